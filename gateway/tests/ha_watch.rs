//! A watch across gateways sharing one PostgreSQL: a watch on gateway B sees a sandbox
//! created, made Ready and deleted through gateway A (which holds the workspace), every event
//! at its own revision and in order; a watch resumed on A from a version B gave out gets
//! exactly what came after it, and one resumed on B from a version A gave out likewise.

mod common;

use std::time::Duration;

use common::ha::SharedStore;
use common::{DataDir, Sbxd, sbx};
use sbx_proto::v1::{EventType, SandboxEvent, WatchSandboxesRequest};
use tokio_stream::StreamExt;

type Events = tonic::Streaming<SandboxEvent>;

async fn watch(d: &Sbxd, resource_version: u64) -> Events {
    d.sandboxes()
        .await
        .watch_sandboxes(WatchSandboxesRequest {
            all_workspaces: true,
            resource_version,
            ..Default::default()
        })
        .await
        .expect("the watch starts")
        .into_inner()
}

/// The next event, within 10 s.
async fn next(events: &mut Events) -> SandboxEvent {
    tokio::time::timeout(Duration::from_secs(10), events.next())
        .await
        .expect("an event within 10 s")
        .expect("the watch goes on")
        .expect("an event, not an error")
}

/// Events until (and with) the first for which `last` holds; at most 50.
async fn until(events: &mut Events, last: impl Fn(&SandboxEvent) -> bool) -> Vec<SandboxEvent> {
    let mut seen = Vec::new();
    for _ in 0..50 {
        let ev = next(events).await;
        let done = last(&ev);
        seen.push(ev);
        if done {
            return seen;
        }
    }
    panic!("50 events and not the one awaited: {seen:#?}");
}

fn name(ev: &SandboxEvent) -> &str {
    ev.sandbox.as_ref().map_or("", |s| s.name.as_str())
}

fn is(ev: &SandboxEvent, kind: EventType, of: &str) -> bool {
    ev.r#type == kind as i32 && name(ev) == of
}

fn ready(ev: &SandboxEvent, of: &str) -> bool {
    name(ev) == of
        && ev
            .sandbox
            .as_ref()
            .is_some_and(|s| s.phase == sbx_proto::v1::Phase::Ready as i32)
}

fn assert_increasing(events: &[SandboxEvent]) {
    for pair in events.windows(2) {
        assert!(
            pair[0].resource_version < pair[1].resource_version,
            "out of order: {pair:#?}"
        );
    }
    for ev in events {
        assert_eq!(
            Some(ev.resource_version),
            ev.sandbox.as_ref().map(|s| s.resource_version),
            "an event's version is its sandbox's"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_on_one_gateway_sees_another_s_writes_and_resumes_across_them() {
    let store = SharedStore::start();
    let url = store.database("watch").await;
    let lease = ["--lease-seconds", "3"];
    let a_data = DataDir::new();
    let a = store.gateway(a_data.path(), &url, &lease);
    let b_data = DataDir::new();
    let b = store.gateway(b_data.path(), &url, &lease);
    // A holds the default workspace (it started first); B serves none of it.
    assert!(!b.log_text().contains("serving the workspace"));

    let mut on_b = watch(&b, 0).await;
    let created = sbx(
        &a.endpoint(),
        &["sandbox", "create", "w1", "--", "sleep", "100"],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let w1 = until(&mut on_b, |ev| ready(ev, "w1")).await;
    assert!(is(&w1[0], EventType::Added, "w1"), "{w1:#?}");
    assert_increasing(&w1);
    let added_at = w1[0].resource_version;

    // A resume on A from the version B gave out: what came after it, nothing before.
    let mut on_a = watch(&a, added_at).await;
    let created = sbx(
        &a.endpoint(),
        &["sandbox", "create", "w2", "--", "sleep", "100"],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let resumed = until(&mut on_a, |ev| ready(ev, "w2")).await;
    assert_increasing(&resumed);
    assert!(resumed.iter().all(|ev| ev.resource_version > added_at));
    // w1's events after its ADDED, exactly as B saw them, then w2's from its ADDED.
    let w1_after: Vec<u64> = w1[1..].iter().map(|e| e.resource_version).collect();
    let w1_resumed: Vec<u64> = resumed
        .iter()
        .filter(|e| name(e) == "w1")
        .map(|e| e.resource_version)
        .collect();
    assert_eq!(w1_resumed, w1_after);
    let w2_added = resumed
        .iter()
        .find(|e| name(e) == "w2")
        .expect("w2's events");
    assert!(is(w2_added, EventType::Added, "w2"), "{resumed:#?}");

    // B's first watch saw w2 too, the same events at the same versions.
    let w2_on_b = until(&mut on_b, |ev| ready(ev, "w2")).await;
    let versions = |evs: &[SandboxEvent], of: &str| -> Vec<(i32, u64)> {
        evs.iter()
            .filter(|e| name(e) == of)
            .map(|e| (e.r#type, e.resource_version))
            .collect()
    };
    assert_eq!(versions(&w2_on_b, "w2"), versions(&resumed, "w2"));

    // A resume on B from a version A gave out (w2's ADDED): the rest only.
    let mut resumed_on_b = watch(&b, w2_added.resource_version).await;
    let deleted = sbx(&a.endpoint(), &["sandbox", "delete", "w1"]);
    assert_eq!(deleted.code, 0, "{deleted:?}");
    let rest = until(&mut resumed_on_b, |ev| is(ev, EventType::Deleted, "w1")).await;
    assert_increasing(&rest);
    assert!(
        rest.iter()
            .all(|e| e.resource_version > w2_added.resource_version)
    );
    assert!(
        !rest.iter().any(|e| is(e, EventType::Added, "w2")),
        "{rest:#?}"
    );
    // The delete at its own version, after every earlier event of w1.
    let gone = rest.last().unwrap();
    assert!(gone.resource_version > *w1_after.last().unwrap());
    // And B's first watch ends the same way.
    let tail = until(&mut on_b, |ev| is(ev, EventType::Deleted, "w1")).await;
    assert_eq!(
        tail.last().map(|e| e.resource_version),
        Some(gone.resource_version)
    );

    // A version no gateway gave out is refused on both.
    let newest = gone.resource_version + 1_000;
    for d in [&a, &b] {
        let err = d
            .sandboxes()
            .await
            .watch_sandboxes(WatchSandboxesRequest {
                all_workspaces: true,
                resource_version: newest,
                ..Default::default()
            })
            .await;
        assert!(err.is_err(), "a watch from the future started");
    }
}
