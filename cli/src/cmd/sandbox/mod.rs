//! `sbx sandbox …`: sandboxes. This file: the noun's commands, how one sandbox is named on
//! the command line, and get, list and delete; each other verb (or group of verbs) has a file
//! of its own, and `view.rs` is how a sandbox shows.

use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{DeleteSandboxRequest, GetSandboxRequest, ListSandboxesRequest, SandboxRef};
use uuid::Uuid;

use crate::CliError;
use crate::args::parse_name;
use crate::connect::{Target, connect};
use crate::output::{OutputArgs, OutputFormat};
use crate::reply::{collect_pages, found_or_absent, print, print_deleted, print_list};
use lifecycle::{Lifecycle, run_lifecycle};
use view::{render_sandbox, render_sandboxes};

pub mod create;
pub mod exec;
pub mod files;
pub mod forward;
pub mod lifecycle;
pub mod logs;
pub mod network;
pub mod provider;
pub mod stats;
pub mod view;
pub mod watch;

/// `sbx sandbox …`
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox running CMD ARGS… and (unless --detach) wait until it is Ready.
    #[command(long_about = create::CREATE_ABOUT)]
    Create(Box<create::SandboxCreateArgs>),
    /// Show one sandbox.
    Get(SandboxTargetArgs),
    /// List sandboxes of one workspace or of all (every page).
    #[command(visible_alias = "ls")]
    List(SandboxListArgs),
    /// Stop a sandbox's workload (its files are kept) and wait until it is Stopped. Stopping a
    /// stopped sandbox does nothing.
    Stop(lifecycle::SandboxActionArgs),
    /// Start a stopped sandbox (also recovers one in Error) and wait until it is Ready.
    /// Starting a running one does nothing.
    Start(lifecycle::SandboxActionArgs),
    /// Restart a sandbox's workload under a new generation (files are kept) and wait until it
    /// is Ready.
    Restart(lifecycle::SandboxActionArgs),
    /// Pause a Ready sandbox: its processes stop where they are, keeping their memory (oci:
    /// frozen, their memory stays resident; vm: saved to disk, memory and CPU freed); answers
    /// once it is Paused. Needs a driver that can pause (`sbx version` lists it).
    Pause(lifecycle::SandboxActionArgs),
    /// Bring a paused sandbox back: the same processes, memory, open files and sockets;
    /// answers once it is Ready.
    Resume(lifecycle::SandboxActionArgs),
    /// Move a sandbox's ttl deadline to now + DURATION (0: no deadline), as E2B's set_timeout.
    Ttl(lifecycle::SandboxTtlArgs),
    /// Delete a sandbox and its files. A NAME that does not exist fails with SANDBOX_NOT_FOUND
    /// (exit 1); an --id that does not exist succeeds with deleted=false (nothing to delete).
    #[command(visible_alias = "rm")]
    Delete(SandboxTargetArgs),
    /// Run a command inside a sandbox; its output is passed through and its exit code becomes
    /// sbx's exit code (killed by signal N: 128+N).
    Exec(exec::SandboxExecArgs),
    /// Copy files or a directory tree between here and a sandbox, as `docker cp` does: one
    /// side is NAME:/path. Into DST when it is an existing directory, else as DST; times and
    /// symlinks are kept, modes as --preserve says. The sandbox must be Ready.
    ///
    /// A copy out is unpacked here as `tar --no-same-owner --no-same-permissions` would,
    /// since the sandbox may send anything: files belong to you, their modes are the
    /// owner/group/other bits less your umask (no setuid, setgid or sticky bit), device
    /// nodes and FIFOs are skipped (stderr says how many), and a hard link is made only to a
    /// file of the same copy. A copy in keeps every mode bit.
    Cp(files::SandboxCpArgs),
    /// Forward local TCP ports to ports on a sandbox's loopback, as `kubectl port-forward`
    /// does; runs until interrupted (Ctrl-C).
    #[command(name = "port-forward")]
    PortForward(forward::SandboxPortForwardArgs),
    /// Print a sandbox's workload output, its stdout to stdout and its stderr to stderr,
    /// optionally with times, from a time, or following it.
    Logs(logs::SandboxLogsArgs),
    /// Stream sandbox changes, one line (or JSON object) per event, until interrupted.
    Watch(watch::SandboxWatchArgs),
    /// Attach, detach and list the providers of a sandbox.
    #[command(subcommand)]
    Provider(provider::SandboxProviderCommand),
    /// Show a sandbox's network (address, allowlist, refused connections) and change its
    /// allowlist live.
    #[command(subcommand)]
    Network(network::SandboxNetworkCommand),
    /// Show what sandboxes use, as `docker stats` does: CPU (cores, and % of the limit),
    /// memory against its limit, pids, disk used against its size and network bytes, read
    /// from each sandbox's driver now; --watch keeps showing them, --history shows the
    /// samples the gateway kept of one sandbox.
    Stats(stats::SandboxStatsArgs),
    /// List what happened to a sandbox, oldest first (`sbx events` for a whole workspace).
    Events(crate::cmd::events::SandboxEventsArgs),
}

/// Names one sandbox: exactly one of NAME (with `--workspace`) or `--id`.
#[derive(Debug, Clone, Args)]
#[group(id = "sandbox_target", required = true, multiple = false)]
pub struct SandboxTarget {
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub name: Option<String>,
    /// The sandbox's UUID (authoritative: acts on that sandbox or on nothing, never on another
    /// one found by name).
    #[arg(long, value_name = "UUID")]
    pub id: Option<Uuid>,
}

/// The workspace a sandbox NAME is looked up in. Not allowed with `--id`, which is enough on
/// its own and would make a workspace given beside it silently ignored.
#[derive(Debug, Clone, Args)]
pub struct WorkspaceScope {
    /// The workspace of the sandbox named (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name, conflicts_with = "id")]
    pub workspace: Option<String>,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxTargetArgs {
    #[command(flatten)]
    pub scope: WorkspaceScope,
    #[command(flatten)]
    pub target: SandboxTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxListArgs {
    /// The workspace to list (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// List the sandboxes of every workspace.
    #[arg(short = 'A', long, conflicts_with = "workspace")]
    pub all_workspaces: bool,
    /// Only sandboxes whose labels match: "k=v,k2=v2", "k!=v", "k" (present), "!k" (absent).
    #[arg(short = 'l', long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
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

pub fn list_sandboxes_request(args: &SandboxListArgs, page_token: &str) -> ListSandboxesRequest {
    ListSandboxesRequest {
        workspace: args.workspace.clone().unwrap_or_default(),
        all_workspaces: args.all_workspaces,
        label_selector: args.selector.clone().unwrap_or_default(),
        page_size: 0,
        page_token: page_token.to_string(),
    }
}

/// Runs one `sbx sandbox …` command.
pub async fn run_sandbox(target: &Target, cmd: SandboxCommand) -> Result<u8, CliError> {
    match cmd {
        SandboxCommand::Create(args) => create::run_create(target, &args).await,
        SandboxCommand::Get(args) => get(target, &args).await,
        SandboxCommand::List(args) => list(target, &args).await,
        SandboxCommand::Stop(args) => run_lifecycle(target, &args, Lifecycle::Stop).await,
        SandboxCommand::Start(args) => run_lifecycle(target, &args, Lifecycle::Start).await,
        SandboxCommand::Restart(args) => run_lifecycle(target, &args, Lifecycle::Restart).await,
        SandboxCommand::Pause(args) => run_lifecycle(target, &args, Lifecycle::Pause).await,
        SandboxCommand::Resume(args) => run_lifecycle(target, &args, Lifecycle::Resume).await,
        SandboxCommand::Ttl(args) => lifecycle::run_ttl(target, args).await,
        SandboxCommand::Delete(args) => delete(target, &args).await,
        SandboxCommand::Exec(args) => exec::run_exec(target, &args).await,
        SandboxCommand::Cp(args) => files::run_cp(target, args).await,
        SandboxCommand::PortForward(args) => forward::run_port_forward(target, args).await,
        SandboxCommand::Logs(args) => logs::run_logs(target, &args).await,
        SandboxCommand::Watch(args) => watch::run_watch(target, &args).await,
        SandboxCommand::Provider(cmd) => provider::run_sandbox_provider(target, cmd).await,
        SandboxCommand::Network(cmd) => network::run_sandbox_network(target, cmd).await,
        SandboxCommand::Stats(args) => stats::run_sandbox_stats(target, args).await,
        SandboxCommand::Events(args) => crate::cmd::events::run_sandbox_events(target, args).await,
    }
}

/// `sbx sandbox list`.
async fn list(target: &Target, args: &SandboxListArgs) -> Result<u8, CliError> {
    let client = SandboxServiceClient::new(connect(target).await?);
    let sandboxes = collect_pages(|token| {
        let mut client = client.clone();
        let req = list_sandboxes_request(args, &token);
        async move {
            let page = client.list_sandboxes(req).await?.into_inner();
            Ok((page.sandboxes, page.next_page_token))
        }
    })
    .await?;
    let rendered = render_sandboxes(&args.output, &sandboxes, SystemTime::now())?;
    let note = if args.all_workspaces {
        "No sandboxes found in any workspace.".to_string()
    } else {
        format!(
            "No sandboxes found in workspace {:?}.",
            sbx_proto::names::workspace_or_default(args.workspace.as_deref().unwrap_or_default())
        )
    };
    print_list(&rendered, &note)?;
    Ok(0)
}

/// `sbx sandbox delete`.
async fn delete(target: &Target, args: &SandboxTargetArgs) -> Result<u8, CliError> {
    let reference = sandbox_ref(&args.scope, &args.target);
    let what = describe_sandbox_ref(&reference);
    let mut client = SandboxServiceClient::new(connect(target).await?);
    // Looked up first so that -o json|yaml|name can say what was deleted.
    let found = found_or_absent(
        client
            .get_sandbox(GetSandboxRequest {
                sandbox: Some(reference.clone()),
            })
            .await,
    )?;
    let req = DeleteSandboxRequest {
        sandbox: Some(reference),
    };
    let deleted = client.delete_sandbox(req).await?.into_inner().deleted;
    let found = found.map(|s| (s.id, s.name));
    print_deleted(&args.output, deleted, found, &what, "sandbox")?;
    Ok(0)
}

/// `sbx sandbox get`.
async fn get(target: &Target, args: &SandboxTargetArgs) -> Result<u8, CliError> {
    let sandbox = Some(sandbox_ref(&args.scope, &args.target));
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let answer = client
        .get_sandbox(GetSandboxRequest {
            sandbox: sandbox.clone(),
        })
        .await?
        .into_inner();
    let mut text = render_sandbox(&args.output, &answer, SystemTime::now())?;
    // The table also says what the sandbox's network refused lately (JSON and YAML keep the
    // sandbox as the API gives it; `sbx sandbox network get` has the whole view).
    let networked = answer
        .spec
        .as_ref()
        .and_then(|s| s.network.as_ref())
        .is_some_and(|n| n.mode() == sbx_proto::v1::NetworkMode::Policy);
    if networked && matches!(args.output.format, OutputFormat::Table | OutputFormat::Wide) {
        let network = client
            .get_sandbox_network(sbx_proto::v1::GetSandboxNetworkRequest { sandbox })
            .await;
        text.push_str(&network::summary(network.map(|r| r.into_inner())));
    }
    print(&text)?;
    Ok(0)
}
