//! References between records (an attachment refers to a provider) and the owner index at
//! scale: a reference is checked and written in one transaction with its target's existence,
//! a referred-to record cannot be deleted, and an owner takes thousands of owned records with
//! it in one delete.

use std::collections::BTreeMap;
use std::sync::Arc;

use uuid::Uuid;

use super::{assert_integrity, new_setting, sandbox, workspace};
use crate::{Kind, ListQuery, NewRecord, ObjectStore, Record, Scope, StoreError};

fn provider(ws: &Record, name: &str) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Provider,
        workspace: Some(ws.id),
        name: name.into(),
        owner: None,
        labels: BTreeMap::new(),
        created_at_ms: 4_000,
        body: b"provider".to_vec(),
    }
}

/// An attachment of `sandbox` to `provider`: owned by the sandbox, named by the provider id.
fn attachment(sandbox: &Record, provider: Uuid) -> NewRecord {
    NewRecord {
        id: Uuid::new_v4(),
        kind: Kind::Attachment,
        workspace: sandbox.workspace,
        name: provider.to_string(),
        owner: Some(sandbox.id),
        labels: BTreeMap::new(),
        created_at_ms: 5_000,
        body: Vec::new(),
    }
}

/// A record that others refer to is not deleted (`Referenced`, every referrer named), nor is
/// the workspace holding them; the reference index names the referrers, and deleting a
/// referrer (itself or through its owner) releases the record.
pub async fn a_referred_record_cannot_be_deleted_and_every_referrer_is_named(
    store: Arc<dyn ObjectStore>,
) {
    let ws = workspace(&*store, "team").await;
    let p = store.create(provider(&ws, "github")).await.unwrap();
    let a = sandbox(&*store, &ws, "a").await;
    let b = sandbox(&*store, &ws, "b").await;
    let att_a = store
        .create_referring(attachment(&a, p.id), vec![p.id])
        .await
        .unwrap();
    assert_eq!(att_a.refs, vec![p.id]);
    let att_b = store
        .create_referring(attachment(&b, p.id), vec![p.id])
        .await
        .unwrap();
    match store.delete(p.id, p.resource_version).await {
        Err(StoreError::Referenced { id, mut by }) => {
            assert_eq!(id, p.id);
            by.sort();
            let mut want = vec![att_a.id, att_b.id];
            want.sort();
            assert_eq!(by, want);
        }
        other => panic!("delete of a referred provider: {other:?}"),
    }
    assert!(store.get(p.id).await.unwrap().is_some(), "nothing deleted");
    let mut referrers = store.referrers(p.id).await.unwrap();
    referrers.sort();
    let mut want = vec![att_a.id, att_b.id];
    want.sort();
    assert_eq!(referrers, want);
    // The workspace cannot go either while it holds them.
    assert!(matches!(
        store.delete(ws.id, ws.resource_version).await,
        Err(StoreError::NotEmpty { .. })
    ));
    // A sandbox's delete takes its attachment with it, and releases the provider from it.
    store.delete(a.id, a.resource_version).await.unwrap();
    assert_eq!(store.referrers(p.id).await.unwrap(), vec![att_b.id]);
    store
        .delete(att_b.id, att_b.resource_version)
        .await
        .unwrap();
    assert_eq!(store.referrers(p.id).await.unwrap(), Vec::<Uuid>::new());
    store.delete(p.id, p.resource_version).await.unwrap();
}

/// A reference to a missing record or to a record of another workspace is
/// `ReferenceNotFound` naming it, the same reference twice is `Invalid`, and nothing is
/// written.
pub async fn a_reference_to_a_missing_or_foreign_record_is_refused(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let other = workspace(&*store, "other").await;
    let sb = sandbox(&*store, &ws, "a").await;
    let missing = Uuid::new_v4();
    assert!(matches!(
        store.create_referring(attachment(&sb, missing), vec![missing]).await,
        Err(StoreError::ReferenceNotFound { id }) if id == missing
    ));
    let foreign = store.create(provider(&other, "github")).await.unwrap();
    assert!(matches!(
        store.create_referring(attachment(&sb, foreign.id), vec![foreign.id]).await,
        Err(StoreError::ReferenceNotFound { id }) if id == foreign.id
    ));
    let twice = store.create(provider(&ws, "github")).await.unwrap();
    assert!(matches!(
        store
            .create_referring(attachment(&sb, twice.id), vec![twice.id, twice.id])
            .await,
        Err(StoreError::Invalid { .. })
    ));
    assert_eq!(store.owned(sb.id).await.unwrap(), Vec::<Uuid>::new());
}

/// The race the reference exists for: an attach and the provider's delete, concurrently, 200
/// times. Whichever the store commits first, exactly one of them wins, and no attachment ever
/// refers to a provider that is gone.
pub async fn attach_and_delete_racing_never_leave_a_dangling_reference(
    store: Arc<dyn ObjectStore>,
) {
    let ws = workspace(&*store, "team").await;
    let sb = sandbox(&*store, &ws, "a").await;
    let (mut attached, mut deleted) = (0, 0);
    for i in 0..200 {
        let p = store
            .create(provider(&ws, &format!("p-{i}")))
            .await
            .unwrap();
        let attach = {
            let store = Arc::clone(&store);
            let att = attachment(&sb, p.id);
            tokio::spawn(async move { store.create_referring(att, vec![p.id]).await })
        };
        let delete = {
            let store = Arc::clone(&store);
            tokio::spawn(async move { store.delete(p.id, p.resource_version).await })
        };
        let (attach, delete) = (attach.await.unwrap(), delete.await.unwrap());
        match (&attach, &delete) {
            (Ok(_), Err(StoreError::Referenced { .. })) => attached += 1,
            (Err(StoreError::ReferenceNotFound { .. }), Ok(_)) => deleted += 1,
            other => panic!("round {i}: attach and delete both decided: {other:?}"),
        }
        if let Ok(att) = attach {
            assert!(store.get(p.id).await.unwrap().is_some(), "round {i}");
            store.delete(att.id, att.resource_version).await.unwrap();
        }
    }
    assert_eq!(attached + deleted, 200);
    println!("attach first: {attached}, delete first: {deleted}");
}

/// An owned record's name is unique per owner, not per workspace: two sandboxes each have
/// their own setting of one name, found by name under its owner only, and a new sandbox of
/// an old name inherits nothing.
pub async fn owned_names_are_unique_per_owner_not_per_workspace(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let a = sandbox(&*store, &ws, "a").await;
    let b = sandbox(&*store, &ws, "b").await;
    let sa = store
        .create(new_setting(&a, "approval-mode"))
        .await
        .unwrap();
    let sb = store
        .create(new_setting(&b, "approval-mode"))
        .await
        .unwrap();
    assert!(matches!(
        store.create(new_setting(&a, "approval-mode")).await,
        Err(StoreError::AlreadyExists { existing, .. }) if existing == sa.id
    ));
    let by_name = |owner: Uuid| {
        let store = &store;
        async move {
            store
                .get_by_name(Kind::Setting, Some(owner), "approval-mode")
                .await
                .unwrap()
                .map(|r| r.id)
        }
    };
    assert_eq!(by_name(a.id).await, Some(sa.id));
    assert_eq!(by_name(b.id).await, Some(sb.id));
    // Not found under the workspace: an owned name lives under its owner only.
    assert_eq!(by_name(ws.id).await, None);
    // A new sandbox of the old name inherits nothing.
    store.delete(a.id, a.resource_version).await.unwrap();
    let again = sandbox(&*store, &ws, "a").await;
    assert_eq!(by_name(again.id).await, None);
    assert_eq!(store.owned(again.id).await.unwrap(), Vec::<Uuid>::new());
}

/// More than a thousand owned records (more than one chunk or batch of any owner index), some
/// removed one by one from the middle, then the rest cascaded in one delete: nothing is left
/// behind.
pub async fn thousands_of_owned_records_cascade_in_one_delete(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let sb = sandbox(&*store, &ws, "big").await;
    let other = sandbox(&*store, &ws, "small").await;
    let keep = store.create(new_setting(&other, "k")).await.unwrap();
    let mut settings = Vec::new();
    for i in 0..1_500 {
        settings.push(
            store
                .create(new_setting(&sb, &format!("k-{i}")))
                .await
                .unwrap(),
        );
    }
    for s in settings.iter().skip(100).step_by(97) {
        store.delete(s.id, s.resource_version).await.unwrap();
    }
    let removed = settings.iter().skip(100).step_by(97).count();
    let owned = store.owned(sb.id).await.unwrap();
    assert_eq!(owned.len(), 1_500 - removed);
    assert_integrity(&*store).await;
    let fresh = store.get(sb.id).await.unwrap().unwrap();
    let deleted = store.delete(sb.id, fresh.resource_version).await.unwrap();
    assert_eq!(deleted.len(), 1 + 1_500 - removed);
    // A scan of the whole store: only the other sandbox's setting is left.
    let left = store
        .list(ListQuery::new(Kind::Setting, Scope::Workspace(ws.id), 0))
        .await
        .unwrap();
    assert_eq!(
        left.records.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![keep.id]
    );
    assert_eq!(store.owned(sb.id).await.unwrap(), Vec::<Uuid>::new());
}
