//! What sbxd counts, for Prometheus (`sbxd serve --metrics-listen ADDR`, OpenMetrics text).
//!
//! One [`Metrics`] per gateway, in its [`crate::Config`]: counted where what it counts happens
//! (an API request in the gateway's service layer, a driver call in the sandbox actor that
//! makes it, a restart in the supervisor that restarts) and read at each scrape where it is a
//! state (sandboxes by phase, the watch history). No label names a sandbox: every family's
//! cardinality is bounded by the API's methods, the drivers, their operations and the phases.
//! Names follow Prometheus' conventions (`_total`, `_seconds`, `_bytes`; the `sbx_` prefix).

use std::sync::Mutex;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};
use sbx_driver_api::DriverError;

/// Latency buckets, seconds: 1 ms to about 65 s, doubling.
fn latency_buckets() -> impl Iterator<Item = f64> {
    prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 17)
}

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ApiLabels {
    /// The gRPC method (`/sbx.v1.SandboxService/CreateSandbox`).
    pub method: String,
    /// The gRPC status code's name (`OK`, `NOT_FOUND`, …).
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConnectionLabels {
    /// The listener (`api`, `e2b`, `service`, `metrics`).
    pub listener: String,
    /// `limit` (every place taken), `peer_limit` (the peer's share taken), `unproven` (closed
    /// with no authenticated request within the proof timeout).
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MethodLabels {
    pub method: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DriverCallLabels {
    pub driver: String,
    pub operation: String,
    /// `ok`, or the error's kind (`not_found`, `unavailable`, `deadline_exceeded`, …).
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DriverOpLabels {
    pub driver: String,
    pub operation: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActorLabels {
    /// `sandbox` or `workspace` (a workspace supervisor).
    pub actor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SandboxLabels {
    pub phase: String,
    pub driver: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: String,
}

/// Counts one command in flight while it lives (a gauge up at its start, down at its end,
/// however it ends).
pub struct InFlight<'a>(&'a Gauge);

impl<'a> InFlight<'a> {
    pub fn enter(gauge: &'a Gauge) -> InFlight<'a> {
        gauge.inc();
        InFlight(gauge)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.dec();
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

/// Every family sbxd serves.
pub struct Metrics {
    /// Counting is off until sbxd serves the metrics (`--metrics-listen`): without a scraper
    /// the hot paths pay nothing.
    enabled: std::sync::atomic::AtomicBool,
    registry: Mutex<Registry>,
    pub api_requests: Family<ApiLabels, Counter>,
    pub api_duration: Family<MethodLabels, Histogram>,
    pub connections_refused: Family<ConnectionLabels, Counter>,
    pub driver_calls: Family<DriverCallLabels, Counter>,
    pub driver_duration: Family<DriverOpLabels, Histogram>,
    pub actor_restarts: Family<ActorLabels, Counter>,
    pub sandboxes: Family<SandboxLabels, Gauge>,
    pub watch_subscribers: Gauge,
    pub sandbox_commands_in_flight: Gauge,
    pub network_denials: Gauge,
    pub resolver_answers: Family<OutcomeLabels, Counter>,
    pub watch_history_events: Gauge,
    pub watch_history_bytes: Gauge,
    pub stats_history_samples: Gauge,
    pub stats_history_bytes: Gauge,
    pub store_writes: Counter,
    pub store_commits: Counter,
    pub store_commit_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pub store_flushed_bytes: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let metrics = Metrics {
            enabled: std::sync::atomic::AtomicBool::new(false),
            registry: Mutex::new(Registry::with_prefix("sbx")),
            api_requests: Family::<ApiLabels, Counter>::default(),
            api_duration: Family::<MethodLabels, Histogram>::new_with_constructor(
                latency_histogram as fn() -> _,
            ),
            connections_refused: Family::<ConnectionLabels, Counter>::default(),
            driver_calls: Family::<DriverCallLabels, Counter>::default(),
            driver_duration: Family::<DriverOpLabels, Histogram>::new_with_constructor(
                latency_histogram as fn() -> _,
            ),
            actor_restarts: Family::<ActorLabels, Counter>::default(),
            sandboxes: Family::<SandboxLabels, Gauge>::default(),
            watch_subscribers: Gauge::default(),
            sandbox_commands_in_flight: Gauge::default(),
            network_denials: Gauge::default(),
            resolver_answers: Family::<OutcomeLabels, Counter>::default(),
            watch_history_events: Gauge::default(),
            watch_history_bytes: Gauge::default(),
            stats_history_samples: Gauge::default(),
            stats_history_bytes: Gauge::default(),
            store_writes: Counter::default(),
            store_commits: Counter::default(),
            store_commit_seconds: Counter::<f64, std::sync::atomic::AtomicU64>::default(),
            store_flushed_bytes: Counter::default(),
        };
        metrics.register_all();
        metrics
    }

    /// Registers every metric under its name, in the order the exposition lists them, and
    /// the build's version.
    fn register_all(&self) {
        let mut registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        registry.register(
            "api_requests",
            "API requests answered, by gRPC method and status code",
            self.api_requests.clone(),
        );
        registry.register_with_unit(
            "api_request_duration",
            "Time from an API request's arrival to its answer's head (a stream's first message)",
            Unit::Seconds,
            self.api_duration.clone(),
        );
        registry.register(
            "connections_refused",
            "Connections closed by the listeners' bounds, by listener and reason (limit, peer_limit, unproven)",
            self.connections_refused.clone(),
        );
        registry.register(
            "driver_calls",
            "Driver calls made by sandbox actors, by driver, operation and outcome",
            self.driver_calls.clone(),
        );
        registry.register_with_unit(
            "driver_call_duration",
            "Time of a driver call made by a sandbox actor, by driver and operation",
            Unit::Seconds,
            self.driver_duration.clone(),
        );
        registry.register(
            "actor_restarts",
            "Actors restarted by their supervisor after they failed",
            self.actor_restarts.clone(),
        );
        registry.register(
            "sandboxes",
            "Sandboxes in the store, by phase and driver (read at each scrape)",
            self.sandboxes.clone(),
        );
        registry.register(
            "sandbox_commands_in_flight",
            "Commands sent to sandbox actors and not yet answered: waiting in their mailboxes or running",
            self.sandbox_commands_in_flight.clone(),
        );
        registry.register(
            "network_denials",
            "Connection attempts and DNS queries the sandboxes' egress policies refused in the last ten minutes, every sandbox together (as the store last recorded them)",
            self.network_denials.clone(),
        );
        registry.register(
            "resolver_answers",
            "Queries the sandbox network's resolver answered, by outcome (noerror, refused, servfail, notimp, dropped), in this process",
            self.resolver_answers.clone(),
        );
        registry.register(
            "watch_subscribers",
            "Open watches of sandbox events",
            self.watch_subscribers.clone(),
        );
        registry.register(
            "watch_history_events",
            "Sandbox events the watch history holds",
            self.watch_history_events.clone(),
        );
        registry.register_with_unit(
            "watch_history",
            "What the watch history's events cost, as it counts them against its bound",
            Unit::Bytes,
            self.watch_history_bytes.clone(),
        );
        registry.register(
            "stats_history_samples",
            "Usage samples of sandboxes the gateway keeps (sbxd serve --stats-interval, --stats-history)",
            self.stats_history_samples.clone(),
        );
        registry.register_with_unit(
            "stats_history",
            "The memory the kept usage samples take, about",
            Unit::Bytes,
            self.stats_history_bytes.clone(),
        );
        registry.register(
            "store_writes",
            "Store writes acknowledged as durable since the store opened",
            self.store_writes.clone(),
        );
        registry.register(
            "store_commits",
            "Store commits (a sled group flush, a PostgreSQL transaction); writes / commits is \
             the mean batch",
            self.store_commits.clone(),
        );
        registry.register_with_unit(
            "store_commit",
            "Time spent committing; over store_commits_total, a commit's mean latency",
            Unit::Seconds,
            self.store_commit_seconds.clone(),
        );
        registry.register_with_unit(
            "store_flushed",
            "Bytes the sled store's flushes wrote (0 on PostgreSQL)",
            Unit::Bytes,
            self.store_flushed_bytes.clone(),
        );
        let build = Family::<BuildLabels, Gauge>::default();
        build
            .get_or_create(&BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
            })
            .set(1);
        registry.register("build_info", "The sbx version serving (always 1)", build);
    }

    /// The store's cumulative commit figures, as read at a scrape (the counters follow them).
    pub fn store_stats(&self, stats: &sbx_storage::FlushStats) {
        let follow = |counter: &Counter, now: u64| {
            counter.inc_by(now.saturating_sub(counter.get()));
        };
        follow(&self.store_writes, stats.writes);
        follow(&self.store_commits, stats.flushes);
        follow(&self.store_flushed_bytes, stats.flush_bytes);
        let seconds = stats.flush_micros as f64 / 1e6;
        let grew = seconds - self.store_commit_seconds.get();
        if grew > 0.0 {
            self.store_commit_seconds.inc_by(grew);
        }
    }

    /// From now on, count (sbxd serves the metrics).
    pub fn enable(&self) {
        self.enabled
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether counting is on.
    pub fn enabled(&self) -> bool {
        self.enabled.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One driver call made by a sandbox actor, and how it ended.
    pub fn driver_call<T>(
        &self,
        driver: &str,
        operation: &str,
        took: Duration,
        result: &Result<T, DriverError>,
    ) {
        if !self.enabled() {
            return;
        }
        let outcome = match result {
            Ok(_) => "ok",
            Err(e) => driver_outcome(e),
        };
        self.driver_calls
            .get_or_create(&DriverCallLabels {
                driver: driver.to_string(),
                operation: operation.to_string(),
                outcome: outcome.to_string(),
            })
            .inc();
        self.driver_duration
            .get_or_create(&DriverOpLabels {
                driver: driver.to_string(),
                operation: operation.to_string(),
            })
            .observe(took.as_secs_f64());
    }

    /// An actor of `kind` (`sandbox`, `workspace`) is restarted after it failed.
    pub fn actor_restarted(&self, kind: &str) {
        if !self.enabled() {
            return;
        }
        self.actor_restarts
            .get_or_create(&ActorLabels {
                actor: kind.to_string(),
            })
            .inc();
    }

    /// Every family, in the OpenMetrics text format (what Prometheus scrapes).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().unwrap_or_else(|p| p.into_inner());
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
        out
    }
}

/// A driver error's kind, as the `outcome` label says it.
fn driver_outcome(e: &DriverError) -> &'static str {
    match e {
        DriverError::InvalidArgument(_) => "invalid_argument",
        DriverError::NotFound { .. } => "not_found",
        DriverError::GenerationMismatch { .. } => "generation_mismatch",
        DriverError::FailedPrecondition(_) => "failed_precondition",
        DriverError::Unimplemented(_) => "unimplemented",
        DriverError::Unavailable(_) => "unavailable",
        DriverError::DeadlineExceeded { .. } => "deadline_exceeded",
        DriverError::Internal(_) => "internal",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_are_named_by_the_conventions_and_count() {
        let m = Metrics::new();
        m.driver_call::<()>("sim", "get", Duration::from_millis(3), &Ok(()));
        assert!(
            !m.encode().contains("sbx_driver_calls_total{"),
            "off until enabled"
        );
        m.enable();
        m.driver_call::<()>("sim", "get", Duration::from_millis(3), &Ok(()));
        m.driver_call::<()>(
            "sim",
            "get",
            Duration::from_millis(3),
            &Err(DriverError::NotFound {
                sandbox_id: "x".into(),
            }),
        );
        m.actor_restarted("sandbox");
        let text = m.encode();
        for line in [
            "sbx_driver_calls_total{driver=\"sim\",operation=\"get\",outcome=\"ok\"} 1",
            "sbx_driver_calls_total{driver=\"sim\",operation=\"get\",outcome=\"not_found\"} 1",
            "sbx_driver_call_duration_seconds_count{driver=\"sim\",operation=\"get\"} 2",
            "sbx_actor_restarts_total{actor=\"sandbox\"} 1",
            "# TYPE sbx_watch_history_bytes gauge",
            "# EOF",
        ] {
            assert!(text.contains(line), "{line:?} not in:\n{text}");
        }
        assert!(text.contains("sbx_build_info{version="), "{text}");
    }
}
