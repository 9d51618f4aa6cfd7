//! Sled-specific write semantics: concurrent writers share flushes (group commit). The
//! store semantics every store promises are checked by the store conformance suite
//! (`sbx_storage::conformance`), run on sled by `conformance_sled.rs`.

mod common;

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_share_flushes() {
    let (_dir, store) = open_temp();
    let ws = workspace(&store, "team").await;
    let before = store.flush_stats();
    let writers: Vec<_> = (0..64)
        .map(|i| {
            let store = store.clone();
            let ws = ws.clone();
            tokio::spawn(async move { sandbox(&store, &ws, &format!("sb-{i}")).await })
        })
        .collect();
    let mut versions = Vec::new();
    for w in writers {
        versions.push(w.await.unwrap().resource_version);
    }
    versions.sort();
    versions.dedup();
    assert_eq!(versions.len(), 64, "every write got its own revision");
    let after = store.flush_stats();
    let (writes, flushes) = (after.writes - before.writes, after.flushes - before.flushes);
    assert_eq!(writes, 64);
    assert!(
        flushes <= 32,
        "64 concurrent writes took {flushes} flushes; group commit is not grouping"
    );
}
