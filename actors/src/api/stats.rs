//! A sandbox's usage: read from its driver by id (never through its actor), made into
//! samples with rates (`crate::stats`), with the history this gateway kept of it.

use std::time::Duration;

use futures::StreamExt;
use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_proto::v1::SandboxStats;
use uuid::Uuid;

use super::{ActorStream, Gateway};
use crate::error::{ActorError, Result};
use crate::stats::{Reading, sample};
use crate::validate::SandboxSelector;

/// The least and most time between two messages of a stats watch.
pub const MIN_STATS_INTERVAL: Duration = Duration::from_millis(500);
pub const MAX_STATS_INTERVAL: Duration = Duration::from_secs(3600);
/// A one-shot read with no kept read recent enough to make a rate with reads twice, this
/// far apart.
const RATE_WINDOW: Duration = Duration::from_millis(500);

impl Gateway {
    /// What a sandbox uses now, and the samples kept of it since `history` ago.
    pub async fn sandbox_stats(
        &self,
        sel: &SandboxSelector,
        history: Duration,
    ) -> Result<SandboxStats> {
        let sb = self.resolve_sandbox(sel).await?;
        let driver = self.driver_of(&sb).await?;
        let id = sb.id();
        let mut now = read(&*driver, id, &self.driver_name(&sb.sandbox)).await?;
        let settings = self.stats.settings();
        // The rate is over the latest kept read when it is recent (at most two intervals
        // old); else over a second read a moment later.
        let kept = self.stats.latest(id, &now.usage).filter(|r| {
            let age = now.at_ms.saturating_sub(r.at_ms);
            age >= 100 && age <= 2 * settings.interval.as_millis() as u64
        });
        let before = match kept {
            Some(kept) => kept,
            None if now.usage.running => {
                tokio::time::sleep(RATE_WINDOW).await;
                let first = now;
                now = read(&*driver, id, &self.driver_name(&sb.sandbox)).await?;
                first
            }
            None => now.clone(),
        };
        let from_ms = now
            .at_ms
            .saturating_sub(history.as_millis().min(u128::from(u64::MAX)) as u64);
        Ok(SandboxStats {
            sandbox_id: id.to_string(),
            workspace_id: sb.sandbox.workspace_id.clone(),
            name: sb.sandbox.name.clone(),
            current: Some(sample(&now, Some(&before))),
            history: if history.is_zero() {
                Vec::new()
            } else {
                self.stats.since(id, from_ms, &now.usage)
            },
            history_interval_seconds: settings.interval.as_secs() as u32,
        })
    }

    /// The sandbox's usage every `interval`, each message's rates over the interval before
    /// it, until the caller drops the stream or the sandbox is gone (the stream then ends
    /// with its NotFound).
    pub async fn watch_sandbox_stats(
        &self,
        sel: &SandboxSelector,
        interval: Duration,
    ) -> Result<ActorStream<SandboxStats>> {
        if !(MIN_STATS_INTERVAL..=MAX_STATS_INTERVAL).contains(&interval) {
            return Err(ActorError::InvalidArgument(format!(
                "a stats interval of {interval:?} is out of range: from {MIN_STATS_INTERVAL:?} \
                 to {MAX_STATS_INTERVAL:?}"
            )));
        }
        let sb = self.resolve_sandbox(sel).await?;
        let driver = self.driver_of(&sb).await?;
        let (id, workspace_id, name) = (
            sb.id(),
            sb.sandbox.workspace_id.clone(),
            sb.sandbox.name.clone(),
        );
        let driver_name = self.driver_name(&sb.sandbox);
        let first = read(&*driver, id, &driver_name).await?;
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let stream = futures::stream::unfold(Some((first, tick)), move |state| {
            let (driver, driver_name) = (driver.clone(), driver_name.clone());
            let (workspace_id, name) = (workspace_id.clone(), name.clone());
            async move {
                let (before, mut tick) = state?;
                tick.tick().await;
                match read(&*driver, id, &driver_name).await {
                    Ok(now) => {
                        let stats = SandboxStats {
                            sandbox_id: id.to_string(),
                            workspace_id,
                            name,
                            current: Some(sample(&now, Some(&before))),
                            history: Vec::new(),
                            history_interval_seconds: 0,
                        };
                        Some((Ok(stats), Some((now, tick))))
                    }
                    // The last message: the sandbox is gone, or its driver failed.
                    Err(e) => Some((Err(e), None)),
                }
            }
        });
        Ok(stream.boxed())
    }
}

impl Gateway {
    /// The name of the driver a sandbox's spec names (the default when it names none).
    pub(super) fn driver_name(&self, sandbox: &sbx_proto::v1::Sandbox) -> String {
        sandbox
            .spec
            .as_ref()
            .map(|s| s.driver.clone())
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| self.shared.drivers.default_name().to_string())
    }
}

/// One read of sandbox `id`'s usage from `driver` (named `driver_name` in errors).
async fn read(driver: &dyn ComputeDriver, id: Uuid, driver_name: &str) -> Result<Reading> {
    let usage = driver
        .stats(pb::StatsRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .map_err(|e| match e {
            DriverError::Unimplemented(_) => ActorError::FailedPrecondition(format!(
                "driver {driver_name:?} reads no usage figures of its sandboxes"
            )),
            other => ActorError::Driver(other),
        })?;
    Ok(Reading::now(usage))
}
