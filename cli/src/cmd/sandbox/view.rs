//! How a sandbox shows: its table row (and `-o wide`), the lines `sbx sandbox get` adds (limits,
//! image, network, refusals, lifetime), and the flat view JSON and YAML print. Pure: the
//! current time is a parameter.

use std::collections::BTreeMap;
use std::time::SystemTime;

use sbx_proto::v1::{Phase, Sandbox};
use serde::Serialize;

use crate::CliError;
use crate::error::say_once;
use crate::lifetime::{self, LifetimeView, lifetime_view};
use crate::output::{
    OutputFormat, Style, age, columns, dash_if_empty, desired_state_name, labels_cell, limits_text,
    phase_name, render_list, render_structured, render_table, rfc3339, sorted, truncate,
};

/// A sandbox as printed in JSON and YAML: flat, with enums as CamelCase words and timestamps as
/// RFC 3339 strings, so scripts need not know protobuf conventions.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SandboxView {
    pub id: String,
    pub name: String,
    pub workspace: String,
    pub workspace_id: String,
    pub phase: String,
    pub desired_state: String,
    pub reason: String,
    pub message: String,
    pub generation: u64,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub resource_version: u64,
    /// Sorted (BTreeMap) so that output is stable from run to run.
    pub labels: BTreeMap<String, String>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub image: String,
    /// The manifest digest the gateway pinned at create (drivers with images).
    pub image_digest: String,
    pub driver: String,
    /// The node it runs on ("local": the gateway's own drivers) and that node's id (empty
    /// for local); absent for a sandbox made before nodes.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub node: String,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub node_id: String,
    pub cpu_millis: u32,
    pub memory_bytes: u64,
    pub disk_bytes: u64,
    /// Egress its policy refused in the last ten minutes (absent when none).
    #[serde(skip_serializing_if = "is_zero")]
    pub network_denied: u64,
    /// The most recent refused destination, `DEST:PORT/PROTO`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub network_last_denial: Option<String>,
    /// What the host refused it past its budgets (absent when nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_refusals: Option<RefusalsView>,
    /// Its lifetime (absent: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lifetime: Option<LifetimeView>,
    /// The ttl's deadline (absent: none).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// What the gateway does by itself next: `{action, at, reason}` (absent: nothing).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<NextView>,
    /// How the main process ended, once it ended by itself: its exit code (-1 when a signal
    /// killed it) and that signal (absent: it runs, or never ended by itself).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub exit_code: Option<i32>,
    #[serde(skip_serializing_if = "is_zero_i32")]
    pub exit_signal: i32,
}

/// `Sandbox.next` as JSON/YAML shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NextView {
    pub action: String,
    pub at: Option<String>,
    pub reason: String,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

fn is_zero_i32(n: &i32) -> bool {
    *n == 0
}

pub fn sandbox_view(sandbox: &Sandbox) -> SandboxView {
    let spec = sandbox.spec.clone().unwrap_or_default();
    let resources = spec.resources.unwrap_or_default();
    SandboxView {
        id: sandbox.id.clone(),
        name: sandbox.name.clone(),
        workspace: sandbox.workspace.clone(),
        workspace_id: sandbox.workspace_id.clone(),
        phase: phase_name(sandbox.phase),
        desired_state: desired_state_name(sandbox.desired_state),
        reason: sandbox.reason.clone(),
        message: sandbox.message.clone(),
        generation: sandbox.generation,
        created_at: rfc3339(sandbox.created_at.as_ref()),
        updated_at: rfc3339(sandbox.updated_at.as_ref()),
        resource_version: sandbox.resource_version,
        labels: sorted(&spec.labels),
        command: spec.command,
        env: sorted(&spec.env),
        image: spec.image,
        image_digest: spec.image_digest,
        driver: spec.driver,
        node: sandbox.node.clone(),
        node_id: sandbox.node_id.clone(),
        cpu_millis: resources.cpu_millis,
        memory_bytes: resources.memory_bytes,
        disk_bytes: resources.disk_bytes,
        network_denied: sandbox.network_denied,
        network_last_denial: sandbox
            .network_last_denial
            .as_ref()
            .map(|d| denial_target(&d.destination, d.port, &d.protocol)),
        budget_refusals: sandbox.budget_refusals.as_ref().map(|r| RefusalsView {
            ptys: r.ptys,
            pids: r.pids,
            dns_queries: r.dns_queries,
            connections: r.connections,
        }),
        lifetime: spec.lifetime.as_ref().map(lifetime_view),
        expires_at: rfc3339(sandbox.expires_at.as_ref()),
        next: sandbox.next.as_ref().map(|n| NextView {
            action: n.action.clone(),
            at: rfc3339(n.at.as_ref()),
            reason: n.reason.clone(),
        }),
        exit_code: sandbox.exit_code,
        exit_signal: sandbox.exit_signal,
    }
}

/// How many characters of an Error sandbox's message the REASON column shows (the whole one
/// is in `sbx sandbox get -o yaml`).
pub const MESSAGE_WIDTH: usize = 60;

/// The REASON cell: the reason, and for a sandbox in Error its message (truncated to
/// [`MESSAGE_WIDTH`]), since the reason alone often only repeats the phase; `-` when empty.
pub fn reason_cell(sandbox: &Sandbox) -> String {
    let phase = phase_name(sandbox.phase);
    let reason = if sandbox.reason.eq_ignore_ascii_case(&phase) {
        ""
    } else {
        sandbox.reason.as_str()
    };
    let text = if sandbox.phase == Phase::Error as i32 && !sandbox.message.is_empty() {
        if reason.is_empty() {
            sandbox.message.clone()
        } else {
            format!("{reason}: {}", sandbox.message)
        }
    } else {
        reason.to_string()
    };
    dash_if_empty(&truncate(&say_once(&text), MESSAGE_WIDTH))
}

pub const SANDBOX_COLUMNS: &[&str] = &["WORKSPACE", "NAME", "ID", "PHASE", "REASON", "GEN", "AGE"];
/// `-o wide` adds these after [`SANDBOX_COLUMNS`].
pub const SANDBOX_WIDE_COLUMNS: &[&str] = &["DRIVER", "IMAGE", "LABELS"];

pub fn sandbox_table(sandboxes: &[Sandbox], now: SystemTime, style: Style) -> String {
    let wide = style.format == OutputFormat::Wide;
    let rows: Vec<Vec<String>> = sandboxes
        .iter()
        .map(|s| {
            let mut row = vec![
                dash_if_empty(&s.workspace),
                s.name.clone(),
                s.id.clone(),
                phase_name(s.phase),
                reason_cell(s),
                s.generation.to_string(),
                age(now, s.created_at.as_ref()),
            ];
            if wide {
                let spec = s.spec.clone().unwrap_or_default();
                row.push(dash_if_empty(&spec.driver));
                row.push(dash_if_empty(&spec.image));
                row.push(labels_cell(&spec.labels));
            }
            row
        })
        .collect();
    render_table(
        &columns(style, SANDBOX_COLUMNS, SANDBOX_WIDE_COLUMNS),
        &rows,
        style,
    )
}

/// One sandbox: in table mode the list's columns and, when the sandbox runs an image, an
/// `IMAGE` line with the reference and the pinned digest.
pub fn render_sandbox(
    style: impl Into<Style>,
    sandbox: &Sandbox,
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Table | OutputFormat::Wide => {
            let mut out = sandbox_table(std::slice::from_ref(sandbox), now, style);
            let spec = sandbox.spec.clone().unwrap_or_default();
            if let Some(r) = spec
                .resources
                .as_ref()
                .filter(|r| **r != Default::default())
                && style.headers
            {
                out.push_str(&format!("LIMITS: {}\n", limits_text(r)));
            }
            if !spec.image_digest.is_empty() && style.headers {
                out.push_str(&format!("IMAGE: {} ({})\n", spec.image, spec.image_digest));
            }
            if style.headers {
                out.push_str(&network_lines(sandbox));
                out.push_str(&refusal_lines(sandbox));
                out.push_str(&lifetime::sandbox_lines(sandbox));
            }
            Ok(out)
        }
        OutputFormat::Name => render_sandboxes(style, std::slice::from_ref(sandbox), now),
        OutputFormat::Json | OutputFormat::Yaml => {
            render_structured(style.format, &sandbox_view(sandbox))
        }
    }
}

/// What the host refused a sandbox past its budgets, in `sandbox_view`'s JSON.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct RefusalsView {
    pub ptys: u64,
    pub pids: u64,
    pub dns_queries: u64,
    pub connections: u64,
}

/// What `sbx sandbox get` says of the host's budgets a sandbox ran into (nothing when none):
/// one `REFUSED:` line naming each count and the flag that sets the budget.
pub fn refusal_lines(sandbox: &Sandbox) -> String {
    let Some(r) = sandbox.budget_refusals.as_ref() else {
        return String::new();
    };
    let said: Vec<String> = [
        (r.ptys, "terminals (sbxd --max-ptys)"),
        (r.pids, "processes (sbxd --oci-pids-limit)"),
        (
            r.dns_queries,
            "DNS queries (the resolver's budget per sandbox)",
        ),
        (
            r.connections,
            "new connections (sbxd --network-conntrack-max)",
        ),
    ]
    .into_iter()
    .filter(|(n, _)| *n > 0)
    .map(|(n, what)| format!("{n} {what}"))
    .collect();
    if said.is_empty() {
        return String::new();
    }
    format!(
        "REFUSED: past its budgets on this host: {}\n",
        said.join(", ")
    )
}

/// What `sbx sandbox get` says of a sandbox's network: what it may reach, and what it tried
/// and was refused (a name lookup too), with the command that would admit it.
pub fn network_lines(sandbox: &Sandbox) -> String {
    use sbx_proto::v1::NetworkMode;
    let policy = sandbox
        .spec
        .as_ref()
        .and_then(|s| s.network.clone())
        .unwrap_or_default();
    let mut out = match policy.mode() {
        NetworkMode::Policy if policy.allow.is_empty() => {
            "NETWORK: an address, no egress (nothing allowed; names resolve to nothing)\n".into()
        }
        NetworkMode::Policy => format!("NETWORK: allows {}\n", policy.allow.join(", ")),
        _ => "NETWORK: none: loopback only (no address; no name resolves, nothing is reachable)\n"
            .to_string(),
    };
    if sandbox.network_denied > 0 {
        let last = sandbox
            .network_last_denial
            .as_ref()
            .map(|d| {
                let target = denial_target(&d.destination, d.port, &d.protocol);
                let host = sanitize(&d.destination);
                format!(
                    ", last {target}: not in its allowlist (admit it: sbx sandbox network allow {} {host}:PORT)",
                    sandbox.name
                )
            })
            .unwrap_or_default();
        out.push_str(&format!(
            "DENIED: {} in the last 10 minutes{last}\n",
            sandbox.network_denied
        ));
    }
    out
}

/// A list: a table (empty string when there are no rows, so the caller can say so),
/// `sandbox/NAME` lines, or a JSON array / YAML sequence (`[]` when empty).
pub fn render_sandboxes(
    style: impl Into<Style>,
    sandboxes: &[Sandbox],
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        sandboxes,
        ("sandbox", |s| &s.name),
        |rows| sandbox_table(rows, now, style),
        sandbox_view,
    )
}

/// `text` with every control character shown as `?` (what a sandbox chose to be named in a
/// refused DNS query must not drive the operator's terminal).
fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// A refused destination as `DEST:PORT/PROTO` (`DEST/PROTO` without a port).
pub fn denial_target(destination: &str, port: u32, protocol: &str) -> String {
    let (dest, proto) = (sanitize(destination), sanitize(protocol));
    if port == 0 {
        format!("{dest}/{proto}")
    } else {
        format!("{dest}:{port}/{proto}")
    }
}
