//! cgroups for sandboxes: finding the host's hierarchies (v1, v2 or hybrid), making one cgroup
//! per sandbox under a configurable parent, applying cpu and memory limits, counting OOM kills,
//! killing every process in a sandbox's cgroup and removing it.
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
}

/// The host's cgroup setup as found when the driver opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupHost {
    pub version: Option<CgroupVersion>,
    /// v1: one base per hierarchy we use (memory, cpu; one if they are co-mounted).
    /// v2: the one unified base.
    pub bases: Vec<CgroupBase>,
}

/// The cgroups of one sandbox, stored in its record so a restarted driver (even one opened with
/// other options) finds and removes exactly these.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxCgroups {
    pub version: Option<CgroupVersion>,
    /// Every directory the workload joins: one per v1 hierarchy, or the one v2 directory.
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
    /// Reads the host's setup from `/proc/self/mountinfo` and `/proc/self/cgroup`.
    pub fn detect() -> CgroupHost {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Self::from_tables(&mountinfo, &own, |dir| {
            fs::read_to_string(dir.join("cgroup.controllers")).ok()
        })
    }

    /// The pure part of [`CgroupHost::detect`]: v1 hierarchies holding `memory` or `cpu` win
    /// (a hybrid host's unified mount usually has no controllers); otherwise a cgroup2 mount is
    /// used with the controllers its `cgroup.controllers` lists.
    pub fn from_tables(
        mountinfo: &str,
        own_cgroups: &str,
        read_controllers: impl Fn(&Path) -> Option<String>,
    ) -> CgroupHost {
        let mounts = parse_mountinfo(mountinfo);
        let own = parse_own_cgroups(own_cgroups);
        let mut v1_bases: Vec<CgroupBase> = Vec::new();
        for mount in mounts.iter().filter(|m| m.fstype == "cgroup") {
            let memory = mount.super_options.iter().any(|o| o == "memory");
            let cpu = mount.super_options.iter().any(|o| o == "cpu");
            if !(memory || cpu) {
                continue;
            }
            let own_path = own
                .iter()
                .find(|(controllers, _)| {
                    controllers
                        .iter()
                        .any(|c| (memory && c == "memory") || (cpu && c == "cpu"))
                })
                .map(|(_, path)| path.as_str())
                .unwrap_or("/");
            let dir = own_dir(&mount.mount_point, &mount.root, own_path);
            v1_bases.push(CgroupBase { dir, memory, cpu });
        }
        if !v1_bases.is_empty() {
            return CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: v1_bases,
            };
        }
        if let Some(mount) = mounts.iter().find(|m| m.fstype == "cgroup2") {
            let own_path = own
                .iter()
                .find(|(controllers, _)| controllers.is_empty())
                .map(|(_, path)| path.as_str())
                .unwrap_or("/");
            let dir = own_dir(&mount.mount_point, &mount.root, own_path);
            let controllers = read_controllers(&dir).unwrap_or_default();
            let has = |name: &str| controllers.split_ascii_whitespace().any(|c| c == name);
            let base = CgroupBase {
                memory: has("memory"),
                cpu: has("cpu"),
                dir,
            };
            return CgroupHost {
                version: Some(CgroupVersion::V2),
                bases: vec![base],
            };
        }
        CgroupHost {
            version: None,
            bases: Vec::new(),
        }
    }

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

/// A line of `/proc/self/mountinfo`, the fields we need.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mount {
    root: String,
    mount_point: PathBuf,
    fstype: String,
    super_options: Vec<String>,
}

fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            let fields: Vec<&str> = before.split(' ').collect();
            let mut after = after.split(' ');
            let fstype = after.next()?.to_string();
            let _source = after.next()?;
            let super_options = after
                .next()
                .unwrap_or("")
                .split(',')
                .map(str::to_string)
                .collect();
            Some(Mount {
                root: fields.get(3)?.to_string(),
                mount_point: PathBuf::from(fields.get(4)?),
                fstype,
                super_options,
            })
        })
        .collect()
}

/// `/proc/self/cgroup` as (controllers, path); v2's line has no controllers.
fn parse_own_cgroups(text: &str) -> Vec<(Vec<String>, String)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let controllers = parts.next()?;
            let path = parts.next()?.to_string();
            let controllers = controllers
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_string)
                .collect();
            Some((controllers, path))
        })
        .collect()
}

/// The directory of cgroup `own_path` in a hierarchy mounted at `mount_point` whose mount shows
/// the hierarchy from `root` on.
fn own_dir(mount_point: &Path, root: &str, own_path: &str) -> PathBuf {
    let relative = if root == "/" {
        Some(own_path)
    } else {
        own_path
            .strip_prefix(root)
            .filter(|r| r.is_empty() || r.starts_with('/'))
    };
    match relative.map(|r| r.trim_start_matches('/')) {
        Some(r) if !r.is_empty() => mount_point.join(r),
        _ => mount_point.to_path_buf(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID_MOUNTS: &str = "\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
31 30 0:27 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu
32 30 0:28 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct
33 30 0:29 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
34 30 0:30 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
35 30 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw";
    const HYBRID_OWN: &str = "8:pids:/\n4:memory:/api/abc\n2:cpuacct:/\n1:cpu:/\n0::/\n";

    fn check(mounts: &str, own: &str, controllers: Option<&str>, expected: CgroupHost) {
        let got = CgroupHost::from_tables(mounts, own, |_| controllers.map(str::to_string));
        assert_eq!(got, expected);
    }

    #[test]
    fn hybrid_host_uses_v1_under_own_cgroups() {
        check(
            HYBRID_MOUNTS,
            HYBRID_OWN,
            Some(""),
            CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: vec![
                    CgroupBase {
                        dir: "/sys/fs/cgroup/cpu".into(),
                        memory: false,
                        cpu: true,
                    },
                    CgroupBase {
                        dir: "/sys/fs/cgroup/memory/api/abc".into(),
                        memory: true,
                        cpu: false,
                    },
                ],
            },
        );
    }

    #[test]
    fn comounted_cpu_and_cpuacct_is_one_base() {
        let mounts = "31 30 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct";
        check(
            mounts,
            "3:cpu,cpuacct:/x\n",
            None,
            CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: vec![CgroupBase {
                    dir: "/sys/fs/cgroup/cpu,cpuacct/x".into(),
                    memory: false,
                    cpu: true,
                }],
            },
        );
    }

    #[test]
    fn pure_v2_host_reads_its_controllers() {
        let mounts = "25 20 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate";
        check(
            mounts,
            "0::/\n",
            Some("cpuset cpu io memory pids\n"),
            CgroupHost {
                version: Some(CgroupVersion::V2),
                bases: vec![CgroupBase {
                    dir: "/sys/fs/cgroup".into(),
                    memory: true,
                    cpu: true,
                }],
            },
        );
        check(
            mounts,
            "0::/system.slice/sbxd.service\n",
            Some("pids\n"),
            CgroupHost {
                version: Some(CgroupVersion::V2),
                bases: vec![CgroupBase {
                    dir: "/sys/fs/cgroup/system.slice/sbxd.service".into(),
                    memory: false,
                    cpu: false,
                }],
            },
        );
    }

    #[test]
    fn no_cgroup_mounts_means_no_cgroups() {
        check(
            "22 1 0:21 / /proc rw - proc proc rw",
            "",
            None,
            CgroupHost {
                version: None,
                bases: vec![],
            },
        );
    }

    #[test]
    fn a_mount_rooted_below_the_hierarchy_root_is_joined_correctly() {
        assert_eq!(
            own_dir(Path::new("/cg"), "/a", "/a/b/c"),
            PathBuf::from("/cg/b/c")
        );
        assert_eq!(own_dir(Path::new("/cg"), "/a", "/a"), PathBuf::from("/cg"));
        assert_eq!(own_dir(Path::new("/cg"), "/a", "/ab"), PathBuf::from("/cg"));
        assert_eq!(own_dir(Path::new("/cg"), "/", "/"), PathBuf::from("/cg"));
    }

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
}
