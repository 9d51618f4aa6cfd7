//! What sandboxes use: reads of a sandbox's driver (`ComputeDriver::stats`, the host's own
//! accounting) made into samples with rates, and the bounded history a gateway keeps of the
//! sandboxes it serves (one read every `interval`, for the last `history`).
//!
//! The history is in memory, per gateway: a gateway restart or a workspace handed to another
//! gateway starts it afresh. A read is never made through a sandbox's actor (its mailbox is
//! for lifecycle commands): usage is a read of the driver by id, like `get`.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use sbx_driver_api::pb;
use sbx_proto::v1::{Phase, SandboxUsageSample};
use sbx_storage::Kind;
use uuid::Uuid;

use crate::config::Shared;
pub use crate::config::StatsSettings;

/// Driver reads made at once by one round of the history's sampler.
const SAMPLE_CONCURRENCY: usize = 16;

/// One read as kept: the counters and figures, without the limits (those of the latest read
/// are the history's). 56 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Kept {
    at_ms: u64,
    cpu_nanos: u64,
    memory: u64,
    disk_used: u64,
    rx: u64,
    tx: u64,
    pids: u32,
    /// OOM kills so far (saturating), in what the other fields leave of the 56 bytes.
    oom_kills: u16,
    flags: u8,
}

const RUNNING: u8 = 1;
const HAS_DISK: u8 = 2;
const HAS_NETWORK: u8 = 4;

impl Kept {
    fn of(at_ms: u64, u: &pb::SandboxUsage) -> Kept {
        let flag = |on: bool, bit: u8| if on { bit } else { 0 };
        Kept {
            at_ms,
            cpu_nanos: u.cpu_nanos,
            memory: u.memory_bytes,
            disk_used: u.disk_used_bytes,
            rx: u.network_rx_bytes,
            tx: u.network_tx_bytes,
            pids: u.pids.min(u64::from(u32::MAX)) as u32,
            oom_kills: u.oom_kills.min(u64::from(u16::MAX)) as u16,
            flags: flag(u.running, RUNNING)
                | flag(u.has_disk, HAS_DISK)
                | flag(u.has_network, HAS_NETWORK),
        }
    }

    /// Back to the driver's message, with the limits of `limits`.
    fn usage(&self, limits: &pb::SandboxUsage) -> pb::SandboxUsage {
        pb::SandboxUsage {
            running: self.flags & RUNNING != 0,
            cpu_nanos: self.cpu_nanos,
            memory_bytes: self.memory,
            pids: u64::from(self.pids),
            has_disk: self.flags & HAS_DISK != 0,
            disk_used_bytes: self.disk_used,
            has_network: self.flags & HAS_NETWORK != 0,
            network_rx_bytes: self.rx,
            network_tx_bytes: self.tx,
            cpu_limit_millis: limits.cpu_limit_millis,
            memory_limit_bytes: limits.memory_limit_bytes,
            pids_limit: limits.pids_limit,
            disk_limit_bytes: limits.disk_limit_bytes,
            oom_kills: u64::from(self.oom_kills),
        }
    }
}

/// A driver's read and when it was made.
#[derive(Debug, Clone, PartialEq)]
pub struct Reading {
    pub at_ms: u64,
    pub usage: pb::SandboxUsage,
}

impl Reading {
    pub fn now(usage: pb::SandboxUsage) -> Reading {
        Reading {
            at_ms: crate::records::now_ms(),
            usage,
        }
    }
}

/// The public sample of `now`, its CPU rate over the time since `before` (0 without one, or
/// when the counter went down: a new run).
pub fn sample(now: &Reading, before: Option<&Reading>) -> SandboxUsageSample {
    let u = &now.usage;
    let cpu_cores = match before {
        Some(b)
            if now.at_ms > b.at_ms
                && u.running
                && b.usage.running
                && u.cpu_nanos >= b.usage.cpu_nanos =>
        {
            (u.cpu_nanos - b.usage.cpu_nanos) as f64 / ((now.at_ms - b.at_ms) as f64 * 1e6)
        }
        _ => 0.0,
    };
    SandboxUsageSample {
        time: Some(crate::records::timestamp(now.at_ms)),
        running: u.running,
        cpu_cores,
        cpu_limit_cores: u.cpu_limit_millis as f64 / 1000.0,
        cpu_seconds_total: u.cpu_nanos as f64 / 1e9,
        memory_bytes: u.memory_bytes,
        memory_limit_bytes: u.memory_limit_bytes,
        pids: u.pids,
        pids_limit: u.pids_limit,
        has_disk: u.has_disk,
        disk_used_bytes: u.disk_used_bytes,
        disk_limit_bytes: u.disk_limit_bytes,
        has_network: u.has_network,
        network_rx_bytes: u.network_rx_bytes,
        network_tx_bytes: u.network_tx_bytes,
        oom_kills: u.oom_kills,
    }
}

/// The samples a gateway keeps, per sandbox, bounded by [`StatsSettings::capacity`].
#[derive(Debug, Default)]
pub struct StatsHistory {
    settings: StatsSettings,
    kept: Mutex<HashMap<Uuid, VecDeque<Kept>>>,
}

impl StatsHistory {
    pub fn new(settings: StatsSettings) -> StatsHistory {
        StatsHistory {
            settings,
            kept: Mutex::default(),
        }
    }

    pub fn settings(&self) -> StatsSettings {
        self.settings
    }

    fn kept(&self) -> std::sync::MutexGuard<'_, HashMap<Uuid, VecDeque<Kept>>> {
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `reading` of sandbox `id`, dropping its oldest beyond the bound.
    pub fn record(&self, id: Uuid, reading: &Reading) {
        let capacity = self.settings.capacity();
        if capacity == 0 {
            return;
        }
        let mut kept = self.kept();
        let ring = kept.entry(id).or_default();
        while ring.len() >= capacity {
            ring.pop_front();
        }
        // Grown in steps that never pass the bound (a doubling would reserve up to twice it).
        if ring.len() == ring.capacity() {
            ring.reserve_exact(ring.len().max(16).min(capacity - ring.len()));
        }
        ring.push_back(Kept::of(reading.at_ms, &reading.usage));
    }

    /// Forgets every sandbox not in `live` (deleted ones).
    pub fn retain(&self, live: &HashSet<Uuid>) {
        self.kept().retain(|id, _| live.contains(id));
    }

    /// The latest kept read of `id`, with `limits`' limits.
    pub fn latest(&self, id: Uuid, limits: &pb::SandboxUsage) -> Option<Reading> {
        let kept = self.kept();
        let last = kept.get(&id)?.back()?;
        Some(Reading {
            at_ms: last.at_ms,
            usage: last.usage(limits),
        })
    }

    /// The samples of `id` kept since `from_ms`, oldest first, each one's rate over the kept
    /// read before it; limits as `limits` gives them (the latest read's).
    pub fn since(
        &self,
        id: Uuid,
        from_ms: u64,
        limits: &pb::SandboxUsage,
    ) -> Vec<SandboxUsageSample> {
        let kept = self.kept();
        let Some(ring) = kept.get(&id) else {
            return Vec::new();
        };
        let readings: Vec<Reading> = ring
            .iter()
            .map(|k| Reading {
                at_ms: k.at_ms,
                usage: k.usage(limits),
            })
            .collect();
        readings
            .iter()
            .enumerate()
            .filter(|(_, r)| r.at_ms >= from_ms)
            .map(|(i, r)| sample(r, i.checked_sub(1).map(|j| &readings[j])))
            .collect()
    }

    /// Sandboxes with kept samples, and the samples kept.
    pub fn counts(&self) -> (usize, usize) {
        let kept = self.kept();
        (kept.len(), kept.values().map(VecDeque::len).sum())
    }

    /// The bytes the kept samples take (their rings' allocations), about.
    pub fn bytes(&self) -> usize {
        let kept = self.kept();
        kept.values()
            .map(|ring| ring.capacity() * std::mem::size_of::<Kept>())
            .sum::<usize>()
            + kept.capacity() * (std::mem::size_of::<(Uuid, VecDeque<Kept>)>() + 8)
    }
}

/// Reads every running sandbox this gateway serves, every `interval`, into `history`, for
/// ever (the caller aborts it). A driver that does not answer within the interval (or the
/// driver call deadline, the shorter) leaves a gap; reads run 16 at a time, so a round with
/// many such drivers ends late (the next starts when it ends), and every read keeps its own
/// time.
pub async fn sample_forever(shared: Arc<Shared>, history: Arc<StatsHistory>) {
    let every = history.settings().interval;
    if every.is_zero() {
        return;
    }
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tick.tick().await;
        sample_once(&shared, &history, every).await;
    }
}

/// One round of [`sample_forever`].
pub async fn sample_once(shared: &Arc<Shared>, history: &StatsHistory, every: Duration) {
    let records = match crate::scan::all_records(
        &*shared.store,
        Kind::Sandbox,
        sbx_storage::Scope::All,
        &sbx_storage::LabelSelector::everything(),
    )
    .await
    {
        Ok(records) => records,
        Err(e) => {
            tracing::warn!("stats: cannot list the sandboxes: {e}");
            return;
        }
    };
    let mut live = HashSet::new();
    let mut targets = Vec::new();
    for record in records {
        let Ok(stored) = crate::records::StoredSandbox::from_record(record) else {
            continue;
        };
        let id = stored.id();
        live.insert(id);
        let held = shared.ownership.is_none()
            || shared
                .drivers
                .nodes()
                .fence_of(stored.workspace_id())
                .is_some();
        if !held || stored.sandbox.phase() != Phase::Ready {
            continue;
        }
        if let Ok(driver) = shared.drivers.for_sandbox(&stored.sandbox) {
            targets.push((id, driver));
        }
    }
    let deadline = every.min(shared.config.driver_call_timeout);
    // Each read is kept as it arrives, stamped when it was made (the end of its own call),
    // never at the end of the round.
    let reads: Vec<BoxFuture<'static, (Uuid, Option<Reading>)>> = targets
        .into_iter()
        .map(|(id, driver)| {
            async move {
                let read = driver.stats(pb::StatsRequest {
                    sandbox_id: id.to_string(),
                });
                let usage = tokio::time::timeout(deadline, read).await;
                (id, usage.ok().and_then(Result::ok).map(Reading::now))
            }
            .boxed()
        })
        .collect();
    let mut reads = futures::stream::iter(reads).buffer_unordered(SAMPLE_CONCURRENCY);
    while let Some((id, reading)) = reads.next().await {
        if let Some(reading) = reading {
            history.record(id, &reading);
        }
    }
    history.retain(&live);
    let metrics = &shared.config.metrics;
    metrics.stats_history_samples.set(history.counts().1 as i64);
    metrics.stats_history_bytes.set(history.bytes() as i64);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(cpu_nanos: u64, running: bool) -> pb::SandboxUsage {
        pb::SandboxUsage {
            running,
            cpu_nanos,
            cpu_limit_millis: 2000,
            memory_bytes: 100 << 20,
            memory_limit_bytes: 1 << 30,
            pids: 3,
            ..Default::default()
        }
    }

    #[test]
    fn the_cpu_rate_is_cores_over_the_time_between_reads() {
        let before = Reading {
            at_ms: 10_000,
            usage: usage(1_000_000_000, true),
        };
        // 1.5 CPU-seconds in 2 seconds: 0.75 cores.
        let now = Reading {
            at_ms: 12_000,
            usage: usage(2_500_000_000, true),
        };
        let s = sample(&now, Some(&before));
        assert!((s.cpu_cores - 0.75).abs() < 1e-9, "{}", s.cpu_cores);
        assert_eq!(s.cpu_limit_cores, 2.0);
        assert_eq!(s.cpu_seconds_total, 2.5);
        assert_eq!(s.time.unwrap().seconds, 12);
        // No read before, a counter that went down (a new run), a stopped workload: no rate.
        assert_eq!(sample(&now, None).cpu_cores, 0.0);
        let restarted = Reading {
            at_ms: 14_000,
            usage: usage(5, true),
        };
        assert_eq!(sample(&restarted, Some(&now)).cpu_cores, 0.0);
        let stopped = Reading {
            at_ms: 14_000,
            usage: usage(2_600_000_000, false),
        };
        assert_eq!(sample(&stopped, Some(&now)).cpu_cores, 0.0);
    }

    #[test]
    fn the_history_is_bounded_ordered_and_forgets_deleted_sandboxes() {
        let history = StatsHistory::new(StatsSettings {
            interval: Duration::from_secs(5),
            history: Duration::from_secs(20),
        });
        assert_eq!(history.settings().capacity(), 4);
        let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
        for i in 0..10u64 {
            history.record(
                a,
                &Reading {
                    at_ms: i * 5000,
                    usage: usage(i * 1_000_000_000, true),
                },
            );
        }
        history.record(
            b,
            &Reading {
                at_ms: 0,
                usage: usage(0, true),
            },
        );
        let limits = usage(0, true);
        let kept = history.since(a, 0, &limits);
        assert_eq!(kept.len(), 4, "the oldest beyond the bound are dropped");
        let seconds: Vec<i64> = kept.iter().map(|s| s.time.unwrap().seconds).collect();
        assert_eq!(seconds, vec![30, 35, 40, 45]);
        // 1 CPU-second every 5 s: 0.2 cores, except the first kept (nothing before it).
        assert_eq!(kept[0].cpu_cores, 0.0);
        assert!(kept[1..].iter().all(|s| (s.cpu_cores - 0.2).abs() < 1e-9));
        assert_eq!(history.since(a, 40_000, &limits).len(), 2);
        assert_eq!(history.latest(a, &limits).unwrap().at_ms, 45_000);
        assert_eq!(history.counts(), (2, 5));
        // A ring never holds room for more than the bound.
        assert!(
            history.kept().values().all(|ring| ring.capacity() <= 16),
            "{history:?}"
        );
        assert!(history.bytes() >= 5 * std::mem::size_of::<Kept>());
        history.retain(&HashSet::from([b]));
        assert_eq!(history.counts(), (1, 1));
        assert!(history.since(a, 0, &limits).is_empty());
        // No interval: nothing kept.
        let off = StatsHistory::new(StatsSettings {
            interval: Duration::ZERO,
            history: Duration::from_secs(60),
        });
        off.record(a, &Reading::now(usage(1, true)));
        assert_eq!(off.counts(), (0, 0));
    }

    #[test]
    fn a_kept_read_round_trips_its_figures() {
        let mut u = usage(7, true);
        u.oom_kills = 2;
        (u.has_disk, u.disk_used_bytes, u.disk_limit_bytes) = (true, 11, 12);
        (u.has_network, u.network_rx_bytes, u.network_tx_bytes) = (true, 13, 14);
        let back = Kept::of(1, &u).usage(&u);
        assert_eq!(back, u);
        assert_eq!(std::mem::size_of::<Kept>(), 56);
    }
}
