//! The sandbox's lifetime deadlines (`crate::lifetime`): one timer armed for the next
//! (ttl, idle, delete_after) after every message, what a deadline that rang does (delete,
//! stop, or pause, recording why), and the CPU reads that tell an idle workload from a busy
//! one.

use std::time::{Duration, SystemTime};

use ractor::{ActorProcessingErr, ActorRef};
use sbx_driver_api::{DriverError, pb};
use sbx_proto::v1::{DesiredState, Phase};

use super::converge::with_deadline;
use super::{SandboxActor, SandboxState, desired_of, set_phase};
use crate::error::ActorError;
use crate::lifecycle::Observed;
use crate::lifetime::{self, Action, Busy, Due, Why};
use crate::protocol::SandboxMsg;

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

impl SandboxActor {
    /// The timer of the sandbox's next deadline rang: act on it, unless it moved (a ttl call,
    /// a use) or its sandbox turned out busy.
    pub(super) async fn deadline(
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
    pub(super) async fn arm(&self, myself: &ActorRef<SandboxMsg>, st: &mut SandboxState) {
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
}

/// A start or resume gives the sandbox a ttl deadline again when the one it had passed (or
/// fired): now + its ttl.
pub(super) fn rearm_ttl(st: &mut SandboxState) {
    st.stored.sandbox.expires_at =
        lifetime::rearmed_expiry(&st.stored.sandbox, SystemTime::now()).map(Into::into);
}

/// What the record says of the sandbox's lifetime, brought up to date before each write:
/// when it finished (what `delete_after` counts from), its idle window, its next deadline.
pub(super) fn keep_lifetime(st: &mut SandboxState) {
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
