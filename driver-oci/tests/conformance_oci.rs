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
use sbx_driver_api::conformance::DriverHarness;
use sbx_driver_api::{ComputeDriver, pb};

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

sbx_driver_api::conformance_suite! {
    #[tokio::test]
    harness: OciHarness { env: TestEnv::new() },
    after_each: |h| h.env.finish().await,
}
