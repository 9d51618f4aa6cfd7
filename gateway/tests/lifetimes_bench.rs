//! What lifetimes cost and how exact they are, through sbxd on the sim driver (the driver
//! takes no time, so what is measured is the gateway's own):
//! - deadline accuracy: 100 sandboxes with a 3 s ttl that stops them, each one's stop seen on
//!   the watch stream against the deadline its create answered (`expires_at`): p50 and max of
//!   the difference, and that none fired early;
//! - the cost of armed timers: two sbxd side by side, each with `SBX_TIMERS` sandboxes
//!   (default 10,000), one giving each a ttl of an hour (a timer armed per sandbox), the
//!   other none; then each one's resident memory and its CPU over 30 idle seconds.
//!
//! Ignored; run with `cargo test -p sbx-gateway --test lifetimes_bench -- --ignored
//! --nocapture --test-threads 1`.

mod common;

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime};

use common::{DataDir, Sbxd, rss_kib};
use futures::StreamExt;
use sbx_proto::v1::{
    CreateSandboxRequest, EventType, Lifetime, LifetimeAction, Phase, SandboxSpec,
    WatchSandboxesRequest,
};

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn spec(lifetime: Option<Lifetime>) -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "1000".into()],
        lifetime,
        ..Default::default()
    }
}

/// CPU time (user + system) of process `pid` so far, from /proc/PID/stat, in seconds.
fn cpu_seconds(pid: i32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .unwrap()
        .unwrap_or(100) as f64;
    ticks as f64 / hz
}

/// Every sandbox of `d`, page by page.
async fn every_sandbox(d: &Sbxd) -> Vec<sbx_proto::v1::Sandbox> {
    let mut client = d.sandboxes().await;
    let (mut all, mut token) = (Vec::new(), String::new());
    for _ in 0..1000 {
        let page = client
            .list_sandboxes(sbx_proto::v1::ListSandboxesRequest {
                all_workspaces: true,
                page_size: 1000,
                page_token: token,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        all.extend(page.sandboxes);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    all
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with -- --ignored --nocapture"]
async fn deadline_accuracy_over_a_hundred_sandboxes() {
    let n = env_or("SBX_DEADLINES", 100);
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &[]);
    let mut sb = d.sandboxes().await;
    let mut watch = sb
        .watch_sandboxes(WatchSandboxesRequest::default())
        .await
        .unwrap()
        .into_inner();
    let ttl = Lifetime {
        ttl_seconds: 3,
        on_ttl: LifetimeAction::Stop as i32,
        ..Default::default()
    };
    let created: Vec<(String, SystemTime)> = futures::stream::iter(0..n)
        .map(|i| {
            let mut sb = sb.clone();
            async move {
                let s = sb
                    .create_sandbox(CreateSandboxRequest {
                        name: format!("d{i}"),
                        spec: Some(spec(Some(ttl))),
                        ..Default::default()
                    })
                    .await
                    .unwrap()
                    .into_inner();
                let at = SystemTime::try_from(s.expires_at.unwrap()).unwrap();
                (s.id, at)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let deadlines: HashMap<String, SystemTime> = created.into_iter().collect();
    let mut seen: HashMap<String, SystemTime> = HashMap::new();
    let until = Instant::now() + Duration::from_secs(60);
    while seen.len() < n && Instant::now() < until {
        let Ok(Some(Ok(event))) = tokio::time::timeout(Duration::from_secs(5), watch.next()).await
        else {
            break;
        };
        let modified = event.r#type() == EventType::Modified;
        let Some(s) = event.sandbox else { continue };
        let fired = modified
            && matches!(s.phase(), Phase::Stopping | Phase::Stopped)
            && s.reason == "TtlExpired";
        if fired && deadlines.contains_key(&s.id) {
            seen.entry(s.id).or_insert_with(SystemTime::now);
        }
    }
    assert_eq!(seen.len(), n, "every ttl fired");
    let mut late: Vec<f64> = Vec::new();
    for (id, at) in &seen {
        let deadline = deadlines[id];
        match at.duration_since(deadline) {
            Ok(d) => late.push(d.as_secs_f64() * 1000.0),
            Err(early) => panic!("{id} fired {:?} before its deadline", early.duration()),
        }
    }
    late.sort_by(f64::total_cmp);
    println!(
        "deadline accuracy over {n} sandboxes (ttl 3 s, stop; seen on the watch stream): fire \
         minus deadline p50 {:.1} ms, p90 {:.1} ms, max {:.1} ms, min {:.1} ms",
        percentile(&late, 0.5),
        percentile(&late, 0.9),
        late[late.len() - 1],
        late[0]
    );
    d.assert_healthy().await;
    drop(sb);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with -- --ignored --nocapture"]
async fn what_ten_thousand_armed_timers_cost() {
    let n = env_or("SBX_TIMERS", 10_000);
    let timed_data = DataDir::new();
    let timed = Sbxd::start(timed_data.path(), "sim", &[]);
    let bare_data = DataDir::new();
    let bare = Sbxd::start(bare_data.path(), "sim", &[]);
    let hour = Lifetime {
        ttl_seconds: 3600,
        on_ttl: LifetimeAction::Delete as i32,
        ..Default::default()
    };
    async fn create(d: &Sbxd, from: usize, to: usize, lifetime: Option<Lifetime>) -> Duration {
        let client = d.sandboxes().await;
        let began = Instant::now();
        futures::stream::iter(from..to)
            .map(|i| {
                let mut client = client.clone();
                async move {
                    client
                        .create_sandbox(CreateSandboxRequest {
                            name: format!("t{i}"),
                            spec: Some(spec(lifetime)),
                            ..Default::default()
                        })
                        .await
                        .unwrap();
                }
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        began.elapsed()
    }
    // The same creates on both, in rounds of 500, alternating which goes first.
    let (mut took_timed, mut took_bare) = (Duration::ZERO, Duration::ZERO);
    for (round, from) in (0..n).step_by(500).enumerate() {
        let to = (from + 500).min(n);
        if round % 2 == 0 {
            took_timed += create(&timed, from, to, Some(hour)).await;
            took_bare += create(&bare, from, to, None).await;
        } else {
            took_bare += create(&bare, from, to, None).await;
            took_timed += create(&timed, from, to, Some(hour)).await;
        }
    }
    println!(
        "creating {n} sandboxes, 16 at a time: {took_timed:?} with a ttl, {took_bare:?} without \
         (ratio {:.3})",
        took_timed.as_secs_f64() / took_bare.as_secs_f64()
    );
    // Every sandbox Ready (its actor settled, its timer armed), then a quiet minute's half.
    for d in [&timed, &bare] {
        let began = Instant::now();
        loop {
            let all = every_sandbox(d).await;
            let ready = all.iter().filter(|s| s.phase() == Phase::Ready).count();
            if ready == n || began.elapsed() > Duration::from_secs(300) {
                assert_eq!(ready, n, "all Ready");
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }
    let armed = every_sandbox(&timed)
        .await
        .iter()
        .filter(|s| s.next.as_ref().is_some_and(|x| x.reason == "TtlExpired"))
        .count();
    assert_eq!(armed, n, "every sandbox of the first has its deadline next");
    tokio::time::sleep(Duration::from_secs(5)).await;
    let window = Duration::from_secs(30);
    let (timed_cpu, bare_cpu) = (cpu_seconds(timed.pid()), cpu_seconds(bare.pid()));
    tokio::time::sleep(window).await;
    let timed_cpu = cpu_seconds(timed.pid()) - timed_cpu;
    let bare_cpu = cpu_seconds(bare.pid()) - bare_cpu;
    let (timed_rss, bare_rss) = (rss_kib(timed.pid()), rss_kib(bare.pid()));
    println!(
        "{n} sandboxes, Ready and idle: resident memory {timed_rss} KiB with a timer each, \
         {bare_rss} KiB without ({:+.1} KiB, {:.0} bytes per timer); CPU over {window:?}: \
         {timed_cpu:.2} s with, {bare_cpu:.2} s without ({:.2}% and {:.2}% of a core)",
        timed_rss as f64 - bare_rss as f64,
        (timed_rss as f64 - bare_rss as f64) * 1024.0 / n as f64,
        timed_cpu / window.as_secs_f64() * 100.0,
        bare_cpu / window.as_secs_f64() * 100.0,
    );
}
