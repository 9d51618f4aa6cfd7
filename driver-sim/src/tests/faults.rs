//! The fault knobs: seeded determinism, hangs, fail_all, latency, lost replies.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::{Instant, timeout};
use uuid::Uuid;

use super::*;

/// The outcome of each of `calls` gets of an unknown id: 'n' NotFound (the call went
/// through), 'u' Unavailable (injected).
async fn outcomes(faults: SimFaults, calls: usize) -> String {
    let d = SimDriver::new(SimWorld::new(), faults);
    let mut out = String::new();
    for _ in 0..calls {
        out.push(match d.get(get_req(Uuid::new_v4())).await {
            Err(DriverError::NotFound { .. }) => 'n',
            Err(DriverError::Unavailable(_)) => 'u',
            other => panic!("unexpected {other:?}"),
        });
    }
    out
}

#[tokio::test]
async fn error_rate_is_deterministic_for_a_seed() {
    let a = outcomes(SimFaults::seeded(7).with_error_rate(0.5), 200).await;
    let b = outcomes(SimFaults::seeded(7).with_error_rate(0.5), 200).await;
    let c = outcomes(SimFaults::seeded(8).with_error_rate(0.5), 200).await;
    assert_eq!(a, b);
    assert_ne!(a, c);
    let failures = a.matches('u').count();
    assert!(
        (60..=140).contains(&failures),
        "{failures} of 200 at p=0.5: {a}"
    );
    assert_eq!(outcomes(SimFaults::seeded(7), 50).await, "n".repeat(50));
    assert_eq!(
        outcomes(SimFaults::seeded(7).with_error_rate(1.0), 20).await,
        "u".repeat(20)
    );
    // A per-op rate overrides the default.
    let only_start = SimFaults::seeded(7)
        .with_error_rate(1.0)
        .with_error_rate_for(SimOp::Get, 0.0);
    assert_eq!(outcomes(only_start, 20).await, "n".repeat(20));
}

#[tokio::test]
async fn injected_error_message_names_seed_and_call() {
    let d = SimDriver::new(
        SimWorld::new(),
        SimFaults::seeded(1234).with_error_rate(1.0),
    );
    let err = d.list().await.unwrap_err();
    assert_eq!(
        err,
        DriverError::Unavailable("sim: injected fault (seed 1234, list call #1)".into())
    );
}

#[tokio::test(start_paused = true)]
async fn hang_really_hangs_and_leaves_the_world_untouched() {
    let d = SimDriver::new(
        SimWorld::new(),
        SimFaults::seeded(1).with_hang_on(SimOp::Stop),
    );
    let id = Uuid::new_v4();
    d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    let hung = timeout(Duration::from_secs(3600), d.stop(stop_req(id))).await;
    assert!(hung.is_err(), "stop answered: {hung:?}");
    assert_eq!(
        state(&d.get(get_req(id)).await.unwrap()),
        pb::State::Running
    );
    assert_eq!(
        d.world()
            .audit()
            .iter()
            .filter(|e| e.op == SimOp::Stop)
            .count(),
        1
    );

    // A hang rate below 1 hangs some calls, the same ones for the same seed.
    let pattern = |seed| {
        let d = SimDriver::new(SimWorld::new(), SimFaults::seeded(seed).with_hang_rate(0.3));
        async move {
            let mut out = String::new();
            for _ in 0..40 {
                out.push(match timeout(Duration::from_secs(60), d.list()).await {
                    Ok(Ok(_)) => '.',
                    Ok(Err(e)) => panic!("{e}"),
                    Err(_) => 'h',
                });
            }
            out
        }
    };
    let first = pattern(5).await;
    assert_eq!(first, pattern(5).await);
    assert!(first.contains('h') && first.contains('.'), "{first}");
}

#[tokio::test]
async fn fail_all_then_recover_through_a_handle() {
    let sim = SimDriver::new(SimWorld::new(), SimFaults::default());
    let handle = sim.faults();
    let world = sim.world().clone();
    let d: Arc<dyn ComputeDriver> = Arc::new(sim);
    let id = Uuid::new_v4();

    handle.fail_all(true);
    assert!(matches!(
        d.create(create_req(id, "alpha", "demo", 1)).await,
        Err(DriverError::Unavailable(_))
    ));
    assert!(matches!(d.list().await, Err(DriverError::Unavailable(_))));
    assert!(matches!(
        d.capabilities().await,
        Err(DriverError::Unavailable(_))
    ));
    assert!(world.snapshot(id).is_none(), "a failed call must not act");

    handle.fail_all(false);
    d.create(create_req(id, "alpha", "demo", 1)).await.unwrap();
    let caps = d.capabilities().await.unwrap();
    assert_eq!(caps.driver, "sim");
    assert!(caps.exec && caps.logs && caps.watch && caps.persistent_storage);
    assert!(!caps.cpu_limit && !caps.memory_limit);

    handle.set_faults(SimFaults::default().with_fail_all(true));
    assert!(handle.faults().fail_all);
    assert!(matches!(
        d.get(get_req(id)).await,
        Err(DriverError::Unavailable(_))
    ));
}

#[tokio::test(start_paused = true)]
async fn latency_and_jitter_delay_each_call() {
    let d = SimDriver::new(
        SimWorld::new(),
        SimFaults::seeded(3).with_latency(Duration::from_millis(100)),
    );
    let t0 = Instant::now();
    d.list().await.unwrap();
    assert_eq!(t0.elapsed(), Duration::from_millis(100));

    let jittered = |seed| {
        let faults = SimFaults::seeded(seed)
            .with_latency(Duration::from_millis(100))
            .with_jitter(Duration::from_millis(50));
        let d = SimDriver::new(SimWorld::new(), faults);
        async move {
            let mut delays = Vec::new();
            for _ in 0..20 {
                let t0 = Instant::now();
                d.list().await.unwrap();
                delays.push(t0.elapsed());
            }
            delays
        }
    };
    let delays = jittered(3).await;
    assert_eq!(delays, jittered(3).await);
    assert!(
        delays
            .iter()
            .all(|d| (Duration::from_millis(100)..=Duration::from_millis(150)).contains(d)),
        "{delays:?}"
    );
    assert!(
        delays.iter().any(|d| *d != delays[0]),
        "jitter must vary: {delays:?}"
    );
}

#[tokio::test]
async fn a_lost_reply_acts_and_then_answers_unavailable() {
    let faults = SimFaults::seeded(9).with_lost_reply_rate_for(SimOp::Create, 1.0);
    let d = SimDriver::new(SimWorld::new(), faults);
    let id = Uuid::new_v4();
    let err = d
        .create(create_req(id, "alpha", "demo", 1))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, DriverError::Unavailable(m) if m.contains("the call acted")),
        "{err:?}"
    );
    let snapshot = d.world().snapshot(id).expect("the create must have acted");
    assert_eq!(
        (state(&snapshot), snapshot.generation),
        (pb::State::Running, 1)
    );
    // The caller's retry under the same generation is idempotent, and its reply lost again.
    assert!(matches!(
        d.create(create_req(id, "alpha", "demo", 1)).await,
        Err(DriverError::Unavailable(_))
    ));
    assert_eq!(
        d.world().snapshot(id).unwrap().instance_id,
        snapshot.instance_id
    );
    // A call that fails on its own merits keeps its own error.
    let bad = pb::CreateRequest {
        sandbox_id: String::new(),
        ..create_req(id, "alpha", "demo", 1)
    };
    assert!(matches!(
        d.create(bad).await,
        Err(DriverError::InvalidArgument(_))
    ));
    // Other ops are not affected.
    assert_eq!(
        d.get(get_req(id)).await.unwrap().instance_id,
        snapshot.instance_id
    );
}
