//! Group commit: one committer thread turns the writes of many concurrent writers into one
//! sled transaction and one flush.
//!
//! A writer queues its operation and awaits (on a oneshot channel, without blocking a tokio
//! worker) the reply. The committer thread takes every operation queued so far (up to
//! [`MAX_BATCH`]), runs them in order inside one sled transaction, then calls `Db::flush` and
//! fdatasyncs the log file, and only then answers each writer. So a write is acknowledged only
//! after a flush that began after its commit completed, and writers that arrive while a flush
//! runs share the next one.
//!
//! Why the transaction is grouped too, not just the flush: in sled 0.34 every multi-tree
//! transaction rolls the log's IO buffer twice (`pin_log`), each roll a `pwrite` plus
//! `sync_file_range`, under sled's global concurrency lock, and `Db::flush` holds that lock
//! (shared) for the whole fsync. Writers committing their own transactions therefore serialize
//! on the disk: measured here, 64 such writers reached about 2,400 writes/s against 1,400 for
//! one, with only ~25 writes per flush. One transaction per batch pays those syncs once.
//!
//! A full disk (see `space.rs`): a batch is refused up front with `DiskFull` while the store's
//! file system has less than [`crate::DISK_RESERVE_BYTES`] free, so sled never meets the
//! ENOSPC, and the first batch after space is freed goes through. A batch that meets ENOSPC all
//! the same (another process took the reserve between the check and the write, or one batch
//! outgrew it) is answered `DiskFull` and not acknowledged; sled 0.34 then keeps that error and
//! fails every later write with it, and neither clears it nor can be closed (dropping it waits
//! for the failed write for ever, seen in this module's test), so from then on the store answers
//! `DiskFull` saying sbxd must be restarted, and reads go on. A write that was not flushed is
//! gone after the restart; its writer was told it failed.
//!
//! An operation refused by the store (`AlreadyExists`, `Conflict`, ...) is refused before it
//! writes anything, gets its own error immediately, and does not disturb the rest of its batch;
//! operations later in a batch see the writes of earlier ones, exactly as if they ran one by
//! one in queue order.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::error::StoreError;
use crate::trees::Trees;
use crate::writes::{WriteOp, WriteOutcome, apply_batch};

/// The most operations in one transaction (bounds its memory and the latency of the first
/// writer in it).
pub const MAX_BATCH: usize = 512;

/// Counts kept by the committer, for benchmarks and tests that check writers share flushes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlushStats {
    /// Writes acknowledged as durable.
    pub writes: u64,
    /// Durable flushes completed (`Db::flush` + fdatasync; one per batch that wrote
    /// something).
    pub flushes: u64,
    /// Time spent flushing, in microseconds.
    pub flush_micros: u64,
    /// Bytes `Db::flush` reported writing.
    pub flush_bytes: u64,
}

#[derive(Default)]
struct Counters {
    writes: AtomicU64,
    flushes: AtomicU64,
    flush_micros: AtomicU64,
    flush_bytes: AtomicU64,
}

struct Request {
    op: WriteOp,
    reply: oneshot::Sender<Result<WriteOutcome, StoreError>>,
}

pub(crate) struct Committer {
    /// `None` only while dropping: closing the channel tells the thread to finish and exit.
    requests: Option<mpsc::Sender<Request>>,
    thread: Option<JoinHandle<()>>,
    counters: Arc<Counters>,
    /// Set once a write met ENOSPC inside sled (which then takes no write until reopened).
    sled_failed: Arc<Mutex<Option<StoreError>>>,
}

impl Committer {
    /// Starts the committer thread. It owns a `Db` handle so that it can flush, and a handle
    /// on sled's log file (`<path>/db`) so that it can fsync it.
    pub(crate) fn start(db: sled::Db, trees: Trees, path: &Path) -> Result<Committer, StoreError> {
        let mark = HighWater::open(path)?;
        let log_path = path.join(SLED_LOG_FILE);
        let log = File::open(&log_path).map_err(|e| {
            StoreError::Io(format!(
                "cannot open sled's log file {}: {e}",
                log_path.display()
            ))
        })?;
        let (requests, queue) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let thread_counters = Arc::clone(&counters);
        let sled_failed = Arc::new(Mutex::new(None));
        let committer = Thread {
            db,
            trees,
            path: path.to_path_buf(),
            log,
            mark,
            sled_failed: Arc::clone(&sled_failed),
            full_since: None,
        };
        let thread = std::thread::Builder::new()
            .name("sbx-store-committer".into())
            .spawn(move || committer.run(queue, &thread_counters))
            .map_err(|e| StoreError::Io(format!("cannot start the committer thread: {e}")))?;
        Ok(Committer {
            requests: Some(requests),
            thread: Some(thread),
            counters,
            sled_failed,
        })
    }

    /// Queues `op` and waits until it is committed and flushed (or refused).
    pub(crate) async fn submit(&self, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.requests
            .as_ref()
            .ok_or_else(|| StoreError::Io("store is closing".into()))?
            .send(Request { op, reply })
            .map_err(|_| StoreError::Io("the committer thread has stopped".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Io("the committer thread dropped the write".into()))?
    }

    /// The `DiskFull` every write gets since one met ENOSPC inside sled, if one did.
    pub(crate) fn sled_failed(&self) -> Option<StoreError> {
        self.sled_failed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
    }

    pub(crate) fn stats(&self) -> FlushStats {
        let c = &self.counters;
        FlushStats {
            writes: c.writes.load(Ordering::Relaxed),
            flushes: c.flushes.load(Ordering::Relaxed),
            flush_micros: c.flush_micros.load(Ordering::Relaxed),
            flush_bytes: c.flush_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Committer {
    fn drop(&mut self) {
        self.requests.take();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("the store committer thread panicked");
        }
    }
}

/// sled 0.34 keeps its whole log in this one file inside the store directory.
pub(crate) const SLED_LOG_FILE: &str = "db";

/// `Db::flush` writes the log with `pwrite` + `sync_file_range`, which survives a killed
/// process but neither flushes the device's write cache nor the file's metadata; an fdatasync
/// of the log file afterwards makes the write survive a power loss too.
fn flush_durably(db: &sled::Db, log: &File) -> Result<usize, StoreError> {
    let bytes = db.flush()?;
    log.sync_data()
        .map_err(|e| StoreError::from_io("fdatasync of the log", &e))?;
    Ok(bytes)
}

/// The store's high-water mark: the revision of the last acknowledged commit, in a file
/// beside the store (`<store>.high-water`), so that a store that lost acknowledged writes
/// (truncated, damaged, an old copy put back) is told apart from a healthy one at open
/// ([`crate::SledStore::check_integrity`]).
///
/// It is written (`pwrite`, no fsync) after every durable flush, so it never says more than
/// the store holds durably: after a crash the mark may be older than the store, never newer.
/// The final flush at close syncs it. A store whose revision is below its mark lost data.
pub(crate) struct HighWater {
    file: File,
    /// What the file says: the mark only ever rises here (a store opened and closed without
    /// commits, after a refused start, must not lower the mark to what it lost).
    at: AtomicU64,
}

/// Where the high-water mark of the store at `store` is.
pub fn high_water_path(store: &Path) -> std::path::PathBuf {
    let mut name = store.as_os_str().to_owned();
    name.push(".high-water");
    std::path::PathBuf::from(name)
}

/// The mark's value, if there is one: a decimal revision.
pub fn read_high_water(store: &Path) -> Result<Option<u64>, StoreError> {
    let path = high_water_path(store);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let digits = text.trim_matches(|c: char| c.is_whitespace() || c == '\0');
            if digits.is_empty() {
                // Made at the first open, before any commit.
                return Ok(None);
            }
            digits.parse::<u64>().map(Some).map_err(|_| {
                StoreError::Corrupt(format!("{} holds no revision: {text:?}", path.display()))
            })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(StoreError::Io(format!("{}: {e}", path.display()))),
    }
}

impl HighWater {
    pub(crate) fn open(store: &Path) -> Result<HighWater, StoreError> {
        let path = high_water_path(store);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| StoreError::Io(format!("cannot open {}: {e}", path.display())))?;
        let at = read_high_water(store)?.unwrap_or(0);
        Ok(HighWater {
            file,
            at: AtomicU64::new(at),
        })
    }

    /// Raises the mark to `revision` (never lowers it); `sync` makes it durable.
    pub(crate) fn set(&self, revision: u64, sync: bool) -> std::io::Result<()> {
        if revision > self.at.load(Ordering::Relaxed) {
            self.write(revision)?;
        }
        if sync {
            self.file.sync_data()?;
        }
        Ok(())
    }

    /// Sets the mark to `revision`, lower or not (an operator's acceptance of a loss).
    pub(crate) fn reset(&self, revision: u64) -> std::io::Result<()> {
        self.write(revision)?;
        self.file.sync_data()
    }

    /// Fixed width, so a write never leaves a longer old value's tail.
    fn write(&self, revision: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        self.file
            .write_all_at(format!("{revision:020}\n").as_bytes(), 0)?;
        self.at.store(revision, Ordering::Relaxed);
        Ok(())
    }
}

/// The store's revision as its meta tree says.
fn revision_of(trees: &Trees) -> Option<u64> {
    let raw = trees.meta.get(crate::layout::META_REVISION).ok()??;
    crate::layout::decode_u64(&raw, "stored revision").ok()
}

/// The committer thread's own state.
struct Thread {
    db: sled::Db,
    trees: Trees,
    path: PathBuf,
    log: File,
    mark: HighWater,
    /// Shared with [`Committer::sled_failed`].
    sled_failed: Arc<Mutex<Option<StoreError>>>,
    /// Since when writes are refused for lack of space (logged once each way, not per batch).
    full_since: Option<Instant>,
}

impl Thread {
    fn run(mut self, queue: mpsc::Receiver<Request>, counters: &Counters) {
        while let Ok(first) = queue.recv() {
            let mut ops = vec![first.op];
            let mut replies = vec![first.reply];
            while ops.len() < MAX_BATCH {
                let Ok(next) = queue.try_recv() else { break };
                ops.push(next.op);
                replies.push(next.reply);
            }
            if let Err(refused) = self.ready() {
                for reply in replies {
                    let _ = reply.send(Err(refused.clone()));
                }
                continue;
            }
            self.commit(&ops, replies, counters);
        }
        // Every handle is gone: make sure nothing committed stays unflushed.
        if self.sled_failed.lock().is_ok_and(|failed| failed.is_some()) {
            // sled's flush would wait for the failed write for ever.
            tracing::error!(store = %self.path.display(), "the store is closed without its final flush: a write met a full disk inside sled");
            std::mem::forget(self.db);
            std::mem::forget(self.trees);
            return;
        }
        match flush_durably(&self.db, &self.log) {
            Ok(_) => {
                if let Some(revision) = revision_of(&self.trees)
                    && let Err(e) = self.mark.set(revision, true)
                {
                    tracing::error!(error = %e, "the store's high-water mark was not written");
                }
            }
            Err(e) => tracing::error!(error = %e, "final store flush failed"),
        }
    }

    /// Whether a batch may be tried: sled has not failed, and the disk has its reserve free.
    fn ready(&mut self) -> Result<(), StoreError> {
        if let Some(failed) = self
            .sled_failed
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
        {
            return Err(failed);
        }
        if let Some(full) = crate::space::check(&self.path) {
            self.note_full(&full);
            return Err(full);
        }
        if let Some(since) = self.full_since.take() {
            tracing::warn!(store = %self.path.display(), after = ?since.elapsed(), "the store's disk has space again; writes are taken");
        }
        Ok(())
    }

    fn note_full(&mut self, full: &StoreError) {
        if self.full_since.is_none() {
            tracing::error!(error = %full, "the store's disk is full; writes are refused until space is freed");
            self.full_since = Some(Instant::now());
        }
    }

    /// A batch's fault: a full disk is noted (and sled to be reopened), anything else logged.
    fn failed(&mut self, err: StoreError, what: &str, writes: usize) -> StoreError {
        let err = err.at_store(&self.path);
        if let StoreError::DiskFull { path, detail } = &err {
            self.note_full(&err);
            let failed = StoreError::DiskFull {
                path: path.clone(),
                detail: format!(
                    "a write met the full disk inside the database ({detail}), which then takes \
                     no write until sbxd is restarted"
                ),
            };
            tracing::error!(error = %failed, "the store takes no more writes until sbxd restarts");
            *self
                .sled_failed
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(failed);
        } else {
            tracing::error!(error = %err, writes, "{what} failed");
        }
        err
    }

    fn commit(
        &mut self,
        ops: &[WriteOp],
        replies: Vec<oneshot::Sender<Result<WriteOutcome, StoreError>>>,
        counters: &Counters,
    ) {
        let results = match apply_batch(&self.trees, ops) {
            Ok(results) => results,
            Err(fault) => {
                let fault = self.failed(fault, "write batch", ops.len());
                for reply in replies {
                    let _ = reply.send(Err(fault.clone()));
                }
                return;
            }
        };
        // Refusals wrote nothing: answer them now. Successes wait for the flush.
        let mut pending = Vec::new();
        for (result, reply) in results.into_iter().zip(replies) {
            match result {
                Ok(outcome) => pending.push((outcome, reply)),
                Err(refusal) => {
                    let _ = reply.send(Err(refusal));
                }
            }
        }
        if pending.is_empty() {
            return;
        }
        let started = Instant::now();
        let flushed = flush_durably(&self.db, &self.log);
        counters
            .flush_micros
            .fetch_add(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        counters.flushes.fetch_add(1, Ordering::Relaxed);
        match flushed {
            Ok(bytes) => {
                counters
                    .flush_bytes
                    .fetch_add(bytes as u64, Ordering::Relaxed);
                counters
                    .writes
                    .fetch_add(pending.len() as u64, Ordering::Relaxed);
                // The writes are durable whatever happens to the mark: a mark left behind is
                // what a crash leaves too, and open accepts it (never newer than the store).
                if let Some(revision) = revision_of(&self.trees)
                    && let Err(e) = self.mark.set(revision, false)
                {
                    tracing::error!(error = %e, mark = %high_water_path(&self.path).display(), "the store's high-water mark was not raised; it stays behind the store");
                }
                for (outcome, reply) in pending {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                let err = match self.failed(e, "store flush", pending.len()) {
                    full @ StoreError::DiskFull { .. } => full,
                    other => {
                        StoreError::Io(format!("flush failed, write not acknowledged: {other}"))
                    }
                };
                for (_, reply) in pending {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use crate::{Kind, NewRecord, ObjectStore, SledStore, StoreError};

    fn workspace(name: &str, body: Vec<u8>) -> NewRecord {
        NewRecord {
            id: uuid::Uuid::new_v4(),
            kind: Kind::Workspace,
            workspace: None,
            name: name.into(),
            owner: None,
            labels: Default::default(),
            created_at_ms: 1,
            body,
        }
    }

    /// A tmpfs of its own, unmounted on drop (also when the test fails).
    struct Tmpfs(std::path::PathBuf);

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    /// A 4 MiB tmpfs in a temp dir (`None` unless root).
    fn tmpfs_of_4_mib() -> Option<(tempfile::TempDir, Tmpfs)> {
        if !nix::unistd::Uid::effective().is_root() {
            return None;
        }
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("fs");
        std::fs::create_dir(&mnt).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &mnt,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=4m"),
        )
        .expect("mount a tmpfs");
        Some((dir, Tmpfs(mnt)))
    }

    /// Writes `DIR/fill` until ENOSPC (at most 64 MiB).
    fn fill_up(dir: &std::path::Path) -> std::fs::File {
        let mut fill = std::fs::File::create(dir.join("fill")).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        for _ in 0..1000 {
            if fill.write_all(&chunk).is_err() {
                break;
            }
        }
        fill
    }

    fn resize(fs: &Tmpfs, size: &str) {
        nix::mount::mount(
            None::<&str>,
            &fs.0,
            None::<&str>,
            nix::mount::MsFlags::MS_REMOUNT,
            Some(format!("size={size}").as_str()),
        )
        .expect("remount the tmpfs");
    }

    /// The path past the reserve: a write bigger than the space left meets ENOSPC inside sled,
    /// which fails every later write for good: it answers `DiskFull`, and so does every write
    /// after it, also once space is back, saying sbxd must be restarted; reads go on, and the
    /// store closes without hanging (sled's own close would wait for the failed write).
    #[tokio::test]
    async fn a_write_that_meets_enospc_in_sled_is_disk_full_until_the_store_reopens() {
        let Some((_dir, fs)) = tmpfs_of_4_mib() else {
            eprintln!("skipped: mounting a tmpfs needs root");
            return;
        };
        let mnt = fs.0.clone();
        let store = SledStore::open(&mnt.join("store")).unwrap();
        let kept = store
            .create(workspace("before", vec![1; 100]))
            .await
            .unwrap();

        // Leave the reserve and 64 KiB free, then write 1.5 MiB in one record.
        let fill = fill_up(&mnt);
        let len = fill.metadata().unwrap().len();
        fill.set_len(len - super::super::DISK_RESERVE_BYTES - 64 * 1024)
            .unwrap();
        assert!(store.disk_full().is_none(), "the reserve is still free");
        let big = store.create(workspace("big", vec![7; 1536 * 1024])).await;
        assert!(
            matches!(&big, Err(StoreError::DiskFull { path, .. }) if path == &mnt.join("store")),
            "{big:?}"
        );
        resize(&fs, "32m");
        let after = store.create(workspace("after", vec![2; 100])).await;
        assert!(
            matches!(&after, Err(StoreError::DiskFull { detail, .. }) if detail.contains("restarted")),
            "{after:?}"
        );
        assert!(store.disk_full().is_some(), "health must see it");
        assert_eq!(store.get(kept.id).await.unwrap().unwrap().name, "before");
        let closing = std::time::Instant::now();
        drop(store);
        assert!(closing.elapsed() < std::time::Duration::from_secs(5));

        // The leaked handles keep sled's lock in this process; a new sbxd opens it (its
        // acknowledged writes are on disk: flushed before they were acknowledged).
        drop(fs);
    }

    /// The reserve: with less than it free, a write is refused before sled sees it, and taken
    /// as soon as the space is back.
    #[tokio::test]
    async fn a_write_below_the_reserve_is_refused_up_front_and_taken_once_space_is_back() {
        let Some((_dir, fs)) = tmpfs_of_4_mib() else {
            eprintln!("skipped: mounting a tmpfs needs root");
            return;
        };
        let mnt = fs.0.clone();
        let store = SledStore::open(&mnt.join("store")).unwrap();
        let kept = store
            .create(workspace("before", vec![1; 100]))
            .await
            .unwrap();
        let fill = fill_up(&mnt);
        let full = store.disk_full().expect("the tmpfs is full");
        assert!(full.to_string().contains("is full"), "{full}");
        let flushes = store.flush_stats().flushes;
        let refused = store.create(workspace("refused", vec![])).await;
        assert!(
            matches!(refused, Err(StoreError::DiskFull { .. })),
            "{refused:?}"
        );
        assert_eq!(store.flush_stats().flushes, flushes, "sled never saw it");
        drop(fill);
        std::fs::remove_file(mnt.join("fill")).unwrap();
        assert!(store.disk_full().is_none());
        store.create(workspace("refused", vec![])).await.unwrap();
        assert_eq!(store.get(kept.id).await.unwrap().unwrap(), kept);
        drop(store);
        drop(fs);
    }
}
