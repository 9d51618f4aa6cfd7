//! sbxd as a program: its help, and the ways it refuses to start, each with a clear error and
//! exit status 1 — without disturbing an sbxd already running.

mod common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd};

/// Runs sbxd to completion (at most 30 s; killed by pid after) and answers (code, stderr).
fn run_sbxd(args: &[&str]) -> (i32, String, String) {
    let mut child = common::sbxd_command()
        .args(args)
        .env("SBX_LOG", "warn")
        // Plain TCP on loopback, as the tests' clients dial it (`--auth` overrides).
        .env("SBX_AUTH", "none")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sbxd");
    let began = Instant::now();
    loop {
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        if began.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("sbxd {args:?} did not exit within 30 s");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().expect("output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).to_string(),
        String::from_utf8_lossy(&out.stderr).to_string(),
    )
}

#[test]
fn help_explains_every_flag() {
    let (code, top, _) = run_sbxd(&["--help"]);
    assert_eq!(code, 0);
    assert!(top.contains("serve"), "{top}");
    let (code, help, _) = run_sbxd(&["serve", "--help"]);
    assert_eq!(code, 0);
    for flag in [
        "--listen",
        "--addr-file",
        "--data-dir",
        "--driver",
        "--log-format",
        "--reconcile-interval",
        "--shutdown-grace",
        "--process-cgroup-parent",
        "--sim-latency-ms",
        "--sim-fail",
    ] {
        assert!(help.contains(flag), "{flag} missing from:\n{help}");
    }
    for env in ["SBX_LISTEN", "SBX_ADDR_FILE", "SBX_DATA_DIR", "SBX_DRIVER"] {
        assert!(help.contains(env), "{env} missing");
    }
    assert!(help.contains("do NOT survive") || help.contains("do not survive"));
    // The secure default and its escape hatches are explained.
    for said in [
        "sbxd.sock",
        "--auth",
        "none",
        "--tls-cert",
        "--tls-client-ca",
    ] {
        assert!(help.contains(said), "{said} missing from:\n{help}");
    }
    let (code, token_help, _) = run_sbxd(&["token", "create", "--help"]);
    assert_eq!(code, 0);
    for said in [
        "--role",
        "--workspace",
        "--ttl",
        "--cert-only",
        "viewer",
        "editor",
        "admin",
    ] {
        assert!(
            token_help.contains(said),
            "{said} missing from:\n{token_help}"
        );
    }
    let (code, _, err) = run_sbxd(&["serve", "--driver", "warp"]);
    assert_eq!(code, 2, "a usage error: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_to_start_are_clear_and_leave_the_running_one_alone() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let other = DataDir::new();
    let other_dir = other.path().to_str().unwrap();

    // The port is taken.
    let (code, _, err) = run_sbxd(&[
        "serve",
        "--driver",
        "sim",
        "--listen",
        &d.addr,
        "--data-dir",
        other_dir,
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot listen on"), "{err}");

    // The data dir is in use by the running sbxd.
    let (code, _, err) = run_sbxd(&[
        "serve",
        "--driver",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.path().to_str().unwrap(),
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("cannot open the store"), "{err}");

    // A sim fault that names no operation.
    let (code, _, err) = run_sbxd(&[
        "serve",
        "--driver",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        other_dir,
        "--sim-fail",
        "explode",
    ]);
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("explode"), "{err}");

    d.assert_healthy().await;
}

/// A log that is not a terminal (here a file, as under systemd or `2>sbxd.log`) carries no
/// ANSI colour: not one ESC byte, and the level reads as plain text.
#[test]
fn logs_to_a_file_have_no_colour() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "sim", &[]);
    let (_, status) = d.sigterm(Duration::from_secs(10));
    assert!(status.success());
    let log = d.log_text();
    assert!(log.contains(" INFO "), "no plain INFO level in:\n{log}");
    assert!(!log.contains('\u{1b}'), "an ESC byte in the log:\n{log:?}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "sim", &["--log-format", "json"]);
    let (_, status) = d.sigterm(Duration::from_secs(10));
    assert!(status.success());
    let log = d.log_text();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    let messages: Vec<&str> = lines
        .iter()
        .filter_map(|v| v["fields"]["message"].as_str())
        .collect();
    for wanted in ["serving", "shutting down"] {
        assert!(messages.contains(&wanted), "{wanted:?} not in {messages:?}");
    }
}

/// SIGTERM lets a call in flight finish: a stop that takes the (sim) driver 800 ms answers
/// Stopped, and only then does sbxd exit, with status 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_finishes_calls_in_flight() {
    use sbx_proto::v1::{
        CreateSandboxRequest, GetSandboxRequest, Phase, SandboxRef, SandboxSpec, StopSandboxRequest,
    };
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "sim", &["--sim-latency-ms", "800"]);
    let mut sb = d.sandboxes().await;
    let created = sb
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "slow".into(),
            spec: Some(SandboxSpec {
                command: vec!["sleep".into(), "1000".into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .unwrap()
        .into_inner();
    let by_id = Some(SandboxRef {
        id: created.id.clone(),
        ..Default::default()
    });
    common::eventually(Duration::from_secs(30), "Ready", || {
        let mut sb = sb.clone();
        let by_id = by_id.clone();
        async move {
            let s = sb
                .get_sandbox(GetSandboxRequest { sandbox: by_id })
                .await
                .ok()?
                .into_inner();
            (s.phase() == Phase::Ready).then_some(())
        }
    })
    .await;
    let mut stopper = sb.clone();
    let stop = tokio::spawn(async move {
        stopper
            .stop_sandbox(StopSandboxRequest { sandbox: by_id })
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (took, status) = tokio::task::block_in_place(|| d.sigterm(Duration::from_secs(15)));
    assert!(status.success(), "{status:?}");
    let stopped = tokio::time::timeout(Duration::from_secs(5), stop)
        .await
        .expect("the stop never answered")
        .unwrap()
        .expect("the stop in flight failed")
        .into_inner();
    assert_eq!(stopped.phase(), Phase::Stopped);
    assert!(
        took >= Duration::from_millis(300),
        "sbxd exited after {took:?}, before the stop in flight could finish"
    );
}

/// While sandboxes re-attach after a restart, health says NOT_SERVING and there is no address
/// file; both change once every sandbox has re-attached. The sim driver with 1.5 s per driver
/// call makes the re-attach window wide enough to see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_until_every_sandbox_reattached() {
    use sbx_proto::v1::{CreateSandboxRequest, SandboxSpec};
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;

    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    for i in 0..3 {
        sb.create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: format!("r{i}"),
            spec: Some(SandboxSpec {
                command: vec!["sleep".into(), "1000".into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .unwrap();
    }
    let (_, status) = tokio::task::block_in_place(|| d.sigterm(Duration::from_secs(10)));
    assert!(status.success());

    // A port picked here, so that health can be asked before the address file exists.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let listen = format!("127.0.0.1:{port}");
    let mut d = Sbxd::spawn(data.path(), "sim", &listen, &["--sim-latency-ms", "1500"]);
    let endpoint = format!("http://{listen}");
    let began = Instant::now();
    let mut saw_not_serving = false;
    let serving_at = loop {
        assert!(began.elapsed() < Duration::from_secs(60), "never SERVING");
        tokio::time::sleep(Duration::from_millis(20)).await;
        let Ok(channel) = tonic::transport::Channel::from_shared(endpoint.clone())
            .unwrap()
            .connect()
            .await
        else {
            continue;
        };
        // Read before asking: a file that existed before the answer means SERVING was set.
        let file_before = d.addr_file_exists();
        let answer = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: String::new(),
            })
            .await;
        let Ok(answer) = answer else { continue };
        match answer.into_inner().status {
            s if s == ServingStatus::NotServing as i32 => {
                assert!(!file_before, "address file written while NOT_SERVING");
                saw_not_serving = true;
            }
            s if s == ServingStatus::Serving as i32 => break began.elapsed(),
            other => panic!("unexpected health {other}"),
        }
    };
    assert!(
        saw_not_serving,
        "health never said NOT_SERVING while re-attaching"
    );
    d.wait_serving();
    assert_eq!(d.addr, listen);
    assert!(d.log_text().contains("every sandbox re-attached"));
    eprintln!("SERVING {serving_at:?} after start");
    d.assert_healthy().await;
}

/// A call that outlasts --shutdown-grace does not hold sbxd up: it exits 0 after the grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_grace_bounds_a_slow_call() {
    use sbx_proto::v1::{CreateSandboxRequest, SandboxSpec};
    let data = DataDir::new();
    let mut d = Sbxd::start(
        data.path(),
        "sim",
        &["--sim-latency-ms", "8000", "--shutdown-grace", "1"],
    );
    let mut sb = d.sandboxes().await;
    sb.create_sandbox(CreateSandboxRequest {
        providers: Default::default(),
        workspace: String::new(),
        name: "slow".into(),
        spec: Some(SandboxSpec {
            command: vec!["sleep".into(), "1000".into()],
            ..Default::default()
        }),
        stopped: false,
    })
    .await
    .unwrap();
    // The stop waits behind the 8 s driver create in the sandbox's mailbox.
    let mut stopper = sb.clone();
    let stop = tokio::spawn(async move {
        stopper
            .stop_sandbox(sbx_proto::v1::StopSandboxRequest {
                sandbox: Some(sbx_proto::v1::SandboxRef {
                    name: "slow".into(),
                    ..Default::default()
                }),
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (took, status) = tokio::task::block_in_place(|| d.sigterm(Duration::from_secs(15)));
    eprintln!("exited {took:?} after SIGTERM with a slow call in flight");
    assert!(status.success(), "{status:?}");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(6),
        "exited after {took:?}; the grace is 1 s"
    );
    let answer = tokio::time::timeout(Duration::from_secs(5), stop)
        .await
        .expect("the cut-off call never ended")
        .unwrap();
    assert!(
        answer.is_err(),
        "the call cut off at shutdown cannot have succeeded"
    );
}

/// `--listen` keeps the Unix socket beside TCP: its owner is an admin there, with no token,
/// while a TCP caller without one is refused; `--no-socket` leaves the socket out.
#[test]
fn listen_keeps_the_socket_for_the_local_admin_unless_told_not_to() {
    let data = DataDir::new();
    let token = [("SBX_AUTH", "token")];
    let mut d = Sbxd::spawn_with_env(data.path(), "sim", "127.0.0.1:0", &[], &token);
    d.wait_serving();
    assert!(
        !d.addr.starts_with("unix://"),
        "the address file names TCP: {}",
        d.addr
    );
    let socket = format!("unix://{}", data.path().join("sbxd.sock").display());
    let local = common::sbx(&socket, &["sandbox", "list", "-o", "json"]);
    assert_eq!(local.json(), serde_json::json!([]), "{local:?}");
    let remote = common::sbx(&d.endpoint(), &["sandbox", "list"]);
    assert_ne!(remote.code, 0, "{remote:?}");
    assert!(remote.stderr.contains("UNAUTHENTICATED"), "{remote:?}");
    d.sigterm(Duration::from_secs(30));

    let bare = DataDir::new();
    let mut d = Sbxd::spawn_with_env(bare.path(), "sim", "127.0.0.1:0", &["--no-socket"], &token);
    d.wait_serving();
    assert!(!bare.path().join("sbxd.sock").exists());
    d.sigterm(Duration::from_secs(30));
    // --no-socket alone would serve nothing.
    let (code, _, err) = run_sbxd(&["serve", "--driver", "sim", "--no-socket"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--listen"), "{err}");
}

/// A mount namespace of the test's own, held by a `sleep` that lives as long as this: in it an
/// empty tmpfs is on /run and on /var/lib, so the places `sbx` looks for a gateway no setting
/// names — the package's service socket, /run/sbx/sbxd.sock, and root's data dir's,
/// /var/lib/sbx/sbxd.sock — are the test's, whatever this host runs. Programs are started in
/// it with `nsenter --mount` (which execs them: their pid is the child's).
struct PrivateMounts {
    holder: std::process::Child,
}

impl PrivateMounts {
    fn new() -> PrivateMounts {
        let holder = std::process::Command::new("unshare")
            .args(["--mount", "--propagation", "private", "--", "sleep", "300"])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare");
        let mounts = PrivateMounts { holder };
        let ours = std::fs::read_link("/proc/self/ns/mnt").unwrap();
        let began = Instant::now();
        while std::fs::read_link(format!("/proc/{}/ns/mnt", mounts.holder.id())).ok()
            == Some(ours.clone())
        {
            assert!(began.elapsed() < Duration::from_secs(10), "unshare --mount");
            std::thread::sleep(Duration::from_millis(10));
        }
        let script = "mount -t tmpfs sbx-test-run /run && mkdir -m 0755 /run/sbx && \
                      mount -t tmpfs sbx-test-lib /var/lib && mkdir -m 0711 /var/lib/sbx";
        let made = common::run_bounded(mounts.command("sh").args(["-c", script]), "mounts");
        assert_eq!(made.code, 0, "{made:?}");
        mounts
    }

    /// `program` to be run in the namespace.
    fn command(&self, program: &str) -> std::process::Command {
        let mut command = std::process::Command::new("nsenter");
        command
            .arg("--target")
            .arg(self.holder.id().to_string())
            .args(["--mount", "--", program]);
        command
    }
}

/// A process of the test's, killed (by its pid) and reaped when dropped, also on a failure.
struct Running(std::process::Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for PrivateMounts {
    fn drop(&mut self) {
        // The namespace and its tmpfs go with the last process in it.
        let _ = self.holder.kill();
        let _ = self.holder.wait();
    }
}

#[test]
fn sbx_with_no_endpoint_waits_for_the_service_socket_and_names_every_place_when_none_serves() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: a mount namespace of the test's own needs root");
        return;
    }
    let mounts = PrivateMounts::new();
    let home = DataDir::new();
    let sbx = |args: &[&str]| {
        let mut command = mounts.command(common::SBX);
        command
            .args(args)
            .env_remove("SBX_ENDPOINT")
            .env_remove("SBX_CONFIG")
            .env("HOME", home.path())
            .env("XDG_CONFIG_HOME", home.path().join("config"))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        command
    };

    // `sbx wait --for serving` begins before the service has made its socket (right after
    // `systemctl start sbxd`); the service then serves on /run/sbx/sbxd.sock, as the
    // package's unit says.
    let mut wait = Running(
        sbx(&["wait", "--for", "serving", "--timeout", "20"])
            .spawn()
            .expect("sbx wait"),
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(wait.0.try_wait().unwrap().is_none(), "sbx wait waits");
    let data = DataDir::new();
    let mut service = Running(
        mounts
            .command(common::SBXD)
            .args(["serve", "--socket", "/run/sbx/sbxd.sock", "--data-dir"])
            .arg(data.path())
            .args(["--driver", "process"])
            .args(["--process-cgroup-parent", common::TEST_CGROUP_PARENT])
            .env("SBX_NETWORK_CIDR", "off")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("sbxd"),
    );
    let started = Instant::now();
    let status = common::wait_bounded(&mut wait.0, Duration::from_secs(30), "sbx wait");
    let waited = started.elapsed();
    let read = |pipe: Option<&mut dyn std::io::Read>| {
        let mut text = String::new();
        if let Some(pipe) = pipe {
            let _ = pipe.read_to_string(&mut text);
        }
        text
    };
    let stdout = read(wait.0.stdout.as_mut().map(|p| p as &mut dyn std::io::Read));
    let stderr = read(wait.0.stderr.as_mut().map(|p| p as &mut dyn std::io::Read));
    eprintln!("sbx wait: {status} {waited:?} after sbxd began; stdout {stdout:?}; stderr {stderr}");
    assert!(status.success(), "{stderr}");
    assert_eq!(stdout, "unix:///run/sbx/sbxd.sock\n");
    assert!(
        stderr.contains(
            "waiting for sbxd to serve: unix:///run/sbx/sbxd.sock (the sbx package's \
             service): no socket yet; unix:///var/lib/sbx/sbxd.sock"
        ),
        "progress says where it looks: {stderr}"
    );
    // A command with no endpoint reaches the same gateway.
    let listed = common::run_bounded(&mut sbx(&["workspace", "ls"]), "sbx workspace ls");
    assert_eq!(listed.code, 0, "{listed:?}");
    assert!(listed.stdout.contains("default"), "{listed:?}");

    // The service stops: nothing serves anywhere, and the error names every place, in order.
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(&service.0),
        rustix::process::Signal::TERM,
    );
    common::wait_bounded(&mut service.0, Duration::from_secs(30), "sbxd");
    let failed = common::run_bounded(&mut sbx(&["workspace", "ls"]), "sbx workspace ls");
    assert_eq!(failed.code, 1, "{failed:?}");
    let places = [
        "--endpoint (not given)",
        "SBX_ENDPOINT (not set)",
        "the context (none",
        "unix:///run/sbx/sbxd.sock (the sbx package's service) (",
        "unix:///var/lib/sbx/sbxd.sock (sbxd serve's default, in your data dir) (no socket there)",
    ];
    let mut from = 0;
    for place in places {
        let at = failed.stderr[from..]
            .find(place)
            .unwrap_or_else(|| panic!("{place:?} after byte {from} of: {}", failed.stderr));
        from += at + place.len();
    }
    assert!(
        failed.stderr.contains("sbx wait --for serving"),
        "{failed:?}"
    );
}
