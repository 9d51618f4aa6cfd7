//! Signal dispositions for what the agent starts.
//!
//! A non-interactive shell starts a background command (`cmd &`) with SIGINT and SIGQUIT
//! ignored, and an ignored signal stays ignored across exec: the sandbox's init starts both
//! the main process and the agent that way, so without this a Ctrl-C (SIGINT) sent to an
//! exec'd command or to the main process would do nothing. [`reset`] puts every ignored signal
//! back to its default and unblocks all; the agent does it at start (its commands inherit
//! that), and `sbx-agent run CMD…` does it before it becomes the main process.

use std::os::unix::process::CommandExt;

/// Every signal the process ignores goes back to its default action; none stays blocked.
#[allow(unsafe_code)]
pub fn reset() {
    use nix::sys::signal::{SigHandler, SigSet, SigmaskHow, Signal, sigprocmask};
    for sig in Signal::iterator() {
        if matches!(sig, Signal::SIGKILL | Signal::SIGSTOP) {
            continue;
        }
        // SAFETY: SIG_DFL installs no handler (no code of ours runs on delivery); the
        // process has no handlers of its own to lose (an exec cleared them, and the agent
        // installs none), and this runs before any thread is started.
        let _ = unsafe { nix::sys::signal::signal(sig, SigHandler::SigDfl) };
    }
    let _ = sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None);
}

/// The agent's own SIGPIPE is ignored: a write to the stdin of a command that has exited
/// (or to a client gone) is an `EPIPE` error for that one exec, not the end of the agent and
/// of every exec after it. Its commands still start with SIGPIPE at its default: the standard
/// library's `Command` puts it back in the child before the exec.
#[allow(unsafe_code)]
pub fn ignore_broken_pipe() {
    use nix::sys::signal::{SigHandler, Signal};
    // SAFETY: SIG_IGN installs no handler; called at start, before any thread.
    let _ = unsafe { nix::sys::signal::signal(Signal::SIGPIPE, SigHandler::SigIgn) };
}

/// Marks every descriptor above `fd` close-on-exec, so a command started next inherits none
/// of what this process was handed (the process driver's shim passes the agent binary as 4).
#[allow(unsafe_code)]
pub fn close_on_exec_above(fd: i32) {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let fds: Vec<i32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .filter(|&n| n > fd)
        .collect();
    for n in fds {
        // SAFETY: only the descriptor's flags change; it stays open and unowned. The
        // directory listing's own descriptor is closed by now and answers EBADF, ignored.
        let borrowed = unsafe { rustix::fd::BorrowedFd::borrow_raw(n) };
        let _ = rustix::io::fcntl_setfd(borrowed, rustix::io::FdFlags::CLOEXEC);
    }
}

/// `sbx-agent which CMD`: whether [`run`] would find CMD (a program on PATH, or a path with a
/// `/`, executable), with the same lookup as the agent's exec.
pub fn which(cmd: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let cwd = std::env::current_dir().unwrap_or_else(|_| "/".into());
    crate::server::find_program(cmd.as_ref(), &path, &cwd).is_some()
}

/// `sbx-agent run CMD ARGS…`: [`reset`], no descriptor but stdio passed on, a Landlock domain
/// of its own (see [`crate::confine`]; none where the kernel has no Landlock), then becomes
/// CMD (looked up on PATH). Returns only when CMD cannot be run: the message and the shell's
/// exit status for it (127 not found, 126 not executable).
pub fn run(args: &[String]) -> (String, u8) {
    const USAGE: &str = "usage: sbx-agent run [--user USER] [--workdir DIR] [--] CMD [ARGS…]";
    let (mut user, mut workdir, mut rest) = (None, None, args);
    loop {
        match rest {
            [flag, value, more @ ..] if flag == "--user" => (user, rest) = (Some(value), more),
            [flag, value, more @ ..] if flag == "--workdir" => {
                (workdir, rest) = (Some(value), more)
            }
            [flag, more @ ..] if flag == "--" => {
                rest = more;
                break;
            }
            _ => break,
        }
    }
    let Some((cmd, rest)) = rest.split_first() else {
        return (USAGE.to_string(), 2);
    };
    if let Err(e) = become_user(user.map(String::as_str), workdir.map(String::as_str)) {
        return (format!("sbx-agent run: {e}"), 126);
    }
    reset();
    close_on_exec_above(2);
    if let Err(e) = crate::confine::Domain::new().and_then(|d| d.enter())
        && !crate::confine::unsupported(&e)
    {
        // A kernel with Landlock that refuses it: the sandbox must not run unconfined.
        return (
            format!("sbx-agent run: cannot enter a Landlock domain: {e}"),
            126,
        );
    }
    let err = std::process::Command::new(cmd).args(rest).exec();
    match err.kind() {
        std::io::ErrorKind::NotFound => (format!("command not found: {cmd}"), 127),
        std::io::ErrorKind::PermissionDenied => (format!("permission denied: {cmd}"), 126),
        _ => (format!("{cmd}: {err}"), 126),
    }
}

/// `run --user USER --workdir DIR`, as a container runtime does it: USER (an image's `User`,
/// names looked up in this root's `/etc/passwd` and `/etc/group`) with its groups, and DIR
/// (made by root first when missing) as the directory. Runs as root, before the exec.
pub fn become_user(user: Option<&str>, workdir: Option<&str>) -> Result<(), String> {
    use nix::unistd::{Gid, Uid, setgroups, setresgid, setresuid};
    let resolved = match user {
        Some(user) => Some(crate::user::resolve(
            user,
            || crate::user::read_small("/etc/passwd"),
            || crate::user::read_small("/etc/group"),
        )?),
        None => None,
    };
    if let Some(dir) = workdir.filter(|d| !d.is_empty())
        && std::fs::symlink_metadata(dir).is_err()
    {
        std::fs::create_dir_all(dir).map_err(|e| format!("the working directory {dir}: {e}"))?;
    }
    if let Some(u) = resolved {
        let groups: Vec<Gid> = u
            .additional_gids
            .iter()
            .map(|g| Gid::from_raw(*g))
            .collect();
        setgroups(&groups).map_err(|e| format!("setgroups: {e}"))?;
        let gid = Gid::from_raw(u.gid);
        setresgid(gid, gid, gid).map_err(|e| format!("setgid {}: {e}", u.gid))?;
        let uid = Uid::from_raw(u.uid);
        setresuid(uid, uid, uid).map_err(|e| format!("setuid {}: {e}", u.uid))?;
    }
    if let Some(dir) = workdir.filter(|d| !d.is_empty()) {
        std::env::set_current_dir(dir).map_err(|e| format!("the working directory {dir}: {e}"))?;
    }
    Ok(())
}
