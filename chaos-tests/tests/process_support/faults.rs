//! The faults of a process chaos run, all seeded: SIGKILL of the managed driver process, and
//! SIGKILL of sbxd followed by a start on the same data dir. Also the closing kill of both,
//! after which every Ready sandbox must be Ready again on the very same workload process.

use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use sbx_chaos_tests::rng::Rng;
use sbx_proto::v1::{Phase, Sandbox};

use super::checks::quiesce;
use super::{Daemon, managed_driver, runs, workload_pids};
use crate::{Run, lock};

pub fn count_fault(run: &Run, kind: &'static str) {
    *lock(&run.report).faults.entry(kind).or_default() += 1;
}

/// SIGKILLs sbxd and starts it again on the same data dir; clients move to the new address.
pub async fn restart_sbxd(run: &Run) -> Result<(), String> {
    let mut daemon = run.daemon.write().await;
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
    Ok(())
}

/// Faults until `until`: the first two are one of each kind (in seeded order), then seeded.
pub async fn inject_faults(run: Arc<Run>, until: Instant) -> Result<(), String> {
    let mut rng = Rng::new(run.seed ^ 0xFA17);
    let first_kill_driver = rng.chance(0.5);
    for i in 0..100u32 {
        tokio::time::sleep(Duration::from_millis(1_000 + rng.below(1_500))).await;
        if Instant::now() >= until {
            break;
        }
        let kill_driver = match i {
            0 => first_kill_driver,
            1 => !first_kill_driver,
            _ => rng.chance(0.5),
        };
        if kill_driver {
            if let Some((pid, start)) = managed_driver(&run.data)
                && runs(pid, start)
            {
                kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(|e| e.to_string())?;
                count_fault(&run, "sigkill_driver");
            }
        } else {
            restart_sbxd(&run).await?;
            count_fault(&run, "sigkill_sbxd_and_restart");
        }
    }
    Ok(())
}

/// Once settled, SIGKILL the driver and then sbxd, start sbxd again: every Ready sandbox is
/// Ready again on the very same workload process (re-attached, not restarted).
pub async fn workloads_survive_both_kills(run: &Run, settled: &[Sandbox]) -> Result<u64, String> {
    let before: Vec<(String, Vec<i32>)> = settled
        .iter()
        .filter(|s| s.phase() == Phase::Ready)
        .map(|s| (s.id.clone(), workload_pids(&run.data, &s.id)))
        .collect();
    if let Some((pid, start)) = managed_driver(&run.data)
        && runs(pid, start)
    {
        kill(Pid::from_raw(pid), Signal::SIGKILL).map_err(|e| e.to_string())?;
        count_fault(run, "closing_sigkill_driver");
    }
    restart_sbxd(run).await?;
    count_fault(run, "closing_sigkill_sbxd_and_restart");
    let after = quiesce(run).await?;
    let mut checks = 0;
    for (id, pids) in &before {
        checks += 1;
        let now = workload_pids(&run.data, id);
        let ready = after
            .iter()
            .any(|s| &s.id == id && s.phase() == Phase::Ready);
        if !ready || &now != pids {
            return Err(format!(
                "after SIGKILL of the driver and sbxd, {id} (workloads {pids:?}) is ready: \
                 {ready}, workloads {now:?}"
            ));
        }
    }
    Ok(checks)
}
