//! The fault injector of the in-process scenario: one seeded fault every few tens of
//! milliseconds (actor and supervisor kills, gateway restarts, sim-driver faults) until told
//! to stop.

use super::*;

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
        let gw = gw_of(&h).await;
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
        let pick = |rng: &mut Rng| {
            (!known.is_empty()).then(|| known[rng.below(known.len() as u64) as usize])
        };
        match rng.below(100) {
            0..25 => {
                if let Some(id) = pick(&mut rng)
                    && let Ok(Some(actor)) = gw.sandbox_actor(id).await
                {
                    actor.kill();
                    count_fault(&h, "kill_sandbox_actor");
                }
            }
            25..33 => {
                let ws = workspace_name(rng.below(h.cfg.workspaces as u64) as usize);
                if let Ok(w) = gw.get_workspace(&WorkspaceSelector::Name(ws)).await
                    && let Ok(id) = Uuid::parse_str(&w.id)
                    && let Ok(Some(sup)) = gw.workspace_supervisor(id).await
                {
                    sup.kill();
                    count_fault(&h, "kill_workspace_supervisor");
                }
            }
            33..55 => {
                let faults = SimFaults::seeded(rng.next_u64())
                    .with_latency(Duration::from_millis(rng.below(20)))
                    .with_jitter(Duration::from_millis(rng.below(30)))
                    .with_error_rate(0.05 * rng.below(4) as f64)
                    .with_hang_rate(0.02 * rng.below(3) as f64)
                    .with_lost_reply_rate(0.03 * rng.below(3) as f64);
                h.faults.set_faults(faults);
                count_fault(&h, "driver_faults_on");
            }
            55..70 => {
                h.faults.set_faults(SimFaults::seeded(rng.next_u64()));
                count_fault(&h, "driver_faults_off");
            }
            70..75 => {
                h.world.crash_forget_generations();
                count_fault(&h, "driver_forgets_generations");
            }
            75..79 => {
                if let Some(id) = pick(&mut rng)
                    && h.world.set_generation(id, rng.below(1000))
                {
                    count_fault(&h, "generation_changed_by_hand");
                }
            }
            79..82 => {
                h.world.crash_lose_all();
                count_fault(&h, "driver_loses_all_state");
            }
            82..90 => {
                if let Some(id) = pick(&mut rng)
                    && h.world.exit(id, rng.below(3) as i32).is_some()
                {
                    count_fault(&h, "workload_exits");
                }
            }
            90..95 if h.cfg.gateway_restarts => {
                let mut slot = h.gateway.write().await;
                slot.shutdown().await;
                match start_gateway(&h.store, &h.driver).await {
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
                count_fault(&h, "gateway_restart");
            }
            _ => {}
        }
    }
}
