//! The driver's side of `sbx-agent` (the `agent` crate), the program of ours that a sandbox's
//! init starts next to the main process and that serves exec from inside the sandbox.
//!
//! - [`install`] puts the static agent binary (built by this crate's build script, embedded
//!   in it) into a driver's state directory.
//! - [`Listener::bind`] makes a run's listening socket in the sandbox's own directory (host
//!   root's, never bound into the sandbox) before the launch; the launch hands it to the init
//!   as fd 3. The workload can neither replace the socket nor turn its path into a symlink,
//!   and the driver never connects to a path the sandbox controls.
//! - [`exec`] is one connection per exec: the request, then the caller's input as frames one
//!   way and the output as frames the other, with the kernel's socket buffer as the only
//!   buffer between the agent and the output stream's bounded channel.
//!
//! Socket paths go through `/proc/self/fd/<dir>/agent.sock`, so a state directory deeper than
//! a socket address's 108 bytes still works.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use sbx_agent::wire::{self, Failure, Frame};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::internal;
use super::records::write_atomically;
use crate::{DriverError, DriverStream, ExecInputStream, pb};

/// The static agent, as built for this crate.
pub(crate) const BINARY: &[u8] = include_bytes!(env!("SBX_AGENT_BINARY"));

/// The socket's file name in a sandbox's directory.
pub(crate) const SOCKET: &str = "agent.sock";

/// How long connecting to an agent may take (it accepts at once when it runs).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Installs the agent as `<dir>/sbx-agent` (mode 0755), replacing an outdated copy; returns
/// its path.
pub(crate) fn install(dir: &Path) -> Result<PathBuf, DriverError> {
    let path = dir.join("sbx-agent");
    if std::fs::read(&path).ok().as_deref() != Some(BINARY) {
        write_atomically(&path, BINARY)
            .map_err(|e| internal(&format!("installing {}", path.display()), e))?;
    }
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| internal(&format!("setting the mode of {}", path.display()), e))?;
    Ok(path)
}

/// `dir`'s socket as a path short enough for a socket address, and the open directory that
/// keeps the path valid.
fn short_path(dir: &Path) -> std::io::Result<(File, PathBuf)> {
    let handle = File::open(dir)?;
    let path = PathBuf::from(format!("/proc/self/fd/{}/{SOCKET}", handle.as_raw_fd()));
    Ok((handle, path))
}

/// A run's listening socket, made before the launch and handed to the sandbox's init.
#[derive(Debug)]
pub(crate) struct Listener {
    pub fd: OwnedFd,
}

impl Listener {
    /// Binds `<sandbox_dir>/agent.sock` afresh (an earlier run's socket is removed) and
    /// listens on it.
    pub(crate) fn bind(sandbox_dir: &Path) -> Result<Listener, DriverError> {
        let io = |what: &str, e: std::io::Error| {
            internal(&format!("{what} in {}", sandbox_dir.display()), e)
        };
        let (_dir, path) = short_path(sandbox_dir).map_err(|e| io("opening", e))?;
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io("removing the old agent socket", e)),
        }
        let listener = std::os::unix::net::UnixListener::bind(&path)
            .map_err(|e| io("binding the agent socket", e))?;
        Ok(Listener {
            fd: OwnedFd::from(listener),
        })
    }
}

/// Runs `req` through the agent listening in `sandbox_dir`, with `input` as the caller sends
/// it. The stream ends with the exit; it ends the command (the agent kills its process group)
/// when the caller drops it, or when `req.timeout_seconds` pass (then `DeadlineExceeded`).
pub(crate) async fn exec(
    sandbox_dir: &Path,
    sandbox: &str,
    req: pb::ExecRequest,
    input: ExecInputStream,
) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
    let unavailable = |why: String| {
        let said = agent_said(sandbox_dir);
        DriverError::Unavailable(format!(
            "sandbox {sandbox}'s exec agent does not answer ({why}){said}; a sandbox started \
             by an older sbx has none: restart it"
        ))
    };
    let (_dir, path) = short_path(sandbox_dir).map_err(|e| unavailable(e.to_string()))?;
    let mut conn = match tokio::time::timeout(CONNECT_TIMEOUT, UnixStream::connect(&path)).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => return Err(unavailable(e.to_string())),
        Err(_) => return Err(unavailable(format!("no answer within {CONNECT_TIMEOUT:?}"))),
    };
    // The agent greets on accept; a socket still listening (held by a launcher) with no agent
    // behind it greets no one.
    match tokio::time::timeout(CONNECT_TIMEOUT, read_frame(&mut conn)).await {
        Ok(Ok(Some(Frame::Hello(_)))) => {}
        Ok(Ok(other)) => return Err(unavailable(format!("it sent {other:?} first"))),
        Ok(Err(e)) => return Err(unavailable(e.to_string())),
        Err(_) => {
            return Err(unavailable(format!(
                "no greeting within {CONNECT_TIMEOUT:?}"
            )));
        }
    }
    let timeout =
        (req.timeout_seconds > 0).then(|| Duration::from_secs(u64::from(req.timeout_seconds)));
    let tty = req.tty.is_some();
    let request = Frame::Exec(wire::ExecRequest {
        argv: req.command.iter().map(|a| a.clone().into_bytes()).collect(),
        env: sorted_env(&req.env),
        workdir: req.workdir.clone().into_bytes(),
        stdin: req.stdin,
        tty: req.tty.as_ref().map(|t| wire::Tty {
            rows: clamp(t.rows),
            cols: clamp(t.cols),
            term: t.term.clone(),
        }),
    });
    conn.write_all(&request.encode())
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let (mut rd, mut wr) = conn.into_split();
    let (tx, rx) = mpsc::channel::<Result<pb::ExecOutput, DriverError>>(64);
    let wants_stdin = req.stdin;
    tokio::spawn(async move {
        // The caller's input, as frames. The write half stays open after the input ends: the
        // agent takes a closed connection for a caller gone.
        let send_input = async {
            let mut input = input;
            while let Some(msg) = input.next().await {
                for frame in input_frames(msg, tty) {
                    if wr.write_all(&frame.encode()).await.is_err() {
                        return;
                    }
                }
            }
            if wants_stdin {
                let _ = wr.write_all(&Frame::CloseStdin.encode()).await;
            }
            std::future::pending::<()>().await
        };
        let relay_output = async {
            loop {
                match read_frame(&mut rd).await {
                    Ok(Some(frame)) => {
                        let (item, last) = output_item(frame);
                        if let Some(item) = item
                            && tx.send(item).await.is_err()
                        {
                            return None;
                        }
                        if last {
                            return None;
                        }
                    }
                    Ok(None) => {
                        return Some(DriverError::Internal(
                            "the exec agent closed the connection before the command's exit"
                                .to_string(),
                        ));
                    }
                    Err(e) => return Some(internal("reading from the exec agent", e)),
                }
            }
        };
        let timed = async {
            match timeout {
                Some(after) => tokio::time::timeout(after, relay_output)
                    .await
                    .unwrap_or(Some(DriverError::DeadlineExceeded {
                        operation: "exec",
                        after,
                    })),
                None => relay_output.await,
            }
        };
        let outcome = tokio::select! {
            outcome = timed => outcome,
            () = send_input => None,
            // The caller dropped the stream (even of a command that prints nothing).
            () = tx.closed() => None,
        };
        if let Some(err) = outcome {
            let _ = tx.send(Err(err)).await;
        }
        // Dropping both halves here closes the connection: if the command still runs, the
        // agent ends it.
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// The last line the agent of the sandbox's current run wrote to its log (`run-*/agent.log`),
/// as `: it said "…"`, or nothing.
fn agent_said(sandbox_dir: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(sandbox_dir) else {
        return String::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("run-"))
        .filter_map(|e| std::fs::read_to_string(e.path().join("agent.log")).ok())
        .filter_map(|log| log.lines().last().map(str::to_string))
        .next()
        .map(|line| format!(": it said {line:?}"))
        .unwrap_or_default()
}

fn clamp(n: u32) -> u16 {
    u16::try_from(n).unwrap_or(u16::MAX)
}

fn sorted_env(env: &std::collections::HashMap<String, String>) -> Vec<(Vec<u8>, Vec<u8>)> {
    let mut env: Vec<(Vec<u8>, Vec<u8>)> = env
        .iter()
        .map(|(k, v)| (k.clone().into_bytes(), v.clone().into_bytes()))
        .collect();
    env.sort();
    env
}

/// The frames one input message becomes (stdin cut to the frame size).
fn input_frames(msg: pb::ExecInput, tty: bool) -> Vec<Frame> {
    use pb::exec_input::Input;
    match msg.input {
        Some(Input::Stdin(bytes)) => bytes
            .chunks(wire::MAX_PAYLOAD)
            .map(|c| Frame::Stdin(c.to_vec()))
            .collect(),
        Some(Input::CloseStdin(true)) => vec![Frame::CloseStdin],
        Some(Input::Resize(size)) if tty => vec![Frame::Resize {
            rows: clamp(size.rows),
            cols: clamp(size.cols),
        }],
        Some(Input::Signal(n)) => vec![Frame::Signal(n)],
        // A second start, a resize without a terminal, `close_stdin: false`: nothing to do
        // (the gateway refuses the first two before they get here).
        _ => Vec::new(),
    }
}

/// The output message a frame from the agent is, and whether it is the last.
fn output_item(frame: Frame) -> (Option<Result<pb::ExecOutput, DriverError>>, bool) {
    use pb::exec_output::Chunk;
    let chunk = |c| Some(Ok(pb::ExecOutput { chunk: Some(c) }));
    match frame {
        Frame::Stdout(b) => (chunk(Chunk::Stdout(b)), false),
        Frame::Stderr(b) => (chunk(Chunk::Stderr(b)), false),
        Frame::Exit { code, signal } => (chunk(Chunk::Exit(pb::ExecExit { code, signal })), true),
        Frame::Error {
            failure: Failure::Invalid,
            message,
        } => (Some(Err(DriverError::InvalidArgument(message))), true),
        Frame::Error { message, .. } => (
            Some(Err(DriverError::Internal(format!(
                "the exec agent: {message}"
            )))),
            true,
        ),
        other => (
            Some(Err(DriverError::Internal(format!(
                "the exec agent sent an unexpected {other:?}"
            )))),
            true,
        ),
    }
}

async fn read_frame(rd: &mut (impl AsyncReadExt + Unpin)) -> std::io::Result<Option<Frame>> {
    let mut header = [0u8; 5];
    match rd.read_exact(&mut header[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    rd.read_exact(&mut header[1..]).await?;
    let (kind, len) = Frame::check_header(header)?;
    let mut payload = vec![0u8; len];
    rd.read_exact(&mut payload).await?;
    Frame::decode(kind, &payload).map(Some)
}
