//! Reading process identities from `/proc`.
//!
//! A pid alone does not identify a process: the kernel reuses pids. A workload is identified by
//! its pid *and* its start time (field 22 of `/proc/<pid>/stat`, in clock ticks since boot), so a
//! recycled pid that now belongs to an unrelated process is never mistaken for the workload.

use std::fmt;

use serde::{Deserialize, Serialize};

/// One incarnation of a process: its pid and the tick at which it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
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
