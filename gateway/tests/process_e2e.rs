//! End to end through sbxd with the process driver: a sandbox running `sleep` keeps its
//! workload and its `/sandbox` files across a SIGKILL of sbxd, keeps its files across stop and
//! start, and leaves nothing behind when deleted — no directory, no cgroup, no process.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::{
    DataDir, Sbxd, TEST_CGROUP_PARENT, all_workload_pids, eventually, proc_start_time,
    workload_pids,
};
use futures::StreamExt;
use sbx_drivers::process::ProcessDriver;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, ExecRequest, GetSandboxRequest, Phase, Sandbox,
    SandboxRef, SandboxSpec, StartSandboxRequest, StopSandboxRequest, exec_output,
};
use tonic::transport::Channel;

fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.into(),
        ..Default::default()
    })
}

async fn get(sb: &SandboxServiceClient<Channel>, id: &str) -> Sandbox {
    sb.clone()
        .get_sandbox(GetSandboxRequest { sandbox: by_id(id) })
        .await
        .unwrap()
        .into_inner()
}

async fn settle(sb: &SandboxServiceClient<Channel>, id: &str, phase: Phase) -> Sandbox {
    eventually(
        Duration::from_secs(60),
        &format!("{id} {phase:?}"),
        || async {
            let s = get(sb, id).await;
            (s.phase() == phase).then_some(s)
        },
    )
    .await
}

/// Runs `sh -c SCRIPT` in the sandbox; answers (exit code, stdout).
async fn sh(sb: &SandboxServiceClient<Channel>, id: &str, script: &str) -> (i32, String) {
    let mut stream = sb
        .clone()
        .exec(
            ExecRequest {
                sandbox: by_id(id),
                command: vec!["sh".into(), "-c".into(), script.into()],
                timeout_seconds: 30,
                ..Default::default()
            }
            .alone(),
        )
        .await
        .unwrap()
        .into_inner();
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(msg) = tokio::time::timeout(Duration::from_secs(40), stream.next())
        .await
        .expect("exec answered")
    {
        match msg.unwrap().chunk {
            Some(exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(exec_output::Chunk::Exit(e)) => code = Some(e.code),
            _ => {}
        }
    }
    (code.expect("an exit"), String::from_utf8(out).unwrap())
}

/// The cgroup directories of sandbox `id` under the tests' cgroup parent, in every hierarchy.
fn cgroup_dirs(id: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for parent in ProcessDriver::cgroup_parent_dirs_for(TEST_CGROUP_PARENT) {
        if let Ok(entries) = std::fs::read_dir(&parent) {
            found.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_name().to_string_lossy().contains(id))
                    .map(|e| e.path()),
            );
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_and_workload_survive_sigkill_stop_and_start_and_delete_leaves_nothing() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "process", &[]);
    let sb = d.sandboxes().await;
    let created = sb
        .clone()
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: format!("keeper-{}", common::unique()),
            spec: Some(SandboxSpec {
                command: vec!["sleep".into(), "infinity".into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .unwrap()
        .into_inner();
    let id = created.id.clone();
    let ready = settle(&sb, &id, Phase::Ready).await;
    assert_eq!(
        sh(&sb, &id, "echo kept > /sandbox/note && cat /sandbox/note").await,
        (0, "kept\n".into())
    );
    let pids = workload_pids(data.path(), &id);
    assert_eq!(pids.len(), 1, "one workload");
    let (pid, started) = (pids[0], proc_start_time(pids[0]).unwrap());
    assert!(!cgroup_dirs(&id).is_empty(), "the sandbox has a cgroup");

    // SIGKILL sbxd and start it again on the same data dir.
    d.sigkill();
    drop(d);
    let d = Sbxd::start(data.path(), "process", &[]);
    let sb = d.sandboxes().await;
    let after = get(&sb, &id).await;
    assert_eq!(
        (after.phase(), after.generation),
        (Phase::Ready, ready.generation),
        "{after:?}"
    );
    assert_eq!(
        proc_start_time(pid),
        Some(started),
        "the workload was not restarted"
    );
    assert_eq!(workload_pids(data.path(), &id), vec![pid]);
    assert_eq!(
        sh(&sb, &id, "cat /sandbox/note").await,
        (0, "kept\n".into())
    );

    // Stop and start: the files stay, the workload is a new one under a new generation.
    let stopped = sb
        .clone()
        .stop_sandbox(StopSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.phase(), Phase::Stopped);
    assert!(
        workload_pids(data.path(), &id).is_empty(),
        "nothing runs after stop"
    );
    sb.clone()
        .start_sandbox(StartSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap();
    let restarted = settle(&sb, &id, Phase::Ready).await;
    assert!(restarted.generation > ready.generation);
    assert_eq!(
        sh(&sb, &id, "cat /sandbox/note").await,
        (0, "kept\n".into())
    );
    let sandbox_dir = data.path().join("drivers/process/sandboxes").join(&id);
    assert!(
        sandbox_dir.join("root/note").exists(),
        "the persistent directory is on the host"
    );

    // Delete: directory, cgroup and processes are gone.
    let deleted = sb
        .clone()
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(deleted.deleted);
    assert!(!sandbox_dir.exists(), "{} is left", sandbox_dir.display());
    assert_eq!(cgroup_dirs(&id), Vec::<PathBuf>::new(), "cgroups left");
    assert!(workload_pids(data.path(), &id).is_empty());
    assert_eq!(
        proc_start_time(pid),
        None,
        "the first workload process is gone"
    );
    assert_eq!(all_workload_pids(data.path()), Vec::<i32>::new());
    let trash = data.path().join("drivers/process");
    let leftovers: Vec<_> = walk(&trash)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(&id))
        .collect();
    assert!(
        leftovers.is_empty(),
        "files of the deleted sandbox remain: {leftovers:?}"
    );
}

fn walk(dir: &std::path::Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            }
            out.push(p);
        }
    }
    out
}
