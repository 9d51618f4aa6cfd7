//! Converging: the sandbox driven towards what is wanted, one plan step (`crate::lifecycle`)
//! and one driver call at a time, each call under a deadline; and what a call that failed
//! does (settle in Error, or retry with backoff).

use std::sync::Arc;
use std::time::Duration;

use ractor::{ActorProcessingErr, ActorRef};
use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_proto::v1::{DesiredState, Phase};

use super::{Outcome, SandboxActor, SandboxState, current, deadline_reason, desired, set_phase};
use crate::error::{ActorError, Result};
use crate::lifecycle::{Observed, PhaseChange, Step, plan};
use crate::lifetime;
use crate::protocol::SandboxMsg;
use crate::supervision::backoff;

/// The most steps one convergence takes before it yields and retries later (each step is a
/// driver call; a well-behaved driver needs at most three).
const MAX_STEPS: usize = 8;

/// Where one step of a convergence leads.
enum Flow {
    /// Plan again from this observation (what the step's driver call answered), or from a
    /// new look at the driver (None).
    Look(Option<Observed>),
    /// The convergence is over.
    Done(Outcome),
}

impl SandboxActor {
    /// Drives the sandbox towards its desired state, one plan step at a time.
    pub(super) async fn converge(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        initial: Option<Observed>,
    ) -> Result<Outcome, ActorProcessingErr> {
        let driver = match self.driver(st) {
            Ok(driver) => driver,
            Err(e) => return self.driver_failed(myself, st, e).await,
        };
        let mut next = initial;
        // A pause refused once as out of place is looked at again (the workload may have
        // ended between the look and the call); a second refusal is the driver's answer.
        let mut pause_refused = false;
        for _ in 0..MAX_STEPS {
            let obs = match next.take() {
                Some(obs) => obs,
                None => match self.observe(st, &driver).await {
                    Ok(obs) => obs,
                    Err(e) => return self.driver_failed(myself, st, e).await,
                },
            };
            let step = plan(&current(st), &obs, st.fresh);
            tracing::debug!(sandbox = %st.stored.id(), ?obs, ?step, "plan");
            match self
                .take_step(myself, st, &driver, step, &mut pause_refused)
                .await?
            {
                Flow::Look(obs) => next = obs,
                Flow::Done(outcome) => return Ok(outcome),
            }
        }
        // The driver keeps changing under us; look again later rather than spin.
        self.driver_failed(
            myself,
            st,
            DriverError::Unavailable("the workload did not settle".into()),
        )
        .await
    }

    /// One plan step: recorded, or a driver call whose answer is the next look.
    async fn take_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
        step: Step,
        pause_refused: &mut bool,
    ) -> Result<Flow, ActorProcessingErr> {
        match step {
            Step::Settled => {
                st.attempts = 0;
                self.persist_if_changed(st).await?;
                Ok(Flow::Done(Outcome::Settled))
            }
            Step::Record(change) => {
                apply(st, change);
                st.attempts = 0;
                self.persist(st).await?;
                Ok(Flow::Done(Outcome::Settled))
            }
            Step::Create { generation } => self.create_step(myself, st, driver, generation).await,
            Step::Prepare { generation } => self.prepare_step(myself, st, driver, generation).await,
            Step::Start { generation } => self.start_step(myself, st, driver, generation).await,
            Step::Stop => self.stop_step(myself, st, driver).await,
            Step::Delete => self.delete_step(myself, st, driver).await,
            Step::Adopt { generation } => self.adopt_step(st, generation).await,
            Step::Pause => self.pause_step(myself, st, driver, pause_refused).await,
            Step::Resume => self.resume_step(myself, st, driver).await,
            Step::Drift { persisted, running } => {
                tracing::warn!(sandbox = %st.stored.id(), persisted, running, "generation drift: the actor restarts to reconcile");
                Err(format!(
                    "sandbox {}: the driver runs generation {running} but the record says {persisted}; restarting the actor to reconcile",
                    st.stored.id()
                )
                .into())
            }
        }
    }

    /// A driver call of a step failed: [`Self::driver_failed`], which ends the convergence.
    async fn failed(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        e: DriverError,
    ) -> Result<Flow, ActorProcessingErr> {
        self.driver_failed(myself, st, e).await.map(Flow::Done)
    }

    /// Create: the workload made and started under a new generation, with its run's
    /// environment.
    async fn create_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
        generation: u64,
    ) -> Result<Flow, ActorProcessingErr> {
        let phase = if st.stored.sandbox.phase() == Phase::Provisioning {
            Phase::Provisioning
        } else {
            Phase::Starting
        };
        st.stored.sandbox.generation = generation;
        set_phase(st, phase, "", "");
        self.persist_if_changed(st).await?;
        let run_env = match self.run_env(st).await {
            Ok(env) => env,
            Err(e) => return self.run_env_failed(myself, st, e).await.map(Flow::Done),
        };
        let request = pb::CreateRequest {
            run_env,
            ..crate::translate::create_request(st.stored.id(), &st.stored.sandbox)
        };
        match with_deadline(st, "create", driver.create(request)).await {
            Ok(snapshot) => Ok(Flow::Look(Some(Observed::from_snapshot(&snapshot)))),
            Err(DriverError::GenerationMismatch { running, .. }) => {
                Ok(Flow::Look(Some(Observed::Running {
                    generation: running,
                })))
            }
            Err(e) => self.failed(myself, st, e).await,
        }
    }

    /// Prepare: the workload made but not started (a sandbox wanted stopped or paused).
    async fn prepare_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
        generation: u64,
    ) -> Result<Flow, ActorProcessingErr> {
        st.stored.sandbox.generation = generation;
        self.persist_if_changed(st).await?;
        let request = pb::CreateRequest {
            stopped: true,
            ..crate::translate::create_request(st.stored.id(), &st.stored.sandbox)
        };
        match with_deadline(st, "create", driver.create(request)).await {
            Ok(snapshot) => Ok(Flow::Look(Some(Observed::from_snapshot(&snapshot)))),
            Err(e) => self.failed(myself, st, e).await,
        }
    }

    /// Start: a made workload started under a new generation, with its run's environment.
    async fn start_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
        generation: u64,
    ) -> Result<Flow, ActorProcessingErr> {
        st.stored.sandbox.generation = generation;
        set_phase(st, Phase::Starting, "", "");
        self.persist_if_changed(st).await?;
        let run_env = match self.run_env(st).await {
            Ok(env) => env,
            Err(e) => return self.run_env_failed(myself, st, e).await.map(Flow::Done),
        };
        let request = pb::StartRequest {
            run_env,
            sandbox_id: st.stored.id().to_string(),
            generation,
        };
        match with_deadline(st, "start", driver.start(request)).await {
            Ok(snapshot) => Ok(Flow::Look(Some(Observed::from_snapshot(&snapshot)))),
            Err(DriverError::NotFound { .. }) => Ok(Flow::Look(Some(Observed::Absent))),
            Err(DriverError::GenerationMismatch { running, .. }) => {
                Ok(Flow::Look(Some(Observed::Running {
                    generation: running,
                })))
            }
            Err(e) => self.failed(myself, st, e).await,
        }
    }

    /// Stop: recorded Stopping (with a deadline's reason when one asked), then the driver's
    /// stop.
    async fn stop_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
    ) -> Result<Flow, ActorProcessingErr> {
        if st.stored.sandbox.phase() != Phase::Stopping {
            let (reason, message) = st.why.clone().unwrap_or_default();
            set_phase(st, Phase::Stopping, &reason, &message);
        }
        self.persist_if_changed(st).await?;
        match self.stop_workload(st, driver).await {
            Ok(obs) => Ok(Flow::Look(Some(obs))),
            Err(e) => self.failed(myself, st, e).await,
        }
    }

    /// Delete: recorded Deleting, deleted by the driver (one it does not know is gone), then
    /// the record deleted.
    async fn delete_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
    ) -> Result<Flow, ActorProcessingErr> {
        if st.stored.sandbox.phase() != Phase::Deleting {
            set_phase(st, Phase::Deleting, "", "");
            self.persist(st).await?;
        }
        let request = pb::DeleteRequest {
            sandbox_id: st.stored.id().to_string(),
        };
        match with_deadline(st, "delete", driver.delete(request)).await {
            Ok(_) | Err(DriverError::NotFound { .. }) => {}
            Err(e) => return self.failed(myself, st, e).await,
        }
        self.delete_record(st).await?;
        Ok(Flow::Done(Outcome::Deleted))
    }

    /// Adopt: a fresh actor found the workload running (or paused) under another generation
    /// than the record's, and takes it as it is.
    async fn adopt_step(
        &self,
        st: &mut SandboxState,
        generation: u64,
    ) -> Result<Flow, ActorProcessingErr> {
        let before = st.stored.sandbox.generation;
        st.stored.sandbox.generation = generation;
        let (phase, what) = if desired(st) == DesiredState::Paused {
            (Phase::Paused, "paused")
        } else {
            (Phase::Ready, "running")
        };
        set_phase(
            st,
            phase,
            "Adopted",
            &format!(
                "re-attached to the {what} workload under its generation {generation} (the record said {before})"
            ),
        );
        tracing::info!(sandbox = %st.stored.id(), before, generation, "adopted a running workload after generation drift");
        self.persist(st).await?;
        st.attempts = 0;
        Ok(Flow::Done(Outcome::Settled))
    }

    /// Pause: recorded Pausing with whose pause it is, then the driver's pause (under the
    /// pause's own deadline). A refusal is looked at again once; a second is given up on.
    async fn pause_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
        pause_refused: &mut bool,
    ) -> Result<Flow, ActorProcessingErr> {
        if st.stored.sandbox.phase() != Phase::Pausing {
            // Whose pause this is: the step's, else a deadline's the record holds (a pause
            // tried again after a failure), else a call's.
            let (reason, message) = st
                .why
                .clone()
                .or_else(|| deadline_reason(&st.stored.sandbox))
                .unwrap_or_else(|| {
                    (
                        lifetime::PAUSED_BY_CALL.to_string(),
                        "paused by a PauseSandbox call".to_string(),
                    )
                });
            set_phase(st, Phase::Pausing, &reason, &message);
        }
        self.persist_if_changed(st).await?;
        let request = pb::PauseRequest {
            sandbox_id: st.stored.id().to_string(),
        };
        let within = st.shared.config.lifetimes.pause_timeout;
        super::attach_done(st);
        match with_deadline_of(st, "pause", within, driver.pause(request)).await {
            Ok(snapshot) => Ok(Flow::Look(Some(Observed::from_snapshot(&snapshot)))),
            Err(DriverError::NotFound { .. }) => Ok(Flow::Look(Some(Observed::Absent))),
            Err(e) if e.is_transient() => self.failed(myself, st, e).await,
            Err(DriverError::FailedPrecondition(why)) if !*pause_refused => {
                tracing::debug!(sandbox = %st.stored.id(), %why, "the pause was refused; looking again");
                *pause_refused = true;
                Ok(Flow::Look(None))
            }
            Err(e) => self.pause_gave_up(myself, st, e).await.map(Flow::Done),
        }
    }

    /// Resume: recorded Starting (Resuming), then the driver's resume (under the pause's
    /// deadline).
    async fn resume_step(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        driver: &Arc<dyn ComputeDriver>,
    ) -> Result<Flow, ActorProcessingErr> {
        set_phase(
            st,
            Phase::Starting,
            "Resuming",
            "bringing the saved processes back",
        );
        self.persist_if_changed(st).await?;
        let request = pb::ResumeRequest {
            sandbox_id: st.stored.id().to_string(),
        };
        let within = st.shared.config.lifetimes.pause_timeout;
        super::attach_done(st);
        match with_deadline_of(st, "resume", within, driver.resume(request)).await {
            Ok(snapshot) => Ok(Flow::Look(Some(Observed::from_snapshot(&snapshot)))),
            Err(DriverError::NotFound { .. }) => Ok(Flow::Look(Some(Observed::Absent))),
            Err(e) => self.failed(myself, st, e).await,
        }
    }

    /// What this sandbox's run gets on top of its spec's environment: its providers'
    /// credentials and its settings, read now (so every start sees the current ones).
    pub(super) async fn run_env(
        &self,
        st: &SandboxState,
    ) -> Result<std::collections::HashMap<String, String>> {
        let env = crate::owned::run_env(
            st.shared.store.as_ref(),
            &st.shared.config.secrets,
            st.stored.id(),
        )
        .await?;
        Ok(env.into_iter().collect())
    }

    /// A run whose environment cannot be made: a store that failed is retried like a driver
    /// that failed; credentials that cannot be opened (or too many) settle the sandbox in
    /// Error saying which, until start or restart.
    pub(super) async fn run_env_failed(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        e: ActorError,
    ) -> Result<Outcome, ActorProcessingErr> {
        if let ActorError::FailedPrecondition(why) = &e {
            set_phase(
                st,
                Phase::Error,
                "CredentialsUnavailable",
                &format!("{why}; then start or restart"),
            );
            st.attempts = 0;
            self.persist(st).await?;
            return Ok(Outcome::Settled);
        }
        self.driver_failed(myself, st, DriverError::Unavailable(e.to_string()))
            .await
    }

    /// A driver call failed: settle in Error for errors a retry cannot fix, retry with
    /// backoff for the others, and settle in Error once the attempts are spent.
    pub(super) async fn driver_failed(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        e: DriverError,
    ) -> Result<Outcome, ActorProcessingErr> {
        if matches!(&e, DriverError::FailedPrecondition(m) if m.starts_with("fenced:")) {
            // A newer holder of the workspace reached the node: this gateway no longer acts
            // for it, and writes nothing about it. From now on its requests are refused
            // (naming the holder), and its lease loop lets the workspace go at its next round.
            tracing::warn!(sandbox = %st.stored.id(), "the node fenced this gateway's call: {e}");
            st.shared
                .drivers
                .nodes()
                .set_fence(st.stored.workspace_id(), None);
            return Err(format!("fenced: {e}").into());
        }
        let cfg = &st.shared.config;
        if !e.is_transient() {
            set_phase(
                st,
                Phase::Error,
                "DriverRejected",
                &format!("the driver refused: {e}; fix the cause, then start or restart"),
            );
            st.attempts = 0;
            self.persist(st).await?;
            return Ok(Outcome::Settled);
        }
        st.attempts += 1;
        if st.attempts >= cfg.max_driver_attempts && desired(st) == DesiredState::Paused {
            return self.pause_gave_up(myself, st, e).await;
        }
        if st.attempts >= cfg.max_driver_attempts {
            let msg = format!(
                "the driver failed {} attempts, last: {e}; start or restart tries again, and so does the reconciler",
                st.attempts
            );
            set_phase(st, Phase::Error, "DriverUnavailable", &msg);
            self.persist(st).await?;
            return Ok(Outcome::Settled);
        }
        let delay = backoff(cfg.retry_backoff, cfg.max_retry_backoff, st.attempts - 1);
        st.stored.sandbox.message = format!(
            "attempt {} of {} failed: {e}; retrying in {delay:?}",
            st.attempts, cfg.max_driver_attempts
        );
        self.persist(st).await?;
        st.retry_due = Some(std::time::Instant::now() + delay);
        myself.send_after(delay, || SandboxMsg::Retry);
        Ok(Outcome::Retrying(e))
    }

    pub(super) async fn observe(
        &self,
        st: &SandboxState,
        driver: &Arc<dyn ComputeDriver>,
    ) -> Result<Observed, DriverError> {
        let request = pb::GetRequest {
            sandbox_id: st.stored.id().to_string(),
        };
        match with_deadline(st, "get", driver.get(request)).await {
            Ok(snapshot) => Ok(Observed::from_snapshot(&snapshot)),
            Err(DriverError::NotFound { .. }) => Ok(Observed::Absent),
            Err(e) => Err(e),
        }
    }

    pub(super) async fn stop_workload(
        &self,
        st: &SandboxState,
        driver: &Arc<dyn ComputeDriver>,
    ) -> Result<Observed, DriverError> {
        let grace = st
            .shared
            .config
            .stop_grace
            .as_millis()
            .min(u32::MAX as u128) as u32;
        let request = pb::StopRequest {
            sandbox_id: st.stored.id().to_string(),
            grace_period_ms: grace,
        };
        match with_deadline(st, "stop", driver.stop(request)).await {
            Ok(snapshot) => Ok(Observed::from_snapshot(&snapshot)),
            Err(DriverError::NotFound { .. }) => Ok(Observed::Absent),
            Err(e) => Err(e),
        }
    }

    pub(super) fn driver(&self, st: &SandboxState) -> Result<Arc<dyn ComputeDriver>, DriverError> {
        st.shared
            .drivers
            .for_sandbox(&st.stored.sandbox)
            .map_err(|e| DriverError::FailedPrecondition(e.to_string()))
    }
}

pub(super) fn apply(st: &mut SandboxState, change: PhaseChange) {
    let PhaseChange {
        phase,
        reason,
        message,
        desired,
        exit,
    } = change;
    if phase == Phase::Paused && reason.is_empty() {
        // Paused keeps the reason its pause was asked for (recorded on Pausing).
        st.stored.sandbox.set_phase(phase);
    } else if phase == Phase::Stopped
        && reason.is_empty()
        && let Some((reason, message)) = st.why.clone().or_else(|| {
            (st.stored.sandbox.phase() == Phase::Stopping)
                .then(|| deadline_reason(&st.stored.sandbox))
                .flatten()
        })
    {
        // Stopped by a deadline: its reason (kept on Stopping across an actor's restart).
        set_phase(st, phase, &reason, &message);
    } else {
        set_phase(st, phase, &reason, &message);
    }
    if let Some(desired) = desired {
        st.stored.sandbox.set_desired_state(desired);
    }
    if let Some((code, signal)) = exit {
        st.stored.sandbox.exit_code = Some(code);
        st.stored.sandbox.exit_signal = signal;
    }
}

/// Runs a driver call under the configured deadline: a driver that never answers costs one
/// deadline, not the actor.
pub(super) async fn with_deadline<T>(
    st: &SandboxState,
    operation: &'static str,
    call: impl Future<Output = Result<T, DriverError>>,
) -> Result<T, DriverError> {
    with_deadline_of(st, operation, st.shared.config.driver_call_timeout, call).await
}

/// [`with_deadline`] with a deadline of its own (a pause moves a whole memory to disk).
pub(super) async fn with_deadline_of<T>(
    st: &SandboxState,
    operation: &'static str,
    after: Duration,
    call: impl Future<Output = Result<T, DriverError>>,
) -> Result<T, DriverError> {
    let began = std::time::Instant::now();
    let result = tokio::time::timeout(after, call)
        .await
        .unwrap_or(Err(DriverError::DeadlineExceeded { operation, after }));
    let metrics = &st.shared.config.metrics;
    if metrics.enabled() {
        let driver = st
            .stored
            .sandbox
            .spec
            .as_ref()
            .map(|s| s.driver.as_str())
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| st.shared.drivers.default_name());
        metrics.driver_call(driver, operation, began.elapsed(), &result);
    }
    result
}
