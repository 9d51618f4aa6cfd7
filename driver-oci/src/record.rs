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
//! <state_dir>/sandboxes/<id>/disk.img          the sandbox's disk (with a disk limit)
//! <state_dir>/sandboxes/<id>/disk/              that disk mounted, else a plain directory
//! <state_dir>/sandboxes/<id>/disk/upper/, work/ the overlay's writable layer: every change
//!                                               to the root filesystem, kept until delete
//! <state_dir>/sandboxes/<id>/lower/<n>/         the image's layer n as the sandbox's own uid
//!                                               range sees it (idmapped, read-only; mounted
//!                                               only while a root filesystem is mounted)
//! <state_dir>/sandboxes/<id>/disk/volume/       /sandbox inside
//! <state_dir>/sandboxes/<id>/workload.log       stdout and stderr of the workload, the newest
//!                                               part; `workload.log.1` the part before it
//! <state_dir>/sandboxes/<id>/exec-pts/          where the exec devpts instance is mounted
//!                                               during a launch (`host::ptys`)
//! <state_dir>/sandboxes/<id>/run-<run_id>/      one run, host root's (0711, never bound
//!                                               into the sandbox): `init` (the init's /proc
//!                                               stat line, written by the driver), `pid`
//!                                               (runc's), `exit`, `not-found`, `agent.log`,
//!                                               `launched` (made by the driver, written by the init
//!                                               through descriptors), `hostname` and
//!                                               `resolv.conf` (0444, bound read-only)
//! <state_dir>/trash/                            sandboxes being deleted
//! ```
//!
//! The record is read and written by the kit (`host::records`: atomic writes, the format
//! check, the trash), and so are the run directory's `init` and `exit` (`host::run`).
//! Nothing under a sandbox's directory is the sandbox's to write but `upper/` and `volume/`,
//! which host code reads only through `host::safefs` (the image user's `/etc/passwd` and
//! `/etc/group`, resolved in the rootfs) or as the sandbox's own uid (a copy of a stopped
//! sandbox).
//!
//! Every directory on the way to a rootfs is mode 0711: the runtime's container init runs as
//! the sandbox's unprivileged host uid and must be able to walk to the rootfs and to the
//! sources of its bind mounts, but not list what is beside them.

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use sbx_host_kit::host_record;
use sbx_host_kit::records;
use sbx_host_kit::{Desired, RunDir};
use sbx_images::IdMap;

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
    /// On the gateway's network with this egress allowlist (entries as the spec gave them);
    /// `None`: loopback only. Absent in records written before networks existed.
    #[serde(default)]
    pub network_allow: Option<Vec<String>>,
    /// The host ids of this sandbox alone, leased from the driver's uid pool at create and
    /// released at delete. `None`: the driver's shared range (records written before
    /// per-sandbox ranges, or a driver without a pool).
    #[serde(default)]
    pub id_map: Option<IdMap>,
    /// The disk limit (bytes of `disk.img`); 0: none.
    #[serde(default)]
    pub disk_bytes: u64,
}

host_record!(OciRecord, RECORD_FORMAT);

/// The paths of one sandbox's state.
#[derive(Debug, Clone)]
pub struct SandboxPaths {
    pub dir: PathBuf,
    pub bundle: PathBuf,
    pub rootfs: PathBuf,
    pub upper: PathBuf,
    pub work: PathBuf,
    /// The image's layers as the sandbox's own uid range sees them (idmapped mounts, while
    /// a root filesystem is being mounted).
    pub lower: PathBuf,
    /// Holds `upper/`, `work/` and `volume/`: the sandbox's disk (see `oci::disk`), or a
    /// plain directory without a disk limit.
    pub disk: PathBuf,
    pub volume: PathBuf,
    pub log: PathBuf,
    /// Where the exec devpts instance is mounted while a launch runs (see `host::ptys`).
    pub exec_pts: PathBuf,
}

impl SandboxPaths {
    pub fn new(state_dir: &Path, id: Uuid) -> SandboxPaths {
        Self::of_dir(records::sandboxes_dir(state_dir).join(id.to_string()))
    }

    /// The paths of the sandbox whose directory is `dir` (also one in the trash).
    /// A sandbox made before disks (a directory without `disk/`) keeps its writable dirs
    /// beside the record.
    pub fn of_dir(dir: PathBuf) -> SandboxPaths {
        let bundle = dir.join("bundle");
        let disk = dir.join("disk");
        let writable = if disk.exists() || !dir.exists() {
            disk.clone()
        } else {
            dir.clone()
        };
        SandboxPaths {
            rootfs: bundle.join("rootfs"),
            bundle,
            upper: writable.join("upper"),
            work: writable.join("work"),
            lower: dir.join("lower"),
            volume: writable.join("volume"),
            disk,
            log: dir.join("workload.log"),
            exec_pts: dir.join("exec-pts"),
            dir,
        }
    }

    pub fn run(&self, run_id: &str) -> RunDir {
        RunDir::new(&self.dir, run_id)
    }
}

/// The run directory's file the runtime writes the pid of the run's container init to.
pub const PID_FILE: &str = "pid";

/// The run directory's files the sandbox's init writes to, made by the driver and handed to
/// it open as fds 4, 5 and 6 (in this order): the main process's status, the name of a main
/// command not found, the exec agent's log.
pub const INIT_OUTPUTS: [&str; 3] = ["exit", "not-found", "agent.log"];

/// The run directory's file the sandbox's init writes `launched` to once the main command is
/// found, made by the driver and handed to it open as fd 9 (after the log's two).
pub const LAUNCHED: &str = sbx_host_kit::run::LAUNCHED;

/// Where the runtime writes the pid of the run's container init.
pub fn pid_file(run: &RunDir) -> PathBuf {
    run.dir.join(PID_FILE)
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

/// Keeps a sandbox's state from every other local user: `bundle/` (its root filesystem while
/// mounted) and `disk/` (the writable layer and the volume) stay host root's, with the
/// sandbox root's group (its host gid) and mode 0710 — the runtime's container init walks
/// through them as that group, no one else can, and nothing of the sandbox may change what is
/// in them; the record, the runtime config (which holds the run's credentials until the
/// runtime has read it), the disk image, the log and the agent's socket are host root's, 0600.
/// Made at create, and again at each launch and open (a sandbox from before keeps nothing
/// readable past its next start).
pub fn make_private(paths: &SandboxPaths, ids: IdMap) -> io::Result<()> {
    use nix::unistd::{Gid, Uid, chown};
    for dir in [&paths.bundle, &paths.disk] {
        if dir.is_dir() {
            chown(
                dir.as_path(),
                Some(Uid::from_raw(0)),
                Some(Gid::from_raw(ids.host_gid)),
            )?;
            fs::set_permissions(dir, fs::Permissions::from_mode(0o710))?;
        }
    }
    let log_before = sbx_host_kit::logfile::previous_path(&paths.log);
    for file in [
        sbx_host_kit::records::record_file(&paths.dir),
        paths.bundle.join("config.json"),
        super::disk::image(&paths.dir),
        paths.log.clone(),
        log_before,
        paths.dir.join(sbx_host_kit::agent::SOCKET),
    ] {
        match fs::set_permissions(&file, fs::Permissions::from_mode(0o600)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

impl sbx_host_kit::sandbox_network::NetworkedRecord for OciRecord {
    fn network_allow(&self) -> Option<&Vec<String>> {
        self.network_allow.as_ref()
    }
    fn set_network_allow(&mut self, allow: Option<Vec<String>>) {
        self.network_allow = allow;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_host_kit::records::{read_json_with_format, record_file, write_json_atomically};

    fn write_record(paths: &SandboxPaths, record: &OciRecord) -> std::io::Result<()> {
        write_json_atomically(&record_file(&paths.dir), record)
    }

    fn read_record(paths: &SandboxPaths) -> std::io::Result<OciRecord> {
        read_json_with_format(&record_file(&paths.dir))
    }

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
            network_allow: None,
            id_map: Some(IdMap {
                host_uid: 1_000_000,
                host_gid: 1_000_000,
                size: 65_536,
            }),
            disk_bytes: 1 << 30,
        };
        write_record(&paths, &record).unwrap();
        assert_eq!(read_record(&paths).unwrap(), record);
        record.format = 9;
        write_record(&paths, &record).unwrap();
        assert!(read_record(&paths).is_err());
    }
}
