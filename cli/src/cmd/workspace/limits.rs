//! `sbx workspace limits get|set`: the cpu, memory and disk limits new sandboxes of a
//! workspace get when they set none themselves (the gateway's `--default-cpu`,
//! `--default-memory` and `--default-disk` where the workspace has none either).

use clap::{Args, Subcommand};
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{Resources, Workspace};
use serde::Serialize;

use super::{WorkspaceTarget, workspace_ref};
use crate::connect::{Target, connect};
#[cfg(test)]
use crate::output::cores;
use crate::output::{OutputArgs, OutputFormat, Style, limits_text, render_structured};
use crate::reply::print;
use crate::{CliError, size};

/// `sbx workspace limits …`
#[derive(Debug, Subcommand)]
pub enum WorkspaceLimitsCommand {
    /// Show the workspace's default limits.
    Get(WorkspaceLimitsGetArgs),
    /// Set the default cpu, memory and/or disk limit (a flag not given is kept as it is, 0
    /// leaves that one to the gateway's default); --clear removes them all.
    Set(WorkspaceLimitsSetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceLimitsGetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct WorkspaceLimitsSetArgs {
    #[command(flatten)]
    pub target: WorkspaceTarget,
    /// CPU: cores (2, 0.5) or millicores (500m); 0: the gateway's default.
    #[arg(long, value_name = "CPUS", value_parser = size::parse_cpu, conflicts_with = "clear")]
    pub cpu: Option<u32>,
    /// Memory: 512Mi, 1Gi, 2G, … (Ki/Mi/Gi/Ti or K/M/G/T); 0: the gateway's default.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size, conflicts_with = "clear")]
    pub memory: Option<u64>,
    /// Disk (the root filesystem's writable layer and /sandbox together), as --memory; 0: the
    /// gateway's default.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size, conflicts_with = "clear")]
    pub disk: Option<u64>,
    /// Remove every default (new sandboxes get the gateway's).
    #[arg(long)]
    pub clear: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// A workspace's defaults as shown.
#[derive(Debug, Serialize)]
struct LimitsView {
    workspace: String,
    cpu_millis: u32,
    memory_bytes: u64,
    disk_bytes: u64,
}

fn render(style: impl Into<Style>, ws: &Workspace) -> Result<String, CliError> {
    let style: Style = style.into();
    let r = ws.default_resources.unwrap_or_default();
    let view = LimitsView {
        workspace: ws.name.clone(),
        cpu_millis: r.cpu_millis,
        memory_bytes: r.memory_bytes,
        disk_bytes: r.disk_bytes,
    };
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &view),
        OutputFormat::Name => Ok(format!("workspace/{}\n", view.workspace)),
        OutputFormat::Table | OutputFormat::Wide => Ok(format!(
            "{} (a sandbox that sets none; - means the gateway's default)\n",
            limits_text(&r)
        )),
    }
}

pub async fn run_workspace_limits(
    target: &Target,
    cmd: WorkspaceLimitsCommand,
) -> Result<u8, CliError> {
    let mut client = WorkspaceServiceClient::new(connect(target).await?);
    let get = |t: &WorkspaceTarget| sbx_proto::v1::GetWorkspaceRequest {
        workspace: Some(workspace_ref(t)),
    };
    let (ws, output) = match cmd {
        WorkspaceLimitsCommand::Get(a) => {
            let ws = client.get_workspace(get(&a.target)).await?.into_inner();
            (ws, a.output)
        }
        WorkspaceLimitsCommand::Set(a) => {
            let resources = if a.clear {
                None
            } else {
                if a.cpu.is_none() && a.memory.is_none() && a.disk.is_none() {
                    return Err(CliError::Usage(
                        "give --cpu CPUS, --memory SIZE and/or --disk SIZE, or --clear".into(),
                    ));
                }
                let now = client
                    .get_workspace(get(&a.target))
                    .await?
                    .into_inner()
                    .default_resources
                    .unwrap_or_default();
                Some(Resources {
                    cpu_millis: a.cpu.unwrap_or(now.cpu_millis),
                    memory_bytes: a.memory.unwrap_or(now.memory_bytes),
                    disk_bytes: a.disk.unwrap_or(now.disk_bytes),
                })
            };
            let ws = client
                .set_workspace_limits(sbx_proto::v1::SetWorkspaceLimitsRequest {
                    workspace: Some(workspace_ref(&a.target)),
                    default_resources: resources,
                })
                .await?
                .into_inner();
            (ws, a.output)
        }
    };
    print(&render(&output, &ws)?)?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_read_as_people_write_them() {
        assert_eq!(cores(1000), "1");
        assert_eq!(cores(500), "0.5");
        assert_eq!(cores(1250), "1.25");
        assert_eq!(cores(2001), "2.001");
        assert_eq!(
            limits_text(&Resources {
                cpu_millis: 1500,
                memory_bytes: 1 << 30,
                disk_bytes: 10 << 30,
            }),
            "cpu 1.5, memory 1.0GiB, disk 10.0GiB"
        );
        assert_eq!(
            limits_text(&Resources::default()),
            "cpu -, memory -, disk -"
        );
    }
}
