//! QEMU: the command line of a sandbox's microVM, its launch (daemonized, so it outlives the
//! driver), its identity (pid from QEMU's pidfile + the process's start time), QMP, the
//! machine protocol on a Unix socket in the sandbox's directory, and the saving and loading of
//! a VM's state (QEMU's migration, to and from a file whose descriptor goes over QMP).

use std::io::{BufRead, BufReader, IoSlice, Write};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use sbx_driver_api::DriverError;
use sbx_host_kit::procfs::{self, ProcessIdentity};

/// How QEMU runs guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accel {
    /// KVM when a probe boot under KVM works, TCG otherwise.
    #[default]
    Auto,
    Kvm,
    Tcg,
}

/// The name `--vm-accel` takes ("kvm"), for logs and messages.
impl std::fmt::Display for Accel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Accel::Auto => "auto",
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        })
    }
}

impl std::str::FromStr for Accel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Accel::Auto),
            "kvm" => Ok(Accel::Kvm),
            "tcg" => Ok(Accel::Tcg),
            other => Err(format!("unknown accelerator {other:?} (auto, kvm or tcg)")),
        }
    }
}

/// Everything one boot of a sandbox's VM needs.
#[derive(Debug, Clone)]
pub struct VmLaunch<'a> {
    pub qemu: &'a Path,
    /// The sandbox id: QEMU's `-name`, checked through QMP when the VM is found again.
    pub name: String,
    pub accel: Accel,
    pub kernel: &'a Path,
    pub initramfs: &'a Path,
    pub disk: &'a Path,
    /// A sandbox of an image: its root disk (a qcow2 over the image's base), serial
    /// `sbx-root` in the guest.
    pub root: Option<&'a Path>,
    /// On the gateway's network: QEMU runs in the sandbox's namespace (`nsenter`) and its NIC
    /// (this MAC) is on the namespace's tap (`sbx_network::guest`).
    pub net: Option<(&'a Path, String)>,
    pub console_log: &'a Path,
    pub qmp_socket: &'a Path,
    /// The control channel's base path (ping, stop): FIFOs `<agent>.in` and `<agent>.out`.
    pub agent: &'a Path,
    /// The exec channels' base path (the guest's `sbx-agent`s): channel `k` is the port
    /// `sbx.exec.<k>` on `<exec>-<k>.in` and `<exec>-<k>.out` ([`exec_channel`]).
    pub exec: &'a Path,
    pub pidfile: &'a Path,
    pub memory_mib: u64,
    pub cpus: u32,
    /// The host's TSC rate: under TCG, microvm has no timer to calibrate the TSC against.
    pub tsc_khz: Option<u64>,
    /// Started to load a saved state, not to boot: stopped (`-S`), waiting for
    /// `migrate-incoming` (`-incoming defer`, see [`load_state`]).
    pub incoming: bool,
}

/// The guest kernel's command line.
pub fn kernel_cmdline(accel: Accel, tsc_khz: Option<u64>) -> String {
    let mut append = "console=ttyS0 reboot=t panic=-1 pci=off quiet".to_string();
    if let (Accel::Tcg, Some(khz)) = (accel, tsc_khz) {
        // Without a TSC rate the guest finds no timer to calibrate against and hangs;
        // trusting the TSC (no clocksource watchdog) lets an idle guest sleep instead of
        // ticking (measured: 1% of a core idle, against 7% without).
        append.push_str(&format!(" tsc_early_khz={khz} tsc=reliable nowatchdog"));
    }
    append
}

impl VmLaunch<'_> {
    pub fn args(&self) -> Vec<String> {
        let append = kernel_cmdline(self.accel, self.tsc_khz);
        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("kvm", "host"),
            _ => ("tcg", "max"),
        };
        let p = |p: &Path| p.display().to_string();
        let mut args = vec![
            "-name".to_string(),
            self.name.clone(),
            "-machine".into(),
            "microvm".into(),
            "-accel".into(),
            accel.into(),
            "-cpu".into(),
            cpu.into(),
            "-smp".into(),
            self.cpus.max(1).to_string(),
            "-m".into(),
            format!("{}M", self.memory_mib),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-kernel".into(),
            p(self.kernel),
            "-initrd".into(),
            p(self.initramfs),
            "-append".into(),
            append,
            "-chardev".into(),
            format!("file,id=console,path={},append=on", p(self.console_log)),
            "-serial".into(),
            "chardev:console".into(),
            "-drive".into(),
            format!(
                "id=disk,file={},format=raw,if=none,cache=writeback",
                p(self.disk)
            ),
            "-device".into(),
            "virtio-blk-device,drive=disk".into(),
            "-device".into(),
            "virtio-serial-device".into(),
            "-chardev".into(),
            format!("pipe,id=agent,path={}", p(self.agent)),
            "-device".into(),
            "virtserialport,chardev=agent,name=sbx.agent".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", p(self.qmp_socket)),
            "-pidfile".into(),
            p(self.pidfile),
        ];
        if let Some(root) = self.root {
            args.extend([
                "-drive".into(),
                format!(
                    "id=root,file={},format=qcow2,if=none,cache=writeback,discard=unmap",
                    p(root)
                ),
                "-device".into(),
                format!("virtio-blk-device,drive=root,serial={ROOT_SERIAL}"),
            ]);
        }
        if let Some((_, mac)) = &self.net {
            args.extend([
                "-netdev".into(),
                format!(
                    "tap,id=net0,ifname={},script=no,downscript=no",
                    sbx_network::guest::TAP
                ),
                "-device".into(),
                format!("virtio-net-device,netdev=net0,mac={mac}"),
            ]);
        }
        if self.incoming {
            args.extend(["-S".into(), "-incoming".into(), "defer".into()]);
        }
        for k in 0..EXEC_CHANNELS {
            args.extend([
                "-chardev".into(),
                format!("pipe,id=exec{k},path={}", p(&exec_channel(self.exec, k))),
                "-device".into(),
                format!("virtserialport,chardev=exec{k},name=sbx.exec.{k}"),
            ]);
        }
        args.push("-daemonize".into());
        args
    }

    /// Starts QEMU daemonized (in its own session, stdio on /dev/null) and returns the
    /// identity of the VM's process once QEMU has written its pidfile.
    pub async fn launch(&self) -> Result<ProcessIdentity, DriverError> {
        let _ = std::fs::remove_file(self.pidfile);
        let _ = std::fs::remove_file(self.qmp_socket);
        let bases = std::iter::once(self.agent.to_path_buf())
            .chain((0..EXEC_CHANNELS).map(|k| exec_channel(self.exec, k)));
        for end in bases.flat_map(|base| [fifo(&base, "in"), fifo(&base, "out")]) {
            let _ = std::fs::remove_file(&end);
            nix::unistd::mkfifo(&end, nix::sys::stat::Mode::from_bits_truncate(0o600))
                .map_err(|e| DriverError::Internal(format!("mkfifo {}: {e}", end.display())))?;
        }
        // In the sandbox's network namespace, when it has one: nsenter enters it and becomes
        // QEMU (no fork), so the pidfile's process is QEMU's either way.
        let mut command = match &self.net {
            Some((netns, _)) => {
                let mut c = tokio::process::Command::new("nsenter");
                c.arg(format!("--net={}", netns.display()))
                    .arg("--")
                    .arg(self.qemu);
                c
            }
            None => tokio::process::Command::new(self.qemu),
        };
        let output = command
            .args(self.args())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .output()
            .await
            .map_err(|e| {
                DriverError::Unavailable(format!("starting {}: {e}", self.qemu.display()))
            })?;
        if !output.status.success() {
            return Err(DriverError::Internal(format!(
                "qemu refused to start the vm ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            )));
        }
        read_identity(self.pidfile).ok_or_else(|| {
            DriverError::Internal(format!(
                "qemu started but left no live process in its pidfile {}",
                self.pidfile.display()
            ))
        })
    }
}

/// The serial of a sandbox's root disk, by which the guest's init finds it.
pub const ROOT_SERIAL: &str = "sbx-root";

/// How many execs a VM runs at once: each has a virtio port of its own (`sbx.exec.<k>`), served
/// by its own `sbx-agent` in the guest; more wait for one to be free. A forwarded connection
/// holds one for its life, so there are as many as a virtio-serial device takes: 31 ports,
/// port 0 reserved for a console, one `sbx.agent`. Measured under TCG: a boot 3.1 s with 4,
/// 3.8–4.6 s with 29.
pub const EXEC_CHANNELS: usize = 29;

/// The base path of exec channel `k`: `<exec>-<k>`.
pub fn exec_channel(exec: &Path, k: usize) -> PathBuf {
    let mut path = exec.as_os_str().to_owned();
    path.push(format!("-{k}"));
    PathBuf::from(path)
}

/// One end of a channel: `<base>.in` (to the guest) or `<base>.out` (from it).
pub fn fifo(base: &Path, end: &str) -> PathBuf {
    let mut path = base.as_os_str().to_owned();
    path.push(".");
    path.push(end);
    PathBuf::from(path)
}

/// The process in QEMU's pidfile, with its start time (QEMU removes the file when it exits).
pub fn read_identity(pidfile: &Path) -> Option<ProcessIdentity> {
    let text = std::fs::read_to_string(pidfile).ok()?;
    let pid: i32 = text.trim().parse().ok()?;
    procfs::read_stat(pid).map(|stat| stat.identity)
}

/// A QMP session: blocking, every read and write bounded by `timeout`.
pub struct Qmp {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Qmp {
    pub fn connect(socket: &Path, timeout: Duration) -> Result<Qmp, String> {
        let stream = UnixStream::connect(socket).map_err(|e| format!("connect: {e}"))?;
        stream
            .set_read_timeout(Some(timeout))
            .and_then(|()| stream.set_write_timeout(Some(timeout)))
            .map_err(|e| e.to_string())?;
        let writer = stream.try_clone().map_err(|e| e.to_string())?;
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
            writer,
        };
        let greeting = qmp.read_message()?;
        if greeting.get("QMP").is_none() {
            return Err(format!("not a QMP greeting: {greeting}"));
        }
        qmp.execute("qmp_capabilities")?;
        Ok(qmp)
    }

    /// Runs `command` and returns its `return` value (events in between are skipped).
    pub fn execute(&mut self, command: &str) -> Result<Value, String> {
        self.call(command, None, None)
    }

    /// Runs `command` with `arguments`, and `fd` passed along (SCM_RIGHTS, for `getfd`).
    pub fn call(
        &mut self,
        command: &str,
        arguments: Option<Value>,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Value, String> {
        let mut message = json!({ "execute": command });
        if let Some(arguments) = arguments {
            message["arguments"] = arguments;
        }
        let line = format!("{message}\n");
        let mut sent = 0;
        if let Some(fd) = fd {
            use nix::sys::socket::{ControlMessage, MsgFlags, UnixAddr, sendmsg};
            sent = sendmsg::<UnixAddr>(
                self.writer.as_raw_fd(),
                &[IoSlice::new(line.as_bytes())],
                &[ControlMessage::ScmRights(&[fd.as_raw_fd()])],
                MsgFlags::empty(),
                None,
            )
            .map_err(|e| format!("{command}: sending the file descriptor: {e}"))?;
        }
        self.writer
            .write_all(&line.as_bytes()[sent..])
            .map_err(|e| format!("{command}: {e}"))?;
        loop {
            let message = self.read_message()?;
            if let Some(ret) = message.get("return") {
                return Ok(ret.clone());
            }
            if let Some(err) = message.get("error") {
                return Err(format!("{command}: {err}"));
            }
        }
    }

    fn read_message(&mut self) -> Result<Value, String> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => Err("qmp closed the connection".to_string()),
            Ok(_) => serde_json::from_str(&line).map_err(|e| format!("bad qmp message: {e}")),
            Err(e) => Err(format!("reading qmp: {e}")),
        }
    }
}

/// What QMP says of a VM: its name (`query-name`) and run status (`query-status`).
pub fn query(socket: &Path) -> Result<(String, String), String> {
    let mut qmp = Qmp::connect(socket, Duration::from_secs(3))?;
    let name = qmp.execute("query-name")?;
    let status = qmp.execute("query-status")?;
    Ok((
        name.get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        status
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
    ))
}

/// Sends one QMP command (`system_powerdown`, `quit`), bounded to 3 s.
pub fn command(socket: &Path, command: &str) -> Result<(), String> {
    Qmp::connect(socket, Duration::from_secs(3))?
        .execute(command)
        .map(|_| ())
}

/// The name a saved state's file descriptor goes by in QEMU (`getfd`, then `fd:<name>`).
const STATE_FD: &str = "sbx-state";

/// The migration's bandwidth cap, bytes per second: none to speak of (QEMU's default, 32 MiB/s
/// for live migration over a network, would make a 1 GiB save take half a minute).
const UNCAPPED: u64 = 1 << 40;

/// How long a VM's state may take to save or load: a minute, plus a minute per GiB of memory.
pub fn state_transfer_limit(memory_mib: u64) -> Duration {
    Duration::from_secs(60 + 60 * memory_mib.div_ceil(1024))
}

/// What a finished migration reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Migrated {
    /// Bytes of the stream QEMU wrote (or read).
    pub transferred: u64,
    /// RAM pages sent whole, and pages found to hold only zeros (sent as a flag).
    pub normal_pages: u64,
    pub zero_pages: u64,
}

/// Saves a running VM's state to `file`: QMP `stop`, then `migrate` to the file's descriptor,
/// polled until `completed` (QEMU's error on `failed`), within `limit`. On success the VM is
/// left stopped (`postmigrate`), its disk flushed, for the caller to make the file durable and
/// end it; on failure it is cancelled and running again ([`resume_after_failed_save`]), and
/// the error says what QEMU said.
/// Hands QEMU `file` (QMP `getfd`) and starts `command` (`migrate` or `migrate-incoming`)
/// through it.
fn migrate_through(
    qmp: &mut Qmp,
    command: &str,
    file: std::os::fd::BorrowedFd<'_>,
) -> Result<(), String> {
    qmp.call("getfd", Some(json!({ "fdname": STATE_FD })), Some(file))?;
    qmp.call(
        command,
        Some(json!({ "uri": format!("fd:{STATE_FD}") })),
        None,
    )?;
    Ok(())
}

pub fn save_state(
    socket: &Path,
    file: &std::fs::File,
    limit: Duration,
) -> Result<Migrated, String> {
    use std::os::fd::AsFd;
    let deadline = Instant::now() + limit;
    let mut qmp = Qmp::connect(socket, Duration::from_secs(10))?;
    qmp.call(
        "migrate-set-parameters",
        Some(json!({ "max-bandwidth": UNCAPPED })),
        None,
    )?;
    qmp.execute("stop")?;
    let saved = (|| {
        migrate_through(&mut qmp, "migrate", file.as_fd())?;
        wait_migrated(&mut qmp, deadline, limit)
    })();
    match saved {
        Ok(migrated) => Ok(migrated),
        Err(e) => {
            drop(qmp);
            match resume_after_failed_save(socket) {
                Ok(()) => Err(e),
                Err(again) => Err(format!("{e}; and the vm could not be resumed: {again}")),
            }
        }
    }
}

/// Runs a VM whose save failed (or whose saved state could not be kept) again: the migration
/// cancelled if it still runs, the descriptor let go, `cont`.
pub fn resume_after_failed_save(socket: &Path) -> Result<(), String> {
    let mut qmp = Qmp::connect(socket, Duration::from_secs(10))?;
    let _ = qmp.execute("migrate_cancel");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let status = qmp.execute("query-migrate")?;
        let status = status.get("status").and_then(Value::as_str).unwrap_or("");
        if !matches!(
            status,
            "setup" | "active" | "cancelling" | "device" | "pre-switchover"
        ) {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the migration is still {status} 10 s after its cancel"
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // Taken by a migrate that started; left over by one that did not.
    let _ = qmp.call("closefd", Some(json!({ "fdname": STATE_FD })), None);
    qmp.execute("cont").map(|_| ())
}

/// Loads a saved state from `file` into a VM launched `incoming` (stopped, `-incoming defer`):
/// `migrate-incoming` from the file's descriptor, polled until `completed`, within `limit`.
/// The VM is left stopped, for the caller to `cont`. A load that fails ends QEMU (it exits on a
/// failed incoming migration); the error says so.
pub fn load_state(
    socket: &Path,
    file: &std::fs::File,
    limit: Duration,
) -> Result<Migrated, String> {
    use std::os::fd::AsFd;
    let deadline = Instant::now() + limit;
    let mut qmp = Qmp::connect(socket, Duration::from_secs(10))?;
    let loaded = (|| {
        migrate_through(&mut qmp, "migrate-incoming", file.as_fd())?;
        let migrated = wait_migrated(&mut qmp, deadline, limit)?;
        // Completed, the VM leaves `inmigrate` for `paused` (it was started with -S).
        loop {
            let status = qmp.execute("query-status")?;
            if status.get("status").and_then(Value::as_str) != Some("inmigrate") {
                return Ok(migrated);
            }
            if Instant::now() >= deadline {
                return Err(format!("the vm still loads its state after {limit:?}"));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    })();
    loaded.map_err(|e| {
        if e.contains("closed the connection") || e.contains("reading qmp") {
            format!(
                "qemu ended while loading the saved state (the file does not match this vm, or \
                 is damaged): {e}"
            )
        } else {
            e
        }
    })
}

/// Polls `query-migrate` until the migration completed, failed or ran past `deadline`.
fn wait_migrated(qmp: &mut Qmp, deadline: Instant, limit: Duration) -> Result<Migrated, String> {
    loop {
        let info = qmp.execute("query-migrate")?;
        match info.get("status").and_then(Value::as_str) {
            Some("completed") => {
                let ram = info.get("ram");
                let field = |name: &str| {
                    ram.and_then(|r| r.get(name))
                        .and_then(Value::as_u64)
                        .unwrap_or(0)
                };
                return Ok(Migrated {
                    transferred: field("transferred"),
                    normal_pages: field("normal"),
                    zero_pages: field("duplicate"),
                });
            }
            Some(status @ ("failed" | "cancelled")) => {
                let why = info
                    .get("error-desc")
                    .and_then(Value::as_str)
                    .unwrap_or("qemu gave no reason");
                return Err(format!("the migration {status}: {why}"));
            }
            _ => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("the migration did not complete within {limit:?}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The host's TSC rate in kHz, from `/proc/cpuinfo` (the first CPU's "cpu MHz").
pub fn host_tsc_khz() -> Option<u64> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = cpuinfo
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    (mhz > 0.0).then_some((mhz * 1000.0) as u64)
}

/// Finds `qemu-system-x86_64` on PATH.
pub fn find_qemu(explicit: Option<&Path>) -> Result<PathBuf, DriverError> {
    if let Some(path) = explicit {
        return path
            .is_file()
            .then(|| path.to_path_buf())
            .ok_or_else(|| DriverError::Unavailable(format!("no qemu at {}", path.display())));
    }
    find_program("qemu-system-x86_64").ok_or_else(|| {
        DriverError::Unavailable(
            "the vm driver needs qemu-system-x86_64 on PATH; install qemu-system-x86".to_string(),
        )
    })
}

pub fn find_program(program: &str) -> Option<PathBuf> {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|dir| Path::new(dir).join(program))
        .find(|candidate| candidate.is_file())
}

/// Whether KVM can boot this kernel: a throwaway VM under KVM must get as far as running the
/// initramfs's first program (it then panics and resets, and QEMU exits) within `limit`. On
/// machines where `/dev/kvm` exists but cannot run a stock kernel, QEMU fails at once.
pub async fn kvm_boots(qemu: &Path, kernel: &Path, initramfs: &Path, scratch: &Path) -> bool {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return false;
    }
    let log = scratch.join("kvm-probe.log");
    let _ = std::fs::remove_file(&log);
    let child = tokio::process::Command::new(qemu)
        .args([
            "-machine", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128M",
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initramfs)
        .args([
            "-append",
            "console=ttyS0 panic=-1 reboot=t rdinit=/bin/busybox",
        ])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .status();
    let started = Instant::now();
    let booted = matches!(
        tokio::time::timeout(Duration::from_secs(20), child).await,
        Ok(Ok(status)) if status.success()
    ) && std::fs::read_to_string(&log).is_ok_and(|l| l.contains("Run /bin/busybox"));
    tracing::info!(booted, elapsed = ?started.elapsed(), "kvm probe");
    booted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcg_gets_the_tsc_rate_and_kvm_does_not() {
        let p = Path::new("/x");
        let mut launch = VmLaunch {
            qemu: p,
            name: "0b5e1c1e-0000-4000-8000-000000000001".into(),
            accel: Accel::Tcg,
            kernel: p,
            initramfs: p,
            disk: Path::new("/state/disk.img"),
            root: None,
            net: None,
            console_log: p,
            qmp_socket: Path::new("/state/qmp.sock"),
            agent: p,
            exec: Path::new("/state/exec"),
            pidfile: p,
            memory_mib: 256,
            cpus: 1,
            tsc_khz: Some(2_445_412),
            incoming: false,
        };
        let args = launch.args().join(" ");
        assert!(
            args.contains("-machine microvm -accel tcg -cpu max"),
            "{args}"
        );
        assert!(args.contains("tsc_early_khz=2445412"), "{args}");
        assert!(
            args.contains("-name 0b5e1c1e-0000-4000-8000-000000000001"),
            "{args}"
        );
        assert!(args.contains("file=/state/disk.img,format=raw"), "{args}");
        assert!(
            args.contains("unix:/state/qmp.sock,server=on,wait=off"),
            "{args}"
        );
        assert!(
            args.contains(
                "-chardev pipe,id=exec3,path=/state/exec-3 -device \
                 virtserialport,chardev=exec3,name=sbx.exec.3"
            ),
            "{args}"
        );
        assert!(args.ends_with("-daemonize"), "{args}");
        assert!(!args.contains("-incoming"), "{args}");
        launch.incoming = true;
        let args = launch.args().join(" ");
        assert!(args.contains(" -S -incoming defer "), "{args}");
        assert!(args.ends_with("-daemonize"), "{args}");
        launch.incoming = false;
        launch.accel = Accel::Kvm;
        let args = launch.args().join(" ");
        assert!(args.contains("-accel kvm -cpu host"), "{args}");
        assert!(!args.contains("tsc_early_khz"), "{args}");
    }

    #[test]
    fn accelerators_parse() {
        assert_eq!("tcg".parse::<Accel>(), Ok(Accel::Tcg));
        assert_eq!("auto".parse::<Accel>(), Ok(Accel::Auto));
        assert!("xen".parse::<Accel>().unwrap_err().contains("xen"));
    }

    #[test]
    fn the_cpu_rate_is_read() {
        // Every x86 Linux host names its CPU rate.
        assert!(host_tsc_khz().is_some_and(|khz| khz > 100_000));
    }
}
