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

const HELP: &str = "\
sbx-chaos: the long (soak) profile of the in-process chaos scenario.

Runs seeded rounds (gateway, actors and the simulated driver in this process, with faults:
sandbox-actor and supervisor kills, driver latency, errors, hangs and lost replies, forgotten
generations, lost driver state, workload exits, gateway restarts) one after another until the
time budget is spent, then prints the totals. (The disk-full fault and the store-damage check
run in the process-level suite, chaos-tests/tests/chaos_processes.rs.) The first violated invariant
stops the run: it is printed with its seed, the round's directory is kept and its journal
written there, and the exit status is 1.

Usage:
  sbx-chaos [SECONDS] [FIRST_SEED]    soak for SECONDS (default 60) from FIRST_SEED (default 1)
  SBX_CHAOS_REPLAY=FILE sbx-chaos     replay a failed round's journal, operations and faults
                                      in their recorded order
  sbx-chaos --help                    this text

Exit status: 0 when every round kept every invariant, 1 on a violation, 2 on a bad argument.
";

/// The positional argument at `index`, parsed, or its default; a value that is not a number
/// is a usage error, never silently replaced by the default.
fn number_arg(args: &[String], index: usize, name: &str, default: u64) -> u64 {
    match args.get(index) {
        None => default,
        Some(raw) => raw.parse().unwrap_or_else(|_| {
            eprintln!("sbx-chaos: {name} must be a whole number, got {raw:?} (see --help)");
            std::process::exit(2);
        }),
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        print!("{HELP}");
        return;
    }
    if args.len() > 2 || args.iter().any(|a| a.starts_with('-')) {
        eprintln!("sbx-chaos: unexpected arguments {args:?} (see --help)");
        std::process::exit(2);
    }
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
    let seconds = number_arg(&args, 0, "SECONDS", 60);
    let first = number_arg(&args, 1, "FIRST_SEED", 1);
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
