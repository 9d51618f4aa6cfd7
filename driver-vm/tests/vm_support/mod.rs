//! What the vm driver's tests share: a driver on a temporary state directory, with the guest's
//! kernel and initramfs cached once for every test (unpacking the kernel takes seconds), and
//! the clean-up check that no VM of the test is left running.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use sbx_driver_vm::{VmDriver, VmDriverOptions};

pub struct VmEnv {
    pub state: tempfile::TempDir,
}

/// The asset cache shared by the tests of this machine.
pub fn asset_cache() -> PathBuf {
    std::env::temp_dir().join("sbx-vm-test-assets")
}

pub fn options() -> VmDriverOptions {
    VmDriverOptions {
        asset_cache: Some(asset_cache()),
        // Boots under TCG on a loaded 2-core machine can take a while.
        boot_timeout: Duration::from_secs(90),
        default_grace: Duration::from_secs(2),
        poll_interval: Duration::from_millis(200),
        ..VmDriverOptions::default()
    }
}

impl VmEnv {
    pub fn new() -> VmEnv {
        VmEnv {
            state: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub async fn open(&self) -> VmDriver {
        self.open_with(options()).await
    }

    /// A driver with `images` as its image store.
    pub async fn open_with_images(&self, images: sbx_images::ImageStore) -> VmDriver {
        self.open_with(VmDriverOptions {
            images: Some(images),
            root_free_mib: 256,
            ..options()
        })
        .await
    }

    pub async fn open_with(&self, opts: VmDriverOptions) -> VmDriver {
        VmDriver::open(self.state.path().to_path_buf(), opts)
            .await
            .unwrap_or_else(|e| {
                panic!("the vm driver did not open (CI installs qemu-system-x86, qemu-utils, linux-image-amd64, busybox-static): {e}")
            })
    }

    /// No QEMU process of this test's state directory is left running.
    pub fn assert_no_vm_left(&self) {
        let left: Vec<String> = self
            .vms_left()
            .into_iter()
            .map(|(pid, cmdline)| format!("{pid}: {cmdline}"))
            .collect();
        assert!(left.is_empty(), "vms left running: {left:?}");
    }

    /// The QEMU processes of this test's state directory (pid, command line).
    fn vms_left(&self) -> Vec<(i32, String)> {
        let state = self.state.path().display().to_string();
        let mut left = Vec::new();
        for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
                continue;
            };
            let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // QEMU names no path of the host's (its files are descriptors): its working
            // directory, the sandbox's `chan/`, says whose it is.
            let cwd = std::fs::read_link(entry.path().join("cwd")).unwrap_or_default();
            if cmdline.contains("qemu-system")
                && (cmdline.contains(&state) || cwd.starts_with(&state))
            {
                left.push((pid, cmdline));
            }
        }
        left
    }
}

/// A test that fails half-way leaves its VMs (daemonized, they outlive the driver): they are
/// ended with the test's state directory, by pid (only QEMUs booted on that directory).
impl Drop for VmEnv {
    fn drop(&mut self) {
        for (pid, _) in self.vms_left() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// The static busybox the image tests import (Debian's busybox-static).
pub fn busybox() -> PathBuf {
    sbx_images::find_static_busybox(None, &sbx_images::BUSYBOX_PATHS)
        .expect("these tests need busybox-static")
}
