//! The records of a host driver's sandboxes: on disk, found again at open, and cached.
//!
//! Each sandbox has a directory `<root>/<id>/` (`<state_dir>/sandboxes/`, the vm driver's
//! `<state_dir>/vms/`) holding its record [`RECORD_FILE`]: pretty JSON carrying its format
//! version ([`HostRecord::FORMAT`]), which a reader refuses unless it is the one it knows.
//! Every write is atomic — a temp file beside it, fsync, rename over the record, fsync of the
//! directory — so a driver killed at any moment leaves the old record or the new one, never
//! half of one. A directory without a record is a create killed before its first write (the
//! drivers write the record before they launch anything); open removes it.
//!
//! A deleted sandbox's directory is first renamed into `<state_dir>/trash/` (one rename, so
//! the sandbox is there or gone), then removed; a driver killed during the removal leaves
//! trash, which the next open empties.
//!
//! [`RecordCache`] holds every record in memory — reads never touch the disk, every write goes
//! to disk first — and one lock per sandbox ([`SandboxLocks`]) that serialises its lifecycle
//! calls.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::sync::OwnedMutexGuard;
use uuid::Uuid;

use super::{Desired, internal, locked};
use sbx_driver_api::DriverError;

/// The name of a sandbox's record in its directory.
pub const RECORD_FILE: &str = "sandbox.json";

/// What the kit needs to know of a driver's record; the rest is the driver's.
pub trait HostRecord: Clone + Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The format version this build writes, and the only one it reads.
    const FORMAT: u32;
    /// The format version the record says it has.
    fn format(&self) -> u32;
    fn sandbox_id(&self) -> Uuid;
    /// Round-tripped in snapshots; never used to find the sandbox.
    fn workspace(&self) -> &str;
    fn name(&self) -> &str;
    /// What the gateway last asked of the workload.
    fn desired(&self) -> Desired;
    fn set_desired(&mut self, desired: Desired);
    /// Wall-clock time of the last launch, milliseconds since the Unix epoch; 0 before the
    /// first.
    fn launched_at_ms(&self) -> u64;
}

/// Implements [`HostRecord`] for a record struct with the fields `format: u32`,
/// `sandbox_id: Uuid`, `workspace` and `name: String`, `desired: Desired` and
/// `launched_at_ms: u64` (every host driver's record has them), whose format version is
/// `$format`.
#[macro_export]
macro_rules! host_record {
    ($record:ty, $format:expr) => {
        impl $crate::records::HostRecord for $record {
            const FORMAT: u32 = $format;
            fn format(&self) -> u32 {
                self.format
            }
            fn sandbox_id(&self) -> ::uuid::Uuid {
                self.sandbox_id
            }
            fn workspace(&self) -> &str {
                &self.workspace
            }
            fn name(&self) -> &str {
                &self.name
            }
            fn desired(&self) -> $crate::Desired {
                self.desired
            }
            fn set_desired(&mut self, desired: $crate::Desired) {
                self.desired = desired;
            }
            fn launched_at_ms(&self) -> u64 {
                self.launched_at_ms
            }
        }
    };
}

/// `<state_dir>/sandboxes`: where the oci and process drivers keep their sandboxes.
pub fn sandboxes_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("sandboxes")
}

/// `<state_dir>/trash`: sandboxes being deleted.
pub fn trash_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("trash")
}

/// The record of the sandbox whose directory is `sandbox_dir`.
pub fn record_file(sandbox_dir: &Path) -> PathBuf {
    sandbox_dir.join(RECORD_FILE)
}

/// Writes `bytes` to `path` atomically and durably: a temp file `.<name>.tmp` beside it,
/// fsync, rename over `path`, fsync of the directory.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| io::Error::other(format!("{} has no parent", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file")
    ));
    {
        // 0600: a record (or anything else written this way) is host root's alone until its
        // writer says otherwise; another local user reads none of it.
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        file.set_permissions(fs::Permissions::from_mode(0o600))?;
        file.write_all(bytes)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    fs::File::open(dir)?.sync_all()
}

/// Writes `value` to `path` as pretty JSON, atomically and durably ([`write_atomically`]).
pub fn write_json_atomically(path: &Path, value: &impl Serialize) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(value).map_err(io::Error::other)?;
    write_atomically(path, &bytes)
}

/// Reads the record at `path`, refusing one whose format is not [`HostRecord::FORMAT`].
pub fn read_json_with_format<R: HostRecord>(path: &Path) -> io::Result<R> {
    let record: R = serde_json::from_slice(&fs::read(path)?).map_err(io::Error::other)?;
    if record.format() != R::FORMAT {
        return Err(io::Error::other(format!(
            "record format {} is not the supported {}",
            record.format(),
            R::FORMAT
        )));
    }
    Ok(record)
}

/// Removes every entry of the trash, after `before_removal` (the oci driver unmounts a root
/// filesystem left mounted there).
pub fn empty_trash(trash: &Path, mut before_removal: impl FnMut(&Path)) -> Result<(), DriverError> {
    for entry in fs::read_dir(trash)
        .map_err(|e| internal(&format!("reading the trash {}", trash.display()), e))?
        .flatten()
    {
        before_removal(&entry.path());
        if let Err(e) = fs::remove_dir_all(entry.path()) {
            tracing::warn!(path = %entry.path().display(), error = %e, "trash entry not removed");
        }
    }
    Ok(())
}

/// Reads the record of every sandbox directory under `root`. A directory not named by a
/// sandbox id is left alone; one without a record (a create killed before its record was
/// written: nothing was launched) is removed, after `half_created` undid what the driver made
/// outside it; one with an unreadable record is skipped, with an error in the log.
pub fn find_records<R: HostRecord>(
    root: &Path,
    mut half_created: impl FnMut(Uuid, &Path),
) -> Result<HashMap<Uuid, R>, DriverError> {
    let mut records = HashMap::new();
    for entry in fs::read_dir(root)
        .map_err(|e| internal("reading the state directory", e))?
        .flatten()
    {
        let Some(id) = entry
            .file_name()
            .to_str()
            .and_then(|n| Uuid::parse_str(n).ok())
        else {
            tracing::warn!(path = %entry.path().display(), "not a sandbox directory; left alone");
            continue;
        };
        let dir = entry.path();
        match read_json_with_format::<R>(&record_file(&dir)) {
            Ok(record) => {
                records.insert(id, record);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                half_created(id, &dir);
                if let Err(e) = fs::remove_dir_all(&dir) {
                    tracing::warn!(sandbox_id = %id, error = %e, "half-created sandbox not removed");
                }
            }
            Err(e) => {
                tracing::error!(sandbox_id = %id, error = %e, "unreadable sandbox record; skipped")
            }
        }
    }
    Ok(records)
}

/// One async lock per sandbox, made at first use.
#[derive(Debug, Default)]
pub struct SandboxLocks(Mutex<HashMap<Uuid, Arc<tokio::sync::Mutex<()>>>>);

impl SandboxLocks {
    /// Waits for sandbox `id`'s lock.
    pub async fn lock(&self, id: Uuid) -> OwnedMutexGuard<()> {
        let lock = locked(&self.0).entry(id).or_default().clone();
        lock.lock_owned().await
    }

    /// Forgets `id`'s lock unless another call waits on it: called by the lock's holder, whose
    /// guard and the map hold the only references then. A waiter must keep serialising
    /// against later calls for this id.
    pub fn forget_unless_awaited(&self, id: Uuid) {
        let mut locks = locked(&self.0);
        if locks.get(&id).is_some_and(|l| Arc::strong_count(l) <= 2) {
            locks.remove(&id);
        }
    }
}

/// A host driver's records: the directories under `root`, each record cached in memory.
#[derive(Debug)]
pub struct RecordCache<R> {
    root: PathBuf,
    trash: PathBuf,
    records: Mutex<HashMap<Uuid, R>>,
    /// One lock per sandbox serialises its lifecycle calls (create, start, stop, delete).
    locks: SandboxLocks,
}

impl<R: HostRecord> RecordCache<R> {
    /// The cache of `records` (as [`find_records`] found them under `root`); deletes go
    /// through `trash`.
    pub fn new(root: PathBuf, trash: PathBuf, records: HashMap<Uuid, R>) -> Self {
        RecordCache {
            root,
            trash,
            records: Mutex::new(records),
            locks: SandboxLocks::default(),
        }
    }

    /// Sandbox `id`'s directory.
    pub fn sandbox_dir(&self, id: Uuid) -> PathBuf {
        self.root.join(id.to_string())
    }

    /// Waits for sandbox `id`'s lifecycle lock.
    pub async fn lock(&self, id: Uuid) -> OwnedMutexGuard<()> {
        self.locks.lock(id).await
    }

    pub fn get(&self, id: Uuid) -> Option<R> {
        locked(&self.records).get(&id).cloned()
    }

    /// Sandbox `id`'s record, or `NotFound`.
    pub fn require(&self, id: Uuid) -> Result<R, DriverError> {
        self.get(id).ok_or_else(|| DriverError::NotFound {
            sandbox_id: id.to_string(),
        })
    }

    pub fn contains(&self, id: Uuid) -> bool {
        locked(&self.records).contains_key(&id)
    }

    /// Every record, in no order.
    pub fn all(&self) -> Vec<R> {
        locked(&self.records).values().cloned().collect()
    }

    /// Every record, by sandbox id.
    pub fn sorted(&self) -> Vec<R> {
        let mut records = self.all();
        records.sort_by_key(R::sandbox_id);
        records
    }

    /// Writes the record to disk (atomically, durably), then to the cache.
    pub fn save(&self, record: &R) -> Result<(), DriverError> {
        let id = record.sandbox_id();
        let file = record_file(&self.sandbox_dir(id));
        write_json_atomically(&file, record)
            .map_err(|e| super::write_failure("writing the sandbox record", &file, e))?;
        locked(&self.records).insert(id, record.clone());
        Ok(())
    }

    /// Removes sandbox `id`: its directory renamed into the trash (a driver killed during the
    /// removal leaves trash, emptied at open, not a half-deleted sandbox), its record
    /// forgotten, then the trash entry removed.
    pub fn remove(&self, id: Uuid) -> Result<(), DriverError> {
        let trash = self.trash.join(format!("{id}-{}", Uuid::new_v4()));
        fs::rename(self.sandbox_dir(id), &trash)
            .map_err(|e| internal("moving the sandbox to the trash", e))?;
        locked(&self.records).remove(&id);
        if let Err(e) = fs::remove_dir_all(&trash) {
            tracing::warn!(sandbox_id = %id, error = %e, "deleted sandbox's files not all removed");
        }
        Ok(())
    }

    /// Forgets `id`'s lifecycle lock unless another call waits on it (see
    /// [`SandboxLocks::forget_unless_awaited`]).
    pub fn forget_lock(&self, id: Uuid) {
        self.locks.forget_unless_awaited(id);
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
    struct Sample {
        format: u32,
        sandbox_id: Uuid,
        workspace: String,
        name: String,
        desired: Desired,
        launched_at_ms: u64,
    }

    host_record!(Sample, 1);

    fn sample() -> Sample {
        Sample {
            format: Sample::FORMAT,
            sandbox_id: Uuid::new_v4(),
            workspace: "ws".into(),
            name: "web".into(),
            desired: Desired::Running,
            launched_at_ms: 0,
        }
    }

    #[test]
    fn records_round_trip_and_overwrite_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(RECORD_FILE);
        let mut record = sample();
        write_json_atomically(&path, &record).unwrap();
        assert_eq!(read_json_with_format::<Sample>(&path).unwrap(), record);
        record.desired = Desired::Stopped;
        write_json_atomically(&path, &record).unwrap();
        assert_eq!(read_json_with_format::<Sample>(&path).unwrap(), record);
        assert!(!tmp.path().join(".sandbox.json.tmp").exists());
    }

    #[test]
    fn unknown_formats_and_broken_json_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(RECORD_FILE);
        let mut record = sample();
        record.format = 99;
        write_json_atomically(&path, &record).unwrap();
        let err = read_json_with_format::<Sample>(&path).unwrap_err();
        assert!(err.to_string().contains("format 99"), "{err}");
        fs::write(&path, b"{not json").unwrap();
        assert!(read_json_with_format::<Sample>(&path).is_err());
    }

    #[test]
    fn open_finds_records_removes_half_creates_and_empties_the_trash() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, trash) = (sandboxes_dir(tmp.path()), trash_dir(tmp.path()));
        let kept = sample();
        let half = Uuid::new_v4();
        let broken = Uuid::new_v4();
        for id in [kept.sandbox_id, half, broken] {
            fs::create_dir_all(root.join(id.to_string())).unwrap();
        }
        write_json_atomically(&record_file(&root.join(kept.sandbox_id.to_string())), &kept)
            .unwrap();
        fs::write(record_file(&root.join(broken.to_string())), b"{").unwrap();
        fs::create_dir_all(root.join("not-an-id")).unwrap();
        fs::create_dir_all(trash.join("x").join("y")).unwrap();

        let mut undone = Vec::new();
        let records: HashMap<Uuid, Sample> =
            find_records(&root, |id, dir| undone.push((id, dir.to_path_buf()))).unwrap();
        assert_eq!(records, HashMap::from([(kept.sandbox_id, kept.clone())]));
        assert_eq!(undone, [(half, root.join(half.to_string()))]);
        assert!(
            !root.join(half.to_string()).exists(),
            "a half create is removed"
        );
        assert!(
            root.join(broken.to_string()).exists(),
            "an unreadable one is kept"
        );
        assert!(root.join("not-an-id").exists());

        let mut seen = Vec::new();
        empty_trash(&trash, |entry| seen.push(entry.to_path_buf())).unwrap();
        assert_eq!(seen, [trash.join("x")]);
        assert_eq!(fs::read_dir(&trash).unwrap().count(), 0);
        let err = empty_trash(&tmp.path().join("none"), |_| {}).unwrap_err();
        assert!(err.to_string().contains("none"), "{err}");
    }

    #[tokio::test]
    async fn the_cache_writes_through_and_removes_through_the_trash() {
        let tmp = tempfile::tempdir().unwrap();
        let (root, trash) = (sandboxes_dir(tmp.path()), trash_dir(tmp.path()));
        fs::create_dir_all(&trash).unwrap();
        let cache = RecordCache::new(root.clone(), trash.clone(), HashMap::new());
        let mut record = sample();
        let id = record.sandbox_id;
        assert!(matches!(
            cache.require(id),
            Err(DriverError::NotFound { .. })
        ));
        fs::create_dir_all(cache.sandbox_dir(id)).unwrap();
        record.desired = Desired::Stopped;
        cache.save(&record).unwrap();
        assert_eq!(cache.get(id), Some(record.clone()));
        let on_disk: Sample = read_json_with_format(&record_file(&cache.sandbox_dir(id))).unwrap();
        assert_eq!(on_disk, record);
        let other = sample();
        fs::create_dir_all(cache.sandbox_dir(other.sandbox_id)).unwrap();
        cache.save(&other).unwrap();
        let ids: Vec<Uuid> = cache.sorted().iter().map(|r| r.sandbox_id).collect();
        let mut want = vec![id, other.sandbox_id];
        want.sort();
        assert_eq!(ids, want);

        cache.remove(id).unwrap();
        assert!(!cache.contains(id) && cache.contains(other.sandbox_id));
        assert!(!cache.sandbox_dir(id).exists());
        assert_eq!(fs::read_dir(&trash).unwrap().count(), 0);
        let err = cache.remove(id).unwrap_err();
        assert!(err.to_string().contains("trash"), "{err}");
    }

    #[tokio::test]
    async fn a_lock_is_forgotten_only_when_nobody_waits_on_it() {
        let locks = Arc::new(SandboxLocks::default());
        let id = Uuid::new_v4();
        let held = locks.lock(id).await;
        let waiter = tokio::spawn({
            let locks = Arc::clone(&locks);
            async move {
                let _guard = locks.lock(id).await;
            }
        });
        // Let the waiter take its reference and block.
        for _ in 0..100 {
            if locked(&locks.0)
                .get(&id)
                .is_some_and(|l| Arc::strong_count(l) > 2)
            {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        locks.forget_unless_awaited(id);
        assert!(
            locked(&locks.0).contains_key(&id),
            "a waiter keeps the lock"
        );
        drop(held);
        waiter.await.unwrap();
        let held = locks.lock(id).await;
        locks.forget_unless_awaited(id);
        assert!(
            !locked(&locks.0).contains_key(&id),
            "nobody waits: forgotten"
        );
        drop(held);
    }
}
