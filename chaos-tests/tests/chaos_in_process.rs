//! The in-process chaos scenario, CI profile: a few seeded rounds. A longer soak:
//! `SBX_CHAOS_ROUNDS=200 cargo nextest run -p sbx-chaos-tests --test chaos_in_process` or the
//! `sbx-chaos` binary. A failing round prints its seed (`SBX_CHAOS_SEED=N` runs the seed
//! again: the same choices, not the same interleaving) and keeps its directory with its
//! journal; `SBX_CHAOS_REPLAY=FILE` replays the journal's operations and faults in their order.

use std::collections::HashSet;
use std::time::Duration;

use sbx_chaos_tests::scenario::journal::{Action, Answer, Entry, read_journal};
use sbx_chaos_tests::scenario::{ChaosConfig, replay, run};
use uuid::Uuid;

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
    if let Ok(file) = std::env::var("SBX_CHAOS_REPLAY") {
        let report = replay(std::path::Path::new(&file), None)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("{report:?}");
        return;
    }
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

/// Whether two actions are the same but for their sandbox ids, and (`strict`) an action of the
/// replay on a sandbox the round had created acts on a sandbox the replay created. Under faults
/// a create the round got acknowledged may be refused in the replay; what was done to that
/// sandbox is then done to its recorded id, which names nothing.
fn same_action(recorded: &[Entry], replayed: &[Entry], a: &Entry, b: &Entry, strict: bool) -> bool {
    let created = |entries: &[Entry]| -> HashSet<String> {
        entries
            .iter()
            .filter_map(|e| match &e.answer {
                Some(Ok(Answer {
                    created: Some(id), ..
                })) => Some(id.to_string()),
                _ => None,
            })
            .collect()
    };
    let (ours, theirs) = (created(recorded), created(replayed));
    let ids = |action: &Action| -> Vec<String> {
        let text = serde_json::to_string(action).unwrap();
        text.split('"')
            .filter(|t| Uuid::parse_str(t).is_ok())
            .map(str::to_string)
            .collect()
    };
    let shape = |action: &Action| {
        ids(action)
            .iter()
            .fold(serde_json::to_string(action).unwrap(), |t, id| {
                t.replace(id, "ID")
            })
    };
    shape(&a.action) == shape(&b.action)
        && ids(&a.action)
            .iter()
            .zip(ids(&b.action))
            .all(|(x, y)| !strict || !ours.contains(x) || theirs.contains(&y))
}

fn short_round(seed: u64, faults: bool, clients: usize, journal: &std::path::Path) -> ChaosConfig {
    let mut cfg = ChaosConfig::ci(seed);
    cfg.faults = faults;
    cfg.gateway_restarts = faults;
    cfg.clients = clients;
    cfg.duration = Duration::from_millis(1500);
    cfg.journal = Some(journal.to_path_buf());
    cfg
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_serial_fault_free_round_replays_to_the_same_answers() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (
        dir.path().join("round.jsonl"),
        dir.path().join("replay.jsonl"),
    );
    let mut cfg = short_round(5, false, 1, &first);
    // Answers that follow from the operations alone: no deadline fires in between.
    cfg.ttls = false;
    run(cfg).await.unwrap();
    replay(&first, Some(second.clone())).await.unwrap();
    let recorded = read_journal(&first).unwrap();
    let replayed = read_journal(&second).unwrap();
    assert!(
        recorded.entries.len() > 20,
        "{} entries",
        recorded.entries.len()
    );
    assert_eq!(recorded.entries.len(), replayed.entries.len());
    let acked = |e: &Entry| {
        matches!(
            e.answer,
            Some(Ok(Answer {
                acknowledged: true,
                ..
            }))
        ) as u32
    };
    let mut ended = HashSet::new();
    let mut i = 0;
    while i < recorded.entries.len() {
        let a = &recorded.entries[i];
        assert!(
            same_action(
                &recorded.entries,
                &replayed.entries,
                a,
                &replayed.entries[i],
                true
            ),
            "entry {}: the replay issued {:?} for {:?}",
            a.seq,
            replayed.entries[i].action,
            a.action
        );
        assert!(matches!(a.answer, Some(Ok(_))), "{a:?}");
        ended.extend(a.after.iter().copied());
        // One client and no faults: each answer follows from the operations before it — except
        // those of the two copies of an operation sent twice at once (the next entry began
        // before this one ended): which copy wins is a race, what they leave behind is not.
        let twin = recorded
            .entries
            .get(i + 1)
            .filter(|next| !next.after.contains(&a.seq) && !ended.contains(&a.seq));
        let n = if let Some(twin) = twin {
            ended.extend(twin.after.iter().copied());
            2
        } else {
            1
        };
        if n == 1 {
            assert_eq!(
                acked(a),
                acked(&replayed.entries[i]),
                "entry {i}: {a:?} replayed as {:?}",
                replayed.entries[i]
            );
        }
        i += n;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_faulty_round_replays_its_operations_and_faults_in_their_order() {
    let dir = tempfile::tempdir().unwrap();
    let (first, second) = (
        dir.path().join("round.jsonl"),
        dir.path().join("replay.jsonl"),
    );
    let report = run(short_round(3, true, 4, &first)).await.unwrap();
    assert!(!report.faults.is_empty(), "{report:?}");
    replay(&first, Some(second.clone())).await.unwrap();
    let recorded = read_journal(&first).unwrap();
    let replayed = read_journal(&second).unwrap();
    assert_eq!(recorded.entries.len(), replayed.entries.len());
    assert!(
        recorded
            .entries
            .iter()
            .any(|e| matches!(e.action, Action::Fault(_))),
        "the round journaled no fault"
    );
    let (mut ended_in_round, mut ended_in_replay) = (HashSet::new(), HashSet::new());
    for (a, b) in recorded.entries.iter().zip(&replayed.entries) {
        assert!(
            same_action(&recorded.entries, &replayed.entries, a, b, false),
            "entry {}: the replay issued {:?} for {:?}",
            a.seq,
            b.action,
            a.action
        );
        assert_eq!(a.lane, b.lane);
        // What had ended before an entry began in the round has ended before it in the replay.
        ended_in_replay.extend(b.after.iter().copied());
        ended_in_round.extend(a.after.iter().copied());
        assert!(
            ended_in_round.is_subset(&ended_in_replay),
            "entry {}: entries {:?} ended before it in the round but not in the replay",
            a.seq,
            ended_in_round
                .difference(&ended_in_replay)
                .collect::<Vec<_>>()
        );
    }
}
