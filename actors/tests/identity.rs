//! Identity: a request by id acts on that sandbox or nothing; names resolve inside one
//! workspace; an ambiguous name-only request is refused the same way every time.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use sbx_actors::{ActorError, SandboxSelector};
use sbx_driver_sim::SimOp;
use sbx_proto::v1::Phase;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_name_in_two_workspaces_only_the_target_is_touched() {
    let env = Env::new().await;
    let gw = env.gw();
    gw.create_workspace("alpha", HashMap::new()).await.unwrap();
    gw.create_workspace("beta", HashMap::new()).await.unwrap();
    let a = gw
        .create_sandbox(Some("alpha"), "demo", sleep_spec())
        .await
        .unwrap();
    let b = gw
        .create_sandbox(Some("beta"), "demo", sleep_spec())
        .await
        .unwrap();
    assert_ne!(a.id, b.id);
    wait_phase(gw, &by_id(&a), Phase::Ready, Duration::from_secs(5)).await;
    let b_ready = wait_phase(gw, &by_id(&b), Phase::Ready, Duration::from_secs(5)).await;
    let b_instance = env.world.snapshot(uuid(&b)).unwrap().instance_id;

    env.world.clear_audit();
    let stopped = gw.stop_sandbox(&by_id(&a)).await.unwrap();
    assert_eq!(stopped.phase(), Phase::Stopped);
    let started = gw.start_sandbox(&by_id(&a)).await.unwrap();
    assert_eq!(started.phase(), Phase::Ready);
    assert!(
        started.generation > a.generation,
        "every start has a fresh generation"
    );
    assert!(gw.delete_sandbox(&by_id(&a)).await.unwrap());

    let audit = env.world.audit();
    assert!(audit.iter().any(|e| e.op == SimOp::Stop), "{audit:?}");
    assert!(audit.iter().any(|e| e.op == SimOp::Delete), "{audit:?}");
    for entry in &audit {
        assert_eq!(
            entry.sandbox_id, a.id,
            "a call reached another sandbox: {entry:?}"
        );
    }
    // beta/demo is untouched: same record, same workload.
    let b_now = gw.get_sandbox(&by_id(&b)).await.unwrap();
    assert_eq!(
        (b_now.phase(), b_now.generation, b_now.resource_version),
        (Phase::Ready, b_ready.generation, b_ready.resource_version)
    );
    assert_eq!(
        env.world.snapshot(uuid(&b)).unwrap().instance_id,
        b_instance
    );

    // A repeated delete by id reports false and calls nothing at all.
    env.world.clear_audit();
    assert!(!gw.delete_sandbox(&by_id(&a)).await.unwrap());
    assert!(env.world.audit().is_empty(), "{:?}", env.world.audit());
    assert!(env.world.snapshot(uuid(&b)).is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ambiguous_name_only_requests_are_refused_deterministically() {
    let env = Env::new().await;
    let gw = env.gw();
    for ws in ["beta", "alpha"] {
        gw.create_workspace(ws, HashMap::new()).await.unwrap();
        gw.create_sandbox(Some(ws), "demo", sleep_spec())
            .await
            .unwrap();
    }
    env.world.clear_audit();
    let name_only = SandboxSelector::Name {
        workspace: None,
        name: "demo".into(),
    };
    for _ in 0..5 {
        for result in [
            gw.stop_sandbox(&name_only).await.map(|_| ()),
            gw.delete_sandbox(&name_only).await.map(|_| ()),
        ] {
            match result {
                Err(ActorError::AmbiguousName { name, workspaces }) => {
                    assert_eq!(name, "demo");
                    assert_eq!(workspaces, vec!["alpha".to_string(), "beta".to_string()]);
                }
                other => panic!("expected AmbiguousName, got {other:?}"),
            }
        }
    }
    assert!(
        env.world
            .audit()
            .iter()
            .all(|e| e.op != SimOp::Stop && e.op != SimOp::Delete),
        "{:?}",
        env.world.audit()
    );

    // With one match elsewhere it is still not found in default, with a hint.
    gw.delete_sandbox(&SandboxSelector::Name {
        workspace: Some("beta".into()),
        name: "demo".into(),
    })
    .await
    .unwrap();
    match gw.get_sandbox(&name_only).await {
        Err(ActorError::SandboxNotFound { hint, .. }) => assert!(hint.contains("alpha"), "{hint}"),
        other => panic!("expected SandboxNotFound, got {other:?}"),
    }
    // Named with its workspace, it resolves.
    let found = gw
        .get_sandbox(&SandboxSelector::Name {
            workspace: Some("alpha".into()),
            name: "demo".into(),
        })
        .await
        .unwrap();
    assert_eq!(found.workspace, "alpha");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_unique_per_workspace_and_reusable_after_delete() {
    let env = Env::new().await;
    let gw = env.gw();
    let first = gw.create_sandbox(None, "web", sleep_spec()).await.unwrap();
    assert_eq!(first.workspace, "default");
    match gw.create_sandbox(None, "web", sleep_spec()).await {
        Err(ActorError::NameTaken { existing, .. }) => assert_eq!(existing, first.id),
        other => panic!("expected NameTaken, got {other:?}"),
    }
    assert!(gw.delete_sandbox(&by_id(&first)).await.unwrap());
    let second = gw.create_sandbox(None, "web", sleep_spec()).await.unwrap();
    assert_ne!(second.id, first.id);
    assert!(gw.get_sandbox(&by_id(&first)).await.is_err());
    // Bad input is refused before anything is written.
    for bad in ["", "Web", "a_b", "-x", &"x".repeat(64)] {
        assert!(
            matches!(
                gw.create_sandbox(None, bad, sleep_spec()).await,
                Err(ActorError::InvalidName { .. })
            ),
            "{bad:?}"
        );
    }
    assert!(matches!(
        gw.create_sandbox(Some("nope"), "x", sleep_spec()).await,
        Err(ActorError::WorkspaceNotFound(_))
    ));
    assert!(matches!(
        gw.create_sandbox(None, "x", Default::default()).await,
        Err(ActorError::InvalidArgument(_))
    ));
}
