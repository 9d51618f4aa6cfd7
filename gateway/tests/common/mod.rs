//! The black-box harness: the real `sbxd` on 127.0.0.1:0 with a temp data dir, the real `sbx`
//! CLI, and tonic clients. Every process started here is killed by pid when its guard drops,
//! every wait is bounded, and workloads of the process driver left behind by a failed test are
//! killed by the data dir's guard.

#![allow(dead_code)]

pub mod ha;
pub mod metrics;
pub mod node;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_types::StatusExt;

pub const SBXD: &str = env!("CARGO_BIN_EXE_sbxd");
/// `sbx`, the CLI crate's binary. Cargo builds every binary of the workspace into one
/// directory, so it is beside sbxd: [`SBXD`]'s path without its last letter (`…/sbxd` →
/// `…/sbx`). `cargo nextest run --workspace` builds both; a run of this package alone needs
/// `cargo build -p sbx-cli` first.
pub const SBX: &str = match std::str::from_utf8(SBXD.as_bytes().split_at(SBXD.len() - 1).0) {
    Ok(path) => path,
    Err(_) => panic!("a path cut after an ASCII letter is UTF-8"),
};

/// How long sbxd may take to write its address file.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one CLI command may take.
const CLI_TIMEOUT: Duration = Duration::from_secs(90);
/// The cgroup the tests' process-driver sandboxes are made under.
pub const TEST_CGROUP_PARENT: &str = "sbx-gateway-tests";

/// A temp data dir. On drop, kills every process-driver workload still alive in it (a test
/// that passes has deleted them already; this is the safety net for one that fails).
pub struct DataDir {
    pub dir: tempfile::TempDir,
}

impl DataDir {
    pub fn new() -> DataDir {
        DataDir {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for DataDir {
    fn drop(&mut self) {
        for pid in all_workload_pids(self.path()) {
            eprintln!("killing leaked workload {pid}");
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
        // The oci driver's containers, and their root filesystems' mounts.
        let runc_root = self.path().join("drivers/oci/runc");
        if runc_root.exists() {
            for id in oci_containers(self.path()) {
                eprintln!("deleting leaked container {id}");
                let _ = Command::new("runc")
                    .arg("--root")
                    .arg(&runc_root)
                    .args(["delete", "--force", &id])
                    .status();
            }
        }
        for mount in mounts_under(self.path()) {
            let _ = nix::mount::umount2(Path::new(&mount), nix::mount::MntFlags::MNT_DETACH);
        }
    }
}

/// The oci driver's runtime containers under data dir `data` (their ids).
pub fn oci_containers(data: &Path) -> Vec<String> {
    let out = Command::new("runc")
        .arg("--root")
        .arg(data.join("drivers/oci/runc"))
        .args(["list", "-q"])
        .output();
    match out {
        Ok(out) => String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_string)
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Mount points under `dir`, from this process's mount table.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let needle = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|m| m.starts_with(&needle))
        .map(str::to_string)
        .collect()
}

/// The live init pids of the process driver's workloads of sandbox `id` (normally zero or
/// one), read from the driver's state: `sandboxes/ID/run-*/init` holds the init's
/// `/proc/self/stat` line, whose first field is its host pid and 22nd its start time.
pub fn workload_pids(data: &Path, id: &str) -> Vec<i32> {
    workload_pids_in(&data.join("drivers/process"), id)
}

/// [`workload_pids`] of a process driver whose state dir is `state` (an `sbxd node`'s
/// `--state-dir`).
pub fn workload_pids_in(state: &Path, id: &str) -> Vec<i32> {
    let dir = state.join("sandboxes").join(id);
    let mut pids = Vec::new();
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return pids;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if !name.starts_with("run-") {
            continue;
        }
        let Ok(line) = std::fs::read_to_string(entry.path().join("init")) else {
            continue;
        };
        if let Some((pid, start)) = parse_stat(&line)
            && proc_start_time(pid) == Some(start)
        {
            pids.push(pid);
        }
    }
    pids
}

/// Every live workload init pid of the process driver under `data`.
pub fn all_workload_pids(data: &Path) -> Vec<i32> {
    let Ok(entries) = std::fs::read_dir(data.join("drivers/process/sandboxes")) else {
        return Vec::new();
    };
    entries
        .flatten()
        .flat_map(|e| workload_pids(data, &e.file_name().to_string_lossy()))
        .collect()
}

/// (pid, start time) of a `/proc/PID/stat` line.
fn parse_stat(line: &str) -> Option<(i32, u64)> {
    let pid = line.split_whitespace().next()?.parse().ok()?;
    let after_comm = &line[line.rfind(')')? + 2..];
    // Fields after comm start at field 3 (state); start time is field 22.
    let start = after_comm.split_whitespace().nth(19)?.parse().ok()?;
    Some((pid, start))
}

/// The start time of a live process, or None when it does not exist.
pub fn proc_start_time(pid: i32) -> Option<u64> {
    let line = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_stat(&line).map(|(_, start)| start)
}

/// A running sbxd. Killed (SIGKILL, by pid) when dropped if it still runs.
pub struct Sbxd {
    child: Child,
    pub addr: String,
    pub data: PathBuf,
    addr_file: PathBuf,
    pub log: PathBuf,
}

impl Sbxd {
    /// Starts sbxd on 127.0.0.1:0 over `data` and waits for its address file.
    pub fn start(data: &Path, driver: &str, extra: &[&str]) -> Sbxd {
        let mut d = Sbxd::spawn(data, driver, "127.0.0.1:0", extra);
        d.wait_serving();
        d
    }

    /// Starts sbxd on `listen` over `data` without waiting for anything; an empty `listen`
    /// leaves `--listen` out: sbxd then serves on its Unix socket, DATA/sbxd.sock (the
    /// address file says `unix://PATH`, which [`Sbxd::endpoint`] does not dial).
    pub fn spawn(data: &Path, driver: &str, listen: &str, extra: &[&str]) -> Sbxd {
        Sbxd::spawn_with_env(data, driver, listen, extra, &[])
    }

    /// [`Sbxd::start`] with `env` set for sbxd (a secret that must not be on its command line).
    pub fn start_with_env(data: &Path, driver: &str, extra: &[&str], env: &[(&str, &str)]) -> Sbxd {
        let mut d = Sbxd::spawn_with_env(data, driver, "127.0.0.1:0", extra, env);
        d.wait_serving();
        d
    }

    /// [`Sbxd::spawn`] with `env` set for sbxd.
    pub fn spawn_with_env(
        data: &Path,
        driver: &str,
        listen: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Sbxd {
        let log = data.join(format!("sbxd-{}.log", unique()));
        let log_file = std::fs::File::create(&log).expect("log file");
        Sbxd::spawn_logging_to(data, driver, listen, extra, env, log_file.into(), log)
    }

    /// [`Sbxd::spawn_with_env`] with sbxd's stderr (its log) on `stderr`; `log` is the file
    /// [`Sbxd::log_text`] reads.
    pub fn spawn_logging_to(
        data: &Path,
        driver: &str,
        listen: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        stderr: Stdio,
        log: PathBuf,
    ) -> Sbxd {
        let addr_file = data.join("addr");
        let _ = std::fs::remove_file(&addr_file);
        // An empty driver leaves --driver out: sbxd's default (oci).
        let driver_flag: &[&str] = if driver.is_empty() {
            &[]
        } else {
            &["--driver", driver]
        };
        let listen_flag: &[&str] = if listen.is_empty() {
            &[]
        } else {
            &["--listen", listen]
        };
        let child = sbxd_command()
            .arg("serve")
            .args(listen_flag)
            .args(driver_flag)
            .arg("--data-dir")
            .arg(data)
            .arg("--addr-file")
            .arg(&addr_file)
            .args(["--process-cgroup-parent", TEST_CGROUP_PARENT])
            .args(if extra.contains(&"--reconcile-interval") {
                &[][..]
            } else {
                &["--reconcile-interval", "2"][..]
            })
            .args(extra)
            .env("SBX_LOG", "info")
            // Plain TCP on loopback for the tests' clients, unless the test says how to
            // authenticate (`--auth token`: gateway/tests/auth.rs).
            .env("SBX_AUTH", "none")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("spawn sbxd");
        Sbxd {
            child,
            addr: String::new(),
            data: data.to_path_buf(),
            addr_file,
            log,
        }
    }

    /// Waits for the address file (written once sbxd serves) and reads the address from it.
    pub fn wait_serving(&mut self) {
        let began = Instant::now();
        self.addr = loop {
            if let Ok(text) = std::fs::read_to_string(&self.addr_file) {
                assert!(text.ends_with('\n'), "partial address file {text:?}");
                break text.trim().to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "sbxd exited with {status} before serving:\n{}",
                    self.log_text()
                );
            }
            if began.elapsed() > START_TIMEOUT {
                panic!(
                    "sbxd did not write its address file within {START_TIMEOUT:?}:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
    }

    pub fn addr_file_exists(&self) -> bool {
        self.addr_file.exists()
    }

    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends SIGTERM and waits (at most `limit`) for the exit. Answers how long it took.
    pub fn sigterm(&mut self, limit: Duration) -> (Duration, ExitStatus) {
        let began = Instant::now();
        kill(Pid::from_raw(self.pid()), Signal::SIGTERM).expect("SIGTERM");
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return (began.elapsed(), status);
            }
            if began.elapsed() > limit {
                panic!(
                    "sbxd still running {limit:?} after SIGTERM:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// SIGKILL, and reap.
    pub fn sigkill(&mut self) {
        let _ = kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
        let _ = self.child.wait();
        // A killed sbxd leaves its address file behind; the next start must not read it.
        let _ = std::fs::remove_file(&self.addr_file);
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.endpoint())
            .expect("endpoint")
            .connect()
            .await
            .expect("connect")
    }

    pub async fn workspaces(&self) -> WorkspaceServiceClient<Channel> {
        WorkspaceServiceClient::connect(self.endpoint())
            .await
            .expect("connect")
    }

    pub async fn sandboxes(&self) -> SandboxServiceClient<Channel> {
        SandboxServiceClient::connect(self.endpoint())
            .await
            .expect("connect")
    }

    /// Asserts that the health service answers SERVING for "" and both sbx.v1 services.
    /// Every sandbox of every workspace, by id (one page of up to 1,000).
    pub async fn all_sandboxes(
        &self,
    ) -> std::collections::BTreeMap<String, sbx_proto::v1::Sandbox> {
        self.sandboxes()
            .await
            .list_sandboxes(sbx_proto::v1::ListSandboxesRequest {
                all_workspaces: true,
                page_size: 1000,
                ..Default::default()
            })
            .await
            .expect("list sandboxes")
            .into_inner()
            .sandboxes
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect()
    }

    pub async fn assert_healthy(&self) {
        let mut health = HealthClient::new(self.channel().await);
        for service in ["", "sbx.v1.WorkspaceService", "sbx.v1.SandboxService"] {
            let status = tokio::time::timeout(
                Duration::from_secs(10),
                health.check(HealthCheckRequest {
                    service: service.to_string(),
                }),
            )
            .await
            .expect("health check timed out")
            .expect("health check failed")
            .into_inner()
            .status;
            assert_eq!(
                status,
                ServingStatus::Serving as i32,
                "health of {service:?}"
            );
        }
    }
}

impl Drop for Sbxd {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = kill(Pid::from_raw(self.pid()), Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// `sbxd`, to be given its subcommand and flags, without a sandbox network unless the flags
/// ask for one (`--network-cidr`, which overrides the environment): gateways on one host share
/// a network name's bridge and table, and a second sbxd on a name another serves refuses to
/// start, so a test's gateway that needs no network has none.
pub fn sbxd_command() -> Command {
    let mut command = Command::new(SBXD);
    command.env("SBX_NETWORK_CIDR", "off");
    command
}

/// What a CLI run produced.
#[derive(Debug)]
pub struct CliRun {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl CliRun {
    /// Asserts success and parses stdout as JSON.
    pub fn json(&self) -> serde_json::Value {
        assert_eq!(self.code, 0, "{self:?}");
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    pub fn ok(&self) -> &str {
        assert_eq!(self.code, 0, "{self:?}");
        &self.stdout
    }
}

/// Runs the `sbx` CLI against `endpoint` (bounded by [`CLI_TIMEOUT`]; killed by pid after).
pub fn sbx(endpoint: &str, args: &[&str]) -> CliRun {
    run_bounded(
        Command::new(SBX).args(args).env("SBX_ENDPOINT", endpoint),
        &format!("sbx {args:?}"),
    )
}

/// Runs `command` (stdin empty, output captured) to its end, bounded by [`CLI_TIMEOUT`]
/// (killed by pid after); `what` names it in the panic.
pub fn run_bounded(command: &mut Command, what: &str) -> CliRun {
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot spawn {what}: {e}"));
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let err = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        if began.elapsed() > CLI_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {CLI_TIMEOUT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    CliRun {
        code: status.code().unwrap_or(-1),
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// `sbxd token create` over data dir `data`: a token named `name` with `role`, granted on
/// `workspace` (gateway-wide when `None`), in E2B's key form when `e2b`; answers the token.
pub fn token(data: &Path, name: &str, role: &str, workspace: Option<&str>, e2b: bool) -> String {
    let mut command = Command::new(SBXD);
    command
        .args(["token", "create", "--data-dir"])
        .arg(data)
        .args(["--name", name, "--role", role]);
    if e2b {
        command.arg("--e2b");
    }
    if let Some(w) = workspace {
        command.args(["--workspace", w]);
    }
    let made = run_bounded(&mut command, &format!("sbxd token create --name {name}"));
    assert_eq!(made.code, 0, "{made:?}");
    made.stdout.lines().last().unwrap_or_default().to_string()
}

/// sbxd on `driver` with token authentication and its E2B listener on a free loopback port
/// (`extra` adds flags); answers it and the listener's host:port.
pub fn e2b_sbxd(data: &Path, driver: &str, extra: &[&str]) -> (Sbxd, String) {
    let e2b_file = data.join("e2b-addr");
    let e2b_arg = e2b_file.display().to_string();
    let mut args = vec![
        "--auth",
        "token",
        "--e2b-listen",
        "127.0.0.1:0",
        "--e2b-addr-file",
        &e2b_arg,
    ];
    args.extend_from_slice(extra);
    let d = Sbxd::start(data, driver, &args);
    let addr = std::fs::read_to_string(&e2b_file)
        .unwrap()
        .trim()
        .to_string();
    (d, addr)
}

/// A long-running CLI command (watch, logs -f) whose stdout lines arrive on a channel.
/// Killed by pid on drop.
pub struct CliStream {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl CliStream {
    pub fn start(endpoint: &str, args: &[&str]) -> CliStream {
        let mut command = Command::new(SBX);
        command
            .args(args)
            .env("SBX_ENDPOINT", endpoint)
            .stderr(Stdio::null());
        CliStream::spawn(command)
    }

    /// Spawns `command` with stdin empty and stdout read line by line; its stderr is left as
    /// `command` says.
    pub fn spawn(mut command: Command) -> CliStream {
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn sbx");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        CliStream { child, lines }
    }

    /// Waits at most `limit` for the command to exit (killed by pid and a panic after).
    pub fn wait(&mut self, limit: Duration) -> ExitStatus {
        wait_bounded(&mut self.child, limit, "sbx")
    }

    /// The next line, waiting at most `limit`.
    pub fn next_line(&self, limit: Duration) -> Option<String> {
        self.lines.recv_timeout(limit).ok()
    }

    /// Reads lines until one satisfies `pred` (at most `limit` in all); answers it.
    pub fn wait_for(&self, limit: Duration, pred: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + limit;
        let mut seen = Vec::new();
        while let Some(left) = deadline.checked_duration_since(Instant::now()) {
            match self.lines.recv_timeout(left) {
                Ok(line) if pred(&line) => return line,
                Ok(line) => seen.push(line),
                Err(_) => break,
            }
        }
        panic!("no matching line within {limit:?}; saw {seen:#?}");
    }
}

impl Drop for CliStream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asserts that `status` has this code and `google.rpc.ErrorInfo` reason (domain sbx.dev).
pub fn assert_status(status: &tonic::Status, code: tonic::Code, reason: &str) {
    assert_eq!(status.code(), code, "{status:?}");
    let info = status
        .get_details_error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.reason, reason, "{status:?}");
    assert_eq!(info.domain, "sbx.dev");
}

/// A name nobody else uses in this process.
pub fn unique() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..8].to_string()
}

/// Polls `probe` every 20 ms until it answers Some, at most `limit`.
pub async fn eventually<T, F, Fut>(limit: Duration, what: &str, mut probe: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = probe().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits at most `limit` for `child` to exit; kills it (by pid) and panics after.
pub fn wait_bounded(child: &mut Child, limit: Duration, what: &str) -> ExitStatus {
    let began = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Asserts that the oci driver under `data` left nothing behind once its sandboxes are
/// deleted: no container, mount, cgroup under `cgroup_parent` or sandbox directory; then
/// removes the (empty) cgroup parent from every hierarchy.
pub fn assert_oci_left_nothing(data: &Path, cgroup_parent: &str) {
    let containers = oci_containers(data);
    assert!(containers.is_empty(), "containers left: {containers:?}");
    let mounts = mounts_under(data);
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
    let cgroups = sbx_drivers::oci::OciDriver::cgroup_leftovers(cgroup_parent);
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
    let left = std::fs::read_dir(data.join("drivers/oci/sandboxes"))
        .map(|d| d.count())
        .unwrap_or(0);
    assert_eq!(left, 0, "sandbox directories left");
    remove_cgroup_parent(cgroup_parent);
}

/// Removes a test's (empty) cgroup parent from every hierarchy.
pub fn remove_cgroup_parent(cgroup_parent: &str) {
    for entry in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::remove_dir(entry.path().join(cgroup_parent));
    }
}

/// A cgroup parent a test gave sbxd's oci driver, removed from every hierarchy when dropped.
/// Declare it after the `Sbxd` and the `DataDir`: it is emptied once their containers are
/// gone.
#[allow(dead_code)]
pub struct CgroupParent(pub String);

impl Drop for CgroupParent {
    fn drop(&mut self) {
        remove_cgroup_parent(&self.0);
    }
}

/// A python3 that has grpcio: the first of `python3` on PATH and Debian's `/usr/bin/python3`
/// (where .ci/run's python3-grpcio goes, whatever python3 comes first on PATH). `None`
/// (the test is skipped, saying so) outside CI; under CI (`CI` set) its absence fails.
#[allow(dead_code)]
pub fn python_with_grpcio() -> Option<&'static str> {
    for python in ["python3", "/usr/bin/python3"] {
        let probe = Command::new(python).args(["-c", "import grpc"]).output();
        if matches!(&probe, Ok(out) if out.status.success()) {
            return Some(python);
        }
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "python3 with grpcio is missing under CI (.ci/run installs python3-grpcio)"
    );
    eprintln!("skipped: python3 with grpcio is not installed (apt-get install python3-grpcio)");
    None
}

/// What a restart (or a restore, or a copy to another store) must keep of a sandbox: all of
/// it when it was stopped; its identity, spec and creation time when it ran (the sim driver's
/// workloads do not outlive sbxd, so a restart moves a running sandbox on).
pub fn kept_across_restart(s: &sbx_proto::v1::Sandbox) -> sbx_proto::v1::Sandbox {
    if s.phase == sbx_proto::v1::Phase::Stopped as i32 {
        return s.clone();
    }
    sbx_proto::v1::Sandbox {
        id: s.id.clone(),
        workspace: s.workspace.clone(),
        workspace_id: s.workspace_id.clone(),
        name: s.name.clone(),
        spec: s.spec.clone(),
        created_at: s.created_at,
        ..Default::default()
    }
}

/// The repository's README.md.
pub fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md");
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The body of the first ```sh block after `heading` in `text`.
pub fn sh_block_after(text: &str, heading: &str) -> String {
    let at = text
        .find(heading)
        .unwrap_or_else(|| panic!("README.md has no {heading:?} heading"));
    let rest = &text[at..];
    let open = rest
        .find("```sh\n")
        .unwrap_or_else(|| panic!("no ```sh block after {heading:?}"));
    let body = &rest[open + "```sh\n".len()..];
    let close = body
        .find("\n```")
        .unwrap_or_else(|| panic!("the ```sh block after {heading:?} is not closed"));
    body[..=close].to_string()
}

/// What a script run by [`run_script`] did.
pub struct ScriptRun {
    /// `None`: it ran over its limit (and was killed).
    pub status: Option<ExitStatus>,
    pub out: String,
    pub err: String,
    pub took: Duration,
}

/// Runs `script` with `bash -euo pipefail` in `dir` (its own process group, killed whole
/// however it ends: nothing it started outlives it), with `env`, at most `limit`.
pub fn run_script(script: &Path, dir: &Path, env: &[(&str, &str)], limit: Duration) -> ScriptRun {
    use std::os::unix::process::CommandExt;
    let out_path = dir.join("script.out");
    let err_path = dir.join("script.err");
    let mut child = Command::new("bash")
        .args(["-euo", "pipefail"])
        .arg(script)
        .current_dir(dir)
        .env_remove("SBX_ENDPOINT")
        .env("SBX_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path).unwrap())
        .stderr(std::fs::File::create(&err_path).unwrap())
        .process_group(0)
        .spawn()
        .expect("spawn bash");
    let group = Pid::from_raw(child.id() as i32);
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if began.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = began.elapsed();
    // Whatever is left of the script's process group (an sbxd, a node, a watch) goes with it.
    let _ = nix::sys::signal::killpg(group, Signal::SIGKILL);
    let _ = child.wait();
    ScriptRun {
        status,
        out: std::fs::read_to_string(&out_path).unwrap_or_default(),
        err: std::fs::read_to_string(&err_path).unwrap_or_default(),
        took,
    }
}

/// A process's resident memory, in KiB (VmRSS of /proc/PID/status).
pub fn rss_kib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_else(|e| panic!("cannot read /proc/{pid}/status: {e}"));
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// One sbxd on `oci` (the default driver, under a cgroup parent of the test's own) or another
/// driver, for tests that drive it through `sbx`; [`DriverWorld::finish`] deletes every
/// sandbox, stops sbxd and, on oci, checks that nothing is left.
#[allow(dead_code)]
pub struct DriverWorld {
    pub sbxd: Sbxd,
    pub data: DataDir,
    /// The oci driver's cgroup parent (None: another driver).
    pub cgroup_parent: Option<String>,
}

#[allow(dead_code)]
impl DriverWorld {
    /// `tag` names the cgroup parent (`sbx-gateway-tests-TAG-…`).
    pub fn new(driver: &str, tag: &str) -> DriverWorld {
        DriverWorld::with_flags(driver, tag, &[])
    }

    /// [`DriverWorld::new`], sbxd given `flags` too.
    pub fn with_flags(driver: &str, tag: &str, flags: &[&str]) -> DriverWorld {
        let data = DataDir::new();
        let (sbxd, cgroup_parent) = if driver == "oci" {
            let parent = format!("sbx-gateway-tests-{tag}-{}", unique());
            let mut all = vec!["--oci-cgroup-parent", parent.as_str()];
            all.extend_from_slice(flags);
            let sbxd = Sbxd::start(data.path(), "", &all);
            (sbxd, Some(parent))
        } else {
            (Sbxd::start(data.path(), driver, flags), None)
        };
        DriverWorld {
            sbxd,
            data,
            cgroup_parent,
        }
    }

    pub fn sbx(&self, args: &[&str]) -> CliRun {
        sbx(&self.sbxd.endpoint(), args)
    }

    pub fn finish(self) {
        self.finish_with(&[]);
    }

    /// [`DriverWorld::finish`] for a gateway that wants a credential: `token`'s.
    pub fn finish_as(self, token: &str) {
        self.finish_with(&["--token", token]);
    }

    fn finish_with(mut self, auth: &[&str]) {
        fn with<'a>(auth: &[&'a str], args: &[&'a str]) -> Vec<&'a str> {
            let mut all = auth.to_vec();
            all.extend_from_slice(args);
            all
        }
        let left = self
            .sbx(&with(auth, &["sandbox", "list", "-o", "json"]))
            .json();
        for sb in left.as_array().into_iter().flatten() {
            if let Some(name) = sb["name"].as_str() {
                self.sbx(&with(auth, &["sandbox", "delete", name])).ok();
            }
        }
        self.sbxd.sigterm(Duration::from_secs(30));
        if let Some(parent) = &self.cgroup_parent {
            assert_oci_left_nothing(self.data.path(), parent);
        }
    }
}

impl Drop for DriverWorld {
    /// The oci driver's cgroup parent, empty once its sandboxes are gone, goes too (however
    /// the test ended; a parent still holding a cgroup stays, for the leak check to name).
    fn drop(&mut self) {
        if let Some(parent) = &self.cgroup_parent {
            for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
                .into_iter()
                .flatten()
                .flatten()
            {
                let _ = std::fs::remove_dir(hierarchy.path().join(parent));
            }
        }
    }
}

/// A TCP proxy on 127.0.0.1 to `upstream` (`HOST:PORT`) that passes what the upstream answers
/// at most `bytes_per_second` per connection (what the client sends goes at once): a slow
/// registry made of a real one. Serves at most 64 connections, each in threads of its own,
/// until the test ends.
pub fn throttled_proxy(upstream: &str, bytes_per_second: u64) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
    let addr = listener
        .local_addr()
        .expect("the proxy's address")
        .to_string();
    let upstream = upstream.to_string();
    std::thread::spawn(move || {
        for client in listener.incoming().take(64) {
            let Ok(client) = client else { return };
            let Ok(server) = std::net::TcpStream::connect(&upstream) else {
                continue;
            };
            let (mut c_read, mut s_write) = (
                client.try_clone().expect("clone a socket"),
                server.try_clone().expect("clone a socket"),
            );
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_read, &mut s_write);
                let _ = s_write.shutdown(std::net::Shutdown::Write);
            });
            let (mut s_read, mut c_write) = (server, client);
            std::thread::spawn(move || {
                // 20 slices a second, each its share of the rate.
                let mut buf = vec![0u8; (bytes_per_second / 20).max(1) as usize];
                loop {
                    let n = match s_read.read(&mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    if c_write.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
                let _ = c_write.shutdown(std::net::Shutdown::Both);
            });
        }
    });
    addr
}

/// A tmpfs of `size` (`256m`) mounted on `at` (an empty directory), unmounted (lazily) when
/// dropped, however the test ends.
pub struct Tmpfs {
    pub path: PathBuf,
}

impl Tmpfs {
    pub fn mount(at: &Path, size: &str) -> Tmpfs {
        std::fs::create_dir_all(at).expect("the tmpfs's mount point");
        nix::mount::mount(
            Some("tmpfs"),
            at,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size={size},mode=0700").as_str()),
        )
        .expect("mount a tmpfs");
        Tmpfs {
            path: at.to_path_buf(),
        }
    }

    /// Bytes free on it now.
    pub fn free(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.path).expect("statvfs");
        st.blocks_available() * st.fragment_size()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
    }
}
