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
//!   buffer between the agent and the output stream's bounded channel. The mapping between
//!   frames and the contract's messages is [`exec_over`], over any byte stream: the `vm`
//!   driver runs it over a virtio-serial port.
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
use sbx_driver_api::{DriverError, DriverStream, ExecInputStream, pb};

/// The static agent, as built for this crate.
pub const BINARY: &[u8] = include_bytes!(env!("SBX_AGENT_BINARY"));

/// The socket's file name in a sandbox's directory.
pub const SOCKET: &str = "agent.sock";

/// How long connecting to an agent may take (it accepts at once when it runs).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Installs the agent as `<dir>/sbx-agent` (mode 0755), replacing an outdated copy; returns
/// its path.
pub fn install(dir: &Path) -> Result<PathBuf, DriverError> {
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
pub struct Listener {
    pub fd: OwnedFd,
}

impl Listener {
    /// Binds `<sandbox_dir>/agent.sock` afresh (an earlier run's socket is removed) and
    /// listens on it.
    pub fn bind(sandbox_dir: &Path) -> Result<Listener, DriverError> {
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
        // Host root's alone: only the driver connects (the agent holds the listening end).
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .map_err(|e| io("setting the agent socket's mode", e))?;
        Ok(Listener {
            fd: OwnedFd::from(listener),
        })
    }
}

/// Connects to the agent listening in `sandbox_dir` and takes its greeting.
async fn connect(sandbox_dir: &Path, sandbox: &str) -> Result<UnixStream, DriverError> {
    let unavailable = |why: String| {
        let said = agent_said(sandbox_dir);
        DriverError::Unavailable(format!(
            "sandbox {sandbox}'s agent does not answer ({why}){said}; a sandbox started by an \
             older sbx has none: restart it"
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
        Ok(Ok(Some(Frame::Hello(_)))) => Ok(conn),
        Ok(Ok(other)) => Err(unavailable(format!("it sent {other:?} first"))),
        Ok(Err(e)) => Err(unavailable(e.to_string())),
        Err(_) => Err(unavailable(format!(
            "no greeting within {CONNECT_TIMEOUT:?}"
        ))),
    }
}

/// The error an agent's error frame stands for.
fn agent_error(failure: Failure, message: String) -> DriverError {
    match failure {
        Failure::Invalid => DriverError::InvalidArgument(message),
        Failure::Internal => DriverError::Internal(format!("the sandbox's agent: {message}")),
        Failure::Exhausted => DriverError::FailedPrecondition(format!(
            "{}: {message}; close a terminal in the sandbox, or start sbxd with a larger \
             --max-ptys",
            crate::ptys::PTYS_SPENT
        )),
    }
}

/// Sends the first frame of an operation.
async fn send(conn: &mut UnixStream, frame: &Frame) -> Result<(), DriverError> {
    conn.write_all(&frame.encode())
        .await
        .map_err(|e| internal("writing to the sandbox's agent", e))
}

/// `path` of the sandbox as a tar stream. An unreadable path is the call's error, before
/// any byte.
pub async fn copy_from(
    sandbox_dir: &Path,
    req: &pb::CopyFromRequest,
) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
    let conn = connect(sandbox_dir, &req.sandbox_id).await?;
    copy_from_over(conn, (), req).await
}

/// [`copy_from`] over a greeted connection; `keep` is held until the stream ends (an offline
/// agent's process).
async fn copy_from_over(
    mut conn: UnixStream,
    keep: impl Send + 'static,
    req: &pb::CopyFromRequest,
) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
    send(
        &mut conn,
        &Frame::CopyOut {
            path: req.path.as_bytes().to_vec(),
        },
    )
    .await?;
    let first = read_frame(&mut conn)
        .await
        .map_err(|e| internal("reading from the sandbox's agent", e))?;
    let first = match first {
        Some(Frame::Error { failure, message }) => return Err(agent_error(failure, message)),
        other => other,
    };
    let (tx, rx) = mpsc::channel::<Result<pb::CopyChunk, DriverError>>(16);
    tokio::spawn(async move {
        let _keep = keep;
        let mut next = Ok(first);
        loop {
            let item = match next {
                Ok(Some(Frame::Stdout(data))) => Ok(pb::CopyChunk { data }),
                Ok(Some(Frame::Exit { .. })) => return,
                Ok(Some(Frame::Error { failure, message })) => Err(agent_error(failure, message)),
                Ok(Some(other)) => Err(DriverError::Internal(format!(
                    "the sandbox's agent sent an unexpected {other:?}"
                ))),
                Ok(None) => Err(DriverError::Internal(
                    "the sandbox's agent ended the copy before its end".into(),
                )),
                Err(e) => Err(internal("reading from the sandbox's agent", e)),
            };
            let last = item.is_err();
            if tx.send(item).await.is_err() || last {
                return;
            }
            next = read_frame(&mut conn).await;
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Unpacks the tar `data` in the sandbox at `path`; answers once the agent has unpacked all
/// of it (or refused it).
pub async fn copy_to(
    sandbox_dir: &Path,
    req: &pb::CopyToStart,
    data: sbx_driver_api::ByteStream,
) -> Result<pb::CopyToResponse, DriverError> {
    let conn = connect(sandbox_dir, &req.sandbox_id).await?;
    copy_to_over(conn, req, data).await
}

/// [`copy_to`] over a greeted connection.
async fn copy_to_over(
    mut conn: UnixStream,
    req: &pb::CopyToStart,
    mut data: sbx_driver_api::ByteStream,
) -> Result<pb::CopyToResponse, DriverError> {
    send(
        &mut conn,
        &Frame::CopyIn {
            path: req.path.as_bytes().to_vec(),
        },
    )
    .await?;
    let (mut rd, mut wr) = conn.into_split();
    let upload = async {
        while let Some(bytes) = data.next().await {
            for chunk in bytes.chunks(wire::MAX_PAYLOAD) {
                if wr
                    .write_all(&Frame::Stdin(chunk.to_vec()).encode())
                    .await
                    .is_err()
                {
                    // The agent stopped reading: its answer says why.
                    return std::future::pending().await;
                }
            }
        }
        let _ = wr.write_all(&Frame::CloseStdin.encode()).await;
        std::future::pending::<()>().await
    };
    let answer = async {
        match read_frame(&mut rd).await {
            Ok(Some(Frame::Exit { .. })) => Ok(pb::CopyToResponse {}),
            Ok(Some(Frame::Error { failure, message })) => Err(agent_error(failure, message)),
            Ok(other) => Err(DriverError::Internal(format!(
                "the sandbox's agent answered the copy with {other:?}"
            ))),
            Err(e) => Err(internal("reading from the sandbox's agent", e)),
        }
    };
    tokio::select! {
        answer = answer => answer,
        () = upload => unreachable!("the upload never ends by itself"),
    }
}

/// Where and as whom a stopped sandbox's files are copied: `sbx-agent offline`, started here
/// (host root) with one end of a socket pair as fd 3, mounts the sandbox's root filesystem
/// (`overlay`, or an empty tmpfs) at `mountpoint` and its persistent directory (`sandbox`)
/// at `/sandbox` in a mount namespace of its own, `chroot`s there and becomes `uid`/`gid`
/// (the sandbox's root on the host) before it reads the request.
#[derive(Debug, Clone)]
pub struct Offline {
    /// The agent binary on the host ([`install`]).
    pub agent: PathBuf,
    /// The overlay's mount options (an oci sandbox's image layers under its writable
    /// layer); none for a process sandbox, whose root filesystem is the host's.
    pub overlay: Option<String>,
    /// The persistent directory, `/sandbox` inside.
    pub sandbox: PathBuf,
    /// An empty directory of the driver's, only mounted on in the agent's namespace.
    pub mountpoint: PathBuf,
    pub uid: u32,
    pub gid: u32,
}

/// How long an offline agent may take to greet (it mounts and `chroot`s first).
const OFFLINE_START_TIMEOUT: Duration = Duration::from_secs(10);

impl Offline {
    /// Starts the agent and takes its greeting. Its process is killed when the returned
    /// child is dropped.
    async fn start(&self) -> Result<(UnixStream, tokio::process::Child), DriverError> {
        use command_fds::{CommandFdExt, FdMapping};
        let (ours, theirs) = std::os::unix::net::UnixStream::pair()
            .map_err(|e| internal("making a socket pair for the copy", e))?;
        std::fs::create_dir_all(&self.mountpoint)
            .map_err(|e| internal(&format!("making {}", self.mountpoint.display()), e))?;
        let mut cmd = tokio::process::Command::new(&self.agent);
        cmd.arg("offline");
        if let Some(options) = &self.overlay {
            cmd.arg("--overlay").arg(options);
        }
        cmd.arg("--bind")
            .arg(&self.sandbox)
            .arg("--uid")
            .arg(self.uid.to_string())
            .arg("--gid")
            .arg(self.gid.to_string())
            .arg(&self.mountpoint)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        cmd.fd_mappings(vec![FdMapping {
            parent_fd: OwnedFd::from(theirs),
            child_fd: 3,
        }])
        .map_err(|e| DriverError::Internal(format!("handing the copy's socket over: {e}")))?;
        let mut child = cmd
            .spawn()
            .map_err(|e| internal(&format!("starting {}", self.agent.display()), e))?;
        ours.set_nonblocking(true)
            .map_err(|e| internal("the copy's socket", e))?;
        let mut conn = UnixStream::from_std(ours).map_err(|e| internal("the copy's socket", e))?;
        let greeting = tokio::time::timeout(OFFLINE_START_TIMEOUT, read_frame(&mut conn)).await;
        if let Ok(Ok(Some(Frame::Hello(_)))) = greeting {
            return Ok((conn, child));
        }
        // No greeting: the agent said why on stderr, or it hangs (then it is killed).
        let _ = child.start_kill();
        let mut said = String::new();
        if let Some(mut stderr) = child.stderr.take() {
            let _ = tokio::time::timeout(Duration::from_secs(2), stderr.read_to_string(&mut said))
                .await;
        }
        let _ = child.wait().await;
        Err(DriverError::Internal(format!(
            "the agent copying the stopped sandbox's files did not start: {}",
            match said.trim() {
                "" => format!("{greeting:?}"),
                said => said.to_string(),
            }
        )))
    }

    /// [`copy_from`] of a stopped sandbox; `keep` is held until the stream ends.
    async fn copy_from(
        &self,
        req: &pb::CopyFromRequest,
        keep: impl Send + 'static,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        let (conn, child) = self.start().await?;
        copy_from_over(conn, (child, keep), req).await
    }

    /// [`copy_to`] of a stopped sandbox; the agent has ended when it answers.
    async fn copy_to(
        &self,
        req: &pb::CopyToStart,
        data: sbx_driver_api::ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        let (conn, mut child) = self.start().await?;
        let answer = copy_to_over(conn, req, data).await;
        if answer.is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait()).await;
        }
        answer
    }
}

/// Where a copy of a sandbox goes: the agent of its running workload, or, when none runs,
/// an [`Offline`] agent on the host, with the sandbox's lock held for the whole copy so that
/// no run begins (and mounts the same writable layer) meanwhile: a start waits for the copy.
#[derive(Debug)]
pub enum CopyVia {
    /// The running agent's sandbox directory.
    Running(PathBuf),
    Stopped(Offline, tokio::sync::OwnedMutexGuard<()>),
}

impl CopyVia {
    pub async fn copy_from(
        self,
        req: &pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        match self {
            CopyVia::Running(dir) => copy_from(&dir, req).await,
            CopyVia::Stopped(offline, lock) => offline.copy_from(req, lock).await,
        }
    }

    pub async fn copy_to(
        self,
        req: &pb::CopyToStart,
        data: sbx_driver_api::ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        match self {
            CopyVia::Running(dir) => copy_to(&dir, req, data).await,
            CopyVia::Stopped(offline, _lock) => offline.copy_to(req, data).await,
        }
    }
}

/// The TCP port a forward names (1–65535), or `InvalidArgument`.
pub fn forward_port(req: &pb::PortForwardStart) -> Result<u16, DriverError> {
    u16::try_from(req.port)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| DriverError::InvalidArgument(format!("port {} is not a TCP port", req.port)))
}

/// A connection to `port` on the sandbox's loopback. The stream carries the port's bytes and
/// then `closed`; it ends once both directions are closed (or the caller drops it, which
/// closes the connection).
pub async fn port_forward(
    sandbox_dir: &Path,
    req: &pb::PortForwardStart,
    mut input: sbx_driver_api::ForwardInputStream,
) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
    use pb::port_forward_input::Input;
    use pb::port_forward_output::Output;
    let port = forward_port(req)?;
    let mut conn = connect(sandbox_dir, &req.sandbox_id).await?;
    send(&mut conn, &Frame::Forward { port }).await?;
    match read_frame(&mut conn).await {
        Ok(Some(Frame::Hello(_))) => {}
        Ok(Some(Frame::Error { message, .. })) => {
            return Err(DriverError::FailedPrecondition(message));
        }
        Ok(other) => {
            return Err(DriverError::Internal(format!(
                "the sandbox's agent answered the forward with {other:?}"
            )));
        }
        Err(e) => return Err(internal("reading from the sandbox's agent", e)),
    }
    let (mut rd, mut wr) = conn.into_split();
    let (tx, rx) = mpsc::channel::<Result<pb::PortForwardOutput, DriverError>>(16);
    tokio::spawn(async move {
        let to_port = async {
            while let Some(msg) = input.next().await {
                let frame = match msg.input {
                    Some(Input::Data(bytes)) => bytes
                        .chunks(wire::MAX_PAYLOAD)
                        .map(|c| Frame::Stdin(c.to_vec()).encode())
                        .collect::<Vec<_>>()
                        .concat(),
                    Some(Input::CloseWrite(true)) => Frame::CloseStdin.encode(),
                    _ => continue,
                };
                if wr.write_all(&frame).await.is_err() {
                    return;
                }
            }
            let _ = wr.write_all(&Frame::CloseStdin.encode()).await;
        };
        let from_port = async {
            loop {
                let out = match read_frame(&mut rd).await {
                    Ok(Some(Frame::Stdout(data))) => Output::Data(data),
                    Ok(Some(Frame::Eof)) => Output::Closed(true),
                    _ => return,
                };
                let closed = matches!(out, Output::Closed(_));
                let msg = pb::PortForwardOutput { output: Some(out) };
                if tx.send(Ok(msg)).await.is_err() || closed {
                    return;
                }
            }
        };
        // Both directions end on their own; the connection closes when both have (or when
        // the caller goes away).
        tokio::select! {
            _ = async { tokio::join!(to_port, from_port) } => {}
            () = tx.closed() => {}
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Runs `req` through the agent listening in `sandbox_dir`, with `input` as the caller sends
/// it. The stream ends with the exit; it ends the command (the agent kills its process group)
/// when the caller drops it, or when `req.timeout_seconds` pass (then the exit is
/// [`timed_out_exit`]).
pub async fn exec(
    sandbox_dir: &Path,
    sandbox: &str,
    req: pb::ExecRequest,
    input: ExecInputStream,
) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
    let (rd, wr) = connect(sandbox_dir, sandbox).await?.into_split();
    // Dropping both halves closes the connection: if the command still runs, the agent ends
    // it.
    exec_over(rd, wr, req, input, |_, _, _, _| async {}).await
}

/// The last message of an exec its timeout ended: exit 124 (what `timeout(1)` answers),
/// `timed_out`.
pub fn timed_out_exit() -> pb::ExecOutput {
    pb::ExecOutput {
        chunk: Some(pb::exec_output::Chunk::Exit(pb::ExecExit {
            code: TIMED_OUT_CODE,
            signal: 0,
            timed_out: true,
        })),
    }
}

/// The exit code of a command its timeout ended.
pub const TIMED_OUT_CODE: i32 = 124;

/// How an exec over [`exec_over`] ended, for its `then`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExecEnd {
    /// The agent sent the exit or an error: nothing runs, and the stream from the agent is at
    /// a frame's end (the stream to it once `then`'s unsent rest is written).
    Over,
    /// The caller went away, or the timeout passed: the command may still run.
    Abandoned,
    /// The stream broke (closed, or an unreadable frame).
    Broken,
}

/// Runs `req` through an agent on the other end of `rd`/`wr` (greeted already), with
/// `input` as the caller sends it; the frame <-> message mapping of every transport. The
/// stream ends with the exit. When the exchange is over — the exit, the caller dropping the
/// stream, `req.timeout_seconds` passing (then the exit is [`timed_out_exit`]) — `then` gets both halves
/// back, how it ended (a socket is dropped, so the agent ends the command; a virtio port
/// must be told) and the unsent rest of a frame of input the exchange ended in the middle of
/// (empty when none): the exit can come while the caller's stdin is still going out, and a
/// stream that outlives the exchange (a virtio port) is at a frame's end only once that is
/// written.
pub async fn exec_over<R, W, F, Fut>(
    mut rd: R,
    mut wr: W,
    req: pb::ExecRequest,
    input: ExecInputStream,
    then: F,
) -> Result<DriverStream<pb::ExecOutput>, DriverError>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
    F: FnOnce(R, W, ExecEnd, Vec<u8>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let tty = req.tty.is_some();
    let timeout =
        (req.timeout_seconds > 0).then(|| Duration::from_secs(u64::from(req.timeout_seconds)));
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
        user: req.user.clone().into_bytes(),
    });
    wr.write_all(&request.encode())
        .await
        .map_err(|e| internal("sending the exec to the agent", e))?;
    let (tx, rx) = mpsc::channel::<Result<pb::ExecOutput, DriverError>>(64);
    let wants_stdin = req.stdin;
    tokio::spawn(async move {
        // The frame of input being written and how much of it is, kept outside the writing
        // future, which the exchange's end drops wherever it is.
        let mut sending = Sending::default();
        // The caller's input, as frames. The write half stays open after the input ends: the
        // agent takes a closed connection for a caller gone.
        let send_input = async {
            let mut input = input;
            while let Some(msg) = input.next().await {
                for frame in input_frames(msg, tty) {
                    if sending.write(&mut wr, frame.encode()).await.is_err() {
                        // The agent closed the connection (after the command's exit, which
                        // input can outlast): what it sent says how the exec ended.
                        return std::future::pending().await;
                    }
                }
            }
            if wants_stdin {
                let _ = sending.write(&mut wr, Frame::CloseStdin.encode()).await;
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
                            return (None, ExecEnd::Abandoned);
                        }
                        if last {
                            return (None, ExecEnd::Over);
                        }
                    }
                    Ok(None) => {
                        return (
                            Some(DriverError::Internal(
                                "the exec agent closed the connection before the command's exit"
                                    .to_string(),
                            )),
                            ExecEnd::Broken,
                        );
                    }
                    Err(e) => {
                        return (
                            Some(internal("reading from the exec agent", e)),
                            ExecEnd::Broken,
                        );
                    }
                }
            }
        };
        // The timeout ends the exchange like any exit: with its ExecExit (124, timed_out),
        // and the command is ended as for a caller gone.
        let timed = async {
            match timeout {
                Some(after) => match tokio::time::timeout(after, relay_output).await {
                    Ok(ended) => ended,
                    Err(_) => {
                        let _ = tx.send(Ok(timed_out_exit())).await;
                        (None, ExecEnd::Abandoned)
                    }
                },
                None => relay_output.await,
            }
        };
        let (outcome, end) = tokio::select! {
            outcome = timed => outcome,
            () = send_input => unreachable!("sending the input never ends by itself"),
            // The caller dropped the stream (even of a command that prints nothing).
            () = tx.closed() => (None, ExecEnd::Abandoned),
        };
        if let Some(err) = outcome {
            let _ = tx.send(Err(err)).await;
        }
        then(rd, wr, end, sending.unsent()).await;
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// A frame being written: its bytes and how many of them are written.
#[derive(Default)]
struct Sending {
    frame: Vec<u8>,
    written: usize,
}

impl Sending {
    /// Writes `frame` whole, counting what is written as it goes: a write is cancel safe (a
    /// dropped one wrote nothing), so when the future is dropped the count is right.
    async fn write(
        &mut self,
        wr: &mut (impl tokio::io::AsyncWrite + Unpin),
        frame: Vec<u8>,
    ) -> std::io::Result<()> {
        self.frame = frame;
        self.written = 0;
        while self.written < self.frame.len() {
            match wr.write(&self.frame[self.written..]).await? {
                0 => return Err(std::io::ErrorKind::WriteZero.into()),
                n => self.written += n,
            }
        }
        Ok(())
    }

    /// The rest of a frame begun and not finished (empty when the last one was written
    /// whole, or not begun: then the stream is at a frame's end).
    fn unsent(mut self) -> Vec<u8> {
        match self.written {
            0 => Vec::new(),
            n => self.frame.split_off(n.min(self.frame.len())),
        }
    }
}

/// The last line the agent of the sandbox's current run wrote to its log (`run-*/agent.log`,
/// at most its last 4 KiB, read through [`super::safefs`]), as `: it said "…"`, or nothing.
fn agent_said(sandbox_dir: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(sandbox_dir) else {
        return String::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("run-"))
        .filter_map(|e| {
            let rel = Path::new(&e.file_name()).join("agent.log");
            super::safefs::read_tail_beneath(sandbox_dir, &rel, 4096).ok()
        })
        .filter_map(|log| {
            let log = String::from_utf8_lossy(&log).into_owned();
            log.lines().last().map(|l| super::safefs::printable(l, 256))
        })
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
        Frame::Exit { code, signal } => (
            chunk(Chunk::Exit(pb::ExecExit {
                code,
                signal,
                timed_out: false,
            })),
            true,
        ),
        Frame::Error { failure, message } => (Some(Err(agent_error(failure, message))), true),
        other => (
            Some(Err(DriverError::Internal(format!(
                "the exec agent sent an unexpected {other:?}"
            )))),
            true,
        ),
    }
}

pub async fn read_frame(rd: &mut (impl AsyncReadExt + Unpin)) -> std::io::Result<Option<Frame>> {
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
