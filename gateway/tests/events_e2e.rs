//! Sandbox events through the real sbxd on its default driver (oci) and the real CLI (needs
//! root, runc and busybox-static): a sandbox whose workload the memory limit kills, which is
//! started again, and whose running workload the reconciler re-attaches after a SIGKILL of
//! sbxd (the test makes the driver's generation disagree while sbxd is down) lists those
//! events in order, from the store, after the restart; events are bounded per sandbox and in
//! all, and go with their sandbox.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{CgroupParent, DataDir, Sbxd, sbx, unique};

fn phase(ep: &str, name: &str) -> String {
    sbx(ep, &["sandbox", "get", name, "-o", "json"]).json()["phase"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

fn wait_phase(ep: &str, name: &str, want: &str) {
    let began = Instant::now();
    loop {
        let now = phase(ep, name);
        if now == want {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "{name} is {now}, never {want}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The reasons of the sandbox's events, oldest first.
fn reasons(ep: &str, name: &str) -> Vec<String> {
    let events = sbx(ep, &["sandbox", "events", name, "-o", "json"]).json();
    events
        .as_array()
        .expect("a list")
        .iter()
        .map(|e| e["reason"].as_str().unwrap().to_string())
        .collect()
}

/// Until the sandbox's events include `reason` (bounded: 10 s).
fn wait_for_reason(ep: &str, name: &str, reason: &str) {
    let began = Instant::now();
    loop {
        let got = reasons(ep, name);
        if got.iter().any(|r| r == reason) {
            return;
        }
        assert!(
            began.elapsed() < Duration::from_secs(10),
            "no {reason} among {got:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The oci driver's record of sandbox `id` under sbxd's data dir.
fn driver_record(data: &Path, id: &str) -> PathBuf {
    let path = data
        .join("drivers/oci/sandboxes")
        .join(id)
        .join("sandbox.json");
    assert!(path.exists(), "no driver record at {}", path.display());
    path
}

/// Whether `want` appears in `got` in this order (other events may come between).
fn in_order(got: &[String], want: &[&str]) -> bool {
    let mut rest = got.iter();
    want.iter().all(|w| rest.any(|g| g == w))
}

#[test]
fn events_tell_an_oom_kill_a_recovery_and_a_reconciliation_in_order_after_a_sigkill() {
    let data = DataDir::new();
    let parent = CgroupParent(format!("sbx-gateway-tests-events-{}", unique()));
    let flags = [
        "--oci-cgroup-parent",
        parent.0.as_str(),
        "--events-per-sandbox",
        "8",
    ];
    let mut d = Sbxd::start(data.path(), "", &flags);
    let ep = d.endpoint();

    // Its first run holds more than its 64 MiB: the memory limit kills it. Its second sleeps.
    let script = "if [ -f /sandbox/once ]; then exec sleep 3600; fi; touch /sandbox/once; \
                  x=$(head -c 209715200 /dev/zero | tr '\\0' x); sleep 3600";
    let created = sbx(
        &ep,
        &[
            "sandbox", "create", "oom", "--memory", "64Mi", "--detach", "--", "sh", "-c", script,
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    wait_phase(&ep, "oom", "Error");
    let get = sbx(&ep, &["sandbox", "get", "oom", "-o", "json"]).json();
    assert_eq!(get["reason"], "OOMKilled", "{get}");
    sbx(&ep, &["sandbox", "start", "oom"]).ok();
    wait_phase(&ep, "oom", "Ready");
    let id = get["id"].as_str().unwrap().to_string();
    let generation = sbx(&ep, &["sandbox", "get", "oom", "-o", "json"]).json()["generation"]
        .as_u64()
        .unwrap();
    // (An event is written just after its change, by a task of its own: the recovery's is
    // in the store before sbxd is killed.)
    wait_for_reason(&ep, "oom", "Recovered");

    // SIGKILL sbxd; while it is down the driver's record comes to disagree about the running
    // workload's generation (as after a driver that restarted it on its own).
    d.sigkill();
    let record = driver_record(data.path(), &id);
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&record).unwrap()).unwrap();
    let drifted = generation + 5;
    json["generation"] = serde_json::json!(drifted);
    std::fs::write(&record, serde_json::to_vec(&json).unwrap()).unwrap();
    let d = Sbxd::start(data.path(), "", &flags);
    let ep = d.endpoint();
    wait_phase(&ep, "oom", "Ready");
    let began = Instant::now();
    let got = loop {
        let got = reasons(&ep, "oom");
        if got.iter().any(|r| r == "Adopted") || began.elapsed() > Duration::from_secs(30) {
            break got;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!("events of oom after the restart: {got:?}");
    assert!(
        in_order(
            &got,
            &["Created", "Started", "OOMKilled", "Recovered", "Adopted"]
        ),
        "{got:?}"
    );
    // Each with its type, a message saying what happened, and the generation.
    let events = sbx(&ep, &["sandbox", "events", "oom", "-o", "json"]).json();
    let by_reason = |reason: &str| {
        events
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["reason"] == reason)
            .unwrap()
            .clone()
    };
    let oom = by_reason("OOMKilled");
    assert_eq!(oom["type"], "Warning", "{oom}");
    assert!(
        oom["message"].as_str().unwrap().contains("memory limit"),
        "{oom}"
    );
    let recovered = by_reason("Recovered");
    assert_eq!(recovered["type"], "Normal", "{recovered}");
    assert!(
        recovered["message"].as_str().unwrap().contains("OOMKilled"),
        "{recovered}"
    );
    let adopted = by_reason("Adopted");
    assert_eq!(adopted["generation"], drifted, "{adopted}");
    let times: Vec<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["time"].as_str().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
    // The table says the same.
    let table = sbx(&ep, &["sandbox", "events", "oom"]).ok().to_string();
    eprintln!("$ sbx sandbox events oom\n{table}");
    assert!(
        table.starts_with("TIME") && table.contains("OOMKilled"),
        "{table}"
    );

    // Bounded per sandbox: stop and start it again and again; the newest 8 are kept.
    sbx(&ep, &["sandbox", "create", "churn", "--", "sleep", "3600"]).ok();
    for _ in 0..6 {
        sbx(&ep, &["sandbox", "stop", "churn"]).ok();
        sbx(&ep, &["sandbox", "start", "churn"]).ok();
    }
    // The last writes and drops land a moment after the last start answered.
    let began = Instant::now();
    let churn = loop {
        let churn = reasons(&ep, "churn");
        if (churn.len() == 8 && churn.last().map(String::as_str) == Some("Started"))
            || began.elapsed() > Duration::from_secs(10)
        {
            break churn;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    eprintln!("events of churn: {churn:?}");
    assert_eq!(churn.len(), 8, "{churn:?}");
    assert_eq!(
        churn.last().map(String::as_str),
        Some("Started"),
        "{churn:?}"
    );
    assert!(
        !churn.contains(&"Created".to_string()),
        "the oldest went first: {churn:?}"
    );

    // `sbx events` lists the workspace's, oldest first; deleted with their sandbox.
    let all = sbx(&ep, &["events", "-o", "json"]).json();
    let names: Vec<&str> = all
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["sandbox"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"oom") && names.contains(&"churn"),
        "{names:?}"
    );
    sbx(&ep, &["sandbox", "delete", "churn"]).ok();
    let after = sbx(&ep, &["events", "-o", "json"]).json();
    assert!(
        after
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["sandbox"] != "churn"),
        "{after}"
    );

    // Bounded in all: a gateway with --events-max 3 drops the oldest at start.
    drop(d);
    let d = Sbxd::start(
        data.path(),
        "",
        &["--oci-cgroup-parent", &parent.0, "--events-max", "3"],
    );
    let ep = d.endpoint();
    let began = Instant::now();
    loop {
        let left = sbx(&ep, &["events", "-o", "json"]).json();
        let left = left.as_array().unwrap();
        if left.len() <= 3 {
            let reasons: Vec<&str> = left.iter().map(|e| e["reason"].as_str().unwrap()).collect();
            assert!(
                reasons.contains(&"Adopted"),
                "the newest are kept: {reasons:?}"
            );
            break;
        }
        assert!(began.elapsed() < Duration::from_secs(20), "{left:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
    sbx(&ep, &["sandbox", "delete", "oom"]).ok();
}
