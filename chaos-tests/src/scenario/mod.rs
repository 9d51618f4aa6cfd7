//! The in-process chaos scenario: concurrent clients doing random lifecycle operations across
//! workspaces that reuse the same sandbox names, while faults are injected (actor and
//! supervisor kills, gateway restarts, sim-driver latency, errors, hangs, lost replies, lost
//! state and forgotten generations, workloads exiting by themselves); then quiesce and check
//! the invariants — on the records, on the driver calls and on what the simulated machine
//! really did (see `removals.rs`). Everything is drawn from one seed; a failure names it,
//! keeps the round's directory and writes its journal there, which `replay` runs again
//! (`journal.rs` says what a replay reproduces and what it does not).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sbx_actors::{
    ActorError, Config, DriverSet, Gateway, LifetimeSettings, RestartPolicy, SandboxSelector,
    WorkspaceSelector,
};
use sbx_drivers::sim::{SimDriver, SimFaultHandle, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, pb};
use sbx_proto::v1::{DesiredState, Lifetime, LifetimeAction, Phase, Sandbox, SandboxSpec};
use sbx_storage::{Kind, ListQuery, ObjectStore, Scope, SledStore};
use serde::{Deserialize, Serialize};
use tokio::sync::RwLock;
use uuid::Uuid;

use crate::recording::{Destructive, Recording, RecordingDriver};
use crate::removals::{RemovalObserver, unasked_removals};
use crate::rng::Rng;

mod faults;
mod invariants;
pub mod journal;

use faults::Fault;
use faults::inject_faults;
use invariants::{check_invariants, quiesce};
use journal::{Entry, Journal};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChaosConfig {
    pub seed: u64,
    pub workspaces: usize,
    /// Sandbox names per workspace; the same names are used in every workspace.
    pub names: usize,
    pub clients: usize,
    /// Clients keep going until this much time has passed…
    pub duration: Duration,
    /// …or they have done this many operations each.
    pub max_ops_per_client: usize,
    /// Inject faults at all (off: a control run that checks the checks).
    pub faults: bool,
    pub gateway_restarts: bool,
    /// Some creates give their sandbox a ttl (off: every answer follows from the operations
    /// alone, not from the clock — what a replay that must give the same answers needs).
    #[serde(default = "on")]
    pub ttls: bool,
    /// Write the round's journal here whatever its outcome (a failing round writes it into
    /// its kept directory anyway).
    #[serde(skip)]
    pub journal: Option<PathBuf>,
}

impl ChaosConfig {
    pub fn ci(seed: u64) -> Self {
        ChaosConfig {
            seed,
            workspaces: 3,
            names: 3,
            clients: 4,
            duration: Duration::from_secs(4),
            max_ops_per_client: 5_000,
            faults: true,
            gateway_restarts: true,
            ttls: true,
            journal: None,
        }
    }
}

fn on() -> bool {
    true
}

/// What a run did, for the closing note of a soak.
#[derive(Debug, Clone, Default)]
pub struct ChaosReport {
    pub seed: u64,
    pub ops: u64,
    pub ops_acknowledged: u64,
    /// Operations refused as `Unavailable` (expected only while faults are injected).
    pub ops_unavailable: u64,
    /// What the first few of those refusals said (a report that counts one says why).
    pub unavailable_said: Vec<String>,
    pub creates_acknowledged: u64,
    pub deletes_acknowledged: u64,
    /// Provider, attachment, setting and service-endpoint operations acknowledged.
    pub owned_acknowledged: u64,
    pub faults: BTreeMap<&'static str, u64>,
    pub gateway_restarts: u64,
    /// Destructive driver calls whose target could not be placed (no record of its create).
    pub unverified_calls: u64,
    /// Workloads the simulated machine removed, each matched to a delete naming its id.
    pub removals_checked: u64,
    /// Times the removal observer fell behind the world's watch buffer (removals among the
    /// missed events went unchecked).
    pub removal_observer_lagged: u64,
    pub invariant_checks: u64,
    /// Creates that gave a ttl, and driver stops and deletes only a due ttl explained (each
    /// checked to come at or after the earliest its deadline could be).
    pub ttls_given: u64,
    pub calls_by_ttl: u64,
    /// Pauses and resumes acknowledged; Paused records checked against the driver's saved
    /// workload (a paused sandbox is never lost).
    pub pauses_acknowledged: u64,
    pub resumes_acknowledged: u64,
    pub paused_checked: u64,
}

/// What clients asked for and what was acknowledged.
#[derive(Default)]
struct Ledger {
    /// id → (workspace, name) of every acknowledged create.
    created: HashMap<Uuid, (String, String)>,
    deleted_ids: HashSet<Uuid>,
    /// Every stop, restart and delete a client sent, with when, on the driver's call clock.
    requests: Vec<Request>,
    /// The stops and deletes ttls asked for (at create), each not before its deadline.
    ttls: Vec<TtlAsk>,
}

/// A ttl a create gave its sandbox: the driver may stop or delete that sandbox by itself, but
/// never before the deadline (which is no earlier than the create's sending plus the ttl).
#[derive(Debug, Clone)]
struct TtlAsk {
    op: Destructive,
    /// By id when the create was acknowledged; by name when not (the sandbox may exist).
    target: Target,
    not_before: std::time::SystemTime,
}

/// A request that may legitimately make the driver stop or delete a sandbox.
#[derive(Debug, Clone)]
struct Request {
    /// Delete for deletes (of a sandbox or a whole workspace); Stop for stops and restarts.
    op: Destructive,
    target: Target,
    /// The driver's call clock when the request was sent and when it was answered; a request
    /// that was not acknowledged may still take effect later (its intent is persisted), so
    /// its `answered` is `u64::MAX`.
    sent: u64,
    answered: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Target {
    Id(Uuid),
    Name(String, String),
    Workspace(String),
}

impl Ledger {
    /// Whether some request could have made the driver `op` sandbox `id` (placed at
    /// `workspace/name` by a create numbered `created_at`) with the call numbered `seq`: it
    /// named that sandbox, by id, by name or by its workspace; it was sent before the call; and
    /// (for names) it was still unanswered when that sandbox existed.
    fn explains(
        &self,
        op: Destructive,
        id: Uuid,
        workspace: &str,
        name: &str,
        created_at: u64,
        seq: u64,
    ) -> bool {
        self.requests.iter().any(|r| {
            r.op == op
                && r.sent < seq
                && match &r.target {
                    Target::Id(target) => *target == id,
                    Target::Name(ws, n) => ws == workspace && n == name && r.answered >= created_at,
                    Target::Workspace(ws) => ws == workspace && r.answered >= created_at,
                }
        })
    }

    /// The requests that name this sandbox (by id, name or workspace), for a violation's
    /// message: each with its op and its sent/answered calls.
    fn naming(&self, id: Uuid, workspace: &str, name: &str) -> String {
        let shown: Vec<String> = self
            .requests
            .iter()
            .filter(|r| match &r.target {
                Target::Id(target) => *target == id,
                Target::Name(ws, n) => ws == workspace && n == name,
                Target::Workspace(ws) => ws == workspace,
            })
            .map(|r| {
                let answered = if r.answered == u64::MAX {
                    "never".to_string()
                } else {
                    r.answered.to_string()
                };
                format!(
                    "{:?} {:?} sent {} answered {answered}",
                    r.op, r.target, r.sent
                )
            })
            .collect();
        if shown.is_empty() {
            "none".to_string()
        } else {
            shown.join("; ")
        }
    }

    /// Whether a delete was ever asked that covers this acknowledged sandbox.
    fn delete_asked(&self, id: Uuid, workspace: &str, name: &str) -> bool {
        self.deleted_ids.contains(&id)
            || self.requests.iter().any(|r| {
                r.op == Destructive::Delete
                    && match &r.target {
                        Target::Id(target) => *target == id,
                        Target::Name(ws, n) => ws == workspace && n == name,
                        Target::Workspace(ws) => ws == workspace,
                    }
            })
            || self
                .ttls
                .iter()
                .any(|t| t.op == Destructive::Delete && t.names(id, workspace, name))
    }

    /// Whether a ttl given at create could have made the driver `op` sandbox `id` (of
    /// `workspace/name`) at `at`: only at or after its deadline.
    fn ttl_explains(
        &self,
        op: Destructive,
        id: Uuid,
        workspace: &str,
        name: &str,
        at: std::time::SystemTime,
    ) -> bool {
        self.ttls
            .iter()
            .any(|t| t.op == op && t.names(id, workspace, name) && at >= t.not_before)
    }
}

impl Ledger {
    /// The ttls that name this sandbox, for a violation's message.
    fn ttls_naming(&self, id: Uuid, workspace: &str, name: &str) -> String {
        let shown: Vec<String> = self
            .ttls
            .iter()
            .filter(|t| t.names(id, workspace, name))
            .map(|t| format!("{:?} not before {:?}", t.op, t.not_before))
            .collect();
        if shown.is_empty() {
            "none".into()
        } else {
            shown.join(", ")
        }
    }
}

impl TtlAsk {
    fn names(&self, id: Uuid, workspace: &str, name: &str) -> bool {
        match &self.target {
            Target::Id(target) => *target == id,
            Target::Name(ws, n) => ws == workspace && n == name,
            Target::Workspace(_) => false,
        }
    }
}

struct Harness {
    cfg: ChaosConfig,
    gateway: RwLock<Arc<Gateway>>,
    store: Arc<SledStore>,
    world: SimWorld,
    faults: SimFaultHandle,
    driver: Arc<dyn ComputeDriver>,
    recording: Arc<Recording>,
    /// What the machine really removed, to hold against the deletes the driver was asked for.
    removals: RemovalObserver,
    ledger: Mutex<Ledger>,
    report: Mutex<ChaosReport>,
    /// Set when the clients are done: the injector finishes its current fault and stops.
    stop_faults: std::sync::atomic::AtomicBool,
    /// Every operation and fault, in the order they began.
    journal: Arc<Journal>,
    /// The credentials' key, the same for every gateway of the round.
    secrets: Arc<sbx_actors::Sealer>,
}

pub fn chaos_actor_config() -> Config {
    let fast = RestartPolicy {
        max_restarts: 10,
        window: Duration::from_secs(5),
        base_backoff: Duration::from_millis(5),
        max_backoff: Duration::from_millis(200),
    };
    Config {
        driver_call_timeout: Duration::from_millis(150),
        max_driver_attempts: 4,
        retry_backoff: Duration::from_millis(10),
        max_retry_backoff: Duration::from_millis(100),
        sandbox_restarts: fast,
        workspace_restarts: fast,
        reconcile_interval: Duration::from_millis(500),
        request_timeout: Duration::from_secs(5),
        // The sim pauses in microseconds; a pause or resume it hangs must end at a deadline of
        // the harness's scale, as every other call does (150 ms), not at sbxd's 30 minutes:
        // a gateway restarted amid a pause re-issues it while attaching, and one hung call
        // then held the startup past its 30 s wait (CI, seed 2).
        lifetimes: LifetimeSettings {
            pause_timeout: Duration::from_secs(1),
            ..LifetimeSettings::default()
        },
        ..Config::default()
    }
}

fn workspace_name(i: usize) -> String {
    format!("ws-{i}")
}

fn sandbox_name(i: usize) -> String {
    format!("sb-{i}")
}

/// Runs one scenario and checks every invariant. `Err` names the seed and what broke, and
/// where the round's directory and journal were kept.
pub async fn run(cfg: ChaosConfig) -> Result<ChaosReport, String> {
    run_journaled(cfg, None).await
}

/// Runs the operations and faults of a journal again, in their recorded order (see
/// `journal.rs`), then quiesces and checks every invariant as the round did. The replay's own
/// journal is written to `journal` when given.
pub async fn replay(path: &Path, journal: Option<PathBuf>) -> Result<ChaosReport, String> {
    let recorded = journal::read_journal(path)?;
    let cfg = ChaosConfig {
        journal,
        ..recorded.config
    };
    run_journaled(cfg, Some(recorded.entries)).await
}

async fn run_journaled(
    cfg: ChaosConfig,
    replay: Option<Vec<Entry>>,
) -> Result<ChaosReport, String> {
    let seed = cfg.seed;
    let what = if replay.is_some() {
        "replay of chaos seed"
    } else {
        "chaos seed"
    };
    let dir = tempfile::Builder::new()
        .prefix(&format!("sbx-chaos-{seed}-"))
        .tempdir()
        .map_err(|e| format!("{what} {seed}: cannot make the round's directory: {e}"))?;
    let journal = Arc::new(Journal::default());
    let result = run_inner(cfg.clone(), dir.path(), Arc::clone(&journal), replay).await;
    if let Some(path) = &cfg.journal {
        journal.write(path, &cfg, result.as_ref().err().map(String::as_str))?;
    }
    match result {
        Ok(report) => Ok(report),
        Err(e) => {
            let kept = dir.keep();
            let file = kept.join("journal.jsonl");
            let saved = match journal.write(&file, &cfg, Some(&e)) {
                Ok(()) => format!(
                    "; its journal is {} (replay: SBX_CHAOS_REPLAY={} cargo nextest run -p sbx-chaos-tests --test chaos_in_process)",
                    file.display(),
                    file.display()
                ),
                Err(why) => format!("; {why}"),
            };
            Err(format!(
                "{what} {seed}: {e}\n  kept the round's directory {}{saved}",
                kept.display()
            ))
        }
    }
}

async fn run_inner(
    cfg: ChaosConfig,
    dir: &Path,
    journal: Arc<Journal>,
    replay: Option<Vec<Entry>>,
) -> Result<ChaosReport, String> {
    let store = Arc::new(SledStore::open(&dir.join("store")).map_err(|e| e.to_string())?);
    let world = SimWorld::new();
    let removals = RemovalObserver::start(world.clone())
        .await
        .map_err(|e| e.to_string())?;
    let sim = SimDriver::new(world.clone(), SimFaults::seeded(cfg.seed));
    let faults = sim.faults();
    let recording = RecordingDriver::new(Arc::new(sim));
    let calls = recording.recording();
    let driver: Arc<dyn ComputeDriver> = Arc::new(recording);
    // One key for the whole round, as sbxd keeps DATA/secrets.key across its restarts: a
    // restarted gateway opens the credentials the one before it sealed.
    let secrets = Arc::new(sbx_actors::Sealer::ephemeral());
    let gw = start_gateway(&store, &driver, &secrets).await?;
    let h = Arc::new(Harness {
        secrets,
        gateway: RwLock::new(Arc::new(gw)),
        report: Mutex::new(ChaosReport {
            seed: cfg.seed,
            ..Default::default()
        }),
        cfg,
        store,
        world,
        faults,
        driver,
        recording: calls,
        removals,
        ledger: Mutex::default(),
        stop_faults: Default::default(),
        journal,
    });
    for i in 0..h.cfg.workspaces {
        gw_of(&h)
            .await
            .create_workspace(&workspace_name(i), HashMap::new())
            .await
            .map_err(|e| e.to_string())?;
    }

    if let Some(entries) = replay {
        journal::replay_entries(Arc::clone(&h), entries).await?;
    } else {
        let clients: Vec<_> = (0..h.cfg.clients)
            .map(|c| tokio::spawn(client(Arc::clone(&h), c)))
            .collect();
        let injector = tokio::spawn(inject_faults(Arc::clone(&h)));
        for c in clients {
            c.await.map_err(|e| format!("a client panicked: {e}"))??;
        }
        // Stop the injector between two faults, never in the middle of one: aborting it during
        // a gateway restart would leave the harness holding a gateway that was shut down.
        h.stop_faults
            .store(true, std::sync::atomic::Ordering::SeqCst);
        tokio::time::timeout(Duration::from_secs(60), injector)
            .await
            .map_err(|_| "the fault injector did not stop".to_string())?
            .map_err(|e| format!("the fault injector panicked: {e}"))?;
    }

    quiesce(&h).await?;
    check_invariants(&h).await?;
    gw_of(&h).await.shutdown().await;
    let report = h.report.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(report)
}

async fn start_gateway(
    store: &Arc<SledStore>,
    driver: &Arc<dyn ComputeDriver>,
    secrets: &Arc<sbx_actors::Sealer>,
) -> Result<Gateway, String> {
    let store: Arc<dyn ObjectStore> = Arc::clone(store) as Arc<dyn ObjectStore>;
    let gw = Gateway::start(
        store,
        DriverSet::single("sim", Arc::clone(driver)),
        Config {
            secrets: Arc::clone(secrets),
            ..chaos_actor_config()
        },
    )
    .await
    .map_err(|e| e.to_string())?;
    if !gw.wait_attached(Duration::from_secs(30)).await {
        return Err("sandboxes did not re-attach after a gateway start".into());
    }
    Ok(gw)
}

async fn gw_of(h: &Harness) -> Arc<Gateway> {
    Arc::clone(&*h.gateway.read().await)
}

fn count_fault(h: &Harness, kind: &'static str) {
    *h.report
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .faults
        .entry(kind)
        .or_default() += 1;
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        ..Default::default()
    }
}

/// A create, with its ttl: the ttl is in the ledger before the create is sent (an
/// unacknowledged create may still be made, with its ttl), by name until its id is known.
async fn create_with(
    h: &Harness,
    gw: &Gateway,
    ws: &str,
    name: &str,
    ttl: Option<(u64, TtlAction)>,
) -> Result<Sandbox, ActorError> {
    let mut spec = spec();
    if let Some((secs, action)) = ttl {
        let (op, on) = match action {
            TtlAction::Delete => (Some(Destructive::Delete), LifetimeAction::Delete),
            TtlAction::Stop => (Some(Destructive::Stop), LifetimeAction::Stop),
            TtlAction::Pause => (None, LifetimeAction::Pause),
        };
        spec.lifetime = Some(Lifetime {
            ttl_seconds: secs,
            on_ttl: on as i32,
            ..Default::default()
        });
        let mut report = h.report.lock().unwrap_or_else(|p| p.into_inner());
        report.ttls_given += 1;
        drop(report);
        if let Some(op) = op {
            h.ledger
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .ttls
                .push(TtlAsk {
                    op,
                    target: Target::Name(ws.to_string(), name.to_string()),
                    not_before: std::time::SystemTime::now() + Duration::from_secs(secs),
                });
        }
    }
    gw.create_sandbox(Some(ws), name, spec).await
}

/// One client: random operations, some sent twice at once.
async fn client(h: Arc<Harness>, index: usize) -> Result<(), String> {
    let mut rng = Rng::new(h.cfg.seed ^ (0xC11E_u64 << 16) ^ index as u64);
    let until = tokio::time::Instant::now() + h.cfg.duration;
    for _ in 0..h.cfg.max_ops_per_client {
        if tokio::time::Instant::now() >= until {
            break;
        }
        let op = pick_op(&h, &mut rng);
        let duplicate = rng.chance(0.08);
        let lane = format!("client {index}");
        let once = || {
            h.journal
                .around(&lane, Action::Op(op.clone()), perform(&h, &op))
        };
        let ok = if duplicate {
            let (a, b) = tokio::join!(once(), once());
            a?.acknowledged | b?.acknowledged
        } else {
            once().await?.acknowledged
        };
        let mut report = h.report.lock().unwrap_or_else(|p| p.into_inner());
        report.ops += if duplicate { 2 } else { 1 };
        report.ops_acknowledged += ok as u64;
    }
    Ok(())
}

/// The answer of an operation or a fault (what the journal keeps of each entry).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    /// The gateway acknowledged it (a fault: it took effect).
    pub acknowledged: bool,
    /// The id an acknowledged create was given.
    pub created: Option<Uuid>,
    /// The error of an operation that was refused (as a client of a faulty system expects).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
}

/// What a client or the fault injector does: one entry of the journal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Action {
    Op(Op),
    Fault(Fault),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Op {
    Create {
        ws: String,
        name: String,
        /// A ttl in seconds and what it does (a journal from before ttls has none).
        #[serde(default)]
        ttl: Option<(u64, TtlAction)>,
    },
    ById {
        kind: Cmd,
        id: Uuid,
    },
    ByName {
        kind: Cmd,
        ws: String,
        name: String,
    },
    DeleteWorkspace {
        ws: String,
    },
    List {
        ws: String,
    },
    /// Something that hangs off a sandbox or a workspace: providers, attachments, settings,
    /// service endpoints (checked by invariant 6).
    Owned {
        kind: OwnedOp,
        ws: String,
        name: String,
        provider: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum OwnedOp {
    CreateProvider,
    Attach,
    DeleteProvider,
    ForceDeleteProvider,
    SetSetting,
    Expose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Cmd {
    Start,
    Stop,
    Restart,
    Delete,
    Get,
    Pause,
    Resume,
}

/// What a create's ttl does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum TtlAction {
    Delete,
    Stop,
    Pause,
}

impl Op {
    /// The same operation with its sandbox id (if any) passed through `map`.
    fn map_id(&self, map: impl Fn(Uuid) -> Uuid) -> Op {
        match self {
            Op::ById { kind, id } => Op::ById {
                kind: *kind,
                id: map(*id),
            },
            other => other.clone(),
        }
    }
}

fn pick_op(h: &Harness, rng: &mut Rng) -> Op {
    let ws = workspace_name(rng.below(h.cfg.workspaces as u64) as usize);
    let name = sandbox_name(rng.below(h.cfg.names as u64) as usize);
    let ledger = h.ledger.lock().unwrap_or_else(|p| p.into_inner());
    let known: Vec<Uuid> = ledger.created.keys().copied().collect();
    // Sandboxes a ttl stops or deletes: no client stops or deletes them, by id, by name or
    // by their workspace (theirs are workspaces of their own, `t` + a client workspace's
    // name, which no client names), so that the driver's stop or delete of one is the ttl's
    // alone, and is checked against its deadline.
    let timed: HashSet<Uuid> = ledger
        .ttls
        .iter()
        .filter_map(|t| match t.target {
            Target::Id(id) => Some(id),
            _ => None,
        })
        .collect();
    drop(ledger);
    let cmd = match rng.below(7) {
        0 => Cmd::Start,
        1 => Cmd::Stop,
        2 => Cmd::Restart,
        3 => Cmd::Delete,
        4 => Cmd::Pause,
        5 => Cmd::Resume,
        _ => Cmd::Get,
    };
    // Two creates in five live 1–4 s, then delete, stop or pause themselves.
    let ttl = (h.cfg.ttls && rng.chance(0.4)).then(|| {
        let action = match rng.below(3) {
            0 => TtlAction::Delete,
            1 => TtlAction::Stop,
            _ => TtlAction::Pause,
        };
        (1 + rng.below(4), action)
    });
    let destructive = matches!(cmd, Cmd::Stop | Cmd::Restart | Cmd::Delete);
    match rng.below(100) {
        0..30 => match ttl {
            Some((_, TtlAction::Delete | TtlAction::Stop)) => Op::Create {
                ws: format!("t{ws}"),
                name,
                ttl,
            },
            _ => Op::Create { ws, name, ttl },
        },
        30..65 if !known.is_empty() => {
            let mut ids = known;
            ids.sort();
            let id = ids[rng.below(ids.len() as u64) as usize];
            Op::ById {
                kind: if destructive && timed.contains(&id) {
                    Cmd::Get
                } else {
                    cmd
                },
                id,
            }
        }
        30..85 => Op::ByName {
            kind: cmd,
            ws,
            name,
        },
        85..88 => Op::DeleteWorkspace { ws },
        88..96 => Op::Owned {
            kind: match rng.below(6) {
                0 => OwnedOp::CreateProvider,
                1 => OwnedOp::Attach,
                2 => OwnedOp::DeleteProvider,
                3 => OwnedOp::ForceDeleteProvider,
                4 => OwnedOp::SetSetting,
                _ => OwnedOp::Expose,
            },
            ws,
            name,
            provider: format!("p-{}", rng.below(2)),
        },
        _ => Op::List { ws },
    }
}

/// Performs one operation and records it in the ledger. Acknowledged or not (an error that a
/// client of a faulty system should expect); anything else is a violation.
async fn perform(h: &Harness, op: &Op) -> Result<Answer, String> {
    let mut answer = Answer::default();
    answer.acknowledged = perform_inner(h, op, &mut answer).await?;
    Ok(answer)
}

/// `answer` gets the id of an acknowledged create and the error of a refusal.
async fn perform_inner(h: &Harness, op: &Op, answer: &mut Answer) -> Result<bool, String> {
    let gw = gw_of(h).await;
    match op {
        Op::Create { ws, name, ttl } => match create_with(h, &gw, ws, name, *ttl).await {
            Ok(sb) => {
                let id = Uuid::parse_str(&sb.id).map_err(|e| e.to_string())?;
                answer.created = Some(id);
                let mut ledger = h.ledger.lock().unwrap_or_else(|p| p.into_inner());
                ledger.created.insert(id, (ws.clone(), name.clone()));
                // The sandbox is known by its id from now on.
                for t in ledger.ttls.iter_mut().rev() {
                    if t.target == Target::Name(ws.clone(), name.clone()) {
                        t.target = Target::Id(id);
                        break;
                    }
                }
                drop(ledger);
                h.report
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .creates_acknowledged += 1;
                Ok(true)
            }
            Err(ActorError::WorkspaceNotFound(_)) => {
                // A client that finds its workspace gone makes it again.
                let _ = gw.create_workspace(ws, HashMap::new()).await;
                Ok(false)
            }
            Err(e) => expected(h, e, answer),
        },
        Op::ById { kind, id } => {
            let sel = SandboxSelector::Id(*id);
            let sent = h.recording.now();
            let result = command(h, &gw, *kind, &sel, Some(*id), answer).await;
            note_request(h, *kind, Target::Id(*id), sent, matches!(result, Ok(true)));
            result
        }
        Op::ByName { kind, ws, name } => {
            let sel = SandboxSelector::Name {
                workspace: Some(ws.clone()),
                name: name.clone(),
            };
            let sent = h.recording.now();
            let result = command(h, &gw, *kind, &sel, None, answer).await;
            note_request(
                h,
                *kind,
                Target::Name(ws.clone(), name.clone()),
                sent,
                matches!(result, Ok(true)),
            );
            result
        }
        Op::DeleteWorkspace { ws } => {
            let sent = h.recording.now();
            let result = gw
                .delete_workspace(&WorkspaceSelector::Name(ws.clone()), true)
                .await;
            note_request(
                h,
                Cmd::Delete,
                Target::Workspace(ws.clone()),
                sent,
                result.is_ok(),
            );
            match result {
                Ok(_) => {
                    let _ = gw.create_workspace(ws, HashMap::new()).await;
                    Ok(true)
                }
                Err(ActorError::WorkspaceNotFound(_)) => Ok(false),
                Err(e) => expected(h, e, answer),
            }
        }
        Op::Owned {
            kind,
            ws,
            name,
            provider,
        } => {
            let sel = SandboxSelector::Name {
                workspace: Some(ws.clone()),
                name: name.clone(),
            };
            let by_name = sbx_actors::ProviderSelector::Name {
                workspace: Some(ws.clone()),
                name: provider.clone(),
            };
            let result = match kind {
                OwnedOp::CreateProvider => gw
                    .create_provider(
                        Some(ws),
                        provider,
                        "generic",
                        HashMap::from([("TOKEN".to_string(), format!("t-{}", Uuid::new_v4()))]),
                        HashMap::new(),
                    )
                    .await
                    .map(|_| ()),
                OwnedOp::Attach => gw.attach_provider(&sel, provider).await.map(|_| ()),
                OwnedOp::DeleteProvider => gw.delete_provider(&by_name, false).await.map(|_| ()),
                OwnedOp::ForceDeleteProvider => {
                    gw.delete_provider(&by_name, true).await.map(|_| ())
                }
                OwnedOp::SetSetting => gw
                    .set_settings(
                        &sel,
                        HashMap::from([("approval-mode".to_string(), "suggest".to_string())]),
                    )
                    .await
                    .map(|_| ()),
                OwnedOp::Expose => gw.expose_service(&sel, 8000, "web").await.map(|_| ()),
            };
            match result {
                Ok(()) => {
                    h.report
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .owned_acknowledged += 1;
                    Ok(true)
                }
                Err(e) => expected(h, e, answer),
            }
        }
        Op::List { ws } => {
            let filter = sbx_actors::SandboxFilter {
                workspace: Some(ws.clone()),
                ..Default::default()
            };
            match gw.list_sandboxes(&filter, 100, "").await {
                Ok(page) => check_listed_names_unique(&page.items).map(|_| true),
                Err(e) => expected(h, e, answer),
            }
        }
    }
}

/// Records a stop, restart or delete request once it is answered (or failed).
fn note_request(h: &Harness, kind: Cmd, target: Target, sent: u64, acknowledged: bool) {
    let op = match kind {
        Cmd::Delete => Destructive::Delete,
        Cmd::Stop | Cmd::Restart => Destructive::Stop,
        Cmd::Start | Cmd::Get | Cmd::Pause | Cmd::Resume => return,
    };
    let answered = if acknowledged {
        h.recording.now()
    } else {
        u64::MAX
    };
    h.ledger
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .requests
        .push(Request {
            op,
            target,
            sent,
            answered,
        });
}

async fn command(
    h: &Harness,
    gw: &Gateway,
    kind: Cmd,
    sel: &SandboxSelector,
    id: Option<Uuid>,
    answer: &mut Answer,
) -> Result<bool, String> {
    let result = match kind {
        Cmd::Start => gw.start_sandbox(sel).await.map(|_| ()),
        Cmd::Stop => gw.stop_sandbox(sel).await.map(|_| ()),
        Cmd::Restart => gw.restart_sandbox(sel).await.map(|_| ()),
        Cmd::Get => gw.get_sandbox(sel).await.map(|_| ()),
        Cmd::Pause | Cmd::Resume => {
            let done = if kind == Cmd::Pause {
                gw.pause_sandbox(sel).await
            } else {
                gw.resume_sandbox(sel).await
            };
            if done.is_ok() {
                let mut report = h.report.lock().unwrap_or_else(|p| p.into_inner());
                if kind == Cmd::Pause {
                    report.pauses_acknowledged += 1;
                } else {
                    report.resumes_acknowledged += 1;
                }
            }
            done.map(|_| ())
        }
        Cmd::Delete => match gw.delete_sandbox(sel).await {
            Ok(true) => {
                if let Some(id) = id {
                    h.ledger
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .deleted_ids
                        .insert(id);
                }
                h.report
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .deletes_acknowledged += 1;
                Ok(())
            }
            Ok(false) => Ok(()),
            Err(e) => Err(e),
        },
    };
    match result {
        Ok(()) => Ok(true),
        Err(e) => expected(h, e, answer),
    }
}

/// Errors a client must expect from a gateway under faults; anything else is a violation.
fn expected(h: &Harness, e: ActorError, answer: &mut Answer) -> Result<bool, String> {
    answer.refusal = Some(e.to_string());
    // A driver call that failed under the faults (an injected error, a hang past the call's
    // timeout) is an honest answer: the client sees UNAVAILABLE or DEADLINE_EXCEEDED and
    // tries again. What the driver refused on purpose is not expected here.
    let driver_failed = matches!(
        &e,
        ActorError::Driver(DriverError::Unavailable(_) | DriverError::DeadlineExceeded { .. })
    );
    if matches!(e, ActorError::Unavailable(_)) || driver_failed {
        let mut report = h.report.lock().unwrap_or_else(|p| p.into_inner());
        report.ops_unavailable += 1;
        if report.unavailable_said.len() < 5 {
            report.unavailable_said.push(e.to_string());
        }
    }
    match e {
        ActorError::SandboxNotFound { .. }
        | ActorError::WorkspaceNotFound(_)
        | ActorError::NameTaken { .. }
        | ActorError::WorkspaceTerminating(_)
        | ActorError::FailedPrecondition(_)
        | ActorError::ObjectNotFound { .. }
        | ActorError::ProviderInUse { .. }
        | ActorError::Unavailable(_) => Ok(false),
        _ if driver_failed => Ok(false),
        other => Err(format!("unexpected error from the gateway: {other}")),
    }
}

fn check_listed_names_unique(items: &[Sandbox]) -> Result<(), String> {
    let mut seen = HashSet::new();
    for sb in items {
        if !seen.insert((sb.workspace_id.clone(), sb.name.clone())) {
            return Err(format!(
                "two live sandboxes share {}/{}",
                sb.workspace, sb.name
            ));
        }
    }
    Ok(())
}
