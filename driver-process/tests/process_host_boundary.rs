//! The process driver's host boundary, attacked from inside a sandbox as the oci driver's is
//! (`oci_host_boundary.rs`): nothing a workload writes may steer host root (needs root,
//! `uidmap` and `root:200000:65536` in /etc/subuid and /etc/subgid).
//!
//! A process sandbox's run directory is host root's and hidden from the workload (the shim
//! covers the state directory with an empty tmpfs), so the attacks plant their links and
//! FIFOs wherever the workload can write, under every name the driver reads, and also try to
//! reach the run directory through the shim's `/proc/1/cwd`.

mod process_support;

use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use process_support::*;
use sbx_driver_api::conformance::attacks;
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_process::ProcessDriver;
use uuid::Uuid;

/// The places a process sandbox's workload can write, and the run directory's names.
const PLANT: &str = "for d in /proc/1/cwd /tmp /var/tmp /dev/shm /sandbox; do \
                     for n in init exit not-found agent.log launcher.log; do f=$d/$n";

struct Decoy(Child);

impl Drop for Decoy {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn wait_ready(driver: &ProcessDriver, id: Uuid, file: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let r = exec(driver, id, &["test", "-e", &format!("/sandbox/{file}")], 5).await;
        if r.exit.is_some_and(|e| e.code == 0) {
            return;
        }
        assert!(Instant::now() < deadline, "sandbox {id} never wrote {file}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn links_and_fifos_a_workload_plants_steer_nothing_of_the_host() {
    let env = TestEnv::new();
    let driver = std::sync::Arc::new(env.open());
    let mut decoy = Decoy({
        use std::os::unix::process::CommandExt;
        Command::new("sleep")
            .arg("600")
            .process_group(0)
            .spawn()
            .unwrap()
    });
    let token = format!("sbx-secret-{}", Uuid::new_v4().simple());
    let secret = std::path::PathBuf::from(format!("/root/{token}"));
    std::fs::write(&secret, &token).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let pid = decoy.0.id();
    let plants = [
        format!("ln -sf /proc/{pid}/stat $f 2>/dev/null"),
        format!("ln -sf {} $f 2>/dev/null", secret.display()),
        "rm -f $f 2>/dev/null; mkfifo $f 2>/dev/null".to_string(),
        "ln -sf /dev/zero $f 2>/dev/null".to_string(),
    ];
    let mut ids = Vec::new();
    for (k, each) in plants.iter().enumerate() {
        for (end, name) in [("exec sleep 3600", "run"), ("exit 127", "gone")] {
            let script =
                format!("{PLANT}; {each}; done; done; echo > /sandbox/ready-{k}-{name}; {end}");
            let id = Uuid::new_v4();
            driver
                .create(create_req(
                    id,
                    &format!("p{k}-{name}"),
                    spec(&["sh", "-c", &script]),
                    1,
                ))
                .await
                .unwrap();
            ids.push((id, end.starts_with("exec"), format!("ready-{k}-{name}")));
        }
    }
    for (id, running, ready) in &ids {
        if *running {
            wait_ready(&driver, *id, ready).await;
        } else {
            wait_for_state(&driver, *id, pb::State::Exited, Duration::from_secs(20)).await;
        }
        // Every call answers promptly, and none says the secret.
        let d = std::sync::Arc::clone(&driver);
        let sid = id.to_string();
        let said = tokio::time::timeout(
            Duration::from_secs(5),
            tokio::spawn(async move {
                let get = d.get(pb::GetRequest { sandbox_id: sid }).await;
                let list = d.list().await;
                format!("{get:?} {list:?}")
            }),
        )
        .await
        .expect("get and list answered within 5 s")
        .unwrap();
        assert!(!said.contains(&token), "the secret came back: {said}");
        let stopped =
            tokio::time::timeout(Duration::from_secs(10), driver.stop(stop_req(*id, 200)))
                .await
                .expect("stop answered within 10 s");
        assert!(stopped.is_ok(), "{stopped:?}");
        assert!(
            decoy.0.try_wait().unwrap().is_none(),
            "a stop signalled the host's decoy"
        );
    }
    let _ = std::fs::remove_file(&secret);
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn the_workload_cannot_open_the_memory_of_the_agent() {
    let env = TestEnv::new();
    let driver = env.open();
    let script = r#"echo > /sandbox/ready; end=$(( $(date +%s) + 3 ))
while [ $(date +%s) -lt $end ]; do
  for p in /proc/[0-9]*; do
    [ "$(cat $p/comm 2>/dev/null)" = 4 ] || [ "$(cat $p/comm 2>/dev/null)" = sbx-agent ] || continue
    echo "$p" >> /sandbox/seen
    (exec 3<>$p/mem) 2>/dev/null && echo "mem $p" >> /sandbox/loot
  done
done
echo > /sandbox/done; exec sleep 3600"#;
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "spy", spec(&["sh", "-c", script]), 1))
        .await
        .unwrap();
    wait_ready(&driver, id, "done").await;
    let seen = exec(&driver, id, &["cat", "/sandbox/seen"], 5).await.stdout;
    assert!(
        !seen.is_empty(),
        "the workload saw no agent: the test tried nothing"
    );
    let loot = exec(&driver, id, &["cat", "/sandbox/loot"], 5).await;
    assert!(
        loot.stdout.is_empty(),
        "the workload opened the agent's memory: {}",
        loot.stdout
    );
    drop(driver);
    env.finish().await;
}

/// Neither the workload nor another exec opens an operator's exec — its stdin pipe, its
/// terminal (the sandbox's own `/dev/pts`, host root's ptys), its memory, environment or
/// working directory (`attack_support`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn neither_the_workload_nor_another_exec_reaches_into_an_exec() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "spy", spec(attacks::PLAYS_GO), 1))
        .await
        .unwrap();
    attacks::execs_are_out_of_reach(&driver, &id.to_string(), "/dev/pts/").await;
    drop(driver);
    env.finish().await;
}

/// A workload that writes about 6 MiB of output keeps its log within the driver's 1 MiB cap,
/// and `logs`, tail or follow, still tells its newest lines (`attack_support`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_flood_of_output_stays_within_the_log_cap() {
    let mut env = TestEnv::new();
    env.log_max = Some(attacks::FLOOD_CAP);
    let driver = env.open();
    let id = Uuid::new_v4();
    let command = attacks::flooder();
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    driver
        .create(create_req(id, "loud", spec(&command), 1))
        .await
        .unwrap();
    let id = id.to_string();
    attacks::a_flood_stays_within_the_log_cap(&driver, &id, env.state_dir.path()).await;
    drop(driver);
    env.finish().await;
}
