//! `oci`: sandboxes as OCI containers from images, run by an OCI runtime (`runc` by default).
//!
//! Each sandbox is an OCI bundle in its own directory ([`record`] lists the files): a root
//! filesystem that is an overlay of its image's layers (unpacked once in the gateway's image
//! store, shared read-only) under a writable layer of its own ([`rootfs`]), a persistent
//! volume at `/sandbox`, and a runtime config ([`bundle`]) that puts the workload behind the
//! boundary a container user expects: a user namespace (root inside is an unprivileged uid on
//! the host), its own pid/mount/uts/ipc/net/cgroup namespaces, the runtime-default
//! capabilities, `no_new_privs`, a default seccomp profile ([`seccomp`]), masked and
//! read-only `/proc` and `/sys` paths, and cpu, memory and pids limits.
//!
//! **Lifecycle.** A start mounts the overlay, writes the config and runs `runc run --detach`
//! with the log file as the container's stdout and stderr (never a pipe to the driver), so
//! the workload outlives the driver and the gateway. The container's pid 1 is a small init of
//! ours — a static busybox shell running [`INIT_SCRIPT`], bound read-only at `/dev/.sbx` —
//! that runs the image's (or the spec's) command with its stdout and stderr on a FIFO each in
//! the run directory, read by one `sbx-agent log` per stream, which appends them to the log as
//! timestamped records of their stream (see `host::logfile`; the init's own words stay
//! plain lines), forwards SIGTERM to every process of the
//! sandbox, reaps orphans, and writes the main process's status to the run directory (bound
//! at `/dev/.sbx-run`; its `hostname` file, the sandbox's name, is bound read-only at
//! `/etc/hostname`). A main command or an exec'd one that is not found is told as `command not
//! found: NAME` with 127, never in runc's words. A stop sends SIGTERM to that init, SIGKILL after the grace period,
//! then `runc delete --force` (which removes the cgroup and the runtime state) and unmounts
//! the overlay; the writable layer and the volume stay. A delete removes them too.
//!
//! **Uids.** Each sandbox has a host uid/gid range of its own (65,536 ids), leased at create
//! from the host-wide pool (`OciDriverOptions::uid_pool`, `host::uidpool`), kept in its
//! record and released once its files are gone: no two sandboxes share a host uid, so not a
//! kernel quota (the session keyring runc makes per container counts against its uid) nor a
//! file. The image store keeps one copy of each layer, its owners shifted into the store's
//! range; a start mounts each layer idmapped into the sandbox's range (`rootfs::mapped_layers`)
//! under the overlay, so nothing is copied per sandbox.
//!
//! **Identity.** A sandbox is found again after a restart of the driver by its directory
//! (named by its id), the runtime's own state (`runc --root <state>/runc list`, at open), and its
//! init's pid *and* start time, recorded after each launch (a reused pid is never taken for
//! it). The record holds the generation the run was started with.
//!
//! Known limits:
//! - The main process's status is the init shell's `$?`: an exit code of 128 + n cannot be
//!   told from death by signal n. The workload can write its own run directory (it is the
//!   init's), so a workload can misreport its own exit status, and only its own.
//! - No network beyond loopback. At most ~35 image layers (one overlay mount's options).
//! - Pause keeps the sandbox's memory resident (the cgroup freezer: see [`pause`]); nothing
//!   is saved to disk, and a paused sandbox holds its RAM until it is resumed or stopped. A
//!   pause that saves the memory and frees it (`runc checkpoint`, CRIU) cannot save a sandbox
//!   as this driver makes it: Debian 12's criu 3.17 does not start on a kernel of 6.13 or
//!   later (it cannot parse their `[vvar_vclock]` vDSO mapping; CRIU 4.1 can); the
//!   descriptors the driver hands the init (the log as stdout and stderr, the run's status
//!   files, the agent's socket, made in the host's network namespace) are outside the
//!   container, where CRIU does not find them and from where `runc restore` cannot hand them
//!   back; and CRIU drops, without a word, the Landlock domains that keep the workload out of
//!   the agent, the loggers and each exec (`sbx_agent::confine`).
//!
//! **Pause** ([`pause`]) freezes the sandbox's cgroup (`runc pause`): every process stays, with
//! its pid, open files, sockets and memory (resident), and none runs; the snapshot says
//! `Paused` under the same generation while the cgroup is frozen — the kernel's freezer, which
//! is what runc reads for `paused`, is the only record of it, so a restart finds it as it is.
//! **Resume** thaws it (`runc resume`). Exec, copies and port forwarding into a paused sandbox
//! are refused; a stop or delete thaws it first and then stops it as any other.
//!
//! **Exec.** The init also starts `sbx-agent` ([`sbx_host_kit::agent`]) on a listening socket the
//! driver binds in the sandbox's directory before each launch and hands to runc as fd 3
//! (`--preserve-fds 1`). An exec is one connection to it: the command is the agent's child,
//! so it runs inside everything the workload runs inside (namespaces, cgroup, seccomp,
//! capabilities, user) by inheritance, with stdin, a terminal, resizes and signals, in about
//! a millisecond where `runc exec` took tens.

mod bundle;
mod cgroup;
mod changes;
mod copy;
mod disk;
pub mod flags;
mod mountinfo;
mod pause;
mod record;
mod rootfs;
mod runtime;
mod seccomp;
mod service;

use std::fs::File;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::fcntl::Flock;
use uuid::Uuid;

use record::{OciRecord, SandboxPaths};
use runtime::Runtime;
use sbx_driver_api::{DriverError, pb};
use sbx_host_kit::command::RunEnv;
use sbx_host_kit::feed::{self, SnapshotFeed};
use sbx_host_kit::logfile::log_since;
use sbx_host_kit::procfs::{self, ProcessIdentity};
use sbx_host_kit::ptys;
use sbx_host_kit::records::{self, RecordCache, write_atomically};
use sbx_host_kit::sandbox_network;
use sbx_host_kit::uidpool::{self, UidPool};
use sbx_host_kit::{Alive, Desired, HostDriver, RunDir, internal, lock_state_dir, now_ms};
use sbx_images::{IdMap, ImageStore};
use sbx_network::Network;

pub use bundle::{INIT_MOUNT, VOLUME_MOUNT};
pub use flags::OciArgs;

/// The init of every oci sandbox, run by the static busybox at `/dev/.sbx/busybox` as
/// `sh /dev/.sbx/init RUN_DIR LOG_MAX USER COMMAND…` (only shell builtins: the image may have
/// no tools). The container's process is the sandbox's root; the main process becomes USER
/// (the image's User) through `sbx-agent run`, and the exec agent stays root so that an exec
/// may name any user, running as USER when it names none.
pub const INIT_SCRIPT: &str = r#"# sbx: pid 1 of an oci sandbox. Runs the command, passes SIGTERM on to every process of
# the sandbox, reaps orphans, and records the command's status in files the driver made and
# handed over open: fd 4 takes the status, fd 5 the name of a command not found, fd 6 the
# agent's words, fd 9 `launched` once the command is found (what the driver's start waits
# for, with the status); fd 3 is the agent's listening socket, fds 7 and 8 the log opened for
# reading and its previous part (the loggers keep the log within LOG_MAX bytes with them). Exec
# terminals come from the devpts instance at /dev/.sbx-pts, host root's. `$1` is a tmpfs of
# the sandbox's own (its FIFOs and the stop mark), which host code never opens.
# A stop's TERM (which pid 1 of a namespace would drop without a trap) is passed on to every
# process of the sandbox, and marked in `stopping` first: a TERM can miss the main process, one
# that comes before it is forked or while it is (a forked shell drops what its parent's trap
# caught). Its shell looks at the mark once its signals are its own, before it opens the FIFOs
# (a logger a TERM ended before it blocked signals would leave that open waiting for ever).
run="$1"; logmax="$2"; user="$3"; shift 3
trap ': > "$run/stopping"; kill -TERM -1 2>/dev/null' TERM INT
# Looked up as `sbx-agent run` will run it (a program on PATH, not one of this busybox's
# applets or a shell builtin, which `command -v` would also find).
# Not found, it says so in the log as a stderr record.
if ! /dev/.sbx/sbx-agent which --record "$1" 3<&- 4>&- 5>&- 6>&- 7<&- 8>&- 9>&-; then
  printf '%s\n' "$1" >&5
  printf '127\n' >&4
  exit 127
fi
printf 'launched\n' >&9
exec 9>&-
# The main process's stdout and stderr each go through a FIFO to a logger (`sbx-agent log`),
# which appends them to the log (this shell's stdout) as timestamped records of their stream.
# A logger opens its FIFO once it is ready for signals, and the main process's open of it
# waits for that. The loggers ignore SIGTERM: they outlive the main process.
/dev/.sbx/busybox mkfifo "$run/stdout.fifo" "$run/stderr.fifo" || exit 125
/dev/.sbx/sbx-agent log stdout "$run/stdout.fifo" --rotate "$logmax" 7 8 3<&- 4>&- 5>&- 6>&- &
out=$!
/dev/.sbx/sbx-agent log stderr "$run/stderr.fifo" --rotate "$logmax" 7 8 3<&- 4>&- 5>&- 6>&- &
err=$!
# The main process through `sbx-agent run`, which puts back the SIGINT and SIGQUIT this
# shell's `&` ignores; then the exec agent, on the listening socket the driver handed over as
# fd 3, which only the agent keeps: if it ends, a connection is refused rather than left
# waiting. Neither keeps the status files.
(
  [ ! -e "$run/stopping" ] || exit 143
  exec >"$run/stdout.fifo" 2>"$run/stderr.fifo"
  exec /dev/.sbx/sbx-agent run --user "$user" -- "$@"
) 3<&- 4>&- 5>&- 6>&- 7<&- 8>&- &
child=$!
/dev/.sbx/sbx-agent serve --pts /dev/.sbx-pts --user "$user" 2>&6 4>&- 5>&- 6>&- 7<&- 8>&- &
exec 3<&- 6>&- 7<&- 8>&-
while :; do
  wait "$child"; st=$?
  kill -0 "$child" 2>/dev/null || break
done
# The main process is gone (a process it left may still hold a FIFO): each logger writes
# what is left in its FIFO and ends, before the status is told.
kill -USR1 "$out" "$err" 2>/dev/null
for p in "$out" "$err"; do
  while kill -0 "$p" 2>/dev/null; do wait "$p"; done
done
printf '%s\n' "$st" >&4
exit "$st"
"#;

/// How the oci driver is set up.
#[derive(Debug, Clone)]
pub struct OciDriverOptions {
    /// The OCI runtime binary; default `runc` on PATH.
    pub runtime: Option<PathBuf>,
    /// A static busybox for the sandbox init; default `/bin/busybox`, else `/usr/bin/busybox`.
    pub busybox: Option<PathBuf>,
    /// The cgroup (from each hierarchy's root) under which sandbox cgroups are made.
    pub cgroup_parent: String,
    /// The image store's uid/gid range (its layers' owners are shifted into it), and the
    /// range of every sandbox when there is no `uid_pool`.
    pub id_map: IdMap,
    /// Where each sandbox's own range comes from (see `host::uidpool`); `None`: every
    /// sandbox shares `id_map`.
    pub uid_pool: Option<UidPool>,
    /// The most processes (threads included) one sandbox may have.
    pub pids_limit: i64,
    /// The most processes every sandbox of this driver may have together: the `pids.max` of
    /// `cgroup_parent` (`host::budgets`). `None`: half of what the kernel allows.
    pub pids_total: Option<u64>,
    /// How long a stop waits after SIGTERM before SIGKILL when the request says 0.
    pub default_grace: Duration,
    /// How often the watch task looks for workloads that changed by themselves.
    pub poll_interval: Duration,
    /// The most bytes a sandbox's log keeps on disk, with its previous part (see the agent's
    /// `log` module); at least `sbx_agent::log::MIN_CAP`.
    pub log_max: u64,
    /// The most ptys each devpts instance of a sandbox holds (its `/dev/pts`, and the exec
    /// instance): see `host::ptys`.
    pub max_ptys: u32,
    /// The gateway's sandbox network, shared with its other host drivers; `None`: sandboxes
    /// have loopback only and a create with network mode policy is refused.
    pub network: Option<Arc<Network>>,
}

impl Default for OciDriverOptions {
    fn default() -> Self {
        OciDriverOptions {
            runtime: None,
            busybox: None,
            cgroup_parent: "sbx-oci".to_string(),
            id_map: IdMap::default(),
            uid_pool: Some(UidPool::default()),
            pids_limit: 1024,
            pids_total: None,
            default_grace: Duration::from_secs(5),
            poll_interval: Duration::from_millis(250),
            log_max: sbx_host_kit::logfile::DEFAULT_LOG_MAX,
            max_ptys: sbx_host_kit::ptys::DEFAULT_MAX_PTYS,
            network: None,
        }
    }
}

/// The oci driver. See the module docs.
#[derive(Debug)]
pub struct OciDriver {
    inner: Arc<Inner>,
    /// Dropped with the driver: ends the watch and log streams it handed out.
    alive: Alive,
}

#[derive(Debug)]
struct Inner {
    state_dir: PathBuf,
    opts: OciDriverOptions,
    runtime: Runtime,
    images: ImageStore,
    /// The records on disk, cached, with one lock per sandbox that serialises its lifecycle
    /// calls.
    records: RecordCache<OciRecord>,
    feed: SnapshotFeed,
    /// The exclusive lock on `<state_dir>/driver.lock`.
    _instance_lock: Flock<File>,
}

impl OciDriver {
    /// Opens the driver on `state_dir`, reading images from `images`, and finds every sandbox
    /// a previous instance left there. Finishes what a killed instance left half done: empties
    /// the trash, removes creates that never wrote a record, ends interrupted stops, and
    /// deletes runtime containers that no record owns.
    pub async fn open(
        state_dir: PathBuf,
        images: ImageStore,
        opts: OciDriverOptions,
    ) -> Result<Self, DriverError> {
        if images.idmap() != opts.id_map {
            return Err(DriverError::InvalidArgument(format!(
                "the image store's id map {:?} is not the driver's {:?}",
                images.idmap(),
                opts.id_map
            )));
        }
        if let Some(pool) = &opts.uid_pool {
            sbx_host_kit::uidpool::check_apart(pool, &opts.id_map)?;
        }
        let runtime = Runtime::find(opts.runtime.as_deref(), record::runtime_root(&state_dir))?;
        let busybox =
            sbx_images::find_static_busybox(opts.busybox.as_deref(), &sbx_images::BUSYBOX_PATHS)
                .map_err(|why| {
                    DriverError::Unavailable(format!(
                        "the oci driver's sandbox init needs a static busybox: {why}"
                    ))
                })?;
        check_walkable(&state_dir)?;
        for dir in [
            state_dir.clone(),
            records::sandboxes_dir(&state_dir),
            record::init_dir(&state_dir),
        ] {
            record::make_walkable_dir(&dir)
                .map_err(|e| internal(&format!("making {}", dir.display()), e))?;
        }
        for dir in [records::trash_dir(&state_dir), runtime.root.clone()] {
            std::fs::create_dir_all(&dir)
                .map_err(|e| internal(&format!("making {}", dir.display()), e))?;
        }
        let instance_lock = lock_state_dir(&state_dir)?;
        install_init(&record::init_dir(&state_dir), &busybox)?;
        let pids_total = opts
            .pids_total
            .unwrap_or_else(sbx_host_kit::budgets::default_parent_pids);
        match sbx_host_kit::budgets::cap_parent_pids(&opts.cgroup_parent, pids_total) {
            Ok(file) => {
                tracing::debug!(file = %file.display(), pids_total, "every sandbox together is capped")
            }
            Err(why) => tracing::warn!(
                cgroup_parent = %opts.cgroup_parent,
                "the sandboxes together have no pids cap: {why}"
            ),
        }
        // A root filesystem may still be mounted in the trash, or in a half-made sandbox.
        let unmount_rootfs = |dir: &Path| {
            let paths = SandboxPaths::of_dir(dir.to_path_buf());
            let _ = rootfs::unmount(&paths);
            let _ = disk::unmount(&paths.disk);
        };
        let trash = records::trash_dir(&state_dir);
        records::empty_trash(&trash, unmount_rootfs)?;
        let sandboxes = records::sandboxes_dir(&state_dir);
        let found = records::find_records::<OciRecord>(&sandboxes, |_, dir| unmount_rootfs(dir))?;
        // The table still holds every attached sandbox's list; the resolver is told them
        // again, so the names they may resolve still resolve.
        sandbox_network::restore(
            opts.network.as_ref(),
            found
                .values()
                .map(|r| (r.sandbox_id, r.network_allow.as_ref())),
        );
        for record in found.values() {
            let paths = SandboxPaths::new(&state_dir, record.sandbox_id);
            uidpool::reclaim_at_open(
                opts.uid_pool.as_ref(),
                record.id_map,
                &paths.dir,
                record.sandbox_id,
            );
            if record.disk_bytes > 0
                && let Err(e) = disk::mount(&paths.dir, &paths.disk)
            {
                tracing::error!(sandbox_id = %record.sandbox_id, error = %e, "the sandbox's disk is not mounted");
            }
            let ids = record.id_map.unwrap_or(opts.id_map);
            if let Err(e) = record::make_private(&paths, ids) {
                tracing::error!(sandbox_id = %record.sandbox_id, error = %e, "the sandbox's state is not private");
            }
            pause::settle_at_open(record);
            if record.desired == Desired::Stopped {
                finish_interrupted_stop(&runtime, &paths, record).await;
            }
        }
        match runtime.list().await {
            Ok(containers) => {
                for c in containers {
                    let owned = Uuid::parse_str(&c.id).is_ok_and(|id| found.contains_key(&id));
                    if !owned {
                        tracing::warn!(container = %c.id, status = %c.status, "a runtime container without a sandbox record; deleting it");
                        if let Err(e) = runtime.delete(&c.id).await {
                            tracing::warn!(container = %c.id, error = %e, "not deleted");
                        }
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "the runtime's containers could not be listed"),
        }
        let inner = Inner {
            state_dir,
            opts,
            runtime,
            images,
            records: RecordCache::new(sandboxes, trash, found),
            feed: SnapshotFeed::new(),
            _instance_lock: instance_lock,
        };
        Ok(OciDriver {
            inner: Arc::new(inner),
            alive: Alive::new(),
        })
    }

    /// The state directory this driver keeps its sandboxes in.
    pub fn state_dir(&self) -> &Path {
        &self.inner.state_dir
    }

    /// The host ids of sandbox `id`: its own range, else the driver's shared one.
    pub fn id_map(&self, id: Uuid) -> Option<IdMap> {
        let record = self.inner.records.get(id)?;
        Some(self.inner.id_map(&record))
    }

    /// The persistent volume of sandbox `id` on the host (`/sandbox` inside it).
    pub fn volume_dir(&self, id: Uuid) -> PathBuf {
        SandboxPaths::new(&self.inner.state_dir, id).volume
    }

    /// The writable layer of sandbox `id`'s root filesystem on the host.
    pub fn upper_dir(&self, id: Uuid) -> PathBuf {
        SandboxPaths::new(&self.inner.state_dir, id).upper
    }

    /// The identity of the running init of sandbox `id`, if it runs.
    pub fn workload_identity(&self, id: Uuid) -> Option<ProcessIdentity> {
        let record = self.inner.records.get(id)?;
        self.inner.run_paths(&record).live_init()
    }

    /// The cgroup directories that exist for sandboxes under `cgroup_parent`, in every
    /// hierarchy (for leak checks).
    pub fn cgroup_leftovers(cgroup_parent: &str) -> Vec<PathBuf> {
        cgroup::children_of(cgroup_parent)
    }
}

/// The state dir's ancestors must let the sandboxes' host uid walk through them: the
/// runtime's container init, already in the user namespace, walks to the rootfs.
fn check_walkable(state_dir: &Path) -> Result<(), DriverError> {
    let mut dir = state_dir.parent();
    while let Some(d) = dir {
        if let Ok(meta) = std::fs::metadata(d)
            && meta.permissions().mode() & 0o001 == 0
        {
            return Err(DriverError::Unavailable(format!(
                "the oci driver's state dir {} is under {}, which other users cannot \
                 enter (mode {:o}); a sandbox's container init runs as an unprivileged \
                 host uid and must walk to its root filesystem: use a data dir outside it \
                 (e.g. /var/lib/sbx) or chmod o+x {}",
                state_dir.display(),
                d.display(),
                meta.permissions().mode() & 0o7777,
                d.display()
            )));
        }
        dir = d.parent();
    }
    Ok(())
}

/// Puts the init (busybox and script) in place, replacing an outdated copy.
fn install_init(dir: &Path, busybox: &Path) -> Result<(), DriverError> {
    let io = |what: &str, e: std::io::Error| internal(&format!("{what} in {}", dir.display()), e);
    let busybox = std::fs::read(busybox).map_err(|e| io("reading busybox", e))?;
    for (name, bytes, mode) in [
        ("busybox", &busybox[..], 0o755),
        ("init", INIT_SCRIPT.as_bytes(), 0o644),
        ("sbx-agent", sbx_host_kit::agent::BINARY, 0o755),
    ] {
        let path = dir.join(name);
        if std::fs::read(&path).ok().as_deref() != Some(bytes) {
            write_atomically(&path, bytes).map_err(|e| io("installing the init", e))?;
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .map_err(|e| io("setting the init's mode", e))?;
    }
    Ok(())
}

/// Ends, without grace, a workload whose stop a killed driver left unfinished.
async fn finish_interrupted_stop(runtime: &Runtime, paths: &SandboxPaths, record: &OciRecord) {
    paths
        .run(&record.run_id)
        .finish_interrupted_stop(record.sandbox_id);
    if let Err(e) = runtime.delete(&record.sandbox_id.to_string()).await {
        tracing::warn!(sandbox_id = %record.sandbox_id, error = %e, "runtime container not deleted");
    }
    let _ = rootfs::unmount(paths);
}

/// "disk full: …" once less than 1% of the sandbox's disk (at `mount_point`, `limit` bytes)
/// is free: its writes then fail with ENOSPC.
fn disk_full(mount_point: &Path, limit: u64) -> Option<String> {
    let st = nix::sys::statvfs::statvfs(mount_point).ok()?;
    let block = st.fragment_size();
    let (total, free) = (st.blocks() * block, st.blocks_available() * block);
    // Not mounted (the host's filesystem is seen): nothing to say.
    if total > limit || free.saturating_mul(100) >= total {
        return None;
    }
    Some(format!(
        "disk full: {} of the sandbox's {} disk is used; writes fail with ENOSPC (delete files, \
         or make a sandbox with a larger --disk)",
        sbx_proto::quantity::human_bytes(total - free),
        sbx_proto::quantity::human_bytes(limit)
    ))
}

impl sbx_host_kit::running::RunsInit for Inner {
    fn run_dir(&self, record: &OciRecord) -> RunDir {
        self.run_paths(record)
    }

    fn agent_dir(&self, id: Uuid) -> PathBuf {
        self.paths(id).dir
    }
}

impl Inner {
    fn paths(&self, id: Uuid) -> SandboxPaths {
        SandboxPaths::new(&self.state_dir, id)
    }

    fn run_paths(&self, record: &OciRecord) -> RunDir {
        self.paths(record.sandbox_id).run(&record.run_id)
    }

    /// The host ids of the sandbox: its own range, else the driver's shared one.
    fn id_map(&self, record: &OciRecord) -> IdMap {
        record.id_map.unwrap_or(self.opts.id_map)
    }

    /// The overlay's lower dirs for `record`: its image's layers as its range sees them.
    fn lower_dirs(
        &self,
        record: &OciRecord,
        paths: &SandboxPaths,
    ) -> Result<Vec<PathBuf>, DriverError> {
        rootfs::mapped_layers(
            &record.image.layers,
            self.opts.id_map,
            self.id_map(record),
            &paths.lower,
        )
        .map_err(DriverError::Internal)
    }
}

impl HostDriver for Inner {
    type Record = OciRecord;
    const NAME: &'static str = "oci";

    sbx_host_kit::host_driver_state!();

    fn live_init(&self, record: &OciRecord) -> Option<ProcessIdentity> {
        self.run_paths(record).live_init()
    }

    fn log_file(&self, id: Uuid) -> PathBuf {
        self.paths(id).log
    }

    /// The sandbox's network namespace, veth, rules and address lease go with it.
    async fn before_removal(&self, record: &OciRecord) -> Result<(), DriverError> {
        disk::unmount(&self.paths(record.sandbox_id).disk)?;
        sandbox_network::release(
            self.opts.network.as_ref(),
            record.sandbox_id,
            record.network_allow.as_ref(),
            "oci",
        )
        .await
    }

    /// What the sandbox looks like now, from its record, its run files and `/proc`.
    fn snapshot(&self, record: &OciRecord) -> pb::Snapshot {
        let (mut observed, init) = self.run_paths(record).observe(record.desired, || {
            cgroup::oom_kills(&record.cgroup_path) > 0
        });
        // Paused while its cgroup is frozen (see `pause`), under the same generation.
        if observed.state == pb::State::Running && self.freezer(record) == cgroup::Freezer::Frozen {
            observed = sbx_host_kit::observe::Observed {
                state: pb::State::Paused,
                exit_code: 0,
                exit_signal: 0,
                reason: "",
                message: String::new(),
            };
        }
        let instance = init.map(|i| i.to_string());
        let mut warnings = record.warnings.clone();
        if record.disk_bytes > 0
            && let Some(full) = disk_full(&self.paths(record.sandbox_id).disk, record.disk_bytes)
        {
            warnings.push(full);
        }
        let mut snapshot = observed.into_snapshot(record, record.generation, instance, warnings);
        sandbox_network::note_denials(
            self.opts.network.as_ref(),
            record.sandbox_id,
            record.network_allow.as_ref(),
            &mut snapshot,
        );
        snapshot.budget_refusals = sbx_host_kit::budgets::refusals(
            record.sandbox_id,
            &sbx_host_kit::usage::hierarchy_dirs(&record.cgroup_path),
            sandbox_network::budget_refusals(self.opts.network.as_ref(), record.sandbox_id),
        );
        snapshot
    }

    /// Starts a new run under `generation`: the record (desired running, new generation, new
    /// run id) is durable before the launch, so a driver killed meanwhile reopens to a
    /// sandbox that says its launch did not complete.
    async fn start_run(
        &self,
        mut record: OciRecord,
        generation: u64,
        run_env: RunEnv,
    ) -> Result<pb::Snapshot, DriverError> {
        let id = record.sandbox_id;
        let paths = self.paths(id);
        sbx_host_kit::run::remove_runs(&paths.dir)
            .map_err(|e| internal("removing earlier run directories", e))?;
        record.run_id = Uuid::new_v4().simple().to_string();
        record.generation = generation;
        record.desired = Desired::Running;
        record.launched_at_ms = now_ms();
        self.records.save(&record)?;
        if let Err(e) = self.launch(&record, &paths, &run_env).await {
            let _ = self.runtime.delete(&id.to_string()).await;
            let _ = rootfs::unmount(&paths);
            return Err(e);
        }
        let snapshot = self.snapshot(&record);
        tracing::info!(
            sandbox_id = %id,
            generation,
            instance = %snapshot.instance_id,
            "workload started"
        );
        feed::publish(self, id, &snapshot);
        Ok(snapshot)
    }

    /// Ends the workload: a paused one thawed first (so that it gets its SIGTERM and grace
    /// period), SIGTERM to its init (which passes it on), SIGKILL after `grace`, then `runc
    /// delete --force` and the overlay unmounted. Bounded.
    async fn terminate(&self, record: &OciRecord, grace: Duration) -> Result<(), DriverError> {
        let paths = self.run_paths(record);
        let thawed = self.thaw(record).await;
        if let Err(e) = &thawed {
            // `runc delete --force` ends a frozen container too (runc 1.1.5), without grace.
            tracing::warn!(sandbox_id = %record.sandbox_id, error = %e, "a paused sandbox not thawed: ended without grace");
        }
        if thawed.is_ok()
            && let Some(init) = paths.signal_init(record.sandbox_id, grace).await
        {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while procfs::is_alive(&init) {
                if tokio::time::Instant::now() >= deadline {
                    return Err(DriverError::Internal(format!(
                        "sandbox {}'s init {init} still runs after SIGKILL",
                        record.sandbox_id
                    )));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        self.runtime
            .delete(&record.sandbox_id.to_string())
            .await
            .map_err(|e| DriverError::Internal(format!("deleting the container: {e}")))?;
        rootfs::unmount(&self.paths(record.sandbox_id)).map_err(DriverError::Internal)
    }

    /// The sandbox's uid range goes back to the pool once its files are gone.
    fn after_removal(&self, record: &OciRecord) {
        uidpool::release_for(
            self.opts.uid_pool.as_ref(),
            record.id_map,
            &self.paths(record.sandbox_id).dir,
        );
    }
}

impl Inner {
    /// A create's network request, checked against what this driver has.
    pub(crate) fn network_allow(
        &self,
        policy: Option<&pb::NetworkPolicy>,
    ) -> Result<Option<Vec<String>>, DriverError> {
        sbx_network::requested(policy, self.opts.network.as_ref())
    }

    /// Mounts the root filesystem, writes the runtime config and runs the container; records
    /// the init's identity.
    async fn launch(
        &self,
        record: &OciRecord,
        paths: &SandboxPaths,
        run_env: &RunEnv,
    ) -> Result<(), DriverError> {
        let id = record.sandbox_id.to_string();
        let run = paths.run(&record.run_id);
        let io = |what: &str, e: std::io::Error| internal(what, e);
        // The run directory is host root's (0711: the container's init walks through it to the
        // files bound into the sandbox, and can neither list nor change it). What the init
        // says goes into files made here and handed to it open (see INIT_SCRIPT).
        std::fs::create_dir_all(&run.dir).map_err(|e| io("making the run directory", e))?;
        std::fs::set_permissions(&run.dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| io("setting the run directory's mode", e))?;
        let made = |name: &str| {
            std::fs::OpenOptions::new()
                .append(true)
                .create_new(true)
                .mode(0o600)
                .open(run.dir.join(name))
                .map(std::os::fd::OwnedFd::from)
                .map_err(|e| io(&format!("making the run's {name}"), e))
        };
        let mut handed = Vec::new();
        for name in record::INIT_OUTPUTS {
            handed.push(made(name)?);
        }
        let launched_file = made(record::LAUNCHED)?;
        // No container holds the id here (no `runc delete` first, ≈ 3 ms a launch): a known
        // sandbox is terminated (its container deleted) before every new run, a new id has
        // never had one, and `open` deletes the containers no record owns.
        let layers = self.lower_dirs(record, paths)?;
        rootfs::mount_overlay(&layers, &paths.upper, &paths.work, &paths.rootfs)
            .map_err(DriverError::Internal)?;
        rootfs::unmount_layers(&paths.lower).map_err(DriverError::Internal)?;
        // Checked here, so that a user the image does not have fails the start, said once;
        // the container runs as the sandbox's root and the init hands the image's User to
        // the main process and to the exec agent (see `INIT_SCRIPT`).
        rootfs::resolve_user(&record.image.user, &paths.rootfs)
            .map_err(|e| DriverError::InvalidArgument(format!("the image's user: {e}")))?;
        write_host_file(
            &run.dir.join(bundle::HOSTNAME_FILE),
            format!("{}\n", record.name).as_bytes(),
            0o444,
        )
        .map_err(|e| io("writing the sandbox's hostname file", e))?;
        let attached = sandbox_network::attach(
            self.opts.network.as_ref(),
            record.sandbox_id,
            record.network_allow.as_ref(),
        )
        .await?;
        if let Some(a) = &attached {
            sandbox_network::write_resolv_conf(&run.dir, a.gateway)?;
        }
        let netns = attached.map(|a| a.netns_path);
        let init_dir = record::init_dir(&self.state_dir);
        let mut args = vec![
            format!("{INIT_MOUNT}/busybox"),
            "sh".to_string(),
            format!("{INIT_MOUNT}/init"),
            bundle::RUN_MOUNT.to_string(),
            self.opts.log_max.to_string(),
            record.image.user.clone(),
        ];
        args.extend(record.image.args.iter().cloned());
        let mut spec = bundle::RunSpec {
            hostname: &record.name,
            args,
            env: with_run_env(&record.image.env, run_env),
            cwd: &record.image.cwd,
            user: bundle::ProcessUser::default(),
            id_map: self.id_map(record),
            cgroup_path: &record.cgroup_path,
            cpu_millis: record.cpu_millis,
            memory_bytes: record.memory_bytes,
            pids_limit: self.opts.pids_limit,
            max_ptys: self.opts.max_ptys,
            volume: &paths.volume,
            init_dir: &init_dir,
            run_dir: &run.dir,
            exec_pts: &paths.exec_pts,
            netns: netns.as_deref(),
        };
        let config_file = paths.bundle.join("config.json");
        // Host root's alone (0600, in a directory only the sandbox's root walks through): it
        // holds the run's credentials until the runtime has read it.
        let write_config = |spec: &bundle::RunSpec<'_>| {
            let config = serde_json::to_vec_pretty(&bundle::runtime_config(spec))
                .map_err(|e| internal("encoding the runtime config", e))?;
            write_host_file(&config_file, &config, 0o600)
                .map_err(|e| io("writing the runtime config", e))
        };
        record::make_private(paths, self.id_map(record))
            .map_err(|e| io("making the sandbox's state private", e))?;
        write_config(&spec)?;
        let log_start = std::fs::metadata(&paths.log).map(|m| m.len()).unwrap_or(0);
        let agent = sbx_host_kit::agent::Listener::bind(&paths.dir)?;
        let mut fds = vec![agent.fd];
        fds.extend(handed);
        let (log_read, log_previous) = sbx_host_kit::logfile::rotation_files(&paths.log)
            .map_err(|e| io("opening the log for its rotation", e))?;
        fds.extend([log_read, log_previous, launched_file]);
        ptys::mount_exec_devpts(&paths.exec_pts, self.opts.max_ptys)?;
        let launched = self
            .runtime
            .run_detached(&id, &paths.bundle, &record::pid_file(&run), &paths.log, fds)
            .await;
        // The container has its own mount of the instance by now (or none: it did not start).
        ptys::detach_exec_devpts(&paths.exec_pts);
        // The runtime has read the config: the run's own variables (credentials) leave the
        // disk; what stays says what the image and the spec give.
        if !run_env.is_empty() {
            spec.env = record.image.env.clone();
            write_config(&spec)?;
        }
        if let Err(e) = launched {
            return Err(DriverError::Internal(format!(
                "the container did not start: {e}: {}",
                log_since(&paths.log, log_start)
            )));
        }
        let pid: i32 = sbx_host_kit::safefs::read_beneath(
            &run.dir,
            std::path::Path::new(record::PID_FILE),
            64,
        )
        .ok()
        .and_then(|t| String::from_utf8(t).ok()?.trim().parse().ok())
        .ok_or_else(|| DriverError::Internal("the runtime wrote no pid file".to_string()))?;
        // The init is recorded only once it proves to be the container's: in its cgroup.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_err(|e| internal("reading the container init's identity", e))?;
        if !procfs::in_sandbox_cgroup(pid, &id) {
            return Err(DriverError::Internal(format!(
                "the runtime's pid {pid} is not in the sandbox's cgroup"
            )));
        }
        let line = format!("{}\n", stat.trim_end());
        write_host_file(&run.init(), line.as_bytes(), 0o444)
            .map_err(|e| io("recording the init", e))?;
        // Started means the main command was found, or it has ended (a command not found is
        // then the start's answer, never a Ready a moment before an Error).
        run.wait_launched(sbx_host_kit::run::LAUNCH_WAIT).await;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_dir_under_a_closed_directory_is_refused_with_the_way_out() {
        let tmp = tempfile::tempdir().unwrap();
        let closed = tmp.path().join("closed");
        std::fs::create_dir(&closed).unwrap();
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o700)).unwrap();
        let err = check_walkable(&closed.join("oci")).unwrap_err().to_string();
        assert!(err.contains("chmod o+x") && err.contains("closed"), "{err}");
        std::fs::set_permissions(&closed, std::fs::Permissions::from_mode(0o711)).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        check_walkable(&closed.join("oci")).unwrap();
    }
}

/// Writes `bytes` to a new file `path` in a directory of host root's, with `mode` (made anew:
/// `create_new` is `O_CREAT | O_EXCL`, which follows no link and opens no existing file).
fn write_host_file(path: &std::path::Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write;
    let _ = std::fs::remove_file(path);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)?;
    file.write_all(bytes)
}

/// The container's `KEY=VALUE` environment: the image's and the spec's (`image_env`), then the
/// run's own variables, which replace a variable of the same name.
fn with_run_env(image_env: &[String], run_env: &RunEnv) -> Vec<String> {
    let mut env: Vec<String> = image_env
        .iter()
        .filter(|kv| {
            let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k);
            !run_env.contains_key(key)
        })
        .cloned()
        .collect();
    env.extend(run_env.iter().map(|(k, v)| format!("{k}={v}")));
    env
}

#[cfg(test)]
mod run_env_tests {
    use super::*;

    #[test]
    fn the_run_env_replaces_and_adds() {
        let image = vec!["PATH=/bin".to_string(), "TOKEN=old".to_string()];
        let run: RunEnv = [("TOKEN", "new"), ("OTHER", "x")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        assert_eq!(
            with_run_env(&image, &run),
            ["PATH=/bin", "OTHER=x", "TOKEN=new"]
        );
    }
}
