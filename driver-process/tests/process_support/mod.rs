//! Shared by the process driver's integration tests: a temp state dir and a cgroup parent of
//! its own per test, short timeouts, bounded waits, and the leak check every test ends with
//! (no cgroup, process or mount of the test left behind).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use sbx_driver_api::pb;
use sbx_driver_api::{ComputeDriver, DriverError};
use sbx_driver_process::{ProcessDriver, ProcessDriverOptions};
use uuid::Uuid;

/// One test's world: its own state directory and cgroup parent.
pub struct TestEnv {
    pub state_dir: tempfile::TempDir,
    pub cgroup_parent: String,
    /// The driver's `log_max`, when a test sets one.
    pub log_max: Option<u64>,
    /// Set by `finish`; a test that panics before leaves the clean-up to `Drop`.
    finished: bool,
}

impl Drop for TestEnv {
    /// A failed test must not leave workloads behind for the next: kill everything in the
    /// test's cgroups and remove them (best effort; the test has failed already).
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        // No driver is opened here: the failed test may still hold one (and its lock).
        for parent in ProcessDriver::cgroup_parent_dirs_for(&self.cgroup_parent) {
            let Ok(children) = std::fs::read_dir(&parent) else {
                continue;
            };
            for child in children.flatten().filter(|c| c.path().is_dir()) {
                for _ in 0..100 {
                    let procs = std::fs::read_to_string(child.path().join("cgroup.procs"))
                        .unwrap_or_default();
                    for pid in procs
                        .split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok())
                    {
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

impl TestEnv {
    pub fn new() -> TestEnv {
        TestEnv {
            state_dir: tempfile::Builder::new()
                .prefix("sbx-process-test-")
                .tempdir()
                .unwrap(),
            cgroup_parent: format!("sbx-test-{}", Uuid::new_v4().simple()),
            log_max: None,
            finished: false,
        }
    }

    pub fn options(&self) -> ProcessDriverOptions {
        ProcessDriverOptions {
            cgroup_parent: self.cgroup_parent.clone(),
            default_grace: Duration::from_secs(2),
            poll_interval: Duration::from_millis(50),
            launch_timeout: Duration::from_secs(10),
            log_max: self
                .log_max
                .unwrap_or(ProcessDriverOptions::default().log_max),
            ..ProcessDriverOptions::default()
        }
    }

    /// Opens a driver on the state dir. A driver just dropped may still hold the state's lock
    /// for a moment: a lifecycle call it ran detached finishes first (and its caller may have
    /// stopped waiting for it), so the open is tried again for up to 5 s.
    pub fn open(&self) -> ProcessDriver {
        let began = std::time::Instant::now();
        loop {
            match ProcessDriver::open(self.state_dir.path().to_path_buf(), self.options()) {
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

    /// Deletes every sandbox the state holds (through a fresh driver), then asserts that
    /// nothing of the test is left: the cgroup parent has no children (and is removed), no
    /// process mentions the state dir in its command line or environment, and no mount lies
    /// under it.
    pub async fn finish(mut self) {
        let driver = self.open();
        let parents = driver.cgroup_parent_dirs();
        for snapshot in driver.list().await.unwrap() {
            let req = pb::DeleteRequest {
                sandbox_id: snapshot.sandbox_id.clone(),
            };
            assert!(
                driver.delete(req).await.unwrap().deleted,
                "{}",
                snapshot.sandbox_id
            );
        }
        drop(driver);
        for parent in &parents {
            if parent.exists() {
                let children: Vec<PathBuf> = std::fs::read_dir(parent)
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
                std::fs::remove_dir(parent).unwrap();
            }
        }
        let state = self.state_dir.path().to_path_buf();
        // The launcher (`unshare`) of a run ends just after its sandbox's init: allow it 3 s.
        let left = wait_until(Duration::from_secs(3), || {
            let p = processes_mentioning(&state);
            p.is_empty().then_some(()).ok_or(p)
        })
        .await;
        assert!(
            left.is_ok(),
            "processes left that mention {}: {:?}",
            state.display(),
            left.err()
        );
        let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        let needle = state.to_string_lossy().to_string();
        let mounts: Vec<&str> = mountinfo.lines().filter(|l| l.contains(&needle)).collect();
        assert!(
            mounts.is_empty(),
            "mounts left under the state dir: {mounts:?}"
        );
        self.finished = true;
    }
}

/// Polls `probe` every 20 ms until it answers `Ok`, for at most `limit`; the last `Err` else.
pub async fn wait_until<T, E>(
    limit: Duration,
    mut probe: impl FnMut() -> Result<T, E>,
) -> Result<T, E> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match probe() {
            Ok(v) => return Ok(v),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Waits (bounded) until `get` shows the sandbox in `state`; returns that snapshot.
pub async fn wait_for_state(
    driver: &ProcessDriver,
    id: Uuid,
    state: pb::State,
    limit: Duration,
) -> pb::Snapshot {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let snapshot = driver
            .get(pb::GetRequest {
                sandbox_id: id.to_string(),
            })
            .await
            .unwrap();
        if snapshot.state == state as i32 {
            return snapshot;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sandbox {id} not {state:?} within {limit:?}: {snapshot:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Pids of processes whose command line or environment mentions `path`.
pub fn processes_mentioning(path: &Path) -> Vec<(i32, String)> {
    let needle = path.to_string_lossy().as_bytes().to_vec();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        for file in ["cmdline", "environ"] {
            let Ok(bytes) = std::fs::read(entry.path().join(file)) else {
                continue;
            };
            if bytes.windows(needle.len()).any(|w| w == needle.as_slice()) {
                let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
                found.push((pid, String::from_utf8_lossy(&cmdline).replace('\0', " ")));
                break;
            }
        }
    }
    found
}

pub fn spec(command: &[&str]) -> pb::SandboxSpec {
    pb::SandboxSpec {
        command: command.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

pub fn create_req(
    id: Uuid,
    name: &str,
    spec: pb::SandboxSpec,
    generation: u64,
) -> pb::CreateRequest {
    pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: "ws".to_string(),
        name: name.to_string(),
        spec: Some(spec),
        generation,
        stopped: false,
    }
}

pub fn stop_req(id: Uuid, grace_ms: u32) -> pb::StopRequest {
    pb::StopRequest {
        sandbox_id: id.to_string(),
        grace_period_ms: grace_ms,
    }
}

pub fn start_req(id: Uuid, generation: u64) -> pb::StartRequest {
    pb::StartRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        generation,
    }
}

/// What an exec produced.
#[derive(Debug, Default)]
pub struct ExecResult {
    pub stdout: String,
    pub stderr: String,
    pub exit: Option<pb::ExecExit>,
    pub error: Option<DriverError>,
}

/// Runs `command` in the sandbox, collecting everything (bounded by 30 s).
pub async fn exec(
    driver: &ProcessDriver,
    id: Uuid,
    command: &[&str],
    timeout_seconds: u32,
) -> ExecResult {
    use futures::StreamExt;
    let req = pb::ExecRequest {
        sandbox_id: id.to_string(),
        command: command.iter().map(|s| s.to_string()).collect(),
        env: Default::default(),
        timeout_seconds,
        ..Default::default()
    };
    let mut stream = driver.exec(req).await.unwrap();
    let mut result = ExecResult::default();
    let collect = async {
        while let Some(item) = stream.next().await {
            match item {
                Ok(pb::ExecOutput { chunk: Some(chunk) }) => match chunk {
                    pb::exec_output::Chunk::Stdout(b) => {
                        result.stdout.push_str(&String::from_utf8_lossy(&b))
                    }
                    pb::exec_output::Chunk::Stderr(b) => {
                        result.stderr.push_str(&String::from_utf8_lossy(&b))
                    }
                    pb::exec_output::Chunk::Exit(e) => result.exit = Some(e),
                },
                Ok(_) => {}
                Err(e) => result.error = Some(e),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(30), collect)
        .await
        .expect("exec did not end within 30 s");
    result
}

/// Whether this host lets the driver apply memory and cpu limits, judged independently of the
/// driver: v1 `memory` and `cpu` hierarchies are mounted, or this process's v2 cgroup is the
/// machine's real root (no `cgroup.type` file; a container's namespaced root has one and, holding
/// processes, cannot delegate) or already delegates both controllers. Tests of limits take the
/// strict branch here, and elsewhere check that the driver *says* the limits were not applied.
pub fn host_can_limit_memory_and_cpu() -> bool {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let v1_has = |controller: &str| {
        mountinfo.lines().any(|l| {
            l.split_once(" - cgroup ").is_some_and(|(_, rest)| {
                rest.rsplit(' ')
                    .next()
                    .unwrap_or("")
                    .split(',')
                    .any(|o| o == controller)
            })
        })
    };
    if v1_has("memory") && v1_has("cpu") {
        return true;
    }
    let Some(mount) = mountinfo.lines().find_map(|l| {
        l.contains(" - cgroup2 ")
            .then(|| l.split(' ').nth(4).unwrap_or("").to_string())
    }) else {
        return false;
    };
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) else {
        return false;
    };
    if path == "/" && !Path::new(&mount).join("cgroup.type").exists() {
        return true;
    }
    let dir = Path::new(&mount).join(path.trim_start_matches('/'));
    let delegated = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    ["memory", "cpu"]
        .iter()
        .all(|c| delegated.split_whitespace().any(|d| d == *c))
}
