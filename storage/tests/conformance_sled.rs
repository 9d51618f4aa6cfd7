//! The store conformance suite (`sbx_storage::conformance`) on the sled store: one test per
//! check, each on a fresh store in a temp dir, then the store's integrity check.

use std::sync::Arc;

use sbx_storage::{ObjectStore, SledStore};

sbx_storage::store_conformance_suite! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    store: {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SledStore::open(&dir.path().join("db")).expect("open store");
        (dir, Arc::new(store) as Arc<dyn ObjectStore>)
    },
}
