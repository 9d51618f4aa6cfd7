//! Quiescing the in-process scenario and checking its invariants against the ledger, the
//! store and the simulated machine.

use super::*;

/// Lifts every fault and waits until each sandbox has settled where it should.
pub(super) async fn quiesce(h: &Harness) -> Result<(), String> {
    h.faults.set_faults(SimFaults::seeded(h.cfg.seed));
    let gw = gw_of(h).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let _ = gw.reconcile_now().await;
        let unsettled = unsettled(h).await?;
        if unsettled.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "sandboxes did not settle after the faults stopped: {unsettled:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sandboxes that are not where their desired state says, with why.
async fn unsettled(h: &Harness) -> Result<Vec<String>, String> {
    let records = h
        .store
        .list(ListQuery::new(Kind::Sandbox, Scope::All, 0))
        .await
        .map_err(|e| e.to_string())?
        .records;
    let mut out = Vec::new();
    for record in records {
        let sb = decode(&record)?;
        // Ready means the driver runs it under the recorded generation; a mismatch is only
        // settled once the actor has reconciled it.
        let agrees = h
            .world
            .snapshot(record.id)
            .is_some_and(|s| s.state() == pb::State::Running && s.generation == sb.generation);
        let ok = match sb.desired_state() {
            DesiredState::Running | DesiredState::Unspecified => {
                sb.phase() == Phase::Ready && agrees
            }
            DesiredState::Stopped => {
                matches!(sb.phase(), Phase::Stopped | Phase::Completed | Phase::Error)
                    && !(sb.phase() == Phase::Error && sb.reason.starts_with("Driver"))
            }
            // Paused: the driver holds the saved workload under the recorded generation.
            DesiredState::Paused => {
                sb.phase() == Phase::Paused
                    && h.world.snapshot(record.id).is_some_and(|s| {
                        s.state() == pb::State::Paused && s.generation == sb.generation
                    })
            }
            DesiredState::Deleted => false,
        };
        // A ttl still ahead is not settled either: it would stop, pause or delete the sandbox
        // in the middle of the checks (the round's ttls are seconds long, so this ends).
        let due = sbx_actors::lifetime::next(&sb, None);
        if !ok || due.is_some() {
            out.push(format!(
                "{}/{} {} desired {:?} phase {:?} ({}: {}){}",
                sb.workspace,
                sb.name,
                sb.id,
                sb.desired_state(),
                sb.phase(),
                sb.reason,
                sb.message,
                due.map(|d| format!(", {:?} due by {:?}", d.action, d.why))
                    .unwrap_or_default()
            ));
        }
    }
    Ok(out)
}

fn decode(record: &sbx_storage::Record) -> Result<Sandbox, String> {
    let mut sb =
        <Sandbox as prost::Message>::decode(record.body.as_slice()).map_err(|e| e.to_string())?;
    sb.id = record.id.to_string();
    sb.name = record.name.clone();
    Ok(sb)
}

/// What the store holds at the check, read once.
struct Stored {
    records: Vec<sbx_storage::Record>,
    ws_ids: HashSet<Uuid>,
    ws_names: HashMap<Uuid, String>,
    ids: HashSet<Uuid>,
    provider_records: Vec<sbx_storage::Record>,
    owned_records: Vec<(Kind, Vec<sbx_storage::Record>)>,
}

/// What the checks of the driver's destructive calls counted.
#[derive(Default)]
struct CallCounts {
    checks: u64,
    /// Stops and deletes only a due ttl explains.
    by_ttl: u64,
    /// Calls that could not have hit a workload (none of that id existed in the driver).
    unverified: u64,
    removed: u64,
}

/// The invariants (docs/SPECIFICATION.md), one step each, checked in the order they always
/// were (1, 2, 3, 4, 6, 5); the first broken one is the answer. What was checked is added to
/// the report.
pub(super) async fn check_invariants(h: &Harness) -> Result<(), String> {
    // The store is read with no event write under way (events are written a moment after
    // the changes they tell of, by tasks of their own).
    let gateway = h.gateway.read().await.clone();
    if !gateway
        .events_written(std::time::Duration::from_secs(10))
        .await
    {
        return Err("event writes still under way after 10 s".into());
    }
    let stored = read_store(h).await?;
    let ledger = h.ledger.lock().unwrap_or_else(|p| p.into_inner());
    let mut checks = acknowledged_creates_exist(&ledger, &stored.ids)?;
    let calls = destructive_calls_asked(h, &ledger)?;
    checks += calls.checks;
    checks += names_unique_in_live_workspaces(&stored)?;
    let (agreed, paused_checked) = store_agrees_with_driver(h, &stored)?;
    checks += agreed;
    checks += owned_objects_live(&stored)?;
    // 5. The store's indexes agree with its records.
    checks += 1;
    let problems = h.store.verify_indexes().map_err(|e| e.to_string())?;
    if !problems.is_empty() {
        return Err(format!(
            "the store's indexes disagree with its records: {problems:?}"
        ));
    }
    drop(ledger);
    let mut report = h.report.lock().unwrap_or_else(|p| p.into_inner());
    report.invariant_checks += checks;
    report.calls_by_ttl += calls.by_ttl;
    report.paused_checked += paused_checked;
    report.unverified_calls += calls.unverified;
    report.removals_checked += calls.removed;
    report.removal_observer_lagged += h.removals.lagged();
    Ok(())
}

/// Every sandbox, workspace, provider and owned record in the store.
async fn read_store(h: &Harness) -> Result<Stored, String> {
    let list_all = |kind| {
        let store = &h.store;
        async move {
            store
                .list(ListQuery::new(kind, Scope::All, 0))
                .await
                .map(|p| p.records)
                .map_err(|e| e.to_string())
        }
    };
    let records = list_all(Kind::Sandbox).await?;
    let workspaces = list_all(Kind::Workspace).await?;
    let ws_ids: HashSet<Uuid> = workspaces.iter().map(|w| w.id).collect();
    let ws_names: HashMap<Uuid, String> =
        workspaces.iter().map(|w| (w.id, w.name.clone())).collect();
    let ids: HashSet<Uuid> = records.iter().map(|r| r.id).collect();
    let provider_records = list_all(Kind::Provider).await?;
    let mut owned_records = Vec::new();
    for kind in [Kind::Setting, Kind::Attachment, Kind::Service] {
        owned_records.push((kind, list_all(kind).await?));
    }
    Ok(Stored {
        records,
        ws_ids,
        ws_names,
        ids,
        provider_records,
        owned_records,
    })
}

/// 1. Every acknowledged create exists, unless a delete that could cover it was asked for.
fn acknowledged_creates_exist(ledger: &Ledger, ids: &HashSet<Uuid>) -> Result<u64, String> {
    let mut checks = 0;
    for (id, (ws, name)) in &ledger.created {
        checks += 1;
        if !ids.contains(id) && !ledger.delete_asked(*id, ws, name) {
            return Err(format!(
                "acknowledged sandbox {ws}/{name} ({id}) is gone and nobody deleted it"
            ));
        }
    }
    Ok(checks)
}

/// 2. Every stop and delete the driver received hit a sandbox that a client had asked, by
///    then, to stop or delete — by id, by its own (workspace, name), or by its workspace.
fn destructive_calls_asked(h: &Harness, ledger: &Ledger) -> Result<CallCounts, String> {
    // Taken before the calls: every removal observed has its delete call in the later copy.
    let removed = h.removals.removed();
    let placements = h
        .recording
        .placements
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let calls = h
        .recording
        .destructive
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut counts = CallCounts {
        removed: removed.len() as u64,
        ..CallCounts::default()
    };
    // 2a. The machine removed a workload only on a delete naming that very id (once per call).
    counts.checks += removed.len() as u64;
    if let Some((id, times, asked)) = unasked_removals(&removed, &calls).first() {
        let at = placements
            .get(id)
            .map(|p| format!("{}/{}", p.workspace, p.name))
            .unwrap_or_default();
        return Err(format!(
            "the driver removed sandbox {at} ({id}) {times} times but was asked to delete that id \
             {asked} times: a delete hit a sandbox nobody named"
        ));
    }
    for call in calls {
        counts.checks += 1;
        let Ok(id) = Uuid::parse_str(&call.sandbox_id) else {
            return Err(format!(
                "a driver call carried a malformed sandbox id: {call:?}"
            ));
        };
        let Some(placed) = placements.get(&call.sandbox_id) else {
            // Never created in the driver: the call could not have hit a workload.
            counts.unverified += 1;
            continue;
        };
        if call.seq < placed.created_at {
            // Before the driver's first create of this id: no workload of it existed to hit.
            // (A stop by name reaches a sandbox from its record's write, which comes before
            // the driver's create: the name rightly resolved, and the stop found nothing.)
            counts.unverified += 1;
            continue;
        }
        if !ledger.explains(
            call.op,
            id,
            &placed.workspace,
            &placed.name,
            placed.created_at,
            call.seq,
        ) {
            if ledger.ttl_explains(call.op, id, &placed.workspace, &placed.name, call.at) {
                counts.by_ttl += 1;
                continue;
            }
            return Err(format!(
                "the driver was asked to {:?} sandbox {}/{} ({id}) at call {} ({:?}), and no client had asked for that \
                 (first created in the driver at call {}; requests naming it: {}; ttls: {})",
                call.op,
                placed.workspace,
                placed.name,
                call.seq,
                call.at,
                placed.created_at,
                ledger.naming(id, &placed.workspace, &placed.name),
                ledger.ttls_naming(id, &placed.workspace, &placed.name)
            ));
        }
    }
    Ok(counts)
}

/// 3. No sandbox in a deleted workspace; no two live sandboxes share (workspace, name).
fn names_unique_in_live_workspaces(stored: &Stored) -> Result<u64, String> {
    let mut checks = 0;
    let mut names = HashSet::new();
    for record in &stored.records {
        checks += 2;
        let ws = record
            .workspace
            .ok_or("a sandbox record has no workspace")?;
        if !stored.ws_ids.contains(&ws) {
            return Err(format!(
                "sandbox {} ({}) is in a deleted workspace {ws}",
                record.name, record.id
            ));
        }
        if !names.insert((ws, record.name.clone())) {
            return Err(format!(
                "two live sandboxes are named {}/{}",
                stored.ws_names[&ws], record.name
            ));
        }
    }
    Ok(checks)
}

/// 4. The store and the driver agree, by id; nothing runs without a record. Answers the
///    checks made and the Paused records checked against the driver.
fn store_agrees_with_driver(h: &Harness, stored: &Stored) -> Result<(u64, u64), String> {
    let (mut checks, mut paused_checked) = (0, 0);
    for record in &stored.records {
        checks += 1;
        let sb = decode(record)?;
        let snap = h.world.snapshot(record.id);
        if sb.phase() == Phase::Ready {
            match &snap {
                Some(s) if s.state() == pb::State::Running && s.generation == sb.generation => {}
                other => {
                    return Err(format!(
                        "{} is Ready at generation {} but the driver has {other:?}",
                        record.id, sb.generation
                    ));
                }
            }
        }
        if sb.phase() == Phase::Stopped
            && snap
                .as_ref()
                .is_some_and(|s| s.state() == pb::State::Running)
        {
            return Err(format!("{} is Stopped but its workload runs", record.id));
        }
        // A paused sandbox is never lost: the driver holds its saved workload, of its run.
        if sb.phase() == Phase::Paused {
            checks += 1;
            paused_checked += 1;
            match &snap {
                Some(s) if s.state() == pb::State::Paused && s.generation == sb.generation => {}
                other => {
                    return Err(format!(
                        "{} is Paused at generation {} but the driver has {other:?}",
                        record.id, sb.generation
                    ));
                }
            }
        }
    }
    for running in h.world.running_ids() {
        checks += 1;
        if !stored.ids.contains(&running) {
            return Err(format!("workload {running} runs without a record (leaked)"));
        }
    }
    Ok((checks, paused_checked))
}

/// 6. What hangs off a sandbox or a workspace: every setting, attachment and service
///    endpoint is owned by a live sandbox of its own workspace, every attachment refers to a
///    live provider of that workspace, every provider is in a live workspace.
fn owned_objects_live(stored: &Stored) -> Result<u64, String> {
    let mut checks = 0;
    let by_id: HashMap<Uuid, &sbx_storage::Record> =
        stored.records.iter().map(|r| (r.id, r)).collect();
    let mut providers = HashMap::new();
    for p in &stored.provider_records {
        checks += 1;
        let ws = p.workspace.unwrap_or_default();
        if !stored.ws_ids.contains(&ws) {
            return Err(format!(
                "provider {} ({}) is in a deleted workspace {ws}",
                p.name, p.id
            ));
        }
        providers.insert(p.id, p);
    }
    for (kind, owned) in &stored.owned_records {
        for r in owned {
            checks += 1;
            let owner = r.owner.and_then(|o| by_id.get(&o));
            if owner.is_none_or(|o| o.workspace != r.workspace) {
                return Err(format!(
                    "{kind} {} ({}) is an orphan: its owner {:?} is no live sandbox of its workspace",
                    r.name, r.id, r.owner
                ));
            }
            if *kind == Kind::Attachment {
                checks += 1;
                let target = r.refs.first().and_then(|p| providers.get(p));
                if target.is_none_or(|p| p.workspace != r.workspace) {
                    return Err(format!(
                        "attachment {} of sandbox {:?} refers to a provider that is gone: {:?}",
                        r.id, r.owner, r.refs
                    ));
                }
            }
        }
    }
    Ok(checks)
}
