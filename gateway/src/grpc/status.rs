//! The one place where an [`ActorError`] becomes a gRPC [`Status`].
//!
//! Every status carries a `google.rpc.ErrorInfo` detail with domain [`ERROR_DOMAIN`] and an
//! UPPER_SNAKE reason, so clients branch on the reason, never on the message text. The
//! message is the error's own text, which names the workspace or sandbox concerned.
//!
//! | reason | code |
//! |---|---|
//! | `WORKSPACE_NOT_FOUND`, `SANDBOX_NOT_FOUND` | `NOT_FOUND` |
//! | `NAME_TAKEN` | `ALREADY_EXISTS` |
//! | `AMBIGUOUS_NAME` | `FAILED_PRECONDITION` — the request is well formed; what makes it unanswerable is the current state (the name exists in several workspaces), and it becomes answerable once the caller names the workspace |
//! | `WORKSPACE_TERMINATING`, `WORKSPACE_NOT_EMPTY`, `FAILED_PRECONDITION` | `FAILED_PRECONDITION` |
//! | `INVALID_NAME`, `INVALID_ARGUMENT` | `INVALID_ARGUMENT` |
//! | `UNIMPLEMENTED` | `UNIMPLEMENTED` |
//! | `UNAVAILABLE` | `UNAVAILABLE` |
//! | `RESOURCE_VERSION_TOO_OLD` | `OUT_OF_RANGE` |
//! | `IMAGE_NOT_FOUND` | `NOT_FOUND` |
//! | `IMAGE_IN_USE` | `FAILED_PRECONDITION` (metadata `users`: the sandboxes, workspace/name) |
//! | `IMAGE_REFERENCE_INVALID`, `IMAGE_INVALID` (unsafe, malformed or mismatched content), `IMAGE_INVALID_ARGUMENT`, `IMAGE_PLATFORM` | `INVALID_ARGUMENT` |
//! | `REGISTRY_UNAVAILABLE` | `UNAVAILABLE` |
//! | `REGISTRY_UNAUTHORIZED` | `PERMISSION_DENIED` |
//! | `REGISTRY_DEADLINE` (a pull over `--pull-timeout`; nothing of it kept) | `DEADLINE_EXCEEDED` |
//! | `IMAGE_TOO_LARGE` (over `--image-max-layers`, `-size` or `-files`; the message names it) | `RESOURCE_EXHAUSTED` |
//! | `IMAGE_STORE_FULL` (the add would leave less than `--image-min-free` free; the message names the free space) | `RESOURCE_EXHAUSTED` |
//! | `IMAGE_CANCELLED` (the add was cancelled; nothing of it kept) | `CANCELLED` |
//! | `IMAGE_NAME_RESERVED` (a client wrote a `sbx.local/*` name, the gateway's own) | `PERMISSION_DENIED` |
//! | `IMAGE_STORE` (the image store's own files failed) | `INTERNAL` |
//! | `DRIVER_*` | the driver error's own kind (see `frontdoor::error`) |
//! | `DISK_FULL` (the disk holding the store is full; the message names its path, from `DATA`; nothing was written, reads keep working) | `RESOURCE_EXHAUSTED` |
//! | `INTERNAL` (a store failure or a bug) | `INTERNAL` |
//! | `REQUEST_TOO_LARGE` (a message over the service's decode limit) | `RESOURCE_EXHAUSTED` |
//! | `MALFORMED_REQUEST` (a message that does not decode) | `INVALID_ARGUMENT` (`INTERNAL` for a framing error, as gRPC requires) |
//! | the code's name (`UNIMPLEMENTED`, `NOT_FOUND`…) for any other status that came without one | its code |
//!
//! Bounded whatever builds it: a message is cut to [`MAX_ERROR_MESSAGE_BYTES`] and an
//! ErrorInfo metadata value to [`MAX_ERROR_METADATA_VALUE_BYTES`], so no error can echo a
//! megabyte of input into headers (a stock gRPC client refuses more than 16 KiB of them, and
//! the reason is then lost). [`ErrorInfoLayer`] wraps the whole server: a status that tonic
//! made itself before any handler ran (a message over the decode limit, one that does not
//! decode, an unknown method) or that a handler made without a detail gets its ErrorInfo
//! there, and any status over the bounds is cut there — in the headers of a trailers-only
//! answer and in the trailers of a stream alike.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http_body::{Body as HttpBody, Frame, SizeHint};
use sbx_actors::ActorError;
#[cfg(test)]
use sbx_actors::ImageFailure;
use sbx_actors::limits::{MAX_ERROR_MESSAGE_BYTES, MAX_ERROR_METADATA_VALUE_BYTES, truncate};
#[cfg(test)]
use sbx_drivers::DriverError;
use tonic::codegen::http::{self, HeaderMap};
use tonic::codegen::{Bytes, Service};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::frontdoor::{Class, Failure};

/// The `ErrorInfo.domain` of every error sbxd answers.
pub const ERROR_DOMAIN: &str = "sbx.dev";

/// Maps an actor-layer error to the gRPC status the client sees: its front-door class
/// ([`Failure`]) as gRPC says it ([`status_of`]).
pub fn actor_error_to_status(err: &ActorError) -> Status {
    status_of(&Failure::from(err))
}

/// The gRPC code of a front-door class: the class is the code, but for
/// [`Class::Elsewhere`], which is `UNAVAILABLE` naming the holder.
pub fn grpc_code(class: Class) -> Code {
    match class {
        Class::Cancelled => Code::Cancelled,
        Class::InvalidArgument => Code::InvalidArgument,
        Class::DeadlineExceeded => Code::DeadlineExceeded,
        Class::NotFound => Code::NotFound,
        Class::AlreadyExists => Code::AlreadyExists,
        Class::PermissionDenied => Code::PermissionDenied,
        Class::Unauthenticated => Code::Unauthenticated,
        Class::ResourceExhausted => Code::ResourceExhausted,
        Class::FailedPrecondition => Code::FailedPrecondition,
        Class::Aborted => Code::Aborted,
        Class::OutOfRange => Code::OutOfRange,
        Class::Unimplemented => Code::Unimplemented,
        Class::Internal => Code::Internal,
        Class::Unavailable | Class::Elsewhere => Code::Unavailable,
    }
}

pub use crate::frontdoor::forward::class_of;

/// The gRPC status of a front-door failure: its class's code, its message, an ErrorInfo of
/// its reason and metadata (none for a [`Failure::bare`] one: the server's layer adds it);
/// a workspace held elsewhere also names the holder in [`HOLDER_HEADER`], where the
/// forwarding layer (`daemon::forward`) sends the request.
///
/// [`HOLDER_HEADER`]: crate::daemon::forward::HOLDER_HEADER
pub fn status_of(failure: &Failure) -> Status {
    let code = grpc_code(failure.class);
    if failure.bare {
        return Status::new(code, failure.message.clone());
    }
    let mut status = bounded_status(
        code,
        &failure.message,
        &failure.reason,
        failure.metadata.clone(),
    );
    if let Some(address) = failure.holder()
        && let Ok(value) = address.parse()
    {
        status
            .metadata_mut()
            .insert(crate::daemon::forward::HOLDER_HEADER, value);
    }
    status
}

/// [`status_of`] by value, for an adapter's `map_err(failed)`.
pub fn failed(failure: Failure) -> Status {
    status_of(&failure)
}

pub use crate::frontdoor::error::hide_data_dir;
use crate::frontdoor::error::without_data_dir;

/// A status with an ErrorInfo of `reason`, its message cut to [`MAX_ERROR_MESSAGE_BYTES`]
/// and each metadata value to [`MAX_ERROR_METADATA_VALUE_BYTES`], the data dir's path in
/// either written `DATA`. Every status sbxd makes is made here.
pub fn bounded_status(
    code: Code,
    message: &str,
    reason: &str,
    metadata: HashMap<String, String>,
) -> Status {
    let message = without_data_dir(message);
    let message = message.as_ref();
    let metadata: HashMap<String, String> = metadata
        .into_iter()
        .map(|(k, v)| {
            let v = without_data_dir(&v).into_owned();
            let v = truncate(&v, MAX_ERROR_METADATA_VALUE_BYTES).into_owned();
            (truncate(&k, MAX_ERROR_METADATA_VALUE_BYTES).into_owned(), v)
        })
        .collect();
    Status::with_error_details(
        code,
        truncate(message, MAX_ERROR_MESSAGE_BYTES),
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
}

/// The reason of a status that came without one: its code's name.
fn code_reason(code: Code) -> &'static str {
    code_name(code)
}

/// A status code's name as gRPC spells it (`NOT_FOUND`).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// `status` as sbxd sends it, or `None` when it already is: with an ErrorInfo (tonic's own
/// errors get `REQUEST_TOO_LARGE` or `MALFORMED_REQUEST`, others their code's name) and
/// within the bounds. `method` is the request's path, for an unknown method's message.
pub fn with_error_info(status: &Status, method: &str) -> Option<Status> {
    if status.code() == Code::Ok {
        return None;
    }
    let message = status.message();
    let info = status.get_details_error_info();
    if let Some(info) = &info {
        let within = message.len() <= MAX_ERROR_MESSAGE_BYTES
            && info
                .metadata
                .iter()
                .all(|(k, v)| k.len().max(v.len()) <= MAX_ERROR_METADATA_VALUE_BYTES);
        if within {
            return None;
        }
        return Some(bounded_status(
            status.code(),
            message,
            &info.reason,
            info.metadata.clone(),
        ));
    }
    let mut metadata = HashMap::from([("method".to_string(), method.to_string())]);
    let (code, reason, text) = if message.starts_with("Error, decoded message length too large") {
        // tonic says OUT_OF_RANGE; gRPC's own servers say RESOURCE_EXHAUSTED.
        (
            Code::ResourceExhausted,
            "REQUEST_TOO_LARGE",
            format!("the request to {method} is too large: {message}"),
        )
    } else if status.code() == Code::Internal
        && message.starts_with("failed to decode Protobuf message")
    {
        (
            Code::InvalidArgument,
            "MALFORMED_REQUEST",
            format!("the request to {method} does not decode: {message}"),
        )
    } else if status.code() == Code::Internal && message.starts_with("protocol error") {
        (Code::Internal, "MALFORMED_REQUEST", message.to_string())
    } else if status.code() == Code::Unimplemented && message.is_empty() {
        (
            Code::Unimplemented,
            "UNIMPLEMENTED",
            format!("sbxd has no method {method}"),
        )
    } else {
        (
            status.code(),
            code_reason(status.code()),
            message.to_string(),
        )
    };
    if reason == "REQUEST_TOO_LARGE" {
        metadata.insert("limit".to_string(), decode_limit(message));
    }
    Some(bounded_status(code, &text, reason, metadata))
}

/// The limit tonic's size error names ("… the limit is: N bytes"), or "".
fn decode_limit(message: &str) -> String {
    message
        .rsplit_once("the limit is: ")
        .map(|(_, rest)| rest.trim_end_matches(" bytes").to_string())
        .unwrap_or_default()
}

/// Rewrites the status in `headers` (a trailers-only answer's headers, or a stream's
/// trailers) as [`with_error_info`] says; headers without a status are left alone.
fn fix_status_headers(headers: &mut HeaderMap, method: &str) {
    if !headers.contains_key("grpc-status") {
        return;
    }
    let Some(status) = Status::from_header_map(headers) else {
        return;
    };
    let Some(fixed) = with_error_info(&status, method) else {
        return;
    };
    let mut written = HeaderMap::new();
    if fixed.add_header(&mut written).is_err() {
        return;
    }
    for name in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
        headers.remove(name);
    }
    headers.extend(written);
}

/// A tower layer around the whole gRPC server: every error status it answers carries an
/// ErrorInfo and stays within the bounds, including the ones tonic makes before a handler
/// runs (see the module docs).
#[derive(Debug, Clone, Copy, Default)]
pub struct ErrorInfoLayer;

impl<S> tower::Layer<S> for ErrorInfoLayer {
    type Service = ErrorInfoService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ErrorInfoService { inner }
    }
}

/// The service [`ErrorInfoLayer`] makes.
#[derive(Debug, Clone)]
pub struct ErrorInfoService<S> {
    inner: S,
}

impl<S, ReqBody, ResBody> Service<http::Request<ReqBody>> for ErrorInfoService<S>
where
    S: Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
    S::Future: Send + 'static,
    ResBody: HttpBody<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<tonic::codegen::StdError>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<ReqBody>) -> Self::Future {
        let method = truncate(req.uri().path(), 200).into_owned();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let (mut parts, body) = answer.await?.into_parts();
            fix_status_headers(&mut parts.headers, &method);
            let body = StatusTrailers {
                inner: tonic::body::Body::new(body),
                method,
            };
            Ok(http::Response::from_parts(
                parts,
                tonic::body::Body::new(body),
            ))
        })
    }
}

/// A response body whose trailers (a stream's final status) are rewritten like headers.
struct StatusTrailers {
    inner: tonic::body::Body,
    method: String,
}

impl HttpBody for StatusTrailers {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(mut frame)) => {
                if let Some(trailers) = frame.trailers_mut() {
                    fix_status_headers(trailers, &this.method);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            other => Poll::Ready(other),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sbx_proto::names::validate_name;

    use super::*;

    fn check(err: ActorError, code: Code, reason: &str, message_part: &str) {
        let status = actor_error_to_status(&err);
        assert_eq!(status.code(), code, "{err:?}");
        let info = status
            .get_details_error_info()
            .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
        assert_eq!(info.reason, reason, "{err:?}");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert!(
            status.message().contains(message_part),
            "{:?} does not contain {message_part:?}",
            status.message()
        );
    }

    #[test]
    fn every_actor_error_has_its_code_and_reason() {
        let name_error = validate_name("Bad_Name").unwrap_err();
        let cases = [
            (
                ActorError::WorkspaceNotFound("\"alpha\"".into()),
                Code::NotFound,
                "WORKSPACE_NOT_FOUND",
                "alpha",
            ),
            (
                ActorError::SandboxNotFound {
                    what: "\"web\" in workspace \"alpha\"".into(),
                    hint: String::new(),
                    similar: Vec::new(),
                },
                Code::NotFound,
                "SANDBOX_NOT_FOUND",
                "web",
            ),
            (
                ActorError::NameTaken {
                    kind: "sandbox",
                    name: "web".into(),
                    scope: " in workspace \"alpha\"".into(),
                    existing: "x".into(),
                },
                Code::AlreadyExists,
                "NAME_TAKEN",
                "web",
            ),
            (
                ActorError::AmbiguousName {
                    name: "web".into(),
                    workspaces: vec!["a".into(), "b".into()],
                },
                Code::FailedPrecondition,
                "AMBIGUOUS_NAME",
                "web",
            ),
            (
                ActorError::WorkspaceTerminating("alpha".into()),
                Code::FailedPrecondition,
                "WORKSPACE_TERMINATING",
                "alpha",
            ),
            (
                ActorError::WorkspaceNotEmpty {
                    name: "alpha".into(),
                    remaining: 2,
                    blockers: vec!["sandbox alpha/a".into(), "provider alpha/p".into()],
                },
                Code::FailedPrecondition,
                "WORKSPACE_NOT_EMPTY",
                "alpha",
            ),
            (
                ActorError::InvalidName {
                    what: "sandbox",
                    name: "Bad_Name".into(),
                    error: name_error,
                },
                Code::InvalidArgument,
                "INVALID_NAME",
                "Bad_Name",
            ),
            (
                ActorError::InvalidArgument("x".into()),
                Code::InvalidArgument,
                "INVALID_ARGUMENT",
                "x",
            ),
            (
                ActorError::FailedPrecondition("not ready".into()),
                Code::FailedPrecondition,
                "FAILED_PRECONDITION",
                "not ready",
            ),
            (
                ActorError::Unimplemented("snapshots".into()),
                Code::Unimplemented,
                "UNIMPLEMENTED",
                "snapshots",
            ),
            (
                ActorError::Unavailable("busy".into()),
                Code::Unavailable,
                "UNAVAILABLE",
                "busy",
            ),
            (
                ActorError::ResourceVersionTooOld {
                    requested: 3,
                    oldest: 9,
                },
                Code::OutOfRange,
                "RESOURCE_VERSION_TOO_OLD",
                "3",
            ),
            (
                ActorError::Store("disk full".into()),
                Code::Internal,
                "INTERNAL",
                "disk full",
            ),
            (
                ActorError::Internal("bug".into()),
                Code::Internal,
                "INTERNAL",
                "bug",
            ),
            (
                ActorError::InvalidImageReference("image reference \"Bad Ref\" is invalid".into()),
                Code::InvalidArgument,
                "IMAGE_REFERENCE_INVALID",
                "Bad Ref",
            ),
            (
                ActorError::ImageNotFound("\"docker.io/library/nope:1\"".into()),
                Code::NotFound,
                "IMAGE_NOT_FOUND",
                "nope:1",
            ),
            (
                ActorError::ImageInUse {
                    image: "docker.io/library/app:v1".into(),
                    digest: "sha256:ab".into(),
                    users: vec!["default/web".into(), "team/api".into()],
                },
                Code::FailedPrecondition,
                "IMAGE_IN_USE",
                "default/web, team/api",
            ),
        ];
        let image = |kind| ActorError::Image {
            kind,
            message: "image docker.io/library/app:v1: why".into(),
        };
        let image_cases = [
            (
                ImageFailure::RegistryUnavailable,
                Code::Unavailable,
                "REGISTRY_UNAVAILABLE",
            ),
            (
                ImageFailure::RegistryUnauthorized,
                Code::PermissionDenied,
                "REGISTRY_UNAUTHORIZED",
            ),
            (
                ImageFailure::Platform,
                Code::InvalidArgument,
                "IMAGE_PLATFORM",
            ),
            (
                ImageFailure::BadContent,
                Code::InvalidArgument,
                "IMAGE_INVALID",
            ),
            (
                ImageFailure::InvalidArgument,
                Code::InvalidArgument,
                "IMAGE_INVALID_ARGUMENT",
            ),
            (ImageFailure::Store, Code::Internal, "IMAGE_STORE"),
            (
                ImageFailure::Deadline,
                Code::DeadlineExceeded,
                "REGISTRY_DEADLINE",
            ),
            (
                ImageFailure::TooLarge,
                Code::ResourceExhausted,
                "IMAGE_TOO_LARGE",
            ),
            (
                ImageFailure::NoRoom,
                Code::ResourceExhausted,
                "IMAGE_STORE_FULL",
            ),
            (ImageFailure::Cancelled, Code::Cancelled, "IMAGE_CANCELLED"),
            (
                ImageFailure::Reserved,
                Code::PermissionDenied,
                "IMAGE_NAME_RESERVED",
            ),
        ];
        for (kind, code, reason) in image_cases {
            check(image(kind), code, reason, "docker.io/library/app:v1");
        }
        for (err, code, reason, part) in cases {
            check(err, code, reason, part);
        }
    }

    /// The bytes a status takes in headers: grpc-message (percent-encoded) and
    /// grpc-status-details-bin (base64), as tonic writes them.
    fn header_bytes(status: &Status) -> usize {
        let mut headers = HeaderMap::new();
        status.add_header(&mut headers).unwrap();
        headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum()
    }

    #[test]
    fn huge_inputs_make_small_errors() {
        let name = "a".repeat(5000);
        let err = ActorError::InvalidName {
            what: "sandbox",
            name: name.clone(),
            error: validate_name(&name).unwrap_err(),
        };
        let status = actor_error_to_status(&err);
        assert!(status.message().len() <= MAX_ERROR_MESSAGE_BYTES);
        let info = status.get_details_error_info().unwrap();
        assert_eq!(info.reason, "INVALID_NAME");
        assert!(info.metadata["name"].len() <= MAX_ERROR_METADATA_VALUE_BYTES);
        let err = ActorError::InvalidArgument("x".repeat(4 << 20));
        let status = actor_error_to_status(&err);
        assert!(header_bytes(&status) < 4096, "{}", header_bytes(&status));
        // A status someone else built over the bounds is cut by the layer's rewrite.
        let fat = Status::with_error_details(
            Code::NotFound,
            "m".repeat(1 << 20),
            ErrorDetails::with_error_info(
                "X",
                ERROR_DOMAIN,
                HashMap::from([("k".to_string(), "v".repeat(1 << 20))]),
            ),
        );
        let fixed = with_error_info(&fat, "/m").expect("rewritten");
        assert_eq!(fixed.code(), Code::NotFound);
        assert_eq!(fixed.get_details_error_info().unwrap().reason, "X");
        assert!(header_bytes(&fixed) < 4096, "{}", header_bytes(&fixed));
        // Within the bounds and with an ErrorInfo: left alone.
        assert!(with_error_info(&status, "/m").is_none());
        assert!(with_error_info(&Status::ok(""), "/m").is_none());
    }

    #[test]
    fn tonic_errors_get_an_error_info() {
        let method = "/sbx.v1.SandboxService/CreateSandbox";
        let check = |status: Status, code: Code, reason: &str, part: &str| {
            let fixed = with_error_info(&status, method).expect("rewritten");
            assert_eq!(fixed.code(), code, "{fixed:?}");
            let info = fixed.get_details_error_info().expect("an ErrorInfo");
            assert_eq!(info.reason, reason);
            assert_eq!(info.domain, ERROR_DOMAIN);
            assert_eq!(info.metadata["method"], method);
            assert!(fixed.message().contains(part), "{:?}", fixed.message());
            info
        };
        let info = check(
            Status::out_of_range(
                "Error, decoded message length too large: found 5000000 bytes, the limit is: 4194304 bytes",
            ),
            Code::ResourceExhausted,
            "REQUEST_TOO_LARGE",
            "5000000 bytes",
        );
        assert_eq!(info.metadata["limit"], "4194304");
        check(
            Status::internal("failed to decode Protobuf message: invalid wire type value: 7"),
            Code::InvalidArgument,
            "MALFORMED_REQUEST",
            "does not decode",
        );
        check(
            Status::internal("protocol error: received message with invalid compression flag: 9"),
            Code::Internal,
            "MALFORMED_REQUEST",
            "compression flag",
        );
        check(
            Status::new(Code::Unimplemented, ""),
            Code::Unimplemented,
            "UNIMPLEMENTED",
            method,
        );
        check(
            Status::not_found("service not registered"),
            Code::NotFound,
            "NOT_FOUND",
            "not registered",
        );
        // In headers, as a trailers-only answer carries it: rewritten in place, bounded.
        let mut headers = HeaderMap::new();
        headers.insert("content-type", "application/grpc".parse().unwrap());
        Status::invalid_argument("q".repeat(1 << 20))
            .add_header(&mut headers)
            .unwrap();
        fix_status_headers(&mut headers, method);
        let status = Status::from_header_map(&headers).unwrap();
        assert_eq!(status.code(), Code::InvalidArgument);
        assert_eq!(
            status.get_details_error_info().unwrap().reason,
            "INVALID_ARGUMENT"
        );
        assert!(headers.contains_key("content-type"));
        let total: usize = headers
            .iter()
            .map(|(k, v)| k.as_str().len() + v.len())
            .sum();
        assert!(total < 4096, "{total} bytes of headers");
    }

    #[test]
    fn driver_errors_keep_their_kind() {
        let id = "0b0e7d6e-55b4-4b5e-9d0c-1a9a4f0c2d11".to_string();
        let cases = [
            (
                DriverError::InvalidArgument("x".into()),
                Code::InvalidArgument,
                "DRIVER_INVALID_ARGUMENT",
            ),
            (
                DriverError::NotFound {
                    sandbox_id: id.clone(),
                },
                Code::NotFound,
                "DRIVER_NOT_FOUND",
            ),
            (
                DriverError::GenerationMismatch {
                    sandbox_id: id.clone(),
                    running: 2,
                    requested: 3,
                },
                Code::Aborted,
                "DRIVER_GENERATION_MISMATCH",
            ),
            (
                DriverError::FailedPrecondition("stopped".into()),
                Code::FailedPrecondition,
                "DRIVER_FAILED_PRECONDITION",
            ),
            (
                DriverError::Unimplemented("exec".into()),
                Code::Unimplemented,
                "DRIVER_UNIMPLEMENTED",
            ),
            (
                DriverError::Unavailable("away".into()),
                Code::Unavailable,
                "DRIVER_UNAVAILABLE",
            ),
            (
                DriverError::DeadlineExceeded {
                    operation: "exec",
                    after: Duration::from_secs(1),
                },
                Code::DeadlineExceeded,
                "DRIVER_DEADLINE_EXCEEDED",
            ),
            (
                DriverError::Internal("bug".into()),
                Code::Internal,
                "DRIVER_INTERNAL",
            ),
        ];
        for (err, code, reason) in cases {
            let text = err.to_string();
            check(ActorError::Driver(err), code, reason, &text);
        }
        let status = actor_error_to_status(&ActorError::Driver(DriverError::NotFound {
            sandbox_id: id.clone(),
        }));
        let info = status.get_details_error_info().unwrap();
        assert_eq!(info.metadata.get("sandbox_id"), Some(&id));
    }

    /// Once the data dir is set, an error's message and metadata name its paths from `DATA`.
    #[test]
    fn errors_name_data_dir_paths_from_data() {
        hide_data_dir(std::path::Path::new("/srv/sbx-status-test-data/"));
        let status = bounded_status(
            Code::Internal,
            "cannot open /srv/sbx-status-test-data/images/tmp/upload-1: gone",
            "INTERNAL",
            [(
                "path".to_string(),
                "/srv/sbx-status-test-data/store".to_string(),
            )]
            .into(),
        );
        assert_eq!(
            status.message(),
            "cannot open DATA/images/tmp/upload-1: gone"
        );
        let info = tonic_types::StatusExt::get_error_details(&status)
            .error_info()
            .cloned()
            .unwrap();
        assert_eq!(info.metadata["path"], "DATA/store");
    }
}
