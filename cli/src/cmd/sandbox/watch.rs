//! `sbx sandbox watch`: sandbox changes as they happen, one line (or JSON object, or YAML
//! document) per event, until interrupted; a broken stream says where to resume.

use std::io::Write;

use clap::Args;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{EventType, SandboxEvent, WatchSandboxesRequest};
use serde::Serialize;

use super::view::{SandboxView, denial_target, sandbox_view};
use crate::CliError;
use crate::args::parse_name;
use crate::connect::{Channel, Target, connect};
use crate::output::{
    OutputArgs, OutputFormat, Style, camel_case_enum, name_lines, phase_name, unknown_enum,
};

#[derive(Debug, Clone, Args)]
pub struct SandboxWatchArgs {
    /// The workspace to watch (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// Watch the sandboxes of every workspace (NAME is then shown as WORKSPACE/NAME).
    #[arg(short = 'A', long, conflicts_with = "workspace")]
    pub all_workspaces: bool,
    /// Only sandboxes whose labels match: "k=v,k2=v2", "k!=v", "k" (present), "!k" (absent).
    #[arg(short = 'l', long, value_name = "SELECTOR")]
    pub selector: Option<String>,
    /// Resume after this resource version (0: first an ADDED event for every current sandbox).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub resource_version: u64,
    #[command(flatten)]
    pub output: OutputArgs,
}

pub fn watch_request(args: &SandboxWatchArgs) -> WatchSandboxesRequest {
    WatchSandboxesRequest {
        workspace: args.workspace.clone().unwrap_or_default(),
        all_workspaces: args.all_workspaces,
        label_selector: args.selector.clone().unwrap_or_default(),
        resource_version: args.resource_version,
    }
}

/// One watch event as printed in JSON and YAML.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SandboxEventView {
    #[serde(rename = "type")]
    pub event_type: String,
    pub resource_version: u64,
    pub sandbox: Option<SandboxView>,
}

pub fn event_type_name(value: i32) -> String {
    EventType::try_from(value)
        .map(|t| camel_case_enum(t.as_str_name(), "EVENT_TYPE_"))
        .unwrap_or_else(|_| unknown_enum(value))
}

pub fn sandbox_event_view(event: &SandboxEvent) -> SandboxEventView {
    SandboxEventView {
        event_type: event_type_name(event.r#type),
        resource_version: event.resource_version,
        sandbox: event.sandbox.as_ref().map(sandbox_view),
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

/// `sbx sandbox watch`.
pub async fn run_watch(target: &Target, args: &SandboxWatchArgs) -> Result<u8, CliError> {
    let req = watch_request(args);
    let mut client = SandboxServiceClient::new(connect(target).await?);
    watch(&mut client, req, (&args.output).into()).await
}

/// Prints one line (table, JSON) or document (YAML) per event until the stream ends.
pub async fn watch(
    client: &mut SandboxServiceClient<Channel>,
    request: WatchSandboxesRequest,
    style: Style,
) -> Result<u8, CliError> {
    let format = style.format;
    let all_workspaces = request.all_workspaces;
    let mut stream = client.watch_sandboxes(request).await?.into_inner();
    let mut out = std::io::stdout().lock();
    if matches!(format, OutputFormat::Table | OutputFormat::Wide) && style.headers {
        out.write_all(watch_header().as_bytes())?;
        out.flush()?;
    }
    // The newest resource version printed, so a broken stream can say where to resume.
    let mut last_seen = 0;
    loop {
        let event = match stream.message().await {
            Ok(Some(event)) => event,
            Ok(None) => return Ok(0),
            Err(status) if last_seen > 0 => {
                return Err(CliError::WatchBroken { last_seen, status });
            }
            Err(status) => return Err(CliError::Rpc(status)),
        };
        out.write_all(render_event(format, &event, all_workspaces)?.as_bytes())?;
        out.flush()?;
        last_seen = last_seen.max(event.resource_version);
    }
}
