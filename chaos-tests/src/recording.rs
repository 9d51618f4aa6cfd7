//! A driver decorator that remembers, for every sandbox id a driver was ever asked to create,
//! the workspace and name the gateway sent — so a chaos check can tell, after the fact, which
//! sandbox each destructive call really hit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use sbx_drivers::{ComputeDriver, DriverError, DriverStream, pb};

/// Where a sandbox id belongs, as the gateway told the driver at create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub workspace: String,
    pub name: String,
}

pub struct RecordingDriver {
    inner: Arc<dyn ComputeDriver>,
    placements: Arc<Mutex<HashMap<String, Placement>>>,
}

impl RecordingDriver {
    pub fn new(inner: Arc<dyn ComputeDriver>) -> Self {
        RecordingDriver {
            inner,
            placements: Arc::default(),
        }
    }

    /// A handle on the placements that stays usable after the driver is handed away.
    pub fn placements(&self) -> Arc<Mutex<HashMap<String, Placement>>> {
        Arc::clone(&self.placements)
    }
}

#[async_trait]
impl ComputeDriver for RecordingDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        self.inner.capabilities().await
    }
    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        self.placements
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(
                req.sandbox_id.clone(),
                Placement {
                    workspace: req.workspace.clone(),
                    name: req.name.clone(),
                },
            );
        self.inner.create(req).await
    }
    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        self.inner.start(req).await
    }
    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        self.inner.stop(req).await
    }
    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        self.inner.delete(req).await
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
    async fn exec(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.inner.exec(req).await
    }
    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        self.inner.logs(req).await
    }
}
