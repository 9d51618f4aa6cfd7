//! The few system calls sbx makes that no safe binding offers (rustix has `open_tree` and
//! `move_mount` but not `mount_setattr`, and no way to make a user namespace other than in
//! the calling process). Every `unsafe` block here says why it is sound.
//!
//! - [`user_namespace`]: a new user namespace with the given uid and gid maps, held by a
//!   descriptor (the process made to hold it is gone when the call returns).
//! - [`idmapped_tree`]: a detached, read-only copy of a mount whose owners are seen through
//!   a user namespace's map (an idmapped mount), to be attached with `move_mount`.
//! - [`process_ended`]: waits for a process's pidfd on tokio's reactor (tokio's safe
//!   constructor of an `AsyncFd` is deprecated: its registration is `unsafe` now).

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::mount::{MoveMountFlags, OpenTreeFlags};

/// `MOUNT_ATTR_RDONLY` (linux/mount.h).
const MOUNT_ATTR_RDONLY: u64 = 0x0000_0001;
/// `MOUNT_ATTR_IDMAP` (linux/mount.h).
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// `struct mount_attr` (linux/mount.h), as `mount_setattr(2)` takes it.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// A new user namespace whose maps are `uid_map` and `gid_map` (lines `INSIDE OUTSIDE COUNT`,
/// as `/proc/PID/uid_map` takes them). The caller must be root in the initial user namespace.
pub fn user_namespace(uid_map: &str, gid_map: &str) -> io::Result<OwnedFd> {
    // SAFETY: a raw clone without CLONE_VM and without a new stack is a fork: the child gets
    // a copy of this address space. The child (pid 0 here) then makes one system call in a
    // loop and never returns into Rust code of this process's other threads, takes no lock
    // and allocates nothing; it ends only by the SIGKILL below. CLONE_NEWUSER puts it in its
    // new namespace before the call returns in either process, so there is no race with the
    // map writes.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            libc::CLONE_NEWUSER | libc::SIGCHLD,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    if pid == 0 {
        loop {
            // SAFETY: pause(2) takes no argument and touches no memory.
            unsafe {
                libc::syscall(libc::SYS_pause);
            }
        }
    }
    let pid = pid as libc::pid_t;
    let held = (|| {
        std::fs::write(format!("/proc/{pid}/uid_map"), uid_map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), gid_map)?;
        Ok(OwnedFd::from(std::fs::File::open(format!(
            "/proc/{pid}/ns/user"
        ))?))
    })();
    // SAFETY: kill and waitpid on our own child, whose pid no one else can reap; the status
    // pointer is a live local.
    unsafe {
        libc::kill(pid, libc::SIGKILL);
        let mut status = 0;
        while libc::waitpid(pid, &mut status, 0) < 0
            && io::Error::last_os_error().kind() == io::ErrorKind::Interrupted
        {}
    }
    held
}

/// A detached copy of the mount at `path` (that directory's tree, not its submounts), read-only
/// and idmapped through `userns`: a file whose owner is `u` on disk is seen as owned by
/// whatever `userns` maps `u` to. Attach it with [`attach`].
pub fn idmapped_tree(path: &Path, userns: BorrowedFd<'_>) -> io::Result<OwnedFd> {
    let tree = rustix::mount::open_tree(
        rustix::fs::CWD,
        path,
        OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC,
    )?;
    let attr = MountAttr {
        attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.as_raw_fd() as u64,
    };
    // SAFETY: mount_setattr(2) reads `size_of::<MountAttr>()` bytes from `&attr`, a live
    // repr(C) struct laid out as the kernel's `struct mount_attr`; the path is an empty C
    // string (AT_EMPTY_PATH: the descriptor itself).
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(tree)
}

/// Attaches a detached mount (from [`idmapped_tree`]) at `target`.
pub fn attach(tree: BorrowedFd<'_>, target: &Path) -> io::Result<()> {
    rustix::mount::move_mount(
        tree,
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?;
    Ok(())
}

/// Resolves when process `pidfd` has ended (a pidfd turns readable then), on tokio's reactor:
/// no thread waits. An error if the reactor does not take the descriptor.
pub async fn process_ended(pidfd: OwnedFd) -> io::Result<()> {
    let readable = tokio::io::Interest::READABLE;
    // SAFETY: the AsyncFd owns `pidfd`, so the descriptor stays open and is the same one for
    // the AsyncFd's whole life: nothing else holds it, nothing can close it meanwhile.
    let fd = unsafe { tokio::io::unix::AsyncFd::register_with_interest(pidfd, readable) }
        .map_err(io::Error::from)?;
    fd.readable().await.map(|_| ())
}

#[cfg(test)]
mod tests {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;

    use super::*;

    fn is_root() -> bool {
        rustix::process::geteuid().is_root()
    }

    #[test]
    fn a_tree_is_seen_through_the_namespace_map() {
        if !is_root() {
            eprintln!("skipped: idmapped mounts need root");
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let layer = tmp.path().join("layer");
        let seen = tmp.path().join("seen");
        std::fs::create_dir_all(&layer).unwrap();
        std::fs::create_dir_all(&seen).unwrap();
        let file = layer.join("f");
        std::fs::write(&file, b"x").unwrap();
        std::os::unix::fs::chown(&file, Some(200_005), Some(200_007)).unwrap();
        let ns = user_namespace("200000 5000000 65536", "200000 5000000 65536").unwrap();
        let tree = idmapped_tree(&layer, ns.as_fd()).unwrap();
        attach(tree.as_fd(), &seen).unwrap();
        let meta = std::fs::metadata(seen.join("f"));
        let denied = std::fs::write(seen.join("g"), b"y");
        rustix::mount::unmount(&seen, rustix::mount::UnmountFlags::DETACH).unwrap();
        let meta = meta.unwrap();
        assert_eq!((meta.uid(), meta.gid()), (5_000_005, 5_000_007));
        assert!(denied.is_err(), "the idmapped copy is read-only");
        // The file on disk is unchanged.
        assert_eq!(std::fs::metadata(&file).unwrap().uid(), 200_005);
    }

    #[test]
    fn a_bad_map_is_an_error_not_a_namespace() {
        if !is_root() {
            eprintln!("skipped: needs root");
            return;
        }
        assert!(user_namespace("garbage", "0 1 1").is_err());
    }
}
