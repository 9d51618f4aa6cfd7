//! The driver conformance suite against the vm driver (QEMU microVMs; needs qemu-system-x86,
//! qemu-utils, linux-image-amd64 and busybox-static, which `.ci/run` installs). Every check
//! runs on one shared state directory, one after the other, to keep the number of boots
//! (seconds each under TCG) small; then no VM may be left. `kill` drops the driver instance;
//! the VMs, daemonized, outlive it and the next instance finds them again.

mod vm_support;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sbx_drivers::conformance::{self, DriverHarness};
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_driver_passes_the_conformance_suite() {
    let h = VmHarness { env: VmEnv::new() };
    let started = std::time::Instant::now();
    conformance::run_all(&h).await;
    eprintln!(
        "vm conformance: every check passed in {:?}",
        started.elapsed()
    );
    h.env.assert_no_vm_left();
}
