//! The long (soak) profile of the in-process chaos scenario: seeded rounds one after another
//! until a time budget is spent; prints the totals, or the first violation with its seed.
//!
//! ```text
//! cargo run --release -p sbx-chaos-tests --bin sbx-chaos -- [SECONDS] [FIRST_SEED]
//! ```
//! A violation exits 1, keeps the round's directory and writes its journal there;
//! `SBX_CHAOS_REPLAY=FILE sbx-chaos` (or the `chaos_in_process` test with the same variable)
//! replays that journal's operations and faults in their order. `SBX_CHAOS_SEED=N cargo
//! nextest run -p sbx-chaos-tests --test chaos_in_process` runs seed N again (the same
//! choices, not the same interleaving).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sbx_chaos_tests::scenario::{ChaosConfig, replay, run};

#[tokio::main]
async fn main() {
    if let Ok(file) = std::env::var("SBX_CHAOS_REPLAY") {
        match replay(std::path::Path::new(&file), None).await {
            Ok(report) => {
                println!("sbx-chaos: the replay of {file} kept every invariant: {report:?}")
            }
            Err(violation) => {
                eprintln!("VIOLATION in the replay of {file}: {violation}");
                std::process::exit(1);
            }
        }
        return;
    }
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(60);
    let first: u64 = std::env::args()
        .nth(2)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1);
    let budget = Duration::from_secs(seconds);
    let started = Instant::now();
    let (mut rounds, mut ops, mut acked, mut creates, mut deletes, mut restarts, mut checks) =
        (0u64, 0u64, 0u64, 0u64, 0u64, 0u64, 0u64);
    let mut faults: BTreeMap<&'static str, u64> = BTreeMap::new();
    // Removals by the simulated machine, each matched to a delete of its id; and how often
    // the observer of removals fell behind (removals then go unchecked).
    let (mut removals, mut lagged, mut owned) = (0u64, 0u64, 0u64);
    let mut seed = first;
    while started.elapsed() < budget {
        match run(ChaosConfig::ci(seed)).await {
            Ok(report) => {
                rounds += 1;
                ops += report.ops;
                acked += report.ops_acknowledged;
                creates += report.creates_acknowledged;
                deletes += report.deletes_acknowledged;
                restarts += report.gateway_restarts;
                checks += report.invariant_checks;
                removals += report.removals_checked;
                lagged += report.removal_observer_lagged;
                owned += report.owned_acknowledged;
                for (kind, n) in report.faults {
                    *faults.entry(kind).or_default() += n;
                }
            }
            Err(violation) => {
                eprintln!("VIOLATION after {rounds} clean rounds: {violation}");
                std::process::exit(1);
            }
        }
        seed += 1;
    }
    println!(
        "sbx-chaos: {rounds} rounds (seeds {first}..{}) in {:?}: {ops} operations ({acked} acknowledged; {creates} creates and {deletes} deletes acknowledged), {restarts} gateway restarts, {checks} invariant checks passed, 0 violations",
        seed - 1,
        started.elapsed()
    );
    println!(
        "  driver removals matched to a delete of their id: {removals} (observer fell behind {lagged} times)"
    );
    println!("  provider, attachment, setting and service operations acknowledged: {owned}");
    for (kind, n) in faults {
        println!("  fault {kind}: {n}");
    }
}
