//! Many machines on one, black box: a gateway (`sbxd serve`) and two nodes (`sbxd node
//! --driver process`, each on its own state dir), joined by mutual TLS with certificates of
//! `sbxd certs init`, and registered with `sbx node add`. Sandboxes spread over both nodes,
//! each runs where its record says; a node killed (SIGKILL) leaves its sandboxes Unknown within
//! the grace period and the other node's untouched, and the node started again on its state
//! dir and address brings them back Ready with the same workload pids.
//!
//! Every process is killed by pid when its guard drops; a node's leftover workloads are killed
//! by its data dir's guard (its state dir is where `common::all_workload_pids` looks).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::node::Node;
use common::{DataDir, Sbxd, eventually, sbx, workload_pids_in};
use sbx_proto::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, Phase, Sandbox, SandboxRef, SandboxSpec,
};

const SANDBOXES: usize = 20;

/// A process node over `data` (its state in DATA/drivers/process) on `listen`, with mutual
/// TLS from `tls`.
fn process_node(data: &Path, listen: &str, tls: &Path) -> Node {
    let state = data.join("drivers/process");
    std::fs::create_dir_all(&state).unwrap();
    let pem = |name: &str| tls.join(name).display().to_string();
    Node::start(
        data,
        &[
            "--driver",
            "process",
            "--state-dir",
            state.to_str().unwrap(),
            "--listen",
            listen,
            "--cgroup-parent",
            common::TEST_CGROUP_PARENT,
            // Ten sandboxes of the gateway's default cpu (1 core) each, on a 2-core machine.
            "--capacity-cpu",
            "12",
            "--tls-cert",
            &pem("server.pem"),
            "--tls-key",
            &pem("server-key.pem"),
            "--tls-client-ca",
            &pem("ca.pem"),
        ],
    )
}

fn phase(s: &Sandbox) -> Phase {
    Phase::try_from(s.phase).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_spread_over_two_nodes_and_survive_one_being_killed() {
    let gateway_data = DataDir::new();
    let tls = gateway_data.path().join("tls");
    common::node::certs_init(&tls, &["--name", "127.0.0.1", "--client", "gateway"]);
    let datas = [DataDir::new(), DataDir::new()];
    let mut nodes: Vec<Node> = datas
        .iter()
        .map(|d| process_node(d.path(), "127.0.0.1:0", &tls))
        .collect();
    let pem = |name: &str| tls.join(name).display().to_string();
    let d = Sbxd::start(
        gateway_data.path(),
        "sim",
        &[
            "--node-tls-ca",
            &pem("ca.pem"),
            "--node-tls-cert",
            &pem("client-gateway.pem"),
            "--node-tls-key",
            &pem("client-gateway-key.pem"),
            "--node-grace",
            "3",
        ],
    );
    let endpoint = d.endpoint();
    // The gateway's own drivers take none of these sandboxes.
    let cordoned = sbx(&endpoint, &["node", "cordon", "local"]);
    assert_eq!(cordoned.code, 0, "{cordoned:?}\n{}", d.log_text());
    for (i, node) in nodes.iter().enumerate() {
        let added = sbx(
            &endpoint,
            &[
                "node",
                "add",
                &format!("n{i}"),
                "--address",
                &node.addr,
                "--label",
                &format!("rack=r{i}"),
                "-o",
                "json",
            ],
        );
        assert_eq!(added.code, 0, "{added:?}\n{}", d.log_text());
        let json = added.json();
        assert_eq!(json["state"], "Ready", "{json}");
        assert_eq!(json["drivers"][0], "process", "{json}");
    }
    let listed = sbx(&endpoint, &["node", "list"]).ok().to_string();
    assert!(listed.contains("n0") && listed.contains("n1"), "{listed}");

    let mut client = d.sandboxes().await;
    let mut made = Vec::new();
    for i in 0..SANDBOXES {
        let sb = client
            .create_sandbox(CreateSandboxRequest {
                name: format!("job-{i}"),
                spec: Some(SandboxSpec {
                    command: vec!["sleep".into(), "120".into()],
                    driver: "process".into(),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create job-{i}: {e}"))
            .into_inner();
        made.push(sb);
    }
    let per_node: BTreeMap<String, usize> = made.iter().fold(BTreeMap::new(), |mut m, s| {
        *m.entry(s.node.clone()).or_default() += 1;
        m
    });
    assert_eq!(
        per_node,
        BTreeMap::from([("n0".to_string(), 10), ("n1".to_string(), 10)]),
        "spread evenly over both nodes"
    );
    let ready = eventually(Duration::from_secs(60), "every sandbox Ready", || async {
        let all = d.all_sandboxes().await;
        (all.len() == SANDBOXES && all.values().all(|s| phase(s) == Phase::Ready)).then_some(all)
    })
    .await;
    // Each runs on its node, and only there.
    let mut pids = BTreeMap::new();
    for sb in ready.values() {
        let i: usize = sb.node[1..].parse().unwrap();
        let state = datas[i].path().join("drivers/process");
        let here = workload_pids_in(&state, &sb.id);
        assert_eq!(here.len(), 1, "{} on {}: {here:?}", sb.name, sb.node);
        let other = datas[1 - i].path().join("drivers/process");
        assert!(workload_pids_in(&other, &sb.id).is_empty());
        pids.insert(sb.id.clone(), here[0]);
    }

    // n0 dies.
    let n0_addr = nodes[0].addr.clone();
    let _ = nodes[0].child.kill();
    let _ = nodes[0].child.wait();
    let began = std::time::Instant::now();
    eventually(
        Duration::from_secs(10),
        "n0's sandboxes Unknown",
        || async {
            let all = d.all_sandboxes().await;
            all.values()
                .filter(|s| s.node == "n0")
                .all(|s| phase(s) == Phase::Unknown)
                .then_some(())
        },
    )
    .await;
    let took = began.elapsed();
    assert!(took < Duration::from_secs(3 + 5), "Unknown after {took:?}");
    for sb in d.all_sandboxes().await.values() {
        if sb.node == "n1" {
            assert_eq!(phase(sb), Phase::Ready, "{} on n1 is untouched", sb.name);
        } else {
            assert_eq!(sb.reason, "NodeNotAnswering", "{sb:?}");
        }
    }
    let shown = sbx(&endpoint, &["node", "get", "n0", "-o", "json"]).json();
    assert_eq!(shown["state"], "NotReady", "{shown}");
    // The workloads themselves never stopped: they outlive their node's process.
    for sb in made.iter().filter(|s| s.node == "n0") {
        assert!(common::proc_start_time(pids[&sb.id]).is_some());
    }

    // n0 again, on its state dir and address: the same workloads, Ready.
    nodes[0] = process_node(datas[0].path(), &n0_addr, &tls);
    eventually(
        Duration::from_secs(30),
        "n0's sandboxes Ready again",
        || async {
            let all = d.all_sandboxes().await;
            all.values().all(|s| phase(s) == Phase::Ready).then_some(())
        },
    )
    .await;
    for sb in made.iter() {
        let i: usize = sb.node[1..].parse().unwrap();
        let state = datas[i].path().join("drivers/process");
        assert_eq!(
            workload_pids_in(&state, &sb.id),
            vec![pids[&sb.id]],
            "{} keeps its workload",
            sb.name
        );
    }

    // A node that holds sandboxes is not removed; emptied, it is.
    let refused = sbx(&endpoint, &["node", "remove", "n1"]);
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(refused.stderr.contains("holds 10 sandbox"), "{refused:?}");
    for sb in &made {
        client
            .delete_sandbox(DeleteSandboxRequest {
                sandbox: Some(SandboxRef {
                    id: sb.id.clone(),
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
    }
    eventually(Duration::from_secs(30), "every sandbox deleted", || async {
        d.all_sandboxes().await.is_empty().then_some(())
    })
    .await;
    for data in &datas {
        assert!(common::all_workload_pids(data.path()).is_empty());
    }
    sbx(&endpoint, &["node", "remove", "n1"]).ok();
    let listed = sbx(&endpoint, &["node", "list", "-o", "name"])
        .ok()
        .to_string();
    assert_eq!(listed, "node/local\nnode/n0\n");
}
