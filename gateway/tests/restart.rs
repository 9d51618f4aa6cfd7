//! sbxd killed (SIGKILL) with operations in flight, and stopped (SIGTERM), with the process
//! driver: every acknowledged sandbox comes back in its phase with its generation, running
//! workloads are never restarted by a gateway restart, and SIGTERM is quick.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{DataDir, Sbxd, all_workload_pids, eventually, proc_start_time, workload_pids};
use futures::StreamExt;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteWorkspaceRequest, ExecRequest,
    GetSandboxRequest, Phase, RestartSandboxRequest, Sandbox, SandboxRef, SandboxSpec,
    StopSandboxRequest, WatchSandboxesRequest, WorkspaceRef, exec_output,
};
use tonic::transport::Channel;

const WS: &str = "crash";

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    }
}

fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.into(),
        ..Default::default()
    })
}

async fn create(
    sb: &mut SandboxServiceClient<Channel>,
    name: &str,
) -> Result<Sandbox, tonic::Status> {
    sb.create_sandbox(CreateSandboxRequest {
        providers: Default::default(),
        workspace: WS.into(),
        name: name.into(),
        spec: Some(spec()),
        stopped: false,
    })
    .await
    .map(|r| r.into_inner())
}

async fn get(sb: &SandboxServiceClient<Channel>, id: &str) -> Option<Sandbox> {
    sb.clone()
        .get_sandbox(GetSandboxRequest { sandbox: by_id(id) })
        .await
        .ok()
        .map(|r| r.into_inner())
}

/// Waits (at most 60 s) until sandbox `id` is in one of `phases`.
async fn settle(sb: &SandboxServiceClient<Channel>, id: &str, phases: &[Phase]) -> Sandbox {
    eventually(
        Duration::from_secs(60),
        &format!("{id} in {phases:?}"),
        || async { get(sb, id).await.filter(|s| phases.contains(&s.phase())) },
    )
    .await
}

async fn delete_workspace(d: &Sbxd) {
    let deleted = d
        .workspaces()
        .await
        .delete_workspace(DeleteWorkspaceRequest {
            workspace: Some(WorkspaceRef {
                id: String::new(),
                name: WS.into(),
            }),
            cascade: true,
        })
        .await
        .unwrap()
        .into_inner()
        .deleted;
    assert!(deleted);
}

async fn exec_echo(sb: &mut SandboxServiceClient<Channel>, id: &str) -> String {
    let mut stream = sb
        .exec(
            ExecRequest {
                sandbox: by_id(id),
                command: vec!["echo".into(), "alive".into()],
                ..Default::default()
            }
            .alone(),
        )
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    let mut exit = None;
    while let Some(msg) = tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("exec timed out")
    {
        match msg.unwrap().chunk {
            Some(exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(exec_output::Chunk::Exit(e)) => exit = Some(e.code),
            _ => {}
        }
    }
    assert_eq!(exit, Some(0));
    String::from_utf8(out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_with_operations_in_flight_loses_nothing_acknowledged() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "process", &[]);
    d.workspaces()
        .await
        .create_workspace(CreateWorkspaceRequest {
            name: WS.into(),
            labels: HashMap::new(),
        })
        .await
        .unwrap();
    let mut sb = d.sandboxes().await;
    let mut before = Vec::new();
    for i in 0..6 {
        let created = create(&mut sb, &format!("s{i}")).await.unwrap();
        before.push(settle(&sb, &created.id, &[Phase::Ready]).await);
    }
    for s in &mut before[4..] {
        *s = sb
            .stop_sandbox(StopSandboxRequest {
                sandbox: by_id(&s.id),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(s.phase(), Phase::Stopped);
    }
    // The workloads of the untouched running ones: (pid, start time).
    let running: HashMap<String, (i32, u64)> = before[2..4]
        .iter()
        .map(|s| {
            let pids = workload_pids(data.path(), &s.id);
            assert_eq!(pids.len(), 1, "{}", s.name);
            (s.id.clone(), (pids[0], proc_start_time(pids[0]).unwrap()))
        })
        .collect();

    // In flight when sbxd dies: a restart of s0, a stop of s1, six creates.
    let acked: Arc<Mutex<Vec<(String, Sandbox)>>> = Arc::default();
    let mut tasks = Vec::new();
    for (what, id) in [
        ("restart", before[0].id.clone()),
        ("stop", before[1].id.clone()),
    ] {
        let mut client = sb.clone();
        let acked = Arc::clone(&acked);
        tasks.push(tokio::spawn(async move {
            let answer = if what == "restart" {
                client
                    .restart_sandbox(RestartSandboxRequest {
                        sandbox: by_id(&id),
                    })
                    .await
            } else {
                client
                    .stop_sandbox(StopSandboxRequest {
                        sandbox: by_id(&id),
                    })
                    .await
            };
            if let Ok(s) = answer {
                acked
                    .lock()
                    .unwrap()
                    .push((what.to_string(), s.into_inner()));
            }
        }));
    }
    // Creates staggered over the kill, so some are answered and some are cut off.
    for i in 0..6u64 {
        let mut client = sb.clone();
        let acked = Arc::clone(&acked);
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 25)).await;
            if let Ok(s) = create(&mut client, &format!("late-{i}")).await {
                acked.lock().unwrap().push(("create".to_string(), s));
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(110)).await;
    d.sigkill();
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(30), t)
            .await
            .expect("an in-flight call hung after SIGKILL")
            .unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    eprintln!(
        "acknowledged before SIGKILL: {:?}",
        acked
            .iter()
            .map(|(w, s)| format!("{w} {}", s.name))
            .collect::<Vec<_>>()
    );

    let d = Sbxd::start(data.path(), "process", &[]);
    let sb = d.sandboxes().await;
    d.assert_healthy().await;
    // Untouched running sandboxes: Ready, same generation, the very same workload process.
    for s in &before[2..4] {
        let now = get(&sb, &s.id).await.expect("acknowledged sandbox lost");
        assert_eq!(now.phase(), Phase::Ready, "{now:?}");
        assert_eq!(now.generation, s.generation, "{now:?}");
        let (pid, start) = running[&s.id];
        assert_eq!(
            proc_start_time(pid),
            Some(start),
            "{} was restarted",
            s.name
        );
        assert_eq!(workload_pids(data.path(), &s.id), vec![pid]);
    }
    // Stopped ones stay stopped, same generation, no workload.
    for s in &before[4..] {
        let now = get(&sb, &s.id).await.expect("acknowledged sandbox lost");
        assert_eq!(now.phase(), Phase::Stopped, "{now:?}");
        assert_eq!(now.generation, s.generation);
        assert!(workload_pids(data.path(), &s.id).is_empty());
    }
    // What was acknowledged in flight holds; the rest settles (never stuck in Error).
    for (what, s) in &acked {
        let wanted: &[Phase] = if what == "stop" {
            &[Phase::Stopped]
        } else {
            &[Phase::Ready]
        };
        let now = settle(&sb, &s.id, wanted).await;
        assert!(now.generation >= s.generation, "{what}: {now:?}");
    }
    for s in &before[..2] {
        settle(&sb, &s.id, &[Phase::Ready, Phase::Stopped]).await;
    }
    let acked_restart = acked.iter().any(|(w, _)| w == "restart");
    if acked_restart {
        let s0 = get(&sb, &before[0].id).await.unwrap();
        assert!(s0.generation > before[0].generation, "{s0:?}");
    }

    delete_workspace(&d).await;
    for s in &before {
        assert!(
            workload_pids(data.path(), &s.id).is_empty(),
            "{} leaked",
            s.name
        );
    }
    for (_, s) in &acked {
        assert!(
            workload_pids(data.path(), &s.id).is_empty(),
            "{} leaked",
            s.name
        );
    }
    assert_eq!(
        all_workload_pids(data.path()),
        Vec::<i32>::new(),
        "leaked workloads"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_is_quick_and_leaves_every_sandbox_running() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "process", &[]);
    d.workspaces()
        .await
        .create_workspace(CreateWorkspaceRequest {
            name: WS.into(),
            labels: HashMap::new(),
        })
        .await
        .unwrap();
    let mut sb = d.sandboxes().await;
    let mut before = Vec::new();
    for i in 0..3 {
        let created = create(&mut sb, &format!("t{i}")).await.unwrap();
        before.push(settle(&sb, &created.id, &[Phase::Ready]).await);
    }
    let workloads: Vec<(i32, u64)> = before
        .iter()
        .map(|s| {
            let pids = workload_pids(data.path(), &s.id);
            assert_eq!(pids.len(), 1);
            (pids[0], proc_start_time(pids[0]).unwrap())
        })
        .collect();
    // A client following a watch must not hold shutdown up.
    let mut watch = sb
        .watch_sandboxes(WatchSandboxesRequest {
            workspace: WS.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    for _ in 0..3 {
        watch.next().await.unwrap().unwrap();
    }

    let (took, status) = d.sigterm(Duration::from_secs(10));
    eprintln!("sbxd exited {took:?} after SIGTERM");
    assert!(status.success(), "{status:?}\n{}", d.log_text());
    assert!(took < Duration::from_secs(5), "SIGTERM took {took:?}");
    let end = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .expect("the watch did not end");
    match &end {
        Some(Err(status)) => common::assert_status(status, tonic::Code::Unavailable, "UNAVAILABLE"),
        other => panic!("the watch ended with {other:?}, not UNAVAILABLE"),
    }
    assert!(
        !data.path().join("addr").exists(),
        "the address file is removed"
    );
    for (s, (pid, start)) in before.iter().zip(&workloads) {
        assert_eq!(
            proc_start_time(*pid),
            Some(*start),
            "{} stopped with sbxd",
            s.name
        );
    }

    let d = Sbxd::start(data.path(), "process", &[]);
    let mut sb = d.sandboxes().await;
    for (s, (pid, start)) in before.iter().zip(&workloads) {
        let now = get(&sb, &s.id).await.unwrap();
        assert_eq!(now.phase(), Phase::Ready, "{now:?}");
        assert_eq!(now.generation, s.generation);
        assert_eq!(exec_echo(&mut sb, &s.id).await, "alive\n");
        assert_eq!(
            proc_start_time(*pid),
            Some(*start),
            "{} was restarted",
            s.name
        );
    }
    delete_workspace(&d).await;
    for (pid, start) in &workloads {
        assert_ne!(proc_start_time(*pid), Some(*start), "workload {pid} leaked");
    }
    assert_eq!(
        all_workload_pids(data.path()),
        Vec::<i32>::new(),
        "leaked workloads"
    );
}
