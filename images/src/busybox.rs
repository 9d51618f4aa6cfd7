//! The built-in default image: a root filesystem around a static busybox, so that a gateway
//! without network access still has an image to run.
//!
//! The layer is an uncompressed tar (about 2 MiB for Debian's busybox-static 1.35) written with
//! fixed metadata (mtime 0, owner 0:0, entries in a fixed order) and the config has no
//! timestamp, so the same busybox always gives the same manifest digest.

use std::io::Write;
use std::path::Path;

use super::spec::{self, Compression, ContainerConfig, Descriptor};
use super::{ImageError, ImageInfo, ImageStore};

/// The directories of the image, with their modes.
const DIRS: &[(&str, u32)] = &[
    ("bin", 0o755),
    ("dev", 0o755),
    ("etc", 0o755),
    ("home", 0o755),
    ("proc", 0o555),
    ("root", 0o700),
    ("run", 0o755),
    ("sys", 0o555),
    ("tmp", 0o1777),
    ("usr", 0o755),
    ("usr/bin", 0o755),
    ("usr/sbin", 0o755),
    ("sbin", 0o755),
    ("var", 0o755),
];

/// Root, `user` (uid 1000, at home in `/home/user`: the account E2B's SDKs run commands and
/// write files as, `user="user"`) and nobody. The image's User stays root.
const PASSWD: &str = "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n\
                      nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n";
const GROUP: &str = "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n";

/// `/bin/bash`: busybox's shell under bash's name (its build has no `bash` applet), for the
/// programs that ask for bash by path — E2B's SDKs run every command as `/bin/bash -l -c`.
const BASH: &str =
    "#!/bin/sh\n# sbx: the built-in image's bash is busybox's ash.\nexec /bin/sh \"$@\"\n";

/// `user`'s home, its own (mode 0755).
const USER_HOME: &str = "home/user";
const USER_ID: u64 = 1000;

impl ImageStore {
    /// Builds and imports the built-in default image from a static busybox binary: `/bin/busybox`,
    /// a symlink in `/bin` per applet (`busybox --list`), `/etc/passwd`, `/etc/group` (no
    /// `/etc/hostname`: the runtime provides it), `/tmp` (1777), `/root`, `/home`, `/var`, `/run`,
    /// `/proc`, `/sys`, `/dev`; config `Env` PATH=…, `Cmd ["sh"]`. Refuses a dynamically linked
    /// busybox (it would not run in a root filesystem without its libraries).
    pub fn import_busybox(&self, busybox: &Path, name: &str) -> Result<ImageInfo, ImageError> {
        let transfer = self.transfer(Default::default());
        self.import_busybox_with(busybox, name, &transfer)
    }

    /// [`ImageStore::import_busybox`] as `t` (what it writes is held until `t` ends).
    pub fn import_busybox_with(
        &self,
        busybox: &Path,
        name: &str,
        t: &super::Transfer,
    ) -> Result<ImageInfo, ImageError> {
        self.writable("import of the busybox image")?;
        let image = format!("{name} (from {})", busybox.display());
        let binary = std::fs::read(busybox).map_err(|e| ImageError::InvalidArgument {
            image: image.clone(),
            why: format!("cannot read busybox ({e}); install Debian's busybox-static"),
        })?;
        match crate::elf::elf_interpreter(&binary) {
            Some(false) => {}
            Some(true) => {
                return Err(ImageError::InvalidArgument {
                    image,
                    why: "busybox is dynamically linked (it has a PT_INTERP); install Debian's busybox-static".into(),
                });
            }
            None => {
                return Err(ImageError::InvalidArgument {
                    image,
                    why: "busybox is not a 64-bit ELF program; install Debian's busybox-static"
                        .into(),
                });
            }
        }
        let applets = list_applets(&image, busybox)?;

        let mut writer = self.blob_writer(&image, t)?;
        if let Err(e) = write_rootfs(&mut writer, &binary, &applets) {
            return Err(writer.failure("write the busybox layer", e));
        }
        let (digest, size) = writer.commit(None)?;
        // The host's own busybox: no limit.
        let mut budget = super::Budget::unlimited(&image);
        let diff_id =
            self.unpack_layer(&image, &digest, Compression::None, None, &mut budget, t)?;
        let layer = Descriptor::new(spec::LAYER_TAR, digest, size);
        let config = ContainerConfig {
            labels: Some(
                [(
                    "org.opencontainers.image.title".to_string(),
                    "sbx busybox".to_string(),
                )]
                .into(),
            ),
            ..super::import::default_config()
        };
        self.single_layer_image(&image, layer, diff_id, config, t)
    }
}

/// The applet names `busybox --list` prints, sorted, without `busybox` itself.
fn list_applets(image: &str, busybox: &Path) -> Result<Vec<String>, ImageError> {
    let out = std::process::Command::new(busybox)
        .arg("--list")
        .output()
        .map_err(|e| ImageError::io(image, "run busybox --list", e))?;
    if !out.status.success() {
        return Err(ImageError::InvalidArgument {
            image: image.to_string(),
            why: format!("busybox --list failed ({})", out.status),
        });
    }
    let mut applets: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::trim)
        .filter(|a| !a.is_empty() && *a != "busybox" && !a.contains('/') && *a != "." && *a != "..")
        .map(str::to_string)
        .collect();
    applets.sort();
    applets.dedup();
    if applets.is_empty() {
        return Err(ImageError::InvalidArgument {
            image: image.to_string(),
            why: "busybox --list printed no applets".into(),
        });
    }
    Ok(applets)
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_mtime(0);
    h.set_uid(0);
    h.set_gid(0);
    h
}

fn write_rootfs(out: &mut impl Write, busybox: &[u8], applets: &[String]) -> std::io::Result<()> {
    let mut b = tar::Builder::new(out);
    for (dir, mode) in DIRS {
        let mut h = header(tar::EntryType::Directory, *mode, 0);
        b.append_data(&mut h, format!("{dir}/"), std::io::empty())?;
    }
    let mut h = header(tar::EntryType::Directory, 0o755, 0);
    h.set_uid(USER_ID);
    h.set_gid(USER_ID);
    b.append_data(&mut h, format!("{USER_HOME}/"), std::io::empty())?;
    let mut h = header(tar::EntryType::Regular, 0o755, busybox.len() as u64);
    b.append_data(&mut h, "bin/busybox", busybox)?;
    if !applets.iter().any(|a| a == "bash") {
        let mut h = header(tar::EntryType::Regular, 0o755, BASH.len() as u64);
        b.append_data(&mut h, "bin/bash", BASH.as_bytes())?;
    }
    for applet in applets {
        let mut h = header(tar::EntryType::Symlink, 0o777, 0);
        b.append_link(&mut h, format!("bin/{applet}"), "busybox")?;
    }
    for (path, content) in [("etc/passwd", PASSWD), ("etc/group", GROUP)] {
        let mut h = header(tar::EntryType::Regular, 0o644, content.len() as u64);
        b.append_data(&mut h, path, content.as_bytes())?;
    }
    b.into_inner()?.flush()
}
