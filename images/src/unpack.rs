//! Unpacking one layer tar into a directory, safe against hostile archives.
//!
//! The `tar` crate only reads the entries; everything is created here, relative to directory
//! file descriptors that were opened one component at a time with `O_NOFOLLOW | O_DIRECTORY`,
//! so that no path the archive names is ever resolved through a symlink, and nothing is
//! written outside the layer directory. The rules (see the module docs of `image` too):
//!
//! - a leading `./` is dropped; an absolute path or any `..` refuses the layer;
//! - a parent that is a symlink (or not a directory) refuses the layer; missing parents are
//!   created (`0755`, owned by the mapped root);
//! - files are created with `O_CREAT | O_EXCL | O_NOFOLLOW`; an earlier entry of the same name
//!   is removed first (the later entry wins); symlinks are created as symlinks;
//! - a hard link must name an entry already unpacked by this layer;
//! - a GNU long name or PAX entry past 1 MiB refuses the layer from its header (the `tar`
//!   crate would read it whole into memory first): see [`LayerMeter`];
//! - character and block devices are skipped (counted and logged); fifos are created;
//! - `.wh.NAME` becomes an overlayfs whiteout (a 0:0 character device), `.wh..wh..opq` sets
//!   `trusted.overlay.opaque=y` on its directory;
//! - mode bits (setuid, setgid and sticky too) and mtimes are kept; owners are shifted by the
//!   store's [`IdMap`], and an id outside it refuses the layer.
//!
//! Extended attributes carried in PAX headers (`SCHILY.xattr.*`, e.g. file capabilities) are
//! not applied: a capability granted on the host side of an unprivileged sandbox would be one
//! more thing to get wrong, and no image this store serves needs them.

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{
    FchmodatFlags, Mode, SFlag, UtimensatFlags, fchmod, fchmodat, fstatat, futimens, makedev,
    mkdirat, mknodat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, symlinkat, unlinkat};
use tar::EntryType;
use xattr::FileExt;

use super::limits::{Budget, LayerMeter};
use super::{IdMap, ImageError};

/// The overlayfs attribute that makes a directory hide what lower layers have under it.
pub const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
const WHITEOUT_PREFIX: &str = ".wh.";
const OPAQUE_MARKER: &str = ".wh..wh..opq";

/// What the unpacking of one layer is about, for its error messages and owners.
pub struct Layer<'a> {
    pub image: &'a str,
    pub digest: &'a str,
    pub idmap: IdMap,
    /// Ends the unpack at its next read of the layer (a cancelled add).
    pub cancel: Option<&'a tokio_util::sync::CancellationToken>,
}

/// What an unpack did.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct UnpackStats {
    pub entries: u64,
    pub devices_skipped: u64,
}

/// The layer as the `tar` crate reads it, each header checked by a [`LayerMeter`] before the
/// crate sees it (the budget is the unpack's own, paid per entry below: the meter's is
/// unlimited). The crate reads a GNU long name or PAX entry whole into memory, whatever its
/// size: a gzip of a few hundred KiB can say 20 GiB; the meter refuses one past 1 MiB.
struct Checked<'a, R> {
    inner: R,
    meter: LayerMeter,
    refused: Option<ImageError>,
    image: &'a str,
    cancel: Option<&'a tokio_util::sync::CancellationToken>,
}

impl<R: Read> Read for Checked<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.cancel.is_some_and(|c| c.is_cancelled()) {
            let e = ImageError::Cancelled {
                image: self.image.to_string(),
            };
            let shown = e.to_string();
            self.refused = Some(e);
            return Err(std::io::Error::other(shown));
        }
        let n = self.inner.read(buf)?;
        if let Err(e) = self.meter.feed(&buf[..n]) {
            let shown = e.to_string();
            self.refused = Some(e);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, shown));
        }
        Ok(n)
    }
}

/// A relative path inside the layer, as its normal components.
type RelPath = Vec<OsString>;

/// Unpacks the tar stream `reader` into `dest`, an existing empty directory. On error `dest`
/// holds a partial tree: the caller removes it.
pub fn unpack(
    layer: &Layer<'_>,
    reader: impl Read,
    dest: &Path,
    budget: &mut Budget,
) -> Result<UnpackStats, ImageError> {
    let root: OwnedFd = openat(
        nix::fcntl::AT_FDCWD,
        dest,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| layer.io(&dest.display().to_string(), "open the unpack directory", e))?;
    let mut u = Unpacker {
        layer,
        root,
        dest,
        unpacked: HashSet::new(),
        dir_mtimes: Vec::new(),
        stats: UnpackStats::default(),
        budget,
    };
    let mut checked = Checked {
        inner: reader,
        meter: LayerMeter::new(Budget::unlimited(layer.image)),
        refused: None,
        image: layer.image,
        cancel: layer.cancel,
    };
    let walked = (|| {
        let mut archive = tar::Archive::new(&mut checked);
        let entries = archive
            .entries()
            .map_err(|e| layer.malformed(format!("not a tar stream: {e}")))?;
        for entry in entries {
            let entry =
                entry.map_err(|e| layer.malformed(format!("reading the tar stream: {e}")))?;
            u.entry(entry)?;
        }
        Ok(())
    })();
    if let Err(e) = walked {
        // Why the stream was cut, when the meter cut it.
        return Err(checked.refused.take().unwrap_or(e));
    }
    u.finish()?;
    Ok(u.stats)
}

struct Unpacker<'a> {
    layer: &'a Layer<'a>,
    root: OwnedFd,
    dest: &'a Path,
    /// Non-directory entries this layer created: the only valid hard link targets.
    unpacked: HashSet<RelPath>,
    /// Directory mtimes, applied at the end (creating entries inside changes them).
    dir_mtimes: Vec<(RelPath, i64)>,
    stats: UnpackStats,
    /// The image's limits: every entry is paid for before it is written.
    budget: &'a mut Budget,
}

impl Layer<'_> {
    fn unsafe_entry(&self, entry: &str, why: impl Into<String>) -> ImageError {
        ImageError::UnsafeLayer {
            image: self.image.to_string(),
            layer: self.digest.to_string(),
            entry: entry.to_string(),
            why: why.into(),
        }
    }

    fn malformed(&self, why: impl Into<String>) -> ImageError {
        ImageError::malformed(self.image, format!("layer {}: {}", self.digest, why.into()))
    }

    fn io(&self, entry: &str, what: &str, e: impl Into<std::io::Error>) -> ImageError {
        ImageError::io(
            self.image,
            format!("layer {}: {what} for {entry:?}", self.digest),
            e.into(),
        )
    }
}

/// The normal components of an entry path: `./` and `.` are dropped; an absolute path or a
/// `..` is refused with the reason.
pub fn normalize(path: &[u8]) -> Result<RelPath, &'static str> {
    if path.first() == Some(&b'/') {
        return Err("absolute path");
    }
    let mut out = Vec::new();
    for c in Path::new(OsStr::from_bytes(path)).components() {
        match c {
            Component::Normal(n) => out.push(n.to_os_string()),
            Component::CurDir => {}
            Component::ParentDir => return Err("path has a `..` component"),
            Component::RootDir | Component::Prefix(_) => return Err("absolute path"),
        }
    }
    Ok(out)
}

/// Where an entry goes: its parent directory (open), the parent's path under the layer root,
/// and its name there.
struct Place<'p> {
    parent: &'p OwnedFd,
    parent_rel: &'p [OsString],
    name: &'p OsString,
}

/// What an entry's header gives every kind of entry: its mode bits, its mtime and its owner
/// (shifted into the store's id map).
#[derive(Clone, Copy)]
struct Meta {
    mode: u32,
    mtime: i64,
    uid: Uid,
    gid: Gid,
}

impl Unpacker<'_> {
    fn entry<R: Read>(&mut self, mut entry: tar::Entry<'_, R>) -> Result<(), ImageError> {
        let raw = entry.path_bytes().into_owned();
        let shown = String::from_utf8_lossy(&raw).into_owned();
        let layer = self.layer;
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            EntryType::XGlobalHeader | EntryType::XHeader | EntryType::GNULongName
        ) {
            return Ok(());
        }
        let rel = normalize(&raw).map_err(|why| layer.unsafe_entry(&shown, why))?;
        self.budget.take_at(
            &format!("/{}", shown.trim_start_matches("./")),
            entry.size(),
        )?;
        self.stats.entries += 1;
        let meta = self.meta(entry.header(), &shown)?;
        let Meta {
            mode,
            mtime,
            uid,
            gid,
        } = meta;

        let Some((name, parent_rel)) = rel.split_last() else {
            // The layer root itself ("./"): keep its mode and owner.
            if kind.is_dir() {
                self.set_dir_meta(&self.root, &shown, mode, uid, gid)?;
                self.dir_mtimes.push((Vec::new(), mtime));
            }
            return Ok(());
        };
        let parent = self.open_parent(parent_rel, &shown, true)?;
        if name.to_string_lossy().starts_with(WHITEOUT_PREFIX) {
            return self.whiteout(parent, parent_rel, name, &shown, meta);
        }
        let at = Place {
            parent: &parent,
            parent_rel,
            name,
        };

        match kind {
            EntryType::Directory => {
                self.directory(&at, &shown, meta)?;
                self.dir_mtimes.push((rel.clone(), mtime));
            }
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                self.regular_file(&at, &shown, meta, &mut entry)?;
                self.unpacked.insert(rel);
            }
            EntryType::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| layer.malformed(format!("symlink {shown:?} has no target")))?
                    .into_owned();
                self.remove_existing(&parent, parent_rel, name, &shown)?;
                symlinkat(OsStr::from_bytes(&target), &parent, name.as_os_str())
                    .map_err(|e| layer.io(&shown, "create the symlink", e))?;
                self.own_at(&parent, name, &shown, uid, gid, Some(mtime))?;
                self.unpacked.insert(rel);
            }
            EntryType::Link => {
                let target = entry
                    .link_name_bytes()
                    .ok_or_else(|| layer.malformed(format!("hard link {shown:?} has no target")))?
                    .into_owned();
                if self.hard_link(&at, &rel, &shown, &target)? {
                    self.unpacked.insert(rel);
                }
            }
            EntryType::Fifo => {
                self.fifo(&at, &shown, meta)?;
                self.unpacked.insert(rel);
            }
            EntryType::Char | EntryType::Block => {
                self.stats.devices_skipped += 1;
                tracing::debug!(
                    image = layer.image,
                    layer = layer.digest,
                    entry = %shown,
                    "device node skipped: sandboxes get their /dev from the runtime"
                );
            }
            other => {
                tracing::debug!(
                    image = layer.image,
                    layer = layer.digest,
                    entry = %shown,
                    kind = ?other,
                    "tar entry of an unsupported type skipped"
                );
            }
        }
        Ok(())
    }

    /// The header's mode bits, mtime and owner (shifted), or why they do not read.
    fn meta(&self, header: &tar::Header, shown: &str) -> Result<Meta, ImageError> {
        let layer = self.layer;
        let mode = header
            .mode()
            .map_err(|e| layer.malformed(format!("{shown:?}: {e}")))?
            & 0o7777;
        let mtime = header
            .mtime()
            .map_err(|e| layer.malformed(format!("{shown:?}: {e}")))?;
        let mtime = i64::try_from(mtime).unwrap_or(i64::MAX);
        let uid = header
            .uid()
            .map_err(|e| layer.malformed(format!("{shown:?}: {e}")))?;
        let gid = header
            .gid()
            .map_err(|e| layer.malformed(format!("{shown:?}: {e}")))?;
        let (uid, gid) = self.shift(shown, uid, gid)?;
        Ok(Meta {
            mode,
            mtime,
            uid,
            gid,
        })
    }

    /// A whiteout (`.wh.NAME`: NAME is removed, as overlayfs's character device 0/0), the
    /// opaque marker (`.wh..wh..opq`: the directory hides the layers below), or aufs
    /// bookkeeping (other `.wh..wh.` names), skipped.
    fn whiteout(
        &mut self,
        parent: OwnedFd,
        parent_rel: &[OsString],
        name: &OsStr,
        shown: &str,
        meta: Meta,
    ) -> Result<(), ImageError> {
        let layer = self.layer;
        let name_str = name.to_string_lossy();
        let Some(target) = name_str.strip_prefix(WHITEOUT_PREFIX) else {
            return Ok(());
        };
        if name_str == OPAQUE_MARKER {
            File::from(parent)
                .set_xattr(OPAQUE_XATTR, b"y")
                .map_err(|e| layer.io(shown, "set the overlay opaque attribute", e))?;
        } else if target.starts_with(WHITEOUT_PREFIX) {
            // Other `.wh..wh.` names are aufs bookkeeping (e.g. `.wh..wh.plnk`): not content.
        } else if target.is_empty() || target == "." || target == ".." {
            return Err(layer.unsafe_entry(shown, "whiteout names no file"));
        } else {
            let target = OsStr::from_bytes(&name.as_bytes()[WHITEOUT_PREFIX.len()..]);
            self.remove_existing(&parent, parent_rel, target, shown)?;
            mknodat(
                &parent,
                target,
                SFlag::S_IFCHR,
                Mode::empty(),
                makedev(0, 0),
            )
            .map_err(|e| layer.io(shown, "create the overlay whiteout", e))?;
            self.own_at(&parent, target, shown, meta.uid, meta.gid, None)?;
        }
        Ok(())
    }

    /// A directory: made (over whatever else had the name), or kept when there is one; its
    /// mode and owner set (its mtime is set once the layer is done).
    fn directory(&mut self, at: &Place<'_>, shown: &str, meta: Meta) -> Result<(), ImageError> {
        let layer = self.layer;
        let (parent, parent_rel, name) = (at.parent, at.parent_rel, at.name);
        let exists_as_dir = match fstatat(parent, name.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => {
                if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
                    true
                } else {
                    self.remove_existing(parent, parent_rel, name, shown)?;
                    false
                }
            }
            Err(Errno::ENOENT) => false,
            Err(e) => return Err(layer.io(shown, "stat", e)),
        };
        if !exists_as_dir {
            mkdirat(parent, name.as_os_str(), Mode::from_bits_truncate(0o700))
                .map_err(|e| layer.io(shown, "create the directory", e))?;
        }
        let dir = open_dir(parent, name).map_err(|e| layer.io(shown, "open the directory", e))?;
        self.set_dir_meta(&dir, shown, meta.mode, meta.uid, meta.gid)
    }

    /// A regular file: made anew (`O_EXCL`, never through a link), its content copied from
    /// the entry, then its owner, mode and mtime set.
    fn regular_file<R: Read>(
        &mut self,
        at: &Place<'_>,
        shown: &str,
        meta: Meta,
        entry: &mut tar::Entry<'_, R>,
    ) -> Result<(), ImageError> {
        let layer = self.layer;
        let (parent, parent_rel, name) = (at.parent, at.parent_rel, at.name);
        self.remove_existing(parent, parent_rel, name, shown)?;
        let fd = openat(
            parent,
            name.as_os_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::from_bits_truncate(0o600),
        )
        .map_err(|e| layer.io(shown, "create the file", e))?;
        let mut file = File::from(fd);
        copy_entry(layer, shown, entry, &mut file)?;
        fchown(&file, Some(meta.uid), Some(meta.gid)).map_err(|e| layer.io(shown, "chown", e))?;
        // After the chown, which clears setuid and setgid bits.
        fchmod(&file, Mode::from_bits_truncate(meta.mode))
            .map_err(|e| layer.io(shown, "chmod", e))?;
        futimens(&file, &TimeSpec::UTIME_OMIT, &TimeSpec::new(meta.mtime, 0))
            .map_err(|e| layer.io(shown, "set the mtime", e))?;
        Ok(())
    }

    /// A hard link to `target`, which this layer must have unpacked itself (a link to a lower
    /// layer's file, or to a path outside the layer, is refused). False: the link names
    /// itself, and nothing is done.
    fn hard_link(
        &mut self,
        at: &Place<'_>,
        rel: &RelPath,
        shown: &str,
        target: &[u8],
    ) -> Result<bool, ImageError> {
        let layer = self.layer;
        let (parent, parent_rel, name) = (at.parent, at.parent_rel, at.name);
        let target_rel = normalize(target)
            .map_err(|why| layer.unsafe_entry(shown, format!("hard link target: {why}")))?;
        if !self.unpacked.contains(&target_rel) {
            return Err(layer.unsafe_entry(
                shown,
                format!(
                    "hard link to {:?}, which this layer has not unpacked",
                    String::from_utf8_lossy(target)
                ),
            ));
        }
        if target_rel == *rel {
            return Ok(false);
        }
        let (target_name, target_parent_rel) = target_rel
            .split_last()
            .expect("an unpacked entry has a name");
        let target_parent = self.open_parent(target_parent_rel, shown, false)?;
        self.remove_existing(parent, parent_rel, name, shown)?;
        linkat(
            &target_parent,
            target_name.as_os_str(),
            parent,
            name.as_os_str(),
            AtFlags::empty(),
        )
        .map_err(|e| layer.io(shown, "create the hard link", e))?;
        Ok(true)
    }

    /// A fifo, with its owner, mtime and mode.
    fn fifo(&mut self, at: &Place<'_>, shown: &str, meta: Meta) -> Result<(), ImageError> {
        let layer = self.layer;
        let (parent, parent_rel, name) = (at.parent, at.parent_rel, at.name);
        self.remove_existing(parent, parent_rel, name, shown)?;
        mknodat(
            parent,
            name.as_os_str(),
            SFlag::S_IFIFO,
            Mode::from_bits_truncate(0o600),
            0,
        )
        .map_err(|e| layer.io(shown, "create the fifo", e))?;
        self.own_at(parent, name, shown, meta.uid, meta.gid, Some(meta.mtime))?;
        fchmodat(
            parent,
            name.as_os_str(),
            Mode::from_bits_truncate(meta.mode),
            FchmodatFlags::FollowSymlink,
        )
        .map_err(|e| layer.io(shown, "chmod the fifo", e))
    }

    fn shift(&self, shown: &str, uid: u64, gid: u64) -> Result<(Uid, Gid), ImageError> {
        let map = self.layer.idmap;
        let check = |what: &str, id: u64, base: u32| -> Result<u32, ImageError> {
            if id >= u64::from(map.size) {
                return Err(self.layer.unsafe_entry(
                    shown,
                    format!(
                        "{what} {id} is outside the store's id map ({} ids)",
                        map.size
                    ),
                ));
            }
            Ok(base + id as u32)
        };
        Ok((
            Uid::from_raw(check("uid", uid, map.host_uid)?),
            Gid::from_raw(check("gid", gid, map.host_gid)?),
        ))
    }

    /// Opens the directory `rel` under the layer root one component at a time, never
    /// following a symlink; with `create`, missing components are made (`0755`, mapped root).
    fn open_parent(
        &self,
        rel: &[OsString],
        shown: &str,
        create: bool,
    ) -> Result<OwnedFd, ImageError> {
        let layer = self.layer;
        let mut dir = self
            .root
            .try_clone()
            .map_err(|e| layer.io(shown, "duplicate the layer directory fd", e))?;
        for c in rel {
            let next = match open_dir(&dir, c) {
                Ok(fd) => fd,
                Err(Errno::ENOENT) if create => {
                    mkdirat(&dir, c.as_os_str(), Mode::from_bits_truncate(0o755))
                        .map_err(|e| layer.io(shown, "create a parent directory", e))?;
                    let fd = open_dir(&dir, c)
                        .map_err(|e| layer.io(shown, "open a parent directory", e))?;
                    let map = layer.idmap;
                    fchown(
                        &fd,
                        Some(Uid::from_raw(map.host_uid)),
                        Some(Gid::from_raw(map.host_gid)),
                    )
                    .map_err(|e| layer.io(shown, "chown a parent directory", e))?;
                    fchmod(&fd, Mode::from_bits_truncate(0o755))
                        .map_err(|e| layer.io(shown, "chmod a parent directory", e))?;
                    fd
                }
                Err(Errno::ELOOP | Errno::ENOTDIR) => {
                    let is_link = fstatat(&dir, c.as_os_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
                        .is_ok_and(|st| {
                            SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK
                        });
                    let why = if is_link {
                        format!("parent {:?} is a symlink", c.to_string_lossy())
                    } else {
                        format!("parent {:?} is not a directory", c.to_string_lossy())
                    };
                    return Err(layer.unsafe_entry(shown, why));
                }
                Err(Errno::ENOENT) => {
                    return Err(layer.unsafe_entry(
                        shown,
                        format!(
                            "hard link target's parent {:?} does not exist",
                            c.to_string_lossy()
                        ),
                    ));
                }
                Err(e) => return Err(layer.io(shown, "open a parent directory", e)),
            };
            dir = next;
        }
        Ok(dir)
    }

    /// Removes what an earlier entry of this layer left at `parent/name` (the later entry wins).
    fn remove_existing(
        &mut self,
        parent: &OwnedFd,
        parent_rel: &[OsString],
        name: &OsStr,
        shown: &str,
    ) -> Result<(), ImageError> {
        let layer = self.layer;
        let st = match fstatat(parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(layer.io(shown, "stat", e)),
        };
        let mut rel: RelPath = parent_rel.to_vec();
        rel.push(name.to_os_string());
        if SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFDIR {
            // Every component up to here was opened without following a symlink, and
            // remove_dir_all does not follow symlinks inside the tree it removes.
            let path = rel.iter().fold(self.dest.to_path_buf(), |p, c| p.join(c));
            std::fs::remove_dir_all(&path)
                .map_err(|e| layer.io(shown, "remove the earlier directory", e))?;
            self.unpacked.retain(|p| !p.starts_with(&rel));
            self.dir_mtimes.retain(|(p, _)| !p.starts_with(&rel));
        } else {
            unlinkat(parent, name, UnlinkatFlags::NoRemoveDir)
                .map_err(|e| layer.io(shown, "remove the earlier entry", e))?;
            self.unpacked.remove(&rel);
        }
        Ok(())
    }

    /// Owner (and mtime) of `parent/name`, which is not followed if it is a symlink.
    fn own_at(
        &self,
        parent: &OwnedFd,
        name: &OsStr,
        shown: &str,
        uid: Uid,
        gid: Gid,
        mtime: Option<i64>,
    ) -> Result<(), ImageError> {
        let layer = self.layer;
        fchownat(
            parent,
            name,
            Some(uid),
            Some(gid),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| layer.io(shown, "chown", e))?;
        if let Some(mtime) = mtime {
            utimensat(
                parent,
                name,
                &TimeSpec::UTIME_OMIT,
                &TimeSpec::new(mtime, 0),
                UtimensatFlags::NoFollowSymlink,
            )
            .map_err(|e| layer.io(shown, "set the mtime", e))?;
        }
        Ok(())
    }

    fn set_dir_meta(
        &self,
        dir: &OwnedFd,
        shown: &str,
        mode: u32,
        uid: Uid,
        gid: Gid,
    ) -> Result<(), ImageError> {
        let layer = self.layer;
        fchown(dir, Some(uid), Some(gid)).map_err(|e| layer.io(shown, "chown the directory", e))?;
        fchmod(dir, Mode::from_bits_truncate(mode))
            .map_err(|e| layer.io(shown, "chmod the directory", e))?;
        Ok(())
    }

    /// Applies the directory mtimes, deepest first, now that nothing more is created in them.
    fn finish(&mut self) -> Result<(), ImageError> {
        let mut dirs = std::mem::take(&mut self.dir_mtimes);
        dirs.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        for (rel, mtime) in dirs {
            let shown = rel
                .iter()
                .map(|c| c.to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            let dir = self.open_parent(&rel, &shown, false)?;
            futimens(&dir, &TimeSpec::UTIME_OMIT, &TimeSpec::new(mtime, 0))
                .map_err(|e| self.layer.io(&shown, "set the directory's mtime", e))?;
        }
        Ok(())
    }
}

fn open_dir(parent: impl AsFd, name: &OsStr) -> Result<OwnedFd, Errno> {
    openat(
        parent,
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
}

/// Copies an entry's data: a read failure is the archive's fault (malformed), a write failure
/// the store's (io).
fn copy_entry(
    layer: &Layer<'_>,
    shown: &str,
    from: &mut impl Read,
    to: &mut File,
) -> Result<(), ImageError> {
    let mut buf = vec![0u8; 128 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(layer.malformed(format!("reading {shown:?}: {e}"))),
        };
        to.write_all(&buf[..n])
            .map_err(|e| layer.io(shown, "write the file", e))?;
    }
}

/// An entry of an image's root filesystem as its layers merge it (see
/// [`crate::ImageStore::lookup`]): owners as the sandbox sees them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MergedEntry {
    pub is_dir: bool,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
}

/// What `rel` (components of a path, no `..`) is in the merged view of `layers` (highest
/// first): found in the highest layer that has it, unless a layer above whites it out or
/// makes an ancestor opaque. Walked from each layer's root by directory fds, never through
/// a symlink: `Err(path)` names an ancestor that is one.
pub(crate) fn merged_lookup(
    layers: &[std::path::PathBuf],
    rel: &[&OsStr],
    ids: IdMap,
) -> Result<Option<MergedEntry>, String> {
    let Some((name, ancestors)) = rel.split_last() else {
        return Ok(None);
    };
    'layers: for layer in layers {
        let Ok(mut dir) = openat(
            nix::fcntl::AT_FDCWD,
            layer.as_path(),
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) else {
            continue;
        };
        let mut opaque_above = false;
        for (i, part) in ancestors.iter().enumerate() {
            match fstatat(&dir, *part, AtFlags::AT_SYMLINK_NOFOLLOW) {
                Err(_) if opaque_above => return Ok(None),
                Err(_) => continue 'layers,
                Ok(st) => match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
                    SFlag::S_IFDIR => {}
                    SFlag::S_IFLNK => {
                        let shown: Vec<_> = ancestors[..=i]
                            .iter()
                            .map(|p| p.to_string_lossy())
                            .collect();
                        return Err(format!("/{}", shown.join("/")));
                    }
                    // A whiteout, or a file where a directory would be.
                    _ => return Ok(None),
                },
            }
            dir = match open_dir(&dir, part) {
                Ok(d) => d,
                Err(_) => continue 'layers,
            };
            if matches!(File::from(dir.try_clone().map_err(|e| e.to_string())?)
                .get_xattr("trusted.overlay.opaque"), Ok(Some(v)) if v == b"y")
            {
                opaque_above = true;
            }
        }
        match fstatat(&dir, *name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Err(_) if opaque_above => return Ok(None),
            Err(_) => continue,
            Ok(st) => {
                let kind = SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits());
                if kind == SFlag::S_IFCHR && st.st_rdev == 0 {
                    return Ok(None);
                }
                return Ok(Some(MergedEntry {
                    is_dir: kind == SFlag::S_IFDIR,
                    mode: st.st_mode & 0o7777,
                    uid: st.st_uid.saturating_sub(ids.host_uid),
                    gid: st.st_gid.saturating_sub(ids.host_gid),
                    mtime: st.st_mtime,
                }));
            }
        }
    }
    Ok(None)
}
