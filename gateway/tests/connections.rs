//! Idle and half-open connections cannot starve sbxd (black box, the real sbxd on the sim
//! driver): under `ulimit -n 1024` (`prlimit`), 2,000 connections that send half an HTTP/2
//! preface or a preface and then nothing are closed by the handshake timeout and the
//! keepalive, those past the connection cap at once; a client connected before the flood
//! keeps creating and listing sandboxes throughout, and afterwards sbxd's descriptors are
//! back near where they were and new clients connect.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{DataDir, SBXD};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{CreateSandboxRequest, ListSandboxesRequest, SandboxSpec};

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty SETTINGS frame: length 0, type 4, no flags, stream 0.
const EMPTY_SETTINGS: [u8; 9] = [0, 0, 0, 4, 0, 0, 0, 0, 0];

struct Daemon(Child);

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// sbxd under a descriptor limit of 1,024, plain TCP on loopback, short timeouts.
fn start(data: &Path) -> (Daemon, String) {
    start_with(
        data,
        &[
            "--auth",
            "none",
            "--handshake-timeout",
            "1",
            "--keepalive",
            "1",
        ],
    )
}

/// [`start`] with `flags` instead of `--auth none` and its timeouts.
fn start_with(data: &Path, flags: &[&str]) -> (Daemon, String) {
    let addr_file = data.join("addr");
    let log = std::fs::File::create(data.join("sbxd.log")).unwrap();
    let child = Command::new("prlimit")
        .args(["--nofile=1024:1024", "--"])
        .arg(SBXD)
        .args(["serve", "--driver", "sim", "--listen", "127.0.0.1:0"])
        .args(flags)
        .arg("--data-dir")
        .arg(data.join("d"))
        .arg("--addr-file")
        .arg(&addr_file)
        .env("SBX_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn prlimit sbxd (util-linux)");
    let daemon = Daemon(child);
    let began = Instant::now();
    loop {
        if let Ok(text) = std::fs::read_to_string(&addr_file)
            && text.ends_with('\n')
        {
            return (daemon, text.trim().to_string());
        }
        assert!(
            began.elapsed() < Duration::from_secs(30),
            "sbxd did not serve"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Whether the server closed `conn` (end-of-file or reset), waiting at most `within`.
fn closed_by_server(conn: &mut TcpStream, within: Duration) -> bool {
    conn.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + within;
    loop {
        match conn.read(&mut buf) {
            Ok(0) => return true,
            // The server's SETTINGS, pings: read on.
            Ok(_) => {}
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false;
            }
            Err(_) => return true,
        }
        if Instant::now() >= deadline {
            return false;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_while_a_real_client_keeps_working() {
    let data = DataDir::new();
    let (daemon, addr) = start(data.path());
    let pid = daemon.0.id();
    // prlimit execs sbxd: the pid is sbxd's.
    let channel = tonic::transport::Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("the real client connects before the flood");
    let mut client = SandboxServiceClient::new(channel);
    let spec = || SandboxSpec {
        command: vec!["sleep".into(), "1000".into()],
        ..Default::default()
    };
    client
        .create_sandbox(CreateSandboxRequest {
            name: "before".into(),
            spec: Some(spec()),
            ..Default::default()
        })
        .await
        .expect("create before the flood");
    let baseline = open_fds(pid);

    // The flood, from a thread of its own: half prefaces and silent prefaces, 1,000 each.
    let flood_addr = addr.clone();
    let flood = std::thread::spawn(move || {
        let mut conns = Vec::new();
        for i in 0..2000 {
            let Ok(mut conn) = TcpStream::connect(&flood_addr) else {
                continue;
            };
            let sent = if i % 2 == 0 {
                conn.write_all(&PREFACE[..10])
            } else {
                conn.write_all(PREFACE)
                    .and_then(|()| conn.write_all(&EMPTY_SETTINGS))
            };
            if sent.is_ok() {
                conns.push(conn);
            }
        }
        conns
    });
    // The real client works throughout.
    let began = Instant::now();
    let mut calls = 0;
    while !flood.is_finished() || calls < 5 {
        let listed = tokio::time::timeout(
            Duration::from_secs(5),
            client.list_sandboxes(ListSandboxesRequest::default()),
        )
        .await
        .expect("a list during the flood answers within 5 s")
        .expect("a list during the flood");
        assert!(!listed.into_inner().sandboxes.is_empty());
        calls += 1;
        assert!(
            began.elapsed() < Duration::from_secs(60),
            "the flood took over a minute"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut conns = flood.join().expect("the flood thread");
    client
        .create_sandbox(CreateSandboxRequest {
            name: "during".into(),
            spec: Some(spec()),
            ..Default::default()
        })
        .await
        .expect("create during the flood");
    let held = open_fds(pid);
    eprintln!(
        "{} flood connections opened; sbxd fds {baseline} before, {held} during (limit 1024); \
         {calls} lists answered",
        conns.len()
    );
    assert!(held < 1024, "sbxd ran out of descriptors: {held}");

    // Every flood connection is closed by the server within the timeouts (1 s handshake,
    // 1 s keepalive + 1 s for the ping's answer), with some slack.
    let closing = Instant::now();
    let open: Vec<usize> = conns
        .iter_mut()
        .enumerate()
        .filter_map(|(i, conn)| {
            let left = Duration::from_secs(10).saturating_sub(closing.elapsed());
            (!closed_by_server(conn, left.max(Duration::from_millis(10)))).then_some(i)
        })
        .collect();
    assert!(
        open.is_empty(),
        "{} of {} flood connections still open after 10 s (first: {:?})",
        open.len(),
        conns.len(),
        &open[..open.len().min(5)]
    );
    drop(conns);
    let after = {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let n = open_fds(pid);
            if n <= baseline + 8 || Instant::now() >= deadline {
                break n;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    eprintln!("sbxd fds after the flood: {after}");
    assert!(
        after <= baseline + 8,
        "descriptors not given back: {baseline} -> {after}"
    );
    // A new client connects and works.
    let mut fresh = SandboxServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("a new client after the flood");
    let names: Vec<String> = fresh
        .list_sandboxes(ListSandboxesRequest::default())
        .await
        .expect("list")
        .into_inner()
        .sandboxes
        .into_iter()
        .map(|s| s.name)
        .collect();
    assert_eq!(names.len(), 2, "{names:?}");
    let log = std::fs::read_to_string(data.path().join("sbxd.log")).unwrap_or_default();
    assert!(
        !log.contains("Too many open files"),
        "sbxd ran out of descriptors:\n{log}"
    );
}

/// A stranger holds no one else's place: 4,096 HTTP/2 connections from one peer (127.0.0.2)
/// that send the preface and then nothing a credential backs take at most their share
/// (`--max-connections-per-peer`, 128), a real client (from 127.0.0.1, with a token) is served
/// in under a second meanwhile, and the stranger's connections are closed at the proof
/// timeout (here 2 s) although they answer the server; the refusals are counted per reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strangers_connections_leave_a_real_client_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // The test's own descriptors: 4,096 connections and then some.
    let hard = rustix::process::getrlimit(rustix::process::Resource::Nofile).maximum;
    rustix::process::setrlimit(
        rustix::process::Resource::Nofile,
        rustix::process::Rlimit {
            current: Some(hard.unwrap_or(65536).min(65536)),
            maximum: hard,
        },
    )
    .unwrap();
    let data = DataDir::new();
    let metrics_file = data.path().join("metrics-addr");
    let (daemon, addr) = start_with(
        data.path(),
        &[
            "--auth",
            "token",
            "--proof-timeout",
            "2",
            "--handshake-timeout",
            "1",
            "--keepalive",
            "30",
            "--metrics-listen",
            "127.0.0.1:0",
            "--metrics-addr-file",
            metrics_file.to_str().unwrap(),
        ],
    );
    let token = common::token(&data.path().join("d"), "real", "admin", None, false);
    let target: std::net::SocketAddr = addr.parse().unwrap();
    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..4096 {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let Ok(mut conn) = socket.connect(target).await else {
            refused += 1;
            continue;
        };
        if conn.write_all(PREFACE).await.is_err() || conn.write_all(&EMPTY_SETTINGS).await.is_err()
        {
            refused += 1;
            continue;
        }
        held.push(conn);
    }
    // The real client: a fresh connection and a call, timed.
    let began = Instant::now();
    let listed = common::run_bounded(
        Command::new(common::SBX)
            .args(["sandbox", "list", "-o", "json"])
            .env("SBX_ENDPOINT", &addr)
            .env("SBX_TOKEN", &token),
        "sbx sandbox list",
    );
    let took = began.elapsed();
    eprintln!("a real client answered in {took:?} beside the stranger's connections");
    assert_eq!(listed.code, 0, "{listed:?}");
    assert!(
        took < Duration::from_secs(1),
        "the real client waited {took:?}"
    );
    // How many of the stranger's are still open after a moment: at most its share.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut open = 0;
    for conn in held.iter_mut() {
        let mut buf = [0u8; 256];
        match tokio::time::timeout(Duration::from_millis(1), conn.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {}
            _ => open += 1,
        }
    }
    eprintln!(
        "{} connected, {refused} refused at once; {open} still open",
        held.len()
    );
    assert!(open <= 128, "one peer holds {open} connections");
    // The proof timeout: every one of them closed within it (2 s) and some slack, although
    // each answered what the server sent (its reads kept going).
    let closing = Instant::now();
    let mut left = held.len();
    let mut closed = vec![false; held.len()];
    while left > 0 && closing.elapsed() < Duration::from_secs(10) {
        for (i, conn) in held.iter_mut().enumerate() {
            if closed[i] {
                continue;
            }
            let mut buf = [0u8; 256];
            if let Ok(Ok(0) | Err(_)) =
                tokio::time::timeout(Duration::from_millis(1), conn.read(&mut buf)).await
            {
                closed[i] = true;
                left -= 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        left, 0,
        "{left} of the stranger's connections still open after 10 s"
    );
    let metrics = std::fs::read_to_string(&metrics_file).unwrap();
    let scraped = common::metrics::scrape(metrics.trim()).await;
    let by = |reason| {
        common::metrics::value(
            &scraped,
            "sbx_connections_refused_total",
            &[("listener", "api"), ("reason", reason)],
        )
    };
    eprintln!(
        "refused: peer_limit {}, unproven {}",
        by("peer_limit"),
        by("unproven")
    );
    assert!(by("peer_limit") >= 3900.0, "{}", by("peer_limit"));
    assert!(by("unproven") >= 1.0);
    let log = std::fs::read_to_string(data.path().join("sbxd.log")).unwrap_or_default();
    let lines = log.matches("a peer holds as many connections").count();
    assert_eq!(lines, 1, "the refusal is logged once per peer:\n{log}");
    drop(daemon);
}
