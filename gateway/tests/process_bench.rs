//! Process-driver benchmarks through sbxd, ignored by default. Run as root, in release mode:
//!
//! ```text
//! cargo test --release -p sbx-gateway --test process_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! - create→Ready latency through sbxd (gRPC create, then the sandbox's watch until Ready) vs
//!   the bare cost of starting the same namespaced process with `unshare`, interleaved in one
//!   run, as a ratio;
//! - the time sbxd takes to re-attach SBX_BENCH_SANDBOXES (default 500) running sandboxes
//!   after a SIGKILL: from the new sbxd's spawn until it serves (it serves only once every
//!   sandbox has re-attached).

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd, all_workload_pids, eventually, proc_start_time};
use futures::StreamExt;
use sbx_proto::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, ListSandboxesRequest, Phase, SandboxRef,
    SandboxSpec, WatchSandboxesRequest,
};

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        ..Default::default()
    }
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Starts `sleep` in new pid/mount/uts/ipc/net namespaces in its own session, as the process
/// driver does, and waits until the namespaced process runs (`unshare` reports nothing, so the
/// wait is for the forked child to appear).
fn bare_unshare() -> Duration {
    let started = Instant::now();
    let mut child = Command::new("setsid")
        .args([
            "unshare",
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--mount-proc",
            "sh",
            "-c",
            "exec sleep infinity",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("setsid unshare");
    // `setsid` execs `unshare` (the child is not a group leader, so it does not fork);
    // `unshare --fork` forks the namespaced `sh`, which execs `sleep`.
    let parent = child.id();
    let (elapsed, workload) = loop {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        let sleeping = children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .find(|pid| {
                std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            });
        if let Some(pid) = sleeping {
            break (started.elapsed(), pid);
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "bare unshare did not start"
        );
        std::thread::sleep(Duration::from_micros(200));
    };
    // End what this function started, by pid: the namespaced sleep, then unshare.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(workload),
        nix::sys::signal::Signal::SIGKILL,
    );
    let _ = child.kill();
    let _ = child.wait();
    elapsed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn create_to_ready_through_sbxd_vs_bare_unshare() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &["--log-format", "json"]);
    let sb = d.sandboxes().await;
    let rounds = 30;
    let (mut through, mut bare) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        bare.push(bare_unshare());
        let mut watch = sb
            .clone()
            .watch_sandboxes(WatchSandboxesRequest {
                resource_version: 0,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let started = Instant::now();
        let created = sb
            .clone()
            .create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: String::new(),
                name: format!("b{i}"),
                spec: Some(spec()),
                stopped: false,
            })
            .await
            .unwrap()
            .into_inner();
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(30), watch.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let s = ev.sandbox.unwrap();
            if s.id == created.id && s.phase() == Phase::Ready {
                break;
            }
        }
        through.push(started.elapsed());
        sb.clone()
            .delete_sandbox(DeleteSandboxRequest {
                sandbox: Some(SandboxRef {
                    id: created.id,
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
    }
    let (t, b) = (p50(&mut through), p50(&mut bare));
    println!(
        "create→Ready through sbxd (process driver, {rounds} rounds): p50 {t:?}, p90 {:?}; bare setsid+unshare → running: p50 {b:?}, p90 {:?}; ratio (p50) {:.1}x",
        through[rounds * 9 / 10],
        bare[rounds * 9 / 10],
        t.as_secs_f64() / b.as_secs_f64()
    );
    assert!(all_workload_pids(data.path()).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn reattach_running_sandboxes_after_sigkill() {
    let n: usize = std::env::var("SBX_BENCH_SANDBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500);
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "process", &["--log-format", "json"]);
    let sb = d.sandboxes().await;
    let started = Instant::now();
    let names: Vec<String> = (0..n).map(|i| format!("r{i}")).collect();
    futures::stream::iter(names)
        .for_each_concurrent(8, |name| {
            let mut client = sb.clone();
            async move {
                client
                    .create_sandbox(CreateSandboxRequest {
                        providers: Default::default(),
                        workspace: String::new(),
                        name,
                        spec: Some(spec()),
                        stopped: false,
                    })
                    .await
                    .unwrap();
            }
        })
        .await;
    let ready = |sb: sbx_proto::v1::sandbox_service_client::SandboxServiceClient<
        tonic::transport::Channel,
    >| async move {
        let mut all = Vec::new();
        let mut token = String::new();
        loop {
            let page = sb
                .clone()
                .list_sandboxes(ListSandboxesRequest {
                    page_size: 1000,
                    page_token: token,
                    ..Default::default()
                })
                .await
                .unwrap()
                .into_inner();
            all.extend(page.sandboxes);
            if page.next_page_token.is_empty() {
                break all;
            }
            token = page.next_page_token;
        }
    };
    eventually(Duration::from_secs(600), "every sandbox Ready", || {
        let sb = sb.clone();
        async move {
            ready(sb)
                .await
                .iter()
                .all(|s| s.phase() == Phase::Ready)
                .then_some(())
        }
    })
    .await;
    println!(
        "created {n} process sandboxes, all Ready, in {:?}",
        started.elapsed()
    );
    let before: Vec<(i32, Option<u64>)> = all_workload_pids(data.path())
        .into_iter()
        .map(|p| (p, proc_start_time(p)))
        .collect();
    assert_eq!(before.len(), n);

    d.sigkill();
    drop(d);
    let restart = Instant::now();
    let d = Sbxd::start(data.path(), "process", &["--log-format", "json"]);
    let serving = restart.elapsed();
    let sb = d.sandboxes().await;
    let after = ready(sb.clone()).await;
    assert_eq!(after.len(), n);
    assert!(
        after
            .iter()
            .all(|s| s.phase() == Phase::Ready && s.generation == 1),
        "every sandbox Ready under its first generation"
    );
    for (pid, start) in &before {
        assert_eq!(
            proc_start_time(*pid),
            *start,
            "workload {pid} was restarted"
        );
    }
    println!(
        "sbxd re-attached {n} running sandboxes after SIGKILL: serving after {serving:?} (spawn → every sandbox re-attached → address file)"
    );

    let cleanup = Instant::now();
    futures::stream::iter(after)
        .for_each_concurrent(8, |s| {
            let mut client = sb.clone();
            async move {
                client
                    .delete_sandbox(DeleteSandboxRequest {
                        sandbox: Some(SandboxRef {
                            id: s.id,
                            ..Default::default()
                        }),
                    })
                    .await
                    .unwrap();
            }
        })
        .await;
    println!("deleted them in {:?}", cleanup.elapsed());
    assert!(all_workload_pids(data.path()).is_empty());
}
