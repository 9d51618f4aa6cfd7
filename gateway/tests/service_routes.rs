//! Service endpoints end to end through the real sbxd (default driver: oci, busybox image;
//! needs root and runc) and its HTTP listener (`--service-listen`): a request reaches the
//! sandbox its Host names when two workspaces hold same-named sandboxes and endpoints; a Host
//! that names nothing, a sandbox deleted and made again, and a port nobody listens on each get
//! an answer of the listener's own; and the routed request's latency is measured side by side
//! with the same request through `sbx sandbox port-forward` (SBX_BENCH_ROUNDS requests each,
//! 30 by default; docs/BENCHMARKS.md).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{DataDir, SBX, Sbxd, sbx, unique};
use sbx_proto::v1::service_endpoint_service_client::ServiceEndpointServiceClient;
use sbx_proto::v1::{ExposeServiceRequest, SandboxRef};

const QUICK: Duration = Duration::from_secs(20);

struct World {
    sbxd: Sbxd,
    _data: DataDir,
    /// The service listener's address.
    routes: String,
    /// Dropped last, once the data dir's containers are gone.
    _cgroups: common::CgroupParent,
}

impl World {
    fn new() -> World {
        let data = DataDir::new();
        let cgroup_parent = format!("sbx-gateway-tests-routes-{}", unique());
        let addr_file = data.path().join("service-addr");
        let sbxd = Sbxd::start(
            data.path(),
            "",
            &[
                "--oci-cgroup-parent",
                &cgroup_parent,
                "--service-listen",
                "127.0.0.1:0",
                "--service-addr-file",
                addr_file.to_str().unwrap(),
            ],
        );
        let routes = std::fs::read_to_string(&addr_file)
            .expect("the service address file is written once sbxd serves")
            .trim()
            .to_string();
        World {
            sbxd,
            _data: data,
            routes,
            _cgroups: common::CgroupParent(cgroup_parent),
        }
    }

    fn sbx(&self, args: &[&str]) -> common::CliRun {
        sbx(&self.sbxd.endpoint(), args)
    }

    /// A Ready sandbox in `ws` serving `body` on 127.0.0.1:8000 (busybox httpd).
    fn web_sandbox(&self, ws: &str, name: &str, body: &str) {
        let script = format!(
            "mkdir -p /www && echo {body} > /www/index.html && exec httpd -f -p 127.0.0.1:8000 -h /www"
        );
        let created = self.sbx(&[
            "sandbox", "create", "-w", ws, "-n", name, "--", "sh", "-c", &script,
        ]);
        assert_eq!(created.code, 0, "{created:?}");
    }

    async fn expose(&self, ws: &str, sandbox: &str, port: u32, name: &str) {
        let mut client = ServiceEndpointServiceClient::new(self.sbxd.channel().await);
        client
            .expose_service(ExposeServiceRequest {
                sandbox: Some(SandboxRef {
                    workspace: ws.into(),
                    name: sandbox.into(),
                    ..Default::default()
                }),
                port,
                name: name.into(),
            })
            .await
            .unwrap_or_else(|e| panic!("expose {ws}/{sandbox}:{port} as {name}: {e:?}"));
    }
}

/// One HTTP/1.0 GET of `/` to `addr` with `host`: (status line, body), read to EOF.
fn get(addr: &str, host: &str) -> (String, String) {
    let mut conn = TcpStream::connect(addr).expect("connect");
    conn.set_read_timeout(Some(QUICK)).unwrap();
    conn.write_all(format!("GET / HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .unwrap();
    let mut all = Vec::new();
    conn.read_to_end(&mut all).expect("read the response");
    let text = String::from_utf8_lossy(&all).to_string();
    let status = text.lines().next().unwrap_or("").to_string();
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// Retries a GET while the sandbox's server is not up yet (bounded).
fn get_ready(addr: &str, host: &str) -> (String, String) {
    let deadline = Instant::now() + QUICK;
    loop {
        let got = get(addr, host);
        if got.0.contains(" 200") || Instant::now() > deadline {
            return got;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_reaches_the_sandbox_it_names_and_nothing_else() {
    let w = World::new();
    for ws in ["red", "blue"] {
        let made = w.sbx(&["workspace", "create", ws]);
        assert_eq!(made.code, 0, "{made:?}");
        w.web_sandbox(ws, "app", &format!("hello-from-{ws}"));
        w.expose(ws, "app", 8000, "web").await;
    }
    let red = get_ready(&w.routes, "web--app--red.localhost");
    assert!(red.0.contains(" 200"), "{red:?}");
    assert_eq!(red.1.trim(), "hello-from-red");
    let blue = get_ready(&w.routes, "web--app--blue.localhost:80");
    assert_eq!(blue.1.trim(), "hello-from-blue", "{blue:?}");

    // Hosts that name nothing, or another domain.
    let (status, body) = get(&w.routes, "web--app--green.localhost");
    assert!(status.contains(" 404"), "{status} {body}");
    assert!(body.contains("not found"), "{body}");
    let (status, _) = get(&w.routes, "web--app--red.example.test");
    assert!(status.contains(" 421"), "{status}");
    // An endpoint on a port nobody listens on: the listener's 502, naming the cause.
    w.expose("red", "app", 9, "closed").await;
    let (status, body) = get(&w.routes, "closed--app--red.localhost");
    assert!(status.contains(" 502"), "{status} {body}");

    // Deleted and made again under the same name: the old endpoint went with it.
    let deleted = w.sbx(&["sandbox", "delete", "-w", "red", "app"]);
    assert_eq!(deleted.code, 0, "{deleted:?}");
    w.web_sandbox("red", "app", "the-new-red");
    let (status, body) = get(&w.routes, "web--app--red.localhost");
    assert!(
        status.contains(" 404"),
        "a new sandbox inherited a service: {status} {body}"
    );
    // Blue never noticed.
    assert_eq!(
        get(&w.routes, "web--app--blue.localhost").1.trim(),
        "hello-from-blue"
    );
}

/// A running `sbx sandbox port-forward -w WS NAME 0:8000`, and the local port it listens on.
struct Forward {
    child: Child,
    port: u16,
}

impl Forward {
    fn start(w: &World, ws: &str, name: &str) -> Forward {
        let mut child = Command::new(SBX)
            .args(["sandbox", "port-forward", "-w", ws, name, "0:8000"])
            .env("SBX_ENDPOINT", w.sbxd.endpoint())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn sbx port-forward");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .expect("the Forwarding line");
        let port = line
            .strip_prefix("Forwarding from 127.0.0.1:")
            .and_then(|rest| rest.split_once(" -> "))
            .and_then(|(p, _)| p.parse().ok())
            .unwrap_or_else(|| panic!("{line:?}"));
        Forward { child, port }
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rounds() -> usize {
    std::env::var("SBX_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routed_request_latency_against_a_port_forward() {
    let w = World::new();
    w.web_sandbox("default", "bench", "bench-page");
    w.expose("default", "bench", 8000, "web").await;
    let host = "web--bench--default.localhost";
    assert_eq!(get_ready(&w.routes, host).1.trim(), "bench-page");
    let forward = Forward::start(&w, "default", "bench");
    let direct = format!("127.0.0.1:{}", forward.port);
    assert_eq!(get_ready(&direct, "localhost").1.trim(), "bench-page");
    let n = rounds();
    // Interleaved, so that whatever else the machine does falls on both alike.
    let (mut routed, mut forwarded) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for _ in 0..n {
        let began = Instant::now();
        let (status, _) = get(&w.routes, host);
        routed.push(began.elapsed());
        assert!(status.contains(" 200"), "{status}");
        let began = Instant::now();
        let (status, _) = get(&direct, "localhost");
        forwarded.push(began.elapsed());
        assert!(status.contains(" 200"), "{status}");
    }
    let (r, f) = (median(routed), median(forwarded));
    println!(
        "service route vs port-forward, {n} GETs each (a new connection each): median {r:?} vs {f:?} (ratio {:.2})",
        r.as_secs_f64() / f.as_secs_f64()
    );
    assert!(r < Duration::from_secs(2), "a routed GET took {r:?}");
    drop(forward);
    let gone = w.sbx(&["sandbox", "delete", "bench"]);
    assert_eq!(gone.code, 0, "{gone:?}");
}
