//! The CLI's waits through the real sbxd on its default driver (oci) and the real `sbx`:
//! create returns as soon as the gateway has the sandbox Ready (it follows the watch stream;
//! it used to poll every 200 ms), and tells the truth (a main process that exits within the
//! wait is reported as Completed or as the failure, with its status); stop/start/restart wait
//! for the state they ask for; `sbx wait --for serving|ready|stopped|deleted`; the address
//! file of a killed sbxd is never trusted; a relative `--data-dir` works.

mod common;

use std::path::Path;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant, SystemTime};

use common::{DataDir, Sbxd, oci_containers, sbx};
use serde_json::Value;

fn field<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key]
        .as_str()
        .unwrap_or_else(|| panic!("no string {key:?} in {v}"))
}

fn timestamp(v: &Value, key: &str) -> SystemTime {
    let text = field(v, key);
    let parsed: sbx_proto::Timestamp = text
        .parse()
        .unwrap_or_else(|e| panic!("{key} {text:?} is not RFC 3339: {e}"));
    SystemTime::try_from(parsed).unwrap_or_else(|e| panic!("{key} {text:?}: {e}"))
}

/// An sbxd started here (cwd, flags of the test's choosing); SIGKILLed by pid on drop.
struct Daemon(Child);

impl Daemon {
    fn spawn(cwd: &Path, args: &[&str]) -> Daemon {
        let log = std::fs::File::create(cwd.join(format!("sbxd-{}.log", common::unique())))
            .expect("log file");
        Daemon(
            common::sbxd_command()
                .arg("serve")
                .args(["--listen", "127.0.0.1:0"])
                .args(args)
                .current_dir(cwd)
                .env("SBX_LOG", "info")
                // Plain TCP on loopback, as the tests' clients dial it.
                .env("SBX_AUTH", "none")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn sbxd"),
        )
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `sbx wait --for serving --addr-file FILE`: the address, once it serves.
fn wait_serving(addr_file: &Path) -> String {
    let run = sbx(
        "",
        &[
            "wait",
            "--for",
            "serving",
            "--addr-file",
            addr_file.to_str().unwrap(),
            "--timeout",
            "60",
        ],
    );
    run.ok().trim().to_string()
}

#[test]
fn create_returns_when_the_gateway_has_it_ready() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "", &[]);
    let ep = d.endpoint();
    let mut cli_ms = Vec::new();
    let mut gateway_ms = Vec::new();
    for i in 0..8 {
        let name = format!("fast-{i}");
        let began = Instant::now();
        let v = sbx(
            &ep,
            &[
                "sandbox", "create", &name, "--settle", "0", "-o", "json", "--", "sleep", "1000",
            ],
        )
        .json();
        let cli = began.elapsed();
        assert_eq!(field(&v, "phase"), "Ready", "{v}");
        let gateway = timestamp(&v, "updated_at")
            .duration_since(timestamp(&v, "created_at"))
            .unwrap_or_default();
        cli_ms.push(cli.as_secs_f64() * 1000.0);
        gateway_ms.push(gateway.as_secs_f64() * 1000.0);
    }
    // --settle 500 holds Ready for 500 ms more.
    let began = Instant::now();
    let v = sbx(
        &ep,
        &[
            "sandbox", "create", "settled", "--settle", "500", "-o", "json", "--", "sleep", "1000",
        ],
    )
    .json();
    let settled = began.elapsed();
    assert_eq!(field(&v, "phase"), "Ready", "{v}");
    assert!(settled >= Duration::from_millis(500), "{settled:?}");
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (cli, gateway) = (median(&mut cli_ms), median(&mut gateway_ms));
    eprintln!(
        "create→Ready over 8 creates, median: sbx (process start to exit) {cli:.1} ms, \
         gateway (created_at→updated_at of Ready) {gateway:.1} ms; with --settle 500 \
         {:.1} ms; all sbx: {cli_ms:.1?}; all gateway: {gateway_ms:.1?}",
        settled.as_secs_f64() * 1000.0
    );
    // Polling every 200 ms put 0–200 ms on each; what is left is starting sbx and dialing.
    assert!(
        cli - gateway < 120.0,
        "sbx takes {cli:.1} ms for a create the gateway has Ready in {gateway:.1} ms"
    );
    for i in 0..8 {
        sbx(&ep, &["sandbox", "delete", &format!("fast-{i}")]).ok();
    }
    sbx(&ep, &["sandbox", "delete", "settled"]).ok();
    assert!(oci_containers(data.path()).is_empty());
}

#[test]
fn create_tells_the_truth_about_the_main_process() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "", &[]);
    let ep = d.endpoint();

    let failed = sbx(
        &ep,
        // --settle: the oci driver notices an exit within 250 ms.
        &[
            "sandbox", "create", "bad", "--settle", "500", "--", "sh", "-c", "exit 3",
        ],
    );
    assert_eq!(failed.code, 1, "{failed:?}");
    // The reason is the driver's (oci: "Error"), the message the gateway's with the status.
    assert!(
        failed.stderr.contains("error: sandbox \"bad\" failed: ")
            && failed.stderr.contains("main process exited with status 3"),
        "{failed:?}"
    );
    assert!(
        !failed
            .stderr
            .lines()
            .last()
            .unwrap_or_default()
            .contains("Ready"),
        "{failed:?}"
    );
    assert!(failed.stdout.is_empty(), "{failed:?}");
    let got = sbx(&ep, &["sandbox", "get", "bad", "-o", "json"]).json();
    assert_eq!(field(&got, "phase"), "Error", "{got}");

    let killed = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "killed",
            "--settle",
            "500",
            "--",
            "sh",
            "-c",
            "kill -9 $$",
        ],
    );
    assert_eq!(killed.code, 1, "{killed:?}");
    assert!(
        killed.stderr.contains("failed: ") && killed.stderr.contains('9'),
        "{killed:?}"
    );

    let done = sbx(
        &ep,
        &[
            "sandbox", "create", "done", "--settle", "500", "-o", "json", "--", "true",
        ],
    )
    .json();
    assert_eq!(field(&done, "phase"), "Completed", "never Ready: {done}");

    // `sbx wait --for ready` of a failed sandbox fails the same way.
    let waited = sbx(&ep, &["wait", "--for", "ready", "bad"]);
    assert_eq!(waited.code, 1, "{waited:?}");
    assert!(waited.stderr.contains("exited with status 3"), "{waited:?}");

    for name in ["bad", "killed", "done"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    assert!(oci_containers(data.path()).is_empty());
}

#[test]
fn stop_start_restart_and_wait_reach_their_state() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "", &[]);
    let ep = d.endpoint();
    let web = sbx(
        &ep,
        &[
            "sandbox", "create", "web", "-o", "json", "--", "sleep", "1000",
        ],
    )
    .json();
    let id = field(&web, "id").to_string();
    let generation = web["generation"].as_u64().unwrap();

    let stopped = sbx(&ep, &["sandbox", "stop", "web", "-o", "json"]).json();
    assert_eq!(field(&stopped, "phase"), "Stopped", "{stopped}");
    let waited = sbx(&ep, &["wait", "--for", "stopped", "web", "-o", "json"]).json();
    assert_eq!(field(&waited, "phase"), "Stopped", "{waited}");
    // Not Ready, and not about to be: waiting for Ready on a stopped sandbox fails at once.
    let refused = sbx(&ep, &["wait", "--for", "ready", "web", "--timeout", "30"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains("will not become Ready"),
        "{refused:?}"
    );

    // start and restart answer Ready themselves; no polling needed.
    let started = sbx(&ep, &["sandbox", "start", "web", "-o", "json"]).json();
    assert_eq!(field(&started, "phase"), "Ready", "{started}");
    assert_eq!(started["generation"].as_u64().unwrap(), generation + 1);
    let restarted = sbx(&ep, &["sandbox", "restart", "--id", &id, "-o", "json"]).json();
    assert_eq!(field(&restarted, "phase"), "Ready", "{restarted}");
    assert_eq!(restarted["generation"].as_u64().unwrap(), generation + 2);
    let ready = sbx(&ep, &["wait", "--for", "ready", "--id", &id, "-o", "json"]).json();
    assert_eq!(field(&ready, "id"), id);

    let usage = sbx(&ep, &["wait", "--for", "ready"]);
    assert_eq!(usage.code, 1, "{usage:?}");
    assert!(usage.stderr.contains("needs the sandbox"), "{usage:?}");

    sbx(&ep, &["sandbox", "delete", "web"]).ok();
    let gone = sbx(&ep, &["wait", "--for", "deleted", "--id", &id]);
    assert_eq!(gone.code, 0, "{gone:?}");
    assert!(oci_containers(data.path()).is_empty());
}

#[test]
fn wait_for_serving_never_trusts_a_stale_address_file() {
    let data = DataDir::new();
    let addr_file = data.path().join("addr");
    // What an sbxd killed with SIGKILL leaves: an address nobody serves on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stale = dead.local_addr().unwrap().to_string();
    drop(dead);
    std::fs::write(&addr_file, format!("{stale}\n")).unwrap();
    let nobody = sbx(
        "",
        &[
            "wait",
            "--for",
            "serving",
            "--addr-file",
            addr_file.to_str().unwrap(),
            "--timeout",
            "1",
        ],
    );
    assert_eq!(nobody.code, 1, "{nobody:?}");
    assert!(
        nobody.stderr.contains("not serving after 1s") && nobody.stderr.contains(&stale),
        "{nobody:?}"
    );

    let data_arg = data.path().to_str().unwrap().to_string();
    let addr_arg = addr_file.to_str().unwrap().to_string();
    let _d = Daemon::spawn(
        data.path(),
        &["--data-dir", &data_arg, "--addr-file", &addr_arg],
    );
    let began = Instant::now();
    let serving = wait_serving(&addr_file);
    assert_ne!(serving, stale);
    assert_eq!(
        std::fs::read_to_string(&addr_file).unwrap(),
        format!("{serving}\n")
    );
    let list = sbx(&serving, &["sandbox", "list"]);
    assert_eq!(list.code, 0, "{list:?}");
    eprintln!("sbxd served after {:?}", began.elapsed());
}

#[test]
fn a_relative_data_dir_works() {
    let data = DataDir::new();
    // The data dir is named relative to its parent, which sbxd starts in.
    let parent = data.path().parent().unwrap();
    let relative = data.path().file_name().unwrap().to_str().unwrap();
    let addr = format!("{relative}/addr");
    let _d = Daemon::spawn(parent, &["--data-dir", relative, "--addr-file", &addr]);
    let ep = wait_serving(&data.path().join("addr"));
    assert!(data.path().join("store").is_dir(), "the store is in DATA");
    let web = sbx(
        &ep,
        &[
            "sandbox", "create", "web", "-o", "json", "--", "sleep", "1000",
        ],
    )
    .json();
    assert_eq!(field(&web, "phase"), "Ready", "{web}");
    let run = sbx(
        &ep,
        &[
            "sandbox",
            "exec",
            "web",
            "--",
            "sh",
            "-c",
            "echo hi > /sandbox/f; cat /sandbox/f",
        ],
    );
    assert_eq!(run.ok(), "hi\n");
    assert_eq!(oci_containers(data.path()).len(), 1);
    sbx(&ep, &["sandbox", "delete", "web"]).ok();
    assert!(oci_containers(data.path()).is_empty());
}
