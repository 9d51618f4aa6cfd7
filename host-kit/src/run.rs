//! The run directory of a workload whose init is a process of this machine (oci, process):
//! `<sandbox_dir>/run-<run_id>/`, one per launch, named by a fresh id recorded before the
//! launch, the earlier ones removed first. So an exit status from an earlier run is never
//! read as the current one.
//!
//! It holds `init`, the `/proc/<pid>/stat` line of the run's init (the driver's record of
//! which process it is: pid *and* start time), and `exit`, the main process's wait status as
//! the init saw it (the shell's `$?`). Each is read only once it is a complete line (up to its
//! final newline), so a half-written file reads as not there yet. When the main command is
//! not found (checked by the init before it runs it), the init writes its name to
//! `not-found` and `127` to `exit`: the Error then says `command not found: NAME`, not what
//! a wrapper or the runtime would have said. Otherwise it writes `launched` to [`LAUNCHED`]
//! just before it runs the command: a start returns once either is there
//! ([`RunDir::wait_launched`]).
//!
//! **Invariant:** the run directory is host root's: the sandbox's init writes its words into
//! files the driver made and handed it open (the oci driver passes them as descriptors), so
//! nothing in it is the sandbox's to replace. Every file of it is still read through
//! [`safefs`] (beneath the sandbox's directory, no link followed, regular files only,
//! bounded), and a pid read from it is acted on only once its start time and its cgroup
//! prove it is the sandbox's own ([`procfs::signal_sandbox_process`]): a run directory an
//! earlier driver handed to its sandbox, found again after an upgrade, steers nothing.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rustix::process::Signal;
use uuid::Uuid;

use super::observe::{self, Desired, Observed, RunFacts};
use super::procfs::{self, ProcessIdentity};
use super::safefs;

/// The most of `init` (a `/proc/<pid>/stat` line) that is read.
const MAX_INIT: u64 = 4096;
/// The most of `exit` (a number and a newline) that is read.
const MAX_EXIT: u64 = 32;
/// The most of `not-found` (a command's name) that is read, and shown.
const MAX_NOT_FOUND: u64 = 512;
const SHOWN_NOT_FOUND: usize = 128;

/// The run's file the init writes `launched` to once the main command is found, before it
/// runs it.
pub const LAUNCHED: &str = "launched";

/// How long a start waits for the init to say the main command was found, or for it to end
/// ([`RunDir::wait_launched`]). Past it the start answers anyway: the next look tells.
pub const LAUNCH_WAIT: Duration = Duration::from_secs(10);

/// The files of one run of the workload.
#[derive(Debug, Clone)]
pub struct RunDir {
    pub dir: PathBuf,
    /// The sandbox's directory: every file of the run is opened beneath it.
    sandbox_dir: PathBuf,
    /// The run directory's name in it.
    name: String,
    /// The sandbox's id (its directory's name): a pid is acted on only while it is in a
    /// cgroup named by it.
    sandbox_id: String,
}

impl RunDir {
    /// The run directory named `run_id` of the sandbox whose directory is `sandbox_dir`
    /// (named by the sandbox's id).
    pub fn new(sandbox_dir: &Path, run_id: &str) -> RunDir {
        let name = format!("run-{run_id}");
        RunDir {
            dir: sandbox_dir.join(&name),
            sandbox_dir: sandbox_dir.to_path_buf(),
            name,
            sandbox_id: sandbox_dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }

    /// A complete line (up to its final newline) of the run's file `file`, read as
    /// [`safefs::read_beneath`] does, at most `max` bytes.
    fn line(&self, file: &str, max: u64) -> Option<String> {
        let rel = Path::new(&self.name).join(file);
        let bytes = safefs::read_beneath(&self.sandbox_dir, &rel, max).ok()?;
        let text = String::from_utf8(bytes).ok()?;
        text.ends_with('\n').then_some(text)
    }

    /// Whether `init` is this sandbox's own process and still runs.
    fn is_ours(&self, init: &ProcessIdentity) -> bool {
        procfs::is_sandbox_process(init, &self.sandbox_id)
    }

    pub fn init(&self) -> PathBuf {
        self.dir.join("init")
    }

    /// The identity of the run's init, as it was recorded.
    pub fn read_init(&self) -> Option<ProcessIdentity> {
        let line = self.line("init", MAX_INIT)?;
        procfs::parse_stat_line(&line).map(|s| s.identity)
    }

    /// The wait status of the run's main process, once the init has written it.
    pub fn read_exit(&self) -> Option<i32> {
        self.line("exit", MAX_EXIT)?.trim().parse().ok()
    }

    /// Whether the init said the main command was found (it runs it next).
    pub fn launched(&self) -> bool {
        self.line(LAUNCHED, 16).is_some_and(|l| l == "launched\n")
    }

    /// Waits (at most `limit`, looking every 2 ms) until the init says the main command was
    /// found, or has written the main process's status and ended: what a start waits for, so
    /// that a command not found is the start's answer. Answers whether either happened.
    pub async fn wait_launched(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            if self.launched() || (self.read_exit().is_some() && self.live_init().is_none()) {
                return true;
            }
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    /// The main command the init did not find, if it wrote one: the sandbox's words, so
    /// shown short and printable.
    pub fn read_not_found(&self) -> Option<String> {
        let line = self.line("not-found", MAX_NOT_FOUND)?;
        Some(safefs::printable(
            line.trim_end_matches('\n'),
            SHOWN_NOT_FOUND,
        ))
    }

    /// The run observed: [`observe::observe`] of its [`RunDir::facts`], and a status 127
    /// with a `not-found` file told as the command not found (by name, reason
    /// `CommandNotFound`).
    pub fn observe(
        &self,
        desired: Desired,
        oom_kills_rose: impl FnOnce() -> bool,
    ) -> (Observed, Option<ProcessIdentity>) {
        let (facts, init) = self.facts(desired, oom_kills_rose);
        let mut observed = observe::observe(facts);
        if observed.reason == "Error"
            && observed.exit_code == 127
            && let Some(command) = self.read_not_found()
        {
            observed.reason = "CommandNotFound";
            observed.message =
                format!("command not found: {command} (the main process exited with code 127)");
        }
        (observed, init)
    }

    /// What an observation of the run needs to know, with the run's init as recorded.
    /// `oom_kills_rose` (whether the memory cgroup's OOM-kill counter rose during the run) is
    /// asked only of a run meant to be running whose recorded init is gone: in any other case
    /// the observation does not depend on it.
    pub fn facts(
        &self,
        desired: Desired,
        oom_kills_rose: impl FnOnce() -> bool,
    ) -> (RunFacts, Option<ProcessIdentity>) {
        let init = self.read_init();
        let alive = init.as_ref().is_some_and(|i| self.is_ours(i));
        // Read after the liveness check: the init writes the status before it ends.
        let exit_status = if alive { None } else { self.read_exit() };
        let oom_killed =
            !alive && desired == Desired::Running && init.is_some() && oom_kills_rose();
        let facts = RunFacts {
            desired,
            init_recorded: init.is_some(),
            alive,
            exit_status,
            oom_killed,
        };
        (facts, init)
    }

    /// The run's init, if it still runs (and is the sandbox's own).
    pub fn live_init(&self) -> Option<ProcessIdentity> {
        self.read_init().filter(|i| self.is_ours(i))
    }

    /// Sends `signal` to the run's init `init`, if it is still the sandbox's own (checked
    /// through a pidfd, see [`procfs::signal_sandbox_process`]).
    fn signal(&self, init: &ProcessIdentity, signal: Signal) -> bool {
        procfs::signal_sandbox_process(init, &self.sandbox_id, signal)
    }

    /// SIGTERM to the run's init, if it runs (the init passes it on to the workload), and
    /// SIGKILL if it still runs after `grace` (checked every 10 ms). Returns the init it
    /// signalled.
    pub async fn signal_init(&self, sandbox_id: Uuid, grace: Duration) -> Option<ProcessIdentity> {
        let init = self.live_init()?;
        tracing::info!(%sandbox_id, %init, ?grace, "ending the workload");
        self.signal(&init, Signal::TERM);
        let deadline = tokio::time::Instant::now() + grace;
        while self.is_ours(&init) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if self.is_ours(&init) {
            tracing::warn!(%sandbox_id, ?grace, "SIGTERM not heeded; SIGKILL");
            self.signal(&init, Signal::KILL);
        }
        Some(init)
    }

    /// SIGKILL to the run's init, if it runs: the end, without grace, of a stop that a killed
    /// driver left unfinished.
    pub fn finish_interrupted_stop(&self, sandbox_id: Uuid) {
        if let Some(init) = self.live_init() {
            tracing::warn!(%sandbox_id, %init, "finishing an interrupted stop");
            self.signal(&init, Signal::KILL);
        }
    }
}

/// Removes every run directory of the sandbox whose directory is `sandbox_dir`.
pub fn remove_runs(sandbox_dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(sandbox_dir)?.flatten() {
        if entry.file_name().to_string_lossy().starts_with("run-") {
            fs::remove_dir_all(entry.path())?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_files_are_read_back_only_when_complete() {
        let tmp = tempfile::tempdir().unwrap();
        let sandbox = tmp.path().join("sandbox");
        let old = RunDir::new(&sandbox, "old");
        fs::create_dir_all(&old.dir).unwrap();
        let run = RunDir::new(&sandbox, "r1");
        fs::create_dir_all(&run.dir).unwrap();
        assert_eq!(run.dir, sandbox.join("run-r1"));
        assert_eq!((run.read_init(), run.read_exit()), (None, None));
        fs::write(
            run.init(),
            "42 (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 555 0 0\n",
        )
        .unwrap();
        fs::write(run.dir.join("exit"), "137\n").unwrap();
        assert_eq!(
            run.read_init(),
            Some(ProcessIdentity {
                pid: 42,
                start_ticks: 555
            })
        );
        assert_eq!(run.read_exit(), Some(137));
        assert_eq!(old.read_exit(), None, "runs do not share files");
        // Half-written files (no final newline yet) are not read.
        fs::write(run.dir.join("exit"), "13").unwrap();
        fs::write(
            run.init(),
            "42 (sh) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 55",
        )
        .unwrap();
        assert_eq!((run.read_init(), run.read_exit()), (None, None));
        fs::write(sandbox.join("workload.log"), "kept").unwrap();
        remove_runs(&sandbox).unwrap();
        assert!(!old.dir.exists() && !run.dir.exists());
        assert!(
            sandbox.join("workload.log").exists(),
            "only run directories go"
        );
    }
}
