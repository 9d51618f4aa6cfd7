//! The smallest driver: sandboxes kept in memory that run nothing. It exists to show what
//! adding a driver takes — this crate and one row in `sbx_drivers::registry` (compiled into
//! the registry's tests only) — and answers the contract's lifecycle calls truthfully:
//! a create records the sandbox (running unless asked stopped, under the generation asked),
//! start and stop change its state, delete forgets it; it has no exec, no logs of its own
//! and no files.

use std::collections::BTreeMap;
use std::sync::Mutex;

use async_trait::async_trait;
use futures::StreamExt;
use sbx_driver_api::{
    ComputeDriver, DriverError, DriverStream, ExecInputStream, locked, parse_sandbox_id, pb,
};
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;

/// The example driver (see the crate's docs).
#[derive(Debug)]
pub struct ExampleDriver {
    sandboxes: Mutex<BTreeMap<String, pb::Snapshot>>,
    events: broadcast::Sender<pb::WatchEvent>,
}

impl Default for ExampleDriver {
    fn default() -> ExampleDriver {
        ExampleDriver {
            sandboxes: Mutex::new(BTreeMap::new()),
            events: broadcast::channel(1024).0,
        }
    }
}

fn state_of(running: bool) -> i32 {
    if running {
        pb::State::Running as i32
    } else {
        pb::State::Stopped as i32
    }
}

impl ExampleDriver {
    /// Changes the sandbox `id` with `change` and tells the watchers; its snapshot after.
    fn change(
        &self,
        id: &str,
        change: impl FnOnce(&mut pb::Snapshot),
    ) -> Result<pb::Snapshot, DriverError> {
        let mut sandboxes = locked(&self.sandboxes);
        let snapshot = sandboxes.get_mut(id).ok_or_else(|| DriverError::NotFound {
            sandbox_id: id.to_string(),
        })?;
        change(snapshot);
        let _ = self.events.send(pb::WatchEvent {
            snapshot: Some(snapshot.clone()),
            deleted: false,
        });
        Ok(snapshot.clone())
    }
}

#[async_trait]
impl ComputeDriver for ExampleDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        Ok(pb::CapabilitiesResponse {
            driver: "example".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            watch: true,
            isolation: "none: its sandboxes run nothing".to_string(),
            ..Default::default()
        })
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?.to_string();
        if let Some(known) = locked(&self.sandboxes).get(&id) {
            return Ok(known.clone());
        }
        let snapshot = pb::Snapshot {
            sandbox_id: id.clone(),
            workspace: req.workspace,
            name: req.name,
            state: state_of(!req.stopped),
            generation: req.generation,
            ..Default::default()
        };
        locked(&self.sandboxes).insert(id.clone(), snapshot);
        self.change(&id, |_| {})
    }

    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?.to_string();
        self.change(&id, |s| {
            s.state = state_of(true);
            s.generation = req.generation;
        })
    }

    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?.to_string();
        self.change(&id, |s| s.state = state_of(false))
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?.to_string();
        let removed = locked(&self.sandboxes).remove(&id);
        if let Some(snapshot) = &removed {
            let _ = self.events.send(pb::WatchEvent {
                snapshot: Some(snapshot.clone()),
                deleted: true,
            });
        }
        Ok(pb::DeleteResponse {
            deleted: removed.is_some(),
        })
    }

    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?.to_string();
        let sandboxes = locked(&self.sandboxes);
        sandboxes
            .get(&id)
            .cloned()
            .ok_or(DriverError::NotFound { sandbox_id: id })
    }

    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        Ok(locked(&self.sandboxes).values().cloned().collect())
    }

    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        // A watcher too slow to keep up misses events, as the contract allows: its next list
        // tells it the truth.
        let events = BroadcastStream::new(self.events.subscribe());
        Ok(Box::pin(
            events.filter_map(|e| async move { e.ok().map(Ok) }),
        ))
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        _input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        parse_sandbox_id(&req.sandbox_id)?;
        Err(DriverError::Unimplemented(
            "exec: the example driver's sandboxes run nothing".into(),
        ))
    }

    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        self.get(pb::GetRequest {
            sandbox_id: req.sandbox_id,
        })
        .await?;
        Ok(Box::pin(futures::stream::empty()))
    }
}
