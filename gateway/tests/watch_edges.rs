//! Watch edge cases through sbxd (sim driver): a watch from a resource version the gateway has
//! never reached is OUT_OF_RANGE with reason RESOURCE_VERSION_IN_FUTURE (it would otherwise wait
//! in silence for ever), while a watch from the version a create just answered — the newest —
//! is accepted and delivers the next change.

mod common;

use std::time::Duration;

use common::{DataDir, Sbxd, assert_status};
use sbx_proto::v1::{
    CreateSandboxRequest, SandboxRef, SandboxSpec, StopSandboxRequest, WatchSandboxesRequest,
};
use tonic::Code;

fn watch_from(resource_version: u64) -> WatchSandboxesRequest {
    WatchSandboxesRequest {
        workspace: String::new(),
        all_workspaces: true,
        label_selector: String::new(),
        resource_version,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_from_the_future_is_out_of_range_and_from_the_newest_is_fine() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    let created = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "box".into(),
            spec: Some(SandboxSpec {
                command: vec!["sleep".into(), "1000".into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .unwrap()
        .into_inner();
    let rv = created.resource_version;

    let err = sb
        .watch_sandboxes(watch_from(rv + 1000))
        .await
        .expect_err("a watch from a version never reached was accepted");
    assert_status(&err, Code::OutOfRange, "RESOURCE_VERSION_IN_FUTURE");
    assert!(err.message().contains(&(rv + 1000).to_string()), "{err:?}");

    // From the create's own version (the newest when it answered): accepted, and the next
    // change (the sandbox becoming Ready, or the stop below) arrives.
    let mut events = sb
        .watch_sandboxes(watch_from(rv))
        .await
        .unwrap()
        .into_inner();
    sb.stop_sandbox(StopSandboxRequest {
        sandbox: Some(SandboxRef {
            id: created.id.clone(),
            ..Default::default()
        }),
    })
    .await
    .unwrap();
    let next = tokio::time::timeout(Duration::from_secs(10), events.message())
        .await
        .expect("no event within 10 s")
        .unwrap()
        .expect("the watch ended");
    assert!(next.resource_version > rv, "{next:?}");
    d.assert_healthy().await;
}
