//! Files as tar, both ways, named the way `docker cp` names them: a copy of `SRC` is a tar
//! whose entries are rooted at `SRC`'s own name, and unpacking it at `DEST` puts that root
//! *inside* `DEST` when `DEST` is a directory that exists, else *as* `DEST` (the root renamed).
//!
//! Kept as they are: file modes (0750 stays 0750), modification times, symlinks as symlinks
//! (never followed when packing). Ownership is not kept: files belong to whoever unpacks.
//!
//! Unpacking refuses any entry that would leave `DEST`: an absolute path, a `..`, or a path
//! through a symlink (one already there or one the archive made earlier) — so a hostile
//! archive cannot write outside the destination, on either side of a copy.

use std::io::{self, Read, Write};
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

/// Unpacks the tar from `input` at `dest` (see the module docs for where its root goes).
/// Returns how many entries were unpacked.
pub fn unpack(input: impl Read, dest: &Path) -> io::Result<u64> {
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
    archive.set_preserve_permissions(true);
    archive.set_preserve_mtime(true);
    archive.set_overwrite(true);
    let mut dirs: Vec<(PathBuf, u64)> = Vec::new();
    let mut count = 0;
    for entry in archive.entries()? {
        let mut entry = entry?;
        let path = entry.path()?.into_owned();
        let mut rel = PathBuf::new();
        for component in path.components() {
            match component {
                Component::Normal(part) => rel.push(part),
                Component::CurDir => {}
                _ => {
                    return Err(refused(format!(
                        "refusing the archive entry {}: it leaves the destination",
                        path.display()
                    )));
                }
            }
        }
        if let Some(name) = &rename {
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
        if rel.as_os_str().is_empty() {
            // "." unpacked into an existing directory: that directory is already there.
            continue;
        }
        // No ancestor of the target (below the root) may be a symlink: writing through one
        // could land anywhere.
        let mut walked = root.clone();
        let parts: Vec<_> = rel.components().collect();
        for part in &parts[..parts.len() - 1] {
            walked.push(part);
            match std::fs::symlink_metadata(&walked) {
                Ok(m) if m.file_type().is_symlink() => {
                    return Err(refused(format!(
                        "refusing the archive entry {}: {} is a symlink",
                        path.display(),
                        walked.display()
                    )));
                }
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    std::fs::create_dir_all(&walked)?;
                }
                Err(e) => return Err(e),
            }
        }
        let target = root.join(&rel);
        // A directory over a symlink would be entered through it by the entries after it
        // (tar itself refuses it, as "File exists"): say why.
        if entry.header().entry_type().is_dir()
            && std::fs::symlink_metadata(&target).is_ok_and(|m| m.file_type().is_symlink())
        {
            return Err(refused(format!(
                "refusing the archive entry {}: {} is a symlink",
                path.display(),
                target.display()
            )));
        }
        if entry.header().entry_type().is_dir() {
            dirs.push((target.clone(), entry.header().mtime().unwrap_or(0)));
        }
        let located = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", target.display()));
        if entry.header().entry_type().is_file() {
            // A file is written under a name of its own beside its target and renamed there
            // once whole: a copy cut short (the client gone, its credential revoked) leaves no
            // half-written file under the name.
            let part = partial_name(&target);
            if let Err(e) = entry.unpack(&part) {
                let _ = std::fs::remove_file(&part);
                return Err(located(e));
            }
            std::fs::rename(&part, &target).map_err(|e| {
                let _ = std::fs::remove_file(&part);
                located(e)
            })?;
        } else {
            entry.unpack(&target).map_err(located)?;
        }
        count += 1;
    }
    // A directory's time changes as entries land in it: set them last, deepest first.
    for (dir, mtime) in dirs.iter().rev() {
        let time = filetime::FileTime::from_unix_time(*mtime as i64, 0);
        let _ = filetime::set_symlink_file_times(dir, time, time);
    }
    Ok(count)
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
}
