//! The sandbox event hub: every persisted change of a sandbox becomes an event that watchers
//! receive, and a bounded history lets a watcher resume from the last resource version it saw.
//!
//! Why bounded in bytes and not only in events: one event carries the whole sandbox, and a
//! spec may be 256 KiB (`limits::MAX_SPEC_BYTES`), so 10,000 events could be 2.5 GB. The
//! history is bounded by both a count ([`HistoryBounds::max_events`], 10,000 by default) and
//! the events' size ([`HistoryBounds::max_bytes`], 64 MiB by default): the oldest events are
//! evicted while either is exceeded, and the horizon moves past them (a resume from before it
//! is refused with `ResourceVersionTooOld`). An event's size is its protobuf encoding
//! (`encoded_len`) plus [`EVENT_OVERHEAD`], what its decoded form and its slot cost besides
//! (measured: a small event's allocations are ≈ 4× its encoding, a spec of long strings ≈ 1×).
//!
//! Why the history is also the live buffer: each event is held once, in an `Arc`. A watcher is
//! a cursor into the history (its next sequence number), woken by a `watch` channel when an
//! event is published; it clones an event only when it sends it. There is no second buffer
//! per event (a broadcast channel of full events held one copy more, and up to 4,096 of them
//! for a slow watcher: 1 GiB). A watcher whose next event was evicted has fallen behind by more
//! than the history's bounds and ends with [`LiveError::FellBehind`]; so the memory of all
//! watchers together is the history's bound plus what each holds in flight (its channel to
//! the client), never a copy of the history per watcher.
//!
//! Events are delivered in publish order, which is resource-version order except for the gap
//! docs/ARCHITECTURE.md ("Watch") describes; events at or below a resume's version are skipped.
//!
//! On a store with a change log (PostgreSQL, shared by gateways) the hub is fed by the store
//! instead ([`EventHub::fed_by_store`], [`crate::change_log::follow_change_log`]): every gateway's writes, in
//! revision order with no gap, each delete at its own revision; the actors' own publishes are
//! ignored there (they would come twice, and out of order).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use prost::Message;
use sbx_proto::v1::{EventType, Sandbox, SandboxEvent};
use tokio::sync::watch;

use crate::error::{ActorError, Result};

/// What an event costs besides its encoding, in bytes: the decoded `SandboxEvent` and
/// `Sandbox` structs (≈ 400 bytes), the allocations of its strings and maps (≈ 40 bytes each
/// beyond their contents, a dozen for a small sandbox), the `Arc`'s counts and its slot in the
/// history.
pub const EVENT_OVERHEAD: usize = 1024;

/// How much history the hub keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryBounds {
    /// Events kept, at most (at least 1).
    pub max_events: usize,
    /// Bytes of events kept, at most (each event's `encoded_len` + [`EVENT_OVERHEAD`]). The
    /// newest event is kept even when it alone is larger.
    pub max_bytes: usize,
}

impl Default for HistoryBounds {
    fn default() -> Self {
        HistoryBounds {
            max_events: 10_000,
            max_bytes: 64 << 20,
        }
    }
}

pub struct EventHub {
    history: Arc<Mutex<History>>,
    /// Fed by the store's change log: [`EventHub::publish`] does nothing.
    fed_by_store: bool,
    /// The sequence number the next event will get, sent after each publish: live watchers
    /// wait on it. Dropped with the hub, which ends every watcher with [`LiveError::Closed`].
    published: watch::Sender<u64>,
}

struct Entry {
    event: Arc<SandboxEvent>,
    bytes: usize,
}

struct History {
    events: VecDeque<Entry>,
    /// The sequence number of `events[0]` (every published event gets the next one).
    first_seq: u64,
    bytes: usize,
    bounds: HistoryBounds,
    /// Every event with a resource version at or below this one may have been dropped (evicted,
    /// or published before this process started): a resume from older than it is refused.
    horizon: u64,
}

impl History {
    fn next_seq(&self) -> u64 {
        self.first_seq + self.events.len() as u64
    }

    fn over_bounds(&self) -> bool {
        self.events.len() > self.bounds.max_events.max(1)
            || (self.bytes > self.bounds.max_bytes && self.events.len() > 1)
    }

    fn evict(&mut self) {
        while self.over_bounds() {
            let Some(old) = self.events.pop_front() else {
                break;
            };
            self.first_seq += 1;
            self.bytes -= old.bytes;
            self.horizon = self.horizon.max(old.event.resource_version);
        }
        // Memory returns: a deque that grew for a burst of small events gives back its slots
        // once it holds a quarter of them (a budget of large events holds few).
        let (len, capacity) = (self.events.len(), self.events.capacity());
        if capacity > 1024 && len < capacity / 4 {
            self.events.shrink_to(len * 2);
        }
    }
}

/// Why a watcher's stream of events ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LiveError {
    /// The next event the watcher had not read was evicted: it fell behind the history's
    /// bounds by `missed` events or more.
    FellBehind { missed: u64 },
    /// The hub is gone (the gateway shut down).
    Closed,
}

/// A watcher's position: the events after the requested version that the history still holds,
/// then each event as it is published.
pub struct Subscription {
    history: Arc<Mutex<History>>,
    published: watch::Receiver<u64>,
    /// The sequence number of the next event to deliver.
    next: u64,
    /// Events at or below this resource version are skipped.
    after: u64,
}

impl EventHub {
    /// `horizon` is the store's revision at startup: nothing before it is in the history.
    pub fn new(bounds: HistoryBounds, horizon: u64) -> Self {
        Self::with_feed(bounds, horizon, false)
    }

    /// A hub fed only by the store's change log ([`crate::change_log::follow_change_log`]) from `horizon` on.
    pub fn fed_by_store(bounds: HistoryBounds, horizon: u64) -> Self {
        Self::with_feed(bounds, horizon, true)
    }

    fn with_feed(bounds: HistoryBounds, horizon: u64, fed_by_store: bool) -> Self {
        let (published, _) = watch::channel(0);
        EventHub {
            fed_by_store,
            history: Arc::new(Mutex::new(History {
                events: VecDeque::with_capacity(bounds.max_events.clamp(1, 1024)),
                first_seq: 0,
                bytes: 0,
                bounds,
                horizon,
            })),
            published,
        }
    }

    /// An actor's event, after its write is durable. Ignored by a hub fed by the store, where
    /// the same write comes from the change log.
    pub fn publish(&self, kind: EventType, sandbox: Sandbox) {
        if !self.fed_by_store {
            self.append(kind, sandbox);
        }
    }

    pub(crate) fn append(&self, kind: EventType, sandbox: Sandbox) {
        let event = SandboxEvent {
            r#type: kind as i32,
            resource_version: sandbox.resource_version,
            sandbox: Some(sandbox),
        };
        let bytes = event.encoded_len() + EVENT_OVERHEAD;
        let next = {
            let mut history = lock(&self.history);
            history.bytes += bytes;
            history.events.push_back(Entry {
                event: Arc::new(event),
                bytes,
            });
            history.evict();
            history.next_seq()
        };
        self.published.send_replace(next);
    }

    /// Nothing before `horizon` can be delivered any more (the change log was trimmed past
    /// what this hub had read): the history is dropped, every watcher ends with
    /// [`LiveError::FellBehind`], and a resume from before `horizon` is refused.
    pub fn restart_at(&self, horizon: u64) {
        let next = {
            let mut history = lock(&self.history);
            let dropped = history.events.len() as u64;
            history.events.clear();
            history.bytes = 0;
            // One sequence number skipped: a watcher at the end falls behind too.
            history.first_seq += dropped + 1;
            history.horizon = history.horizon.max(horizon);
            history.next_seq()
        };
        self.published.send_replace(next);
    }

    /// Subscribes to events after `after` (0: only events published from now on; the caller
    /// lists first).
    pub fn subscribe(&self, after: u64) -> Result<Subscription> {
        let history = lock(&self.history);
        if after > 0 && after < history.horizon {
            return Err(ActorError::ResourceVersionTooOld {
                requested: after,
                oldest: history.horizon,
            });
        }
        let next = if after == 0 {
            history.next_seq()
        } else {
            history
                .events
                .iter()
                .position(|e| e.event.resource_version > after)
                .map_or(history.next_seq(), |i| history.first_seq + i as u64)
        };
        Ok(Subscription {
            history: Arc::clone(&self.history),
            published: self.published.subscribe(),
            next,
            after,
        })
    }

    /// Open subscriptions (watches), and the events and bytes the history holds now.
    pub fn stats(&self) -> (usize, usize, usize) {
        let (events, bytes) = self.usage();
        (self.published.receiver_count(), events, bytes)
    }

    /// Events and bytes the history holds now.
    fn usage(&self) -> (usize, usize) {
        let history = lock(&self.history);
        (history.events.len(), history.bytes)
    }
}

impl Subscription {
    /// The next event, waiting for one to be published if the watcher is up to date.
    /// Cancel-safe: an event is consumed only when it is returned.
    pub async fn recv(&mut self) -> std::result::Result<Arc<SandboxEvent>, LiveError> {
        loop {
            // Marked seen before looking, so a publish after the look wakes the wait below.
            self.published.borrow_and_update();
            if let Some(event) = self.try_recv()? {
                return Ok(event);
            }
            if self.published.changed().await.is_err() {
                // The hub is gone; what it published before is still delivered.
                return self.try_recv()?.ok_or(LiveError::Closed);
            }
        }
    }

    /// The next event if one has been published, without waiting.
    pub fn try_recv(&mut self) -> std::result::Result<Option<Arc<SandboxEvent>>, LiveError> {
        let history = lock(&self.history);
        if self.next < history.first_seq {
            return Err(LiveError::FellBehind {
                missed: history.first_seq - self.next,
            });
        }
        while self.next < history.next_seq() {
            let event = &history.events[(self.next - history.first_seq) as usize].event;
            self.next += 1;
            if event.resource_version > self.after {
                return Ok(Some(Arc::clone(event)));
            }
        }
        Ok(None)
    }
}

fn lock(history: &Mutex<History>) -> std::sync::MutexGuard<'_, History> {
    history.lock().unwrap_or_else(|p| p.into_inner())
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

    /// A sandbox whose event is about `kib` KiB encoded.
    fn large(rv: u64, kib: usize) -> Sandbox {
        Sandbox {
            spec: Some(sbx_proto::v1::SandboxSpec {
                command: vec!["x".repeat(kib << 10)],
                ..Default::default()
            }),
            ..sandbox(rv)
        }
    }

    fn counted(max_events: usize) -> HistoryBounds {
        HistoryBounds {
            max_events,
            max_bytes: usize::MAX,
        }
    }

    /// A hub with room for 4 events of 10 KiB (each ≈ 10 KiB + EVENT_OVERHEAD; 4.5 of them, as
    /// the names' lengths differ), far below its count bound; and one such event's size.
    fn room_for_four_of_10_kib() -> (EventHub, usize) {
        let one = large(1, 10).encoded_len() + EVENT_OVERHEAD;
        let bounds = HistoryBounds {
            max_events: 10_000,
            max_bytes: 4 * one + one / 2,
        };
        (EventHub::new(bounds, 0), one)
    }

    fn drain(sub: &mut Subscription) -> Vec<u64> {
        let mut rvs = Vec::new();
        while let Some(ev) = sub.try_recv().unwrap() {
            rvs.push(ev.resource_version);
        }
        rvs
    }

    #[test]
    fn resume_delivers_exactly_the_events_after_the_version() {
        let hub = EventHub::new(counted(10), 0);
        for rv in 1..=5 {
            hub.publish(EventType::Modified, sandbox(rv));
        }
        let mut sub = hub.subscribe(3).unwrap();
        assert_eq!(drain(&mut sub), vec![4, 5]);
        hub.publish(EventType::Modified, sandbox(6));
        assert_eq!(drain(&mut sub), vec![6]);
    }

    #[test]
    fn resume_from_before_the_history_is_refused() {
        let hub = EventHub::new(counted(3), 0);
        for rv in 1..=5 {
            hub.publish(EventType::Modified, sandbox(rv));
        }
        // 1 and 2 were evicted: resuming after 1 would miss 2.
        assert!(matches!(
            hub.subscribe(1),
            Err(ActorError::ResourceVersionTooOld { .. })
        ));
        assert_eq!(drain(&mut hub.subscribe(2).unwrap()), vec![3, 4, 5]);
        // A hub started after a restart refuses versions from before it.
        let hub = EventHub::new(counted(3), 100);
        assert!(hub.subscribe(50).is_err());
        assert!(drain(&mut hub.subscribe(100).unwrap()).is_empty());
    }

    #[test]
    fn the_byte_bound_evicts_the_oldest_and_moves_the_horizon() {
        let (hub, one) = room_for_four_of_10_kib();
        for rv in 1..=20 {
            hub.publish(EventType::Modified, large(rv, 10));
            let (events, bytes) = hub.usage();
            assert!(bytes <= 4 * one + one / 2, "{bytes} bytes after {rv}");
            assert_eq!(events, (rv as usize).min(4), "events after {rv}");
        }
        // 1..=16 were evicted: the horizon is 16, so a resume after 15 would miss 16.
        assert!(matches!(
            hub.subscribe(15),
            Err(ActorError::ResourceVersionTooOld {
                requested: 15,
                oldest: 16
            })
        ));
        assert_eq!(drain(&mut hub.subscribe(16).unwrap()), vec![17, 18, 19, 20]);
        assert_eq!(drain(&mut hub.subscribe(18).unwrap()), vec![19, 20]);
    }

    #[test]
    fn an_event_larger_than_the_budget_is_kept_alone() {
        let hub = EventHub::new(
            HistoryBounds {
                max_events: 10,
                max_bytes: 1024,
            },
            0,
        );
        hub.publish(EventType::Modified, large(1, 8));
        hub.publish(EventType::Modified, large(2, 8));
        assert_eq!(hub.usage().0, 1);
        assert_eq!(drain(&mut hub.subscribe(1).unwrap()), vec![2]);
    }

    #[test]
    fn a_watcher_that_falls_behind_the_history_is_ended() {
        let (hub, _) = room_for_four_of_10_kib();
        let mut slow = hub.subscribe(0).unwrap();
        let mut keeping_up = hub.subscribe(0).unwrap();
        for rv in 1..=10 {
            hub.publish(EventType::Modified, large(rv, 10));
            assert_eq!(drain(&mut keeping_up), vec![rv]);
        }
        // 1..=6 are gone; the slow one had read none of them.
        assert_eq!(
            slow.try_recv().err(),
            Some(LiveError::FellBehind { missed: 6 })
        );
        // One that read up to the history's first event is behind by nothing yet.
        let mut edge = hub.subscribe(6).unwrap();
        assert_eq!(drain(&mut edge), vec![7, 8, 9, 10]);
    }

    #[test]
    fn evicted_events_are_freed_and_the_deque_shrinks() {
        let hub = EventHub::new(counted(100_000), 0);
        for rv in 1..=5000 {
            hub.publish(EventType::Modified, sandbox(rv));
        }
        let grown = lock(&hub.history).events.capacity();
        assert!(grown >= 5000);
        let mut sub = hub.subscribe(4999).unwrap();
        let held = Arc::downgrade(&sub.try_recv().unwrap().unwrap());
        // The history's own copy is the only one: a watcher holds none once it let go.
        assert!(held.upgrade().is_some());
        lock(&hub.history).bounds = HistoryBounds {
            max_events: 10,
            max_bytes: usize::MAX,
        };
        for rv in 5001..=5010 {
            hub.publish(EventType::Modified, sandbox(rv));
        }
        assert!(held.upgrade().is_none(), "an evicted event is still held");
        let shrunk = lock(&hub.history).events.capacity();
        assert!(shrunk < 1024, "the deque kept {shrunk} slots for 10 events");
    }

    #[tokio::test]
    async fn live_events_wake_the_watcher_and_a_closed_hub_ends_it() {
        let hub = EventHub::new(counted(10), 0);
        hub.publish(EventType::Added, sandbox(1));
        let mut sub = hub.subscribe(0).unwrap();
        assert!(sub.try_recv().unwrap().is_none());
        let waiting = tokio::spawn(async move {
            let ev = sub.recv().await.unwrap();
            let end = sub.recv().await;
            (ev, end)
        });
        tokio::task::yield_now().await;
        hub.publish(EventType::Deleted, sandbox(2));
        drop(hub);
        let (ev, end) = tokio::time::timeout(std::time::Duration::from_secs(5), waiting)
            .await
            .expect("the watcher was not woken")
            .unwrap();
        assert_eq!(
            (ev.resource_version, ev.r#type),
            (2, EventType::Deleted as i32)
        );
        assert_eq!(end.err(), Some(LiveError::Closed));
    }
}
