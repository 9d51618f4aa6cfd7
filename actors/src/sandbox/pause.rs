//! Pause and resume: by a PauseSandbox or ResumeSandbox call (only a Ready sandbox on a
//! driver with the `pause` capability is paused), by a deadline (`deadlines`), and what a
//! pause the driver did not make becomes.

use ractor::{ActorProcessingErr, ActorRef};
use sbx_driver_api::DriverError;
use sbx_proto::v1::{DesiredState, Phase};

use super::converge::with_deadline;
use super::deadlines::rearm_ttl;
use super::{
    Outcome, SandboxActor, SandboxState, deadline_reason, desired, is_deadline_reason,
    refuse_if_deleting, set_phase,
};
use crate::error::{ActorError, Result};
use crate::lifecycle::Observed;
use crate::lifetime;
use crate::protocol::SandboxMsg;

impl SandboxActor {
    /// A pause the driver did not make (it refused, or failed every attempt). A deadline's is
    /// a stop instead, so the sandbox never runs on past its lifetime (its files kept; the
    /// stop is the next step, with the deadline's reason). A call's leaves the workload as the
    /// driver keeps it, running, and wanted so (Ready when the driver said why it refused,
    /// Error when it did not answer: the next look records what runs), reason PauseFailed.
    pub(super) async fn pause_gave_up(
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
    pub(super) async fn pause(
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
    pub(super) async fn begin_pause(
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
    pub(super) async fn resume(
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
    pub(super) async fn can_pause(&self, st: &SandboxState) -> Result<()> {
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
