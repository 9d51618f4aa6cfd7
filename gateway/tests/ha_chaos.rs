//! Multi-process chaos of gateways in HA, black box: one PostgreSQL of the test's own, three
//! `sbxd serve --store postgres://…` gateways (A, B, C; lease 3 s, node grace 3 s) and two
//! `sbxd node --driver process` nodes (n1, n2, each on its own state dir and a fixed loopback
//! port, so that one started again comes back where the gateways registered it). Sandboxes
//! (`sleep 600`, on the nodes: the gateways' own drivers are cordoned) go to two workspaces,
//! `default` and `chaos`, so that their holders may differ.
//!
//! Each round creates three sandboxes (`sbx sandbox create -d -o json`) through the gateways
//! in turn — a create that does not succeed is tried again under a new name, and all three
//! must be acknowledged within 30 s of the round's start (the system is back after the last
//! fault) — then injects one fault, cycling through:
//!
//! 1. SIGKILL of a gateway (one that holds a workspace, when its log says so), started again
//!    on its data dir (where its gateway id is kept) 2 s later;
//! 2. SIGSTOP of a gateway (again a holder when there is one) for the lease + 2 s, then
//!    SIGCONT: its lease has passed to another gateway meanwhile, and once it runs again the
//!    nodes refuse whatever it still sends under its old token;
//! 3. SIGKILL of a node, started again 2 s later on its address and state dir;
//! 4. PostgreSQL stopped as a crash (`pg_ctl stop -m immediate`) and started again 1 s later;
//! 5. SIGSTOP of a node for 5 s, then SIGCONT;
//!
//! and, while the fault is in effect, keeps creating (one to three creates) through the
//! gateways that still run. Every create whose `sbx` exits 0 is acknowledged (its name and
//! id recorded); one that fails or does not answer within 20 s may or may not have been made.
//!
//! Then, everything running again, within 90 s every sandbox listed through each of A, B and C
//! (the same set through each) is Ready, and:
//!
//! - every acknowledged create is there exactly once, under the id it was acknowledged with;
//!   nothing is there twice (no two sandboxes of a workspace share a name), and nothing is
//!   there that was never asked for (every sandbox was an attempted create, with its spec:
//!   none was adopted from a workload whose record was lost);
//! - every sandbox has exactly one live workload, on the node its record names, and none on
//!   the other node; every live workload on either node belongs to a listed sandbox;
//! - no node admitted calls under one workspace token from two gateways (`token_conflicts` 0
//!   now, and no "two gateways called under one fencing token" in any log of any of its
//!   runs); the calls the nodes fenced are printed (`fenced_calls`, and refusals counted in
//!   their logs across restarts);
//! - a command through each gateway works (`sbx sandbox get` through A, B and C).
//!
//! Finally every sandbox is deleted, no workload is left on either node, and the gateways stop
//! on SIGTERM.
//!
//! Profiles: `SBX_HA_CHAOS_ROUNDS` sets the number of rounds. The default, 10 (every fault
//! twice: both nodes and more than one gateway hit), is the CI profile: under a minute, well
//! within two. A longer run: `SBX_HA_CHAOS_ROUNDS=15 cargo nextest run -p sbx-gateway --test
//! ha_chaos --no-capture` (three of each fault), or more. Up to six sandboxes are created a
//! round (three before the fault, one to three during it), all kept to the end. Needs what
//! the other HA tests need: PostgreSQL's binaries (Debian's, or `SBX_PG_BIN`) and the `sbx`
//! binary beside `sbxd` (`cargo build -p sbx-cli`).
//!
//! Every process is killed by pid when its guard drops (a stopped one is continued first, by
//! the guard of its pause); the nodes' workloads are killed by their data dirs' guards if the
//! test fails. A failing test prints the journal of faults and the tail of every log (every
//! run of every gateway and node) before it ends.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::ha::SharedStore;
use common::node::Node;
use common::{CliRun, DataDir, SBX, Sbxd, TEST_CGROUP_PARENT, sbx, workload_pids_in};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{DeleteSandboxRequest, ListSandboxesRequest, Phase, Sandbox, SandboxRef};
use tonic::transport::Endpoint;

/// The gateways' lease period, seconds.
const LEASE: u64 = 3;
/// Rounds without `SBX_HA_CHAOS_ROUNDS`: the CI profile.
const DEFAULT_ROUNDS: usize = 10;
/// The workspaces sandboxes are created in, in turn.
const WORKSPACES: [&str; 2] = ["default", "chaos"];
/// Creates acknowledged at the start of each round, before its fault.
const CREATES_BEFORE: usize = 3;
/// The most creates sent while one fault is in effect (at least one is).
const MAX_CREATES_DURING: usize = 3;
/// How long one `sbx sandbox create` may take; after it, it is killed (by pid) and the
/// create counts as not acknowledged.
const CREATE_LIMIT: Duration = Duration::from_secs(20);
/// How long after a fault a create must be acknowledged again (tries included).
const RECOVERY_LIMIT: Duration = Duration::from_secs(30);
/// How long every sandbox may take to be Ready once the faults end.
const SETTLE_LIMIT: Duration = Duration::from_secs(90);
/// The deadline of one gRPC call of the test (a list, a delete, a node's info).
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Every node's capacity, far more than all the sandboxes of a soak take (1 core, 1 GiB each).
const NODE_CPU: &str = "256";
const NODE_MEMORY: &str = "256Gi";
/// The workload of every sandbox.
const WORKLOAD: [&str; 2] = ["sleep", "600"];
/// What a node logs for an admitted call under a token another gateway called under first.
const CONFLICT_LINE: &str = "two gateways called under one fencing token";
/// What a node logs for a call it fenced.
const FENCED_LINE: &str = "refused a call from a former holder";

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillGateway,
    PauseGateway,
    KillNode,
    RestartPostgres,
    PauseNode,
}

const FAULTS: [Fault; 5] = [
    Fault::KillGateway,
    Fault::PauseGateway,
    Fault::KillNode,
    Fault::RestartPostgres,
    Fault::PauseNode,
];

const GATEWAYS: [&str; 3] = ["A", "B", "C"];
const NODES: [&str; 2] = ["n1", "n2"];

/// What happened, in order, and where every process logged: printed (with the logs' tails)
/// when the test fails, before the data dirs holding the logs go.
struct Journal {
    began: Instant,
    events: Mutex<Vec<String>>,
    logs: Mutex<Vec<(String, PathBuf)>>,
}

impl Journal {
    fn new() -> Arc<Journal> {
        Arc::new(Journal {
            began: Instant::now(),
            events: Mutex::new(Vec::new()),
            logs: Mutex::new(Vec::new()),
        })
    }

    fn note(&self, what: impl Into<String>) {
        let line = format!("{:>7.2?} {}", self.began.elapsed(), what.into());
        eprintln!("chaos: {line}");
        self.events.lock().unwrap().push(line);
    }

    fn log(&self, label: impl Into<String>, path: PathBuf) {
        self.logs.lock().unwrap().push((label.into(), path));
    }
}

/// Prints the journal and the logs' tails if the test is failing when it drops. Declared after
/// the data dirs, so it drops (and reads the logs) before they are removed.
struct DumpOnPanic(Arc<Journal>);

impl Drop for DumpOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let journal = &self.0;
        eprintln!("==== ha_chaos failed; the journal of the run:");
        for line in journal
            .events
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            eprintln!("  {line}");
        }
        for (label, path) in journal
            .logs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
        {
            let text = std::fs::read_to_string(path).unwrap_or_default();
            eprintln!("==== {label} ({}), the last 60 lines:", path.display());
            eprintln!("{}", tail(&text, 60));
        }
    }
}

/// A process stopped with SIGSTOP: continued (SIGCONT, by pid) by [`Paused::resume`], or when
/// dropped (a failing assertion never leaves it stopped for the guards that kill it).
struct Paused {
    pid: i32,
    resumed: bool,
}

impl Paused {
    fn stop(pid: i32) -> Paused {
        kill(Pid::from_raw(pid), Signal::SIGSTOP).expect("SIGSTOP");
        Paused {
            pid,
            resumed: false,
        }
    }

    fn resume(mut self) {
        kill(Pid::from_raw(self.pid), Signal::SIGCONT).expect("SIGCONT");
        self.resumed = true;
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if !self.resumed {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGCONT);
        }
    }
}

/// A node that can be killed and started again on the same address and state dir.
struct ChaosNode {
    name: &'static str,
    data: PathBuf,
    state: PathBuf,
    listen: String,
    node: Node,
}

impl ChaosNode {
    fn start(name: &'static str, data: &Path, journal: &Journal) -> ChaosNode {
        let listen = format!("127.0.0.1:{}", free_port());
        let state = data.join("drivers/process");
        let node = start_node(data, &state, &listen);
        journal.log(format!("node {name}"), node_log(data, None));
        ChaosNode {
            name,
            data: data.to_path_buf(),
            state,
            listen,
            node,
        }
    }

    fn pid(&self) -> i32 {
        self.node.child.id() as i32
    }

    /// SIGKILL, by pid, and reap.
    fn sigkill(&mut self) {
        let _ = self.node.child.kill();
        let _ = self.node.child.wait();
    }

    /// Starts the node again on its address and state dir (after [`ChaosNode::sigkill`]).
    fn restart(&mut self, journal: &Journal) {
        let before: BTreeSet<PathBuf> = node_logs(&self.data).into_iter().collect();
        self.node = start_node(&self.data, &self.state, &self.listen);
        journal.log(format!("node {} (again)", self.name), {
            node_log(&self.data, Some(&before))
        });
    }
}

/// A port of 127.0.0.1 free now (bound and let go), below the kernel's range of ephemeral
/// ports: while its node is down, no outgoing connection is given it, so the node can bind it
/// again. Tried from a start of this process's own, at most 500 ports; else one the kernel
/// picks.
fn free_port() -> u16 {
    let low: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse().ok())
        .unwrap_or(32768);
    if low > 12_000 {
        let span = u32::from(low) - 10_000;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .subsec_nanos();
        let start = (std::process::id().wrapping_mul(7919) ^ nanos) % span;
        for k in 0..500 {
            let port = 10_000 + ((start + k * 37) % span) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return port;
            }
        }
    }
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    listener.local_addr().expect("local address").port()
}

/// `sbxd node --driver process` over `data` (its state in `state`) on `listen`, as
/// `Node::process` starts one but on a fixed address. A stale address file is removed first,
/// so the start waits for this run's.
fn start_node(data: &Path, state: &Path, listen: &str) -> Node {
    std::fs::create_dir_all(state).unwrap();
    let _ = std::fs::remove_file(data.join("addr"));
    let node = Node::start(
        data,
        &[
            "--driver",
            "process",
            "--state-dir",
            state.to_str().unwrap(),
            "--listen",
            listen,
            "--auth",
            "none",
            "--cgroup-parent",
            TEST_CGROUP_PARENT,
            "--capacity-cpu",
            NODE_CPU,
            "--capacity-memory",
            NODE_MEMORY,
        ],
    );
    assert_eq!(node.addr, listen, "the node serves where it was told");
    node
}

/// Every log of every run of the node over `data` (`node-*.log`).
fn node_logs(data: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(data)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("node-") && name.ends_with(".log")
        })
        .collect()
}

/// The log of the node's latest run: the one not in `before`.
fn node_log(data: &Path, before: Option<&BTreeSet<PathBuf>>) -> PathBuf {
    node_logs(data)
        .into_iter()
        .find(|p| before.is_none_or(|b| !b.contains(p)))
        .unwrap_or_else(|| data.join("node-?.log"))
}

/// How many lines with `needle` the logs of every run of the node over `data` have.
fn count_in_node_logs(data: &Path, needle: &str) -> usize {
    node_logs(data)
        .iter()
        .map(|p| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.contains(needle))
                .count()
        })
        .sum()
}

fn gateway(store: &SharedStore, data: &Path, url: &str) -> Sbxd {
    let lease = LEASE.to_string();
    store.gateway(data, url, &["--lease-seconds", &lease, "--node-grace", "3"])
}

/// The workspaces (ids) a gateway's log says it serves now: the last of "serving the
/// workspace" and "letting the workspace go" for each is the first.
fn held_by(d: &Sbxd) -> BTreeSet<String> {
    let mut held = BTreeSet::new();
    for line in d.log_text().lines() {
        let Some(ws) = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("workspace="))
        else {
            continue;
        };
        if line.contains("serving the workspace") {
            held.insert(ws.to_string());
        } else if line.contains("letting the workspace go") {
            held.remove(ws);
        }
    }
    held
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs `sbx ARGS` against `endpoint`, at most `limit`: `None` when it ran over (then it is
/// killed, by pid).
fn sbx_within(endpoint: &str, args: &[&str], limit: Duration) -> Option<CliRun> {
    let mut child = Command::new(SBX)
        .args(args)
        .env("SBX_ENDPOINT", endpoint)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sbx");
    let stdout = child.stdout.take().expect("stdout");
    let stderr = child.stderr.take().expect("stderr");
    let out = std::thread::spawn(move || std::io::read_to_string(stdout).unwrap_or_default());
    let err = std::thread::spawn(move || std::io::read_to_string(stderr).unwrap_or_default());
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break Some(status);
        }
        if began.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let stdout = out.join().unwrap_or_default();
    let stderr = err.join().unwrap_or_default();
    status.map(|status| CliRun {
        code: status.code().unwrap_or(-1),
        stdout,
        stderr,
    })
}

#[derive(Debug, Clone)]
enum Outcome {
    /// `sbx` exited 0 with the sandbox: its id.
    Acknowledged(String),
    /// `sbx` failed: the first line of what it said.
    Refused(String),
    /// No answer within [`CREATE_LIMIT`].
    TimedOut,
}

#[derive(Debug, Clone)]
struct Attempt {
    workspace: &'static str,
    name: String,
    via: &'static str,
    outcome: Outcome,
    took: Duration,
}

/// `sbx sandbox create -w WS NAME --driver process -d -o json -- sleep 600` through `endpoint`
/// (gateway `via`), bounded by [`CREATE_LIMIT`].
fn create(via: &'static str, endpoint: &str, workspace: &'static str, name: String) -> Attempt {
    let began = Instant::now();
    let args: Vec<&str> = ["sandbox", "create", "-w", workspace, &name]
        .into_iter()
        .chain(["--driver", "process", "-d", "-o", "json", "--"])
        .chain(WORKLOAD)
        .collect();
    let run = sbx_within(endpoint, &args, CREATE_LIMIT);
    drop(args);
    let outcome = match run {
        None => Outcome::TimedOut,
        Some(run) if run.code == 0 => {
            let json: serde_json::Value = serde_json::from_str(&run.stdout)
                .unwrap_or_else(|e| panic!("create {name} exited 0 without JSON ({e}): {run:?}"));
            assert_eq!(json["name"], name.as_str(), "{json}");
            let id = json["id"].as_str().unwrap_or_default().to_string();
            assert!(!id.is_empty(), "create {name} answered no id: {json}");
            Outcome::Acknowledged(id)
        }
        Some(run) => Outcome::Refused(format!(
            "exit {}: {}",
            run.code,
            run.stderr.lines().next().unwrap_or_default()
        )),
    };
    Attempt {
        workspace,
        name,
        via,
        outcome,
        took: began.elapsed(),
    }
}

/// Creates while a fault is in effect, from a thread of its own: through `targets` in turn,
/// one create at a time, a second apart, until told to stop (after one at least) or
/// [`MAX_CREATES_DURING`] were sent.
struct Creator {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Vec<Attempt>>,
}

impl Creator {
    fn start(
        targets: Vec<(&'static str, String)>,
        round: usize,
        first_workspace: usize,
        journal: Arc<Journal>,
    ) -> Creator {
        assert!(!targets.is_empty(), "no live gateway to create through");
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut attempts = Vec::new();
                for k in 0..MAX_CREATES_DURING {
                    if k > 0 && stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let (via, endpoint) = &targets[k % targets.len()];
                    let workspace = WORKSPACES[(first_workspace + k) % WORKSPACES.len()];
                    let attempt = create(via, endpoint, workspace, format!("r{round}-d{k}"));
                    journal.note(format!(
                        "  during the fault: {workspace}/{} through {via}: {:?} in {:.1?}",
                        attempt.name, attempt.outcome, attempt.took
                    ));
                    attempts.push(attempt);
                    // A second to the next, or less if the fault ends.
                    for _ in 0..20 {
                        if stop.load(Ordering::SeqCst) {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(50));
                    }
                }
                attempts
            })
        };
        Creator { stop, thread }
    }

    /// Tells it to stop and answers its attempts (each is bounded, so this is too).
    fn finish(self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("the creator thread panicked")
    }
}

/// What the test asked for and what it was told.
#[derive(Default)]
struct Ledger {
    /// (workspace, name) → id, of every acknowledged create.
    acknowledged: BTreeMap<(String, String), String>,
    /// (workspace, name) of every create not acknowledged: made, or not.
    maybe: BTreeSet<(String, String)>,
    /// Why creates were not acknowledged (the error's reason, or no answer), and how often.
    refusals: BTreeMap<String, usize>,
    /// Acknowledged and sent creates while each fault was in effect.
    during: BTreeMap<Fault, (usize, usize)>,
}

impl Ledger {
    fn record(&mut self, attempt: &Attempt, during: Option<Fault>) -> bool {
        let key = (attempt.workspace.to_string(), attempt.name.clone());
        let acknowledged = match &attempt.outcome {
            Outcome::Acknowledged(id) => {
                let earlier = self.acknowledged.insert(key, id.clone());
                assert!(earlier.is_none(), "{} created twice", attempt.name);
                true
            }
            Outcome::Refused(why) => {
                self.maybe.insert(key);
                // `error: REASON: …` counted by its reason (the whole line when it has none).
                let reason = why
                    .split_once("error: ")
                    .and_then(|(_, rest)| rest.split_once(':'))
                    .map_or(why.as_str(), |(reason, _)| reason);
                *self.refusals.entry(reason.to_string()).or_default() += 1;
                false
            }
            Outcome::TimedOut => {
                self.maybe.insert(key);
                *self
                    .refusals
                    .entry(format!("no answer within {CREATE_LIMIT:?}"))
                    .or_default() += 1;
                false
            }
        };
        if let Some(fault) = during {
            let counts = self.during.entry(fault).or_default();
            counts.1 += 1;
            if acknowledged {
                counts.0 += 1;
            }
        }
        acknowledged
    }
}

fn phase(s: &Sandbox) -> Phase {
    Phase::try_from(s.phase).unwrap_or_default()
}

/// Every sandbox of every workspace through `endpoint` (one page); an error, or no answer
/// within [`CALL_TIMEOUT`], as text.
async fn list(endpoint: &str) -> Result<Vec<Sandbox>, String> {
    let call = async {
        let channel = Endpoint::from_shared(endpoint.to_string())
            .map_err(|e| e.to_string())?
            .connect_timeout(CALL_TIMEOUT)
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let listed = SandboxServiceClient::new(channel)
            .list_sandboxes(ListSandboxesRequest {
                all_workspaces: true,
                page_size: 1000,
                ..Default::default()
            })
            .await
            .map_err(|s| format!("list: {:?} {}", s.code(), s.message()))?
            .into_inner();
        assert!(
            listed.next_page_token.is_empty(),
            "more than one page of sandboxes"
        );
        Ok(listed.sandboxes)
    };
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .unwrap_or_else(|_| Err(format!("list: no answer within {CALL_TIMEOUT:?}")))
}

/// The lists through every gateway when they agree and every sandbox is Ready; else why not.
async fn settled(gateways: &[Sbxd]) -> Result<Vec<Sandbox>, String> {
    let mut first: Option<Vec<Sandbox>> = None;
    for (label, g) in GATEWAYS.iter().zip(gateways) {
        let listed = list(&g.endpoint())
            .await
            .map_err(|e| format!("through {label}: {e}"))?;
        let not_ready: Vec<String> = listed
            .iter()
            .filter(|s| phase(s) != Phase::Ready)
            .map(|s| {
                format!(
                    "{}/{} {:?} on {} ({}: {})",
                    s.workspace,
                    s.name,
                    phase(s),
                    s.node,
                    s.reason,
                    s.message
                )
            })
            .collect();
        if !not_ready.is_empty() {
            return Err(format!(
                "through {label}, {} of {} not Ready: {not_ready:?}",
                not_ready.len(),
                listed.len()
            ));
        }
        let ids = |l: &[Sandbox]| l.iter().map(|s| s.id.clone()).collect::<BTreeSet<_>>();
        match &first {
            None => first = Some(listed),
            Some(seen) if ids(seen) != ids(&listed) => {
                return Err(format!(
                    "through {label}, {} sandboxes; through A, {}",
                    listed.len(),
                    seen.len()
                ));
            }
            Some(_) => {}
        }
    }
    Ok(first.unwrap_or_default())
}

/// What each node's info says: (fenced_calls, token_conflicts).
async fn node_counts(node: &Node) -> Result<(u64, u64), String> {
    match tokio::time::timeout(CALL_TIMEOUT, node.plain().node_info()).await {
        Ok(Ok(info)) => Ok((info.fenced_calls, info.token_conflicts)),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("no answer within {CALL_TIMEOUT:?}")),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_nodes_and_postgres_killed_and_paused_lose_nothing_acknowledged() {
    let rounds: usize = match std::env::var("SBX_HA_CHAOS_ROUNDS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("SBX_HA_CHAOS_ROUNDS={v:?} is not a number")),
        Err(_) => DEFAULT_ROUNDS,
    };
    let began = Instant::now();
    let mut store = SharedStore::start();
    let url = store.database("chaos").await;
    let node_datas = [DataDir::new(), DataDir::new()];
    let gateway_datas = [DataDir::new(), DataDir::new(), DataDir::new()];
    let journal = Journal::new();
    let _dump = DumpOnPanic(Arc::clone(&journal));
    journal.note(format!("{rounds} rounds"));

    let mut nodes: Vec<ChaosNode> = NODES
        .iter()
        .zip(&node_datas)
        .map(|(name, data)| ChaosNode::start(name, data.path(), &journal))
        .collect();

    // A first: its own driver cordoned, both nodes added, the second workspace made; then B
    // and C.
    let mut gateways: Vec<Sbxd> = Vec::new();
    gateways.push(gateway(&store, gateway_datas[0].path(), &url));
    journal.log("gateway A", gateways[0].log.clone());
    let a = gateways[0].endpoint();
    let cordoned = sbx(&a, &["node", "cordon", "local"]);
    assert_eq!(cordoned.code, 0, "{cordoned:?}");
    for n in &nodes {
        let added = sbx(
            &a,
            &["node", "add", n.name, "--address", &n.listen, "-o", "json"],
        );
        assert_eq!(added.code, 0, "{added:?}");
        assert_eq!(added.json()["state"], "Ready", "{added:?}");
    }
    let made = sbx(&a, &["workspace", "create", WORKSPACES[1]]);
    assert_eq!(made.code, 0, "{made:?}");
    for (i, data) in gateway_datas.iter().enumerate().skip(1) {
        gateways.push(gateway(&store, data.path(), &url));
        journal.log(format!("gateway {}", GATEWAYS[i]), gateways[i].log.clone());
    }
    journal.note(format!(
        "up in {:.1?}: gateways {:?}, nodes {:?}",
        began.elapsed(),
        gateways.iter().map(|g| g.addr.clone()).collect::<Vec<_>>(),
        nodes.iter().map(|n| n.listen.clone()).collect::<Vec<_>>()
    ));

    let mut ledger = Ledger::default();
    let mut turn = 0usize; // the next gateway (and workspace) to create through
    let mut gateway_kills = 0usize;
    let mut gateway_pauses = 0usize;
    let mut node_kills = 0usize;
    let mut node_pauses = 0usize;
    let mut fault_before: Option<Fault> = None;
    for round in 0..rounds {
        // Creates before the fault, each tried again (under a new name) until acknowledged.
        let round_began = Instant::now();
        for k in 0..CREATES_BEFORE {
            for attempt_no in 0.. {
                let g = turn % GATEWAYS.len();
                let workspace = WORKSPACES[turn % WORKSPACES.len()];
                turn += 1;
                let attempt = create(
                    GATEWAYS[g],
                    &gateways[g].endpoint(),
                    workspace,
                    format!("r{round}-b{k}-t{attempt_no}"),
                );
                if !matches!(attempt.outcome, Outcome::Acknowledged(_)) {
                    journal.note(format!(
                        "  before the fault: {workspace}/{} through {}: {:?} in {:.1?}",
                        attempt.name, attempt.via, attempt.outcome, attempt.took
                    ));
                }
                if ledger.record(&attempt, None) {
                    break;
                }
                assert!(
                    round_began.elapsed() < RECOVERY_LIMIT && attempt_no < 60,
                    "round {round}: no create acknowledged within {RECOVERY_LIMIT:?} (after \
                     {fault_before:?}); the last: {attempt:?}"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }

        // The fault, and creates while it is in effect.
        let fault = FAULTS[round % FAULTS.len()];
        let live = |except: Option<usize>| -> Vec<(&'static str, String)> {
            (0..GATEWAYS.len())
                .filter(|&i| Some(i) != except)
                .map(|i| (GATEWAYS[i], gateways[i].endpoint()))
                .collect()
        };
        let fault_began = Instant::now();
        let attempts = match fault {
            Fault::KillGateway | Fault::PauseGateway => {
                // A holder of a workspace when the logs name one, else any gateway: kills
                // from the first on, pauses from the second, in turn.
                let nth = if fault == Fault::KillGateway {
                    gateway_kills += 1;
                    gateway_kills - 1
                } else {
                    gateway_pauses += 1;
                    gateway_pauses
                };
                let holding: Vec<usize> = (0..GATEWAYS.len())
                    .filter(|&i| !held_by(&gateways[i]).is_empty())
                    .collect();
                let target = if holding.is_empty() {
                    nth % GATEWAYS.len()
                } else {
                    holding[nth % holding.len()]
                };
                let label = GATEWAYS[target];
                let creator = Creator::start(live(Some(target)), round, turn, journal.clone());
                if fault == Fault::KillGateway {
                    journal.note(format!(
                        "round {round}: SIGKILL gateway {label} (pid {}, holding {:?})",
                        gateways[target].pid(),
                        held_by(&gateways[target])
                    ));
                    gateways[target].sigkill();
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    gateways[target] = gateway(&store, gateway_datas[target].path(), &url);
                    journal.log(
                        format!("gateway {label} (again)"),
                        gateways[target].log.clone(),
                    );
                    journal.note(format!(
                        "round {round}: gateway {label} started again at {}",
                        gateways[target].addr
                    ));
                } else {
                    let pause = Duration::from_secs(LEASE + 2);
                    journal.note(format!(
                        "round {round}: SIGSTOP gateway {label} for {pause:?} (pid {}, \
                         holding {:?})",
                        gateways[target].pid(),
                        held_by(&gateways[target])
                    ));
                    let paused = Paused::stop(gateways[target].pid());
                    tokio::time::sleep(pause).await;
                    paused.resume();
                    journal.note(format!("round {round}: SIGCONT gateway {label}"));
                }
                creator.finish()
            }
            Fault::KillNode | Fault::PauseNode => {
                // Kills from n1 on, pauses from n2 on: each node gets both.
                let i = if fault == Fault::KillNode {
                    node_kills += 1;
                    (node_kills - 1) % nodes.len()
                } else {
                    node_pauses += 1;
                    node_pauses % nodes.len()
                };
                let n = &mut nodes[i];
                let creator = Creator::start(live(None), round, turn, journal.clone());
                if fault == Fault::KillNode {
                    let counts = node_counts(&n.node).await;
                    journal.note(format!(
                        "round {round}: SIGKILL node {} (pid {}; fenced calls, token \
                         conflicts of this run: {counts:?})",
                        n.name,
                        n.pid()
                    ));
                    n.sigkill();
                    tokio::time::sleep(Duration::from_secs(2)).await;
                    n.restart(&journal);
                    journal.note(format!(
                        "round {round}: node {} started again on {}",
                        n.name, n.listen
                    ));
                } else {
                    journal.note(format!(
                        "round {round}: SIGSTOP node {} for 5s (pid {})",
                        n.name,
                        n.pid()
                    ));
                    let paused = Paused::stop(n.pid());
                    tokio::time::sleep(Duration::from_secs(5)).await;
                    paused.resume();
                    journal.note(format!("round {round}: SIGCONT node {}", n.name));
                }
                creator.finish()
            }
            Fault::RestartPostgres => {
                let creator = Creator::start(live(None), round, turn, journal.clone());
                journal.note(format!("round {round}: PostgreSQL stopped (immediate)"));
                store.server.stop("immediate").expect("stop PostgreSQL");
                tokio::time::sleep(Duration::from_secs(1)).await;
                store.server.start_again().expect("start PostgreSQL again");
                journal.note(format!("round {round}: PostgreSQL started again"));
                creator.finish()
            }
        };
        for attempt in &attempts {
            ledger.record(attempt, Some(fault));
        }
        turn += attempts.len();
        journal.note(format!(
            "round {round} done: {fault:?} for {:.1?}, {} creates during it",
            fault_began.elapsed(),
            attempts.len()
        ));
        fault_before = Some(fault);
    }
    let chaos_took = began.elapsed();

    // Everything runs again: every sandbox settles, Ready, the same through every gateway.
    journal.note("settling");
    let settle_began = Instant::now();
    let mut polls = 0u32;
    let listed = loop {
        polls += 1;
        let last = match settled(&gateways).await {
            Ok(listed) => break listed,
            Err(why) => why,
        };
        assert!(
            settle_began.elapsed() < SETTLE_LIMIT && polls < 10_000,
            "not every sandbox Ready through every gateway {SETTLE_LIMIT:?} after the last \
             fault ({fault_before:?}); last: {last}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let settle_took = settle_began.elapsed();
    journal.note(format!(
        "settled in {settle_took:.1?}: {} sandboxes Ready",
        listed.len()
    ));

    // (a) Nothing acknowledged lost, nothing twice, nothing never asked for.
    let mut by_name: BTreeMap<(String, String), Vec<&Sandbox>> = BTreeMap::new();
    for s in &listed {
        by_name
            .entry((s.workspace.clone(), s.name.clone()))
            .or_default()
            .push(s);
    }
    for (key, found) in &by_name {
        assert_eq!(
            found.len(),
            1,
            "{key:?} is there {} times: {found:?}",
            found.len()
        );
        assert!(
            ledger.acknowledged.contains_key(key) || ledger.maybe.contains(key),
            "{key:?} is there, but no create of it was sent: {:?}",
            found[0]
        );
        let spec = found[0].spec.clone().unwrap_or_default();
        assert_eq!(
            (spec.command.as_slice(), spec.driver.as_str()),
            (&WORKLOAD.map(String::from)[..], "process"),
            "{key:?} lost its spec (adopted?): {:?}",
            found[0]
        );
    }
    for (key, id) in &ledger.acknowledged {
        let found = by_name
            .get(key)
            .unwrap_or_else(|| panic!("acknowledged create {key:?} ({id}) is lost"));
        assert_eq!(
            &found[0].id, id,
            "acknowledged create {key:?} has another id"
        );
    }
    let maybe_there: Vec<String> = ledger
        .maybe
        .iter()
        .filter(|k| by_name.contains_key(*k))
        .map(|(ws, name)| format!("{ws}/{name}"))
        .collect();

    // (b) One workload per sandbox, on its node only; no workload without a sandbox.
    let ids: BTreeSet<&str> = listed.iter().map(|s| s.id.as_str()).collect();
    let mut per_node: BTreeMap<&str, usize> = BTreeMap::new();
    for s in &listed {
        let i = NODES
            .iter()
            .position(|n| *n == s.node)
            .unwrap_or_else(|| panic!("{}/{} on node {:?}", s.workspace, s.name, s.node));
        let here = workload_pids_in(&nodes[i].state, &s.id);
        let there = workload_pids_in(&nodes[1 - i].state, &s.id);
        assert_eq!(
            (here.len(), there.len()),
            (1, 0),
            "{}/{} ({}) on {}: workloads there {here:?}, on the other node {there:?}",
            s.workspace,
            s.name,
            s.id,
            s.node
        );
        *per_node.entry(NODES[i]).or_default() += 1;
    }
    for n in &nodes {
        for entry in std::fs::read_dir(n.state.join("sandboxes"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let id = entry.file_name().to_string_lossy().to_string();
            let pids = workload_pids_in(&n.state, &id);
            assert!(
                pids.is_empty() || ids.contains(id.as_str()),
                "a workload without a sandbox on {}: {id} ({pids:?})",
                n.name
            );
        }
    }

    // (c) No two gateways acted under one token; what the nodes fenced.
    let mut fenced = Vec::new();
    for n in &nodes {
        let (calls, conflicts) = node_counts(&n.node)
            .await
            .unwrap_or_else(|e| panic!("node {} info: {e}", n.name));
        assert_eq!(
            conflicts, 0,
            "node {} admitted calls under one token from two gateways",
            n.name
        );
        let logged_conflicts = count_in_node_logs(&n.data, CONFLICT_LINE);
        assert_eq!(
            logged_conflicts, 0,
            "node {} logged {CONFLICT_LINE:?} (in one of its runs)",
            n.name
        );
        let logged_fenced = count_in_node_logs(&n.data, FENCED_LINE);
        fenced.push(format!(
            "{}: fenced_calls {calls} (this run), {logged_fenced} fenced in all its runs",
            n.name
        ));
    }

    // (d) A command through each gateway works.
    let probes = WORKSPACES
        .iter()
        .filter_map(|ws| ledger.acknowledged.iter().find(|((w, _), _)| w == ws));
    for (key, id) in probes {
        for (label, g) in GATEWAYS.iter().zip(&gateways) {
            let got = sbx_within(
                &g.endpoint(),
                &["sandbox", "get", "-w", &key.0, &key.1, "-o", "json"],
                CREATE_LIMIT,
            )
            .unwrap_or_else(|| panic!("get {key:?} through {label}: no answer"));
            assert_eq!(got.code, 0, "get {key:?} through {label}: {got:?}");
            assert_eq!(got.json()["id"], id.as_str(), "through {label}");
        }
    }

    let during: BTreeMap<String, String> = ledger
        .during
        .iter()
        .map(|(f, (ok, sent))| (format!("{f:?}"), format!("{ok}/{sent}")))
        .collect();
    eprintln!(
        "ha_chaos: {rounds} rounds in {chaos_took:.1?}; {} creates acknowledged, {} not \
         ({} of them made anyway: {maybe_there:?}); acknowledged/sent while each fault was in \
         effect: {during:?}; not acknowledged, why: {:?}; settled in {settle_took:.1?}; \
         sandboxes per node {per_node:?}; {}",
        ledger.acknowledged.len(),
        ledger.maybe.len(),
        maybe_there.len(),
        ledger.refusals,
        fenced.join("; ")
    );

    // Clean up: every sandbox deleted, no workload left, the gateways stop on SIGTERM.
    journal.note("deleting every sandbox");
    let a = gateways[0].endpoint();
    let channel = Endpoint::from_shared(a.clone())
        .unwrap()
        .connect_timeout(CALL_TIMEOUT)
        .connect()
        .await
        .expect("connect to A");
    let mut client = SandboxServiceClient::new(channel);
    for s in &listed {
        let deleted = tokio::time::timeout(
            Duration::from_secs(30),
            client.delete_sandbox(DeleteSandboxRequest {
                sandbox: Some(SandboxRef {
                    id: s.id.clone(),
                    ..Default::default()
                }),
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("delete of {} did not answer in 30 s", s.name));
        assert!(deleted.is_ok(), "delete {}: {deleted:?}", s.name);
    }
    common::eventually(Duration::from_secs(60), "every sandbox deleted", || {
        let a = a.clone();
        async move { list(&a).await.ok()?.is_empty().then_some(()) }
    })
    .await;
    common::eventually(Duration::from_secs(10), "no workload left", || async {
        node_datas
            .iter()
            .all(|d| common::all_workload_pids(d.path()).is_empty())
            .then_some(())
    })
    .await;
    for (label, g) in GATEWAYS.iter().zip(gateways.iter_mut()) {
        let (took, status) = g.sigterm(Duration::from_secs(30));
        journal.note(format!("gateway {label} stopped in {took:.1?}: {status}"));
    }
    eprintln!("ha_chaos: done in {:.1?}", began.elapsed());
}
