//! Nodes, in process: simulated nodes (each a sim driver and a world of its own behind a
//! `NodeLink`), a gateway that places sandboxes on them, sends every call for a sandbox to its
//! node, shows a silent node's sandboxes as Unknown (and as they were once it answers), keeps
//! what it placed across a restart, and refuses what would lose a sandbox.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use common::{sleep_spec, test_config};
use futures::StreamExt;
use sbx_actors::nodes::{NodeDialer, NodeLink, NodeReport, NodeTiming, Nodes};
use sbx_actors::{ActorError, Config, DriverSet, Gateway, NodeSelector, SandboxSelector};
use sbx_driver_api::{ComputeDriver, DriverError};
use sbx_driver_sim::{SimDriver, SimFaults, SimWorld};
use sbx_proto::v1::{NodeCapacity, NodeState, Phase, Resources};
use sbx_storage::{ObjectStore, SledStore};
use uuid::Uuid;

/// One simulated machine: its id, its driver and a switch that makes it go silent.
struct SimNode {
    id: Uuid,
    world: SimWorld,
    driver: Arc<SimDriver>,
    silent: Arc<AtomicBool>,
    /// Hangs instead: its report never comes (a machine paused, a network that drops).
    hung: Arc<AtomicBool>,
    capacity: NodeCapacity,
}

struct SimLink {
    node: Arc<SimNode>,
}

#[async_trait]
impl NodeLink for SimLink {
    fn driver(&self) -> Arc<dyn ComputeDriver> {
        self.node.driver.clone()
    }

    async fn report(&self) -> Result<NodeReport, DriverError> {
        if self.node.hung.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        if self.node.silent.load(Ordering::SeqCst) {
            return Err(DriverError::Unavailable(
                "the simulated node is down".into(),
            ));
        }
        Ok(NodeReport {
            node_id: self.node.id,
            name: String::new(),
            drivers: vec!["sim".into()],
            labels: BTreeMap::new(),
            capacity: self.node.capacity,
            sandboxes: self.node.world.running_ids().len() as u32,
        })
    }
}

/// Nodes by endpoint (`sim-N`).
#[derive(Clone, Default)]
struct SimDialer {
    nodes: Arc<Mutex<HashMap<String, Arc<SimNode>>>>,
}

impl SimDialer {
    fn add(&self, endpoint: &str, capacity: NodeCapacity) -> Arc<SimNode> {
        let world = SimWorld::new();
        let driver = Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
        let node = Arc::new(SimNode {
            id: Uuid::new_v4(),
            world,
            driver,
            silent: Arc::new(AtomicBool::new(false)),
            hung: Arc::new(AtomicBool::new(false)),
            capacity,
        });
        self.nodes
            .lock()
            .unwrap()
            .insert(endpoint.to_string(), Arc::clone(&node));
        node
    }
}

impl NodeDialer for SimDialer {
    fn dial(&self, endpoint: &str) -> Result<Arc<dyn NodeLink>, DriverError> {
        let node = self.nodes.lock().unwrap().get(endpoint).cloned();
        match node {
            Some(node) => Ok(Arc::new(SimLink { node })),
            None => Err(DriverError::Unavailable(format!("nothing at {endpoint}"))),
        }
    }
}

fn timing() -> NodeTiming {
    NodeTiming {
        probe_every: Duration::from_millis(50),
        ready_within: Duration::from_millis(400),
        grace: Duration::from_millis(800),
    }
}

fn capacity(cpu_millis: u64, sandboxes: u32) -> NodeCapacity {
    NodeCapacity {
        cpu_millis,
        memory_bytes: 64 << 30,
        disk_bytes: 0,
        max_sandboxes: sandboxes,
    }
}

struct Cluster {
    _dir: tempfile::TempDir,
    store: Arc<dyn ObjectStore>,
    dialer: SimDialer,
    local: Arc<SimDriver>,
    gw: Option<Gateway>,
    timing: NodeTiming,
}

impl Cluster {
    async fn new() -> Cluster {
        Cluster::with_timing(timing()).await
    }

    async fn with_timing(timing: NodeTiming) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn ObjectStore> =
            Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
        let mut cluster = Cluster {
            _dir: dir,
            store,
            dialer: SimDialer::default(),
            local: Arc::new(SimDriver::new(SimWorld::new(), SimFaults::default())),
            gw: None,
            timing,
        };
        cluster.start().await;
        cluster
    }

    fn config() -> Config {
        Config {
            local_node_cordoned: true,
            ..test_config()
        }
    }

    async fn start(&mut self) {
        let nodes = Nodes::new(Some(Arc::new(self.dialer.clone())), self.timing);
        let drivers = DriverSet::single("sim", self.local.clone()).with_nodes(nodes);
        let gw = Gateway::start(Arc::clone(&self.store), drivers, Cluster::config())
            .await
            .unwrap();
        assert!(gw.wait_attached(Duration::from_secs(10)).await);
        self.gw = Some(gw);
    }

    async fn restart(&mut self) {
        let gw = self.gw.take().unwrap();
        assert!(gw.shutdown().await);
        self.start().await;
    }

    fn gw(&self) -> &Gateway {
        self.gw.as_ref().unwrap()
    }
}

async fn ready(gw: &Gateway, id: Uuid) -> sbx_proto::v1::Sandbox {
    for _ in 0..400 {
        let sb = gw.get_sandbox(&SandboxSelector::Id(id)).await.unwrap();
        if sb.phase() == Phase::Ready {
            return sb;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("sandbox {id} never became Ready");
}

async fn phase_becomes(gw: &Gateway, id: Uuid, phase: Phase, within: Duration) {
    let began = std::time::Instant::now();
    loop {
        let sb = gw.get_sandbox(&SandboxSelector::Id(id)).await.unwrap();
        if sb.phase() == phase {
            return;
        }
        assert!(
            began.elapsed() < within,
            "{id} is {:?} ({}), not {phase:?}, after {within:?}",
            sb.phase(),
            sb.message
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_spread_over_nodes_and_every_call_goes_to_their_node() {
    let mut c = Cluster::new().await;
    let a = c.dialer.add("sim-a", capacity(8000, 100));
    let b = c.dialer.add("sim-b", capacity(8000, 100));
    let gw = c.gw();
    let added = gw.add_node("a", "sim-a", BTreeMap::new()).await.unwrap();
    assert_eq!(added.id, a.id.to_string());
    assert_eq!(added.state(), NodeState::Ready);
    gw.add_node("b", "sim-b", [("zone".into(), "z1".into())].into())
        .await
        .unwrap();
    let mut on = HashMap::<String, Vec<Uuid>>::new();
    for i in 0..20 {
        let mut s = sleep_spec();
        s.resources = Some(Resources {
            cpu_millis: 250,
            ..Default::default()
        });
        let sb = gw
            .create_sandbox(None, &format!("sb-{i}"), s)
            .await
            .unwrap();
        let id = Uuid::parse_str(&sb.id).unwrap();
        assert_eq!(
            sb.node_id,
            if sb.node == "a" { a.id } else { b.id }.to_string()
        );
        on.entry(sb.node.clone()).or_default().push(id);
    }
    assert_eq!(on["a"].len(), 10, "{on:?}");
    assert_eq!(on["b"].len(), 10, "{on:?}");
    for (node, world) in [("a", &a.world), ("b", &b.world)] {
        for id in &on[node] {
            ready(gw, *id).await;
        }
        let mut running = world.running_ids();
        running.sort();
        let mut want = on[node].clone();
        want.sort();
        assert_eq!(running, want, "node {node} runs exactly its own sandboxes");
    }
    assert!(
        c.local.world().running_ids().is_empty(),
        "the cordoned local node got none"
    );
    // Stop goes to the sandbox's node only.
    let one = on["a"][0];
    gw.stop_sandbox(&SandboxSelector::Id(one)).await.unwrap();
    phase_becomes(gw, one, Phase::Stopped, Duration::from_secs(5)).await;
    assert!(!a.world.running_ids().contains(&one));
    assert_eq!(b.world.running_ids().len(), 10);
    // Allocations: 10 × 250m on each, one fewer once deleted.
    let listed = gw.list_nodes();
    assert_eq!(listed[0].name, "local");
    let node_a = listed.iter().find(|n| n.name == "a").unwrap();
    assert_eq!(node_a.allocated.unwrap().cpu_millis, 2500);
    assert!(gw.delete_sandbox(&SandboxSelector::Id(one)).await.unwrap());
    let node_a = gw.get_node(&NodeSelector::Name("a".into())).unwrap();
    assert_eq!(node_a.allocated.unwrap().cpu_millis, 2250);
    assert_eq!(node_a.allocated.unwrap().max_sandboxes, 9);

    // A selector and a pin.
    let mut s = sleep_spec();
    s.node_selector.insert("zone".into(), "z1".into());
    let sb = gw.create_sandbox(None, "zoned", s).await.unwrap();
    assert_eq!(sb.node, "b");
    let mut s = sleep_spec();
    s.node = "a".into();
    let sb = gw.create_sandbox(None, "pinned", s).await.unwrap();
    assert_eq!(sb.node, "a");

    // After a restart every sandbox is still on its node, and the allocations are recounted.
    c.restart().await;
    let gw = c.gw();
    let node_b = gw.get_node(&NodeSelector::Name("b".into())).unwrap();
    assert_eq!(node_b.allocated.unwrap().max_sandboxes, 11);
    for id in &on["b"] {
        let sb = ready(gw, *id).await;
        assert_eq!(sb.node_id, b.id.to_string());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_nodes_sandboxes_are_unknown_and_come_back_as_they_were() {
    let c = Cluster::new().await;
    let a = c.dialer.add("sim-a", capacity(8000, 100));
    let b = c.dialer.add("sim-b", capacity(8000, 100));
    let gw = c.gw();
    gw.add_node("a", "sim-a", BTreeMap::new()).await.unwrap();
    gw.add_node("b", "sim-b", BTreeMap::new()).await.unwrap();
    let mut ids = Vec::new();
    for i in 0..4 {
        let sb = gw
            .create_sandbox(None, &format!("sb-{i}"), sleep_spec())
            .await
            .unwrap();
        ids.push((Uuid::parse_str(&sb.id).unwrap(), sb.node.clone()));
    }
    for (id, _) in &ids {
        ready(gw, *id).await;
    }
    // Down: it answers nothing, its driver included.
    a.silent.store(true, Ordering::SeqCst);
    a.driver.fail_all(true);
    // A reconciler sweep meanwhile neither loses nor recreates anything.
    let report = gw.reconcile_now().await.unwrap();
    assert!(!report.driver_errors.is_empty(), "{report:?}");
    let generations: HashMap<Uuid, u64> = a
        .world
        .running_ids()
        .into_iter()
        .map(|id| (id, a.world.snapshot(id).unwrap().generation))
        .collect();
    for (id, node) in &ids {
        if node == "a" {
            phase_becomes(gw, *id, Phase::Unknown, Duration::from_secs(3)).await;
            let sb = gw.get_sandbox(&SandboxSelector::Id(*id)).await.unwrap();
            assert_eq!(sb.reason, "NodeNotAnswering");
            assert!(sb.message.contains("node a"), "{}", sb.message);
        } else {
            let sb = gw.get_sandbox(&SandboxSelector::Id(*id)).await.unwrap();
            assert_eq!(sb.phase(), Phase::Ready, "the other node's are untouched");
        }
    }
    let node_a = gw.get_node(&NodeSelector::Name("a".into())).unwrap();
    assert_eq!(node_a.state(), NodeState::NotReady);
    // A silent node gets nothing new.
    for i in 0..3 {
        let sb = gw
            .create_sandbox(None, &format!("new-{i}"), sleep_spec())
            .await
            .unwrap();
        assert_eq!(sb.node, "b");
    }
    a.silent.store(false, Ordering::SeqCst);
    a.driver.fail_all(false);
    for (id, node) in &ids {
        if node == "a" {
            phase_becomes(gw, *id, Phase::Ready, Duration::from_secs(3)).await;
            let snapshot = a.world.snapshot(*id).unwrap();
            assert_eq!(snapshot.generation, generations[id], "the same workload");
        }
    }
    assert_eq!(b.world.running_ids().len(), 2 + 3);
}

/// A node that hangs (its probe never answers, past the probe's timeout) does not make the
/// others look silent: each answer is recorded as it comes and the next round does not wait
/// for the hung probe, so a healthy node stays Ready throughout — here with a probe timeout
/// (twice the probe period) longer than the readiness window, where waiting for the slowest
/// probe would age the healthy node's answer past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_node_does_not_make_the_others_look_silent() {
    let c = Cluster::with_timing(NodeTiming {
        probe_every: Duration::from_millis(300),
        ready_within: Duration::from_millis(450),
        grace: Duration::from_millis(900),
    })
    .await;
    let a = c.dialer.add("sim-a", capacity(8000, 100));
    c.dialer.add("sim-b", capacity(8000, 100));
    let gw = c.gw();
    gw.add_node("a", "sim-a", BTreeMap::new()).await.unwrap();
    gw.add_node("b", "sim-b", BTreeMap::new()).await.unwrap();
    a.hung.store(true, Ordering::SeqCst);
    let began = std::time::Instant::now();
    let mut a_not_ready = false;
    while began.elapsed() < Duration::from_secs(4) {
        let b = gw.get_node(&NodeSelector::Name("b".into())).unwrap();
        assert_eq!(
            b.state(),
            NodeState::Ready,
            "b looked silent {:?} after a hung: {}",
            began.elapsed(),
            b.message
        );
        a_not_ready |= gw
            .get_node(&NodeSelector::Name("a".into()))
            .unwrap()
            .state()
            == NodeState::NotReady;
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(a_not_ready, "the hung node was never NotReady");
    a.hung.store(false, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_refusals_cordon_drain_and_remove() {
    let c = Cluster::new().await;
    let a = c.dialer.add("sim-a", capacity(1000, 100));
    let gw = c.gw();
    // Nothing at the endpoint: refused, nothing registered.
    let err = gw
        .add_node("ghost", "sim-ghost", BTreeMap::new())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            ActorError::InvalidArgument(_) | ActorError::Unavailable(_)
        ),
        "{err:?}"
    );
    assert!(gw.get_node(&NodeSelector::Name("ghost".into())).is_err());
    let err = gw
        .add_node("local", "sim-a", BTreeMap::new())
        .await
        .unwrap_err();
    assert!(matches!(err, ActorError::InvalidArgument(_)), "{err:?}");
    gw.add_node("a", "sim-a", BTreeMap::new()).await.unwrap();
    // The same machine under a second name: refused.
    let err = gw
        .add_node("a2", "sim-a", BTreeMap::new())
        .await
        .unwrap_err();
    assert!(err.to_string().contains("registered already"), "{err}");

    // No room: every node says why.
    let mut big = sleep_spec();
    big.resources = Some(Resources {
        cpu_millis: 1500,
        ..Default::default()
    });
    let err = gw.create_sandbox(None, "big", big).await.unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ActorError::NoNodeFits(_)), "{err:?}");
    assert!(text.contains("local: cordoned"), "{text}");
    assert!(text.contains("a: 0m of 1000m cpu placed"), "{text}");

    let mut small = sleep_spec();
    small.resources = Some(Resources {
        cpu_millis: 600,
        ..Default::default()
    });
    let sb = gw
        .create_sandbox(None, "small", small.clone())
        .await
        .unwrap();
    let id = Uuid::parse_str(&sb.id).unwrap();
    ready(gw, id).await;
    // 600 + 600 > 1000: the second does not fit, and its failed create reserved nothing.
    assert!(
        gw.create_sandbox(None, "small-2", small.clone())
            .await
            .is_err()
    );
    let node_a = gw.get_node(&NodeSelector::Name("a".into())).unwrap();
    assert_eq!(node_a.allocated.unwrap().cpu_millis, 600);

    // Uncordoning local makes room there.
    gw.cordon_node(&NodeSelector::Name("local".into()), false)
        .await
        .unwrap();
    let sb2 = gw.create_sandbox(None, "small-2", small).await.unwrap();
    assert_eq!(sb2.node, "local");
    assert_eq!(sb2.node_id, "");

    // A node that holds a sandbox is not removed.
    let err = gw
        .remove_node(&NodeSelector::Name("a".into()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("holds 1 sandbox"), "{err}");
    // Drain: cordoned, its sandbox stopped.
    let (node, stopped, _) = gw
        .drain_node(&NodeSelector::Name("a".into()), true)
        .await
        .unwrap();
    assert!(node.cordoned);
    assert_eq!(stopped, 1);
    phase_becomes(gw, id, Phase::Stopped, Duration::from_secs(5)).await;
    assert!(a.world.running_ids().is_empty());
    assert!(gw.delete_sandbox(&SandboxSelector::Id(id)).await.unwrap());
    assert!(
        gw.remove_node(&NodeSelector::Name("a".into()))
            .await
            .unwrap()
    );
    assert!(gw.get_node(&NodeSelector::Name("a".into())).is_err());
}

/// How many sandboxes the simulation places: a CI profile by default, the 100,000 with
/// `SBX_SIM_SANDBOXES=100000` (release: `cargo test --release -p sbx-actors --test nodes
/// fifty -- --nocapture`).
fn simulated_sandboxes() -> usize {
    std::env::var("SBX_SIM_SANDBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2_000)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_simulated_nodes_take_sandboxes_within_their_capacity_and_evenly() {
    const NODES: usize = 50;
    let total = simulated_sandboxes();
    let c = Cluster::new().await;
    let gw = c.gw();
    // Nodes of four sizes; together room for about 1.25× what is asked.
    let asks = [250u32, 500, 1000, 2000];
    let mean_ask = asks.iter().map(|a| u64::from(*a)).sum::<u64>() / asks.len() as u64;
    let room = (total as u64 * mean_ask) * 5 / 4;
    let weights = [1u64, 2, 3, 4];
    let weight_sum: u64 = (0..NODES).map(|i| weights[i % 4]).sum();
    let mut capacity_of = HashMap::new();
    for i in 0..NODES {
        let cpu = room * weights[i % 4] / weight_sum;
        let node = c.dialer.add(&format!("sim-{i}"), capacity(cpu, u32::MAX));
        gw.add_node(&format!("n{i}"), &format!("sim-{i}"), BTreeMap::new())
            .await
            .unwrap();
        capacity_of.insert(node.id.to_string(), cpu);
    }
    let began = std::time::Instant::now();
    let mut placed: HashMap<String, u64> = HashMap::new();
    let workspaces = 20;
    for w in 0..workspaces {
        gw.create_workspace(&format!("w{w}"), Default::default())
            .await
            .unwrap();
    }
    let creates = futures::stream::iter(0..total)
        .map(|i| async move {
            let mut s = sleep_spec();
            let cpu = asks[i % asks.len()];
            s.resources = Some(Resources {
                cpu_millis: cpu,
                ..Default::default()
            });
            let ws = format!("w{}", i % 20);
            let sb = gw
                .create_sandbox(Some(&ws), &format!("s{i}"), s)
                .await
                .unwrap_or_else(|e| panic!("create s{i}: {e}"));
            (sb.node_id, u64::from(cpu))
        })
        .buffer_unordered(32)
        .collect::<Vec<_>>()
        .await;
    let took = began.elapsed();
    for (node, cpu) in creates {
        *placed.entry(node).or_default() += cpu;
    }
    // Within every node's capacity, as the gateway counts it and as the records say.
    let mut fractions = Vec::new();
    for node in gw.list_nodes().into_iter().skip(1) {
        let cap = capacity_of[&node.id];
        let used = placed.get(&node.id).copied().unwrap_or(0);
        assert!(used <= cap, "node {} holds {used}m of {cap}m", node.name);
        assert_eq!(
            node.allocated.unwrap().cpu_millis,
            used,
            "node {}",
            node.name
        );
        fractions.push(used as f64 / cap as f64);
    }
    let mean = fractions.iter().sum::<f64>() / fractions.len() as f64;
    let max = fractions.iter().copied().fold(0.0, f64::max);
    let min = fractions.iter().copied().fold(1.0, f64::min);
    println!(
        "{total} sandboxes on {NODES} simulated nodes in {took:?} ({:.0}/s): load (cpu placed / \
         capacity) mean {mean:.3}, max {max:.3}, min {min:.3}, max/mean {:.3}",
        total as f64 / took.as_secs_f64(),
        max / mean
    );
    assert!(max / mean < 1.05, "uneven: max {max:.3}, mean {mean:.3}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_registered_cordoned_or_removed_through_one_gateway_is_seen_by_another() {
    let c = Cluster::new().await;
    let nodes = Nodes::new(Some(Arc::new(c.dialer.clone())), timing());
    let other = Gateway::start(
        Arc::clone(&c.store),
        DriverSet::single("sim", c.local.clone()).with_nodes(nodes),
        Cluster::config(),
    )
    .await
    .unwrap();
    c.dialer.add("sim-a", capacity(8000, 100));
    c.gw()
        .add_node("a", "sim-a", BTreeMap::new())
        .await
        .unwrap();
    let seen = |want: Option<bool>| {
        let other = &other;
        async move {
            for _ in 0..200 {
                let node = other.get_node(&NodeSelector::Name("a".into())).ok();
                if node.map(|n| n.cordoned) == want {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("the other gateway never saw node a as {want:?}");
        }
    };
    seen(Some(false)).await;
    c.gw()
        .cordon_node(&NodeSelector::Name("a".into()), true)
        .await
        .unwrap();
    seen(Some(true)).await;
    assert!(
        c.gw()
            .remove_node(&NodeSelector::Name("a".into()))
            .await
            .unwrap()
    );
    seen(None).await;
    assert!(other.shutdown().await);
}
