//! oci-driver benchmarks through sbxd, ignored by default. Run as root (runc, busybox-static,
//! docker-registry and skopeo installed), in release mode:
//!
//! ```text
//! cargo test --release -p sbx-gateway --test oci_bench -- --ignored --nocapture --test-threads 1
//! ```
//!
//! Each prints a Markdown table (the figures in docs/BENCHMARKS.md are pasted from them):
//! - create→Ready through sbxd (gRPC create, then the watch until Ready) vs a bare `runc run
//!   -d` of an equivalent bundle — the config.json the driver wrote for a sandbox (new id,
//!   volume, run dir and cgroup) over a fresh overlay of the same image layers — on a runc root
//!   of its own, until runc returns and its pid file is read; SBX_BENCH_OCI_ROUNDS rounds
//!   (default 30), as a ratio of p50s. Interleaved with them, each side first in turn: the oci
//!   driver alone in this process (`OciDriver::create`, which answers once the workload runs)
//!   and, as a control, the same path through a second sbxd on the sim driver, which does no
//!   work. The through-sbxd time is split at the create's answer and at the driver's
//!   "workload started" log line. The bare overlay mount is timed apart (in no other row);
//! - SBX_BENCH_OCI_CONCURRENT (default 50) sandboxes created at once until all are Ready;
//! - `sbx image pull` of a SBX_BENCH_PULL_MIB (default 100) MiB image of incompressible
//!   layers from a registry on 127.0.0.1 vs `skopeo copy` of the same image to an `oci:`
//!   layout (and vs that copy plus `tar -xzf` of each layer, since a pull also unpacks), 3
//!   rounds interleaved, each into a fresh image store or destination;
//! - re-attach of SBX_BENCH_OCI_SANDBOXES (default 200) running sandboxes after a SIGKILL of
//!   sbxd: spawn → serving (address file), and → all listed Ready, under the same generation
//!   and on the same container inits (pid and start time), with the memory they took.
//!
//! Every test deletes what it made and checks that no container, mount or cgroup is left; on a
//! failure the guards (`DataDir`, `Sbxd`) delete the containers, unmount and kill by pid.

mod common;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use common::{DataDir, Sbxd, mounts_under, oci_containers, proc_start_time, sbx};
use futures::StreamExt;
use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
use sbx_drivers::image::{IdMap, ImageStore};
use sbx_drivers::oci::{OciDriver, OciDriverOptions};
use sbx_drivers::{ComputeDriver, pb};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, ListSandboxesRequest, Phase, Sandbox, SandboxEvent,
    SandboxRef, SandboxSpec, WatchSandboxesRequest,
};
use serde_json::Value;
use tonic::transport::Channel;

/// The cgroup parent of the sandboxes made through sbxd.
const CGROUP_PARENT: &str = "sbx-bench-oci";
/// The cgroup parent of the bare runc containers.
const BARE_CGROUP_PARENT: &str = "sbx-bench-oci-bare";
/// The cgroup parent of the sandboxes of the in-process driver.
const DIRECT_CGROUP_PARENT: &str = "sbx-bench-oci-direct";
/// The sandboxes' host uid and gid (the driver's default id map).
const HOST_ID: u32 = 200_000;

type Client = SandboxServiceClient<Channel>;

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn spec() -> SandboxSpec {
    SandboxSpec {
        command: vec!["sleep".into(), "100000".into()],
        ..Default::default()
    }
}

fn start_sbxd(data: &DataDir) -> Sbxd {
    // The sandboxes' host uid walks through the data dir's parents to each rootfs.
    std::fs::set_permissions(data.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    Sbxd::start(
        data.path(),
        "oci",
        &["--log-format", "json", "--oci-cgroup-parent", CGROUP_PARENT],
    )
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// p50, p90 and max of the samples (sorted in place).
fn stats(samples: &mut [Duration]) -> (Duration, Duration, Duration) {
    samples.sort();
    let n = samples.len();
    (samples[n / 2], samples[n * 9 / 10], samples[n - 1])
}

fn row(label: &str, samples: &mut [Duration]) -> String {
    let (p50, p90, max) = stats(samples);
    format!(
        "| {label} | {:.1} | {:.1} | {:.1} |",
        ms(p50),
        ms(p90),
        ms(max)
    )
}

fn delete_request(id: &str) -> DeleteSandboxRequest {
    DeleteSandboxRequest {
        sandbox: Some(SandboxRef {
            id: id.to_string(),
            ..Default::default()
        }),
    }
}

/// Every sandbox, all pages.
async fn list_all(sb: &Client) -> Vec<Sandbox> {
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let page = sb
            .clone()
            .list_sandboxes(ListSandboxesRequest {
                page_size: 1000,
                page_token: token,
                ..Default::default()
            })
            .await
            .expect("list sandboxes")
            .into_inner();
        all.extend(page.sandboxes);
        if page.next_page_token.is_empty() {
            return all;
        }
        token = page.next_page_token;
    }
}

/// Polls the list every 2 ms (at most `limit`) until every sandbox of it is Ready and there
/// are `n` of them.
async fn wait_all_ready(sb: &Client, n: usize, limit: Duration) -> Vec<Sandbox> {
    let began = Instant::now();
    loop {
        let all = list_all(sb).await;
        if all.len() == n && all.iter().all(|s| s.phase() == Phase::Ready) {
            return all;
        }
        assert!(
            began.elapsed() < limit,
            "not all of {n} sandboxes Ready within {limit:?}: {} listed, {} Ready, e.g. {:?}",
            all.len(),
            all.iter().filter(|s| s.phase() == Phase::Ready).count(),
            all.iter().find(|s| s.phase() != Phase::Ready)
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Deletes the sandboxes, 8 at a time; answers how long it took.
async fn delete_all(sb: &Client, ids: Vec<String>) -> Duration {
    let began = Instant::now();
    futures::stream::iter(ids)
        .for_each_concurrent(8, |id| {
            let mut client = sb.clone();
            async move {
                client
                    .delete_sandbox(delete_request(&id))
                    .await
                    .unwrap_or_else(|e| panic!("delete sandbox {id}: {e}"));
            }
        })
        .await;
    began.elapsed()
}

/// Asserts that nothing of the sandboxes made under `data` is left: no runtime container, no
/// mount, no cgroup under `cgroup_parent`; then removes that (empty) parent the runtime made
/// in each hierarchy.
fn assert_nothing_left(data: &Path, cgroup_parent: &str) {
    let containers = oci_containers(data);
    assert!(containers.is_empty(), "containers left: {containers:?}");
    let mounts = mounts_under(data);
    assert!(mounts.is_empty(), "mounts left: {mounts:?}");
    let cgroups = OciDriver::cgroup_leftovers(cgroup_parent);
    assert!(cgroups.is_empty(), "cgroups left: {cgroups:?}");
    for hierarchy in std::fs::read_dir("/sys/fs/cgroup")
        .into_iter()
        .flatten()
        .flatten()
    {
        let _ = std::fs::remove_dir(hierarchy.path().join(cgroup_parent));
    }
}

/// A watch of every sandbox, from the current list on.
async fn watch_all(sb: &Client) -> tonic::Streaming<SandboxEvent> {
    sb.clone()
        .watch_sandboxes(WatchSandboxesRequest {
            resource_version: 0,
            ..Default::default()
        })
        .await
        .expect("watch")
        .into_inner()
}

/// CreateSandbox of `name` (the default image, `sleep`), answered.
async fn create(sb: &Client, name: &str) -> Sandbox {
    sb.clone()
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: name.to_string(),
            spec: Some(spec()),
            stopped: false,
        })
        .await
        .unwrap_or_else(|e| panic!("create sandbox {name}: {e}"))
        .into_inner()
}

/// One create through sbxd, timed.
struct Created {
    id: String,
    /// The wall-clock time the create was sent (to place the driver's log lines).
    sent_at: SystemTime,
    /// Sent → the create answered (the record durable, the actor spawned).
    answered: Duration,
    /// Sent → the watch says Ready.
    ready: Duration,
}

/// CreateSandbox, then the watch (opened before the create) until the sandbox is Ready.
async fn create_until_ready(sb: &Client, name: &str) -> Created {
    let mut watch = watch_all(sb).await;
    let sent_at = SystemTime::now();
    let started = Instant::now();
    let created = create(sb, name).await;
    let answered = started.elapsed();
    loop {
        let ev = tokio::time::timeout(Duration::from_secs(30), watch.next())
            .await
            .unwrap_or_else(|_| panic!("sandbox {name} not Ready within 30 s"))
            .expect("the watch ended")
            .expect("a watch event");
        let s = ev.sandbox.expect("an event's sandbox");
        if s.id == created.id {
            assert_ne!(s.phase(), Phase::Error, "sandbox {name}: {s:?}");
            if s.phase() == Phase::Ready {
                return Created {
                    id: created.id,
                    sent_at,
                    answered,
                    ready: started.elapsed(),
                };
            }
        }
    }
}

/// Seconds since the Unix epoch of an RFC 3339 UTC timestamp as sbxd's JSON log writes it
/// (`2026-12-01T09:15:41.304023Z`).
fn log_time(stamp: &str) -> Option<f64> {
    let (date, time) = stamp.strip_suffix('Z')?.split_once('T')?;
    let mut ymd = date.split('-').map(|p| p.parse::<i64>().ok());
    let (y, m, d) = (ymd.next()??, ymd.next()??, ymd.next()??);
    let mut hms = time.split(':');
    let (h, min, sec): (i64, i64, f64) = (
        hms.next()?.parse().ok()?,
        hms.next()?.parse().ok()?,
        hms.next()?.parse().ok()?,
    );
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let days = era * 146_097 + yoe * 365 + yoe / 4 - yoe / 100 + doy - 719_468;
    Some((days * 86_400 + h * 3600 + min * 60) as f64 + sec)
}

/// When the oci driver logged "workload started" (its launch done: runc returned, the init
/// recorded), by sandbox id, from sbxd's JSON log.
fn workload_started_times(log: &Path) -> HashMap<String, f64> {
    std::fs::read_to_string(log)
        .unwrap_or_else(|e| panic!("reading {}: {e}", log.display()))
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|v| v["fields"]["message"] == "workload started")
        .filter_map(|v| {
            Some((
                v["fields"]["sandbox_id"].as_str()?.to_string(),
                log_time(v["timestamp"].as_str()?)?,
            ))
        })
        .collect()
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .expect("after the epoch")
        .as_secs_f64()
}

/// What a bare run copies from a sandbox the driver made: its runtime config and the image
/// layers its overlay is made of (lowest first).
struct Template {
    config: Value,
    layers: Vec<PathBuf>,
}

impl Template {
    fn of(data: &Path, id: &str) -> Template {
        let dir = data.join("drivers/oci/sandboxes").join(id);
        let read = |name: &str| -> Value {
            let path = dir.join(name);
            let bytes =
                std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
        };
        let record = read("sandbox.json");
        let layers: Vec<PathBuf> = record["image"]["layers"]
            .as_array()
            .expect("the record's image layers")
            .iter()
            .map(|l| PathBuf::from(l.as_str().expect("a layer path")))
            .collect();
        assert!(!layers.is_empty(), "the record names no layers: {record}");
        Template {
            config: read("bundle/config.json"),
            layers,
        }
    }
}

/// Makes `dir` owned by the bare containers' root (host uid 200000) with `mode`.
fn hand_to_sandbox(dir: &Path, mode: u32) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).unwrap();
    nix::unistd::chown(
        dir,
        Some(nix::unistd::Uid::from_raw(HOST_ID)),
        Some(nix::unistd::Gid::from_raw(HOST_ID)),
    )
    .unwrap();
}

/// The bare side: runc directly on bundles of its own under `bare` (whose
/// `drivers/oci/runc` is its runc root, so that the `DataDir` guard deletes what a failed
/// run leaves, as it does for sbxd's).
struct Bare<'a> {
    bare: &'a Path,
    template: &'a Template,
}

/// One bare run's times.
struct BareRun {
    mount: Duration,
    run: Duration,
}

impl Bare<'_> {
    fn runc_root(&self) -> PathBuf {
        self.bare.join("drivers/oci/runc")
    }

    /// Makes bundle `n` as the driver makes a sandbox's (walkable dirs, the writable layer,
    /// volume and run dir owned by the sandbox's root, the driver's config with this
    /// bundle's paths and cgroup), mounts a fresh overlay of the template's layers, runs
    /// `runc run -d`, reads the pid file; then deletes the container and unmounts.
    fn run(&self, n: usize) -> BareRun {
        let id = format!("bare-{n}");
        let dir = self.bare.join("bundles").join(&id);
        let bundle = dir.join("bundle");
        let rootfs = bundle.join("rootfs");
        for d in [&dir, &bundle, &rootfs] {
            std::fs::create_dir_all(d).unwrap();
            std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o711)).unwrap();
        }
        let (upper, work, volume, run_dir) = (
            dir.join("upper"),
            dir.join("work"),
            dir.join("volume"),
            dir.join("run"),
        );
        hand_to_sandbox(&upper, 0o755);
        hand_to_sandbox(&volume, 0o755);
        hand_to_sandbox(&run_dir, 0o700);
        std::fs::create_dir_all(&work).unwrap();
        let mut config = self.template.config.clone();
        config["linux"]["cgroupsPath"] = Value::from(format!("/{BARE_CGROUP_PARENT}/{id}"));
        // The bare side runs on the layers as they are on disk (owners in the image store's
        // range), with no idmapped mounts: its root maps to that range, not to a sandbox's own.
        for maps in ["uidMappings", "gidMappings"] {
            config["linux"][maps][0]["hostID"] = Value::from(HOST_ID);
        }
        let mut replaced = 0;
        for m in config["mounts"]
            .as_array_mut()
            .expect("the config's mounts")
        {
            let source = match m["destination"].as_str() {
                Some("/sandbox") => &volume,
                Some("/dev/.sbx-run") => &run_dir,
                _ => continue,
            };
            m["source"] = Value::from(source.to_string_lossy().to_string());
            replaced += 1;
        }
        assert_eq!(replaced, 2, "the volume and run-dir mounts of {config}");
        std::fs::write(
            bundle.join("config.json"),
            serde_json::to_vec_pretty(&config).unwrap(),
        )
        .unwrap();
        let lower: Vec<String> = self
            .template
            .layers
            .iter()
            .rev()
            .map(|l| l.to_string_lossy().to_string())
            .collect();
        let options = format!(
            "lowerdir={},upperdir={},workdir={}",
            lower.join(":"),
            upper.display(),
            work.display()
        );
        let log = dir.join("workload.log");
        let open_log = || {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&log)
                .unwrap()
        };
        let pid_file = run_dir.join("pid");

        let mount_began = Instant::now();
        nix::mount::mount(
            Some("overlay"),
            &rootfs,
            Some("overlay"),
            nix::mount::MsFlags::empty(),
            Some(options.as_str()),
        )
        .unwrap_or_else(|e| panic!("mounting the bare overlay at {}: {e}", rootfs.display()));
        let mount = mount_began.elapsed();

        let began = Instant::now();
        let status = Command::new("runc")
            .arg("--root")
            .arg(self.runc_root())
            .args(["run", "--detach", "--bundle"])
            .arg(&bundle)
            .arg("--pid-file")
            .arg(&pid_file)
            .arg(&id)
            .stdin(Stdio::null())
            .stdout(open_log())
            .stderr(open_log())
            .status()
            .expect("runc runs");
        let pid: Option<i32> = std::fs::read_to_string(&pid_file)
            .ok()
            .and_then(|t| t.trim().parse().ok());
        let run = began.elapsed();
        assert!(
            status.success() && pid.is_some_and(|p| proc_start_time(p).is_some()),
            "bare runc run {id}: {status}, pid {pid:?}: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );

        let deleted = Command::new("runc")
            .arg("--root")
            .arg(self.runc_root())
            .args(["delete", "--force", &id])
            .output()
            .expect("runc runs");
        assert!(deleted.status.success(), "runc delete {id}: {deleted:?}");
        nix::mount::umount2(&rootfs, nix::mount::MntFlags::MNT_DETACH)
            .unwrap_or_else(|e| panic!("unmounting {}: {e}", rootfs.display()));
        std::fs::remove_dir_all(&dir).unwrap();
        BareRun { mount, run }
    }
}

/// The oci driver alone, in this process: its own state dir and image store (holding the
/// same built-in busybox image sbxd makes) under `dir`, whose `drivers/oci/runc` is its
/// runc root (the `DataDir` guard cleans it).
struct Direct {
    driver: OciDriver,
    image: String,
}

impl Direct {
    async fn open(dir: &Path) -> Direct {
        let images = ImageStore::open(dir.join("images"), IdMap::default())
            .unwrap_or_else(|e| panic!("image store in {}: {e}", dir.display()));
        let busybox = sbx_drivers::find_static_busybox(None, &sbx_drivers::BUSYBOX_PATHS)
            .expect("a static busybox");
        let image = images
            .import_busybox(&busybox, "sbx.local/busybox:latest")
            .expect("the busybox image")
            .digest;
        let opts = OciDriverOptions {
            cgroup_parent: DIRECT_CGROUP_PARENT.to_string(),
            ..OciDriverOptions::default()
        };
        let driver = OciDriver::open(dir.join("drivers/oci"), images, opts)
            .await
            .unwrap_or_else(|e| panic!("the oci driver in {}: {e}", dir.display()));
        Direct { driver, image }
    }

    /// `create` (answered once the workload runs) → RUNNING; then `delete`.
    async fn create_and_delete(&self, n: usize) -> Duration {
        let id = uuid::Uuid::new_v4().to_string();
        let began = Instant::now();
        let snapshot = self
            .driver
            .create(pb::CreateRequest {
                run_env: Default::default(),
                sandbox_id: id.clone(),
                workspace: "default".into(),
                name: format!("d{n}"),
                spec: Some(pb::SandboxSpec {
                    command: spec().command,
                    image: self.image.clone(),
                    ..Default::default()
                }),
                generation: 1,
                stopped: false,
            })
            .await
            .unwrap_or_else(|e| panic!("in-process create d{n}: {e}"));
        let took = began.elapsed();
        assert_eq!(snapshot.state(), pb::State::Running, "{snapshot:?}");
        let deleted = self
            .driver
            .delete(pb::DeleteRequest { sandbox_id: id })
            .await
            .unwrap_or_else(|e| panic!("in-process delete d{n}: {e}"));
        assert!(deleted.deleted, "d{n} not deleted");
        took
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn create_to_ready_through_sbxd_vs_bare_runc() {
    let rounds = env_usize("SBX_BENCH_OCI_ROUNDS", 30);
    let data = DataDir::new();
    let (bare_dir, direct_dir) = (DataDir::new(), DataDir::new());
    for dir in [&bare_dir, &direct_dir] {
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    let d = start_sbxd(&data);
    let sb = d.sandboxes().await;
    // The control: the same path through sbxd over the sim driver, which does no work.
    let sim_data = DataDir::new();
    let sim = Sbxd::start(sim_data.path(), "sim", &["--log-format", "json"]);
    let sim_sb = sim.sandboxes().await;

    // A first sandbox warms the path up and lends the bare side its config and layers.
    let first = create_until_ready(&sb, "template").await;
    let template = Template::of(data.path(), &first.id);
    delete_all(&sb, vec![first.id.clone()]).await;
    let bare = Bare {
        bare: bare_dir.path(),
        template: &template,
    };

    let direct = Direct::open(direct_dir.path()).await;

    let (mut through, mut bare_run, mut bare_mount, mut in_process, mut sim_ready) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        // Each side goes first, second, third and fourth in turn.
        for side in 0..4 {
            match (side + i) % 4 {
                3 => {
                    let created = create_until_ready(&sim_sb, &format!("s{i}")).await;
                    delete_all(&sim_sb, vec![created.id.clone()]).await;
                    sim_ready.push(created.ready);
                }
                0 => {
                    let b = bare.run(i);
                    bare_run.push(b.run);
                    bare_mount.push(b.mount);
                }
                1 => {
                    let created = create_until_ready(&sb, &format!("b{i}")).await;
                    delete_all(&sb, vec![created.id.clone()]).await;
                    through.push(created);
                }
                _ => in_process.push(direct.create_and_delete(i).await),
            }
        }
    }
    // Where the time through sbxd goes: the driver's "workload started" line splits it.
    let started = workload_started_times(&d.log);
    let mut to_ready: Vec<Duration> = through.iter().map(|c| c.ready).collect();
    let mut answered: Vec<Duration> = through.iter().map(|c| c.answered).collect();
    let (mut to_launched, mut launched_to_ready) = (Vec::new(), Vec::new());
    for c in &through {
        let at = *started
            .get(&c.id)
            .unwrap_or_else(|| panic!("no \"workload started\" line for {} in sbxd's log", c.id));
        let launched = Duration::from_secs_f64((at - unix_secs(c.sent_at)).max(0.0));
        to_launched.push(launched);
        launched_to_ready.push(c.ready.saturating_sub(launched));
    }
    let ratio = ms(stats(&mut to_ready).0) / ms(stats(&mut bare_run).0);
    let driver_ratio = ms(stats(&mut in_process).0) / ms(stats(&mut bare_run).0);
    println!(
        "\ncreate→Ready, oci driver, {rounds} rounds interleaved (first create, not counted: {:.1} ms)\n\n\
         | path | p50 ms | p90 ms | max ms |\n|---|---|---|---|\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n{}\n\n\
         ratio through sbxd / bare runc (p50): {ratio:.2}x; the driver alone / bare runc: {driver_ratio:.2}x\n",
        ms(first.ready),
        row(
            "through sbxd: CreateSandbox → watch says Ready",
            &mut to_ready
        ),
        row(
            "the oci driver alone, in process: `OciDriver::create` → RUNNING",
            &mut in_process
        ),
        row(
            "bare `runc run -d` of the same bundle → pid file read",
            &mut bare_run
        ),
        row(
            "control: through sbxd on the sim driver (no work) → watch says Ready",
            &mut sim_ready
        ),
        row(
            "(bare overlay mount, before the run; in neither row)",
            &mut bare_mount
        ),
        row(
            "through sbxd, part: CreateSandbox → answered",
            &mut answered
        ),
        row(
            "through sbxd, part: CreateSandbox → the driver logs \"workload started\"",
            &mut to_launched
        ),
        row(
            "through sbxd, part: \"workload started\" → watch says Ready",
            &mut launched_to_ready
        ),
    );

    let (mut d, mut sim) = (d, sim);
    sim.sigterm(Duration::from_secs(30));
    d.sigterm(Duration::from_secs(30));
    assert_nothing_left(data.path(), CGROUP_PARENT);
    assert_nothing_left(bare_dir.path(), BARE_CGROUP_PARENT);
    drop(direct);
    assert_nothing_left(direct_dir.path(), DIRECT_CGROUP_PARENT);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn concurrent_creates_until_all_ready() {
    let n = env_usize("SBX_BENCH_OCI_CONCURRENT", 50);
    let data = DataDir::new();
    let mut d = start_sbxd(&data);
    let sb = d.sandboxes().await;
    // Warm-up, as in the latency benchmark: the first create pays for cold caches.
    let warm = create_until_ready(&sb, "warm").await;
    delete_all(&sb, vec![warm.id]).await;

    // One watch sees every sandbox's Ready; each create notes when it was sent.
    let mut watch = watch_all(&sb).await;
    let watcher = tokio::spawn(async move {
        let mut ready = HashMap::new();
        let deadline = Instant::now() + Duration::from_secs(300);
        while ready.len() < n {
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(Some(Ok(ev))) = tokio::time::timeout(left, watch.next()).await else {
                break;
            };
            let s = ev.sandbox.expect("an event's sandbox");
            assert_ne!(s.phase(), Phase::Error, "{s:?}");
            if s.phase() == Phase::Ready {
                ready.entry(s.name.clone()).or_insert_with(Instant::now);
            }
        }
        ready
    });
    let wall = Instant::now();
    let creates = (0..n).map(|i| {
        let sb = &sb;
        async move {
            let name = format!("c{i}");
            let sent = Instant::now();
            let created = create(sb, &name).await;
            (name, created.id, sent, sent.elapsed())
        }
    });
    let created = futures::future::join_all(creates).await;
    let ready = watcher.await.expect("the watcher");
    let all_ready = ready.values().max().map(|t| t.duration_since(wall));
    assert_eq!(
        ready.len(),
        n,
        "only {} of {n} sandboxes Ready",
        ready.len()
    );
    let mut per: Vec<Duration> = created
        .iter()
        .map(|(name, _, sent, _)| ready[name].duration_since(*sent))
        .collect();
    let mut acks: Vec<Duration> = created.iter().map(|(.., ack)| *ack).collect();
    println!(
        "\n{n} oci sandboxes created at once: all Ready after {:.0} ms (wall)\n\n\
         | per sandbox | p50 ms | p90 ms | max ms |\n|---|---|---|---|\n{}\n{}\n",
        ms(all_ready.expect("a Ready")),
        row("CreateSandbox sent → watch says Ready", &mut per),
        row("CreateSandbox sent → answered", &mut acks),
    );
    let took = delete_all(&sb, created.into_iter().map(|(_, id, ..)| id).collect()).await;
    println!("deleted them (8 at a time) in {:.0} ms", ms(took));
    d.sigterm(Duration::from_secs(30));
    assert_nothing_left(data.path(), CGROUP_PARENT);
}

/// Incompressible bytes (xorshift64).
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// The layer digests of the one image in the OCI layout at `dir`.
fn layout_layers(dir: &Path) -> Vec<PathBuf> {
    let read = |path: PathBuf| -> Value {
        serde_json::from_slice(
            &std::fs::read(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display())),
        )
        .unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
    };
    let blob = |digest: &str| dir.join("blobs/sha256").join(&digest["sha256:".len()..]);
    let index = read(dir.join("index.json"));
    let manifest = read(blob(
        index["manifests"][0]["digest"]
            .as_str()
            .expect("a manifest"),
    ));
    manifest["layers"]
        .as_array()
        .expect("layers")
        .iter()
        .map(|l| blob(l["digest"].as_str().expect("a layer digest")))
        .collect()
}

/// `skopeo copy` of `reference` from the loopback registry to a fresh `oci:` layout at `dest`.
fn skopeo_copy(reference: &str, dest: &Path) -> Duration {
    let began = Instant::now();
    let out = Command::new("skopeo")
        .args(["--insecure-policy", "copy", "--src-tls-verify=false"])
        .arg(format!("docker://{reference}"))
        .arg(format!("oci:{}:v1", dest.display()))
        .output()
        .expect("skopeo runs");
    let took = began.elapsed();
    assert!(out.status.success(), "skopeo copy {reference}: {out:?}");
    took
}

/// `tar -xzf` of each layer of the layout at `layout`, each into its own dir under `into`.
fn untar_layers(layout: &Path, into: &Path) -> Duration {
    let began = Instant::now();
    for (i, blob) in layout_layers(layout).iter().enumerate() {
        let dir = into.join(i.to_string());
        std::fs::create_dir_all(&dir).unwrap();
        let out = Command::new("tar")
            .arg("-xzf")
            .arg(blob)
            .arg("-C")
            .arg(&dir)
            .output()
            .expect("tar runs");
        assert!(out.status.success(), "tar -xzf {}: {out:?}", blob.display());
    }
    began.elapsed()
}

/// Asserts that the image store under `data` holds every noise layer unpacked (the file
/// whole, owned by the sandboxes' root): the pull did not stop at the download.
fn assert_unpacked(data: &Path, layers: usize, size: usize) {
    use std::os::unix::fs::MetadataExt;
    let root = data.join("images/layers/sha256");
    let dirs: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap_or_else(|e| panic!("reading {}: {e}", root.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    for i in 0..layers {
        let found = dirs
            .iter()
            .find_map(|d| std::fs::metadata(d.join(format!("data/noise-{i}"))).ok())
            .unwrap_or_else(|| panic!("layer {i} is not unpacked under {}", root.display()));
        assert_eq!(
            (found.len(), found.uid()),
            (size as u64, HOST_ID),
            "layer {i}'s file"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn image_pull_vs_skopeo_copy() {
    if !LocalRegistry::available("image_pull_vs_skopeo_copy") {
        return;
    }
    let mib = env_usize("SBX_BENCH_PULL_MIB", 100);
    let layers = 4;
    let work = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(work.path());
    let made = Instant::now();
    let tars: Vec<Vec<u8>> = (0..layers)
        .map(|i| {
            fixtures::tar_bytes(&[
                TarEntry::dir("data/"),
                TarEntry::file(
                    &format!("data/noise-{i}"),
                    &noise((mib << 20) / layers, 0x9e37_79b9_7f4a_7c15 + i as u64),
                ),
            ])
        })
        .collect();
    let layout = work.path().join("layout");
    fixtures::write_oci_layout(&layout, &tars, "v1");
    drop(tars);
    let reference = format!("{}/bench/big:v1", registry.addr);
    registry.push(&layout, &reference, &[]);
    let pushed: u64 = layout_layers(&layout)
        .iter()
        .map(|b| std::fs::metadata(b).unwrap().len())
        .sum();
    println!(
        "image: {layers} gzip layers, {:.1} MiB compressed, built and pushed in {:.1} s",
        pushed as f64 / f64::from(1 << 20),
        made.elapsed().as_secs_f64()
    );

    let (mut pulls, mut copies, mut unpacks) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..3 {
        // sbx: a fresh sbxd (so a fresh image store) each round; only the CLI run is timed.
        let data = DataDir::new();
        let mut d = start_sbxd(&data);
        let began = Instant::now();
        let pulled = sbx(&d.endpoint(), &["image", "pull", &reference, "-o", "json"]).json();
        pulls.push(began.elapsed());
        assert_eq!(
            pulled["layers"].as_array().map(Vec::len),
            Some(layers),
            "{pulled}"
        );
        assert_unpacked(data.path(), layers, (mib << 20) / layers);
        d.sigterm(Duration::from_secs(30));
        drop(d);
        drop(data);

        let dest = work.path().join(format!("skopeo-{round}"));
        copies.push(skopeo_copy(&reference, &dest));
        unpacks.push(untar_layers(
            &dest,
            &work.path().join(format!("unpacked-{round}")),
        ));
        std::fs::remove_dir_all(&dest).unwrap();
        std::fs::remove_dir_all(work.path().join(format!("unpacked-{round}"))).unwrap();
    }
    let both: Vec<Duration> = copies.iter().zip(&unpacks).map(|(c, u)| *c + *u).collect();
    let p50 = |v: &[Duration]| {
        let mut v = v.to_vec();
        stats(&mut v).0
    };
    let list = |v: &[Duration]| {
        v.iter()
            .map(|d| format!("{:.2}", d.as_secs_f64()))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "\n{mib} MiB image from the loopback registry, 3 rounds interleaved, fresh destination each\n\n\
         | tool | rounds s | p50 s |\n|---|---|---|\n\
         | `sbx image pull` (download, verify, unpack with shifted owners) | {} | {:.2} |\n\
         | `skopeo copy docker:// oci:` (download, verify) | {} | {:.2} |\n\
         | `skopeo copy` then `tar -xzf` of each layer | {} | {:.2} |\n\n\
         ratio sbx / skopeo copy (p50): {:.2}x; sbx / skopeo copy + tar: {:.2}x\n",
        list(&pulls),
        p50(&pulls).as_secs_f64(),
        list(&copies),
        p50(&copies).as_secs_f64(),
        list(&both),
        p50(&both).as_secs_f64(),
        p50(&pulls).as_secs_f64() / p50(&copies).as_secs_f64(),
        p50(&pulls).as_secs_f64() / p50(&both).as_secs_f64(),
    );
}

/// A field of /proc/meminfo, in KiB.
fn meminfo_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// The memory charged to cgroup `parent` and everything under it (cgroup v1's
/// `memory.usage_in_bytes`, hierarchical, or v2's `memory.current`), in bytes; 0 if neither.
fn cgroup_memory_bytes(parent: &str) -> u64 {
    [
        format!("/sys/fs/cgroup/memory/{parent}/memory.usage_in_bytes"),
        format!("/sys/fs/cgroup/{parent}/memory.current"),
    ]
    .iter()
    .find_map(|path| std::fs::read_to_string(path).ok()?.trim().parse().ok())
    .unwrap_or(0)
}

/// The resident set of process `pid`, in KiB.
fn rss_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// A sandbox's container init: its pid and the `/proc` stat line the driver recorded
/// (`DATA/drivers/oci/sandboxes/ID/run-*/init`), and its start time as `/proc` says now
/// (None once it is gone).
#[derive(Debug, PartialEq, Eq)]
struct Init {
    pid: i32,
    recorded: String,
    start: Option<u64>,
}

fn init_of(data: &Path, id: &str) -> Init {
    let dir = data.join("drivers/oci/sandboxes").join(id);
    let run = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("run-"))
        .unwrap_or_else(|| panic!("sandbox {id} has no run directory"));
    let line = std::fs::read_to_string(run.path().join("init"))
        .unwrap_or_else(|e| panic!("sandbox {id}'s init record: {e}"));
    let pid: i32 = line
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("sandbox {id}'s init record {line:?}"));
    Init {
        pid,
        recorded: line,
        start: proc_start_time(pid),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark; run as root with --release -- --ignored"]
async fn reattach_running_sandboxes_after_sigkill() {
    let n = env_usize("SBX_BENCH_OCI_SANDBOXES", 200);
    let data = DataDir::new();
    let mut d = start_sbxd(&data);
    let sb = d.sandboxes().await;
    let available_before = meminfo_kib("MemAvailable");
    let rss_before = rss_kib(d.pid());
    let began = Instant::now();
    futures::stream::iter((0..n).map(|i| format!("r{i}")))
        .for_each_concurrent(8, |name| {
            let sb = &sb;
            async move {
                create(sb, &name).await;
            }
        })
        .await;
    let before = wait_all_ready(&sb, n, Duration::from_secs(600)).await;
    let created_in = began.elapsed();
    let used_mib = available_before.saturating_sub(meminfo_kib("MemAvailable")) as f64 / 1024.0;
    let charged_mib = cgroup_memory_bytes(CGROUP_PARENT) as f64 / f64::from(1 << 20);
    let rss_full = rss_kib(d.pid());
    let inits: Vec<(String, u64, Init)> = before
        .iter()
        .map(|s| (s.id.clone(), s.generation, init_of(data.path(), &s.id)))
        .collect();
    for (id, _, init) in &inits {
        assert!(
            init.start.is_some(),
            "sandbox {id}'s init does not run: {init:?}"
        );
    }

    d.sigkill();
    drop(d);
    let restart = Instant::now();
    let d = start_sbxd(&data);
    let serving = restart.elapsed();
    let sb = d.sandboxes().await;
    let after = wait_all_ready(&sb, n, Duration::from_secs(120)).await;
    let all_ready = restart.elapsed();
    let rss_after = rss_kib(d.pid());
    for (id, generation, init) in &inits {
        let now = after
            .iter()
            .find(|s| &s.id == id)
            .unwrap_or_else(|| panic!("sandbox {id} not listed after the restart"));
        assert_eq!(now.generation, *generation, "sandbox {id}'s generation");
        assert_eq!(
            &init_of(data.path(), id),
            init,
            "sandbox {id}'s workload was restarted"
        );
    }
    println!(
        "\nre-attach of {n} running oci sandboxes after SIGKILL of sbxd\n\n\
         | measure | figure |\n|---|---|\n\
         | new sbxd spawned → serving (address file written) | {:.0} ms |\n\
         | new sbxd spawned → all {n} listed Ready | {:.0} ms |\n\
         | same generation, same init (pid + start time) | {n} of {n} |\n\
         | (for scale) creating the {n}, 8 at a time, until all Ready | {:.1} s |\n\
         | memory charged to the {n} sandboxes' cgroups | {charged_mib:.0} MiB ({:.2} MiB each) |\n\
         | host memory taken meanwhile (MemAvailable before − after; other work on the machine counts too) | {used_mib:.0} MiB ({:.2} MiB each) |\n\
         | sbxd resident: before the creates / with {n} / after the re-attach | {:.1} / {:.1} / {:.1} MiB |\n",
        ms(serving),
        ms(all_ready),
        created_in.as_secs_f64(),
        charged_mib / n as f64,
        used_mib / n as f64,
        rss_before as f64 / 1024.0,
        rss_full as f64 / 1024.0,
        rss_after as f64 / 1024.0,
    );
    let took = delete_all(&sb, after.into_iter().map(|s| s.id).collect()).await;
    println!("deleted them (8 at a time) in {:.1} s", took.as_secs_f64());
    let mut d = d;
    d.sigterm(Duration::from_secs(30));
    assert_nothing_left(data.path(), CGROUP_PARENT);
}
