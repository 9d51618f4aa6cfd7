//! The full-disk state: how much space the store's file system has, and the reserve below which
//! the store refuses writes.
//!
//! Why a reserve and not just ENOSPC: sled 0.34 remembers the first failed log write as a
//! "global error" and fails every later write with it, also after space is freed (measured
//! through sbxd on an 8 MiB tmpfs: once full, creates answered ENOSPC for good, also after the
//! tmpfs grew to 64 MiB). So the committer checks the free space before every batch and refuses
//! the batch while less than [`DISK_RESERVE_BYTES`] are free: sled never sees the ENOSPC, and a
//! write goes through the moment space is back. One `statvfs` per batch costs about a
//! microsecond. When a write meets ENOSPC all the same (another process filled the disk between
//! the check and the write, or one batch was bigger than the reserve), the committer reopens
//! sled once space is back (`committer.rs`).

use std::path::Path;

use crate::error::StoreError;

/// Writes are refused while the store's file system has less than this free: two of sled's
/// 512 KiB log segments, so that one batch (up to a segment rolled and the next begun) never
/// meets ENOSPC by itself.
pub const DISK_RESERVE_BYTES: u64 = 2 * 512 * 1024;

/// Bytes free for an unprivileged writer on the file system holding `path` (`statvfs`:
/// `f_bavail × f_frsize`); `None` when it cannot be told (the write is then tried).
pub(crate) fn free_bytes(path: &Path) -> Option<u64> {
    let stat = nix::sys::statvfs::statvfs(path).ok()?;
    Some((stat.blocks_available() as u64).saturating_mul(stat.fragment_size() as u64))
}

/// `Some(DiskFull)` naming the store at `store` when its file system has less than the
/// reserve free.
pub(crate) fn check(store: &Path) -> Option<StoreError> {
    let free = free_bytes(store)?;
    (free < DISK_RESERVE_BYTES).then(|| StoreError::DiskFull {
        path: store.to_path_buf(),
        detail: format!("{free} bytes free, {DISK_RESERVE_BYTES} kept in reserve"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_roomy_temp_dir_is_not_full_and_the_message_names_the_store() {
        let dir = tempfile::tempdir().unwrap();
        assert!(free_bytes(dir.path()).unwrap() > 0);
        assert!(check(dir.path()).is_none(), "the temp dir has room");
        let err = StoreError::DiskFull {
            path: dir.path().join("store"),
            detail: "0 bytes free".into(),
        };
        let text = err.to_string();
        assert!(text.contains("disk holding the store at"), "{text}");
        assert!(text.contains(&dir.path().join("store").display().to_string()));
        assert!(err.is_disk_full() && !err.is_request_error());
    }

    #[test]
    fn enospc_and_edquot_are_disk_full_other_errors_are_not() {
        for code in [nix::libc::ENOSPC, nix::libc::EDQUOT] {
            let err = std::io::Error::from_raw_os_error(code);
            let mapped = StoreError::from_io("write", &err).at_store(Path::new("/s"));
            assert!(
                matches!(&mapped, StoreError::DiskFull { path, .. } if path == Path::new("/s")),
                "{mapped:?}"
            );
            let sled: StoreError = sled::Error::Io(std::io::Error::from_raw_os_error(code)).into();
            assert!(sled.is_disk_full(), "{sled:?}");
        }
        let eio = std::io::Error::from_raw_os_error(nix::libc::EIO);
        assert!(matches!(
            StoreError::from_io("write", &eio),
            StoreError::Io(_)
        ));
    }
}
