//! What the usage history and the events cost a gateway, side by side in one run: three sbxd
//! on the sim driver with the same `SBX_STATS_SANDBOXES` sandboxes (default 1,000), one
//! keeping a sample a second for `SBX_STATS_HISTORY` seconds (default 120) and every event,
//! one keeping the events alone, one keeping neither. Once the history is full: each sbxd's
//! resident memory, the kept samples and their bytes as sbxd counts them
//! (`sbx_stats_history_*`), the events in the store and the store's size on disk; and the time
//! of the same creates on the first and the last. Ignored; run with
//! `cargo test -p sbx-gateway --test stats_bench -- --ignored --nocapture`.

mod common;

use std::time::Duration;

use common::metrics::{scrape, start_with_metrics, value};
use common::{DataDir, Sbxd, rss_kib};
use futures::StreamExt;
use sbx_proto::v1::{CreateSandboxRequest, ListEventsRequest, SandboxSpec};

fn du_kib(path: &std::path::Path) -> u64 {
    let out = std::process::Command::new("du")
        .args(["-sk"])
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run with --release -- --ignored --nocapture"]
async fn what_the_usage_history_and_the_events_cost_per_thousand_sandboxes() {
    let many = env_or("SBX_STATS_SANDBOXES", 1000);
    let history = env_or("SBX_STATS_HISTORY", 120);
    let keeping_data = DataDir::new();
    let history_arg = format!("{history}s");
    let (keeping, addr) = start_with_metrics(
        keeping_data.path(),
        "sim",
        &[
            "--log-format",
            "json",
            "--stats-interval",
            "1s",
            "--stats-history",
            &history_arg,
        ],
    );
    let events_data = DataDir::new();
    let events_only = Sbxd::start(
        events_data.path(),
        "sim",
        &["--log-format", "json", "--stats-interval", "0"],
    );
    let bare_data = DataDir::new();
    let bare = Sbxd::start(
        bare_data.path(),
        "sim",
        &[
            "--log-format",
            "json",
            "--stats-interval",
            "0",
            "--events-per-sandbox",
            "0",
        ],
    );
    // The same creates on both (each timed to its answer), in rounds of 100, alternating
    // which goes first; each one's time is summed.
    async fn create_round(d: &Sbxd, from: usize, to: usize) -> Duration {
        let client = d.sandboxes().await;
        let began = std::time::Instant::now();
        futures::stream::iter(from..to)
            .map(|i| {
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
            })
            .buffer_unordered(16)
            .collect::<Vec<_>>()
            .await;
        began.elapsed()
    }
    let (mut took_keeping, mut took_bare) = (Duration::ZERO, Duration::ZERO);
    for (round, from) in (0..many).step_by(100).enumerate() {
        let to = (from + 100).min(many);
        if round % 2 == 0 {
            took_keeping += create_round(&keeping, from, to).await;
            took_bare += create_round(&bare, from, to).await;
        } else {
            took_bare += create_round(&bare, from, to).await;
            took_keeping += create_round(&keeping, from, to).await;
        }
        create_round(&events_only, from, to).await;
    }
    println!(
        "creating {many} sandboxes, 16 at a time: {took_keeping:?} keeping events and \
         samples, {took_bare:?} keeping neither (ratio {:.3})",
        took_keeping.as_secs_f64() / took_bare.as_secs_f64()
    );
    // Until every sandbox has a full history (bounded: the history and a minute more).
    let full = (many * history) as f64;
    let began = std::time::Instant::now();
    loop {
        let samples = value(&scrape(&addr).await, "sbx_stats_history_samples", &[]);
        if samples >= full || began.elapsed() > Duration::from_secs(history as u64 + 60) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let scraped = scrape(&addr).await;
    let samples = value(&scraped, "sbx_stats_history_samples", &[]);
    let bytes = value(&scraped, "sbx_stats_history_bytes", &[]);
    let events = keeping
        .sandboxes()
        .await
        .list_events(ListEventsRequest {
            all_workspaces: true,
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let (rss_keeping, rss_events, rss_bare) = (
        rss_kib(keeping.pid()),
        rss_kib(events_only.pid()),
        rss_kib(bare.pid()),
    );
    let (store_keeping, store_bare) = (
        du_kib(&keeping_data.path().join("store")),
        du_kib(&bare_data.path().join("store")),
    );
    println!(
        "{many} sandboxes (sim driver), a sample a second for {history} s: {samples} samples \
         kept, {bytes} bytes as sbxd counts them ({:.1} bytes a sample; {:.1} KiB a sandbox \
         at the default 720); resident memory {rss_keeping} KiB keeping them and the events, \
         {rss_events} KiB keeping the events alone, {rss_bare} KiB keeping neither ({:+} KiB, \
         {:.1} KiB per 1,000 sandboxes, for both); {} events \
         in the first page (2 a sandbox: Created, Started); store on disk {store_keeping} KiB \
         with them, {store_bare} KiB without",
        bytes / samples.max(1.0),
        bytes / samples.max(1.0) * 720.0 / 1024.0,
        rss_keeping as i64 - rss_bare as i64,
        (rss_keeping as f64 - rss_bare as f64) * 1000.0 / many as f64,
        events.events.len(),
    );
    assert!(
        samples >= full * 0.9,
        "the history filled: {samples} of {full}"
    );
}
