//! The HTTP listener of service endpoints (`sbxd serve --service-listen ADDR`).
//!
//! A request whose Host is `NAME--SANDBOX--WORKSPACE.<domain>` goes to the port endpoint
//! `NAME` of that sandbox exposes (`sbx service expose`). The target is looked up in the store
//! on every request (`Gateway::route_service_host`), and the request is forwarded by the
//! endpoint's stored sandbox **id**: a sandbox deleted and made again under the same name has
//! no endpoint until one is exposed for it, and a request never reaches a sandbox it was not
//! meant for. Each request gets a connection of its own to the sandbox's port, through the
//! driver's port-forward (the same path as `sbx port-forward`): HTTP/1.1 from the client
//! (keep-alive is kept on the client's side), spoken over that connection by hyper's client.
//!
//! Answers of its own: 404 for a Host that names no endpoint, 421 for a Host under another
//! domain, 409 for a Host two endpoints could answer (names holding `--`), 502 when the
//! sandbox is not Ready or nothing listens on the port, 503 while the gateway cannot tell.
//! Each says why in a one-line text body. Upgrades (WebSocket) are not forwarded.
//!
//! There is no authentication on this listener: exposing a port makes it reachable by
//! whoever reaches the listener (bind it to loopback, the default suggestion, or behind a
//! proxy that authenticates).

use std::sync::Arc;

use futures::StreamExt;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use sbx_actors::{ActorError, Gateway, SandboxSelector};
use sbx_actors::{ActorStream, ForwardInputs};
use sbx_proto::v1::PortForwardOutput;
use sbx_proto::v1::port_forward_input::Input;
use sbx_proto::v1::port_forward_output::Output;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// Bytes in flight between hyper's client and a forwarded connection, each way.
const BRIDGE_BYTES: usize = 64 * 1024;

/// Serves service endpoints on `listener` (under `limits`) until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    limits: super::connections::Limits,
    gateway: Arc<Gateway>,
    shutdown: CancellationToken,
) {
    serve_http1(listener, "service", None, limits, shutdown, move |req| {
        let gateway = Arc::clone(&gateway);
        async move { route(&gateway, req).await }
    })
    .await
}

/// Accepts connections on `listener` until `shutdown` and answers each one's HTTP/1.1
/// requests with `handle` (one task per connection, ended at `shutdown` too), over TLS when
/// `tls` is given; `what` names the listener in logs. The loop of sbxd's HTTP listeners
/// (service endpoints, metrics, the E2B API). Its connections are held to `limits` as the
/// gRPC listener's are (`connections::bounded`: at most `max_connections` open, the first
/// bytes within `handshake_timeout`), and so are the TLS handshake and each request's head.
pub async fn serve_http1<H, Fut, B>(
    listener: TcpListener,
    what: &'static str,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: super::connections::Limits,
    shutdown: CancellationToken,
    handle: H,
) where
    H: Fn(Request<Incoming>) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<B>> + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use tonic::transport::server::Connected;
    let deadline = limits.handshake_timeout;
    // TCP_NODELAY on every accepted connection, as on the gRPC listener: without it an answer
    // written while the client's previous segment is unacknowledged waits for its delayed
    // ACK (~40 ms on Linux), a floor under every E2B call (`commands.run` took ~44 ms where
    // an exec takes 16–20).
    let accepted = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |stream| {
            stream.inspect(|s| {
                if let Err(e) = s.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY not set on a connection");
                }
            })
        },
    );
    let incoming = super::connections::bounded(accepted, limits);
    let mut incoming = std::pin::pin!(incoming);
    loop {
        let accepted = tokio::select! {
            accepted = incoming.next() => accepted,
            _ = shutdown.cancelled() => return,
        };
        let stream = match accepted {
            None => return,
            Some(Ok(stream)) => stream,
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the {what} listener could not accept a connection");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let peer = stream.connect_info().remote_addr();
        // Each request carries its connection's proof, for the handler to give when it
        // authenticates the request (connections::ConnProof).
        let proof = stream.proof();
        let handle = handle.clone();
        let shutdown = shutdown.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |mut req: Request<Incoming>| {
                if let Some(proof) = &proof {
                    req.extensions_mut().insert(proof.clone());
                }
                let answer = handle(req);
                async move { Ok::<_, std::convert::Infallible>(answer.await) }
            });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(deadline);
            let served = async {
                let Some(acceptor) = tls else {
                    return builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                };
                match tokio::time::timeout(deadline, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => builder.serve_connection(TokioIo::new(s), service).await,
                    Ok(Err(e)) => {
                        tracing::debug!(?peer, error = %e, "a {what} TLS handshake failed");
                        Ok(())
                    }
                    Err(_) => {
                        tracing::debug!(
                            ?peer,
                            "a {what} connection did not finish its TLS handshake in time"
                        );
                        Ok(())
                    }
                }
            };
            tokio::select! {
                result = served => if let Err(e) = result {
                    tracing::debug!(?peer, error = %e, "a {what} connection ended with an error");
                },
                _ = shutdown.cancelled() => {}
            }
        });
    }
}

fn text(status: StatusCode, message: String) -> Response<Body> {
    let mut response = Response::new(
        Full::new(Bytes::from(format!("{message}\n")))
            .map_err(|never| match never {})
            .boxed(),
    );
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "text/plain; charset=utf-8".parse().expect("a header value"),
    );
    response
}

/// The host a request names: its Host header, else its URI's authority ("" when neither).
pub(super) fn host_of<B>(req: &Request<B>) -> String {
    req.headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default()
}

/// One request: its Host to an endpoint, then the request over a fresh forwarded connection.
async fn route(gateway: &Gateway, req: Request<Incoming>) -> Response<Body> {
    let host = host_of(&req);
    let target = match gateway.route_service_host(&host).await {
        Ok(t) => t,
        Err(e) => {
            let status = match &e {
                ActorError::ObjectNotFound { what, .. } if what.contains("not under") => {
                    StatusCode::MISDIRECTED_REQUEST
                }
                ActorError::ObjectNotFound { .. }
                | ActorError::SandboxNotFound { .. }
                | ActorError::WorkspaceNotFound(_) => StatusCode::NOT_FOUND,
                ActorError::FailedPrecondition(_) => StatusCode::CONFLICT,
                _ => StatusCode::SERVICE_UNAVAILABLE,
            };
            return text(status, e.to_string());
        }
    };
    // A request that reaches an exposed service is what this listener is for: the
    // connection has proven itself (connections::ConnProof).
    if let Some(proof) = req.extensions().get::<super::connections::ConnProof>() {
        proof.prove();
    }
    forward(
        gateway,
        target.sandbox_id,
        target.port,
        req,
        Wake::OnRequest,
    )
    .await
}

/// Whether a forwarded request may resume a paused sandbox: as a caller's use would
/// (`auto_resume`: the E2B API's requests, which carry the sandbox's token), or only as the
/// sandbox's `wake_on_request` allows (a service endpoint's, which nobody authenticates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Wake {
    AsCaller,
    OnRequest,
}

/// `req` sent to `port` of sandbox `sandbox_id` over a fresh forwarded connection (the
/// driver's port-forward, as `sbx port-forward` uses), and the sandbox's answer; 502 when the
/// sandbox is not Ready or nothing answers on the port. Also how the E2B listener reaches a
/// sandbox's ports (`E2b-Sandbox-Port`).
pub(super) async fn forward(
    gateway: &Gateway,
    sandbox_id: uuid::Uuid,
    port: u32,
    req: Request<Incoming>,
    wake: Wake,
) -> Response<Body> {
    let (tx, rx) = mpsc::channel::<Input>(16);
    let input: ForwardInputs = Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx));
    let sel = SandboxSelector::Id(sandbox_id);
    let opened = match wake {
        Wake::AsCaller => gateway.port_forward(&sel, port, input).await,
        Wake::OnRequest => gateway.routed_forward(&sel, port, input).await,
    };
    let output = match opened {
        Ok(o) => o,
        // Gateways sharing a store: the sandbox is served by another gateway. Said without
        // naming it (these requests are not authenticated: the gateways' ids and addresses
        // are none of their business).
        Err(ActorError::HeldElsewhere { .. }) => {
            return text(
                StatusCode::SERVICE_UNAVAILABLE,
                "this sandbox is served by another gateway of the store; send its service \
                 requests to that gateway"
                    .to_string(),
            );
        }
        Err(e) => return text(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    let (client_io, bridge_io) = tokio::io::duplex(BRIDGE_BYTES);
    tokio::spawn(bridge(bridge_io, tx, output));
    let (mut sender, conn) =
        match hyper::client::conn::http1::handshake(TokioIo::new(client_io)).await {
            Ok(pair) => pair,
            Err(e) => return text(StatusCode::BAD_GATEWAY, format!("the sandbox's port: {e}")),
        };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    match sender.send_request(req).await {
        Ok(response) => response.map(|b| b.map_err(Into::into).boxed()),
        Err(e) => text(
            StatusCode::BAD_GATEWAY,
            format!("port {port} of sandbox {sandbox_id} did not answer the request: {e}"),
        ),
    }
}

/// Copies bytes between hyper's side of a duplex pipe and a forwarded connection, each way
/// until its end (a half-close passes through as one).
async fn bridge(
    io: tokio::io::DuplexStream,
    tx: mpsc::Sender<Input>,
    mut output: ActorStream<PortForwardOutput>,
) {
    let (mut reader, mut writer) = tokio::io::split(io);
    let up = async move {
        let mut buf = vec![0u8; BRIDGE_BYTES];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = tx.send(Input::CloseWrite(true)).await;
                    return;
                }
                Ok(n) => {
                    if tx.send(Input::Data(buf[..n].to_vec())).await.is_err() {
                        return;
                    }
                }
            }
        }
    };
    let down = async move {
        while let Some(item) = output.next().await {
            match item {
                Ok(PortForwardOutput {
                    output: Some(Output::Data(data)),
                }) => {
                    if writer.write_all(&data).await.is_err() {
                        return;
                    }
                }
                Ok(PortForwardOutput {
                    output: Some(Output::Closed(_)),
                })
                | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = writer.shutdown().await;
    };
    tokio::join!(up, down);
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::daemon::connections::Limits;

    /// What `read` gives once the peer closed: 0 bytes, or a reset.
    async fn closed(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
        let mut buf = [0u8; 64];
        matches!(
            tokio::time::timeout(within, stream.read(&mut buf)).await,
            Ok(Ok(0) | Err(_))
        )
    }

    #[tokio::test]
    async fn http_listeners_close_silent_connections_and_those_past_the_cap() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let limits = Limits {
            max_connections: 1,
            handshake_timeout: Duration::from_millis(300),
            ..Limits::default()
        };
        tokio::spawn(serve_http1(
            listener,
            "test",
            None,
            limits,
            stop.clone(),
            |_req| async { Response::new(Full::new(Bytes::from_static(b"answered"))) },
        ));
        // A connection that sends nothing holds the one place...
        let began = Instant::now();
        let mut silent = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        // ...so the next is closed at once...
        let mut second = tokio::net::TcpStream::connect(addr).await.unwrap();
        assert!(closed(&mut second, Duration::from_millis(200)).await);
        // ...and the silent one at the handshake deadline, not before.
        assert!(closed(&mut silent, Duration::from_secs(3)).await);
        assert!(
            began.elapsed() >= Duration::from_millis(250),
            "{:?}",
            began.elapsed()
        );
        // Its place is free again: a request is answered.
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        third
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(3), third.read_to_string(&mut answer))
            .await
            .unwrap()
            .unwrap();
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.ends_with("answered"),
            "{answer}"
        );
        stop.cancel();
    }
}
