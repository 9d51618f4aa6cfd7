//! The driver host: opens one in-tree driver and serves it on a Unix socket until a
//! termination signal. `sbx-driver-host` is a thin `main` around [`run_driver_host`]; the
//! gateway's `sbxd driver` subcommand flattens [`DriverHostArgs`] and calls the same function.
//! `sbxd node` flattens [`BackendArgs`] (the same flags but `--socket`) and serves the driver
//! over TCP instead ([`super::serve_node`]).
//! Every driver's own flags ([`DriverArgs`], composed by the registry from the drivers' crates)
//! are flattened into `sbxd serve` too, so that the same flags and `SBX_*` variables set up an
//! in-process, a managed and a hosted driver.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::image::ImageStore;
use crate::process::ProcessArgs;
use crate::registry::{self, DriverArgs, DriverFactory, DriverSettings, OpenContext};
use crate::sim::SimFaults;
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
    /// Every driver's own flags (the vm driver's, the oci driver's, the sandbox network's and
    /// the host drivers' shared ones).
    #[command(flatten)]
    pub drivers: DriverArgs,
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
            flags: args.drivers.clone(),
            process: ProcessArgs {
                cgroup_parent: args.cgroup_parent.clone(),
                hidden_paths: args.hidden_paths.clone(),
            },
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

    use std::ffi::OsString;

    use super::*;
    use crate::vm::{Accel, VmArgs};

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
        let defaults = host(&[
            "--backend",
            "process",
            "--socket",
            "/s",
            "--state-dir",
            "/d",
        ]);
        assert_eq!(defaults.unwrap().drivers.host.log_max, 10 << 20);
        let err = host(&[
            "--backend",
            "process",
            "--socket",
            "/s",
            "--state-dir",
            "/d",
            "--log-max",
            "512Ki",
        ])
        .unwrap_err();
        assert!(err.to_string().contains("at least 1Mi"), "{err}");
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
        let opts = args.drivers.oci.driver_options();
        assert_eq!(opts.runtime, Some(PathBuf::from("crun")));
        assert_eq!(opts.pids_limit, 64);
        assert_eq!(args.drivers.host.log_max, 2 << 20);
        // What sbxd passes a managed driver parses back to the same settings.
        let ctx = OpenContext {
            state_dir: Some(PathBuf::from("/d")),
            images: None,
            settings: DriverSettings {
                flags: args.drivers.clone(),
                ..DriverSettings::default()
            },
        };
        let mut flags: Vec<String> = ["--backend", "oci", "--socket", "/s", "--state-dir", "/d"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        flags.extend(["--image-store".into(), "/i".into()]);
        flags.extend(
            (args.backend.host_flags)(&ctx)
                .iter()
                .map(|f| f.to_string_lossy().into_owned()),
        );
        let again = host(&flags.iter().map(String::as_str).collect::<Vec<_>>()).unwrap();
        assert_eq!(again.drivers, args.drivers);
        let err = host(&["--backend", "oci", "--socket", "/s", "--state-dir", "/d"]).unwrap_err();
        assert!(err.to_string().contains("--image-store"), "{err}");
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
        let opts = args.drivers.vm.driver_options();
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
            let parsed = Host::try_parse_from(args).unwrap().host.driver.drivers.vm;
            assert_eq!(parsed, vm);
        }
    }
}
