//! QEMU: the command line of a sandbox's microVM, its launch (daemonized, so it outlives the
//! driver), its identity (pid from QEMU's pidfile + the process's start time), QMP, the
//! machine protocol on a Unix socket in the sandbox's directory, and the saving and loading of
//! a VM's state (QEMU's migration, to and from a file whose descriptor goes over QMP).

use std::io::{BufRead, BufReader, IoSlice, Read, Seek, SeekFrom, Write};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use sbx_driver_api::DriverError;
use sbx_host_kit::procfs::{self, ProcessIdentity};
use sbx_images::IdMap;

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
    /// What the guest boots from: the shared initramfs, or a boot's own in memory (a memfd);
    /// QEMU reads it through its descriptor.
    pub initramfs: BorrowedFd<'a>,
    pub disk: &'a Path,
    /// A sandbox of an image: its root disk (a qcow2, serial `sbx-root` in the guest) and the
    /// base disk under it (read only).
    pub root: Option<(&'a Path, &'a Path)>,
    /// On the gateway's network: QEMU runs in the sandbox's namespace (`nsenter`) and its NIC
    /// (this MAC) is on the namespace's tap (`sbx_network::guest`). Without: in an empty
    /// network namespace of its own.
    pub net: Option<(&'a Path, String)>,
    pub console_log: &'a Path,
    pub qmp_socket: &'a Path,
    /// QEMU's directory (its working directory), where the FIFOs of the control channel
    /// (`agent.in`/`.out`) and of the exec channels (`exec-<k>.in`/`.out`) are.
    pub chan: &'a Path,
    pub pidfile: &'a Path,
    pub memory_mib: u64,
    pub cpus: u32,
    /// The host's TSC rate: under TCG, microvm has no timer to calibrate the TSC against.
    pub tsc_khz: Option<u64>,
    /// Started to load a saved state, not to boot: stopped (`-S`), waiting for
    /// `migrate-incoming` (`-incoming defer`, see [`load_state`]).
    pub incoming: bool,
    /// The sandbox's host ids: QEMU runs as the first uid and gid, the console's logger as
    /// the second.
    pub ids: IdMap,
    /// Under KVM: the group of `/dev/kvm`, QEMU's one supplementary group.
    pub kvm_group: Option<u32>,
    /// The static `sbx-agent` on the host: the console's logger (`sbx-agent log console`).
    pub logger: &'a Path,
    /// The most the console and its previous part keep on disk together.
    pub log_max: u64,
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

/// The descriptors QEMU is started with (what its command line names): the kernel and the
/// initramfs (opened again through `/proc/self/fd`: QEMU loads them by name), the console's
/// pipe, QMP's listening socket, the disks (fd sets: the block layer takes `/dev/fdset/N`).
const FD_KERNEL: i32 = 3;
const FD_INITRD: i32 = 4;
const FD_CONSOLE: i32 = 5;
const FD_QMP: i32 = 6;
const FD_DISK: i32 = 7;
const FD_ROOT: i32 = 8;
const FD_BASE: i32 = 9;

/// QEMU's own seccomp filter: no obsolete system calls, no set*uid/gid, no fork or exec, no
/// scheduling or affinity changes.
pub const SECCOMP: &str = "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny";

/// How long a QEMU may take from its start to its first QMP greeting.
const START_TIMEOUT: Duration = Duration::from_secs(30);

impl VmLaunch<'_> {
    pub fn args(&self) -> Vec<String> {
        let append = kernel_cmdline(self.accel, self.tsc_khz);
        let (accel, cpu) = match self.accel {
            Accel::Kvm => ("kvm", "host"),
            _ => ("tcg", "max"),
        };
        let mut args: Vec<String> = [
            "-name",
            &self.name,
            "-machine",
            "microvm",
            "-accel",
            accel,
            "-cpu",
            cpu,
            "-smp",
            &self.cpus.max(1).to_string(),
            "-m",
            &format!("{}M", self.memory_mib),
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
            "-sandbox",
            SECCOMP,
            "-kernel",
            &format!("/proc/self/fd/{FD_KERNEL}"),
            "-initrd",
            &format!("/proc/self/fd/{FD_INITRD}"),
            "-append",
            &append,
            "-add-fd",
            &format!("fd={FD_CONSOLE},set={FD_CONSOLE}"),
            "-chardev",
            &format!("file,id=console,path=/dev/fdset/{FD_CONSOLE},append=on"),
            "-serial",
            "chardev:console",
            "-add-fd",
            &format!("fd={FD_DISK},set={FD_DISK}"),
            "-blockdev",
            &format!("driver=file,node-name=disk-file,filename=/dev/fdset/{FD_DISK}"),
            "-blockdev",
            "driver=raw,node-name=disk,file=disk-file",
            "-device",
            "virtio-blk-device,drive=disk",
            "-device",
            "virtio-serial-device",
            "-chardev",
            &format!("pipe,id=agent,path={}", super::record::AGENT),
            "-device",
            "virtserialport,chardev=agent,name=sbx.agent",
            "-chardev",
            &format!("socket,id=qmp,fd={FD_QMP},server=on,wait=off"),
            "-mon",
            "chardev=qmp,mode=control",
        ]
        .map(String::from)
        .into();
        if self.root.is_some() {
            args.extend(
                [
                    "-add-fd",
                    &format!("fd={FD_BASE},set={FD_BASE}"),
                    "-blockdev",
                    &format!(
                        "driver=file,node-name=base-file,filename=/dev/fdset/{FD_BASE},\
                         read-only=on"
                    ),
                    "-blockdev",
                    "driver=raw,node-name=base,file=base-file,read-only=on",
                    "-add-fd",
                    &format!("fd={FD_ROOT},set={FD_ROOT}"),
                    "-blockdev",
                    &format!(
                        "driver=file,node-name=root-file,filename=/dev/fdset/{FD_ROOT},\
                         discard=unmap"
                    ),
                    "-blockdev",
                    "driver=qcow2,node-name=root,file=root-file,backing=base,discard=unmap",
                    "-device",
                    &format!("virtio-blk-device,drive=root,serial={ROOT_SERIAL}"),
                ]
                .map(String::from),
            );
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
                format!("pipe,id=exec{k},path={}-{k}", super::record::EXEC),
                "-device".into(),
                format!("virtserialport,chardev=exec{k},name=sbx.exec.{k}"),
            ]);
        }
        args
    }

    /// The programs QEMU is started through, each becoming the next (no fork): `setsid` (a
    /// session of its own, so it outlives the driver), `nsenter` into the sandbox's network
    /// namespace or `unshare` into an empty one, `setpriv` to the VM's uid and gid with no
    /// capability left (none permitted, effective, inheritable or in the bounding set) and
    /// `no_new_privs`; then QEMU, which installs its seccomp filter ([`SECCOMP`]) before it
    /// runs the guest.
    pub fn wrapper(&self) -> Vec<String> {
        let mut argv = vec!["setsid".to_string()];
        match &self.net {
            Some((netns, _)) => {
                argv.extend(["nsenter".into(), format!("--net={}", netns.display())]);
            }
            None => argv.extend(["unshare".into(), "--net".into()]),
        }
        argv.push("--".into());
        argv.extend(unprivileged(
            self.ids.host_uid,
            self.ids.host_gid,
            self.kvm_group,
        ));
        argv
    }

    /// Starts QEMU as the VM's own unprivileged user (see [`VmLaunch::wrapper`]), with the
    /// console's logger next to it ([`start_logger`]), and returns the identity of the VM's
    /// process once QMP answers a command (QEMU has loaded the kernel and the initramfs and
    /// runs its main loop: the greeting alone comes earlier, from QMP's own thread). The identity is in the pidfile before the call waits for anything, so a
    /// driver killed meanwhile finds the VM at open. QEMU is not daemonized: its seccomp
    /// filter is installed before it would fork (`spawn=deny` forbids that), and it drops no
    /// privileges itself (`elevateprivileges=deny` forbids its `-runas`).
    pub async fn launch(&self) -> Result<ProcessIdentity, DriverError> {
        use command_fds::{CommandFdExt, FdMapping};
        let io = |what: String, e: std::io::Error| DriverError::Internal(format!("{what}: {e}"));
        let _ = std::fs::remove_file(self.pidfile);
        make_chan(self.chan, self.ids)?;
        let qmp = bind_qmp(self.qmp_socket)?;
        let open = |path: &Path, write: bool| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(write)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(path)
                .map(OwnedFd::from)
                .map_err(|e| io(format!("opening {}", path.display()), e))
        };
        let mut fds = vec![
            (open(self.kernel, false)?, FD_KERNEL),
            (
                self.initramfs
                    .try_clone_to_owned()
                    .map_err(|e| io("the initramfs's descriptor".into(), e))?,
                FD_INITRD,
            ),
            (OwnedFd::from(qmp), FD_QMP),
            (open(self.disk, true)?, FD_DISK),
        ];
        if let Some((root, base)) = self.root {
            fds.push((open(root, true)?, FD_ROOT));
            fds.push((open(base, false)?, FD_BASE));
        }
        let (console_in, console_out) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| io("a pipe for the console".into(), e.into()))?;
        let mut logger = start_logger(
            self.logger,
            console_in,
            self.console_log,
            self.log_max,
            self.ids,
        )?;
        let dup = |fd: &OwnedFd| {
            fd.try_clone()
                .map_err(|e| io("the console's descriptor".into(), e))
        };
        fds.push((dup(&console_out)?, FD_CONSOLE));
        let wrapper = self.wrapper();
        let mut command = tokio::process::Command::new(&wrapper[0]);
        command
            .args(&wrapper[1..])
            .arg(self.qemu)
            .args(self.args())
            .current_dir(self.chan)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::from(dup(&console_out)?))
            .stderr(std::process::Stdio::from(console_out));
        command
            .fd_mappings(
                fds.into_iter()
                    .map(|(parent_fd, child_fd)| FdMapping {
                        parent_fd,
                        child_fd,
                    })
                    .collect(),
            )
            .map_err(|e| DriverError::Internal(format!("handing qemu its descriptors: {e}")))?;
        let mut child = command.spawn().map_err(|e| {
            DriverError::Unavailable(format!("starting {}: {e}", self.qemu.display()))
        })?;
        // Our copies of its descriptors go: the console's pipe ends with QEMU (the logger
        // then ends too), and a QEMU that dies closes QMP's socket for good.
        drop(command);
        let identity = child
            .id()
            .and_then(|pid| procfs::read_stat(pid as i32))
            .map(|stat| stat.identity)
            .ok_or_else(|| DriverError::Internal("qemu ended as it started".to_string()))?;
        write_pidfile(self.pidfile, identity)
            .map_err(|e| io(format!("writing {}", self.pidfile.display()), e))?;
        let deadline = tokio::time::Instant::now() + START_TIMEOUT;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                // Its last words went to the console; the logger writes them out.
                let _ = tokio::time::timeout(Duration::from_secs(2), logger.wait()).await;
                return Err(DriverError::Internal(format!(
                    "qemu refused to start the vm ({status}): {}",
                    console_tail(self.console_log, 800)
                )));
            }
            let qmp = self.qmp_socket.to_path_buf();
            // The greeting comes from QMP's own thread, possibly before the machine is made
            // (and the initramfs read): a command runs in the main loop, which starts after.
            let greeted = tokio::task::spawn_blocking(move || {
                Qmp::connect(&qmp, Duration::from_millis(200))
                    .and_then(|mut qmp| qmp.execute("query-status"))
                    .is_ok()
            })
            .await
            .unwrap_or(false);
            if greeted {
                break;
            }
            if tokio::time::Instant::now() >= deadline {
                let _ = child.start_kill();
                return Err(DriverError::Unavailable(format!(
                    "qemu did not answer on QMP within {START_TIMEOUT:?}; ended"
                )));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Ok(Some(status)) = logger.try_wait() {
            let _ = child.start_kill();
            return Err(DriverError::Internal(format!(
                "the console's logger ended at once ({status}); qemu ended"
            )));
        }
        // Both run on by themselves; the runtime reaps them when they end.
        Ok(identity)
    }
}

/// `setpriv` to `uid`:`gid` with no supplementary group but `group`, no capability at all and
/// `no_new_privs`, then `--`.
fn unprivileged(uid: u32, gid: u32, group: Option<u32>) -> Vec<String> {
    vec![
        "setpriv".into(),
        format!("--reuid={uid}"),
        format!("--regid={gid}"),
        match group {
            Some(group) => format!("--groups={group}"),
            None => "--clear-groups".into(),
        },
        "--inh-caps=-all".into(),
        "--bounding-set=-all".into(),
        "--nnp".into(),
        "--".into(),
    ]
}

/// QEMU's directory: host root's, its group the VM's, 0710 (QEMU reaches the FIFOs in it by
/// name and can neither add nor remove an entry), with every FIFO made afresh, the VM's uid's,
/// 0600. The driver opens the FIFOs by name: nothing in the directory is QEMU's to replace.
fn make_chan(chan: &Path, ids: IdMap) -> Result<(), DriverError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let fail = |what: &str, path: &Path, e: std::io::Error| {
        DriverError::Internal(format!("{what} {}: {e}", path.display()))
    };
    match std::fs::symlink_metadata(chan) {
        Ok(meta) if meta.is_dir() => {}
        Ok(_) => std::fs::remove_file(chan).map_err(|e| fail("removing", chan, e))?,
        Err(_) => {}
    }
    if !chan.is_dir() {
        std::fs::DirBuilder::new()
            .mode(0o710)
            .create(chan)
            .map_err(|e| fail("making", chan, e))?;
    }
    let nofollow = nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW;
    let own = |path: &Path, uid: u32, gid: u32| {
        nix::unistd::fchownat(
            nix::fcntl::AT_FDCWD,
            path,
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
            nofollow,
        )
        .map_err(|e| fail("handing over", path, e.into()))
    };
    own(chan, 0, ids.host_gid)?;
    let meta = std::fs::symlink_metadata(chan).map_err(|e| fail("reading", chan, e))?;
    if meta.mode() & 0o7777 != 0o710 {
        std::fs::set_permissions(chan, std::os::unix::fs::PermissionsExt::from_mode(0o710))
            .map_err(|e| fail("setting the mode of", chan, e))?;
    }
    let bases = std::iter::once(chan.join(super::record::AGENT))
        .chain((0..EXEC_CHANNELS).map(|k| exec_channel(&chan.join(super::record::EXEC), k)));
    // An earlier version's FIFOs, in the sandbox's directory itself, go.
    if let Some(dir) = chan.parent() {
        let old = std::iter::once(dir.join(super::record::AGENT))
            .chain((0..EXEC_CHANNELS).map(|k| exec_channel(&dir.join(super::record::EXEC), k)));
        for end in old.flat_map(|base| [fifo(&base, "in"), fifo(&base, "out")]) {
            let _ = std::fs::remove_file(end);
        }
    }
    for end in bases.flat_map(|base| [fifo(&base, "in"), fifo(&base, "out")]) {
        let _ = std::fs::remove_file(&end);
        nix::unistd::mkfifo(&end, nix::sys::stat::Mode::from_bits_truncate(0o600))
            .map_err(|e| DriverError::Internal(format!("mkfifo {}: {e}", end.display())))?;
        own(&end, ids.host_uid, ids.host_gid)?;
    }
    Ok(())
}

/// QMP's socket, bound by the driver (host root's, 0600, in the sandbox's 0700 directory) and
/// handed to QEMU listening: QEMU needs no right to make anything in the directory.
fn bind_qmp(socket: &Path) -> Result<std::os::unix::net::UnixListener, DriverError> {
    let fail =
        |e: std::io::Error| DriverError::Internal(format!("qmp socket {}: {e}", socket.display()));
    let _ = std::fs::remove_file(socket);
    let listener = std::os::unix::net::UnixListener::bind(socket).map_err(fail)?;
    std::fs::set_permissions(socket, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .map_err(fail)?;
    Ok(listener)
}

/// The console's logger: `sbx-agent log console -` reading the pipe QEMU writes the serial
/// console (and its own stderr) to, writing `console` (opened `O_APPEND`) and rotating it into
/// its previous part within `log_max` (the agent's `log` module, as the oci and process
/// sandboxes' loggers do). It runs in a session of its own, as the second uid of the sandbox's
/// range (no capability, `no_new_privs`), from its descriptor; the log's files are the
/// driver's, handed over open. It ends when QEMU has (every writer of the pipe gone), so it
/// bounds the log while the driver is away, and the guest never waits on a pipe nobody reads.
fn start_logger(
    agent: &Path,
    input: OwnedFd,
    console: &Path,
    log_max: u64,
    ids: IdMap,
) -> Result<tokio::process::Child, DriverError> {
    use command_fds::{CommandFdExt, FdMapping};
    let fail = |what: &str, e: std::io::Error| DriverError::Internal(format!("{what}: {e}"));
    let (read, previous) = sbx_host_kit::logfile::rotation_files(console)
        .map_err(|e| fail(&format!("opening {}", console.display()), e))?;
    let output = std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(console)
        .map_err(|e| fail(&format!("opening {}", console.display()), e))?;
    let binary =
        std::fs::File::open(agent).map_err(|e| fail(&format!("opening {}", agent.display()), e))?;
    let mut argv = vec!["setsid".to_string()];
    argv.extend(unprivileged(ids.host_uid + 1, ids.host_gid + 1, None));
    argv.extend(
        [
            "/proc/self/fd/3",
            "log",
            "console",
            "-",
            "--rotate",
            &log_max.to_string(),
            "4",
            "5",
        ]
        .map(String::from),
    );
    let mut command = tokio::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .stdin(std::process::Stdio::from(input))
        .stdout(std::process::Stdio::from(output))
        .stderr(std::process::Stdio::null());
    command
        .fd_mappings(vec![
            FdMapping {
                parent_fd: binary.into(),
                child_fd: 3,
            },
            FdMapping {
                parent_fd: read,
                child_fd: 4,
            },
            FdMapping {
                parent_fd: previous,
                child_fd: 5,
            },
        ])
        .map_err(|e| DriverError::Internal(format!("handing the logger its files: {e}")))?;
    command
        .spawn()
        .map_err(|e| fail("starting the console's logger", e))
}

/// The pidfile: the VM's pid and its start time, so that a pid used again by another process
/// is never taken for the VM (QEMU's own pidfile said the pid only).
fn write_pidfile(pidfile: &Path, identity: ProcessIdentity) -> std::io::Result<()> {
    sbx_host_kit::records::write_atomically(
        pidfile,
        format!("{} {}\n", identity.pid, identity.start_ticks).as_bytes(),
    )
}

/// The end of the console log (what QEMU writes of the guest's serial console): the last `max` bytes, for error messages.
pub fn console_tail(console_log: &Path, max: u64) -> String {
    let Ok(mut file) = std::fs::File::open(console_log) else {
        return String::new();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut text = Vec::new();
    let _ = file.read_to_end(&mut text);
    String::from_utf8_lossy(&text).trim().to_string()
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

/// The process in the pidfile, if that very process (same start time) is still there. A
/// pidfile of QEMU's own (earlier versions: the pid alone) names whichever process has the pid.
pub fn read_identity(pidfile: &Path) -> Option<ProcessIdentity> {
    let text = std::fs::read_to_string(pidfile).ok()?;
    let mut words = text.split_whitespace();
    let pid: i32 = words.next()?.parse().ok()?;
    let found = procfs::read_stat(pid)?.identity;
    match words.next() {
        None => Some(found),
        Some(start) => (start.parse::<u64>().ok()? == found.start_ticks).then_some(found),
    }
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
        let initramfs = std::fs::File::open("/dev/null").unwrap();
        let mut launch = VmLaunch {
            qemu: p,
            name: "0b5e1c1e-0000-4000-8000-000000000001".into(),
            accel: Accel::Tcg,
            kernel: p,
            initramfs: std::os::fd::AsFd::as_fd(&initramfs),
            disk: Path::new("/state/disk.img"),
            root: None,
            net: None,
            console_log: p,
            qmp_socket: Path::new("/state/qmp.sock"),
            chan: Path::new("/state/chan"),
            pidfile: p,
            memory_mib: 256,
            cpus: 1,
            tsc_khz: Some(2_445_412),
            incoming: false,
            ids: IdMap {
                host_uid: 1_000_000,
                host_gid: 1_000_000,
                size: 65_536,
            },
            kvm_group: None,
            logger: p,
            log_max: 1 << 20,
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
        // Nothing by a path of the host's: descriptors, and names in QEMU's own directory.
        assert!(!args.contains("/state"), "{args}");
        assert!(args.contains(&format!("-sandbox {SECCOMP}")), "{args}");
        assert!(
            args.contains("-kernel /proc/self/fd/3 -initrd /proc/self/fd/4"),
            "{args}"
        );
        assert!(args.contains("filename=/dev/fdset/7"), "{args}");
        assert!(
            args.contains("socket,id=qmp,fd=6,server=on,wait=off"),
            "{args}"
        );
        assert!(
            args.contains(
                "-chardev pipe,id=exec3,path=exec-3 -device \
                 virtserialport,chardev=exec3,name=sbx.exec.3"
            ),
            "{args}"
        );
        assert!(
            !args.contains("-daemonize") && !args.contains("-runas"),
            "{args}"
        );
        assert!(!args.contains("-incoming"), "{args}");
        assert!(!args.contains("sbx-root"), "{args}");
        launch.root = Some((Path::new("/state/root.qcow2"), Path::new("/bases/b.ext4")));
        let args = launch.args().join(" ");
        assert!(
            args.contains("driver=qcow2,node-name=root,file=root-file,backing=base"),
            "{args}"
        );
        assert!(
            args.contains("filename=/dev/fdset/9,read-only=on"),
            "{args}"
        );
        launch.incoming = true;
        let args = launch.args().join(" ");
        assert!(args.contains(" -S -incoming defer "), "{args}");
        launch.incoming = false;
        launch.accel = Accel::Kvm;
        let args = launch.args().join(" ");
        assert!(args.contains("-accel kvm -cpu host"), "{args}");
        assert!(!args.contains("tsc_early_khz"), "{args}");
        // Started unprivileged: an empty network namespace, the VM's uid, no capability.
        assert_eq!(
            launch.wrapper().join(" "),
            "setsid unshare --net -- setpriv --reuid=1000000 --regid=1000000 --clear-groups \
             --inh-caps=-all --bounding-set=-all --nnp --"
        );
        launch.net = Some((Path::new("/run/netns/x"), "02:00:00:00:00:01".into()));
        launch.kvm_group = Some(108);
        assert!(launch.wrapper().join(" ").starts_with(
            "setsid nsenter --net=/run/netns/x -- setpriv --reuid=1000000 \
                              --regid=1000000 --groups=108 "
        ),);
    }

    #[test]
    fn a_pidfile_names_only_the_process_that_started_then() {
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("qemu.pid");
        let me = procfs::read_stat(std::process::id() as i32)
            .unwrap()
            .identity;
        write_pidfile(&pidfile, me).unwrap();
        assert_eq!(read_identity(&pidfile), Some(me));
        // The same pid, another start: another process.
        std::fs::write(&pidfile, format!("{} {}\n", me.pid, me.start_ticks + 1)).unwrap();
        assert_eq!(read_identity(&pidfile), None);
        // QEMU's own pidfile (earlier versions): the pid alone.
        std::fs::write(&pidfile, format!("{}\n", me.pid)).unwrap();
        assert_eq!(read_identity(&pidfile), Some(me));
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
