//! A writer of cpio archives in the "newc" format, the one the Linux kernel unpacks as an
//! initramfs. The kernel unpacks several archives concatenated one after the other, each with
//! its own trailer: the vm driver appends a small per-run archive to the shared one.

/// An archive being written.
#[derive(Debug, Default)]
pub struct Archive {
    bytes: Vec<u8>,
    /// Inode numbers only need to differ within one archive.
    next_inode: u32,
}

const DIR: u32 = 0o040000;
const FILE: u32 = 0o100000;

impl Archive {
    pub fn new() -> Archive {
        Archive {
            bytes: Vec::new(),
            next_inode: 1,
        }
    }

    /// Adds a directory (`path` without a leading slash, e.g. `etc/sbx`).
    pub fn dir(&mut self, path: &str) {
        self.entry(path, DIR | 0o755, &[]);
    }

    /// Adds a regular file with permission bits `mode` (e.g. 0o755).
    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) {
        self.entry(path, FILE | (mode & 0o7777), data);
    }

    /// Ends the archive with its trailer and returns its bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.bytes
    }

    fn entry(&mut self, path: &str, mode: u32, data: &[u8]) {
        let inode = self.next_inode;
        self.next_inode += 1;
        let nlink = if mode & DIR != 0 { 2 } else { 1 };
        let name_size = path.len() + 1;
        let fields = [
            inode,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime: fixed, so the same inputs give the same bytes
            data.len() as u32,
            0, // dev major
            0, // dev minor
            0, // rdev major
            0, // rdev minor
            name_size as u32,
            0, // check (unused by newc)
        ];
        self.bytes.extend_from_slice(b"070701");
        for field in fields {
            self.bytes
                .extend_from_slice(format!("{field:08X}").as_bytes());
        }
        self.bytes.extend_from_slice(path.as_bytes());
        self.bytes.push(0);
        self.pad();
        self.bytes.extend_from_slice(data);
        self.pad();
    }

    /// Header+name and data are each padded to a multiple of four bytes.
    fn pad(&mut self) {
        while !self.bytes.len().is_multiple_of(4) {
            self.bytes.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_cpio_reads_back_what_was_written() {
        let Ok(cpio) = which_cpio() else {
            eprintln!("skipped: no cpio on this host");
            return;
        };
        let mut archive = Archive::new();
        archive.dir("etc");
        archive.dir("etc/sbx");
        archive.file("etc/sbx/run.env", 0o644, b"SBX_RUN_ID=abc\n");
        archive.file("init", 0o755, b"#!/bin/sh\necho hi\n");
        archive.file("empty", 0o600, b"");
        let bytes = archive.finish();
        assert_eq!(bytes.len() % 4, 0);
        let dir = tempfile::tempdir().unwrap();
        let mut child = std::process::Command::new(cpio)
            .args(["-i", "-d", "--quiet"])
            .current_dir(dir.path())
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write;
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        assert!(child.wait().unwrap().success());
        let read = |p: &str| std::fs::read(dir.path().join(p)).unwrap();
        assert_eq!(read("etc/sbx/run.env"), b"SBX_RUN_ID=abc\n");
        assert_eq!(read("init"), b"#!/bin/sh\necho hi\n");
        assert_eq!(read("empty"), b"");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join("init"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
    }

    #[test]
    fn the_layout_is_newc() {
        let mut archive = Archive::new();
        archive.file("a", 0o644, b"xyz");
        let bytes = archive.finish();
        assert_eq!(&bytes[..6], b"070701");
        // 110-byte header + "a\0" padded to 112, then "xyz" padded to 4.
        assert_eq!(&bytes[110..112], b"a\0");
        assert_eq!(&bytes[112..115], b"xyz");
        assert_eq!(bytes[115], 0);
        assert_eq!(&bytes[116..122], b"070701");
        assert!(bytes.windows(10).any(|w| w == b"TRAILER!!!"));
    }

    fn which_cpio() -> Result<std::path::PathBuf, ()> {
        ["/usr/bin/cpio", "/bin/cpio"]
            .iter()
            .map(std::path::PathBuf::from)
            .find(|p| p.is_file())
            .ok_or(())
    }
}
