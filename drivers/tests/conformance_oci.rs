//! The driver conformance suite against the oci driver (needs root, runc and a static
//! busybox): one test per check, each on its own state dir, image store and cgroup parent,
//! each ending with the leak check (no container, cgroup, mount or process left). `kill`
//! drops the driver instance; the next `open` is a new instance on the same state dir, as
//! after a crash of the controller.

mod oci_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use oci_support::TestEnv;
use sbx_drivers::conformance::{self, DriverHarness};
use sbx_drivers::{ComputeDriver, pb};

struct OciHarness {
    env: TestEnv,
}

#[async_trait]
impl DriverHarness for OciHarness {
    async fn open(&self) -> Arc<dyn ComputeDriver> {
        Arc::new(self.env.open().await)
    }

    async fn kill(&self, driver: Arc<dyn ComputeDriver>) {
        drop(driver);
    }

    fn long_running_spec(&self) -> pb::SandboxSpec {
        self.env.spec(&["sleep", "3600"])
    }

    fn exiting_spec(&self, code: i32) -> Option<pb::SandboxSpec> {
        Some(
            self.env
                .spec(&["sh", "-c", &format!("sleep 0.2; exit {code}")]),
        )
    }

    fn settle_timeout(&self) -> Duration {
        Duration::from_secs(10)
    }

    fn call_timeout(&self) -> Duration {
        Duration::from_secs(20)
    }
}

macro_rules! conformance_tests {
    ($($check:ident),* $(,)?) => {$(
        #[tokio::test]
        async fn $check() {
            let h = OciHarness { env: TestEnv::new() };
            conformance::$check(&h).await;
            h.env.finish().await;
        }
    )*};
}

conformance_tests!(
    same_name_in_two_workspaces,
    empty_and_malformed_ids_are_invalid,
    idempotent_stop_start_delete,
    generation_round_trip_and_mismatch,
    workloads_survive_driver_restart,
    list_round_trips_workspace_and_name,
    exec_returns_stdout_and_exit_code,
    self_exit_shows_exited_with_code,
    watch_reports_self_exit,
);
