//! Pause and resume on the oci driver (the cgroup freezer), tried as a user would (needs
//! root, runc, busybox-static and a cgroup freezer): the sandbox's processes are the same ones
//! after a resume, counting on from where they were, with their open files and their /tmp; a
//! paused busy loop uses no CPU and its memory stays resident; exec, copies and forwarding are
//! refused while paused; a stop of a paused sandbox gives its workload its SIGTERM; a driver
//! restarted, or a runtime call killed at any point of a pause or a resume, never leaves a
//! sandbox lost or half frozen. Each test ends with the leak check. The `#[ignore]`d
//! `pause_and_resume_timing` measures (see its docs).

mod oci_support;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use oci_support::{TestEnv, create, exec, wait_for};
use sbx_driver_api::{ComputeDriver, DriverError, pb};
use sbx_driver_oci::OciDriver;
use uuid::Uuid;

/// The workload: its pid, a file it holds open on fd 7, a file in /tmp, and a counter that
/// ticks every 50 ms in /tmp/count (written whole: renamed into place).
const COUNTER: &str = "mkdir -p /tmp; echo $$ > /tmp/pid; exec 7>/tmp/held; echo kept > /tmp/kept; \
     i=0; while :; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; \
     sleep 0.05; done";

fn sid(id: Uuid) -> String {
    id.to_string()
}

/// A cgroup file of sandbox `id` under `parent`: v1 `controller`'s, else v2's `v2_file`.
fn cgroup_file(parent: &str, id: Uuid, controller: &str, v1_file: &str, v2_file: &str) -> PathBuf {
    let v1 = PathBuf::from(format!(
        "/sys/fs/cgroup/{controller}/{parent}/{id}/{v1_file}"
    ));
    if v1.exists() {
        return v1;
    }
    PathBuf::from(format!("/sys/fs/cgroup/{parent}/{id}/{v2_file}"))
}

/// The freezer's state, as the kernel says it (v1 `freezer.state`; v2 `frozen 0|1`).
fn freezer_state(env: &TestEnv, id: Uuid) -> String {
    let file = cgroup_file(
        &env.cgroup_parent,
        id,
        "freezer",
        "freezer.state",
        "cgroup.events",
    );
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    if file.ends_with("cgroup.events") {
        return match text.lines().any(|l| l == "frozen 1") {
            true => "FROZEN".into(),
            false => "THAWED".into(),
        };
    }
    text.trim().to_string()
}

/// CPU time the sandbox's cgroup has used, in nanoseconds.
fn cpu_nanos(env: &TestEnv, id: Uuid) -> u64 {
    let file = cgroup_file(
        &env.cgroup_parent,
        id,
        "cpuacct",
        "cpuacct.usage",
        "cpu.stat",
    );
    let text = std::fs::read_to_string(&file).unwrap();
    if file.ends_with("cpu.stat") {
        let usec: u64 = text
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap();
        return usec * 1000;
    }
    text.trim().parse().unwrap()
}

/// The memory the sandbox's cgroup holds (v1 `memory.usage_in_bytes`, v2 `memory.current`).
fn memory_bytes(env: &TestEnv, id: Uuid) -> u64 {
    let file = cgroup_file(
        &env.cgroup_parent,
        id,
        "memory",
        "memory.usage_in_bytes",
        "memory.current",
    );
    std::fs::read_to_string(&file)
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// The host pids of the sandbox's processes but the counter's `sleep` and `mv` of the moment
/// (a freeze may also catch one of its forks before its exec: a test checks that every
/// process it saw before is there after, and a restart would end them all).
fn host_pids(env: &TestEnv, id: Uuid) -> BTreeSet<i32> {
    let file = cgroup_file(
        &env.cgroup_parent,
        id,
        "pids",
        "cgroup.procs",
        "cgroup.procs",
    );
    std::fs::read_to_string(&file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .filter(|pid| lasting(*pid))
        .collect()
}

/// The processes of [`host_pids`] that are there twice, 200 ms apart (none of the counter's
/// passing ones).
fn lasting_pids(env: &TestEnv, id: Uuid) -> BTreeSet<i32> {
    let first = host_pids(env, id);
    std::thread::sleep(Duration::from_millis(200));
    first.intersection(&host_pids(env, id)).copied().collect()
}

/// Whether `pid` is not one of the counter's passing `sleep` and `mv`.
fn lasting(pid: i32) -> bool {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    !matches!(comm.trim(), "sleep" | "mv" | "")
}

/// The pid that host process `pid` has in its own pid namespace (`NSpid`'s last field).
fn ns_pid(pid: i32) -> Option<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The counter as the host reads it from the sandbox's writable layer (no exec: it works
/// while paused).
fn count(driver: &OciDriver, id: Uuid) -> Option<u64> {
    std::fs::read_to_string(driver.upper_dir(id).join("tmp/count"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Waits (bounded) until the counter reads at least `at_least`; answers it.
async fn count_reaches(driver: &OciDriver, id: Uuid, at_least: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(n) = count(driver, id).filter(|n| *n >= at_least) {
            return n;
        }
        assert!(
            Instant::now() < deadline,
            "the counter of {id} did not reach {at_least}: {:?}",
            count(driver, id)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn pause(driver: &dyn ComputeDriver, id: Uuid) -> Result<pb::Snapshot, DriverError> {
    driver
        .pause(pb::PauseRequest {
            sandbox_id: sid(id),
        })
        .await
}

async fn resume(driver: &dyn ComputeDriver, id: Uuid) -> Result<pb::Snapshot, DriverError> {
    driver
        .resume(pb::ResumeRequest {
            sandbox_id: sid(id),
        })
        .await
}

fn state(s: &pb::Snapshot) -> (pb::State, u64) {
    (
        pb::State::try_from(s.state).unwrap_or(pb::State::Unspecified),
        s.generation,
    )
}

async fn get(driver: &dyn ComputeDriver, id: Uuid) -> pb::Snapshot {
    driver
        .get(pb::GetRequest {
            sandbox_id: sid(id),
        })
        .await
        .unwrap()
}

#[tokio::test]
async fn a_resumed_sandbox_has_the_same_processes_counting_on_with_their_files() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let caps = driver.capabilities().await.unwrap();
    assert!(caps.pause, "the oci driver cannot pause: {caps:?}");
    let (id, created) = create(&driver, &env, "counter", env.spec(&["sh", "-c", COUNTER])).await;
    count_reaches(&driver, id, 5).await;
    let pid = exec(&driver, &sid(id), &["cat", "/tmp/pid"]).await.1;
    let before = lasting_pids(&env, id);
    assert!(
        before.len() >= 3,
        "the init, the counter, the agent: {before:?}"
    );

    let paused = pause(&driver, id).await.unwrap();
    assert_eq!(state(&paused), (pb::State::Paused, 1), "{paused:?}");
    assert_eq!(paused.instance_id, created.instance_id);
    assert_eq!(freezer_state(&env, id), "FROZEN");
    // Nothing runs: the counter stands still.
    let at_pause = count(&driver, id).unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        count(&driver, id),
        Some(at_pause),
        "the counter ran while paused"
    );
    assert_eq!(state(&get(&driver, id).await), (pb::State::Paused, 1));

    let resumed = resume(&driver, id).await.unwrap();
    assert_eq!(state(&resumed), (pb::State::Running, 1), "{resumed:?}");
    assert_eq!(resumed.instance_id, created.instance_id);
    assert_eq!(freezer_state(&env, id), "THAWED");
    // The same processes (a restart would make new ones, its counter from 1), counting on
    // from where they stood.
    let after = count_reaches(&driver, id, at_pause + 1).await;
    assert!(after <= at_pause + 10, "{at_pause} → {after}");
    let now = host_pids(&env, id);
    assert!(
        before.is_subset(&now),
        "processes gone: {before:?} → {now:?}"
    );
    let (code, out, err) = exec(&driver, &sid(id), &["cat", "/tmp/pid", "/tmp/kept"]).await;
    assert_eq!((code, out), (0, format!("{pid}kept\n")), "{err}");
    // Its file still open (seen from the host: an exec may not look into the workload's fds).
    let in_sandbox: i32 = pid.trim().parse().unwrap();
    let counter = before
        .iter()
        .find(|host| ns_pid(**host) == Some(in_sandbox))
        .expect("the counter among the sandbox's processes");
    let held = std::fs::read_link(format!("/proc/{counter}/fd/7")).unwrap();
    assert!(held.ends_with("tmp/held"), "{}", held.display());
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_paused_busy_loop_uses_no_cpu_and_its_memory_stays_resident() {
    let env = TestEnv::new();
    let driver = env.open().await;
    // 32 MiB of random bytes held by a blocked `dd`, and a busy loop.
    let script = "dd if=/dev/urandom bs=32M count=1 2>/dev/null | sleep 3600 & \
                  while :; do :; done";
    let (id, _) = create(&driver, &env, "busy", env.spec(&["sh", "-c", script])).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while memory_bytes(&env, id) < 32 << 20 {
        assert!(Instant::now() < deadline, "{}", memory_bytes(&env, id));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cpu_over_a_second = || async {
        let a = cpu_nanos(&env, id);
        tokio::time::sleep(Duration::from_secs(1)).await;
        cpu_nanos(&env, id) - a
    };
    let running = cpu_over_a_second().await;
    // At least 5% of a core (the tests share two loaded cores), where a paused one gets none.
    assert!(
        running > 50_000_000,
        "the busy loop used {running} ns in 1 s"
    );
    let resident = memory_bytes(&env, id);

    pause(&driver, id).await.unwrap();
    let paused = cpu_over_a_second().await;
    let held = memory_bytes(&env, id);
    eprintln!(
        "cpu in 1 s: running {running} ns, paused {paused} ns; memory: running {resident} B, \
         paused {held} B"
    );
    assert!(
        paused < 5_000_000,
        "a paused busy loop used {paused} ns in 1 s"
    );
    assert!(
        held >= resident / 10 * 9,
        "paused, the memory went from {resident} to {held} B"
    );
    resume(&driver, id).await.unwrap();
    let again = cpu_over_a_second().await;
    assert!(
        again > 50_000_000,
        "resumed, the loop used {again} ns in 1 s"
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn exec_copy_and_forward_into_a_paused_sandbox_are_refused_at_once() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "napper", env.spec(&["sleep", "3600"])).await;
    pause(&driver, id).await.unwrap();
    let limit = Duration::from_secs(5);
    let refused = |what: &str, answer: Result<Result<(), DriverError>, _>| match answer {
        Ok(Err(DriverError::FailedPrecondition(m))) => {
            assert!(m.contains("paused") && m.contains("resume"), "{what}: {m}")
        }
        Ok(other) => panic!("{what} into a paused sandbox answered {other:?}"),
        Err(_) => panic!("{what} into a paused sandbox did not answer within {limit:?}"),
    };
    let execd = tokio::time::timeout(
        limit,
        driver.exec(pb::ExecRequest {
            sandbox_id: sid(id),
            command: vec!["true".into()],
            ..Default::default()
        }),
    )
    .await;
    refused("exec", execd.map(|r| r.map(drop)));
    let copied = tokio::time::timeout(
        limit,
        driver.copy_from(pb::CopyFromRequest {
            sandbox_id: sid(id),
            path: "/etc".into(),
            ..Default::default()
        }),
    )
    .await;
    refused("copy from", copied.map(|r| r.map(drop)));
    let data: sbx_driver_api::ByteStream = Box::pin(futures::stream::empty());
    let copied = tokio::time::timeout(
        limit,
        driver.copy_to(
            pb::CopyToStart {
                sandbox_id: sid(id),
                path: "/tmp".into(),
            },
            data,
        ),
    )
    .await;
    refused("copy to", copied.map(|r| r.map(drop)));
    let input: sbx_driver_api::ForwardInputStream = Box::pin(futures::stream::empty());
    let forwarded = tokio::time::timeout(
        limit,
        driver.port_forward(
            pb::PortForwardStart {
                sandbox_id: sid(id),
                port: 8080,
            },
            input,
        ),
    )
    .await;
    refused("port forwarding", forwarded.map(|r| r.map(drop)));
    // Resumed, they work again.
    resume(&driver, id).await.unwrap();
    let (code, out, _) = exec(&driver, &sid(id), &["echo", "awake"]).await;
    assert_eq!((code, out.as_str()), (0, "awake\n"));
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_stop_of_a_paused_sandbox_gives_its_workload_its_sigterm() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let script = "trap 'echo bye > /sandbox/bye; exit 0' TERM; while :; do sleep 0.1; done";
    let (id, _) = create(&driver, &env, "polite", env.spec(&["sh", "-c", script])).await;
    pause(&driver, id).await.unwrap();
    let began = Instant::now();
    let stopped = driver
        .stop(pb::StopRequest {
            sandbox_id: sid(id),
            grace_period_ms: 10_000,
        })
        .await
        .unwrap();
    assert_eq!(state(&stopped).0, pb::State::Stopped, "{stopped:?}");
    assert!(
        began.elapsed() < Duration::from_secs(5),
        "the stop waited out its grace: {:?}",
        began.elapsed()
    );
    let bye = std::fs::read_to_string(driver.volume_dir(id).join("bye")).unwrap_or_default();
    assert_eq!(bye, "bye\n", "the paused workload did not get its SIGTERM");
    // Started again, paused again, deleted: nothing is left (the leak check).
    driver
        .start(pb::StartRequest {
            sandbox_id: sid(id),
            generation: 2,
            ..Default::default()
        })
        .await
        .unwrap();
    wait_for(&driver, id, pb::State::Running).await;
    assert_eq!(
        state(&pause(&driver, id).await.unwrap()),
        (pb::State::Paused, 2)
    );
    let deleted = driver
        .delete(pb::DeleteRequest {
            sandbox_id: sid(id),
        })
        .await
        .unwrap();
    assert!(deleted.deleted);
    drop(driver);
    env.finish().await;
}

/// `runc --root STATE/runc ARGS…` as a child, to be killed half way.
fn runc(env: &TestEnv, args: &[&str]) -> std::process::Child {
    std::process::Command::new("runc")
        .arg("--root")
        .arg(env.state_dir().join("runc"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap()
}

#[tokio::test]
async fn a_pause_or_resume_killed_at_any_point_leaves_the_sandbox_paused_or_running() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "counter", env.spec(&["sh", "-c", COUNTER])).await;
    count_reaches(&driver, id, 3).await;
    let before = lasting_pids(&env, id);
    // A driver restarted finds a paused sandbox paused, under its generation.
    pause(&driver, id).await.unwrap();
    drop(driver);
    let driver = env.open().await;
    assert_eq!(state(&get(&driver, id).await), (pb::State::Paused, 1));
    resume(&driver, id).await.unwrap();
    drop(driver);

    // The runtime's pause or resume (what a driver runs) SIGKILLed after 0 to ~20 ms, then a
    // driver opened on the state: the sandbox is paused (frozen) or running (thawed), never
    // half frozen, and its processes are the same.
    let mut seen = BTreeSet::new();
    for round in 0..24u64 {
        let verb = if round % 2 == 0 { "pause" } else { "resume" };
        let mut child = runc(&env, &[verb, &sid(id)]);
        std::thread::sleep(Duration::from_micros(round / 2 * 1_700));
        let _ = child.kill();
        let _ = child.wait();
        let driver = env.open().await;
        let (now, generation) = state(&get(&driver, id).await);
        let kernel = freezer_state(&env, id);
        match (now, kernel.as_str()) {
            (pb::State::Paused, "FROZEN") | (pb::State::Running, "THAWED") => {}
            other => panic!("round {round} ({verb} killed): {other:?}"),
        }
        assert_eq!(generation, 1);
        let pids = host_pids(&env, id);
        assert!(
            before.is_subset(&pids),
            "round {round}: processes gone: {before:?} → {pids:?}"
        );
        seen.insert(format!("{verb} killed → {now:?}"));
        // The next round starts from the other state.
        if verb == "pause" && now == pb::State::Running {
            pause(&driver, id).await.unwrap();
        } else if verb == "resume" && now == pb::State::Paused {
            resume(&driver, id).await.unwrap();
        }
    }
    eprintln!("outcomes: {seen:?}");
    let driver = env.open().await;
    let at = count(&driver, id).unwrap();
    let after = count_reaches(&driver, id, at + 1).await;
    assert!(after <= at + 10, "{at} → {after}");
    drop(driver);
    env.finish().await;
}

/// `p50` of `samples` (sorted in place).
fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// Pause and resume times through the driver (each a `runc` call and the freeze or thaw) of a
/// sandbox that touched 64 MiB and one that touched 512 MiB (random bytes read by a `dd` that
/// then blocks, holding them), p50 of 10 each, and the paused sandbox's resident memory
/// (`memory.usage_in_bytes`). Run with
/// `cargo nextest run -p sbx-driver-oci --test oci_pause --run-ignored only --no-capture`.
#[tokio::test]
#[ignore = "a measurement: run it by name"]
async fn pause_and_resume_timing() {
    let env = TestEnv::new();
    let driver = env.open().await;
    for mib in [64u64, 512] {
        let script = format!(
            "dd if=/dev/urandom bs={mib}M count=1 iflag=fullblock 2>/dev/null | sleep 3600"
        );
        let (id, _) = create(
            &driver,
            &env,
            &format!("touched-{mib}"),
            env.spec(&["sh", "-c", &script]),
        )
        .await;
        let deadline = Instant::now() + Duration::from_secs(60);
        while memory_bytes(&env, id) < mib << 20 {
            assert!(Instant::now() < deadline, "{}", memory_bytes(&env, id));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let (mut pauses, mut resumes, mut held) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..10 {
            let began = Instant::now();
            pause(&driver, id).await.unwrap();
            pauses.push(began.elapsed());
            held.push(memory_bytes(&env, id));
            let began = Instant::now();
            resume(&driver, id).await.unwrap();
            resumes.push(began.elapsed());
        }
        let mut held_sorted = held.clone();
        held_sorted.sort();
        eprintln!(
            "oci {mib} MiB touched: pause p50 {:?} (min {:?}, max {:?}), resume p50 {:?} \
             (min {:?}, max {:?}), paused memory.usage_in_bytes p50 {:.1} MiB",
            p50(&mut pauses),
            pauses[0],
            pauses[9],
            p50(&mut resumes),
            resumes[0],
            resumes[9],
            held_sorted[5] as f64 / f64::from(1 << 20),
        );
        assert!(held_sorted[0] >= mib << 20, "{held:?}");
        driver
            .delete(pb::DeleteRequest {
                sandbox_id: sid(id),
            })
            .await
            .unwrap();
    }
    assert!(driver.list().await.unwrap().is_empty());
    drop(driver);
    env.finish().await;
}
