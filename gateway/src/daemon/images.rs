//! sbxd's image settings and the built-in default image.
//!
//! A sandbox on a driver with images that names none runs `--default-image` (default
//! [`sbx_actors::DEFAULT_IMAGE`], `sbx.local/busybox:latest`). That built-in image is made
//! at start from the host's static busybox (`--busybox`, else the first of [`BUSYBOX_PATHS`])
//! — once: when its record exists, nothing is done — and only when the driver reports
//! `images`. A dynamically linked busybox would not run inside an image, so it is refused
//! with the package that has a static one.

use std::path::{Path, PathBuf};

use clap::Args;
use sbx_actors::{DEFAULT_IMAGE, Gateway};

/// Where a static busybox is looked for when `--busybox` is not given, in order.
pub const BUSYBOX_PATHS: [&str; 2] = ["/bin/busybox", "/usr/bin/busybox"];

/// The image flags of `sbxd serve`.
#[derive(Debug, Clone, Args)]
pub struct ImageArgs {
    /// The image (a name) a sandbox runs when its spec names none, on drivers with images.
    /// The built-in `sbx.local/busybox:latest` is made from the host's static busybox.
    #[arg(long, env = "SBX_DEFAULT_IMAGE", default_value = DEFAULT_IMAGE, value_name = "NAME")]
    pub default_image: String,

    /// The static busybox the built-in default image is made from (default: /bin/busybox,
    /// else /usr/bin/busybox).
    #[arg(long = "busybox", env = "SBX_BUSYBOX", value_name = "PATH")]
    pub image_busybox: Option<PathBuf>,

    /// sim driver (testing): report the `images` capability, so that sandboxes resolve and
    /// pin an image.
    #[arg(long, env = "SBX_SIM_IMAGES")]
    pub sim_images: bool,

    /// The largest image import accepted, in MiB.
    #[arg(
        long,
        env = "SBX_MAX_IMPORT_MIB",
        default_value_t = 8192,
        value_name = "MIB"
    )]
    pub max_import_mib: u64,
}

/// Why the built-in image could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BusyboxError {
    #[error(
        "no busybox for the built-in image {image}: none of {tried} exists; install one \
         (apt-get install busybox-static) or pass --busybox PATH, or set --default-image"
    )]
    Missing { image: String, tried: String },
    #[error(
        "{path} is not a statically linked busybox, which the built-in image {image} needs: \
         apt-get install busybox-static, or pass --busybox PATH"
    )]
    Dynamic { path: PathBuf, image: String },
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the built-in image {image}: {source}")]
    Record {
        image: String,
        #[source]
        source: sbx_actors::ActorError,
    },
}

/// Whether an ELF file is statically linked: it has no `PT_INTERP` program header (64-bit
/// little-endian ELF, as on every host sbx runs on). `None` when it is not such an ELF file.
pub fn is_static_elf(bytes: &[u8]) -> Option<bool> {
    const PT_INTERP: u32 = 3;
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| {
        bytes
            .get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
    };
    let u32_at = |o: usize| {
        bytes
            .get(o..o + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    let phoff = bytes
        .get(32..40)
        .map(|b| u64::from_le_bytes(b.try_into().unwrap_or_default()))? as usize;
    let phentsize = u16_at(54)? as usize;
    let phnum = u16_at(56)? as usize;
    for i in 0..phnum {
        if u32_at(phoff + i * phentsize)? == PT_INTERP {
            return Some(false);
        }
    }
    Some(true)
}

/// The busybox to build the built-in image from: `given`, else the first that exists of
/// `candidates`; refused when it is not a static ELF program.
pub fn find_busybox(
    given: Option<&Path>,
    candidates: &[&str],
    image: &str,
) -> Result<PathBuf, BusyboxError> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => candidates
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| BusyboxError::Missing {
                image: image.to_string(),
                tried: candidates.join(", "),
            })?,
    };
    let bytes = std::fs::read(&path).map_err(|source| BusyboxError::Read {
        path: path.clone(),
        source,
    })?;
    match is_static_elf(&bytes) {
        Some(true) => Ok(path),
        _ => Err(BusyboxError::Dynamic {
            path,
            image: image.to_string(),
        }),
    }
}

/// At start: when the default driver runs images and the default image is the built-in one
/// without a record, makes it from the host's busybox and records it.
pub async fn ensure_default_image(gateway: &Gateway, args: &ImageArgs) -> Result<(), BusyboxError> {
    let image = args.default_image.as_str();
    if image != DEFAULT_IMAGE {
        return Ok(());
    }
    match gateway.driver_has_images("").await {
        Ok(true) => {}
        Ok(false) => return Ok(()),
        Err(e) => {
            tracing::warn!(
                "cannot tell whether the driver runs images ({e}); the built-in image is made at the next start"
            );
            return Ok(());
        }
    }
    let record = |source| BusyboxError::Record {
        image: image.to_string(),
        source,
    };
    let selector = sbx_actors::ImageSelector::parse("", image).map_err(record)?;
    if gateway.get_image(&selector).await.is_ok() {
        return Ok(());
    }
    let busybox = find_busybox(args.image_busybox.as_deref(), &BUSYBOX_PATHS, image)?;
    if let Some(made) = gateway
        .ensure_busybox_image(&busybox, image)
        .await
        .map_err(record)?
    {
        tracing::info!(image = %made.name, digest = %made.digest, busybox = %busybox.display(), "built the default image");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal 64-bit little-endian ELF header with `types` as its program headers.
    fn elf(types: &[u32]) -> Vec<u8> {
        let mut bytes = vec![0u8; 64 + 56 * types.len()];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[4] = 2;
        bytes[5] = 1;
        bytes[32..40].copy_from_slice(&64u64.to_le_bytes());
        bytes[54..56].copy_from_slice(&56u16.to_le_bytes());
        bytes[56..58].copy_from_slice(&(types.len() as u16).to_le_bytes());
        for (i, t) in types.iter().enumerate() {
            bytes[64 + i * 56..68 + i * 56].copy_from_slice(&t.to_le_bytes());
        }
        bytes
    }

    #[test]
    fn static_and_dynamic_elf_files_are_told_apart() {
        assert_eq!(is_static_elf(&elf(&[1, 1, 4])), Some(true));
        assert_eq!(is_static_elf(&elf(&[6, 3, 1])), Some(false));
        assert_eq!(is_static_elf(b"#!/bin/sh\necho hi\n"), None);
        // Program headers past the end of the file are not an ELF file we can read.
        let mut truncated = elf(&[1, 1]);
        truncated.truncate(80);
        assert_eq!(is_static_elf(&truncated), None);
    }

    #[test]
    fn the_busybox_is_found_and_a_dynamic_one_refused_with_the_package() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("busybox");
        std::fs::write(&good, elf(&[1])).unwrap();
        let dynamic = dir.path().join("dyn");
        std::fs::write(&dynamic, elf(&[3])).unwrap();
        let absent = dir.path().join("absent");
        let (g, a) = (good.to_str().unwrap(), absent.to_str().unwrap());
        assert_eq!(find_busybox(None, &[a, g], DEFAULT_IMAGE).unwrap(), good);
        let err = find_busybox(Some(&dynamic), &[g], DEFAULT_IMAGE).unwrap_err();
        assert!(
            err.to_string().contains("apt-get install busybox-static"),
            "{err}"
        );
        assert!(err.to_string().contains("dyn"), "{err}");
        let err = find_busybox(None, &[a], DEFAULT_IMAGE).unwrap_err();
        assert!(err.to_string().contains(a), "{err}");
        assert!(err.to_string().contains("busybox-static"), "{err}");
    }
}
