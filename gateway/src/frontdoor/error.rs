//! The one error classification: every [`ActorError`] becomes a [`Failure`] of one [`Class`],
//! here and nowhere else, and each transport maps a class once (gRPC: `grpc::status`; the
//! E2B control plane and in-sandbox API: [`Class::http_status`], [`Class::connect_code`]).
//!
//! Before this module three places classified the same error and disagreed: a driver that was
//! away (`DriverError::Unavailable`) was `UNAVAILABLE` over gRPC and HTTP 500 on the E2B control
//! plane, and an internal driver error was `INTERNAL` over gRPC and `unavailable` on the E2B
//! in-sandbox API. Now a failure has one class whichever door it leaves by.
//!
//! The reason (`WORKSPACE_NOT_FOUND`, `DRIVER_UNAVAILABLE`…) and the metadata are those gRPC's
//! `ErrorInfo` has always carried; the class is the gRPC code's, plus [`Class::Elsewhere`]: the
//! workspace is held by another gateway of the store, whose address the metadata names (the
//! front door forwards the call there, or a transport answers it as unavailable).

use std::collections::HashMap;

use sbx_actors::{ActorError, ImageFailure};
use sbx_drivers::DriverError;

/// What kind of failure a call met: what a client branches on, whatever the transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Class {
    Cancelled,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    Unauthenticated,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    /// The workspace is served by another gateway of the store (metadata `address`).
    Elsewhere,
}

impl Class {
    /// Every class, for tables and tests.
    pub const ALL: [Class; 15] = [
        Class::Cancelled,
        Class::InvalidArgument,
        Class::DeadlineExceeded,
        Class::NotFound,
        Class::AlreadyExists,
        Class::PermissionDenied,
        Class::Unauthenticated,
        Class::ResourceExhausted,
        Class::FailedPrecondition,
        Class::Aborted,
        Class::OutOfRange,
        Class::Unimplemented,
        Class::Internal,
        Class::Unavailable,
        Class::Elsewhere,
    ];

    /// The HTTP status of the class on the E2B control plane and in a unary Connect answer
    /// of the in-sandbox API: the mapping Google's APIs and the Connect protocol share
    /// (`google/rpc/code.proto`), so one table serves both E2B doors.
    pub fn http_status(self) -> u16 {
        match self {
            Class::Cancelled => 499,
            Class::InvalidArgument | Class::FailedPrecondition | Class::OutOfRange => 400,
            Class::Unauthenticated => 401,
            Class::PermissionDenied => 403,
            Class::NotFound => 404,
            Class::AlreadyExists | Class::Aborted => 409,
            Class::ResourceExhausted => 429,
            Class::Internal => 500,
            Class::Unimplemented => 501,
            Class::Unavailable | Class::Elsewhere => 503,
            Class::DeadlineExceeded => 504,
        }
    }

    /// The Connect protocol's code of the class (the E2B in-sandbox API speaks Connect).
    pub fn connect_code(self) -> &'static str {
        match self {
            Class::Cancelled => "canceled",
            Class::InvalidArgument => "invalid_argument",
            Class::DeadlineExceeded => "deadline_exceeded",
            Class::NotFound => "not_found",
            Class::AlreadyExists => "already_exists",
            Class::PermissionDenied => "permission_denied",
            Class::Unauthenticated => "unauthenticated",
            Class::ResourceExhausted => "resource_exhausted",
            Class::FailedPrecondition => "failed_precondition",
            Class::Aborted => "aborted",
            Class::OutOfRange => "out_of_range",
            Class::Unimplemented => "unimplemented",
            Class::Internal => "internal",
            Class::Unavailable | Class::Elsewhere => "unavailable",
        }
    }
}

/// A call that failed, as every transport answers it: its class, its reason (UPPER_SNAKE, the
/// gRPC ErrorInfo's), its message (the error's own text, naming what it is about) and
/// metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub class: Class,
    pub reason: String,
    pub message: String,
    pub metadata: HashMap<String, String>,
    /// Made by a check with no reason of its own (a refused role, a bad request field): gRPC
    /// sends it without an ErrorInfo and the server's layer adds one naming the method, as it
    /// always has.
    pub bare: bool,
}

impl Failure {
    /// A failure of `class` with `reason` and `message`, no metadata.
    pub fn new(class: Class, reason: &str, message: impl Into<String>) -> Failure {
        Failure {
            class,
            reason: reason.to_string(),
            message: message.into(),
            metadata: HashMap::new(),
            bare: false,
        }
    }

    /// A failure a check made, with no reason but its class (see [`Failure::bare`]).
    pub fn bare(class: Class, message: impl Into<String>) -> Failure {
        Failure {
            bare: true,
            ..Failure::new(class, "", message)
        }
    }

    /// `INVALID_ARGUMENT` for a request that does not say what is needed.
    pub fn invalid(message: impl Into<String>) -> Failure {
        Failure::bare(Class::InvalidArgument, message)
    }

    /// `FAILED_PRECONDITION` naming what stands in the way.
    pub fn failed_precondition(message: impl Into<String>) -> Failure {
        Failure::new(Class::FailedPrecondition, "FAILED_PRECONDITION", message)
    }

    /// The address of the gateway holding the workspace, for [`Class::Elsewhere`].
    pub fn holder(&self) -> Option<&str> {
        (self.class == Class::Elsewhere)
            .then(|| self.metadata.get("address").map(String::as_str))
            .flatten()
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<ActorError> for Failure {
    fn from(err: ActorError) -> Failure {
        Failure::from(&err)
    }
}

impl From<&ActorError> for Failure {
    fn from(err: &ActorError) -> Failure {
        let (class, reason, metadata) = classify(err);
        // Where the gateway keeps its state is none of a caller's business, whatever the door:
        // the data dir is written `DATA` (`grpc::status::hide_data_dir`).
        let hidden = |text: &str| without_data_dir(text).into_owned();
        Failure {
            class,
            reason: reason.to_string(),
            message: hidden(&err.to_string()),
            metadata: metadata
                .into_iter()
                .map(|(k, v)| (k.to_string(), hidden(&v)))
                .collect(),
            bare: false,
        }
    }
}

/// The data dir's path in a failure's text is written `DATA`: where the gateway keeps its state
/// on the host is none of a caller's business, whatever the door.
/// The gateway's data dir, as errors must not show it (set once at start).
static DATA_DIR: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Errors name paths of the data dir `dir` from it (`DATA/images/…`): where the gateway keeps
/// its state on the host is none of a caller's business.
pub fn hide_data_dir(dir: &std::path::Path) {
    let shown = dir.display().to_string();
    if !shown.is_empty() && shown != "/" {
        let _ = DATA_DIR.set(shown.trim_end_matches('/').to_string());
    }
}

/// `text` with the data dir written `DATA`.
pub(crate) fn without_data_dir(text: &str) -> std::borrow::Cow<'_, str> {
    match DATA_DIR.get() {
        Some(dir) if text.contains(dir.as_str()) => text.replace(dir.as_str(), "DATA").into(),
        _ => text.into(),
    }
}

/// The class, reason and metadata of an actor error: the table of docs/SPECIFICATION.md.
fn classify(err: &ActorError) -> (Class, &'static str, Vec<(&'static str, String)>) {
    use Class as C;
    match err {
        ActorError::WorkspaceNotFound(what) => (
            C::NotFound,
            "WORKSPACE_NOT_FOUND",
            vec![("workspace", what.clone())],
        ),
        ActorError::SandboxNotFound { what, .. } => (
            C::NotFound,
            "SANDBOX_NOT_FOUND",
            vec![("sandbox", what.clone())],
        ),
        ActorError::NameTaken {
            kind,
            name,
            existing,
            ..
        } => (
            C::AlreadyExists,
            "NAME_TAKEN",
            vec![
                ("kind", kind.to_string()),
                ("name", name.clone()),
                ("existing", existing.clone()),
            ],
        ),
        ActorError::AmbiguousName { name, workspaces } => (
            C::FailedPrecondition,
            "AMBIGUOUS_NAME",
            vec![("name", name.clone()), ("workspaces", workspaces.join(","))],
        ),
        ActorError::WorkspaceTerminating(name) => (
            C::FailedPrecondition,
            "WORKSPACE_TERMINATING",
            vec![("workspace", name.clone())],
        ),
        ActorError::WorkspaceNotEmpty {
            name,
            remaining,
            blockers,
        } => (
            C::FailedPrecondition,
            "WORKSPACE_NOT_EMPTY",
            vec![
                ("workspace", name.clone()),
                ("remaining", remaining.to_string()),
                ("blockers", blockers.join(",")),
            ],
        ),
        ActorError::ObjectNotFound { kind, what } => {
            let reason = match *kind {
                "provider" => "PROVIDER_NOT_FOUND",
                "setting" => "SETTING_NOT_FOUND",
                "service" => "SERVICE_NOT_FOUND",
                _ => "NOT_FOUND",
            };
            (C::NotFound, reason, vec![(kind, what.clone())])
        }
        ActorError::ProviderInUse { provider, users } => (
            C::FailedPrecondition,
            "PROVIDER_IN_USE",
            vec![("provider", provider.clone()), ("users", users.join(","))],
        ),
        ActorError::InvalidName { what, name, .. } => (
            C::InvalidArgument,
            "INVALID_NAME",
            vec![("kind", what.to_string()), ("name", name.clone())],
        ),
        ActorError::InvalidArgument(_) => (C::InvalidArgument, "INVALID_ARGUMENT", vec![]),
        ActorError::FailedPrecondition(_) => (C::FailedPrecondition, "FAILED_PRECONDITION", vec![]),
        ActorError::Unimplemented(_) => (C::Unimplemented, "UNIMPLEMENTED", vec![]),
        ActorError::Unavailable(_) => (C::Unavailable, "UNAVAILABLE", vec![]),
        ActorError::HeldElsewhere {
            workspace,
            gateway,
            address,
        } => (
            C::Elsewhere,
            "HELD_ELSEWHERE",
            vec![
                ("workspace", workspace.to_string()),
                ("gateway", gateway.to_string()),
                ("address", address.clone()),
            ],
        ),
        ActorError::ResourceVersionInFuture { requested, newest } => (
            C::OutOfRange,
            "RESOURCE_VERSION_IN_FUTURE",
            vec![
                ("requested", requested.to_string()),
                ("newest", newest.to_string()),
            ],
        ),
        ActorError::ResourceVersionTooOld { requested, oldest } => (
            C::OutOfRange,
            "RESOURCE_VERSION_TOO_OLD",
            vec![
                ("requested", requested.to_string()),
                ("oldest", oldest.to_string()),
            ],
        ),
        ActorError::InvalidImageReference(_) => {
            (C::InvalidArgument, "IMAGE_REFERENCE_INVALID", vec![])
        }
        ActorError::ImageNotFound(what) => (
            C::NotFound,
            "IMAGE_NOT_FOUND",
            vec![("image", what.clone())],
        ),
        ActorError::ImageInUse {
            image,
            digest,
            users,
        } => (
            C::FailedPrecondition,
            "IMAGE_IN_USE",
            vec![
                ("image", image.clone()),
                ("digest", digest.clone()),
                ("users", users.join(",")),
            ],
        ),
        ActorError::Image { kind, .. } => {
            let (class, reason) = image_class(*kind);
            (class, reason, vec![])
        }
        ActorError::Driver(driver) => {
            let (class, reason) = driver_class(driver);
            let metadata = match driver {
                DriverError::NotFound { sandbox_id }
                | DriverError::GenerationMismatch { sandbox_id, .. } => {
                    vec![("sandbox_id", sandbox_id.clone())]
                }
                _ => vec![],
            };
            (class, reason, metadata)
        }
        ActorError::DiskFull(_) => (C::ResourceExhausted, "DISK_FULL", vec![]),
        ActorError::StoreUnavailable(_) => (C::Unavailable, "STORE_UNAVAILABLE", vec![]),
        ActorError::NoNodeFits(_) => (C::ResourceExhausted, "NO_NODE_FITS", vec![]),
        ActorError::Store(_) | ActorError::Internal(_) => (C::Internal, "INTERNAL", vec![]),
    }
}

/// The class and reason of an image failure.
fn image_class(kind: ImageFailure) -> (Class, &'static str) {
    use Class as C;
    match kind {
        ImageFailure::RegistryUnavailable => (C::Unavailable, "REGISTRY_UNAVAILABLE"),
        ImageFailure::RegistryUnauthorized => (C::PermissionDenied, "REGISTRY_UNAUTHORIZED"),
        ImageFailure::Platform => (C::InvalidArgument, "IMAGE_PLATFORM"),
        ImageFailure::BadContent => (C::InvalidArgument, "IMAGE_INVALID"),
        ImageFailure::InvalidArgument => (C::InvalidArgument, "IMAGE_INVALID_ARGUMENT"),
        ImageFailure::Store => (C::Internal, "IMAGE_STORE"),
        ImageFailure::Deadline => (C::DeadlineExceeded, "REGISTRY_DEADLINE"),
        ImageFailure::TooLarge => (C::ResourceExhausted, "IMAGE_TOO_LARGE"),
        ImageFailure::NoRoom => (C::ResourceExhausted, "IMAGE_STORE_FULL"),
        ImageFailure::Cancelled => (C::Cancelled, "IMAGE_CANCELLED"),
        ImageFailure::Reserved => (C::PermissionDenied, "IMAGE_NAME_RESERVED"),
    }
}

/// The class and reason of a driver error passed through: the driver error's own kind.
fn driver_class(err: &DriverError) -> (Class, &'static str) {
    use Class as C;
    match err {
        DriverError::InvalidArgument(_) => (C::InvalidArgument, "DRIVER_INVALID_ARGUMENT"),
        DriverError::NotFound { .. } => (C::NotFound, "DRIVER_NOT_FOUND"),
        DriverError::GenerationMismatch { .. } => (C::Aborted, "DRIVER_GENERATION_MISMATCH"),
        DriverError::FailedPrecondition(_) => (C::FailedPrecondition, "DRIVER_FAILED_PRECONDITION"),
        DriverError::Unimplemented(_) => (C::Unimplemented, "DRIVER_UNIMPLEMENTED"),
        DriverError::Unavailable(_) => (C::Unavailable, "DRIVER_UNAVAILABLE"),
        DriverError::DeadlineExceeded { .. } => (C::DeadlineExceeded, "DRIVER_DEADLINE_EXCEEDED"),
        DriverError::Internal(_) => (C::Internal, "DRIVER_INTERNAL"),
    }
}

/// One of each actor error, every variant (and every image and driver kind) at least once:
/// what the tables of the transports are checked over. The match in [`covers`] has no
/// wildcard, so a new variant does not compile until it is added here.
#[cfg(test)]
pub(crate) fn every_actor_error() -> Vec<ActorError> {
    use std::time::Duration;
    let id = "0b0e7d6e-55b4-4b5e-9d0c-1a9a4f0c2d11".to_string();
    let mut all = vec![
        ActorError::WorkspaceNotFound("\"alpha\"".into()),
        ActorError::SandboxNotFound {
            what: "\"web\" in workspace \"alpha\"".into(),
            hint: " (it exists in \"beta\")".into(),
            similar: Vec::new(),
        },
        ActorError::NameTaken {
            kind: "sandbox",
            name: "web".into(),
            scope: " in workspace \"alpha\"".into(),
            existing: "x".into(),
        },
        ActorError::AmbiguousName {
            name: "web".into(),
            workspaces: vec!["a".into(), "b".into()],
        },
        ActorError::WorkspaceTerminating("alpha".into()),
        ActorError::WorkspaceNotEmpty {
            name: "alpha".into(),
            remaining: 1,
            blockers: vec!["sandbox alpha/a".into()],
        },
        ActorError::ObjectNotFound {
            kind: "provider",
            what: "\"p\"".into(),
        },
        ActorError::ProviderInUse {
            provider: "p".into(),
            users: vec!["alpha/a".into()],
        },
        ActorError::InvalidName {
            what: "sandbox",
            name: "Bad_Name".into(),
            error: sbx_proto::names::validate_name("Bad_Name").unwrap_err(),
        },
        ActorError::InvalidArgument("x".into()),
        ActorError::FailedPrecondition("not ready".into()),
        ActorError::Unimplemented("snapshots".into()),
        ActorError::Unavailable("busy".into()),
        ActorError::HeldElsewhere {
            workspace: uuid::Uuid::nil(),
            gateway: uuid::Uuid::nil(),
            address: "http://127.0.0.1:1".into(),
        },
        ActorError::ResourceVersionInFuture {
            requested: 9,
            newest: 3,
        },
        ActorError::ResourceVersionTooOld {
            requested: 3,
            oldest: 9,
        },
        ActorError::InvalidImageReference("image reference \"Bad Ref\" is invalid".into()),
        ActorError::ImageNotFound("\"docker.io/library/nope:1\"".into()),
        ActorError::ImageInUse {
            image: "docker.io/library/app:v1".into(),
            digest: "sha256:ab".into(),
            users: vec!["default/web".into()],
        },
        ActorError::DiskFull("DATA is full".into()),
        ActorError::StoreUnavailable("the store is away".into()),
        ActorError::NoNodeFits("no node has 64 cores".into()),
        ActorError::Store("corrupt".into()),
        ActorError::Internal("bug".into()),
    ];
    for kind in [
        ImageFailure::RegistryUnavailable,
        ImageFailure::RegistryUnauthorized,
        ImageFailure::Platform,
        ImageFailure::BadContent,
        ImageFailure::InvalidArgument,
        ImageFailure::Store,
        ImageFailure::Deadline,
        ImageFailure::TooLarge,
        ImageFailure::NoRoom,
        ImageFailure::Cancelled,
        ImageFailure::Reserved,
    ] {
        all.push(ActorError::Image {
            kind,
            message: "image docker.io/library/app:v1: why".into(),
        });
    }
    for driver in [
        DriverError::InvalidArgument("x".into()),
        DriverError::NotFound {
            sandbox_id: id.clone(),
        },
        DriverError::GenerationMismatch {
            sandbox_id: id,
            running: 2,
            requested: 3,
        },
        DriverError::FailedPrecondition("stopped".into()),
        DriverError::Unimplemented("exec".into()),
        DriverError::Unavailable("away".into()),
        DriverError::DeadlineExceeded {
            operation: "exec",
            after: Duration::from_secs(1),
        },
        DriverError::Internal("bug".into()),
    ] {
        all.push(ActorError::Driver(driver));
    }
    all.iter().for_each(covers);
    all
}

/// Fails to compile when `ActorError` gains a variant [`every_actor_error`] lacks.
#[cfg(test)]
fn covers(err: &ActorError) {
    match err {
        ActorError::WorkspaceNotFound(_)
        | ActorError::SandboxNotFound { .. }
        | ActorError::NameTaken { .. }
        | ActorError::AmbiguousName { .. }
        | ActorError::WorkspaceTerminating(_)
        | ActorError::WorkspaceNotEmpty { .. }
        | ActorError::ObjectNotFound { .. }
        | ActorError::ProviderInUse { .. }
        | ActorError::InvalidName { .. }
        | ActorError::InvalidArgument(_)
        | ActorError::FailedPrecondition(_)
        | ActorError::Unimplemented(_)
        | ActorError::Unavailable(_)
        | ActorError::HeldElsewhere { .. }
        | ActorError::ResourceVersionInFuture { .. }
        | ActorError::ResourceVersionTooOld { .. }
        | ActorError::InvalidImageReference(_)
        | ActorError::ImageNotFound(_)
        | ActorError::ImageInUse { .. }
        | ActorError::Image { .. }
        | ActorError::Driver(_)
        | ActorError::DiskFull(_)
        | ActorError::StoreUnavailable(_)
        | ActorError::NoNodeFits(_)
        | ActorError::Store(_)
        | ActorError::Internal(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_a_class_a_reason_and_its_own_text() {
        for err in every_actor_error() {
            let failure = Failure::from(&err);
            assert!(!failure.reason.is_empty(), "{err:?}");
            assert_eq!(failure.message, err.to_string());
            assert!(!failure.bare);
        }
    }

    #[test]
    fn http_and_connect_agree_with_each_other_for_every_class() {
        // Connect's own table from code to HTTP status (connectrpc.com/docs/protocol).
        let connect_http = |code: &str| match code {
            "canceled" => 499,
            "invalid_argument" | "failed_precondition" | "out_of_range" => 400,
            "unauthenticated" => 401,
            "permission_denied" => 403,
            "not_found" => 404,
            "already_exists" | "aborted" => 409,
            "resource_exhausted" => 429,
            "unimplemented" => 501,
            "unavailable" => 503,
            "deadline_exceeded" => 504,
            _ => 500,
        };
        for class in Class::ALL {
            assert_eq!(
                connect_http(class.connect_code()),
                class.http_status(),
                "{class:?}"
            );
        }
    }

    #[test]
    fn a_held_workspace_names_its_holder() {
        let failure = Failure::from(ActorError::HeldElsewhere {
            workspace: uuid::Uuid::nil(),
            gateway: uuid::Uuid::nil(),
            address: "https://10.0.0.2:7443".into(),
        });
        assert_eq!(failure.class, Class::Elsewhere);
        assert_eq!(failure.holder(), Some("https://10.0.0.2:7443"));
        assert_eq!(
            Failure::from(ActorError::Internal("x".into())).holder(),
            None
        );
    }
}
