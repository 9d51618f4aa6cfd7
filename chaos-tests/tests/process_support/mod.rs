//! Real processes for the process-level chaos test: the `sbxd` binary (built beforehand by
//! `cargo build -p sbx-gateway --bin sbxd`, found next to this test's executable), its managed
//! driver's pid file, the process driver's workload pids, cgroups and mounts. Everything this
//! module starts is killed by pid; nothing is found by name.

pub mod checks;
pub mod client;
pub mod disk;
pub mod faults;
pub mod store_damage;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_drivers::process::ProcessDriver;
use sbx_proto::v1::{Phase, Sandbox};

/// How long sbxd may take to write its address file (it re-attaches every sandbox first).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The sbxd binary of the same profile as this test (target/PROFILE/sbxd), or an error that
/// says how to build it. The test never builds anything itself.
pub fn sbxd_binary() -> Result<PathBuf, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    // target/PROFILE/deps/chaos_processes-HASH → target/PROFILE/sbxd
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| format!("no profile dir above {}", exe.display()))?;
    let sbxd = profile_dir.join("sbxd");
    if sbxd.is_file() {
        Ok(sbxd)
    } else {
        Err(format!(
            "{} is missing: build it first with `cargo build -p sbx-gateway --bin sbxd`",
            sbxd.display()
        ))
    }
}

/// One running `sbxd serve --driver managed:process`. SIGKILLed by pid when dropped.
pub struct Daemon {
    child: Child,
    /// host:port it serves on (port 0 → a fresh port on every start).
    pub addr: String,
    pub log: PathBuf,
}

impl Daemon {
    /// Starts sbxd over `data` and waits (bounded) until it serves.
    pub fn start(sbxd: &Path, data: &Path, cgroup_parent: &str, n: u64) -> Result<Daemon, String> {
        let addr_file = data.join("addr");
        let _ = std::fs::remove_file(&addr_file);
        let log = data.join(format!("sbxd-{n}.log"));
        let log_file = std::fs::File::create(&log).map_err(|e| format!("log file: {e}"))?;
        let mut child = Command::new(sbxd)
            .arg("serve")
            .args(["--listen", "127.0.0.1:0", "--driver", "managed:process"])
            .arg("--data-dir")
            .arg(data)
            .arg("--addr-file")
            .arg(&addr_file)
            .args(["--process-cgroup-parent", cgroup_parent])
            .args(["--reconcile-interval", "1", "--driver-call-timeout", "3"])
            // Plain TCP on loopback, as the chaos clients dial it.
            .args(["--auth", "none"])
            // No sandbox network: none is needed, and the host's gateways share a name's.
            .args(["--network-cidr", "off"])
            // The sandbox actors' plans (each observation and the step it chose) explain a
            // violation after the fact: `history` quotes them.
            .env("SBX_LOG", "info,sbx_actors::sandbox=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .map_err(|e| format!("spawn {}: {e}", sbxd.display()))?;
        let began = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&addr_file)
                && text.ends_with('\n')
            {
                return Ok(Daemon {
                    child,
                    addr: text.trim().to_string(),
                    log,
                });
            }
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!(
                    "sbxd exited with {status} before serving; log {}",
                    log.display()
                ));
            }
            if began.elapsed() > START_TIMEOUT {
                let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
                let _ = child.wait();
                return Err(format!(
                    "sbxd did not serve within {START_TIMEOUT:?}; log {}",
                    log.display()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGKILL, and reap.
    pub fn sigkill(&mut self) {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM and wait at most `limit`; answers whether it exited.
    pub fn sigterm(&mut self, limit: Duration) -> bool {
        let _ = kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM);
        let began = Instant::now();
        while began.elapsed() < limit {
            if let Ok(Some(_)) = self.child.try_wait() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.sigkill();
        }
    }
}

/// (pid, start ticks) of the managed driver, from DATA/drivers/process.pid.
pub fn managed_driver(data: &Path) -> Option<(i32, u64)> {
    let text = std::fs::read_to_string(data.join("drivers/process.pid")).ok()?;
    let mut fields = text.split_whitespace();
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// (pid, start time) of a `/proc/PID/stat` line (start time is field 22).
fn parse_stat(line: &str) -> Option<(i32, u64)> {
    let pid = line.split_whitespace().next()?.parse().ok()?;
    let after_comm = &line[line.rfind(')')? + 2..];
    let start = after_comm.split_whitespace().nth(19)?.parse().ok()?;
    Some((pid, start))
}

/// Whether the process (pid, start ticks) runs (a zombie counts as gone).
pub fn runs(pid: i32, start: u64) -> bool {
    let Ok(line) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let zombie = line
        .rfind(')')
        .and_then(|i| line[i + 1..].split_whitespace().next())
        .is_some_and(|s| s == "Z" || s == "X");
    !zombie && parse_stat(&line).is_some_and(|(_, s)| s == start)
}

/// The live workload init pids of sandbox `id`: DATA/drivers/process/sandboxes/ID/run-*/init
/// holds the init's `/proc/self/stat` line (host pid and start time).
pub fn workload_pids(data: &Path, id: &str) -> Vec<i32> {
    let dir = data.join("drivers/process/sandboxes").join(id);
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut pids = Vec::new();
    for entry in entries.flatten() {
        if !entry.file_name().to_string_lossy().starts_with("run-") {
            continue;
        }
        let Ok(line) = std::fs::read_to_string(entry.path().join("init")) else {
            continue;
        };
        if let Some((pid, start)) = parse_stat(&line)
            && runs(pid, start)
        {
            pids.push(pid);
        }
    }
    pids
}

/// What a violation about sandbox `id` needs explained, for its message: the process
/// driver's record of it (generation, desired state, run) and its run directories, then the
/// last [`HISTORY_LINES`] lines of every sbxd start's log and of the driver's log that name it.
pub fn history(data: &Path, id: &str) -> String {
    let dir = data.join("drivers/process/sandboxes").join(id);
    let mut out = String::new();
    match std::fs::read_to_string(dir.join("sandbox.json")) {
        Ok(text) => {
            let fields: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| {
                    [
                        "\"generation\"",
                        "\"desired\"",
                        "\"run_id\"",
                        "\"launched_at_ms\"",
                    ]
                    .iter()
                    .any(|k| l.starts_with(k))
                })
                .collect();
            out.push_str(&format!("driver record: {}\n", fields.join(" ")));
        }
        Err(e) => out.push_str(&format!("driver record: {e}\n")),
    }
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with("run-") {
                let init = std::fs::read_to_string(entry.path().join("init")).unwrap_or_default();
                let pid = parse_stat(&init).map(|(pid, start)| (pid, runs(pid, start)));
                out.push_str(&format!("{name}: init (pid, alive) {pid:?}\n"));
            }
        }
    }
    let mut logs: Vec<PathBuf> = std::fs::read_dir(data)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    logs.sort();
    logs.push(data.join("drivers/process.log"));
    for log in logs {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(id)).collect();
        let from = lines.len().saturating_sub(HISTORY_LINES);
        out.push_str(&format!(
            "{} ({} lines name it):\n",
            log.file_name().unwrap_or_default().to_string_lossy(),
            lines.len()
        ));
        for line in &lines[from..] {
            out.push_str("  ");
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// How many of the last log lines naming a sandbox [`history`] quotes, per log.
const HISTORY_LINES: usize = 25;

/// Each Ready sandbox of `settled` with its live workload pids.
pub fn ready_workloads(data: &Path, settled: &[Sandbox]) -> Vec<(String, Vec<i32>)> {
    settled
        .iter()
        .filter(|s| s.phase() == Phase::Ready)
        .map(|s| (s.id.clone(), workload_pids(data, &s.id)))
        .collect()
}

/// Every sandbox of `before` ([`ready_workloads`]) is Ready in `after` on the very same
/// workload processes, after `what` (for the message); answers the checks made.
pub fn same_workloads_ready(
    data: &Path,
    before: &[(String, Vec<i32>)],
    after: &[Sandbox],
    what: &str,
) -> Result<u64, String> {
    for (id, pids) in before {
        let now = workload_pids(data, id);
        let ready = after
            .iter()
            .any(|s| &s.id == id && s.phase() == Phase::Ready);
        if !ready || &now != pids {
            return Err(format!(
                "after {what}, {id} (workloads {pids:?}) is ready: {ready}, workloads {now:?}\n{}",
                history(data, id)
            ));
        }
    }
    Ok(before.len() as u64)
}

/// Every sandbox id with driver state under DATA, with its live workload pids.
pub fn workloads_by_sandbox(data: &Path) -> Vec<(String, Vec<i32>)> {
    let Ok(entries) = std::fs::read_dir(data.join("drivers/process/sandboxes")) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<i32>)> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .map(|id| {
            let pids = workload_pids(data, &id);
            (id, pids)
        })
        .collect();
    out.sort();
    out
}

/// The cgroup directories left under `cgroup_parent`, in every hierarchy.
pub fn cgroups_under(cgroup_parent: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for parent in ProcessDriver::cgroup_parent_dirs_for(cgroup_parent) {
        if let Ok(entries) = std::fs::read_dir(&parent) {
            found.extend(
                entries
                    .flatten()
                    .filter(|e| e.path().is_dir())
                    .map(|e| e.path()),
            );
        }
    }
    found.sort();
    found
}

/// Lines of /proc/self/mountinfo whose mount point lies under `dir`.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .nth(4)
                .is_some_and(|m| m.starts_with(&format!("{prefix}/")))
        })
        .map(str::to_string)
        .collect()
}

/// The safety net of a failed run, on drop: SIGKILLs the managed driver (if the recorded
/// process still runs) and every workload left in the data dir, then removes the (then empty)
/// cgroups under the run's own parent and the parent itself.
pub struct Cleanup {
    pub data: PathBuf,
    pub cgroup_parent: String,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some((pid, start)) = managed_driver(&self.data)
            && runs(pid, start)
        {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        for (_, pids) in workloads_by_sandbox(&self.data) {
            for pid in pids {
                eprintln!("killing leaked workload {pid}");
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
        }
        // Killed processes leave their cgroups a moment later; a few bounded tries.
        for _ in 0..50 {
            for dir in cgroups_under(&self.cgroup_parent) {
                let _ = std::fs::remove_dir(dir);
            }
            if cgroups_under(&self.cgroup_parent).is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        for parent in ProcessDriver::cgroup_parent_dirs_for(&self.cgroup_parent) {
            let _ = std::fs::remove_dir(parent);
        }
    }
}
