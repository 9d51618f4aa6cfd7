//! The client's channel: a host that is down answers `Unavailable` within the call's
//! deadline, and the same client works again once a host listens; a host whose driver hangs
//! answers `DeadlineExceeded` at the deadline while other calls on the same channel go on.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_drivers::remote::{RemoteDriver, serve};
use sbx_drivers::sim::{SimDriver, SimFaults, SimOp, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, pb};
use tokio::task::JoinHandle;

/// A server task that is aborted when the guard is dropped (also when a test fails).
struct ServerTask(Option<JoinHandle<Result<(), DriverError>>>);

impl Drop for ServerTask {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

impl ServerTask {
    /// Serves `driver` on `socket`; returns once it answers a probe of its own (bounded).
    async fn start(driver: Arc<dyn ComputeDriver>, socket: &Path) -> ServerTask {
        let at = socket.to_path_buf();
        let task = tokio::spawn(async move { serve(driver, &at, std::future::pending()).await });
        let probe = RemoteDriver::connect_lazy(socket.to_path_buf(), Duration::from_secs(1));
        for _ in 0..250 {
            if probe.capabilities().await.is_ok() {
                return ServerTask(Some(task));
            }
            assert!(!task.is_finished(), "the server ended: {:?}", task.await);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        task.abort();
        panic!("the server did not bind {} within 5 s", socket.display());
    }

    /// Aborts the task and waits (bounded) until it is gone.
    async fn kill(mut self) {
        let Some(task) = self.0.take() else { return };
        task.abort();
        let ended = tokio::time::timeout(Duration::from_secs(5), task).await;
        assert!(
            matches!(ended, Ok(Err(ref e)) if e.is_cancelled()),
            "{ended:?}"
        );
    }
}

fn sim(world: &SimWorld, faults: SimFaults) -> Arc<dyn ComputeDriver> {
    Arc::new(SimDriver::new(world.clone(), faults))
}

fn socket_in(dir: &tempfile::TempDir) -> PathBuf {
    dir.path().join("driver.sock")
}

/// Calls `capabilities`, returning the answer and how long it took.
async fn timed_capabilities(
    driver: &RemoteDriver,
) -> (Result<pb::CapabilitiesResponse, DriverError>, Duration) {
    let started = Instant::now();
    let answer = driver.capabilities().await;
    (answer, started.elapsed())
}

#[tokio::test]
async fn a_client_without_a_server_answers_unavailable_in_time_then_reconnects() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let deadline = Duration::from_secs(2);
    let client = RemoteDriver::connect_lazy(socket.clone(), deadline);

    // Nobody ever listened: no socket file at all.
    for _ in 0..3 {
        let (answer, took) = timed_capabilities(&client).await;
        assert!(
            matches!(answer, Err(DriverError::Unavailable(_))),
            "{answer:?}"
        );
        assert!(took < deadline, "Unavailable took {took:?}");
    }

    // A host comes up: the same client answers, with no reconnect of its own.
    let world = SimWorld::new();
    let server = ServerTask::start(sim(&world, SimFaults::default()), &socket).await;
    let (answer, _) = timed_capabilities(&client).await;
    assert_eq!(answer.unwrap().driver, "sim");

    // The host is killed: its socket file stays behind, stale.
    server.kill().await;
    assert!(socket.exists());
    let (answer, took) = timed_capabilities(&client).await;
    assert!(
        matches!(answer, Err(DriverError::Unavailable(_))),
        "{answer:?}"
    );
    assert!(took < deadline, "Unavailable took {took:?}");

    // A new host on the same socket (and the same world): the client finds it again, and
    // with it the sandbox made through the first host.
    let server = ServerTask::start(sim(&world, SimFaults::default()), &socket).await;
    let id = uuid::Uuid::new_v4().to_string();
    let created = client
        .create(pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: id.clone(),
            workspace: "ws".into(),
            name: "back".into(),
            spec: Some(pb::SandboxSpec {
                command: vec!["sleep".into()],
                ..Default::default()
            }),
            generation: 1,
            stopped: false,
        })
        .await
        .unwrap();
    assert_eq!(created.sandbox_id, id);
    server.kill().await;
    let server = ServerTask::start(sim(&world, SimFaults::default()), &socket).await;
    let found = client
        .get(pb::GetRequest {
            sandbox_id: id.clone(),
        })
        .await
        .unwrap();
    assert_eq!((found.name.as_str(), found.generation), ("back", 1));
    drop(server);
}

#[tokio::test]
async fn a_hanging_driver_answers_deadline_exceeded_and_the_channel_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let world = SimWorld::new();
    let faults = SimFaults::default().with_hang_on(SimOp::Get);
    let _server = ServerTask::start(sim(&world, faults), &socket).await;
    let deadline = Duration::from_millis(600);
    let client = RemoteDriver::connect_lazy(socket, deadline);
    client.capabilities().await.unwrap();

    let hanging = {
        let client = client.clone();
        tokio::spawn(async move {
            let started = Instant::now();
            let answer = client
                .get(pb::GetRequest {
                    sandbox_id: uuid::Uuid::new_v4().to_string(),
                })
                .await;
            (answer, started.elapsed())
        })
    };
    // While the get hangs, other calls on the same channel answer, quickly.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for _ in 0..5 {
        let (answer, took) = timed_capabilities(&client).await;
        assert!(answer.is_ok(), "{answer:?}");
        assert!(took < Duration::from_millis(300), "{took:?}");
    }
    assert!(!hanging.is_finished(), "the hung get answered early");

    let (answer, took) = tokio::time::timeout(Duration::from_secs(5), hanging)
        .await
        .expect("the client's deadline did not fire")
        .unwrap();
    assert_eq!(
        answer.unwrap_err(),
        DriverError::DeadlineExceeded {
            operation: "get",
            after: deadline
        }
    );
    assert!(took >= deadline, "answered before the deadline: {took:?}");
    assert!(took < deadline + Duration::from_millis(500), "{took:?}");

    // After the deadline, the channel still works.
    assert!(client.list().await.unwrap().is_empty());
    let get_calls = world.audit().iter().filter(|e| e.op == SimOp::Get).count();
    assert_eq!(get_calls, 1, "the get reached the driver exactly once");
}

/// Sets its flag when dropped: tells that a driver call's future was abandoned.
struct DropFlag(Arc<std::sync::atomic::AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// The sim, except that `stop` never answers and says when its call is abandoned.
struct HangingStop {
    sim: SimDriver,
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl ComputeDriver for HangingStop {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        self.sim.capabilities().await
    }
    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        self.sim.create(req).await
    }
    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        self.sim.start(req).await
    }
    async fn stop(&self, _: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let _flag = DropFlag(self.abandoned.clone());
        std::future::pending().await
    }
    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        self.sim.delete(req).await
    }
    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        self.sim.get(req).await
    }
    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        self.sim.list().await
    }
    async fn watch(&self) -> Result<sbx_drivers::DriverStream<pb::WatchEvent>, DriverError> {
        self.sim.watch().await
    }
    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: sbx_drivers::ExecInputStream,
    ) -> Result<sbx_drivers::DriverStream<pb::ExecOutput>, DriverError> {
        self.sim.exec_io(req, input).await
    }
    async fn logs(
        &self,
        req: pb::LogsRequest,
    ) -> Result<sbx_drivers::DriverStream<pb::LogChunk>, DriverError> {
        self.sim.logs(req).await
    }
}

#[tokio::test]
async fn the_host_abandons_a_call_whose_deadline_passed() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let driver = Arc::new(HangingStop {
        sim: SimDriver::new(SimWorld::new(), SimFaults::default()),
        abandoned: abandoned.clone(),
    });
    let _server = ServerTask::start(driver, &socket).await;
    let deadline = Duration::from_millis(300);
    let client = RemoteDriver::connect_lazy(socket, deadline);
    let answer = client
        .stop(pb::StopRequest {
            sandbox_id: uuid::Uuid::new_v4().to_string(),
            grace_period_ms: 0,
        })
        .await;
    assert!(
        matches!(
            answer,
            Err(DriverError::DeadlineExceeded {
                operation: "stop",
                ..
            })
        ),
        "{answer:?}"
    );
    let mut seen = false;
    for _ in 0..100 {
        if abandoned.load(std::sync::atomic::Ordering::SeqCst) {
            seen = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(seen, "the host still runs the call its client gave up on");
    assert!(client.list().await.unwrap().is_empty());
}

#[tokio::test]
async fn many_concurrent_calls_share_one_channel() {
    let dir = tempfile::tempdir().unwrap();
    let socket = socket_in(&dir);
    let world = SimWorld::new();
    let faults = SimFaults::default().with_latency(Duration::from_millis(50));
    let _server = ServerTask::start(sim(&world, faults), &socket).await;
    let client = RemoteDriver::connect_lazy(socket, Duration::from_secs(10));
    let calls = 400;
    let started = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..calls {
        let client = client.clone();
        tasks.spawn(async move {
            let id = uuid::Uuid::new_v4().to_string();
            let created = client
                .create(pb::CreateRequest {
                    run_env: Default::default(),
                    sandbox_id: id.clone(),
                    workspace: "ws".into(),
                    name: format!("n{i}"),
                    spec: Some(pb::SandboxSpec {
                        command: vec!["sleep".into()],
                        ..Default::default()
                    }),
                    generation: 1,
                    stopped: false,
                })
                .await
                .unwrap();
            assert_eq!((created.sandbox_id, created.name), (id, format!("n{i}")));
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    // Each call waits 50 ms in the driver: in flight together, they take far less than
    // 400 × 50 ms = 20 s.
    let took = started.elapsed();
    assert!(took < Duration::from_secs(5), "{calls} calls took {took:?}");
    assert_eq!(client.list().await.unwrap().len(), calls);
}
