//! `sbx setting …`: a sandbox's settings (SettingService), KEY=VALUE pairs its workload sees
//! as `$SBX_SETTING_<KEY>`.

use clap::{Args, Subcommand};
use sbx_proto::v1::setting_service_client::SettingServiceClient;
use sbx_proto::v1::{
    DeleteSettingRequest, GetSettingRequest, ListSettingsRequest, SetSettingsRequest, Setting,
};
use serde::Serialize;

use crate::CliError;
use crate::args::{
    SandboxArgs, ScopeArgs, describe_sandbox, key_value_map, parse_key_value, parse_name,
    sandbox_by_name,
};
use crate::connect::{Target, connect};
use crate::output::{OutputArgs, Style, render_list, render_one, render_table, rfc3339};
use crate::reply::{collect_pages, print, print_list, print_removed};

/// `sbx setting …`
#[derive(Debug, Subcommand)]
pub enum SettingCommand {
    /// Set settings of a sandbox, KEY=VALUE… (all checked before any is written); a workload
    /// sees KEY as $SBX_SETTING_<KEY> (upper case, '-' as '_') at its next start and exec.
    /// approval-mode takes suggest, auto-edit or full-auto.
    Set(SettingSetArgs),
    /// Show one setting of a sandbox.
    Get(SettingKeyArgs),
    /// List a sandbox's settings, in key order.
    #[command(visible_alias = "ls")]
    List(SandboxArgs),
    /// Delete one setting of a sandbox.
    #[command(visible_alias = "rm")]
    Delete(SettingKeyArgs),
}

#[derive(Debug, Clone, Args)]
pub struct SettingSetArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// The settings, KEY=VALUE (KEY a DNS label).
    #[arg(required = true, value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub values: Vec<(String, String)>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct SettingKeyArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// The setting's key.
    pub key: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SettingView {
    pub sandbox_id: String,
    pub key: String,
    pub value: String,
    pub updated_at: Option<String>,
    pub resource_version: u64,
}

pub fn setting_view(s: &Setting) -> SettingView {
    SettingView {
        sandbox_id: s.sandbox_id.clone(),
        key: s.key.clone(),
        value: s.value.clone(),
        updated_at: rfc3339(s.updated_at.as_ref()),
        resource_version: s.resource_version,
    }
}

pub const SETTING_COLUMNS: &[&str] = &["KEY", "VALUE"];

pub fn render_settings(style: impl Into<Style>, settings: &[Setting]) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        settings,
        ("setting", |s| &s.key),
        |rows| {
            let rows: Vec<Vec<String>> = rows
                .iter()
                .map(|s| vec![s.key.clone(), s.value.clone()])
                .collect();
            render_table(SETTING_COLUMNS, &rows, style)
        },
        setting_view,
    )
}

pub async fn run_setting(target: &Target, cmd: SettingCommand) -> Result<u8, CliError> {
    let mut client = SettingServiceClient::new(connect(target).await?);
    match cmd {
        SettingCommand::Set(args) => {
            let values = key_value_map("KEY=VALUE", &args.values)?;
            let mut set = client
                .set_settings(SetSettingsRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    values,
                })
                .await?
                .into_inner()
                .settings;
            set.sort_by(|a, b| a.key.cmp(&b.key));
            print(&render_settings(&args.output, &set)?)?;
        }
        SettingCommand::Get(args) => {
            let found = client
                .get_setting(GetSettingRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    key: args.key.clone(),
                })
                .await?
                .into_inner();
            print(&render_one(
                &args.output,
                &found,
                setting_view,
                render_settings,
            )?)?;
        }
        SettingCommand::List(args) => {
            let settings = collect_pages(|page_token| {
                let mut client = client.clone();
                let req = ListSettingsRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    page_size: 0,
                    page_token,
                };
                async move {
                    let page = client.list_settings(req).await?.into_inner();
                    Ok((page.settings, page.next_page_token))
                }
            })
            .await?;
            print_list(
                &render_settings(&args.output, &settings)?,
                &format!(
                    "No settings on {}.",
                    describe_sandbox(&args.scope, &args.sandbox)
                ),
            )?;
        }
        SettingCommand::Delete(args) => {
            let deleted = client
                .delete_setting(DeleteSettingRequest {
                    sandbox: sandbox_by_name(&args.scope, &args.sandbox),
                    key: args.key.clone(),
                })
                .await?
                .into_inner()
                .deleted;
            let what = format!("setting {:?} of", args.key);
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
