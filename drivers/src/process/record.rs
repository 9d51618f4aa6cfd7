//! The on-disk state of the process driver.
//!
//! ```text
//! <state_dir>/sandboxes/<id>/sandbox.json   the record (written atomically)
//! <state_dir>/sandboxes/<id>/root/          the persistent directory, /sandbox inside
//! <state_dir>/sandboxes/<id>/workload.log   stdout and stderr of the workload
//! <state_dir>/sandboxes/<id>/run-<run_id>/init      the /proc stat line of the run's init (shim)
//! <state_dir>/sandboxes/<id>/run-<run_id>/exit      the main process's status, written by the shim
//! <state_dir>/sandboxes/<id>/run-<run_id>/warnings  what the shim could not set up
//! <state_dir>/trash/                                sandboxes being deleted
//! ```
//!
//! A run directory belongs to one launch of the workload, named by a fresh id recorded before
//! the launch; earlier ones are removed first. So an exit status from an earlier run is never
//! read as the current one, and a shim from an abandoned launch (a driver killed mid-launch,
//! then a retry) finds its directory gone and ends before starting anything.

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::cgroup::SandboxCgroups;
use crate::host::Desired;
use crate::host::procfs::{self, ProcessIdentity};

/// The version of [`SandboxRecord`]'s format.
pub const RECORD_FORMAT: u32 = 1;

/// The spec as sent at create (the proto types have no serde).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredSpec {
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub cpu_millis: u32,
    pub memory_bytes: u64,
    pub image: String,
}

/// Everything a restarted driver needs to find and manage one sandbox.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub format: u32,
    pub sandbox_id: Uuid,
    /// Round-tripped in snapshots; never used to find the sandbox.
    pub workspace: String,
    pub name: String,
    pub spec: StoredSpec,
    /// The runtime generation of the current (or last) run; 0 before the first start.
    pub generation: u64,
    pub desired: Desired,
    /// Wall-clock time of the last launch, milliseconds since the Unix epoch.
    pub launched_at_ms: u64,
    /// The memory cgroup's OOM-kill counter at the last launch: a later, higher count means
    /// the OOM killer struck during this run.
    pub oom_kills_at_launch: u64,
    /// Names the run directory of the current (or last) launch; empty before the first.
    #[serde(default)]
    pub run_id: String,
    pub cgroups: SandboxCgroups,
    /// What could not be applied at create (limits without a controller, …).
    pub warnings: Vec<String>,
}

/// The paths of one sandbox's state.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    pub dir: PathBuf,
    pub record: PathBuf,
    pub root: PathBuf,
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
        SandboxPaths {
            record: dir.join("sandbox.json"),
            root: dir.join("root"),
            log: dir.join("workload.log"),
            dir,
        }
    }

    /// The run directory named `run_id` (see the module docs).
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

    pub fn warnings(&self) -> PathBuf {
        self.dir.join("warnings")
    }

    /// The identity of the current run's init (the shim), as it recorded it.
    pub fn read_init(&self) -> Option<ProcessIdentity> {
        let line = complete_line(&self.init())?;
        procfs::parse_stat_line(&line).map(|s| s.identity)
    }

    /// The wait status of the current run's main process, once the shim has written it.
    pub fn read_exit(&self) -> Option<i32> {
        complete_line(&self.exit())?.trim().parse().ok()
    }

    /// The shim's warnings for the current run.
    pub fn read_warnings(&self) -> Vec<String> {
        fs::read_to_string(self.warnings())
            .map(|t| {
                t.lines()
                    .filter(|l| !l.is_empty())
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default()
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

/// Writes `record` atomically: temp file, fsync, rename over the record, fsync the directory.
/// A driver killed at any moment leaves either the old record or the new one.
pub fn write_record(paths: &SandboxPaths, record: &SandboxRecord) -> io::Result<()> {
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

pub fn read_record(path: &Path) -> io::Result<SandboxRecord> {
    let bytes = fs::read(path)?;
    let record: SandboxRecord = serde_json::from_slice(&bytes).map_err(io::Error::other)?;
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

    fn sample(id: Uuid) -> SandboxRecord {
        SandboxRecord {
            format: RECORD_FORMAT,
            sandbox_id: id,
            workspace: "alpha".into(),
            name: "web".into(),
            spec: StoredSpec {
                command: vec!["sleep".into(), "60".into()],
                env: BTreeMap::from([("A".into(), "1".into())]),
                cpu_millis: 250,
                memory_bytes: 1 << 26,
                image: String::new(),
            },
            generation: 7,
            desired: Desired::Running,
            launched_at_ms: 1,
            oom_kills_at_launch: 0,
            run_id: "r1".into(),
            cgroups: SandboxCgroups::default(),
            warnings: vec!["w".into()],
        }
    }

    #[test]
    fn records_round_trip_and_overwrite_atomically() {
        let tmp = tempfile::tempdir().unwrap();
        let id = Uuid::new_v4();
        let paths = SandboxPaths::new(tmp.path(), id);
        fs::create_dir_all(&paths.dir).unwrap();
        let mut record = sample(id);
        write_record(&paths, &record).unwrap();
        assert_eq!(read_record(&paths.record).unwrap(), record);
        record.generation = 8;
        record.desired = Desired::Stopped;
        write_record(&paths, &record).unwrap();
        assert_eq!(read_record(&paths.record).unwrap(), record);
        assert!(!paths.dir.join(".sandbox.json.tmp").exists());
    }

    #[test]
    fn unknown_formats_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let id = Uuid::new_v4();
        let paths = SandboxPaths::new(tmp.path(), id);
        fs::create_dir_all(&paths.dir).unwrap();
        let mut record = sample(id);
        record.format = 99;
        write_record(&paths, &record).unwrap();
        assert!(read_record(&paths.record).is_err());
        fs::write(&paths.record, b"{not json").unwrap();
        assert!(read_record(&paths.record).is_err());
    }

    #[test]
    fn run_files_are_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let sandbox = SandboxPaths::new(tmp.path(), Uuid::new_v4());
        let old = sandbox.run("old");
        fs::create_dir_all(&old.dir).unwrap();
        let paths = sandbox.run("r1");
        fs::create_dir_all(&paths.dir).unwrap();
        assert_eq!(paths.read_init(), None);
        assert_eq!(paths.read_exit(), None);
        fs::write(
            paths.init(),
            "42 (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 555 0 0\n",
        )
        .unwrap();
        fs::write(paths.exit(), "137\n").unwrap();
        fs::write(paths.warnings(), "a\n\nb\n").unwrap();
        assert_eq!(
            paths.read_init(),
            Some(ProcessIdentity {
                pid: 42,
                start_ticks: 555
            })
        );
        assert_eq!(paths.read_exit(), Some(137));
        assert_eq!(
            paths.read_warnings(),
            vec!["a".to_string(), "b".to_string()]
        );
        assert_eq!(old.read_exit(), None, "runs do not share files");
        // Half-written files (no final newline yet) are not read.
        fs::write(paths.exit(), "13").unwrap();
        fs::write(
            paths.init(),
            "42 (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55",
        )
        .unwrap();
        assert_eq!((paths.read_init(), paths.read_exit()), (None, None));
        sandbox.remove_runs().unwrap();
        assert!(!old.dir.exists() && !paths.dir.exists() && sandbox.dir.exists());
    }
}
