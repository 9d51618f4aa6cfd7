//! `sbxd serve --metrics-listen`: the exposition is scraped over HTTP and parsed by the
//! Prometheus project's own parser (Debian's `python3-prometheus-client`, its OpenMetrics
//! parser, strict), with no series twice; and the families move as they should after a create,
//! an exec, a refused call, a stop and an open watch.

mod common;

use std::io::Write as _;
use std::time::Duration;

use common::metrics::{scrape, start_with_metrics, value};
use common::{DataDir, Sbxd, eventually, sbx};
use sbx_proto::v1::WatchSandboxesRequest;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_exposition_parses_and_its_families_move() {
    let data = DataDir::new();
    let (d, addr) = start_with_metrics(data.path(), "process", &[]);
    let before = scrape(&addr).await;
    assert_eq!(value(&before, "sbx_build_info", &[]), 1.0);
    assert_eq!(value(&before, "sbx_sandboxes", &[]), 0.0);

    let create = "/sbx.v1.SandboxService/CreateSandbox";
    sbx(
        &d.endpoint(),
        &["sandbox", "create", "m1", "--", "sleep", "100"],
    )
    .ok();
    sbx(&d.endpoint(), &["sandbox", "exec", "m1", "--", "true"]).ok();
    let missing = sbx(&d.endpoint(), &["sandbox", "get", "nope"]);
    assert_ne!(missing.code, 0);
    let after = scrape(&addr).await;
    assert_eq!(
        value(
            &after,
            "sbx_api_requests_total",
            &[("method", create), ("code", "OK")]
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "sbx_api_request_duration_seconds_count",
            &[("method", create)]
        ),
        1.0
    );
    assert_eq!(
        value(
            &after,
            "sbx_api_requests_total",
            &[("method", "/sbx.v1.SandboxService/Exec"), ("code", "OK")]
        ),
        1.0,
        "the exec"
    );
    assert_eq!(
        value(&after, "sbx_api_requests_total", &[("code", "NOT_FOUND")]),
        1.0,
        "the refused get"
    );
    assert!(
        value(
            &after,
            "sbx_driver_calls_total",
            &[
                ("driver", "process"),
                ("operation", "create"),
                ("outcome", "ok")
            ]
        ) >= 1.0
    );
    assert!(
        value(
            &after,
            "sbx_driver_call_duration_seconds_count",
            &[("driver", "process")]
        ) >= 1.0
    );
    // The sled store's commits: at least the create's writes, in batches of one or more.
    let writes = value(&after, "sbx_store_writes_total", &[]);
    let commits = value(&after, "sbx_store_commits_total", &[]);
    assert!(
        writes >= 2.0 && commits >= 1.0 && commits <= writes,
        "{writes} / {commits}"
    );
    assert!(value(&after, "sbx_store_commit_seconds_total", &[]) > 0.0);
    assert!(value(&after, "sbx_store_flushed_bytes_total", &[]) > 0.0);
    assert_eq!(
        value(
            &after,
            "sbx_sandboxes",
            &[("phase", "Ready"), ("driver", "process")]
        ),
        1.0
    );

    // A stop moves the sandbox between phases; an open watch is a subscriber.
    sbx(&d.endpoint(), &["sandbox", "stop", "m1"]).ok();
    let mut watch = d
        .sandboxes()
        .await
        .watch_sandboxes(WatchSandboxesRequest {
            resource_version: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let _ = watch.message().await.unwrap();
    let stopped = eventually(
        Duration::from_secs(10),
        "the stop and the watch counted",
        || async {
            let s = scrape(&addr).await;
            (value(&s, "sbx_sandboxes", &[("phase", "Stopped")]) == 1.0
                && value(&s, "sbx_watch_subscribers", &[]) >= 1.0)
                .then_some(s)
        },
    )
    .await;
    assert_eq!(value(&stopped, "sbx_sandboxes", &[("phase", "Ready")]), 0.0);
    assert!(value(&stopped, "sbx_watch_history_events", &[]) >= 1.0);
    assert!(value(&stopped, "sbx_watch_history_bytes", &[]) > 0.0);
    assert!(
        value(
            &stopped,
            "sbx_driver_calls_total",
            &[("operation", "stop"), ("outcome", "ok")]
        ) >= 1.0
    );
    drop(watch);
    sbx(&d.endpoint(), &["sandbox", "delete", "m1"]).ok();
}

/// A driver fault is counted by its outcome and shows in the phases; a restarted sbxd serves
/// the metrics again, its counters begun anew (as Prometheus expects of a restarted process)
/// and its states read from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_fault_and_a_restart_show_in_the_metrics() {
    let data = DataDir::new();
    let (mut d, addr) = start_with_metrics(data.path(), "sim", &["--sim-fail", "create"]);
    sbx(
        &d.endpoint(),
        &["sandbox", "create", "f1", "--detach", "--", "sleep", "100"],
    )
    .ok();
    let failed = eventually(Duration::from_secs(30), "the sandbox in Error", || async {
        let s = scrape(&addr).await;
        (value(
            &s,
            "sbx_sandboxes",
            &[("phase", "Error"), ("driver", "sim")],
        ) == 1.0)
            .then_some(s)
    })
    .await;
    assert!(
        value(
            &failed,
            "sbx_driver_calls_total",
            &[
                ("driver", "sim"),
                ("operation", "create"),
                ("outcome", "unavailable")
            ]
        ) >= 2.0,
        "every failed attempt is counted"
    );
    assert_eq!(
        value(
            &failed,
            "sbx_driver_calls_total",
            &[("operation", "create"), ("outcome", "ok")]
        ),
        0.0
    );
    d.sigterm(Duration::from_secs(30));

    let (d, addr) = start_with_metrics(data.path(), "sim", &[]);
    let again = scrape(&addr).await;
    assert_eq!(value(&again, "sbx_build_info", &[]), 1.0);
    assert_eq!(
        value(
            &again,
            "sbx_driver_calls_total",
            &[("outcome", "unavailable")]
        ),
        0.0,
        "a new process counts anew"
    );
    assert_eq!(
        value(&again, "sbx_sandboxes", &[]),
        1.0,
        "the states come from the store"
    );
    sbx(&d.endpoint(), &["sandbox", "delete", "f1"]).ok();
}

/// Commands waiting for a sandbox's actor are counted while they wait and run, and no more
/// once answered: two commands to one sandbox behind a slow driver show 2, then 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commands_in_flight_count_what_waits_for_a_sandbox_actor() {
    let data = DataDir::new();
    let (d, addr) = start_with_metrics(data.path(), "sim", &["--sim-latency-ms", "1500"]);
    let ep = d.endpoint();
    sbx(&ep, &["sandbox", "create", "slow", "--", "sleep", "100"]).ok();
    let idle = scrape(&addr).await;
    assert_eq!(value(&idle, "sbx_sandbox_commands_in_flight", &[]), 0.0);
    // A stop (the driver takes 1.5 s a call), and a setting queued behind it in the mailbox.
    let (stop_ep, set_ep) = (ep.clone(), ep.clone());
    let stop = std::thread::spawn(move || sbx(&stop_ep, &["sandbox", "stop", "slow"]));
    std::thread::sleep(Duration::from_millis(300));
    let set = std::thread::spawn(move || sbx(&set_ep, &["setting", "set", "slow", "mode=fast"]));
    eventually(
        Duration::from_secs(10),
        "two commands in flight",
        || async {
            let s = scrape(&addr).await;
            (value(&s, "sbx_sandbox_commands_in_flight", &[]) == 2.0).then_some(())
        },
    )
    .await;
    let (stopped, set) = (stop.join().unwrap(), set.join().unwrap());
    assert_eq!((stopped.code, set.code), (0, 0), "{stopped:?} {set:?}");
    let after = scrape(&addr).await;
    assert_eq!(value(&after, "sbx_sandbox_commands_in_flight", &[]), 0.0);
    // No network here: nothing refused, and the resolver's family is there, at zero.
    assert_eq!(value(&after, "sbx_network_denials", &[]), 0.0);
    assert_eq!(value(&after, "sbx_resolver_answers_total", &[]), 0.0);
    sbx(&ep, &["sandbox", "delete", "slow"]).ok();
}

#[test]
fn metrics_off_loopback_are_refused_at_start() {
    let data = DataDir::new();
    let run = common::run_bounded(
        common::sbxd_command()
            .args(["serve", "--driver", "sim", "--listen", "127.0.0.1:0"])
            .args(["--metrics-listen", "0.0.0.0:0", "--data-dir"])
            .arg(data.path())
            .env("SBX_AUTH", "none"),
        "sbxd serve --metrics-listen 0.0.0.0:0",
    );
    assert_ne!(run.code, 0, "{run:?}");
    assert!(run.stderr.contains("not a loopback address"), "{run:?}");
}

/// The cost of counting on the hot paths: two sbxd side by side (process driver), one with
/// `--metrics-listen` and one without, rounds interleaved: the exec round trip (gRPC exec of
/// `true` until its exit) and create→Ready (gRPC create, then the watch until Ready), p50 of
/// each and the ratio; then a scrape's time and size with `SBX_METRICS_SANDBOXES` sandboxes
/// (sim driver, default 1,000). Ignored; run as root with
/// `cargo test --release -p sbx-gateway --test metrics -- --ignored --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn the_cost_of_metrics_on_the_hot_paths() {
    use sbx_proto::v1::exec_output::Chunk;
    use sbx_proto::v1::{CreateSandboxRequest, ExecRequest, Phase, SandboxRef, SandboxSpec};
    use std::time::Instant;
    use tokio_stream::StreamExt;

    let rounds: usize = std::env::var("SBX_METRICS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let on_data = DataDir::new();
    let (on, on_addr) = start_with_metrics(on_data.path(), "process", &["--log-format", "json"]);
    let off_data = DataDir::new();
    let off = Sbxd::start(off_data.path(), "process", &["--log-format", "json"]);
    let spec = || SandboxSpec {
        command: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    };
    for d in [&on, &off] {
        sbx(
            &d.endpoint(),
            &["sandbox", "create", "box", "--", "sleep", "1000"],
        )
        .ok();
    }
    let by_name = || {
        Some(SandboxRef {
            name: "box".into(),
            ..Default::default()
        })
    };
    async fn exec_true(d: &Sbxd, sandbox: Option<SandboxRef>) -> Duration {
        let mut client = d.sandboxes().await;
        let began = Instant::now();
        let req = ExecRequest {
            sandbox,
            command: vec!["true".into()],
            ..Default::default()
        };
        let mut out = client.exec(req.alone()).await.unwrap().into_inner();
        let mut code = None;
        while let Some(m) = out.message().await.unwrap() {
            if let Some(Chunk::Exit(e)) = m.chunk {
                code = Some(e.code);
            }
        }
        assert_eq!(code, Some(0));
        began.elapsed()
    }
    async fn create_ready(d: &Sbxd, name: String, spec: SandboxSpec) -> Duration {
        let client = d.sandboxes().await;
        let mut watch = client
            .clone()
            .watch_sandboxes(WatchSandboxesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let began = Instant::now();
        let created = client
            .clone()
            .create_sandbox(CreateSandboxRequest {
                name,
                spec: Some(spec),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(30), watch.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap();
            let s = ev.sandbox.unwrap();
            if s.id == created.id && s.phase() == Phase::Ready {
                return began.elapsed();
            }
        }
    }
    let p50 = |v: &mut Vec<Duration>| {
        v.sort();
        v[v.len() / 2]
    };
    let (mut exec_on, mut exec_off, mut ready_on, mut ready_off) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        // Alternate which goes first, so neither always meets a warmer machine.
        let order: [(&Sbxd, bool); 2] = if i % 2 == 0 {
            [(&on, true), (&off, false)]
        } else {
            [(&off, false), (&on, true)]
        };
        for (d, is_on) in order {
            let e = exec_true(d, by_name()).await;
            let r = create_ready(d, format!("c{i}"), spec()).await;
            if is_on {
                exec_on.push(e);
                ready_on.push(r);
            } else {
                exec_off.push(e);
                ready_off.push(r);
            }
        }
    }
    let (eo, ef, ro, rf) = (
        p50(&mut exec_on),
        p50(&mut exec_off),
        p50(&mut ready_on),
        p50(&mut ready_off),
    );
    println!(
        "{rounds} rounds interleaved, process driver: exec round trip p50 with metrics {eo:?}, \
         without {ef:?}, ratio {:.3}; create→Ready p50 with {ro:?}, without {rf:?}, ratio {:.3}",
        eo.as_secs_f64() / ef.as_secs_f64(),
        ro.as_secs_f64() / rf.as_secs_f64()
    );
    let scraped = scrape(&on_addr).await;
    assert!(value(&scraped, "sbx_sandboxes", &[]) >= rounds as f64);
    drop(on);
    drop(off);

    // A scrape with many sandboxes (sim driver).
    let many: usize = std::env::var("SBX_METRICS_SANDBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let sim_data = DataDir::new();
    let (sim, sim_addr) = start_with_metrics(sim_data.path(), "sim", &["--log-format", "json"]);
    let client = sim.sandboxes().await;
    futures::StreamExt::buffer_unordered(
        futures::stream::iter(0..many).map(|i| {
            let mut client = client.clone();
            async move {
                client
                    .create_sandbox(CreateSandboxRequest {
                        name: format!("s{i}"),
                        spec: Some(SandboxSpec {
                            command: vec!["sleep".into(), "1000".into()],
                            ..Default::default()
                        }),
                        ..Default::default()
                    })
                    .await
                    .unwrap();
            }
        }),
        16,
    )
    .collect::<Vec<_>>()
    .await;
    let mut took = Vec::new();
    let mut size = 0;
    for _ in 0..10 {
        let began = Instant::now();
        let text = tokio::task::spawn_blocking({
            let addr = sim_addr.clone();
            move || {
                use std::io::Read as _;
                let mut conn = std::net::TcpStream::connect(&addr).unwrap();
                conn.write_all(
                    b"GET /metrics HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n",
                )
                .unwrap();
                let mut text = String::new();
                conn.read_to_string(&mut text).unwrap();
                text
            }
        })
        .await
        .unwrap();
        took.push(began.elapsed());
        size = text
            .split_once("\r\n\r\n")
            .map_or(0, |(_, body)| body.len());
    }
    let parsed = scrape(&sim_addr).await;
    assert_eq!(value(&parsed, "sbx_sandboxes", &[]), many as f64);
    println!(
        "a scrape with {many} sandboxes (sim driver): p50 {:?} (10 scrapes), {size} bytes",
        p50(&mut took)
    );
}

/// A stranger grows nothing: 20,000 unauthenticated calls to made-up methods (`/sbx.<uuid>/M`)
/// and 200 with 12 KiB `/grpc.…` paths leave `/metrics` within 10% of its size and sbxd's
/// resident size within 64 MiB, every one counted (as `unauthenticated`), and the log's audit
/// lines for them name no path they sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stranger_grows_neither_the_metrics_nor_the_log() {
    let data = DataDir::new();
    let (d, addr) = start_with_metrics(data.path(), "sim", &["--auth", "token"]);
    // Warmed: the families a stranger's call touches exist before the first measure.
    let channel = d.channel().await;
    let call = move |path: String| {
        let channel = channel.clone();
        async move {
            let mut grpc = tonic::client::Grpc::new(channel);
            grpc.ready().await.unwrap();
            let path = tonic::codegen::http::uri::PathAndQuery::try_from(path).unwrap();
            grpc.unary(
                tonic::Request::new(()),
                path,
                tonic_prost::ProstCodec::<(), ()>::default(),
            )
            .await
        }
    };
    let refused = call("/sbx.v1.GatewayService/GetGatewayInfo".into()).await;
    assert_eq!(refused.unwrap_err().code(), tonic::Code::Unauthenticated);
    let size = |text: &Vec<(String, std::collections::BTreeMap<String, String>, f64)>| {
        text.iter()
            .map(|(n, l, _)| n.len() + l.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>())
            .sum::<usize>()
    };
    let before = scrape(&addr).await;
    let rss_before = common::rss_kib(d.pid());
    let long = format!("/grpc.{}/M", "x".repeat(12 << 10));
    let mut tasks = tokio::task::JoinSet::new();
    for worker in 0..16 {
        let call = call.clone();
        let long = long.clone();
        tasks.spawn(async move {
            for i in 0..1250 {
                let path = if worker == 0 && i < 200 {
                    long.clone()
                } else {
                    format!("/sbx.{}/M", uuid::Uuid::new_v4().simple())
                };
                let answer = call(path).await;
                assert_eq!(answer.unwrap_err().code(), tonic::Code::Unauthenticated);
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    let after = scrape(&addr).await;
    let rss_after = common::rss_kib(d.pid());
    let (b, a) = (size(&before), size(&after));
    eprintln!("metrics {b} -> {a} bytes of names and labels; sbxd {rss_before} -> {rss_after} KiB");
    assert!(
        (a as f64) < b as f64 * 1.1,
        "the metrics grew from {b} to {a} bytes of names and labels"
    );
    assert!(
        rss_after.saturating_sub(rss_before) < 64 << 10,
        "sbxd grew by {} KiB",
        rss_after - rss_before
    );
    let counted = value(
        &after,
        "sbx_api_requests_total",
        &[("method", "unauthenticated"), ("code", "UNAUTHENTICATED")],
    );
    assert!(counted >= 20_000.0, "{counted} strangers' calls counted");
    let log = d.log_text();
    assert!(
        !log.contains(&long[..200]),
        "the log holds a stranger's long path"
    );
    assert!(
        !log.lines()
            .any(|l| l.contains("sbx::audit") && l.contains("/sbx.") && l.contains("/M ")),
        "an audit line names a stranger's made-up method"
    );
}
