//! Process driver: the driver *process* is SIGKILLed (not just dropped) — while idle and in the
//! middle of creates, stops and starts — and a fresh driver on the same state finds every
//! sandbox, can stop, start and exec each, and deletes them leaving nothing behind.
//!
//! The driver runs in a child process: this test binary re-run with `--ignored --exact
//! crash_child_driver`, told what to do through `SBX_CRASH_*` variables. Kill delays come from a
//! seeded generator; a failing run prints its seed, and `SBX_CRASH_SEED=<seed>` replays it.

mod process_support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use process_support::*;
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_process::{ProcessDriver, ProcessDriverOptions};
use uuid::Uuid;

/// Not a test: the child half of the tests below (a driver process to be killed). Ignored so
/// that it runs only when a test starts it, with its instructions in the environment.
#[tokio::test]
#[ignore = "the child process of the crash tests; started by them"]
async fn crash_child_driver() {
    let (Ok(state), Ok(parent), Ok(mode)) = (
        std::env::var("SBX_CRASH_STATE"),
        std::env::var("SBX_CRASH_CGROUP_PARENT"),
        std::env::var("SBX_CRASH_MODE"),
    ) else {
        eprintln!("crash_child_driver runs only as the child of a crash test");
        return;
    };
    let opts = ProcessDriverOptions {
        cgroup_parent: parent,
        default_grace: Duration::from_millis(500),
        ..ProcessDriverOptions::default()
    };
    let driver = ProcessDriver::open(state.into(), opts).unwrap();
    let long = spec(&["sleep", "3600"]);
    match mode.as_str() {
        "settled" => {
            for i in 0..3 {
                let id = Uuid::new_v4();
                driver
                    .create(create_req(id, &format!("settled-{i}"), long.clone(), 1))
                    .await
                    .unwrap();
                println!("CREATED {id}");
            }
            println!("READY");
        }
        _ => {
            println!("READY");
            // Busy: create four sandboxes, then stop and start them in turn, until killed
            // (bounded to 60 s).
            let began = Instant::now();
            let mut ids = Vec::new();
            let mut generation = 1;
            while began.elapsed() < Duration::from_secs(60) {
                if ids.len() < 4 {
                    let id = Uuid::new_v4();
                    driver
                        .create(create_req(
                            id,
                            &format!("busy-{}", ids.len()),
                            long.clone(),
                            1,
                        ))
                        .await
                        .unwrap();
                    ids.push(id);
                    continue;
                }
                let id = ids[generation as usize % ids.len()];
                driver.stop(stop_req(id, 100)).await.unwrap();
                generation += 1;
                driver.start(start_req(id, generation)).await.unwrap();
            }
        }
    }
    tokio::time::sleep(Duration::from_secs(60)).await;
}

/// The child driver process; SIGKILLed when dropped, so a failing test does not leave it.
struct ChildDriver(Child);

impl Drop for ChildDriver {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn spawn_child(env: &TestEnv, mode: &str) -> (ChildDriver, BufReader<std::process::ChildStdout>) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "crash_child_driver",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("SBX_CRASH_STATE", env.state_dir.path())
        .env("SBX_CRASH_CGROUP_PARENT", &env.cgroup_parent)
        .env("SBX_CRASH_MODE", mode)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = BufReader::new(child.stdout.take().unwrap());
    (ChildDriver(child), stdout)
}

/// Reads the child's lines until READY (the read ends at the child's exit at the latest).
fn read_until_ready(stdout: &mut BufReader<std::process::ChildStdout>) -> Vec<String> {
    let mut lines = Vec::new();
    for line in stdout.lines() {
        let line = line.unwrap();
        // The test harness's own output may share the line.
        if line.ends_with("READY") {
            lines.push(line.trim_end_matches("READY").to_string());
            return lines;
        }
        lines.push(line);
    }
    panic!("the child driver ended before READY: {lines:?}");
}

fn sigkill(child: &mut Child) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();
}

#[tokio::test]
async fn workloads_survive_sigkill_of_the_driver_process() {
    let env = TestEnv::new();
    let (mut child, mut stdout) = spawn_child(&env, "settled");
    let ready = tokio::task::spawn_blocking(move || read_until_ready(&mut stdout));
    let lines = tokio::time::timeout(Duration::from_secs(30), ready)
        .await
        .unwrap()
        .unwrap();
    let created: Vec<Uuid> = lines
        .iter()
        .filter_map(|l| l.split_once("CREATED ").map(|(_, id)| id))
        .map(|id| id.parse().unwrap())
        .collect();
    assert_eq!(created.len(), 3, "{lines:?}");
    sigkill(&mut child.0);

    let driver = env.open();
    let listed = driver.list().await.unwrap();
    assert_eq!(listed.len(), 3, "{listed:?}");
    for id in created {
        let snapshot = driver
            .get(pb::GetRequest {
                sandbox_id: id.to_string(),
            })
            .await
            .unwrap();
        assert_eq!(
            (snapshot.state, snapshot.generation),
            (pb::State::Running as i32, 1),
            "{snapshot:?}"
        );
        let echo = exec(&driver, id, &["echo", "still-here"], 0).await;
        assert_eq!(echo.stdout, "still-here\n", "{echo:?}");
    }
    drop(driver);
    env.finish().await;
}

/// A small seeded generator (xorshift64*), enough for kill delays.
struct Seeded(u64);

impl Seeded {
    fn next_below(&mut self, bound: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % bound
    }
}

#[tokio::test]
async fn a_driver_killed_mid_operation_leaves_a_recoverable_state() {
    let seed = std::env::var("SBX_CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
                | 1
        });
    eprintln!("SBX_CRASH_SEED={seed}");
    let mut rng = Seeded(seed);
    let env = TestEnv::new();
    for round in 0..3 {
        let (mut child, mut stdout) = spawn_child(&env, "busy");
        let ready = tokio::task::spawn_blocking(move || read_until_ready(&mut stdout));
        tokio::time::timeout(Duration::from_secs(30), ready)
            .await
            .unwrap()
            .unwrap();
        let delay = Duration::from_millis(100 + rng.next_below(600));
        tokio::time::sleep(delay).await;
        sigkill(&mut child.0);

        // A fresh driver finds a consistent state: every sandbox answers, and each one can be
        // stopped, started under a new generation, and exec'd into.
        let driver = env.open();
        let listed = driver.list().await.unwrap();
        assert!(
            !listed.is_empty(),
            "seed {seed} round {round}: nothing created in {delay:?}"
        );
        for snapshot in listed {
            let id: Uuid = snapshot.sandbox_id.parse().unwrap();
            let stopped = driver.stop(stop_req(id, 100)).await.unwrap();
            assert_eq!(
                stopped.state,
                pb::State::Stopped as i32,
                "seed {seed}: {stopped:?}"
            );
            assert!(
                driver.workload_identity(id).is_none(),
                "seed {seed}: {id} still runs after stop"
            );
            let generation = snapshot.generation + 1000;
            let started = driver.start(start_req(id, generation)).await.unwrap();
            assert_eq!(
                (started.state, started.generation),
                (pb::State::Running as i32, generation),
                "seed {seed}: {started:?}"
            );
            let echo = exec(&driver, id, &["echo", "ok"], 0).await;
            assert_eq!(echo.stdout, "ok\n", "seed {seed}: {echo:?}");
        }
        drop(driver);
    }
    // Deletes everything and checks that no process, cgroup or mount is left: a workload
    // launched by a killed driver and then lost track of would show here.
    env.finish().await;
}

/// A driver killed between persisting "stopped" and killing the workload: the next `open`
/// finishes the stop (the workload does not linger under a record that says stopped).
#[tokio::test]
async fn open_finishes_a_stop_that_a_killed_driver_left_half_done() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "half-stopped", spec(&["sleep", "3600"]), 1))
        .await
        .unwrap();
    let init = driver.workload_identity(id).unwrap();
    drop(driver);
    let record_path = env
        .state_dir
        .path()
        .join("sandboxes")
        .join(id.to_string())
        .join("sandbox.json");
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    assert_eq!(record["desired"], "Running");
    record["desired"] = "Stopped".into();
    std::fs::write(&record_path, serde_json::to_vec(&record).unwrap()).unwrap();

    let driver = env.open();
    // SIGKILL was sent at open; the snapshot says "Stopping" until the processes are gone.
    wait_for_state(&driver, id, pb::State::Stopped, Duration::from_secs(5)).await;
    let gone = wait_until(Duration::from_secs(5), || {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", init.pid)).unwrap_or_default();
        if stat.is_empty() || stat.contains(") Z") {
            Ok(())
        } else {
            Err(stat)
        }
    })
    .await;
    assert!(
        gone.is_ok(),
        "the half-stopped workload still runs: {gone:?}"
    );
    let started = driver.start(start_req(id, 2)).await.unwrap();
    assert_eq!(started.state, pb::State::Running as i32);
    drop(driver);
    env.finish().await;
}
