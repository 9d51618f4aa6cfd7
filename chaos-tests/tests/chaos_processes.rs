//! Process-level chaos: the real `sbxd serve --driver managed:process` on 127.0.0.1:0, tonic
//! clients doing random lifecycle operations across workspaces that reuse the same sandbox
//! names (workload `sleep infinity`), while a seeded injector SIGKILLs the managed driver
//! process and SIGKILLs sbxd (starting it again on the same data dir), at random moments and
//! the moment a create of its own is acknowledged (that sandbox must exist after the
//! restart), and fills the data dir's disk (its own tmpfs) for 1.5 s. Then quiesce and check:
//! acknowledged creates survive unless a delete covered them, no sandbox in a deleted
//! workspace, names unique per workspace, every Ready sandbox has exactly one live workload and
//! every live workload (and every process in a sandbox cgroup) has a record. Then SIGKILL
//! the driver and sbxd once more: every Ready sandbox is Ready again on the very same
//! workload process. Then damage the store (sbxd stopped, backed up, the store put behind its
//! high-water mark): sbxd must refuse it, and `sbxd store restore` of the backup must bring
//! back every sandbox on its very workload (see `process_support/store_damage.rs`). Finally
//! delete everything and check that no process, cgroup (under the
//! run's own parent) or mount (under the data dir) is left, and that sbxd and its driver exit
//! on SIGTERM.
//!
//! Needs root and `cargo build -p sbx-gateway --bin sbxd` first. CI: seeds 1 and 2. More:
//! `SBX_CHAOS_PROCESS_ROUNDS=10`; a soak of seeds 1, 2, 3… until a time budget is spent (each
//! seed complete), with totals printed at the end: `SBX_CHAOS_PROCESS_SECONDS=1800` (run it
//! with `--profile soak --no-capture`); replay one: `SBX_CHAOS_SEED=N`.
//!
//! The clients are in `process_support/client.rs`, the faults in `process_support/faults.rs`,
//! the checks in `process_support/checks.rs`.

mod process_support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use process_support::checks::{check_invariants, clear_ttls, delete_everything, quiesce};
use process_support::client::{
    Ledger, PROBE_WORKSPACE, TtlAsk, bounded, client, clients, sb_name, spec, ws_name,
};
use process_support::disk::{Tmpfs, keep_evidence};
use process_support::faults::{inject_faults, workloads_survive_both_kills};
use process_support::store_damage::damaged_store_is_refused_and_restored;
use process_support::{Cleanup, Daemon, sbxd_binary, workload_pids};
use sbx_proto::v1::{CreateSandboxRequest, CreateWorkspaceRequest, Phase};
use tokio::sync::RwLock;

const WORKSPACES: usize = 3;
const NAMES: usize = 3;
const CLIENTS: usize = 3;
/// How long clients run (and faults are injected) per seed.
const DURATION: Duration = Duration::from_secs(12);
/// Bound of one client call (a driver call times out after 3 s and is retried a few times).
const CALL_TIMEOUT: Duration = Duration::from_secs(20);
/// Bound of the wait for every sandbox to settle once faults stop.
const QUIESCE: Duration = Duration::from_secs(60);

#[derive(Debug, Default, Clone)]
struct Report {
    seed: u64,
    ops: u64,
    acknowledged: u64,
    /// Refusals a client of a faulty system must expect, by gRPC code.
    refused: BTreeMap<String, u64>,
    creates_acknowledged: u64,
    deletes_acknowledged: u64,
    /// Deadlines clients gave (ttls at create, ttl calls), and acknowledged sandboxes gone
    /// with a ttl due (one gone with nothing else to explain it is checked not to be gone
    /// before its deadline).
    ttls_given: usize,
    gone_with_ttl_due: u64,
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
    /// When the run began, to date a violation within it.
    began: Instant,
    ledger: Mutex<Ledger>,
    report: Mutex<Report>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What a run holds besides its [`Run`], dropped after it in this order: the safety net (sbxd
/// dies before it runs), the data dir's tmpfs, the temp dir the tmpfs is mounted in.
struct Holds {
    cleanup: Option<Cleanup>,
    tmpfs: Option<Tmpfs>,
    dir: tempfile::TempDir,
}

/// Starts sbxd on a fresh data dir (its own tmpfs, for the disk-full fault) and cgroup parent,
/// with the scenario's workspaces. Drop the run before what holds it.
async fn start_run(seed: u64) -> Result<(Holds, Arc<Run>), String> {
    let sbxd = sbxd_binary()?;
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let data = dir.path().join("data");
    let tmpfs = Tmpfs::mount(&data)?;
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
        began: Instant::now(),
        ledger: Mutex::default(),
        report: Mutex::new(Report {
            seed,
            ..Default::default()
        }),
    });
    let (_, mut ws_client) = clients(&run)?;
    let names = (0..WORKSPACES).map(ws_name);
    for name in names.chain([PROBE_WORKSPACE.to_string()]) {
        bounded(ws_client.create_workspace(CreateWorkspaceRequest {
            name,
            ..Default::default()
        }))
        .await
        .map_err(|e| format!("create workspace: {e:?}"))?;
    }
    let holds = Holds {
        cleanup: Some(cleanup),
        tmpfs: Some(tmpfs),
        dir,
    };
    Ok((holds, run))
}

/// One seed, start to end. On a violation the data dir (store, driver state, each sbxd
/// start's log) is kept and named in the error; sbxd and every workload are killed first.
async fn run_seed(seed: u64) -> Result<Report, String> {
    let began = Instant::now();
    let (mut holds, run) = start_run(seed).await?;
    let result = exercise(&run, began).await;
    if result.is_err()
        && let Ok(mut daemon) = run.daemon.try_write()
    {
        // Clients of a failed seed may still hold the run: stop sbxd now, not when they end.
        daemon.sigkill();
    }
    let data = run.data.clone();
    drop(run);
    drop(holds.cleanup.take());
    let evidence = holds.dir.path().join("kept");
    if result.is_err() {
        keep_evidence(&data, &evidence);
    }
    drop(holds.tmpfs.take());
    result.map_err(|e| {
        let _ = holds.dir.keep();
        format!(
            "{e}\ndata dir (store, driver state, sbxd logs) copied to {}",
            evidence.display()
        )
    })
}

/// Clients and faults, then quiescence and every check.
async fn exercise(run: &Arc<Run>, began: Instant) -> Result<Report, String> {
    let until = Instant::now() + DURATION;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|c| tokio::spawn(client(Arc::clone(run), c, until)))
        .collect();
    let injector = tokio::spawn(inject_faults(Arc::clone(run), until));
    for t in tasks {
        t.await.map_err(|e| format!("a client panicked: {e}"))??;
    }
    injector
        .await
        .map_err(|e| format!("the injector panicked: {e}"))??;

    let settled = quiesce(run).await?;
    let mut checks = check_invariants(run, &settled).await?;
    // The phases after this one check that sandboxes stay exactly as they are: no deadline
    // may change them meanwhile.
    checks += clear_ttls(run, &settled).await?;
    let settled = quiesce(run).await?;
    let ready_at_end = settled.iter().filter(|s| s.phase() == Phase::Ready).count();
    checks += workloads_survive_both_kills(run, &settled).await?;
    checks += damaged_store_is_refused_and_restored(run, &settled).await?;
    checks += delete_everything(run).await?;
    let mut report = lock(&run.report).clone();
    report.checks = checks;
    report.sandboxes_at_end = settled.len();
    report.ready_at_end = ready_at_end;
    report.duration = began.elapsed();
    Ok(report)
}

/// A number from the environment, if set and well formed.
fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The seeds to run, in order: just `SBX_CHAOS_SEED`; or 1, 2, 3… while less than
/// `SBX_CHAOS_PROCESS_SECONDS` have passed since `started` (checked before each seed, so every
/// seed runs to its end; at most [`MAX_SOAK_SEEDS`]); or 1..=`SBX_CHAOS_PROCESS_ROUNDS`
/// (default 2, the CI profile).
fn seeds(started: Instant) -> Box<dyn Iterator<Item = u64>> {
    if let Some(seed) = env_u64("SBX_CHAOS_SEED") {
        return Box::new(std::iter::once(seed));
    }
    if let Some(seconds) = env_u64("SBX_CHAOS_PROCESS_SECONDS") {
        let budget = Duration::from_secs(seconds);
        return Box::new((1..=MAX_SOAK_SEEDS).take_while(move |_| started.elapsed() < budget));
    }
    Box::new(1..=env_u64("SBX_CHAOS_PROCESS_ROUNDS").unwrap_or(2))
}

/// Bound of a time-budgeted soak, in seeds (one takes well over ten seconds).
const MAX_SOAK_SEEDS: u64 = 100_000;

/// The sum of the reports of every seed of a run, for the closing note of a soak.
#[derive(Debug, Default)]
struct Totals {
    seeds: Vec<u64>,
    ops: u64,
    acknowledged: u64,
    refused: BTreeMap<String, u64>,
    creates_acknowledged: u64,
    deletes_acknowledged: u64,
    faults: BTreeMap<&'static str, u64>,
    checks: u64,
    sandboxes_at_end: u64,
    ready_at_end: u64,
}

impl Totals {
    fn add(&mut self, report: &Report) {
        self.seeds.push(report.seed);
        self.ops += report.ops;
        self.acknowledged += report.acknowledged;
        self.creates_acknowledged += report.creates_acknowledged;
        self.deletes_acknowledged += report.deletes_acknowledged;
        self.checks += report.checks;
        self.sandboxes_at_end += report.sandboxes_at_end as u64;
        self.ready_at_end += report.ready_at_end as u64;
        for (code, n) in &report.refused {
            *self.refused.entry(code.clone()).or_default() += n;
        }
        for (kind, n) in &report.faults {
            *self.faults.entry(kind).or_default() += n;
        }
    }

    /// The closing note, in the style of the `sbx-chaos` binary's.
    fn summary(&self, elapsed: Duration) -> String {
        let first = self.seeds.first().copied().unwrap_or_default();
        let last = self.seeds.last().copied().unwrap_or_default();
        let mut out = format!(
            "process chaos: {} seeds ({first}..={last}) in {elapsed:?}: {} operations ({} \
             acknowledged; {} creates and {} deletes acknowledged), {} sandboxes settled at the \
             ends of the fault phases ({} Ready), {} invariant checks passed, 0 violations",
            self.seeds.len(),
            self.ops,
            self.acknowledged,
            self.creates_acknowledged,
            self.deletes_acknowledged,
            self.sandboxes_at_end,
            self.ready_at_end,
            self.checks,
        );
        for (kind, n) in &self.faults {
            out.push_str(&format!("\n  fault {kind}: {n}"));
        }
        for (code, n) in &self.refused {
            out.push_str(&format!("\n  refused {code}: {n}"));
        }
        out
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_driver_and_sbxd_keep_every_invariant() {
    let started = Instant::now();
    let mut totals = Totals::default();
    for seed in seeds(started) {
        let report = run_seed(seed).await.unwrap_or_else(|e| {
            let before = if totals.seeds.is_empty() {
                String::new()
            } else {
                format!(
                    "\nthe seeds before it: {}",
                    totals.summary(started.elapsed())
                )
            };
            panic!("process chaos seed {seed}: {e}\nreplay with SBX_CHAOS_SEED={seed}{before}")
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
        for kind in [
            "sigkill_driver",
            "sigkill_sbxd_and_restart",
            "sigkill_sbxd_just_after_create_ack",
            "disk_full_for_a_while",
            "store_damaged_then_restored",
        ] {
            assert!(
                report.faults.get(kind).copied().unwrap_or(0) > 0,
                "seed {seed}: no {kind} fault: {report:?}"
            );
        }
        totals.add(&report);
    }
    assert!(!totals.seeds.is_empty(), "no seed ran");
    eprintln!("{}", totals.summary(started.elapsed()));
}

/// The checks bite: against a real sandbox, a record missing from the list is an orphan
/// workload, an acknowledged create nobody deleted must exist, and a healthy state passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checks_catch_an_orphan_workload_and_a_lost_create() {
    let (_holds, run) = start_run(0).await.unwrap();
    let (mut sb, _) = clients(&run).unwrap();
    let created = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: ws_name(0),
            name: sb_name(0),
            spec: spec(),
            stopped: false,
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

    // A sandbox gone when the only thing that could delete it is a ttl not yet due.
    let early = uuid::Uuid::new_v4().to_string();
    {
        let mut ledger = lock(&run.ledger);
        ledger
            .created
            .insert(early.clone(), (ws_name(2), sb_name(2)));
        ledger.ttl_asks.push(TtlAsk {
            target: Ok(early.clone()),
            deletes: true,
            not_before: Instant::now() + Duration::from_secs(60),
            not_after: None,
        });
    }
    let err = check_invariants(&run, &settled).await.unwrap_err();
    assert!(err.contains("before any deadline"), "{err}");
    lock(&run.ledger).ttl_asks.last_mut().unwrap().not_before = Instant::now();
    check_invariants(&run, &settled).await.unwrap();
    // A sandbox that outlived the ttl it was created with.
    lock(&run.ledger)
        .created
        .insert(created.id.clone(), (ws_name(0), sb_name(0)));
    lock(&run.ledger).ttl_asks.push(TtlAsk {
        target: Ok(created.id.clone()),
        deletes: true,
        not_before: Instant::now() - Duration::from_secs(60),
        not_after: Some(Instant::now() - Duration::from_secs(30)),
    });
    let err = check_invariants(&run, &settled).await.unwrap_err();
    assert!(err.contains("outlived its ttl"), "{err}");
    lock(&run.ledger).ttl_asks.pop();
    assert!(delete_everything(&run).await.unwrap() > 0);
    assert!(workload_pids(&run.data, &created.id).is_empty());
}
