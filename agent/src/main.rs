//! `sbx-agent serve`: serves exec on the listening Unix socket inherited as fd 3;
//! `sbx-agent serve-port PATH`: on a `vm` guest's virtio-serial port. See the library's docs.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixListener;
use std::process::ExitCode;

/// The descriptor the driver hands the listening socket on.
const LISTEN_FD: i32 = 3;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("serve-port") {
        return serve_port(args.get(1).map(String::as_str));
    }
    match args.first().map(String::as_str) {
        Some("serve") => sbx_agent::signals::reset(),
        Some("which") => {
            let found = args.get(1).is_some_and(|c| sbx_agent::signals::which(c));
            return if found {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(1)
            };
        }
        Some("log") => {
            // The logger of one of the main process's streams: see the library's `log` module.
            return match sbx_agent::log::run(&args[1..]) {
                Ok(()) => ExitCode::SUCCESS,
                Err(message) => {
                    eprintln!("sbx-agent log: {message}");
                    ExitCode::from(2)
                }
            };
        }
        Some("run") => {
            let (message, code) = sbx_agent::signals::run(&args[1..]);
            eprintln!("{message}");
            return ExitCode::from(code);
        }
        Some("--help" | "-h") | None => {
            println!(
                "usage: sbx-agent serve | sbx-agent run CMD [ARGS…]\n\nserve: serves exec, \
                 copy and port-forward on the listening Unix socket inherited as fd {LISTEN_FD}.\n\
                 run: becomes CMD with every signal at its default action (a shell's \
                 background job starts with SIGINT ignored).\nStarted by a sandbox's init; \
                 not a command for people."
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

/// `sbx-agent serve-port PATH`: serves exec on the virtio-serial port at PATH (a `vm`
/// guest's `sbx.exec`), one exec at a time; see the library's `port` module.
fn serve_port(path: Option<&str>) -> ExitCode {
    let Some(path) = path else {
        eprintln!("usage: sbx-agent serve-port PATH (a virtio-serial port, /dev/vportNpM)");
        return ExitCode::from(2);
    };
    // The guest's init starts it as a background job, with SIGINT ignored.
    sbx_agent::signals::reset();
    match sbx_agent::port::serve(std::path::Path::new(path)) {
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
