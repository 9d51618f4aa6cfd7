//! `sbx sandbox cp` and `sbx sandbox port-forward` end to end through the real sbxd (default
//! driver: oci, busybox image; needs root and runc) and the real `sbx` binary: a tree with
//! modes, times, symlinks and a 3 MB file round-trips byte-exact both ways, named as
//! `docker cp` names it; hostile archives and symlinks on either side write nothing outside
//! the destination (checked on the host); a setuid program and a FIFO the sandbox's root
//! leaves are copied out by root as neither; errors name what they are about; a forwarded
//! busybox httpd serves one, twenty concurrent and a half-closed connection; a port nobody
//! listens on closes that connection only. Each test ends its sbxd by pid and checks that no
//! container, mount, cgroup or `sbx` child is left.
//!
//! `cp_throughput` (ignored; `--run-ignored only`) measures a 200 MB copy each way and the
//! peak RSS of `sbx`, which must stay in constant memory (the CLI streams 64 KiB chunks).

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{CliRun, DataDir, SBX, Sbxd, oci_containers, sbx, unique, wait_bounded};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_proto::v1::{CopyToSandboxInput, CopyToSandboxStart, SandboxRef, copy_to_sandbox_input};
use sha2::{Digest, Sha256};

/// How long a command that should end at once may take.
const QUICK: Duration = Duration::from_secs(20);

/// One test's sbxd (default driver) with sandbox "box" running `sleep 3600`.
struct World {
    sbxd: Sbxd,
    data: DataDir,
    cgroup_parent: String,
    /// Local scratch space (the host side of the copies).
    tmp: tempfile::TempDir,
}

impl World {
    fn new() -> World {
        let data = DataDir::new();
        let cgroup_parent = format!("sbx-gateway-tests-files-{}", unique());
        let sbxd = Sbxd::start(data.path(), "", &["--oci-cgroup-parent", &cgroup_parent]);
        let w = World {
            sbxd,
            data,
            cgroup_parent,
            tmp: tempfile::tempdir().expect("temp dir"),
        };
        let created = w.sbx(&["sandbox", "create", "-n", "box", "--", "sleep", "3600"]);
        assert_eq!(created.code, 0, "{created:?}");
        w
    }

    fn endpoint(&self) -> String {
        self.sbxd.endpoint()
    }

    fn sbx(&self, args: &[&str]) -> CliRun {
        sbx(&self.endpoint(), args)
    }

    fn cp(&self, src: &str, dst: &str) -> CliRun {
        self.sbx(&["sandbox", "cp", src, dst])
    }

    /// `sbx sandbox exec box -- sh -c SCRIPT`.
    fn sh(&self, script: &str) -> CliRun {
        self.sbx(&["sandbox", "exec", "box", "--", "sh", "-c", script])
    }

    fn local(&self, rel: &str) -> PathBuf {
        self.tmp.path().join(rel)
    }

    fn id(&self) -> String {
        self.sbx(&["sandbox", "get", "box", "-o", "json"]).json()["id"]
            .as_str()
            .expect("an id")
            .to_string()
    }

    /// The sandbox's directory on the host (root fs layers, volume, logs).
    fn sandbox_dir(&self) -> PathBuf {
        self.data
            .path()
            .join("drivers/oci/sandboxes")
            .join(self.id())
    }

    /// The host pid of the sandbox's container init (from `runc state`).
    fn init_pid(&self) -> i32 {
        let ids = oci_containers(self.data.path());
        assert_eq!(ids.len(), 1, "containers: {ids:?}");
        let out = Command::new("runc")
            .arg("--root")
            .arg(self.data.path().join("drivers/oci/runc"))
            .args(["state", &ids[0]])
            .output()
            .expect("runc state");
        let state: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("runc state is not JSON ({e}): {out:?}"));
        state["pid"].as_i64().expect("a pid") as i32
    }

    /// Deletes the sandbox, ends sbxd by pid, and checks that nothing of them is left: no
    /// process of the sandbox, container, mount, cgroup, sandbox directory or `sbx` child.
    fn finish(mut self) {
        let init = self.init_pid();
        let init_start = common::proc_start_time(init);
        assert!(
            init_start.is_some(),
            "the sandbox's init {init} is not running"
        );
        self.sbx(&["sandbox", "delete", "box"]).ok();
        self.sbxd.sigterm(Duration::from_secs(30));
        let data = self.data.path();
        // Gone, or a zombie nobody reaped yet (it runs nothing): its stat says `Z`.
        let stat = std::fs::read_to_string(format!("/proc/{init}/stat")).unwrap_or_default();
        let alive = common::proc_start_time(init) == init_start
            && !stat
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'));
        assert!(
            !alive,
            "the sandbox's init {init} still runs after delete: {stat}"
        );
        common::assert_oci_left_nothing(data, &self.cgroup_parent);
        assert_no_sbx_children();
    }
}

/// Asserts that no `sbx` process is a child of this test (running or an unreaped zombie).
fn assert_no_sbx_children() {
    let me = std::process::id().to_string();
    let mut left = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let comm = &stat[open + 1..close];
        let ppid = stat[close + 2..].split_whitespace().nth(1);
        if comm == "sbx" && ppid == Some(me.as_str()) {
            left.push(stat.clone());
        }
    }
    assert!(left.is_empty(), "sbx children left: {left:#?}");
}

fn sha256(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

fn random_bytes(len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    rand::fill(&mut data[..]);
    data
}

/// What a tree holds, entry by entry (relative path → kind, mode, mtime, content hash or
/// link target): two trees are copies when their summaries are equal.
fn summary(root: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            let rel = path.strip_prefix(root).unwrap().display().to_string();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            let mode = meta.mode() & 0o7777;
            let what = if meta.file_type().is_symlink() {
                format!(
                    "symlink -> {}",
                    std::fs::read_link(&path).unwrap().display()
                )
            } else if meta.is_dir() {
                stack.push(path.clone());
                format!("dir {mode:o} mtime {}", meta.mtime())
            } else {
                let content = std::fs::read(&path).unwrap();
                format!(
                    "file {mode:o} mtime {} {} bytes sha256 {}",
                    meta.mtime(),
                    content.len(),
                    sha256(&content)
                )
            };
            found.insert(rel, what);
        }
    }
    found
}

fn set_mtime(path: &Path, secs: i64) {
    use nix::sys::stat::{UtimensatFlags, utimensat};
    use nix::sys::time::TimeSpec;
    let t = TimeSpec::new(secs, 0);
    utimensat(
        nix::fcntl::AT_FDCWD,
        path,
        &t,
        &t,
        UtimensatFlags::NoFollowSymlink,
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// The local tree the round trip copies: a nested dir, a 0750 file, an absolute and a
/// relative symlink, a 3 MB random file and a file with an old mtime.
fn make_tree(root: &Path) {
    std::fs::create_dir_all(root.join("nested/deeper")).unwrap();
    std::fs::write(root.join("nested/deeper/leaf.txt"), b"a leaf\n").unwrap();
    std::fs::write(root.join("secret.sh"), b"#!/bin/sh\necho secret\n").unwrap();
    std::fs::set_permissions(root.join("secret.sh"), PermissionsExt::from_mode(0o750)).unwrap();
    std::os::unix::fs::symlink("/etc/passwd", root.join("abs-link")).unwrap();
    std::os::unix::fs::symlink("nested/deeper/leaf.txt", root.join("rel-link")).unwrap();
    std::fs::write(root.join("big.bin"), random_bytes(3 * 1024 * 1024)).unwrap();
    std::fs::write(root.join("old.txt"), b"from 2001\n").unwrap();
    set_mtime(&root.join("old.txt"), 1_000_000_000);
    // Directory times last: writing into a directory changes its own.
    set_mtime(&root.join("nested/deeper"), 1_200_000_000);
    set_mtime(&root.join("nested"), 1_200_000_000);
}

#[test]
fn a_tree_round_trips_byte_exact_with_modes_times_and_symlinks() {
    let w = World::new();
    let src = w.local("src/tree");
    make_tree(&src);
    let want = summary(&src);
    let src_arg = src.to_str().unwrap();

    // Into an existing directory: under its own name; to a new path: as that name.
    w.cp(src_arg, "box:/sandbox").ok();
    w.cp(src_arg, "box:/tmp/renamed").ok();
    // A lone file to a new name.
    w.cp(src.join("big.bin").to_str().unwrap(), "box:/tmp/one.bin")
        .ok();

    // Inside: the same bytes, modes, times and link targets.
    let big = sha256(&std::fs::read(src.join("big.bin")).unwrap());
    for root in ["/sandbox/tree", "/tmp/renamed"] {
        let stat = w
            .sh(&format!(
                "cd {root} && stat -c '%n %a %s %Y' secret.sh old.txt big.bin nested/deeper/leaf.txt \
                 && readlink abs-link \
                 && readlink rel-link && sha256sum big.bin && cat rel-link"
            ))
            .ok()
            .to_string();
        let lines: Vec<&str> = stat.lines().collect();
        assert_eq!(
            lines[0],
            "secret.sh 750 22 ".to_string() + &mtime(&src, "secret.sh")
        );
        assert_eq!(lines[1], "old.txt 644 10 1000000000", "{stat}");
        assert_eq!(
            lines[2],
            format!("big.bin 644 3145728 {}", mtime(&src, "big.bin"))
        );
        assert!(
            lines[3].starts_with("nested/deeper/leaf.txt 644 7 "),
            "{stat}"
        );
        assert_eq!(lines[4], "/etc/passwd", "{stat}");
        assert_eq!(lines[5], "nested/deeper/leaf.txt", "{stat}");
        assert_eq!(lines[6], format!("{big}  big.bin"), "{stat}");
        assert_eq!(lines[7], "a leaf", "{stat}");
    }
    let one = w
        .sh("stat -c '%a %s' /tmp/one.bin && sha256sum /tmp/one.bin")
        .ok()
        .to_string();
    assert_eq!(one, format!("644 3145728\n{big}  /tmp/one.bin\n"));
    // Nothing else landed in the existing directory /sandbox.
    assert_eq!(w.sh("ls -A /sandbox").ok(), "tree\n");

    // Back out: into an existing local directory, and as a new name.
    let into = w.local("into");
    std::fs::create_dir(&into).unwrap();
    w.cp("box:/sandbox/tree", into.to_str().unwrap()).ok();
    assert_eq!(
        std::fs::read_dir(&into).unwrap().count(),
        1,
        "more than the tree in {into:?}"
    );
    assert_eq!(summary(&into.join("tree")), want, "box:/sandbox/tree");
    let back = w.local("back");
    w.cp("box:/tmp/renamed", back.to_str().unwrap()).ok();
    assert_eq!(summary(&back), want, "box:/tmp/renamed");
    // The tree's root keeps its mode too; the symlinks are symlinks.
    assert_eq!(
        std::fs::metadata(&back).unwrap().mode() & 0o7777,
        std::fs::metadata(&src).unwrap().mode() & 0o7777
    );
    assert_eq!(
        std::fs::read_link(back.join("abs-link")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert_eq!(
        std::fs::read_link(back.join("rel-link")).unwrap(),
        Path::new("nested/deeper/leaf.txt")
    );
    let one_back = w.local("one.bin");
    w.cp("box:/tmp/one.bin", one_back.to_str().unwrap()).ok();
    assert_eq!(sha256(&std::fs::read(&one_back).unwrap()), big);
    w.finish();
}

/// The mtime of `src/rel`, in seconds, as `stat -c %Y` prints it.
fn mtime(src: &Path, rel: &str) -> String {
    std::fs::metadata(src.join(rel))
        .unwrap()
        .mtime()
        .to_string()
}

/// A tar of `entries` (path, kind, file content or link target) written as given: the names'
/// bytes go into the header raw, past the tar crate's own refusal of `..` and absolute paths.
fn hostile_tar(entries: &[(&str, tar::EntryType, &str)]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (path, kind, data) in entries {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(*kind);
        h.set_mode(0o644);
        h.set_mtime(1_000_000_000);
        let name = h.as_old_mut().name.as_mut();
        name[..path.len()].copy_from_slice(path.as_bytes());
        if *kind == tar::EntryType::Symlink {
            h.set_size(0);
            h.set_link_name(data).unwrap();
            h.set_cksum();
            b.append(&h, std::io::empty()).unwrap();
        } else {
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data.as_bytes()).unwrap();
        }
    }
    b.into_inner().unwrap()
}

/// Paths under `dir` (not following symlinks) whose name contains `needle`.
fn named_under(dir: &Path, needle: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_name().to_string_lossy().contains(needle) {
                found.push(p.clone());
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            }
        }
    }
    found
}

/// Entries of `dir` (recursively, not following symlinks) with their kind and size, but
/// for those under `except`.
fn listing(dir: &Path, except: &Path) -> BTreeMap<PathBuf, (bool, u64)> {
    let mut found = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            let meta = std::fs::symlink_metadata(&p).unwrap();
            if p.starts_with(except) {
                continue;
            }
            if meta.is_dir() {
                stack.push(p.clone());
            }
            found.insert(p, (meta.is_dir(), meta.len()));
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn escapes_write_nothing_outside_the_destination() {
    let w = World::new();
    let sandbox_dir = w.sandbox_dir();
    let tag = format!("sbx-cp-escape-{}", unique());
    let mut client = w.sbxd.sandboxes().await;

    // (a) Hostile archives sent to CopyToSandbox directly, one attack per call (the first
    // refused entry ends a copy), into the volume (a host directory) and into /tmp.
    let up = format!("../../../../../../../../tmp/{tag}-dotdot");
    let abs = format!("/tmp/{tag}-abs");
    let link = format!("{tag}-evil");
    let through = format!("{link}/{tag}-through");
    let attacks = [
        (
            "a .. path",
            hostile_tar(&[(&up, tar::EntryType::Regular, "escaped")]),
        ),
        (
            "an absolute path",
            hostile_tar(&[(&abs, tar::EntryType::Regular, "escaped")]),
        ),
        (
            "a path through a symlink",
            hostile_tar(&[
                (&link, tar::EntryType::Symlink, "/tmp"),
                (&through, tar::EntryType::Regular, "escaped"),
            ]),
        ),
    ];
    for dest in ["/sandbox", "/tmp"] {
        for (what, tar) in &attacks {
            let messages = vec![
                CopyToSandboxInput {
                    input: Some(copy_to_sandbox_input::Input::Start(CopyToSandboxStart {
                        sandbox: Some(SandboxRef {
                            id: String::new(),
                            workspace: String::new(),
                            name: "box".into(),
                        }),
                        path: dest.into(),
                    })),
                },
                CopyToSandboxInput {
                    input: Some(copy_to_sandbox_input::Input::Data(tar.clone())),
                },
            ];
            let answer = tokio::time::timeout(
                QUICK,
                client.copy_to_sandbox(futures::stream::iter(messages)),
            )
            .await
            .unwrap_or_else(|_| panic!("CopyToSandbox of {what} to {dest} did not answer"));
            let status = answer.expect_err(&format!("{what} to {dest} was accepted"));
            assert_eq!(
                status.code(),
                tonic::Code::InvalidArgument,
                "{what} to {dest}: {status:?}"
            );
            eprintln!("{what} to {dest}: {}", status.message());
            assert!(
                status.message().contains(&tag),
                "{what} to {dest}: the message does not name the entry: {status:?}"
            );
        }
    }
    for name in [
        format!("{tag}-dotdot"),
        format!("{tag}-abs"),
        format!("{tag}-through"),
    ] {
        let host = Path::new("/tmp").join(&name);
        assert!(!host.exists(), "{host:?} was written on the host");
        let found = named_under(w.data.path(), &name);
        assert!(found.is_empty(), "{name} was written: {found:?}");
    }
    // Only the symlink itself was made, and only inside the sandbox.
    for found in named_under(w.data.path(), &tag) {
        assert!(
            found.starts_with(&sandbox_dir),
            "{found:?} is outside the sandbox"
        );
    }

    // (b) An upload through a symlink the sandbox planted (/sandbox/link -> /): refused, or
    // inside the sandbox only — never in the host's /etc.
    w.sh("ln -s / /sandbox/link").ok();
    let name = format!("{tag}-etc");
    let file = w.local(&name);
    std::fs::write(&file, "through the link").unwrap();
    let through_link = w.cp(
        file.to_str().unwrap(),
        &format!("box:/sandbox/link/etc/{name}"),
    );
    let host_etc = Path::new("/etc").join(&name);
    assert!(!host_etc.exists(), "{host_etc:?} was written on the host");
    eprintln!("cp through /sandbox/link: {through_link:?}");
    if through_link.code == 0 {
        assert_eq!(w.sh(&format!("cat /etc/{name}")).ok(), "through the link");
    } else {
        assert!(through_link.stderr.contains(&name), "{through_link:?}");
    }
    for found in named_under(w.data.path(), &name) {
        assert!(
            found.starts_with(&sandbox_dir),
            "{found:?} is outside the sandbox"
        );
    }

    // (c) A download of a directory holding a symlink up and out (/sandbox/out/up -> ../../..)
    // and one to an absolute path: nothing is written beside the local destination.
    w.sh("mkdir -p /sandbox/out && ln -s ../../.. /sandbox/out/up && ln -s /etc /sandbox/out/etc && echo in > /sandbox/out/file")
        .ok();
    let parent = w.local("parent");
    let dest = parent.join("dest");
    std::fs::create_dir_all(&dest).unwrap();
    std::fs::write(parent.join("sibling"), "untouched").unwrap();
    let before = listing(w.tmp.path(), &dest);
    // Twice: the second over the first (its symlinks replaced, not followed).
    for round in 0..2 {
        w.cp("box:/sandbox/out", dest.to_str().unwrap()).ok();
        let after = listing(w.tmp.path(), &dest);
        assert_eq!(after, before, "round {round}: written beside {dest:?}");
        let up = std::fs::read_link(dest.join("out/up")).unwrap();
        assert_eq!(up, Path::new("../../.."), "round {round}");
        let etc = std::fs::read_link(dest.join("out/etc")).unwrap();
        assert_eq!(etc, Path::new("/etc"), "round {round}");
        let file = std::fs::read_to_string(dest.join("out/file")).unwrap();
        assert_eq!(file, "in\n", "round {round}");
    }

    // A local destination holding a symlink where the archive has a directory
    // (`planted/out -> ../victim`): refused, and the directory it points to is untouched
    // (no file in it, its mode and time kept).
    w.sh("chmod 0777 /sandbox/out").ok();
    let planted = parent.join("planted");
    let victim = parent.join("victim");
    std::fs::create_dir_all(&planted).unwrap();
    std::fs::create_dir_all(&victim).unwrap();
    std::fs::set_permissions(&victim, PermissionsExt::from_mode(0o700)).unwrap();
    set_mtime(&victim, 1_000_000_000);
    std::os::unix::fs::symlink("../victim", planted.join("out")).unwrap();
    let through = w.cp("box:/sandbox/out", planted.to_str().unwrap());
    eprintln!("cp into a planted symlink: {through:?}");
    assert_eq!(through.code, 1, "{through:?}");
    assert!(through.stderr.contains("symlink"), "{through:?}");
    assert_eq!(
        std::fs::read_dir(&victim).unwrap().count(),
        0,
        "written into {victim:?}"
    );
    let meta = std::fs::metadata(&victim).unwrap();
    assert_eq!(
        meta.mode() & 0o7777,
        0o700,
        "{victim:?}'s mode changed through the symlink"
    );
    assert_eq!(
        meta.mtime(),
        1_000_000_000,
        "{victim:?}'s time changed through the symlink"
    );
    w.finish();
}

/// Issue 41's attack on a copy out: the sandbox's root leaves a setuid-root program and a FIFO
/// in `/sandbox`; root copies the directory out (as in the README's tour). The copy has no
/// setuid bit, so `nobody` running it gets euid 65534, not 0; the FIFO is not made, and stderr
/// says so; a 0666 file gets the caller's umask. `--preserve` keeps the modes (0666 stays
/// 0666) but still no setuid for a root caller.
///
/// The program is the host's `/usr/bin/id` (coreutils: it keeps the euid it is given and
/// prints it; busybox's `sh`, `id` and most applets drop a setuid bit themselves, so a copy of
/// busybox shows nothing), copied in as bytes: what matters is that the sandbox's root set the
/// bit.
#[test]
fn a_copy_out_as_root_makes_no_setuid_program_and_no_fifo() {
    let w = World::new();
    w.sh("mkdir /sandbox/out").ok();
    w.cp("/usr/bin/id", "box:/sandbox/out/id").ok();
    let made = w
        .sh(
            "cd /sandbox/out && chmod 4755 id && mkfifo pipe && touch open && chmod 666 open \
             && stat -c '%a %F' id pipe open",
        )
        .ok()
        .to_string();
    assert_eq!(
        made, "4755 regular file\n644 fifo\n666 regular empty file\n",
        "in the sandbox"
    );
    // Where `nobody` can reach the copy.
    std::fs::set_permissions(w.tmp.path(), PermissionsExt::from_mode(0o755)).unwrap();
    let out = w.local("out");
    let copied = w.cp("box:/sandbox/out", out.to_str().unwrap());
    assert_eq!(copied.code, 0, "{copied:?}");
    let id = out.join("id");
    let mode = std::fs::metadata(&id).unwrap().mode() & 0o7777;
    let as_nobody = run_bounded_as_nobody(&id, &["-u"]);
    assert_eq!(
        as_nobody, "65534\n",
        "nobody ran the copy ({mode:o}) with euid {as_nobody:?}"
    );
    assert_eq!(mode & 0o7000, 0, "copied out as {mode:o}: {copied:?}");
    let umask = std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Umask:"))
        .and_then(|v| u32::from_str_radix(v.trim(), 8).ok())
        .expect("a umask in /proc/self/status");
    let open = std::fs::metadata(out.join("open")).unwrap().mode() & 0o7777;
    assert_eq!(
        format!("{open:o}"),
        format!("{:o}", 0o666 & !umask),
        "umask {umask:o}"
    );
    // The FIFO: skipped, and said.
    assert!(
        std::fs::symlink_metadata(out.join("pipe")).is_err(),
        "the FIFO was made on the host"
    );
    assert!(
        copied.stderr.contains("1 FIFO") && copied.stderr.contains("box:/sandbox/out"),
        "{copied:?}"
    );
    // --preserve keeps the archive's modes, never setuid-root.
    let kept = w.local("kept");
    let preserved = w.sbx(&[
        "sandbox",
        "cp",
        "--preserve",
        "box:/sandbox/out",
        kept.to_str().unwrap(),
    ]);
    assert_eq!(preserved.code, 0, "{preserved:?}");
    for (name, want) in [("id", "755"), ("open", "666")] {
        let mode = std::fs::metadata(kept.join(name)).unwrap().mode() & 0o7777;
        assert_eq!(format!("{mode:o}"), want, "{name} with --preserve as root");
    }
    w.finish();
}

/// Runs `program ARGS` as user and group 65534 with no other groups (setpriv), bounded;
/// answers its stdout (its exit must be 0).
fn run_bounded_as_nobody(program: &Path, args: &[&str]) -> String {
    let run = common::run_bounded(
        Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(program)
            .args(args),
        "setpriv as nobody",
    );
    assert_eq!(run.code, 0, "{run:?}");
    run.stdout
}

#[test]
fn copy_errors_name_the_path_and_the_state() {
    let w = World::new();
    let missing_local = w.local("no-such-file");
    let missing_arg = missing_local.to_str().unwrap();
    let up = w.cp(missing_arg, "box:/tmp/x");
    assert_eq!(up.code, 1, "{up:?}");
    assert!(up.stderr.contains(missing_arg), "{up:?}");

    let down = w.cp("box:/no/such/file", w.local("x").to_str().unwrap());
    assert_eq!(down.code, 1, "{down:?}");
    assert!(down.stderr.contains("/no/such/file"), "{down:?}");
    assert!(!w.local("x").exists());

    // A destination whose directory does not exist, either side.
    let file = w.local("f");
    std::fs::write(&file, "f").unwrap();
    let no_dir = w.cp(file.to_str().unwrap(), "box:/no/such/dir/f");
    assert_eq!(no_dir.code, 1, "{no_dir:?}");
    assert!(no_dir.stderr.contains("/no/such/dir"), "{no_dir:?}");
    let local_no_dir = w.local("none/f");
    let no_local_dir = w.cp("box:/etc/hostname", local_no_dir.to_str().unwrap());
    assert_eq!(no_local_dir.code, 1, "{no_local_dir:?}");
    assert!(
        no_local_dir
            .stderr
            .contains(w.local("none").to_str().unwrap()),
        "{no_local_dir:?}"
    );

    // Usage errors: both sides local, both in sandboxes, a relative sandbox path.
    let local = w.cp(file.to_str().unwrap(), w.local("g").to_str().unwrap());
    assert_eq!(local.code, 2, "{local:?}");
    assert!(local.stderr.contains("NAME:/path"), "{local:?}");
    assert!(!w.local("g").exists());
    let both = w.cp("box:/etc/hostname", "box:/tmp/h");
    assert_eq!(both.code, 2, "{both:?}");
    let relative = w.cp(file.to_str().unwrap(), "box:tmp/f");
    assert_eq!(relative.code, 2, "{relative:?}");
    assert!(relative.stderr.contains("absolute"), "{relative:?}");
    let gone = w.cp(file.to_str().unwrap(), "nobox:/tmp/f");
    assert_eq!(gone.code, 1, "{gone:?}");
    assert!(gone.stderr.contains("nobox"), "{gone:?}");

    // A stopped sandbox: its files are copied on the host, both ways (the oci driver copies
    // while stopped), and the workload finds them when it runs again.
    w.sbx(&["sandbox", "stop", "box"]).ok();
    std::fs::write(&file, "copied while stopped\n").unwrap();
    let stopped_up = w.cp(file.to_str().unwrap(), "box:/tmp/f");
    assert_eq!(stopped_up.code, 0, "{stopped_up:?}");
    let stopped_down = w.cp("box:/tmp/f", w.local("h").to_str().unwrap());
    assert_eq!(stopped_down.code, 0, "{stopped_down:?}");
    assert_eq!(
        std::fs::read_to_string(w.local("h")).unwrap(),
        "copied while stopped\n"
    );
    let missing_stopped = w.cp("box:/no/such/file", w.local("y").to_str().unwrap());
    assert_eq!(missing_stopped.code, 1, "{missing_stopped:?}");
    assert!(
        missing_stopped.stderr.contains("/no/such/file"),
        "{missing_stopped:?}"
    );
    // The caller's mistake, said as one (not as the driver's).
    assert!(
        missing_stopped.stderr.contains("INVALID_ARGUMENT: ")
            && !missing_stopped.stderr.contains("DRIVER_"),
        "{missing_stopped:?}"
    );
    assert_eq!(common::oci_containers(w.data.path()), Vec::<String>::new());
    w.sbx(&["sandbox", "start", "box"]).ok();
    assert_eq!(w.sh("cat /tmp/f").ok(), "copied while stopped\n");
    w.finish();
}

/// `sbx sandbox create --upload LOCAL:DEST`: the tree is in the sandbox before its workload
/// first starts (the main command checks for it, and fails without it), with its modes and
/// symlinks; `--stopped` makes a sandbox that runs nothing until started; a missing local
/// path is refused before anything is created.
#[test]
fn create_upload_fills_the_sandbox_before_its_first_start() {
    let w = World::new();
    let app = w.local("app");
    std::fs::create_dir(&app).unwrap();
    std::fs::write(app.join("run.sh"), "#!/bin/sh\necho uploaded\n").unwrap();
    std::fs::set_permissions(app.join("run.sh"), std::fs::Permissions::from_mode(0o750)).unwrap();
    std::os::unix::fs::symlink("run.sh", app.join("link")).unwrap();
    let upload = format!("{}:/sandbox/app", app.display());
    let created = w.sbx(&[
        "sandbox",
        "create",
        "-n",
        "up",
        "--upload",
        &upload,
        "-o",
        "json",
        "--",
        "sh",
        "-c",
        "test -x /sandbox/app/run.sh || exit 3; exec sleep 3600",
    ]);
    assert_eq!(created.json()["phase"], "Ready", "{created:?}");
    let inside = w.sbx(&[
        "sandbox",
        "exec",
        "up",
        "--",
        "sh",
        "-c",
        "stat -c '%a %U' /sandbox/app/run.sh; readlink /sandbox/app/link; /sandbox/app/run.sh",
    ]);
    assert_eq!(inside.ok(), "750 root\nrun.sh\nuploaded\n");
    w.sbx(&["sandbox", "delete", "up"]).ok();

    // --stopped: Stopped, with no container, until started.
    let stopped = w.sbx(&[
        "sandbox",
        "create",
        "-n",
        "later",
        "--stopped",
        "-o",
        "json",
        "--",
        "sleep",
        "3600",
    ]);
    assert_eq!(stopped.json()["phase"], "Stopped", "{stopped:?}");
    assert_eq!(oci_containers(w.data.path()).len(), 1, "only box runs");
    w.sbx(&["sandbox", "delete", "later"]).ok();

    // A local path that does not exist: refused, nothing created.
    let missing = w.local("nothing-here");
    let arg = format!("{}:/sandbox/x", missing.display());
    let refused = w.sbx(&[
        "sandbox", "create", "-n", "never", "--upload", &arg, "--", "true",
    ]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(refused.stderr.contains("nothing-here"), "{refused:?}");
    let get = w.sbx(&["sandbox", "get", "never"]);
    assert_ne!(get.code, 0, "a refused upload created the sandbox: {get:?}");
    w.finish();
}

/// A running `sbx sandbox port-forward`: its listeners' ports (from its stdout) and its
/// stderr lines.
struct Forward {
    child: Child,
    ports: Vec<u16>,
    stderr: mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Forward {
    fn start(w: &World, specs: &[&str]) -> Forward {
        let mut child = Command::new(SBX)
            .args(["sandbox", "port-forward", "box"])
            .args(specs)
            .env("SBX_ENDPOINT", w.endpoint())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn sbx port-forward");
        let (tx, stderr) = mpsc::channel();
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut ports = Vec::new();
        for spec in specs {
            let remote = spec.rsplit(':').next().unwrap();
            let line = lines
                .recv_timeout(QUICK)
                .unwrap_or_else(|_| panic!("no Forwarding line for {spec}"));
            let rest = line
                .strip_prefix("Forwarding from 127.0.0.1:")
                .unwrap_or_else(|| panic!("{line:?}"));
            let (port, to) = rest
                .split_once(" -> ")
                .unwrap_or_else(|| panic!("{line:?}"));
            assert_eq!(to, remote, "{line:?}");
            ports.push(port.parse().unwrap_or_else(|_| panic!("{line:?}")));
        }
        Forward {
            child,
            ports,
            stderr,
            seen: Vec::new(),
        }
    }

    /// Waits (at most `limit`) for a stderr line containing every one of `needles`.
    fn stderr_line(&mut self, limit: Duration, needles: &[&str]) -> String {
        let deadline = Instant::now() + limit;
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.stderr.recv_timeout(left) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if needles.iter().all(|n| line.contains(n)) {
                        return line;
                    }
                }
                Err(_) => break,
            }
        }
        panic!(
            "no stderr line with {needles:?} within {limit:?}; saw {:#?}",
            self.seen
        );
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// An HTTP/1.0 GET of `/` on 127.0.0.1:`port`: the whole response, read to EOF (bounded).
fn http_get(port: u16, half_close: bool) -> std::io::Result<Vec<u8>> {
    let mut conn = TcpStream::connect(("127.0.0.1", port))?;
    conn.set_read_timeout(Some(QUICK))?;
    conn.write_all(b"GET / HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    if half_close {
        conn.shutdown(Shutdown::Write)?;
    }
    let mut all = Vec::new();
    conn.read_to_end(&mut all)?;
    Ok(all)
}

/// The body of a 200 response, or None.
fn body_of(response: &[u8]) -> Option<&[u8]> {
    if !response.starts_with(b"HTTP/1.") || !response[..12.min(response.len())].ends_with(b"200") {
        return None;
    }
    let at = response.windows(4).position(|w| w == b"\r\n\r\n")?;
    Some(&response[at + 4..])
}

#[test]
fn port_forward_serves_concurrent_and_half_closed_connections() {
    let w = World::new();
    // The page: 1 MiB of random bytes, copied in.
    let page = random_bytes(1024 * 1024);
    let page_sha = sha256(&page);
    std::fs::write(w.local("index.html"), &page).unwrap();
    w.sh("mkdir -p /www").ok();
    w.cp(
        w.local("index.html").to_str().unwrap(),
        "box:/www/index.html",
    )
    .ok();
    // busybox httpd goes to the background by itself.
    w.sh("httpd -p 127.0.0.1:8080 -h /www").ok();

    let mut fwd = Forward::start(&w, &["0:8080", "0:9"]);
    let (web, dead) = (fwd.ports[0], fwd.ports[1]);
    assert_ne!(web, 0);

    // The first page (httpd may take a moment to listen: bounded retries).
    let began = Instant::now();
    let first = loop {
        let got = http_get(web, false).unwrap_or_default();
        if body_of(&got).is_some() || began.elapsed() > QUICK {
            break got;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let body = body_of(&first).unwrap_or_else(|| {
        panic!(
            "no page through the forward: {:?}",
            String::from_utf8_lossy(&first[..first.len().min(300)])
        )
    });
    assert_eq!(sha256(body), page_sha, "{} bytes", body.len());

    // Twenty at once.
    let began = Instant::now();
    let clients: Vec<_> = (0..20)
        .map(|_| std::thread::spawn(move || http_get(web, false)))
        .collect();
    for (i, client) in clients.into_iter().enumerate() {
        let got = client
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("client {i}: {e}"));
        let body = body_of(&got).unwrap_or_else(|| panic!("client {i}: no page"));
        assert_eq!(sha256(body), page_sha, "client {i}: {} bytes", body.len());
    }
    eprintln!(
        "20 concurrent GETs of 1 MiB through port-forward in {:?}",
        began.elapsed()
    );

    // Half-closed: the request's end is sent, the whole answer still comes back.
    let got = http_get(web, true).expect("half-closed GET");
    assert_eq!(sha256(body_of(&got).expect("a page")), page_sha);

    // A port nobody listens on: that connection is closed at once and sbx says why; the
    // listener accepts the next one (closed again), and the other listener still serves.
    for attempt in 0..2 {
        let began = Instant::now();
        let got = http_get(dead, false);
        let took = began.elapsed();
        assert!(
            took < Duration::from_secs(10),
            "attempt {attempt}: took {took:?}"
        );
        match got {
            Ok(bytes) => assert!(bytes.is_empty(), "attempt {attempt}: {bytes:?}"),
            Err(e) => assert!(
                matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ),
                "attempt {attempt}: {e}"
            ),
        }
        let line = fwd.stderr_line(QUICK, &["error:", "port 9"]);
        assert!(line.contains("9"), "{line}");
    }
    let got = http_get(web, false).expect("GET after the dead port");
    assert_eq!(sha256(body_of(&got).expect("a page")), page_sha);

    // SIGINT ends it, with status 0 (an interrupt is how port-forward is meant to end).
    kill(Pid::from_raw(fwd.child.id() as i32), Signal::SIGINT).unwrap();
    let status = wait_bounded(&mut fwd.child, QUICK, "port-forward after SIGINT");
    assert_eq!(status.code(), Some(0), "{status:?}");
    assert!(
        TcpStream::connect(("127.0.0.1", web)).is_err(),
        "the listener is still open after exit"
    );
    drop(fwd);
    w.finish();
}

/// Runs `sbx ARGS…` under GNU time: (wall time, exit status, peak RSS in KiB).
fn timed_sbx(w: &World, args: &[&str]) -> (Duration, i32, u64, String) {
    let report = w.local(&format!("time-{}", unique()));
    let began = Instant::now();
    let mut child = Command::new("/usr/bin/time")
        .arg("-f")
        .arg("%M")
        .arg("-o")
        .arg(&report)
        .arg(SBX)
        .args(args)
        .env("SBX_ENDPOINT", w.endpoint())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn /usr/bin/time sbx");
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = wait_bounded(&mut child, Duration::from_secs(300), "timed sbx");
    let took = began.elapsed();
    let rss = std::fs::read_to_string(&report)
        .unwrap_or_default()
        .trim()
        .lines()
        .last()
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    (took, status.code().unwrap_or(-1), rss, err)
}

#[test]
#[ignore = "a measurement: 200 MB each way"]
fn cp_throughput() {
    assert!(
        Path::new("/usr/bin/time").exists(),
        "needs GNU time (Debian: time)"
    );
    let w = World::new();
    const SIZE: usize = 200 * 1024 * 1024;
    let data = random_bytes(SIZE);
    let want = sha256(&data);
    let file = w.local("big");
    std::fs::write(&file, &data).unwrap();
    drop(data);
    let mb = SIZE as f64 / 1e6;
    let (took, code, rss_in, err) = timed_sbx(
        &w,
        &["sandbox", "cp", file.to_str().unwrap(), "box:/sandbox/big"],
    );
    assert_eq!(code, 0, "{err}");
    eprintln!(
        "cp in: {mb:.0} MB in {took:?} = {:.0} MB/s, sbx peak RSS {} KiB",
        mb / took.as_secs_f64(),
        rss_in
    );
    let inside = w.sh("sha256sum /sandbox/big").ok().to_string();
    assert!(inside.starts_with(&want), "{inside}");
    let back = w.local("back");
    let (took, code, rss_out, err) = timed_sbx(
        &w,
        &["sandbox", "cp", "box:/sandbox/big", back.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{err}");
    eprintln!(
        "cp out: {mb:.0} MB in {took:?} = {:.0} MB/s, sbx peak RSS {} KiB",
        mb / took.as_secs_f64(),
        rss_out
    );
    assert_eq!(sha256(&std::fs::read(&back).unwrap()), want);
    // Constant memory: far below the file's size.
    for rss in [rss_in, rss_out] {
        assert!(rss > 0 && rss < 100 * 1024, "peak RSS {rss} KiB");
    }
    w.finish();
}
