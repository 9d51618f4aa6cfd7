//! Group commit: one flusher thread makes committed transactions durable for many writers at
//! once.
//!
//! A writer commits its sled transaction, then takes a *ticket* (a sequence number issued after
//! its commit) and waits, asynchronously, until the flusher reports a completed flush whose
//! *target* is at least that ticket. The flusher reads the highest issued ticket as its target
//! *before* it starts `Db::flush`, so a flush that covers ticket `t` began after the commit that
//! took `t`: everything that commit wrote is on disk when the writer wakes. Writers that commit
//! while a flush is running all share the next one.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use tokio::sync::watch;

use crate::error::StoreError;

/// What the flusher has done so far; published on a watch channel so writers await it without
/// blocking a tokio worker.
#[derive(Debug, Clone, Default)]
struct FlushProgress {
    /// Every ticket up to this one is durable.
    durable_through: u64,
    /// The target of the last flush that failed; tickets up to it that are not durable get the
    /// error.
    failed_through: u64,
    last_error: Option<String>,
    /// The flusher has exited (store closing); no more tickets will become durable.
    stopped: bool,
}

#[derive(Debug, Default)]
struct TicketState {
    /// The last ticket handed out.
    issued: u64,
    /// Set on drop: the flusher drains what is issued and exits.
    shutting_down: bool,
}

struct Shared {
    tickets: Mutex<TicketState>,
    /// Wakes the flusher when a ticket is issued or shutdown begins.
    wake: Condvar,
    progress: watch::Sender<FlushProgress>,
}

impl Shared {
    fn tickets(&self) -> MutexGuard<'_, TicketState> {
        // A panic while holding this lock leaves only integers behind: still consistent.
        self.tickets.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Counts of flushes, for benchmarks and tests that check writers really share flushes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlushStats {
    /// Tickets issued (one per acknowledged write).
    pub tickets: u64,
    /// `Db::flush` calls completed.
    pub flushes: u64,
}

pub(crate) struct GroupCommit {
    shared: Arc<Shared>,
    flusher: Mutex<Option<JoinHandle<()>>>,
    /// Flushes completed, counted by the flusher thread.
    flushes: Arc<std::sync::atomic::AtomicU64>,
}

impl GroupCommit {
    /// Starts the flusher thread for `db`.
    pub(crate) fn start(db: sled::Db) -> Result<GroupCommit, StoreError> {
        let (progress, _) = watch::channel(FlushProgress::default());
        let shared = Arc::new(Shared {
            tickets: Mutex::new(TicketState::default()),
            wake: Condvar::new(),
            progress,
        });
        let flushes = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let thread_shared = Arc::clone(&shared);
        let thread_flushes = Arc::clone(&flushes);
        let flusher = std::thread::Builder::new()
            .name("sbx-store-flusher".into())
            .spawn(move || run_flusher(db, &thread_shared, &thread_flushes))
            .map_err(|e| StoreError::Io(format!("cannot start the flusher thread: {e}")))?;
        Ok(GroupCommit {
            shared,
            flusher: Mutex::new(Some(flusher)),
            flushes,
        })
    }

    /// Waits until everything committed before this call is on disk. Call it after the
    /// transaction has committed.
    pub(crate) async fn wait_durable(&self) -> Result<(), StoreError> {
        let mut rx = self.shared.progress.subscribe();
        let ticket = {
            let mut t = self.shared.tickets();
            if t.shutting_down {
                return Err(StoreError::Io("store is closing; write not flushed".into()));
            }
            t.issued += 1;
            t.issued
        };
        self.shared.wake.notify_one();
        let progress = rx
            .wait_for(|p| p.durable_through >= ticket || p.failed_through >= ticket || p.stopped)
            .await
            .map_err(|_| StoreError::Io("the flusher thread is gone".into()))?;
        if progress.durable_through >= ticket {
            Ok(())
        } else if progress.failed_through >= ticket {
            Err(StoreError::Io(format!(
                "flush failed: {}",
                progress.last_error.as_deref().unwrap_or("unknown error")
            )))
        } else {
            Err(StoreError::Io(
                "store closed before the write was flushed".into(),
            ))
        }
    }

    pub(crate) fn stats(&self) -> FlushStats {
        FlushStats {
            tickets: self.shared.tickets().issued,
            flushes: self.flushes.load(std::sync::atomic::Ordering::Relaxed),
        }
    }
}

impl Drop for GroupCommit {
    fn drop(&mut self) {
        self.shared.tickets().shutting_down = true;
        self.shared.wake.notify_one();
        let handle = self
            .flusher
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(handle) = handle
            && handle.join().is_err()
        {
            tracing::error!("the store flusher thread panicked");
        }
    }
}

fn run_flusher(db: sled::Db, shared: &Shared, flushes: &std::sync::atomic::AtomicU64) {
    let mut flushed = 0u64;
    loop {
        let target = {
            let mut t = shared.tickets();
            while t.issued == flushed && !t.shutting_down {
                t = shared.wake.wait(t).unwrap_or_else(|e| e.into_inner());
            }
            if t.issued == flushed {
                break; // shutting down with nothing pending
            }
            t.issued
        };
        let result = db.flush();
        flushes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        flushed = target;
        match result {
            Ok(_) => shared.progress.send_modify(|p| p.durable_through = target),
            Err(e) => {
                tracing::error!(error = %e, "store flush failed");
                shared.progress.send_modify(|p| {
                    p.failed_through = target;
                    p.last_error = Some(e.to_string());
                });
            }
        }
    }
    // A final flush so that anything written without a ticket (e.g. by a migration) is on disk.
    if let Err(e) = db.flush() {
        tracing::error!(error = %e, "final store flush failed");
    }
    shared.progress.send_modify(|p| p.stopped = true);
}
