//! The devpts instance an oci sandbox's exec terminals come from.
//!
//! An exec with a terminal gets a pty from the agent. From the sandbox's own `/dev/pts` it
//! would be a file of the sandbox's user, which the workload (root of the sandbox, or the same
//! user as the exec) could open by path or through `/proc/<pid>/fd` and read an operator's
//! keystrokes from, or write into their terminal. So the driver mounts a devpts instance of
//! its own, as host root, for each launch: `mode=0600,uid=0,gid=0` makes every pty of it host
//! root's, an owner the sandbox's user namespace does not map, so no process of the sandbox —
//! root inside included — opens one by any path; `ptmxmode=0666` lets the agent make them,
//! and it opens each terminal's side through its master (`TIOCGPTPEER`), never by path.
//! `max=64` keeps one sandbox from taking the host's ptys.
//!
//! The container sees it at [`EXEC_PTS_MOUNT`] (a bind mount the runtime makes), so an exec's
//! `tty` names its terminal there. Nothing of it stays mounted on the host: once the runtime
//! has made the container's mounts, the driver detaches its own (the container's mount keeps
//! the instance, which goes away with the container). The process driver's shim mounts its
//! own in the sandbox's mount namespace, over `/dev/pts` there.

use std::path::Path;

use nix::mount::{MntFlags, MsFlags};

use sbx_driver_api::DriverError;

/// The mount options of an exec devpts instance (see the module docs).
pub const EXEC_DEVPTS_OPTIONS: &str = "newinstance,ptmxmode=0666,mode=0600,uid=0,gid=0,max=64";

/// Where an oci sandbox sees its exec devpts instance.
pub const EXEC_PTS_MOUNT: &str = "/dev/.sbx-pts";

/// Mounts a new devpts instance for a sandbox's execs at `at` (made if missing), after
/// detaching any a killed driver left there.
pub fn mount_exec_devpts(at: &Path) -> Result<(), DriverError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        DriverError::Internal(format!("{what} {}: {e}", at.display()))
    };
    std::fs::create_dir_all(at).map_err(|e| fail("making", &e))?;
    detach_exec_devpts(at);
    nix::mount::mount(
        Some("sbx-exec-pts"),
        at,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some(EXEC_DEVPTS_OPTIONS),
    )
    .map_err(|e| fail("mounting a devpts instance at", &e))
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
        mount_exec_devpts(&at).unwrap();
        // Twice: the second replaces the first rather than stacking on it.
        mount_exec_devpts(&at).unwrap();
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
