//! End to end through the real sbxd on its default driver (oci) and the real `sbx` CLI (needs
//! root, runc and busybox-static): what a sandbox can and cannot do, tried from inside the way
//! an attacker would; a never-stopped sandbox across a SIGKILL of sbxd; images pulled from a
//! registry on 127.0.0.1 and imported in every form, then run. Each test checks that nothing of
//! it is left: no container, no mount, no cgroup.

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{CliRun, DataDir, Sbxd, eventually, mounts_under, oci_containers, sbx, unique};
use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
use sbx_drivers::oci::OciDriver;

/// One test's gateway: its data dir, and a cgroup parent of its own (the leak check looks
/// under it; tests run in parallel).
struct World {
    data: DataDir,
    cgroup_parent: String,
}

impl World {
    fn new() -> World {
        World {
            data: DataDir::new(),
            cgroup_parent: format!("sbx-gateway-tests-oci-{}", unique()),
        }
    }

    fn start(&self, extra: &[&str]) -> Sbxd {
        let mut args = vec!["--oci-cgroup-parent", &self.cgroup_parent];
        args.extend_from_slice(extra);
        // "": no --driver, the default.
        Sbxd::start(self.data.path(), "", &args)
    }

    /// Deletes the sandboxes, then asserts that nothing of them is left on the host.
    fn delete_and_check_nothing_left(&self, endpoint: &str, names: &[&str]) {
        let data = self.data.path();
        for name in names {
            sbx(endpoint, &["sandbox", "delete", name]).ok();
        }
        assert!(
            oci_containers(data).is_empty(),
            "{:?}",
            oci_containers(data)
        );
        assert!(mounts_under(data).is_empty(), "{:?}", mounts_under(data));
        let cgroups = OciDriver::cgroup_leftovers(&self.cgroup_parent);
        assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
        let left = std::fs::read_dir(data.join("drivers/oci/sandboxes"))
            .unwrap()
            .count();
        assert_eq!(left, 0, "sandbox directories left");
        for entry in std::fs::read_dir("/sys/fs/cgroup")
            .into_iter()
            .flatten()
            .flatten()
        {
            let _ = std::fs::remove_dir(entry.path().join(&self.cgroup_parent));
        }
    }
}

/// The id of sandbox `name` in the default workspace.
fn id_of(endpoint: &str, name: &str) -> String {
    sbx(endpoint, &["sandbox", "get", name, "-o", "json"]).json()["id"]
        .as_str()
        .expect("an id")
        .to_string()
}

fn exec(endpoint: &str, name: &str, script: &str) -> CliRun {
    sbx(
        endpoint,
        &["sandbox", "exec", name, "--", "sh", "-c", script],
    )
}

/// The host path of sandbox `id`'s persistent volume (`/sandbox` inside).
fn volume(data: &Path, id: &str) -> PathBuf {
    data.join("drivers/oci/sandboxes")
        .join(id)
        .join("disk/volume")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_sandbox_runs_an_image_behind_a_real_boundary() {
    let w = World::new();
    let data = &w.data;
    let d = w.start(&[]);
    let ep = d.endpoint();
    // No pull: the built-in image is made locally.
    let created = sbx(
        &ep,
        &["sandbox", "create", "-n", "box", "--", "sleep", "3600"],
    );
    assert_eq!(created.code, 0, "{created:?}");
    let get = sbx(&ep, &["sandbox", "get", "box", "-o", "json"]).json();
    assert_eq!(get["phase"], "Ready", "{get}");
    assert_eq!(get["driver"], "oci", "{get}");
    assert!(
        get["image_digest"]
            .as_str()
            .is_some_and(|d| d.starts_with("sha256:")),
        "{get}"
    );
    let id = id_of(&ep, "box");

    // The host's files are invisible: a marker in the host's /root, the gateway's data dir.
    let marker = format!("/root/sbx-e2e-marker-{}", unique());
    std::fs::write(&marker, "host secret").unwrap();
    let read = exec(&ep, "box", &format!("cat {marker}"));
    std::fs::remove_file(&marker).unwrap();
    assert_ne!(read.code, 0, "the host's {marker} is readable: {read:?}");
    assert!(!read.stdout.contains("host secret"));
    let data_dir = data.path().display().to_string();
    let listed = exec(&ep, "box", &format!("ls {data_dir} || ls {data_dir}/store"));
    assert_ne!(listed.code, 0, "the data dir is visible inside: {listed:?}");
    let root = exec(&ep, "box", "ls /").ok().to_string();
    assert!(
        root.contains("sandbox") && !root.contains("work"),
        "not the image's root: {root}"
    );

    // Root inside writes /sandbox as an unprivileged uid of the host.
    assert_eq!(exec(&ep, "box", "id -u").ok().trim(), "0");
    exec(&ep, "box", "echo mine > /sandbox/mine").ok();
    let meta = std::fs::metadata(volume(data.path(), &id).join("mine")).unwrap();
    assert_ne!(meta.uid(), 0, "a file written inside is owned by host root");
    // A host uid of the sandbox's own range (from sbxd's uid pool), not the shared 200000.
    let pool = sbx_drivers::uidpool::UidPool::default();
    assert!(
        meta.uid() >= pool.start && meta.uid() < pool.start + pool.count,
        "{}",
        meta.uid()
    );

    // mount, /proc/sysrq-trigger and unshare are refused (`h` only prints the sysrq help).
    for (what, script) in [
        ("mount", "mount -t tmpfs none /mnt"),
        (
            "a write to /proc/sysrq-trigger",
            "echo h > /proc/sysrq-trigger",
        ),
        ("unshare", "unshare -U -m true"),
        ("a sysctl", "echo 1 > /proc/sys/kernel/sysrq"),
    ] {
        let run = exec(&ep, "box", script);
        assert_ne!(run.code, 0, "{what} was allowed inside: {run:?}");
    }

    // Another sandbox sees none of this one's files or processes.
    sbx(
        &ep,
        &["sandbox", "create", "-n", "other", "--", "sleep", "3601"],
    )
    .ok();
    exec(&ep, "box", "echo s > /etc/only-in-box").ok();
    let seen = exec(&ep, "other", "ls /sandbox /etc; ps -o args")
        .ok()
        .to_string();
    assert!(
        !seen.contains("only-in-box") && !seen.contains("mine"),
        "{seen}"
    );
    assert!(
        !seen.contains("sleep 3600") && seen.contains("sleep 3601"),
        "{seen}"
    );

    w.delete_and_check_nothing_left(&ep, &["box", "other"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_stays_inside_and_a_memory_hog_is_oom_killed() {
    let w = World::new();
    let d = w.start(&["--oci-pids-limit", "64"]);
    let ep = d.endpoint();
    let bomb = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "bomb",
            "--",
            "sh",
            "-c",
            "b() { b | b & }; b; sleep 60",
        ],
    );
    assert_eq!(bomb.code, 0, "{bomb:?}");
    let id = id_of(&ep, "bomb");
    std::thread::sleep(Duration::from_millis(500));
    // The host stays responsive: it starts processes, and sbxd answers, at once.
    for _ in 0..5 {
        let began = std::time::Instant::now();
        assert!(
            std::process::Command::new("true")
                .status()
                .unwrap()
                .success()
        );
        sbx(&ep, &["sandbox", "get", "bomb"]).ok();
        assert!(
            began.elapsed() < Duration::from_secs(3),
            "the host took {:?}",
            began.elapsed()
        );
    }
    let pids = ["/sys/fs/cgroup/pids", "/sys/fs/cgroup"]
        .iter()
        .find_map(|root| {
            std::fs::read_to_string(format!("{root}/{}/{id}/pids.current", w.cgroup_parent)).ok()
        })
        .and_then(|t| t.trim().parse::<u64>().ok());
    assert!(
        pids.is_some_and(|n| n <= 64),
        "{pids:?} processes, limit 64"
    );

    let hog = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "-n",
            "hog",
            "--memory",
            "32Mi",
            "-d",
            "--",
            "sh",
            "-c",
            "dd if=/dev/zero of=/dev/null bs=256M count=1",
        ],
    );
    assert_eq!(hog.code, 0, "{hog:?}");
    let reason = eventually(Duration::from_secs(30), "hog OOMKilled", || async {
        let got = sbx(&ep, &["sandbox", "get", "hog", "-o", "json"]).json();
        (got["reason"] == "OOMKilled").then_some(got)
    })
    .await;
    assert_eq!(reason["phase"], "Error", "{reason}");
    w.delete_and_check_nothing_left(&ep, &["bomb", "hog"]);
}

/// The init's identity (its /proc stat line) recorded for the current run of sandbox `id`.
fn init_identity(data: &Path, id: &str) -> String {
    let dir = data.join("drivers/oci/sandboxes").join(id);
    std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("run-"))
        .and_then(|e| std::fs::read_to_string(e.path().join("init")).ok())
        .expect("a recorded init")
}

/// Whether the process of a /proc stat line still runs: same pid, same start time, and not a
/// zombie waiting to be reaped.
fn alive(stat_line: &str) -> bool {
    let fields: Vec<&str> = stat_line.split_whitespace().collect();
    let pid = fields[0];
    let start = stat_line[stat_line.rfind(')').unwrap() + 2..]
        .split_whitespace()
        .nth(19)
        .unwrap()
        .to_string();
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|now| {
        let mut after = now[now.rfind(')').unwrap() + 2..].split_whitespace();
        let state = after.next();
        let started = after.nth(18);
        started == Some(start.as_str()) && !matches!(state, Some("Z" | "X"))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_stopped_sandbox_survives_sigkill_of_sbxd_and_its_root_fs_survives_stop_start() {
    let w = World::new();
    let data = &w.data;
    let mut d = w.start(&[]);
    let ep = d.endpoint();
    sbx(
        &ep,
        &["sandbox", "create", "-n", "keep", "--", "sleep", "3600"],
    )
    .ok();
    let id = id_of(&ep, "keep");
    exec(
        &ep,
        "keep",
        "echo rootfs > /etc/kept; echo volume > /sandbox/kept",
    )
    .ok();
    let before = sbx(&ep, &["sandbox", "get", "keep", "-o", "json"]).json();
    let init = init_identity(data.path(), &id);
    assert!(alive(&init));

    d.sigkill();
    let d = w.start(&[]);
    let ep = d.endpoint();
    let after = sbx(&ep, &["sandbox", "get", "keep", "-o", "json"]).json();
    assert_eq!(after["phase"], "Ready", "{after}");
    assert_eq!(after["generation"], before["generation"], "{after}");
    assert_eq!(
        init_identity(data.path(), &id),
        init,
        "the workload was restarted"
    );
    assert!(alive(&init), "the workload died with sbxd");
    assert_eq!(
        exec(&ep, "keep", "cat /etc/kept /sandbox/kept").ok(),
        "rootfs\nvolume\n"
    );

    // Stop and start: a new run, and the whole root filesystem is still there.
    sbx(&ep, &["sandbox", "stop", "keep"]).ok();
    assert!(!alive(&init), "the stopped workload still runs");
    // Its disk (sbxd's --default-disk) stays mounted: what it holds is the sandbox's.
    let left: Vec<String> = mounts_under(data.path())
        .into_iter()
        .filter(|m| !m.ends_with(&format!("{id}/disk")))
        .collect();
    assert!(left.is_empty(), "a stopped sandbox keeps a mount: {left:?}");
    sbx(&ep, &["sandbox", "start", "keep"]).ok();
    assert_eq!(
        exec(&ep, "keep", "cat /etc/kept /sandbox/kept").ok(),
        "rootfs\nvolume\n"
    );
    let restarted = sbx(&ep, &["sandbox", "get", "keep", "-o", "json"]).json();
    assert_ne!(restarted["generation"], before["generation"]);
    w.delete_and_check_nothing_left(&ep, &["keep"]);
}

/// A layer of a runnable image: a static busybox with `sh`, `cat` and `sleep`, and a marker.
fn runnable_layer(marker: &str) -> Vec<u8> {
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static");
    fixtures::tar_bytes(&[
        TarEntry::dir("bin/"),
        TarEntry::file("bin/busybox", &busybox).mode(0o755),
        TarEntry::symlink("bin/sh", "busybox"),
        TarEntry::symlink("bin/cat", "busybox"),
        TarEntry::symlink("bin/sleep", "busybox"),
        TarEntry::dir("etc/"),
        TarEntry::file("etc/marker", marker.as_bytes()),
        TarEntry::dir("proc/"),
        TarEntry::dir("sys/"),
        TarEntry::dir("dev/"),
    ])
}

/// Runs a sandbox from `image` and reads its marker back.
fn marker_of(ep: &str, name: &str, image: &str) -> String {
    let created = sbx(
        ep,
        &[
            "sandbox", "create", "-n", name, "--image", image, "--", "sleep", "3600",
        ],
    );
    assert_eq!(created.code, 0, "{created:?}");
    exec(ep, name, "cat /etc/marker").ok().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_pulled_from_a_registry_and_imported_in_every_form_run() {
    if !LocalRegistry::available("images_pulled_from_a_registry_and_imported_in_every_form_run") {
        return;
    }
    let w = World::new();
    let d = w.start(&[]);
    let ep = d.endpoint();
    let work = tempfile::tempdir().unwrap();

    // Pull: an OCI layout written here, pushed with skopeo to a registry on 127.0.0.1.
    let registry = LocalRegistry::start(&work.path().join("registry"));
    let layout = work.path().join("pushed");
    fixtures::write_oci_layout(&layout, &[runnable_layer("pulled\n")], "v1");
    let reference = format!("{}/sbx-test/marker:v1", registry.addr);
    registry.push(&layout, &reference, &[]);
    let pulled = sbx(&ep, &["image", "pull", &reference]);
    assert_eq!(pulled.code, 0, "{pulled:?}");
    assert!(
        pulled.stderr.contains("sha256:"),
        "no progress shown: {pulled:?}"
    );
    assert_eq!(marker_of(&ep, "pulled", &reference), "pulled\n");

    // Import: an OCI layout directory, a docker-save archive, a plain rootfs tar.
    let dir = work.path().join("oci-dir");
    fixtures::write_oci_layout(&dir, &[runnable_layer("oci layout\n")], "v1");
    let dir_path = dir.display().to_string();
    sbx(
        &ep,
        &["image", "import", &dir_path, "--name", "local/oci:v1"],
    )
    .ok();
    assert_eq!(
        marker_of(&ep, "from-layout", "local/oci:v1"),
        "oci layout\n"
    );

    let archive = work.path().join("docker.tar");
    std::fs::write(
        &archive,
        fixtures::docker_archive(&[runnable_layer("docker archive\n")], "local/docker:v1"),
    )
    .unwrap();
    sbx(&ep, &["image", "import", &archive.display().to_string()]).ok();
    assert_eq!(
        marker_of(&ep, "from-archive", "local/docker:v1"),
        "docker archive\n"
    );

    let rootfs = work.path().join("rootfs.tar");
    std::fs::write(&rootfs, runnable_layer("rootfs tar\n")).unwrap();
    let rootfs_path = rootfs.display().to_string();
    sbx(
        &ep,
        &["image", "import", &rootfs_path, "--name", "local/rootfs:v1"],
    )
    .ok();
    assert_eq!(
        marker_of(&ep, "from-rootfs", "local/rootfs:v1"),
        "rootfs tar\n"
    );

    // An image in use is not removed; the refusal names its user.
    let rm = sbx(&ep, &["image", "rm", "local/rootfs:v1"]);
    assert_ne!(rm.code, 0, "{rm:?}");
    assert!(rm.stderr.contains("default/from-rootfs"), "{rm:?}");
    w.delete_and_check_nothing_left(
        &ep,
        &["pulled", "from-layout", "from-archive", "from-rootfs"],
    );
    sbx(&ep, &["image", "rm", "local/rootfs:v1"]).ok();
}

/// Entries of `dir` (recursively), as paths relative to it.
fn files_under(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            found.push(p.strip_prefix(dir).unwrap().display().to_string());
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            }
        }
    }
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_images_are_refused_clearly_and_leave_nothing_behind() {
    if !LocalRegistry::available("bad_images_are_refused_clearly_and_leave_nothing_behind") {
        return;
    }
    let w = World::new();
    let d = w.start(&[]);
    let ep = d.endpoint();
    let work = tempfile::tempdir().unwrap();
    let images_dir = w.data.path().join("images");
    let before = files_under(&images_dir);
    let refused = |args: &[&str], code: &str, names: &str| {
        let run = sbx(&ep, args);
        assert_ne!(run.code, 0, "{args:?} succeeded: {run:?}");
        assert!(
            run.stderr.contains(code) && run.stderr.contains(names),
            "{args:?}: expected {code} naming {names}: {run:?}"
        );
    };

    // A registry nobody listens on, a tag it does not have, a reference that is not one.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("127.0.0.1:{port}/sbx-test/none:v1");
    refused(&["image", "pull", &dead], "REGISTRY_UNAVAILABLE", &dead);
    let registry = LocalRegistry::start(&work.path().join("registry"));
    let missing = format!("{}/sbx-test/missing:v1", registry.addr);
    refused(
        &["image", "pull", &missing],
        "IMAGE_NOT_FOUND",
        "sbx-test/missing",
    );
    // (The CLI refuses a malformed reference itself, as a usage error.)
    refused(
        &["image", "pull", "Not A Reference"],
        "is invalid",
        "Not A Reference",
    );

    // A layout with only an arm64 image: nothing for this machine.
    let arm = work.path().join("arm64");
    fixtures::write_oci_layout(&arm, &[runnable_layer("arm\n")], "v1");
    let index_path = arm.join("index.json");
    let mut index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&index_path).unwrap()).unwrap();
    index["manifests"][0]["platform"] = serde_json::json!({"os": "linux", "architecture": "arm64"});
    std::fs::write(&index_path, serde_json::to_vec(&index).unwrap()).unwrap();
    let arm_path = arm.display().to_string();
    refused(
        &["image", "import", &arm_path, "--name", "local/arm:v1"],
        "IMAGE_PLATFORM",
        "arm64",
    );

    // A rootfs tar whose layer tries to write outside itself.
    let hostile = work.path().join("hostile.tar");
    std::fs::write(
        &hostile,
        fixtures::tar_bytes(&[
            TarEntry::file("etc/ok", b"fine"),
            TarEntry::file("../../../escaped-by-sbx-test", b"out"),
        ]),
    )
    .unwrap();
    let hostile_path = hostile.display().to_string();
    refused(
        &[
            "image",
            "import",
            &hostile_path,
            "--name",
            "local/hostile:v1",
        ],
        "IMAGE_INVALID",
        "..",
    );

    // An unknown image at create: refused, and no sandbox is made.
    refused(
        &[
            "sandbox",
            "create",
            "-n",
            "ghost",
            "--image",
            "local/nothing:v1",
            "--pull",
            "never",
            "--",
            "true",
        ],
        "IMAGE_NOT_FOUND",
        "local/nothing:v1",
    );
    let listed = sbx(&ep, &["sandbox", "list", "-o", "json"]).json();
    assert_eq!(listed.as_array().expect("a list").len(), 0, "{listed}");

    // Nothing half-made: the image store holds what it held, and only the built-in image.
    let names: Vec<String> = sbx(&ep, &["image", "list", "-o", "json"])
        .json()
        .as_array()
        .expect("a list")
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["sbx.local/busybox:latest"]);
    let after = files_under(&images_dir);
    let new: Vec<&String> = after.iter().filter(|f| !before.contains(f)).collect();
    assert!(
        new.iter()
            .all(|f| !f.starts_with("layers/") && !f.starts_with("tmp/")),
        "the refused images left {new:?}"
    );
    assert!(
        files_under(w.data.path())
            .iter()
            .all(|f| !f.contains("escaped-by-sbx-test")),
        "the hostile layer wrote outside itself"
    );
    assert!(
        !w.data
            .path()
            .parent()
            .unwrap()
            .join("escaped-by-sbx-test")
            .exists()
    );
}
