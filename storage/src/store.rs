//! The store trait the actor layer codes against.

use async_trait::async_trait;
use uuid::Uuid;

use crate::error::StoreError;
use crate::record::{Kind, ListQuery, NewRecord, Page, Record};

/// One inconsistency found by an index check ([`ObjectStore::integrity_problems`]; sled's
/// `SledStore::verify_indexes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IndexProblem {
    /// The tree where the problem shows (`records`, `names`, `owners`, `refs`, `order_all`,
    /// `order_ws`, `ws_counts`, `meta`).
    pub tree: &'static str,
    pub detail: String,
}

impl std::fmt::Display for IndexProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.tree, self.detail)
    }
}

/// What a write did to a record, as the change log keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeOp {
    Created,
    Updated,
    Deleted,
}

/// One entry of a store's change log.
#[derive(Debug, Clone, PartialEq)]
pub struct Change {
    /// The revision of the write.
    pub revision: u64,
    pub op: ChangeOp,
    /// The record as the write left it; for a delete, as it was, with `resource_version` the
    /// delete's revision.
    pub record: Record,
}

/// A transactional object store of workspaces, sandboxes and the records they own.
///
/// Every write is acknowledged only once it is durable, and bumps one global revision that
/// becomes the written record's `resource_version`. Dropping the future of a write does not
/// cancel it: once queued it may still be committed, so a caller that gave up must re-read.
#[async_trait]
pub trait ObjectStore: Send + Sync + 'static {
    /// Must-create. Fails `AlreadyExists { existing }` when `(kind, workspace, name)` is taken or
    /// the id exists; `WorkspaceNotFound` when a scoped record names a workspace with no record;
    /// `OwnerNotFound` when the owner does not exist; `Invalid` on an empty/invalid name, a nil
    /// id, a scoped kind without workspace (or a global kind with one), a setting without owner,
    /// an owner in another workspace, or malformed labels.
    async fn create(&self, rec: NewRecord) -> Result<Record, StoreError> {
        self.create_referring(rec, Vec::new()).await
    }

    /// `create`, and the new record refers to each of `refs` (at most `MAX_REFS`, none nil,
    /// itself or twice): in the same transaction each must exist, in the record's workspace or
    /// globally (else `ReferenceNotFound { id }`), and from then on none of them can be deleted
    /// while the new record lives (`Referenced`). So a reference never dangles, whatever races
    /// it: the existence check and the write are one transaction.
    async fn create_referring(&self, rec: NewRecord, refs: Vec<Uuid>)
    -> Result<Record, StoreError>;

    /// Compare-and-swap: `rec.resource_version` is the version the caller read. Only labels,
    /// body and updated_at may change (changing id/kind/workspace/name/owner/created_at is
    /// `Invalid`). `Conflict { id, expected, actual }` if the stored version differs;
    /// `NotFound`.
    async fn update(&self, rec: Record) -> Result<Record, StoreError>;

    /// Conditional delete on id + version. Deletes, in the same transaction, every record the
    /// owner index says this one owns (recursively). A workspace record with records still in it
    /// is refused: `NotEmpty { workspace, remaining }`; so is a record that a record outside
    /// the delete refers to: `Referenced { id, by }`, every referrer named. Returns the ids deleted (the record
    /// first). `NotFound` when absent, `Conflict` on version mismatch.
    async fn delete(&self, id: Uuid, expected_version: u64) -> Result<Vec<Uuid>, StoreError>;

    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError>;

    /// The record of `kind` called `name` in `scope`: where the kind's names are unique — the
    /// owner for owned kinds (`Kind::is_owned`), the workspace for other scoped kinds, `None`
    /// for global kinds.
    async fn get_by_name(
        &self,
        kind: Kind,
        scope: Option<Uuid>,
        name: &str,
    ) -> Result<Option<Record>, StoreError>;

    /// One page of records in the total order `(created_at_ms, id)`, filtered by the selector.
    /// A malformed cursor is `Invalid`.
    async fn list(&self, q: ListQuery) -> Result<Page, StoreError>;

    /// The ids owned by `owner` (from the owner index), in the order they were created.
    async fn owned(&self, owner: Uuid) -> Result<Vec<Uuid>, StoreError>;

    /// The ids of the records that refer to `id` (from the reference index).
    async fn referrers(&self, id: Uuid) -> Result<Vec<Uuid>, StoreError>;

    /// The highest resource version ever assigned (0 for an empty store).
    async fn current_revision(&self) -> Result<u64, StoreError>;

    /// The store's own integrity check: every record against every index (names, owners,
    /// references, orders), and the revision against every record's version. Returns the
    /// problems found, empty for a healthy store. Run it while no writes are in flight.
    async fn integrity_problems(&self) -> Result<Vec<IndexProblem>, StoreError>;

    /// Where a store shared by several gateways keeps a change log (PostgreSQL): the revision
    /// after which it holds every change to a record of a logged kind
    /// (`Kind::in_change_log`), so a gateway's watch sees every gateway's writes. `None`: no
    /// change log (sled: one gateway, whose own writes are its events).
    async fn change_log_start(&self) -> Result<Option<u64>, StoreError> {
        Ok(None)
    }

    /// The changes after revision `after`, in revision order (the records one delete removed
    /// share its revision; they come in id order), at most `limit` (at least 1). Each write is
    /// in the log from the moment it is acknowledged, and a change at revision N is readable
    /// only once every write below N is: so a reader that saw N never later finds a change
    /// below it. `ChangesTooOld` when `after` is below [`ObjectStore::change_log_start`];
    /// `NoChangeLog` for a store without one.
    async fn changes_after(&self, after: u64, limit: usize) -> Result<Vec<Change>, StoreError> {
        let _ = (after, limit);
        Err(StoreError::NoChangeLog {
            store: self.describe(),
        })
    }

    /// What this store is, for messages: `sled store at PATH`, `PostgreSQL store at HOST:PORT/DB`.
    fn describe(&self) -> String;

    /// `Some(StoreError::DiskFull)` while the store refuses writes for lack of space, checked
    /// now (cheap: one `statvfs`); `None` when writes are taken. Callers refuse writes up front
    /// with it, and the gateway's health reports it. A store without the notion answers `None`.
    fn disk_full(&self) -> Option<StoreError> {
        None
    }

    /// What the store has committed since it opened: writes acknowledged, commits (a sled
    /// group flush, a PostgreSQL transaction), the time they took and the bytes sled flushed
    /// (0 for PostgreSQL) — for the gateway's metrics. `None`: the store does not count.
    fn commit_stats(&self) -> Option<crate::FlushStats> {
        None
    }
}
