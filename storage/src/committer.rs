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
//! An operation refused by the store (`AlreadyExists`, `Conflict`, ...) is refused before it
//! writes anything, gets its own error immediately, and does not disturb the rest of its batch;
//! operations later in a batch see the writes of earlier ones, exactly as if they ran one by
//! one in queue order.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::oneshot;

use crate::error::StoreError;
use crate::sled_store::Trees;
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
        let thread = std::thread::Builder::new()
            .name("sbx-store-committer".into())
            .spawn(move || run(db, log, trees, queue, &thread_counters, &mark))
            .map_err(|e| StoreError::Io(format!("cannot start the committer thread: {e}")))?;
        Ok(Committer {
            requests: Some(requests),
            thread: Some(thread),
            counters,
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
fn flush_durably(db: &sled::Db, log: &File) -> Result<usize, String> {
    let bytes = db.flush().map_err(|e| e.to_string())?;
    log.sync_data()
        .map_err(|e| format!("fdatasync of the log: {e}"))?;
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

fn run(
    db: sled::Db,
    log: File,
    trees: Trees,
    queue: mpsc::Receiver<Request>,
    counters: &Counters,
    mark: &HighWater,
) {
    while let Ok(first) = queue.recv() {
        let mut ops = vec![first.op];
        let mut replies = vec![first.reply];
        while ops.len() < MAX_BATCH {
            let Ok(next) = queue.try_recv() else { break };
            ops.push(next.op);
            replies.push(next.reply);
        }
        let results = match apply_batch(&trees, &ops) {
            Ok(results) => results,
            Err(fault) => {
                tracing::error!(error = %fault, writes = ops.len(), "write batch failed");
                for reply in replies {
                    let _ = reply.send(Err(fault.clone()));
                }
                continue;
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
            continue;
        }
        let started = Instant::now();
        let flushed = flush_durably(&db, &log);
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
                if let Some(revision) = revision_of(&trees)
                    && let Err(e) = mark.set(revision, false)
                {
                    tracing::error!(error = %e, "the store's high-water mark was not written");
                }
                for (outcome, reply) in pending {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "store flush failed");
                let err = StoreError::Io(format!("flush failed, write not acknowledged: {e}"));
                for (_, reply) in pending {
                    let _ = reply.send(Err(err.clone()));
                }
            }
        }
    }
    // Every handle is gone: make sure nothing committed stays unflushed.
    match flush_durably(&db, &log) {
        Ok(_) => {
            if let Some(revision) = revision_of(&trees)
                && let Err(e) = mark.set(revision, true)
            {
                tracing::error!(error = %e, "the store's high-water mark was not written");
            }
        }
        Err(e) => tracing::error!(error = %e, "final store flush failed"),
    }
}
