use std::time::Duration;

/// What a driver call can fail with.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DriverError {
    /// The request is malformed (an empty or non-UUID sandbox id, an empty command…).
    /// Callers should not retry.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The driver knows no sandbox with this id. Expected after a driver lost its state.
    #[error("sandbox {sandbox_id} not found in the driver")]
    NotFound { sandbox_id: String },
    /// The workload already runs under another runtime generation than the one requested.
    /// Expected after a gateway restart; the sandbox actor reconciles (adopts or restarts).
    #[error("sandbox {sandbox_id} already runs under generation {running}, not {requested}")]
    GenerationMismatch {
        sandbox_id: String,
        running: u64,
        requested: u64,
    },
    /// The operation makes no sense in the workload's current state (exec into a stopped
    /// sandbox, for example).
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The driver does not support this operation (see its capabilities).
    #[error("unsupported by this driver: {0}")]
    Unimplemented(String),
    /// The driver (or the machine under it) is away for now; retry with backoff.
    #[error("driver unavailable: {0}")]
    Unavailable(String),
    /// The call did not answer within its deadline.
    #[error("driver call {operation} did not answer within {after:?}")]
    DeadlineExceeded {
        operation: &'static str,
        after: Duration,
    },
    /// Anything else: a bug or an unexpected failure of the host.
    #[error("driver internal error: {0}")]
    Internal(String),
}

impl DriverError {
    /// Whether retrying the same call later can succeed.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            DriverError::Unavailable(_)
                | DriverError::DeadlineExceeded { .. }
                | DriverError::Internal(_)
        )
    }
}
