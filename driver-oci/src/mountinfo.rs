//! What is mounted where, read from `/proc/self/mountinfo`: the rootfs, the idmapped layers
//! and the disk all ask before they mount or unmount.

use std::path::Path;

/// Whether `path` is a mount point in this process's mount namespace.
pub fn is_mount_point(path: &Path) -> bool {
    mount_source(path).is_some()
}

/// What is mounted at `path` (the last mount there), as mountinfo names its source (a device
/// such as `/dev/loop3`, or a name such as `overlay`); `None` when nothing is.
pub fn mount_source(path: &Path) -> Option<String> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    let wanted = path.to_string_lossy();
    table
        .lines()
        .filter(|line| {
            line.split(' ')
                .nth(4)
                .is_some_and(|mount_point| unescape_mountinfo(mount_point) == wanted)
        })
        .filter_map(|line| {
            let (_, after) = line.split_once(" - ")?;
            after.split(' ').nth(1).map(unescape_mountinfo)
        })
        .next_back()
}

/// Mount points in mountinfo escape space, tab, newline and backslash as octal.
fn unescape_mountinfo(field: &str) -> String {
    let mut out = String::with_capacity(field.len());
    let bytes = field.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && let Ok(code) = u8::from_str_radix(&field[i + 1..i + 4], 8)
        {
            out.push(code as char);
            i += 4;
            continue;
        }
        out.push(bytes[i] as char);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_source_is_read_from_mountinfo() {
        assert_eq!(mount_source(Path::new("/proc")).as_deref(), Some("proc"));
        assert_eq!(mount_source(Path::new("/proc/self")), None);
    }

    #[test]
    fn mountinfo_escapes_are_read() {
        assert_eq!(unescape_mountinfo("/a\\040b"), "/a b");
        assert_eq!(unescape_mountinfo("/plain"), "/plain");
        assert!(is_mount_point(Path::new("/proc")));
        assert!(!is_mount_point(Path::new("/proc/self")));
    }
}
