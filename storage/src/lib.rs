//! sbx-storage: the object store of sbx.
//!
//! Records (workspaces, sandboxes, settings) are keyed by UUID, with a unique name index per
//! `(kind, workspace, name)`, an owner index so deleting an owner deletes what it owns in the
//! same transaction, ordered list indexes with keyset pagination, a global revision that every
//! write bumps, and durable acknowledgement through group commit. Only this crate knows sled.

mod committer;
mod envelope;
mod error;
mod fsck;
pub mod layout;
mod record;
mod schema;
mod selector;
mod sled_store;
mod store;
mod writes;

pub use committer::{FlushStats, MAX_BATCH};
pub use error::StoreError;
pub use fsck::IndexProblem;
pub use record::{Kind, ListQuery, NewRecord, Page, Record, Scope};
pub use schema::{SCHEMA_VERSION, SchemaOutcome};
pub use selector::{LabelSelector, MAX_LABEL_LEN, Requirement, validate_labels};
pub use sled_store::SledStore;
pub use store::ObjectStore;
