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
}
