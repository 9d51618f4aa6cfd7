//! Supervision: a killed sandbox actor is restarted from its record and the command it held
//! completes exactly once; a killed workspace supervisor comes back with its children.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::*;
use sbx_driver_api::pb;
use sbx_driver_sim::{SimFaults, SimOp};
use sbx_proto::v1::Phase;

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_sandbox_actor_mid_operation_restarts_it_and_the_command_completes_once() {
    let env = Env::new().await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "victim", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&a);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let neighbour = gw
        .create_sandbox(None, "neighbour", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&neighbour), Phase::Ready, T).await;

    for round in 0..6u64 {
        // Slow the driver so the kill lands while a call is in flight.
        env.driver
            .set_faults(SimFaults::seeded(round).with_latency(Duration::from_millis(60)));
        let actor = gw
            .sandbox_actor(uuid(&a))
            .await
            .unwrap()
            .expect("a live actor");
        let gw_ref = &env;
        let stop = async { gw_ref.gw().stop_sandbox(&sel).await };
        let kill = async {
            tokio::time::sleep(Duration::from_millis(20 + 10 * round)).await;
            actor.kill();
        };
        let (stopped, ()) = tokio::join!(stop, kill);
        let stopped = stopped.expect("the stop completes after the actor's restart");
        assert!(
            matches!(stopped.phase(), Phase::Stopped | Phase::Stopping),
            "{:?}",
            stopped.phase()
        );
        let settled = wait_phase(gw, &sel, Phase::Stopped, T).await;
        let restarted = eventually(T, || async {
            gw.sandbox_actor(uuid(&a))
                .await
                .ok()
                .flatten()
                .is_some_and(|n| n.get_id() != actor.get_id())
        })
        .await;
        assert!(restarted, "the killed actor was not restarted");

        env.driver.set_faults(SimFaults::default());
        let started = gw.start_sandbox(&sel).await.unwrap();
        assert_eq!(started.phase(), Phase::Ready);
        assert!(started.generation > settled.generation);
        // Nothing duplicated: one record, one workload, running under the recorded generation.
        let snap = env.world.snapshot(uuid(&a)).unwrap();
        assert_eq!(
            (snap.state(), snap.generation),
            (pb::State::Running, started.generation)
        );
        let listed = gw
            .list_sandboxes(&Default::default(), 100, "")
            .await
            .unwrap()
            .items;
        assert_eq!(listed.iter().filter(|s| s.name == "victim").count(), 1);
    }
    // The neighbour was never touched.
    assert!(
        env.world
            .audit()
            .iter()
            .filter(|e| e.sandbox_id == neighbour.id)
            .all(|e| matches!(e.op, SimOp::Create | SimOp::Get))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_sandbox_actor_during_create_does_not_duplicate_the_workload() {
    let env = Env::with(
        test_config(),
        SimFaults::seeded(3).with_latency(Duration::from_millis(50)),
    )
    .await;
    let gw = env.gw();
    let a = gw
        .create_sandbox(None, "newborn", sleep_spec())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    if let Some(actor) = gw.sandbox_actor(uuid(&a)).await.unwrap() {
        actor.kill();
    }
    let ready = wait_phase(gw, &by_id(&a), Phase::Ready, T).await;
    assert_eq!(
        ready.generation, 1,
        "the create intent's generation is reused, not a new run"
    );
    let creates = env
        .world
        .audit()
        .iter()
        .filter(|e| e.sandbox_id == a.id && e.op == SimOp::Create)
        .count();
    assert!((1..=2).contains(&creates), "{creates} creates");
    assert_eq!(env.world.running_ids(), vec![uuid(&a)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_a_workspace_supervisor_brings_it_and_its_children_back() {
    let env = Env::new().await;
    let gw = env.gw();
    let ws = gw.create_workspace("team", HashMap::new()).await.unwrap();
    let ws_id = uuid::Uuid::parse_str(&ws.id).unwrap();
    let mut sandboxes = Vec::new();
    for i in 0..5 {
        let sb = gw
            .create_sandbox(Some("team"), &format!("s{i}"), sleep_spec())
            .await
            .unwrap();
        sandboxes.push(wait_phase(gw, &by_id(&sb), Phase::Ready, T).await);
    }
    let instances: Vec<String> = sandboxes
        .iter()
        .map(|s| env.world.snapshot(uuid(s)).unwrap().instance_id)
        .collect();

    let sup = gw.workspace_supervisor(ws_id).await.unwrap().unwrap();
    let child = gw
        .sandbox_actor(uuid(&sandboxes[0]))
        .await
        .unwrap()
        .unwrap();
    sup.kill();

    assert!(
        eventually(T, || async {
            match gw.supervised_sandboxes(ws_id).await {
                Ok(Some(children)) => children.len() == 5,
                _ => false,
            }
        })
        .await,
        "the supervisor did not come back with its children"
    );
    let new_sup = gw.workspace_supervisor(ws_id).await.unwrap().unwrap();
    assert_ne!(new_sup.get_id(), sup.get_id());
    assert!(
        eventually(T, || async {
            gw.sandbox_actor(uuid(&sandboxes[0]))
                .await
                .unwrap()
                .is_some_and(|a| a.get_id() != child.get_id())
        })
        .await
    );
    for (sb, instance) in sandboxes.iter().zip(&instances) {
        let now = gw.get_sandbox(&by_id(sb)).await.unwrap();
        assert_eq!((now.phase(), now.generation), (Phase::Ready, sb.generation));
        assert_eq!(
            &env.world.snapshot(uuid(sb)).unwrap().instance_id,
            instance,
            "workload was restarted"
        );
    }
    // And it works: a create and a stop through the new supervisor.
    let extra = gw
        .create_sandbox(Some("team"), "extra", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&extra), Phase::Ready, T).await;
    assert_eq!(
        gw.stop_sandbox(&by_id(&sandboxes[1]))
            .await
            .unwrap()
            .phase(),
        Phase::Stopped
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_actor_that_keeps_failing_escalates_and_the_tree_recovers() {
    let env = Env::new().await;
    let gw = env.gw();
    let ws = gw.create_workspace("flaky", HashMap::new()).await.unwrap();
    let ws_id = uuid::Uuid::parse_str(&ws.id).unwrap();
    let a = gw
        .create_sandbox(Some("flaky"), "a", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&a), Phase::Ready, T).await;
    let sup = gw.workspace_supervisor(ws_id).await.unwrap().unwrap();
    // More kills than the intensity limit (5 in 10 s) allows.
    for _ in 0..7 {
        let found = eventually(T, || async {
            gw.sandbox_actor(uuid(&a)).await.ok().flatten().is_some()
        })
        .await;
        assert!(found);
        if let Some(actor) = gw.sandbox_actor(uuid(&a)).await.unwrap() {
            actor.kill();
        }
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    // The supervisor escalated (it was restarted by the root) and everything is back.
    assert!(
        eventually(T, || async {
            gw.workspace_supervisor(ws_id)
                .await
                .ok()
                .flatten()
                .is_some_and(|s| s.get_id() != sup.get_id())
        })
        .await
    );
    assert!(
        eventually(T, || async {
            gw.sandbox_actor(uuid(&a)).await.ok().flatten().is_some()
        })
        .await
    );
    assert_eq!(
        gw.stop_sandbox(&by_id(&a)).await.unwrap().phase(),
        Phase::Stopped
    );
}
