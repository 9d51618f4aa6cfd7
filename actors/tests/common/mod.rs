//! A gateway on a temp-dir store and the sim driver, for the actor tests.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use sbx_actors::{Config, DriverSet, Gateway, RestartPolicy, SandboxSelector};
use sbx_driver_sim::{SimDriver, SimFaults, SimWorld};
use sbx_proto::v1::{Phase, Sandbox, SandboxSpec};
use sbx_storage::{ObjectStore, SledStore};
use tempfile::TempDir;
use uuid::Uuid;

pub struct Env {
    /// Keeps the store's directory alive.
    pub dir: TempDir,
    pub store: Arc<dyn ObjectStore>,
    /// The simulated machine; outlives driver instances and gateways.
    pub world: SimWorld,
    pub driver: Arc<SimDriver>,
    pub gw: Option<Gateway>,
}

pub fn test_config() -> Config {
    Config {
        driver_call_timeout: Duration::from_millis(300),
        max_driver_attempts: 4,
        retry_backoff: Duration::from_millis(10),
        max_retry_backoff: Duration::from_millis(80),
        sandbox_restarts: RestartPolicy {
            max_restarts: 5,
            window: Duration::from_secs(10),
            base_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(200),
        },
        workspace_restarts: RestartPolicy {
            max_restarts: 5,
            window: Duration::from_secs(10),
            base_backoff: Duration::from_millis(5),
            max_backoff: Duration::from_millis(200),
        },
        reconcile_interval: Duration::ZERO,
        request_timeout: Duration::from_secs(20),
        ..Config::default()
    }
}

impl Env {
    pub async fn new() -> Env {
        Env::with(test_config(), SimFaults::default()).await
    }

    pub async fn with(config: Config, faults: SimFaults) -> Env {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> =
            Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
        let world = SimWorld::new();
        let driver = Arc::new(SimDriver::new(world.clone(), faults));
        let gw = Gateway::start(
            Arc::clone(&store),
            DriverSet::single("sim", driver.clone()),
            config,
        )
        .await
        .unwrap();
        assert!(gw.wait_attached(Duration::from_secs(10)).await);
        Env {
            dir,
            store,
            world,
            driver,
            gw: Some(gw),
        }
    }

    pub fn gw(&self) -> &Gateway {
        self.gw.as_ref().unwrap()
    }

    /// A gateway restart: the actor tree and the driver instance go away; the store and the
    /// simulated machine stay. `between` runs while no gateway is up.
    pub async fn restart_gateway(&mut self, config: Config, between: impl FnOnce(&SimWorld)) {
        if let Some(gw) = self.gw.take() {
            assert!(gw.shutdown().await, "actors let go of the gateway context");
        }
        between(&self.world);
        self.driver = Arc::new(SimDriver::new(self.world.clone(), SimFaults::default()));
        let gw = Gateway::start(
            Arc::clone(&self.store),
            DriverSet::single("sim", self.driver.clone()),
            config,
        )
        .await
        .unwrap();
        assert!(
            gw.wait_attached(Duration::from_secs(10)).await,
            "sandboxes did not re-attach"
        );
        self.gw = Some(gw);
    }
}

pub fn sleep_spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "3600".into()],
        ..Default::default()
    }
}

pub fn by_id(sb: &Sandbox) -> SandboxSelector {
    SandboxSelector::Id(Uuid::parse_str(&sb.id).unwrap())
}

pub fn uuid(sb: &Sandbox) -> Uuid {
    Uuid::parse_str(&sb.id).unwrap()
}

/// Polls until the sandbox reaches `phase`; panics with its last state after `timeout`.
pub async fn wait_phase(
    gw: &Gateway,
    sel: &SandboxSelector,
    phase: Phase,
    timeout: Duration,
) -> Sandbox {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let sb = gw.get_sandbox(sel).await.unwrap();
        if sb.phase() == phase {
            return sb;
        }
        if tokio::time::Instant::now() >= deadline {
            panic!(
                "sandbox {} stayed {:?} ({}: {}), wanted {phase:?}",
                sb.name,
                sb.phase(),
                sb.reason,
                sb.message
            );
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Polls `check` until it is true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if check().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
