//! Three gateways sharing one PostgreSQL and two nodes, black box: three `sbxd serve --store
//! postgres://…` and two `sbxd node --driver process`. Twenty sandboxes created through
//! gateway A land on both nodes; A is killed (SIGKILL) and, through gateway B, all twenty are
//! Ready within the lease period + 5 s, on the same workloads (the same init pids) and with
//! the same generations.
//!
//! "Ready through B" is the answer of a live holder of the workspace (B's own actors, or C's
//! through B's forwarding), not the store's: a list reads the shared store (it
//! shows what A wrote even before B holds the workspace), so B must also answer a lifecycle
//! command for every sandbox — `StartSandbox`, which a gateway that does not hold the
//! workspace forwards to its holder (and, the holder dead, answers UNAVAILABLE) for a
//! workspace it does not hold and which, on a Ready sandbox, changes nothing and answers the
//! sandbox as its actor sees it. Before the kill, B forwarding it to A is asserted.
//!
//! Every process is killed by pid when its guard drops; the nodes' workloads are deleted
//! through B at the end, and killed by the nodes' data dir guards if the test fails first.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::ha::SharedStore;
use common::node::Node;
use common::{DataDir, Sbxd, sbx, workload_pids_in};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{ListSandboxesRequest, Phase, Sandbox, SandboxRef, StartSandboxRequest};
use tonic::transport::Channel;

/// The gateways' lease period, seconds.
const LEASE: u64 = 3;
/// The acceptance criterion's allowance over the lease period.
const ALLOWANCE: Duration = Duration::from_secs(5);
/// How much longer than lease + allowance the poll runs, so that a slow takeover is
/// measured (and reported) rather than only timed out.
const POLL_SLACK: Duration = Duration::from_secs(4);
const SANDBOXES: usize = 20;
/// The deadline of each call to a gateway in the polls.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);

fn gateway(store: &SharedStore, data: &Path, url: &str) -> Sbxd {
    let lease = LEASE.to_string();
    store.gateway(data, url, &["--lease-seconds", &lease, "--node-grace", "3"])
}

/// A process node with room for all twenty sandboxes (1 core and 1 GiB each, the gateway's
/// defaults).
fn process_node(data: &Path) -> (Node, PathBuf) {
    Node::process(data, &["--capacity-cpu", "32", "--capacity-memory", "64Gi"])
}

fn phase(s: &Sandbox) -> Phase {
    Phase::try_from(s.phase).unwrap_or_default()
}

fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.to_string(),
        ..Default::default()
    })
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Every sandbox of every workspace through `client`, by id; an error (or no answer within
/// [`CALL_TIMEOUT`]) as text instead of a panic.
async fn list(
    client: &mut SandboxServiceClient<Channel>,
) -> Result<BTreeMap<String, Sandbox>, String> {
    let call = client.list_sandboxes(ListSandboxesRequest {
        all_workspaces: true,
        page_size: 1000,
        ..Default::default()
    });
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(Ok(listed)) => Ok(listed
            .into_inner()
            .sandboxes
            .into_iter()
            .map(|s| (s.id.clone(), s))
            .collect()),
        Ok(Err(status)) => Err(format!("list: {status:?}")),
        Err(_) => Err(format!("list: no answer within {CALL_TIMEOUT:?}")),
    }
}

/// `StartSandbox` of sandbox `id` through `client`: the sandbox as the gateway's actor
/// answers it, or the error as text.
async fn start(
    client: &mut SandboxServiceClient<Channel>,
    id: &str,
) -> Result<Sandbox, tonic::Status> {
    let call = client.start_sandbox(StartSandboxRequest { sandbox: by_id(id) });
    match tokio::time::timeout(CALL_TIMEOUT, call).await {
        Ok(answer) => answer.map(|r| r.into_inner()),
        Err(_) => Err(tonic::Status::deadline_exceeded(format!(
            "no answer within {CALL_TIMEOUT:?}"
        ))),
    }
}

/// Whether the gateway behind `client` serves all of `ids` Ready: its list has exactly them,
/// all Ready, and its actor of each answers `StartSandbox` with it Ready. Answers the list
/// and the actors' answers, or why not (yet).
async fn served_ready(
    client: &mut SandboxServiceClient<Channel>,
    ids: &[String],
) -> Result<(BTreeMap<String, Sandbox>, BTreeMap<String, Sandbox>), String> {
    let listed = list(client).await?;
    if listed.keys().collect::<Vec<_>>() != ids.iter().collect::<Vec<_>>() {
        return Err(format!(
            "listed {} sandboxes, not the {}",
            listed.len(),
            ids.len()
        ));
    }
    if let Some(s) = listed.values().find(|s| phase(s) != Phase::Ready) {
        return Err(format!("listed {} {:?} ({})", s.name, phase(s), s.reason));
    }
    let mut answered = BTreeMap::new();
    for id in ids {
        let s = start(client, id)
            .await
            .map_err(|status| format!("start {id}: {:?} {}", status.code(), status.message()))?;
        if phase(&s) != Phase::Ready {
            return Err(format!("start {}: {:?} ({})", s.name, phase(&s), s.reason));
        }
        answered.insert(id.clone(), s);
    }
    Ok((listed, answered))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_sandboxes_on_two_nodes_are_ready_through_b_after_sigkill_of_a() {
    let store = SharedStore::start();
    let url = store.database("ha2").await;

    // Two nodes, n1 and n2, each on its own data (and state) dir.
    let node_datas = [DataDir::new(), DataDir::new()];
    let (n1, state1) = process_node(node_datas[0].path());
    let (n2, state2) = process_node(node_datas[1].path());
    let nodes = [("n1", &n1, &state1), ("n2", &n2, &state2)];

    // Gateway A: its own driver cordoned, both nodes registered.
    let a_data = DataDir::new();
    let mut a = gateway(&store, a_data.path(), &url);
    let cordoned = sbx(&a.endpoint(), &["node", "cordon", "local"]);
    assert_eq!(cordoned.code, 0, "{cordoned:?}\n{}", a.log_text());
    for (name, node, _) in &nodes {
        let added = sbx(
            &a.endpoint(),
            &["node", "add", name, "--address", &node.addr, "-o", "json"],
        );
        assert_eq!(added.code, 0, "{added:?}\n{}", a.log_text());
        let json = added.json();
        assert_eq!(json["state"], "Ready", "{json}");
    }
    // Gateway B, once A holds the workspace.
    let b_data = DataDir::new();
    let mut b = gateway(&store, b_data.path(), &url);
    // And gateway C: after A's death, B or C takes the workspace; B serves it either way
    // (its own, or forwarded to C).
    let c_data = DataDir::new();
    let mut c = gateway(&store, c_data.path(), &url);

    // Twenty sandboxes through A, all Ready.
    for i in 0..SANDBOXES {
        let created = sbx(
            &a.endpoint(),
            &[
                "sandbox",
                "create",
                &format!("s{i}"),
                "--driver",
                "process",
                "--",
                "sleep",
                "300",
            ],
        );
        assert_eq!(created.code, 0, "s{i}: {created:?}\n{}", a.log_text());
    }
    let mut through_a = a.sandboxes().await;
    let ready = common::eventually(Duration::from_secs(60), "all 20 Ready through A", || {
        let mut client = through_a.clone();
        async move {
            let all = list(&mut client).await.ok()?;
            (all.len() == SANDBOXES && all.values().all(|s| phase(s) == Phase::Ready))
                .then_some(all)
        }
    })
    .await;
    let ids: Vec<String> = ready.keys().cloned().collect();

    // Both nodes hold some; each sandbox runs on its node (one init there) and not on the
    // other.
    let mut per_node: BTreeMap<String, usize> = BTreeMap::new();
    let mut pids: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for s in ready.values() {
        let i = nodes
            .iter()
            .position(|(name, _, _)| *name == s.node)
            .unwrap_or_else(|| panic!("{} on node {:?}, not n1 or n2", s.name, s.node));
        assert!(!s.node_id.is_empty(), "{} has no node id: {s:?}", s.name);
        *per_node.entry(s.node.clone()).or_default() += 1;
        let here = workload_pids_in(nodes[i].2, &s.id);
        assert_eq!(here.len(), 1, "{} on {}: {here:?}", s.name, s.node);
        assert!(
            workload_pids_in(nodes[1 - i].2, &s.id).is_empty(),
            "{} also runs on the other node",
            s.name
        );
        assert!(s.generation > 0, "{} has no generation: {s:?}", s.name);
        pids.insert(s.id.clone(), here);
    }
    eprintln!("placement through A: {per_node:?}");
    assert_eq!(per_node.len(), 2, "not on both nodes: {per_node:?}");
    assert_eq!(per_node.values().sum::<usize>(), SANDBOXES);
    assert!(per_node.values().all(|&n| n > 0), "{per_node:?}");

    // A answers StartSandbox of a Ready sandbox with it unchanged (the probe used on B below
    // changes nothing); B, not holding the workspace, forwards it to A: the same answer, and
    // B's own actors serve nothing yet.
    let probe = &ids[0];
    let same = start(&mut through_a, probe).await.expect("A answers start");
    assert_eq!(phase(&same), Phase::Ready, "{same:?}");
    assert_eq!(same.generation, ready[probe].generation, "{same:?}");
    let mut through_b = b.sandboxes().await;
    let forwarded = start(&mut through_b, probe).await.expect("B forwards to A");
    assert_eq!(
        (
            forwarded.id.as_str(),
            forwarded.generation,
            phase(&forwarded)
        ),
        (same.id.as_str(), same.generation, Phase::Ready)
    );
    assert!(
        !b.log_text().contains("serving the workspace"),
        "B served before the kill"
    );

    // SIGKILL of A, by pid; then through B, all twenty Ready.
    kill(Pid::from_raw(a.pid()), Signal::SIGKILL).expect("SIGKILL A");
    let killed = Instant::now();
    a.sigkill(); // reaps it
    let limit = Duration::from_secs(LEASE) + ALLOWANCE;
    let mut last = String::new();
    let mut rounds = 0u32;
    let (listed, answered) = loop {
        rounds += 1;
        match served_ready(&mut through_b, &ids).await {
            Ok(served) => break served,
            Err(why) => last = why,
        }
        assert!(
            killed.elapsed() < limit + POLL_SLACK && rounds < 10_000,
            "through B, not all {SANDBOXES} Ready {:?} after SIGKILL of A ({rounds} polls); \
             last: {last}\nB's log:\n{}\nn1's log:\n{}\nn2's log:\n{}",
            killed.elapsed(),
            tail(&b.log_text(), 60),
            tail(&n1.log_text(), 30),
            tail(&n2.log_text(), 30),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let took = killed.elapsed();
    eprintln!(
        "all {SANDBOXES} Ready through B {took:?} after SIGKILL of A (lease {LEASE} s, {rounds} \
         polls; the last refusal: {last})"
    );
    assert!(
        took < limit,
        "all Ready through B only {took:?} after SIGKILL of A (limit {limit:?})\nB's log:\n{}",
        tail(&b.log_text(), 60)
    );

    // The same sandboxes, generations and workloads.
    assert_eq!(
        listed.keys().collect::<Vec<_>>(),
        ids.iter().collect::<Vec<_>>()
    );
    for id in &ids {
        let before = &ready[id];
        for (how, s) in [("listed", &listed[id]), ("answered", &answered[id])] {
            assert_eq!(s.name, before.name, "{how}: {s:?}");
            assert_eq!(s.node, before.node, "{how} {}: {s:?}", s.name);
            assert_eq!(
                s.generation, before.generation,
                "{how} {}: the generation changed",
                s.name
            );
        }
        let (_, _, state) = nodes.iter().find(|(n, _, _)| *n == before.node).unwrap();
        assert_eq!(
            workload_pids_in(state, id),
            pids[id],
            "{} kept its workload",
            before.name
        );
    }
    // B reaches the workloads on both nodes: an exec into one sandbox of each.
    for (name, _, _) in &nodes {
        let s = ready.values().find(|s| s.node == *name).unwrap();
        let ran = sbx(&b.endpoint(), &["sandbox", "exec", &s.name, "--", "true"]);
        assert_eq!(
            ran.code, 0,
            "exec into {} on {name} through B: {ran:?}",
            s.name
        );
    }

    // Clean up through B: nothing is left on either node.
    for s in ready.values() {
        let deleted = sbx(&b.endpoint(), &["sandbox", "delete", &s.name]);
        assert_eq!(deleted.code, 0, "{deleted:?}\n{}", tail(&b.log_text(), 40));
    }
    common::eventually(Duration::from_secs(30), "every sandbox deleted", || {
        let mut client = through_b.clone();
        async move { list(&mut client).await.ok()?.is_empty().then_some(()) }
    })
    .await;
    for data in &node_datas {
        let left = common::all_workload_pids(data.path());
        assert!(left.is_empty(), "workloads left: {left:?}");
    }
    for n in [&n1, &n2] {
        let info = n.plain().node_info().await.unwrap();
        assert_eq!(
            info.token_conflicts, 0,
            "two gateways called under one token"
        );
    }
    let holder = if b.log_text().contains("serving the workspace") {
        "B"
    } else {
        "C"
    };
    eprintln!("the workspace was taken over by {holder}");
    b.sigterm(Duration::from_secs(30));
    c.sigterm(Duration::from_secs(30));
}
