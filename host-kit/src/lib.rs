//! The kit of the host drivers: what every driver whose workloads run on this machine, as
//! processes of its own, shares (`oci`, `process` and `vm`).
//!
//! A host driver's workloads outlive it: each is started in its own session and found again
//! by a new driver instance from what the old one left in its state directory, by the pid
//! *and* start time of a process. So a host driver learns about its sandboxes by looking, not
//! by being told, and the kit holds what that takes:
//!
//! - [`records`] — each sandbox's record, `<root>/<id>/sandbox.json`, written atomically with
//!   its format version and read back refusing another; found again at open (half-made
//!   creates removed, the trash emptied), deletes through the trash, and `RecordCache`: the
//!   records in memory, written through, with one lifecycle lock per sandbox.
//! - [`lifecycle`] — the contract's calls every host driver answers alike (create of a known
//!   sandbox, start, stop, delete, get, list, watch, logs), over [`HostDriver`], the trait
//!   with what each does its own way (start a run, end it, see it).
//! - [`running`] — exec and port forwarding through a running sandbox's agent (oci, process).
//! - [`run`] — the run directory of a workload whose init is a host process (oci, process):
//!   `run-<id>/init` and `exit`, read only when complete, and the signals that end the init.
//! - [`lock`] — at most one live driver instance per state directory (an exclusive `flock` on
//!   `<state_dir>/driver.lock`, released by the kernel when the driver's process dies), and
//!   [`locked`], a mutex lock that survives poisoning.
//! - [`procfs`] — a process's identity (pid + start time), whether it still runs, whether it
//!   is a sandbox's own (its cgroup), and a signal sent only to such a process (by pidfd).
//! - [`safefs`] — reads of files a sandbox may have had a hand in: beneath a root, no link
//!   followed, regular files only, bounded.
//! - [`observe`] — the observed state of a run (running, exited with what, lost, OOM-killed)
//!   derived from what the gateway last asked ([`Desired`]) and the facts found ([`RunFacts`]).
//! - [`contract`] — the contract's rules for a create or start of a sandbox already known.
//! - [`feed`] — the watch feed: changes the driver makes are published at once, a poller
//!   started by the first watch publishes what changed by itself.
//! - [`logfile`] — tail and follow of a sandbox's log file.
//! - [`exec`] — an exec helper's piped output as the contract's stream, bounded, ended when
//!   the caller goes away or its timeout passes.
//! - [`sandbox_network`] — what a host driver does with the gateway's network for its
//!   sandboxes (attach at a launch, policy updates, denials, release at delete).
//! - [`command`] — checks of a command and environment before they reach a launch or an exec.
//! - [`usage`] — what a sandbox uses (the contract's `stats`), from its cgroups, its disk's
//!   filesystem, its link's counters or its process: the kernel's files only.
//!
//! **Invariant:** a host driver imports what it shares with another only from here, never
//! from that other driver.

pub mod agent;
pub mod budgets;
pub mod command;
pub mod contract;
pub mod feed;
pub mod flags;
pub mod image_process;
pub mod lifecycle;
pub mod lock;
pub mod logfile;
pub mod observe;
pub mod procfs;
pub mod ptys;
pub mod records;
pub mod run;
pub mod running;
pub mod safefs;
pub mod sandbox_network;
pub mod service;
pub mod uidpool;
pub mod usage;

pub use command::validate_command;
pub use lifecycle::{Alive, HostDriver};
pub use lock::lock_state_dir;
pub use observe::{Desired, RunFacts};
pub use procfs::ProcessIdentity;
pub use run::RunDir;
pub use sbx_driver_api::locked;

use std::time::{SystemTime, UNIX_EPOCH};

use sbx_driver_api::DriverError;

/// An internal error about `what`, with its cause.
pub fn internal(what: &str, e: impl std::fmt::Display) -> DriverError {
    DriverError::Internal(format!("{what}: {e}"))
}

/// A failed write of the driver's state under `path`: a full disk (or quota) is the machine
/// being away for now — `Unavailable`, retried with backoff, saying that the disk holding
/// `path` is full and that freeing space lets the call go through — and anything else is
/// [`internal`].
pub fn write_failure(what: &str, path: &std::path::Path, e: std::io::Error) -> DriverError {
    match e.raw_os_error() {
        Some(code) if code == nix::libc::ENOSPC || code == nix::libc::EDQUOT => {
            DriverError::Unavailable(format!(
                "{what}: the disk holding {} is full ({e}); free space there and the call \
                 goes through",
                path.display()
            ))
        }
        _ => internal(what, e),
    }
}

/// Wall-clock time now, milliseconds since the Unix epoch (0 for a clock before it).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_unavailable_and_says_so_other_write_failures_are_internal() {
        let path = std::path::Path::new("/state/sandboxes/x/sandbox.json");
        for code in [nix::libc::ENOSPC, nix::libc::EDQUOT] {
            let e = write_failure(
                "writing the sandbox record",
                path,
                std::io::Error::from_raw_os_error(code),
            );
            match &e {
                DriverError::Unavailable(message) => {
                    assert!(
                        message
                            .contains("the disk holding /state/sandboxes/x/sandbox.json is full"),
                        "{message}"
                    );
                    assert!(
                        message.starts_with("writing the sandbox record: "),
                        "{message}"
                    );
                }
                other => panic!("{code}: {other:?}"),
            }
            assert!(e.is_transient());
        }
        let e = write_failure(
            "writing the sandbox record",
            path,
            std::io::Error::from_raw_os_error(nix::libc::EACCES),
        );
        assert!(matches!(e, DriverError::Internal(_)), "{e:?}");
    }
}
