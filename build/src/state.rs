//! The build's state between steps: the image so far, the config the next image gets, the
//! cache key, the ARGs in scope; and the steps that change the config only (ENV, ARG,
//! WORKDIR, USER, ENTRYPOINT, CMD, LABEL, EXPOSE, SHELL).

use std::collections::BTreeMap;

use sbx_actors::{ActorError, Result};
use sbx_images::ImageConfig;
use sbx_images::ImageInfo;

use crate::dockerfile::{self, Step};

/// The build's state between steps.
pub(crate) struct State {
    /// The image so far (None: FROM scratch, nothing made yet).
    pub(crate) image: Option<ImageInfo>,
    /// The config the next image gets.
    pub(crate) config: ImageConfig,
    /// Whether `image` already has `config`.
    pub(crate) committed: bool,
    pub(crate) key: String,
    /// ARG values in scope (declared, with their value).
    pub(crate) args: BTreeMap<String, String>,
    /// The ARGs declared before FROM, with their values.
    pub(crate) global_args: BTreeMap<String, String>,
    /// Whether this Dockerfile set CMD (an ENTRYPOINT after it keeps it).
    pub(crate) cmd_set: bool,
    pub(crate) shell: Vec<String>,
}

impl State {
    /// ENV and ARG values, ENV winning: what `$VAR` expands to.
    pub(crate) fn vars(&self) -> BTreeMap<String, String> {
        let mut vars = self.args.clone();
        for kv in &self.config.env {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            vars.insert(k.to_string(), v.to_string());
        }
        vars
    }

    pub(crate) fn set_env(&mut self, key: &str, value: &str) {
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
    pub(crate) fn took(&mut self, info: ImageInfo) {
        self.key = sha256_hex(&[b"image", info.digest.as_bytes()]);
        self.image = Some(info);
        self.committed = true;
    }

    pub(crate) fn advance(&mut self, what: &[&[u8]]) {
        let mut parts: Vec<&[u8]> = vec![self.key.as_bytes()];
        parts.extend_from_slice(what);
        self.key = sha256_hex(&parts);
    }

    /// A path the Dockerfile gives, made absolute against WORKDIR, `.` and `..` resolved
    /// by name (`..` stops at `/`); a trailing `/` or `/.` is kept (it says "a directory").
    pub(crate) fn absolute(&self, path: &str) -> String {
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

impl State {
    /// The state a build starts from: nothing yet, `/bin/sh -c` as the shell.
    pub(crate) fn new() -> State {
        State {
            image: None,
            config: ImageConfig::default(),
            committed: false,
            key: String::new(),
            args: BTreeMap::new(),
            global_args: BTreeMap::new(),
            cmd_set: false,
            shell: vec!["/bin/sh".into(), "-c".into()],
        }
    }

    /// A step that changes the config only, its key advanced by what it set.
    pub(crate) fn configure(
        &mut self,
        step: &Step,
        line: usize,
        build_args: &BTreeMap<String, String>,
    ) -> Result<()> {
        match step {
            Step::Arg(text) => {
                let vars = self.vars();
                for (name, default) in dockerfile::pairs(text, &vars, false)? {
                    let value = match (build_args.get(&name), default) {
                        (Some(v), _) => v.clone(),
                        (None, Some(d)) => d,
                        (None, None) => self.global_args.get(&name).cloned().unwrap_or_default(),
                    };
                    self.advance(&[b"ARG", name.as_bytes(), value.as_bytes()]);
                    self.args.insert(name, value);
                }
            }
            Step::Env(text) => {
                for (k, v) in dockerfile::pairs(text, &self.vars(), true)? {
                    let Some(v) = v else {
                        return Err(refuse(line, format!("ENV {k} has no value")));
                    };
                    self.set_env(&k, &v);
                }
                self.advance(&[b"ENV", format!("{:?}", self.config.env).as_bytes()]);
            }
            Step::Workdir(path) => {
                let path = dockerfile::expand(path, &self.vars())?;
                let dir = self.absolute(&path);
                self.config.working_dir = match dir.len() > 1 {
                    true => dir.trim_end_matches('/').to_string(),
                    false => dir,
                };
                self.committed = false;
                self.advance(&[b"WORKDIR", self.config.working_dir.clone().as_bytes()]);
            }
            Step::User(user) => {
                self.config.user = dockerfile::expand(user, &self.vars())?;
                self.committed = false;
                self.advance(&[b"USER", self.config.user.clone().as_bytes()]);
            }
            Step::Entrypoint(form) => {
                self.config.entrypoint = form.argv(&self.shell);
                // As Docker: a new ENTRYPOINT drops the CMD the base image had (not one this
                // Dockerfile set).
                if !self.cmd_set {
                    self.config.cmd.clear();
                }
                self.committed = false;
                self.advance(&[b"ENTRYPOINT", format!("{form:?}").as_bytes()]);
            }
            Step::Cmd(form) => {
                self.config.cmd = form.argv(&self.shell);
                self.cmd_set = true;
                self.committed = false;
                self.advance(&[b"CMD", format!("{form:?}").as_bytes()]);
            }
            Step::Label(text) => {
                for (k, v) in dockerfile::pairs(text, &self.vars(), true)? {
                    self.config.labels.insert(k, v.unwrap_or_default());
                }
                self.committed = false;
                self.advance(&[b"LABEL", format!("{:?}", self.config.labels).as_bytes()]);
            }
            Step::Expose(ports) => self.expose(ports)?,
            Step::Shell(shell) => {
                self.shell = shell.clone();
                self.advance(&[b"SHELL", format!("{shell:?}").as_bytes()]);
            }
            // Not the config's: `steps.rs` takes them before asking here.
            Step::From(_) | Step::Run(_) | Step::Copy { .. } => {}
        }
        Ok(())
    }

    /// EXPOSE: each port (`/tcp` unless it names a protocol) once.
    fn expose(&mut self, ports: &[String]) -> Result<()> {
        for p in ports {
            let p = dockerfile::expand(p, &self.vars())?;
            let p = if p.contains('/') {
                p
            } else {
                format!("{p}/tcp")
            };
            if !self.config.exposed_ports.contains(&p) {
                self.config.exposed_ports.push(p);
            }
        }
        self.committed = false;
        self.advance(&[
            b"EXPOSE",
            format!("{:?}", self.config.exposed_ports).as_bytes(),
        ]);
        Ok(())
    }
}

/// A Dockerfile line's error: the caller's to fix.
pub(crate) fn refuse(line: usize, why: impl std::fmt::Display) -> ActorError {
    ActorError::InvalidArgument(format!("Dockerfile line {line}: {why}"))
}

/// The sha256 of `parts`, each after its length (no two lists hash alike), in hex.
pub(crate) fn sha256_hex(parts: &[&[u8]]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        ctx.update(&(p.len() as u64).to_be_bytes());
        ctx.update(p);
    }
    hex::encode(ctx.finish().as_ref())
}
