//! The record types the store keeps and the queries it answers. No IO here.

use std::collections::BTreeMap;
use std::fmt;

use uuid::Uuid;

use crate::selector::LabelSelector;

/// What a record is. The byte tag of each kind is part of the on-disk format and never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    /// A tenant. Global scope: `workspace` is `None`.
    Workspace,
    /// A sandbox, scoped to a workspace (`workspace` is `Some(ws id)`).
    Sandbox,
    /// A small record owned by a sandbox (`owner` is `Some(sandbox id)`), scoped to the
    /// sandbox's workspace. It dies with its owner and never re-attaches to a new sandbox of the
    /// same name.
    Setting,
    /// An image of the image store: its name (a normalised image reference) → a manifest
    /// digest. Global scope.
    Image,
    /// A named credential set of a workspace (its secrets sealed by the gateway). Scoped; not
    /// owned: sandboxes refer to it through attachments, and it cannot be deleted while one
    /// does.
    Provider,
    /// That a sandbox uses a provider: owned by the sandbox, referring (`refs`) to the
    /// provider, named by the provider's id. Dies with the sandbox; keeps the provider alive.
    Attachment,
    /// A service endpoint of a sandbox (a port to route HTTP to). Owned by the sandbox.
    Service,
    /// A machine sandboxes run on (an `sbxd node` host), by its own id. Global scope.
    Node,
    /// Which gateway serves a workspace, until when, under which fencing token: named by the
    /// workspace's id. Global scope (it outlives nothing: the gateways remove the lease of a
    /// workspace that is gone).
    Lease,
    /// Something that happened to a sandbox (it started, its workload was OOM-killed, the
    /// reconciler re-attached it, …): owned by the sandbox, dies with it; kept per sandbox
    /// and in total within bounds the gateway enforces.
    Event,
}

impl Kind {
    /// Every kind, in tag order.
    pub const ALL: [Kind; 10] = [
        Kind::Workspace,
        Kind::Sandbox,
        Kind::Setting,
        Kind::Image,
        Kind::Provider,
        Kind::Attachment,
        Kind::Service,
        Kind::Node,
        Kind::Lease,
        Kind::Event,
    ];

    /// The stable on-disk tag.
    pub const fn tag(self) -> u8 {
        match self {
            Kind::Workspace => 1,
            Kind::Sandbox => 2,
            Kind::Setting => 3,
            Kind::Image => 4,
            Kind::Provider => 5,
            Kind::Attachment => 6,
            Kind::Service => 7,
            Kind::Node => 8,
            Kind::Lease => 9,
            Kind::Event => 10,
        }
    }

    /// The kind for an on-disk tag, `None` for a tag this build does not know.
    pub const fn from_tag(tag: u8) -> Option<Kind> {
        match tag {
            1 => Some(Kind::Workspace),
            2 => Some(Kind::Sandbox),
            3 => Some(Kind::Setting),
            4 => Some(Kind::Image),
            5 => Some(Kind::Provider),
            6 => Some(Kind::Attachment),
            7 => Some(Kind::Service),
            8 => Some(Kind::Node),
            9 => Some(Kind::Lease),
            10 => Some(Kind::Event),
            _ => None,
        }
    }

    /// Whether records of this kind live inside a workspace (`workspace = Some(..)`).
    pub const fn is_scoped(self) -> bool {
        !matches!(
            self,
            Kind::Workspace | Kind::Image | Kind::Node | Kind::Lease
        )
    }

    /// Whether every record of this kind must have an owner (and so dies with it).
    pub const fn is_owned(self) -> bool {
        matches!(
            self,
            Kind::Setting | Kind::Attachment | Kind::Service | Kind::Event
        )
    }

    /// Whether the store's change log (`ObjectStore::changes_after`, where a store keeps one)
    /// records writes of this kind: the kinds a watch follows — sandboxes.
    pub const fn in_change_log(self) -> bool {
        matches!(self, Kind::Sandbox)
    }

    /// Checks a record name by this kind's rule: the DNS-1123 label rule
    /// (`sbx_proto::names`) for every kind but images; a normalised image reference without
    /// digest (`sbx_proto::image_ref`) for images.
    pub fn validate_name(self, name: &str) -> Result<(), String> {
        match self {
            Kind::Image => {
                sbx_proto::image_ref::validate_image_name(name).map_err(|e| e.to_string())
            }
            Kind::Workspace
            | Kind::Sandbox
            | Kind::Setting
            | Kind::Provider
            | Kind::Attachment
            | Kind::Service
            | Kind::Node
            | Kind::Lease
            | Kind::Event => sbx_proto::names::validate_name(name).map_err(|e| e.to_string()),
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Workspace => "workspace",
            Kind::Sandbox => "sandbox",
            Kind::Setting => "setting",
            Kind::Image => "image",
            Kind::Provider => "provider",
            Kind::Attachment => "attachment",
            Kind::Service => "service",
            Kind::Node => "node",
            Kind::Lease => "lease",
            Kind::Event => "event",
        })
    }
}

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
