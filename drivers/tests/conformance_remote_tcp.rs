//! The driver conformance suite through [`RemoteDriver::connect_tcp_lazy`] against an
//! in-process [`serve_node`] of the sim driver on 127.0.0.1 (what `sbxd node` serves, without
//! TLS): every call and stream of the contract — exec with stdin and a terminal, copies both
//! ways, port forwarding — over TCP. `kill` aborts the server task, `open` serves a new sim
//! driver on the same `SimWorld` on a new port. `sbxd node` itself (its flags, mutual TLS, the
//! node id) is tested black box in gateway/tests/node_host.rs.

#[macro_use]
mod sim_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use sbx_drivers::conformance::{self, DriverHarness};
use sbx_drivers::remote::{NodeIdentity, RemoteDriver, serve, serve_node};
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, pb};
use tokio::task::JoinHandle;

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

fn identity() -> NodeIdentity {
    NodeIdentity {
        node_id: "2c5e1c3e-8b0e-4d0a-9c59-3d1b1f7f8a10".to_string(),
        name: "node-a".to_string(),
        version: "0.0.0-test".to_string(),
        drivers: vec!["sim".to_string()],
        labels: HashMap::from([("zone".to_string(), "a".to_string())]),
        capacity: pb::Capacity {
            cpu_millicores: 4000,
            memory_bytes: 8 << 30,
            disk_bytes: 100 << 30,
            max_sandboxes: 10,
        },
    }
}

/// Serves `driver` as a node on 127.0.0.1:0 in a task; waits (bounded) until a client over
/// TCP gets an answer.
async fn spawn_node(
    driver: Arc<dyn ComputeDriver>,
) -> (JoinHandle<Result<(), DriverError>>, RemoteDriver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let fences = sbx_drivers::remote::fence::Fences::open(dir.path()).unwrap();
    let server = tokio::spawn(async move {
        // The fences' directory lives as long as the node.
        let _dir = dir;
        serve_node(
            driver,
            identity(),
            fences,
            None,
            listener,
            None,
            std::future::pending(),
        )
        .await
    });
    let remote = RemoteDriver::connect_tcp_lazy(&addr, None, CALL_TIMEOUT).unwrap();
    for _ in 0..250 {
        if remote.capabilities().await.is_ok() {
            return (server, remote);
        }
        if server.is_finished() {
            panic!("the node ended before answering: {:?}", server.await);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the node did not answer within 5 s");
}

struct TcpSimHarness {
    world: SimWorld,
    /// The task serving the current instance; aborted by `kill` and on drop.
    server: Mutex<Option<JoinHandle<Result<(), DriverError>>>>,
}

impl TcpSimHarness {
    fn new() -> Self {
        TcpSimHarness {
            world: SimWorld::new(),
            server: Mutex::new(None),
        }
    }

    async fn abort_server(&self) {
        let server = self.server.lock().unwrap().take();
        if let Some(server) = server {
            server.abort();
            let ended = tokio::time::timeout(Duration::from_secs(5), server).await;
            assert!(
                matches!(ended, Ok(Err(ref e)) if e.is_cancelled()),
                "{ended:?}"
            );
        }
    }
}

impl Drop for TcpSimHarness {
    fn drop(&mut self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
    }
}

#[async_trait]
impl DriverHarness for TcpSimHarness {
    sim_harness_answers!();

    async fn open(&self) -> Arc<dyn ComputeDriver> {
        self.abort_server().await;
        let sim = Arc::new(SimDriver::new(self.world.clone(), SimFaults::default()));
        let (server, remote) = spawn_node(sim).await;
        *self.server.lock().unwrap() = Some(server);
        Arc::new(remote)
    }

    async fn kill(&self, driver: Arc<dyn ComputeDriver>) {
        drop(driver);
        self.abort_server().await;
    }

    fn call_timeout(&self) -> Duration {
        CALL_TIMEOUT
    }
}

#[tokio::test]
async fn run_all_over_tcp_leaves_the_world_empty() {
    let h = TcpSimHarness::new();
    conformance::run_all(&h).await;
    let leftovers = SimDriver::new(h.world.clone(), SimFaults::default())
        .list()
        .await
        .unwrap();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn node_info_says_what_the_node_is_and_counts_its_sandboxes() {
    let world = SimWorld::new();
    let sim = Arc::new(SimDriver::new(world, SimFaults::default()));
    let (server, remote) = spawn_node(sim).await;
    let info = remote.node_info().await.unwrap();
    let expected = identity();
    assert_eq!(info.node_id, expected.node_id);
    assert_eq!(info.name, "node-a");
    assert_eq!(info.drivers, ["sim"]);
    assert_eq!(info.labels, expected.labels);
    assert_eq!(info.capacity, Some(expected.capacity));
    assert_eq!(info.sandboxes, 0);
    remote
        .create(pb::CreateRequest {
            sandbox_id: uuid::Uuid::new_v4().to_string(),
            workspace: "default".into(),
            name: "one".into(),
            generation: 1,
            spec: Some(pb::SandboxSpec {
                command: vec!["sleep".into(), "3600".into()],
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(remote.node_info().await.unwrap().sandboxes, 1);

    // Nothing answers once the node is gone: Unavailable, within the deadline.
    server.abort();
    let _ = server.await;
    drop(remote);
    let gone = RemoteDriver::connect_tcp_lazy(
        &format!("127.0.0.1:{}", free_port()),
        None,
        Duration::from_secs(2),
    )
    .unwrap();
    let began = std::time::Instant::now();
    let err = gone.node_info().await.unwrap_err();
    assert!(matches!(err, DriverError::Unavailable(_)), "{err}");
    assert!(
        began.elapsed() < Duration::from_secs(3),
        "{:?}",
        began.elapsed()
    );
}

#[tokio::test]
async fn a_driver_host_on_a_socket_serves_no_node_service() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("sim.sock");
    let sim: Arc<dyn ComputeDriver> =
        Arc::new(SimDriver::new(SimWorld::new(), SimFaults::default()));
    let serve_on = socket.clone();
    let server = tokio::spawn(async move { serve(sim, &serve_on, std::future::pending()).await });
    let remote = RemoteDriver::connect_lazy(socket.clone(), CALL_TIMEOUT);
    assert_eq!(remote.socket(), Some(socket.as_path()));
    for _ in 0..250 {
        if remote.capabilities().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = remote.node_info().await.unwrap_err();
    assert!(matches!(err, DriverError::Unimplemented(_)), "{err}");
    server.abort();
}

/// A port nothing listens on (bound, then closed).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}
