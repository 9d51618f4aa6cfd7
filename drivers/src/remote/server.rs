//! The server side: any [`ComputeDriver`] served as `sbx.driver.v1` on a Unix socket.
//!
//! Connections are served by hyper directly (not by `tonic::transport::Server`) so that the
//! serve future *owns* them: dropping it (aborting its task) ends every connection at once,
//! as killing a host process would, and the driver is released with it. Ending it through
//! `shutdown` instead lets in-flight calls finish for [`SHUTDOWN_GRACE`] first.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use tokio::net::{UnixListener, UnixStream};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use super::status::driver_error_to_status;
use crate::pb::driver_server::{Driver, DriverServer};
use crate::{ComputeDriver, DriverError, DriverStream, pb};

/// How long a shutdown lets in-flight calls finish before it cuts their connections.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How many calls one client connection may have in flight (hyper's default is 200).
const MAX_CONCURRENT_STREAMS: u32 = 1024;

/// Serves `driver` on the Unix socket `socket` until `shutdown` resolves.
///
/// A stale socket file (nobody answers on it) is removed first; a socket on which another
/// server answers, or a path that is not a socket, is refused with
/// [`DriverError::FailedPrecondition`]. The socket file is made with mode 0600 (it is bound
/// under a temporary name, restricted, then linked into place, so it is never reachable with
/// a wider mode) and removed on shutdown. Dropping the returned future instead ends every
/// connection at once and leaves the socket file, as a crash would.
pub async fn serve(
    driver: Arc<dyn ComputeDriver>,
    socket: &Path,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DriverError> {
    let listener = bind(socket).await?;
    tracing::info!(socket = %socket.display(), "driver host serving");
    let service = DriverServer::new(DriverService {
        driver,
        images: None,
    });
    let stopping = CancellationToken::new();
    // Owned here, so that dropping the serve future aborts every connection.
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    connections.spawn(serve_connection(stream, service.clone(), stopping.clone()));
                }
                Err(e) => {
                    // EMFILE and the like: back off rather than spin.
                    tracing::warn!(error = %e, "accepting a driver connection failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    if let Err(e) = std::fs::remove_file(socket) {
        tracing::warn!(socket = %socket.display(), error = %e, "socket file not removed");
    }
    stopping.cancel();
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            left = connections.len(),
            "connections still busy after the shutdown grace; cut"
        );
    }
    tracing::info!(socket = %socket.display(), "driver host stopped");
    Ok(())
}

/// Serves one client connection (HTTP/2 only, as gRPC is) until it closes, or until
/// `stopping`, after which it finishes its in-flight calls and closes.
async fn serve_connection(
    stream: UnixStream,
    service: DriverServer<DriverService>,
    stopping: CancellationToken,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new()).http2_only();
    // Streams (watch, exec, logs follow) stay open for long; one gateway holds many at once.
    builder
        .http2()
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS);
    let connection =
        builder.serve_connection(TokioIo::new(stream), TowerToHyperService::new(service));
    tokio::pin!(connection);
    let outcome = tokio::select! {
        outcome = connection.as_mut() => outcome,
        () = stopping.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = outcome {
        tracing::debug!(error = %e, "driver connection ended with an error");
    }
}

/// Binds the listener at `socket`; see [`serve`] for what it refuses and removes.
async fn bind(socket: &Path) -> Result<UnixListener, DriverError> {
    let shown = socket.display();
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if meta.file_type().is_socket() => match UnixStream::connect(socket).await {
            Ok(_) => {
                return Err(DriverError::FailedPrecondition(format!(
                    "another driver host answers on {shown}"
                )));
            }
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                tracing::info!(socket = %shown, "removing a stale socket file");
                match std::fs::remove_file(socket) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(io_error("removing the stale socket", socket, e)),
                }
            }
            Err(e) => return Err(io_error("probing the existing socket", socket, e)),
        },
        Ok(_) => {
            return Err(DriverError::FailedPrecondition(format!(
                "{shown} exists and is not a socket; not removed"
            )));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_error("inspecting", socket, e)),
    }
    let temporary = temporary_name(socket)?;
    let listener =
        UnixListener::bind(&temporary).map_err(|e| io_error("binding", &temporary, e))?;
    let placed = std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| io_error("restricting", &temporary, e))
        .and_then(|()| {
            // link, not rename: it fails if a racing host placed its socket meanwhile.
            std::fs::hard_link(&temporary, socket).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    DriverError::FailedPrecondition(format!(
                        "another driver host took {shown} while this one started"
                    ))
                } else {
                    io_error("placing the socket at", socket, e)
                }
            })
        });
    let _ = std::fs::remove_file(&temporary);
    placed.map(|()| listener)
}

/// The longest path a Unix socket can be bound at on Linux (`sun_path` minus its NUL).
const MAX_SOCKET_PATH: usize = 107;

/// A sibling of `socket` to bind first, unique to this call; refuses a `socket` path (or
/// sibling) too long to bind, naming the limit.
fn temporary_name(socket: &Path) -> Result<PathBuf, DriverError> {
    if socket.file_name().is_none() {
        return Err(DriverError::InvalidArgument(format!(
            "socket path {} has no file name",
            socket.display()
        )));
    }
    let unique = uuid::Uuid::new_v4().simple().to_string();
    let temporary = socket.with_file_name(format!(".sbx-{}", &unique[..8]));
    let longest = socket.as_os_str().len().max(temporary.as_os_str().len());
    if longest > MAX_SOCKET_PATH {
        return Err(DriverError::InvalidArgument(format!(
            "socket path {} is too long: the host binds {} (and a sibling of {} bytes first); \
             Unix sockets take at most {MAX_SOCKET_PATH} bytes",
            socket.display(),
            socket.as_os_str().len(),
            temporary.as_os_str().len()
        )));
    }
    Ok(temporary)
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> DriverError {
    DriverError::Internal(format!("{what} {}: {e}", path.display()))
}

/// The generated `Driver` service over a [`ComputeDriver`]: on a Unix socket here, over TCP
/// in [`super::node`].
pub(super) struct DriverService {
    pub(super) driver: Arc<dyn ComputeDriver>,
    /// A node's own image store: a create's image it lacks is fetched first (from the mirror
    /// its [`super::images::IMAGE_SOURCE_HEADER`] names).
    pub(super) images: Option<Arc<super::images::NodeImages>>,
}

type StatusStream<T> = std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>>;

fn answer<T>(result: Result<T, DriverError>) -> Result<Response<T>, Status> {
    result
        .map(Response::new)
        .map_err(|e| driver_error_to_status(&e))
}

fn forward<T: Send + 'static>(
    result: Result<DriverStream<T>, DriverError>,
) -> Result<Response<StatusStream<T>>, Status> {
    let stream = result.map_err(|e| driver_error_to_status(&e))?;
    let mapped = stream.map(|item| item.map_err(|e| driver_error_to_status(&e)));
    Ok(Response::new(Box::pin(mapped)))
}

#[tonic::async_trait]
impl Driver for DriverService {
    async fn capabilities(
        &self,
        _: Request<pb::CapabilitiesRequest>,
    ) -> Result<Response<pb::CapabilitiesResponse>, Status> {
        answer(self.driver.capabilities().await)
    }

    async fn create(
        &self,
        r: Request<pb::CreateRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        if let Some(images) = &self.images {
            let source = match r.metadata().get(super::images::IMAGE_SOURCE_HEADER) {
                Some(value) => Some(value.to_str().map_err(|_| {
                    Status::invalid_argument(format!(
                        "the {} header is not text",
                        super::images::IMAGE_SOURCE_HEADER
                    ))
                })?),
                None => None,
            };
            let image = r.get_ref().spec.as_ref().map(|s| s.image.as_str());
            if let Err(e) = images.ensure(image.unwrap_or(""), source).await {
                return Err(driver_error_to_status(&e));
            }
        }
        answer(self.driver.create(r.into_inner()).await)
    }

    async fn start(&self, r: Request<pb::StartRequest>) -> Result<Response<pb::Snapshot>, Status> {
        answer(self.driver.start(r.into_inner()).await)
    }

    async fn stop(&self, r: Request<pb::StopRequest>) -> Result<Response<pb::Snapshot>, Status> {
        answer(self.driver.stop(r.into_inner()).await)
    }

    async fn delete(
        &self,
        r: Request<pb::DeleteRequest>,
    ) -> Result<Response<pb::DeleteResponse>, Status> {
        answer(self.driver.delete(r.into_inner()).await)
    }

    async fn update_network(
        &self,
        r: Request<pb::UpdateNetworkRequest>,
    ) -> Result<Response<pb::NetworkStatus>, Status> {
        answer(self.driver.update_network(r.into_inner()).await)
    }

    async fn get_network(
        &self,
        r: Request<pb::GetNetworkRequest>,
    ) -> Result<Response<pb::NetworkStatus>, Status> {
        answer(self.driver.get_network(r.into_inner()).await)
    }

    async fn stats(
        &self,
        r: Request<pb::StatsRequest>,
    ) -> Result<Response<pb::SandboxUsage>, Status> {
        answer(self.driver.stats(r.into_inner()).await)
    }

    async fn pause(&self, r: Request<pb::PauseRequest>) -> Result<Response<pb::Snapshot>, Status> {
        answer(self.driver.pause(r.into_inner()).await)
    }

    async fn resume(
        &self,
        r: Request<pb::ResumeRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        answer(self.driver.resume(r.into_inner()).await)
    }

    async fn get(&self, r: Request<pb::GetRequest>) -> Result<Response<pb::Snapshot>, Status> {
        answer(self.driver.get(r.into_inner()).await)
    }

    async fn list(
        &self,
        _: Request<pb::ListRequest>,
    ) -> Result<Response<pb::ListResponse>, Status> {
        answer(
            self.driver
                .list()
                .await
                .map(|sandboxes| pb::ListResponse { sandboxes }),
        )
    }

    type WatchStream = StatusStream<pb::WatchEvent>;

    async fn watch(
        &self,
        _: Request<pb::WatchRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        forward(self.driver.watch().await)
    }

    type ExecStream = StatusStream<pb::ExecOutput>;

    async fn exec(
        &self,
        r: Request<tonic::Streaming<pb::ExecInput>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let (req, input) = split_exec_input(r.into_inner()).await?;
        forward(self.driver.exec_io(req, input).await)
    }

    type CopyFromStream = StatusStream<pb::CopyChunk>;

    async fn copy_from(
        &self,
        r: Request<pb::CopyFromRequest>,
    ) -> Result<Response<Self::CopyFromStream>, Status> {
        forward(self.driver.copy_from(r.into_inner()).await)
    }

    async fn copy_to(
        &self,
        r: Request<tonic::Streaming<pb::CopyToInput>>,
    ) -> Result<Response<pb::CopyToResponse>, Status> {
        use pb::copy_to_input::Input;
        let mut stream = r.into_inner();
        let Some(Input::Start(start)) = first_message(&mut stream, "copy").await?.input else {
            return Err(Status::invalid_argument(
                "the first message of a copy stream must be its start",
            ));
        };
        // A stream that fails (the gateway's call was cut) is never taken whole.
        let (data, failed) = crate::upload(stream, |message: pb::CopyToInput| match message {
            pb::CopyToInput {
                input: Some(Input::Data(bytes)),
            } => Some(bytes),
            _ => None,
        });
        tokio::select! {
            copied = self.driver.copy_to(start, data) => answer(copied),
            status = failed => Err(status),
        }
    }

    type PortForwardStream = StatusStream<pb::PortForwardOutput>;

    async fn port_forward(
        &self,
        r: Request<tonic::Streaming<pb::PortForwardInput>>,
    ) -> Result<Response<Self::PortForwardStream>, Status> {
        use futures::StreamExt;
        use pb::port_forward_input::Input;
        let mut stream = r.into_inner();
        let Some(Input::Start(start)) = first_message(&mut stream, "port-forward").await?.input
        else {
            return Err(Status::invalid_argument(
                "the first message of a port-forward stream must be its start",
            ));
        };
        let rest = stream
            .take_while(|item| std::future::ready(item.is_ok()))
            .filter_map(|item| std::future::ready(item.ok()));
        forward(self.driver.port_forward(start, Box::pin(rest)).await)
    }

    type LogsStream = StatusStream<pb::LogChunk>;

    async fn logs(
        &self,
        r: Request<pb::LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        forward(self.driver.logs(r.into_inner()).await)
    }
}

/// The first message of a client stream; its absence is INVALID_ARGUMENT.
async fn first_message<T>(stream: &mut tonic::Streaming<T>, what: &str) -> Result<T, Status> {
    stream.message().await?.ok_or_else(|| {
        Status::invalid_argument(format!("the {what} stream ended before its start"))
    })
}

/// An exec's input stream split into its request (the first message, which must be `start`)
/// and the rest. A broken input stream ends the rest (the caller is gone; its output stream
/// goes with it, which ends the command).
pub async fn split_exec_input(
    mut stream: tonic::Streaming<pb::ExecInput>,
) -> Result<(pb::ExecRequest, crate::ExecInputStream), Status> {
    use futures::StreamExt;
    use pb::exec_input::Input;
    let first = stream
        .message()
        .await?
        .ok_or_else(|| Status::invalid_argument("the exec stream ended before its request"))?;
    let Some(Input::Start(req)) = first.input else {
        return Err(Status::invalid_argument(
            "the first message of an exec stream must be its request (start)",
        ));
    };
    let rest = stream.take_while(|item| std::future::ready(item.is_ok()));
    let rest = rest.filter_map(|item| std::future::ready(item.ok()));
    Ok((req, Box::pin(rest)))
}
