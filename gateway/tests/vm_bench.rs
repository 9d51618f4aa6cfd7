//! vm-driver benchmarks through sbxd, ignored by default. Run as root, in release mode:
//!
//! ```text
//! cargo test --release -p sbx-gateway --test vm_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! - create→Ready through sbxd (gRPC create, then the sandbox's watch until Ready) vs a bare
//!   QEMU boot of the same kernel and shared initramfs with a run of the same command, on a
//!   machine of the same devices (spawn → the guest's "ready" line on the console), interleaved in one run, as a ratio; SBX_BENCH_VM_ROUNDS rounds (default 5);
//! - the time sbxd takes to re-attach SBX_BENCH_VMS (default 20) running VMs after a SIGKILL:
//!   from the new sbxd's spawn until it serves (it serves once every sandbox has re-attached),
//!   and until all are listed Ready — on the same QEMU processes.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{DataDir, Sbxd};
use futures::StreamExt;
use sbx_drivers::vm::{Accel, EXEC_CHANNELS, host_tsc_khz, kernel_cmdline, plain_initramfs};
use sbx_proto::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, ListSandboxesRequest, Phase, Sandbox, SandboxRef,
    SandboxSpec, WatchSandboxesRequest,
};

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "100000".into()],
        ..Default::default()
    }
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn p50(samples: &mut [Duration]) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

/// The first file named `name` under `dir` (depth-first).
fn find_file(dir: &Path, name: &str) -> Option<PathBuf> {
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        if path.is_dir() {
            if let Some(found) = find_file(&path, name) {
                return Some(found);
            }
        } else if path.file_name().is_some_and(|n| n == name) {
            return Some(path);
        }
    }
    None
}

/// Boots the given kernel and initramfs with QEMU directly, as the driver's command line does
/// (microvm, TCG, a fresh raw ext4 disk, console to a file, the control and exec ports, on
/// nothing: the guest's init waits up to 10 s for the ports), as root, without the driver's
/// confinement, and returns the time from spawn to the guest's "ready" line. The disk is made
/// before the clock starts.
fn bare_boot(kernel: &Path, initramfs: &Path, scratch: &Path) -> Duration {
    let disk = scratch.join("bare-disk.img");
    let console = scratch.join("bare-console.log");
    let _ = std::fs::remove_file(&disk);
    let _ = std::fs::remove_file(&console);
    let made = Command::new("qemu-img")
        .args(["create", "-q", "-f", "raw"])
        .arg(&disk)
        .arg("256M")
        .status()
        .expect("qemu-img")
        .success()
        && Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&disk)
            .status()
            .expect("mkfs.ext4")
            .success();
    assert!(made, "bare disk not made");
    let started = Instant::now();
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-machine", "microvm", "-accel", "tcg", "-cpu", "max", "-m", "256M",
        ])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initramfs)
        .arg("-append")
        .arg(kernel_cmdline(Accel::Tcg, host_tsc_khz()))
        .arg("-serial")
        .arg(format!("file:{}", console.display()))
        .arg("-drive")
        .arg(format!(
            "id=disk,file={},format=raw,if=none",
            disk.display()
        ))
        .args(["-device", "virtio-blk-device,drive=disk"])
        .args(["-device", "virtio-serial-device"])
        .args(["-chardev", "null,id=agent"])
        .args(["-device", "virtserialport,chardev=agent,name=sbx.agent"])
        .args((0..EXEC_CHANNELS).flat_map(|k| {
            [
                "-chardev".to_string(),
                format!("null,id=exec{k}"),
                "-device".to_string(),
                format!("virtserialport,chardev=exec{k},name=sbx.exec.{k}"),
            ]
        }))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64");
    let elapsed = loop {
        let text = std::fs::read_to_string(&console).unwrap_or_default();
        if text
            .lines()
            .any(|l| l.starts_with("sbx-guest: ") && l.ends_with(" ready"))
        {
            break started.elapsed();
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "bare boot not ready: {text}"
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let _ = child.kill();
    let _ = child.wait();
    elapsed
}

/// (sandbox id, QEMU pid, QEMU start time) of every live VM under the data dir, sorted.
fn qemu_identities(data: &Path) -> Vec<(String, i32, u64)> {
    let mut found = Vec::new();
    let mut dirs = vec![data.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.file_name().is_some_and(|n| n == "qemu.pid") {
                let pid: i32 = std::fs::read_to_string(&path)
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse().ok())
                    .unwrap_or(0);
                if let Some(start) = common::proc_start_time(pid) {
                    let id = dir.file_name().unwrap().to_string_lossy().into_owned();
                    found.push((id, pid, start));
                }
            }
        }
    }
    found.sort();
    found
}

async fn list_all(d: &Sbxd) -> Vec<Sandbox> {
    d.sandboxes()
        .await
        .list_sandboxes(ListSandboxesRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sandboxes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn vm_create_to_ready_through_sbxd_vs_bare_qemu() {
    let rounds = env_usize("SBX_BENCH_VM_ROUNDS", 5);
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "vm", &["--vm-accel", "tcg"]);
    let sb = d.sandboxes().await;
    let (mut through, mut bare) = (Vec::new(), Vec::new());
    for i in 0..rounds {
        let mut watch = sb
            .clone()
            .watch_sandboxes(WatchSandboxesRequest::default())
            .await
            .unwrap()
            .into_inner();
        let started = Instant::now();
        let created = sb
            .clone()
            .create_sandbox(CreateSandboxRequest {
                providers: Default::default(),
                workspace: String::new(),
                name: format!("b{i}"),
                spec: Some(spec()),
                stopped: false,
            })
            .await
            .unwrap()
            .into_inner();
        loop {
            let ev = tokio::time::timeout(Duration::from_secs(120), watch.next())
                .await
                .expect("Ready within 120 s")
                .unwrap()
                .unwrap();
            let s = ev.sandbox.unwrap();
            if s.id == created.id && s.phase() == Phase::Ready {
                break;
            }
        }
        through.push(started.elapsed());
        // The bare boot uses the driver's kernel and shared initramfs, with a run's archive
        // for the same command appended (a sandbox's own is only ever in memory).
        let kernel = find_file(data.path(), "vmlinux").expect("the unpacked kernel");
        let shared = find_file(data.path(), "initramfs.cpio").expect("the shared initramfs");
        let copy = data.path().join("bare-initramfs.cpio");
        std::fs::write(
            &copy,
            plain_initramfs(
                &std::fs::read(&shared).unwrap(),
                &format!("bare{i}"),
                &spec().command,
            ),
        )
        .unwrap();
        sb.clone()
            .delete_sandbox(DeleteSandboxRequest {
                sandbox: Some(SandboxRef {
                    id: created.id,
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
        bare.push(bare_boot(&kernel, &copy, data.path()));
    }
    let (t, b) = (p50(&mut through), p50(&mut bare));
    println!(
        "vm create→Ready through sbxd (TCG, {rounds} rounds): p50 {t:?} (min {:?}, max {:?}); bare QEMU boot → guest ready: p50 {b:?} (min {:?}, max {:?}); ratio (p50) {:.2}x",
        through[0],
        through[rounds - 1],
        bare[0],
        bare[rounds - 1],
        t.as_secs_f64() / b.as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn vm_reattach_running_vms_after_sigkill() {
    let n = env_usize("SBX_BENCH_VMS", 20);
    let data = DataDir::new();
    let mut d = Sbxd::start(
        data.path(),
        "vm",
        &["--vm-accel", "tcg", "--vm-memory-mib", "256"],
    );
    let sb = d.sandboxes().await;
    let began = Instant::now();
    futures::stream::iter((0..n).map(|i| format!("r{i}")))
        .for_each_concurrent(2, |name| {
            let mut client = sb.clone();
            async move {
                client
                    .create_sandbox(CreateSandboxRequest {
                        providers: Default::default(),
                        workspace: String::new(),
                        name,
                        spec: Some(spec()),
                        stopped: false,
                    })
                    .await
                    .unwrap();
            }
        })
        .await;
    let deadline = Instant::now() + Duration::from_secs(600);
    let before = loop {
        let all = list_all(&d).await;
        if all.len() == n && all.iter().all(|s| s.phase() == Phase::Ready) {
            break all;
        }
        assert!(Instant::now() < deadline, "not all {n} vms Ready");
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!("{n} vms created and Ready in {:?}", began.elapsed());
    let qemu_before = qemu_identities(data.path());
    assert_eq!(qemu_before.len(), n, "one live qemu per sandbox");
    drop(before);

    d.sigkill();
    let spawned = Instant::now();
    let mut d = Sbxd::spawn(
        data.path(),
        "vm",
        "127.0.0.1:0",
        &["--vm-accel", "tcg", "--vm-memory-mib", "256"],
    );
    d.wait_serving();
    let serving = spawned.elapsed();
    let after = loop {
        let all = list_all(&d).await;
        if all.len() == n && all.iter().all(|s| s.phase() == Phase::Ready) {
            break all;
        }
        assert!(
            spawned.elapsed() < Duration::from_secs(300),
            "not all Ready again"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let all_ready = spawned.elapsed();
    assert_eq!(
        qemu_before,
        qemu_identities(data.path()),
        "a vm was rebooted"
    );
    println!(
        "re-attach of {n} running vms after SIGKILL of sbxd: serving after {serving:?}, all listed Ready after {all_ready:?}; every QEMU process the same"
    );
    for s in after {
        d.sandboxes()
            .await
            .delete_sandbox(DeleteSandboxRequest {
                sandbox: Some(SandboxRef {
                    id: s.id,
                    ..Default::default()
                }),
            })
            .await
            .unwrap();
    }
}
