//! The wire form of [`DriverError`]: the one place that maps it to a `tonic::Status`
//! ([`driver_error_to_status`], used by the server) and the one place that maps a status back
//! ([`status_to_driver_error`], used by the client). The two are exact inverses for every
//! status the server sends; the unit tests below check that variant by variant.
//!
//! Every status the server sends carries a `google.rpc.ErrorInfo` in domain
//! [`ERROR_DOMAIN`] whose reason names the variant, with the variant's fields as metadata. A
//! status without it did not come from a driver: it is the transport's (connection refused,
//! reset, the client's own deadline) and maps to `Unavailable` or `DeadlineExceeded`.

use std::collections::HashMap;
use std::time::Duration;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::DriverError;

/// The `ErrorInfo.domain` of every status a driver host sends.
pub const ERROR_DOMAIN: &str = "driver.sbx.dev";

/// `ErrorInfo.reason` of [`DriverError::GenerationMismatch`] (specified by driver.proto).
pub const REASON_GENERATION_MISMATCH: &str = "GENERATION_MISMATCH";
/// `ErrorInfo.reason` of [`DriverError::NotFound`].
pub const REASON_SANDBOX_NOT_FOUND: &str = "SANDBOX_NOT_FOUND";
const REASON_INVALID_ARGUMENT: &str = "INVALID_ARGUMENT";
const REASON_FAILED_PRECONDITION: &str = "FAILED_PRECONDITION";
const REASON_UNIMPLEMENTED: &str = "UNIMPLEMENTED";
const REASON_UNAVAILABLE: &str = "DRIVER_UNAVAILABLE";
const REASON_DEADLINE_EXCEEDED: &str = "DEADLINE_EXCEEDED";
const REASON_INTERNAL: &str = "INTERNAL";

const KEY_SANDBOX_ID: &str = "sandbox_id";
const KEY_RUNNING: &str = "running_generation";
const KEY_REQUESTED: &str = "requested_generation";
const KEY_OPERATION: &str = "operation";
const KEY_AFTER_NANOS: &str = "after_nanos";

/// The driver operations, by the name used in [`DriverError::DeadlineExceeded`]. A remote
/// `operation` is mapped back to one of these `'static` names; another name becomes the
/// name of the call that received it.
pub const OPERATIONS: [&str; 10] = [
    "capabilities",
    "create",
    "start",
    "stop",
    "delete",
    "get",
    "list",
    "watch",
    "exec",
    "logs",
];

/// The client's side of one call, for the statuses that carry no driver error: the transport
/// and the client's own deadline do not know which call they cut short.
#[derive(Debug, Clone, Copy)]
pub struct CallContext {
    /// One of [`OPERATIONS`].
    pub operation: &'static str,
    /// The deadline the client gave the call.
    pub timeout: Duration,
}

/// Maps a driver's error to the status the server answers with. See the module docs.
pub fn driver_error_to_status(err: &DriverError) -> Status {
    let mut metadata = HashMap::new();
    let (code, reason, message) = match err {
        DriverError::InvalidArgument(m) => {
            (Code::InvalidArgument, REASON_INVALID_ARGUMENT, m.clone())
        }
        DriverError::NotFound { sandbox_id } => {
            metadata.insert(KEY_SANDBOX_ID.to_string(), sandbox_id.clone());
            (Code::NotFound, REASON_SANDBOX_NOT_FOUND, err.to_string())
        }
        DriverError::GenerationMismatch {
            sandbox_id,
            running,
            requested,
        } => {
            metadata.insert(KEY_SANDBOX_ID.to_string(), sandbox_id.clone());
            metadata.insert(KEY_RUNNING.to_string(), running.to_string());
            metadata.insert(KEY_REQUESTED.to_string(), requested.to_string());
            (
                Code::AlreadyExists,
                REASON_GENERATION_MISMATCH,
                err.to_string(),
            )
        }
        DriverError::FailedPrecondition(m) => (
            Code::FailedPrecondition,
            REASON_FAILED_PRECONDITION,
            m.clone(),
        ),
        DriverError::Unimplemented(m) => (Code::Unimplemented, REASON_UNIMPLEMENTED, m.clone()),
        DriverError::Unavailable(m) => (Code::Unavailable, REASON_UNAVAILABLE, m.clone()),
        DriverError::DeadlineExceeded { operation, after } => {
            metadata.insert(KEY_OPERATION.to_string(), operation.to_string());
            metadata.insert(KEY_AFTER_NANOS.to_string(), after.as_nanos().to_string());
            (
                Code::DeadlineExceeded,
                REASON_DEADLINE_EXCEEDED,
                err.to_string(),
            )
        }
        DriverError::Internal(m) => (Code::Internal, REASON_INTERNAL, m.clone()),
    };
    Status::with_error_details(
        code,
        message,
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
}

/// Maps a status a client received back to the driver's error. See the module docs.
pub fn status_to_driver_error(status: &Status, call: CallContext) -> DriverError {
    if let Some(info) = status.get_details_error_info()
        && info.domain == ERROR_DOMAIN
        && let Some(err) = from_error_info(status, &info.reason, &info.metadata, call)
    {
        return err;
    }
    from_transport(status, call)
}

/// A status the server made from a [`DriverError`]; `None` when the reason and code do not
/// form a pair the server sends (then it is treated as the transport's).
fn from_error_info(
    status: &Status,
    reason: &str,
    metadata: &HashMap<String, String>,
    call: CallContext,
) -> Option<DriverError> {
    let message = status.message().to_string();
    let field = |key: &str| metadata.get(key).cloned();
    let number = |key: &str| metadata.get(key).and_then(|v| v.parse::<u64>().ok());
    let err = match (status.code(), reason) {
        (Code::InvalidArgument, REASON_INVALID_ARGUMENT) => DriverError::InvalidArgument(message),
        (Code::NotFound, REASON_SANDBOX_NOT_FOUND) => DriverError::NotFound {
            sandbox_id: field(KEY_SANDBOX_ID)?,
        },
        (Code::AlreadyExists, REASON_GENERATION_MISMATCH) => DriverError::GenerationMismatch {
            sandbox_id: field(KEY_SANDBOX_ID)?,
            running: number(KEY_RUNNING)?,
            requested: number(KEY_REQUESTED)?,
        },
        (Code::FailedPrecondition, REASON_FAILED_PRECONDITION) => {
            DriverError::FailedPrecondition(message)
        }
        (Code::Unimplemented, REASON_UNIMPLEMENTED) => DriverError::Unimplemented(message),
        (Code::Unavailable, REASON_UNAVAILABLE) => DriverError::Unavailable(message),
        (Code::DeadlineExceeded, REASON_DEADLINE_EXCEEDED) => {
            let nanos = metadata.get(KEY_AFTER_NANOS)?.parse::<u128>().ok()?;
            let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
            let operation = field(KEY_OPERATION)?;
            DriverError::DeadlineExceeded {
                operation: OPERATIONS
                    .into_iter()
                    .find(|op| *op == operation)
                    .unwrap_or(call.operation),
                after: Duration::new(secs, (nanos % 1_000_000_000) as u32),
            }
        }
        (Code::Internal, REASON_INTERNAL) => DriverError::Internal(message),
        _ => return None,
    };
    Some(err)
}

/// A status that no driver made: the client's deadline, or the transport.
fn from_transport(status: &Status, call: CallContext) -> DriverError {
    if is_client_timeout(status) || status.code() == Code::DeadlineExceeded {
        return DriverError::DeadlineExceeded {
            operation: call.operation,
            after: call.timeout,
        };
    }
    if status.code() == Code::Unimplemented {
        // A host that does not know the method at all (an older contract).
        return DriverError::Unimplemented(format!(
            "the driver host does not serve {}: {}",
            call.operation,
            status.message()
        ));
    }
    DriverError::Unavailable(format!(
        "driver host unreachable during {} ({:?}): {}",
        call.operation,
        status.code(),
        status.message()
    ))
}

/// Whether tonic's own request timeout (`grpc-timeout`) cut the call short: tonic answers
/// `CANCELLED` with a `TimeoutExpired` in the error chain (client side) or the same message
/// (when the server's copy of the deadline fired first).
fn is_client_timeout(status: &Status) -> bool {
    if status.code() != Code::Cancelled {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(err) = source {
        if err.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = err.source();
    }
    status.message() == tonic::TimeoutExpired(()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    const CALL: CallContext = CallContext {
        operation: "get",
        timeout: Duration::from_millis(750),
    };

    fn every_variant() -> Vec<DriverError> {
        vec![
            DriverError::InvalidArgument("sandbox_id is empty".into()),
            DriverError::NotFound {
                sandbox_id: "0b6c0c5e-4f51-4c55-9d39-1f0e3c9f4a11".into(),
            },
            DriverError::GenerationMismatch {
                sandbox_id: "0b6c0c5e-4f51-4c55-9d39-1f0e3c9f4a11".into(),
                running: u64::MAX,
                requested: 7,
            },
            DriverError::FailedPrecondition("sandbox is stopped".into()),
            DriverError::Unimplemented("no exec".into()),
            DriverError::Unavailable("machine away".into()),
            DriverError::DeadlineExceeded {
                operation: "exec",
                after: Duration::new(3, 123_456_789),
            },
            DriverError::Internal("disk full".into()),
            DriverError::InvalidArgument(String::new()),
        ]
    }

    #[test]
    fn every_driver_error_survives_server_map_then_client_map() {
        for err in every_variant() {
            let status = driver_error_to_status(&err);
            assert_eq!(status_to_driver_error(&status, CALL), err, "{status:?}");
        }
    }

    #[test]
    fn codes_and_reasons_are_the_contracts() {
        let check = |err: DriverError, code: Code, reason: &str, meta: &[(&str, &str)]| {
            let status = driver_error_to_status(&err);
            assert_eq!(status.code(), code, "{err:?}");
            let info = status.get_details_error_info().expect("ErrorInfo");
            assert_eq!(info.domain, ERROR_DOMAIN);
            assert_eq!(info.reason, reason);
            for (k, v) in meta {
                assert_eq!(info.metadata.get(*k).map(String::as_str), Some(*v), "{k}");
            }
        };
        check(
            DriverError::GenerationMismatch {
                sandbox_id: "s".into(),
                running: 4,
                requested: 5,
            },
            Code::AlreadyExists,
            "GENERATION_MISMATCH",
            &[
                ("sandbox_id", "s"),
                ("running_generation", "4"),
                ("requested_generation", "5"),
            ],
        );
        check(
            DriverError::NotFound {
                sandbox_id: "s".into(),
            },
            Code::NotFound,
            "SANDBOX_NOT_FOUND",
            &[("sandbox_id", "s")],
        );
        check(
            DriverError::InvalidArgument("x".into()),
            Code::InvalidArgument,
            "INVALID_ARGUMENT",
            &[],
        );
        check(
            DriverError::DeadlineExceeded {
                operation: "stop",
                after: Duration::from_secs(2),
            },
            Code::DeadlineExceeded,
            "DEADLINE_EXCEEDED",
            &[("operation", "stop"), ("after_nanos", "2000000000")],
        );
    }

    #[test]
    fn statuses_without_driver_error_info_are_the_transports() {
        let unavailable = status_to_driver_error(&Status::unavailable("connection refused"), CALL);
        assert!(
            matches!(unavailable, DriverError::Unavailable(ref m) if m.contains("connection refused"))
        );
        let unknown = status_to_driver_error(&Status::unknown("h2 protocol error"), CALL);
        assert!(
            matches!(unknown, DriverError::Unavailable(_)),
            "{unknown:?}"
        );
        // Another domain's ErrorInfo is not a driver's error.
        let foreign = Status::with_error_details(
            Code::NotFound,
            "x",
            ErrorDetails::with_error_info("SANDBOX_NOT_FOUND", "sbx.dev", HashMap::new()),
        );
        assert!(matches!(
            status_to_driver_error(&foreign, CALL),
            DriverError::Unavailable(_)
        ));
        // A reason sent with a code the server never pairs it with.
        let mismatched = Status::with_error_details(
            Code::Internal,
            "x",
            ErrorDetails::with_error_info("SANDBOX_NOT_FOUND", ERROR_DOMAIN, HashMap::new()),
        );
        assert!(matches!(
            status_to_driver_error(&mismatched, CALL),
            DriverError::Unavailable(_)
        ));
        let timeout = DriverError::DeadlineExceeded {
            operation: "get",
            after: Duration::from_millis(750),
        };
        assert_eq!(
            status_to_driver_error(&Status::cancelled("Timeout expired"), CALL),
            timeout
        );
        assert_eq!(
            status_to_driver_error(&Status::deadline_exceeded("late"), CALL),
            timeout
        );
        assert!(matches!(
            status_to_driver_error(&Status::cancelled("h2 reset"), CALL),
            DriverError::Unavailable(_)
        ));
        assert!(matches!(
            status_to_driver_error(&Status::unimplemented("no such method"), CALL),
            DriverError::Unimplemented(_)
        ));
    }

    #[test]
    fn a_mismatch_without_its_generations_is_not_taken_for_one() {
        let mut meta = HashMap::new();
        meta.insert("sandbox_id".to_string(), "s".to_string());
        let status = Status::with_error_details(
            Code::AlreadyExists,
            "x",
            ErrorDetails::with_error_info("GENERATION_MISMATCH", ERROR_DOMAIN, meta),
        );
        assert!(matches!(
            status_to_driver_error(&status, CALL),
            DriverError::Unavailable(_)
        ));
    }

    #[test]
    fn an_unknown_remote_operation_takes_the_calls_name() {
        let mut meta = HashMap::new();
        meta.insert("operation".to_string(), "frobnicate".to_string());
        meta.insert("after_nanos".to_string(), "5".to_string());
        let status = Status::with_error_details(
            Code::DeadlineExceeded,
            "x",
            ErrorDetails::with_error_info("DEADLINE_EXCEEDED", ERROR_DOMAIN, meta),
        );
        assert_eq!(
            status_to_driver_error(&status, CALL),
            DriverError::DeadlineExceeded {
                operation: "get",
                after: Duration::from_nanos(5)
            }
        );
    }
}
