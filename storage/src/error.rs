//! The one error type of the store.

use std::path::PathBuf;

use uuid::Uuid;

use crate::kind::Kind;

/// Everything a store operation can fail with.
///
/// The first group (`AlreadyExists` … `Invalid`) are answers about the caller's request: callers
/// should expect them and map them to a user-facing status. `DiskFull` is a state of the
/// machine that passes by itself once space is freed. The last group (`Io`, `Corrupt`,
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

    /// `create_referring` named a record to refer to that does not exist (or is in another
    /// workspace, which is the same to the creator: it cannot refer to it). Nothing written.
    #[error("record {id} to refer to does not exist")]
    ReferenceNotFound { id: Uuid },

    /// `delete` of a record that records outside the delete still refer to (`by`, every one
    /// of them). Nothing was deleted.
    #[error("record {id} is referred to by {} record(s)", by.len())]
    Referenced { id: Uuid, by: Vec<Uuid> },

    /// `delete` of a workspace that still holds records (sandboxes, settings). Nothing was
    /// deleted.
    #[error("workspace {workspace} still holds {remaining} record(s)")]
    NotEmpty { workspace: Uuid, remaining: u64 },

    /// The request can never succeed as written: an empty or malformed name, a nil id, a scoped
    /// kind without a workspace (or a global kind with one), a change to an immutable field, a
    /// malformed label, selector or cursor.
    #[error("invalid request: {reason}")]
    Invalid { reason: String },

    /// The file system holding the store at `path` is full: before the write less than
    /// [`crate::DISK_RESERVE_BYTES`] were free (the write was refused and nothing was written),
    /// or the write itself met ENOSPC (it was not acknowledged; a write that was not flushed is
    /// gone once the store reopens). Not a fault of the request nor of the data: writes are
    /// taken again by themselves once space is freed; reads keep working meanwhile.
    #[error(
        "the disk holding the store at {} is full ({detail}); writes are refused until space \
         is freed, reads keep working",
        path.display()
    )]
    DiskFull { path: PathBuf, detail: String },

    /// The embedded database or the file system failed (permission, I/O error), or
    /// the background flusher has stopped. The write may or may not have been committed, but it
    /// was not acknowledged as durable.
    #[error("storage I/O failed: {0}")]
    Io(String),

    /// Data on disk cannot be decoded or contradicts itself (a record that does not decode, an
    /// index that points nowhere during a cascade). Not expected in a healthy store; run
    /// `SledStore::verify_indexes`.
    #[error("store data is corrupt: {0}")]
    Corrupt(String),

    /// The store (`store`: what it is and where, see `ObjectStore::describe`) has a schema
    /// version this build cannot use: newer than this build supports, or one with no known
    /// migration. Nothing was changed.
    #[error(
        "{store} has schema version {found}, this build supports version {supported} \
         (and migrates from older known versions): {reason}"
    )]
    Schema {
        store: String,
        found: String,
        supported: u32,
        reason: String,
    },

    /// The store's server cannot be reached or stopped answering (PostgreSQL down, the
    /// network to it cut, every pooled connection broken). A write that failed so may or may
    /// not have been committed; it was not acknowledged. Passes by itself once the server is
    /// back: reads of what the gateway holds go on meanwhile.
    #[error("{store} is unavailable: {detail}")]
    Unavailable { store: String, detail: String },

    /// A read of the change log from before what it still holds (it keeps the latest
    /// `CHANGE_LOG_REVISIONS` revisions, and nothing from before the store began one).
    #[error(
        "the change log holds the changes after revision {oldest} only; revision {requested} \
         is older"
    )]
    ChangesTooOld { requested: u64, oldest: u64 },

    /// The store keeps no change log (a sled store: one gateway, whose own writes are its
    /// events).
    #[error("{store} keeps no change log")]
    NoChangeLog { store: String },
}

impl StoreError {
    /// Whether this is an answer about the request (expected, nothing was written) rather than
    /// a fault or state of the machine or the data (`DiskFull`, `Io`, `Corrupt`, `Schema`, `Unavailable`).
    pub fn is_request_error(&self) -> bool {
        !matches!(
            self,
            StoreError::DiskFull { .. }
                | StoreError::Io(_)
                | StoreError::Corrupt(_)
                | StoreError::Schema { .. }
                | StoreError::Unavailable { .. }
                | StoreError::NoChangeLog { .. }
        )
    }

    /// Whether this is [`StoreError::Unavailable`]: the store's server cannot be reached now.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable { .. })
    }

    /// Whether this is [`StoreError::DiskFull`]: an operational state that passes by itself
    /// once space is freed, not a failure of the caller or of the data.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, StoreError::DiskFull { .. })
    }

    /// Names the store a [`StoreError::DiskFull`] is about (a sled error does not know it).
    pub(crate) fn at_store(self, store: &std::path::Path) -> Self {
        match self {
            StoreError::DiskFull { path, detail } if path.as_os_str().is_empty() => {
                StoreError::DiskFull {
                    path: store.to_path_buf(),
                    detail,
                }
            }
            other => other,
        }
    }

    /// An I/O error of `what`: [`StoreError::DiskFull`] for ENOSPC or EDQUOT (the store's path
    /// filled in by [`StoreError::at_store`]), [`StoreError::Io`] otherwise.
    pub(crate) fn from_io(what: &str, err: &std::io::Error) -> Self {
        if is_no_space(err) {
            StoreError::DiskFull {
                path: PathBuf::new(),
                detail: format!("{what}: {err}"),
            }
        } else {
            StoreError::Io(format!("{what}: {err}"))
        }
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
            sled::Error::Io(ref io) if is_no_space(io) => StoreError::DiskFull {
                path: PathBuf::new(),
                detail: format!("sled: {io}"),
            },
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

/// Whether an I/O error says the file system (or the user's quota on it) has no space left.
pub(crate) fn is_no_space(err: &std::io::Error) -> bool {
    matches!(
        err.kind(),
        std::io::ErrorKind::StorageFull | std::io::ErrorKind::QuotaExceeded
    ) || matches!(err.raw_os_error(), Some(code) if code == nix::libc::ENOSPC || code == nix::libc::EDQUOT)
}
