//! `sbx sandbox logs` as docker users expect it, end to end through the real sbxd and the
//! real `sbx` binary (oci, the default driver, busybox image; the process driver too; needs
//! root, runc, and uidmap): the workload's stdout on sbx's stdout and its stderr on sbx's
//! stderr, `--timestamps` lines that begin with the time they were logged, `--since` a time
//! between two writes showing only the later one, a bad `--since` a usage error, and `-f`
//! following new lines. Each test ends its sbxd by pid and checks that nothing is left.

mod common;

use std::time::{Duration, SystemTime};

use common::{CliRun, CliStream};
use sbx_proto::Timestamp;

/// The workload: a line to each stream, a second's pause, then one more to stdout; then it
/// stays up.
const TALKER: &str = "echo out1; echo err1 >&2; sleep 1; echo out2; sleep 3600";

/// The logs' world: [`common::DriverWorld`] and its `box`.
struct World(common::DriverWorld);

impl std::ops::Deref for World {
    type Target = common::DriverWorld;
    fn deref(&self) -> &common::DriverWorld {
        &self.0
    }
}

impl World {
    fn new(driver: &str) -> World {
        World(common::DriverWorld::new(driver, "logs"))
    }

    /// `sbx sandbox logs ARGS… box`.
    fn logs(&self, args: &[&str]) -> CliRun {
        let mut argv = vec!["sandbox", "logs"];
        argv.extend_from_slice(args);
        argv.push("box");
        self.sbx(&argv)
    }

    /// Polls `sbx sandbox logs` until its stdout holds `line` (at most 20 s).
    fn wait_for_output(&self, line: &str) -> CliRun {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let run = self.logs(&[]);
            if run.stdout.lines().any(|l| l == line) {
                return run;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no {line:?} in the logs within 20 s: {run:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn finish(self) {
        self.0.finish();
    }
}

/// The time at the start of `line` (`TIME REST`) and the rest.
fn timed(line: &str) -> (SystemTime, &str) {
    let (time, rest) = line
        .split_once(' ')
        .unwrap_or_else(|| panic!("no time in {line:?}"));
    let time: Timestamp = time
        .parse()
        .unwrap_or_else(|e| panic!("{time:?} in {line:?} is not RFC 3339: {e}"));
    (SystemTime::try_from(time).unwrap(), rest)
}

fn streams_times_and_since(driver: &str) {
    let w = World::new(driver);
    let began = SystemTime::now();
    let created = w.sbx(&["sandbox", "create", "-n", "box", "--", "sh", "-c", TALKER]);
    assert_eq!(created.code, 0, "{created:?}");

    // stdout to stdout, stderr to stderr, as the workload wrote them.
    let plain = w.wait_for_output("out2");
    let ended = SystemTime::now();
    assert_eq!(plain.code, 0, "{plain:?}");
    assert_eq!(plain.stdout, "out1\nout2\n", "{plain:?}");
    assert_eq!(plain.stderr, "err1\n", "{plain:?}");

    // --timestamps: each line begins with its time, within the test's window, in order.
    let stamped = w.logs(&["--timestamps"]);
    assert_eq!(stamped.code, 0, "{stamped:?}");
    let out: Vec<(SystemTime, &str)> = stamped.stdout.lines().map(timed).collect();
    let err: Vec<(SystemTime, &str)> = stamped.stderr.lines().map(timed).collect();
    assert_eq!(
        out.iter().map(|(_, l)| *l).collect::<Vec<_>>(),
        ["out1", "out2"],
        "{stamped:?}"
    );
    assert_eq!(err.iter().map(|(_, l)| *l).collect::<Vec<_>>(), ["err1"]);
    for (time, line) in out.iter().chain(&err) {
        assert!(
            *time >= began && *time <= ended,
            "{line:?} logged at {time:?}, outside the test's {began:?}..{ended:?}"
        );
    }
    // The workload slept a second between out1 and out2.
    let gap = out[1].0.duration_since(out[0].0).unwrap();
    assert!(gap >= Duration::from_millis(900), "{gap:?}");

    // --since a time between the two writes: only out2.
    let between = out[0].0 + gap / 2;
    let since = Timestamp::from(between).to_string();
    let later = w.logs(&["--since", &since]);
    assert_eq!(
        (later.code, later.stdout.as_str()),
        (0, "out2\n"),
        "{later:?}"
    );
    assert_eq!(later.stderr, "", "{later:?}");
    // A duration ago: everything of the last hour; nothing of the future.
    assert_eq!(w.logs(&["--since", "1h"]).stdout, "out1\nout2\n");
    let future = Timestamp::from(SystemTime::now() + Duration::from_secs(3600)).to_string();
    let none = w.logs(&["--since", &future]);
    assert_eq!(
        (none.code, none.stdout.as_str(), none.stderr.as_str()),
        (0, "", "")
    );
    // --tail counts the workload's lines, both streams together (out1 and err1 may be logged
    // in either order: each stream has its own logger; out2 came a second later).
    let tail = w.logs(&["--tail", "1"]);
    assert_eq!((tail.stdout.as_str(), tail.stderr.as_str()), ("out2\n", ""));
    let tail = w.logs(&["--tail", "3"]);
    assert_eq!(
        (tail.stdout.as_str(), tail.stderr.as_str()),
        ("out1\nout2\n", "err1\n")
    );

    // A bad --since is a usage error saying what is accepted.
    let bad = w.logs(&["--since", "yesterday"]);
    assert_eq!(bad.code, 2, "{bad:?}");
    assert!(
        bad.stderr.contains("duration ago") && bad.stderr.contains("RFC 3339"),
        "{bad:?}"
    );
    w.finish();
}

#[test]
fn logs_keep_stdout_and_stderr_apart_with_times_oci() {
    streams_times_and_since("oci");
}

#[test]
fn logs_keep_stdout_and_stderr_apart_with_times_process() {
    streams_times_and_since("process");
}

#[test]
fn logs_follow_shows_new_lines_with_their_times() {
    let w = World::new("oci");
    let created = w.sbx(&[
        "sandbox", "create", "-n", "box", "--", "sh", "-c",
        // A line now, then one a second until the test is done.
        "echo first; i=0; while [ $i -lt 60 ]; do sleep 1; i=$((i+1)); echo tick$i; done; sleep 3600",
    ]);
    assert_eq!(created.code, 0, "{created:?}");
    w.wait_for_output("first");
    let began = SystemTime::now();
    let follow = CliStream::start(
        &w.sbxd.endpoint(),
        &[
            "sandbox",
            "logs",
            "-f",
            "--timestamps",
            "--tail",
            "1",
            "box",
        ],
    );
    // The last line there is, then new ones as they are written, each with a time.
    let first = follow
        .next_line(Duration::from_secs(20))
        .expect("a first line");
    assert!(
        first.ends_with(" first") || first.contains(" tick"),
        "{first:?}"
    );
    let mut ticks = Vec::new();
    while ticks.len() < 2 {
        let line = follow
            .next_line(Duration::from_secs(20))
            .expect("a new line within 20 s");
        let (time, text) = timed(&line);
        assert!(text.starts_with("tick"), "{line:?}");
        ticks.push((time, text.to_string()));
    }
    // New lines: logged after the follow began (the second one for sure).
    assert!(ticks[1].0 >= began, "{ticks:?} began {began:?}");
    let n = |t: &str| t["tick".len()..].parse::<u32>().unwrap();
    assert_eq!(n(&ticks[1].1), n(&ticks[0].1) + 1, "{ticks:?}");
    drop(follow);
    w.finish();
}
