//! The on-disk state of the oci driver.
//!
//! ```text
//! <state_dir>/driver.lock                       one live driver instance per state dir
//! <state_dir>/runc/                             the OCI runtime's own state (`runc --root`)
//! <state_dir>/init/                             the sandbox init (a static busybox and its
//!                                               script), bound read-only at /dev/.sbx
//! <state_dir>/sandboxes/<id>/sandbox.json       the record (written atomically)
//! <state_dir>/sandboxes/<id>/bundle/config.json the OCI runtime config of the current run
//! <state_dir>/sandboxes/<id>/bundle/rootfs/     the overlay of the image's layers (mounted
//!                                               while the workload runs)
//! <state_dir>/sandboxes/<id>/upper/, work/      the overlay's writable layer: every change
//!                                               to the root filesystem, kept until delete
//! <state_dir>/sandboxes/<id>/volume/            /sandbox inside
//! <state_dir>/sandboxes/<id>/workload.log       stdout and stderr of the workload
//! <state_dir>/sandboxes/<id>/run-<run_id>/      one run: `init` (the init's /proc stat
//!                                               line), `exit` (written by the init inside,
//!                                               bound at /dev/.sbx-run), `pid` (runc's)
//! <state_dir>/trash/                            sandboxes being deleted
//! ```
//!
//! Every directory on the way to a rootfs is mode 0711: the runtime's container init runs as
//! the sandbox's unprivileged host uid and must be able to walk to the rootfs and to the
//! sources of its bind mounts, but not list what is beside them.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::host::Desired;
use crate::host::procfs::{self, ProcessIdentity};

/// The version of [`OciRecord`]'s format.
pub const RECORD_FORMAT: u32 = 1;

/// What the image gave the sandbox at create, kept so that a start needs nothing but the
/// layers (which the gateway keeps while a sandbox pins their image).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageRun {
    /// The pinned manifest digest.
    pub digest: String,
    /// The unpacked layer directories, lowest first.
    pub layers: Vec<PathBuf>,
    /// The main process's argv: the spec's command, else the image's Entrypoint + Cmd.
    pub args: Vec<String>,
    /// The image's `Env`, then the spec's variables (a spec variable replaces the image's).
    pub env: Vec<String>,
    /// The image's `WorkingDir`, else `/`.
    pub cwd: String,
    /// The image's `User` (`uid[:gid]` or names, resolved in the rootfs at each start).
    pub user: String,
}

/// Everything a restarted driver needs to find and manage one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OciRecord {
    pub format: u32,
    pub sandbox_id: Uuid,
    /// Round-tripped in snapshots; never used to find the sandbox.
    pub workspace: String,
    pub name: String,
    pub image: ImageRun,
    pub cpu_millis: u32,
    pub memory_bytes: u64,
    /// The runtime generation of the current (or last) run; 0 before the first start.
    pub generation: u64,
    pub desired: Desired,
    /// Wall-clock time of the last launch, milliseconds since the Unix epoch.
    pub launched_at_ms: u64,
    /// Names the run directory of the current (or last) launch; empty before the first.
    pub run_id: String,
    /// The cgroup path given to the runtime (`/<parent>/<id>`, the same in every hierarchy).
    pub cgroup_path: String,
    /// What could not be applied at create.
    pub warnings: Vec<String>,
    /// The spec's variables as sent (for the record's readers; `image.env` is what runs).
    pub spec_env: BTreeMap<String, String>,
}

/// The paths of one sandbox's state.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    pub dir: PathBuf,
    pub record: PathBuf,
    pub bundle: PathBuf,
    pub rootfs: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    pub volume: PathBuf,
    pub log: PathBuf,
}

/// The files of one run of the workload.
#[derive(Debug, Clone)]
pub struct RunPaths {
    pub dir: PathBuf,
}

impl SandboxPaths {
    pub fn new(state_dir: &Path, id: Uuid) -> SandboxPaths {
        let dir = sandboxes_dir(state_dir).join(id.to_string());
        let bundle = dir.join("bundle");
        SandboxPaths {
            record: dir.join("sandbox.json"),
            rootfs: bundle.join("rootfs"),
            bundle,
            upper: dir.join("upper"),
            work: dir.join("work"),
            volume: dir.join("volume"),
            log: dir.join("workload.log"),
            dir,
        }
    }

    pub fn run(&self, run_id: &str) -> RunPaths {
        RunPaths {
            dir: self.dir.join(format!("run-{run_id}")),
        }
    }

    /// Removes every run directory.
    pub fn remove_runs(&self) -> io::Result<()> {
        for entry in fs::read_dir(&self.dir)?.flatten() {
            if entry.file_name().to_string_lossy().starts_with("run-") {
                fs::remove_dir_all(entry.path())?;
            }
        }
        Ok(())
    }
}

impl RunPaths {
    pub fn init(&self) -> PathBuf {
        self.dir.join("init")
    }

    pub fn exit(&self) -> PathBuf {
        self.dir.join("exit")
    }

    pub fn pid_file(&self) -> PathBuf {
        self.dir.join("pid")
    }

    /// The identity of the run's container init, as the driver recorded it after the launch.
    pub fn read_init(&self) -> Option<ProcessIdentity> {
        let line = complete_line(&self.init())?;
        procfs::parse_stat_line(&line).map(|s| s.identity)
    }

    /// The wait status of the main process, once the init has written it.
    pub fn read_exit(&self) -> Option<i32> {
        complete_line(&self.exit())?.trim().parse().ok()
    }
}

/// The file's text if it is a complete line (written to its final newline), else `None`.
fn complete_line(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    text.ends_with('\n').then_some(text)
}

pub fn sandboxes_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("sandboxes")
}

pub fn trash_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("trash")
}

pub fn runtime_root(state_dir: &Path) -> PathBuf {
    state_dir.join("runc")
}

pub fn init_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("init")
}

/// Makes `dir` (and missing parents) with mode 0711: walkable by the sandboxes' host uid,
/// not listable.
pub fn make_walkable_dir(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o711))
}

/// Writes `record` atomically: temp file, fsync, rename over the record, fsync the directory.
pub fn write_record(paths: &SandboxPaths, record: &OciRecord) -> io::Result<()> {
    let bytes = serde_json::to_vec_pretty(record).map_err(io::Error::other)?;
    let tmp = paths.dir.join(".sandbox.json.tmp");
    {
        let mut file = fs::File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, &paths.record)?;
    fs::File::open(&paths.dir)?.sync_all()
}

pub fn read_record(path: &Path) -> io::Result<OciRecord> {
    let bytes = fs::read(path)?;
    let record: OciRecord = serde_json::from_slice(&bytes).map_err(io::Error::other)?;
    if record.format != RECORD_FORMAT {
        return Err(io::Error::other(format!(
            "record format {} is not the supported {RECORD_FORMAT}",
            record.format
        )));
    }
    Ok(record)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_bad_ones_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let id = Uuid::new_v4();
        let paths = SandboxPaths::new(tmp.path(), id);
        fs::create_dir_all(&paths.dir).unwrap();
        let mut record = OciRecord {
            format: RECORD_FORMAT,
            sandbox_id: id,
            workspace: "alpha".into(),
            name: "web".into(),
            image: ImageRun {
                digest: "sha256:ab".into(),
                layers: vec!["/l1".into(), "/l2".into()],
                args: vec!["sh".into()],
                env: vec!["PATH=/bin".into()],
                cwd: "/".into(),
                user: "1000:1000".into(),
            },
            cpu_millis: 250,
            memory_bytes: 1 << 26,
            generation: 3,
            desired: Desired::Running,
            launched_at_ms: 5,
            run_id: "r1".into(),
            cgroup_path: "/sbx-oci/x".into(),
            warnings: vec![],
            spec_env: BTreeMap::new(),
        };
        write_record(&paths, &record).unwrap();
        assert_eq!(read_record(&paths.record).unwrap(), record);
        record.format = 9;
        write_record(&paths, &record).unwrap();
        assert!(read_record(&paths.record).is_err());
        fs::write(&paths.record, b"{").unwrap();
        assert!(read_record(&paths.record).is_err());
    }
}
