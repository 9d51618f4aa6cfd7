//! What the driver reads of the cgroups the runtime makes for its sandboxes: the OOM-kill
//! counter (so a main process killed by its memory limit is reported as `OOMKilled`), the
//! freezer's state (a frozen sandbox is paused: see `pause.rs`), and which sandbox cgroups
//! exist (for leak checks). The runtime creates, freezes, thaws and removes them; the driver
//! writes one cgroup file only, to thaw a freeze the runtime left half done ([`thaw`]): the
//! runtime cannot, it waits for a `FREEZING` cgroup to settle before it does anything.
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

/// The cgroup freezer's state of one sandbox's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freezer {
    Thawed,
    /// A freeze under way, or one left half done: some of its processes may still run.
    Freezing,
    /// Every process of the cgroup frozen: what `runc` reports as `paused`.
    Frozen,
}

/// Whether this host has a cgroup freezer: v2's `cgroup.freeze` (kernel 5.2 and later: every
/// kernel the driver runs on), or v1's `freezer` controller mounted (which the runtime uses on
/// a hybrid host).
pub fn freezer_available() -> bool {
    let root = Path::new(CGROUP_ROOT);
    root.join("freezer").join("cgroup.procs").exists() || root.join("cgroup.controllers").exists()
}

/// The freezer's state of the cgroup at `path`: v1's `freezer.state` where the freezer
/// controller is mounted (the file the runtime reads for its `paused` status), else v2's
/// `cgroup.events` (`frozen 1`) and `cgroup.freeze` (asked but not yet frozen: freezing).
/// `None` when the cgroup does not exist (the workload does not run).
pub fn freezer(path: &str) -> Option<Freezer> {
    let rel = path.trim_start_matches('/');
    let root = Path::new(CGROUP_ROOT);
    if let Ok(text) = std::fs::read_to_string(root.join("freezer").join(rel).join("freezer.state"))
    {
        return Some(parse_v1_state(&text));
    }
    let dir = root.join(rel);
    let events = std::fs::read_to_string(dir.join("cgroup.events")).ok()?;
    let asked = std::fs::read_to_string(dir.join("cgroup.freeze")).unwrap_or_default();
    Some(parse_v2_state(&events, &asked))
}

fn parse_v1_state(text: &str) -> Freezer {
    match text.trim() {
        "FROZEN" => Freezer::Frozen,
        "THAWED" => Freezer::Thawed,
        // FREEZING, or anything the kernel may say one day: not all frozen.
        _ => Freezer::Freezing,
    }
}

fn parse_v2_state(events: &str, asked: &str) -> Freezer {
    match (events.lines().any(|l| l.trim() == "frozen 1"), asked.trim()) {
        (true, _) => Freezer::Frozen,
        (false, "1") => Freezer::Freezing,
        (false, _) => Freezer::Thawed,
    }
}

/// Thaws the cgroup at `path` by writing its freezer file (v1 `freezer.state`, v2
/// `cgroup.freeze`): for a freeze left `FREEZING`, which the runtime cannot undo. A write
/// that cannot fail half way: every process runs again.
pub fn thaw(path: &str) -> std::io::Result<()> {
    let rel = path.trim_start_matches('/');
    let root = Path::new(CGROUP_ROOT);
    let v1 = root.join("freezer").join(rel).join("freezer.state");
    if v1.exists() {
        return std::fs::write(v1, "THAWED");
    }
    std::fs::write(root.join(rel).join("cgroup.freeze"), "0")
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

    #[test]
    fn freezer_states_are_read_from_v1_and_v2_files() {
        assert_eq!(parse_v1_state("FROZEN\n"), Freezer::Frozen);
        assert_eq!(parse_v1_state("THAWED\n"), Freezer::Thawed);
        assert_eq!(parse_v1_state("FREEZING\n"), Freezer::Freezing);
        assert_eq!(
            parse_v2_state("populated 1\nfrozen 1\n", "1\n"),
            Freezer::Frozen
        );
        assert_eq!(
            parse_v2_state("populated 1\nfrozen 0\n", "1\n"),
            Freezer::Freezing
        );
        assert_eq!(
            parse_v2_state("populated 1\nfrozen 0\n", "0\n"),
            Freezer::Thawed
        );
        assert_eq!(freezer("/no-such-parent/no-such-sandbox"), None);
    }
}
