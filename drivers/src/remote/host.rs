//! The driver host: opens one in-tree driver and serves it on a Unix socket until a
//! termination signal. `sbx-driver-host` is a thin `main` around [`run_driver_host`]; the
//! gateway's `sbxd driver` subcommand flattens [`DriverHostArgs`] and calls the same function.
//! `sbxd node` flattens [`BackendArgs`] (the same flags but `--socket`) and serves the driver
//! over TCP instead ([`super::serve_node`]).
//! [`VmArgs`] (the vm driver's settings) is flattened into `sbxd serve` too, so that the same
//! flags and `SBX_VM_*` variables set up an in-process, a managed and a hosted vm driver.

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::image::ImageStore;
use crate::oci::OciDriverOptions;
use crate::registry::{self, DriverFactory, DriverSettings, OpenContext};
use crate::sim::SimFaults;
use crate::vm::{Accel, AssetPaths, VmDriverOptions};
use crate::{ComputeDriver, DriverError};

/// The command line of a driver host: the driver and its settings ([`BackendArgs`]), and the
/// Unix socket it is served on. It derefs to its [`BackendArgs`], so `args.backend` and the
/// other settings read as fields of it.
#[derive(Debug, Clone, clap::Args)]
#[command(mut_arg("image_store", |a| a.required_if_eq_any(registry::needing_images("backend"))))]
pub struct DriverHostArgs {
    /// The Unix socket to serve on (made with mode 0600). A stale socket file is replaced;
    /// a socket on which another host answers is refused.
    #[arg(long)]
    pub socket: PathBuf,
    #[command(flatten)]
    pub driver: BackendArgs,
}

impl std::ops::Deref for DriverHostArgs {
    type Target = BackendArgs;

    fn deref(&self) -> &BackendArgs {
        &self.driver
    }
}

impl std::ops::DerefMut for DriverHostArgs {
    fn deref_mut(&mut self) -> &mut BackendArgs {
        &mut self.driver
    }
}

/// Which driver a host serves, and its settings: every flag of a driver host but where it
/// listens. `sbxd driver` (a Unix socket, [`DriverHostArgs`]) and `sbxd node` (TCP) flatten it.
#[derive(Debug, Clone, clap::Args)]
pub struct BackendArgs {
    /// The driver to serve.
    #[arg(long, value_name = "NAME", value_parser = registry::parse_backend,
          long_help = format!("The driver to serve.\n\n{}", registry::help()))]
    pub backend: &'static DriverFactory,
    /// Where the oci, process or vm driver keeps its sandboxes (required with those
    /// backends; one live host per directory). Unused by sim.
    #[arg(long, required_if_eq_any(registry::needing_state_dir("backend")))]
    pub state_dir: Option<PathBuf>,
    /// A path the process driver hides from its workloads (under an empty read-only tmpfs),
    /// besides its own state dir; repeat for more. sbxd passes its data dir.
    #[arg(long = "hide", value_name = "PATH")]
    pub hidden_paths: Vec<PathBuf>,
    /// The gateway's image store (DATA/images), read by the oci driver (required with
    /// --backend oci).
    #[arg(long, value_name = "DIR")]
    pub image_store: Option<PathBuf>,
    /// The cgroup under which the process driver makes sandbox cgroups, relative to the
    /// host's own cgroup.
    #[arg(long, default_value = "sbx")]
    pub cgroup_parent: String,
    /// How long the process and vm drivers' stop waits after SIGTERM (in the vm: to the
    /// guest's command) before SIGKILL when a request gives no grace period.
    #[arg(long, default_value_t = 5000)]
    pub default_grace_ms: u64,
    /// How often the process and vm drivers look for workloads that changed by themselves.
    #[arg(long, default_value_t = 250)]
    pub poll_interval_ms: u64,
    #[command(flatten)]
    pub vm: VmArgs,
    #[command(flatten)]
    pub oci: OciArgs,
}

/// The oci driver's settings: flags of `sbxd serve` (for `--driver oci` and `managed:oci`,
/// which passes them on to its driver process) and of `sbxd driver --backend oci`. Unused by
/// the other drivers.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "oci driver")]
pub struct OciArgs {
    /// The OCI runtime that runs the containers: a path, or a name looked up on PATH (runc
    /// by default; crun and other runtimes with runc's command line work too).
    #[arg(
        id = "oci_runtime",
        long = "oci-runtime",
        env = "SBX_OCI_RUNTIME",
        default_value = "runc",
        value_name = "PATH"
    )]
    pub runtime: PathBuf,

    /// The most processes (threads included) one sandbox may run at once: a fork bomb stops
    /// there.
    #[arg(
        id = "oci_pids_limit",
        long = "oci-pids-limit",
        env = "SBX_OCI_PIDS_LIMIT",
        default_value_t = 1024,
        value_parser = parse_pids_limit,
        value_name = "N"
    )]
    pub pids_limit: i64,

    /// The most processes every oci sandbox of this gateway may run together (the pids.max
    /// of --oci-cgroup-parent): many sandboxes at their own limit cannot take the host's
    /// pids. Default: half of kernel.pid_max (or of kernel.threads-max, the lower).
    #[arg(
        id = "oci_pids_total",
        long = "oci-pids-total",
        env = "SBX_OCI_PIDS_TOTAL",
        value_parser = parse_pids_total,
        value_name = "N"
    )]
    pub pids_total: Option<u64>,

    /// The static busybox the sandbox init runs on (bound read-only into every sandbox at
    /// /dev/.sbx). Default: /bin/busybox, else /usr/bin/busybox (Debian's busybox-static).
    #[arg(
        id = "oci_busybox",
        long = "oci-busybox",
        env = "SBX_OCI_BUSYBOX",
        value_name = "PATH"
    )]
    pub busybox: Option<PathBuf>,

    /// The cgroup (from each hierarchy's root) under which sandbox cgroups are made.
    #[arg(
        id = "oci_cgroup_parent",
        long = "oci-cgroup-parent",
        env = "SBX_OCI_CGROUP_PARENT",
        default_value = "sbx-oci",
        value_name = "PATH"
    )]
    pub cgroup_parent: String,

    /// The sandbox network (oci and process drivers): a bridge (<--network-name>0) holding
    /// this IPv4 network's first address, an address per sandbox leased by its UUID, and
    /// their egress policies enforced by one nftables table (`inet <--network-name>`). A
    /// sandbox on it reaches nothing but what its allowlist admits (none by default).
    /// `auto` (the default): the first of 10.213.0.0/16, 10.214.0.0/16, 10.215.0.0/16,
    /// 172.29.0.0/16, 172.30.0.0/16, 192.168.213.0/24 that overlaps nothing the host routes,
    /// kept for later starts (the log says which); when the network cannot be set up (no
    /// nft, no ip), sbxd says why and runs without. `off`: no network, every sandbox has
    /// loopback only. A CIDR: that one, refused at startup if it overlaps a network the host
    /// routes. Turns on IPv4 forwarding.
    #[arg(
        id = "network_cidr",
        long = "network-cidr",
        env = "SBX_NETWORK_CIDR",
        value_name = "CIDR|auto|off",
        default_value = "auto"
    )]
    pub network_cidr: Option<String>,

    /// Names the sandbox network's bridge (<NAME>0), nftables table and namespaces
    /// (<NAME>-<uuid>): 1 to 8 characters of a-z and 0-9. One per gateway on a host.
    #[arg(
        id = "network_name",
        long = "network-name",
        env = "SBX_NETWORK_NAME",
        default_value = "sbx",
        value_name = "NAME"
    )]
    pub network_name: String,

    /// The resolver the gateway's sandbox resolver asks for the names a sandbox's policy
    /// allows (`ADDR` or `ADDR:PORT`, IPv4). Default: the host's first IPv4 nameserver in
    /// /etc/resolv.conf. Sandboxes never reach it themselves: they ask the bridge's address,
    /// and names off their list are refused there.
    #[arg(
        id = "network_dns",
        long = "network-dns",
        env = "SBX_NETWORK_DNS",
        value_name = "ADDR[:PORT]",
        value_parser = parse_dns_upstream
    )]
    pub network_dns: Option<std::net::SocketAddr>,

    /// The connections each sandbox on the network may have in the host's connection
    /// tracking table at once (the table, `nf_conntrack_max`, is shared by every connection
    /// of the host: without a bound one sandbox fills it). One more is refused and counted.
    /// No ordinary program comes near the default; 64 sandboxes at it fill a table of
    /// 262,144.
    #[arg(
        id = "network_conntrack_max",
        long = "network-conntrack-max",
        env = "SBX_NETWORK_CONNTRACK_MAX",
        default_value_t = crate::network::DEFAULT_CONNTRACK_MAX,
        value_name = "N",
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub network_conntrack_max: u32,

    /// The host ids sandboxes (oci, process and vm: a VM's QEMU runs as its range's first uid)
    /// take their own range of 65536 from: START:COUNT as in /etc/subuid, COUNT a multiple of
    /// 65536 (the default holds 4096 sandboxes at once).
    /// Root's /etc/subuid and /etc/subgid must grant it for the process driver (newuidmap);
    /// it must not overlap the image store's 200000..265535.
    #[arg(
        id = "uid_pool",
        long = "uid-pool",
        env = "SBX_UID_POOL",
        default_value = "1000000:268435456",
        value_name = "START:COUNT",
        value_parser = crate::uidpool::parse_pool
    )]
    pub uid_pool: (u32, u32),

    /// Where the host's uid leases are kept (one file per sandbox's range): shared by every
    /// gateway and driver host on this machine, so none hands out a range another holds.
    #[arg(
        id = "uid_lease_dir",
        long = "uid-lease-dir",
        env = "SBX_UID_LEASE_DIR",
        default_value = crate::uidpool::DEFAULT_LEASE_DIR,
        value_name = "DIR"
    )]
    pub uid_lease_dir: PathBuf,

    /// The most a sandbox's log keeps on disk (oci and process; vm: its console): the log and the part before
    /// it together, the newest output kept (10Mi, 512Ki, …; at least 1Mi). A workload that
    /// writes more loses its oldest output, never the host's disk.
    #[arg(
        id = "log_max",
        long = "log-max",
        env = "SBX_LOG_MAX",
        default_value = "10Mi",
        value_name = "SIZE",
        value_parser = parse_log_max
    )]
    pub log_max: u64,

    /// The most ptys a sandbox holds in each of its two terminal instances (oci and process):
    /// its own /dev/pts, and the one its execs' terminals come from. A sandbox that opens
    /// more gets ENOSPC; neither instance can take the ptys the kernel keeps for the host's
    /// own terminals (kernel.pty.reserve).
    #[arg(
        id = "max_ptys",
        long = "max-ptys",
        env = "SBX_MAX_PTYS",
        default_value_t = crate::ptys::DEFAULT_MAX_PTYS,
        value_parser = crate::ptys::parse_max_ptys,
        value_name = "N"
    )]
    pub max_ptys: u32,
}

/// `--log-max`: a size (see `sbx_proto::quantity`) of at least `sbx_agent::log::MIN_CAP`.
pub fn parse_log_max(text: &str) -> Result<u64, String> {
    match sbx_proto::quantity::parse_bytes(text) {
        Some(bytes) if bytes >= sbx_agent::log::MIN_CAP => Ok(bytes),
        Some(_) => Err("a sandbox's log keeps at least 1Mi".to_string()),
        None => Err("not a size: write bytes, or a number with Ki, Mi or Gi (10Mi)".to_string()),
    }
}

/// `A.B.C.D` or `A.B.C.D:PORT`.
pub fn parse_dns_upstream(text: &str) -> Result<std::net::SocketAddr, String> {
    if let Ok(addr) = text.parse::<std::net::Ipv4Addr>() {
        return Ok(std::net::SocketAddr::from((addr, 53)));
    }
    match text.parse::<std::net::SocketAddr>() {
        Ok(a @ std::net::SocketAddr::V4(_)) if a.port() != 0 => Ok(a),
        _ => Err(format!(
            "{text:?} is not an IPv4 address, optionally with a port (10.0.0.53 or 10.0.0.53:5353)"
        )),
    }
}

impl Default for OciArgs {
    fn default() -> Self {
        let opts = OciDriverOptions::default();
        OciArgs {
            runtime: PathBuf::from("runc"),
            pids_limit: opts.pids_limit,
            pids_total: opts.pids_total,
            busybox: None,
            cgroup_parent: opts.cgroup_parent,
            network_cidr: None,
            network_name: crate::network::DEFAULT_NAME.to_string(),
            network_dns: None,
            network_conntrack_max: crate::network::DEFAULT_CONNTRACK_MAX,
            uid_pool: (crate::uidpool::DEFAULT_START, crate::uidpool::DEFAULT_COUNT),
            uid_lease_dir: PathBuf::from(crate::uidpool::DEFAULT_LEASE_DIR),
            log_max: opts.log_max,
            max_ptys: opts.max_ptys,
        }
    }
}

impl OciArgs {
    pub fn driver_options(&self) -> OciDriverOptions {
        OciDriverOptions {
            runtime: Some(self.runtime.clone()),
            busybox: self.busybox.clone(),
            cgroup_parent: self.cgroup_parent.clone(),
            pids_limit: self.pids_limit,
            pids_total: self.pids_total,
            uid_pool: Some(self.uid_pool()),
            log_max: self.log_max,
            max_ptys: self.max_ptys,
            ..OciDriverOptions::default()
        }
    }

    /// The pool `--uid-pool` and `--uid-lease-dir` give.
    pub fn uid_pool(&self) -> crate::uidpool::UidPool {
        crate::uidpool::UidPool {
            start: self.uid_pool.0,
            count: self.uid_pool.1,
            lease_dir: self.uid_lease_dir.clone(),
        }
    }

    /// What a driver host running sandboxes of its own (oci, process or vm) is told of them:
    /// `--uid-pool`, `--uid-lease-dir`, `--log-max` and `--max-ptys`.
    pub fn sandbox_flags(&self) -> Vec<OsString> {
        vec![
            "--uid-pool".into(),
            format!("{}:{}", self.uid_pool.0, self.uid_pool.1).into(),
            "--uid-lease-dir".into(),
            self.uid_lease_dir.clone().into(),
            "--log-max".into(),
            self.log_max.to_string().into(),
            "--max-ptys".into(),
            self.max_ptys.to_string().into(),
        ]
    }

    pub fn to_flags(&self) -> Vec<OsString> {
        let mut flags: Vec<OsString> = vec![
            "--oci-runtime".into(),
            self.runtime.clone().into(),
            "--oci-pids-limit".into(),
            self.pids_limit.to_string().into(),
            "--oci-cgroup-parent".into(),
            self.cgroup_parent.clone().into(),
        ];
        if let Some(total) = self.pids_total {
            flags.push("--oci-pids-total".into());
            flags.push(total.to_string().into());
        }
        if let Some(busybox) = &self.busybox {
            flags.push("--oci-busybox".into());
            flags.push(busybox.into());
        }
        flags.extend(self.network_flags());
        flags.extend(self.sandbox_flags());
        flags
    }

    /// The `--network-*` flags alone (the process driver's host gets these, not the oci
    /// ones); none when the network is off.
    pub fn network_flags(&self) -> Vec<OsString> {
        // Always said: a host's own default (auto) must not stand in for `off`.
        let cidr = self.network_cidr.as_deref().unwrap_or("off");
        let mut flags: Vec<OsString> = vec!["--network-cidr".into(), cidr.into()];
        if cidr == "off" {
            return flags;
        }
        flags.push("--network-name".into());
        flags.push(self.network_name.clone().into());
        if let Some(dns) = &self.network_dns {
            flags.push("--network-dns".into());
            flags.push(dns.to_string().into());
        }
        if self.network_conntrack_max != crate::network::DEFAULT_CONNTRACK_MAX {
            flags.push("--network-conntrack-max".into());
            flags.push(self.network_conntrack_max.to_string().into());
        }
        flags
    }

    /// The sandbox network these flags ask for (its leases under `state_dir/network`), set
    /// up or found again; `None` without `--network-cidr`.
    pub async fn open_network(
        &self,
        state_dir: &std::path::Path,
    ) -> Result<Option<Arc<crate::network::Network>>, DriverError> {
        let auto = match self.network_cidr.as_deref() {
            None | Some("off") => return Ok(None),
            Some("auto") => true,
            Some(_) => false,
        };
        let net_dir = state_dir.join("network");
        let cidr = match auto {
            true => {
                let (dir, name) = (net_dir.clone(), self.network_name.clone());
                let chosen =
                    tokio::task::spawn_blocking(move || crate::network::auto_cidr(&dir, &name))
                        .await
                        .map_err(|e| {
                            DriverError::Internal(format!("choosing the sandbox network: {e}"))
                        })?;
                match chosen {
                    Ok(cidr) => cidr,
                    Err(e) => {
                        tracing::warn!(error = %e, "no sandbox network (--network-cidr auto): sandboxes get loopback only; give --network-cidr CIDR, or --network-cidr off to say so");
                        return Ok(None);
                    }
                }
            }
            false => self.network_cidr.clone().unwrap_or_default(),
        };
        let cidr = &cidr;
        let (network, prefix) = crate::network::parse_cidr(cidr)
            .map_err(|e| DriverError::InvalidArgument(e.to_string()))?;
        let dns_upstream = self.network_dns.or_else(|| {
            let conf = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
            crate::network::resolver::host_nameserver(&conf, network, prefix)
        });
        if dns_upstream.is_none() {
            tracing::warn!(
                "no upstream resolver (no --network-dns, no IPv4 nameserver in /etc/resolv.conf): hostname entries of sandbox policies resolve to nothing"
            );
        }
        let config = crate::network::NetworkConfig {
            name: self.network_name.clone(),
            network,
            prefix,
            state_dir: state_dir.join("network"),
            dns_upstream,
            conntrack_max: self.network_conntrack_max,
        };
        let opened = tokio::task::spawn_blocking(move || crate::network::Network::open(config))
            .await
            .map_err(|e| DriverError::Internal(format!("opening the sandbox network: {e}")))?;
        let net = match opened {
            Ok(net) => net,
            // Another gateway's network: never a silent start without one, auto or not.
            Err(e @ crate::network::NetworkError::InUse { .. }) => {
                return Err(DriverError::Unavailable(format!(
                    "the sandbox network: {e}"
                )));
            }
            // auto is best effort: a host without nft or ip runs without a network, saying so.
            Err(e) if auto => {
                tracing::warn!(error = %e, cidr = %cidr, "no sandbox network (--network-cidr auto): sandboxes get loopback only; give --network-cidr CIDR, or --network-cidr off to say so");
                return Ok(None);
            }
            Err(e) => {
                return Err(DriverError::Unavailable(format!(
                    "the sandbox network: {e}"
                )));
            }
        };
        tracing::info!(cidr = %cidr, chosen = if auto { "auto" } else { "--network-cidr" }, bridge = %net.bridge_name(), resolver = ?dns_upstream, "the sandbox network is up");
        Ok(Some(Arc::new(net)))
    }
}

/// `--oci-pids-total`: at least 64, at most 4 Mi.
pub fn parse_pids_total(text: &str) -> Result<u64, String> {
    parse_bounded(text, "processes", 64, 4 << 20)
}

/// A pids limit: at least 16 (the init, a shell and a few commands), at most 4 Mi.
pub fn parse_pids_limit(text: &str) -> Result<i64, String> {
    parse_bounded(text, "processes", 16, 4 << 20).map(|n| n as i64)
}

/// The smallest guest memory the vm flags take: a Debian kernel and the busybox initramfs
/// do not boot in less (the vm driver raises a sandbox's own request to the same floor).
pub const VM_MIN_MEMORY_MIB: u64 = 256;
/// The largest guest memory the vm flags take (1 TiB): beyond it is surely a typo.
pub const VM_MAX_MEMORY_MIB: u64 = 1024 * 1024;
/// The smallest persistent disk: an ext4 file system with its journal needs a few MiB.
pub const VM_MIN_DISK_MIB: u64 = 16;
/// The largest persistent disk the flags take (16 TiB; the image is sparse).
pub const VM_MAX_DISK_MIB: u64 = 16 * 1024 * 1024;
/// The default of --vm-boot-timeout, in seconds (the driver's own default).
pub const VM_DEFAULT_BOOT_TIMEOUT_SECS: u64 = 45;
/// The longest --vm-boot-timeout, in seconds.
pub const VM_MAX_BOOT_TIMEOUT_SECS: u64 = 3600;

/// The vm driver's settings: flags of `sbxd serve` (for `--driver vm` and `managed:vm`, which
/// passes them on to its driver process) and of `sbxd driver --backend vm`. Unused by the
/// other drivers.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "vm driver")]
pub struct VmArgs {
    /// How QEMU runs guests: `kvm` (hardware virtualization through /dev/kvm), `tcg` (QEMU's
    /// emulator: works everywhere, a boot takes seconds), or `auto`: KVM when a probe boot
    /// under KVM works at startup, else TCG (on machines whose /dev/kvm cannot boot a stock
    /// kernel, e.g. PVM, the probe fails fast).
    #[arg(
        long = "vm-accel",
        env = "SBX_VM_ACCEL",
        default_value = "auto",
        value_parser = parse_vm_accel,
        value_name = "auto|kvm|tcg"
    )]
    pub accel: Accel,

    /// Guest memory in MiB for sandboxes whose spec asks for none (at least 256).
    #[arg(
        long = "vm-memory-mib",
        env = "SBX_VM_MEMORY_MIB",
        default_value_t = 256,
        value_parser = parse_vm_memory_mib,
        value_name = "MIB"
    )]
    pub memory_mib: u64,

    /// Size in MiB of a new sandbox's persistent disk (`/sandbox` in the guest; a sparse
    /// ext4 image, at least 16). Existing disks keep their size.
    #[arg(
        long = "vm-disk-mib",
        env = "SBX_VM_DISK_MIB",
        default_value_t = 256,
        value_parser = parse_vm_disk_mib,
        value_name = "MIB"
    )]
    pub disk_mib: u64,

    /// Seconds a boot may take until the guest runs the sandbox's command; a guest that
    /// takes longer is ended and the create or start fails (and is retried). Under TCG on a
    /// loaded machine a boot can take tens of seconds. sbxd's default --driver-call-timeout
    /// for the vm driver is this plus 15 s.
    #[arg(
        long = "vm-boot-timeout",
        env = "SBX_VM_BOOT_TIMEOUT",
        default_value_t = VM_DEFAULT_BOOT_TIMEOUT_SECS,
        value_parser = parse_vm_boot_timeout,
        value_name = "SECS"
    )]
    pub boot_timeout_secs: u64,

    /// The guest kernel (a bzImage or an ELF vmlinux). Default: the newest /boot/vmlinuz-*
    /// whose modules are in /lib/modules (Debian's linux-image-amd64).
    #[arg(long = "vm-kernel", env = "SBX_VM_KERNEL", value_name = "PATH")]
    pub kernel: Option<PathBuf>,

    /// The kernel's modules directory (virtio and ext4 modules go into the initramfs).
    /// Default: /lib/modules/VERSION of the kernel.
    #[arg(
        long = "vm-modules-dir",
        env = "SBX_VM_MODULES_DIR",
        value_name = "DIR"
    )]
    pub modules_dir: Option<PathBuf>,

    /// A statically linked busybox, the guest's userland. Default: /bin/busybox (Debian's
    /// busybox-static).
    #[arg(long = "vm-busybox", env = "SBX_VM_BUSYBOX", value_name = "PATH")]
    pub busybox: Option<PathBuf>,

    /// Where the unpacked kernel and the shared initramfs are cached (made at startup,
    /// which takes seconds the first time). Default: STATE_DIR/assets. Several drivers may
    /// share one.
    #[arg(
        long = "vm-asset-cache",
        env = "SBX_VM_ASSET_CACHE",
        value_name = "DIR"
    )]
    pub asset_cache: Option<PathBuf>,

    /// The QEMU binary. Default: qemu-system-x86_64 on PATH.
    #[arg(long = "vm-qemu", env = "SBX_VM_QEMU", value_name = "PATH")]
    pub qemu: Option<PathBuf>,
}

impl Default for VmArgs {
    fn default() -> Self {
        VmArgs {
            accel: Accel::Auto,
            memory_mib: 256,
            disk_mib: 256,
            boot_timeout_secs: VM_DEFAULT_BOOT_TIMEOUT_SECS,
            kernel: None,
            modules_dir: None,
            busybox: None,
            asset_cache: None,
            qemu: None,
        }
    }
}

impl VmArgs {
    pub fn boot_timeout(&self) -> Duration {
        Duration::from_secs(self.boot_timeout_secs)
    }

    /// The driver's options: these settings, and the driver's defaults for the rest.
    pub fn driver_options(&self) -> VmDriverOptions {
        VmDriverOptions {
            assets: AssetPaths {
                kernel: self.kernel.clone(),
                modules_dir: self.modules_dir.clone(),
                busybox: self.busybox.clone(),
            },
            asset_cache: self.asset_cache.clone(),
            qemu: self.qemu.clone(),
            accel: self.accel,
            memory_mib: self.memory_mib,
            disk_mib: self.disk_mib,
            boot_timeout: self.boot_timeout(),
            ..VmDriverOptions::default()
        }
    }

    /// These settings as command-line flags, for a driver process sbxd starts: parsing them
    /// (in the same environment, which the child inherits) gives these settings back.
    pub fn to_flags(&self) -> Vec<OsString> {
        let mut flags: Vec<OsString> = vec![
            "--vm-accel".into(),
            accel_name(self.accel).into(),
            "--vm-memory-mib".into(),
            self.memory_mib.to_string().into(),
            "--vm-disk-mib".into(),
            self.disk_mib.to_string().into(),
            "--vm-boot-timeout".into(),
            self.boot_timeout_secs.to_string().into(),
        ];
        let paths = [
            ("--vm-kernel", &self.kernel),
            ("--vm-modules-dir", &self.modules_dir),
            ("--vm-busybox", &self.busybox),
            ("--vm-asset-cache", &self.asset_cache),
            ("--vm-qemu", &self.qemu),
        ];
        for (flag, path) in paths {
            if let Some(path) = path {
                flags.push(flag.into());
                flags.push(path.into());
            }
        }
        flags
    }
}

/// The flag value of an accelerator (what [`parse_vm_accel`] reads).
pub fn accel_name(accel: Accel) -> &'static str {
    match accel {
        Accel::Auto => "auto",
        Accel::Kvm => "kvm",
        Accel::Tcg => "tcg",
    }
}

/// Parses `--vm-accel` (clap's value parser).
pub fn parse_vm_accel(text: &str) -> Result<Accel, String> {
    text.trim().to_ascii_lowercase().parse()
}

/// A whole number of `unit` within `min..=max`, or an error that says what is expected.
fn parse_bounded(text: &str, unit: &str, min: u64, max: u64) -> Result<u64, String> {
    let value: u64 = text
        .trim()
        .parse()
        .map_err(|_| format!("{text:?} is not a whole number of {unit}"))?;
    if value < min {
        return Err(format!("{value} {unit} is too small: at least {min}"));
    }
    if value > max {
        return Err(format!("{value} {unit} is too large: at most {max}"));
    }
    Ok(value)
}

/// Parses `--vm-memory-mib`.
pub fn parse_vm_memory_mib(text: &str) -> Result<u64, String> {
    parse_bounded(text, "MiB", VM_MIN_MEMORY_MIB, VM_MAX_MEMORY_MIB)
        .map_err(|e| format!("{e} (a guest needs {VM_MIN_MEMORY_MIB} MiB to boot)"))
}

/// Parses `--vm-disk-mib`.
pub fn parse_vm_disk_mib(text: &str) -> Result<u64, String> {
    parse_bounded(text, "MiB", VM_MIN_DISK_MIB, VM_MAX_DISK_MIB)
}

/// Parses `--vm-boot-timeout` (seconds, at least 1).
pub fn parse_vm_boot_timeout(text: &str) -> Result<u64, String> {
    parse_bounded(text, "seconds", 1, VM_MAX_BOOT_TIMEOUT_SECS)
}

/// Opens the driver `args` name, from the registry ([`crate::registry`]), with the settings
/// its flags give: a driver that runs images reads them from `--image-store`, opened
/// read-only (a gateway's store).
pub async fn open_backend(args: &BackendArgs) -> Result<Arc<dyn ComputeDriver>, DriverError> {
    let images = match (&args.image_store, args.backend.needs_images) {
        (Some(store), true) => Some(
            ImageStore::open_read_only(store.clone())
                .map_err(|e| DriverError::Unavailable(format!("the image store: {e}")))?,
        ),
        _ => None,
    };
    open_backend_with(args, images).await
}

/// [`open_backend`] with the image store given (`sbxd node`'s own, which it writes), instead
/// of `--image-store` opened read-only.
pub async fn open_backend_with(
    args: &BackendArgs,
    images: Option<ImageStore>,
) -> Result<Arc<dyn ComputeDriver>, DriverError> {
    let ctx = OpenContext {
        state_dir: args.state_dir.clone(),
        images,
        settings: DriverSettings {
            oci: args.oci.clone(),
            vm: args.vm.clone(),
            cgroup_parent: args.cgroup_parent.clone(),
            hidden_paths: args.hidden_paths.clone(),
            default_grace: Some(Duration::from_millis(args.default_grace_ms)),
            poll_interval: Some(Duration::from_millis(args.poll_interval_ms.max(1))),
            sim_faults: SimFaults::default(),
            sim_images: false,
        },
    };
    (args.backend.open)(ctx).await
}

/// Opens the driver and serves it on `args.socket` until `shutdown` resolves.
pub async fn run_driver_host(
    args: DriverHostArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DriverError> {
    let driver = open_backend(&args).await?;
    super::serve(driver, &args.socket, shutdown).await
}

/// Resolves at the first SIGTERM or SIGINT. The handlers are installed by this call, so a
/// signal that arrives any time after it returns is seen.
pub fn termination_signal() -> Result<impl Future<Output = ()> + Send, DriverError> {
    use tokio::signal::unix::{SignalKind, signal};
    let install = |kind: SignalKind| {
        signal(kind).map_err(|e| DriverError::Internal(format!("installing a signal handler: {e}")))
    };
    let mut terminate = install(SignalKind::terminate())?;
    let mut interrupt = install(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = interrupt.recv() => tracing::info!("SIGINT: shutting down"),
        }
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Host {
        #[command(flatten)]
        host: DriverHostArgs,
    }

    fn host(args: &[&str]) -> Result<DriverHostArgs, clap::Error> {
        Host::try_parse_from(std::iter::once("host").chain(args.iter().copied())).map(|h| h.host)
    }

    #[test]
    fn a_log_cap_is_a_size_of_at_least_a_mebibyte() {
        assert_eq!(parse_log_max("10Mi"), Ok(10 << 20));
        assert_eq!(parse_log_max("1048576"), Ok(1 << 20));
        assert!(parse_log_max("512Ki").unwrap_err().contains("at least 1Mi"));
        assert!(parse_log_max("lots").unwrap_err().contains("not a size"));
        let defaults = host(&[
            "--backend",
            "process",
            "--socket",
            "/s",
            "--state-dir",
            "/d",
        ]);
        assert_eq!(defaults.unwrap().oci.log_max, 10 << 20);
    }

    #[test]
    fn oci_backend_flags_parse_and_need_an_image_store() {
        use clap::CommandFactory;
        Host::command().debug_assert();
        let args = host(&[
            "--backend",
            "oci",
            "--socket",
            "/s",
            "--state-dir",
            "/d",
            "--image-store",
            "/i",
            "--oci-runtime",
            "crun",
            "--oci-pids-limit",
            "64",
            "--log-max",
            "2Mi",
            "--hide",
            "/data",
        ])
        .unwrap();
        assert_eq!(args.image_store, Some(PathBuf::from("/i")));
        assert_eq!(args.hidden_paths, [PathBuf::from("/data")]);
        let opts = args.oci.driver_options();
        assert_eq!(opts.runtime, Some(PathBuf::from("crun")));
        assert_eq!(opts.pids_limit, 64);
        assert_eq!(opts.log_max, 2 << 20);
        // What sbxd passes a managed driver parses back to the same settings.
        let mut flags: Vec<String> = ["--backend", "oci", "--socket", "/s", "--state-dir", "/d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        flags.extend(["--image-store".into(), "/i".into()]);
        flags.extend(
            args.oci
                .to_flags()
                .iter()
                .map(|f| f.to_string_lossy().into_owned()),
        );
        let again = host(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(again.oci, args.oci);
        let err = host(&["--backend", "oci", "--socket", "/s", "--state-dir", "/d"]).unwrap_err();
        assert!(err.to_string().contains("--image-store"), "{err}");
        let err = parse_pids_limit("3").unwrap_err();
        assert!(err.contains("at least 16"), "{err}");
    }

    #[test]
    fn vm_values_parse_and_bad_ones_say_why() {
        assert_eq!(parse_vm_accel("tcg"), Ok(Accel::Tcg));
        assert_eq!(parse_vm_accel(" KVM "), Ok(Accel::Kvm));
        assert_eq!(parse_vm_accel("auto"), Ok(Accel::Auto));
        let err = parse_vm_accel("hvf").unwrap_err();
        assert!(err.contains("hvf") && err.contains("tcg"), "{err}");

        assert_eq!(parse_vm_memory_mib("256"), Ok(256));
        assert_eq!(parse_vm_disk_mib(" 16 "), Ok(16));
        assert_eq!(parse_vm_boot_timeout("1"), Ok(1));
        for (parse, bad, mentions) in [
            (
                parse_vm_memory_mib as fn(&str) -> Result<u64, String>,
                "255",
                "at least 256",
            ),
            (parse_vm_memory_mib, "2G", "not a whole number"),
            (parse_vm_memory_mib, "-1", "not a whole number"),
            (parse_vm_memory_mib, "1048577", "at most 1048576"),
            (parse_vm_disk_mib, "15", "at least 16"),
            (parse_vm_disk_mib, "", "not a whole number"),
            (parse_vm_boot_timeout, "0", "at least 1"),
            (parse_vm_boot_timeout, "3601", "at most 3600"),
            (parse_vm_boot_timeout, "1.5", "not a whole number"),
        ] {
            let err = parse(bad).unwrap_err();
            assert!(err.contains(mentions), "{bad:?}: {err}");
        }
    }

    #[test]
    fn vm_backend_needs_a_state_dir_and_takes_the_vm_flags() {
        let err = host(&["--backend", "vm", "--socket", "/s"]).unwrap_err();
        assert!(err.to_string().contains("--state-dir"), "{err}");
        let err = host(&["--backend", "vm", "--socket", "/s", "--state-dir", "/d"]).unwrap_err();
        assert!(err.to_string().contains("--image-store"), "{err}");

        let args = host(&[
            "--backend",
            "vm",
            "--socket",
            "/s",
            "--state-dir",
            "/d",
            "--image-store",
            "/i",
            "--vm-accel",
            "tcg",
            "--vm-memory-mib",
            "512",
            "--vm-boot-timeout",
            "90",
            "--vm-kernel",
            "/k",
        ])
        .unwrap();
        assert_eq!(args.backend.name, "vm");
        let opts = args.vm.driver_options();
        assert_eq!(opts.accel, Accel::Tcg);
        assert_eq!(opts.memory_mib, 512);
        assert_eq!(opts.disk_mib, 256);
        assert_eq!(opts.boot_timeout, Duration::from_secs(90));
        assert_eq!(opts.assets.kernel, Some(PathBuf::from("/k")));
        assert_eq!(opts.assets.busybox, None);

        let err = host(&[
            "--backend",
            "vm",
            "--socket",
            "/s",
            "--state-dir",
            "/d",
            "--image-store",
            "/i",
            "--vm-memory-mib",
            "64",
        ])
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("--vm-memory-mib") && err.contains("at least 256"),
            "{err}"
        );
    }

    #[test]
    fn vm_flags_round_trip() {
        let full = VmArgs {
            accel: Accel::Kvm,
            memory_mib: 1024,
            disk_mib: 64,
            boot_timeout_secs: 120,
            kernel: Some(PathBuf::from("/boot/vmlinuz-x")),
            modules_dir: Some(PathBuf::from("/lib/modules/x")),
            busybox: Some(PathBuf::from("/opt/busybox")),
            asset_cache: Some(PathBuf::from("/var/cache/sbx vm")),
            qemu: Some(PathBuf::from("/opt/qemu")),
        };
        for vm in [VmArgs::default(), full] {
            let mut args: Vec<OsString> = [
                "host",
                "--backend",
                "vm",
                "--socket",
                "/s",
                "--state-dir",
                "/d",
                "--image-store",
                "/i",
            ]
            .map(OsString::from)
            .to_vec();
            args.extend(vm.to_flags());
            let parsed = Host::try_parse_from(args).unwrap().host.driver.vm;
            assert_eq!(parsed, vm);
        }
    }
}
