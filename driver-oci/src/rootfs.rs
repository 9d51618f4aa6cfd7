//! A sandbox's root filesystem: an overlay of its image's layers (read-only, shared by every
//! sandbox of the image) under a writable layer of its own, mounted on the host at the
//! bundle's `rootfs/` while the workload runs. The writable layer is kept until delete, so
//! every change to the root filesystem survives stop, start, restart and driver restarts.
//!
//! Also: who the image's `User` is, read from the sandbox's own `/etc/passwd` and
//! `/etc/group`, opened inside the rootfs (`openat2` with `RESOLVE_IN_ROOT`: a symlink in
//! the image cannot point the driver at a host file).

use std::path::{Path, PathBuf};

use std::os::fd::AsFd;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use super::mountinfo::is_mount_point;
use super::record::SandboxPaths;
use sbx_agent::user::ProcessUser;
use sbx_images::IdMap;

/// The overlay's mount options for these layers (lowest first) and writable dirs.
pub fn overlay_options(layers: &[PathBuf], upper: &Path, work: &Path) -> String {
    // overlayfs lists lower dirs highest first.
    let lower: Vec<String> = layers
        .iter()
        .rev()
        .map(|l| escape(&l.to_string_lossy()))
        .collect();
    format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.join(":"),
        escape(&upper.to_string_lossy()),
        escape(&work.to_string_lossy())
    )
}

/// Escapes the characters that separate overlay options and lower dirs.
fn escape(path: &str) -> String {
    path.replace('\\', "\\\\")
        .replace(':', "\\:")
        .replace(',', "\\,")
}

/// The longest mount data the kernel takes (one page).
const MAX_OPTIONS: usize = 4095;

/// Mounts the overlay at `rootfs` unless something is mounted there already.
pub fn mount_overlay(
    layers: &[PathBuf],
    upper: &Path,
    work: &Path,
    rootfs: &Path,
) -> Result<(), String> {
    if is_mount_point(rootfs) {
        return Ok(());
    }
    if layers.is_empty() {
        return Err("the image has no layers".to_string());
    }
    let options = overlay_options(layers, upper, work);
    if options.len() > MAX_OPTIONS {
        return Err(format!(
            "the image has too many layers for one overlay mount ({} layers, {} bytes of \
             options; the kernel takes {MAX_OPTIONS})",
            layers.len(),
            options.len()
        ));
    }
    mount(
        Some("overlay"),
        rootfs,
        Some("overlay"),
        MsFlags::empty(),
        Some(options.as_str()),
    )
    .map_err(|e| format!("mounting the root filesystem at {}: {e}", rootfs.display()))
}

/// Unmounts the sandbox's root filesystem if it is mounted, then its layers as its range sees
/// them (lazily: a process that still holds one keeps its view until it lets go, nothing is
/// left in the mount table).
pub fn unmount(paths: &SandboxPaths) -> Result<(), String> {
    sbx_host_kit::ptys::detach_exec_devpts(&paths.exec_pts);
    if is_mount_point(&paths.rootfs) {
        umount2(&paths.rootfs, MntFlags::MNT_DETACH)
            .map_err(|e| format!("unmounting {}: {e}", paths.rootfs.display()))?;
    }
    unmount_layers(&paths.lower)
}

/// The image's layers as a sandbox whose ids are `sandbox` sees them. The image store keeps
/// one copy of each layer, its owners shifted into `store` (the store's range); a sandbox with
/// a range of its own gets each layer as a read-only idmapped mount at `lower/<n>` (owner
/// `store + k` seen as `sandbox + k`), through a user namespace made for the mapping alone.
/// The overlay holds its own copies of its layers' mounts, so these are unmounted once it is
/// mounted; an offline copy's namespace copies them when it starts. With the store's own
/// range, the layers themselves.
pub fn mapped_layers(
    layers: &[PathBuf],
    store: IdMap,
    sandbox: IdMap,
    lower: &Path,
) -> Result<Vec<PathBuf>, String> {
    if store == sandbox {
        return Ok(layers.to_vec());
    }
    if sandbox.size > store.size {
        return Err(format!(
            "the sandbox's range ({} ids) is larger than the image store's ({})",
            sandbox.size, store.size
        ));
    }
    super::record::make_walkable_dir(lower)
        .map_err(|e| format!("making {}: {e}", lower.display()))?;
    let targets: Vec<PathBuf> = (0..layers.len())
        .map(|i| lower.join(i.to_string()))
        .collect();
    let mut namespace = None;
    for (layer, target) in layers.iter().zip(&targets) {
        if is_mount_point(target) {
            continue;
        }
        if namespace.is_none() {
            let map = |from: u32, to: u32| format!("{from} {to} {}\n", sandbox.size);
            namespace = Some(
                sbx_sys::user_namespace(
                    &map(store.host_uid, sandbox.host_uid),
                    &map(store.host_gid, sandbox.host_gid),
                )
                .map_err(|e| format!("making the user namespace of the sandbox's ids: {e}"))?,
            );
        }
        let ns = namespace.as_ref().expect("made above");
        super::record::make_walkable_dir(target)
            .map_err(|e| format!("making {}: {e}", target.display()))?;
        let tree = sbx_sys::idmapped_tree(layer, ns.as_fd())
            .map_err(|e| format!("an idmapped copy of layer {}: {e}", layer.display()))?;
        sbx_sys::attach(tree.as_fd(), target).map_err(|e| {
            format!(
                "mounting layer {} at {}: {e}",
                layer.display(),
                target.display()
            )
        })?;
    }
    Ok(targets)
}

/// Unmounts and removes the idmapped layers under `lower` (see [`mapped_layers`]).
pub fn unmount_layers(lower: &Path) -> Result<(), String> {
    let Ok(entries) = std::fs::read_dir(lower) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let target = entry.path();
        if is_mount_point(&target) {
            umount2(&target, MntFlags::MNT_DETACH)
                .map_err(|e| format!("unmounting {}: {e}", target.display()))?;
        }
        let _ = std::fs::remove_dir(&target);
    }
    Ok(())
}

/// Reads a small file of the rootfs (at most 4 MiB), resolved inside it: the sandbox can write
/// its root filesystem, so through [`sbx_host_kit::safefs::read_in_root`] — symlinks cannot
/// leave it, and a FIFO or a device there is refused without blocking.
fn read_in_root(rootfs: &Path, path: &str) -> Option<String> {
    let bytes = sbx_host_kit::safefs::read_in_root(rootfs, Path::new(path), 4 << 20).ok()?;
    String::from_utf8(bytes).ok()
}

/// Resolves an image's `User` (`""`, `uid`, `uid:gid`, `name`, `name:group`, …) against the
/// rootfs's `/etc/passwd` and `/etc/group`. A numeric uid without a gid takes the passwd
/// entry's group when there is one, else 0. A name that is not there is an error naming it.
pub fn resolve_user(user: &str, rootfs: &Path) -> Result<ProcessUser, String> {
    let passwd = || read_in_root(rootfs, "/etc/passwd").unwrap_or_default();
    let group = || read_in_root(rootfs, "/etc/group").unwrap_or_default();
    sbx_agent::user::resolve(user, passwd, group)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workloads_fifo_or_link_as_etc_passwd_neither_hangs_nor_reads_the_host() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::create_dir(root.join("etc")).unwrap();
        // A FIFO where the user's name is looked up: the start would hang on the open.
        nix::unistd::mkfifo(&root.join("etc/passwd"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let started = std::time::Instant::now();
        let err = resolve_user("app", root).unwrap_err();
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert!(err.contains("not in the image's /etc/passwd"), "{err}");
        // A link to the host's /etc/passwd resolves inside the rootfs: root, the host's
        // first user, is not found there.
        std::fs::remove_file(root.join("etc/passwd")).unwrap();
        std::os::unix::fs::symlink("/etc/passwd", root.join("etc/passwd")).unwrap();
        assert!(resolve_user("root", root).is_err());
        std::fs::remove_file(root.join("etc/passwd")).unwrap();
        std::fs::write(root.join("etc/passwd"), "app:x:1000:1000::/:/bin/sh\n").unwrap();
        assert_eq!(resolve_user("app", root).unwrap().uid, 1000);
    }

    #[test]
    fn overlay_options_list_the_highest_layer_first_and_escape() {
        let layers = vec![PathBuf::from("/l/1"), PathBuf::from("/l/a:b")];
        assert_eq!(
            overlay_options(&layers, Path::new("/u"), Path::new("/w,x")),
            "lowerdir=/l/a\\:b:/l/1,upperdir=/u,workdir=/w\\,x"
        );
    }

    #[test]
    fn files_are_read_inside_the_root_only() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::write(tmp.path().join("secret"), "host file").unwrap();
        // An absolute symlink in the image resolves inside the root, not on the host.
        std::os::unix::fs::symlink(tmp.path().join("secret"), root.join("etc/passwd")).unwrap();
        assert_eq!(read_in_root(&root, "/etc/passwd"), None);
        std::os::unix::fs::symlink("../../secret", root.join("etc/group")).unwrap();
        assert_eq!(read_in_root(&root, "/etc/group"), None);
        std::fs::write(root.join("etc/hosts"), "inside").unwrap();
        assert_eq!(read_in_root(&root, "/etc/hosts").as_deref(), Some("inside"));
    }
}
