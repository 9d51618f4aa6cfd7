//! `sbx wait`: for the gateway to serve (its health service, at the endpoint or at the address
//! an `--addr-file` names), or for a sandbox to reach a state (followed on the watch stream,
//! `crate::wait`).

use std::time::{Duration, SystemTime};

use clap::{Args, ValueEnum};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{GetSandboxRequest, SandboxRef};
use uuid::Uuid;

use crate::args::parse_name;
use crate::cmd::sandbox::view::render_sandbox;
use crate::connect::{Target, connect};
use crate::output::OutputArgs;
use crate::reply::print;
use crate::wait::{Goal, Observation, WaitOptions, follow, wait_serving};
use crate::{CliError, size};

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
        SBX_ENDPOINT, the context, else each of the default sockets in order: the sbx \
        package's service, unix:///run/sbx/sbxd.sock, then sbxd's in your data dir) until it \
        answers SERVING, waiting also for a socket that does not exist yet, and saying on \
        stderr what each place says while it waits; with \
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

/// `sbx wait`: for the gateway to serve, or for a sandbox to reach a state.
pub async fn run_wait(target: &Target, args: &WaitArgs) -> Result<u8, CliError> {
    let timeout = Duration::from_secs(args.timeout);
    let named = args.name.is_some() || args.id.is_some();
    let goal = match args.condition {
        WaitCondition::Serving => {
            if named || args.workspace.is_some() {
                return Err(CliError::WaitUsage(
                    "--for serving waits for the gateway; it takes no sandbox".to_string(),
                ));
            }
            let serving = wait_serving(target, args.addr_file.as_deref(), timeout).await?;
            print(&format!("{serving}\n"))?;
            return Ok(0);
        }
        WaitCondition::Ready => Goal::Ready,
        WaitCondition::Stopped => Goal::Ended,
        WaitCondition::Completed => Goal::Completed,
        WaitCondition::Deleted => Goal::Deleted,
    };
    if !named {
        return Err(CliError::WaitUsage(format!(
            "--for {} needs the sandbox: NAME (with -w WORKSPACE) or --id UUID",
            goal.name().to_lowercase()
        )));
    }
    if args.addr_file.is_some() {
        return Err(CliError::WaitUsage(
            "--addr-file goes with --for serving only".to_string(),
        ));
    }
    let reference = match &args.id {
        Some(id) => SandboxRef {
            id: id.to_string(),
            workspace: String::new(),
            name: String::new(),
        },
        None => SandboxRef {
            id: String::new(),
            workspace: args.workspace.clone().unwrap_or_default(),
            name: args.name.clone().unwrap_or_default(),
        },
    };
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let found = client
        .get_sandbox(GetSandboxRequest {
            sandbox: Some(reference),
        })
        .await;
    let sandbox = match found {
        Ok(answer) => answer.into_inner(),
        // Already gone is what --for deleted waits for.
        Err(status) if status.code() == tonic::Code::NotFound && goal == Goal::Deleted => {
            return Ok(0);
        }
        Err(status) => return Err(status.into()),
    };
    let options = WaitOptions {
        timeout,
        settle: Duration::from_millis(args.settle),
    };
    match follow(&client, sandbox, goal, options).await? {
        Observation::Present(sandbox) => {
            print(&render_sandbox(&args.output, &sandbox, SystemTime::now())?)?
        }
        Observation::Gone { .. } => {}
    }
    Ok(0)
}
