//! Process driver: exec, logs and watch streams, on the real kernel (needs root).

mod process_support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use process_support::*;
use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_driver_process::ProcessDriver;
use uuid::Uuid;

#[tokio::test]
async fn exec_streams_stdout_stderr_and_the_exit_last() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    let mut with_env = spec(&["sleep", "1000"]);
    with_env.env.insert("GREETING".into(), "hello".into());
    driver
        .create(create_req(id, "exec", with_env, 1))
        .await
        .unwrap();

    let req = pb::ExecRequest {
        sandbox_id: id.to_string(),
        command: [
            "sh",
            "-c",
            "echo out-$GREETING-$EXTRA; echo err >&2; exit 7",
        ]
        .map(String::from)
        .to_vec(),
        env: [("EXTRA".to_string(), "x".to_string())].into(),
        timeout_seconds: 10,
        ..Default::default()
    };
    let items: Vec<_> = tokio::time::timeout(
        Duration::from_secs(30),
        driver.exec(req).await.unwrap().collect(),
    )
    .await
    .unwrap();
    let chunks: Vec<pb::exec_output::Chunk> = items
        .into_iter()
        .map(|i| i.unwrap().chunk.unwrap())
        .collect();
    let last = chunks.last().cloned();
    assert_eq!(
        last,
        Some(pb::exec_output::Chunk::Exit(pb::ExecExit {
            code: 7,
            signal: 0,
            timed_out: false
        })),
        "{chunks:?}"
    );
    let stdout: Vec<u8> = chunks
        .iter()
        .filter_map(|c| {
            if let pb::exec_output::Chunk::Stdout(b) = c {
                Some(b.clone())
            } else {
                None
            }
        })
        .flatten()
        .collect();
    let stderr: Vec<u8> = chunks
        .iter()
        .filter_map(|c| {
            if let pb::exec_output::Chunk::Stderr(b) = c {
                Some(b.clone())
            } else {
                None
            }
        })
        .flatten()
        .collect();
    assert_eq!(String::from_utf8(stdout).unwrap(), "out-hello-x\n");
    assert_eq!(String::from_utf8(stderr).unwrap(), "err\n");

    let killed = exec(&driver, id, &["sh", "-c", "kill -TERM $$"], 0).await;
    assert_eq!(
        killed.exit,
        Some(pb::ExecExit {
            code: -1,
            signal: 15,
            timed_out: false
        }),
        "{killed:?}"
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn exec_timeout_is_honoured_and_leaves_nothing_running() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "slow", spec(&["sleep", "1000"]), 1))
        .await
        .unwrap();
    let began = Instant::now();
    let slow = exec(&driver, id, &["sh", "-c", "echo started; sleep 30"], 1).await;
    let took = began.elapsed();
    // The timeout ends the stream with its exit: 124, timed out.
    assert!(slow.error.is_none(), "{slow:?}");
    assert_eq!(
        slow.exit,
        Some(pb::ExecExit {
            code: 124,
            signal: 0,
            timed_out: true
        }),
        "{slow:?}"
    );
    assert_eq!(slow.stdout, "started\n");
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(5),
        "{took:?}"
    );
    // Only the workload's own processes (shim, loggers, exec agent and sleep) remain.
    let left = wait_until(Duration::from_secs(3), || {
        let ps = exec_sync_count(&driver, id);
        if ps == WORKLOAD { Ok(ps) } else { Err(ps) }
    })
    .await;
    assert!(
        left.is_ok(),
        "processes in the sandbox after the timeout: {left:?}"
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn dropping_an_exec_stream_ends_the_command() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "dropper", spec(&["sleep", "1000"]), 1))
        .await
        .unwrap();
    let req = pb::ExecRequest {
        sandbox_id: id.to_string(),
        command: ["sleep", "1000"].map(String::from).to_vec(),
        ..Default::default()
    };
    let stream = driver.exec(req).await.unwrap();
    let grew = wait_until(Duration::from_secs(3), || {
        match exec_sync_count(&driver, id) {
            n if n > WORKLOAD => Ok(n),
            n => Err(n),
        }
    })
    .await;
    assert!(grew.is_ok(), "the exec'd sleep never showed: {grew:?}");
    drop(stream);
    let back = wait_until(Duration::from_secs(3), || {
        match exec_sync_count(&driver, id) {
            WORKLOAD => Ok(()),
            n => Err(n),
        }
    })
    .await;
    assert!(
        back.is_ok(),
        "the exec'd command outlived its stream: {back:?}"
    );
    drop(driver);
    env.finish().await;
}

/// The processes of an idle sandbox: the shim, its two loggers (stdout's and stderr's), its
/// exec agent and the main `sleep`.
const WORKLOAD: usize = 5;

/// How many processes are in the sandbox's cgroup (read on the host).
fn exec_sync_count(driver: &ProcessDriver, id: Uuid) -> usize {
    let leaf = format!("sbx-{id}");
    driver
        .cgroup_parent_dirs()
        .iter()
        .filter_map(|p| std::fs::read_to_string(p.join(&leaf).join("cgroup.procs")).ok())
        .map(|t| t.split_whitespace().count())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn exec_into_a_stopped_or_unknown_sandbox_is_refused() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "idle", spec(&["sleep", "1000"]), 1))
        .await
        .unwrap();
    driver.stop(stop_req(id, 200)).await.unwrap();
    let req = |id: String| pb::ExecRequest {
        sandbox_id: id,
        command: vec!["true".into()],
        ..Default::default()
    };
    let refused = driver.exec(req(id.to_string())).await.err();
    assert!(
        matches!(refused, Some(DriverError::FailedPrecondition(_))),
        "{refused:?}"
    );
    let unknown = driver.exec(req(Uuid::new_v4().to_string())).await.err();
    assert!(
        matches!(unknown, Some(DriverError::NotFound { .. })),
        "{unknown:?}"
    );
    let empty = driver.exec(req(String::new())).await.err();
    assert!(
        matches!(empty, Some(DriverError::InvalidArgument(_))),
        "{empty:?}"
    );
    drop(driver);
    env.finish().await;
}

async fn collect_logs(driver: &ProcessDriver, id: Uuid, tail_lines: u32) -> String {
    let req = pb::LogsRequest {
        sandbox_id: id.to_string(),
        follow: false,
        tail_lines,
        ..Default::default()
    };
    let chunks: Vec<_> = tokio::time::timeout(
        Duration::from_secs(10),
        driver.logs(req).await.unwrap().collect(),
    )
    .await
    .unwrap();
    let bytes: Vec<u8> = chunks.into_iter().flat_map(|c| c.unwrap().data).collect();
    String::from_utf8(bytes).unwrap()
}

#[tokio::test]
async fn logs_tail_and_follow_the_workload_output() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    let talker = spec(&[
        "sh",
        "-c",
        "for i in 1 2 3 4 5; do echo line$i; done; sleep 0.3; echo oops >&2; read _ < /sandbox/go; echo after",
    ]);
    // stdout and stderr have a logger each, writing to the log independently: the sleep
    // keeps their lines in the order the test asserts.
    // The workload blocks on a FIFO in its persistent dir until the test opens it. Its host
    // uid is leased at create, after the FIFO is made, so the FIFO is open to every user.
    std::fs::create_dir_all(driver.persistent_dir(id)).unwrap();
    let fifo = driver.persistent_dir(id).join("go");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o666)).unwrap();
    std::fs::set_permissions(&fifo, std::os::unix::fs::PermissionsExt::from_mode(0o666)).unwrap();
    driver
        .create(create_req(id, "talker", talker, 1))
        .await
        .unwrap();
    let ready = wait_until(Duration::from_secs(10), || {
        let text = std::fs::read_to_string(
            env.state_dir
                .path()
                .join("sandboxes")
                .join(id.to_string())
                .join("workload.log"),
        )
        .unwrap_or_default();
        if text.contains("oops") {
            Ok(())
        } else {
            Err(text)
        }
    })
    .await;
    assert!(ready.is_ok(), "{ready:?}");
    assert_eq!(collect_logs(&driver, id, 2).await, "line5\noops\n");
    assert_eq!(
        collect_logs(&driver, id, 0).await,
        "line1\nline2\nline3\nline4\nline5\noops\n"
    );

    let req = pb::LogsRequest {
        sandbox_id: id.to_string(),
        follow: true,
        tail_lines: 1,
        ..Default::default()
    };
    let mut follow = driver.logs(req).await.unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), follow.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(first.data, b"oops\n");
    // Release the workload: it prints one more line, which the follower must see.
    std::fs::write(driver.persistent_dir(id).join("go"), b"go\n").unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), follow.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(next.data, b"after\n");
    wait_for_state(&driver, id, pb::State::Exited, Duration::from_secs(10)).await;
    // Delete ends the follow.
    assert!(
        driver
            .delete(pb::DeleteRequest {
                sandbox_id: id.to_string()
            })
            .await
            .unwrap()
            .deleted
    );
    let end = tokio::time::timeout(Duration::from_secs(5), follow.next())
        .await
        .unwrap();
    assert!(end.is_none(), "{end:?}");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn watch_sees_changes_made_behind_the_drivers_back_and_deletes() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "watched", spec(&["sleep", "1000"]), 1))
        .await
        .unwrap();
    let mut events = driver.watch().await.unwrap();
    let init = driver.workload_identity(id).unwrap();
    // Someone kills the workload's main process (not through the driver).
    // (The shim's first child may still be the `mv` that recorded it: look for the `sleep`.)
    let sleeper = wait_until(Duration::from_secs(5), || {
        let children =
            std::fs::read_to_string(format!("/proc/{}/task/{}/children", init.pid, init.pid))
                .unwrap_or_default();
        children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok())
            .find(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm"))
                    .is_ok_and(|c| c.trim() == "sleep")
            })
            .ok_or(children)
    })
    .await
    .expect("the workload's sleep");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sleeper),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let exited = next_event(&mut events, |e| {
        e.snapshot
            .as_ref()
            .is_some_and(|s| s.state == pb::State::Exited as i32)
    })
    .await;
    let snapshot = exited.snapshot.unwrap();
    assert_eq!(
        (snapshot.exit_signal, snapshot.reason.as_str()),
        (9, "Killed"),
        "{snapshot:?}"
    );
    assert!(
        driver
            .delete(pb::DeleteRequest {
                sandbox_id: id.to_string()
            })
            .await
            .unwrap()
            .deleted
    );
    let deleted = next_event(&mut events, |e| e.deleted).await;
    assert_eq!(deleted.snapshot.unwrap().sandbox_id, id.to_string());
    // Dropping the driver ends its watch streams.
    drop(driver);
    let end = tokio::time::timeout(Duration::from_secs(5), events.next())
        .await
        .unwrap();
    assert!(end.is_none(), "{end:?}");
    env.finish().await;
}

async fn next_event(
    events: &mut sbx_driver_api::DriverStream<pb::WatchEvent>,
    wanted: impl Fn(&pb::WatchEvent) -> bool,
) -> pb::WatchEvent {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let event = tokio::time::timeout(left, events.next())
            .await
            .expect("no such event within 10 s");
        let event = event.expect("watch ended").unwrap();
        if wanted(&event) {
            return event;
        }
    }
}
