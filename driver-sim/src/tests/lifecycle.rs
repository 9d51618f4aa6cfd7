//! The trait rules as the sim keeps them, and the world's test controls.

use std::time::Duration;

use futures::StreamExt;
use tokio::time::timeout;
use uuid::Uuid;

use super::*;

#[tokio::test]
async fn lifecycle_follows_the_trait_rules() {
    let d = driver();
    let id = Uuid::new_v4();
    let created = d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    assert_eq!(state(&created), pb::State::Running);
    assert_eq!(
        (created.workspace.as_str(), created.name.as_str()),
        ("alpha", "demo")
    );
    assert_eq!(created.generation, 1);
    assert!(created.started_at.is_some());

    // Create again, same generation: nothing happens.
    let again = d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    assert_eq!(again.instance_id, created.instance_id);
    // Same id under another workspace/name is refused, not silently relabelled.
    let relabel = d
        .create(create_req(id, "beta", "demo", 1))
        .await
        .unwrap_err();
    assert!(
        matches!(relabel, DriverError::FailedPrecondition(_)),
        "{relabel:?}"
    );
    // Create under another generation while running.
    let err = d
        .create(create_req(id, "alpha", "demo", 2))
        .await
        .unwrap_err();
    assert_eq!(
        err,
        DriverError::GenerationMismatch {
            sandbox_id: id.to_string(),
            running: 1,
            requested: 2
        }
    );

    let same = d.start(start_req(id, 1)).await.unwrap();
    assert_eq!(same.instance_id, created.instance_id);
    let err = d.start(start_req(id, 5)).await.unwrap_err();
    assert_eq!(
        err,
        DriverError::GenerationMismatch {
            sandbox_id: id.to_string(),
            running: 1,
            requested: 5
        }
    );

    let stopped = d.stop(stop_req(id)).await.unwrap();
    assert_eq!(state(&stopped), pb::State::Stopped);
    assert_eq!(
        state(&d.stop(stop_req(id)).await.unwrap()),
        pb::State::Stopped
    );

    let restarted = d.start(start_req(id, 5)).await.unwrap();
    assert_eq!(state(&restarted), pb::State::Running);
    assert_eq!(restarted.generation, 5);
    assert_ne!(restarted.instance_id, created.instance_id);

    assert_eq!(
        log_lines(&d, id, 0).await,
        ["started generation 1", "stopped", "started generation 5"]
    );
    assert_eq!(log_lines(&d, id, 1).await, ["started generation 5"]);

    assert!(d.delete(delete_req(id)).await.unwrap().deleted);
    assert!(!d.delete(delete_req(id)).await.unwrap().deleted);
    assert!(matches!(
        d.get(get_req(id)).await,
        Err(DriverError::NotFound { .. })
    ));
    assert!(matches!(
        d.start(start_req(id, 6)).await,
        Err(DriverError::NotFound { .. })
    ));
}

#[tokio::test]
async fn create_of_a_stopped_sandbox_under_a_new_generation_starts_it() {
    let d = driver();
    let id = Uuid::new_v4();
    d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    d.stop(stop_req(id)).await.unwrap();
    let snapshot = d.create(create_req(id, "alpha", "demo", 2)).await.unwrap();
    assert_eq!(
        (state(&snapshot), snapshot.generation),
        (pb::State::Running, 2)
    );
}

#[tokio::test]
async fn files_survive_stop_and_start_and_go_with_delete() {
    let d = driver();
    let id = Uuid::new_v4();
    d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    assert_eq!(
        exec(&d, id, &["write", "/sandbox/notes", "kept"]).await.2,
        0
    );
    d.stop(stop_req(id)).await.unwrap();
    let err = d
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["echo".into()],
            ..Default::default()
        })
        .await
        .err()
        .unwrap();
    assert!(matches!(err, DriverError::FailedPrecondition(_)), "{err:?}");
    d.start(start_req(id, 2)).await.unwrap();
    assert_eq!(
        exec(&d, id, &["cat", "/sandbox/notes"]).await,
        ("kept".into(), String::new(), 0)
    );
    assert_eq!(d.world().files(id).unwrap().len(), 1);

    d.delete(delete_req(id)).await.unwrap();
    d.create(create_req(id, "alpha", "demo", 3)).await.unwrap();
    let (_, stderr, code) = exec(&d, id, &["cat", "/sandbox/notes"]).await;
    assert_eq!(
        (stderr.as_str(), code),
        ("cat: /sandbox/notes: No such file or directory\n", 1)
    );
    assert_eq!(
        exec(&d, id, &["frobnicate"]).await,
        (
            String::new(),
            "sim: unknown command: frobnicate\n".into(),
            127
        )
    );
    assert_eq!(
        exec(&d, id, &["echo", "hello"]).await,
        ("hello\n".into(), String::new(), 0)
    );
    // Exec output is not in the logs.
    assert_eq!(log_lines(&d, id, 0).await, ["started generation 3"]);
}

#[tokio::test]
async fn a_new_driver_on_the_same_world_finds_everything_and_the_audit_survives() {
    let world = SimWorld::new();
    let (running, stopped) = (Uuid::new_v4(), Uuid::new_v4());
    let first = SimDriver::new(world.clone(), SimFaults::default());
    let before = first
        .create(create_req(running, "alpha", "one", 4))
        .await
        .unwrap();
    first
        .create(create_req(stopped, "alpha", "two", 1))
        .await
        .unwrap();
    first.stop(stop_req(stopped)).await.unwrap();
    drop(first);

    let second = SimDriver::new(world.clone(), SimFaults::default());
    let after = second.get(get_req(running)).await.unwrap();
    assert_eq!(after, before);
    assert_eq!(
        state(&second.get(get_req(stopped)).await.unwrap()),
        pb::State::Stopped
    );
    assert_eq!(world.running_ids(), vec![running]);
    assert_eq!(world.audit().len(), 5, "{:?}", world.audit());
    world.clear_audit();
    assert!(world.audit().is_empty());
}

#[tokio::test]
async fn audit_records_every_call_as_received() {
    let d = SimDriver::new(SimWorld::new(), SimFaults::default().with_fail_all(false));
    let id = Uuid::new_v4();
    d.create(create_req(id, "alpha", "demo", 9)).await.unwrap();
    assert!(matches!(
        d.stop(pb::StopRequest::default()).await,
        Err(DriverError::InvalidArgument(_))
    ));
    assert!(matches!(
        d.start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: "demo".into(),
            generation: 3
        })
        .await,
        Err(DriverError::InvalidArgument(_))
    ));
    d.list().await.unwrap();
    d.faults().fail_all(true);
    assert!(matches!(
        d.get(get_req(id)).await,
        Err(DriverError::Unavailable(_))
    ));
    let entry = |op, sandbox_id: &str, generation| AuditEntry {
        op,
        sandbox_id: sandbox_id.to_string(),
        generation,
    };
    assert_eq!(
        d.world().audit(),
        vec![
            entry(SimOp::Create, &id.to_string(), Some(9)),
            entry(SimOp::Stop, "", None),
            entry(SimOp::Start, "demo", Some(3)),
            entry(SimOp::List, "", None),
            entry(SimOp::Get, &id.to_string(), None),
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn watch_reports_changes_in_order_and_ends_with_the_driver() {
    let d = driver();
    let mut events = d.watch().await.unwrap();
    let id = Uuid::new_v4();
    d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    d.stop(stop_req(id)).await.unwrap();
    d.start(start_req(id, 2)).await.unwrap();
    d.world().exit(id, 4).unwrap();
    d.delete(delete_req(id)).await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..5 {
        let event = events.next().await.unwrap().unwrap();
        let snapshot = event.snapshot.unwrap();
        assert_eq!(snapshot.sandbox_id, id.to_string());
        seen.push((
            state(&snapshot),
            snapshot.generation,
            snapshot.exit_code,
            event.deleted,
        ));
    }
    assert_eq!(
        seen,
        [
            (pb::State::Running, 1, 0, false),
            (pb::State::Stopped, 1, 0, false),
            (pb::State::Running, 2, 0, false),
            (pb::State::Exited, 2, 4, false),
            (pb::State::Stopped, 2, 4, true),
        ]
    );
    drop(d);
    let end = timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap();
    assert!(
        end.is_none(),
        "stream must end when the driver goes: {end:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn logs_follow_sees_new_lines_and_ends_on_delete() {
    let d = driver();
    let id = Uuid::new_v4();
    d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    let req = pb::LogsRequest {
        sandbox_id: id.to_string(),
        follow: true,
        tail_lines: 0,
        ..Default::default()
    };
    let mut follow = d.logs(req).await.unwrap();
    d.stop(stop_req(id)).await.unwrap();
    d.delete(delete_req(id)).await.unwrap();
    let chunks: Vec<_> = timeout(Duration::from_secs(5), follow.by_ref().collect::<Vec<_>>())
        .await
        .unwrap();
    let lines: Vec<String> = chunks
        .into_iter()
        .map(|c| String::from_utf8(c.unwrap().data).unwrap())
        .collect();
    assert_eq!(lines, ["started generation 1\n", "stopped\n"]);
}

#[tokio::test(start_paused = true)]
async fn an_exit_spec_ends_by_itself_unless_stopped_first() {
    let d = driver();
    let mut events = d.watch().await.unwrap();
    let (exits, stopped_first) = (Uuid::new_v4(), Uuid::new_v4());
    let mut req = create_req(exits, "alpha", "exits", 1);
    req.spec = Some(pb::SandboxSpec {
        command: vec!["exit".into(), "3".into()],
        ..Default::default()
    });
    d.create(req.clone()).await.unwrap();
    req.sandbox_id = stopped_first.to_string();
    req.name = "stopped-first".into();
    d.create(req).await.unwrap();
    d.stop(stop_req(stopped_first)).await.unwrap();

    tokio::time::sleep(SELF_EXIT_DELAY * 2).await;
    let snapshot = d.get(get_req(exits)).await.unwrap();
    assert_eq!(
        (
            state(&snapshot),
            snapshot.exit_code,
            snapshot.reason.as_str()
        ),
        (pb::State::Exited, 3, "Error")
    );
    // The stop fenced the scheduled exit off.
    assert_eq!(
        state(&d.get(get_req(stopped_first)).await.unwrap()),
        pb::State::Stopped
    );
    let mut exited_events = 0;
    while let Ok(Some(event)) = timeout(Duration::from_millis(1), events.next()).await {
        let snapshot = event.unwrap().snapshot.unwrap();
        if state(&snapshot) == pb::State::Exited {
            assert_eq!(snapshot.sandbox_id, exits.to_string());
            exited_events += 1;
        }
    }
    assert_eq!(exited_events, 1);
}

#[tokio::test]
async fn world_controls() {
    let d = driver();
    let world = d.world().clone();
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    let a0 = d.create(create_req(a, "alpha", "a", 7)).await.unwrap();
    d.create(create_req(b, "alpha", "b", 8)).await.unwrap();
    assert_eq!(world.running_ids(), vec![a, b]);

    assert!(world.set_generation(b, 42));
    assert!(!world.set_generation(Uuid::new_v4(), 1));
    assert_eq!(world.snapshot(b).unwrap().generation, 42);

    world.crash_forget_generations();
    let a1 = world.snapshot(a).unwrap();
    assert_eq!(
        (state(&a1), a1.generation, &a1.instance_id),
        (pb::State::Running, 0, &a0.instance_id)
    );
    assert_eq!(
        d.start(start_req(a, 7)).await.unwrap_err(),
        DriverError::GenerationMismatch {
            sandbox_id: a.to_string(),
            running: 0,
            requested: 7
        }
    );

    let exited = world.exit(b, 0).unwrap();
    assert_eq!(
        (state(&exited), exited.reason.as_str()),
        (pb::State::Exited, "Completed")
    );
    assert!(
        world.exit(b, 1).is_none(),
        "an exited workload cannot exit again"
    );
    assert_eq!(world.running_ids(), vec![a]);

    exec(&d, a, &["write", "f", "x"]).await;
    world.crash_lose_all();
    assert!(world.running_ids().is_empty());
    assert!(d.list().await.unwrap().is_empty());
    assert!(matches!(
        d.get(get_req(a)).await,
        Err(DriverError::NotFound { .. })
    ));
    d.create(create_req(a, "alpha", "a", 9)).await.unwrap();
    assert!(
        world.files(a).unwrap().is_empty(),
        "files must be lost with the machine"
    );
}

#[tokio::test(start_paused = true)]
async fn a_scheduled_exit_cannot_end_a_later_run() {
    let d = driver();
    let id = Uuid::new_v4();
    let mut req = create_req(id, "alpha", "exits", 1);
    req.spec = Some(pb::SandboxSpec {
        command: vec!["exit".into(), "3".into()],
        ..Default::default()
    });
    d.create(req).await.unwrap();
    // Restart halfway through the first run: its exit is due before the second run's.
    tokio::time::sleep(SELF_EXIT_DELAY / 2).await;
    d.stop(stop_req(id)).await.unwrap();
    let second = d.start(start_req(id, 2)).await.unwrap();
    tokio::time::sleep(SELF_EXIT_DELAY * 3 / 4).await;
    let now = d.get(get_req(id)).await.unwrap();
    assert_eq!(
        (state(&now), &now.instance_id),
        (pb::State::Running, &second.instance_id),
        "the first run's exit ended the second run"
    );
    tokio::time::sleep(SELF_EXIT_DELAY).await;
    let now = d.get(get_req(id)).await.unwrap();
    assert_eq!(
        (state(&now), now.generation, now.exit_code),
        (pb::State::Exited, 2, 3)
    );
}

#[tokio::test]
async fn the_images_option_is_reported_and_the_spec_kept() {
    assert!(!driver().capabilities().await.unwrap().images);
    let d = SimDriver::new(SimWorld::new(), SimFaults::default()).with_images(true);
    assert!(d.capabilities().await.unwrap().images);
    let id = Uuid::new_v4();
    let mut req = create_req(id, "alpha", "img", 1);
    let digest = format!("sha256:{}", "ab".repeat(32));
    req.spec.as_mut().unwrap().image = digest.clone();
    d.create(req).await.unwrap();
    assert_eq!(d.world().spec(id).map(|s| s.image), Some(digest));
    assert_eq!(d.world().spec(Uuid::new_v4()), None);
}
