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
