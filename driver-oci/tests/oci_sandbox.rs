//! The oci driver's boundary, tried from inside a sandbox the way an attacker would (needs
//! root, runc and a static busybox). Each test asserts something a broken boundary would
//! make pass, and ends with the leak check.

mod oci_support;

use std::os::unix::fs::MetadataExt;
use std::time::Duration;

use oci_support::{TestEnv, create, exec, wait_for};
use sbx_driver_api::{ComputeDriver, pb};
use uuid::Uuid;

#[tokio::test]
async fn root_inside_is_an_unprivileged_host_uid_behind_the_boundary() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, snapshot) = create(&driver, &env, "box", env.spec(&["sleep", "3600"])).await;
    assert_eq!(snapshot.state, pb::State::Running as i32, "{snapshot:?}");
    let sid = id.to_string();

    // Root inside; outside, the first id of a range of the sandbox's own from the uid pool
    // (not the image store's shared 200000).
    assert_eq!(exec(&driver, &sid, &["id", "-u"]).await.1.trim(), "0");
    let map = exec(&driver, &sid, &["cat", "/proc/self/uid_map"]).await.1;
    let fields: Vec<&str> = map.split_whitespace().collect();
    assert_eq!((fields[0], fields[2]), ("0", "65536"), "{map}");
    let host_uid: u32 = fields[1].parse().unwrap();
    let pool = sbx_host_kit::uidpool::UidPool::default();
    assert!(
        host_uid >= pool.start && host_uid < pool.start + pool.count,
        "{map}"
    );
    // The image's files (shared layers, owned by 200000.. on disk) are root's inside.
    let owners = exec(
        &driver,
        &sid,
        &["stat", "-c", "%u:%g", "/bin", "/etc/passwd"],
    )
    .await
    .1;
    assert_eq!(
        owners.split_whitespace().collect::<Vec<_>>(),
        ["0:0", "0:0"],
        "{owners}"
    );

    // A host file (a marker in the host's /root) and the driver's state dir are invisible.
    let marker = format!("/root/sbx-oci-marker-{}", Uuid::new_v4().simple());
    std::fs::write(&marker, "host secret").unwrap();
    let (code, out, _) = exec(&driver, &sid, &["cat", &marker]).await;
    std::fs::remove_file(&marker).unwrap();
    assert_ne!(code, 0, "the host's {marker} is readable inside: {out}");
    let state = env.state_dir().to_string_lossy().to_string();
    let (code, _, _) = exec(&driver, &sid, &["ls", &state]).await;
    assert_ne!(code, 0, "the driver's state dir {state} is visible inside");

    // A file written under /sandbox is owned by the unprivileged uid on the host.
    let (code, _, err) = exec(&driver, &sid, &["sh", "-c", "echo hi > /sandbox/mine"]).await;
    assert_eq!(code, 0, "{err}");
    let meta = std::fs::metadata(driver.volume_dir(id).join("mine")).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (host_uid, host_uid));
    // So is a file written to the root filesystem (its writable layer) and one it changed
    // from the image (copied up with the sandbox's owner, not the store's).
    let (code, _, err) = exec(
        &driver,
        &sid,
        &["sh", "-c", "echo x > /etc/new; echo y >> /etc/passwd"],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    for name in ["new", "passwd"] {
        let meta = std::fs::metadata(driver.upper_dir(id).join("etc").join(name)).unwrap();
        assert_eq!(
            (meta.uid(), meta.gid()),
            (host_uid, host_uid),
            "/etc/{name}"
        );
    }

    // mount, unshare, sysrq, kcore and module loading are refused. (`h` only prints the
    // sysrq help to the kernel log, should the write ever get through.)
    for (what, cmd) in [
        ("mount", "mount -t tmpfs none /mnt"),
        ("unshare of a user namespace", "unshare -U true"),
        ("unshare of a mount namespace", "unshare -m true"),
        (
            "a write to /proc/sysrq-trigger",
            "echo h > /proc/sysrq-trigger",
        ),
        ("a read of /proc/kcore", "head -c 1 /proc/kcore > /dev/null"),
        ("a sysctl write", "echo 1 > /proc/sys/kernel/sysrq"),
        (
            "a cgroup move",
            "echo $$ > /sys/fs/cgroup/pids/cgroup.procs",
        ),
        ("a remount of /sys", "mount -o remount,rw /sys"),
    ] {
        let (code, out, err) = exec(&driver, &sid, &["sh", "-c", cmd]).await;
        assert_ne!(code, 0, "{what} was allowed inside: {out} {err}");
    }
    // No CAP_SYS_ADMIN (bit 21) in the effective set, and no_new_privs.
    let status = exec(&driver, &sid, &["cat", "/proc/self/status"]).await.1;
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| panic!("{name} not in {status}"))
    };
    let cap_eff = u64::from_str_radix(&field("CapEff:"), 16).unwrap();
    assert_eq!(cap_eff & (1 << 21), 0, "CAP_SYS_ADMIN inside: {cap_eff:x}");
    assert_ne!(cap_eff, 0, "root inside keeps the default capabilities");
    assert_eq!(field("NoNewPrivs:"), "1");
    assert_eq!(field("Seccomp:"), "2", "a seccomp filter is on");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn two_sandboxes_see_neither_files_nor_processes_of_each_other() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (a, _) = create(&driver, &env, "a", env.spec(&["sleep", "3601"])).await;
    let (b, _) = create(&driver, &env, "b", env.spec(&["sleep", "3602"])).await;
    let (a, b) = (a.to_string(), b.to_string());
    let (code, _, err) = exec(
        &driver,
        &a,
        &[
            "sh",
            "-c",
            "echo s > /sandbox/secret-a; echo s > /etc/secret-a",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let seen = exec(&driver, &b, &["sh", "-c", "ls /sandbox /etc; ps -o args"])
        .await
        .1;
    assert!(!seen.contains("secret-a"), "b sees a's files: {seen}");
    assert!(!seen.contains("3601"), "b sees a's processes: {seen}");
    assert!(seen.contains("3602"), "b sees its own processes: {seen}");
    let pids = exec(&driver, &b, &["sh", "-c", "ls -d /proc/[0-9]* | wc -l"])
        .await
        .1;
    let pids: usize = pids.trim().parse().unwrap();
    assert!(pids < 10, "b sees {pids} processes");
    // Their host uids differ: each has a range of its own.
    let outside = |id: &str| {
        let driver = &driver;
        let id = id.to_string();
        async move {
            let map = exec(driver, &id, &["cat", "/proc/self/uid_map"]).await.1;
            map.split_whitespace().nth(1).unwrap().to_string()
        }
    };
    let (ua, ub) = (outside(&a).await, outside(&b).await);
    assert_ne!(ua, ub, "two sandboxes share host uid {ua}");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn the_whole_root_filesystem_persists_across_stop_and_start() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "keep", env.spec(&["sleep", "3600"])).await;
    let sid = id.to_string();
    let (code, _, err) = exec(
        &driver,
        &sid,
        &[
            "sh",
            "-c",
            "echo kept > /etc/kept; echo vol > /sandbox/vol; rm /bin/vi",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    driver
        .stop(pb::StopRequest {
            sandbox_id: sid.clone(),
            grace_period_ms: 1000,
        })
        .await
        .unwrap();
    // Stopped: no container, no mount; the writable layer holds the change.
    assert!(oci_support::mounts_under(env.dir.path()).is_empty());
    assert_eq!(
        std::fs::read_to_string(driver.upper_dir(id).join("etc/kept")).unwrap(),
        "kept\n"
    );
    let s = driver
        .start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: sid.clone(),
            generation: 2,
        })
        .await
        .unwrap();
    assert_eq!((s.state, s.generation), (pb::State::Running as i32, 2));
    let (_, out, _) = exec(
        &driver,
        &sid,
        &[
            "sh",
            "-c",
            "cat /etc/kept /sandbox/vol; ls /bin/vi || echo gone",
        ],
    )
    .await;
    assert_eq!(out, "kept\nvol\ngone\n");
    // A new sandbox from the same image starts from the image, not from this one's changes.
    let (other, _) = create(&driver, &env, "fresh", env.spec(&["sleep", "3600"])).await;
    let (code, _, _) = exec(&driver, &other.to_string(), &["cat", "/etc/kept"]).await;
    assert_ne!(
        code, 0,
        "a fresh sandbox inherited another's root fs change"
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_fork_bomb_stays_inside_its_pids_limit() {
    let mut env = TestEnv::new();
    env.pids_limit = Some(64);
    let driver = env.open().await;
    let bomb = "b() { b | b & }; b; sleep 30";
    let (id, _) = create(&driver, &env, "bomb", env.spec(&["sh", "-c", bomb])).await;
    // While it forks, the host keeps starting processes quickly, and the sandbox's
    // processes stay at the limit.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for _ in 0..5 {
        let started = std::time::Instant::now();
        let status = std::process::Command::new("true").status().unwrap();
        assert!(status.success());
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "the host took {:?} to start a process",
            started.elapsed()
        );
    }
    let current = oci_support::pids_current(&env.cgroup_parent, id);
    assert!(
        current.is_some_and(|n| n <= 64),
        "the sandbox has {current:?} processes, over its limit of 64"
    );
    driver
        .stop(pb::StopRequest {
            sandbox_id: id.to_string(),
            grace_period_ms: 100,
        })
        .await
        .unwrap();
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_main_process_over_its_memory_limit_is_oom_killed() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let mut spec = env.spec(&["sh", "-c", "dd if=/dev/zero of=/dev/null bs=256M count=1"]);
    spec.resources = Some(pb::Resources {
        cpu_millis: 0,
        memory_bytes: 32 << 20,
        disk_bytes: 0,
    });
    let (id, _) = create(&driver, &env, "hog", spec).await;
    let s = wait_for(&driver, id, pb::State::Exited).await;
    assert_eq!(s.reason, "OOMKilled", "{s:?}");
    drop(driver);
    env.finish().await;
}
