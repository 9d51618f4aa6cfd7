//! The `sbx` CLI's conventions, through the real binaries (sbxd on the in-memory sim driver):
//! resource quantities as kubectl takes them, `sbx version` and `sbx completion`, `-o wide`,
//! `-o name` and `--no-headers`, and usage and gateway errors that say one thing once.

mod common;

use common::{DataDir, Sbxd, sbx};

/// `--cpu` in cores or millicores and `--memory` with units reach the gateway as millicores
/// and bytes; a bad quantity is a usage error (exit 2) that names the flag and the value.
#[test]
fn resource_quantities_as_people_write_them() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let ep = d.endpoint();
    for (name, cpu, memory, millis, bytes) in [
        ("half", "0.5", "512Mi", 500, 512u64 << 20),
        ("milli", "500m", "1G", 500, 1_000_000_000),
        ("two", "2", "4096", 2000, 4096),
    ] {
        let created = sbx(
            &ep,
            &[
                "sandbox", "create", name, "--cpu", cpu, "--memory", memory, "-o", "json", "--",
                "sleep", "60",
            ],
        )
        .json();
        assert_eq!(created["cpu_millis"], millis, "--cpu {cpu}: {created}");
        assert_eq!(
            created["memory_bytes"], bytes,
            "--memory {memory}: {created}"
        );
    }
    for (flag, value, says) in [
        ("--memory", "12Q", "expected bytes, or a number with a unit"),
        ("--cpu", "0.0005", "expected cores"),
        ("--cpu", "2cores", "millicores (500m)"),
    ] {
        let refused = sbx(&ep, &["sandbox", "create", flag, value, "--", "true"]);
        assert_eq!(refused.code, 2, "{flag} {value}: {refused:?}");
        assert!(
            refused.stderr.contains(&format!("'{value}' for '{flag} <"))
                && refused.stderr.contains(says),
            "{flag} {value}: {refused:?}"
        );
        assert!(refused.stdout.is_empty(), "{refused:?}");
    }
    // Nothing was created by the refused commands.
    let names = sbx(&ep, &["sandbox", "list", "-o", "json"]).json();
    assert_eq!(names.as_array().map(Vec::len), Some(3), "{names}");
}
