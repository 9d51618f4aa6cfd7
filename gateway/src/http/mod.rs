//! The HTTP/1.1 plumbing of sbxd's HTTP doors — the routed service endpoints (`routes`), the
//! metrics listener (`daemon::metrics`) and the E2B API (`e2b`) — none of which is a door of
//! its own: [`listener`] is the one accept loop they share (TCP_NODELAY, the connection limits
//! of `connections::bounded`, TLS, hyper's header-read deadline), and [`bridge`] speaks a
//! request to a sandbox's port over a connection the front door forwarded (the service
//! endpoints' requests and the E2B door's `E2b-Sandbox-Port` ones).
//!
//! Transport only: nothing here names the actor API, checks access or writes an audit line.

pub mod bridge;
pub mod listener;

use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Request, Response, StatusCode};

pub use listener::serve_http1;

/// A body an HTTP door answers: a text of its own or a sandbox's streamed answer.
pub type Body = BoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// An answer of the door's own: `status` with `message` as a one-line text body.
pub fn text(status: StatusCode, message: String) -> Response<Body> {
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
pub fn host_of<B>(req: &Request<B>) -> String {
    req.headers()
        .get(hyper::header::HOST)
        .and_then(|h| h.to_str().ok())
        .map(str::to_string)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
        .unwrap_or_default()
}
