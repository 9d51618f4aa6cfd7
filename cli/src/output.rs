//! What every noun prints with: the `-o` flag and its formats, aligned tables, JSON and YAML,
//! the names of the API's enums, ages, and the answers of a delete or a removal. Each noun's
//! own views (a sandbox's row, an image's JSON) live with the noun (`cmd/*`) and are made of
//! these. Pure functions: the current time is a parameter, so every rendering is testable as
//! data (`cmd/output_tests.rs`).

use std::collections::{BTreeMap, HashMap};
use std::time::SystemTime;

use clap::{Args, ValueEnum};
use sbx_proto::Timestamp;
use sbx_proto::v1::{DesiredState, Phase, Resources};
use serde::Serialize;

use super::CliError;

/// How a command prints the objects it gets back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormat {
    /// Aligned columns for humans.
    Table,
    /// The table with more columns: driver, image and labels of a sandbox, labels of a
    /// workspace.
    Wide,
    /// `KIND/NAME` per line (`sandbox/web`), as kubectl prints it, for scripts.
    Name,
    /// JSON: one object for one resource, an array for a list, one object per line for watch.
    Json,
    /// YAML, with the same structure as JSON.
    Yaml,
}

/// The `-o/--output` flag, shared by every command that prints an object.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Output format.
    #[arg(short = 'o', long = "output", value_enum, default_value_t = OutputFormat::Table)]
    pub format: OutputFormat,
    /// Leave out the table's header line (-o table and -o wide).
    #[arg(long)]
    pub no_headers: bool,
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
pub fn unknown_enum(value: i32) -> String {
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

/// RFC 3339 in UTC, e.g. `2026-11-29T10:22:22Z` (fractional seconds only when present).
pub fn rfc3339(timestamp: Option<&Timestamp>) -> Option<String> {
    timestamp.map(|t| t.to_string())
}

pub fn sorted(map: &HashMap<String, String>) -> BTreeMap<String, String> {
    map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
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

/// Labels as `k=v,k2=v2`, sorted; `-` when none.
pub fn labels_cell(labels: &HashMap<String, String>) -> String {
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

/// The header of a table, with the wide columns when `style` is wide.
pub fn columns(style: Style, base: &[&'static str], wide: &[&'static str]) -> Vec<&'static str> {
    let mut all = base.to_vec();
    if style.format == OutputFormat::Wide {
        all.extend_from_slice(wide);
    }
    all
}

/// `-o name`: `KIND/NAME` per line, as kubectl prints it.
pub fn name_lines<'a>(kind: &str, names: impl IntoIterator<Item = &'a str>) -> String {
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

/// One object: JSON or YAML of its view, else the list rendering of it alone.
pub fn render_one<T, V: Serialize>(
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
