//! Measures the actor runtime against the bare sim driver, side by side in one run.
//!
//! ```text
//! cargo run --release -p sbx-chaos-tests --bin sbx-actor-bench -- [SANDBOXES] [OPS] [CONCURRENCY]
//! ```
//! 1. Lifecycle operations per second (stop and start, alternately, by id) through the actor
//!    tree — durable store writes included — vs the same calls made on the sim driver
//!    directly, at zero latency.
//! 2. The time to load and re-attach SANDBOXES sandboxes at startup, and the resident memory
//!    each idle sandbox actor adds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_actors::{Config, DriverSet, Gateway, SandboxSelector};
use sbx_chaos_tests::resident_bytes;
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, pb};
use sbx_proto::v1::SandboxSpec;
use sbx_storage::{Kind, ListQuery, ObjectStore, Scope, SledStore};
use uuid::Uuid;

fn arg(n: usize, default: usize) -> usize {
    std::env::args()
        .nth(n)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn config() -> Config {
    Config {
        reconcile_interval: Duration::ZERO,
        ..Config::default()
    }
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        ..Default::default()
    }
}

#[tokio::main]
async fn main() {
    let sandboxes = arg(1, 10_000);
    let ops = arg(2, 20_000);
    let concurrency = arg(3, 64);
    println!(
        "sbx-actor-bench: {sandboxes} sandboxes, {ops} lifecycle ops, concurrency {concurrency}"
    );

    lifecycle_ratio(ops, concurrency).await;
    startup(sandboxes, concurrency).await;
}

/// Stop/start by id through the actor tree vs on the sim driver directly.
async fn lifecycle_ratio(ops: usize, concurrency: usize) {
    let targets = concurrency;
    // Bare driver.
    let world = SimWorld::new();
    let driver = Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
    let ids: Vec<Uuid> = (0..targets).map(|_| Uuid::new_v4()).collect();
    for (i, id) in ids.iter().enumerate() {
        let request = pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: id.to_string(),
            workspace: "default".into(),
            name: format!("s{i}"),
            spec: Some(pb::SandboxSpec {
                command: vec!["sleep".into()],
                ..Default::default()
            }),
            generation: 1,
            stopped: false,
        };
        driver.create(request).await.unwrap();
    }
    let started = Instant::now();
    futures::stream::iter(ids.iter().copied().enumerate())
        .for_each_concurrent(concurrency, |(_, id)| {
            let driver = Arc::clone(&driver);
            async move {
                let mut generation = 1;
                for k in 0..ops / targets {
                    if k % 2 == 0 {
                        driver
                            .stop(pb::StopRequest {
                                sandbox_id: id.to_string(),
                                grace_period_ms: 0,
                            })
                            .await
                            .unwrap();
                    } else {
                        generation += 1;
                        driver
                            .start(pb::StartRequest {
                                run_env: Default::default(),
                                sandbox_id: id.to_string(),
                                generation,
                            })
                            .await
                            .unwrap();
                    }
                }
            }
        })
        .await;
    let bare = started.elapsed();
    let done = (ops / targets) * targets;
    let bare_rate = done as f64 / bare.as_secs_f64();

    // Through the actor tree, on a durable store.
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
    let world = SimWorld::new();
    let driver = Arc::new(SimDriver::new(world, SimFaults::default()));
    let gw = Gateway::start(store, DriverSet::single("sim", driver), config())
        .await
        .unwrap();
    let mut sels = Vec::new();
    for i in 0..targets {
        let sb = gw
            .create_sandbox(None, &format!("s{i}"), spec())
            .await
            .unwrap();
        sels.push(SandboxSelector::Id(Uuid::parse_str(&sb.id).unwrap()));
    }
    for sel in &sels {
        while gw.get_sandbox(sel).await.unwrap().phase() != sbx_proto::v1::Phase::Ready {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let gw = Arc::new(gw);
    let started = Instant::now();
    futures::stream::iter(sels.clone())
        .for_each_concurrent(concurrency, |sel| {
            let gw = Arc::clone(&gw);
            async move {
                for k in 0..ops / targets {
                    if k % 2 == 0 {
                        gw.stop_sandbox(&sel).await.unwrap();
                    } else {
                        gw.start_sandbox(&sel).await.unwrap();
                    }
                }
            }
        })
        .await;
    let actors = started.elapsed();
    let actor_rate = done as f64 / actors.as_secs_f64();
    println!(
        "lifecycle ops/s (stop+start by id, {concurrency} concurrent, {done} ops): bare sim driver {bare_rate:.0}/s ({bare:?}), \
         through the actor tree with durable writes {actor_rate:.0}/s ({actors:?}); actor tree / bare = {:.4} (bare is {:.0}x faster)",
        actor_rate / bare_rate,
        bare_rate / actor_rate
    );
    if let Ok(gw) = Arc::try_unwrap(gw) {
        gw.shutdown().await;
    }
}

/// Creates `n` sandboxes, then starts a fresh gateway on the same store and machine and times
/// the load and re-attach; resident memory is read before and after.
async fn startup(n: usize, concurrency: usize) {
    let dir = tempfile::tempdir().unwrap();
    let world = SimWorld::new();
    {
        let store: Arc<dyn ObjectStore> =
            Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
        let driver = Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
        let gw = Arc::new(
            Gateway::start(
                Arc::clone(&store),
                DriverSet::single("sim", driver),
                config(),
            )
            .await
            .unwrap(),
        );
        let started = Instant::now();
        futures::stream::iter(0..n)
            .for_each_concurrent(concurrency, |i| {
                let gw = Arc::clone(&gw);
                async move {
                    gw.create_sandbox(None, &format!("sb-{i}"), spec())
                        .await
                        .unwrap();
                }
            })
            .await;
        let created = started.elapsed();
        // Wait until every workload runs.
        while world.running_ids().len() < n {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        println!(
            "created {n} sandboxes in {created:?} ({:.0}/s acknowledged), all running after {:?}",
            n as f64 / created.as_secs_f64(),
            started.elapsed()
        );
        match Arc::try_unwrap(gw) {
            Ok(gw) => assert!(
                gw.shutdown_within(Duration::from_secs(60)).await,
                "actors let go of the store"
            ),
            Err(_) => panic!("the gateway is still shared"),
        }
    }

    let store: Arc<dyn ObjectStore> = Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
    let listed = store
        .list(ListQuery::new(Kind::Sandbox, Scope::All, 0))
        .await
        .unwrap()
        .records
        .len();
    assert_eq!(listed, n, "every sandbox is in the store");
    let driver = Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
    world.clear_audit();
    let rss_before = resident_bytes().unwrap_or(0);
    let started = Instant::now();
    let gw = Gateway::start(store, DriverSet::single("sim", driver), config())
        .await
        .unwrap();
    assert!(
        gw.wait_attached(Duration::from_secs(600)).await,
        "re-attach did not finish"
    );
    let attach = started.elapsed();
    let rss_after = resident_bytes().unwrap_or(0);
    let gets = world.audit().len();
    let per_actor = rss_after.saturating_sub(rss_before) as f64 / n as f64;
    println!(
        "startup: loaded and re-attached {n} sandboxes in {attach:?} ({:.0}/s; {gets} driver calls); \
         resident memory {} MiB -> {} MiB, {per_actor:.0} bytes per idle sandbox actor (store cache included)",
        n as f64 / attach.as_secs_f64(),
        rss_before / (1024 * 1024),
        rss_after / (1024 * 1024),
    );
    let sample = gw
        .list_sandboxes(&Default::default(), 5, "")
        .await
        .unwrap()
        .items;
    assert!(
        sample
            .iter()
            .all(|s| s.phase() == sbx_proto::v1::Phase::Ready && s.reason.is_empty()),
        "re-attach kept every sandbox as it was"
    );
    gw.shutdown().await;
}
