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
//! The record is read and written by the kit (`host::records`: atomic writes, the format
//! check, the trash). A run directory belongs to one launch of the workload, named by a fresh
//! id recorded before the launch; earlier ones are removed first (`host::run`). So an exit
//! status from an earlier run is never read as the current one, and a shim from an abandoned
//! launch (a driver killed mid-launch, then a retry) finds its directory gone and ends before
//! starting anything.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use super::cgroup::SandboxCgroups;
use sbx_host_kit::host_record;
use sbx_host_kit::records;
use sbx_host_kit::{Desired, RunDir};

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
    /// On the gateway's network with this egress allowlist; `None`: loopback only.
    #[serde(default)]
    pub network_allow: Option<Vec<String>>,
    /// The host ids of this sandbox alone, leased from the driver's uid pool at create and
    /// released at delete; `None`: the driver's shared range (older records, no pool).
    #[serde(default)]
    pub id_map: Option<sbx_images::IdMap>,
}

host_record!(SandboxRecord, RECORD_FORMAT);

impl sbx_host_kit::sandbox_network::NetworkedRecord for SandboxRecord {
    fn network_allow(&self) -> Option<&Vec<String>> {
        self.network_allow.as_ref()
    }
    fn set_network_allow(&mut self, allow: Option<Vec<String>>) {
        self.network_allow = allow;
    }
}

/// The paths of one sandbox's state.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    pub dir: PathBuf,
    pub root: PathBuf,
    pub log: PathBuf,
}

impl SandboxPaths {
    pub fn new(state_dir: &Path, id: Uuid) -> SandboxPaths {
        let dir = records::sandboxes_dir(state_dir).join(id.to_string());
        SandboxPaths {
            root: dir.join("root"),
            log: dir.join("workload.log"),
            dir,
        }
    }

    /// The run directory named `run_id` (see the module docs).
    pub fn run(&self, run_id: &str) -> RunDir {
        RunDir::new(&self.dir, run_id)
    }

    /// Keeps the sandbox's state from every other local user: its directory is host root's,
    /// 0700 (the shim binds the persistent directory in as host root; nothing of the sandbox
    /// walks this path), and the log, the part before it and the agent's socket are 0600 (the
    /// log made so when missing). Made at create and at each launch (a sandbox from before
    /// keeps nothing readable past its next start).
    pub fn make_private(&self) -> std::io::Result<()> {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        fs::create_dir_all(&self.dir)?;
        fs::set_permissions(&self.dir, fs::Permissions::from_mode(0o700))?;
        for log in [
            self.log.clone(),
            sbx_host_kit::logfile::previous_path(&self.log),
        ] {
            fs::OpenOptions::new()
                .append(true)
                .create(true)
                .mode(0o600)
                .open(&log)?
                .set_permissions(fs::Permissions::from_mode(0o600))?;
        }
        match fs::set_permissions(
            self.dir.join(sbx_host_kit::agent::SOCKET),
            fs::Permissions::from_mode(0o600),
        ) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        }
    }
}

/// What the shim could not set up for the run, a line each.
pub fn warnings_file(run: &RunDir) -> PathBuf {
    run.dir.join("warnings")
}

/// The shim's warnings for the run.
pub fn read_warnings(run: &RunDir) -> Vec<String> {
    fs::read_to_string(warnings_file(run))
        .map(|t| {
            t.lines()
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_host_kit::records::{read_json_with_format, record_file, write_json_atomically};

    fn write_record(paths: &SandboxPaths, record: &SandboxRecord) -> std::io::Result<()> {
        write_json_atomically(&record_file(&paths.dir), record)
    }

    fn read_record(paths: &SandboxPaths) -> std::io::Result<SandboxRecord> {
        read_json_with_format(&record_file(&paths.dir))
    }

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
            network_allow: Some(vec!["10.0.0.1:80".into()]),
            id_map: None,
        }
    }

    #[test]
    fn records_round_trip_and_unknown_formats_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let id = Uuid::new_v4();
        let paths = SandboxPaths::new(tmp.path(), id);
        fs::create_dir_all(&paths.dir).unwrap();
        let mut record = sample(id);
        write_record(&paths, &record).unwrap();
        assert_eq!(read_record(&paths).unwrap(), record);
        record.format = 99;
        write_record(&paths, &record).unwrap();
        assert!(read_record(&paths).is_err());
    }

    #[test]
    fn the_shims_warnings_are_read_back() {
        let tmp = tempfile::tempdir().unwrap();
        let run = SandboxPaths::new(tmp.path(), Uuid::new_v4()).run("r1");
        fs::create_dir_all(&run.dir).unwrap();
        assert!(read_warnings(&run).is_empty());
        fs::write(warnings_file(&run), "a\n\nb\n").unwrap();
        assert_eq!(read_warnings(&run), vec!["a".to_string(), "b".to_string()]);
    }
}
