//! Settings of the actor runtime, and the context every actor shares.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sbx_driver_api::ComputeDriver;
use sbx_images::ImageStore;
use sbx_proto::v1::Sandbox;
use sbx_storage::ObjectStore;
use tokio::sync::Semaphore;

use crate::error::{ActorError, Result};
use crate::events::EventHub;
use crate::lease::LeaseTable;
use crate::nodes::{Nodes, node_id_of, node_of_place, place_key};
use crate::owned::sealer::Sealer;
use crate::startup::StartupTracker;
use crate::supervision::RestartPolicy;

/// The built-in default image: busybox, built by sbxd from the host's static busybox.
pub const DEFAULT_IMAGE: &str = "sbx.local/busybox:latest";

#[derive(Debug, Clone)]
pub struct Config {
    /// Deadline of every driver call. A driver that does not answer in time is treated as
    /// unavailable for that call.
    pub driver_call_timeout: Duration,
    /// Attempts of one lifecycle step against a failing driver before the sandbox settles in
    /// `Error` with reason `DriverUnavailable`.
    pub max_driver_attempts: u32,
    /// First delay between those attempts; doubles each time, capped by `max_retry_backoff`.
    pub retry_backoff: Duration,
    pub max_retry_backoff: Duration,
    /// How sandbox actors are restarted by their workspace supervisor.
    pub sandbox_restarts: RestartPolicy,
    /// How workspace supervisors are restarted by the gateway root.
    pub workspace_restarts: RestartPolicy,
    /// How often the reconciler sweeps every driver. Zero disables the periodic sweep (tests
    /// call `Gateway::reconcile_now`).
    pub reconcile_interval: Duration,
    /// How many sandbox actors may talk to drivers at once while re-attaching at startup.
    pub attach_concurrency: usize,
    /// How long a lifecycle request waits for its sandbox's actor (including restarts).
    pub request_timeout: Duration,
    /// How long a restarted sandbox actor waits for the previous one's lease.
    pub lease_wait: Duration,
    /// Sandbox events kept for watch resumption (and as the live buffer: a watcher further
    /// behind than the history ends with "fell behind"), at most.
    pub event_history: usize,
    /// Bytes of sandbox events kept, at most: each event's encoding plus
    /// `events::EVENT_OVERHEAD` (the oldest are evicted while either bound is passed).
    pub event_history_bytes: usize,
    /// What the gateway counts for Prometheus (served by sbxd's `--metrics-listen`).
    pub metrics: Arc<crate::metrics::Metrics>,
    /// How often, and for how long, the gateway keeps usage samples of the sandboxes it
    /// serves (`crate::stats`). sbxd: every 5 s for an hour; the default here is the same.
    pub stats: StatsSettings,
    /// Events kept per sandbox (the oldest are dropped past it; 0: none kept) and in all
    /// (`crate::journal`). sbxd: 100 and 100,000; the default here is the same.
    pub events_per_sandbox: usize,
    pub events_max: usize,
    /// Grace period asked of drivers on stop (0: the driver's default).
    pub stop_grace: Duration,
    /// The image store (content) that drivers with the `images` capability run from. `None`:
    /// image calls and creates on such drivers answer `FailedPrecondition`.
    pub image_store: Option<ImageStore>,
    /// The image (a name) a sandbox on a driver with images runs when its spec names none.
    pub default_image: String,
    /// The largest file an image import accepts, in bytes.
    pub max_image_import_bytes: u64,
    /// The most a pull may take, from its first request to its record: a registry that drips
    /// (each read making progress, so no read deadline fires) is cut here.
    pub pull_timeout: Duration,
    /// Seals providers' credentials at rest. sbxd opens `DATA/secrets.key`; the default is
    /// an in-memory key (credentials do not outlive the process: for tests).
    pub secrets: Arc<Sealer>,
    /// The domain service endpoints' Hosts end in (`NAME--SANDBOX--WORKSPACE.<domain>`).
    pub service_domain: String,
    /// The cpu and memory limits a sandbox gets for each it sets neither itself nor through
    /// its workspace's default (0: none), on a driver that can apply it. sbxd's are 1 core
    /// and 1 GiB; the default here is none (tests).
    pub default_resources: sbx_proto::v1::Resources,
    /// Whether the local node (the gateway's own drivers) starts cordoned, until an operator
    /// says otherwise (`sbx node cordon|uncordon local`, kept in the store). sbxd: no.
    pub local_node_cordoned: bool,
    /// Gateways sharing one store: each serves the workspaces whose lease it holds
    /// (`crate::ownership`). `None`: this gateway serves every workspace (one gateway).
    pub ownership: Option<OwnershipSettings>,
    /// Bounds and thresholds of sandbox lifetimes (`crate::lifetime`).
    pub lifetimes: LifetimeSettings,
}

/// Bounds and thresholds of sandbox lifetimes.
#[derive(Debug, Clone, PartialEq)]
pub struct LifetimeSettings {
    /// The longest ttl, idle timeout or delete-after a sandbox may ask (sbxd `--max-ttl`,
    /// default 30 days): a longer one is refused at create, not discovered at the deadline.
    pub max_ttl: Duration,
    /// A Ready sandbox whose workload uses at least this many cores on average over its idle
    /// window is busy, not idle (sbxd `--idle-cpu`, default 0.05).
    pub idle_cpu_cores: f64,
    /// The deadline of one driver pause or resume call (each moves the workload's whole
    /// memory to or from disk): 30 minutes (a vm driver allows itself a minute and a minute per GiB).
    pub pause_timeout: Duration,
}

impl Default for LifetimeSettings {
    fn default() -> Self {
        LifetimeSettings {
            max_ttl: Duration::from_secs(30 * 24 * 3600),
            idle_cpu_cores: 0.05,
            pause_timeout: Duration::from_secs(30 * 60),
        }
    }
}

/// Who this gateway is among those sharing a store, and how long a lease lasts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnershipSettings {
    /// This gateway's id: kept across its restarts (sbxd: DATA/gateway-id), so a restarted
    /// gateway renews its own leases at once.
    pub gateway: uuid::Uuid,
    /// Where it serves its API, written into its leases.
    pub address: String,
    /// How long a lease lasts unrenewed; renewed every third of it.
    pub period: Duration,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            driver_call_timeout: Duration::from_secs(60),
            max_driver_attempts: 5,
            retry_backoff: Duration::from_millis(200),
            max_retry_backoff: Duration::from_secs(10),
            sandbox_restarts: RestartPolicy::default(),
            workspace_restarts: RestartPolicy::default(),
            reconcile_interval: Duration::from_secs(15),
            attach_concurrency: 64,
            request_timeout: Duration::from_secs(120),
            lease_wait: Duration::from_secs(5),
            event_history: 10_000,
            event_history_bytes: 64 << 20,
            metrics: Arc::default(),
            stats: StatsSettings::default(),
            events_per_sandbox: 100,
            events_max: 100_000,
            stop_grace: Duration::ZERO,
            image_store: None,
            default_image: DEFAULT_IMAGE.to_string(),
            max_image_import_bytes: 8 << 30,
            pull_timeout: Duration::from_secs(30 * 60),
            secrets: Arc::new(Sealer::ephemeral()),
            service_domain: "localhost".to_string(),
            default_resources: sbx_proto::v1::Resources::default(),
            local_node_cordoned: false,
            ownership: None,
            lifetimes: LifetimeSettings::default(),
        }
    }
}

/// The compute drivers a gateway runs sandboxes on, by name, and which one is the default.
#[derive(Clone)]
pub struct DriverSet {
    drivers: BTreeMap<String, Arc<dyn ComputeDriver>>,
    default: String,
    /// The nodes beyond the gateway's own drivers (`crate::nodes`), shared by every clone.
    nodes: Arc<Nodes>,
}

impl DriverSet {
    pub fn single(name: impl Into<String>, driver: Arc<dyn ComputeDriver>) -> Self {
        let name = name.into();
        DriverSet {
            drivers: BTreeMap::from([(name.clone(), driver)]),
            default: name,
            nodes: Arc::new(Nodes::local_only()),
        }
    }

    pub fn with(mut self, name: impl Into<String>, driver: Arc<dyn ComputeDriver>) -> Self {
        self.drivers.insert(name.into(), driver);
        self
    }

    /// This set with `nodes` (how nodes are reached and judged) in place of none.
    pub fn with_nodes(mut self, nodes: Nodes) -> Self {
        self.nodes = Arc::new(nodes);
        self
    }

    pub fn nodes(&self) -> &Arc<Nodes> {
        &self.nodes
    }

    /// Where `sandbox`'s driver calls go ([`crate::nodes::place_key`]).
    pub fn place_of(&self, sandbox: &Sandbox) -> String {
        let driver = sandbox.spec.as_ref().map_or("", |s| s.driver.as_str());
        place_key(node_id_of(sandbox), self.name_or_default(driver))
    }

    /// The driver of a place: a node's, or a local driver's by name.
    pub fn resolve_place(&self, place: &str) -> Result<Arc<dyn ComputeDriver>> {
        match node_of_place(place) {
            Some(id) => self.nodes.link_of(id).ok_or_else(|| {
                ActorError::FailedPrecondition(format!(
                    "node {id} is not registered with this gateway"
                ))
            }),
            None => self.resolve(place).map(|(_, d)| Arc::clone(d)),
        }
    }

    /// The driver `sandbox` runs on (on a node: fenced with its workspace's token while this
    /// gateway holds the workspace under one).
    pub fn for_sandbox(&self, sandbox: &Sandbox) -> Result<Arc<dyn ComputeDriver>> {
        let workspace = uuid::Uuid::parse_str(&sandbox.workspace_id).ok();
        match (node_id_of(sandbox), workspace) {
            (Some(node), Some(workspace)) => {
                self.nodes.link_for(node, workspace).ok_or_else(|| {
                    ActorError::FailedPrecondition(format!(
                        "node {node} is not registered with this gateway"
                    ))
                })
            }
            _ => self.resolve_place(&self.place_of(sandbox)),
        }
    }

    /// Every place and its driver: the local drivers by name, then each node.
    pub fn places(&self) -> Vec<(String, Arc<dyn ComputeDriver>)> {
        let mut out: Vec<_> = self
            .drivers
            .iter()
            .map(|(name, d)| (name.clone(), Arc::clone(d)))
            .collect();
        out.extend(
            self.nodes
                .drivers()
                .into_iter()
                .map(|(id, d)| (place_key(Some(id), ""), d)),
        );
        out
    }

    pub fn default_name(&self) -> &str {
        &self.default
    }

    /// The name a sandbox's driver goes by: empty (a spec that names none) means the default.
    pub fn name_or_default<'a>(&'a self, name: &'a str) -> &'a str {
        if name.is_empty() { &self.default } else { name }
    }

    /// The driver called `name` (empty: the default), and the name it goes by.
    pub fn resolve<'a>(&'a self, name: &'a str) -> Result<(&'a str, &'a Arc<dyn ComputeDriver>)> {
        let name = self.name_or_default(name);
        let driver = self.drivers.get(name).ok_or_else(|| {
            ActorError::InvalidArgument(format!(
                "unknown driver {}; this gateway has {:?}",
                crate::limits::quote(name),
                self.drivers.keys().collect::<Vec<_>>()
            ))
        })?;
        Ok((name, driver))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Arc<dyn ComputeDriver>)> {
        self.drivers.iter()
    }
}

/// How often and how long a gateway keeps samples.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StatsSettings {
    /// Between two samples of one sandbox; zero: no history is kept.
    pub interval: Duration,
    /// Samples older than this are dropped.
    pub history: Duration,
}

impl Default for StatsSettings {
    fn default() -> Self {
        StatsSettings {
            interval: Duration::from_secs(5),
            history: Duration::from_secs(3600),
        }
    }
}

impl StatsSettings {
    /// Samples kept per sandbox, at most.
    pub fn capacity(&self) -> usize {
        if self.interval.is_zero() {
            return 0;
        }
        (self.history.as_millis() / self.interval.as_millis()).max(1) as usize
    }
}

/// What every actor of one gateway shares.
pub struct Shared {
    pub store: Arc<dyn ObjectStore>,
    pub drivers: DriverSet,
    pub config: Config,
    pub events: EventHub,
    pub leases: Arc<LeaseTable>,
    /// Bounds the driver calls of actors re-attaching at startup.
    pub attach_permits: Arc<Semaphore>,
    pub startup: StartupTracker,
    /// This gateway's side of the workspace leases, when gateways share the store.
    pub ownership: Option<Arc<crate::ownership::Ownership>>,
    /// Event writes under way (`crate::journal::write`'s tasks).
    pub event_writes: std::sync::atomic::AtomicUsize,
    /// The data calls open on each sandbox: what idleness is measured against.
    pub activity: Arc<crate::lifetime::Activity>,
}
