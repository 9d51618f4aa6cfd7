//! The vm driver's host side, as another local user and a hostile guest see it:
//!
//! - every file of a vm sandbox on the host is 0600 and every directory 0700 (QEMU's channel
//!   directory 0710 to its own group), and user `nobody` reads no byte of a provider
//!   credential or a secret of the spec's environment — while the VM runs, while a start boots
//!   it again, and after the driver was restarted;
//! - QEMU runs as an unprivileged uid of the sandbox's own range, with no capabilities (none
//!   permitted, effective or in its bounding set), `no_new_privs` and a seccomp filter, and two
//!   VMs run as two uids; a resumed VM and a stopped sandbox's helper guest too;
//! - the console (the sandbox's log) stays within the driver's `log_max`, its rotation read
//!   across by `logs`, and the run's exit is still seen after the guest flooded it.

mod vm_support;

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_vm::{VmDriver, VmDriverOptions};
use vm_support::VmEnv;

const SPEC_SECRET: &str = "spec-secret-7f3a9c1e";
const PROVIDER_SECRET: &str = "provider-token-b41d0e22";

fn create(id: &str, command: &str, env: BTreeMap<String, String>) -> pb::CreateRequest {
    pb::CreateRequest {
        sandbox_id: id.to_string(),
        workspace: "w".into(),
        name: "host-side".into(),
        spec: Some(pb::SandboxSpec {
            command: vec!["sh".into(), "-c".into(), command.into()],
            env: env.into_iter().collect(),
            ..Default::default()
        }),
        run_env: [("PROVIDER_TOKEN".to_string(), PROVIDER_SECRET.to_string())].into(),
        generation: 1,
        stopped: false,
    }
}

async fn exec(driver: &VmDriver, id: &str, script: &str) -> (i32, String) {
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            timeout_seconds: 60,
            ..Default::default()
        })
        .await
        .expect("exec");
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(item) = stream.next().await {
        match item.expect("exec output").chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) | Some(pb::exec_output::Chunk::Stderr(b)) => {
                out.extend(b)
            }
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            None => {}
        }
    }
    (
        code.expect("an exit"),
        String::from_utf8_lossy(&out).into_owned(),
    )
}

/// What user `nobody` (no groups) finds of the secrets under `dir`: `grep -r` as that user,
/// every file it can open read, devices and FIFOs skipped. Empty when it reads none.
fn nobody_finds(dir: &Path) -> String {
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "--",
            "grep",
            "-r",
            "-a",
            "-l",
            "-D",
            "skip",
            "-e",
            SPEC_SECRET,
            "-e",
            PROVIDER_SECRET,
        ])
        .arg(dir)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("setpriv and grep");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// Every entry under `dir` (itself included) that user `nobody` could read, or whose mode is
/// not what a sandbox's host files must have: directories 0700 (QEMU's channel directory
/// `chan` 0710, its group the VM's), everything else 0600; owned by root or `vm_uid`.
fn wrong_modes(dir: &Path, vm_uid: Option<u32>) -> Vec<String> {
    let mut wrong = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(path) = todo.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue; // removed meanwhile
        };
        let mode = meta.mode() & 0o7777;
        let kind = meta.file_type();
        let owner_ok = meta.uid() == 0 || Some(meta.uid()) == vm_uid;
        let mode_ok = if kind.is_dir() {
            mode == 0o700
                || (path.file_name().is_some_and(|n| n == "chan")
                    && mode == 0o710
                    && Some(meta.gid()) == vm_uid)
        } else {
            mode == 0o600
        };
        if !owner_ok || !mode_ok || kind.is_symlink() {
            wrong.push(format!(
                "{} (uid {}, gid {}, mode {mode:o}{})",
                path.display(),
                meta.uid(),
                meta.gid(),
                if kind.is_fifo() {
                    ", fifo"
                } else if kind.is_socket() {
                    ", socket"
                } else {
                    ""
                }
            ));
        }
        if kind.is_dir() {
            for entry in std::fs::read_dir(&path).into_iter().flatten().flatten() {
                todo.push(entry.path());
            }
        }
    }
    wrong.sort();
    wrong
}

/// `/proc/<pid>/status`'s fields, by name.
fn proc_status(pid: i32) -> BTreeMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| {
            (
                k.to_string(),
                v.split_whitespace().collect::<Vec<_>>().join(" "),
            )
        })
        .collect()
}

/// The uid a VM's QEMU (`pid`) runs as, after checking it is sandboxed: the same unprivileged
/// uid real, effective, saved and for the filesystem (gid likewise), no supplementary group
/// beyond KVM's, no capability permitted, effective, inheritable, ambient or in its bounding
/// set, `no_new_privs`, and a seccomp filter (mode 2).
fn sandboxed_uid(pid: i32) -> u32 {
    let status = proc_status(pid);
    let field = |name: &str| status.get(name).cloned().unwrap_or_default();
    let uids: Vec<u32> = field("Uid")
        .split(' ')
        .filter_map(|u| u.parse().ok())
        .collect();
    let gids: Vec<u32> = field("Gid")
        .split(' ')
        .filter_map(|u| u.parse().ok())
        .collect();
    assert_eq!(uids.len(), 4, "{status:?}");
    assert!(
        uids[0] != 0 && uids.iter().all(|&u| u == uids[0]),
        "qemu {pid} runs as uid {uids:?}: {status:?}"
    );
    assert!(
        gids[0] != 0 && gids.iter().all(|&g| g == gids[0]),
        "qemu {pid} runs as gid {gids:?}"
    );
    for cap in ["CapPrm", "CapEff", "CapInh", "CapBnd", "CapAmb"] {
        assert_eq!(field(cap), "0000000000000000", "qemu {pid}'s {cap}");
    }
    assert_eq!(field("NoNewPrivs"), "1", "qemu {pid}'s no_new_privs");
    assert_eq!(field("Seccomp"), "2", "qemu {pid} has no seccomp filter");
    uids[0]
}

fn qemu_pid(driver: &VmDriver, id: &str) -> i32 {
    driver
        .vm_identity(id.parse().unwrap())
        .expect("a live qemu")
        .pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_host_files_are_private_and_nobody_reads_a_secret() {
    let env = VmEnv::new();
    let driver = env.open().await;
    let id = uuid::Uuid::new_v4().to_string();
    let sandbox_dir = driver.sandbox_dir(id.parse().unwrap());
    // The workload keeps both secrets on its disk, as a workload would.
    let workload = "echo \"$SPEC_SECRET $PROVIDER_TOKEN\" > /sandbox/secrets; sync; \
                    while :; do sleep 1; done";
    let spec_env = [("SPEC_SECRET".to_string(), SPEC_SECRET.to_string())].into();
    driver
        .create(create(&id, workload, spec_env))
        .await
        .expect("create");
    let (code, out) = exec(&driver, &id, "cat /sandbox/secrets").await;
    assert_eq!(
        (code, out.trim()),
        (0, format!("{SPEC_SECRET} {PROVIDER_SECRET}").as_str())
    );
    let uid = sandboxed_uid_or_none(&driver, &id);
    let state = env.state.path().to_path_buf();
    let check = |when: &str, uid: Option<u32>| {
        let found = nobody_finds(&state);
        assert!(
            found.is_empty(),
            "{when}: user nobody read a secret in {found}"
        );
        let wrong = wrong_modes(&sandbox_dir, uid);
        assert!(wrong.is_empty(), "{when}: {wrong:#?}");
    };
    check("running", uid);

    // A restart of the driver, and a stop and a start (a new boot, the credential handed to
    // it again) while `nobody` keeps looking.
    drop(driver);
    check("driver gone", uid);
    let driver = env.open().await;
    check("driver back", uid);
    driver
        .stop(pb::StopRequest {
            sandbox_id: id.clone(),
            grace_period_ms: 2000,
        })
        .await
        .expect("stop");
    check("stopped", uid);
    let looking = {
        let state = state.clone();
        let sandbox_dir = sandbox_dir.clone();
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = done.clone();
        let task = std::thread::spawn(move || {
            let mut seen = Vec::new();
            let began = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::SeqCst)
                && began.elapsed() < Duration::from_secs(120)
            {
                let found = nobody_finds(&state);
                if !found.is_empty() {
                    seen.push(found);
                }
                seen.extend(wrong_modes(&sandbox_dir, uid));
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        });
        (done, task)
    };
    driver
        .start(pb::StartRequest {
            sandbox_id: id.clone(),
            generation: 2,
            run_env: [("PROVIDER_TOKEN".to_string(), PROVIDER_SECRET.to_string())].into(),
        })
        .await
        .expect("start");
    looking.0.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut seen = looking.1.join().unwrap();
    seen.dedup();
    assert!(
        seen.is_empty(),
        "during a start, user nobody read or could read: {seen:#?}"
    );
    let uid = sandboxed_uid_or_none(&driver, &id);
    check("started again", uid);
    driver
        .delete(pb::DeleteRequest {
            sandbox_id: id.clone(),
        })
        .await
        .expect("delete");
    assert!(!sandbox_dir.exists());
    env.assert_no_vm_left();
}

/// The VM's uid when its QEMU is not root (`None` when it is: the mode check then allows
/// root's files only).
fn sandboxed_uid_or_none(driver: &VmDriver, id: &str) -> Option<u32> {
    let pid = qemu_pid(driver, id);
    let uid: u32 = proc_status(pid)
        .get("Uid")?
        .split(' ')
        .next()?
        .parse()
        .ok()?;
    (uid != 0).then_some(uid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_qemu_runs_as_its_own_uid_without_capabilities_under_seccomp() {
    let env = VmEnv::new();
    let driver = env.open().await;
    let (a, b) = (
        uuid::Uuid::new_v4().to_string(),
        uuid::Uuid::new_v4().to_string(),
    );
    let workload = "echo started; while :; do sleep 1; done";
    for id in [&a, &b] {
        driver
            .create(create(id, workload, BTreeMap::new()))
            .await
            .expect("create");
    }
    let (uid_a, uid_b) = (
        sandboxed_uid(qemu_pid(&driver, &a)),
        sandboxed_uid(qemu_pid(&driver, &b)),
    );
    assert_ne!(uid_a, uid_b, "two vms, one uid");
    // Everything still works through the sandboxed QEMU: exec, a pause and a resume (the
    // state through a descriptor QMP hands over), a driver restart, a copy out of the stopped
    // sandbox (through a helper guest, itself sandboxed), delete.
    assert_eq!(
        exec(&driver, &a, "echo kept > /sandbox/f; cat /sandbox/f").await,
        (0, "kept\n".to_string())
    );
    driver
        .pause(pb::PauseRequest {
            sandbox_id: a.clone(),
        })
        .await
        .expect("pause");
    driver
        .resume(pb::ResumeRequest {
            sandbox_id: a.clone(),
        })
        .await
        .expect("resume");
    assert_eq!(sandboxed_uid(qemu_pid(&driver, &a)), uid_a);
    assert_eq!(exec(&driver, &a, "cat /sandbox/f").await.1, "kept\n");
    drop(driver);
    let driver = env.open().await;
    assert_eq!(sandboxed_uid(qemu_pid(&driver, &a)), uid_a);
    assert_eq!(exec(&driver, &a, "cat /sandbox/f").await.1, "kept\n");
    driver
        .stop(pb::StopRequest {
            sandbox_id: a.clone(),
            grace_period_ms: 2000,
        })
        .await
        .expect("stop");
    let mut copy = driver
        .copy_from(pb::CopyFromRequest {
            sandbox_id: a.clone(),
            path: "/sandbox/f".into(),
            ..Default::default()
        })
        .await
        .expect("copy out of the stopped sandbox");
    // The helper guest's QEMU, while the copy holds it.
    let helper = helper_qemu(env.state.path(), &a).expect("the helper's qemu");
    assert_eq!(sandboxed_uid(helper), uid_a, "the helper runs as the vm");
    let mut tar = Vec::new();
    while let Some(chunk) = copy.next().await {
        tar.extend(chunk.expect("copy chunk").data);
    }
    assert!(String::from_utf8_lossy(&tar).contains("kept"));
    for id in [&a, &b] {
        driver
            .delete(pb::DeleteRequest {
                sandbox_id: id.clone(),
            })
            .await
            .expect("delete");
    }
    env.assert_no_vm_left();
}

/// The live QEMU whose pidfile is in sandbox `id`'s directory.
fn helper_qemu(state: &Path, id: &str) -> Option<i32> {
    let pidfile: PathBuf = state.join("vms").join(id).join("qemu.pid");
    let text = std::fs::read_to_string(pidfile).ok()?;
    let pid: i32 = text.split_whitespace().next()?.parse().ok()?;
    std::path::Path::new(&format!("/proc/{pid}"))
        .exists()
        .then_some(pid)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_console_flood_stays_within_log_max() {
    const LOG_MAX: u64 = 1 << 20;
    let env = VmEnv::new();
    let driver = env
        .open_with(VmDriverOptions {
            log_max: LOG_MAX,
            ..vm_support::options()
        })
        .await;
    let id = uuid::Uuid::new_v4().to_string();
    // Guest root writes 4 MiB to the console as fast as the UART takes it, then the workload
    // ends.
    let flood = "echo flood-begins; \
                 head -c 3000000 /dev/urandom | od -An -tx1 -v | head -c 4194304 > /dev/console; \
                 echo; echo flood-done; exit 7";
    driver
        .create(create(&id, flood, BTreeMap::new()))
        .await
        .expect("create");
    let console = driver.sandbox_dir(id.parse().unwrap()).join("console.log");
    let previous = console.with_file_name("console.log.1");
    let began = Instant::now();
    let mut most = 0;
    let exited = loop {
        let on_disk = [&console, &previous]
            .iter()
            .map(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
            .sum::<u64>();
        most = most.max(on_disk);
        let got = driver
            .get(pb::GetRequest {
                sandbox_id: id.clone(),
            })
            .await
            .expect("get");
        if got.state == pb::State::Exited as i32 {
            break got;
        }
        assert!(
            began.elapsed() < Duration::from_secs(150),
            "the flood did not end: {got:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!(
        "4 MiB to the console in {:?}; at most {most} bytes on disk",
        began.elapsed()
    );
    // Within the cap and one write past it (a rotation happens before a write that would
    // pass half of it).
    assert!(
        most <= LOG_MAX + (64 << 10),
        "the console took {most} bytes of disk, log_max {LOG_MAX}"
    );
    assert!(
        previous.exists(),
        "no rotation: the flood did not reach the log"
    );
    // The run's end is still read from the console after it was rotated.
    assert_eq!(exited.exit_code, 7, "{exited:?}");
    // `logs` reads across the rotation: the flood's end and the workload's last line.
    let mut stream = driver
        .logs(pb::LogsRequest {
            sandbox_id: id.clone(),
            tail_lines: 20,
            ..Default::default()
        })
        .await
        .expect("logs");
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        text.extend(chunk.expect("log chunk").data);
    }
    let text = String::from_utf8_lossy(&text);
    assert!(text.contains("flood-done"), "{text}");
    driver
        .delete(pb::DeleteRequest {
            sandbox_id: id.clone(),
        })
        .await
        .expect("delete");
    env.assert_no_vm_left();
}

/// A boot's time, create → Running, printed (`SBX_BENCH_VM_BOOTS` boots, 3 by default): run
/// this binary and one built before QEMU's sandboxing in turns to compare them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark: cargo nextest run -p sbx-drivers --test vm_host --run-ignored only"]
async fn vm_boot_timing() {
    let boots: usize = std::env::var("SBX_BENCH_VM_BOOTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(3);
    let env = VmEnv::new();
    let driver = env.open().await;
    for _ in 0..boots {
        let id = uuid::Uuid::new_v4().to_string();
        let began = Instant::now();
        let created = driver
            .create(create(&id, "while :; do sleep 1; done", BTreeMap::new()))
            .await
            .expect("create");
        let took = began.elapsed();
        assert_eq!(created.state, pb::State::Running as i32);
        println!("vm boot create→Running: {:.3} s", took.as_secs_f64());
        driver
            .delete(pb::DeleteRequest {
                sandbox_id: id.clone(),
            })
            .await
            .expect("delete");
    }
    env.assert_no_vm_left();
}
