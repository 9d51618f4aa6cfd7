//! Data-plane benchmarks through sbxd — exec, stdin/stdout, cp, port-forward — ignored by
//! default. Run as root (runc, busybox-static, uidmap), in release mode:
//!
//! ```text
//! cargo test --release -p sbx-gateway --test data_plane_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! Each prints a Markdown table (docs/BENCHMARKS.md pastes them), every row measured in the
//! same run as the row it is compared with, interleaved where the rows are rounds:
//! - `exec -- true`, SBX_BENCH_EXEC_ROUNDS rounds (default 100): from the CLI (the `sbx`
//!   binary, a process per exec) and through the API (one gRPC Exec), on the oci and on the
//!   process driver, against each driver's bare mechanism without the gateway: `runc exec`
//!   into the same container, and `nsenter` into the same sandbox's namespaces;
//! - stdin/stdout throughput of `exec -i -- cat` of SBX_BENCH_STDIN_MIB (default 256) MiB,
//!   through the CLI and through the API, against a local `cat | cat` pipe of the same file;
//! - `sbx sandbox cp` of a SBX_BENCH_CP_MIB (default 1024) MiB file into the sandbox and back
//!   out, with the peak RSS of `sbx` (GNU time's %M) and of sbxd (VmHWM), against a local `cp`;
//! - port-forward: SBX_BENCH_PF_REQUESTS (default 200) sequential HTTP/1.0 requests (a new
//!   connection each) and a SBX_BENCH_PF_MIB (default 64) MiB download, through
//!   `sbx sandbox port-forward` to busybox httpd inside the sandbox, against the same httpd
//!   binary serving the same files directly on the host's loopback.

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd, sbx};
use futures::StreamExt;
use sbx_proto::v1::exec_input::Input;
use sbx_proto::v1::exec_output::Chunk;
use sbx_proto::v1::{ExecInput, ExecRequest, SandboxRef};

const CGROUP_PARENT: &str = "sbx-bench-data-plane";

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn row(label: &str, samples: &mut [Duration]) -> String {
    samples.sort();
    let n = samples.len();
    format!(
        "| {label} | {:.2} | {:.2} | {:.2} |",
        ms(samples[n / 2]),
        ms(samples[n * 9 / 10]),
        ms(samples[n - 1])
    )
}

fn sbx_bin() -> &'static str {
    common::SBX
}

/// An sbxd on `driver` with one running sandbox `box` (`sleep`); its id.
async fn with_box(driver: &str) -> (DataDir, Sbxd, String) {
    let data = DataDir::new();
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    // The harness gives the process driver a cgroup parent of its own already.
    let extra: &[&str] = match driver {
        "oci" => &["--oci-cgroup-parent", CGROUP_PARENT],
        _ => &[],
    };
    let d = Sbxd::start(data.path(), driver, extra);
    sbx(
        &d.endpoint(),
        &["sandbox", "create", "box", "--", "sleep", "1000000"],
    )
    .ok();
    let got = sbx(&d.endpoint(), &["sandbox", "get", "box", "-o", "json"]).json();
    let id = got["id"].as_str().unwrap().to_string();
    (data, d, id)
}

fn by_name() -> Option<SandboxRef> {
    Some(SandboxRef {
        name: "box".into(),
        ..Default::default()
    })
}

fn timed(cmd: &mut Command) -> Duration {
    let began = Instant::now();
    let status = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .unwrap();
    let took = began.elapsed();
    assert!(status.success(), "{cmd:?}: {status}");
    took
}

/// One gRPC exec of `true`, until its exit.
async fn api_true(d: &Sbxd) -> Duration {
    let mut sb = d.sandboxes().await;
    let began = Instant::now();
    let req = ExecRequest {
        sandbox: by_name(),
        command: vec!["true".into()],
        ..Default::default()
    };
    let mut out = sb.exec(req.alone()).await.unwrap().into_inner();
    let mut code = None;
    while let Some(m) = out.message().await.unwrap() {
        if let Some(Chunk::Exit(e)) = m.chunk {
            code = Some(e.code);
        }
    }
    assert_eq!(code, Some(0));
    began.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn exec_round_trip_vs_bare_mechanism() {
    let rounds = env_usize("SBX_BENCH_EXEC_ROUNDS", 100);
    let (oci_data, oci, oci_id) = with_box("oci").await;
    let (proc_data, process, proc_id) = with_box("process").await;
    let runc_root = oci_data.path().join("drivers/oci/runc");
    let init_pid = common::workload_pids(proc_data.path(), &proc_id)[0];
    // Warm each path once.
    let cli = |d: &Sbxd| {
        let mut cmd = Command::new(sbx_bin());
        cmd.args([
            "--endpoint",
            &d.endpoint(),
            "sandbox",
            "exec",
            "box",
            "--",
            "true",
        ]);
        cmd
    };
    let runc = || {
        let mut cmd = Command::new("runc");
        cmd.arg("--root")
            .arg(&runc_root)
            .args(["exec", &oci_id, "/dev/.sbx/busybox", "true"]);
        cmd
    };
    let nsenter = || {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &init_pid.to_string()])
            .args(["--pid", "--mount", "--uts", "--ipc", "--net", "--", "true"]);
        cmd
    };
    timed(&mut cli(&oci));
    timed(&mut runc());
    timed(&mut nsenter());
    api_true(&oci).await;
    let mut s: [Vec<Duration>; 6] = Default::default();
    for _ in 0..rounds {
        s[0].push(timed(&mut cli(&oci)));
        s[1].push(api_true(&oci).await);
        s[2].push(timed(&mut runc()));
        s[3].push(timed(&mut cli(&process)));
        s[4].push(api_true(&process).await);
        s[5].push(timed(&mut nsenter()));
    }
    let labels = [
        "oci: `sbx sandbox exec box -- true` (CLI)",
        "oci: gRPC Exec `true` (API)",
        "oci: bare `runc exec` of the same container",
        "process: `sbx sandbox exec box -- true` (CLI)",
        "process: gRPC Exec `true` (API)",
        "process: bare `nsenter` into the same sandbox",
    ];
    println!("\nexec round trip, {rounds} rounds interleaved (ms)\n");
    println!("| path | p50 | p90 | max |\n|---|---|---|---|");
    for (label, samples) in labels.iter().zip(s.iter_mut()) {
        println!("{}", row(label, samples));
    }
    let p: Vec<f64> = s.iter_mut().map(|v| ms(p50(v))).collect();
    println!(
        "\nratios of p50s: oci CLI/runc exec {:.2}, oci API/runc exec {:.2}, process CLI/nsenter \
         {:.2}, process API/nsenter {:.2}",
        p[0] / p[2],
        p[1] / p[2],
        p[3] / p[5],
        p[4] / p[5]
    );
    sbx(&oci.endpoint(), &["sandbox", "delete", "box"]).ok();
    sbx(&process.endpoint(), &["sandbox", "delete", "box"]).ok();
}

/// A file of `mib` MiB of bytes that do not compress (xorshift).
fn noise_file(dir: &Path, mib: usize) -> PathBuf {
    let path = dir.join(format!("noise-{mib}"));
    let mut f = std::io::BufWriter::new(std::fs::File::create(&path).unwrap());
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for chunk in buf.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        f.write_all(&buf).unwrap();
    }
    f.flush().unwrap();
    path
}

fn mb_per_s(bytes: u64, took: Duration) -> f64 {
    bytes as f64 / 1e6 / took.as_secs_f64()
}

/// Peak RSS (KiB) of a finished command, from GNU time's `%M` written to `report`.
fn gnu_time(args: &[&str], stdin: Option<&Path>, report: &Path) -> (Duration, u64) {
    let mut cmd = Command::new("/usr/bin/time");
    cmd.args(["-f", "%M", "-o"]).arg(report).args(args);
    cmd.stdin(match stdin {
        Some(p) => Stdio::from(std::fs::File::open(p).unwrap()),
        None => Stdio::null(),
    });
    cmd.stdout(Stdio::null()).stderr(Stdio::inherit());
    let began = Instant::now();
    let status = cmd.status().unwrap();
    let took = began.elapsed();
    assert!(status.success(), "{args:?}: {status}");
    let rss = std::fs::read_to_string(report)
        .unwrap()
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .unwrap_or(0);
    (took, rss)
}

fn sbxd_hwm_kib(d: &Sbxd) -> u64 {
    std::fs::read_to_string(format!("/proc/{}/status", d.pid()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn stdin_stdout_throughput_vs_pipe() {
    let mib = env_usize("SBX_BENCH_STDIN_MIB", 256);
    let (_data, d, _id) = with_box("oci").await;
    let tmp = tempfile::tempdir().unwrap();
    let file = noise_file(tmp.path(), mib);
    let bytes = (mib as u64) << 20;
    let report = tmp.path().join("time");
    let mut rows = Vec::new();
    for round in 0..3 {
        let began = Instant::now();
        let status = Command::new("sh")
            .arg("-c")
            .arg(format!("cat {} | cat > /dev/null", file.display()))
            .status()
            .unwrap();
        assert!(status.success());
        let local = began.elapsed();
        let endpoint = d.endpoint();
        let (cli, rss) = gnu_time(
            &[
                sbx_bin(),
                "--endpoint",
                &endpoint,
                "sandbox",
                "exec",
                "-i",
                "box",
                "--",
                "cat",
            ],
            Some(&file),
            &report,
        );
        // Through the API: stdin sent as 64 KiB messages, stdout counted.
        let mut sb = d.sandboxes().await;
        let start = ExecInput {
            input: Some(Input::Start(ExecRequest {
                sandbox: by_name(),
                command: vec!["cat".into()],
                stdin: true,
                ..Default::default()
            })),
        };
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tx.send(start).await.unwrap();
        let path = file.clone();
        let feeder = tokio::task::spawn_blocking(move || {
            let mut f = std::fs::File::open(path).unwrap();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = f.read(&mut buf).unwrap();
                if n == 0 {
                    return;
                }
                let msg = ExecInput {
                    input: Some(Input::Stdin(buf[..n].to_vec())),
                };
                if tx.blocking_send(msg).is_err() {
                    return;
                }
            }
        });
        let began = Instant::now();
        let mut out = sb
            .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        let mut got = 0u64;
        while let Some(m) = out.next().await {
            match m.unwrap().chunk {
                Some(Chunk::Stdout(b)) => got += b.len() as u64,
                Some(Chunk::Exit(e)) => assert_eq!(e.code, 0),
                _ => {}
            }
        }
        let api = began.elapsed();
        feeder.await.unwrap();
        assert_eq!(got, bytes);
        rows.push(format!(
            "| {round} | {:.0} | {:.0} | {:.0} | {} |",
            mb_per_s(bytes, local),
            mb_per_s(bytes, cli),
            mb_per_s(bytes, api),
            rss / 1024
        ));
    }
    println!("\n`exec -i -- cat` of {mib} MiB (MB/s; sbx peak RSS MiB)\n");
    println!("| round | local `cat \\| cat` | CLI `sbx sandbox exec -i` | API | sbx RSS |");
    println!("|---|---|---|---|---|");
    for r in rows {
        println!("{r}");
    }
    println!("sbxd peak RSS: {} MiB", sbxd_hwm_kib(&d) / 1024);
    sbx(&d.endpoint(), &["sandbox", "delete", "box"]).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn cp_in_and_out_vs_local_cp() {
    let mib = env_usize("SBX_BENCH_CP_MIB", 1024);
    let (_data, d, _id) = with_box("oci").await;
    let tmp = tempfile::tempdir().unwrap();
    let file = noise_file(tmp.path(), mib);
    let bytes = (mib as u64) << 20;
    let report = tmp.path().join("time");
    let endpoint = d.endpoint();
    let began = Instant::now();
    let status = Command::new("cp")
        .arg(&file)
        .arg(tmp.path().join("local-copy"))
        .status()
        .unwrap();
    assert!(status.success());
    let local = began.elapsed();
    std::fs::remove_file(tmp.path().join("local-copy")).unwrap();
    let hwm_before = sbxd_hwm_kib(&d);
    let file_arg = file.display().to_string();
    let (cp_in, rss_in) = gnu_time(
        &[
            sbx_bin(),
            "--endpoint",
            &endpoint,
            "sandbox",
            "cp",
            &file_arg,
            "box:/sandbox/big",
        ],
        None,
        &report,
    );
    let out = tmp.path().join("back");
    let out_arg = out.display().to_string();
    let (cp_out, rss_out) = gnu_time(
        &[
            sbx_bin(),
            "--endpoint",
            &endpoint,
            "sandbox",
            "cp",
            "box:/sandbox/big",
            &out_arg,
        ],
        None,
        &report,
    );
    let hwm_after = sbxd_hwm_kib(&d);
    assert_eq!(std::fs::metadata(&out).unwrap().len(), bytes);
    let same = Command::new("cmp").arg(&file).arg(&out).status().unwrap();
    assert!(same.success(), "the copy out differs from the original");
    println!("\n`sbx sandbox cp` of {mib} MiB (MB/s; peak RSS MiB)\n");
    println!("| copy | MB/s | sbx RSS |\n|---|---|---|");
    println!("| local `cp` | {:.0} | - |", mb_per_s(bytes, local));
    println!(
        "| into the sandbox | {:.0} | {} |",
        mb_per_s(bytes, cp_in),
        rss_in / 1024
    );
    println!(
        "| out of the sandbox | {:.0} | {} |",
        mb_per_s(bytes, cp_out),
        rss_out / 1024
    );
    println!(
        "sbxd peak RSS: {} MiB before the copies, {} MiB after",
        hwm_before / 1024,
        hwm_after / 1024
    );
    sbx(&d.endpoint(), &["sandbox", "delete", "box"]).ok();
}

/// One HTTP/1.0 GET of `path` on `port`, on a new connection; the body's length.
fn http_get(port: u16, path: &str) -> usize {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\n\r\n").unwrap();
    let mut all = Vec::new();
    s.read_to_end(&mut all).unwrap();
    let head_end = all
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("an HTTP response");
    assert!(all.starts_with(b"HTTP/1.0 200") || all.starts_with(b"HTTP/1.1 200"));
    all.len() - head_end - 4
}

/// A child killed (by pid) when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn port_forward_vs_direct_loopback() {
    let requests = env_usize("SBX_BENCH_PF_REQUESTS", 200);
    let mib = env_usize("SBX_BENCH_PF_MIB", 64);
    let (_data, d, _id) = with_box("oci").await;
    let endpoint = d.endpoint();
    // The same files inside the sandbox and on the host.
    let www = tempfile::tempdir().unwrap();
    std::fs::write(www.path().join("index.html"), "hello\n").unwrap();
    let big = noise_file(www.path(), mib);
    std::fs::rename(&big, www.path().join("big")).unwrap();
    let www_arg = www.path().display().to_string();
    sbx(&endpoint, &["sandbox", "cp", &www_arg, "box:/www"]).ok();
    sbx(
        &endpoint,
        &[
            "sandbox",
            "exec",
            "box",
            "--",
            "httpd",
            "-p",
            "127.0.0.1:8080",
            "-h",
            "/www",
        ],
    )
    .ok();
    // The host's side: the same busybox httpd binary, in the foreground on a free port.
    let host_port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let _host_httpd = Child(
        Command::new("/bin/busybox")
            .args(["httpd", "-f", "-p", &format!("127.0.0.1:{host_port}"), "-h"])
            .arg(www.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut pf = Command::new(sbx_bin())
        .args([
            "--endpoint",
            &endpoint,
            "sandbox",
            "port-forward",
            "box",
            "0:8080",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(pf.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let _pf = Child(pf);
    let fwd_port: u16 = line
        .split(" -> ")
        .next()
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    // Wait for the host httpd to listen.
    let deadline = Instant::now() + Duration::from_secs(5);
    while std::net::TcpStream::connect(("127.0.0.1", host_port)).is_err() {
        assert!(Instant::now() < deadline, "the host httpd never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(http_get(fwd_port, "/index.html"), 6);
    let mut direct = Vec::new();
    let mut forwarded = Vec::new();
    for _ in 0..requests {
        let t = Instant::now();
        http_get(host_port, "/index.html");
        direct.push(t.elapsed());
        let t = Instant::now();
        http_get(fwd_port, "/index.html");
        forwarded.push(t.elapsed());
    }
    let bytes = (mib as u64) << 20;
    let mut rates = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        assert_eq!(http_get(host_port, "/big") as u64, bytes);
        let direct_rate = mb_per_s(bytes, t.elapsed());
        let t = Instant::now();
        assert_eq!(http_get(fwd_port, "/big") as u64, bytes);
        rates.push((direct_rate, mb_per_s(bytes, t.elapsed())));
    }
    println!("\nport-forward, {requests} sequential requests interleaved (ms per request)\n");
    println!("| path | p50 | p90 | max |\n|---|---|---|---|");
    let d50 = ms(p50(&mut direct));
    let f50 = ms(p50(&mut forwarded));
    println!(
        "{}",
        row("direct to httpd on the host's loopback", &mut direct)
    );
    println!(
        "{}",
        row("through `sbx sandbox port-forward`", &mut forwarded)
    );
    println!("\nadded latency per request (p50): {:.2} ms", f50 - d50);
    println!("\n{mib} MiB download (MB/s)\n\n| round | direct | forwarded |\n|---|---|---|");
    for (i, (direct_rate, fwd_rate)) in rates.iter().enumerate() {
        println!("| {i} | {direct_rate:.0} | {fwd_rate:.0} |");
    }
    sbx(&endpoint, &["sandbox", "delete", "box"]).ok();
}
