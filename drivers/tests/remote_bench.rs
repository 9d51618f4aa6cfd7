//! What the socket costs: the same sim driver called in process and through `RemoteDriver` →
//! Unix socket → `serve`, interleaved in one run so the machine's load hits both alike.
//! Ignored by default; run with
//!
//! ```text
//! cargo test -p sbx-drivers --test remote_bench -- --ignored --nocapture
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_drivers::remote::{RemoteDriver, serve};
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, pb};

const ROUNDS: usize = 20;
const CALLS_PER_ROUND: usize = 100;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Times `CALLS_PER_ROUND` sequential calls of `call` on `driver`, adding each to `samples`.
async fn time_calls<F>(driver: &dyn ComputeDriver, samples: &mut Vec<Duration>, call: F)
where
    F: AsyncFn(&dyn ComputeDriver),
{
    for _ in 0..CALLS_PER_ROUND {
        let began = Instant::now();
        call(driver).await;
        samples.push(began.elapsed());
    }
}

fn report(what: &str, local: &mut [Duration], remote: &mut [Duration]) {
    local.sort();
    remote.sort();
    let (l50, r50) = (percentile(local, 0.5), percentile(remote, 0.5));
    let (l99, r99) = (percentile(local, 0.99), percentile(remote, 0.99));
    println!(
        "{what:<12} n={:<5} in-process p50 {:>8.1} µs p99 {:>8.1} µs | remote p50 {:>8.1} µs p99 {:>8.1} µs | remote − in-process p50 {:>8.1} µs",
        local.len(),
        us(l50),
        us(l99),
        us(r50),
        us(r99),
        us(r50.saturating_sub(l50)),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with --ignored --nocapture"]
async fn remote_call_overhead_against_in_process() {
    let world = SimWorld::new();
    let local = SimDriver::new(world.clone(), SimFaults::default());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("bench.sock");
    let served: Arc<dyn ComputeDriver> =
        Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
    let at = socket.clone();
    let server = tokio::spawn(async move { serve(served, &at, std::future::pending()).await });
    let remote = RemoteDriver::connect_lazy(socket, Duration::from_secs(5));
    let mut ready = false;
    for _ in 0..250 {
        if remote.capabilities().await.is_ok() {
            ready = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(ready, "the server did not answer");

    let id = uuid::Uuid::new_v4().to_string();
    let create = pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.clone(),
        workspace: "bench".into(),
        name: "bench".into(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into()],
            ..Default::default()
        }),
        generation: 1,
        stopped: false,
    };
    local.create(create).await.unwrap();

    let get = async |d: &dyn ComputeDriver| {
        let s = d
            .get(pb::GetRequest {
                sandbox_id: id.clone(),
            })
            .await
            .unwrap();
        assert_eq!(s.sandbox_id, id);
    };
    let exec = async |d: &dyn ComputeDriver| {
        let req = pb::ExecRequest {
            sandbox_id: id.clone(),
            command: vec!["echo".into(), "hi".into()],
            ..Default::default()
        };
        let items: Vec<_> = d.exec(req).await.unwrap().collect().await;
        assert!(
            items.iter().all(|i| i.is_ok()) && items.len() >= 2,
            "{items:?}"
        );
    };

    let (mut get_local, mut get_remote) = (Vec::new(), Vec::new());
    let (mut exec_local, mut exec_remote) = (Vec::new(), Vec::new());
    for _ in 0..ROUNDS {
        time_calls(&local, &mut get_local, get).await;
        time_calls(&remote, &mut get_remote, get).await;
        time_calls(&local, &mut exec_local, exec).await;
        time_calls(&remote, &mut exec_remote, exec).await;
    }
    assert_eq!(get_remote.len(), ROUNDS * CALLS_PER_ROUND);
    report("get", &mut get_local, &mut get_remote);
    report("exec (echo)", &mut exec_local, &mut exec_remote);

    // Throughput: 16 callers sharing the one channel for a fixed number of gets.
    let began = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let remote = remote.clone();
        let id = id.clone();
        tasks.spawn(async move {
            for _ in 0..250 {
                let req = pb::GetRequest {
                    sandbox_id: id.clone(),
                };
                remote.get(req).await.unwrap();
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let took = began.elapsed();
    println!(
        "remote gets, 16 concurrent callers: 4000 in {:.0} ms = {:.0} calls/s",
        took.as_secs_f64() * 1000.0,
        4000.0 / took.as_secs_f64()
    );
    server.abort();
}
