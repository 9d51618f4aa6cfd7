//! `sbx sandbox network get|allow|deny|set`: a sandbox's network and live changes of its
//! egress allowlist; and the `--network`/`--allow` flags a create (and a workspace's default)
//! turns into a policy.

use clap::{Args, Subcommand};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    GetSandboxNetworkRequest, NetworkMode, NetworkPolicy, SandboxNetwork,
    UpdateSandboxNetworkRequest,
};
use serde::Serialize;

use super::view::denial_target;
use crate::CliError;
use crate::args::{SandboxArgs, ScopeArgs, parse_name, sandbox_by_name};
use crate::connect::{Target, connect};
use crate::output::{OutputArgs, OutputFormat, Style, render_structured, render_table};
use crate::reply::print;

/// `sbx sandbox create --network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NetworkModeArg {
    /// Loopback only: the sandbox reaches nothing else.
    None,
    /// An address on the gateway's network, every connection denied but those --allow
    /// admits (needs sbxd serve --network-cidr).
    Policy,
}

/// A policy of mode `policy` with `allow`.
pub fn policy(allow: Vec<String>) -> NetworkPolicy {
    NetworkPolicy {
        mode: NetworkMode::Policy as i32,
        allow,
    }
}

/// `--network` and `--allow` as a policy: `--allow` implies policy; none with `--allow` is
/// a usage error; neither given is `None`.
pub fn mode_and_allow(
    mode: Option<NetworkModeArg>,
    allow: &[String],
) -> Result<Option<NetworkPolicy>, CliError> {
    match (mode, allow.is_empty()) {
        (None, true) => Ok(None),
        (Some(NetworkModeArg::None), true) => Ok(Some(NetworkPolicy {
            mode: NetworkMode::None as i32,
            allow: Vec::new(),
        })),
        (Some(NetworkModeArg::None), false) => Err(CliError::Usage(
            "--allow admits connections, and --network none has none: use --network policy".into(),
        )),
        (Some(NetworkModeArg::Policy) | None, _) => Ok(Some(policy(allow.to_vec()))),
    }
}

/// `sbx sandbox network …`
#[derive(Debug, Subcommand)]
pub enum SandboxNetworkCommand {
    /// Show a sandbox's network: its mode, address, allowlist, and the connection attempts
    /// its policy refused in the last ten minutes (destination, protocol, port, packets).
    Get(SandboxArgs),
    /// Add entries to a networked sandbox's allowlist, live: the workload keeps running and
    /// its open connections keep going; its next new connection meets the new list.
    Allow(NetworkEntriesArgs),
    /// Remove entries from a networked sandbox's allowlist, live (as written when allowed).
    /// Connections already open keep going.
    Deny(NetworkEntriesArgs),
    /// Replace a networked sandbox's allowlist whole, live; with no ENTRY, deny everything.
    Set(NetworkSetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct NetworkEntriesArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// Allowlist entries: CIDR[:PORT[-PORT]][/tcp|/udp] or HOSTNAME[:PORT[-PORT]][/tcp|/udp],
    /// e.g. 10.1.2.3:443, 10.0.0.0/8:8000-8100/tcp, 192.168.5.7 (every port and protocol),
    /// api.example.test:443, *.example.test:443 (every name below example.test).
    #[arg(required = true, value_name = "ENTRY")]
    pub entries: Vec<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct NetworkSetArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// The whole new allowlist (none: deny everything).
    #[arg(value_name = "ENTRY")]
    pub entries: Vec<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// The allowlist after `add` (appended, each once) and `remove` (every equal entry).
pub fn edited(current: &[String], add: &[String], remove: &[String]) -> Vec<String> {
    let mut out: Vec<String> = current
        .iter()
        .filter(|e| !remove.contains(e))
        .cloned()
        .collect();
    for a in add {
        if !out.contains(a) {
            out.push(a.clone());
        }
    }
    out
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DenialView {
    pub destination: String,
    pub protocol: String,
    pub port: u32,
    pub packets: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NetworkView {
    pub sandbox_id: String,
    pub mode: String,
    pub address: String,
    pub gateway: String,
    pub allow: Vec<String>,
    pub denials: Vec<DenialView>,
}

pub fn network_view(n: &SandboxNetwork) -> NetworkView {
    let policy = n.policy.clone().unwrap_or_default();
    let mode = match policy.mode() {
        NetworkMode::Policy => "policy",
        NetworkMode::None | NetworkMode::Unspecified => "none",
    };
    NetworkView {
        sandbox_id: n.sandbox_id.clone(),
        mode: mode.to_string(),
        address: n.address.clone(),
        gateway: n.gateway.clone(),
        allow: policy.allow,
        denials: n
            .denials
            .iter()
            .map(|d| DenialView {
                destination: d.destination.clone(),
                protocol: d.protocol.clone(),
                port: d.port,
                packets: d.packets,
            })
            .collect(),
    }
}

/// The network as text (-o table/wide/name), or JSON/YAML.
pub fn render_network(style: impl Into<Style>, n: &SandboxNetwork) -> Result<String, CliError> {
    let style: Style = style.into();
    let view = network_view(n);
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &view),
        OutputFormat::Name => Ok(format!("{}\n", view.sandbox_id)),
        OutputFormat::Table | OutputFormat::Wide => {
            let dash = |s: &str| {
                if s.is_empty() {
                    "-".to_string()
                } else {
                    s.to_string()
                }
            };
            let mut out = format!("Mode:     {}\n", view.mode);
            if view.mode == "policy" {
                out.push_str(&format!(
                    "Address:  {} (gateway {})\n",
                    dash(&view.address),
                    dash(&view.gateway)
                ));
                if view.allow.is_empty() {
                    out.push_str("Allow:    nothing (every connection is denied)\n");
                } else {
                    out.push_str(&format!("Allow:    {}\n", view.allow.join(", ")));
                }
                if view.denials.is_empty() {
                    out.push_str("Denied:   nothing in the last ten minutes\n");
                } else {
                    out.push_str("Denied (last ten minutes):\n");
                    let rows: Vec<Vec<String>> = view
                        .denials
                        .iter()
                        .map(|d| {
                            vec![
                                d.destination.clone(),
                                d.protocol.clone(),
                                if d.port == 0 {
                                    "-".into()
                                } else {
                                    d.port.to_string()
                                },
                                d.packets.to_string(),
                            ]
                        })
                        .collect();
                    out.push_str(&render_table(
                        &["DESTINATION", "PROTOCOL", "PORT", "PACKETS"],
                        &rows,
                        style,
                    ));
                }
            } else {
                out.push_str("Loopback only: the sandbox reaches nothing else.\n");
            }
            Ok(out)
        }
    }
}

/// The lines `sbx sandbox get` adds for a networked sandbox: its address and allowlist size,
/// and the five most-refused destinations of the last ten minutes.
pub fn summary(network: Result<SandboxNetwork, tonic::Status>) -> String {
    let n = match network {
        Ok(n) => network_view(&n),
        Err(e) => {
            return format!(
                "NETWORK: policy (its state could not be read: {})\n",
                e.message()
            );
        }
    };
    let mut out = format!(
        "NETWORK: policy, address {}, {} allow entries\n",
        if n.address.is_empty() {
            "-"
        } else {
            &n.address
        },
        n.allow.len()
    );
    if n.denials.is_empty() {
        out.push_str("DENIED: nothing in the last ten minutes\n");
    } else {
        let shown: Vec<String> = n
            .denials
            .iter()
            .take(5)
            .map(|d| {
                format!(
                    "{} ({} packets)",
                    denial_target(&d.destination, d.port, &d.protocol),
                    d.packets
                )
            })
            .collect();
        let more = n.denials.len().saturating_sub(5);
        out.push_str(&format!(
            "DENIED (last ten minutes): {}{}\n",
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more (sbx sandbox network get)")
            } else {
                String::new()
            }
        ));
    }
    out
}

pub async fn run_sandbox_network(
    target: &Target,
    cmd: SandboxNetworkCommand,
) -> Result<u8, CliError> {
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let (scope, sandbox, output, change) = match cmd {
        SandboxNetworkCommand::Get(a) => (a.scope, a.sandbox, a.output, None),
        SandboxNetworkCommand::Allow(a) => (
            a.scope,
            a.sandbox,
            a.output,
            Some((a.entries, false, false)),
        ),
        SandboxNetworkCommand::Deny(a) => {
            (a.scope, a.sandbox, a.output, Some((a.entries, true, false)))
        }
        SandboxNetworkCommand::Set(a) => {
            (a.scope, a.sandbox, a.output, Some((a.entries, false, true)))
        }
    };
    let sandbox_ref = sandbox_by_name(&scope, &sandbox);
    let current = client
        .get_sandbox_network(GetSandboxNetworkRequest {
            sandbox: sandbox_ref.clone(),
        })
        .await?
        .into_inner();
    let shown = match change {
        None => current,
        Some((entries, remove, replace)) => {
            let now = current.policy.clone().unwrap_or_default().allow;
            let allow = if replace {
                entries
            } else if remove {
                let missing: Vec<&String> = entries.iter().filter(|e| !now.contains(e)).collect();
                if !missing.is_empty() {
                    return Err(CliError::Usage(format!(
                        "not in the allowlist of {sandbox:?} (as written there): {} (see sbx sandbox network get)",
                        missing
                            .iter()
                            .map(|s| s.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
                edited(&now, &[], &entries)
            } else {
                edited(&now, &entries, &[])
            };
            client
                .update_sandbox_network(UpdateSandboxNetworkRequest {
                    sandbox: sandbox_ref,
                    policy: Some(policy(allow)),
                })
                .await?
                .into_inner()
        }
    };
    print(&render_network(&output, &shown)?)?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_appends_once_and_deny_removes() {
        let now = vec!["10.0.0.1:80".to_string(), "10.0.0.2".to_string()];
        assert_eq!(
            edited(&now, &["10.0.0.1:80".into(), "10.0.0.3:443".into()], &[]),
            vec!["10.0.0.1:80", "10.0.0.2", "10.0.0.3:443"]
        );
        assert_eq!(edited(&now, &[], &["10.0.0.2".into()]), vec!["10.0.0.1:80"]);
    }
}
