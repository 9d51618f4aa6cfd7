//! Images on nodes, black box: a gateway (`sbxd serve --driver sim --sim-images`, its own
//! driver cordoned) with `--image-mirror` on Debian's `docker-registry` (127.0.0.1, a free
//! port), and an `sbxd node --driver oci` whose image store (STATE_DIR/images) starts empty.
//! An image imported through the gateway, one pulled through it, and the gateway's built-in
//! default image each run on the node, which fetched each by digest from the mirror, once: a
//! second sandbox of an image fetches nothing.
//!
//! Needs root, runc and busybox-static (the oci driver) and the Debian packages
//! `docker-registry` and `skopeo`; without the packages the test prints why and passes (and
//! fails under CI, which installs them). Every process is killed by pid when its guard drops;
//! the node's containers, mounts and cgroups are removed by its data dir's guard if the test
//! fails before it deletes its sandboxes.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::ha::SharedStore;
use common::node::Node;
use common::{CgroupParent, DataDir, Sbxd, eventually, sbx, unique};
use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
use sbx_drivers::image::{IdMap, ImageStore, Mirror, PullOptions};

/// What the node logs for each image it fetches.
const FETCHED: &str = "image fetched from the mirror";

/// An image layer of a static busybox: `/bin/busybox` and a few of its applets, with a marker
/// file of its own.
fn busybox_layer(marker: &str) -> Vec<u8> {
    let path = sbx_drivers::find_static_busybox(None, &sbx_drivers::BUSYBOX_PATHS)
        .expect("a static busybox (Debian's busybox-static)");
    let busybox = std::fs::read(path).unwrap();
    let mut entries = vec![
        TarEntry::dir("bin/"),
        TarEntry::file("bin/busybox", &busybox).mode(0o755),
        TarEntry::dir("etc/"),
        TarEntry::file("etc/marker", marker.as_bytes()),
    ];
    for applet in ["sh", "sleep", "echo", "cat"] {
        entries.push(TarEntry::symlink(&format!("bin/{applet}"), "busybox"));
    }
    fixtures::tar_bytes(&entries)
}

/// How many images the node has fetched, by its log.
fn fetches(node: &Node) -> usize {
    node.log_text().matches(FETCHED).count()
}

/// Creates sandbox `name` on the oci driver (a node: the gateway's own is cordoned) running
/// `sleep`, of `image` (none: the default), and waits until it is Ready.
fn create(endpoint: &str, name: &str, image: Option<&str>, gateway: &Sbxd, node: &Node) {
    let mut args = vec!["sandbox", "create", "-n", name, "--driver", "oci"];
    if let Some(image) = image {
        args.extend(["--image", image]);
    }
    args.extend(["-o", "json", "--", "sleep", "3600"]);
    let created = sbx(endpoint, &args);
    assert_eq!(
        created.code,
        0,
        "{created:?}\ngateway:\n{}\nnode:\n{}",
        gateway.log_text(),
        node.log_text()
    );
    let json = created.json();
    assert_eq!(json["phase"], "Ready", "{json}");
    assert_eq!(json["node"], "n1", "{json}");
}

/// Whether the node's image store (`store`) holds the image `digest`: its manifest blob, and
/// the image whole.
fn node_holds(store: &Path, digest: &str) -> bool {
    store
        .join("blobs/sha256")
        .join(&digest["sha256:".len()..])
        .is_file()
        && ImageStore::open_read_only(store.to_path_buf())
            .and_then(|s| s.get(digest))
            .is_ok()
}

/// An oci node over `data` (its state in DATA/drivers/oci, where the data dir's guard looks),
/// on loopback without TLS, its sandboxes' cgroups under `cgroup`. Answers the node and its
/// image store (STATE_DIR/images, empty).
fn oci_node(data: &Path, cgroup: &str) -> (Node, PathBuf) {
    let state = data.join("drivers/oci");
    std::fs::create_dir_all(&state).unwrap();
    let node = Node::start(
        data,
        &[
            "--driver",
            "oci",
            "--state-dir",
            state.to_str().unwrap(),
            "--listen",
            "127.0.0.1:0",
            "--auth",
            "none",
            "--oci-cgroup-parent",
            cgroup,
            // Four sandboxes of the gateway's default cpu (1 core) each, on any machine.
            "--capacity-cpu",
            "8",
        ],
    );
    (node, state.join("images"))
}

/// Cordons the gateway's own driver and registers `node` as n1.
fn add_node(endpoint: &str, node: &Node) {
    sbx(endpoint, &["node", "cordon", "local"]).ok();
    let added = sbx(
        endpoint,
        &["node", "add", "n1", "--address", &node.addr, "-o", "json"],
    )
    .json();
    assert_eq!(added["state"], "Ready", "{added}");
    assert_eq!(added["drivers"][0], "oci", "{added}");
}

/// Imports an OCI layout of [`busybox_layer`] with `marker` as `name`; answers its digest.
fn import(endpoint: &str, dir: &Path, name: &str, marker: &str) -> String {
    let layout = dir.join(format!("layout-{}", unique()));
    fixtures::write_oci_layout(&layout, &[busybox_layer(marker)], "v1");
    let imported = sbx(
        endpoint,
        &[
            "image",
            "import",
            layout.to_str().unwrap(),
            "--name",
            name,
            "-o",
            "json",
        ],
    )
    .json();
    imported[0]["digest"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_pulled_or_imported_through_a_gateway_run_on_a_node_that_fetches_them_once() {
    if !LocalRegistry::available(
        "images_pulled_or_imported_through_a_gateway_run_on_a_node_that_fetches_them_once",
    ) {
        return;
    }
    // Dropped last: the cgroup parent, once the data dirs' guards removed the containers.
    let cgroup = CgroupParent(format!("sbx-gateway-tests-mirror-{}", unique()));
    let gateway_data = DataDir::new();
    let node_data = DataDir::new();
    let registry_dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(registry_dir.path());
    let mirror = format!("{}/sbx-test", registry.addr);

    let (node, node_store) = oci_node(node_data.path(), &cgroup.0);
    let d = Sbxd::start(
        gateway_data.path(),
        "sim",
        &["--sim-images", "--image-mirror", &mirror],
    );
    let ep = d.endpoint();
    add_node(&ep, &node);

    // An image imported through the gateway (an OCI layout): in the mirror once imported.
    let digest = import(
        &ep,
        gateway_data.path(),
        "localhost/imported:v1",
        "imported\n",
    );
    let scratch = ImageStore::open(registry_dir.path().join("scratch"), IdMap::default()).unwrap();
    let reference = Mirror::parse(&mirror).unwrap().reference(&digest);
    let in_mirror = scratch
        .pull(&reference, &PullOptions::default(), &|_| {})
        .await
        .unwrap_or_else(|e| panic!("{reference} is not in the mirror: {e}"));
    assert_eq!(in_mirror.digest, digest);
    assert!(!node_holds(&node_store, &digest));

    // It runs on the node, which fetched it.
    create(&ep, "first", Some("localhost/imported:v1"), &d, &node);
    let echoed = sbx(
        &ep,
        &["sandbox", "exec", "first", "--", "cat", "/etc/marker"],
    );
    assert_eq!(echoed.ok(), "imported\n", "{echoed:?}");
    assert!(node_holds(&node_store, &digest));
    assert_eq!(fetches(&node), 1, "{}", node.log_text());
    // A second sandbox of it fetches nothing.
    create(&ep, "second", Some("localhost/imported:v1"), &d, &node);
    let echoed = sbx(&ep, &["sandbox", "exec", "second", "--", "echo", "again"]);
    assert_eq!(echoed.ok(), "again\n", "{echoed:?}");
    assert_eq!(fetches(&node), 1, "{}", node.log_text());

    // An image pulled through the gateway (from another repository of the same registry).
    let source = registry_dir.path().join("source");
    fixtures::write_oci_layout(&source, &[busybox_layer("pulled\n")], "v1");
    let pulled_ref = format!("{}/src/pulled:v1", registry.addr);
    registry.push(&source, &pulled_ref, &[]);
    let pulled = sbx(&ep, &["image", "pull", &pulled_ref, "-o", "json"]).json();
    let pulled_digest = pulled["digest"].as_str().unwrap().to_string();
    create(&ep, "third", Some(&pulled_ref), &d, &node);
    let echoed = sbx(
        &ep,
        &["sandbox", "exec", "third", "--", "cat", "/etc/marker"],
    );
    assert_eq!(echoed.ok(), "pulled\n", "{echoed:?}");
    assert!(node_holds(&node_store, &pulled_digest));
    assert_eq!(fetches(&node), 2, "{}", node.log_text());

    // The default image, made by the gateway at its start (never pulled): the node made the
    // same at its own start, from its own busybox, and fetches nothing.
    create(&ep, "fourth", None, &d, &node);
    let default = sbx(&ep, &["sandbox", "get", "fourth", "-o", "json"]).json();
    let default_digest = default["image_digest"].as_str().unwrap().to_string();
    assert!(node_holds(&node_store, &default_digest), "{default}");
    let echoed = sbx(&ep, &["sandbox", "exec", "fourth", "--", "echo", "default"]);
    assert_eq!(echoed.ok(), "default\n", "{echoed:?}");
    assert_eq!(fetches(&node), 2, "{}", node.log_text());

    for name in ["first", "second", "third", "fourth"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    common::assert_oci_left_nothing(node_data.path(), &cgroup.0);
}

/// The built-in image on an oci node and a gateway without `--image-mirror`: the node made it
/// at its start from its own busybox (the same digest as the gateway's), so a create of the
/// default image is Ready there, and nothing is fetched (issue 46, item 8; before, the create
/// failed: "not in this node's image store … start the gateways with --image-mirror").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_built_in_image_runs_on_a_node_with_no_mirror() {
    let cgroup = CgroupParent(format!("sbx-gateway-tests-builtin-{}", unique()));
    let gateway_data = DataDir::new();
    let node_data = DataDir::new();
    let (node, node_store) = oci_node(node_data.path(), &cgroup.0);
    assert!(
        node.log_text().contains("built the default image"),
        "{}",
        node.log_text()
    );
    let d = Sbxd::start(gateway_data.path(), "sim", &["--sim-images"]);
    let ep = d.endpoint();
    add_node(&ep, &node);
    create(&ep, "builtin", None, &d, &node);
    let made = sbx(&ep, &["sandbox", "get", "builtin", "-o", "json"]).json();
    let digest = made["image_digest"].as_str().unwrap().to_string();
    assert!(node_holds(&node_store, &digest), "{made}");
    let echoed = sbx(
        &ep,
        &["sandbox", "exec", "builtin", "--", "echo", "built here"],
    );
    assert_eq!(echoed.ok(), "built here\n", "{echoed:?}");
    assert_eq!(fetches(&node), 0, "{}", node.log_text());
    sbx(&ep, &["sandbox", "delete", "builtin"]).ok();
    common::assert_oci_left_nothing(node_data.path(), &cgroup.0);
}

/// Two gateways sharing a store: an image imported through A, which then stops, runs through B,
/// whose own image store never had it: B fetches it from the mirror to pin it (and the
/// default image, which A made), and the node from the mirror to run it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_imported_through_one_gateway_runs_through_another() {
    if !LocalRegistry::available("an_image_imported_through_one_gateway_runs_through_another") {
        return;
    }
    let cgroup = CgroupParent(format!("sbx-gateway-tests-mirror-{}", unique()));
    let store = SharedStore::start();
    let url = store.database("mirror").await;
    let (a_data, b_data, node_data) = (DataDir::new(), DataDir::new(), DataDir::new());
    let registry_dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(registry_dir.path());
    let mirror = format!("{}/sbx-test", registry.addr);
    let (node, node_store) = oci_node(node_data.path(), &cgroup.0);
    let flags = [
        "--sim-images",
        "--image-mirror",
        &mirror,
        "--lease-seconds",
        "2",
    ];

    // A: the node registered, an image imported; then A stops.
    let mut a = store.gateway(a_data.path(), &url, &flags);
    add_node(&a.endpoint(), &node);
    let digest = import(
        &a.endpoint(),
        a_data.path(),
        "localhost/via-a:v1",
        "via A\n",
    );
    a.sigterm(Duration::from_secs(30));

    // B, on a data dir of its own: its image store has neither image.
    let b = store.gateway(b_data.path(), &url, &flags);
    let b_blob = |digest: &str| {
        b_data
            .path()
            .join("images/blobs/sha256")
            .join(&digest["sha256:".len()..])
    };
    assert!(!b_blob(&digest).exists());
    eventually(
        Duration::from_secs(30),
        "B serves the workspace",
        || async { b.log_text().contains("serving the workspace").then_some(()) },
    )
    .await;
    let ep = b.endpoint();
    create(&ep, "via-b", Some("localhost/via-a:v1"), &b, &node);
    let marker = sbx(
        &ep,
        &["sandbox", "exec", "via-b", "--", "cat", "/etc/marker"],
    );
    assert_eq!(marker.ok(), "via A\n", "{marker:?}");
    assert!(b_blob(&digest).is_file(), "B fetched it to pin it");
    assert!(node_holds(&node_store, &digest));
    // The default image, made by A at its start.
    create(&ep, "default", None, &b, &node);
    let default = sbx(&ep, &["sandbox", "get", "default", "-o", "json"]).json();
    let default_digest = default["image_digest"].as_str().unwrap();
    assert!(b_blob(default_digest).is_file(), "{default}");
    assert!(node_holds(&node_store, default_digest), "{default}");

    for name in ["via-b", "default"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    common::assert_oci_left_nothing(node_data.path(), &cgroup.0);
}

/// One raw HTTP/1.1 request to `addr` (the E2B listener); answers (status, body).
fn raw(addr: &str, request: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(120)))
        .unwrap();
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = String::new();
    let _ = stream.read_to_string(&mut answer);
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The mirror on every create, whatever the door: an E2B create (the SDK's `POST /sandboxes`)
/// through B, whose own image store never had the image (A imported it, then stopped), runs
/// on the oci node: B's front door fetched it from the mirror to pin it, as for a gRPC
/// create.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_e2b_create_of_an_image_only_the_mirror_has_runs_on_a_node() {
    if !LocalRegistry::available("an_e2b_create_of_an_image_only_the_mirror_has_runs_on_a_node") {
        return;
    }
    let cgroup = CgroupParent(format!("sbx-gateway-tests-mirror-{}", unique()));
    let store = SharedStore::start();
    let url = store.database("mirrore2b").await;
    let (a_data, b_data, node_data) = (DataDir::new(), DataDir::new(), DataDir::new());
    let registry_dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(registry_dir.path());
    let mirror = format!("{}/sbx-test", registry.addr);
    let (node, node_store) = oci_node(node_data.path(), &cgroup.0);
    let flags = [
        "--sim-images",
        "--image-mirror",
        &mirror,
        "--lease-seconds",
        "2",
    ];
    let mut a = store.gateway(a_data.path(), &url, &flags);
    add_node(&a.endpoint(), &node);
    let digest = import(
        &a.endpoint(),
        a_data.path(),
        "localhost/only-mirror:v1",
        "only in the mirror\n",
    );
    a.sigterm(Duration::from_secs(30));

    let e2b_file = b_data.path().join("e2b-addr");
    let e2b_arg = e2b_file.display().to_string();
    // B's own driver is oci (an E2B create names no driver: the gateway's is the one), cordoned
    // as A's was: the sandbox runs on the node.
    let b = Sbxd::start(
        b_data.path(),
        "oci",
        &[
            "--store",
            &url,
            "--store-password-file",
            &store.password_file,
            "--image-mirror",
            &mirror,
            "--lease-seconds",
            "2",
            "--oci-cgroup-parent",
            &cgroup.0,
            "--e2b-listen",
            "127.0.0.1:0",
            "--e2b-addr-file",
            &e2b_arg,
        ],
    );
    let e2b = std::fs::read_to_string(&e2b_file)
        .unwrap()
        .trim()
        .to_string();
    eventually(
        Duration::from_secs(30),
        "B serves the workspace",
        || async { b.log_text().contains("serving the workspace").then_some(()) },
    )
    .await;
    assert!(!node_holds(&node_store, &digest));
    let body = r#"{"templateID": "localhost/only-mirror:v1", "timeout": 60}"#;
    let (status, made) = raw(
        &e2b,
        &format!(
            "POST /sandboxes HTTP/1.1\r\nHost: x\r\nX-API-KEY: any\r\nContent-Type: \
             application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        ),
    );
    assert_eq!(status, 201, "{made}\nB:\n{}", b.log_text());
    assert!(node_holds(&node_store, &digest), "the node ran it");
    let made: serde_json::Value = serde_json::from_str(&made).unwrap();
    let id = made["sandboxID"].as_str().unwrap();
    let (status, _) = raw(
        &e2b,
        &format!(
            "DELETE /sandboxes/{id} HTTP/1.1\r\nHost: x\r\nX-API-KEY: any\r\nConnection: \
             close\r\n\r\n"
        ),
    );
    assert_eq!(status, 204);
    common::assert_oci_left_nothing(node_data.path(), &cgroup.0);
}
