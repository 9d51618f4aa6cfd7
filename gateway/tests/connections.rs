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
    let addr_file = data.join("addr");
    let log = std::fs::File::create(data.join("sbxd.log")).unwrap();
    let child = Command::new("prlimit")
        .args(["--nofile=1024:1024", "--"])
        .arg(SBXD)
        .args([
            "serve",
            "--driver",
            "sim",
            "--listen",
            "127.0.0.1:0",
            "--auth",
            "none",
        ])
        .args(["--handshake-timeout", "1", "--keepalive", "1"])
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
