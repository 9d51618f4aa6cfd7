//! `sbx workspace lifetime get|set`: the lifetime (ttl, idle timeout, delete-after) new
//! sandboxes of a workspace get when they give none; the flags and the words are
//! `crate::lifetime`'s, as `sbx sandbox create` takes and shows them.

use clap::{Args, Subcommand};
use sbx_proto::v1::Workspace;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use serde::Serialize;

use super::{WorkspaceTarget, workspace_ref};
use crate::CliError;
use crate::connect::{Target, connect};
use crate::lifetime::{LifetimeFlags, LifetimeView, lifetime_text, lifetime_view};
use crate::output::{OutputArgs, OutputFormat, Style, render_structured};
use crate::reply::print;

/// `sbx workspace lifetime …`
#[derive(Debug, Subcommand)]
pub enum WorkspaceLifetimeCommand {
    /// Show the lifetime new sandboxes of the workspace get when they give none.
    Get(WorkspaceLifetimeGetArgs),
    /// Set it (the flags given replace the whole default); --clear removes it.
    Set(WorkspaceLifetimeSetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceLifetimeGetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceLifetimeSetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    #[command(flatten)]
    pub flags: LifetimeFlags,
    /// Remove the default (new sandboxes live until deleted).
    #[arg(long)]
    pub clear: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Serialize)]
struct WorkspaceLifetimeView {
    workspace: String,
    default_lifetime: Option<LifetimeView>,
}

fn render_workspace(style: impl Into<Style>, ws: &Workspace) -> Result<String, CliError> {
    let style: Style = style.into();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(
            style.format,
            &WorkspaceLifetimeView {
                workspace: ws.name.clone(),
                default_lifetime: ws.default_lifetime.as_ref().map(lifetime_view),
            },
        ),
        OutputFormat::Name => Ok(format!("workspace/{}\n", ws.name)),
        OutputFormat::Table | OutputFormat::Wide => Ok(format!(
            "{} (a sandbox created without a lifetime gets it)\n",
            ws.default_lifetime
                .as_ref()
                .map_or_else(|| "none".to_string(), lifetime_text)
        )),
    }
}

pub async fn run_workspace_lifetime(
    target: &Target,
    cmd: WorkspaceLifetimeCommand,
) -> Result<u8, CliError> {
    let mut client = WorkspaceServiceClient::new(connect(target).await?);
    let (ws, output) = match cmd {
        WorkspaceLifetimeCommand::Get(a) => {
            let req = sbx_proto::v1::GetWorkspaceRequest {
                workspace: Some(workspace_ref(&a.target)),
            };
            (client.get_workspace(req).await?.into_inner(), a.output)
        }
        WorkspaceLifetimeCommand::Set(a) => {
            let lifetime = if a.clear {
                None
            } else {
                Some(a.flags.lifetime()?.ok_or_else(|| {
                    CliError::Usage(
                        "give --ttl, --idle-timeout and/or --delete-after (with their --on-…), \
                         or --clear"
                            .into(),
                    )
                })?)
            };
            let ws = client
                .set_workspace_lifetime(sbx_proto::v1::SetWorkspaceLifetimeRequest {
                    workspace: Some(workspace_ref(&a.target)),
                    default_lifetime: lifetime,
                })
                .await?
                .into_inner();
            (ws, a.output)
        }
    };
    print(&render_workspace(&output, &ws)?)?;
    Ok(0)
}
