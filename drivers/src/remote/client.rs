//! The client side: [`RemoteDriver`], a [`ComputeDriver`] that forwards every call to a
//! driver host on a Unix socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Response, Status};

use super::status::{CallContext, status_to_driver_error};
use crate::pb::driver_client::DriverClient;
use crate::{ComputeDriver, DriverError, DriverStream, pb};

/// A driver served by another process (`sbx-driver-host`, or `sbxd driver`) on a Unix socket.
///
/// The channel is lazy: making a `RemoteDriver` never fails and never waits. While no host
/// listens, calls answer [`DriverError::Unavailable`]; once one listens again (a restarted
/// host on the same socket), the next call reconnects by itself.
///
/// Every unary call carries the deadline `call_timeout` (sent to the host as `grpc-timeout`
/// and enforced here); a call still unanswered then answers
/// [`DriverError::DeadlineExceeded`] and its request is cancelled on the host. Opening a
/// stream (watch, exec, logs) has the same deadline; the stream itself has none.
#[derive(Debug, Clone)]
pub struct RemoteDriver {
    /// Shares one HTTP/2 connection between all calls and clones of this driver.
    client: DriverClient<Channel>,
    socket: PathBuf,
    call_timeout: Duration,
}

impl RemoteDriver {
    /// A driver talking to the host on `socket`, each call bounded by `call_timeout`.
    /// Must be called within a Tokio runtime (the channel's worker task is spawned on it).
    pub fn connect_lazy(socket: PathBuf, call_timeout: Duration) -> RemoteDriver {
        let dial = socket.clone();
        let connector = tower::service_fn(move |_: Uri| {
            let dial = dial.clone();
            async move { UnixStream::connect(dial).await.map(TokioIo::new) }
        });
        // HTTP/2 needs an authority; it is never resolved, the connector dials the socket.
        let channel = Endpoint::from_static("http://sbx-driver.local")
            .connect_timeout(call_timeout)
            .connect_with_connector_lazy(connector);
        RemoteDriver {
            client: DriverClient::new(channel),
            socket,
            call_timeout,
        }
    }

    /// The socket this driver talks to.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The deadline of each call.
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    fn context(&self, operation: &'static str) -> CallContext {
        CallContext {
            operation,
            timeout: self.call_timeout,
        }
    }

    /// Runs one call with the deadline. The local timer also covers the time a call waits
    /// for the channel (connecting), which tonic's own request timeout does not.
    async fn call<Req, Resp, Fut>(
        &self,
        operation: &'static str,
        message: Req,
        send_deadline: bool,
        call: impl FnOnce(DriverClient<Channel>, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp, DriverError>
    where
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let mut request = tonic::Request::new(message);
        if send_deadline {
            request.set_timeout(self.call_timeout);
        }
        let ctx = self.context(operation);
        match tokio::time::timeout(self.call_timeout, call(self.client.clone(), request)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(status_to_driver_error(&status, ctx)),
            Err(_) => Err(DriverError::DeadlineExceeded {
                operation,
                after: self.call_timeout,
            }),
        }
    }

    /// Maps a remote stream's items: a status from the host (or a cut connection) becomes
    /// the driver error it stands for.
    fn stream<T: Send + 'static>(
        &self,
        operation: &'static str,
        stream: tonic::Streaming<T>,
    ) -> DriverStream<T> {
        let ctx = self.context(operation);
        Box::pin(
            stream.map(move |item| item.map_err(|status| status_to_driver_error(&status, ctx))),
        )
    }
}

#[async_trait]
impl ComputeDriver for RemoteDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        let req = pb::CapabilitiesRequest {};
        self.call("capabilities", req, true, |mut c, r| async move {
            c.capabilities(r).await
        })
        .await
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        self.call(
            "create",
            req,
            true,
            |mut c, r| async move { c.create(r).await },
        )
        .await
    }

    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        self.call(
            "start",
            req,
            true,
            |mut c, r| async move { c.start(r).await },
        )
        .await
    }

    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        self.call("stop", req, true, |mut c, r| async move { c.stop(r).await })
            .await
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        self.call(
            "delete",
            req,
            true,
            |mut c, r| async move { c.delete(r).await },
        )
        .await
    }

    async fn update_network(
        &self,
        req: pb::UpdateNetworkRequest,
    ) -> Result<pb::NetworkStatus, DriverError> {
        self.call("update_network", req, true, |mut c, r| async move {
            c.update_network(r).await
        })
        .await
    }

    async fn get_network(
        &self,
        req: pb::GetNetworkRequest,
    ) -> Result<pb::NetworkStatus, DriverError> {
        self.call("get_network", req, true, |mut c, r| async move {
            c.get_network(r).await
        })
        .await
    }

    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        self.call("get", req, true, |mut c, r| async move { c.get(r).await })
            .await
    }

    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        let req = pb::ListRequest {};
        let list = self
            .call("list", req, true, |mut c, r| async move { c.list(r).await })
            .await?;
        Ok(list.sandboxes)
    }

    // Streams: no grpc-timeout, which would bound the whole stream, only the local timer on
    // opening it.

    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        let req = pb::WatchRequest {};
        let stream = self
            .call(
                "watch",
                req,
                false,
                |mut c, r| async move { c.watch(r).await },
            )
            .await?;
        Ok(self.stream("watch", stream))
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: crate::ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        // The request as the first input message, then the caller's input; its end is the
        // end of stdin (a half-close, not a cancel).
        let start = pb::ExecInput {
            input: Some(pb::exec_input::Input::Start(req)),
        };
        let messages = sync_stream(futures::stream::iter([start]).chain(input));
        let ctx = self.context("exec");
        let mut client = self.client.clone();
        let stream = match tokio::time::timeout(self.call_timeout, client.exec(messages)).await {
            Ok(Ok(response)) => response.into_inner(),
            Ok(Err(status)) => return Err(status_to_driver_error(&status, ctx)),
            Err(_) => {
                return Err(DriverError::DeadlineExceeded {
                    operation: "exec",
                    after: self.call_timeout,
                });
            }
        };
        Ok(self.stream("exec", stream))
    }

    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        let stream = self
            .call(
                "logs",
                req,
                false,
                |mut c, r| async move { c.logs(r).await },
            )
            .await?;
        Ok(self.stream("logs", stream))
    }

    async fn copy_from(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        let stream = self
            .call("copy_from", req, false, |mut c, r| async move {
                c.copy_from(r).await
            })
            .await?;
        Ok(self.stream("copy_from", stream))
    }

    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: crate::ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        use pb::copy_to_input::Input;
        let start = pb::CopyToInput {
            input: Some(Input::Start(req)),
        };
        let data = data.map(|bytes| pb::CopyToInput {
            input: Some(Input::Data(bytes)),
        });
        let messages = sync_stream(futures::stream::iter([start]).chain(data));
        // No local timer: the upload takes as long as the caller's data does.
        let mut client = self.client.clone();
        client
            .copy_to(messages)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|status| status_to_driver_error(&status, self.context("copy_to")))
    }

    async fn port_forward(
        &self,
        req: pb::PortForwardStart,
        input: crate::ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
        let start = pb::PortForwardInput {
            input: Some(pb::port_forward_input::Input::Start(req)),
        };
        let messages = sync_stream(futures::stream::iter([start]).chain(input));
        let ctx = self.context("port_forward");
        let mut client = self.client.clone();
        let stream =
            match tokio::time::timeout(self.call_timeout, client.port_forward(messages)).await {
                Ok(Ok(response)) => response.into_inner(),
                Ok(Err(status)) => return Err(status_to_driver_error(&status, ctx)),
                Err(_) => {
                    return Err(DriverError::DeadlineExceeded {
                        operation: "port_forward",
                        after: self.call_timeout,
                    });
                }
            };
        Ok(self.stream("port_forward", stream))
    }
}

/// `stream` through a bounded channel: tonic's client-streaming futures are `Send` only for a
/// `Sync` stream, which a boxed one is not. The forwarding task ends with the call (when the
/// receiver is dropped) or with the stream.
fn sync_stream<T: Send + 'static>(
    stream: impl futures::Stream<Item = T> + Send + 'static,
) -> tokio_stream::wrappers::ReceiverStream<T> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        loop {
            let message = tokio::select! {
                message = stream.next() => message,
                () = tx.closed() => return,
            };
            let Some(message) = message else { return };
            if tx.send(message).await.is_err() {
                return;
            }
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}
