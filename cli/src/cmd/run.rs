//! `sbx run`: a sandbox as a job, as `docker run` runs a container. It creates the sandbox,
//! prints the workload's stdout and stderr to its own as they come (`Logs`, followed), waits
//! on the watch stream until the workload has ended, prints what the follow had not yet
//! delivered (the log is complete once the gateway reports the end: the drivers drain their
//! loggers before they record the exit), and exits with the main process's exit code (128+N
//! for a signal N), as the record's `exit_code` says. With `--rm` the sandbox is deleted after,
//! however the run ended (also when it failed to start, or on Ctrl-C); without it, it stays
//! Completed or Error for `sbx sandbox get`/`logs`.
//!
//! What the follow printed is counted per stream; after the end the whole log is read once
//! more and only what lies past those counts is printed, so nothing is printed twice or left
//! out (unless the log rotated during the run: `sbxd serve --log-max`, then what came after the
//! follow's last chunk may be missing).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use clap::Args;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    DeleteSandboxRequest, LogChunk, LogStream, LogsRequest, Phase, Sandbox, SandboxRef,
};

use crate::args::{parse_key_value, parse_name};
use crate::cmd::image::{PullPolicy, create_pulling};
use crate::cmd::sandbox::create::{
    SandboxCreateArgs, create_sandbox_request, generate_sandbox_name,
};
use crate::cmd::sandbox::network::NetworkModeArg;
use crate::connect::{Channel, Target, connect};
use crate::output::{OutputArgs, OutputFormat, desired_state_name, phase_name};
use crate::wait::{Goal, NoProgress, Observation, WaitOptions, follow_with};
use crate::{CliError, size};

/// `sbx run`.
#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  sbx run --rm busybox -- sh -c 'echo hi; exit 7'    prints hi, exits 7, leaves nothing
  sbx run -n build --image debian:bookworm -- make    keeps the sandbox (Completed or Error)

Exit status: the main process's; 128+N when a signal N killed it; 127 when the command is not
found; 1 when sbx itself failed or the sandbox failed without an exit (a driver error); 130
after Ctrl-C (the sandbox is left running, or deleted with --rm).")]
pub struct RunArgs {
    /// The image to run (drivers with images; default: the gateway's default image). The
    /// same as --image.
    #[arg(value_name = "IMAGE", conflicts_with = "image_flag")]
    pub image: Option<String>,
    /// The image to run, as an option.
    #[arg(long = "image", id = "image_flag", value_name = "REF")]
    pub image_flag: Option<String>,
    /// When the image is pulled from its registry first: when the store lacks it
    /// (missing), before every run (always), or never.
    #[arg(long, value_enum, value_name = "WHEN", default_value_t = PullPolicy::Missing)]
    pub pull: PullPolicy,
    /// Delete the sandbox once the run ends, however it ends.
    #[arg(long)]
    pub rm: bool,
    /// The workspace to run in (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The sandbox's name (default: "sbx-" + 8 random characters).
    #[arg(short = 'n', long, value_name = "NAME", value_parser = parse_name)]
    pub name: Option<String>,
    /// An environment variable of the workload, KEY=VALUE; repeatable.
    #[arg(short = 'e', long = "env", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub env: Vec<(String, String)>,
    /// A label to set, KEY=VALUE; repeatable.
    #[arg(short = 'l', long = "label", value_name = "KEY=VALUE", value_parser = parse_key_value)]
    pub labels: Vec<(String, String)>,
    /// CPU limit, as `sbx sandbox create --cpu` takes it.
    #[arg(long, value_name = "CPU", value_parser = size::parse_cpu)]
    pub cpu: Option<u32>,
    /// Memory limit, as `sbx sandbox create --memory` takes it.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub memory: Option<u64>,
    /// Disk limit, as `sbx sandbox create --disk` takes it.
    #[arg(long, value_name = "SIZE", value_parser = size::parse_size)]
    pub disk: Option<u64>,
    /// The compute driver (default: the gateway's default driver).
    #[arg(long, value_name = "DRIVER")]
    pub driver: Option<String>,
    /// The network: none (loopback only; the default) or policy (--allow admits).
    #[arg(long, value_enum, value_name = "MODE")]
    pub network: Option<NetworkModeArg>,
    /// With --network policy: admit connections to ENTRY, as `sbx sandbox create --allow`.
    #[arg(long = "allow", value_name = "ENTRY")]
    pub allow: Vec<String>,
    /// Give up waiting for the end after this long (seconds, or 30s, 2m, 1h; 0: never); sbx
    /// then exits 1 and leaves the sandbox running (deleted with --rm).
    #[arg(long, value_name = "DURATION", default_value_t = 0, value_parser = size::parse_secs)]
    pub timeout: u64,
    /// The command and its arguments, after `--` (may be left out when the image has an
    /// Entrypoint or Cmd).
    #[arg(last = true, value_name = "CMD")]
    pub command: Vec<String>,
}

impl RunArgs {
    /// The `sbx sandbox create` these flags mean (no wait: the run waits itself).
    fn create_args(&self) -> SandboxCreateArgs {
        SandboxCreateArgs {
            workspace: self.workspace.clone(),
            name: self.name.clone(),
            name_flag: None,
            labels: self.labels.clone(),
            env: self.env.clone(),
            cpu: self.cpu,
            memory: self.memory,
            disk: self.disk,
            image: self.image.clone().or_else(|| self.image_flag.clone()),
            pull: self.pull,
            driver: self.driver.clone(),
            node: None,
            node_selector: Vec::new(),
            stopped: false,
            uploads: Vec::new(),
            providers: Vec::new(),
            network: self.network,
            allow: self.allow.clone(),
            lifetime: Default::default(),
            detach: true,
            timeout: 0,
            settle: 0,
            command: self.command.clone(),
            output: OutputArgs {
                format: OutputFormat::Table,
                no_headers: false,
            },
        }
    }
}

/// A run "forever" (`--timeout 0`): long enough, and far from any overflow.
const NO_TIMEOUT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// How long `--rm` waits for the sandbox to be gone.
const DELETE_WAIT: Duration = Duration::from_secs(60);

/// `sbx run`.
pub async fn run_job(target: &Target, args: &RunArgs) -> Result<u8, CliError> {
    let create = args.create_args();
    let req = create_sandbox_request(&create, generate_sandbox_name(&mut rand::rng()))?;
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let created = create_pulling(target, &mut client, req, create.pull).await?;
    let this = SandboxRef {
        id: created.id.clone(),
        workspace: String::new(),
        name: String::new(),
    };
    let timeout = match args.timeout {
        0 => NO_TIMEOUT,
        secs => Duration::from_secs(secs),
    };
    let outcome = run_to_end(&client, created.clone(), this.clone(), timeout).await;
    if args.rm {
        let deleted = remove(&mut client, this, created).await;
        // The run's own failure says more than the delete's.
        if let (Ok(_), Err(e)) = (&outcome, deleted) {
            return Err(e);
        }
    }
    outcome
}

/// Follows the sandbox to the end of its workload, printing its output; answers the exit.
async fn run_to_end(
    client: &SandboxServiceClient<Channel>,
    created: Sandbox,
    this: SandboxRef,
    timeout: Duration,
) -> Result<u8, CliError> {
    // One deadline for the start and the end together.
    let began = std::time::Instant::now();
    let options = || WaitOptions {
        timeout: timeout.saturating_sub(began.elapsed()),
        settle: Duration::ZERO,
    };
    let printed = Arc::new(Mutex::new(Printed::default()));
    // The output is followed once the workload runs (a failure to start has its words in the
    // log, printed below).
    let started = follow_with(
        client,
        created,
        Goal::Ready,
        options(),
        Box::new(NoProgress),
    )
    .await;
    let (ended, follower) = match started {
        Ok(Observation::Present(sandbox)) => {
            let follower = tokio::spawn(print_followed(
                client.clone(),
                this.clone(),
                Arc::clone(&printed),
            ));
            let ended = follow_with(
                client,
                sandbox,
                Goal::Ended,
                options(),
                Box::new(NoProgress),
            )
            .await;
            (ended, Some(follower))
        }
        Ok(gone) => (Ok(gone), None),
        // Failed while starting: its end is what the record says now.
        Err(CliError::SandboxFailed { .. }) => (read(client, &this).await, None),
        Err(e) => (Err(e), None),
    };
    if let Some(follower) = follower {
        follower.abort();
        // Whatever it was doing, it has stopped: its counts are final.
        let _ = follower.await;
    }
    let sandbox = match ended? {
        Observation::Present(sandbox) => sandbox,
        Observation::Gone { name, id } => {
            return Err(CliError::SandboxGone {
                name,
                id,
                goal: "Completed",
            });
        }
    };
    print_rest(client, &this, &printed).await?;
    exit_status(&sandbox)
}

/// The sandbox as the gateway has it now.
async fn read(
    client: &SandboxServiceClient<Channel>,
    this: &SandboxRef,
) -> Result<Observation, CliError> {
    let got = client
        .clone()
        .get_sandbox(sbx_proto::v1::GetSandboxRequest {
            sandbox: Some(this.clone()),
        })
        .await?
        .into_inner();
    Ok(Observation::Present(got))
}

/// The exit status `sbx run` ends with, from the ended sandbox's record.
pub fn exit_status(sandbox: &Sandbox) -> Result<u8, CliError> {
    match (Phase::try_from(sandbox.phase).ok(), sandbox.exit_code) {
        (Some(Phase::Completed), _) => Ok(0),
        (Some(Phase::Error), Some(-1)) if sandbox.exit_signal > 0 => {
            Ok(128u8.saturating_add(sandbox.exit_signal.clamp(0, 127) as u8))
        }
        (Some(Phase::Error), Some(code)) => Ok((code & 0xff) as u8),
        (Some(Phase::Error), None) => Err(CliError::SandboxFailed {
            name: sandbox.name.clone(),
            reason: sandbox.reason.clone(),
            message: sandbox.message.clone(),
        }),
        _ => Err(CliError::SandboxAbandoned {
            name: sandbox.name.clone(),
            goal: "Completed",
            phase: phase_name(sandbox.phase),
            desired: desired_state_name(sandbox.desired_state),
        }),
    }
}

/// Bytes printed so far, per stream (stdout, stderr).
#[derive(Debug, Default)]
struct Printed([u64; 2]);

fn slot(chunk: &LogChunk) -> usize {
    usize::from(LogStream::try_from(chunk.stream).ok() == Some(LogStream::Stderr))
}

/// Writes `bytes` of `chunk`'s stream to stdout or stderr and counts them, under the lock (so
/// an abort between two chunks leaves the count true).
fn emit(printed: &Mutex<Printed>, chunk: &LogChunk, bytes: &[u8]) -> std::io::Result<()> {
    let mut counts = printed.lock().unwrap_or_else(|p| p.into_inner());
    if slot(chunk) == 1 {
        let mut err = std::io::stderr().lock();
        err.write_all(bytes)?;
        err.flush()?;
    } else {
        let mut out = std::io::stdout().lock();
        out.write_all(bytes)?;
        out.flush()?;
    }
    counts.0[slot(chunk)] += bytes.len() as u64;
    Ok(())
}

/// Prints the followed log as it comes, until aborted (or the stream ends).
async fn print_followed(
    mut client: SandboxServiceClient<Channel>,
    this: SandboxRef,
    printed: Arc<Mutex<Printed>>,
) {
    let request = LogsRequest {
        sandbox: Some(this),
        follow: true,
        ..Default::default()
    };
    let Ok(answer) = client.logs(request).await else {
        return;
    };
    let mut stream = answer.into_inner();
    while let Ok(Some(chunk)) = stream.message().await {
        if emit(&printed, &chunk, &chunk.data).is_err() {
            return;
        }
    }
}

/// After the end: the whole log once more, printing what lies past what was printed.
async fn print_rest(
    client: &SandboxServiceClient<Channel>,
    this: &SandboxRef,
    printed: &Mutex<Printed>,
) -> Result<(), CliError> {
    let request = LogsRequest {
        sandbox: Some(this.clone()),
        ..Default::default()
    };
    let mut stream = client.clone().logs(request).await?.into_inner();
    let mut seen = [0u64; 2];
    while let Some(chunk) = stream.message().await? {
        let slot = slot(&chunk);
        let done = printed.lock().unwrap_or_else(|p| p.into_inner()).0[slot];
        let start = seen[slot];
        seen[slot] += chunk.data.len() as u64;
        if seen[slot] > done {
            let skip = done.saturating_sub(start) as usize;
            emit(printed, &chunk, &chunk.data[skip..])?;
        }
    }
    Ok(())
}

/// `--rm`: deletes the sandbox and waits until it is gone.
async fn remove(
    client: &mut SandboxServiceClient<Channel>,
    this: SandboxRef,
    created: Sandbox,
) -> Result<(), CliError> {
    match client
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: Some(this),
        })
        .await
    {
        Ok(_) => {}
        Err(status) if status.code() == tonic::Code::NotFound => return Ok(()),
        Err(status) => return Err(status.into()),
    }
    let options = WaitOptions {
        timeout: DELETE_WAIT,
        settle: Duration::ZERO,
    };
    follow_with(
        client,
        created,
        Goal::Deleted,
        options,
        Box::new(NoProgress),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ended(phase: Phase, code: Option<i32>, signal: i32) -> Sandbox {
        Sandbox {
            name: "job".into(),
            phase: phase as i32,
            exit_code: code,
            exit_signal: signal,
            reason: "Why".into(),
            message: "what".into(),
            ..Default::default()
        }
    }

    #[test]
    fn the_run_exits_as_its_main_process_did() {
        let status = |s: &Sandbox| exit_status(s).map_err(|e| e.to_string());
        assert_eq!(status(&ended(Phase::Completed, Some(0), 0)), Ok(0));
        assert_eq!(status(&ended(Phase::Error, Some(7), 0)), Ok(7));
        assert_eq!(status(&ended(Phase::Error, Some(127), 0)), Ok(127));
        assert_eq!(status(&ended(Phase::Error, Some(300), 0)), Ok(44));
        assert_eq!(status(&ended(Phase::Error, Some(-1), 9)), Ok(137));
        // An Error without an exit (a driver failure) is sbx's failure, with its words.
        let err = status(&ended(Phase::Error, None, 0)).unwrap_err();
        assert!(err.contains("Why") && err.contains("what"), "{err}");
        // Stopped by someone: no exit to pass on.
        let err = status(&ended(Phase::Stopped, None, 0)).unwrap_err();
        assert!(err.contains("Stopped"), "{err}");
    }
}
