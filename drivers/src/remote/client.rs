//! The client side: [`RemoteDriver`], a [`ComputeDriver`] that forwards every call to a
//! driver host on a Unix socket, or to a node over TCP (plain, or TLS with a client
//! certificate).

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint, Uri};
use tonic::{Response, Status};

use super::status::{CallContext, status_to_driver_error};
use crate::pb::driver_client::DriverClient;
use crate::pb::node_client::NodeClient;
use crate::{ComputeDriver, DriverError, DriverStream, pb};

/// How often an idle TCP connection to a node is pinged, and how long a ping may go
/// unanswered before the connection is taken as dead (the next call reconnects).
const TCP_KEEPALIVE: Duration = Duration::from_secs(20);

/// Where a [`RemoteDriver`]'s calls go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RemoteTarget {
    /// A driver host's Unix socket (`sbxd driver`, `sbx-driver-host`).
    Socket(PathBuf),
    /// A node's `HOST:PORT` (`sbxd node`), over TLS when `tls`.
    Tcp { addr: String, tls: bool },
}

impl fmt::Display for RemoteTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RemoteTarget::Socket(path) => write!(f, "unix://{}", path.display()),
            RemoteTarget::Tcp { addr, tls: true } => write!(f, "https://{addr}"),
            RemoteTarget::Tcp { addr, tls: false } => write!(f, "http://{addr}"),
        }
    }
}

/// The deadline of a pause or a resume, each moving a workload's whole memory to or from
/// disk (at about 1 s per GiB measured on the vm driver): 30 minutes, however short the
/// other calls' deadline.
const MOVING_MEMORY: Duration = Duration::from_secs(30 * 60);

/// A driver served by another process: a driver host (`sbx-driver-host`, or `sbxd driver`)
/// on a Unix socket, or a node (`sbxd node`) over TCP.
///
/// The channel is lazy: making a `RemoteDriver` never waits. While no host listens, calls
/// answer [`DriverError::Unavailable`]; once one listens again (a restarted host on the same
/// socket or address), the next call reconnects by itself.
///
/// Every unary call carries the deadline `call_timeout` (sent to the host as `grpc-timeout`
/// and enforced here); a call still unanswered then answers
/// [`DriverError::DeadlineExceeded`] and its request is cancelled on the host. Opening a
/// stream (watch, exec, logs) has the same deadline; the stream itself has none.
#[derive(Debug, Clone)]
pub struct RemoteDriver {
    /// Shares one HTTP/2 connection between all calls and clones of this driver.
    client: DriverClient<Channel>,
    /// The node service on the same connection (answered by `sbxd node` only).
    node: NodeClient<Channel>,
    target: RemoteTarget,
    call_timeout: Duration,
    /// The workspace and fencing token every call carries ([`RemoteDriver::fenced`]).
    fence: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// The gateway a fenced call comes from ([`RemoteDriver::as_gateway`]).
    holder: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
    /// The image mirror a create names ([`RemoteDriver::with_image_source`]).
    image_source: Option<std::sync::Arc<super::images::ImageSource>>,
}

impl RemoteDriver {
    /// This driver, its every call carrying `workspace`'s fencing `token` (the node refuses
    /// it once it has seen a newer one: see [`super::fence`]). Shares the connection.
    pub fn fenced(&self, workspace: uuid::Uuid, token: u64) -> RemoteDriver {
        let mut fenced = self.clone();
        fenced.fence = super::fence::fence_value(workspace, token).parse().ok();
        fenced
    }

    /// This driver, its fenced calls also naming the gateway they come from, so the node can
    /// tell two gateways calling under one token apart (which leases must never allow: it
    /// counts them, `NodeInfo.token_conflicts`).
    pub fn as_gateway(&self, gateway: uuid::Uuid) -> RemoteDriver {
        let mut named = self.clone();
        named.holder = gateway.to_string().parse().ok();
        named
    }

    /// This driver, its creates naming where a node fetches their image from when it lacks
    /// it (the [`super::images::IMAGE_SOURCE_HEADER`] header: the image's reference in
    /// `source`'s mirror, which `source` first fills from the gateway's store when it can).
    pub fn with_image_source(&self, source: std::sync::Arc<super::images::ImageSource>) -> Self {
        let mut sourced = self.clone();
        sourced.image_source = Some(source);
        sourced
    }

    /// The fence headers of this driver on one request.
    fn decorate<T>(&self, request: &mut tonic::Request<T>) {
        if let Some(fence) = &self.fence {
            request
                .metadata_mut()
                .insert(super::fence::FENCE_HEADER, fence.clone());
            if let Some(holder) = &self.holder {
                request
                    .metadata_mut()
                    .insert(super::fence::FENCE_HOLDER_HEADER, holder.clone());
            }
        }
    }

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
        RemoteDriver::over(channel, RemoteTarget::Socket(socket), call_timeout)
    }

    /// A driver talking to the node at `addr` (`HOST:PORT`, as `sbxd node --listen` was
    /// given or wrote to its address file) over TCP: plain HTTP/2 without `tls`, TLS with it
    /// (the CA that signed the node's certificate and, for the mutual TLS a node requires, the
    /// gateway's client certificate). Lazy as [`RemoteDriver::connect_lazy`]: the host name is
    /// resolved and the connection made by the first call, and made again after it breaks.
    /// Must be called within a Tokio runtime.
    ///
    /// A malformed address (not `HOST:PORT`, a port that is not a number, a scheme) or a TLS
    /// configuration tonic refuses is [`DriverError::InvalidArgument`].
    pub fn connect_tcp_lazy(
        addr: &str,
        tls: Option<ClientTlsConfig>,
        call_timeout: Duration,
    ) -> Result<RemoteDriver, DriverError> {
        check_host_port(addr)?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{addr}"))
            .map_err(|e| DriverError::InvalidArgument(format!("node address {addr:?}: {e}")))?
            .connect_timeout(call_timeout)
            .tcp_nodelay(true)
            .tcp_keepalive(Some(TCP_KEEPALIVE))
            .http2_keep_alive_interval(TCP_KEEPALIVE)
            .keep_alive_timeout(TCP_KEEPALIVE)
            .keep_alive_while_idle(true);
        let secure = tls.is_some();
        if let Some(tls) = tls {
            endpoint = endpoint.tls_config(tls).map_err(|e| {
                DriverError::InvalidArgument(format!("TLS for the node at {addr}: {e}"))
            })?;
        }
        let target = RemoteTarget::Tcp {
            addr: addr.to_string(),
            tls: secure,
        };
        Ok(RemoteDriver::over(
            endpoint.connect_lazy(),
            target,
            call_timeout,
        ))
    }

    fn over(channel: Channel, target: RemoteTarget, call_timeout: Duration) -> RemoteDriver {
        RemoteDriver {
            client: DriverClient::new(channel.clone()),
            node: NodeClient::new(channel),
            target,
            call_timeout,
            fence: None,
            holder: None,
            image_source: None,
        }
    }

    /// Where this driver's calls go.
    pub fn target(&self) -> &RemoteTarget {
        &self.target
    }

    /// The socket this driver talks to; `None` for a node over TCP ([`RemoteDriver::target`]
    /// says where).
    pub fn socket(&self) -> Option<&Path> {
        match &self.target {
            RemoteTarget::Socket(path) => Some(path),
            RemoteTarget::Tcp { .. } => None,
        }
    }

    /// The deadline of each call.
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// What the node is (`sbx.driver.v1.Node/Info`): its id, name, drivers, labels, capacity
    /// and how many sandboxes it holds. Bounded by the call deadline; `Unavailable` when
    /// nothing answers, `Unimplemented` from a plain driver host (`sbxd driver`), which serves
    /// no node service.
    pub async fn node_info(&self) -> Result<pb::NodeInfo, DriverError> {
        let mut request = tonic::Request::new(pb::NodeInfoRequest {});
        request.set_timeout(self.call_timeout);
        let ctx = self.context("node_info");
        let mut node = self.node.clone();
        match tokio::time::timeout(self.call_timeout, node.info(request)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(status_to_driver_error(&status, ctx)),
            Err(_) => Err(DriverError::DeadlineExceeded {
                operation: "node_info",
                after: self.call_timeout,
            }),
        }
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
        self.call_with(
            operation,
            message,
            send_deadline,
            None,
            self.call_timeout,
            call,
        )
        .await
    }

    /// [`RemoteDriver::call`] with one more header (`name`, `value`).
    async fn call_with<Req, Resp, Fut>(
        &self,
        operation: &'static str,
        message: Req,
        send_deadline: bool,
        header: Option<(
            &'static str,
            tonic::metadata::MetadataValue<tonic::metadata::Ascii>,
        )>,
        within: Duration,
        call: impl FnOnce(DriverClient<Channel>, tonic::Request<Req>) -> Fut,
    ) -> Result<Resp, DriverError>
    where
        Fut: Future<Output = Result<Response<Resp>, Status>>,
    {
        let mut request = tonic::Request::new(message);
        if send_deadline {
            request.set_timeout(within);
        }
        self.decorate(&mut request);
        if let Some((name, value)) = header {
            request.metadata_mut().insert(name, value);
        }
        let ctx = self.context(operation);
        match tokio::time::timeout(within, call(self.client.clone(), request)).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(status_to_driver_error(&status, ctx)),
            Err(_) => Err(DriverError::DeadlineExceeded {
                operation,
                after: within,
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
        let image = req.spec.as_ref().map(|s| s.image.as_str()).unwrap_or("");
        let header = match &self.image_source {
            Some(source) => source.prepare(image).await.and_then(|reference| {
                let value = reference.parse().ok()?;
                Some((super::images::IMAGE_SOURCE_HEADER, value))
            }),
            None => None,
        };
        self.call_with(
            "create",
            req,
            true,
            header,
            self.call_timeout,
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

    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError> {
        self.call(
            "stats",
            req,
            true,
            |mut c, r| async move { c.stats(r).await },
        )
        .await
    }

    async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        let within = self.call_timeout.max(MOVING_MEMORY);
        self.call_with("pause", req, true, None, within, |mut c, r| async move {
            c.pause(r).await
        })
        .await
    }

    async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        let within = self.call_timeout.max(MOVING_MEMORY);
        self.call_with("resume", req, true, None, within, |mut c, r| async move {
            c.resume(r).await
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
        let mut messages =
            tonic::Request::new(sync_stream(futures::stream::iter([start]).chain(input)));
        self.decorate(&mut messages);
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
        let mut messages =
            tonic::Request::new(sync_stream(futures::stream::iter([start]).chain(data)));
        self.decorate(&mut messages);
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
        let mut messages =
            tonic::Request::new(sync_stream(futures::stream::iter([start]).chain(input)));
        self.decorate(&mut messages);
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

/// Checks that `addr` is `HOST:PORT` (a name or IPv4 address, or an IPv6 address in brackets,
/// and a port of 1 to 65535), as a node's `--listen` or address file gives it.
fn check_host_port(addr: &str) -> Result<(), DriverError> {
    let bad = |why: &str| {
        Err(DriverError::InvalidArgument(format!(
            "node address {addr:?}: {why} (expected HOST:PORT, e.g. 10.0.0.7:7443 or [::1]:7443)"
        )))
    };
    let Some((host, port)) = addr.rsplit_once(':') else {
        return bad("no port");
    };
    match port.parse::<u16>() {
        Ok(0) => return bad("port 0"),
        Ok(_) => {}
        Err(_) => return bad("the port is not a number from 1 to 65535"),
    }
    if let Some(inner) = host.strip_prefix('[') {
        return match inner
            .strip_suffix(']')
            .map(str::parse::<std::net::Ipv6Addr>)
        {
            Some(Ok(_)) => Ok(()),
            _ => bad("not an IPv6 address in brackets"),
        };
    }
    let name_char = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_');
    if host.is_empty() || host.len() > 253 || !host.chars().all(name_char) {
        return bad("not a host name or an IP address");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_addresses_are_host_and_port() {
        for good in [
            "127.0.0.1:7443",
            "node-1.example.com:1",
            "[::1]:65535",
            "localhost:80",
        ] {
            assert_eq!(check_host_port(good), Ok(()), "{good}");
        }
        for (bad, why) in [
            ("127.0.0.1", "no port"),
            ("127.0.0.1:0", "port 0"),
            ("127.0.0.1:65536", "not a number"),
            ("127.0.0.1:x", "not a number"),
            (":80", "not a host name"),
            ("http://127.0.0.1:80", "not a host name"),
            ("a b:80", "not a host name"),
            ("::1:80", "not a host name"),
            ("[::g]:80", "IPv6"),
        ] {
            let err = check_host_port(bad).unwrap_err();
            assert!(
                matches!(&err, DriverError::InvalidArgument(m) if m.contains(why)),
                "{bad}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn a_malformed_node_address_is_an_invalid_argument() {
        let err =
            RemoteDriver::connect_tcp_lazy("nowhere", None, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(err, DriverError::InvalidArgument(_)), "{err}");
        let remote =
            RemoteDriver::connect_tcp_lazy("127.0.0.1:9", None, Duration::from_secs(1)).unwrap();
        assert_eq!(remote.socket(), None);
        assert_eq!(remote.target().to_string(), "http://127.0.0.1:9");
    }
}
