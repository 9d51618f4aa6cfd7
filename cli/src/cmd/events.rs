//! `sbx events` and `sbx sandbox events NAME`: what happened to sandboxes, oldest first, as
//! `kubectl get events` shows it; `--watch` keeps printing new ones.

use std::collections::HashSet;
use std::time::Duration;

use clap::Args;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{Event, ListEventsRequest, SandboxRef};
use serde::Serialize;

use crate::CliError;
use crate::args::{ScopeArgs, parse_name, sandbox_by_name};
use crate::connect::{Channel, Target, connect};
use crate::output::{OutputArgs, OutputFormat, Style, render_structured, render_table, rfc3339};
use crate::reply::{collect_pages, print};

/// How often `--watch` asks for new events.
const WATCH_EVERY: Duration = Duration::from_secs(1);
/// Event ids `--watch` remembers having printed, at most (then it starts again from the
/// events the gateway keeps now).
const MAX_SEEN: usize = 200_000;

#[derive(Debug, Clone, Args)]
pub struct EventsArgs {
    /// The workspace (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name,
          conflicts_with = "all_workspaces")]
    pub workspace: Option<String>,
    /// Every workspace's events (those the caller may see).
    #[arg(short = 'A', long)]
    pub all_workspaces: bool,
    /// Keep printing new events (asking once a second) until interrupted.
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, Args)]
pub struct SandboxEventsArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandbox's name, within --workspace.
    #[arg(value_parser = parse_name)]
    pub sandbox: String,
    /// Keep printing new events (asking once a second) until interrupted.
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EventView {
    pub time: Option<String>,
    #[serde(rename = "type")]
    pub kind: String,
    pub reason: String,
    pub sandbox: String,
    pub sandbox_id: String,
    pub workspace_id: String,
    pub generation: u64,
    pub message: String,
}

pub fn event_view(e: &Event) -> EventView {
    EventView {
        time: rfc3339(e.time.as_ref()),
        kind: e.r#type.clone(),
        reason: e.reason.clone(),
        sandbox: e.sandbox_name.clone(),
        sandbox_id: e.sandbox_id.clone(),
        workspace_id: e.workspace_id.clone(),
        generation: e.generation,
        message: e.message.clone(),
    }
}

/// Events as a table (TIME, TYPE, REASON, SANDBOX, MESSAGE; -o wide adds the generation
/// and the sandbox's id) or JSON/YAML.
pub fn render_events(style: Style, events: &[Event]) -> Result<String, CliError> {
    let views: Vec<EventView> = events.iter().map(event_view).collect();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &views),
        OutputFormat::Name => Ok(views.iter().map(|v| format!("{}\n", v.reason)).collect()),
        OutputFormat::Table | OutputFormat::Wide => {
            let wide = style.format == OutputFormat::Wide;
            let mut headers = vec!["TIME", "TYPE", "REASON", "SANDBOX"];
            if wide {
                headers.extend(["GENERATION", "SANDBOX ID"]);
            }
            headers.push("MESSAGE");
            let rows: Vec<Vec<String>> = views
                .into_iter()
                .map(|v| {
                    let mut row = vec![v.time.unwrap_or_default(), v.kind, v.reason, v.sandbox];
                    if wide {
                        row.extend([v.generation.to_string(), v.sandbox_id]);
                    }
                    row.push(v.message);
                    row
                })
                .collect();
            Ok(render_table(&headers, &rows, style))
        }
    }
}

/// What to list: one sandbox's events, or a workspace's (or every one's) in pages.
enum Source {
    Sandbox(Option<SandboxRef>),
    Workspaces { workspace: String, all: bool },
}

async fn fetch(
    client: &SandboxServiceClient<Channel>,
    source: &Source,
) -> Result<Vec<Event>, CliError> {
    match source {
        Source::Sandbox(sandbox) => Ok(client
            .clone()
            .list_events(ListEventsRequest {
                sandbox: sandbox.clone(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .events),
        Source::Workspaces { workspace, all } => {
            collect_pages(|token| {
                let mut client = client.clone();
                let req = ListEventsRequest {
                    workspace: workspace.clone(),
                    all_workspaces: *all,
                    page_size: 1000,
                    page_token: token,
                    ..Default::default()
                };
                async move {
                    let page = client.list_events(req).await?.into_inner();
                    Ok((page.events, page.next_page_token))
                }
            })
            .await
        }
    }
}

pub async fn run_events(target: &Target, args: EventsArgs) -> Result<u8, CliError> {
    let source = Source::Workspaces {
        workspace: args.workspace.clone().unwrap_or_default(),
        all: args.all_workspaces,
    };
    show(target, source, args.watch, Style::from(&args.output)).await
}

pub async fn run_sandbox_events(target: &Target, args: SandboxEventsArgs) -> Result<u8, CliError> {
    let source = Source::Sandbox(sandbox_by_name(&args.scope, &args.sandbox));
    show(target, source, args.watch, Style::from(&args.output)).await
}

async fn show(target: &Target, source: Source, watch: bool, style: Style) -> Result<u8, CliError> {
    let client = SandboxServiceClient::new(connect(target).await?);
    let events = fetch(&client, &source).await?;
    if !watch {
        if events.is_empty() && matches!(style.format, OutputFormat::Table | OutputFormat::Wide) {
            eprintln!("No events.");
            return Ok(0);
        }
        print(&render_events(style, &events)?)?;
        return Ok(0);
    }
    // Watching: a line (or a JSON object per line) per event, the header once.
    let mut seen: HashSet<String> = HashSet::new();
    let mut first = true;
    let mut batch = events;
    loop {
        let ids: Vec<String> = batch.iter().map(|e| e.id.clone()).collect();
        let fresh: Vec<Event> = batch
            .into_iter()
            .filter(|e| seen.insert(e.id.clone()))
            .collect();
        // Past the bound, only what the gateway keeps now is remembered (after this batch was
        // filtered, so its new events were printed).
        if seen.len() > MAX_SEEN {
            seen = ids.into_iter().collect();
        }
        if !fresh.is_empty() || first {
            let text = match style.format {
                OutputFormat::Json => fresh
                    .iter()
                    .map(|e| serde_json::to_string(&event_view(e)).map(|s| s + "\n"))
                    .collect::<Result<String, _>>()
                    .map_err(|e| CliError::Render(e.to_string()))?,
                OutputFormat::Yaml => fresh
                    .iter()
                    .map(|e| {
                        render_structured(style.format, &event_view(e)).map(|y| format!("---\n{y}"))
                    })
                    .collect::<Result<String, _>>()?,
                _ => render_events(
                    Style {
                        headers: style.headers && first,
                        ..style
                    },
                    &fresh,
                )?,
            };
            print(&text)?;
            first = false;
        }
        tokio::time::sleep(WATCH_EVERY).await;
        batch = fetch(&client, &source).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(reason: &str, kind: &str, message: &str) -> Event {
        Event {
            id: format!("id-{reason}"),
            workspace_id: "w".into(),
            sandbox_id: "s".into(),
            sandbox_name: "web".into(),
            time: Some(sbx_proto::Timestamp {
                seconds: 1_800_000_000,
                nanos: 0,
            }),
            r#type: kind.into(),
            reason: reason.into(),
            message: message.into(),
            generation: 2,
        }
    }

    #[test]
    fn events_are_rows_in_the_order_given_and_json_names_the_type() {
        let events = [
            event("OOMKilled", "Warning", "killed by the memory limit"),
            event("Recovered", "Normal", "recovered from Error"),
        ];
        let table = render_events(OutputFormat::Table.into(), &events).unwrap();
        let lines: Vec<&str> = table.lines().collect();
        assert!(
            lines[0].starts_with("TIME") && lines[0].ends_with("MESSAGE"),
            "{table}"
        );
        assert!(
            lines[1].contains("Warning") && lines[1].contains("OOMKilled"),
            "{table}"
        );
        assert!(lines[2].contains("Recovered") && lines[2].ends_with("recovered from Error"));
        let json: serde_json::Value =
            serde_json::from_str(&render_events(OutputFormat::Json.into(), &events).unwrap())
                .unwrap();
        assert_eq!(json[0]["type"], "Warning");
        assert_eq!(json[1]["reason"], "Recovered");
        assert_eq!(json[1]["time"], "2027-01-15T08:00:00Z");
    }
}
