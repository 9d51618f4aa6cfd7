//! The oci driver's host boundary, attacked from inside a sandbox: nothing a workload writes
//! may steer host root (needs root, runc and a static busybox).
//!
//! Each test plays one attack an earlier driver fell to, the way a workload would try it — in
//! every directory a sandbox can write, under every name the driver ever read or wrote there
//! (`init`, `exit`, `not-found`, `agent.log`, `pid`) — and then checks what host code did with
//! it: no host process signalled, no host file read back or created, no call hung, no memory
//! blown up. Each was seen failing against the driver before its run directory became
//! one-way (the closing note of the host-boundary issue has the output).

mod oci_support;

use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use futures::StreamExt;
use oci_support::{TestEnv, create, exec, wait_for};
use sbx_driver_api::conformance::attacks;
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_oci::OciDriver;
use uuid::Uuid;

/// The directories an attack plants its files in: the run directory an earlier driver bound
/// at `/dev/.sbx-run`, and every other place a workload can write.
const PLANT_DIRS: &str = "/dev/.sbx-run /dev/.sbx /dev /tmp /sandbox /";
/// The names host code of an earlier driver read or wrote in the run directory.
const PLANT_NAMES: &str = "init exit not-found agent.log pid";

/// A host process of the test's own, which no sandbox may signal.
struct Decoy(Child);

impl Decoy {
    fn start() -> Decoy {
        use std::os::unix::process::CommandExt;
        Decoy(
            Command::new("sleep")
                .arg("600")
                .process_group(0)
                .spawn()
                .unwrap(),
        )
    }
    fn pid(&self) -> u32 {
        self.0.id()
    }
    fn alive(&mut self) -> bool {
        self.0.try_wait().unwrap().is_none()
    }
}

impl Drop for Decoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A root-only host file holding a token that must never come back out of the driver.
struct Secret {
    path: std::path::PathBuf,
    token: String,
}

impl Secret {
    fn new() -> Secret {
        let token = format!("sbx-secret-{}", Uuid::new_v4().simple());
        let path = std::path::PathBuf::from(format!("/root/{token}"));
        std::fs::write(&path, format!("{token}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        Secret { path, token }
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A shell loop that runs `each` with `$f` set to every planted path.
fn plant(each: &str) -> String {
    plant_names(PLANT_NAMES, each)
}

/// [`plant`] under `names` only.
fn plant_names(names: &str, each: &str) -> String {
    format!("for d in {PLANT_DIRS}; do for n in {names}; do f=$d/$n; {each}; done; done")
}

/// Waits (bounded) until the workload of sandbox `id` has written `/sandbox/ready`.
async fn wait_ready(driver: &OciDriver, id: Uuid) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !driver.volume_dir(id).join("ready").exists() {
        assert!(Instant::now() < deadline, "sandbox {id} never got ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Everything the driver says about sandbox `id` that a caller can see: its snapshot, its
/// listing, its log, and what an exec answers.
async fn all_said(driver: &OciDriver, id: Uuid) -> String {
    let sid = id.to_string();
    let mut said = format!(
        "{:?}",
        driver
            .get(pb::GetRequest {
                sandbox_id: sid.clone(),
            })
            .await
    );
    said.push_str(&format!("{:?}", driver.list().await));
    if let Ok(mut logs) = driver
        .logs(pb::LogsRequest {
            sandbox_id: sid.clone(),
            ..Default::default()
        })
        .await
    {
        while let Ok(Some(chunk)) = tokio::time::timeout(Duration::from_secs(2), logs.next()).await
        {
            said.push_str(&format!("{chunk:?}"));
            if let Ok(c) = chunk {
                said.push_str(&String::from_utf8_lossy(&c.data));
            }
        }
    }
    match driver
        .exec(pb::ExecRequest {
            sandbox_id: sid,
            command: vec!["true".into()],
            timeout_seconds: 10,
            ..Default::default()
        })
        .await
    {
        Ok(mut s) => {
            while let Some(item) = s.next().await {
                said.push_str(&format!("{item:?}"));
            }
        }
        Err(e) => said.push_str(&e.to_string()),
    }
    said
}

#[tokio::test]
async fn a_symlinked_init_file_signals_no_host_process_on_stop() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let mut decoy = Decoy::start();
    let script = format!(
        "{}; touch /sandbox/ready; exec sleep 3600",
        plant(&format!(
            "ln -sf /proc/{}/stat $f.x 2>/dev/null && mv -f $f.x $f 2>/dev/null",
            decoy.pid()
        ))
    );
    let (id, _) = create(&driver, &env, "kill", env.spec(&["sh", "-c", &script])).await;
    wait_ready(&driver, id).await;
    driver
        .stop(pb::StopRequest {
            sandbox_id: id.to_string(),
            grace_period_ms: 500,
        })
        .await
        .unwrap();
    assert!(decoy.alive(), "the stop signalled the host's decoy process");
    // A new driver instance (a restart of the gateway) reads the sandbox's state again.
    drop(driver);
    let driver = env.open().await;
    let s = driver
        .start(pb::StartRequest {
            sandbox_id: id.to_string(),
            generation: 2,
            run_env: Default::default(),
        })
        .await
        .unwrap();
    assert_eq!(s.state, pb::State::Running as i32, "{s:?}");
    wait_ready(&driver, id).await;
    drop(driver);
    let driver = env.open().await;
    driver
        .stop(pb::StopRequest {
            sandbox_id: id.to_string(),
            grace_period_ms: 500,
        })
        .await
        .unwrap();
    assert!(decoy.alive(), "a reopened driver signalled the decoy");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn linked_status_and_agent_files_reveal_no_host_file() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let secret = Secret::new();
    // What the driver read back into a status or an error (the init's own record left
    // alone, so that the run is seen).
    let link = plant_names(
        "not-found agent.log",
        &format!(
            "ln -sf {} $f.x 2>/dev/null && mv -f $f.x $f 2>/dev/null",
            secret.path.display()
        ),
    );
    // The main process says it was not found (exit 127) after linking every status file to
    // the secret.
    let (missing, _) = create(
        &driver,
        &env,
        "missing",
        env.spec(&["sh", "-c", &format!("{link}; exit 127")]),
    )
    .await;
    let s = wait_for(&driver, missing, pb::State::Exited).await;
    assert_eq!(s.exit_code, 127, "{s:?}");
    let said = all_said(&driver, missing).await;
    assert!(
        !said.contains(&secret.token),
        "the secret came back: {said}"
    );
    // The workload kills what serves exec (every process of the sandbox it can), so that an
    // exec's error quotes the agent's last words.
    let kill = "for p in /proc/[0-9]*; do p=${p#/proc/}; [ $p -ne 1 ] && [ $p -ne $$ ] && \
                kill -9 $p 2>/dev/null; done";
    let (silent, _) = create(
        &driver,
        &env,
        "silent",
        env.spec(&[
            "sh",
            "-c",
            &format!("{link}; {kill}; touch /sandbox/ready; exec sleep 3600"),
        ]),
    )
    .await;
    wait_ready(&driver, silent).await;
    let said = all_said(&driver, silent).await;
    assert!(
        !said.contains(&secret.token),
        "the secret came back: {said}"
    );
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_raced_write_of_the_init_file_creates_no_host_file() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let target = format!("/root/sbx-race-{}", Uuid::new_v4().simple());
    // From its first instruction on, the workload keeps a link to the target under every name
    // in every place, while the driver records the run: a loop of its own for each name, and
    // one for the rest of the places.
    let mut script = String::new();
    for n in PLANT_NAMES.split(' ') {
        script.push_str(&format!(
            "(while :; do ln -sf {target} /dev/.sbx-run/{n} 2>/dev/null; done) & "
        ));
    }
    script.push_str(&format!(
        "touch /sandbox/ready; while :; do {}; done",
        plant(&format!("ln -sf {target} $f 2>/dev/null"))
    ));
    let (id, _) = create(&driver, &env, "race", env.spec(&["sh", "-c", &script])).await;
    let tries: u64 = std::env::var("SBX_RACE_TRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    for generation in 2..2 + tries {
        driver
            .stop(pb::StopRequest {
                sandbox_id: id.to_string(),
                grace_period_ms: 50,
            })
            .await
            .unwrap();
        assert!(
            !std::path::Path::new(&target).exists(),
            "try {generation}: the driver created {target} through a link"
        );
        driver
            .start(pb::StartRequest {
                sandbox_id: id.to_string(),
                generation,
                run_env: Default::default(),
            })
            .await
            .unwrap();
    }
    assert!(
        !std::path::Path::new(&target).exists(),
        "the driver created {target} through a link"
    );
    drop(driver);
    env.finish().await;
}

/// This process's resident set, in KiB.
fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

/// Every call the gateway makes of a sandbox answers within `limit`, run as a task of its
/// own (so a call that blocks its thread is seen, not waited for).
async fn every_call_answers(driver: &std::sync::Arc<OciDriver>, id: Uuid, limit: Duration) {
    let calls: [(&str, usize); 4] = [("get", 0), ("list", 1), ("logs", 2), ("exec", 3)];
    for (name, which) in calls {
        let d = std::sync::Arc::clone(driver);
        let sid = id.to_string();
        let call = tokio::spawn(async move {
            match which {
                0 => d.get(pb::GetRequest { sandbox_id: sid }).await.map(|_| ()),
                1 => d.list().await.map(|_| ()),
                2 => d
                    .logs(pb::LogsRequest {
                        sandbox_id: sid,
                        ..Default::default()
                    })
                    .await
                    .map(|_| ()),
                _ => d
                    .exec(pb::ExecRequest {
                        sandbox_id: sid,
                        command: vec!["true".into()],
                        timeout_seconds: 5,
                        ..Default::default()
                    })
                    .await
                    .map(|_| ()),
            }
        });
        let started = Instant::now();
        let answered = tokio::time::timeout(limit, call).await;
        assert!(
            answered.is_ok(),
            "{name} of sandbox {id} did not answer within {limit:?}"
        );
        assert!(started.elapsed() < limit);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifos_and_dev_zero_where_the_driver_reads_neither_hang_nor_bloat_it() {
    let env = TestEnv::new();
    let driver = std::sync::Arc::new(env.open().await);
    let before = rss_kib();
    for (name, each) in [
        (
            "fifo",
            "rm -f $f 2>/dev/null; mkfifo $f.x 2>/dev/null && mv -f $f.x $f 2>/dev/null",
        ),
        (
            "zero",
            "ln -sf /dev/zero $f.x 2>/dev/null && mv -f $f.x $f 2>/dev/null",
        ),
    ] {
        // One sandbox that keeps running, one whose main process says it was not found.
        for (suffix, end) in [("run", "exec sleep 3600"), ("gone", "exit 127")] {
            let script = format!("{}; touch /sandbox/ready; {end}", plant(each));
            let (id, _) = create(
                &driver,
                &env,
                &format!("{name}-{suffix}"),
                env.spec(&["sh", "-c", &script]),
            )
            .await;
            wait_ready(&driver, id).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            every_call_answers(&driver, id, Duration::from_secs(2)).await;
            let stop = tokio::time::timeout(
                Duration::from_secs(10),
                driver.stop(pb::StopRequest {
                    sandbox_id: id.to_string(),
                    grace_period_ms: 200,
                }),
            )
            .await;
            assert!(
                matches!(stop, Ok(Ok(_))),
                "stop of {name}-{suffix}: {stop:?}"
            );
            let grown = rss_kib().saturating_sub(before);
            assert!(
                grown < 64 * 1024,
                "the driver's process grew by {grown} KiB reading {name}s"
            );
        }
    }
    // A driver reopened on the same state finds every sandbox again, promptly.
    let started = Instant::now();
    drop(driver);
    let driver = env.open().await;
    assert_eq!(driver.list().await.unwrap().len(), 4);
    assert!(started.elapsed() < Duration::from_secs(10));
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn the_workload_cannot_open_the_memory_of_the_agent_or_the_loggers() {
    let env = TestEnv::new();
    let driver = env.open().await;
    // For 3 s the workload tries to open, for writing, the memory of every sbx-agent it can
    // see (the exec agent and the two loggers), as a patch of the agent — and so of every
    // later exec — would need; it records what it managed and what it saw.
    let script = r#"touch /sandbox/ready; end=$(( $(date +%s) + 3 ))
while [ $(date +%s) -lt $end ]; do
  for p in /proc/[0-9]*; do
    [ "$(cat $p/comm 2>/dev/null)" = sbx-agent ] || continue
    echo "$p" >> /sandbox/seen
    (exec 3<>$p/mem) 2>/dev/null && echo "mem $p" >> /sandbox/loot
    (exec 3<$p/fd/1) 2>/dev/null && echo "fd $p" >> /sandbox/loot
  done
done
touch /sandbox/done; exec sleep 3600"#;
    let (id, _) = create(&driver, &env, "spy", env.spec(&["sh", "-c", script])).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !driver.volume_dir(id).join("done").exists() {
        assert!(
            Instant::now() < deadline,
            "the workload never finished looking"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let seen = std::fs::read_to_string(driver.volume_dir(id).join("seen")).unwrap_or_default();
    assert!(
        !seen.is_empty(),
        "the workload saw no sbx-agent: the test tried nothing"
    );
    let loot = std::fs::read_to_string(driver.volume_dir(id).join("loot")).unwrap_or_default();
    assert!(
        loot.is_empty(),
        "the workload reached into an sbx-agent: {loot}"
    );
    // The agent still serves.
    assert_eq!(exec(&driver, &id.to_string(), &["true"]).await.0, 0);
    drop(driver);
    env.finish().await;
}

/// Neither the workload nor another exec opens an operator's exec — its stdin pipe, its
/// terminal (`/dev/.sbx-pts`, host root's ptys), its memory, environment or working
/// directory (`attack_support`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn neither_the_workload_nor_another_exec_reaches_into_an_exec() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "spy", env.spec(attacks::PLAYS_GO)).await;
    attacks::execs_are_out_of_reach(&driver, &id.to_string(), "/dev/.sbx-pts/").await;
    drop(driver);
    env.finish().await;
}

/// A workload that writes about 6 MiB of output keeps its log within the driver's 1 MiB cap,
/// and `logs`, tail or follow, still tells its newest lines (`attack_support`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_output_stays_within_the_log_cap() {
    let mut env = TestEnv::new();
    env.log_max = Some(attacks::FLOOD_CAP);
    let driver = env.open().await;
    let command = attacks::flooder();
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    let (id, _) = create(&driver, &env, "loud", env.spec(&command)).await;
    let id = id.to_string();
    attacks::a_flood_stays_within_the_log_cap(&driver, &id, &env.state_dir()).await;
    drop(driver);
    env.finish().await;
}
