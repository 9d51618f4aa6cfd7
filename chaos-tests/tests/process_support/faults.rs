//! The faults of a process chaos run, all seeded: SIGKILL of the managed driver process;
//! SIGKILL of sbxd followed by a start on the same data dir; and that SIGKILL timed the
//! moment a create is acknowledged, with the created sandbox asked for right after; and the
//! data dir's disk full for a while. Also the closing kill of both,
//! after which every Ready sandbox must be Ready again on the very same workload process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_chaos_tests::rng::Rng;
use sbx_proto::v1::{CreateSandboxRequest, GetSandboxRequest, Sandbox};
use tonic::Code;

use super::checks::quiesce;
use super::client::{PROBE_WORKSPACE, bounded, by_id, clients, spec};
use super::{Daemon, managed_driver, ready_workloads, runs, same_workloads_ready};
use crate::{Run, lock};

pub fn count_fault(run: &Run, kind: &'static str) {
    *lock(&run.report).faults.entry(kind).or_default() += 1;
}

/// SIGKILLs sbxd and starts it again on the same data dir; clients move to the new address.
/// Answers when the SIGKILL was sent.
pub async fn restart_sbxd(run: &Run) -> Result<Instant, String> {
    let mut daemon = run.daemon.write().await;
    let killed = Instant::now();
    daemon.sigkill();
    let n = {
        let mut starts = lock(&run.starts);
        *starts += 1;
        *starts
    };
    let (sbxd, data, parent) = (
        run.sbxd.clone(),
        run.data.clone(),
        run.cgroup_parent.clone(),
    );
    let fresh = tokio::task::spawn_blocking(move || Daemon::start(&sbxd, &data, &parent, n))
        .await
        .map_err(|e| e.to_string())??;
    *run.endpoint.write().unwrap_or_else(|p| p.into_inner()) = fresh.endpoint();
    *daemon = fresh;
    Ok(killed)
}

/// What the injector SIGKILLs, and when: the driver, or sbxd (restarted at once) at a random
/// moment or just after a create is acknowledged.
#[derive(Debug, Clone, Copy)]
enum Sigkill {
    Driver,
    Sbxd,
    SbxdJustAfterCreateAck,
    /// Not a kill: the data dir's disk full for a while (see `disk.rs`).
    DiskFull,
}

/// Faults until `until`: the first three are one of each kind (in seeded order), then seeded.
pub async fn inject_faults(run: Arc<Run>, until: Instant) -> Result<(), String> {
    let mut rng = Rng::new(run.seed ^ 0xFA17);
    let mut first = [
        Sigkill::Driver,
        Sigkill::Sbxd,
        Sigkill::SbxdJustAfterCreateAck,
        Sigkill::DiskFull,
    ];
    for i in (1..first.len()).rev() {
        first.swap(i, rng.below(i as u64 + 1) as usize);
    }
    for i in 0..100usize {
        tokio::time::sleep(Duration::from_millis(1_000 + rng.below(1_500))).await;
        if Instant::now() >= until {
            break;
        }
        let fault = match first.get(i) {
            Some(fault) => *fault,
            None => first[rng.below(first.len() as u64) as usize],
        };
        match fault {
            Sigkill::Driver => {
                if let Some((pid, start)) = managed_driver(&run.data)
                    && runs(pid, start)
                {
                    kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(|e| e.to_string())?;
                    count_fault(&run, "sigkill_driver");
                }
            }
            Sigkill::Sbxd => {
                restart_sbxd(&run).await?;
                count_fault(&run, "sigkill_sbxd_and_restart");
            }
            Sigkill::SbxdJustAfterCreateAck => {
                if kill_sbxd_just_after_create_ack(&run, i).await? {
                    count_fault(&run, "sigkill_sbxd_just_after_create_ack");
                }
            }
            Sigkill::DiskFull => {
                if super::disk::fill_for_a_while(&run.data).await? > 0 {
                    count_fault(&run, "disk_full_for_a_while");
                }
            }
        }
    }
    Ok(())
}

/// Creates sandbox `probe-N` in the probe workspace (no client names it or deletes that
/// workspace), SIGKILLs sbxd the moment the create is acknowledged, starts sbxd again and
/// asks for the sandbox by id: an acknowledged create must have been durable before its
/// acknowledgement, however soon the kill follows. `Ok(false)` when the create was refused
/// (no fault injected). Afterwards the probe joins the ledger like any acknowledged create.
async fn kill_sbxd_just_after_create_ack(run: &Run, n: usize) -> Result<bool, String> {
    let (mut sb, _) = clients(run)?;
    let name = format!("probe-{n}");
    let created = match bounded(sb.create_sandbox(CreateSandboxRequest {
        providers: Default::default(),
        workspace: PROBE_WORKSPACE.into(),
        name: name.clone(),
        spec: spec(),
        stopped: false,
    }))
    .await
    {
        Ok(created) => created,
        Err(_) => return Ok(false),
    };
    let acked = Instant::now();
    // Nothing between the answer and the kill but an uncontended lock (only the closing
    // clean-up and this injector take the daemon's write lock).
    let killed_after = restart_sbxd(run).await?.duration_since(acked);
    let id = created.id;
    let (mut sb, _) = clients(run)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match bounded(sb.get_sandbox(GetSandboxRequest {
            sandbox: by_id(&id),
        }))
        .await
        {
            Ok(_) => break,
            Err(status) if status.code() == Code::NotFound => {
                return Err(format!(
                    "sandbox {PROBE_WORKSPACE}/{name} ({id}), acknowledged and then sbxd SIGKILLed \
                     {killed_after:?} after the acknowledgement, is gone after the restart \
                     ({:.1?} into the run): the create was acknowledged before it was durable",
                    run.began.elapsed()
                ));
            }
            Err(status) if Instant::now() >= deadline => {
                return Err(format!(
                    "could not ask sbxd for probe {id} within 30 s of its restart: {status:?}"
                ));
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let mut ledger = lock(&run.ledger);
    ledger.created_sent.insert(id.clone(), acked);
    ledger.created.insert(id, (PROBE_WORKSPACE.into(), name));
    drop(ledger);
    lock(&run.report).creates_acknowledged += 1;
    Ok(true)
}

/// Once settled, SIGKILL the driver and then sbxd, start sbxd again: every Ready sandbox is
/// Ready again on the very same workload process (re-attached, not restarted).
pub async fn workloads_survive_both_kills(run: &Run, settled: &[Sandbox]) -> Result<u64, String> {
    let before = ready_workloads(&run.data, settled);
    if let Some((pid, start)) = managed_driver(&run.data)
        && runs(pid, start)
    {
        kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(|e| e.to_string())?;
        count_fault(run, "closing_sigkill_driver");
    }
    restart_sbxd(run).await?;
    count_fault(run, "closing_sigkill_sbxd_and_restart");
    let after = quiesce(run).await?;
    same_workloads_ready(&run.data, &before, &after, "SIGKILL of the driver and sbxd")
}
