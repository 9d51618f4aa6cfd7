//! The drivers sbx knows, as one table: each row names a driver, says what it needs, opens it,
//! and says which of the settings a driver host of it must be given. `sbxd serve --driver NAME`
//! (in process), `--driver managed:NAME` (a driver host sbxd starts) and `sbxd driver --backend
//! NAME` (a driver host someone else runs) all build their driver from [`DRIVERS`], so a new
//! driver is its crate plus one row here, and every name in the table works in all three.
//!
//! A row opens its driver from an [`OpenContext`]: the driver's state directory, the gateway's
//! image store when the driver runs images, and [`DriverSettings`], every driver's settings as
//! sbxd's flags or a driver host's give them.
//!
//! Each driver owns its flags: a `clap::Args` struct in its own crate (`OciArgs`, `VmArgs`,
//! the process driver's `ProcessArgs`), and so do the parts several drivers share (the sandbox
//! network's `NetworkArgs`, the host drivers' `HostDriverArgs` in host-kit). [`DriverArgs`]
//! composes them once, and `sbxd serve` and a driver host (`sbxd driver`, `sbxd node`) both
//! flatten it, so a driver with settings of its own is its crate (its flags struct), its row
//! here, and its field in [`DriverArgs`]: no flag struct of the gateway's or the host's, and
//! no other field of [`DriverSettings`], changes. The one exception is the process driver's
//! cgroup parent and hidden paths, which sbxd and a driver host have always taken by
//! different flags (`--process-cgroup-parent` against `--cgroup-parent` and `--hide`).

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::host_kit::flags::HostDriverArgs;
use crate::image::ImageStore;
use crate::network::NetworkArgs;
use crate::oci::{OciArgs, OciDriver, OciDriverOptions};
use crate::process::{ProcessArgs, ProcessDriver, ProcessDriverOptions};
use crate::sim::{SimDriver, SimFaults, SimWorld};
use crate::vm::{VmArgs, VmDriver, VmDriverOptions};
use crate::{ComputeDriver, DriverError};

/// Every driver's own flags, each struct from its driver's crate (or, shared by several, from
/// the network's and host-kit's): `sbxd serve`, `sbxd driver` and `sbxd node` flatten this.
/// The fields' order is the order of `--help` (the vm driver's heading, then the oci driver's,
/// under which the network's and the host drivers' flags have always been listed).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args)]
pub struct DriverArgs {
    /// The vm driver's (`--vm-*`).
    #[command(flatten)]
    pub vm: VmArgs,
    /// The oci driver's (`--oci-*`).
    #[command(flatten)]
    pub oci: OciArgs,
    /// The sandbox network's (`--network-*`: oci, process and vm).
    #[command(flatten)]
    pub network: NetworkArgs,
    /// The host drivers' shared ones (`--uid-pool`, `--uid-lease-dir`, `--log-max`,
    /// `--max-ptys`: oci, process and vm).
    #[command(flatten)]
    pub host: HostDriverArgs,
}

impl DriverArgs {
    /// The path flags whose relative values are made absolute once at start (against the
    /// current directory), so that a driver process or runtime started elsewhere finds them.
    pub fn paths_mut(&mut self) -> Vec<&mut PathBuf> {
        let mut paths = self.oci.paths_mut();
        paths.extend(self.vm.paths_mut());
        paths
    }
}

/// Every driver's settings, as sbxd's flags or a driver host's give them.
#[derive(Debug, Clone, Default)]
pub struct DriverSettings {
    /// Every driver's own flags.
    pub flags: DriverArgs,
    /// The process driver's cgroup parent (relative to the opener's own cgroup) and the paths
    /// it hides from its workloads, besides its own state dir.
    pub process: ProcessArgs,
    /// How long a stop waits after SIGTERM when the request gives no grace period; `None`:
    /// the driver's default.
    pub default_grace: Option<Duration>,
    /// How often a driver looks for workloads that changed by themselves; `None`: the
    /// driver's default.
    pub poll_interval: Option<Duration>,
    /// The sim driver's faults.
    pub sim_faults: SimFaults,
    /// Whether the sim driver offers images.
    pub sim_images: bool,
}

/// What a row opens its driver with.
#[derive(Debug, Clone, Default)]
pub struct OpenContext {
    /// Where the driver keeps its sandboxes (required by a row with `needs_state_dir`).
    pub state_dir: Option<PathBuf>,
    /// The gateway's image store (required by a row with `needs_images`).
    pub images: Option<ImageStore>,
    pub settings: DriverSettings,
}

/// An opened driver, or why not.
pub type Opening = BoxFuture<'static, Result<Arc<dyn ComputeDriver>, DriverError>>;

/// One driver: a row of [`DRIVERS`].
pub struct DriverFactory {
    /// The name it is registered under (each of its sandboxes' `spec.driver`), in `--driver`
    /// and `--backend`.
    pub name: &'static str,
    /// What it runs and needs, for help texts.
    pub about: &'static str,
    /// Whether it keeps sandboxes in a state directory.
    pub needs_state_dir: bool,
    /// Whether it runs images from the gateway's image store.
    pub needs_images: bool,
    /// What an error opening it in sbxd adds: where to look.
    pub hint: &'static str,
    /// How long sbxd waits for a driver host of it to answer after starting it.
    pub host_ready_within: Duration,
    /// Opens the driver.
    pub open: fn(OpenContext) -> Opening,
    /// The settings a driver host of it is started with (after `--backend`, `--socket` and
    /// `--state-dir`): its own flags, from the context sbxd would open it with.
    pub host_flags: fn(&OpenContext) -> Vec<OsString>,
}

impl fmt::Debug for DriverFactory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl PartialEq for DriverFactory {
    fn eq(&self, other: &DriverFactory) -> bool {
        self.name == other.name
    }
}

impl Eq for DriverFactory {}

/// The drivers, in the order help texts list them.
#[cfg(not(test))]
pub static DRIVERS: &[DriverFactory] = &[OCI, PROCESS, SIM, VM];

/// In this crate's own tests, the example driver too: adding a driver is its crate and its
/// row ([`EXAMPLE`]).
#[cfg(test)]
pub static DRIVERS: &[DriverFactory] = &[OCI, PROCESS, SIM, VM, EXAMPLE];

/// The row named `name`.
pub fn driver(name: &str) -> Option<&'static DriverFactory> {
    DRIVERS.iter().find(|d| d.name == name)
}

/// The names of every driver, as `a, b, c` (`separator` between them).
pub fn names(separator: &str) -> String {
    let names: Vec<&str> = DRIVERS.iter().map(|d| d.name).collect();
    names.join(separator)
}

/// Every driver and what it is, one paragraph each (for `--help`).
pub fn help() -> String {
    let rows: Vec<String> = DRIVERS
        .iter()
        .map(|d| format!("{}: {}", d.name, d.about))
        .collect();
    rows.join("\n\n")
}

/// `--backend NAME` (clap's value parser).
pub fn parse_backend(text: &str) -> Result<&'static DriverFactory, String> {
    driver(text).ok_or_else(|| format!("unknown driver {text:?}; expected {}", names(", ")))
}

/// `(arg, name)` for every driver that needs a state directory: for clap's
/// `required_if_eq_any` on `arg`.
pub fn needing_state_dir(arg: &'static str) -> Vec<(&'static str, &'static str)> {
    DRIVERS
        .iter()
        .filter(|d| d.needs_state_dir)
        .map(|d| (arg, d.name))
        .collect()
}

/// `(arg, name)` for every driver that runs images (see [`needing_state_dir`]).
pub fn needing_images(arg: &'static str) -> Vec<(&'static str, &'static str)> {
    DRIVERS
        .iter()
        .filter(|d| d.needs_images)
        .map(|d| (arg, d.name))
        .collect()
}

impl OpenContext {
    fn state_dir(&self, driver: &str) -> Result<PathBuf, DriverError> {
        self.state_dir.clone().ok_or_else(|| {
            DriverError::InvalidArgument(format!("the {driver} driver needs --state-dir"))
        })
    }

    fn images(&self, driver: &str) -> Result<ImageStore, DriverError> {
        self.images.clone().ok_or_else(|| {
            DriverError::InvalidArgument(format!("the {driver} driver needs --image-store"))
        })
    }
}

/// `default` replaced by the setting, when there is one.
fn or_default(setting: Option<Duration>, default: Duration) -> Duration {
    setting.unwrap_or(default)
}

const OCI: DriverFactory = DriverFactory {
    name: "oci",
    about: "OCI containers from images, run by runc, behind a user namespace (root inside is \
            an unprivileged uid on the host), seccomp, dropped capabilities and cpu/memory/pids \
            limits, with an overlay root filesystem that persists; they outlive sbxd and are \
            re-attached after a restart. Needs root, runc and busybox-static.",
    needs_state_dir: true,
    needs_images: true,
    hint: " (see sbxd serve --help for the --oci-* and --network-* flags; --driver process \
           runs without runc, for trusted work)",
    host_ready_within: Duration::from_secs(30),
    open: |ctx| {
        Box::pin(async move {
            let state_dir = ctx.state_dir("oci")?;
            let images = ctx.images("oci")?;
            let settings = &ctx.settings;
            let flags = &settings.flags;
            let defaults = OciDriverOptions::default();
            let opts = OciDriverOptions {
                default_grace: or_default(settings.default_grace, defaults.default_grace),
                poll_interval: or_default(settings.poll_interval, defaults.poll_interval),
                id_map: images.idmap(),
                network: flags.network.open(&state_dir).await?,
                uid_pool: Some(flags.host.uid_pool()),
                log_max: flags.host.log_max,
                max_ptys: flags.host.max_ptys,
                ..flags.oci.driver_options()
            };
            let driver = OciDriver::open(state_dir, images, opts).await?;
            Ok(Arc::new(driver) as Arc<dyn ComputeDriver>)
        })
    },
    host_flags: |ctx| {
        let mut flags: Vec<OsString> = Vec::new();
        if let Some(images) = &ctx.images {
            flags.push("--image-store".into());
            flags.push(images.root().into());
        }
        flags.extend(ctx.settings.flags.oci.to_flags());
        flags.extend(ctx.settings.flags.network.to_flags());
        flags.extend(ctx.settings.flags.host.to_flags());
        flags
    },
};

const PROCESS: DriverFactory = DriverFactory {
    name: "process",
    about: "Namespaced, cgrouped process trees on this machine, for trusted work: root inside \
            is an unprivileged host uid in a user namespace, with no capabilities, and sees the \
            host's filesystem as that uid does (minus the driver's state). They outlive sbxd \
            and are re-attached after a restart. Needs root and uidmap.",
    needs_state_dir: true,
    needs_images: false,
    hint: " (see sbxd serve --help for the --network-* flags; on a machine where it cannot \
           run, use --driver sim)",
    host_ready_within: Duration::from_secs(30),
    open: |ctx| {
        Box::pin(async move {
            let state_dir = ctx.state_dir("process")?;
            let settings = &ctx.settings;
            let flags = &settings.flags;
            let defaults = ProcessDriverOptions::default();
            let opts = ProcessDriverOptions {
                network: flags.network.open(&state_dir).await?,
                cgroup_parent: settings.process.cgroup_parent.clone(),
                hidden_paths: settings.process.hidden_paths.clone(),
                default_grace: or_default(settings.default_grace, defaults.default_grace),
                poll_interval: or_default(settings.poll_interval, defaults.poll_interval),
                uid_pool: Some(flags.host.uid_pool()),
                log_max: flags.host.log_max,
                max_ptys: flags.host.max_ptys,
                ..defaults
            };
            let driver = tokio::task::spawn_blocking(move || ProcessDriver::open(state_dir, opts))
                .await
                .map_err(|e| DriverError::Internal(format!("opening the driver: {e}")))??;
            Ok(Arc::new(driver) as Arc<dyn ComputeDriver>)
        })
    },
    host_flags: |ctx| {
        let mut flags: Vec<OsString> = Vec::new();
        for path in &ctx.settings.process.hidden_paths {
            flags.push("--hide".into());
            flags.push(path.into());
        }
        flags.extend(ctx.settings.flags.network.to_flags());
        flags.extend(ctx.settings.flags.host.to_flags());
        flags
    },
};

const SIM: DriverFactory = DriverFactory {
    name: "sim",
    about: "In memory, for tests and benchmarks. Its sandboxes do NOT survive a restart: after \
            one, the records are still in the store but their workloads are gone.",
    needs_state_dir: false,
    needs_images: false,
    hint: "",
    host_ready_within: Duration::from_secs(30),
    open: |ctx| {
        Box::pin(async move {
            let settings = ctx.settings;
            let driver = SimDriver::new(SimWorld::new(), settings.sim_faults)
                .with_images(settings.sim_images);
            Ok(Arc::new(driver) as Arc<dyn ComputeDriver>)
        })
    },
    host_flags: |_| Vec::new(),
};

const VM: DriverFactory = DriverFactory {
    name: "vm",
    about: "QEMU microVMs booted from the sandbox's image (its root filesystem kept until \
            delete) with a persistent disk at /sandbox (see the --vm-* flags); they outlive \
            sbxd and are re-attached after a restart. Needs qemu-system-x86, qemu-utils, \
            e2fsprogs, a kernel (linux-image-amd64) and busybox-static.",
    needs_state_dir: true,
    needs_images: true,
    hint: " (see sbxd serve --help for the --vm-* flags)",
    // It answers once it has prepared the guest's kernel and initramfs (seconds, the first
    // time) and, with `--vm-accel auto`, probed KVM with a throwaway boot (up to 20 s).
    host_ready_within: Duration::from_secs(60),
    open: |ctx| {
        Box::pin(async move {
            let state_dir = ctx.state_dir("vm")?;
            let settings = &ctx.settings;
            let flags = &settings.flags;
            let defaults = VmDriverOptions::default();
            let opts = VmDriverOptions {
                images: Some(ctx.images("vm")?),
                network: flags.network.open(&state_dir).await?,
                uid_pool: flags.host.uid_pool(),
                log_max: flags.host.log_max,
                default_grace: or_default(settings.default_grace, defaults.default_grace),
                poll_interval: or_default(settings.poll_interval, defaults.poll_interval),
                ..flags.vm.driver_options()
            };
            let driver = VmDriver::open(state_dir, opts).await?;
            tracing::info!(accel = %driver.accel(), "the vm driver is open");
            Ok(Arc::new(driver) as Arc<dyn ComputeDriver>)
        })
    },
    host_flags: |ctx| {
        let mut flags: Vec<OsString> = Vec::new();
        if let Some(images) = &ctx.images {
            flags.push("--image-store".into());
            flags.push(images.root().into());
        }
        flags.extend(ctx.settings.flags.network.to_flags());
        flags.extend(ctx.settings.flags.host.to_flags());
        flags.extend(ctx.settings.flags.vm.to_flags());
        flags
    },
};

/// The example driver (`sbx_driver_example`), in this crate's tests only.
#[cfg(test)]
const EXAMPLE: DriverFactory = DriverFactory {
    name: "example",
    about: "Sandboxes kept in memory that run nothing: the example of adding a driver.",
    needs_state_dir: false,
    needs_images: false,
    hint: "",
    host_ready_within: Duration::from_secs(30),
    open: |_| {
        Box::pin(async {
            let driver = sbx_driver_example::ExampleDriver::default();
            Ok(Arc::new(driver) as Arc<dyn ComputeDriver>)
        })
    },
    host_flags: |_| Vec::new(),
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_driver_is_found_by_its_name_and_an_unknown_one_names_them_all() {
        for d in DRIVERS {
            assert_eq!(driver(d.name), Some(d));
            assert_eq!(parse_backend(d.name), Ok(d));
        }
        let err = parse_backend("kvm").unwrap_err();
        assert!(err.contains("oci, process, sim, vm, example"), "{err}");
        assert_eq!(
            needing_state_dir("backend"),
            [
                ("backend", "oci"),
                ("backend", "process"),
                ("backend", "vm")
            ]
        );
        assert_eq!(
            needing_images("backend"),
            [("backend", "oci"), ("backend", "vm")]
        );
    }

    #[tokio::test]
    async fn a_driver_that_needs_a_state_dir_says_so_instead_of_opening() {
        for d in DRIVERS.iter().filter(|d| d.needs_state_dir) {
            let err = match (d.open)(OpenContext::default()).await {
                Err(err) => err.to_string(),
                Ok(_) => panic!("{} opened without a state dir", d.name),
            };
            assert!(err.contains("--state-dir"), "{}: {err}", d.name);
        }
    }
}

/// The example driver, added by its crate and its row alone, is served by a driver host
/// (`sbxd driver --backend example`, what `--driver managed:example` starts) and answers a
/// lifecycle through the host's socket.
#[cfg(test)]
mod example {
    use clap::Parser;

    use crate::remote::{DriverHostArgs, RemoteDriver, run_driver_host};
    use crate::{ComputeDriver, pb};

    #[derive(Debug, Parser)]
    struct Host {
        #[command(flatten)]
        host: DriverHostArgs,
    }

    #[tokio::test]
    async fn a_driver_added_by_one_row_is_served_by_a_driver_host() {
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("example.sock");
        let argv = ["sbxd-driver", "--backend", "example", "--socket"];
        let args = Host::try_parse_from(argv.iter().copied().chain([socket.to_str().unwrap()]))
            .unwrap()
            .host;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let host = tokio::spawn(run_driver_host(args, async {
            let _ = stopped.await;
        }));
        let driver = RemoteDriver::connect_lazy(socket, std::time::Duration::from_secs(5));
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        let capabilities = loop {
            match driver.capabilities().await {
                Ok(c) => break c,
                Err(e) if tokio::time::Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
                Err(e) => panic!("the host never answered: {e}"),
            }
        };
        assert_eq!(capabilities.driver, "example");

        let id = uuid::Uuid::new_v4().to_string();
        let created = driver
            .create(pb::CreateRequest {
                sandbox_id: id.clone(),
                workspace: "default".into(),
                name: "box".into(),
                generation: 1,
                ..Default::default()
            })
            .await
            .unwrap();
        assert_eq!(created.state, pb::State::Running as i32);
        let stopped_box = driver
            .stop(pb::StopRequest {
                sandbox_id: id.clone(),
                grace_period_ms: 0,
            })
            .await
            .unwrap();
        assert_eq!(stopped_box.state, pb::State::Stopped as i32);
        let listed = driver.list().await.unwrap();
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].sandbox_id, id);
        let deleted = driver
            .delete(pb::DeleteRequest {
                sandbox_id: id.clone(),
            })
            .await
            .unwrap();
        assert!(deleted.deleted);
        let gone = driver.get(pb::GetRequest { sandbox_id: id }).await;
        assert!(
            matches!(gone, Err(crate::DriverError::NotFound { .. })),
            "{gone:?}"
        );

        stop.send(()).unwrap();
        host.await.unwrap().unwrap();
    }
}
