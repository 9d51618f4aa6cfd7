//! The vm driver's own promises, beyond the conformance suite, in two boots: `/sandbox`
//! survives a graceful stop and a new boot; the stop reaches the guest's command as SIGTERM;
//! a VM outlives its driver and is found again, also from QEMU's pidfile alone; the generation
//! marker is what the driver reports, and a start under another generation says so instead of
//! rebooting; exec and logs work, the guest's loopback is up, exec output is streamed (the
//! first line of `echo; sleep 3; echo` seconds before the exit) and not capped (3 MiB whole);
//! delete leaves nothing; an exec that ends amid its stdin leaves the exec port serving. And
//! clear errors for what is missing.

mod vm_support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_driver_vm::{AssetPaths, VmDriver, VmDriverOptions};
use sha2::{Digest, Sha256};
use vm_support::VmEnv;

const WORKLOAD: &str = "echo workload-started; echo boot >> /sandbox/boots; \
                        trap 'echo term-seen >> /sandbox/terms; sync; exit 0' TERM; \
                        while :; do sleep 1; done";

/// What one exec gave: its exit code, stdout and stderr, when the first stdout came and
/// when the exit did (from the call).
struct Ran {
    code: i32,
    out: Vec<u8>,
    err: Vec<u8>,
    first_out: Option<Duration>,
    took: Duration,
}

async fn exec(driver: &VmDriver, id: &str, script: &str) -> (i32, String, String) {
    let ran = run(driver, id, script).await;
    (
        ran.code,
        String::from_utf8_lossy(&ran.out).into_owned(),
        String::from_utf8_lossy(&ran.err).into_owned(),
    )
}

async fn run(driver: &VmDriver, id: &str, script: &str) -> Ran {
    let began = Instant::now();
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            env: [("WHO".to_string(), "it's me".to_string())].into(),
            timeout_seconds: 30,
            ..Default::default()
        })
        .await
        .expect("exec");
    let (mut out, mut err, mut code, mut first_out) = (Vec::new(), Vec::new(), None, None);
    while let Some(item) = stream.next().await {
        match item.expect("exec output").chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => {
                first_out.get_or_insert(began.elapsed());
                out.extend(b)
            }
            Some(pb::exec_output::Chunk::Stderr(b)) => err.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            None => {}
        }
    }
    Ran {
        code: code.expect("an exit"),
        out,
        err,
        first_out,
        took: began.elapsed(),
    }
}

async fn logs(driver: &VmDriver, id: &str) -> String {
    let mut stream = driver
        .logs(pb::LogsRequest {
            sandbox_id: id.to_string(),
            follow: false,
            tail_lines: 0,
            ..Default::default()
        })
        .await
        .expect("logs");
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        text.extend(chunk.expect("log chunk").data);
    }
    String::from_utf8_lossy(&text).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_data_markers_and_rediscovery() {
    let env = VmEnv::new();
    let driver = env.open().await;
    let id = uuid::Uuid::new_v4();
    let sid = id.to_string();
    let began = std::time::Instant::now();
    let created = driver
        .create(pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: sid.clone(),
            workspace: "team-a".into(),
            name: "demo".into(),
            spec: Some(pb::SandboxSpec {
                command: vec!["sh".into(), "-c".into(), WORKLOAD.into()],
                ..Default::default()
            }),
            generation: 1,
            stopped: false,
        })
        .await
        .expect("create");
    eprintln!("create → running in {:?}", began.elapsed());
    assert_eq!(created.state, pb::State::Running as i32);
    assert_eq!(created.generation, 1);
    let first_instance = created.instance_id.clone();
    let qemu = driver.vm_identity(id).expect("a live qemu");

    // Exec: stdout, stderr, exit code, environment, working directory /sandbox.
    let (code, out, err) = exec(&driver, &sid, "echo \"$WHO\"; pwd; echo oops >&2; exit 3").await;
    assert_eq!(
        (code, out.as_str(), err.as_str()),
        (3, "it's me\n/sandbox\n", "oops\n")
    );
    let (code, out, _) = exec(&driver, &sid, "echo kept > /sandbox/data; hostname").await;
    assert_eq!((code, out.as_str()), (0, "demo\n"));
    assert!(logs(&driver, &sid).await.contains("workload-started"));

    // Loopback is up: a server started by one exec answers another exec on 127.0.0.1.
    let (code, _, err) = exec(
        &driver,
        &sid,
        "mkdir -p /tmp/www && echo served-from-loopback > /tmp/www/index.html && \
         busybox httpd -p 127.0.0.1:8080 -h /tmp/www",
    )
    .await;
    assert_eq!(code, 0, "httpd did not start: {err}");
    let (code, out, err) = exec(&driver, &sid, "wget -q -O - http://127.0.0.1:8080/").await;
    assert_eq!(
        (code, out.as_str()),
        (0, "served-from-loopback\n"),
        "wget through the guest's loopback: {err}"
    );
    let began = std::time::Instant::now();
    for _ in 0..5 {
        assert_eq!(exec(&driver, &sid, "true").await.0, 0);
    }
    eprintln!("exec round trip (true): {:?}", began.elapsed() / 5);

    // Output comes as it is written: the first line long before the exit, 3 s later.
    let ran = run(&driver, &sid, "echo first; sleep 3; echo second").await;
    let first = ran.first_out.expect("stdout");
    assert_eq!((ran.code, ran.out.as_slice()), (0, &b"first\nsecond\n"[..]));
    assert!(
        ran.took >= Duration::from_secs(3) && first + Duration::from_millis(2500) <= ran.took,
        "the first line came {first:?} after the call, the exit {:?}: not streamed",
        ran.took
    );
    // No cap: 3 MiB of random bytes arrive whole (length and sha256 against the guest's).
    let (code, sum, err) = exec(
        &driver,
        &sid,
        "head -c 3145728 /dev/urandom > /tmp/big && sha256sum /tmp/big",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    let ran = run(&driver, &sid, "cat /tmp/big").await;
    assert_eq!((ran.code, ran.out.len()), (0, 3 << 20));
    let got: String = Sha256::digest(&ran.out)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        sum.split_whitespace().next(),
        Some(got.as_str()),
        "3 MiB through exec differ from the guest's file"
    );
    eprintln!(
        "3 MiB of exec output in {:?} ({:.1} MiB/s)",
        ran.took,
        3.0 / ran.took.as_secs_f64()
    );

    // The driver goes away; the VM does not. A new instance finds it: by its record…
    drop(driver);
    let driver = env.open().await;
    assert_eq!(driver.vm_identity(id), Some(qemu));
    let got = driver
        .get(pb::GetRequest {
            sandbox_id: sid.clone(),
        })
        .await
        .unwrap();
    assert_eq!(
        (got.state, got.instance_id.as_str()),
        (pb::State::Running as i32, first_instance.as_str())
    );
    // …and, when the record lost it (a driver killed between launch and record update), by
    // QEMU's pidfile and QMP.
    drop(driver);
    let record_path = env.state.path().join("vms").join(&sid).join("sandbox.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    record["qemu"] = serde_json::Value::Null;
    std::fs::write(&record_path, serde_json::to_vec(&record).unwrap()).unwrap();
    let driver = env.open().await;
    assert_eq!(driver.vm_identity(id), Some(qemu));

    // The generation marker, changed by hand, is what the driver reports; a start under
    // another generation is a mismatch, under the marker's a no-op: no reboot either way.
    std::fs::write(
        env.state.path().join("vms").join(&sid).join("generation"),
        "77\n",
    )
    .unwrap();
    let got = driver
        .get(pb::GetRequest {
            sandbox_id: sid.clone(),
        })
        .await
        .unwrap();
    assert_eq!(got.generation, 77);
    match driver
        .start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: sid.clone(),
            generation: 2,
        })
        .await
    {
        Err(DriverError::GenerationMismatch {
            running: 77,
            requested: 2,
            ..
        }) => {}
        other => panic!("expected a generation mismatch, got {other:?}"),
    }
    let same = driver
        .start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: sid.clone(),
            generation: 77,
        })
        .await
        .unwrap();
    assert_eq!(same.instance_id, first_instance);

    // A graceful stop: the command gets SIGTERM (its trap writes to /sandbox), the guest
    // syncs and powers off.
    let stopped = driver
        .stop(pb::StopRequest {
            sandbox_id: sid.clone(),
            grace_period_ms: 3000,
        })
        .await
        .unwrap();
    assert_eq!(stopped.state, pb::State::Stopped as i32);
    assert_eq!(driver.vm_identity(id), None);

    // A new boot on the same disk under a new generation: everything written is there.
    let began = std::time::Instant::now();
    let started = driver
        .start(pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: sid.clone(),
            generation: 78,
        })
        .await
        .unwrap();
    eprintln!("start → running in {:?}", began.elapsed());
    assert_eq!(
        (started.state, started.generation),
        (pb::State::Running as i32, 78)
    );
    assert_ne!(started.instance_id, first_instance);
    let (code, out, _) = exec(
        &driver,
        &sid,
        "cat /sandbox/data /sandbox/terms /sandbox/boots",
    )
    .await;
    assert_eq!((code, out.as_str()), (0, "kept\nterm-seen\nboot\nboot\n"));

    // Delete: the VM ends, its directory (disk included) goes.
    let deleted = driver
        .delete(pb::DeleteRequest {
            sandbox_id: sid.clone(),
        })
        .await
        .unwrap();
    assert!(deleted.deleted);
    assert!(!env.state.path().join("vms").join(&sid).exists());
    assert!(matches!(
        driver
            .get(pb::GetRequest {
                sandbox_id: sid.clone()
            })
            .await,
        Err(DriverError::NotFound { .. })
    ));
    env.assert_no_vm_left();
}

#[tokio::test]
async fn vm_missing_pieces_are_named() {
    let state = tempfile::tempdir().unwrap();
    let open = |assets: AssetPaths| {
        VmDriver::open(
            state.path().to_path_buf(),
            VmDriverOptions {
                assets,
                asset_cache: Some(vm_support::asset_cache()),
                ..VmDriverOptions::default()
            },
        )
    };
    let err = open(AssetPaths {
        kernel: Some("/nonexistent/vmlinuz-9".into()),
        ..AssetPaths::default()
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/vmlinuz-9"), "{err}");
    let err = open(AssetPaths {
        busybox: Some("/nonexistent/busybox".into()),
        ..AssetPaths::default()
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("busybox-static"), "{err}");
    let err = VmDriver::open(
        state.path().to_path_buf(),
        VmDriverOptions {
            qemu: Some("/nonexistent/qemu".into()),
            ..VmDriverOptions::default()
        },
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("/nonexistent/qemu"), "{err}");

    // Bad requests are refused before anything boots.
    let env = VmEnv::new();
    let driver = env.open().await;
    let err = driver
        .create(pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: uuid::Uuid::new_v4().to_string(),
            workspace: "w".into(),
            name: "n".into(),
            spec: Some(pb::SandboxSpec {
                command: vec!["true".into()],
                env: [("NOT-AN-ID".to_string(), "x".to_string())].into(),
                ..Default::default()
            }),
            generation: 1,
            stopped: false,
        })
        .await
        .unwrap_err();
    assert!(
        matches!(err, DriverError::InvalidArgument(ref m) if m.contains("NOT-AN-ID")),
        "{err}"
    );
    assert!(driver.list().await.unwrap().is_empty());
}

/// A boot that does not finish in time is ended and reported as such; the sandbox says its
/// launch did not complete, and the retried create boots it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_a_boot_that_times_out_is_ended_and_retried() {
    let env = VmEnv::new();
    let impatient = VmDriver::open(
        env.state.path().to_path_buf(),
        VmDriverOptions {
            boot_timeout: std::time::Duration::from_millis(500),
            ..vm_support::options()
        },
    )
    .await
    .unwrap();
    let id = uuid::Uuid::new_v4();
    let create = pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: "w".into(),
        name: "slow".into(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }),
        generation: 3,
        stopped: false,
    };
    let err = impatient.create(create.clone()).await.unwrap_err();
    assert!(
        matches!(err, DriverError::Unavailable(ref m) if m.contains("did not boot within")),
        "{err}"
    );
    assert_eq!(impatient.vm_identity(id), None);
    env.assert_no_vm_left();
    let got = impatient
        .get(pb::GetRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap();
    assert_eq!(
        (got.state, got.reason.as_str()),
        (pb::State::Stopped as i32, "NotStarted")
    );
    drop(impatient);

    let driver = env.open().await;
    let created = driver.create(create).await.unwrap();
    assert_eq!(
        (created.state, created.generation),
        (pb::State::Running as i32, 3)
    );
    driver
        .delete(pb::DeleteRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap();
    env.assert_no_vm_left();
}

/// A caller that gives up on a create mid-boot (its deadline passed) does not cut the create
/// short: the boot completes and is recorded, and the caller's retry finds that VM instead of
/// booting a second one on the same disk. (The dangerous moment — QEMU launched, not yet
/// recorded — lasts milliseconds, too short to hit on purpose here; the driver runs every
/// lifecycle call as its own task so that no moment is dangerous. This checks the outcome.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_a_create_given_up_by_its_caller_boots_once() {
    let env = VmEnv::new();
    let driver = env.open().await;
    let id = uuid::Uuid::new_v4();
    let create = pb::CreateRequest {
        run_env: Default::default(),
        sandbox_id: id.to_string(),
        workspace: "w".into(),
        name: "once".into(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }),
        generation: 5,
        stopped: false,
    };
    let gave_up = tokio::time::timeout(
        std::time::Duration::from_millis(800),
        driver.create(create.clone()),
    )
    .await;
    assert!(
        gave_up.is_err(),
        "a boot takes longer than 800 ms: {gave_up:?}"
    );
    let retried = driver.create(create).await.unwrap();
    assert_eq!(
        (retried.state, retried.generation),
        (pb::State::Running as i32, 5)
    );
    let qemus: Vec<String> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.contains("qemu-system") && cmdline.contains(&id.to_string()))
                .then(|| e.file_name().to_string_lossy().into_owned())
        })
        .collect();
    assert_eq!(qemus.len(), 1, "one QEMU for the sandbox: {qemus:?}");
    assert_eq!(
        driver.vm_identity(id).map(|i| i.pid.to_string()),
        qemus.first().cloned()
    );
    driver
        .delete(pb::DeleteRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap();
    env.assert_no_vm_left();
}

/// A command that takes more memory than its VM has is killed by the guest's kernel, and the
/// sandbox says so: Exited, reason OOMKilled, exit 137 — not a plain SIGKILL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_a_command_past_its_memory_is_oom_killed() {
    let env = VmEnv::new();
    let driver = env.open().await;
    let id = uuid::Uuid::new_v4().to_string();
    driver
        .create(pb::CreateRequest {
            sandbox_id: id.clone(),
            workspace: "team-a".into(),
            name: "hungry".into(),
            spec: Some(pb::SandboxSpec {
                // A string that doubles until the kernel ends it.
                command: vec![
                    "sh".into(),
                    "-c".into(),
                    "sleep 1; x=0123456789; while :; do x=\"$x$x\"; done".into(),
                ],
                resources: Some(pb::Resources {
                    memory_bytes: 256 << 20,
                    // (the least a guest boots with)
                    ..Default::default()
                }),
                ..Default::default()
            }),
            generation: 1,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| {
            let console = std::fs::read_to_string(
                driver.sandbox_dir(id.parse().unwrap()).join("console.log"),
            )
            .unwrap_or_default();
            panic!("create: {e}; the console: {console}")
        });
    let deadline = Instant::now() + Duration::from_secs(60);
    let snap = loop {
        let snap = driver
            .get(pb::GetRequest {
                sandbox_id: id.clone(),
            })
            .await
            .expect("get");
        if snap.state == pb::State::Exited as i32 || Instant::now() > deadline {
            break snap;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(snap.state, pb::State::Exited as i32, "{snap:?}");
    assert_eq!(
        (snap.reason.as_str(), snap.exit_code),
        ("OOMKilled", 137),
        "{snap:?}"
    );
    driver
        .delete(pb::DeleteRequest { sandbox_id: id })
        .await
        .expect("delete");
    env.assert_no_vm_left();
}

/// A copy into a stopped VM boots a helper guest that holds the sandbox's lock: a caller that
/// then sends nothing has the copy ended after the driver's idle limit (here 3 s), and the
/// sandbox starts at once after — the lock and the disks are let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_a_quiet_copy_into_a_stopped_sandbox_is_ended_and_lets_go_of_it() {
    let env = VmEnv::new();
    let driver = env
        .open_with(VmDriverOptions {
            copy_idle_limit: Duration::from_secs(3),
            ..vm_support::options()
        })
        .await;
    let id = uuid::Uuid::new_v4().to_string();
    driver
        .create(pb::CreateRequest {
            sandbox_id: id.clone(),
            workspace: "team-a".into(),
            name: "quiet".into(),
            spec: Some(pb::SandboxSpec {
                command: vec!["sleep".into(), "3600".into()],
                ..Default::default()
            }),
            generation: 1,
            stopped: true,
            ..Default::default()
        })
        .await
        .expect("create stopped");
    let began = Instant::now();
    let quiet: sbx_driver_api::ByteStream = Box::pin(futures::stream::pending());
    let copied = tokio::time::timeout(
        Duration::from_secs(120),
        driver.copy_to(
            pb::CopyToStart {
                sandbox_id: id.clone(),
                path: "/sandbox".into(),
            },
            quiet,
        ),
    )
    .await
    .expect("the quiet copy ends by itself");
    eprintln!(
        "the quiet copy ended after {:?}: {copied:?}",
        began.elapsed()
    );
    assert!(
        matches!(&copied, Err(sbx_driver_api::DriverError::Unavailable(m)) if m.contains("moved no data for 3s")),
        "{copied:?}"
    );
    let started = tokio::time::timeout(
        Duration::from_secs(120),
        driver.start(pb::StartRequest {
            sandbox_id: id.clone(),
            generation: 2,
            ..Default::default()
        }),
    )
    .await
    .expect("the start is not held by the copy")
    .expect("start");
    assert_eq!(started.state, pb::State::Running as i32, "{started:?}");
    driver
        .delete(pb::DeleteRequest { sandbox_id: id })
        .await
        .expect("delete");
    env.assert_no_vm_left();
}

/// A stream of `chunks` stdin messages of 64 KiB each (made as they are sent).
fn stdin_of(chunks: usize) -> sbx_driver_api::ExecInputStream {
    Box::pin(futures::stream::iter((0..chunks).map(|_| pb::ExecInput {
        input: Some(pb::exec_input::Input::Stdin(vec![b'x'; 64 * 1024])),
    })))
}

/// An exec's exit (or its timeout) can come while the caller's stdin is still going out,
/// in the middle of one of its 64 KiB frames: the exec port is one stream for the VM's life,
/// so the next turn on it must not be read as the rest of that frame. Three commands that
/// exit at once without reading 16 MiB of stdin, each followed by an exec that must answer;
/// then a `cat` that reads a stream of stdin without end until its 2 s timeout, whose end
/// must reach it (the exec's stream ends soon after the timeout) and leave the port serving.
/// (Before: the next exec found no answer within 15 s; the timed-out one ended 10 s late.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_an_exec_that_ends_amid_its_stdin_leaves_the_port_serving() {
    let env = VmEnv::new();
    let driver = env.open().await;
    let id = uuid::Uuid::new_v4().to_string();
    driver
        .create(pb::CreateRequest {
            sandbox_id: id.clone(),
            workspace: "team-a".into(),
            name: "stdin".into(),
            spec: Some(pb::SandboxSpec {
                command: vec!["sleep".into(), "3600".into()],
                ..Default::default()
            }),
            generation: 1,
            ..Default::default()
        })
        .await
        .expect("create");
    let collect = |stream: sbx_driver_api::DriverStream<pb::ExecOutput>| async move {
        let mut exit = None;
        let mut out = Vec::new();
        let mut stream = stream;
        while let Some(item) = stream.next().await {
            match item.expect("exec output").chunk {
                Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
                Some(pb::exec_output::Chunk::Exit(e)) => exit = Some((e.code, e.timed_out)),
                _ => {}
            }
        }
        (exit, String::from_utf8_lossy(&out).into_owned())
    };
    let request = |script: &str, timeout_seconds: u32| pb::ExecRequest {
        sandbox_id: id.clone(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        stdin: true,
        timeout_seconds,
        ..Default::default()
    };
    for round in 0..3 {
        let stream = driver
            .exec_io(request("exit 3", 30), stdin_of(256))
            .await
            .expect("exec");
        assert_eq!(collect(stream).await.0, Some((3, false)), "round {round}");
        let stream = tokio::time::timeout(
            Duration::from_secs(60),
            driver.exec_io(request("echo still serving", 30), stdin_of(0)),
        )
        .await
        .expect("an answer within 60 s")
        .unwrap_or_else(|e| panic!("round {round}: the exec after: {e}"));
        assert_eq!(
            collect(stream).await,
            (Some((0, false)), "still serving\n".to_string()),
            "round {round}"
        );
    }

    let began = Instant::now();
    let stream = driver
        .exec_io(request("cat > /dev/null", 2), stdin_of(usize::MAX))
        .await
        .expect("exec");
    let (exit, _) = collect(stream).await;
    let took = began.elapsed();
    assert_eq!(exit, Some((124, true)));
    assert!(
        took < Duration::from_secs(8),
        "the timed-out exec's stream ended {took:?} after its start (timeout 2 s)"
    );
    let stream = driver
        .exec_io(request("echo still serving", 30), stdin_of(0))
        .await
        .expect("the exec after the timeout");
    assert_eq!(
        collect(stream).await,
        (Some((0, false)), "still serving\n".to_string())
    );

    driver
        .delete(pb::DeleteRequest { sandbox_id: id })
        .await
        .expect("delete");
    env.assert_no_vm_left();
}
