//! The store conformance suite: one set of checks, run against every [`ObjectStore`] (the
//! embedded sled store and the PostgreSQL store).
//!
//! It checks the promises of the store trait that the actor layer relies on: must-create and
//! the `(kind, scope, name)` unique index, compare-and-swap on the resource version, immutable
//! fields, cascading deletes through the owner index in one transaction, a workspace that
//! still holds records is not deleted, references that must exist and keep what they refer
//! to alive, validation that keeps bad records out, one global revision that every write
//! bumps, one winner among concurrent creates of a name, and lists in the total order
//! `(created_at_ms, id)` with keyset cursors that neither skip nor repeat and selectors that
//! still fill pages; and, where a store keeps one, a change log of every sandbox write in
//! revision order. After each check the store's own integrity check
//! ([`ObjectStore::integrity_problems`]) must find nothing.
//!
//! # Using it for a store
//!
//! Invoke [`store_conformance_suite!`](crate::store_conformance_suite) in the store's
//! integration test: it makes one test per check, each on a fresh store, so each check passes
//! or fails on its own and can be run alone by name. Where a fresh store is dear (a database
//! server to start), start it once and call [`run_each`] with a maker of fresh stores (a new
//! database per check). The list of checks is written once, in that macro; [`run_each`] runs
//! the same list, so a new check runs against every store.
//!
//! ```ignore
//! sbx_storage::store_conformance_suite! {
//!     #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
//!     // Evaluated once per test: `(guard, Arc<dyn ObjectStore>)`; the guard lives as long
//!     // as the check (a temp dir).
//!     store: fresh_sled_store(),
//! }
//! ```

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use uuid::Uuid;

use crate::{Kind, NewRecord, ObjectStore, Record};

mod changes;
mod lists;
pub mod postgres_server;
mod references;
mod semantics;

pub use changes::*;
pub use lists::*;
pub use references::*;
pub use semantics::*;

/// Runs every check of the suite's list, each on a fresh store from `make` (which is given the
/// check's name, for a database name or a log line); panics at the first failure, naming it.
pub async fn run_each<F, Fut, G>(mut make: F)
where
    F: FnMut(&'static str) -> Fut,
    Fut: Future<Output = (G, Arc<dyn ObjectStore>)>,
{
    crate::store_conformance_suite!(@with_checks run_each make);
}

/// The store conformance suite as tests: one test per check, each on a fresh store.
///
/// This macro holds THE list of checks; [`run_each`] runs the same list. A new check is added
/// here, once, and every store's test file runs it. Each test is named after its check, so
/// `cargo nextest run --test conformance_sled cascades` runs the checks whose names match.
#[macro_export]
macro_rules! store_conformance_suite {
    // THE list of checks, in the order `run_each` runs them. Add a new check here, once.
    (@with_checks $($then:tt)*) => {
        $crate::store_conformance_suite! {
            @$($then)* [
                must_create_conflict_names_the_existing_id,
                compare_and_swap_refuses_stale_versions,
                same_name_in_two_workspaces_but_not_twice_in_one,
                a_name_is_reusable_after_delete,
                deleting_an_owner_cascades_in_one_transaction,
                a_workspace_with_records_is_not_deleted,
                workspaces_and_owners_must_exist,
                invalid_records_are_never_written,
                revisions_increase_with_every_write,
                concurrent_creates_of_one_name_have_one_winner,
                image_records_follow_the_image_reference_rule,
                a_referred_record_cannot_be_deleted_and_every_referrer_is_named,
                a_reference_to_a_missing_or_foreign_record_is_refused,
                attach_and_delete_racing_never_leave_a_dangling_reference,
                owned_names_are_unique_per_owner_not_per_workspace,
                thousands_of_owned_records_cascade_in_one_delete,
                pages_follow_the_total_order_with_inserts_between_pages,
                selectors_filter_and_still_fill_pages,
                bad_cursors_and_scopes_are_invalid,
                the_change_log_holds_every_sandbox_write_in_order,
            ]
        }
    };
    (@run_each $make:ident [$($check:ident),* $(,)?]) => {$(
        eprintln!("store conformance: {}", stringify!($check));
        {
            let (_guard, store) = $make(stringify!($check)).await;
            $crate::conformance::$check(store.clone()).await;
            $crate::conformance::assert_integrity(&*store).await;
        }
    )*};
    // One test per check; `$attrs` is a `{ ... }` group, passed whole.
    (@tests $attrs:tt $make:expr, [$($check:ident),* $(,)?]) => {$(
        $crate::store_conformance_suite! { @test $attrs $make, $check }
    )*};
    // The test of one check, on a fresh store.
    (@test { $(#[$attr:meta])* } $make:expr, $check:ident) => {
        $(#[$attr])*
        async fn $check() {
            let (_guard, store) = $make;
            $crate::conformance::$check(store.clone()).await;
            $crate::conformance::assert_integrity(&*store).await;
        }
    };
    ($(#[$attr:meta])* store: $make:expr $(,)?) => {
        $crate::store_conformance_suite! { @with_checks tests { $(#[$attr])* } $make, }
    };
}

/// Asserts the store's own integrity check finds nothing.
pub async fn assert_integrity(store: &dyn ObjectStore) {
    let problems = store
        .integrity_problems()
        .await
        .expect("the integrity check runs");
    assert!(
        problems.is_empty(),
        "{}: the integrity check found problems: {problems:#?}",
        store.describe()
    );
}

/// Labels from pairs.
pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A new workspace record called `name`.
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

/// A new sandbox record called `name` in workspace `ws`.
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

/// A new setting record called `name`, owned by `owner`.
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

/// Creates a workspace called `name`.
pub async fn workspace(store: &dyn ObjectStore, name: &str) -> Record {
    store
        .create(new_workspace(name))
        .await
        .expect("create workspace")
}

/// Creates a sandbox called `name` in `ws`.
pub async fn sandbox(store: &dyn ObjectStore, ws: &Record, name: &str) -> Record {
    store
        .create(new_sandbox(ws.id, name))
        .await
        .expect("create sandbox")
}
