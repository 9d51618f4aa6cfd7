//! What a VM boots: the host's Debian kernel (`linux-image-amd64`), unpacked to an ELF
//! `vmlinux` when possible so QEMU boots it directly (PVH) instead of decompressing a bzImage
//! under emulation, and a shared initramfs holding a static busybox (`busybox-static`), the
//! kernel modules the guest needs (virtio-mmio, virtio-blk, ext4, virtio-console, the ACPI power
//! button), the guest init ([`INIT`]) and `sbx-agent` (the static binary the oci and process
//! drivers run too; in the guest it serves exec on a virtio-serial port). Both are prepared once per kernel/busybox/init and
//! cached under the driver's state directory. A missing piece is an error that names the
//! Debian package to install.

use std::collections::{BTreeMap, HashSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::UNIX_EPOCH;

use super::cpio::Archive;
use sbx_driver_api::DriverError;

/// The guest's pid 1.
pub const INIT: &str = include_str!("guest/init.sh");

/// The modules the guest loads, by name; each comes with its dependencies, loaded first.
const MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "crc32c_generic",
    "ext4",
    "virtio_console",
    "virtio_net",
    "button",
    "evdev",
];

/// Where to find what a VM boots; `None` means "look in the usual places".
#[derive(Debug, Clone, Default)]
pub struct AssetPaths {
    /// A kernel image (bzImage or ELF vmlinux). Default: the newest `/boot/vmlinuz-*` whose
    /// modules are in `/lib/modules`.
    pub kernel: Option<PathBuf>,
    /// The kernel's modules directory. Default: `/lib/modules/<version of the kernel>`.
    pub modules_dir: Option<PathBuf>,
    /// A statically linked busybox. Default: `/bin/busybox` (from `busybox-static`).
    pub busybox: Option<PathBuf>,
}

/// The prepared boot files.
#[derive(Debug, Clone)]
pub struct GuestAssets {
    /// What QEMU's `-kernel` gets.
    pub kernel: PathBuf,
    /// Whether `kernel` is the compressed bzImage (a slower boot; said in warnings).
    pub compressed_kernel: bool,
    /// The shared initramfs (a newc cpio, uncompressed).
    pub initramfs: PathBuf,
    pub kernel_version: String,
}

fn missing(what: String) -> DriverError {
    DriverError::Unavailable(format!("the vm driver cannot boot guests: {what}"))
}

fn io_error(what: &str, path: &Path, e: std::io::Error) -> DriverError {
    DriverError::Internal(format!("{what} {}: {e}", path.display()))
}

/// Finds the kernel, modules and busybox, and prepares (or finds cached under `cache_dir`)
/// the unpacked kernel and the shared initramfs.
pub fn prepare(paths: &AssetPaths, cache_dir: &Path) -> Result<GuestAssets, DriverError> {
    let (kernel_image, version) = find_kernel(paths.kernel.as_deref())?;
    let modules_dir = paths
        .modules_dir
        .clone()
        .unwrap_or_else(|| Path::new("/lib/modules").join(&version));
    let busybox = paths
        .busybox
        .clone()
        .unwrap_or_else(|| PathBuf::from("/bin/busybox"));
    check_static_busybox(&busybox)?;
    let modules = resolve_modules(&modules_dir)?;

    let mut hasher = DefaultHasher::new();
    for file in [&kernel_image, &busybox] {
        file_stamp(file)?.hash(&mut hasher);
    }
    modules.hash(&mut hasher);
    INIT.hash(&mut hasher);
    sbx_host_kit::agent::BINARY.hash(&mut hasher);
    let dir = cache_dir.join(format!("{version}-{:016x}", hasher.finish()));
    std::fs::create_dir_all(&dir).map_err(|e| io_error("making", &dir, e))?;

    let initramfs = dir.join("initramfs.cpio");
    if !initramfs.is_file() {
        let bytes = build_initramfs(&busybox, &modules_dir, &modules)?;
        write_atomically(&initramfs, &bytes)?;
    }
    let vmlinux = dir.join("vmlinux");
    let (kernel, compressed_kernel) = if is_elf(&kernel_image) {
        (kernel_image, false)
    } else if vmlinux.is_file() {
        (vmlinux, false)
    } else {
        match unpack_bzimage(&kernel_image) {
            Ok(elf) => {
                write_atomically(&vmlinux, &elf)?;
                (vmlinux, false)
            }
            Err(why) => {
                tracing::warn!(kernel = %kernel_image.display(), %why, "booting the compressed kernel (slower)");
                (kernel_image, true)
            }
        }
    };
    Ok(GuestAssets {
        kernel,
        compressed_kernel,
        initramfs,
        kernel_version: version,
    })
}

/// The kernel image and its version (the part after `vmlinuz-`).
fn find_kernel(explicit: Option<&Path>) -> Result<(PathBuf, String), DriverError> {
    if let Some(path) = explicit {
        if !path.is_file() {
            return Err(missing(format!("no kernel at {}", path.display())));
        }
        let version = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("vmlinuz-").or(n.strip_prefix("vmlinux-")))
            .unwrap_or("custom")
            .to_string();
        return Ok((path.to_path_buf(), version));
    }
    let mut found: Vec<(PathBuf, String)> = std::fs::read_dir("/boot")
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| {
                    let name = e.file_name().to_str()?.to_string();
                    let version = name.strip_prefix("vmlinuz-")?.to_string();
                    Path::new("/lib/modules")
                        .join(&version)
                        .is_dir()
                        .then(|| (e.path(), version))
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort_by(|a, b| compare_versions(&a.1, &b.1));
    found.pop().ok_or_else(|| {
        missing(
            "no /boot/vmlinuz-* with its /lib/modules directory; install linux-image-amd64"
                .to_string(),
        )
    })
}

/// Orders versions like `6.1.0-9-amd64` < `6.1.0-57-amd64` (numbers compared as numbers).
fn compare_versions(a: &str, b: &str) -> std::cmp::Ordering {
    let parts = |s: &str| -> Vec<Result<u64, String>> {
        s.split(['.', '-'])
            .map(|p| p.parse::<u64>().map_err(|_| p.to_string()))
            .collect()
    };
    parts(a).cmp(&parts(b))
}

/// A statically linked ELF has no program interpreter (`PT_INTERP`).
fn check_static_busybox(path: &Path) -> Result<(), DriverError> {
    sbx_images::find_static_busybox(Some(path), &[])
        .map(|_| ())
        .map_err(missing)
}

fn is_elf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"\x7fELF"
}

/// The modules to load, dependencies first, as paths relative to `modules_dir`. A module the
/// kernel has built in is left out; one it has neither built in nor as a file is an error.
fn resolve_modules(modules_dir: &Path) -> Result<Vec<String>, DriverError> {
    let dep_file = modules_dir.join("modules.dep");
    let deps_text = std::fs::read_to_string(&dep_file).map_err(|e| {
        missing(format!(
            "cannot read {} ({e}); install the kernel's modules (linux-image-amd64)",
            dep_file.display()
        ))
    })?;
    let builtin = std::fs::read_to_string(modules_dir.join("modules.builtin")).unwrap_or_default();
    let deps: BTreeMap<String, Vec<String>> = deps_text
        .lines()
        .filter_map(|line| {
            let (module, rest) = line.split_once(':')?;
            Some((
                module.trim().to_string(),
                rest.split_whitespace().map(str::to_string).collect(),
            ))
        })
        .collect();
    let by_name: BTreeMap<String, String> = deps
        .keys()
        .map(|path| (module_name(path), path.clone()))
        .collect();
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    for name in MODULES {
        match by_name.get(*name) {
            Some(path) => visit(path, &deps, &mut seen, &mut order),
            None if builtin
                .lines()
                .any(|l| module_name(l) == name.replace('-', "_")) => {}
            None => {
                return Err(missing(format!(
                    "the kernel has no module {name} (in {})",
                    dep_file.display()
                )));
            }
        }
    }
    Ok(order)
}

fn visit(
    path: &str,
    deps: &BTreeMap<String, Vec<String>>,
    seen: &mut HashSet<String>,
    order: &mut Vec<String>,
) {
    if !seen.insert(path.to_string()) {
        return;
    }
    for dep in deps.get(path).into_iter().flatten() {
        visit(dep, deps, seen, order);
    }
    order.push(path.to_string());
}

/// `kernel/fs/ext4/ext4.ko` → `ext4`.
fn module_name(path: &str) -> String {
    let file = path.rsplit('/').next().unwrap_or(path);
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

fn build_initramfs(
    busybox: &Path,
    modules_dir: &Path,
    modules: &[String],
) -> Result<Vec<u8>, DriverError> {
    let mut archive = Archive::new();
    for dir in [
        "bin",
        "dev",
        "etc",
        "etc/sbx",
        "lib",
        "lib/modules",
        "proc",
        "sys",
        "tmp",
    ] {
        archive.dir(dir);
    }
    archive.dir("sandbox");
    archive.dir("run");
    let busybox_bytes = std::fs::read(busybox).map_err(|e| io_error("reading", busybox, e))?;
    archive.file("bin/busybox", 0o755, &busybox_bytes);
    archive.file("init", 0o755, INIT.as_bytes());
    archive.file("bin/sbx-agent", 0o755, sbx_host_kit::agent::BINARY);
    let mut list = String::new();
    for module in modules {
        let path = modules_dir.join(module);
        let bytes = std::fs::read(&path).map_err(|e| io_error("reading", &path, e))?;
        let name = module_name(module);
        archive.file(&format!("lib/modules/{name}.ko"), 0o644, &bytes);
        list.push_str(&name);
        list.push('\n');
    }
    archive.file("etc/sbx/modules", 0o644, list.as_bytes());
    Ok(archive.finish())
}

/// The ELF kernel inside a bzImage: the first compressed stream that a host tool unpacks to an
/// ELF image. `Err` says why not (no known stream, or no tool for it).
fn unpack_bzimage(image: &Path) -> Result<Vec<u8>, String> {
    let data = std::fs::read(image).map_err(|e| e.to_string())?;
    let formats: [(&[u8], &str, &[&str]); 3] = [
        (b"\xfd7zXZ\x00", "xz", &["-dc", "--single-stream"]),
        (b"\x28\xb5\x2f\xfd", "zstd", &["-dcq"]),
        (b"\x1f\x8b\x08", "gzip", &["-dc"]),
    ];
    let mut tried = Vec::new();
    for (magic, tool, args) in formats {
        let Some(offset) = data.windows(magic.len()).position(|w| w == magic) else {
            continue;
        };
        match run_filter(tool, args, &data[offset..]) {
            Ok(out) if out.starts_with(b"\x7fELF") => return Ok(out),
            Ok(_) => tried.push(format!("{tool}: not an ELF image")),
            Err(e) => tried.push(format!("{tool}: {e}")),
        }
    }
    Err(if tried.is_empty() {
        "no xz, zstd or gzip stream found in the image".to_string()
    } else {
        tried.join("; ")
    })
}

/// Runs `tool args` with `input` on stdin; its stdout, even when it complains about trailing
/// data after the stream (a bzImage goes on after its payload).
fn run_filter(tool: &str, args: &[&str], input: &[u8]) -> Result<Vec<u8>, String> {
    let mut child = Command::new(tool)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| e.to_string())?;
    let mut stdin = child.stdin.take().ok_or("no stdin")?;
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut out = Vec::new();
    child
        .stdout
        .take()
        .ok_or("no stdout")?
        .read_to_end(&mut out)
        .map_err(|e| e.to_string())?;
    let _ = child.wait();
    let _ = writer.join();
    Ok(out)
}

/// Size and modification time: enough to notice a replaced kernel or busybox.
fn file_stamp(path: &Path) -> Result<(u64, u128), DriverError> {
    let meta = std::fs::metadata(path).map_err(|e| io_error("reading", path, e))?;
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    Ok((meta.len(), mtime))
}

/// Writes a shared asset: 0644, whatever the umask, since each VM's QEMU (a uid of its
/// sandbox's own) reads it through the descriptor the driver opens (`/proc/self/fd`, which
/// checks the file's mode). The assets are the host's kernel, busybox, modules and our agent:
/// nothing of a sandbox's.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), DriverError> {
    use std::io::Write;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let tmp = path.with_extension(format!("tmp-{}", uuid::Uuid::new_v4().simple()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o644)
        .open(&tmp)
        .and_then(|mut file| {
            file.set_permissions(std::fs::Permissions::from_mode(0o644))?;
            file.write_all(bytes)
        })
        .map_err(|e| io_error("writing", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io_error("renaming", &tmp, e))
}

/// The per-run archive appended to the shared initramfs: `/etc/sbx/run.env` and
/// `/etc/sbx/command`.
pub fn run_archive(run_env: &str, command: &str, process_env: Option<&str>) -> Vec<u8> {
    let mut archive = Archive::new();
    archive.dir("etc");
    archive.dir("etc/sbx");
    archive.file("etc/sbx/run.env", 0o644, run_env.as_bytes());
    archive.file("etc/sbx/command", 0o644, command.as_bytes());
    if let Some(env) = process_env {
        archive.file("etc/sbx/process.env", 0o644, env.as_bytes());
    }
    archive.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare_numerically() {
        use std::cmp::Ordering::*;
        assert_eq!(compare_versions("6.1.0-9-amd64", "6.1.0-57-amd64"), Less);
        assert_eq!(compare_versions("6.10.0-1-amd64", "6.9.0-1-amd64"), Greater);
        assert_eq!(compare_versions("6.1.0-57-amd64", "6.1.0-57-amd64"), Equal);
    }

    #[test]
    fn module_names_come_from_paths() {
        assert_eq!(module_name("kernel/fs/ext4/ext4.ko"), "ext4");
        assert_eq!(
            module_name("kernel/crypto/crc32c_generic.ko"),
            "crc32c_generic"
        );
        assert_eq!(
            module_name("kernel/drivers/virtio/virtio-mmio.ko.xz"),
            "virtio_mmio"
        );
    }

    #[test]
    fn dependencies_load_first_and_once() {
        let dir = tempfile::tempdir().unwrap();
        let dep = "kernel/drivers/virtio/virtio_mmio.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/virtio/virtio_ring.ko:\n\
                   kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/crypto/crc32c_generic.ko:\n\
                   kernel/fs/ext4/ext4.ko: kernel/lib/crc16.ko kernel/fs/mbcache.ko kernel/fs/jbd2/jbd2.ko\n\
                   kernel/lib/crc16.ko:\nkernel/fs/mbcache.ko:\nkernel/fs/jbd2/jbd2.ko:\n\
                   kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko\n\
                   kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko\n\
                   kernel/net/core/failover.ko:\n\
                   kernel/drivers/acpi/button.ko:\n";
        std::fs::write(dir.path().join("modules.dep"), dep).unwrap();
        // evdev is built in here.
        std::fs::write(
            dir.path().join("modules.builtin"),
            "kernel/drivers/input/evdev.ko\n",
        )
        .unwrap();
        let order: Vec<String> = resolve_modules(dir.path())
            .unwrap()
            .iter()
            .map(|m| module_name(m))
            .collect();
        let pos = |m: &str| order.iter().position(|x| x == m).unwrap();
        assert!(pos("virtio_ring") < pos("virtio"));
        assert!(pos("virtio") < pos("virtio_mmio"));
        assert!(pos("jbd2") < pos("ext4") && pos("crc16") < pos("ext4"));
        assert_eq!(order.iter().filter(|m| *m == "virtio").count(), 1);
        assert!(pos("failover") < pos("net_failover") && pos("net_failover") < pos("virtio_net"));
        assert!(!order.contains(&"evdev".to_string()));

        // Neither a module nor built in: the error names it.
        std::fs::write(dir.path().join("modules.builtin"), "").unwrap();
        let err = resolve_modules(dir.path()).unwrap_err().to_string();
        assert!(err.contains("evdev"), "{err}");
    }

    #[test]
    fn static_and_dynamic_programs_are_told_apart() {
        // The test binary itself is dynamically linked (it has a PT_INTERP).
        let err = check_static_busybox(&std::env::current_exe().unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("busybox-static"), "{err}");
        let err = check_static_busybox(Path::new("/nonexistent/busybox"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("busybox-static"), "{err}");
    }

    #[test]
    fn a_missing_kernel_is_named() {
        let err = find_kernel(Some(Path::new("/nonexistent/vmlinuz-1")))
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/vmlinuz-1"), "{err}");
    }
}
