//! The end of a process chaos run: wait until every sandbox has settled, check the
//! invariants against the API, the driver's state and the host (processes, cgroups, mounts),
//! then delete everything and check that nothing is left.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use sbx_proto::v1::{
    DeleteWorkspaceRequest, DesiredState, ListSandboxesRequest, ListWorkspacesRequest, Phase,
    Sandbox, WorkspaceRef,
};

use super::client::{bounded, clients};
use super::{cgroups_under, managed_driver, mounts_under, runs, workloads_by_sandbox};
use crate::{QUIESCE, Run, lock};

/// How long past its latest possible deadline a sandbox may still exist when the checks run
/// (its delete was under way, or the deadline came during the last restart).
const TTL_SLACK: Duration = Duration::from_secs(15);

pub async fn all_sandboxes(run: &Run) -> Result<Vec<Sandbox>, String> {
    let (mut sb, _) = clients(run)?;
    let mut out = Vec::new();
    let mut token = String::new();
    for _ in 0..100 {
        let page = bounded(sb.list_sandboxes(ListSandboxesRequest {
            all_workspaces: true,
            page_size: 500,
            page_token: token.clone(),
            ..Default::default()
        }))
        .await
        .map_err(|e| format!("list sandboxes: {e:?}"))?;
        out.extend(page.sandboxes);
        if page.next_page_token.is_empty() {
            return Ok(out);
        }
        token = page.next_page_token;
    }
    Err("more than 100 pages of sandboxes".into())
}

/// Sandboxes not where their desired state says (Ready with one live workload, or stopped
/// with none), with why.
fn unsettled(data: &Path, sandboxes: &[Sandbox]) -> Vec<String> {
    let pids: HashMap<String, Vec<i32>> = workloads_by_sandbox(data).into_iter().collect();
    let mut out = Vec::new();
    for s in sandboxes {
        let live = pids.get(&s.id).map_or(0, Vec::len);
        let ok = match s.desired_state() {
            DesiredState::Running | DesiredState::Unspecified => {
                s.phase() == Phase::Ready && live == 1
            }
            DesiredState::Stopped => {
                matches!(s.phase(), Phase::Stopped | Phase::Completed | Phase::Error)
                    && !(s.phase() == Phase::Error && s.reason.starts_with("Driver"))
                    && live == 0
            }
            // Paused: saved, nothing of it runs.
            DesiredState::Paused => s.phase() == Phase::Paused && live == 0,
            DesiredState::Deleted => false,
        };
        // A deadline still ahead is not settled either: a ttl would stop or delete the sandbox
        // in the middle of the checks (the round's ttls are seconds long, so this ends).
        if !ok || s.next.is_some() {
            out.push(format!(
                "{}/{} {} desired {:?} phase {:?} ({}: {}) workloads {live} next {:?}",
                s.workspace,
                s.name,
                s.id,
                s.desired_state(),
                s.phase(),
                s.reason,
                s.message,
                s.next
            ));
        }
    }
    out
}

pub async fn quiesce(run: &Run) -> Result<Vec<Sandbox>, String> {
    let deadline = Instant::now() + QUIESCE;
    loop {
        let last = match all_sandboxes(run).await {
            Ok(sandboxes) => {
                let bad = unsettled(&run.data, &sandboxes);
                if bad.is_empty() {
                    return Ok(sandboxes);
                }
                format!("{bad:#?}")
            }
            Err(e) => e,
        };
        if Instant::now() >= deadline {
            return Err(format!(
                "not settled {QUIESCE:?} after the faults stopped: {last}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub async fn check_invariants(run: &Run, sandboxes: &[Sandbox]) -> Result<u64, String> {
    let mut checks = 0u64;
    let (_, mut ws_client) = clients(run)?;
    let workspaces = bounded(ws_client.list_workspaces(ListWorkspacesRequest {
        page_size: 1000,
        ..Default::default()
    }))
    .await
    .map_err(|e| format!("list workspaces: {e:?}"))?
    .workspaces;
    let ws_ids: HashSet<&str> = workspaces.iter().map(|w| w.id.as_str()).collect();
    let ids: HashSet<&str> = sandboxes.iter().map(|s| s.id.as_str()).collect();
    let ledger = lock(&run.ledger);
    lock(&run.report).ttls_given = ledger.ttl_asks.len();
    // 1. Every acknowledged create exists, unless a delete that could cover it was asked for.
    for (id, (ws, name)) in &ledger.created {
        checks += 1;
        // A delete by name or of the workspace covers it only if it was answered after the
        // create was sent (before that, this sandbox did not exist to be resolved).
        let sent = ledger.created_sent.get(id).copied();
        let after = |answered: &Instant| sent.is_none_or(|sent| *answered > sent);
        let excused = ledger.deleted_ids.contains(id)
            || ledger.delete_requested_ids.contains(id)
            || ledger
                .delete_requested_names
                .iter()
                .any(|(key, answered)| key.0 == *ws && key.1 == *name && after(answered))
            || ledger
                .delete_requested_workspaces
                .iter()
                .any(|(w, answered)| w == ws && after(answered));
        let now = Instant::now();
        let asks: Vec<_> = ledger
            .ttl_asks_of(id, ws, name, sent)
            .filter(|a| a.deletes)
            .collect();
        if !ids.contains(id.as_str()) && asks.iter().any(|a| a.not_before <= now) {
            lock(&run.report).gone_with_ttl_due += 1;
        }
        if !ids.contains(id.as_str()) && !excused {
            // Gone by a ttl: only once its deadline could have come.
            checks += 1;
            if asks.is_empty() {
                return Err(format!(
                    "acknowledged sandbox {ws}/{name} ({id}) is gone and nobody deleted it"
                ));
            }
            if asks.iter().all(|a| a.not_before > now) {
                return Err(format!(
                    "sandbox {ws}/{name} ({id}) is gone before any deadline it was given: {asks:?}"
                ));
            }
        }
        // A ttl that deletes, given at create and never moved, whose deadline passed well
        // before now (sbxd SIGKILLed or not), has deleted its sandbox: a deadline is never lost.
        checks += 1;
        if ids.contains(id.as_str())
            && asks.len() == 1
            && asks[0].target.as_ref().is_ok_and(|t| t == id)
            && asks[0].not_after.is_some_and(|by| by + TTL_SLACK < now)
        {
            return Err(format!(
                "sandbox {ws}/{name} ({id}) outlived its ttl by more than {TTL_SLACK:?}: {:?}",
                asks[0]
            ));
        }
    }
    // 2. No sandbox in a deleted workspace; no two live sandboxes share (workspace, name).
    let mut names = HashSet::new();
    for s in sandboxes {
        checks += 2;
        if !ws_ids.contains(s.workspace_id.as_str()) {
            return Err(format!(
                "sandbox {}/{} ({}) is in a deleted workspace {}",
                s.workspace, s.name, s.id, s.workspace_id
            ));
        }
        if !names.insert((s.workspace_id.clone(), s.name.clone())) {
            return Err(format!(
                "two live sandboxes are named {}/{}",
                s.workspace, s.name
            ));
        }
    }
    // 3. Ready ⇒ exactly one live workload; every live workload belongs to a record.
    let pids: HashMap<String, Vec<i32>> = workloads_by_sandbox(&run.data).into_iter().collect();
    for s in sandboxes {
        checks += 1;
        let live = pids.get(&s.id).map_or(0, Vec::len);
        if s.phase() == Phase::Ready && live != 1 {
            return Err(format!("{} is Ready with {live} live workloads", s.id));
        }
    }
    for (id, live) in &pids {
        checks += 1;
        if !live.is_empty() && !ids.contains(id.as_str()) {
            return Err(format!("workload {live:?} of {id} runs without a record"));
        }
    }
    // 4. No process runs in a sandbox cgroup (under the run's own parent) without a record.
    for dir in cgroups_under(&run.cgroup_parent) {
        checks += 1;
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let leaf = dir
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        if !procs.trim().is_empty() && !ids.iter().any(|id| leaf.contains(id)) {
            return Err(format!(
                "processes {:?} run in cgroup {} of no sandbox",
                procs.split_whitespace().collect::<Vec<_>>(),
                dir.display()
            ));
        }
    }
    Ok(checks)
}

/// Removes the ttl deadline of every sandbox that has one (a ttl call of 0), so that the
/// checks after this one find sandboxes as they left them.
pub async fn clear_ttls(run: &Run, sandboxes: &[Sandbox]) -> Result<u64, String> {
    let (mut sb, _) = clients(run)?;
    let mut cleared = 0;
    for s in sandboxes.iter().filter(|s| s.expires_at.is_some()) {
        let r = bounded(sb.set_sandbox_ttl(sbx_proto::v1::SetSandboxTtlRequest {
            sandbox: super::client::by_id(&s.id),
            ttl_seconds: 0,
        }))
        .await;
        match r {
            Ok(_) => cleared += 1,
            // Deleted by its ttl meanwhile.
            Err(e) if e.code() == tonic::Code::NotFound => {}
            Err(e) => return Err(format!("clearing the ttl of {}: {e:?}", s.id)),
        }
    }
    Ok(cleared)
}

/// Deletes every workspace (cascade) and checks that nothing is left: no workload, no cgroup
/// under the run's parent, no mount under the data dir; then stops sbxd and its driver.
pub async fn delete_everything(run: &Run) -> Result<u64, String> {
    let (_, mut ws_client) = clients(run)?;
    let workspaces = bounded(ws_client.list_workspaces(ListWorkspacesRequest {
        page_size: 1000,
        ..Default::default()
    }))
    .await
    .map_err(|e| format!("list workspaces: {e:?}"))?
    .workspaces;
    // The default workspace cannot be deleted; no client makes sandboxes in it.
    for w in workspaces.into_iter().filter(|w| w.name != "default") {
        bounded(ws_client.delete_workspace(DeleteWorkspaceRequest {
            workspace: Some(WorkspaceRef {
                id: w.id.clone(),
                ..Default::default()
            }),
            cascade: true,
        }))
        .await
        .map_err(|e| format!("delete workspace {}: {e:?}", w.name))?;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let sandboxes = all_sandboxes(run).await?;
        let workloads: Vec<_> = workloads_by_sandbox(&run.data)
            .into_iter()
            .filter(|(_, p)| !p.is_empty())
            .collect();
        let cgroups = cgroups_under(&run.cgroup_parent);
        let mounts = mounts_under(&run.data);
        if sandboxes.is_empty() && workloads.is_empty() && cgroups.is_empty() && mounts.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "left after deleting everything: {} sandboxes, workloads {workloads:?}, \
                 cgroups {cgroups:?}, mounts {mounts:?}",
                sandboxes.len()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let driver = managed_driver(&run.data);
    let mut daemon = run.daemon.write().await;
    if !daemon.sigterm(Duration::from_secs(20)) {
        return Err(format!(
            "sbxd did not exit within 20 s of SIGTERM; log {}",
            daemon.log.display()
        ));
    }
    if let Some((pid, start)) = driver {
        let began = Instant::now();
        while runs(pid, start) {
            if began.elapsed() > Duration::from_secs(10) {
                return Err(format!("the managed driver {pid} outlived sbxd's SIGTERM"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    Ok(4)
}
