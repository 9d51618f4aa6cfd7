//! Shared by the remote_*.rs tests: sandbox calls by id, a `sbxd driver` host started (and
//! killed, by pid) by the test, and the managed driver's pid file.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, ExecRequest, GetSandboxRequest, Phase, Sandbox, SandboxRef, SandboxSpec,
    exec_output,
};
use tonic::transport::Channel;

use crate::common::{SBXD, TEST_CGROUP_PARENT, eventually, proc_start_time};

pub fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.into(),
        ..Default::default()
    })
}

pub async fn get(sb: &SandboxServiceClient<Channel>, id: &str) -> Sandbox {
    sb.clone()
        .get_sandbox(GetSandboxRequest { sandbox: by_id(id) })
        .await
        .unwrap()
        .into_inner()
}

/// Waits (at most `limit`) until sandbox `id` is in `phase`.
pub async fn settle(
    sb: &SandboxServiceClient<Channel>,
    id: &str,
    phase: Phase,
    limit: Duration,
) -> Sandbox {
    eventually(limit, &format!("{id} {phase:?}"), || async {
        let s = get(sb, id).await;
        (s.phase() == phase).then_some(s)
    })
    .await
}

/// Creates a sandbox running `sleep infinity`; answers its id.
pub async fn create_sleeper(sb: &SandboxServiceClient<Channel>, prefix: &str) -> String {
    sb.clone()
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: format!("{prefix}-{}", crate::common::unique()),
            spec: Some(SandboxSpec {
                command: vec!["sleep".into(), "infinity".into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .unwrap()
        .into_inner()
        .id
}

/// Runs `sh -c SCRIPT` in the sandbox; answers (exit code, stdout), or the status the call
/// (or its stream) failed with.
pub async fn sh(
    sb: &SandboxServiceClient<Channel>,
    id: &str,
    script: &str,
) -> Result<(i32, String), tonic::Status> {
    let mut stream = sb
        .clone()
        .exec(
            ExecRequest {
                sandbox: by_id(id),
                command: vec!["sh".into(), "-c".into(), script.into()],
                timeout_seconds: 30,
                ..Default::default()
            }
            .alone(),
        )
        .await?
        .into_inner();
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(msg) = tokio::time::timeout(Duration::from_secs(40), stream.next())
        .await
        .expect("exec answered")
    {
        match msg?.chunk {
            Some(exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(exec_output::Chunk::Exit(e)) => code = Some(e.code),
            _ => {}
        }
    }
    Ok((code.expect("an exit"), String::from_utf8(out).unwrap()))
}

/// (pid, start ticks) recorded in DATA/drivers/process.pid by managed mode.
pub fn managed_driver(data: &Path) -> Option<(i32, u64)> {
    let text = std::fs::read_to_string(data.join("drivers/process.pid")).ok()?;
    let mut fields = text.split_whitespace();
    Some((fields.next()?.parse().ok()?, fields.next()?.parse().ok()?))
}

/// Whether the process (pid, start ticks) still runs (zombies count as gone).
pub fn runs(pid: i32, start: u64) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    let zombie = stat
        .rfind(')')
        .and_then(|i| stat[i + 1..].split_whitespace().next())
        .is_some_and(|s| s == "Z" || s == "X");
    !zombie && proc_start_time(pid) == Some(start)
}

/// On drop, SIGKILLs the managed driver recorded in DATA/drivers/process.pid if that very
/// process still runs — the safety net for a failed test that left it orphaned.
pub struct ManagedDriverGuard(pub PathBuf);

impl Drop for ManagedDriverGuard {
    fn drop(&mut self) {
        if let Some((pid, start)) = managed_driver(&self.0)
            && runs(pid, start)
        {
            eprintln!("killing leftover managed driver {pid}");
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// An `sbxd driver --backend process` the test runs on `socket` over DATA/drivers/process
/// (where the harness's leak checks look). SIGKILLed by pid when dropped.
pub struct DriverHost {
    child: Child,
    pub log: PathBuf,
}

impl DriverHost {
    pub fn start(data: &Path, socket: &Path) -> DriverHost {
        let log = data.join(format!("driver-{}.log", crate::common::unique()));
        let child = Command::new(SBXD)
            .args(["driver", "--backend", "process", "--socket"])
            .arg(socket)
            .arg("--state-dir")
            .arg(data.join("drivers/process"))
            .args(["--cgroup-parent", TEST_CGROUP_PARENT])
            .env("SBX_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("driver log"))
            .spawn()
            .expect("spawn sbxd driver");
        let began = Instant::now();
        let mut host = DriverHost { child, log };
        // Bounded wait for the socket to appear (the host makes it once it serves).
        while !socket.exists() {
            if let Ok(Some(status)) = host.child.try_wait() {
                panic!("sbxd driver exited with {status}:\n{}", host.log_text());
            }
            assert!(
                began.elapsed() < Duration::from_secs(30),
                "no socket after 30 s:\n{}",
                host.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        host
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn sigkill(&mut self) {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
    }

    /// SIGTERM and wait (at most `limit`); panics if it did not exit.
    pub fn sigterm(&mut self, limit: Duration) -> std::process::ExitStatus {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGTERM);
        let began = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return status;
            }
            assert!(began.elapsed() < limit, "sbxd driver ignored SIGTERM");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for DriverHost {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// Whether a phase is one a sandbox may show while its driver is away.
pub fn away_phase(s: &Sandbox) -> bool {
    s.phase() == Phase::Ready || (s.phase() == Phase::Error && s.reason == "DriverUnavailable")
}
