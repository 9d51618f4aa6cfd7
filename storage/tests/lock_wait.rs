//! An open waits a moment for the store's lock: a handle closed a moment ago (or closing while
//! the open starts) does not make it fail; a store held open for longer than the wait does.

use std::time::{Duration, Instant};

use sbx_storage::SledStore;

#[test]
fn an_open_waits_for_a_handle_being_closed_but_not_for_one_kept() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let first = SledStore::open(&path).unwrap();
    let closer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(first);
    });
    let began = Instant::now();
    let second = SledStore::open(&path);
    closer.join().unwrap();
    assert!(
        second.is_ok(),
        "the open did not wait for the closing handle: {:?}",
        second.err()
    );
    assert!(
        began.elapsed() >= Duration::from_millis(250),
        "{:?}",
        began.elapsed()
    );

    // Held for good: refused after the wait, saying why.
    let began = Instant::now();
    let third = SledStore::open(&path);
    let took = began.elapsed();
    let err = third.expect_err("a store held open was opened a second time");
    assert!(err.to_string().contains("lock"), "{err}");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(10),
        "refused after {took:?}"
    );
    drop(second);
}
