//! Counts the sandbox actors that still have to re-attach to their workloads after startup,
//! so the gateway reports nothing as Ready before every sandbox has been looked at.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;

#[derive(Default)]
pub struct StartupTracker {
    pending: AtomicUsize,
    done: Notify,
}

impl StartupTracker {
    pub fn add(&self, n: usize) {
        self.pending.fetch_add(n, Ordering::SeqCst);
    }

    pub fn attached(&self) {
        if self.pending.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.done.notify_waiters();
        }
    }

    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }

    /// Waits until no actor is left to re-attach; false on timeout.
    pub async fn wait(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.done.notified();
            if self.pending() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.pending() == 0;
            }
        }
    }
}
