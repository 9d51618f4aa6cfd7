//! Whether a program is statically linked: a static binary (no `PT_INTERP` program header,
//! so no dynamic loader to find) runs in any root filesystem — a guest's initramfs, a
//! container's image. The vm driver's guest and the oci driver's sandbox init both need a
//! static busybox, and the built-in image is made of one.

/// Whether a 64-bit little-endian ELF image has a `PT_INTERP` program header; `None` when
/// `data` is not such an image.
pub fn elf_interpreter(data: &[u8]) -> Option<bool> {
    if data.len() < 64 || &data[..4] != b"\x7fELF" || data[4] != 2 || data[5] != 1 {
        return None;
    }
    let u16_at = |o: usize| Some(u16::from_le_bytes(data.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(data.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(data.get(o..o + 8)?.try_into().ok()?));
    let phoff = usize::try_from(u64_at(0x20)?).ok()?;
    let phentsize = usize::from(u16_at(0x36)?);
    let phnum = usize::from(u16_at(0x38)?);
    for i in 0..phnum {
        if u32_at(phoff + i * phentsize)? == 3 {
            return Some(true);
        }
    }
    Some(false)
}

/// Where a static busybox is looked for when none is given, in order (Debian's
/// busybox-static installs `/bin/busybox`).
pub const BUSYBOX_PATHS: [&str; 2] = ["/bin/busybox", "/usr/bin/busybox"];

/// A static busybox: `given`, else the first of `candidates` that exists. The error says why
/// not, naming the path(s) and Debian's `busybox-static`.
pub fn find_static_busybox(
    given: Option<&std::path::Path>,
    candidates: &[&str],
) -> Result<std::path::PathBuf, String> {
    let path = match given {
        Some(p) => p.to_path_buf(),
        None => candidates
            .iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.exists())
            .ok_or_else(|| {
                format!(
                    "no busybox: none of {} exists (apt-get install busybox-static)",
                    candidates.join(", ")
                )
            })?,
    };
    let bytes = std::fs::read(&path).map_err(|e| {
        format!(
            "cannot read {} ({e}); apt-get install busybox-static",
            path.display()
        )
    })?;
    match elf_interpreter(&bytes) {
        Some(false) => Ok(path),
        Some(true) => Err(format!(
            "{} is dynamically linked, and a busybox that runs in any root filesystem must be \
             static (apt-get install busybox-static)",
            path.display()
        )),
        None => Err(format!(
            "{} is not a 64-bit ELF program (apt-get install busybox-static)",
            path.display()
        )),
    }
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
    fn program_headers_tell_static_from_dynamic() {
        assert_eq!(elf_interpreter(&elf(&[1, 1, 4])), Some(false));
        assert_eq!(elf_interpreter(&elf(&[6, 3, 1])), Some(true));
        // Program headers past the end of the file are not an ELF file we can read.
        let mut truncated = elf(&[1, 1]);
        truncated.truncate(80);
        assert_eq!(elf_interpreter(&truncated), None);
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
        assert_eq!(find_static_busybox(None, &[a, g]).unwrap(), good);
        let err = find_static_busybox(Some(&dynamic), &[g]).unwrap_err();
        assert!(
            err.contains("apt-get install busybox-static") && err.contains("dyn"),
            "{err}"
        );
        let err = find_static_busybox(None, &[a]).unwrap_err();
        assert!(err.contains(a) && err.contains("busybox-static"), "{err}");
    }

    #[test]
    fn static_and_dynamic_programs_are_told_apart() {
        // The test binary itself is dynamically linked (it has a PT_INTERP).
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert_eq!(elf_interpreter(&me), Some(true));
        assert_eq!(elf_interpreter(b"#!/bin/sh\n"), None);
        assert_eq!(elf_interpreter(b""), None);
        // Debian's busybox-static, which the oci and vm drivers need, is static.
        if let Ok(busybox) = std::fs::read("/bin/busybox") {
            assert_eq!(elf_interpreter(&busybox), Some(false));
        }
    }
}
