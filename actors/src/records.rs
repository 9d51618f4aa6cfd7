//! How sandboxes and workspaces are kept in the object store: the record's body is the
//! prost-encoded public message; timestamps and resource version come from the record itself.

use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;
use sbx_proto::Timestamp;
use sbx_proto::v1::{Sandbox, Workspace};
use sbx_storage::{Kind, NewRecord, Record};
use uuid::Uuid;

use crate::error::{ActorError, Result};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub fn timestamp(ms: u64) -> Timestamp {
    Timestamp {
        seconds: (ms / 1000) as i64,
        nanos: ((ms % 1000) * 1_000_000) as i32,
    }
}

/// A sandbox as stored, with the record it came from (for compare-and-swap writes).
#[derive(Debug, Clone)]
pub struct StoredSandbox {
    pub record: Record,
    pub sandbox: Sandbox,
}

impl StoredSandbox {
    pub fn id(&self) -> Uuid {
        self.record.id
    }

    /// The workspace the sandbox is in (nil for a record without one, which the store never
    /// writes).
    pub fn workspace_id(&self) -> Uuid {
        self.record.workspace.unwrap_or_default()
    }

    pub fn from_record(record: Record) -> Result<Self> {
        let mut sandbox = Sandbox::decode(record.body.as_slice()).map_err(|e| {
            ActorError::Internal(format!("sandbox record {} does not decode: {e}", record.id))
        })?;
        fill_sandbox_meta(&mut sandbox, &record);
        Ok(StoredSandbox { record, sandbox })
    }

    /// The record to write for the current `sandbox`, checked against the version read.
    pub fn to_update(&self) -> Record {
        let mut record = self.record.clone();
        record.labels = self
            .sandbox
            .spec
            .as_ref()
            .map(|s| s.labels.clone().into_iter().collect())
            .unwrap_or_default();
        record.body = encode_sandbox_body(&self.sandbox);
        record.updated_at_ms = now_ms();
        record
    }
}

fn fill_sandbox_meta(sandbox: &mut Sandbox, record: &Record) {
    sandbox.id = record.id.to_string();
    sandbox.resource_version = record.resource_version;
    sandbox.created_at = Some(timestamp(record.created_at_ms));
    sandbox.updated_at = Some(timestamp(record.updated_at_ms));
    if let Some(ws) = record.workspace {
        sandbox.workspace_id = ws.to_string();
    }
    sandbox.name = record.name.clone();
}

/// The body omits what the record itself carries, so the two can never disagree.
fn encode_sandbox_body(sandbox: &Sandbox) -> Vec<u8> {
    let mut body = sandbox.clone();
    body.resource_version = 0;
    body.created_at = None;
    body.updated_at = None;
    body.encode_to_vec()
}

pub fn new_sandbox_record(id: Uuid, workspace_id: Uuid, sandbox: &Sandbox) -> NewRecord {
    NewRecord {
        id,
        kind: Kind::Sandbox,
        workspace: Some(workspace_id),
        name: sandbox.name.clone(),
        owner: None,
        labels: sandbox
            .spec
            .as_ref()
            .map(|s| s.labels.clone().into_iter().collect())
            .unwrap_or_default(),
        created_at_ms: now_ms(),
        body: encode_sandbox_body(sandbox),
    }
}

/// A workspace as stored.
#[derive(Debug, Clone)]
pub struct StoredWorkspace {
    pub record: Record,
    pub workspace: Workspace,
}

impl StoredWorkspace {
    pub fn id(&self) -> Uuid {
        self.record.id
    }

    pub fn from_record(record: Record) -> Result<Self> {
        let mut workspace = Workspace::decode(record.body.as_slice()).map_err(|e| {
            ActorError::Internal(format!(
                "workspace record {} does not decode: {e}",
                record.id
            ))
        })?;
        workspace.id = record.id.to_string();
        workspace.name = record.name.clone();
        workspace.resource_version = record.resource_version;
        workspace.created_at = Some(timestamp(record.created_at_ms));
        workspace.updated_at = Some(timestamp(record.updated_at_ms));
        Ok(StoredWorkspace { record, workspace })
    }

    pub fn to_update(&self) -> Record {
        let mut record = self.record.clone();
        record.labels = self.workspace.labels.clone().into_iter().collect();
        record.body = encode_workspace_body(&self.workspace);
        record.updated_at_ms = now_ms();
        record
    }
}

fn encode_workspace_body(workspace: &Workspace) -> Vec<u8> {
    let mut body = workspace.clone();
    body.resource_version = 0;
    body.created_at = None;
    body.updated_at = None;
    body.encode_to_vec()
}

pub fn new_workspace_record(id: Uuid, workspace: &Workspace) -> NewRecord {
    NewRecord {
        id,
        kind: Kind::Workspace,
        workspace: None,
        name: workspace.name.clone(),
        owner: None,
        labels: workspace.labels.clone().into_iter().collect(),
        created_at_ms: now_ms(),
        body: encode_workspace_body(workspace),
    }
}
