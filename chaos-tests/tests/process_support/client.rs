//! The clients of a process chaos run: random lifecycle operations over gRPC across
//! workspaces that reuse the same sandbox names (some sent twice at once), each judged
//! (acknowledged, an expected refusal, or a violation) and written to the run's ledger.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_chaos_tests::rng::Rng;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, DeleteWorkspaceRequest,
    GetSandboxRequest, Lifetime, LifetimeAction, ListSandboxesRequest, PauseSandboxRequest, Phase,
    RestartSandboxRequest, ResumeSandboxRequest, SandboxRef, SandboxSpec, SetSandboxTtlRequest,
    StartSandboxRequest, StopSandboxRequest, WorkspaceRef,
};
use tonic::Code;
use tonic::transport::Channel;

use crate::{CALL_TIMEOUT, NAMES, Run, WORKSPACES, lock};

/// What clients asked for and what was acknowledged.
#[derive(Default)]
pub struct Ledger {
    /// id → (workspace, name) of every acknowledged create.
    pub created: HashMap<String, (String, String)>,
    /// When each acknowledged create was sent: its sandbox cannot have existed before.
    pub created_sent: HashMap<String, Instant>,
    pub deleted_ids: HashSet<String>,
    pub delete_requested_ids: HashSet<String>,
    /// Deletes by name and of whole workspaces, with when they were answered (or failed): a
    /// request resolves its target before it answers, so it cannot touch a sandbox that was
    /// created only after that.
    pub delete_requested_names: Vec<((String, String), Instant)>,
    pub delete_requested_workspaces: Vec<(String, Instant)>,
    /// Deletes a ttl asked for (at create, or by a ttl call): each is the sandbox's own
    /// doing, and none may happen before its deadline.
    pub ttl_asks: Vec<TtlAsk>,
}

/// A deadline a client gave a sandbox: at create (`--ttl`, deleting or stopping) or by a ttl
/// call (deleting: a sandbox without a lifetime deletes when its ttl comes).
#[derive(Debug, Clone)]
pub struct TtlAsk {
    /// By id, or by (workspace, name) when the create was not acknowledged (its id unknown)
    /// or the ttl call named the sandbox by name.
    pub target: Result<String, (String, String)>,
    pub deletes: bool,
    /// The deadline is no earlier than this: the request was sent then, with the ttl.
    pub not_before: Instant,
    /// And no later than this (the answer came, the deadline was written before it); `None`
    /// when it was not acknowledged.
    pub not_after: Option<Instant>,
}

impl Ledger {
    /// The ttl asks that name sandbox `id` (of `ws`/`name`, whose create was sent at `sent`).
    pub fn ttl_asks_of<'a>(
        &'a self,
        id: &'a str,
        ws: &'a str,
        name: &'a str,
        sent: Option<Instant>,
    ) -> impl Iterator<Item = &'a TtlAsk> + 'a {
        self.ttl_asks.iter().filter(move |a| match &a.target {
            Ok(target) => target == id,
            Err((w, n)) => w == ws && n == name && sent.is_none_or(|s| a.not_before >= s),
        })
    }
}

/// The workspace of the injector's probes (see `faults.rs`): no client names it, so no client
/// deletes it or a sandbox in it by name.
pub const PROBE_WORKSPACE: &str = "chaos-probe";

pub fn ws_name(i: usize) -> String {
    format!("ws-{i}")
}

pub fn sb_name(i: usize) -> String {
    format!("sb-{i}")
}

pub fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.into(),
        ..Default::default()
    })
}

fn by_name(ws: &str, name: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        workspace: ws.into(),
        name: name.into(),
        ..Default::default()
    })
}

fn channel(endpoint: &str) -> Result<Channel, String> {
    Ok(Channel::from_shared(endpoint.to_string())
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(2))
        .connect_lazy())
}

pub fn clients(
    run: &Run,
) -> Result<
    (
        SandboxServiceClient<Channel>,
        WorkspaceServiceClient<Channel>,
    ),
    String,
> {
    let endpoint = run
        .endpoint
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let ch = channel(&endpoint)?;
    Ok((
        SandboxServiceClient::new(ch.clone()),
        WorkspaceServiceClient::new(ch),
    ))
}

pub fn spec() -> Option<SandboxSpec> {
    Some(SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        ..Default::default()
    })
}

/// A create's ttl: its seconds, and whether it deletes (else it stops).
type Ttl = Option<(u64, bool)>;

fn spec_with(ttl: Ttl) -> Option<SandboxSpec> {
    let mut spec = spec()?;
    spec.lifetime = ttl.map(|(secs, deletes)| Lifetime {
        ttl_seconds: secs,
        on_ttl: if deletes {
            LifetimeAction::Delete
        } else {
            LifetimeAction::Stop
        } as i32,
        ..Default::default()
    });
    Some(spec)
}

#[derive(Debug, Clone)]
enum Op {
    Create { ws: String, name: String, ttl: Ttl },
    ById { cmd: Cmd, id: String },
    ByName { cmd: Cmd, ws: String, name: String },
    DeleteWorkspace { ws: String },
    List { ws: String },
}

#[derive(Debug, Clone, Copy)]
enum Cmd {
    Start,
    Stop,
    Restart,
    Delete,
    Get,
    /// A ttl call: the sandbox deletes itself this many seconds later.
    Ttl(u64),
    /// Refused on the process driver (it cannot pause): never acknowledged.
    Pause,
    Resume,
}

fn pick_op(run: &Run, rng: &mut Rng) -> Op {
    let ws = ws_name(rng.below(WORKSPACES as u64) as usize);
    let name = sb_name(rng.below(NAMES as u64) as usize);
    let mut known: Vec<String> = lock(&run.ledger).created.keys().cloned().collect();
    known.sort();
    let cmd = match rng.below(9) {
        0 => Cmd::Start,
        1 => Cmd::Stop,
        2 => Cmd::Restart,
        3 => Cmd::Delete,
        4 => Cmd::Ttl(2 + rng.below(4)),
        5 => Cmd::Pause,
        6 => Cmd::Resume,
        _ => Cmd::Get,
    };
    // Two creates in five live 2–5 s, then delete or stop themselves.
    let ttl = rng.chance(0.4).then(|| (2 + rng.below(4), rng.chance(0.5)));
    match rng.below(100) {
        0..35 => Op::Create { ws, name, ttl },
        35..65 if !known.is_empty() => Op::ById {
            cmd,
            id: known[rng.below(known.len() as u64) as usize].clone(),
        },
        35..88 => Op::ByName { cmd, ws, name },
        88..91 => Op::DeleteWorkspace { ws },
        _ => Op::List { ws },
    }
}

/// The outcome of a call: acknowledged, or refused in a way a client of a faulty system must
/// expect. Anything else is a violation (`Err`).
fn judge<T>(run: &Run, result: Result<T, tonic::Status>) -> Result<Option<T>, String> {
    match result {
        Ok(v) => Ok(Some(v)),
        Err(status) => match status.code() {
            Code::NotFound
            | Code::AlreadyExists
            | Code::FailedPrecondition
            | Code::Unavailable
            | Code::DeadlineExceeded
            | Code::Cancelled
            | Code::Aborted
            // A full disk (the disk-full fault).
            | Code::ResourceExhausted
            // A connection cut by SIGKILL of sbxd mid-call surfaces as Unknown.
            | Code::Unknown => {
                *lock(&run.report)
                    .refused
                    .entry(format!("{:?}", status.code()))
                    .or_default() += 1;
                Ok(None)
            }
            _ => Err(format!("unexpected answer: {status:?}")),
        },
    }
}

pub async fn bounded<T>(
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, tonic::Status> {
    match tokio::time::timeout(CALL_TIMEOUT, fut).await {
        Ok(r) => r.map(tonic::Response::into_inner),
        Err(_) => Err(tonic::Status::deadline_exceeded("client-side bound")),
    }
}

/// Performs one operation and records it; `Ok(true)` when acknowledged.
async fn perform(run: &Run, op: &Op) -> Result<bool, String> {
    let (mut sb, mut ws_client) = clients(run)?;
    match op {
        Op::Create { ws, name, ttl } => {
            let sent = Instant::now();
            let r = bounded(sb.create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: ws.clone(),
                name: name.clone(),
                spec: spec_with(*ttl),
                stopped: false,
            }))
            .await;
            let missing_ws = matches!(&r, Err(s) if s.code() == Code::NotFound);
            let answered = Instant::now();
            let r = judge(run, r)?;
            if let Some((secs, deletes)) = *ttl {
                // An unacknowledged create may still have been made (with its ttl).
                lock(&run.ledger).ttl_asks.push(TtlAsk {
                    target: match &r {
                        Some(created) => Ok(created.id.clone()),
                        None => Err((ws.clone(), name.clone())),
                    },
                    deletes,
                    not_before: sent + Duration::from_secs(secs),
                    not_after: r.as_ref().map(|_| answered + Duration::from_secs(secs)),
                });
            }
            match r {
                Some(created) => {
                    let mut ledger = lock(&run.ledger);
                    ledger.created_sent.insert(created.id.clone(), sent);
                    ledger
                        .created
                        .insert(created.id, (ws.clone(), name.clone()));
                    drop(ledger);
                    lock(&run.report).creates_acknowledged += 1;
                    Ok(true)
                }
                None => {
                    if missing_ws {
                        // A client that finds its workspace gone makes it again.
                        let _ = bounded(ws_client.create_workspace(CreateWorkspaceRequest {
                            name: ws.clone(),
                            ..Default::default()
                        }))
                        .await;
                    }
                    Ok(false)
                }
            }
        }
        Op::ById { cmd, id } => {
            if let Cmd::Delete = cmd {
                lock(&run.ledger).delete_requested_ids.insert(id.clone());
            }
            if let Cmd::Ttl(secs) = cmd {
                lock(&run.ledger).ttl_asks.push(TtlAsk {
                    target: Ok(id.clone()),
                    deletes: true,
                    not_before: Instant::now() + Duration::from_secs(*secs),
                    not_after: None,
                });
            }
            command(run, &mut sb, *cmd, by_id(id), Some(id)).await
        }
        Op::ByName { cmd, ws, name } => {
            if let Cmd::Ttl(secs) = cmd {
                lock(&run.ledger).ttl_asks.push(TtlAsk {
                    target: Err((ws.clone(), name.clone())),
                    deletes: true,
                    not_before: Instant::now() + Duration::from_secs(*secs),
                    not_after: None,
                });
            }
            let result = command(run, &mut sb, *cmd, by_name(ws, name), None).await;
            if let Cmd::Delete = cmd {
                lock(&run.ledger)
                    .delete_requested_names
                    .push(((ws.clone(), name.clone()), Instant::now()));
            }
            result
        }
        Op::DeleteWorkspace { ws } => {
            let r = bounded(ws_client.delete_workspace(DeleteWorkspaceRequest {
                workspace: Some(WorkspaceRef {
                    name: ws.clone(),
                    ..Default::default()
                }),
                cascade: true,
            }))
            .await;
            lock(&run.ledger)
                .delete_requested_workspaces
                .push((ws.clone(), Instant::now()));
            let ok = judge(run, r)?.is_some();
            if ok {
                let _ = bounded(ws_client.create_workspace(CreateWorkspaceRequest {
                    name: ws.clone(),
                    ..Default::default()
                }))
                .await;
            }
            Ok(ok)
        }
        Op::List { ws } => {
            let r = bounded(sb.list_sandboxes(ListSandboxesRequest {
                workspace: ws.clone(),
                page_size: 100,
                ..Default::default()
            }))
            .await;
            match judge(run, r)? {
                Some(page) => {
                    let mut seen = HashSet::new();
                    for s in &page.sandboxes {
                        if !seen.insert(s.name.clone()) {
                            return Err(format!("list of {ws} shows {} twice", s.name));
                        }
                    }
                    Ok(true)
                }
                None => Ok(false),
            }
        }
    }
}

async fn command(
    run: &Run,
    sb: &mut SandboxServiceClient<Channel>,
    cmd: Cmd,
    sandbox: Option<SandboxRef>,
    id: Option<&String>,
) -> Result<bool, String> {
    let acknowledged = match cmd {
        Cmd::Start => judge(
            run,
            bounded(sb.start_sandbox(StartSandboxRequest { sandbox })).await,
        )?
        .is_some(),
        Cmd::Stop => judge(
            run,
            bounded(sb.stop_sandbox(StopSandboxRequest { sandbox })).await,
        )?
        .is_some(),
        Cmd::Restart => judge(
            run,
            bounded(sb.restart_sandbox(RestartSandboxRequest { sandbox })).await,
        )?
        .is_some(),
        Cmd::Get => judge(
            run,
            bounded(sb.get_sandbox(GetSandboxRequest { sandbox })).await,
        )?
        .is_some(),
        Cmd::Ttl(ttl_seconds) => judge(
            run,
            bounded(sb.set_sandbox_ttl(SetSandboxTtlRequest {
                sandbox,
                ttl_seconds,
            }))
            .await,
        )?
        .is_some(),
        Cmd::Pause => {
            let r = bounded(sb.pause_sandbox(PauseSandboxRequest { sandbox })).await;
            if let Ok(s) = r {
                return Err(format!(
                    "a pause was acknowledged by the process driver, which cannot pause: {s:?}"
                ));
            }
            judge(run, r)?;
            false
        }
        // Nothing is ever paused here: a resume answers a Ready sandbox as it is, or is
        // refused.
        Cmd::Resume => {
            match judge(
                run,
                bounded(sb.resume_sandbox(ResumeSandboxRequest { sandbox })).await,
            )? {
                Some(s) if s.phase() != Phase::Ready => {
                    return Err(format!(
                        "a resume answered a sandbox that is not Ready: {s:?}"
                    ));
                }
                answer => answer.is_some(),
            }
        }
        Cmd::Delete => {
            match judge(
                run,
                bounded(sb.delete_sandbox(DeleteSandboxRequest { sandbox })).await,
            )? {
                Some(answer) => {
                    if answer.deleted {
                        if let Some(id) = id {
                            lock(&run.ledger).deleted_ids.insert(id.clone());
                        }
                        lock(&run.report).deletes_acknowledged += 1;
                    }
                    true
                }
                None => false,
            }
        }
    };
    Ok(acknowledged)
}

/// One client: random operations until the deadline, some sent twice at once.
pub async fn client(run: Arc<Run>, index: usize, until: Instant) -> Result<(), String> {
    let mut rng = Rng::new(run.seed ^ (0xC11E_u64 << 16) ^ index as u64);
    // Bounded in count as well as time.
    for _ in 0..5_000 {
        if Instant::now() >= until {
            break;
        }
        let op = pick_op(&run, &mut rng);
        let duplicate = rng.chance(0.08);
        let ok = if duplicate {
            let (a, b) = tokio::join!(perform(&run, &op), perform(&run, &op));
            a? | b?
        } else {
            perform(&run, &op).await?
        };
        {
            let mut report = lock(&run.report);
            report.ops += if duplicate { 2 } else { 1 };
            report.acknowledged += ok as u64;
        }
        if !ok {
            // Do not spin against a restarting sbxd.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    Ok(())
}
