//! Images on nodes, through the real transport: a gateway's [`RemoteDriver`] with an
//! [`ImageSource`] over a mirror (Debian's `docker-registry` on 127.0.0.1) and its own image
//! store, against an in-process [`serve_node`] whose [`NodeImages`] store starts empty (the
//! sim driver behind it: what is tested is what reaches the driver). A create of an image the
//! gateway holds pushes it to the mirror first; the node fetches it by digest before the
//! driver sees the create, once however many creates of it come at once, and never again.
//! A create without the header of an image the node lacks is refused, naming it.
//! Needs root (layers are unpacked with shifted owners) and the Debian packages
//! `docker-registry` and `skopeo`; without the packages the test prints why and passes (and
//! fails under CI, which installs them).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
use sbx_drivers::image::{IdMap, ImageStore, Mirror};
use sbx_drivers::remote::images::{ImageSource, NodeImages};
use sbx_drivers::remote::{NodeIdentity, RemoteDriver, serve_node};
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, pb};
use uuid::Uuid;

const CALL_TIMEOUT: Duration = Duration::from_secs(20);

fn identity() -> NodeIdentity {
    NodeIdentity {
        node_id: Uuid::new_v4().to_string(),
        name: "node-images".to_string(),
        version: "0.0.0-test".to_string(),
        drivers: vec!["sim".to_string()],
        labels: HashMap::new(),
        capacity: pb::Capacity {
            cpu_millicores: 4000,
            memory_bytes: 8 << 30,
            disk_bytes: 100 << 30,
            max_sandboxes: 100,
        },
    }
}

fn create(image: &str) -> pb::CreateRequest {
    pb::CreateRequest {
        sandbox_id: Uuid::new_v4().to_string(),
        workspace: "ws".into(),
        name: format!("s-{}", &Uuid::new_v4().simple().to_string()[..8]),
        spec: Some(pb::SandboxSpec {
            command: vec!["sleep".into(), "3600".into()],
            image: image.to_string(),
            ..Default::default()
        }),
        generation: 1,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_fetches_what_it_lacks_from_the_mirror_once() {
    if !LocalRegistry::available("a_node_fetches_what_it_lacks_from_the_mirror_once") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(dir.path());
    let mirror = Mirror::parse(&format!("{}/t", registry.addr)).unwrap();

    // The gateway's store holds two images; the mirror none yet.
    let gateway_store = ImageStore::open(dir.path().join("gateway"), IdMap::default()).unwrap();
    let mut digests = Vec::new();
    for name in ["one", "two"] {
        let layout = dir.path().join(name);
        let layer = fixtures::tar_bytes(&[
            TarEntry::dir("etc/"),
            TarEntry::file(&format!("etc/{name}"), name.as_bytes()),
        ]);
        fixtures::write_oci_layout(&layout, &[layer], "v1");
        let imported = gateway_store
            .import(&layout, Some("localhost/x:v1"))
            .unwrap();
        digests.push(imported[0].info.digest.clone());
    }
    let source = Arc::new(ImageSource::new(
        mirror.clone(),
        Some(gateway_store.clone()),
    ));

    // The node: its own empty store.
    let node_images =
        Arc::new(NodeImages::open(dir.path().join("node-images"), IdMap::default()).unwrap());
    let fences = sbx_drivers::remote::fence::Fences::open(&dir.path().join("fences")).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let sim = Arc::new(SimDriver::new(SimWorld::new(), SimFaults::default()));
    let server = tokio::spawn(serve_node(
        sim,
        identity(),
        fences,
        Some(Arc::clone(&node_images)),
        listener,
        None,
        std::future::pending(),
    ));
    let plain = RemoteDriver::connect_tcp_lazy(&addr, None, CALL_TIMEOUT).unwrap();
    let gateway = plain.with_image_source(Arc::clone(&source));

    // Without the header, an image the node lacks is refused, naming it and what to do.
    let err = plain.create(create(&digests[0])).await.unwrap_err();
    assert!(
        matches!(&err, DriverError::FailedPrecondition(m) if m.contains(&digests[0]) && m.contains("--image-mirror")),
        "{err}"
    );
    assert_eq!(node_images.fetched(), 0);

    // Five creates of one image at once: pushed by the gateway, fetched by the node once.
    let creates: Vec<_> = (0..5)
        .map(|_| {
            let gateway = gateway.clone();
            let image = digests[0].clone();
            tokio::spawn(async move { gateway.create(create(&image)).await })
        })
        .collect();
    for created in creates {
        created.await.unwrap().unwrap();
    }
    assert_eq!(node_images.fetched(), 1);
    let held = node_images.store().get(&digests[0]).unwrap();
    assert_eq!(held, gateway_store.get(&digests[0]).unwrap());
    // Again: nothing is fetched.
    gateway.create(create(&digests[0])).await.unwrap();
    assert_eq!(node_images.fetched(), 1);
    // Now the node holds it, a create without the header is fine too.
    plain.create(create(&digests[0])).await.unwrap();

    // The second image: the mirror lacks it; the gateway pushes it at its first create.
    gateway.create(create(&digests[1])).await.unwrap();
    assert_eq!(node_images.fetched(), 2);
    node_images.store().get(&digests[1]).unwrap();

    // An image neither the gateway nor the mirror has: refused, naming it and the mirror.
    let absent = format!("sha256:{}", "e".repeat(64));
    let err = gateway.create(create(&absent)).await.unwrap_err();
    assert!(
        matches!(&err, DriverError::FailedPrecondition(m) if m.contains(&absent) && m.contains(&mirror.to_string())),
        "{err}"
    );
    // A create without an image reaches the driver untouched.
    gateway.create(create("")).await.unwrap();
    assert_eq!(node_images.fetched(), 2);
    server.abort();
    drop(registry);
}
