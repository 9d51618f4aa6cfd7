//! The store's high-water mark and the integrity check at open: a healthy store after
//! writes and a reopen; a store older than its mark (what truncation, damage or an old copy
//! put back leave) is told apart, saying how many acknowledged commits are missing; accepting
//! it as it is clears that.

mod common;

use common::*;
use sbx_storage::{ObjectStore, SledStore, high_water_path, read_high_water};

#[tokio::test]
async fn a_store_older_than_its_high_water_mark_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let revision = {
        let store = SledStore::open(&path).unwrap();
        assert!(store.check_integrity().unwrap().healthy(), "a new store");
        let ws = workspace(&store, "team").await;
        for i in 0..10 {
            sandbox(&store, &ws, &format!("sb-{i}")).await;
        }
        let revision = store.current_revision().await.unwrap();
        // Written after each acknowledged commit, before the close.
        assert_eq!(read_high_water(&path).unwrap(), Some(revision));
        revision
    };
    // Closed: the mark says the last commit.
    assert_eq!(read_high_water(&path).unwrap(), Some(revision));
    let store = SledStore::open(&path).unwrap();
    let report = store.check_integrity().unwrap();
    assert!(report.healthy(), "{report:?}");
    assert_eq!(
        (report.revision, report.high_water),
        (revision, Some(revision))
    );
    drop(store);

    // Commits acknowledged that the store no longer holds.
    std::fs::write(high_water_path(&path), format!("{:020}\n", revision + 7)).unwrap();
    let store = SledStore::open(&path).unwrap();
    let report = store.check_integrity().unwrap();
    assert!(report.lost_commits() && !report.healthy(), "{report:?}");
    let said = report.describe();
    assert!(
        said.contains(&format!("up to revision {revision}"))
            && said.contains(&format!("revision {} was acknowledged", revision + 7))
            && said.contains("7 acknowledged commit(s) are missing"),
        "{said}"
    );
    // Opening and closing it without a commit does not lower the mark to what it holds.
    drop(store);
    let store = SledStore::open(&path).unwrap();
    assert!(store.check_integrity().unwrap().lost_commits());
    store.accept_as_is().unwrap();
    assert!(store.check_integrity().unwrap().healthy());
    assert_eq!(read_high_water(&path).unwrap(), Some(revision));

    // A mark that is not a number is corruption, said so.
    drop(store);
    std::fs::write(high_water_path(&path), "garbage").unwrap();
    let err = SledStore::open(&path).unwrap_err();
    assert!(err.to_string().contains("holds no revision"), "{err}");
}
