//! What an add to the store holds, and a garbage collection that takes nothing held.
//!
//! A pull, an import or a build's layer ([`Transfer`]) writes blobs and unpacked layers before
//! any image record names them, and relies on ones already there (a layer another image
//! unpacked). Each of those is *held* by the transfer — taken before the file is renamed into
//! `blobs/` or `layers/`, or before an existing one is looked at — until the transfer ends
//! (every clone of it dropped: the future of a pull dropped mid-way, a blocking unpack that
//! ran on after it, a failed or cancelled add). A collection ([`ImageStore::begin_collection`])
//! removes what no record keeps and no transfer *has held since it began*: a hold taken during
//! a collection is remembered until it ends, so content a transfer recorded and released
//! meanwhile (its record written after the collection read the records) is never taken. A
//! collection therefore never waits for a transfer, and a transfer never waits for a
//! collection: an image deleted while a 30-minute pull runs is freed at once, unless that pull
//! uses its content.
//!
//! An entry is removed by renaming it into `tmp/` under the holds' lock (an instant), then
//! deleting it outside it: a transfer that holds an entry and then finds it is sure it stays.
//!
//! A transfer that ends holding content its caller did not keep ([`Transfer::kept`]) — it
//! failed, it was cancelled, its caller went away — says so ([`ImageStore::transfer_ended`]),
//! so that whoever collects does it then: what it left is freed without waiting for the next
//! add or delete.
//!
//! A transfer is also how it is stopped: [`Transfer::cancel`] (its caller went away, its
//! caller's credential was revoked) ends it at its next chunk or tar entry, and nothing of it
//! is renamed into place after that.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio_util::sync::CancellationToken;

use super::{GcReport, ImageError, ImageStore};

/// What every transfer of a store holds, and whether a collection is under way.
#[derive(Debug, Default)]
pub(crate) struct Holds {
    table: Mutex<HoldTable>,
    /// Told (one stored permit) when a transfer ends holding content nobody kept.
    ended: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct HoldTable {
    /// Hex digest (of a blob, or the diff id of a layer) → how many transfers hold it.
    counts: HashMap<String, usize>,
    /// A collection is under way: every hold taken is also remembered in `touched`.
    collecting: bool,
    /// Everything held at any moment since the collection under way began.
    touched: HashSet<String>,
}

impl Holds {
    fn lock(&self) -> std::sync::MutexGuard<'_, HoldTable> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn hold(&self, hex: &str) {
        let mut t = self.lock();
        *t.counts.entry(hex.to_string()).or_default() += 1;
        if t.collecting {
            t.touched.insert(hex.to_string());
        }
    }

    fn release(&self, hex: &str) {
        let mut t = self.lock();
        if let Some(n) = t.counts.get_mut(hex) {
            *n -= 1;
            if *n == 0 {
                t.counts.remove(hex);
            }
        }
    }

    /// Runs `remove` on an entry unless some transfer held it since the collection began
    /// (answers false then), under the lock: `remove` must be quick (a rename).
    pub(crate) fn take_unless_held(
        &self,
        hex: &str,
        remove: impl FnOnce() -> std::io::Result<()>,
    ) -> std::io::Result<bool> {
        let t = self.lock();
        if t.touched.contains(hex) || t.counts.contains_key(hex) {
            return Ok(false);
        }
        remove().map(|()| true)
    }
}

/// One add to the store under way (see the module docs). Cheap to clone; every clone is the
/// same transfer, which ends when the last is dropped.
#[derive(Debug, Clone)]
pub struct Transfer {
    inner: Arc<TransferInner>,
}

#[derive(Debug)]
struct TransferInner {
    holds: Arc<Holds>,
    /// Hex digests this transfer holds (each once).
    held: Mutex<HashSet<String>>,
    cancel: CancellationToken,
    /// Its caller recorded what it added: its end owes no collection.
    kept: AtomicBool,
}

impl Transfer {
    pub(crate) fn new(holds: Arc<Holds>, cancel: CancellationToken) -> Transfer {
        Transfer {
            inner: Arc::new(TransferInner {
                holds,
                held: Mutex::new(HashSet::new()),
                cancel,
                kept: AtomicBool::new(false),
            }),
        }
    }

    /// Holds `digest` (`sha256:<hex>` or the hex alone) until the transfer ends.
    pub(crate) fn hold(&self, digest: &str) {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        let mut held = self.inner.held.lock().unwrap_or_else(|p| p.into_inner());
        if held.insert(hex.to_string()) {
            self.inner.holds.hold(hex);
        }
    }

    /// Ends the transfer at its next step; nothing more of it is put in place.
    pub fn cancel(&self) {
        self.inner.cancel.cancel();
    }

    pub fn is_cancelled(&self) -> bool {
        self.inner.cancel.is_cancelled()
    }

    /// The token that cancels it (for a wait to race against).
    pub fn cancel_token(&self) -> &CancellationToken {
        &self.inner.cancel
    }

    /// [`ImageError::Cancelled`] once cancelled.
    pub(crate) fn check(&self, image: &str) -> Result<(), ImageError> {
        match self.is_cancelled() {
            true => Err(ImageError::Cancelled {
                image: image.to_string(),
            }),
            false => Ok(()),
        }
    }

    /// Its caller recorded what it added (an image record holds it now).
    pub fn kept(&self) {
        self.inner.kept.store(true, Ordering::SeqCst);
    }
}

impl Drop for TransferInner {
    fn drop(&mut self) {
        let held = std::mem::take(self.held.get_mut().unwrap_or_else(|p| p.into_inner()));
        for hex in &held {
            self.holds.release(hex);
        }
        if !held.is_empty() && !self.kept.load(Ordering::SeqCst) {
            self.holds.ended.notify_one();
        }
    }
}

/// A garbage collection under way (see the module docs): from [`ImageStore::begin_collection`],
/// which is to be called *before* the records whose manifests are kept are read.
#[derive(Debug)]
pub struct Collection {
    store: ImageStore,
}

impl Collection {
    /// Removes every blob and layer that none of `keep` (manifest digests: the images still
    /// recorded, the digests sandboxes pin) reaches and no transfer held since the collection
    /// began. Blocking.
    pub fn remove_unreferenced(self, keep: &[String]) -> Result<GcReport, ImageError> {
        self.store.collect(keep)
    }
}

impl Drop for Collection {
    fn drop(&mut self) {
        let mut t = self.store.holds().lock();
        t.collecting = false;
        t.touched.clear();
    }
}

impl ImageStore {
    /// A new transfer, cancelled by `cancel`.
    pub fn transfer(&self, cancel: CancellationToken) -> Transfer {
        Transfer::new(self.holds().clone(), cancel)
    }

    /// Begins a collection: from now on every hold is remembered until it ends. `None` while
    /// another one is under way (its caller collects: nothing is lost by not waiting).
    pub fn begin_collection(&self) -> Option<Collection> {
        let mut t = self.holds().lock();
        if t.collecting {
            return None;
        }
        t.collecting = true;
        t.touched = t.counts.keys().cloned().collect();
        drop(t);
        Some(Collection {
            store: self.clone(),
        })
    }

    /// Waits until a transfer ends holding content its caller did not keep (a failed or
    /// cancelled add): then a collection frees it. A transfer that ended before this call
    /// is answered at once (one is remembered).
    pub async fn transfer_ended(&self) {
        self.holds().ended.notified().await;
    }
}
