//! The fault injector of the in-process scenario: one seeded fault every few tens of
//! milliseconds (actor and supervisor kills, gateway restarts, sim-driver faults) until told
//! to stop. A fault is drawn as data ([`Fault`], what the journal keeps and a replay applies)
//! and then applied.

use serde::{Deserialize, Serialize};

use super::*;

/// One fault, with every value drawn for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Fault {
    KillSandboxActor(Uuid),
    KillWorkspaceSupervisor(String),
    DriverFaultsOn {
        seed: u64,
        latency_ms: u64,
        jitter_ms: u64,
        error_rate: f64,
        hang_rate: f64,
        lost_reply_rate: f64,
    },
    DriverFaultsOff {
        seed: u64,
    },
    ForgetGenerations,
    SetGeneration {
        id: Uuid,
        generation: u64,
    },
    LoseAllState,
    WorkloadExits {
        id: Uuid,
        code: i32,
    },
    GatewayRestart,
}

impl Fault {
    /// The same fault with its sandbox id (if any) passed through `map`.
    pub(super) fn map_id(&self, map: impl Fn(Uuid) -> Uuid) -> Fault {
        match self {
            Fault::KillSandboxActor(id) => Fault::KillSandboxActor(map(*id)),
            Fault::SetGeneration { id, generation } => Fault::SetGeneration {
                id: map(*id),
                generation: *generation,
            },
            Fault::WorkloadExits { id, code } => Fault::WorkloadExits {
                id: map(*id),
                code: *code,
            },
            other => other.clone(),
        }
    }
}

/// Injects one fault every few tens of milliseconds until told to stop.
pub(super) async fn inject_faults(h: Arc<Harness>) {
    if !h.cfg.faults {
        return;
    }
    let mut rng = Rng::new(h.cfg.seed ^ 0xFA17);
    loop {
        tokio::time::sleep(Duration::from_millis(10 + rng.below(40))).await;
        if h.stop_faults.load(std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let known: Vec<Uuid> = {
            let mut ids: Vec<Uuid> = h
                .ledger
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .created
                .keys()
                .copied()
                .collect();
            ids.sort();
            ids
        };
        if let Some(fault) = draw_fault(&h.cfg, &mut rng, &known) {
            let action = Action::Fault(fault.clone());
            // A fault never fails the round; its answer says only whether it took effect.
            let _ = h
                .journal
                .around("injector", action, async {
                    Ok(apply_fault(&h, &fault).await)
                })
                .await;
        }
    }
}

/// Draws the next fault (the draws in the order the scenario has always made them, so a seed
/// keeps its schedule). `None`: nothing this time.
fn draw_fault(cfg: &ChaosConfig, rng: &mut Rng, known: &[Uuid]) -> Option<Fault> {
    let pick =
        |rng: &mut Rng| (!known.is_empty()).then(|| known[rng.below(known.len() as u64) as usize]);
    Some(match rng.below(100) {
        0..25 => Fault::KillSandboxActor(pick(rng)?),
        25..33 => Fault::KillWorkspaceSupervisor(workspace_name(
            rng.below(cfg.workspaces as u64) as usize
        )),
        33..55 => Fault::DriverFaultsOn {
            seed: rng.next_u64(),
            latency_ms: rng.below(20),
            jitter_ms: rng.below(30),
            error_rate: 0.05 * rng.below(4) as f64,
            hang_rate: 0.02 * rng.below(3) as f64,
            lost_reply_rate: 0.03 * rng.below(3) as f64,
        },
        55..70 => Fault::DriverFaultsOff {
            seed: rng.next_u64(),
        },
        70..75 => Fault::ForgetGenerations,
        75..79 => {
            let id = pick(rng)?;
            Fault::SetGeneration {
                id,
                generation: rng.below(1000),
            }
        }
        79..82 => Fault::LoseAllState,
        82..90 => {
            let id = pick(rng)?;
            Fault::WorkloadExits {
                id,
                code: rng.below(3) as i32,
            }
        }
        90..95 if cfg.gateway_restarts => Fault::GatewayRestart,
        _ => return None,
    })
}

/// Applies one fault; acknowledged when it took effect (a kill needs a live actor, an exit a
/// running workload).
pub(super) async fn apply_fault(h: &Harness, fault: &Fault) -> Answer {
    let gw = gw_of(h).await;
    let kind = match fault {
        Fault::KillSandboxActor(id) => match gw.sandbox_actor(*id).await {
            Ok(Some(actor)) => {
                actor.kill();
                Some("kill_sandbox_actor")
            }
            _ => None,
        },
        Fault::KillWorkspaceSupervisor(ws) => {
            match gw.get_workspace(&WorkspaceSelector::Name(ws.clone())).await {
                Ok(w) => match Uuid::parse_str(&w.id) {
                    Ok(id) => match gw.workspace_supervisor(id).await {
                        Ok(Some(sup)) => {
                            sup.kill();
                            Some("kill_workspace_supervisor")
                        }
                        _ => None,
                    },
                    Err(_) => None,
                },
                Err(_) => None,
            }
        }
        Fault::DriverFaultsOn {
            seed,
            latency_ms,
            jitter_ms,
            error_rate,
            hang_rate,
            lost_reply_rate,
        } => {
            h.faults.set_faults(
                SimFaults::seeded(*seed)
                    .with_latency(Duration::from_millis(*latency_ms))
                    .with_jitter(Duration::from_millis(*jitter_ms))
                    .with_error_rate(*error_rate)
                    .with_hang_rate(*hang_rate)
                    .with_lost_reply_rate(*lost_reply_rate),
            );
            Some("driver_faults_on")
        }
        Fault::DriverFaultsOff { seed } => {
            h.faults.set_faults(SimFaults::seeded(*seed));
            Some("driver_faults_off")
        }
        Fault::ForgetGenerations => {
            h.world.crash_forget_generations();
            Some("driver_forgets_generations")
        }
        Fault::SetGeneration { id, generation } => h
            .world
            .set_generation(*id, *generation)
            .then_some("generation_changed_by_hand"),
        Fault::LoseAllState => {
            h.world.crash_lose_all();
            Some("driver_loses_all_state")
        }
        Fault::WorkloadExits { id, code } => h
            .world
            .exit(*id, *code)
            .is_some()
            .then_some("workload_exits"),
        Fault::GatewayRestart => {
            drop(gw);
            let mut slot = h.gateway.write().await;
            slot.shutdown().await;
            match start_gateway(&h.store, &h.driver, &h.secrets).await {
                Ok(gw) => *slot = Arc::new(gw),
                Err(e) => panic!(
                    "chaos seed {}: the gateway did not restart: {e}",
                    h.cfg.seed
                ),
            }
            drop(slot);
            h.report
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .gateway_restarts += 1;
            Some("gateway_restart")
        }
    };
    if let Some(kind) = kind {
        count_fault(h, kind);
    }
    Answer {
        acknowledged: kind.is_some(),
        ..Answer::default()
    }
}
