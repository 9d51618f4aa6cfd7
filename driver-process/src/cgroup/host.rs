//! Finding the host's cgroup hierarchies (v1, v2 or hybrid) and the driver's own cgroup in
//! each.

use std::fs;
use std::path::{Path, PathBuf};

use super::{CgroupBase, CgroupHost, CgroupVersion};

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
    /// (a hybrid host's unified mount usually has no controllers), together with those holding
    /// `cpuacct` or `pids` (the sandbox's CPU time and process count are read there); otherwise
    /// a cgroup2 mount is used with the controllers its `cgroup.controllers` lists.
    pub fn from_tables(
        mountinfo: &str,
        own_cgroups: &str,
        read_controllers: impl Fn(&Path) -> Option<String>,
    ) -> CgroupHost {
        let mounts = parse_mountinfo(mountinfo);
        let own = parse_own_cgroups(own_cgroups);
        let mut v1_bases: Vec<CgroupBase> = Vec::new();
        for mount in mounts.iter().filter(|m| m.fstype == "cgroup") {
            let used: Vec<&str> = V1_CONTROLLERS
                .into_iter()
                .filter(|c| mount.super_options.iter().any(|o| o == c))
                .collect();
            if used.is_empty() {
                continue;
            }
            let own_path = own
                .iter()
                .find(|(controllers, _)| controllers.iter().any(|c| used.contains(&c.as_str())))
                .map(|(_, path)| path.as_str())
                .unwrap_or("/");
            let dir = own_dir(&mount.mount_point, &mount.root, own_path);
            v1_bases.push(CgroupBase {
                dir,
                memory: used.contains(&"memory"),
                cpu: used.contains(&"cpu"),
                cpuacct: used.contains(&"cpuacct"),
                pids: used.contains(&"pids"),
            });
        }
        // cpuacct and pids alone (their hierarchies without memory or cpu) do not make a v1
        // host: they are joined for their figures next to the limits, not instead of them.
        if v1_bases.iter().any(|b| b.memory || b.cpu) {
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
                cpuacct: false,
                pids: false,
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
}

/// The v1 controllers whose hierarchies a sandbox's workload joins: `memory` and `cpu` for
/// their limits, `cpuacct` and `pids` for their figures (CPU time, process count).
const V1_CONTROLLERS: [&str; 4] = ["memory", "cpu", "cpuacct", "pids"];

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

    /// A v1 base carrying `controllers` (of memory, cpu, cpuacct, pids).
    fn v1(dir: &str, controllers: &[&str]) -> CgroupBase {
        let has = |c: &str| controllers.contains(&c);
        CgroupBase {
            dir: dir.into(),
            memory: has("memory"),
            cpu: has("cpu"),
            cpuacct: has("cpuacct"),
            pids: has("pids"),
        }
    }

    /// Every v1 controller on a hierarchy of its own (this machine's setup): the workload joins
    /// cpuacct and pids next to cpu and memory, each under the driver's own cgroup there;
    /// cpuset and the rest are left alone.
    #[test]
    fn hybrid_host_uses_v1_under_own_cgroups() {
        check(
            HYBRID_MOUNTS,
            HYBRID_OWN,
            Some(""),
            CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: vec![
                    v1("/sys/fs/cgroup/cpu", &["cpu"]),
                    v1("/sys/fs/cgroup/cpuacct", &["cpuacct"]),
                    v1("/sys/fs/cgroup/memory/api/abc", &["memory"]),
                    v1("/sys/fs/cgroup/pids", &["pids"]),
                ],
            },
        );
        let mut with_others = HYBRID_MOUNTS.to_string();
        with_others.push_str(
            "\n36 30 0:32 / /sys/fs/cgroup/cpuset rw - cgroup cgroup rw,cpuset\n\
             37 30 0:33 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd",
        );
        let own = "9:name=systemd:/sbxd.service\n8:pids:/sbxd.service\n7:cpuset:/\n\
                   4:memory:/api/abc\n2:cpuacct:/acct\n1:cpu:/\n0::/\n";
        check(
            &with_others,
            own,
            Some(""),
            CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: vec![
                    v1("/sys/fs/cgroup/cpu", &["cpu"]),
                    v1("/sys/fs/cgroup/cpuacct/acct", &["cpuacct"]),
                    v1("/sys/fs/cgroup/memory/api/abc", &["memory"]),
                    v1("/sys/fs/cgroup/pids/sbxd.service", &["pids"]),
                ],
            },
        );
    }

    /// `cpu,cpuacct` co-mounted (the common systemd layout): one base for both, as before;
    /// a separate pids hierarchy is joined too.
    #[test]
    fn comounted_cpu_and_cpuacct_is_one_base() {
        let mounts = "31 30 0:27 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct";
        check(
            mounts,
            "3:cpu,cpuacct:/x\n",
            None,
            CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: vec![v1("/sys/fs/cgroup/cpu,cpuacct/x", &["cpu", "cpuacct"])],
            },
        );
        let mounts = format!(
            "{mounts}\n\
             32 30 0:28 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n\
             33 30 0:29 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids"
        );
        check(
            &mounts,
            "5:pids:/p\n4:memory:/m\n3:cpu,cpuacct:/x\n",
            None,
            CgroupHost {
                version: Some(CgroupVersion::V1),
                bases: vec![
                    v1("/sys/fs/cgroup/cpu,cpuacct/x", &["cpu", "cpuacct"]),
                    v1("/sys/fs/cgroup/memory/m", &["memory"]),
                    v1("/sys/fs/cgroup/pids/p", &["pids"]),
                ],
            },
        );
    }

    /// cpuacct and pids hierarchies without a memory or cpu one do not make a v1 host: the
    /// cgroup2 mount is used, as it was, and no v1 accounting base is kept.
    #[test]
    fn cpuacct_and_pids_alone_do_not_make_a_v1_host() {
        let mounts = "\
32 30 0:28 / /sys/fs/cgroup/cpuacct rw - cgroup cgroup rw,cpuacct
34 30 0:30 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids
35 30 0:31 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw";
        check(
            mounts,
            "8:pids:/\n2:cpuacct:/\n0::/\n",
            Some("cpu memory\n"),
            CgroupHost {
                version: Some(CgroupVersion::V2),
                bases: vec![CgroupBase {
                    dir: "/sys/fs/cgroup/unified".into(),
                    memory: true,
                    cpu: true,
                    cpuacct: false,
                    pids: false,
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
                    cpuacct: false,
                    pids: false,
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
                    cpuacct: false,
                    pids: false,
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
}
