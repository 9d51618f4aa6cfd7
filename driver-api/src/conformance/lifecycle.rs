//! Checks of the lifecycle: idempotent stop / start / delete, the generation round-trip and
//! mismatch, exec, workloads that exit by themselves and the watch event that reports it.

use std::time::Duration;

use futures::StreamExt;
use tokio::time::{Instant, timeout};
use uuid::Uuid;

use super::DriverHarness;
use super::session::{Session, assert_untouched, describe, run_check, state_of};
use crate::{DriverError, pb};

/// Stop of a stopped sandbox, start of a running one under its generation, and delete of an
/// absent one succeed without doing anything; get of an absent one is `NotFound`. With the
/// `stats` capability: usage says whether the workload runs (a stopped one uses nothing), and
/// of an absent id it is `NotFound`.
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

    let stats = s.capabilities().await.stats;
    if stats {
        let usage = s.stats(&id).await;
        assert!(
            usage.as_ref().is_ok_and(|u| u.running),
            "[{check}] stats of a running sandbox must say it runs, got {usage:?}"
        );
    }

    let stopped = s.stop(&id).await;
    if stats {
        let usage = s.stats(&id).await;
        assert!(
            usage
                .as_ref()
                .is_ok_and(|u| !u.running && u.cpu_nanos == 0 && u.memory_bytes == 0),
            "[{check}] stats of a stopped sandbox must say it does not run and uses nothing, \
             got {usage:?}"
        );
    }
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
    if stats {
        let usage = s.stats(&absent).await;
        assert!(
            matches!(&usage, Err(DriverError::NotFound { sandbox_id }) if *sandbox_id == absent),
            "[{check}] stats of an absent id must be NotFound naming it, got {usage:?}"
        );
    }
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

/// Pause and resume (the `pause` capability). Without it, both are refused and the workload
/// runs on. With it: a paused workload reports `Paused` under its generation (in get, list,
/// and to a new driver instance), refuses exec, is resumed under the same generation; a second
/// pause or resume does nothing; a sandbox that does not run cannot be paused nor a running
/// one resumed into anything else; stop of a paused one stops it (a start makes a new run),
/// delete removes it.
pub async fn pause_and_resume_keep_the_run(h: &dyn DriverHarness) {
    run_check(h, "pause_and_resume_keep_the_run", |s| {
        Box::pin(pause_body(s))
    })
    .await;
}

async fn pause(s: &Session<'_>, id: &str) -> Result<pb::Snapshot, DriverError> {
    let req = pb::PauseRequest {
        sandbox_id: id.to_string(),
    };
    s.call(&format!("pause {id}"), s.driver().pause(req)).await
}

async fn resume(s: &Session<'_>, id: &str) -> Result<pb::Snapshot, DriverError> {
    let req = pb::ResumeRequest {
        sandbox_id: id.to_string(),
    };
    s.call(&format!("resume {id}"), s.driver().resume(req))
        .await
}

async fn pause_body(s: &mut Session<'_>) {
    let check = s.check();
    let caps = s.capabilities().await;
    let first = s.create_running("alpha", "napper", 1).await;
    let id = first.sandbox_id.clone();
    if !caps.pause {
        for (what, answer) in [
            ("pause", pause(s, &id).await),
            ("resume", resume(s, &id).await),
        ] {
            assert!(
                matches!(answer, Err(DriverError::Unimplemented(_))),
                "[{check}] {what} on a driver without the pause capability must be \
                 Unimplemented, got {answer:?}"
            );
        }
        assert_untouched(s, &id, &first, "a refused pause").await;
        return;
    }
    let refused = resume(s, &id).await;
    assert!(
        refused
            .as_ref()
            .is_ok_and(|r| state_of(r) == pb::State::Running && r.generation == 1),
        "[{check}] resume of a running sandbox must do nothing, got {refused:?}"
    );
    let paused = pause(s, &id)
        .await
        .unwrap_or_else(|e| panic!("[{check}] pause failed: {e}"));
    assert_eq!(
        (state_of(&paused), paused.generation),
        (pb::State::Paused, 1),
        "[{check}] pause answered {paused:?}"
    );
    let again = pause(s, &id).await;
    assert!(
        again
            .as_ref()
            .is_ok_and(|a| state_of(a) == pb::State::Paused),
        "[{check}] a second pause must do nothing, got {again:?}"
    );
    let listed = s.listed(&id).await;
    assert!(
        listed.len() == 1 && state_of(&listed[0]) == pb::State::Paused,
        "[{check}] list must show it paused: {listed:?}"
    );
    if caps.exec {
        let exec = s.try_exec(&id, s.h.exec_echo("asleep")).await;
        assert!(
            exec.is_err(),
            "[{check}] exec into a paused sandbox must be refused"
        );
    }
    // A new driver instance finds it paused.
    s.kill_and_reopen().await;
    let found = s.get(&id).await;
    assert_eq!(
        (state_of(&found), found.generation),
        (pb::State::Paused, 1),
        "[{check}] a reopened driver found {found:?}"
    );
    let resumed = resume(s, &id)
        .await
        .unwrap_or_else(|e| panic!("[{check}] resume failed: {e}"));
    assert_eq!(
        (state_of(&resumed), resumed.generation),
        (pb::State::Running, 1),
        "[{check}] resume answered {resumed:?}"
    );
    if caps.exec {
        let ran = s.exec(&id, s.h.exec_echo("awake")).await;
        assert_eq!(
            (ran.exit_code, ran.stdout.as_str()),
            (Some(0), "awake\n"),
            "[{check}] exec after resume: stderr {:?}",
            ran.stderr
        );
    }
    // Stop of a paused sandbox stops it; a start is a new run.
    pause(s, &id)
        .await
        .unwrap_or_else(|e| panic!("[{check}] second pause failed: {e}"));
    let stopped = s.stop(&id).await;
    assert_eq!(
        state_of(&stopped),
        pb::State::Stopped,
        "[{check}] stop of a paused sandbox"
    );
    let refused = pause(s, &id).await;
    assert!(
        matches!(refused, Err(DriverError::FailedPrecondition(_))),
        "[{check}] pause of a stopped sandbox must be FailedPrecondition, got {refused:?}"
    );
    let refused = resume(s, &id).await;
    assert!(
        matches!(refused, Err(DriverError::FailedPrecondition(_))),
        "[{check}] resume of a stopped sandbox must be FailedPrecondition, got {refused:?}"
    );
    s.start(&id, 2).await;
    s.wait_for_state(&id, pb::State::Running).await;
    // Delete of a paused sandbox removes it.
    pause(s, &id)
        .await
        .unwrap_or_else(|e| panic!("[{check}] third pause failed: {e}"));
    assert!(s.delete(&id).await, "[{check}] delete of a paused sandbox");
    let gone = s.try_get(&id).await;
    assert!(
        matches!(gone, Err(DriverError::NotFound { .. })),
        "[{check}] a deleted paused sandbox must be NotFound, got {gone:?}"
    );
}
