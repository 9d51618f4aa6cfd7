//! An image's base disk: its layers as one read-only ext4 filesystem, built once per manifest
//! digest at `<state_dir>/bases/<hex>-<build>.ext4` (`<hex>.current` names the image's current
//! one), the backing file of every sandbox's root disk (`root.qcow2`, copy-on-write) of that
//! image. Host root's, mode 0444, in a 0700 directory.
//!
//! **Why ext4 made by `mkfs.ext4 -d`** (e2fsprogs): the guest's kernel already mounts ext4
//! for `/sandbox`, so no module is added; `-d` fills the filesystem from a directory in one
//! pass, with owners, modes, hard links, devices and timestamps; the root is read-write in
//! the guest through its qcow2 layer, which erofs and squashfs (read-only filesystems) would
//! need an overlay in the guest for. The file is sparse: its free space (`free_mib`, room
//! for what the sandbox writes to its root) costs nothing until written, and then only in
//! the sandbox's own qcow2.
//!
//! **How.** The layers are unpacked in the image store with their owners shifted to the
//! store's id map (host uid 200000 + N). In a mount namespace of its own (nothing is seen by
//! the host, and the mount goes when the build ends, however it ends), the build mounts them
//! as one read-only overlay (whiteouts applied, as a container sees them) and runs
//! `mkfs.ext4 -d` on it inside a user namespace mapping the store's ids back to 0..65536: what
//! mkfs reads as each file's owner is then the image's own, so the disk holds the image's
//! uids, not the host's. Both the overlay and the disk file are handed to it as descriptors
//! (`/proc/self/fd/N`), so nothing in the driver's private state directory is walked by it.
//!
//! **Never half-used, never replaced under a sandbox.** The disk is built under a temporary
//! name, checked with `e2fsck -fn`, synced and renamed to a name of its own build, and only
//! then does the image's pointer name it; a build killed halfway leaves only a temporary
//! file, which a later build removes. A base is checked again (`e2fsck -fn`) the first time a
//! driver process uses it; one missing or damaged gets a new build, and the pointer moves to
//! it. The old file is left where it is: sandboxes made on it have their roots over it.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};

use sbx_driver_api::DriverError;
use sbx_host_kit::{internal, locked};
use sbx_images::{IdMap, ImageInfo, ImageStore};

/// The bases of one driver, and which were checked by this process.
#[derive(Debug)]
pub struct Bases {
    dir: PathBuf,
    /// The current base of each image this process has checked.
    checked: Mutex<HashMap<String, PathBuf>>,
    /// Free space in a new base, in MiB.
    free_mib: u64,
}

/// What a build took, for logs and the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Made {
    /// The base was there and sound.
    Found,
    /// It was built now (first use of the image, or the old one was damaged).
    Built,
}

impl Bases {
    pub fn new(state_dir: &Path, free_mib: u64) -> Result<Bases, DriverError> {
        let dir = state_dir.join("bases");
        std::fs::create_dir_all(&dir).map_err(|e| internal("making the bases directory", e))?;
        // Host root's alone: a base is the root filesystem of every VM of its image.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| internal("making the bases directory private", e))?;
        Ok(Bases {
            dir,
            checked: Mutex::new(HashMap::new()),
            free_mib,
        })
    }

    /// The file naming the image's current base (`<hex>.current`).
    fn pointer(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        self.dir.join(format!("{hex}.current"))
    }

    /// The image's current base, as its pointer names it (a base of this image's, in this
    /// directory).
    fn current(&self, digest: &str) -> Option<PathBuf> {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        let name = std::fs::read_to_string(self.pointer(digest)).ok()?;
        let name = name.trim();
        let ok =
            name.starts_with(&format!("{hex}-")) && name.ends_with(".ext4") && !name.contains('/');
        ok.then(|| self.dir.join(name))
    }

    /// The image's base, built first when it is missing or damaged. Blocking (seconds for a
    /// large image): call it off the async threads. Builds of one image wait for each other.
    /// A base is never replaced in place: sandboxes' roots are copy-on-write over the very
    /// file they were made on, so a new build gets a name of its own and the pointer moves.
    pub fn ensure(
        &self,
        store: &ImageStore,
        info: &ImageInfo,
    ) -> Result<(PathBuf, Made), DriverError> {
        if let Some(path) = locked(&self.checked).get(&info.digest)
            && path.is_file()
        {
            return Ok((path.clone(), Made::Found));
        }
        let lock_path = self.pointer(&info.digest).with_extension("lock");
        let lock_file = File::create(&lock_path).map_err(|e| internal("the base's lock", e))?;
        let _lock = Flock::lock(lock_file, FlockArg::LockExclusive)
            .map_err(|(_, e)| internal("locking the base", e))?;
        if let Some(path) = self.current(&info.digest) {
            match path.is_file().then(|| fsck(&path)) {
                Some(Ok(())) => {
                    locked(&self.checked).insert(info.digest.clone(), path.clone());
                    return Ok((path, Made::Found));
                }
                Some(Err(why)) => {
                    tracing::warn!(base = %path.display(), %why, "a damaged base disk: new sandboxes get a new one");
                }
                None => {
                    tracing::warn!(base = %path.display(), "a missing base disk is built again");
                }
            }
        }
        self.remove_leftovers();
        let tmp = self
            .dir
            .join(format!("tmp-{}.ext4", uuid::Uuid::new_v4().simple()));
        let built = self.build(store, info, &tmp);
        if let Err(e) = built {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        let hex = info.digest.strip_prefix("sha256:").unwrap_or(&info.digest);
        let name = format!("{hex}-{}.ext4", uuid::Uuid::new_v4().simple());
        let path = self.dir.join(&name);
        std::fs::rename(&tmp, &path).map_err(|e| internal("placing the base disk", e))?;
        sbx_host_kit::records::write_atomically(&self.pointer(&info.digest), name.as_bytes())
            .map_err(|e| internal("naming the image's base disk", e))?;
        locked(&self.checked).insert(info.digest.clone(), path.clone());
        Ok((path, Made::Built))
    }

    /// At open, before any create: removes each base no sandbox's root is over (`in_use`)
    /// that is either superseded (no longer its image's current) or of an image the store no
    /// longer holds (deleted or pruned: a create of it pulls it again and builds anew), and
    /// the pointer and lock of an image whose current base went. Nothing creates or reads a
    /// base while the driver opens, so no create loses its base to this; a base of an image
    /// still in the store stays (the next create of it needs no build). Answers the files
    /// removed and the bytes they took on disk (they are sparse).
    pub fn collect_unused(
        &self,
        in_use: &HashSet<PathBuf>,
        store: Option<&ImageStore>,
    ) -> (usize, u64) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return (0, 0);
        };
        let (mut files, mut bytes) = (0, 0);
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some((hex, _build)) = name
                .strip_suffix(".ext4")
                .and_then(|stem| stem.split_once('-'))
                .filter(|(hex, _)| hex.len() == 64 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            else {
                continue;
            };
            let path = self.dir.join(&name);
            if in_use.contains(&path) {
                continue;
            }
            let digest = format!("sha256:{hex}");
            let superseded = self.current(&digest).as_ref() != Some(&path);
            let gone = store.is_some_and(|s| {
                matches!(s.get(&digest), Err(sbx_images::ImageError::NotFound { .. }))
            });
            if !superseded && !gone {
                continue;
            }
            let taken = entry.metadata().map(|m| m.blocks() * 512).unwrap_or(0);
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    files += 1;
                    bytes += taken;
                    if !superseded {
                        let _ = std::fs::remove_file(self.pointer(&digest));
                        let _ = std::fs::remove_file(self.pointer(&digest).with_extension("lock"));
                    }
                    tracing::info!(base = %path.display(), superseded, image_gone = gone, "an unused base disk removed");
                }
                Err(e) => tracing::warn!(base = %path.display(), "an unused base disk stays: {e}"),
            }
        }
        (files, bytes)
    }

    /// Temporary files and mount points of builds that did not finish (a driver killed
    /// mid-build). Only while holding some base's lock: another build may be under way for
    /// another image, so only what is older than an hour goes.
    fn remove_leftovers(&self) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        for entry in entries.flatten() {
            let name = entry.file_name();
            let name = name.to_string_lossy();
            let old = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t < hour_ago);
            if old && name.starts_with("tmp-") {
                let _ = std::fs::remove_file(entry.path());
                let _ = std::fs::remove_dir(entry.path());
            }
        }
    }

    fn build(&self, store: &ImageStore, info: &ImageInfo, tmp: &Path) -> Result<(), DriverError> {
        let layers = store.layer_dirs(info);
        let (bytes, entries) = measure(&layers);
        // The filesystem's own overhead (inode tables, journal, directories) on top of the
        // files, then the free space; sparse, so only what mkfs writes takes room.
        let size = bytes + bytes / 5 + entries * 512 + (64 << 20) + (self.free_mib << 20);
        let size = size.div_ceil(1 << 20) << 20;
        let inodes = entries + 65_536;
        let file = File::create(tmp).map_err(|e| internal("making the base disk", e))?;
        file.set_len(size)
            .map_err(|e| internal("sizing the base disk", e))?;
        let ids = store.idmap();
        // mkfs runs as the store's root (in its user namespace): the file must be that
        // user's to open again through /proc/self/fd.
        nix::unistd::chown(
            tmp,
            Some(nix::unistd::Uid::from_raw(ids.host_uid)),
            Some(nix::unistd::Gid::from_raw(ids.host_gid)),
        )
        .map_err(|e| internal("handing the base disk to the build", e))?;
        drop(file);
        let mountpoint = self
            .dir
            .join(format!("tmp-mnt-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir(&mountpoint).map_err(|e| internal("making a mount point", e))?;
        let empty = self.dir.join("empty");
        std::fs::create_dir_all(&empty).map_err(|e| internal("making an empty layer", e))?;
        let result = run_mkfs(&layers, &empty, &mountpoint, tmp, ids, inodes);
        let _ = std::fs::remove_dir(&mountpoint);
        result?;
        fsck(tmp).map_err(|why| {
            DriverError::Internal(format!(
                "the base disk of image {} failed its check after the build: {why}",
                info.digest
            ))
        })?;
        // Host root's, read-only: mkfs wrote it as the store's root (host uid 200000, which is
        // the host side of other sandboxes' root).
        nix::unistd::chown(
            tmp,
            Some(nix::unistd::Uid::from_raw(0)),
            Some(nix::unistd::Gid::from_raw(0)),
        )
        .map_err(|e| internal("handing the base disk back to root", e))?;
        std::fs::set_permissions(tmp, std::fs::Permissions::from_mode(0o444))
            .map_err(|e| internal("making the base disk read-only", e))?;
        File::open(tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| internal("syncing the base disk", e))
    }
}

/// The bytes the layers' files take and how many entries they hold (an upper bound of the
/// merged tree's: a file replaced in a higher layer counts twice).
/// The base disk a sandbox's `root.qcow2` (made by an earlier version, whose record did not
/// say) is over, from the qcow2's header: its backing file's name, taken only if it is a
/// regular file directly in `bases` (the header was written by `qemu-img` and, since, by a
/// QEMU that ran as host root: read once, at open, and recorded; never again, now that the
/// guest's QEMU, another user, writes the file).
pub fn backing_of(root: &Path, bases: &Path) -> Option<PathBuf> {
    use std::io::{Read, Seek, SeekFrom};
    let mut file = File::open(root).ok()?;
    let mut header = [0u8; 20];
    file.read_exact(&mut header).ok()?;
    if header[..4] != *b"QFI\xfb" {
        return None;
    }
    let offset = u64::from_be_bytes(header[8..16].try_into().ok()?);
    let size = u32::from_be_bytes(header[16..20].try_into().ok()?);
    if offset == 0 || size == 0 || size > 1023 {
        return None;
    }
    let mut name = vec![0u8; size as usize];
    file.seek(SeekFrom::Start(offset)).ok()?;
    file.read_exact(&mut name).ok()?;
    let path = PathBuf::from(String::from_utf8(name).ok()?);
    let file_name = path.file_name()?;
    let meta = std::fs::symlink_metadata(bases.join(file_name)).ok()?;
    (path.parent() == Some(bases) && meta.is_file()).then(|| bases.join(file_name))
}

fn measure(layers: &[PathBuf]) -> (u64, u64) {
    let (mut bytes, mut entries) = (0u64, 0u64);
    let mut stack: Vec<PathBuf> = layers.to_vec();
    // Bounded by the layers' own size: each entry is visited once.
    while let Some(dir) = stack.pop() {
        let Ok(read) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in read.flatten() {
            let Ok(meta) = entry.metadata() else {
                continue;
            };
            entries += 1;
            bytes += meta.blocks() * 512;
            if meta.is_dir() {
                stack.push(entry.path());
            }
        }
    }
    (bytes, entries)
}

/// The build itself: the overlay in a mount namespace of its own, mkfs in a user namespace
/// that maps the store's ids back (see the module docs).
fn run_mkfs(
    layers: &[PathBuf],
    empty: &Path,
    mountpoint: &Path,
    disk: &Path,
    ids: IdMap,
    inodes: u64,
) -> Result<(), DriverError> {
    // Highest first, as overlayfs lists them, by name relative to the layers' directory (the
    // mount options fit a page); an empty one last, so that one layer is an overlay too.
    let Some(parent) = layers.first().and_then(|l| l.parent()) else {
        return Err(DriverError::InvalidArgument(
            "the image has no layers".to_string(),
        ));
    };
    let mut lower: Vec<String> = layers
        .iter()
        .rev()
        .map(|l| {
            l.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .collect();
    lower.push(empty.display().to_string());
    let users = format!("{},0,{}", ids.host_uid, ids.size);
    let groups = format!("{},0,{}", ids.host_gid, ids.size);
    const SCRIPT: &str = r#"set -e
cd "$1"
mount -t overlay -o "ro,lowerdir=$2" sbx-base "$3"
exec 3< "$3"
exec 4<> "$4"
cd /
exec unshare --user --map-users="$5" --map-groups="$6" --setuid 0 --setgid 0 \
  mkfs.ext4 -q -F -L root -N "$7" -E lazy_itable_init=1,lazy_journal_init=1 \
  -d /proc/self/fd/3 /proc/self/fd/4
"#;
    let out = Command::new("unshare")
        .args([
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            SCRIPT,
            "sh",
        ])
        .arg(parent)
        .arg(lower.join(":"))
        .arg(mountpoint)
        .arg(disk)
        .arg(users)
        .arg(groups)
        .arg(inodes.to_string())
        .stdin(Stdio::null())
        .output()
        .map_err(|e| internal("running unshare for the base disk's build", e))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(DriverError::Internal(format!(
            "building the base disk failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )))
    }
}

/// `e2fsck -fn`: a full check that changes nothing.
fn fsck(disk: &Path) -> Result<(), String> {
    let out = Command::new("e2fsck")
        .args(["-f", "-n"])
        .arg(disk)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("running e2fsck: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        let text = String::from_utf8_lossy(&out.stdout);
        let tail: String = text.lines().rev().take(3).collect::<Vec<_>>().join("; ");
        Err(format!("e2fsck -fn said {} ({tail})", out.status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Built once with the image's own owners; found again; built anew when the file is
    /// missing or damaged, never used as it is. Needs root (the user namespace's map) and
    /// e2fsprogs, as the driver does.
    #[test]
    fn a_base_is_built_with_the_images_owners_and_rebuilt_when_missing_or_damaged() {
        let tmp = tempfile::tempdir().unwrap();
        let store = ImageStore::open(tmp.path().join("images"), IdMap::default()).unwrap();
        let busybox = sbx_images::find_static_busybox(None, &sbx_images::BUSYBOX_PATHS)
            .expect("busybox-static");
        let info = store
            .import_busybox(&busybox, "sbx.local/busybox:latest")
            .unwrap();
        let state = tmp.path().join("vm");
        let bases = Bases::new(&state, 16).unwrap();
        let (path, made) = bases.ensure(&store, &info).unwrap();
        assert_eq!(made, Made::Built);
        // The store's layer is owned by its shifted root (200000); the disk by the image's.
        let stat = Command::new("debugfs")
            .args(["-R", "stat /bin/busybox"])
            .arg(&path)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&stat.stdout);
        assert!(text.contains("User:     0   Group:     0"), "{text}");
        assert_eq!(bases.ensure(&store, &info).unwrap().1, Made::Found);
        // A new driver process checks it before use: sound, found.
        let again = Bases::new(&state, 16).unwrap();
        assert_eq!(again.ensure(&store, &info).unwrap().1, Made::Found);
        // Damaged (its superblock overwritten): built anew, and sound.
        {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
            f.seek(SeekFrom::Start(1024)).unwrap();
            f.write_all(&[0xff; 1024]).unwrap();
        }
        let again = Bases::new(&state, 16).unwrap();
        assert!(fsck(&path).is_err(), "the damage is seen");
        let (rebuilt, made) = again.ensure(&store, &info).unwrap();
        assert_eq!(made, Made::Built);
        assert_ne!(rebuilt, path, "a new build, not the old file replaced");
        assert!(
            path.is_file(),
            "the old file stays for the sandboxes made on it"
        );
        assert!(fsck(&rebuilt).is_ok());
        // Missing: built anew.
        std::fs::remove_file(&rebuilt).unwrap();
        let again = Bases::new(&state, 16).unwrap();
        let (third, made) = again.ensure(&store, &info).unwrap();
        assert_eq!(made, Made::Built);
        // Host root's and read-only, in a private directory.
        let meta = std::fs::metadata(&third).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o777), (0, 0o444));
        let dir = std::fs::metadata(state.join("bases")).unwrap();
        assert_eq!(dir.mode() & 0o777, 0o700);
        // No temporary file or mount point is left.
        let left: Vec<_> = std::fs::read_dir(state.join("bases"))
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("tmp-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");

        // Collected at open: the damaged build (superseded) unless a sandbox is over it; the
        // current one while its image is in the store; then that too once the image is gone,
        // its pointer with it.
        let bases_now = |dir: &Path| -> Vec<PathBuf> {
            let mut all: Vec<PathBuf> = std::fs::read_dir(dir)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "ext4"))
                .collect();
            all.sort();
            all
        };
        let dir = state.join("bases");
        assert_eq!(bases_now(&dir).len(), 2, "{:?}", bases_now(&dir));
        let opened = Bases::new(&state, 16).unwrap();
        let used: HashSet<PathBuf> = [path.clone()].into();
        assert_eq!(opened.collect_unused(&used, Some(&store)).0, 0);
        assert!(path.is_file(), "a sandbox is over it");
        let (files, bytes) = opened.collect_unused(&HashSet::new(), Some(&store));
        assert_eq!(files, 1, "the damaged one, superseded and now nobody's");
        assert!(bytes > 0);
        assert_eq!(
            bases_now(&dir),
            vec![third.clone()],
            "the current one stays"
        );
        store.remove_unreferenced(&[]).unwrap();
        let (files, _) = opened.collect_unused(&HashSet::new(), Some(&store));
        assert_eq!(files, 1, "its image is gone");
        assert!(bases_now(&dir).is_empty());
        assert!(!opened.pointer(&info.digest).exists());
    }
}
