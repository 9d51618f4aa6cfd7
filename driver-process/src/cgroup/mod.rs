//! cgroups for sandboxes: finding the host's hierarchies (v1, v2 or hybrid), making one cgroup
//! per sandbox under a configurable parent, applying cpu and memory limits, counting OOM kills,
//! killing every process in a sandbox's cgroup and removing it.
//!
//! On v1 the workload also joins a cgroup of the `cpuacct` and `pids` hierarchies where the
//! host mounts them apart from `cpu` and `memory` (a hybrid host often mounts every controller
//! on its own): those carry no limit, but `cpuacct.usage` and `pids.current` are where a
//! sandbox's CPU time and process count are read (`stats`). Where `cpuacct` is co-mounted with
//! `cpu` the cpu cgroup is that one already. v2 counts CPU time in `cpu.stat` of the one cgroup.
//!
//! The parent is made under the driver's *own* cgroup in each hierarchy (as read from
//! `/proc/self/cgroup`), so the sandboxes of a driver that runs in a delegated or limited cgroup
//! stay inside it. Where a limit cannot be applied, the caller gets a warning in words; nothing
//! here pretends a limit holds when it does not.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

mod host;

/// The cgroup interface in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The limits of a sandbox, as the spec asks them (0 means unlimited).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    pub cpu_millis: u32,
    pub memory_bytes: u64,
}

/// One directory where the driver makes its cgroups, with the controllers usable there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupBase {
    /// The driver's own cgroup in this hierarchy.
    pub dir: PathBuf,
    pub memory: bool,
    pub cpu: bool,
    /// v1: this hierarchy carries `cpuacct` (CPU time, read by `stats`). Always false on v2,
    /// whose `cpu.stat` counts it.
    pub cpuacct: bool,
    /// v1: this hierarchy carries `pids` (the process count, read by `stats`). Always false on
    /// v2, where the driver delegates no pids controller.
    pub pids: bool,
}

/// The host's cgroup setup as found when the driver opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupHost {
    pub version: Option<CgroupVersion>,
    /// v1: one base per hierarchy we use (memory, cpu, and for their figures cpuacct and
    /// pids; one for those co-mounted). v2: the one unified base.
    pub bases: Vec<CgroupBase>,
}

/// The cgroups of one sandbox, stored in its record so a restarted driver (even one opened with
/// other options) finds and removes exactly these.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxCgroups {
    pub version: Option<CgroupVersion>,
    /// Every directory the workload joins: one per v1 hierarchy, or the one v2 directory.
    /// Records made before the driver joined v1 `cpuacct` and `pids` list only the cpu and
    /// memory ones: their `stats` then read no CPU time or pids, and nothing else differs.
    pub dirs: Vec<PathBuf>,
    /// Where the memory controller (limit, OOM counter) of the sandbox lives, if anywhere.
    pub memory_dir: Option<PathBuf>,
    pub cpu_dir: Option<PathBuf>,
}

/// The CFS period the driver uses, in microseconds.
const CPU_PERIOD_US: u64 = 100_000;
/// The smallest CFS quota the kernel accepts, in microseconds.
const CPU_MIN_QUOTA_US: u64 = 1_000;

impl CgroupHost {
    pub fn has_memory(&self) -> bool {
        self.bases.iter().any(|b| b.memory)
    }

    pub fn has_cpu(&self) -> bool {
        self.bases.iter().any(|b| b.cpu)
    }

    /// The parent directories the driver makes sandbox cgroups in, one per base.
    pub fn parent_dirs(&self, parent: &str) -> Vec<PathBuf> {
        self.bases.iter().map(|b| b.dir.join(parent)).collect()
    }

    /// Describes the setup in words, for capabilities.
    pub fn describe(&self) -> String {
        let controllers = match (self.has_memory(), self.has_cpu()) {
            (true, true) => "memory, cpu",
            (true, false) => "memory only",
            (false, true) => "cpu only",
            (false, false) => "no controllers",
        };
        match self.version {
            Some(CgroupVersion::V1) => format!("cgroup v1 ({controllers})"),
            Some(CgroupVersion::V2) => format!("cgroup v2 ({controllers})"),
            None => "no cgroup".to_string(),
        }
    }

    /// Makes the cgroup(s) of sandbox `id` under `parent` and applies `limits`. Returns what
    /// was made and a warning for everything that could not be done.
    pub fn create_sandbox(
        &self,
        parent: &str,
        id: Uuid,
        limits: Limits,
    ) -> (SandboxCgroups, Vec<String>) {
        let mut warnings = Vec::new();
        let mut made = SandboxCgroups {
            version: self.version,
            ..SandboxCgroups::default()
        };
        let leaf = leaf_name(id);
        for base in &self.bases {
            let parent_dir = base.dir.join(parent);
            if let Err(e) = fs::create_dir_all(&parent_dir) {
                warnings.push(format!(
                    "cgroup parent {} not made: {e}",
                    parent_dir.display()
                ));
                continue;
            }
            let mut memory = base.memory;
            let mut cpu = base.cpu;
            if self.version == Some(CgroupVersion::V2) {
                memory =
                    memory && enable_v2_controller(&base.dir, &parent_dir, "memory", &mut warnings);
                cpu = cpu && enable_v2_controller(&base.dir, &parent_dir, "cpu", &mut warnings);
            }
            let dir = parent_dir.join(&leaf);
            if let Err(e) = fs::create_dir(&dir)
                && e.kind() != io::ErrorKind::AlreadyExists
            {
                warnings.push(format!("cgroup {} not made: {e}", dir.display()));
                continue;
            }
            if memory && made.memory_dir.is_none() {
                made.memory_dir = Some(dir.clone());
            }
            if cpu && made.cpu_dir.is_none() {
                made.cpu_dir = Some(dir.clone());
            }
            made.dirs.push(dir);
        }
        if made.dirs.is_empty() {
            made.version = None;
        }
        made.apply_limits(limits, &mut warnings);
        (made, warnings)
    }
}

impl SandboxCgroups {
    fn apply_limits(&self, limits: Limits, warnings: &mut Vec<String>) {
        if limits.memory_bytes > 0 {
            match (&self.memory_dir, self.version) {
                (Some(dir), Some(CgroupVersion::V1)) => {
                    let bytes = limits.memory_bytes.to_string();
                    if let Err(e) = write(dir, "memory.limit_in_bytes", &bytes) {
                        warnings.push(format!("memory limit not applied: {e}"));
                    } else if dir.join("memory.memsw.limit_in_bytes").exists() {
                        // Without this the workload could swap past its limit; where swap
                        // accounting is off the file is absent and there is no swap to escape to.
                        if let Err(e) = write(dir, "memory.memsw.limit_in_bytes", &bytes) {
                            warnings.push(format!("memory+swap limit not applied: {e}"));
                        }
                    }
                }
                (Some(dir), Some(CgroupVersion::V2)) => {
                    if let Err(e) = write(dir, "memory.max", &limits.memory_bytes.to_string()) {
                        warnings.push(format!("memory limit not applied: {e}"));
                    } else if dir.join("memory.swap.max").exists()
                        && let Err(e) = write(dir, "memory.swap.max", "0")
                    {
                        warnings.push(format!("swap limit not applied: {e}"));
                    }
                }
                _ => warnings.push("memory limit not applied: no memory cgroup controller".into()),
            }
        }
        if limits.cpu_millis > 0 {
            let mut quota = u64::from(limits.cpu_millis) * CPU_PERIOD_US / 1000;
            if quota < CPU_MIN_QUOTA_US {
                warnings.push(format!(
                    "cpu limit raised from {} to {} millicpu, the smallest quota the kernel takes",
                    limits.cpu_millis,
                    CPU_MIN_QUOTA_US * 1000 / CPU_PERIOD_US
                ));
                quota = CPU_MIN_QUOTA_US;
            }
            let result = match (&self.cpu_dir, self.version) {
                (Some(dir), Some(CgroupVersion::V1)) => {
                    write(dir, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())
                        .and_then(|()| write(dir, "cpu.cfs_quota_us", &quota.to_string()))
                }
                (Some(dir), Some(CgroupVersion::V2)) => {
                    write(dir, "cpu.max", &format!("{quota} {CPU_PERIOD_US}"))
                }
                _ => Err(io::Error::other("no cpu cgroup controller")),
            };
            if let Err(e) = result {
                warnings.push(format!("cpu limit not applied: {e}"));
            }
        }
    }

    /// How many times the kernel's OOM killer has killed a process of this cgroup (0 when
    /// there is no memory controller or the kernel does not count).
    pub fn oom_kills(&self) -> u64 {
        let Some(dir) = &self.memory_dir else {
            return 0;
        };
        let file = match self.version {
            Some(CgroupVersion::V2) => "memory.events",
            _ => "memory.oom_control",
        };
        fs::read_to_string(dir.join(file))
            .map(|t| parse_oom_kills(&t))
            .unwrap_or(0)
    }

    /// The pids (as the driver sees them) of every process in the sandbox's cgroups.
    pub fn pids(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .dirs
            .iter()
            .filter_map(|d| fs::read_to_string(d.join("cgroup.procs")).ok())
            .flat_map(|t| {
                t.split_ascii_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect::<Vec<_>>()
            })
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Sends SIGKILL to every process in the sandbox's cgroups. Returns how many were signalled.
    pub fn kill_all(&self) -> usize {
        let pids = self.pids();
        for pid in &pids {
            // A process that exits meanwhile answers ESRCH, which is what we want anyway.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        pids.len()
    }

    /// Removes the sandbox's cgroup directories; fails (and can be retried) while a process
    /// is still in one of them.
    pub fn remove(&self) -> io::Result<()> {
        for dir in &self.dirs {
            match fs::remove_dir(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
            }
        }
        Ok(())
    }
}

/// The name of sandbox `id`'s cgroup under the parent.
pub fn leaf_name(id: Uuid) -> String {
    format!("sbx-{id}")
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    fs::write(dir.join(file), value)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", dir.join(file).display())))
}

/// Makes `controller` available to children of `parent_dir` (v2): enabled in the base's and
/// then the parent's `cgroup.subtree_control`. The base may refuse (a non-root cgroup that holds
/// processes cannot delegate controllers); the warning says so.
fn enable_v2_controller(
    base: &Path,
    parent_dir: &Path,
    controller: &str,
    warnings: &mut Vec<String>,
) -> bool {
    for dir in [base, parent_dir] {
        let enabled = fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
        if enabled.split_ascii_whitespace().any(|c| c == controller) {
            continue;
        }
        if let Err(e) = write(dir, "cgroup.subtree_control", &format!("+{controller}")) {
            warnings.push(format!("{controller} controller not delegated: {e}"));
            return false;
        }
    }
    true
}

/// Reads the `oom_kill N` line of `memory.oom_control` (v1) or `memory.events` (v2).
pub fn parse_oom_kills(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.strip_prefix("oom_kill "))
        .find_map(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn oom_kill_counters() {
        assert_eq!(
            parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(
            parse_oom_kills("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n"),
            2
        );
        assert_eq!(parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n"), 0);
    }

    #[test]
    fn missing_controllers_give_warnings_not_silence() {
        let host = CgroupHost {
            version: None,
            bases: vec![],
        };
        let (made, warnings) = host.create_sandbox(
            "p",
            Uuid::new_v4(),
            Limits {
                cpu_millis: 500,
                memory_bytes: 1 << 26,
            },
        );
        assert!(made.dirs.is_empty());
        assert!(
            warnings
                .iter()
                .any(|w| w.starts_with("memory limit not applied")),
            "{warnings:?}"
        );
        assert!(
            warnings
                .iter()
                .any(|w| w.starts_with("cpu limit not applied")),
            "{warnings:?}"
        );
    }

    /// A record from before the driver joined v1 cpuacct and pids lists only its cpu and
    /// memory dirs; one whose dirs are gone altogether (removed by hand, a reboot) must fail
    /// nothing either: no pids, nothing to kill, a remove that succeeds, zero figures.
    #[test]
    fn missing_dirs_fail_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let gone = SandboxCgroups {
            version: Some(CgroupVersion::V1),
            dirs: vec![tmp.path().join("cpu/p/x"), tmp.path().join("memory/p/x")],
            memory_dir: Some(tmp.path().join("memory/p/x")),
            cpu_dir: Some(tmp.path().join("cpu/p/x")),
        };
        assert!(gone.pids().is_empty());
        assert_eq!(gone.kill_all(), 0);
        assert_eq!(gone.oom_kills(), 0);
        gone.remove().unwrap();
        assert_eq!(
            sbx_host_kit::usage::cgroup_usage(&gone.dirs),
            sbx_host_kit::usage::CgroupUsage::default()
        );
    }

    /// The v1 code path on this machine's real mounts (skipped elsewhere): the sandbox gets a
    /// cgroup in every hierarchy found, cpuacct and pids included where they are mounted on
    /// their own, so a busy process put in all of them shows its CPU time and count in the
    /// figures `stats` reads; kill and remove leave no directory behind.
    #[test]
    fn v1_hierarchies_on_the_real_mounts_count_cpu_time_and_pids() {
        let host = CgroupHost::detect();
        if host.version != Some(CgroupVersion::V1) {
            eprintln!("no cgroup v1 here: {host:?}");
            return;
        }
        let parent = format!("sbx-v1-unit-{}", Uuid::new_v4().simple());
        let id = Uuid::new_v4();
        let (made, warnings) = host.create_sandbox(&parent, id, Limits::default());
        assert!(warnings.is_empty(), "{warnings:?}");
        let expected: Vec<PathBuf> = host
            .parent_dirs(&parent)
            .iter()
            .map(|p| p.join(leaf_name(id)))
            .collect();
        assert_eq!(made.dirs, expected);
        let has_file = |file: &str| made.dirs.iter().any(|d| d.join(file).exists());
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let mounted = |c: &str| {
            mountinfo.lines().any(|l| {
                l.split_once(" - cgroup ").is_some_and(|(_, r)| {
                    r.rsplit(' ')
                        .next()
                        .unwrap_or("")
                        .split(',')
                        .any(|o| o == c)
                })
            })
        };
        assert_eq!(has_file("cpuacct.usage"), mounted("cpuacct"), "{made:?}");
        assert_eq!(has_file("pids.current"), mounted("pids"), "{made:?}");

        let mut busy = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        for dir in &made.dirs {
            fs::write(dir.join("cgroup.procs"), busy.id().to_string()).unwrap();
        }
        std::thread::sleep(std::time::Duration::from_millis(500));
        let usage = sbx_host_kit::usage::cgroup_usage(&made.dirs);
        assert_eq!(made.pids(), vec![busy.id() as i32]);
        assert_eq!(made.kill_all(), 1);
        busy.wait().unwrap();
        if mounted("cpuacct") {
            assert!(usage.cpu_nanos >= 100_000_000, "{usage:?}");
        }
        if mounted("pids") {
            assert_eq!(usage.pids, 1, "{usage:?}");
        }
        made.remove().unwrap();
        for (dir, parent_dir) in made.dirs.iter().zip(host.parent_dirs(&parent)) {
            assert!(!dir.exists(), "{} left", dir.display());
            fs::remove_dir(parent_dir).unwrap();
        }
    }

    /// The v2 code path on this machine's real cgroup2 mount (on a hybrid host it carries no
    /// memory or cpu controller, so the limits must come back as warnings): a sandbox cgroup is
    /// made, a process put in it is seen, killed, and the cgroup removed.
    #[test]
    fn v2_hierarchy_on_the_real_mount() {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap();
        let v2_only: Vec<&str> = mountinfo
            .lines()
            .filter(|l| l.contains(" - cgroup2 "))
            .collect();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap();
        let host = CgroupHost::from_tables(&v2_only.join("\n"), &own, |d| {
            fs::read_to_string(d.join("cgroup.controllers")).ok()
        });
        assert_eq!(
            host.version,
            Some(CgroupVersion::V2),
            "no cgroup2 mount: {mountinfo}"
        );
        let parent = format!("sbx-v2-unit-{}", Uuid::new_v4().simple());
        let limits = Limits {
            cpu_millis: 500,
            memory_bytes: 64 << 20,
        };
        let (made, warnings) = host.create_sandbox(&parent, Uuid::new_v4(), limits);
        assert_eq!(made.dirs.len(), 1, "{warnings:?}");
        let dir = made.dirs[0].clone();
        match &made.memory_dir {
            Some(m) => assert_eq!(
                fs::read_to_string(m.join("memory.max")).unwrap().trim(),
                "67108864"
            ),
            None => assert!(
                warnings
                    .iter()
                    .any(|w| w.contains("memory limit not applied")),
                "{warnings:?}"
            ),
        }
        match &made.cpu_dir {
            Some(c) => assert_eq!(
                fs::read_to_string(c.join("cpu.max")).unwrap().trim(),
                "50000 100000"
            ),
            None => assert!(
                warnings.iter().any(|w| w.contains("cpu limit not applied")),
                "{warnings:?}"
            ),
        }
        let mut sleeper = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        fs::write(dir.join("cgroup.procs"), sleeper.id().to_string()).unwrap();
        assert_eq!(made.pids(), vec![sleeper.id() as i32]);
        assert!(
            made.remove().is_err(),
            "a cgroup with a process in it was removed"
        );
        assert_eq!(made.kill_all(), 1);
        let status = sleeper.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::signal(&status),
            Some(9)
        );
        made.remove().unwrap();
        assert!(!dir.exists());
        fs::remove_dir(dir.parent().unwrap()).unwrap();
    }
}
