//! Pause on the default driver (oci: the cgroup freezer), end to end through the real sbxd
//! and the real `sbx` CLI (needs root, runc, busybox-static and a cgroup freezer): `sbx
//! sandbox pause` and `resume` keep the sandbox's processes (the same host pids, a counter
//! that counts on from where it stood, not from 1); a `--ttl 3s --on-ttl pause` sandbox is
//! paused by its ttl and resumed by an exec; and sbxd SIGKILLed right after a pause request
//! comes back to a sandbox that is Paused or Ready, with the same processes, never lost or
//! half frozen. Each test checks that nothing of it is left.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{CgroupParent, CliRun, DataDir, SBX, Sbxd, assert_oci_left_nothing, sbx, unique};

/// The workload: its pid in /tmp/pid, a file in /tmp, and a counter that ticks every 50 ms in
/// /tmp/count (written whole: renamed into place).
const COUNTER: &str = "mkdir -p /tmp; echo $$ > /tmp/pid; echo kept > /tmp/kept; i=0; \
     while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; \
     sleep 0.05; done";

/// One test's gateway on the default driver, under a cgroup parent of its own.
struct World {
    data: DataDir,
    parent: CgroupParent,
}

impl World {
    fn new() -> World {
        World {
            data: DataDir::new(),
            parent: CgroupParent(format!("sbx-gateway-tests-pause-{}", unique())),
        }
    }

    fn start(&self) -> Sbxd {
        Sbxd::start(
            self.data.path(),
            "",
            &["--oci-cgroup-parent", &self.parent.0],
        )
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.data.path().join("drivers/oci/sandboxes").join(id)
    }

    /// The counter, as the host reads it in the sandbox's writable layer (works while paused).
    fn count(&self, id: &str) -> Option<u64> {
        std::fs::read_to_string(self.sandbox_dir(id).join("disk/upper/tmp/count"))
            .ok()?
            .trim()
            .parse()
            .ok()
    }

    /// Waits (bounded) for the counter to reach `at_least`; answers it.
    fn count_reaches(&self, id: &str, at_least: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(n) = self.count(id).filter(|n| *n >= at_least) {
                return n;
            }
            assert!(
                Instant::now() < deadline,
                "the counter did not reach {at_least}: {:?}",
                self.count(id)
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn cgroup_file(&self, id: &str, controller: &str, file: &str) -> PathBuf {
        Path::new("/sys/fs/cgroup")
            .join(controller)
            .join(&self.parent.0)
            .join(id)
            .join(file)
    }

    /// The kernel's freezer state of the sandbox's cgroup (v1, as on this project's hosts).
    fn freezer(&self, id: &str) -> String {
        std::fs::read_to_string(self.cgroup_file(id, "freezer", "freezer.state"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// The host pids of the sandbox's processes but the counter's passing `sleep` and `mv` (a
    /// freeze may also catch one of its forks before its exec: the tests check that every
    /// process seen before is there after; a restart would end them all).
    fn host_pids(&self, id: &str) -> BTreeSet<i32> {
        std::fs::read_to_string(self.cgroup_file(id, "pids", "cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter(|pid| {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"));
                !matches!(comm.unwrap_or_default().trim(), "sleep" | "mv" | "")
            })
            .collect()
    }

    /// The processes of [`World::host_pids`] that are there twice, 200 ms apart (none of the
    /// counter's passing ones).
    fn lasting_pids(&self, id: &str) -> BTreeSet<i32> {
        let first = self.host_pids(id);
        std::thread::sleep(Duration::from_millis(200));
        first.intersection(&self.host_pids(id)).copied().collect()
    }

    /// Deletes `names`, stops sbxd, checks that nothing is left.
    fn finish(&self, mut d: Sbxd, names: &[&str]) {
        for name in names {
            sbx(&d.endpoint(), &["sandbox", "delete", name]).ok();
        }
        d.sigterm(Duration::from_secs(30));
        assert_oci_left_nothing(self.data.path(), &self.parent.0);
    }
}

fn get(ep: &str, name: &str) -> serde_json::Value {
    sbx(ep, &["sandbox", "get", name, "-o", "json"]).json()
}

fn exec(ep: &str, name: &str, script: &str) -> CliRun {
    sbx(ep, &["sandbox", "exec", name, "--", "sh", "-c", script])
}

/// Waits (bounded) until `pred` holds of sandbox `name`; answers it.
fn wait_get(
    ep: &str,
    name: &str,
    limit: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + limit;
    loop {
        let got = get(ep, name);
        if pred(&got) {
            return got;
        }
        assert!(
            Instant::now() < deadline,
            "not as expected in {limit:?}: {got}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sbx_pauses_and_resumes_a_sandbox_on_the_default_driver() {
    let w = World::new();
    let d = w.start();
    let ep = d.endpoint();
    sbx(
        &ep,
        &[
            "sandbox", "create", "-n", "counter", "--", "sh", "-c", COUNTER,
        ],
    )
    .ok();
    let id = get(&ep, "counter")["id"].as_str().unwrap().to_string();
    assert_eq!(get(&ep, "counter")["driver"], "oci");
    w.count_reaches(&id, 5);
    let pid = exec(&ep, "counter", "cat /tmp/pid").ok().to_string();
    let before = w.lasting_pids(&id);

    let paused = sbx(&ep, &["sandbox", "pause", "counter"]);
    assert_eq!(paused.code, 0, "{paused:?}");
    assert_eq!(get(&ep, "counter")["phase"], "Paused");
    assert_eq!(w.freezer(&id), "FROZEN");
    let at_pause = w.count(&id).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(w.count(&id), Some(at_pause), "the counter ran while paused");
    // An exec into a sandbox paused by a call is refused, and leaves it paused.
    let refused = exec(&ep, "counter", "true");
    assert_ne!(refused.code, 0, "{refused:?}");
    assert_eq!(get(&ep, "counter")["phase"], "Paused");

    let resumed = sbx(&ep, &["sandbox", "resume", "counter"]);
    assert_eq!(resumed.code, 0, "{resumed:?}");
    assert_eq!(get(&ep, "counter")["phase"], "Ready");
    let after = w.count_reaches(&id, at_pause + 1);
    assert!(after <= at_pause + 20, "{at_pause} → {after}");
    let now = w.host_pids(&id);
    assert!(
        before.is_subset(&now),
        "processes gone: {before:?} → {now:?}"
    );
    let out = exec(&ep, "counter", "cat /tmp/pid /tmp/kept")
        .ok()
        .to_string();
    assert_eq!(out, format!("{pid}kept\n"));
    w.finish(d, &["counter"]);
}

#[test]
fn a_ttl_pauses_a_sandbox_on_oci_and_an_exec_resumes_it() {
    let w = World::new();
    let d = w.start();
    let ep = d.endpoint();
    let created = sbx(
        &ep,
        &[
            "sandbox", "create", "-n", "napper", "--ttl", "3s", "--on-ttl", "pause", "--", "sh",
            "-c", COUNTER,
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let id = get(&ep, "napper")["id"].as_str().unwrap().to_string();
    w.count_reaches(&id, 3);
    let pid = exec(&ep, "napper", "cat /tmp/pid").ok().to_string();
    let before = w.lasting_pids(&id);
    let paused = wait_get(&ep, "napper", Duration::from_secs(20), |s| {
        s["phase"] == "Paused"
    });
    assert_eq!(paused["reason"], "TtlExpired", "{paused}");
    assert_eq!(w.freezer(&id), "FROZEN");
    let at_pause = w.count(&id).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(w.count(&id), Some(at_pause), "the counter ran while paused");
    // Its ttl paused it: an exec resumes it first, then runs in the same processes.
    let out = exec(&ep, "napper", "cat /tmp/pid /tmp/kept")
        .ok()
        .to_string();
    assert_eq!(out, format!("{pid}kept\n"));
    assert_eq!(get(&ep, "napper")["phase"], "Ready");
    let now = w.host_pids(&id);
    assert!(
        before.is_subset(&now),
        "processes gone: {before:?} → {now:?}"
    );
    w.count_reaches(&id, at_pause + 1);
    w.finish(d, &["napper"]);
}

#[test]
fn sbxd_killed_right_after_a_pause_request_comes_back_paused_or_ready() {
    let w = World::new();
    let mut d = w.start();
    let ep = d.endpoint();
    sbx(
        &ep,
        &[
            "sandbox", "create", "-n", "counter", "--", "sh", "-c", COUNTER,
        ],
    )
    .ok();
    let id = get(&ep, "counter")["id"].as_str().unwrap().to_string();
    w.count_reaches(&id, 3);
    let pid = exec(&ep, "counter", "cat /tmp/pid").ok().to_string();
    let before = w.lasting_pids(&id);
    let mut outcomes = Vec::new();
    for delay_ms in [0u64, 5, 10, 15, 20, 25, 30, 40, 60, 200] {
        let ep = d.endpoint();
        // The request sent, then sbxd SIGKILLed `delay_ms` later, wherever it is.
        let mut request = Command::new(SBX)
            .args(["sandbox", "pause", "counter"])
            .env("SBX_ENDPOINT", &ep)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        d.sigkill();
        let _ = request.kill();
        let _ = request.wait();
        // Whether the killed sbxd had finished the freeze (its driver logs it), or was cut
        // before or during it.
        let finished = d.log_text().contains("sandbox paused (frozen)");
        d = w.start();
        let ep = d.endpoint();
        // Settled: Paused with its cgroup frozen, or Ready with it thawed.
        let settled = wait_get(&ep, "counter", Duration::from_secs(30), |s| {
            matches!(
                (s["phase"].as_str(), w.freezer(&id).as_str()),
                (Some("Paused"), "FROZEN") | (Some("Ready"), "THAWED")
            )
        });
        let phase = settled["phase"].as_str().unwrap().to_string();
        let now = w.host_pids(&id);
        assert!(
            before.is_subset(&now),
            "killed after {delay_ms} ms: processes gone: {before:?} → {now:?}"
        );
        let cut = if finished {
            "after the freeze"
        } else {
            "before its end"
        };
        outcomes.push(format!("{delay_ms} ms ({cut}): {phase}"));
        if phase == "Paused" {
            let resumed = sbx(&ep, &["sandbox", "resume", "counter"]);
            assert_eq!(resumed.code, 0, "{resumed:?}");
        }
        let at = w.count(&id).unwrap();
        w.count_reaches(&id, at + 1);
        let now = exec(&ep, "counter", "cat /tmp/pid").ok().to_string();
        assert_eq!(now, pid, "killed after {delay_ms} ms: not the same process");
    }
    eprintln!("sbxd SIGKILLed after a pause request: {outcomes:?}");
    // The later requests had the time to pause it (a driver that cannot pause never does).
    assert!(
        outcomes.iter().any(|o| o.ends_with("Paused")),
        "no pause took: {outcomes:?}"
    );
    w.finish(d, &["counter"]);
}
