//! Gateways sharing one store, in process: five gateways spread the workspaces between them
//! (none holds more than its share of their leases, every workspace is exactly one gateway's), and when one
//! dies without a word (its lease loop stops, nothing released) the others take its
//! workspaces over within the lease period and spread them again.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::test_config;
use sbx_actors::{Config, DriverSet, Gateway, OwnershipSettings};
use sbx_driver_sim::{SimDriver, SimFaults, SimWorld};
use sbx_storage::{ObjectStore, SledStore};
use uuid::Uuid;

const LEASE: Duration = Duration::from_millis(1500);

/// Workspaces made: a CI profile by default, the 1,000 with `SBX_HA_WORKSPACES`.
fn workspaces() -> usize {
    std::env::var("SBX_HA_WORKSPACES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

async fn gateway(store: &Arc<dyn ObjectStore>, i: usize, lease: Duration) -> Gateway {
    let config = Config {
        ownership: Some(OwnershipSettings {
            gateway: Uuid::new_v4(),
            address: format!("gateway-{i}"),
            period: lease,
        }),
        ..test_config()
    };
    let driver = Arc::new(SimDriver::new(SimWorld::new(), SimFaults::default()));
    Gateway::start(Arc::clone(store), DriverSet::single("sim", driver), config)
        .await
        .unwrap()
}

/// Who holds what, once every workspace is held by exactly one gateway and none holds more than
/// its share (the workspaces divided by the gateways, rounded up); `None` until then.
fn spread(gateways: &[&Gateway], total: usize) -> Option<Vec<usize>> {
    let mut holders: BTreeMap<Uuid, usize> = BTreeMap::new();
    let mut counts = Vec::new();
    for gw in gateways {
        let held = gw.held_workspaces();
        counts.push(held.len());
        for ws in held {
            *holders.entry(ws).or_default() += 1;
        }
    }
    let max = *counts.iter().max()?;
    let share = total.div_ceil(gateways.len());
    (holders.len() == total && holders.values().all(|n| *n == 1) && max <= share).then_some(counts)
}

async fn until_spread(gateways: &[&Gateway], total: usize, within: Duration) -> Vec<usize> {
    let began = Instant::now();
    loop {
        if let Some(counts) = spread(gateways, total) {
            return counts;
        }
        assert!(
            began.elapsed() < within,
            "not spread after {within:?}: {:?}",
            gateways
                .iter()
                .map(|g| g.held_workspaces().len())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_gateways_spread_the_workspaces_and_take_over_a_dead_ones() {
    let n = workspaces();
    let lease = if n > 100 {
        Duration::from_secs(10)
    } else {
        LEASE
    };
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
    let mut gws = Vec::new();
    for i in 0..5 {
        gws.push(gateway(&store, i, lease).await);
    }
    for w in 0..n {
        gws[w % 5]
            .create_workspace(&format!("w{w}"), Default::default())
            .await
            .unwrap();
    }
    // And `default`.
    let total = n + 1;
    let all: Vec<&Gateway> = gws.iter().collect();
    let counts = until_spread(&all, total, lease * 10).await;
    eprintln!("{total} workspaces over 5 gateways: {counts:?}");

    // One dies: its leases run out, the others take them over and spread them.
    let dead = gws.remove(0);
    let held_by_dead = dead.held_workspaces().len();
    let killed = Instant::now();
    assert!(dead.shutdown().await);
    let rest: Vec<&Gateway> = gws.iter().collect();
    let counts = until_spread(&rest, total, lease * 10).await;
    let took = killed.elapsed();
    eprintln!(
        "{held_by_dead} workspaces of the dead gateway moved in {took:?} (lease {lease:?}); now \
         {counts:?}"
    );
    assert!(took < lease * 3, "took {took:?}");
    for gw in gws {
        assert!(gw.shutdown().await);
    }
}
