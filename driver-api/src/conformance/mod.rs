//! The driver conformance suite: one set of checks, run against every [`ComputeDriver`].
//!
//! It checks the promises of the driver contract that the gateway relies on: resolution by id
//! only (two sandboxes named `demo` in two workspaces), `INVALID_ARGUMENT` for empty and
//! malformed ids, idempotent stop / start / delete, the generation round-trip and
//! `GenerationMismatch`, workloads that survive a crash of the driver instance and are found
//! again by a new one, workspace and name round-tripped by list, exec, and workloads that end
//! by themselves (state EXITED with their exit code, and a watch event saying so), and the
//! bidirectional exec (stdin, terminals and their size, signals, the working directory and
//! environment, a command not found, a dropped output stream; see `exec.rs`), and copying
//! files and forwarding ports (a tree there and back, escapes refused, 100 KiB through a
//! forwarded connection, a closed port; see `files.rs`).
//!
//! # Using it for a driver
//!
//! Implement [`DriverHarness`] in the driver's integration test, then invoke
//! [`conformance_suite!`](crate::conformance_suite): it makes one `#[tokio::test]` per check,
//! each on a fresh harness (so that each check passes or fails on its own, and can be run
//! alone by name), and optionally one that runs [`run_all`] on one shared harness. The list
//! of checks is written once, in that macro; [`run_all`] runs the same list, so a new check
//! runs against every driver. Where every check costs seconds (the vm driver boots a VM for
//! each sandbox), call [`run_all`] alone instead.
//!
//! ```ignore
//! use sbx_drivers::conformance::DriverHarness;
//!
//! struct ProcessHarness { state_dir: tempfile::TempDir }
//!
//! #[async_trait::async_trait]
//! impl DriverHarness for ProcessHarness {
//!     async fn open(&self) -> Arc<dyn ComputeDriver> { /* a driver on self.state_dir */ }
//!     async fn kill(&self, driver: Arc<dyn ComputeDriver>) { drop(driver) /* or SIGKILL */ }
//!     fn long_running_spec(&self) -> pb::SandboxSpec { /* sleep 3600 */ }
//!     fn settle_timeout(&self) -> Duration { Duration::from_secs(10) }
//!     // exec_echo, exec_exit, exec_cat, exiting_spec and call_timeout have defaults for real
//!     // drivers (`echo TEXT`, `sh -c 'exit N'`, `cat`, `sh -c 'sleep 0.2; exit N'`); override
//!     // them where the driver's commands differ (the sim's harness uses its built-in
//!     // `exit N`), and runs_processes, exec_workdir and command_not_found_stderr where the
//!     // driver's exec is not a real process with a working directory; echo_server has a
//!     // busybox default where runs_processes is true.
//! }
//!
//! sbx_drivers::conformance_suite! {
//!     #[tokio::test]
//!     harness: ProcessHarness::new(),
//!     // Optional: after each check passed, with the harness (e.g. a leak check).
//!     after_each: |h| h.finish().await,
//!     // Optional: a test that runs `run_all` on one harness, then `after_each`.
//!     run_all_test: run_all_on_one_shared_state,
//! }
//! ```
//!
//! Each check panics with a message that says what was expected and what the driver answered.
//! Each check deletes every sandbox it created — on success, and also when it fails, before
//! the panic goes on — and on success it also checks that the deletes worked (get answers
//! `NotFound`). Every driver call has a deadline ([`DriverHarness::call_timeout`]), so a
//! driver that does not answer fails the check instead of hanging it. A check that needs a
//! capability the driver does not report (exec, watch, copy, port_forward) or something the
//! harness cannot give ([`DriverHarness::exiting_spec`] or [`DriverHarness::echo_server`]
//! returning `None`) prints that it skips and returns.
//!
//! Checks never match sandboxes by name, except to prove that a request with a bad id made
//! nothing; they filter list results by the ids they created, so a harness may share driver
//! state between checks.

pub mod attacks;
mod exec;
mod files;
mod identity;
mod lifecycle;
mod session;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{ComputeDriver, pb};

pub use exec::{
    exec_command_not_found_is_127, exec_dropped_stream_ends_the_command,
    exec_refuses_bad_argv_and_env, exec_refuses_what_the_driver_lacks,
    exec_signal_reaches_the_command, exec_stdin_round_trips,
    exec_tty_gives_a_terminal_of_the_asked_size, exec_without_stdin_sees_end_of_file,
    exec_workdir_and_env,
};
pub use files::{
    copy_reaches_a_stopped_sandboxs_files, copy_refuses_escapes_and_missing_paths,
    copy_round_trips_a_tree, port_forward_carries_bytes_both_ways,
    port_forward_to_a_closed_port_fails,
};
pub use identity::{
    empty_and_malformed_ids_are_invalid, list_round_trips_workspace_and_name,
    same_name_in_two_workspaces, workloads_survive_driver_restart,
};
pub use lifecycle::{
    exec_returns_stdout_and_exit_code, generation_round_trip_and_mismatch,
    idempotent_stop_start_delete, pause_and_resume_keep_the_run, self_exit_shows_exited_with_code,
    watch_reports_self_exit,
};

/// What the suite needs from a driver's test: a way to open (and crash) driver instances on
/// one persistent state, and the commands that driver runs.
#[async_trait]
pub trait DriverHarness: Send + Sync {
    /// Opens a driver instance on the harness's persistent state (the same state each time).
    async fn open(&self) -> Arc<dyn ComputeDriver>;

    /// Ends the given driver instance as a crash would (drop it; for an out-of-process driver,
    /// SIGKILL the hosting process). Workloads must survive.
    async fn kill(&self, driver: Arc<dyn ComputeDriver>);

    /// A spec whose workload runs until stopped (e.g. `sleep 3600` for real drivers).
    fn long_running_spec(&self) -> pb::SandboxSpec;

    /// How long to wait for a state change to show (real drivers are slower).
    fn settle_timeout(&self) -> Duration;

    /// The deadline of one driver call. Covers a stop's grace period.
    fn call_timeout(&self) -> Duration {
        Duration::from_secs(30)
    }

    /// A command that writes `text` and a newline to stdout and exits 0.
    fn exec_echo(&self, text: &str) -> Vec<String> {
        vec!["echo".to_string(), text.to_string()]
    }

    /// A command that exits with `code`.
    fn exec_exit(&self, code: i32) -> Vec<String> {
        vec!["sh".to_string(), "-c".to_string(), format!("exit {code}")]
    }

    /// A command that writes its stdin back to stdout until stdin ends, then exits 0; with
    /// an empty stdin it writes nothing and exits 0 at once.
    fn exec_cat(&self) -> Vec<String> {
        vec!["cat".to_string()]
    }

    /// Whether exec runs real processes in a POSIX userland (`sh`, `sleep`, `kill`, `pwd`,
    /// `tty`, `stty` on its PATH). `false` (the sim: only its built-ins) skips the checks and
    /// parts that need them, saying so.
    fn runs_processes(&self) -> bool {
        true
    }

    /// Whether exec takes a working directory (`ExecRequest.workdir`). `false` (the vm):
    /// the driver must answer `Unimplemented` to one instead.
    fn exec_workdir(&self) -> bool {
        true
    }

    /// What stderr of an exec of the missing command `name` contains. `None`: only that it
    /// names the command (a driver whose exec is a shell script says it in the shell's words).
    fn command_not_found_stderr(&self, name: &str) -> Option<String> {
        Some(format!("command not found: {name}"))
    }

    /// A command that listens on TCP `port` of the sandbox's loopback and writes back what
    /// each connection sends until that connection's write side closes, then closes it; run
    /// as an exec that the check holds open. `None` skips the check that needs one. The
    /// default, where [`runs_processes`](Self::runs_processes), is busybox's `nc -ll -e cat`
    /// (the oci busybox image has it; for the process driver, the host's busybox-static).
    fn echo_server(&self, port: u16) -> Option<Vec<String>> {
        self.runs_processes().then(|| {
            ["busybox", "nc", "-ll", "-p", &port.to_string(), "-e", "cat"]
                .map(String::from)
                .to_vec()
        })
    }

    /// A spec whose main process ends by itself soon after it starts, with `code`; `None`
    /// skips the checks that need one.
    fn exiting_spec(&self, code: i32) -> Option<pb::SandboxSpec> {
        Some(pb::SandboxSpec {
            command: vec![
                "sh".to_string(),
                "-c".to_string(),
                format!("sleep 0.2; exit {code}"),
            ],
            ..Default::default()
        })
    }
}

/// Runs every check of [`conformance_suite!`](crate::conformance_suite)'s list, one after the
/// other, on the same harness; panics at the first failure.
pub async fn run_all(h: &dyn DriverHarness) {
    crate::conformance_suite!(@with_checks run_all h);
}

/// The conformance suite as tests: one test per check, each on a fresh harness, plus
/// optionally one that runs [`run_all`] on a single harness.
///
/// This macro holds THE list of checks; [`run_all`] runs the same list. A new check is added
/// here, once, and every driver's test file runs it.
///
/// ```ignore
/// sbx_drivers::conformance_suite! {
///     // The attributes of every generated test (at least the test attribute itself).
///     #[tokio::test]
///     // How to build a fresh harness; evaluated once per test.
///     harness: ProcessHarness { env: TestEnv::new() },
///     // Optional: run after the check passed, with the harness (here: the leak check).
///     after_each: |h| h.env.finish().await,
///     // Optional: the name of a test that runs `run_all` on one harness, then `after_each`.
///     run_all_test: run_all_on_one_shared_state,
/// }
/// ```
///
/// Each test is named after its check (`same_name_in_two_workspaces`, ...), so
/// `cargo nextest run --test conformance_process same_name_in_two_workspaces` runs one check.
#[macro_export]
macro_rules! conformance_suite {
    // THE list of checks, in the order `run_all` runs them. Add a new check here, once.
    (@with_checks $($then:tt)*) => {
        $crate::conformance_suite! {
            @$($then)* [
                same_name_in_two_workspaces,
                empty_and_malformed_ids_are_invalid,
                idempotent_stop_start_delete,
                generation_round_trip_and_mismatch,
                workloads_survive_driver_restart,
                list_round_trips_workspace_and_name,
                exec_returns_stdout_and_exit_code,
                exec_stdin_round_trips,
                exec_without_stdin_sees_end_of_file,
                exec_tty_gives_a_terminal_of_the_asked_size,
                exec_signal_reaches_the_command,
                exec_workdir_and_env,
                exec_command_not_found_is_127,
                exec_dropped_stream_ends_the_command,
                exec_refuses_what_the_driver_lacks,
                exec_refuses_bad_argv_and_env,
                copy_round_trips_a_tree,
                copy_refuses_escapes_and_missing_paths,
                copy_reaches_a_stopped_sandboxs_files,
                port_forward_carries_bytes_both_ways,
                port_forward_to_a_closed_port_fails,
                self_exit_shows_exited_with_code,
                watch_reports_self_exit,
                pause_and_resume_keep_the_run,
            ]
        }
    };
    (@run_all $h:ident [$($check:ident),* $(,)?]) => {$(
        eprintln!("conformance: {}", stringify!($check));
        $crate::conformance::$check($h).await;
    )*};
    // One test per check; `$attrs` and `$after` are `{ ... }` groups, passed whole.
    (@tests $attrs:tt $make:expr, $h:ident $after:tt [$($check:ident),* $(,)?]) => {$(
        $crate::conformance_suite! { @test $attrs $make, $h $after $check $check }
    )*};
    // A test named `$name` that runs `$run` (a check, or `run_all`) on a fresh harness.
    (@test { $(#[$attr:meta])* } $make:expr, $h:ident { $($after:tt)* } $name:ident $run:ident) => {
        $(#[$attr])*
        async fn $name() {
            let $h = $make;
            $crate::conformance::$run(&$h).await;
            $($after)*
        }
    };
    (@suite $attrs:tt $make:expr, $h:ident $after:tt $($run_all_test:ident)?) => {
        $crate::conformance_suite! { @with_checks tests $attrs $make, $h $after }
        $($crate::conformance_suite! { @test $attrs $make, $h $after $run_all_test run_all })?
    };
    (
        $(#[$attr:meta])*
        harness: $make:expr,
        after_each: |$h:ident| $after:expr
        $(, run_all_test: $run_all_test:ident)? $(,)?
    ) => {
        $crate::conformance_suite! {
            @suite { $(#[$attr])* } $make, $h { $after; } $($run_all_test)?
        }
    };
    (
        $(#[$attr:meta])*
        harness: $make:expr
        $(, run_all_test: $run_all_test:ident)? $(,)?
    ) => {
        $crate::conformance_suite! { @suite { $(#[$attr])* } $make, h { } $($run_all_test)? }
    };
}

/// A script run as `user` (on a terminal with `tty`) in sandbox `id`, for the user tests of
/// the host drivers: what it gave, (exit code, stdout, stderr), or the error it was refused
/// with.
pub async fn exec_as(
    driver: &dyn ComputeDriver,
    id: &str,
    user: &str,
    tty: bool,
    script: &str,
) -> Result<(i32, String, String), crate::DriverError> {
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            timeout_seconds: 20,
            user: user.into(),
            tty: tty.then(|| pb::Tty {
                rows: 24,
                cols: 80,
                term: String::new(),
            }),
            ..Default::default()
        })
        .await?;
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(item) = futures::StreamExt::next(&mut stream).await {
        match item?.chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(pb::exec_output::Chunk::Stderr(b)) => err.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            None => {}
        }
    }
    Ok((
        code.expect("an exit"),
        String::from_utf8_lossy(&out).replace('\r', ""),
        String::from_utf8_lossy(&err).into_owned(),
    ))
}
