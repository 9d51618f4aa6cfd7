//! A build from start to end: the request checked, the context indexed, then each step of
//! the Dockerfile in turn (FROM, RUN and COPY here; the config's steps in `state.rs`), and
//! the result recorded under its name.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use sbx_actors::{ActorError, BuiltImage, Gateway, ImageScope, ImageSelector, ImageWriter, Result};
use sbx_images::{ImageInfo, PullOptions};
use sbx_proto::v1::Image;
use tokio::sync::mpsc;
use uuid::Uuid;

use crate::context::{self, Context, CopySpec};
use crate::dockerfile::{self, Form, Parsed, Step};
use crate::run::RunStep;
use crate::state::{State, refuse, sha256_hex};
use crate::{Build, BuildEvent, BuildRequest};

/// Removes a file when dropped.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Builds an image (see the crate docs); `events` hears each step and each RUN's output.
pub(crate) async fn build_image(
    gateway: &Gateway,
    req: BuildRequest,
    events: mpsc::Sender<BuildEvent>,
) -> Result<Image> {
    let steps = dockerfile::parse(&req.dockerfile)?;
    refuse_undeclared_args(&steps, &req)?;
    let allowance = allowance(&req)?;
    let context = Arc::new(match &req.context {
        Some(path) => {
            let path = path.clone();
            tokio::task::spawn_blocking(move || Context::index(&path))
                .await
                .map_err(|e| ActorError::Internal(format!("context index task: {e}")))??
        }
        None => Context::empty(),
    });
    let (spool, _) = gateway.image_spool()?;
    let scope = gateway.image_scope(req.workspace.as_deref(), false).await?;
    let ImageScope::Workspace(workspace_id) = scope else {
        return Err(ActorError::Internal(
            "a build's scope is a workspace".into(),
        ));
    };
    let build = Build {
        gateway,
        req: &req,
        events: &events,
        scope,
        workspace_id,
        spool,
        context,
        allowance,
        build_id: Uuid::new_v4().simple().to_string()[..8].to_string(),
        count: steps.len() as u32,
        cache_ids: Default::default(),
    };
    let mut state = State::new();
    for (i, parsed) in steps.iter().enumerate() {
        if req.cancel.is_cancelled() {
            return Err(ActorError::FailedPrecondition(
                "the build's caller went away".into(),
            ));
        }
        build.step(&mut state, i as u32 + 1, parsed).await?;
    }
    build.finish(state).await
}

/// A `--build-arg` the Dockerfile declares no ARG for is refused (as Docker warns).
fn refuse_undeclared_args(steps: &[Parsed], req: &BuildRequest) -> Result<()> {
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
    Ok(())
}

/// What a RUN may reach is part of its key: a step run with network may have fetched what
/// the same step without could not, and the other way round. In normal form (sorted, without
/// duplicates, names lowercase): the same allowance is the same key.
fn allowance(req: &BuildRequest) -> Result<String> {
    let allowance: Vec<String> = sbx_network::parse_allowlist(&req.allow)
        .map_err(|e| ActorError::InvalidArgument(format!("--allow: {e}")))?
        .iter()
        .map(ToString::to_string)
        .collect();
    Ok(allowance.join("\n"))
}

impl Build<'_> {
    /// Tells the caller; a caller that went away stops hearing (the build ends at its next
    /// await that fails, or finishes and is cached).
    pub(crate) async fn say(&self, event: BuildEvent) {
        let _ = self.events.send(event).await;
    }

    /// One step of the Dockerfile, the `index`th.
    async fn step(&self, state: &mut State, index: u32, parsed: &Parsed) -> Result<()> {
        let step_event = |cached: bool| BuildEvent::Step {
            index,
            count: self.count,
            text: parsed.text.clone(),
            cached,
        };
        let line = parsed.line;
        match &parsed.step {
            Step::From(image) => {
                self.say(step_event(false)).await;
                self.from(state, image).await
            }
            Step::Run(form) => self.run(state, form, line, index, &step_event).await,
            Step::Copy {
                sources,
                dest,
                chown,
                chmod,
                add,
            } => {
                let copy = copy_spec(state, sources, dest, chown, chmod, *add, line)?;
                self.copy(state, &copy, line, &step_event).await
            }
            config => {
                self.say(step_event(false)).await;
                state.configure(config, line, &self.req.build_args)
            }
        }
    }

    /// FROM: the base image (none for `scratch`) and its config; the keys start over from it
    /// and the build's workspace.
    async fn from(&self, state: &mut State, image: &str) -> Result<()> {
        let reference = dockerfile::expand(image, &state.args)?;
        state.image = self.base(&reference).await?;
        state.config = state
            .image
            .as_ref()
            .map(|i| i.config.clone())
            .unwrap_or_default();
        state.committed = state.image.is_some();
        // The workspace roots the keys: no build sees another workspace's steps.
        state.key = sha256_hex(&[
            b"sbx-build/2",
            self.workspace_id.as_bytes(),
            state
                .image
                .as_ref()
                .map_or("scratch", |i| &i.digest)
                .as_bytes(),
        ]);
        // ARGs before FROM are for FROM only, unless declared again after it (then with the
        // value they had before FROM, as Docker does).
        state.global_args = std::mem::take(&mut state.args);
        Ok(())
    }

    /// RUN: from the cache when its key is there, else run in a sandbox and its changes kept
    /// as the next image.
    async fn run(
        &self,
        state: &mut State,
        form: &Form,
        line: usize,
        index: u32,
        step_event: &(dyn Fn(bool) -> BuildEvent + Sync),
    ) -> Result<()> {
        let argv = form.argv(&state.shell);
        let run_env: Vec<(String, String)> = state
            .args
            .iter()
            .filter(|(k, _)| {
                !state
                    .config
                    .env
                    .iter()
                    .any(|kv| kv.split_once('=').map_or(kv.as_str(), |(n, _)| n) == k.as_str())
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        self.commit(state).await?;
        let before = state.key.clone();
        state.advance(&[
            b"RUN",
            format!("{argv:?}").as_bytes(),
            format!("{run_env:?}").as_bytes(),
            b"allow",
            self.allowance.as_bytes(),
        ]);
        if !self.req.no_cache && self.take_cached(state).await? {
            self.say(step_event(true)).await;
            return Ok(());
        }
        self.say(step_event(false)).await;
        let base = state.image.clone().ok_or_else(|| {
            refuse(
                line,
                "RUN in an image FROM scratch: it has no shell to run; COPY one in first",
            )
        })?;
        let layer = self.layer_path();
        let _layer = TempFile(layer.clone());
        let run = RunStep {
            cancel: self.req.cancel.clone(),
            line,
            argv,
            env: run_env,
            image: base.digest.clone(),
            base_size: base.size,
            name: format!("build-{}-{index}", self.build_id),
        };
        self.run_in_sandbox(&run, &layer).await?;
        let info = self.derive(state, Some(base), &layer).await?;
        tracing::debug!(before, key = %state.key, digest = %info.digest, "build step kept");
        state.took(info);
        Ok(())
    }

    /// COPY and ADD: the layer made from the context; from the cache when its key is there.
    async fn copy(
        &self,
        state: &mut State,
        copy: &CopySpec,
        line: usize,
        step_event: &(dyn Fn(bool) -> BuildEvent + Sync),
    ) -> Result<()> {
        let layer = self.layer_path();
        let _layer = TempFile(layer.clone());
        let digest = self
            .copy_layer(copy, state.image.clone(), &layer)
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
        if !self.req.no_cache && self.take_cached(state).await? {
            self.say(step_event(true)).await;
            return Ok(());
        }
        self.say(step_event(false)).await;
        let info = self.derive(state, state.image.clone(), &layer).await?;
        state.took(info);
        Ok(())
    }

    /// The last step's config committed, and the image recorded under the build's name (in
    /// the workspace, or the gateway's when published).
    async fn finish(&self, mut state: State) -> Result<Image> {
        let req = self.req;
        self.commit(&mut state).await?;
        let info = state.image.ok_or_else(|| {
            ActorError::InvalidArgument(
                "FROM scratch and nothing after it: the image would be empty".into(),
            )
        })?;
        let into = match req.publish {
            true => ImageScope::Gateway,
            false => self.scope,
        };
        match &req.name {
            Some(name) => {
                let built = BuiltImage {
                    into,
                    writer: ImageWriter::Client,
                    build_cache: self.cache_entries(),
                };
                self.gateway
                    .tag_image(name, &info, built, req.cancel.clone())
                    .await
            }
            // This build's image, whatever another build re-tagged meanwhile.
            None if req.cancel.is_cancelled() => Err(ActorError::FailedPrecondition(
                "the build was cancelled".into(),
            )),
            None => Ok(sbx_actors::image_message(&info, 0)),
        }
    }

    /// FROM: the image a reference names, pulled first when the store lacks it; None for
    /// `scratch`.
    async fn base(&self, reference: &str) -> Result<Option<ImageInfo>> {
        if reference == "scratch" {
            return Ok(None);
        }
        let selector = ImageSelector::parse("", reference)?;
        let image = match self.gateway.get_image(&selector, self.scope).await {
            Ok(image) => image,
            Err(ActorError::ImageNotFound(_)) => {
                self.say(BuildEvent::Log {
                    data: format!("{reference} is not in the image store: pulling it\n")
                        .into_bytes(),
                    stderr: true,
                })
                .await;
                self.gateway
                    .pull_image(
                        reference,
                        &PullOptions::default(),
                        &|_| {},
                        self.scope,
                        self.req.cancel.clone(),
                    )
                    .await?
            }
            Err(e) => return Err(e),
        };
        self.gateway.image_content(&image.digest).await.map(Some)
    }

    /// A fresh path for a step's layer, in the spool.
    fn layer_path(&self) -> PathBuf {
        self.spool.join(format!("build-{}.tar", Uuid::new_v4()))
    }

    /// A COPY's layer written to `out` (off the runtime: it reads and writes files); its
    /// digest of what it holds.
    async fn copy_layer(
        &self,
        copy: &CopySpec,
        parent: Option<ImageInfo>,
        out: &Path,
    ) -> Result<String> {
        let store = self.gateway.image_content_store()?;
        let (context, copy, out) = (self.context.clone(), copy.clone(), out.to_path_buf());
        tokio::task::spawn_blocking(move || {
            let lookup = |path: &str| -> sbx_images::build::Result<context::ParentDir> {
                match &parent {
                    Some(info) => Ok(store.lookup(info, path)?),
                    None => Ok(None),
                }
            };
            context.copy_layer(&copy, &lookup, &out)
        })
        .await
        .map_err(|e| ActorError::Internal(format!("COPY layer task: {e}")))?
        .map_err(ActorError::from)
    }
}

/// A COPY's words expanded: its sources (an ADD's checked again once expanded), its
/// destination made absolute, its owner and mode.
fn copy_spec(
    state: &State,
    sources: &[String],
    dest: &str,
    chown: &Option<String>,
    chmod: &Option<String>,
    add: bool,
    line: usize,
) -> Result<CopySpec> {
    let vars = state.vars();
    let mut expanded = Vec::new();
    for s in sources {
        let s = dockerfile::expand(s, &vars)?;
        if add {
            dockerfile::refuse_add_source(line, &s)?;
        }
        expanded.push(s);
    }
    let dest = state.absolute(&dockerfile::expand(dest, &vars)?);
    let (uid, gid) = match chown {
        Some(c) => context::chown(&dockerfile::expand(c, &vars)?)?,
        None => (0, 0),
    };
    Ok(CopySpec {
        sources: expanded,
        dest,
        uid,
        gid,
        mode: chmod.as_deref().map(context::chmod).transpose()?,
    })
}
