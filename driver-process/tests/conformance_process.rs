//! The driver conformance suite against the process driver (needs root): one test per check,
//! each on its own state directory and cgroup parent, each ending with the leak check (no
//! cgroup, process or mount of the test left). `kill` drops the driver instance; the next
//! `open` is a new instance on the same state directory, as after a crash of the controller.

mod process_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use process_support::TestEnv;
use sbx_driver_api::conformance::DriverHarness;
use sbx_driver_api::{ComputeDriver, pb};

struct ProcessHarness {
    env: TestEnv,
}

#[async_trait]
impl DriverHarness for ProcessHarness {
    async fn open(&self) -> Arc<dyn ComputeDriver> {
        Arc::new(self.env.open())
    }

    async fn kill(&self, driver: Arc<dyn ComputeDriver>) {
        drop(driver);
    }

    fn long_running_spec(&self) -> pb::SandboxSpec {
        pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }
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
    harness: ProcessHarness { env: TestEnv::new() },
    after_each: |h| h.env.finish().await,
    run_all_test: run_all_on_one_shared_state,
}
