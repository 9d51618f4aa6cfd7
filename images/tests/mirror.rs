//! `ImageStore::push` to an image mirror and a pull back by digest, against Debian's
//! `docker-registry` on 127.0.0.1: an image of each form the store takes in (an OCI layout
//! with gzip layers, a `docker save` archive with plain tar layers, a zstd root-filesystem
//! tar) is pushed from one store and pulled by digest into another, where it is the same
//! image, its files and all. Needs root (layers are unpacked with shifted owners) and the
//! Debian packages `docker-registry` and `skopeo`; without the packages the test prints why and
//! passes (and fails under CI, which installs them).

use sbx_images::fixtures::{self, LocalRegistry, TarEntry};
use sbx_images::{IdMap, ImageError, ImageStore, Mirror, PullOptions};

fn layer(name: &str, content: &str) -> Vec<u8> {
    fixtures::tar_bytes(&[
        TarEntry::dir("etc/"),
        TarEntry::file(&format!("etc/{name}"), content.as_bytes()),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_of_every_form_go_to_the_mirror_and_come_back_by_digest() {
    if !LocalRegistry::available("images_of_every_form_go_to_the_mirror_and_come_back_by_digest") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(dir.path());
    let mirror = Mirror::parse(&format!("{}/sbx-test", registry.addr)).unwrap();
    let gateway = ImageStore::open(dir.path().join("gateway"), IdMap::default()).unwrap();
    let node = ImageStore::open(dir.path().join("node"), IdMap::default()).unwrap();
    let opts = PullOptions::default();

    // Three forms; the layout's second layer is the docker archive's only one (shared).
    let shared = layer("shared", "in two images\n");
    let layout = dir.path().join("layout");
    fixtures::write_oci_layout(&layout, &[layer("base", "base\n"), shared.clone()], "v1");
    let docker = dir.path().join("docker.tar");
    std::fs::write(
        &docker,
        fixtures::docker_archive(std::slice::from_ref(&shared), "localhost/docker:v1"),
    )
    .unwrap();
    let rootfs = dir.path().join("rootfs.tar.zst");
    std::fs::write(&rootfs, fixtures::zstd(&layer("rootfs", "rootfs\n"))).unwrap();
    let mut infos = Vec::new();
    for (path, name) in [
        (&layout, None),
        (&docker, None),
        (&rootfs, Some("localhost/rootfs:v1")),
    ] {
        let imported = gateway.import(path, name).unwrap();
        infos.push(imported[0].info.clone());
    }
    let media: Vec<&str> = infos
        .iter()
        .map(|i| i.layers[0].media_type.as_str())
        .collect();
    assert!(
        media[0].ends_with("+gzip") && media[1].ends_with(".tar") && media[2].ends_with("+zstd"),
        "{media:?}"
    );

    let pushed = gateway
        .push(&infos[0].digest, &mirror, &opts)
        .await
        .unwrap();
    assert!(!pushed.already_there);
    assert_eq!((pushed.blobs_pushed, pushed.blobs_present), (3, 0));
    // The docker archive's layer is the plain tar, the layout's the gzip one: not shared as
    // blobs (their diff_ids are the same).
    let pushed = gateway
        .push(&infos[1].digest, &mirror, &opts)
        .await
        .unwrap();
    assert_eq!(pushed.blobs_pushed, 2, "{pushed:?}");
    gateway
        .push(&infos[2].digest, &mirror, &opts)
        .await
        .unwrap();
    // Again: the manifest is there, nothing is sent.
    let again = gateway
        .push(&infos[0].digest, &mirror, &opts)
        .await
        .unwrap();
    assert!(again.already_there, "{again:?}");

    // Back by digest into the node's store: the same images, the same files.
    for info in &infos {
        let reference = mirror.reference(&info.digest);
        let pulled = node.pull(&reference, &opts, &|_| {}).await.unwrap();
        assert_eq!(pulled, *info, "{reference}");
        assert_eq!(node.get(&info.digest).unwrap(), *info);
    }
    let top = node.layer_dirs(&infos[2]).pop().unwrap();
    assert_eq!(
        std::fs::read_to_string(top.join("etc/rootfs")).unwrap(),
        "rootfs\n"
    );
    let shared_dir = node.layer_dirs(&infos[1]).pop().unwrap();
    assert_eq!(
        std::fs::read_to_string(shared_dir.join("etc/shared")).unwrap(),
        "in two images\n"
    );
    // The manifest is tagged by its digest in the repository.
    let tag = format!(
        "{}/sbx-test/sbx-images:{}",
        registry.addr,
        Mirror::tag(&infos[0].digest)
    );
    assert_eq!(
        node.pull(&tag, &opts, &|_| {}).await.unwrap().digest,
        infos[0].digest
    );

    // An image the store does not hold; a mirror nobody listens on.
    let absent = format!("sha256:{}", "0".repeat(64));
    let err = gateway.push(&absent, &mirror, &opts).await.unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = Mirror::parse(&format!("127.0.0.1:{port}")).unwrap();
    let err = gateway
        .push(&infos[0].digest, &nobody, &opts)
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Unavailable { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!("127.0.0.1:{port}")),
        "{err}"
    );
    drop(registry);
}
