//! `sbx workspace …`: workspaces, the groups sandboxes live in. This file: create, get, list
//! and delete, and how a workspace shows; the defaults new sandboxes of a workspace get are
//! `network.rs`, `limits.rs` and `lifetime.rs`.

use std::collections::BTreeMap;
use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{
    CreateWorkspaceRequest, DeleteWorkspaceRequest, GetWorkspaceRequest, ListWorkspacesRequest,
    Workspace, WorkspacePhase, WorkspaceRef,
};
use serde::Serialize;
use uuid::Uuid;

use crate::CliError;
use crate::args::{key_value_map, parse_key_value, parse_name};
use crate::connect::{Target, connect};
use crate::output::{
    OutputArgs, OutputFormat, Style, age, camel_case_enum, columns, labels_cell, render_list,
    render_structured, render_table, rfc3339, sorted, unknown_enum,
};
use crate::reply::{collect_pages, found_or_absent, print, print_deleted, print_list};

pub mod lifetime;
pub mod limits;
pub mod network;

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

/// A workspace as printed in JSON and YAML.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WorkspaceView {
    pub id: String,
    pub name: String,
    pub phase: String,
    pub labels: BTreeMap<String, String>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub resource_version: u64,
}

pub fn workspace_phase_name(value: i32) -> String {
    WorkspacePhase::try_from(value)
        .map(|p| camel_case_enum(p.as_str_name(), "WORKSPACE_PHASE_"))
        .unwrap_or_else(|_| unknown_enum(value))
}

pub fn workspace_view(workspace: &Workspace) -> WorkspaceView {
    WorkspaceView {
        id: workspace.id.clone(),
        name: workspace.name.clone(),
        phase: workspace_phase_name(workspace.phase),
        labels: sorted(&workspace.labels),
        created_at: rfc3339(workspace.created_at.as_ref()),
        updated_at: rfc3339(workspace.updated_at.as_ref()),
        resource_version: workspace.resource_version,
    }
}

pub const WORKSPACE_COLUMNS: &[&str] = &["NAME", "ID", "PHASE", "AGE"];
/// `-o wide` adds these after [`WORKSPACE_COLUMNS`].
pub const WORKSPACE_WIDE_COLUMNS: &[&str] = &["LABELS"];

pub fn workspace_table(workspaces: &[Workspace], now: SystemTime, style: Style) -> String {
    let rows: Vec<Vec<String>> = workspaces
        .iter()
        .map(|w| {
            let mut row = vec![
                w.name.clone(),
                w.id.clone(),
                workspace_phase_name(w.phase),
                age(now, w.created_at.as_ref()),
            ];
            if style.format == OutputFormat::Wide {
                row.push(labels_cell(&w.labels));
            }
            row
        })
        .collect();
    render_table(
        &columns(style, WORKSPACE_COLUMNS, WORKSPACE_WIDE_COLUMNS),
        &rows,
        style,
    )
}

pub fn render_workspace(
    style: impl Into<Style>,
    workspace: &Workspace,
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => {
            render_structured(style.format, &workspace_view(workspace))
        }
        _ => render_workspaces(style, std::slice::from_ref(workspace), now),
    }
}

pub fn render_workspaces(
    style: impl Into<Style>,
    workspaces: &[Workspace],
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        workspaces,
        ("workspace", |w| &w.name),
        |rows| workspace_table(rows, now, style),
        workspace_view,
    )
}

pub async fn run_workspace(target: &Target, cmd: WorkspaceCommand) -> Result<u8, CliError> {
    match cmd {
        WorkspaceCommand::Create(args) => {
            let req = create_workspace_request(&args)?;
            let mut client = WorkspaceServiceClient::new(connect(target).await?);
            let workspace = client.create_workspace(req).await?.into_inner();
            print(&render_workspace(
                &args.output,
                &workspace,
                SystemTime::now(),
            )?)?;
        }
        WorkspaceCommand::Network(cmd) => {
            return network::run_workspace_network(target, cmd).await;
        }
        WorkspaceCommand::Limits(cmd) => {
            return limits::run_workspace_limits(target, cmd).await;
        }
        WorkspaceCommand::Lifetime(cmd) => {
            return lifetime::run_workspace_lifetime(target, cmd).await;
        }
        WorkspaceCommand::Get(args) => {
            let req = GetWorkspaceRequest {
                workspace: Some(workspace_ref(&args.target)),
            };
            let mut client = WorkspaceServiceClient::new(connect(target).await?);
            let workspace = client.get_workspace(req).await?.into_inner();
            print(&render_workspace(
                &args.output,
                &workspace,
                SystemTime::now(),
            )?)?;
        }
        WorkspaceCommand::List(args) => {
            let client = WorkspaceServiceClient::new(connect(target).await?);
            let workspaces = collect_pages(|token| {
                let mut client = client.clone();
                let req = list_workspaces_request(&args, &token);
                async move {
                    let page = client.list_workspaces(req).await?.into_inner();
                    Ok((page.workspaces, page.next_page_token))
                }
            })
            .await?;
            let rendered = render_workspaces(&args.output, &workspaces, SystemTime::now())?;
            print_list(&rendered, "No workspaces found.")?;
        }
        WorkspaceCommand::Delete(args) => {
            let req = delete_workspace_request(&args);
            let what = req
                .workspace
                .as_ref()
                .map(describe_workspace_ref)
                .unwrap_or_default();
            let mut client = WorkspaceServiceClient::new(connect(target).await?);
            // Looked up first so that -o json|yaml|name can say what was deleted.
            let found = found_or_absent(
                client
                    .get_workspace(GetWorkspaceRequest {
                        workspace: req.workspace.clone(),
                    })
                    .await,
            )?;
            let deleted = client.delete_workspace(req).await?.into_inner().deleted;
            let found = found.map(|w| (w.id, w.name));
            print_deleted(&args.output, deleted, found, &what, "workspace")?;
        }
    }
    Ok(0)
}
