//! The checks of the conformance suite. Each public function is one check; see the module
//! docs of [`conformance`](super) for how to run them.

use std::time::Duration;

use futures::StreamExt;
use tokio::time::{Instant, timeout};
use uuid::Uuid;

use super::DriverHarness;
use super::session::{Session, describe, run_check};
use crate::{DriverError, pb};

fn state_of(snapshot: &pb::Snapshot) -> pb::State {
    pb::State::try_from(snapshot.state).unwrap_or(pb::State::Unspecified)
}

/// Asserts that `id` is exactly as `before` showed it: same state, generation, instance id,
/// workspace and name.
async fn assert_untouched(s: &Session<'_>, id: &str, before: &pb::Snapshot, after_what: &str) {
    let now = s.get(id).await;
    let key = |x: &pb::Snapshot| {
        (
            x.state,
            x.generation,
            x.instance_id.clone(),
            x.workspace.clone(),
            x.name.clone(),
        )
    };
    assert_eq!(
        key(&now),
        key(before),
        "[{}] {after_what} changed another sandbox ({id}): was {}, now {}",
        s.check(),
        describe(&Ok(before.clone())),
        describe(&Ok(now.clone()))
    );
}

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
            sandbox_id: bad.to_string(),
            workspace: "alpha".to_string(),
            name: PROBE_NAME.to_string(),
            spec: Some(s.h.long_running_spec()),
            generation: 1,
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

/// Stop of a stopped sandbox, start of a running one under its generation, and delete of an
/// absent one succeed without doing anything; get of an absent one is `NotFound`.
pub async fn idempotent_stop_start_delete(h: &dyn DriverHarness) {
    run_check(h, "idempotent_stop_start_delete", |s| {
        Box::pin(idempotent_body(s))
    })
    .await;
}

async fn idempotent_body(s: &mut Session<'_>) {
    let check = s.check();
    let first = s.create_running("alpha", "demo", 1).await;
    let id = first.sandbox_id.clone();

    let again = s.start(&id, 1).await;
    assert_eq!(
        (state_of(&again), &again.instance_id, again.generation),
        (pb::State::Running, &first.instance_id, 1),
        "[{check}] start of a running sandbox under its generation must do nothing"
    );
    assert_untouched(s, &id, &first, "a second start").await;

    let stopped = s.stop(&id).await;
    let stop_again = s.try_stop(&id).await;
    let stop_again =
        stop_again.unwrap_or_else(|e| panic!("[{check}] stop of a stopped sandbox failed: {e}"));
    assert_eq!(
        state_of(&stop_again),
        pb::State::Stopped,
        "[{check}] second stop answered {stop_again:?}"
    );
    assert_untouched(s, &id, &stopped, "a second stop").await;

    let restarted = s.start(&id, 2).await;
    assert_eq!(
        restarted.generation, 2,
        "[{check}] restart under generation 2"
    );
    let running = s.wait_for_state(&id, pb::State::Running).await;
    assert_ne!(
        running.instance_id, first.instance_id,
        "[{check}] a restarted workload must report a new instance id"
    );

    assert!(
        s.delete(&id).await,
        "[{check}] the first delete must report deleted = true"
    );
    assert!(
        !s.delete(&id).await,
        "[{check}] a second delete must report deleted = false"
    );
    let absent = Uuid::new_v4().to_string();
    assert!(
        !s.delete(&absent).await,
        "[{check}] delete of a never-created id"
    );
    assert!(
        !s.delete(&absent).await,
        "[{check}] second delete of a never-created id"
    );
    let get = s.try_get(&absent).await;
    assert!(
        matches!(&get, Err(DriverError::NotFound { sandbox_id }) if *sandbox_id == absent),
        "[{check}] get of an absent id must be NotFound naming it, got {}",
        describe(&get)
    );
}

/// The generation sent at create and start is the one get and list report; create or start
/// under another generation while the workload runs is `GenerationMismatch` naming both.
pub async fn generation_round_trip_and_mismatch(h: &dyn DriverHarness) {
    run_check(h, "generation_round_trip_and_mismatch", |s| {
        Box::pin(generation_body(s))
    })
    .await;
}

async fn generation_body(s: &mut Session<'_>) {
    let check = s.check();
    let req = s.create_request("alpha", "demo", s.h.long_running_spec(), 7);
    let id = req.sandbox_id.clone();
    let created = s.create(req.clone()).await;
    assert_eq!(
        created.generation, 7,
        "[{check}] create must report the generation it was sent"
    );
    let running = s.wait_for_state(&id, pb::State::Running).await;
    assert_eq!(running.generation, 7, "[{check}] get after create");
    let listed = s.listed(&id).await;
    assert_eq!(
        listed.iter().map(|x| x.generation).collect::<Vec<_>>(),
        [7],
        "[{check}] list after create"
    );

    let recreated = s.create(req.clone()).await;
    assert_eq!(
        (recreated.generation, &recreated.instance_id),
        (7, &running.instance_id),
        "[{check}] create again under the same generation must do nothing"
    );

    let mismatch = DriverError::GenerationMismatch {
        sandbox_id: id.clone(),
        running: 7,
        requested: 8,
    };
    let start = s.try_start(&id, 8).await;
    assert_eq!(
        start,
        Err(mismatch.clone()),
        "[{check}] start under another generation while running"
    );
    let create = s
        .call(
            "create",
            s.driver().create(pb::CreateRequest {
                generation: 8,
                ..req
            }),
        )
        .await;
    assert_eq!(
        create,
        Err(mismatch),
        "[{check}] create under another generation while running"
    );
    assert_untouched(s, &id, &running, "a refused start").await;

    s.stop(&id).await;
    let restarted = s.start(&id, 9).await;
    assert_eq!(
        restarted.generation, 9,
        "[{check}] start must report the generation it was sent"
    );
    let running = s.wait_for_state(&id, pb::State::Running).await;
    assert_eq!(running.generation, 9, "[{check}] get after start");
    let listed = s.listed(&id).await;
    assert_eq!(
        listed.iter().map(|x| x.generation).collect::<Vec<_>>(),
        [9],
        "[{check}] list after start"
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

/// Exec returns the command's stdout and exit code; exec into a stopped sandbox is
/// `FailedPrecondition`. Skipped when the driver does not report exec.
pub async fn exec_returns_stdout_and_exit_code(h: &dyn DriverHarness) {
    run_check(h, "exec_returns_stdout_and_exit_code", |s| {
        Box::pin(exec_body(s))
    })
    .await;
}

async fn exec_body(s: &mut Session<'_>) {
    let check = s.check();
    if !s.capabilities().await.exec {
        eprintln!("conformance: {check} skipped: the driver does not report exec");
        return;
    }
    let id = s.create_running("alpha", "demo", 1).await.sandbox_id;
    let echo = s.exec(&id, s.h.exec_echo("hello")).await;
    assert_eq!(
        (echo.stdout.as_str(), echo.exit_code),
        ("hello\n", Some(0)),
        "[{check}] exec echo hello (stderr {:?})",
        echo.stderr
    );
    let exit = s.exec(&id, s.h.exec_exit(3)).await;
    assert_eq!(
        exit.exit_code,
        Some(3),
        "[{check}] exec of a command that exits 3: {exit:?}"
    );

    s.stop(&id).await;
    let stopped = s.try_exec(&id, s.h.exec_echo("hello")).await;
    assert!(
        matches!(stopped, Err(DriverError::FailedPrecondition(_))),
        "[{check}] exec into a stopped sandbox must be FailedPrecondition, got {:?}",
        stopped.err()
    );
}

/// A workload whose main process exits by itself shows EXITED with its exit code (3, and 0),
/// and a start under a new generation runs it again. Skipped when the harness has no
/// exiting spec.
pub async fn self_exit_shows_exited_with_code(h: &dyn DriverHarness) {
    run_check(h, "self_exit_shows_exited_with_code", |s| {
        Box::pin(self_exit_body(s))
    })
    .await;
}

async fn self_exit_body(s: &mut Session<'_>) {
    let check = s.check();
    for code in [3, 0] {
        let Some(spec) = s.h.exiting_spec(code) else {
            eprintln!("conformance: {check} skipped: the harness has no exiting spec");
            return;
        };
        let req = s.create_request("alpha", &format!("exits-{code}"), spec, 1);
        let id = req.sandbox_id.clone();
        s.create(req).await;
        let exited = s.wait_for_state(&id, pb::State::Exited).await;
        assert_eq!(
            exited.exit_code, code,
            "[{check}] exit code of a workload that exits {code}"
        );
        assert_eq!(
            exited.generation, 1,
            "[{check}] an exited workload keeps its generation"
        );

        let restarted = s.start(&id, 2).await;
        assert_eq!(
            restarted.generation, 2,
            "[{check}] start of an exited workload"
        );
        let exited = s.wait_for_state(&id, pb::State::Exited).await;
        assert_eq!(
            (exited.exit_code, exited.generation),
            (code, 2),
            "[{check}] the second run exits too"
        );
    }
}

/// Watch reports a workload that exits by itself: an event for its id with state EXITED and
/// its exit code arrives within the settle timeout. Skipped without watch or exiting spec.
pub async fn watch_reports_self_exit(h: &dyn DriverHarness) {
    run_check(h, "watch_reports_self_exit", |s| Box::pin(watch_body(s))).await;
}

async fn watch_body(s: &mut Session<'_>) {
    let check = s.check();
    let Some(spec) = s.h.exiting_spec(3) else {
        eprintln!("conformance: {check} skipped: the harness has no exiting spec");
        return;
    };
    if !s.capabilities().await.watch {
        eprintln!("conformance: {check} skipped: the driver does not report watch");
        return;
    }
    let mut events = s
        .call("watch", s.driver().watch())
        .await
        .unwrap_or_else(|e| panic!("[{check}] watch failed: {e}"));
    let req = s.create_request("alpha", "exits-3", spec, 1);
    let id = req.sandbox_id.clone();
    s.create(req).await;

    let settle = s.h.settle_timeout();
    let give_up = Instant::now() + settle;
    let mut seen = Vec::new();
    loop {
        let left = give_up
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1));
        match timeout(left, events.next()).await {
            Ok(Some(Ok(event))) => {
                let Some(snapshot) = event.snapshot else {
                    continue;
                };
                if snapshot.sandbox_id != id {
                    continue;
                }
                if state_of(&snapshot) == pb::State::Exited && !event.deleted {
                    assert_eq!(snapshot.exit_code, 3, "[{check}] watch event of the exit");
                    return;
                }
                seen.push(describe(&Ok(snapshot)));
            }
            Ok(Some(Err(e))) => panic!("[{check}] watch stream failed: {e}"),
            Ok(None) => panic!("[{check}] watch stream ended before the exit; saw {seen:?}"),
            Err(_) => panic!("[{check}] no EXITED event for {id} within {settle:?}; saw {seen:?}"),
        }
    }
}
