//! `process`: sandboxes as namespaced process trees on this machine, for trusted work (light:
//! no image, no VM; see the known limits for what a workload still shares with the host).
//!
//! Each sandbox's workload runs in its own pid, mount, uts, ipc and net namespaces (hostname =
//! sandbox name, only `lo`, up; or, made with an egress policy on a gateway with a network,
//! the namespace `host::network` made for it, joined with `nsenter`), in its own cgroup
//! carrying the spec's cpu and memory limits (v1 or v2, whichever the host has), with a persistent directory bound at `/sandbox`. It runs
//! as uid 0 of a user namespace of its own that is host uid 200000 outside (the id map,
//! [`ProcessDriverOptions::id_map`]), with no capabilities and `no_new_privs`; that user
//! namespace owns none of the other namespaces, so root inside can change none of them (see
//! `userns.rs`). The driver's state directory and [`ProcessDriverOptions::hidden_paths`] are
//! hidden under an empty read-only tmpfs each, so one sandbox cannot read another's files or
//! the gateway's store. It is
//! started in its own session with its output going to a log file, so it outlives the driver
//! and the gateway; everything a restarted driver needs is in `<state_dir>/sandboxes/<id>/`
//! (see [`record`]). A workload is identified by its init's pid *and* start time, so a reused
//! pid is never mistaken for it.
//!
//! Exit detection does not need the workload to be our child: a shell shim, pid 1 of the
//! sandbox, waits for the main process and writes its status to the run directory; the driver
//! polls for the init's disappearance (see [`launch`] and [`sbx_host_kit::observe`]).
//!
//! What the workload gets is its own, not the driver's: the environment is a fixed base (see
//! [`launch::workload_env`]: a default PATH, HOME, HOSTNAME, SBX_SANDBOX_ID) plus the spec's;
//! `ps` inside shows pid 1 as `/bin/sh <state>/sbx-shim …` and the main process as its child,
//! under its own command line; a command not found is told as `command not found: NAME` with
//! 127, never by the wrappers' names.
//!
//! **Invariant:** sandboxes are found by id only (their directory is named by the id); the
//! name is the hostname and is reported back, never matched.
//!
//! **Invariant:** at most one live driver instance per state directory (an exclusive `flock`
//! on `<state_dir>/driver.lock`, released by the kernel if the driver process dies).
//!
//! Needs: root; util-linux (`unshare`, `setsid`, `setpriv`), `ip` (iproute2), the
//! setuid helpers `newuidmap`/`newgidmap` (Debian: `uidmap`) and a `root:200000:65536` line in
//! `/etc/subuid` and in `/etc/subgid` (for the default map). `open` checks them and says what
//! to install or add.
//!
//! Tried as an attacker from inside (`drivers/tests/process_boundary.rs`), a workload cannot
//! read `/etc/shadow` or a file in `/root`, write `/root`, a sysctl or any `cgroup.procs`,
//! unmount `/proc` (nor anything else: every mount is host root's), `nsenter` another network
//! namespace, change its hostname, or see the state directory; it has no capability
//! (`CapEff` 0), and files it writes to `/sandbox` are owned by host uid 200000.
//!
//! Known limits (say them, do not hide them):
//! - A light boundary, for trusted work; the kernel is the host's, with no seccomp filter. The
//!   workload sees the host's root filesystem (no image: the spec's `image` is ignored with a
//!   warning) as an unprivileged stranger (host uid 200000) sees it, minus the hidden paths: it
//!   reads what is world-readable (`/etc`, `/usr`, other users' readable files, `/proc/sys`,
//!   `/sys`), writes what is world-writable — and `/tmp`, `/var/tmp` and `/dev/shm` are the
//!   host's, shared with the host and every other sandbox — and can connect to any Unix socket
//!   on the filesystem that lets others in. Host uids 200000..265535 are the sandboxes' (all of
//!   them share the one map): a file another sandbox left world-readable in a shared place is
//!   readable, and host users in that range are the sandboxes' roots.
//! - `/sandbox` is made on the host's root, empty, as a mount point if it is missing. A host
//!   file put into a persistent directory must be owned by the map (uid 200000) or be
//!   world-accessible for the workload to use it.
//! - `/etc` is the host's, so `/etc/hostname` names the host while `hostname` names the
//!   sandbox (a per-sandbox file would need a mount over the host's `/etc/hostname` in every
//!   sandbox's mount namespace; not done).
//! - The shim sees the main process's status as a shell does: an exit code of 128 + n cannot
//!   be told from death by signal n (both are reported as signal n).
//! - The `unshare` that launched a workload stays its parent; after the driver dies it is
//!   re-parented to the host's init, which must reap it (a container whose pid 1 does not
//!   reap keeps it as a zombie, harmless but visible).
//! - cgroup v2: controllers are delegated from the driver's own cgroup. A cgroup that holds
//!   processes (anything but the machine's real root, e.g. a container's namespaced root, or a
//!   systemd unit's cgroup holding the gateway) cannot delegate; limits are then not applied
//!   and every snapshot's warnings say so. Run the gateway in a cgroup that delegates (move it
//!   into a leaf first, as container-in-container setups do). Not exercised on this machine,
//!   whose v2 hierarchy carries no memory or cpu controller.
//! - Descriptors that the driver's process inherited without close-on-exec are closed by a
//!   bash prelude before `setsid` runs (closing them in Rust needs `pre_exec`, unsafe code the
//!   workspace forbids). On a host without bash they pass on to workloads, and each sandbox's
//!   warnings say so.
//! - Exec, copy and port-forward go through the sandbox's `sbx-agent` (see
//!   [`sbx_host_kit::agent`]), which runs as the workload's kind of user (uid 0 of its own user
//!   namespace, host uid 200000): an exec'd command, a copied file and a forwarded connection
//!   can do what the workload can, nothing more. The `unshare` that launched the sandbox keeps
//!   the agent's listening socket open (it passes descriptors on); an agent that died is told
//!   by its missing greeting, not by a refused connection.

mod cgroup;
mod copy;
pub mod flags;
pub(crate) mod launch;
pub(crate) mod record;
mod service;
mod userns;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use nix::fcntl::Flock;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use uuid::Uuid;

pub use cgroup::CgroupVersion;
pub use flags::ProcessArgs;
pub use sbx_host_kit::ProcessIdentity;
use sbx_images::IdMap;

use cgroup::CgroupHost;
use launch::HostTools;
use record::{SandboxPaths, SandboxRecord};
use sbx_driver_api::{DriverError, pb};
use sbx_host_kit::command::RunEnv;
use sbx_host_kit::feed::{self, SnapshotFeed};
use sbx_host_kit::records::{self, RecordCache};
use sbx_host_kit::uidpool::{self, UidPool};
use sbx_host_kit::{
    Alive, Desired, HostDriver, RunDir, internal, lock_state_dir, now_ms, procfs, sandbox_network,
};

/// How the process driver is set up.
#[derive(Debug, Clone)]
pub struct ProcessDriverOptions {
    /// The cgroup under which sandbox cgroups are made, relative to the driver's own cgroup in
    /// each hierarchy (tests use their own, to check that nothing leaks).
    pub cgroup_parent: String,
    /// How long a stop waits after SIGTERM before SIGKILL when the request says 0.
    pub default_grace: Duration,
    /// How often the watch task looks for workloads that changed by themselves.
    pub poll_interval: Duration,
    /// How long a launch may take until the sandbox's init reports.
    pub launch_timeout: Duration,
    /// The host ids a workload's uid and gid 0.. are (see `userns.rs`); the image store's
    /// default, 200000..265535, unless set. `/etc/subuid` and `/etc/subgid` must grant it to
    /// root.
    pub id_map: IdMap,
    /// Where each sandbox's own range comes from (`host::uidpool`); root's subordinate ids
    /// must cover the whole pool. `None`: every sandbox shares `id_map`.
    pub uid_pool: Option<UidPool>,
    /// Paths hidden from every workload besides the driver's state directory, each under an
    /// empty read-only tmpfs (sbxd puts its data directory here). Absolute; a missing one is
    /// skipped.
    pub hidden_paths: Vec<PathBuf>,
    /// The gateway's sandbox network; `None`: sandboxes have loopback only and a create with
    /// network mode policy is refused.
    pub network: Option<Arc<sbx_network::Network>>,
    /// The most bytes a sandbox's log keeps on disk, with its previous part (see the agent's
    /// `log` module); at least `sbx_agent::log::MIN_CAP`.
    pub log_max: u64,
    /// The most ptys the sandbox's devpts instance holds (see `host::ptys`).
    pub max_ptys: u32,
}

impl Default for ProcessDriverOptions {
    fn default() -> Self {
        ProcessDriverOptions {
            cgroup_parent: "sbx".to_string(),
            default_grace: Duration::from_secs(5),
            poll_interval: Duration::from_millis(250),
            launch_timeout: Duration::from_secs(10),
            id_map: IdMap::default(),
            uid_pool: Some(UidPool::default()),
            hidden_paths: Vec::new(),
            network: None,
            log_max: sbx_host_kit::logfile::DEFAULT_LOG_MAX,
            max_ptys: sbx_host_kit::ptys::DEFAULT_MAX_PTYS,
        }
    }
}

/// The process driver. See the module docs.
#[derive(Debug)]
pub struct ProcessDriver {
    inner: Arc<Inner>,
    /// Dropped with the driver: ends the watch and log streams it handed out.
    alive: Alive,
}

#[derive(Debug)]
struct Inner {
    state_dir: PathBuf,
    opts: ProcessDriverOptions,
    tools: HostTools,
    cgroups: CgroupHost,
    /// What the shim hides from the workload: the state directory (canonical), then
    /// `opts.hidden_paths`.
    hidden: Vec<PathBuf>,
    /// The records on disk, cached, with one lock per sandbox that serialises its lifecycle
    /// calls (create, start, stop, delete).
    records: RecordCache<SandboxRecord>,
    /// Watch events: every change the driver makes or its poller sees.
    feed: SnapshotFeed,
    /// An exclusive `flock` on `<state_dir>/driver.lock`: two live instances on one state
    /// would launch and kill the same workloads. Released on drop, and by the kernel when the
    /// driver's process dies.
    _instance_lock: Flock<File>,
}

impl ProcessDriver {
    /// Opens the driver on `state_dir`, finding every sandbox a previous instance left there.
    /// Finishes what a killed instance left half done: empties the trash, removes directories
    /// of creates that never wrote a record, and kills workloads whose stop was interrupted.
    pub fn open(state_dir: PathBuf, opts: ProcessDriverOptions) -> Result<Self, DriverError> {
        let cgroups = CgroupHost::detect();
        let sandboxes = records::sandboxes_dir(&state_dir);
        let trash = records::trash_dir(&state_dir);
        std::fs::create_dir_all(&sandboxes)
            .map_err(|e| internal("making the state directory", e))?;
        std::fs::create_dir_all(&trash).map_err(|e| internal("making the trash directory", e))?;
        let instance_lock = lock_state_dir(&state_dir)?;
        let granted = match &opts.uid_pool {
            Some(pool) => {
                sbx_host_kit::uidpool::check_apart(pool, &opts.id_map)?;
                IdMap {
                    host_uid: pool.start,
                    host_gid: pool.start,
                    size: pool.count,
                }
            }
            None => opts.id_map,
        };
        let tools = HostTools::find(&opts.id_map, &granted, &state_dir)?;
        let hidden = hidden_paths(&state_dir, &opts.hidden_paths)?;
        records::empty_trash(&trash, |_| {})?;
        let found = records::find_records::<SandboxRecord>(&sandboxes, |id, _| {
            // No workload was launched, but its cgroups may have been made.
            for dir in cgroups.parent_dirs(&opts.cgroup_parent) {
                let _ = std::fs::remove_dir(dir.join(cgroup::leaf_name(id)));
            }
        })?;
        for record in found.values() {
            uidpool::reclaim_at_open(
                opts.uid_pool.as_ref(),
                record.id_map,
                &SandboxPaths::new(&state_dir, record.sandbox_id).dir,
                record.sandbox_id,
            );
            if record.desired == Desired::Stopped {
                finish_interrupted_stop(&SandboxPaths::new(&state_dir, record.sandbox_id), record);
            }
        }
        sandbox_network::restore(
            opts.network.as_ref(),
            found
                .values()
                .map(|r| (r.sandbox_id, r.network_allow.as_ref())),
        );
        let inner = Inner {
            state_dir,
            opts,
            tools,
            cgroups,
            hidden,
            records: RecordCache::new(sandboxes, trash, found),
            feed: SnapshotFeed::new(),
            _instance_lock: instance_lock,
        };
        Ok(ProcessDriver {
            inner: Arc::new(inner),
            alive: Alive::new(),
        })
    }

    /// The state directory this driver keeps its sandboxes in.
    pub fn state_dir(&self) -> &Path {
        &self.inner.state_dir
    }

    /// The cgroup parent directories the driver makes sandbox cgroups in, one per hierarchy.
    pub fn cgroup_parent_dirs(&self) -> Vec<PathBuf> {
        self.inner
            .cgroups
            .parent_dirs(&self.inner.opts.cgroup_parent)
    }

    /// The cgroup parent directories a driver opened with `cgroup_parent` on this host would
    /// use (for clean-up tools that must not open a driver).
    pub fn cgroup_parent_dirs_for(cgroup_parent: &str) -> Vec<PathBuf> {
        CgroupHost::detect().parent_dirs(cgroup_parent)
    }

    /// The cgroup interface found on this host, if any.
    pub fn cgroup_version(&self) -> Option<CgroupVersion> {
        self.inner.cgroups.version
    }

    /// The host ids of sandbox `id`: its own range, else the driver's shared one.
    pub fn id_map(&self, id: Uuid) -> Option<IdMap> {
        let record = self.inner.records.get(id)?;
        Some(record.id_map.unwrap_or(self.inner.opts.id_map))
    }

    /// The persistent directory of sandbox `id` on the host (`/sandbox` inside it).
    pub fn persistent_dir(&self, id: Uuid) -> PathBuf {
        SandboxPaths::new(&self.inner.state_dir, id).root
    }

    /// The identity of the running init of sandbox `id`, if it runs.
    pub fn workload_identity(&self, id: Uuid) -> Option<ProcessIdentity> {
        let record = self.inner.records.get(id)?;
        self.inner.run_paths(&record).live_init()
    }
}

/// The paths every workload's shim hides: the state directory and `extra`, canonical where
/// they exist (so a symlinked path hides what it points to). Relative paths and `/` are refused.
fn hidden_paths(state_dir: &Path, extra: &[PathBuf]) -> Result<Vec<PathBuf>, DriverError> {
    std::iter::once(state_dir)
        .chain(extra.iter().map(PathBuf::as_path))
        .map(|path| {
            let path = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
            if !path.is_absolute() || path == Path::new("/") {
                return Err(DriverError::InvalidArgument(format!(
                    "hidden path {}: it must be absolute and not /",
                    path.display()
                )));
            }
            Ok(path)
        })
        .collect()
}

/// Kills, without grace, a workload whose stop a killed driver left unfinished.
fn finish_interrupted_stop(paths: &SandboxPaths, record: &SandboxRecord) {
    paths
        .run(&record.run_id)
        .finish_interrupted_stop(record.sandbox_id);
    record.cgroups.kill_all();
}

impl sbx_host_kit::running::RunsInit for Inner {
    fn run_dir(&self, record: &SandboxRecord) -> RunDir {
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

    fn run_paths(&self, record: &SandboxRecord) -> RunDir {
        self.paths(record.sandbox_id).run(&record.run_id)
    }
}

impl HostDriver for Inner {
    type Record = SandboxRecord;
    const NAME: &'static str = "process";

    sbx_host_kit::host_driver_state!();

    fn live_init(&self, record: &SandboxRecord) -> Option<ProcessIdentity> {
        self.run_paths(record).live_init()
    }

    fn log_file(&self, id: Uuid) -> PathBuf {
        self.paths(id).log
    }

    /// The sandbox's uid range goes back to the pool once its files are gone.
    fn after_removal(&self, record: &SandboxRecord) {
        uidpool::release_for(
            self.opts.uid_pool.as_ref(),
            record.id_map,
            &self.paths(record.sandbox_id).dir,
        );
    }

    /// What the sandbox looks like now, from its record, its run files and `/proc`.
    fn snapshot(&self, record: &SandboxRecord) -> pb::Snapshot {
        let paths = self.run_paths(record);
        let (observed, init) = paths.observe(record.desired, || {
            record.cgroups.oom_kills() > record.oom_kills_at_launch
        });
        let mut warnings = record.warnings.clone();
        if observed.has_run() {
            warnings.extend(record::read_warnings(&paths));
        }
        let instance = init.map(|i| i.to_string());
        let mut snapshot = observed.into_snapshot(record, record.generation, instance, warnings);
        sandbox_network::note_denials(
            self.opts.network.as_ref(),
            record.sandbox_id,
            record.network_allow.as_ref(),
            &mut snapshot,
        );
        snapshot.budget_refusals = sbx_host_kit::budgets::refusals(
            record.sandbox_id,
            &record.cgroups.dirs,
            sandbox_network::budget_refusals(self.opts.network.as_ref(), record.sandbox_id),
        );
        snapshot
    }

    /// Starts a new run of the workload under `generation`. The record (desired running, new
    /// generation, OOM baseline) is durable before the launch, so a driver killed meanwhile
    /// reopens to a sandbox that says its launch did not complete.
    async fn start_run(
        &self,
        mut record: SandboxRecord,
        generation: u64,
        run_env: RunEnv,
    ) -> Result<pb::Snapshot, DriverError> {
        let paths = self.paths(record.sandbox_id);
        sbx_host_kit::run::remove_runs(&paths.dir)
            .map_err(|e| internal("removing earlier run directories", e))?;
        record.run_id = Uuid::new_v4().simple().to_string();
        record.generation = generation;
        record.desired = Desired::Running;
        record.launched_at_ms = now_ms();
        record.oom_kills_at_launch = record.cgroups.oom_kills();
        self.records.save(&record)?;
        let attached = sandbox_network::attach(
            self.opts.network.as_ref(),
            record.sandbox_id,
            record.network_allow.as_ref(),
        )
        .await?;
        let settings = launch::LaunchSettings {
            hidden: &self.hidden,
            timeout: self.opts.launch_timeout,
            log_max: self.opts.log_max,
            max_ptys: self.opts.max_ptys,
        };
        if let Err(e) = launch::launch(
            &self.tools,
            &paths,
            &record,
            &run_env,
            attached.as_ref(),
            &settings,
        )
        .await
        {
            record.cgroups.kill_all();
            return Err(e);
        }
        let snapshot = self.snapshot(&record);
        tracing::info!(
            sandbox_id = %record.sandbox_id,
            generation,
            instance = %snapshot.instance_id,
            "workload started"
        );
        feed::publish(self, record.sandbox_id, &snapshot);
        Ok(snapshot)
    }

    /// Ends the workload: SIGTERM to its init (the shim passes it to every process of the
    /// sandbox), SIGKILL after `grace`, then SIGKILL to anything left in its cgroups, until
    /// nothing is. Bounded: fails after `grace` + 10 s if processes remain.
    async fn terminate(&self, record: &SandboxRecord, grace: Duration) -> Result<(), DriverError> {
        let paths = self.run_paths(record);
        let tick = Duration::from_millis(10);
        paths.signal_init(record.sandbox_id, grace).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let init_gone = !paths.read_init().is_some_and(|i| procfs::is_alive(&i));
            if init_gone && record.cgroups.pids().is_empty() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(DriverError::Internal(format!(
                    "sandbox {} still has processes {:?} after SIGKILL",
                    record.sandbox_id,
                    record.cgroups.pids()
                )));
            }
            if let Some(init) = paths.live_init() {
                let _ = kill(Pid::from_raw(init.pid), Signal::SIGKILL);
            }
            record.cgroups.kill_all();
            tokio::time::sleep(tick).await;
        }
    }

    /// The cgroups go, and the sandbox's network namespace, veth, rules and address lease.
    async fn before_removal(&self, record: &SandboxRecord) -> Result<(), DriverError> {
        service::remove_cgroups(record).await?;
        sandbox_network::release(
            self.opts.network.as_ref(),
            record.sandbox_id,
            record.network_allow.as_ref(),
            "process",
        )
        .await
    }
}
