//! `sbx service …`: a sandbox's service endpoints (ServiceEndpointService), ports of its
//! loopback that sbxd's HTTP listener routes to by Host.

use clap::{Args, Subcommand};
use sbx_proto::v1::service_endpoint_service_client::ServiceEndpointServiceClient;
use sbx_proto::v1::{
    DeleteServiceRequest, ExposeServiceRequest, GetServiceRequest, ListServicesRequest,
    ServiceEndpoint,
};
use serde::Serialize;

use crate::CliError;
use crate::args::{ScopeArgs, describe_sandbox, parse_name, sandbox_by_name};
use crate::connect::{Target, connect};
use crate::output::{OutputArgs, Style, render_list, render_one, render_table, rfc3339};
use crate::reply::{print, print_list, print_removed};

/// `sbx service …`
#[derive(Debug, Subcommand)]
pub enum ServiceCommand {
    /// Expose a port of a sandbox as a service endpoint: sbxd's HTTP listener routes the Host
    /// NAME--SANDBOX--WORKSPACE.<domain> to it.
    Expose(ServiceExposeArgs),
    /// Show one service endpoint of a sandbox.
    Get(ServiceNameArgs),
    /// List the endpoints of one sandbox, or of a workspace (or of all, with -A).
    #[command(visible_alias = "ls")]
    List(ServiceListArgs),
    /// Delete one service endpoint of a sandbox.
    #[command(visible_alias = "rm")]
    Delete(ServiceNameArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ServiceExposeArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// The port on the sandbox's loopback to route to.
    #[arg(long, value_name = "PORT")]
    pub port: u32,
    /// The endpoint's name (a DNS label without "--"; default: web).
    #[arg(long, value_name = "NAME")]
    pub name: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ServiceNameArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// The endpoint's name.
    pub name: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ServiceListArgs {
    /// The workspace (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The endpoints of every workspace (without SANDBOX).
    #[arg(short = 'A', long, conflicts_with_all = ["workspace", "sandbox"])]
    pub all_workspaces: bool,
    /// Only this sandbox's endpoints.
    #[arg(value_parser = parse_name)]
    pub sandbox: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceView {
    pub id: String,
    pub name: String,
    pub sandbox: String,
    pub sandbox_id: String,
    pub workspace: String,
    pub port: u32,
    pub host: String,
    pub created_at: Option<String>,
    pub resource_version: u64,
}

pub fn service_view(s: &ServiceEndpoint) -> ServiceView {
    ServiceView {
        id: s.id.clone(),
        name: s.name.clone(),
        sandbox: s.sandbox.clone(),
        sandbox_id: s.sandbox_id.clone(),
        workspace: s.workspace.clone(),
        port: s.port,
        host: s.host.clone(),
        created_at: rfc3339(s.created_at.as_ref()),
        resource_version: s.resource_version,
    }
}

pub const SERVICE_COLUMNS: &[&str] = &["NAME", "SANDBOX", "PORT", "HOST"];

pub fn render_services(
    style: impl Into<Style>,
    services: &[ServiceEndpoint],
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        services,
        ("service", |s| &s.name),
        |rows| {
            let rows: Vec<Vec<String>> = rows
                .iter()
                .map(|s| {
                    vec![
                        s.name.clone(),
                        s.sandbox.clone(),
                        s.port.to_string(),
                        s.host.clone(),
                    ]
                })
                .collect();
            render_table(SERVICE_COLUMNS, &rows, style)
        },
        service_view,
    )
}

pub async fn run_service(target: &Target, cmd: ServiceCommand) -> Result<u8, CliError> {
    let mut client = ServiceEndpointServiceClient::new(connect(target).await?);
    match cmd {
        ServiceCommand::Expose(args) => {
            let exposed = client
                .expose_service(ExposeServiceRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    port: args.port,
                    name: args.name.clone().unwrap_or_default(),
                })
                .await?
                .into_inner();
            print(&render_one(
                &args.output,
                &exposed,
                service_view,
                render_services,
            )?)?;
        }
        ServiceCommand::Get(args) => {
            let found = client
                .get_service(GetServiceRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    name: args.name.clone(),
                })
                .await?
                .into_inner();
            print(&render_one(
                &args.output,
                &found,
                service_view,
                render_services,
            )?)?;
        }
        ServiceCommand::List(args) => {
            let scope = ScopeArgs {
                workspace: args.workspace.clone(),
            };
            let services = client
                .list_services(ListServicesRequest {
                    sandbox: args
                        .sandbox
                        .as_deref()
                        .and_then(|name| sandbox_by_name(&scope, name)),
                    workspace: args.workspace.clone().unwrap_or_default(),
                    all_workspaces: args.all_workspaces,
                })
                .await?
                .into_inner()
                .services;
            let note = match &args.sandbox {
                Some(name) => format!("No services on {}.", describe_sandbox(&scope, name)),
                None => "No services found.".to_string(),
            };
            print_list(&render_services(&args.output, &services)?, &note)?;
        }
        ServiceCommand::Delete(args) => {
            let deleted = client
                .delete_service(DeleteServiceRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    name: args.name.clone(),
                })
                .await?
                .into_inner()
                .deleted;
            let what = format!("service {:?} of", args.name);
            print_removed(
                &args.output,
                deleted,
                &what,
                &args.scope,
                &args.sandbox,
                "deleted",
            )?;
        }
    }
    Ok(0)
}
