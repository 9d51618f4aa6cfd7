//! What a sandbox asked of what every sandbox on the host shares, past its own budget — the
//! refusals a snapshot carries (`pb::BudgetRefusals`), and the one budget over all sandboxes
//! together: the pids of the driver's cgroup parent.
//!
//! Each budget is enforced where it is cheapest and cannot be argued with (the kernel where it
//! can): a sandbox's ptys by its devpts instances' `max=` (`ptys`), its processes by its
//! cgroup's `pids.max`, its DNS queries by the gateway's resolver and its tracked connections
//! by the network's table (`sbx_network`). What each refused is counted where it is refused
//! and gathered here for the snapshot: an exec's terminal the driver could not get (counted as
//! the exec fails, in this process), a fork at the pids limit (the cgroup's own `pids.events`,
//! kept with the cgroup, so for the run), and the network's counts.
//!
//! **Processes over all sandboxes.** Each sandbox's `pids.max` bounds one fork bomb, but 32
//! sandboxes of 1024 each take a host of `kernel.pid_max` 32768 whole. So the parent cgroup
//! under which a driver makes its sandboxes' cgroups gets a `pids.max` of its own
//! ([`cap_parent_pids`]): by default half of `kernel.pid_max` (and of `kernel.threads-max`),
//! which leaves the host's own processes the other half whatever the sandboxes do.

use std::path::{Path, PathBuf};

use sbx_driver_api::pb;

use crate::usage;

/// The refusals of the sandbox whose cgroup is at `cgroup_path` (`/<parent>/<id>`, the same
/// path in every hierarchy) and whose exec ptys are counted by `ptys::refused`, with the
/// network's `(dns_queries, connections)`. `None` when nothing was refused.
pub fn refusals(
    id: uuid::Uuid,
    cgroup_dirs: &[PathBuf],
    network: (u64, u64),
) -> Option<pb::BudgetRefusals> {
    let r = pb::BudgetRefusals {
        ptys: crate::ptys::refused(id),
        pids: pids_refused(cgroup_dirs),
        dns_queries: network.0,
        connections: network.1,
    };
    (r != pb::BudgetRefusals::default()).then_some(r)
}

/// Forks refused at the pids limit of the cgroup whose directories are `dirs` (`pids.events`'
/// `max`, v1 or v2; 0 without a pids controller).
pub fn pids_refused(dirs: &[PathBuf]) -> u64 {
    dirs.iter()
        .find_map(|d| std::fs::read_to_string(d.join("pids.events")).ok())
        .map(|text| usage::key_value(&text, "max"))
        .unwrap_or(0)
}

/// The default `pids.max` of the sandboxes' parent cgroup: half of what the kernel allows
/// (`kernel.pid_max` and `kernel.threads-max`, the lower), at least 1024.
pub fn default_parent_pids() -> u64 {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
    };
    let limit = [
        read("/proc/sys/kernel/pid_max"),
        read("/proc/sys/kernel/threads-max"),
    ]
    .into_iter()
    .flatten()
    .min()
    .unwrap_or(32768);
    (limit / 2).max(1024)
}

/// Gives the cgroup `parent` (relative to each hierarchy's root) a `pids.max` of `max`: on
/// cgroup v1 in the pids hierarchy, on v2 under the unified root with the pids controller
/// enabled on the way. The directory is made when missing (the runtime makes the sandboxes'
/// under it). Answers the file written, or why nothing could be.
pub fn cap_parent_pids(parent: &str, max: u64) -> Result<PathBuf, String> {
    let rel = parent.trim_start_matches('/');
    let root = Path::new(usage::CGROUP_ROOT);
    let dir = if root.join("cgroup.controllers").exists() {
        // v2: every ancestor below the root must delegate the pids controller to its children.
        let mut at = root.to_path_buf();
        for part in Path::new(rel).components() {
            let controllers =
                std::fs::read_to_string(at.join("cgroup.subtree_control")).unwrap_or_default();
            if !controllers.split_whitespace().any(|c| c == "pids") {
                std::fs::write(at.join("cgroup.subtree_control"), "+pids").map_err(|e| {
                    format!("enabling the pids controller in {}: {e}", at.display())
                })?;
            }
            at.push(part);
            std::fs::create_dir_all(&at).map_err(|e| format!("making {}: {e}", at.display()))?;
        }
        at
    } else {
        let pids = root.join("pids");
        if !pids.join("cgroup.procs").exists() {
            return Err(format!(
                "no pids hierarchy is mounted at {}",
                pids.display()
            ));
        }
        let dir = pids.join(rel);
        std::fs::create_dir_all(&dir).map_err(|e| format!("making {}: {e}", dir.display()))?;
        dir
    };
    let file = dir.join("pids.max");
    std::fs::write(&file, max.to_string())
        .map_err(|e| format!("writing {}: {e}", file.display()))?;
    Ok(file)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cgroup parent capped at 40 pids: its children together run at most 40 (a child's
    /// own limit is `max`), the fork past it fails, and the child's `pids.events` counts it.
    /// Needs root and a pids controller; skipped, and said, without them.
    #[test]
    fn the_parent_cap_bounds_every_child_together_and_refusals_are_counted() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("needs root to make cgroups");
            return;
        }
        let parent = format!("sbx-budgets-test-{}", uuid::Uuid::new_v4().simple());
        let file = match cap_parent_pids(&parent, 40) {
            Ok(file) => file,
            Err(e) if e.contains("no pids hierarchy") => {
                eprintln!("{e}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        assert_eq!(std::fs::read_to_string(&file).unwrap().trim(), "40");
        let parent_dir = file.parent().unwrap().to_path_buf();
        let child = parent_dir.join("a");
        std::fs::create_dir(&child).unwrap();
        // A process in the child forks 60 sleepers; at most 40 (itself included) get made.
        const FORKS: &str = r#"import os, sys, time
open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid()))
kids, refused = [], 0
for _ in range(60):
    try:
        pid = os.fork()
    except OSError:
        refused += 1
        continue
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
print(open(sys.argv[1] + '/pids.current').read().strip(), refused, flush=True)
for k in kids:
    os.kill(k, 9)
for k in kids:
    os.waitpid(k, 0)
"#;
        let out = std::process::Command::new("python3")
            .args(["-c", FORKS])
            .arg(&child)
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let out = String::from_utf8_lossy(&out.stdout).into_owned();
        let mut words = out
            .split_whitespace()
            .map(|w| w.parse::<u64>().unwrap_or(u64::MAX));
        let (peak, refused_forks) = (words.next().unwrap_or(u64::MAX), words.next().unwrap_or(0));
        let refused = pids_refused(std::slice::from_ref(&child))
            + pids_refused(std::slice::from_ref(&parent_dir));
        // Bounded: the loop's tries end, and the test's cgroups go.
        for _ in 0..50 {
            if std::fs::remove_dir(&child).is_ok() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        let _ = std::fs::remove_dir(&parent_dir);
        assert!(
            peak <= 40,
            "the children ran {peak} processes past the parent's 40: {out}"
        );
        assert!(refused_forks > 0, "every fork was let through: {out}");
        assert!(refused > 0, "no refusal was counted in pids.events");
    }

    #[test]
    fn the_default_cap_leaves_the_host_half() {
        let d = default_parent_pids();
        assert!(d >= 1024);
        let pid_max: u64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(d <= pid_max.max(2048) / 2, "{d} of {pid_max}");
    }
}
