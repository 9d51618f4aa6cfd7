//! The sandbox actor's lifecycle commands (start, stop, restart, ttl, settings, delete) and
//! its observations (its first look, a scheduled retry, a driver's report): each checks what
//! it may, says what is wanted, and converges there (`converge`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use ractor::{ActorProcessingErr, ActorRef, RpcReplyPort};
use sbx_driver_api::pb;
use sbx_proto::v1::{DesiredState, Phase, Sandbox};
use sbx_storage::Record;

use super::deadlines::rearm_ttl;
use super::{
    DELETED, Outcome, SandboxActor, SandboxState, attach_done, caller_gone, current, desired,
    refuse_if_deleting, set_phase,
};
use crate::error::{ActorError, Result};
use crate::lifecycle::{Observed, Step, plan};
use crate::lifetime;
use crate::protocol::SandboxMsg;

/// How long past its due time a scheduled retry may be late before observations act anyway.
const RETRY_GRACE: Duration = Duration::from_secs(2);

/// Where a command's answer goes.
type Reply<T> = RpcReplyPort<Result<T>>;

impl SandboxActor {
    /// The first look of a (re)started actor: converge from what the driver says (bounded by
    /// the startup's permits while the gateway starts).
    pub(super) async fn on_attach(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        if st.report_attach {
            st.attach_permit = Arc::clone(&st.shared.attach_permits)
                .acquire_owned()
                .await
                .ok();
        }
        let outcome = self.converge(myself, st, None).await;
        st.fresh = false;
        attach_done(st);
        self.after(myself, st, outcome?).await;
        Ok(())
    }

    /// A scheduled retry of a step that failed against the driver.
    pub(super) async fn on_retry(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
    ) -> Result<(), ActorProcessingErr> {
        st.retry_due = None;
        let outcome = self.converge(myself, st, None).await?;
        self.after(myself, st, outcome).await;
        Ok(())
    }

    /// What a driver reported (a sweep or a watch event): its denials recorded, and a
    /// convergence when the plan is not settled (not while a retry is due).
    pub(super) async fn on_observe(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        snapshot: Option<Box<pb::Snapshot>>,
    ) -> Result<(), ActorProcessingErr> {
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
        if desired(st) != DesiredState::Deleted && plan(&current(st), &obs, false) == Step::Settled
        {
            return Ok(());
        }
        // A settled Error gets one attempt per observation, not a new series.
        st.attempts = st
            .attempts
            .min(st.shared.config.max_driver_attempts.saturating_sub(1));
        // Look again, by id: the observation may be older than this actor's last step.
        let outcome = self.converge(myself, st, None).await?;
        self.after(myself, st, outcome).await;
        Ok(())
    }

    /// StartSandbox.
    pub(super) async fn on_start(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        reply: Reply<Sandbox>,
    ) -> Result<(), ActorProcessingErr> {
        if caller_gone(&reply, st, "start") {
            return Ok(());
        }
        if let Err(e) = refuse_if_deleting(st, "start") {
            let _ = reply.send(Err(e));
            return Ok(());
        }
        if desired(st) == DesiredState::Running && st.stored.sandbox.phase() == Phase::Ready {
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
        let outcome = self.converge(myself, st, assumed).await?;
        let _ = reply.send(Ok(st.stored.sandbox.clone()));
        self.after(myself, st, outcome).await;
        Ok(())
    }

    /// StopSandbox.
    pub(super) async fn on_stop(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        reply: Reply<Sandbox>,
    ) -> Result<(), ActorProcessingErr> {
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
        let outcome = self.converge(myself, st, assumed).await?;
        let _ = reply.send(Ok(st.stored.sandbox.clone()));
        self.after(myself, st, outcome).await;
        Ok(())
    }

    /// RestartSandbox: the workload stopped, then started again from there.
    pub(super) async fn on_restart(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        reply: Reply<Sandbox>,
    ) -> Result<(), ActorProcessingErr> {
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
            Ok(Observed::Absent) => self.converge(myself, st, Some(Observed::Absent)).await?,
            Ok(_) => self.converge(myself, st, Some(Observed::Stopped)).await?,
            Err(e) => self.driver_failed(myself, st, e).await?,
        };
        let _ = reply.send(Ok(st.stored.sandbox.clone()));
        self.after(myself, st, outcome).await;
        Ok(())
    }

    /// SetSandboxTtl.
    pub(super) async fn on_set_ttl(
        &self,
        st: &mut SandboxState,
        seconds: u64,
        reply: Reply<Sandbox>,
    ) -> Result<(), ActorProcessingErr> {
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
        Ok(())
    }

    /// Sets settings of the sandbox (refused once it is being deleted).
    pub(super) async fn on_set_settings(
        &self,
        st: &mut SandboxState,
        values: BTreeMap<String, String>,
        reply: Reply<Vec<Record>>,
    ) -> Result<(), ActorProcessingErr> {
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
        Ok(())
    }

    /// Deletes one setting of the sandbox (refused once it is being deleted).
    pub(super) async fn on_delete_setting(
        &self,
        st: &mut SandboxState,
        key: String,
        reply: Reply<bool>,
    ) -> Result<(), ActorProcessingErr> {
        let result = match refuse_if_deleting(st, "delete a setting of") {
            Err(e) => Err(e),
            Ok(()) => {
                crate::owned::delete_setting(st.shared.store.as_ref(), st.stored.id(), &key).await
            }
        };
        let _ = reply.send(result);
        Ok(())
    }

    /// DeleteSandbox: wanted deleted, recorded Deleting, and the actor ends once the driver
    /// confirmed it; until then the caller hears that it is retried.
    pub(super) async fn on_delete(
        &self,
        myself: &ActorRef<SandboxMsg>,
        st: &mut SandboxState,
        reply: Reply<bool>,
    ) -> Result<(), ActorProcessingErr> {
        if desired(st) != DesiredState::Deleted {
            st.stored.sandbox.set_desired_state(DesiredState::Deleted);
            set_phase(st, Phase::Deleting, "", "");
            self.persist(st).await?;
        }
        st.attempts = 0;
        match self.converge(myself, st, Some(Observed::Absent)).await? {
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
                self.after(myself, st, other).await;
            }
        }
        Ok(())
    }
}
