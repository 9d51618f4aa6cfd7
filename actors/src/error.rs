use sbx_driver_api::DriverError;
use sbx_images::ImageError;
use sbx_proto::names::NameError;
use sbx_storage::StoreError;

/// What the actor API answers when a request cannot be served.
///
/// The gateway maps each variant to one gRPC status and reason; nothing else in the crate
/// knows gRPC.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ActorError {
    /// No workspace with this name or id. Expected for a typo or a deleted workspace.
    #[error("workspace {0} not found")]
    WorkspaceNotFound(String),
    /// No sandbox with this id, or this name in this workspace. `hint` says where a sandbox of
    /// that name does exist, when one does.
    /// `similar`: names of its workspace within two edits of a name not found ("did you
    /// mean"), for a caller who may see that workspace.
    #[error(
        "sandbox {what} not found{hint}{}",
        sbx_proto::names::did_you_mean(similar)
    )]
    SandboxNotFound {
        what: String,
        hint: String,
        similar: Vec<String>,
    },
    /// The name is already used by another object of the same kind in the same scope.
    #[error("{kind} name {name:?} is already taken{scope} (by {existing})")]
    NameTaken {
        kind: &'static str,
        name: String,
        scope: String,
        existing: String,
    },
    /// A name-only request matches sandboxes in several workspaces and names none of them.
    #[error(
        "sandbox name {name:?} is ambiguous: it is not in workspace \"default\" but exists in workspaces {workspaces:?}; name the workspace or use the id"
    )]
    AmbiguousName {
        name: String,
        workspaces: Vec<String>,
    },
    /// The workspace is being deleted; nothing new can be created in it.
    #[error("workspace {0:?} is terminating; no sandbox can be created in it")]
    WorkspaceTerminating(String),
    /// Deleting a workspace that still holds objects, without cascade. `blockers` names every
    /// one ("sandbox ws/name", "provider ws/name", "service ws/sandbox/name").
    #[error(
        "workspace {name:?} still holds {remaining} object(s): {}; delete them first or delete with cascade",
        blockers.join(", ")
    )]
    WorkspaceNotEmpty {
        name: String,
        remaining: usize,
        blockers: Vec<String>,
    },
    /// No object of `kind` (provider, setting, service) with this id or name.
    #[error("{kind} {what} not found")]
    ObjectNotFound { kind: &'static str, what: String },
    /// Deleting a provider that sandboxes are attached to; `users` are `workspace/name`,
    /// sorted.
    #[error(
        "provider {provider:?} is attached to {} sandbox(es): {}; detach them first, or delete with --force",
        users.len(),
        users.join(", ")
    )]
    ProviderInUse {
        provider: String,
        users: Vec<String>,
    },
    /// A name that breaks the naming rule.
    #[error("invalid {what} name {name:?}: {error}")]
    InvalidName {
        what: &'static str,
        name: String,
        error: NameError,
    },
    /// Malformed input other than a name (a non-UUID id, an empty command, a bad selector).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A lifecycle move that makes no sense in the sandbox's current state.
    #[error("failed precondition: {0}")]
    FailedPrecondition(String),
    /// The driver does not support what was asked.
    #[error("unsupported: {0}")]
    Unimplemented(String),
    /// The sandbox's actor or its driver is not answering for now; retry.
    #[error("unavailable: {0}")]
    Unavailable(String),
    /// Gateways sharing a store: the workspace is served by another gateway, at `address`
    /// (sbxd forwards the request there; a client may ask it directly).
    #[error(
        "workspace {workspace} is served by another gateway ({gateway}, at {address}); ask it, \
         or again once its lease moves"
    )]
    HeldElsewhere {
        workspace: uuid::Uuid,
        gateway: uuid::Uuid,
        address: String,
    },
    /// A watch resumed from a resource version older than the history kept.
    #[error(
        "resource version {requested} is too old (history starts after {oldest}); list again and watch from the list's version"
    )]
    ResourceVersionTooOld { requested: u64, oldest: u64 },
    /// A watch from a resource version the store has not reached: it would never deliver.
    #[error(
        "resource version {requested} is newer than the gateway's newest ({newest}); watch from a version a list or an object gave you, or 0"
    )]
    ResourceVersionInFuture { requested: u64, newest: u64 },
    /// An image reference that breaks the reference rule (`sbx_proto::image_ref`).
    #[error("{0}")]
    InvalidImageReference(String),
    /// No image record with this id, name or digest.
    #[error("image {0} not found")]
    ImageNotFound(String),
    /// Deleting an image whose digest sandboxes pin; `users` are `workspace/name`, sorted.
    #[error(
        "image {image} ({digest}) is in use by {} sandbox(es): {}; delete them first",
        users.len(),
        users.join(", ")
    )]
    ImageInUse {
        image: String,
        digest: String,
        users: Vec<String>,
    },
    /// The image store or a registry refused or failed; `kind` says how, `message` names the
    /// image.
    #[error("{message}")]
    Image { kind: ImageFailure, message: String },
    /// A driver error that the caller should see as it is (exec into a stopped sandbox…).
    #[error(transparent)]
    Driver(#[from] DriverError),
    /// The disk holding the store is full: the write was refused (nothing changed) or not
    /// acknowledged. The message names the store's path; retry once space is freed. Reads
    /// keep working.
    #[error("{0}")]
    DiskFull(String),
    /// No node can take a new sandbox: each considered says why (cordoned, not answering,
    /// no such driver, a missing label, no room).
    #[error("no node can take the sandbox: {0}")]
    NoNodeFits(String),
    /// The store's server cannot be reached now (PostgreSQL down): the write was not
    /// acknowledged. The message names the store; retry once it is back. Reads of what the
    /// gateway holds keep working.
    #[error("{0}")]
    StoreUnavailable(String),
    /// The store failed. Unexpected.
    #[error("store: {0}")]
    Store(String),
    /// A bug.
    #[error("internal: {0}")]
    Internal(String),
}

impl From<StoreError> for ActorError {
    fn from(e: StoreError) -> Self {
        if e.is_disk_full() {
            ActorError::DiskFull(e.to_string())
        } else if e.is_unavailable() {
            ActorError::StoreUnavailable(e.to_string())
        } else {
            ActorError::Store(e.to_string())
        }
    }
}

/// The store's full-disk error inside an actor's failure, if that is what it is (a store error
/// that an actor's `?` boxed).
pub fn disk_full_in(err: &ractor::ActorProcessingErr) -> Option<ActorError> {
    err.downcast_ref::<StoreError>()
        .filter(|e| e.is_disk_full())
        .map(|e| ActorError::from(e.clone()))
}

/// How an image operation failed (the gateway maps each to a status code).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFailure {
    /// The registry could not be reached or answered with a server error.
    RegistryUnavailable,
    /// The registry refused the credentials, or wants some.
    RegistryUnauthorized,
    /// The image has no manifest for this platform (linux/amd64).
    Platform,
    /// The content is unsafe, malformed or does not match its digest; never stored.
    BadContent,
    /// An argument the image store cannot use (a rootfs tar without a name, a dynamic busybox,
    /// an import over the size limit).
    InvalidArgument,
    /// The image store's own files failed (IO, a read-only or mismatched store).
    Store,
    /// The pull took longer than the gateway allows (`--pull-timeout`); nothing of it is kept.
    Deadline,
    /// The image is larger than the gateway takes (`--image-max-layers`, `--image-max-size`,
    /// `--image-max-files`); nothing of it is kept.
    TooLarge,
    /// The image would leave less of the store's filesystem free than `--image-min-free`
    /// keeps; nothing of it is kept.
    NoRoom,
    /// The add was cancelled (its caller went away or was revoked); nothing of it is kept.
    Cancelled,
    /// A client wrote a name of the gateway's own (`sbx.local/*`).
    Reserved,
}

/// A refused Dockerfile or COPY (`sbx_images::build`): the caller's to fix, ours, or the
/// image store's.
impl From<sbx_images::build::BuildError> for ActorError {
    fn from(e: sbx_images::build::BuildError) -> Self {
        use sbx_images::build::BuildError;
        match e {
            BuildError::Invalid(m) => ActorError::InvalidArgument(m),
            BuildError::Internal(m) => ActorError::Internal(m),
            BuildError::Image(e) => e.into(),
        }
    }
}

impl From<ImageError> for ActorError {
    fn from(e: ImageError) -> Self {
        let message = e.to_string();
        let kind = match e {
            ImageError::InvalidReference { .. } => {
                return ActorError::InvalidImageReference(message);
            }
            ImageError::NotFound { image, why } => {
                return ActorError::ImageNotFound(format!("{image} ({why})"));
            }
            ImageError::Unavailable { .. } => ImageFailure::RegistryUnavailable,
            ImageError::Unauthorized { .. } => ImageFailure::RegistryUnauthorized,
            ImageError::Platform { .. } => ImageFailure::Platform,
            ImageError::DigestMismatch { .. }
            | ImageError::Malformed { .. }
            | ImageError::UnsafeLayer { .. } => ImageFailure::BadContent,
            ImageError::InvalidArgument { .. } => ImageFailure::InvalidArgument,
            ImageError::TooLarge { .. } => ImageFailure::TooLarge,
            ImageError::NoRoom { .. } => ImageFailure::NoRoom,
            ImageError::Cancelled { .. } => ImageFailure::Cancelled,
            ImageError::IdMapMismatch { .. }
            | ImageError::ReadOnly { .. }
            | ImageError::Io { .. } => ImageFailure::Store,
        };
        ActorError::Image { kind, message }
    }
}

pub type Result<T, E = ActorError> = std::result::Result<T, E>;
