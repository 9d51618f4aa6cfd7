//! A damaged store is refused at startup, never served as if whole (black box, the real
//! sbxd on the sim driver). After 200 acknowledged creates and a clean stop `sbxd store check`
//! says healthy. With the store's log truncated to half, or to nothing, sbxd exits 1 saying
//! the store cannot be used (sled finds the cut). With an older copy of the store put back
//! (100 of the 200; what a rolled-back disk snapshot or a careless restore leaves, which sled
//! cannot tell), sbxd exits 1 naming the missing commits and what to do, `store check`
//! exits 1, `--accept-store-loss` serves the 100 (logged), and the next start is clean.

mod common;

use std::time::Duration;

use common::{DataDir, Sbxd};
use sbx_proto::v1::{CreateSandboxRequest, ListSandboxesRequest, SandboxSpec};

const SANDBOXES: usize = 200;

fn store_check(data: &std::path::Path) -> (i32, String, String) {
    let mut cmd = common::sbxd_command();
    cmd.args(["store", "check", "--data-dir"]).arg(data);
    let run = common::run_bounded(&mut cmd, "sbxd store check");
    (run.code, run.stdout, run.stderr)
}

/// `sbxd serve` on `data` that must fail: its exit code and stderr (a served store would
/// keep it running, and `run_bounded` fails the test then).
fn refused_start(data: &std::path::Path) -> (i32, String) {
    let mut cmd = common::sbxd_command();
    cmd.args([
        "serve",
        "--driver",
        "sim",
        "--listen",
        "127.0.0.1:0",
        "--auth",
        "none",
    ])
    .arg("--data-dir")
    .arg(data)
    .env("SBX_LOG", "warn");
    let run = common::run_bounded(&mut cmd, "sbxd serve on a damaged store");
    (run.code, run.stderr)
}

async fn count(d: &Sbxd) -> usize {
    d.sandboxes()
        .await
        .list_sandboxes(ListSandboxesRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .expect("list")
        .into_inner()
        .sandboxes
        .len()
}

async fn create(d: &Sbxd, range: std::ops::Range<usize>) {
    let mut client = d.sandboxes().await;
    for i in range {
        client
            .create_sandbox(CreateSandboxRequest {
                name: format!("sb-{i}"),
                spec: Some(SandboxSpec {
                    command: vec!["sleep".into(), "1000".into()],
                    ..Default::default()
                }),
                ..Default::default()
            })
            .await
            .expect("create");
    }
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_older_copy_of_the_store_is_refused_and_served_only_when_told() {
    let data = DataDir::new();
    let mut d = Sbxd::start(data.path(), "sim", &[]);
    create(&d, 0..SANDBOXES / 2).await;
    d.sigterm(Duration::from_secs(30));
    let old = data.path().join("old-store");
    copy_dir(&data.path().join("store"), &old);
    let mut d = Sbxd::start(data.path(), "sim", &[]);
    create(&d, SANDBOXES / 2..SANDBOXES).await;
    assert_eq!(count(&d).await, SANDBOXES);
    d.sigterm(Duration::from_secs(30));
    // The older copy put back; the high-water mark beside it stays.
    std::fs::remove_dir_all(data.path().join("store")).unwrap();
    copy_dir(&old, &data.path().join("store"));

    let (code, err) = refused_start(data.path());
    eprintln!("older copy: sbxd said: {}", err.trim());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("damaged")
            && err.contains("acknowledged commit(s) are missing")
            && err.contains("--accept-store-loss")
            && err.contains("sbxd store check"),
        "{err}"
    );
    let (code, _, said) = store_check(data.path());
    assert_eq!(code, 1, "store check of the older copy: {said}");
    assert!(said.contains("missing"), "{said}");

    // Told to: served as it is, the loss logged; then clean again.
    let mut d = Sbxd::start(data.path(), "sim", &["--accept-store-loss"]);
    assert_eq!(count(&d).await, SANDBOXES / 2);
    assert!(
        d.log_text().contains("serving a damaged store"),
        "{}",
        d.log_text()
    );
    d.sigterm(Duration::from_secs(30));
    let (code, out, err) = store_check(data.path());
    assert_eq!(code, 0, "accepted, then healthy: {out} {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_store_is_refused_and_served_only_when_told() {
    for cut in ["half", "empty"] {
        let data = DataDir::new();
        let mut d = Sbxd::start(data.path(), "sim", &[]);
        create(&d, 0..SANDBOXES).await;
        assert_eq!(count(&d).await, SANDBOXES);
        let (_, status) = d.sigterm(Duration::from_secs(30));
        assert!(status.success(), "{status:?}");
        let (code, out, err) = store_check(data.path());
        assert_eq!(code, 0, "a healthy store: {out} {err}");
        assert!(out.contains("0 index problem(s)"), "{out}");

        // The damage: sled's log cut.
        let log = data.path().join("store/db");
        let len = std::fs::metadata(&log).unwrap().len();
        let keep = if cut == "half" { len / 2 } else { 0 };
        std::fs::OpenOptions::new()
            .write(true)
            .open(&log)
            .unwrap()
            .set_len(keep)
            .unwrap();
        let (code, err) = refused_start(data.path());
        eprintln!("{cut}: sbxd said: {}", err.trim());
        assert_eq!(code, 1, "{err}");
        assert!(
            err.contains("damaged") || err.contains("cannot open the store"),
            "{cut}: {err}"
        );
        if err.contains("damaged") {
            assert!(
                err.contains("acknowledged commit(s) are missing")
                    && err.contains("--accept-store-loss")
                    && err.contains("sbxd store check"),
                "{cut}: {err}"
            );
            let (code, _, said) = store_check(data.path());
            assert_eq!(code, 1, "store check of a damaged store: {said}");
            assert!(said.contains("missing"), "{said}");

            // Told to: served as it is, the loss logged; then clean again.
            let mut d = Sbxd::start(data.path(), "sim", &["--accept-store-loss"]);
            let left = count(&d).await;
            eprintln!("{cut}: {left} of {SANDBOXES} sandboxes left");
            assert!(left < SANDBOXES, "{cut}: nothing was lost?");
            assert!(
                d.log_text().contains("serving a damaged store"),
                "{}",
                d.log_text()
            );
            d.sigterm(Duration::from_secs(30));
            assert_eq!(store_check(data.path()).0, 0, "accepted, then healthy");
        }
    }
}
