//! A full disk is an operational state (issue 13, item 5): sbxd over an 8 MiB tmpfs (sim
//! driver) that a file fills to ENOSPC. Writes answer RESOURCE_EXHAUSTED / DISK_FULL naming
//! the store's path, each within 5 s; stop and delete too (they never answered before: the
//! actors restarted in a loop); gets and lists keep working; health "" and `sbx.v1.Writes` say
//! NOT_SERVING, the read services SERVING. After `mount -o remount,size=64m` the gateway takes
//! writes by itself (the time from the remount to the first successful create is printed), and
//! nothing acknowledged is lost: listed after the recovery and after a restart of sbxd.
//!
//! Needs root (a tmpfs); skipped with a message otherwise.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::{Sbxd, assert_status};
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, GetSandboxRequest,
    ListSandboxesRequest, SandboxRef, SandboxSpec, StopSandboxRequest,
};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Every call must answer within this, full disk or not.
const CALL_LIMIT: Duration = Duration::from_secs(5);

/// A tmpfs mounted on a temp dir, unmounted when dropped (also when the test fails).
struct Tmpfs {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &path,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size={size}").as_str()),
        )
        .expect("mount a tmpfs");
        Tmpfs { _dir: dir, path }
    }

    fn resize(&self, size: &str) {
        nix::mount::mount(
            None::<&str>,
            &self.path,
            None::<&str>,
            nix::mount::MsFlags::MS_REMOUNT,
            Some(format!("size={size}").as_str()),
        )
        .expect("remount the tmpfs");
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Writes `DIR/fill` until ENOSPC (at most 64 MiB).
fn fill_up(dir: &Path) {
    let mut fill = std::fs::File::create(dir.join("fill")).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    for _ in 0..1024 {
        if fill
            .write_all(&chunk)
            .and_then(|_| fill.sync_data())
            .is_err()
        {
            return;
        }
    }
    panic!("64 MiB went into an 8 MiB tmpfs");
}

fn create(name: &str) -> CreateSandboxRequest {
    CreateSandboxRequest {
        providers: Default::default(),
        workspace: String::new(),
        name: name.into(),
        spec: Some(SandboxSpec {
            command: vec!["sleep".into(), "1000".into()],
            ..Default::default()
        }),
        stopped: false,
    }
}

fn by_name(name: &str) -> Option<SandboxRef> {
    Some(SandboxRef {
        name: name.into(),
        ..Default::default()
    })
}

/// Runs one call under [`CALL_LIMIT`]; panics naming `what` when it takes longer.
async fn timed<T>(what: &str, call: impl std::future::Future<Output = T>) -> T {
    let began = Instant::now();
    let out = tokio::time::timeout(CALL_LIMIT, call)
        .await
        .unwrap_or_else(|_| panic!("{what} did not answer within {CALL_LIMIT:?}"));
    eprintln!("{what}: answered in {:?}", began.elapsed());
    out
}

async fn health(d: &Sbxd, service: &str) -> i32 {
    let mut h = HealthClient::new(d.channel().await);
    timed(
        &format!("health {service:?}"),
        h.check(HealthCheckRequest {
            service: service.into(),
        }),
    )
    .await
    .expect("health answers")
    .into_inner()
    .status
}

async fn names(d: &Sbxd) -> Vec<String> {
    let mut sb = d.sandboxes().await;
    let mut names: Vec<String> = timed("list", sb.list_sandboxes(ListSandboxesRequest::default()))
        .await
        .expect("list works")
        .into_inner()
        .sandboxes
        .into_iter()
        .map(|s| s.name)
        .collect();
    names.sort();
    names
}

fn assert_disk_full(status: &tonic::Status, store: &Path) {
    assert_status(status, tonic::Code::ResourceExhausted, "DISK_FULL");
    // The store's path, named from the data dir (DATA/store), never the host's.
    let from_data = format!(
        "DATA/{}",
        store
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    );
    assert!(
        status.message().contains("is full") && status.message().contains(&from_data),
        "the message says the disk holding the store is full: {status:?}"
    );
    assert!(
        !status.message().contains(&store.display().to_string()),
        "the message names the host's path: {status:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_serves_reads_and_recovers_when_space_returns() {
    if !nix::unistd::Uid::effective().is_root() {
        eprintln!("skipped: a_full_disk_… needs root to mount a tmpfs");
        return;
    }
    let fs = Tmpfs::mount("8m");
    let data = fs.path.join("data");
    std::fs::create_dir(&data).unwrap();
    let store = data.join("store");
    let mut d = Sbxd::start(&data, "sim", &[]);
    let mut sb = d.sandboxes().await;
    let mut acknowledged = Vec::new();
    for name in ["before-a", "before-b", "before-c"] {
        timed("create", sb.create_sandbox(create(name)))
            .await
            .expect("create before the disk fills");
        acknowledged.push(name.to_string());
    }
    assert_eq!(health(&d, "").await, ServingStatus::Serving as i32);
    assert_eq!(
        health(&d, "sbx.v1.Writes").await,
        ServingStatus::Serving as i32
    );

    fill_up(&fs.path);

    let err = timed("create", sb.create_sandbox(create("during")))
        .await
        .expect_err("a create on a full disk is refused");
    assert_disk_full(&err, &store);
    let err = timed(
        "stop",
        sb.stop_sandbox(StopSandboxRequest {
            sandbox: by_name("before-a"),
        }),
    )
    .await
    .expect_err("a stop on a full disk is refused");
    assert_disk_full(&err, &store);
    let err = timed(
        "delete",
        sb.delete_sandbox(DeleteSandboxRequest {
            sandbox: by_name("before-b"),
        }),
    )
    .await
    .expect_err("a delete on a full disk is refused");
    assert_disk_full(&err, &store);
    let err = timed(
        "create workspace",
        d.workspaces()
            .await
            .create_workspace(CreateWorkspaceRequest {
                name: "ws-during".into(),
                labels: Default::default(),
            }),
    )
    .await
    .expect_err("a workspace create on a full disk is refused");
    assert_disk_full(&err, &store);
    // Reads keep working, and show what was acknowledged, unchanged.
    let got = timed(
        "get",
        sb.get_sandbox(GetSandboxRequest {
            sandbox: by_name("before-a"),
        }),
    )
    .await
    .expect("get works on a full disk")
    .into_inner();
    assert_eq!(got.name, "before-a");
    assert_eq!(names(&d).await, acknowledged);
    // Health: NOT_SERVING overall and for writes (within its 500 ms period), reads SERVING.
    let began = Instant::now();
    while health(&d, "").await != ServingStatus::NotServing as i32 {
        assert!(
            began.elapsed() < CALL_LIMIT,
            "health stayed SERVING on a full disk"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        health(&d, "sbx.v1.Writes").await,
        ServingStatus::NotServing as i32
    );
    assert_eq!(
        health(&d, "sbx.v1.SandboxService").await,
        ServingStatus::Serving as i32
    );
    let log = d.log_text();
    assert!(
        !log.contains("escalating") && !log.contains("restarting it from its record"),
        "no actor restarts on a full disk:\n{log}"
    );

    // Space returns: the next create goes through, without a restart.
    fs.resize("64m");
    let grown = Instant::now();
    let recovered = loop {
        match timed(
            "create after the remount",
            sb.create_sandbox(create("after")),
        )
        .await
        {
            Ok(_) => break grown.elapsed(),
            Err(e) => {
                assert_disk_full(&e, &store);
                assert!(
                    grown.elapsed() < CALL_LIMIT,
                    "no recovery within {CALL_LIMIT:?}: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    };
    eprintln!("remount to first successful create: {recovered:?}");
    acknowledged.push("after".into());
    acknowledged.sort();
    timed(
        "stop after the remount",
        sb.stop_sandbox(StopSandboxRequest {
            sandbox: by_name("before-a"),
        }),
    )
    .await
    .expect("a stop after the remount");
    let began = Instant::now();
    while health(&d, "").await != ServingStatus::Serving as i32 {
        assert!(
            began.elapsed() < CALL_LIMIT,
            "health stayed NOT_SERVING after the remount"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(names(&d).await, acknowledged);

    // And after a restart, everything acknowledged is still there.
    d.sigterm(Duration::from_secs(30));
    let d = Sbxd::start(&data, "sim", &[]);
    assert_eq!(names(&d).await, acknowledged);
    drop(d);
    drop(fs);
}

/// A log that cannot be written (sbxd's stderr on `/dev/full`, as a log file on a full disk
/// is) costs the log lines only: every call is answered as it would be, none is cut off (a
/// failed log write used to be reported on stderr, whose failure panicked the call's task: the
/// client saw its stream reset), and sbxd keeps serving. Needs no root: nothing is mounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_that_cannot_be_written_loses_only_log_lines() {
    let dir = tempfile::tempdir().unwrap();
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let mut d = Sbxd::spawn_logging_to(
        dir.path(),
        "sim",
        "127.0.0.1:0",
        &[],
        // Every call logs at debug: each would have been one more failed write.
        &[("SBX_LOG", "debug")],
        full.into(),
        dir.path().join("no-log"),
    );
    d.wait_serving();
    let mut sb = d.sandboxes().await;
    let mut made = Vec::new();
    for i in 0..5 {
        let name = format!("quiet-{i}");
        timed("create", sb.create_sandbox(create(&name)))
            .await
            .expect("a create with a log that cannot be written");
        made.push(name);
    }
    for name in &made[..2] {
        timed(
            "stop",
            sb.stop_sandbox(StopSandboxRequest {
                sandbox: by_name(name),
            }),
        )
        .await
        .expect("a stop with a log that cannot be written");
    }
    timed(
        "delete",
        sb.delete_sandbox(DeleteSandboxRequest {
            sandbox: by_name(&made[4]),
        }),
    )
    .await
    .expect("a delete with a log that cannot be written");
    made.pop();
    assert_eq!(names(&d).await, made);
    assert_eq!(health(&d, "").await, ServingStatus::Serving as i32);
    let (_, status) = d.sigterm(Duration::from_secs(30));
    assert!(status.success(), "sbxd ended with {status}");
}
