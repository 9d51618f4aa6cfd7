//! sbxd on PostgreSQL (`--store postgres://…`), black box, with a PostgreSQL server of the
//! test's own: a gateway keeps its workspaces and sandboxes there across restarts, with the
//! password never on its command line; and `sbxd store migrate` moves a stopped gateway's
//! embedded store there exactly (ids, names, specs, resource versions), refused while sbxd
//! runs and into a database that holds records.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use common::{CliRun, DataDir, Sbxd, eventually, kept_across_restart};
use sbx_proto::v1::{CreateSandboxRequest, CreateWorkspaceRequest, Phase, Sandbox, SandboxSpec};
use sbx_storage::conformance::postgres_server::TestPostgres;

const STOP: Duration = Duration::from_secs(30);

fn server() -> TestPostgres {
    TestPostgres::start().unwrap_or_else(|e| panic!("starting a test PostgreSQL server: {e}"))
}

/// A database `db` on `server` and a file holding its password, in `data`.
async fn database(server: &TestPostgres, db: &str, data: &Path) -> (String, String) {
    server.create_database(db).await.unwrap();
    let file = data.join(format!("{db}.password"));
    std::fs::write(&file, format!("{}\n", server.password())).unwrap();
    (server.url(db), file.display().to_string())
}

/// Workspace `ws` with sandboxes `one` (stopped) and `two` (running), settled.
async fn populate(d: &Sbxd, ws: &str) -> BTreeMap<String, Sandbox> {
    d.workspaces()
        .await
        .create_workspace(CreateWorkspaceRequest {
            name: ws.into(),
            labels: [("team".to_string(), ws.to_string())].into(),
        })
        .await
        .expect("create workspace");
    for (name, stopped) in [("one", true), ("two", false)] {
        d.sandboxes()
            .await
            .create_sandbox(CreateSandboxRequest {
                workspace: ws.into(),
                name: name.into(),
                spec: Some(SandboxSpec {
                    command: vec!["sleep".into(), "300".into()],
                    labels: [("tier".to_string(), name.to_string())].into(),
                    ..Default::default()
                }),
                stopped,
                ..Default::default()
            })
            .await
            .unwrap_or_else(|e| panic!("create {ws}/{name}: {e}"));
    }
    eventually(Duration::from_secs(20), "every sandbox settled", || async {
        let all = d.all_sandboxes().await;
        all.values()
            .all(|s| s.phase == Phase::Ready as i32 || s.phase == Phase::Stopped as i32)
            .then_some(all)
    })
    .await
}

fn all_kept(listed: &BTreeMap<String, Sandbox>) -> BTreeMap<String, Sandbox> {
    listed
        .iter()
        .map(|(id, s)| (id.clone(), kept_across_restart(s)))
        .collect()
}

fn migrate(data: &Path, url: &str, password_file: &str) -> CliRun {
    let mut cmd = common::sbxd_command();
    cmd.args([
        "store",
        "migrate",
        "--to",
        url,
        "--store-password-file",
        password_file,
    ])
    .arg("--data-dir")
    .arg(data)
    .env("SBX_LOG", "warn");
    common::run_bounded(&mut cmd, "sbxd store migrate")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_on_postgres_keeps_its_sandboxes_across_restarts() {
    let server = server();
    let data = DataDir::new();
    let (url, password_file) = database(&server, "gateway", data.path()).await;
    let store = ["--store", &url, "--store-password-file", &password_file];
    let mut d = Sbxd::start(data.path(), "sim", &store);
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", d.pid())).unwrap();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains(server.password()),
        "the password is on sbxd's command line"
    );
    assert!(
        d.log_text()
            .contains(&format!("127.0.0.1:{}/gateway", server.port())),
        "sbxd logs which store it opened:\n{}",
        d.log_text()
    );
    let before = populate(&d, "alpha").await;
    assert_eq!(before.len(), 2);
    // No embedded store is made beside a shared one.
    assert!(!data.path().join("store").exists());
    d.sigkill();

    // A restart, with the password from the environment this time.
    let mut d = Sbxd::start_with_env(
        data.path(),
        "sim",
        &["--store", &url],
        &[("SBX_STORE_PASSWORD", server.password())],
    );
    let after = eventually(Duration::from_secs(20), "every sandbox back", || async {
        let all = d.all_sandboxes().await;
        (all.len() == 2
            && all
                .values()
                .all(|s| s.phase == Phase::Ready as i32 || s.phase == Phase::Stopped as i32))
        .then_some(all)
    })
    .await;
    let stripped: BTreeMap<_, _> = after
        .iter()
        .map(|(id, s)| (id.clone(), kept_across_restart(s)))
        .collect();
    let expected = all_kept(&before);
    for (id, want) in &expected {
        let got = &stripped[id];
        assert_eq!(got.id, want.id);
        assert_eq!(got.name, want.name);
        assert_eq!(got.spec, want.spec);
        assert_eq!(got.created_at, want.created_at);
    }
    let (_, status) = d.sigterm(STOP);
    assert!(status.success(), "{status:?}");

    // A wrong password: sbxd refuses to start and says why.
    std::fs::write(&password_file, "wrong\n").unwrap();
    let mut cmd = common::sbxd_command();
    cmd.args(["serve", "--driver", "sim", "--listen", "127.0.0.1:0"])
        .args(["--store", &url, "--store-password-file", &password_file])
        .arg("--data-dir")
        .arg(data.path())
        .env("SBX_AUTH", "none")
        .env("SBX_LOG", "warn");
    let run = common::run_bounded(&mut cmd, "sbxd serve with a wrong password");
    assert_ne!(run.code, 0, "{run:?}");
    assert!(
        run.stderr.contains("password authentication failed"),
        "{run:?}"
    );
    assert!(
        run.stderr.contains("/gateway"),
        "the error names the store: {run:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_gateways_store_migrates_to_postgres_exactly() {
    let server = server();
    let data = DataDir::new();
    let (url, password_file) = database(&server, "moved", data.path()).await;

    let mut d = Sbxd::start(data.path(), "sim", &[]);
    let mut before = populate(&d, "alpha").await;
    before.extend(populate(&d, "beta").await);
    let before = all_kept(&before);
    // Refused while sbxd runs on the store.
    let run = migrate(data.path(), &url, &password_file);
    assert_eq!(run.code, 2, "{run:?}");
    assert!(run.stderr.contains("is sbxd running"), "{run:?}");
    let (_, status) = d.sigterm(STOP);
    assert!(status.success(), "{status:?}");

    let run = migrate(data.path(), &url, &password_file);
    assert_eq!(run.code, 0, "{run:?}");
    assert!(run.stdout.contains("checked the copy"), "{run:?}");
    // Once copied, the database holds records: a second copy is refused.
    let again = migrate(data.path(), &url, &password_file);
    assert_eq!(again.code, 1, "{again:?}");
    assert!(again.stderr.contains("empty database"), "{again:?}");

    // A gateway on the copy serves exactly what the embedded store held.
    let store = ["--store", &url, "--store-password-file", &password_file];
    let mut d = Sbxd::start(data.path(), "sim", &store);
    let after = eventually(Duration::from_secs(20), "every sandbox back", || async {
        let all = d.all_sandboxes().await;
        (all.len() == before.len()).then_some(all)
    })
    .await;
    for (id, want) in &before {
        let got = kept_across_restart(&after[id]);
        if want.phase == Phase::Stopped as i32 {
            assert_eq!(&got, want, "a stopped sandbox is copied exactly");
        } else {
            assert_eq!((&got.name, &got.spec), (&want.name, &want.spec));
        }
    }
    let (_, status) = d.sigterm(STOP);
    assert!(status.success(), "{status:?}");
}

/// `--store-tls-ca`: a gateway reaches a PostgreSQL that takes TLS only and serves on it
/// (and keeps what it wrote across a restart); without the flag, or with another CA, sbxd
/// refuses to start and says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_talks_to_postgres_over_tls_with_the_ca_it_is_given() {
    let mut server = server();
    let certs = DataDir::new();
    let (ca, cert, key) = sbx_storage::conformance::postgres_server::tls_files(certs.path(), "pg");
    let (other_ca, _, _) =
        sbx_storage::conformance::postgres_server::tls_files(certs.path(), "other");
    server.require_tls(&cert, &key).unwrap();
    let data = DataDir::new();
    let (url, password_file) = database(&server, "secure", data.path()).await;
    let ca = ca.display().to_string();
    let flags = |ca: &str| {
        vec![
            "--store".to_string(),
            url.clone(),
            "--store-password-file".to_string(),
            password_file.clone(),
            "--store-tls-ca".to_string(),
            ca.to_string(),
        ]
    };
    let args = flags(&ca);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut d = Sbxd::start(data.path(), "sim", &args);
    let before = populate(&d, "alpha").await;
    let (_, status) = d.sigterm(STOP);
    assert!(status.success(), "{status:?}");
    let mut d = Sbxd::start(data.path(), "sim", &args);
    let after = eventually(Duration::from_secs(20), "every sandbox back", || async {
        let all = d.all_sandboxes().await;
        (all.len() == before.len()).then_some(all)
    })
    .await;
    assert_eq!(all_kept(&after), all_kept(&before));
    d.sigterm(STOP);

    let refused = |extra: &[&str], what: &str| {
        let mut cmd = common::sbxd_command();
        cmd.args(["serve", "--driver", "sim", "--listen", "127.0.0.1:0"])
            .args(["--store", &url, "--store-password-file", &password_file])
            .args(extra)
            .arg("--data-dir")
            .arg(data.path())
            .env("SBX_AUTH", "none")
            .env("SBX_LOG", "warn");
        let run = common::run_bounded(&mut cmd, what);
        assert_ne!(run.code, 0, "{what}: {run:?}");
        run.stderr
    };
    let plain = refused(&[], "sbxd serve without TLS");
    assert!(plain.contains("/secure"), "names the store: {plain}");
    assert!(
        plain.to_lowercase().contains("no encryption") || plain.to_lowercase().contains("ssl"),
        "{plain}"
    );
    let other = other_ca.display().to_string();
    let wrong = refused(&["--store-tls-ca", &other], "sbxd serve with another CA");
    assert!(wrong.to_lowercase().contains("certificate"), "{wrong}");
}
