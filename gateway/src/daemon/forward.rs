//! Forwarding: gateways sharing a store serve each workspace on one gateway at a time (its
//! lease holder); a request that reaches another gateway is sent on to the holder, and the
//! holder's answer goes back to the client as it is. So a client may send any request to any
//! gateway.
//!
//! How: this layer sits inside authentication. It passes each request on, keeping a copy of
//! the request's bytes as the handler reads them (at most [`RECORD_LIMIT`]). When the answer
//! is `UNAVAILABLE` with [`HOLDER_HEADER`] — the router found the workspace held elsewhere
//! (`ActorError::HeldElsewhere`), before acting — the layer replays the copy, followed by
//! whatever the client still sends (a stream's later messages), to the holder over HTTP/2,
//! and answers with the holder's response, streamed. One layer serves every RPC, unary and
//! streaming alike, with no per-method code: the handler itself decides, from the message,
//! which workspace a request is about.
//!
//! What it does not forward, answering the original `UNAVAILABLE` naming the holder instead:
//! a request already forwarded once ([`FORWARDED_HEADER`]: leases moving under it must not
//! bounce it around); one whose bytes read before the answer passed [`RECORD_LIMIT`]; one
//! whose caller is known by something the holder cannot check again (a client certificate,
//! the Unix socket's peer uid) — only a bearer token travels, and the holder checks it against
//! its own identities, so every gateway of a store must hold the same identities file; and
//! one whose holder cannot be reached. That answer names the holder (its id and address) only
//! to a gateway-wide caller: a tenant's grant is for some workspaces, and the store's gateways
//! are none of its business ([`for_caller`]).

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http_body::{Body as HttpBody, Frame, SizeHint};
use tonic::body::Body;
use tonic::codegen::http::{self, HeaderMap, HeaderValue};
use tonic::codegen::{Bytes, Service};
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};

/// The header of an `UNAVAILABLE` answer naming the address of the workspace's holder.
pub const HOLDER_HEADER: &str = "sbx-holder";

/// The header of a forwarded request: the id of the gateway that forwarded it.
pub const FORWARDED_HEADER: &str = "sbx-forwarded-by";

/// The bytes of a request kept for a replay, at most: a create's largest spec (256 KiB) and
/// then some. A request that read more before its answer is not forwarded.
pub const RECORD_LIMIT: usize = 1 << 20;

/// How long a connection to a holder may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// HTTP/2 pings to a holder every this long, and the connection is dropped when one is not
/// answered within it.
const KEEPALIVE: Duration = Duration::from_secs(5);

/// Headers of one HTTP/2 hop, never sent on.
const HOP_HEADERS: [&str; 6] = [
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "host",
    "proxy-connection",
];

/// The other gateways of the store, as this one reaches them.
pub struct Peers {
    /// This gateway's id, put in [`FORWARDED_HEADER`].
    me: HeaderValue,
    /// TLS to the holders (when this gateway serves TLS, so do they), checked against this.
    tls: Option<ClientTlsConfig>,
    /// `--auth none`: every caller may be forwarded (the holder takes anyone too).
    anyone: bool,
    channels: Mutex<HashMap<String, Channel>>,
}

impl Peers {
    pub fn new(me: uuid::Uuid, tls: Option<ClientTlsConfig>, anyone: bool) -> Peers {
        Peers {
            me: HeaderValue::from_str(&me.to_string()).expect("a uuid is a header value"),
            tls,
            anyone,
            channels: Mutex::new(HashMap::new()),
        }
    }

    /// This gateway's id, as a forwarded request names it ([`FORWARDED_HEADER`]).
    pub(crate) fn me(&self) -> HeaderValue {
        self.me.clone()
    }

    /// `--auth none`: a call may be forwarded without a credential.
    pub(crate) fn anyone(&self) -> bool {
        self.anyone
    }

    /// Whether a request with these headers may be forwarded: not forwarded before, and its
    /// caller proven by something the holder checks again.
    fn may_forward(&self, headers: &HeaderMap) -> bool {
        !headers.contains_key(FORWARDED_HEADER)
            && (self.anyone || headers.contains_key(http::header::AUTHORIZATION))
    }

    /// The connection to the gateway at `address` (one per address, made on first use and
    /// kept: HTTP/2 multiplexes every forwarded call on it, and it reconnects by itself).
    pub(crate) fn channel(&self, address: &str) -> Result<Channel, String> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(channel) = channels.get(address) {
            return Ok(channel.clone());
        }
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
            .map_err(|e| format!("the holder's address {address:?}: {e}"))?
            .connect_timeout(CONNECT_TIMEOUT)
            .tcp_nodelay(true)
            // A holder paused or cut off without a reset is found out, and the calls
            // forwarded to it end, instead of waiting for ever.
            .http2_keep_alive_interval(KEEPALIVE)
            .keep_alive_timeout(KEEPALIVE)
            .keep_alive_while_idle(true);
        if let Some(tls) = &self.tls {
            endpoint = endpoint
                .tls_config(tls.clone())
                .map_err(|e| format!("TLS to {address}: {e}"))?;
        }
        let channel = endpoint.connect_lazy();
        channels.insert(address.to_string(), channel.clone());
        Ok(channel)
    }

    async fn forward(
        &self,
        address: &str,
        head: Head,
        body: Replay,
    ) -> Result<http::Response<Body>, String> {
        let mut channel = self.channel(address)?;
        let mut request = http::Request::new(Body::new(body));
        *request.method_mut() = head.method;
        *request.uri_mut() = head.uri;
        let headers = request.headers_mut();
        *headers = head.headers;
        for hop in HOP_HEADERS {
            headers.remove(hop);
        }
        headers.insert(FORWARDED_HEADER, self.me.clone());
        std::future::poll_fn(|cx| channel.poll_ready(cx))
            .await
            .map_err(|e| format!("{address}: {e}"))?;
        channel
            .call(request)
            .await
            .map_err(|e| format!("{address}: {e}"))
    }
}

/// What the forward of a request keeps of it besides its body.
struct Head {
    method: http::Method,
    uri: http::Uri,
    headers: HeaderMap,
}

/// Forwards requests for a workspace held by another gateway to it (see the module's doc);
/// `None` (one gateway, no shared store): passes every request through.
#[derive(Clone)]
pub struct ForwardLayer(pub Option<Arc<Peers>>);

impl<S> tower::Layer<S> for ForwardLayer {
    type Service = ForwardService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ForwardService {
            inner,
            peers: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct ForwardService<S> {
    inner: S,
    peers: Option<Arc<Peers>>,
}

type Answer<E> = Pin<Box<dyn Future<Output = Result<http::Response<Body>, E>> + Send>>;

impl<S> Service<http::Request<Body>> for ForwardService<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = Answer<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let scoped = req
            .extensions()
            .get::<crate::auth::Caller>()
            .is_none_or(|c| c.is_scoped());
        let peers = match &self.peers {
            Some(peers) if peers.may_forward(req.headers()) => Arc::clone(peers),
            _ => {
                let answer = self.inner.call(req);
                return Box::pin(async move { Ok(for_caller(answer.await?, scoped)) });
            }
        };
        let (parts, body) = req.into_parts();
        let head = Head {
            method: parts.method.clone(),
            uri: parts.uri.clone(),
            headers: parts.headers.clone(),
        };
        let tee = Arc::new(Mutex::new(Tee {
            body: Some(body),
            recorded: VecDeque::new(),
            len: 0,
            overflow: false,
            ended: false,
        }));
        let req = http::Request::from_parts(parts, Body::new(TeeBody(Arc::clone(&tee))));
        let answer = self.inner.call(req);
        Box::pin(async move {
            let response = answer.await?;
            let Some(address) = response
                .headers()
                .get(HOLDER_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
            else {
                // Served here: the copy is no longer needed (a long stream would otherwise
                // keep up to the limit of its input for its whole life).
                let mut tee = tee.lock().unwrap_or_else(|p| p.into_inner());
                tee.overflow = true;
                tee.recorded = VecDeque::new();
                return Ok(response);
            };
            let replay = {
                let mut tee = tee.lock().unwrap_or_else(|p| p.into_inner());
                if tee.overflow {
                    None
                } else {
                    let rest = if tee.ended { None } else { tee.body.take() };
                    Some(Replay {
                        recorded: std::mem::take(&mut tee.recorded),
                        rest,
                    })
                }
            };
            let Some(replay) = replay else {
                tracing::info!(path = %head.uri.path(), "not forwarded: the request was longer than the forwarding copy");
                return Ok(for_caller(response, scoped));
            };
            let path = head.uri.path().to_string();
            match peers.forward(&address, head, replay).await {
                Ok(forwarded) => {
                    tracing::debug!(%path, holder = %address, "forwarded to the workspace's holder");
                    Ok(forwarded)
                }
                Err(e) => {
                    tracing::warn!(%path, holder = %address, "cannot forward to the workspace's holder: {e}");
                    Ok(for_caller(response, scoped))
                }
            }
        })
    }
}

/// An answer that names the workspace's holder (`HELD_ELSEWHERE`), as a `scoped` caller may
/// see it: `UNAVAILABLE` saying the workspace is served by another gateway, without that
/// gateway's id or address. Any other answer, or any answer to a gateway-wide caller, as it is.
fn for_caller(response: http::Response<Body>, scoped: bool) -> http::Response<Body> {
    if !scoped || !response.headers().contains_key(HOLDER_HEADER) {
        return response;
    }
    tonic::Status::unavailable(
        "this workspace is served by another gateway of the store, which this one could not \
         reach with the request: try again, or call the gateway that serves it",
    )
    .into_http()
}

/// A request's body as it passes to the handler, with a copy of its data kept for a replay.
struct Tee {
    /// What the client has not sent yet (taken by a replay).
    body: Option<Body>,
    recorded: VecDeque<Bytes>,
    len: usize,
    /// More than [`RECORD_LIMIT`] was read: nothing is kept, and no replay is possible.
    overflow: bool,
    /// The client's body ended.
    ended: bool,
}

struct TeeBody(Arc<Mutex<Tee>>);

impl HttpBody for TeeBody {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        let mut tee = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let Some(body) = tee.body.as_mut() else {
            return Poll::Ready(None);
        };
        let frame = ready!(Pin::new(body).poll_frame(cx));
        match &frame {
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref()
                    && !tee.overflow
                {
                    tee.len += data.len();
                    if tee.len > RECORD_LIMIT {
                        tee.overflow = true;
                        tee.recorded.clear();
                    } else {
                        tee.recorded.push_back(data.clone());
                    }
                }
            }
            Some(Err(_)) => {}
            None => tee.ended = true,
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        let tee = self.0.lock().unwrap_or_else(|p| p.into_inner());
        tee.body.as_ref().is_none_or(|b| b.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let tee = self.0.lock().unwrap_or_else(|p| p.into_inner());
        tee.body.as_ref().map(|b| b.size_hint()).unwrap_or_default()
    }
}

/// A forwarded request's body: what the handler read, then the rest from the client.
struct Replay {
    recorded: VecDeque<Bytes>,
    rest: Option<Body>,
}

impl HttpBody for Replay {
    type Data = Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, tonic::Status>>> {
        if let Some(data) = self.recorded.pop_front() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        match self.rest.as_mut() {
            Some(rest) => Pin::new(rest).poll_frame(cx),
            None => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.recorded.is_empty() && self.rest.as_ref().is_none_or(|b| b.is_end_stream())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn data(chunks: &[&'static str]) -> Body {
        let frames: Vec<Result<Frame<Bytes>, tonic::Status>> = chunks
            .iter()
            .map(|c| Ok(Frame::data(Bytes::from_static(c.as_bytes()))))
            .collect();
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(
            frames,
        )))
    }

    fn tee_of(body: Body) -> Arc<Mutex<Tee>> {
        Arc::new(Mutex::new(Tee {
            body: Some(body),
            recorded: VecDeque::new(),
            len: 0,
            overflow: false,
            ended: false,
        }))
    }

    /// What the handler read and what it did not, replayed in order: the holder sees the
    /// request the client sent, byte for byte.
    #[tokio::test]
    async fn a_replay_is_what_was_read_then_the_rest() {
        let tee = tee_of(data(&["one", "two", "three"]));
        let mut seen = TeeBody(Arc::clone(&tee));
        let first = seen.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "one");
        drop(seen);
        let replay = {
            let mut t = tee.lock().unwrap();
            Replay {
                recorded: std::mem::take(&mut t.recorded),
                rest: t.body.take(),
            }
        };
        let all = replay.collect().await.unwrap().to_bytes();
        assert_eq!(all, "onetwothree");
    }

    /// A request longer than the limit keeps nothing: it cannot be replayed.
    #[tokio::test]
    async fn past_the_limit_nothing_is_kept() {
        let big: &'static str = Box::leak("x".repeat(RECORD_LIMIT).into_boxed_str());
        let tee = tee_of(data(&[big, "y"]));
        let read = TeeBody(Arc::clone(&tee))
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(read.len(), RECORD_LIMIT + 1);
        let t = tee.lock().unwrap();
        assert!(t.overflow && t.recorded.is_empty() && t.ended);
    }

    #[test]
    fn only_callers_the_holder_can_check_again_are_forwarded_and_only_once() {
        let mut headers = HeaderMap::new();
        let tokens = Peers::new(uuid::Uuid::new_v4(), None, false);
        assert!(!tokens.may_forward(&headers), "no credential that travels");
        headers.insert(
            http::header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sbx_x"),
        );
        assert!(tokens.may_forward(&headers));
        headers.insert(FORWARDED_HEADER, HeaderValue::from_static("other"));
        assert!(!tokens.may_forward(&headers), "forwarded once already");
        let anyone = Peers::new(uuid::Uuid::new_v4(), None, true);
        assert!(anyone.may_forward(&HeaderMap::new()));
    }
}
