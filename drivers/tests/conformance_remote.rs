//! The driver conformance suite through [`RemoteDriver`] against a real `sbx-driver-host
//! --backend process` child process (needs root). `kill` SIGKILLs the host; `open` starts a
//! new host on the same state directory and socket. Every workload must survive the SIGKILL
//! (the process driver starts them in their own sessions). Each test has its own state
//! directory and cgroup parent and ends with the process tests' leak check: no cgroup,
//! process or mount of the test left.

// The process driver's own test support (driver-process/tests/), for its driver host.
#[path = "../../driver-process/tests/process_support/mod.rs"]
mod process_support;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use process_support::TestEnv;
use sbx_drivers::conformance::DriverHarness;
use sbx_drivers::remote::RemoteDriver;
use sbx_drivers::{ComputeDriver, pb};

const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `sbx-driver-host`, SIGKILLed and reaped when dropped.
struct HostProcess {
    child: Child,
}

impl HostProcess {
    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for HostProcess {
    fn drop(&mut self) {
        // Child::kill is SIGKILL to this child's pid (and a no-op error if it already ended).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// Fields drop in order: a failed test's host is killed before `env` cleans up after it.
struct RemoteProcessHarness {
    /// The host serving the current instance; `None` between a kill and the next open.
    host: Mutex<Option<HostProcess>>,
    env: TestEnv,
    /// Holds the socket, apart from the state directory.
    socket_dir: tempfile::TempDir,
}

impl RemoteProcessHarness {
    fn new() -> Self {
        RemoteProcessHarness {
            host: Mutex::new(None),
            env: TestEnv::new(),
            socket_dir: tempfile::Builder::new()
                .prefix("sbx-remote-")
                .tempdir()
                .unwrap(),
        }
    }

    fn socket(&self) -> PathBuf {
        self.socket_dir.path().join("process.sock")
    }

    fn spawn_host(&self) -> HostProcess {
        let child = Command::new(env!("CARGO_BIN_EXE_sbx-driver-host"))
            .arg("--backend")
            .arg("process")
            .arg("--socket")
            .arg(self.socket())
            .arg("--state-dir")
            .arg(self.env.state_dir.path())
            .arg("--cgroup-parent")
            .arg(&self.env.cgroup_parent)
            .args(["--default-grace-ms", "2000", "--poll-interval-ms", "50"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .expect("starting sbx-driver-host");
        HostProcess { child }
    }

    /// SIGKILLs the current host, if any, and reaps it.
    fn kill_host(&self) {
        let host = self.host.lock().unwrap().take();
        drop(host);
    }

    /// Kills the last host, then checks that nothing of the test is left.
    async fn finish(self) {
        self.kill_host();
        self.env.finish().await;
    }
}

#[async_trait]
impl DriverHarness for RemoteProcessHarness {
    async fn open(&self) -> Arc<dyn ComputeDriver> {
        self.kill_host();
        let mut host = self.spawn_host();
        let remote = RemoteDriver::connect_lazy(self.socket(), CALL_TIMEOUT);
        let started = Instant::now();
        loop {
            if let Ok(caps) = remote.capabilities().await {
                assert_eq!(caps.driver, "process");
                break;
            }
            if let Some(status) = host.child.try_wait().unwrap() {
                panic!("sbx-driver-host (pid {}) ended: {status}", host.pid());
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "sbx-driver-host did not answer within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        *self.host.lock().unwrap() = Some(host);
        Arc::new(remote)
    }

    async fn kill(&self, driver: Arc<dyn ComputeDriver>) {
        drop(driver);
        self.kill_host();
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
        CALL_TIMEOUT
    }
}

sbx_drivers::conformance_suite! {
    #[tokio::test]
    harness: RemoteProcessHarness::new(),
    after_each: |h| h.finish().await,
    run_all_test: run_all_on_one_shared_state,
}
