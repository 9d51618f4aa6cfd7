//! Managed mode (`sbxd serve --driver managed:process`), black box, as root: sbxd runs
//! `sbxd driver` as a supervised child. Killing the driver process leaves workloads running
//! and sbxd restarts it; killing sbxd orphans the driver, and the next sbxd kills that stale
//! driver (by its recorded pid and start time) and takes over every sandbox unchanged.

mod common;
mod remote_support;

use std::time::{Duration, Instant};

use common::{DataDir, Sbxd, all_workload_pids, eventually, proc_start_time, workload_pids};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use remote_support::{
    ManagedDriverGuard, by_id, create_sleeper, get, managed_driver, runs, settle, sh,
};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{DeleteSandboxRequest, Phase, StartSandboxRequest, StopSandboxRequest};
use tonic::transport::Channel;

const MANAGED: &str = "managed:process";
const SETTLE: Duration = Duration::from_secs(60);

/// Deletes every sandbox and asserts that no workload is left.
async fn delete_all(sb: &SandboxServiceClient<Channel>, data: &DataDir, ids: &[String]) {
    for id in ids {
        let deleted = sb
            .clone()
            .delete_sandbox(DeleteSandboxRequest { sandbox: by_id(id) })
            .await
            .unwrap()
            .into_inner();
        assert!(deleted.deleted, "{id}");
    }
    assert_eq!(all_workload_pids(data.path()), Vec::<i32>::new(), "leaks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_driver_is_restarted_and_workloads_keep_running() {
    let data = DataDir::new();
    let _driver_guard = ManagedDriverGuard(data.path().to_path_buf());
    let mut d = Sbxd::start(data.path(), MANAGED, &[]);
    let sb = d.sandboxes().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(create_sleeper(&sb, &format!("managed{i}")).await);
    }
    let mut before = Vec::new();
    for id in &ids {
        let ready = settle(&sb, id, Phase::Ready, SETTLE).await;
        let pids = workload_pids(data.path(), id);
        assert_eq!(pids.len(), 1, "{id}: one workload");
        before.push((ready.generation, pids[0], proc_start_time(pids[0]).unwrap()));
    }
    let (driver_pid, driver_start) = managed_driver(data.path()).expect("driver pid file");
    assert!(runs(driver_pid, driver_start), "the recorded driver runs");
    assert_ne!(driver_pid, d.pid(), "the driver is a separate process");

    // SIGKILL the driver process: its workloads keep running, untouched.
    kill(Pid::from_raw(driver_pid), Signal::SIGKILL).unwrap();
    for (id, (_, pid, start)) in ids.iter().zip(&before) {
        assert_eq!(proc_start_time(*pid), Some(*start), "{id}'s workload lives");
    }

    // sbxd starts a new driver process (first backoff 100 ms) and records it.
    let began = Instant::now();
    let (new_pid, new_start) = eventually(Duration::from_secs(20), "a new driver", || async {
        managed_driver(data.path()).filter(|(p, s)| *p != driver_pid && runs(*p, *s))
    })
    .await;
    eprintln!("driver restarted as {new_pid} within {:?}", began.elapsed());
    assert!(!runs(driver_pid, driver_start), "the killed driver is gone");
    d.assert_healthy().await;

    // exec, stop and start go through the new driver.
    let exec = eventually(Duration::from_secs(30), "exec after restart", || async {
        sh(&sb, &ids[1], "echo again").await.ok()
    })
    .await;
    assert_eq!(exec, (0, "again\n".to_string()));
    let stopped = sb
        .clone()
        .stop_sandbox(StopSandboxRequest {
            sandbox: by_id(&ids[0]),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.phase(), Phase::Stopped);
    assert!(workload_pids(data.path(), &ids[0]).is_empty());
    sb.clone()
        .start_sandbox(StartSandboxRequest {
            sandbox: by_id(&ids[0]),
        })
        .await
        .unwrap();
    let restarted = settle(&sb, &ids[0], Phase::Ready, SETTLE).await;
    assert!(restarted.generation > before[0].0);

    // Every sandbox ends Ready; the ones not restarted keep generation and workload.
    for (id, (generation, pid, start)) in ids.iter().zip(&before).skip(1) {
        let s = settle(&sb, id, Phase::Ready, SETTLE).await;
        assert_eq!(s.generation, *generation, "{id}");
        assert_eq!(workload_pids(data.path(), id), vec![*pid], "{id}");
        assert_eq!(proc_start_time(*pid), Some(*start), "{id}");
    }

    delete_all(&sb, &data, &ids).await;
    // SIGTERM of sbxd stops its driver process too.
    let (took, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success(), "{status}: {}", d.log_text());
    eprintln!("sbxd and its driver stopped in {took:?}");
    assert!(
        !runs(new_pid, new_start),
        "the driver process outlived sbxd"
    );
    let log = d.log_text();
    assert!(
        log.contains("driver process exited; restarting it"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_sbxd_kills_the_stale_driver_and_takes_over() {
    let data = DataDir::new();
    let _driver_guard = ManagedDriverGuard(data.path().to_path_buf());
    let mut d = Sbxd::start(data.path(), MANAGED, &[]);
    let sb = d.sandboxes().await;
    let mut ids = Vec::new();
    for i in 0..2 {
        ids.push(create_sleeper(&sb, &format!("stale{i}")).await);
    }
    let mut before = Vec::new();
    for id in &ids {
        let ready = settle(&sb, id, Phase::Ready, SETTLE).await;
        let pids = workload_pids(data.path(), id);
        assert_eq!(pids.len(), 1, "{id}: one workload");
        before.push((ready.generation, pids[0], proc_start_time(pids[0]).unwrap()));
    }
    let (stale_pid, stale_start) = managed_driver(data.path()).expect("driver pid file");

    // SIGKILL sbxd: its driver is orphaned and still runs (it holds the state dir's lock).
    d.sigkill();
    drop(sb);
    drop(d);
    std::thread::sleep(Duration::from_millis(300));
    assert!(runs(stale_pid, stale_start), "the orphaned driver runs on");

    // The next sbxd kills the stale driver, starts its own, and takes every sandbox over.
    let began = Instant::now();
    let d = Sbxd::start(data.path(), MANAGED, &[]);
    eprintln!("second sbxd serving after {:?}", began.elapsed());
    assert!(
        !runs(stale_pid, stale_start),
        "the stale driver was stopped"
    );
    let (new_pid, new_start) = managed_driver(data.path()).expect("new pid file");
    assert_ne!(new_pid, stale_pid);
    assert!(runs(new_pid, new_start));
    let sb = d.sandboxes().await;
    for (id, (generation, pid, start)) in ids.iter().zip(&before) {
        let s = get(&sb, id).await;
        assert_eq!(
            (s.phase(), s.generation),
            (Phase::Ready, *generation),
            "{s:?}"
        );
        assert_eq!(workload_pids(data.path(), id), vec![*pid], "{id}");
        assert_eq!(proc_start_time(*pid), Some(*start), "{id}: not restarted");
    }
    assert_eq!(
        sh(&sb, &ids[0], "echo took-over").await.unwrap(),
        (0, "took-over\n".to_string())
    );
    d.assert_healthy().await;
    let log = d.log_text();
    assert!(
        log.contains("a driver process from a previous sbxd still runs"),
        "{log}"
    );

    delete_all(&sb, &data, &ids).await;
    let mut d = d;
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success());
    assert!(!runs(new_pid, new_start), "the driver outlived sbxd");
}

/// After a SIGKILL of sbxd in managed mode, an sbxd with the driver in process
/// (`--driver process`) also stops the orphaned driver (which holds the state dir's lock) and
/// re-attaches the sandbox unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_process_sbxd_after_a_killed_managed_one_takes_over() {
    let data = DataDir::new();
    let _driver_guard = ManagedDriverGuard(data.path().to_path_buf());
    let mut d = Sbxd::start(data.path(), MANAGED, &[]);
    let sb = d.sandboxes().await;
    let id = create_sleeper(&sb, "switch").await;
    let ready = settle(&sb, &id, Phase::Ready, SETTLE).await;
    let pid = workload_pids(data.path(), &id)[0];
    let start = proc_start_time(pid).unwrap();
    let (stale_pid, stale_start) = managed_driver(data.path()).expect("driver pid file");
    d.sigkill();
    drop(sb);
    drop(d);
    assert!(runs(stale_pid, stale_start), "the orphaned driver runs on");

    let mut d = Sbxd::start(data.path(), "process", &[]);
    assert!(
        !runs(stale_pid, stale_start),
        "the stale driver was stopped"
    );
    let sb = d.sandboxes().await;
    let s = get(&sb, &id).await;
    assert_eq!(
        (s.phase(), s.generation),
        (Phase::Ready, ready.generation),
        "{s:?}"
    );
    assert_eq!(workload_pids(data.path(), &id), vec![pid]);
    assert_eq!(proc_start_time(pid), Some(start));
    delete_all(&sb, &data, std::slice::from_ref(&id)).await;
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success());
}
