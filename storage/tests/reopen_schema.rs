//! Reopen after close, and the schema version: initialize, refuse, migrate.

mod common;

use common::*;
use sbx_storage::layout::{
    META_SCHEMA_VERSION, TREE_META, TREE_NAMES, TREE_ORDER_WS, TREE_OWNERS, TREE_WS_COUNTS,
    encode_id_list, name_key,
};
use sbx_storage::{
    Kind, ListQuery, ObjectStore, SCHEMA_VERSION, SchemaOutcome, Scope, SledStore, StoreError,
};

/// The store's sled opened directly: the test's own handle on the trees, which waits for a
/// lock the store just closed still holds for a moment (sled's threads finish after the drop:
/// a CI run met it here).
fn raw_open(path: &std::path::Path) -> sled::Db {
    sbx_storage::open_raw_sled(path).unwrap()
}

#[tokio::test]
async fn reopen_keeps_data_indexes_and_revision() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let (ws, sb, setting, revision) = {
        let store = SledStore::open(&path).unwrap();
        assert_eq!(store.schema_outcome(), &SchemaOutcome::Initialized);
        let ws = workspace(&store, "team").await;
        let sb = sandbox(&store, &ws, "web").await;
        let setting = store.create(new_setting(&sb, "env")).await.unwrap();
        let mut change = sb.clone();
        change.labels = labels(&[("app", "web")]);
        let sb = store.update(change).await.unwrap();
        let gone = sandbox(&store, &ws, "gone").await;
        store.delete(gone.id, gone.resource_version).await.unwrap();
        let revision = store.current_revision().await.unwrap();
        (ws, sb, setting, revision)
    };
    let store = SledStore::open(&path).unwrap();
    assert_eq!(store.schema_outcome(), &SchemaOutcome::Current);
    assert_eq!(store.current_revision().await.unwrap(), revision);
    assert_eq!(store.get(sb.id).await.unwrap(), Some(sb.clone()));
    assert_eq!(
        store
            .get_by_name(Kind::Workspace, None, "team")
            .await
            .unwrap(),
        Some(ws.clone())
    );
    assert!(
        store
            .get_by_name(Kind::Sandbox, Some(ws.id), "gone")
            .await
            .unwrap()
            .is_none()
    );
    assert_eq!(store.owned(sb.id).await.unwrap(), vec![setting.id]);
    let listed = store
        .list(ListQuery::new(Kind::Sandbox, Scope::Workspace(ws.id), 0))
        .await
        .unwrap();
    assert_eq!(listed.records, vec![sb.clone()]);
    assert!(matches!(
        store.delete(ws.id, ws.resource_version).await,
        Err(StoreError::NotEmpty { remaining: 2, .. })
    ));
    assert_fsck_clean(&store);
    // The revision continues from where it was, never backwards.
    let next = sandbox(&store, &ws, "next").await;
    assert_eq!(next.resource_version, revision + 1);
}

/// Sets the raw schema version of a closed store.
fn set_raw_version(path: &std::path::Path, raw: &[u8]) {
    let db = raw_open(path);
    db.open_tree(TREE_META)
        .unwrap()
        .insert(META_SCHEMA_VERSION, raw)
        .unwrap();
    db.flush().unwrap();
}

fn raw_version(path: &std::path::Path) -> Option<Vec<u8>> {
    let db = raw_open(path);
    let meta = db.open_tree(TREE_META).unwrap();
    meta.get(META_SCHEMA_VERSION).unwrap().map(|v| v.to_vec())
}

async fn store_with_data(path: &std::path::Path) {
    let store = SledStore::open(path).unwrap();
    let ws = workspace(&store, "team").await;
    sandbox(&store, &ws, "web").await;
}

#[tokio::test]
async fn newer_or_unknown_versions_are_refused_untouched() {
    let cases: [(&[u8], &str); 3] = [
        (&99u32.to_be_bytes(), "99"),
        (&0u32.to_be_bytes(), "0"),
        (&[1, 2, 3], "[01, 02, 03]"),
    ];
    for (raw, found_text) in cases {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("db");
        store_with_data(&path).await;
        set_raw_version(&path, raw);
        let err = SledStore::open(&path).unwrap_err();
        match &err {
            StoreError::Schema {
                store,
                found,
                supported,
                ..
            } => {
                assert_eq!(store, &format!("sled store at {}", path.display()));
                assert_eq!(found, found_text);
                assert_eq!(*supported, SCHEMA_VERSION);
            }
            other => panic!("expected Schema, got {other:?}"),
        }
        let msg = err.to_string();
        assert!(
            msg.contains(found_text) && msg.contains(&SCHEMA_VERSION.to_string()),
            "{msg}"
        );
        assert!(msg.contains(&path.display().to_string()), "{msg}");
        assert_eq!(
            raw_version(&path).as_deref(),
            Some(raw),
            "refusal changed the db"
        );
    }
}

#[tokio::test]
async fn data_without_a_version_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    {
        let db = raw_open(&path);
        db.open_tree("records").unwrap().insert(b"x", b"y").unwrap();
        db.flush().unwrap();
    }
    let err = SledStore::open(&path).unwrap_err();
    assert!(
        matches!(&err, StoreError::Schema { found, .. } if found == "none"),
        "{err:?}"
    );
}

#[tokio::test]
async fn version_1_is_migrated_to_2() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let (ws, sandboxes) = {
        let store = SledStore::open(&path).unwrap();
        let ws = workspace(&store, "team").await;
        let other = workspace(&store, "other").await;
        let mut sandboxes = Vec::new();
        for i in 0..5 {
            sandboxes.push(sandbox(&store, &ws, &format!("sb-{i}")).await);
        }
        sandbox(&store, &other, "elsewhere").await;
        store
            .create(new_setting(&sandboxes[0], "env"))
            .await
            .unwrap();
        (ws, sandboxes)
    };
    // Turn it into a version-1 layout: no per-workspace order index, no counts.
    {
        let db = raw_open(&path);
        assert!(db.drop_tree(TREE_ORDER_WS).unwrap());
        assert!(db.drop_tree(TREE_WS_COUNTS).unwrap());
        db.open_tree(TREE_META)
            .unwrap()
            .insert(META_SCHEMA_VERSION, &1u32.to_be_bytes())
            .unwrap();
        db.flush().unwrap();
    }
    let store = SledStore::open(&path).unwrap();
    assert_eq!(store.schema_outcome(), &SchemaOutcome::Migrated { from: 1 });
    assert_fsck_clean(&store);
    let listed = store
        .list(ListQuery::new(Kind::Sandbox, Scope::Workspace(ws.id), 0))
        .await
        .unwrap();
    let mut want = sandboxes.clone();
    want.sort_by_key(|r| (r.created_at_ms, r.id));
    assert_eq!(listed.records, want);
    assert!(matches!(
        store.delete(ws.id, ws.resource_version).await,
        Err(StoreError::NotEmpty { remaining: 6, .. })
    ));
    drop(store);
    assert_eq!(
        raw_version(&path).as_deref(),
        Some(&SCHEMA_VERSION.to_be_bytes()[..])
    );
    assert_eq!(
        SledStore::open(&path).unwrap().schema_outcome(),
        &SchemaOutcome::Current
    );
}

#[tokio::test]
async fn version_2_is_migrated_to_3() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let (a, b, settings) = {
        let store = SledStore::open(&path).unwrap();
        let ws = workspace(&store, "team").await;
        let a = sandbox(&store, &ws, "a").await;
        let b = sandbox(&store, &ws, "b").await;
        let mut settings = Vec::new();
        for i in 0..300 {
            settings.push(
                store
                    .create(new_setting(&a, &format!("key-{i}")))
                    .await
                    .unwrap(),
            );
        }
        (a, b, settings)
    };
    // Turn it into a version-2 layout: one flat owner list per owner, owned records named
    // in their workspace.
    {
        let db = raw_open(&path);
        let owners = db.open_tree(TREE_OWNERS).unwrap();
        owners.clear().unwrap();
        let ids: Vec<_> = settings.iter().map(|s| s.id).collect();
        owners
            .insert(a.id.as_bytes(), encode_id_list(&ids))
            .unwrap();
        let names = db.open_tree(TREE_NAMES).unwrap();
        for s in &settings {
            names
                .remove(name_key(s.kind, s.owner, &s.name))
                .unwrap()
                .expect("a version-3 name entry");
            names
                .insert(name_key(s.kind, s.workspace, &s.name), s.id.as_bytes())
                .unwrap();
        }
        db.open_tree(TREE_META)
            .unwrap()
            .insert(META_SCHEMA_VERSION, &2u32.to_be_bytes())
            .unwrap();
        db.flush().unwrap();
    }
    let store = SledStore::open(&path).unwrap();
    assert_eq!(store.schema_outcome(), &SchemaOutcome::Migrated { from: 2 });
    assert_fsck_clean(&store);
    let want: Vec<_> = settings.iter().map(|s| s.id).collect();
    assert_eq!(
        store.owned(a.id).await.unwrap(),
        want,
        "owned, in creation order"
    );
    let found = store
        .get_by_name(Kind::Setting, Some(a.id), "key-7")
        .await
        .unwrap();
    assert_eq!(found.map(|r| r.id), Some(settings[7].id));
    // Named per owner now: the other sandbox may take the same key.
    store.create(new_setting(&b, "key-7")).await.unwrap();
    let deleted = store.delete(a.id, a.resource_version).await.unwrap();
    assert_eq!(deleted.len(), 301, "the sandbox and its 300 settings");
    assert_fsck_clean(&store);
}

#[tokio::test]
async fn a_second_open_of_a_live_store_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("db");
    let store = SledStore::open(&path).unwrap();
    workspace(&store, "team").await;
    let err = SledStore::open(&path).unwrap_err();
    assert!(matches!(err, StoreError::Io(_)), "{err:?}");
    assert!(
        err.to_string().contains(&path.display().to_string()),
        "{err}"
    );
    drop(store);
    // Closing releases it: the data is there on the next open.
    let store = SledStore::open(&path).unwrap();
    assert!(
        store
            .get_by_name(Kind::Workspace, None, "team")
            .await
            .unwrap()
            .is_some()
    );
}
