//! `sbx sandbox stats [NAME…]`: what sandboxes use, as `docker stats` shows it — CPU (cores
//! and % of the limit), memory against its limit, pids, disk and network — once, following
//! (`--watch`), or as the samples the gateway kept (`--history`).

use std::collections::BTreeMap;
use std::io::Write;

use clap::Args;
use futures::StreamExt;
use sbx_proto::quantity::human_bytes;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    GetSandboxStatsRequest, ListSandboxesRequest, Phase, SandboxStats, SandboxUsageSample,
    WatchSandboxStatsRequest,
};
use serde::Serialize;

use crate::args::{ScopeArgs, parse_name, sandbox_by_name};
use crate::connect::{Channel, Target, connect};
use crate::output::{OutputArgs, OutputFormat, Style, render_structured, render_table, rfc3339};
use crate::reply::{collect_pages, print};
use crate::{CliError, size};

#[derive(Debug, Clone, Args)]
pub struct SandboxStatsArgs {
    #[command(flatten)]
    pub scope: ScopeArgs,
    /// The sandboxes' names, within --workspace (none: every Ready sandbox of it).
    #[arg(value_parser = parse_name, value_name = "NAME")]
    pub sandboxes: Vec<String>,
    /// Keep showing fresh figures every --interval until interrupted (JSON and YAML: one
    /// document per sandbox per interval, a line each with -o json).
    #[arg(long, conflicts_with = "history")]
    pub watch: bool,
    /// With --watch: seconds between figures (or 2s, 1m); at least 1.
    #[arg(long, value_name = "DURATION", default_value_t = 2, value_parser = size::parse_secs)]
    pub interval: u64,
    /// The samples the gateway kept of one sandbox over the last DURATION (10m, 1h), one row
    /// each, oldest first (the gateway keeps one every `sbxd serve --stats-interval` for the
    /// last `--stats-history`).
    #[arg(long, value_name = "DURATION", value_parser = size::parse_secs)]
    pub history: Option<u64>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// One sample as `-o json|yaml` prints it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UsageView {
    pub time: Option<String>,
    pub running: bool,
    pub cpu_cores: f64,
    /// 0: no limit.
    pub cpu_limit_cores: f64,
    /// Of the limit; absent without one.
    pub cpu_percent: Option<f64>,
    pub cpu_seconds_total: f64,
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    pub memory_percent: Option<f64>,
    pub pids: u64,
    pub pids_limit: u64,
    pub disk_used_bytes: Option<u64>,
    pub disk_limit_bytes: Option<u64>,
    pub network_rx_bytes: Option<u64>,
    pub network_tx_bytes: Option<u64>,
    pub oom_kills: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatsView {
    pub sandbox_id: String,
    pub workspace_id: String,
    pub name: String,
    pub current: UsageView,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<UsageView>,
}

fn percent(used: f64, limit: f64) -> Option<f64> {
    (limit > 0.0).then(|| (used / limit * 1000.0).round() / 10.0)
}

pub fn usage_view(s: &SandboxUsageSample) -> UsageView {
    UsageView {
        time: rfc3339(s.time.as_ref()),
        running: s.running,
        cpu_cores: (s.cpu_cores * 1000.0).round() / 1000.0,
        cpu_limit_cores: s.cpu_limit_cores,
        cpu_percent: percent(s.cpu_cores, s.cpu_limit_cores),
        cpu_seconds_total: s.cpu_seconds_total,
        memory_bytes: s.memory_bytes,
        memory_limit_bytes: s.memory_limit_bytes,
        memory_percent: percent(s.memory_bytes as f64, s.memory_limit_bytes as f64),
        pids: s.pids,
        pids_limit: s.pids_limit,
        disk_used_bytes: s.has_disk.then_some(s.disk_used_bytes),
        disk_limit_bytes: s.has_disk.then_some(s.disk_limit_bytes),
        network_rx_bytes: s.has_network.then_some(s.network_rx_bytes),
        network_tx_bytes: s.has_network.then_some(s.network_tx_bytes),
        oom_kills: s.oom_kills,
    }
}

pub fn stats_view(s: &SandboxStats) -> StatsView {
    StatsView {
        sandbox_id: s.sandbox_id.clone(),
        workspace_id: s.workspace_id.clone(),
        name: s.name.clone(),
        current: usage_view(&s.current.unwrap_or_default()),
        history: s.history.iter().map(usage_view).collect(),
    }
}

/// The cells of one sample: CPU, CPU %, MEM USAGE / LIMIT, MEM %, PIDS, DISK, NET RX / TX.
fn cells(u: &UsageView) -> Vec<String> {
    let pct = |p: Option<f64>| p.map_or("-".to_string(), |p| format!("{p:.1}%"));
    let of = |used: u64, limit: u64| {
        if limit == 0 {
            human_bytes(used)
        } else {
            format!("{} / {}", human_bytes(used), human_bytes(limit))
        }
    };
    let disk = match (u.disk_used_bytes, u.disk_limit_bytes) {
        (Some(used), Some(limit)) => of(used, limit),
        _ => "-".to_string(),
    };
    let net = match (u.network_rx_bytes, u.network_tx_bytes) {
        (Some(rx), Some(tx)) => format!("{} / {}", human_bytes(rx), human_bytes(tx)),
        _ => "-".to_string(),
    };
    vec![
        if u.running {
            format!("{:.2}", u.cpu_cores)
        } else {
            "stopped".to_string()
        },
        pct(u.cpu_percent),
        of(u.memory_bytes, u.memory_limit_bytes),
        pct(u.memory_percent),
        u.pids.to_string(),
        disk,
        net,
    ]
}

const COLUMNS: [&str; 7] = [
    "CPU",
    "CPU %",
    "MEM USAGE / LIMIT",
    "MEM %",
    "PIDS",
    "DISK USED / SIZE",
    "NET RX / TX",
];

/// Sandboxes' current figures as a table (one row each, by name) or JSON/YAML.
pub fn render_stats(style: Style, all: &[SandboxStats]) -> Result<String, CliError> {
    let views: Vec<StatsView> = all.iter().map(stats_view).collect();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &views),
        OutputFormat::Name => Ok(views.iter().map(|v| format!("{}\n", v.name)).collect()),
        OutputFormat::Table | OutputFormat::Wide => {
            let mut headers = vec!["NAME"];
            headers.extend(COLUMNS);
            if style.format == OutputFormat::Wide {
                headers.extend(["PIDS LIMIT", "OOM KILLS", "ID"]);
            }
            let rows: Vec<Vec<String>> = views
                .iter()
                .map(|v| {
                    let mut row = vec![v.name.clone()];
                    row.extend(cells(&v.current));
                    if style.format == OutputFormat::Wide {
                        row.push(match v.current.pids_limit {
                            0 => "-".to_string(),
                            n => n.to_string(),
                        });
                        row.push(v.current.oom_kills.to_string());
                        row.push(v.sandbox_id.clone());
                    }
                    row
                })
                .collect();
            Ok(render_table(&headers, &rows, style))
        }
    }
}

/// One sandbox's kept samples, one row each (TIME first), or JSON/YAML of the whole.
pub fn render_history(style: Style, stats: &SandboxStats) -> Result<String, CliError> {
    let view = stats_view(stats);
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(style.format, &view),
        OutputFormat::Name => Ok(format!("{}\n", view.name)),
        OutputFormat::Table | OutputFormat::Wide => {
            let mut headers = vec!["TIME"];
            headers.extend(COLUMNS);
            let rows: Vec<Vec<String>> = view
                .history
                .iter()
                .map(|u| {
                    let mut row = vec![u.time.clone().unwrap_or_default()];
                    row.extend(cells(u));
                    row
                })
                .collect();
            Ok(render_table(&headers, &rows, style))
        }
    }
}

pub async fn run_sandbox_stats(target: &Target, args: SandboxStatsArgs) -> Result<u8, CliError> {
    let style = Style::from(&args.output);
    let client = SandboxServiceClient::new(connect(target).await?);
    if let Some(seconds) = args.history {
        let [name] = args.sandboxes.as_slice() else {
            return Err(CliError::Usage(
                "--history shows one sandbox's samples: name exactly one".to_string(),
            ));
        };
        let stats = client
            .clone()
            .get_sandbox_stats(GetSandboxStatsRequest {
                sandbox: sandbox_by_name(&args.scope, name),
                history_seconds: seconds.clamp(1, u64::from(u32::MAX)) as u32,
            })
            .await?
            .into_inner();
        print(&render_history(style, &stats)?)?;
        return Ok(0);
    }
    let names = if args.sandboxes.is_empty() {
        ready_sandboxes(&client, &args.scope).await?
    } else {
        args.sandboxes.clone()
    };
    if names.is_empty() {
        eprintln!(
            "No Ready sandboxes in workspace {:?}.",
            sbx_proto::names::workspace_or_default(args.scope.workspace.as_deref().unwrap_or(""))
        );
        return Ok(0);
    }
    if !args.watch {
        let reads = names.iter().map(|name| {
            let mut client = client.clone();
            let sandbox = sandbox_by_name(&args.scope, name);
            async move {
                client
                    .get_sandbox_stats(GetSandboxStatsRequest {
                        sandbox,
                        history_seconds: 0,
                    })
                    .await
                    .map(tonic::Response::into_inner)
            }
        });
        let all = futures::future::try_join_all(reads).await?;
        print(&render_stats(style, &all)?)?;
        return Ok(0);
    }
    watch(client, &args, &names, style).await
}

/// Every Ready sandbox of the workspace, by name.
async fn ready_sandboxes(
    client: &SandboxServiceClient<Channel>,
    scope: &ScopeArgs,
) -> Result<Vec<String>, CliError> {
    let sandboxes = collect_pages(|token| {
        let mut client = client.clone();
        let req = ListSandboxesRequest {
            workspace: scope.workspace.clone().unwrap_or_default(),
            page_token: token,
            ..Default::default()
        };
        async move {
            let page = client.list_sandboxes(req).await?.into_inner();
            Ok((page.sandboxes, page.next_page_token))
        }
    })
    .await?;
    Ok(sandboxes
        .iter()
        .filter(|s| s.phase() == Phase::Ready)
        .map(|s| s.name.clone())
        .collect())
}

/// `--watch`: one stream per sandbox; a table is drawn each time every sandbox has a fresh
/// figure (JSON/YAML: each figure as it comes). A sandbox whose stream ends (deleted) is
/// dropped from the table with a line on stderr; sbx ends when none is left.
async fn watch(
    client: SandboxServiceClient<Channel>,
    args: &SandboxStatsArgs,
    names: &[String],
    style: Style,
) -> Result<u8, CliError> {
    let interval_ms = (args.interval.max(1) * 1000).min(3_600_000) as u32;
    let mut streams = Vec::new();
    for name in names {
        let stream = client
            .clone()
            .watch_sandbox_stats(WatchSandboxStatsRequest {
                sandbox: sandbox_by_name(&args.scope, name),
                interval_ms,
            })
            .await?
            .into_inner();
        let name = name.clone();
        streams.push(stream.map(move |item| (name.clone(), item)).boxed());
    }
    let mut merged = futures::stream::select_all(streams);
    let mut latest: BTreeMap<String, SandboxStats> = BTreeMap::new();
    let mut fresh = 0usize;
    let mut live = names.len();
    let clear = std::io::IsTerminal::is_terminal(&std::io::stdout());
    while let Some((name, item)) = merged.next().await {
        match item {
            Ok(stats) => {
                if matches!(style.format, OutputFormat::Json | OutputFormat::Yaml) {
                    let view = stats_view(&stats);
                    let text = if style.format == OutputFormat::Json {
                        serde_json::to_string(&view)
                            .map(|s| s + "\n")
                            .map_err(|e| CliError::Render(e.to_string()))?
                    } else {
                        format!("---\n{}", render_structured(style.format, &view)?)
                    };
                    print(&text)?;
                    continue;
                }
                if latest.insert(name, stats).is_none() {
                    fresh += 1;
                } else {
                    fresh = live;
                }
                if fresh >= live {
                    let all: Vec<SandboxStats> = latest.values().cloned().collect();
                    let table = render_stats(style, &all)?;
                    let mut out = std::io::stdout().lock();
                    if clear {
                        let _ = write!(out, "\x1b[2J\x1b[H");
                    }
                    let _ = out.write_all(table.as_bytes());
                    let _ = out.flush();
                    fresh = 0;
                }
            }
            Err(status) => {
                eprintln!("sbx: {name}: {}", status.message());
                latest.remove(&name);
                live = live.saturating_sub(1);
            }
        }
    }
    Ok(if live == 0 { 1 } else { 0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(name: &str, cores: f64, running: bool) -> SandboxStats {
        SandboxStats {
            sandbox_id: "11111111-1111-4111-8111-111111111111".into(),
            workspace_id: "w".into(),
            name: name.into(),
            current: Some(SandboxUsageSample {
                time: Some(sbx_proto::Timestamp {
                    seconds: 1_800_000_000,
                    nanos: 0,
                }),
                running,
                cpu_cores: cores,
                cpu_limit_cores: 2.0,
                memory_bytes: 100 << 20,
                memory_limit_bytes: 1 << 30,
                pids: 4,
                pids_limit: 512,
                has_disk: true,
                disk_used_bytes: 3 << 20,
                disk_limit_bytes: 1 << 30,
                ..Default::default()
            }),
            history: Vec::new(),
            history_interval_seconds: 5,
        }
    }

    #[test]
    fn a_table_row_shows_cores_percent_of_limits_and_what_is_not_read_as_a_dash() {
        let table = render_stats(OutputFormat::Table.into(), &[stats("web", 1.0, true)]).unwrap();
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[0].starts_with("NAME"), "{table}");
        for cell in [
            "web",
            "1.00",
            "50.0%",
            "100.0MiB / 1.0GiB",
            "9.8%",
            "4",
            "3.0MiB / 1.0GiB",
        ] {
            assert!(lines[1].contains(cell), "{cell:?} not in {:?}", lines[1]);
        }
        assert!(
            lines[1].trim_end().ends_with('-'),
            "no network: a dash: {:?}",
            lines[1]
        );
        let stopped = render_stats(OutputFormat::Table.into(), &[stats("db", 0.0, false)]).unwrap();
        assert!(stopped.contains("stopped"), "{stopped}");
    }

    #[test]
    fn json_has_percentages_only_against_a_limit() {
        let mut s = stats("web", 0.5, true);
        let text = render_stats(OutputFormat::Json.into(), std::slice::from_ref(&s)).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v[0]["current"]["cpu_percent"], 25.0);
        assert_eq!(v[0]["current"]["network_rx_bytes"], serde_json::Value::Null);
        if let Some(c) = s.current.as_mut() {
            c.cpu_limit_cores = 0.0;
        }
        let text = render_stats(OutputFormat::Json.into(), &[s]).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v[0]["current"]["cpu_percent"], serde_json::Value::Null);
    }

    #[test]
    fn the_history_is_one_row_per_sample_with_its_time() {
        let mut s = stats("web", 0.0, true);
        s.history = vec![s.current.unwrap(), s.current.unwrap()];
        let table = render_history(OutputFormat::Table.into(), &s).unwrap();
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(
            table
                .lines()
                .nth(1)
                .unwrap()
                .starts_with("2027-01-15T08:00:00Z"),
            "{table}"
        );
    }
}
