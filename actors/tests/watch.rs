//! Watch: a stream of every change, resumable from the last resource version seen.

mod common;

use std::time::Duration;

use common::*;
use futures::StreamExt;
use sbx_actors::{ActorError, SandboxFilter};
use sbx_proto::v1::{EventType, Phase, SandboxEvent};

async fn next(
    stream: &mut (impl futures::Stream<Item = Result<SandboxEvent, ActorError>> + Unpin),
) -> SandboxEvent {
    tokio::time::timeout(Duration::from_secs(5), stream.next())
        .await
        .expect("an event in time")
        .expect("the stream is open")
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_lists_then_streams_and_resumes_without_gaps() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "first", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&a), Phase::Ready, Duration::from_secs(5)).await;

    let filter = SandboxFilter::default();
    let mut w = gw.watch(&filter, 0).await.unwrap();
    let added = next(&mut w).await;
    assert_eq!(
        (added.r#type, added.sandbox.as_ref().unwrap().name.as_str()),
        (EventType::Added as i32, "first")
    );

    gw.stop_sandbox(&by_id(&a)).await.unwrap();
    let mut seen = Vec::new();
    loop {
        let ev = next(&mut w).await;
        seen.push(ev.resource_version);
        if ev.sandbox.as_ref().unwrap().phase() == Phase::Stopped {
            break;
        }
    }
    assert!(
        seen.windows(2).all(|p| p[0] < p[1]),
        "versions increase: {seen:?}"
    );
    assert!(seen[0] > added.resource_version);
    let last_seen = *seen.last().unwrap();
    drop(w);

    // Changes while nobody watches are delivered on resume, in order, and nothing older.
    gw.start_sandbox(&by_id(&a)).await.unwrap();
    let b = gw
        .create_sandbox(None, "second", sleep_spec())
        .await
        .unwrap();
    assert!(gw.delete_sandbox(&by_id(&b)).await.unwrap());
    let mut w = gw.watch(&filter, last_seen).await.unwrap();
    let mut kinds = Vec::new();
    let mut versions = Vec::new();
    while kinds.last() != Some(&(EventType::Deleted as i32, "second".to_string())) {
        let ev = next(&mut w).await;
        versions.push(ev.resource_version);
        kinds.push((ev.r#type, ev.sandbox.unwrap().name));
    }
    assert!(versions.iter().all(|v| *v > last_seen), "{versions:?}");
    assert!(
        kinds.contains(&(EventType::Added as i32, "second".to_string())),
        "{kinds:?}"
    );
    assert!(
        kinds.iter().any(|(_, n)| n == "first"),
        "the restart of 'first' is in the resumed stream: {kinds:?}"
    );

    // A filter by workspace leaves other workspaces out.
    gw.create_workspace("elsewhere", Default::default())
        .await
        .unwrap();
    let mut only_default = gw.watch(&filter, 0).await.unwrap();
    let _ = next(&mut only_default).await; // "first"
    gw.create_sandbox(Some("elsewhere"), "x", sleep_spec())
        .await
        .unwrap();
    gw.stop_sandbox(&by_id(&a)).await.unwrap();
    let ev = next(&mut only_default).await;
    assert_eq!(ev.sandbox.unwrap().name, "first");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_from_before_a_gateway_restart_is_refused_clearly() {
    let mut env = Env::new().await;
    let a = env
        .gw()
        .create_sandbox(None, "old", sleep_spec())
        .await
        .unwrap();
    let first_rv = a.resource_version;
    env.gw().stop_sandbox(&by_id(&a)).await.unwrap();
    env.restart_gateway(test_config(), |_| {}).await;
    match env.gw().watch(&SandboxFilter::default(), first_rv).await {
        Err(ActorError::ResourceVersionTooOld { requested, .. }) => assert_eq!(requested, first_rv),
        Err(e) => panic!("unexpected error {e}"),
        Ok(_) => panic!("a resume across a restart must be refused"),
    }
}
