//! Checks of identity: resolution by id only, bad ids refused, workspace and name
//! round-tripped, workloads found again by id after the driver restarts.

use super::DriverHarness;
use super::session::{Session, assert_untouched, describe, run_check, state_of};
use crate::{DriverError, pb};

/// Two sandboxes named `demo`, in workspaces `alpha` and `beta`: stop, start and delete by id
/// act on the target only; the other keeps its state, instance id and generation.
pub async fn same_name_in_two_workspaces(h: &dyn DriverHarness) {
    run_check(h, "same_name_in_two_workspaces", |s| {
        Box::pin(same_name_body(s))
    })
    .await;
}

async fn same_name_body(s: &mut Session<'_>) {
    let alpha = s.create_running("alpha", "demo", 1).await;
    let beta = s.create_running("beta", "demo", 1).await;
    let (a, b) = (alpha.sandbox_id.clone(), beta.sandbox_id.clone());
    assert_eq!(
        (alpha.workspace.as_str(), alpha.name.as_str()),
        ("alpha", "demo"),
        "[{}]",
        s.check()
    );
    assert_eq!(
        (beta.workspace.as_str(), beta.name.as_str()),
        ("beta", "demo"),
        "[{}]",
        s.check()
    );

    s.stop(&a).await;
    assert_untouched(s, &b, &beta, "stop of alpha/demo").await;

    let restarted = s.start(&a, 2).await;
    assert_eq!(
        restarted.generation,
        2,
        "[{}] start of alpha/demo under generation 2",
        s.check()
    );
    s.wait_for_state(&a, pb::State::Running).await;
    assert_untouched(s, &b, &beta, "start of alpha/demo").await;

    assert!(
        s.delete(&a).await,
        "[{}] delete of alpha/demo reported nothing deleted",
        s.check()
    );
    let gone = s.try_get(&a).await;
    assert!(
        matches!(gone, Err(DriverError::NotFound { .. })),
        "[{}] alpha/demo after delete: {}",
        s.check(),
        describe(&gone)
    );
    assert_untouched(s, &b, &beta, "delete of alpha/demo").await;
    let listed = s.listed(&b).await;
    assert_eq!(
        listed.len(),
        1,
        "[{}] beta/demo must be listed once: {listed:?}",
        s.check()
    );
    assert!(
        s.listed(&a).await.is_empty(),
        "[{}] deleted alpha/demo is still listed",
        s.check()
    );

    // And the other way round: the survivor can still be acted on, by its own id.
    s.stop(&b).await;
}

/// An empty or malformed sandbox id is `InvalidArgument` for create, start, stop, delete,
/// get, exec and logs, and a create with such an id makes nothing.
pub async fn empty_and_malformed_ids_are_invalid(h: &dyn DriverHarness) {
    run_check(h, "empty_and_malformed_ids_are_invalid", |s| {
        Box::pin(invalid_ids_body(s))
    })
    .await;
}

async fn invalid_ids_body(s: &mut Session<'_>) {
    const PROBE_NAME: &str = "invalid-id-probe";
    let check = s.check();
    for bad in [
        "",
        "demo",
        "not-a-uuid",
        "00000000-0000-0000-0000-00000000000g",
    ] {
        let expect_invalid = |op: &str, answer: Result<(), DriverError>| {
            assert!(
                matches!(answer, Err(DriverError::InvalidArgument(_))),
                "[{check}] {op} with sandbox id {bad:?} must be InvalidArgument, got {answer:?}"
            );
        };
        let create = pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id: bad.to_string(),
            workspace: "alpha".to_string(),
            name: PROBE_NAME.to_string(),
            spec: Some(s.h.long_running_spec()),
            generation: 1,
            stopped: false,
        };
        expect_invalid(
            "create",
            s.call("create", s.driver().create(create)).await.map(drop),
        );
        expect_invalid("start", s.try_start(bad, 1).await.map(drop));
        expect_invalid("stop", s.try_stop(bad).await.map(drop));
        expect_invalid("delete", s.try_delete(bad).await.map(drop));
        expect_invalid("get", s.try_get(bad).await.map(drop));
        expect_invalid(
            "exec",
            s.try_exec(bad, s.h.exec_echo("hello")).await.map(drop),
        );
        let logs = pb::LogsRequest {
            sandbox_id: bad.to_string(),
            follow: false,
            tail_lines: 0,
            ..Default::default()
        };
        expect_invalid(
            "logs",
            s.call("logs", s.driver().logs(logs)).await.map(drop),
        );
    }
    let made: Vec<_> = s
        .list()
        .await
        .into_iter()
        .filter(|x| x.name == PROBE_NAME)
        .collect();
    assert!(
        made.is_empty(),
        "[{check}] a create with a bad id made sandboxes: {made:?}"
    );
}

/// The driver instance crashes and a new one opens on the same state: running workloads are
/// found by id, still running, same instance id and generation; stopped ones are still
/// stopped; and the new instance can act on them.
pub async fn workloads_survive_driver_restart(h: &dyn DriverHarness) {
    run_check(h, "workloads_survive_driver_restart", |s| {
        Box::pin(restart_body(s))
    })
    .await;
}

async fn restart_body(s: &mut Session<'_>) {
    let check = s.check();
    let running = s.create_running("alpha", "keeps-running", 3).await;
    let stopped = s.create_running("alpha", "was-stopped", 1).await;
    let stopped = s.stop(&stopped.sandbox_id).await;

    s.kill_and_reopen().await;

    let found = s.get(&running.sandbox_id).await;
    let key = |x: &pb::Snapshot| {
        (
            state_of(x),
            x.generation,
            x.instance_id.clone(),
            x.workspace.clone(),
            x.name.clone(),
        )
    };
    assert_eq!(
        key(&found),
        key(&running),
        "[{check}] a running workload must survive the driver and be found again unchanged"
    );
    let found_stopped = s.get(&stopped.sandbox_id).await;
    assert_eq!(
        (
            state_of(&found_stopped),
            found_stopped.workspace.as_str(),
            found_stopped.name.as_str()
        ),
        (pb::State::Stopped, "alpha", "was-stopped"),
        "[{check}] a stopped workload must still be stopped after the driver restarts"
    );
    for id in [&running.sandbox_id, &stopped.sandbox_id] {
        assert_eq!(
            s.listed(id).await.len(),
            1,
            "[{check}] {id} must be listed once after the restart"
        );
    }

    // The new instance controls what the old one started.
    s.stop(&running.sandbox_id).await;
    s.start(&running.sandbox_id, 4).await;
    let again = s
        .wait_for_state(&running.sandbox_id, pb::State::Running)
        .await;
    assert_eq!(
        again.generation, 4,
        "[{check}] restart through the new instance"
    );
}

/// List reports every sandbox once, with workspace and name exactly as sent, before and after
/// a state change.
pub async fn list_round_trips_workspace_and_name(h: &dyn DriverHarness) {
    run_check(h, "list_round_trips_workspace_and_name", |s| {
        Box::pin(list_body(s))
    })
    .await;
}

async fn list_body(s: &mut Session<'_>) {
    let check = s.check();
    let longest = format!("n{}", "0123456789-".repeat(6).trim_end_matches('-'));
    let longest = &longest[..sbx_proto::names::MAX_NAME_LEN];
    let sent = [
        ("alpha", "demo", 1),
        ("beta", "demo", 2),
        ("default", "a-1-b", 3),
        ("w-2", longest, 4),
    ];
    let mut ids = Vec::new();
    for (workspace, name, generation) in sent {
        ids.push(
            s.create_running(workspace, name, generation)
                .await
                .sandbox_id,
        );
    }
    s.stop(&ids[0]).await;
    let list = s.list().await;
    for (id, (workspace, name, generation)) in ids.iter().zip(sent) {
        let entries: Vec<_> = list.iter().filter(|x| x.sandbox_id == *id).collect();
        assert_eq!(
            entries.len(),
            1,
            "[{check}] {workspace}/{name} ({id}) listed {} times",
            entries.len()
        );
        let entry = entries[0];
        let want_state = if *id == ids[0] {
            pb::State::Stopped
        } else {
            pb::State::Running
        };
        assert_eq!(
            (
                entry.workspace.as_str(),
                entry.name.as_str(),
                entry.generation,
                state_of(entry)
            ),
            (workspace, name, generation, want_state),
            "[{check}] list entry of {id}"
        );
    }
}
