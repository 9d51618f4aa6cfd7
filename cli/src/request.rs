//! From parsed arguments to protobuf requests. Pure functions: no IO, no gRPC.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rand::RngExt;
use sbx_proto::Timestamp;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteWorkspaceRequest, ExecRequest, ImageRef,
    ListSandboxesRequest, ListWorkspacesRequest, LogsRequest, NetworkMode, NetworkPolicy,
    PullImageRequest, Resources, SandboxRef, SandboxSpec, Tty, WatchSandboxesRequest, WorkspaceRef,
};

use super::{
    CliError, ImagePullArgs, ImageTarget, NetworkModeArg, SandboxCreateArgs, SandboxExecArgs,
    SandboxListArgs, SandboxLogsArgs, SandboxTarget, SandboxWatchArgs, WorkspaceCreateArgs,
    WorkspaceDeleteArgs, WorkspaceListArgs, WorkspaceScope, WorkspaceTarget,
};

/// Prefix of generated sandbox names.
const GENERATED_NAME_PREFIX: &str = "sbx-";
/// The characters of the random part of a generated name: all valid anywhere in a DNS-1123
/// label, so the name always passes `validate_name`.
const GENERATED_NAME_ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
/// Length of the random part: 36^8 ≈ 2.8e12 names, so collisions in one workspace are rare.
const GENERATED_NAME_RANDOM_LEN: usize = 8;

/// A fresh sandbox name: `sbx-` + 8 random lowercase letters and digits.
pub fn generate_sandbox_name<R: rand::Rng + ?Sized>(rng: &mut R) -> String {
    let mut name = String::with_capacity(GENERATED_NAME_PREFIX.len() + GENERATED_NAME_RANDOM_LEN);
    name.push_str(GENERATED_NAME_PREFIX);
    for _ in 0..GENERATED_NAME_RANDOM_LEN {
        let index = rng.random_range(0..GENERATED_NAME_ALPHABET.len());
        name.push(char::from(GENERATED_NAME_ALPHABET[index]));
    }
    name
}

/// Collects `KEY=VALUE` pairs into a map, refusing a key given twice (`flag` names the option
/// in the error).
pub fn key_value_map(
    flag: &'static str,
    pairs: &[(String, String)],
) -> Result<HashMap<String, String>, CliError> {
    let mut map = HashMap::with_capacity(pairs.len());
    for (key, value) in pairs {
        if map.insert(key.clone(), value.clone()).is_some() {
            return Err(CliError::DuplicateKey {
                flag,
                key: key.clone(),
            });
        }
    }
    Ok(map)
}

/// The reference sent for a workspace: by id when given (authoritative), else by name.
pub fn workspace_ref(target: &WorkspaceTarget) -> WorkspaceRef {
    match (&target.id, &target.name) {
        (Some(id), _) => WorkspaceRef {
            id: id.to_string(),
            name: String::new(),
        },
        (None, name) => WorkspaceRef {
            id: String::new(),
            name: name.clone().unwrap_or_default(),
        },
    }
}

/// The reference sent for a sandbox: by id alone when given (the workspace is never sent with
/// an id, so nothing can be resolved by name), else by workspace + name.
pub fn sandbox_ref(scope: &WorkspaceScope, target: &SandboxTarget) -> SandboxRef {
    match (&target.id, &target.name) {
        (Some(id), _) => SandboxRef {
            id: id.to_string(),
            workspace: String::new(),
            name: String::new(),
        },
        (None, name) => SandboxRef {
            id: String::new(),
            workspace: scope.workspace.clone().unwrap_or_default(),
            name: name.clone().unwrap_or_default(),
        },
    }
}

/// How a sandbox target reads in messages: `"web" in workspace "default"` or `id 0191…`.
pub fn describe_sandbox_ref(reference: &SandboxRef) -> String {
    if !reference.id.is_empty() {
        format!("sandbox {}", reference.id)
    } else {
        format!(
            "sandbox {:?} in workspace {:?}",
            reference.name,
            sbx_proto::names::workspace_or_default(&reference.workspace)
        )
    }
}

/// How a workspace target reads in messages.
pub fn describe_workspace_ref(reference: &WorkspaceRef) -> String {
    if !reference.id.is_empty() {
        format!("workspace {}", reference.id)
    } else {
        format!("workspace {:?}", reference.name)
    }
}

pub fn create_workspace_request(
    args: &WorkspaceCreateArgs,
) -> Result<CreateWorkspaceRequest, CliError> {
    Ok(CreateWorkspaceRequest {
        name: args.name.clone(),
        labels: key_value_map("--label", &args.labels)?,
    })
}

pub fn list_workspaces_request(
    args: &WorkspaceListArgs,
    page_token: &str,
) -> ListWorkspacesRequest {
    ListWorkspacesRequest {
        label_selector: args.selector.clone().unwrap_or_default(),
        page_size: 0,
        page_token: page_token.to_string(),
    }
}

pub fn delete_workspace_request(args: &WorkspaceDeleteArgs) -> DeleteWorkspaceRequest {
    DeleteWorkspaceRequest {
        workspace: Some(workspace_ref(&args.target)),
        cascade: args.cascade,
    }
}

/// The create request; `generated_name` is used only when `--name` was not given.
pub fn create_sandbox_request(
    args: &SandboxCreateArgs,
    generated_name: String,
) -> Result<CreateSandboxRequest, CliError> {
    let resources =
        (args.cpu.is_some() || args.memory.is_some() || args.disk.is_some()).then(|| Resources {
            cpu_millis: args.cpu.unwrap_or(0),
            memory_bytes: args.memory.unwrap_or(0),
            disk_bytes: args.disk.unwrap_or(0),
        });
    Ok(CreateSandboxRequest {
        providers: args.providers.clone(),
        workspace: args.workspace.clone().unwrap_or_default(),
        name: args
            .name
            .clone()
            .or_else(|| args.name_flag.clone())
            .unwrap_or(generated_name),
        spec: Some(SandboxSpec {
            command: args.command.clone(),
            env: key_value_map("--env", &args.env)?,
            labels: key_value_map("--label", &args.labels)?,
            resources,
            driver: args.driver.clone().unwrap_or_default(),
            image: args.image.clone().unwrap_or_default(),
            image_digest: String::new(),
            network: mode_and_allow(args.network, &args.allow)?,
            node: args.node.clone().unwrap_or_default(),
            node_selector: key_value_map("--node-selector", &args.node_selector)?,
            lifetime: args.lifetime.lifetime()?,
        }),
        stopped: args.stopped || !args.uploads.is_empty(),
    })
}

pub fn list_sandboxes_request(args: &SandboxListArgs, page_token: &str) -> ListSandboxesRequest {
    ListSandboxesRequest {
        workspace: args.workspace.clone().unwrap_or_default(),
        all_workspaces: args.all_workspaces,
        label_selector: args.selector.clone().unwrap_or_default(),
        page_size: 0,
        page_token: page_token.to_string(),
    }
}

/// The exec's start message. `tty` is what `-t` found out about the local terminal (its size
/// and TERM; None without -t): reading it is IO, so the caller does it.
pub fn exec_request(args: &SandboxExecArgs, tty: Option<Tty>) -> Result<ExecRequest, CliError> {
    Ok(ExecRequest {
        sandbox: Some(sandbox_ref(&args.scope, &args.target)),
        command: args.command.clone(),
        env: key_value_map("--env", &args.env)?,
        timeout_seconds: args.timeout,
        workdir: args.workdir.clone().unwrap_or_default(),
        stdin: args.stdin,
        tty,
    })
}

pub fn logs_request(args: &SandboxLogsArgs) -> LogsRequest {
    logs_request_at(args, SystemTime::now())
}

/// [`logs_request`] with `--since DURATION` counted back from `now`.
pub fn logs_request_at(args: &SandboxLogsArgs, now: SystemTime) -> LogsRequest {
    LogsRequest {
        sandbox: Some(sandbox_ref(&args.scope, &args.target)),
        follow: args.follow,
        tail_lines: args.tail.unwrap_or(0),
        timestamps: args.timestamps,
        since: args.since.map(|since| since.at(now)),
    }
}

/// `sbx sandbox logs --since`: a time, or how long ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    Ago(Duration),
    At(Timestamp),
}

impl Since {
    /// The time it names, `now` being now (a duration longer ago than 1970 is 1970).
    pub fn at(self, now: SystemTime) -> Timestamp {
        match self {
            Since::At(time) => time,
            Since::Ago(ago) => Timestamp::from(now.checked_sub(ago).unwrap_or(UNIX_EPOCH)),
        }
    }
}

/// Parses `--since`: a duration ago as `--timeout` takes one ([`super::size::parse_secs`]:
/// `30s`, `10m`, `2h`, `1h30m`, at most 10 days) or an RFC 3339 time.
pub fn parse_since(text: &str) -> Result<Since, String> {
    if let Ok(time) = text.parse::<Timestamp>() {
        return Ok(Since::At(time));
    }
    super::size::parse_secs(text)
        .map(|secs| Since::Ago(Duration::from_secs(secs)))
        .map_err(|_| {
            format!(
                "{text:?} is neither a duration ago (30s, 10m, 2h, 1h30m; at most 10 days) nor \
                 an RFC 3339 time (2026-03-01T10:00:00Z)"
            )
        })
}

pub fn watch_request(args: &SandboxWatchArgs) -> WatchSandboxesRequest {
    WatchSandboxesRequest {
        workspace: args.workspace.clone().unwrap_or_default(),
        all_workspaces: args.all_workspaces,
        label_selector: args.selector.clone().unwrap_or_default(),
        resource_version: args.resource_version,
    }
}

/// Names an image: by id when `--id` was given, else by reference.
pub fn image_ref(target: &ImageTarget) -> ImageRef {
    match target.id {
        Some(id) => ImageRef {
            id: id.to_string(),
            reference: String::new(),
        },
        None => ImageRef {
            id: String::new(),
            reference: target.reference.clone().unwrap_or_default(),
        },
    }
}

/// `image "busybox"` or `image with id …`, for messages.
pub fn describe_image_ref(r: &ImageRef) -> String {
    if r.id.is_empty() {
        format!("image {:?}", r.reference)
    } else {
        format!("image with id {}", r.id)
    }
}

/// The pull request; `password` is what --password-stdin read (None without it).
pub fn pull_image_request(args: &ImagePullArgs, password: Option<String>) -> PullImageRequest {
    PullImageRequest {
        reference: args.reference.clone(),
        insecure: args.insecure,
        username: args.username.clone().unwrap_or_default(),
        password: password.unwrap_or_default(),
    }
}

/// A policy of mode `policy` with `allow`.
pub fn policy(allow: Vec<String>) -> NetworkPolicy {
    NetworkPolicy {
        mode: NetworkMode::Policy as i32,
        allow,
    }
}

/// `--network` and `--allow` as a policy: `--allow` implies policy; none with `--allow` is
/// a usage error; neither given is `None`.
pub fn mode_and_allow(
    mode: Option<NetworkModeArg>,
    allow: &[String],
) -> Result<Option<NetworkPolicy>, CliError> {
    match (mode, allow.is_empty()) {
        (None, true) => Ok(None),
        (Some(NetworkModeArg::None), true) => Ok(Some(NetworkPolicy {
            mode: NetworkMode::None as i32,
            allow: Vec::new(),
        })),
        (Some(NetworkModeArg::None), false) => Err(CliError::Usage(
            "--allow admits connections, and --network none has none: use --network policy".into(),
        )),
        (Some(NetworkModeArg::Policy) | None, _) => Ok(Some(policy(allow.to_vec()))),
    }
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
