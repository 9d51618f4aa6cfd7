//! Opening the data directory's store and the chosen compute driver.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sbx_drivers::ComputeDriver;
use sbx_drivers::image::ImageStore;
use sbx_drivers::process::ProcessArgs;
use sbx_drivers::registry::{DriverSettings, OpenContext};
use sbx_drivers::remote::RemoteDriver;
use sbx_drivers::sim::{SimFaults, SimOp};

use super::managed::{MAX_SOCKET_PATH, ManagedDriver, ManagedDriverPaths, stop_stale_driver};
use super::{DaemonError, DriverKind, DriverSpec, ServeArgs};

/// The data directory: the flag, else the default of sbxd's user
/// ([`sbx_proto::local::default_data_dir`]).
pub fn data_dir(flag: Option<&Path>) -> Result<PathBuf, DaemonError> {
    match flag {
        Some(dir) => Ok(dir.to_path_buf()),
        None => sbx_proto::local::default_data_dir(nix::unistd::geteuid().is_root())
            .ok_or(DaemonError::NoDataDir),
    }
}

/// The compute driver sbxd serves sandboxes on.
pub struct OpenedDriver {
    /// The name it is registered under in the DriverSet (each sandbox's `spec.driver`).
    pub name: String,
    pub driver: Arc<dyn ComputeDriver>,
    /// The supervised driver process, in managed mode; stopped at shutdown.
    pub managed: Option<ManagedDriver>,
}

/// Opens the driver chosen by `args`, keeping its state in `DATA/drivers/NAME`; an oci
/// driver runs images from `images`.
pub async fn open_driver(
    args: &ServeArgs,
    data_dir: &Path,
    images: &ImageStore,
) -> Result<OpenedDriver, DaemonError> {
    let name = args
        .driver
        .driver_name(args.driver_name.as_deref())
        .map_err(|why| {
            DaemonError::DriverName(args.driver_name.clone().unwrap_or_default(), why)
        })?;
    let (driver, managed) = match &args.driver {
        DriverSpec::InProcess(kind) => {
            // An orphaned managed driver (its sbxd was SIGKILLed) would hold the state lock.
            stop_stale_driver(&ManagedDriverPaths::new(data_dir, *kind)).await;
            (open_in_process(*kind, args, data_dir, images).await?, None)
        }
        DriverSpec::Remote(socket) => {
            check_socket_path(socket)?;
            let driver = RemoteDriver::connect_lazy(socket.clone(), args.driver_call_timeout());
            (Arc::new(driver) as Arc<dyn ComputeDriver>, None)
        }
        DriverSpec::Managed(kind) => {
            let paths = ManagedDriverPaths::new(data_dir, *kind);
            let socket = paths.socket.clone();
            check_socket_path(&socket)?;
            let flags = managed_host_flags(*kind, args, data_dir, images)?;
            let managed = ManagedDriver::start(paths, flags).await?;
            let driver = RemoteDriver::connect_lazy(socket, args.driver_call_timeout());
            (Arc::new(driver) as Arc<dyn ComputeDriver>, Some(managed))
        }
    };
    Ok(OpenedDriver {
        name,
        driver,
        managed,
    })
}

/// Waits (at most `limit`) until the driver answers a capabilities call; false when it did
/// not. For an out-of-process driver that is still starting, so that re-attaching does not
/// begin with a burst of UNAVAILABLE retries.
pub async fn wait_driver_ready(driver: &dyn ComputeDriver, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        if left.is_zero() {
            return false;
        }
        if let Ok(Ok(_)) = tokio::time::timeout(left, driver.capabilities()).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50).min(left)).await;
    }
}

/// A socket path the kernel cannot bind or connect to is refused up front, clearly.
fn check_socket_path(socket: &Path) -> Result<(), DaemonError> {
    let len = socket.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(DaemonError::SocketPathTooLong {
            path: socket.to_path_buf(),
            len,
        });
    }
    Ok(())
}

/// What the registry opens the driver `kind` with in sbxd's own process: its state in
/// `DATA/drivers/NAME`, the gateway's image store, and the settings sbxd's flags give.
fn open_context(
    kind: DriverKind,
    args: &ServeArgs,
    data_dir: &Path,
    images: &ImageStore,
) -> Result<OpenContext, DaemonError> {
    let mut sim_faults =
        SimFaults::default().with_latency(Duration::from_millis(args.sim_latency_ms));
    for op in &args.sim_fail {
        sim_faults = sim_faults.with_error_rate_for(parse_sim_op(op)?, 1.0);
    }
    Ok(OpenContext {
        state_dir: Some(data_dir.join("drivers").join(kind.name())),
        images: Some(images.clone()),
        settings: DriverSettings {
            flags: args.drivers.clone(),
            process: ProcessArgs {
                cgroup_parent: args.process.cgroup_parent.clone(),
                // The store, the images and the other drivers' sandboxes are none of the
                // workloads' business.
                hidden_paths: vec![data_dir.to_path_buf()],
            },
            default_grace: None,
            poll_interval: None,
            sim_faults,
            sim_images: args.images.sim_images,
        },
    })
}

/// The backend's settings a managed driver process gets on its command line (after
/// `--backend --socket --state-dir`, which the launcher adds): the cgroup parent, then what
/// its row of the registry asks for.
fn managed_host_flags(
    kind: DriverKind,
    args: &ServeArgs,
    data_dir: &Path,
    images: &ImageStore,
) -> Result<Vec<OsString>, DaemonError> {
    let ctx = open_context(kind, args, data_dir, images)?;
    let mut flags: Vec<OsString> = vec![
        "--cgroup-parent".into(),
        args.process.cgroup_parent.clone().into(),
    ];
    flags.extend((kind.factory().host_flags)(&ctx));
    Ok(flags)
}

/// Opens the driver `kind` in sbxd's own process, from its row of the registry.
async fn open_in_process(
    kind: DriverKind,
    args: &ServeArgs,
    data_dir: &Path,
    images: &ImageStore,
) -> Result<Arc<dyn ComputeDriver>, DaemonError> {
    let ctx = open_context(kind, args, data_dir, images)?;
    let factory = kind.factory();
    (factory.open)(ctx)
        .await
        .map_err(|source| DaemonError::Driver {
            driver: factory.name,
            source,
            hint: factory.hint,
        })
}

fn parse_sim_op(text: &str) -> Result<SimOp, DaemonError> {
    let wanted = text.trim().to_ascii_lowercase();
    SimOp::ALL
        .into_iter()
        .find(|op| op.as_str() == wanted)
        .ok_or_else(|| {
            let known: Vec<&str> = SimOp::ALL.iter().map(|op| op.as_str()).collect();
            DaemonError::UnknownSimOp(text.to_string(), known.join(", "))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_paths_longer_than_sun_path_are_refused() {
        assert!(check_socket_path(Path::new("/run/sbx/process.sock")).is_ok());
        let long = PathBuf::from(format!("/{}", "d".repeat(MAX_SOCKET_PATH)));
        let err = check_socket_path(&long).unwrap_err().to_string();
        assert!(err.contains("108") && err.contains("--data-dir"), "{err}");
    }

    #[test]
    fn managed_drivers_get_their_backend_settings() {
        use clap::Parser;
        let argv = [
            "sbxd",
            "serve",
            "--driver",
            "managed:vm",
            "--network-cidr",
            "off",
            "--process-cgroup-parent",
            "cg",
            "--vm-accel",
            "tcg",
            "--vm-kernel",
            "/k",
        ];
        let args = match super::super::Sbxd::try_parse_from(argv).unwrap().command {
            super::super::Command::Serve(args) => args,
            _ => unreachable!("parsed serve"),
        };
        let text = |flags: Vec<OsString>| -> Vec<String> {
            flags
                .into_iter()
                .map(|f| f.to_string_lossy().into_owned())
                .collect()
        };
        let tmp = tempfile::tempdir().unwrap();
        let images = ImageStore::open(tmp.path().join("images"), Default::default()).unwrap();
        assert_eq!(
            text(
                managed_host_flags(
                    DriverKind::named("process").unwrap(),
                    &args,
                    Path::new("/d"),
                    &images
                )
                .unwrap()
            ),
            [
                "--cgroup-parent",
                "cg",
                "--hide",
                "/d",
                // Said even when off: the host's own default (auto) must not stand in.
                "--network-cidr",
                "off",
                "--uid-pool",
                "1000000:268435456",
                "--uid-lease-dir",
                "/var/lib/sbx/uid-leases",
                "--log-max",
                "10485760",
                "--max-ptys",
                "128"
            ]
        );
        // With a network, the process driver's host gets it too (and only its flags).
        let mut networked = args.clone();
        networked.drivers.network.cidr = Some("10.213.0.0/16".into());
        networked.drivers.network.dns = Some("10.0.0.53:53".parse().unwrap());
        assert_eq!(
            text(
                managed_host_flags(
                    DriverKind::named("process").unwrap(),
                    &networked,
                    Path::new("/d"),
                    &images
                )
                .unwrap()
            ),
            [
                "--cgroup-parent",
                "cg",
                "--hide",
                "/d",
                "--network-cidr",
                "10.213.0.0/16",
                "--network-name",
                "sbx",
                "--network-dns",
                "10.0.0.53:53",
                "--uid-pool",
                "1000000:268435456",
                "--uid-lease-dir",
                "/var/lib/sbx/uid-leases",
                "--log-max",
                "10485760",
                "--max-ptys",
                "128"
            ]
        );
        let oci = text(
            managed_host_flags(
                DriverKind::named("oci").unwrap(),
                &args,
                Path::new("/d"),
                &images,
            )
            .unwrap(),
        )
        .join(" ");
        assert!(
            oci.contains(&format!("--image-store {}", images.root().display()))
                && oci.contains("--oci-runtime runc")
                && oci.contains("--oci-pids-limit 1024")
                && oci.contains("--uid-pool 1000000:268435456"),
            "{oci}"
        );
        let vm = text(
            managed_host_flags(
                DriverKind::named("vm").unwrap(),
                &args,
                Path::new("/d"),
                &images,
            )
            .unwrap(),
        );
        let joined = vm.join(" ");
        assert!(
            joined.starts_with(&format!(
                "--cgroup-parent cg --image-store {} ",
                images.root().display()
            )) && joined.contains("--vm-accel tcg ")
                && joined.contains("--network-cidr")
                && joined.contains("--vm-boot-timeout 45")
                && joined.ends_with("--vm-kernel /k"),
            "{joined}"
        );
    }

    #[test]
    fn sim_ops_parse_by_name() {
        assert_eq!(parse_sim_op("exec").unwrap(), SimOp::Exec);
        assert_eq!(parse_sim_op(" Stop ").unwrap(), SimOp::Stop);
        let err = parse_sim_op("explode").unwrap_err().to_string();
        assert!(
            err.contains("explode") && err.contains("capabilities"),
            "{err}"
        );
    }
}
