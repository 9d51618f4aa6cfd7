//! Bounds on the connections sbxd accepts, so that callers who open connections and send
//! nothing cannot take the descriptors its driver and store need.
//!
//! - **A cap** ([`Limits::max_connections`]): past it a new connection is closed at once
//!   (logged, at most once a second). The default leaves [`RESERVED_FDS`] of the process's
//!   descriptor limit to the store, the driver and the sandboxes' plumbing: with the usual
//!   1,024, 768 connections.
//! - **A handshake deadline** ([`Limits::handshake_timeout`]): a connection must send the
//!   HTTP/2 connection preface (24 bytes) and the header of its first frame within it, or it
//!   is closed — a connection that sends nothing, or half a preface, holds nothing for long.
//! - **Keepalive** (set on the server, `serve.rs`): an established connection is pinged when
//!   idle and closed when the ping goes unanswered, so a peer that vanished or never speaks
//!   HTTP/2 back does not stay open either.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What a connection must send before its deadline: the client preface (24 bytes) and the
/// 9-byte header of the SETTINGS frame that follows it.
const PREFACE_BYTES: u64 = 24 + 9;

/// Descriptors kept for everything but connections: the store, the driver's sockets and
/// pipes, the sandboxes' log and agent files.
pub const RESERVED_FDS: u64 = 256;

/// The connection bounds.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    /// The default cap and `--handshake-timeout`'s default (10 s), for listeners without
    /// those flags (a node's metrics).
    fn default() -> Self {
        Limits {
            max_connections: default_max_connections(),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

/// The default cap: the descriptor limit less [`RESERVED_FDS`], at least 16, at most 4,096.
pub fn default_max_connections() -> usize {
    let soft = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(1024);
    soft.saturating_sub(RESERVED_FDS).clamp(16, 4096) as usize
}

/// `incoming`'s connections, each holding a place under the cap and watched until it has
/// sent its preface; those past the cap are closed as they come.
pub fn bounded<I, IO, E>(
    incoming: I,
    limits: Limits,
) -> impl Stream<Item = Result<Guarded<IO>, E>> + Send + 'static
where
    I: Stream<Item = Result<IO, E>> + Send + 'static,
    IO: Send + 'static,
    E: Send + 'static,
{
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let refused = Arc::new(AtomicU64::new(0));
    incoming.filter_map(move |accepted| {
        let places = places.clone();
        let refused = refused.clone();
        async move {
            let io = match accepted {
                Ok(io) => io,
                Err(e) => return Some(Err(e)),
            };
            match places.try_acquire_owned() {
                Ok(place) => Some(Ok(Guarded::new(io, place, limits.handshake_timeout))),
                Err(_) => {
                    // Dropping it closes it.
                    let n = refused.fetch_add(1, Ordering::Relaxed) + 1;
                    if n == 1 || n.is_power_of_two() {
                        tracing::warn!(
                            max = limits.max_connections,
                            refused = n,
                            "connection limit reached: new connections are closed (--max-connections)"
                        );
                    }
                    None
                }
            }
        }
    })
}

/// A connection under the bounds: its place is given back when it closes.
pub struct Guarded<IO> {
    io: IO,
    _place: OwnedSemaphorePermit,
    /// Until the preface is in: when it must be.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    read: u64,
}

impl<IO> Guarded<IO> {
    fn new(io: IO, place: OwnedSemaphorePermit, handshake: Duration) -> Self {
        Guarded {
            io,
            _place: place,
            deadline: Some(Box::pin(tokio::time::sleep(handshake))),
            read: 0,
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Guarded<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.io).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = &polled {
            this.read += (buf.filled().len() - before) as u64;
        }
        if this.read >= PREFACE_BYTES {
            this.deadline = None;
        } else if let Some(deadline) = this.deadline.as_mut()
            && polled.is_pending()
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no HTTP/2 preface, request or TLS hello within the handshake timeout",
            )));
        }
        polled
    }
}

/// For a connection wrapper that changes only what is read: its writes, and what the server
/// asks of the connection (`Connected`), go to its `io` field as they are.
macro_rules! only_reads_change {
    ($wrapper:ident) => {
        impl<IO: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $wrapper<IO> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                data: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write(cx, data)
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.io).poll_shutdown(cx)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }
        }

        impl<IO: tonic::transport::server::Connected> tonic::transport::server::Connected
            for $wrapper<IO>
        {
            type ConnectInfo = IO::ConnectInfo;

            fn connect_info(&self) -> Self::ConnectInfo {
                self.io.connect_info()
            }
        }
    };
}
pub(crate) use only_reads_change;

only_reads_change!(Guarded);

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn limits(max: usize, handshake_ms: u64) -> Limits {
        Limits {
            max_connections: max,
            handshake_timeout: Duration::from_millis(handshake_ms),
        }
    }

    #[tokio::test]
    async fn a_connection_without_its_preface_is_closed_at_the_deadline() {
        let (client, server) = tokio::io::duplex(1024);
        let place = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let mut guarded = Guarded::new(server, place, Duration::from_millis(100));
        let mut client = client;
        client.write_all(b"PRI * HTTP/2.0").await.unwrap();
        let mut buf = [0u8; 64];
        let began = std::time::Instant::now();
        assert_eq!(guarded.read(&mut buf).await.unwrap(), 14);
        let err = guarded.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(began.elapsed() >= Duration::from_millis(90));
    }

    #[tokio::test]
    async fn past_the_preface_an_idle_connection_is_not_timed_out_here() {
        let (mut client, server) = tokio::io::duplex(1024);
        let place = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        let mut guarded = Guarded::new(server, place, Duration::from_millis(50));
        client
            .write_all(&[0u8; PREFACE_BYTES as usize])
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(
            guarded.read(&mut buf).await.unwrap(),
            PREFACE_BYTES as usize
        );
        let idle = tokio::time::timeout(Duration::from_millis(200), guarded.read(&mut buf)).await;
        assert!(
            idle.is_err(),
            "an idle connection past its preface must stay open"
        );
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_and_places_come_back() {
        let (tx, rx) =
            tokio::sync::mpsc::unbounded_channel::<Result<tokio::io::DuplexStream, io::Error>>();
        let mut accepted = Box::pin(bounded(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            limits(2, 10_000),
        ));
        let mut clients = Vec::new();
        for _ in 0..3 {
            let (client, server) = tokio::io::duplex(64);
            clients.push(client);
            tx.send(Ok(server)).unwrap();
        }
        let first = accepted.next().await.unwrap().unwrap();
        let _second = accepted.next().await.unwrap().unwrap();
        // The third is taken and closed (the stream then waits for a fourth).
        assert!(
            tokio::time::timeout(Duration::from_millis(100), accepted.next())
                .await
                .is_err()
        );
        // Closed: its client reads end-of-file.
        let mut buf = [0u8; 1];
        assert_eq!(clients[2].read(&mut buf).await.unwrap(), 0);
        // One closes: the next connection gets its place.
        drop(first);
        let (client, server) = tokio::io::duplex(64);
        tx.send(Ok(server)).unwrap();
        assert!(accepted.next().await.unwrap().is_ok());
        drop(client);
    }
}
