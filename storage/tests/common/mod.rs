//! Helpers shared by the storage integration tests.
#![allow(dead_code)] // each test binary uses a different subset

use std::collections::BTreeMap;

use sbx_storage::{Kind, NewRecord, ObjectStore, Record, SledStore};
use uuid::Uuid;

pub fn open_temp() -> (tempfile::TempDir, SledStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SledStore::open(&dir.path().join("db")).expect("open store");
    (dir, store)
}

pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

pub fn new_workspace(name: &str) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Workspace,
        workspace: None,
        name: name.into(),
        owner: None,
        labels: BTreeMap::new(),
        created_at_ms: 1_000,
        body: b"ws".to_vec(),
    }
}

pub fn new_sandbox(ws: Uuid, name: &str) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Sandbox,
        workspace: Some(ws),
        name: name.into(),
        owner: None,
        labels: BTreeMap::new(),
        created_at_ms: 2_000,
        body: b"sb".to_vec(),
    }
}

pub fn new_setting(owner: &Record, name: &str) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Setting,
        workspace: owner.workspace,
        name: name.into(),
        owner: Some(owner.id),
        labels: BTreeMap::new(),
        created_at_ms: 3_000,
        body: b"set".to_vec(),
    }
}

pub async fn workspace(store: &SledStore, name: &str) -> Record {
    store
        .create(new_workspace(name))
        .await
        .expect("create workspace")
}

pub async fn sandbox(store: &SledStore, ws: &Record, name: &str) -> Record {
    store
        .create(new_sandbox(ws.id, name))
        .await
        .expect("create sandbox")
}

/// Asserts the store's indexes agree with its records.
pub fn assert_fsck_clean(store: &SledStore) {
    let problems = store.verify_indexes().expect("fsck runs");
    assert!(problems.is_empty(), "fsck found problems: {problems:#?}");
}
