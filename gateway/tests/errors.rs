//! Error reasons of bad input and of state (INVALID_NAME, INVALID_ARGUMENT, *_NOT_FOUND,
//! NAME_TAKEN, AMBIGUOUS_NAME, WORKSPACE_NOT_EMPTY, FAILED_PRECONDITION), each with its clear
//! error while the server stays healthy (checked after each). The sim driver: these are about
//! the gateway, not about workloads. Reasons that need the driver or a restart are in
//! `errors_runtime.rs`.

mod common;

use std::collections::HashMap;

use common::{DataDir, Sbxd, assert_status, sbx};
use futures::StreamExt;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, DeleteWorkspaceRequest,
    ExecRequest, GetSandboxRequest, GetWorkspaceRequest, ListSandboxesRequest, Phase, SandboxRef,
    SandboxSpec, StopSandboxRequest, WatchSandboxesRequest, WorkspaceRef,
};
use tonic::Code;

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    }
}

fn by_name(workspace: &str, name: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: String::new(),
        workspace: workspace.into(),
        name: name.into(),
    })
}

fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.into(),
        ..Default::default()
    })
}

fn huge_labels(n: usize) -> HashMap<String, String> {
    (0..n)
        .map(|i| (format!("key-{i}"), "value".to_string()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_its_reason_and_the_server_stays_healthy() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut ws = d.workspaces().await;
    let mut sb = d.sandboxes().await;
    d.assert_healthy().await;

    // Names: empty, over-long, not DNS-1123, non-ASCII — for workspaces and for sandboxes.
    let over_long = "a".repeat(64);
    for bad in ["", over_long.as_str(), "Bad_Name", "-lead", "naïve", "名前"] {
        let err = ws
            .create_workspace(CreateWorkspaceRequest {
                name: bad.into(),
                labels: HashMap::new(),
            })
            .await
            .unwrap_err();
        assert_status(&err, Code::InvalidArgument, "INVALID_NAME");
        assert!(
            err.message().contains("lowercase"),
            "the rule is stated: {err:?}"
        );
        let err = sb
            .create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: String::new(),
                name: bad.into(),
                spec: Some(spec()),
                stopped: false,
            })
            .await
            .unwrap_err();
        assert_status(&err, Code::InvalidArgument, "INVALID_NAME");
        assert!(err.message().contains("sandbox"), "{err:?}");
        d.assert_healthy().await;
    }
    // A bad workspace name in a sandbox reference.
    let err = sb
        .get_sandbox(GetSandboxRequest {
            sandbox: by_name("NOPE", "x"),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_NAME");

    // Unknown workspace, by name and by id.
    let err = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: "nowhere".into(),
            name: "x".into(),
            spec: Some(spec()),
            stopped: false,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::NotFound, "WORKSPACE_NOT_FOUND");
    assert!(err.message().contains("nowhere"), "{err:?}");
    let err = ws
        .get_workspace(GetWorkspaceRequest {
            workspace: Some(WorkspaceRef {
                id: uuid::Uuid::new_v4().to_string(),
                name: String::new(),
            }),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::NotFound, "WORKSPACE_NOT_FOUND");
    d.assert_healthy().await;

    // Unknown sandbox id, malformed id, empty reference.
    let unknown = uuid::Uuid::new_v4().to_string();
    let err = sb
        .get_sandbox(GetSandboxRequest {
            sandbox: by_id(&unknown),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::NotFound, "SANDBOX_NOT_FOUND");
    assert!(err.message().contains(&unknown), "{err:?}");
    let deleted = sb
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: by_id(&unknown),
        })
        .await
        .unwrap()
        .into_inner()
        .deleted;
    assert!(!deleted, "deleting an absent id deletes nothing");
    for bad in ["not-a-uuid", "1234", "00000000-0000-0000-0000-00000000000g"] {
        let err = sb
            .stop_sandbox(StopSandboxRequest {
                sandbox: by_id(bad),
            })
            .await
            .unwrap_err();
        assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
        assert!(err.message().contains(bad), "{err:?}");
    }
    for empty in [None, by_name("", "")] {
        let err = sb
            .get_sandbox(GetSandboxRequest { sandbox: empty })
            .await
            .unwrap_err();
        assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    }
    let err = sb
        .get_sandbox(GetSandboxRequest {
            sandbox: by_name("", "ghost"),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::NotFound, "SANDBOX_NOT_FOUND");
    assert!(err.message().contains("ghost") && err.message().contains("default"));
    d.assert_healthy().await;

    // Huge label maps (well under the 4 MiB message limit, far over the 64-label cap).
    let err = ws
        .create_workspace(CreateWorkspaceRequest {
            name: "labelled".into(),
            labels: huge_labels(20_000),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    assert!(err.message().contains("64"), "{err:?}");
    let mut labelled = spec();
    labelled.labels = huge_labels(20_000);
    let err = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "labelled".into(),
            spec: Some(labelled),
            stopped: false,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    d.assert_healthy().await;

    // Empty command, unknown driver, missing spec.
    for bad in [
        SandboxSpec::default(),
        SandboxSpec {
            driver: "warp-drive".into(),
            ..spec()
        },
    ] {
        let err = sb
            .create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: String::new(),
                name: "bad-spec".into(),
                spec: Some(bad),
                stopped: false,
            })
            .await
            .unwrap_err();
        assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    }
    let err = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "no-spec".into(),
            spec: None,
            stopped: false,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    d.assert_healthy().await;

    // Malformed label selector.
    let err = ws
        .list_workspaces(sbx_proto::v1::ListWorkspacesRequest {
            label_selector: "a=b=c,,==".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    // A page token that no list handed out.
    let err = sb
        .list_sandboxes(ListSandboxesRequest {
            page_token: "not-a-cursor".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    // Listing or watching a workspace that does not exist.
    let err = sb
        .list_sandboxes(ListSandboxesRequest {
            workspace: "nowhere".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::NotFound, "WORKSPACE_NOT_FOUND");
    let err = match sb
        .watch_sandboxes(WatchSandboxesRequest {
            workspace: "nowhere".into(),
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
    assert_status(&err, Code::NotFound, "WORKSPACE_NOT_FOUND");
    d.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_errors_get_their_reasons() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut ws = d.workspaces().await;
    let mut sb = d.sandboxes().await;

    // NAME_TAKEN for workspaces and sandboxes.
    for name in ["alpha", "beta"] {
        ws.create_workspace(CreateWorkspaceRequest {
            name: name.into(),
            labels: HashMap::new(),
        })
        .await
        .unwrap();
    }
    let err = ws
        .create_workspace(CreateWorkspaceRequest {
            name: "alpha".into(),
            labels: HashMap::new(),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::AlreadyExists, "NAME_TAKEN");
    assert!(err.message().contains("alpha"));
    let mut ids = Vec::new();
    for workspace in ["alpha", "beta"] {
        let created = sb
            .create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: workspace.into(),
                name: "twin".into(),
                spec: Some(spec()),
                stopped: false,
            })
            .await
            .unwrap()
            .into_inner();
        ids.push(created.id);
    }
    let err = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: "alpha".into(),
            name: "twin".into(),
            spec: Some(spec()),
            stopped: false,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::AlreadyExists, "NAME_TAKEN");
    d.assert_healthy().await;

    // AMBIGUOUS_NAME: "twin" is not in default but in two workspaces; never resolved by
    // picking one.
    let err = sb
        .stop_sandbox(StopSandboxRequest {
            sandbox: by_name("", "twin"),
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::FailedPrecondition, "AMBIGUOUS_NAME");
    assert!(err.message().contains("alpha") && err.message().contains("beta"));
    for id in &ids {
        let s = sb
            .get_sandbox(GetSandboxRequest { sandbox: by_id(id) })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(s.desired_state, sbx_proto::v1::DesiredState::Running as i32);
    }
    d.assert_healthy().await;

    // WORKSPACE_NOT_EMPTY, and FAILED_PRECONDITION for the default workspace.
    let err = ws
        .delete_workspace(DeleteWorkspaceRequest {
            workspace: Some(WorkspaceRef {
                id: String::new(),
                name: "alpha".into(),
            }),
            cascade: false,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::FailedPrecondition, "WORKSPACE_NOT_EMPTY");
    assert!(err.message().contains("alpha"));
    let err = ws
        .delete_workspace(DeleteWorkspaceRequest {
            workspace: Some(WorkspaceRef {
                id: String::new(),
                name: "default".into(),
            }),
            cascade: true,
        })
        .await
        .unwrap_err();
    assert_status(&err, Code::FailedPrecondition, "FAILED_PRECONDITION");
    d.assert_healthy().await;

    // FAILED_PRECONDITION: exec into a stopped sandbox.
    let stopped = sb
        .stop_sandbox(StopSandboxRequest {
            sandbox: by_id(&ids[0]),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(stopped.phase(), Phase::Stopped);
    let err = sb
        .exec(
            ExecRequest {
                sandbox: by_id(&ids[0]),
                command: vec!["echo".into(), "hi".into()],
                ..Default::default()
            }
            .alone(),
        )
        .await
        .unwrap_err();
    assert_status(&err, Code::FailedPrecondition, "FAILED_PRECONDITION");
    assert!(err.message().contains("twin"), "{err:?}");
    // An empty exec command.
    let err = sb
        .exec(
            ExecRequest {
                sandbox: by_id(&ids[1]),
                command: vec![],
                ..Default::default()
            }
            .alone(),
        )
        .await
        .unwrap_err();
    assert_status(&err, Code::InvalidArgument, "INVALID_ARGUMENT");
    d.assert_healthy().await;

    // The CLI prints the reason of a failed call and exits 1.
    let run = sbx(&d.endpoint(), &["workspace", "delete", "alpha"]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("WORKSPACE_NOT_EMPTY"), "{run:?}");
    let run = sbx(&d.endpoint(), &["sandbox", "get", "twin"]);
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("AMBIGUOUS_NAME"), "{run:?}");
    // A name the CLI itself refuses (usage error, nothing sent).
    let run = sbx(&d.endpoint(), &["sandbox", "get", "Bad_Name"]);
    assert_eq!(run.code, 2, "{run:?}");
    d.assert_healthy().await;
}
