//! The store's cost on creates, sled against PostgreSQL, in the same run. Ignored by default;
//! run in release mode:
//!
//! ```text
//! cargo test --release -p sbx-gateway --test store_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! - creates through sbxd (sim driver, gRPC, 16 at once): creates/s and the latency of each
//!   acknowledged create (p50, p99), on the embedded sled store and on PostgreSQL (a server
//!   of the test's own, Debian's defaults: fsync on, synchronous commit), alternating rounds;
//! - the same against the store alone (`ObjectStore::create` of sandbox records, 16 at once),
//!   to say how much of the difference is the store.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd};
use futures::StreamExt;
use sbx_proto::v1::{CreateSandboxRequest, SandboxSpec};
use sbx_storage::conformance::postgres_server::TestPostgres;
use sbx_storage::conformance::{new_sandbox, new_workspace};
use sbx_storage::{ObjectStore, PgStore, SledStore};

const CREATES: usize = 600;
const CONCURRENCY: usize = 16;
const ROUNDS: usize = 3;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

struct Figures {
    per_second: f64,
    p50: Duration,
    p99: Duration,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.0}/s, p50 {:.2?}, p99 {:.2?}",
            self.per_second, self.p50, self.p99
        )
    }
}

/// Runs `CREATES` calls of `one`, `CONCURRENCY` at once; each call's latency.
async fn measure<F, Fut>(one: F) -> Figures
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let began = Instant::now();
    let mut latencies: Vec<Duration> = futures::stream::iter(0..CREATES)
        .map(|i| {
            let call = one(i);
            async move {
                let t = Instant::now();
                call.await;
                t.elapsed()
            }
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let took = began.elapsed();
    latencies.sort();
    Figures {
        per_second: CREATES as f64 / took.as_secs_f64(),
        p50: percentile(&latencies, 0.5),
        p99: percentile(&latencies, 0.99),
    }
}

/// Creates through an sbxd started with `extra` (a store flag, or none).
async fn through_sbxd(data: &std::path::Path, extra: &[&str]) -> Figures {
    let mut args = vec!["--log-format", "json", "--reconcile-interval", "15"];
    args.extend(extra);
    let mut d = Sbxd::start(data, "sim", &args);
    let client = d.sandboxes().await;
    let round = common::unique();
    let figures = measure(|i| {
        let mut client = client.clone();
        let name = format!("b{i}-{round}");
        async move {
            client
                .create_sandbox(CreateSandboxRequest {
                    name,
                    spec: Some(SandboxSpec {
                        command: vec!["sleep".into(), "1000".into()],
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
    })
    .await;
    d.sigterm(Duration::from_secs(60));
    figures
}

/// Sandbox records straight into `store`.
async fn into_store(store: Arc<dyn ObjectStore>) -> Figures {
    let ws = store
        .create(new_workspace(&format!("w{}", common::unique())))
        .await
        .unwrap();
    measure(|i| {
        let store = Arc::clone(&store);
        async move {
            store
                .create(new_sandbox(ws.id, &format!("s{i}")))
                .await
                .unwrap();
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with --release -- --ignored"]
async fn creates_on_sled_vs_postgres() {
    let server = TestPostgres::start().expect("a PostgreSQL server");
    for round in 0..ROUNDS {
        let sled_data = DataDir::new();
        let sled = through_sbxd(sled_data.path(), &[]).await;
        let db = format!("bench{round}");
        server.create_database(&db).await.unwrap();
        let pw = DataDir::new();
        let pw_file = pw.path().join("pw");
        std::fs::write(&pw_file, server.password()).unwrap();
        let url = server.url(&db);
        let pg_data = DataDir::new();
        let pg = through_sbxd(
            pg_data.path(),
            &[
                "--store",
                &url,
                "--store-password-file",
                pw_file.to_str().unwrap(),
            ],
        )
        .await;
        println!(
            "round {round}: {CREATES} creates through sbxd, {CONCURRENCY} at once, sim driver: \
             sled {sled}; PostgreSQL {pg}; creates/s sled/PostgreSQL {:.2}, p99 \
             PostgreSQL/sled {:.2}",
            sled.per_second / pg.per_second,
            pg.p99.as_secs_f64() / sled.p99.as_secs_f64()
        );

        let dir = DataDir::new();
        let sled_store: Arc<dyn ObjectStore> =
            Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
        let sled = into_store(sled_store).await;
        let db = format!("store{round}");
        server.create_database(&db).await.unwrap();
        let pg_store: Arc<dyn ObjectStore> =
            Arc::new(PgStore::connect(server.config(&db)).await.unwrap());
        let pg = into_store(pg_store).await;
        println!(
            "round {round}: {CREATES} sandbox records into the store alone, {CONCURRENCY} at \
             once: sled {sled}; PostgreSQL {pg}; creates/s sled/PostgreSQL {:.2}",
            sled.per_second / pg.per_second
        );
    }
}

/// Workspaces the gateways share in [`one_vs_three_gateways`] (and "default").
const WORKSPACES: usize = 6;

/// The workspace each create goes to: `i` round-robin over the bench's workspaces.
fn workspace_of(i: usize) -> String {
    format!("w{}", i % WORKSPACES)
}

/// Creates spread over the bench's workspaces, create `i` sent to `endpoints[to(i)]`.
async fn creates_spread(
    endpoints: &[String],
    round: usize,
    to: impl Fn(usize) -> usize,
) -> Figures {
    let mut clients = Vec::new();
    for e in endpoints {
        clients.push(
            sbx_proto::v1::sandbox_service_client::SandboxServiceClient::connect(e.clone())
                .await
                .unwrap(),
        );
    }
    measure(|i| {
        let mut client = clients[to(i)].clone();
        async move {
            client
                .create_sandbox(CreateSandboxRequest {
                    workspace: workspace_of(i),
                    name: format!("c{i}-{round}"),
                    spec: Some(SandboxSpec {
                        command: vec!["sleep".into(), "1000".into()],
                        ..Default::default()
                    }),
                    ..Default::default()
                })
                .await
                .unwrap();
        }
    })
    .await
}

/// The index (in `gateways`) of the holder of each bench workspace, once every workspace is
/// held and none holds more than its share; within 60 s.
async fn holders(store: &dyn ObjectStore, gateways: &[Sbxd]) -> Vec<usize> {
    let began = Instant::now();
    loop {
        let mut held = Vec::new();
        let mut counts = vec![0usize; gateways.len()];
        for w in 0..WORKSPACES {
            let record = store
                .get_by_name(sbx_storage::Kind::Workspace, None, &format!("w{w}"))
                .await
                .unwrap()
                .unwrap();
            let holder = sbx_actors::ownership::holder_of(store, record.id)
                .await
                .unwrap();
            let at = holder.and_then(|(_, address)| {
                gateways
                    .iter()
                    .position(|g| g.endpoint() == format!("http://{address}"))
            });
            if let Some(at) = at {
                counts[at] += 1;
            }
            held.push(at);
        }
        let share = (WORKSPACES + 1).div_ceil(gateways.len());
        if held.iter().all(Option::is_some) && counts.iter().all(|c| *c <= share) {
            return held.into_iter().flatten().collect();
        }
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "not spread: {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One gateway against three on one PostgreSQL (sim driver, the same creates spread over six
/// workspaces, 16 at once): three gateways each serve a share of the workspaces; the creates
/// go to each workspace's holder, and, separately, round-robin to any gateway (two in three
/// forwarded). Ignored; see the file's doc for how to run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with --release -- --ignored"]
async fn one_vs_three_gateways() {
    let store = common::ha::SharedStore::start();
    for round in 0..ROUNDS {
        let mut figures = Vec::new();
        for gateways in [1usize, 3] {
            let url = store.database(&format!("gw{gateways}r{round}")).await;
            let datas: Vec<DataDir> = (0..gateways).map(|_| DataDir::new()).collect();
            let extra = [
                "--log-format",
                "json",
                "--reconcile-interval",
                "15",
                "--lease-seconds",
                "3",
            ];
            let mut running: Vec<Sbxd> = datas
                .iter()
                .map(|d| store.gateway(d.path(), &url, &extra))
                .collect();
            let mut ws = running[0].workspaces().await;
            for w in 0..WORKSPACES {
                ws.create_workspace(sbx_proto::v1::CreateWorkspaceRequest {
                    name: format!("w{w}"),
                    ..Default::default()
                })
                .await
                .unwrap();
            }
            let pg: Arc<dyn ObjectStore> = Arc::new(
                PgStore::connect(store.server.config(&format!("gw{gateways}r{round}")))
                    .await
                    .unwrap(),
            );
            let held = holders(&*pg, &running).await;
            let endpoints: Vec<String> = running.iter().map(|g| g.endpoint()).collect();
            let direct = creates_spread(&endpoints, round, |i| held[i % WORKSPACES]).await;
            let any = creates_spread(&endpoints, round + 100, |i| i % gateways).await;
            figures.push((gateways, direct, any));
            for g in &mut running {
                g.sigterm(Duration::from_secs(60));
            }
        }
        let (_, one, _) = &figures[0];
        let (_, three, three_any) = &figures[1];
        println!(
            "round {round}: {CREATES} creates over {WORKSPACES} workspaces, {CONCURRENCY} at once, \
             sim driver, PostgreSQL: 1 gateway {one}; 3 gateways, each create to its workspace's \
             holder {three}; 3 gateways, round-robin (2 in 3 forwarded) {three_any}; creates/s \
             3/1 {:.2} (holder), {:.2} (round-robin)",
            three.per_second / one.per_second,
            three_any.per_second / one.per_second
        );
    }
}
