//! The messages of the actor tree and the answer to "who owns this UUID", in one place.
//!
//! Every request an actor takes is a variant here: [`RootMsg`] for the gateway root,
//! [`WorkspaceMsg`] for a workspace supervisor, [`SandboxMsg`] for a sandbox actor,
//! [`ReconcilerMsg`] for the reconciler. The actor
//! files hold the behaviour; this file is what each of them can be asked, so a new message
//! (and what it answers) is added here first.

use std::collections::BTreeMap;

use ractor::{ActorRef, RpcReplyPort};
use sbx_driver_api::pb;
use sbx_proto::v1::{Sandbox, SandboxSpec, Workspace};
use sbx_storage::{NewRecord, Record};
use uuid::Uuid;

use crate::error::Result;

/// Where a request for one UUID goes.
pub enum Route<M> {
    Actor(ActorRef<M>),
    /// The actor failed and its supervisor restarts it; ask again shortly.
    Restarting,
    /// Nobody owns this UUID (it was deleted, or never existed).
    Unknown,
}

/// What the gateway root is asked (see `root.rs`).
pub enum RootMsg {
    CreateWorkspace {
        name: String,
        labels: BTreeMap<String, String>,
        reply: RpcReplyPort<Result<Workspace>>,
    },
    Route {
        id: Uuid,
        reply: RpcReplyPort<Route<WorkspaceMsg>>,
    },
    RespawnSupervisor(Uuid),
    RespawnReconciler,
    /// This gateway took the workspace's lease: serve it (spawn its supervisor).
    Hold(Uuid),
    /// This gateway no longer holds the workspace's lease (lost it, or cannot renew it in
    /// time): stop its supervisor and sandbox actors, leaving the workloads as they are.
    LetGo(Uuid),
    Reconciler(RpcReplyPort<Option<ActorRef<ReconcilerMsg>>>),
}

/// What a workspace supervisor is asked (see `workspace.rs`).
pub enum WorkspaceMsg {
    CreateSandbox {
        name: String,
        spec: SandboxSpec,
        /// Made in the driver but not started.
        stopped: bool,
        /// Providers (of this workspace) attached before the first start.
        providers: Vec<Uuid>,
        /// The node it was placed on (`None`: local) and that node's name.
        node: (Option<Uuid>, String),
        reply: RpcReplyPort<Result<Sandbox>>,
    },
    Route {
        id: Uuid,
        reply: RpcReplyPort<Route<SandboxMsg>>,
    },
    /// Deletes the workspace; answers whether it was deleted.
    Delete {
        cascade: bool,
        reply: RpcReplyPort<Result<bool>>,
    },
    /// The cascade task has asked every sandbox to delete itself.
    CascadeFinished,
    RespawnChild(Uuid),
    /// Takes over a workload a driver runs without a record in the store.
    Adopt {
        driver: String,
        snapshot: pb::Snapshot,
        reply: RpcReplyPort<Result<Sandbox>>,
    },
    /// Sets (Some) or clears (None) the workspace's default network policy (checked already);
    /// refused while the workspace is terminating.
    SetDefaultNetwork {
        policy: Option<sbx_proto::v1::NetworkPolicy>,
        reply: RpcReplyPort<Result<Workspace>>,
    },
    /// Sets (Some) or clears (None) the workspace's default cpu and memory limits (checked
    /// already); refused while the workspace is terminating.
    SetDefaultResources {
        resources: Option<sbx_proto::v1::Resources>,
        reply: RpcReplyPort<Result<Workspace>>,
    },
    /// Sets (Some) or clears (None) the workspace's default lifetime (checked already);
    /// refused while the workspace is terminating.
    SetDefaultLifetime {
        lifetime: Option<sbx_proto::v1::Lifetime>,
        reply: RpcReplyPort<Result<Workspace>>,
    },
    /// The sandbox ids this supervisor owns (for tests and diagnostics).
    Children(RpcReplyPort<Vec<Uuid>>),
    /// Writes a new provider record (prepared and sealed by the caller) in this workspace.
    /// Refused while the workspace is terminating, so a provider never outlives a cascade.
    CreateProvider {
        record: NewRecord,
        reply: RpcReplyPort<Result<Record>>,
    },
    /// A sandbox record of this workspace that this supervisor does not know (the reconciler
    /// found it): start its actor. A store write outlives its dropped future, so a create
    /// queued by a supervisor that was killed lands after its replacement listed the
    /// workspace, and nothing else would ever drive that record.
    Supervise(Uuid),
}

/// What a sandbox actor is asked (see `sandbox.rs`).
pub enum SandboxMsg {
    /// The first look of a newly (re)started actor: re-attach to the workload by id.
    Attach,
    Start(RpcReplyPort<Result<Sandbox>>),
    Stop(RpcReplyPort<Result<Sandbox>>),
    Restart(RpcReplyPort<Result<Sandbox>>),
    /// Answers whether anything was deleted.
    Delete(RpcReplyPort<Result<bool>>),
    /// Saves the workload's processes and memory (driver `pause`); answers once Paused.
    Pause(RpcReplyPort<Result<Sandbox>>),
    /// Brings a paused workload back (driver `resume`); answers once Ready.
    Resume(RpcReplyPort<Result<Sandbox>>),
    /// Moves the ttl deadline to now + `seconds` (0: no deadline); answers the sandbox as
    /// written.
    SetTtl {
        seconds: u64,
        reply: RpcReplyPort<Result<Sandbox>>,
    },
    /// The timer the actor armed from the sandbox's next deadline (`crate::lifetime`) rang.
    Deadline,
    /// What a driver reported about this sandbox (a sweep or a watch event); `None` when the
    /// driver's list did not have it.
    Observe(Option<Box<pb::Snapshot>>),
    /// A scheduled retry of a step that failed against the driver.
    Retry,
    /// Sets settings of this sandbox (checked already): each key created or updated; answers
    /// the records written. Refused once the sandbox is being deleted.
    SetSettings {
        values: BTreeMap<String, String>,
        reply: RpcReplyPort<Result<Vec<Record>>>,
    },
    /// Deletes one setting; answers whether it existed.
    DeleteSetting {
        key: String,
        reply: RpcReplyPort<Result<bool>>,
    },
    /// Replaces the sandbox's egress allowlist (checked already): persisted, then applied by
    /// the driver while the workload runs; answers the driver's view of the network.
    UpdateNetwork {
        policy: sbx_proto::v1::NetworkPolicy,
        reply: RpcReplyPort<Result<pb::NetworkStatus>>,
    },
}

/// What the reconciler is asked (see `reconciler.rs`).
pub enum ReconcilerMsg {
    /// Sweep every driver now; the report goes to the port when one is given.
    Sweep(Option<RpcReplyPort<SweepReport>>),
    /// A change a driver's watch stream reported.
    Watched(Box<pb::WatchEvent>),
}

/// What one sweep did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Workloads reported by drivers and routed to their actors.
    pub observed: usize,
    /// Records the drivers did not list, routed to their actors as absent.
    pub absent: usize,
    pub adopted: usize,
    /// Workloads without a record seen for the first time: adopted only if the next sweep
    /// still finds them (a workload whose sandbox was being deleted is gone by then).
    pub deferred: usize,
    /// Driver records that were refused or failed, each with why.
    pub skipped: Vec<String>,
    /// Drivers whose list failed.
    pub driver_errors: Vec<String>,
}
