//! Attacks on an exec from inside its sandbox, shared by the oci and process drivers' host
//! boundary tests (`driver-oci/tests/oci_host_boundary.rs`,
//! `driver-process/tests/process_host_boundary.rs`): the workload, and another exec, try to reach into an operator's running
//! execs — one with its stdin on a pipe and a secret in its environment, one on a terminal.

use std::time::{Duration, Instant};

use crate::{ComputeDriver, DriverStream, pb};
use futures::StreamExt;
use futures::channel::mpsc;

/// The main command of a sandbox whose workload is the attacker: it plays `/sandbox/go` (as
/// itself: its own process, user and confinement) whenever that appears and no `out` is
/// there yet.
pub const PLAYS_GO: &[&str] = &[
    "sh",
    "-c",
    "while :; do if [ -f /sandbox/go ] && [ ! -e /sandbox/out ]; then sh /sandbox/go; fi; \
     sleep 0.1; done",
];

/// The attack: for every process whose command line is one of the operator's execs (`sleep
/// 3601`, stdin on a pipe; `sleep 3602`, on a terminal), try to open its stdin and stdout,
/// its memory and environment, and to list its working directory; then open every pty of the
/// sandbox's `/dev/pts` and of the oci driver's exec instance. Each try that works is an
/// `open` line of `/sandbox/out`; each target found a `seen` line.
const REACH_INTO_EXECS: &str = r#"out=/sandbox/out.$$; : > $out
for p in /proc/[0-9]*; do
  pid=${p#/proc/}
  cmd=$(tr '\0' ' ' < $p/cmdline 2>/dev/null)
  case "$cmd" in "sleep 3601 "|"sleep 3602 ") ;; *) continue ;; esac
  echo "seen $pid $cmd" >> $out
  for f in fd/0 fd/1 mem environ; do
    (exec 3<$p/$f) 2>/dev/null && echo "open $pid $f" >> $out
  done
  ls $p/cwd/ >/dev/null 2>&1 && echo "open $pid cwd" >> $out
done
for t in /dev/pts/[0-9]* /dev/.sbx-pts/[0-9]*; do
  [ -e "$t" ] || continue
  echo "seen $t" >> $out
  (exec 3<>"$t") 2>/dev/null && echo "open $t" >> $out
done
mv $out /sandbox/out
"#;

/// Runs `command` to its end; its exit code and stdout.
async fn run(driver: &dyn ComputeDriver, id: &str, command: &[&str]) -> (i32, String) {
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: command.iter().map(|s| s.to_string()).collect(),
            timeout_seconds: 20,
            ..Default::default()
        })
        .await
        .unwrap();
    let (mut out, mut code) = (Vec::new(), -1);
    while let Some(item) = stream.next().await {
        match item.unwrap().chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = e.code,
            _ => {}
        }
    }
    (code, String::from_utf8_lossy(&out).into_owned())
}

/// An exec that keeps running (`sh -c 'echo ready; exec sleep SECS'`) with its input held
/// open, once it said `ready`.
struct Held {
    _input: mpsc::UnboundedSender<pb::ExecInput>,
    _output: DriverStream<pb::ExecOutput>,
}

async fn hold(driver: &dyn ComputeDriver, id: &str, secs: &str, tty: bool) -> Held {
    let (tx, rx) = mpsc::unbounded();
    let mut output = driver
        .exec_io(
            pb::ExecRequest {
                sandbox_id: id.to_string(),
                command: ["sh", "-c", &format!("echo ready; exec sleep {secs}")]
                    .map(String::from)
                    .to_vec(),
                env: [("SBX_EXEC_SECRET".to_string(), "operator-only".to_string())].into(),
                stdin: true,
                tty: tty.then(|| pb::Tty {
                    rows: 24,
                    cols: 80,
                    term: String::new(),
                }),
                ..Default::default()
            },
            Box::pin(rx),
        )
        .await
        .unwrap();
    let mut said = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&said).contains("ready") {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, output.next()).await {
            Ok(Some(Ok(pb::ExecOutput {
                chunk: Some(pb::exec_output::Chunk::Stdout(b)),
            }))) => said.extend(b),
            Ok(Some(Ok(_))) => {}
            other => panic!("the exec of sleep {secs} did not start: {other:?}"),
        }
    }
    Held {
        _input: tx,
        _output: output,
    }
}

/// Plays [`REACH_INTO_EXECS`] as `attacker` says — `"workload"` (the sandbox's main process
/// must be [`PLAYS_GO`]) or `"exec"` (an exec of its own) — while two operator execs run, and
/// returns what it wrote.
async fn attack(driver: &dyn ComputeDriver, id: &str, attacker: &str) -> String {
    let _piped = hold(driver, id, "3601", false).await;
    let _terminal = hold(driver, id, "3602", true).await;
    assert_eq!(run(driver, id, &["rm", "-f", "/sandbox/out"]).await.0, 0);
    match attacker {
        "workload" => {
            let put = "printf '%s' \"$1\" > /sandbox/go.new && mv /sandbox/go.new /sandbox/go";
            let (code, _) = run(driver, id, &["sh", "-c", put, "sh", REACH_INTO_EXECS]).await;
            assert_eq!(code, 0, "the attack script was not written");
            let deadline = Instant::now() + Duration::from_secs(20);
            loop {
                let (code, out) = run(driver, id, &["cat", "/sandbox/out"]).await;
                if code == 0 {
                    assert_eq!(run(driver, id, &["rm", "-f", "/sandbox/go"]).await.0, 0);
                    return out;
                }
                assert!(
                    Instant::now() < deadline,
                    "the workload never played the attack"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        _ => {
            let (code, _) = run(driver, id, &["sh", "-c", REACH_INTO_EXECS]).await;
            assert_eq!(code, 0, "the exec's attack did not run");
            run(driver, id, &["cat", "/sandbox/out"]).await.1
        }
    }
}

/// Neither the workload nor another exec opens anything of an operator's execs: their pipes,
/// terminal, memory, environment or working directory — while both are seen running (the
/// attack found its targets, so it tried). Needs a sandbox whose main command is
/// [`PLAYS_GO`].
pub async fn execs_are_out_of_reach(driver: &dyn ComputeDriver, id: &str, tty_dir: &str) {
    for attacker in ["workload", "exec"] {
        let out = attack(driver, id, attacker).await;
        let seen = |what: &str| {
            out.lines()
                .any(|l| l.starts_with("seen") && l.contains(what))
        };
        assert!(
            seen("sleep 3601") && seen("sleep 3602") && seen(tty_dir),
            "the {attacker} did not find the execs and the terminal to attack: {out}"
        );
        let opened: Vec<&str> = out.lines().filter(|l| l.starts_with("open")).collect();
        assert!(
            opened.is_empty(),
            "the {attacker} reached into the operator's execs: {opened:?}"
        );
    }
}

/// How many lines of each stream [`flooder`] writes: about 6 MiB in all.
const FLOOD_LINES: u32 = 30_000;

/// The cap the flood tests give their driver (`log_max`).
pub const FLOOD_CAP: u64 = sbx_agent::log::MIN_CAP;

/// The main command of a sandbox that floods its log: on `/sandbox/flood`, [`FLOOD_LINES`]
/// numbered lines of about 100 bytes on stdout and as many on stderr, then `flood done`.
pub fn flooder() -> Vec<String> {
    let lines = FLOOD_LINES;
    let pad = "x".repeat(90);
    let script = format!(
        "while [ ! -e /sandbox/flood ]; do sleep 0.05; done; i=0; \
         while [ $i -lt {lines} ]; do echo \"out $i {pad}\"; echo \"err $i {pad}\" >&2; \
         i=$((i+1)); done; echo 'flood done'; exec sleep 3600"
    );
    ["sh".to_string(), "-c".to_string(), script].to_vec()
}

/// Every line of the log files is a whole record (`<time> <stream> <F|P> …`).
fn whole_records(name: &str, text: &str) {
    for line in text.lines() {
        let mut fields = line.splitn(4, ' ');
        let (time, stream, tag) = (fields.next(), fields.next(), fields.next());
        assert!(
            time.is_some_and(|t| t.len() >= 20 && t.as_bytes()[10] == b'T')
                && matches!(stream, Some("stdout" | "stderr"))
                && matches!(tag, Some("F" | "P")),
            "{name} holds a cut record: {line:?}"
        );
    }
}

/// The numbers of a stream's lines in `text` (`out N …` / `err N …`), in order: one run with
/// no gap when `whole`, else only rising (a follower that fell behind may skip lines).
fn numbered(what: &str, text: &str, prefix: &str, whole: bool) -> Vec<u32> {
    let numbers: Vec<u32> = text
        .lines()
        .filter_map(|l| l.split_once(prefix)?.1.split(' ').next()?.parse().ok())
        .collect();
    let bad = numbers
        .windows(2)
        .position(|w| !(if whole { w[1] == w[0] + 1 } else { w[1] > w[0] }));
    if let Some(at) = bad {
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(prefix)).collect();
        let from = at.saturating_sub(2);
        let near: Vec<String> = lines[from..(at + 3).min(lines.len())]
            .iter()
            .map(|l| l.chars().take(40).collect())
            .collect();
        panic!("{what}: the {prefix:?} lines have a gap or are out of order near {near:?}");
    }
    numbers
}

/// A sandbox made with [`flooder`] writes about 6 MiB of output: its log (`workload.log` of
/// its directory in the driver's `state_dir`) and the part before it never hold more than
/// [`FLOOD_CAP`] (and one write),
/// both hold whole records only, `logs` gives the newest lines of each stream with no gap up to
/// `flood done`, and a follower started before the flood reads on, in order, through every
/// rotation to `flood done`.
pub async fn a_flood_stays_within_the_log_cap(
    driver: &dyn ComputeDriver,
    id: &str,
    state_dir: &std::path::Path,
) {
    let (cap, lines) = (FLOOD_CAP, FLOOD_LINES);
    let log = state_dir.join("sandboxes").join(id).join("workload.log");
    let log = log.as_path();
    let mut follower = driver
        .logs(pb::LogsRequest {
            sandbox_id: id.to_string(),
            follow: true,
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(run(driver, id, &["touch", "/sandbox/flood"]).await.0, 0);
    let previous = {
        let mut name = log.as_os_str().to_owned();
        name.push(".1");
        std::path::PathBuf::from(name)
    };
    let on_disk = || {
        std::fs::metadata(log).map_or(0, |m| m.len())
            + std::fs::metadata(&previous).map_or(0, |m| m.len())
    };
    // The follower reads to the flood's end; the files are measured all the while.
    // Each stream's bytes apart: a record of one stream may come between the parts of a line
    // of the other.
    let (mut followed, mut followed_err) = (Vec::new(), Vec::new());
    let mut most = 0;
    let deadline = Instant::now() + Duration::from_secs(120);
    let last_err = format!("err {} ", lines - 1);
    while !(String::from_utf8_lossy(&followed).contains("flood done")
        && String::from_utf8_lossy(&followed_err).contains(&last_err))
    {
        most = most.max(on_disk());
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            let on_host = |path: &std::path::Path| {
                let text = std::fs::read(path).unwrap_or_default();
                let text = String::from_utf8_lossy(&text);
                format!(
                    "{} bytes, the end {}, the last err {}",
                    text.len(),
                    text.contains("flood done"),
                    text.contains(&last_err)
                )
            };
            let end =
                |b: &[u8]| String::from_utf8_lossy(&b[b.len().saturating_sub(200)..]).into_owned();
            let tail = format!("stdout …{} stderr …{}", end(&followed), end(&followed_err));
            panic!(
                "the follower never read the flood's end; the log: {}; its previous part: {}; \
                 the follower read {} bytes, ending {tail:?}",
                on_host(log),
                on_host(&previous),
                followed.len() + followed_err.len()
            );
        }
        match tokio::time::timeout(left.min(Duration::from_millis(200)), follower.next()).await {
            Ok(Some(Ok(chunk))) if chunk.stream == pb::LogStream::Stderr as i32 => {
                followed_err.extend(chunk.data)
            }
            Ok(Some(Ok(chunk))) => followed.extend(chunk.data),
            Ok(other) => panic!("the follower ended: {other:?}"),
            Err(_) => {}
        }
    }
    most = most.max(on_disk());
    let written = 2 * u64::from(lines) * 100;
    assert!(
        written > 2 * cap,
        "the flood ({written} bytes) must pass the cap twice"
    );
    assert!(
        most <= cap + 64 * 1024,
        "the log and its previous part held {most} bytes, over the cap of {cap}"
    );
    let (current, before) = (
        std::fs::read_to_string(log).unwrap(),
        std::fs::read_to_string(&previous).unwrap(),
    );
    assert!(!before.is_empty(), "the log was never rotated");
    whole_records("the log", &current);
    whole_records("its previous part", &before);
    let (mut told, mut told_err) = (Vec::new(), Vec::new());
    let mut tail = driver
        .logs(pb::LogsRequest {
            sandbox_id: id.to_string(),
            ..Default::default()
        })
        .await
        .unwrap();
    while let Some(chunk) = tail.next().await {
        let chunk = chunk.unwrap();
        if chunk.stream == pb::LogStream::Stderr as i32 {
            told_err.extend(chunk.data);
        } else {
            told.extend(chunk.data);
        }
    }
    let (told, told_err) = (
        String::from_utf8_lossy(&told),
        String::from_utf8_lossy(&told_err),
    );
    assert!(
        told.contains("flood done\n"),
        "logs does not tell the flood's end"
    );
    for (prefix, told) in [("out ", &told), ("err ", &told_err)] {
        let kept = numbered("logs", told, prefix, true);
        assert_eq!(
            kept.last(),
            Some(&(lines - 1)),
            "{prefix:?}: the newest line is missing"
        );
        assert!(!kept.is_empty(), "{prefix:?}: nothing kept");
    }
    // The log and its previous part keep at least half the cap: a rotation happens when a
    // batch of records would take the log past half, so the previous part holds at least
    // half the cap less one batch (one read of at most 64 KiB of output, with its records'
    // framing: under 96 KiB), and the batch is in the log. Counted in bytes on disk: a
    // record's framing makes a line's size vary.
    let kept_bytes = (current.len() + before.len()) as u64;
    assert!(
        kept_bytes + 96 * 1024 >= cap / 2,
        "only {kept_bytes} bytes kept of a {cap}-byte cap"
    );
    let (followed, followed_err) = (
        String::from_utf8_lossy(&followed),
        String::from_utf8_lossy(&followed_err),
    );
    for (prefix, followed) in [("out ", &followed), ("err ", &followed_err)] {
        let seen = numbered("the follower", followed, prefix, false);
        assert_eq!(
            seen.last(),
            Some(&(lines - 1)),
            "{prefix:?}: the follower missed the end"
        );
    }
}
