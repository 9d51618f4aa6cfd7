//! `sbx workspace network get|set`: the network policy new sandboxes of a workspace get when
//! they ask for none, shown as `sbx sandbox network get` shows a sandbox's.

use clap::{Args, Subcommand};
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{NetworkMode, NetworkPolicy, SandboxNetwork};

use super::{WorkspaceTarget, workspace_ref};
use crate::CliError;
use crate::cmd::sandbox::network::{NetworkModeArg, mode_and_allow, render_network};
use crate::connect::{Target, connect};
use crate::output::OutputArgs;
use crate::reply::print;

/// `sbx workspace network …`
#[derive(Debug, Subcommand)]
pub enum WorkspaceNetworkCommand {
    /// Show the workspace's default network policy.
    Get(WorkspaceNetworkGetArgs),
    /// Set the default: --network none, or --network policy with --allow ENTRY… (--allow
    /// alone means policy); --clear removes it (new sandboxes: none).
    Set(WorkspaceNetworkSetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceNetworkGetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceNetworkSetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    /// none (loopback only) or policy (default deny, --allow admitted).
    #[arg(long, value_enum, value_name = "MODE", conflicts_with = "clear")]
    pub network: Option<NetworkModeArg>,
    /// An allowlist entry, CIDR or HOSTNAME, [:PORT[-PORT]][/tcp|/udp]; repeatable.
    #[arg(long = "allow", value_name = "ENTRY", conflicts_with = "clear")]
    pub allow: Vec<String>,
    /// Remove the default.
    #[arg(long)]
    pub clear: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// The workspace's default as the network view (no address, no denials).
fn default_view(ws: &sbx_proto::v1::Workspace) -> SandboxNetwork {
    SandboxNetwork {
        sandbox_id: ws.id.clone(),
        policy: Some(ws.default_network.clone().unwrap_or(NetworkPolicy {
            mode: NetworkMode::None as i32,
            allow: Vec::new(),
        })),
        ..Default::default()
    }
}

pub async fn run_workspace_network(
    target: &Target,
    cmd: WorkspaceNetworkCommand,
) -> Result<u8, CliError> {
    let mut client = WorkspaceServiceClient::new(connect(target).await?);
    let (ws, output) = match cmd {
        WorkspaceNetworkCommand::Get(a) => {
            let ws = client
                .get_workspace(sbx_proto::v1::GetWorkspaceRequest {
                    workspace: Some(workspace_ref(&a.target)),
                })
                .await?
                .into_inner();
            (ws, a.output)
        }
        WorkspaceNetworkCommand::Set(a) => {
            let policy = match a.clear {
                true => None,
                false => Some(mode_and_allow(a.network, &a.allow)?.ok_or_else(|| {
                    CliError::Usage(
                        "give --network none, --network policy [--allow ENTRY…], --allow \
                         ENTRY… or --clear"
                            .into(),
                    )
                })?),
            };
            let ws = client
                .set_workspace_network(sbx_proto::v1::SetWorkspaceNetworkRequest {
                    workspace: Some(workspace_ref(&a.target)),
                    default_network: policy,
                })
                .await?
                .into_inner();
            (ws, a.output)
        }
    };
    print(&render_network(&output, &default_view(&ws))?)?;
    Ok(0)
}
