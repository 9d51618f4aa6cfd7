//! Process-level chaos: the real `sbxd serve --driver managed:process` on 127.0.0.1:0, tonic
//! clients doing random lifecycle operations across workspaces that reuse the same sandbox
//! names (workload `sleep infinity`), while a seeded injector SIGKILLs the managed driver
//! process and SIGKILLs sbxd (starting it again on the same data dir). Then quiesce and check:
//! acknowledged creates survive unless a delete covered them, no sandbox in a deleted
//! workspace, names unique per workspace, every Ready sandbox has exactly one live workload and
//! every live workload (and every process in a sandbox cgroup) has a record. Then SIGKILL
//! the driver and sbxd once more: every Ready sandbox is Ready again on the very same
//! workload process. Finally delete everything and check that no process, cgroup (under the
//! run's own parent) or mount (under the data dir) is left, and that sbxd and its driver exit
//! on SIGTERM.
//!
//! Needs root and `cargo build -p sbx-gateway --bin sbxd` first. CI: seeds 1 and 2. More:
//! `SBX_CHAOS_PROCESS_ROUNDS=10`; replay one: `SBX_CHAOS_SEED=N`.

mod process_support;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use process_support::checks::{check_invariants, delete_everything, quiesce};
use process_support::{Cleanup, Daemon, managed_driver, runs, sbxd_binary, workload_pids};
use sbx_chaos_tests::rng::Rng;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, DeleteWorkspaceRequest,
    GetSandboxRequest, ListSandboxesRequest, Phase, RestartSandboxRequest, Sandbox, SandboxRef,
    SandboxSpec, StartSandboxRequest, StopSandboxRequest, WorkspaceRef,
};
use tokio::sync::RwLock;
use tonic::Code;
use tonic::transport::Channel;

const WORKSPACES: usize = 3;
const NAMES: usize = 3;
const CLIENTS: usize = 3;
/// How long clients run (and faults are injected) per seed.
const DURATION: Duration = Duration::from_secs(12);
/// Bound of one client call (a driver call times out after 3 s and is retried a few times).
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound of the wait for every sandbox to settle once faults stop.
const QUIESCE: Duration = Duration::from_secs(60);

/// What clients asked for and what was acknowledged.
#[derive(Default)]
struct Ledger {
    /// id → (workspace, name) of every acknowledged create.
    created: HashMap<String, (String, String)>,
    /// When each acknowledged create was sent: its sandbox cannot have existed before.
    created_sent: HashMap<String, Instant>,
    deleted_ids: HashSet<String>,
    delete_requested_ids: HashSet<String>,
    /// Deletes by name and of whole workspaces, with when they were answered (or failed): a
    /// request resolves its target before it answers, so it cannot touch a sandbox that was
    /// created only after that.
    delete_requested_names: Vec<((String, String), Instant)>,
    delete_requested_workspaces: Vec<(String, Instant)>,
}

#[derive(Debug, Default, Clone)]
struct Report {
    seed: u64,
    ops: u64,
    acknowledged: u64,
    /// Refusals a client of a faulty system must expect, by gRPC code.
    refused: BTreeMap<String, u64>,
    creates_acknowledged: u64,
    deletes_acknowledged: u64,
    faults: BTreeMap<&'static str, u64>,
    checks: u64,
    /// Sandboxes alive at the end of the fault phase (all deleted by the final clean-up).
    sandboxes_at_end: usize,
    /// Of those, Ready (each checked to have exactly one live workload).
    ready_at_end: usize,
    duration: Duration,
}

struct Run {
    seed: u64,
    data: PathBuf,
    cgroup_parent: String,
    sbxd: PathBuf,
    daemon: RwLock<Daemon>,
    /// The endpoint clients use; replaced (under the write lock) when sbxd restarts.
    endpoint: std::sync::RwLock<String>,
    /// How many times sbxd was started again (names each start's log file).
    starts: Mutex<u64>,
    ledger: Mutex<Ledger>,
    report: Mutex<Report>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn ws_name(i: usize) -> String {
    format!("ws-{i}")
}

fn sb_name(i: usize) -> String {
    format!("sb-{i}")
}

fn by_id(id: &str) -> Option<SandboxRef> {
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

fn clients(
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

fn spec() -> Option<SandboxSpec> {
    Some(SandboxSpec {
        command: vec!["sleep".into(), "infinity".into()],
        ..Default::default()
    })
}

#[derive(Debug, Clone)]
enum Op {
    Create { ws: String, name: String },
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
}

fn pick_op(run: &Run, rng: &mut Rng) -> Op {
    let ws = ws_name(rng.below(WORKSPACES as u64) as usize);
    let name = sb_name(rng.below(NAMES as u64) as usize);
    let mut known: Vec<String> = lock(&run.ledger).created.keys().cloned().collect();
    known.sort();
    let cmd = [Cmd::Start, Cmd::Stop, Cmd::Restart, Cmd::Delete, Cmd::Get][rng.below(5) as usize];
    match rng.below(100) {
        0..35 => Op::Create { ws, name },
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

async fn bounded<T>(
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
        Op::Create { ws, name } => {
            let sent = Instant::now();
            let r = bounded(sb.create_sandbox(CreateSandboxRequest {
                workspace: ws.clone(),
                name: name.clone(),
                spec: spec(),
            }))
            .await;
            let missing_ws = matches!(&r, Err(s) if s.code() == Code::NotFound);
            match judge(run, r)? {
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
            command(run, &mut sb, *cmd, by_id(id), Some(id)).await
        }
        Op::ByName { cmd, ws, name } => {
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
async fn client(run: Arc<Run>, index: usize, until: Instant) -> Result<(), String> {
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

fn count_fault(run: &Run, kind: &'static str) {
    *lock(&run.report).faults.entry(kind).or_default() += 1;
}

/// SIGKILLs sbxd and starts it again on the same data dir; clients move to the new address.
async fn restart_sbxd(run: &Run) -> Result<(), String> {
    let mut daemon = run.daemon.write().await;
    daemon.sigkill();
    let n = {
        let mut starts = lock(&run.starts);
        *starts += 1;
        *starts
    };
    let (sbxd, data, parent) = (
        run.sbxd.clone(),
        run.data.clone(),
        run.cgroup_parent.clone(),
    );
    let fresh = tokio::task::spawn_blocking(move || Daemon::start(&sbxd, &data, &parent, n))
        .await
        .map_err(|e| e.to_string())??;
    *run.endpoint.write().unwrap_or_else(|p| p.into_inner()) = fresh.endpoint();
    *daemon = fresh;
    Ok(())
}

/// Faults until `until`: the first two are one of each kind (in seeded order), then seeded.
async fn inject_faults(run: Arc<Run>, until: Instant) -> Result<(), String> {
    let mut rng = Rng::new(run.seed ^ 0xFA17);
    let first_kill_driver = rng.chance(0.5);
    for i in 0..100u32 {
        tokio::time::sleep(Duration::from_millis(1_000 + rng.below(1_500))).await;
        if Instant::now() >= until {
            break;
        }
        let kill_driver = match i {
            0 => first_kill_driver,
            1 => !first_kill_driver,
            _ => rng.chance(0.5),
        };
        if kill_driver {
            if let Some((pid, start)) = managed_driver(&run.data)
                && runs(pid, start)
            {
                kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(|e| e.to_string())?;
                count_fault(&run, "sigkill_driver");
            }
        } else {
            restart_sbxd(&run).await?;
            count_fault(&run, "sigkill_sbxd_and_restart");
        }
    }
    Ok(())
}

/// Once settled, SIGKILL the driver and then sbxd, start sbxd again: every Ready sandbox is
/// Ready again on the very same workload process (re-attached, not restarted).
async fn workloads_survive_both_kills(run: &Run, settled: &[Sandbox]) -> Result<u64, String> {
    let before: Vec<(String, Vec<i32>)> = settled
        .iter()
        .filter(|s| s.phase() == Phase::Ready)
        .map(|s| (s.id.clone(), workload_pids(&run.data, &s.id)))
        .collect();
    if let Some((pid, start)) = managed_driver(&run.data)
        && runs(pid, start)
    {
        kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(|e| e.to_string())?;
    }
    restart_sbxd(run).await?;
    let after = quiesce(run).await?;
    let mut checks = 0;
    for (id, pids) in &before {
        checks += 1;
        let now = workload_pids(&run.data, id);
        let ready = after
            .iter()
            .any(|s| &s.id == id && s.phase() == Phase::Ready);
        if !ready || &now != pids {
            return Err(format!(
                "after SIGKILL of the driver and sbxd, {id} (workloads {pids:?}) is ready: \
                 {ready}, workloads {now:?}"
            ));
        }
    }
    Ok(checks)
}

/// Starts sbxd on a fresh data dir and cgroup parent, with the scenario's workspaces. Drop
/// the answer in reverse order (run, clean-up, dir): sbxd dies before the safety net runs.
async fn start_run(seed: u64) -> Result<(tempfile::TempDir, Cleanup, Arc<Run>), String> {
    let sbxd = sbxd_binary()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().to_path_buf();
    let cgroup_parent = format!(
        "sbx-chaos-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let cleanup = Cleanup {
        data: data.clone(),
        cgroup_parent: cgroup_parent.clone(),
    };
    let daemon = {
        let (sbxd, data, parent) = (sbxd.clone(), data.clone(), cgroup_parent.clone());
        tokio::task::spawn_blocking(move || Daemon::start(&sbxd, &data, &parent, 0))
            .await
            .map_err(|e| e.to_string())??
    };
    let run = Arc::new(Run {
        seed,
        endpoint: std::sync::RwLock::new(daemon.endpoint()),
        daemon: RwLock::new(daemon),
        data,
        cgroup_parent,
        sbxd,
        starts: Mutex::new(0),
        ledger: Mutex::default(),
        report: Mutex::new(Report {
            seed,
            ..Default::default()
        }),
    });
    let (_, mut ws_client) = clients(&run)?;
    for i in 0..WORKSPACES {
        bounded(ws_client.create_workspace(CreateWorkspaceRequest {
            name: ws_name(i),
            ..Default::default()
        }))
        .await
        .map_err(|e| format!("create workspace: {e:?}"))?;
    }
    Ok((dir, cleanup, run))
}

async fn run_seed(seed: u64) -> Result<Report, String> {
    let began = Instant::now();
    let (_dir, _cleanup, run) = start_run(seed).await?;
    let until = Instant::now() + DURATION;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(client(Arc::clone(&run), c, until)))
        .collect();
    let injector = tokio::spawn(inject_faults(Arc::clone(&run), until));
    for t in tasks {
        t.await.map_err(|e| format!("a client panicked: {e}"))??;
    }
    injector
        .await
        .map_err(|e| format!("the injector panicked: {e}"))??;

    let settled = quiesce(&run).await?;
    let mut checks = check_invariants(&run, &settled).await?;
    let ready_at_end = settled.iter().filter(|s| s.phase() == Phase::Ready).count();
    checks += workloads_survive_both_kills(&run, &settled).await?;
    checks += delete_everything(&run).await?;
    let mut report = lock(&run.report).clone();
    report.checks = checks;
    report.sandboxes_at_end = settled.len();
    report.ready_at_end = ready_at_end;
    report.duration = began.elapsed();
    Ok(report)
}

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("SBX_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return vec![seed];
    }
    let rounds: u64 = std::env::var("SBX_CHAOS_PROCESS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2);
    (1..=rounds).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_driver_and_sbxd_keep_every_invariant() {
    for seed in seeds() {
        let report = run_seed(seed).await.unwrap_or_else(|e| {
            panic!("process chaos seed {seed}: {e}\nreplay with SBX_CHAOS_SEED={seed}")
        });
        eprintln!("process chaos seed {}: {report:?}", report.seed);
        assert!(report.checks > 0, "seed {seed}: nothing was checked");
        assert!(
            report.acknowledged > 0,
            "seed {seed}: nothing was acknowledged"
        );
        assert!(
            report.creates_acknowledged > 0,
            "seed {seed}: no create was acknowledged"
        );
        for kind in ["sigkill_driver", "sigkill_sbxd_and_restart"] {
            assert!(
                report.faults.get(kind).copied().unwrap_or(0) > 0,
                "seed {seed}: no {kind} fault: {report:?}"
            );
        }
    }
}

/// The checks bite: against a real sandbox, a record missing from the list is an orphan
/// workload, an acknowledged create nobody deleted must exist, and a healthy state passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checks_catch_an_orphan_workload_and_a_lost_create() {
    let (_dir, _cleanup, run) = start_run(0).await.unwrap();
    let (mut sb, _) = clients(&run).unwrap();
    let created = sb
        .create_sandbox(CreateSandboxRequest {
            workspace: ws_name(0),
            name: sb_name(0),
            spec: spec(),
        })
        .await
        .unwrap()
        .into_inner();
    let settled = quiesce(&run).await.unwrap();
    assert_eq!(settled.len(), 1);
    assert_eq!(workload_pids(&run.data, &created.id).len(), 1);
    assert!(check_invariants(&run, &settled).await.unwrap() > 0);

    // The sandbox left out of the records: its live workload is an orphan.
    let err = check_invariants(&run, &[]).await.unwrap_err();
    assert!(err.contains("without a record"), "{err}");

    // An acknowledged create that is gone though nobody deleted it.
    let lost = uuid::Uuid::new_v4().to_string();
    lock(&run.ledger)
        .created
        .insert(lost.clone(), (ws_name(1), sb_name(1)));
    let err = check_invariants(&run, &settled).await.unwrap_err();
    assert!(err.contains("nobody deleted it"), "{err}");

    // A delete of that name answered before the create was sent does not excuse it…
    let before = Instant::now();
    lock(&run.ledger)
        .delete_requested_names
        .push(((ws_name(1), sb_name(1)), before));
    lock(&run.ledger)
        .created_sent
        .insert(lost.clone(), Instant::now());
    let err = check_invariants(&run, &settled).await.unwrap_err();
    assert!(err.contains("nobody deleted it"), "{err}");
    // …one answered after it was sent does.
    lock(&run.ledger)
        .delete_requested_names
        .push(((ws_name(1), sb_name(1)), Instant::now()));
    check_invariants(&run, &settled).await.unwrap();
    assert!(delete_everything(&run).await.unwrap() > 0);
    assert!(workload_pids(&run.data, &created.id).is_empty());
}
