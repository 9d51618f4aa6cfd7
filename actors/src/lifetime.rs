//! Lifetimes as pure data: given a sandbox's record (and, for idleness, when it was last
//! used), what will the gateway do to it by itself next, and when? No IO, no tokio: the
//! sandbox actor arms one timer from [`next`] after every step (time as an output of
//! reconciling, never a loop of its own), and [`Activity`] is what the data calls (exec, copy,
//! port-forward, log follow, routed requests) tell it about use.
//!
//! Deadlines live in the record: the ttl's as `expires_at`, `delete_after`'s counted from
//! `finished_at`. A gateway restart therefore neither resets nor skips one, and one that
//! passed while the gateway was down fires once at start. Idleness is the one deadline counted
//! from memory: a restarted gateway gives every sandbox a full idle period again (never less).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use sbx_proto::v1::{DesiredState, Lifetime, LifetimeAction, NextAction, Phase, Sandbox};
use uuid::Uuid;

/// What a deadline does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    Delete,
    Stop,
    Pause,
}

impl Action {
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Delete => "delete",
            Action::Stop => "stop",
            Action::Pause => "pause",
        }
    }
}

/// Which deadline it is: the reason recorded when it fires.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    TtlExpired,
    Idle,
    DeleteAfter,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::TtlExpired => "TtlExpired",
            Why::Idle => "Idle",
            Why::DeleteAfter => "DeleteAfter",
        }
    }
}

/// The next thing the gateway does to a sandbox by itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Due {
    pub at: SystemTime,
    pub action: Action,
    pub why: Why,
}

impl Due {
    pub fn to_public(self) -> NextAction {
        NextAction {
            action: self.action.as_str().to_string(),
            at: Some(self.at.into()),
            reason: self.why.as_str().to_string(),
        }
    }
}

pub fn lifetime_of(sb: &Sandbox) -> Lifetime {
    sb.spec
        .as_ref()
        .and_then(|s| s.lifetime)
        .unwrap_or_default()
}

/// What the ttl does (DELETE when unset).
pub fn on_ttl(l: &Lifetime) -> Action {
    match l.on_ttl() {
        LifetimeAction::Stop => Action::Stop,
        LifetimeAction::Pause => Action::Pause,
        LifetimeAction::Delete | LifetimeAction::Unspecified => Action::Delete,
    }
}

/// What idleness does (STOP when unset; DELETE is refused at create).
pub fn on_idle(l: &Lifetime) -> Action {
    match l.on_idle() {
        LifetimeAction::Pause => Action::Pause,
        _ => Action::Stop,
    }
}

fn time_of(t: &Option<sbx_proto::Timestamp>) -> Option<SystemTime> {
    t.and_then(|t| SystemTime::try_from(t).ok())
}

fn desired(sb: &Sandbox) -> DesiredState {
    match sb.desired_state() {
        DesiredState::Unspecified => DesiredState::Running,
        d => d,
    }
}

/// Whether the sandbox is finished: stopped by a stop, or ended by itself (Completed, or
/// Error after its workload's own exit), and wanted stopped. What `delete_after` counts.
pub fn is_finished(sb: &Sandbox) -> bool {
    desired(sb) == DesiredState::Stopped
        && matches!(sb.phase(), Phase::Stopped | Phase::Completed | Phase::Error)
}

/// The earliest deadline of a sandbox, from its record; idleness counted from `idle_from`
/// (the start of the current idle window: when it became Ready, or was last used).
pub fn next(sb: &Sandbox, idle_from: Option<SystemTime>) -> Option<Due> {
    let wanted = desired(sb);
    if wanted == DesiredState::Deleted {
        return None;
    }
    let l = lifetime_of(sb);
    let mut candidates = Vec::with_capacity(3);
    if let Some(at) = time_of(&sb.expires_at) {
        let action = on_ttl(&l);
        let applies = match action {
            Action::Delete => true,
            // A stopped sandbox is not stopped again; a paused one is stopped (its memory
            // discarded) only by a ttl that says stop.
            Action::Stop => matches!(wanted, DesiredState::Running | DesiredState::Paused),
            Action::Pause => wanted == DesiredState::Running,
        };
        if applies {
            candidates.push(Due {
                at,
                action,
                why: Why::TtlExpired,
            });
        }
    }
    if l.idle_timeout_seconds > 0
        && wanted == DesiredState::Running
        && sb.phase() == Phase::Ready
        && let Some(from) = idle_from
        && let Some(at) = after(from, l.idle_timeout_seconds)
    {
        candidates.push(Due {
            at,
            action: on_idle(&l),
            why: Why::Idle,
        });
    }
    if l.delete_after_seconds > 0
        && is_finished(sb)
        && let Some(finished) = time_of(&sb.finished_at)
        && let Some(at) = after(finished, l.delete_after_seconds)
    {
        candidates.push(Due {
            at,
            action: Action::Delete,
            why: Why::DeleteAfter,
        });
    }
    candidates.into_iter().min_by_key(|d| d.at)
}

/// The ttl deadline a run (a start or a resume at `now`) gets: the one it has while it is
/// still ahead (however it was set), else now + its ttl (none without one).
pub fn rearmed_expiry(sb: &Sandbox, now: SystemTime) -> Option<SystemTime> {
    match time_of(&sb.expires_at) {
        Some(at) if at > now => Some(at),
        _ => after(now, lifetime_of(sb).ttl_seconds),
    }
}

/// `at` + `secs` seconds; `None` for 0 seconds, or past what the clock can say.
pub fn after(at: SystemTime, secs: u64) -> Option<SystemTime> {
    if secs == 0 {
        return None;
    }
    at.checked_add(Duration::from_secs(secs))
}

/// Whether a use of a Paused sandbox resumes it first: as its lifetime says, else when its
/// ttl or idleness paused it (not a PauseSandbox call).
pub fn auto_resumes(sb: &Sandbox) -> bool {
    lifetime_of(sb)
        .auto_resume
        .unwrap_or(sb.reason != crate::lifetime::PAUSED_BY_CALL)
}

/// The reason of a sandbox paused by a PauseSandbox call.
pub const PAUSED_BY_CALL: &str = "Paused";

/// The reason of a sandbox its idle timeout paused (`Why::Idle`'s).
pub const PAUSED_IDLE: &str = "Idle";

/// Whether a request routed to a service endpoint of the Paused sandbox (nobody's, never
/// authenticated) may resume it at `now`: only when its lifetime says `wake_on_request`, its
/// idleness paused it, and its ttl (if it has one) is still ahead — a resume whose deadline
/// passed would be given a new one ([`rearmed_expiry`]), and a wake must never move the ttl.
/// A ttl's pause stands until a caller resumes it, and so does a PauseSandbox call's.
pub fn wakes_on_request(sb: &Sandbox, now: SystemTime) -> bool {
    let lifetime = lifetime_of(sb);
    let ttl_ahead = lifetime.ttl_seconds == 0 || time_of(&sb.expires_at).is_some_and(|at| at > now);
    lifetime.wake_on_request && sb.reason == PAUSED_IDLE && ttl_ahead
}

/// How busy a sandbox was over an idle window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Busy {
    /// Nothing in use, CPU under the threshold: idle since the window began.
    Idle,
    /// In use, or used or busy on CPU since: a new window begins at this time.
    Until(SystemTime),
}

/// Whether a sandbox was idle over a window that began at `from`, from its use (`open` calls
/// now, the last one ended at `last_end`) and its CPU (`cpu_cores` used on average over the
/// window, `None` when its driver reads none) against `threshold` cores.
pub fn busy(
    from: SystemTime,
    now: SystemTime,
    open: u32,
    last_end: Option<SystemTime>,
    cpu_cores: Option<f64>,
    threshold: f64,
) -> Busy {
    if open > 0 {
        return Busy::Until(now);
    }
    if let Some(end) = last_end
        && end > from
    {
        return Busy::Until(end);
    }
    if cpu_cores.is_some_and(|c| c >= threshold) {
        return Busy::Until(now);
    }
    Busy::Idle
}

/// The data calls open on each sandbox, and when the last one ended: what idleness is
/// measured against. One per gateway, shared by the API (which opens and ends uses) and the
/// sandbox actors (which read it at their idle deadline).
#[derive(Debug, Default)]
pub struct Activity {
    uses: Mutex<HashMap<Uuid, Use>>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Use {
    open: u32,
    last_end: Option<SystemTime>,
}

/// One open use of a sandbox (an exec, a copy, a forwarded connection, a log follow): it ends
/// when dropped.
#[derive(Debug)]
pub struct InUse {
    activity: Arc<Activity>,
    id: Uuid,
}

impl Drop for InUse {
    fn drop(&mut self) {
        let mut uses = sbx_driver_api::locked(&self.activity.uses);
        if let Some(u) = uses.get_mut(&self.id) {
            u.open = u.open.saturating_sub(1);
            u.last_end = Some(SystemTime::now());
        }
    }
}

impl Activity {
    /// A use of sandbox `id` begins now; it ends when the answer is dropped.
    pub fn begin(self: &Arc<Self>, id: Uuid) -> InUse {
        sbx_driver_api::locked(&self.uses)
            .entry(id)
            .or_default()
            .open += 1;
        InUse {
            activity: Arc::clone(self),
            id,
        }
    }

    /// Uses open now, and when the last one ended.
    pub fn of(&self, id: Uuid) -> (u32, Option<SystemTime>) {
        sbx_driver_api::locked(&self.uses)
            .get(&id)
            .map(|u| (u.open, u.last_end))
            .unwrap_or((0, None))
    }

    /// Forgets a deleted sandbox (an open use of it ends in nothing).
    pub fn forget(&self, id: Uuid) {
        let mut uses = sbx_driver_api::locked(&self.uses);
        if uses.get(&id).is_some_and(|u| u.open == 0) {
            uses.remove(&id);
        }
    }
}

/// A wall-clock deadline as a delay from now (zero when it passed), for a timer.
pub fn delay_until(at: SystemTime, now: SystemTime) -> Duration {
    at.duration_since(now).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_proto::v1::SandboxSpec;

    const T0: u64 = 1_800_000_000;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(T0 + secs)
    }

    fn ts(secs: u64) -> Option<sbx_proto::Timestamp> {
        Some(at(secs).into())
    }

    fn sandbox(l: Lifetime, desired: DesiredState, phase: Phase) -> Sandbox {
        let mut sb = Sandbox {
            spec: Some(SandboxSpec {
                lifetime: Some(l),
                ..Default::default()
            }),
            ..Default::default()
        };
        sb.set_desired_state(desired);
        sb.set_phase(phase);
        sb
    }

    fn ttl(secs: u64, on: LifetimeAction) -> Lifetime {
        Lifetime {
            ttl_seconds: secs,
            on_ttl: on as i32,
            ..Default::default()
        }
    }

    #[test]
    fn a_ttl_fires_at_its_recorded_deadline_with_its_action() {
        for (on, action) in [
            (LifetimeAction::Unspecified, Action::Delete),
            (LifetimeAction::Delete, Action::Delete),
            (LifetimeAction::Stop, Action::Stop),
            (LifetimeAction::Pause, Action::Pause),
        ] {
            let mut sb = sandbox(ttl(30, on), DesiredState::Running, Phase::Ready);
            assert_eq!(next(&sb, None), None, "no deadline recorded, nothing due");
            sb.expires_at = ts(30);
            assert_eq!(
                next(&sb, None),
                Some(Due {
                    at: at(30),
                    action,
                    why: Why::TtlExpired
                })
            );
        }
    }

    #[test]
    fn a_ttl_does_not_stop_what_is_stopped_nor_pause_what_is_not_running() {
        let mut sb = sandbox(
            ttl(30, LifetimeAction::Stop),
            DesiredState::Stopped,
            Phase::Stopped,
        );
        sb.expires_at = ts(30);
        assert_eq!(next(&sb, None), None);
        sb.set_desired_state(DesiredState::Paused);
        assert_eq!(next(&sb, None).map(|d| d.action), Some(Action::Stop));
        let mut sb = sandbox(
            ttl(30, LifetimeAction::Pause),
            DesiredState::Paused,
            Phase::Paused,
        );
        sb.expires_at = ts(30);
        assert_eq!(next(&sb, None), None);
        // Delete applies whatever the sandbox does, but not twice.
        let mut sb = sandbox(
            ttl(30, LifetimeAction::Delete),
            DesiredState::Stopped,
            Phase::Stopped,
        );
        sb.expires_at = ts(30);
        assert_eq!(next(&sb, None).map(|d| d.action), Some(Action::Delete));
        sb.set_desired_state(DesiredState::Deleted);
        assert_eq!(next(&sb, None), None);
    }

    #[test]
    fn idleness_counts_from_the_window_only_while_ready_and_wanted_running() {
        let l = Lifetime {
            idle_timeout_seconds: 5,
            on_idle: LifetimeAction::Pause as i32,
            ..Default::default()
        };
        let sb = sandbox(l, DesiredState::Running, Phase::Ready);
        assert_eq!(
            next(&sb, Some(at(10))),
            Some(Due {
                at: at(15),
                action: Action::Pause,
                why: Why::Idle
            })
        );
        for phase in [Phase::Starting, Phase::Stopped, Phase::Paused, Phase::Error] {
            assert_eq!(
                next(&sandbox(l, DesiredState::Running, phase), Some(at(10))),
                None,
                "{phase:?}"
            );
        }
        // On idle, DELETE is not an action (refused at create; taken as stop if it got in).
        let sb = sandbox(
            Lifetime {
                idle_timeout_seconds: 5,
                on_idle: LifetimeAction::Delete as i32,
                ..Default::default()
            },
            DesiredState::Running,
            Phase::Ready,
        );
        assert_eq!(next(&sb, Some(at(0))).map(|d| d.action), Some(Action::Stop));
    }

    #[test]
    fn delete_after_counts_from_when_it_finished_and_the_earliest_deadline_wins() {
        let l = Lifetime {
            delete_after_seconds: 60,
            ..Default::default()
        };
        let mut sb = sandbox(l, DesiredState::Stopped, Phase::Completed);
        assert_eq!(next(&sb, None), None, "no finish time recorded");
        sb.finished_at = ts(100);
        let due = next(&sb, None).unwrap();
        assert_eq!((due.at, due.why), (at(160), Why::DeleteAfter));
        // Error after its own exit counts; a sandbox wanted running does not.
        sb.set_phase(Phase::Error);
        assert!(next(&sb, None).is_some());
        sb.set_desired_state(DesiredState::Running);
        assert_eq!(next(&sb, None), None);

        let mut both = sandbox(
            Lifetime {
                ttl_seconds: 100,
                idle_timeout_seconds: 10,
                ..Default::default()
            },
            DesiredState::Running,
            Phase::Ready,
        );
        both.expires_at = ts(100);
        assert_eq!(next(&both, Some(at(0))).unwrap().why, Why::Idle);
        assert_eq!(next(&both, Some(at(95))).unwrap().why, Why::TtlExpired);
    }

    #[test]
    fn a_run_keeps_a_deadline_ahead_and_rearms_one_passed() {
        let mut sb = sandbox(
            ttl(60, LifetimeAction::Pause),
            DesiredState::Running,
            Phase::Paused,
        );
        assert_eq!(rearmed_expiry(&sb, at(10)), Some(at(70)));
        sb.expires_at = ts(30);
        assert_eq!(rearmed_expiry(&sb, at(10)), Some(at(30)));
        assert_eq!(rearmed_expiry(&sb, at(30)), Some(at(90)));
        let mut none = sandbox(Lifetime::default(), DesiredState::Running, Phase::Ready);
        assert_eq!(rearmed_expiry(&none, at(10)), None);
        // A deadline a ttl call gave a sandbox created without one is kept while ahead.
        none.expires_at = ts(100);
        assert_eq!(rearmed_expiry(&none, at(10)), Some(at(100)));
        assert_eq!(rearmed_expiry(&none, at(100)), None);
        // No deadline past what the clock can say.
        assert_eq!(after(at(0), u64::MAX), None);
    }

    #[test]
    fn use_and_cpu_make_a_sandbox_busy() {
        let threshold = 0.05;
        let (from, now) = (at(0), at(10));
        assert_eq!(busy(from, now, 0, None, Some(0.0), threshold), Busy::Idle);
        assert_eq!(busy(from, now, 0, None, None, threshold), Busy::Idle);
        assert_eq!(
            busy(from, now, 1, None, Some(0.0), threshold),
            Busy::Until(now)
        );
        assert_eq!(
            busy(from, now, 0, Some(at(4)), Some(0.0), threshold),
            Busy::Until(at(4))
        );
        // A use that ended before the window does not count.
        assert_eq!(
            busy(at(5), now, 0, Some(at(4)), Some(0.0), threshold),
            Busy::Idle
        );
        assert_eq!(
            busy(from, now, 0, None, Some(0.9), threshold),
            Busy::Until(now)
        );
        assert_eq!(busy(from, now, 0, None, Some(0.049), threshold), Busy::Idle);
    }

    #[test]
    fn a_routed_request_wakes_only_what_its_idleness_paused_and_only_when_asked() {
        for (wake, reason, wakes) in [
            (false, "Idle", false),
            (false, "TtlExpired", false),
            (false, "Paused", false),
            (true, "Idle", true),
            (true, "TtlExpired", false),
            (true, "Paused", false),
        ] {
            let mut sb = sandbox(
                Lifetime {
                    idle_timeout_seconds: 60,
                    wake_on_request: wake,
                    ..Default::default()
                },
                DesiredState::Paused,
                Phase::Paused,
            );
            sb.reason = reason.into();
            let now = at(100);
            assert_eq!(
                wakes_on_request(&sb, now),
                wakes,
                "wake_on_request {wake}, {reason}"
            );
            // With a ttl: only while its deadline is ahead (a wake never gives a new one).
            sb.spec
                .as_mut()
                .unwrap()
                .lifetime
                .as_mut()
                .unwrap()
                .ttl_seconds = 30;
            sb.expires_at = Some(at(130).into());
            assert_eq!(wakes_on_request(&sb, now), wakes, "ttl ahead, {reason}");
            sb.expires_at = Some(at(90).into());
            assert!(!wakes_on_request(&sb, now), "ttl passed, {reason}");
            sb.expires_at = None;
            assert!(!wakes_on_request(&sb, now), "ttl fired, {reason}");
        }
    }

    #[test]
    fn auto_resume_follows_who_paused_unless_the_lifetime_says() {
        let mut sb = sandbox(Lifetime::default(), DesiredState::Paused, Phase::Paused);
        for (reason, resumes) in [("TtlExpired", true), ("Idle", true), ("Paused", false)] {
            sb.reason = reason.into();
            assert_eq!(auto_resumes(&sb), resumes, "{reason}");
        }
        for set in [true, false] {
            let mut sb = sandbox(
                Lifetime {
                    auto_resume: Some(set),
                    ..Default::default()
                },
                DesiredState::Paused,
                Phase::Paused,
            );
            for reason in ["TtlExpired", "Paused"] {
                sb.reason = reason.into();
                assert_eq!(auto_resumes(&sb), set);
            }
        }
    }

    #[test]
    fn a_use_is_open_until_dropped_and_then_dated() {
        let activity = Arc::new(Activity::default());
        let id = Uuid::new_v4();
        assert_eq!(activity.of(id), (0, None));
        let a = activity.begin(id);
        let b = activity.begin(id);
        assert_eq!(activity.of(id).0, 2);
        drop(a);
        let (open, last) = activity.of(id);
        assert_eq!(open, 1);
        assert!(last.is_some());
        activity.forget(id);
        assert_eq!(activity.of(id).0, 1, "an open use is not forgotten");
        drop(b);
        activity.forget(id);
        assert_eq!(activity.of(id), (0, None));
    }
}
