//! `sbxd serve --driver remote:SOCKET` against an `sbxd driver` the test runs, black box, as
//! root: the lifecycle works through the socket; with the driver killed, calls answer quickly
//! (UNAVAILABLE, or the sandbox shows DriverUnavailable), nothing is deleted and sbxd stays
//! healthy; with the driver started again, every sandbox recovers to Ready.

mod common;
mod remote_support;

use std::time::{Duration, Instant};

use common::{DataDir, Sbxd, all_workload_pids, eventually, proc_start_time, workload_pids};
use remote_support::{DriverHost, away_phase, by_id, create_sleeper, get, settle, sh};
use sbx_proto::v1::{
    DeleteSandboxRequest, ListSandboxesRequest, Phase, StartSandboxRequest, StopSandboxRequest,
};

const SETTLE: Duration = Duration::from_secs(60);
/// How fast a call must answer while the driver is away (the call deadline is 5 s).
const QUICK: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_driver_lifecycle_outage_and_recovery() {
    let data = DataDir::new();
    let socket = data.path().join("process-driver.sock");
    let mut host = DriverHost::start(data.path(), &socket);
    let driver = format!("remote:{}", socket.display());
    let mut d = Sbxd::start(data.path(), &driver, &["--driver-call-timeout", "5"]);
    let sb = d.sandboxes().await;

    // Lifecycle through the socket; the sandbox is recorded under the driver name "process".
    let a = create_sleeper(&sb, "remote-a").await;
    let ready = settle(&sb, &a, Phase::Ready, SETTLE).await;
    assert_eq!(ready.spec.as_ref().unwrap().driver, "process");
    assert_eq!(
        sh(&sb, &a, "echo hi").await.unwrap(),
        (0, "hi\n".to_string())
    );
    let stopped = sb
        .clone()
        .stop_sandbox(StopSandboxRequest { sandbox: by_id(&a) })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.phase(), Phase::Stopped);
    assert!(workload_pids(data.path(), &a).is_empty());
    sb.clone()
        .start_sandbox(StartSandboxRequest { sandbox: by_id(&a) })
        .await
        .unwrap();
    let ready = settle(&sb, &a, Phase::Ready, SETTLE).await;
    let pids = workload_pids(data.path(), &a);
    assert_eq!(pids.len(), 1);
    let (pid, start) = (pids[0], proc_start_time(pids[0]).unwrap());

    // The driver goes away: the workload keeps running, calls answer quickly.
    host.sigkill();
    assert_eq!(proc_start_time(pid), Some(start));
    let began = Instant::now();
    let exec = sh(&sb, &a, "echo hi").await;
    let took = began.elapsed();
    let status = exec.expect_err("exec with the driver away");
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(took < QUICK, "exec answered after {took:?}");
    eprintln!("exec answered {:?} in {took:?}", status.code());

    // A sandbox created meanwhile is recorded, and settles in Error/DriverUnavailable.
    let b = create_sleeper(&sb, "remote-b").await;
    let away = eventually(SETTLE, "b DriverUnavailable", || async {
        let s = get(&sb, &b).await;
        (s.phase() == Phase::Error).then_some(s)
    })
    .await;
    assert_eq!(away.reason, "DriverUnavailable", "{away:?}");
    let shown = get(&sb, &a).await;
    assert!(away_phase(&shown), "{shown:?}");
    let listed = sb
        .clone()
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let mut listed_ids: Vec<_> = listed.sandboxes.iter().map(|s| s.id.clone()).collect();
    listed_ids.sort();
    let mut want = vec![a.clone(), b.clone()];
    want.sort();
    assert_eq!(
        listed_ids, want,
        "nothing is deleted while the driver is away"
    );
    d.assert_healthy().await;

    // The driver comes back: both recover (reconciler every 2 s); a keeps its workload.
    let _host = DriverHost::start(data.path(), &socket);
    let began = Instant::now();
    let a_after = settle(&sb, &a, Phase::Ready, SETTLE).await;
    assert_eq!(a_after.generation, ready.generation);
    settle(&sb, &b, Phase::Ready, SETTLE).await;
    eprintln!("recovered in {:?}", began.elapsed());
    assert_eq!(workload_pids(data.path(), &a), vec![pid]);
    assert_eq!(proc_start_time(pid), Some(start));
    assert_eq!(workload_pids(data.path(), &b).len(), 1);
    let exec = eventually(Duration::from_secs(30), "exec after recovery", || async {
        sh(&sb, &b, "echo back").await.ok()
    })
    .await;
    assert_eq!(exec, (0, "back\n".to_string()));

    for id in [&a, &b] {
        let deleted = sb
            .clone()
            .delete_sandbox(DeleteSandboxRequest { sandbox: by_id(id) })
            .await
            .unwrap()
            .into_inner();
        assert!(deleted.deleted);
    }
    assert_eq!(all_workload_pids(data.path()), Vec::<i32>::new(), "leaks");
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success(), "{}", d.log_text());
}

/// One data dir served in turn by `--driver process`, `--driver remote:SOCKET` and
/// `--driver managed:process`: the sandbox (recorded under the driver name "process") is
/// re-attached every time with the same generation and workload.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_move_between_in_process_remote_and_managed() {
    let data = DataDir::new();
    let _managed_guard = remote_support::ManagedDriverGuard(data.path().to_path_buf());
    let mut d = Sbxd::start(data.path(), "process", &[]);
    let sb = d.sandboxes().await;
    let id = create_sleeper(&sb, "mover").await;
    let ready = settle(&sb, &id, Phase::Ready, SETTLE).await;
    let pids = workload_pids(data.path(), &id);
    assert_eq!(pids.len(), 1);
    let (pid, start) = (pids[0], proc_start_time(pids[0]).unwrap());
    drop(sb);
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success());

    let socket = data.path().join("mover.sock");
    let mut host = DriverHost::start(data.path(), &socket);
    let driver = format!("remote:{}", socket.display());
    let mut d = Sbxd::start(data.path(), &driver, &[]);
    let sb = d.sandboxes().await;
    let s = get(&sb, &id).await;
    assert_eq!(
        (s.phase(), s.generation),
        (Phase::Ready, ready.generation),
        "{s:?}"
    );
    assert_eq!(
        sh(&sb, &id, "echo r").await.unwrap(),
        (0, "r\n".to_string())
    );
    drop(sb);
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success());
    let status = host.sigterm(Duration::from_secs(30));
    assert!(status.success(), "{}", host.log_text());

    let mut d = Sbxd::start(data.path(), "managed:process", &[]);
    let sb = d.sandboxes().await;
    let s = get(&sb, &id).await;
    assert_eq!(
        (s.phase(), s.generation),
        (Phase::Ready, ready.generation),
        "{s:?}"
    );
    assert_eq!(workload_pids(data.path(), &id), vec![pid]);
    assert_eq!(proc_start_time(pid), Some(start), "never restarted");
    let deleted = sb
        .clone()
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.deleted);
    assert_eq!(all_workload_pids(data.path()), Vec::<i32>::new(), "leaks");
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success());
}
