//! What a sandbox uses, read from the host's own accounting: its cgroups (CPU time, memory,
//! pids, their limits, OOM kills), the filesystem of its disk (`statvfs` of the mount), the
//! host end of its network link (`/sys/class/net/<veth>/statistics`), and, for a workload that
//! is one host process (a VM's QEMU), that process's `/proc` figures.
//!
//! Every file read here is the kernel's (cgroupfs, sysfs, procfs), never one in a directory the
//! sandbox controls: a sandbox cannot make these answer anything but its own figures. What
//! cannot be read is reported absent (0, or `None`), never guessed.

use std::path::{Path, PathBuf};

use sbx_driver_api::pb;

pub(crate) const CGROUP_ROOT: &str = "/sys/fs/cgroup";
/// A v1 memory limit at or above this is "no limit" (the kernel reports `PAGE_COUNTER_MAX`
/// pages rounded to bytes, 0x7FFFFFFFFFFFF000 on x86_64).
const V1_NO_LIMIT: u64 = 1 << 60;

/// The figures of one sandbox's cgroups.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CgroupUsage {
    pub cpu_nanos: u64,
    /// Thousandths of a core; 0: no limit.
    pub cpu_limit_millis: u64,
    /// In use, minus the page cache the kernel may drop at once (inactive file pages): what
    /// `docker stats` and the kubelet call the working set.
    pub memory_bytes: u64,
    pub memory_limit_bytes: u64,
    pub pids: u64,
    pub pids_limit: u64,
    pub oom_kills: u64,
}

/// The directories of the cgroup at `path` (`/<parent>/<id>`, the same path in every
/// hierarchy) that exist: one per v1 controller mount, and the v2 one.
pub fn hierarchy_dirs(path: &str) -> Vec<PathBuf> {
    let mut dirs = hierarchy_paths(path);
    dirs.retain(|d| d.is_dir());
    dirs
}

/// Where the cgroup at `path` would be in every hierarchy: under each v1 controller's mount,
/// and under the v2 (unified) root; whether or not it exists.
pub fn hierarchy_paths(path: &str) -> Vec<PathBuf> {
    let rel = path.trim_start_matches('/');
    let root = Path::new(CGROUP_ROOT);
    // cgroup v2 alone: the root is the one hierarchy, and its children are cgroups (of which
    // a delegated one could hold a tree named like another sandbox's path), not mounts.
    if root.join("cgroup.controllers").exists() {
        return vec![root.join(rel)];
    }
    // v1 (or hybrid): each child of the root is a hierarchy's mount (the v2 one included).
    let mut paths: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join(rel))
        .collect();
    paths.push(root.join(rel));
    paths
}

/// Reads a sandbox's figures from the cgroup directories `dirs` (each a hierarchy's directory
/// of the sandbox, v1 or v2, as [`hierarchy_dirs`] or the driver's record gives them).
pub fn cgroup_usage(dirs: &[PathBuf]) -> CgroupUsage {
    let read = |name: &str| {
        dirs.iter()
            .find_map(|d| std::fs::read_to_string(d.join(name)).ok())
    };
    let number = |name: &str| read(name).and_then(|t| t.trim().parse::<u64>().ok());

    // CPU: v1 cpuacct counts nanoseconds, v2 cpu.stat microseconds.
    let cpu_nanos = number("cpuacct.usage")
        .or_else(|| {
            read("cpu.stat")
                .map(|t| key_value(&t, "usage_usec"))
                .filter(|&us| us > 0)
                .map(|us| us.saturating_mul(1000))
        })
        .unwrap_or(0);
    let cpu_limit_millis = match (number("cpu.cfs_quota_us"), number("cpu.cfs_period_us")) {
        (Some(quota), Some(period)) if period > 0 => quota.saturating_mul(1000) / period,
        // A quota of -1 (no limit) does not parse as u64.
        _ => read("cpu.max").map(|t| cpu_max_millis(&t)).unwrap_or(0),
    };

    // Memory: v1's files, else v2's ("max" does not parse: no limit).
    let stat = read("memory.stat").unwrap_or_default();
    let (memory_bytes, memory_limit_bytes, oom_kills) =
        if let Some(used) = number("memory.usage_in_bytes") {
            (
                used.saturating_sub(key_value(&stat, "total_inactive_file")),
                number("memory.limit_in_bytes")
                    .filter(|&l| l < V1_NO_LIMIT)
                    .unwrap_or(0),
                read("memory.oom_control").map_or(0, |t| key_value(&t, "oom_kill")),
            )
        } else if let Some(used) = number("memory.current") {
            (
                used.saturating_sub(key_value(&stat, "inactive_file")),
                number("memory.max").unwrap_or(0),
                read("memory.events").map_or(0, |t| key_value(&t, "oom_kill")),
            )
        } else {
            (0, 0, 0)
        };

    CgroupUsage {
        cpu_nanos,
        cpu_limit_millis,
        memory_bytes,
        memory_limit_bytes,
        pids: number("pids.current").unwrap_or(0),
        pids_limit: number("pids.max").unwrap_or(0),
        oom_kills,
    }
}

/// The value of `key N` in a cgroup key-value file (0 when absent).
pub fn key_value(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|line| {
            let (k, v) = line.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
        })
        .unwrap_or(0)
}

/// A v2 `cpu.max` (`"<quota> <period>"`, quota `max` for none) in thousandths of a core.
fn cpu_max_millis(text: &str) -> u64 {
    let mut parts = text.split_whitespace();
    match (
        parts.next().and_then(|q| q.parse::<u64>().ok()),
        parts.next().and_then(|p| p.parse::<u64>().ok()),
    ) {
        (Some(quota), Some(period)) if period > 0 => quota.saturating_mul(1000) / period,
        _ => 0,
    }
}

/// Bytes used and the size of the filesystem mounted at `mount_point`, when one of at most
/// `limit` bytes is mounted there (the sandbox's disk); `None` otherwise (the host's own
/// filesystem would be seen: its figures are not the sandbox's).
pub fn disk_usage(mount_point: &Path, limit: u64) -> Option<(u64, u64)> {
    if limit == 0 {
        return None;
    }
    let st = nix::sys::statvfs::statvfs(mount_point).ok()?;
    let block = st.fragment_size();
    let total = st.blocks() * block;
    if total > limit {
        return None;
    }
    Some((total - st.blocks_free() * block, total))
}

/// Bytes received and sent by the sandbox on its link whose host end is `host_end`: the host
/// end's transmit counter is what the sandbox received, and the other way round.
pub fn link_traffic(host_end: &str) -> Option<(u64, u64)> {
    let read = |name: &str| -> Option<u64> {
        let path = Path::new("/sys/class/net")
            .join(host_end)
            .join("statistics")
            .join(name);
        std::fs::read_to_string(path).ok()?.trim().parse().ok()
    };
    Some((read("tx_bytes")?, read("rx_bytes")?))
}

/// CPU time (user + system, in nanoseconds) and resident memory (bytes) of the process
/// `identity`, from `/proc/<pid>/stat` and `/proc/<pid>/statm`; `None` unless both were read
/// of that very process (its start time checked before and after: a recycled pid is another
/// process, never read for it).
pub fn process_usage(identity: &crate::ProcessIdentity) -> Option<(u64, u64)> {
    let pid = identity.pid;
    let read_stat = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let line = crate::procfs::parse_stat_line(&stat)?;
        (line.identity == *identity).then_some(stat)
    };
    let stat = read_stat()?;
    // Fields after the command name (which may hold spaces), counted from its last ')':
    // utime and stime are fields 14 and 15, the 12th and 13th after it.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_ascii_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let ticks = rustix::param::clock_ticks_per_second().max(1);
    let cpu_nanos = (utime + stime).saturating_mul(1_000_000_000) / ticks;
    let statm = std::fs::read_to_string(format!("/proc/{pid}/statm")).ok()?;
    let resident_pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    let rss = resident_pages.saturating_mul(rustix::param::page_size() as u64);
    read_stat()?;
    Some((cpu_nanos, rss))
}

impl CgroupUsage {
    /// The contract's message of these figures, for a workload that runs (`running`) or not.
    pub fn message(&self, running: bool) -> pb::SandboxUsage {
        let mut usage = pb::SandboxUsage {
            running,
            cpu_limit_millis: self.cpu_limit_millis,
            memory_limit_bytes: self.memory_limit_bytes,
            pids_limit: self.pids_limit,
            oom_kills: self.oom_kills,
            ..Default::default()
        };
        if running {
            usage.cpu_nanos = self.cpu_nanos;
            usage.memory_bytes = self.memory_bytes;
            usage.pids = self.pids;
        }
        usage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn v1_figures_are_read_across_controller_dirs() {
        let tmp = tempfile::tempdir().unwrap();
        let (cpu, mem, pids) = (
            tmp.path().join("cpu"),
            tmp.path().join("memory"),
            tmp.path().join("pids"),
        );
        for d in [&cpu, &mem, &pids] {
            std::fs::create_dir(d).unwrap();
        }
        write(&cpu, "cpuacct.usage", "2500000000\n");
        write(&cpu, "cpu.cfs_quota_us", "150000\n");
        write(&cpu, "cpu.cfs_period_us", "100000\n");
        write(&mem, "memory.usage_in_bytes", "110000000\n");
        write(
            &mem,
            "memory.stat",
            "cache 20\ntotal_inactive_file 10000000\n",
        );
        write(&mem, "memory.limit_in_bytes", "268435456\n");
        write(
            &mem,
            "memory.oom_control",
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        );
        write(&pids, "pids.current", "7\n");
        write(&pids, "pids.max", "512\n");
        let usage = cgroup_usage(&[cpu, mem, pids]);
        assert_eq!(
            usage,
            CgroupUsage {
                cpu_nanos: 2_500_000_000,
                cpu_limit_millis: 1500,
                memory_bytes: 100_000_000,
                memory_limit_bytes: 268_435_456,
                pids: 7,
                pids_limit: 512,
                oom_kills: 2,
            }
        );
    }

    #[test]
    fn v2_figures_and_absent_limits() {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().to_path_buf();
        write(&d, "cpu.stat", "usage_usec 1500\nuser_usec 1000\n");
        write(&d, "cpu.max", "max 100000\n");
        write(&d, "memory.current", "5000\n");
        write(&d, "memory.stat", "anon 4000\ninactive_file 1000\n");
        write(&d, "memory.max", "max\n");
        write(&d, "memory.events", "oom 0\noom_kill 0\n");
        write(&d, "pids.current", "3\n");
        write(&d, "pids.max", "max\n");
        let usage = cgroup_usage(&[d]);
        assert_eq!(usage.cpu_nanos, 1_500_000);
        assert_eq!(usage.cpu_limit_millis, 0, "cpu.max of max is no limit");
        assert_eq!(usage.memory_bytes, 4000);
        assert_eq!(usage.memory_limit_bytes, 0, "memory.max of max is no limit");
        assert_eq!((usage.pids, usage.pids_limit), (3, 0));
        // A v1 quota of -1 is no limit too.
        let v1 = tmp.path().join("v1");
        std::fs::create_dir(&v1).unwrap();
        write(&v1, "cpu.cfs_quota_us", "-1\n");
        write(&v1, "cpu.cfs_period_us", "100000\n");
        write(&v1, "memory.usage_in_bytes", "10\n");
        write(&v1, "memory.limit_in_bytes", "9223372036854771712\n");
        let usage = cgroup_usage(&[v1]);
        assert_eq!((usage.cpu_limit_millis, usage.memory_limit_bytes), (0, 0));
        // Nothing to read: nothing reported.
        assert_eq!(cgroup_usage(&[]), CgroupUsage::default());
    }

    #[test]
    fn a_stopped_workload_reports_limits_but_no_use() {
        let usage = CgroupUsage {
            cpu_nanos: 5,
            cpu_limit_millis: 500,
            memory_bytes: 6,
            memory_limit_bytes: 7,
            pids: 1,
            pids_limit: 9,
            oom_kills: 1,
        };
        let stopped = usage.message(false);
        assert_eq!(
            (stopped.cpu_nanos, stopped.memory_bytes, stopped.pids),
            (0, 0, 0)
        );
        assert_eq!((stopped.cpu_limit_millis, stopped.oom_kills), (500, 1));
        let running = usage.message(true);
        assert_eq!(
            (running.cpu_nanos, running.memory_bytes, running.pids),
            (5, 6, 1)
        );
    }

    #[test]
    fn this_process_has_cpu_time_and_resident_memory() {
        let me = crate::procfs::read_stat(std::process::id() as i32)
            .unwrap()
            .identity;
        let (cpu, rss) = process_usage(&me).unwrap();
        assert!(rss > 0);
        // Burn a little CPU, and see it counted.
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < std::time::Duration::from_millis(50) {
            x = x.wrapping_mul(31).wrapping_add(1);
        }
        std::hint::black_box(x);
        let (later, _) = process_usage(&me).unwrap();
        assert!(later > cpu, "{later} > {cpu}");
        // Another incarnation of the pid (another start time) is not read; nor is no process.
        let recycled = crate::ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert_eq!(process_usage(&recycled), None);
        let none = crate::ProcessIdentity { pid: -1, ..me };
        assert_eq!(process_usage(&none), None);
    }

    #[test]
    fn no_disk_is_reported_without_a_limit_or_for_the_hosts_filesystem() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(disk_usage(tmp.path(), 0), None);
        // A 1 MiB "limit" on the host's filesystem: its figures are not the sandbox's.
        assert_eq!(disk_usage(tmp.path(), 1 << 20), None);
        assert_eq!(link_traffic("sbx-no-such-link"), None);
    }
}
