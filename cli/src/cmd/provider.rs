//! `sbx provider …`: the providers of a workspace (ProviderService), named credential sets
//! that sandboxes attach to (`sbx sandbox provider …`, in `cmd/sandbox/provider.rs`).
//!
//! A provider's credentials go to the gateway and never come back: the API answers their
//! names and fingerprints (16 hex digits of an HMAC), so nothing here can print a value.
//! `--credential-env KEY` reads the value from this process's environment, so a secret need
//! not be on a command line (where `ps` shows it).

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::provider_service_client::ProviderServiceClient;
use sbx_proto::v1::{
    CreateProviderRequest, DeleteProviderRequest, GetProviderRequest, ListProvidersRequest,
    Provider, ProviderRef, UpdateProviderRequest,
};
use serde::Serialize;
use uuid::Uuid;

use crate::CliError;
use crate::args::{ScopeArgs, key_value_map, parse_key_value, parse_name};
use crate::connect::{Target, connect};
use crate::output::{
    OutputArgs, RemovedView, Style, age, dash_if_empty, render_list, render_one, render_removed,
    render_table, rfc3339,
};
use crate::reply::{collect_pages, print, print_list};

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::output::OutputFormat;

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
