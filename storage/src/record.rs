//! The record types the store keeps and the queries it answers. No IO here.

use std::collections::BTreeMap;

use uuid::Uuid;

pub use crate::kind::Kind;
use crate::selector::LabelSelector;

/// A record as the caller asks to create it. The store assigns the resource version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRecord {
    pub id: Uuid,
    pub kind: Kind,
    /// `None` for global kinds, `Some(non-nil workspace id)` for scoped ones.
    pub workspace: Option<Uuid>,
    pub name: String,
    /// The record this one belongs to; deleting the owner deletes this record in the same
    /// transaction. Must be in the same scope (same workspace) as this record.
    pub owner: Option<Uuid>,
    pub labels: BTreeMap<String, String>,
    /// Set by the caller (wall clock); the first part of the list order.
    pub created_at_ms: u64,
    /// Opaque payload (the actor layer stores prost-encoded messages).
    pub body: Vec<u8>,
}

impl NewRecord {
    /// Where this record's name is unique: its owner for owned records (a setting's key is
    /// unique per sandbox), else its workspace (`None`: globally).
    pub fn name_scope(&self) -> Option<Uuid> {
        self.owner.or(self.workspace)
    }
}

/// A stored record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub id: Uuid,
    pub kind: Kind,
    pub workspace: Option<Uuid>,
    pub name: String,
    pub owner: Option<Uuid>,
    pub labels: BTreeMap<String, String>,
    pub created_at_ms: u64,
    pub body: Vec<u8>,
    /// The global revision of the write that last changed this record. The caller passes it
    /// back to `update` / `delete` as the version it read.
    pub resource_version: u64,
    /// Set by the caller on update (wall clock); equals `created_at_ms` after create.
    pub updated_at_ms: u64,
    /// The records this one refers to (see `ObjectStore::create_referring`): each existed
    /// when this one was created, and none can be deleted while this one lives. Immutable.
    pub refs: Vec<Uuid>,
}

impl Record {
    /// Where this record's name is unique (see [`NewRecord::name_scope`]).
    pub fn name_scope(&self) -> Option<Uuid> {
        self.owner.or(self.workspace)
    }

    pub(crate) fn from_new(rec: NewRecord, refs: Vec<Uuid>, resource_version: u64) -> Record {
        Record {
            id: rec.id,
            kind: rec.kind,
            workspace: rec.workspace,
            name: rec.name,
            owner: rec.owner,
            labels: rec.labels,
            created_at_ms: rec.created_at_ms,
            updated_at_ms: rec.created_at_ms,
            body: rec.body,
            resource_version,
            refs,
        }
    }
}

/// Which records a list covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every record of the kind, across workspaces.
    All,
    /// The records of the kind inside one workspace (uses that workspace's own order index).
    Workspace(Uuid),
}

/// One page request of a list. Records come in the total order `(created_at_ms, id bytes)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListQuery {
    pub kind: Kind,
    pub scope: Scope,
    pub selector: LabelSelector,
    /// The most records to return; 0 means no limit (the whole remaining list in one page).
    pub limit: usize,
    /// `next_cursor` of the previous page, `None` for the first page.
    pub cursor: Option<String>,
}

impl ListQuery {
    /// The first page of every record of `kind` in `scope`, unfiltered, `limit` at a time.
    pub fn new(kind: Kind, scope: Scope, limit: usize) -> ListQuery {
        ListQuery {
            kind,
            scope,
            selector: LabelSelector::everything(),
            limit,
            cursor: None,
        }
    }
}

/// One page of a list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    pub records: Vec<Record>,
    /// Where the next page starts; `None` when no matching record follows this page.
    pub next_cursor: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_round_trip_and_never_repeat() {
        for kind in Kind::ALL {
            assert_eq!(Kind::from_tag(kind.tag()), Some(kind));
        }
        let mut tags: Vec<u8> = Kind::ALL.iter().map(|k| k.tag()).collect();
        tags.dedup();
        assert_eq!(tags, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]);
        assert_eq!(Kind::from_tag(11), None);
    }

    #[test]
    fn each_kind_has_its_name_rule() {
        let image = "docker.io/library/busybox:latest";
        assert!(Kind::Image.validate_name(image).is_ok());
        assert!(Kind::Image.validate_name("busybox").is_err());
        for kind in [Kind::Workspace, Kind::Sandbox, Kind::Setting] {
            assert!(kind.validate_name("busybox").is_ok(), "{kind}");
            assert!(kind.validate_name(image).is_err(), "{kind}");
        }
        assert!(!Kind::Image.is_scoped());
    }
}
