//! What an oci sandbox changed in its root filesystem, as an OCI image layer: the overlay's
//! writable layer (`upper/`) written as a tar while no workload runs (an image build's `RUN`
//! step is kept this way).
//!
//! `upper/` is the sandbox's to write, so this host code reads it the way `safefs` reads
//! anything a sandbox had a hand in: every entry is reached from its parent's directory fd,
//! never by a path; `O_NOFOLLOW` everywhere; a regular file is opened `O_NONBLOCK` and used
//! only when `fstat` of the open file is the regular file `fstatat` saw (a FIFO or a swap
//! between the two calls is refused, not read). The sandbox's lock is held for the whole
//! walk, so no run of it writes meanwhile.
//!
//! Overlay's own format becomes the OCI one: a whiteout (a 0:0 character device) is written
//! as an empty `.wh.<name>`, an opaque directory (`trusted.overlay.opaque=y`) gets a
//! `.wh..wh..opq` entry. Owners are written as the sandbox sees them (host id − the id map's
//! base); an entry owned outside the map refuses the layer. Device nodes and sockets are left
//! out (no sandbox can make a device node in its user namespace). What the runtime made only
//! as mount points — `/proc`, `/sys`, `/dev`, `/sandbox` as empty directories,
//! `/etc/hostname` and `/etc/resolv.conf` as empty files — is left out too.
//!
//! A name beginning `.wh.` that the sandbox made itself (a file, a directory, a link, a FIFO)
//! refuses the layer, naming the path: in a layer that prefix says "deleted" (`.wh.passwd`
//! deletes `passwd`, `.wh..wh..opq` hides a directory's lower contents), so written as it is
//! it would delete or hide the base's files in the result. The OCI layer spec says as much
//! ("it is not possible to create a filesystem which has a file or directory with a name
//! beginning with `.wh.`"); the same trick was reported against buildah (podman issue 3582,
//! `RUN mkdir .wh.sbin`). Only the whiteouts written here from overlay's own are `.wh.` names.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, openat, readlinkat};
use nix::sys::stat::{FileStat, Mode, SFlag, fstat, fstatat};
use nix::{dir::Dir, fcntl::AtFlags};
use sbx_images::IdMap;

/// The deepest directory nesting written (deeper is refused: no image needs it).
const MAX_DEPTH: usize = 256;

/// What a layer's name begins with when it says "deleted" (see the module docs).
const WHITEOUT_PREFIX: &[u8] = b".wh.";

/// Mount points the runtime may have made in `upper/`: left out while they are empty.
const MOUNT_POINTS: &[&str] = &[
    "proc",
    "sys",
    "dev",
    "sandbox",
    "etc/hostname",
    "etc/resolv.conf",
];

/// How many entries of each kind a layer holds.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct LayerStats {
    pub entries: u64,
    pub whiteouts: u64,
    pub bytes: u64,
}

/// Writes the changes under `upper` as an (uncompressed) OCI layer tar to `out`.
pub fn write_layer(upper: &Path, ids: IdMap, out: impl Write) -> io::Result<LayerStats> {
    let root = open_dir_at(None, upper.as_os_str())?;
    let mut walk = Walk {
        tar: tar::Builder::new(out),
        ids,
        links: HashMap::new(),
        stats: LayerStats::default(),
    };
    walk.dir(&root, Path::new(""), 0)?;
    walk.tar.into_inner()?.flush()?;
    Ok(walk.stats)
}

struct Walk<W: Write> {
    tar: tar::Builder<W>,
    ids: IdMap,
    /// Regular files with more than one link, by (device, inode): where the first was written.
    links: HashMap<(u64, u64), PathBuf>,
    stats: LayerStats,
}

fn refused(why: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, why)
}

fn open_dir_at(parent: Option<&OwnedFd>, name: &OsStr) -> io::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    let fd = match parent {
        Some(p) => openat(p.as_fd(), name, flags, Mode::empty()),
        None => openat(nix::fcntl::AT_FDCWD, name, flags, Mode::empty()),
    }?;
    Ok(fd)
}

fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

impl<W: Write> Walk<W> {
    fn owner(&self, st: &FileStat, at: &Path) -> io::Result<(u64, u64)> {
        let shift = |host: u32, base: u32| host.checked_sub(base).filter(|id| *id < self.ids.size);
        match (
            shift(st.st_uid, self.ids.host_uid),
            shift(st.st_gid, self.ids.host_gid),
        ) {
            (Some(uid), Some(gid)) => Ok((uid.into(), gid.into())),
            _ => Err(refused(format!(
                "/{} is owned by host ids {}:{}, outside the sandbox's",
                at.display(),
                st.st_uid,
                st.st_gid
            ))),
        }
    }

    fn header(&self, st: &FileStat, at: &Path, kind: tar::EntryType) -> io::Result<tar::Header> {
        let (uid, gid) = self.owner(st, at)?;
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(0);
        Ok(h)
    }

    fn dir(&mut self, fd: &OwnedFd, at: &Path, depth: usize) -> io::Result<()> {
        if depth > MAX_DEPTH {
            return Err(refused(format!(
                "/{} is nested deeper than {MAX_DEPTH} directories",
                at.display()
            )));
        }
        let dup = fd.try_clone()?;
        let mut names: Vec<Vec<u8>> = Dir::from_fd(dup)?
            .iter()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_bytes().to_vec())
            .filter(|n| n != b"." && n != b"..")
            .collect();
        // The same changes make the same tar.
        names.sort();
        for name in names {
            let name = OsStr::from_bytes(&name);
            let path = at.join(name);
            self.entry(fd, name, &path, depth)?;
        }
        Ok(())
    }

    fn entry(&mut self, dir: &OwnedFd, name: &OsStr, path: &Path, depth: usize) -> io::Result<()> {
        let st = fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)?;
        let shown = path.to_string_lossy();
        // Whatever its kind: even the deletion of such a name (overlay's 0:0 device) would be
        // written `.wh..wh.NAME`, which readers take for aufs bookkeeping, not a deletion.
        if name.as_bytes().starts_with(WHITEOUT_PREFIX) {
            return Err(refused(format!(
                "/{shown}: a name beginning with .wh. is how a layer says a file was deleted, \
                 so a layer cannot hold it (rename it)"
            )));
        }
        let mount_point = MOUNT_POINTS.contains(&shown.as_ref());
        match kind(&st) {
            SFlag::S_IFDIR => {
                let sub = open_dir_at(Some(dir), name)?;
                if mount_point && dir_is_empty(&sub)? {
                    return Ok(());
                }
                let mut h = self.header(&st, path, tar::EntryType::Directory)?;
                self.tar.append_data(&mut h, path, io::empty())?;
                self.stats.entries += 1;
                let as_file = File::from(sub.try_clone()?);
                // A directory overlay renamed (`redirect_dir`) holds its contents elsewhere:
                // written as it is, the layer would lose them.
                if has_xattr(&as_file, "trusted.overlay.redirect") {
                    return Err(refused(format!(
                        "/{} was renamed by overlay's redirect_dir, which a layer cannot say",
                        path.display()
                    )));
                }
                if xattr_opaque(&as_file) {
                    self.whiteout(&path.join(".wh..wh..opq"))?;
                }
                self.dir(&sub, path, depth + 1)
            }
            SFlag::S_IFREG => {
                if mount_point && st.st_size == 0 {
                    return Ok(());
                }
                self.file(dir, name, path, &st)
            }
            SFlag::S_IFLNK => {
                let target = readlinkat(dir.as_fd(), name)?;
                let mut h = self.header(&st, path, tar::EntryType::Symlink)?;
                // The target byte for byte (`append_link` would normalise `/` to `//`), and
                // a long one through the GNU long-link entry `append_link` writes.
                if target.as_bytes().len() <= 100 {
                    h.set_link_name_literal(target.as_bytes())?;
                    self.tar.append_data(&mut h, path, io::empty())?;
                } else {
                    self.tar.append_link(&mut h, path, Path::new(&target))?;
                }
                self.stats.entries += 1;
                Ok(())
            }
            SFlag::S_IFCHR if st.st_rdev == 0 => {
                // The name byte for byte: a lossy one would white out another name.
                let mut wh_name = b".wh.".to_vec();
                wh_name.extend_from_slice(name.as_bytes());
                let wh_name = OsStr::from_bytes(&wh_name);
                let wh = match path.parent() {
                    Some(parent) => parent.join(wh_name),
                    None => PathBuf::from(wh_name),
                };
                self.whiteout(&wh)
            }
            SFlag::S_IFIFO => {
                let mut h = self.header(&st, path, tar::EntryType::Fifo)?;
                self.tar.append_data(&mut h, path, io::empty())?;
                self.stats.entries += 1;
                Ok(())
            }
            // Sockets and device nodes: nothing a layer carries.
            _ => Ok(()),
        }
    }

    fn whiteout(&mut self, path: &Path) -> io::Result<()> {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(0);
        h.set_size(0);
        self.tar.append_data(&mut h, path, io::empty())?;
        self.stats.whiteouts += 1;
        Ok(())
    }

    fn file(
        &mut self,
        dir: &OwnedFd,
        name: &OsStr,
        path: &Path,
        seen: &FileStat,
    ) -> io::Result<()> {
        if seen.st_nlink > 1 {
            let key = (seen.st_dev, seen.st_ino);
            if let Some(first) = self.links.get(&key).cloned() {
                let mut h = self.header(seen, path, tar::EntryType::Link)?;
                self.tar.append_link(&mut h, path, &first)?;
                self.stats.entries += 1;
                return Ok(());
            }
            self.links.insert(key, path.to_path_buf());
        }
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_NONBLOCK | OFlag::O_CLOEXEC;
        let fd = openat(dir.as_fd(), name, flags, Mode::empty())?;
        let st = fstat(fd.as_fd())?;
        if kind(&st) != SFlag::S_IFREG || st.st_ino != seen.st_ino || st.st_dev != seen.st_dev {
            return Err(refused(format!(
                "/{} changed while it was read",
                path.display()
            )));
        }
        let file = File::from(fd);
        // A metadata-only copy-up (`metacopy`) holds no data of its own: its zeros are not
        // the file.
        if has_xattr(&file, "trusted.overlay.metacopy") {
            return Err(refused(format!(
                "/{} is a metadata-only copy (overlay's metacopy), which a layer cannot say",
                path.display()
            )));
        }
        let mut h = self.header(&st, path, tar::EntryType::Regular)?;
        let size = st.st_size.max(0) as u64;
        h.set_size(size);
        // Exactly the size fstat said: a file that grew is cut there, one that shrank is an
        // error of the tar writer (the sandbox runs nothing meanwhile, so neither happens).
        self.tar
            .append_data(&mut h, path, io::Read::take(file, size))?;
        self.stats.entries += 1;
        self.stats.bytes += size;
        Ok(())
    }
}

fn dir_is_empty(fd: &OwnedFd) -> io::Result<bool> {
    let dup = fd.try_clone()?;
    let mut dir = Dir::from_fd(dup)?;
    Ok(!dir
        .iter()
        .filter_map(|e| e.ok())
        .any(|e| !matches!(e.file_name().to_bytes(), b"." | b"..")))
}

/// Whether the entry carries the extended attribute `name` at all.
fn has_xattr(file: &File, name: &str) -> bool {
    use xattr::FileExt;
    matches!(file.get_xattr(name), Ok(Some(_)))
}

/// Whether overlay marked this directory opaque (it replaced a lower one).
fn xattr_opaque(dir: &File) -> bool {
    use xattr::FileExt;
    matches!(dir.get_xattr("trusted.overlay.opaque"), Ok(Some(v)) if v == b"y")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (path, kind, uid, link target) of every entry.
    fn listing(tar: &[u8]) -> Vec<(String, tar::EntryType, u64, String)> {
        tar::Archive::new(tar)
            .entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    e.header().entry_type(),
                    e.header().uid().unwrap(),
                    e.link_name()
                        .unwrap()
                        .map(|l| l.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                )
            })
            .collect()
    }

    #[test]
    fn links_fifos_and_whiteouts_are_written_as_they_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let upper = dir.path();
        let me = nix::unistd::geteuid().as_raw();
        let ids = IdMap {
            host_uid: me,
            host_gid: nix::unistd::getegid().as_raw(),
            size: 65536,
        };
        std::fs::create_dir_all(upper.join("etc")).unwrap();
        std::fs::write(upper.join("etc/hostname"), "").unwrap();
        std::fs::write(upper.join("etc/app.conf"), "x=1\n").unwrap();
        std::os::unix::fs::symlink("/etc/shadow", upper.join("shadow-link")).unwrap();
        std::os::unix::fs::symlink("/", upper.join("root-link")).unwrap();
        std::fs::hard_link(upper.join("etc/app.conf"), upper.join("hard")).unwrap();
        nix::unistd::mkfifo(&upper.join("pipe"), Mode::from_bits_truncate(0o644)).unwrap();
        std::fs::create_dir(upper.join("proc")).unwrap();
        let mut out = Vec::new();
        let stats = write_layer(upper, ids, &mut out).unwrap();
        let got = listing(&out);
        let find = |p: &str| got.iter().find(|e| e.0 == p).cloned();
        assert_eq!(
            find("shadow-link").map(|e| (e.1, e.3)),
            Some((tar::EntryType::Symlink, "/etc/shadow".into()))
        );
        assert_eq!(
            find("root-link").map(|e| (e.1, e.3)),
            Some((tar::EntryType::Symlink, "/".into()))
        );
        assert_eq!(find("pipe").map(|e| e.1), Some(tar::EntryType::Fifo));
        // The first name of the file is its data; the second a link to it.
        assert_eq!(
            find("etc/app.conf").map(|e| e.1),
            Some(tar::EntryType::Regular)
        );
        assert_eq!(
            find("hard").map(|e| (e.1, e.3)),
            Some((tar::EntryType::Link, "etc/app.conf".into()))
        );
        assert_eq!(
            find("etc/app.conf").map(|e| e.2),
            Some(0),
            "owners as inside"
        );
        // Mount points the runtime made, empty, are not changes.
        assert!(
            find("proc").is_none() && find("etc/hostname").is_none(),
            "{got:?}"
        );
        assert_eq!(stats.bytes, 4);
    }

    #[test]
    fn what_overlay_keeps_elsewhere_refuses_the_layer() {
        let ids = IdMap {
            host_uid: nix::unistd::geteuid().as_raw(),
            host_gid: nix::unistd::getegid().as_raw(),
            size: 65536,
        };
        // A metadata-only copy-up: its data is in a lower layer, not in this file.
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tool"), vec![0u8; 16]).unwrap();
        xattr::set(dir.path().join("tool"), "trusted.overlay.metacopy", b"").unwrap();
        let e = write_layer(dir.path(), ids, Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("/tool is a metadata-only copy"), "{e}");
        // A renamed directory: its contents are named by the redirect.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("moved")).unwrap();
        xattr::set(
            dir.path().join("moved"),
            "trusted.overlay.redirect",
            b"/old",
        )
        .unwrap();
        let e = write_layer(dir.path(), ids, Vec::new())
            .unwrap_err()
            .to_string();
        assert!(e.contains("/moved was renamed"), "{e}");
    }

    #[test]
    fn a_name_a_layer_reads_as_a_deletion_refuses_the_layer_and_overlays_own_is_written() {
        let ids = IdMap {
            host_uid: nix::unistd::geteuid().as_raw(),
            host_gid: nix::unistd::getegid().as_raw(),
            size: 65536,
        };
        type Make = fn(&Path);
        let made: [(&str, Make); 4] = [
            ("etc/.wh.passwd", |p| std::fs::write(p, "").unwrap()),
            ("etc/.wh..wh..opq", |p| std::fs::write(p, "").unwrap()),
            (".wh.home", |p| std::fs::create_dir(p).unwrap()),
            ("etc/.wh.group", |p| {
                std::os::unix::fs::symlink("passwd", p).unwrap()
            }),
        ];
        for (path, make) in made {
            let dir = tempfile::tempdir().unwrap();
            std::fs::create_dir(dir.path().join("etc")).unwrap();
            make(&dir.path().join(path));
            let e = write_layer(dir.path(), ids, Vec::new()).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData);
            let e = e.to_string();
            assert!(
                e.starts_with(&format!("/{path}: a name beginning with .wh.")),
                "{e}"
            );
        }
        // Overlay's whiteout (a 0:0 character device) and opaque directory are the layer's.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("etc")).unwrap();
        nix::sys::stat::mknod(
            &dir.path().join("etc/passwd"),
            SFlag::S_IFCHR,
            Mode::empty(),
            0,
        )
        .unwrap();
        xattr::set(dir.path().join("etc"), "trusted.overlay.opaque", b"y").unwrap();
        let mut out = Vec::new();
        let stats = write_layer(dir.path(), ids, &mut out).unwrap();
        let names: Vec<String> = listing(&out).into_iter().map(|e| e.0).collect();
        assert_eq!(names, ["etc", "etc/.wh..wh..opq", "etc/.wh.passwd"]);
        assert_eq!(stats.whiteouts, 2);
    }
}
