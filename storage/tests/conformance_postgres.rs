//! The PostgreSQL store: the store conformance suite on a PostgreSQL server of the test's own
//! (one server, a fresh database per check), and what only a store on a server has: a schema
//! shared by gateways that open it at once, a server that goes away and comes back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sbx_storage::conformance::postgres_server::TestPostgres;
use sbx_storage::conformance::{new_sandbox, new_workspace};
use sbx_storage::{Kind, ObjectStore, PG_SCHEMA_VERSION, PgStore, SchemaOutcome, StoreError};

fn server() -> TestPostgres {
    TestPostgres::start().unwrap_or_else(|e| panic!("starting a test PostgreSQL server: {e}"))
}

async fn store_in(server: &TestPostgres, db: &str) -> PgStore {
    server.create_database(db).await.unwrap();
    PgStore::connect(server.config(db)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_passes_the_store_conformance_suite() {
    let server = server();
    sbx_storage::conformance::run_each(|check| {
        let server = &server;
        async move {
            let store = store_in(server, check).await;
            ((), Arc::new(store) as Arc<dyn ObjectStore>)
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_opening_one_database_at_once_create_its_schema_once() {
    let server = server();
    server.create_database("shared").await.unwrap();
    let opens: Vec<_> = (0..5)
        .map(|_| {
            let config = server.config("shared");
            tokio::spawn(async move { PgStore::connect(config).await })
        })
        .collect();
    let mut outcomes = Vec::new();
    let mut stores = Vec::new();
    for open in opens {
        let store = open.await.unwrap().unwrap();
        outcomes.push(store.schema_outcome().clone());
        stores.push(store);
    }
    let initialized = outcomes
        .iter()
        .filter(|o| **o == SchemaOutcome::Initialized)
        .count();
    assert_eq!(initialized, 1, "{outcomes:?}");
    // Every gateway writes into one revision order and sees the others' writes.
    let ws = stores[0].create(new_workspace("team")).await.unwrap();
    let sb = stores[1].create(new_sandbox(ws.id, "web")).await.unwrap();
    assert!(sb.resource_version > ws.resource_version);
    // Each store counts what it committed (the gateway's store metrics).
    let counted = stores[1].commit_stats().unwrap();
    assert_eq!((counted.writes, counted.flushes), (1, 1));
    assert!(counted.flush_micros > 0);
    let seen = stores[4]
        .get_by_name(Kind::Sandbox, Some(ws.id), "web")
        .await
        .unwrap();
    assert_eq!(seen, Some(sb));
    assert_eq!(
        stores[2].current_revision().await.unwrap(),
        stores[3].current_revision().await.unwrap()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_of_a_newer_schema_is_refused_untouched() {
    let server = server();
    let store = store_in(&server, "newer").await;
    store.create(new_workspace("team")).await.unwrap();
    drop(store);
    let (client, conn) = server
        .config("newer")
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    let newer = i64::from(PG_SCHEMA_VERSION) + 1;
    client
        .execute(
            "UPDATE sbx_meta SET value = $1 WHERE key = 'schema_version'",
            &[&newer],
        )
        .await
        .unwrap();
    let err = PgStore::connect(server.config("newer")).await.unwrap_err();
    match &err {
        StoreError::Schema {
            store,
            found,
            supported,
            ..
        } => {
            assert!(
                store.contains(&format!("127.0.0.1:{}/newer", server.port())),
                "{store}"
            );
            assert_eq!(found, &newer.to_string());
            assert_eq!(*supported, PG_SCHEMA_VERSION);
        }
        other => panic!("expected Schema, got {other:?}"),
    }
    assert!(err.to_string().contains("newer sbx"), "{err}");
    let row = client
        .query_one("SELECT count(*) FROM sbx_records", &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i64>(0), 1, "the refused open changed nothing");
    drop(client);
    let _ = task.await;
}

/// A version-1 database (before the change log) is migrated when opened: its records stay,
/// and its change log begins at the revision it had — a read from before is `ChangesTooOld`,
/// never a silent gap — and from then on holds every sandbox write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_1_database_is_migrated_and_its_change_log_begins_there() {
    let server = server();
    let store = store_in(&server, "old").await;
    let ws = store.create(new_workspace("team")).await.unwrap();
    let old = store.create(new_sandbox(ws.id, "old")).await.unwrap();
    drop(store);
    // Back to version 1, as a build before the change log left it.
    let (client, conn) = server
        .config("old")
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap();
    let task = tokio::spawn(conn);
    client
        .batch_execute(
            "DROP TABLE sbx_changes; DELETE FROM sbx_meta WHERE key = 'changes_from'; \
             UPDATE sbx_meta SET value = 1 WHERE key = 'schema_version';",
        )
        .await
        .unwrap();
    let store = PgStore::connect(server.config("old")).await.unwrap();
    assert_eq!(store.schema_outcome(), &SchemaOutcome::Migrated { from: 1 });
    assert!(store.integrity_problems().await.unwrap().is_empty());
    assert_eq!(store.get(old.id).await.unwrap(), Some(old.clone()));
    let at = old.resource_version;
    assert_eq!(store.change_log_start().await.unwrap(), Some(at));
    let err = store.changes_after(at - 1, 10).await.unwrap_err();
    assert!(
        matches!(err, StoreError::ChangesTooOld { requested, oldest } if requested == at - 1 && oldest == at),
        "{err:?}"
    );
    let new = store.create(new_sandbox(ws.id, "new")).await.unwrap();
    let changes = store.changes_after(at, 10).await.unwrap();
    assert_eq!(changes.len(), 1);
    assert_eq!(changes[0].record, new);
    drop(client);
    let _ = task.await;
}

/// The change log keeps the last revisions it is told to and no more: what it trimmed is
/// `ChangesTooOld`, what it kept is all there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_change_log_is_trimmed_to_what_it_keeps() {
    let server = server();
    let store = store_in(&server, "trim")
        .await
        .with_change_log_revisions(20);
    let ws = store.create(new_workspace("team")).await.unwrap();
    let mut sb = store.create(new_sandbox(ws.id, "web")).await.unwrap();
    for i in 0..60u32 {
        sb.body = i.to_be_bytes().to_vec();
        sb = store.update(sb).await.unwrap();
    }
    let now = store.current_revision().await.unwrap();
    let start = store.change_log_start().await.unwrap().unwrap();
    assert!(
        start >= now - 25 && start <= now - 20,
        "the log starts at {start}, the revision is {now}"
    );
    let kept = store.changes_after(start, 100).await.unwrap();
    let revisions: Vec<u64> = kept.iter().map(|c| c.revision).collect();
    assert_eq!(revisions, ((start + 1)..=now).collect::<Vec<_>>());
    assert!(matches!(
        store.changes_after(start - 1, 100).await,
        Err(StoreError::ChangesTooOld { .. })
    ));
    assert!(store.integrity_problems().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_password_or_no_server_is_said_so() {
    let server = server();
    server.create_database("auth").await.unwrap();
    let mut config = server.config("auth");
    config.password("not-the-password");
    let err = PgStore::connect(config).await.unwrap_err();
    assert!(
        err.to_string().contains("password authentication failed"),
        "{err}"
    );
    // Nothing listens on a port of a stopped server: unavailable, within the connect wait.
    let config = server.config("auth");
    drop(server);
    let began = Instant::now();
    let err = PgStore::connect(config).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "{:?}",
        began.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_the_server_is_down_writes_are_unavailable_and_nothing_acknowledged_is_lost() {
    let mut server = server();
    let store = store_in(&server, "restart").await;
    let ws = store.create(new_workspace("team")).await.unwrap();
    let mut acknowledged = Vec::new();
    for i in 0..20 {
        acknowledged.push(
            store
                .create(new_sandbox(ws.id, &format!("before-{i}")))
                .await
                .unwrap(),
        );
    }
    // A crash of the server (no clean shutdown): what was committed is in its WAL.
    server.stop("immediate").unwrap();
    let err = store
        .create(new_sandbox(ws.id, "while-down"))
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        err.to_string()
            .contains(&format!("127.0.0.1:{}/restart", server.port())),
        "the error names the store: {err}"
    );
    server.start_again().unwrap();
    // The pool replaces its broken connections by itself: within a few tries the store
    // writes again, with no reopen.
    let began = Instant::now();
    let after = loop {
        match store.create(new_sandbox(ws.id, "after")).await {
            Ok(rec) => break rec,
            Err(e) if e.is_unavailable() && began.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("no write after the restart: {e:?}"),
        }
    };
    for rec in &acknowledged {
        assert_eq!(store.get(rec.id).await.unwrap().as_ref(), Some(rec));
    }
    assert!(after.resource_version > acknowledged.last().unwrap().resource_version);
    assert!(
        store
            .get_by_name(Kind::Sandbox, Some(ws.id), "while-down")
            .await
            .unwrap()
            .is_none()
    );
    sbx_storage::conformance::assert_integrity(&store).await;
}

/// TLS to PostgreSQL: a server that takes TLS only is reached with its CA, the store works
/// over it; without TLS it refuses the connection, and a certificate another CA signed is
/// refused by the store — each said so, naming the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tls_the_server_is_checked_and_plain_connections_refused() {
    let mut server = server();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = sbx_storage::conformance::postgres_server::tls_files(dir.path(), "right");
    let (other_ca, _, _) =
        sbx_storage::conformance::postgres_server::tls_files(dir.path(), "other");
    server.require_tls(&cert, &key).unwrap();
    server.create_database("tls").await.unwrap();

    let tls = sbx_tls::rustls_client_config(&ca).unwrap();
    let store = PgStore::connect_with(server.config("tls"), Some(tls))
        .await
        .expect("the store over TLS");
    let ws = store.create(new_workspace("team")).await.unwrap();
    assert_eq!(store.get(ws.id).await.unwrap(), Some(ws));

    let plain = PgStore::connect(server.config("tls")).await.unwrap_err();
    assert!(
        plain
            .to_string()
            .contains(&format!("127.0.0.1:{}/tls", server.port())),
        "{plain}"
    );
    assert!(
        plain.to_string().to_lowercase().contains("no encryption")
            || plain.to_string().to_lowercase().contains("ssl"),
        "the refusal says why: {plain}"
    );
    let wrong = sbx_tls::rustls_client_config(&other_ca).unwrap();
    let err = PgStore::connect_with(server.config("tls"), Some(wrong))
        .await
        .unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("certificate"),
        "a certificate of another CA: {err}"
    );
}
