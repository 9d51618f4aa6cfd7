//! What the driver reads of the cgroups the runtime makes for its sandboxes: the OOM-kill
//! counter (so a main process killed by its memory limit is reported as `OOMKilled`), and
//! which sandbox cgroups exist (for leak checks). The runtime creates and removes them; the
//! driver never writes a cgroup file.
//!
//! The runtime is given the same absolute path `/<parent>/<id>` for every hierarchy: on
//! cgroup v1 it is made under each controller's mount (`/sys/fs/cgroup/memory/<parent>/<id>`,
//! …), on v2 under the unified mount.

use std::path::{Path, PathBuf};

use sbx_host_kit::usage;

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// How many times the OOM killer struck in the cgroup at `path` (0 when it has none, or no
/// memory controller).
pub fn oom_kills(path: &str) -> u64 {
    let rel = path.trim_start_matches('/');
    let v1 = Path::new(CGROUP_ROOT)
        .join("memory")
        .join(rel)
        .join("memory.oom_control");
    let v2 = Path::new(CGROUP_ROOT).join(rel).join("memory.events");
    [v1, v2]
        .iter()
        .find_map(|file| std::fs::read_to_string(file).ok())
        .map(|text| usage::key_value(&text, "oom_kill"))
        .unwrap_or(0)
}

/// Every cgroup directory under `/<parent>` in every hierarchy (v1 controllers and v2).
pub fn children_of(parent: &str) -> Vec<PathBuf> {
    usage::hierarchy_paths(parent)
        .iter()
        .flat_map(|base| std::fs::read_dir(base).into_iter().flatten().flatten())
        .filter(|e| e.path().is_dir())
        .map(|e| e.path())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_are_read_from_v1_and_v2_files() {
        let v1 = "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n";
        let v2 = "low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\noom_group_kill 0\n";
        assert_eq!(usage::key_value(v1, "oom_kill"), 3);
        assert_eq!(usage::key_value(v2, "oom_kill"), 1);
        assert_eq!(usage::key_value("", "oom_kill"), 0);
        assert_eq!(oom_kills("/no-such-parent/no-such-sandbox"), 0);
    }
}
