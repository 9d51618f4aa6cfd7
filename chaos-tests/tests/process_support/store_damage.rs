//! The store-damage check at the end of a process chaos run, with real workloads running all
//! along: sbxd stopped cleanly, `sbxd store backup`, then the store rolled back behind its
//! high-water mark (what an old copy put back, or a disk that lost writes, leaves: sled cannot
//! tell). sbxd must refuse to serve it, saying what was lost and how to proceed; `sbxd store
//! restore --force` of the backup must bring back every sandbox, each Ready sandbox on the very
//! workload process it had (the workloads outlive sbxd and its driver; nothing is relaunched).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use sbx_proto::v1::Sandbox;

use super::checks::quiesce;
use super::faults::count_fault;
use super::{Daemon, ready_workloads, same_workloads_ready};
use crate::{Run, lock};

/// Bound of one `sbxd store …` command.
const STORE_COMMAND: Duration = Duration::from_secs(60);
/// How far the damage puts the store behind its mark, in commits.
const LOST_COMMITS: u64 = 5;

/// Runs `sbxd store ARGS… --data-dir DATA`, bounded; its exit code and output.
fn store_command(run: &Run, args: &[&str]) -> Result<(i32, String), String> {
    let out = run.data.join(format!("store-{}.out", args[0]));
    let file = std::fs::File::create(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let mut child = Command::new(&run.sbxd)
        .arg("store")
        .args(args)
        .arg("--data-dir")
        .arg(&run.data)
        .stdin(Stdio::null())
        .stdout(file)
        .stderr(err)
        .spawn()
        .map_err(|e| format!("spawn sbxd store {}: {e}", args[0]))?;
    let began = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| e.to_string())? {
            break status;
        }
        if began.elapsed() > STORE_COMMAND {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "sbxd store {} took over {STORE_COMMAND:?}",
                args[0]
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = std::fs::read_to_string(&out).unwrap_or_default();
    Ok((status.code().unwrap_or(-1), text))
}

/// Puts the store's mark `LOST_COMMITS` above its revision: the store now holds less than
/// was acknowledged.
fn lose_commits(data: &Path) -> Result<u64, String> {
    let path = data.join("store.high-water");
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mark: u64 = text
        .trim_matches(|c: char| c.is_whitespace() || c == '\0')
        .parse()
        .map_err(|_| format!("{} holds no revision: {text:?}", path.display()))?;
    std::fs::write(&path, format!("{:020}\n", mark + LOST_COMMITS))
        .map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(mark)
}

fn next_start(run: &Run) -> u64 {
    let mut starts = lock(&run.starts);
    *starts += 1;
    *starts
}

/// See the module docs. `settled` is what the run settled to (and the closing kill kept).
pub async fn damaged_store_is_refused_and_restored(
    run: &Run,
    settled: &[Sandbox],
) -> Result<u64, String> {
    let before = ready_workloads(&run.data, settled);
    let mut daemon = run.daemon.write().await;
    if !daemon.sigterm(Duration::from_secs(30)) {
        return Err("sbxd did not exit within 30 s of SIGTERM".into());
    }
    let backup = run.data.join("chaos.sbxstore");
    let (code, text) = store_command(run, &["backup", backup.to_str().unwrap_or_default()])?;
    if code != 0 {
        return Err(format!("sbxd store backup exited {code}: {text}"));
    }
    let mark = lose_commits(&run.data)?;
    let (sbxd, data, parent) = (
        run.sbxd.clone(),
        run.data.clone(),
        run.cgroup_parent.clone(),
    );
    let n = next_start(run);
    let refused = tokio::task::spawn_blocking(move || Daemon::start(&sbxd, &data, &parent, n))
        .await
        .map_err(|e| e.to_string())?;
    if let Ok(served) = refused {
        drop(served);
        return Err(format!(
            "sbxd served a store {LOST_COMMITS} commits behind its mark ({mark} + {LOST_COMMITS})"
        ));
    }
    let log = std::fs::read_to_string(run.data.join(format!("sbxd-{n}.log"))).unwrap_or_default();
    for said in ["store check", "store restore", "--accept-store-loss"] {
        if !log.contains(said) {
            return Err(format!(
                "sbxd refused the damaged store without naming `{said}`: {log}"
            ));
        }
    }
    let (code, text) = store_command(
        run,
        &["restore", "--force", backup.to_str().unwrap_or_default()],
    )?;
    if code != 0 {
        return Err(format!("sbxd store restore exited {code}: {text}"));
    }
    let (sbxd, data, parent) = (
        run.sbxd.clone(),
        run.data.clone(),
        run.cgroup_parent.clone(),
    );
    let n = next_start(run);
    let fresh = tokio::task::spawn_blocking(move || Daemon::start(&sbxd, &data, &parent, n))
        .await
        .map_err(|e| e.to_string())??;
    *run.endpoint.write().unwrap_or_else(|p| p.into_inner()) = fresh.endpoint();
    *daemon = fresh;
    drop(daemon);
    let after = quiesce(run).await?;
    count_fault(run, "store_damaged_then_restored");
    let checks = 2;
    let mut ids: Vec<&str> = settled.iter().map(|s| s.id.as_str()).collect();
    let mut restored: Vec<&str> = after.iter().map(|s| s.id.as_str()).collect();
    ids.sort();
    restored.sort();
    if ids != restored {
        return Err(format!(
            "after the restore sbxd serves {restored:?}, not the {ids:?} it held"
        ));
    }
    Ok(checks + same_workloads_ready(&run.data, &before, &after, "the store's restore")?)
}
