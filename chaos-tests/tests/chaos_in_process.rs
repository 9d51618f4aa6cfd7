//! The in-process chaos scenario, CI profile: a few seeded rounds. A longer soak:
//! `SBX_CHAOS_ROUNDS=200 cargo nextest run -p sbx-chaos-tests --test chaos_in_process` or the
//! `sbx-chaos` binary. A failing round prints its seed; `SBX_CHAOS_SEED=N` replays it.

use sbx_chaos_tests::scenario::{ChaosConfig, run};

fn seeds() -> Vec<u64> {
    if let Some(seed) = std::env::var("SBX_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        return vec![seed];
    }
    let rounds: u64 = std::env::var("SBX_CHAOS_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    (1..=rounds).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_rounds_keep_every_invariant() {
    for seed in seeds() {
        let report = run(ChaosConfig::ci(seed))
            .await
            .unwrap_or_else(|e| panic!("{e}\nreplay with SBX_CHAOS_SEED={seed}"));
        eprintln!("{report:?}");
        assert!(report.invariant_checks > 0);
        assert!(
            report.ops_acknowledged > 0,
            "seed {seed}: nothing was acknowledged"
        );
        let injected: u64 = report.faults.values().sum();
        assert!(injected > 0, "seed {seed}: no fault was injected");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fault_free_run_acknowledges_most_operations() {
    let mut cfg = ChaosConfig::ci(99);
    cfg.faults = false;
    cfg.gateway_restarts = false;
    let report = run(cfg).await.unwrap();
    assert!(report.faults.is_empty());
    // Without faults nothing is refused as unavailable (only name clashes and lookups of
    // names that do not exist are refused, and those are checked as expected errors).
    assert_eq!(report.ops_unavailable, 0, "{report:?}");
    assert!(
        report.creates_acknowledged > 0 && report.deletes_acknowledged > 0,
        "{report:?}"
    );
}
