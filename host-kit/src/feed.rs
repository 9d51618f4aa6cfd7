//! The watch feed of a driver that learns about its sandboxes by looking (oci, process, vm):
//! every change it makes is published at once, and a poller started by the first watch
//! publishes what changed by itself (a workload that exited). Only changes are sent: the last
//! snapshot sent per sandbox is kept.
//!
//! A workload's end is an event, not only a poll: where the driver names the process whose
//! end is the run's end ([`Watched::run_init`]), a running snapshot's publication starts a
//! task waiting on that process's pidfd, which wakes the poller the moment it ends (the
//! init writes the exit status before it ends), so the exit is published within
//! milliseconds; the poll remains for everything else.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::sync::{Notify, broadcast};
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
    /// The process whose end is the end of sandbox `id`'s run (its init), while it runs:
    /// its exit wakes the poller. None where the driver has no such process.
    fn run_init(&self, _id: Uuid) -> Option<crate::procfs::ProcessIdentity> {
        None
    }
}

/// What the exit waiters share with the feed (not the driver: a waiter never keeps it alive).
#[derive(Debug, Default)]
struct Exits {
    /// Wakes the poller: a run's init ended.
    wake: Notify,
    /// The inits waited on, by sandbox.
    waited: Mutex<HashSet<(Uuid, crate::procfs::ProcessIdentity)>>,
}

#[derive(Debug)]
pub struct SnapshotFeed {
    events: broadcast::Sender<pb::WatchEvent>,
    /// The last snapshot sent per sandbox, to send only changes.
    last_seen: Mutex<HashMap<Uuid, pb::Snapshot>>,
    /// Whether the poller runs.
    poller_started: AtomicBool,
    exits: Arc<Exits>,
    /// Dropped with the feed: ends the exit waiters.
    closed: tokio::sync::watch::Sender<()>,
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
            exits: Arc::default(),
            closed: tokio::sync::watch::channel(()).0,
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
    if last.get(&id) == Some(snapshot) {
        return;
    }
    last.insert(id, snapshot.clone());
    let _ = feed.events.send(pb::WatchEvent {
        snapshot: Some(snapshot.clone()),
        deleted: false,
    });
    drop(last);
    // A run that started (or was seen running anew): its end is waited for.
    if snapshot.state() == pb::State::Running {
        wait_for_exit(driver, id);
    }
}

/// Starts a task that wakes the poller when sandbox `id`'s run init ends, unless one waits
/// for that init already (or there is no runtime to run it on).
fn wait_for_exit(driver: &impl Watched, id: Uuid) {
    let Some(init) = driver.run_init(id) else {
        return;
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    let feed = driver.feed();
    if !locked(&feed.exits.waited).insert((id, init)) {
        return;
    }
    let exits = Arc::clone(&feed.exits);
    let mut closed = feed.closed.subscribe();
    runtime.spawn(async move {
        tokio::select! {
            _ = ended(id, init) => exits.wake.notify_one(),
            // The driver went: nothing to wake.
            _ = closed.changed() => {}
        }
        locked(&exits.waited).remove(&(id, init));
    });
}

/// Resolves when `init` (sandbox `id`'s) has ended: its pidfd turns readable. At once if it
/// is gone already or is not the sandbox's (its pid named another process by now).
async fn ended(id: Uuid, init: crate::procfs::ProcessIdentity) {
    let Some(pid) = rustix::process::Pid::from_raw(init.pid) else {
        return;
    };
    let Ok(pidfd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK) else {
        return;
    };
    // Checked once the pidfd is open: from here on it names that process for good.
    if !crate::procfs::is_sandbox_process(&init, &id.to_string()) {
        return;
    }
    let _ = sbx_sys::process_ended(pidfd).await;
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
            for (id, snapshot) in &current {
                last.entry(*id).or_insert_with(|| snapshot.clone());
            }
        }
        // Runs that began before this driver did: their ends are waited for too.
        for (id, snapshot) in &current {
            if snapshot.state() == pb::State::Running {
                wait_for_exit(driver.as_ref(), *id);
            }
        }
        let weak = Arc::downgrade(driver);
        let exits = Arc::clone(&driver.feed().exits);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = exits.wake.notified() => {}
                }
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
