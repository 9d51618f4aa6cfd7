//! `sbx`, the command-line client of the sbx gateway (the `sbx.v1` gRPC API).
//!
//! Layout: this module holds the clap argument types; [`request`] turns them into protobuf
//! requests (pure); [`connect`] parses endpoints and dials the gateway with the credential;
//! [`config`] keeps the contexts (`sbx config`) and decides where a call goes; [`run`]
//! dispatches; [`output`] renders protobuf
//! objects as tables, JSON or YAML (pure); [`size`] parses `--cpu` and `--memory`; [`wait`] waits for a
//! sandbox to become Ready, Stopped or deleted, and for the gateway to serve; [`stream`] passes
//! exec/logs/watch streams through; [`image`] runs the image commands (pull with progress,
//! import of a file or an OCI layout directory); [`meta`] prints `sbx version` and `sbx
//! completion`.

pub mod config;
pub mod connect;
pub mod error;
pub mod events;
pub mod files;
pub mod forward;
pub mod identity;
pub mod image;
pub mod job;
pub mod lifetime;
pub mod limits;
pub mod meta;
pub mod network;
pub mod node;
pub mod output;
pub mod owned;
pub mod reply;
pub mod request;
pub mod run;
pub mod size;
pub mod stats;
pub mod stream;
pub mod terminal;
pub mod wait;

use clap::{Args, Parser, Subcommand, ValueEnum};
use uuid::Uuid;

pub use error::CliError;

/// Parses the process arguments, runs the command and returns the process exit code: 0 on
/// success, 1 on any error (printed as one `error: …` line), 2 on a usage error, and for
/// `sandbox exec` the remote command's exit code.
pub fn main() -> std::process::ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // Help and version go to stdout with status 0; usage errors to stderr with 2.
            let _ = err.print();
            let args: Vec<String> = std::env::args().skip(1).collect();
            if let Some(hint) = missing_separator_hint(err.kind(), &args) {
                eprintln!("\n{hint}");
            }
            return std::process::ExitCode::from(clamp_exit(err.exit_code()));
        }
    };
    std::process::ExitCode::from(run::run_to_exit_code(cli))
}

/// The commands whose workload command comes after `--`.
const TAKES_A_COMMAND: [&str; 3] = ["exec", "create", "run"];

/// A usage error from a command that takes a command after `--`, given one without it (`sbx
/// sandbox exec web ls`: clap says only `unexpected argument 'ls'`): where it goes.
pub fn missing_separator_hint(kind: clap::error::ErrorKind, args: &[String]) -> Option<String> {
    use clap::error::ErrorKind;
    if !matches!(
        kind,
        ErrorKind::UnknownArgument | ErrorKind::ArgumentConflict | ErrorKind::TooManyValues
    ) || args.iter().any(|a| a == "--")
    {
        return None;
    }
    let verb = args
        .iter()
        .find(|a| TAKES_A_COMMAND.contains(&a.as_str()))?;
    let example = match verb.as_str() {
        "exec" => "sbx sandbox exec NAME -- ls -l /sandbox",
        "create" => "sbx sandbox create NAME -- sleep infinity",
        _ => "sbx run --rm IMAGE -- sh -c 'echo hi'",
    };
    Some(format!(
        "hint: the command to run goes after `--`, as in `{example}`"
    ))
}

fn clamp_exit(code: i32) -> u8 {
    u8::try_from(code).unwrap_or(1)
}

/// The help heading of the connection flags every command takes: listed after each
/// command's own options, not before them.
const CONNECTION: &str = "Connection options (every command)";

/// The `sbx` command line.
#[derive(Debug, Parser)]
#[command(
    name = "sbx",
    version,
    about = "Command-line client of the sbx sandbox gateway",
    long_about = "Command-line client of the sbx sandbox gateway (sbxd).\n\n\
        Sandboxes are isolated, stateful workloads grouped into workspaces. Every object has a \
        UUID assigned by the gateway; names are labels for humans. Where a command takes \
        `--id`, the id is authoritative: the gateway acts on that object or on nothing.",
    after_long_help = SETTINGS_HELP
)]
pub struct Cli {
    /// The gateway: unix:///PATH (sbxd's socket), http://HOST:PORT, https://HOST:PORT, or
    /// HOST:PORT (http; https when TLS settings are given). Default: the packaged service's
    /// socket, unix:///run/sbx/sbxd.sock, when it exists; else sbxd's socket,
    /// unix://<data dir>/sbxd.sock, where the data dir is /var/lib/sbx for root, else
    /// $XDG_STATE_HOME/sbx, else ~/.local/state/sbx. Overrides SBX_ENDPOINT, which overrides
    /// the context's endpoint.
    //
    // SBX_ENDPOINT and SBX_TOKEN are read by [`Cli::given`], not by clap: an arg clap fills
    // from the environment counts as given, and clap then writes `--endpoint <URL>` into every
    // usage line of a usage error, as if it were required (and would show a token's value as
    // the env default in --help).
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "URL")]
    pub endpoint: Option<String>,

    /// The bearer token sent on every call (`authorization: Bearer …`). Overrides SBX_TOKEN,
    /// which overrides the context's token. Not needed on sbxd's own Unix socket as the user
    /// who runs sbxd. Every user of the machine sees a command line (`ps`): prefer SBX_TOKEN,
    /// --token-file or a context; sbx says so when this flag is used.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "TOKEN",
          value_parser = connect::Token::parse, conflicts_with = "token_file")]
    pub token: Option<connect::Token>,

    /// Read the bearer token from this file (its first line; keep it mode 0600): as --token,
    /// without the token on the command line.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "FILE")]
    pub token_file: Option<std::path::PathBuf>,

    /// The context to use from the config file (`sbx config`), instead of its
    /// current-context.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "NAME")]
    pub context: Option<String>,

    /// TLS: the CA certificate (PEM) that signed the gateway's certificate (`sbxd certs
    /// init` makes one); without it, the system's trusted roots. Overrides the context's.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "PATH")]
    pub tls_ca: Option<std::path::PathBuf>,

    /// TLS: a client certificate (PEM) to present, with --tls-key. Overrides the context's.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "PATH")]
    pub tls_cert: Option<std::path::PathBuf>,

    /// TLS: the client certificate's private key (PEM). Overrides the context's.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "PATH")]
    pub tls_key: Option<std::path::PathBuf>,

    /// TLS: the name the gateway's certificate must carry (default: the endpoint's host).
    /// Overrides the context's.
    #[arg(long, global = true, help_heading = CONNECTION, value_name = "NAME")]
    pub tls_server_name: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

/// The end of `sbx --help`: where settings come from.
const SETTINGS_HELP: &str = "\
Settings: each of endpoint, token and TLS comes from its flag, else the environment
(SBX_ENDPOINT, SBX_TOKEN), else the context (--context NAME, else the config file's
current-context; see `sbx config --help`), else the default (sbxd's Unix socket, no token).
The config file is $SBX_CONFIG, else $XDG_CONFIG_HOME/sbx/config.toml, else
~/.config/sbx/config.toml.

An UNAUTHENTICATED answer means the gateway wants a credential: pass --token or set
SBX_TOKEN, or save one in a context (`sbx config set-context NAME --endpoint URL --token …
--use`).";

/// The top-level command groups.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create, inspect, list and delete workspaces (groups of sandboxes).
    #[command(subcommand, visible_alias = "ws")]
    Workspace(WorkspaceCommand),
    /// Create, inspect, control, exec into, tail and watch sandboxes.
    #[command(subcommand, visible_alias = "sb")]
    Sandbox(SandboxCommand),
    /// Create, inspect, list, update and delete providers (credential sets of a workspace that
    /// sandboxes attach to; values never shown).
    #[command(subcommand)]
    Provider(owned::ProviderCommand),
    /// Set, get, list and delete a sandbox's settings (seen by its workload as
    /// $SBX_SETTING_<KEY>).
    #[command(subcommand)]
    Setting(owned::SettingCommand),
    /// Expose, inspect, list and delete service endpoints (a sandbox port routed by Host).
    #[command(subcommand, visible_alias = "svc")]
    Service(owned::ServiceCommand),
    /// Pull, import, inspect, list and delete images (what sandboxes on image drivers run).
    #[command(subcommand, visible_alias = "img")]
    Image(ImageCommand),
    /// Make, list and revoke identities and their tokens (a gateway-wide admin's; on the
    /// gateway's host `sbxd token` does the same without a connection).
    #[command(subcommand, visible_alias = "id")]
    Identity(identity::IdentityCommand),
    /// Add, list, inspect, cordon, drain and remove nodes: the machines sandboxes run on
    /// (`sbxd node` hosts; `local` is the gateway's own drivers). A gateway-wide admin's.
    #[command(subcommand)]
    Node(node::NodeCommand),
    /// List what happened to a workspace's sandboxes (or every workspace's, -A), oldest first:
    /// created, started, stopped, exited, OOM-killed, failed driver steps, recovered from
    /// Error, re-attached or restarted by the reconciler; --watch keeps printing new ones.
    Events(events::EventsArgs),
    /// Run a command in a new sandbox as a job, as `docker run` does: create it, stream its
    /// output, wait for its end and exit with its exit code (--rm: delete it after).
    Run(Box<job::RunArgs>),
    /// Wait until the gateway serves (`--for serving`) or a sandbox is Ready, Stopped,
    /// Completed or deleted (`--for ready|stopped|completed|deleted NAME`).
    Wait(WaitArgs),
    /// Print the client's version, and the gateway's at --endpoint: its version, its default
    /// driver and what each of its drivers can do (stdin, tty, cp, port-forward, images).
    /// Exits 0 also when the gateway is down (and says so).
    Version(VersionArgs),
    /// Keep gateways and their credentials as named contexts in the config file, and pick
    /// the current one (as kubeconfig does).
    #[command(subcommand, long_about = CONFIG_ABOUT)]
    Config(ConfigCommand),
    /// Print a shell completion script: `source <(sbx completion bash)`, `sbx completion zsh >
    /// "${fpath[1]}/_sbx"`, `sbx completion fish > ~/.config/fish/completions/sbx.fish`.
    Completion(CompletionArgs),
}

/// The long help of `sbx config`.
const CONFIG_ABOUT: &str = "Keep gateways and their credentials as named contexts.\n\n\
    The config file is $SBX_CONFIG, else $XDG_CONFIG_HOME/sbx/config.toml, else \
    ~/.config/sbx/config.toml. It holds tokens, so sbx writes it mode 0600, atomically (a \
    temp file renamed over it). A context has an endpoint, a token and TLS settings (tls-ca, \
    tls-cert, tls-key, tls-server-name), each optional; a call uses the context named by \
    --context, else the current-context, for what its flags and SBX_ENDPOINT/SBX_TOKEN leave \
    unsaid.\n\n\
    Example:\n  sbx config set-context lab --endpoint https://lab:7070 --token-file tok \
    --tls-ca ca.pem --use\n  sbx config get-contexts\n  sbx --context local sandbox ls";

/// `sbx config …`
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Create or update a context with the settings given (--endpoint, --token or
    /// --token-file, --tls-ca, --tls-cert, --tls-key, --tls-server-name); settings not given
    /// are kept, an empty value ("") removes one. SBX_ENDPOINT and SBX_TOKEN are not saved.
    #[command(name = "set-context")]
    SetContext(SetContextArgs),
    /// Make NAME the current context.
    #[command(name = "use-context")]
    UseContext {
        /// The context.
        name: String,
    },
    /// List the contexts: which is current, their endpoints, whether a token is saved (never
    /// the token) and which TLS settings are.
    #[command(name = "get-contexts")]
    GetContexts {
        /// Leave out the header line.
        #[arg(long)]
        no_headers: bool,
    },
    /// Print the name of the current context.
    #[command(name = "current-context")]
    CurrentContext,
    /// Delete a context (and unset current-context when it was the current one).
    #[command(name = "delete-context")]
    DeleteContext {
        /// The context.
        name: String,
    },
}

/// `sbx config set-context`.
#[derive(Debug, Clone, Args)]
pub struct SetContextArgs {
    /// The context's name (letters, digits, '-', '_', '.', '@'). Its token comes from the
    /// global --token-file FILE (or --token).
    pub name: String,
    /// Also make it the current context.
    #[arg(long = "use")]
    pub use_it: bool,
}

/// `sbx version`.
#[derive(Debug, Clone, Args)]
pub struct VersionArgs {
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `sbx completion`.
#[derive(Debug, Clone, Args)]
pub struct CompletionArgs {
    /// The shell to write the script for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

/// What `sbx wait` waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WaitCondition {
    /// The gateway's health service answers SERVING (every sandbox re-attached).
    Serving,
    /// The sandbox is Ready (or Completed), and stays Ready for --settle.
    Ready,
    /// The sandbox runs no workload: Stopped, Completed or Error (one that runs is waited
    /// for until it ends).
    Stopped,
    /// The sandbox's main process exited 0 (Completed); an exit non-zero fails the wait.
    Completed,
    /// The sandbox is gone.
    Deleted,
}

/// `sbx wait`.
#[derive(Debug, Clone, Args)]
#[command(
    long_about = "Wait until the gateway serves, or until a sandbox reaches a state.\n\n\
        `sbx wait --for serving` tries the health service of the gateway (--endpoint, \
        SBX_ENDPOINT, the context, or sbxd's default socket) until it answers SERVING; with \
        --addr-file it reads the address from that file (as `sbxd serve --addr-file` writes \
        it: unix:///PATH or HOST:PORT) on every try, and prints it: \
        `SBX_ENDPOINT=$(sbx wait --for serving --addr-file F)`.\n\n\
        `sbx wait --for ready|stopped|completed|deleted NAME` follows the sandbox on the \
        gateway's watch stream and returns the moment it gets there (printing it, except for \
        deleted); it fails when the sandbox cannot get there by itself (Error while waiting \
        for ready or completed, deleted while waiting for ready, stopped or completed, \
        stopped while waiting for completed). Stopped and completed wait for a sandbox that \
        runs until its workload ends: `sbx wait --for completed job` exits 0 once the job's \
        main process exited 0."
)]
pub struct WaitArgs {
    /// The condition.
    #[arg(long = "for", value_enum, value_name = "CONDITION")]
    pub condition: WaitCondition,
    /// With --for serving: where sbxd writes its address (`sbxd serve --addr-file`).
    #[arg(long, value_name = "PATH")]
    pub addr_file: Option<std::path::PathBuf>,
    /// The workspace of the sandbox named (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name, conflicts_with = "id")]
    pub workspace: Option<String>,
    /// The sandbox's name (not with --for serving).
    #[arg(value_parser = parse_name, conflicts_with = "id")]
    pub name: Option<String>,
    /// The sandbox's UUID (authoritative).
    #[arg(long, value_name = "UUID")]
    pub id: Option<Uuid>,
    /// How long to wait before giving up: seconds, or 30s, 2m, 1h.
    #[arg(long, value_name = "DURATION", default_value_t = 60, value_parser = size::parse_secs)]
    pub timeout: u64,
    /// With --for ready: how long the sandbox must stay Ready, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub settle: u64,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// How a command prints the objects it gets back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Aligned columns for humans.
    Table,
    /// The table with more columns: driver, image and labels of a sandbox, labels of a
    /// workspace.
    Wide,
    /// `KIND/NAME` per line (`sandbox/web`), as kubectl prints it, for scripts.
    Name,
    /// JSON: one object for one resource, an array for a list, one object per line for watch.
    Json,
    /// YAML, with the same structure as JSON.
    Yaml,
}

/// The `-o/--output` flag, shared by every command that prints an object.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Leave out the table's header line (-o table and -o wide).
    #[arg(long)]
    pub no_headers: bool,
}

/// A clap value parser: a DNS-1123 label, checked with the same rule (and rule text) the
/// gateway uses.
pub fn parse_name(input: &str) -> Result<String, CliError> {
    sbx_proto::names::validate_name(input).map_err(|source| CliError::InvalidName { source })?;
    Ok(input.to_string())
}

/// A clap value parser for `KEY=VALUE`: split at the first `=`; the key must not be empty, the
/// value may be (and may itself contain `=`).
pub fn parse_key_value(input: &str) -> Result<(String, String), CliError> {
    match input.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(CliError::InvalidKeyValue {
            input: input.to_string(),
        }),
    }
}

// ---------------------------------------------------------------------------------------------
// Workspaces

/// `sbx workspace …`
#[derive(Debug, Subcommand)]
pub enum WorkspaceCommand {
    /// Create a workspace.
    Create(WorkspaceCreateArgs),
    /// Show one workspace, by name or by --id.
    Get(WorkspaceGetArgs),
    /// List workspaces (every page).
    #[command(visible_alias = "ls")]
    List(WorkspaceListArgs),
    /// Delete a workspace, by name or by --id. Refused while it has sandboxes, unless --cascade.
    /// A NAME that does not exist fails with WORKSPACE_NOT_FOUND (exit 1); an --id that does
    /// not exist succeeds with deleted=false.
    #[command(visible_alias = "rm")]
    Delete(WorkspaceDeleteArgs),
    /// Show or set the network policy new sandboxes of a workspace get when they ask for none
    /// (copied in at create; existing sandboxes keep theirs).
    #[command(subcommand)]
    Network(network::WorkspaceNetworkCommand),
    /// Show or set the cpu and memory limits new sandboxes of a workspace get when they set
    /// none (copied in at create; existing sandboxes keep theirs).
    #[command(subcommand)]
    Limits(limits::WorkspaceLimitsCommand),
    /// Show or set the lifetime (ttl, idle timeout, delete-after) new sandboxes of a workspace
    /// get when they give none (copied in at create; existing sandboxes keep theirs).
    #[command(subcommand)]
    Lifetime(lifetime::WorkspaceLifetimeCommand),
}

/// Names one workspace: exactly one of NAME or `--id`.
#[derive(Debug, Clone, Args)]
#[group(id = "workspace_target", required = true, multiple = false)]
pub struct WorkspaceTarget {
    /// The workspace's name.
    #[arg(value_parser = parse_name)]
    pub name: Option<String>,
    /// The workspace's UUID (authoritative: never falls back to a name).
    #[arg(long, value_name = "UUID")]
    pub id: Option<Uuid>,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceCreateArgs {
    /// The new workspace's name (a DNS-1123 label, unique across the gateway).
    #[arg(value_parser = parse_name)]
    pub name: String,
    /// A label to set, KEY=VALUE; repeatable.
    #[arg(short = 'l', long = "label", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub labels: Vec<(String, String)>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceGetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceListArgs {
    /// Only workspaces whose labels match: "k=v,k2=v2", "k!=v", "k" (present), "!k" (absent).
    #[arg(short = 'l', long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceDeleteArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    /// Delete the workspace's sandboxes and providers too (otherwise deletion is refused
    /// while any remain, naming each).
    #[arg(long)]
    pub cascade: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

// ---------------------------------------------------------------------------------------------
// Sandboxes

/// `sbx sandbox …`
#[derive(Debug, Subcommand)]
pub enum SandboxCommand {
    /// Create a sandbox running CMD ARGS… and (unless --detach) wait until it is Ready.
    #[command(long_about = CREATE_ABOUT)]
    Create(Box<SandboxCreateArgs>),
    /// Show one sandbox.
    Get(SandboxTargetArgs),
    /// List sandboxes of one workspace or of all (every page).
    #[command(visible_alias = "ls")]
    List(SandboxListArgs),
    /// Stop a sandbox's workload (its files are kept) and wait until it is Stopped. Stopping a
    /// stopped sandbox does nothing.
    Stop(SandboxActionArgs),
    /// Start a stopped sandbox (also recovers one in Error) and wait until it is Ready.
    /// Starting a running one does nothing.
    Start(SandboxActionArgs),
    /// Restart a sandbox's workload under a new generation (files are kept) and wait until it
    /// is Ready.
    Restart(SandboxActionArgs),
    /// Save a Ready sandbox's processes and memory to disk and free its memory and CPU; answers
    /// once it is Paused. Needs a driver that can pause (`sbx version` lists it).
    Pause(SandboxActionArgs),
    /// Bring a paused sandbox back: the same processes, memory, open files and sockets;
    /// answers once it is Ready.
    Resume(SandboxActionArgs),
    /// Move a sandbox's ttl deadline to now + DURATION (0: no deadline), as E2B's set_timeout.
    Ttl(lifetime::SandboxTtlArgs),
    /// Delete a sandbox and its files. A NAME that does not exist fails with SANDBOX_NOT_FOUND
    /// (exit 1); an --id that does not exist succeeds with deleted=false (nothing to delete).
    #[command(visible_alias = "rm")]
    Delete(SandboxTargetArgs),
    /// Run a command inside a sandbox; its output is passed through and its exit code becomes
    /// sbx's exit code (killed by signal N: 128+N).
    Exec(SandboxExecArgs),
    /// Copy files or a directory tree between here and a sandbox, as `docker cp` does: one
    /// side is NAME:/path. Into DST when it is an existing directory, else as DST; times and
    /// symlinks are kept, modes as --preserve says. The sandbox must be Ready.
    ///
    /// A copy out is unpacked here as `tar --no-same-owner --no-same-permissions` would,
    /// since the sandbox may send anything: files belong to you, their modes are the
    /// owner/group/other bits less your umask (no setuid, setgid or sticky bit), device
    /// nodes and FIFOs are skipped (stderr says how many), and a hard link is made only to a
    /// file of the same copy. A copy in keeps every mode bit.
    Cp(SandboxCpArgs),
    /// Forward local TCP ports to ports on a sandbox's loopback, as `kubectl port-forward`
    /// does; runs until interrupted (Ctrl-C).
    #[command(name = "port-forward")]
    PortForward(SandboxPortForwardArgs),
    /// Print a sandbox's workload output, its stdout to stdout and its stderr to stderr,
    /// optionally with times, from a time, or following it.
    Logs(SandboxLogsArgs),
    /// Stream sandbox changes, one line (or JSON object) per event, until interrupted.
    Watch(SandboxWatchArgs),
    /// Attach, detach and list the providers of a sandbox.
    #[command(subcommand)]
    Provider(owned::SandboxProviderCommand),
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
    Events(events::SandboxEventsArgs),
}

/// `sbx sandbox create --network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NetworkModeArg {
    /// Loopback only: the sandbox reaches nothing else.
    None,
    /// An address on the gateway's network, every connection denied but those --allow
    /// admits (needs sbxd serve --network-cidr).
    Policy,
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

/// A stop, start or restart, which waits (unless --detach) for the state it asks for.
#[derive(Debug, Clone, Args)]
pub struct SandboxActionArgs {
    #[command(flatten)]
    pub target: SandboxTargetArgs,
    /// Print the gateway's answer at once, without waiting.
    #[arg(short = 'd', long)]
    pub detach: bool,
    /// How long to wait before giving up (the sandbox is left as it is): seconds, or 30s,
    /// 2m, 1h.
    #[arg(long, value_name = "DURATION", default_value_t = 120, value_parser = size::parse_secs)]
    pub timeout: u64,
}

/// The long help of `sbx sandbox create`: what the wait promises.
const CREATE_ABOUT: &str = "Create a sandbox running CMD ARGS… and (unless --detach) wait \
    until it is Ready.\n\n\
    `sbx sandbox create NAME -- CMD ARGS…` (`-n NAME` works too). The wait follows the \
    gateway's watch stream. What Ready promises, when create exits 0 and prints phase Ready: \
    the driver started the main process, the sandbox then stayed Ready for --settle \
    (default 0: create answers the moment the gateway records Ready), and the gateway's \
    record, read just before printing, still said Ready. A main process that ends within the \
    wait (or the settle window) is reported as what it is: exit 0 makes the \
    sandbox Completed (printed, exit 0); a non-zero exit or a signal makes it Error, and \
    create fails (exit 1) with the reason and status, e.g. `sandbox \"web\" failed: \
    main process exited with status 3`. Ready does not promise the process \
    keeps running afterwards (drivers notice an exit within about 250 ms; see `sbx sandbox \
    get`, `sbx wait`); --settle 500 also catches a main process that fails at once.";

#[derive(Debug, Clone, Args)]
pub struct SandboxCreateArgs {
    /// The workspace to create the sandbox in (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The sandbox's name, unique in its workspace (default: "sbx-" + 8 random characters).
    #[arg(value_name = "NAME", value_parser = parse_name, conflicts_with = "name_flag")]
    pub name: Option<String>,
    /// The sandbox's name, as an option (the same as NAME).
    #[arg(short = 'n', long = "name", id = "name_flag", value_name = "NAME", value_parser = parse_name)]
    pub name_flag: Option<String>,
    /// A label to set, KEY=VALUE; repeatable.
    #[arg(short = 'l', long = "label", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub labels: Vec<(String, String)>,
    /// An environment variable of the workload, KEY=VALUE; repeatable.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// CPU limit: cores (2, 0.5) or millicores (500m). Default: no limit.
    #[arg(long, value_name = "CPU", value_parser = size::parse_cpu)]
    pub cpu: Option<u32>,
    /// Memory limit: bytes, or with a unit: 512Mi, 1.5Gi (powers of 1024), 500M, 1G (powers
    /// of 1000). Default: no limit.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub memory: Option<u64>,
    /// Disk limit (the root filesystem's writable layer and /sandbox together), as --memory
    /// takes sizes: 2Gi, 500M. Default: the workspace's default, else the gateway's
    /// (sbxd --default-disk, 10Gi), on drivers that limit disk.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub disk: Option<u64>,
    /// The image to run, for drivers with images: a name (busybox, name:tag), name@sha256:…
    /// or sha256:… (default: the gateway's default image). The gateway pins its digest.
    #[arg(long, value_name = "REF")]
    pub image: Option<String>,
    /// When the image is pulled from its registry first: when the store lacks it
    /// (missing), before every create (always), or never.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = PullPolicy::Missing)]
    pub pull: PullPolicy,
    /// The compute driver to run the sandbox on (default: the gateway's default driver).
    #[arg(long, value_name = "DRIVER")]
    pub driver: Option<String>,
    /// The node to run on, by name (`sbx node list`; "local": the gateway's own drivers).
    /// Default: the gateway places it on the least committed node with room.
    #[arg(long, value_name = "NODE", value_parser = parse_name)]
    pub node: Option<String>,
    /// Only nodes with this label (KEY=VALUE, as `sbx node add --label` set it); repeat.
    #[arg(long = "node-selector", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub node_selector: Vec<(String, String)>,
    /// Create the sandbox without starting its workload: it is Stopped until `sbx sandbox
    /// start` (its files are there, for `sbx sandbox cp`, on drivers that copy while stopped).
    #[arg(long)]
    pub stopped: bool,
    /// Copy a local file or directory into the sandbox before its workload first starts:
    /// LOCAL or LOCAL:DEST, named as `sbx sandbox cp LOCAL NAME:DEST` names it (DEST defaults
    /// to /sandbox: a directory `app` lands at /sandbox/app). Repeatable; needs a driver that
    /// copies while stopped (`sbx version` lists it as cp-when-stopped).
    #[arg(long = "upload", value_name = "LOCAL[:DEST]", value_parser = files::parse_upload)]
    pub uploads: Vec<files::Upload>,
    /// A provider of the workspace to attach before the first start, by name or UUID: its
    /// credentials reach the workload's environment and every exec's. Repeatable.
    #[arg(long = "provider", value_name = "PROVIDER")]
    pub providers: Vec<String>,
    /// The sandbox's network: none (loopback only; the default) or policy (an address on
    /// the gateway's network; every connection denied but those --allow admits). --allow
    /// alone means policy.
    #[arg(long, value_enum, value_name = "MODE")]
    pub network: Option<NetworkModeArg>,
    /// With --network policy: admit connections to CIDR[:PORT[-PORT]][/tcp|/udp] (e.g.
    /// 10.1.2.3:443, 10.0.0.0/8:8000-8100/tcp, 192.168.5.7 for every port) or to what a
    /// HOSTNAME[:PORT…] resolves to through the gateway's resolver (api.example.test:443,
    /// *.example.test:443 for every name below it). Repeatable; changed later with `sbx
    /// sandbox network allow|deny|set`.
    #[arg(long = "allow", value_name = "ENTRY")]
    pub allow: Vec<String>,
    #[command(flatten)]
    pub lifetime: lifetime::LifetimeFlags,
    /// Print the sandbox as soon as it is created, without waiting for Ready.
    #[arg(short = 'd', long)]
    pub detach: bool,
    /// How long to wait for Ready before giving up (the sandbox is left as it is): seconds,
    /// or 30s, 2m, 1h.
    #[arg(long, value_name = "DURATION", default_value_t = 120, value_parser = size::parse_secs)]
    pub timeout: u64,
    /// How long the sandbox must stay Ready before create reports it, in milliseconds (a
    /// main process that ends within it is reported as Completed or as the failure).
    #[arg(long, value_name = "MS", default_value_t = wait::DEFAULT_SETTLE.as_millis() as u64)]
    pub settle: u64,
    /// The workload's command and its arguments, after `--` (may be left out on a driver with
    /// images when the image has an Entrypoint or Cmd: the image's default then runs).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
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

/// `sbx sandbox exec`: as `docker exec` / `kubectl exec`, stdin only with -i, a terminal only
/// with -t.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  sbx sandbox exec web -- ls -l /sandbox        run a command, print its output
  sbx sandbox exec -it web -- sh                an interactive shell on a terminal
  tar c dir | sbx sandbox exec -i web -- tar x  pipe input to the command

Without -i the command's stdin is empty (/dev/null) and sbx reads none of its own. Without -t,
Ctrl-C (SIGINT) and SIGTERM are sent to the command's process group and sbx waits for it to
end; a second Ctrl-C sends SIGKILL. With -it, Ctrl-C is typed into the remote terminal.

Exit status: the command's; 128+N when a signal N killed it; 124 when --timeout ended it;
127 when the command is not found; 1 when sbx itself failed; 2 for a usage error.")]
pub struct SandboxExecArgs {
    #[command(flatten)]
    pub scope: WorkspaceScope,
    #[command(flatten)]
    pub target: SandboxTarget,
    /// Pass sbx's stdin to the command (read as it comes, until its end). Without it the
    /// command's stdin is empty.
    #[arg(short = 'i', long = "stdin")]
    pub stdin: bool,
    /// Run the command on a terminal (a pty inside, with this terminal's size and TERM; output
    /// comes as one stream). With -i, this terminal goes raw so keys reach the command as typed.
    /// sbx's stdin must be a terminal.
    #[arg(short = 't', long = "tty")]
    pub tty: bool,
    /// The command's working directory inside the sandbox (default: the sandbox's own).
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<String>,
    /// Kill the command after this long (seconds, or 30s, 2m, 1h; 0: no timeout); sbx then
    /// exits with 124.
    #[arg(long, value_name = "DURATION", default_value_t = 0, value_parser = size::parse_secs_u32)]
    pub timeout: u32,
    /// An environment variable for the command, KEY=VALUE; repeatable.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// The command and its arguments, after `--`.
    #[arg(last = true, required = true, value_name = "CMD")]
    pub command: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxCpArgs {
    /// The workspace of the sandbox named in NAME:/path (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// What to copy: a local path, or NAME:/path (absolute) in a sandbox.
    #[arg(value_name = "SRC", value_parser = files::parse_location)]
    pub src: files::Location,
    /// Where to: a local path, or NAME:/path in a sandbox (the other side of SRC).
    #[arg(value_name = "DST", value_parser = files::parse_location)]
    pub dst: files::Location,
    /// On a copy out, keep the modes the sandbox sent (sticky bits too, your umask not
    /// applied), as `tar --same-permissions` does; but setuid and setgid are dropped whenever
    /// you are root (euid or egid 0), so a copy out never makes a setuid-root program.
    /// Owners are never taken from the sandbox. A copy in keeps every mode bit anyway.
    #[arg(long)]
    pub preserve: bool,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxPortForwardArgs {
    /// The workspace of the sandbox (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The sandbox's name.
    #[arg(value_parser = parse_name)]
    pub name: String,
    /// [LOCAL_ADDR:]LOCAL_PORT:REMOTE_PORT, repeatable. LOCAL_ADDR defaults to 127.0.0.1
    /// (loopback only); LOCAL_PORT 0 picks a free port (printed); a lone PORT is both.
    #[arg(required = true, value_name = "PORTS", value_parser = forward::parse_port_spec)]
    pub ports: Vec<forward::PortSpec>,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxLogsArgs {
    #[command(flatten)]
    pub scope: WorkspaceScope,
    #[command(flatten)]
    pub target: SandboxTarget,
    /// Keep streaming new output until interrupted.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Only the last N lines of the existing output, stdout's and stderr's together (default:
    /// all).
    #[arg(long, value_name = "N")]
    pub tail: Option<u32>,
    /// Begin each line with the time it was logged (RFC 3339, UTC) and a space. A line the
    /// log has no time for gets none: a sandbox init's own words, a vm's console, the output
    /// of a sandbox started before the log had times.
    #[arg(short = 't', long)]
    pub timestamps: bool,
    /// Only output logged since WHEN: a duration ago (30s, 10m, 2h, 1h30m; at most 10 days)
    /// or an RFC 3339 time (2026-03-01T10:00:00Z, 2026-03-01T11:00:00+01:00). Lines the log
    /// has no time for are then left out.
    #[arg(long, value_name = "WHEN", value_parser = request::parse_since)]
    pub since: Option<request::Since>,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxWatchArgs {
    /// The workspace to watch (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// Watch the sandboxes of every workspace (NAME is then shown as WORKSPACE/NAME).
    #[arg(short = 'A', long, conflicts_with = "workspace")]
    pub all_workspaces: bool,
    /// Only sandboxes whose labels match: "k=v,k2=v2", "k!=v", "k" (present), "!k" (absent).
    #[arg(short = 'l', long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// Resume after this resource version (0: first an ADDED event for every current sandbox).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub resource_version: u64,
    #[command(flatten)]
    pub output: OutputArgs,
}

// ---------------------------------------------------------------------------------------------
// Images

/// `sbx image …`
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Pull an image from its registry, showing the bytes of each layer on stderr.
    Pull(ImagePullArgs),
    /// Import an image from a file (OCI layout tar, docker save tar, rootfs tar) or an OCI
    /// layout directory.
    Import(ImageImportArgs),
    /// List images (every page).
    #[command(visible_alias = "ls")]
    List(ImageListArgs),
    /// Show one image, by reference (name:tag, name@sha256:…, sha256:…) or by --id.
    Get(ImageTargetArgs),
    /// Delete an image. Refused while a sandbox pins its digest.
    #[command(visible_alias = "rm")]
    Delete(ImageTargetArgs),
    /// Build an image from a Dockerfile, each RUN in a sandbox (no network unless --allow),
    /// each step cached.
    Build(ImageBuildArgs),
}

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  sbx image build -t app:v1 .                       ./Dockerfile, the current directory as context
  sbx image build -t app:v1 -f ci/Dockerfile src    another Dockerfile, src/ as context
  sbx image build -t tools --allow deb.debian.org:80 .   RUN may reach that host (port 80)

Supported: FROM (an image of the store, pulled when missing, or scratch), RUN, COPY and ADD from
the context (numeric --chown, --chmod), ENV, ARG, WORKDIR, USER, ENTRYPOINT, CMD, LABEL, EXPOSE,
SHELL. Refused with the line named: multi-stage builds, ADD of a URL or an archive, RUN flags,
HEALTHCHECK, ONBUILD, STOPSIGNAL, VOLUME.

Each RUN runs in a sandbox of the workspace, from the build's state so far, and is deleted
after. Each step's result is kept as the image sbx.local/build-cache:KEY; a step whose inputs
did not change is not run again (--no-cache runs every step). Step lines and RUN output go to
stderr; the image is printed on stdout.")]
pub struct ImageBuildArgs {
    /// The build context: the directory whose files COPY and ADD name (sent to the gateway
    /// as a tar; .dockerignore is not read).
    #[arg(value_name = "CONTEXT", id = "build_context")]
    pub context: std::path::PathBuf,
    /// The result's name, NAME[:TAG] (default: none; the image is shown by digest).
    #[arg(short = 't', long = "tag", value_name = "NAME[:TAG]", value_parser = parse_image_reference)]
    pub tag: Option<String>,
    /// The Dockerfile (default: CONTEXT/Dockerfile).
    #[arg(short = 'f', long = "file", value_name = "PATH")]
    pub file: Option<std::path::PathBuf>,
    /// A value for an ARG the Dockerfile declares, NAME=VALUE; repeatable.
    #[arg(long = "build-arg", value_name = "NAME=VALUE", value_parser = parse_key_value)]
    pub build_args: Vec<(String, String)>,
    /// What every RUN may reach, as `sbx sandbox create --allow` takes it; repeatable.
    /// Without it a RUN has loopback only.
    #[arg(long = "allow", value_name = "ENTRY")]
    pub allow: Vec<String>,
    /// Run every step, whatever the cache holds.
    #[arg(long)]
    pub no_cache: bool,
    /// The workspace RUN steps run in (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The driver RUN steps run on (default: the gateway's; it must keep a sandbox's changes,
    /// as oci does).
    #[arg(long, value_name = "DRIVER")]
    pub driver: Option<String>,
    /// The longest one RUN may take: 90s, 10m, 1h (default 30m).
    #[arg(long, value_name = "DURATION", value_parser = size::parse_lifetime)]
    pub run_timeout: Option<u64>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// When `sbx sandbox create` and `sbx run` pull their image first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PullPolicy {
    /// Never: a create of an image the store lacks fails (IMAGE_NOT_FOUND).
    Never,
    /// When the gateway answers IMAGE_NOT_FOUND: pulled (progress on stderr), then created.
    #[default]
    Missing,
    /// Before the create, every time (a tag that moved is re-pulled).
    Always,
}

/// A clap value parser: an image reference by the gateway's rule (`sbx_proto::image_ref`),
/// or a bare `sha256:…` digest.
pub fn parse_image_reference(input: &str) -> Result<String, CliError> {
    if !sbx_proto::image_ref::is_digest(input) {
        sbx_proto::image_ref::parse(input)
            .map_err(|source| CliError::InvalidImageReference { source })?;
    }
    Ok(input.to_string())
}

#[derive(Debug, Clone, Args)]
pub struct ImagePullArgs {
    /// What to pull: [registry/]name[:tag][@sha256:…] (default registry docker.io, tag latest).
    #[arg(value_parser = parse_image_reference)]
    pub reference: String,
    /// Plain HTTP to the registry (loopback registries get it anyway).
    #[arg(long)]
    pub insecure: bool,
    /// The registry user (with --password-stdin).
    #[arg(long, value_name = "USER", requires = "password_stdin")]
    pub username: Option<String>,
    /// Read the registry password from stdin (one line).
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ImageImportArgs {
    /// The file (streamed as it is) or OCI layout directory (tarred, then streamed).
    #[arg(value_name = "FILE|DIR")]
    pub path: std::path::PathBuf,
    /// The name to record the image under, NAME:TAG (default: the names the archive carries).
    #[arg(long, value_name = "NAME:TAG", value_parser = parse_image_reference)]
    pub name: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ImageListArgs {
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Names one image: exactly one of REF or `--id`.
#[derive(Debug, Clone, Args)]
#[group(id = "image_target", required = true, multiple = false)]
pub struct ImageTarget {
    /// The image: name[:tag], name@sha256:… or sha256:….
    #[arg(value_parser = parse_image_reference)]
    pub reference: Option<String>,
    /// The image's UUID (authoritative).
    #[arg(long, value_name = "UUID")]
    pub id: Option<Uuid>,
}

#[derive(Debug, Clone, Args)]
pub struct ImageTargetArgs {
    #[command(flatten)]
    pub target: ImageTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}
