//! Lifetimes end to end, through sbxd: a ttl deletes on time, moves when asked, and survives a
//! SIGKILL of sbxd without being lost or fired twice; idleness stops only what is idle (an open
//! `exec -i` and a CPU-bound workload are busy); pause and resume through the API, and a use of
//! a sandbox its ttl paused resumes it first; bad lifetimes are refused at create.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use common::{DataDir, Sbxd, eventually};
use futures::StreamExt;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, ExecInput, ExecRequest, GetSandboxRequest,
    Lifetime, LifetimeAction, ListEventsRequest, PauseSandboxRequest, Phase, ResumeSandboxRequest,
    Sandbox, SandboxRef, SandboxSpec, SetSandboxTtlRequest, exec_input, exec_output,
};
use tonic::transport::Channel;

const WS: &str = "lives";

fn by_id(id: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        id: id.into(),
        ..Default::default()
    })
}

async fn workspace(d: &Sbxd) {
    d.workspaces()
        .await
        .create_workspace(CreateWorkspaceRequest {
            name: WS.into(),
            labels: HashMap::new(),
        })
        .await
        .unwrap();
}

async fn create(
    sb: &mut SandboxServiceClient<Channel>,
    name: &str,
    command: &[&str],
    lifetime: Lifetime,
) -> Result<Sandbox, tonic::Status> {
    sb.create_sandbox(CreateSandboxRequest {
        workspace: WS.into(),
        name: name.into(),
        spec: Some(SandboxSpec {
            command: command.iter().map(|s| s.to_string()).collect(),
            lifetime: Some(lifetime),
            ..Default::default()
        }),
        ..Default::default()
    })
    .await
    .map(|r| r.into_inner())
}

async fn get(sb: &SandboxServiceClient<Channel>, id: &str) -> Result<Sandbox, tonic::Status> {
    sb.clone()
        .get_sandbox(GetSandboxRequest { sandbox: by_id(id) })
        .await
        .map(|r| r.into_inner())
}

async fn phase_is(sb: &SandboxServiceClient<Channel>, id: &str, phase: Phase) -> Sandbox {
    eventually(
        Duration::from_secs(60),
        &format!("{id} {phase:?}"),
        || async { get(sb, id).await.ok().filter(|s| s.phase() == phase) },
    )
    .await
}

fn ttl(secs: u64, on: LifetimeAction) -> Lifetime {
    Lifetime {
        ttl_seconds: secs,
        on_ttl: on as i32,
        ..Default::default()
    }
}

fn secs_since(t: SystemTime) -> f64 {
    SystemTime::now()
        .duration_since(t)
        .unwrap_or_default()
        .as_secs_f64()
}

fn created(s: &Sandbox) -> SystemTime {
    SystemTime::try_from(s.created_at.unwrap()).unwrap()
}

/// Polls until sandbox `id` is gone (NOT_FOUND), every 25 ms for at most `limit`; answers when
/// it was first seen gone.
async fn gone_at(sb: &SandboxServiceClient<Channel>, id: &str, limit: Duration) -> SystemTime {
    let began = Instant::now();
    while began.elapsed() < limit {
        match get(sb, id).await {
            Err(s) if s.code() == tonic::Code::NotFound => return SystemTime::now(),
            _ => tokio::time::sleep(Duration::from_millis(25)).await,
        }
    }
    panic!("sandbox {id} still there after {limit:?}");
}

async fn reasons(sb: &SandboxServiceClient<Channel>, id: &str) -> Vec<String> {
    sb.clone()
        .list_events(ListEventsRequest {
            sandbox: by_id(id),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .events
        .into_iter()
        .map(|e| e.reason)
        .collect()
}

/// The sandbox's event reasons once `done` holds of them, or after 5 s: an event is written
/// by a task of its own (a lifecycle step never waits on it), so it may land just after the
/// phase it tells is seen.
async fn reasons_once(
    sb: &SandboxServiceClient<Channel>,
    id: &str,
    done: impl Fn(&[String]) -> bool,
) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let told = reasons(sb, id).await;
        if done(&told) || Instant::now() >= deadline {
            return told;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn exec_out(sb: &SandboxServiceClient<Channel>, id: &str, cmd: &[&str]) -> String {
    let mut stream = sb
        .clone()
        .exec(
            ExecRequest {
                sandbox: by_id(id),
                command: cmd.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            }
            .alone(),
        )
        .await
        .unwrap()
        .into_inner();
    let mut out = Vec::new();
    let mut code = None;
    while let Some(msg) = tokio::time::timeout(Duration::from_secs(30), stream.next())
        .await
        .expect("exec timed out")
    {
        match msg.unwrap().chunk {
            Some(exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(exec_output::Chunk::Exit(e)) => code = Some(e.code),
            _ => {}
        }
    }
    assert_eq!(code, Some(0), "{cmd:?}");
    String::from_utf8(out).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ttl_deletes_on_time_moves_when_asked_and_survives_sigkill_firing_once() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "process", &[]);
    workspace(&d).await;
    let mut sb = d.sandboxes().await;
    let sleep = ["sleep", "1000"];

    // A ttl of 3 s that deletes: never before 3 s, gone within 4.
    let a = create(&mut sb, "a", &sleep, ttl(3, LifetimeAction::Delete))
        .await
        .unwrap();
    assert!(a.expires_at.is_some(), "the deadline is in the record");
    let a = phase_is(&sb, &a.id, Phase::Ready).await;
    let next = a.next.clone().expect("get says what happens next");
    assert_eq!(
        (next.action.as_str(), next.reason.as_str()),
        ("delete", "TtlExpired")
    );
    let gone = gone_at(&sb, &a.id, Duration::from_secs(10)).await;
    let after = gone.duration_since(created(&a)).unwrap().as_secs_f64();
    assert!(
        (3.0..4.0).contains(&after),
        "deleted {after:.3} s after creation"
    );

    // A ttl moved by the ttl call: from now.
    let b = create(&mut sb, "b", &sleep, ttl(3, LifetimeAction::Delete))
        .await
        .unwrap();
    phase_is(&sb, &b.id, Phase::Ready).await;
    let moved_at = SystemTime::now();
    let moved = sb
        .set_sandbox_ttl(SetSandboxTtlRequest {
            sandbox: by_id(&b.id),
            ttl_seconds: 5,
        })
        .await
        .unwrap()
        .into_inner();
    let expires = SystemTime::try_from(moved.expires_at.unwrap()).unwrap();
    let ahead = expires.duration_since(moved_at).unwrap().as_secs_f64();
    assert!(
        (4.9..5.5).contains(&ahead),
        "the new deadline is {ahead:.3} s ahead"
    );
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        get(&sb, &b.id).await.unwrap().phase(),
        Phase::Ready,
        "extended"
    );
    let gone = gone_at(&sb, &b.id, Duration::from_secs(10)).await;
    let after = gone.duration_since(moved_at).unwrap().as_secs_f64();
    assert!(
        (5.0..6.0).contains(&after),
        "deleted {after:.3} s after the ttl call"
    );

    // SIGKILL during the wait: a ttl that stops is kept, fires once after the restart, at
    // its time; one whose deadline passed while sbxd was down fires at start.
    let c = create(&mut sb, "c", &sleep, ttl(5, LifetimeAction::Stop))
        .await
        .unwrap();
    let e = create(&mut sb, "e", &sleep, ttl(2, LifetimeAction::Delete))
        .await
        .unwrap();
    phase_is(&sb, &c.id, Phase::Ready).await;
    phase_is(&sb, &e.id, Phase::Ready).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    d.sigkill();
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(
        secs_since(created(&e)) > 2.0,
        "e's deadline passed while sbxd was down"
    );
    d = Sbxd::start(data.path(), "process", &[]);
    sb = d.sandboxes().await;
    gone_at(&sb, &e.id, Duration::from_secs(10)).await;
    let stopped = phase_is(&sb, &c.id, Phase::Stopped).await;
    let after = secs_since(created(&c));
    assert!(
        (5.0..7.0).contains(&after),
        "c stopped {after:.3} s after creation"
    );
    assert_eq!(stopped.reason, "TtlExpired", "{stopped:?}");
    assert!(stopped.expires_at.is_none(), "a ttl that fired is cleared");
    assert!(stopped.next.is_none(), "{:?}", stopped.next);
    // Once, and still once after another SIGKILL and restart. Events are written by tasks
    // of their own, a moment after the change they tell of: read until it is there (5 s).
    let told = |r: &Vec<String>| r.iter().filter(|r| *r == "TtlExpired").count();
    let deadline = Instant::now() + Duration::from_secs(5);
    while told(&reasons(&sb, &c.id).await) == 0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(told(&reasons(&sb, &c.id).await), 1);
    d.sigkill();
    d = Sbxd::start(data.path(), "process", &[]);
    sb = d.sandboxes().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let again = get(&sb, &c.id).await.unwrap();
    assert_eq!(
        (again.phase(), again.reason.as_str()),
        (Phase::Stopped, "TtlExpired")
    );
    assert_eq!(told(&reasons(&sb, &c.id).await), 1, "fired once");
    d.assert_healthy().await;
}

/// An exec whose stdin stays open (`exec -i cat`) for as long as the returned sender lives.
async fn open_exec(
    sb: &SandboxServiceClient<Channel>,
    id: &str,
) -> (
    tokio::sync::mpsc::Sender<ExecInput>,
    tonic::Streaming<sbx_proto::v1::ExecOutput>,
) {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(ExecInput {
        input: Some(exec_input::Input::Start(ExecRequest {
            sandbox: by_id(id),
            command: vec!["cat".into()],
            stdin: true,
            ..Default::default()
        })),
    })
    .await
    .unwrap();
    let out = sb
        .clone()
        .exec(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    (tx, out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idleness_stops_only_what_is_idle() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &[]);
    workspace(&d).await;
    let mut sb = d.sandboxes().await;
    let idle = Lifetime {
        idle_timeout_seconds: 3,
        ..Default::default()
    };
    let quiet = create(&mut sb, "quiet", &["sleep", "1000"], idle)
        .await
        .unwrap();
    let typing = create(&mut sb, "typing", &["sleep", "1000"], idle)
        .await
        .unwrap();
    let busy = create(&mut sb, "busy", &["sh", "-c", "while :; do :; done"], idle)
        .await
        .unwrap();
    let quiet = phase_is(&sb, &quiet.id, Phase::Ready).await;
    let ready_at = SystemTime::now();
    phase_is(&sb, &typing.id, Phase::Ready).await;
    phase_is(&sb, &busy.id, Phase::Ready).await;
    let (stdin, _out) = open_exec(&sb, &typing.id).await;

    let stopped = phase_is(&sb, &quiet.id, Phase::Stopped).await;
    let after = secs_since(ready_at);
    assert!(
        after < 5.0,
        "the untouched one stopped {after:.3} s after Ready"
    );
    assert_eq!(stopped.reason, "Idle", "{stopped:?}");
    assert!(
        stopped.message.contains("idle for 3 s"),
        "{}",
        stopped.message
    );
    let _ = quiet;
    let told = reasons_once(&sb, &stopped.id, |r| r.iter().any(|r| r == "Idle")).await;
    assert!(told.contains(&"Idle".to_string()), "{told:?}");

    tokio::time::sleep(Duration::from_secs(10).saturating_sub(ready_at.elapsed().unwrap())).await;
    for s in [&typing, &busy] {
        let now = get(&sb, &s.id).await.unwrap();
        assert_eq!(now.phase(), Phase::Ready, "{} after 10 s: {now:?}", s.name);
    }
    // The exec ends: the typing one is idle 3 s after it, and stopped.
    drop(stdin);
    let ended = SystemTime::now();
    let stopped = phase_is(&sb, &typing.id, Phase::Stopped).await;
    let after = secs_since(ended);
    assert!(
        (2.5..6.0).contains(&after),
        "stopped {after:.3} s after its exec ended"
    );
    assert_eq!(stopped.reason, "Idle");
    d.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_resume_and_a_use_of_what_a_ttl_paused() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    workspace(&d).await;
    let mut sb = d.sandboxes().await;
    // Paused by a call: a use is refused until resume (auto_resume is off by default then).
    let s = create(&mut sb, "p", &["sleep", "1000"], Lifetime::default())
        .await
        .unwrap();
    phase_is(&sb, &s.id, Phase::Ready).await;
    exec_out(&sb, &s.id, &["write", "/sandbox/f", "kept"]).await;
    for round in 0..5 {
        let paused = sb
            .pause_sandbox(PauseSandboxRequest {
                sandbox: by_id(&s.id),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            (paused.phase(), paused.reason.as_str()),
            (Phase::Paused, "Paused")
        );
        let refused = sb
            .clone()
            .exec(
                ExecRequest {
                    sandbox: by_id(&s.id),
                    command: vec!["cat".into(), "/sandbox/f".into()],
                    ..Default::default()
                }
                .alone(),
            )
            .await
            .unwrap_err();
        assert_eq!(
            refused.code(),
            tonic::Code::FailedPrecondition,
            "{refused:?}"
        );
        assert!(
            refused.message().contains("resume"),
            "{}",
            refused.message()
        );
        let resumed = sb
            .resume_sandbox(ResumeSandboxRequest {
                sandbox: by_id(&s.id),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resumed.phase(), Phase::Ready, "round {round}");
        assert_eq!(
            resumed.generation, s.generation,
            "the same run, round {round}"
        );
        assert_eq!(exec_out(&sb, &s.id, &["cat", "/sandbox/f"]).await, "kept");
    }
    let told = reasons_once(&sb, &s.id, |r| {
        r.iter().filter(|r| *r == "Paused").count() >= 5
            && r.iter().filter(|r| *r == "Resumed").count() >= 5
    })
    .await;
    assert_eq!(
        told.iter().filter(|r| *r == "Paused").count(),
        5,
        "{told:?}"
    );
    assert_eq!(
        told.iter().filter(|r| *r == "Resumed").count(),
        5,
        "{told:?}"
    );

    // Paused by its ttl: an exec resumes it first, then runs.
    let t = create(
        &mut sb,
        "t",
        &["sleep", "1000"],
        ttl(2, LifetimeAction::Pause),
    )
    .await
    .unwrap();
    phase_is(&sb, &t.id, Phase::Ready).await;
    let paused = phase_is(&sb, &t.id, Phase::Paused).await;
    assert_eq!(paused.reason, "TtlExpired");
    assert!(paused.expires_at.is_none());
    assert_eq!(exec_out(&sb, &t.id, &["echo", "back"]).await.trim(), "back");
    let back = get(&sb, &t.id).await.unwrap();
    assert_eq!(back.phase(), Phase::Ready);
    assert!(back.expires_at.is_some(), "a resume arms the ttl again");
    d.assert_healthy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_lifetimes_are_refused_at_create_naming_the_field() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &["--max-ttl", "1d"]);
    workspace(&d).await;
    let mut sb = d.sandboxes().await;
    let cases = [
        (
            ttl(2 * 86_400, LifetimeAction::Delete),
            tonic::Code::InvalidArgument,
            "spec.lifetime.ttl_seconds",
        ),
        (
            Lifetime {
                idle_timeout_seconds: 10,
                on_idle: LifetimeAction::Delete as i32,
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "on_idle",
        ),
        (
            Lifetime {
                ttl_seconds: 10,
                on_ttl: 42,
                ..Default::default()
            },
            tonic::Code::InvalidArgument,
            "on_ttl",
        ),
        // The process driver cannot pause: refused now, not at the deadline.
        (
            ttl(60, LifetimeAction::Pause),
            tonic::Code::FailedPrecondition,
            "spec.lifetime.on_ttl",
        ),
    ];
    for (i, (lifetime, code, field)) in cases.into_iter().enumerate() {
        let err = create(&mut sb, &format!("bad{i}"), &["sleep", "1"], lifetime)
            .await
            .unwrap_err();
        assert_eq!(err.code(), code, "{lifetime:?}: {err:?}");
        assert!(err.message().contains(field), "{field}: {}", err.message());
    }
    let s = create(&mut sb, "ok", &["sleep", "1000"], Lifetime::default())
        .await
        .unwrap();
    phase_is(&sb, &s.id, Phase::Ready).await;
    let err = sb
        .pause_sandbox(PauseSandboxRequest {
            sandbox: by_id(&s.id),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("cannot pause"), "{}", err.message());
    let err = sb
        .set_sandbox_ttl(SetSandboxTtlRequest {
            sandbox: by_id(&s.id),
            ttl_seconds: 3 * 86_400,
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert_eq!(get(&sb, &s.id).await.unwrap().phase(), Phase::Ready);
    d.assert_healthy().await;
}

#[test]
fn the_cli_sets_shows_moves_pauses_and_resumes() {
    use common::sbx;
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let ep = d.endpoint();
    sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "agent",
            "--ttl",
            "30m",
            "--on-ttl",
            "pause",
            "--idle-timeout",
            "5m",
            "--",
            "sleep",
            "infinity",
        ],
    )
    .ok();
    let shown = sbx(&ep, &["sandbox", "get", "agent"]);
    let text = shown.ok();
    assert!(
        text.contains("LIFETIME: ttl 30m (pause), idle 5m (stop)"),
        "{text}"
    );
    assert!(
        text.contains("NEXT: stop at ") && text.contains("(Idle)"),
        "{text}"
    );
    let json = sbx(&ep, &["sandbox", "get", "agent", "-o", "json"]).json();
    assert_eq!(json["lifetime"]["ttl_seconds"], 1800, "{json}");
    assert_eq!(json["next"]["reason"], "Idle", "{json}");

    // The ttl call, by name and by id: the deadline moves to now + the ttl.
    let before = SystemTime::now();
    let moved = sbx(&ep, &["sandbox", "ttl", "agent", "2h", "-o", "json"]).json();
    let id = moved["id"].as_str().unwrap().to_string();
    let expires = moved["expires_at"].as_str().unwrap().to_string();
    assert!(expires.len() > 10, "{moved}");
    let by_id = sbx(&ep, &["sandbox", "ttl", "--id", &id, "0", "-o", "json"]).json();
    assert!(by_id.get("expires_at").is_none(), "0 removes it: {by_id}");
    let _ = before;
    for bad in [
        &["sandbox", "ttl", "agent"][..],
        &["sandbox", "ttl", "agent", "-1h"],
    ] {
        let run = sbx(&ep, bad);
        assert_eq!(run.code, 2, "{run:?}");
    }

    // Pause and resume; a use of what a call paused is refused, saying how to resume.
    let paused = sbx(&ep, &["sandbox", "pause", "agent", "-o", "json"]).json();
    assert_eq!(
        (paused["phase"].as_str(), paused["reason"].as_str()),
        (Some("Paused"), Some("Paused"))
    );
    let refused = sbx(&ep, &["sandbox", "exec", "agent", "--", "echo", "hi"]);
    assert_ne!(refused.code, 0);
    assert!(refused.stderr.contains("sbx sandbox resume"), "{refused:?}");
    let resumed = sbx(&ep, &["sandbox", "resume", "agent", "-o", "json"]).json();
    assert_eq!(resumed["phase"], "Ready", "{resumed}");
    assert_eq!(
        sbx(&ep, &["sandbox", "exec", "agent", "--", "echo", "hi"]).ok(),
        "hi\n"
    );

    // A workspace's default lifetime, copied into a sandbox created without one.
    sbx(
        &ep,
        &[
            "workspace",
            "lifetime",
            "set",
            "default",
            "--ttl",
            "1h",
            "--on-ttl",
            "stop",
        ],
    )
    .ok();
    let shown = sbx(&ep, &["workspace", "lifetime", "get", "default"]);
    assert!(shown.ok().starts_with("ttl 1h (stop)"), "{shown:?}");
    sbx(
        &ep,
        &[
            "sandbox", "create", "plain", "-d", "--", "sleep", "infinity",
        ],
    )
    .ok();
    let plain = sbx(&ep, &["sandbox", "get", "plain", "-o", "json"]).json();
    assert_eq!(plain["lifetime"]["on_ttl"], "stop", "{plain}");
    let run = sbx(&ep, &["workspace", "lifetime", "set", "default"]);
    assert_eq!(run.code, 2, "nothing to set: {run:?}");
    sbx(&ep, &["workspace", "lifetime", "set", "default", "--clear"]).ok();
    assert!(
        sbx(&ep, &["workspace", "lifetime", "get", "default"])
            .ok()
            .starts_with("none")
    );
}
