//! `sbx sandbox logs`: a sandbox's workload output, its stdout to stdout and its stderr to
//! stderr, with times, from a time, or followed.

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
use sbx_proto::Timestamp;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{LogChunk, LogStream, LogsRequest};

use super::{SandboxTarget, WorkspaceScope, sandbox_ref};
use crate::connect::{Channel, Target, connect};
use crate::{CliError, size};

#[derive(Debug, Clone, Args)]
pub struct SandboxLogsArgs {
    #[command(flatten)]
    pub scope: WorkspaceScope,
    #[command(flatten)]
    pub target: SandboxTarget,
    /// Keep streaming new output until interrupted.
    #[arg(short = 'f', long)]
    pub follow: bool,
    /// Only the last N lines of the existing output, stdout's and stderr's together (default:
    /// all).
    #[arg(long, value_name = "N")]
    pub tail: Option<u32>,
    /// Begin each line with the time it was logged (RFC 3339, UTC) and a space. A line the
    /// log has no time for gets none: a sandbox init's own words, a vm's console, the output
    /// of a sandbox started before the log had times.
    #[arg(short = 't', long)]
    pub timestamps: bool,
    /// Only output logged since WHEN: a duration ago (30s, 10m, 2h, 1h30m; at most 10 days)
    /// or an RFC 3339 time (2026-03-01T10:00:00Z, 2026-03-01T11:00:00+01:00). Lines the log
    /// has no time for are then left out.
    #[arg(long, value_name = "WHEN", value_parser = parse_since)]
    pub since: Option<Since>,
}

/// `sbx sandbox logs --since`: a time, or how long ago.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Since {
    Ago(Duration),
    At(Timestamp),
}

impl Since {
    /// The time it names, `now` being now (a duration longer ago than 1970 is 1970).
    pub fn at(self, now: SystemTime) -> Timestamp {
        match self {
            Since::At(time) => time,
            Since::Ago(ago) => Timestamp::from(now.checked_sub(ago).unwrap_or(UNIX_EPOCH)),
        }
    }
}

/// Parses `--since`: a duration ago as `--timeout` takes one ([`size::parse_secs`]:
/// `30s`, `10m`, `2h`, `1h30m`, at most 10 days) or an RFC 3339 time.
pub fn parse_since(text: &str) -> Result<Since, String> {
    if let Ok(time) = text.parse::<Timestamp>() {
        return Ok(Since::At(time));
    }
    size::parse_secs(text)
        .map(|secs| Since::Ago(Duration::from_secs(secs)))
        .map_err(|_| {
            format!(
                "{text:?} is neither a duration ago (30s, 10m, 2h, 1h30m; at most 10 days) nor \
                 an RFC 3339 time (2026-03-01T10:00:00Z)"
            )
        })
}

pub fn logs_request(args: &SandboxLogsArgs) -> LogsRequest {
    logs_request_at(args, SystemTime::now())
}

/// [`logs_request`] with `--since DURATION` counted back from `now`.
pub fn logs_request_at(args: &SandboxLogsArgs, now: SystemTime) -> LogsRequest {
    LogsRequest {
        sandbox: Some(sandbox_ref(&args.scope, &args.target)),
        follow: args.follow,
        tail_lines: args.tail.unwrap_or(0),
        timestamps: args.timestamps,
        since: args.since.map(|since| since.at(now)),
    }
}

/// `sbx sandbox logs`.
pub async fn run_logs(target: &Target, args: &SandboxLogsArgs) -> Result<u8, CliError> {
    let req = logs_request(args);
    let mut client = SandboxServiceClient::new(connect(target).await?);
    logs(&mut client, req).await
}

/// Copies the workload's stdout to stdout and its stderr to stderr until the stream ends
/// (never, with `follow`, until interrupted or the sandbox goes away); with `timestamps`,
/// each line begins with its time.
pub async fn logs(
    client: &mut SandboxServiceClient<Channel>,
    request: LogsRequest,
) -> Result<u8, CliError> {
    let mut printer = LogPrinter::new(request.timestamps);
    let mut stream = client.logs(request).await?.into_inner();
    let (mut out, mut err) = (std::io::stdout().lock(), std::io::stderr().lock());
    while let Some(chunk) = stream.message().await? {
        let (sink, bytes) = printer.print(&chunk);
        let sink: &mut dyn Write = match sink {
            LogStream::Stderr => &mut err,
            LogStream::Stdout => &mut out,
        };
        sink.write_all(&bytes)?;
        sink.flush()?;
    }
    Ok(0)
}

/// What `sbx sandbox logs` prints of each chunk, and where.
#[derive(Debug)]
pub struct LogPrinter {
    timestamps: bool,
    /// Per stream (stdout, stderr): the last chunk ended its line.
    at_line_start: [bool; 2],
}

impl LogPrinter {
    pub fn new(timestamps: bool) -> LogPrinter {
        LogPrinter {
            timestamps,
            at_line_start: [true, true],
        }
    }

    /// The stream `chunk` goes to and its bytes, its time first when timestamps are asked
    /// for and it begins a line (a chunk with none gets none).
    pub fn print(&mut self, chunk: &LogChunk) -> (LogStream, Vec<u8>) {
        let stream = LogStream::try_from(chunk.stream).unwrap_or(LogStream::Stdout);
        let start = &mut self.at_line_start[usize::from(stream == LogStream::Stderr)];
        let mut bytes = Vec::with_capacity(chunk.data.len() + 32);
        if self.timestamps
            && *start
            && let Some(time) = &chunk.time
        {
            bytes.extend_from_slice(format!("{time} ").as_bytes());
        }
        bytes.extend_from_slice(&chunk.data);
        if !chunk.data.is_empty() {
            *start = chunk.data.ends_with(b"\n");
        }
        (stream, bytes)
    }
}
