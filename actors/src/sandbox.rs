//! The sandbox actor: one per sandbox UUID, the only writer of that sandbox's record.
//!
//! Its mailbox serializes every lifecycle command (start, stop, restart, delete) and every
//! observation of the sandbox's workload. For each step it persists the intent first (a fresh
//! runtime generation for every start), calls the driver with a deadline, and persists the
//! outcome. Reads never come here: they read the store, which the actor writes before it
//! answers.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_proto::v1::{DesiredState, EventType, Phase};
use uuid::Uuid;

use crate::config::Shared;
use crate::error::{ActorError, Result, disk_full_in};
use crate::lease::Lease;
use crate::lifecycle::{Current, Observed, PhaseChange, Step, plan};
use crate::lifetime::{self, Action, Busy, Due, Why};
use crate::protocol::SandboxMsg;
use crate::records::StoredSandbox;
use crate::supervision::backoff;

/// The exit reason of a sandbox actor that ends because its sandbox was deleted. Its
/// supervisor does not restart it.
pub const DELETED: &str = "deleted";

/// The most steps one convergence takes before it yields and retries later (each step is a
/// driver call; a well-behaved driver needs at most three).
const MAX_STEPS: usize = 8;

pub struct SandboxActor;

pub struct SandboxArgs {
    pub id: Uuid,
    pub shared: Arc<Shared>,
    /// Count this actor's first look in the startup tracker.
    pub report_attach: bool,
}

pub struct SandboxState {
    /// Held for the actor's whole life; dropping the state releases it.
    _lease: Lease,
    shared: Arc<Shared>,
    stored: StoredSandbox,
    /// True until the first convergence ends: only a fresh actor adopts a drifted workload.
    fresh: bool,
    /// Consecutive failed driver attempts of the current step.
    attempts: u32,
    /// When the scheduled `Retry` is due. Observations wait for it instead of adding driver
    /// calls — but not past its due time: a retry that never arrived must not park the
    /// sandbox for good.
    retry_due: Option<std::time::Instant>,
    report_attach: bool,
    /// The sandbox's events in the store, oldest first (`crate::journal`).
    journal: crate::journal::Kept,
    /// Why the step under way was asked for by the gateway itself (a deadline: its reason and
    /// message), recorded on the phase it ends in; `None` for a client's command.
    why: Option<(String, String)>,
    /// The timer armed for the sandbox's next deadline, and that deadline.
    timer: Option<(SystemTime, tokio::task::JoinHandle<()>)>,
    /// When the current idle window began (the sandbox became Ready, or was last busy); `None`
    /// while it is not Ready.
    idle_from: Option<SystemTime>,
    /// The workload's CPU time when the idle window's CPU was first read, and when.
    idle_cpu: Option<(SystemTime, u64)>,
    /// The idle window (its start) whose first CPU read was tried.
    idle_cpu_read_for: Option<SystemTime>,
    /// The deadline last acted upon: one still due after it fired (its step failed and is
    /// retried) is not fired again at once.
    last_fired: Option<SystemTime>,
}

/// One read of a workload's CPU time.
enum CpuRead {
    Nanos(u64),
    /// Its driver reads no usage (Unimplemented): idleness is use alone.
    NoStats,
    /// The read failed now (the driver did not answer): not known.
    Failed,
}

/// The CPU an idle window's workload used.
enum WindowCpu {
    /// Cores on average since the window's first read.
    Cores(f64),
    /// Read now for the first time in this window.
    NoBaseline,
    /// Its driver reads none (or failed to).
    Unreadable,
}

impl Drop for SandboxState {
    fn drop(&mut self) {
        if let Some((_, timer)) = self.timer.take() {
            timer.abort();
        }
    }
}

/// How long past its due time a scheduled retry may be late before observations act anyway.
const RETRY_GRACE: Duration = Duration::from_secs(2);

/// How a convergence ended.
enum Outcome {
    Settled,
    /// The step failed against the driver and a retry is scheduled.
    Retrying(DriverError),
    Deleted,
    /// A pause the driver could not make: the workload runs on (recorded Ready, reason
    /// PauseFailed), and the caller is told why.
    PauseRefused(DriverError),
}

impl Actor for SandboxActor {
    type Msg = SandboxMsg;
    type State = SandboxState;
    type Arguments = SandboxArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<SandboxMsg>,
        args: SandboxArgs,
    ) -> Result<SandboxState, ActorProcessingErr> {
        let SandboxArgs {
            id,
            shared,
            report_attach,
        } = args;
        let lease = shared
            .leases
            .acquire(id, shared.config.lease_wait)
            .await
            .ok_or_else(|| format!("another actor for sandbox {id} is still alive"))?;
        let record = shared
            .store
            .get(id)
            .await?
            .ok_or_else(|| format!("sandbox {id} has no record"))?;
        let stored = StoredSandbox::from_record(record)?;
        let mut journal = crate::journal::Kept::load(&*shared.store, id).await;
        // A sandbox just made: nothing ran yet, nothing was told yet.
        if journal.is_empty() && stored.sandbox.phase() == Phase::Provisioning {
            crate::journal::created(&shared, &mut journal, &stored.sandbox);
        }
        myself.send_message(SandboxMsg::Attach)?;
        Ok(SandboxState {
            journal,
            _lease: lease,
            shared,
            stored,
            fresh: true,
            attempts: 0,
            retry_due: None,
            report_attach,
            why: None,
            timer: None,
            idle_from: None,
            idle_cpu: None,
            idle_cpu_read_for: None,
            last_fired: None,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<SandboxMsg>,
        msg: SandboxMsg,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        let result = self.handle_msg(myself.clone(), msg, st).await;
        if result.is_ok() {
            self.arm(&myself, st).await;
        }
        match result {
            Err(e) if disk_full_in(&e).is_some() => {
                // The write did not happen: the actor stays alive as its record says, not as it
                // was about to be. A caller whose reply went with the message is answered
                // DiskFull by `Gateway` (it checks the store when an actor drops a request);
                // observations try again on the next sweep. No restart, so no restart loop.
                let before = StoredSandbox::from_record(st.stored.record.clone())?;
                st.stored = before;
                tracing::warn!(sandbox = %st.stored.id(), error = %e, "a step was not recorded: the store's disk is full; the sandbox stays as its record says");
                Ok(())
            }
            other => other,
        }
    }
}

impl SandboxActor {
    async fn handle_msg(
        &self,
        myself: ActorRef<SandboxMsg>,
        msg: SandboxMsg,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SandboxMsg::Attach => {
                let shared = Arc::clone(&st.shared);
                let outcome = {
                    let _permit = if st.report_attach {
                        shared.attach_permits.acquire().await.ok()
                    } else {
                        None
                    };
                    self.converge(&myself, st, None).await
                };
                st.fresh = false;
                if std::mem::take(&mut st.report_attach) {
                    st.shared.startup.attached();
                }
                self.after(&myself, st, outcome?).await;
            }
            SandboxMsg::Retry => {
                st.retry_due = None;
                let outcome = self.converge(&myself, st, None).await?;
                self.after(&myself, st, outcome).await;
            }
            SandboxMsg::Observe(snapshot) => {
                if let Some(s) = &snapshot {
                    self.note_denials(st, s).await?;
                }
                if st
                    .retry_due
                    .is_some_and(|due| std::time::Instant::now() < due + RETRY_GRACE)
                {
                    return Ok(());
                }
                let obs = snapshot
                    .as_ref()
                    .map(|s| Observed::from_snapshot(s))
                    .unwrap_or(Observed::Absent);
                // A deletion whose attempts ran out is tried again here, once per sweep.
                if desired(st) != DesiredState::Deleted
                    && plan(&current(st), &obs, false) == Step::Settled
                {
                    return Ok(());
                }
                // A settled Error gets one attempt per observation, not a new series.
                st.attempts = st
                    .attempts
                    .min(st.shared.config.max_driver_attempts.saturating_sub(1));
                // Look again, by id: the observation may be older than this actor's last step.
                let outcome = self.converge(&myself, st, None).await?;
                self.after(&myself, st, outcome).await;
            }
            SandboxMsg::Start(reply) => {
                if caller_gone(&reply, st, "start") {
                    return Ok(());
                }
                if let Err(e) = refuse_if_deleting(st, "start") {
                    let _ = reply.send(Err(e));
                    return Ok(());
                }
                if desired(st) == DesiredState::Running && st.stored.sandbox.phase() == Phase::Ready
                {
                    let _ = reply.send(Ok(st.stored.sandbox.clone()));
                    return Ok(());
                }
                st.stored.sandbox.set_desired_state(DesiredState::Running);
                st.attempts = 0;
                st.why = None;
                rearm_ttl(st);
                // An Error of a failed driver step is looked at, not assumed down: a resume that
                // failed leaves the workload paused in the driver, and a start then resumes it
                // rather than losing it. An Error of the workload's own end is down.
                let assumed = match st.stored.sandbox.phase() {
                    Phase::Stopped | Phase::Completed => Some(Observed::Stopped),
                    Phase::Error if current(st).exited => Some(Observed::Stopped),
                    _ => None,
                };
                let outcome = self.converge(&myself, st, assumed).await?;
                let _ = reply.send(Ok(st.stored.sandbox.clone()));
                self.after(&myself, st, outcome).await;
            }
            SandboxMsg::Stop(reply) => {
                if caller_gone(&reply, st, "stop") {
                    return Ok(());
                }
                if let Err(e) = refuse_if_deleting(st, "stop") {
                    let _ = reply.send(Err(e));
                    return Ok(());
                }
                let phase = st.stored.sandbox.phase();
                if desired(st) == DesiredState::Stopped
                    && matches!(phase, Phase::Stopped | Phase::Completed | Phase::Error)
                {
                    let _ = reply.send(Ok(st.stored.sandbox.clone()));
                    return Ok(());
                }
                st.stored.sandbox.set_desired_state(DesiredState::Stopped);
                st.attempts = 0;
                st.why = None;
                let assumed = (phase == Phase::Ready).then_some(Observed::Running {
                    generation: st.stored.sandbox.generation,
                });
                let outcome = self.converge(&myself, st, assumed).await?;
                let _ = reply.send(Ok(st.stored.sandbox.clone()));
                self.after(&myself, st, outcome).await;
            }
            SandboxMsg::Restart(reply) => {
                if caller_gone(&reply, st, "restart") {
                    return Ok(());
                }
                if let Err(e) = refuse_if_deleting(st, "restart") {
                    let _ = reply.send(Err(e));
                    return Ok(());
                }
                st.stored.sandbox.set_desired_state(DesiredState::Running);
                st.attempts = 0;
                st.why = None;
                rearm_ttl(st);
                set_phase(
                    st,
                    Phase::Stopping,
                    "Restarting",
                    "stopping the workload to start it again",
                );
                self.persist(st).await?;
                let stopped = match self.driver(st) {
                    Ok(driver) => self.stop_workload(st, &driver).await,
                    Err(e) => Err(e),
                };
                let outcome = match stopped {
                    // The workload is down, or gone: start it again from there.
                    Ok(Observed::Absent) => {
                        self.converge(&myself, st, Some(Observed::Absent)).await?
                    }
                    Ok(_) => self.converge(&myself, st, Some(Observed::Stopped)).await?,
                    Err(e) => self.driver_failed(&myself, st, e).await?,
                };
                let _ = reply.send(Ok(st.stored.sandbox.clone()));
                self.after(&myself, st, outcome).await;
            }
            SandboxMsg::Pause(reply) => {
                if caller_gone(&reply, st, "pause") {
                    return Ok(());
                }
                let answer = self.pause(&myself, st).await?;
                let _ = reply.send(answer);
            }
            SandboxMsg::Resume(reply) => {
                if caller_gone(&reply, st, "resume") {
                    return Ok(());
                }
                let answer = self.resume(&myself, st).await?;
                let _ = reply.send(answer);
            }
            SandboxMsg::SetTtl { seconds, reply } => {
                if caller_gone(&reply, st, "set the ttl of") {
                    return Ok(());
                }
                if let Err(e) = refuse_if_deleting(st, "set the ttl of") {
                    let _ = reply.send(Err(e));
                    return Ok(());
                }
                // The deadline moves to now + the ttl, and the ttl is this one from now on (a
                // later start or resume that finds the deadline passed re-arms it from this):
                // E2B's set_timeout. 0 removes both.
                let sb = &mut st.stored.sandbox;
                sb.expires_at = lifetime::after(SystemTime::now(), seconds).map(Into::into);
                sb.spec
                    .get_or_insert_with(Default::default)
                    .lifetime
                    .get_or_insert_with(Default::default)
                    .ttl_seconds = seconds;
                self.persist(st).await?;
                let _ = reply.send(Ok(st.stored.sandbox.clone()));
            }
            SandboxMsg::Deadline => {
                st.timer = None;
                self.deadline(&myself, st).await?;
            }
            SandboxMsg::SetSettings { values, reply } => {
                if caller_gone(&reply, st, "set settings") {
                    return Ok(());
                }
                let result = match refuse_if_deleting(st, "set settings of") {
                    Err(e) => Err(e),
                    Ok(()) => {
                        crate::owned::write_settings(
                            st.shared.store.as_ref(),
                            st.stored.workspace_id(),
                            st.stored.id(),
                            &values,
                        )
                        .await
                    }
                };
                let _ = reply.send(result);
            }
            SandboxMsg::UpdateNetwork { policy, reply } => {
                if caller_gone(&reply, st, "update the network") {
                    return Ok(());
                }
                let result = self.update_network(st, policy).await;
                let _ = reply.send(result);
            }
            SandboxMsg::DeleteSetting { key, reply } => {
                let result = match refuse_if_deleting(st, "delete a setting of") {
                    Err(e) => Err(e),
                    Ok(()) => {
                        crate::owned::delete_setting(st.shared.store.as_ref(), st.stored.id(), &key)
                            .await
                    }
                };
                let _ = reply.send(result);
            }
            SandboxMsg::Delete(reply) => {
                if desired(st) != DesiredState::Deleted {
                    st.stored.sandbox.set_desired_state(DesiredState::Deleted);
                    set_phase(st, Phase::Deleting, "", "");
                    self.persist(st).await?;
                }
                st.attempts = 0;
                match self.converge(&myself, st, Some(Observed::Absent)).await? {
                    Outcome::Deleted => {
                        let _ = reply.send(Ok(true));
                        myself.stop(Some(DELETED.to_string()));
                    }
                    other => {
                        let why = match &other {
                            Outcome::Retrying(e) => e.to_string(),
                            _ => st.stored.sandbox.message.clone(),
                        };
                        let _ = reply.send(Err(ActorError::Unavailable(format!(
                            "sandbox {} is being deleted but the driver has not confirmed it ({why}); deletion is retried",
                            st.stored.id()
                        ))));
                        self.after(&myself, st, other).await;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Whether `reason` is one a deadline records (`crate::lifetime::Why`).
fn is_deadline_reason(reason: &str) -> bool {
    [Why::TtlExpired, Why::Idle, Why::DeleteAfter]
        .iter()
        .any(|w| w.as_str() == reason)
}

/// The deadline's reason and message a record holds (a pause or stop a deadline began).
fn deadline_reason(sb: &sbx_proto::v1::Sandbox) -> Option<(String, String)> {
    is_deadline_reason(&sb.reason).then(|| (sb.reason.clone(), sb.message.clone()))
}

fn desired(st: &SandboxState) -> DesiredState {
    desired_of(&st.stored.sandbox)
}

fn desired_of(sb: &sbx_proto::v1::Sandbox) -> DesiredState {
    match sb.desired_state() {
        DesiredState::Unspecified => DesiredState::Running,
        d => d,
    }
}

fn current(st: &SandboxState) -> Current {
    let sb = &st.stored.sandbox;
    let phase = sb.phase();
    Current {
        desired: desired(st),
        phase,
        generation: sb.generation,
        // A recorded exit: Completed, or Error for the workload's own reason (a failed driver
        // step's reasons are DriverRejected, DriverUnavailable and PauseFailed).
        exited: phase == Phase::Completed
            || (phase == Phase::Error
                && !sb.reason.starts_with("Driver")
                && sb.reason != "PauseFailed"),
    }
}

fn set_phase(st: &mut SandboxState, phase: Phase, reason: &str, message: &str) {
    let sb = &mut st.stored.sandbox;
    // How the last run ended is told until something else happens to the workload (a
    // start, a stop); an exit being recorded sets it again after this (`apply`).
    if phase != sb.phase() && !matches!(phase, Phase::Completed | Phase::Error) {
        sb.exit_code = None;
        sb.exit_signal = 0;
    }
    sb.set_phase(phase);
    sb.reason = reason.to_string();
    sb.message = message.to_string();
}

fn refuse_if_deleting(st: &SandboxState, what: &str) -> Result<()> {
    if desired(st) == DesiredState::Deleted {
        return Err(ActorError::FailedPrecondition(format!(
            "cannot {what} sandbox {} ({}): it is being deleted",
            st.stored.sandbox.name,
            st.stored.id()
        )));
    }
    Ok(())
}

impl SandboxActor {
    /// Drives the sandbox towards its desired state, one plan step at a time.
    async fn converge(
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
            match step {
                Step::Settled => {
                    st.attempts = 0;
                    self.persist_if_changed(st).await?;
                    return Ok(Outcome::Settled);
                }
                Step::Record(change) => {
                    apply(st, change);
                    st.attempts = 0;
                    self.persist(st).await?;
                    return Ok(Outcome::Settled);
                }
                Step::Create { generation } => {
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
                        Err(e) => return self.run_env_failed(myself, st, e).await,
                    };
                    let request = pb::CreateRequest {
                        run_env,
                        ..create_request(st)
                    };
                    match with_deadline(st, "create", driver.create(request)).await {
                        Ok(snapshot) => next = Some(Observed::from_snapshot(&snapshot)),
                        Err(DriverError::GenerationMismatch { running, .. }) => {
                            next = Some(Observed::Running {
                                generation: running,
                            })
                        }
                        Err(e) => return self.driver_failed(myself, st, e).await,
                    }
                }
                Step::Prepare { generation } => {
                    st.stored.sandbox.generation = generation;
                    self.persist_if_changed(st).await?;
                    let request = pb::CreateRequest {
                        stopped: true,
                        ..create_request(st)
                    };
                    match with_deadline(st, "create", driver.create(request)).await {
                        Ok(snapshot) => next = Some(Observed::from_snapshot(&snapshot)),
                        Err(e) => return self.driver_failed(myself, st, e).await,
                    }
                }
                Step::Start { generation } => {
                    st.stored.sandbox.generation = generation;
                    set_phase(st, Phase::Starting, "", "");
                    self.persist_if_changed(st).await?;
                    let run_env = match self.run_env(st).await {
                        Ok(env) => env,
                        Err(e) => return self.run_env_failed(myself, st, e).await,
                    };
                    let request = pb::StartRequest {
                        run_env,
                        sandbox_id: st.stored.id().to_string(),
                        generation,
                    };
                    match with_deadline(st, "start", driver.start(request)).await {
                        Ok(snapshot) => next = Some(Observed::from_snapshot(&snapshot)),
                        Err(DriverError::NotFound { .. }) => next = Some(Observed::Absent),
                        Err(DriverError::GenerationMismatch { running, .. }) => {
                            next = Some(Observed::Running {
                                generation: running,
                            })
                        }
                        Err(e) => return self.driver_failed(myself, st, e).await,
                    }
                }
                Step::Stop => {
                    if st.stored.sandbox.phase() != Phase::Stopping {
                        let (reason, message) = st.why.clone().unwrap_or_default();
                        set_phase(st, Phase::Stopping, &reason, &message);
                    }
                    self.persist_if_changed(st).await?;
                    match self.stop_workload(st, &driver).await {
                        Ok(obs) => next = Some(obs),
                        Err(e) => return self.driver_failed(myself, st, e).await,
                    }
                }
                Step::Delete => {
                    if st.stored.sandbox.phase() != Phase::Deleting {
                        set_phase(st, Phase::Deleting, "", "");
                        self.persist(st).await?;
                    }
                    let request = pb::DeleteRequest {
                        sandbox_id: st.stored.id().to_string(),
                    };
                    match with_deadline(st, "delete", driver.delete(request)).await {
                        Ok(_) | Err(DriverError::NotFound { .. }) => {}
                        Err(e) => return self.driver_failed(myself, st, e).await,
                    }
                    self.delete_record(st).await?;
                    return Ok(Outcome::Deleted);
                }
                Step::Adopt { generation } => {
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
                    return Ok(Outcome::Settled);
                }
                Step::Pause => {
                    if st.stored.sandbox.phase() != Phase::Pausing {
                        // Whose pause this is: the step's, else a deadline's the record holds
                        // (a pause tried again after a failure), else a call's.
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
                    match with_deadline_of(st, "pause", within, driver.pause(request)).await {
                        Ok(snapshot) => next = Some(Observed::from_snapshot(&snapshot)),
                        Err(DriverError::NotFound { .. }) => next = Some(Observed::Absent),
                        Err(e) if e.is_transient() => {
                            return self.driver_failed(myself, st, e).await;
                        }
                        Err(DriverError::FailedPrecondition(why)) if !pause_refused => {
                            tracing::debug!(sandbox = %st.stored.id(), %why, "the pause was refused; looking again");
                            pause_refused = true;
                        }
                        Err(e) => return self.pause_gave_up(myself, st, e).await,
                    }
                }
                Step::Resume => {
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
                    match with_deadline_of(st, "resume", within, driver.resume(request)).await {
                        Ok(snapshot) => next = Some(Observed::from_snapshot(&snapshot)),
                        Err(DriverError::NotFound { .. }) => next = Some(Observed::Absent),
                        Err(e) => return self.driver_failed(myself, st, e).await,
                    }
                }
                Step::Drift { persisted, running } => {
                    tracing::warn!(sandbox = %st.stored.id(), persisted, running, "generation drift: the actor restarts to reconcile");
                    return Err(format!(
                        "sandbox {}: the driver runs generation {running} but the record says {persisted}; restarting the actor to reconcile",
                        st.stored.id()
                    )
                    .into());
                }
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

    /// After a convergence: an actor whose sandbox is gone stops; a step that settled is no
    /// longer the one a deadline asked for.
    async fn after(&self, myself: &ActorRef<SandboxMsg>, st: &mut SandboxState, outcome: Outcome) {
        match outcome {
            Outcome::Deleted => myself.stop(Some(DELETED.to_string())),
            Outcome::Settled | Outcome::PauseRefused(_) => st.why = None,
            Outcome::Retrying(_) => {}
        }
    }

    /// A pause the driver did not make (it refused, or failed every attempt). A deadline's is
    /// a stop instead, so the sandbox never runs on past its lifetime (its files kept; the
    /// stop is the next step, with the deadline's reason). A call's leaves the workload as the
    /// driver keeps it, running, and wanted so (Ready when the driver said why it refused,
    /// Error when it did not answer: the next look records what runs), reason PauseFailed.
    async fn pause_gave_up(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        e: DriverError,
    ) -> Result<Outcome, ActorProcessingErr> {
        st.attempts = 0;
        st.retry_due = None;
        let deadline = st
            .why
            .clone()
            .filter(|(reason, _)| is_deadline_reason(reason))
            .or_else(|| deadline_reason(&st.stored.sandbox));
        match deadline {
            Some((reason, message)) => {
                let message = format!("{message}; it could not be paused ({e}), so it was stopped");
                tracing::warn!(sandbox = %st.stored.id(), "{message}");
                st.why = Some((reason.clone(), message.clone()));
                st.stored.sandbox.set_desired_state(DesiredState::Stopped);
                set_phase(st, Phase::Stopping, &reason, &message);
                self.persist(st).await?;
                myself.send_message(SandboxMsg::Retry)?;
            }
            None => {
                st.stored.sandbox.set_desired_state(DesiredState::Running);
                let phase = if e.is_transient() {
                    Phase::Error
                } else {
                    Phase::Ready
                };
                set_phase(
                    st,
                    phase,
                    "PauseFailed",
                    &format!("the driver could not pause the sandbox: {e}; it runs on"),
                );
                self.persist(st).await?;
            }
        }
        Ok(Outcome::PauseRefused(e))
    }

    /// A PauseSandbox call: only a Ready sandbox on a driver that can pause is paused.
    async fn pause(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
    ) -> Result<Result<sbx_proto::v1::Sandbox>, ActorProcessingErr> {
        if let Err(e) = refuse_if_deleting(st, "pause") {
            return Ok(Err(e));
        }
        let phase = st.stored.sandbox.phase();
        if desired(st) == DesiredState::Paused && phase == Phase::Paused {
            return Ok(Ok(st.stored.sandbox.clone()));
        }
        if phase != Phase::Ready || desired(st) != DesiredState::Running {
            return Ok(Err(ActorError::FailedPrecondition(format!(
                "cannot pause sandbox {:?}: it is {phase:?}, not Ready",
                st.stored.sandbox.name
            ))));
        }
        if let Err(e) = self.can_pause(st).await {
            return Ok(Err(e));
        }
        st.why = Some((
            lifetime::PAUSED_BY_CALL.to_string(),
            "paused by a PauseSandbox call".to_string(),
        ));
        let outcome = self.begin_pause(myself, st).await?;
        let answer = settled_in(st, &outcome, Phase::Paused, "pause");
        self.after(myself, st, outcome).await;
        Ok(answer)
    }

    /// Wants the sandbox paused and converges there.
    async fn begin_pause(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
    ) -> Result<Outcome, ActorProcessingErr> {
        st.stored.sandbox.set_desired_state(DesiredState::Paused);
        st.attempts = 0;
        let assumed = (st.stored.sandbox.phase() == Phase::Ready).then_some(Observed::Running {
            generation: st.stored.sandbox.generation,
        });
        self.converge(myself, st, assumed).await
    }

    /// A ResumeSandbox call (and an automatic resume before a use).
    async fn resume(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
    ) -> Result<Result<sbx_proto::v1::Sandbox>, ActorProcessingErr> {
        if let Err(e) = refuse_if_deleting(st, "resume") {
            return Ok(Err(e));
        }
        let phase = st.stored.sandbox.phase();
        if desired(st) == DesiredState::Running && phase == Phase::Ready {
            return Ok(Ok(st.stored.sandbox.clone()));
        }
        let not_paused = || {
            Err(ActorError::FailedPrecondition(format!(
                "cannot resume sandbox {:?}: it is {phase:?}, not Paused (start it instead)",
                st.stored.sandbox.name
            )))
        };
        let mut look = None;
        if desired(st) != DesiredState::Paused && !matches!(phase, Phase::Paused | Phase::Pausing) {
            // A resume that failed (Error, or Starting with its retry pending) left the
            // workload paused in the driver: look, and resume it if so.
            if !matches!(phase, Phase::Error | Phase::Starting) {
                return Ok(not_paused());
            }
            let observed = match self.driver(st) {
                Ok(driver) => self.observe(st, &driver).await,
                Err(e) => Err(e),
            };
            match observed {
                Ok(obs @ Observed::Paused { .. }) => look = Some(obs),
                Ok(_) => return Ok(not_paused()),
                Err(e) => return Ok(Err(e.into())),
            }
        }
        st.stored.sandbox.set_desired_state(DesiredState::Running);
        st.attempts = 0;
        st.why = None;
        rearm_ttl(st);
        let outcome = self.converge(myself, st, look).await?;
        let answer = settled_in(st, &outcome, Phase::Ready, "resume");
        self.after(myself, st, outcome).await;
        Ok(answer)
    }

    /// FailedPrecondition unless the sandbox's driver has the `pause` capability.
    async fn can_pause(&self, st: &SandboxState) -> Result<()> {
        let driver = self.driver(st)?;
        let caps = with_deadline(st, "capabilities", driver.capabilities())
            .await
            .map_err(|e| {
                if e.is_transient() {
                    ActorError::Unavailable(format!(
                        "could not ask the driver whether it can pause: {e}; try again"
                    ))
                } else {
                    e.into()
                }
            })?;
        if caps.pause {
            return Ok(());
        }
        Err(ActorError::FailedPrecondition(format!(
            "sandbox {:?} runs on the {} driver, which cannot pause a sandbox (no `pause` \
             capability); stop it instead",
            st.stored.sandbox.name, caps.driver
        )))
    }

    /// The timer of the sandbox's next deadline rang: act on it, unless it moved (a ttl call,
    /// a use) or its sandbox turned out busy.
    async fn deadline(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        let now = SystemTime::now();
        let Some(due) = lifetime::next(&st.stored.sandbox, st.idle_from) else {
            return Ok(());
        };
        if due.at > now {
            // Moved since it was armed (or the clock stepped): the new one is armed after
            // this message. Never acted on before its time.
            return Ok(());
        }
        if due.why == Why::Idle {
            let from = st.idle_from.unwrap_or(now);
            let (open, last_end) = st.shared.activity.of(st.stored.id());
            let busy = match self.window_cpu(st, now).await {
                WindowCpu::Cores(cores) => lifetime::busy(
                    from,
                    now,
                    open,
                    last_end,
                    Some(cores),
                    st.shared.config.lifetimes.idle_cpu_cores,
                ),
                WindowCpu::Unreadable => lifetime::busy(from, now, open, last_end, None, 0.0),
                // The window's first CPU read is only now: measure one whole window from here.
                WindowCpu::NoBaseline => Busy::Until(now),
            };
            if let Busy::Until(from) = busy {
                tracing::debug!(sandbox = %st.stored.id(), open, "not idle: a new idle window");
                st.idle_from = Some(from);
                return Ok(());
            }
        }
        st.last_fired = Some(due.at);
        self.fire(myself, st, due).await
    }

    /// Does what a deadline says, recording why.
    async fn fire(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        due: Due,
    ) -> Result<(), ActorProcessingErr> {
        let l = lifetime::lifetime_of(&st.stored.sandbox);
        let reason = due.why.as_str().to_string();
        let message = match due.why {
            Why::TtlExpired => "its ttl deadline passed".to_string(),
            Why::Idle => format!(
                "idle for {} s: no exec, copy, port-forward, log follow or routed request, and \
                 under {} cores of CPU",
                l.idle_timeout_seconds, st.shared.config.lifetimes.idle_cpu_cores
            ),
            Why::DeleteAfter => format!("finished for {} s (delete_after)", l.delete_after_seconds),
        };
        tracing::info!(sandbox = %st.stored.id(), action = due.action.as_str(), reason = %reason, "a lifetime deadline came");
        if due.why == Why::TtlExpired && due.action != Action::Delete {
            // Fired once: the same write that changes what is wanted clears the deadline.
            st.stored.sandbox.expires_at = None;
        }
        st.attempts = 0;
        let running = (st.stored.sandbox.phase() == Phase::Ready).then_some(Observed::Running {
            generation: st.stored.sandbox.generation,
        });
        let outcome = match due.action {
            Action::Delete => {
                st.stored.sandbox.set_desired_state(DesiredState::Deleted);
                set_phase(st, Phase::Deleting, &reason, &message);
                self.persist(st).await?;
                self.converge(myself, st, Some(Observed::Absent)).await?
            }
            Action::Stop => {
                st.why = Some((reason, message));
                st.stored.sandbox.set_desired_state(DesiredState::Stopped);
                self.converge(myself, st, running).await?
            }
            Action::Pause => match self.can_pause(st).await {
                // A pause that fails is stopped instead (`pause_gave_up`).
                Ok(()) => {
                    st.why = Some((reason, message));
                    self.begin_pause(myself, st).await?
                }
                // The driver did not answer: nothing changed; the deadline is tried again in a
                // second (`arm`), its memory not thrown away for a hiccup.
                Err(ActorError::Unavailable(why)) => {
                    tracing::warn!(sandbox = %st.stored.id(), "a deadline's pause waits: {why}");
                    if due.why == Why::TtlExpired {
                        st.stored.sandbox.expires_at = Some(due.at.into());
                    }
                    return Ok(());
                }
                // A driver that cannot pause (its capability changed since the create): the
                // sandbox never runs on past its lifetime, it is stopped (its files kept).
                Err(e) => {
                    st.why = Some((
                        reason,
                        format!("{message}; it could not be paused ({e}), so it was stopped"),
                    ));
                    st.stored.sandbox.set_desired_state(DesiredState::Stopped);
                    self.converge(myself, st, running).await?
                }
            },
        };
        self.after(myself, st, outcome).await;
        Ok(())
    }

    /// The cores the workload used on average since the idle window's CPU was last read, and
    /// a new read for the next window.
    async fn window_cpu(&self, st: &mut SandboxState, now: SystemTime) -> WindowCpu {
        let before = st.idle_cpu.take();
        let cpu = match self.read_cpu(st).await {
            CpuRead::Nanos(cpu) => cpu,
            CpuRead::NoStats => return WindowCpu::Unreadable,
            // Not known, so not idle: a new window, read again at its start.
            CpuRead::Failed => return WindowCpu::NoBaseline,
        };
        st.idle_cpu = Some((now, cpu));
        match before {
            // A counter below its baseline was restarted (a new run): not a figure.
            Some((then, was)) if cpu >= was => {
                let secs = now
                    .duration_since(then)
                    .unwrap_or_default()
                    .as_secs_f64()
                    .max(0.001);
                WindowCpu::Cores((cpu - was) as f64 / 1e9 / secs)
            }
            _ => WindowCpu::NoBaseline,
        }
    }

    /// The workload's CPU time (nanoseconds), from its driver.
    async fn read_cpu(&self, st: &SandboxState) -> CpuRead {
        let Ok(driver) = self.driver(st) else {
            return CpuRead::Failed;
        };
        let request = pb::StatsRequest {
            sandbox_id: st.stored.id().to_string(),
        };
        match with_deadline(st, "stats", driver.stats(request)).await {
            Ok(usage) => CpuRead::Nanos(usage.cpu_nanos),
            Err(DriverError::Unimplemented(_)) => CpuRead::NoStats,
            Err(e) => {
                tracing::debug!(sandbox = %st.stored.id(), error = %e, "no CPU figure for idleness now");
                CpuRead::Failed
            }
        }
    }

    /// Arms one timer for the sandbox's next deadline (after every message: what a step
    /// changed, the deadline follows), and takes the idle window's first CPU read.
    async fn arm(&self, myself: &ActorRef<SandboxMsg>, st: &mut SandboxState) {
        // Once per idle window: a driver that fails the read is not asked after every message.
        if st.idle_from.is_some()
            && st.idle_cpu.is_none()
            && st.idle_cpu_read_for != st.idle_from
            && lifetime::lifetime_of(&st.stored.sandbox).idle_timeout_seconds > 0
        {
            st.idle_cpu_read_for = st.idle_from;
            if let CpuRead::Nanos(cpu) = self.read_cpu(st).await {
                st.idle_cpu = Some((SystemTime::now(), cpu));
            }
        }
        let due = lifetime::next(&st.stored.sandbox, st.idle_from);
        let Some(due) = due else {
            if let Some((_, timer)) = st.timer.take() {
                timer.abort();
            }
            return;
        };
        if st.timer.as_ref().is_some_and(|(at, _)| *at == due.at) {
            return;
        }
        if let Some((_, timer)) = st.timer.take() {
            timer.abort();
        }
        let mut delay = lifetime::delay_until(due.at, SystemTime::now());
        if st.last_fired == Some(due.at) {
            // Fired already and still due (its step is being retried): not again at once.
            delay = delay.max(Duration::from_secs(1));
        }
        let me = myself.clone();
        let timer = tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = me.cast(SandboxMsg::Deadline);
        });
        st.timer = Some((due.at, timer));
    }

    /// A driver call failed: settle in Error for errors a retry cannot fix, retry with
    /// backoff for the others, and settle in Error once the attempts are spent.
    /// What this sandbox's run gets on top of its spec's environment: its providers'
    /// credentials and its settings, read now (so every start sees the current ones).
    async fn run_env(
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
    async fn run_env_failed(
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

    async fn driver_failed(
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

    async fn observe(
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

    async fn stop_workload(
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

    fn driver(&self, st: &SandboxState) -> Result<Arc<dyn ComputeDriver>, DriverError> {
        st.shared
            .drivers
            .for_sandbox(&st.stored.sandbox)
            .map_err(|e| DriverError::FailedPrecondition(e.to_string()))
    }

    async fn persist_if_changed(&self, st: &mut SandboxState) -> Result<(), ActorProcessingErr> {
        keep_lifetime(st);
        if st.stored.to_update().body != st.stored.record.body {
            self.persist(st).await?;
        }
        Ok(())
    }

    /// A live policy update: the new allowlist is written to the sandbox's record first, then
    /// the driver applies it; if the driver cannot, the record is put back (both say the old
    /// list) and the driver's error is the answer.
    async fn update_network(
        &self,
        st: &mut SandboxState,
        policy: sbx_proto::v1::NetworkPolicy,
    ) -> Result<pb::NetworkStatus> {
        use sbx_proto::v1::NetworkMode;
        refuse_if_deleting(st, "change the network of")?;
        let name = st.stored.sandbox.name.clone();
        let current = st
            .stored
            .sandbox
            .spec
            .as_ref()
            .and_then(|s| s.network.clone());
        if current.as_ref().map(|n| n.mode()) != Some(NetworkMode::Policy) {
            return Err(ActorError::FailedPrecondition(format!(
                "sandbox {name:?} was made with network mode none: the mode is fixed at create \
                 (make a new sandbox with --network policy)"
            )));
        }
        if policy.mode() != NetworkMode::Policy {
            return Err(ActorError::FailedPrecondition(format!(
                "the network mode of sandbox {name:?} is fixed at create: give mode policy with \
                 the new allowlist (an empty one denies everything)"
            )));
        }
        let driver = self.driver(st)?;
        let write = |st: &mut SandboxState, network: Option<sbx_proto::v1::NetworkPolicy>| {
            if let Some(spec) = st.stored.sandbox.spec.as_mut() {
                spec.network = network;
            }
        };
        write(st, Some(policy.clone()));
        let written = st.shared.store.update(st.stored.to_update()).await;
        match written {
            Ok(record) => st.stored = StoredSandbox::from_record(record)?,
            Err(e) => {
                write(st, current);
                return Err(e.into());
            }
        }
        st.shared
            .events
            .publish(EventType::Modified, st.stored.sandbox.clone());
        let request = pb::UpdateNetworkRequest {
            sandbox_id: st.stored.id().to_string(),
            policy: Some(pb::NetworkPolicy {
                mode: policy.mode,
                allow: policy.allow,
            }),
        };
        match driver.update_network(request).await {
            Ok(status) => Ok(status),
            Err(e) => {
                write(st, current);
                match st.shared.store.update(st.stored.to_update()).await {
                    Ok(record) => {
                        st.stored = StoredSandbox::from_record(record)?;
                        st.shared
                            .events
                            .publish(EventType::Modified, st.stored.sandbox.clone());
                    }
                    Err(put_back) => tracing::warn!(
                        sandbox_id = %st.stored.id(),
                        error = %put_back,
                        "the driver refused a network update and the old policy could not be written back"
                    ),
                }
                Err(e.into())
            }
        }
    }

    /// Records what the driver last saw the sandbox's egress policy refuse, and what the host
    /// refused it past its budgets, if that changed:
    /// one write and one MODIFIED event per change, and the driver's look is itself at most
    /// every few seconds (a sandbox hammering a refused port costs that, not a write per
    /// packet).
    async fn note_denials(
        &self,
        st: &mut SandboxState,
        s: &pb::Snapshot,
    ) -> Result<(), ActorProcessingErr> {
        let last = s
            .network_last_denial
            .clone()
            .map(crate::translate::public_denial);
        let refusals = s
            .budget_refusals
            .map(crate::translate::public_refusals)
            .filter(|r| *r != sbx_proto::v1::BudgetRefusals::default());
        let sandbox = &st.stored.sandbox;
        if desired(st) == DesiredState::Deleted
            || (sandbox.network_denied == s.network_denied
                && sandbox.network_last_denial == last
                && sandbox.budget_refusals == refusals)
        {
            return Ok(());
        }
        let before = sandbox.network_denied;
        let refused_before = sandbox.budget_refusals;
        st.stored.sandbox.network_denied = s.network_denied;
        st.stored.sandbox.network_last_denial = last;
        st.stored.sandbox.budget_refusals = refusals;
        self.persist(st).await?;
        let event = st.journal.note_denials(
            before,
            s.network_denied,
            st.stored.sandbox.network_last_denial.as_ref(),
        );
        tell(st, event);
        let event = st.journal.note_refusals(
            refused_before.as_ref(),
            st.stored.sandbox.budget_refusals.as_ref(),
        );
        tell(st, event);
        Ok(())
    }

    /// Writes the actor's view of the sandbox, checked against the version it last wrote.
    async fn persist(&self, st: &mut SandboxState) -> Result<(), ActorProcessingErr> {
        refuse_unless_held(st)?;
        keep_lifetime(st);
        let before = StoredSandbox::from_record(st.stored.record.clone()).map(|s| s.sandbox);
        let written = st.shared.store.update(st.stored.to_update()).await?;
        st.stored = StoredSandbox::from_record(written)?;
        st.shared
            .events
            .publish(EventType::Modified, st.stored.sandbox.clone());
        if let Ok(before) = before {
            let event = st.journal.note(&before, &st.stored.sandbox);
            tell(st, event);
        }
        Ok(())
    }

    async fn delete_record(&self, st: &mut SandboxState) -> Result<(), ActorProcessingErr> {
        refuse_unless_held(st)?;
        match st
            .shared
            .store
            .delete(st.stored.id(), st.stored.record.resource_version)
            .await
        {
            Ok(_) | Err(sbx_storage::StoreError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        st.shared.activity.forget(st.stored.id());
        let (cpu, memory) = crate::nodes::asks_of(&st.stored.sandbox);
        st.shared.drivers.nodes().release(
            crate::nodes::node_id_of(&st.stored.sandbox),
            cpu,
            memory,
        );
        st.shared
            .events
            .publish(EventType::Deleted, st.stored.sandbox.clone());
        Ok(())
    }
}

/// Writes `event` of the sandbox, if there is one (`crate::journal::write`).
fn tell(st: &mut SandboxState, event: Option<(&'static str, String, String)>) {
    if let Some((kind, reason, message)) = event {
        crate::journal::write(
            &st.shared,
            &mut st.journal,
            &st.stored.sandbox,
            (kind, &reason, &message),
        );
    }
}

/// Gateways sharing a store: a sandbox's record is written only while this gateway holds its
/// workspace's lease (as its lease loop last renewed it); a gateway that lost or could not
/// renew it writes nothing more about it.
fn refuse_unless_held(st: &SandboxState) -> Result<(), ActorProcessingErr> {
    if st.shared.ownership.is_none() {
        return Ok(());
    }
    let ws = st.stored.workspace_id();
    if st.shared.drivers.nodes().fence_of(ws).is_some() {
        Ok(())
    } else {
        Err(format!(
            "workspace {ws} is not held by this gateway (its lease is another's, or was not \
             renewed in time): nothing written"
        )
        .into())
    }
}

/// Whether the caller of a lifecycle command gave up (its call was cancelled, or timed out)
/// while the command waited its turn in the mailbox: then it is not carried out. A client
/// that gave up does not know whether it happened, so not doing it is a truthful outcome —
/// and a command acted on long after its caller left (a restart after the caller went on
/// believing the sandbox Ready) is not.
fn caller_gone<T>(reply: &ractor::RpcReplyPort<T>, st: &SandboxState, what: &str) -> bool {
    if !reply.is_closed() {
        return false;
    }
    tracing::info!(
        sandbox_id = %st.stored.id(),
        command = what,
        "the caller gave up before its turn; not carried out"
    );
    true
}

fn create_request(st: &SandboxState) -> pb::CreateRequest {
    let sb = &st.stored.sandbox;
    let spec = sb.spec.clone().unwrap_or_default();
    let resources = spec.resources.unwrap_or_default();
    pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: st.stored.id().to_string(),
        workspace: sb.workspace.clone(),
        name: sb.name.clone(),
        spec: Some(pb::SandboxSpec {
            command: spec.command,
            env: spec.env,
            resources: Some(pb::Resources {
                cpu_millis: resources.cpu_millis,
                memory_bytes: resources.memory_bytes,
                disk_bytes: resources.disk_bytes,
            }),
            // A driver with images is given the digest pinned at create, never the name.
            image: if spec.image_digest.is_empty() {
                spec.image
            } else {
                spec.image_digest
            },
            network: spec.network.map(|n| pb::NetworkPolicy {
                mode: n.mode,
                allow: n.allow,
            }),
        }),
        generation: sb.generation,
        stopped: false,
    }
}

fn apply(st: &mut SandboxState, change: PhaseChange) {
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

/// A start or resume gives the sandbox a ttl deadline again when the one it had passed (or
/// fired): now + its ttl.
fn rearm_ttl(st: &mut SandboxState) {
    st.stored.sandbox.expires_at =
        lifetime::rearmed_expiry(&st.stored.sandbox, SystemTime::now()).map(Into::into);
}

/// The answer to a pause or resume: the sandbox, once it settled in `wanted`; else why not.
fn settled_in(
    st: &SandboxState,
    outcome: &Outcome,
    wanted: Phase,
    what: &str,
) -> Result<sbx_proto::v1::Sandbox> {
    let sb = &st.stored.sandbox;
    match outcome {
        Outcome::Settled if sb.phase() == wanted => Ok(sb.clone()),
        // A driver that did not answer (its attempts spent): a client may try again.
        Outcome::PauseRefused(e) if e.is_transient() => Err(ActorError::Unavailable(format!(
            "the {what} of sandbox {:?} failed ({e}); it runs on, wanted running",
            sb.name
        ))),
        Outcome::PauseRefused(e) => Err(ActorError::Driver(e.clone())),
        Outcome::Retrying(e) => Err(ActorError::Unavailable(format!(
            "the {what} of sandbox {:?} failed ({e}) and is retried",
            sb.name
        ))),
        _ => Err(ActorError::FailedPrecondition(format!(
            "the {what} of sandbox {:?} did not happen: it is {:?} ({}: {})",
            sb.name,
            sb.phase(),
            sb.reason,
            sb.message
        ))),
    }
}

/// What the record says of the sandbox's lifetime, brought up to date before each write:
/// when it finished (what `delete_after` counts from), its idle window, its next deadline.
fn keep_lifetime(st: &mut SandboxState) {
    let now = SystemTime::now();
    let sb = &mut st.stored.sandbox;
    if lifetime::is_finished(sb) {
        if sb.finished_at.is_none() {
            sb.finished_at = Some(now.into());
        }
    } else {
        sb.finished_at = None;
    }
    if sb.phase() == Phase::Ready && desired_of(sb) == DesiredState::Running {
        if st.idle_from.is_none() {
            st.idle_from = Some(now);
            st.idle_cpu = None;
        }
    } else {
        st.idle_from = None;
        st.idle_cpu = None;
    }
    sb.next = lifetime::next(sb, st.idle_from).map(Due::to_public);
}

/// Runs a driver call under the configured deadline: a driver that never answers costs one
/// deadline, not the actor.
async fn with_deadline<T>(
    st: &SandboxState,
    operation: &'static str,
    call: impl Future<Output = Result<T, DriverError>>,
) -> Result<T, DriverError> {
    with_deadline_of(st, operation, st.shared.config.driver_call_timeout, call).await
}

/// [`with_deadline`] with a deadline of its own (a pause moves a whole memory to disk).
async fn with_deadline_of<T>(
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
