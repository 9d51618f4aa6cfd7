//! The Connect protocol as the E2B in-sandbox API speaks it (JSON): unary errors (a code and
//! its HTTP status: the front door's class table, [`crate::frontdoor::Class`]), 5-byte
//! envelopes, server streams fed by a task and ended in band.

use futures::StreamExt;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Bytes, Frame};
use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Body;

/// A Connect error (unary): its code string and HTTP status.
pub(super) fn connect_error(code: &str, message: impl Into<String>) -> Response<Body> {
    let status = match code {
        "canceled" => StatusCode::from_u16(499).unwrap_or(StatusCode::BAD_REQUEST),
        "invalid_argument" | "failed_precondition" | "out_of_range" => StatusCode::BAD_REQUEST,
        "unauthenticated" => StatusCode::UNAUTHORIZED,
        "permission_denied" => StatusCode::FORBIDDEN,
        "not_found" => StatusCode::NOT_FOUND,
        "already_exists" | "aborted" => StatusCode::CONFLICT,
        "resource_exhausted" => StatusCode::TOO_MANY_REQUESTS,
        "unimplemented" => StatusCode::NOT_IMPLEMENTED,
        "unavailable" => StatusCode::SERVICE_UNAVAILABLE,
        "deadline_exceeded" => StatusCode::GATEWAY_TIMEOUT,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    super::json_response(status, &json!({"code": code, "message": message.into()}))
}

/// The Connect code of a front-door failure: its class's.
pub(super) fn code_of(f: &crate::frontdoor::Failure) -> &'static str {
    f.class.connect_code()
}

/// An enveloped stream message: flags, big-endian length, the JSON.
pub(super) fn frame(flags: u8, value: &Value) -> Bytes {
    let json = value.to_string().into_bytes();
    let mut out = Vec::with_capacity(json.len() + 5);
    out.push(flags);
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(&json);
    Bytes::from(out)
}

/// The messages of an enveloped request body (a streaming call's; one for Start and Connect).
pub(super) fn unframe(mut body: &[u8]) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    while !body.is_empty() {
        if body.len() < 5 {
            return Err("a Connect envelope shorter than its 5-byte header".into());
        }
        let flags = body[0];
        let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
        if body.len() < 5 + len {
            return Err(format!(
                "a Connect envelope says {len} bytes and holds fewer"
            ));
        }
        if flags & 0x01 != 0 {
            return Err("compressed Connect messages are not accepted".into());
        }
        let message: Value = serde_json::from_slice(&body[5..5 + len])
            .map_err(|e| format!("a Connect message is not JSON: {e}"))?;
        if flags & 0x02 == 0 {
            out.push(message);
        }
        body = &body[5 + len..];
    }
    Ok(out)
}

/// A server stream's answer: HTTP 200, `application/connect+json`, the frames `frames` yields.
pub(super) fn stream_response(frames: mpsc::Receiver<Bytes>) -> Response<Body> {
    let frames = tokio_stream::wrappers::ReceiverStream::new(frames);
    let body = StreamBody::new(frames.map(|b| Ok::<_, std::convert::Infallible>(Frame::data(b))));
    let mut response = Response::new(BodyExt::map_err(body, |never| match never {}).boxed());
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        "application/connect+json".parse().expect("a header value"),
    );
    response
}

/// A server stream that is only an error (in band, as Connect streams answer).
pub(super) fn stream_error(code: &str, message: &str) -> Response<Body> {
    let end = frame(0x02, &json!({"error": {"code": code, "message": message}}));
    let (tx, rx) = mpsc::channel(1);
    let _ = tx.try_send(end);
    stream_response(rx)
}

/// A stream fed by a task (`body` sends into it); the task ends with the stream's reader.
pub(super) fn async_stream<F, Fut>(body: F) -> mpsc::Receiver<Bytes>
where
    F: FnOnce(mpsc::Sender<Bytes>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(body(tx));
    rx
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn envelopes_round_trip_and_bad_ones_are_refused() {
        let one = frame(0, &json!({"a": 1}));
        let end = frame(0x02, &json!({}));
        let both = [one.as_ref(), end.as_ref()].concat();
        assert_eq!(unframe(&both).unwrap(), vec![json!({"a": 1})]);
        assert!(unframe(&one[..3]).is_err());
        assert!(unframe(&one[..one.len() - 1]).is_err());
        let mut compressed = one.to_vec();
        compressed[0] = 1;
        assert!(unframe(&compressed).is_err());
        let mut not_json = frame(0, &json!("x")).to_vec();
        not_json[5] = b'{';
        assert!(unframe(&not_json).is_err());
    }
}
