//! Concurrent sandbox creation and workspace deletion, many seeded rounds: never an orphan,
//! never a sandbox in a deleted workspace, and a late delete of an old workspace never
//! deletes a new one of the same name.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use sbx_actors::{ActorError, SandboxFilter, WorkspaceSelector};
use sbx_proto::v1::Phase;
use sbx_storage::{Kind, ListQuery, Scope};
use tokio::sync::Barrier;
use uuid::Uuid;

/// splitmix64: a seeded source of choices, so a failing round can be replayed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn rounds() -> u64 {
    std::env::var("SBX_RACE_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40)
}

/// Every sandbox record names a workspace that exists, and every workload the machine runs
/// has a record.
async fn check_no_orphans(env: &Env, seed: u64) {
    let workspaces: HashSet<Uuid> = env
        .store
        .list(ListQuery::new(Kind::Workspace, Scope::All, 0))
        .await
        .unwrap()
        .records
        .iter()
        .map(|r| r.id)
        .collect();
    let sandboxes = env
        .store
        .list(ListQuery::new(Kind::Sandbox, Scope::All, 0))
        .await
        .unwrap()
        .records;
    for sb in &sandboxes {
        assert!(
            workspaces.contains(&sb.workspace.unwrap()),
            "seed {seed}: sandbox {} ({}) is in a deleted workspace",
            sb.name,
            sb.id
        );
    }
    let ids: HashSet<Uuid> = sandboxes.iter().map(|r| r.id).collect();
    for running in env.world.running_ids() {
        assert!(
            ids.contains(&running),
            "seed {seed}: workload {running} runs without a record (an orphan)"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_sandbox_and_delete_workspace_race_without_orphans() {
    let env = Arc::new(Env::new().await);
    // How often each interleaving happened, to show the rounds really race.
    let (mut refused_creates, mut cascaded_creates) = (0, 0);
    for seed in 0..rounds() {
        let mut rng = Rng(seed);
        let gw = env.gw();
        let ws = gw.create_workspace("race", HashMap::new()).await.unwrap();
        let ws_id = Uuid::parse_str(&ws.id).unwrap();
        let creates = 1 + rng.below(5) as usize;
        let cascade = rng.below(2) == 0;
        let by_name = rng.below(2) == 0;
        let delay = Duration::from_micros(rng.below(3000));
        let barrier = Arc::new(Barrier::new(2));

        let creator = {
            let (env, barrier) = (Arc::clone(&env), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                let mut acked = Vec::new();
                let mut refused = 0;
                for k in 0..creates {
                    match env
                        .gw()
                        .create_sandbox(Some("race"), &format!("s{k}"), sleep_spec())
                        .await
                    {
                        Ok(sb) => acked.push(uuid(&sb)),
                        Err(
                            ActorError::WorkspaceTerminating(_) | ActorError::WorkspaceNotFound(_),
                        ) => refused += 1,
                        Err(e) => panic!("seed {seed}: unexpected create error {e}"),
                    }
                }
                (acked, refused)
            })
        };
        let deleter = {
            let (env, barrier) = (Arc::clone(&env), Arc::clone(&barrier));
            tokio::spawn(async move {
                barrier.wait().await;
                tokio::time::sleep(delay).await;
                let sel = if by_name {
                    WorkspaceSelector::Name("race".into())
                } else {
                    WorkspaceSelector::Id(ws_id)
                };
                env.gw().delete_workspace(&sel, cascade).await
            })
        };
        let (acked, refused) = creator.await.unwrap();
        let deleted = deleter.await.unwrap();
        refused_creates += (refused > 0) as u32;
        cascaded_creates += (matches!(deleted, Ok(true)) && !acked.is_empty()) as u32;

        match deleted {
            Ok(true) => {
                assert!(
                    gw.get_workspace(&WorkspaceSelector::Id(ws_id))
                        .await
                        .is_err(),
                    "seed {seed}"
                );
                for id in &acked {
                    assert!(
                        gw.get_sandbox(&sbx_actors::SandboxSelector::Id(*id))
                            .await
                            .is_err(),
                        "seed {seed}: sandbox outlived its workspace"
                    );
                }
            }
            Err(ActorError::WorkspaceNotEmpty { remaining, .. }) => {
                assert!(!cascade, "seed {seed}: cascade refused");
                assert!(remaining > 0);
                for id in &acked {
                    assert!(
                        gw.get_sandbox(&sbx_actors::SandboxSelector::Id(*id))
                            .await
                            .is_ok(),
                        "seed {seed}: an acknowledged create was lost"
                    );
                }
                assert!(
                    gw.delete_workspace(&WorkspaceSelector::Id(ws_id), true)
                        .await
                        .unwrap(),
                    "seed {seed}"
                );
            }
            other => panic!("seed {seed}: unexpected delete answer {other:?}"),
        }
        check_no_orphans(&env, seed).await;

        // ABA: a late delete aimed at the old workspace (by its id) must not touch a new
        // workspace of the same name.
        let new = gw.create_workspace("race", HashMap::new()).await.unwrap();
        gw.create_sandbox(Some("race"), "keeper", sleep_spec())
            .await
            .unwrap();
        assert!(
            !gw.delete_workspace(&WorkspaceSelector::Id(ws_id), true)
                .await
                .unwrap(),
            "seed {seed}"
        );
        let still = gw
            .get_workspace(&WorkspaceSelector::Name("race".into()))
            .await
            .unwrap();
        assert_eq!(
            still.id, new.id,
            "seed {seed}: the new workspace was deleted"
        );
        let filter = SandboxFilter {
            workspace: Some("race".into()),
            ..Default::default()
        };
        assert_eq!(
            gw.list_sandboxes(&filter, 10, "")
                .await
                .unwrap()
                .items
                .len(),
            1,
            "seed {seed}"
        );
        assert!(
            gw.delete_workspace(
                &WorkspaceSelector::Id(Uuid::parse_str(&new.id).unwrap()),
                true
            )
            .await
            .unwrap()
        );
    }
    check_no_orphans(&env, u64::MAX).await;
    assert!(
        env.world.running_ids().is_empty(),
        "every workload was deleted with its workspace"
    );
    eprintln!(
        "rounds with a refused create: {refused_creates}; with acknowledged creates then cascaded: {cascaded_creates}"
    );
    if rounds() >= 40 {
        assert!(
            refused_creates > 0 && cascaded_creates > 0,
            "the rounds never interleaved"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminating_workspace_refuses_creates_and_non_cascade_delete_refuses_while_sandboxes_remain()
 {
    let env = Env::new().await;
    let gw = env.gw();
    gw.create_workspace("full", HashMap::new()).await.unwrap();
    gw.create_sandbox(Some("full"), "one", sleep_spec())
        .await
        .unwrap();
    match gw
        .delete_workspace(&WorkspaceSelector::Name("full".into()), false)
        .await
    {
        Err(ActorError::WorkspaceNotEmpty {
            remaining, name, ..
        }) => {
            assert_eq!((remaining, name.as_str()), (1, "full"))
        }
        other => panic!("expected WorkspaceNotEmpty, got {other:?}"),
    }
    // The refusal changed nothing: creates still work.
    gw.create_sandbox(Some("full"), "two", sleep_spec())
        .await
        .unwrap();
    // Slow the driver so the cascade is still running when the create arrives.
    env.driver
        .set_faults(sbx_driver_sim::SimFaults::seeded(1).with_latency(Duration::from_millis(100)));
    let env2 = &env;
    let delete = async {
        env2.gw()
            .delete_workspace(&WorkspaceSelector::Name("full".into()), true)
            .await
    };
    let create = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        env2.gw()
            .create_sandbox(Some("full"), "three", sleep_spec())
            .await
    };
    let (deleted, created) = tokio::join!(delete, create);
    assert!(deleted.unwrap());
    assert!(
        matches!(
            created,
            Err(ActorError::WorkspaceTerminating(_) | ActorError::WorkspaceNotFound(_))
        ),
        "{created:?}"
    );
    assert!(env.world.running_ids().is_empty());
    // The default workspace cannot be deleted.
    assert!(matches!(
        gw.delete_workspace(&WorkspaceSelector::Name("default".into()), true)
            .await,
        Err(ActorError::FailedPrecondition(_))
    ));
}

/// A lifecycle command whose caller gave up while it waited its turn (behind a slow stop in
/// the sandbox's mailbox) is not carried out: the restart the caller abandoned does not
/// start the sandbox after the stop, long after the caller went on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_abandoned_before_its_turn_is_not_carried_out() {
    let env = Env::new().await;
    let gw = env.gw();
    let sb = gw
        .create_sandbox(None, "patient", sleep_spec())
        .await
        .unwrap();
    wait_phase(gw, &by_id(&sb), Phase::Ready, Duration::from_secs(10)).await;
    let generation = gw.get_sandbox(&by_id(&sb)).await.unwrap().generation;
    // Every driver call now takes 300 ms: the stop holds the mailbox that long.
    env.driver
        .set_faults(sbx_driver_sim::SimFaults::seeded(7).with_latency(Duration::from_millis(300)));
    let sel = by_id(&sb);
    let stop = gw.stop_sandbox(&sel);
    let abandoned = async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Queued behind the stop, then given up on.
        tokio::time::timeout(Duration::from_millis(50), gw.restart_sandbox(&sel)).await
    };
    let (stopped, abandoned) = tokio::join!(stop, abandoned);
    stopped.unwrap();
    assert!(
        abandoned.is_err(),
        "the restart was meant to be given up on"
    );
    env.driver.set_faults(sbx_driver_sim::SimFaults::default());
    // Long enough for an abandoned restart to have run, had it run.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let now = gw.get_sandbox(&by_id(&sb)).await.unwrap();
    assert_eq!(
        (now.phase(), now.generation),
        (Phase::Stopped, generation),
        "the abandoned restart was carried out: {now:?}"
    );
    assert!(env.world.running_ids().is_empty());
}
