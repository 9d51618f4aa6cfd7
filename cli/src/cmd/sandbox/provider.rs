//! `sbx sandbox provider …`: the providers attached to a sandbox (ProviderService's
//! attachments); the providers themselves are `sbx provider …` (`cmd/provider.rs`).

use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::provider_service_client::ProviderServiceClient;
use sbx_proto::v1::{
    AttachProviderRequest, DetachProviderRequest, ListAttachmentsRequest, ProviderAttachment,
};
use serde::Serialize;

use crate::CliError;
use crate::args::{SandboxArgs, ScopeArgs, describe_sandbox, parse_name, sandbox_by_name};
use crate::connect::{Target, connect};
use crate::output::{OutputArgs, Style, age, render_list, render_one, render_table, rfc3339};
use crate::reply::{print, print_list, print_removed};

/// `sbx sandbox provider …`
#[derive(Debug, Subcommand)]
pub enum SandboxProviderCommand {
    /// Attach a provider of the sandbox's workspace: its credentials reach the sandbox's next
    /// start and every exec.
    Attach(AttachArgs),
    /// Detach a provider from a sandbox (the running workload keeps what it was started with).
    Detach(AttachArgs),
    /// List the providers attached to a sandbox.
    #[command(visible_alias = "ls")]
    List(SandboxArgs),
}

#[derive(Debug, Clone, Args)]
pub struct AttachArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// The provider, by name or UUID (of the sandbox's workspace).
    pub provider: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AttachmentView {
    pub sandbox_id: String,
    pub provider_id: String,
    pub provider_name: String,
    pub created_at: Option<String>,
}

pub fn attachment_view(a: &ProviderAttachment) -> AttachmentView {
    AttachmentView {
        sandbox_id: a.sandbox_id.clone(),
        provider_id: a.provider_id.clone(),
        provider_name: a.provider_name.clone(),
        created_at: rfc3339(a.created_at.as_ref()),
    }
}

pub const ATTACHMENT_COLUMNS: &[&str] = &["PROVIDER", "PROVIDER ID", "AGE"];

pub fn render_attachments(
    style: impl Into<Style>,
    attachments: &[ProviderAttachment],
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        attachments,
        ("provider", |a| &a.provider_name),
        |rows| {
            let rows: Vec<Vec<String>> = rows
                .iter()
                .map(|a| {
                    vec![
                        a.provider_name.clone(),
                        a.provider_id.clone(),
                        age(now, a.created_at.as_ref()),
                    ]
                })
                .collect();
            render_table(ATTACHMENT_COLUMNS, &rows, style)
        },
        attachment_view,
    )
}

pub async fn run_sandbox_provider(
    target: &Target,
    cmd: SandboxProviderCommand,
) -> Result<u8, CliError> {
    let mut client = ProviderServiceClient::new(connect(target).await?);
    match cmd {
        SandboxProviderCommand::Attach(args) => {
            let attached = client
                .attach_provider(AttachProviderRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    provider: args.provider.clone(),
                })
                .await?
                .into_inner();
            print(&render_one(
                &args.output,
                &attached,
                attachment_view,
                |s, a| render_attachments(s, a, SystemTime::now()),
            )?)?;
        }
        SandboxProviderCommand::Detach(args) => {
            let detached = client
                .detach_provider(DetachProviderRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    provider: args.provider.clone(),
                })
                .await?
                .into_inner()
                .detached;
            let what = format!("provider {:?} of", args.provider);
            print_removed(
                &args.output,
                detached,
                &what,
                &args.scope,
                &args.sandbox,
                "detached",
            )?;
        }
        SandboxProviderCommand::List(args) => {
            let attachments = client
                .list_attachments(ListAttachmentsRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                })
                .await?
                .into_inner()
                .attachments;
            print_list(
                &render_attachments(&args.output, &attachments, SystemTime::now())?,
                &format!(
                    "No providers attached to {}.",
                    describe_sandbox(&args.scope, &args.sandbox)
                ),
            )?;
        }
    }
    Ok(0)
}
