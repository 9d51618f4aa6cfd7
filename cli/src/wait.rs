//! Waiting for a sandbox to reach a goal (Ready, Stopped, deleted) and for the gateway to
//! serve, with progress on stderr.
//!
//! A sandbox wait follows the gateway's **watch stream** (`WatchSandboxes`, resumed from the
//! resource version of the answer that started the wait, filtered by id — never by name, so
//! a same-named sandbox created by someone else cannot be mistaken for ours), so the CLI sees
//! each change the moment the gateway publishes it. It used to poll `GetSandbox` every 200 ms,
//! which put 0–200 ms (100 ms on average) on every create whose gateway side takes tens of
//! milliseconds. When the watch answers `OUT_OF_RANGE` (its history no longer reaches back,
//! e.g. after a gateway restart) the sandbox is read by id instead and the watch resumes from
//! there. The decision per observation is the pure [`wait_step`]. [`follow`] is what every
//! command that waits after a call (a create, a stop, `sbx wait`, `sbx run`) goes through: by
//! id, from the call's answer, Ctrl-C ending the wait and leaving the sandbox as it is.
//!
//! What "Ready" promises: the driver started the main process, the gateway had not seen it
//! end when the wait finished, the sandbox stayed Ready for `--settle` (default none:
//! [`DEFAULT_SETTLE`]), and a `GetSandbox` by id read just before answering still says Ready.
//! A main process that ends within the wait (or the settle window) is reported as what it is:
//! Completed (exit 0) or the failure, with its reason and exit status. Drivers notice an exit
//! by polling (the oci driver every 250 ms), so a process that dies just after Ready is seen
//! by `sbx sandbox get` a moment later; `--settle 500` waits that out.
//!
//! Waiting for the gateway ([`wait_serving`]) polls its `grpc.health.v1` service every
//! [`SERVING_POLL`], at the endpoint or at the address an `--addr-file` names (re-read on
//! every try, so a stale file left by a crash is never trusted: its address must answer
//! SERVING).

use std::future::Future;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use super::connect::{Channel, Target};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    DesiredState, EventType, GetSandboxRequest, Phase, Sandbox, SandboxEvent, SandboxRef,
    WatchSandboxesRequest,
};
use tokio::time::Instant;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::CliError;
use super::output::{desired_state_name, phase_name};

/// How long a Ready sandbox must stay Ready before `create` reports it (`--settle`): none by
/// default, so create answers the moment the gateway records Ready (the CLI is as fast as the
/// gateway). `--settle 500` (twice the oci driver's 250 ms exit poll) also catches a main
/// process that fails at once.
pub const DEFAULT_SETTLE: Duration = Duration::ZERO;

/// How often [`wait_serving`] tries the gateway's health service.
pub const SERVING_POLL: Duration = Duration::from_millis(25);

/// How long the read that confirms a reached goal may take, even past the wait's timeout.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one health try may take (connect, then the check).
const HEALTH_TRY_TIMEOUT: Duration = Duration::from_secs(2);

/// What a sandbox wait waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Goal {
    /// Ready (or Completed: its main process exited 0).
    Ready,
    /// Stopped (or Completed/Error: no workload runs), after a stop was asked for: a start by
    /// someone else abandons the wait.
    Stopped,
    /// The workload ended, by itself or stopped (Stopped, Completed, Error): a sandbox that
    /// runs is waited for until it ends (`sbx wait --for stopped`, `sbx run`).
    Ended,
    /// The main process exited 0 (Completed); an Error fails the wait with its reason.
    Completed,
    /// Gone from the gateway.
    Deleted,
}

impl Goal {
    pub fn name(self) -> &'static str {
        match self {
            Goal::Ready => "Ready",
            Goal::Stopped | Goal::Ended => "Stopped",
            Goal::Completed => "Completed",
            Goal::Deleted => "deleted",
        }
    }
}

/// One look at the sandbox waited for.
// A handful live at a time (one per event), so the size difference costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Observation {
    Present(Sandbox),
    /// Deleted (a DELETED event, or NOT_FOUND by id).
    Gone {
        name: String,
        id: String,
    },
}

impl Observation {
    fn phase(&self) -> Option<Phase> {
        match self {
            Observation::Present(sandbox) => Phase::try_from(sandbox.phase).ok(),
            Observation::Gone { .. } => None,
        }
    }

    fn who(&self) -> (&str, &str) {
        match self {
            Observation::Present(sandbox) => (&sandbox.name, &sandbox.id),
            Observation::Gone { name, id } => (name, id),
        }
    }
}

/// What one observation of the sandbox means for the wait.
#[derive(Debug)]
pub enum WaitStep {
    /// The goal is reached: stop waiting.
    Done,
    /// Still on its way (Provisioning, Starting, Stopping, …): keep waiting.
    Pending,
    /// It will not reach the goal by itself: stop with this error.
    Failed(CliError),
}

/// Decides what an observation means for `goal`.
///
/// Ready: Ready/Completed end the wait; Error fails with the sandbox's reason and message
/// (for a main process that exited non-zero: `ExitedNonZero: main process exited with status
/// N`); a sandbox someone stopped or deleted fails as abandoned. Stopped: Stopped, Completed
/// and Error end it (no workload runs); a delete, or a start by someone else, abandons it.
/// Deleted: only gone ends it. A sandbox gone while waiting for Ready or Stopped fails.
pub fn wait_step(goal: Goal, observation: &Observation) -> WaitStep {
    let sandbox = match (goal, observation) {
        (Goal::Deleted, Observation::Gone { .. }) => return WaitStep::Done,
        (Goal::Deleted, Observation::Present(_)) => return WaitStep::Pending,
        (_, Observation::Gone { name, id }) => {
            return WaitStep::Failed(CliError::SandboxGone {
                name: name.clone(),
                id: id.clone(),
                goal: goal.name(),
            });
        }
        (_, Observation::Present(sandbox)) => sandbox,
    };
    let phase = Phase::try_from(sandbox.phase).ok();
    let desired = DesiredState::try_from(sandbox.desired_state).ok();
    let abandoned = || {
        WaitStep::Failed(CliError::SandboxAbandoned {
            name: sandbox.name.clone(),
            goal: goal.name(),
            phase: phase_name(sandbox.phase),
            desired: desired_state_name(sandbox.desired_state),
        })
    };
    match goal {
        Goal::Ready => match phase {
            Some(Phase::Ready | Phase::Completed) => WaitStep::Done,
            Some(Phase::Error) => WaitStep::Failed(CliError::SandboxFailed {
                name: sandbox.name.clone(),
                reason: or_unknown(&sandbox.reason),
                message: or_unknown(&sandbox.message),
            }),
            _ if phase == Some(Phase::Deleting)
                || matches!(desired, Some(DesiredState::Stopped | DesiredState::Deleted)) =>
            {
                abandoned()
            }
            _ => WaitStep::Pending,
        },
        Goal::Stopped => match phase {
            Some(Phase::Deleting) => abandoned(),
            _ if desired == Some(DesiredState::Deleted) => abandoned(),
            Some(Phase::Stopped | Phase::Completed | Phase::Error) => WaitStep::Done,
            _ if desired == Some(DesiredState::Running) => abandoned(),
            _ => WaitStep::Pending,
        },
        Goal::Ended => match phase {
            Some(Phase::Deleting) => abandoned(),
            _ if desired == Some(DesiredState::Deleted) => abandoned(),
            Some(Phase::Stopped | Phase::Completed | Phase::Error) => WaitStep::Done,
            _ => WaitStep::Pending,
        },
        Goal::Completed => match phase {
            Some(Phase::Completed) => WaitStep::Done,
            Some(Phase::Error) => WaitStep::Failed(CliError::SandboxFailed {
                name: sandbox.name.clone(),
                reason: or_unknown(&sandbox.reason),
                message: or_unknown(&sandbox.message),
            }),
            Some(Phase::Deleting | Phase::Stopped) => abandoned(),
            _ if desired == Some(DesiredState::Deleted) => abandoned(),
            _ => WaitStep::Pending,
        },
        Goal::Deleted => WaitStep::Pending,
    }
}

fn or_unknown(text: &str) -> String {
    if text.is_empty() {
        "(none given)".to_string()
    } else {
        text.to_string()
    }
}

/// Where progress goes while waiting.
pub trait Progress {
    /// Called with every observation; implementations show only changes.
    fn observed(&mut self, sandbox: &Sandbox);
    /// Called once when the wait ends, however it ends.
    fn finish(&mut self);
}

/// No progress at all (`sbx run`, whose stderr is the workload's).
pub struct NoProgress;

impl Progress for NoProgress {
    fn observed(&mut self, _: &Sandbox) {}
    fn finish(&mut self) {}
}

/// Progress as plain lines, `sandbox NAME: Phase`, one per phase change (for logs and pipes).
pub struct LineProgress<W: Write> {
    out: W,
    /// The last phase printed, so repeated polls in one phase print one line.
    last_phase: Option<i32>,
}

impl<W: Write> LineProgress<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            last_phase: None,
        }
    }

    pub fn into_inner(self) -> W {
        self.out
    }
}

impl<W: Write> Progress for LineProgress<W> {
    fn observed(&mut self, sandbox: &Sandbox) {
        if self.last_phase != Some(sandbox.phase) {
            self.last_phase = Some(sandbox.phase);
            // Progress is best effort: a closed stderr must not fail the command.
            let _ = writeln!(
                self.out,
                "sandbox {}: {}",
                sandbox.name,
                phase_name(sandbox.phase)
            );
            let _ = self.out.flush();
        }
    }

    fn finish(&mut self) {}
}

/// Progress as an indicatif spinner on a terminal, showing the current phase.
pub struct SpinnerProgress {
    bar: indicatif::ProgressBar,
}

impl SpinnerProgress {
    pub fn new() -> Self {
        let bar = indicatif::ProgressBar::new_spinner();
        if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {msg} ({elapsed})") {
            bar.set_style(style);
        }
        bar.enable_steady_tick(Duration::from_millis(100));
        Self { bar }
    }
}

impl Default for SpinnerProgress {
    fn default() -> Self {
        Self::new()
    }
}

impl Progress for SpinnerProgress {
    fn observed(&mut self, sandbox: &Sandbox) {
        self.bar.set_message(format!(
            "sandbox {}: {}",
            sandbox.name,
            phase_name(sandbox.phase)
        ));
    }

    fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// A spinner when stderr is a terminal, plain lines otherwise.
pub fn progress_for_stderr() -> Box<dyn Progress> {
    if std::io::stderr().is_terminal() {
        Box::new(SpinnerProgress::new())
    } else {
        Box::new(LineProgress::new(std::io::stderr()))
    }
}

/// Where a sandbox wait gets its observations.
pub trait Source {
    /// The next change of the sandbox (waits for it).
    fn next(&mut self) -> impl Future<Output = Result<Observation, CliError>>;
    /// The sandbox as the gateway's record says now.
    fn get(&mut self) -> impl Future<Output = Result<Observation, CliError>>;
}

/// Observations from `WatchSandboxes` over the sandbox's workspace, filtered by id, resumed
/// after the last resource version seen; `GetSandbox` by id when the watch answers
/// OUT_OF_RANGE.
pub struct WatchSource {
    client: SandboxServiceClient<Channel>,
    id: String,
    name: String,
    workspace: String,
    resource_version: u64,
    stream: Option<tonic::Streaming<SandboxEvent>>,
}

impl WatchSource {
    /// Follows `sandbox` from its resource version on (the answer of the call that started
    /// the wait: nothing after it is missed).
    pub fn new(client: SandboxServiceClient<Channel>, sandbox: &Sandbox) -> WatchSource {
        WatchSource {
            client,
            id: sandbox.id.clone(),
            name: sandbox.name.clone(),
            workspace: sandbox.workspace.clone(),
            resource_version: sandbox.resource_version,
            stream: None,
        }
    }

    async fn read(&mut self) -> Result<Observation, CliError> {
        let req = GetSandboxRequest {
            sandbox: Some(SandboxRef {
                id: self.id.clone(),
                workspace: String::new(),
                name: String::new(),
            }),
        };
        match self.client.get_sandbox(req).await {
            Ok(answer) => {
                let sandbox = answer.into_inner();
                self.resource_version = self.resource_version.max(sandbox.resource_version);
                Ok(Observation::Present(sandbox))
            }
            Err(status) if status.code() == tonic::Code::NotFound => Ok(Observation::Gone {
                name: self.name.clone(),
                id: self.id.clone(),
            }),
            Err(status) => Err(status.into()),
        }
    }

    async fn follow(&mut self) -> Result<Observation, CliError> {
        loop {
            let stream = match &mut self.stream {
                Some(stream) => stream,
                None => {
                    let req = WatchSandboxesRequest {
                        workspace: self.workspace.clone(),
                        all_workspaces: false,
                        label_selector: String::new(),
                        resource_version: self.resource_version,
                    };
                    match self.client.watch_sandboxes(req).await {
                        Ok(answer) => self.stream.insert(answer.into_inner()),
                        Err(status) if status.code() == tonic::Code::OutOfRange => {
                            return self.read().await;
                        }
                        Err(status) => return Err(status.into()),
                    }
                }
            };
            match stream.message().await {
                Ok(Some(event)) => {
                    let Some(sandbox) = event.sandbox else {
                        continue;
                    };
                    if sandbox.id != self.id {
                        continue;
                    }
                    self.resource_version = event.resource_version.max(sandbox.resource_version);
                    if event.r#type == EventType::Deleted as i32 {
                        return Ok(Observation::Gone {
                            name: sandbox.name,
                            id: sandbox.id,
                        });
                    }
                    return Ok(Observation::Present(sandbox));
                }
                Ok(None) => {
                    self.stream = None;
                    return Err(tonic::Status::unavailable(format!(
                        "the watch of workspace {:?} ended while waiting for sandbox {:?}",
                        self.workspace, self.name
                    ))
                    .into());
                }
                Err(status) if status.code() == tonic::Code::OutOfRange => {
                    self.stream = None;
                    return self.read().await;
                }
                Err(status) => {
                    self.stream = None;
                    return Err(status.into());
                }
            }
        }
    }
}

impl Source for WatchSource {
    fn next(&mut self) -> impl Future<Output = Result<Observation, CliError>> {
        self.follow()
    }

    fn get(&mut self) -> impl Future<Output = Result<Observation, CliError>> {
        self.read()
    }
}

/// How long a wait may take, and how long Ready must hold before it counts.
#[derive(Debug, Clone, Copy)]
pub struct WaitOptions {
    pub timeout: Duration,
    /// Only for [`Goal::Ready`]: how long the sandbox must stay Ready (0: answer at once).
    pub settle: Duration,
}

/// Waits until the sandbox reaches `goal`, from the observation `first` (the answer of the
/// call that started the wait) on. Before answering, re-reads the sandbox (`source.get`) so
/// the answer is the gateway's record, not an event the stream delivered a moment earlier.
/// Ends with an error when the sandbox fails or is abandoned, when a read fails, or after
/// `timeout`.
pub async fn wait_for<S: Source>(
    goal: Goal,
    first: Observation,
    source: &mut S,
    options: WaitOptions,
    progress: &mut dyn Progress,
) -> Result<Observation, CliError> {
    let deadline = Instant::now() + options.timeout;
    let (name, id) = {
        let (name, id) = first.who();
        (name.to_string(), id.to_string())
    };
    let mut current = first;
    let mut ready_since: Option<Instant> = None;
    let mut confirmed = false;
    let result = loop {
        if let Observation::Present(sandbox) = &current {
            progress.observed(sandbox);
        }
        let done = match wait_step(goal, &current) {
            WaitStep::Failed(err) => break Err(err),
            WaitStep::Pending => {
                ready_since = None;
                false
            }
            WaitStep::Done => true,
        };
        let wait_until = if done {
            let settling = goal == Goal::Ready && current.phase() == Some(Phase::Ready);
            let now = Instant::now();
            let until = if settling {
                *ready_since.get_or_insert(now) + options.settle
            } else {
                now
            };
            if now >= until {
                if confirmed {
                    break Ok(current);
                }
                confirmed = true;
                match tokio::time::timeout_at(deadline.max(now + CONFIRM_TIMEOUT), source.get())
                    .await
                {
                    Ok(Ok(observation)) => current = observation,
                    Ok(Err(err)) => break Err(err),
                    Err(_) => break Err(timed_out(goal, &name, &id, &current, options.timeout)),
                }
                continue;
            }
            until
        } else {
            deadline
        };
        match tokio::time::timeout_at(wait_until, source.next()).await {
            Ok(Ok(observation)) => {
                current = observation;
                confirmed = false;
            }
            Ok(Err(err)) => break Err(err),
            // Settled: the next round confirms and answers.
            Err(_) if done => {}
            Err(_) => break Err(timed_out(goal, &name, &id, &current, options.timeout)),
        }
    };
    progress.finish();
    result
}

/// Waits for `goal` from `answer` (the gateway's answer to the call that started the wait)
/// on, following the sandbox by id on the watch stream, with progress on stderr; Ctrl-C ends
/// the wait and leaves the sandbox as it is.
pub async fn follow(
    client: &SandboxServiceClient<Channel>,
    answer: Sandbox,
    goal: Goal,
    options: WaitOptions,
) -> Result<Observation, CliError> {
    follow_with(client, answer, goal, options, progress_for_stderr()).await
}

/// [`follow`] with `progress` instead of stderr's.
pub async fn follow_with(
    client: &SandboxServiceClient<Channel>,
    answer: Sandbox,
    goal: Goal,
    options: WaitOptions,
    mut progress: Box<dyn Progress>,
) -> Result<Observation, CliError> {
    // Followed by id only: the id is the identity; the name could meanwhile mean another
    // sandbox (deleted and re-created by someone else).
    if answer.id.is_empty() {
        return Err(CliError::CreatedWithoutId { name: answer.name });
    }
    let interrupted = CliError::Interrupted {
        name: answer.name.clone(),
        id: answer.id.clone(),
        goal: goal.name(),
    };
    let mut source = WatchSource::new(client.clone(), &answer);
    let waited = tokio::select! {
        waited = wait_for(
            goal,
            Observation::Present(answer),
            &mut source,
            options,
            progress.as_mut(),
        ) => waited,
        // If the handler cannot be installed, wait on without it.
        Ok(()) = tokio::signal::ctrl_c() => Err(interrupted),
    };
    // Clears the spinner however the wait ended (an interrupted wait never reached its own
    // finish call); finishing twice is harmless.
    progress.finish();
    waited
}

/// The sandbox a finished wait for Ready or Stopped saw (such a wait fails when it is gone).
pub fn present(observation: Observation) -> Result<Sandbox, CliError> {
    match observation {
        Observation::Present(sandbox) => Ok(sandbox),
        Observation::Gone { name, id } => Err(CliError::SandboxGone {
            name,
            id,
            goal: "Ready",
        }),
    }
}

fn timed_out(
    goal: Goal,
    name: &str,
    id: &str,
    current: &Observation,
    timeout: Duration,
) -> CliError {
    let phase = match current {
        Observation::Present(sandbox) => phase_name(sandbox.phase),
        Observation::Gone { .. } => "gone".to_string(),
    };
    CliError::WaitTimeout {
        name: name.to_string(),
        id: id.to_string(),
        goal: goal.name(),
        phase,
        timeout,
    }
}

/// Waits until the gateway's health service answers SERVING — at `target`, or, with
/// `addr_file`, at the address in that file (`unix:///path` or `host:port`, with the
/// target's credentials) once it holds a whole line — and answers where it serves (the
/// file's address, or the target's endpoint). A target no setting named is looked for at
/// each default socket, in order, on every try: the first that answers SERVING is the
/// gateway, so a socket that does not exist yet (a service being started) is waited for. A
/// gateway that refuses the credential (UNAUTHENTICATED, PERMISSION_DENIED) ends the wait at
/// once: asking again will not help. Progress goes to stderr, a line each time what the
/// places say changes; the error at the timeout names every place and what it said last.
pub async fn wait_serving(
    target: &Target,
    addr_file: Option<&Path>,
    timeout: Duration,
) -> Result<String, CliError> {
    let mut progress = std::io::stderr();
    wait_serving_with(target, addr_file, timeout, &mut progress).await
}

/// [`wait_serving`] with its progress lines written to `progress`.
pub async fn wait_serving_with(
    target: &Target,
    addr_file: Option<&Path>,
    timeout: Duration,
    progress: &mut dyn Write,
) -> Result<String, CliError> {
    let deadline = Instant::now() + timeout;
    let mut shown = String::new();
    loop {
        // What the file says, printed as it says it (sbxd writes host:port or unix://PATH).
        let mut written = None;
        let (tries, last) = match addr_file {
            Some(path) => match std::fs::read_to_string(path) {
                Ok(text) if text.ends_with('\n') && !text.trim().is_empty() => {
                    written = Some(text.trim().to_string());
                    (vec![target.at(text.trim())?], String::new())
                }
                Ok(text) => (
                    Vec::new(),
                    format!("{} holds {text:?}, not a whole line", path.display()),
                ),
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {
                    (Vec::new(), format!("{} is not written yet", path.display()))
                }
                Err(err) => {
                    return Err(CliError::AddrFile {
                        path: path.display().to_string(),
                        cause: err.to_string(),
                    });
                }
            },
            None => (vec![target.clone()], String::new()),
        };
        let mut said = Vec::new();
        for try_at in tries {
            match &try_at.search {
                // A gateway no setting named: each default socket, in order.
                Some(search) => {
                    for socket in &search.sockets {
                        if !socket.is_there() {
                            said.push(format!("{}: no socket yet", socket.shown()));
                            continue;
                        }
                        let at = try_at.at(&format!("unix://{}", socket.path.display()))?;
                        match health(&at).await {
                            Ok(()) => return Ok(at.endpoint()),
                            Err(Unhealthy::Refused(status)) => return Err(CliError::Rpc(status)),
                            Err(cause) => said.push(format!("{}: {cause}", socket.shown())),
                        }
                    }
                }
                None => match health(&try_at).await {
                    Ok(()) => return Ok(written.unwrap_or_else(|| try_at.endpoint())),
                    Err(Unhealthy::Refused(status)) => return Err(CliError::Rpc(status)),
                    Err(cause) => said.push(format!("{}: {cause}", try_at.endpoint())),
                },
            }
        }
        let last = if said.is_empty() {
            last
        } else {
            said.join("; ")
        };
        if last != shown {
            // Progress is best effort: a closed stderr must not fail the wait.
            let _ = writeln!(progress, "waiting for sbxd to serve: {last}");
            let _ = progress.flush();
            shown = last.clone();
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(CliError::NotServing {
                what: match (addr_file, &target.search) {
                    (Some(path), _) => format!("the address in {}", path.display()),
                    (None, Some(search)) => format!(
                        "sbxd, looked for (after {}) at each default socket in order, is",
                        search.looked(&[])
                    ),
                    (None, None) => target.endpoint(),
                },
                timeout,
                last,
            });
        }
        tokio::time::sleep_until((now + SERVING_POLL).min(deadline)).await;
    }
}

/// Why a health check did not say SERVING.
#[derive(Debug)]
pub(crate) enum Unhealthy {
    /// The gateway refused the credential: UNAUTHENTICATED or PERMISSION_DENIED.
    Refused(tonic::Status),
    /// Not reachable, not serving yet, or no answer in time.
    Down(String),
}

impl std::fmt::Display for Unhealthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // A refusal's words are the same however the gateway was dialled.
            Unhealthy::Refused(status) => f.write_str(&super::error::describe_status(status, None)),
            Unhealthy::Down(cause) => f.write_str(cause),
        }
    }
}

/// One health check of the whole server (service ""): Ok when SERVING.
pub(crate) async fn health(target: &Target) -> Result<(), Unhealthy> {
    let check = async {
        let channel = super::connect::connect(target)
            .await
            .map_err(|err| match err {
                CliError::Unreachable { cause, .. } => Unhealthy::Down(cause),
                other => Unhealthy::Down(other.to_string()),
            })?;
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await
            .map_err(|status| match status.code() {
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                    Unhealthy::Refused(status)
                }
                _ => Unhealthy::Down(super::error::describe_status(
                    &status,
                    Some(target.address.transport()),
                )),
            })?;
        match ServingStatus::try_from(answer.into_inner().status) {
            Ok(ServingStatus::Serving) => Ok(()),
            Ok(other) => Err(Unhealthy::Down(format!("health {}", other.as_str_name()))),
            Err(_) => Err(Unhealthy::Down(
                "health answered an unknown status".to_string(),
            )),
        }
    };
    match tokio::time::timeout(HEALTH_TRY_TIMEOUT, check).await {
        Ok(result) => result,
        Err(_) => Err(Unhealthy::Down(format!(
            "no health answer within {}s",
            HEALTH_TRY_TIMEOUT.as_secs()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    fn observed(name: &str, phase: Phase, desired: DesiredState) -> Observation {
        Observation::Present(Sandbox {
            id: "id-1".into(),
            name: name.into(),
            phase: phase as i32,
            desired_state: desired as i32,
            ..Sandbox::default()
        })
    }

    fn failed(name: &str, reason: &str, message: &str) -> Observation {
        let Observation::Present(mut sandbox) = observed(name, Error, Running) else {
            unreachable!()
        };
        sandbox.reason = reason.into();
        sandbox.message = message.into();
        Observation::Present(sandbox)
    }

    /// Scripted observations: `next` hands out `events` in order (then waits for ever, as a
    /// quiet watch does); `get` answers `record` (or the last observation handed out).
    struct Script {
        events: VecDeque<Result<Observation, CliError>>,
        record: Option<Observation>,
        last: Option<Observation>,
        nexts: usize,
        gets: usize,
    }

    impl Source for Script {
        fn next(&mut self) -> impl Future<Output = Result<Observation, CliError>> {
            self.nexts += 1;
            let next = self.events.pop_front();
            if let Some(Ok(observation)) = &next {
                self.last = Some(observation.clone());
            }
            async move {
                match next {
                    Some(next) => next,
                    None => std::future::pending().await,
                }
            }
        }

        fn get(&mut self) -> impl Future<Output = Result<Observation, CliError>> {
            self.gets += 1;
            let answer = self.record.clone().or_else(|| self.last.clone());
            async move { Ok(answer.expect("a scripted record")) }
        }
    }

    struct Outcome {
        result: Result<Observation, CliError>,
        lines: String,
        script: Script,
        took: std::time::Duration,
    }

    async fn run(
        goal: Goal,
        first: Observation,
        events: Vec<Result<Observation, CliError>>,
        record: Option<Observation>,
        timeout: Duration,
        settle: Duration,
    ) -> Outcome {
        let mut script = Script {
            events: events.into(),
            record,
            last: Some(first.clone()),
            nexts: 0,
            gets: 0,
        };
        let mut progress = LineProgress::new(Vec::new());
        let began = std::time::Instant::now();
        let result = wait_for(
            goal,
            first,
            &mut script,
            WaitOptions { timeout, settle },
            &mut progress,
        )
        .await;
        Outcome {
            result,
            lines: String::from_utf8(progress.into_inner()).unwrap(),
            script,
            took: began.elapsed(),
        }
    }

    fn phase_of(result: &Result<Observation, CliError>) -> Phase {
        match result {
            Ok(observation) => observation.phase().unwrap(),
            Err(err) => panic!("failed: {err}"),
        }
    }

    use DesiredState::Running;
    use Phase::*;

    const LONG: Duration = Duration::from_secs(5);
    const NO_SETTLE: Duration = Duration::ZERO;

    #[tokio::test]
    async fn reaches_ready_from_events_printing_each_phase_once() {
        let out = run(
            Goal::Ready,
            observed("web", Provisioning, Running),
            vec![
                Ok(observed("web", Provisioning, Running)),
                Ok(observed("web", Ready, Running)),
            ],
            None,
            LONG,
            NO_SETTLE,
        )
        .await;
        assert_eq!(phase_of(&out.result), Ready);
        assert_eq!(out.lines, "sandbox web: Provisioning\nsandbox web: Ready\n");
        assert_eq!(out.script.nexts, 2);
        assert_eq!(out.script.gets, 1, "the answer is confirmed by one read");
        assert!(out.took < Duration::from_millis(100), "{:?}", out.took);
    }

    #[tokio::test]
    async fn already_ready_needs_no_event() {
        let out = run(
            Goal::Ready,
            observed("a", Ready, Running),
            vec![],
            None,
            LONG,
            NO_SETTLE,
        )
        .await;
        assert_eq!(phase_of(&out.result), Ready);
        assert_eq!((out.script.nexts, out.script.gets), (0, 1));
    }

    #[tokio::test]
    async fn error_phase_fails_with_reason_and_message() {
        let out = run(
            Goal::Ready,
            observed("web", Provisioning, Running),
            vec![Ok(failed("web", "ImagePullFailed", "no such image"))],
            None,
            LONG,
            NO_SETTLE,
        )
        .await;
        assert_eq!(
            out.result.unwrap_err().to_string(),
            "sandbox \"web\" failed: ImagePullFailed: no such image"
        );
    }

    #[tokio::test]
    async fn an_exit_within_the_settle_window_is_the_failure_it_is() {
        let out = run(
            Goal::Ready,
            observed("web", Ready, Running),
            vec![Ok(failed(
                "web",
                "ExitedNonZero",
                "main process exited with status 3",
            ))],
            None,
            LONG,
            Duration::from_millis(300),
        )
        .await;
        assert_eq!(
            out.result.unwrap_err().to_string(),
            "sandbox \"web\" failed: ExitedNonZero: main process exited with status 3"
        );
        assert!(out.took < Duration::from_millis(250), "{:?}", out.took);
    }

    #[tokio::test]
    async fn ready_that_holds_for_the_settle_window_is_ready() {
        let settle = Duration::from_millis(150);
        let out = run(
            Goal::Ready,
            observed("web", Ready, Running),
            vec![],
            None,
            LONG,
            settle,
        )
        .await;
        assert_eq!(phase_of(&out.result), Ready);
        assert!(out.took >= settle, "{:?}", out.took);
        assert!(out.took < settle * 4, "{:?}", out.took);
    }

    #[tokio::test]
    async fn completed_within_the_window_is_reported_completed() {
        let out = run(
            Goal::Ready,
            observed("job", Ready, Running),
            vec![Ok(observed("job", Completed, Running))],
            None,
            LONG,
            Duration::from_secs(2),
        )
        .await;
        assert_eq!(phase_of(&out.result), Completed);
        assert!(out.took < Duration::from_secs(1), "{:?}", out.took);
    }

    #[tokio::test]
    async fn the_record_has_the_last_word() {
        // The stream said Ready, but the record read before answering says the process failed.
        let out = run(
            Goal::Ready,
            observed("web", Ready, Running),
            vec![],
            Some(failed(
                "web",
                "ExitedNonZero",
                "main process exited with status 1",
            )),
            LONG,
            NO_SETTLE,
        )
        .await;
        assert!(
            matches!(&out.result, Err(CliError::SandboxFailed { reason, .. }) if reason == "ExitedNonZero"),
            "{:?}",
            out.result
        );
    }

    #[tokio::test]
    async fn stopped_by_someone_else_is_abandoned() {
        let out = run(
            Goal::Ready,
            observed("web", Provisioning, Running),
            vec![Ok(observed("web", Stopping, DesiredState::Stopped))],
            None,
            LONG,
            NO_SETTLE,
        )
        .await;
        assert_eq!(
            out.result.unwrap_err().to_string(),
            "sandbox \"web\" will not become Ready: it is Stopping (desired state Stopped)"
        );
    }

    #[tokio::test]
    async fn read_errors_end_the_wait() {
        let out = run(
            Goal::Ready,
            observed("web", Provisioning, Running),
            vec![Err(tonic::Status::unavailable("gateway gone").into())],
            None,
            LONG,
            NO_SETTLE,
        )
        .await;
        assert!(
            matches!(&out.result, Err(CliError::Rpc(s)) if s.message() == "gateway gone"),
            "{:?}",
            out.result
        );
    }

    #[tokio::test]
    async fn gives_up_after_the_timeout() {
        let out = run(
            Goal::Ready,
            observed("slow", Provisioning, Running),
            vec![],
            None,
            Duration::from_millis(100),
            NO_SETTLE,
        )
        .await;
        let err = out.result.unwrap_err();
        assert!(matches!(err, CliError::WaitTimeout { .. }), "{err:?}");
        assert!(err.to_string().contains("not Ready after"), "{err}");
        assert!(err.to_string().contains("last phase Provisioning"), "{err}");
        assert!(out.took >= Duration::from_millis(100), "{:?}", out.took);
        assert!(out.took < Duration::from_secs(3), "{:?}", out.took);
        assert_eq!(out.lines, "sandbox slow: Provisioning\n");
    }

    #[tokio::test]
    async fn deleted_ends_on_the_deleted_event() {
        let gone = Observation::Gone {
            name: "web".into(),
            id: "id-1".into(),
        };
        let out = run(
            Goal::Deleted,
            observed("web", Deleting, DesiredState::Deleted),
            vec![Ok(gone.clone())],
            Some(gone),
            LONG,
            NO_SETTLE,
        )
        .await;
        assert!(matches!(out.result, Ok(Observation::Gone { .. })));
    }

    #[tokio::test]
    async fn gone_while_waiting_for_ready_fails() {
        let out = run(
            Goal::Ready,
            observed("web", Provisioning, Running),
            vec![Ok(Observation::Gone {
                name: "web".into(),
                id: "id-1".into(),
            })],
            None,
            LONG,
            NO_SETTLE,
        )
        .await;
        assert_eq!(
            out.result.unwrap_err().to_string(),
            "sandbox \"web\" (id id-1) was deleted while waiting for it to become Ready"
        );
    }

    #[test]
    fn steps() {
        let check = |goal: Goal, phase: Phase, desired: DesiredState, expected: &str| {
            let step = wait_step(goal, &observed("x", phase, desired));
            let got = match step {
                WaitStep::Done => "done",
                WaitStep::Pending => "pending",
                WaitStep::Failed(CliError::SandboxFailed { .. }) => "failed",
                WaitStep::Failed(CliError::SandboxAbandoned { .. }) => "abandoned",
                WaitStep::Failed(other) => panic!("unexpected {other:?}"),
            };
            assert_eq!(got, expected, "{goal:?}: {phase:?} / {desired:?}");
        };
        use Goal::{Deleted as Gone, Ready as R, Stopped as S};
        check(R, Unspecified, Running, "pending");
        check(R, Provisioning, Running, "pending");
        check(R, Starting, Running, "pending");
        check(R, Stopped, Running, "pending");
        check(R, Ready, Running, "done");
        check(R, Completed, Running, "done");
        check(R, Error, Running, "failed");
        check(R, Error, DesiredState::Stopped, "failed");
        check(R, Provisioning, DesiredState::Stopped, "abandoned");
        check(R, Stopped, DesiredState::Stopped, "abandoned");
        check(R, Provisioning, DesiredState::Deleted, "abandoned");
        check(R, Deleting, Running, "abandoned");
        check(S, Stopping, DesiredState::Stopped, "pending");
        check(S, Stopped, DesiredState::Stopped, "done");
        check(S, Completed, DesiredState::Stopped, "done");
        check(S, Error, DesiredState::Stopped, "done");
        check(S, Starting, Running, "abandoned");
        check(S, Deleting, DesiredState::Deleted, "abandoned");
        // Ended: a sandbox that runs is waited for; however it ends, the wait is done.
        let (e, c) = (Goal::Ended, Goal::Completed);
        for phase in [Provisioning, Starting, Ready] {
            check(e, phase, Running, "pending");
            check(c, phase, Running, "pending");
        }
        check(e, Stopping, DesiredState::Stopped, "pending");
        for phase in [Stopped, Completed, Error] {
            check(e, phase, DesiredState::Stopped, "done");
        }
        check(e, Deleting, DesiredState::Deleted, "abandoned");
        // Completed: only an exit 0; a failure says why, a stop or delete abandons.
        check(c, Completed, DesiredState::Stopped, "done");
        check(c, Error, DesiredState::Stopped, "failed");
        check(c, Stopped, DesiredState::Stopped, "abandoned");
        check(c, Deleting, DesiredState::Deleted, "abandoned");
        check(Gone, Ready, Running, "pending");
        check(Gone, Deleting, DesiredState::Deleted, "pending");
    }
}
