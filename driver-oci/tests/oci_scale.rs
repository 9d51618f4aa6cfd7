//! Many idle `oci` sandboxes on one host at once, each on a uid range of its own (needs root,
//! runc and a static busybox). With one shared host uid, the kernel's per-uid key quota
//! (`kernel.keys.maxkeys`, 200 here; runc makes a session keyring per container) stopped new
//! sandboxes near 200; with a range per sandbox the only bound is the host.
//!
//! `SBX_SCALE_SANDBOXES=N` sets how many (default 500, the figure: ≈ 45 s here).
//! The figures it prints are in docs/BENCHMARKS.md.

mod oci_support;

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::time::{Duration, Instant};

use oci_support::{TestEnv, create, exec};
use sbx_driver_api::{ComputeDriver, pb};

fn wanted() -> usize {
    std::env::var("SBX_SCALE_SANDBOXES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(500)
}

/// Bytes under `dir` that are the sandbox's own on the host disk (not the shared layers).
fn disk_use(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let Ok(meta) = e.path().symlink_metadata() else {
                continue;
            };
            // The mounted rootfs is the shared layers seen through the overlay.
            if meta.dev() != std::fs::metadata(dir).unwrap().dev() {
                continue;
            }
            total += meta.blocks() * 512;
            if meta.is_dir() && e.file_name() != "rootfs" {
                stack.push(e.path());
            }
        }
    }
    total
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn many_idle_sandboxes_run_at_once_each_on_its_own_uids() {
    let n = wanted();
    let max_keys: u64 = std::fs::read_to_string("/proc/sys/kernel/keys/maxkeys")
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or(200);
    let env = TestEnv::new();
    let driver = std::sync::Arc::new(env.open().await);
    let began = Instant::now();
    let mut ids = Vec::with_capacity(n);
    let mut times = Vec::with_capacity(n);
    // 4 creates at a time; every one must come back Running (the driver's Ready).
    for chunk in (0..n).collect::<Vec<_>>().chunks(4) {
        let mut tasks = Vec::new();
        for &i in chunk {
            let driver = driver.clone();
            let spec = env.spec(&["sleep", "3600"]);
            let name = format!("idle-{i}");
            let env_ref = &env;
            tasks.push(async move {
                let t = Instant::now();
                let (id, snapshot) = create(&driver, env_ref, &name, spec).await;
                (id, snapshot, t.elapsed())
            });
        }
        for (id, snapshot, took) in futures::future::join_all(tasks).await {
            assert_eq!(
                snapshot.state,
                pb::State::Running as i32,
                "sandbox {} of {n} is not running: {snapshot:?}",
                ids.len() + 1
            );
            ids.push(id);
            times.push(took);
        }
        assert!(
            began.elapsed() < Duration::from_secs(600),
            "{} sandboxes in 10 min",
            ids.len()
        );
    }
    let all_created = began.elapsed();
    // All of them still run, each on a range no other has.
    let listed = driver.list().await.unwrap();
    let running = listed
        .iter()
        .filter(|s| s.state == pb::State::Running as i32)
        .count();
    assert_eq!(running, n, "of {n} sandboxes, {running} run");
    let firsts: BTreeSet<u32> = ids
        .iter()
        .map(|id| driver.id_map(*id).unwrap().host_uid)
        .collect();
    assert_eq!(
        firsts.len(),
        n,
        "{n} sandboxes on {} uid ranges",
        firsts.len()
    );
    // The newest answers an exec, and its root is its own host uid.
    let last = ids.last().unwrap().to_string();
    let (code, out, err) = exec(driver.as_ref(), &last, &["cat", "/proc/self/uid_map"]).await;
    assert_eq!(code, 0, "{err}");
    let host: u32 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    assert_eq!(host, driver.id_map(*ids.last().unwrap()).unwrap().host_uid);
    let own_disk = disk_use(&env.state_dir().join("sandboxes").join(&last));
    let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
    let mut later: Vec<f64> = times[1..].iter().map(ms).collect();
    later.sort_by(f64::total_cmp);
    eprintln!(
        "{n} sandboxes running at once (key quota per uid {max_keys}) in {:.1} s; create: first \
         {:.0} ms, later p50 {:.0} ms / p90 {:.0} ms (4 at a time); disk of one sandbox's own: \
         {} KiB",
        all_created.as_secs_f64(),
        ms(&times[0]),
        later.get(later.len() / 2).copied().unwrap_or(0.0),
        later.get(later.len() * 9 / 10).copied().unwrap_or(0.0),
        own_disk / 1024
    );
    drop(driver);
    let sandboxes = env.state_dir().join("sandboxes");
    env.finish().await;
    // Every range went back: no lease still names one of this test's sandboxes.
    let pool = sbx_host_kit::uidpool::UidPool::default();
    for first in &firsts {
        let held =
            std::fs::read_to_string(pool.lease_dir.join(first.to_string())).unwrap_or_default();
        assert!(
            !held.starts_with(&*sandboxes.to_string_lossy()),
            "range {first} is still leased to {held}"
        );
    }
}
