//! The walls must not break ordinary programs: inside a default sandbox of every driver, `git
//! clone` of a local repository (it hard-links the objects into another directory), `git push`
//! to a bare repository (its objects renamed from a quarantine into place), `ln` and
//! `rename(2)` across directories work on the sandbox's root filesystem, `/sandbox` and `/tmp`.
//! A Landlock domain that handles `REFER` without granting it refused each of them with EXDEV
//! (and `mv` fell back to a copy without a word: the check compares inode numbers).
//!
//! `oci` and `vm` run an image made here of busybox and the host's git with its libraries;
//! `process` runs on the host's root filesystem (its `/` is the host's, not the sandbox's to
//! write: there `/sandbox` and `/tmp`). Needs root, runc, busybox-static and git; the vm case
//! what `vm_e2e.rs` needs.

mod common;
mod vm_support;

use std::path::{Path, PathBuf};

use common::{DriverWorld, sbx};
use sbx_drivers::image::fixtures::{self, TarEntry};

/// What the sandbox runs, for each directory given: a repository, a clone, a push to a bare
/// one, a hard link and a rename across directories. One line `ok DIR` per directory, or the
/// first failure on stderr and a non-zero exit.
const SCRIPT: &str = r#"set -e
export HOME=/tmp GIT_AUTHOR_NAME=t GIT_AUTHOR_EMAIL=t@example.test
export GIT_COMMITTER_NAME=t GIT_COMMITTER_EMAIL=t@example.test GIT_CONFIG_NOSYSTEM=1
for base in "$@"; do
  d="${base%/}/walls.$$"; rm -rf "$d"; mkdir -p "$d"; cd "$d"
  git init -q src; (cd src && echo one > f && git add f && git commit -qm one)
  git clone -q src clone || { echo "git clone failed in $base" >&2; exit 1; }
  git init -q --bare bare.git
  (cd clone && echo two >> f && git commit -qam two && git push -q ../bare.git HEAD:refs/heads/main) \
    || { echo "git push failed in $base" >&2; exit 1; }
  n=$(git --git-dir=bare.git rev-list --count main)
  [ "$n" = 2 ] || { echo "the bare repository has $n commits in $base" >&2; exit 1; }
  mkdir a b; echo x > a/f; echo y > a/g
  ln a/f b/linked || { echo "ln across directories failed in $base" >&2; exit 1; }
  [ "$(stat -c %h a/f)" = 2 ] || { echo "no hard link in $base" >&2; exit 1; }
  i=$(stat -c %i a/g); mv a/g b/moved
  [ "$(stat -c %i b/moved)" = "$i" ] || { echo "mv copied instead of renaming in $base" >&2; exit 1; }
  cd /; rm -rf "$d"
  echo "ok $base"
done
"#;

/// The files of `paths` (and, for each program, the libraries `ldd` names with the loader),
/// as tar entries at their own paths, contents read through symlinks.
fn host_files(programs: &[&str]) -> Vec<TarEntry> {
    let mut files: Vec<PathBuf> = Vec::new();
    for program in programs {
        files.push(PathBuf::from(program));
        let out = std::process::Command::new("ldd")
            .arg(program)
            .output()
            .expect("ldd");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "libz.so.1 => /lib/x86_64-linux-gnu/libz.so.1 (0x…)" or "/lib64/ld-linux… (0x…)"
            let path = line
                .split("=>")
                .last()
                .and_then(|rest| rest.split_whitespace().next())
                .filter(|p| p.starts_with('/'));
            if let Some(path) = path {
                files.push(PathBuf::from(path));
            }
        }
    }
    files.sort();
    files.dedup();
    let mut entries = Vec::new();
    let mut dirs = std::collections::BTreeSet::new();
    for file in &files {
        let rel = file.strip_prefix("/").unwrap();
        for dir in rel.ancestors().skip(1) {
            if !dir.as_os_str().is_empty() {
                dirs.insert(format!("{}/", dir.display()));
            }
        }
    }
    for dir in dirs {
        entries.push(TarEntry::dir(&dir));
    }
    for file in &files {
        let rel = file.strip_prefix("/").unwrap().display().to_string();
        let data = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        entries.push(TarEntry::file(&rel, &data).mode(0o755));
    }
    entries
}

/// An image of busybox (every applet) and git: an OCI layout at `dir`.
fn git_image(dir: &Path) -> PathBuf {
    let busybox = sbx_drivers::find_static_busybox(None, &sbx_drivers::BUSYBOX_PATHS)
        .expect("a static busybox (Debian's busybox-static)");
    let list = std::process::Command::new(&busybox)
        .arg("--list")
        .output()
        .expect("busybox --list");
    let mut entries = vec![
        TarEntry::dir("bin/"),
        TarEntry::file("bin/busybox", &std::fs::read(&busybox).unwrap()).mode(0o755),
        TarEntry::dir("tmp/").mode(0o1777),
        TarEntry::dir("etc/"),
        TarEntry::file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"),
        TarEntry::file("etc/group", b"root:x:0:\n"),
    ];
    for applet in String::from_utf8_lossy(&list.stdout).split_whitespace() {
        if applet != "busybox" {
            entries.push(TarEntry::symlink(&format!("bin/{applet}"), "busybox"));
        }
    }
    entries.extend(host_files(&["/usr/bin/git"]));
    // What git runs of itself: the pack programs a push and a fetch start by name.
    entries.push(TarEntry::dir("usr/lib/git-core/"));
    for helper in [
        "git",
        "git-receive-pack",
        "git-upload-pack",
        "git-upload-archive",
    ] {
        entries.push(TarEntry::symlink(
            &format!("usr/lib/git-core/{helper}"),
            "/usr/bin/git",
        ));
    }
    let layout = dir.join("git-image");
    fixtures::write_oci_layout_with_config(
        &layout,
        &[fixtures::tar_bytes(&entries)],
        "v1",
        serde_json::json!({ "Env": ["PATH=/usr/bin:/bin"], "Cmd": ["sleep", "3600"] }),
    );
    layout
}

/// Imports the git image into the gateway at `endpoint` as `walls:v1`.
fn import_git_image(endpoint: &str, dir: &Path) {
    let layout = git_image(dir);
    sbx(
        endpoint,
        &[
            "image",
            "import",
            layout.to_str().unwrap(),
            "--name",
            "localhost/walls:v1",
        ],
    )
    .ok();
}

/// Runs [`SCRIPT`] in sandbox `name` over `dirs` and checks every directory said `ok`.
fn check(endpoint: &str, name: &str, dirs: &[&str]) {
    let mut args = vec!["sandbox", "exec", name, "--", "sh", "-c", SCRIPT, "walls"];
    args.extend_from_slice(dirs);
    let run = sbx(endpoint, &args);
    assert_eq!(
        run.code, 0,
        "an ordinary program failed in the sandbox: {run:?}"
    );
    for dir in dirs {
        assert!(run.stdout.contains(&format!("ok {dir}\n")), "{run:?}");
    }
}

/// Whether Debian's git is here (.ci/run installs it: a machine without it fails the test).
fn have_git() -> bool {
    assert!(
        Path::new("/usr/bin/git").is_file(),
        "the test needs /usr/bin/git (apt-get install git)"
    );
    true
}

#[test]
fn git_ln_and_rename_work_across_directories_in_an_oci_sandbox() {
    if !have_git() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let world = DriverWorld::with_flags("oci", "walls", &["--network-cidr", "off"]);
    import_git_image(&world.sbxd.endpoint(), dir.path());
    world
        .sbx(&[
            "sandbox",
            "create",
            "-n",
            "walls",
            "--image",
            "localhost/walls:v1",
            "--",
            "sleep",
            "3600",
        ])
        .ok();
    check(&world.sbxd.endpoint(), "walls", &["/", "/sandbox", "/tmp"]);
    world.finish();
}

#[test]
fn git_ln_and_rename_work_across_directories_in_a_process_sandbox() {
    if !have_git() {
        return;
    }
    let world = DriverWorld::with_flags("process", "walls", &["--network-cidr", "off"]);
    world
        .sbx(&["sandbox", "create", "-n", "walls", "--", "sleep", "3600"])
        .ok();
    check(&world.sbxd.endpoint(), "walls", &["/sandbox", "/tmp"]);
    world.finish();
}

#[test]
fn vm_git_ln_and_rename_work_across_directories() {
    if !have_git() {
        return;
    }
    vm_support::require_vm_tools();
    let data = common::DataDir::new();
    let _reaper = vm_support::QemuReaper(data.path().to_path_buf());
    let dir = tempfile::tempdir().unwrap();
    let mut d = vm_support::start_sbxd(data.path(), "vm");
    let endpoint = d.endpoint();
    import_git_image(&endpoint, dir.path());
    sbx(
        &endpoint,
        &[
            "sandbox",
            "create",
            "-n",
            "walls",
            "--image",
            "localhost/walls:v1",
            "--timeout",
            "120s",
            "--",
            "sleep",
            "3600",
        ],
    )
    .ok();
    check(&endpoint, "walls", &["/", "/sandbox", "/tmp"]);
    sbx(&endpoint, &["sandbox", "delete", "walls"]).ok();
    d.sigterm(std::time::Duration::from_secs(30));
}
