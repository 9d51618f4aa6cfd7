//! Limits by default, through the real sbxd on its default driver (oci) and the real `sbx`
//! CLI (needs root, runc and busybox-static): a sandbox that asks for nothing gets the
//! gateway's cpu and memory limits, a workspace's defaults replace the gateway's field by
//! field, a sandbox's own replace both; what applies is in its spec, on `sbx sandbox get`, in
//! its cgroup, and seen from inside.

mod common;

use common::{CgroupParent, DataDir, Sbxd, sbx, unique};

fn limits(endpoint: &str, name: &str) -> (u64, u64) {
    let get = sbx(endpoint, &["sandbox", "get", name, "-o", "json"]).json();
    (
        get["cpu_millis"].as_u64().unwrap(),
        get["memory_bytes"].as_u64().unwrap(),
    )
}

fn disk_limit(endpoint: &str, name: &str) -> u64 {
    let get = sbx(endpoint, &["sandbox", "get", name, "-o", "json"]).json();
    get["disk_bytes"].as_u64().unwrap()
}

/// The size of the filesystem /sandbox is on, seen from inside, in KiB (`df -k`).
fn disk_inside_kib(endpoint: &str, name: &str) -> u64 {
    let out = sbx(
        endpoint,
        &["sandbox", "exec", name, "--", "df", "-k", "/sandbox"],
    )
    .ok()
    .to_string();
    out.lines()
        .nth(1)
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("df: {out}"))
}

/// The memory limit the sandbox sees from inside (its own cgroup, v1 or v2).
fn memory_inside(endpoint: &str, name: &str) -> String {
    sbx(
        endpoint,
        &[
            "sandbox",
            "exec",
            name,
            "--",
            "sh",
            "-c",
            "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
        ],
    )
    .ok()
    .trim()
    .to_string()
}

#[test]
fn sandboxes_get_the_gateways_limits_unless_their_workspace_or_they_say_otherwise() {
    let data = DataDir::new();
    let parent = CgroupParent(format!("sbx-gateway-tests-limits-{}", unique()));
    let d = Sbxd::start(
        data.path(),
        "",
        &[
            "--oci-cgroup-parent",
            &parent.0,
            "--default-memory",
            "1Gi",
            "--default-cpu",
            "1",
            "--default-disk",
            "1Gi",
        ],
    );
    let ep = d.endpoint();
    const GIB: u64 = 1 << 30;

    // Nothing asked: the gateway's defaults (1 core, 1 GiB), shown and enforced.
    sbx(&ep, &["sandbox", "create", "plain", "--", "sleep", "3600"]).ok();
    assert_eq!(limits(&ep, "plain"), (1000, GIB));
    let table = sbx(&ep, &["sandbox", "get", "plain"]).ok().to_string();
    assert!(
        table.contains("LIMITS: cpu 1, memory 1.0GiB, disk 1.0GiB"),
        "{table}"
    );
    assert_eq!(memory_inside(&ep, "plain"), GIB.to_string());
    // The disk: /sandbox is on a filesystem of that size (less ext4's own metadata).
    assert_eq!(disk_limit(&ep, "plain"), GIB);
    let kib = disk_inside_kib(&ep, "plain");
    assert!(
        kib <= GIB / 1024 && kib > GIB / 1024 * 9 / 10,
        "/sandbox is {kib} KiB"
    );

    // The workspace's default memory replaces the gateway's; its cpu is still the gateway's.
    sbx(
        &ep,
        &["workspace", "limits", "set", "default", "--memory", "256Mi"],
    )
    .ok();
    let shown = sbx(
        &ep,
        &["workspace", "limits", "get", "default", "-o", "json"],
    )
    .json();
    assert_eq!(
        (shown["cpu_millis"].as_u64(), shown["memory_bytes"].as_u64()),
        (Some(0), Some(256 << 20)),
        "{shown}"
    );
    sbx(&ep, &["sandbox", "create", "ws", "--", "sleep", "3600"]).ok();
    assert_eq!(limits(&ep, "ws"), (1000, 256 << 20));
    assert_eq!(memory_inside(&ep, "ws"), (256u64 << 20).to_string());

    // The sandbox's own limits win; an earlier sandbox keeps what it was given.
    sbx(
        &ep,
        &[
            "sandbox", "create", "own", "--cpu", "0.5", "--memory", "64Mi", "--", "sleep", "3600",
        ],
    )
    .ok();
    assert_eq!(limits(&ep, "own"), (500, 64 << 20));
    // A disk of its own, and a workspace's default disk, in the same way.
    sbx(
        &ep,
        &[
            "sandbox", "create", "disk", "--disk", "128Mi", "--", "sleep", "3600",
        ],
    )
    .ok();
    assert_eq!(disk_limit(&ep, "disk"), 128 << 20);
    assert!(disk_inside_kib(&ep, "disk") <= 128 << 10);
    assert_eq!(limits(&ep, "plain"), (1000, GIB));

    // Bad input is refused and changes nothing; --clear goes back to the gateway's.
    let bad = sbx(
        &ep,
        &["workspace", "limits", "set", "default", "--memory", "1Ki"],
    );
    assert_ne!(bad.code, 0, "{bad:?}");
    assert!(bad.stderr.contains("4 MiB"), "{bad:?}");
    let neither = sbx(&ep, &["workspace", "limits", "set", "default"]);
    assert_eq!(neither.code, 2, "{neither:?}");
    sbx(&ep, &["workspace", "limits", "set", "default", "--clear"]).ok();
    sbx(&ep, &["sandbox", "create", "after", "--", "sleep", "3600"]).ok();
    assert_eq!(limits(&ep, "after"), (1000, GIB));

    let tiny = sbx(
        &ep,
        &[
            "sandbox", "create", "tiny", "--disk", "1Mi", "--", "sleep", "3600",
        ],
    );
    assert_ne!(tiny.code, 0, "{tiny:?}");
    assert!(tiny.stderr.contains("32 MiB"), "{tiny:?}");
    for name in ["plain", "ws", "own", "disk", "after"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    drop(d);

    // An sbxd given a default below what a sandbox can start with does not start.
    let bad = common::run_bounded(
        common::sbxd_command().args([
            "serve",
            "--data-dir",
            &data.path().join("other").display().to_string(),
            "--default-memory",
            "1Ki",
        ]),
        "sbxd with a tiny default",
    );
    assert_ne!(bad.code, 0, "{bad:?}");
    assert!(bad.stderr.contains("--default-memory"), "{bad:?}");
}

/// `--log-max`: a sandbox that writes 4 MiB of output keeps at most the cap of it on the host
/// (its log and the part before it), and `sbx sandbox logs` tells its newest lines.
#[test]
fn a_sandboxs_log_stays_within_the_gateways_cap() {
    let data = DataDir::new();
    let parent = CgroupParent(format!("sbx-gateway-tests-logcap-{}", unique()));
    let d = Sbxd::start(
        data.path(),
        "",
        &["--oci-cgroup-parent", &parent.0, "--log-max", "1Mi"],
    );
    let ep = d.endpoint();
    let flood = "i=0; while [ $i -lt 20000 ]; do \
                 echo \"line $i xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\"; \
                 i=$((i+1)); done; echo flood-done; exec sleep 3600";
    sbx(&ep, &["sandbox", "create", "loud", "--", "sh", "-c", flood]).ok();
    let id = sbx(&ep, &["sandbox", "get", "loud", "-o", "json"]).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    let dir = data.path().join("drivers/oci/sandboxes").join(&id);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let told = loop {
        let told = sbx(&ep, &["sandbox", "logs", "loud", "--tail", "3"])
            .ok()
            .to_string();
        if told.contains("flood-done") {
            break told;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the flood never ended: {told}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    assert!(told.contains("line 19999 "), "{told}");
    let size = |name: &str| std::fs::metadata(dir.join(name)).map_or(0, |m| m.len());
    let (log, before) = (size("workload.log"), size("workload.log.1"));
    assert!(before > 0, "the log was never rotated");
    assert!(
        log + before <= (1 << 20) + 64 * 1024,
        "{log} + {before} bytes of log kept, over the 1Mi cap"
    );
    sbx(&ep, &["sandbox", "delete", "loud"]).ok();
    drop(d);
    common::assert_oci_left_nothing(data.path(), &parent.0);
}
