//! Files as tar, both ways, named the way `docker cp` names them: a copy of `SRC` is a tar
//! whose entries are rooted at `SRC`'s own name, and unpacking it at `DEST` puts that root
//! *inside* `DEST` when `DEST` is a directory that exists, else *as* `DEST` (the root renamed).
//!
//! Packing keeps file modes (0750 stays 0750), modification times, symlinks as symlinks
//! (never followed). Unpacking comes in two kinds, one per direction of a copy:
//!
//! - [`unpack`] trusts the archive's modes and types: the agent's copy *in* (the operator's
//!   files, unpacked inside the sandbox as the sandbox's root), where every mode bit the
//!   operator set is kept.
//! - [`unpack_untrusted`] is the receiving side of a copy *out* (`sbx sandbox cp NAME:PATH
//!   DEST`, often run as root, as in the README's tour), where the sender is the sandbox and
//!   may be hostile: its agent can be replaced, and the tar be anything. It keeps what
//!   `tar --no-same-owner --no-same-permissions` keeps: the owner, group and other bits less
//!   the caller's umask — no setuid, setgid or sticky bit ([`Modes::Umask`]), or with
//!   [`Modes::Preserve`] the archive's bits, but setuid and setgid dropped whenever the
//!   process's euid or egid is 0 (never a setuid-root program across the boundary). It makes
//!   files, directories, symlinks and hard links only: device nodes and FIFOs are skipped and
//!   counted ([`Unpacked::skipped`]; tar has no socket type), as are entries of a type it
//!   does not know (tar 0.4 would write those, and devices and FIFOs, as regular files with
//!   their modes). A hard link is made only to a regular file this same copy wrote, its
//!   target resolved inside the destination and never through a symlink: tar's own
//!   `Entry::unpack` takes a hard link's target as a path of the unpacking host (`/etc/shadow`
//!   as it is), which linked any host file into the destination.
//!
//! Ownership is never kept: files belong to whoever unpacks.
//!
//! Unpacking refuses any entry that would leave `DEST`: an absolute path, a `..`, or a path
//! through a symlink (one already there or one the archive made earlier) — so a hostile
//! archive cannot write outside the destination, on either side of a copy.
//!
//! Memory: an untrusted unpacking remembers each file it wrote as a (device, inode) pair, the
//! targets a hard link may have: 16 bytes (about 32 in the set) per file, against at least 512
//! bytes of the stream per entry.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Component, Path, PathBuf};

/// Writes `path` (a file, a symlink or a directory tree) to `out` as a tar rooted at its name.
pub fn pack(path: &Path, out: impl Write) -> io::Result<()> {
    let meta = std::fs::symlink_metadata(path)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    let name = path
        .file_name()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    let mut builder = tar::Builder::new(out);
    builder.follow_symlinks(false);
    builder.mode(tar::HeaderMode::Complete);
    if meta.is_dir() {
        builder.append_dir_all(&name, path)?;
    } else {
        builder.append_path_with_name(path, &name)?;
    }
    builder.into_inner()?.flush()
}

fn refused(what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, what.to_string())
}

/// What [`unpack_untrusted`] keeps of each entry's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Modes {
    /// As `tar --no-same-permissions`: the owner, group and other bits (0777) less the
    /// process's umask; never a setuid, setgid or sticky bit.
    #[default]
    Umask,
    /// As `tar --same-permissions` (`sbx sandbox cp --preserve`): every bit the archive says,
    /// the umask not applied, but setuid and setgid dropped whenever the process's euid or
    /// egid is 0.
    Preserve,
}

impl Modes {
    /// Whether the bits above 0777 are kept, and the bits then cleared, for a process whose
    /// umask is `umask` and whose euid or egid is 0 when `privileged`.
    fn mask(self, umask: u32, privileged: bool) -> (bool, u32) {
        match self {
            Modes::Umask => (false, umask & 0o777),
            Modes::Preserve if privileged => (true, 0o6000),
            Modes::Preserve => (true, 0),
        }
    }
}

/// What [`unpack_untrusted`] did: the entries it made, and those it skipped by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Unpacked {
    /// Files, directories, symlinks and hard links made.
    pub entries: u64,
    /// Entries skipped, by kind: a copy out makes none of them.
    pub char_devices: u64,
    pub block_devices: u64,
    pub fifos: u64,
    /// Entries of a type not made here (GNU volume headers, type flags tar does not know).
    pub others: u64,
}

impl Unpacked {
    /// What was skipped, as "1 character device, 2 FIFOs", or `None` when nothing was.
    pub fn skipped(&self) -> Option<String> {
        let said: Vec<String> = [
            (self.char_devices, "character device", "character devices"),
            (self.block_devices, "block device", "block devices"),
            (self.fifos, "FIFO", "FIFOs"),
            (
                self.others,
                "entry of another type",
                "entries of other types",
            ),
        ]
        .into_iter()
        .filter(|(n, ..)| *n > 0)
        .map(|(n, one, many)| format!("{n} {}", if n == 1 { one } else { many }))
        .collect();
        (!said.is_empty()).then(|| said.join(", "))
    }
}

/// Unpacks the tar from `input` at `dest` (see the module docs for where its root goes),
/// trusting it: every mode bit as the archive says, every entry as tar unpacks it (the
/// agent's copy in, inside the sandbox). Returns how many entries were unpacked.
pub fn unpack(input: impl Read, dest: &Path) -> io::Result<u64> {
    unpack_at(input, dest, None).map(|done| done.entries)
}

/// Unpacks the tar from `input` at `dest` as the receiving side of a copy out, whose sender
/// may be hostile (see the module docs): modes as `modes` says, owners the caller's, no
/// device node or FIFO, hard links only to files of the same copy.
pub fn unpack_untrusted(input: impl Read, dest: &Path, modes: Modes) -> io::Result<Unpacked> {
    let privileged = rustix::process::geteuid().is_root() || rustix::process::getegid().is_root();
    let (preserve, mask) = modes.mask(process_umask(), privileged);
    let untrusted = Untrusted {
        preserve,
        mask,
        files: HashSet::new(),
    };
    unpack_at(input, dest, Some(untrusted))
}

/// The process's umask: `/proc/self/status` says it without changing it (Linux 4.7 and
/// later); else umask(2) is set to 0o077 and back (a file another thread makes in between
/// gets a stricter mask, never a looser one).
fn process_umask() -> u32 {
    let said = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find_map(|l| l.strip_prefix("Umask:"))
                .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        });
    said.unwrap_or_else(|| {
        use rustix::fs::Mode;
        let old = rustix::process::umask(Mode::from_raw_mode(0o077));
        rustix::process::umask(old);
        old.as_raw_mode()
    })
}

/// How an untrusted unpacking goes: the modes it sets, and the files it wrote.
struct Untrusted {
    /// Keep the bits above 0777 (then less `mask`).
    preserve: bool,
    mask: u32,
    /// (device, inode) of every regular file this copy wrote: the only targets a hard link
    /// may have.
    files: HashSet<(u64, u64)>,
}

/// `path`, an entry's name or a hard link's target in the archive, as a path below the
/// destination's root, the archive's root renamed to `rename` when given; `None` when it
/// would leave the root (absolute, `..`).
fn below_root(path: &Path, rename: Option<&OsStr>) -> Option<PathBuf> {
    let mut rel = PathBuf::new();
    for component in path.components() {
        match component {
            Component::Normal(part) => rel.push(part),
            Component::CurDir => {}
            _ => return None,
        }
    }
    if let Some(name) = rename {
        let mut parts = rel.components();
        let _root = parts.next();
        let rest = parts.as_path();
        // The archive's root itself (or "."): it becomes the new name.
        rel = if rest.as_os_str().is_empty() {
            PathBuf::from(name)
        } else {
            Path::new(name).join(rest)
        };
    }
    Some(rel)
}

/// Checks that no ancestor of `rel` below `root` is a symlink (going through one could land
/// anywhere); missing ones are made when `make`, else the walk ends there (nothing below a
/// missing directory exists). `entry` names the archive entry in the refusal.
fn walk_ancestors(root: &Path, rel: &Path, entry: &Path, make: bool) -> io::Result<()> {
    let mut walked = root.to_path_buf();
    let parts: Vec<_> = rel.components().collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        walked.push(part);
        match std::fs::symlink_metadata(&walked) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(refused(format!(
                    "refusing the archive entry {}: {} is a symlink",
                    entry.display(),
                    walked.display()
                )));
            }
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound && make => {
                std::fs::create_dir_all(&walked)?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Unpacks at `dest`, trusting the archive when `untrusted` is `None`.
fn unpack_at(
    input: impl Read,
    dest: &Path,
    mut untrusted: Option<Untrusted>,
) -> io::Result<Unpacked> {
    let (root, rename) = if dest.is_dir() {
        (dest.to_path_buf(), None)
    } else {
        let parent = match dest.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !parent.is_dir() {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: no such directory", parent.display()),
            ));
        }
        let name = dest
            .file_name()
            .ok_or_else(|| refused(format!("{}: not a name to copy to", dest.display())))?;
        (parent, Some(name.to_os_string()))
    };
    let mut archive = tar::Archive::new(input);
    let (preserve, mask) = untrusted
        .as_ref()
        .map_or((true, 0), |u| (u.preserve, u.mask));
    archive.set_preserve_permissions(preserve);
    archive.set_mask(mask);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    let mut dirs: Vec<(PathBuf, u64)> = Vec::new();
    let mut done = Unpacked::default();
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let rel = below_root(&path, rename.as_deref()).ok_or_else(|| {
            refused(format!(
                "refusing the archive entry {}: it leaves the destination",
                path.display()
            ))
        })?;
        if rel.as_os_str().is_empty() {
            // "." unpacked into an existing directory: that directory is already there.
            continue;
        }
        let kind = entry.header().entry_type();
        if untrusted.is_some() {
            use tar::EntryType as T;
            let skipped = match kind {
                T::Regular | T::Continuous | T::GNUSparse => None,
                T::Directory | T::Symlink | T::Link => None,
                // Metadata for the entries after it, not an entry.
                T::XGlobalHeader => continue,
                T::Char => Some(&mut done.char_devices),
                T::Block => Some(&mut done.block_devices),
                T::Fifo => Some(&mut done.fifos),
                _ => Some(&mut done.others),
            };
            if let Some(count) = skipped {
                *count += 1;
                continue;
            }
        }
        // No ancestor of the target (below the root) may be a symlink: writing through one
        // could land anywhere.
        walk_ancestors(&root, &rel, &path, true)?;
        let target = root.join(&rel);
        // A directory over a symlink would be entered through it by the entries after it
        // (tar itself refuses it, as "File exists"): say why.
        if kind.is_dir()
            && std::fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_symlink())
        {
            return Err(refused(format!(
                "refusing the archive entry {}: {} is a symlink",
                path.display(),
                target.display()
            )));
        }
        if kind.is_dir() {
            dirs.push((target.clone(), entry.header().mtime().unwrap_or(0)));
        }
        let located = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", target.display()));
        let file = kind.is_file()
            || (untrusted.is_some()
                && matches!(kind, tar::EntryType::Continuous | tar::EntryType::GNUSparse));
        if let Some(u) = untrusted.as_mut().filter(|_| kind.is_hard_link()) {
            link_inside(&entry, &path, &root, rename.as_deref(), &target, &u.files)?;
        } else if file {
            // A file is written under a name of its own beside its target and renamed there
            // once whole: a copy cut short (the client gone, its credential revoked) leaves no
            // half-written file under the name.
            let part = partial_name(&target);
            let written = match entry.unpack(&part) {
                Ok(tar::Unpacked::File(f)) => f.metadata().ok().map(|m| (m.dev(), m.ino())),
                // An old header's name ending in '/': a directory, as tar reads it.
                Ok(_) => None,
                Err(e) => {
                    let _ = std::fs::remove_file(&part);
                    return Err(located(e));
                }
            };
            std::fs::rename(&part, &target).map_err(|e| {
                let _ = std::fs::remove_file(&part);
                located(e)
            })?;
            if let (Some(u), Some(written)) = (untrusted.as_mut(), written) {
                u.files.insert(written);
            }
        } else {
            entry.unpack(&target).map_err(located)?;
        }
        done.entries += 1;
    }
    // A directory's time changes as entries land in it: set them last, deepest first.
    for (dir, mtime) in dirs.iter().rev() {
        let time = filetime::FileTime::from_unix_time(*mtime as i64, 0);
        let _ = filetime::set_symlink_file_times(dir, time, time);
    }
    Ok(done)
}

/// Makes the hard link `entry` (named `path` in the archive) at `target`, if its own target
/// is a regular file this copy wrote (in `files`), found below `root` through no symlink;
/// anything else is refused, naming the entry.
fn link_inside<R: Read>(
    entry: &tar::Entry<'_, R>,
    path: &Path,
    root: &Path,
    rename: Option<&OsStr>,
    target: &Path,
    files: &HashSet<(u64, u64)>,
) -> io::Result<()> {
    let why = |what: String| {
        refused(format!(
            "refusing the archive entry {}: {what}",
            path.display()
        ))
    };
    let link = entry
        .link_name()?
        .ok_or_else(|| why("a hard link to nothing".into()))?
        .into_owned();
    let from = below_root(&link, rename)
        .filter(|rel| !rel.as_os_str().is_empty())
        .ok_or_else(|| {
            why(format!(
                "its hard link to {} leaves the destination",
                link.display()
            ))
        })?;
    walk_ancestors(root, &from, path, false)?;
    let source = root.join(&from);
    let ours = std::fs::symlink_metadata(&source)
        .is_ok_and(|m| m.file_type().is_file() && files.contains(&(m.dev(), m.ino())));
    if !ours {
        return Err(why(format!(
            "its hard link to {} is not to a file of this copy",
            link.display()
        )));
    }
    let linked = std::fs::hard_link(&source, target).or_else(|e| {
        // As tar overwrites: what was there (not a directory) goes.
        if e.kind() == io::ErrorKind::AlreadyExists
            && std::fs::symlink_metadata(target).is_ok_and(|m| !m.is_dir())
        {
            std::fs::remove_file(target).and_then(|()| std::fs::hard_link(&source, target))
        } else {
            Err(e)
        }
    });
    linked.map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", target.display())))
}

/// Where a file bound for `target` is written until it is whole: `.NAME.sbx-part-PID-N` beside
/// it (a name no archive entry of this copy shares: entries land at their own names).
fn partial_name(target: &Path) -> PathBuf {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    target.with_file_name(format!(".{name}.sbx-part-{}-{n}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn tree(root: &Path) {
        std::fs::create_dir_all(root.join("d/sub")).unwrap();
        std::fs::write(root.join("d/secret"), b"0750 file").unwrap();
        std::fs::set_permissions(
            root.join("d/secret"),
            std::fs::Permissions::from_mode(0o750),
        )
        .unwrap();
        std::fs::write(root.join("d/sub/data"), vec![7u8; 100_000]).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("d/link")).unwrap();
        let old = filetime::FileTime::from_unix_time(1_000_000_000, 0);
        filetime::set_file_mtime(root.join("d/sub/data"), old).unwrap();
    }

    /// A tar cut in the middle of a file's data: an error, and nothing under the file's name
    /// (nor a part of it) is left; the file before it, whole, is.
    #[test]
    fn a_copy_cut_short_leaves_no_half_written_file() {
        let tmp = tempfile::tempdir().unwrap();
        // In this order: the small file whole, then the big one.
        let mut builder = tar::Builder::new(Vec::new());
        for (name, data) in [
            ("src/a-first", b"whole".to_vec()),
            ("src/b-big", vec![9u8; 200_000]),
        ] {
            let mut header = tar::Header::new_gnu();
            header.set_size(data.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, name, &data[..]).unwrap();
        }
        let tar = builder.into_inner().unwrap();
        let big_at = tar
            .windows(5)
            .position(|w| w == b"b-big")
            .expect("the big file's header");
        let cut = &tar[..big_at + 512 + 50_000];
        let dest = tmp.path().join("dest");
        std::fs::create_dir_all(&dest).unwrap();
        assert!(unpack(cut, &dest).is_err());
        let left: Vec<String> = std::fs::read_dir(dest.join("src"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(left, ["a-first"], "{left:?}");
        assert_eq!(std::fs::read(dest.join("src/a-first")).unwrap(), b"whole");
    }

    #[test]
    fn a_tree_round_trips_with_modes_times_and_symlinks() {
        let tmp = tempfile::tempdir().unwrap();
        tree(tmp.path());
        let mut tar = Vec::new();
        pack(&tmp.path().join("d"), &mut tar).unwrap();
        // Into an existing directory: under its own name.
        let into = tmp.path().join("into");
        std::fs::create_dir(&into).unwrap();
        unpack(&tar[..], &into).unwrap();
        let got = into.join("d");
        assert_eq!(std::fs::read(got.join("secret")).unwrap(), b"0750 file");
        assert_eq!(
            std::fs::metadata(got.join("secret")).unwrap().mode() & 0o7777,
            0o750
        );
        assert_eq!(
            std::fs::metadata(got.join("sub/data")).unwrap().mtime(),
            1_000_000_000
        );
        assert_eq!(
            std::fs::read_link(got.join("link")).unwrap(),
            Path::new("/etc/passwd")
        );
        // To a new name: the root renamed.
        let renamed = tmp.path().join("renamed");
        unpack(&tar[..], &renamed).unwrap();
        assert_eq!(
            std::fs::read(renamed.join("sub/data")).unwrap().len(),
            100_000
        );
        // A file to a new name.
        let mut one = Vec::new();
        pack(&tmp.path().join("d/secret"), &mut one).unwrap();
        unpack(&one[..], &tmp.path().join("copy")).unwrap();
        assert_eq!(
            std::fs::read(tmp.path().join("copy")).unwrap(),
            b"0750 file"
        );
    }

    fn hostile(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(*kind);
            h.set_mode(0o644);
            if *kind == tar::EntryType::Symlink {
                h.set_size(0);
                b.append_link(&mut h, path, data).unwrap();
            } else {
                h.set_size(data.len() as u64);
                // Bypass the builder's own path checks: write the name bytes raw.
                let name = h.as_old_mut().name.as_mut();
                name[..path.len()].copy_from_slice(path.as_bytes());
                h.set_cksum();
                b.append(&h, data.as_bytes()).unwrap();
            }
        }
        b.into_inner().unwrap()
    }

    #[test]
    fn entries_that_leave_the_destination_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let dest = tmp.path().join("dest");
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&dest).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let dotdot = hostile(&[("a/../../outside/x", tar::EntryType::Regular, "escaped")]);
        assert!(unpack(&dotdot[..], &dest).is_err());
        // A symlink to outside, then a file written through it.
        let through = hostile(&[
            ("evil", tar::EntryType::Symlink, outside.to_str().unwrap()),
            ("evil/x", tar::EntryType::Regular, "escaped"),
        ]);
        let err = unpack(&through[..], &dest).unwrap_err();
        assert!(err.to_string().contains("symlink"), "{err}");
        assert!(!outside.join("x").exists());
        // A symlink already in the destination is not followed either.
        std::os::unix::fs::symlink(&outside, dest.join("planted")).unwrap();
        let planted = hostile(&[("planted/y", tar::EntryType::Regular, "escaped")]);
        assert!(unpack(&planted[..], &dest).is_err());
        assert!(!outside.join("y").exists());
        // Nor is a directory entry unpacked over it.
        let over = hostile(&[("planted", tar::EntryType::Directory, "")]);
        let err = unpack(&over[..], &dest).unwrap_err();
        assert!(err.to_string().contains("is a symlink"), "{err}");
    }

    /// One entry of a crafted archive: its path and link name are written raw (past the tar
    /// crate's own checks), with the mode and owner given.
    struct Crafted<'a> {
        path: &'a str,
        kind: tar::EntryType,
        mode: u32,
        /// A file's content, or a link's target.
        data: &'a str,
        uid: u64,
    }

    fn entry<'a>(path: &'a str, kind: tar::EntryType, mode: u32, data: &'a str) -> Crafted<'a> {
        Crafted {
            path,
            kind,
            mode,
            data,
            uid: 0,
        }
    }

    fn crafted(entries: &[Crafted]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for e in entries {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(e.kind);
            h.set_mode(e.mode);
            h.set_uid(e.uid);
            h.set_gid(e.uid);
            h.set_mtime(1_000_000_000);
            let name = h.as_old_mut().name.as_mut();
            name[..e.path.len()].copy_from_slice(e.path.as_bytes());
            let data = if e.kind.is_symlink() || e.kind.is_hard_link() {
                h.set_link_name_literal(e.data).unwrap();
                ""
            } else {
                e.data
            };
            if matches!(e.kind, tar::EntryType::Char | tar::EntryType::Block) {
                h.set_device_major(5).unwrap();
                h.set_device_minor(1).unwrap();
            }
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data.as_bytes()).unwrap();
        }
        b.into_inner().unwrap()
    }

    /// Asserts `path`'s permission bits (shown in octal).
    fn assert_mode(path: &Path, want: u32, what: &str) {
        let got = std::fs::symlink_metadata(path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .mode()
            & 0o7777;
        assert_eq!(format!("{got:o}"), format!("{want:o}"), "{what}");
    }

    /// A file only root may read, outside the destination: what a hard link must not reach.
    fn root_only(path: &Path) {
        std::fs::write(path, b"root only").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }

    /// A copy out as root makes no setuid program, no setgid or sticky directory: the owner,
    /// group and other bits, less the umask, as `tar --no-same-permissions` does. The agent's
    /// own unpacking (a copy in, inside the sandbox) keeps every bit, as before.
    #[test]
    fn a_copy_out_drops_setuid_setgid_and_sticky_bits_and_applies_the_umask() {
        let tmp = tempfile::tempdir().unwrap();
        let tar = crafted(&[
            entry("d", tar::EntryType::Directory, 0o2777, ""),
            entry("d/sh", tar::EntryType::Regular, 0o4755, "#!/bin/sh\n"),
            entry("d/group", tar::EntryType::Regular, 0o2777, "g"),
            entry("d/tmp", tar::EntryType::Directory, 0o1777, ""),
        ]);
        let umask = process_umask();
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        unpack_untrusted(&tar[..], &out, Modes::Umask).unwrap();
        for (rel, archived) in [
            ("d/sh", 0o4755),
            ("d/group", 0o2777),
            ("d/tmp", 0o1777),
            ("d", 0o2777),
        ] {
            assert_mode(
                &out.join(rel),
                archived & 0o777 & !umask,
                &format!("{rel} (archived {archived:o}, umask {umask:o})"),
            );
        }
        // The agent's unpack, unchanged: the operator's modes, every bit.
        let agent = tmp.path().join("agent");
        std::fs::create_dir(&agent).unwrap();
        unpack(&tar[..], &agent).unwrap();
        assert_mode(&agent.join("d/sh"), 0o4755, "the agent's d/sh");
        assert_mode(&agent.join("d/tmp"), 0o1777, "the agent's d/tmp");
    }

    /// `--preserve` keeps the archive's bits (a 0666 file stays 0666 whatever the umask, a
    /// sticky directory stays sticky) but never setuid-root or setgid-root: setuid and setgid
    /// go when the process's euid or egid is 0.
    #[test]
    fn preserve_keeps_modes_but_no_setuid_or_setgid_for_root() {
        let tmp = tempfile::tempdir().unwrap();
        let meta = std::fs::metadata(tmp.path()).unwrap();
        let privileged = meta.uid() == 0 || meta.gid() == 0;
        let tar = crafted(&[
            entry("d", tar::EntryType::Directory, 0o2775, ""),
            entry("d/sh", tar::EntryType::Regular, 0o4755, "#!/bin/sh\n"),
            entry("d/open", tar::EntryType::Regular, 0o666, "anyone"),
            entry("d/tmp", tar::EntryType::Directory, 0o1777, ""),
        ]);
        let out = tmp.path().join("out");
        unpack_untrusted(&tar[..], &out, Modes::Preserve).unwrap();
        let (sh, dir) = if privileged {
            (0o755, 0o775)
        } else {
            (0o4755, 0o2775)
        };
        let who = format!("privileged: {privileged}");
        assert_mode(&out.join("sh"), sh, &format!("a setuid file, {who}"));
        assert_mode(&out, dir, &format!("a setgid directory, {who}"));
        assert_mode(&out.join("open"), 0o666, "a 0666 file");
        assert_mode(&out.join("tmp"), 0o1777, "a sticky directory");
    }

    /// What `--preserve` clears, for a caller who is root and one who is not (the tests run
    /// as one of them only).
    #[test]
    fn preserve_clears_setuid_and_setgid_only_for_root() {
        assert_eq!(Modes::Preserve.mask(0o022, true), (true, 0o6000));
        assert_eq!(Modes::Preserve.mask(0o022, false), (true, 0));
        assert_eq!(Modes::Umask.mask(0o027, true), (false, 0o027));
        assert_eq!(Modes::Umask.mask(0o027, false), (false, 0o027));
    }

    /// Device nodes and FIFOs are never made by a copy out: skipped, counted by kind, and
    /// nothing at their names (tar 0.4 would write each as a regular file with its mode).
    #[test]
    fn devices_and_fifos_are_skipped_and_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let tar = crafted(&[
            entry("d", tar::EntryType::Directory, 0o755, ""),
            entry("d/tty", tar::EntryType::Char, 0o4666, ""),
            entry("d/disk", tar::EntryType::Block, 0o666, ""),
            entry("d/pipe", tar::EntryType::Fifo, 0o666, ""),
            entry("d/pipe2", tar::EntryType::Fifo, 0o666, ""),
            entry("d/file", tar::EntryType::Regular, 0o644, "kept"),
        ]);
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        let done = unpack_untrusted(&tar[..], &out, Modes::Umask).unwrap();
        for name in ["tty", "disk", "pipe", "pipe2"] {
            let made = std::fs::symlink_metadata(out.join("d").join(name));
            assert!(made.is_err(), "d/{name} was made: {made:?}");
        }
        assert_eq!(std::fs::read(out.join("d/file")).unwrap(), b"kept");
        assert_eq!(
            (
                done.entries,
                done.char_devices,
                done.block_devices,
                done.fifos,
                done.others
            ),
            (2, 1, 1, 2, 0),
            "{done:?}"
        );
        assert_eq!(
            done.skipped().as_deref(),
            Some("1 character device, 1 block device, 2 FIFOs")
        );
        let none = unpack_untrusted(
            &crafted(&[entry("f", tar::EntryType::Regular, 0o644, "")])[..],
            &out,
            Modes::Umask,
        )
        .unwrap();
        assert_eq!(none.skipped(), None);
    }

    /// A hard link whose target is not a file this copy unpacked is refused, naming the
    /// entry: an absolute host path (a root-only file), `../x`, a `..` walk from anywhere to
    /// that file, or a file that was in the destination before the copy. Nothing is linked.
    #[test]
    fn a_hard_link_out_of_the_copy_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let secret = tmp.path().join("secret");
        root_only(&secret);
        let x = tmp.path().join("x");
        root_only(&x);
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        std::fs::write(out.join("before"), b"not this copy's").unwrap();
        let walk = format!(
            "{}{}",
            "../".repeat(16),
            secret.to_str().unwrap().trim_start_matches('/')
        );
        for link in [secret.to_str().unwrap(), "../x", &walk, "before"] {
            let tar = crafted(&[
                entry("d", tar::EntryType::Directory, 0o755, ""),
                entry("d/evil", tar::EntryType::Link, 0o644, link),
            ]);
            let err = unpack_untrusted(&tar[..], &out, Modes::Umask).unwrap_err();
            assert!(
                err.to_string().contains("d/evil"),
                "a link to {link}: {err}"
            );
            assert!(
                std::fs::symlink_metadata(out.join("d/evil")).is_err(),
                "a link to {link} was made"
            );
        }
        for file in [&secret, &x, &out.join("before")] {
            assert_eq!(
                std::fs::metadata(file).unwrap().nlink(),
                1,
                "{}",
                file.display()
            );
        }
    }

    /// A hard link through a symlink the archive made (to a directory outside), or to that
    /// symlink itself, is refused: a link's target is resolved inside the destination, never
    /// through a symlink.
    #[test]
    fn a_hard_link_through_a_symlink_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        root_only(&outside.join("secret"));
        let out = tmp.path().join("out");
        std::fs::create_dir(&out).unwrap();
        for (link, through) in [("d/s/secret", "out/d/s"), ("d/t", "d/t")] {
            let tar = crafted(&[
                entry("d", tar::EntryType::Directory, 0o755, ""),
                entry(
                    "d/s",
                    tar::EntryType::Symlink,
                    0o777,
                    outside.to_str().unwrap(),
                ),
                entry(
                    "d/t",
                    tar::EntryType::Symlink,
                    0o777,
                    outside.join("secret").to_str().unwrap(),
                ),
                entry("d/evil", tar::EntryType::Link, 0o644, link),
            ]);
            let err = unpack_untrusted(&tar[..], &out, Modes::Umask).unwrap_err();
            let said = err.to_string();
            assert!(
                said.contains("d/evil") && said.contains(through),
                "a link to {link}: {said}"
            );
            assert!(
                std::fs::symlink_metadata(out.join("d/evil")).is_err(),
                "a link to {link} was made"
            );
        }
        assert_eq!(
            std::fs::metadata(outside.join("secret")).unwrap().nlink(),
            1
        );
    }

    /// A hard link to a file the same copy unpacked is made (as GNU tar writes them: the
    /// target named from the archive's root), into a directory and under a new name.
    #[test]
    fn a_hard_link_inside_the_copy_is_made() {
        let tmp = tempfile::tempdir().unwrap();
        let tar = crafted(&[
            entry("d", tar::EntryType::Directory, 0o755, ""),
            entry("d/a", tar::EntryType::Regular, 0o644, "shared"),
            entry("d/sub", tar::EntryType::Directory, 0o755, ""),
            entry("d/sub/b", tar::EntryType::Link, 0o644, "d/a"),
        ]);
        let into = tmp.path().join("into");
        std::fs::create_dir(&into).unwrap();
        let renamed = tmp.path().join("renamed");
        for (dest, root) in [(&into, into.join("d")), (&renamed, renamed.clone())] {
            let done = unpack_untrusted(&tar[..], dest, Modes::Umask)
                .unwrap_or_else(|e| panic!("{}: {e}", dest.display()));
            assert_eq!(done.entries, 4);
            let a = std::fs::metadata(root.join("a")).unwrap();
            let b = std::fs::metadata(root.join("sub/b")).unwrap();
            assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "{}", root.display());
            assert_eq!(std::fs::read(root.join("sub/b")).unwrap(), b"shared");
        }
    }

    /// Owners are never taken from the archive: an entry claiming uid and gid 1000 belongs
    /// to the caller, as a file the caller makes there does, with or without `--preserve`.
    #[test]
    fn owners_are_the_callers() {
        let tmp = tempfile::tempdir().unwrap();
        let mut tar_entries = vec![
            entry("d", tar::EntryType::Directory, 0o755, ""),
            entry("d/f", tar::EntryType::Regular, 0o644, "theirs"),
        ];
        for e in &mut tar_entries {
            e.uid = 1000;
        }
        let tar = crafted(&tar_entries);
        for modes in [Modes::Umask, Modes::Preserve] {
            let out = tmp.path().join(format!("{modes:?}"));
            std::fs::create_dir(&out).unwrap();
            std::fs::write(out.join("mine"), b"").unwrap();
            let mine = std::fs::metadata(out.join("mine")).unwrap();
            unpack_untrusted(&tar[..], &out, modes).unwrap();
            for rel in ["d", "d/f"] {
                let got = std::fs::metadata(out.join(rel)).unwrap();
                assert_eq!(
                    (got.uid(), got.gid()),
                    (mine.uid(), mine.gid()),
                    "{modes:?} {rel}"
                );
            }
        }
    }
}
