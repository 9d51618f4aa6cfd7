//! `sbx provider …`, `sbx sandbox provider …`, `sbx setting …` and `sbx service …`: the
//! objects a sandbox owns or uses besides its spec (ProviderService, SettingService,
//! ServiceEndpointService).
//!
//! A provider's credentials go to the gateway and never come back: the API answers their
//! names and fingerprints (16 hex digits of an HMAC), so nothing here can print a value.
//! `--credential-env KEY` reads the value from this process's environment, so a secret need
//! not be on a command line (where `ps` shows it).

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::provider_service_client::ProviderServiceClient;
use sbx_proto::v1::service_endpoint_service_client::ServiceEndpointServiceClient;
use sbx_proto::v1::setting_service_client::SettingServiceClient;
use sbx_proto::v1::{
    AttachProviderRequest, CreateProviderRequest, DeleteProviderRequest, DeleteServiceRequest,
    DeleteSettingRequest, DetachProviderRequest, ExposeServiceRequest, GetProviderRequest,
    GetServiceRequest, GetSettingRequest, ListAttachmentsRequest, ListProvidersRequest,
    ListServicesRequest, ListSettingsRequest, Provider, ProviderAttachment, ProviderRef,
    SandboxRef, ServiceEndpoint, SetSettingsRequest, Setting, UpdateProviderRequest,
};
use serde::Serialize;
use uuid::Uuid;

use super::connect::{Target, connect};
use super::output::{
    Style, age, dash_if_empty, render_list, render_structured, render_table, rfc3339,
};
use super::reply::{collect_pages, print, print_list};
use super::request::key_value_map;
use super::{CliError, OutputArgs, OutputFormat, parse_key_value, parse_name};

// ---------------------------------------------------------------------------------------------
// Arguments

/// `sbx provider …`
#[derive(Debug, Subcommand)]
pub enum ProviderCommand {
    /// Create a provider: a named set of credentials (and config) of a workspace that
    /// sandboxes attach to get them as environment variables.
    Create(ProviderCreateArgs),
    /// Show one provider: its type, credential names and fingerprints (never a value), config.
    Get(ProviderTargetArgs),
    /// List the providers of one workspace or of all (every page).
    #[command(visible_alias = "ls")]
    List(ProviderListArgs),
    /// Set or remove credentials and config entries; attached sandboxes see the change at
    /// their next start and exec.
    Update(ProviderUpdateArgs),
    /// Delete a provider. Refused while sandboxes are attached (naming each), unless --force,
    /// which detaches them first and prints who was detached.
    #[command(visible_alias = "rm")]
    Delete(ProviderDeleteArgs),
}

/// The workspace of a provider or sandbox named (default: "default").
#[derive(Debug, Clone, Args)]
pub struct ScopeArgs {
    /// The workspace (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
}

/// Names one provider: exactly one of NAME (with --workspace) or --id.
#[derive(Debug, Clone, Args)]
#[group(id = "provider_target", required = true, multiple = false)]
pub struct ProviderTarget {
    /// The provider's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub name: Option<String>,
    /// The provider's UUID (authoritative: never falls back to a name).
    #[arg(long, value_name = "UUID")]
    pub id: Option<Uuid>,
}

#[derive(Debug, Clone, Args)]
pub struct ProviderTargetArgs {
    /// The workspace of the provider named (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name, conflicts_with = "id")]
    pub workspace: Option<String>,
    #[command(flatten)]
    pub target: ProviderTarget,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Credentials given as KEY=VALUE and as KEY read from this process's environment.
#[derive(Debug, Clone, Args)]
pub struct CredentialArgs {
    /// A credential, NAME=VALUE (NAME becomes the sandbox's environment variable); repeatable.
    /// The value is visible in `ps` while sbx runs: prefer --credential-env for secrets.
    #[arg(long = "credential", value_name = "NAME=VALUE", value_parser = parse_key_value)]
    pub credentials: Vec<(String, String)>,
    /// A credential whose value is this CLI's own environment variable NAME (the sandbox sees
    /// it under the same name); repeatable. An unset variable is an error.
    #[arg(long = "credential-env", value_name = "NAME")]
    pub credential_env: Vec<String>,
    /// A config entry, KEY=VALUE (not secret: answered as set); repeatable.
    #[arg(long = "config", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub config: Vec<(String, String)>,
}

#[derive(Debug, Clone, Args)]
pub struct ProviderCreateArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The provider's name, unique in its workspace.
    #[arg(value_parser = parse_name)]
    pub name: String,
    /// What the credentials are for: generic, github, openai, anthropic, … (a DNS label).
    #[arg(long = "type", value_name = "TYPE")]
    pub kind: String,
    #[command(flatten)]
    pub values: CredentialArgs,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ProviderListArgs {
    /// The workspace to list (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// List the providers of every workspace.
    #[arg(short = 'A', long, conflicts_with = "workspace")]
    pub all_workspaces: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct ProviderUpdateArgs {
    #[command(flatten)]
    pub target: ProviderTargetArgs,
    #[command(flatten)]
    pub values: CredentialArgs,
    /// A credential to remove, by name; repeatable.
    #[arg(long = "remove-credential", value_name = "NAME")]
    pub remove_credentials: Vec<String>,
    /// A config entry to remove, by key; repeatable.
    #[arg(long = "remove-config", value_name = "KEY")]
    pub remove_config: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct ProviderDeleteArgs {
    #[command(flatten)]
    pub target: ProviderTargetArgs,
    /// Detach every sandbox using the provider first (each is printed), then delete it.
    #[arg(long)]
    pub force: bool,
}

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

/// One sandbox, by name.
#[derive(Debug, Clone, Args)]
pub struct SandboxArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    #[command(flatten)]
    pub output: OutputArgs,
}

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

// ---------------------------------------------------------------------------------------------
// Requests (pure)

pub(super) fn sandbox_by_name(scope: &ScopeArgs, name: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: String::new(),
        workspace: scope.workspace.clone().unwrap_or_default(),
        name: name.to_string(),
    })
}

pub fn provider_ref(args: &ProviderTargetArgs) -> ProviderRef {
    match (&args.target.id, &args.target.name) {
        (Some(id), _) => ProviderRef {
            id: id.to_string(),
            ..Default::default()
        },
        (None, name) => ProviderRef {
            id: String::new(),
            workspace: args.workspace.clone().unwrap_or_default(),
            name: name.clone().unwrap_or_default(),
        },
    }
}

/// The credentials of `args`: the KEY=VALUE ones and, for each --credential-env NAME, the
/// value of `env(NAME)` (an unset one is an error naming it). A name given twice is refused.
pub fn credentials(
    args: &CredentialArgs,
    env: impl Fn(&str) -> Option<String>,
) -> Result<HashMap<String, String>, CliError> {
    let mut pairs = args.credentials.clone();
    for name in &args.credential_env {
        let value = env(name).ok_or_else(|| {
            CliError::Usage(format!(
                "--credential-env {name}: the environment variable {name} is not set"
            ))
        })?;
        pairs.push((name.clone(), value));
    }
    key_value_map("--credential", &pairs)
}

fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

pub fn create_provider_request(
    args: &ProviderCreateArgs,
    env: impl Fn(&str) -> Option<String>,
) -> Result<CreateProviderRequest, CliError> {
    Ok(CreateProviderRequest {
        workspace: args.scope.workspace.clone().unwrap_or_default(),
        name: args.name.clone(),
        r#type: args.kind.clone(),
        credentials: credentials(&args.values, env)?,
        config: key_value_map("--config", &args.values.config)?,
    })
}

pub fn update_provider_request(
    args: &ProviderUpdateArgs,
    env: impl Fn(&str) -> Option<String>,
) -> Result<UpdateProviderRequest, CliError> {
    Ok(UpdateProviderRequest {
        provider: Some(provider_ref(&args.target)),
        set_credentials: credentials(&args.values, env)?,
        remove_credentials: args.remove_credentials.clone(),
        set_config: key_value_map("--config", &args.values.config)?,
        remove_config: args.remove_config.clone(),
    })
}

// ---------------------------------------------------------------------------------------------
// Output (pure)

/// A provider as printed in JSON and YAML: credential names and fingerprints, never values
/// (the gateway sends none).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProviderView {
    pub id: String,
    pub name: String,
    pub workspace: String,
    pub workspace_id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub credentials: Vec<CredentialView>,
    pub config: BTreeMap<String, String>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub resource_version: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CredentialView {
    pub name: String,
    pub fingerprint: String,
}

pub fn provider_view(p: &Provider) -> ProviderView {
    ProviderView {
        id: p.id.clone(),
        name: p.name.clone(),
        workspace: p.workspace.clone(),
        workspace_id: p.workspace_id.clone(),
        kind: p.r#type.clone(),
        credentials: p
            .credentials
            .iter()
            .map(|c| CredentialView {
                name: c.name.clone(),
                fingerprint: c.fingerprint.clone(),
            })
            .collect(),
        config: p
            .config
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        created_at: rfc3339(p.created_at.as_ref()),
        updated_at: rfc3339(p.updated_at.as_ref()),
        resource_version: p.resource_version,
    }
}

pub const PROVIDER_COLUMNS: &[&str] = &["NAME", "TYPE", "CREDENTIALS", "AGE"];

pub fn render_providers(
    style: impl Into<Style>,
    providers: &[Provider],
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        providers,
        ("provider", |p| &p.name),
        |rows| {
            let rows: Vec<Vec<String>> = rows
                .iter()
                .map(|p| {
                    let names: Vec<&str> = p.credentials.iter().map(|c| c.name.as_str()).collect();
                    vec![
                        p.name.clone(),
                        p.r#type.clone(),
                        dash_if_empty(&names.join(",")),
                        age(now, p.created_at.as_ref()),
                    ]
                })
                .collect();
            render_table(PROVIDER_COLUMNS, &rows, style)
        },
        provider_view,
    )
}

/// One object: JSON or YAML of its view, else the list rendering of it alone.
fn render_one<T, V: Serialize>(
    style: impl Into<Style>,
    item: &T,
    view: fn(&T) -> V,
    list: impl Fn(Style, &[T]) -> Result<String, CliError>,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &view(item)),
        _ => list(style, std::slice::from_ref(item)),
    }
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

/// What a delete (or detach) answers in JSON and YAML.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RemovedView {
    pub deleted: bool,
    /// The sandboxes a forced provider delete detached, as workspace/name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub detached: Vec<String>,
}

/// A delete's answer: in table mode a sentence about `what` (and one line per sandbox a
/// forced delete detached), else JSON or YAML.
pub fn render_removed(
    style: impl Into<Style>,
    removed: &RemovedView,
    what: &str,
    verb: &str,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, removed),
        _ => {
            let mut out = String::new();
            for who in &removed.detached {
                out.push_str(&format!("detached from sandbox {who}\n"));
            }
            if removed.deleted {
                out.push_str(&format!("{what} {verb}\n"));
            } else {
                out.push_str(&format!("{what} not found; nothing {verb}\n"));
            }
            Ok(out)
        }
    }
}

fn describe_sandbox(scope: &ScopeArgs, name: &str) -> String {
    format!(
        "sandbox {name:?} in workspace {:?}",
        scope.workspace.as_deref().unwrap_or("default")
    )
}

/// Prints the answer of a delete (or detach) of something of a sandbox: `what` ("setting
/// \"k\" of") and the sandbox, then whether it was `verb`.
fn print_removed(
    output: &OutputArgs,
    deleted: bool,
    what: &str,
    scope: &ScopeArgs,
    sandbox: &str,
    verb: &str,
) -> Result<(), CliError> {
    let removed = RemovedView {
        deleted,
        detached: Vec::new(),
    };
    let what = format!("{what} {}", describe_sandbox(scope, sandbox));
    print(&render_removed(output, &removed, &what, verb)?)
}

fn describe_provider(r: &ProviderRef) -> String {
    if !r.id.is_empty() {
        format!("provider {}", r.id)
    } else {
        format!(
            "provider {:?} in workspace {:?}",
            r.name,
            sbx_proto::names::workspace_or_default(&r.workspace)
        )
    }
}

// ---------------------------------------------------------------------------------------------
// Running

pub async fn run_provider(target: &Target, cmd: ProviderCommand) -> Result<u8, CliError> {
    let now = SystemTime::now();
    match cmd {
        ProviderCommand::Create(args) => {
            let req = create_provider_request(&args, process_env)?;
            let mut client = ProviderServiceClient::new(connect(target).await?);
            let made = client.create_provider(req).await?.into_inner();
            print(&render_one(&args.output, &made, provider_view, |s, p| {
                render_providers(s, p, now)
            })?)?;
        }
        ProviderCommand::Get(args) => {
            let req = GetProviderRequest {
                provider: Some(provider_ref(&args)),
            };
            let mut client = ProviderServiceClient::new(connect(target).await?);
            let found = client.get_provider(req).await?.into_inner();
            print(&render_one(&args.output, &found, provider_view, |s, p| {
                render_providers(s, p, now)
            })?)?;
        }
        ProviderCommand::List(args) => {
            let client = ProviderServiceClient::new(connect(target).await?);
            let providers = collect_pages(|page_token| {
                let mut client = client.clone();
                let req = ListProvidersRequest {
                    workspace: args.workspace.clone().unwrap_or_default(),
                    all_workspaces: args.all_workspaces,
                    page_size: 0,
                    page_token,
                };
                async move {
                    let page = client.list_providers(req).await?.into_inner();
                    Ok((page.providers, page.next_page_token))
                }
            })
            .await?;
            print_list(
                &render_providers(&args.output, &providers, now)?,
                "No providers found.",
            )?;
        }
        ProviderCommand::Update(args) => {
            let req = update_provider_request(&args, process_env)?;
            let mut client = ProviderServiceClient::new(connect(target).await?);
            let updated = client.update_provider(req).await?.into_inner();
            print(&render_one(
                &args.target.output,
                &updated,
                provider_view,
                |s, p| render_providers(s, p, now),
            )?)?;
        }
        ProviderCommand::Delete(args) => {
            let provider = provider_ref(&args.target);
            let what = describe_provider(&provider);
            let req = DeleteProviderRequest {
                provider: Some(provider),
                force: args.force,
            };
            let mut client = ProviderServiceClient::new(connect(target).await?);
            let answer = client.delete_provider(req).await?.into_inner();
            let removed = RemovedView {
                deleted: answer.deleted,
                detached: answer.detached,
            };
            print(&render_removed(
                &args.target.output,
                &removed,
                &what,
                "deleted",
            )?)?;
        }
    }
    Ok(0)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn cred_args(pairs: &[(&str, &str)], env: &[&str]) -> CredentialArgs {
        CredentialArgs {
            credentials: pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            credential_env: env.iter().map(|s| s.to_string()).collect(),
            config: Vec::new(),
        }
    }

    #[test]
    fn credential_env_reads_the_named_variable_and_refuses_an_unset_or_repeated_one() {
        let env = |name: &str| (name == "TOKEN").then(|| "s3cret".to_string());
        let got = credentials(&cred_args(&[("A", "1")], &["TOKEN"]), env).unwrap();
        assert_eq!(got.get("TOKEN").map(String::as_str), Some("s3cret"));
        assert_eq!(got.get("A").map(String::as_str), Some("1"));
        let unset = credentials(&cred_args(&[], &["NOPE"]), env).unwrap_err();
        assert!(unset.to_string().contains("NOPE"), "{unset}");
        let twice = credentials(&cred_args(&[("TOKEN", "x")], &["TOKEN"]), env).unwrap_err();
        assert!(twice.to_string().contains("TOKEN"), "{twice}");
    }

    #[test]
    fn provider_tables_show_credential_names_and_json_never_a_value() {
        let p = Provider {
            name: "gh".into(),
            r#type: "github".into(),
            credentials: vec![
                sbx_proto::v1::CredentialInfo {
                    name: "GH_TOKEN".into(),
                    fingerprint: "0123456789abcdef".into(),
                },
                sbx_proto::v1::CredentialInfo {
                    name: "OTHER".into(),
                    fingerprint: "fedcba9876543210".into(),
                },
            ],
            ..Default::default()
        };
        let table = render_providers(
            OutputFormat::Table,
            std::slice::from_ref(&p),
            SystemTime::now(),
        )
        .unwrap();
        let mut lines = table.lines();
        let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(header, PROVIDER_COLUMNS);
        let row: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
        assert_eq!(row[..3], ["gh", "github", "GH_TOKEN,OTHER"]);
        let json = render_one(OutputFormat::Json, &p, provider_view, |s, p| {
            render_providers(s, p, SystemTime::now())
        })
        .unwrap();
        let v: serde_json::Value = serde_json::from_str(&json).unwrap();
        assert_eq!(v["type"], "github");
        assert_eq!(v["credentials"][0]["fingerprint"], "0123456789abcdef");
    }

    #[test]
    fn a_forced_delete_names_each_detached_sandbox() {
        let removed = RemovedView {
            deleted: true,
            detached: vec!["default/a".into(), "default/b".into()],
        };
        let text =
            render_removed(OutputFormat::Table, &removed, "provider \"p\"", "deleted").unwrap();
        assert_eq!(
            text,
            "detached from sandbox default/a\ndetached from sandbox default/b\nprovider \"p\" deleted\n"
        );
        let none = RemovedView {
            deleted: false,
            detached: Vec::new(),
        };
        let text = render_removed(OutputFormat::Table, &none, "setting \"k\"", "deleted").unwrap();
        assert!(text.contains("not found"), "{text}");
    }
}
