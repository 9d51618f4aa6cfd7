//! What the simulated machine really removed, as opposed to what its driver was asked to
//! remove. A fault-free observer driver on the same [`SimWorld`] follows the world's watch
//! stream and keeps the id of every workload a delete removed (the world reports each removal
//! there, from inside the delete that did it; `crash_lose_all` reports nothing). The check
//! [`unasked_removals`] then holds the removals against the delete calls the gateway's driver
//! received (see `recording.rs`): a workload may be removed only by a delete naming that very
//! id, once per such call. A driver that, not finding an id, deletes "the one with the same
//! name" instead — the classic idempotent-delete-by-name bug — removes a workload nobody
//! named, and fails it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use futures::StreamExt;
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError};
use tokio::task::JoinHandle;

use crate::recording::{Destructive, DestructiveCall};

/// Follows one world's removals until dropped.
pub struct RemovalObserver {
    removed: Arc<Mutex<Vec<String>>>,
    /// Watch events missed because the observer fell behind the broadcast buffer: removals
    /// among them are not checked (the check can then miss a removal, never invent one).
    lagged: Arc<AtomicU64>,
    task: JoinHandle<()>,
    /// Kept alive: the watch stream ends when its driver instance is dropped.
    _driver: Arc<SimDriver>,
}

impl RemovalObserver {
    /// Subscribes to `world`'s watch stream through a driver without faults (the driver the
    /// gateway uses may be told to hang or fail; this one must not miss anything).
    pub async fn start(world: SimWorld) -> Result<Self, DriverError> {
        let driver = Arc::new(SimDriver::new(world, SimFaults::seeded(0)));
        let mut events = driver.watch().await?;
        let removed = Arc::new(Mutex::new(Vec::new()));
        let lagged = Arc::new(AtomicU64::new(0));
        let task = {
            let (removed, lagged) = (Arc::clone(&removed), Arc::clone(&lagged));
            tokio::spawn(async move {
                while let Some(event) = events.next().await {
                    match event {
                        Ok(event) if event.deleted => {
                            let id = event.snapshot.map(|s| s.sandbox_id).unwrap_or_default();
                            removed.lock().unwrap_or_else(|p| p.into_inner()).push(id);
                        }
                        Ok(_) => {}
                        Err(_) => {
                            lagged.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
            })
        };
        Ok(RemovalObserver {
            removed,
            lagged,
            task,
            _driver: driver,
        })
    }

    /// The ids removed so far, in the order the world removed them.
    pub fn removed(&self) -> Vec<String> {
        self.removed
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// How many times the observer fell behind (each loses some events).
    pub fn lagged(&self) -> u64 {
        self.lagged.load(Ordering::Relaxed)
    }
}

impl Drop for RemovalObserver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Ids removed more often than deletes naming them were received, with how many times each
/// was removed and asked for. Take `removed` before `calls`: a call is recorded before it
/// reaches the world, so every removal observed has its call in a later copy of the calls.
pub fn unasked_removals(removed: &[String], calls: &[DestructiveCall]) -> Vec<(String, u64, u64)> {
    let mut asked: HashMap<&str, u64> = HashMap::new();
    for call in calls.iter().filter(|c| c.op == Destructive::Delete) {
        *asked.entry(call.sandbox_id.as_str()).or_default() += 1;
    }
    let mut times: HashMap<&str, u64> = HashMap::new();
    for id in removed {
        *times.entry(id.as_str()).or_default() += 1;
    }
    let mut out: Vec<(String, u64, u64)> = times
        .into_iter()
        .map(|(id, n)| (id, n, asked.get(id).copied().unwrap_or(0)))
        .filter(|(_, n, asked)| n > asked)
        .map(|(id, n, asked)| (id.to_string(), n, asked))
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_drivers::pb;

    fn call(op: Destructive, id: &str, seq: u64) -> DestructiveCall {
        DestructiveCall {
            op,
            sandbox_id: id.to_string(),
            seq,
            at: std::time::SystemTime::now(),
        }
    }

    #[test]
    fn each_removal_needs_its_own_delete_of_that_id() {
        let calls = [
            call(Destructive::Delete, "a", 1),
            call(Destructive::Stop, "b", 2),
            call(Destructive::Delete, "a", 3),
        ];
        let removed = |ids: &[&str]| ids.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert!(unasked_removals(&removed(&["a"]), &calls).is_empty());
        assert!(unasked_removals(&removed(&["a", "a"]), &calls).is_empty());
        assert_eq!(
            unasked_removals(&removed(&["a", "a", "a"]), &calls),
            vec![("a".to_string(), 3, 2)]
        );
        // A stop is not a delete.
        assert_eq!(
            unasked_removals(&removed(&["b"]), &calls),
            vec![("b".to_string(), 1, 0)]
        );
    }

    #[tokio::test]
    async fn the_observer_sees_deletes_and_not_crashes() {
        let world = SimWorld::new();
        let observer = RemovalObserver::start(world.clone()).await.unwrap();
        let driver = SimDriver::new(world.clone(), SimFaults::seeded(1));
        let ids: Vec<String> = (0..3).map(|_| uuid::Uuid::new_v4().to_string()).collect();
        for (i, id) in ids.iter().enumerate() {
            driver
                .create(pb::CreateRequest {
                    run_env: Default::default(),
                    sandbox_id: id.clone(),
                    workspace: "ws".into(),
                    name: format!("sb-{i}"),
                    generation: 1,
                    spec: Some(pb::SandboxSpec::default()),
                    stopped: false,
                })
                .await
                .unwrap();
        }
        let deleted = driver
            .delete(pb::DeleteRequest {
                sandbox_id: ids[0].clone(),
            })
            .await
            .unwrap();
        assert!(deleted.deleted);
        world.crash_lose_all();
        let began = std::time::Instant::now();
        while observer.removed().is_empty() && began.elapsed().as_secs() < 5 {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert_eq!(observer.removed(), vec![ids[0].clone()]);
        assert_eq!(observer.lagged(), 0);
    }
}
