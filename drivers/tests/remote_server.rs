//! The server's socket and lifetime: mode 0600, a stale socket file replaced, a live one or a
//! non-socket refused, a shutdown that lets in-flight calls finish and removes the socket,
//! and an aborted server that takes its connections (and the driver) with it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_drivers::remote::{RemoteDriver, SHUTDOWN_GRACE, serve};
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, pb};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

type ServeTask = JoinHandle<Result<(), DriverError>>;

/// Aborts the server task when dropped, so that a failed test leaves no server behind.
struct AbortOnDrop(Option<ServeTask>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

impl AbortOnDrop {
    fn task(&mut self) -> &mut ServeTask {
        self.0.as_mut().unwrap()
    }
}

fn sim(faults: SimFaults) -> Arc<dyn ComputeDriver> {
    Arc::new(SimDriver::new(SimWorld::new(), faults))
}

/// Serves `driver` on `socket` until `shutdown`; returns once a client gets an answer.
async fn start(
    driver: Arc<dyn ComputeDriver>,
    socket: &Path,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> AbortOnDrop {
    let at = socket.to_path_buf();
    let mut server = AbortOnDrop(Some(tokio::spawn(async move {
        serve(driver, &at, shutdown).await
    })));
    let probe = RemoteDriver::connect_lazy(socket.to_path_buf(), Duration::from_secs(1));
    for _ in 0..250 {
        if probe.capabilities().await.is_ok() {
            return server;
        }
        assert!(
            !server.task().is_finished(),
            "the server ended: {:?}",
            server.0.take().unwrap().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the server did not answer within 5 s");
}

/// Serves on `socket` and expects the call to end at once with an error.
async fn serve_fails(socket: &Path) -> DriverError {
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        serve(sim(SimFaults::default()), socket, std::future::pending()),
    )
    .await
    .expect("serve should have refused at once");
    answer.expect_err("serve should have refused")
}

#[tokio::test]
async fn the_socket_is_private_and_no_temporary_file_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    let _server = start(sim(SimFaults::default()), &socket, std::future::pending()).await;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "mode {mode:o}");
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("d.sock")]);
}

#[tokio::test]
async fn a_stale_socket_file_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(
        socket.exists(),
        "the stale socket file should stay after its listener"
    );
    let _server = start(sim(SimFaults::default()), &socket, std::future::pending()).await;
    let client = RemoteDriver::connect_lazy(socket, Duration::from_secs(2));
    assert_eq!(client.capabilities().await.unwrap().driver, "sim");
}

#[tokio::test]
async fn a_socket_on_which_a_server_answers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    let _first = start(sim(SimFaults::default()), &socket, std::future::pending()).await;
    let refused = serve_fails(&socket).await;
    assert!(
        matches!(&refused, DriverError::FailedPrecondition(m) if m.contains("another driver host answers")),
        "{refused:?}"
    );
    let client = RemoteDriver::connect_lazy(socket, Duration::from_secs(2));
    assert!(client.list().await.is_ok(), "the first server must go on");
}

#[tokio::test]
async fn a_path_that_is_not_a_socket_is_refused_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    std::fs::write(&socket, "precious").unwrap();
    let refused = serve_fails(&socket).await;
    assert!(
        matches!(&refused, DriverError::FailedPrecondition(m) if m.contains("not a socket")),
        "{refused:?}"
    );
    assert_eq!(std::fs::read_to_string(&socket).unwrap(), "precious");
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_call_finish_then_removes_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    let (stop, stopped) = oneshot::channel::<()>();
    let latency = Duration::from_millis(400);
    let mut server = start(
        sim(SimFaults::default().with_latency(latency)),
        &socket,
        async move {
            let _ = stopped.await;
        },
    )
    .await;
    let client = RemoteDriver::connect_lazy(socket.clone(), Duration::from_secs(5));
    let in_flight = tokio::spawn(async move { client.list().await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    stop.send(()).unwrap();
    let served = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(2), server.task())
        .await
        .expect("serve did not return after shutdown")
        .unwrap();
    assert_eq!(served, Ok(()));
    assert!(
        started.elapsed() < SHUTDOWN_GRACE,
        "{:?}",
        started.elapsed()
    );
    assert_eq!(
        in_flight.await.unwrap(),
        Ok(vec![]),
        "the in-flight call must finish"
    );
    assert!(!socket.exists(), "the socket file must be removed");
}

#[tokio::test]
async fn shutdown_cuts_a_stream_that_outlasts_the_grace() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    let (stop, stopped) = oneshot::channel::<()>();
    let mut server = start(sim(SimFaults::default()), &socket, async move {
        let _ = stopped.await;
    })
    .await;
    let client = RemoteDriver::connect_lazy(socket, Duration::from_secs(2));
    let mut watch = client.watch().await.unwrap();
    let started = Instant::now();
    stop.send(()).unwrap();
    let served = tokio::time::timeout(SHUTDOWN_GRACE + Duration::from_secs(2), server.task())
        .await
        .expect("serve did not return within its grace")
        .unwrap();
    assert_eq!(served, Ok(()));
    let took = started.elapsed();
    assert!(
        took >= SHUTDOWN_GRACE,
        "the open watch was not given its grace: {took:?}"
    );
    let end = tokio::time::timeout(Duration::from_secs(2), watch.next())
        .await
        .expect("the watch stream did not end with the server");
    assert!(
        matches!(end, None | Some(Err(DriverError::Unavailable(_)))),
        "{end:?}"
    );
}

#[tokio::test]
async fn an_aborted_server_ends_its_streams_and_releases_the_driver() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("d.sock");
    let driver = sim(SimFaults::default());
    let weak = Arc::downgrade(&driver);
    let mut server = start(driver, &socket, std::future::pending()).await;
    let client = RemoteDriver::connect_lazy(socket.clone(), Duration::from_secs(2));
    let mut watch = client.watch().await.unwrap();
    let logs = client
        .logs(pb::LogsRequest {
            sandbox_id: uuid::Uuid::new_v4().to_string(),
            follow: true,
            tail_lines: 0,
            ..Default::default()
        })
        .await;
    assert!(
        matches!(logs, Err(DriverError::NotFound { .. })),
        "{:?}",
        logs.err()
    );

    server.task().abort();
    let end = tokio::time::timeout(Duration::from_secs(2), watch.next())
        .await
        .expect("the watch stream did not end with the server");
    assert!(
        matches!(end, None | Some(Err(DriverError::Unavailable(_)))),
        "{end:?}"
    );
    let mut released = false;
    for _ in 0..100 {
        if weak.upgrade().is_none() {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(released, "the aborted server still holds the driver");
    assert!(
        socket.exists(),
        "an aborted server leaves its socket file, as a crash would"
    );
    let answer = client.capabilities().await;
    assert!(
        matches!(answer, Err(DriverError::Unavailable(_))),
        "{answer:?}"
    );
}

#[tokio::test]
async fn a_socket_path_too_long_to_bind_is_an_invalid_argument() {
    let dir = tempfile::tempdir().unwrap();
    let long = dir.path().join("s".repeat(110));
    let refused = serve_fails(&long).await;
    assert!(
        matches!(&refused, DriverError::InvalidArgument(m) if m.contains("too long")),
        "{refused:?}"
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        0,
        "nothing made"
    );
}
