//! The sandbox lifecycle as pure data: given what the record says and what the driver
//! observes, what is the next step? No IO, no tokio — tested exhaustively below.

use sbx_proto::driver::{self as pb, State};
use sbx_proto::v1::{DesiredState, Phase};

/// What the driver says about one sandbox, reduced to what the plan needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observed {
    /// The driver knows no sandbox with this id.
    Absent,
    Running {
        generation: u64,
    },
    Stopped,
    /// The driver is stopping the workload; processes of it still run.
    Stopping,
    /// The main process ended by itself.
    Exited(Exit),
    /// The workload's processes and memory are saved on the driver's disk; none runs.
    Paused {
        generation: u64,
    },
}

/// How a workload's main process ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exit {
    pub generation: u64,
    pub code: i32,
    pub signal: i32,
    /// The driver's reason, e.g. "OOMKilled"; empty when it has none.
    pub reason: String,
    pub message: String,
}

impl Observed {
    pub fn from_snapshot(s: &pb::Snapshot) -> Observed {
        match s.state() {
            State::Running => Observed::Running {
                generation: s.generation,
            },
            State::Exited => Observed::Exited(Exit {
                generation: s.generation,
                code: s.exit_code,
                signal: s.exit_signal,
                reason: s.reason.clone(),
                message: s.message.clone(),
            }),
            State::Stopping => Observed::Stopping,
            State::Paused => Observed::Paused {
                generation: s.generation,
            },
            State::Stopped | State::Unspecified => Observed::Stopped,
        }
    }
}

/// What the sandbox record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Current {
    pub desired: DesiredState,
    pub phase: Phase,
    pub generation: u64,
    /// The record holds the current run's own end (an exit was observed and recorded), not a
    /// failed step.
    pub exited: bool,
}

/// A phase to record, with its reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PhaseChange {
    pub phase: Phase,
    pub reason: String,
    pub message: String,
    /// A new desired state, when the observation changes what is wanted (a workload that
    /// exited by itself is no longer wanted running).
    pub desired: Option<DesiredState>,
    /// The main process's exit code and signal, when the change records its own end.
    pub exit: Option<(i32, i32)>,
}

/// The next step towards the desired state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// The record already tells the truth.
    Settled,
    /// Record what was observed; no driver call.
    Record(PhaseChange),
    /// Persist `generation` (the intent), then create the workload under it.
    Create { generation: u64 },
    /// Persist `generation`, then make the sandbox in the driver without starting it (a
    /// sandbox created stopped, or stopped before its driver had made it): its files exist
    /// for a copy before the first start.
    Prepare { generation: u64 },
    /// Persist `generation` (the intent), then start the workload under it.
    Start { generation: u64 },
    /// Persist Stopping, then stop the workload.
    Stop,
    /// Persist Deleting, then delete the workload and the record.
    Delete,
    /// A freshly started actor found the workload running (or, wanted paused, paused) under
    /// another generation: take it over as it is, persisting the driver's generation.
    Adopt { generation: u64 },
    /// A long-lived actor found the workload running under another generation: its view is
    /// stale. The actor fails; its supervisor restarts it from the record, and the fresh actor
    /// adopts.
    Drift { persisted: u64, running: u64 },
    /// Persist Pausing, then save the workload's processes and memory (driver `pause`).
    Pause,
    /// Persist Starting (reason Resuming), then bring the paused workload back under its own
    /// generation (driver `resume`).
    Resume,
}

/// Whether the record holds a start intent not yet confirmed by the driver.
fn start_pending(phase: Phase) -> bool {
    matches!(phase, Phase::Provisioning | Phase::Starting)
}

/// The generation for the next start: the pending intent's own, or a fresh one.
fn next_generation(cur: &Current) -> u64 {
    if start_pending(cur.phase) && cur.generation > 0 {
        cur.generation
    } else {
        cur.generation + 1
    }
}

/// The phase change that records a workload's own exit.
pub fn exit_change(exit: &Exit) -> PhaseChange {
    let (phase, reason, message) = if exit.code == 0 && exit.signal == 0 {
        (
            Phase::Completed,
            "Completed".to_string(),
            "main process exited with status 0".to_string(),
        )
    } else if exit.signal != 0 {
        (
            Phase::Error,
            "Signaled".to_string(),
            format!("main process was killed by signal {}", exit.signal),
        )
    } else {
        (
            Phase::Error,
            "ExitedNonZero".to_string(),
            format!("main process exited with status {}", exit.code),
        )
    };
    let reason = if exit.reason.is_empty() {
        reason
    } else {
        exit.reason.clone()
    };
    // The driver's words, without what they only restate: the host drivers say "the main
    // process exited with code N" (alone, or after what they add) for the same exit.
    let mut extra = exit.message.clone();
    for restated in [
        format!("the main process exited with code {}", exit.code),
        format!("the main process was killed by signal {}", exit.signal),
    ] {
        extra = extra.replace(&format!(" ({restated})"), "");
        if extra.trim() == restated {
            extra.clear();
        }
    }
    let message = if extra.trim().is_empty() {
        message
    } else {
        format!("{message}: {extra}")
    };
    PhaseChange {
        phase,
        reason,
        message,
        desired: Some(DesiredState::Stopped),
        exit: Some((if exit.signal != 0 { -1 } else { exit.code }, exit.signal)),
    }
}

fn record(phase: Phase, reason: &str, message: &str) -> Step {
    Step::Record(PhaseChange {
        phase,
        reason: reason.into(),
        message: message.into(),
        desired: None,
        exit: None,
    })
}

/// A workload the driver holds under another generation than the record's: a fresh actor
/// adopts it; a long-lived one fails, so that its supervisor starts a fresh one that does.
fn drifted(cur: &Current, generation: u64, fresh: bool) -> Step {
    if fresh {
        Step::Adopt { generation }
    } else {
        Step::Drift {
            persisted: cur.generation,
            running: generation,
        }
    }
}

/// The next step for a sandbox. `fresh` is true for the first look of a newly (re)started
/// actor, which adopts a drifted workload instead of failing.
pub fn plan(cur: &Current, obs: &Observed, fresh: bool) -> Step {
    match cur.desired {
        DesiredState::Deleted => Step::Delete,
        DesiredState::Stopped => match obs {
            // The run whose end the record holds, seen running: a look from before its exit,
            // delivered after it (a sweep's list after the watch's exit). A new run would
            // carry a new generation. Stopping it would be a stop nobody asked for.
            Observed::Running { generation } if cur.exited && *generation == cur.generation => {
                Step::Settled
            }
            // A stop under way (this actor's, cut short, or a restarted driver's) ends with
            // this one, which queues behind it.
            Observed::Running { .. } | Observed::Stopping => Step::Stop,
            Observed::Exited(exit) => {
                if matches!(cur.phase, Phase::Completed | Phase::Error) {
                    Step::Settled
                } else {
                    Step::Record(exit_change(exit))
                }
            }
            // A stop of a paused workload discards what was saved.
            Observed::Paused { .. } => Step::Stop,
            // Never made in the driver: made now, not started.
            Observed::Absent if cur.phase == Phase::Provisioning => Step::Prepare {
                generation: next_generation(cur),
            },
            // An Error here came from a failed step (an exit would still be observed as
            // Exited): the driver now says the workload is down, which is what was wanted.
            Observed::Absent | Observed::Stopped => {
                if matches!(cur.phase, Phase::Stopped | Phase::Completed) {
                    Step::Settled
                } else {
                    record(Phase::Stopped, "", "")
                }
            }
        },
        DesiredState::Paused => match obs {
            Observed::Running { .. } => Step::Pause,
            // Saved under another generation (a driver that forgot its generations): taken
            // over as it is, as a running one would be, so the record says what the driver
            // holds and a resume brings back what the record names.
            Observed::Paused { generation } if *generation != cur.generation => {
                drifted(cur, *generation, fresh)
            }
            Observed::Paused { .. } => {
                if cur.phase == Phase::Paused {
                    Step::Settled
                } else {
                    // The reason the pause was asked for stays (see `PhaseChange::keeps_reason`).
                    record(Phase::Paused, "", "")
                }
            }
            // A stop under way finishes; what is stopped cannot be paused: it stays stopped.
            Observed::Stopping => Step::Stop,
            Observed::Exited(exit) => Step::Record(exit_change(exit)),
            Observed::Stopped | Observed::Absent => Step::Record(PhaseChange {
                phase: Phase::Stopped,
                reason: String::new(),
                message: "the workload was not running, so there was nothing to pause".into(),
                desired: Some(DesiredState::Stopped),
                exit: None,
            }),
        },
        DesiredState::Running | DesiredState::Unspecified => match obs {
            // The same processes come back, under their own generation.
            Observed::Paused { .. } => Step::Resume,
            Observed::Absent => Step::Create {
                generation: next_generation(cur),
            },
            // The driver is stopping the workload (a stop this actor asked for before a start
            // came): it is not Ready, whatever runs now. The start queues behind the stop.
            Observed::Stopped | Observed::Stopping => Step::Start {
                generation: next_generation(cur),
            },
            Observed::Running { generation } if *generation == cur.generation => {
                if cur.phase == Phase::Ready {
                    Step::Settled
                } else {
                    record(Phase::Ready, "", "")
                }
            }
            Observed::Running { generation } => drifted(cur, *generation, fresh),
            Observed::Exited(exit) => {
                if start_pending(cur.phase) && exit.generation != cur.generation {
                    // An old run ended; the start the user asked for has not happened yet.
                    Step::Start {
                        generation: next_generation(cur),
                    }
                } else if exit.generation != 0 && exit.generation < cur.generation {
                    // The end of a run older than the one the record has seen start: an
                    // observation made before that start and delivered after it. Recording it
                    // would end the current run's wish to run (desired Stopped) and the next
                    // look would stop a workload nobody asked to stop. (Generation 0: a driver
                    // that forgot its generations; its exit is taken as it comes.)
                    Step::Settled
                } else {
                    Step::Record(exit_change(exit))
                }
            }
        },
    }
}

/// Whether a phase is one the sandbox passes through on its way somewhere else.
pub fn is_transitional(phase: Phase) -> bool {
    matches!(
        phase,
        Phase::Provisioning
            | Phase::Starting
            | Phase::Stopping
            | Phase::Deleting
            | Phase::Pausing
            | Phase::Unspecified
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cur(desired: DesiredState, phase: Phase, generation: u64) -> Current {
        Current {
            desired,
            phase,
            generation,
            exited: false,
        }
    }

    fn exited(phase: Phase, generation: u64) -> Current {
        Current {
            exited: true,
            ..cur(D::Stopped, phase, generation)
        }
    }

    fn exit(generation: u64, code: i32, signal: i32) -> Observed {
        Observed::Exited(Exit {
            generation,
            code,
            signal,
            reason: String::new(),
            message: String::new(),
        })
    }

    fn check(c: Current, obs: Observed, fresh: bool, expected: Step) {
        assert_eq!(
            plan(&c, &obs, fresh),
            expected,
            "current {c:?}, observed {obs:?}, fresh {fresh}"
        );
    }

    use DesiredState as D;
    use Phase as P;

    #[test]
    fn running_sandbox_that_matches_is_settled_or_marked_ready() {
        check(
            cur(D::Running, P::Ready, 3),
            Observed::Running { generation: 3 },
            false,
            Step::Settled,
        );
        check(
            cur(D::Running, P::Ready, 3),
            Observed::Running { generation: 3 },
            true,
            Step::Settled,
        );
        for phase in [P::Provisioning, P::Starting, P::Error, P::Stopped] {
            check(
                cur(D::Running, phase, 3),
                Observed::Running { generation: 3 },
                false,
                record(P::Ready, "", ""),
            );
        }
    }

    /// A workload the driver is stopping is never recorded Ready (the chaos run once saw a
    /// Ready sandbox whose driver wanted it stopped; the driver's restart finished the stop and
    /// the workload was gone): a wanted run starts again behind the stop, a wanted stop waits
    /// for it.
    /// An exit of an older run, observed before a start and delivered after it, is not the
    /// current run's end (the in-process soak once saw the driver asked to stop a sandbox
    /// no client had asked to stop: the stale exit had set desired Stopped).
    #[test]
    fn the_exit_of_an_older_run_does_not_end_the_current_one() {
        let old = |generation| {
            Observed::Exited(Exit {
                generation,
                code: 0,
                signal: 0,
                reason: String::new(),
                message: String::new(),
            })
        };
        for fresh in [true, false] {
            check(cur(D::Running, P::Ready, 5), old(4), fresh, Step::Settled);
            // The current run's own exit is recorded, and so is one of a driver that forgot
            // its generations.
            for generation in [5, 0] {
                let step = plan(&cur(D::Running, P::Ready, 5), &old(generation), fresh);
                assert!(
                    matches!(&step, Step::Record(c) if c.desired == Some(DesiredState::Stopped)),
                    "generation {generation}: {step:?}"
                );
            }
            // A start not yet confirmed is still made.
            check(
                cur(D::Running, P::Starting, 5),
                old(4),
                fresh,
                Step::Start { generation: 5 },
            );
        }
    }

    /// A run the record saw end by itself, seen running again under its generation, is a look
    /// from before its exit: not stopped (a stop nobody asked for — the in-process soak's seed
    /// 463). Under another generation, or after a failed step (not an exit), it is stopped.
    #[test]
    fn a_stale_look_at_an_exited_run_does_not_stop_it() {
        for fresh in [true, false] {
            for phase in [P::Completed, P::Error] {
                check(
                    exited(phase, 5),
                    Observed::Running { generation: 5 },
                    fresh,
                    Step::Settled,
                );
                check(
                    exited(phase, 5),
                    Observed::Running { generation: 6 },
                    fresh,
                    Step::Stop,
                );
            }
            check(
                cur(D::Stopped, P::Error, 5),
                Observed::Running { generation: 5 },
                fresh,
                Step::Stop,
            );
        }
    }

    #[test]
    fn a_workload_being_stopped_is_not_ready() {
        for phase in [P::Ready, P::Starting, P::Stopping, P::Error] {
            for fresh in [true, false] {
                check(
                    cur(D::Running, phase, 3),
                    Observed::Stopping,
                    fresh,
                    Step::Start {
                        generation: if phase == P::Starting { 3 } else { 4 },
                    },
                );
                check(
                    cur(D::Stopped, phase, 3),
                    Observed::Stopping,
                    fresh,
                    Step::Stop,
                );
            }
        }
        assert_eq!(
            Observed::from_snapshot(&pb::Snapshot {
                state: State::Stopping as i32,
                generation: 3,
                ..Default::default()
            }),
            Observed::Stopping
        );
    }

    #[test]
    fn generation_drift_adopts_when_fresh_and_fails_otherwise() {
        for phase in [P::Ready, P::Starting, P::Error, P::Provisioning] {
            check(
                cur(D::Running, phase, 3),
                Observed::Running { generation: 9 },
                true,
                Step::Adopt { generation: 9 },
            );
            check(
                cur(D::Running, phase, 3),
                Observed::Running { generation: 9 },
                false,
                Step::Drift {
                    persisted: 3,
                    running: 9,
                },
            );
        }
        // Drift is never recorded as Error.
        for fresh in [true, false] {
            let step = plan(
                &cur(D::Running, P::Ready, 3),
                &Observed::Running { generation: 0 },
                fresh,
            );
            assert!(
                !matches!(
                    step,
                    Step::Record(PhaseChange {
                        phase: P::Error,
                        ..
                    })
                ),
                "{step:?}"
            );
        }
    }

    #[test]
    fn pending_start_intent_reuses_its_generation() {
        check(
            cur(D::Running, P::Provisioning, 1),
            Observed::Absent,
            false,
            Step::Create { generation: 1 },
        );
        check(
            cur(D::Running, P::Starting, 4),
            Observed::Stopped,
            false,
            Step::Start { generation: 4 },
        );
        check(
            cur(D::Running, P::Starting, 4),
            Observed::Absent,
            true,
            Step::Create { generation: 4 },
        );
    }

    #[test]
    fn settled_sandbox_gets_a_fresh_generation() {
        for phase in [P::Ready, P::Error, P::Stopped, P::Stopping, P::Completed] {
            check(
                cur(D::Running, phase, 4),
                Observed::Stopped,
                false,
                Step::Start { generation: 5 },
            );
            check(
                cur(D::Running, phase, 4),
                Observed::Absent,
                false,
                Step::Create { generation: 5 },
            );
        }
    }

    #[test]
    fn stop_wanted() {
        check(
            cur(D::Stopped, P::Stopping, 2),
            Observed::Running { generation: 2 },
            false,
            Step::Stop,
        );
        check(
            cur(D::Stopped, P::Ready, 2),
            Observed::Running { generation: 7 },
            false,
            Step::Stop,
        );
        check(
            cur(D::Stopped, P::Stopping, 2),
            Observed::Stopped,
            false,
            record(P::Stopped, "", ""),
        );
        check(
            cur(D::Stopped, P::Stopping, 2),
            Observed::Absent,
            false,
            record(P::Stopped, "", ""),
        );
        check(
            cur(D::Stopped, P::Stopped, 2),
            Observed::Stopped,
            false,
            Step::Settled,
        );
        check(
            cur(D::Stopped, P::Completed, 2),
            Observed::Stopped,
            false,
            Step::Settled,
        );
        check(
            cur(D::Stopped, P::Completed, 2),
            exit(2, 0, 0),
            false,
            Step::Settled,
        );
        check(
            cur(D::Stopped, P::Stopping, 2),
            exit(2, 1, 0),
            false,
            Step::Record(exit_change(&Exit {
                generation: 2,
                code: 1,
                signal: 0,
                reason: String::new(),
                message: String::new(),
            })),
        );
    }

    #[test]
    fn delete_wanted_always_deletes() {
        for obs in [
            Observed::Absent,
            Observed::Stopped,
            Observed::Running { generation: 1 },
            exit(1, 0, 0),
        ] {
            for fresh in [true, false] {
                check(
                    cur(D::Deleted, P::Deleting, 1),
                    obs.clone(),
                    fresh,
                    Step::Delete,
                );
            }
        }
    }

    #[test]
    fn exits_are_recorded_with_their_status_and_stop_being_wanted() {
        let Step::Record(change) = plan(&cur(D::Running, P::Ready, 2), &exit(2, 0, 0), false)
        else {
            panic!("expected a record step")
        };
        assert_eq!(
            (change.phase, change.reason.as_str()),
            (P::Completed, "Completed")
        );
        assert_eq!(change.desired, Some(D::Stopped));

        let Step::Record(change) = plan(&cur(D::Running, P::Ready, 2), &exit(2, 3, 0), false)
        else {
            panic!("expected a record step")
        };
        assert_eq!(
            (change.phase, change.reason.as_str()),
            (P::Error, "ExitedNonZero")
        );
        assert!(change.message.contains("status 3"), "{}", change.message);

        let oom = Observed::Exited(Exit {
            generation: 2,
            code: 137,
            signal: 9,
            reason: "OOMKilled".into(),
            message: "memory limit 64 MiB".into(),
        });
        let Step::Record(change) = plan(&cur(D::Running, P::Ready, 2), &oom, false) else {
            panic!("expected a record step")
        };
        assert_eq!(
            (change.phase, change.reason.as_str()),
            (P::Error, "OOMKilled")
        );
        assert!(
            change.message.contains("signal 9") && change.message.contains("64 MiB"),
            "{}",
            change.message
        );
    }

    #[test]
    fn a_sandbox_wanted_stopped_is_made_in_the_driver_once_and_not_started() {
        // Created stopped (or stopped before the driver made it): made, not started.
        check(
            cur(D::Stopped, P::Provisioning, 1),
            Observed::Absent,
            false,
            Step::Prepare { generation: 1 },
        );
        // Made: recorded Stopped, never started.
        check(
            cur(D::Stopped, P::Provisioning, 1),
            Observed::Stopped,
            false,
            record(P::Stopped, "", ""),
        );
        // A stopped sandbox the driver lost is not made again until it is started.
        check(
            cur(D::Stopped, P::Stopped, 2),
            Observed::Absent,
            false,
            Step::Settled,
        );
        // The first start of a sandbox made stopped takes a new generation.
        check(
            cur(D::Running, P::Stopped, 1),
            Observed::Stopped,
            false,
            Step::Start { generation: 2 },
        );
    }

    #[test]
    fn pause_and_resume_are_planned_from_what_the_driver_says() {
        let paused = Observed::Paused { generation: 3 };
        for fresh in [true, false] {
            // Wanted paused: a running workload is paused, a paused one recorded once.
            check(
                cur(D::Paused, P::Pausing, 3),
                Observed::Running { generation: 3 },
                fresh,
                Step::Pause,
            );
            check(
                cur(D::Paused, P::Pausing, 3),
                paused.clone(),
                fresh,
                record(P::Paused, "", ""),
            );
            check(
                cur(D::Paused, P::Paused, 3),
                paused.clone(),
                fresh,
                Step::Settled,
            );
            // Saved under another generation (the driver forgot its own): a fresh actor
            // adopts it, a long-lived one fails so that a fresh one does.
            let other = Observed::Paused { generation: 0 };
            let expected = if fresh {
                Step::Adopt { generation: 0 }
            } else {
                Step::Drift {
                    persisted: 3,
                    running: 0,
                }
            };
            for phase in [P::Pausing, P::Paused] {
                check(
                    cur(D::Paused, phase, 3),
                    other.clone(),
                    fresh,
                    expected.clone(),
                );
            }
            // Wanted running: the paused workload is resumed, never made again.
            for phase in [P::Paused, P::Starting, P::Error] {
                check(
                    cur(D::Running, phase, 3),
                    paused.clone(),
                    fresh,
                    Step::Resume,
                );
            }
            // Wanted stopped or deleted: what was saved is discarded.
            check(
                cur(D::Stopped, P::Paused, 3),
                paused.clone(),
                fresh,
                Step::Stop,
            );
            check(
                cur(D::Deleted, P::Paused, 3),
                paused.clone(),
                fresh,
                Step::Delete,
            );
            // A workload that is not running cannot be paused: it is recorded as it is, and
            // stopped is what is wanted from then on.
            for obs in [Observed::Stopped, Observed::Absent] {
                let step = plan(&cur(D::Paused, P::Pausing, 3), &obs, fresh);
                assert!(
                    matches!(&step, Step::Record(c) if c.phase == P::Stopped && c.desired == Some(D::Stopped)),
                    "{obs:?}: {step:?}"
                );
            }
            let step = plan(&cur(D::Paused, P::Pausing, 3), &exit(3, 0, 0), fresh);
            assert!(
                matches!(&step, Step::Record(c) if c.phase == P::Completed && c.desired == Some(D::Stopped)),
                "{step:?}"
            );
        }
        assert_eq!(
            Observed::from_snapshot(&pb::Snapshot {
                state: State::Paused as i32,
                generation: 3,
                ..Default::default()
            }),
            paused
        );
    }

    #[test]
    fn an_old_runs_exit_does_not_cancel_a_pending_start() {
        check(
            cur(D::Running, P::Starting, 5),
            exit(4, 1, 0),
            false,
            Step::Start { generation: 5 },
        );
    }

    #[test]
    fn every_combination_has_a_step_and_error_is_never_a_dead_end() {
        let phases = [
            P::Provisioning,
            P::Ready,
            P::Stopping,
            P::Stopped,
            P::Starting,
            P::Deleting,
            P::Error,
            P::Completed,
            P::Paused,
            P::Pausing,
        ];
        let observations = [
            Observed::Paused { generation: 1 },
            Observed::Absent,
            Observed::Stopped,
            Observed::Running { generation: 1 },
            Observed::Running { generation: 2 },
            exit(1, 0, 0),
            exit(1, 2, 0),
        ];
        for desired in [D::Running, D::Stopped, D::Deleted, D::Paused] {
            for phase in phases {
                for obs in &observations {
                    for fresh in [true, false] {
                        let step = plan(&cur(desired, phase, 1), obs, fresh);
                        if desired == D::Running && phase == P::Error {
                            // A sandbox in Error that should run is always acted upon or
                            // recognised as running: never left as it is.
                            assert_ne!(step, Step::Settled, "{obs:?}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn an_exit_is_told_once_with_what_the_driver_adds() {
        let with = |code: i32, signal: i32, message: &str| {
            exit_change(&Exit {
                generation: 1,
                code,
                signal,
                reason: String::new(),
                message: message.to_string(),
            })
            .message
        };
        assert_eq!(
            with(3, 0, "the main process exited with code 3"),
            "main process exited with status 3"
        );
        assert_eq!(
            with(
                127,
                0,
                "command not found: nosuch (the main process exited with code 127)"
            ),
            "main process exited with status 127: command not found: nosuch"
        );
        assert_eq!(
            with(-1, 9, "the main process was killed by signal 9"),
            "main process was killed by signal 9"
        );
        // What only the driver knows stays; a different code is not a restatement.
        assert_eq!(
            with(3, 0, "the main process exited with code 4"),
            "main process exited with status 3: the main process exited with code 4"
        );
        assert_eq!(
            with(1, 0, "disk full"),
            "main process exited with status 1: disk full"
        );
        assert_eq!(with(2, 0, ""), "main process exited with status 2");
    }
}
