//! The agent's server: one thread per connection, one exec per connection.
//!
//! The exec'd command is a child of the agent, so it is inside everything the agent is
//! inside — the sandbox's namespaces, cgroups, seccomp filter, capabilities and
//! `no_new_privs` — by inheritance, not by re-entering them as a helper from outside would.
//! Its environment is the agent's (the sandbox's base environment) with the request's on top;
//! its working directory the agent's unless the request names one.
//!
//! Per exec, threads (not an event loop: a handful per exec, blocking IO, and the kernel's
//! socket and pipe buffers as the only buffers):
//! - the connection's thread reads the client's frames: stdin goes to the command through a
//!   bounded queue and a writer thread of its own ([`crate::feed`]: a command that does not
//!   read holds up to 4 MiB, then the client is back-pressured through the socket, and a
//!   signal or a hang-up behind the stdin still gets through);
//!   a resize sets the pty's size (the kernel then sends SIGWINCH); a signal goes to the
//!   command's process group; the connection closing before the exit ends the command
//!   (SIGKILL to its process group).
//! - one thread per output (stdout and stderr, or the pty) sends what the command writes.
//! - one thread waits for the command, lets the output drain (until its end, or at most
//!   [`DRAIN_AFTER_EXIT`] when something the command left behind holds it open), and sends
//!   the exit last.
//!
//! Each exec runs in a Landlock domain of its own ([`crate::confine`]), so neither the workload
//! nor another exec opens its pipes, terminal or memory through `/proc`. Its terminal, when it
//! has one, comes from a devpts instance the driver mounted as host root ([`isolate`]): its
//! pty is host root's (mode 0600, an owner the sandbox's user namespace does not map), so no
//! process of the sandbox opens it by path either; the agent opens the terminal's side
//! through the master (`TIOCGPTPEER`), never by its name.
//!
//! An exec runs as its request's user, else the agent's default user ([`default_user`]: the
//! image's `User`, the same as the workload's), looked up in the sandbox's own `/etc/passwd`
//! and `/etc/group` at each exec (an exec may add users). The agent itself runs as the
//! sandbox's root, so that it can become any user the sandbox's user namespace maps: in the
//! child, between fork and exec, `setgroups` (the user's groups from `/etc/group`), `setgid`,
//! `setuid` — the kernel then clears every capability of a user that is not root. `HOME`,
//! `USER` and `LOGNAME` are the user's (a request's own env wins); an exec without a directory
//! starts in the agent's (the image's `WorkingDir`) unless that is `/`, then in the user's
//! home; a relative directory is taken from the home. An agent given no default user (the
//! process driver's, whose sandbox's HOME is its persistent directory) leaves an exec that
//! names none exactly as it is, environment and directory. A user the sandbox does not have, or a
//! uid outside the namespace's map, is refused naming it before anything runs.

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use rustix::process::{Pid, Signal, kill_process_group};

use crate::confine::{self, Domain};
use crate::feed::StdinFeed;
use crate::user::{Account, ProcessUser};
use crate::wire::{ExecRequest, Failure, Frame, MAX_PAYLOAD};

/// How this agent keeps its execs apart from the workload and from each other, set once at
/// start ([`isolate`]); unset, execs run as the agent does and ptys come from `/dev/ptmx`.
static ISOLATION: std::sync::OnceLock<Isolation> = std::sync::OnceLock::new();

#[derive(Debug)]
struct Isolation {
    /// Each exec enters a new domain of this ruleset; `None` where the kernel has no Landlock.
    domain: Option<Domain>,
    /// The devpts instance exec terminals come from (its root, open); `None`: `/dev/ptmx`'s.
    pts: Option<OwnedFd>,
}

/// Sets how execs are kept apart (see the module docs): `domain` for every exec, terminals
/// from the devpts instance whose root `pts` is. Once, before serving; a second call changes
/// nothing.
pub fn isolate(domain: Option<Domain>, pts: Option<OwnedFd>) {
    let _ = ISOLATION.set(Isolation { domain, pts });
}

/// Who an exec without a user of its own runs as: set once at start (`serve --user`); unset,
/// root of the sandbox (uid 0 and its passwd entry).
static DEFAULT_USER: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sets who an exec that names no user runs as (an image's `User`: `NAME`, `UID`,
/// `NAME:GROUP`, `UID:GID`). Once, before serving; a second call changes nothing.
pub fn default_user(user: String) {
    let _ = DEFAULT_USER.set(user);
}

/// Whether each exec drops CAP_SETUID, CAP_SETGID and CAP_SETPCAP from its bounding set
/// before it runs ([`drop_id_caps`]).
static DROP_ID_CAPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Where the agent holds no capability but those it needs to become another user (the
/// process driver's jail: CAP_SETUID, CAP_SETGID, and CAP_SETPCAP to drop them), every exec
/// drops the three from its bounding set after its user switch, so that a command run as root
/// gets none of them back at exec: it is as powerless as the workload.
pub fn drop_id_caps() {
    DROP_ID_CAPS.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// How long output may still come after the command exited, from processes it left behind
/// holding its stdout: the exit is sent after that, as `docker exec` does.
pub const DRAIN_AFTER_EXIT: Duration = Duration::from_millis(500);

/// Serves connections on `listener` for ever (each on its own thread).
pub fn serve(listener: UnixListener) -> io::Result<()> {
    loop {
        match listener.accept() {
            Ok((conn, _)) => {
                thread::spawn(move || {
                    if let Err(e) = handle(conn) {
                        eprintln!("sbx-agent: a connection ended in error: {e}");
                    }
                });
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                eprintln!("sbx-agent: accept failed: {e}");
                thread::sleep(Duration::from_millis(100));
            }
        }
    }
}

/// Where an exec's frames go: a connection (closed both ways after the last frame), or one
/// exec's turn on a virtio port ([`crate::port`], which stays open for the next).
pub(crate) trait Conn: Write + Send {
    /// After the last frame.
    fn close(&mut self) {}
}

impl Conn for UnixStream {
    fn close(&mut self) {
        let _ = self.shutdown(std::net::Shutdown::Both);
    }
}

/// The sending half of a connection, shared by the output threads; once the last frame
/// (exit or error) is sent nothing else is.
pub(crate) struct Sender {
    conn: Mutex<Option<Box<dyn Conn>>>,
}

impl Sender {
    pub(crate) fn new(conn: impl Conn + 'static) -> Arc<Sender> {
        Arc::new(Sender {
            conn: Mutex::new(Some(Box::new(conn))),
        })
    }

    fn send(&self, frame: &Frame) -> io::Result<()> {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_mut() {
            Some(conn) => frame.write_to(conn),
            None => Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "exec already over",
            )),
        }
    }

    /// Sends the last frame and closes the connection (both ways, which also ends the
    /// connection's reading thread).
    pub(crate) fn finish(&self, frame: &Frame) {
        let mut guard = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(mut conn) = guard.take() {
            let _ = frame.write_to(&mut conn);
            conn.close();
        }
    }
}

fn handle(mut conn: UnixStream) -> io::Result<()> {
    Frame::Hello(env!("CARGO_PKG_VERSION").to_string()).write_to(&mut conn)?;
    let mut reader = conn.try_clone()?;
    let sender = Sender::new(conn);
    let req = match Frame::read_from(&mut reader) {
        Ok(Some(Frame::Exec(req))) => req,
        Ok(Some(Frame::Forward { port })) => {
            forward(port, reader, &sender);
            return Ok(());
        }
        Ok(Some(Frame::CopyOut { path })) => {
            copy_out(&PathBuf::from(OsString::from_vec(path)), &sender);
            return Ok(());
        }
        Ok(Some(Frame::CopyIn { path })) => {
            copy_in(&PathBuf::from(OsString::from_vec(path)), reader, &sender);
            return Ok(());
        }
        Ok(Some(other)) => {
            sender.finish(&invalid(format!(
                "the first frame must be a request, not {other:?}"
            )));
            return Ok(());
        }
        Ok(None) => return Ok(()),
        Err(e) => {
            sender.finish(&invalid(format!("an unreadable request: {e}")));
            return Ok(());
        }
    };
    exec(req, reader, sender)
}

/// Serves one copy (in or out) on `conn`, the only requests an offline agent takes
/// ([`crate::offline`]): a stopped sandbox runs nothing, so exec and port-forward are refused.
pub fn serve_copy(mut conn: UnixStream) -> io::Result<()> {
    Frame::Hello(env!("CARGO_PKG_VERSION").to_string()).write_to(&mut conn)?;
    let reader = conn.try_clone()?;
    let mut first = conn.try_clone()?;
    let sender = Sender::new(conn);
    match Frame::read_from(&mut first) {
        Ok(Some(Frame::CopyOut { path })) => {
            copy_out(&PathBuf::from(OsString::from_vec(path)), &sender)
        }
        Ok(Some(Frame::CopyIn { path })) => {
            copy_in(&PathBuf::from(OsString::from_vec(path)), reader, &sender)
        }
        Ok(Some(other)) => sender.finish(&invalid(format!(
            "the sandbox is not running: only a copy can be served, not {other:?}"
        ))),
        Ok(None) => {}
        Err(e) => sender.finish(&invalid(format!("an unreadable request: {e}"))),
    }
    Ok(())
}

/// The stdin frames of a connection as a byte stream, ending at close-stdin. A connection
/// that ends before it is an error: the data was cut short.
struct FrameReader {
    conn: UnixStream,
    pending: Vec<u8>,
    at: usize,
    done: bool,
}

impl Read for FrameReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while self.at == self.pending.len() {
            if self.done {
                return Ok(0);
            }
            match Frame::read_from(&mut self.conn)? {
                Some(Frame::Stdin(bytes)) => {
                    self.pending = bytes;
                    self.at = 0;
                }
                Some(Frame::CloseStdin) => self.done = true,
                Some(_) => {}
                None => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the client went away before the end of the data",
                    ));
                }
            }
        }
        let n = buf.len().min(self.pending.len() - self.at);
        buf[..n].copy_from_slice(&self.pending[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Bytes written, sent as stdout frames of at most [`MAX_PAYLOAD`].
struct FrameWriter<'a> {
    sender: &'a Sender,
    buf: Vec<u8>,
}

impl Write for FrameWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        let n = data.len().min(MAX_PAYLOAD - self.buf.len());
        self.buf.extend_from_slice(&data[..n]);
        if self.buf.len() == MAX_PAYLOAD {
            self.flush()?;
        }
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        if !self.buf.is_empty() {
            self.sender
                .send(&Frame::Stdout(std::mem::take(&mut self.buf)))?;
        }
        Ok(())
    }
}

/// The failure frame for an IO error on `path`: a missing or unusable path is the caller's.
fn path_error(path: &Path, e: &io::Error) -> Frame {
    let message = format!("{}: {e}", path.display());
    if callers_fault(e) {
        invalid(message)
    } else {
        internal(message)
    }
}

/// Whether an IO error of a copy is the caller's: a missing or unusable path, or an archive
/// entry refused ([`crate::archive::unpack`] says `InvalidInput`).
pub(crate) fn callers_fault(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::InvalidInput
            | io::ErrorKind::NotADirectory
            | io::ErrorKind::IsADirectory
            | io::ErrorKind::AlreadyExists
    )
}

/// Sends `path` as a tar ([`crate::archive::pack`]), then an exit 0.
fn copy_out(path: &Path, sender: &Sender) {
    let mut out = FrameWriter {
        sender,
        buf: Vec::with_capacity(MAX_PAYLOAD),
    };
    match crate::archive::pack(path, &mut out).and_then(|()| out.flush()) {
        Ok(()) => sender.finish(&Frame::Exit { code: 0, signal: 0 }),
        Err(e) => sender.finish(&path_error(path, &e)),
    }
}

/// Unpacks the tar the client sends at `path` ([`crate::archive::unpack`]), then an exit 0.
fn copy_in(path: &Path, conn: UnixStream, sender: &Sender) {
    let input = FrameReader {
        conn,
        pending: Vec::new(),
        at: 0,
        done: false,
    };
    match crate::archive::unpack(input, path) {
        Ok(_) => sender.finish(&Frame::Exit { code: 0, signal: 0 }),
        Err(e) => sender.finish(&path_error(path, &e)),
    }
}

/// How long connecting to a forwarded port may take.
pub(crate) const FORWARD_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Carries bytes between the client and `127.0.0.1:port` inside the sandbox, each direction
/// half-closed on its own, until the client closes the connection.
fn forward(port: u16, mut conn: UnixStream, sender: &Arc<Sender>) {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let tcp = match std::net::TcpStream::connect_timeout(&addr, FORWARD_CONNECT_TIMEOUT) {
        Ok(tcp) => tcp,
        Err(e) => {
            sender.finish(&invalid(format!(
                "nothing accepts connections on {addr} in the sandbox ({e})"
            )));
            return;
        }
    };
    let _ = tcp.set_nodelay(true);
    // Connected: said with a second greeting, so the client can tell a port that answers
    // from one that refuses before any byte flows.
    if sender.send(&Frame::Hello("connected".into())).is_err() {
        return;
    }
    let Ok(mut from_port) = tcp.try_clone() else {
        sender.finish(&internal("duplicating the forwarded connection".into()));
        return;
    };
    let back = {
        let sender = sender.clone();
        thread::spawn(move || {
            let mut buf = vec![0u8; MAX_PAYLOAD];
            loop {
                match from_port.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = sender.send(&Frame::Eof);
                        return;
                    }
                    Ok(n) => {
                        if sender.send(&Frame::Stdout(buf[..n].to_vec())).is_err() {
                            return;
                        }
                    }
                }
            }
        })
    };
    let mut to_port = tcp;
    loop {
        match Frame::read_from(&mut conn) {
            Ok(Some(Frame::Stdin(bytes))) => {
                if to_port.write_all(&bytes).is_err() {
                    let _ = to_port.shutdown(std::net::Shutdown::Write);
                }
            }
            Ok(Some(Frame::CloseStdin)) => {
                let _ = to_port.shutdown(std::net::Shutdown::Write);
            }
            Ok(Some(_)) => {}
            Ok(None) | Err(_) => break,
        }
    }
    let _ = to_port.shutdown(std::net::Shutdown::Both);
    let _ = back.join();
    sender.finish(&Frame::Eof);
}

fn invalid(message: String) -> Frame {
    Frame::Error {
        failure: Failure::Invalid,
        message,
    }
}

pub(crate) fn internal(message: String) -> Frame {
    Frame::Error {
        failure: Failure::Internal,
        message,
    }
}

/// What the command writes to and reads from.
enum Stdio3 {
    Pipes,
    Pty { master: File },
}

fn exec(req: ExecRequest, mut reader: UnixStream, sender: Arc<Sender>) -> io::Result<()> {
    let Some(mut running) = start(&req, &sender)? else {
        return Ok(());
    };
    let watched = reader.try_clone()?;
    let gone = client_gone(&watched);
    while let Ok(Some(frame)) = Frame::read_from(&mut reader) {
        if !running.apply(frame, &gone) {
            break;
        }
    }
    // The client is gone or the exec is over. If the command still runs, nobody listens:
    // end it (its whole process group).
    running.end();
    Ok(())
}

/// Whether the client of `conn` is gone: the driver never shuts its writing half while an
/// exec runs, so a hang-up is a caller that went away.
fn client_gone(conn: &UnixStream) -> impl Fn() -> bool + '_ {
    use rustix::event::{PollFd, PollFlags, poll};
    move || {
        let mut fds = [PollFd::new(conn, PollFlags::RDHUP)];
        let now = rustix::time::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        matches!(poll(&mut fds, Some(&now)), Ok(n) if n > 0)
            && fds[0]
                .revents()
                .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR)
    }
}

/// A command started by [`start`]: what the client's frames reach, and the thread that
/// sends its exit.
pub(crate) struct Running {
    pgid: Pid,
    stdin: Option<StdinFeed>,
    pty: Option<File>,
    waiter: thread::JoinHandle<()>,
}

impl Running {
    /// Whether the exit (or an error) has been sent.
    pub(crate) fn is_over(&self) -> bool {
        self.waiter.is_finished()
    }

    /// Sends the command's process group SIGKILL unless it is over, and waits for its exit
    /// to be sent.
    pub(crate) fn end(self) {
        if !self.waiter.is_finished() {
            let _ = kill_process_group(self.pgid, Signal::KILL);
        }
        let _ = self.waiter.join();
    }

    /// Does what one of the client's frames asks; `false` when the client turned out to be
    /// gone (asked through `gone` while stdin waits for room: [`crate::feed`]).
    pub(crate) fn apply(&mut self, frame: Frame, gone: &dyn Fn() -> bool) -> bool {
        match frame {
            Frame::Stdin(bytes) => {
                if let Some(feed) = &self.stdin {
                    return feed.push(bytes, gone);
                }
            }
            Frame::CloseStdin => {
                if self.pty.is_some() {
                    // A terminal has no end of its own: type the end-of-file character (^D),
                    // as a user at a terminal would.
                    if let Some(feed) = &self.stdin {
                        return feed.push(vec![0x04], gone);
                    }
                } else if let Some(feed) = self.stdin.take() {
                    feed.close();
                }
            }
            Frame::Resize { rows, cols } => {
                // Without a terminal there is nothing to resize: the driver refuses that
                // before it gets here.
                if let Some(pty) = &self.pty {
                    let _ = resize(pty, rows, cols);
                }
            }
            Frame::Signal(n) => {
                if let Some(sig) = Signal::from_named_raw(n) {
                    let _ = kill_process_group(self.pgid, sig);
                }
            }
            // Frames only the agent sends, or a second request: ignored.
            _ => {}
        }
        true
    }
}

/// Starts `req`'s command, its output sent through `sender` and its exit last; `None` when
/// it did not start (the exit, 126 or 127, or the error is sent then).
pub(crate) fn start(req: &ExecRequest, sender: &Arc<Sender>) -> io::Result<Option<Running>> {
    let Some(program) = req.argv.first() else {
        sender.finish(&invalid("the command is empty".into()));
        return Ok(None);
    };
    let program = OsString::from_vec(program.clone());
    let (account, switch, untouched) = match exec_user(&req.user) {
        Ok(found) => found,
        Err(message) => {
            sender.finish(&invalid(message));
            return Ok(None);
        }
    };
    let home = Path::new(&account.home);
    let named = PathBuf::from(OsString::from_vec(req.workdir.clone()));
    // No directory: the agent's (the image's WorkingDir) unless that is `/`, then the user's
    // home when it is there; a relative one is the home's.
    let workdir = if req.workdir.is_empty() {
        let own = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
        if !untouched && own == Path::new("/") && home.is_dir() {
            home.to_path_buf()
        } else {
            own
        }
    } else if named.is_relative() {
        home.join(&named)
    } else {
        named
    };
    if !req.workdir.is_empty() && !workdir.is_dir() {
        let why = match std::fs::metadata(&workdir) {
            Ok(_) => "is not a directory".to_string(),
            Err(e) => format!("cannot be entered: {e}"),
        };
        // At most 64 characters of it (a path may be 4 KiB): an error stays small.
        let shown = workdir.to_string_lossy();
        let cut: String = shown.chars().take(64).collect();
        let more = if cut.len() < shown.len() { "…" } else { "" };
        sender.finish(&invalid(format!("the working directory {cut}{more} {why}")));
        return Ok(None);
    }
    let path_var = req
        .env
        .iter()
        .rev()
        .find(|(k, _)| k == b"PATH")
        .map(|(_, v)| OsString::from_vec(v.clone()))
        .or_else(|| std::env::var_os("PATH"))
        .unwrap_or_default();
    let Some(resolved) = find_program(&program, &path_var, &workdir) else {
        // The user's name for the command, never a wrapper's.
        let name = String::from_utf8_lossy(program.as_bytes()).into_owned();
        let _ = sender.send(&Frame::Stderr(
            format!("command not found: {name}\n").into_bytes(),
        ));
        sender.finish(&Frame::Exit {
            code: 127,
            signal: 0,
        });
        return Ok(None);
    };
    let mut cmd = Command::new(&resolved);
    cmd.arg0(&program);
    cmd.args(req.argv[1..].iter().map(|a| OsString::from_vec(a.clone())));
    if !untouched {
        cmd.env("HOME", &account.home)
            .env("USER", &account.name)
            .env("LOGNAME", &account.name);
    }
    for (k, v) in &req.env {
        cmd.env(OsString::from_vec(k.clone()), OsString::from_vec(v.clone()));
    }
    cmd.current_dir(&workdir);
    // The bounding set first: the drop needs CAP_SETPCAP, which a switch to a user other than
    // root clears; the switch needs only the effective set, which the drop leaves.
    if DROP_ID_CAPS.load(std::sync::atomic::Ordering::Relaxed) {
        drop_id_caps_in_child(&mut cmd);
    }
    if switch {
        become_in_child(&mut cmd, &account.ids);
    }
    if let Some(domain) = ISOLATION.get().and_then(|i| i.domain.as_ref()) {
        enter_in_child(&mut cmd, domain.raw());
    }
    let owner = switch.then_some(&account.ids);
    let (mut child, io) = match spawn(&mut cmd, req, owner) {
        Ok(started) => started,
        Err(e) => {
            let name = String::from_utf8_lossy(program.as_bytes()).into_owned();
            match e.kind() {
                // The exec instance's `max=` is reached (ENOSPC from its ptmx).
                _ if req.tty.is_some()
                    && e.raw_os_error() == Some(rustix::io::Errno::NOSPC.raw_os_error()) =>
                {
                    sender.finish(&Frame::Error {
                        failure: Failure::Exhausted,
                        message: "no terminal is left for the exec: every pty the sandbox may \
                                  hold is in use"
                            .into(),
                    });
                }
                io::ErrorKind::PermissionDenied => {
                    let _ = sender.send(&Frame::Stderr(
                        format!("permission denied: {name}\n").into_bytes(),
                    ));
                    sender.finish(&Frame::Exit {
                        code: 126,
                        signal: 0,
                    });
                }
                _ => sender.finish(&internal(format!("{name} could not be started: {e}"))),
            }
            return Ok(None);
        }
    };
    let pgid = Pid::from_child(&child);
    let mut outputs = Vec::new();
    let mut pty = None;
    let stdin_sink: Option<Box<dyn Write + Send>> = match io {
        Stdio3::Pipes => {
            if let Some(out) = child.stdout.take() {
                outputs.push(pump(out, sender.clone(), Frame::Stdout));
            }
            if let Some(err) = child.stderr.take() {
                outputs.push(pump(err, sender.clone(), Frame::Stderr));
            }
            child
                .stdin
                .take()
                .map(|s| Box::new(s) as Box<dyn Write + Send>)
        }
        Stdio3::Pty { master } => {
            outputs.push(pump(master.try_clone()?, sender.clone(), Frame::Stdout));
            pty = Some(master.try_clone()?);
            Some(Box::new(master))
        }
    };
    let waiter = {
        let sender = sender.clone();
        thread::spawn(move || wait_and_finish(&mut child, outputs, &sender))
    };
    Ok(Some(Running {
        pgid,
        stdin: stdin_sink.map(StdinFeed::new),
        pty,
        waiter,
    }))
}

/// Starts the command with pipes, or on a new pty as its controlling terminal.
fn spawn(
    cmd: &mut Command,
    req: &ExecRequest,
    owner: Option<&ProcessUser>,
) -> io::Result<(Child, Stdio3)> {
    match &req.tty {
        None => {
            cmd.stdin(if req.stdin {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group, so a signal or a kill reaches what it starts too.
            .process_group(0);
            Ok((cmd.spawn()?, Stdio3::Pipes))
        }
        Some(tty) => {
            let (master, slave) = open_pty(tty.rows, tty.cols)?;
            // The terminal is the user's, as login(1) makes it: `tty`, `mesg` and programs
            // that check their terminal's owner work. Where the devpts instance's owner is one
            // the sandbox does not map (the host's exec instance: see the module docs) the
            // kernel refuses, and the terminal stays the host's, still open to the command.
            if let Some(user) = owner {
                let _ = rustix::fs::fchown(
                    &slave,
                    Some(rustix::process::Uid::from_raw(user.uid)),
                    Some(rustix::process::Gid::from_raw(user.gid)),
                );
            }
            let term = if tty.term.is_empty() {
                "xterm"
            } else {
                &tty.term
            };
            cmd.env("TERM", term)
                .stdin(Stdio::from(slave.try_clone()?))
                .stdout(Stdio::from(slave.try_clone()?))
                .stderr(Stdio::from(slave));
            set_controlling_terminal(cmd);
            let child = cmd.spawn()?;
            // The command's copies of the slave are its own now; ours (held by `cmd`, which
            // outlives this call) are closed here, so the master reads end-of-file once the
            // command and its children close theirs — not only after the drain deadline.
            cmd.stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            Ok((
                child,
                Stdio3::Pty {
                    master: File::from(master),
                },
            ))
        }
    }
}

/// In the child, between fork and exec: a new session, with the pty (already its stdin) as
/// its controlling terminal. Only async-signal-safe system calls run there.
#[allow(unsafe_code)]
fn set_controlling_terminal(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and only makes two system
    // calls (setsid, ioctl TIOCSCTTY on fd 0), both async-signal-safe; it allocates nothing
    // and touches no lock.
    unsafe {
        cmd.pre_exec(|| {
            rustix::process::setsid()?;
            rustix::process::ioctl_tiocsctty(rustix::stdio::stdin())?;
            Ok(())
        });
    }
}

/// The account an exec runs as (its request's user, else the default one), whether the
/// child must switch to it (it is not who the agent is), and whether the exec is left as the
/// agent is, environment too: no user named and no default set (the process driver's agent,
/// whose sandbox's HOME is its persistent directory, and a vm guest without an image). An
/// error names what is wrong.
fn exec_user(requested: &[u8]) -> Result<(Account, bool, bool), String> {
    let requested = std::str::from_utf8(requested)
        .map_err(|_| "the user is not UTF-8".to_string())?
        .to_string();
    let untouched = requested.is_empty() && DEFAULT_USER.get().is_none();
    let who = if requested.is_empty() {
        DEFAULT_USER.get().cloned().unwrap_or_default()
    } else {
        requested
    };
    let account = crate::user::account(
        &who,
        || crate::user::read_small("/etc/passwd"),
        || crate::user::read_small("/etc/group"),
    )
    .map_err(|e| format!("{e}: the command cannot run as {who:?}"))?;
    let ids = &account.ids;
    let (uid, gid) = (
        rustix::process::getuid().as_raw(),
        rustix::process::getgid().as_raw(),
    );
    if untouched || (ids.uid == uid && ids.gid == gid && ids.additional_gids.is_empty()) {
        return Ok((account, false, untouched));
    }
    if !rustix::process::geteuid().is_root() {
        return Err(format!(
            "this sandbox's agent runs as uid {uid}, not root: it cannot run a command as \
             {who:?} (uid {}, gid {})",
            ids.uid, ids.gid
        ));
    }
    for (what, id, map) in [
        ("uid", ids.uid, "/proc/self/uid_map"),
        ("gid", ids.gid, "/proc/self/gid_map"),
    ] {
        let map = crate::user::read_small(map);
        if !id_mapped(&map, id) {
            return Err(format!(
                "{what} {id} of {who:?} is not in this sandbox's user namespace, which maps \
                 {what}s {}: the command cannot run as it",
                ranges(&map)
            ));
        }
    }
    Ok((account, true, false))
}

/// Whether `id` is inside one of the ranges of a `/proc/PID/uid_map` (`inside outside count`
/// a line). An empty or unreadable map (no `/proc`) says nothing: the kernel has the last word.
fn id_mapped(map: &str, id: u32) -> bool {
    let ranges = map_ranges(map);
    ranges.is_empty()
        || ranges
            .iter()
            .any(|(first, count)| u64::from(id) >= *first && u64::from(id) < first + count)
}

fn map_ranges(map: &str) -> Vec<(u64, u64)> {
    map.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let inside = f.next()?.parse::<u64>().ok()?;
            let _outside = f.next()?;
            let count = f.next()?.parse::<u64>().ok()?;
            Some((inside, count))
        })
        .collect()
}

/// A map's ranges as people write them (`0–65535`).
fn ranges(map: &str) -> String {
    map_ranges(map)
        .iter()
        .map(|(first, count)| format!("{first}–{}", first + count.saturating_sub(1)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// In the child, between fork and exec: the user's groups, gid and uid (in that order: the
/// uid last, while the capabilities to set the others are still there).
#[allow(unsafe_code)]
fn become_in_child(cmd: &mut Command, user: &ProcessUser) {
    use nix::unistd::{Gid, Uid, setgroups, setresgid, setresuid};
    let groups: Vec<Gid> = user
        .additional_gids
        .iter()
        .map(|g| Gid::from_raw(*g))
        .collect();
    let (uid, gid) = (Uid::from_raw(user.uid), Gid::from_raw(user.gid));
    // SAFETY: the closure runs in the forked child before exec and makes three system calls
    // (setgroups, setresgid, setresuid) on memory allocated before the fork; it allocates
    // nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || {
            setgroups(&groups)?;
            setresgid(gid, gid, gid)?;
            setresuid(uid, uid, uid)?;
            Ok(())
        });
    }
}

/// In the child, between fork and exec: CAP_SETUID, CAP_SETGID and CAP_SETPCAP out of the
/// bounding set (CAP_SETPCAP, which the drop needs, last), so that the command's exec gives
/// none of them back; before the user switch, which still uses the effective set.
#[allow(unsafe_code)]
fn drop_id_caps_in_child(cmd: &mut Command) {
    // SAFETY: the closure runs in the forked child before exec and makes three prctl calls
    // with integers; it allocates nothing and touches no lock.
    unsafe {
        cmd.pre_exec(|| {
            // linux/capability.h: CAP_SETGID 6, CAP_SETUID 7, CAP_SETPCAP 8.
            for cap in [6u64, 7, 8] {
                // EINVAL: a capability this kernel does not know; nothing to drop.
                if nix::libc::prctl(nix::libc::PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 {
                    let e = io::Error::last_os_error();
                    if e.raw_os_error() != Some(nix::libc::EINVAL) {
                        return Err(e);
                    }
                }
            }
            Ok(())
        });
    }
}

/// In the child, between fork and exec: a new Landlock domain ([`crate::confine`]).
#[allow(unsafe_code)]
fn enter_in_child(cmd: &mut Command, ruleset: std::os::fd::RawFd) {
    // SAFETY: the closure runs in the forked child before exec and makes two system calls
    // (prctl, landlock_restrict_self) on a descriptor the parent keeps open; it allocates
    // nothing and touches no lock.
    unsafe {
        cmd.pre_exec(move || confine::enter_raw(ruleset));
    }
}

/// A new pty: from the exec devpts instance when the driver made one, else from `/dev/ptmx`;
/// its terminal side opened through the master (`TIOCGPTPEER`), or by its name on a kernel
/// older than that (4.13).
fn open_pty(rows: u16, cols: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::{OpenptFlags, grantpt, ioctl_tiocgptpeer, openpt, ptsname, unlockpt};
    let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
    let master = match ISOLATION.get().and_then(|i| i.pts.as_ref()) {
        Some(pts) => rustix::fs::openat(
            pts,
            "ptmx",
            OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
            Mode::empty(),
        )?,
        None => openpt(flags)?,
    };
    grantpt(&master)?;
    unlockpt(&master)?;
    let slave = match ioctl_tiocgptpeer(&master, flags) {
        Ok(slave) => slave,
        Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOTTY) => {
            let name = ptsname(&master, Vec::new())?;
            rustix::fs::open(
                name.as_c_str(),
                OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC,
                Mode::empty(),
            )?
        }
        Err(e) => return Err(e.into()),
    };
    resize(&master, rows, cols)?;
    Ok((master, slave))
}

fn resize(pty: impl AsFd, rows: u16, cols: u16) -> io::Result<()> {
    let size = rustix::termios::Winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    rustix::termios::tcsetwinsize(pty, size)?;
    Ok(())
}

/// Sends what `from` yields, in chunks, until its end (or the connection's).
fn pump(
    mut from: impl Read + Send + 'static,
    sender: Arc<Sender>,
    frame: fn(Vec<u8>) -> Frame,
) -> thread::JoinHandle<()> {
    thread::spawn(move || {
        let mut buf = vec![0u8; MAX_PAYLOAD];
        loop {
            match from.read(&mut buf) {
                // A pty's master answers EIO once no process holds its slave: its end.
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if sender.send(&frame(buf[..n].to_vec())).is_err() {
                        return;
                    }
                }
            }
        }
    })
}

fn wait_and_finish(child: &mut Child, outputs: Vec<thread::JoinHandle<()>>, sender: &Sender) {
    let status = match child.wait() {
        Ok(status) => status,
        Err(e) => {
            sender.finish(&internal(format!("waiting for the command: {e}")));
            return;
        }
    };
    let deadline = std::time::Instant::now() + DRAIN_AFTER_EXIT;
    for out in outputs {
        while !out.is_finished() && std::time::Instant::now() < deadline {
            thread::sleep(Duration::from_millis(2));
        }
    }
    let last = match status.signal() {
        Some(signal) => Frame::Exit { code: -1, signal },
        None => Frame::Exit {
            code: status.code().unwrap_or(-1),
            signal: 0,
        },
    };
    sender.finish(&last);
}

/// Finds `program` as a shell would: a name with a `/` as it is (relative to `base`), any
/// other on `path`; only an executable file counts.
pub fn find_program(
    program: &std::ffi::OsStr,
    path: &std::ffi::OsStr,
    base: &Path,
) -> Option<PathBuf> {
    let executable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if program.as_bytes().contains(&b'/') {
        let p = base.join(program);
        return executable(&p).then_some(p);
    }
    if program.is_empty() {
        return None;
    }
    path.as_bytes()
        .split(|&b| b == b':')
        .map(|dir| {
            if dir.is_empty() {
                base.to_path_buf()
            } else {
                base.join(std::ffi::OsStr::from_bytes(dir))
            }
        })
        .map(|dir| dir.join(program))
        .find(|p| executable(p))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn programs_are_found_as_a_shell_finds_them() {
        let sh = find_program(
            "sh".as_ref(),
            "/nonexistent:/bin:/usr/bin".as_ref(),
            "/".as_ref(),
        );
        assert!(sh.is_some());
        assert!(find_program("no-such-cmd-xyz".as_ref(), "/bin".as_ref(), "/".as_ref()).is_none());
        assert!(find_program("/bin/sh".as_ref(), "".as_ref(), "/".as_ref()).is_some());
        // A file that is not executable is not a command.
        assert!(find_program("/etc/passwd".as_ref(), "".as_ref(), "/".as_ref()).is_none());
        assert!(find_program("".as_ref(), "/bin".as_ref(), "/".as_ref()).is_none());
    }
}
