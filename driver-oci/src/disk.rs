//! A sandbox's disk limit: its writable root layer (`upper/`, `work/`) and its volume
//! (`/sandbox`) live on one ext4 filesystem of the limit's size, in a sparse image file
//! `<dir>/disk.img` mounted on a loop device at `<dir>/disk/` (nodev, nosuid). The kernel
//! enforces it: a write past it fails with ENOSPC inside, and the host's disk holds at most
//! the image's size for the sandbox. Chosen over project quotas because it needs nothing of
//! the host's filesystem (the data dir may be on any filesystem, quotas on or off) and is
//! removed with the sandbox; the cost is one loop device and one mount per sandbox with a
//! limit. Without a limit `<dir>/disk/` is a plain directory.
//!
//! The mount is made at create, kept across stops and driver restarts (made again at open if
//! the host rebooted), and unmounted at delete before the directory goes.

use std::path::Path;
use std::process::Command;

use sbx_driver_api::DriverError;

/// The image file of a sandbox directory's disk.
pub fn image(dir: &Path) -> std::path::PathBuf {
    dir.join("disk.img")
}

/// Makes the disk of `bytes` at `mount_point` (the sandbox directory's `disk/`), its root
/// directory private to the sandbox (`record::make_private`, by the caller), and mounts it.
pub fn make(dir: &Path, mount_point: &Path, bytes: u64) -> Result<(), DriverError> {
    let img = image(dir);
    use std::os::unix::fs::OpenOptionsExt;
    // 0600: the image holds every file of the sandbox.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&img)
        .map_err(|e| fail(&format!("making {}", img.display()), e))?;
    file.set_len(bytes)
        .map_err(|e| fail(&format!("sizing {}", img.display()), e))?;
    drop(file);
    // -m 0: nothing reserved for root (the sandbox's root is not host root anyway); lazy
    // init: mkfs writes only the metadata it needs, the image stays sparse.
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-E"])
        .arg("lazy_itable_init=1,lazy_journal_init=1,root_owner=0:0")
        .arg(&img))?;
    // Its root, which holds the writable dirs, is made the sandbox's own and private by the
    // caller (`record::make_private`).
    mount(dir, mount_point)
}

/// Mounts the disk at `mount_point` unless it is mounted there.
pub fn mount(dir: &Path, mount_point: &Path) -> Result<(), DriverError> {
    if super::mountinfo::is_mount_point(mount_point) {
        return Ok(());
    }
    std::fs::create_dir_all(mount_point)
        .map_err(|e| fail(&format!("making {}", mount_point.display()), e))?;
    // The loop device is attached with direct I/O from the start: without it every block
    // passes through the page cache twice (the disk's and the image file's; measured beside
    // the host's ext4: 0.73–0.81× its write speed without, 0.93–1.0× with), and turning it on
    // for a device already in use freezes its queue (15–25 ms a create, measured). A host
    // whose filesystem refuses O_DIRECT gets a buffered device. Once the disk is mounted,
    // `losetup -d` only marks the busy device autoclear: it goes with the unmount.
    let img = image(dir);
    let attach = |direct: bool| {
        let mut cmd = Command::new("losetup");
        cmd.args(["--find", "--show"]);
        if direct {
            cmd.arg("--direct-io=on");
        }
        run_output(cmd.arg(&img))
    };
    let device = match attach(true) {
        Ok(device) => device,
        Err(e) => {
            tracing::warn!(image = %img.display(), error = %e, "the disk's loop device is buffered");
            attach(false)?
        }
    };
    let mounted = run(Command::new("mount")
        .args(["-t", "ext4", "-o", "nodev,nosuid,noatime"])
        .arg(&device)
        .arg(mount_point));
    // Marks it autoclear once mounted; detaches it when the mount failed.
    let released = run(Command::new("losetup").args(["-d", &device]));
    mounted?;
    released
}

/// Unmounts the disk (lazily: a process that still holds it keeps it until it lets go; the
/// loop device is freed then).
pub fn unmount(mount_point: &Path) -> Result<(), DriverError> {
    if !super::mountinfo::is_mount_point(mount_point) {
        return Ok(());
    }
    nix::mount::umount2(mount_point, nix::mount::MntFlags::MNT_DETACH)
        .map_err(|e| DriverError::Internal(format!("unmounting {}: {e}", mount_point.display())))
}

fn run(cmd: &mut Command) -> Result<(), DriverError> {
    run_output(cmd).map(drop)
}

/// What `cmd` printed on stdout, trimmed, once it succeeded.
fn run_output(cmd: &mut Command) -> Result<String, DriverError> {
    let shown = format!("{cmd:?}");
    let out = cmd.output().map_err(|e| {
        DriverError::Unavailable(format!(
            "running {shown} (a disk limit needs e2fsprogs and util-linux): {e}"
        ))
    })?;
    if !out.status.success() {
        return Err(DriverError::Internal(format!(
            "{shown} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn fail(what: &str, e: std::io::Error) -> DriverError {
    DriverError::Internal(format!("{what}: {e}"))
}
