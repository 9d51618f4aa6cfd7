//! Checks of what a request asks for, before any actor sees it. Pure functions, called once
//! at the actor API's entry points; the bounds are the table in [`crate::limits`], and every
//! error quotes at most a short escaped prefix of the value it refuses ([`limits::quote`]).

use std::collections::HashMap;

use prost::Message;
use sbx_proto::names::validate_name;
use sbx_proto::v1::{SandboxRef, SandboxSpec, WorkspaceRef};
use sbx_storage::LabelSelector;
use uuid::Uuid;

use crate::error::{ActorError, Result};
use crate::limits::{self, quote};

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

/// The workspace a request means: none named, or an empty name, is
/// [`sbx_proto::names::DEFAULT_WORKSPACE`] (the rule itself is
/// [`sbx_proto::names::workspace_or_default`], which the CLI applies too).
pub fn workspace_or_default(workspace: Option<&str>) -> &str {
    sbx_proto::names::workspace_or_default(workspace.unwrap_or(""))
}

pub fn parse_id(what: &str, id: &str) -> Result<Uuid> {
    Uuid::parse_str(id).map_err(|_| invalid(format!("{what} id {} is not a UUID", quote(id))))
}

/// Checks a workspace or sandbox name. The error keeps at most a short prefix of the name
/// (its length is in the rule's words, e.g. "name is 5000 bytes long").
pub fn name(what: &'static str, name: &str) -> Result<()> {
    validate_name(name).map_err(|error| ActorError::InvalidName {
        what,
        name: limits::prefix(name),
        error,
    })
}

fn invalid(message: String) -> ActorError {
    ActorError::InvalidArgument(message)
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

/// The label a build's RUN sandboxes carry (its value: the sandbox's name); no exec, copy
/// into or forward reaches a sandbox with it (`Gateway`'s use checks, `api/lifetimes.rs`).
pub const BUILD_LABEL: &str = "sbx.build";

/// Checks a label map: at most [`limits::MAX_LABELS`], keys and values at most
/// [`limits::MAX_LABEL_BYTES`] and by the store's rules.
pub fn labels(labels: &HashMap<String, String>) -> Result<()> {
    if labels.len() > limits::MAX_LABELS {
        return Err(invalid(format!(
            "{} labels given; at most {} are allowed",
            labels.len(),
            limits::MAX_LABELS
        )));
    }
    for (key, value) in labels {
        for (what, text) in [("key", key), ("value", value)] {
            if text.len() > limits::MAX_LABEL_BYTES {
                return Err(invalid(format!(
                    "label {what} {} is over the limit of {} bytes",
                    quote(text),
                    limits::MAX_LABEL_BYTES
                )));
            }
        }
    }
    // Every key and value is short now, so the store's message quoting one is short too.
    let map = labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    sbx_storage::validate_labels(&map).map_err(|e| invalid(e.to_string()))
}

/// Checks an argv (a spec's command or an exec's) against the argv bounds: at most
/// [`limits::MAX_ARGS`] arguments of at most [`limits::MAX_ARG_BYTES`] each, at most
/// [`limits::MAX_ARGV_BYTES`] in all, none holding a NUL byte (`execve` could not pass it).
pub fn argv(what: &str, argv: &[String]) -> Result<()> {
    if argv.len() > limits::MAX_ARGS {
        return Err(invalid(format!(
            "{what} has {} arguments; at most {} are allowed",
            argv.len(),
            limits::MAX_ARGS
        )));
    }
    let total: usize = argv.iter().map(|a| a.len() + 1).sum();
    if total > limits::MAX_ARGV_BYTES {
        return Err(invalid(format!(
            "{what} is {total} bytes (its arguments and their NULs); at most {} are allowed",
            limits::MAX_ARGV_BYTES
        )));
    }
    if let Some((i, arg)) = argv
        .iter()
        .enumerate()
        .find(|(_, a)| a.len() > limits::MAX_ARG_BYTES)
    {
        return Err(invalid(format!(
            "argument {i} of {what}, {}, is over the limit of {} bytes",
            quote(arg),
            limits::MAX_ARG_BYTES
        )));
    }
    if let Some((i, arg)) = argv.iter().enumerate().find(|(_, a)| a.contains('\0')) {
        return Err(invalid(format!(
            "argument {i} of {what} holds a NUL byte: {}",
            quote(arg)
        )));
    }
    Ok(())
}

/// Checks an environment (a spec's or an exec's): at most [`limits::MAX_ENV_VARS`]
/// variables, values at most [`limits::MAX_ENV_VALUE_BYTES`], at most
/// [`limits::MAX_ENV_BYTES`] in all; names non-empty without `=` or NUL, values without NUL.
pub fn env(what: &str, env: &HashMap<String, String>) -> Result<()> {
    if env.len() > limits::MAX_ENV_VARS {
        return Err(invalid(format!(
            "{what} has {} environment variables; at most {} are allowed",
            env.len(),
            limits::MAX_ENV_VARS
        )));
    }
    let total: usize = env.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if total > limits::MAX_ENV_BYTES {
        return Err(invalid(format!(
            "the environment of {what} is {total} bytes (NAME=value and a NUL each); at most {} are allowed",
            limits::MAX_ENV_BYTES
        )));
    }
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(invalid(format!(
                "environment variable name {} of {what} is invalid: names are non-empty, without '=' or NUL",
                quote(k)
            )));
        }
        if v.contains('\0') || v.len() > limits::MAX_ENV_VALUE_BYTES {
            return Err(invalid(format!(
                "environment variable {} of {what} is invalid: its value is {} bytes (at most {}) or holds a NUL byte",
                quote(k),
                v.len(),
                limits::MAX_ENV_VALUE_BYTES
            )));
        }
    }
    Ok(())
}

/// Checks every bound of a sandbox spec that does not depend on its image: its command,
/// environment, labels, image reference and resources (each check a linear scan that stops
/// at its bound, and each saying which field is over), then its size as a whole
/// ([`limits::MAX_SPEC_BYTES`]). Called first at create.
pub fn spec_bounds(spec: &SandboxSpec) -> Result<()> {
    argv("the sandbox command", &spec.command)?;
    env("the sandbox", &spec.env)?;
    labels(&spec.labels)?;
    if spec.image.len() > limits::MAX_IMAGE_REF_BYTES {
        return Err(invalid(format!(
            "the image reference {} is over the limit of {} bytes",
            quote(&spec.image),
            limits::MAX_IMAGE_REF_BYTES
        )));
    }
    if let Some(r) = &spec.resources {
        memory_limit("the memory limit", r.memory_bytes, "no limit")?;
        disk_limit("the disk limit", r.disk_bytes, "the defaults")?;
    }
    if let Some(n) = &spec.network {
        network(n)?;
    }
    let size = spec.encoded_len();
    if size > limits::MAX_SPEC_BYTES {
        return Err(invalid(format!(
            "the sandbox spec is {size} bytes encoded; at most {} are allowed",
            limits::MAX_SPEC_BYTES
        )));
    }
    Ok(())
}

/// Checks a network policy: a known mode, an allowlist only with mode policy, every entry
/// well formed (`sbx_network::parse_allowlist`), at most 10,000.
pub fn network(policy: &sbx_proto::v1::NetworkPolicy) -> Result<()> {
    use sbx_proto::v1::NetworkMode;
    match NetworkMode::try_from(policy.mode) {
        Ok(NetworkMode::Policy) => {}
        Ok(NetworkMode::None) | Ok(NetworkMode::Unspecified) => {
            if !policy.allow.is_empty() {
                return Err(invalid(
                    "network mode none admits nothing: an allowlist needs mode policy".to_string(),
                ));
            }
        }
        Err(_) => {
            return Err(invalid(format!(
                "network mode {} is not known",
                policy.mode
            )));
        }
    }
    sbx_network::parse_allowlist(&policy.allow)
        .map(|_| ())
        .map_err(|e| invalid(e.to_string()))
}

/// Checks a sandbox spec. `image_default` names the resolved image when it has an
/// Entrypoint or Cmd of its own: the command may then be empty (the driver runs the image's
/// default). `image` is the resolved image without one (for the error message). The bounds
/// are [`spec_bounds`]'s, checked before the image is resolved.
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
    Ok(())
}

/// Checks an exec: a non-empty command within the argv bounds, an environment within the
/// environment bounds, and a working directory that is empty or an absolute path of at most
/// [`limits::MAX_PATH_BYTES`] without NUL. The same bounds as a spec's, so an exec never ends
/// in E2BIG.
pub fn exec(command: &[String], env_vars: &HashMap<String, String>, workdir: &str) -> Result<()> {
    if command.is_empty() || command[0].is_empty() {
        return Err(invalid("the exec command is empty".into()));
    }
    argv("the exec command", command)?;
    env("the exec", env_vars)?;
    if !workdir.is_empty()
        && (!workdir.starts_with('/')
            || workdir.contains('\0')
            || workdir.len() > limits::MAX_PATH_BYTES)
    {
        return Err(invalid(format!(
            "the exec working directory {} is not an absolute path (at most {} bytes, no NUL)",
            quote(workdir),
            limits::MAX_PATH_BYTES
        )));
    }
    Ok(())
}

/// Checks an exec's user (`NAME`, `UID`, `NAME:GROUP`, `UID:GID`; empty: the sandbox's
/// default): at most [`limits::MAX_USER_BYTES`], no NUL or other control character. Whether
/// the sandbox has that user is the driver's to say (its agent looks it up inside).
pub fn exec_user(user: &str) -> Result<()> {
    if user.len() > limits::MAX_USER_BYTES || user.chars().any(char::is_control) {
        return Err(invalid(format!(
            "the exec user {} is not a user name or id (NAME, UID, NAME:GROUP or UID:GID: at \
             most {} bytes, no control characters)",
            quote(user),
            limits::MAX_USER_BYTES
        )));
    }
    Ok(())
}

/// Parses a label selector after checking its bounds: at most [`limits::MAX_SELECTOR_BYTES`]
/// and [`limits::MAX_SELECTOR_TERMS`] terms, so parsing and matching stay cheap.
pub fn selector(text: &str) -> Result<LabelSelector> {
    if text.len() > limits::MAX_SELECTOR_BYTES {
        return Err(invalid(format!(
            "label selector {} is over the limit of {} bytes",
            quote(text),
            limits::MAX_SELECTOR_BYTES
        )));
    }
    let terms = text.split(',').count();
    if terms > limits::MAX_SELECTOR_TERMS {
        return Err(invalid(format!(
            "label selector {} has {terms} terms; at most {} are allowed",
            quote(text),
            limits::MAX_SELECTOR_TERMS
        )));
    }
    text.parse::<LabelSelector>().map_err(|e| {
        // The store's message quotes the whole selector and the bad term in full (up to
        // 4 KiB each): each of them is quoted short here instead, as every error quotes.
        let mut reason = e.to_string();
        for part in std::iter::once(text).chain(text.split(',').map(str::trim)) {
            if part.chars().nth(limits::ERROR_QUOTE_CHARS).is_some() {
                reason = reason.replace(&format!("{part:?}"), &quote(part));
            }
        }
        invalid(format!(
            "label selector {}: {}",
            quote(text),
            limits::truncate(&reason, 256)
        ))
    })
}

/// Checks a list's page token: at most [`limits::MAX_PAGE_TOKEN_BYTES`].
pub fn page_token(token: &str) -> Result<()> {
    if token.len() > limits::MAX_PAGE_TOKEN_BYTES {
        return Err(invalid(format!(
            "page token {} is over the limit of {} bytes",
            quote(token),
            limits::MAX_PAGE_TOKEN_BYTES
        )));
    }
    Ok(())
}

/// The image a sandbox create resolved, as far as the command check cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageDefault {
    /// The image's name and digest, for messages.
    pub name: String,
    /// Whether its Entrypoint + Cmd is non-empty.
    pub runs: bool,
}

/// A memory limit (`what`, in bytes) is 0 (`zero_means`) or at least what a sandbox can
/// start with, [`limits::MIN_MEMORY_BYTES`] — for a sandbox's own, a workspace's default and
/// the gateway's.
pub fn memory_limit(what: &str, bytes: u64, zero_means: &str) -> Result<()> {
    size_floor(
        what,
        bytes,
        limits::MIN_MEMORY_BYTES,
        "the smallest a sandbox can start with",
        zero_means,
    )
}

/// A disk limit (`what`, in bytes) is 0 (`zero_means`) or at least
/// [`limits::MIN_DISK_BYTES`] — for a sandbox's own, a workspace's default and the gateway's.
pub fn disk_limit(what: &str, bytes: u64, zero_means: &str) -> Result<()> {
    size_floor(
        what,
        bytes,
        limits::MIN_DISK_BYTES,
        "the smallest disk a sandbox can be given",
        zero_means,
    )
}

fn size_floor(what: &str, bytes: u64, min: u64, min_is: &str, zero_means: &str) -> Result<()> {
    if bytes != 0 && bytes < min {
        return Err(invalid(format!(
            "{what} {bytes} bytes is below {min_is}, {min} bytes ({} MiB); give at least that, or 0 for {zero_means}",
            min >> 20
        )));
    }
    Ok(())
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
        assert!(spec_bounds(&bad_env).is_err());
        let mut many_labels = ok.clone();
        for i in 0..=limits::MAX_LABELS {
            many_labels.labels.insert(format!("k{i}"), "v".into());
        }
        assert!(spec_bounds(&many_labels).is_err());
    }

    fn refused(result: Result<impl std::fmt::Debug>) -> String {
        match result {
            Err(e @ (ActorError::InvalidArgument(_) | ActorError::InvalidName { .. })) => {
                let text = e.to_string();
                assert!(text.len() < 600, "{} bytes: {text}", text.len());
                text
            }
            other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
        }
    }

    #[test]
    fn every_bound_is_refused_with_a_short_message() {
        let base = SandboxSpec {
            command: vec!["sleep".into(), "1".into()],
            ..Default::default()
        };
        let with = |f: &dyn Fn(&mut SandboxSpec)| {
            let mut s = base.clone();
            f(&mut s);
            spec_bounds(&s)
        };
        // Argv: count, total bytes, one argument, NUL.
        assert!(with(&|s| s.command = vec!["x".into(); limits::MAX_ARGS]).is_ok());
        let e = refused(with(&|s| {
            s.command = vec!["x".into(); limits::MAX_ARGS + 1]
        }));
        assert!(e.contains("4097 arguments"), "{e}");
        let e = refused(with(&|s| s.command = vec!["y".repeat(1023); 300]));
        assert!(e.contains("307200 bytes"), "{e}");
        let e = refused(with(&|s| {
            s.command = vec!["z".repeat(limits::MAX_ARG_BYTES + 1)]
        }));
        assert!(
            e.contains("argument 0") && e.contains("(32769 bytes)"),
            "{e}"
        );
        refused(with(&|s| s.command = vec!["a\0b".into()]));
        // Environment: count, total, value, names.
        refused(with(&|s| {
            s.env = (0..=limits::MAX_ENV_VARS)
                .map(|i| (format!("V{i}"), String::new()))
                .collect()
        }));
        refused(with(&|s| {
            s.env = (0..8)
                .map(|i| (format!("V{i}"), "v".repeat(20_000)))
                .collect()
        }));
        refused(with(&|s| {
            s.env = HashMap::from([(String::new(), "v".into())])
        }));
        // Labels: a 3 MB value is refused quoting 64 characters of it.
        let e = refused(with(&|s| {
            s.labels = HashMap::from([("k".into(), "v".repeat(3 << 20))])
        }));
        assert!(
            e.contains(&format!("(\"{}\"… ({} bytes)", "v".repeat(64), 3 << 20)[1..]),
            "{e}"
        );
        // The spec as a whole.
        let e = refused(with(&|s| {
            // Each part inside its own bound, the whole over MAX_SPEC_BYTES.
            s.command = vec!["c".repeat(32_000); 4];
            s.env = (0..4)
                .map(|i| (format!("V{i}"), "e".repeat(32_000)))
                .collect();
            s.image = "i".repeat(1000);
            s.labels = (0..limits::MAX_LABELS)
                .map(|i| (format!("{i:a>63}"), "v".repeat(63)))
                .collect();
        }));
        assert!(e.contains("the sandbox spec is"), "{e}");
        refused(with(&|s| {
            s.image = "i".repeat(limits::MAX_IMAGE_REF_BYTES + 1)
        }));
        // Memory: a minimum, 0 meaning no limit.
        let mem = |bytes| {
            with(&|s| {
                s.resources = Some(sbx_proto::v1::Resources {
                    memory_bytes: bytes,
                    ..Default::default()
                })
            })
        };
        assert!(mem(0).is_ok() && mem(limits::MIN_MEMORY_BYTES).is_ok());
        let e = refused(mem(1));
        assert!(e.contains("memory limit 1 bytes"), "{e}");
        // Names keep a prefix only.
        let e = refused(name("sandbox", &"a".repeat(5000)));
        assert!(e.contains("5000 bytes long"), "{e}");
        refused(parse_id("sandbox", &"u".repeat(1 << 20)));
        // Exec: the same bounds, and the working directory.
        let env = HashMap::new();
        refused(exec(&vec!["x".to_string(); 5000], &env, ""));
        refused(exec(&["a\0".to_string()], &env, ""));
        refused(exec(
            &["true".to_string()],
            &HashMap::from([("A=B".into(), String::new())]),
            "",
        ));
        refused(exec(&["true".to_string()], &env, "relative"));
        assert!(exec_user("").is_ok() && exec_user("app:staff").is_ok());
        assert!(exec_user(&"u".repeat(limits::MAX_USER_BYTES)).is_ok());
        refused(exec_user(&"u".repeat(limits::MAX_USER_BYTES + 1)));
        refused(exec_user("app\0"));
        refused(exec_user("app\nroot"));
        refused(exec(
            &["true".to_string()],
            &env,
            &format!("/{}", "d".repeat(5000)),
        ));
        assert!(exec(&["true".to_string()], &env, "/sandbox").is_ok());
        // Selectors: bytes, terms, syntax.
        assert!(selector("a=b,!c").is_ok());
        let e = refused(selector(&"a=b,".repeat(1 << 18)));
        assert!(e.contains("1048576 bytes"), "{e}");
        let e = refused(selector(&vec!["a"; 65].join(",")));
        assert!(e.contains("65 terms"), "{e}");
        refused(selector("a=b=c"));
        refused(page_token(&"t".repeat(2000)));
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

/// How a request names a provider: by id, or by name inside one workspace (`None`:
/// "default").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProviderSelector {
    Id(Uuid),
    Name {
        workspace: Option<String>,
        name: String,
    },
}

impl ProviderSelector {
    pub fn from_ref(r: &sbx_proto::v1::ProviderRef) -> Result<Self> {
        if !r.id.is_empty() {
            return Ok(ProviderSelector::Id(parse_id("provider", &r.id)?));
        }
        if r.name.is_empty() {
            return Err(invalid(
                "name the provider by id, or by name (and workspace)".into(),
            ));
        }
        name("provider", &r.name)?;
        let workspace = if r.workspace.is_empty() {
            None
        } else {
            name("workspace", &r.workspace)?;
            Some(r.workspace.clone())
        };
        Ok(ProviderSelector::Name {
            workspace,
            name: r.name.clone(),
        })
    }
}

/// The values `approval-mode` takes.
pub const APPROVAL_MODES: [&str; 3] = ["suggest", "auto-edit", "full-auto"];

/// Checks a provider's type (a DNS label), credentials (names as for an environment, values
/// without NUL, at most [`limits::MAX_CREDENTIAL_BYTES`] together) and config (keys DNS-ish:
/// at most 63 bytes, no NUL; at most [`limits::MAX_PROVIDER_CONFIG_BYTES`] together). An
/// error names a credential, never its value.
pub fn provider(
    kind: &str,
    credentials: &std::collections::BTreeMap<String, String>,
    config: &std::collections::BTreeMap<String, String>,
) -> Result<()> {
    validate_name(kind).map_err(|e| invalid(format!("provider type {}: {e}", quote(kind))))?;
    let total: usize = credentials.iter().map(|(k, v)| k.len() + v.len() + 2).sum();
    if total > limits::MAX_CREDENTIAL_BYTES {
        return Err(invalid(format!(
            "the provider's credentials are {total} bytes; at most {} are allowed",
            limits::MAX_CREDENTIAL_BYTES
        )));
    }
    for (k, v) in credentials {
        let name_ok = !k.is_empty()
            && k.len() <= 255
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !k.starts_with(|c: char| c.is_ascii_digit());
        if !name_ok {
            return Err(invalid(format!(
                "credential name {} is not an environment variable name (letters, digits and _, not starting with a digit)",
                quote(k)
            )));
        }
        if v.contains('\0') {
            return Err(invalid(format!(
                "the value of credential {} holds a NUL byte",
                quote(k)
            )));
        }
        if k.starts_with("SBX_") {
            return Err(invalid(format!(
                "credential name {} is reserved (SBX_ names are the gateway's)",
                quote(k)
            )));
        }
    }
    let config_total: usize = config.iter().map(|(k, v)| k.len() + v.len()).sum();
    if config_total > limits::MAX_PROVIDER_CONFIG_BYTES {
        return Err(invalid(format!(
            "the provider's config is {config_total} bytes; at most {} are allowed",
            limits::MAX_PROVIDER_CONFIG_BYTES
        )));
    }
    for (k, v) in config {
        if k.is_empty() || k.len() > 63 || k.contains('\0') || v.contains('\0') {
            return Err(invalid(format!(
                "config key {} is invalid: 1-63 bytes, no NUL in it or its value",
                quote(k)
            )));
        }
    }
    Ok(())
}

/// Checks a setting: its key a DNS label, its value at most
/// [`limits::MAX_SETTING_VALUE_BYTES`] without NUL, and `approval-mode` one of
/// [`APPROVAL_MODES`].
pub fn setting(key: &str, value: &str) -> Result<()> {
    validate_name(key).map_err(|e| invalid(format!("setting key {}: {e}", quote(key))))?;
    if value.len() > limits::MAX_SETTING_VALUE_BYTES || value.contains('\0') {
        return Err(invalid(format!(
            "the value of setting {key:?} is {} bytes (at most {}) or holds a NUL byte",
            value.len(),
            limits::MAX_SETTING_VALUE_BYTES
        )));
    }
    if key == "approval-mode" && !APPROVAL_MODES.contains(&value) {
        return Err(invalid(format!(
            "approval-mode {} is not one of {}",
            quote(value),
            APPROVAL_MODES.join(", ")
        )));
    }
    Ok(())
}

/// Checks a service endpoint's name (a DNS label without `--`, which separates the parts of
/// its Host) and port (1-65535).
pub fn service(name_: &str, port: u32) -> Result<()> {
    name("service", name_)?;
    if name_.contains("--") {
        return Err(invalid(format!(
            "service name {} holds \"--\", which separates the parts of its Host",
            quote(name_)
        )));
    }
    if port == 0 || port > u32::from(u16::MAX) {
        return Err(invalid(format!("port {port} is not a TCP port (1-65535)")));
    }
    Ok(())
}
