//! The driver host: opens one in-tree driver and serves it on a Unix socket until a
//! termination signal. `sbx-driver-host` is a thin `main` around [`run_driver_host`]; the
//! gateway's `sbxd driver` subcommand flattens [`DriverHostArgs`] and calls the same function.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::process::{ProcessDriver, ProcessDriverOptions};
use crate::sim::{SimDriver, SimFaults, SimWorld};
use crate::{ComputeDriver, DriverError};

/// Which in-tree driver a host serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Namespaced process trees on this machine (needs root); state in --state-dir, so a
    /// restarted host finds every workload again.
    Process,
    /// The in-memory simulated driver. It keeps nothing on disk: killing the host loses
    /// every sandbox it knew.
    Sim,
}

/// The command line of a driver host.
#[derive(Debug, Clone, clap::Args)]
pub struct DriverHostArgs {
    /// The driver to serve.
    #[arg(long, value_enum)]
    pub backend: Backend,
    /// The Unix socket to serve on (made with mode 0600). A stale socket file is replaced;
    /// a socket on which another host answers is refused.
    #[arg(long)]
    pub socket: PathBuf,
    /// Where the process driver keeps its sandboxes (required with --backend process; one
    /// live host per directory). Unused by sim.
    #[arg(long, required_if_eq("backend", "process"))]
    pub state_dir: Option<PathBuf>,
    /// The cgroup under which the process driver makes sandbox cgroups, relative to the
    /// host's own cgroup.
    #[arg(long, default_value = "sbx")]
    pub cgroup_parent: String,
    /// How long the process driver's stop waits after SIGTERM before SIGKILL when a request
    /// gives no grace period.
    #[arg(long, default_value_t = 5000)]
    pub default_grace_ms: u64,
    /// How often the process driver looks for workloads that ended by themselves.
    #[arg(long, default_value_t = 250)]
    pub poll_interval_ms: u64,
}

/// Opens the driver `args` choose.
pub fn open_backend(args: &DriverHostArgs) -> Result<Arc<dyn ComputeDriver>, DriverError> {
    match args.backend {
        Backend::Process => {
            let state_dir = args.state_dir.clone().ok_or_else(|| {
                DriverError::InvalidArgument("--backend process needs --state-dir".into())
            })?;
            let opts = ProcessDriverOptions {
                cgroup_parent: args.cgroup_parent.clone(),
                default_grace: Duration::from_millis(args.default_grace_ms),
                poll_interval: Duration::from_millis(args.poll_interval_ms.max(1)),
                ..ProcessDriverOptions::default()
            };
            Ok(Arc::new(ProcessDriver::open(state_dir, opts)?))
        }
        Backend::Sim => Ok(Arc::new(SimDriver::new(
            SimWorld::new(),
            SimFaults::default(),
        ))),
    }
}

/// Opens the driver and serves it on `args.socket` until `shutdown` resolves.
pub async fn run_driver_host(
    args: DriverHostArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<(), DriverError> {
    let socket = args.socket.clone();
    // Opening the process driver may wait for a previous instance's lock: off the runtime.
    let driver = tokio::task::spawn_blocking(move || open_backend(&args))
        .await
        .map_err(|e| DriverError::Internal(format!("opening the driver: {e}")))??;
    super::serve(driver, &socket, shutdown).await
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
