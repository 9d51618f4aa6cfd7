//! The accept loop of sbxd's HTTP/1.1 listeners (service endpoints, metrics, the E2B API):
//! one task per connection, each held to the limits the gRPC listener's connections are
//! (`connections::bounded`: at most `max_connections` open, a cap per peer address, the first
//! bytes within `handshake_timeout`, an authenticated request within the proof timeout), the
//! TLS handshake and each request's head within the same deadline.

use futures::StreamExt;
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::daemon::connections;

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
    limits: connections::Limits,
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
    let incoming = connections::bounded(accepted, limits);
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

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::daemon::connections::Limits;
    use http_body_util::Full;
    use hyper::body::Bytes;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
