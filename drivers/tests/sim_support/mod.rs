//! What a conformance harness of the sim driver answers, whatever carries the sim (in process,
//! over a Unix socket, over TCP): the sim's own command language (`sleep`, `exit N`, its
//! "unknown command"), and no processes.

/// The [`DriverHarness`](sbx_drivers::conformance::DriverHarness) methods every sim harness
/// shares; invoke it inside the `impl`.
macro_rules! sim_harness_answers {
    () => {
        fn long_running_spec(&self) -> sbx_drivers::pb::SandboxSpec {
            sbx_drivers::pb::SandboxSpec {
                command: vec!["sleep".into(), "3600".into()],
                ..Default::default()
            }
        }

        fn settle_timeout(&self) -> std::time::Duration {
            std::time::Duration::from_secs(2)
        }

        fn exec_exit(&self, code: i32) -> Vec<String> {
            vec!["exit".into(), code.to_string()]
        }

        fn runs_processes(&self) -> bool {
            false
        }

        fn command_not_found_stderr(&self, name: &str) -> Option<String> {
            Some(format!("sim: unknown command: {name}"))
        }

        fn exiting_spec(&self, code: i32) -> Option<sbx_drivers::pb::SandboxSpec> {
            Some(sbx_drivers::pb::SandboxSpec {
                command: vec!["exit".into(), code.to_string()],
                ..Default::default()
            })
        }
    };
}
