//! The sandbox event hub: every persisted change of a sandbox becomes an event that watchers
//! receive, and a bounded history lets a watcher resume from the last resource version it saw.

use std::collections::VecDeque;
use std::sync::Mutex;

use sbx_proto::v1::{EventType, Sandbox, SandboxEvent};
use tokio::sync::broadcast;

use crate::error::{ActorError, Result};

/// How many events a live watcher may fall behind before its stream ends with an error.
const LIVE_BUFFER: usize = 4096;

pub struct EventHub {
    inner: Mutex<History>,
    /// Live delivery. Sent under the history lock so that history and live stream never
    /// disagree about what was published.
    live: broadcast::Sender<SandboxEvent>,
}

struct History {
    events: VecDeque<SandboxEvent>,
    capacity: usize,
    /// Every event with a resource version at or below this one may have been dropped (evicted,
    /// or published before this process started): a resume from older than it is refused.
    horizon: u64,
}

/// A watcher's starting point: the events after the requested version that the history still
/// holds, and the live stream from then on.
pub struct Subscription {
    pub backlog: Vec<SandboxEvent>,
    pub live: broadcast::Receiver<SandboxEvent>,
}

impl EventHub {
    /// `horizon` is the store's revision at startup: nothing before it is in the history.
    pub fn new(capacity: usize, horizon: u64) -> Self {
        let (live, _) = broadcast::channel(LIVE_BUFFER);
        EventHub {
            inner: Mutex::new(History {
                events: VecDeque::with_capacity(capacity.min(1024)),
                capacity,
                horizon,
            }),
            live,
        }
    }

    pub fn publish(&self, kind: EventType, sandbox: Sandbox) {
        let event = SandboxEvent {
            r#type: kind as i32,
            resource_version: sandbox.resource_version,
            sandbox: Some(sandbox),
        };
        let mut history = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if history.events.len() == history.capacity
            && let Some(old) = history.events.pop_front()
        {
            history.horizon = history.horizon.max(old.resource_version);
        }
        history.events.push_back(event.clone());
        // No receiver is not an error: nobody is watching.
        let _ = self.live.send(event);
    }

    /// Subscribes to events after `after` (0: only live events; the caller lists first).
    pub fn subscribe(&self, after: u64) -> Result<Subscription> {
        let history = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if after > 0 && after < history.horizon {
            return Err(ActorError::ResourceVersionTooOld {
                requested: after,
                oldest: history.horizon,
            });
        }
        let live = self.live.subscribe();
        let mut backlog: Vec<SandboxEvent> = if after == 0 {
            Vec::new()
        } else {
            history
                .events
                .iter()
                .filter(|e| e.resource_version > after)
                .cloned()
                .collect()
        };
        backlog.sort_by_key(|e| e.resource_version);
        Ok(Subscription { backlog, live })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sandbox(rv: u64) -> Sandbox {
        Sandbox {
            resource_version: rv,
            name: format!("s{rv}"),
            ..Default::default()
        }
    }

    #[test]
    fn resume_delivers_exactly_the_events_after_the_version() {
        let hub = EventHub::new(10, 0);
        for rv in 1..=5 {
            hub.publish(EventType::Modified, sandbox(rv));
        }
        let sub = hub.subscribe(3).unwrap();
        let rvs: Vec<u64> = sub.backlog.iter().map(|e| e.resource_version).collect();
        assert_eq!(rvs, vec![4, 5]);
    }

    #[test]
    fn resume_from_before_the_history_is_refused() {
        let hub = EventHub::new(3, 0);
        for rv in 1..=5 {
            hub.publish(EventType::Modified, sandbox(rv));
        }
        // 1 and 2 were evicted: resuming after 1 would miss 2.
        assert!(matches!(
            hub.subscribe(1),
            Err(ActorError::ResourceVersionTooOld { .. })
        ));
        assert_eq!(hub.subscribe(2).unwrap().backlog.len(), 3);
        // A hub started after a restart refuses versions from before it.
        let hub = EventHub::new(3, 100);
        assert!(hub.subscribe(50).is_err());
        assert!(hub.subscribe(100).unwrap().backlog.is_empty());
    }

    #[tokio::test]
    async fn live_events_follow_the_backlog() {
        let hub = EventHub::new(10, 0);
        hub.publish(EventType::Added, sandbox(1));
        let mut sub = hub.subscribe(0).unwrap();
        assert!(sub.backlog.is_empty());
        hub.publish(EventType::Deleted, sandbox(2));
        let ev = sub.live.recv().await.unwrap();
        assert_eq!(
            (ev.resource_version, ev.r#type),
            (2, EventType::Deleted as i32)
        );
    }
}
