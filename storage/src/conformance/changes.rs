//! The change log, where a store keeps one (`ObjectStore::change_log_start` is `Some`): what a
//! watch on any gateway reads to see every gateway's writes.

use std::sync::Arc;

use super::{new_setting, sandbox, workspace};
use crate::{Change, ChangeOp, Kind, ObjectStore, StoreError};

/// Every write of a logged kind is in the log, in revision order, with the record as that
/// write left it (a delete: as it was, at the delete's revision); writes of other kinds are
/// not; a read pages by `limit`; a read from before the log's start is `ChangesTooOld`. A
/// store without a log says so (`NoChangeLog`) and never pretends to an empty one.
pub async fn the_change_log_holds_every_sandbox_write_in_order(store: Arc<dyn ObjectStore>) {
    let Some(start) = store.change_log_start().await.expect("change_log_start") else {
        let err = store.changes_after(0, 10).await.unwrap_err();
        assert!(matches!(err, StoreError::NoChangeLog { .. }), "{err:?}");
        return;
    };
    let begun = store.current_revision().await.unwrap();
    assert!(
        start <= begun,
        "the log starts at {start}, after the revision {begun}"
    );
    let ws = workspace(&*store, "team").await;
    let a = sandbox(&*store, &ws, "a").await;
    let b = sandbox(&*store, &ws, "b").await;
    let mut a2 = a.clone();
    a2.body = b"changed".to_vec();
    let a2 = store.update(a2).await.unwrap();
    // A setting owned by b: not logged, and it goes with b.
    store.create(new_setting(&b, "cfg")).await.unwrap();
    let deleted = store.delete(b.id, b.resource_version).await.unwrap();
    assert_eq!(deleted.len(), 2);
    let delete_rev = store.current_revision().await.unwrap();

    let all = store.changes_after(begun, 100).await.unwrap();
    let seen: Vec<(u64, ChangeOp, Kind, String)> = all
        .iter()
        .map(|c| (c.revision, c.op, c.record.kind, c.record.name.clone()))
        .collect();
    assert_eq!(
        seen,
        vec![
            (
                a.resource_version,
                ChangeOp::Created,
                Kind::Sandbox,
                "a".into()
            ),
            (
                b.resource_version,
                ChangeOp::Created,
                Kind::Sandbox,
                "b".into()
            ),
            (
                a2.resource_version,
                ChangeOp::Updated,
                Kind::Sandbox,
                "a".into()
            ),
            (delete_rev, ChangeOp::Deleted, Kind::Sandbox, "b".into()),
        ]
    );
    // Each record as its write left it.
    assert_eq!(all[0].record, a);
    assert_eq!(all[2].record, a2);
    let mut gone = b.clone();
    gone.resource_version = delete_rev;
    assert_eq!(all[3].record, gone);
    for c in &all {
        assert_eq!(c.record.resource_version, c.revision);
    }

    // Pages: after each change's revision, the rest.
    let mut paged: Vec<Change> = Vec::new();
    let mut after = begun;
    for _ in 0..10 {
        let page = store.changes_after(after, 1).await.unwrap();
        let Some(last) = page.last() else { break };
        assert_eq!(page.len(), 1);
        after = last.revision;
        paged.extend(page);
    }
    assert_eq!(paged, all);
    assert!(
        store
            .changes_after(delete_rev, 10)
            .await
            .unwrap()
            .is_empty()
    );

    if start > 0 {
        let err = store.changes_after(start - 1, 10).await.unwrap_err();
        assert!(
            matches!(err, StoreError::ChangesTooOld { requested, oldest } if requested == start - 1 && oldest == start),
            "{err:?}"
        );
    }
}
