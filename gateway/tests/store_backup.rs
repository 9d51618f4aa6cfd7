//! `sbxd store backup` and `sbxd store restore` through the real sbxd (sim driver, black box).
//! A round trip: workspaces and sandboxes made, sbxd stopped, a backup, then the store moved
//! on (a sandbox deleted, one created) and its log cut to nothing, which sbxd refuses; the
//! restore is refused without --force and leaves the cut store as it was, and with --force
//! keeps it aside and puts the backup in place, after which sbxd starts without
//! --accept-store-loss and serves exactly the backed-up objects (ids, names, specs, resource
//! versions). Also: a truncated and an altered backup refused without a store written, an
//! existing backup file not replaced without --force, and both commands refused (exit 2)
//! while sbxd runs.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{CliRun, DataDir, Sbxd, eventually, kept_across_restart};
use sbx_proto::v1::{
    CreateSandboxRequest, CreateWorkspaceRequest, DeleteSandboxRequest, ListWorkspacesRequest,
    Phase, Sandbox, SandboxRef, SandboxSpec, Workspace,
};

const STOP: Duration = Duration::from_secs(30);

fn store(args: &[&str], data: &Path) -> CliRun {
    let mut cmd = common::sbxd_command();
    cmd.arg("store")
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .env("SBX_LOG", "warn");
    common::run_bounded(&mut cmd, &format!("sbxd store {args:?}"))
}

async fn workspaces(d: &Sbxd) -> BTreeMap<String, Workspace> {
    d.workspaces()
        .await
        .list_workspaces(ListWorkspacesRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .expect("list workspaces")
        .into_inner()
        .workspaces
        .into_iter()
        .map(|w| (w.id.clone(), w))
        .collect()
}

async fn create(d: &Sbxd, workspace: &str, name: &str, stopped: bool) -> Sandbox {
    d.sandboxes()
        .await
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: workspace.into(),
            name: name.into(),
            spec: Some(SandboxSpec {
                command: vec!["sleep".into(), format!("{}", 100 + name.len())],
                env: [("WHO".to_string(), format!("{workspace}/{name}"))].into(),
                labels: [("tier".to_string(), workspace.to_string())].into(),
                ..Default::default()
            }),
            stopped,
        })
        .await
        .unwrap_or_else(|e| panic!("create {workspace}/{name}: {e}"))
        .into_inner()
}

/// A data dir whose sbxd (stopped again) made workspaces `alpha` and `beta` with three
/// sandboxes each (two stopped, one running); answers what sbxd listed before it stopped.
async fn populated(data: &Path) -> (BTreeMap<String, Workspace>, BTreeMap<String, Sandbox>) {
    let mut d = Sbxd::start(data, "sim", &[]);
    for ws in ["alpha", "beta"] {
        d.workspaces()
            .await
            .create_workspace(CreateWorkspaceRequest {
                name: ws.into(),
                labels: [("team".to_string(), ws.to_string())].into(),
            })
            .await
            .expect("create workspace");
        for (name, stopped) in [("one", true), ("two", true), ("three", false)] {
            create(&d, ws, name, stopped).await;
        }
    }
    let listed = eventually(Duration::from_secs(20), "every sandbox settled", || async {
        let all = d.all_sandboxes().await;
        all.values()
            .all(|s| s.phase == Phase::Ready as i32 || s.phase == Phase::Stopped as i32)
            .then_some(all)
    })
    .await;
    assert_eq!(listed.len(), 6, "{listed:#?}");
    let ws = workspaces(&d).await;
    let (_, status) = d.sigterm(STOP);
    assert!(status.success(), "{status:?}");
    (ws, listed)
}

/// `sbxd serve` on `data` that must fail: its exit code and stderr (a served store keeps it
/// running, and `run_bounded` fails the test then).
fn refused_start(data: &Path) -> (i32, String) {
    let mut cmd = common::sbxd_command();
    cmd.args(["serve", "--driver", "sim", "--listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data)
        .env("SBX_AUTH", "none")
        .env("SBX_LOG", "warn");
    let run = common::run_bounded(&mut cmd, "sbxd serve on a damaged store");
    (run.code, run.stderr)
}

/// N in the "N records" a backup or restore prints.
fn records_said(out: &str) -> usize {
    let at = out
        .find(" records (")
        .unwrap_or_else(|| panic!("no record count in {out:?}"));
    let digits = out[..at]
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap_or_default();
    digits.parse().unwrap_or_else(|_| panic!("{out:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_brings_a_refused_store_back_exactly() {
    let data = DataDir::new();
    let (ws_before, sb_before) = populated(data.path()).await;
    let backup = data.path().join("store.sbxbak");
    let run = store(&["backup"], data.path()).stderr;
    assert!(run.contains("FILE"), "backup without FILE: {run}");
    let run = store(&["backup", backup.to_str().unwrap()], data.path());
    assert_eq!(run.code, 0, "{run:?}");
    let records = records_said(&run.stdout);
    // Images and settings are records too.
    assert!(
        records >= ws_before.len() + sb_before.len(),
        "{} workspaces and sandboxes: {run:?}",
        ws_before.len() + sb_before.len()
    );
    assert!(!data.path().join("store.sbxbak.tmp").exists());

    // The store moves on after the backup: one sandbox deleted, one created.
    let gone = sb_before
        .values()
        .find(|s| s.name == "one" && s.workspace == "beta")
        .expect("beta/one")
        .clone();
    let mut d = Sbxd::start(data.path(), "sim", &[]);
    d.sandboxes()
        .await
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: Some(SandboxRef {
                id: gone.id.clone(),
                ..Default::default()
            }),
        })
        .await
        .expect("delete");
    let late = create(&d, "alpha", "late", true).await;
    eventually(Duration::from_secs(20), "beta/one deleted", || async {
        (!d.all_sandboxes().await.contains_key(&gone.id)).then_some(())
    })
    .await;
    d.sigterm(STOP);
    // Then damaged: sled's log cut to nothing (a store this small can lose its second half
    // unharmed: what sled still reads lies in the first). sbxd refuses it.
    let log = data.path().join("store/db");
    std::fs::OpenOptions::new()
        .write(true)
        .open(&log)
        .unwrap()
        .set_len(0)
        .unwrap();
    let refused = store(&["check"], data.path());
    assert_ne!(refused.code, 0, "a cut store passes its check: {refused:?}");
    let (code, said) = refused_start(data.path());
    assert_eq!(code, 1, "sbxd on the cut store: {said}");
    let cut = std::fs::read(&log).unwrap();

    // Without --force: refused, and the damaged store is left as it is.
    let run = store(&["restore", backup.to_str().unwrap()], data.path());
    assert_eq!(run.code, 1, "{run:?}");
    assert!(
        run.stderr.contains("already holds a store") && run.stderr.contains("--force"),
        "{run:?}"
    );
    assert!(
        std::fs::read(&log).unwrap() == cut,
        "the refused restore touched the store"
    );

    let run = store(
        &["restore", "--force", backup.to_str().unwrap()],
        data.path(),
    );
    assert_eq!(run.code, 0, "{run:?}");
    assert_eq!(records_said(&run.stdout), records, "{run:?}");
    // The damaged store is kept aside, whole as it was, with its mark.
    let aside: Vec<_> = std::fs::read_dir(data.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            name.starts_with("store.before-restore-") && !name.ends_with(".high-water")
        })
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert!(std::fs::read(aside[0].join("db")).unwrap() == cut);
    let mut mark = aside[0].as_os_str().to_owned();
    mark.push(".high-water");
    assert!(Path::new(&mark).exists(), "its mark was not kept beside it");
    assert!(
        run.stdout.contains(&aside[0].display().to_string()),
        "{run:?}"
    );
    let check = store(&["check"], data.path());
    assert_eq!(check.code, 0, "the restored store: {check:?}");

    // sbxd serves it without --accept-store-loss, and serves exactly what was backed up.
    let d = Sbxd::start(data.path(), "sim", &[]);
    assert_eq!(workspaces(&d).await, ws_before);
    let sb_after = d.all_sandboxes().await;
    assert!(sb_after.contains_key(&gone.id), "the deleted one is back");
    assert!(
        !sb_after.contains_key(&late.id),
        "the one made later is served"
    );
    assert_eq!(
        sb_after.keys().collect::<Vec<_>>(),
        sb_before.keys().collect::<Vec<_>>()
    );
    for (id, before) in &sb_before {
        let after = &sb_after[id];
        if before.phase == Phase::Stopped as i32 {
            assert_eq!(after.resource_version, before.resource_version, "{id}");
        }
        assert_eq!(
            kept_across_restart(after),
            kept_across_restart(before),
            "{id}"
        );
    }
    assert!(
        !d.log_text().contains("serving a damaged store"),
        "{}",
        d.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_or_altered_backups_are_refused_and_change_nothing() {
    let data = DataDir::new();
    populated(data.path()).await;
    let backup = data.path().join("b.sbxbak");
    let path = backup.to_str().unwrap();
    assert_eq!(store(&["backup", path], data.path()).code, 0);
    let bytes = std::fs::read(&backup).unwrap();

    // An existing file is not replaced without --force.
    let run = store(&["backup", path], data.path());
    assert_eq!(run.code, 1, "{run:?}");
    assert!(run.stderr.contains("already exists"), "{run:?}");
    assert_eq!(std::fs::read(&backup).unwrap(), bytes);
    assert_eq!(store(&["backup", "--force", path], data.path()).code, 0);

    let mut altered = bytes.clone();
    altered[bytes.len() / 2] ^= 0x40;
    for (what, content, says) in [
        ("truncated", &bytes[..bytes.len() - 100], "truncated"),
        ("cut to its header", &bytes[..80], "truncated"),
        ("altered", &altered[..], "checksum mismatch"),
    ] {
        let bad = data
            .path()
            .join(format!("{}.sbxbak", what.replace(' ', "-")));
        std::fs::write(&bad, content).unwrap();
        let fresh = DataDir::new();
        let run = store(&["restore", bad.to_str().unwrap()], fresh.path());
        assert_eq!(run.code, 1, "{what}: {run:?}");
        assert!(
            run.stderr.contains(says) && run.stderr.contains(&bad.display().to_string()),
            "{what}: {run:?}"
        );
        assert!(
            std::fs::read_dir(fresh.path()).unwrap().next().is_none(),
            "{what}: the refused restore wrote into the data dir"
        );
    }
    // The same file unaltered restores.
    let fresh = DataDir::new();
    let run = store(&["restore", path], fresh.path());
    assert_eq!(run.code, 0, "{run:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_are_refused_while_sbxd_runs() {
    let data = DataDir::new();
    populated(data.path()).await;
    let backup = data.path().join("b.sbxbak");
    assert_eq!(
        store(&["backup", backup.to_str().unwrap()], data.path()).code,
        0
    );
    let d = Sbxd::start(data.path(), "sim", &[]);
    let served = d.all_sandboxes().await.len();

    let online = data.path().join("online.sbxbak");
    let run = store(&["backup", online.to_str().unwrap()], data.path());
    assert_eq!(run.code, 2, "{run:?}");
    assert!(
        run.stderr.contains("in use") && run.stderr.contains("stop it first"),
        "{run:?}"
    );
    assert!(!online.exists() && !data.path().join("online.sbxbak.tmp").exists());

    let run = store(
        &["restore", "--force", backup.to_str().unwrap()],
        data.path(),
    );
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("in use"), "{run:?}");
    let names: Vec<_> = std::fs::read_dir(data.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| n.starts_with("store.before-restore") || n.starts_with("store.restoring"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
    assert_eq!(
        d.all_sandboxes().await.len(),
        served,
        "sbxd still serves its store"
    );
}
