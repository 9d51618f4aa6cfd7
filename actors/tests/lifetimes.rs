//! Lifetimes in the actors, on the sim driver: a deadline's pause the driver cannot make stops
//! the sandbox instead (it never runs on past its lifetime), a call's leaves it running and
//! says why; a ttl set by a call survives a restart of the sandbox; a use waits for a resume
//! under way; a pause that meets a workload which ended meanwhile records the exit; a pause
//! that fails its last attempt is refused as unavailable; a paused sandbox whose driver forgot
//! its generation is adopted, still paused.

mod common;

use std::time::Duration;

use common::{Env, by_id, sleep_spec, test_config, wait_phase};
use sbx_driver_sim::{SimFaults, SimOp};
use sbx_proto::v1::{DesiredState, Lifetime, LifetimeAction, Phase, SandboxSpec};

const T: Duration = Duration::from_secs(10);

fn with_ttl(secs: u64, on: LifetimeAction) -> SandboxSpec {
    SandboxSpec {
        lifetime: Some(Lifetime {
            ttl_seconds: secs,
            on_ttl: on as i32,
            ..Default::default()
        }),
        ..sleep_spec()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlines_pause_that_fails_stops_the_sandbox_and_a_calls_leaves_it_running() {
    let faults = SimFaults::default().with_error_rate_for(SimOp::Pause, 1.0);
    let env = Env::with(test_config(), faults).await;
    let gw = env.gw();

    // Its ttl pauses it; every pause fails: once the attempts are spent it is stopped, with
    // the ttl's reason, its files kept.
    let timed = gw
        .create_sandbox(None, "timed", with_ttl(1, LifetimeAction::Pause))
        .await
        .unwrap();
    let sel = by_id(&timed);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let stopped = wait_phase(gw, &sel, Phase::Stopped, T).await;
    assert_eq!(stopped.reason, "TtlExpired", "{stopped:?}");
    assert!(
        stopped.message.contains("could not be paused"),
        "{}",
        stopped.message
    );
    assert_eq!(stopped.desired_state(), DesiredState::Stopped);
    assert!(stopped.expires_at.is_none(), "fired once");

    // A call's pause that fails: the workload runs on, wanted running, and the call says why.
    let plain = gw
        .create_sandbox(None, "plain", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&plain);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let err = gw.pause_sandbox(&sel).await.unwrap_err();
    assert!(
        err.to_string().contains("injected") && err.to_string().contains("retried"),
        "{err}"
    );
    // Once its attempts are spent, it is wanted running again, and says why.
    let began = std::time::Instant::now();
    let after = loop {
        let now = gw.get_sandbox(&sel).await.unwrap();
        if now.reason == "PauseFailed" || began.elapsed() > T {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(after.desired_state(), DesiredState::Running, "{after:?}");
    assert_eq!(after.reason, "PauseFailed", "{after:?}");
    // The next look records it Ready (it never stopped running).
    gw.reconcile_now().await.unwrap();
    wait_phase(gw, &sel, Phase::Ready, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_a_call_gave_survives_a_restart_and_becomes_the_sandboxs_ttl() {
    let env = Env::new().await;
    let gw = env.gw();
    let s = gw
        .create_sandbox(None, "later", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&s);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let moved = gw.set_sandbox_ttl(&sel, 3600).await.unwrap();
    let deadline = moved.expires_at.expect("a deadline");
    let ttl = moved.spec.as_ref().unwrap().lifetime.unwrap().ttl_seconds;
    assert_eq!(ttl, 3600, "the call's ttl is the sandbox's from now on");
    let restarted = gw.restart_sandbox(&sel).await.unwrap();
    assert_eq!(restarted.expires_at, Some(deadline), "kept while ahead");
    // 0 removes the deadline and the ttl: a start does not bring it back.
    let cleared = gw.set_sandbox_ttl(&sel, 0).await.unwrap();
    assert!(
        cleared.expires_at.is_none() && cleared.next.is_none(),
        "{cleared:?}"
    );
    gw.stop_sandbox(&sel).await.unwrap();
    let started = gw.start_sandbox(&sel).await.unwrap();
    assert!(started.expires_at.is_none(), "{started:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uses_during_a_resume_wait_for_it_and_two_resume_once() {
    let env = Env::new().await;
    let gw = env.gw();
    let s = gw
        .create_sandbox(None, "napper", with_ttl(1, LifetimeAction::Pause))
        .await
        .unwrap();
    let sel = by_id(&s);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    wait_phase(gw, &sel, Phase::Paused, T).await;
    env.world.clear_audit();
    // Two execs at once: both run, after one resume.
    let exec = |text: &'static str| {
        let sel = sel.clone();
        async move {
            let mut out = gw
                .exec(
                    &sel,
                    vec!["echo".into(), text.into()],
                    Default::default(),
                    5,
                )
                .await
                .unwrap();
            let mut said = Vec::new();
            while let Some(chunk) = futures::StreamExt::next(&mut out).await {
                if let Some(sbx_proto::v1::exec_output::Chunk::Stdout(b)) = chunk.unwrap().chunk {
                    said.extend(b);
                }
            }
            String::from_utf8(said).unwrap()
        }
    };
    let (a, b) = tokio::join!(exec("one"), exec("two"));
    assert_eq!((a.as_str(), b.as_str()), ("one\n", "two\n"));
    let resumes = env
        .world
        .audit()
        .iter()
        .filter(|e| e.op == SimOp::Resume)
        .count();
    assert_eq!(resumes, 1, "one resume for both uses");
}

/// A pause that meets a workload which ended between the actor's look and the driver's call
/// (the driver refuses: it is not running) looks again and records the exit; the call is
/// refused as out of place, never passed on as the driver's error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_that_meets_a_workload_ended_meanwhile_records_the_exit() {
    let env = Env::with(test_config(), SimFaults::default()).await;
    let gw = env.gw();
    let made = gw.create_sandbox(None, "ends", sleep_spec()).await.unwrap();
    let sel = by_id(&made);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let id = uuid::Uuid::parse_str(&made.id).unwrap();
    // Every driver call now waits 150 ms after it is recorded: the workload ends inside the
    // pause call's wait, after the actor looked.
    env.driver
        .faults()
        .set_faults(SimFaults::default().with_latency(Duration::from_millis(150)));
    env.world.clear_audit();
    let ends = async {
        let began = std::time::Instant::now();
        while !env.world.audit().iter().any(|a| a.op == SimOp::Pause) {
            assert!(began.elapsed() < T, "no pause reached the driver");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        assert!(env.world.exit(id, 0).is_some(), "it was running");
    };
    let (answer, ()) = tokio::join!(gw.pause_sandbox(&sel), ends);
    let err = answer.unwrap_err();
    assert!(
        matches!(err, sbx_actors::ActorError::FailedPrecondition(_)),
        "{err:?}"
    );
    let now = gw.get_sandbox(&sel).await.unwrap();
    assert_eq!(now.phase(), Phase::Completed, "{now:?}");
    assert_eq!(now.desired_state(), DesiredState::Stopped, "{now:?}");
}

/// A call's pause whose driver fails on the last attempt the sandbox had left gives up at
/// once: the call is refused as unavailable (a client retries), never passed on as the
/// driver's own error, and the workload runs on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pause_that_fails_its_last_attempt_is_refused_as_unavailable() {
    let mut cfg = test_config();
    cfg.max_driver_attempts = 1;
    let env = Env::with(cfg, SimFaults::default()).await;
    let gw = env.gw();
    let made = gw.create_sandbox(None, "last", sleep_spec()).await.unwrap();
    let sel = by_id(&made);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    env.driver
        .faults()
        .set_faults(SimFaults::default().with_error_rate_for(SimOp::Pause, 1.0));
    let err = gw.pause_sandbox(&sel).await.unwrap_err();
    assert!(
        matches!(err, sbx_actors::ActorError::Unavailable(_)),
        "{err:?}"
    );
    assert!(err.to_string().contains("injected"), "{err}");
    let now = gw.get_sandbox(&sel).await.unwrap();
    assert_eq!(now.desired_state(), DesiredState::Running, "{now:?}");
    assert_eq!(now.reason, "PauseFailed", "{now:?}");
}

/// A paused sandbox whose driver forgot its generations (a driver restart) is taken over as
/// it is: the record takes the driver's generation and stays Paused, and a resume brings it
/// back Ready under that generation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_sandbox_whose_driver_forgot_its_generation_is_adopted_paused() {
    let env = Env::new().await;
    let gw = env.gw();
    let made = gw.create_sandbox(None, "kept", sleep_spec()).await.unwrap();
    let sel = by_id(&made);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let paused = gw.pause_sandbox(&sel).await.unwrap();
    assert!(paused.generation > 0, "{paused:?}");
    let id = uuid::Uuid::parse_str(&made.id).unwrap();
    env.world.crash_forget_generations();
    let began = std::time::Instant::now();
    let adopted = loop {
        gw.reconcile_now().await.unwrap();
        let now = gw.get_sandbox(&sel).await.unwrap();
        if now.generation == 0 || began.elapsed() > T {
            break now;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(adopted.generation, 0, "{adopted:?}");
    assert_eq!(adopted.phase(), Phase::Paused, "{adopted:?}");
    assert_eq!(adopted.desired_state(), DesiredState::Paused, "{adopted:?}");
    assert_eq!(adopted.reason, "Adopted", "{adopted:?}");
    let resumed = gw.resume_sandbox(&sel).await.unwrap();
    assert_eq!(resumed.phase(), Phase::Ready, "{resumed:?}");
    let held = env.world.snapshot(id).unwrap();
    assert_eq!(held.state(), sbx_driver_api::pb::State::Running, "{held:?}");
    assert_eq!(held.generation, resumed.generation, "{held:?} {resumed:?}");
}

/// A gateway restarted while a pause hangs in the driver re-issues the pause as its first look
/// at that sandbox, but does not wait on it to start: a pause may take its whole deadline
/// (minutes for a large memory), and sbxd serves nothing until every sandbox re-attached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_amid_a_hung_pause_attaches_without_waiting_for_the_pause() {
    let mut config = test_config();
    config.lifetimes.pause_timeout = Duration::from_secs(120);
    let mut env = Env::with(config.clone(), SimFaults::default()).await;
    let hung_pause = || SimFaults::seeded(3).with_hang_on(SimOp::Pause);
    let made = env
        .gw()
        .create_sandbox(None, "sleeper", sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&made);
    wait_phase(env.gw(), &sel, Phase::Ready, T).await;
    env.driver.set_faults(hung_pause());
    let gw = std::sync::Arc::new(env.gw.take().unwrap());
    let pausing = {
        let sel = sel.clone();
        let gw = std::sync::Arc::clone(&gw);
        tokio::spawn(async move { gw.pause_sandbox(&sel).await })
    };
    wait_phase(&gw, &sel, Phase::Pausing, T).await;
    // The old actor is stuck in its pause: it will not let go within a second.
    gw.shutdown_within(Duration::from_secs(1)).await;
    pausing.abort();

    let driver = std::sync::Arc::new(sbx_driver_sim::SimDriver::new(
        env.world.clone(),
        hung_pause(),
    ));
    env.driver = std::sync::Arc::clone(&driver);
    let began = std::time::Instant::now();
    let gw = sbx_actors::Gateway::start(
        std::sync::Arc::clone(&env.store),
        sbx_actors::DriverSet::single("sim", driver),
        config,
    )
    .await
    .unwrap();
    assert!(
        gw.wait_attached(Duration::from_secs(10)).await,
        "the start waited on the hung pause ({} still to attach)",
        gw.pending_attach()
    );
    assert!(began.elapsed() < Duration::from_secs(10));
    // The pause was re-issued (it is what hangs), and the gateway serves meanwhile.
    let pauses = env
        .world
        .audit()
        .iter()
        .filter(|e| e.op == SimOp::Pause && e.sandbox_id == made.id)
        .count();
    assert!(
        pauses >= 2,
        "the first look re-issued the pause ({pauses} pauses)"
    );
    assert_eq!(gw.get_sandbox(&sel).await.unwrap().phase(), Phase::Pausing);
    let other = gw
        .create_sandbox(None, "other", sleep_spec())
        .await
        .unwrap();
    wait_phase(&gw, &by_id(&other), Phase::Ready, T).await;
    gw.shutdown_within(Duration::from_secs(1)).await;
}
