//! Process driver measurements (needs root). Ignored by default; run with
//!
//! ```text
//! cargo test -p sbx-drivers --test process_bench -- --ignored --nocapture --test-threads=1
//! ```
//!
//! - create→Ready: the driver's `create` until it answers RUNNING, against starting the same
//!   namespaced process with `unshare` directly (until it says it runs), interleaved in one run
//!   so the machine's load hits both alike; the ratio is the figure to watch.
//! - re-discovery: 100 running sandboxes, the driver dropped; a new `open` + `list` until all
//!   100 show RUNNING.

mod process_support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use process_support::*;
use sbx_driver_api::{ComputeDriver, pb};
use uuid::Uuid;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// What the shell inside a bare `unshare` does before it says it runs: nothing, or the same
/// setup as the driver's shim (hostname, `lo` up, a fresh /proc, the bind at /sandbox).
const NO_SETUP: &str = "";
const SHIM_SETUP: &str = "echo bench > /proc/sys/kernel/hostname; ip link set dev lo up; \
                          mount -t proc proc /proc; mount --bind /tmp /sandbox; ";

/// Starts `sleep` in new pid/mount/uts/ipc/net namespaces with `unshare` and waits until the
/// process inside says it runs (a line on a pipe); then kills it. Returns the start time.
fn bare_unshare_start(setup: &'static str) -> Duration {
    let script = format!("{setup}echo ready; exec sleep 3600");
    let began = Instant::now();
    let mut child = Command::new("setsid")
        .args([
            "unshare",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--uts",
            "--ipc",
            "--net",
        ])
        .args(["--", "/bin/sh", "-c", &script])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let took = began.elapsed();
    assert_eq!(line, "ready\n");
    child.kill().unwrap();
    child.wait().unwrap();
    took
}

#[tokio::test]
#[ignore = "a measurement; run explicitly"]
async fn bench_create_to_ready_vs_bare_unshare() {
    const ROUNDS: usize = 30;
    let env = TestEnv::new();
    let driver = env.open();
    let mut bare = Vec::new();
    let mut bare_setup = Vec::new();
    let mut driven = Vec::new();
    // One warm-up of each, not counted (the driver's also makes /sandbox on the host).
    bare_unshare_start(NO_SETUP);
    let warm = Uuid::new_v4();
    driver
        .create(create_req(warm, "warm", spec(&["sleep", "3600"]), 1))
        .await
        .unwrap();
    for i in 0..ROUNDS {
        bare.push(
            tokio::task::spawn_blocking(|| bare_unshare_start(NO_SETUP))
                .await
                .unwrap(),
        );
        bare_setup.push(
            tokio::task::spawn_blocking(|| bare_unshare_start(SHIM_SETUP))
                .await
                .unwrap(),
        );
        let id = Uuid::new_v4();
        let began = Instant::now();
        let snapshot = driver
            .create(create_req(
                id,
                &format!("b-{i}"),
                spec(&["sleep", "3600"]),
                1,
            ))
            .await
            .unwrap();
        driven.push(began.elapsed());
        assert_eq!(snapshot.state, pb::State::Running as i32);
    }
    bare.sort();
    bare_setup.sort();
    driven.sort();
    let (b50, d50) = (percentile(&bare, 0.5), percentile(&driven, 0.5));
    println!("create->Ready, {ROUNDS} rounds, interleaved:");
    println!("| path | p50 ms | p90 ms | max ms |");
    println!("|---|---|---|---|");
    for (name, v) in [
        (
            "bare `setsid unshare` (pid,mnt,uts,ipc,net) → running",
            &bare,
        ),
        (
            "bare `setsid unshare` + the shim's setup commands → running",
            &bare_setup,
        ),
        ("process driver create → RUNNING", &driven),
    ] {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} |",
            ms(percentile(v, 0.5)),
            ms(percentile(v, 0.9)),
            ms(*v.last().unwrap())
        );
    }
    println!("ratio driver/bare (p50): {:.2}", ms(d50) / ms(b50));
    println!(
        "ratio driver/bare+setup (p50): {:.2}",
        ms(d50) / ms(percentile(&bare_setup, 0.5))
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
#[ignore = "a measurement; run explicitly"]
async fn bench_rediscover_100_running_sandboxes() {
    const SANDBOXES: usize = 100;
    const REOPENS: usize = 5;
    let env = TestEnv::new();
    let driver = env.open();
    let began = Instant::now();
    for i in 0..SANDBOXES {
        driver
            .create(create_req(
                Uuid::new_v4(),
                &format!("r-{i}"),
                spec(&["sleep", "3600"]),
                1,
            ))
            .await
            .unwrap();
    }
    let created_in = began.elapsed();
    drop(driver);
    let mut rediscovery = Vec::new();
    for _ in 0..REOPENS {
        let began = Instant::now();
        let driver = env.open();
        let listed = driver.list().await.unwrap();
        let took = began.elapsed();
        let running = listed
            .iter()
            .filter(|s| s.state == pb::State::Running as i32)
            .count();
        assert_eq!(running, SANDBOXES, "{listed:?}");
        rediscovery.push(took);
        drop(driver);
    }
    rediscovery.sort();
    let driver = env.open();
    let began = Instant::now();
    for snapshot in driver.list().await.unwrap() {
        let req = pb::DeleteRequest {
            sandbox_id: snapshot.sandbox_id,
        };
        assert!(driver.delete(req).await.unwrap().deleted);
    }
    let deleted_in = began.elapsed();
    println!(
        "{SANDBOXES} sandboxes: created one after another in {:.0} ms",
        ms(created_in)
    );
    println!(
        "re-discovery (open + list, all RUNNING), {REOPENS} reopens: p50 {:.1} ms, max {:.1} ms",
        ms(percentile(&rediscovery, 0.5)),
        ms(*rediscovery.last().unwrap())
    );
    println!("deleted one after another in {:.0} ms", ms(deleted_in));
    drop(driver);
    env.finish().await;
}
