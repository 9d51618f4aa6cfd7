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
        // A bare number is bytes (at least the 4 MiB a sandbox can start with).
        ("two", "2", "8388608", 2000, 8 << 20),
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
    // A memory limit below what a process can start with is the gateway's refusal, saying the
    // smallest it takes.
    let small = sbx(
        &ep,
        &[
            "sandbox", "create", "tiny", "--memory", "4096", "--", "true",
        ],
    );
    assert_eq!(small.code, 1, "{small:?}");
    assert!(
        small.stderr.contains("INVALID_ARGUMENT") && small.stderr.contains("4 MiB"),
        "{small:?}"
    );
    // Nothing was created by the refused commands.
    let names = sbx(&ep, &["sandbox", "list", "-o", "json"]).json();
    assert_eq!(names.as_array().map(Vec::len), Some(3), "{names}");
}

/// `sbx version` names the client's version and the gateway's, its default driver and its
/// drivers' features, and exits 0 with a gateway down too.
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
    assert!(
        text.contains(&format!("Server Version: {}\n", env!("CARGO_PKG_VERSION"))),
        "{up:?}"
    );
    assert!(text.contains("Default Driver: sim\n"), "{up:?}");
    // The sim models stdin (its `cat`) and pause, nothing else of the data plane.
    assert!(
        text.contains("Driver sim: sim (exec with stdin, pause); "),
        "{up:?}"
    );
    let json = sbx(&ep, &["version", "-o", "json"]).json();
    assert_eq!(json["server"]["reachable"], true, "{json}");
    assert_eq!(json["server"]["default_driver"], "sim", "{json}");
    assert_eq!(
        json["server"]["drivers"][0]["features"][0], "stdin",
        "{json}"
    );

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

/// `-o wide`, `-o name`, `--no-headers`, and `delete -o json` with the id.
#[test]
fn output_formats_for_scripts_and_humans() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let ep = d.endpoint();
    for name in ["web", "db"] {
        sbx(
            &ep,
            &[
                "sandbox",
                "create",
                name,
                "-l",
                "tier=back",
                "-d",
                "--",
                "sleep",
                "60",
            ],
        )
        .ok();
    }
    let names = sbx(&ep, &["sandbox", "list", "-o", "name"]);
    let mut lines: Vec<&str> = names.ok().lines().collect();
    lines.sort_unstable();
    assert_eq!(lines, ["sandbox/db", "sandbox/web"], "{names:?}");

    let wide = sbx(&ep, &["sandbox", "get", "web", "-o", "wide"]);
    let text = wide.ok();
    let header = text.lines().next().unwrap_or_default();
    for column in ["NAME", "PHASE", "GEN", "AGE", "DRIVER", "IMAGE", "LABELS"] {
        assert!(header.contains(column), "{wide:?}");
    }
    assert!(
        text.contains("sim") && text.contains("tier=back"),
        "{wide:?}"
    );

    let bare = sbx(&ep, &["sandbox", "list", "--no-headers"]);
    assert_eq!(bare.ok().lines().count(), 2, "{bare:?}");
    assert!(!bare.stdout.contains("NAME"), "{bare:?}");

    let id = sbx(&ep, &["sandbox", "get", "web", "-o", "json"]).json()["id"].clone();
    let deleted = sbx(&ep, &["sandbox", "delete", "web", "-o", "json"]).json();
    assert_eq!(deleted["deleted"], true, "{deleted}");
    assert_eq!(deleted["id"], id, "{deleted}");
    // As the help says: an absent name is an error, an absent id is deleted=false.
    let by_name = sbx(&ep, &["sandbox", "delete", "web", "-o", "json"]);
    assert_eq!(by_name.code, 1, "{by_name:?}");
    assert!(by_name.stderr.contains("SANDBOX_NOT_FOUND"), "{by_name:?}");
    let id_text = id.as_str().unwrap_or_default();
    let again = sbx(&ep, &["sandbox", "delete", "--id", id_text, "-o", "json"]).json();
    assert_eq!(again["deleted"], false, "{again}");
    assert_eq!(again["id"], serde_json::Value::Null, "{again}");
    let help = sbx(&ep, &["sandbox", "delete", "--help"]);
    assert!(
        help.ok().contains("fails with SANDBOX_NOT_FOUND"),
        "{help:?}"
    );
    let by_name = sbx(&ep, &["sandbox", "delete", "db", "-o", "name"]);
    assert_eq!(by_name.ok(), "sandbox/db\n", "{by_name:?}");
}

/// Usage errors with SBX_ENDPOINT set do not write `--endpoint` into the usage line; a
/// refused workspace delete names `--cascade`; a failed sandbox's reason and message are said
/// once, on create and in the table.
#[test]
fn errors_say_one_thing_once() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let ep = d.endpoint();
    let id = "6d1f7bd8-3a31-4b8f-a4a8-7c5c6d1b2b2b";
    for argv in [
        &["sandbox", "get"][..],
        &["sandbox", "get", "web", "--id", id],
        &["wait"],
    ] {
        let usage = sbx(&ep, argv);
        assert_eq!(usage.code, 2, "{argv:?}: {usage:?}");
        assert!(usage.stderr.contains("Usage: sbx "), "{argv:?}: {usage:?}");
        assert!(!usage.stderr.contains("--endpoint"), "{argv:?}: {usage:?}");
    }
    // The environment still picks the gateway, and the flag still wins over it.
    sbx(&ep, &["workspace", "create", "team"]).ok();
    let flag_wins = sbx(
        "http://127.0.0.1:1",
        &["--endpoint", &ep, "workspace", "get", "team"],
    );
    assert!(flag_wins.ok().contains("team"), "{flag_wins:?}");

    sbx(
        &ep,
        &[
            "sandbox", "create", "-w", "team", "a", "-d", "--", "sleep", "60",
        ],
    )
    .ok();
    let refused = sbx(&ep, &["workspace", "delete", "team"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains("WORKSPACE_NOT_EMPTY")
            && refused.stderr.contains("sbx workspace delete --cascade"),
        "{refused:?}"
    );
    sbx(&ep, &["workspace", "delete", "team", "--cascade"]).ok();

    // The process driver words the exit itself too ("the main process exited with code 3"),
    // which the gateway appended to its own words for the same exit.
    let pdata = DataDir::new();
    let p = Sbxd::start(pdata.path(), "process", &[]);
    let ep = p.endpoint();
    let failed = sbx(
        &ep,
        &[
            "sandbox", "create", "bad", "--settle", "2000", "--", "sh", "-c", "exit 3",
        ],
    );
    assert_eq!(failed.code, 1, "{failed:?}");
    let line = failed.stderr.lines().last().unwrap_or_default();
    assert!(
        line.starts_with("error: sandbox \"bad\" failed: "),
        "{failed:?}"
    );
    assert_eq!(line.matches("exited").count(), 1, "said twice: {line}");
    assert!(!line.contains("failed: Error"), "said twice: {line}");
    let table = sbx(&ep, &["sandbox", "get", "bad"]);
    let row = table.ok().lines().nth(1).unwrap_or_default().to_string();
    assert!(
        row.contains("Error") && row.contains("status 3"),
        "{table:?}"
    );
    assert_eq!(row.matches("exited").count(), 1, "said twice: {row}");
    sbx(&ep, &["sandbox", "delete", "bad"]).ok();
}
