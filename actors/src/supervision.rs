//! The restart policy of sbx's supervisors, as plain data: exponential backoff and an
//! OTP-style intensity limit (more than `max_restarts` within `window` escalates).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy)]
pub struct RestartPolicy {
    pub max_restarts: usize,
    pub window: Duration,
    pub base_backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for RestartPolicy {
    fn default() -> Self {
        RestartPolicy {
            max_restarts: 5,
            window: Duration::from_secs(10),
            base_backoff: Duration::from_millis(20),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// The recent restarts of one child.
#[derive(Debug, Default, Clone)]
pub struct RestartHistory {
    recent: VecDeque<Instant>,
}

/// What to do about a child that ended abnormally.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RestartDecision {
    /// Restart it after this delay.
    RestartAfter(Duration),
    /// Too many restarts in the window: escalate to the supervisor's own supervisor.
    Escalate,
}

impl RestartHistory {
    pub fn on_failure(&mut self, policy: &RestartPolicy, now: Instant) -> RestartDecision {
        while let Some(first) = self.recent.front() {
            if now.duration_since(*first) > policy.window {
                self.recent.pop_front();
            } else {
                break;
            }
        }
        if self.recent.len() >= policy.max_restarts {
            return RestartDecision::Escalate;
        }
        let n = self.recent.len() as u32;
        self.recent.push_back(now);
        RestartDecision::RestartAfter(backoff(policy.base_backoff, policy.max_backoff, n))
    }
}

/// How a supervised child ended, as its supervisor needs to know it.
pub enum ChildEnd {
    /// It ended because what it stood for was deleted: remove it, do not restart it.
    Deleted(ractor::ActorCell),
    /// Anything else (a failure, a kill, an unexpected stop), with a description for logs.
    Abnormal(ractor::ActorCell, String),
}

/// Reads a supervision event: `None` for events that are not a child ending.
pub fn child_end(evt: ractor::SupervisionEvent, deleted_reason: &str) -> Option<ChildEnd> {
    match evt {
        ractor::SupervisionEvent::ActorTerminated(cell, _, reason) => {
            Some(if reason.as_deref() == Some(deleted_reason) {
                ChildEnd::Deleted(cell)
            } else {
                ChildEnd::Abnormal(
                    cell,
                    format!(
                        "terminated ({})",
                        reason.unwrap_or_else(|| "no reason".into())
                    ),
                )
            })
        }
        ractor::SupervisionEvent::ActorFailed(cell, err) => {
            Some(ChildEnd::Abnormal(cell, format!("failed: {err}")))
        }
        _ => None,
    }
}

/// `base * 2^n`, capped at `max`.
pub fn backoff(base: Duration, max: Duration, n: u32) -> Duration {
    base.checked_mul(1u32.checked_shl(n.min(20)).unwrap_or(u32::MAX))
        .unwrap_or(max)
        .min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let b = |n| backoff(Duration::from_millis(100), Duration::from_secs(1), n);
        assert_eq!(b(0), Duration::from_millis(100));
        assert_eq!(b(1), Duration::from_millis(200));
        assert_eq!(b(3), Duration::from_millis(800));
        assert_eq!(b(4), Duration::from_secs(1));
        assert_eq!(b(60), Duration::from_secs(1));
    }

    #[test]
    fn intensity_limit_escalates_and_the_window_forgives() {
        let policy = RestartPolicy {
            max_restarts: 3,
            window: Duration::from_secs(10),
            base_backoff: Duration::from_millis(10),
            max_backoff: Duration::from_secs(1),
        };
        let mut h = RestartHistory::default();
        let t0 = Instant::now();
        assert_eq!(
            h.on_failure(&policy, t0),
            RestartDecision::RestartAfter(Duration::from_millis(10))
        );
        assert_eq!(
            h.on_failure(&policy, t0),
            RestartDecision::RestartAfter(Duration::from_millis(20))
        );
        assert_eq!(
            h.on_failure(&policy, t0),
            RestartDecision::RestartAfter(Duration::from_millis(40))
        );
        assert_eq!(h.on_failure(&policy, t0), RestartDecision::Escalate);
        // Once the window has passed, restarts are allowed again, from the first backoff.
        let later = t0 + Duration::from_secs(11);
        assert_eq!(
            h.on_failure(&policy, later),
            RestartDecision::RestartAfter(Duration::from_millis(10))
        );
    }
}
