//! `sbx sandbox stats` through the real sbxd on its default driver (oci) and the real CLI
//! (needs root, runc and busybox-static): a workload that holds about 100 MiB and burns a
//! core reads within 10 % of its cgroup's own figures (read beside it from
//! `/sys/fs/cgroup`); the disk figure moves when the workload writes; the history keeps one
//! sample per interval; `--watch` streams; a sandbox of a driver's that is gone is an error,
//! not a zero. The network counters are checked in `network_e2e.rs` (they need a network).

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{CgroupParent, DataDir, Sbxd, sbx, unique};

/// The directory of the sandbox's cgroup in the v1 hierarchy `controller`, or v2's.
fn cgroup_dir(parent: &str, id: &str, controller: &str) -> PathBuf {
    let v1 = PathBuf::from("/sys/fs/cgroup")
        .join(controller)
        .join(parent)
        .join(id);
    if v1.is_dir() {
        v1
    } else {
        PathBuf::from("/sys/fs/cgroup").join(parent).join(id)
    }
}

fn read_u64(path: PathBuf) -> u64 {
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .trim()
        .parse()
        .unwrap()
}

/// The cgroup's CPU time (ns) and memory in use (bytes), as its own files say.
fn cgroup_figures(parent: &str, id: &str) -> (u64, u64) {
    let cpu = cgroup_dir(parent, id, "cpuacct");
    let cpu_ns = if cpu.join("cpuacct.usage").exists() {
        read_u64(cpu.join("cpuacct.usage"))
    } else {
        let stat = std::fs::read_to_string(cpu.join("cpu.stat")).unwrap();
        let usec: u64 = stat
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .unwrap()
            .parse()
            .unwrap();
        usec * 1000
    };
    let mem = cgroup_dir(parent, id, "memory");
    let used = if mem.join("memory.usage_in_bytes").exists() {
        read_u64(mem.join("memory.usage_in_bytes"))
    } else {
        read_u64(mem.join("memory.current"))
    };
    (cpu_ns, used)
}

fn stats(ep: &str, name: &str) -> serde_json::Value {
    let all = sbx(ep, &["sandbox", "stats", name, "-o", "json"]).json();
    let one = all
        .as_array()
        .expect("a list")
        .first()
        .expect("one")
        .clone();
    assert_eq!(one["name"], name, "{one}");
    one["current"].clone()
}

/// Seconds since the epoch of an RFC 3339 UTC time with milliseconds, as the CLI prints it
/// (`2026-12-04T12:41:13.817Z`).
fn rfc3339_seconds(text: &str) -> f64 {
    let out = std::process::Command::new("date")
        .args(["-u", "-d", text, "+%s.%N"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().parse().unwrap()
}

fn within(what: &str, got: f64, want: f64, tolerance: f64) {
    assert!(
        (got - want).abs() <= want * tolerance,
        "{what}: stats read {got}, the cgroup {want} (more than {}% apart)",
        tolerance * 100.0
    );
}

#[test]
fn stats_read_what_the_sandboxs_cgroup_reads_and_move_with_its_disk() {
    let data = DataDir::new();
    let parent = CgroupParent(format!("sbx-gateway-tests-stats-{}", unique()));
    let d = Sbxd::start(
        data.path(),
        "",
        &[
            "--oci-cgroup-parent",
            &parent.0,
            "--default-cpu",
            "1",
            "--default-memory",
            "512Mi",
            "--default-disk",
            "256Mi",
            "--stats-interval",
            "1s",
            "--stats-history",
            "1m",
        ],
    );
    let ep = d.endpoint();

    // The workload: a shell that holds about 100 MiB in a variable, then spins for ever.
    let burn = "x=$(head -c 104857600 /dev/zero | tr '\\0' x); echo held; \
                while :; do :; done";
    let created = sbx(&ep, &["sandbox", "create", "burn", "--", "sh", "-c", burn]);
    assert_eq!(created.code, 0, "{created:?}");
    let id = sbx(&ep, &["sandbox", "get", "burn", "-o", "json"]).json()["id"]
        .as_str()
        .unwrap()
        .to_string();
    // Until the memory is held (the log says so) and the loop has run for a while.
    let began = Instant::now();
    loop {
        let logs = sbx(&ep, &["sandbox", "logs", "burn"]);
        if logs.stdout.contains("held") {
            break;
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the workload never held its memory: {logs:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));

    // CPU and memory: beside the cgroup's own files, read just before and just after.
    let (cpu0, mem0) = cgroup_figures(&parent.0, &id);
    let t0 = Instant::now();
    let now = stats(&ep, "burn");
    let (cpu1, mem1) = cgroup_figures(&parent.0, &id);
    let cgroup_cores = (cpu1 - cpu0) as f64 / t0.elapsed().as_nanos() as f64;
    eprintln!("stats: {now}\ncgroup: {cgroup_cores:.3} cores, memory {mem0}..{mem1}");
    assert_eq!(now["running"], true, "{now}");
    let total_ns = now["cpu_seconds_total"].as_f64().unwrap() * 1e9;
    assert!(
        total_ns >= cpu0 as f64 - 1e6 && total_ns <= cpu1 as f64 + 1e6,
        "the CPU counter {total_ns} is the cgroup's, read between {cpu0} and {cpu1}"
    );
    // (Cores used are compared with the cgroup's over the very same windows below, with
    // --watch: the loop's share of a core moves with whatever else the machine runs.)
    assert!(
        now["cpu_cores"].as_f64().unwrap() > 0.2,
        "the loop burns: {now}"
    );
    assert_eq!(now["cpu_limit_cores"], 1.0, "{now}");
    let memory = now["memory_bytes"].as_u64().unwrap() as f64;
    within("memory", memory, ((mem0 + mem1) / 2) as f64, 0.10);
    assert!(memory >= 95.0 * 1048576.0, "it holds 100 MiB: {now}");
    assert_eq!(now["memory_limit_bytes"], 512u64 << 20, "{now}");
    let pids_file = cgroup_dir(&parent.0, &id, "pids").join("pids.current");
    let pids = now["pids"].as_u64().unwrap();
    assert!(
        pids >= 1 && pids.abs_diff(read_u64(pids_file)) <= 2,
        "pids: {now}"
    );

    // The disk: 20 MiB written to /sandbox show in its used bytes, against its 256 MiB.
    let disk0 = now["disk_used_bytes"].as_u64().expect("a disk figure");
    assert!(
        now["disk_limit_bytes"].as_u64().unwrap() <= 256 << 20,
        "{now}"
    );
    let wrote = sbx(
        &ep,
        &[
            "sandbox",
            "exec",
            "burn",
            "--",
            "sh",
            "-c",
            "head -c 20971520 /dev/urandom > /sandbox/blob && sync",
        ],
    );
    assert_eq!(wrote.code, 0, "{wrote:?}");
    let disk1 = stats(&ep, "burn")["disk_used_bytes"].as_u64().unwrap();
    assert!(
        disk1 >= disk0 + (19 << 20),
        "20 MiB written: disk used {disk0} then {disk1}"
    );
    // No network asked: no network figures (not zeros).
    assert_eq!(now["network_rx_bytes"], serde_json::Value::Null, "{now}");

    // The table: the columns docker stats has, the figures in them.
    let table = sbx(&ep, &["sandbox", "stats", "burn"]).ok().to_string();
    eprintln!("$ sbx sandbox stats burn\n{table}");
    let lines: Vec<&str> = table.lines().collect();
    assert!(
        lines[0].starts_with("NAME") && lines[0].contains("MEM USAGE / LIMIT"),
        "{table}"
    );
    assert!(
        lines[1].starts_with("burn") && lines[1].contains("/ 512.0MiB"),
        "{table}"
    );

    // The history: one sample a second was kept; each in order, running, with a rate.
    std::thread::sleep(Duration::from_secs(3));
    let kept = sbx(
        &ep,
        &["sandbox", "stats", "burn", "--history", "1m", "-o", "json"],
    )
    .json();
    let history = kept["history"].as_array().expect("history").clone();
    assert!(history.len() >= 3, "{kept}");
    let times: Vec<&str> = history
        .iter()
        .map(|s| s["time"].as_str().unwrap())
        .collect();
    assert!(times.windows(2).all(|w| w[0] < w[1]), "{times:?}");
    let burning = history[1..]
        .iter()
        .filter(|s| s["cpu_cores"].as_f64().unwrap() > 0.2)
        .count();
    assert!(burning >= history.len() / 2, "the loop burns: {kept}");

    // --watch streams a line per interval per sandbox (-o json), until it is ended. Beside
    // it, the cgroup's own CPU counter is read every 20 ms, each read with its time: the
    // cores of each message are compared with the cgroup's over that message's own window
    // (from the previous message's read to its own).
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = {
        let (sampling, parent, id) = (sampling.clone(), parent.0.clone(), id.clone());
        std::thread::spawn(move || {
            let mut reads: Vec<(f64, f64)> = Vec::new();
            let began = Instant::now();
            while sampling.load(std::sync::atomic::Ordering::Relaxed)
                && began.elapsed() < Duration::from_secs(60)
            {
                let at = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64();
                reads.push((at, cgroup_figures(&parent, &id).0 as f64 / 1e9));
                std::thread::sleep(Duration::from_millis(20));
            }
            reads
        })
    };
    let mut watch = std::process::Command::new(common::SBX)
        .env("SBX_ENDPOINT", &ep)
        .args(["sandbox", "stats", "burn", "--watch"])
        .args(["--interval", "1", "-o", "json"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = watch.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        use std::io::BufRead;
        std::io::BufReader::new(stdout)
            .lines()
            .take(3)
            .map(Result::unwrap)
            .collect::<Vec<String>>()
    });
    let began = Instant::now();
    while !reader.is_finished() && began.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = watch.kill();
    let _ = watch.wait();
    let lines = reader.join().unwrap();
    // A few more cgroup reads after the last message's (so each message's time has a read
    // on both sides).
    std::thread::sleep(Duration::from_millis(200));
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let reads = sampler.join().unwrap();
    assert_eq!(lines.len(), 3, "{lines:?}");
    // The cgroup's counter at time `t`, between the two reads around it.
    let counter_at = |t: f64| -> f64 {
        let after = reads.iter().position(|r| r.0 >= t).expect("a read after");
        assert!(after > 0, "no read before {t}");
        let ((t0, c0), (t1, c1)) = (reads[after - 1], reads[after]);
        c0 + (c1 - c0) * (t - t0) / (t1 - t0)
    };
    let samples: Vec<(f64, f64, f64)> = lines
        .iter()
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            assert_eq!(v["name"], "burn");
            let time = v["current"]["time"].as_str().unwrap();
            let at = rfc3339_seconds(time);
            let cores = v["current"]["cpu_cores"].as_f64().unwrap();
            let total = v["current"]["cpu_seconds_total"].as_f64().unwrap();
            (at, cores, total)
        })
        .collect();
    for pair in samples.windows(2) {
        let ((t0, _, _), (t1, cores, total)) = (pair[0], pair[1]);
        let cgroup = (counter_at(t1) - counter_at(t0)) / (t1 - t0);
        eprintln!(
            "watch: {cores:.3} cores over {:.3}s, the cgroup {cgroup:.3}",
            t1 - t0
        );
        within("cores used", cores, cgroup, 0.10);
        assert!(
            (total - counter_at(t1)).abs() < 0.05,
            "CPU seconds {total} at {t1}, the cgroup's {}",
            counter_at(t1)
        );
    }

    // A stopped sandbox: no CPU, memory or pids, its limits still shown.
    sbx(&ep, &["sandbox", "stop", "burn"]).ok();
    let stopped = stats(&ep, "burn");
    assert_eq!(stopped["running"], false, "{stopped}");
    assert_eq!(
        (stopped["memory_bytes"].as_u64(), stopped["pids"].as_u64()),
        (Some(0), Some(0)),
        "{stopped}"
    );
    assert_eq!(stopped["memory_limit_bytes"], 512u64 << 20, "{stopped}");
    // An unknown sandbox is an error, not a row of zeros.
    let missing = sbx(&ep, &["sandbox", "stats", "no-such-sandbox"]);
    assert_ne!(missing.code, 0, "{missing:?}");
    assert!(missing.stderr.contains("no-such-sandbox"), "{missing:?}");
    sbx(&ep, &["sandbox", "delete", "burn"]).ok();
}
