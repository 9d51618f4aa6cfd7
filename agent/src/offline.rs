//! `sbx-agent offline`: one copy into or out of a sandbox whose workload does not run — before
//! its first start (`sbx sandbox create --upload`) or after a stop — on the host, by the
//! driver, with no container around it.
//!
//! The files of a stopped sandbox are on the host's disk, so a copy needs no sandbox running,
//! but it must resolve paths the way the sandbox would, and must not be able to write or read
//! anything else: a symlink the workload left (`/sandbox/x -> /etc/shadow`) must point into
//! the sandbox, as it does inside it. So the agent, started by host root with the driver's end
//! of the copy as a connected socket on fd 3:
//! 1. enters a mount namespace of its own (private propagation: nothing it mounts is seen
//!    by the host, and everything goes when it exits, whatever becomes of the driver);
//! 2. mounts the sandbox's root filesystem at MOUNTPOINT the way a run would — an oci
//!    sandbox's overlay (`--overlay OPTIONS`: its image's layers under its writable layer),
//!    or, for a process sandbox (whose root is the host's, not its own), an empty tmpfs — and
//!    its persistent directory (`--bind DIR`) at `/sandbox` on top;
//! 3. `chroot`s there, so that every path and symlink resolves inside it;
//! 4. drops to the uid and gid that the sandbox's root is on the host (`--uid`, `--gid`),
//!    with no supplementary groups and so no capabilities: what it writes belongs to the
//!    sandbox's root, and what the host's permissions forbid that user stays forbidden;
//! 5. serves the one copy request on fd 3 with the same code as a running sandbox's agent
//!    (`server::serve_copy`), then exits.

use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, unshare};
use nix::unistd::{Gid, Uid, chdir, chroot, setgroups, setresgid, setresuid};

/// The descriptor the driver hands its end of the copy on.
const CONN_FD: i32 = 3;

/// What `sbx-agent offline` was asked.
#[derive(Debug, PartialEq, Eq)]
pub struct Args {
    /// The overlay's mount options (`lowerdir=…,upperdir=…,workdir=…`); none: an empty tmpfs.
    pub overlay: Option<String>,
    /// The sandbox's persistent directory, bound at `/sandbox`.
    pub sandbox: PathBuf,
    pub uid: u32,
    pub gid: u32,
    pub mountpoint: PathBuf,
}

pub const USAGE: &str = "usage: sbx-agent offline [--overlay OPTIONS] --bind DIR --uid UID \
                         --gid GID MOUNTPOINT, with a connected socket on fd 3";

/// Parses the arguments after `offline`.
pub fn parse(args: &[String]) -> Result<Args, String> {
    let (mut overlay, mut sandbox) = (None, None);
    let (mut uid, mut gid, mut mountpoint) = (None, None, None);
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value; {USAGE}"))
        };
        let id = |name: &str, v: String| {
            v.parse::<u32>()
                .map_err(|_| format!("{name} {v:?} is not a number"))
        };
        match arg.as_str() {
            "--overlay" => overlay = Some(value("--overlay")?),
            "--bind" => sandbox = Some(PathBuf::from(value("--bind")?)),
            "--uid" => uid = Some(id("--uid", value("--uid")?)?),
            "--gid" => gid = Some(id("--gid", value("--gid")?)?),
            other if other.starts_with('-') => return Err(format!("unknown option {other:?}")),
            other if mountpoint.is_none() => mountpoint = Some(PathBuf::from(other)),
            other => return Err(format!("unexpected argument {other:?}; {USAGE}")),
        }
    }
    let missing = |what: &str| format!("{what} is missing; {USAGE}");
    let args = Args {
        overlay,
        sandbox: sandbox.ok_or_else(|| missing("--bind"))?,
        uid: uid.ok_or_else(|| missing("--uid"))?,
        gid: gid.ok_or_else(|| missing("--gid"))?,
        mountpoint: mountpoint.ok_or_else(|| missing("MOUNTPOINT"))?,
    };
    // Host root's ids are never the sandbox's root.
    if args.uid == 0 || args.gid == 0 {
        return Err("--uid and --gid must be the sandbox's mapped ids, never 0".to_string());
    }
    Ok(args)
}

/// Steps 1–4 of the module docs: after this the process sees only the sandbox's files, as
/// the sandbox's root without capabilities.
pub fn enter(args: &Args) -> Result<(), String> {
    unshare(CloneFlags::CLONE_NEWNS).map_err(|e| format!("a mount namespace: {e}"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("making the mounts private: {e}"))?;
    let at = &args.mountpoint;
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    match &args.overlay {
        Some(options) => mount(
            Some("overlay"),
            at,
            Some("overlay"),
            nosuid,
            Some(options.as_str()),
        )
        .map_err(|e| format!("mounting the sandbox's overlay at {}: {e}", at.display()))?,
        None => mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nosuid | MsFlags::MS_NOEXEC,
            Some("mode=0755,size=1m"),
        )
        .map_err(|e| format!("mounting a tmpfs at {}: {e}", at.display()))?,
    }
    // Where a run mounts it too (the runtime makes the mount point in the writable layer).
    let inside = at.join("sandbox");
    match std::fs::symlink_metadata(&inside) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => {
            return Err("/sandbox in the sandbox's root filesystem is not a directory".to_string());
        }
        Err(_) => {
            std::fs::create_dir(&inside).map_err(|e| format!("making {}: {e}", inside.display()))?
        }
    }
    mount(
        Some(args.sandbox.as_path()),
        &inside,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REC,
        None::<&str>,
    )
    .map_err(|e| format!("binding {} at /sandbox: {e}", args.sandbox.display()))?;
    if args.overlay.is_none() {
        // Nothing outside /sandbox is the sandbox's: a copy there fails instead of landing
        // in a tmpfs that goes with this process.
        mount(
            None::<&str>,
            at,
            None::<&str>,
            MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | nosuid | MsFlags::MS_NOEXEC,
            Some("mode=0755,size=1m"),
        )
        .map_err(|e| format!("making the tmpfs at {} read-only: {e}", at.display()))?;
    }
    chroot(at.as_path()).map_err(|e| format!("chroot to {}: {e}", at.display()))?;
    chdir("/").map_err(|e| format!("chdir to the new root: {e}"))?;
    setgroups(&[]).map_err(|e| format!("dropping supplementary groups: {e}"))?;
    let (uid, gid) = (Uid::from_raw(args.uid), Gid::from_raw(args.gid));
    setresgid(gid, gid, gid).map_err(|e| format!("becoming gid {gid}: {e}"))?;
    setresuid(uid, uid, uid).map_err(|e| format!("becoming uid {uid}: {e}"))?;
    // Uid 0 with capabilities is gone for good: a non-root uid after setresuid has none.
    if nix::unistd::setuid(Uid::from_raw(0)).is_ok() {
        return Err("still able to become root after dropping privileges".to_string());
    }
    Ok(())
}

/// `sbx-agent offline …`: enter the sandbox's files (see [`enter`]) and serve one copy.
pub fn run(args: &[String]) -> Result<(), String> {
    let args = parse(args)?;
    let conn = inherited_conn()?;
    enter(&args)?;
    crate::server::serve_copy(conn).map_err(|e| format!("the copy: {e}"))
}

/// The connected socket on fd 3, checked to be one.
#[allow(unsafe_code)]
fn inherited_conn() -> Result<UnixStream, String> {
    use rustix::fs::FileType;
    use rustix::io::FdFlags;
    // SAFETY: descriptor 3 is handed to this process by the driver for this purpose; it is
    // checked to be an open socket before it is owned, and nothing else owns it.
    let borrowed = unsafe { rustix::fd::BorrowedFd::borrow_raw(CONN_FD) };
    let stat = rustix::fs::fstat(borrowed).map_err(|e| format!("fd {CONN_FD}: {e}"))?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::Socket {
        return Err(format!("fd {CONN_FD} is not a socket"));
    }
    rustix::io::fcntl_setfd(borrowed, FdFlags::CLOEXEC).map_err(|e| e.to_string())?;
    // SAFETY: as above; from here the descriptor is owned by the stream alone.
    let owned = unsafe { OwnedFd::from_raw_fd(CONN_FD) };
    Ok(UnixStream::from(owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(args: &[&str]) -> Vec<String> {
        args.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn arguments_are_parsed_and_root_ids_refused() {
        let args = parse(&strings(&[
            "--bind", "/d", "--uid", "200000", "--gid", "200001", "/m",
        ]))
        .unwrap();
        assert_eq!(
            args,
            Args {
                overlay: None,
                sandbox: "/d".into(),
                uid: 200000,
                gid: 200001,
                mountpoint: "/m".into()
            }
        );
        let overlay = parse(&strings(&[
            "--overlay",
            "lowerdir=/a,upperdir=/b,workdir=/c",
            "--bind",
            "/v",
            "--uid",
            "1",
            "--gid",
            "1",
            "/m",
        ]))
        .unwrap();
        assert_eq!(
            overlay.overlay.as_deref(),
            Some("lowerdir=/a,upperdir=/b,workdir=/c")
        );
        for bad in [
            &["--bind", "/d", "--uid", "0", "--gid", "1", "/m"][..],
            &["--bind", "/d", "--uid", "1", "--gid", "1"],
            &["--uid", "1", "--gid", "1", "/m"],
            &["--overlay", "o", "--uid", "1", "--gid", "1", "/m"],
            &["--bind", "/d", "--uid", "x", "--gid", "1", "/m"],
            &["--bind", "/d", "--uid", "1", "--gid", "1", "/m", "/n"],
            &["--bind"],
        ] {
            assert!(parse(&strings(bad)).is_err(), "{bad:?}");
        }
    }
}
