//! `sbx-agent serve`: serves exec on the listening Unix socket inherited as fd 3;
//! `sbx-agent serve-port PATH`: on a `vm` guest's virtio-serial port; `sbx-agent pack`,
//! `unpack` and `connect`: copy and port-forward as commands, which the `vm` driver runs
//! through exec (the library's `tools` module). See the library's docs.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::process::ExitCode;

/// The descriptor the driver hands the listening socket on.
const LISTEN_FD: i32 = 3;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve-port") {
        return serve_port(&args[1..]);
    }
    match args.first().map(String::as_str) {
        Some(tool @ ("pack" | "unpack" | "connect")) => {
            return sbx_agent::tools::main(tool, &args[1..]);
        }
        Some("serve") => {
            not_dumpable();
            sbx_agent::signals::reset();
            sbx_agent::signals::ignore_broken_pipe();
            // `--user USER`: who an exec that names none runs as (the image's User).
            let mut rest = args[1..].to_vec();
            if let Some(at) = rest.iter().position(|a| a == "--user") {
                let Some(user) = rest.get(at + 1).cloned() else {
                    eprintln!("sbx-agent serve: --user needs a value");
                    return ExitCode::from(2);
                };
                sbx_agent::server::default_user(user);
                rest.drain(at..at + 2);
            }
            // `--drop-id-caps`: the agent keeps CAP_SETUID, CAP_SETGID and CAP_SETPCAP (the
            // process driver's) for execs as other users; each exec drops them.
            if let Some(at) = rest.iter().position(|a| a == "--drop-id-caps") {
                sbx_agent::server::drop_id_caps();
                rest.remove(at);
            }
            if let Err(message) = isolate_execs(&rest) {
                eprintln!("sbx-agent serve: {message}");
                return ExitCode::from(2);
            }
        }
        // Whether `run` would find CMD; with --record, a CMD not found is said on stdout (the
        // sandbox's log) as a stderr record of the log's, `command not found: CMD`, so that
        // `logs` shows it on stderr, as the workload's own stderr would.
        Some("which") => {
            let (record, name) = match args.get(1).map(String::as_str) {
                Some("--record") => (true, args.get(2)),
                _ => (false, args.get(1)),
            };
            let found = name.is_some_and(|c| sbx_agent::signals::which(c));
            if !found && record {
                use std::io::Write;
                let mut said = Vec::new();
                let words = format!("command not found: {}\n", name.map_or("", |n| n.as_str()));
                sbx_agent::log::Recorder::new(sbx_agent::log::Stream::Stderr).push(
                    words.as_bytes(),
                    std::time::SystemTime::now(),
                    &mut said,
                );
                let _ = std::io::stdout().write_all(&said);
            }
            return if found {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            };
        }
        // The logger of one of the main process's streams: see the library's `log` module.
        Some("log") => {
            not_dumpable();
            return outcome("log", sbx_agent::log::run(&args[1..]));
        }
        // One copy of a stopped sandbox's files, on the host: see the library's `offline`.
        Some("offline") => {
            sbx_agent::signals::ignore_broken_pipe();
            return outcome("offline", sbx_agent::offline::run(&args[1..]));
        }
        Some("run") => {
            let (message, code) = sbx_agent::signals::run(&args[1..]);
            eprintln!("{message}");
            return ExitCode::from(code);
        }
        Some("--help" | "-h") | None => {
            println!(
                "usage: sbx-agent serve [--pts DIR] [--user USER] [--drop-id-caps] | serve-port PATH [--workdir DIR] [--user USER] | run [--user USER] [--workdir DIR] \
                 [--] CMD [ARGS…] | pack PATH | \
                 unpack DEST | connect PORT | offline …\n\n\
                 serve: serves exec, copy and port-forward on the listening Unix socket \
                 inherited as fd {LISTEN_FD}; exec terminals from the devpts instance at \
                 --pts DIR (else /dev/ptmx's); an exec that names no user runs as USER \
                 (else root).\n\
                 serve-port: serves exec on a vm guest's virtio-serial port, one at a time.\n\
                 run: becomes CMD with every signal at its default action (a shell's \
                 background job starts with SIGINT ignored), as USER (an image's User, \
                 names looked up in /etc/passwd and /etc/group) in DIR when given.\n\
                 pack: writes the tar of PATH to stdout (rooted at PATH's name).\n\
                 unpack: reads a tar from stdin into DEST (entries that leave DEST refused).\n\
                 connect: carries stdin to 127.0.0.1:PORT and the connection to stdout; \
                 says \"connected\" and \"closed N\" on stderr.\n\
                 Exit status of pack, unpack and connect: 0 done, 1 internal, 2 usage, \
                 3 the caller's path or archive, 4 nothing listens on PORT.\n\
                 offline: one copy of a stopped sandbox's files, on the host, confined to \
                 them ({}).\n\
                 Started by a sandbox's init or its driver; not a command for people.",
                sbx_agent::offline::USAGE
            );
            return ExitCode::SUCCESS;
        }
        Some(other) => {
            eprintln!("sbx-agent: unknown command {other:?} (try --help)");
            return ExitCode::from(2);
        }
    }
    // The process driver's shim hands the agent binary over as fd 4: no exec'd command gets it.
    sbx_agent::signals::close_on_exec_above(LISTEN_FD);
    let Some(listener) = inherited_listener() else {
        eprintln!("sbx-agent: fd {LISTEN_FD} is not a listening Unix socket");
        return ExitCode::from(2);
    };
    match sbx_agent::server::serve(listener) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sbx-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The agent and the loggers hold what the workload must not reach (the listening socket, the
/// pipes and terminals of every exec, the log file): not dumpable, so that no process of the
/// sandbox without `CAP_SYS_PTRACE` — none has it — can open their `/proc/<pid>/mem` or
/// `fd/`, or attach to them, even one of the same uid. (An exec'd command is a program of its
/// own again, dumpable once it runs: see the driver's known limits.)
fn not_dumpable() {
    if let Err(e) =
        rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
    {
        eprintln!("sbx-agent: cannot make itself undumpable: {e}");
    }
}

/// `serve`'s arguments: `[--pts DIR]`, where the devpts instance the driver mounted for exec
/// terminals is (see the library's `server` module). Execs go into Landlock domains of their
/// own; where the kernel has no Landlock that is said once, on stderr (the agent's log), and
/// execs run as before.
fn isolate_execs(args: &[String]) -> Result<(), String> {
    let pts = match args {
        [] => None,
        [flag, dir] if flag == "--pts" => {
            use rustix::fs::{Mode, OFlags};
            let opened = rustix::fs::open(
                dir.as_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| format!("--pts {dir}: {e}"))?;
            let fs = rustix::fs::fstatfs(&opened).map_err(|e| format!("--pts {dir}: {e}"))?;
            const DEVPTS_SUPER_MAGIC: i64 = 0x1cd1;
            if fs.f_type as i64 != DEVPTS_SUPER_MAGIC {
                return Err(format!("--pts {dir}: not a devpts instance"));
            }
            Some(opened)
        }
        _ => return Err(format!("unknown arguments {args:?} (try --help)")),
    };
    let domain = match sbx_agent::confine::Domain::new() {
        Ok(domain) => Some(domain),
        Err(e) if sbx_agent::confine::unsupported(&e) => {
            eprintln!(
                "sbx-agent: this kernel has no Landlock ({e}): execs and the workload can \
                 open each other's descriptors and memory"
            );
            None
        }
        Err(e) => return Err(format!("a Landlock ruleset for execs: {e}")),
    };
    sbx_agent::server::isolate(domain, pts);
    Ok(())
}

/// A command's result as the exit status: 0, or 2 with its message on stderr.
fn outcome(command: &str, result: Result<(), String>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("sbx-agent {command}: {message}");
            ExitCode::from(2)
        }
    }
}

/// `sbx-agent serve-port PATH [--workdir DIR] [--user USER]`: serves exec on the
/// virtio-serial port at PATH (a `vm` guest's `sbx.exec`), one exec at a time, an exec
/// without a directory of its own starting in DIR (a sandbox image's WorkingDir; when it is
/// not there, where the agent started), as USER unless it names another (the image's User,
/// as an oci sandbox's execs run); see the library's `port` module.
fn serve_port(args: &[String]) -> ExitCode {
    const USAGE: &str = "usage: sbx-agent serve-port PATH [--workdir DIR] [--user USER] (PATH: \
                         a virtio-serial port, /dev/vportNpM)";
    let Some((path, mut rest)) = args.split_first() else {
        eprintln!("{USAGE}");
        return ExitCode::from(2);
    };
    let (mut workdir, mut user) = (None, None);
    loop {
        match rest {
            [] => break,
            [flag, dir, more @ ..] if flag == "--workdir" => (workdir, rest) = (Some(dir), more),
            [flag, who, more @ ..] if flag == "--user" => (user, rest) = (Some(who), more),
            _ => {
                eprintln!("{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let path = path.as_str();
    if let Some(dir) = workdir
        && !dir.is_empty()
        && std::env::set_current_dir(dir).is_err()
    {
        eprintln!("sbx-agent serve-port: the working directory {dir} cannot be entered");
    }
    // The guest's init starts it as a background job, with SIGINT ignored.
    sbx_agent::signals::reset();
    sbx_agent::signals::ignore_broken_pipe();
    if let Err(message) = isolate_execs(&[]) {
        eprintln!("sbx-agent serve-port: {message}");
        return ExitCode::from(2);
    }
    let port = match sbx_agent::port::open(std::path::Path::new(path)) {
        Ok(port) => port,
        Err(e) => {
            eprintln!("sbx-agent: the exec port {path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    // The agent stays root, so that an exec may name any user; one that names none runs as
    // USER (the image's User), as the workload does.
    if let Some(user) = user {
        sbx_agent::server::default_user(user.clone());
    }
    match sbx_agent::port::serve_file(port) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sbx-agent: the exec port {path}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The listening socket on fd 3, after checking it is one; marked close-on-exec, so no exec'd
/// command inherits it.
#[allow(unsafe_code)]
fn inherited_listener() -> Option<UnixListener> {
    use rustix::fs::FileType;
    use rustix::io::FdFlags;
    // SAFETY: descriptor 3 is handed to this process by its parent for this purpose; nothing
    // else in the agent opens or closes it, and it is checked to be an open socket before
    // it is owned.
    let borrowed = unsafe { rustix::fd::BorrowedFd::borrow_raw(LISTEN_FD) };
    let stat = rustix::fs::fstat(borrowed).ok()?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::Socket {
        return None;
    }
    rustix::io::fcntl_setfd(borrowed, FdFlags::CLOEXEC).ok()?;
    // SAFETY: as above; from here the descriptor is owned by the listener alone.
    let owned = unsafe { OwnedFd::from_raw_fd(LISTEN_FD) };
    Some(UnixListener::from(owned))
}
