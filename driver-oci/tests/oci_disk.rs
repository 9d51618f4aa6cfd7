//! A sandbox's disk limit, tried from inside (needs root, runc, a static busybox, e2fsprogs and
//! util-linux's loop mounts): its root filesystem's writable layer and /sandbox share one
//! bound that the kernel enforces.

mod oci_support;

use std::os::unix::fs::MetadataExt;
use std::time::Instant;

use oci_support::{TestEnv, create, exec};
use sbx_driver_api::{ComputeDriver, pb};

const LIMIT: u64 = 64 << 20;

fn with_disk(mut spec: pb::SandboxSpec, bytes: u64) -> pb::SandboxSpec {
    spec.resources = Some(pb::Resources {
        disk_bytes: bytes,
        ..Default::default()
    });
    spec
}

async fn get(driver: &dyn ComputeDriver, id: &str) -> pb::Snapshot {
    driver
        .get(pb::GetRequest {
            sandbox_id: id.to_string(),
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn writes_past_the_disk_limit_fail_inside_and_the_host_keeps_the_rest() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, snapshot) = create(
        &driver,
        &env,
        "small",
        with_disk(env.spec(&["sleep", "3600"]), LIMIT),
    )
    .await;
    assert_eq!(snapshot.state, pb::State::Running as i32, "{snapshot:?}");
    let sid = id.to_string();
    let dir = env.state_dir().join("sandboxes").join(&sid);

    // /sandbox, then the root filesystem: both on the one disk.
    let (code, _, err) = exec(
        &driver,
        &sid,
        &[
            "sh",
            "-c",
            "dd if=/dev/zero of=/sandbox/fill bs=1M count=100",
        ],
    )
    .await;
    assert_ne!(code, 0, "100 MiB went into a 64 MiB disk");
    assert!(err.contains("No space left on device"), "{err}");
    let (code, _, err) = exec(
        &driver,
        &sid,
        &["sh", "-c", "dd if=/dev/zero of=/etc/more bs=1M count=16"],
    )
    .await;
    assert_ne!(
        code, 0,
        "the root filesystem wrote past the disk shared with /sandbox"
    );
    assert!(err.contains("No space left on device"), "{err}");
    // The sandbox says so.
    let s = get(&driver, &sid).await;
    assert!(
        s.warnings.iter().any(|w| w.contains("disk full")),
        "{:?}",
        s.warnings
    );
    // What the host's disk holds for it is bounded by the limit (the image is sparse).
    let held = std::fs::metadata(dir.join("disk.img")).unwrap().blocks() * 512;
    assert!(
        held <= LIMIT,
        "the host holds {held} bytes for a {LIMIT}-byte disk"
    );

    // Space freed is space again; the files stay through a stop, a start and a new driver.
    let (code, _, err) = exec(
        &driver,
        &sid,
        &[
            "sh",
            "-c",
            "rm /sandbox/fill && echo kept > /sandbox/note && echo root > /etc/note",
        ],
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(
        !get(&driver, &sid)
            .await
            .warnings
            .iter()
            .any(|w| w.contains("disk full"))
    );
    driver
        .stop(pb::StopRequest {
            sandbox_id: sid.clone(),
            grace_period_ms: 1000,
        })
        .await
        .unwrap();
    drop(driver);
    let driver = env.open().await;
    driver
        .start(pb::StartRequest {
            sandbox_id: sid.clone(),
            generation: 2,
            run_env: Default::default(),
        })
        .await
        .unwrap();
    let (code, out, err) = exec(&driver, &sid, &["cat", "/sandbox/note", "/etc/note"]).await;
    assert_eq!((code, out.as_str()), (0, "kept\nroot\n"), "{err}");
    // The limit is still the kernel's after the restart.
    let (code, _, err) = exec(
        &driver,
        &sid,
        &[
            "sh",
            "-c",
            "dd if=/dev/zero of=/sandbox/fill bs=1M count=100",
        ],
    )
    .await;
    assert!(
        code != 0 && err.contains("No space left on device"),
        "{code} {err}"
    );

    // A delete takes the disk: no mount, no image.
    driver
        .delete(pb::DeleteRequest {
            sandbox_id: sid.clone(),
        })
        .await
        .unwrap();
    assert!(!dir.exists());
    drop(driver);
    env.finish().await;
}

/// Seconds `dd` takes to write and sync `mib` MiB to /sandbox in sandbox `id`.
async fn write_seconds(driver: &dyn ComputeDriver, id: &str, mib: u32) -> f64 {
    let script = format!(
        "dd if=/dev/zero of=/sandbox/w bs=1M count={mib} conv=fsync 2>/dev/null && rm /sandbox/w"
    );
    let began = Instant::now();
    let (code, _, err) = exec(driver, id, &["sh", "-c", &script]).await;
    assert_eq!(code, 0, "{err}");
    began.elapsed().as_secs_f64()
}

#[tokio::test]
async fn a_disk_limited_sandbox_writes_about_as_fast_as_an_unlimited_one() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (limited, _) = create(
        &driver,
        &env,
        "limited",
        with_disk(env.spec(&["sleep", "3600"]), 1 << 30),
    )
    .await;
    let (free, _) = create(&driver, &env, "free", env.spec(&["sleep", "3600"])).await;
    let (limited, free) = (limited.to_string(), free.to_string());
    const MIB: u32 = 128;
    // Alternated, best of 3 each: the same machine, the same moment.
    let (mut l, mut f) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        l = l.min(write_seconds(&driver, &limited, MIB).await);
        f = f.min(write_seconds(&driver, &free, MIB).await);
    }
    let mbps = |s: f64| f64::from(MIB) / s;
    eprintln!(
        "write {MIB} MiB + fsync to /sandbox: disk-limited {:.0} MiB/s, unlimited {:.0} MiB/s, ratio {:.2}",
        mbps(l),
        mbps(f),
        f / l
    );
    // A loop-backed ext4 costs something; a tenth of the speed would be a defect.
    assert!(l < f * 10.0 + 0.5, "limited {l:.2}s vs unlimited {f:.2}s");
    drop(driver);
    env.finish().await;
}
