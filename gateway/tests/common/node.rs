//! A running `sbxd node` for the black-box tests: started with its address file, killed
//! (SIGKILL, by pid) and reaped when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_drivers::remote::RemoteDriver;
use tonic::transport::ClientTlsConfig;

use super::{SBXD, wait_bounded};

/// How long a node may take to write its address file.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// The deadline of each call to a node.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a refused start may take to exit.
pub const REFUSAL_TIMEOUT: Duration = Duration::from_secs(20);

/// A running `sbxd node`, SIGKILLed (by pid) and reaped when dropped.
pub struct Node {
    pub child: Child,
    pub addr: String,
    pub addr_file: PathBuf,
    log: PathBuf,
}

impl Node {
    /// A `process` node over `data` on loopback without TLS (`--auth none`), its state in
    /// DATA/drivers/process (where the data dir's guard and `all_workload_pids` look), in the
    /// tests' cgroup parent; `extra` after (`--capacity-cpu`, …). Answers the node and its
    /// state dir.
    pub fn process(data: &Path, extra: &[&str]) -> (Node, PathBuf) {
        let state = data.join("drivers/process");
        std::fs::create_dir_all(&state).unwrap();
        let mut args = vec![
            "--driver",
            "process",
            "--state-dir",
            state.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--auth",
            "none",
            "--cgroup-parent",
            super::TEST_CGROUP_PARENT,
        ];
        args.extend_from_slice(extra);
        (Node::start(data, &args), state)
    }

    /// Starts `sbxd node ARGS… --addr-file DIR/addr` and waits for its address file.
    pub fn start(dir: &Path, args: &[&str]) -> Node {
        let addr_file = dir.join("addr");
        let log = dir.join(format!("node-{}.log", super::unique()));
        let log_file = std::fs::File::create(&log).expect("log file");
        let child = Command::new(SBXD)
            .arg("node")
            .args(args)
            .arg("--addr-file")
            .arg(&addr_file)
            .env("SBX_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("spawn sbxd node");
        let mut node = Node {
            child,
            addr: String::new(),
            addr_file,
            log,
        };
        let began = Instant::now();
        node.addr = loop {
            if let Ok(text) = std::fs::read_to_string(&node.addr_file) {
                assert!(text.ends_with('\n'), "partial address file {text:?}");
                break text.trim().to_string();
            }
            if let Ok(Some(status)) = node.child.try_wait() {
                panic!(
                    "sbxd node exited with {status} before serving:\n{}",
                    node.log_text()
                );
            }
            assert!(
                began.elapsed() < START_TIMEOUT,
                "sbxd node wrote no address file within {START_TIMEOUT:?}:\n{}",
                node.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        node
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// A client of this node over plain TCP.
    pub fn plain(&self) -> RemoteDriver {
        RemoteDriver::connect_tcp_lazy(&self.addr, None, CALL_TIMEOUT).expect("a client")
    }

    /// A client of this node over TLS.
    pub fn tls(&self, tls: ClientTlsConfig) -> RemoteDriver {
        RemoteDriver::connect_tcp_lazy(&self.addr, Some(tls), CALL_TIMEOUT).expect("a client")
    }

    /// SIGTERM, and the exit (bounded).
    pub fn sigterm(&mut self) -> ExitStatus {
        kill(Pid::from_raw(self.child.id() as i32), Signal::SIGTERM).expect("SIGTERM");
        wait_bounded(
            &mut self.child,
            Duration::from_secs(20),
            "sbxd node after SIGTERM",
        )
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        // Child::kill is SIGKILL to this child's pid (an error, ignored, once it has ended).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `sbxd certs init --dir DIR ARGS…`, which must succeed.
pub fn certs_init(dir: &Path, args: &[&str]) {
    let made = super::run_bounded(
        Command::new(SBXD)
            .args(["certs", "init", "--dir"])
            .arg(dir)
            .args(args),
        "sbxd certs init",
    );
    assert_eq!(made.code, 0, "certs init {}: {made:?}", dir.display());
}
