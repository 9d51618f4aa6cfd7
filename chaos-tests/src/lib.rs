//! sbx-chaos-tests: fault-injection and kill/restart scenarios, load generators and
//! benchmarks for the sbx gateway.
//!
//! - [`scenario`]: the in-process chaos scenario and its invariant checks.
//! - [`recording`], [`removals`]: what the driver was asked to do, and what the simulated
//!   machine really removed.
//!
//! Binaries:
//! - `sbx-actor-bench`: lifecycle throughput through the actor tree vs the bare sim driver,
//!   startup re-attach time, and memory per idle sandbox actor (see docs/BENCHMARKS.md).

pub mod recording;
pub mod removals;
pub mod rng;
pub mod scenario;

/// Resident set size of this process in bytes, from /proc/self/status.
pub fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// The `p`-th percentile (0..=100) of sorted samples.
pub fn percentile(sorted: &[std::time::Duration], p: f64) -> std::time::Duration {
    if sorted.is_empty() {
        return std::time::Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn percentiles_pick_the_ranked_sample() {
        let s: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&s, 50.0), Duration::from_millis(51));
        assert_eq!(percentile(&s, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&s, 0.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }

    #[test]
    fn this_process_has_a_resident_size() {
        assert!(resident_bytes().unwrap() > 1024 * 1024);
    }
}
