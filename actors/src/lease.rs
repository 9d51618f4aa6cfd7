//! At most one live sandbox actor per sandbox UUID in the process.
//!
//! A killed actor's state is dropped a moment after its supervisor hears of the death, so a
//! restarted actor could otherwise overlap the old one. Each sandbox actor holds a lease for
//! its UUID in its state; the lease is released when that state is dropped, and a new actor
//! for the same UUID waits for it.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use uuid::Uuid;

#[derive(Default)]
pub struct LeaseTable {
    held: Mutex<HashSet<Uuid>>,
}

/// Proof that its holder is the only live actor for `id`. Released on drop.
pub struct Lease {
    table: Arc<LeaseTable>,
    id: Uuid,
}

impl LeaseTable {
    /// Takes the lease for `id`, waiting up to `wait` for a previous holder to go away.
    pub async fn acquire(self: &Arc<Self>, id: Uuid, wait: Duration) -> Option<Lease> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            if self
                .held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id)
            {
                return Some(Lease {
                    table: Arc::clone(self),
                    id,
                });
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.table
            .held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn second_holder_waits_for_the_first() {
        let table = Arc::new(LeaseTable::default());
        let id = Uuid::new_v4();
        let first = table.acquire(id, Duration::ZERO).await.unwrap();
        assert!(table.acquire(id, Duration::from_millis(20)).await.is_none());
        let other = table.acquire(Uuid::new_v4(), Duration::ZERO).await;
        assert!(other.is_some(), "another id is independent");
        let t2 = Arc::clone(&table);
        let waiter =
            tokio::spawn(async move { t2.acquire(id, Duration::from_secs(5)).await.is_some() });
        tokio::time::sleep(Duration::from_millis(10)).await;
        drop(first);
        assert!(waiter.await.unwrap());
    }
}
