//! Whether a program is statically linked: a static binary (no `PT_INTERP` program header,
//! so no dynamic loader to find) runs in any root filesystem — a guest's initramfs, a
//! container's image. The vm driver's guest and the oci driver's sandbox init both need a
//! static busybox, and the built-in image is made of one.

/// Whether a 64-bit little-endian ELF image has a `PT_INTERP` program header; `None` when
/// `data` is not such an image.
pub(crate) fn elf_interpreter(data: &[u8]) -> Option<bool> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
