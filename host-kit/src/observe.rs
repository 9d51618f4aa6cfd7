//! Deriving a sandbox's observed state from what the gateway last asked and the facts found
//! on disk and in `/proc`, and the snapshot that reports it. Pure: no IO.

use std::time::{Duration, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use super::records::HostRecord;
use sbx_driver_api::pb::{self, State};

/// What the gateway last asked of the workload (kept in each sandbox's record).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Desired {
    Running,
    Stopped,
}

/// What the driver found about the current run of one sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunFacts {
    pub desired: Desired,
    /// The shim recorded its identity (the launch got that far).
    pub init_recorded: bool,
    /// That identity is still a live process (same pid *and* start time).
    pub alive: bool,
    /// The main process's status as the shim saw it: the shell's `$?` (128 + n for signal n).
    pub exit_status: Option<i32>,
    /// The memory cgroup's OOM-kill counter rose during this run.
    pub oom_killed: bool,
}

/// The state a snapshot reports, with how and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    pub state: State,
    pub exit_code: i32,
    pub exit_signal: i32,
    pub reason: &'static str,
    pub message: String,
}

impl Observed {
    fn plain(state: State) -> Observed {
        Observed {
            state,
            exit_code: 0,
            exit_signal: 0,
            reason: "",
            message: String::new(),
        }
    }

    /// Whether the workload has run under the current generation (any state but stopped):
    /// then a snapshot shows its instance and when it was launched.
    pub fn has_run(&self) -> bool {
        self.state != State::Stopped
    }

    /// The snapshot of `record`'s sandbox in this state, under `generation`, with `instance`
    /// (the workload's process) shown only when it has run.
    pub fn into_snapshot(
        self,
        record: &impl HostRecord,
        generation: u64,
        instance: Option<String>,
        warnings: Vec<String>,
    ) -> pb::Snapshot {
        let has_run = self.has_run();
        let launched_at_ms = record.launched_at_ms();
        let started_at = (has_run && launched_at_ms > 0).then(|| {
            sbx_proto::Timestamp::from(UNIX_EPOCH + Duration::from_millis(launched_at_ms))
        });
        pb::Snapshot {
            sandbox_id: record.sandbox_id().to_string(),
            workspace: record.workspace().to_string(),
            name: record.name().to_string(),
            state: self.state as i32,
            generation,
            instance_id: instance.filter(|_| has_run).unwrap_or_default(),
            exit_code: self.exit_code,
            exit_signal: self.exit_signal,
            reason: self.reason.to_string(),
            message: self.message,
            warnings,
            started_at,
            ..Default::default()
        }
    }
}

/// The signal that a shell status of `128 + n` stands for (the shim cannot tell an `exit 137`
/// from a SIGKILL; both read as signal 9).
pub fn signal_of_status(status: i32) -> Option<i32> {
    (129..=128 + 64).contains(&status).then(|| status - 128)
}

pub fn observe(facts: RunFacts) -> Observed {
    match (facts.desired, facts.alive) {
        (Desired::Stopped, false) => Observed::plain(State::Stopped),
        (Desired::Stopped, true) => Observed {
            reason: "Stopping",
            message: "a stop is in progress; processes of the sandbox still run".into(),
            ..Observed::plain(State::Stopping)
        },
        (Desired::Running, true) => Observed::plain(State::Running),
        (Desired::Running, false) if !facts.init_recorded => Observed {
            reason: "NotStarted",
            message: "the workload's launch has not completed (it is under way, or the driver \
                      was interrupted during it; then start the sandbox again)"
                .into(),
            ..Observed::plain(State::Stopped)
        },
        (Desired::Running, false) => exited(facts.exit_status, facts.oom_killed),
    }
}

fn exited(status: Option<i32>, oom_killed: bool) -> Observed {
    let exited = Observed::plain(State::Exited);
    match status {
        Some(0) => Observed {
            reason: "Completed",
            message: "the main process exited with code 0".into(),
            ..exited
        },
        Some(status) => {
            let signal = signal_of_status(status);
            let (reason, message) = match (oom_killed, signal) {
                (true, _) => (
                    "OOMKilled",
                    format!("the main process was killed by the memory limit (status {status})"),
                ),
                (false, Some(sig)) => (
                    "Killed",
                    format!("the main process was killed by signal {sig}"),
                ),
                (false, None) => (
                    "Error",
                    format!("the main process exited with code {status}"),
                ),
            };
            Observed {
                exit_code: status,
                exit_signal: signal.unwrap_or(0),
                reason,
                message,
                ..exited
            }
        }
        None if oom_killed => Observed {
            exit_signal: 9,
            reason: "OOMKilled",
            message:
                "the sandbox's init was killed by the memory limit before recording an exit status"
                    .into(),
            ..exited
        },
        None => Observed {
            reason: "Lost",
            message:
                "the sandbox's init ended without recording an exit status (killed from outside?)"
                    .into(),
            ..exited
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(
        desired: Desired,
        init_recorded: bool,
        alive: bool,
        exit_status: Option<i32>,
        oom_killed: bool,
    ) -> RunFacts {
        RunFacts {
            desired,
            init_recorded,
            alive,
            exit_status,
            oom_killed,
        }
    }

    fn check(f: RunFacts, state: State, code: i32, signal: i32, reason: &str) {
        let got = observe(f);
        assert_eq!(
            (got.state, got.exit_code, got.exit_signal, got.reason),
            (state, code, signal, reason),
            "{f:?} -> {got:?}"
        );
        if !reason.is_empty() {
            assert!(!got.message.is_empty(), "{f:?} has a reason but no message");
        }
    }

    #[test]
    fn derivations() {
        use Desired::*;
        check(
            facts(Running, true, true, None, false),
            State::Running,
            0,
            0,
            "",
        );
        // A stale exit file cannot make a live run look exited.
        check(
            facts(Running, true, true, Some(1), false),
            State::Running,
            0,
            0,
            "",
        );
        check(
            facts(Running, true, false, Some(0), false),
            State::Exited,
            0,
            0,
            "Completed",
        );
        check(
            facts(Running, true, false, Some(3), false),
            State::Exited,
            3,
            0,
            "Error",
        );
        check(
            facts(Running, true, false, Some(143), false),
            State::Exited,
            143,
            15,
            "Killed",
        );
        check(
            facts(Running, true, false, Some(137), true),
            State::Exited,
            137,
            9,
            "OOMKilled",
        );
        check(
            facts(Running, true, false, None, true),
            State::Exited,
            0,
            9,
            "OOMKilled",
        );
        check(
            facts(Running, true, false, None, false),
            State::Exited,
            0,
            0,
            "Lost",
        );
        check(
            facts(Running, false, false, None, false),
            State::Stopped,
            0,
            0,
            "NotStarted",
        );
        check(
            facts(Stopped, true, false, Some(143), false),
            State::Stopped,
            0,
            0,
            "",
        );
        check(
            facts(Stopped, false, false, None, false),
            State::Stopped,
            0,
            0,
            "",
        );
        check(
            facts(Stopped, true, true, None, false),
            State::Stopping,
            0,
            0,
            "Stopping",
        );
    }

    #[test]
    fn signal_statuses() {
        assert_eq!(signal_of_status(128), None);
        assert_eq!(signal_of_status(129), Some(1));
        assert_eq!(signal_of_status(137), Some(9));
        assert_eq!(signal_of_status(192), Some(64));
        assert_eq!(signal_of_status(193), None);
        assert_eq!(signal_of_status(1), None);
    }
}
