//! Reading process identities from `/proc`.
//!
//! A pid alone does not identify a process: the kernel reuses pids. A workload is identified by
//! its pid *and* its start time (field 22 of `/proc/<pid>/stat`, in clock ticks since boot), so a
//! recycled pid that now belongs to an unrelated process is never mistaken for the workload.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One incarnation of a process: its pid and the tick at which it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProcessIdentity {
    pub pid: i32,
    /// Field 22 of `/proc/<pid>/stat`: start time in clock ticks after boot.
    pub start_ticks: u64,
}

impl fmt::Display for ProcessIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pid {} started at tick {}", self.pid, self.start_ticks)
    }
}

/// What one line of `/proc/<pid>/stat` says about its process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatLine {
    pub identity: ProcessIdentity,
    /// Field 3: `R`, `S`, `D`, `Z` (zombie), `X` (dead), …
    pub state: char,
}

/// Parses a `/proc/<pid>/stat` line. The command name (field 2) is in parentheses and may
/// itself hold spaces and parentheses, so fields after it are counted from the *last* `)`.
pub fn parse_stat_line(line: &str) -> Option<StatLine> {
    let open = line.find(" (")?;
    let pid: i32 = line[..open].trim().parse().ok()?;
    let close = line.rfind(')')?;
    if close < open {
        return None;
    }
    // Fields 3.. follow the command name; field 22 is the 20th of them.
    let mut rest = line[close + 1..].split_ascii_whitespace();
    let state = rest.next()?.chars().next()?;
    let start_ticks: u64 = rest.nth(18)?.parse().ok()?;
    if pid <= 0 {
        return None;
    }
    Some(StatLine {
        identity: ProcessIdentity { pid, start_ticks },
        state,
    })
}

/// Reads the current stat line of `pid`, if such a process exists.
pub fn read_stat(pid: i32) -> Option<StatLine> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat_line(&text)
}

/// Whether the process `identity` still runs: its pid exists, started at the same tick, and
/// is not a zombie waiting to be reaped.
pub fn is_alive(identity: &ProcessIdentity) -> bool {
    match read_stat(identity.pid) {
        Some(stat) => {
            stat.identity.start_ticks == identity.start_ticks && !matches!(stat.state, 'Z' | 'X')
        }
        None => false,
    }
}

/// Whether `pid` is in a cgroup of sandbox `sandbox_id`: a line of its `/proc/<pid>/cgroup`
/// has a path segment that is the id (the oci driver's `/<parent>/<id>`) or `sbx-<id>` (the
/// process driver's); an empty id names no sandbox. A sandbox's process cannot leave its cgroups (their files are host
/// root's), and no host process is in them: the proof that a pid is the sandbox's own, which
/// a pid and start time read from a file can never be.
pub fn in_sandbox_cgroup(pid: i32, sandbox_id: &str) -> bool {
    if sandbox_id.is_empty() {
        return false;
    }
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else {
        return false;
    };
    let named = |seg: &str| seg == sandbox_id || seg.strip_prefix("sbx-") == Some(sandbox_id);
    text.lines().any(|line| {
        line.splitn(3, ':')
            .nth(2)
            .is_some_and(|path| path.split('/').any(named))
    })
}

/// Whether `identity` still runs (see [`is_alive`]) and is sandbox `sandbox_id`'s own (see
/// [`in_sandbox_cgroup`]).
pub fn is_sandbox_process(identity: &ProcessIdentity, sandbox_id: &str) -> bool {
    is_alive(identity) && in_sandbox_cgroup(identity.pid, sandbox_id)
}

/// Sends `signal` to `identity` if it is sandbox `sandbox_id`'s own process, through a pidfd
/// opened first and checked after: between the check and the signal the pid cannot come to
/// name another process (a pidfd names one process for its life). Returns whether it was
/// sent.
pub fn signal_sandbox_process(
    identity: &ProcessIdentity,
    sandbox_id: &str,
    signal: rustix::process::Signal,
) -> bool {
    let Some(pid) = rustix::process::Pid::from_raw(identity.pid) else {
        return false;
    };
    let Ok(pidfd) = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) else {
        return false;
    };
    if !is_sandbox_process(identity, sandbox_id) {
        return false;
    }
    rustix::process::pidfd_send_signal(&pidfd, signal).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SH: &str = "9911 (sh) S 9909 9909 9909 0 -1 4194560 83 0 0 0 0 0 0 0 20 0 1 0 69204 \
                      2654208 396 18446744073709551615 1 2 3 0 0 0 0 6 65536 0 0 0 17 1 0 0";

    #[test]
    fn parses_pid_state_and_start_time() {
        let stat = parse_stat_line(SH).unwrap();
        assert_eq!(
            stat.identity,
            ProcessIdentity {
                pid: 9911,
                start_ticks: 69204
            }
        );
        assert_eq!(stat.state, 'S');
    }

    #[test]
    fn command_names_with_spaces_and_parentheses_do_not_shift_fields() {
        let line = SH.replace("(sh)", "(a b) (c)");
        let stat = parse_stat_line(&line).unwrap();
        assert_eq!(stat.identity.start_ticks, 69204);
        assert_eq!(stat.state, 'S');
    }

    #[test]
    fn malformed_lines_are_refused() {
        for bad in [
            "",
            "12",
            "x (sh) S 1",
            "12 (sh) S 1 2 3",
            "-4 (sh) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
        ] {
            assert_eq!(parse_stat_line(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_process_outside_the_sandboxs_cgroups_is_not_its_own_and_is_not_signalled() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let identity = read_stat(child.id() as i32).unwrap().identity;
        let id = "0b9c3c1e-6f1a-4c50-9a57-1d2a3b4c5d6e";
        assert!(is_alive(&identity));
        assert!(!in_sandbox_cgroup(identity.pid, id));
        assert!(
            !in_sandbox_cgroup(identity.pid, ""),
            "an empty id names every process"
        );
        assert!(!is_sandbox_process(&identity, id));
        assert!(!signal_sandbox_process(
            &identity,
            id,
            rustix::process::Signal::KILL
        ));
        assert!(
            child.try_wait().unwrap().is_none(),
            "the host process was signalled"
        );
        // The child's own cgroup path names it (as a sandbox's names the sandbox); a
        // segment that only ends with it does not.
        let own = std::fs::read_to_string(format!("/proc/{}/cgroup", identity.pid)).unwrap();
        if let Some(leaf) = own
            .lines()
            .filter_map(|l| l.splitn(3, ':').nth(2)?.rsplit('/').next())
            .find(|s| s.len() > 1)
        {
            assert!(in_sandbox_cgroup(identity.pid, leaf), "{own}");
            assert!(!in_sandbox_cgroup(identity.pid, &leaf[1..]), "{own}");
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn own_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = read_stat(std::process::id() as i32).unwrap().identity;
        assert!(is_alive(&me));
        let reused = ProcessIdentity {
            pid: me.pid,
            start_ticks: me.start_ticks + 1,
        };
        assert!(!is_alive(&reused));
    }
}
