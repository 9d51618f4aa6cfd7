//! Lifetimes on the vm driver, end to end through sbxd: a ttl that pauses saves the VM (its
//! QEMU ends, its memory is on disk), an exec into it resumes it first and runs, and the
//! guest's processes go on where they were (same pid, a counter that continues, files kept);
//! then a pause and a resume through the API do the same. Prints the times.
//!
//! Needs what `vm_e2e.rs` needs (QEMU, a kernel, a static busybox).

mod common;
mod vm_support;

use std::time::{Duration, Instant};

use common::{DataDir, unique};
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, Lifetime, LifetimeAction, PauseSandboxRequest,
    Phase, ResumeSandboxRequest, SandboxSpec, SetSandboxTtlRequest,
};
use vm_support::{
    QemuReaper, READY_LIMIT, by_id, get, is_alive, qemu_of, sh, start_sbxd, wait_for,
};

/// The workload: its pid and a counter that ticks every 100 ms, kept in the guest's /tmp (its
/// memory: gone if the VM were rebooted, not paused), and a file on /sandbox.
const COUNTER: &str = "echo $$ > /tmp/pid; echo kept > /sandbox/file; i=0; \
     while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; sleep 0.1; done";

/// (pid, count) as the guest says.
async fn look(
    sb: &sbx_proto::v1::sandbox_service_client::SandboxServiceClient<tonic::transport::Channel>,
    id: &str,
) -> (u32, u64) {
    let (code, out, err) = sh(sb, id, "cat /tmp/pid /tmp/count").await;
    assert_eq!(code, 0, "stderr {err:?}");
    let mut lines = out.lines();
    let pid = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .expect("a pid");
    let count = lines
        .next()
        .and_then(|l| l.trim().parse().ok())
        .expect("a count");
    (pid, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_paused_by_its_ttl_resumes_for_an_exec_with_its_processes() {
    vm_support::require_vm_tools();
    let data = DataDir::new();
    let _reaper = QemuReaper(data.path().to_path_buf());
    let data = data.path();
    let d = start_sbxd(data, "vm");
    let mut sb = d.sandboxes().await;
    let workspace = format!("vm-life-{}", unique());
    d.workspaces()
        .await
        .create_workspace(CreateWorkspaceRequest {
            name: workspace.clone(),
            ..Default::default()
        })
        .await
        .unwrap();
    let created = sb
        .create_sandbox(CreateSandboxRequest {
            workspace: workspace.clone(),
            name: "counter".into(),
            spec: Some(SandboxSpec {
                command: vec!["sh".into(), "-c".into(), COUNTER.into()],
                lifetime: Some(Lifetime {
                    ttl_seconds: 3600,
                    on_ttl: LifetimeAction::Pause as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let id = created.id.clone();
    wait_for(&d, &sb, &id, Phase::Ready, READY_LIMIT, |_| true).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (pid, before) = look(&sb, &id).await;
    let qemu = qemu_of(data, &id).expect("the VM's QEMU runs");

    // The ttl, moved to 2 s from now, pauses it: its QEMU ends.
    sb.set_sandbox_ttl(SetSandboxTtlRequest {
        sandbox: by_id(&id),
        ttl_seconds: 2,
    })
    .await
    .unwrap();
    let paused = wait_for(&d, &sb, &id, Phase::Paused, Duration::from_secs(60), |_| {
        true
    })
    .await;
    assert_eq!(paused.reason, "TtlExpired", "{paused:?}");
    assert!(!is_alive(qemu), "the paused VM's QEMU is gone");
    assert!(qemu_of(data, &id).is_none());
    let paused_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;

    // An exec resumes it first (its ttl paused it), then runs: the same process, counting on
    // from where it was (it did not count while paused), its files there.
    let began = Instant::now();
    let (pid_after, after) = look(&sb, &id).await;
    eprintln!(
        "timing: exec into a VM its ttl paused (resume included): {:?}",
        began.elapsed()
    );
    assert_eq!(pid_after, pid, "the same process");
    assert!(after >= before, "the counter went on: {before} → {after}");
    let paused_for = paused_at.elapsed().as_secs_f64();
    assert!(
        ((after - before) as f64) < (paused_for + 30.0) * 10.0,
        "{before} → {after}"
    );
    let (code, out, _) = sh(&sb, &id, "cat /sandbox/file").await;
    assert_eq!((code, out.trim()), (0, "kept"));
    let back = get(&sb, &id).await;
    assert_eq!(back.phase(), Phase::Ready);
    assert_eq!(back.generation, created.generation, "the same run");
    let qemu = qemu_of(data, &id).expect("a QEMU runs it again");

    // Paused and resumed by calls.
    let began = Instant::now();
    let paused = sb
        .pause_sandbox(PauseSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap()
        .into_inner();
    let pause_took = began.elapsed();
    assert_eq!(
        (paused.phase(), paused.reason.as_str()),
        (Phase::Paused, "Paused")
    );
    assert!(!is_alive(qemu));
    let began = Instant::now();
    let resumed = sb
        .resume_sandbox(ResumeSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .unwrap()
        .into_inner();
    let resume_took = began.elapsed();
    assert_eq!(resumed.phase(), Phase::Ready);
    let ram = resumed
        .spec
        .as_ref()
        .and_then(|s| s.resources)
        .map_or(0, |r| r.memory_bytes >> 20);
    eprintln!(
        "timing: PauseSandbox {pause_took:?}, ResumeSandbox {resume_took:?} (a guest of {ram} \
         MiB, mostly untouched; TCG)"
    );
    let (pid_again, again) = look(&sb, &id).await;
    assert_eq!(pid_again, pid);
    assert!(again >= after, "{after} → {again}");

    // Delete of a paused sandbox removes its saved memory.
    sb.pause_sandbox(PauseSandboxRequest {
        sandbox: by_id(&id),
    })
    .await
    .unwrap();
    let dir = data.join("drivers/vm/vms").join(&id);
    assert!(dir.join("memory").exists(), "the saved memory is on disk");
    sb.delete_sandbox(sbx_proto::v1::DeleteSandboxRequest {
        sandbox: by_id(&id),
    })
    .await
    .unwrap();
    assert!(
        !dir.exists(),
        "delete removed the sandbox's state, saved memory included"
    );
    assert!(vm_support::qemus_under(data).is_empty());
}

/// One HTTP/1.0 GET of `/` through the service listener at `routes` for `host`: its status
/// line ("" when nothing answered within the deadline).
fn routed_get(routes: &str, host: &str) -> String {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(routes) else {
        return String::new();
    };
    conn.set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let _ = conn.write_all(format!("GET / HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes());
    let mut all = Vec::new();
    let _ = conn.read_to_end(&mut all);
    String::from_utf8_lossy(&all)
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}

/// A stranger's request wakes nothing it should not: two VMs serving a page through a service
/// endpoint, both paused by their idle timeout; a routed request (nobody's) to the one made
/// without `wake_on_request` is refused and it stays paused; the one made with it wakes,
/// serves the page, and keeps its ttl's deadline exactly where it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_a_routed_request_wakes_only_what_asked_and_never_moves_its_ttl() {
    use sbx_proto::v1::ExposeServiceRequest;
    use sbx_proto::v1::service_endpoint_service_client::ServiceEndpointServiceClient;
    vm_support::require_vm_tools();
    let data = DataDir::new();
    let _reaper = QemuReaper(data.path().to_path_buf());
    let routes_file = data.path().join("routes");
    let cache = vm_support::asset_cache().display().to_string();
    let d = common::Sbxd::start(
        data.path(),
        "vm",
        &[
            "--vm-asset-cache",
            &cache,
            "--vm-boot-timeout",
            vm_support::BOOT_TIMEOUT_SECS,
            "--service-listen",
            "127.0.0.1:0",
            "--service-addr-file",
            routes_file.to_str().unwrap(),
            // An idle guest under TCG still takes some CPU: idleness here is no use.
            "--idle-cpu",
            "4",
        ],
    );
    let routes = std::fs::read_to_string(&routes_file)
        .unwrap()
        .trim()
        .to_string();
    let mut sb = d.sandboxes().await;
    let serve = "mkdir -p /tmp/www && echo awake > /tmp/www/index.html && \
                 exec httpd -f -p 127.0.0.1:8000 -h /tmp/www";
    let mut ids = Vec::new();
    for (name, wake) in [("asleep", false), ("waker", true)] {
        let made = sb
            .create_sandbox(CreateSandboxRequest {
                name: name.into(),
                spec: Some(SandboxSpec {
                    command: vec!["sh".into(), "-c".into(), serve.into()],
                    lifetime: Some(Lifetime {
                        ttl_seconds: 3600,
                        idle_timeout_seconds: 4,
                        on_idle: LifetimeAction::Pause as i32,
                        wake_on_request: wake,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        ids.push(made.id.clone());
        ServiceEndpointServiceClient::new(d.channel().await)
            .expose_service(ExposeServiceRequest {
                sandbox: by_id(&made.id),
                port: 8000,
                name: name.into(),
            })
            .await
            .unwrap();
    }
    let host = |name: &str| format!("{name}--{name}--default.localhost");
    let mut before = Vec::new();
    for id in &ids {
        let paused = wait_for(&d, &sb, id, Phase::Paused, READY_LIMIT * 2, |s| {
            s.reason == "Idle"
        })
        .await;
        before.push(paused.expires_at);
    }
    // Not asked: refused, and still paused.
    let answer = routed_get(&routes, &host("asleep"));
    assert!(
        !answer.contains(" 200"),
        "a paused sandbox answered: {answer}"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let still = get(&sb, &ids[0]).await;
    assert_eq!(
        still.phase(),
        Phase::Paused,
        "a stranger's request woke it: {still:?}"
    );
    // Asked: woken, served, its ttl where it was.
    let began = Instant::now();
    let answer = routed_get(&routes, &host("waker"));
    eprintln!(
        "a routed request woke a paused VM and was answered in {:?}",
        began.elapsed()
    );
    assert!(
        answer.contains(" 200"),
        "the woken sandbox did not answer: {answer}\n{}",
        d.log_text()
    );
    let woken = get(&sb, &ids[1]).await;
    assert_eq!(woken.phase(), Phase::Ready);
    assert_eq!(woken.expires_at, before[1], "a wake moved the ttl");
    for id in &ids {
        sb.delete_sandbox(sbx_proto::v1::DeleteSandboxRequest { sandbox: by_id(id) })
            .await
            .unwrap();
    }
}
