//! The one place where an [`ActorError`] becomes a gRPC [`Status`].
//!
//! Every status carries a `google.rpc.ErrorInfo` detail with domain [`ERROR_DOMAIN`] and an
//! UPPER_SNAKE reason, so clients branch on the reason, never on the message text. The
//! message is the error's own text, which names the workspace or sandbox concerned.
//!
//! | reason | code |
//! |---|---|
//! | `WORKSPACE_NOT_FOUND`, `SANDBOX_NOT_FOUND` | `NOT_FOUND` |
//! | `NAME_TAKEN` | `ALREADY_EXISTS` |
//! | `AMBIGUOUS_NAME` | `FAILED_PRECONDITION` — the request is well formed; what makes it unanswerable is the current state (the name exists in several workspaces), and it becomes answerable once the caller names the workspace |
//! | `WORKSPACE_TERMINATING`, `WORKSPACE_NOT_EMPTY`, `FAILED_PRECONDITION` | `FAILED_PRECONDITION` |
//! | `INVALID_NAME`, `INVALID_ARGUMENT` | `INVALID_ARGUMENT` |
//! | `UNIMPLEMENTED` | `UNIMPLEMENTED` |
//! | `UNAVAILABLE` | `UNAVAILABLE` |
//! | `RESOURCE_VERSION_TOO_OLD` | `OUT_OF_RANGE` |
//! | `IMAGE_NOT_FOUND` | `NOT_FOUND` |
//! | `IMAGE_IN_USE` | `FAILED_PRECONDITION` (metadata `users`: the sandboxes, workspace/name) |
//! | `IMAGE_REFERENCE_INVALID`, `IMAGE_INVALID` (unsafe, malformed or mismatched content), `IMAGE_INVALID_ARGUMENT`, `IMAGE_PLATFORM` | `INVALID_ARGUMENT` |
//! | `REGISTRY_UNAVAILABLE` | `UNAVAILABLE` |
//! | `REGISTRY_UNAUTHORIZED` | `PERMISSION_DENIED` |
//! | `IMAGE_STORE` (the image store's own files failed) | `INTERNAL` |
//! | `DRIVER_*` | the driver error's own kind (see [`driver_status`]) |
//! | `INTERNAL` (a store failure or a bug) | `INTERNAL` |

use std::collections::HashMap;

use sbx_actors::{ActorError, ImageFailure};
use sbx_drivers::DriverError;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

/// The `ErrorInfo.domain` of every error sbxd answers.
pub const ERROR_DOMAIN: &str = "sbx.dev";

/// Maps an actor-layer error to the gRPC status the client sees.
pub fn actor_error_to_status(err: &ActorError) -> Status {
    let mut metadata = HashMap::new();
    let (code, reason) = match err {
        ActorError::WorkspaceNotFound(what) => {
            metadata.insert("workspace".to_string(), what.clone());
            (Code::NotFound, "WORKSPACE_NOT_FOUND")
        }
        ActorError::SandboxNotFound { what, .. } => {
            metadata.insert("sandbox".to_string(), what.clone());
            (Code::NotFound, "SANDBOX_NOT_FOUND")
        }
        ActorError::NameTaken {
            kind,
            name,
            existing,
            ..
        } => {
            metadata.insert("kind".to_string(), kind.to_string());
            metadata.insert("name".to_string(), name.clone());
            metadata.insert("existing".to_string(), existing.clone());
            (Code::AlreadyExists, "NAME_TAKEN")
        }
        ActorError::AmbiguousName { name, workspaces } => {
            metadata.insert("name".to_string(), name.clone());
            metadata.insert("workspaces".to_string(), workspaces.join(","));
            (Code::FailedPrecondition, "AMBIGUOUS_NAME")
        }
        ActorError::WorkspaceTerminating(name) => {
            metadata.insert("workspace".to_string(), name.clone());
            (Code::FailedPrecondition, "WORKSPACE_TERMINATING")
        }
        ActorError::WorkspaceNotEmpty { name, remaining } => {
            metadata.insert("workspace".to_string(), name.clone());
            metadata.insert("remaining".to_string(), remaining.to_string());
            (Code::FailedPrecondition, "WORKSPACE_NOT_EMPTY")
        }
        ActorError::InvalidName { what, name, .. } => {
            metadata.insert("kind".to_string(), what.to_string());
            metadata.insert("name".to_string(), name.clone());
            (Code::InvalidArgument, "INVALID_NAME")
        }
        ActorError::InvalidArgument(_) => (Code::InvalidArgument, "INVALID_ARGUMENT"),
        ActorError::FailedPrecondition(_) => (Code::FailedPrecondition, "FAILED_PRECONDITION"),
        ActorError::Unimplemented(_) => (Code::Unimplemented, "UNIMPLEMENTED"),
        ActorError::Unavailable(_) => (Code::Unavailable, "UNAVAILABLE"),
        ActorError::ResourceVersionTooOld { requested, oldest } => {
            metadata.insert("requested".to_string(), requested.to_string());
            metadata.insert("oldest".to_string(), oldest.to_string());
            (Code::OutOfRange, "RESOURCE_VERSION_TOO_OLD")
        }
        ActorError::InvalidImageReference(_) => (Code::InvalidArgument, "IMAGE_REFERENCE_INVALID"),
        ActorError::ImageNotFound(what) => {
            metadata.insert("image".to_string(), what.clone());
            (Code::NotFound, "IMAGE_NOT_FOUND")
        }
        ActorError::ImageInUse {
            image,
            digest,
            users,
        } => {
            metadata.insert("image".to_string(), image.clone());
            metadata.insert("digest".to_string(), digest.clone());
            metadata.insert("users".to_string(), users.join(","));
            (Code::FailedPrecondition, "IMAGE_IN_USE")
        }
        ActorError::Image { kind, .. } => match kind {
            ImageFailure::RegistryUnavailable => (Code::Unavailable, "REGISTRY_UNAVAILABLE"),
            ImageFailure::RegistryUnauthorized => (Code::PermissionDenied, "REGISTRY_UNAUTHORIZED"),
            ImageFailure::Platform => (Code::InvalidArgument, "IMAGE_PLATFORM"),
            ImageFailure::BadContent => (Code::InvalidArgument, "IMAGE_INVALID"),
            ImageFailure::InvalidArgument => (Code::InvalidArgument, "IMAGE_INVALID_ARGUMENT"),
            ImageFailure::Store => (Code::Internal, "IMAGE_STORE"),
        },
        ActorError::Driver(driver) => {
            let (code, reason) = driver_status(driver);
            if let DriverError::NotFound { sandbox_id }
            | DriverError::GenerationMismatch { sandbox_id, .. } = driver
            {
                metadata.insert("sandbox_id".to_string(), sandbox_id.clone());
            }
            (code, reason)
        }
        ActorError::Store(_) | ActorError::Internal(_) => (Code::Internal, "INTERNAL"),
    };
    Status::with_error_details(
        code,
        err.to_string(),
        ErrorDetails::with_error_info(reason, ERROR_DOMAIN, metadata),
    )
}

/// The code and reason of a driver error passed through to the client.
fn driver_status(err: &DriverError) -> (Code, &'static str) {
    match err {
        DriverError::InvalidArgument(_) => (Code::InvalidArgument, "DRIVER_INVALID_ARGUMENT"),
        DriverError::NotFound { .. } => (Code::NotFound, "DRIVER_NOT_FOUND"),
        DriverError::GenerationMismatch { .. } => (Code::Aborted, "DRIVER_GENERATION_MISMATCH"),
        DriverError::FailedPrecondition(_) => {
            (Code::FailedPrecondition, "DRIVER_FAILED_PRECONDITION")
        }
        DriverError::Unimplemented(_) => (Code::Unimplemented, "DRIVER_UNIMPLEMENTED"),
        DriverError::Unavailable(_) => (Code::Unavailable, "DRIVER_UNAVAILABLE"),
        DriverError::DeadlineExceeded { .. } => {
            (Code::DeadlineExceeded, "DRIVER_DEADLINE_EXCEEDED")
        }
        DriverError::Internal(_) => (Code::Internal, "DRIVER_INTERNAL"),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sbx_proto::names::validate_name;

    use super::*;

    fn check(err: ActorError, code: Code, reason: &str, message_part: &str) {
        let status = actor_error_to_status(&err);
        assert_eq!(status.code(), code, "{err:?}");
        let info = status
            .get_details_error_info()
            .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
        assert_eq!(info.reason, reason, "{err:?}");
        assert_eq!(info.domain, ERROR_DOMAIN);
        assert!(
            status.message().contains(message_part),
            "{:?} does not contain {message_part:?}",
            status.message()
        );
    }

    #[test]
    fn every_actor_error_has_its_code_and_reason() {
        let name_error = validate_name("Bad_Name").unwrap_err();
        let cases = [
            (
                ActorError::WorkspaceNotFound("\"alpha\"".into()),
                Code::NotFound,
                "WORKSPACE_NOT_FOUND",
                "alpha",
            ),
            (
                ActorError::SandboxNotFound {
                    what: "\"web\" in workspace \"alpha\"".into(),
                    hint: String::new(),
                },
                Code::NotFound,
                "SANDBOX_NOT_FOUND",
                "web",
            ),
            (
                ActorError::NameTaken {
                    kind: "sandbox",
                    name: "web".into(),
                    scope: " in workspace \"alpha\"".into(),
                    existing: "x".into(),
                },
                Code::AlreadyExists,
                "NAME_TAKEN",
                "web",
            ),
            (
                ActorError::AmbiguousName {
                    name: "web".into(),
                    workspaces: vec!["a".into(), "b".into()],
                },
                Code::FailedPrecondition,
                "AMBIGUOUS_NAME",
                "web",
            ),
            (
                ActorError::WorkspaceTerminating("alpha".into()),
                Code::FailedPrecondition,
                "WORKSPACE_TERMINATING",
                "alpha",
            ),
            (
                ActorError::WorkspaceNotEmpty {
                    name: "alpha".into(),
                    remaining: 2,
                },
                Code::FailedPrecondition,
                "WORKSPACE_NOT_EMPTY",
                "alpha",
            ),
            (
                ActorError::InvalidName {
                    what: "sandbox",
                    name: "Bad_Name".into(),
                    error: name_error,
                },
                Code::InvalidArgument,
                "INVALID_NAME",
                "Bad_Name",
            ),
            (
                ActorError::InvalidArgument("x".into()),
                Code::InvalidArgument,
                "INVALID_ARGUMENT",
                "x",
            ),
            (
                ActorError::FailedPrecondition("not ready".into()),
                Code::FailedPrecondition,
                "FAILED_PRECONDITION",
                "not ready",
            ),
            (
                ActorError::Unimplemented("snapshots".into()),
                Code::Unimplemented,
                "UNIMPLEMENTED",
                "snapshots",
            ),
            (
                ActorError::Unavailable("busy".into()),
                Code::Unavailable,
                "UNAVAILABLE",
                "busy",
            ),
            (
                ActorError::ResourceVersionTooOld {
                    requested: 3,
                    oldest: 9,
                },
                Code::OutOfRange,
                "RESOURCE_VERSION_TOO_OLD",
                "3",
            ),
            (
                ActorError::Store("disk full".into()),
                Code::Internal,
                "INTERNAL",
                "disk full",
            ),
            (
                ActorError::Internal("bug".into()),
                Code::Internal,
                "INTERNAL",
                "bug",
            ),
            (
                ActorError::InvalidImageReference("image reference \"Bad Ref\" is invalid".into()),
                Code::InvalidArgument,
                "IMAGE_REFERENCE_INVALID",
                "Bad Ref",
            ),
            (
                ActorError::ImageNotFound("\"docker.io/library/nope:1\"".into()),
                Code::NotFound,
                "IMAGE_NOT_FOUND",
                "nope:1",
            ),
            (
                ActorError::ImageInUse {
                    image: "docker.io/library/app:v1".into(),
                    digest: "sha256:ab".into(),
                    users: vec!["default/web".into(), "team/api".into()],
                },
                Code::FailedPrecondition,
                "IMAGE_IN_USE",
                "default/web, team/api",
            ),
        ];
        let image = |kind| ActorError::Image {
            kind,
            message: "image docker.io/library/app:v1: why".into(),
        };
        let image_cases = [
            (
                ImageFailure::RegistryUnavailable,
                Code::Unavailable,
                "REGISTRY_UNAVAILABLE",
            ),
            (
                ImageFailure::RegistryUnauthorized,
                Code::PermissionDenied,
                "REGISTRY_UNAUTHORIZED",
            ),
            (
                ImageFailure::Platform,
                Code::InvalidArgument,
                "IMAGE_PLATFORM",
            ),
            (
                ImageFailure::BadContent,
                Code::InvalidArgument,
                "IMAGE_INVALID",
            ),
            (
                ImageFailure::InvalidArgument,
                Code::InvalidArgument,
                "IMAGE_INVALID_ARGUMENT",
            ),
            (ImageFailure::Store, Code::Internal, "IMAGE_STORE"),
        ];
        for (kind, code, reason) in image_cases {
            check(image(kind), code, reason, "docker.io/library/app:v1");
        }
        for (err, code, reason, part) in cases {
            check(err, code, reason, part);
        }
    }

    #[test]
    fn driver_errors_keep_their_kind() {
        let id = "0b0e7d6e-55b4-4b5e-9d0c-1a9a4f0c2d11".to_string();
        let cases = [
            (
                DriverError::InvalidArgument("x".into()),
                Code::InvalidArgument,
                "DRIVER_INVALID_ARGUMENT",
            ),
            (
                DriverError::NotFound {
                    sandbox_id: id.clone(),
                },
                Code::NotFound,
                "DRIVER_NOT_FOUND",
            ),
            (
                DriverError::GenerationMismatch {
                    sandbox_id: id.clone(),
                    running: 2,
                    requested: 3,
                },
                Code::Aborted,
                "DRIVER_GENERATION_MISMATCH",
            ),
            (
                DriverError::FailedPrecondition("stopped".into()),
                Code::FailedPrecondition,
                "DRIVER_FAILED_PRECONDITION",
            ),
            (
                DriverError::Unimplemented("exec".into()),
                Code::Unimplemented,
                "DRIVER_UNIMPLEMENTED",
            ),
            (
                DriverError::Unavailable("away".into()),
                Code::Unavailable,
                "DRIVER_UNAVAILABLE",
            ),
            (
                DriverError::DeadlineExceeded {
                    operation: "exec",
                    after: Duration::from_secs(1),
                },
                Code::DeadlineExceeded,
                "DRIVER_DEADLINE_EXCEEDED",
            ),
            (
                DriverError::Internal("bug".into()),
                Code::Internal,
                "DRIVER_INTERNAL",
            ),
        ];
        for (err, code, reason) in cases {
            let text = err.to_string();
            check(ActorError::Driver(err), code, reason, &text);
        }
        let status = actor_error_to_status(&ActorError::Driver(DriverError::NotFound {
            sandbox_id: id.clone(),
        }));
        let info = status.get_details_error_info().unwrap();
        assert_eq!(info.metadata.get("sandbox_id"), Some(&id));
    }
}
