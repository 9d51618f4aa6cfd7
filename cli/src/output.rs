//! From protobuf objects to what the CLI prints: aligned tables, JSON and YAML. Pure functions:
//! the current time is a parameter, so every rendering is testable as data.

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use sbx_proto::Timestamp;
use sbx_proto::v1::{
    DesiredState, EventType, Image, Phase, Resources, Sandbox, SandboxEvent, Workspace,
    WorkspacePhase,
};
use serde::Serialize;

use super::{CliError, OutputArgs, OutputFormat};

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
    pub lifetime: Option<super::lifetime::LifetimeView>,
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

/// One watch event as printed in JSON and YAML.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SandboxEventView {
    #[serde(rename = "type")]
    pub event_type: String,
    pub resource_version: u64,
    pub sandbox: Option<SandboxView>,
}

/// `PHASE_READY` with prefix `PHASE_` → `Ready`; `EVENT_TYPE_ADDED` → `Added`.
pub fn camel_case_enum(full_name: &str, prefix: &str) -> String {
    let bare = full_name.strip_prefix(prefix).unwrap_or(full_name);
    let mut out = String::with_capacity(bare.len());
    for word in bare.split('_').filter(|w| !w.is_empty()) {
        let mut chars = word.chars();
        if let Some(first) = chars.next() {
            out.push(first.to_ascii_uppercase());
            out.extend(chars.map(|c| c.to_ascii_lowercase()));
        }
    }
    out
}

/// A name for an enum number this CLI was built without (a newer gateway).
fn unknown_enum(value: i32) -> String {
    format!("Unknown({value})")
}

pub fn phase_name(value: i32) -> String {
    Phase::try_from(value)
        .map(|p| camel_case_enum(p.as_str_name(), "PHASE_"))
        .unwrap_or_else(|_| unknown_enum(value))
}

pub fn desired_state_name(value: i32) -> String {
    DesiredState::try_from(value)
        .map(|d| camel_case_enum(d.as_str_name(), "DESIRED_STATE_"))
        .unwrap_or_else(|_| unknown_enum(value))
}

pub fn workspace_phase_name(value: i32) -> String {
    WorkspacePhase::try_from(value)
        .map(|p| camel_case_enum(p.as_str_name(), "WORKSPACE_PHASE_"))
        .unwrap_or_else(|_| unknown_enum(value))
}

pub fn event_type_name(value: i32) -> String {
    EventType::try_from(value)
        .map(|t| camel_case_enum(t.as_str_name(), "EVENT_TYPE_"))
        .unwrap_or_else(|_| unknown_enum(value))
}

/// RFC 3339 in UTC, e.g. `2026-11-29T10:22:22Z` (fractional seconds only when present).
pub fn rfc3339(timestamp: Option<&Timestamp>) -> Option<String> {
    timestamp.map(|t| t.to_string())
}

fn sorted(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
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
        lifetime: spec.lifetime.as_ref().map(super::lifetime::lifetime_view),
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

pub fn sandbox_event_view(event: &SandboxEvent) -> SandboxEventView {
    SandboxEventView {
        event_type: event_type_name(event.r#type),
        resource_version: event.resource_version,
        sandbox: event.sandbox.as_ref().map(sandbox_view),
    }
}

/// How long ago `created` was, kubectl style: `45s`, `12m`, `5h`, `3d`; `-` when unknown.
pub fn age(now: SystemTime, created: Option<&Timestamp>) -> String {
    let Some(created) = created else {
        return "-".to_string();
    };
    let now_secs = now
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0);
    let secs = now_secs.saturating_sub(created.seconds).max(0);
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 2 * 3600 => format!("{}m", s / 60),
        s if s < 48 * 3600 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

/// Columns padded to their widest cell (by display width, so wide and combining Unicode
/// characters line up), separated by three spaces, drawn by comfy-table without borders; lines
/// carry no trailing blanks and each ends with a newline. Without `headers` (`--no-headers`)
/// only the rows are drawn.
pub fn render_table(headers: &[&str], rows: &[Vec<String>], style: Style) -> String {
    use comfy_table::{ContentArrangement, Table, presets};
    let mut table = Table::new();
    table
        .load_preset(presets::NOTHING)
        .set_content_arrangement(ContentArrangement::Disabled);
    if style.headers {
        table.set_header(headers.iter().copied());
    }
    for row in rows {
        table.add_row(row.iter().map(String::as_str));
    }
    let last = headers.len().saturating_sub(1);
    for (i, column) in table.column_iter_mut().enumerate() {
        column.set_padding((0, if i == last { 0 } else { 3 }));
    }
    let mut out = String::new();
    if style.headers || !rows.is_empty() {
        for line in table.lines() {
            out.push_str(line.trim_end());
            out.push('\n');
        }
    }
    out
}

/// How a command prints: the `-o` format and whether tables have their header line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Style {
    pub format: OutputFormat,
    /// False with `--no-headers`.
    pub headers: bool,
}

impl From<OutputFormat> for Style {
    fn from(format: OutputFormat) -> Style {
        Style {
            format,
            headers: true,
        }
    }
}

impl From<&OutputArgs> for Style {
    fn from(args: &OutputArgs) -> Style {
        Style {
            format: args.format,
            headers: !args.no_headers,
        }
    }
}

/// At most `max` characters of `text`, the last one `…` when cut.
pub fn truncate(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_string();
    }
    let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
    out.push('…');
    out
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
    dash_if_empty(&truncate(&super::error::say_once(&text), MESSAGE_WIDTH))
}

/// Labels as `k=v,k2=v2`, sorted; `-` when none.
fn labels_cell(labels: &HashMap<String, String>) -> String {
    let joined = sorted(labels)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    dash_if_empty(&joined)
}

pub(crate) fn dash_if_empty(text: &str) -> String {
    if text.is_empty() {
        "-".to_string()
    } else {
        text.to_string()
    }
}

pub const SANDBOX_COLUMNS: &[&str] = &["WORKSPACE", "NAME", "ID", "PHASE", "REASON", "GEN", "AGE"];
/// `-o wide` adds these after [`SANDBOX_COLUMNS`].
pub const SANDBOX_WIDE_COLUMNS: &[&str] = &["DRIVER", "IMAGE", "LABELS"];
pub const WORKSPACE_COLUMNS: &[&str] = &["NAME", "ID", "PHASE", "AGE"];
/// `-o wide` adds these after [`WORKSPACE_COLUMNS`].
pub const WORKSPACE_WIDE_COLUMNS: &[&str] = &["LABELS"];

/// The header of a table, with the wide columns when `style` is wide.
fn columns(style: Style, base: &[&'static str], wide: &[&'static str]) -> Vec<&'static str> {
    let mut all = base.to_vec();
    if style.format == OutputFormat::Wide {
        all.extend_from_slice(wide);
    }
    all
}

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

/// `-o name`: `KIND/NAME` per line, as kubectl prints it.
fn name_lines<'a>(kind: &str, names: impl IntoIterator<Item = &'a str>) -> String {
    names
        .into_iter()
        .map(|name| format!("{kind}/{name}\n"))
        .collect()
}

/// JSON (pretty, with a final newline) or YAML of any view.
pub fn render_structured<T: Serialize>(
    format: OutputFormat,
    value: &T,
) -> Result<String, CliError> {
    match format {
        OutputFormat::Json | OutputFormat::Table | OutputFormat::Wide | OutputFormat::Name => {
            serde_json::to_string_pretty(value)
                .map(|s| s + "\n")
                .map_err(|e| CliError::Render(e.to_string()))
        }
        OutputFormat::Yaml => {
            serde_yaml::to_string(value).map_err(|e| CliError::Render(e.to_string()))
        }
    }
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
                out.push_str(&super::lifetime::sandbox_lines(sandbox));
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

/// A list in `style`: `table(items)` (an empty string when there are no items, so the caller
/// can say so), `KIND/NAME` lines by `name`, or a JSON array / YAML sequence of `view`s.
pub(crate) fn render_list<T, V: Serialize>(
    style: Style,
    items: &[T],
    (kind, name): (&str, fn(&T) -> &str),
    table: impl Fn(&[T]) -> String,
    view: fn(&T) -> V,
) -> Result<String, CliError> {
    match style.format {
        OutputFormat::Table | OutputFormat::Wide if items.is_empty() => Ok(String::new()),
        OutputFormat::Table | OutputFormat::Wide => Ok(table(items)),
        OutputFormat::Name => Ok(name_lines(kind, items.iter().map(name))),
        OutputFormat::Json | OutputFormat::Yaml => {
            render_structured(style.format, &items.iter().map(view).collect::<Vec<_>>())
        }
    }
}

/// The answer of a delete, in JSON and YAML.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeletedView {
    pub deleted: bool,
    /// The id of what was deleted: given with --id, or looked up by name just before the
    /// delete; `None` when nothing was found.
    pub id: Option<String>,
}

/// The answer of a delete: `{"deleted": …, "id": …}`, `KIND/NAME` with `-o name` (nothing
/// when nothing was deleted), or in table mode a sentence about `what` (e.g. `sandbox "web"
/// in workspace "default"`).
pub fn render_deleted(
    style: impl Into<Style>,
    deleted: &DeletedView,
    what: &str,
    kind_name: &str,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Table | OutputFormat::Wide if deleted.deleted => {
            Ok(format!("{what} deleted\n"))
        }
        OutputFormat::Table | OutputFormat::Wide => {
            Ok(format!("{what} not found; nothing deleted\n"))
        }
        OutputFormat::Name if deleted.deleted => Ok(format!("{kind_name}\n")),
        OutputFormat::Name => Ok(String::new()),
        _ => render_structured(style.format, deleted),
    }
}

/// What `sbx image get -o json|yaml` prints.
#[derive(Debug, Clone, Serialize)]
pub struct ImageView {
    pub id: String,
    pub name: String,
    pub digest: String,
    pub size: u64,
    pub os: String,
    pub architecture: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: String,
    pub user: String,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<String>,
    pub layers: Vec<ImageLayerView>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub resource_version: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ImageLayerView {
    pub digest: String,
    pub size: u64,
}

pub fn image_view(image: &Image) -> ImageView {
    let config = image.config.clone().unwrap_or_default();
    ImageView {
        id: image.id.clone(),
        name: image.name.clone(),
        digest: image.digest.clone(),
        size: image.size,
        os: image.os.clone(),
        architecture: image.architecture.clone(),
        entrypoint: config.entrypoint,
        cmd: config.cmd,
        env: config.env,
        working_dir: config.working_dir,
        user: config.user,
        labels: config.labels.into_iter().collect(),
        exposed_ports: config.exposed_ports,
        layers: image
            .layers
            .iter()
            .map(|l| ImageLayerView {
                digest: l.digest.clone(),
                size: l.size,
            })
            .collect(),
        created_at: rfc3339(image.created_at.as_ref()),
        updated_at: rfc3339(image.updated_at.as_ref()),
        resource_version: image.resource_version,
    }
}

/// Bytes for humans (the drivers say sizes the same way).
pub use sbx_proto::quantity::human_bytes;

/// `cpu_millis` as cores for people: `1`, `0.5`, `1.25`.
pub fn cores(millis: u32) -> String {
    let text = format!("{}.{:03}", millis / 1000, millis % 1000);
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// The limits line of a sandbox or a workspace: `cpu 1, memory 1.0GiB, disk 10.0GiB` (`-`
/// for none).
pub fn limits_text(r: &Resources) -> String {
    let cpu = match r.cpu_millis {
        0 => "-".to_string(),
        m => cores(m),
    };
    let memory = match r.memory_bytes {
        0 => "-".to_string(),
        b => human_bytes(b),
    };
    let disk = match r.disk_bytes {
        0 => "-".to_string(),
        b => human_bytes(b),
    };
    format!("cpu {cpu}, memory {memory}, disk {disk}")
}

/// `sha256:` and the first 12 hex digits, as image tables show a digest.
pub fn short_digest(digest: &str) -> String {
    match digest.strip_prefix("sha256:") {
        Some(hex) => format!("sha256:{}", &hex[..hex.len().min(12)]),
        None => digest.to_string(),
    }
}

pub const IMAGE_COLUMNS: &[&str] = &["NAME", "DIGEST", "SIZE", "ID", "AGE"];

pub fn image_table(images: &[Image], now: SystemTime, style: Style) -> String {
    let rows: Vec<Vec<String>> = images
        .iter()
        .map(|i| {
            vec![
                i.name.clone(),
                short_digest(&i.digest),
                human_bytes(i.size),
                i.id.clone(),
                age(now, i.created_at.as_ref()),
            ]
        })
        .collect();
    render_table(IMAGE_COLUMNS, &rows, style)
}

/// Images: a table (`-o wide` shows the same columns), `image/NAME` lines (the digest for an
/// image without a name), or JSON / YAML.
pub fn render_images(
    style: impl Into<Style>,
    images: &[Image],
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        images,
        ("image", |i| {
            if i.name.is_empty() {
                &i.digest
            } else {
                &i.name
            }
        }),
        |rows| image_table(rows, now, style),
        image_view,
    )
}

pub fn render_image(
    style: impl Into<Style>,
    image: &Image,
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => {
            render_structured(style.format, &image_view(image))
        }
        _ => render_images(style, std::slice::from_ref(image), now),
    }
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

/// The header printed once before table-mode watch lines.
pub fn watch_header() -> String {
    format_watch_columns(["TYPE", "NAME", "PHASE", "GEN", "RV"])
}

fn format_watch_columns(cells: [&str; 5]) -> String {
    let [kind, name, phase, generation, rv] = cells;
    format!("{kind:<9} {name:<30} {phase:<13} {generation:<5} {rv}\n")
}

/// One watch event as one line: fixed-width `TYPE NAME PHASE GEN RV` columns in table mode
/// (NAME is `WORKSPACE/NAME` when watching every workspace), one compact JSON object in JSON
/// mode, one YAML document (starting `---`) in YAML mode.
pub fn render_event(
    format: OutputFormat,
    event: &SandboxEvent,
    all_workspaces: bool,
) -> Result<String, CliError> {
    match format {
        OutputFormat::Name => Ok(name_lines(
            "sandbox",
            event.sandbox.as_ref().map(|s| s.name.as_str()),
        )),
        OutputFormat::Table | OutputFormat::Wide => {
            let (name, phase, generation) = match &event.sandbox {
                Some(s) if all_workspaces => (
                    format!("{}/{}", s.workspace, s.name),
                    phase_name(s.phase),
                    s.generation.to_string(),
                ),
                Some(s) => (
                    s.name.clone(),
                    phase_name(s.phase),
                    s.generation.to_string(),
                ),
                None => ("-".into(), "-".into(), "-".into()),
            };
            let mut line = format_watch_columns([
                &event_type_name(event.r#type),
                &name,
                &phase,
                &generation,
                &event.resource_version.to_string(),
            ]);
            // Refused egress, when there is any: after the columns, so the line stays one.
            if let Some(s) = event.sandbox.as_ref().filter(|s| s.network_denied > 0) {
                line.pop();
                line.push_str(&format!("  denied {}", s.network_denied));
                if let Some(d) = &s.network_last_denial {
                    line.push_str(&format!(
                        ", last {}",
                        denial_target(&d.destination, d.port, &d.protocol)
                    ));
                }
                line.push('\n');
            }
            Ok(line)
        }
        OutputFormat::Json => serde_json::to_string(&sandbox_event_view(event))
            .map(|s| s + "\n")
            .map_err(|e| CliError::Render(e.to_string())),
        OutputFormat::Yaml => serde_yaml::to_string(&sandbox_event_view(event))
            .map(|s| format!("---\n{s}"))
            .map_err(|e| CliError::Render(e.to_string())),
    }
}

#[cfg(test)]
#[path = "output_tests.rs"]
mod tests;
