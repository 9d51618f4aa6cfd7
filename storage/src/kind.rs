//! What a record is ([`Kind`]): the one name the error, the record and the layout modules all
//! use, kept below them. No IO here.

use std::fmt;

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
