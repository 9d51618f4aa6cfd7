//! `sbx sandbox stop|start|restart|pause|resume` (each waits, unless --detach, for the state it
//! asks for) and `sbx sandbox ttl` (moves the ttl's deadline).

use std::time::{Duration, SystemTime};

use clap::Args;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{RestartSandboxRequest, StartSandboxRequest, StopSandboxRequest};

use super::view::render_sandbox;
use super::{SandboxTarget, SandboxTargetArgs, WorkspaceScope, sandbox_ref};
use crate::args::parse_name;
use crate::connect::{Target, connect};
use crate::output::OutputArgs;
use crate::reply::print;
use crate::wait::{Goal, WaitOptions, follow, present};
use crate::{CliError, size};

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

/// The calls that change what a sandbox should be doing, and then wait for it.
#[derive(Debug, Clone, Copy)]
pub enum Lifecycle {
    Stop,
    Start,
    Restart,
    Pause,
    Resume,
}

impl Lifecycle {
    /// What to wait for after the call; `None`: its answer is the end (pause and resume answer
    /// once Paused, once Ready).
    fn goal(self) -> Option<Goal> {
        match self {
            Lifecycle::Stop => Some(Goal::Stopped),
            Lifecycle::Start | Lifecycle::Restart => Some(Goal::Ready),
            Lifecycle::Pause | Lifecycle::Resume => None,
        }
    }
}

/// `sbx sandbox stop|start|restart|pause|resume`.
pub async fn run_lifecycle(
    gateway: &Target,
    args: &SandboxActionArgs,
    call: Lifecycle,
) -> Result<u8, CliError> {
    let target = &args.target;
    let sandbox = Some(sandbox_ref(&target.scope, &target.target));
    let mut client = SandboxServiceClient::new(connect(gateway).await?);
    let answer = match call {
        Lifecycle::Stop => client.stop_sandbox(StopSandboxRequest { sandbox }).await?,
        Lifecycle::Start => {
            client
                .start_sandbox(StartSandboxRequest { sandbox })
                .await?
        }
        Lifecycle::Restart => {
            client
                .restart_sandbox(RestartSandboxRequest { sandbox })
                .await?
        }
        Lifecycle::Pause => {
            client
                .pause_sandbox(sbx_proto::v1::PauseSandboxRequest { sandbox })
                .await?
        }
        Lifecycle::Resume => {
            client
                .resume_sandbox(sbx_proto::v1::ResumeSandboxRequest { sandbox })
                .await?
        }
    }
    .into_inner();
    let sandbox = if let (false, Some(goal)) = (args.detach, call.goal()) {
        let options = WaitOptions {
            timeout: Duration::from_secs(args.timeout),
            settle: Duration::ZERO,
        };
        present(follow(&client, answer, goal, options).await?)?
    } else {
        answer
    };
    print(&render_sandbox(
        &target.output,
        &sandbox,
        SystemTime::now(),
    )?)?;
    Ok(0)
}

/// `sbx sandbox ttl NAME DURATION` or `sbx sandbox ttl --id UUID DURATION`: a name is
/// optional where an id is given, and a required DURATION cannot follow an optional
/// positional in clap, so the two are read as they come and told apart here.
#[derive(Debug, Clone, Args)]
pub struct SandboxTtlArgs {
    #[command(flatten)]
    pub scope: WorkspaceScope,
    /// The sandbox's name, then the new ttl from now: 30s, 10m, 2h, 7d (0: no deadline). With
    /// --id, the ttl alone.
    #[arg(value_name = "NAME|DURATION", allow_hyphen_values = true)]
    pub first: String,
    /// The new ttl, after NAME.
    #[arg(value_name = "DURATION", allow_hyphen_values = true)]
    pub second: Option<String>,
    /// The sandbox's UUID (authoritative: acts on that sandbox or on nothing).
    #[arg(long, value_name = "UUID")]
    pub id: Option<uuid::Uuid>,
    #[command(flatten)]
    pub output: OutputArgs,
}

impl SandboxTtlArgs {
    /// The sandbox named and the ttl asked.
    pub fn resolve(&self) -> Result<(SandboxTarget, u64), CliError> {
        let (name, ttl) = match (&self.id, &self.second) {
            (Some(_), None) => (None, &self.first),
            (Some(_), Some(_)) => {
                return Err(CliError::Usage(
                    "give NAME DURATION or --id UUID DURATION, not both a name and an id".into(),
                ));
            }
            (None, Some(ttl)) => (Some(parse_name(&self.first)?), ttl),
            (None, None) => {
                return Err(CliError::Usage(
                    "give NAME DURATION (or --id UUID DURATION): the sandbox and its new ttl"
                        .into(),
                ));
            }
        };
        Ok((
            SandboxTarget { name, id: self.id },
            size::parse_lifetime(ttl)?,
        ))
    }
}

/// `sbx sandbox ttl NAME DURATION`.
pub async fn run_ttl(target: &Target, args: SandboxTtlArgs) -> Result<u8, CliError> {
    let (sandbox, ttl_seconds) = args.resolve()?;
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let sandbox = client
        .set_sandbox_ttl(sbx_proto::v1::SetSandboxTtlRequest {
            sandbox: Some(sandbox_ref(&args.scope, &sandbox)),
            ttl_seconds,
        })
        .await?
        .into_inner();
    print(&render_sandbox(
        &args.output,
        &sandbox,
        std::time::SystemTime::now(),
    )?)?;
    Ok(0)
}
