//! The exec of the vm driver, through `sbx-agent serve-port` in the guest (the agent crate's
//! `port` module) on the virtio ports `sbx.exec.<k>`, which QEMU joins to FIFOs in the
//! sandbox's directory. (Watch and logs, of the console log file, are the
//! kit's, `host::lifecycle`.)
//!
//! A port is one stream for the VM's life, so execs take turns on it; a VM has
//! [`qemu::EXEC_CHANNELS`] ports (`sbx.exec.<k>`, FIFOs `exec-<k>.in`/`.out`), each with its own
//! agent, so that many run at once and more wait for the first one freed ([`ExecChannels`]);
//! copy and port-forward run through the same turns (`files.rs`). A
//! turn opens the FIFOs, greets the agent with a token of its own and skips what it reads up
//! to the echo (output of an earlier turn that nobody read), then runs the exec with the
//! same frame <-> message mapping as the socket drivers (`host::agent::exec_over`): output
//! reaches the caller as the command writes it, with no cap, and stdin, a terminal, resizes
//! and signals reach the command. A turn that ended in the middle of a frame of stdin (the
//! exit or the timeout came while the caller's stdin was still going out: a 64 KiB frame
//! is more than the FIFO holds) first writes that frame's rest, or else leaves the stream out
//! of step (the next turn pads). A turn whose caller went away (or whose timeout passed)
//! sends SIGKILL to the command's process group and waits for its exit before the next turn;
//! an agent's greeting also ends whatever an earlier, vanished turn left running.

use std::collections::HashMap;
use std::io::Cursor;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbx_agent::wire::{Frame, MAX_PAYLOAD};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use uuid::Uuid;

use super::{Inner, VmDriver, qemu};
use sbx_driver_api::{DriverError, DriverStream, ExecInputStream, parse_sandbox_id, pb};
use sbx_host_kit::agent::{ExecEnd, exec_over, read_frame};
use sbx_host_kit::{Desired, locked, validate_command};

/// How long the agent may take to echo a turn's greeting (it answers at once when idle; an
/// earlier turn's command is ended first, which takes up to the agent's 0.5 s drain).
const GREETING_TIMEOUT: Duration = Duration::from_secs(15);

/// How long an abandoned turn waits for the command's exit after SIGKILL.
const ABANDON_TIMEOUT: Duration = Duration::from_secs(10);

/// Each VM's exec channels ([`qemu::EXEC_CHANNELS`]), each a lock (one turn at a time)
/// around whether its stream is known to be in step, at a frame's end with nothing running;
/// and as many permits, taken first, in order: a turn that finds every channel busy waits
/// for the first one freed (not for one chosen beforehand, which a forwarded connection may
/// hold for hours).
#[derive(Debug, Default)]
pub(super) struct ExecChannels(Mutex<HashMap<Uuid, Arc<VmChannels>>>);

#[derive(Debug)]
struct VmChannels {
    free: Arc<tokio::sync::Semaphore>,
    channels: Vec<Arc<tokio::sync::Mutex<Channel>>>,
}

#[derive(Debug, Default)]
pub(super) struct Channel {
    /// Which of the VM's channels (`exec-<k>`).
    k: usize,
    /// The run (boot) whose stream the last turn left in step; any other run, or none: the
    /// next turn first writes zeros, so a frame an earlier writer left half-written ends.
    in_step: Option<String>,
}

/// One turn's hold on a channel; the permit goes back after the channel's lock.
pub(super) struct Turn {
    channel: tokio::sync::OwnedMutexGuard<Channel>,
    _permit: tokio::sync::OwnedSemaphorePermit,
}

impl std::ops::Deref for Turn {
    type Target = Channel;
    fn deref(&self) -> &Channel {
        &self.channel
    }
}

impl std::ops::DerefMut for Turn {
    fn deref_mut(&mut self) -> &mut Channel {
        &mut self.channel
    }
}

impl ExecChannels {
    /// A free channel of VM `id`, waiting (in turn) for one when all are busy.
    async fn turn(&self, id: Uuid) -> Turn {
        let vm = locked(&self.0)
            .entry(id)
            .or_insert_with(|| {
                Arc::new(VmChannels {
                    free: Arc::new(tokio::sync::Semaphore::new(qemu::EXEC_CHANNELS)),
                    channels: (0..qemu::EXEC_CHANNELS)
                        .map(|k| Arc::new(tokio::sync::Mutex::new(Channel { k, in_step: None })))
                        .collect(),
                })
            })
            .clone();
        let permit = vm
            .free
            .clone()
            .acquire_owned()
            .await
            .expect("the semaphore is never closed");
        // A permit means a channel is free: every other holder of one holds at most one
        // channel, and gives the channel back before the permit.
        for channel in &vm.channels {
            if let Ok(channel) = channel.clone().try_lock_owned() {
                return Turn {
                    channel,
                    _permit: permit,
                };
            }
        }
        unreachable!("{} permits for as many channels", qemu::EXEC_CHANNELS)
    }

    pub(super) fn remove(&self, id: Uuid) {
        locked(&self.0).remove(&id);
    }
}

impl VmDriver {
    pub(super) async fn exec_stream(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.exec_for("exec", req, input, false).await
    }

    /// [`exec_stream`](Self::exec_stream) on behalf of `what` (`exec`, `copying files`,
    /// `port forwarding`), the name a sandbox that is not running is refused with.
    pub(super) async fn exec_for(
        &self,
        what: &str,
        req: pb::ExecRequest,
        input: ExecInputStream,
        copy: bool,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let rec = self.inner.records.require(id)?;
        // A stopped sandbox's helper guest serves its copy (`copy`), and nothing else: an
        // exec of a stopped sandbox is refused as before.
        let helper = copy
            .then(|| locked(&self.inner.helpers).get(&id).cloned())
            .flatten();
        if rec.desired == Desired::Running && rec.paused {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is paused; {what} needs a running vm (resume it first)"
            )));
        }
        if helper.is_none() && (rec.desired != Desired::Running || !Inner::is_alive(&rec)) {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; {what} needs a running vm"
            )));
        }
        let n = self.inner.exec_ids.fetch_add(1, Ordering::Relaxed);
        let mut turn = self.inner.exec_channels.turn(id).await;
        let run_id = helper.unwrap_or(rec.run_id);
        let in_step = turn.in_step.take().as_deref() == Some(run_id.as_str());
        let token = format!("{run_id}-{n}");
        let exec = qemu::exec_channel(&self.inner.paths(id).exec, turn.k);
        let (rd, wr) = greet(&exec, &token, !in_step).await.map_err(|why| {
            DriverError::Unavailable(format!("sandbox {id}'s exec agent in the vm: {why}"))
        })?;
        exec_over(
            rd,
            wr,
            req,
            input,
            move |mut rd, mut wr, end, unsent| async move {
                // The exchange may have ended in the middle of a frame of stdin (the exit comes
                // while the caller's stdin still goes out): its rest first, so the agent reads
                // what follows (a signal, the next turn's greeting) as a frame of its own. The
                // agent reads on when no command runs; not written in time, the next turn pads.
                let finished = unsent.is_empty()
                    || matches!(
                        tokio::time::timeout(ABANDON_TIMEOUT, wr.write_all(&unsent)).await,
                        Ok(Ok(()))
                    );
                let in_step = finished
                    && match end {
                        ExecEnd::Over => true,
                        ExecEnd::Abandoned => abandon(&mut rd, &mut wr).await,
                        ExecEnd::Broken => false,
                    };
                if in_step {
                    turn.in_step = Some(run_id);
                }
            },
        )
        .await
    }
}

/// Opens the exec channel's FIFOs and begins a turn: (zeros if `pad`, then) a greeting with
/// `token`, and everything read up to its echo skipped. Returns the stream from just after
/// the echo, and the writing end.
async fn greet(
    exec: &Path,
    token: &str,
    pad: bool,
) -> Result<(impl AsyncRead + Unpin + Send + 'static, pipe::Sender), String> {
    // The reading end first: the agent's answer must find a reader. Opening the writing end
    // fails (ENXIO) when no QEMU holds the channel, instead of waiting for one.
    let mut rd = pipe::OpenOptions::new()
        .open_receiver(qemu::fifo(exec, "out"))
        .map_err(|e| format!("opening {}: {e}", qemu::fifo(exec, "out").display()))?;
    let mut wr = pipe::OpenOptions::new()
        .open_sender(qemu::fifo(exec, "in"))
        .map_err(|e| format!("opening {}: {e}", qemu::fifo(exec, "in").display()))?;
    let hello = Frame::Hello(token.to_string()).encode();
    let send = async {
        if pad {
            // Completes a frame an earlier writer left cut (at most a full output-sized one);
            // the agent skips the rest, zero being no frame's kind.
            wr.write_all(&vec![0u8; MAX_PAYLOAD + 5]).await?;
        }
        wr.write_all(&hello).await
    };
    let echo = async {
        let mut seen: Vec<u8> = Vec::new();
        let mut buf = vec![0u8; MAX_PAYLOAD];
        loop {
            let n = rd.read(&mut buf).await?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the channel closed",
                ));
            }
            seen.extend_from_slice(&buf[..n]);
            if let Some(at) = find(&seen, &hello) {
                return Ok(seen.split_off(at + hello.len()));
            }
            // Keep only what may be the start of the echo.
            let keep = seen.len().min(hello.len() - 1);
            seen.drain(..seen.len() - keep);
        }
    };
    let after = tokio::time::timeout(GREETING_TIMEOUT, async {
        tokio::try_join!(send, echo).map(|((), after)| after)
    })
    .await
    .map_err(|_| {
        format!(
            "no answer within {GREETING_TIMEOUT:?} (the guest may be starting or stopping, or a \
             command that does not read its stdin holds the agent)"
        )
    })?
    .map_err(|e| e.to_string())?;
    Ok((Cursor::new(after).chain(rd), wr))
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// Ends an abandoned turn: SIGKILL to the command's process group, then its frames skipped
/// up to the exit. Whether the exit came (the stream is in step again).
async fn abandon(rd: &mut (impl AsyncRead + Unpin), wr: &mut pipe::Sender) -> bool {
    if wr.write_all(&Frame::Signal(9).encode()).await.is_err() {
        return false;
    }
    let drain = async {
        loop {
            match read_frame(rd).await {
                Ok(Some(Frame::Exit { .. } | Frame::Error { .. })) => return true,
                Ok(Some(_)) => {}
                Ok(None) | Err(_) => return false,
            }
        }
    };
    tokio::time::timeout(ABANDON_TIMEOUT, drain)
        .await
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_echo_is_found_across_reads() {
        let hello = Frame::Hello("r1-7".into()).encode();
        let mut stream = Frame::Stdout(b"stale output".to_vec()).encode();
        stream.extend(Frame::Hello("r1-6".into()).encode());
        let at = stream.len();
        stream.extend(&hello);
        assert_eq!(find(&stream, &hello), Some(at));
        assert_eq!(find(&stream[..stream.len() - 1], &hello), None);
    }
}
