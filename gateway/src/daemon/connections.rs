//! Bounds on the connections sbxd accepts, so that callers who open connections and send
//! nothing — or nothing a credential backs — cannot take the descriptors its driver and store
//! need, nor every place the next caller needs.
//!
//! - **A cap** ([`Limits::max_connections`]): past it a new connection is closed at once.
//!   The default leaves [`RESERVED_FDS`] of the process's descriptor limit to the store, the
//!   driver and the sandboxes' plumbing: with the usual 1,024, 768 connections.
//! - **A cap per peer** ([`Limits::per_peer`], `--max-connections-per-peer`, 128 by default):
//!   one address (an IPv4 address, an IPv6 /64, which one host holds whole) holds at most
//!   this many at once, so a stranger with one address cannot take the places of everyone
//!   else (4,096 idle HTTP/2 connections from one peer once left every real call with
//!   `connection limit reached`). The Unix socket has no peers to tell apart: its callers are
//!   local, and its mode admits its owner.
//! - **A handshake deadline** ([`Limits::handshake_timeout`]): a connection must send the
//!   HTTP/2 connection preface (24 bytes) and the header of its first frame within it, or it
//!   is closed — a connection that sends nothing, or half a preface, holds nothing for long.
//! - **A proof deadline** ([`Limits::proof_timeout`], `--proof-timeout`, 10 s by default): a
//!   TCP connection that has carried no authenticated request within it of its opening is
//!   closed, however busy it keeps itself (pings answered, requests refused). What counts as
//!   proof is the listener's to say, through [`ConnProof`]: the gRPC authentication layer
//!   proves a connection when a caller authenticates ([`prove`], by the connection's two
//!   addresses), the E2B API when a key or a sandbox's token does, the service routes when a
//!   request reaches an exposed service, the metrics when a scrape asks for `/metrics`.
//! - **Keepalive** (set on the server, `serve.rs`): an established connection is pinged when
//!   idle and closed when the ping goes unanswered, so a peer that vanished or never speaks
//!   HTTP/2 back does not stay open either.
//!
//! Every refusal and every connection closed for want of proof is counted
//! (`sbx_connections_refused_total{listener, reason}`) and logged at most once a minute per
//! peer, never once per connection.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use sbx_actors::metrics::{ConnectionLabels, Metrics};
use sbx_drivers::locked;
use tokio::io::{AsyncRead, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// What a connection must send before its deadline: the client preface (24 bytes) and the
/// 9-byte header of the SETTINGS frame that follows it.
const PREFACE_BYTES: u64 = 24 + 9;

/// Descriptors kept for everything but connections: the store, the driver's sockets and
/// pipes, the sandboxes' log and agent files.
pub const RESERVED_FDS: u64 = 256;

/// The default of `--max-connections-per-peer`.
pub const DEFAULT_PER_PEER: usize = 128;

/// The default of `--proof-timeout`, seconds.
pub const DEFAULT_PROOF_TIMEOUT: u64 = 10;

/// How often a peer's refusals are logged, at most.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// The connection bounds of one listener.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_connections: usize,
    pub per_peer: usize,
    pub handshake_timeout: Duration,
    /// How long a TCP connection may stay open without an authenticated request.
    pub proof_timeout: Duration,
    /// Where refusals are counted (absent in unit tests and a node's metrics).
    pub metrics: Option<Arc<Metrics>>,
    /// The listener's name in the counts and the log (`api`, `e2b`, `service`, `metrics`).
    pub listener: &'static str,
}

impl Default for Limits {
    /// The defaults, for listeners without those flags (a node's metrics).
    fn default() -> Self {
        Limits {
            max_connections: default_max_connections(),
            per_peer: DEFAULT_PER_PEER,
            handshake_timeout: Duration::from_secs(10),
            proof_timeout: Duration::from_secs(DEFAULT_PROOF_TIMEOUT),
            metrics: None,
            listener: "api",
        }
    }
}

impl Limits {
    /// The same bounds, counted as `listener`'s.
    pub fn named(&self, listener: &'static str) -> Limits {
        Limits {
            listener,
            ..self.clone()
        }
    }

    fn count(&self, reason: &str) {
        if let Some(metrics) = &self.metrics {
            metrics
                .connections_refused
                .get_or_create(&ConnectionLabels {
                    listener: self.listener.to_string(),
                    reason: reason.to_string(),
                })
                .inc();
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

/// Who a connection comes from and which one it is.
pub trait Peer {
    /// Its two addresses, `(local, remote)`; none for a Unix socket's.
    fn addresses(&self) -> Option<(SocketAddr, SocketAddr)>;
}

impl Peer for tokio::net::TcpStream {
    fn addresses(&self) -> Option<(SocketAddr, SocketAddr)> {
        Some((self.local_addr().ok()?, self.peer_addr().ok()?))
    }
}

impl Peer for tokio::net::UnixStream {
    fn addresses(&self) -> Option<(SocketAddr, SocketAddr)> {
        None
    }
}

/// The per-peer cap's key: an IPv4 address, or an IPv6 address's /64 (an IPv4-mapped one as
/// its IPv4 address).
fn peer_key(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V4(v4) => IpAddr::V4(v4),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
    }
}

/// Whether a connection has carried an authenticated request. Shared between the connection
/// (which closes itself at its deadline without one) and whoever authenticates its requests.
#[derive(Debug, Clone, Default)]
pub struct ConnProof(Arc<AtomicBool>);

impl ConnProof {
    /// A request on the connection was authenticated: its deadline is lifted.
    pub fn prove(&self) {
        self.0.store(true, Ordering::Relaxed);
    }

    fn proven(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// The open TCP connections of the gRPC listeners by their two addresses, for [`prove`].
fn open_proofs() -> &'static Mutex<HashMap<(SocketAddr, SocketAddr), ConnProof>> {
    static OPEN: OnceLock<Mutex<HashMap<(SocketAddr, SocketAddr), ConnProof>>> = OnceLock::new();
    OPEN.get_or_init(Default::default)
}

/// The connection between `local` and `remote` carried an authenticated request.
pub fn prove(local: SocketAddr, remote: SocketAddr) {
    if let Some(proof) = locked(open_proofs()).get(&(local, remote)) {
        proof.prove();
    }
}

/// The open connections of each peer, and when each peer's refusals were last logged.
#[derive(Default)]
struct Peers {
    open: HashMap<IpAddr, usize>,
    logged: HashMap<IpAddr, Instant>,
}

/// A connection's place in its peer's count, given back when it closes.
struct PeerPlace {
    peers: Arc<Mutex<Peers>>,
    key: IpAddr,
    /// Its entry in [`open_proofs`], removed when it closes.
    addresses: Option<(SocketAddr, SocketAddr)>,
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        let mut peers = locked(&self.peers);
        if let Some(n) = peers.open.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                peers.open.remove(&self.key);
            }
        }
        drop(peers);
        if let Some(addresses) = self.addresses {
            locked(open_proofs()).remove(&addresses);
        }
    }
}

/// Whether `key`'s refusal should be logged now (once a minute per peer; the memory of whom
/// was logged is bounded).
fn log_now(peers: &mut Peers, key: IpAddr) -> bool {
    let now = Instant::now();
    if peers.logged.len() > 4096 {
        peers
            .logged
            .retain(|_, at| now.duration_since(*at) < LOG_EVERY);
    }
    match peers.logged.get(&key) {
        Some(at) if now.duration_since(*at) < LOG_EVERY => false,
        _ => {
            peers.logged.insert(key, now);
            true
        }
    }
}

/// `incoming`'s connections, each holding a place under the cap and its peer's, watched
/// until it has sent its preface and, over TCP, until it carried an authenticated request;
/// those past a cap are closed as they come.
pub fn bounded<I, IO, E>(
    incoming: I,
    limits: Limits,
) -> impl Stream<Item = Result<Guarded<IO>, E>> + Send + 'static
where
    I: Stream<Item = Result<IO, E>> + Send + 'static,
    IO: Peer + Send + 'static,
    E: Send + 'static,
{
    let places = Arc::new(Semaphore::new(limits.max_connections));
    let peers = Arc::new(Mutex::new(Peers::default()));
    let global_logged = Arc::new(Mutex::new(None::<Instant>));
    incoming.filter_map(move |accepted| {
        let places = places.clone();
        let peers = peers.clone();
        let global_logged = global_logged.clone();
        let limits = limits.clone();
        async move {
            let io = match accepted {
                Ok(io) => io,
                Err(e) => return Some(Err(e)),
            };
            let addresses = io.addresses();
            let peer = match addresses {
                Some((_, remote)) => {
                    let key = peer_key(remote.ip());
                    let mut all = locked(&peers);
                    let open = all.open.get(&key).copied().unwrap_or(0);
                    if open >= limits.per_peer {
                        limits.count("peer_limit");
                        if log_now(&mut all, key) {
                            tracing::warn!(
                                listener = limits.listener,
                                peer = %key,
                                per_peer = limits.per_peer,
                                "a peer holds as many connections as one may: its new ones are                                  closed (--max-connections-per-peer; logged once a minute)"
                            );
                        }
                        return None;
                    }
                    *all.open.entry(key).or_insert(0) += 1;
                    drop(all);
                    let proof = ConnProof::default();
                    if let Some(addresses) = addresses {
                        locked(open_proofs()).insert(addresses, proof.clone());
                    }
                    Some((
                        PeerPlace {
                            peers: peers.clone(),
                            key,
                            addresses,
                        },
                        proof,
                    ))
                }
                None => None,
            };
            match places.try_acquire_owned() {
                Ok(place) => Some(Ok(Guarded::new(io, place, peer, &limits))),
                Err(_) => {
                    // Dropping it (and its peer place) closes it.
                    limits.count("limit");
                    let mut last = locked(&global_logged);
                    if last.is_none_or(|at| at.elapsed() >= LOG_EVERY) {
                        *last = Some(Instant::now());
                        tracing::warn!(
                            listener = limits.listener,
                            max = limits.max_connections,
                            "connection limit reached: new connections are closed                              (--max-connections; logged once a minute)"
                        );
                    }
                    None
                }
            }
        }
    })
}

/// A connection under the bounds: its places are given back when it closes.
pub struct Guarded<IO> {
    io: IO,
    _place: OwnedSemaphorePermit,
    /// Until the preface is in: when it must be.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    read: u64,
    /// Over TCP, until a request is authenticated: its proof, and when it must come.
    proof: Option<(ConnProof, Pin<Box<tokio::time::Sleep>>)>,
    /// Its place in its peer's count (TCP).
    _peer: Option<PeerPlace>,
    /// Where a close for want of proof is counted.
    limits: Limits,
}

impl<IO> Guarded<IO> {
    fn new(
        io: IO,
        place: OwnedSemaphorePermit,
        peer: Option<(PeerPlace, ConnProof)>,
        limits: &Limits,
    ) -> Self {
        let (peer, proof) = match peer {
            Some((place, proof)) => (
                Some(place),
                Some((proof, Box::pin(tokio::time::sleep(limits.proof_timeout)))),
            ),
            None => (None, None),
        };
        Guarded {
            io,
            _place: place,
            deadline: Some(Box::pin(tokio::time::sleep(limits.handshake_timeout))),
            read: 0,
            proof,
            _peer: peer,
            limits: limits.clone(),
        }
    }

    /// What the listener's requests use to prove the connection (TCP only).
    pub fn proof(&self) -> Option<ConnProof> {
        self.proof.as_ref().map(|(p, _)| p.clone())
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
        if let Some((proof, due)) = this.proof.as_mut() {
            if proof.proven() {
                this.proof = None;
            } else if due.as_mut().poll(cx).is_ready() {
                // Busy or idle: a connection nothing authenticated goes at its deadline.
                this.proof = None;
                this.limits.count("unproven");
                return Poll::Ready(Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "no authenticated request within the proof timeout",
                )));
            }
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
            per_peer: 2,
            handshake_timeout: Duration::from_millis(handshake_ms),
            proof_timeout: Duration::from_millis(300),
            metrics: None,
            listener: "test",
        }
    }

    /// A test's connection: a duplex pipe that says it comes from `remote` (none: a Unix
    /// socket's).
    struct Fake {
        io: tokio::io::DuplexStream,
        remote: Option<SocketAddr>,
    }

    impl Peer for Fake {
        fn addresses(&self) -> Option<(SocketAddr, SocketAddr)> {
            self.remote
                .map(|r| (SocketAddr::from(([127, 0, 0, 1], 9)), r))
        }
    }

    impl AsyncRead for Fake {
        fn poll_read(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut ReadBuf<'_>,
        ) -> Poll<io::Result<()>> {
            Pin::new(&mut self.io).poll_read(cx, buf)
        }
    }

    fn fake(remote: Option<&str>) -> (tokio::io::DuplexStream, Fake) {
        let (client, server) = tokio::io::duplex(1024);
        let remote = remote.map(|r| r.parse().unwrap());
        (client, Fake { io: server, remote })
    }

    fn unix_guarded(server: Fake, limits: &Limits) -> Guarded<Fake> {
        let place = Arc::new(Semaphore::new(1)).try_acquire_owned().unwrap();
        Guarded::new(server, place, None, limits)
    }

    #[tokio::test]
    async fn a_connection_without_its_preface_is_closed_at_the_deadline() {
        let (mut client, server) = fake(None);
        let mut guarded = unix_guarded(server, &limits(1, 100));
        client.write_all(b"PRI * HTTP/2.0").await.unwrap();
        let mut buf = [0u8; 64];
        let began = std::time::Instant::now();
        assert_eq!(guarded.read(&mut buf).await.unwrap(), 14);
        let err = guarded.read(&mut buf).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut);
        assert!(began.elapsed() >= Duration::from_millis(90));
    }

    #[tokio::test]
    async fn past_the_preface_an_idle_unix_connection_is_not_timed_out_here() {
        let (mut client, server) = fake(None);
        let mut guarded = unix_guarded(server, &limits(1, 50));
        client
            .write_all(&[0u8; PREFACE_BYTES as usize])
            .await
            .unwrap();
        let mut buf = [0u8; 64];
        assert_eq!(
            guarded.read(&mut buf).await.unwrap(),
            PREFACE_BYTES as usize
        );
        let idle = tokio::time::timeout(Duration::from_millis(500), guarded.read(&mut buf)).await;
        assert!(
            idle.is_err(),
            "an idle connection past its preface must stay open"
        );
    }

    /// Over TCP: a connection that keeps talking but carries no authenticated request is
    /// closed at the proof deadline; one proven (by its addresses, as the gRPC layer proves
    /// it) stays open past it.
    #[tokio::test]
    async fn a_tcp_connection_without_an_authenticated_request_is_closed_at_its_deadline() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Fake, io::Error>>();
        let mut accepted = Box::pin(bounded(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            limits(8, 10_000),
        ));
        let (mut talker, server) = fake(Some("127.0.0.7:1000"));
        tx.send(Ok(server)).unwrap();
        let mut unproven = accepted.next().await.unwrap().unwrap();
        let (mut proven_client, server) = fake(Some("127.0.0.7:1001"));
        tx.send(Ok(server)).unwrap();
        let mut proven = accepted.next().await.unwrap().unwrap();
        prove(
            SocketAddr::from(([127, 0, 0, 1], 9)),
            "127.0.0.7:1001".parse().unwrap(),
        );
        let began = std::time::Instant::now();
        let mut buf = [0u8; 64];
        // The unproven one talks all along, and is closed all the same.
        let closed = loop {
            talker.write_all(&[0u8; 8]).await.unwrap();
            match tokio::time::timeout(Duration::from_millis(50), unproven.read(&mut buf)).await {
                Ok(Err(e)) => break e,
                _ if began.elapsed() > Duration::from_secs(5) => panic!("never closed"),
                _ => {}
            }
        };
        assert_eq!(closed.kind(), io::ErrorKind::TimedOut);
        assert!(began.elapsed() >= Duration::from_millis(250));
        proven_client
            .write_all(&[0u8; PREFACE_BYTES as usize])
            .await
            .unwrap();
        assert_eq!(proven.read(&mut buf).await.unwrap(), PREFACE_BYTES as usize);
        let idle = tokio::time::timeout(Duration::from_millis(400), proven.read(&mut buf)).await;
        assert!(
            idle.is_err(),
            "a proven connection must stay open: {idle:?}"
        );
    }

    /// One peer holds at most its share; another peer is served meanwhile; a place comes back
    /// when a connection closes; an IPv6 /64 is one peer.
    #[tokio::test]
    async fn one_peer_holds_at_most_its_share_and_others_are_served() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Fake, io::Error>>();
        let mut accepted = Box::pin(bounded(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            limits(8, 10_000),
        ));
        let mut clients = Vec::new();
        for port in 0..3 {
            let (client, server) = fake(Some(&format!("127.0.0.2:{}", 2000 + port)));
            clients.push(client);
            tx.send(Ok(server)).unwrap();
        }
        let first = accepted.next().await.unwrap().unwrap();
        let _second = accepted.next().await.unwrap().unwrap();
        let (_other, server) = fake(Some("127.0.0.3:2000"));
        tx.send(Ok(server)).unwrap();
        // The third of 127.0.0.2 was closed; 127.0.0.3's is next.
        let third = accepted.next().await.unwrap().unwrap();
        assert_eq!(
            third.io.remote,
            Some("127.0.0.3:2000".parse().unwrap()),
            "the other peer's connection is served"
        );
        let mut buf = [0u8; 1];
        assert_eq!(clients[2].read(&mut buf).await.unwrap(), 0);
        drop(first);
        let (_again, server) = fake(Some("127.0.0.2:2009"));
        tx.send(Ok(server)).unwrap();
        assert!(accepted.next().await.unwrap().is_ok());
        // Two addresses of one /64 are one peer.
        assert_eq!(
            peer_key("2001:db8::1".parse().unwrap()),
            peer_key("2001:db8::ffff:2".parse().unwrap())
        );
        assert_ne!(
            peer_key("2001:db8::1".parse().unwrap()),
            peer_key("2001:db8:0:1::1".parse().unwrap())
        );
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_and_places_come_back() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Result<Fake, io::Error>>();
        let mut accepted = Box::pin(bounded(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
            limits(2, 10_000),
        ));
        let mut clients = Vec::new();
        for _ in 0..3 {
            let (client, server) = fake(None);
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
        let (client, server) = fake(None);
        tx.send(Ok(server)).unwrap();
        assert!(accepted.next().await.unwrap().is_ok());
        drop(client);
    }
}
