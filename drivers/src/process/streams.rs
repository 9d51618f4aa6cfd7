//! The streaming calls of the process driver: watch (a poller over every sandbox), exec (a
//! command in the sandbox's namespaces and cgroups) and logs (tail and follow of the log file).

use std::os::unix::process::ExitStatusExt;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{Inner, ProcessDriver, launch};
use crate::host::logfile::{CHUNK, log_stream};
use crate::host::{Desired, feed, internal, locked, procfs, validate_command};
use crate::{DriverError, DriverStream, parse_sandbox_id, pb};

type ExecItem = Result<pb::ExecOutput, DriverError>;

impl ProcessDriver {
    pub(super) fn watch_stream(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        let events = feed::watch(&self.inner, "process", self.inner.opts.poll_interval);
        Ok(Box::pin(events.take_until(self.dropped())))
    }

    pub(super) fn exec_stream(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let record = self.inner.require(id)?;
        let init = self
            .inner
            .run_paths(&record)
            .read_init()
            .filter(procfs::is_alive);
        let init = match (init, record.desired) {
            (Some(init), Desired::Running) => init,
            _ => {
                return Err(DriverError::FailedPrecondition(format!(
                    "sandbox {id} is not running; exec needs a running workload"
                )));
            }
        };
        let mut command =
            launch::exec_command(&self.inner.tools, &init, &record.cgroups.dirs, &req.command);
        command
            .env_clear()
            .envs(launch::workload_env(&record))
            .envs(req.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let mut child = command
            .spawn()
            .map_err(|e| internal("spawning nsenter", e))?;
        let (Some(stdout), Some(stderr), Some(pid)) =
            (child.stdout.take(), child.stderr.take(), child.id())
        else {
            return Err(DriverError::Internal(
                "nsenter started without its pipes".to_string(),
            ));
        };
        // nsenter leads its own process group; the command it forks inside the sandbox is in it.
        let group = Pid::from_raw(pid as i32);
        let timeout =
            (req.timeout_seconds > 0).then(|| Duration::from_secs(u64::from(req.timeout_seconds)));
        let (tx, rx) = mpsc::channel::<ExecItem>(64);
        tokio::spawn(async move {
            let run = async {
                let out = pump(stdout, tx.clone(), pb::exec_output::Chunk::Stdout);
                let err = pump(stderr, tx.clone(), pb::exec_output::Chunk::Stderr);
                let (out_open, err_open) = tokio::join!(out, err);
                if !(out_open && err_open) {
                    // Nobody listens any more: end the command.
                    let _ = killpg(group, Signal::SIGKILL);
                }
                child.wait().await
            };
            let timed = async {
                match timeout {
                    Some(after) => tokio::time::timeout(after, run).await.map_err(|_| after),
                    None => Ok(run.await),
                }
            };
            let listener = tx.clone();
            let outcome = tokio::select! {
                outcome = timed => outcome,
                // The caller dropped the stream (even of a command that prints nothing).
                () = listener.closed() => {
                    let _ = killpg(group, Signal::SIGKILL);
                    let _ = child.wait().await;
                    return;
                }
            };
            let last = match outcome {
                Ok(Ok(status)) => Ok(pb::ExecOutput {
                    chunk: Some(pb::exec_output::Chunk::Exit(pb::ExecExit {
                        code: status.code().unwrap_or(0),
                        signal: status.signal().unwrap_or(0),
                    })),
                }),
                Ok(Err(e)) => Err(internal("waiting for the exec'd command", e)),
                Err(after) => {
                    let _ = killpg(group, Signal::SIGKILL);
                    let _ = child.wait().await;
                    Err(DriverError::DeadlineExceeded {
                        operation: "exec",
                        after,
                    })
                }
            };
            let _ = tx.send(last).await;
        });
        Ok(Box::pin(ReceiverStream::new(rx)))
    }

    pub(super) fn logs_stream(
        &self,
        req: pb::LogsRequest,
    ) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        self.inner.require(id)?;
        let log = self.inner.paths(id).log;
        let weak = Arc::downgrade(&self.inner);
        let interval = self
            .inner
            .opts
            .poll_interval
            .min(Duration::from_millis(100));
        let exists = move || {
            weak.upgrade()
                .is_some_and(|inner| sandbox_exists(&inner, id))
        };
        let stream = log_stream(log, req.tail_lines, req.follow, interval, exists)?;
        Ok(Box::pin(stream.take_until(self.dropped())))
    }
}

fn sandbox_exists(inner: &Inner, id: uuid::Uuid) -> bool {
    locked(&inner.records).contains_key(&id)
}

/// Sends what `source` yields as chunks; returns false when the receiver is gone.
async fn pump(
    mut source: impl AsyncRead + Unpin,
    tx: mpsc::Sender<ExecItem>,
    wrap: fn(Vec<u8>) -> pb::exec_output::Chunk,
) -> bool {
    let mut buf = vec![0u8; CHUNK];
    loop {
        match source.read(&mut buf).await {
            Ok(0) | Err(_) => return true,
            Ok(n) => {
                let item = Ok(pb::ExecOutput {
                    chunk: Some(wrap(buf[..n].to_vec())),
                });
                if tx.send(item).await.is_err() {
                    return false;
                }
            }
        }
    }
}
