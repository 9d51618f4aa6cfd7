//! Images through the real sbxd (`--driver sim --sim-images`) and the real `sbx` binary:
//! the built-in default image made at start from the host's static busybox; import of an OCI
//! layout directory and of a rootfs tar; list, get (by name, by digest), rm; rm refused while a
//! sandbox pins the image, naming it as workspace/name; a bad reference is INVALID_ARGUMENT;
//! an unknown image at create is NOT_FOUND.

mod common;

use std::path::{Path, PathBuf};

use common::{DataDir, Sbxd, assert_status, sbx};
use sbx_proto::v1::image_service_client::ImageServiceClient;
use sbx_proto::v1::{CreateSandboxRequest, GetImageRequest, ImageRef, SandboxSpec};
use serde_json::Value;
use sha2::{Digest as _, Sha256};

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// A tar of one file `etc/NAME` holding `content`.
fn one_file_tar(name: &str, content: &str) -> Vec<u8> {
    let mut builder = tar::Builder::new(Vec::new());
    let mut header = tar::Header::new_gnu();
    header.set_size(content.len() as u64);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_entry_type(tar::EntryType::Regular);
    builder
        .append_data(&mut header, format!("etc/{name}"), content.as_bytes())
        .unwrap();
    builder.into_inner().unwrap()
}

/// Writes an OCI image layout with one single-layer image (config Cmd `["/bin/true"]`) to
/// `dir`; answers the manifest digest.
fn write_oci_layout(dir: &Path) -> String {
    let blobs = dir.join("blobs/sha256");
    std::fs::create_dir_all(&blobs).unwrap();
    let put = |bytes: &[u8]| {
        let digest = sha256(bytes);
        std::fs::write(blobs.join(&digest[7..]), bytes).unwrap();
        digest
    };
    let layer = one_file_tar("layout", "from an OCI layout");
    let layer_digest = put(&layer);
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["/bin/true"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [sha256(&layer)]},
    });
    let config = serde_json::to_vec(&config).unwrap();
    let config_digest = put(&config);
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config_digest, "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer.len()}],
    });
    let manifest = serde_json::to_vec(&manifest).unwrap();
    let manifest_digest = put(&manifest);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": manifest_digest, "size": manifest.len()}],
    });
    std::fs::write(dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    manifest_digest
}

fn names(list: &Value) -> Vec<String> {
    let mut names: Vec<String> = list
        .as_array()
        .unwrap_or_else(|| panic!("not a list: {list}"))
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_through_sbxd_and_the_cli() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "sim", &["--sim-images"]);
    let ep = d.endpoint();
    let ep = ep.as_str();

    // The built-in default image was made at start from the host's static busybox.
    let list = sbx(ep, &["image", "list", "-o", "json"]).json();
    assert_eq!(names(&list), vec!["sbx.local/busybox:latest"], "{list}");
    let busybox_digest = list[0]["digest"].as_str().unwrap().to_string();

    // An OCI layout directory (tarred by the CLI) and a rootfs tar (streamed as is).
    let layout = data.path().join("layout");
    let layout_digest = write_oci_layout(&layout);
    let imported = sbx(
        ep,
        &[
            "image",
            "import",
            layout.to_str().unwrap(),
            "--name",
            "layout:v1",
            "-o",
            "json",
        ],
    )
    .json();
    assert_eq!(
        imported[0]["name"], "docker.io/library/layout:v1",
        "{imported}"
    );
    assert_eq!(imported[0]["digest"], layout_digest.as_str());
    assert_eq!(imported[0]["cmd"][0], "/bin/true");
    let rootfs: PathBuf = data.path().join("rootfs.tar");
    std::fs::write(&rootfs, one_file_tar("rootfs", "from a rootfs tar")).unwrap();
    let imported = sbx(
        ep,
        &[
            "image",
            "import",
            rootfs.to_str().unwrap(),
            "--name",
            "localhost/rootfs:1",
            "-o",
            "json",
        ],
    )
    .json();
    let rootfs_digest = imported[0]["digest"].as_str().unwrap().to_string();
    assert!(rootfs_digest.starts_with("sha256:"), "{imported}");

    let list = sbx(ep, &["image", "ls", "-o", "json"]).json();
    assert_eq!(
        names(&list),
        vec![
            "docker.io/library/layout:v1",
            "localhost/rootfs:1",
            "sbx.local/busybox:latest"
        ]
    );
    let table = sbx(ep, &["image", "list"]);
    assert!(
        table.ok().contains("NAME") && table.stdout.contains("localhost/rootfs:1"),
        "{table:?}"
    );
    let yaml = sbx(ep, &["image", "get", "layout:v1", "-o", "yaml"]);
    assert!(
        yaml.ok().contains(&format!("digest: {layout_digest}")),
        "{yaml:?}"
    );
    let by_digest = sbx(ep, &["image", "get", &rootfs_digest, "-o", "json"]).json();
    assert_eq!(by_digest["name"], "localhost/rootfs:1");

    // Sandboxes: one pins the rootfs image; one without an image or a command runs the
    // default (busybox's Cmd is sh).
    let pinned = sbx(
        ep,
        &[
            "sandbox",
            "create",
            "-n",
            "web",
            "--image",
            "localhost/rootfs:1",
            "-o",
            "json",
            "--",
            "sleep",
            "60",
        ],
    )
    .json();
    assert_eq!(pinned["image_digest"], rootfs_digest.as_str(), "{pinned}");
    let shown = sbx(ep, &["sandbox", "get", "web"]);
    assert!(
        shown
            .ok()
            .contains(&format!("IMAGE: localhost/rootfs:1 ({rootfs_digest})")),
        "{shown:?}"
    );
    let defaulted = sbx(ep, &["sandbox", "create", "-n", "plain", "-o", "json"]).json();
    assert_eq!(
        defaulted["image"], "sbx.local/busybox:latest",
        "{defaulted}"
    );
    assert_eq!(defaulted["image_digest"], busybox_digest.as_str());

    // rm is refused while a sandbox pins the image, naming it; the image stays.
    let refused = sbx(ep, &["image", "rm", "localhost/rootfs:1"]);
    assert_eq!(refused.code, 1, "{refused:?}");
    assert!(
        refused.stderr.contains("IMAGE_IN_USE") && refused.stderr.contains("default/web"),
        "{refused:?}"
    );
    sbx(ep, &["image", "get", "localhost/rootfs:1"]).ok();

    // An unused image goes; asking for it again is NOT_FOUND.
    let removed = sbx(ep, &["image", "rm", "layout:v1"]);
    assert!(removed.ok().contains("deleted"), "{removed:?}");
    let gone = sbx(ep, &["image", "get", "layout:v1"]);
    assert!(
        gone.code == 1 && gone.stderr.contains("IMAGE_NOT_FOUND"),
        "{gone:?}"
    );
    // Once the sandbox is gone, so can its image be.
    sbx(ep, &["sandbox", "rm", "web"]).ok();
    let rootfs_id =
        sbx(ep, &["image", "get", "localhost/rootfs:1", "-o", "json"]).json()["id"].clone();
    let removed = sbx(ep, &["image", "rm", "localhost/rootfs:1", "-o", "json"]).json();
    assert_eq!(removed["deleted"], true, "{removed}");
    assert_eq!(removed["id"], rootfs_id, "{removed}");

    // Through the API: a bad reference is INVALID_ARGUMENT; an unknown image at create is
    // NOT_FOUND naming it (the CLI refuses a bad reference itself, with usage status 2).
    let mut images = ImageServiceClient::new(d.channel().await);
    let err = images
        .get_image(GetImageRequest {
            image: Some(ImageRef {
                reference: "Bad Ref".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap_err();
    assert_status(
        &err,
        tonic::Code::InvalidArgument,
        "IMAGE_REFERENCE_INVALID",
    );
    assert!(err.message().contains("Bad Ref"), "{err:?}");
    assert_eq!(sbx(ep, &["image", "get", "Bad Ref"]).code, 2);
    let err = d
        .sandboxes()
        .await
        .create_sandbox(CreateSandboxRequest {
            providers: Default::default(),
            workspace: String::new(),
            name: "ghost".into(),
            spec: Some(SandboxSpec {
                image: "nope:1".into(),
                command: vec!["sleep".into()],
                ..Default::default()
            }),
            stopped: false,
        })
        .await
        .unwrap_err();
    assert_status(&err, tonic::Code::NotFound, "IMAGE_NOT_FOUND");
    assert!(
        err.message().contains("docker.io/library/nope:1"),
        "{err:?}"
    );
    let cli = sbx(
        ep,
        // --pull never: the default would ask docker.io for it (this test reaches no
        // registry but its own); `an_image_missing_from_the_store_is_pulled_by_create_run_and_build`
        // tests the pull.
        &[
            "sandbox", "create", "--image", "nope:1", "--pull", "never", "--", "sleep",
        ],
    );
    assert!(
        cli.code == 1 && cli.stderr.contains("IMAGE_NOT_FOUND"),
        "{cli:?}"
    );
}

/// The lowest free space seen on `fs` every 10 ms until [`LowWater::lowest`].
struct LowWater {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl LowWater {
    fn watch(fs: &common::Tmpfs) -> LowWater {
        let path = fs.path.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let free = || {
                let st = nix::sys::statvfs::statvfs(&path).expect("statvfs");
                st.blocks_available() * st.fragment_size()
            };
            let mut low = free();
            // Bounded: 120 s of samples at most.
            for _ in 0..12_000 {
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                low = low.min(free());
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            low
        });
        LowWater {
            stop,
            thread: Some(thread),
        }
    }

    fn lowest(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for LowWater {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// `len` bytes that do not compress (xorshift), different for each `seed`.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// A gzip layer of a few hundred KiB that unpacks to 400 MiB, pulled into a store of 256 MiB
/// (a tmpfs of the test's own on DATA/images): refused as it unpacks, before the store's
/// filesystem passes `--image-min-free` (its default: 10% of it here), the error naming the
/// free space and the flag; nothing recorded; the store takes the next (smaller) image, and
/// lists its unpacked size beside its compressed one.
#[test]
fn a_pull_that_would_fill_the_disk_is_refused_naming_the_free_space() {
    use sbx_drivers::image::fixtures::{self, LocalRegistry};
    if !LocalRegistry::available("a_pull_that_would_fill_the_disk_is_refused_naming_the_free_space")
    {
        return;
    }
    let data = DataDir::new();
    let fs = common::Tmpfs::mount(&data.path().join("images"), "256m");
    let d = Sbxd::start(data.path(), "sim", &["--sim-images"]);
    let ep = d.endpoint();
    let work = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(&work.path().join("registry"));
    let bomb = format!("{}/sbx-test/zeros:big", registry.addr);
    fixtures::write_oci_layout_of_zeros(&work.path().join("big"), "zeros", 400 << 20, "v1");
    registry.push(&work.path().join("big"), &bomb, &[]);
    let fits = format!("{}/sbx-test/zeros:fits", registry.addr);
    fixtures::write_oci_layout_of_zeros(&work.path().join("fits"), "zeros", 40 << 20, "v1");
    registry.push(&work.path().join("fits"), &fits, &[]);

    let min_free = 256u64 * (1 << 20) / 10;
    let low = LowWater::watch(&fs);
    let started = std::time::Instant::now();
    let refused = sbx(&ep, &["image", "pull", &bomb]);
    let took = started.elapsed();
    let lowest = low.lowest();
    eprintln!(
        "refused in {took:?}, the store's filesystem at {} MiB free at its lowest: {}",
        lowest >> 20,
        refused.stderr.trim()
    );
    assert_ne!(refused.code, 0, "{refused:?}");
    assert!(
        refused.stderr.contains("--image-min-free")
            && refused.stderr.contains("MiB free")
            && refused.stderr.contains("/zeros"),
        "the refusal names the free space, the entry and the flag: {refused:?}"
    );
    assert!(
        lowest + (1 << 20) >= min_free,
        "the filesystem went down to {} MiB free (--image-min-free: {} MiB)",
        lowest >> 20,
        min_free >> 20
    );
    let listed = sbx(&ep, &["image", "list", "-o", "json"]).ok().to_string();
    assert!(!listed.contains("zeros:big"), "{listed}");

    // The store still writes; the image's unpacked size is listed beside its blob's.
    let pulled = sbx(&ep, &["image", "pull", &fits, "-o", "json"]).json();
    let unpacked = pulled["unpacked_size"].as_u64().unwrap_or(0);
    let size = pulled["size"].as_u64().unwrap_or(u64::MAX);
    assert!(
        unpacked >= 40 << 20 && size < 1 << 20,
        "size {size}, unpacked {unpacked}: {pulled}"
    );
    let table = sbx(&ep, &["image", "list"]);
    assert!(
        table.ok().contains("UNPACKED") && table.stdout.contains("40.0MiB"),
        "{table:?}"
    );
    drop(d);
    drop(fs);
}

/// An image of 64 MiB on disk is deleted while a pull crawls through a throttled registry; the
/// pull's caller then goes away: the deleted image's disk is free again (within 1 MiB of
/// where the store was before it), and so is whatever the cancelled pull had fetched.
#[test]
fn a_deleted_images_disk_is_freed_though_a_cancelled_pull_ran_meanwhile() {
    use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
    if !LocalRegistry::available(
        "a_deleted_images_disk_is_freed_though_a_cancelled_pull_ran_meanwhile",
    ) {
        return;
    }
    let data = DataDir::new();
    let fs = common::Tmpfs::mount(&data.path().join("images"), "512m");
    let d = Sbxd::start(data.path(), "sim", &["--sim-images"]);
    let ep = d.endpoint();
    let work = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(&work.path().join("registry"));
    let slow_layer = fixtures::tar_bytes(&[TarEntry::file("noise", &noise(8 << 20, 7))]);
    fixtures::write_oci_layout(&work.path().join("slow"), &[slow_layer], "v1");
    registry.push(
        &work.path().join("slow"),
        &format!("{}/sbx-test/slow:v1", registry.addr),
        &[],
    );
    let proxy = common::throttled_proxy(&registry.addr, 256 << 10);

    let baseline = fs.free();
    let big = work.path().join("big.tar");
    std::fs::write(
        &big,
        fixtures::tar_bytes(&[TarEntry::file("noise", &noise(32 << 20, 11))]),
    )
    .unwrap();
    sbx(
        &ep,
        &["image", "import", big.to_str().unwrap(), "--name", "big:v1"],
    )
    .ok();
    let with_big = fs.free();
    assert!(
        baseline - with_big >= 60 << 20,
        "the image takes {} MiB",
        (baseline - with_big) >> 20
    );

    // The slow pull is under way (its blob is being written in the store's tmp/).
    let mut pull = std::process::Command::new(common::SBX)
        .args(["image", "pull", &format!("{proxy}/sbx-test/slow:v1")])
        .env("SBX_ENDPOINT", &ep)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let tmp = data.path().join("images/tmp");
    let fetching = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while std::fs::read_dir(&tmp).map_or(0, |d| d.count()) == 0 {
        assert!(std::time::Instant::now() < fetching, "the pull never began");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let removed = sbx(&ep, &["image", "rm", "big:v1"]);
    assert!(removed.ok().contains("deleted"), "{removed:?}");
    // The pull's caller goes (a Ctrl-C, a dropped connection).
    pull.kill().unwrap();
    pull.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    loop {
        let free = fs.free();
        if free + (1 << 20) >= baseline {
            eprintln!(
                "freed to {} KiB of the baseline",
                (baseline.saturating_sub(free)) >> 10
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "15 s after the delete and the cancel, {} MiB of the store's disk is still taken",
            (baseline - free) >> 20
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let listed = sbx(&ep, &["image", "list", "-o", "json"]).ok().to_string();
    assert!(
        !listed.contains("big:v1") && !listed.contains("slow:v1"),
        "{listed}"
    );
    drop(d);
    drop(fs);
}
