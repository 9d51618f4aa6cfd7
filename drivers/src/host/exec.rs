//! The output side of an exec on a host driver: a spawned helper (`nsenter`, `runc exec`)
//! whose stdout and stderr are piped, turned into the contract's stream of output chunks and
//! a last exit message. The driver says how to end the exec'd command (`end`): the helper
//! itself may not pass a SIGKILL on.
//!
//! - The stream's buffer is bounded (64 chunks of at most [`CHUNK`] bytes): a slow reader
//!   slows the pipes, nothing piles up.
//! - A caller that drops the stream ends the command, even one that prints nothing.
//! - A timeout ends the command and answers `DeadlineExceeded`.

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Child;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::internal;
use super::logfile::CHUNK;
use crate::{DriverError, DriverStream, pb};

type ExecItem = Result<pb::ExecOutput, DriverError>;

/// Streams `child`'s output (its stdout and stderr must be piped). `end` kills the exec'd
/// command; `finished` runs once the stream is over, however it ended (to remove files).
pub(crate) fn stream_output(
    mut child: Child,
    timeout: Option<Duration>,
    end: impl Fn() + Send + Sync + 'static,
    finished: impl FnOnce() + Send + 'static,
) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
    let (Some(stdout), Some(stderr)) = (child.stdout.take(), child.stderr.take()) else {
        return Err(DriverError::Internal(
            "the exec helper started without its pipes".to_string(),
        ));
    };
    let (tx, rx) = mpsc::channel::<ExecItem>(64);
    tokio::spawn(async move {
        let run = async {
            let out = pump(stdout, tx.clone(), pb::exec_output::Chunk::Stdout);
            let err = pump(stderr, tx.clone(), pb::exec_output::Chunk::Stderr);
            let (out_open, err_open) = tokio::join!(out, err);
            if !(out_open && err_open) {
                // Nobody listens any more: end the command.
                end();
            }
            child.wait().await
        };
        let timed = async {
            match timeout {
                Some(after) => tokio::time::timeout(after, run)
                    .await
                    .map_err(|_| Some(after)),
                None => Ok(run.await),
            }
        };
        let listener = tx.clone();
        let outcome = tokio::select! {
            outcome = timed => outcome,
            // The caller dropped the stream (even of a command that prints nothing).
            () = listener.closed() => Err(None),
        };
        let last = match outcome {
            Ok(Ok(status)) => Some(Ok(exit_message(status))),
            Ok(Err(e)) => Some(Err(internal("waiting for the exec'd command", e))),
            Err(after) => {
                end();
                after.map(|after| {
                    Err(DriverError::DeadlineExceeded {
                        operation: "exec",
                        after,
                    })
                })
            }
        };
        finished();
        if let Some(last) = last {
            let _ = tx.send(last).await;
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// The exit message for the helper's status (it exits with the command's status).
fn exit_message(status: std::process::ExitStatus) -> pb::ExecOutput {
    pb::ExecOutput {
        chunk: Some(pb::exec_output::Chunk::Exit(pb::ExecExit {
            code: status.code().unwrap_or(-1),
            signal: status.signal().unwrap_or(0),
        })),
    }
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
