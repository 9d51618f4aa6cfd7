//! Waiting for a newly created sandbox to become Ready, with progress on stderr.
//!
//! The loop polls `GetSandbox` **by id** (never by name, so a same-named sandbox created by
//! someone else cannot be mistaken for ours) every [`POLL_INTERVAL`] until the sandbox is Ready,
//! fails, or the timeout passes. The decision per observation is the pure [`wait_step`].

use std::future::Future;
use std::io::{IsTerminal, Write};
use std::time::Duration;

use sbx_proto::v1::{DesiredState, Phase, Sandbox};
use tokio::time::Instant;

use super::CliError;
use super::output::{desired_state_name, phase_name};

/// How often the sandbox is polled while waiting.
pub const POLL_INTERVAL: Duration = Duration::from_millis(200);

/// What one observation of the sandbox means for the wait.
#[derive(Debug)]
pub enum WaitStep {
    /// Ready — or already Completed (its main process exited 0 before we looked): stop waiting.
    Done,
    /// Still on its way (Provisioning, Starting, …): keep polling.
    Pending,
    /// It will not become Ready by itself: stop with this error.
    Failed(CliError),
}

/// Decides what an observed sandbox means: Ready/Completed end the wait; Error fails with the
/// sandbox's reason and message; a sandbox someone stopped or deleted (desired state no longer
/// running, or phase Deleting) fails as abandoned; anything else is pending.
pub fn wait_step(sandbox: &Sandbox) -> WaitStep {
    let phase = Phase::try_from(sandbox.phase).ok();
    let desired = DesiredState::try_from(sandbox.desired_state).ok();
    match phase {
        Some(Phase::Ready | Phase::Completed) => WaitStep::Done,
        Some(Phase::Error) => WaitStep::Failed(CliError::SandboxFailed {
            name: sandbox.name.clone(),
            reason: or_unknown(&sandbox.reason),
            message: or_unknown(&sandbox.message),
        }),
        _ if phase == Some(Phase::Deleting)
            || matches!(desired, Some(DesiredState::Stopped | DesiredState::Deleted)) =>
        {
            WaitStep::Failed(CliError::SandboxAbandoned {
                name: sandbox.name.clone(),
                phase: phase_name(sandbox.phase),
                desired: desired_state_name(sandbox.desired_state),
            })
        }
        _ => WaitStep::Pending,
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

/// Waits until `fetch` reports the sandbox Ready (or Completed). `created` is the first
/// observation (the answer of CreateSandbox); `fetch` re-reads the sandbox by id. Ends with an
/// error when the sandbox fails or is abandoned, when a read fails, or after `timeout`.
pub async fn wait_until_ready<F, Fut>(
    created: Sandbox,
    mut fetch: F,
    timeout: Duration,
    poll_interval: Duration,
    progress: &mut dyn Progress,
) -> Result<Sandbox, CliError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Sandbox, tonic::Status>>,
{
    let deadline = Instant::now() + timeout;
    let mut current = created;
    let result = loop {
        progress.observed(&current);
        match wait_step(&current) {
            WaitStep::Done => break Ok(current),
            WaitStep::Failed(err) => break Err(err),
            WaitStep::Pending => {}
        }
        let timed_out = || CliError::WaitTimeout {
            name: current.name.clone(),
            id: current.id.clone(),
            phase: phase_name(current.phase),
            timeout,
        };
        let now = Instant::now();
        if now >= deadline {
            break Err(timed_out());
        }
        tokio::time::sleep_until((now + poll_interval).min(deadline)).await;
        match tokio::time::timeout_at(deadline, fetch()).await {
            Ok(Ok(sandbox)) => current = sandbox,
            Ok(Err(status)) => break Err(CliError::Rpc(status)),
            Err(_elapsed) => break Err(timed_out()),
        }
    };
    progress.finish();
    result
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    fn observed(name: &str, phase: Phase, desired: DesiredState) -> Sandbox {
        Sandbox {
            id: "id-1".into(),
            name: name.into(),
            phase: phase as i32,
            desired_state: desired as i32,
            ..Sandbox::default()
        }
    }

    /// Runs the wait over a scripted series of observations (the first is the create answer;
    /// when the script runs out, the last observation repeats), returning the outcome, the
    /// progress lines and how many fetches were made.
    async fn run_script(
        script: Vec<Result<Sandbox, tonic::Status>>,
        timeout: Duration,
    ) -> (Result<Sandbox, CliError>, String, usize) {
        let mut script: VecDeque<_> = script.into();
        let first = script.pop_front().unwrap().unwrap();
        let mut last = first.clone();
        let mut fetches = 0;
        let mut progress = LineProgress::new(Vec::new());
        let result = wait_until_ready(
            first,
            || {
                fetches += 1;
                let next = match script.pop_front() {
                    Some(Ok(sandbox)) => {
                        last = sandbox.clone();
                        Ok(sandbox)
                    }
                    Some(Err(status)) => Err(status),
                    None => Ok(last.clone()),
                };
                async move { next }
            },
            timeout,
            Duration::from_millis(5),
            &mut progress,
        )
        .await;
        let lines = String::from_utf8(progress.into_inner()).unwrap();
        (result, lines, fetches)
    }

    use DesiredState::Running;
    use Phase::*;

    #[tokio::test]
    async fn reaches_ready_and_prints_each_phase_once() {
        let (result, lines, fetches) = run_script(
            vec![
                Ok(observed("web", Provisioning, Running)),
                Ok(observed("web", Provisioning, Running)),
                Ok(observed("web", Provisioning, Running)),
                Ok(observed("web", Ready, Running)),
            ],
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(result.unwrap().phase, Ready as i32);
        assert_eq!(lines, "sandbox web: Provisioning\nsandbox web: Ready\n");
        assert_eq!(fetches, 3);
    }

    #[tokio::test]
    async fn already_ready_needs_no_fetch() {
        let (result, _, fetches) = run_script(
            vec![Ok(observed("a", Ready, Running))],
            Duration::from_secs(5),
        )
        .await;
        assert!(result.is_ok());
        assert_eq!(fetches, 0);
    }

    #[tokio::test]
    async fn error_phase_fails_with_reason_and_message() {
        let mut failed = observed("web", Error, Running);
        failed.reason = "ImagePullFailed".into();
        failed.message = "no such image".into();
        let (result, _, _) = run_script(
            vec![Ok(observed("web", Provisioning, Running)), Ok(failed)],
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(
            result.unwrap_err().to_string(),
            "sandbox \"web\" failed: ImagePullFailed: no such image"
        );
    }

    #[tokio::test]
    async fn stopped_by_someone_else_is_abandoned() {
        let (result, _, _) = run_script(
            vec![
                Ok(observed("web", Provisioning, Running)),
                Ok(observed("web", Stopping, DesiredState::Stopped)),
            ],
            Duration::from_secs(5),
        )
        .await;
        assert_eq!(
            result.unwrap_err().to_string(),
            "sandbox \"web\" will not become Ready: it is Stopping (desired state Stopped)"
        );
    }

    #[tokio::test]
    async fn read_errors_end_the_wait() {
        let (result, _, _) = run_script(
            vec![
                Ok(observed("web", Provisioning, Running)),
                Err(tonic::Status::not_found("sandbox gone")),
            ],
            Duration::from_secs(5),
        )
        .await;
        assert!(matches!(result, Err(CliError::Rpc(s)) if s.message() == "sandbox gone"));
    }

    #[tokio::test]
    async fn gives_up_after_the_timeout() {
        let started = std::time::Instant::now();
        let (result, lines, fetches) = run_script(
            vec![Ok(observed("slow", Provisioning, Running))],
            Duration::from_millis(100),
        )
        .await;
        let elapsed = started.elapsed();
        let err = result.unwrap_err();
        assert!(matches!(err, CliError::WaitTimeout { .. }), "{err:?}");
        assert!(err.to_string().contains("last phase Provisioning"), "{err}");
        assert!(elapsed >= Duration::from_millis(100), "{elapsed:?}");
        assert!(elapsed < Duration::from_secs(3), "{elapsed:?}");
        assert!(fetches >= 2, "polled only {fetches} times");
        assert_eq!(lines, "sandbox slow: Provisioning\n");
    }

    #[test]
    fn steps() {
        let check = |phase: Phase, desired: DesiredState, expected: &str| {
            let step = wait_step(&observed("x", phase, desired));
            let got = match step {
                WaitStep::Done => "done",
                WaitStep::Pending => "pending",
                WaitStep::Failed(CliError::SandboxFailed { .. }) => "failed",
                WaitStep::Failed(CliError::SandboxAbandoned { .. }) => "abandoned",
                WaitStep::Failed(other) => panic!("unexpected {other:?}"),
            };
            assert_eq!(got, expected, "{phase:?} / {desired:?}");
        };
        check(Unspecified, Running, "pending");
        check(Provisioning, Running, "pending");
        check(Starting, Running, "pending");
        check(Stopped, Running, "pending");
        check(Ready, Running, "done");
        check(Completed, Running, "done");
        check(Error, Running, "failed");
        check(Error, DesiredState::Stopped, "failed");
        check(Provisioning, DesiredState::Stopped, "abandoned");
        check(Stopped, DesiredState::Stopped, "abandoned");
        check(Provisioning, DesiredState::Deleted, "abandoned");
        check(Deleting, Running, "abandoned");
    }
}
