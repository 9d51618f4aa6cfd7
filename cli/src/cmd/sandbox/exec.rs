//! `sbx sandbox exec`: a command in a sandbox, its stdin, stdout and stderr passed through
//! both ways, the local terminal raw for `-it`, and the signals that would end sbx forwarded.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use clap::Args;
use sbx_proto::v1::exec_input::Input;
use sbx_proto::v1::exec_output::Chunk;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{ExecExit, ExecInput, ExecOutput, ExecRequest, Tty};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, UnboundedReceiverStream};
use tonic_types::StatusExt;

use super::{SandboxTarget, WorkspaceScope, sandbox_ref};
use crate::args::{key_value_map, parse_key_value};
use crate::connect::{Channel, Target, connect};
use crate::terminal::{self, RawMode};
use crate::{CliError, size};

/// `sbx sandbox exec`: as `docker exec` / `kubectl exec`, stdin only with -i, a terminal only
/// with -t.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  sbx sandbox exec web -- ls -l /sandbox        run a command, print its output
  sbx sandbox exec -it web -- sh                an interactive shell on a terminal
  tar c dir | sbx sandbox exec -i web -- tar x  pipe input to the command
  sbx sandbox exec -u nobody web -- id          run it as another user of the sandbox

Without -i the command's stdin is empty (/dev/null) and sbx reads none of its own. Without -t,
Ctrl-C (SIGINT) and SIGTERM are sent to the command's process group and sbx waits for it to
end; a second Ctrl-C sends SIGKILL. With -it, Ctrl-C is typed into the remote terminal.

Exit status: the command's; 128+N when a signal N killed it; 124 when --timeout ended it;
127 when the command is not found; 1 when sbx itself failed; 2 for a usage error.")]
pub struct SandboxExecArgs {
    #[command(flatten)]
    pub scope: WorkspaceScope,
    #[command(flatten)]
    pub target: SandboxTarget,
    /// Pass sbx's stdin to the command (read as it comes, until its end). Without it the
    /// command's stdin is empty.
    #[arg(short = 'i', long = "stdin")]
    pub stdin: bool,
    /// Run the command on a terminal (a pty inside, with this terminal's size and TERM; output
    /// comes as one stream). With -i, this terminal goes raw so keys reach the command as typed.
    /// sbx's stdin must be a terminal.
    #[arg(short = 't', long = "tty")]
    pub tty: bool,
    /// The command's working directory inside the sandbox (default: the image's WORKDIR,
    /// else the user's home).
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<String>,
    /// Run the command as this user, as `docker exec -u`: NAME, UID, NAME:GROUP or UID:GID,
    /// looked up in the sandbox's /etc/passwd and /etc/group (default: the image's USER, else
    /// root). HOME, USER and LOGNAME are the user's.
    #[arg(short = 'u', long, value_name = "USER")]
    pub user: Option<String>,
    /// Kill the command after this long (seconds, or 30s, 2m, 1h; 0: no timeout); sbx then
    /// exits with 124.
    #[arg(long, value_name = "DURATION", default_value_t = 0, value_parser = size::parse_secs_u32)]
    pub timeout: u32,
    /// An environment variable for the command, KEY=VALUE; repeatable.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

/// The exec's start message. `tty` is what `-t` found out about the local terminal (its size
/// and TERM; None without -t): reading it is IO, so the caller does it.
pub fn exec_request(args: &SandboxExecArgs, tty: Option<Tty>) -> Result<ExecRequest, CliError> {
    Ok(ExecRequest {
        sandbox: Some(sandbox_ref(&args.scope, &args.target)),
        command: args.command.clone(),
        env: key_value_map("--env", &args.env)?,
        timeout_seconds: args.timeout,
        workdir: args.workdir.clone().unwrap_or_default(),
        stdin: args.stdin,
        tty,
        user: args.user.clone().unwrap_or_default(),
    })
}

/// `sbx sandbox exec`.
pub async fn run_exec(target: &Target, args: &SandboxExecArgs) -> Result<u8, CliError> {
    // -t needs a terminal to take the size and keystrokes from.
    if args.tty && !terminal::stdin_is_terminal() {
        return Err(CliError::NotATerminal);
    }
    let tty = args
        .tty
        .then(|| terminal::tty_request(std::env::var("TERM").ok()));
    let req = exec_request(args, tty)?;
    let mut client = SandboxServiceClient::new(connect(target).await?);
    exec(&mut client, req).await
}

/// The CLI's exit code for a finished exec: killed by signal N → 128+N; else the command's
/// code. Codes a Unix process cannot have are mapped so they never read as success: a negative
/// code without a signal → 1, above 255 → 255.
pub fn exec_exit_code(exit: &ExecExit) -> u8 {
    if exit.signal > 0 {
        return u8::try_from(128 + i64::from(exit.signal)).unwrap_or(255);
    }
    match exit.code {
        code if code < 0 => 1,
        code => u8::try_from(code).unwrap_or(255),
    }
}

/// Writes one exec message through: stdout bytes to `out`, stderr bytes to `err`, flushed at
/// once so interactive output appears as it arrives. Returns the exit code on the exit message.
pub fn pass_exec_output(
    message: ExecOutput,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<Option<u8>, CliError> {
    match message.chunk {
        Some(Chunk::Stdout(bytes)) => {
            out.write_all(&bytes)?;
            out.flush()?;
            Ok(None)
        }
        Some(Chunk::Stderr(bytes)) => {
            err.write_all(&bytes)?;
            err.flush()?;
            Ok(None)
        }
        Some(Chunk::Exit(exit)) => Ok(Some(exec_exit_code(&exit))),
        // An empty message from a newer gateway: nothing to pass through.
        None => Ok(None),
    }
}

/// Runs the exec and returns the exit code the CLI should end with. What is sent besides the
/// start follows from `request`: stdin read from sbx's own when `request.stdin` (-i), the local
/// terminal made raw when that and `request.tty` (-it), window-size changes with a tty, and the
/// signals that would end sbx forwarded (see [`Interrupts`]).
pub async fn exec(
    client: &mut SandboxServiceClient<Channel>,
    request: ExecRequest,
) -> Result<u8, CliError> {
    let began = Instant::now();
    let timeout = request.timeout_seconds;
    let tty = request.tty.is_some();
    let interactive = request.stdin;
    // Handlers first: from here on SIGINT/SIGTERM/SIGHUP no longer end sbx by themselves, so
    // they cannot leave a raw terminal behind.
    let mut interrupts = Interrupts::new()?;
    let mut resizes = if tty {
        Some(signal(SignalKind::window_change()).map_err(setup("handle SIGWINCH"))?)
    } else {
        None
    };
    // Lives until this function returns, so the terminal is restored before any error is
    // printed by the caller.
    let _raw = if tty && interactive {
        Some(RawMode::enter().map_err(setup("put the terminal on stdin into raw mode"))?)
    } else {
        None
    };
    let stdin = if interactive {
        spawn_stdin_reader()?
    } else {
        // Nothing to read: the command's stdin is /dev/null and the stream sends no stdin.
        mpsc::channel(1).1
    };
    let (control, control_rx) = mpsc::unbounded_channel::<ExecInput>();
    let start = ExecInput {
        input: Some(Input::Start(request)),
    };
    // Signals and resizes have their own channel so they are never stuck behind stdin chunks
    // the gateway is not taking yet.
    let outgoing = tokio_stream::once(start)
        .chain(UnboundedReceiverStream::new(control_rx).merge(ReceiverStream::new(stdin)));
    let failed = |status: tonic::Status| exec_failure(status, timeout, began.elapsed());
    let mut stream = client.exec(outgoing).await.map_err(failed)?.into_inner();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    loop {
        tokio::select! {
            message = stream.message() => match message.map_err(failed)? {
                Some(message) => {
                    // The command's timeout ended it: exit 124, saying so.
                    if let Some(Chunk::Exit(exit)) = &message.chunk
                        && exit.timed_out
                    {
                        return Err(CliError::ExecTimedOut { seconds: timeout });
                    }
                    if let Some(code) = pass_exec_output(message, &mut out, &mut err)? {
                        return Ok(code);
                    }
                }
                None => return Err(CliError::ExecWithoutExit),
            },
            number = interrupts.next() => {
                let number = number.ok_or(CliError::ExecAbandoned)?;
                // The gateway gone is seen on the output side; nothing to do here.
                let _ = control.send(ExecInput { input: Some(Input::Signal(number)) });
            }
            Some(()) = next_resize(&mut resizes) => {
                if let Some(size) = terminal::stdin_size() {
                    let _ = control.send(ExecInput { input: Some(Input::Resize(size)) });
                }
            }
        }
    }
}

/// Bytes read from stdin per message (and per read): 32 KiB.
const STDIN_CHUNK: usize = 32 * 1024;
/// Chunks waiting for the gateway before the reader stops reading: with [`STDIN_CHUNK`],
/// at most 4 × 32 KiB = 128 KiB of stdin is held, whatever its size (the gRPC stream's own
/// flow-control window comes on top).
const STDIN_CHUNKS_IN_FLIGHT: usize = 4;

/// Reads stdin on a thread of its own (a blocking read cannot be cancelled; the thread is
/// simply left behind when the command ends first, so sbx never waits for more input) and
/// passes it on as it comes: stdin chunks through a bounded channel (back-pressure: the read
/// waits while the gateway is not taking), then close_stdin at its end. A read error (a
/// terminal hung up: EIO) counts as the end.
fn spawn_stdin_reader() -> Result<mpsc::Receiver<ExecInput>, CliError> {
    let (tx, rx) = mpsc::channel(STDIN_CHUNKS_IN_FLIGHT);
    std::thread::Builder::new()
        .name("sbx-stdin".into())
        .spawn(move || {
            let mut stdin = std::io::stdin();
            let mut buf = vec![0u8; STDIN_CHUNK];
            loop {
                let n = match stdin.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(_) => break,
                };
                let chunk = ExecInput {
                    input: Some(Input::Stdin(buf[..n].to_vec())),
                };
                if tx.blocking_send(chunk).is_err() {
                    // The exec is over.
                    return;
                }
            }
            let _ = tx.blocking_send(ExecInput {
                input: Some(Input::CloseStdin(true)),
            });
        })
        .map_err(setup("start the thread that reads stdin"))?;
    Ok(rx)
}

/// The next window-size change, or never when there is no terminal.
async fn next_resize(resizes: &mut Option<Signal>) -> Option<()> {
    match resizes {
        Some(signal) => signal.recv().await,
        None => std::future::pending().await,
    }
}

/// The signals that would end sbx — SIGINT (Ctrl-C without -t), SIGTERM, SIGHUP — turned into
/// what to send the command: the first one as itself, the second SIGKILL (as kubectl and
/// docker users press Ctrl-C again when a command ignores the first), and on the third sbx
/// stops waiting.
struct Interrupts {
    int: Signal,
    term: Signal,
    hup: Signal,
    seen: u32,
}

impl Interrupts {
    fn new() -> Result<Interrupts, CliError> {
        let handle = |kind, what| signal(kind).map_err(setup(what));
        Ok(Interrupts {
            int: handle(SignalKind::interrupt(), "handle SIGINT")?,
            term: handle(SignalKind::terminate(), "handle SIGTERM")?,
            hup: handle(SignalKind::hangup(), "handle SIGHUP")?,
            seen: 0,
        })
    }

    /// The signal number to send for the next interrupt, or None when it is time to give up.
    async fn next(&mut self) -> Option<i32> {
        let number = tokio::select! {
            _ = self.int.recv() => 2,
            _ = self.term.recv() => 15,
            _ = self.hup.recv() => 1,
        };
        self.seen += 1;
        escalate(self.seen, number)
    }
}

/// What the `seen`-th interrupt (1-based) of signal `number` sends: itself, then 9, then None.
fn escalate(seen: u32, number: i32) -> Option<i32> {
    match seen {
        1 => Some(number),
        2 => Some(9),
        _ => None,
    }
}

/// The error for a failed exec call or stream (a command its timeout ended ends with an exit
/// that says so: see [`exec`]). DEADLINE_EXCEEDED once `--timeout` has passed is the command's
/// timeout too, as a gateway before `ExecExit.timed_out` said it (a driver deadline is reported with the same code, but cannot
/// come after the full timeout has run: it is reported as the gateway said). A status without
/// the gateway's ErrorInfo is the transport's (connection reset, sbxd gone): the stream broke.
fn exec_failure(status: tonic::Status, timeout: u32, elapsed: Duration) -> CliError {
    if status.code() == tonic::Code::DeadlineExceeded
        && timeout > 0
        && elapsed >= Duration::from_secs(u64::from(timeout))
    {
        CliError::ExecTimedOut { seconds: timeout }
    } else if status.get_details_error_info().is_none() {
        CliError::ExecBroken(status)
    } else {
        CliError::Rpc(status)
    }
}

/// Maps a local setup failure to [`CliError::ExecSetup`] saying what failed.
fn setup(what: &'static str) -> impl Fn(std::io::Error) -> CliError {
    move |cause| CliError::ExecSetup { what, cause }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        let check = |code: i32, signal: i32, expected: u8| {
            assert_eq!(
                exec_exit_code(&ExecExit {
                    code,
                    signal,
                    timed_out: false,
                }),
                expected,
                "code {code} signal {signal}"
            );
        };
        check(0, 0, 0);
        check(3, 0, 3);
        check(255, 0, 255);
        check(256, 0, 255);
        check(-1, 9, 137);
        check(-1, 15, 143);
        check(-1, 2, 130);
        check(-1, 0, 1);
        check(-1, 200, 255);
    }

    #[test]
    fn interrupts_escalate_to_sigkill_then_give_up() {
        assert_eq!(escalate(1, 2), Some(2));
        assert_eq!(escalate(1, 15), Some(15));
        assert_eq!(escalate(2, 2), Some(9));
        assert_eq!(escalate(3, 2), None);
    }

    #[test]
    fn a_deadline_after_the_timeout_is_the_commands_timeout() {
        let deadline = || {
            tonic::Status::with_error_details(
                tonic::Code::DeadlineExceeded,
                "exec did not finish within 2s",
                tonic_types::ErrorDetails::with_error_info(
                    "DRIVER_DEADLINE_EXCEEDED",
                    "sbx.dev",
                    std::collections::HashMap::new(),
                ),
            )
        };
        let after = Duration::from_millis(2_100);
        assert!(matches!(
            exec_failure(deadline(), 2, after),
            CliError::ExecTimedOut { seconds: 2 }
        ));
        // Before the timeout has run, or without one, it is a deadline of the gateway's.
        let early = Duration::from_millis(500);
        assert!(matches!(
            exec_failure(deadline(), 2, early),
            CliError::Rpc(_)
        ));
        assert!(matches!(
            exec_failure(deadline(), 0, after),
            CliError::Rpc(_)
        ));
        // A status the gateway did not make (no ErrorInfo) is the connection's.
        assert!(matches!(
            exec_failure(tonic::Status::unavailable("connection reset"), 2, early),
            CliError::ExecBroken(_)
        ));
    }

    #[test]
    fn exec_output_is_passed_through_by_stream() {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let messages = [
            Chunk::Stdout(b"hello ".to_vec()),
            Chunk::Stderr(b"oops\n".to_vec()),
            Chunk::Stdout(vec![0xff, b'\n']),
        ];
        for chunk in messages {
            let got = pass_exec_output(ExecOutput { chunk: Some(chunk) }, &mut out, &mut err);
            assert_eq!(got.unwrap(), None);
        }
        assert_eq!(
            pass_exec_output(ExecOutput { chunk: None }, &mut out, &mut err).unwrap(),
            None
        );
        let exit = ExecOutput {
            chunk: Some(Chunk::Exit(ExecExit {
                code: 7,
                signal: 0,
                timed_out: false,
            })),
        };
        assert_eq!(pass_exec_output(exit, &mut out, &mut err).unwrap(), Some(7));
        assert_eq!(out, b"hello \xff\n");
        assert_eq!(err, b"oops\n");
    }
}
