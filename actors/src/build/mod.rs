//! `BuildImage`: an image from a Dockerfile, built by the gateway with its own parts.
//!
//! - The Dockerfile is parsed by `parse-dockerfile` ([`dockerfile`]); FROM names an image
//!   of the store (pulled first when the store lacks it) or `scratch`.
//! - Each RUN runs in a sandbox of the caller's workspace, created through the same path as
//!   any other (the driver's boundary, the workspace's limits, no network unless the build's
//!   `allow` admits some), from an image holding the build's state so far (its Env,
//!   WorkingDir and User are the Dockerfile's). Its output is streamed to the caller. Once it
//!   has ended with status 0, what it changed in its root filesystem is read from the driver
//!   as an OCI layer (`CopyFromRequest.changes`) and becomes the next image's top layer; the
//!   sandbox is deleted however the step ends (and carries a ttl that deletes it should the
//!   gateway die first).
//! - COPY and ADD make their layer from the build context, without running anything
//!   ([`context`]).
//! - ENV, ARG, WORKDIR, USER, ENTRYPOINT, CMD, LABEL, EXPOSE and SHELL change the config only.
//!
//! **Cache.** Every step has a key: the sha256 of the key before it and of what the step is
//! (its text, the ARG values it sees, for RUN the network the build allows it in normal form,
//! for COPY the layer it makes); the first key is the base image's digest. An image a step made is recorded as `sbx.local/build-cache:<key>`, and a
//! step whose key names an image already is answered from it without running. So a second
//! build of the same Dockerfile and context runs nothing, and a change re-runs the steps from
//! the first that sees it. The cache images are ordinary images (`sbx image list` shows them,
//! `sbx image delete` removes them).

pub mod context;
pub mod dockerfile;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_images::{ImageConfig, ImageInfo, PullOptions};
use sbx_proto::v1::{
    Image, Lifetime, LifetimeAction, LogStream, NetworkMode, NetworkPolicy, Phase, SandboxSpec,
};
use tokio::sync::mpsc;

use crate::api::{Gateway, LogOptions};
use crate::error::{ActorError, Result};
use crate::images::ImageSelector;
use crate::validate::SandboxSelector;
use dockerfile::Step;

/// The label a build's RUN sandboxes carry (its value: the sandbox's name); no exec, copy
/// into or forward reaches a sandbox with it.
pub const BUILD_LABEL: &str = "sbx.build";
/// The name cache images are recorded under (the key as the tag).
pub const CACHE_REPOSITORY: &str = "sbx.local/build-cache";
/// The longest one RUN may take unless the request says otherwise.
pub const DEFAULT_RUN_TIMEOUT: Duration = Duration::from_secs(30 * 60);
/// How often a running RUN's sandbox is looked at.
const POLL: Duration = Duration::from_millis(100);

/// What a build is asked.
#[derive(Debug, Clone, Default)]
pub struct BuildRequest {
    pub workspace: Option<String>,
    pub name: Option<String>,
    pub dockerfile: String,
    pub build_args: BTreeMap<String, String>,
    pub allow: Vec<String>,
    pub no_cache: bool,
    pub driver: String,
    pub run_timeout: Option<Duration>,
    /// The context tar, spooled (None: no context; a COPY then finds nothing).
    pub context: Option<PathBuf>,
    /// Cancelled when the build's caller went away: the running RUN's sandbox is deleted and
    /// the build ends there.
    pub cancel: tokio_util::sync::CancellationToken,
}

/// What a build says while it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildEvent {
    Step {
        index: u32,
        count: u32,
        text: String,
        cached: bool,
    },
    Log {
        data: Vec<u8>,
        stderr: bool,
    },
}

fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        ctx.update(&(p.len() as u64).to_be_bytes());
        ctx.update(p);
    }
    hex::encode(ctx.finish().as_ref())
}

fn cache_name(key: &str) -> String {
    format!("{CACHE_REPOSITORY}:{key}")
}

/// Removes a file when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The build's state between steps.
struct State {
    /// The image so far (None: FROM scratch, nothing made yet).
    image: Option<ImageInfo>,
    /// The config the next image gets.
    config: ImageConfig,
    /// Whether `image` already has `config`.
    committed: bool,
    key: String,
    /// ARG values in scope (declared, with their value).
    args: BTreeMap<String, String>,
    /// The ARGs declared before FROM, with their values.
    global_args: BTreeMap<String, String>,
    /// Whether this Dockerfile set CMD (an ENTRYPOINT after it keeps it).
    cmd_set: bool,
    shell: Vec<String>,
}

impl State {
    /// ENV and ARG values, ENV winning: what `$VAR` expands to.
    fn vars(&self) -> BTreeMap<String, String> {
        let mut vars = self.args.clone();
        for kv in &self.config.env {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            vars.insert(k.to_string(), v.to_string());
        }
        vars
    }

    fn set_env(&mut self, key: &str, value: &str) {
        let entry = format!("{key}={value}");
        match self
            .config
            .env
            .iter_mut()
            .find(|kv| kv.split_once('=').map_or(kv.as_str(), |(k, _)| k) == key)
        {
            Some(slot) => *slot = entry,
            None => self.config.env.push(entry),
        }
        self.committed = false;
    }

    /// The image a step ended with (run or from the cache) roots the keys after it: a step
    /// run again (`--no-cache`, a cache entry gone) that made another image changes every
    /// key after it, so nothing later is taken from the cache on the old one.
    fn took(&mut self, info: ImageInfo) {
        self.key = sha256_hex(&[b"image", info.digest.as_bytes()]);
        self.image = Some(info);
        self.committed = true;
    }

    fn advance(&mut self, what: &[&[u8]]) {
        let mut parts: Vec<&[u8]> = vec![self.key.as_bytes()];
        parts.extend_from_slice(what);
        self.key = sha256_hex(&parts);
    }

    /// A path the Dockerfile gives, made absolute against WORKDIR, `.` and `..` resolved
    /// by name (`..` stops at `/`); a trailing `/` or `/.` is kept (it says "a directory").
    fn absolute(&self, path: &str) -> String {
        let base = match self.config.working_dir.as_str() {
            "" => "/",
            w => w,
        };
        let joined = match path.starts_with('/') {
            true => path.to_string(),
            false => format!("{base}/{path}"),
        };
        let mut parts: Vec<&str> = Vec::new();
        for part in joined.split('/') {
            match part {
                "" | "." => {}
                ".." => {
                    parts.pop();
                }
                p => parts.push(p),
            }
        }
        let mut out = format!("/{}", parts.join("/"));
        let says_dir = path.ends_with('/') || path.ends_with("/.") || path == "." || path == "..";
        if says_dir && !out.ends_with('/') {
            out.push('/');
        }
        out
    }
}

impl Gateway {
    /// Builds an image (see the module docs); `events` hears each step and each RUN's output.
    pub async fn build_image(
        &self,
        req: BuildRequest,
        events: mpsc::Sender<BuildEvent>,
    ) -> Result<Image> {
        let steps = dockerfile::parse(&req.dockerfile)?;
        let declared: Vec<String> = steps
            .iter()
            .filter_map(|p| match &p.step {
                Step::Arg(text) => dockerfile::pairs(text, &BTreeMap::new(), false)
                    .ok()
                    .map(|pairs| pairs.into_iter().map(|(k, _)| k).collect::<Vec<_>>()),
                _ => None,
            })
            .flatten()
            .collect();
        if let Some(unknown) = req.build_args.keys().find(|k| !declared.contains(k)) {
            return Err(ActorError::InvalidArgument(format!(
                "--build-arg {unknown}: the Dockerfile declares no ARG {unknown}"
            )));
        }
        // What a RUN may reach is part of its key: a step run with network may have fetched
        // what the same step without could not, and the other way round. In normal form
        // (sorted, without duplicates, names lowercase): the same allowance is the same key.
        let allowance: Vec<String> = sbx_network::parse_allowlist(&req.allow)
            .map_err(|e| ActorError::InvalidArgument(format!("--allow: {e}")))?
            .iter()
            .map(ToString::to_string)
            .collect();
        let allowance = allowance.join("\n");
        let context = std::sync::Arc::new(match &req.context {
            Some(path) => {
                let path = path.clone();
                tokio::task::spawn_blocking(move || context::Context::index(&path))
                    .await
                    .map_err(|e| ActorError::Internal(format!("context index task: {e}")))??
            }
            None => context::Context::empty(),
        });
        let (spool, _) = self.images.spool()?;
        let count = steps.len() as u32;
        let mut state = State {
            image: None,
            config: ImageConfig::default(),
            committed: false,
            key: String::new(),
            args: BTreeMap::new(),
            global_args: BTreeMap::new(),
            cmd_set: false,
            shell: vec!["/bin/sh".into(), "-c".into()],
        };
        let say = |e: BuildEvent| {
            let events = events.clone();
            async move {
                // A caller that went away stops hearing; the build ends at its next await
                // that fails, or finishes and is cached.
                let _ = events.send(e).await;
            }
        };
        let build_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
        for (i, parsed) in steps.iter().enumerate() {
            if req.cancel.is_cancelled() {
                return Err(ActorError::FailedPrecondition(
                    "the build's caller went away".into(),
                ));
            }
            let index = i as u32 + 1;
            let step_event = |cached: bool| BuildEvent::Step {
                index,
                count,
                text: parsed.text.clone(),
                cached,
            };
            let line = parsed.line;
            match &parsed.step {
                Step::From(image) => {
                    say(step_event(false)).await;
                    let reference = dockerfile::expand(image, &state.args)?;
                    state.image = self.build_base(&reference, &events).await?;
                    state.config = state
                        .image
                        .as_ref()
                        .map(|i| i.config.clone())
                        .unwrap_or_default();
                    state.committed = state.image.is_some();
                    state.key = sha256_hex(&[
                        b"sbx-build/1",
                        state
                            .image
                            .as_ref()
                            .map_or("scratch", |i| &i.digest)
                            .as_bytes(),
                    ]);
                    // ARGs before FROM are for FROM only, unless declared again after it
                    // (then with the value they had before FROM, as Docker does).
                    state.global_args = std::mem::take(&mut state.args);
                }
                Step::Arg(text) => {
                    say(step_event(false)).await;
                    let vars = state.vars();
                    for (name, default) in dockerfile::pairs(text, &vars, false)? {
                        let value = match (req.build_args.get(&name), default) {
                            (Some(v), _) => v.clone(),
                            (None, Some(d)) => d,
                            (None, None) => {
                                state.global_args.get(&name).cloned().unwrap_or_default()
                            }
                        };
                        state.advance(&[b"ARG", name.as_bytes(), value.as_bytes()]);
                        state.args.insert(name, value);
                    }
                }
                Step::Env(text) => {
                    say(step_event(false)).await;
                    for (k, v) in dockerfile::pairs(text, &state.vars(), true)? {
                        let Some(v) = v else {
                            return Err(refuse(line, format!("ENV {k} has no value")));
                        };
                        state.set_env(&k, &v);
                    }
                    state.advance(&[b"ENV", format!("{:?}", state.config.env).as_bytes()]);
                }
                Step::Workdir(path) => {
                    say(step_event(false)).await;
                    let path = dockerfile::expand(path, &state.vars())?;
                    let dir = state.absolute(&path);
                    state.config.working_dir = match dir.len() > 1 {
                        true => dir.trim_end_matches('/').to_string(),
                        false => dir,
                    };
                    state.committed = false;
                    state.advance(&[b"WORKDIR", state.config.working_dir.clone().as_bytes()]);
                }
                Step::User(user) => {
                    say(step_event(false)).await;
                    state.config.user = dockerfile::expand(user, &state.vars())?;
                    state.committed = false;
                    state.advance(&[b"USER", state.config.user.clone().as_bytes()]);
                }
                Step::Entrypoint(form) => {
                    say(step_event(false)).await;
                    state.config.entrypoint = form.argv(&state.shell);
                    // As Docker: a new ENTRYPOINT drops the CMD the base image had (not
                    // one this Dockerfile set).
                    if !state.cmd_set {
                        state.config.cmd.clear();
                    }
                    state.committed = false;
                    state.advance(&[b"ENTRYPOINT", format!("{form:?}").as_bytes()]);
                }
                Step::Cmd(form) => {
                    say(step_event(false)).await;
                    state.config.cmd = form.argv(&state.shell);
                    state.cmd_set = true;
                    state.committed = false;
                    state.advance(&[b"CMD", format!("{form:?}").as_bytes()]);
                }
                Step::Label(text) => {
                    say(step_event(false)).await;
                    for (k, v) in dockerfile::pairs(text, &state.vars(), true)? {
                        state.config.labels.insert(k, v.unwrap_or_default());
                    }
                    state.committed = false;
                    state.advance(&[b"LABEL", format!("{:?}", state.config.labels).as_bytes()]);
                }
                Step::Expose(ports) => {
                    say(step_event(false)).await;
                    for p in ports {
                        let p = dockerfile::expand(p, &state.vars())?;
                        let p = if p.contains('/') {
                            p
                        } else {
                            format!("{p}/tcp")
                        };
                        if !state.config.exposed_ports.contains(&p) {
                            state.config.exposed_ports.push(p);
                        }
                    }
                    state.committed = false;
                    state.advance(&[
                        b"EXPOSE",
                        format!("{:?}", state.config.exposed_ports).as_bytes(),
                    ]);
                }
                Step::Shell(shell) => {
                    say(step_event(false)).await;
                    state.shell = shell.clone();
                    state.advance(&[b"SHELL", format!("{shell:?}").as_bytes()]);
                }
                Step::Run(form) => {
                    let argv = form.argv(&state.shell);
                    let run_env: Vec<(String, String)> = state
                        .args
                        .iter()
                        .filter(|(k, _)| {
                            !state.config.env.iter().any(|kv| {
                                kv.split_once('=').map_or(kv.as_str(), |(n, _)| n) == k.as_str()
                            })
                        })
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect();
                    self.build_commit(&mut state, req.no_cache).await?;
                    let before = state.key.clone();
                    state.advance(&[
                        b"RUN",
                        format!("{argv:?}").as_bytes(),
                        format!("{run_env:?}").as_bytes(),
                        b"allow",
                        allowance.as_bytes(),
                    ]);
                    if !req.no_cache && self.build_from_cache(&mut state).await? {
                        say(step_event(true)).await;
                        continue;
                    }
                    say(step_event(false)).await;
                    let base = state
                        .image
                        .clone()
                        .ok_or_else(|| refuse(line, "RUN in an image FROM scratch: it has no shell to run; COPY one in first"))?;
                    let layer = spool.join(format!("build-{}.tar", uuid::Uuid::new_v4()));
                    let _layer = TempFile(layer.clone());
                    let run = RunStep {
                        cancel: req.cancel.clone(),
                        line,
                        argv,
                        env: run_env,
                        image: base.digest.clone(),
                        base_size: base.size,
                        name: format!("build-{build_id}-{index}"),
                    };
                    self.build_run(&req, &run, &layer, &events).await?;
                    let (_, info) = self
                        .images
                        .derive(
                            &cache_name(&state.key),
                            Some(base),
                            Some(layer.clone()),
                            state.config.clone(),
                        )
                        .await?;
                    tracing::debug!(before, key = %state.key, digest = %info.digest, "build step kept");
                    state.took(info);
                }
                Step::Copy {
                    sources,
                    dest,
                    chown,
                    chmod,
                    add,
                } => {
                    let vars = state.vars();
                    let mut expanded = Vec::new();
                    for s in sources {
                        let s = dockerfile::expand(s, &vars)?;
                        if *add {
                            dockerfile::refuse_add_source(line, &s)?;
                        }
                        expanded.push(s);
                    }
                    let dest = state.absolute(&dockerfile::expand(dest, &vars)?);
                    let (uid, gid) = match chown {
                        Some(c) => context::chown(&dockerfile::expand(c, &vars)?)?,
                        None => (0, 0),
                    };
                    let copy = context::CopySpec {
                        sources: expanded,
                        dest,
                        uid,
                        gid,
                        mode: chmod.as_deref().map(context::chmod).transpose()?,
                    };
                    let layer = spool.join(format!("build-{}.tar", uuid::Uuid::new_v4()));
                    let _layer = TempFile(layer.clone());
                    let digest = self
                        .build_copy_layer(&context, &copy, state.image.clone(), &layer)
                        .await
                        .map_err(|e| match e {
                            ActorError::InvalidArgument(m) => refuse(line, m),
                            e => e,
                        })?;
                    state.advance(&[
                        b"COPY",
                        digest.as_bytes(),
                        format!("{:?}", state.config).as_bytes(),
                    ]);
                    if !req.no_cache && self.build_from_cache(&mut state).await? {
                        say(step_event(true)).await;
                        continue;
                    }
                    say(step_event(false)).await;
                    let (_, info) = self
                        .images
                        .derive(
                            &cache_name(&state.key),
                            state.image.clone(),
                            Some(layer.clone()),
                            state.config.clone(),
                        )
                        .await?;
                    state.took(info);
                }
            }
        }
        self.build_commit(&mut state, req.no_cache).await?;
        let info = state.image.ok_or_else(|| {
            ActorError::InvalidArgument(
                "FROM scratch and nothing after it: the image would be empty".into(),
            )
        })?;
        match &req.name {
            Some(name) => self.images.tag(name, &info).await,
            // This build's image, whatever another build re-tagged meanwhile.
            None => Ok(crate::images::image_message(&info)),
        }
    }

    /// FROM: the image a reference names, pulled first when the store lacks it; None for
    /// `scratch`.
    async fn build_base(
        &self,
        reference: &str,
        events: &mpsc::Sender<BuildEvent>,
    ) -> Result<Option<ImageInfo>> {
        if reference == "scratch" {
            return Ok(None);
        }
        let selector = ImageSelector::parse("", reference)?;
        let image = match self.images.get(&selector).await {
            Ok(image) => image,
            Err(ActorError::ImageNotFound(_)) => {
                let _ = events
                    .send(BuildEvent::Log {
                        data: format!("{reference} is not in the image store: pulling it\n")
                            .into_bytes(),
                        stderr: true,
                    })
                    .await;
                self.images
                    .pull(reference, &PullOptions::default(), &|_| {})
                    .await?
            }
            Err(e) => return Err(e),
        };
        self.images.content_of(&image.digest).await.map(Some)
    }

    /// The image the cache holds for `key`, if its content is still there.
    async fn build_cached(&self, key: &str) -> Result<Option<ImageInfo>> {
        match self.images.get(&ImageSelector::Name(cache_name(key))).await {
            Ok(image) => Ok(self.images.content_of(&image.digest).await.ok()),
            Err(ActorError::ImageNotFound(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Takes the image the cache holds for the state's key, if any (true then).
    async fn build_from_cache(&self, state: &mut State) -> Result<bool> {
        match self.build_cached(&state.key).await? {
            Some(hit) => {
                state.took(hit);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Makes the state's config an image of its own (a RUN runs from it; the result is one).
    async fn build_commit(&self, state: &mut State, no_cache: bool) -> Result<()> {
        if state.committed {
            return Ok(());
        }
        let hit = match no_cache {
            true => None,
            false => self.build_cached(&state.key).await?,
        };
        if let Some(hit) = hit {
            state.image = Some(hit);
        } else {
            let (_, info) = self
                .images
                .derive(
                    &cache_name(&state.key),
                    state.image.clone(),
                    None,
                    state.config.clone(),
                )
                .await?;
            state.image = Some(info);
        }
        state.committed = true;
        Ok(())
    }

    async fn build_copy_layer(
        &self,
        context: &std::sync::Arc<context::Context>,
        copy: &context::CopySpec,
        parent: Option<ImageInfo>,
        out: &Path,
    ) -> Result<String> {
        let store = self.images.content_store()?;
        let (context, copy, out) = (context.clone(), copy.clone(), out.to_path_buf());
        tokio::task::spawn_blocking(move || {
            let lookup = |path: &str| -> Result<context::ParentDir> {
                match &parent {
                    Some(info) => store.lookup(info, path).map_err(ActorError::from),
                    None => Ok(None),
                }
            };
            context.copy_layer(&copy, &lookup, &out)
        })
        .await
        .map_err(|e| ActorError::Internal(format!("COPY layer task: {e}")))?
    }

    /// One RUN: a sandbox from `run.image` running `run.argv`, its output to `events`, its
    /// changes to `layer`; deleted however it ends.
    async fn build_run(
        &self,
        req: &BuildRequest,
        run: &RunStep,
        layer: &Path,
        events: &mpsc::Sender<BuildEvent>,
    ) -> Result<()> {
        let timeout = req.run_timeout.unwrap_or(DEFAULT_RUN_TIMEOUT);
        let network = match req.allow.is_empty() {
            true => NetworkPolicy {
                mode: NetworkMode::None as i32,
                allow: Vec::new(),
            },
            false => NetworkPolicy {
                mode: NetworkMode::Policy as i32,
                allow: req.allow.clone(),
            },
        };
        let spec = SandboxSpec {
            command: run.argv.clone(),
            env: run.env.iter().cloned().collect(),
            labels: [(BUILD_LABEL.to_string(), run.name.clone())].into(),
            driver: req.driver.clone(),
            image: run.image.clone(),
            network: Some(network),
            // Should the gateway die mid-step, the sandbox still goes.
            lifetime: Some(Lifetime {
                ttl_seconds: timeout.as_secs() + 600,
                on_ttl: LifetimeAction::Delete as i32,
                ..Default::default()
            }),
            ..Default::default()
        };
        let sandbox = self
            .create_sandbox(req.workspace.as_deref(), &run.name, spec)
            .await
            .map_err(|e| refuse_run(run.line, e))?;
        let sel = SandboxSelector::Id(
            uuid::Uuid::parse_str(&sandbox.id)
                .map_err(|e| ActorError::Internal(format!("a sandbox id: {e}")))?,
        );
        let outcome = self.build_run_in(&sel, run, layer, timeout, events).await;
        if let Err(e) = self.delete_sandbox(&sel).await {
            tracing::warn!(sandbox = %sandbox.id, error = %e, "a build step's sandbox was not deleted; its ttl will");
        }
        outcome
    }

    async fn build_run_in(
        &self,
        sel: &SandboxSelector,
        run: &RunStep,
        layer: &Path,
        timeout: Duration,
        events: &mpsc::Sender<BuildEvent>,
    ) -> Result<()> {
        let started = Instant::now();
        // The output as it comes; what the follow had not delivered at the end is read after.
        let counted = std::sync::Arc::new(std::sync::Mutex::new([0usize; 2]));
        let follow = self
            .logs(
                sel,
                LogOptions {
                    follow: true,
                    tail_lines: 0,
                    timestamps: false,
                    since: None,
                },
            )
            .await;
        let follower = {
            let events = events.clone();
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut stream) = follow else {
                    return;
                };
                while let Some(Ok(chunk)) = stream.next().await {
                    let stderr = chunk.stream == LogStream::Stderr as i32;
                    let len = chunk.data.len();
                    if events
                        .send(BuildEvent::Log {
                            data: chunk.data,
                            stderr,
                        })
                        .await
                        .is_err()
                    {
                        return;
                    }
                    // Counted once passed on: an abort in the send leaves it to the re-read.
                    counted.lock().unwrap_or_else(|p| p.into_inner())[stderr as usize] += len;
                }
            })
        };
        let ended = loop {
            let sandbox = self.get_sandbox(sel).await?;
            match Phase::try_from(sandbox.phase).unwrap_or(Phase::Unspecified) {
                Phase::Completed | Phase::Error | Phase::Stopped => break sandbox,
                _ => {}
            }
            if run.cancel.is_cancelled() {
                follower.abort();
                return Err(ActorError::FailedPrecondition(format!(
                    "RUN at line {}: the build's caller went away",
                    run.line
                )));
            }
            if started.elapsed() > timeout {
                follower.abort();
                return Err(ActorError::FailedPrecondition(format!(
                    "RUN at line {} ran past its {} s (`--run-timeout`)",
                    run.line,
                    timeout.as_secs()
                )));
            }
            tokio::select! {
                () = tokio::time::sleep(POLL) => {}
                () = run.cancel.cancelled() => {}
            }
        };
        follower.abort();
        let _ = follower.await;
        // The rest of the log: the whole of it, past what the follow passed on.
        let seen = *counted.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(mut stream) = self
            .logs(
                sel,
                LogOptions {
                    follow: false,
                    tail_lines: 0,
                    timestamps: false,
                    since: None,
                },
            )
            .await
        {
            let mut read = [0usize; 2];
            while let Some(Ok(chunk)) = stream.next().await {
                let stderr = chunk.stream == LogStream::Stderr as i32;
                let at = read[stderr as usize];
                read[stderr as usize] += chunk.data.len();
                let skip = seen[stderr as usize]
                    .saturating_sub(at)
                    .min(chunk.data.len());
                if skip < chunk.data.len() {
                    let _ = events
                        .send(BuildEvent::Log {
                            data: chunk.data[skip..].to_vec(),
                            stderr,
                        })
                        .await;
                }
            }
        }
        if Phase::try_from(ended.phase) != Ok(Phase::Completed) {
            let why = match (ended.exit_code, ended.exit_signal) {
                (_, s) if s > 0 => format!("was killed by signal {s}"),
                (Some(code), _) => format!("exited with code {code}"),
                (None, _) => format!("failed: {}", ended.message),
            };
            return Err(ActorError::FailedPrecondition(format!(
                "RUN at line {} {why}: {}",
                run.line,
                shown_argv(&run.argv)
            )));
        }
        // Bounded as a pulled image is (`--image-max-size`, the base's layers counted): a
        // sparse file of terabytes costs the sandbox nothing, its layer would fill the
        // gateway's disk. Each entry is paid for from its header, before its data is written.
        let refused = |e: sbx_images::ImageError| match e {
            sbx_images::ImageError::TooLarge { image, why, limit } => ActorError::Image {
                kind: crate::error::ImageFailure::TooLarge,
                message: format!("{image}: {why} (the limit: {limit})"),
            },
            // The driver's tar is ours: one the meter cannot read is a bug.
            e => ActorError::Internal(format!("the layer of RUN at line {}: {e}", run.line)),
        };
        let mut budget = self
            .images
            .content_store()?
            .limits()
            .budget(&format!("the image of RUN at line {}", run.line));
        budget.take_cached(run.base_size).map_err(refused)?;
        let mut meter = sbx_images::LayerMeter::new(budget);
        let mut stream = self.copy_changes(sel).await?;
        let mut file = tokio::fs::File::create_new(layer)
            .await
            .map_err(|e| ActorError::Internal(format!("creating a layer: {e}")))?;
        use tokio::io::AsyncWriteExt;
        while let Some(chunk) = stream.next().await {
            let data = match chunk {
                Ok(chunk) => chunk.data,
                // What the sandbox made that a layer cannot say (a `.wh.` name…).
                Err(ActorError::Driver(sbx_driver_api::DriverError::FailedPrecondition(m))) => {
                    return Err(ActorError::FailedPrecondition(format!(
                        "RUN at line {}: {m}",
                        run.line
                    )));
                }
                Err(e) => return Err(e),
            };
            meter.feed(&data).map_err(refused)?;
            file.write_all(&data)
                .await
                .map_err(|e| ActorError::Internal(format!("writing a layer: {e}")))?;
        }
        file.sync_all()
            .await
            .map_err(|e| ActorError::Internal(format!("writing a layer: {e}")))?;
        Ok(())
    }
}

/// One RUN to run.
struct RunStep {
    cancel: tokio_util::sync::CancellationToken,
    line: usize,
    argv: Vec<String>,
    env: Vec<(String, String)>,
    image: String,
    /// What the image's layers take before this step's (their sizes, as a manifest says).
    base_size: u64,
    name: String,
}

fn shown_argv(argv: &[String]) -> String {
    let line = argv.join(" ");
    match line.char_indices().nth(200) {
        Some((i, _)) => format!("{}…", &line[..i]),
        None => line,
    }
}

fn refuse(line: usize, why: impl std::fmt::Display) -> ActorError {
    ActorError::InvalidArgument(format!("Dockerfile line {line}: {why}"))
}

fn refuse_run(line: usize, e: ActorError) -> ActorError {
    match e {
        ActorError::InvalidArgument(m) => refuse(line, format!("RUN: {m}")),
        ActorError::FailedPrecondition(m) => {
            ActorError::FailedPrecondition(format!("Dockerfile line {line}: RUN: {m}"))
        }
        e => e,
    }
}
