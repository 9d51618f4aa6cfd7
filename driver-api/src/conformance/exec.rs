//! Checks of the bidirectional exec: stdin byte-exact both ways (chunks of 200 KiB cross the
//! agent's frame size), an empty stdin without input, a terminal of the asked size and its
//! resize, signals, the working directory and environment, a command not found (127), a
//! dropped output stream that ends the command, and `Unimplemented` for what a driver lacks.
//!
//! Each check looks at the capabilities first and prints why it skips when one it needs is
//! absent (`exec_stdin`, `exec_tty`), or when the harness says the driver's exec runs no real
//! processes ([`DriverHarness::runs_processes`]: the sim knows only its built-ins). A driver
//! without `exec_stdin` (vm) also has no live connection to a running command: its output
//! comes after the command ended, so signals and dropped streams are checked only where
//! `exec_stdin` is reported.

use std::time::Duration;

use futures::channel::mpsc;
use futures::{Stream, StreamExt};
use tokio::time::{Instant, sleep, timeout};

use super::DriverHarness;
use super::session::{Session, run_check};
use crate::{DriverError, DriverStream, ExecInputStream, no_exec_input, pb};

use pb::exec_input::Input;
use pb::exec_output::Chunk;

/// How soon a signal must end the command, and a dropped stream the command's processes.
const PROMPTLY: Duration = Duration::from_secs(5);

/// The agent's frame payload is 64 KiB; this chunk crosses it three times.
const BIG_CHUNK: usize = 200 * 1024;

/// A directory no sandbox has.
const MISSING_DIR: &str = "/nonexistent-sbx-dir";

/// What an exec produced, byte-exact.
#[derive(Debug, Default)]
struct Ran {
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// `None` when the stream ended without an exit.
    exit: Option<pb::ExecExit>,
}

impl Ran {
    fn stdout_text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    fn stderr_text(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }

    /// `(code, signal)` of the exit, `None` without one.
    fn exit(&self) -> Option<(i32, i32)> {
        self.exit.as_ref().map(|e| (e.code, e.signal))
    }
}

/// An input stream the check writes to while the command runs; dropping the sender ends it.
fn input_channel() -> (mpsc::UnboundedSender<pb::ExecInput>, ExecInputStream) {
    let (tx, rx) = mpsc::unbounded();
    (tx, Box::pin(rx))
}

fn input(input: Input) -> pb::ExecInput {
    pb::ExecInput { input: Some(input) }
}

fn argv(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| w.to_string()).collect()
}

/// A terminal of `rows` x `cols`, of the default type.
fn tty(rows: u32, cols: u32) -> Option<pb::Tty> {
    Some(pb::Tty {
        rows,
        cols,
        term: String::new(),
    })
}

fn request(id: &str, command: Vec<String>) -> pb::ExecRequest {
    pb::ExecRequest {
        sandbox_id: id.to_string(),
        command,
        ..Default::default()
    }
}

/// Sends `msg` on the check's input channel; the driver dropping its end is a failure.
fn send(s: &Session<'_>, tx: &mpsc::UnboundedSender<pb::ExecInput>, msg: Input) {
    let what = format!("{msg:?}");
    tx.unbounded_send(input(msg)).unwrap_or_else(|_| {
        panic!(
            "[{}] sending {what}: the driver dropped the exec's input",
            s.check()
        )
    });
}

/// Starts an exec (with the call's deadline); the error as the driver answered it.
async fn start(
    s: &Session<'_>,
    req: pb::ExecRequest,
    input: ExecInputStream,
) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
    let what = format!("exec {:?} in {}", req.command, req.sandbox_id);
    s.call(&what, s.driver().exec_io(req, input)).await
}

/// Reads `stream` to its end, within `within`; an error in the stream is returned as such.
async fn collect(
    s: &Session<'_>,
    what: &str,
    mut stream: impl Stream<Item = Result<pb::ExecOutput, DriverError>> + Unpin,
    within: Duration,
) -> Result<Ran, DriverError> {
    let read = async {
        let mut ran = Ran::default();
        while let Some(item) = stream.next().await {
            match item?.chunk {
                Some(Chunk::Stdout(b)) => ran.stdout.extend_from_slice(&b),
                Some(Chunk::Stderr(b)) => ran.stderr.extend_from_slice(&b),
                Some(Chunk::Exit(exit)) => {
                    assert!(
                        ran.exit.is_none(),
                        "[{}] {what}: a second exit {exit:?} after {:?}",
                        s.check(),
                        ran.exit
                    );
                    ran.exit = Some(exit);
                }
                None => {}
            }
        }
        Ok(ran)
    };
    match timeout(within, read).await {
        Ok(ran) => ran,
        Err(_) => panic!(
            "[{}] {what}: the output did not end within {within:?}",
            s.check()
        ),
    }
}

/// Runs `req` with `input` to its end; an error of the call or of the stream is returned.
async fn try_run(
    s: &Session<'_>,
    req: pb::ExecRequest,
    input: ExecInputStream,
) -> Result<Ran, DriverError> {
    let what = format!("exec {:?} in {}", req.command, req.sandbox_id);
    let stream = start(s, req, input).await?;
    collect(s, &what, stream, s.h.call_timeout()).await
}

/// [`try_run`] that must succeed.
async fn run(s: &Session<'_>, req: pb::ExecRequest, input: ExecInputStream) -> Ran {
    let what = format!("exec {:?} in {}", req.command, req.sandbox_id);
    try_run(s, req, input)
        .await
        .unwrap_or_else(|e| panic!("[{}] {what} failed: {e}", s.check()))
}

/// Sets in a request what the driver may lack.
type Ask = fn(&mut pb::ExecRequest);

/// What a check needs of the driver's capabilities besides exec.
#[derive(Clone, Copy)]
enum Needs {
    Exec,
    Stdin,
    Tty,
}

/// Skips (printing why) unless the driver reports exec and what `needs` names; answers the
/// capabilities otherwise.
async fn needs(s: &Session<'_>, needs: Needs) -> Option<pb::CapabilitiesResponse> {
    let check = s.check();
    let caps = s.capabilities().await;
    let lacks = match needs {
        _ if !caps.exec => Some("exec"),
        Needs::Stdin if !caps.exec_stdin => Some("exec_stdin"),
        Needs::Tty if !caps.exec_tty => Some("exec_tty"),
        _ => None,
    };
    if let Some(name) = lacks {
        eprintln!("conformance: {check} skipped: the driver does not report {name}");
        return None;
    }
    Some(caps)
}

/// Whether the harness says the exec runs real processes; prints why the part skips if not.
fn real_processes(s: &Session<'_>, part: &str) -> bool {
    let real = s.h.runs_processes();
    if !real {
        eprintln!(
            "conformance: {} skipped {part}: the harness says the driver's exec runs no real \
             processes (no sh, sleep, kill, pwd, tty or stty)",
            s.check()
        );
    }
    real
}

/// The bytes the stdin check sends, in its three chunks: every byte value (0x00 and 0xff
/// included), a line of text, and 200 KiB of a pattern that is not periodic in 64 KiB.
fn stdin_chunks() -> Vec<Vec<u8>> {
    let all_bytes: Vec<u8> = (0..=255u8).rev().chain(0..=255u8).collect();
    let text = b"a line of text\n".to_vec();
    vec![all_bytes, text, noise(BIG_CHUNK)]
}

/// `len` bytes of a pattern that is not periodic in the agent's 64 KiB frames: a byte lost,
/// doubled or reordered at a frame's edge shows.
pub(super) fn noise(len: usize) -> Vec<u8> {
    let mut x: u32 = 0x9e37_79b9;
    (0..len)
        .map(|_| {
            // xorshift32: cheap, deterministic, every byte value.
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// The first index where `got` and `want` differ, for a failure message about 200 KiB.
pub(super) fn first_difference(got: &[u8], want: &[u8]) -> String {
    match got.iter().zip(want).position(|(a, b)| a != b) {
        Some(i) => format!(
            "they first differ at byte {i} (got {:#04x}, want {:#04x})",
            got[i], want[i]
        ),
        None => format!(
            "one is a prefix of the other ({} bytes vs {})",
            got.len(),
            want.len()
        ),
    }
}

/// `cat` with stdin: three chunks (binary bytes, text, 200 KiB), then the end of the input;
/// stdout is the input byte for byte, and the exit is 0. Needs `exec_stdin`.
pub async fn exec_stdin_round_trips(h: &dyn DriverHarness) {
    run_check(h, "exec_stdin_round_trips", |s| Box::pin(stdin_body(s))).await;
}

async fn stdin_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Stdin).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let chunks = stdin_chunks();
    let want: Vec<u8> = chunks.concat();
    let messages: Vec<pb::ExecInput> = chunks.into_iter().map(|c| input(Input::Stdin(c))).collect();
    let req = pb::ExecRequest {
        stdin: true,
        ..request(&id, s.h.exec_cat())
    };
    let ran = run(s, req, Box::pin(futures::stream::iter(messages))).await;
    assert!(
        ran.stdout == want,
        "[{check}] cat with stdin must write back the {} bytes sent, got {}: {} (stderr {:?}, \
         exit {:?})",
        want.len(),
        ran.stdout.len(),
        first_difference(&ran.stdout, &want),
        ran.stderr_text(),
        ran.exit
    );
    assert_eq!(
        ran.exit(),
        Some((0, 0)),
        "[{check}] cat must exit 0 once stdin ends (stderr {:?})",
        ran.stderr_text()
    );

    // Stdin closed by a message rather than by the end of the input stream, which stays open.
    let (tx, open_input) = input_channel();
    let req = pb::ExecRequest {
        stdin: true,
        ..request(&id, s.h.exec_cat())
    };
    send(s, &tx, Input::Stdin(b"closed by a message\n".to_vec()));
    send(s, &tx, Input::CloseStdin(true));
    let ran = run(s, req, open_input).await;
    drop(tx);
    assert_eq!(
        (ran.stdout_text().as_str(), ran.exit()),
        ("closed by a message\n", Some((0, 0))),
        "[{check}] cat after close_stdin (with the input stream still open) must end with \
         what was sent and exit 0 (stderr {:?})",
        ran.stderr_text()
    );

    // Stdin for a command that exits without reading it: the exit, and exec still works
    // (writing to the gone command's stdin must not take down what serves exec).
    let unread: Vec<pb::ExecInput> = (0..16)
        .map(|_| input(Input::Stdin(vec![b'x'; 64 * 1024])))
        .collect();
    let req = pb::ExecRequest {
        stdin: true,
        ..request(&id, s.h.exec_exit(3))
    };
    let ran = run(s, req, Box::pin(futures::stream::iter(unread))).await;
    assert_eq!(
        ran.exit(),
        Some((3, 0)),
        "[{check}] a command that exits 3 without reading its 1 MiB of stdin must end with \
         exit 3 (stderr {:?})",
        ran.stderr_text()
    );
    let after = run(
        s,
        request(&id, s.h.exec_echo("still serving")),
        no_exec_input(),
    )
    .await;
    assert_eq!(
        (after.stdout_text().trim(), after.exit()),
        ("still serving", Some((0, 0))),
        "[{check}] an exec after stdin went to a command that had exited (stderr {:?})",
        after.stderr_text()
    );
}

/// `cat` without stdin ends at once, with exit 0 and no output: its stdin is empty, never
/// the caller's (nor a pipe nobody closes). Needs exec.
pub async fn exec_without_stdin_sees_end_of_file(h: &dyn DriverHarness) {
    run_check(h, "exec_without_stdin_sees_end_of_file", |s| {
        Box::pin(no_stdin_body(s))
    })
    .await;
}

async fn no_stdin_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Exec).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    // The input stream stays open: the end of stdin must not wait for it.
    let (tx, input) = input_channel();
    let ran = run(s, request(&id, s.h.exec_cat()), input).await;
    drop(tx);
    assert_eq!(
        (ran.stdout.len(), ran.exit()),
        (0, Some((0, 0))),
        "[{check}] cat without stdin must see its end at once: no output, exit 0 (stdout \
         {:?}, stderr {:?})",
        ran.stdout_text(),
        ran.stderr_text()
    );
}

/// On a terminal of 33 rows and 77 columns, `tty` names a pty under `/dev/` (`/dev/pts/N`, or
/// the oci driver's exec instance, `/dev/.sbx-pts/N`) and `stty size`
/// says `33 77`; after a resize to 40 x 100, `stty size` says `40 100`. Needs `exec_tty`.
pub async fn exec_tty_gives_a_terminal_of_the_asked_size(h: &dyn DriverHarness) {
    run_check(h, "exec_tty_gives_a_terminal_of_the_asked_size", |s| {
        Box::pin(tty_body(s))
    })
    .await;
}

async fn tty_body(s: &mut Session<'_>) {
    let check = s.check();
    let Some(caps) = needs(s, Needs::Tty).await else {
        return;
    };
    if !real_processes(s, "the whole check") {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let req = pb::ExecRequest {
        tty: tty(33, 77),
        ..request(&id, argv(&["sh", "-c", "tty; stty size"]))
    };
    let ran = run(s, req, no_exec_input()).await;
    let out = ran.stdout_text();
    let named = out
        .lines()
        .next()
        .is_some_and(|tty| tty.starts_with("/dev/") && tty.contains("pts/"));
    assert!(
        named && out.contains("33 77") && ran.exit() == Some((0, 0)),
        "[{check}] on a tty of 33 x 77, `tty; stty size` must print a pty under /dev/ and \
         `33 77` and exit 0; got stdout {out:?}, stderr {:?}, exit {:?}",
        ran.stderr_text(),
        ran.exit
    );
    assert!(
        ran.stderr.is_empty(),
        "[{check}] with a tty all output comes as stdout, got stderr {:?}",
        ran.stderr_text()
    );

    if !caps.exec_stdin {
        eprintln!("conformance: {check} skipped the resize: the driver does not report exec_stdin");
        return;
    }
    let (tx, input) = input_channel();
    let req = pb::ExecRequest {
        tty: tty(33, 77),
        stdin: true,
        ..request(&id, argv(&["sh", "-c", "read x; stty size"]))
    };
    send(
        s,
        &tx,
        Input::Resize(pb::TerminalSize {
            rows: 40,
            cols: 100,
        }),
    );
    send(s, &tx, Input::Stdin(b"go\n".to_vec()));
    let ran = run(s, req, input).await;
    drop(tx);
    let out = ran.stdout_text();
    // The terminal echoes `go`; the size is the last line.
    let last = out
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    assert!(
        last.contains("40 100") && ran.exit() == Some((0, 0)),
        "[{check}] after a resize to 40 x 100, `stty size` must print `40 100` and exit 0; \
         got stdout {out:?}, exit {:?}",
        ran.exit
    );
}

/// A signal sent as input reaches the running command: SIGTERM ends `cat` waiting on its
/// stdin, `sleep 100` without stdin, and `sleep 100` sent 2 MiB of stdin it never reads
/// ahead of the signal, and the exit says so (code -1, signal 15) within 5 s. Needs `exec_stdin` (a driver without exec input has no way to send a signal).
pub async fn exec_signal_reaches_the_command(h: &dyn DriverHarness) {
    run_check(h, "exec_signal_reaches_the_command", |s| {
        Box::pin(signal_body(s))
    })
    .await;
}

async fn signal_body(s: &mut Session<'_>) {
    if needs(s, Needs::Stdin).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let cat = pb::ExecRequest {
        stdin: true,
        ..request(&id, s.h.exec_cat())
    };
    signal_ends(s, cat, "cat reading its stdin").await;
    if real_processes(s, "`sleep 100` without stdin") {
        let sleep = request(&id, argv(&["sleep", "100"]));
        signal_ends(s, sleep, "sleep 100 without stdin").await;
        // Behind 2 MiB of stdin that the command never reads: the signal is not stuck
        // behind what the command's pipe cannot take.
        let unread = pb::ExecRequest {
            stdin: true,
            ..request(&id, argv(&["sleep", "100"]))
        };
        signal_ends(s, unread, "sleep 100 with 2 MiB of unread stdin").await;
    }
}

/// Stdin a command does not read, sent ahead of a signal or a drop: more than a pipe holds,
/// less than the agent keeps for it (`sbx_agent::feed::MAX_QUEUED`).
const UNREAD_STDIN: usize = 2 * 1024 * 1024;

fn send_unread_stdin(s: &Session<'_>, tx: &mpsc::UnboundedSender<pb::ExecInput>) {
    for _ in 0..UNREAD_STDIN / (64 * 1024) {
        send(s, tx, Input::Stdin(vec![b'u'; 64 * 1024]));
    }
}

/// Starts `req` with an open input, sends SIGTERM once it runs, and expects the exit to say
/// so within [`PROMPTLY`].
async fn signal_ends(s: &Session<'_>, req: pb::ExecRequest, what: &str) {
    let check = s.check();
    let (tx, input) = input_channel();
    // cat writes its stdin back; anything else is given stdin it never reads.
    let echoes = req.stdin && req.command == s.h.exec_cat();
    if echoes {
        // Some output first, so the signal is sent to a command known to run.
        send(s, &tx, Input::Stdin(b"ready\n".to_vec()));
    }
    let mut stream = start(s, req.clone(), input)
        .await
        .unwrap_or_else(|e| panic!("[{check}] {what}: exec failed: {e}"));
    if echoes {
        let first = timeout(s.h.call_timeout(), stream.next()).await;
        assert!(
            matches!(
                &first,
                Ok(Some(Ok(pb::ExecOutput {
                    chunk: Some(Chunk::Stdout(_))
                })))
            ),
            "[{check}] {what}: expected the stdin written back first, got {first:?}"
        );
    } else {
        // Nothing to read from it: give the command a moment to start.
        sleep(Duration::from_millis(300)).await;
    }
    if req.stdin && !echoes {
        send_unread_stdin(s, &tx);
    }
    send(s, &tx, Input::Signal(15));
    let sent = Instant::now();
    let ran = collect(s, what, stream, PROMPTLY)
        .await
        .unwrap_or_else(|e| panic!("[{check}] {what}: the stream failed after SIGTERM: {e}"));
    drop(tx);
    assert_eq!(
        ran.exit(),
        Some((-1, 15)),
        "[{check}] {what}: after SIGTERM the exit must say code -1, signal 15 (got it after \
         {:?}; stderr {:?})",
        sent.elapsed(),
        ran.stderr_text()
    );
}

/// The working directory and the environment of an exec: `pwd` in `/tmp` prints `/tmp`, a
/// variable of the request is seen by the command, and a missing directory is
/// `InvalidArgument` naming it. A harness whose driver takes no working directory
/// ([`DriverHarness::exec_workdir`] false) gets that checked by
/// [`exec_refuses_what_the_driver_lacks`] instead. Needs exec.
pub async fn exec_workdir_and_env(h: &dyn DriverHarness) {
    run_check(h, "exec_workdir_and_env", |s| Box::pin(workdir_body(s))).await;
}

async fn workdir_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Exec).await.is_none() {
        return;
    }
    let real = s.h.runs_processes();
    let workdir = s.h.exec_workdir();
    if !real && !workdir {
        eprintln!(
            "conformance: {check} skipped: the harness says the driver runs no real processes \
             and takes no working directory"
        );
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    if real_processes(s, "the environment and `pwd`") {
        let mut req = request(&id, argv(&["sh", "-c", "echo \"[$SBX_CONF_VAR]\""]));
        req.env.insert(
            "SBX_CONF_VAR".to_string(),
            "seen by the command".to_string(),
        );
        let ran = run(s, req, no_exec_input()).await;
        assert_eq!(
            (ran.stdout_text().as_str(), ran.exit()),
            ("[seen by the command]\n", Some((0, 0))),
            "[{check}] a variable of the exec request must be in the command's environment \
             (stderr {:?})",
            ran.stderr_text()
        );
        if workdir {
            let req = pb::ExecRequest {
                workdir: "/tmp".to_string(),
                ..request(&id, argv(&["pwd"]))
            };
            let ran = run(s, req, no_exec_input()).await;
            assert_eq!(
                (ran.stdout_text().as_str(), ran.exit()),
                ("/tmp\n", Some((0, 0))),
                "[{check}] `pwd` with workdir /tmp (stderr {:?})",
                ran.stderr_text()
            );
        }
    }
    if !workdir {
        eprintln!(
            "conformance: {check} skipped the working directory: the harness says the driver \
             takes none (exec_refuses_what_the_driver_lacks checks that it says so)"
        );
        return;
    }
    let req = pb::ExecRequest {
        workdir: MISSING_DIR.to_string(),
        ..request(&id, s.h.exec_echo("hello"))
    };
    let answer = try_run(s, req, no_exec_input()).await;
    assert!(
        matches!(&answer, Err(DriverError::InvalidArgument(m)) if m.contains(MISSING_DIR)),
        "[{check}] exec in the missing directory {MISSING_DIR} must be InvalidArgument naming \
         it, got {answer:?}"
    );
}

/// A command that is not there exits 127 and says so on stderr, naming it
/// ([`DriverHarness::command_not_found_stderr`]). Needs exec.
pub async fn exec_command_not_found_is_127(h: &dyn DriverHarness) {
    run_check(h, "exec_command_not_found_is_127", |s| {
        Box::pin(not_found_body(s))
    })
    .await;
}

async fn not_found_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Exec).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let name = "no-such-command-sbx";
    let ran = run(
        s,
        request(&id, argv(&[name, "an-argument"])),
        no_exec_input(),
    )
    .await;
    let stderr = ran.stderr_text();
    let want =
        s.h.command_not_found_stderr(name)
            .unwrap_or_else(|| name.to_string());
    assert!(
        ran.exit() == Some((127, 0)) && stderr.contains(&want),
        "[{check}] exec of {name} must exit 127 with {want:?} on stderr; got exit {:?}, \
         stderr {stderr:?}, stdout {:?}",
        ran.exit,
        ran.stdout_text()
    );
}

/// A caller that drops the output stream ends the command and what it started: the shell
/// and its background `sleep 100` are gone (`kill -0` fails) within 5 s, though 2 MiB of
/// stdin the shell never reads went ahead of the drop. Needs `exec_stdin`
/// (a driver without it answers only after the command ended) and real processes.
pub async fn exec_dropped_stream_ends_the_command(h: &dyn DriverHarness) {
    run_check(h, "exec_dropped_stream_ends_the_command", |s| {
        Box::pin(dropped_body(s))
    })
    .await;
}

async fn dropped_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Stdin).await.is_none() || !real_processes(s, "the whole check") {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let (tx, input) = input_channel();
    let req = pb::ExecRequest {
        stdin: true,
        ..request(&id, argv(&["sh", "-c", "sleep 100 & echo $$ $!; wait"]))
    };
    let mut stream = start(s, req, input)
        .await
        .unwrap_or_else(|e| panic!("[{check}] exec of sh with a background sleep failed: {e}"));
    // Read until the line with both pids is complete.
    let mut printed = String::new();
    let read = async {
        while !printed.contains('\n') {
            match stream.next().await {
                Some(Ok(pb::ExecOutput {
                    chunk: Some(Chunk::Stdout(b)),
                })) => printed.push_str(&String::from_utf8_lossy(&b)),
                other => return Err(format!("{other:?}")),
            }
        }
        Ok(())
    };
    if let Err(other) = s.call("reading the pids the shell prints", read).await {
        panic!(
            "[{check}] expected the pids of sh and sleep on stdout, got {other} after {printed:?}"
        );
    }
    let pids: Vec<u32> = printed
        .split_whitespace()
        .map(|p| {
            p.parse()
                .unwrap_or_else(|e| panic!("[{check}] pid {p:?} in {printed:?}: {e}"))
        })
        .collect();
    assert_eq!(
        pids.len(),
        2,
        "[{check}] expected two pids, got {printed:?}"
    );
    // Both alive now: the probe itself must be able to say yes.
    let probe = |pid: u32| argv(&["sh", "-c", &format!("kill -0 {pid} 2>/dev/null")]);
    for pid in &pids {
        let alive = run(s, request(&id, probe(*pid)), no_exec_input()).await;
        assert_eq!(
            alive.exit(),
            Some((0, 0)),
            "[{check}] pid {pid} (of {printed:?}) must be alive while the stream is held: \
             {alive:?}"
        );
    }

    // Stdin the shell never reads, ahead of the drop: the drop is not stuck behind it.
    send_unread_stdin(s, &tx);
    sleep(Duration::from_millis(200)).await;
    drop(stream);
    drop(tx);
    let dropped = Instant::now();
    let mut left = pids.clone();
    while !left.is_empty() {
        let mut still = Vec::new();
        for pid in left {
            let alive = run(s, request(&id, probe(pid)), no_exec_input()).await;
            if alive.exit() == Some((0, 0)) {
                still.push(pid);
            }
        }
        left = still;
        if !left.is_empty() {
            assert!(
                dropped.elapsed() < PROMPTLY,
                "[{check}] pids {left:?} (sh and its background sleep: {printed:?}) still run \
                 (or are unreaped zombies) {PROMPTLY:?} after the output stream was dropped"
            );
            sleep(Duration::from_millis(100)).await;
        }
    }
}

/// What a driver lacks it refuses, said plainly: without `exec_stdin`, an exec asking for
/// stdin is `Unimplemented`; without `exec_tty`, one asking for a terminal; and where the
/// harness says the driver takes no working directory, one asking for it. Skipped when the
/// driver has them all.
pub async fn exec_refuses_what_the_driver_lacks(h: &dyn DriverHarness) {
    run_check(h, "exec_refuses_what_the_driver_lacks", |s| {
        Box::pin(refuses_body(s))
    })
    .await;
}

async fn refuses_body(s: &mut Session<'_>) {
    let check = s.check();
    let Some(caps) = needs(s, Needs::Exec).await else {
        return;
    };
    let ask_stdin: Ask = |r| r.stdin = true;
    let ask_tty: Ask = |r| r.tty = tty(24, 80);
    let ask_workdir: Ask = |r| r.workdir = "/tmp".to_string();
    let lacks: Vec<(&str, Ask)> = [
        (!caps.exec_stdin, "stdin", ask_stdin),
        (!caps.exec_tty, "a tty", ask_tty),
        (!s.h.exec_workdir(), "a workdir", ask_workdir),
    ]
    .into_iter()
    .filter_map(|(lacks, what, ask)| lacks.then_some((what, ask)))
    .collect();
    if lacks.is_empty() {
        eprintln!(
            "conformance: {check} skipped: the driver reports exec_stdin and exec_tty and the \
             harness says it takes a working directory"
        );
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    for (what, ask) in lacks {
        let mut req = request(&id, s.h.exec_echo("hello"));
        ask(&mut req);
        let answer = try_run(s, req, no_exec_input()).await;
        assert!(
            matches!(answer, Err(DriverError::Unimplemented(_))),
            "[{check}] an exec with {what}, which the driver lacks, must be Unimplemented, got \
             {answer:?}"
        );
    }
}

/// What `execve` could not take is refused before anything runs, as `InvalidArgument`: an
/// argument holding a NUL byte, an environment variable named with `=` or named by nothing.
/// Every driver refuses them alike (the host drivers and the sim through one check,
/// `host::validate_command`), so a client sees the same answer whichever runs its sandbox.
pub async fn exec_refuses_bad_argv_and_env(h: &dyn DriverHarness) {
    run_check(h, "exec_refuses_bad_argv_and_env", |s| {
        Box::pin(bad_argv_body(s))
    })
    .await;
}

async fn bad_argv_body(s: &mut Session<'_>) {
    let check = s.check();
    if needs(s, Needs::Exec).await.is_none() {
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let mut nul = s.h.exec_echo("hello");
    nul.push("a\0b".to_string());
    let cases: Vec<(&str, pb::ExecRequest)> = vec![
        ("a NUL byte in an argument", request(&id, nul)),
        ("'=' in an environment variable's name", {
            let mut r = request(&id, s.h.exec_echo("hello"));
            r.env.insert("A=B".to_string(), "1".to_string());
            r
        }),
        ("an empty environment variable name", {
            let mut r = request(&id, s.h.exec_echo("hello"));
            r.env.insert(String::new(), "1".to_string());
            r
        }),
    ];
    for (what, req) in cases {
        let answer = try_run(s, req, no_exec_input()).await;
        assert!(
            matches!(answer, Err(DriverError::InvalidArgument(_))),
            "[{check}] an exec with {what} must be InvalidArgument, got {answer:?}"
        );
    }
    // The same sandbox still runs a good exec.
    let ran = run(s, request(&id, s.h.exec_echo("still")), no_exec_input()).await;
    assert_eq!(
        ran.exit.as_ref().map(|e| e.code),
        Some(0),
        "[{check}] a good exec after the refused ones exits 0 (stdout {:?})",
        ran.stdout_text()
    );
}
