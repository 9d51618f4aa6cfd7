//! The image adds through the front door alone, with no transport: an import and a build take
//! plain byte streams and answer domain values (what the E2B door's template builds will call),
//! and their refusals come before a byte of the upload is read.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::{Stream, StreamExt};
use sbx_actors::{Config, DriverSet, Gateway};
use sbx_drivers::image::{IdMap, ImageStore, fixtures};
use sbx_drivers::sim::{SimDriver, SimFaults, SimWorld};
use sbx_storage::{ObjectStore, SledStore};

use super::{Built, NewBuild, NewImport};
use crate::auth::{Caller, Proof, Role};
use crate::frontdoor::{Class, Failure, FrontDoor};

/// A front door over a sim gateway with an image store whose uploads are at most `limit`
/// bytes; the temp dir holds both stores.
async fn door(limit: u64) -> (tempfile::TempDir, FrontDoor) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(SledStore::open(&dir.path().join("db")).unwrap());
    let images = ImageStore::open(dir.path().join("images"), IdMap::default()).unwrap();
    let driver = SimDriver::new(SimWorld::new(), SimFaults::default()).with_images(true);
    let config = Config {
        reconcile_interval: Duration::ZERO,
        request_timeout: Duration::from_secs(20),
        image_store: Some(images),
        max_image_import_bytes: limit,
        ..Config::default()
    };
    let drivers = DriverSet::single("sim", Arc::new(driver));
    let gateway = Gateway::start(store, drivers, config).await.unwrap();
    assert!(gateway.wait_attached(Duration::from_secs(10)).await);
    (dir, FrontDoor::new(Arc::new(gateway)))
}

/// `bytes` in chunks of `chunk`, counting in `read` the chunks taken.
fn upload(
    bytes: Vec<u8>,
    chunk: usize,
    read: &Arc<AtomicUsize>,
) -> impl Stream<Item = Result<Vec<u8>, Failure>> + Send + 'static {
    let read = Arc::clone(read);
    let chunks: Vec<Vec<u8>> = bytes.chunks(chunk).map(<[u8]>::to_vec).collect();
    futures::stream::iter(chunks).map(move |c| {
        read.fetch_add(1, Ordering::SeqCst);
        Ok(c)
    })
}

/// An OCI archive (a tar of an OCI layout) of one image of one file.
fn archive(work: &std::path::Path) -> Vec<u8> {
    let layout = work.join("layout");
    let layer = fixtures::tar_bytes(&[fixtures::TarEntry::file("etc/hello", b"hello")]);
    fixtures::write_oci_layout(&layout, &[layer], "v1");
    let mut tar = tar::Builder::new(Vec::new());
    tar.append_dir_all(".", &layout).unwrap();
    tar.into_inner().unwrap()
}

fn spooled(door: &FrontDoor) -> usize {
    let (spool, _) = door.gateway().image_spool().unwrap();
    std::fs::read_dir(spool).map_or(0, |files| files.count())
}

#[tokio::test]
async fn an_import_is_a_byte_stream_refused_before_a_byte_is_read() {
    let (dir, door) = door(64 << 10).await;
    let admin = Caller::admin("root", Proof::Token);
    let bytes = archive(dir.path());
    let read = Arc::new(AtomicUsize::new(0));
    let named = |name: &str| NewImport {
        name: Some(name.into()),
        workspace: "default".into(),
        publish: false,
    };

    // A name the gateway keeps for itself, and a caller with no grant there: refused unread.
    let reserved = door
        .import_image(
            &admin,
            named("sbx.local/mine:v1"),
            upload(bytes.clone(), 512, &read),
        )
        .await
        .unwrap_err();
    assert_eq!(
        (reserved.class, reserved.reason.as_str()),
        (Class::PermissionDenied, "IMAGE_NAME_RESERVED")
    );
    let mut stranger = Caller::admin("stranger", Proof::Token);
    stranger.role = Role::Editor;
    stranger.grants = Some(BTreeMap::new());
    let refused = door
        .import_image(
            &stranger,
            named("mine:v1"),
            upload(bytes.clone(), 512, &read),
        )
        .await
        .unwrap_err();
    assert_eq!(refused.class, Class::PermissionDenied, "{refused:?}");
    assert_eq!(
        read.load(Ordering::SeqCst),
        0,
        "a refused import read its upload"
    );

    // Over the limit: refused naming it, nothing left in the spool.
    let big = door
        .import_image(
            &admin,
            named("big:v1"),
            upload(vec![0; 100 << 10], 4096, &read),
        )
        .await
        .unwrap_err();
    assert_eq!(big.class, Class::InvalidArgument, "{big:?}");
    assert!(
        big.message
            .contains("the import of big:v1 is over the gateway's limit of 65536 bytes"),
        "{big:?}"
    );
    assert_eq!(spooled(&door), 0, "the refused upload stayed in the spool");

    // An archive in chunks: imported under its name, the spool emptied.
    let images = door
        .import_image(&admin, named("mine:v1"), upload(bytes, 512, &read))
        .await
        .expect("import");
    assert_eq!(images.len(), 1, "{images:?}");
    assert!(images[0].name.contains("mine:v1"), "{images:?}");
    assert_eq!(spooled(&door), 0, "the import's upload stayed in the spool");
}

#[tokio::test]
async fn a_build_takes_a_byte_stream_and_answers_its_steps_then_its_image() {
    let (dir, door) = door(64 << 10).await;
    let admin = Caller::admin("root", Proof::Token);
    let read = Arc::new(AtomicUsize::new(0));
    let base = NewImport {
        name: Some("base:v1".into()),
        workspace: "default".into(),
        publish: false,
    };
    let bytes = archive(dir.path());
    door.import_image(&admin, base, upload(bytes, 4096, &read))
        .await
        .expect("import the base");

    let context = fixtures::tar_bytes(&[fixtures::TarEntry::file("greeting", b"hi")]);
    let new = NewBuild {
        name: Some("built:v1".into()),
        dockerfile: "FROM base:v1\nCOPY greeting /etc/greeting\n".into(),
        ..NewBuild::default()
    };
    let mut built = door
        .build_image(&admin, new, upload(context, 100, &read))
        .await
        .expect("build");
    let mut steps = 0;
    let image = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match built
                .next()
                .await
                .expect("the build ended without an image")
            {
                Ok(Built::Event(sbx_build::BuildEvent::Step { .. })) => steps += 1,
                Ok(Built::Event(_)) => {}
                Ok(Built::Image(image)) => return image,
                Err(failure) => panic!("the build failed: {failure:?}"),
            }
        }
    })
    .await
    .expect("the build took over 30 s");
    assert_eq!(steps, 2, "FROM and COPY");
    assert!(image.name.contains("built:v1"), "{image:?}");
    assert!(built.next().await.is_none(), "more after the image");

    // A build of a name the gateway keeps is refused before its context is read.
    let before = read.load(Ordering::SeqCst);
    let reserved = NewBuild {
        name: Some("sbx.local/built:v1".into()),
        dockerfile: "FROM base:v1\n".into(),
        ..NewBuild::default()
    };
    let refused = door
        .build_image(&admin, reserved, upload(vec![1; 10], 5, &read))
        .await
        .err()
        .expect("a reserved name was built");
    assert_eq!(refused.reason, "IMAGE_NAME_RESERVED", "{refused:?}");
    assert_eq!(read.load(Ordering::SeqCst), before);
}
