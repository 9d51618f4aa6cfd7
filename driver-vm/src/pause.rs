//! Pause and resume: a VM's state (its RAM and devices, QEMU's migration stream) saved to the
//! file `memory` in the sandbox's directory and its QEMU ended; later a QEMU launched with the
//! same arguments, stopped and waiting for an incoming migration, loads the file and goes on
//! (`cont`). The guest does not notice but for its clock; its processes, their pids, open
//! files, sockets and the agents reading their virtio ports are as they were.
//!
//! **Pause**: QMP `stop`, `migrate` to `memory.part` (its descriptor passed with `getfd`: QEMU
//! 7.2 has no `file:` migration, and an `exec:` helper's end cannot be told from QEMU's),
//! polled until `completed`; fsync, rename to `memory`, the record says paused (durably), then
//! QMP `quit`. A save that fails is cancelled and the VM goes on (`cont`). **Resume**: QEMU
//! launched with `-S -incoming defer`, `migrate-incoming` from `memory`, the record says
//! running with the new QEMU, `cont`, `memory` removed. A resume that fails ends the new QEMU
//! and keeps the file: the sandbox stays paused. The record is written before `cont` because
//! once the guest runs it writes its disk, and the saved state no longer matches it: that
//! state must never be loaded again.
//!
//! A driver killed halfway is finished at open ([`settle_at_open`]).

use std::fs;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use sbx_driver_api::{DriverError, parse_sandbox_id, pb};
use sbx_host_kit::feed;
use sbx_host_kit::procfs::{self, ProcessIdentity};
use sbx_host_kit::{Desired, HostDriver, internal, locked, write_failure};

use super::record::{VmPaths, VmRecord};
use super::{Inner, force_quit, qemu};

/// The refusal of a pause or resume of a sandbox in the wrong state, naming it.
fn not_in_state(id: uuid::Uuid, snapshot: &pb::Snapshot, only: &str) -> DriverError {
    let state = pb::State::try_from(snapshot.state).unwrap_or(pb::State::Unspecified);
    DriverError::FailedPrecondition(format!("sandbox {id} is {}; {only}", state.as_str_name()))
}

impl Inner {
    /// Pauses a running VM (see the module docs). Paused: nothing to do.
    pub(super) async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let _serialised = self.records.lock(id).await;
        let mut rec = self.records.require(id)?;
        let snapshot = self.snapshot(&rec);
        match pb::State::try_from(snapshot.state) {
            Ok(pb::State::Paused) => return Ok(snapshot),
            Ok(pb::State::Running) => {}
            _ => {
                return Err(not_in_state(
                    id,
                    &snapshot,
                    "only a running vm can be paused",
                ));
            }
        }
        let paths = self.paths(id);
        let limit = qemu::state_transfer_limit(rec.spec.memory_mib);
        let began = Instant::now();
        let migrated = tokio::task::spawn_blocking({
            let paths = paths.clone();
            move || save(&paths, limit)
        })
        .await
        .map_err(|e| internal("the pause's task failed", e))??;
        let saved_in = began.elapsed();
        rec.paused = true;
        if let Err(e) = self.records.save(&rec) {
            // Not recorded: the VM goes on and the saved state is dropped.
            let _ = fs::remove_file(&paths.memory);
            let qmp = paths.qmp_socket.clone();
            let resumed =
                tokio::task::spawn_blocking(move || qemu::resume_after_failed_save(&qmp)).await;
            return Err(match resumed {
                Ok(Ok(())) => e,
                Ok(Err(why)) => internal(&format!("{e}; and the vm could not be resumed"), why),
                Err(why) => internal(&format!("{e}; and the vm could not be resumed"), why),
            });
        }
        // Paused from here, whatever happens to this QEMU: its state is on disk, and it is
        // stopped (`postmigrate`) until it ends.
        self.terminate(&rec, Duration::ZERO).await?;
        let size = fs::metadata(&paths.memory).map_or(0, |m| m.len());
        tracing::info!(
            sandbox_id = %id,
            ?saved_in,
            total = ?began.elapsed(),
            bytes = size,
            stream = migrated.transferred,
            pages = migrated.normal_pages,
            zero_pages = migrated.zero_pages,
            "vm paused"
        );
        let snapshot = self.snapshot(&rec);
        feed::publish(self, id, &snapshot);
        Ok(snapshot)
    }

    /// Resumes a paused VM (see the module docs). Running: nothing to do.
    pub(super) async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let _serialised = self.records.lock(id).await;
        let mut rec = self.records.require(id)?;
        let snapshot = self.snapshot(&rec);
        match pb::State::try_from(snapshot.state) {
            Ok(pb::State::Running) => return Ok(snapshot),
            Ok(pb::State::Paused) => {}
            _ => {
                return Err(not_in_state(
                    id,
                    &snapshot,
                    "only a paused vm can be resumed",
                ));
            }
        }
        let paths = self.paths(id);
        if !paths.memory.is_file() {
            return Err(DriverError::Internal(format!(
                "sandbox {id} is paused but its saved state {} is gone; stop it and start it \
                 again to boot afresh",
                paths.memory.display()
            )));
        }
        // What an earlier pause or resume left running (it cannot run the guest: it is
        // stopped), ended first.
        if let Some(left) = rec.qemu.filter(procfs::is_alive) {
            tracing::warn!(sandbox_id = %id, %left, "a qemu of the paused vm still runs; ended");
            self.terminate(&rec, Duration::ZERO).await?;
        }
        let began = Instant::now();
        let _slot = match self.boots.try_acquire() {
            Ok(slot) => slot,
            Err(_) => self
                .boots
                .acquire()
                .await
                .map_err(|e| internal("waiting for a boot slot", e))?,
        };
        // The shared initramfs stands in for the run's own (which held its credentials and
        // was never a file): it is only read at a boot, and the guest does not boot again (it
        // resets only to end).
        let initramfs = std::fs::File::open(&self.assets.initramfs)
            .map_err(|e| internal("opening the shared initramfs", e))?;
        self.ids_of(&mut rec)?;
        let attached = self.attach(&rec).await?;
        let launch = self.launch_of(
            id,
            &rec,
            &paths,
            std::os::fd::AsFd::as_fd(&initramfs),
            true,
            attached.as_ref().map(|a| a.netns_path.as_path()),
        )?;
        let identity = launch.launch().await.map_err(|e| kept(id, e))?;
        // Still paused until it is recorded running: a terminate below ends this QEMU.
        let loading = VmRecord {
            qemu: Some(identity),
            ..rec.clone()
        };
        let limit = qemu::state_transfer_limit(rec.spec.memory_mib);
        let loaded = tokio::task::spawn_blocking({
            let paths = paths.clone();
            move || load(&paths, limit)
        })
        .await
        .map_err(|e| internal("the resume's task failed", e))
        .and_then(|loaded| loaded);
        if let Err(e) = loaded {
            self.terminate(&loading, Duration::ZERO).await?;
            return Err(kept(id, e));
        }
        let loaded_in = began.elapsed();
        // Recorded running before the guest runs: from its first instruction on, the saved
        // state is stale (see the module docs).
        rec.qemu = Some(identity);
        rec.paused = false;
        if let Err(e) = self.records.save(&rec) {
            self.terminate(&loading, Duration::ZERO).await?;
            return Err(kept(id, e));
        }
        let qmp = paths.qmp_socket.clone();
        let cont = tokio::task::spawn_blocking(move || {
            qemu::command(&qmp, "cont").or_else(|e| match qemu::query(&qmp) {
                Ok((_, status)) if status == "running" => Ok(()),
                _ => Err(e),
            })
        })
        .await
        .map_err(|e| internal("the resume's task failed", e))
        .and_then(|cont| cont.map_err(|e| internal("qmp cont", e)));
        if let Err(e) = cont {
            // The guest did not run: the saved state still holds; paused again.
            self.terminate(&rec, Duration::ZERO).await?;
            rec.paused = true;
            self.records.save(&rec)?;
            return Err(kept(id, e));
        }
        remove_saved(&paths);
        locked(&self.finished).remove(&id);
        tracing::info!(sandbox_id = %id, %identity, ?loaded_in, total = ?began.elapsed(), "vm resumed");
        let snapshot = self.snapshot(&rec);
        feed::publish(self, id, &snapshot);
        Ok(snapshot)
    }

    /// A stop of a paused VM: its saved state discarded, the record no longer paused (its
    /// `desired` already says stopped).
    pub(super) fn discard_saved(&self, rec: &VmRecord) -> Result<(), DriverError> {
        remove_saved(&self.paths(rec.sandbox_id));
        self.records.save(&VmRecord {
            paused: false,
            ..rec.clone()
        })
    }
}

/// A resume's error, saying that the sandbox stays paused.
fn kept(id: uuid::Uuid, e: DriverError) -> DriverError {
    let also = "; the sandbox stays paused, its saved state kept (a resume tries again)";
    match e {
        DriverError::Internal(m) => {
            DriverError::Internal(format!("resuming sandbox {id}: {m}{also}"))
        }
        DriverError::Unavailable(m) => {
            DriverError::Unavailable(format!("resuming sandbox {id}: {m}{also}"))
        }
        other => other,
    }
}

/// The blocking half of a pause: the state saved to `memory.part`, synced, renamed to
/// `memory`, the directory synced. On failure the VM runs on and no file is left.
fn save(paths: &VmPaths, limit: Duration) -> Result<qemu::Migrated, DriverError> {
    let _ = fs::remove_file(&paths.memory_part);
    let file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&paths.memory_part)
        .map_err(|e| write_failure("saving the vm's memory", &paths.memory_part, e))?;
    let migrated = qemu::save_state(&paths.qmp_socket, &file, limit).map_err(|why| {
        let _ = fs::remove_file(&paths.memory_part);
        save_failure(&why, &paths.memory_part)
    })?;
    let kept = file
        .sync_all()
        .and_then(|()| fs::rename(&paths.memory_part, &paths.memory))
        .and_then(|()| sync_dir(&paths.dir));
    if let Err(e) = kept {
        let _ = fs::remove_file(&paths.memory_part);
        let _ = fs::remove_file(&paths.memory);
        let err = write_failure("keeping the vm's saved memory", &paths.memory, e);
        return Err(match qemu::resume_after_failed_save(&paths.qmp_socket) {
            Ok(()) => err,
            Err(why) => {
                DriverError::Internal(format!("{err}; and the vm could not be resumed: {why}"))
            }
        });
    }
    Ok(migrated)
}

/// What a failed save answers: a full disk is `Unavailable` (free space, pause again),
/// anything else `Internal`; both say the VM runs on.
fn save_failure(why: &str, part: &Path) -> DriverError {
    let message = format!(
        "saving the vm's memory to {}: {why}; the vm runs on",
        part.display()
    );
    if why.contains("No space left") || why.contains("Disk quota") {
        DriverError::Unavailable(format!(
            "{message} (the disk is full: free space there and pause again)"
        ))
    } else {
        DriverError::Internal(message)
    }
}

/// The blocking half of a resume: the state in `memory` loaded into the VM just launched.
fn load(paths: &VmPaths, limit: Duration) -> Result<qemu::Migrated, DriverError> {
    let file = fs::File::open(&paths.memory)
        .map_err(|e| internal(&format!("opening {}", paths.memory.display()), e))?;
    qemu::load_state(&paths.qmp_socket, &file, limit).map_err(|why| {
        DriverError::Internal(format!(
            "loading the saved state {}: {why}",
            paths.memory.display()
        ))
    })
}

/// Removes a saved state and a save's leftover, durably (best effort: a file left is removed
/// at the next open).
pub(super) fn remove_saved(paths: &VmPaths) {
    let mut removed = false;
    for file in [&paths.memory, &paths.memory_part] {
        match fs::remove_file(file) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %file.display(), error = %e, "saved state not removed"),
        }
    }
    if removed {
        let _ = sync_dir(&paths.dir);
    }
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

/// At open, for a record read back and its QEMU (if one lives, with its QMP status: empty when
/// QMP did not answer): what an interrupted pause, resume or stop of a paused VM left, made
/// whole. Whether the record changed (the caller writes it).
///
/// - Paused, and a QEMU runs the guest (`running`): a resume got past `cont` without
///   recording it (it records first, so only by hand): the VM is adopted, its state removed.
/// - Paused, and a QEMU lives otherwise (a pause that did not end its QEMU, a resume that did
///   not finish loading): it is ended; the saved state is what counts.
/// - Paused with no saved state and no QEMU: nothing to resume; no longer paused (it reports
///   its run ended).
/// - Paused, stop asked: the saved state is discarded (the stop finishes).
/// - Not paused, and the QEMU stopped (`paused`, `postmigrate`, `finish-migrate`): a pause
///   not recorded, or a resume recorded before its `cont`: the VM goes on.
/// - Not paused: a saved state is stale, removed.
pub(super) fn settle_at_open(
    paths: &VmPaths,
    rec: &mut VmRecord,
    live: Option<(ProcessIdentity, &str)>,
) -> bool {
    let id = rec.sandbox_id;
    let _ = fs::remove_file(&paths.memory_part);
    if !rec.paused {
        // Stale (or never recorded): gone before the guest may run again.
        remove_saved(paths);
        if rec.desired == Desired::Running
            && let Some((identity, status)) = live
            && matches!(status, "paused" | "postmigrate" | "finish-migrate")
        {
            tracing::warn!(sandbox_id = %id, %identity, %status, "finishing an interrupted pause or resume: the vm goes on");
            if let Err(e) = qemu::resume_after_failed_save(&paths.qmp_socket) {
                tracing::error!(sandbox_id = %id, error = %e, "the stopped vm could not be resumed");
            }
        }
        return false;
    }
    match (rec.desired, live) {
        (Desired::Stopped, _) => {
            tracing::warn!(sandbox_id = %id, "finishing the stop of a paused vm: its saved state discarded");
            remove_saved(paths);
            rec.paused = false;
            true
        }
        (Desired::Running, Some((identity, "running"))) => {
            tracing::warn!(sandbox_id = %id, %identity, "a paused vm runs: adopted, its saved state removed");
            remove_saved(paths);
            rec.paused = false;
            true
        }
        (Desired::Running, Some((identity, status))) => {
            tracing::warn!(sandbox_id = %id, %identity, %status, "a qemu of a paused vm was left; ended (the saved state counts)");
            force_quit(paths, identity);
            false
        }
        (Desired::Running, None) if !paths.memory.is_file() => {
            tracing::error!(sandbox_id = %id, path = %paths.memory.display(), "a paused vm's saved state is gone; its run is over");
            rec.paused = false;
            true
        }
        (Desired::Running, None) => {
            tracing::info!(sandbox_id = %id, "found the vm paused");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RECORD_FORMAT, VmSpec};

    fn record(paused: bool, desired: Desired) -> VmRecord {
        VmRecord {
            format: RECORD_FORMAT,
            sandbox_id: uuid::Uuid::new_v4(),
            workspace: "w".into(),
            name: "n".into(),
            spec: VmSpec {
                command: vec!["true".into()],
                env: Default::default(),
                memory_mib: 256,
                cpus: 1,
                image: String::new(),
                process: None,
            },
            desired,
            run_id: "r".into(),
            launched_at_ms: 1,
            console_offset: 0,
            qemu: Some(ProcessIdentity {
                pid: i32::MAX,
                start_ticks: 1,
            }),
            warnings: vec![],
            paused,
            network_allow: None,
            id_map: None,
            root_base: None,
        }
    }

    /// What open makes of the files an interrupted pause, resume or stop left, with no QEMU
    /// alive (the cases with one are the integration tests').
    #[test]
    fn open_settles_what_an_interrupted_call_left() {
        let state = tempfile::tempdir().unwrap();
        let check = |rec: VmRecord, files: &[&str], changed: bool, paused: bool, left: &[&str]| {
            let paths = VmPaths::new(state.path(), rec.sandbox_id);
            fs::create_dir_all(&paths.dir).unwrap();
            for file in files {
                fs::write(paths.dir.join(file), b"state").unwrap();
            }
            let mut rec = rec;
            assert_eq!(settle_at_open(&paths, &mut rec, None), changed, "{files:?}");
            assert_eq!(rec.paused, paused, "{files:?}");
            let mut found: Vec<String> = fs::read_dir(&paths.dir)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            found.sort();
            assert_eq!(found, left, "{files:?}");
        };
        // Paused: the saved state is kept, a save's leftover not.
        check(
            record(true, Desired::Running),
            &["memory", "memory.part"],
            false,
            true,
            &["memory"],
        );
        // Paused with nothing saved: nothing to resume.
        check(record(true, Desired::Running), &[], true, false, &[]);
        // A stop of a paused VM cut short: finished.
        check(
            record(true, Desired::Stopped),
            &["memory"],
            true,
            false,
            &[],
        );
        // Not paused: any saved state is stale.
        check(
            record(false, Desired::Running),
            &["memory", "memory.part"],
            false,
            false,
            &[],
        );
    }
}
