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

/// `sbx version` names the client's version, says whether the gateway answers and what it
/// does not report, and exits 0 with a gateway down too.
#[test]
fn version_with_and_without_a_gateway() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let ep = d.endpoint();
    let client = format!("Client Version: {}\n", env!("CARGO_PKG_VERSION"));
    let up = sbx(&ep, &["version"]);
    let text = up.ok();
    assert!(text.starts_with(&client), "{up:?}");
    assert!(text.contains(&format!("Server: {ep} (serving)")), "{up:?}");
    assert!(text.contains("Server Version: not reported"), "{up:?}");
    let json = sbx(&ep, &["version", "-o", "json"]).json();
    assert_eq!(json["server"]["reachable"], true, "{json}");

    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let down_ep = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let down = sbx(&down_ep, &["version"]);
    let text = down.ok();
    assert!(text.starts_with(&client), "{down:?}");
    assert!(
        text.contains(&format!("Server: not reachable at {down_ep}: ")),
        "{down:?}"
    );
    assert!(!text.contains("Server Version"), "{down:?}");
}

/// `sbx completion SHELL` prints a script for that shell naming the commands; an unknown
/// shell is a usage error.
#[test]
fn completion_scripts() {
    let ep = "http://127.0.0.1:1";
    for (shell, marker) in [
        ("bash", "complete -F _sbx"),
        ("zsh", "#compdef sbx"),
        ("fish", "complete -c sbx"),
    ] {
        let run = sbx(ep, &["completion", shell]);
        let script = run.ok();
        assert!(
            script.contains(marker),
            "{shell}: {}",
            &script[..script.len().min(400)]
        );
        for word in ["sandbox", "workspace", "image", "wait", "version"] {
            assert!(script.contains(word), "{shell} script lacks {word}");
        }
    }
    let refused = sbx(ep, &["completion", "tcsh"]);
    assert_eq!(refused.code, 2, "{refused:?}");
    assert!(refused.stderr.contains("'tcsh'"), "{refused:?}");
}
