//! Reading, as host root, files that a sandbox may have had a hand in.
//!
//! **Invariant:** host code never opens by a plain path anything under a directory a
//! sandbox can write (the symlink-exchange class: a link there turns a status read into a
//! read of any host file, a FIFO into a hang, `/dev/zero` into unbounded memory). Every read
//! of a sandbox's run files, logs and agent words goes through [`read_beneath`]: opened
//! beneath a directory the driver holds with `openat2` (`RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV`), `O_NOFOLLOW | O_NONBLOCK`,
//! refused unless it is a regular file, and read to at most a bound the caller names. The run
//! directories the drivers make today are host root's own (nothing in them is the sandbox's
//! to write), so this is the second wall, not the first: it also holds for a run directory
//! an earlier driver handed to its sandbox, found again after an upgrade.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};

/// Opens `rel` beneath the directory `root` for reading: no symlink on the way or at the
/// end, no `..` out of `root`, no other mount, a regular file only (a FIFO, a device or a
/// socket is `InvalidInput`), never blocking on the open.
pub fn open_beneath(root: &Path, rel: &Path) -> io::Result<File> {
    open_resolved(
        root,
        rel,
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS,
        OFlags::NOFOLLOW,
    )
}

/// As [`open_beneath`], but `rel` is resolved as if `root` were `/` (`RESOLVE_IN_ROOT`):
/// symlinks are followed, and none can leave `root` — for a file of a sandbox's root
/// filesystem that an image may legitimately link (its `/etc/passwd`).
pub fn open_in_root(root: &Path, rel: &Path) -> io::Result<File> {
    open_resolved(root, rel, ResolveFlags::IN_ROOT, OFlags::empty())
}

/// At most the first `max` bytes of `rel` resolved in `root` (see [`open_in_root`]).
pub fn read_in_root(root: &Path, rel: &Path, max: u64) -> io::Result<Vec<u8>> {
    let mut data = Vec::new();
    open_in_root(root, rel)?.take(max).read_to_end(&mut data)?;
    Ok(data)
}

fn open_resolved(
    root: &Path,
    rel: &Path,
    resolve: ResolveFlags,
    extra: OFlags,
) -> io::Result<File> {
    let dir = rustix::fs::open(
        root,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW,
        Mode::empty(),
    )?;
    let fd = rustix::fs::openat2(
        &dir,
        rel,
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY | extra,
        Mode::empty(),
        resolve | ResolveFlags::NO_MAGICLINKS | ResolveFlags::NO_XDEV,
    )?;
    let stat = rustix::fs::fstat(&fd)?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::RegularFile {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", rel.display()),
        ));
    }
    Ok(File::from(fd))
}

/// At most the first `max` bytes of `rel` beneath `root` (see [`open_beneath`]).
pub fn read_beneath(root: &Path, rel: &Path, max: u64) -> io::Result<Vec<u8>> {
    let file = open_beneath(root, rel)?;
    let mut data = Vec::new();
    file.take(max).read_to_end(&mut data)?;
    Ok(data)
}

/// At most the last `max` bytes of `rel` beneath `root` (see [`open_beneath`]).
pub fn read_tail_beneath(root: &Path, rel: &Path, max: u64) -> io::Result<Vec<u8>> {
    let mut file = open_beneath(root, rel)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(max)))?;
    let mut data = Vec::new();
    file.take(max).read_to_end(&mut data)?;
    Ok(data)
}

/// `text` as one short printable line: at most `max` characters, control characters as `?`
/// (what a sandbox wrote, quoted in a status or an error, can neither spoof lines nor grow).
pub fn printable(text: &str, max: usize) -> String {
    text.chars()
        .take(max)
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    #[test]
    fn only_regular_files_beneath_the_root_are_read_and_only_so_far() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let outside = tmp.path().join("secret");
        std::fs::write(&outside, "host secret\n").unwrap();
        std::fs::write(root.join("status"), "0123456789").unwrap();
        assert_eq!(
            read_beneath(&root, Path::new("status"), 4).unwrap(),
            b"0123"
        );
        assert_eq!(
            read_tail_beneath(&root, Path::new("status"), 3).unwrap(),
            b"789"
        );
        // A link to a host file, a link to /dev/zero, a link out through a directory, a
        // FIFO, `..`: each refused, none followed, none blocking.
        symlink(&outside, root.join("link")).unwrap();
        symlink("/dev/zero", root.join("zero")).unwrap();
        symlink(tmp.path(), root.join("up")).unwrap();
        nix::unistd::mkfifo(&root.join("fifo"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        std::fs::create_dir(root.join("dir")).unwrap();
        for name in [
            "link",
            "zero",
            "up/secret",
            "fifo",
            "../secret",
            "dir",
            "/etc/passwd",
        ] {
            let got = read_beneath(&root, Path::new(name), 1 << 20);
            assert!(got.is_err(), "{name} was read: {got:?}");
        }
        // Resolved in the root, a link is followed but cannot leave it; a FIFO is still
        // refused without blocking.
        std::fs::create_dir(root.join("etc")).unwrap();
        std::fs::write(root.join("etc/passwd"), "root:x:0:0::/:/bin/sh\n").unwrap();
        symlink("/etc/passwd", root.join("passwd-link")).unwrap();
        assert_eq!(
            read_in_root(&root, Path::new("/passwd-link"), 64).unwrap(),
            b"root:x:0:0::/:/bin/sh\n",
            "the link resolved inside the root, not to the host's /etc/passwd"
        );
        assert!(read_in_root(&root, Path::new("/fifo"), 64).is_err());
        assert!(read_in_root(&root, Path::new("/zero"), 64).is_err());
        // A root that is itself a link is refused too.
        symlink(&root, tmp.path().join("root-link")).unwrap();
        assert!(read_beneath(&tmp.path().join("root-link"), Path::new("status"), 4).is_err());
        assert_eq!(printable("a\nb\x1b[2Jc", 5), "a?b?[");
    }
}
