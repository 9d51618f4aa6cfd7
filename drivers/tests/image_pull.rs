//! `ImageStore::pull` against a real registry: Debian's `docker-registry` (distribution 2.8) on
//! 127.0.0.1, filled with `skopeo copy` from an OCI layout this test writes, once with gzip
//! layers and once recompressed to zstd. Needs the Debian packages `docker-registry` and
//! `skopeo`; without them the test prints why and passes (and fails under CI, which installs
//! them).

use std::sync::Mutex;

use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
use sbx_drivers::image::{IdMap, ImageError, ImageStore, PullOptions, PullProgress};

/// `len` bytes of xorshift64 from `seed`: incompressible enough.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn layer() -> Vec<u8> {
    // Big enough (3 MiB, little of it compressible) for more than one progress report.
    let noise = noise(3 << 20, 0x9e37_79b9_7f4a_7c15);
    fixtures::tar_bytes(&[
        TarEntry::dir("etc/"),
        TarEntry::file("etc/marker", b"pulled from the registry\n"),
        TarEntry::file("var/noise", &noise),
    ])
}

async fn pull(
    store: &ImageStore,
    reference: &str,
) -> (
    Result<sbx_drivers::image::ImageInfo, ImageError>,
    Vec<PullProgress>,
) {
    let events = Mutex::new(Vec::new());
    let result = store
        .pull(reference, &PullOptions::default(), &|p| {
            events.lock().unwrap().push(p)
        })
        .await;
    (result, events.into_inner().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pull_from_a_local_registry() {
    if !LocalRegistry::available("pull_from_a_local_registry") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(dir.path());
    let layout = dir.path().join("layout");
    let tar = layer();
    fixtures::write_oci_layout(&layout, std::slice::from_ref(&tar), "v1");
    let gzip_ref = format!("{}/sbx/marker:gzip", registry.addr);
    let zstd_ref = format!("{}/sbx/marker:zstd", registry.addr);
    registry.push(&layout, &gzip_ref, &[]);
    let plain_layout = dir.path().join("layout-plain");
    fixtures::write_oci_layout_uncompressed(&plain_layout, std::slice::from_ref(&tar), "v1");
    registry.push(
        &plain_layout,
        &zstd_ref,
        &["--dest-compress-format", "zstd"],
    );

    // gzip: downloaded, reported, unpacked with shifted owners.
    let store = ImageStore::open(dir.path().join("images"), IdMap::default()).unwrap();
    let (info, events) = pull(&store, &gzip_ref).await;
    let info = info.unwrap();
    assert_eq!(info.layers.len(), 1);
    assert!(
        info.layers[0].media_type.contains("gzip"),
        "{:?}",
        info.layers[0]
    );
    assert_eq!(info.layers[0].diff_id, fixtures::sha256(&tar));
    assert_eq!(info.config.cmd, vec!["sh"]);
    let top = store.layer_dirs(&info).pop().unwrap();
    assert_eq!(
        std::fs::read_to_string(top.join("etc/marker")).unwrap(),
        "pulled from the registry\n"
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(top.join("etc/marker")).unwrap().uid(),
        200_000
    );
    assert!(
        matches!(&events[0], PullProgress::Resolved { digest, layers: 1, total_bytes } if *digest == info.digest && *total_bytes == info.size),
        "{events:?}"
    );
    let downloads: Vec<u64> = events
        .iter()
        .filter_map(|e| match e {
            PullProgress::Layer { done, total, .. } => {
                assert_eq!(*total, info.layers[0].size);
                Some(*done)
            }
            _ => None,
        })
        .collect();
    assert!(
        downloads.len() >= 2,
        "a 3 MiB layer reports more than once: {events:?}"
    );
    assert!(downloads.windows(2).all(|w| w[0] < w[1]), "{downloads:?}");
    assert_eq!(downloads.last(), Some(&info.layers[0].size));
    assert!(
        matches!(events.last(), Some(PullProgress::LayerUnpacked { .. })),
        "{events:?}"
    );
    assert_eq!(store.get(&info.digest).unwrap(), info);

    // Again: nothing is downloaded; by digest: the same image.
    let (again, events) = pull(&store, &gzip_ref).await;
    assert_eq!(again.unwrap(), info);
    assert!(
        matches!(
            events.as_slice(),
            [
                PullProgress::Resolved { .. },
                PullProgress::LayerCached { .. }
            ]
        ),
        "{events:?}"
    );
    let by_digest = format!("{}/sbx/marker@{}", registry.addr, info.digest);
    assert_eq!(
        pull(&store, &by_digest).await.0.unwrap().digest,
        info.digest
    );

    // zstd, into a fresh store (the same uncompressed layer would be cached here).
    let store2 = ImageStore::open(dir.path().join("images-zstd"), IdMap::default()).unwrap();
    let (zinfo, _) = pull(&store2, &zstd_ref).await;
    let zinfo = zinfo.unwrap();
    assert!(
        zinfo.layers[0].media_type.contains("zstd"),
        "{:?}",
        zinfo.layers[0]
    );
    assert_eq!(zinfo.layers[0].diff_id, info.layers[0].diff_id);
    let top = store2.layer_dirs(&zinfo).pop().unwrap();
    assert_eq!(
        std::fs::read_to_string(top.join("etc/marker")).unwrap(),
        "pulled from the registry\n"
    );

    // A tag the registry does not have.
    let missing = format!("{}/sbx/marker:nope", registry.addr);
    let err = pull(&store, &missing).await.0.unwrap_err();
    assert!(matches!(err, ImageError::NotFound { .. }), "{err}");
    assert!(err.to_string().contains("sbx/marker:nope"), "{err}");

    // A port nobody listens on.
    // A port nobody listens on (bound and let go).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!("127.0.0.1:{port}/sbx/marker:gzip");
    let err = pull(&store, &nobody).await.0.unwrap_err();
    assert!(matches!(err, ImageError::Unavailable { .. }), "{err}");
    assert!(
        err.to_string().contains(nobody.split('/').next().unwrap()),
        "{err}"
    );
    assert_eq!(
        std::fs::read_dir(store.root().join("tmp")).unwrap().count(),
        0,
        "no pull leaves tmp/ files"
    );
    drop(registry);
}

/// The image limits' cost on a normal pull: a ~100 MiB image (one layer of 100 MiB of noise in
/// 100 files) pulled from the local registry with the default limits and with none,
/// alternated, into fresh stores. Ignored (a benchmark):
/// `cargo nextest run -p sbx-drivers --test image_pull --run-ignored only --no-capture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn the_limits_cost_of_a_100_mib_pull() {
    if !LocalRegistry::available("the_limits_cost_of_a_100_mib_pull") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(dir.path());
    let files: Vec<TarEntry> = (0..100u64)
        .map(|i| {
            TarEntry::file(
                &format!("data/{i}"),
                &noise(1 << 20, 0x2545_f491_4f6c_dd1d + i),
            )
        })
        .collect();
    let tar = fixtures::tar_bytes(&files);
    drop(files);
    let layout = dir.path().join("layout");
    fixtures::write_oci_layout(&layout, std::slice::from_ref(&tar), "v1");
    let reference = format!("{}/sbx/big:v1", registry.addr);
    registry.push(&layout, &reference, &[]);
    let unlimited = sbx_drivers::image::ImageLimits {
        max_layers: usize::MAX,
        max_size: u64::MAX,
        max_files: u64::MAX,
        min_free: sbx_drivers::image::MinFree::Bytes(0),
    };
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for round in 0..6 {
        for limited in [round % 2 == 0, round % 2 == 1] {
            let root = dir.path().join(format!("store-{round}-{limited}"));
            let store = ImageStore::open(root.clone(), IdMap::default()).unwrap();
            if !limited {
                store.set_limits(unlimited);
            }
            let began = std::time::Instant::now();
            let (result, _) = pull(&store, &reference).await;
            result.unwrap();
            let took = began.elapsed().as_secs_f64() * 1000.0;
            if limited {
                with.push(took)
            } else {
                without.push(took)
            }
            drop(store);
            std::fs::remove_dir_all(&root).unwrap();
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        v[v.len() / 2]
    };
    let (w, wo) = (median(&mut with), median(&mut without));
    eprintln!(
        "a 100 MiB pull, median of 6: with the default limits {w:.0} ms, without {wo:.0} ms, \
         ratio {:.3}",
        w / wo
    );
}
