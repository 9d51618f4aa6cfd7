//! The vm driver runs the sandbox's image: the guest's root is the image's (a base disk built
//! once per image, a copy-on-write root disk per sandbox), its Cmd, Env, WorkingDir and User
//! apply (the User to execs too, as on oci), the image's own owners are on its files, a
//! change to the root survives a stop and a start and a new driver, and two sandboxes of one
//! image do not see each other's changes.
//! Delete leaves neither the VM nor the root disk.

mod vm_support;

use std::time::Duration;

use futures::StreamExt;
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_vm::VmDriver;
use sbx_images::{IdMap, ImageConfig, ImageInfo, ImageStore, fixtures};
use vm_support::VmEnv;

/// The busybox image with one more layer: a marker owned by 1000:1000, a user `app` (1000),
/// `/app` its home; Env, WorkingDir, User and a Cmd that says who it runs as.
fn image(store: &ImageStore) -> ImageInfo {
    let busybox = store
        .import_busybox(&vm_support::busybox(), "sbx.local/busybox:latest")
        .expect("the busybox image");
    let tar = fixtures::tar_bytes(&[
        fixtures::TarEntry::file("etc/marker", b"marker-from-image\n").owner(1000, 1000),
        fixtures::TarEntry::file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/app:/bin/sh\n",
        ),
        fixtures::TarEntry::file("etc/group", b"root:x:0:\napp:x:1000:\n"),
        fixtures::TarEntry::dir("app").owner(1000, 1000),
    ]);
    let layer = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(layer.path(), tar).unwrap();
    let config = ImageConfig {
        env: vec![
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin".into(),
            "FOO=bar-from-image".into(),
        ],
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "id -u > whoami; pwd >> whoami; echo to-stdout; echo to-stderr >&2; \
             exec sleep 3600"
                .into(),
        ],
        working_dir: "/app".into(),
        user: "app".into(),
        ..ImageConfig::default()
    };
    store
        .derive(
            "sbx.local/vm-test:1",
            Some(&busybox),
            Some(layer.path()),
            &config,
        )
        .expect("the test image")
}

async fn create(driver: &VmDriver, image: &ImageInfo, name: &str) -> String {
    let id = uuid::Uuid::new_v4().to_string();
    let snap = driver
        .create(pb::CreateRequest {
            sandbox_id: id.clone(),
            workspace: "team-a".into(),
            name: name.into(),
            spec: Some(pb::SandboxSpec {
                image: image.digest.clone(),
                ..Default::default()
            }),
            generation: 1,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
    assert_eq!(snap.state, pb::State::Running as i32, "{snap:?}");
    id
}

/// `sh -c script` in the sandbox: (exit code, stdout, stderr).
async fn sh(driver: &VmDriver, id: &str, script: &str) -> (i32, String, String) {
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            timeout_seconds: 30,
            ..Default::default()
        })
        .await
        .expect("exec");
    let (mut out, mut err, mut code) = (Vec::new(), Vec::new(), None);
    while let Some(item) = stream.next().await {
        match item.expect("exec output").chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(pb::exec_output::Chunk::Stderr(b)) => err.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            None => {}
        }
    }
    (
        code.expect("an exit"),
        String::from_utf8_lossy(&out).into_owned(),
        String::from_utf8_lossy(&err).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_runs_its_image_and_keeps_its_root_until_delete() {
    let env = VmEnv::new();
    let store_dir = tempfile::tempdir().unwrap();
    let store = ImageStore::open(store_dir.path().join("images"), IdMap::default()).unwrap();
    let image = image(&store);
    let driver = env.open_with_images(store.clone()).await;
    let caps = driver.capabilities().await.unwrap();
    assert!(caps.images, "{caps:?}");

    let started = std::time::Instant::now();
    let a = create(&driver, &image, "a").await;
    let first = started.elapsed();
    let started = std::time::Instant::now();
    let b = create(&driver, &image, "b").await;
    let second = started.elapsed();
    eprintln!("first create (base disk built) {first:?}, second {second:?}");
    let bases: Vec<_> = std::fs::read_dir(env.state.path().join("bases"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".ext4"))
        .collect();
    assert_eq!(bases.len(), 1, "one base disk for one image");

    // The image's file, with the image's own owner (not the store's shifted one), its Env,
    // its WorkingDir for execs, its User for the main process.
    let (code, out, err) = sh(
        &driver,
        &a,
        "cat /etc/marker; stat -c %u:%g /etc/marker; echo $FOO; pwd; id -u; cat /app/whoami",
    )
    .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.lines().collect::<Vec<_>>(),
        [
            "marker-from-image",
            "1000:1000",
            "bar-from-image",
            "/app",
            "1000",
            "1000",
            "/app"
        ],
        "{err}"
    );
    // The main process's stdout and stderr, apart in the log.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let chunks = loop {
        let mut stream = driver
            .logs(pb::LogsRequest {
                sandbox_id: a.clone(),
                timestamps: true,
                ..Default::default()
            })
            .await
            .expect("logs");
        let mut chunks = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.expect("a log chunk");
            chunks.push((
                chunk.stream,
                String::from_utf8_lossy(&chunk.data).into_owned(),
            ));
        }
        let seen = |text: &str| chunks.iter().any(|(_, d)| d.contains(text));
        if (seen("to-stdout") && seen("to-stderr")) || std::time::Instant::now() > deadline {
            break chunks;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let stream_of = |text: &str| {
        chunks
            .iter()
            .find(|(_, d)| d.trim_end() == text)
            .map(|(s, _)| *s)
    };
    assert_eq!(
        stream_of("to-stdout"),
        Some(pb::LogStream::Stdout as i32),
        "{chunks:?}"
    );
    assert_eq!(
        stream_of("to-stderr"),
        Some(pb::LogStream::Stderr as i32),
        "{chunks:?}"
    );
    // The root is the image's, not the initramfs's: no init script of ours in it.
    let (code, _, _) = sh(&driver, &a, "test -e /etc/sbx/run.env").await;
    assert_eq!(code, 1, "the initramfs is not the root");

    // Execs run as the image's User too, as on oci: /etc is not its to write.
    let (code, _, _) = sh(&driver, &a, "echo no > /etc/changed").await;
    assert_ne!(code, 0, "the image's User wrote /etc");
    // A change to the root filesystem in one sandbox (in its User's home); the other, of the
    // same image, does not see it.
    let (code, _, err) = sh(&driver, &a, "echo changed-in-a > /app/changed; sync").await;
    assert_eq!(code, 0, "{err}");
    let (code, _, _) = sh(&driver, &b, "test -e /app/changed").await;
    assert_eq!(code, 1, "b sees a's change");

    // Kept across a stop and a start...
    driver
        .stop(pb::StopRequest {
            sandbox_id: a.clone(),
            grace_period_ms: 2000,
        })
        .await
        .expect("stop");
    driver
        .start(pb::StartRequest {
            sandbox_id: a.clone(),
            generation: 2,
            ..Default::default()
        })
        .await
        .expect("start");
    let (code, out, err) = sh(&driver, &a, "cat /app/changed").await;
    assert_eq!((code, out.trim()), (0, "changed-in-a"), "{err}");
    // ... and a new driver (the VMs outlive it).
    drop(driver);
    let driver = env.open_with_images(store.clone()).await;
    let (code, out, err) = sh(&driver, &a, "cat /app/changed; cat /etc/marker").await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "changed-in-a\nmarker-from-image\n");

    for id in [&a, &b] {
        driver
            .delete(pb::DeleteRequest {
                sandbox_id: id.to_string(),
            })
            .await
            .expect("delete");
        let dir = driver.sandbox_dir(id.parse().unwrap());
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while dir.exists() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(!dir.exists(), "{} left", dir.display());
    }
    env.assert_no_vm_left();
}

/// `sh -c script` as `user`: (exit code, stdout), or the error the exec was refused with.
async fn sh_as(
    driver: &VmDriver,
    id: &str,
    user: &str,
    script: &str,
) -> Result<(i32, String), sbx_driver_api::DriverError> {
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            timeout_seconds: 30,
            user: user.into(),
            ..Default::default()
        })
        .await?;
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(item) = stream.next().await {
        match item?.chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            _ => {}
        }
    }
    Ok((
        code.expect("an exit"),
        String::from_utf8_lossy(&out).into_owned(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_execs_run_as_the_image_user_or_the_one_they_name() {
    let env = VmEnv::new();
    let store_dir = tempfile::tempdir().unwrap();
    let store = ImageStore::open(store_dir.path().join("images"), IdMap::default()).unwrap();
    let image = image(&store);
    let driver = env.open_with_images(store.clone()).await;
    let id = create(&driver, &image, "users").await;
    let report = "id -u; echo \"$HOME $USER $LOGNAME\"; pwd";
    // No user: the image's (app, 1000), in the image's WorkingDir.
    let (code, out) = sh_as(&driver, &id, "", report).await.unwrap();
    assert_eq!((code, out.as_str()), (0, "1000\n/app app app\n/app\n"));
    // Root, though the guest's agent serves the image's user by default.
    let (_, out) = sh_as(&driver, &id, "root", report).await.unwrap();
    assert_eq!(out, "0\n/root root root\n/app\n");
    let (_, out) = sh_as(
        &driver,
        &id,
        "root",
        "touch /etc/by-root; stat -c %U /etc/by-root",
    )
    .await
    .unwrap();
    assert_eq!(out, "root\n");
    match sh_as(&driver, &id, "ghost", "true").await {
        Err(sbx_driver_api::DriverError::InvalidArgument(m)) => assert!(m.contains("ghost"), "{m}"),
        other => panic!("{other:?}"),
    }
    driver
        .delete(pb::DeleteRequest { sandbox_id: id })
        .await
        .unwrap();
}
