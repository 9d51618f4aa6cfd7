//! Reading a whole list from the store, page by page.
//!
//! The store answers lists a page at a time with keyset cursors (inserts between pages neither
//! skip nor repeat a record). A scan asks for 1000 records per page — the largest page a
//! client's list may ask for (`MAX_PAGE_SIZE`), so one page of a scan costs the store no more
//! than one client's list — and follows the cursor to the end.

use sbx_storage::{Kind, LabelSelector, ListQuery, ObjectStore, Record, Scope};

use crate::error::Result;

/// Records per page of a scan.
const PAGE: usize = 1000;

/// Every record of `kind` in `scope` that `selector` matches, in the store's list order
/// (creation time, then id).
pub(crate) async fn all_records(
    store: &dyn ObjectStore,
    kind: Kind,
    scope: Scope,
    selector: &LabelSelector,
) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    let mut cursor = None;
    loop {
        let page = store
            .list(ListQuery {
                kind,
                scope,
                selector: selector.clone(),
                limit: PAGE,
                cursor,
            })
            .await?;
        records.extend(page.records);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return Ok(records),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use futures::StreamExt;
    use sbx_proto::v1::Workspace;
    use sbx_storage::SledStore;
    use uuid::Uuid;

    use super::*;
    use crate::records::new_workspace_record;

    /// More than two pages, with a selector that also matches more than one page: a scan that
    /// stopped after the first page, or repeated or skipped one across a cursor, is caught.
    #[tokio::test]
    async fn a_scan_reads_every_page_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(&dir.path().join("store")).unwrap();
        let total = 2 * PAGE + 345;
        let created: Vec<(Uuid, bool)> = futures::stream::iter(0..total)
            .map(|i| {
                let store = &store;
                async move {
                    let id = Uuid::new_v4();
                    let labelled = i % 2 == 0;
                    let workspace = Workspace {
                        name: format!("ws-{i}"),
                        labels: if labelled {
                            [("tier".to_string(), "a".to_string())].into()
                        } else {
                            Default::default()
                        },
                        ..Default::default()
                    };
                    store
                        .create(new_workspace_record(id, &workspace))
                        .await
                        .unwrap();
                    (id, labelled)
                }
            })
            .buffer_unordered(64)
            .collect()
            .await;

        let all = all_records(
            &store,
            Kind::Workspace,
            Scope::All,
            &LabelSelector::everything(),
        )
        .await
        .unwrap();
        assert_eq!(all.len(), total, "every record, each once");
        let seen: HashSet<Uuid> = all.iter().map(|r| r.id).collect();
        let want: HashSet<Uuid> = created.iter().map(|(id, _)| *id).collect();
        assert_eq!(seen, want);

        let selector = crate::validate::selector("tier=a").unwrap();
        let some = all_records(&store, Kind::Workspace, Scope::All, &selector)
            .await
            .unwrap();
        let want: HashSet<Uuid> = created
            .iter()
            .filter(|(_, labelled)| *labelled)
            .map(|(id, _)| *id)
            .collect();
        assert!(want.len() > PAGE, "the selected records span pages");
        assert_eq!(some.len(), want.len());
        assert_eq!(some.iter().map(|r| r.id).collect::<HashSet<_>>(), want);
    }
}
