//! `sbxd node`, black box: the real sbxd serving the sim driver on 127.0.0.1:0, reached with
//! `RemoteDriver::connect_tcp_lazy` as a gateway would. What it serves (the driver contract,
//! the node service), its node id across restarts, mutual TLS with certificates of `sbxd
//! certs init`, and what it refuses at start.
//!
//! Every node started here is killed by pid when its guard drops; every wait is bounded. The
//! full driver conformance suite over TCP runs in drivers/tests/conformance_remote_tcp.rs.

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::node::{CALL_TIMEOUT, Node, REFUSAL_TIMEOUT, certs_init};
use common::run_bounded;
use sbx_drivers::{ComputeDriver, DriverError, pb};

/// The arguments of a sim node on 127.0.0.1:0 over `state`, then `extra`.
fn sim_node<'a>(state: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--driver",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--state-dir",
        state,
    ];
    args.extend(extra);
    args
}

fn create_request(name: &str) -> pb::CreateRequest {
    pb::CreateRequest {
        sandbox_id: uuid::Uuid::new_v4().to_string(),
        workspace: "default".into(),
        name: name.into(),
        generation: 1,
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_serves_its_driver_and_says_what_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let state_arg = state.to_str().unwrap();
    let args = sim_node(
        state_arg,
        &["--auth", "none", "--label", "zone=a", "--name", "node-a"],
    );
    let mut node = Node::start(dir.path(), &args);
    let remote = node.plain();

    let node_id = std::fs::read_to_string(state.join("node-id")).expect("the node id file");
    let node_id = node_id.strip_suffix('\n').expect("a line");
    assert!(uuid::Uuid::parse_str(node_id).is_ok(), "{node_id:?}");
    let info = remote.node_info().await.unwrap();
    assert_eq!(info.node_id, node_id);
    assert_eq!(info.name, "node-a");
    assert_eq!(info.drivers, ["sim"]);
    assert_eq!(
        info.labels,
        HashMap::from([("zone".to_string(), "a".to_string())])
    );
    assert!(!info.version.is_empty());
    let capacity = info.capacity.expect("a capacity");
    assert!(capacity.cpu_millicores >= 1000, "{capacity:?}");
    assert!(capacity.memory_bytes > 0, "{capacity:?}");
    assert!(capacity.disk_bytes > 0, "{capacity:?}");
    assert_eq!(capacity.max_sandboxes, 1000);
    assert_eq!(info.sandboxes, 0);

    // The driver contract through it: create, list, stop, delete.
    assert_eq!(remote.capabilities().await.unwrap().driver, "sim");
    let request = create_request("one");
    let id = request.sandbox_id.clone();
    let created = remote.create(request).await.unwrap();
    assert_eq!(created.state(), pb::State::Running);
    let listed = remote.list().await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (listed[0].sandbox_id.as_str(), listed[0].name.as_str()),
        (id.as_str(), "one")
    );
    assert_eq!(remote.node_info().await.unwrap().sandboxes, 1);
    let stopped = remote
        .stop(pb::StopRequest {
            sandbox_id: id.clone(),
            grace_period_ms: 0,
        })
        .await
        .unwrap();
    assert_eq!(stopped.state(), pb::State::Stopped);
    let deleted = remote
        .delete(pb::DeleteRequest {
            sandbox_id: id.clone(),
        })
        .await
        .unwrap();
    assert!(deleted.deleted);
    assert!(remote.list().await.unwrap().is_empty());
    assert_eq!(remote.node_info().await.unwrap().sandboxes, 0);

    // A clean shutdown, even under an open watch stream (cut after the grace), removes the
    // address file; the stream ends and nothing answers then.
    let mut watch = remote.watch().await.unwrap();
    let began = Instant::now();
    let status = node.sigterm();
    assert!(status.success(), "{status}:\n{}", node.log_text());
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "{:?}",
        began.elapsed()
    );
    let last = tokio::time::timeout(CALL_TIMEOUT, futures::StreamExt::next(&mut watch))
        .await
        .expect("the watch stream ended with the node");
    assert!(!matches!(last, Some(Ok(_))), "{last:?}");
    assert!(
        !node.addr_file.exists(),
        "the address file outlived the node"
    );
    let err = remote.node_info().await.unwrap_err();
    assert!(matches!(err, DriverError::Unavailable(_)), "{err}");
    drop(node);

    // Started again on the same state dir: the same node id (and the file untouched).
    let again = Node::start(dir.path(), &args);
    let info = again.plain().node_info().await.unwrap();
    assert_eq!(info.node_id, node_id);
    assert_eq!(
        std::fs::read_to_string(state.join("node-id")).unwrap(),
        format!("{node_id}\n")
    );
}

/// `sbxd certs init --dir DIR ARGS…`.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_only_clients_with_a_certificate_of_its_ca() {
    let dir = tempfile::tempdir().unwrap();
    let x = dir.path().join("x");
    certs_init(&x, &["--name", "127.0.0.1", "--client", "gateway"]);
    // Another CA, with a client certificate of its own.
    let other = dir.path().join("other");
    certs_init(&other, &["--name", "127.0.0.1", "--client", "gateway"]);
    let file = |d: &Path, name: &str| d.join(name).display().to_string();
    let state = dir.path().join("state");
    let (cert, key, ca) = (
        file(&x, "server.pem"),
        file(&x, "server-key.pem"),
        file(&x, "ca.pem"),
    );
    let args = sim_node(
        state.to_str().unwrap(),
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
        ],
    );
    let node = Node::start(dir.path(), &args);
    let ca_pem = x.join("ca.pem");
    let client = |identity: Option<(&Path, &Path)>| {
        sbx_gateway::tls::client_config(Some(&ca_pem), identity, None).expect("a TLS config")
    };

    // The gateway's certificate: served.
    let (gw_cert, gw_key) = (
        x.join("client-gateway.pem"),
        x.join("client-gateway-key.pem"),
    );
    let gateway = node.tls(client(Some((&gw_cert, &gw_key))));
    let info = gateway.node_info().await.unwrap();
    assert_eq!(info.drivers, ["sim"]);
    let created = gateway.create(create_request("secure")).await.unwrap();
    assert_eq!(gateway.list().await.unwrap().len(), 1);
    gateway
        .delete(pb::DeleteRequest {
            sandbox_id: created.sandbox_id,
        })
        .await
        .unwrap();

    // No client certificate, one of another CA, no TLS at all: refused (never an answer).
    let (other_cert, other_key) = (
        other.join("client-gateway.pem"),
        other.join("client-gateway-key.pem"),
    );
    let refused = [
        ("no client certificate", node.tls(client(None))),
        (
            "a client certificate of another CA",
            node.tls(client(Some((&other_cert, &other_key)))),
        ),
        ("plain TCP", node.plain()),
    ];
    for (what, remote) in refused {
        let began = Instant::now();
        match remote.node_info().await {
            Ok(info) => panic!("{what}: answered {info:?}"),
            Err(err) => {
                assert!(
                    matches!(
                        err,
                        DriverError::Unavailable(_) | DriverError::DeadlineExceeded { .. }
                    ),
                    "{what}: {err}"
                );
                eprintln!("{what}: {err} after {:?}", began.elapsed());
            }
        }
        assert!(remote.list().await.is_err(), "{what}: listed");
    }

    // The refused handshakes did not hurt the node: the gateway is still served.
    assert_eq!(gateway.node_info().await.unwrap().sandboxes, 0);
}

/// Runs `sbxd node ARGS…` expecting a refusal: a non-zero exit, within a bound, whose stderr
/// holds every one of `mentions`. Answers stderr.
fn refused(args: &[&str], mentions: &[&str]) -> String {
    let began = Instant::now();
    let run = run_bounded(
        common::sbxd_command().arg("node").args(args),
        &format!("sbxd node {args:?}"),
    );
    assert!(
        began.elapsed() < REFUSAL_TIMEOUT,
        "{args:?}: took {:?}",
        began.elapsed()
    );
    assert_ne!(run.code, 0, "{args:?} started: {run:?}");
    for mention in mentions {
        assert!(
            run.stderr.contains(mention),
            "{args:?}: stderr does not mention {mention:?}:\n{}",
            run.stderr
        );
    }
    run.stderr
}

#[test]
fn a_node_refuses_to_start_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let state_arg = state.to_str().unwrap();
    let addr_file = dir.path().join("addr");
    let addr_arg = addr_file.to_str().unwrap();
    let with = |listen: &str, extra: &[&str]| -> Vec<String> {
        let mut args: Vec<String> = [
            "--driver",
            "sim",
            "--state-dir",
            state_arg,
            "--listen",
            listen,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(["--addr-file".to_string(), addr_arg.to_string()]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let run = |args: Vec<String>, mentions: &[&str]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        refused(&args, mentions)
    };

    // --auth none off loopback, refused before anything is bound: on a port the test holds,
    // the refusal is about --auth, not the port being taken.
    run(
        with("0.0.0.0:0", &["--auth", "none"]),
        &["--auth none", "loopback"],
    );
    let held = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = held.local_addr().unwrap().port();
    let err = run(
        with(&format!("0.0.0.0:{port}"), &["--auth", "none"]),
        &["--auth none"],
    );
    assert!(!err.contains("in use"), "{err}");
    drop(held);

    // Mutual TLS off loopback needs all three TLS flags.
    run(
        with("0.0.0.0:0", &[]),
        &[
            "not a loopback address",
            "--tls-cert",
            "--tls-key",
            "--tls-client-ca",
        ],
    );
    run(
        with("0.0.0.0:0", &["--tls-cert", "c.pem", "--tls-key", "k.pem"]),
        &["missing: --tls-client-ca"],
    );
    // On loopback too, unless --auth none.
    run(with("127.0.0.1:0", &[]), &["--tls-cert", "--auth none"]);

    // A malformed label: a usage error naming the flag.
    let err = run(
        with("127.0.0.1:0", &["--auth", "none", "--label", "zone"]),
        &["--label"],
    );
    assert!(err.contains("KEY=VALUE"), "{err}");
    run(
        with("127.0.0.1:0", &["--auth", "none", "--label", "zone=a b"]),
        &["--label", "values use"],
    );

    // A malformed node id: an error naming the file, which is left as it was.
    std::fs::create_dir_all(&state).unwrap();
    let id_file = state.join("node-id");
    std::fs::write(&id_file, "node-7\n").unwrap();
    run(
        with("127.0.0.1:0", &["--auth", "none"]),
        &[id_file.to_str().unwrap(), "not a node id"],
    );
    assert_eq!(std::fs::read_to_string(&id_file).unwrap(), "node-7\n");

    // No state dir: a usage error naming the flag.
    refused(
        &[
            "--driver",
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--auth",
            "none",
        ],
        &["--state-dir"],
    );
    assert!(!addr_file.exists(), "a refused node wrote its address file");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_refuses_calls_under_an_older_fencing_token_even_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let metrics_file = dir.path().join("metrics-addr");
    let metrics_file_arg = metrics_file.to_str().unwrap().to_string();
    let args = sim_node(
        state.to_str().unwrap(),
        &[
            "--auth",
            "none",
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-addr-file",
            &metrics_file_arg,
        ],
    );
    let mut node = Node::start(dir.path(), &args);
    let ws = uuid::Uuid::new_v4();
    let former = node.plain().fenced(ws, 1);
    let request = create_request("one");
    let id = request.sandbox_id.clone();
    former.create(request).await.unwrap();
    // A newer holder of the workspace reaches the node: from then on the former is refused.
    let newer = node.plain().fenced(ws, 2);
    assert_eq!(newer.list().await.unwrap().len(), 1);
    let err = former
        .stop(pb::StopRequest {
            sandbox_id: id.clone(),
            grace_period_ms: 0,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(&err, DriverError::FailedPrecondition(m) if m.starts_with("fenced:")),
        "{err:?}"
    );
    // Streams carry the fence too: an exec and an upload under the old token are refused.
    let exec = former
        .exec_io(
            pb::ExecRequest {
                sandbox_id: id.clone(),
                command: vec!["true".into()],
                ..Default::default()
            },
            Box::pin(futures::stream::empty()),
        )
        .await;
    assert!(
        matches!(&exec, Err(DriverError::FailedPrecondition(m)) if m.starts_with("fenced:")),
        "an exec under the old token: {:?}",
        exec.err()
    );
    let upload = former
        .copy_to(
            pb::CopyToStart {
                sandbox_id: id.clone(),
                ..Default::default()
            },
            Box::pin(futures::stream::empty()),
        )
        .await;
    assert!(
        matches!(&upload, Err(DriverError::FailedPrecondition(m)) if m.starts_with("fenced:")),
        "an upload under the old token: {upload:?}"
    );
    let info = newer.node_info().await.unwrap();
    assert_eq!(info.fenced_calls, 3);
    // The node's metrics say the same, parsed by Prometheus' own parser.
    let metrics_addr = std::fs::read_to_string(&metrics_file)
        .unwrap()
        .trim()
        .to_string();
    let scraped = common::metrics::scrape(&metrics_addr).await;
    let value = |name: &str| common::metrics::value(&scraped, name, &[]);
    assert_eq!(value("sbx_node_fenced_calls_total"), 3.0);
    assert_eq!(value("sbx_node_token_conflicts_total"), 0.0);
    assert_eq!(value("sbx_node_sandboxes"), 1.0);
    assert_eq!(value("sbx_node_build_info"), 1.0);
    // The refused stop did nothing.
    let snapshot = newer
        .get(pb::GetRequest {
            sandbox_id: id.clone(),
        })
        .await
        .unwrap();
    assert_eq!(snapshot.state(), pb::State::Running);
    // Another workspace's calls are not fenced by this one's token.
    node.plain()
        .fenced(uuid::Uuid::new_v4(), 1)
        .list()
        .await
        .unwrap();

    // The newest token is on the node's disk: after a restart the former is still refused.
    assert!(node.sigterm().success());
    let node = Node::start(dir.path(), &args);
    let former = node.plain().fenced(ws, 1);
    let err = former.list().await.unwrap_err();
    assert!(
        matches!(&err, DriverError::FailedPrecondition(m) if m.starts_with("fenced:")),
        "{err:?}"
    );
    node.plain().fenced(ws, 2).list().await.unwrap();
    assert_eq!(
        std::fs::read_to_string(state.join("fences").join(ws.to_string())).unwrap(),
        "2\n"
    );
}
