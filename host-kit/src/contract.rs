//! The driver contract's rules for a create or start that finds the sandbox already known,
//! shared by the drivers that keep records (oci, process, vm). Pure: the drivers observe, this
//! decides.

use sbx_driver_api::{DriverError, pb};

/// What a create or start of a known sandbox does.
#[derive(Debug)]
// Short-lived and returned by value once per call: boxing the snapshot would buy nothing.
#[allow(clippy::large_enum_variant)]
pub enum Known {
    /// Nothing: answer with the sandbox as it is.
    Answer(pb::Snapshot),
    /// End whatever is left of an earlier run and launch a new one.
    Launch,
}

/// A create of a sandbox the driver already has: the same id must carry the same workspace
/// and name; a retry under the same generation answers as is (unless its launch never
/// completed); a running workload under another generation is a mismatch; otherwise launch.
pub fn known_create(
    known: (&str, &str),
    asked: (&str, &str),
    generation: u64,
    snapshot: pb::Snapshot,
    wants_running: bool,
) -> Result<Known, DriverError> {
    if known != asked {
        return Err(DriverError::FailedPrecondition(format!(
            "sandbox {} exists as {}/{}, not {}/{}",
            snapshot.sandbox_id, known.0, known.1, asked.0, asked.1
        )));
    }
    if snapshot.generation == generation && snapshot.reason != "NotStarted" {
        return Ok(Known::Answer(snapshot));
    }
    running_under(snapshot, wants_running, generation).map(|_| Known::Launch)
}

/// A start: a workload running under the same generation answers as is, under another one is
/// a mismatch; anything else launches.
pub fn known_start(
    snapshot: pb::Snapshot,
    wants_running: bool,
    generation: u64,
) -> Result<Known, DriverError> {
    match running_under(snapshot, wants_running, generation)? {
        Some(snapshot) => Ok(Known::Answer(snapshot)),
        None => Ok(Known::Launch),
    }
}

/// `Some` when the workload runs (and is meant to) under `generation`; a mismatch when it runs
/// under another; `None` when it does not run.
fn running_under(
    snapshot: pb::Snapshot,
    wants_running: bool,
    generation: u64,
) -> Result<Option<pb::Snapshot>, DriverError> {
    if snapshot.state != pb::State::Running as i32 || !wants_running {
        return Ok(None);
    }
    if snapshot.generation == generation {
        return Ok(Some(snapshot));
    }
    Err(DriverError::GenerationMismatch {
        sandbox_id: snapshot.sandbox_id,
        running: snapshot.generation,
        requested: generation,
    })
}
