//! Helpers shared by the sled store's integration tests (the records they make are the
//! conformance suite's).
#![allow(dead_code, unused_imports)] // each test binary uses a different subset

use sbx_storage::SledStore;
pub use sbx_storage::conformance::{
    labels, new_sandbox, new_setting, new_workspace, sandbox, workspace,
};

pub fn open_temp() -> (tempfile::TempDir, SledStore) {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SledStore::open(&dir.path().join("db")).expect("open store");
    (dir, store)
}

/// Asserts the store's indexes agree with its records.
pub fn assert_fsck_clean(store: &SledStore) {
    let problems = store.verify_indexes().expect("fsck runs");
    assert!(problems.is_empty(), "fsck found problems: {problems:#?}");
}
