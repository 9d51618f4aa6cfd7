//! A host-wide pool of uid/gid ranges, one range of [`RANGE`] ids per sandbox, so that no two
//! sandboxes on a host share a host uid: not with each other, not across drivers, not across
//! gateways on one machine. A shared uid is a shared kernel quota (`kernel.keys.maxkeys`,
//! about 200 sandboxes of one uid), and a file one sandbox owns is another's to write.
//!
//! A lease is a file `<lease_dir>/<first host id>` holding the absolute path of the sandbox
//! directory it is for, made with `O_CREAT | O_EXCL` under an exclusive `flock` of
//! `<lease_dir>/.lock` (one allocation at a time on the host, whichever process makes it). It
//! is released when the sandbox's directory is gone; a lease whose directory no longer exists
//! (a gateway's data dir removed, a create killed before its record) is stale and taken again.
//! The lease directory is root's (0700) and lives outside any data dir
//! (`/var/lib/sbx/uid-leases` by default), so every gateway on the host sees the same leases.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use sbx_driver_api::DriverError;
use sbx_images::IdMap;

/// The ids of one sandbox: uid (and gid) 0..65535 inside.
pub const RANGE: u32 = 65_536;

/// The pool when none is given: 4096 ranges from host id 1,000,000 (above the 200000..265535
/// that sandboxes made before per-sandbox ranges keep).
pub const DEFAULT_START: u32 = 1_000_000;
pub const DEFAULT_COUNT: u32 = 4096 * RANGE;

/// Where the host's leases are kept when no other directory is given.
pub const DEFAULT_LEASE_DIR: &str = "/var/lib/sbx/uid-leases";

/// Host ids `start .. start + count`, handed out [`RANGE`] at a time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UidPool {
    pub start: u32,
    pub count: u32,
    pub lease_dir: PathBuf,
}

impl Default for UidPool {
    fn default() -> Self {
        UidPool {
            start: DEFAULT_START,
            count: DEFAULT_COUNT,
            lease_dir: PathBuf::from(DEFAULT_LEASE_DIR),
        }
    }
}

/// `START:COUNT` (as in `/etc/subuid`): COUNT a multiple of 65536, START above 0, the range
/// below 2^32 - 1.
pub fn parse_pool(text: &str) -> Result<(u32, u32), String> {
    let bad = |why: &str| {
        format!("uid pool {text:?}: {why} (expected START:COUNT, e.g. 1000000:268435456)")
    };
    let (start, count) = text.split_once(':').ok_or_else(|| bad("no ':'"))?;
    let start: u32 = start
        .trim()
        .parse()
        .map_err(|_| bad("START is not a number"))?;
    let count: u32 = count
        .trim()
        .parse()
        .map_err(|_| bad("COUNT is not a number"))?;
    if start == 0 {
        return Err(bad("START must be above 0 (host root)"));
    }
    if count < RANGE || !count.is_multiple_of(RANGE) {
        return Err(bad(
            "COUNT must be a positive multiple of 65536 (one sandbox's range)",
        ));
    }
    if u64::from(start) + u64::from(count) > u64::from(u32::MAX) {
        return Err(bad("the range must end below 4294967295"));
    }
    Ok((start, count))
}

/// A pool must not hold the image store's range (the owners of the shared layers on disk) nor
/// host root.
pub fn check_apart(pool: &UidPool, store: &IdMap) -> Result<(), DriverError> {
    let (a0, a1) = (
        u64::from(pool.start),
        u64::from(pool.start) + u64::from(pool.count),
    );
    let (b0, b1) = (
        u64::from(store.host_uid),
        u64::from(store.host_uid) + u64::from(store.size),
    );
    let (c0, c1) = (
        u64::from(store.host_gid),
        u64::from(store.host_gid) + u64::from(store.size),
    );
    if pool.start == 0 || (a0 < b1 && b0 < a1) || (a0 < c1 && c0 < a1) {
        return Err(DriverError::InvalidArgument(format!(
            "the uid pool {}:{} overlaps the image store's ids {}..{} (the owners of every \
             sandbox's image layers): give a pool above them",
            pool.start,
            pool.count,
            store.host_uid,
            b1 - 1
        )));
    }
    Ok(())
}

impl UidPool {
    /// How many sandboxes the pool holds at once.
    pub fn slots(&self) -> u32 {
        self.count / RANGE
    }

    fn map(&self, slot: u32) -> IdMap {
        let base = self.start + slot * RANGE;
        IdMap {
            host_uid: base,
            host_gid: base,
            size: RANGE,
        }
    }

    /// Whether `map` is one of this pool's ranges.
    pub fn holds(&self, map: &IdMap) -> bool {
        map.size == RANGE
            && map.host_uid == map.host_gid
            && map.host_uid >= self.start
            && u64::from(map.host_uid) + u64::from(RANGE)
                <= u64::from(self.start) + u64::from(self.count)
            && (map.host_uid - self.start).is_multiple_of(RANGE)
    }

    fn lock(&self) -> Result<Flock<File>, DriverError> {
        let fail = |what: &str, e: io::Error| {
            DriverError::Internal(format!("{what} {}: {e}", self.lease_dir.display()))
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.lease_dir)
            .map_err(|e| fail("making the uid lease directory", e))?;
        let file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(self.lease_dir.join(".lock"))
            .map_err(|e| fail("opening the lock of the uid leases in", e))?;
        Flock::lock(file, FlockArg::LockExclusive)
            .map_err(|(_, e)| fail("locking the uid leases in", io::Error::from(e)))
    }

    fn lease_file(&self, map: &IdMap) -> PathBuf {
        self.lease_dir.join(map.host_uid.to_string())
    }

    /// A free range, leased to the sandbox whose directory is `owner` (absolute).
    pub fn lease(&self, owner: &Path) -> Result<IdMap, DriverError> {
        let _held = self.lock()?;
        for slot in 0..self.slots() {
            let map = self.map(slot);
            match self.take(&map, owner)? {
                Taken::Ours => return Ok(map),
                Taken::Others => continue,
            }
        }
        Err(DriverError::FailedPrecondition(format!(
            "every uid range of the pool ({} sandboxes from host id {}) is leased; delete a \
             sandbox, or give sbxd a larger --uid-pool",
            self.slots(),
            self.start
        )))
    }

    /// Takes `map` for `owner` if it is free or stale (lock held).
    fn take(&self, map: &IdMap, owner: &Path) -> Result<Taken, DriverError> {
        let file = self.lease_file(map);
        let text = format!("{}\n", owner.display());
        for _ in 0..2 {
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&file)
            {
                Ok(mut f) => {
                    f.write_all(text.as_bytes())
                        .and_then(|_| f.sync_all())
                        .map_err(|e| lease_error(&file, e))?;
                    return Ok(Taken::Ours);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    match holder(&file) {
                        Some(h) if h == owner => return Ok(Taken::Ours),
                        Some(h) if h.symlink_metadata().is_ok() => return Ok(Taken::Others),
                        // Stale: its sandbox directory is gone (or the file is unreadable).
                        _ => fs::remove_file(&file).map_err(|e| lease_error(&file, e))?,
                    }
                }
                Err(e) => return Err(lease_error(&file, e)),
            }
        }
        Ok(Taken::Others)
    }

    /// At a driver's open: the range a sandbox's record names is leased to it again if its
    /// lease went missing. False if another live sandbox holds it (the caller must not run the
    /// sandbox on a shared range).
    pub fn reclaim(&self, map: &IdMap, owner: &Path) -> Result<bool, DriverError> {
        let _held = self.lock()?;
        Ok(matches!(self.take(map, owner)?, Taken::Ours))
    }

    /// Releases `map` if `owner` holds it (the sandbox's directory is gone).
    pub fn release(&self, map: &IdMap, owner: &Path) {
        let Ok(_held) = self.lock() else { return };
        let file = self.lease_file(map);
        if holder(&file).as_deref() == Some(owner)
            && let Err(e) = fs::remove_file(&file)
        {
            tracing::warn!(lease = %file.display(), error = %e, "uid lease not released");
        }
    }
}

/// A new sandbox's range, leased to its directory `owner`; `None` without a pool (the
/// driver's shared range).
pub fn lease_for(pool: Option<&UidPool>, owner: &Path) -> Result<Option<IdMap>, DriverError> {
    pool.map(|p| p.lease(owner)).transpose()
}

/// At a driver's open: the range a sandbox's record names is leased to it again if its lease
/// went missing; if another live sandbox holds it, that is said loudly (two sandboxes on one
/// range are not kept apart by their uids).
pub fn reclaim_at_open(pool: Option<&UidPool>, map: Option<IdMap>, owner: &Path, id: uuid::Uuid) {
    let (Some(pool), Some(map)) = (pool, map) else {
        return;
    };
    match pool.reclaim(&map, owner) {
        Ok(true) => {}
        Ok(false) => tracing::error!(sandbox_id = %id, host_uid = map.host_uid,
            "the sandbox's uid range is leased to another sandbox"),
        Err(e) => tracing::warn!(sandbox_id = %id, error = %e, "uid lease not checked"),
    }
}

/// A deleted sandbox's range back to the pool (its directory is gone).
pub fn release_for(pool: Option<&UidPool>, map: Option<IdMap>, owner: &Path) {
    if let (Some(pool), Some(map)) = (pool, map) {
        pool.release(&map, owner);
    }
}

/// What a driver's capabilities say of its sandboxes' host uids.
pub fn describe(pool: Option<&UidPool>, shared: &IdMap) -> String {
    match pool {
        Some(p) => format!(
            "a host uid range of its own, from the pool {}:{}",
            p.start, p.count
        ),
        None => format!("host uid {}", shared.host_uid),
    }
}

enum Taken {
    Ours,
    Others,
}

/// The sandbox directory a lease names.
fn holder(file: &Path) -> Option<PathBuf> {
    let text = fs::read_to_string(file).ok()?;
    let line = text.lines().next()?.trim();
    (!line.is_empty()).then(|| PathBuf::from(line))
}

fn lease_error(file: &Path, e: io::Error) -> DriverError {
    DriverError::Internal(format!("the uid lease {}: {e}", file.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(dir: &Path, slots: u32) -> UidPool {
        UidPool {
            start: 5_000_000,
            count: slots * RANGE,
            lease_dir: dir.join("leases"),
        }
    }

    #[test]
    fn pools_parse_and_bad_ones_say_why() {
        assert_eq!(parse_pool("1000000:131072"), Ok((1_000_000, 131_072)));
        for (bad, why) in [
            ("1000000", "no ':'"),
            ("x:65536", "START"),
            ("0:65536", "above 0"),
            ("1000:1000", "multiple of 65536"),
            ("4294000000:1048576", "below"),
        ] {
            let err = parse_pool(bad).unwrap_err();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn each_owner_gets_its_own_range_until_the_pool_is_full() {
        let tmp = tempfile::tempdir().unwrap();
        let pool = pool(tmp.path(), 3);
        let owners: Vec<PathBuf> = (0..4).map(|i| tmp.path().join(format!("s{i}"))).collect();
        for o in &owners {
            fs::create_dir(o).unwrap();
        }
        let maps: Vec<IdMap> = owners[..3].iter().map(|o| pool.lease(o).unwrap()).collect();
        let firsts: std::collections::BTreeSet<u32> = maps.iter().map(|m| m.host_uid).collect();
        assert_eq!(firsts.len(), 3, "{maps:?}");
        assert!(maps.iter().all(|m| pool.holds(m)));
        // The same owner asking again gets what it holds.
        assert_eq!(pool.lease(&owners[0]).unwrap(), maps[0]);
        let full = pool.lease(&owners[3]).unwrap_err();
        assert!(matches!(full, DriverError::FailedPrecondition(_)), "{full}");
        // A release frees exactly that range; another owner's release frees nothing.
        pool.release(&maps[1], &owners[0]);
        assert!(pool.lease(&owners[3]).is_err());
        pool.release(&maps[1], &owners[1]);
        assert_eq!(pool.lease(&owners[3]).unwrap(), maps[1]);
    }

    #[test]
    fn a_lease_whose_sandbox_directory_is_gone_is_taken_again() {
        let tmp = tempfile::tempdir().unwrap();
        let pool = pool(tmp.path(), 1);
        let gone = tmp.path().join("gone");
        let live = tmp.path().join("live");
        fs::create_dir(&gone).unwrap();
        fs::create_dir(&live).unwrap();
        let map = pool.lease(&gone).unwrap();
        assert!(
            pool.lease(&live).is_err(),
            "held while its directory exists"
        );
        fs::remove_dir(&gone).unwrap();
        assert_eq!(pool.lease(&live).unwrap(), map);
        // The old owner can no longer claim it back.
        assert!(!pool.reclaim(&map, &gone).unwrap());
        assert!(pool.reclaim(&map, &live).unwrap());
    }

    #[test]
    fn a_pool_over_the_image_store_range_is_refused() {
        let store = IdMap::default();
        let over = UidPool {
            start: 230_000,
            count: RANGE,
            lease_dir: PathBuf::from("/x"),
        };
        let err = check_apart(&over, &store).unwrap_err().to_string();
        assert!(err.contains("overlaps"), "{err}");
        check_apart(&UidPool::default(), &store).unwrap();
    }

    #[test]
    fn a_range_outside_the_pool_is_not_its() {
        let tmp = tempfile::tempdir().unwrap();
        let pool = pool(tmp.path(), 2);
        assert!(!pool.holds(&IdMap::default()));
        assert!(pool.holds(&pool.map(1)));
        let mut off = pool.map(1);
        off.host_uid += 1;
        off.host_gid += 1;
        assert!(!pool.holds(&off));
        assert!(!pool.holds(&pool.map(2)));
    }
}
