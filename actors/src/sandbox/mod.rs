//! The sandbox actor: one per sandbox UUID, the only writer of that sandbox's record.
//!
//! Its mailbox serializes every lifecycle command (start, stop, restart, delete) and every
//! observation of the sandbox's workload. For each step it persists the intent first (a fresh
//! runtime generation for every start), calls the driver with a deadline, and persists the
//! outcome. Reads never come here: they read the store, which the actor writes before it
//! answers.
//!
//! The actor by concern, one file each:
//!
//! - this file: the actor, its state, and which step each message is;
//! - [`commands`]: the lifecycle commands and observations (start, stop, restart, ttl,
//!   settings, delete; attach, retry, a driver's report);
//! - [`converge`]: driving the sandbox towards what is wanted, one plan step
//!   (`crate::lifecycle`) and one driver call at a time, and what a failed call does;
//! - [`pause`]: pause and resume, by a call or a deadline, and a pause the driver refused;
//! - [`deadlines`]: the lifetime's timers (ttl, idle with its CPU reads, delete_after);
//! - [`network`]: a live allowlist update, and the denials and refusals a driver reports;
//! - [`record`]: writing the record (only while this gateway holds the workspace's lease),
//!   its events, and its deletion.
//!
//! The driver's create request is made from the record in `crate::translate`.

mod commands;
mod converge;
mod deadlines;
mod network;
mod pause;
mod record;

use std::sync::Arc;
use std::time::SystemTime;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use sbx_driver_api::DriverError;
use sbx_proto::v1::{DesiredState, Phase};
use uuid::Uuid;

use crate::config::Shared;
use crate::error::{ActorError, Result, disk_full_in};
use crate::lease::Lease;
use crate::lifecycle::Current;
use crate::lifetime::Why;
use crate::protocol::SandboxMsg;
use crate::records::StoredSandbox;

/// The exit reason of a sandbox actor that ends because its sandbox was deleted. Its
/// supervisor does not restart it.
pub const DELETED: &str = "deleted";

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
    /// Until the first look is done: count it in the startup tracker (`attach_done`).
    report_attach: bool,
    /// One of the startup's permits, held while the first look calls the driver.
    attach_permit: Option<tokio::sync::OwnedSemaphorePermit>,
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

impl Drop for SandboxState {
    fn drop(&mut self) {
        if let Some((_, timer)) = self.timer.take() {
            timer.abort();
        }
    }
}

/// How a convergence ended.
pub(super) enum Outcome {
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
            attach_permit: None,
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
    /// One message, as the step of its own each kind is.
    async fn handle_msg(
        &self,
        myself: ActorRef<SandboxMsg>,
        msg: SandboxMsg,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SandboxMsg::Attach => self.on_attach(&myself, st).await?,
            SandboxMsg::Retry => self.on_retry(&myself, st).await?,
            SandboxMsg::Observe(snapshot) => self.on_observe(&myself, st, snapshot).await?,
            SandboxMsg::Start(reply) => self.on_start(&myself, st, reply).await?,
            SandboxMsg::Stop(reply) => self.on_stop(&myself, st, reply).await?,
            SandboxMsg::Restart(reply) => self.on_restart(&myself, st, reply).await?,
            SandboxMsg::Pause(reply) => {
                if !caller_gone(&reply, st, "pause") {
                    let answer = self.pause(&myself, st).await?;
                    let _ = reply.send(answer);
                }
            }
            SandboxMsg::Resume(reply) => {
                if !caller_gone(&reply, st, "resume") {
                    let answer = self.resume(&myself, st).await?;
                    let _ = reply.send(answer);
                }
            }
            SandboxMsg::SetTtl { seconds, reply } => self.on_set_ttl(st, seconds, reply).await?,
            SandboxMsg::Deadline => {
                st.timer = None;
                self.deadline(&myself, st).await?;
            }
            SandboxMsg::SetSettings { values, reply } => {
                self.on_set_settings(st, values, reply).await?
            }
            SandboxMsg::UpdateNetwork { policy, reply } => {
                if !caller_gone(&reply, st, "update the network") {
                    let result = self.update_network(st, policy).await;
                    let _ = reply.send(result);
                }
            }
            SandboxMsg::DeleteSetting { key, reply } => {
                self.on_delete_setting(st, key, reply).await?
            }
            SandboxMsg::Delete(reply) => self.on_delete(&myself, st, reply).await?,
        }
        Ok(())
    }

    /// After a convergence: an actor whose sandbox is gone stops; a step that settled is no
    /// longer the one a deadline asked for.
    pub(super) async fn after(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        outcome: Outcome,
    ) {
        match outcome {
            Outcome::Deleted => myself.stop(Some(DELETED.to_string())),
            Outcome::Settled | Outcome::PauseRefused(_) => st.why = None,
            Outcome::Retrying(_) => {}
        }
    }
}

/// Whether `reason` is one a deadline records (`crate::lifetime::Why`).
pub(super) fn is_deadline_reason(reason: &str) -> bool {
    [Why::TtlExpired, Why::Idle, Why::DeleteAfter]
        .iter()
        .any(|w| w.as_str() == reason)
}

/// The deadline's reason and message a record holds (a pause or stop a deadline began).
pub(super) fn deadline_reason(sb: &sbx_proto::v1::Sandbox) -> Option<(String, String)> {
    is_deadline_reason(&sb.reason).then(|| (sb.reason.clone(), sb.message.clone()))
}

pub(super) fn desired(st: &SandboxState) -> DesiredState {
    desired_of(&st.stored.sandbox)
}

pub(super) fn desired_of(sb: &sbx_proto::v1::Sandbox) -> DesiredState {
    match sb.desired_state() {
        DesiredState::Unspecified => DesiredState::Running,
        d => d,
    }
}

pub(super) fn current(st: &SandboxState) -> Current {
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

pub(super) fn set_phase(st: &mut SandboxState, phase: Phase, reason: &str, message: &str) {
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

pub(super) fn refuse_if_deleting(st: &SandboxState, what: &str) -> Result<()> {
    if desired(st) == DesiredState::Deleted {
        return Err(ActorError::FailedPrecondition(format!(
            "cannot {what} sandbox {} ({}): it is being deleted",
            st.stored.sandbox.name,
            st.stored.id()
        )));
    }
    Ok(())
}

/// Whether the caller of a lifecycle command gave up (its call was cancelled, or timed out)
/// while the command waited its turn in the mailbox: then it is not carried out. A client
/// that gave up does not know whether it happened, so not doing it is a truthful outcome —
/// and a command acted on long after its caller left (a restart after the caller went on
/// believing the sandbox Ready) is not.
pub(super) fn caller_gone<T>(
    reply: &ractor::RpcReplyPort<T>,
    st: &SandboxState,
    what: &str,
) -> bool {
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

/// The first look is done: its startup permit goes back and the startup tracker counts it.
/// Also before a pause or resume a first look re-issues: that call may take its whole
/// deadline (minutes for a large memory), and the gateway's start must not wait on it.
pub(super) fn attach_done(st: &mut SandboxState) {
    st.attach_permit = None;
    if std::mem::take(&mut st.report_attach) {
        st.shared.startup.attached();
    }
}
