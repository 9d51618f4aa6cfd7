//! `sbx-agent run --user USER --workdir DIR`: the main process of a vm sandbox of an image
//! becomes the image's User (looked up in /etc/passwd and /etc/group of the root it runs in,
//! here the host's: the test runs as root) in its WorkingDir, made when missing.

use std::process::Command;

#[test]
fn run_becomes_the_user_in_the_working_directory() {
    if !nix::unistd::Uid::effective().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("made/here");
    let out = Command::new(env!("CARGO_BIN_EXE_sbx-agent"))
        .args(["run", "--user", "4242:4343", "--workdir"])
        .arg(&dir)
        .args(["--", "sh", "-c", "id -u; id -g; id -G; pwd"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines,
        ["4242", "4343", "4343", dir.to_str().unwrap()],
        "{out:?}"
    );
    // A name not in /etc/passwd: the run fails, saying so, and runs nothing.
    let out = Command::new(env!("CARGO_BIN_EXE_sbx-agent"))
        .args([
            "run",
            "--user",
            "no-such-user-here",
            "--",
            "sh",
            "-c",
            "echo ran",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(126), "{out:?}");
    assert!(out.stdout.is_empty());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no-such-user-here"), "{err}");
}
