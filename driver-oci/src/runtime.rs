//! The OCI runtime's command line (`runc`, or another runtime with the same commands such as
//! `crun`), with its state kept under the driver's own `--root`.
//!
//! Only the calls that need the runtime go through it: `run -d` (create and start, detached,
//! the container's stdio being the files the driver hands it), `delete --force` (kill what is
//! left, remove the cgroup and the runtime state), `pause` and `resume` (the cgroup freezer)
//! and `list` (re-discovery at open); exec goes
//! through the sandbox's agent, not the runtime. Signals to the container's init go straight to its pid, after its identity (pid and
//! start time) is checked: cheaper than a runtime call, and just as safe.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::Deserialize;

use sbx_driver_api::DriverError;

/// A runtime binary and the state directory it keeps its containers in.
#[derive(Debug, Clone)]
pub struct Runtime {
    pub binary: PathBuf,
    pub root: PathBuf,
}

/// What `runc list` says about one container.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct ContainerState {
    pub id: String,
    /// `created`, `running`, `paused` or `stopped`.
    pub status: String,
    /// The container init's host pid (0 once stopped).
    #[serde(default)]
    pub pid: i32,
}

/// How long one runtime call may take (a run includes the container's setup).
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

impl Runtime {
    /// Finds the runtime: `binary` if given (a path or a name on PATH), else `runc` on PATH.
    /// Unavailable, naming the Debian package, when it is missing.
    pub fn find(binary: Option<&Path>, root: PathBuf) -> Result<Runtime, DriverError> {
        let wanted = binary.unwrap_or(Path::new("runc"));
        let found = if wanted.components().count() > 1 {
            wanted.is_file().then(|| wanted.to_path_buf())
        } else {
            find_on_path(wanted)
        };
        match found {
            Some(binary) => Ok(Runtime { binary, root }),
            None => Err(DriverError::Unavailable(format!(
                "the oci driver needs an OCI runtime: {} was not found (on Debian: apt-get \
                 install runc; or pass --oci-runtime PATH)",
                wanted.display()
            ))),
        }
    }

    fn command(&self) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.arg("--root").arg(&self.root);
        cmd.env_clear()
            .env(
                "PATH",
                "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            )
            .stdin(Stdio::null())
            .kill_on_drop(true);
        cmd
    }

    /// Runs the runtime with `args`, collecting its output; an error carries what it said.
    async fn call(&self, args: &[&std::ffi::OsStr]) -> Result<Vec<u8>, RuntimeError> {
        let mut cmd = self.command();
        cmd.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        let output = tokio::time::timeout(CALL_TIMEOUT, cmd.output())
            .await
            .map_err(|_| RuntimeError::Failed(format!("no answer within {CALL_TIMEOUT:?}")))?
            .map_err(|e| {
                RuntimeError::Failed(format!("cannot run {}: {e}", self.binary.display()))
            })?;
        if output.status.success() {
            Ok(output.stdout)
        } else {
            let said = String::from_utf8_lossy(&output.stderr).trim().to_string();
            if said.contains("does not exist") || said.contains("not found") {
                Err(RuntimeError::NoSuchContainer)
            } else {
                Err(RuntimeError::Failed(format!(
                    "{} ({})",
                    said, output.status
                )))
            }
        }
    }

    /// `run -d`: creates and starts container `id` from `bundle`, with `log` as its stdout and
    /// stderr, no stdin, and `extra_fd` as the init's fd 3 (`--preserve-fds 1`); the init's pid
    /// goes to `pid_file`.
    pub async fn run_detached(
        &self,
        id: &str,
        bundle: &Path,
        pid_file: &Path,
        log: &Path,
        extra_fds: Vec<std::os::fd::OwnedFd>,
    ) -> Result<(), RuntimeError> {
        use command_fds::{CommandFdExt, FdMapping};
        let open_log = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(log)
                .map_err(|e| RuntimeError::Failed(format!("opening {}: {e}", log.display())))
        };
        let mut cmd = self.command();
        cmd.arg("run")
            .arg("--detach")
            .arg("--preserve-fds")
            .arg(extra_fds.len().to_string())
            .arg("--bundle")
            .arg(bundle)
            .arg("--pid-file")
            .arg(pid_file)
            .arg(id)
            .stdout(open_log()?)
            .stderr(open_log()?);
        let mappings = extra_fds
            .into_iter()
            .enumerate()
            .map(|(i, parent_fd)| FdMapping {
                parent_fd,
                child_fd: 3 + i as i32,
            })
            .collect();
        cmd.fd_mappings(mappings)
            .map_err(|e| RuntimeError::Failed(format!("handing descriptors over: {e}")))?;
        let status = tokio::time::timeout(CALL_TIMEOUT, cmd.status())
            .await
            .map_err(|_| {
                RuntimeError::Failed(format!("run gave no answer within {CALL_TIMEOUT:?}"))
            })?
            .map_err(|e| {
                RuntimeError::Failed(format!("cannot run {}: {e}", self.binary.display()))
            })?;
        if status.success() {
            Ok(())
        } else {
            Err(RuntimeError::Failed(format!("run failed ({status})")))
        }
    }

    /// `delete --force`: kills whatever still runs in the container, removes its cgroup and
    /// the runtime's state. A container the runtime does not know is already deleted.
    pub async fn delete(&self, id: &str) -> Result<(), RuntimeError> {
        match self
            .call(&["delete".as_ref(), "--force".as_ref(), id.as_ref()])
            .await
        {
            Ok(_) | Err(RuntimeError::NoSuchContainer) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// `pause`: freezes every process of the container (the cgroup freezer). runc 1.1 retries
    /// a v1 freeze that new processes keep from completing, up to 1,000 times, and thaws the
    /// cgroup again when it gives up: it fails with the container running.
    pub async fn pause(&self, id: &str) -> Result<(), RuntimeError> {
        self.call(&["pause".as_ref(), id.as_ref()]).await.map(drop)
    }

    /// `resume`: thaws a paused container.
    pub async fn resume(&self, id: &str) -> Result<(), RuntimeError> {
        self.call(&["resume".as_ref(), id.as_ref()]).await.map(drop)
    }

    /// `list`: every container under the driver's runtime root.
    pub async fn list(&self) -> Result<Vec<ContainerState>, RuntimeError> {
        let out = self
            .call(&["list".as_ref(), "--format".as_ref(), "json".as_ref()])
            .await?;
        if out.iter().all(u8::is_ascii_whitespace) || out.starts_with(b"null") {
            return Ok(Vec::new());
        }
        serde_json::from_slice(&out)
            .map_err(|e| RuntimeError::Failed(format!("unreadable container list: {e}")))
    }
}

/// What went wrong in a runtime call.
#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    /// The runtime does not know the container.
    #[error("no such container")]
    NoSuchContainer,
    /// The runtime failed; what it said.
    #[error("{0}")]
    Failed(String),
}

fn find_on_path(program: &Path) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    path.split(':')
        .chain([
            "/usr/local/sbin",
            "/usr/local/bin",
            "/usr/sbin",
            "/usr/bin",
            "/sbin",
            "/bin",
        ])
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(program))
        .find(|candidate| candidate.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_runtime_names_the_package() {
        let err = Runtime::find(Some(Path::new("/nonexistent/runc")), "/tmp".into()).unwrap_err();
        assert!(err.to_string().contains("apt-get install runc"), "{err}");
        let err = Runtime::find(Some(Path::new("no-such-runtime-xyz")), "/tmp".into()).unwrap_err();
        assert!(err.to_string().contains("no-such-runtime-xyz"), "{err}");
    }

    #[test]
    fn states_parse() {
        let s: ContainerState = serde_json::from_str(
            r#"{"ociVersion":"1.0.2","id":"a","pid":42,"status":"running","bundle":"/b"}"#,
        )
        .unwrap();
        assert_eq!(
            (s.id.as_str(), s.status.as_str(), s.pid),
            ("a", "running", 42)
        );
        let list: Vec<ContainerState> =
            serde_json::from_str(r#"[{"id":"a","pid":0,"status":"stopped"}]"#).unwrap();
        assert_eq!(list.len(), 1);
    }
}
