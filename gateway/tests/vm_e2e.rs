//! End to end through the real sbxd with the vm driver (issue 7's "Done when"): two VM
//! sandboxes keep their `/sandbox` data across a stop and start of one of them; after a
//! SIGKILL of sbxd both come back Ready on the very same QEMU processes (not rebooted); a
//! sandbox whose generation marker was changed by hand returns to Ready by itself (its actor
//! fails on the drift and its restarted actor adopts the running VM); delete leaves no QEMU.
//!
//! Needs qemu-system-x86_64, qemu-img, mkfs.ext4, a /boot/vmlinuz-* and a static busybox
//! (CI installs qemu-system-x86, qemu-utils, linux-image-amd64, busybox-static); without
//! them the test fails and says what is missing. Each boot takes seconds under TCG; the test
//! boots three times. It prints its timings (create→Ready, stop/start, re-attach after the
//! SIGKILL, drift→Ready).

mod common;
mod vm_support;

use std::time::{Duration, Instant};

use common::{DataDir, eventually, unique};
use sbx_proto::v1::{
    CreateWorkspaceRequest, DeleteSandboxRequest, Phase, StartSandboxRequest, StopSandboxRequest,
};
use vm_support::{
    QemuReaper, READY_LIMIT, accel_in_log, assert_files, asset_cache, by_id, create_vm, get,
    is_alive, log_tail, managed_driver, qemu_of, qemus_under, sh, start_sbxd, wait_for,
    without_ansi, write_marker,
};

/// How long a stop may take (the guest's grace period, then QMP quit, then SIGKILL).
const STOP_LIMIT: Duration = Duration::from_secs(60);
/// How long a hand-changed marker may take to be adopted: the driver's poll, the actor's
/// failure and its supervisor's restart (with backoff), the fresh actor's look.
const DRIFT_LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_vms_survive_stop_start_and_sigkill_and_a_drifted_marker_heals_itself() {
    vm_support::require_vm_tools();
    let data = DataDir::new();
    // Declared after `data`, so dropped before it: no VM outlives a failed test.
    let _reaper = QemuReaper(data.path().to_path_buf());
    let data = data.path();

    // a. sbxd with the vm driver in process, on a fresh data dir.
    let began = Instant::now();
    let d = start_sbxd(data, "vm");
    eprintln!(
        "timing: sbxd start (fresh data dir) → serving: {:?}; accel {}",
        began.elapsed(),
        accel_in_log(&d)
    );
    let sb = d.sandboxes().await;
    let workspace = format!("vm-e2e-{}", unique());
    d.workspaces()
        .await
        .create_workspace(CreateWorkspaceRequest {
            name: workspace.clone(),
            ..Default::default()
        })
        .await
        .expect("create workspace");

    // b. Two VM sandboxes, one after the other (so that each create→Ready is one boot).
    let mut ids = Vec::new();
    for name in ["vm-a", "vm-b"] {
        let (id, took) = create_vm(&d, &sb, &workspace, name).await;
        eprintln!("timing: create→Ready of {name}: {took:?}");
        ids.push(id);
    }
    let (a, b) = (ids[0].clone(), ids[1].clone());

    // c. Exec into each: the command ran once, in the guest, on /sandbox.
    for (id, tag) in [(&a, "data-A"), (&b, "data-B")] {
        let (code, out, err) = sh(
            &sb,
            id,
            &format!("echo {tag} > /sandbox/data && cat /sandbox/boots"),
        )
        .await;
        assert_eq!((code, out.as_str()), (0, "boot\n"), "{id}: stderr {err:?}");
        assert_files(&sb, id, tag, 1, "after the first boot").await;
    }
    let qemu_a1 = qemu_of(data, &a).expect("A's qemu runs");
    let qemu_b = qemu_of(data, &b).expect("B's qemu runs");
    assert_ne!(qemu_a1, qemu_b, "one QEMU per sandbox");

    // c2. A VM's usage is its QEMU's as the host pays it: CPU time and resident memory read
    // within 10 % of QEMU's own /proc figures, against the VM's cpus and memory; its disk is
    // the image's allocated bytes against its size.
    let before = common::rss_kib(qemu_a1.pid);
    let stats = sb
        .clone()
        .get_sandbox_stats(sbx_proto::v1::GetSandboxStatsRequest {
            sandbox: by_id(&a),
            history_seconds: 0,
        })
        .await
        .expect("stats of a VM")
        .into_inner();
    let after = common::rss_kib(qemu_a1.pid);
    let now = stats.current.expect("a current sample");
    eprintln!("stats of a VM: {now:?}");
    assert!(now.running, "{now:?}");
    assert!(now.cpu_seconds_total > 0.0, "{now:?}");
    let (lo, hi) = (before.min(after) * 1024, before.max(after) * 1024);
    assert!(
        now.memory_bytes * 10 >= lo * 9 && now.memory_bytes * 10 <= hi * 11,
        "QEMU's RSS was {lo}..{hi} bytes, stats say {}",
        now.memory_bytes
    );
    assert!(now.memory_limit_bytes >= 128 << 20, "{now:?}");
    assert!(now.cpu_limit_cores >= 1.0, "{now:?}");
    assert!(
        now.has_disk && now.disk_used_bytes > 0 && now.disk_limit_bytes >= now.disk_used_bytes,
        "{now:?}"
    );
    let gen_b = get(&sb, &b).await.generation;

    // d. Stop and start only A: a new boot on the same disk; B untouched.
    let began = Instant::now();
    let stopped = sb
        .clone()
        .stop_sandbox(StopSandboxRequest { sandbox: by_id(&a) })
        .await
        .expect("stop A")
        .into_inner();
    let stopped = if stopped.phase() == Phase::Stopped {
        stopped
    } else {
        wait_for(&d, &sb, &a, Phase::Stopped, STOP_LIMIT, |_| true).await
    };
    eprintln!("timing: stop of A → Stopped: {:?}", began.elapsed());
    assert!(
        !is_alive(qemu_a1),
        "A's QEMU ended with the stop: {stopped:#?}\nsbxd log:\n{}",
        log_tail(&d)
    );
    assert!(is_alive(qemu_b), "B's QEMU runs on while A stops");
    let began = Instant::now();
    sb.clone()
        .start_sandbox(StartSandboxRequest { sandbox: by_id(&a) })
        .await
        .expect("start A");
    let a_ready = wait_for(&d, &sb, &a, Phase::Ready, READY_LIMIT, |_| true).await;
    eprintln!("timing: start of A → Ready: {:?}", began.elapsed());
    assert!(
        a_ready.generation > stopped.generation,
        "a start runs under a new generation: {} then {}",
        stopped.generation,
        a_ready.generation
    );
    let qemu_a2 = qemu_of(data, &a).expect("A's new qemu runs");
    assert_ne!(qemu_a2, qemu_a1, "A booted again");
    assert_files(&sb, &a, "data-A", 2, "A after stop and start").await;
    let b_now = get(&sb, &b).await;
    assert_eq!((b_now.phase(), b_now.generation), (Phase::Ready, gen_b));
    assert_eq!(qemu_of(data, &b), Some(qemu_b), "B was not rebooted");
    assert_files(&sb, &b, "data-B", 1, "B while A stopped and started").await;

    // e. SIGKILL sbxd; the VMs run on; a new sbxd re-attaches both, not rebooting either.
    let gen_a = a_ready.generation;
    let mut d = d;
    d.sigkill();
    drop(d);
    assert!(
        is_alive(qemu_a2) && is_alive(qemu_b),
        "the VMs outlive sbxd"
    );
    let began = Instant::now();
    let d = start_sbxd(data, "vm");
    let serving = began.elapsed();
    let sb = d.sandboxes().await;
    for (id, generation) in [(&a, gen_a), (&b, gen_b)] {
        wait_for(&d, &sb, id, Phase::Ready, READY_LIMIT, |s| {
            s.generation == generation
        })
        .await;
    }
    eprintln!(
        "timing: re-attach after SIGKILL of sbxd (2 VMs): serving after {serving:?}, both Ready after {:?}",
        began.elapsed()
    );
    assert_eq!(qemu_of(data, &a), Some(qemu_a2), "A was not rebooted");
    assert_eq!(qemu_of(data, &b), Some(qemu_b), "B was not rebooted");
    assert_files(&sb, &a, "data-A", 2, "A after the SIGKILL").await;
    assert_files(&sb, &b, "data-B", 1, "B after the SIGKILL").await;

    // f. B's marker changed by hand: B returns to Ready by itself, adopting the running VM
    // under the hand-written generation (its actor fails on the drift; the restarted actor
    // adopts), with its data and its QEMU.
    let drifted = gen_b + 1000;
    let began = Instant::now();
    write_marker(data, &b, drifted);
    let healed = wait_for(&d, &sb, &b, Phase::Ready, DRIFT_LIMIT, |s| {
        s.generation == drifted
    })
    .await;
    eprintln!(
        "timing: hand-changed marker of B → Ready under it: {:?}",
        began.elapsed()
    );
    assert_eq!(healed.reason, "Adopted", "{healed:#?}");
    assert!(
        healed.message.contains(&drifted.to_string()),
        "{}",
        healed.message
    );
    assert_eq!(
        qemu_of(data, &b),
        Some(qemu_b),
        "B was adopted, not rebooted"
    );
    let log = without_ansi(&d.log_text());
    let said = |what: &str| log.lines().any(|l| l.contains(what) && l.contains(&b));
    assert!(
        said("generation drift: the actor restarts to reconcile")
            && said("adopted a running workload after generation drift"),
        "B's actor failed on the drift and its restarted actor adopted:\n{}",
        log_tail(&d)
    );
    assert_files(&sb, &b, "data-B", 1, "B after the drift").await;
    let a_now = get(&sb, &a).await;
    assert_eq!((a_now.phase(), a_now.generation), (Phase::Ready, gen_a));
    assert_eq!(qemu_of(data, &a), Some(qemu_a2), "A untouched by B's drift");

    // g. Delete both: no QEMU of this data dir is left, nor their directories.
    for id in [&a, &b] {
        let deleted = sb
            .clone()
            .delete_sandbox(DeleteSandboxRequest { sandbox: by_id(id) })
            .await
            .expect("delete")
            .into_inner();
        assert!(deleted.deleted, "{id} deleted");
        assert!(
            !data.join("drivers/vm/vms").join(id).exists(),
            "{id}'s directory is gone"
        );
    }
    assert!(
        !is_alive(qemu_a2) && !is_alive(qemu_b),
        "delete answers once the QEMUs have ended"
    );
    eventually(
        Duration::from_secs(10),
        "no qemu of the data dir left",
        || async { qemus_under(data).is_empty().then_some(()) },
    )
    .await;
}

/// `managed:vm`: sbxd runs the vm driver as its own process and passes the --vm-* flags on;
/// after a SIGKILL of sbxd that driver lives on (an orphan holding the state dir's lock) with
/// the VM, and an in-process `--driver vm` on the same data dir stops it and re-attaches the VM
/// without rebooting it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn managed_vm_driver_gets_the_vm_flags_and_hands_its_vm_to_an_in_process_driver() {
    vm_support::require_vm_tools();
    let data = DataDir::new();
    let _reaper = QemuReaper(data.path().to_path_buf());
    let data = data.path();

    let mut d = start_sbxd(data, "managed:vm");
    let driver = managed_driver(data).expect("the managed vm driver runs");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", driver.pid)).expect("its cmdline");
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    let cache = asset_cache().display().to_string();
    for wanted in [
        "driver --backend vm ".to_string(),
        format!("--vm-asset-cache {cache}"),
        "--vm-boot-timeout 100".to_string(),
        "--vm-accel auto".to_string(),
    ] {
        assert!(cmdline.contains(&wanted), "{wanted:?} in {cmdline:?}");
    }

    let sb = d.sandboxes().await;
    let (id, took) = create_vm(&d, &sb, "", "managed-vm").await;
    eprintln!("timing: create→Ready through managed:vm: {took:?}");
    let qemu = qemu_of(data, &id).expect("its qemu runs");
    // QEMU loads the kernel through the descriptor it was started with (`-kernel
    // /proc/self/fd/3`): that descriptor is the asset cache's.
    let kernel = std::fs::read_link(format!("/proc/{}/fd/3", qemu.pid)).expect("qemu's fd 3");
    assert!(
        kernel.starts_with(&cache),
        "the guest's kernel comes from the asset cache the flag named: {}",
        kernel.display()
    );
    let (code, _, err) = sh(&sb, &id, "echo data-M > /sandbox/data").await;
    assert_eq!(code, 0, "{err}");
    let generation = get(&sb, &id).await.generation;

    d.sigkill();
    drop(d);
    assert!(
        is_alive(driver),
        "the driver process outlives a SIGKILLed sbxd"
    );
    assert!(is_alive(qemu), "so does the VM");
    let began = Instant::now();
    let d = start_sbxd(data, "vm");
    let sb = d.sandboxes().await;
    wait_for(&d, &sb, &id, Phase::Ready, READY_LIMIT, |s| {
        s.generation == generation
    })
    .await;
    eprintln!(
        "timing: managed:vm → in-process vm after SIGKILL, Ready after {:?}",
        began.elapsed()
    );
    assert!(!is_alive(driver), "the orphaned managed driver was stopped");
    assert_eq!(qemu_of(data, &id), Some(qemu), "the VM was not rebooted");
    assert_files(&sb, &id, "data-M", 1, "after the hand-over").await;

    let deleted = sb
        .clone()
        .delete_sandbox(DeleteSandboxRequest {
            sandbox: by_id(&id),
        })
        .await
        .expect("delete")
        .into_inner();
    assert!(deleted.deleted);
    eventually(
        Duration::from_secs(10),
        "no qemu of the data dir left",
        || async { qemus_under(data).is_empty().then_some(()) },
    )
    .await;
}

/// Jobs that tell the truth on vm too: the guest looks the command up before it says it
/// runs, so a missing one fails the create itself, with `command not found` and 127 in the
/// record; `sbx run` of a command that is there exits with its code.
#[test]
fn a_missing_command_fails_the_vm_create_and_run_gives_the_exit_code() {
    vm_support::require_vm_tools();
    let data = DataDir::new();
    let _reaper = QemuReaper(data.path().to_path_buf());
    let d = start_sbxd(data.path(), "vm");
    let ep = d.endpoint();
    let made = common::sbx(&ep, &["sandbox", "create", "bad", "--", "no-such-command"]);
    assert_ne!(made.code, 0, "{made:?}");
    assert!(
        made.stderr.contains("command not found: no-such-command"),
        "{made:?}"
    );
    let got = common::sbx(&ep, &["sandbox", "get", "bad", "-o", "json"]).json();
    assert_eq!(got["phase"], "Error", "{got}");
    assert_eq!(got["reason"], "CommandNotFound", "{got}");
    assert_eq!(got["exit_code"], 127, "{got}");
    // Said on the log's stderr, as the workload's own stderr would be.
    let logs = common::sbx(&ep, &["sandbox", "logs", "bad"]);
    assert!(
        logs.stderr.contains("command not found: no-such-command")
            && !logs.stdout.contains("command not found"),
        "{logs:?}"
    );
    let ran = common::sbx(&ep, &["run", "--rm", "--", "sh", "-c", "echo hi; exit 7"]);
    assert_eq!(ran.code, 7, "{ran:?}");
    assert!(ran.stdout.contains("hi"), "{ran:?}");
    common::sbx(&ep, &["sandbox", "delete", "bad"]).ok();
}
