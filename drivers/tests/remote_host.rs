//! The `sbx-driver-host` binary, black box: workloads outlive its SIGKILL (checked in /proc,
//! while no host runs) and a new host finds them; SIGTERM ends it cleanly (exit 0, socket
//! removed, workloads left running); a second host on a live socket is refused; its command
//! line. The process-backend tests need root and end with the process tests' leak check.

// The process driver's own test support (driver-process/tests/), for its driver host.
#[path = "../../driver-process/tests/process_support/mod.rs"]
mod process_support;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use process_support::TestEnv;
use sbx_drivers::remote::RemoteDriver;
use sbx_drivers::{ComputeDriver, pb};
use uuid::Uuid;

const HOST: &str = env!("CARGO_BIN_EXE_sbx-driver-host");

/// A running host, SIGKILLed and reaped when dropped.
struct Host {
    child: Child,
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Host {
    fn spawn(args: &[&std::ffi::OsStr]) -> Host {
        let child = Command::new(HOST)
            .args(args)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        Host { child }
    }

    fn process(env: &TestEnv, socket: &Path) -> Host {
        Host::spawn(&[
            "--backend".as_ref(),
            "process".as_ref(),
            "--socket".as_ref(),
            socket.as_os_str(),
            "--state-dir".as_ref(),
            env.state_dir.path().as_os_str(),
            "--cgroup-parent".as_ref(),
            env.cgroup_parent.as_ref(),
            "--default-grace-ms".as_ref(),
            "2000".as_ref(),
        ])
    }

    fn sim(socket: &Path) -> Host {
        Host::spawn(&[
            "--backend".as_ref(),
            "sim".as_ref(),
            "--socket".as_ref(),
            socket.as_os_str(),
        ])
    }

    /// Waits (bounded) until the host answers on `socket`.
    async fn wait_ready(&mut self, socket: &Path) -> RemoteDriver {
        let client = RemoteDriver::connect_lazy(socket.to_path_buf(), Duration::from_secs(20));
        let started = Instant::now();
        while client.capabilities().await.is_err() {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the host ended before answering: {status}");
            }
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "host not ready in 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        client
    }

    /// Waits (bounded) for the host to end by itself.
    async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        let started = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                started.elapsed() < limit,
                "the host did not end within {limit:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn sigkill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

fn socket_dir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("sbx-host-")
        .tempdir()
        .unwrap()
}

fn long_running(name: &str) -> pb::CreateRequest {
    pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: Uuid::new_v4().to_string(),
        workspace: "ws".into(),
        name: name.into(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }),
        generation: 1,
        stopped: false,
    }
}

/// The running workload of `id`, read by a driver opened directly on the state (no host may
/// run), and whether /proc shows that very process (pid and start tick) alive.
fn workload_alive(env: &TestEnv, id: &str) -> bool {
    let driver = env.open();
    let Some(identity) = driver.workload_identity(Uuid::parse_str(id).unwrap()) else {
        return false;
    };
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", identity.pid)) else {
        return false;
    };
    let after_comm = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields 3 (state) and 22 (start time) of the line are 0 and 19 after the command name.
    fields[0] != "Z" && fields[19].parse::<u64>().unwrap() == identity.start_ticks
}

#[tokio::test]
async fn workloads_outlive_a_sigkilled_host_and_a_new_host_finds_them() {
    let env = TestEnv::new();
    let dir = socket_dir();
    let socket = dir.path().join("p.sock");
    let mut host = Host::process(&env, &socket);
    let client = host.wait_ready(&socket).await;
    let first = client.create(long_running("one")).await.unwrap();
    let second = client.create(long_running("two")).await.unwrap();
    assert_eq!(first.state, pb::State::Running as i32);

    host.sigkill();
    assert!(
        workload_alive(&env, &first.sandbox_id),
        "one died with the host"
    );
    assert!(
        workload_alive(&env, &second.sandbox_id),
        "two died with the host"
    );

    let mut host = Host::process(&env, &socket);
    host.wait_ready(&socket).await;
    // The same client, which talked to the killed host, reconnects by itself.
    for before in [&first, &second] {
        let found = client
            .get(pb::GetRequest {
                sandbox_id: before.sandbox_id.clone(),
            })
            .await
            .unwrap();
        assert_eq!(found.state, pb::State::Running as i32);
        assert_eq!(
            found.instance_id, before.instance_id,
            "restarted, not re-found"
        );
        assert_eq!((found.workspace.as_str(), found.generation), ("ws", 1));
    }
    let mut ids: Vec<String> = client
        .list()
        .await
        .unwrap()
        .into_iter()
        .map(|s| s.sandbox_id)
        .collect();
    ids.sort();
    let mut expected = vec![first.sandbox_id.clone(), second.sandbox_id.clone()];
    expected.sort();
    assert_eq!(ids, expected);
    host.sigkill();
    env.finish().await;
}

#[tokio::test]
async fn sigterm_ends_the_host_cleanly_and_leaves_workloads_running() {
    let env = TestEnv::new();
    let dir = socket_dir();
    let socket = dir.path().join("p.sock");
    let mut host = Host::process(&env, &socket);
    let client = host.wait_ready(&socket).await;
    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    let sandbox = client.create(long_running("stays")).await.unwrap();

    kill(Pid::from_raw(host.child.id() as i32), Signal::SIGTERM).unwrap();
    let status = host.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
    assert!(
        !socket.exists(),
        "the socket file must be removed on SIGTERM"
    );
    assert!(
        workload_alive(&env, &sandbox.sandbox_id),
        "SIGTERM must not stop workloads"
    );
    drop(host);
    env.finish().await;
}

#[tokio::test]
async fn a_second_host_on_a_live_socket_is_refused() {
    let dir = socket_dir();
    let socket = dir.path().join("s.sock");
    let mut first = Host::sim(&socket);
    let client = first.wait_ready(&socket).await;
    let mut second = Host::sim(&socket);
    let status = second.wait_exit(Duration::from_secs(10)).await;
    assert!(!status.success(), "{status}");
    let mut stderr = String::new();
    std::io::Read::read_to_string(second.child.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert!(stderr.contains("another driver host answers"), "{stderr}");
    assert_eq!(client.capabilities().await.unwrap().driver, "sim");
    drop(first);
}

fn run(args: &[&str]) -> Output {
    Command::new(HOST).args(args).output().unwrap()
}

#[test]
fn the_command_line_is_checked_and_explained() {
    let help = run(&["--help"]);
    assert!(help.status.success());
    let text = String::from_utf8_lossy(&help.stdout);
    for needle in [
        "--backend",
        "--socket",
        "--state-dir",
        "--cgroup-parent",
        "process",
        "sim",
    ] {
        assert!(text.contains(needle), "--help lacks {needle}: {text}");
    }
    assert!(
        text.contains("in memory") && text.contains("loses"),
        "--help must say that sim loses its state: {text}"
    );
    let dir = socket_dir();
    let socket: PathBuf = dir.path().join("x.sock");
    let no_state = run(&["--backend", "process", "--socket", socket.to_str().unwrap()]);
    assert_eq!(no_state.status.code(), Some(2), "usage error expected");
    assert!(String::from_utf8_lossy(&no_state.stderr).contains("--state-dir"));
    let bad_backend = run(&["--backend", "vm", "--socket", socket.to_str().unwrap()]);
    assert_eq!(bad_backend.status.code(), Some(2));
    assert!(!socket.exists());
}
