//! Nodes: the machines sandboxes run on, and where a new sandbox goes.
//!
//! A node is an `sbxd node` host reached through a [`NodeLink`] (the gateway dials it: TCP,
//! mutual TLS); the gateway's own in-process drivers are the node [`LOCAL`]. Each registered
//! node is a `Kind::Node` record whose id is the node's own (kept in its state dir), so a
//! machine answering at the endpoint with another id is not that node and gets no call for
//! its sandboxes. A sandbox's record holds the id of the node it was placed on (none: local);
//! every driver call for it goes there ([`Nodes::link_of`]).
//!
//! Placement ([`place`]) is a pure function of what the gateway knows of each node: the
//! drivers it has, its labels, whether it is cordoned or answering, its capacity and what the
//! sandboxes placed on it already ask for. Among the nodes with room it picks the least
//! committed: the lowest of the largest of its cpu, memory and sandbox-count fractions once
//! the new sandbox is on it (ties: fewer sandboxes, then the name). Why this rule: it fills
//! nodes evenly, so one node's loss hurts least and no node runs hot while another idles,
//! and it is deterministic (a test can predict it); with every node known to the gateway
//! there is no need to sample a few as E2B does for thousands. A placement reserves what it
//! places under the registry's lock, so concurrent creates never overcommit a node; a create
//! that fails gives its reservation back.
//!
//! Health: [`Nodes::probe_all`] (run every few seconds by the gateway) asks each node what it
//! is; a node that answered within [`NodeTiming::ready_within`] is Ready, else NotReady, and
//! once it has not answered for [`NodeTiming::grace`] its sandboxes read as `Unknown` (never
//! `Error`, never recreated elsewhere: their files are on it) until it answers again.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use async_trait::async_trait;
use sbx_driver_api::{ComputeDriver, DriverError};
use sbx_proto::v1::{Node, NodeCapacity, NodeState, Phase, Sandbox};
use uuid::Uuid;

/// The name of the gateway's own in-process drivers as a node.
pub const LOCAL: &str = "local";

/// The prefix of a node's place key ([`place_key`]).
const NODE_PLACE: &str = "node:";

/// Where a sandbox's driver calls go: `node:<id>` for a node, else the local driver's name.
pub fn place_key(node_id: Option<Uuid>, local_driver: &str) -> String {
    match node_id {
        Some(id) => format!("{NODE_PLACE}{id}"),
        None => local_driver.to_string(),
    }
}

/// The node id of a place key, `None` for a local driver.
pub fn node_of_place(place: &str) -> Option<Uuid> {
    place
        .strip_prefix(NODE_PLACE)
        .and_then(|id| Uuid::parse_str(id).ok())
}

/// What a node says of itself when asked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeReport {
    pub node_id: Uuid,
    pub name: String,
    pub drivers: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub capacity: NodeCapacity,
    /// How many sandboxes its driver lists now.
    pub sandboxes: u32,
}

/// The gateway's line to one node.
#[async_trait]
pub trait NodeLink: Send + Sync {
    /// The node's driver (every call bounded by the gateway's call timeout).
    fn driver(&self) -> Arc<dyn ComputeDriver>;
    /// The node's driver, its every call carrying `workspace`'s fencing `token` (nodes refuse
    /// a call under a token older than the newest they have seen). Unfenced by default.
    fn fenced(&self, workspace: Uuid, token: u64) -> Arc<dyn ComputeDriver> {
        let _ = (workspace, token);
        self.driver()
    }
    /// What the node says of itself.
    async fn report(&self) -> Result<NodeReport, DriverError>;
}

/// Makes the line to the node at an endpoint (HOST:PORT). Never waits: a node that does not
/// answer is found out by the first call.
pub trait NodeDialer: Send + Sync {
    fn dial(&self, endpoint: &str) -> Result<Arc<dyn NodeLink>, DriverError>;
}

/// How quickly nodes are judged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeTiming {
    /// How often every node is asked what it is.
    pub probe_every: Duration,
    /// A node that answered within this is Ready.
    pub ready_within: Duration,
    /// A node that has not answered for this long has its sandboxes read as Unknown.
    pub grace: Duration,
}

impl Default for NodeTiming {
    fn default() -> Self {
        NodeTiming {
            probe_every: Duration::from_secs(2),
            ready_within: Duration::from_secs(5),
            grace: Duration::from_secs(15),
        }
    }
}

/// What a placement asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Ask {
    /// The driver the sandbox runs on (a name every candidate must have).
    pub driver: String,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    /// `--node NAME`: only that node.
    pub node: Option<String>,
    /// Only nodes with all these labels.
    pub selector: BTreeMap<String, String>,
}

/// A node as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// `None`: local.
    pub id: Option<Uuid>,
    pub name: String,
    pub drivers: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub cordoned: bool,
    pub ready: bool,
    pub capacity: NodeCapacity,
    pub allocated: NodeCapacity,
}

fn fraction(used: u64, capacity: u64) -> f64 {
    if capacity == 0 {
        0.0
    } else {
        used as f64 / capacity as f64
    }
}

/// Why `c` cannot take `ask`, or `None` when it can.
fn unfit(c: &Candidate, ask: &Ask) -> Option<String> {
    if c.cordoned {
        return Some("cordoned".into());
    }
    if !c.ready {
        return Some("not answering".into());
    }
    if !c.drivers.contains(&ask.driver) {
        return Some(format!(
            "has no driver {:?} (has {:?})",
            ask.driver, c.drivers
        ));
    }
    if let Some((k, v)) = ask
        .selector
        .iter()
        .find(|(k, v)| c.labels.get(*k) != Some(*v))
    {
        return Some(format!("lacks the label {k}={v}"));
    }
    let cap = &c.capacity;
    let used = &c.allocated;
    if cap.cpu_millis > 0 && used.cpu_millis.saturating_add(ask.cpu_millis) > cap.cpu_millis {
        return Some(format!(
            "{}m of {}m cpu placed, the sandbox asks {}m",
            used.cpu_millis, cap.cpu_millis, ask.cpu_millis
        ));
    }
    if cap.memory_bytes > 0 && used.memory_bytes.saturating_add(ask.memory_bytes) > cap.memory_bytes
    {
        return Some(format!(
            "{} of {} bytes of memory placed, the sandbox asks {}",
            used.memory_bytes, cap.memory_bytes, ask.memory_bytes
        ));
    }
    if cap.max_sandboxes > 0 && used.max_sandboxes >= cap.max_sandboxes {
        return Some(format!("holds its most sandboxes ({})", cap.max_sandboxes));
    }
    None
}

/// How committed `c` would be with `ask` on it: its largest fraction.
fn load_after(c: &Candidate, ask: &Ask) -> f64 {
    let cap = &c.capacity;
    let used = &c.allocated;
    // Asks come from callers and may be as large as a u64 holds: sums saturate.
    fraction(
        used.cpu_millis.saturating_add(ask.cpu_millis),
        cap.cpu_millis,
    )
    .max(fraction(
        used.memory_bytes.saturating_add(ask.memory_bytes),
        cap.memory_bytes,
    ))
    .max(fraction(
        u64::from(used.max_sandboxes) + 1,
        u64::from(cap.max_sandboxes),
    ))
}

/// The node `ask` goes on (an index into `candidates`), or why none can take it: one line
/// per node considered.
pub fn place(candidates: &[Candidate], ask: &Ask) -> Result<usize, String> {
    let considered: Vec<(usize, &Candidate)> = match &ask.node {
        Some(name) => {
            let found: Vec<_> = candidates
                .iter()
                .enumerate()
                .filter(|(_, c)| c.name == *name)
                .collect();
            if found.is_empty() {
                return Err(format!("there is no node {name:?}"));
            }
            found
        }
        None => candidates.iter().enumerate().collect(),
    };
    let mut why = Vec::new();
    let mut best: Option<(usize, f64)> = None;
    for (i, c) in considered {
        if let Some(reason) = unfit(c, ask) {
            why.push(format!("{}: {reason}", c.name));
            continue;
        }
        let load = load_after(c, ask);
        let better = match best {
            None => true,
            Some((b, best_load)) => {
                let o = &candidates[b];
                (load, c.allocated.max_sandboxes, &c.name)
                    < (best_load, o.allocated.max_sandboxes, &o.name)
            }
        };
        if better {
            best = Some((i, load));
        }
    }
    match best {
        Some((i, _)) => Ok(i),
        None if why.is_empty() => Err("there is no node".into()),
        None => Err(why.join("; ")),
    }
}

/// One registered node, as the gateway holds it.
struct Entry {
    /// As stored (id, name, endpoint, labels, cordoned) plus what it last said.
    node: Node,
    link: Arc<dyn NodeLink>,
    last_ok: Option<Instant>,
    /// Why the last probe failed.
    last_error: Option<String>,
    registered: Instant,
    /// A probe of this node is under way (a node that hangs is not probed again meanwhile).
    probing: Arc<std::sync::atomic::AtomicBool>,
}

/// What the local node is.
#[derive(Debug, Clone, Default)]
struct Local {
    cordoned: bool,
    drivers: Vec<String>,
    capacity: NodeCapacity,
}

/// The nodes of a gateway, and what is placed on each.
pub struct Nodes {
    dialer: Option<Arc<dyn NodeDialer>>,
    timing: NodeTiming,
    entries: RwLock<BTreeMap<Uuid, Entry>>,
    local: RwLock<Local>,
    /// What the sandboxes on each place ask for: `None` is local.
    allocated: RwLock<HashMap<Option<Uuid>, NodeCapacity>>,
    /// The fencing token of each workspace this gateway holds or held (gateways sharing a
    /// store), and whether it holds it now: every call to a node for a sandbox of it carries
    /// the token — after the workspace was let go, the last one, which a node that saw the
    /// next holder's refuses.
    fences: RwLock<HashMap<Uuid, Fence>>,
    /// Gateways sharing a store: every call for a workspace's sandbox is fenced, with token 0
    /// for a workspace this gateway never held (refused once any holder reached the node).
    fencing: std::sync::atomic::AtomicBool,
}

#[derive(Debug, Clone, Copy)]
struct Fence {
    token: u64,
    held: bool,
    /// Held until then at most, by this process's monotonic clock: the lease's expiry less
    /// a renewal's margin, moved on at each renewal. A gateway that was paused (SIGSTOP) or
    /// starved past it acts for the workspace no more — not even for the requests it finds
    /// waiting when it runs again, before its lease loop has looked.
    until: Option<Instant>,
}

impl Fence {
    fn holds_now(&self) -> bool {
        self.held && self.until.is_none_or(|until| Instant::now() < until)
    }
}

impl std::fmt::Debug for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nodes")
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(|p| p.into_inner())
}

fn add(into: &mut NodeCapacity, cpu: u64, memory: u64, sign: i8) {
    if sign >= 0 {
        into.cpu_millis = into.cpu_millis.saturating_add(cpu);
        into.memory_bytes = into.memory_bytes.saturating_add(memory);
        into.max_sandboxes = into.max_sandboxes.saturating_add(1);
    } else {
        into.cpu_millis = into.cpu_millis.saturating_sub(cpu);
        into.memory_bytes = into.memory_bytes.saturating_sub(memory);
        into.max_sandboxes = into.max_sandboxes.saturating_sub(1);
    }
}

/// What a sandbox asks of its node: its cpu and memory limits.
pub fn asks_of(sandbox: &Sandbox) -> (u64, u64) {
    let resources = sandbox.spec.as_ref().and_then(|s| s.resources.as_ref());
    (
        resources.map_or(0, |r| u64::from(r.cpu_millis)),
        resources.map_or(0, |r| r.memory_bytes),
    )
}

/// The node id a sandbox's record holds, `None` for local (or an id that does not parse,
/// which the store never holds).
pub fn node_id_of(sandbox: &Sandbox) -> Option<Uuid> {
    if sandbox.node_id.is_empty() {
        None
    } else {
        Uuid::parse_str(&sandbox.node_id).ok()
    }
}

fn system_time(at: Instant) -> Option<sbx_proto::Timestamp> {
    let ago = at.elapsed();
    let when = SystemTime::now().checked_sub(ago)?;
    let since = when.duration_since(SystemTime::UNIX_EPOCH).ok()?;
    Some(sbx_proto::Timestamp {
        seconds: since.as_secs() as i64,
        nanos: since.subsec_nanos() as i32,
    })
}

impl Nodes {
    /// No node but local, and no way to reach one (a gateway without `sbxd node`s).
    pub fn local_only() -> Nodes {
        Nodes::new(None, NodeTiming::default())
    }

    pub fn new(dialer: Option<Arc<dyn NodeDialer>>, timing: NodeTiming) -> Nodes {
        Nodes {
            dialer,
            timing,
            entries: RwLock::new(BTreeMap::new()),
            local: RwLock::new(Local::default()),
            allocated: RwLock::new(HashMap::new()),
            fences: RwLock::new(HashMap::new()),
            fencing: std::sync::atomic::AtomicBool::new(false),
        }
    }

    pub fn timing(&self) -> NodeTiming {
        self.timing
    }

    /// Sets what the local node is: its drivers and capacity (the gateway's machine), and
    /// whether it is cordoned.
    pub fn set_local(&self, drivers: Vec<String>, capacity: NodeCapacity, cordoned: bool) {
        *write(&self.local) = Local {
            cordoned,
            drivers,
            capacity,
        };
    }

    pub fn set_local_cordoned(&self, cordoned: bool) {
        write(&self.local).cordoned = cordoned;
    }

    /// Dials the node at `endpoint`.
    pub fn dial(&self, endpoint: &str) -> Result<Arc<dyn NodeLink>, DriverError> {
        match &self.dialer {
            Some(dialer) => dialer.dial(endpoint),
            None => Err(DriverError::FailedPrecondition(
                "this gateway cannot reach nodes (it was started without node settings)".into(),
            )),
        }
    }

    /// Holds `node` (as stored) reached through `link`; `answered`: it just answered.
    pub fn insert(&self, node: Node, link: Arc<dyn NodeLink>, answered: bool) {
        let Ok(id) = Uuid::parse_str(&node.id) else {
            return;
        };
        let now = Instant::now();
        write(&self.entries).insert(
            id,
            Entry {
                node,
                link,
                last_ok: answered.then_some(now),
                last_error: None,
                registered: now,
                probing: Arc::default(),
            },
        );
    }

    /// Replaces the stored part of a held node (cordon, labels), keeping its link and health.
    pub fn update_stored(&self, node: &Node) {
        let Ok(id) = Uuid::parse_str(&node.id) else {
            return;
        };
        if let Some(entry) = write(&self.entries).get_mut(&id) {
            entry.node.name = node.name.clone();
            entry.node.labels = node.labels.clone();
            entry.node.cordoned = node.cordoned;
            entry.node.resource_version = node.resource_version;
        }
    }

    pub fn remove(&self, id: Uuid) {
        write(&self.entries).remove(&id);
        write(&self.allocated).remove(&Some(id));
    }

    /// Whether node `id` is held.
    pub fn holds(&self, id: Uuid) -> bool {
        read(&self.entries).contains_key(&id)
    }

    /// The driver of node `id`, if it is registered.
    pub fn link_of(&self, id: Uuid) -> Option<Arc<dyn ComputeDriver>> {
        read(&self.entries).get(&id).map(|e| e.link.driver())
    }

    /// The driver of node `id` for a sandbox of `workspace`. Gateways sharing a store
    /// ([`Nodes::set_fencing`]): fenced with the workspace's token — the one this gateway
    /// holds it under, or last held it under (a call that slips out after the workspace was
    /// let go is refused by a node the next holder reached), or 0 if it never held it. One
    /// gateway: unfenced.
    pub fn link_for(&self, id: Uuid, workspace: Uuid) -> Option<Arc<dyn ComputeDriver>> {
        let fencing = self.fencing.load(std::sync::atomic::Ordering::Relaxed);
        let token = read(&self.fences).get(&workspace).map(|f| f.token);
        read(&self.entries)
            .get(&id)
            .map(|e| match (fencing, token) {
                (true, token) => e.link.fenced(workspace, token.unwrap_or(0)),
                (false, Some(token)) => e.link.fenced(workspace, token),
                (false, None) => e.link.driver(),
            })
    }

    /// Gateways sharing a store: from now on every call for a workspace's sandbox is fenced.
    pub fn set_fencing(&self) {
        self.fencing
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The workspaces this gateway holds (gateways sharing a store).
    pub fn held_workspaces(&self) -> Vec<Uuid> {
        let mut held: Vec<Uuid> = read(&self.fences)
            .iter()
            .filter(|(_, f)| f.holds_now())
            .map(|(ws, _)| *ws)
            .collect();
        held.sort();
        held
    }

    /// The token under which this gateway holds `workspace`, if it does.
    pub fn fence_of(&self, workspace: Uuid) -> Option<u64> {
        read(&self.fences)
            .get(&workspace)
            .filter(|f| f.holds_now())
            .map(|f| f.token)
    }

    /// The lease of `workspace` was renewed (or taken): this gateway holds it until `until`
    /// at most (see [`Nodes::fence_of`]).
    pub fn hold_until(&self, workspace: Uuid, until: Instant) {
        if let Some(fence) = write(&self.fences).get_mut(&workspace) {
            fence.until = Some(until);
        }
    }

    /// This gateway holds `workspace` under `token` (`None`: no longer; the last token is
    /// kept for the calls that still go out).
    pub fn set_fence(&self, workspace: Uuid, token: Option<u64>) {
        match token {
            Some(token) => {
                write(&self.fences).insert(
                    workspace,
                    Fence {
                        token,
                        held: true,
                        until: None,
                    },
                );
            }
            None => {
                if let Some(fence) = write(&self.fences).get_mut(&workspace) {
                    fence.held = false;
                }
            }
        }
    }

    /// Every registered node's id and driver.
    pub fn drivers(&self) -> Vec<(Uuid, Arc<dyn ComputeDriver>)> {
        read(&self.entries)
            .iter()
            .map(|(id, e)| (*id, e.link.driver()))
            .collect()
    }

    /// The driver node `id` runs sandboxes with (its first).
    pub fn driver_of_node(&self, id: Uuid) -> Option<String> {
        read(&self.entries)
            .get(&id)
            .and_then(|e| e.node.drivers.first().cloned())
    }

    /// The name of node `id` (`local` for `None`).
    pub fn name_of(&self, id: Option<Uuid>) -> Option<String> {
        match id {
            None => Some(LOCAL.to_string()),
            Some(id) => read(&self.entries).get(&id).map(|e| e.node.name.clone()),
        }
    }

    /// Counts a sandbox on its node (at startup, for every record; at create, by `reserve`).
    pub fn count(&self, sandbox: &Sandbox) {
        let (cpu, memory) = asks_of(sandbox);
        add(
            write(&self.allocated)
                .entry(node_id_of(sandbox))
                .or_default(),
            cpu,
            memory,
            1,
        );
    }

    /// Lowers what is reserved on a node by `cpu` and `memory` (a create's limits came out
    /// below what its placement reserved), its sandbox count unchanged.
    pub fn lower(&self, node: Option<Uuid>, cpu: u64, memory: u64) {
        if let Some(used) = write(&self.allocated).get_mut(&node) {
            used.cpu_millis = used.cpu_millis.saturating_sub(cpu);
            used.memory_bytes = used.memory_bytes.saturating_sub(memory);
        }
    }

    /// Gives back what a sandbox asked of its node (deleted, or its create failed).
    pub fn release(&self, node: Option<Uuid>, cpu: u64, memory: u64) {
        if let Some(used) = write(&self.allocated).get_mut(&node) {
            add(used, cpu, memory, -1);
        }
    }

    fn ready(&self, entry: &Entry) -> bool {
        entry
            .last_ok
            .is_some_and(|at| at.elapsed() <= self.timing.ready_within)
    }

    fn silent_past_grace(&self, entry: &Entry) -> bool {
        let since = entry.last_ok.unwrap_or(entry.registered);
        since.elapsed() > self.timing.grace
    }

    fn candidates(&self) -> Vec<Candidate> {
        self.candidates_with(&read(&self.allocated))
    }

    /// Every node as placement sees it, with `allocated` (held by the caller, locked).
    fn candidates_with(&self, allocated: &HashMap<Option<Uuid>, NodeCapacity>) -> Vec<Candidate> {
        let local = read(&self.local);
        let mut out = vec![Candidate {
            id: None,
            name: LOCAL.to_string(),
            drivers: local.drivers.clone(),
            labels: BTreeMap::new(),
            cordoned: local.cordoned,
            ready: true,
            capacity: local.capacity,
            allocated: allocated.get(&None).copied().unwrap_or_default(),
        }];
        for (id, e) in read(&self.entries).iter() {
            out.push(Candidate {
                id: Some(*id),
                name: e.node.name.clone(),
                drivers: e.node.drivers.clone(),
                labels: e.node.labels.clone().into_iter().collect(),
                cordoned: e.node.cordoned,
                ready: self.ready(e),
                capacity: e.node.capacity.unwrap_or_default(),
                allocated: allocated.get(&Some(*id)).copied().unwrap_or_default(),
            });
        }
        out
    }

    /// Places `ask` and reserves it on the chosen node: its id (`None`: local) and name, or
    /// why no node can take it.
    pub fn reserve(&self, ask: &Ask) -> Result<(Option<Uuid>, String), String> {
        // One placement at a time, so two creates never both take a node's last room.
        let mut allocated = write(&self.allocated);
        let candidates = self.candidates_with(&allocated);
        let chosen = &candidates[place(&candidates, ask)?];
        add(
            allocated.entry(chosen.id).or_default(),
            ask.cpu_millis,
            ask.memory_bytes,
            1,
        );
        Ok((chosen.id, chosen.name.clone()))
    }

    /// Every node as the API shows it: local first, then by name.
    pub fn list(&self) -> Vec<Node> {
        let mut nodes: Vec<Node> = self
            .candidates()
            .into_iter()
            .map(|c| self.shown(c))
            .collect();
        nodes[1..].sort_by(|a, b| a.name.cmp(&b.name));
        nodes
    }

    fn shown(&self, c: Candidate) -> Node {
        let Some(id) = c.id else {
            return Node {
                name: LOCAL.to_string(),
                cordoned: c.cordoned,
                drivers: c.drivers,
                capacity: Some(c.capacity),
                allocated: Some(c.allocated),
                state: NodeState::Ready as i32,
                message: "the gateway's own in-process drivers".into(),
                ..Default::default()
            };
        };
        let entries = read(&self.entries);
        let Some(e) = entries.get(&id) else {
            return Node::default();
        };
        let mut node = e.node.clone();
        node.allocated = Some(c.allocated);
        node.last_seen = e.last_ok.and_then(system_time);
        if self.ready(e) {
            node.set_state(NodeState::Ready);
            node.message.clear();
        } else {
            node.set_state(NodeState::NotReady);
            node.message = match &e.last_error {
                Some(err) => format!("not answering: {err}"),
                None => "not heard from yet".into(),
            };
        }
        node
    }

    /// Asks every node what it is, at once, each bounded by `timeout`; records who answered.
    pub async fn probe_all(&self, timeout: Duration) {
        use std::sync::atomic::Ordering;
        // Nodes whose last probe is still under way are skipped: the gateway starts a round
        // every `probe_every` without waiting for the last (`api::Gateway::start`), so a node
        // that hangs until the timeout holds back neither the others' rounds nor, since each
        // answer is recorded as it comes, the freshness of their answers.
        let links: Vec<(Uuid, Arc<dyn NodeLink>, Arc<std::sync::atomic::AtomicBool>)> =
            read(&self.entries)
                .iter()
                .filter(|(_, e)| !e.probing.swap(true, Ordering::AcqRel))
                .map(|(id, e)| (*id, Arc::clone(&e.link), Arc::clone(&e.probing)))
                .collect();
        let probes = links.into_iter().map(|(id, link, probing)| async move {
            let answer = match tokio::time::timeout(timeout, link.report()).await {
                Ok(Ok(report)) if report.node_id == id => Ok(report),
                Ok(Ok(report)) => Err(format!(
                    "the machine at its endpoint is another node (id {})",
                    report.node_id
                )),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!("no answer within {timeout:?}")),
            };
            self.record_probe(id, answer);
            probing.store(false, Ordering::Release);
        });
        futures::future::join_all(probes).await;
    }

    /// Records what one probe of node `id` answered.
    fn record_probe(&self, id: Uuid, answer: std::result::Result<NodeReport, String>) {
        let mut entries = write(&self.entries);
        let Some(e) = entries.get_mut(&id) else {
            return;
        };
        match answer {
            Ok(report) => {
                if e.last_ok
                    .is_none_or(|at| at.elapsed() > self.timing.ready_within)
                {
                    tracing::info!(node = %e.node.name, "node answering");
                }
                e.last_ok = Some(Instant::now());
                e.last_error = None;
                e.node.drivers = report.drivers;
                e.node.capacity = Some(report.capacity);
            }
            Err(err) => {
                if e.last_error.is_none() {
                    tracing::warn!(node = %e.node.name, error = %err, "node not answering");
                }
                e.last_error = Some(err);
            }
        }
    }

    /// `sandbox` as it reads now: `Unknown` while its node has been silent past the grace
    /// period (its record is not changed: it is as it was once the node answers).
    pub fn present(&self, mut sandbox: Sandbox) -> Sandbox {
        let Some(id) = node_id_of(&sandbox) else {
            return sandbox;
        };
        let entries = read(&self.entries);
        if let Some(e) = entries.get(&id)
            && self.silent_past_grace(e)
            && sandbox.phase() != Phase::Deleting
        {
            let since = e.last_ok.unwrap_or(e.registered).elapsed();
            sandbox.set_phase(Phase::Unknown);
            sandbox.reason = "NodeNotAnswering".into();
            sandbox.message = format!(
                "its node {} has not answered for {}s ({}); the sandbox is left there and is \
                 as it was once the node answers",
                e.node.name,
                since.as_secs(),
                e.last_error.as_deref().unwrap_or("no answer")
            );
        }
        sandbox
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A workspace is held until its lease's deadline by this process's clock, whatever its
    /// lease loop has not looked at yet (a gateway paused past its lease acts no more), and
    /// one let go keeps its last token for the calls that still go out.
    #[test]
    fn a_hold_ends_at_its_deadline_and_the_last_token_stays() {
        let nodes = Nodes::new(None, NodeTiming::default());
        let ws = Uuid::new_v4();
        assert_eq!(nodes.fence_of(ws), None);
        nodes.set_fence(ws, Some(3));
        assert_eq!(nodes.fence_of(ws), Some(3), "no deadline yet: held");
        nodes.hold_until(ws, Instant::now() + Duration::from_millis(50));
        assert_eq!(nodes.fence_of(ws), Some(3));
        assert_eq!(nodes.held_workspaces(), vec![ws]);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(nodes.fence_of(ws), None, "past its deadline: not held");
        // Renewed: held again.
        nodes.hold_until(ws, Instant::now() + Duration::from_secs(10));
        assert_eq!(nodes.fence_of(ws), Some(3));
        nodes.set_fence(ws, None);
        assert_eq!(nodes.fence_of(ws), None);
        assert!(nodes.held_workspaces().is_empty());
        assert_eq!(
            read(&nodes.fences).get(&ws).map(|f| f.token),
            Some(3),
            "the last token is kept for the calls that still go out"
        );
    }

    fn node(name: &str, cpu: u64, memory: u64) -> Candidate {
        Candidate {
            id: Some(Uuid::new_v4()),
            name: name.into(),
            drivers: vec!["process".into()],
            labels: BTreeMap::new(),
            cordoned: false,
            ready: true,
            capacity: NodeCapacity {
                cpu_millis: cpu,
                memory_bytes: memory,
                disk_bytes: 0,
                max_sandboxes: 100,
            },
            allocated: NodeCapacity::default(),
        }
    }

    fn ask(cpu: u64, memory: u64) -> Ask {
        Ask {
            driver: "process".into(),
            cpu_millis: cpu,
            memory_bytes: memory,
            ..Default::default()
        }
    }

    #[test]
    fn placement_spreads_to_the_least_committed_node() {
        let mut nodes = vec![node("a", 4000, 8 << 30), node("b", 4000, 8 << 30)];
        let mut counts = [0u32; 2];
        for _ in 0..16 {
            let i = place(&nodes, &ask(500, 1 << 30)).unwrap();
            counts[i] += 1;
            add(&mut nodes[i].allocated, 500, 1 << 30, 1);
            // Never more than one apart.
            assert!(counts[0].abs_diff(counts[1]) <= 1, "{counts:?}");
        }
        assert_eq!(counts, [8, 8]);
        // Both are full now: the ninth is refused, every node saying why.
        let err = place(&nodes, &ask(500, 1 << 30)).unwrap_err();
        assert!(err.contains("a: 4000m of 4000m cpu placed"), "{err}");
        assert!(err.contains("b: "), "{err}");
    }

    #[test]
    fn placement_honours_cordon_readiness_drivers_labels_and_pins() {
        let mut nodes = vec![node("a", 4000, 8 << 30), node("b", 4000, 8 << 30)];
        nodes[0].cordoned = true;
        assert_eq!(place(&nodes, &ask(100, 0)), Ok(1));
        nodes[1].ready = false;
        let err = place(&nodes, &ask(100, 0)).unwrap_err();
        assert!(
            err.contains("a: cordoned") && err.contains("b: not answering"),
            "{err}"
        );
        nodes[1].ready = true;
        let mut other_driver = ask(100, 0);
        other_driver.driver = "vm".into();
        assert!(
            place(&nodes, &other_driver)
                .unwrap_err()
                .contains("has no driver")
        );
        nodes[0].cordoned = false;
        nodes[0].labels.insert("zone".into(), "x".into());
        let mut selected = ask(100, 0);
        selected.selector.insert("zone".into(), "x".into());
        assert_eq!(place(&nodes, &selected), Ok(0));
        let mut pinned = ask(100, 0);
        pinned.node = Some("b".into());
        assert_eq!(place(&nodes, &pinned), Ok(1));
        pinned.node = Some("c".into());
        assert!(
            place(&nodes, &pinned)
                .unwrap_err()
                .contains("no node \"c\"")
        );
    }

    #[test]
    fn unlimited_capacity_counts_as_room_and_ties_go_by_count_then_name() {
        let mut nodes = vec![node("b", 0, 0), node("a", 0, 0)];
        nodes[0].capacity.max_sandboxes = 0;
        nodes[1].capacity.max_sandboxes = 0;
        assert_eq!(place(&nodes, &ask(1_000_000, 1 << 40)), Ok(1), "a before b");
        nodes[1].allocated.max_sandboxes = 1;
        assert_eq!(place(&nodes, &ask(1, 1)), Ok(0), "fewer sandboxes first");
    }

    /// An ask as large as a u64 holds, on a node that already holds something, is refused
    /// where capacity is bounded and placed where it is not, and counting it adds no panic
    /// (the fuzz test found the sums overflowing).
    #[test]
    fn asks_as_large_as_a_u64_are_refused_or_placed_without_overflow() {
        let mut nodes = vec![node("a", 4000, 8 << 30)];
        nodes[0].allocated.cpu_millis = 100;
        nodes[0].allocated.memory_bytes = 1 << 30;
        let err = place(&nodes, &ask(0, u64::MAX)).unwrap_err();
        assert!(err.contains("bytes of memory placed"), "{err}");
        let err = place(&nodes, &ask(u64::MAX, 0)).unwrap_err();
        assert!(err.contains("cpu placed"), "{err}");
        let mut unbounded = vec![node("b", 0, 0)];
        unbounded[0].allocated.memory_bytes = 1 << 30;
        unbounded[0].allocated.cpu_millis = 5;
        assert_eq!(place(&unbounded, &ask(u64::MAX, u64::MAX)), Ok(0));
        add(&mut unbounded[0].allocated, u64::MAX, u64::MAX, 1);
        assert_eq!(unbounded[0].allocated.memory_bytes, u64::MAX);
        assert_eq!(place(&unbounded, &ask(1, 1)), Ok(0));
    }
}
