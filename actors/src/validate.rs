//! Checks of what a request asks for, before any actor sees it. Pure functions.

use std::collections::HashMap;

use sbx_proto::names::validate_name;
use sbx_proto::v1::{SandboxRef, SandboxSpec, WorkspaceRef};
use uuid::Uuid;

use crate::error::{ActorError, Result};

/// The most labels or environment variables one object may carry.
pub const MAX_MAP_ENTRIES: usize = 64;
/// The longest argv, in arguments, and the longest single argument or env value, in bytes.
pub const MAX_ARGS: usize = 1024;
pub const MAX_VALUE_LEN: usize = 32 * 1024;

/// How a request names a sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SandboxSelector {
    /// Authoritative: this sandbox or nothing.
    Id(Uuid),
    /// Resolved inside one workspace only. `workspace: None` means the request named no
    /// workspace (it stands for "default").
    Name {
        workspace: Option<String>,
        name: String,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkspaceSelector {
    Id(Uuid),
    Name(String),
}

pub fn parse_id(what: &str, id: &str) -> Result<Uuid> {
    Uuid::parse_str(id)
        .map_err(|_| ActorError::InvalidArgument(format!("{what} id {id:?} is not a UUID")))
}

pub fn name(what: &'static str, name: &str) -> Result<()> {
    validate_name(name).map_err(|error| ActorError::InvalidName {
        what,
        name: name.to_string(),
        error,
    })
}

impl SandboxSelector {
    pub fn from_ref(r: &SandboxRef) -> Result<Self> {
        if !r.id.is_empty() {
            return Ok(SandboxSelector::Id(parse_id("sandbox", &r.id)?));
        }
        if r.name.is_empty() {
            return Err(ActorError::InvalidArgument(
                "name the sandbox by id, or by name (and workspace)".into(),
            ));
        }
        name("sandbox", &r.name)?;
        let workspace = if r.workspace.is_empty() {
            None
        } else {
            name("workspace", &r.workspace)?;
            Some(r.workspace.clone())
        };
        Ok(SandboxSelector::Name {
            workspace,
            name: r.name.clone(),
        })
    }
}

impl WorkspaceSelector {
    pub fn from_ref(r: &WorkspaceRef) -> Result<Self> {
        if !r.id.is_empty() {
            return Ok(WorkspaceSelector::Id(parse_id("workspace", &r.id)?));
        }
        if r.name.is_empty() {
            return Err(ActorError::InvalidArgument(
                "name the workspace by id or by name".into(),
            ));
        }
        name("workspace", &r.name)?;
        Ok(WorkspaceSelector::Name(r.name.clone()))
    }
}

/// Checks a label map: at most [`MAX_MAP_ENTRIES`], keys and values by the store's rules.
pub fn labels(labels: &HashMap<String, String>) -> Result<()> {
    if labels.len() > MAX_MAP_ENTRIES {
        return Err(ActorError::InvalidArgument(format!(
            "{} labels given; at most {MAX_MAP_ENTRIES} are allowed",
            labels.len()
        )));
    }
    let map = labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    sbx_storage::validate_labels(&map).map_err(|e| ActorError::InvalidArgument(e.to_string()))
}

/// Checks a sandbox spec. `image_default` names the resolved image when it has an
/// Entrypoint or Cmd of its own: the command may then be empty (the driver runs the image's
/// default). `image` is the resolved image without one (for the error message).
pub fn spec(spec: &SandboxSpec, image: Option<&ImageDefault>) -> Result<()> {
    if spec.command.is_empty() {
        match image {
            Some(ImageDefault { runs: true, .. }) => {}
            Some(ImageDefault { name, runs: false }) => {
                return Err(ActorError::InvalidArgument(format!(
                    "the sandbox command is empty and image {name} has no Entrypoint or Cmd; give the argv of its main process"
                )));
            }
            None => {
                return Err(ActorError::InvalidArgument(
                    "the sandbox command is empty; give the argv of its main process".into(),
                ));
            }
        }
    } else if spec.command[0].is_empty() {
        return Err(ActorError::InvalidArgument(
            "the sandbox command starts with an empty argument; give the argv of its main process"
                .into(),
        ));
    }
    if spec.command.len() > MAX_ARGS {
        return Err(ActorError::InvalidArgument(format!(
            "the command has {} arguments; at most {MAX_ARGS}",
            spec.command.len()
        )));
    }
    if let Some(arg) = spec
        .command
        .iter()
        .find(|a| a.len() > MAX_VALUE_LEN || a.contains('\0'))
    {
        return Err(ActorError::InvalidArgument(format!(
            "a command argument is over {MAX_VALUE_LEN} bytes or holds a NUL byte (it starts {:?})",
            arg.chars().take(20).collect::<String>()
        )));
    }
    if spec.env.len() > MAX_MAP_ENTRIES * 4 {
        return Err(ActorError::InvalidArgument(format!(
            "{} environment variables; at most {}",
            spec.env.len(),
            MAX_MAP_ENTRIES * 4
        )));
    }
    for (k, v) in &spec.env {
        if k.is_empty()
            || k.contains('=')
            || k.contains('\0')
            || v.contains('\0')
            || v.len() > MAX_VALUE_LEN
        {
            return Err(ActorError::InvalidArgument(format!(
                "environment variable {k:?} is invalid: names are non-empty without '=' or NUL, values at most {MAX_VALUE_LEN} bytes without NUL"
            )));
        }
    }
    labels(&spec.labels)
}

/// The image a sandbox create resolved, as far as the command check cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDefault {
    /// The image's name and digest, for messages.
    pub name: String,
    /// Whether its Entrypoint + Cmd is non-empty.
    pub runs: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sref(id: &str, workspace: &str, name: &str) -> SandboxRef {
        SandboxRef {
            id: id.into(),
            workspace: workspace.into(),
            name: name.into(),
        }
    }

    #[test]
    fn sandbox_refs() {
        let id = Uuid::new_v4();
        // An id wins over a name, always.
        assert_eq!(
            SandboxSelector::from_ref(&sref(&id.to_string(), "alpha", "demo")).unwrap(),
            SandboxSelector::Id(id)
        );
        assert_eq!(
            SandboxSelector::from_ref(&sref("", "", "demo")).unwrap(),
            SandboxSelector::Name {
                workspace: None,
                name: "demo".into()
            }
        );
        assert_eq!(
            SandboxSelector::from_ref(&sref("", "alpha", "demo")).unwrap(),
            SandboxSelector::Name {
                workspace: Some("alpha".into()),
                name: "demo".into()
            }
        );
        assert!(matches!(
            SandboxSelector::from_ref(&sref("not-a-uuid", "", "")),
            Err(ActorError::InvalidArgument(_))
        ));
        assert!(matches!(
            SandboxSelector::from_ref(&sref("", "", "")),
            Err(ActorError::InvalidArgument(_))
        ));
        assert!(matches!(
            SandboxSelector::from_ref(&sref("", "", "Bad_Name")),
            Err(ActorError::InvalidName { .. })
        ));
        assert!(matches!(
            SandboxSelector::from_ref(&sref("", "ALPHA", "demo")),
            Err(ActorError::InvalidName {
                what: "workspace",
                ..
            })
        ));
    }

    #[test]
    fn specs() {
        let ok = SandboxSpec {
            command: vec!["sleep".into(), "1".into()],
            ..Default::default()
        };
        assert!(spec(&ok, None).is_ok());
        assert!(spec(&SandboxSpec::default(), None).is_err());
        assert!(
            spec(
                &SandboxSpec {
                    command: vec![String::new()],
                    ..Default::default()
                },
                None
            )
            .is_err()
        );
        let mut bad_env = ok.clone();
        bad_env.env.insert("A=B".into(), "x".into());
        assert!(spec(&bad_env, None).is_err());
        let mut many_labels = ok.clone();
        for i in 0..=MAX_MAP_ENTRIES {
            many_labels.labels.insert(format!("k{i}"), "v".into());
        }
        assert!(spec(&many_labels, None).is_err());
    }

    #[test]
    fn an_empty_command_runs_the_image_default_only_when_it_has_one() {
        let empty = SandboxSpec::default();
        let runs = ImageDefault {
            name: "docker.io/library/busybox:latest".into(),
            runs: true,
        };
        assert!(spec(&empty, Some(&runs)).is_ok());
        let silent = ImageDefault {
            name: "sbx.local/rootfs:latest".into(),
            runs: false,
        };
        let err = spec(&empty, Some(&silent)).unwrap_err().to_string();
        assert!(err.contains("sbx.local/rootfs:latest"), "{err}");
        assert!(err.contains("give the argv"), "{err}");
        let err = spec(&empty, None).unwrap_err().to_string();
        assert!(err.contains("give the argv"), "{err}");
        // A given command is checked the same with or without an image.
        let blank_first = SandboxSpec {
            command: vec![String::new()],
            ..Default::default()
        };
        assert!(spec(&blank_first, Some(&runs)).is_err());
    }
}
