//! `SledStore`: the embedded implementation of [`ObjectStore`]. Opening, reads and the trait
//! glue live here; the write transactions are in `writes.rs`, the index checker in `fsck.rs`.

use std::ops::Bound;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use uuid::Uuid;

use crate::committer::{Committer, FlushStats};
use crate::envelope::decode_record;
use crate::error::StoreError;
use crate::layout::{
    self, META_REVISION, decode_u64, decode_uuid, encode_cursor, name_key, record_key,
};
use crate::record::{Kind, ListQuery, NewRecord, Page, Record, Scope};
use crate::schema::{self, SchemaOutcome};
use crate::store::{IndexProblem, ObjectStore};
use crate::trees::Trees;
use crate::writes::{WriteOp, WriteOutcome};

pub(crate) struct Inner {
    pub(crate) trees: Trees,
    /// The database itself, for what spans every tree (a backup); dropped before the
    /// committer, so the committer's handle is still the last one.
    pub(crate) db: sled::Db,
    /// Owns the only other `Db` handle; dropping it joins its thread after a final flush, so
    /// once the last `SledStore` clone is gone sled has released its file lock and the store
    /// can be reopened.
    pub(crate) committer: Committer,
    path: PathBuf,
    schema_outcome: SchemaOutcome,
}

/// The sled-backed object store. Cheap to clone (shared handle); the database closes when the
/// last clone is dropped, after a final flush.
#[derive(Clone)]
pub struct SledStore {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for SledStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.inner.path)
            .finish_non_exhaustive()
    }
}

/// How long an open waits for the store's lock (sled's `flock` on `store/db`) while it is
/// held: a handle this process closed a moment ago can keep it that long (sled's threads
/// finish their last writes after the drop; a restore's import, then its check, met it).
/// Another live process holds it for longer, and the open then fails as before.
pub(crate) const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The sled database at `path` by itself, without the store's schema check or committer and
/// without sled's background flusher (whose thread could keep the lock after the handle is
/// dropped), waiting for the lock as [`SledStore::open`] does: for what works on the raw
/// trees — a backup's import, and tests that write an older layout.
pub fn open_raw_sled(path: &Path) -> sled::Result<sled::Db> {
    open_waiting_for_the_lock(&sled::Config::new().path(path).flush_every_ms(None))
}

/// `config.open()`, tried again every 20 ms for up to [`LOCK_WAIT`] while the lock is held.
fn open_waiting_for_the_lock(config: &sled::Config) -> sled::Result<sled::Db> {
    let began = std::time::Instant::now();
    loop {
        match config.open() {
            // sled words it "could not acquire lock on …: … WouldBlock …" (kind Other).
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && began.elapsed() < LOCK_WAIT =>
            {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

impl SledStore {
    /// Opens (creating if needed) the store at `path`, checking and if needed migrating its
    /// schema version. Fails with `Schema` for a newer or unknown version, `Io` if the
    /// directory cannot be used or another process holds it open.
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        let config = sled::Config::new()
            .path(path)
            // Durability comes from the group-commit flusher, never from a timer.
            .flush_every_ms(None);
        // sled 0.34 can panic while it recovers a damaged log ("tried to serialize
        // Uninitialized", seen on a 100,000-record store whose log was cut to half): that is
        // a corrupt store, said so, not a crash of whoever opened it.
        let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            open_waiting_for_the_lock(&config)
        }))
        .map_err(|panic| {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".into());
            StoreError::Corrupt(format!(
                "sled failed while recovering the log of the store at {} ({what}): the log \
                     is damaged",
                path.display()
            ))
        })?;
        let db = opened.map_err(|e| match StoreError::from(e) {
            StoreError::Io(msg) => {
                StoreError::Io(format!("cannot open store at {}: {msg}", path.display()))
            }
            other => other.at_store(path),
        })?;
        let schema_outcome = schema::prepare(&db, path)?;
        let trees = Trees::open(&db)?;
        let committer = Committer::start(db.clone(), trees.clone(), path)?;
        Ok(SledStore {
            inner: Arc::new(Inner {
                trees,
                db,
                committer,
                path: path.to_path_buf(),
                schema_outcome,
            }),
        })
    }

    /// Where the store lives.
    pub fn path(&self) -> &Path {
        &self.inner.path
    }

    /// What `open` did with the schema version.
    pub fn schema_outcome(&self) -> &SchemaOutcome {
        &self.inner.schema_outcome
    }

    /// How many writes were acknowledged and how many flushes they took.
    pub fn flush_stats(&self) -> FlushStats {
        self.inner.committer.stats()
    }

    /// `Some(DiskFull)` while writes are refused for lack of space: less than
    /// [`crate::DISK_RESERVE_BYTES`] free on the store's file system (checked now), or a write
    /// met ENOSPC inside sled, which then takes no write until the store is reopened.
    pub fn disk_full(&self) -> Option<StoreError> {
        self.inner
            .committer
            .sled_failed()
            .or_else(|| crate::space::check(&self.inner.path))
    }

    fn trees(&self) -> &Trees {
        &self.inner.trees
    }

    fn read_record(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        match self.trees().records.get(record_key(id))? {
            Some(bytes) => decode_record(&bytes).map(Some),
            None => Ok(None),
        }
    }

    fn list_page(&self, q: &ListQuery) -> Result<Page, StoreError> {
        let (tree, prefix) = match q.scope {
            Scope::All => (&self.trees().order_all, vec![q.kind.tag()]),
            Scope::Workspace(ws) if ws.is_nil() => {
                return Err(StoreError::invalid("list scope names the nil workspace id"));
            }
            Scope::Workspace(ws) => {
                let mut p = ws.as_bytes().to_vec();
                p.push(q.kind.tag());
                (&self.trees().order_ws, p)
            }
        };
        let start = match &q.cursor {
            Some(cursor) => {
                let (created, id) = layout::decode_cursor(cursor, q.kind)?;
                let mut key = prefix.clone();
                key.extend_from_slice(&created.to_be_bytes());
                key.extend_from_slice(id.as_bytes());
                Bound::Excluded(key)
            }
            None => Bound::Included(prefix.clone()),
        };
        let limit = if q.limit == 0 { usize::MAX } else { q.limit };
        let mut records = Vec::new();
        let mut more = false;
        for entry in tree.range::<Vec<u8>, _>((start, Bound::Unbounded)) {
            let (key, _) = entry?;
            if !key.starts_with(&prefix) {
                break;
            }
            let (_, id) = layout::order_key_position(&key)?;
            // A record deleted after we read its index entry is simply not listed.
            let Some(rec) = self.read_record(id)? else {
                continue;
            };
            if !q.selector.matches(&rec.labels) {
                continue;
            }
            if records.len() == limit {
                more = true;
                break;
            }
            records.push(rec);
        }
        let next_cursor = match records.last() {
            Some(last) if more => Some(encode_cursor(q.kind, last.created_at_ms, last.id)),
            _ => None,
        };
        Ok(Page {
            records,
            next_cursor,
        })
    }

    pub(crate) fn revision(&self) -> Result<u64, StoreError> {
        match self.trees().meta.get(META_REVISION)? {
            Some(raw) => decode_u64(&raw, "stored revision"),
            None => Ok(0),
        }
    }
}

#[async_trait]
impl ObjectStore for SledStore {
    async fn create_referring(
        &self,
        rec: NewRecord,
        refs: Vec<Uuid>,
    ) -> Result<Record, StoreError> {
        match self
            .inner
            .committer
            .submit(WriteOp::Create(rec, refs))
            .await?
        {
            WriteOutcome::Written(rec) => Ok(rec),
            WriteOutcome::Deleted(_) => {
                Err(StoreError::Corrupt("create answered as a delete".into()))
            }
        }
    }

    async fn update(&self, rec: Record) -> Result<Record, StoreError> {
        match self.inner.committer.submit(WriteOp::Update(rec)).await? {
            WriteOutcome::Written(rec) => Ok(rec),
            WriteOutcome::Deleted(_) => {
                Err(StoreError::Corrupt("update answered as a delete".into()))
            }
        }
    }

    async fn delete(&self, id: Uuid, expected_version: u64) -> Result<Vec<Uuid>, StoreError> {
        let op = WriteOp::Delete {
            id,
            expected_version,
        };
        match self.inner.committer.submit(op).await? {
            WriteOutcome::Deleted(ids) => Ok(ids),
            WriteOutcome::Written(_) => {
                Err(StoreError::Corrupt("delete answered as a write".into()))
            }
        }
    }

    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        self.read_record(id)
    }

    async fn get_by_name(
        &self,
        kind: Kind,
        scope: Option<Uuid>,
        name: &str,
    ) -> Result<Option<Record>, StoreError> {
        let Some(raw) = self.trees().names.get(name_key(kind, scope, name))? else {
            return Ok(None);
        };
        let id = decode_uuid(&raw, "name index value")?;
        // The index and the record are separate trees: re-check that the record still is the
        // one named (a concurrent delete may have removed it).
        Ok(self
            .read_record(id)?
            .filter(|r| r.kind == kind && r.name_scope() == scope && r.name == name))
    }

    async fn list(&self, q: ListQuery) -> Result<Page, StoreError> {
        // A long list (limit 0 over 100k records takes ~0.5 s) must not hold a tokio worker.
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.list_page(&q))
            .await
            .map_err(|e| StoreError::Io(format!("list task failed: {e}")))?
    }

    async fn owned(&self, owner: Uuid) -> Result<Vec<Uuid>, StoreError> {
        crate::idsets::members(&self.trees().owners, owner, "owner index")
    }

    async fn referrers(&self, id: Uuid) -> Result<Vec<Uuid>, StoreError> {
        crate::idsets::members(&self.trees().refs, id, "reference index")
    }

    async fn current_revision(&self) -> Result<u64, StoreError> {
        self.revision()
    }

    async fn integrity_problems(&self) -> Result<Vec<IndexProblem>, StoreError> {
        let store = self.clone();
        tokio::task::spawn_blocking(move || store.verify_indexes())
            .await
            .map_err(|e| StoreError::Io(format!("integrity check task failed: {e}")))?
    }

    fn describe(&self) -> String {
        format!("sled store at {}", self.inner.path.display())
    }

    fn disk_full(&self) -> Option<StoreError> {
        SledStore::disk_full(self)
    }

    fn commit_stats(&self) -> Option<FlushStats> {
        Some(self.flush_stats())
    }
}
