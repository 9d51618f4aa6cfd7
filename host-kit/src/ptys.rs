//! The devpts instance an oci sandbox's exec terminals come from, and the pty budget of a
//! sandbox.
//!
//! An exec with a terminal gets a pty from the agent. From the sandbox's own `/dev/pts` it
//! would be a file of the sandbox's user, which the workload (root of the sandbox, or the same
//! user as the exec) could open by path or through `/proc/<pid>/fd` and read an operator's
//! keystrokes from, or write into their terminal. So the driver mounts a devpts instance of
//! its own, as host root, for each launch: `mode=0600,uid=0,gid=0` makes every pty of it host
//! root's, an owner the sandbox's user namespace does not map, so no process of the sandbox —
//! root inside included — opens one by any path; `ptmxmode=0666` lets the agent make them,
//! and it opens each terminal's side through its master (`TIOCGPTPEER`), never by path.
//!
//! **The pty budget.** The kernel has one count of ptys for the whole host (`kernel.pty.max`,
//! 4096) and keeps the last `kernel.pty.reserve` (1024) of it for devpts instances mounted
//! from the host's initial mount namespace — the host's own `/dev/pts` among them. An
//! instance mounted from any other mount namespace stops at `max - reserve` (3072), so it can
//! never take the host's reserve. A sandbox's own `/dev/pts` is mounted by the runtime inside
//! the container's mount namespace (and the process driver's inside the sandbox's), so it
//! draws on the shared part; the exec instance is the driver's, and a plain `mount` of it
//! from the host's namespace would draw on the reserve — 19 sandboxes opening 64 ptys each
//! through its `ptmx` left the host's own `openpty()` failing. So [`mount_exec_devpts`] makes
//! the instance in a mount namespace of its own (a thread that unshares its mount namespace,
//! `fsopen`, `fsmount`: the instance's reserve right is fixed when its context is made) and
//! attaches the detached mount at its place in the host's namespace (`move_mount`). And each
//! instance, the sandbox's and the exec one, holds at most `--max-ptys` ptys (`max=`, 128 by
//! default): one sandbox cannot take the shared part from the others either.
//!
//! The container sees it at [`EXEC_PTS_MOUNT`] (a bind mount the runtime makes), so an exec's
//! `tty` names its terminal there. Nothing of it stays mounted on the host: once the runtime
//! has made the container's mounts, the driver detaches its own (the container's mount keeps
//! the instance, which goes away with the container). The process driver's shim mounts its
//! own in the sandbox's mount namespace, over `/dev/pts` there.

use std::os::fd::OwnedFd;
use std::path::Path;

use nix::mount::MntFlags;
use rustix::mount::{FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags};

use sbx_driver_api::DriverError;

/// The ptys one devpts instance of a sandbox holds by default (`--max-ptys`): its own
/// `/dev/pts`, and the exec instance, each.
pub const DEFAULT_MAX_PTYS: u32 = 128;

/// The mount options of an exec devpts instance (see the module docs), `max` ptys at most.
pub fn exec_devpts_options(max: u32) -> String {
    format!("newinstance,ptmxmode=0666,mode=0600,uid=0,gid=0,max={max}")
}

/// How an exec refused for want of a terminal begins its message (the driver counts these).
pub const PTYS_SPENT: &str = "the sandbox's pty budget is spent";

/// Exec terminals refused per sandbox for want of a pty, since this process began to count.
static REFUSED: std::sync::Mutex<Option<std::collections::HashMap<uuid::Uuid, u64>>> =
    std::sync::Mutex::new(None);

/// Counts `error` if it is an exec refused for want of a terminal of the sandbox `id`.
pub fn note_refusal(id: uuid::Uuid, error: &DriverError) {
    if matches!(error, DriverError::FailedPrecondition(m) if m.starts_with(PTYS_SPENT)) {
        *sbx_driver_api::locked(&REFUSED)
            .get_or_insert_with(Default::default)
            .entry(id)
            .or_insert(0) += 1;
    }
}

/// How many exec terminals the sandbox `id` was refused (see [`note_refusal`]).
pub fn refused(id: uuid::Uuid) -> u64 {
    sbx_driver_api::locked(&REFUSED)
        .as_ref()
        .and_then(|m| m.get(&id).copied())
        .unwrap_or(0)
}

/// Forgets the count of a deleted sandbox.
pub fn forget(id: uuid::Uuid) {
    if let Some(m) = sbx_driver_api::locked(&REFUSED).as_mut() {
        m.remove(&id);
    }
}

/// Where an oci sandbox sees its exec devpts instance.
pub const EXEC_PTS_MOUNT: &str = "/dev/.sbx-pts";

/// `--max-ptys`: at least 1, at most the kernel's own ceiling for an instance that cannot
/// take the reserve (3072 of the default 4096).
pub fn parse_max_ptys(text: &str) -> Result<u32, String> {
    match text.parse::<u32>() {
        Ok(n @ 1..=3072) => Ok(n),
        _ => Err(format!(
            "{text:?} is not a number of ptys from 1 to 3072 (the most a devpts instance outside \
             the host's mount namespace can hold)"
        )),
    }
}

/// Mounts a new devpts instance of at most `max` ptys for a sandbox's execs at `at` (made if
/// missing), after detaching any a killed driver left there. The instance is made in a mount
/// namespace of its own, so it never draws on the host's reserve of ptys.
pub fn mount_exec_devpts(at: &Path, max: u32) -> Result<(), DriverError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        DriverError::Internal(format!("{what} {}: {e}", at.display()))
    };
    std::fs::create_dir_all(at).map_err(|e| fail("making", &e))?;
    detach_exec_devpts(at);
    let mount = std::thread::Builder::new()
        .name("sbx-devpts".into())
        .stack_size(64 * 1024)
        .spawn(move || detached_devpts(max))
        .map_err(|e| fail("starting the thread that makes the devpts instance for", &e))?
        .join()
        .map_err(|_| fail("making the devpts instance for", &"its thread panicked"))?
        .map_err(|e| fail("making a devpts instance for", &e))?;
    rustix::mount::move_mount(
        &mount,
        "",
        rustix::fs::CWD,
        at,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )
    .map_err(|e| fail("attaching the devpts instance at", &e))
}

/// A devpts instance of at most `max` ptys, detached, made by the calling thread once it has
/// left the host's mount namespace (the thread must be one of its own: it never comes back).
fn detached_devpts(max: u32) -> std::io::Result<OwnedFd> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    let fs = rustix::mount::fsopen("devpts", FsOpenFlags::FSOPEN_CLOEXEC)?;
    for (key, value) in [
        ("ptmxmode", "0666"),
        ("mode", "0600"),
        ("uid", "0"),
        ("gid", "0"),
        ("max", &max.to_string()),
    ] {
        rustix::mount::fsconfig_set_string(&fs, key, value)?;
    }
    rustix::mount::fsconfig_create(&fs)?;
    Ok(rustix::mount::fsmount(
        &fs,
        FsMountFlags::FSMOUNT_CLOEXEC,
        MountAttrFlags::MOUNT_ATTR_NOSUID | MountAttrFlags::MOUNT_ATTR_NOEXEC,
    )?)
}

/// Detaches every mount at `at` (none: nothing to do); a sandbox that holds the instance
/// keeps it.
pub fn detach_exec_devpts(at: &Path) {
    // Bounded: a mount point holds at most the few a killed driver could have stacked.
    for _ in 0..16 {
        if nix::mount::umount2(at, MntFlags::MNT_DETACH).is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The instance's ptys are host root's with mode 0600, made through its `ptmx` and opened
    /// through their master; detached, nothing stays mounted, and an open master keeps
    /// working. Needs root (mount); skipped, and said, without it.
    #[test]
    fn an_exec_devpts_makes_root_only_ptys_and_detaches_whole() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("needs root to mount devpts");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let at = dir.path().join("exec-pts");
        mount_exec_devpts(&at, 8).unwrap();
        // Twice: the second replaces the first rather than stacking on it.
        mount_exec_devpts(&at, 8).unwrap();
        let master = rustix::fs::open(
            at.join("ptmx"),
            rustix::fs::OFlags::RDWR | rustix::fs::OFlags::NOCTTY,
            rustix::fs::Mode::empty(),
        )
        .unwrap();
        rustix::pty::unlockpt(&master).unwrap();
        let slave =
            rustix::pty::ioctl_tiocgptpeer(&master, rustix::pty::OpenptFlags::RDWR).unwrap();
        let st = rustix::fs::fstat(&slave).unwrap();
        assert_eq!((st.st_uid, st.st_gid), (0, 0));
        assert_eq!(st.st_mode & 0o777, 0o600);
        detach_exec_devpts(&at);
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        assert!(
            !mounts.contains(&*at.to_string_lossy()),
            "a mount stays at {}",
            at.display()
        );
        rustix::io::write(&slave, b"still a terminal\n").unwrap();
    }
}
