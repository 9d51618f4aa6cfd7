//! Process driver: what a workload must not be able to do, tried from inside a real sandbox
//! (needs root, `uidmap` and `root:200000:65536` in /etc/subuid and /etc/subgid).
//!
//! Each attack is checked twice: the command fails, *and* what a broken boundary would have
//! let it do did not happen (the marker stayed unread, the process stayed in its cgroup, the
//! host's interfaces stayed out of sight, …). A workload running as host root, as it did before
//! the user namespace, passes none of these tests.

mod process_support;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use process_support::*;
use sbx_driver_api::ComputeDriver;
use sbx_driver_process::{ProcessDriver, ProcessDriverOptions};
use uuid::Uuid;

/// Runs `script` with `sh -c` in the sandbox; stdout, stderr and the exit code.
async fn sh(driver: &ProcessDriver, id: Uuid, script: &str) -> (String, String, i32) {
    let r = exec(driver, id, &["sh", "-c", script], 20).await;
    assert!(r.error.is_none(), "{script}: {r:?}");
    let code = r.exit.as_ref().map(|e| e.code).unwrap_or(-1);
    (r.stdout, r.stderr, code)
}

/// Asserts that `script` fails inside the sandbox; returns its stdout.
async fn refused(driver: &ProcessDriver, id: Uuid, script: &str) -> String {
    let (out, err, code) = sh(driver, id, script).await;
    assert_ne!(
        code, 0,
        "{script} succeeded inside the sandbox: {out} {err}"
    );
    out
}

async fn sleeper(driver: &ProcessDriver, name: &str) -> Uuid {
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, name, spec(&["sleep", "1000"]), 1))
        .await
        .unwrap();
    id
}

/// The `Name:\tvalue` line of `/proc/<pid>/status`, as the host sees it.
fn status_field(pid: i32, name: &str) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}:")))
        .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
        .trim()
        .to_string()
}

/// The pids of the sandbox's cgroup (on the first hierarchy that has it).
fn sandbox_pids(driver: &ProcessDriver, id: Uuid) -> Vec<i32> {
    driver
        .cgroup_parent_dirs()
        .iter()
        .find_map(|p| {
            std::fs::read_to_string(p.join(format!("sbx-{id}")).join("cgroup.procs")).ok()
        })
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// Removes the file when dropped, also when the test fails.
struct Marker(PathBuf);

impl Drop for Marker {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test]
async fn root_inside_is_a_stranger_to_the_hosts_files() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = sleeper(&driver, "stranger").await;

    // uid 0 with no capability at all, and no way to gain one.
    let (out, _, code) = sh(
        &driver,
        id,
        "id -u; id -g; grep -E '^(CapEff|CapPrm|CapBnd|NoNewPrivs):' /proc/self/status",
    )
    .await;
    assert_eq!(code, 0, "{out}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..2], ["0", "0"], "{out}");
    for cap in ["CapEff", "CapPrm", "CapBnd"] {
        assert!(
            out.contains(&format!("{cap}:\t0000000000000000")),
            "{cap} is not empty: {out}"
        );
    }
    assert!(out.contains("NoNewPrivs:\t1"), "{out}");

    // Its host ids are a range of its own from the uid pool.
    let base = driver.id_map(id).unwrap().host_uid;
    let pool = sbx_host_kit::uidpool::UidPool::default();
    assert!(
        base >= pool.start && base < pool.start + pool.count,
        "{base}"
    );

    // The main process, seen from the host: host uid and gid BASE, no capabilities. Ready
    // comes when the shim has started it; its way into `sleep` (unshare, setpriv, sh, exec)
    // may take a moment more: looked for for at most 5 s.
    let began = std::time::Instant::now();
    let main = loop {
        let found = sandbox_pids(&driver, id).into_iter().find(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
        });
        if let Some(pid) = found {
            break pid;
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(5),
            "the workload's sleep is in its cgroup"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(
        status_field(main, "Uid"),
        format!("{base}\t{base}\t{base}\t{base}")
    );
    assert_eq!(
        status_field(main, "Gid"),
        format!("{base}\t{base}\t{base}\t{base}")
    );
    assert_eq!(status_field(main, "Groups"), "");
    assert_eq!(status_field(main, "CapEff"), "0000000000000000");
    assert_eq!(status_field(main, "NoNewPrivs"), "1");

    // Root's files on the host: a secret in /root, /etc/shadow, writing /root.
    let secret = format!("secret-{}", Uuid::new_v4());
    let marker = Marker(PathBuf::from(format!("/root/sbx-boundary-{id}")));
    std::fs::write(&marker.0, &secret).unwrap();
    let out = refused(&driver, id, &format!("cat {}", marker.0.display())).await;
    assert!(!out.contains(&secret), "the secret was read: {out}");
    let out = refused(&driver, id, "cat /etc/shadow").await;
    assert!(!out.contains("root:"), "/etc/shadow was read: {out}");
    let written = PathBuf::from(format!("/root/sbx-boundary-{id}-written"));
    let _written = Marker(written.clone());
    refused(&driver, id, &format!("touch {}", written.display())).await;
    assert!(!written.exists(), "the sandbox wrote {}", written.display());

    // /sandbox is root's inside, base's on the host.
    let (_, err, code) = sh(&driver, id, "echo hi > /sandbox/mine && mkdir /sandbox/d").await;
    assert_eq!(code, 0, "{err}");
    for name in ["", "mine", "d"] {
        let meta = std::fs::metadata(driver.persistent_dir(id).join(name)).unwrap();
        assert_eq!((meta.uid(), meta.gid()), (base, base), "/sandbox/{name}");
    }

    // The exec'd command is no more privileged than the workload.
    let (out, _, _) = sh(&driver, id, "grep -E '^(Uid|CapEff):' /proc/self/status").await;
    assert!(
        out.contains("Uid:\t0\t0\t0\t0") && out.contains("CapEff:\t0000000000000000"),
        "{out}"
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn mounts_namespaces_and_sysctls_stay_as_the_driver_made_them() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = sleeper(&driver, "walls").await;
    let pids_visible = r"ls /proc | grep -c '^[0-9]'";

    // Unmounting the sandbox's /proc would show the host's processes.
    refused(&driver, id, "umount /proc").await;
    refused(&driver, id, "umount -l /proc").await;
    let (out, _, _) = sh(&driver, id, pids_visible).await;
    let visible: u32 = out.trim().parse().unwrap();
    let host_pids = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .count();
    assert!(
        visible < 10 && host_pids > 10,
        "{visible} processes visible in the sandbox, {host_pids} on the host"
    );
    refused(&driver, id, "mount -t tmpfs sbx-attack /mnt").await;
    refused(&driver, id, "mount -t proc proc /mnt").await;

    // Into another network namespace: pid 1 is the shim, in the sandbox's own; the host's is
    // out of reach (a host root would land in it and see eth0 and the rest).
    let host_interfaces = interfaces(&std::fs::read_to_string("/proc/net/dev").unwrap());
    for attempt in [
        "nsenter --net=/proc/1/ns/net cat /proc/net/dev",
        "nsenter -t 1 -n cat /proc/net/dev",
        "nsenter -t 1 -a cat /proc/net/dev",
    ] {
        let (out, _, code) = sh(&driver, id, attempt).await;
        let seen = interfaces(&out);
        assert!(
            code != 0 || seen == ["lo"],
            "{attempt}: sees {seen:?} (the host has {host_interfaces:?})"
        );
    }

    // The hostname, sysctls: the uts namespace and /proc/sys are host root's.
    refused(&driver, id, "hostname attacker").await;
    let (out, _, _) = sh(&driver, id, "cat /proc/sys/kernel/hostname").await;
    assert_eq!(out.trim(), "walls");
    let before = std::fs::read_to_string("/proc/sys/kernel/domainname").unwrap();
    refused(&driver, id, "echo attacker > /proc/sys/kernel/domainname").await;
    let (out, _, _) = sh(&driver, id, "cat /proc/sys/kernel/domainname").await;
    assert_eq!(out, before, "the sandbox's domainname changed");
    refused(&driver, id, "echo 3 > /proc/sys/vm/drop_caches").await;
    refused(&driver, id, "echo 1 > /proc/sys/net/ipv4/ip_forward").await;
    drop(driver);
    env.finish().await;
}

/// The interface names of a `/proc/net/dev` text.
fn interfaces(dev: &str) -> Vec<String> {
    dev.lines()
        .skip(2)
        .filter_map(|l| l.split_once(':'))
        .map(|(name, _)| name.trim().to_string())
        .collect()
}

#[tokio::test]
async fn a_workload_cannot_leave_its_cgroups() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = sleeper(&driver, "kept").await;
    let leaf = format!("sbx-{id}");
    let parents = driver.cgroup_parent_dirs();
    assert!(!parents.is_empty(), "no cgroup hierarchy to test with");
    // Every hierarchy's root (e.g. /sys/fs/cgroup/memory), and the sandbox's own parent.
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let mut targets: Vec<PathBuf> = parents.clone();
    for parent in &parents {
        let root = mountinfo
            .lines()
            .filter(|l| l.contains(" - cgroup ") || l.contains(" - cgroup2 "))
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|mount| parent.starts_with(mount))
            .max_by_key(|mount| mount.len())
            .unwrap_or_else(|| panic!("no cgroup mount holds {}", parent.display()));
        targets.push(PathBuf::from(root));
    }
    targets.sort();
    targets.dedup();
    for target in &targets {
        let procs = target.join("cgroup.procs");
        let script = format!(
            "echo $$ > {}; rc=$?; cat /proc/$$/cgroup; exit $rc",
            procs.display()
        );
        let (out, err, code) = sh(&driver, id, &script).await;
        assert_ne!(code, 0, "moved into {}: {out} {err}", procs.display());
        // Every hierarchy the driver uses still places the shell in the sandbox's leaf.
        let in_leaf = out.lines().filter(|l| l.contains(&leaf)).count();
        assert!(in_leaf >= parents.len(), "left the sandbox's cgroup: {out}");
    }
    refused(
        &driver,
        id,
        &format!(
            "echo 1 > {}",
            parents[0].join(&leaf).join("cgroup.procs").display()
        ),
    )
    .await;
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn the_state_directory_and_the_hidden_paths_are_empty_inside() {
    let env = TestEnv::new();
    let secrets = tempfile::Builder::new()
        .prefix("sbx-hidden-")
        .tempdir()
        .unwrap();
    std::fs::write(secrets.path().join("store.db"), "gateway secret").unwrap();
    open_up(secrets.path());
    let opts = ProcessDriverOptions {
        hidden_paths: vec![
            secrets.path().to_path_buf(),
            PathBuf::from("/nonexistent/sbx-path"),
        ],
        ..env.options()
    };
    let driver = ProcessDriver::open(env.state_dir.path().to_path_buf(), opts).unwrap();
    // A neighbour whose files would be readable from its sandbox directory (world-readable,
    // so only the hiding keeps them out of reach of an unprivileged uid).
    let neighbour = Uuid::new_v4();
    driver
        .create(create_req(
            neighbour,
            "neighbour",
            spec(&["sh", "-c", "echo neighbour-secret; exec sleep 1000"]),
            1,
        ))
        .await
        .unwrap();
    let neighbour_log = env
        .state_dir
        .path()
        .join("sandboxes")
        .join(neighbour.to_string())
        .join("workload.log");
    wait_until(std::time::Duration::from_secs(5), || {
        std::fs::read_to_string(&neighbour_log)
            .unwrap_or_default()
            .contains("neighbour-secret")
            .then_some(())
            .ok_or(())
    })
    .await
    .unwrap();
    open_up(env.state_dir.path());
    let id = sleeper(&driver, "nosy").await;

    let state = std::fs::canonicalize(env.state_dir.path()).unwrap();
    for dir in [state.as_path(), secrets.path()] {
        let (out, err, code) = sh(&driver, id, &format!("ls -A {}", dir.display())).await;
        assert_eq!(
            (out.as_str(), code),
            ("", 0),
            "{} is not empty inside: {err}",
            dir.display()
        );
    }
    let out = refused(&driver, id, &format!("cat {}", neighbour_log.display())).await;
    assert!(!out.contains("neighbour-secret"), "{out}");
    let out = refused(
        &driver,
        id,
        &format!("cat {}", secrets.path().join("store.db").display()),
    )
    .await;
    assert!(!out.contains("gateway secret"), "{out}");
    // The hiding cannot be undone: not by unmounting, nor from a user namespace of its own.
    refused(&driver, id, &format!("umount {}", state.display())).await;
    let (out, _, _) = sh(
        &driver,
        id,
        &format!(
            "unshare --user --map-root-user --mount sh -c 'umount -l {0}; ls -A {0}; cat {1}'",
            state.display(),
            neighbour_log.display()
        ),
    )
    .await;
    assert!(
        !out.contains("neighbour-secret") && !out.contains("sandboxes"),
        "{out}"
    );
    // The workload's own /sandbox still works, and the host still sees the state.
    let (_, err, code) = sh(&driver, id, "echo ok > /sandbox/f && cat /sandbox/f").await;
    assert_eq!(code, 0, "{err}");
    assert!(neighbour_log.exists());
    drop(driver);
    env.finish().await;
}

/// Makes every directory and file under `dir` world-readable, so that only the hiding (not
/// the permissions) keeps a sandbox out.
fn open_up(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    // Executables (the driver's agent) keep their execute bits.
    let was = std::fs::metadata(dir).map(|m| m.mode()).unwrap_or(0);
    let mode = if dir.is_dir() {
        0o755
    } else {
        0o644 | (was & 0o111)
    };
    let _ = std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode));
    if dir.is_dir() {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            open_up(&entry.path());
        }
    }
}

#[tokio::test]
async fn a_sandbox_cannot_write_files_another_sandbox_owns() {
    let env = TestEnv::new();
    let driver = env.open();
    let a = sleeper(&driver, "owner").await;
    let b = sleeper(&driver, "intruder").await;
    let (ua, ub) = (driver.id_map(a).unwrap(), driver.id_map(b).unwrap());
    assert_ne!(ua.host_uid, ub.host_uid, "two sandboxes share a host uid");
    // A directory of a's on the host, where b's root filesystem (the host's) reaches it: a
    // 0755 directory and a 0644 file owned by a's root, as a's own files are.
    let dir = tempfile::Builder::new()
        .prefix("sbx-owned-")
        .tempdir_in("/tmp")
        .unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let owned = dir.path().join("owned");
    std::fs::create_dir(&owned).unwrap();
    std::fs::write(owned.join("file"), "a's\n").unwrap();
    for p in [owned.clone(), owned.join("file")] {
        std::os::unix::fs::chown(&p, Some(ua.host_uid), Some(ua.host_gid)).unwrap();
    }
    let target = owned.display();
    // a, its owner, can write there; b cannot add, change or remove a thing.
    let (out, err, code) = sh(
        &driver,
        a,
        &format!("echo more >> {target}/file && echo ok"),
    )
    .await;
    assert_eq!((code, out.trim()), (0, "ok"), "{err}");
    for (what, cmd) in [
        ("a new file", format!("echo x > {target}/new")),
        ("an append", format!("echo x >> {target}/file")),
        ("a removal", format!("rm -f {target}/file")),
        ("a chmod", format!("chmod 777 {target}/file")),
    ] {
        let (out, err, code) = sh(&driver, b, &cmd).await;
        assert_ne!(
            code, 0,
            "{what} in another sandbox's directory was allowed: {out} {err}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(owned.join("file")).unwrap(),
        "a's\nmore\n"
    );
    assert!(!owned.join("new").exists());
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn open_refuses_an_id_map_from_host_root() {
    let env = TestEnv::new();
    let opts = ProcessDriverOptions {
        id_map: sbx_images::IdMap {
            host_uid: 0,
            host_gid: 0,
            size: 65_536,
        },
        ..env.options()
    };
    let err = ProcessDriver::open(env.state_dir.path().to_path_buf(), opts).unwrap_err();
    assert!(err.to_string().contains("host root"), "{err}");
    env.finish().await;
}
