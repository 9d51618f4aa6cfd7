//! sbx-storage: the object store of sbx.
//!
//! Records (workspaces, sandboxes, settings, providers, attachments, services, images) are
//! keyed by UUID, with a unique name index per `(kind, scope, name)` (the scope: the owner of
//! an owned record, else its workspace), an owner index so deleting an owner deletes what it
//! owns in the same transaction, a reference index so a record that another refers to cannot
//! be deleted (and a reference is written only to a record that exists, in one transaction),
//! ordered list indexes with keyset pagination, a global revision that every write bumps, and
//! durable acknowledgement through group commit. Only this crate knows sled.
//!
//! Code map:
//! - `store.rs`: the [`ObjectStore`] trait the actor layer codes against.
//! - `record.rs`, `selector.rs`, `layout.rs`, `envelope.rs`: types, label selectors, key
//!   encodings and the on-disk record encoding; no IO.
//! - `sled_store.rs`: [`SledStore`]: open, reads and lists.
//! - `writes.rs`: create / CAS update / cascading delete inside one sled transaction.
//! - `idsets.rs`: the chunked id sets of the owner and reference indexes, readable and
//!   writable inside a transaction.
//! - `committer.rs`: group commit: one thread runs each batch of queued writes as one
//!   transaction, flushes and fdatasyncs, then acknowledges; reopens sled after a full disk.
//! - `space.rs`: the full-disk state: writes are refused (`DiskFull`) while the store's file
//!   system has less than [`DISK_RESERVE_BYTES`] free.
//! - `schema.rs`: the schema version and the migrations between versions.
//! - `fsck.rs`: [`SledStore::verify_indexes`], the integrity check against the high-water mark.
//! - `postgres/`: [`PgStore`]: the same store on PostgreSQL, for gateways that share one.
//! - `backup.rs`: [`backup_store`] / [`restore_store`]: the store as one checked file, and back.
//!
//! **Invariant:** every write goes through the committer thread; nothing else writes the trees.
//!
//! **Invariant:** a write is acknowledged only after a flush that began after its commit.
//!
//! **Invariant:** no record with a nil id, an invalid name, or a scoped kind without a
//! (non-nil, existing) workspace is ever written.

mod backup;
mod committer;
#[cfg(feature = "conformance")]
pub mod conformance;
mod envelope;
mod error;
mod fsck;
mod idsets;
mod kind;
pub mod layout;
mod postgres;
mod record;
mod schema;
mod selector;
mod sled_store;
mod space;
mod store;
mod trees;
mod writes;

pub use backup::{
    BACKUP_FORMAT_VERSION, BackupError, BackupSummary, Restored, backup_store, restore_store,
    verify_backup,
};
pub use committer::{FlushStats, MAX_BATCH};
pub use committer::{high_water_path, read_high_water};
pub use error::StoreError;
pub use fsck::IntegrityReport;
pub use postgres::{CopySummary, PG_SCHEMA_VERSION, PgStore};
pub use record::{Kind, ListQuery, NewRecord, Page, Record, Scope};
pub use schema::{SCHEMA_VERSION, SchemaOutcome};
pub use selector::{LabelSelector, MAX_LABEL_LEN, Requirement, validate_labels};
pub use sled_store::{SledStore, open_raw_sled};
pub use space::DISK_RESERVE_BYTES;
pub use store::{Change, ChangeOp, IndexProblem, ObjectStore};
/// The connection settings of a [`PgStore`] (host, port, user, database, password…).
pub use tokio_postgres::Config as PgConfig;
pub use writes::{MAX_REFS, MAX_TIME_MS};
