//! `vm`: sandboxes as QEMU microVMs.
//!
//! Each sandbox is a `-machine microvm` guest (KVM when a probe boot under KVM works, TCG
//! otherwise) booting the host's Debian kernel with a busybox initramfs ([`assets`]). Its pid 1
//! is `guest/init.sh`: it mounts the sandbox's persistent disk (a raw ext4 image made with
//! `qemu-img` and `mkfs.ext4`) at `/sandbox`, runs the sandbox's command with its output on
//! the serial console (the sandbox's log file), answers ping and stop on the virtio-serial
//! port `sbx.agent` (joined by QEMU to the FIFOs `agent.in`/`agent.out` in the sandbox's
//! state directory), starts `sbx-agent serve-port` (the agent crate, the same static binary
//! the oci and process drivers run) on each of [`EXEC_CHANNELS`] (29) more ports,
//! `sbx.exec.<k>` (`exec-<k>.in`/`exec-<k>.out`),
//! and says on the console when the command is running and how it ended. It looks the
//! command up first (the command script's `--sbx-check`, after the spec's exports): a missing
//! one is said (`notfound`) and ends the run with 127 without `ready`, so the start answers
//! once the VM has ended and its snapshot says `CommandNotFound`.
//!
//! **The image** ([`base`]). A spec's image (a manifest digest in the gateway's image store,
//! which sbxd hands the driver) is the guest's root filesystem: its layers become one
//! read-only ext4 *base disk* per image (built once, with the image's own uids), and each
//! sandbox gets a qcow2 over it (`root.qcow2`, copy-on-write), so every change to its root
//! persists across stop, start, driver restarts and pause until delete. The init mounts it
//! (found by its serial, `sbx-root`) with `/proc`, `/sys`, `/dev`, and `/sandbox` bound in,
//! copies the agent to `/dev/.sbx` (the guest's own devtmpfs: nothing is written to the
//! image) and runs the command and every exec there (`chroot`): the spec's command or the
//! image's Entrypoint + Cmd, the image's Env with the spec's over it, its WorkingDir (execs
//! start there too) and its User (resolved by the guest's agent in the root's own
//! `/etc/passwd`; the exec agents drop to it once their port is open, so execs, copies and
//! forwards run as it, as an oci sandbox's do) — as the oci driver does (`sbx_host_kit::image_process`). A spec without
//! an image (a driver used without a store) boots the busybox initramfs as its root, the
//! command run in `/sandbox`.
//!
//! **The network** (`sbx_network::guest`). A sandbox with a network policy gets, in its
//! network namespace (host root's), a tap that QEMU (started there with `nsenter`) opens for
//! the guest's virtio NIC, joined by tc to the veth into the gateway's bridge; only IPv4 and
//! ARP from the guest's own MAC (from its id) and leased address pass. The guest's init sets
//! that address, its routes and `/etc/resolv.conf` (the gateway's resolver); the gateway's
//! table applies the sandbox's policy, live updates and denials as for any sandbox; delete
//! removes namespace, tap, veth, rules and lease.
//!
//! **Exec** ([`streams`]) goes through those agents, one exec per port at a time (a port is
//! one stream, not a listener), so 29 at once per VM and more wait for the first port freed: output reaches the caller as the command writes it, with no
//! cap (3 MiB in 0.1 s under TCG), and stdin, a pty (devpts is mounted in the guest), its
//! resizes, signals and a working directory reach the command. A round trip of `true` takes
//! about 13 ms under TCG (the former line protocol, which ran the command to files and sent
//! base64 at the end, capped at 1 MiB, took 43 ms). A caller that goes away, or a timeout,
//! sends SIGKILL to the command's process group; the agent cannot see a client go by
//! itself.
//!
//! **Copy and port-forward** ([`files`]) are execs too: the guest's agent run as `sbx-agent
//! pack PATH`, `unpack DEST` or `connect PORT`, the tar or the connection's bytes as its
//! stdin and stdout, its stderr line and exit status mapped to the socket drivers' errors.
//! A forwarded connection holds its port for its whole life, which is why there are 29 (the
//! most one virtio-serial device takes besides `sbx.agent`): 20 connections at once run at
//! once, each of 10 KB there and back in 2.4 s under TCG. With 4 ports a boot took 3.1 s
//! under TCG, with 29 3.8–4.6 s (each port is a chardev, a guest device and an idle agent).
//! QEMU runs
//! in a session of its own, so the VM outlives the driver and the gateway; QMP listens on a
//! Unix socket in the sandbox's state directory ([`record`] lists the files).
//!
//! **QEMU's sandbox** (`qemu.rs`). Each sandbox leases a uid range from the host's pool
//! (`host::uidpool`, as oci and process sandboxes do; released at delete): its QEMU runs as the
//! range's first uid and gid, so no two VMs share a uid and none is root. It is started
//! unprivileged (`setsid`, `nsenter` into the sandbox's network namespace or `unshare --net`
//! into an empty one, `setpriv` to the uid with no capability — none permitted, effective,
//! inheritable or in its bounding set — and `no_new_privs`), then QEMU installs its own
//! seccomp filter (`-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,
//! resourcecontrol=deny`) before it runs the guest. QEMU 7.2 cannot drop privileges itself
//! under that filter (`-runas` needs set*id, `-daemonize` a fork, both refused once the filter
//! is in), so it starts without them, and every host file it uses is handed over open: the
//! kernel and the initramfs as descriptors it reads through `/proc/self/fd`, the disks (and an
//! image's base disk, read only) as `-add-fd` fd sets under `-blockdev`, QMP's socket bound by
//! the driver, the console a pipe. It names files only in its working directory `chan/` (host
//! root's, its group the VM's, 0710): the FIFOs of the control and exec channels, its own
//! 0600. The tap in the sandbox's namespace has no owner, and only this QEMU is in that
//! namespace: it opens it with no capability. Measured under TCG: a boot (create → Running)
//! takes as long as before (see the closing note of the change for the figures).
//!
//! **Host files.** The sandbox's directory is host root's, 0700; every file in it 0600, made
//! with that mode (`record.rs` lists them). A boot's initramfs (the run's credentials, the
//! spec's environment) is never a file: a memfd, emptied once the guest booted from it.
//!
//! **Identity.** A VM is found again after a restart of the driver through its pidfile (the
//! driver's: pid and start time, so a reused pid is never taken for it), confirmed over QMP: the VM's
//! name (`-name`) must be the sandbox id, and `query-status` must answer. Sandboxes are found
//! by id only; the name is the guest's hostname, reported back and never matched.
//!
//! **Generations.** The generation marker (`generation` in the sandbox's directory) is written,
//! durably, before each launch from the generation the gateway sent, and read back on every
//! observation. A start that finds the VM running under another generation answers
//! `GenerationMismatch`, so the sandbox's actor reconciles (adopts the running VM) instead of
//! parking the sandbox in `Error`.
//!
//! **Stop** is the ACPI power button (QMP `system_powerdown`): the guest sends the command
//! SIGTERM, SIGKILL after the grace period, syncs and unmounts `/sandbox`, and resets, which
//! ends QEMU (`-no-reboot`). A guest that has not finished after the grace period plus 10 s
//! gets QMP `quit`, then SIGKILL. **Start** boots again on the same disk; **delete** removes
//! disk and state.
//!
//! **Pause** ([`pause`]) saves the VM's state (RAM and devices: QEMU's migration stream) to
//! `memory` in the sandbox's directory and ends its QEMU; the record says paused (durably), the
//! snapshot `Paused` under the same generation, and nothing watches for the VM's end meanwhile.
//! **Resume** launches QEMU with the same arguments, stopped and waiting for the state
//! (`-S -incoming defer`), loads the file, records the new QEMU (same generation, same run)
//! and lets it go on (`cont`); the file goes. The guest's processes keep their pids, memory,
//! files, sockets, and the agents their reads on the virtio ports (the FIFOs are new, the
//! guest does not see it); its clock stands still while paused. Measured under TCG, the
//! guest's memory filled with data that is not zeros: a 1 GiB guest (760 MiB saved) pauses in
//! 0.7–0.8 s and resumes in 0.8–0.9 s; 256 MiB (88 MiB saved) in 0.14–0.16 s and 0.15–0.18 s
//! (the `vm_pause_and_resume_timing` test) — the host's page cache and disk set the pace. A stop of a paused VM discards the saved state, like pulling
//! its plug at the pause (what the guest had not written to its disk is lost; ext4's journal
//! keeps the disk whole); a start of a paused VM boots afresh the same way.
//!
//! Known limits:
//! - A 30th exec or connection of one VM waits for one of the 29 to end. A command that stops reading
//!   its stdin while more input comes holds its agent's one reader, so until it ends neither
//!   its SIGKILL nor a later exec on that port gets through (that exec fails after 15 s,
//!   Unavailable, saying why).
//! - The spec's and the image's environment variable names must be shell identifiers (the
//!   command runs through a script); an exec's may be anything.
//! - The console (the log) also holds the kernel's few messages (it boots `quiet`), the
//!   init's lines and QEMU's own, read as stdout; the main process's stdout and stderr reach
//!   it through the guest agent's loggers (`sbx-agent log`) as records, apart. It is kept
//!   within the driver's `log_max` (with `console.log.1`) by a logger on the host (`sbx-agent
//!   log console`, the second uid of the sandbox's range), which outlives the driver and ends
//!   with QEMU; a guest writing faster than the disk waits on its UART, never longer. A logger
//!   killed (by host root) leaves QEMU without its console: QEMU then ends on SIGPIPE at its
//!   next console write, and the run is reported lost — not silently.
//! - What remains of QEMU's attack surface: a guest that takes QEMU over (a device-emulation
//!   bug) is the sandbox's uid on the host, with no capability, under QEMU's seccomp filter
//!   (a deny list: most system calls stay allowed). It holds the sandbox's own disks, the
//!   image's base (read only), its console pipe, QMP's socket, the FIFOs in `chan/`, and
//!   (networked) the tap in the sandbox's namespace, whose filters it cannot change (no
//!   CAP_NET_ADMIN); it can read what every local user can (world-readable host files, other
//!   users' world-readable processes' `/proc` entries), open sockets in its own namespace (an
//!   empty one without a network) and reach the host kernel's whole system call surface that
//!   the filter leaves (io_uring, user namespaces where the host allows unprivileged ones: the
//!   host's sysctls decide). Not confined by Landlock or a mount namespace, no cgroup limit on
//!   its memory beyond the guest's RAM (QEMU's own allocations are not capped), and the KVM
//!   probe's throwaway boot at open still runs as host root (a stock kernel, no guest input).
//! - A base disk stays in `<state_dir>/bases` after its image is deleted, and an old build
//!   after a new one replaced it as the image's current (sandboxes' roots may be on it),
//!   until the driver next opens: then those no sandbox's root is over go (`collect_bases`).
//!   A damaged base gets a new build for new sandboxes; those made on it keep their roots
//!   over it.
//! - A copy into or out of a stopped VM boots a helper guest on its disks ([`helper`]): a
//!   boot's seconds under TCG.
//! - Under TCG a boot takes seconds and the guest's clock rate comes from the host's
//!   `/proc/cpuinfo` (`tsc_early_khz`): microvm has no timer to calibrate against.

mod assets;
mod base;
mod cpio;
mod files;
pub mod flags;
mod guest;
mod helper;
mod pause;
mod qemu;
mod record;
mod service;
mod streams;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::fcntl::Flock;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use uuid::Uuid;

pub use assets::AssetPaths;
pub use flags::VmArgs;
pub use qemu::{Accel, EXEC_CHANNELS, host_tsc_khz, kernel_cmdline};

use assets::GuestAssets;
use guest::RunReport;
use record::{VmPaths, VmRecord};
use sbx_driver_api::{DriverError, pb};
use sbx_host_kit::command::RunEnv;
use sbx_host_kit::feed::{self, SnapshotFeed};
use sbx_host_kit::procfs::{self, ProcessIdentity};
use sbx_host_kit::records::{self, RecordCache};
use sbx_host_kit::uidpool::{self, UidPool};
use sbx_host_kit::{
    Alive, Desired, HostDriver, RunFacts, internal, lock_state_dir, locked, now_ms, observe,
};
use sbx_images::IdMap;

/// How the vm driver is set up.
#[derive(Debug, Clone)]
pub struct VmDriverOptions {
    pub assets: AssetPaths,
    /// Where the unpacked kernel and the shared initramfs are cached; default
    /// `<state_dir>/assets`. Several drivers may share one (tests do).
    pub asset_cache: Option<PathBuf>,
    /// `qemu-system-x86_64`; default: found on PATH.
    pub qemu: Option<PathBuf>,
    pub accel: Accel,
    /// Guest memory when the spec names none.
    pub memory_mib: u64,
    /// Size of a new sandbox's persistent disk.
    pub disk_mib: u64,
    /// The gateway's image store (read only): a spec's image (a manifest digest there) is
    /// the guest's root. Without it, only specs without an image are taken.
    pub images: Option<sbx_images::ImageStore>,
    /// Free space in an image's base disk: what a sandbox can add to its root filesystem
    /// (sparse: it costs the host nothing until written).
    pub root_free_mib: u64,
    /// How long a copy into or out of a stopped sandbox (through a helper guest, which holds
    /// the sandbox's lock) may go without a byte before it is ended.
    pub copy_idle_limit: Duration,
    /// The gateway's sandbox network: a sandbox with a policy gets a tap in its namespace
    /// (see `sbx_network::guest`) and its address; `None`: loopback only.
    pub network: Option<Arc<sbx_network::Network>>,
    /// How long a boot may take until the guest says its command runs (counted from when
    /// the boot gets its slot, see `max_parallel_boots`).
    pub boot_timeout: Duration,
    /// How many VMs boot at once; more wait for a slot. 0: the number of CPUs under TCG (a
    /// boot keeps a CPU busy for seconds; twenty at once on two CPUs all miss their boot
    /// timeout), four times that under KVM.
    pub max_parallel_boots: usize,
    /// How long a stop waits after SIGTERM (in the guest) when the request says 0.
    pub default_grace: Duration,
    /// How often the watch task looks for VMs that changed by themselves.
    pub poll_interval: Duration,
    /// The most a sandbox's console log and its previous part keep on disk together (the
    /// console's logger rotates it, `qemu.rs`).
    pub log_max: u64,
    /// The host's pool of uid ranges: each sandbox leases one, and its QEMU runs as the
    /// range's first uid and gid (the console's logger as the second).
    pub uid_pool: UidPool,
}

impl Default for VmDriverOptions {
    fn default() -> Self {
        VmDriverOptions {
            assets: AssetPaths::default(),
            asset_cache: None,
            qemu: None,
            accel: Accel::Auto,
            memory_mib: 256,
            disk_mib: 256,
            images: None,
            root_free_mib: 2048,
            network: None,
            copy_idle_limit: Duration::from_secs(60),
            boot_timeout: Duration::from_secs(45),
            max_parallel_boots: 0,
            default_grace: Duration::from_secs(5),
            poll_interval: Duration::from_millis(500),
            log_max: sbx_host_kit::logfile::DEFAULT_LOG_MAX,
            uid_pool: UidPool::default(),
        }
    }
}

/// The vm driver. See the module docs.
#[derive(Debug)]
pub struct VmDriver {
    inner: Arc<Inner>,
    /// Dropped with the driver: ends the watch and log streams it handed out.
    alive: Alive,
}

#[derive(Debug)]
struct Inner {
    state_dir: PathBuf,
    opts: VmDriverOptions,
    qemu: PathBuf,
    assets: GuestAssets,
    /// The images' base disks.
    bases: Arc<base::Bases>,
    /// KVM or TCG, decided once at open.
    accel: Accel,
    /// Under KVM: the group of `/dev/kvm`, which each VM's QEMU gets as its one supplementary
    /// group (it runs as the sandbox's own uid).
    kvm_group: Option<u32>,
    /// The static `sbx-agent` on the host (`<state_dir>/sbx-agent`): the consoles' logger.
    agent: PathBuf,
    tsc_khz: Option<u64>,
    /// Boot slots (see [`VmDriverOptions::max_parallel_boots`]).
    boots: tokio::sync::Semaphore,
    /// The records on disk, cached, with one lock per sandbox that serialises its lifecycle
    /// calls.
    records: RecordCache<VmRecord>,
    /// Each VM's exec channel, one exec at a time (a virtio port is one stream).
    exec_channels: streams::ExecChannels,
    exec_ids: AtomicU64,
    /// What the console said about a finished run, by sandbox: (run id, report). A run's
    /// report does not change once its VM is gone, so the log is read once.
    finished: Mutex<HashMap<Uuid, (String, RunReport)>>,
    /// The stopped sandboxes whose disks a helper guest has booted for a copy, with the
    /// helper's run id ([`helper`]).
    helpers: Mutex<HashMap<Uuid, String>>,
    /// Watch events: every change the driver makes or its poller sees.
    feed: SnapshotFeed,
    /// An exclusive `flock` on `<state_dir>/driver.lock` (see `host::lock`).
    _instance_lock: Flock<File>,
}

/// `Accel::Auto` decided: KVM if a throwaway VM boots under it ([`qemu::kvm_boots`], up to
/// 20 s where `/dev/kvm` exists but hangs). The answer is kept in the asset cache for this
/// kernel and this boot of the host (`/proc/sys/kernel/random/boot_id`), so that a restarted
/// driver — every restart of sbxd — does not probe again.
async fn probed_accel(
    qemu: &std::path::Path,
    assets: &assets::GuestAssets,
    cache: &std::path::Path,
    scratch: &std::path::Path,
) -> Accel {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let kept = (!boot.trim().is_empty()).then(|| {
        cache.join(format!(
            "accel-{}-{}",
            assets.kernel_version.replace('/', "_"),
            boot.trim()
        ))
    });
    if let Some(kept) = &kept {
        match std::fs::read_to_string(kept).as_deref().map(str::trim) {
            Ok("kvm") => return Accel::Kvm,
            Ok("tcg") => return Accel::Tcg,
            _ => {}
        }
    }
    let accel = if qemu::kvm_boots(qemu, &assets.kernel, &assets.initramfs, scratch).await {
        Accel::Kvm
    } else {
        Accel::Tcg
    };
    if let Some(kept) = &kept {
        let word = if accel == Accel::Kvm { "kvm" } else { "tcg" };
        if let Err(e) = records::write_atomically(kept, word.as_bytes()) {
            tracing::warn!(path = %kept.display(), error = %e, "the accelerator probe's answer not kept");
        }
    }
    accel
}

impl VmDriver {
    /// Opens the driver on `state_dir`: prepares the guest's kernel and initramfs, decides
    /// between KVM and TCG, and finds every VM a previous instance left (see the module docs).
    pub async fn open(state_dir: PathBuf, opts: VmDriverOptions) -> Result<Self, DriverError> {
        let qemu = qemu::find_qemu(opts.qemu.as_deref())?;
        for tool in ["qemu-img", "mkfs.ext4", "e2fsck", "unshare"] {
            if qemu::find_program(tool).is_none() {
                return Err(DriverError::Unavailable(format!(
                    "the vm driver needs {tool} on PATH; install {}",
                    match tool {
                        "qemu-img" => "qemu-utils",
                        "unshare" => "util-linux",
                        _ => "e2fsprogs",
                    }
                )));
            }
        }
        let vms = record::vms_dir(&state_dir);
        make_private_dir(&vms).map_err(|e| internal("making the state directory", e))?;
        if let Some(images) = &opts.images {
            uidpool::check_apart(&opts.uid_pool, &images.idmap())?;
        }
        let trash = records::trash_dir(&state_dir);
        std::fs::create_dir_all(&trash).map_err(|e| internal("making the trash directory", e))?;
        // The lock waits (briefly) for a previous instance: not on an async worker thread.
        let instance_lock = tokio::task::spawn_blocking({
            let state_dir = state_dir.clone();
            move || lock_state_dir(&state_dir)
        })
        .await
        .map_err(|e| internal("locking the state directory", e))??;
        let cache = opts
            .asset_cache
            .clone()
            .unwrap_or_else(|| state_dir.join("assets"));
        let asset_paths = opts.assets.clone();
        let prepare_in = cache.clone();
        let assets =
            tokio::task::spawn_blocking(move || assets::prepare(&asset_paths, &prepare_in))
                .await
                .map_err(|e| internal("preparing the guest", e))??;
        let accel = match opts.accel {
            Accel::Auto => probed_accel(&qemu, &assets, &cache, &state_dir).await,
            chosen => chosen,
        };
        tracing::info!(%accel, kernel = %assets.kernel.display(), "vm driver ready");
        records::empty_trash(&trash, |_| {})?;
        let agent = sbx_host_kit::agent::install(&state_dir)?;
        let found = tokio::task::spawn_blocking({
            let state_dir = state_dir.clone();
            let pool = opts.uid_pool.clone();
            move || find_vms(&state_dir, &pool)
        })
        .await
        .map_err(|e| internal("finding the vms", e))??;
        // The table still holds every attached sandbox's list; the resolver is told them
        // again, so the names they may resolve still resolve.
        sbx_host_kit::sandbox_network::restore(
            opts.network.as_ref(),
            found
                .values()
                .map(|r| (r.sandbox_id, r.network_allow.as_ref())),
        );
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        let slots = match (opts.max_parallel_boots, accel) {
            (0, Accel::Kvm) => 4 * cpus,
            (0, _) => cpus,
            (n, _) => n,
        };
        let bases = Arc::new(base::Bases::new(&state_dir, opts.root_free_mib)?);
        collect_bases(&bases, &found, opts.images.as_ref());
        let kvm_group = (accel == Accel::Kvm)
            .then(|| {
                use std::os::unix::fs::MetadataExt;
                std::fs::metadata("/dev/kvm").ok().map(|m| m.gid())
            })
            .flatten();
        let inner = Inner {
            bases,
            kvm_group,
            agent,
            boots: tokio::sync::Semaphore::new(slots),
            state_dir,
            opts,
            qemu,
            assets,
            accel,
            tsc_khz: qemu::host_tsc_khz(),
            records: RecordCache::new(vms, trash, found),
            exec_channels: streams::ExecChannels::default(),
            exec_ids: AtomicU64::new(1),
            finished: Mutex::new(HashMap::new()),
            helpers: Mutex::new(HashMap::new()),
            feed: SnapshotFeed::new(),
            _instance_lock: instance_lock,
        };
        Ok(VmDriver {
            inner: Arc::new(inner),
            alive: Alive::new(),
        })
    }

    /// The accelerator guests run under (decided at open).
    pub fn accel(&self) -> Accel {
        self.inner.accel
    }

    /// The state directory this driver keeps its VMs in.
    pub fn state_dir(&self) -> &Path {
        &self.inner.state_dir
    }

    /// The directory of sandbox `id` (its disk, console log, sockets and generation marker).
    pub fn sandbox_dir(&self, id: Uuid) -> PathBuf {
        VmPaths::new(&self.inner.state_dir, id).dir
    }

    /// The identity of the QEMU process of sandbox `id`, if it runs.
    pub fn vm_identity(&self, id: Uuid) -> Option<ProcessIdentity> {
        self.inner.records.get(id)?.qemu.filter(procfs::is_alive)
    }
}

/// At open: the base disks no sandbox's root is over and no create will use (superseded, or
/// of an image the store no longer holds) go ([`base::Bases::collect_unused`]). Only here,
/// before any create: a create between its base and its record is never raced. Skipped when
/// a sandbox of an image has no recorded base (its root's backing file unreadable): it may
/// be over any of them.
fn collect_bases(
    bases: &base::Bases,
    found: &HashMap<Uuid, VmRecord>,
    store: Option<&sbx_images::ImageStore>,
) {
    let unknown = found
        .values()
        .any(|r| r.spec.process.is_some() && r.root_base.is_none());
    if unknown {
        tracing::warn!("a sandbox's base disk is not known: no base disk is collected");
        return;
    }
    let in_use = found.values().filter_map(|r| r.root_base.clone()).collect();
    let (files, bytes) = bases.collect_unused(&in_use, store);
    if files > 0 {
        tracing::info!(files, bytes, "unused base disks removed");
    }
}

/// Reads every sandbox record under `state_dir` and finds its VM again: the recorded QEMU
/// identity if it is alive, else the process in QEMU's pidfile (a driver killed between the
/// launch and the record's update), each confirmed over QMP to be named after the sandbox.
/// Finishes stops that a killed driver left halfway; removes directories of creates that
/// never wrote a record.
fn find_vms(state_dir: &Path, pool: &UidPool) -> Result<HashMap<Uuid, VmRecord>, DriverError> {
    let mut records = records::find_records::<VmRecord>(&record::vms_dir(state_dir), |_, _| {})?;
    for (&id, rec) in records.iter_mut() {
        let paths = VmPaths::new(state_dir, id);
        keep_private(&paths);
        uidpool::reclaim_at_open(Some(pool), rec.id_map, &paths.dir, id);
        let mut changed = false;
        if rec.spec.process.is_some() && rec.root_base.is_none() {
            rec.root_base = base::backing_of(&paths.root, &state_dir.join("bases"));
            changed = rec.root_base.is_some();
        }
        let recorded = rec.qemu.filter(procfs::is_alive);
        let found = recorded.or_else(|| qemu::read_identity(&paths.pidfile));
        // The live QEMU of the sandbox, with its QMP status (empty when QMP did not answer).
        let mut live = None;
        if let Some(identity) = found.filter(procfs::is_alive) {
            match qemu::query(&paths.qmp_socket) {
                Ok((name, status)) if name == id.to_string() => {
                    tracing::info!(sandbox_id = %id, %identity, %status, "found the vm again");
                    changed = rec.qemu != Some(identity);
                    rec.qemu = Some(identity);
                    live = Some((identity, status));
                }
                Ok((name, _)) => {
                    tracing::error!(sandbox_id = %id, %identity, %name, "the process in the pidfile is another vm; not ours");
                    rec.qemu = None;
                }
                Err(e) => {
                    // Alive with the recorded start time: it is ours, even if QMP is busy.
                    tracing::warn!(sandbox_id = %id, %identity, error = %e, "qmp did not answer");
                    rec.qemu = rec.qemu.or(Some(identity));
                    // Only the recorded process is surely ours to end (a pidfile QEMU did not
                    // remove may name a pid now another's).
                    if recorded.is_some() {
                        live = Some((identity, String::new()));
                    }
                }
            }
            if rec.desired == Desired::Stopped {
                tracing::warn!(sandbox_id = %id, "finishing an interrupted stop");
                force_quit(&paths, identity);
            }
        }
        let live = live
            .as_ref()
            .map(|(identity, status)| (*identity, status.as_str()));
        let settled = pause::settle_at_open(&paths, rec, live);
        if changed || settled {
            let file = records::record_file(&paths.dir);
            if let Err(e) = records::write_json_atomically(&file, rec) {
                tracing::warn!(sandbox_id = %id, error = %e, "record not updated");
            }
        }
    }
    Ok(records)
}

/// Makes `dir` (and what is missing above it) host root's, 0700 (a directory made before
/// now is narrowed).
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

/// A sandbox directory made by an earlier version, made private at open: the directory 0700,
/// every file in it 0600 (its disks were 0644), a boot's initramfs (which held the run's
/// credentials) removed. Only the directory's own regular files, never through a link.
fn keep_private(paths: &VmPaths) {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(&paths.initramfs);
    let _ = std::fs::remove_file(paths.dir.join("helper.cpio"));
    if let Err(e) = std::fs::set_permissions(&paths.dir, std::fs::Permissions::from_mode(0o700)) {
        tracing::warn!(dir = %paths.dir.display(), error = %e, "the sandbox directory not made private");
    }
    for entry in std::fs::read_dir(&paths.dir)
        .into_iter()
        .flatten()
        .flatten()
    {
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if meta.is_file() && meta.permissions().mode() & 0o077 != 0 {
            let _ = std::fs::set_permissions(entry.path(), std::fs::Permissions::from_mode(0o600));
        }
    }
}

/// What the guest boots from for run `run_id` of `command` in a sandbox of no image and no
/// network: the shared initramfs (`shared`, the bytes of the assets' `initramfs.cpio`) with
/// the run's archive appended, as the driver makes a boot's. For a bare QEMU boot of the
/// driver's guest to compare the driver with (`gateway/tests/vm_bench.rs`); the driver's own
/// boots never leave it in a file.
pub fn plain_initramfs(shared: &[u8], run_id: &str, command: &[String]) -> Vec<u8> {
    let env = guest::run_env(run_id, 1, "bare", Duration::from_secs(1), None, None);
    let mut initramfs = shared.to_vec();
    initramfs.extend(assets::run_archive(
        &env,
        &guest::command_script(std::iter::empty(), command),
        None,
    ));
    initramfs
}

/// A boot's initramfs in memory, never on the disk: a memfd holding `bytes`, which QEMU reads
/// through `/proc/self/fd` (a memfd is open to whoever holds it) and the caller empties once
/// the guest has booted from it ([`forget_initramfs`]; not sooner: QMP answers while QEMU may
/// still be making the machine).
fn initramfs_in_memory(bytes: &[u8]) -> Result<std::os::fd::OwnedFd, DriverError> {
    use std::io::Write;
    let fd =
        nix::sys::memfd::memfd_create(c"sbx-initramfs", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
            .map_err(|e| internal("making the boot's initramfs in memory", e))?;
    let mut file = File::from(fd);
    file.write_all(bytes)
        .map_err(|e| internal("writing the boot's initramfs in memory", e))?;
    Ok(file.into())
}

/// Empties a boot's in-memory initramfs once the guest booted from it (QEMU keeps its
/// descriptor for its life; the run's credentials then stay only in the guest).
fn forget_initramfs(fd: &std::os::fd::OwnedFd) {
    if let Err(e) = nix::unistd::ftruncate(fd, 0) {
        tracing::warn!(error = %e, "the boot's initramfs not emptied");
    }
}

/// Ends a VM at once: QMP `quit`, then SIGKILL. Does not wait.
fn force_quit(paths: &VmPaths, identity: ProcessIdentity) {
    if qemu::command(&paths.qmp_socket, "quit").is_err() && procfs::is_alive(&identity) {
        let _ = kill(Pid::from_raw(identity.pid), Signal::SIGKILL);
    }
}

impl Inner {
    fn paths(&self, id: Uuid) -> VmPaths {
        VmPaths::new(&self.state_dir, id)
    }

    fn is_alive(rec: &VmRecord) -> bool {
        rec.qemu.as_ref().is_some_and(procfs::is_alive)
    }

    /// Whether `rec`'s run is paused: it says so, or — a copy taken before a pause recorded
    /// itself and ended its QEMU — the record now does. The poller's copy of a VM being
    /// paused must not make it look exited.
    fn is_paused(&self, rec: &VmRecord, alive: bool) -> bool {
        rec.desired == Desired::Running
            && (rec.paused
                || (!alive
                    && rec.qemu.is_some()
                    && self.records.get(rec.sandbox_id).is_some_and(|now| {
                        now.paused && now.desired == Desired::Running && now.run_id == rec.run_id
                    })))
    }

    /// What the console says about the current run of a VM that is gone (read once per run).
    fn finished_report(&self, rec: &VmRecord) -> RunReport {
        if let Some((run, report)) = locked(&self.finished).get(&rec.sandbox_id)
            && *run == rec.run_id
        {
            return report.clone();
        }
        let paths = self.paths(rec.sandbox_id);
        let report = guest::read_report(&paths.console_log, rec.console_offset, &rec.run_id);
        locked(&self.finished).insert(rec.sandbox_id, (rec.run_id.clone(), report.clone()));
        report
    }

    /// Waits until the guest of the current run says its command runs (or already ended).
    /// A guest that fails or does not boot in time is ended and the call fails with the end
    /// of its console.
    async fn wait_booted(&self, rec: &VmRecord) -> Result<(), DriverError> {
        let paths = self.paths(rec.sandbox_id);
        let deadline = tokio::time::Instant::now() + self.opts.boot_timeout;
        loop {
            let report = guest::read_report(&paths.console_log, rec.console_offset, &rec.run_id);
            let console = || qemu::console_tail(&paths.console_log, 800);
            if let Some(why) = report.fatal {
                self.terminate(rec, Duration::ZERO).await?;
                return Err(DriverError::FailedPrecondition(format!(
                    "the guest could not start the command: {}",
                    safefs_printable(&why)
                )));
            }
            if report.ready {
                return Ok(());
            }
            // The command is not there: the guest ends the run at once (exit 127). Answered
            // once it has, so the start's snapshot says so, never Running.
            if report.not_found && !Self::is_alive(rec) {
                return Ok(());
            }
            if !Self::is_alive(rec) {
                return Err(DriverError::Internal(format!(
                    "the vm ended while booting; its console ends with: {}",
                    console()
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                self.terminate(rec, Duration::ZERO).await?;
                return Err(DriverError::Unavailable(format!(
                    "the vm did not boot within {:?} ({:?}); its console ends with: {}",
                    self.opts.boot_timeout,
                    self.accel,
                    console()
                )));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A command name as the sandbox's words are shown: short and printable.
fn safefs_printable(text: &str) -> String {
    sbx_host_kit::safefs::printable(text, 200)
}

impl HostDriver for Inner {
    type Record = VmRecord;
    const NAME: &'static str = "vm";

    sbx_host_kit::host_driver_state!();

    /// The console (the guest's kernel and the command write to it).
    fn log_file(&self, id: Uuid) -> PathBuf {
        self.paths(id).console_log
    }

    fn log_poll_interval(&self) -> Duration {
        Duration::from_millis(100)
    }

    /// Nothing to keep: the disk goes too, so no graceful power-off.
    fn delete_grace(&self) -> Duration {
        Duration::ZERO
    }

    /// The sandbox's namespace (its tap and veth), rules and address lease go with it.
    async fn before_removal(&self, rec: &VmRecord) -> Result<(), DriverError> {
        sbx_host_kit::sandbox_network::release(
            self.opts.network.as_ref(),
            rec.sandbox_id,
            rec.network_allow.as_ref(),
            "vm",
        )
        .await
    }

    /// The sandbox's uid range goes back to the pool once its files are gone.
    fn after_removal(&self, rec: &VmRecord) {
        uidpool::release_for(
            Some(&self.opts.uid_pool),
            rec.id_map,
            &self.paths(rec.sandbox_id).dir,
        );
    }

    fn forget(&self, id: Uuid) {
        locked(&self.finished).remove(&id);
        self.exec_channels.remove(id);
    }

    /// What the sandbox looks like now, from its record, its generation marker, `/proc` and
    /// (for a VM that is gone) its console. A paused VM is paused, whatever its QEMU does.
    fn snapshot(&self, rec: &VmRecord) -> pb::Snapshot {
        let paths = self.paths(rec.sandbox_id);
        let alive = Self::is_alive(rec);
        let paused = self.is_paused(rec, alive);
        let report = if !paused && !alive && rec.qemu.is_some() && rec.desired == Desired::Running {
            self.finished_report(rec)
        } else {
            RunReport::default()
        };
        let mut observed = if paused {
            observe::Observed {
                state: pb::State::Paused,
                exit_code: 0,
                exit_signal: 0,
                reason: "",
                message: String::new(),
            }
        } else {
            observe::observe(RunFacts {
                desired: rec.desired,
                init_recorded: rec.qemu.is_some(),
                alive,
                exit_status: report.exit,
                oom_killed: report.oom,
            })
        };
        if report.not_found && observed.exit_code == 127 {
            observed.reason = "CommandNotFound";
            observed.message = format!(
                "command not found: {} (the main process exited with code 127)",
                safefs_printable(
                    rec.spec
                        .process
                        .as_ref()
                        .map_or(&rec.spec.command, |p| &p.args)
                        .first()
                        .map_or("", |c| c.as_str())
                )
            );
        } else if let Some(why) = &report.fatal {
            observed.reason = "GuestFailed";
            observed.message = format!(
                "the guest's init could not run the command: {}",
                safefs_printable(why)
            );
        } else if observed.reason == "Lost" {
            observed.message = "the VM ended without the guest reporting an exit (QEMU was \
                                killed, or the guest crashed)"
                .to_string();
        }
        let mut warnings = rec.warnings.clone();
        let generation = match record::read_generation(&paths) {
            Ok(generation) => generation,
            Err(why) => {
                warnings.push(why);
                0
            }
        };
        let instance = rec.qemu.map(|identity| format!("qemu {identity}"));
        let mut snapshot = observed.into_snapshot(rec, generation, instance, warnings);
        sbx_host_kit::sandbox_network::note_denials(
            self.opts.network.as_ref(),
            rec.sandbox_id,
            rec.network_allow.as_ref(),
            &mut snapshot,
        );
        snapshot
    }

    /// Boots the VM under `generation`: the marker and the record (desired running, a new run)
    /// are durable before QEMU starts; the call returns when the guest says its command runs.
    async fn start_run(
        &self,
        mut rec: VmRecord,
        generation: u64,
        run_env: RunEnv,
    ) -> Result<pb::Snapshot, DriverError> {
        let id = rec.sandbox_id;
        // The run's variables are exported by the guest's shell: names must be identifiers.
        service::validate_env_names("the run's environment", run_env.keys())?;
        let paths = self.paths(id);
        record::write_generation(&paths, generation)
            .map_err(|e| internal("writing the generation marker", e))?;
        rec.run_id = Uuid::new_v4().simple().to_string();
        rec.desired = Desired::Running;
        rec.launched_at_ms = now_ms();
        rec.console_offset = std::fs::metadata(&paths.console_log)
            .map(|m| m.len())
            .unwrap_or(0);
        rec.qemu = None;
        // A boot afresh (a start of a paused VM too): a saved state would not match the disk
        // once the new guest writes it.
        rec.paused = false;
        self.records.save(&rec)?;
        pause::remove_saved(&paths);

        self.ids_of(&mut rec)?;
        let attached = self.attach(&rec).await?;
        let initramfs = initramfs_in_memory(&self.boot_initramfs(
            &rec,
            generation,
            &run_env,
            attached.as_ref().map(|a| (a.address, a.gateway)),
            false,
        )?)?;
        let _slot = match self.boots.try_acquire() {
            Ok(slot) => slot,
            Err(_) => {
                tracing::info!(sandbox_id = %id, "waiting for a boot slot");
                self.boots
                    .acquire()
                    .await
                    .map_err(|e| internal("waiting for a boot slot", e))?
            }
        };
        let launch = self.launch_of(
            id,
            &rec,
            &paths,
            std::os::fd::AsFd::as_fd(&initramfs),
            false,
            attached.as_ref().map(|a| a.netns_path.as_path()),
        )?;
        let launched = launch.launch().await;
        let identity = launched?;
        rec.qemu = Some(identity);
        self.records.save(&rec)?;
        let booted = self.wait_booted(&rec).await;
        // The guest runs from the initramfs QEMU loaded (and copies from its own memory on a
        // reset): the run's credentials leave the memfd.
        forget_initramfs(&initramfs);
        if let Err(e) = booted {
            // The launch did not complete: the sandbox says NotStarted, and a retried create
            // or start boots it again. Only once its QEMU is gone: a live one stays tracked.
            if !Self::is_alive(&rec) {
                rec.qemu = None;
                self.records.save(&rec)?;
            }
            return Err(e);
        }
        let snapshot = self.snapshot(&rec);
        tracing::info!(sandbox_id = %id, generation, %identity, "vm booted");
        feed::publish(self, id, &snapshot);
        Ok(snapshot)
    }

    /// Ends the VM: the power button, then (after `grace` + 10 s for the guest to end its
    /// command, sync and reset) QMP `quit`, then SIGKILL. `grace` zero skips the power button.
    /// Bounded: fails if QEMU is still alive 5 s after SIGKILL. A paused VM being stopped or
    /// deleted (desired stopped) has its saved state discarded; a paused VM's QEMU (one still
    /// ending after its pause) is stopped, so no power button for it.
    async fn terminate(&self, rec: &VmRecord, grace: Duration) -> Result<(), DriverError> {
        let grace = if rec.paused { Duration::ZERO } else { grace };
        if rec.paused && rec.desired == Desired::Stopped {
            self.discard_saved(rec)?;
        }
        let Some(identity) = rec.qemu.filter(procfs::is_alive) else {
            return Ok(());
        };
        let paths = self.paths(rec.sandbox_id);
        let qmp = paths.qmp_socket.clone();
        let ask = |command: &'static str| {
            let qmp = qmp.clone();
            tokio::task::spawn_blocking(move || qemu::command(&qmp, command))
        };
        let wait_gone = |limit: Duration| async move {
            let deadline = tokio::time::Instant::now() + limit;
            while procfs::is_alive(&identity) && tokio::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            !procfs::is_alive(&identity)
        };
        if !grace.is_zero() {
            match ask("system_powerdown").await {
                Ok(Ok(())) => {
                    if wait_gone(grace + Duration::from_secs(10)).await {
                        return Ok(());
                    }
                    tracing::warn!(sandbox_id = %rec.sandbox_id, ?grace, "the guest did not power off; quit");
                }
                Ok(Err(e)) => {
                    tracing::warn!(sandbox_id = %rec.sandbox_id, error = %e, "system_powerdown failed; quit");
                }
                Err(e) => tracing::warn!(error = %e, "qmp task failed"),
            }
        }
        if matches!(ask("quit").await, Ok(Ok(()))) && wait_gone(Duration::from_secs(3)).await {
            return Ok(());
        }
        let _ = kill(Pid::from_raw(identity.pid), Signal::SIGKILL);
        if wait_gone(Duration::from_secs(5)).await {
            Ok(())
        } else {
            Err(DriverError::Internal(format!(
                "the vm of sandbox {} ({identity}) is still alive after SIGKILL",
                rec.sandbox_id
            )))
        }
    }
}

impl Inner {
    /// What one boot of `rec`'s guest starts from: the shared initramfs with the run's own
    /// archive appended (run.env, the command script, the image's environment). A `helper`
    /// boot (a copy of a stopped sandbox, [`helper`]) runs no command, as the guest's root,
    /// with no network.
    fn boot_initramfs(
        &self,
        rec: &VmRecord,
        generation: u64,
        run_env: &RunEnv,
        network: Option<(std::net::Ipv4Addr, std::net::Ipv4Addr)>,
        helper: bool,
    ) -> Result<Vec<u8>, DriverError> {
        let mut initramfs = std::fs::read(&self.assets.initramfs)
            .map_err(|e| internal("reading the shared initramfs", e))?;
        let command = match &rec.spec.process {
            Some(process) => guest::image_script(process, run_env),
            None => guest::command_script(
                rec.spec
                    .env
                    .iter()
                    .filter(|(k, _)| !run_env.contains_key(*k))
                    .chain(run_env),
                &rec.spec.command,
            ),
        };
        // A helper's copy is the guest root's, whatever the image's User, as a stopped oci
        // sandbox's is (`sbx-agent offline`).
        let image = rec.spec.process.as_ref().map(|p| {
            let user = if helper { "" } else { p.user.as_str() };
            (p.cwd.as_str(), user)
        });
        let mut env = guest::run_env(
            &rec.run_id,
            generation,
            &rec.name,
            self.opts.default_grace,
            image,
            network,
        );
        if helper {
            env.push_str("SBX_HELPER=1\n");
        }
        initramfs.extend(assets::run_archive(
            &env,
            &command,
            rec.spec.process.as_ref().map(guest::process_env).as_deref(),
        ));
        Ok(initramfs)
    }

    /// The sandbox's place on the gateway's network (its namespace, tap, filters, address
    /// and policy; made when missing, kept when whole), or `None` for loopback only.
    async fn attach(&self, rec: &VmRecord) -> Result<Option<sbx_network::Attachment>, DriverError> {
        sbx_host_kit::sandbox_network::attach_guest(
            self.opts.network.as_ref(),
            rec.sandbox_id,
            rec.network_allow.as_ref(),
        )
        .await
    }

    /// The sandbox's host ids (its QEMU's uid and gid): leased for a sandbox whose record has
    /// none yet (made before QEMU ran unprivileged), and recorded.
    fn ids_of(&self, rec: &mut VmRecord) -> Result<IdMap, DriverError> {
        if let Some(map) = rec.id_map {
            return Ok(map);
        }
        let map = self.opts.uid_pool.lease(&self.paths(rec.sandbox_id).dir)?;
        rec.id_map = Some(map);
        self.records.save(rec)?;
        Ok(map)
    }

    /// How QEMU is launched for sandbox `id`: booting from `initramfs`, or (`incoming`)
    /// stopped, waiting to load a paused VM's saved state. The record names its ids
    /// ([`Inner::ids_of`]).
    fn launch_of<'a>(
        &'a self,
        id: Uuid,
        rec: &'a VmRecord,
        paths: &'a VmPaths,
        initramfs: std::os::fd::BorrowedFd<'a>,
        incoming: bool,
        netns: Option<&'a Path>,
    ) -> Result<qemu::VmLaunch<'a>, DriverError> {
        let root = match (&rec.spec.process, &rec.root_base) {
            (None, _) => None,
            (Some(_), Some(base)) => Some((paths.root.as_path(), base.as_path())),
            (Some(_), None) => {
                return Err(DriverError::Internal(format!(
                    "sandbox {id}: the base disk under its root disk is not known; delete it \
                     and create it again"
                )));
            }
        };
        let ids = rec.id_map.ok_or_else(|| {
            DriverError::Internal(format!("sandbox {id} has no host ids to run its vm as"))
        })?;
        Ok(qemu::VmLaunch {
            qemu: &self.qemu,
            name: id.to_string(),
            accel: self.accel,
            kernel: &self.assets.kernel,
            initramfs,
            disk: &paths.disk,
            root,
            net: netns.map(|ns| (ns, sbx_network::guest::guest_mac(id))),
            console_log: &paths.console_log,
            qmp_socket: &paths.qmp_socket,
            chan: &paths.chan,
            pidfile: &paths.pidfile,
            memory_mib: rec.spec.memory_mib,
            cpus: rec.spec.cpus,
            tsc_khz: self.tsc_khz,
            incoming,
            ids,
            kvm_group: self.kvm_group,
            logger: &self.agent,
            log_max: self.opts.log_max,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_probes_answer_is_kept_for_this_kernel_and_boot() {
        let cache = tempfile::tempdir().unwrap();
        let assets = assets::GuestAssets {
            kernel: cache.path().join("no-kernel"),
            compressed_kernel: false,
            initramfs: cache.path().join("no-initramfs"),
            kernel_version: "6.1.0-test".into(),
        };
        // No QEMU at this path: the probe fails, TCG, and the answer is kept.
        let no_qemu = cache.path().join("no-qemu");
        assert_eq!(
            probed_accel(&no_qemu, &assets, cache.path(), cache.path()).await,
            Accel::Tcg
        );
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
        let kept = cache
            .path()
            .join(format!("accel-6.1.0-test-{}", boot.trim()));
        assert_eq!(std::fs::read_to_string(&kept).unwrap(), "tcg");
        // A kept answer is taken as it is, without probing.
        std::fs::write(&kept, "kvm").unwrap();
        assert_eq!(
            probed_accel(&no_qemu, &assets, cache.path(), cache.path()).await,
            Accel::Kvm
        );
        // Another kernel is probed anew.
        let other = assets::GuestAssets {
            kernel_version: "6.2.0-test".into(),
            ..assets
        };
        assert_eq!(
            probed_accel(&no_qemu, &other, cache.path(), cache.path()).await,
            Accel::Tcg
        );
    }
}
