//! Jobs that tell the truth, through the real sbxd and `sbx`, on the default driver (oci:
//! needs root, runc, busybox-static) and the process driver: a main command not found fails
//! the create itself (never a Ready a moment before the Error), with `exit_code` and reason
//! `CommandNotFound` in the record; `sbx run --rm` prints the job's output, exits with its
//! code and leaves nothing; `sbx wait --for completed|stopped` waits for a sandbox that will
//! end; and the README tour's job logs are complete once the job is reported ended, run after
//! run.

mod common;

use std::time::Duration;

type World = common::DriverWorld;

fn a_missing_command_fails_the_create(driver: &str) {
    let w = World::new(driver, "jobs");
    for i in 0..5 {
        let name = format!("bad-{i}");
        let made = w.sbx(&["sandbox", "create", &name, "--", "no-such-command"]);
        assert_ne!(made.code, 0, "{made:?}");
        assert!(
            made.stderr.contains("command not found: no-such-command"),
            "{made:?}"
        );
        let got = w.sbx(&["sandbox", "get", &name, "-o", "json"]).json();
        assert_eq!(got["phase"], "Error", "{got}");
        assert_eq!(got["reason"], "CommandNotFound", "{got}");
        assert_eq!(got["exit_code"], 127, "{got}");
    }
    // A command that is there is Ready, with no exit, and an exit's code is in the record.
    let ok = w.sbx(&[
        "sandbox", "create", "fine", "-o", "json", "--", "sleep", "3600",
    ]);
    let ok = ok.json();
    assert_eq!(ok["phase"], "Ready", "{ok}");
    assert!(ok.get("exit_code").is_none(), "{ok}");
    w.finish();
}

#[test]
fn a_missing_command_fails_the_create_oci() {
    a_missing_command_fails_the_create("oci");
}

#[test]
fn a_missing_command_fails_the_create_process() {
    a_missing_command_fails_the_create("process");
}

fn run_is_docker_run(driver: &str, image: &[&str]) {
    let w = World::new(driver, "jobs");
    let mut argv = vec!["run", "--rm"];
    argv.extend_from_slice(image);
    argv.extend_from_slice(&["--", "sh", "-c", "echo hi; echo oops >&2; exit 7"]);
    let ran = w.sbx(&argv);
    assert_eq!(ran.code, 7, "{ran:?}");
    assert_eq!(ran.stdout, "hi\n", "{ran:?}");
    assert_eq!(ran.stderr, "oops\n", "{ran:?}");
    let left = w.sbx(&["sandbox", "list", "-o", "json"]).json();
    assert_eq!(left, serde_json::json!([]), "--rm leaves nothing");

    // Streamed output is printed once, all of it, in order.
    let mut argv = vec!["run", "--rm"];
    argv.extend_from_slice(image);
    argv.extend_from_slice(&[
        "--",
        "sh",
        "-c",
        "i=0; while [ $i -lt 3000 ]; do i=$((i+1)); echo line-$i; done",
    ]);
    let ran = w.sbx(&argv);
    assert_eq!(ran.code, 0, "{:?}", ran.stderr);
    let expected: String = (1..=3000).map(|i| format!("line-{i}\n")).collect();
    assert!(
        ran.stdout == expected,
        "{} lines, not 3000 in order",
        ran.stdout.lines().count()
    );

    // A command not found: 127 and its words; without --rm the sandbox stays, its record
    // telling the end.
    let mut argv = vec!["run", "-n", "kept"];
    argv.extend_from_slice(image);
    argv.extend_from_slice(&["--", "no-such-command"]);
    let ran = w.sbx(&argv);
    assert_eq!(ran.code, 127, "{ran:?}");
    assert!(
        ran.stderr.contains("command not found: no-such-command"),
        "{ran:?}"
    );
    let got = w.sbx(&["sandbox", "get", "kept", "-o", "json"]).json();
    assert_eq!(
        (got["phase"].clone(), got["exit_code"].clone()),
        ("Error".into(), 127.into()),
        "{got}"
    );

    // A signal: 128+N.
    let mut argv = vec!["run", "--rm"];
    argv.extend_from_slice(image);
    argv.extend_from_slice(&["--", "sh", "-c", "kill -9 $$"]);
    let ran = w.sbx(&argv);
    assert_eq!(ran.code, 137, "{ran:?}");
    w.finish();
}

#[test]
fn run_prints_the_output_exits_with_the_code_and_rm_leaves_nothing_oci() {
    run_is_docker_run("oci", &["sbx.local/busybox:latest"]);
}

#[test]
fn run_prints_the_output_exits_with_the_code_and_rm_leaves_nothing_process() {
    run_is_docker_run("process", &[]);
}

#[test]
fn wait_for_completed_and_stopped_wait_for_a_job_that_will_end() {
    let w = World::new("process", "jobs");
    w.sbx(&[
        "sandbox",
        "create",
        "ok",
        "--",
        "sh",
        "-c",
        "sleep 1; exit 0",
    ])
    .ok();
    w.sbx(&[
        "sandbox",
        "create",
        "fails",
        "--",
        "sh",
        "-c",
        "sleep 1; exit 3",
    ])
    .ok();
    w.sbx(&[
        "sandbox",
        "create",
        "ends",
        "--",
        "sh",
        "-c",
        "sleep 1; exit 0",
    ])
    .ok();
    let began = std::time::Instant::now();
    let done = w
        .sbx(&["wait", "--for", "completed", "ok", "-o", "json"])
        .json();
    assert_eq!(
        (done["phase"].clone(), done["exit_code"].clone()),
        ("Completed".into(), 0.into()),
        "{done}"
    );
    assert!(
        began.elapsed() >= Duration::from_millis(500),
        "it waited for the end"
    );
    let failed = w.sbx(&["wait", "--for", "completed", "fails"]);
    assert_eq!(failed.code, 1, "{failed:?}");
    assert!(failed.stderr.contains("status 3"), "{failed:?}");
    let stopped = w
        .sbx(&["wait", "--for", "stopped", "ends", "-o", "json"])
        .json();
    assert_eq!(stopped["phase"], "Completed", "{stopped}");
    // A sandbox that never ends: the wait gives up at its timeout, saying so.
    w.sbx(&["sandbox", "create", "forever", "--", "sleep", "3600"])
        .ok();
    let gave_up = w.sbx(&["wait", "--for", "completed", "forever", "--timeout", "1"]);
    assert_ne!(gave_up.code, 0, "{gave_up:?}");
    w.finish();
}

/// The README tour's job, 50 times: made with an upload, waited for, its logs complete.
#[test]
fn the_tours_job_logs_are_complete_once_it_completed() {
    let w = World::new("oci", "jobs");
    let files = tempfile::tempdir().unwrap();
    std::fs::write(files.path().join("note"), "kept\n").unwrap();
    let upload = format!("{}:/sandbox/in", files.path().display());
    for i in 0..50 {
        let name = format!("job-{i}");
        w.sbx(&[
            "sandbox",
            "create",
            &name,
            "--upload",
            &upload,
            "--",
            "cat",
            "/sandbox/in/note",
        ])
        .ok();
        w.sbx(&["wait", "--for", "completed", &name]).ok();
        let logs = w.sbx(&["sandbox", "logs", &name]);
        assert_eq!(logs.stdout, "kept\n", "run {i}: {logs:?}");
        w.sbx(&["sandbox", "delete", &name]).ok();
    }
    w.finish();
}
