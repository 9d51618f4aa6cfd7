//! Pause and resume: the cgroup freezer (`runc pause`, `runc resume`). A paused sandbox's
//! processes stay where they are, in memory, stopped by the kernel: none is scheduled (no CPU
//! at all), every one keeps its pid, its open files and sockets and its memory, which stays
//! resident (the freezer saves nothing to disk: a paused sandbox holds its RAM until it is
//! resumed or stopped). A resume lets them go on; it takes a runtime call (~10 ms), whatever
//! the sandbox's size (see `docs/BENCHMARKS.md`). Their clocks do not stop: a process sees the
//! time it was paused pass at once.
//!
//! **The kernel is the record.** The sandbox is paused when its cgroup is `FROZEN` — the very
//! state `runc` reads for its `paused` status — and nothing else records it: the snapshot
//! reads the freezer, so a driver restarted, or a gateway killed at any point of a pause or a
//! resume, finds the sandbox as the kernel has it. A runtime call cut short (its driver
//! SIGKILLed) runs on to its end as an orphan, and runc's freeze ends `FROZEN` or thawed again
//! (it thaws a freeze it gives up on). What may be left half done is a freeze whose runc was
//! itself killed mid-way: `FREEZING`, some processes frozen and others not, which runc then
//! waits on for ever. Open thaws it ([`settle_at_open`]): the sandbox runs on, and a pause
//! asked again pauses it. A pause or a resume that finds it does the same first.
//!
//! **Stop and delete** of a paused sandbox thaw it first, then stop it as any other: the
//! workload gets its SIGTERM and its grace period (runc 1.1.5's `kill` and `delete --force`
//! also end a frozen container, but with no grace: SIGKILL). **Exec, copies and port
//! forwarding** are refused while it is paused (FailedPrecondition, as the vm driver's): its
//! agent is frozen with the rest and would not answer.

use std::time::Instant;

use sbx_driver_api::{DriverError, parse_sandbox_id, pb};
use sbx_host_kit::{Desired, HostDriver, feed};

use super::Inner;
use super::cgroup::{self, Freezer};
use super::record::OciRecord;

/// The refusal of a pause or resume of a sandbox in the wrong state, naming it.
fn not_in_state(id: uuid::Uuid, snapshot: &pb::Snapshot, only: &str) -> DriverError {
    let state = pb::State::try_from(snapshot.state).unwrap_or(pb::State::Unspecified);
    DriverError::FailedPrecondition(format!("sandbox {id} is {}; {only}", state.as_str_name()))
}

fn state_of(snapshot: &pb::Snapshot) -> pb::State {
    pb::State::try_from(snapshot.state).unwrap_or(pb::State::Unspecified)
}

impl Inner {
    /// The freezer's state of the sandbox's cgroup; thawed when it has none (no workload).
    pub(super) fn freezer(&self, record: &OciRecord) -> Freezer {
        cgroup::freezer(&record.cgroup_path).unwrap_or(Freezer::Thawed)
    }

    /// FailedPrecondition when the sandbox is meant to run and its cgroup is frozen (or being
    /// frozen): `what` (exec, copying files, port forwarding) needs its agent, which is too.
    pub(super) fn refuse_if_paused(&self, sandbox_id: &str, what: &str) -> Result<(), DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let record = self.records.require(id)?;
        if record.desired == Desired::Running && self.freezer(&record) != Freezer::Thawed {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is paused; {what} needs a running workload (resume it first)"
            )));
        }
        Ok(())
    }

    /// Freezes a running sandbox (see the module docs). Paused: nothing to do. A pause that
    /// fails leaves it running.
    pub(super) async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let _serialised = self.records.lock(id).await;
        let record = self.records.require(id)?;
        let snapshot = self.snapshot(&record);
        match state_of(&snapshot) {
            pb::State::Paused => return Ok(snapshot),
            pb::State::Running => {}
            _ => {
                return Err(not_in_state(
                    id,
                    &snapshot,
                    "only a running sandbox can be paused",
                ));
            }
        }
        // runc waits for a freeze left half done to settle (for ever): thawed first.
        if self.freezer(&record) == Freezer::Freezing {
            thaw_half_done(&record);
        }
        let began = Instant::now();
        let paused = self.runtime.pause(&id.to_string()).await;
        let frozen = self.freezer(&record) == Freezer::Frozen;
        if paused.is_err() || !frozen {
            // runc thaws a freeze it gave up on; whatever is left is thawed here.
            let thawed = self.thaw(&record).await;
            let now = self.snapshot(&record);
            if state_of(&now) != pb::State::Running {
                return Err(not_in_state(
                    id,
                    &now,
                    "only a running sandbox can be paused",
                ));
            }
            let why = match paused {
                Err(e) => e.to_string(),
                Ok(()) => "the runtime said paused, but the cgroup is not frozen".to_string(),
            };
            return Err(DriverError::Internal(match thawed {
                Ok(()) => format!("pausing sandbox {id}: {why}; its workload runs on"),
                Err(e) => format!("pausing sandbox {id}: {why}; and thawing it again: {e}"),
            }));
        }
        tracing::info!(sandbox_id = %id, took = ?began.elapsed(), "sandbox paused (frozen)");
        let snapshot = self.snapshot(&record);
        feed::publish(self, id, &snapshot);
        Ok(snapshot)
    }

    /// Thaws a paused sandbox. Running (and thawed): nothing to do.
    pub(super) async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let _serialised = self.records.lock(id).await;
        let record = self.records.require(id)?;
        let snapshot = self.snapshot(&record);
        match (state_of(&snapshot), self.freezer(&record)) {
            (pb::State::Running, Freezer::Thawed) => return Ok(snapshot),
            // Paused, or a freeze left half done (reported running: some of it runs).
            (pb::State::Paused | pb::State::Running, _) => {}
            _ => {
                return Err(not_in_state(
                    id,
                    &snapshot,
                    "only a paused sandbox can be resumed",
                ));
            }
        }
        let began = Instant::now();
        self.thaw(&record).await.map_err(|e| {
            DriverError::Internal(format!(
                "resuming sandbox {id}: {e}; it stays paused (a resume tries again)"
            ))
        })?;
        tracing::info!(sandbox_id = %id, took = ?began.elapsed(), "sandbox resumed (thawed)");
        let snapshot = self.snapshot(&record);
        feed::publish(self, id, &snapshot);
        Ok(snapshot)
    }

    /// Thaws the sandbox's cgroup if it is frozen (`runc resume`) or half frozen (its freezer
    /// file written: runc cannot); then checks that it is thawed.
    pub(super) async fn thaw(&self, record: &OciRecord) -> Result<(), String> {
        match self.freezer(record) {
            Freezer::Thawed => return Ok(()),
            Freezer::Frozen => {
                if let Err(e) = self.runtime.resume(&record.sandbox_id.to_string()).await {
                    tracing::warn!(sandbox_id = %record.sandbox_id, error = %e, "runc resume failed; thawing the cgroup itself");
                    thaw_half_done(record);
                }
            }
            Freezer::Freezing => thaw_half_done(record),
        }
        match self.freezer(record) {
            Freezer::Thawed => Ok(()),
            left => Err(format!(
                "the cgroup {} is still {left:?} after a thaw",
                record.cgroup_path
            )),
        }
    }
}

/// Thaws a cgroup by its freezer file (see [`cgroup::thaw`]); a failure is logged (the
/// caller reads the state back).
fn thaw_half_done(record: &OciRecord) {
    tracing::warn!(sandbox_id = %record.sandbox_id, cgroup = %record.cgroup_path, "thawing a freeze left half done");
    if let Err(e) = cgroup::thaw(&record.cgroup_path) {
        tracing::error!(sandbox_id = %record.sandbox_id, error = %e, "the cgroup could not be thawed");
    }
}

/// At open, for a record read back: what an interrupted pause, resume or stop left in the
/// freezer, made whole. The kernel's state is the sandbox's (see the module docs):
/// - `FROZEN`, meant to run: the sandbox is paused, and stays so.
/// - `FREEZING` (a freeze whose runtime was killed half way): thawed; it runs on.
/// - Frozen or half frozen, meant to be stopped (a stop of a paused sandbox cut short):
///   thawed, so that the stop the caller finishes ends it.
pub(super) fn settle_at_open(record: &OciRecord) {
    let Some(state) = cgroup::freezer(&record.cgroup_path) else {
        return;
    };
    match (action_at_open(record.desired, state), state) {
        (AtOpen::Thaw, _) => thaw_half_done(record),
        (AtOpen::Keep, Freezer::Frozen) => {
            tracing::info!(sandbox_id = %record.sandbox_id, "found the sandbox paused (its cgroup frozen)");
        }
        (AtOpen::Keep, _) => {}
    }
}

/// What open does with a sandbox whose cgroup is in `state`, meant to be `desired`.
#[derive(Debug, PartialEq, Eq)]
enum AtOpen {
    Keep,
    Thaw,
}

fn action_at_open(desired: Desired, state: Freezer) -> AtOpen {
    match (desired, state) {
        (_, Freezer::Thawed) => AtOpen::Keep,
        (Desired::Running, Freezer::Frozen) => AtOpen::Keep,
        (Desired::Running, Freezer::Freezing) => AtOpen::Thaw,
        (Desired::Stopped, _) => AtOpen::Thaw,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Never half frozen after open: a freeze left FREEZING is undone, a frozen sandbox meant
    /// to run stays paused, one meant to stop is thawed for its stop.
    #[test]
    fn open_settles_what_an_interrupted_pause_left() {
        use Freezer::*;
        for (desired, state, action) in [
            (Desired::Running, Thawed, AtOpen::Keep),
            (Desired::Running, Frozen, AtOpen::Keep),
            (Desired::Running, Freezing, AtOpen::Thaw),
            (Desired::Stopped, Thawed, AtOpen::Keep),
            (Desired::Stopped, Frozen, AtOpen::Thaw),
            (Desired::Stopped, Freezing, AtOpen::Thaw),
        ] {
            assert_eq!(
                action_at_open(desired, state),
                action,
                "{desired:?} {state:?}"
            );
        }
    }
}
