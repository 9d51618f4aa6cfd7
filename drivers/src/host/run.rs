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
//! a wrapper or the runtime would have said.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use uuid::Uuid;

use super::observe::{self, Desired, Observed, RunFacts};
use super::procfs::{self, ProcessIdentity};

/// The files of one run of the workload.
#[derive(Debug, Clone)]
pub(crate) struct RunDir {
    pub dir: PathBuf,
}

impl RunDir {
    /// The run directory named `run_id` of the sandbox whose directory is `sandbox_dir`.
    pub(crate) fn new(sandbox_dir: &Path, run_id: &str) -> RunDir {
        RunDir {
            dir: sandbox_dir.join(format!("run-{run_id}")),
        }
    }

    pub(crate) fn init(&self) -> PathBuf {
        self.dir.join("init")
    }

    pub(crate) fn exit(&self) -> PathBuf {
        self.dir.join("exit")
    }

    /// The identity of the run's init, as it was recorded.
    pub(crate) fn read_init(&self) -> Option<ProcessIdentity> {
        let line = complete_line(&self.init())?;
        procfs::parse_stat_line(&line).map(|s| s.identity)
    }

    /// The wait status of the run's main process, once the init has written it.
    pub(crate) fn read_exit(&self) -> Option<i32> {
        complete_line(&self.exit())?.trim().parse().ok()
    }

    /// The main command the init did not find, if it wrote one.
    pub(crate) fn read_not_found(&self) -> Option<String> {
        let line = complete_line(&self.dir.join("not-found"))?;
        Some(line.trim_end_matches('\n').to_string())
    }

    /// The run observed: [`observe::observe`] of its [`RunDir::facts`], and a status 127
    /// with a `not-found` file told as the command not found (by name).
    pub(crate) fn observe(
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
            observed.message =
                format!("command not found: {command} (the main process exited with code 127)");
        }
        (observed, init)
    }

    /// What an observation of the run needs to know, with the run's init as recorded.
    /// `oom_kills_rose` (whether the memory cgroup's OOM-kill counter rose during the run) is
    /// asked only of a run meant to be running whose recorded init is gone: in any other case
    /// the observation does not depend on it.
    pub(crate) fn facts(
        &self,
        desired: Desired,
        oom_kills_rose: impl FnOnce() -> bool,
    ) -> (RunFacts, Option<ProcessIdentity>) {
        let init = self.read_init();
        let alive = init.as_ref().is_some_and(procfs::is_alive);
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

    /// The run's init, if it still runs.
    pub(crate) fn live_init(&self) -> Option<ProcessIdentity> {
        self.read_init().filter(procfs::is_alive)
    }

    /// SIGTERM to the run's init, if it runs (the init passes it on to the workload), and
    /// SIGKILL if it still runs after `grace` (checked every 10 ms). Returns the init it
    /// signalled.
    pub(crate) async fn signal_init(
        &self,
        sandbox_id: Uuid,
        grace: Duration,
    ) -> Option<ProcessIdentity> {
        let init = self.live_init()?;
        tracing::info!(%sandbox_id, %init, ?grace, "ending the workload");
        let pid = Pid::from_raw(init.pid);
        let _ = kill(pid, Signal::SIGTERM);
        let deadline = tokio::time::Instant::now() + grace;
        while procfs::is_alive(&init) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if procfs::is_alive(&init) {
            tracing::warn!(%sandbox_id, ?grace, "SIGTERM not heeded; SIGKILL");
            let _ = kill(pid, Signal::SIGKILL);
        }
        Some(init)
    }

    /// SIGKILL to the run's init, if it runs: the end, without grace, of a stop that a killed
    /// driver left unfinished.
    pub(crate) fn finish_interrupted_stop(&self, sandbox_id: Uuid) {
        if let Some(init) = self.live_init() {
            tracing::warn!(%sandbox_id, %init, "finishing an interrupted stop");
            let _ = kill(Pid::from_raw(init.pid), Signal::SIGKILL);
        }
    }
}

/// Removes every run directory of the sandbox whose directory is `sandbox_dir`.
pub(crate) fn remove_runs(sandbox_dir: &Path) -> io::Result<()> {
    for entry in fs::read_dir(sandbox_dir)?.flatten() {
        if entry.file_name().to_string_lossy().starts_with("run-") {
            fs::remove_dir_all(entry.path())?;
        }
    }
    Ok(())
}

/// The file's text if it is a complete line (written to its final newline), else `None`.
pub(crate) fn complete_line(path: &Path) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    text.ends_with('\n').then_some(text)
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
        fs::write(run.exit(), "137\n").unwrap();
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
        fs::write(run.exit(), "13").unwrap();
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
