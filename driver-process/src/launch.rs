//! Starting a workload in its own namespaces, and the command lines of `exec`.
//!
//! A workload is launched as
//! `setsid unshare --pid --fork --mount --uts --ipc --net -- /bin/sh <state>/sbx-shim …`
//! (on the gateway's network, `setsid nsenter --net=/run/netns/<name>-<id> -- unshare …`
//! without `--net`: the namespace host root made for it, see `host::network`):
//! a new session (so it outlives the driver), new namespaces, and a small shell *shim* as pid 1
//! of the new pid namespace. The shim joins the sandbox's cgroups, sets the hostname, brings
//! up `lo`, mounts a fresh `/proc` and binds the persistent directory at `/sandbox`, hides the
//! driver's state directory and the other hidden paths under an empty read-only tmpfs each,
//! records its own identity (host pid and start time, read from the host's `/proc` before the
//! new one is mounted), then runs the main process in its user namespace (see [`super::userns`]),
//! forwards SIGTERM to every process of the namespace, waits for the main process and writes its
//! status to `run/exit`. When the shim ends, the kernel kills whatever is left in the namespace.
//!
//! The shim keeps the run directory as its working directory while it hides the state
//! directory: the hiding mount covers the path, not a directory already entered, so the shim
//! still writes `init` and `exit` there (by relative paths) and holds no extra descriptor. The
//! workload, a stranger to host root's processes, cannot follow the shim's `/proc/1/cwd`.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use command_fds::CommandFdExt;
use std::time::Duration;

use sbx_driver_api::DriverError;
use sbx_images::IdMap;

use super::record::{SandboxPaths, SandboxRecord};
use super::userns::Jail;
use sbx_host_kit::ProcessIdentity;
use sbx_host_kit::command::RunEnv;
use sbx_host_kit::logfile::log_since;

/// Where the persistent directory appears inside a sandbox.
pub const SANDBOX_MOUNT: &str = "/sandbox";

/// The PATH the shim's own tools are looked up in, and the workload's unless its spec sets one.
const SHIM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// The shell function both the shim and the exec wrapper end with: `jail COMMAND…` runs COMMAND
/// in a new user namespace mapped by `$uidmap`/`$gidmap`, as uid 0 there without capabilities
/// (see [`super::userns`]), with `$userpath` back as its PATH (the helpers `unshare` runs,
/// `newuidmap` and `newgidmap`, are looked up in the shim's). It `exec`s: no process is added.
/// A COMMAND not found on that PATH answers 127 and `command not found: COMMAND`, the
/// user's name for it, never the wrappers' (`sbx-jail: 1: exec: …: not found`).
macro_rules! jail_fn {
    () => {
        r#"
jail() {
  exec "$unshare" --user --map-users="$uidmap" --map-groups="$gidmap" --setuid 0 --setgid 0 -- \
    "$setpriv" --no-new-privs --bounding-set="${jailcaps:--all}" --inh-caps=-all --ambient-caps=-all -- \
    /bin/sh -c 'PATH=$1; shift
      command -v "$1" >/dev/null 2>&1 || { echo "command not found: $1" >&2; exit 127; }
      exec "$@"' sbx-jail "$userpath" "$@"
}
"#
    };
}

/// The shim: `sh SHIM_FILE RUN_DIR PERSIST_DIR HOSTNAME LOG LOG_MAX MAX_PTYS AGENT UNSHARE
/// SETPRIV UID_MAP GID_MAP CGROUP_DIR… -- HIDDEN_PATH… -- COMMAND…`, with the exec agent's
/// listening socket as fd 3. It mounts, in the sandbox's own mount namespace, a devpts instance
/// of its own of at most MAX_PTYS ptys over `/dev/pts` (see `host::ptys`: host root's ptys,
/// which no process of the sandbox opens by path, and none from the host's reserve; the agent
/// and glibc's `openpty` open a terminal's side through its master),
/// so neither the host's terminals nor an exec's are the workload's to open; the loggers get
/// the log opened for reading and its previous part (`LOG.1`) as fds 6 and 7 and keep the two
/// within LOG_MAX bytes. The agent (`sbx-agent`, see [`sbx_host_kit::agent`]) is opened as fd 4 before the
/// driver's state is hidden and run as `/proc/self/fd/4`, in the workload's kind of user
/// namespace, from `/sandbox`, keeping of the capabilities only `setuid`, `setgid` and
/// `setpcap` (over its own namespace: to run an exec as another of the ids it maps, which
/// every exec then drops, `sbx-agent serve --drop-id-caps`); the main process runs through `sbx-agent run` (which puts back
/// the SIGINT and SIGQUIT a shell's `&` ignores, and passes on no descriptor but stdio). Exit status 125 means the sandbox could not
/// be set up (the reason is in the log). The shim sends its own output to LOG; the main
/// process's stdout and stderr go to a FIFO each in the run directory (`stdout.fifo`,
/// `stderr.fifo`), read by one `sbx-agent log` per stream (run as the shim is, not jailed),
/// which appends them to LOG as timestamped records of their stream (see
/// `host::logfile`); once the main process has exited the shim has them drain
/// (SIGUSR1) and waits for them before it writes `exit`. What `unshare` says (for example
/// when the shim is SIGKILLed) goes to the run's
/// `launcher.log`, not into the workload's log. `init` and `exit` are written by one `printf`
/// each (no `mv`: one exec less per launch); a reader takes them only once they end with their
/// newline, so a half-written file is never read as a shorter number. A main command not found
/// (looked up as the workload would, from `/sandbox` on its PATH) is recorded in `not-found`
/// with status 127 (see [`sbx_host_kit::run`]); a command found, by `launched`, which the
/// launch waits for. A hidden path that is a
/// directory gets an empty read-only tmpfs, any other file `/dev/null`; a missing one nothing.
const SHIM: &str = concat!(
    jail_fn!(),
    r#"
run="$1"; persist="$2"; host="$3"; log="$4"; logmax="$5"; maxptys="$6"; agent="$7"; unshare="$8"; setpriv="$9"
shift 9; uidmap="$1"; gidmap="$2"; shift 2
exec >>"$log" 2>&1 || exit 125
userpath="${PATH-}"; PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  echo 0 > "$1/cgroup.procs" || { echo "sbx: cannot join cgroup $1" >&2; exit 125; }
  shift
done
shift
read -r stat < /proc/self/stat || { echo "sbx: cannot read /proc/self/stat" >&2; exit 125; }
echo "$host" > /proc/sys/kernel/hostname || { echo "sbx: cannot set hostname" >&2; exit 125; }
ip link set dev lo up 2>/dev/null || echo "loopback not brought up in the sandbox's network namespace" >> "$run/warnings"
mount -t proc proc /proc || { echo "sbx: cannot mount /proc" >&2; exit 125; }
[ -d /sandbox ] || mkdir -p /sandbox || { echo "sbx: cannot make /sandbox" >&2; exit 125; }
mount --bind "$persist" /sandbox || { echo "sbx: cannot bind $persist at /sandbox" >&2; exit 125; }
if [ -f "$run/resolv.conf" ]; then
  mount --bind "$run/resolv.conf" /etc/resolv.conf 2>/dev/null || echo "the gateway's resolver could not be bound at /etc/resolv.conf: names do not resolve" >> "$run/warnings"
fi
cd "$run" || exit 125
exec 4<"$agent" || { echo "sbx: cannot open the exec agent $agent" >&2; exit 125; }
exec 6<"$log" 7<>"$log.1" || { echo "sbx: cannot open the log for its rotation" >&2; exit 125; }
mount -t devpts -o newinstance,ptmxmode=0666,mode=0600,uid=0,gid=0,max="$maxptys" sbx-exec-pts /dev/pts || { echo "sbx: cannot mount the sandbox's own /dev/pts" >&2; exit 125; }
while [ "$#" -gt 0 ] && [ "$1" != "--" ]; do
  if [ -d "$1" ]; then
    mount -t tmpfs -o ro,nosuid,nodev,noexec,mode=0555,size=4k sbx-hidden "$1"
  elif [ -e "$1" ]; then
    mount --bind /dev/null "$1"
  fi || { echo "sbx: cannot hide $1" >&2; exit 125; }
  shift
done
shift
# A stop may come as soon as `init` says the launch is done. Its TERM (which pid 1 of a
# namespace would drop without a trap) is passed on to every process of the sandbox; and it
# is marked in `stopping` first, because a TERM can miss the main process: one that comes
# before it is forked, or while it is being forked (a forked shell drops what its parent's
# trap caught). Its shell looks at the mark once its signals are its own, before anything runs:
# before it opens the FIFOs too (a logger a TERM ended before it blocked signals would leave
# that open waiting for ever; past the mark, the TERM ends the open).
trap ': > stopping; kill -TERM -1 2>/dev/null' TERM
printf '%s
' "$stat" > init || exit 125
if ! (cd /sandbox && PATH="$userpath" /proc/self/fd/4 which --record "$1" 3<&- 6<&- 7<&-); then
  printf '%s
' "$1" > not-found; printf '127
' > exit; exit 127
fi
printf 'launched
' > launched || exit 125
mkfifo stdout.fifo stderr.fifo || { echo "sbx: cannot make the log FIFOs" >&2; exit 125; }
/proc/self/fd/4 log stdout stdout.fifo --rotate "$logmax" 6 7 3<&- &
out=$!
/proc/self/fd/4 log stderr stderr.fifo --rotate "$logmax" 6 7 3<&- &
err=$!
(
  [ ! -e stopping ] || exit 143
  exec >stdout.fifo 2>stderr.fifo
  cd /sandbox || exit 125
  jail /proc/self/fd/4 run "$@"
) 3<&- 6<&- 7<&- &
child=$!
(exec 2>>agent.log 6<&- 7<&-; cd /sandbox || exit 125; jailcaps=-all,+setuid,+setgid,+setpcap; jail /proc/self/fd/4 serve --drop-id-caps) &
exec 3<&- 4<&- 6<&- 7<&-
while :; do
  wait "$child"; st=$?
  kill -0 "$child" 2>/dev/null || break
done
kill -USR1 "$out" "$err" 2>/dev/null
for p in "$out" "$err"; do
  while kill -0 "$p" 2>/dev/null; do wait "$p"; done
done
printf '%s
' "$st" > exit
exit "$st"
"#
);

/// Closes every descriptor above 3, then runs its arguments (3 is the exec agent's socket,
/// mapped there by the launch over whatever the driver had as 3):
/// `bash -c CLOSE_FDS sbx-close-fds PROGRAM ARG…`. Without it a workload would inherit the
/// descriptors the driver's process got without close-on-exec (a socket-activated gateway's
/// listening socket, a harness's pipes) and keep them for its whole life. bash, because `sh`
/// (dash) cannot name descriptors above 9; closing them in Rust would need `pre_exec`, unsafe.
const CLOSE_FDS: &str = r#"for f in /proc/$$/fd/*; do n=${f##*/}; if [ "$n" -gt 3 ]; then eval "exec $n>&-" 2>/dev/null; fi; done; exec "$@""#;

/// The host programs the driver runs, found on PATH at open.
#[derive(Debug, Clone)]
pub struct HostTools {
    pub setsid: PathBuf,
    pub unshare: PathBuf,
    pub sh: PathBuf,
    /// Joins a sandbox on the gateway's network to its namespace; `None` where util-linux has
    /// no `nsenter` (such sandboxes then cannot start, and say why).
    pub nsenter: Option<PathBuf>,
    /// [`SHIM`], installed as `<state_dir>/sbx-shim`: pid 1 runs `sh <that file> …`, so `ps`
    /// inside shows a file name where a `sh -c` would show the whole 1.5 KB script.
    pub shim: PathBuf,
    /// The exec agent, `<state_dir>/sbx-agent`.
    pub agent: PathBuf,
    /// What the workload and exec'd commands run under.
    pub jail: Jail,
    /// Runs [`CLOSE_FDS`]; `None` where there is no bash (descriptors then pass on, and the
    /// sandbox's warnings say so).
    pub bash: Option<PathBuf>,
}

impl HostTools {
    /// Finds the programs and checks what the workloads' user namespace needs (see
    /// [`super::userns::check`]) of the shared range `id_map` (older sandboxes') and of
    /// `granted`, the uid pool's ids (or the shared range again).
    pub fn find(
        id_map: &IdMap,
        granted: &IdMap,
        state_dir: &Path,
    ) -> Result<HostTools, DriverError> {
        for map in [id_map, granted] {
            super::userns::check(
                map,
                |p| find_on_path(p).ok(),
                Path::new("/etc/subuid"),
                Path::new("/etc/subgid"),
            )?;
        }
        let unshare = find_on_path("unshare")?;
        Ok(HostTools {
            setsid: find_on_path("setsid")?,
            sh: PathBuf::from("/bin/sh"),
            nsenter: find_on_path("nsenter").ok(),
            shim: install_shim(state_dir)?,
            agent: sbx_host_kit::agent::install(state_dir)?,
            bash: find_on_path("bash").ok(),
            jail: Jail {
                unshare: unshare.clone(),
                setpriv: find_on_path("setpriv")?,
                id_map: *id_map,
            },
            unshare,
        })
    }

    /// The command line that runs `program` with only stdin, stdout and stderr open.
    fn with_closed_fds(&self, program: &Path) -> (PathBuf, Vec<std::ffi::OsString>) {
        match &self.bash {
            Some(bash) => (
                bash.clone(),
                vec![
                    "-c".into(),
                    CLOSE_FDS.into(),
                    "sbx-close-fds".into(),
                    program.into(),
                ],
            ),
            None => (program.to_path_buf(), Vec::new()),
        }
    }
}

/// Writes [`SHIM`] to `<state_dir>/sbx-shim` unless it is there already (by a rename, so a
/// shim starting meanwhile reads a whole file). Mode 0644: only `sh` reads it.
fn install_shim(state_dir: &Path) -> Result<PathBuf, DriverError> {
    let target = state_dir.join("sbx-shim");
    if fs::read_to_string(&target).ok().as_deref() != Some(SHIM) {
        let tmp = state_dir.join(".sbx-shim.tmp");
        fs::write(&tmp, SHIM)
            .and_then(|()| fs::rename(&tmp, &target))
            .map_err(|e| {
                DriverError::Internal(format!("installing the shim {}: {e}", target.display()))
            })?;
    }
    Ok(target)
}

/// The warning a sandbox carries when inherited descriptors cannot be closed.
pub const NO_BASH_WARNING: &str = "descriptors inherited by the driver pass on to the workload (no bash on the host to close them)";

fn find_on_path(program: &str) -> Result<PathBuf, DriverError> {
    let path = std::env::var("PATH").unwrap_or_else(|_| SHIM_PATH.to_string());
    path.split(':')
        .chain(SHIM_PATH.split(':'))
        .map(|dir| Path::new(dir).join(program))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| {
            DriverError::Unavailable(format!(
                "the process driver needs `{program}` (util-linux) on PATH"
            ))
        })
}

/// The environment of a workload (and of an exec, which adds the request's): a fixed base —
/// PATH (the Debian default for root, never the daemon's), HOME=/sandbox, HOSTNAME and
/// SBX_SANDBOX_ID — then the spec's variables. Nothing of the driver's own environment.
pub fn workload_env(record: &SandboxRecord) -> Vec<(String, String)> {
    let mut env = vec![
        ("PATH".to_string(), SHIM_PATH.to_string()),
        ("HOME".to_string(), SANDBOX_MOUNT.to_string()),
        ("HOSTNAME".to_string(), record.name.clone()),
        ("SBX_SANDBOX_ID".to_string(), record.sandbox_id.to_string()),
    ];
    env.extend(record.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())));
    env
}

/// What every launch of a driver shares.
#[derive(Debug, Clone, Copy)]
pub struct LaunchSettings<'a> {
    /// Hidden from the workload (see [`SHIM`]).
    pub hidden: &'a [PathBuf],
    /// How long the shim may take to report.
    pub timeout: Duration,
    /// The log's cap (see [`SHIM`]).
    pub log_max: u64,
    /// The most ptys of the sandbox's devpts instance (see [`SHIM`]).
    pub max_ptys: u32,
}

/// Makes the run directory of `record.run_id` and starts the workload. Returns the identity of
/// its init once the shim has recorded it, or an error with the end of the log if the setup
/// failed.
pub async fn launch(
    tools: &HostTools,
    paths: &SandboxPaths,
    record: &SandboxRecord,
    run_env: &RunEnv,
    network: Option<&sbx_network::Attachment>,
    settings: &LaunchSettings<'_>,
) -> Result<ProcessIdentity, DriverError> {
    let LaunchSettings {
        hidden,
        timeout,
        log_max,
        max_ptys,
    } = *settings;
    let io = |what: &str, e: std::io::Error| DriverError::Internal(format!("{what}: {e}"));
    let run = paths.run(&record.run_id);
    paths
        .make_private()
        .map_err(|e| io("making the sandbox's state private", e))?;
    fs::create_dir_all(&run.dir).map_err(|e| io("making the run directory", e))?;
    let id_map = record.id_map.unwrap_or(tools.jail.id_map);
    make_persistent_dir(&paths.root, &id_map)?;
    let log_start = fs::metadata(&paths.log).map(|m| m.len()).unwrap_or(0);
    let launcher_log = run.dir.join("launcher.log");
    let launcher = fs::File::create(&launcher_log).map_err(|e| io("making the launcher log", e))?;
    let launcher_err = launcher
        .try_clone()
        .map_err(|e| io("making the launcher log", e))?;

    // On the gateway's network the workload joins the namespace host root made for it (its
    // user namespace then holds no capability over it); else a new one, loopback only.
    let mut namespaces: Vec<std::ffi::OsString> = Vec::new();
    if let Some(attached) = network {
        let nsenter = tools.nsenter.as_ref().ok_or_else(|| {
            DriverError::Unavailable(
                "a sandbox on the gateway's network needs util-linux's nsenter".into(),
            )
        })?;
        sbx_host_kit::sandbox_network::write_resolv_conf(&run.dir, attached.gateway)?;
        let mut net = std::ffi::OsString::from("--net=");
        net.push(&attached.netns_path);
        namespaces.extend([nsenter.clone().into_os_string(), net, "--".into()]);
    }
    namespaces.push(tools.unshare.clone().into_os_string());
    namespaces.extend(["--pid", "--fork", "--mount", "--uts", "--ipc"].map(Into::into));
    if network.is_none() {
        namespaces.push("--net".into());
    }
    namespaces.push("--".into());
    let (program, prefix) = tools.with_closed_fds(&tools.setsid);
    let mut command = Command::new(program);
    command
        .args(prefix)
        .args(&namespaces)
        .arg(&tools.sh)
        .arg(&tools.shim)
        .arg(&run.dir)
        .arg(&paths.root)
        .arg(&record.name)
        .arg(&paths.log)
        .arg(log_max.to_string())
        .arg(max_ptys.to_string())
        .arg(&tools.agent)
        .args(tools.jail.shell_args(&id_map))
        .args(&record.cgroups.dirs)
        .arg("--")
        .args(hidden)
        .arg("--")
        .args(&record.spec.command)
        .env_clear()
        .envs(workload_env(record))
        .envs(run_env)
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(launcher)
        .stderr(launcher_err);
    let agent = sbx_host_kit::agent::Listener::bind(&paths.dir)?;
    command
        .fd_mappings(vec![command_fds::FdMapping {
            parent_fd: agent.fd,
            child_fd: 3,
        }])
        .map_err(|e| DriverError::Internal(format!("handing the agent's socket over: {e}")))?;
    let mut child = command
        .spawn()
        .map_err(|e| io("spawning setsid/unshare", e))?;

    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(identity) = run.read_init() {
            reap_in_background(child);
            // Started means the main command was found, or it has ended (a command not
            // found is then the start's answer, never a Ready a moment before an Error).
            run.wait_launched(sbx_host_kit::run::LAUNCH_WAIT).await;
            return Ok(identity);
        }
        if let Ok(Some(status)) = child.try_wait() {
            // The shim may have recorded itself just before ending.
            if let Some(identity) = run.read_init() {
                return Ok(identity);
            }
            return Err(DriverError::Internal(format!(
                "the sandbox could not be set up ({status}): {} {}",
                log_since(&paths.log, log_start),
                log_since(&launcher_log, 0)
            )));
        }
        if tokio::time::Instant::now() >= deadline {
            reap_in_background(child);
            return Err(DriverError::Internal(format!(
                "the sandbox's init did not report within {timeout:?}: {}",
                log_since(&paths.log, log_start)
            )));
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Makes the persistent directory (`/sandbox` inside) if it is missing, owned by the id map's
/// root (host uid BASE) so that root inside can write it. A directory owned by another id of
/// the map (the workload chowned it) is left as it is; one owned by an id outside the map (made
/// before workloads ran in a user namespace) is handed over.
pub fn make_persistent_dir(root: &Path, id_map: &IdMap) -> Result<(), DriverError> {
    use std::os::unix::fs::MetadataExt;
    let failed = |what: &str, e: std::io::Error| {
        DriverError::Internal(format!("{what} {}: {e}", root.display()))
    };
    fs::create_dir_all(root).map_err(|e| failed("making the persistent directory", e))?;
    let meta = fs::metadata(root).map_err(|e| failed("reading the persistent directory", e))?;
    let in_map =
        |id: u32, base: u32| id >= base && u64::from(id) < u64::from(base) + u64::from(id_map.size);
    if !(in_map(meta.uid(), id_map.host_uid) && in_map(meta.gid(), id_map.host_gid)) {
        std::os::unix::fs::chown(root, Some(id_map.host_uid), Some(id_map.host_gid))
            .map_err(|e| failed("handing over the persistent directory", e))?;
    }
    Ok(())
}

/// The `unshare` parent is the driver's child until it ends; a small thread waits for it so it
/// does not stay a zombie. If the driver dies first, the parent is re-parented to init.
fn reap_in_background(mut child: Child) {
    let spawned = std::thread::Builder::new()
        .name("sbx-reaper".into())
        .stack_size(64 * 1024)
        .spawn(move || {
            let _ = child.wait();
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no reaper thread; the launcher will be a zombie until the driver exits");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shim mounts its exec devpts with the options the oci driver uses (one literal there,
    /// since the shim is one string made at compile time; its budget is the shim's argument).
    #[test]
    fn the_shims_exec_devpts_has_the_drivers_options() {
        let mount = format!(
            "mount -t devpts -o {} sbx-exec-pts /dev/pts",
            sbx_host_kit::ptys::exec_devpts_options(0).replace("max=0", "max=\"$maxptys\"")
        );
        assert!(SHIM.contains(&mount), "the shim does not run {mount:?}");
    }
}
