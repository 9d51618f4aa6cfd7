//! Lists: total order, keyset cursors that neither skip nor repeat, selectors that still fill
//! pages, per-workspace and global scopes.

use std::collections::BTreeSet;
use std::sync::Arc;

use uuid::Uuid;

use super::{labels, new_sandbox, sandbox, workspace};
use crate::{Kind, LabelSelector, ListQuery, ObjectStore, Scope, StoreError};

const SAME_MS: u64 = 5_000;

/// Lists follow the total order `(created_at_ms, id)`, also for hundreds of records created
/// concurrently in one millisecond; pages neither skip nor repeat when records are inserted
/// between them (those after the cursor appear, those before it do not); a page with a cursor
/// is full; a workspace list holds that workspace only, the global list every workspace's.
pub async fn pages_follow_the_total_order_with_inserts_between_pages(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let other = workspace(&*store, "other").await;
    // 500 sandboxes created in one millisecond: only the UUID orders them.
    let creates: Vec<_> = (0..500)
        .map(|i| {
            let store = Arc::clone(&store);
            let mut rec = new_sandbox(ws.id, &format!("sb-{i}"));
            rec.created_at_ms = SAME_MS;
            tokio::spawn(async move { store.create(rec).await })
        })
        .collect();
    let mut initial = BTreeSet::new();
    for c in creates {
        let rec = c.await.unwrap().unwrap();
        initial.insert((rec.created_at_ms, rec.id));
    }
    for i in 0..40 {
        let mut rec = new_sandbox(other.id, &format!("elsewhere-{i}"));
        rec.created_at_ms = SAME_MS;
        store.create(rec).await.unwrap();
    }

    let mut seen: Vec<(u64, Uuid)> = Vec::new();
    let mut must_appear = initial.clone();
    let mut must_not_appear = BTreeSet::new();
    let mut cursor = None;
    let mut pages = 0;
    let mut inserted = 0;
    loop {
        pages += 1;
        assert!(pages <= 100, "pagination does not terminate");
        let page = store
            .list(ListQuery {
                cursor: cursor.clone(),
                ..ListQuery::new(Kind::Sandbox, Scope::Workspace(ws.id), 37)
            })
            .await
            .unwrap();
        assert!(page.records.len() <= 37);
        for rec in &page.records {
            assert_eq!(rec.workspace, Some(ws.id), "scope leaked {rec:?}");
            seen.push((rec.created_at_ms, rec.id));
        }
        let Some(next) = page.next_cursor else { break };
        assert_eq!(page.records.len(), 37, "a page with a cursor is full");
        cursor = Some(next);
        // Between pages, insert records in the same millisecond (sorting before or after the
        // cursor by UUID), one earlier and one later.
        let last = *seen.last().unwrap();
        for created in [SAME_MS, SAME_MS, SAME_MS - 1, SAME_MS + 1] {
            inserted += 1;
            let mut rec = new_sandbox(ws.id, &format!("late-{inserted}"));
            rec.created_at_ms = created;
            let rec = store.create(rec).await.unwrap();
            let key = (rec.created_at_ms, rec.id);
            if key > last {
                must_appear.insert(key);
            } else {
                must_not_appear.insert(key);
            }
        }
    }
    assert!(
        pages >= 14,
        "500 records at 37 a page take at least 14 pages"
    );
    let mut sorted = seen.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(
        sorted, seen,
        "pages repeat a record or leave the total order"
    );
    let seen_set: BTreeSet<_> = seen.iter().copied().collect();
    let skipped: Vec<_> = must_appear.difference(&seen_set).collect();
    assert!(
        skipped.is_empty(),
        "skipped {} records: {skipped:?}",
        skipped.len()
    );
    assert!(
        seen_set.is_disjoint(&must_not_appear),
        "a record behind the cursor appeared"
    );
    assert!(!must_not_appear.is_empty() && must_appear.len() > initial.len());

    // The global list holds both workspaces, in the same total order.
    let all = store
        .list(ListQuery::new(Kind::Sandbox, Scope::All, 0))
        .await
        .unwrap();
    assert_eq!(all.records.len(), 500 + 40 + inserted);
    assert!(all.next_cursor.is_none());
    let keys: Vec<_> = all
        .records
        .iter()
        .map(|r| (r.created_at_ms, r.id))
        .collect();
    assert!(
        keys.windows(2).all(|w| w[0] < w[1]),
        "global list out of order"
    );
    // Workspaces are a different kind: they do not show up in sandbox lists.
    assert!(all.records.iter().all(|r| r.kind == Kind::Sandbox));
}

/// A label selector filters a list (equality, inequality, existence, absence, conjunctions,
/// the empty selector) and pages still fill: a page with a cursor holds the full limit of
/// matching records.
pub async fn selectors_filter_and_still_fill_pages(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let mut gold = BTreeSet::new();
    for i in 0..60u64 {
        let mut rec = new_sandbox(ws.id, &format!("sb-{i}"));
        rec.created_at_ms = 10_000 + i % 7;
        rec.labels = if i % 3 == 0 {
            labels(&[("tier", "gold"), ("app", "web")])
        } else if i % 3 == 1 {
            labels(&[("tier", "silver")])
        } else {
            labels(&[("app", "web")])
        };
        let rec = store.create(rec).await.unwrap();
        if i % 3 == 0 {
            gold.insert(rec.id);
        }
    }
    let check = |selector: &str, expected: usize| {
        let store = Arc::clone(&store);
        let selector = LabelSelector::parse(selector).unwrap();
        async move {
            let mut cursor = None;
            let mut got = Vec::new();
            for _ in 0..100 {
                let page = store
                    .list(ListQuery {
                        kind: Kind::Sandbox,
                        scope: Scope::Workspace(ws.id),
                        selector: selector.clone(),
                        limit: 7,
                        cursor,
                    })
                    .await
                    .unwrap();
                assert!(page.records.iter().all(|r| selector.matches(&r.labels)));
                if page.next_cursor.is_some() {
                    assert_eq!(
                        page.records.len(),
                        7,
                        "{selector}: short page before the end"
                    );
                }
                got.extend(page.records);
                cursor = page.next_cursor;
                if cursor.is_none() {
                    break;
                }
            }
            assert_eq!(got.len(), expected, "{selector}");
            got
        }
    };
    let golds = check("tier=gold", 20).await;
    assert_eq!(golds.iter().map(|r| r.id).collect::<BTreeSet<_>>(), gold);
    check("tier!=gold", 40).await;
    check("app", 40).await;
    check("!app", 20).await;
    check("app=web,!tier", 20).await;
    check("tier=bronze", 0).await;
    check("", 60).await;
}

/// A malformed cursor, a cursor of another kind's list and a nil workspace scope are
/// `Invalid`; an unknown workspace's list is simply empty.
pub async fn bad_cursors_and_scopes_are_invalid(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    for i in 0..3 {
        sandbox(&*store, &ws, &format!("sb-{i}")).await;
    }
    let page = store
        .list(ListQuery::new(Kind::Sandbox, Scope::All, 1))
        .await
        .unwrap();
    let cursor = page.next_cursor.expect("more pages");
    // The cursor with its first character replaced by one no cursor encoding uses: a cursor
    // of another format.
    let first = cursor.chars().next().expect("a cursor is not empty");
    let other_format = format!("~{}", &cursor[first.len_utf8()..]);
    for bad in ["garbage".to_string(), format!("{cursor}0"), other_format] {
        let err = store
            .list(ListQuery {
                cursor: Some(bad.clone()),
                ..ListQuery::new(Kind::Sandbox, Scope::All, 1)
            })
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{bad}: {err:?}");
    }
    // A sandbox-list cursor does not continue a workspace list.
    let err = store
        .list(ListQuery {
            cursor: Some(cursor),
            ..ListQuery::new(Kind::Workspace, Scope::All, 1)
        })
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid { .. }));
    let err = store
        .list(ListQuery::new(
            Kind::Sandbox,
            Scope::Workspace(Uuid::nil()),
            1,
        ))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid { .. }));
    // An unknown workspace is simply empty.
    let empty = store
        .list(ListQuery::new(
            Kind::Sandbox,
            Scope::Workspace(Uuid::new_v4()),
            1,
        ))
        .await
        .unwrap();
    assert!(empty.records.is_empty() && empty.next_cursor.is_none());
}
