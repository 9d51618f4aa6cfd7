//! What the vm driver keeps on disk per sandbox, in `<state_dir>/vms/<id>/` (host root's,
//! 0700; every file in it 0600, made with that mode, never widened):
//! - `sandbox.json`: the record (spec, desired state, the current run and its QEMU process);
//! - `generation`: the generation marker, written (durably) before each launch from the
//!   generation the gateway sent, and read back on every observation;
//! - `disk.img`: the persistent disk (raw, ext4), `/sandbox` in the guest;
//! - `root.qcow2`: a sandbox of an image: its root filesystem's changes, copy-on-write over
//!   the image's base disk (`<state_dir>/bases/<name>.ext4`, recorded as `root_base`), kept
//!   until delete;
//! - `console.log` and `console.log.1`: the guest's console, appended across boots (the
//!   sandbox's log), kept within the driver's `log_max` by the console's logger (`qemu.rs`);
//! - `qmp.sock` (QMP: a socket the driver binds and hands QEMU), `qemu.pid` (the VM's process:
//!   pid and start time, written by the driver);
//! - `chan/`: QEMU's own directory (host root's, its group the VM's, 0710: QEMU reaches into
//!   it, cannot add or remove anything), the FIFOs QEMU opens by name: `agent.in` +
//!   `agent.out` (the init's control channel), `exec-<k>.in` + `exec-<k>.out` (the exec
//!   channels of the guest's `sbx-agent`s), the VM's uid's, 0600;
//! - `memory`: a paused VM's saved state (QEMU's migration stream: its RAM and devices),
//!   written as `memory.part` and renamed when complete; removed once the VM runs again, or
//!   by a stop. Mode 0600: the guest's memory holds whatever the guest held (credentials).
//!
//! No boot's initramfs is a file: it is made in memory (a memfd, emptied once QEMU has read
//! it), so a run's credentials are never on the host's disk (`initramfs.cpio`, which earlier
//! versions wrote, is removed at open).
//!
//! The record and the marker are written atomically by the kit (`host::records`, which also
//! checks the record's format and deletes through `<state_dir>/trash/`).

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use uuid::Uuid;

use sbx_host_kit::host_record;
use sbx_host_kit::records::write_atomically;
use sbx_host_kit::{Desired, ProcessIdentity};
use sbx_images::IdMap;

pub const RECORD_FORMAT: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSpec {
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub memory_mib: u64,
    pub cpus: u32,
    pub image: String,
    /// What runs when the sandbox has an image: the guest's root is the image's (its base
    /// disk under `root.qcow2`). Absent: the busybox initramfs is the root and `command` runs.
    #[serde(default)]
    pub process: Option<GuestProcess>,
}

/// The main process of a sandbox of an image (see `sbx_host_kit::image_process`), as the
/// guest runs it in the image's root.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestProcess {
    /// The image's manifest digest: the base disk is built from it.
    pub digest: String,
    pub args: Vec<String>,
    /// `KEY=value`, in order.
    pub env: Vec<String>,
    pub cwd: String,
    /// The image's User, resolved by the guest in its root's `/etc/passwd` at each start.
    pub user: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmRecord {
    pub format: u32,
    pub sandbox_id: Uuid,
    /// Reported back in snapshots, never matched.
    pub workspace: String,
    pub name: String,
    pub spec: VmSpec,
    pub desired: Desired,
    /// The current boot: its id (in the guest's console lines), when it was launched, where
    /// its console output begins, and QEMU's process. Empty before the first launch.
    pub run_id: String,
    pub launched_at_ms: u64,
    pub console_offset: u64,
    pub qemu: Option<ProcessIdentity>,
    pub warnings: Vec<String>,
    /// The current run is paused: its state saved in `memory`, no QEMU runs (`qemu` names the
    /// last one). Meaningful only while `desired` is running (a stop discards the state).
    /// Absent in records older than pausing: false.
    #[serde(default)]
    pub paused: bool,
    /// On the gateway's network with this egress allowlist (entries as the spec gave them);
    /// `None`: loopback only. Absent in records older than the vm's network: none.
    #[serde(default)]
    pub network_allow: Option<Vec<String>>,
    /// The sandbox's host id range, leased from the host's pool (`host::uidpool`): its QEMU
    /// runs as the first uid and gid, the console's logger as the second. Absent in records
    /// older than QEMU's sandboxing: leased at the next launch.
    #[serde(default)]
    pub id_map: Option<IdMap>,
    /// A sandbox of an image: the base disk its `root.qcow2` is over (the driver opens it for
    /// QEMU, never a name the qcow2's header, which the guest's QEMU writes, says). Absent
    /// in older records: read once from the header at open.
    #[serde(default)]
    pub root_base: Option<PathBuf>,
}

impl sbx_host_kit::sandbox_network::NetworkedRecord for VmRecord {
    fn network_allow(&self) -> Option<&Vec<String>> {
        self.network_allow.as_ref()
    }
    fn set_network_allow(&mut self, allow: Option<Vec<String>>) {
        self.network_allow = allow;
    }
}

host_record!(VmRecord, RECORD_FORMAT);

#[derive(Debug, Clone)]
pub struct VmPaths {
    pub dir: PathBuf,
    pub generation: PathBuf,
    pub disk: PathBuf,
    pub root: PathBuf,
    pub console_log: PathBuf,
    pub qmp_socket: PathBuf,
    /// QEMU's directory (its working directory): the FIFOs below.
    pub chan: PathBuf,
    /// The exec channels: QEMU's `pipe` chardevs on `<exec>-<k>.in` (to the guest) and
    /// `<exec>-<k>.out` (from it), joined to the port `sbx.exec.<k>` that a `sbx-agent
    /// serve-port` in the guest serves. FIFOs, not a socket: the guest then always sees its
    /// port connected, and its agent blocks in `read` instead of polling. In `chan/`; in the
    /// sandbox's directory itself for a VM an earlier version launched (until it boots again).
    pub exec: PathBuf,
    pub pidfile: PathBuf,
    /// Where earlier versions wrote a boot's initramfs (removed at open).
    pub initramfs: PathBuf,
    /// A paused VM's saved state, complete; and the file a pause writes it to first.
    pub memory: PathBuf,
    pub memory_part: PathBuf,
}

impl VmPaths {
    pub fn new(state_dir: &Path, id: Uuid) -> VmPaths {
        let dir = vms_dir(state_dir).join(id.to_string());
        let chan = dir.join(CHAN);
        VmPaths {
            generation: dir.join("generation"),
            disk: dir.join("disk.img"),
            root: dir.join("root.qcow2"),
            console_log: dir.join("console.log"),
            qmp_socket: dir.join("qmp.sock"),
            exec: if !chan.exists() && dir.join("exec-0.in").exists() {
                dir.join(EXEC)
            } else {
                chan.join(EXEC)
            },
            chan,
            pidfile: dir.join("qemu.pid"),
            initramfs: dir.join("initramfs.cpio"),
            memory: dir.join("memory"),
            memory_part: dir.join("memory.part"),
            dir,
        }
    }
}

/// QEMU's directory in the sandbox's, and the base names of the FIFOs in it (QEMU names them
/// relative to it: its working directory).
pub const CHAN: &str = "chan";
pub const AGENT: &str = "agent";
pub const EXEC: &str = "exec";

pub fn vms_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("vms")
}

/// The generation marker: `Err` with what is wrong when it is missing or not a number.
pub fn read_generation(paths: &VmPaths) -> Result<u64, String> {
    let text = fs::read_to_string(&paths.generation)
        .map_err(|e| format!("generation marker {}: {e}", paths.generation.display()))?;
    text.trim().parse().map_err(|_| {
        format!(
            "generation marker {} holds {:?}, not a number",
            paths.generation.display(),
            text.trim()
        )
    })
}

pub fn write_generation(paths: &VmPaths, generation: u64) -> io::Result<()> {
    write_atomically(&paths.generation, format!("{generation}\n").as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sbx_host_kit::records::{read_json_with_format, record_file, write_json_atomically};

    fn write_record(paths: &VmPaths, record: &VmRecord) -> io::Result<()> {
        write_json_atomically(&record_file(&paths.dir), record)
    }

    fn read_record(paths: &VmPaths) -> io::Result<VmRecord> {
        read_json_with_format(&record_file(&paths.dir))
    }

    #[test]
    fn records_and_markers_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let id = Uuid::new_v4();
        let paths = VmPaths::new(dir.path(), id);
        fs::create_dir_all(&paths.dir).unwrap();
        let record = VmRecord {
            format: RECORD_FORMAT,
            sandbox_id: id,
            workspace: "ws".into(),
            name: "demo".into(),
            spec: VmSpec {
                command: vec!["sleep".into(), "1".into()],
                env: BTreeMap::new(),
                memory_mib: 256,
                cpus: 1,
                image: String::new(),
                process: None,
            },
            desired: Desired::Running,
            run_id: "r1".into(),
            launched_at_ms: 5,
            console_offset: 10,
            qemu: Some(ProcessIdentity {
                pid: 42,
                start_ticks: 7,
            }),
            warnings: vec![],
            paused: true,
            network_allow: Some(vec!["example.com:443".into()]),
            id_map: Some(IdMap {
                host_uid: 1_000_000,
                host_gid: 1_000_000,
                size: 65_536,
            }),
            root_base: None,
        };
        write_record(&paths, &record).unwrap();
        assert_eq!(read_record(&paths).unwrap(), record);
        // A record written before pausing existed reads as not paused.
        let mut old: serde_json::Value =
            serde_json::from_slice(&fs::read(record_file(&paths.dir)).unwrap()).unwrap();
        for newer in ["paused", "id_map", "root_base"] {
            old.as_object_mut().unwrap().remove(newer);
        }
        fs::write(record_file(&paths.dir), serde_json::to_vec(&old).unwrap()).unwrap();
        assert_eq!(
            read_record(&paths).unwrap(),
            VmRecord {
                paused: false,
                id_map: None,
                ..record.clone()
            }
        );

        assert!(
            read_generation(&paths)
                .unwrap_err()
                .contains("generation marker")
        );
        write_generation(&paths, 12).unwrap();
        assert_eq!(read_generation(&paths), Ok(12));
        fs::write(&paths.generation, "twelve").unwrap();
        assert!(
            read_generation(&paths)
                .unwrap_err()
                .contains("not a number")
        );

        let mut other = record.clone();
        other.format = 99;
        write_record(&paths, &other).unwrap();
        assert!(read_record(&paths).is_err());
    }
}
