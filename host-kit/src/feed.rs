//! The watch feed of a driver that learns about its sandboxes by looking (oci, process, vm):
//! every change it makes is published at once, and a poller started by the first watch
//! publishes what changed by itself (a workload that exited). Only changes are sent: the last
//! snapshot sent per sandbox is kept.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;
use uuid::Uuid;

use super::locked;
use sbx_driver_api::{DriverError, pb};

/// A driver's state, as its feed sees it.
pub trait Watched: Send + Sync + 'static {
    fn feed(&self) -> &SnapshotFeed;
    /// Every sandbox's snapshot now.
    fn current(&self) -> Vec<(Uuid, pb::Snapshot)>;
    /// Whether the driver still has sandbox `id` (a deleted one's last snapshot is not sent).
    fn exists(&self, id: Uuid) -> bool;
}

#[derive(Debug)]
pub struct SnapshotFeed {
    events: broadcast::Sender<pb::WatchEvent>,
    /// The last snapshot sent per sandbox, to send only changes.
    last_seen: Mutex<HashMap<Uuid, pb::Snapshot>>,
    /// Whether the poller runs.
    poller_started: AtomicBool,
}

impl Default for SnapshotFeed {
    fn default() -> SnapshotFeed {
        SnapshotFeed::new()
    }
}

impl SnapshotFeed {
    pub fn new() -> SnapshotFeed {
        SnapshotFeed {
            events: broadcast::channel(1024).0,
            last_seen: Mutex::new(HashMap::new()),
            poller_started: AtomicBool::new(false),
        }
    }
}

/// Sends `snapshot` to watchers if it differs from the last one sent for `id` and the
/// sandbox still exists (checked under the feed's lock, so a delete's last event cannot be
/// followed by a stale one).
pub fn publish(driver: &impl Watched, id: Uuid, snapshot: &pb::Snapshot) {
    let feed = driver.feed();
    let mut last = locked(&feed.last_seen);
    if !driver.exists(id) {
        return;
    }
    if last.get(&id) != Some(snapshot) {
        last.insert(id, snapshot.clone());
        let _ = feed.events.send(pb::WatchEvent {
            snapshot: Some(snapshot.clone()),
            deleted: false,
        });
    }
}

/// Sends the last snapshot of a deleted sandbox.
pub fn publish_deleted(driver: &impl Watched, id: Uuid, snapshot: pb::Snapshot) {
    let feed = driver.feed();
    locked(&feed.last_seen).remove(&id);
    let _ = feed.events.send(pb::WatchEvent {
        snapshot: Some(snapshot),
        deleted: true,
    });
}

/// A watch: changes from now on. The first watch starts the poller (every `interval`), which
/// holds only a weak reference and ends with the driver. `name` prefixes the lag error.
pub fn watch<D: Watched>(
    driver: &Arc<D>,
    name: &'static str,
    interval: Duration,
) -> impl Stream<Item = Result<pb::WatchEvent, DriverError>> + Send + 'static {
    let events = driver.feed().events.subscribe();
    if !driver.feed().poller_started.swap(true, Ordering::SeqCst) {
        // The first poll records the current state without sending it, so watchers (already
        // subscribed) see only later changes.
        let current = driver.current();
        {
            let mut last = locked(&driver.feed().last_seen);
            for (id, snapshot) in current {
                last.entry(id).or_insert(snapshot);
            }
        }
        let weak = Arc::downgrade(driver);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(interval).await;
                let Some(driver) = weak.upgrade() else { return };
                for (id, snapshot) in driver.current() {
                    publish(driver.as_ref(), id, &snapshot);
                }
            }
        });
    }
    BroadcastStream::new(events).map(move |event| {
        event.map_err(|BroadcastStreamRecvError::Lagged(missed)| {
            DriverError::Unavailable(format!(
                "{name}: watch fell {missed} events behind; list again to resynchronise"
            ))
        })
    })
}
