//! The driver conformance suite against the vm driver (QEMU microVMs; needs qemu-system-x86,
//! qemu-utils, linux-image-amd64 and busybox-static, which `.ci/run` installs). One test per
//! check, each on its own state directory; after each, no VM may be left. `kill` drops the
//! driver instance; the VMs, daemonized, outlive it and the next instance finds them again.

mod vm_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sbx_drivers::conformance::DriverHarness;
use sbx_drivers::{ComputeDriver, pb};
use vm_support::VmEnv;

struct VmHarness {
    env: VmEnv,
}

#[async_trait]
impl DriverHarness for VmHarness {
    async fn open(&self) -> Arc<dyn ComputeDriver> {
        Arc::new(self.env.open().await)
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
        Duration::from_secs(60)
    }

    fn call_timeout(&self) -> Duration {
        Duration::from_secs(120)
    }
}

// One test per check, each on its own state directory, so a check can be run alone by name
// (`cargo nextest run -p sbx-drivers --test conformance_vm copy_`); nextest runs them one
// after the other (the `vm` test group). Each check boots its own VMs either way: a shared
// state saved only the driver's open, which with the asset cache is milliseconds.
sbx_drivers::conformance_suite! {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    harness: VmHarness { env: VmEnv::new() },
    after_each: |h| h.env.assert_no_vm_left(),
}
