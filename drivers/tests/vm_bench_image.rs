//! What the vm driver's image and network cost, measured side by side in one run (a benchmark,
//! run by hand: `SBX_VM_BENCH_ROOTFS=/tmp/bookworm.tar cargo nextest run -p sbx-drivers --test
//! vm_bench_image --run-ignored only --no-capture`, the tar made as the README says with
//! `mmdebstrap --variant=apt bookworm /tmp/bookworm.tar`):
//! - create→Ready of a `vm` sandbox of the Debian image: the first (its base disk built),
//!   then later ones, against the bare QEMU boot of the same disks (the very command line the
//!   driver ran, started by hand, timed to the guest's `ready`);
//! - TCP from inside a `vm` sandbox and an `oci` sandbox (both of the busybox image, both on
//!   one gateway network with the same policy) to an upstream namespace the test makes:
//!   50 connects, and 16 MiB sent;
//! - the resident memory of an idle VM (its QEMU) on the host.
//!
//! Every packet goes to namespaces this test makes; the network, its namespaces and the
//! upstream are removed at the end, also when it fails.

// The two drivers' own test support (driver-oci/tests/, driver-vm/tests/): this benchmark
// runs both side by side, so it lives with the crate that holds every driver.
#[path = "../../driver-oci/tests/oci_support/mod.rs"]
mod oci_support;
#[path = "../../driver-vm/tests/vm_support/mod.rs"]
mod vm_support;

use std::io::Read;
use std::net::Ipv4Addr;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use sbx_drivers::network::fixtures::{Upstream, runnable};
use sbx_drivers::network::{Network, NetworkConfig};
use sbx_drivers::oci::{OciDriver, OciDriverOptions};
use sbx_drivers::vm::{VmDriver, VmDriverOptions};
use sbx_drivers::{ComputeDriver, pb};
use uuid::Uuid;

/// Servers of the benchmark in the upstream namespace: on 91 each connection is closed at
/// once (a connect's round trip); on 93 it is read to N bytes, answered "done" and closed.
const BENCH_SERVER: &str = r#"
import socket, sys, threading
n = int(sys.argv[1])
def serve(port, talk):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", port)); s.listen(64)
    while True:
        c, _ = s.accept()
        threading.Thread(target=talk, args=(c,), daemon=True).start()
def close(c):
    c.close()
def sink(c):
    got = 0
    while got < n:
        d = c.recv(1 << 16)
        if not d: break
        got += len(d)
    c.sendall(b"done %d\n" % got); c.close()
threading.Thread(target=serve, args=(91, close), daemon=True).start()
threading.Thread(target=serve, args=(93, sink), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"#;

const BYTES: u64 = 16 << 20;
const CONNECTS: u32 = 50;

struct Cleanup {
    net: Option<Arc<Network>>,
    ids: Vec<Uuid>,
    name: String,
    server: Option<std::process::Child>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Some(mut s) = self.server.take() {
            let _ = s.kill();
            let _ = s.wait();
        }
        if let Some(net) = self.net.take() {
            for id in &self.ids {
                let _ = net.detach(*id);
            }
            let _ = net.teardown();
        }
        let _ = Command::new("nft")
            .args(["delete", "table", "inet", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "delete", "dev", &format!("{}0", self.name)])
            .output();
    }
}

/// Runs `sh -c script` in the sandbox; (exit code, stdout, wall time of the exec).
async fn timed(driver: &dyn ComputeDriver, id: &str, script: &str) -> (i32, String, Duration) {
    let began = Instant::now();
    let mut stream = driver
        .exec(pb::ExecRequest {
            sandbox_id: id.to_string(),
            command: vec!["sh".into(), "-c".into(), script.into()],
            timeout_seconds: 300,
            ..Default::default()
        })
        .await
        .expect("exec");
    let (mut out, mut code) = (Vec::new(), None);
    while let Some(item) = stream.next().await {
        match item.expect("exec output").chunk {
            Some(pb::exec_output::Chunk::Stdout(b)) => out.extend(b),
            Some(pb::exec_output::Chunk::Exit(e)) => code = Some(e.code),
            _ => {}
        }
    }
    (
        code.expect("an exit"),
        String::from_utf8_lossy(&out).into_owned(),
        began.elapsed(),
    )
}

async fn create(driver: &dyn ComputeDriver, spec: pb::SandboxSpec) -> (String, Duration) {
    let id = Uuid::new_v4().to_string();
    let began = Instant::now();
    let snap = driver
        .create(pb::CreateRequest {
            sandbox_id: id.clone(),
            workspace: "bench".into(),
            name: "bench".into(),
            spec: Some(spec),
            generation: 1,
            ..Default::default()
        })
        .await
        .expect("create");
    assert_eq!(snap.state, pb::State::Running as i32, "{snap:?}");
    (id, began.elapsed())
}

/// Per connect and MiB/s from inside sandbox `id` to `upstream`.
async fn network_figures(driver: &dyn ComputeDriver, id: &str, upstream: Ipv4Addr) -> (f64, f64) {
    let (_, _, baseline) = timed(driver, id, "true").await;
    let (code, out, took) = timed(
        driver,
        id,
        &format!(
            "i=0; while [ $i -lt {CONNECTS} ]; do nc {upstream} 91 </dev/null || exit 1; \
             i=$((i+1)); done; echo ok"
        ),
    )
    .await;
    assert_eq!((code, out.trim()), (0, "ok"), "the connects");
    let per_connect = (took.saturating_sub(baseline)).as_secs_f64() * 1000.0 / f64::from(CONNECTS);
    let (code, out, took) = timed(
        driver,
        id,
        &format!("head -c {BYTES} /dev/zero | nc {upstream} 93"),
    )
    .await;
    assert_eq!((code, out.trim()), (0, format!("done {BYTES}").as_str()));
    let mib_s = (BYTES >> 20) as f64 / took.saturating_sub(baseline).as_secs_f64();
    (per_connect, mib_s)
}

/// The guest's "ready" lines for run `run` in the console from `offset`.
fn ready_seen(console: &std::path::Path, offset: u64, run: &str) -> bool {
    let text = std::fs::read(console).unwrap_or_default();
    let from = (offset as usize).min(text.len());
    String::from_utf8_lossy(&text[from..]).contains(&format!("sbx-guest: {run} ready"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a benchmark, run by hand with SBX_VM_BENCH_ROOTFS (see the file's docs)"]
async fn vm_image_boot_network_and_memory_measured_side_by_side() {
    let Some(rootfs) = std::env::var_os("SBX_VM_BENCH_ROOTFS") else {
        panic!("set SBX_VM_BENCH_ROOTFS to a root-filesystem tar (see the file's docs)");
    };
    assert!(runnable(), "needs root, ip, nft and python3");
    let tag = format!("b{:04x}", std::process::id() & 0xffff);
    let name = format!("vb{:04x}", std::process::id() & 0xffff);
    let oci_env = oci_support::TestEnv::new();
    let imported = oci_env
        .images
        .import(std::path::Path::new(&rootfs), Some("debian:bookworm"))
        .expect("import the root filesystem");
    let debian = imported[0].info.clone();
    let image_mib = debian.size as f64 / (1 << 20) as f64;

    let up = Upstream::new(&tag, 24, &[80]);
    let net_dir = tempfile::tempdir().unwrap();
    let mut cleanup = Cleanup {
        net: None,
        ids: Vec::new(),
        name: name.clone(),
        server: None,
    };
    let net = Arc::new(
        Network::open(NetworkConfig {
            name: name.clone(),
            network: Ipv4Addr::new(10, 253, 24, 0),
            prefix: 24,
            state_dir: net_dir.path().into(),
            dns_upstream: None,
            conntrack_max: sbx_drivers::network::DEFAULT_CONNTRACK_MAX,
        })
        .expect("the network"),
    );
    cleanup.net = Some(Arc::clone(&net));
    let mut server = Command::new("ip")
        .args(["netns", "exec", &up.ns, "python3", "-c", BENCH_SERVER])
        .arg(BYTES.to_string())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the bench servers");
    let mut ready = [0u8; 6];
    server
        .stdout
        .as_mut()
        .unwrap()
        .read_exact(&mut ready)
        .unwrap();
    cleanup.server = Some(server);

    let env = vm_support::VmEnv::new();
    let vm: VmDriver = env
        .open_with(VmDriverOptions {
            images: Some(oci_env.images.clone()),
            network: Some(Arc::clone(&net)),
            ..vm_support::options()
        })
        .await;
    let oci: OciDriver = OciDriver::open(
        oci_env.state_dir(),
        oci_env.images.clone(),
        OciDriverOptions {
            network: Some(Arc::clone(&net)),
            ..oci_env.options()
        },
    )
    .await
    .unwrap();

    // create→Ready of the Debian image: the first builds its base disk.
    let debian_spec = pb::SandboxSpec {
        image: debian.digest.clone(),
        command: vec!["sleep".into(), "infinity".into()],
        ..Default::default()
    };
    let mut creates = Vec::new();
    let mut vms = Vec::new();
    for _ in 0..3 {
        let (id, took) = create(&vm, debian_spec.clone()).await;
        creates.push(took);
        vms.push(id);
    }
    // The bare boot: the last VM's very QEMU command line, started by hand on its disks.
    let last: Uuid = vms[2].parse().unwrap();
    let qemu = vm.vm_identity(last).expect("its qemu");
    let cmdline: Vec<String> = std::fs::read(format!("/proc/{}/cmdline", qemu.pid))
        .unwrap()
        .split(|b| *b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(vm.sandbox_dir(last).join("sandbox.json")).unwrap())
            .unwrap();
    let run = record["run_id"].as_str().unwrap().to_string();
    vm.stop(pb::StopRequest {
        sandbox_id: vms[2].clone(),
        grace_period_ms: 2000,
    })
    .await
    .unwrap();
    let console = vm.sandbox_dir(last).join("console.log");
    let mut bare = Vec::new();
    for _ in 0..3 {
        let offset = std::fs::metadata(&console).map(|m| m.len()).unwrap_or(0);
        let began = Instant::now();
        let status = Command::new(&cmdline[0])
            .args(&cmdline[1..])
            .status()
            .unwrap();
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(120);
        while !ready_seen(&console, offset, &run) {
            assert!(Instant::now() < deadline, "the bare boot never got ready");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        bare.push(began.elapsed());
        let pid: i32 = std::fs::read_to_string(vm.sandbox_dir(last).join("qemu.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let gone = Instant::now() + Duration::from_secs(10);
        while std::path::Path::new(&format!("/proc/{pid}")).exists() && Instant::now() < gone {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    // Idle memory: a Debian VM that has run for 10 s more, its QEMU's resident set.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let usage = vm
        .stats(pb::StatsRequest {
            sandbox_id: vms[0].clone(),
        })
        .await
        .unwrap();

    // The network, side by side: the busybox image on both drivers, the same policy.
    let policy = pb::NetworkPolicy {
        mode: pb::NetworkMode::Policy as i32,
        allow: vec![format!("{}:91", up.addr), format!("{}:93", up.addr)],
    };
    let busybox_spec = pb::SandboxSpec {
        image: oci_env.image.digest.clone(),
        command: vec!["sleep".into(), "3600".into()],
        network: Some(policy),
        ..Default::default()
    };
    let (vm_net, _) = create(&vm, busybox_spec.clone()).await;
    let (oci_net, _) = create(&oci, busybox_spec).await;
    cleanup.ids = vec![vm_net.parse().unwrap(), oci_net.parse().unwrap()];
    let (vm_connect, vm_mib) = network_figures(&vm, &vm_net, up.addr).await;
    let (oci_connect, oci_mib) = network_figures(&oci, &oci_net, up.addr).await;

    let ms = |d: &Duration| d.as_secs_f64() * 1000.0;
    let median = |v: &[Duration]| {
        let mut v = v.to_vec();
        v.sort();
        v[v.len() / 2]
    };
    let later = median(&creates[1..]);
    let bare_median = median(&bare);
    println!(
        "image: {image_mib:.0} MiB as stored ({} layers)",
        debian.layers.len()
    );
    println!(
        "create→Ready (vm, Debian image): first {:.0} ms (base disk built), later {:.0} ms and {:.0} ms",
        ms(&creates[0]),
        ms(&creates[1]),
        ms(&creates[2])
    );
    println!(
        "bare QEMU boot of the same disks to ready: {:?} ms; median {:.0} ms; later create / bare = {:.2}x; first / later = {:.2}x",
        bare.iter().map(|d| ms(d).round()).collect::<Vec<_>>(),
        ms(&bare_median),
        ms(&later) / ms(&bare_median),
        ms(&creates[0]) / ms(&later)
    );
    println!(
        "idle Debian VM ({} MiB guest): QEMU resident {:.0} MiB",
        usage.memory_limit_bytes >> 20,
        usage.memory_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "connect (incl. nc's start), per connect: vm {vm_connect:.1} ms, oci {oci_connect:.1} ms = {:.1}x",
        vm_connect / oci_connect
    );
    println!(
        "16 MiB sent: vm {vm_mib:.1} MiB/s, oci {oci_mib:.1} MiB/s = {:.2}x",
        vm_mib / oci_mib
    );

    for id in vms.iter().chain([&vm_net]) {
        vm.delete(pb::DeleteRequest {
            sandbox_id: id.clone(),
        })
        .await
        .unwrap();
    }
    oci.delete(pb::DeleteRequest {
        sandbox_id: oci_net.clone(),
    })
    .await
    .unwrap();
    cleanup.ids.clear();
    drop(oci);
    oci_env.finish().await;
    env.assert_no_vm_left();
    drop(cleanup);
    drop(up);
}
