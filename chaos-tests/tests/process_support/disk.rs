//! The data dir of a process chaos run on its own tmpfs, and the disk-full fault that fills it:
//! a balloon file takes all but [`LEFT_FREE`] of the space (below the store's 1 MiB reserve, so
//! the store refuses writes up front, and the driver's record writes meet ENOSPC) for
//! [`HOLD`], then goes. Clients must see refusals they can expect (RESOURCE_EXHAUSTED,
//! UNAVAILABLE), never a lie; once space is back everything converges and nothing
//! acknowledged is lost — the run's usual checks. The tmpfs is unmounted (lazily: a workload
//! killed a moment ago may still hold it) when the run ends, pass or fail; a failed run's files
//! are copied out first ([`keep_evidence`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// The tmpfs's size: the store, the driver's state and every log of a 12 s run fit in a tenth.
pub const SIZE: u64 = 256 << 20;
/// What the balloon leaves free.
pub const LEFT_FREE: u64 = 256 << 10;
/// How long the disk stays full.
pub const HOLD: Duration = Duration::from_millis(1500);
/// The most a failed run's copy of its files holds.
const EVIDENCE_LIMIT: u64 = 512 << 20;

/// A tmpfs mounted at `path` (made if missing) for as long as this lives.
pub struct Tmpfs {
    path: PathBuf,
}

impl Tmpfs {
    pub fn mount(path: &Path) -> Result<Tmpfs, String> {
        std::fs::create_dir_all(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let options = format!("size={SIZE},mode=0755");
        mount(
            Some("tmpfs"),
            path,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options.as_str()),
        )
        .map_err(|e| {
            format!(
                "mount a tmpfs on {}: {e} (the test needs root)",
                path.display()
            )
        })?;
        Ok(Tmpfs {
            path: path.to_path_buf(),
        })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        if let Err(e) = umount2(&self.path, MntFlags::MNT_DETACH) {
            eprintln!("unmounting the run's tmpfs {}: {e}", self.path.display());
        }
    }
}

/// Bytes free for an unprivileged writer on the file system holding `path`.
fn free_bytes(path: &Path) -> Result<u64, String> {
    let st =
        nix::sys::statvfs::statvfs(path).map_err(|e| format!("statvfs {}: {e}", path.display()))?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

/// Fills the disk under `data` but [`LEFT_FREE`] for [`HOLD`], then frees it; answers how
/// much the balloon took (0: it was already that full).
pub async fn fill_for_a_while(data: &Path) -> Result<u64, String> {
    let balloon = data.join("balloon");
    let take = free_bytes(data)?.saturating_sub(LEFT_FREE);
    if take > 0 {
        let file =
            std::fs::File::create(&balloon).map_err(|e| format!("{}: {e}", balloon.display()))?;
        if let Err(e) =
            nix::fcntl::fallocate(&file, nix::fcntl::FallocateFlags::empty(), 0, take as i64)
        {
            let _ = std::fs::remove_file(&balloon);
            return Err(format!(
                "fallocate {take} bytes in {}: {e}",
                balloon.display()
            ));
        }
    }
    tokio::time::sleep(HOLD).await;
    std::fs::remove_file(&balloon)
        .or_else(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Ok(())
            } else {
                Err(e)
            }
        })
        .map_err(|e| format!("removing {}: {e}", balloon.display()))?;
    Ok(take)
}

/// Copies the regular files under `data` (the store, the records, every log) to `to`, at most
/// [`EVIDENCE_LIMIT`] bytes in all, for a failed run's message: the tmpfs goes with the run.
pub fn keep_evidence(data: &Path, to: &Path) {
    let mut budget = EVIDENCE_LIMIT;
    let mut stack = vec![(data.to_path_buf(), to.to_path_buf(), 0usize)];
    while let Some((from, into, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&from) else {
            continue;
        };
        let _ = std::fs::create_dir_all(&into);
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            let target = into.join(entry.file_name());
            if kind.is_dir() && depth < 8 {
                stack.push((entry.path(), target, depth + 1));
            } else if kind.is_file() {
                let size = entry.metadata().map_or(u64::MAX, |m| m.len());
                if size <= budget && std::fs::copy(entry.path(), &target).is_ok() {
                    budget -= size;
                }
            }
        }
    }
}
