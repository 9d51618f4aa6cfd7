//! PostgreSQL restarted (as a crash: `pg_ctl stop -m immediate`) under a stream of creates
//! through sbxd: every create sbxd acknowledged is there afterwards, exactly once; the creates
//! sent while the database was down were answered (`UNAVAILABLE`, never a hang), and creates
//! succeed again once it is back, with no restart of sbxd.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd};
use sbx_proto::v1::{CreateSandboxRequest, SandboxSpec};
use sbx_storage::conformance::postgres_server::TestPostgres;

/// How long the stream of creates runs in all; the database is down in the middle of it.
const STREAM: Duration = Duration::from_secs(12);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_acknowledged_create_is_lost_or_doubled_across_a_database_restart() {
    let mut server = TestPostgres::start().expect("a PostgreSQL server");
    server.create_database("restart").await.unwrap();
    let secrets = DataDir::new();
    let pw = secrets.path().join("pw");
    std::fs::write(&pw, server.password()).unwrap();
    let data = DataDir::new();
    let d = Sbxd::start(
        data.path(),
        "sim",
        &[
            "--store",
            &server.url("restart"),
            "--store-password-file",
            pw.to_str().unwrap(),
        ],
    );
    let mut client = d.sandboxes().await;
    let mut acknowledged = Vec::new();
    let mut refused: BTreeMap<String, usize> = BTreeMap::new();
    let began = Instant::now();
    let mut stopped_at = None;
    let mut restarted_at = None;
    let mut after_restart = 0;
    let mut i = 0;
    while began.elapsed() < STREAM {
        if stopped_at.is_none() && began.elapsed() > Duration::from_secs(3) {
            server.stop("immediate").unwrap();
            stopped_at = Some(began.elapsed());
        }
        if restarted_at.is_none() && began.elapsed() > Duration::from_secs(5) {
            server.start_again().unwrap();
            restarted_at = Some(began.elapsed());
        }
        let name = format!("c{i}");
        i += 1;
        let sent = Instant::now();
        let answer = tokio::time::timeout(
            Duration::from_secs(30),
            client.create_sandbox(CreateSandboxRequest {
                name: name.clone(),
                spec: Some(SandboxSpec {
                    command: vec!["sleep".into(), "100".into()],
                    ..Default::default()
                }),
                ..Default::default()
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("create {name} hung for 30 s"));
        match answer {
            Ok(_) => {
                acknowledged.push(name);
                if restarted_at.is_some() {
                    after_restart += 1;
                }
                // A steady stream, under the 1,000 one list page holds.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(status) => {
                *refused.entry(format!("{:?}", status.code())).or_default() += 1;
                assert!(
                    sent.elapsed() < Duration::from_secs(15),
                    "a refusal took {:?}: {status}",
                    sent.elapsed()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(stopped_at.is_some() && restarted_at.is_some());
    assert!(!refused.is_empty(), "no create met the database down");
    assert!(after_restart > 0, "no create succeeded after the restart");
    // Every acknowledged create is there, once; nothing else was made twice.
    let listed = d.all_sandboxes().await;
    assert!(
        listed.len() < 1000,
        "more than one list page: {}",
        listed.len()
    );
    let mut names: BTreeMap<String, usize> = BTreeMap::new();
    for s in listed.values() {
        *names.entry(s.name.clone()).or_default() += 1;
    }
    for name in &acknowledged {
        assert_eq!(names.get(name), Some(&1), "acknowledged create {name}");
    }
    assert!(names.values().all(|n| *n == 1), "{names:?}");
    eprintln!(
        "{} creates sent, {} acknowledged ({} after the restart), refused while down: \
         {refused:?}; stopped at {stopped_at:?}, started again at {restarted_at:?}",
        i,
        acknowledged.len(),
        after_restart
    );
}
