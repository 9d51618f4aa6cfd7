//! What the vm tests through sbxd share: a check that the machine can run VMs, the QEMU
//! process of a sandbox (read from its `qemu.pid`, told apart from a reused pid by its start
//! time), a reaper that kills a failed test's VMs by pid, and gRPC helpers (wait for a phase,
//! exec a shell script in the guest, check the files in `/sandbox`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
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

use crate::common::{Sbxd, proc_start_time};

/// How long a sandbox may take to become Ready (a TCG boot on a loaded 2-core machine).
pub const READY_LIMIT: Duration = Duration::from_secs(120);
/// The guest's boot timeout sbxd is given (the driver-call deadline follows it, + 15 s).
pub const BOOT_TIMEOUT_SECS: &str = "100";
/// The sandboxes' command: one line in /sandbox/boots per boot, then run on.
pub const COMMAND: &str = "echo boot >> /sandbox/boots; sleep 100000";

/// Fails, saying what to install, when the machine cannot run the vm driver.
pub fn require_vm_tools() {
    let on_path = |program: &str| {
        std::env::var("PATH")
            .unwrap_or_default()
            .split(':')
            .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
            .any(|dir| Path::new(dir).join(program).is_file())
    };
    let mut missing = Vec::new();
    for (program, package) in [
        ("qemu-system-x86_64", "qemu-system-x86"),
        ("qemu-img", "qemu-utils"),
        ("mkfs.ext4", "e2fsprogs"),
    ] {
        if !on_path(program) {
            missing.push(format!("{program} (install {package})"));
        }
    }
    if !Path::new("/bin/busybox").is_file() {
        missing.push("/bin/busybox (install busybox-static)".into());
    }
    let kernel = std::fs::read_dir("/boot")
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("vmlinuz-"));
    if !kernel {
        missing.push("/boot/vmlinuz-* (install linux-image-amd64)".into());
    }
    assert!(
        missing.is_empty(),
        "the vm end-to-end test needs: {}",
        missing.join(", ")
    );
}

/// The kernel and initramfs cache the vm driver's own tests use, so that the kernel is
/// unpacked once per machine.
pub fn asset_cache() -> PathBuf {
    std::env::temp_dir().join("sbx-vm-test-assets")
}

/// A process (a QEMU, or a managed driver), told apart from a later one with the same pid by
/// its start time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub pid: i32,
    pub start_ticks: u64,
}

/// The running QEMU of sandbox `id`: the pid in its `qemu.pid`, alive, and named after the
/// sandbox on its command line (`-name ID`).
pub fn qemu_of(data: &Path, id: &str) -> Option<Identity> {
    let pidfile = data.join("drivers/vm/vms").join(id).join("qemu.pid");
    // `PID START_TICKS` (the driver's), or QEMU's own `PID`.
    let pid: i32 = std::fs::read_to_string(pidfile)
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let qemu = Identity {
        pid,
        start_ticks: proc_start_time(pid)?,
    };
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    (is_alive(qemu) && String::from_utf8_lossy(&cmdline).contains(id)).then_some(qemu)
}

/// Whether that very process still runs: same start time, and not a zombie (a QEMU that
/// exited stays a zombie until whoever adopted the daemon reaps it).
pub fn is_alive(qemu: Identity) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{}/stat", qemu.pid)) else {
        return false;
    };
    let state = stat
        .rfind(')')
        .and_then(|close| stat[close + 1..].split_whitespace().next());
    !matches!(state, Some("Z" | "X")) && proc_start_time(qemu.pid) == Some(qemu.start_ticks)
}

/// Every QEMU process whose command line names a path under `data`, as (pid, command line).
pub fn qemus_under(data: &Path) -> Vec<(i32, String)> {
    let data = data.display().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        // QEMU names no path of the host's (its files are descriptors): its working
        // directory, the sandbox's `chan/`, says whose it is.
        let cwd = std::fs::read_link(entry.path().join("cwd")).unwrap_or_default();
        if cmdline.contains("qemu-system") && (cmdline.contains(&data) || cwd.starts_with(&data)) {
            found.push((pid, cmdline));
        }
    }
    found
}

/// On drop, SIGKILLs (by pid) the data dir's managed vm driver and every QEMU of the data dir
/// still running: the safety net for a test that failed before deleting its sandboxes (VMs
/// are daemonized and outlive sbxd, and so does a managed driver).
pub struct QemuReaper(pub PathBuf);

/// The managed vm driver process sbxd recorded in DATA/drivers/vm.pid (`PID START_TICKS`),
/// if that very process runs.
pub fn managed_driver(data: &Path) -> Option<Identity> {
    let text = std::fs::read_to_string(data.join("drivers/vm.pid")).ok()?;
    let mut fields = text.split_whitespace();
    let process = Identity {
        pid: fields.next()?.parse().ok()?,
        start_ticks: fields.next()?.parse().ok()?,
    };
    is_alive(process).then_some(process)
}

impl Drop for QemuReaper {
    fn drop(&mut self) {
        if let Some(driver) = managed_driver(&self.0) {
            eprintln!("killing leaked managed vm driver {}", driver.pid);
            let _ = kill(Pid::from_raw(driver.pid), Signal::SIGKILL);
        }
        for (pid, cmdline) in qemus_under(&self.0) {
            eprintln!("killing leaked qemu {pid}: {cmdline}");
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

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
        .expect("get sandbox")
        .into_inner()
}

/// Waits (at most `limit`) until the sandbox is in `phase` and `also` holds; fails at once,
/// with sbxd's log, if it settles in Error.
pub async fn wait_for(
    d: &Sbxd,
    sb: &SandboxServiceClient<Channel>,
    id: &str,
    phase: Phase,
    limit: Duration,
    also: impl Fn(&Sandbox) -> bool,
) -> Sandbox {
    let deadline = Instant::now() + limit;
    loop {
        let s = get(sb, id).await;
        if s.phase() == phase && also(&s) {
            return s;
        }
        if s.phase() == Phase::Error || Instant::now() >= deadline {
            panic!(
                "sandbox {id}: wanted {phase:?}, got {s:#?} after {:?}\nsbxd log:\n{}",
                limit.saturating_sub(deadline.saturating_duration_since(Instant::now())),
                log_tail(d)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn log_tail(d: &Sbxd) -> String {
    let log = without_ansi(&d.log_text());
    let start = log.len().saturating_sub(6000);
    let start = (start..log.len())
        .find(|i| log.is_char_boundary(*i))
        .unwrap_or(0);
    log[start..].to_string()
}

/// Runs `sh -c SCRIPT` in the sandbox's guest; answers (exit code, stdout, stderr).
pub async fn sh(
    sb: &SandboxServiceClient<Channel>,
    id: &str,
    script: &str,
) -> (i32, String, String) {
    let mut stream = sb
        .clone()
        .exec(
            ExecRequest {
                sandbox: by_id(id),
                command: vec!["sh".into(), "-c".into(), script.into()],
                timeout_seconds: 60,
                ..Default::default()
            }
            .alone(),
        )
        .await
        .unwrap_or_else(|e| panic!("exec {script:?} in {id}: {e:?}"))
        .into_inner();
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(msg) = tokio::time::timeout(Duration::from_secs(90), stream.next())
        .await
        .unwrap_or_else(|_| panic!("exec {script:?} in {id} did not answer within 90 s"))
    {
        match msg.expect("exec output").chunk {
            Some(exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(exec_output::Chunk::Stderr(b)) => err.extend(b),
            Some(exec_output::Chunk::Exit(e)) => code = Some(e.code),
            None => {}
        }
    }
    (
        code.expect("the exec stream ends with an exit"),
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

/// Asserts what `/sandbox/data` and `/sandbox/boots` hold in the sandbox's guest. Ready
/// means the command was started, not that it has written yet: its line of this boot is
/// waited for (at most 10 s).
pub async fn assert_files(
    sb: &SandboxServiceClient<Channel>,
    id: &str,
    data: &str,
    boots: usize,
    when: &str,
) {
    let expected = format!("{data}\n{}", "boot\n".repeat(boots));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let (code, out, err) = loop {
        let (code, out, err) = sh(sb, id, "cat /sandbox/data /sandbox/boots").await;
        if out == expected || std::time::Instant::now() >= deadline {
            break (code, out, err);
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(
        (code, out.as_str()),
        (0, expected.as_str()),
        "{when}: /sandbox of {id} (stderr {err:?})"
    );
}

/// Starts sbxd over `data` with this vm `driver` (`vm` or `managed:vm`), the shared asset
/// cache and a generous boot timeout; waits until it serves.
pub fn start_sbxd(data: &Path, driver: &str) -> Sbxd {
    let cache = asset_cache().display().to_string();
    Sbxd::start(
        data,
        driver,
        &[
            "--vm-asset-cache",
            &cache,
            "--vm-boot-timeout",
            BOOT_TIMEOUT_SECS,
        ],
    )
}

/// Creates a sandbox running [`COMMAND`] and waits until it is Ready; answers its id and how
/// long create→Ready took.
pub async fn create_vm(
    d: &Sbxd,
    sb: &SandboxServiceClient<Channel>,
    workspace: &str,
    name: &str,
) -> (String, Duration) {
    let began = Instant::now();
    let created = sb
        .clone()
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: workspace.into(),
            name: name.into(),
            spec: Some(SandboxSpec {
                command: vec!["sh".into(), "-c".into(), COMMAND.into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .expect("create sandbox")
        .into_inner();
    assert_eq!(
        created.spec.as_ref().map(|s| s.driver.as_str()),
        Some("vm"),
        "the sandbox is the vm driver's"
    );
    wait_for(d, sb, &created.id, Phase::Ready, READY_LIMIT, |_| true).await;
    (created.id, began.elapsed())
}

/// The accelerator the driver chose, as its log says.
pub fn accel_in_log(d: &Sbxd) -> String {
    without_ansi(&d.log_text())
        .lines()
        .find(|l| l.contains("the vm driver is open"))
        .and_then(|l| l.split("accel=").nth(1))
        .map(|rest| rest.split_whitespace().next().unwrap_or("?").to_string())
        .unwrap_or_else(|| "unknown".into())
}

/// `text` without ANSI escape sequences (sbxd's pretty log colours its fields).
pub fn without_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters… final byte in @..~
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) && c != '[' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// Writes the generation marker of sandbox `id` by hand (atomically, as the driver does).
pub fn write_marker(data: &Path, id: &str, generation: u64) {
    let dir = data.join("drivers/vm/vms").join(id);
    let tmp = dir.join("generation.by-hand");
    std::fs::write(&tmp, format!("{generation}\n")).expect("write the marker");
    std::fs::rename(&tmp, dir.join("generation")).expect("replace the marker");
}
