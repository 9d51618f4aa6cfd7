//! The one error type of the store.

use std::path::PathBuf;

use uuid::Uuid;

use crate::record::Kind;

/// Everything a store operation can fail with.
///
/// The first group (`AlreadyExists` … `Invalid`) are answers about the caller's request: callers
/// should expect them and map them to a user-facing status. The last group (`Io`, `Corrupt`,
/// `Schema`) are faults of the machine or of the data on disk: callers should log them and fail
/// the operation; retrying rarely helps.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// `create` found the `(kind, workspace, name)` key or the id already taken. `existing` is
    /// the id of the record that holds it (the caller's own id when the id itself was taken).
    #[error("{kind} {name:?} already exists (id {existing})")]
    AlreadyExists {
        kind: Kind,
        name: String,
        existing: Uuid,
    },

    /// `update` or `delete` named an id with no record.
    #[error("no record with id {id}")]
    NotFound { id: Uuid },

    /// A compare-and-swap `update` or conditional `delete` carried a resource version that is
    /// not the stored one: somebody else wrote the record since the caller read it.
    #[error("record {id} is at version {actual}, the caller expected {expected}")]
    Conflict {
        id: Uuid,
        expected: u64,
        actual: u64,
    },

    /// `create` of a scoped record (sandbox, setting) named a workspace id that has no
    /// workspace record.
    #[error("workspace {workspace} does not exist")]
    WorkspaceNotFound { workspace: Uuid },

    /// `create` named an owner id that has no record.
    #[error("owner {owner} does not exist")]
    OwnerNotFound { owner: Uuid },

    /// `delete` of a workspace that still holds records (sandboxes, settings). Nothing was
    /// deleted.
    #[error("workspace {workspace} still holds {remaining} record(s)")]
    NotEmpty { workspace: Uuid, remaining: u64 },

    /// The request can never succeed as written: an empty or malformed name, a nil id, a scoped
    /// kind without a workspace (or a global kind with one), a change to an immutable field, a
    /// malformed label, selector or cursor.
    #[error("invalid request: {reason}")]
    Invalid { reason: String },

    /// The embedded database or the file system failed (disk full, permission, I/O error), or
    /// the background flusher has stopped. The write may or may not have been committed, but it
    /// was not acknowledged as durable.
    #[error("storage I/O failed: {0}")]
    Io(String),

    /// Data on disk cannot be decoded or contradicts itself (a record that does not decode, an
    /// index that points nowhere during a cascade). Not expected in a healthy store; run
    /// `SledStore::verify_indexes`.
    #[error("store data is corrupt: {0}")]
    Corrupt(String),

    /// The database at `path` has a schema version this build cannot use: newer than this build
    /// supports, or one with no known migration. Nothing was changed on disk.
    #[error(
        "store at {path} has schema version {found}, this build supports version {supported} \
         (and migrates from older known versions): {reason}"
    )]
    Schema {
        path: PathBuf,
        found: String,
        supported: u32,
        reason: String,
    },
}

impl StoreError {
    /// Whether this is an answer about the request (expected, nothing was written) rather than
    /// a fault of the machine or the data (`Io`, `Corrupt`, `Schema`).
    pub fn is_request_error(&self) -> bool {
        !matches!(
            self,
            StoreError::Io(_) | StoreError::Corrupt(_) | StoreError::Schema { .. }
        )
    }

    pub(crate) fn invalid(reason: impl Into<String>) -> Self {
        StoreError::Invalid {
            reason: reason.into(),
        }
    }
}

impl From<sled::Error> for StoreError {
    fn from(err: sled::Error) -> Self {
        match err {
            sled::Error::Corruption { .. } => StoreError::Corrupt(err.to_string()),
            other => StoreError::Io(other.to_string()),
        }
    }
}

impl From<sled::transaction::TransactionError<StoreError>> for StoreError {
    fn from(err: sled::transaction::TransactionError<StoreError>) -> Self {
        match err {
            sled::transaction::TransactionError::Abort(e) => e,
            sled::transaction::TransactionError::Storage(e) => e.into(),
        }
    }
}
