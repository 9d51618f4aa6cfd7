//! What many nouns take on the command line: names (checked by the gateway's own rule),
//! `KEY=VALUE` pairs, and a sandbox named within a workspace (`-w WORKSPACE NAME`), as the
//! commands of the things a sandbox owns (providers, settings, services, network, stats,
//! events) name it.

use std::collections::HashMap;

use clap::Args;
use sbx_proto::v1::SandboxRef;

use super::CliError;
use super::output::OutputArgs;

/// A clap value parser: a DNS-1123 label, checked with the same rule (and rule text) the
/// gateway uses.
pub fn parse_name(input: &str) -> Result<String, CliError> {
    sbx_proto::names::validate_name(input).map_err(|source| CliError::InvalidName { source })?;
    Ok(input.to_string())
}

/// A clap value parser for `KEY=VALUE`: split at the first `=`; the key must not be empty, the
/// value may be (and may itself contain `=`).
pub fn parse_key_value(input: &str) -> Result<(String, String), CliError> {
    match input.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_string(), value.to_string())),
        _ => Err(CliError::InvalidKeyValue {
            input: input.to_string(),
        }),
    }
}

/// Collects `KEY=VALUE` pairs into a map, refusing a key given twice (`flag` names the option
/// in the error).
pub fn key_value_map(
    flag: &'static str,
    pairs: &[(String, String)],
) -> Result<HashMap<String, String>, CliError> {
    let mut map = HashMap::with_capacity(pairs.len());
    for (key, value) in pairs {
        if map.insert(key.clone(), value.clone()).is_some() {
            return Err(CliError::DuplicateKey {
                flag,
                key: key.clone(),
            });
        }
    }
    Ok(map)
}

/// The workspace of a provider or sandbox named (default: "default").
#[derive(Debug, Clone, Args)]
pub struct ScopeArgs {
    /// The workspace (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
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

/// The reference sent for the sandbox NAME in `scope`'s workspace.
pub fn sandbox_by_name(scope: &ScopeArgs, name: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: String::new(),
        workspace: scope.workspace.clone().unwrap_or_default(),
        name: name.to_string(),
    })
}

/// How the sandbox NAME in `scope`'s workspace reads in messages.
pub fn describe_sandbox(scope: &ScopeArgs, name: &str) -> String {
    format!(
        "sandbox {name:?} in workspace {:?}",
        scope.workspace.as_deref().unwrap_or("default")
    )
}
