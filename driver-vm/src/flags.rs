//! The vm driver's flags (`--vm-*`, with their `SBX_VM_*` variables): `sbxd serve` and a
//! driver host (`sbxd driver`, `sbxd node`) take them through the driver registry, so the same
//! flags set up an in-process, a managed and a hosted vm driver; a managed driver host is
//! passed them again ([`VmArgs::to_flags`]).

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::{Accel, AssetPaths, VmDriverOptions};

/// The smallest guest memory the vm flags take: a Debian kernel and the busybox initramfs
/// do not boot in less (the vm driver raises a sandbox's own request to the same floor).
pub const VM_MIN_MEMORY_MIB: u64 = 256;
/// The largest guest memory the vm flags take (1 TiB): beyond it is surely a typo.
pub const VM_MAX_MEMORY_MIB: u64 = 1024 * 1024;
/// The smallest persistent disk: an ext4 file system with its journal needs a few MiB.
pub const VM_MIN_DISK_MIB: u64 = 16;
/// The largest persistent disk the flags take (16 TiB; the image is sparse).
pub const VM_MAX_DISK_MIB: u64 = 16 * 1024 * 1024;
/// The default of --vm-boot-timeout, in seconds (the driver's own default).
pub const VM_DEFAULT_BOOT_TIMEOUT_SECS: u64 = 45;
/// The longest --vm-boot-timeout, in seconds.
pub const VM_MAX_BOOT_TIMEOUT_SECS: u64 = 3600;

/// The vm driver's settings: flags of `sbxd serve` (for `--driver vm` and `managed:vm`, which
/// passes them on to its driver process) and of `sbxd driver --backend vm`. Unused by the
/// other drivers.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "vm driver")]
pub struct VmArgs {
    /// How QEMU runs guests: `kvm` (hardware virtualization through /dev/kvm), `tcg` (QEMU's
    /// emulator: works everywhere, a boot takes seconds), or `auto`: KVM when a probe boot
    /// under KVM works at startup, else TCG (on machines whose /dev/kvm cannot boot a stock
    /// kernel, e.g. PVM, the probe fails fast).
    #[arg(
        long = "vm-accel",
        env = "SBX_VM_ACCEL",
        default_value = "auto",
        value_parser = parse_vm_accel,
        value_name = "auto|kvm|tcg"
    )]
    pub accel: Accel,

    /// Guest memory in MiB for sandboxes whose spec asks for none (at least 256).
    #[arg(
        long = "vm-memory-mib",
        env = "SBX_VM_MEMORY_MIB",
        default_value_t = 256,
        value_parser = parse_vm_memory_mib,
        value_name = "MIB"
    )]
    pub memory_mib: u64,

    /// Size in MiB of a new sandbox's persistent disk (`/sandbox` in the guest; a sparse
    /// ext4 image, at least 16). Existing disks keep their size.
    #[arg(
        long = "vm-disk-mib",
        env = "SBX_VM_DISK_MIB",
        default_value_t = 256,
        value_parser = parse_vm_disk_mib,
        value_name = "MIB"
    )]
    pub disk_mib: u64,

    /// Seconds a boot may take until the guest runs the sandbox's command; a guest that
    /// takes longer is ended and the create or start fails (and is retried). Under TCG on a
    /// loaded machine a boot can take tens of seconds. sbxd's default --driver-call-timeout
    /// for the vm driver is this plus 15 s.
    #[arg(
        long = "vm-boot-timeout",
        env = "SBX_VM_BOOT_TIMEOUT",
        default_value_t = VM_DEFAULT_BOOT_TIMEOUT_SECS,
        value_parser = parse_vm_boot_timeout,
        value_name = "SECS"
    )]
    pub boot_timeout_secs: u64,

    /// The guest kernel (a bzImage or an ELF vmlinux). Default: the newest /boot/vmlinuz-*
    /// whose modules are in /lib/modules (Debian's linux-image-amd64).
    #[arg(long = "vm-kernel", env = "SBX_VM_KERNEL", value_name = "PATH")]
    pub kernel: Option<PathBuf>,

    /// The kernel's modules directory (virtio and ext4 modules go into the initramfs).
    /// Default: /lib/modules/VERSION of the kernel.
    #[arg(
        long = "vm-modules-dir",
        env = "SBX_VM_MODULES_DIR",
        value_name = "DIR"
    )]
    pub modules_dir: Option<PathBuf>,

    /// A statically linked busybox, the guest's userland. Default: /bin/busybox (Debian's
    /// busybox-static).
    #[arg(long = "vm-busybox", env = "SBX_VM_BUSYBOX", value_name = "PATH")]
    pub busybox: Option<PathBuf>,

    /// Where the unpacked kernel and the shared initramfs are cached (made at startup,
    /// which takes seconds the first time). Default: STATE_DIR/assets. Several drivers may
    /// share one.
    #[arg(
        long = "vm-asset-cache",
        env = "SBX_VM_ASSET_CACHE",
        value_name = "DIR"
    )]
    pub asset_cache: Option<PathBuf>,

    /// The QEMU binary. Default: qemu-system-x86_64 on PATH.
    #[arg(long = "vm-qemu", env = "SBX_VM_QEMU", value_name = "PATH")]
    pub qemu: Option<PathBuf>,
}

impl Default for VmArgs {
    fn default() -> Self {
        VmArgs {
            accel: Accel::Auto,
            memory_mib: 256,
            disk_mib: 256,
            boot_timeout_secs: VM_DEFAULT_BOOT_TIMEOUT_SECS,
            kernel: None,
            modules_dir: None,
            busybox: None,
            asset_cache: None,
            qemu: None,
        }
    }
}

impl VmArgs {
    pub fn boot_timeout(&self) -> Duration {
        Duration::from_secs(self.boot_timeout_secs)
    }

    /// The driver's options: these settings, and the driver's defaults for the rest.
    pub fn driver_options(&self) -> VmDriverOptions {
        VmDriverOptions {
            assets: AssetPaths {
                kernel: self.kernel.clone(),
                modules_dir: self.modules_dir.clone(),
                busybox: self.busybox.clone(),
            },
            asset_cache: self.asset_cache.clone(),
            qemu: self.qemu.clone(),
            accel: self.accel,
            memory_mib: self.memory_mib,
            disk_mib: self.disk_mib,
            boot_timeout: self.boot_timeout(),
            ..VmDriverOptions::default()
        }
    }

    /// The paths among these flags that a relative value must be made absolute in (once, at
    /// start, against the current directory): the kernel, its modules and the busybox.
    pub fn paths_mut(&mut self) -> Vec<&mut PathBuf> {
        [&mut self.kernel, &mut self.modules_dir, &mut self.busybox]
            .into_iter()
            .flatten()
            .collect()
    }

    /// These settings as command-line flags, for a driver process sbxd starts: parsing them
    /// (in the same environment, which the child inherits) gives these settings back.
    pub fn to_flags(&self) -> Vec<OsString> {
        let mut flags: Vec<OsString> = vec![
            "--vm-accel".into(),
            accel_name(self.accel).into(),
            "--vm-memory-mib".into(),
            self.memory_mib.to_string().into(),
            "--vm-disk-mib".into(),
            self.disk_mib.to_string().into(),
            "--vm-boot-timeout".into(),
            self.boot_timeout_secs.to_string().into(),
        ];
        let paths = [
            ("--vm-kernel", &self.kernel),
            ("--vm-modules-dir", &self.modules_dir),
            ("--vm-busybox", &self.busybox),
            ("--vm-asset-cache", &self.asset_cache),
            ("--vm-qemu", &self.qemu),
        ];
        for (flag, path) in paths {
            if let Some(path) = path {
                flags.push(flag.into());
                flags.push(path.into());
            }
        }
        flags
    }
}

/// The flag value of an accelerator (what [`parse_vm_accel`] reads).
pub fn accel_name(accel: Accel) -> &'static str {
    match accel {
        Accel::Auto => "auto",
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg",
    }
}

/// Parses `--vm-accel` (clap's value parser).
pub fn parse_vm_accel(text: &str) -> Result<Accel, String> {
    text.trim().to_ascii_lowercase().parse()
}

pub fn parse_vm_memory_mib(text: &str) -> Result<u64, String> {
    sbx_host_kit::flags::parse_bounded(text, "MiB", VM_MIN_MEMORY_MIB, VM_MAX_MEMORY_MIB)
        .map_err(|e| format!("{e} (a guest needs {VM_MIN_MEMORY_MIB} MiB to boot)"))
}

/// Parses `--vm-disk-mib`.
pub fn parse_vm_disk_mib(text: &str) -> Result<u64, String> {
    sbx_host_kit::flags::parse_bounded(text, "MiB", VM_MIN_DISK_MIB, VM_MAX_DISK_MIB)
}

/// Parses `--vm-boot-timeout` (seconds, at least 1).
pub fn parse_vm_boot_timeout(text: &str) -> Result<u64, String> {
    sbx_host_kit::flags::parse_bounded(text, "seconds", 1, VM_MAX_BOOT_TIMEOUT_SECS)
}

#[cfg(test)]
mod flag_tests {
    use super::*;

    #[test]
    fn vm_values_parse_and_bad_ones_say_why() {
        assert_eq!(parse_vm_accel("tcg"), Ok(Accel::Tcg));
        assert_eq!(parse_vm_accel(" KVM "), Ok(Accel::Kvm));
        assert_eq!(parse_vm_accel("auto"), Ok(Accel::Auto));
        let err = parse_vm_accel("hvf").unwrap_err();
        assert!(err.contains("hvf") && err.contains("tcg"), "{err}");

        assert_eq!(parse_vm_memory_mib("256"), Ok(256));
        assert_eq!(parse_vm_disk_mib(" 16 "), Ok(16));
        assert_eq!(parse_vm_boot_timeout("1"), Ok(1));
        for (parse, bad, mentions) in [
            (
                parse_vm_memory_mib as fn(&str) -> Result<u64, String>,
                "255",
                "at least 256",
            ),
            (parse_vm_memory_mib, "2G", "not a whole number"),
            (parse_vm_memory_mib, "-1", "not a whole number"),
            (parse_vm_memory_mib, "1048577", "at most 1048576"),
            (parse_vm_disk_mib, "15", "at least 16"),
            (parse_vm_disk_mib, "", "not a whole number"),
            (parse_vm_boot_timeout, "0", "at least 1"),
            (parse_vm_boot_timeout, "3601", "at most 3600"),
            (parse_vm_boot_timeout, "1.5", "not a whole number"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(mentions), "{bad:?}: {err}");
        }
    }

    #[test]
    fn the_kernel_modules_and_busybox_are_made_absolute() {
        let mut args = VmArgs {
            kernel: Some(PathBuf::from("k")),
            busybox: Some(PathBuf::from("/abs/bb")),
            qemu: Some(PathBuf::from("q")),
            ..VmArgs::default()
        };
        let paths: Vec<PathBuf> = args.paths_mut().into_iter().map(|p| p.clone()).collect();
        assert_eq!(paths, [PathBuf::from("k"), PathBuf::from("/abs/bb")]);
    }
}
