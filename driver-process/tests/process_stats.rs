//! `stats` of process sandboxes on the real kernel (needs root): CPU time and the process
//! count come from the sandbox's own cgroups, also where the host mounts cgroup v1's `cpuacct`
//! and `pids` apart from `cpu` and `memory`; and a sandbox recorded before the driver joined
//! those still starts, reports and is deleted.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_driver_process::{ProcessDriver, ProcessDriverOptions};
use uuid::Uuid;

/// One test's world: its own state directory and cgroup parent. Dropped without `finish`
/// (a failed test), it kills what is left in its cgroups and removes them.
struct TestEnv {
    state_dir: tempfile::TempDir,
    cgroup_parent: String,
    finished: bool,
}

impl TestEnv {
    fn new() -> TestEnv {
        TestEnv {
            state_dir: tempfile::Builder::new()
                .prefix("sbx-process-stats-test-")
                .tempdir()
                .unwrap(),
            cgroup_parent: format!("sbx-test-{}", Uuid::new_v4().simple()),
            finished: false,
        }
    }

    /// Opens a driver on the state dir; a driver just dropped may hold its lock a moment.
    fn open(&self) -> ProcessDriver {
        let options = ProcessDriverOptions {
            cgroup_parent: self.cgroup_parent.clone(),
            default_grace: Duration::from_secs(2),
            poll_interval: Duration::from_millis(50),
            launch_timeout: Duration::from_secs(10),
            ..ProcessDriverOptions::default()
        };
        let began = Instant::now();
        loop {
            match ProcessDriver::open(self.state_dir.path().to_path_buf(), options.clone()) {
                Err(DriverError::Unavailable(why))
                    if why.contains("another driver instance holds")
                        && began.elapsed() < Duration::from_secs(5) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                opened => return opened.unwrap(),
            }
        }
    }

    /// Asserts that no sandbox cgroup is left under the test's parent in any hierarchy the
    /// driver uses, and removes the parents.
    fn finish(mut self) {
        for parent in ProcessDriver::cgroup_parent_dirs_for(&self.cgroup_parent) {
            if !parent.exists() {
                continue;
            }
            let children: Vec<PathBuf> = std::fs::read_dir(&parent)
                .unwrap()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect();
            assert!(
                children.is_empty(),
                "cgroups left under {}: {children:?}",
                parent.display()
            );
            std::fs::remove_dir(&parent).unwrap();
        }
        self.finished = true;
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        for parent in ProcessDriver::cgroup_parent_dirs_for(&self.cgroup_parent) {
            let Ok(children) = std::fs::read_dir(&parent) else {
                continue;
            };
            for child in children.flatten().filter(|c| c.path().is_dir()) {
                for _ in 0..100 {
                    let procs = std::fs::read_to_string(child.path().join("cgroup.procs"))
                        .unwrap_or_default();
                    for pid in procs.split_whitespace().filter_map(|p| p.parse().ok()) {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                    }
                    if std::fs::remove_dir(child.path()).is_ok() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let _ = std::fs::remove_dir(&parent);
        }
    }
}

/// The mount points of this host's v1 hierarchies carrying `controller` on their own, i.e.
/// not co-mounted with `cpu` or `memory` (read from mountinfo, apart from the driver).
fn separate_v1_mounts(controller: &str) -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mountinfo
        .lines()
        .filter_map(|l| {
            let (before, after) = l.split_once(" - cgroup ")?;
            let options: Vec<&str> = after.rsplit(' ').next()?.split(',').collect();
            let alone = options.contains(&controller)
                && !options.contains(&"cpu")
                && !options.contains(&"memory");
            let mount_point = before.split(' ').nth(4)?;
            alone.then(|| PathBuf::from(mount_point))
        })
        .collect()
}

/// The driver's parent directory in the hierarchy mounted at `mount`.
fn parent_in(driver: &ProcessDriver, mount: &Path) -> PathBuf {
    driver
        .cgroup_parent_dirs()
        .into_iter()
        .find(|p| p.starts_with(mount))
        .unwrap_or_else(|| panic!("the driver makes no cgroup under {}", mount.display()))
}

fn create_req(id: Uuid, command: &[&str], stopped: bool) -> pb::CreateRequest {
    pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: "ws".to_string(),
        name: "stats".to_string(),
        spec: Some(pb::SandboxSpec {
            command: command.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }),
        generation: 1,
        stopped,
    }
}

async fn stats(driver: &ProcessDriver, id: Uuid) -> pb::SandboxUsage {
    driver
        .stats(pb::StatsRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap()
}

async fn delete(driver: &ProcessDriver, id: Uuid) {
    let deleted = driver
        .delete(pb::DeleteRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap();
    assert!(deleted.deleted, "{id}");
}

/// A busy loop's CPU time and its processes show in `stats` (on this host they are counted in
/// the v1 cpuacct and pids hierarchies, mounted apart from cpu and memory); delete leaves no
/// cgroup behind in any hierarchy.
#[tokio::test]
async fn stats_count_a_busy_loops_cpu_time_and_pids() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    let leaf = format!("sbx-{id}");
    let created = driver
        .create(create_req(id, &["sh", "-c", "while :; do :; done"], false))
        .await
        .unwrap();
    assert_eq!(created.state, pb::State::Running as i32, "{created:?}");
    assert!(created.warnings.is_empty(), "{:?}", created.warnings);

    // Where cpuacct and pids are hierarchies of their own, the workload is in a cgroup of
    // each, named as its cpu and memory ones.
    let accounting: Vec<PathBuf> = ["cpuacct", "pids"]
        .iter()
        .flat_map(|c| separate_v1_mounts(c))
        .map(|mount| parent_in(&driver, &mount).join(&leaf))
        .collect();
    let init = driver.workload_identity(id).expect("running");
    for dir in &accounting {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap();
        assert!(
            procs.split_whitespace().any(|p| p == init.pid.to_string()),
            "init {} not in {}: {procs}",
            init.pid,
            dir.display()
        );
    }

    let first = stats(&driver, id).await;
    let began = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let second = stats(&driver, id).await;
    let wall = began.elapsed().as_secs_f64();
    let cores = second.cpu_nanos.saturating_sub(first.cpu_nanos) as f64 / 1e9 / wall;
    eprintln!(
        "busy loop: {cores:.3} cpu s/s over {wall:.3} s (cpu_nanos {} -> {}), pids {}",
        first.cpu_nanos, second.cpu_nanos, second.pids
    );
    assert!(second.running, "{second:?}");
    assert!(
        cores >= 0.3,
        "{cores:.3} cpu s/s: {first:?} then {second:?}"
    );
    assert!(second.pids >= 1, "{second:?}");
    assert!(second.memory_bytes > 0, "{second:?}");

    delete(&driver, id).await;
    for dir in &accounting {
        assert!(!dir.exists(), "{} left after delete", dir.display());
    }
    drop(driver);
    env.finish();
}

/// A sandbox recorded before the driver joined cpuacct and pids (its record lists only its
/// cpu and memory cgroups, and it has no other) starts, answers `stats` and is deleted as
/// before: the cgroups it lacks fail nothing and are never made.
#[tokio::test]
async fn a_sandbox_recorded_with_cpu_and_memory_cgroups_only_still_works() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    let leaf = format!("sbx-{id}");
    driver
        .create(create_req(id, &["sleep", "1000"], true))
        .await
        .unwrap();
    let older: Vec<PathBuf> = ["cpuacct", "pids"]
        .iter()
        .flat_map(|c| separate_v1_mounts(c))
        .map(|mount| parent_in(&driver, &mount).join(&leaf))
        .collect();
    drop(driver);

    // Rewrite the record as the driver wrote it before: no cpuacct or pids dirs.
    let file = env
        .state_dir
        .path()
        .join("sandboxes")
        .join(id.to_string())
        .join("sandbox.json");
    let mut record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let dirs = record["cgroups"]["dirs"].as_array_mut().unwrap();
    let before = dirs.len();
    dirs.retain(|d| !older.iter().any(|o| Path::new(d.as_str().unwrap()) == o));
    assert_eq!(dirs.len() + older.len(), before, "{record}");
    std::fs::write(&file, serde_json::to_vec_pretty(&record).unwrap()).unwrap();
    for dir in &older {
        std::fs::remove_dir(dir).unwrap();
    }

    let driver = env.open();
    let started = driver
        .start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: id.to_string(),
            generation: 2,
        })
        .await
        .unwrap();
    assert_eq!(started.state, pb::State::Running as i32, "{started:?}");
    let usage = stats(&driver, id).await;
    assert!(usage.running, "{usage:?}");
    assert!(usage.memory_bytes > 0, "{usage:?}");
    for dir in &older {
        assert!(!dir.exists(), "{} made for an older record", dir.display());
    }
    let stopped = driver
        .stop(pb::StopRequest {
            sandbox_id: id.to_string(),
            grace_period_ms: 500,
        })
        .await
        .unwrap();
    assert_eq!(stopped.state, pb::State::Stopped as i32, "{stopped:?}");
    delete(&driver, id).await;
    drop(driver);
    env.finish();
}
