//! Managed mode (`sbxd serve --driver managed:process|sim|vm`): sbxd runs its compute driver as
//! a child process — its own binary, `sbxd driver --backend X --socket DATA/drivers/X.sock
//! --state-dir DATA/drivers/X` plus the backend's settings (`--cgroup-parent`, the `--vm-*`
//! flags) — in its own process group, with stdout and stderr appended to
//! DATA/drivers/X.log, and talks to it over the socket like to any remote driver.
//!
//! Supervision: when the driver process exits, it is started again after a backoff of 100 ms
//! doubling to 10 s, reset once a driver has stayed up 30 s; each restart is logged. While it
//! is away, driver calls answer UNAVAILABLE and the actor layer retries (and later recovers).
//!
//! Shutdown (sbxd SIGTERM): the driver gets SIGTERM, then SIGKILL after
//! [`DRIVER_STOP_GRACE`]; its workloads keep running (they live in their own sessions).
//!
//! A stale driver: if sbxd was SIGKILLed, its driver lives on as an orphan and holds the
//! process driver's state-dir lock. sbxd records each driver it starts in DATA/drivers/X.pid
//! as `PID START_TICKS` (start time from `/proc/PID/stat`). The next sbxd, which by then holds
//! the store's lock and so is the only sbxd on this data dir, kills the recorded driver —
//! SIGTERM, then SIGKILL — but only when a live process with that pid has the recorded start
//! time (a reused pid is never signalled). It does not wait for the orphan to exit by itself:
//! an orphaned driver has nobody left to serve.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_drivers::process::ProcessIdentity;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{DaemonError, DriverKind};

/// First delay before restarting a driver that exited.
pub const RESTART_BACKOFF_MIN: Duration = Duration::from_millis(100);
/// Longest delay between restarts.
pub const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// A driver that stayed up this long is healthy again: the next restart waits the minimum.
pub const RESTART_BACKOFF_RESET: Duration = Duration::from_secs(30);
/// How long a driver may take to exit after SIGTERM before it gets SIGKILL.
pub const DRIVER_STOP_GRACE: Duration = Duration::from_secs(5);

/// Where a managed driver's files are, and how to start it.
#[derive(Debug, Clone)]
pub struct ManagedDriverPaths {
    pub backend: DriverKind,
    /// DATA/drivers/X.sock: the socket the driver serves on.
    pub socket: PathBuf,
    /// DATA/drivers/X: the driver's state (the same as `--driver X` uses, so sandboxes move
    /// between in-process and managed mode).
    pub state_dir: PathBuf,
    /// DATA/drivers/X.log: the driver's stdout and stderr, appended.
    pub log: PathBuf,
    /// DATA/drivers/X.pid: `PID START_TICKS` of the driver process sbxd started last.
    pub pid_file: PathBuf,
}

/// The longest Unix socket path the kernel takes (`sun_path` is 108 bytes, NUL included).
pub const MAX_SOCKET_PATH: usize = 107;

impl ManagedDriverPaths {
    pub fn new(data_dir: &Path, backend: DriverKind) -> ManagedDriverPaths {
        let drivers = data_dir.join("drivers");
        let name = backend.name();
        ManagedDriverPaths {
            backend,
            socket: drivers.join(format!("{name}.sock")),
            state_dir: drivers.join(name),
            log: drivers.join(format!("{name}.log")),
            pid_file: drivers.join(format!("{name}.pid")),
        }
    }
}

/// A running managed driver and the task that keeps it running.
pub struct ManagedDriver {
    supervisor: JoinHandle<()>,
    stop: CancellationToken,
}

impl ManagedDriver {
    /// Kills a stale driver recorded in the pid file, starts the driver and supervises it.
    /// `host_flags` (the backend's settings, e.g. `--cgroup-parent X`) go on every driver
    /// process's command line.
    pub async fn start(
        paths: ManagedDriverPaths,
        host_flags: Vec<OsString>,
    ) -> Result<ManagedDriver, DaemonError> {
        let exe = std::env::current_exe().map_err(|source| DaemonError::Io {
            what: "cannot find sbxd's own executable",
            path: PathBuf::from("/proc/self/exe"),
            source,
        })?;
        std::fs::create_dir_all(&paths.state_dir).map_err(|source| DaemonError::Io {
            what: "cannot create the driver state directory",
            path: paths.state_dir.clone(),
            source,
        })?;
        stop_stale_driver(&paths).await;
        let launcher = Launcher {
            exe,
            paths,
            host_flags,
        };
        let child = launcher.spawn()?;
        let stop = CancellationToken::new();
        let supervisor = tokio::spawn(supervise(launcher, child, stop.clone()));
        Ok(ManagedDriver { supervisor, stop })
    }

    /// Stops the driver (SIGTERM, then SIGKILL after [`DRIVER_STOP_GRACE`]) and waits for it.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.supervisor.await;
    }
}

/// What starts one driver process.
struct Launcher {
    exe: PathBuf,
    paths: ManagedDriverPaths,
    /// The backend's settings, after the backend, socket and state dir.
    host_flags: Vec<OsString>,
}

impl Launcher {
    fn spawn(&self) -> Result<Child, DaemonError> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.paths.log)
            .map_err(|source| DaemonError::Io {
                what: "cannot open the driver log",
                path: self.paths.log.clone(),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| DaemonError::Io {
            what: "cannot open the driver log",
            path: self.paths.log.clone(),
            source,
        })?;
        let child = Command::new(&self.exe)
            .arg("driver")
            .arg("--backend")
            .arg(self.paths.backend.name())
            .arg("--socket")
            .arg(&self.paths.socket)
            .arg("--state-dir")
            .arg(&self.paths.state_dir)
            .args(&self.host_flags)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .spawn()
            .map_err(|source| DaemonError::Io {
                what: "cannot start the driver process",
                path: self.exe.clone(),
                source,
            })?;
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            record_pid(&self.paths.pid_file, pid);
            tracing::info!(pid, backend = self.paths.backend.name(), log = %self.paths.log.display(), "driver process started");
        }
        Ok(child)
    }
}

/// Keeps the driver running until `stop`, then stops it.
async fn supervise(launcher: Launcher, mut child: Child, stop: CancellationToken) {
    let mut backoff = RestartBackoff::default();
    let mut started = Instant::now();
    loop {
        let status = tokio::select! {
            status = child.wait() => status,
            _ = stop.cancelled() => {
                stop_child(&mut child).await;
                let _ = std::fs::remove_file(&launcher.paths.pid_file);
                return;
            }
        };
        let up = started.elapsed();
        let delay = backoff.after_exit(up);
        let status = match status {
            Ok(status) => status.to_string(),
            Err(e) => format!("not known ({e})"),
        };
        tracing::warn!(%status, up = ?up, restart_in = ?delay, "driver process exited; restarting it");
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = stop.cancelled() => {
                let _ = std::fs::remove_file(&launcher.paths.pid_file);
                return;
            }
        }
        loop {
            match launcher.spawn() {
                Ok(next) => {
                    child = next;
                    started = Instant::now();
                    break;
                }
                Err(e) => {
                    let delay = backoff.after_exit(Duration::ZERO);
                    tracing::error!(error = %e, retry_in = ?delay, "cannot restart the driver process");
                    tokio::select! {
                        _ = tokio::time::sleep(delay) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            }
        }
    }
}

/// The delays between restarts of a driver process.
#[derive(Debug, Clone, Copy)]
pub struct RestartBackoff {
    /// The delay the next exit waits before its restart.
    next: Duration,
}

impl Default for RestartBackoff {
    fn default() -> Self {
        RestartBackoff {
            next: RESTART_BACKOFF_MIN,
        }
    }
}

impl RestartBackoff {
    /// The delay before restarting a driver that exited after running for `up`: the minimum
    /// again when it had stayed up [`RESTART_BACKOFF_RESET`], else the previous one doubled.
    pub fn after_exit(&mut self, up: Duration) -> Duration {
        if up >= RESTART_BACKOFF_RESET {
            self.next = RESTART_BACKOFF_MIN;
        }
        let delay = self.next;
        self.next = next_backoff(delay);
        delay
    }
}

/// The delay after `current`: doubled, at most [`RESTART_BACKOFF_MAX`].
pub fn next_backoff(current: Duration) -> Duration {
    (current * 2).min(RESTART_BACKOFF_MAX)
}

/// SIGTERM, wait up to the grace, SIGKILL, reap.
async fn stop_child(child: &mut Child) {
    let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) else {
        return; // already reaped
    };
    tracing::info!(pid, "stopping the driver process");
    let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
    match tokio::time::timeout(DRIVER_STOP_GRACE, child.wait()).await {
        Ok(_) => {}
        Err(_) => {
            tracing::warn!(pid, grace = ?DRIVER_STOP_GRACE, "driver still running after SIGTERM; SIGKILL");
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }
}

/// Writes `PID START_TICKS` of a just-started driver. The child is not reaped yet, so its
/// `/proc` entry exists even if it already exited.
fn record_pid(pid_file: &Path, pid: i32) {
    let Some(identity) = read_identity(pid) else {
        tracing::warn!(pid, "cannot read the driver's start time; not recording it");
        return;
    };
    let text = format!("{} {}\n", identity.pid, identity.start_ticks);
    let tmp = pid_file.with_extension("pid.tmp");
    let written = std::fs::write(&tmp, text).and_then(|()| std::fs::rename(&tmp, pid_file));
    if let Err(e) = written {
        tracing::warn!(error = %e, path = %pid_file.display(), "cannot record the driver pid");
    }
}

/// Parses a pid file's `PID START_TICKS`.
pub fn parse_pid_file(text: &str) -> Option<ProcessIdentity> {
    let mut fields = text.split_whitespace();
    let pid: i32 = fields.next()?.parse().ok()?;
    let start_ticks: u64 = fields.next()?.parse().ok()?;
    (pid > 0 && fields.next().is_none()).then_some(ProcessIdentity { pid, start_ticks })
}

/// The identity of a live (non-zombie) process `pid`.
fn read_identity(pid: i32) -> Option<ProcessIdentity> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let close = line.rfind(')')?;
    let mut rest = line.get(close + 1..)?.split_ascii_whitespace();
    let _state = rest.next()?;
    let start_ticks: u64 = rest.nth(18)?.parse().ok()?;
    Some(ProcessIdentity { pid, start_ticks })
}

/// Whether the recorded process still runs (same pid and start time, not a zombie).
fn is_running(identity: &ProcessIdentity) -> bool {
    let Ok(line) = std::fs::read_to_string(format!("/proc/{}/stat", identity.pid)) else {
        return false;
    };
    let Some(close) = line.rfind(')') else {
        return false;
    };
    let state = line[close + 1..].split_ascii_whitespace().next();
    !matches!(state, Some("Z" | "X")) && read_identity(identity.pid).as_ref() == Some(identity)
}

/// Kills the managed driver a previous sbxd recorded in `paths.pid_file`, if that very
/// process still runs. Also used before opening the driver in process (`--driver process`),
/// whose state-dir lock an orphaned managed driver would hold. Only call it while holding the
/// store's lock (so no other sbxd on this data dir supervises that driver).
pub async fn stop_stale_driver(paths: &ManagedDriverPaths) {
    let pid_file = paths.pid_file.clone();
    // Polls /proc with short sleeps for a few seconds at most: off the runtime's workers.
    let _ = tokio::task::spawn_blocking(move || kill_stale_driver(&pid_file)).await;
}

/// [`stop_stale_driver`], blocking for at most about [`DRIVER_STOP_GRACE`] + 2 s.
fn kill_stale_driver(pid_file: &Path) {
    let Ok(text) = std::fs::read_to_string(pid_file) else {
        return;
    };
    let Some(stale) = parse_pid_file(&text) else {
        tracing::warn!(path = %pid_file.display(), "unreadable driver pid file; ignoring it");
        return;
    };
    if !is_running(&stale) {
        tracing::info!(%stale, "the previous driver process is gone");
        return;
    }
    tracing::warn!(%stale, "a driver process from a previous sbxd still runs; stopping it");
    let pid = Pid::from_raw(stale.pid);
    let _ = kill(pid, Signal::SIGTERM);
    if wait_gone(&stale, DRIVER_STOP_GRACE) {
        return;
    }
    tracing::warn!(%stale, "the stale driver ignored SIGTERM; SIGKILL");
    // Checked again right before the signal, so that a pid reused meanwhile is not hit.
    if is_running(&stale) {
        let _ = kill(pid, Signal::SIGKILL);
    }
    if !wait_gone(&stale, Duration::from_secs(2)) {
        tracing::error!(%stale, "the stale driver survived SIGKILL");
    }
}

/// Polls until `identity` no longer runs; false when it still runs after `limit`.
fn wait_gone(identity: &ProcessIdentity, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while is_running(identity) {
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_the_cap() {
        let mut d = RESTART_BACKOFF_MIN;
        let mut seen = vec![d];
        for _ in 0..10 {
            d = next_backoff(d);
            seen.push(d);
        }
        assert_eq!(seen[1], Duration::from_millis(200));
        assert_eq!(seen[6], Duration::from_millis(6400));
        assert_eq!(seen[7], RESTART_BACKOFF_MAX);
        assert_eq!(*seen.last().unwrap(), RESTART_BACKOFF_MAX);
    }

    #[test]
    fn restarts_back_off_and_reset_after_a_long_run() {
        let mut b = RestartBackoff::default();
        let quick = Duration::from_millis(50);
        let delays: Vec<_> = (0..4).map(|_| b.after_exit(quick)).collect();
        assert_eq!(
            delays,
            [100, 200, 400, 800].map(Duration::from_millis).to_vec()
        );
        for _ in 0..20 {
            b.after_exit(quick);
        }
        assert_eq!(b.after_exit(quick), RESTART_BACKOFF_MAX);
        // Up just under the reset: keeps backing off; up long enough: back to the minimum.
        assert_eq!(
            b.after_exit(RESTART_BACKOFF_RESET - Duration::from_millis(1)),
            RESTART_BACKOFF_MAX
        );
        assert_eq!(b.after_exit(RESTART_BACKOFF_RESET), RESTART_BACKOFF_MIN);
        assert_eq!(b.after_exit(quick), Duration::from_millis(200));
    }

    #[test]
    fn pid_file_round_trip_and_rejects() {
        assert_eq!(
            parse_pid_file("123 456\n"),
            Some(ProcessIdentity {
                pid: 123,
                start_ticks: 456
            })
        );
        assert_eq!(parse_pid_file("123"), None);
        assert_eq!(parse_pid_file("-1 5"), None);
        assert_eq!(parse_pid_file("1 2 3"), None);
        assert_eq!(parse_pid_file("x 2"), None);
    }

    #[test]
    fn own_identity_runs_and_a_different_start_time_does_not() {
        let me = read_identity(std::process::id() as i32).expect("own stat");
        assert!(is_running(&me));
        let other = ProcessIdentity {
            start_ticks: me.start_ticks + 1,
            ..me
        };
        assert!(
            !is_running(&other),
            "a reused pid is not the recorded process"
        );
    }
}
