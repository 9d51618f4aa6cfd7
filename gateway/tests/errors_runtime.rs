//! Error reasons that need the driver or a restart: DRIVER_*, WORKSPACE_TERMINATING,
//! RESOURCE_VERSION_TOO_OLD (sim driver, with injected latency and failures).

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{DataDir, Sbxd, assert_status, eventually};
use futures::StreamExt;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteWorkspaceRequest, ExecRequest,
    GetSandboxRequest, Phase, SandboxRef, SandboxSpec, WatchSandboxesRequest, WorkspaceRef,
};
use tonic::Code;

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn driver_errors_and_terminating_workspaces() {
    let data = DataDir::new();
    // Every driver call takes 700 ms, and exec always fails.
    let d = Sbxd::start(
        data.path(),
        "sim",
        &["--sim-latency-ms", "700", "--sim-fail", "exec"],
    );
    let mut ws = d.workspaces().await;
    let mut sb = d.sandboxes().await;
    ws.create_workspace(CreateWorkspaceRequest {
        name: "doomed".into(),
        labels: HashMap::new(),
    })
    .await
    .unwrap();
    let first = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: "doomed".into(),
            name: "first".into(),
            spec: Some(spec()),
            stopped: false,
        })
        .await
        .unwrap()
        .into_inner();
    let id = first.id.clone();
    let mut probe = sb.clone();
    eventually(Duration::from_secs(30), "first Ready", || {
        let mut probe = probe.clone();
        let id = id.clone();
        async move {
            let s = probe
                .get_sandbox(GetSandboxRequest {
                    sandbox: by_id(&id),
                })
                .await
                .ok()?
                .into_inner();
            (s.phase() == Phase::Ready).then_some(())
        }
    })
    .await;

    // DRIVER_UNAVAILABLE: the driver refuses exec.
    let err = match probe
        .exec(
            ExecRequest {
                sandbox: by_id(&first.id),
                command: vec!["echo".into(), "hi".into()],
                ..Default::default()
            }
            .alone(),
        )
        .await
    {
        Err(status) => status,
        Ok(stream) => {
            let mut stream = stream.into_inner();
            stream
                .next()
                .await
                .expect("a message")
                .expect_err("exec must fail")
        }
    };
    assert_status(&err, Code::Unavailable, "DRIVER_UNAVAILABLE");
    d.assert_healthy().await;

    // WORKSPACE_TERMINATING: while a cascade delete is stopping "first" (700 ms per driver
    // call), a create in the workspace is refused.
    let mut deleter = ws.clone();
    let delete = tokio::spawn(async move {
        deleter
            .delete_workspace(DeleteWorkspaceRequest {
                workspace: Some(WorkspaceRef {
                    id: String::new(),
                    name: "doomed".into(),
                }),
                cascade: true,
            })
            .await
    });
    let err = eventually(Duration::from_secs(10), "a refused create", || {
        let mut sb = sb.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            match sb
                .create_sandbox(CreateSandboxRequest {
                    providers: Default::default(),
                    workspace: "doomed".into(),
                    name: format!("late-{}", common::unique()),
                    spec: Some(spec()),
                    stopped: false,
                })
                .await
            {
                Err(status) if status.code() == Code::FailedPrecondition => Some(status),
                _ => None,
            }
        }
    })
    .await;
    assert_status(&err, Code::FailedPrecondition, "WORKSPACE_TERMINATING");
    assert!(err.message().contains("doomed"));
    let deleted = tokio::time::timeout(Duration::from_secs(60), delete)
        .await
        .expect("cascade delete timed out")
        .unwrap()
        .unwrap()
        .into_inner()
        .deleted;
    assert!(deleted);
    let err = sb
        .get_sandbox(GetSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::NotFound, "SANDBOX_NOT_FOUND");
    d.assert_healthy().await;
}

/// RESOURCE_VERSION_TOO_OLD: after a restart the event history starts afresh, so resuming a
/// watch from before it is refused. Also: with the sim driver the records survive a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_before_a_restart_is_out_of_range() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    let created = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "kept".into(),
            spec: Some(spec()),
            stopped: false,
        })
        .await
        .unwrap()
        .into_inner();
    let (took, status) = d.sigterm(Duration::from_secs(10));
    assert!(status.success(), "{status:?} after {took:?}");
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    let again = sb
        .get_sandbox(GetSandboxRequest {
            sandbox: by_id(&created.id),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.name, "kept");
    let err = match sb
        .watch_sandboxes(WatchSandboxesRequest {
            resource_version: 1,
            ..Default::default()
        })
        .await
    {
        Err(status) => status,
        Ok(stream) => stream
            .into_inner()
            .next()
            .await
            .expect("a message")
            .expect_err("must be refused"),
    };
    assert_status(&err, Code::OutOfRange, "RESOURCE_VERSION_TOO_OLD");
    d.assert_healthy().await;
}
