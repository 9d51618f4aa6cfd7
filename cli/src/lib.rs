//! `sbx`, the command-line client of the sbx gateway (the `sbx.v1` gRPC API).
//!
//! Layout, by noun: [`cmd`] holds one module per noun of the command line (`cmd/sandbox/`,
//! `cmd/workspace/`, `cmd/image/`, `cmd/provider.rs`, …), each with its clap arguments, the
//! requests it makes and what it prints; this module holds only the global flags ([`Cli`]),
//! the list of nouns ([`Command`]) and the run of one command line. What every noun shares
//! lies below `cmd` and uses none of it: [`connect`] dials the gateway with the credential
//! ([`transport`] says how it was dialled), [`config`] keeps the contexts and decides where
//! a call goes, [`error`] is the one error type and its exit codes, [`output`] the `-o`
//! formats and tables, [`reply`] printing, paging and deletes' answers, [`args`] the
//! arguments many nouns take, [`size`] quantities and durations, [`lifetime`] the lifetime
//! flags and words, [`wait`] following a sandbox to a goal and the gateway to serving, and
//! [`terminal`] the local terminal of `exec -t`.

pub mod args;
pub mod cmd;
pub mod config;
pub mod connect;
pub mod error;
pub mod lifetime;
pub mod output;
pub mod reply;
pub mod size;
pub mod terminal;
pub mod transport;
pub mod wait;

use clap::{Parser, Subcommand};

use connect::Target;
pub use error::CliError;
use transport::Transport;

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
    std::process::ExitCode::from(run_to_exit_code(cli))
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
    /// HOST:PORT (http; https when TLS settings are given). Overrides SBX_ENDPOINT, which
    /// overrides the context's endpoint. With none of them, sbx looks, in this order, at the
    /// sbx package's service socket, unix:///run/sbx/sbxd.sock, then at sbxd's socket in your
    /// data dir, unix://<data dir>/sbxd.sock (the data dir is /var/lib/sbx for root, else
    /// $XDG_STATE_HOME/sbx, else ~/.local/state/sbx): the first that answers; when none does,
    /// the error names every place looked at.
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
    Workspace(cmd::workspace::WorkspaceCommand),
    /// Create, inspect, control, exec into, tail and watch sandboxes.
    #[command(subcommand, visible_alias = "sb")]
    Sandbox(cmd::sandbox::SandboxCommand),
    /// Create, inspect, list, update and delete providers (credential sets of a workspace that
    /// sandboxes attach to; values never shown).
    #[command(subcommand)]
    Provider(cmd::provider::ProviderCommand),
    /// Set, get, list and delete a sandbox's settings (seen by its workload as
    /// $SBX_SETTING_<KEY>).
    #[command(subcommand)]
    Setting(cmd::setting::SettingCommand),
    /// Expose, inspect, list and delete service endpoints (a sandbox port routed by Host).
    #[command(subcommand, visible_alias = "svc")]
    Service(cmd::service::ServiceCommand),
    /// Pull, import, inspect, list and delete images (what sandboxes on image drivers run).
    #[command(subcommand, visible_alias = "img")]
    Image(cmd::image::ImageCommand),
    /// Make, list and revoke identities and their tokens (a gateway-wide admin's; on the
    /// gateway's host `sbxd token` does the same without a connection).
    #[command(subcommand, visible_alias = "id")]
    Identity(cmd::identity::IdentityCommand),
    /// Add, list, inspect, cordon, drain and remove nodes: the machines sandboxes run on
    /// (`sbxd node` hosts; `local` is the gateway's own drivers). A gateway-wide admin's.
    #[command(subcommand)]
    Node(cmd::node::NodeCommand),
    /// List what happened to a workspace's sandboxes (or every workspace's, -A), oldest first:
    /// created, started, stopped, exited, OOM-killed, failed driver steps, recovered from
    /// Error, re-attached or restarted by the reconciler; --watch keeps printing new ones.
    Events(cmd::events::EventsArgs),
    /// Run a command in a new sandbox as a job, as `docker run` does: create it, stream its
    /// output, wait for its end and exit with its exit code (--rm: delete it after).
    Run(Box<cmd::run::RunArgs>),
    /// Wait until the gateway serves (`--for serving`) or a sandbox is Ready, Stopped,
    /// Completed or deleted (`--for ready|stopped|completed|deleted NAME`).
    Wait(cmd::wait::WaitArgs),
    /// Print the client's version, and the gateway's at --endpoint: its version, its default
    /// driver and what each of its drivers can do (stdin, tty, cp, port-forward, images).
    /// Exits 0 also when the gateway is down (and says so).
    Version(cmd::version::VersionArgs),
    /// Keep gateways and their credentials as named contexts in the config file, and pick
    /// the current one (as kubeconfig does).
    #[command(subcommand, long_about = cmd::config::CONFIG_ABOUT)]
    Config(cmd::config::ConfigCommand),
    /// Print a shell completion script: `source <(sbx completion bash)`, `sbx completion zsh >
    /// "${fpath[1]}/_sbx"`, `sbx completion fish > ~/.config/fish/completions/sbx.fish`.
    Completion(cmd::completion::CompletionArgs),
}

/// Runs the command on a fresh single-threaded runtime, prints any error as one
/// `error: …` line on stderr, and returns the process exit code.
pub fn run_to_exit_code(cli: Cli) -> u8 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return 1;
        }
    };
    let (result, via) = runtime.block_on(run(cli));
    let (code, message) = error::outcome(result, via);
    if let Some(message) = message {
        eprintln!("{message}");
    }
    code
}

/// Runs one command; `Ok` carries the exit code (0, or a remote command's for exec). Beside
/// the result: how the command dialled the gateway (`None`: it dialled nothing), for
/// [`error::outcome`].
pub async fn run(cli: Cli) -> (Result<u8, CliError>, Option<Transport>) {
    let flags = match cli.flags() {
        Ok(flags) => flags,
        Err(err) => return (Err(err), None),
    };
    match cli.command {
        Command::Config(cmd) => (cmd::config::run_config(&flags, &cmd), None),
        Command::Completion(args) => (cmd::completion::run_completion(&args), None),
        command => match flags.target() {
            Ok(target) => {
                let via = target.address.transport();
                (command.run(&target).await, Some(via))
            }
            Err(err) => (Err(err), None),
        },
    }
}

impl Command {
    /// Runs a command that dials the gateway at `target`: one line per noun.
    async fn run(self, target: &Target) -> Result<u8, CliError> {
        match self {
            Command::Workspace(cmd) => cmd::workspace::run_workspace(target, cmd).await,
            Command::Sandbox(cmd) => cmd::sandbox::run_sandbox(target, cmd).await,
            Command::Provider(cmd) => cmd::provider::run_provider(target, cmd).await,
            Command::Setting(cmd) => cmd::setting::run_setting(target, cmd).await,
            Command::Service(cmd) => cmd::service::run_service(target, cmd).await,
            Command::Image(cmd) => cmd::image::run_image(target, cmd).await,
            Command::Identity(cmd) => cmd::identity::run_identity(target, cmd).await,
            Command::Node(cmd) => cmd::node::run_node(target, cmd).await,
            Command::Events(args) => cmd::events::run_events(target, args).await,
            Command::Wait(args) => cmd::wait::run_wait(target, &args).await,
            Command::Run(args) => cmd::run::run_job(target, &args).await,
            Command::Version(args) => cmd::version::run_version(target, &args).await,
            // [`run`] runs these without a target.
            Command::Config(_) | Command::Completion(_) => Err(CliError::Internal(
                "sbx config and sbx completion never dial the gateway".to_string(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_against_no_gateway_fails_with_one_line() {
        use clap::Parser;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let cli = Cli::try_parse_from(["sbx", "--endpoint", &endpoint, "sandbox", "list"]).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (result, via) = runtime.block_on(run(cli));
        let (code, message) = error::outcome(result, via);
        assert_eq!(code, 1);
        let message = message.unwrap();
        assert!(
            message.starts_with(&format!("error: cannot reach sbxd at {endpoint}: ")),
            "{message}"
        );
        assert!(!message.contains('\n'), "{message:?}");
    }
}
