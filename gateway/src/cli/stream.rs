//! Passing server streams through: exec output, logs, watch events.

use std::io::Write;

use sbx_proto::v1::exec_input::Input;
use sbx_proto::v1::exec_output::Chunk;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    ExecExit, ExecInput, ExecOutput, ExecRequest, LogsRequest, WatchSandboxesRequest,
};
use tonic::transport::Channel;

use super::output::{Style, render_event, watch_header};
use super::{CliError, OutputFormat};

/// The CLI's exit code for a finished exec: killed by signal N → 128+N; else the command's
/// code. Codes a Unix process cannot have are mapped so they never read as success: a negative
/// code without a signal → 1, above 255 → 255.
pub fn exec_exit_code(exit: &ExecExit) -> u8 {
    if exit.signal > 0 {
        return u8::try_from(128 + i64::from(exit.signal)).unwrap_or(255);
    }
    match exit.code {
        code if code < 0 => 1,
        code => u8::try_from(code).unwrap_or(255),
    }
}

/// Writes one exec message through: stdout bytes to `out`, stderr bytes to `err`, flushed at
/// once so interactive output appears as it arrives. Returns the exit code on the exit message.
pub fn pass_exec_output(
    message: ExecOutput,
    out: &mut impl Write,
    err: &mut impl Write,
) -> Result<Option<u8>, CliError> {
    match message.chunk {
        Some(Chunk::Stdout(bytes)) => {
            out.write_all(&bytes)?;
            out.flush()?;
            Ok(None)
        }
        Some(Chunk::Stderr(bytes)) => {
            err.write_all(&bytes)?;
            err.flush()?;
            Ok(None)
        }
        Some(Chunk::Exit(exit)) => Ok(Some(exec_exit_code(&exit))),
        // An empty message from a newer gateway: nothing to pass through.
        None => Ok(None),
    }
}

/// Runs the exec and returns the exit code the CLI should end with.
pub async fn exec(
    client: &mut SandboxServiceClient<Channel>,
    request: ExecRequest,
) -> Result<u8, CliError> {
    let start = ExecInput {
        input: Some(Input::Start(request)),
    };
    let mut stream = client.exec(tokio_stream::once(start)).await?.into_inner();
    let mut out = std::io::stdout().lock();
    let mut err = std::io::stderr().lock();
    while let Some(message) = stream.message().await? {
        if let Some(code) = pass_exec_output(message, &mut out, &mut err)? {
            return Ok(code);
        }
    }
    Err(CliError::ExecWithoutExit)
}

/// Copies the workload's output to stdout until the stream ends (never, with `follow`, until
/// interrupted or the sandbox goes away).
pub async fn logs(
    client: &mut SandboxServiceClient<Channel>,
    request: LogsRequest,
) -> Result<u8, CliError> {
    let mut stream = client.logs(request).await?.into_inner();
    let mut out = std::io::stdout().lock();
    while let Some(chunk) = stream.message().await? {
        out.write_all(&chunk.data)?;
        out.flush()?;
    }
    Ok(0)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        let check = |code: i32, signal: i32, expected: u8| {
            assert_eq!(
                exec_exit_code(&ExecExit { code, signal }),
                expected,
                "code {code} signal {signal}"
            );
        };
        check(0, 0, 0);
        check(3, 0, 3);
        check(255, 0, 255);
        check(256, 0, 255);
        check(-1, 9, 137);
        check(-1, 15, 143);
        check(-1, 2, 130);
        check(-1, 0, 1);
        check(-1, 200, 255);
    }

    #[test]
    fn exec_output_is_passed_through_by_stream() {
        let mut out = Vec::new();
        let mut err = Vec::new();
        let messages = [
            Chunk::Stdout(b"hello ".to_vec()),
            Chunk::Stderr(b"oops\n".to_vec()),
            Chunk::Stdout(vec![0xff, b'\n']),
        ];
        for chunk in messages {
            let got = pass_exec_output(ExecOutput { chunk: Some(chunk) }, &mut out, &mut err);
            assert_eq!(got.unwrap(), None);
        }
        assert_eq!(
            pass_exec_output(ExecOutput { chunk: None }, &mut out, &mut err).unwrap(),
            None
        );
        let exit = ExecOutput {
            chunk: Some(Chunk::Exit(ExecExit { code: 7, signal: 0 })),
        };
        assert_eq!(pass_exec_output(exit, &mut out, &mut err).unwrap(), Some(7));
        assert_eq!(out, b"hello \xff\n");
        assert_eq!(err, b"oops\n");
    }
}
