//! The driver conformance suite through [`RemoteDriver`] against an in-process [`serve`] of
//! the sim driver: `kill` aborts the server task (its connections die with it), `open`
//! serves a new sim driver on the same `SimWorld` and socket. Then every [`DriverError`]
//! variant is sent through the socket, as a unary answer and as a stream item, and must come
//! back unchanged.

#[macro_use]
mod sim_support;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use sbx_drivers::conformance::{self, DriverHarness};
use sbx_drivers::remote::{RemoteDriver, serve};
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, DriverStream, pb};
use tokio::task::JoinHandle;

const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Serves `driver` on `socket` in a task; waits (bounded) until a client gets an answer.
async fn spawn_server(
    driver: Arc<dyn ComputeDriver>,
    socket: PathBuf,
) -> (JoinHandle<Result<(), DriverError>>, RemoteDriver) {
    let serve_on = socket.clone();
    let server =
        tokio::spawn(async move { serve(driver, &serve_on, std::future::pending()).await });
    let remote = RemoteDriver::connect_lazy(socket, CALL_TIMEOUT);
    for _ in 0..250 {
        if remote.capabilities().await.is_ok() {
            return (server, remote);
        }
        if server.is_finished() {
            panic!("the server ended before answering: {:?}", server.await);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the server did not answer within 5 s");
}

struct RemoteSimHarness {
    world: SimWorld,
    /// Holds the socket.
    dir: tempfile::TempDir,
    /// The task serving the current instance; aborted by `kill` and on drop.
    server: Mutex<Option<JoinHandle<Result<(), DriverError>>>>,
}

impl RemoteSimHarness {
    fn new() -> Self {
        RemoteSimHarness {
            world: SimWorld::new(),
            dir: tempfile::tempdir().unwrap(),
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

impl Drop for RemoteSimHarness {
    fn drop(&mut self) {
        if let Some(server) = self.server.lock().unwrap().take() {
            server.abort();
        }
    }
}

#[async_trait]
impl DriverHarness for RemoteSimHarness {
    sim_harness_answers!();

    async fn open(&self) -> Arc<dyn ComputeDriver> {
        self.abort_server().await;
        let sim = Arc::new(SimDriver::new(self.world.clone(), SimFaults::default()));
        let (server, remote) = spawn_server(sim, self.dir.path().join("sim.sock")).await;
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

sbx_drivers::conformance_suite! {
    #[tokio::test]
    harness: RemoteSimHarness::new(),
}

#[tokio::test]
async fn run_all_on_one_shared_world_leaves_it_empty() {
    let h = RemoteSimHarness::new();
    conformance::run_all(&h).await;
    let leftovers = SimDriver::new(h.world.clone(), SimFaults::default())
        .list()
        .await
        .unwrap();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

/// A driver that answers every call with the error it is told to, and whose exec stream
/// yields one stdout chunk and then that error.
struct ErrorDriver {
    next: Mutex<DriverError>,
}

impl ErrorDriver {
    fn fail(&self) -> DriverError {
        self.next.lock().unwrap().clone()
    }
}

#[async_trait]
impl ComputeDriver for ErrorDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        // Answers, so that the test's readiness probe can tell when the server is up.
        Ok(pb::CapabilitiesResponse::default())
    }
    async fn create(&self, _: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        Err(self.fail())
    }
    async fn start(&self, _: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        Err(self.fail())
    }
    async fn stop(&self, _: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        Err(self.fail())
    }
    async fn delete(&self, _: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        Err(self.fail())
    }
    async fn get(&self, _: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        Err(self.fail())
    }
    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        Err(self.fail())
    }
    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        Err(self.fail())
    }
    async fn exec_io(
        &self,
        _: pb::ExecRequest,
        _: sbx_drivers::ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let chunk = pb::ExecOutput {
            chunk: Some(pb::exec_output::Chunk::Stdout(b"partial".to_vec())),
        };
        Ok(Box::pin(futures::stream::iter([
            Ok(chunk),
            Err(self.fail()),
        ])))
    }
    async fn logs(&self, _: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        Err(self.fail())
    }
}

fn every_variant() -> Vec<DriverError> {
    let id = "6f1c4f6e-0d7a-4c57-a7a4-5d0a7a1f1c2e".to_string();
    vec![
        DriverError::InvalidArgument("sandbox_id is empty".into()),
        DriverError::NotFound {
            sandbox_id: id.clone(),
        },
        DriverError::GenerationMismatch {
            sandbox_id: id,
            running: 41,
            requested: 42,
        },
        DriverError::FailedPrecondition("the sandbox is stopped".into()),
        DriverError::Unimplemented("logs".into()),
        DriverError::Unavailable("the machine is away".into()),
        DriverError::DeadlineExceeded {
            operation: "stop",
            after: Duration::from_millis(1_234),
        },
        DriverError::Internal("disk full: ünïcode ✓".into()),
    ]
}

#[tokio::test]
async fn every_driver_error_crosses_the_socket_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let driver = Arc::new(ErrorDriver {
        next: Mutex::new(DriverError::Internal("unset".into())),
    });
    let (server, remote) = spawn_server(driver.clone(), dir.path().join("e.sock")).await;
    let id = "6f1c4f6e-0d7a-4c57-a7a4-5d0a7a1f1c2e".to_string();
    for err in every_variant() {
        *driver.next.lock().unwrap() = err.clone();
        let get = remote.get(pb::GetRequest {
            sandbox_id: id.clone(),
        });
        assert_eq!(get.await.unwrap_err(), err, "get");
        let start = remote.start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: id.clone(),
            generation: 42,
        });
        assert_eq!(start.await.unwrap_err(), err, "start");
        assert_eq!(remote.list().await.unwrap_err(), err, "list");
        assert_eq!(remote.watch().await.err(), Some(err.clone()), "watch");

        let exec = pb::ExecRequest {
            sandbox_id: id.clone(),
            command: vec!["true".into()],
            ..Default::default()
        };
        let items: Vec<_> = remote.exec(exec).await.unwrap().collect().await;
        assert_eq!(items.len(), 2, "{items:?}");
        assert!(
            matches!(&items[0], Ok(pb::ExecOutput { chunk: Some(pb::exec_output::Chunk::Stdout(b)) }) if b == b"partial"),
            "{items:?}"
        );
        assert_eq!(items[1].as_ref().err(), Some(&err), "exec stream item");
    }
    server.abort();
}
