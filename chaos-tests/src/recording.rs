//! A driver decorator that numbers every call it forwards and remembers, for every sandbox id
//! a driver was asked to create, the workspace and name the gateway sent, and every stop and
//! delete with its number — so a chaos check can tell, after the fact, which sandbox each
//! destructive call really hit, and whether a client had asked for it by then.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sbx_drivers::{ComputeDriver, DriverError, DriverStream, pb};

/// Where a sandbox id belongs, as the gateway told the driver at its first create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub workspace: String,
    pub name: String,
    /// The number of that first create call.
    pub created_at: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destructive {
    Stop,
    Delete,
}

/// One stop or delete the driver received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DestructiveCall {
    pub op: Destructive,
    pub sandbox_id: String,
    /// Its number in the order of all calls.
    pub seq: u64,
    /// When the driver got it (a ttl's call must not come before the ttl's deadline).
    pub at: std::time::SystemTime,
}

#[derive(Default)]
pub struct Recording {
    /// Numbers calls; also read by clients to date their requests on the same clock.
    pub clock: AtomicU64,
    pub placements: Mutex<HashMap<String, Placement>>,
    pub destructive: Mutex<Vec<DestructiveCall>>,
}

impl Recording {
    /// The current position of the call clock.
    pub fn now(&self) -> u64 {
        self.clock.load(Ordering::SeqCst)
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst) + 1
    }

    fn destructive(&self, op: Destructive, sandbox_id: &str) {
        let seq = self.tick();
        self.destructive
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(DestructiveCall {
                op,
                sandbox_id: sandbox_id.to_string(),
                seq,
                at: std::time::SystemTime::now(),
            });
    }
}

pub struct RecordingDriver {
    inner: Arc<dyn ComputeDriver>,
    recording: Arc<Recording>,
}

impl RecordingDriver {
    pub fn new(inner: Arc<dyn ComputeDriver>) -> Self {
        RecordingDriver {
            inner,
            recording: Arc::default(),
        }
    }

    /// A handle on the recording that stays usable after the driver is handed away.
    pub fn recording(&self) -> Arc<Recording> {
        Arc::clone(&self.recording)
    }
}

#[async_trait]
impl ComputeDriver for RecordingDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        self.inner.capabilities().await
    }
    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let seq = self.recording.tick();
        self.recording
            .placements
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(req.sandbox_id.clone())
            .or_insert(Placement {
                workspace: req.workspace.clone(),
                name: req.name.clone(),
                created_at: seq,
            });
        self.inner.create(req).await
    }
    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        self.inner.start(req).await
    }
    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        self.recording
            .destructive(Destructive::Stop, &req.sandbox_id);
        self.inner.stop(req).await
    }
    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        self.recording
            .destructive(Destructive::Delete, &req.sandbox_id);
        self.inner.delete(req).await
    }
    async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        self.inner.pause(req).await
    }
    async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        self.inner.resume(req).await
    }
    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        self.inner.get(req).await
    }
    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        self.inner.list().await
    }
    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        self.inner.watch().await
    }
    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: sbx_drivers::ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.inner.exec_io(req, input).await
    }
    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        self.inner.logs(req).await
    }
}
