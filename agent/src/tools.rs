//! `sbx-agent pack PATH`, `sbx-agent unpack DEST`, `sbx-agent connect PORT`: copy and
//! port-forward as plain commands, for a transport that carries exec only — a `vm` guest's
//! virtio ports ([`crate::port`]), one exec at a time each. The `vm` driver runs them through
//! its exec path; the socket drivers (oci, process) do the same work inside the agent's
//! server instead, with the same functions ([`crate::archive`]) and the same error kinds.
//!
//! - `pack PATH` writes the tar of PATH to stdout ([`crate::archive::pack`], named the way
//!   `docker cp` names it). An unreadable PATH fails before any byte is written.
//! - `unpack DEST` reads a tar from stdin into DEST ([`crate::archive::unpack`]: an entry that
//!   would leave DEST is refused), and reads stdin to its end also after a failure: the
//!   agent writing it runs with SIGPIPE at its default action, so a command that exits
//!   with input still coming would end that agent.
//! - `connect PORT` connects to `127.0.0.1:PORT` (at most [`CONNECT_TIMEOUT`]) and carries
//!   stdin to the connection and the connection to stdout. The end of stdin half-closes the
//!   connection (`shutdown(Write)`); the connection's end is said on stderr; the command
//!   exits once both directions are done. On stderr, one line each, in this order:
//!   [`CONNECTED`] once connected (before any byte of the connection), then
//!   `closed N` ([`CLOSED`]) when the connection's side ended, N being every byte written to
//!   stdout: stdout and stderr reach the host through two pipes, read by two threads, so
//!   the host holds the `closed` back until it has passed on N bytes.
//!
//! A failure is one line on stderr (naming the path or the port) and one of these exit
//! statuses, which the host maps to the errors the socket drivers give for the same failure:
//!
//! | status | meaning                                                      | host's error       |
//! |--------|--------------------------------------------------------------|--------------------|
//! | 0      | done                                                         | —                  |
//! | 1      | [`INTERNAL`]: anything else (an IO error of the agent's own) | Internal           |
//! | 2      | [`USAGE`]: arguments the command does not take               | Internal           |
//! | 3      | [`INVALID`]: the caller's path is missing or unusable, or an archive entry leaves the destination | InvalidArgument |
//! | 4      | [`NOT_LISTENING`]: nothing accepts connections on the port    | FailedPrecondition |
//!
//! (126 and 127 are the exec's own: the agent binary missing from the guest.)

use std::io::{self, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use crate::server::{FORWARD_CONNECT_TIMEOUT, callers_fault};
use crate::wire::MAX_PAYLOAD;

/// Exit status: an error of the agent's own.
pub const INTERNAL: u8 = 1;
/// Exit status: arguments the command does not take.
pub const USAGE: u8 = 2;
/// Exit status: the caller's fault (a missing or unusable path, an escaping archive entry).
pub const INVALID: u8 = 3;
/// Exit status of `connect`: nothing accepts connections on the port.
pub const NOT_LISTENING: u8 = 4;

/// `connect`'s stderr line once the connection is made.
pub const CONNECTED: &str = "connected";
/// `connect`'s stderr line, followed by a space and the count of bytes written to stdout,
/// when the connection's side has ended.
pub const CLOSED: &str = "closed";

/// How long `connect` waits for the port to accept (as the socket server's forward).
pub const CONNECT_TIMEOUT: Duration = FORWARD_CONNECT_TIMEOUT;

/// A failure: the line for stderr and the exit status.
#[derive(Debug, PartialEq, Eq)]
pub struct ToolError {
    pub status: u8,
    pub message: String,
}

impl ToolError {
    fn io(what: &str, e: &io::Error) -> ToolError {
        // archive's errors already name their path; say it once.
        let message = if e.to_string().contains(what) {
            e.to_string()
        } else {
            format!("{what}: {e}")
        };
        ToolError {
            status: if callers_fault(e) { INVALID } else { INTERNAL },
            message,
        }
    }
}

/// Runs `sbx-agent COMMAND ARGS` for `pack`, `unpack` and `connect` on the process's stdio.
pub fn main(command: &str, args: &[String]) -> ExitCode {
    let result = match (command, args) {
        ("pack", [path]) => pack(
            Path::new(path),
            BufWriter::with_capacity(MAX_PAYLOAD, io::stdout().lock()),
        ),
        ("unpack", [dest]) => {
            let mut stdin = io::stdin().lock();
            let unpacked = unpack(&mut stdin, Path::new(dest)).map(|_| ());
            // Read to the end whatever happened (a refused entry, the tar's trailing zeros):
            // the agent that writes our stdin dies of SIGPIPE if we exit before it is done.
            let _ = io::copy(&mut stdin, &mut io::sink());
            unpacked
        }
        ("connect", [port]) => match port.parse::<u16>() {
            Ok(port) if port > 0 => connect(port, io::stdin(), io::stdout(), io::stderr()),
            _ => Err(ToolError {
                status: USAGE,
                message: format!("{port:?} is not a TCP port"),
            }),
        },
        _ => Err(ToolError {
            status: USAGE,
            message: format!(
                "usage: sbx-agent {command} {}",
                match command {
                    "pack" => "PATH",
                    "unpack" => "DEST",
                    _ => "PORT",
                }
            ),
        }),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sbx-agent {command}: {}", e.message);
            ExitCode::from(e.status)
        }
    }
}

/// Writes the tar of `path` to `out`.
pub fn pack(path: &Path, mut out: impl Write) -> Result<(), ToolError> {
    let what = path.display().to_string();
    crate::archive::pack(path, &mut out)
        .and_then(|()| out.flush())
        .map_err(|e| ToolError::io(&what, &e))
}

/// Unpacks the tar read from `input` at `dest`; how many entries.
pub fn unpack(input: impl Read, dest: &Path) -> Result<u64, ToolError> {
    crate::archive::unpack(input, dest).map_err(|e| ToolError::io(&dest.display().to_string(), &e))
}

/// Carries `input` to `127.0.0.1:port` and the connection to `output`, saying on `status`
/// when connected and when the connection's side ended (see the module docs); returns once
/// both directions are done.
pub fn connect(
    port: u16,
    mut input: impl Read,
    mut output: impl Write + Send,
    mut status: impl Write + Send,
) -> Result<(), ToolError> {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let tcp = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).map_err(|e| ToolError {
        status: NOT_LISTENING,
        message: format!("nothing accepts connections on {addr} in the sandbox ({e})"),
    })?;
    let _ = tcp.set_nodelay(true);
    let mut from_port = tcp
        .try_clone()
        .map_err(|e| ToolError::io("duplicating the connection", &e))?;
    let mut to_port = tcp;
    writeln!(status, "{CONNECTED}")
        .and_then(|()| status.flush())
        .map_err(|e| ToolError::io("stderr", &e))?;
    std::thread::scope(|scope| {
        scope.spawn(move || {
            let mut buf = vec![0u8; MAX_PAYLOAD];
            let mut sent: u64 = 0;
            loop {
                // A reset connection ends this direction as its end does.
                let n = match from_port.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                if output
                    .write_all(&buf[..n])
                    .and_then(|()| output.flush())
                    .is_err()
                {
                    // Nobody reads any more: the connection's data has nowhere to go.
                    let _ = from_port.shutdown(Shutdown::Read);
                    break;
                }
                sent += n as u64;
            }
            let _ = writeln!(status, "{CLOSED} {sent}").and_then(|()| status.flush());
        });
        let mut buf = vec![0u8; MAX_PAYLOAD];
        let mut open = true;
        loop {
            let n = match input.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => break,
            };
            // A connection that no longer takes data: the rest of the input is read and
            // dropped, as the socket server does, until it ends.
            if open && to_port.write_all(&buf[..n]).is_err() {
                open = false;
            }
        }
        let _ = to_port.shutdown(Shutdown::Write);
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    #[test]
    fn pack_and_unpack_round_trip_and_refuse_what_the_socket_refuses() {
        let tmp = tempfile::tempdir().unwrap();
        let src = tmp.path().join("src");
        std::fs::create_dir_all(src.join("sub")).unwrap();
        std::fs::write(src.join("sub/data"), vec![5u8; 200_000]).unwrap();
        let mut tar = Vec::new();
        pack(&src, &mut tar).unwrap();
        let dest = tmp.path().join("dest");
        assert_eq!(unpack(&tar[..], &dest).unwrap(), 3);
        assert_eq!(
            std::fs::read(dest.join("sub/data")).unwrap(),
            vec![5u8; 200_000]
        );

        // A missing path: the caller's, named once, before any byte.
        let missing = tmp.path().join("missing");
        let mut none = Vec::new();
        let err = pack(&missing, &mut none).unwrap_err();
        assert_eq!(err.status, INVALID, "{err:?}");
        assert_eq!(err.message.matches("missing").count(), 1, "{err:?}");
        assert!(none.is_empty());
        // An entry that leaves the destination.
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(1);
        h.as_old_mut().name[..9].copy_from_slice(b"../escape");
        h.set_cksum();
        let mut b = tar::Builder::new(Vec::new());
        b.append(&h, &b"x"[..]).unwrap();
        let hostile = b.into_inner().unwrap();
        let err = unpack(&hostile[..], &dest).unwrap_err();
        assert_eq!(err.status, INVALID, "{err:?}");
        assert!(!tmp.path().join("escape").exists());
        // Something that is not a tar at all is no path's fault.
        let err = unpack(&[1u8; 1024][..], &tmp.path().join("other")).unwrap_err();
        assert_ne!(err.status, 0, "{err:?}");
    }

    /// A writer whose bytes the test reads afterwards.
    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn connect_carries_both_ways_and_honours_the_half_close() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let sent: Vec<u8> = (0..150_000u32).map(|i| (i % 251) as u8).collect();
        // The server reads to the end (which only the half-close gives), then answers with
        // what it read, reversed, and closes.
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut got = Vec::new();
            conn.read_to_end(&mut got).unwrap();
            got.reverse();
            conn.write_all(&got).unwrap();
        });
        let (out, status) = (Shared::default(), Shared::default());
        connect(port, &sent[..], out.clone(), status.clone()).unwrap();
        server.join().unwrap();
        let mut want = sent.clone();
        want.reverse();
        assert!(*out.0.lock().unwrap() == want, "the answer differs");
        assert_eq!(
            String::from_utf8(status.0.lock().unwrap().clone()).unwrap(),
            format!("{CONNECTED}\n{CLOSED} {}\n", want.len())
        );
    }

    #[test]
    fn a_port_nobody_listens_on_is_its_own_status() {
        // A port just freed: nothing listens there.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let status = Shared::default();
        let err = connect(port, &b""[..], Shared::default(), status.clone()).unwrap_err();
        assert_eq!(err.status, NOT_LISTENING, "{err:?}");
        assert!(err.message.contains(&port.to_string()), "{err:?}");
        assert!(status.0.lock().unwrap().is_empty(), "connected said anyway");
    }

    #[test]
    fn the_binary_exits_with_the_statuses() {
        // Through `main` as the host runs it: the agent binary is not built for this crate's
        // tests, so the argument checks run in process.
        assert_eq!(main("connect", &["0".into()]), ExitCode::from(USAGE));
        assert_eq!(main("pack", &[]), ExitCode::from(USAGE));
        assert_eq!(
            main("pack", &["/nonexistent/sbx-tools-test".into()]),
            ExitCode::from(INVALID)
        );
    }
}
