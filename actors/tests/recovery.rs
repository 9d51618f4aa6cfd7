//! Recovery: generation drift ends Ready (never Error), Error is always recoverable, a failing
//! driver settles in Error instead of spinning, and the reconciler survives bad records.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use sbx_actors::SandboxSelector;
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_sim::{SimFaults, SimOp};
use sbx_proto::v1::{DesiredState, Phase};
use uuid::Uuid;

const T: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generation_drift_after_a_gateway_restart_ends_ready_without_a_reboot() {
    let mut env = Env::new().await;
    let a = env
        .gw()
        .create_sandbox(None, "steady", sleep_spec())
        .await
        .unwrap();
    let before = wait_phase(env.gw(), &by_id(&a), Phase::Ready, T).await;
    let instance = env.world.snapshot(uuid(&a)).unwrap().instance_id;

    // The machine keeps the workload running but forgets its generation marker while the
    // gateway is down.
    env.restart_gateway(test_config(), |world| world.crash_forget_generations())
        .await;

    let after = env.gw().get_sandbox(&by_id(&a)).await.unwrap();
    assert_eq!(
        after.phase(),
        Phase::Ready,
        "{}: {}",
        after.reason,
        after.message
    );
    assert_eq!(after.reason, "Adopted");
    assert_eq!(after.generation, 0, "the driver's generation is persisted");
    assert_ne!(before.generation, after.generation);
    let snap = env.world.snapshot(uuid(&a)).unwrap();
    assert_eq!(snap.instance_id, instance, "the workload was not restarted");
    assert_eq!(snap.state(), pb::State::Running);

    // A plain restart with no drift re-attaches without touching anything.
    env.world.clear_audit();
    env.restart_gateway(test_config(), |_| {}).await;
    let again = env.gw().get_sandbox(&by_id(&a)).await.unwrap();
    assert_eq!((again.phase(), again.generation), (Phase::Ready, 0));
    let ops: Vec<SimOp> = env
        .world
        .audit()
        .iter()
        // (The gateway's usage sampler reads stats of running sandboxes: not the actor's.)
        .filter(|e| e.sandbox_id == a.id && e.op != SimOp::Stats)
        .map(|e| e.op)
        .collect();
    assert_eq!(ops, vec![SimOp::Get], "re-attach only looks, by id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_seen_by_a_running_actor_restarts_the_actor_which_adopts() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "drifty", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&a), Phase::Ready, T).await;
    let actor_before = gw.sandbox_actor(uuid(&a)).await.unwrap().unwrap().get_id();
    let instance = env.world.snapshot(uuid(&a)).unwrap().instance_id;

    assert!(env.world.set_generation(uuid(&a), 77));
    let report = gw.reconcile_now().await.unwrap();
    assert_eq!(report.observed, 1, "{report:?}");

    let sel = by_id(&a);
    assert!(
        eventually(T, || async {
            gw.get_sandbox(&sel).await.unwrap().generation == 77
        })
        .await,
        "the sandbox did not adopt the driver's generation"
    );
    let sb = gw.get_sandbox(&sel).await.unwrap();
    assert_eq!(sb.phase(), Phase::Ready);
    let actor_after = gw.sandbox_actor(uuid(&a)).await.unwrap().unwrap().get_id();
    assert_ne!(
        actor_before, actor_after,
        "the actor was restarted by its supervisor"
    );
    assert_eq!(env.world.snapshot(uuid(&a)).unwrap().instance_id, instance);

    // A start that finds the workload under another generation also ends Ready.
    gw.stop_sandbox(&sel).await.unwrap();
    gw.start_sandbox(&sel).await.unwrap();
    assert!(env.world.set_generation(uuid(&a), 5));
    let report = gw.reconcile_now().await.unwrap();
    assert!(report.skipped.is_empty(), "{report:?}");
    assert!(
        eventually(T, || async {
            gw.get_sandbox(&sel).await.unwrap().generation == 5
        })
        .await
    );
    assert_eq!(gw.get_sandbox(&sel).await.unwrap().phase(), Phase::Ready);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_is_recoverable_by_start_and_keeps_the_files() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "crashy", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&a);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    // Write a file in the sandbox's persistent area.
    let mut out = gw
        .exec(
            &sel,
            vec!["write".into(), "/sandbox/note".into(), "kept".into()],
            HashMap::new(),
            5,
        )
        .await
        .unwrap();
    while futures::StreamExt::next(&mut out).await.is_some() {}

    // The workload dies with status 3: the driver's watch reports it.
    env.world.exit(uuid(&a), 3).unwrap();
    let failed = wait_phase(gw, &sel, Phase::Error, T).await;
    assert!(failed.message.contains("status 3"), "{}", failed.message);
    assert_eq!(failed.desired_state(), DesiredState::Stopped);

    // Start recovers it without delete, under a fresh generation, files intact.
    let started = gw.start_sandbox(&sel).await.unwrap();
    assert_eq!(
        started.phase(),
        Phase::Ready,
        "{}: {}",
        started.reason,
        started.message
    );
    assert!(started.generation > failed.generation);
    assert_eq!(
        env.world
            .files(uuid(&a))
            .unwrap()
            .get("/sandbox/note")
            .map(String::as_str),
        Some("kept")
    );

    // Restart is accepted in Error too.
    env.world.exit(uuid(&a), 1).unwrap();
    wait_phase(gw, &sel, Phase::Error, T).await;
    let restarted = gw.restart_sandbox(&sel).await.unwrap();
    assert_eq!(restarted.phase(), Phase::Ready);
    assert!(
        env.world
            .files(uuid(&a))
            .unwrap()
            .contains_key("/sandbox/note")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_driver_backs_off_settles_in_error_and_start_recovers() {
    let env = Env::new().await;
    let gw = env.gw();
    env.driver.fail_all(true);
    let a = gw
        .create_sandbox(None, "unlucky", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&a);
    let failed = wait_phase(gw, &sel, Phase::Error, T).await;
    assert_eq!(failed.reason, "DriverUnavailable");
    assert!(failed.message.contains("4 attempts"), "{}", failed.message);

    // Settled: no more calls while nothing asks.
    let calls = env
        .world
        .audit()
        .iter()
        .filter(|e| e.sandbox_id == a.id)
        .count();
    assert!(calls <= 4, "{calls} calls for 4 attempts");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        env.world
            .audit()
            .iter()
            .filter(|e| e.sandbox_id == a.id)
            .count(),
        calls,
        "it kept calling the driver"
    );

    env.driver.fail_all(false);
    let started = gw.start_sandbox(&sel).await.unwrap();
    assert_eq!(
        started.phase(),
        Phase::Ready,
        "{}: {}",
        started.reason,
        started.message
    );
    assert_eq!(
        env.world.snapshot(uuid(&a)).unwrap().state(),
        pb::State::Running
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_driver_costs_a_deadline_not_the_gateway() {
    let env = Env::with(
        test_config(),
        SimFaults::seeded(7).with_hang_on(SimOp::Create),
    )
    .await;
    let gw = env.gw();
    let hung = gw.create_sandbox(None, "hung", sleep_spec()).await.unwrap();
    // Other work goes on while the create hangs.
    let other = gw.create_workspace("other", HashMap::new()).await.unwrap();
    assert_eq!(other.name, "other");
    let failed = wait_phase(gw, &by_id(&hung), Phase::Error, Duration::from_secs(10)).await;
    assert!(
        failed.message.contains("did not answer"),
        "{}",
        failed.message
    );
    env.driver.set_faults(SimFaults::default());
    assert_eq!(
        gw.start_sandbox(&by_id(&hung)).await.unwrap().phase(),
        Phase::Ready
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_bad_driver_record_does_not_stop_the_sweep() {
    let env = Env::new().await;
    let gw = env.gw();
    let known = gw
        .create_sandbox(None, "known", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&known), Phase::Ready, T).await;

    // Workloads the store has no record of: an empty workspace (normalized to default), a
    // workspace that does not exist, and a name that breaks the rule.
    let spec = pb::SandboxSpec {
        command: vec!["sleep".into()],
        ..Default::default()
    };
    let mut ids = Vec::new();
    for (ws, name) in [
        ("", "stray"),
        ("no-such-ws", "lost"),
        ("default", "Bad_Name"),
    ] {
        let id = Uuid::new_v4();
        ids.push(id);
        let request = pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: id.to_string(),
            workspace: ws.into(),
            name: name.into(),
            spec: Some(spec.clone()),
            generation: 9,
            stopped: false,
        };
        env.driver.create(request).await.unwrap();
    }
    // And the known sandbox exits behind the gateway's back, with no watch to tell it.
    env.world.exit(uuid(&known), 0).unwrap();

    // The first sweep only notes the workloads without a record; the second adopts.
    let first = gw.reconcile_now().await.unwrap();
    assert_eq!((first.adopted, first.deferred), (0, 3), "{first:?}");
    let report = gw.reconcile_now().await.unwrap();
    assert_eq!(report.adopted, 1, "{report:?}");
    assert_eq!(report.skipped.len(), 2, "{report:?}");
    assert!(report.driver_errors.is_empty(), "{report:?}");

    let stray = gw.get_sandbox(&SandboxSelector::Id(ids[0])).await.unwrap();
    assert_eq!(
        (stray.workspace.as_str(), stray.name.as_str()),
        ("default", "stray")
    );
    assert!(!stray.workspace_id.is_empty());
    wait_phase(gw, &SandboxSelector::Id(ids[0]), Phase::Ready, T).await;
    assert!(gw.get_sandbox(&SandboxSelector::Id(ids[1])).await.is_err());
    assert!(gw.get_sandbox(&SandboxSelector::Id(ids[2])).await.is_err());
    // The refused workloads are left alone: the reconciler deletes nothing.
    assert!(env.world.snapshot(ids[1]).is_some() && env.world.snapshot(ids[2]).is_some());
    // The sweep went on to the known sandbox after the bad records.
    wait_phase(gw, &by_id(&known), Phase::Completed, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_that_lost_everything_gets_its_workloads_back() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "phoenix", sleep_spec())
        .await
        .unwrap();
    let ready = wait_phase(gw, &by_id(&a), Phase::Ready, T).await;
    env.world.crash_lose_all();
    let report = gw.reconcile_now().await.unwrap();
    assert_eq!(report.absent, 1, "{report:?}");
    let sel = by_id(&a);
    assert!(
        eventually(T, || async {
            env.world
                .snapshot(uuid(&a))
                .is_some_and(|s| s.state() == pb::State::Running)
        })
        .await
    );
    let back = wait_phase(gw, &sel, Phase::Ready, T).await;
    assert!(
        back.generation > ready.generation,
        "a new run gets a new generation"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_the_driver_refused_is_finished_by_the_reconciler() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "sticky", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&a);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    env.driver.fail_all(true);
    // Not acknowledged: the driver did not confirm.
    assert!(matches!(
        gw.delete_sandbox(&sel).await,
        Err(sbx_actors::ActorError::Unavailable(_))
    ));
    let sel2 = sel.clone();
    assert!(
        eventually(T, || async {
            gw.get_sandbox(&sel2)
                .await
                .is_ok_and(|s| s.phase() == Phase::Error)
        })
        .await,
        "the deletion settles in Error while the driver is away"
    );
    let stuck = gw.get_sandbox(&sel).await.unwrap();
    assert_eq!(stuck.desired_state(), DesiredState::Deleted);
    // Starting it is refused: it is being deleted.
    assert!(matches!(
        gw.start_sandbox(&sel).await,
        Err(sbx_actors::ActorError::FailedPrecondition(_))
    ));

    env.driver.fail_all(false);
    gw.reconcile_now().await.unwrap();
    assert!(
        eventually(T, || async { gw.get_sandbox(&sel).await.is_err() }).await,
        "the reconciler finished the deletion"
    );
    assert!(
        env.world.snapshot(uuid(&a)).is_none(),
        "the workload is gone too"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_deleted_during_a_sweep_is_not_adopted_back() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "short-lived", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&a), Phase::Ready, T).await;
    // A sweep lists the workload while its sandbox is deleted: the driver's list is older than
    // the deletion. Simulate the worst order: the record is gone, the workload still listed.
    let spec = pb::SandboxSpec {
        command: vec!["sleep".into()],
        ..Default::default()
    };
    let ghost = Uuid::new_v4();
    let request = pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: ghost.to_string(),
        workspace: "default".into(),
        name: "ghost".into(),
        spec: Some(spec),
        generation: 1,
        stopped: false,
    };
    env.driver.create(request).await.unwrap();
    let first = gw.reconcile_now().await.unwrap();
    assert_eq!(first.deferred, 1, "{first:?}");
    // It is deleted before the next sweep.
    env.driver
        .delete(pb::DeleteRequest {
            sandbox_id: ghost.to_string(),
        })
        .await
        .unwrap();
    let second = gw.reconcile_now().await.unwrap();
    assert_eq!((second.adopted, second.deferred), (0, 0), "{second:?}");
    assert!(gw.get_sandbox(&SandboxSelector::Id(ghost)).await.is_err());
    assert!(env.world.snapshot(ghost).is_none(), "nothing recreated it");
    assert!(gw.delete_sandbox(&by_id(&a)).await.unwrap());
}

/// A workload without a record is adopted only into a workspace that existed when it started:
/// the driver knows the workspace by name, and one launched before the workspace of that name
/// was made belongs to an earlier one (deleted; its records lost with a store), so it is left
/// running and reported, never adopted into the new one. One started later is adopted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_older_than_the_workspace_of_its_name_is_not_adopted_into_it() {
    let env = Env::new().await;
    let gw = env.gw();
    let launch = |id: Uuid, name: &str| pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: "team".into(),
        name: name.into(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into()],
            ..Default::default()
        }),
        generation: 1,
        stopped: false,
    };
    let old = Uuid::new_v4();
    env.driver.create(launch(old, "old")).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    gw.create_workspace("team", HashMap::new()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let young = Uuid::new_v4();
    env.driver.create(launch(young, "young")).await.unwrap();

    let first = gw.reconcile_now().await.unwrap();
    assert_eq!(first.deferred, 2, "{first:?}");
    let second = gw.reconcile_now().await.unwrap();
    assert_eq!(second.adopted, 1, "{second:?}");
    assert!(
        second
            .skipped
            .iter()
            .any(|s| s.contains(&old.to_string()) && s.contains("started before workspace")),
        "{second:?}"
    );
    assert!(gw.get_sandbox(&SandboxSelector::Id(young)).await.is_ok());
    assert!(
        gw.get_sandbox(&SandboxSelector::Id(old)).await.is_err(),
        "the older workload was adopted into the new workspace of its name"
    );
    assert!(env.world.snapshot(old).is_some(), "it was left running");
}
