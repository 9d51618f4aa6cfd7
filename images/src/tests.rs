//! Unit tests of the image store. They run as root (owners are shifted with chown, whiteouts
//! are character devices).

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use oci_client::client::ClientProtocol;
use tar::EntryType;

use super::fixtures::{self, TarEntry, tar_bytes};
use super::spec::Compression;
use super::*;

fn store() -> (tempfile::TempDir, ImageStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = ImageStore::open(dir.path().join("images"), IdMap::default()).unwrap();
    (dir, store)
}

/// Stores `bytes` as a layer blob and unpacks it; returns the diff_id.
fn unpack_bytes(store: &ImageStore, bytes: &[u8], c: Compression) -> Result<String, ImageError> {
    let t = store.transfer(Default::default());
    let (digest, _) = store.store_blob("test", &mut &bytes[..], None, &t)?;
    store.unpack_layer(
        "test",
        &digest,
        c,
        None,
        &mut store.limits().budget("test"),
        &t,
    )
}

fn count(dir: &Path) -> usize {
    std::fs::read_dir(dir).unwrap().count()
}

fn layer_path(store: &ImageStore, diff_id: &str) -> std::path::PathBuf {
    store.layer_dir("test", diff_id).unwrap()
}

#[test]
fn hostile_layers_are_refused_and_leave_nothing() {
    let (dir, store) = store();
    let sentinel = dir.path().join("sentinel");
    std::fs::create_dir(&sentinel).unwrap();
    std::fs::write(sentinel.join("secret"), b"untouched").unwrap();
    let s = sentinel.display().to_string();
    let cases: Vec<(&str, Vec<TarEntry>, &str)> = vec![
        (
            "dot-dot",
            vec![TarEntry::file("../sentinel/pwned", b"x")],
            "..",
        ),
        (
            "deep dot-dot",
            vec![TarEntry::dir("a/"), TarEntry::file("a/../../pwned", b"x")],
            "..",
        ),
        (
            "absolute",
            vec![TarEntry::file(&format!("{s}/pwned"), b"x")],
            "absolute",
        ),
        (
            "symlinked parent",
            vec![
                TarEntry::symlink("link", &s),
                TarEntry::file("link/pwned", b"x"),
            ],
            "symlink",
        ),
        (
            "symlinked parent, deeper",
            vec![
                TarEntry::symlink("link", &s),
                TarEntry::dir("link/sub/"),
                TarEntry::file("link/sub/pwned", b"x"),
            ],
            "symlink",
        ),
        (
            "hard link outside",
            vec![TarEntry::hardlink("hl", &format!("{s}/secret"))],
            "absolute",
        ),
        (
            "hard link dot-dot",
            vec![TarEntry::hardlink("hl", "../sentinel/secret")],
            "..",
        ),
        (
            "hard link to nothing unpacked",
            vec![TarEntry::hardlink("hl", "etc/passwd")],
            "not unpacked",
        ),
        (
            "hard link through a symlink",
            vec![
                TarEntry::symlink("link", &s),
                TarEntry::hardlink("hl", "link/secret"),
            ],
            "not unpacked",
        ),
        (
            "uid outside the map",
            vec![TarEntry::file("f", b"x").owner(70_000, 0)],
            "outside",
        ),
        (
            "gid outside the map",
            vec![TarEntry::file("f", b"x").owner(0, 65_536)],
            "outside",
        ),
        (
            "file under a file",
            vec![TarEntry::file("f", b"x"), TarEntry::file("f/g", b"x")],
            "not a directory",
        ),
    ];
    for (name, entries, why) in cases {
        let err = unpack_bytes(&store, &tar_bytes(&entries), Compression::None).unwrap_err();
        match &err {
            ImageError::UnsafeLayer { why: w, .. } => assert!(w.contains(why), "{name}: {err}"),
            other => panic!("{name}: expected UnsafeLayer, got {other}"),
        }
        assert_eq!(
            count(&store.root().join("layers/sha256")),
            0,
            "{name}: a layer was left"
        );
        assert_eq!(count(&store.root().join("tmp")), 0, "{name}: tmp/ was left");
        assert_eq!(
            count(&sentinel),
            1,
            "{name}: something was written next to the store"
        );
        assert_eq!(
            std::fs::read(sentinel.join("secret")).unwrap(),
            b"untouched",
            "{name}"
        );
        assert_eq!(
            count(dir.path()),
            2,
            "{name}: something was written outside the store"
        );
    }
}

#[test]
fn entries_keep_mode_and_mtime_with_owners_shifted() {
    let (_dir, store) = store();
    let entries = vec![
        TarEntry::dir("./usr/"),
        TarEntry::file("./usr/su", b"#!/bin/sh\n").mode(0o4755),
        TarEntry::file("home/user/notes", b"n")
            .owner(1000, 1001)
            .mode(0o600),
        TarEntry::symlink("usr/sh", "/bin/busybox").owner(5, 6),
        TarEntry::hardlink("usr/su2", "./usr/su"),
        TarEntry::special("run/fifo", EntryType::Fifo).mode(0o620),
        TarEntry::dir("tmp/").mode(0o1777),
    ];
    let diff_id = unpack_bytes(&store, &tar_bytes(&entries), Compression::None).unwrap();
    let root = layer_path(&store, &diff_id);
    let su = std::fs::symlink_metadata(root.join("usr/su")).unwrap();
    assert_eq!((su.uid(), su.gid()), (200_000, 200_000));
    assert_eq!(su.mode() & 0o7777, 0o4755, "setuid survives the chown");
    assert_eq!(su.mtime(), 1_700_000_000);
    let notes = std::fs::symlink_metadata(root.join("home/user/notes")).unwrap();
    assert_eq!(
        (notes.uid(), notes.gid(), notes.mode() & 0o7777),
        (201_000, 201_001, 0o600)
    );
    let implicit = std::fs::symlink_metadata(root.join("home/user")).unwrap();
    assert_eq!((implicit.uid(), implicit.mode() & 0o7777), (200_000, 0o755));
    let link = std::fs::symlink_metadata(root.join("usr/sh")).unwrap();
    assert!(link.file_type().is_symlink());
    assert_eq!((link.uid(), link.gid()), (200_005, 200_006));
    assert_eq!(
        std::fs::read_link(root.join("usr/sh")).unwrap(),
        Path::new("/bin/busybox")
    );
    let su2 = std::fs::symlink_metadata(root.join("usr/su2")).unwrap();
    assert_eq!(su2.ino(), su.ino(), "a hard link, not a copy");
    let fifo = std::fs::symlink_metadata(root.join("run/fifo")).unwrap();
    assert!(fifo.file_type().is_fifo());
    assert_eq!(fifo.mode() & 0o7777, 0o620);
    let tmp = std::fs::symlink_metadata(root.join("tmp")).unwrap();
    assert_eq!(tmp.mode() & 0o7777, 0o1777);
    assert_eq!(
        tmp.mtime(),
        1_700_000_000,
        "directory mtimes are set after their content"
    );
    assert_eq!(
        std::fs::symlink_metadata(root.join("usr")).unwrap().mtime(),
        1_700_000_000
    );
}

#[test]
fn devices_are_skipped_and_whiteouts_take_overlay_form() {
    let (_dir, store) = store();
    let entries = vec![
        TarEntry::special("dev/null", EntryType::Char),
        TarEntry::special("dev/sda", EntryType::Block),
        TarEntry::file("etc/.wh.motd", b""),
        TarEntry::dir("var/cache/"),
        TarEntry::file("var/cache/.wh..wh..opq", b""),
        TarEntry::file("var/cache/kept", b"k"),
        TarEntry::file("a", b"first"),
        TarEntry::file("a", b"second"),
    ];
    let bytes = tar_bytes(&entries);
    let dest = store.tmp_path("direct");
    std::fs::create_dir(&dest).unwrap();
    let layer = unpack::Layer {
        image: "test",
        digest: "sha256:x",
        idmap: IdMap::default(),
        cancel: None,
    };
    let stats = unpack::unpack(
        &layer,
        &bytes[..],
        &dest,
        &mut super::Budget::unlimited("t"),
    )
    .unwrap();
    assert_eq!(stats.devices_skipped, 2);
    assert!(!dest.join("dev/null").exists() && !dest.join("dev/sda").exists());
    let wh = std::fs::symlink_metadata(dest.join("etc/motd")).unwrap();
    assert!(
        wh.file_type().is_char_device(),
        "a whiteout is a character device"
    );
    assert_eq!(wh.rdev(), 0, "a whiteout is device 0:0");
    assert!(!dest.join("etc/.wh.motd").exists());
    let opaque = xattr::get(dest.join("var/cache"), unpack::OPAQUE_XATTR).unwrap();
    assert_eq!(opaque.as_deref(), Some(&b"y"[..]));
    assert!(!dest.join("var/cache/.wh..wh..opq").exists());
    assert_eq!(std::fs::read(dest.join("var/cache/kept")).unwrap(), b"k");
    assert_eq!(
        std::fs::read(dest.join("a")).unwrap(),
        b"second",
        "the later entry wins"
    );
}

#[test]
fn broken_compressed_layers_fail_cleanly() {
    let (_dir, store) = store();
    let tar = tar_bytes(&[
        TarEntry::file("big", &vec![7u8; 300_000]),
        TarEntry::file("after", b"x"),
    ]);
    let gz = fixtures::gzip(&tar);
    let zst = fixtures::zstd(&tar);
    let cases: Vec<(&str, Vec<u8>, Compression)> = vec![
        (
            "truncated gzip",
            gz[..gz.len() / 2].to_vec(),
            Compression::Gzip,
        ),
        (
            "gzip without its trailer",
            gz[..gz.len() - 4].to_vec(),
            Compression::Gzip,
        ),
        (
            "truncated zstd",
            zst[..zst.len() / 2].to_vec(),
            Compression::Zstd,
        ),
        ("not gzip at all", tar.clone(), Compression::Gzip),
        ("garbage tar", vec![0x55; 4096], Compression::None),
    ];
    for (name, bytes, c) in cases {
        let err = unpack_bytes(&store, &bytes, c).unwrap_err();
        assert!(matches!(err, ImageError::Malformed { .. }), "{name}: {err}");
        assert_eq!(count(&store.root().join("layers/sha256")), 0, "{name}");
        assert_eq!(count(&store.root().join("tmp")), 0, "{name}");
    }
    // And the whole stream unpacks.
    let diff_id = unpack_bytes(&store, &gz, Compression::Gzip).unwrap();
    assert_eq!(diff_id, fixtures::sha256(&tar));
    assert_eq!(
        std::fs::read(layer_path(&store, &diff_id).join("after")).unwrap(),
        b"x"
    );
}

#[test]
fn digest_mismatches_are_refused() {
    let (_dir, store) = store();
    let wrong = fixtures::sha256(b"something else");
    let t = store.transfer(Default::default());
    let err = store
        .store_blob("test", &mut &b"content"[..], Some(&wrong), &t)
        .unwrap_err();
    match &err {
        ImageError::DigestMismatch {
            expected, actual, ..
        } => {
            assert_eq!(expected, &wrong);
            assert_eq!(actual, &fixtures::sha256(b"content"));
        }
        other => panic!("expected DigestMismatch, got {other}"),
    }
    assert_eq!(count(&store.root().join("blobs/sha256")), 0);
    assert_eq!(count(&store.root().join("tmp")), 0);

    // A layer whose content is not the config's diff_id.
    let tar = tar_bytes(&[TarEntry::file("f", b"x")]);
    let (digest, _) = store.store_blob("test", &mut &tar[..], None, &t).unwrap();
    let err = store
        .unpack_layer(
            "test",
            &digest,
            Compression::None,
            Some(&wrong),
            &mut store.limits().budget("test"),
            &t,
        )
        .unwrap_err();
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
    assert_eq!(count(&store.root().join("layers/sha256")), 0);
    assert_eq!(count(&store.root().join("tmp")), 0);
}

#[test]
fn the_store_records_its_id_map_and_read_only_stores_do_not_write() {
    let (dir, store) = store();
    let root = store.root().to_path_buf();
    assert_eq!(std::fs::metadata(&root).unwrap().mode() & 0o777, 0o700);
    std::fs::write(root.join("tmp/leftover"), b"x").unwrap();
    let other = IdMap {
        host_uid: 300_000,
        ..IdMap::default()
    };
    let err = ImageStore::open(root.clone(), other).unwrap_err();
    assert!(matches!(err, ImageError::IdMapMismatch { .. }), "{err}");
    assert!(err.to_string().contains("300000"), "{err}");
    assert!(
        root.join("tmp/leftover").exists(),
        "a refused open changes nothing"
    );
    ImageStore::open(root.clone(), IdMap::default()).unwrap();
    assert!(!root.join("tmp/leftover").exists(), "open empties tmp/");

    std::fs::write(root.join("tmp/leftover"), b"x").unwrap();
    let ro = ImageStore::open_read_only(root.clone()).unwrap();
    assert_eq!(ro.idmap(), IdMap::default());
    assert!(
        root.join("tmp/leftover").exists(),
        "a read-only open cleans nothing"
    );
    let rootfs = dir.path().join("rootfs.tar");
    std::fs::write(&rootfs, tar_bytes(&[TarEntry::file("f", b"x")])).unwrap();
    let err = ro.import(&rootfs, Some("x")).unwrap_err();
    assert!(matches!(err, ImageError::ReadOnly { .. }), "{err}");
    assert!(matches!(
        ro.remove_unreferenced(&[]),
        Err(ImageError::ReadOnly { .. })
    ));
    assert!(ImageStore::open_read_only(dir.path().join("nothing")).is_err());
}

/// A layer with a marker file, and its expected content.
fn marker_layer(text: &str) -> Vec<u8> {
    tar_bytes(&[
        TarEntry::dir("etc/"),
        TarEntry::file("etc/marker", text.as_bytes()),
        TarEntry::file("bin/tool", b"#!"),
    ])
}

fn assert_marker(store: &ImageStore, info: &ImageInfo, text: &str) {
    let got = store.get(&info.digest).unwrap();
    assert_eq!(&got, info);
    let dirs = store.layer_dirs(info);
    let top = dirs.last().unwrap();
    assert_eq!(
        std::fs::read_to_string(top.join("etc/marker")).unwrap(),
        text
    );
    assert_eq!(
        std::fs::metadata(top.join("etc/marker")).unwrap().uid(),
        200_000
    );
    // Every stored image has its manifest blob.
    assert!(store.blob_path("test", &info.digest).unwrap().is_file());
}

#[test]
fn import_takes_oci_layouts_docker_archives_and_rootfs_tars() {
    let (dir, store) = store();
    let base = marker_layer("base");
    let top = marker_layer("oci");

    // OCI layout, as a directory and as a tar of one.
    let layout = dir.path().join("layout");
    let manifest_digest = fixtures::write_oci_layout(&layout, &[base.clone(), top.clone()], "v1");
    let imported = store.import(&layout, None).unwrap();
    assert_eq!(imported.len(), 1);
    assert_eq!(imported[0].name.as_deref(), Some("v1"));
    let info = &imported[0].info;
    assert_eq!(info.digest, manifest_digest);
    assert_eq!(info.layers.len(), 2);
    assert_eq!(info.config.cmd, vec!["sh"]);
    assert_eq!(
        info.config.labels.get("fixture").map(String::as_str),
        Some("yes")
    );
    assert_eq!(
        (info.os.as_str(), info.architecture.as_str()),
        ("linux", "amd64")
    );
    assert_eq!(info.size, info.layers.iter().map(|l| l.size).sum::<u64>());
    assert_marker(&store, info, "oci");
    let layout_tar = dir.path().join("layout.tar");
    std::fs::write(&layout_tar, fixtures::tar_dir(&layout)).unwrap();
    let again = store.import(&layout_tar, Some("named")).unwrap();
    assert_eq!(again[0].name.as_deref(), Some("named"));
    assert_eq!(
        again[0].info.digest, manifest_digest,
        "same layout, same image"
    );
    // Compressed, too (detected by content: the name says nothing).
    let layout_gz = dir.path().join("layout.bin");
    std::fs::write(&layout_gz, fixtures::gzip(&fixtures::tar_dir(&layout))).unwrap();
    assert_eq!(
        store.import(&layout_gz, None).unwrap()[0].info.digest,
        manifest_digest
    );

    // docker save archive.
    let docker = dir.path().join("docker.tar");
    std::fs::write(
        &docker,
        fixtures::docker_archive(&[base.clone(), marker_layer("docker")], "app:1"),
    )
    .unwrap();
    let imported = store.import(&docker, None).unwrap();
    assert_eq!(imported.len(), 1);
    assert_eq!(imported[0].name.as_deref(), Some("app:1"));
    assert_eq!(imported[0].info.layers[0].media_type, spec::LAYER_TAR);
    assert_eq!(imported[0].info.layers[0].diff_id, fixtures::sha256(&base));
    assert_marker(&store, &imported[0].info, "docker");

    // Root-filesystem tar, plain and zstd.
    let rootfs = dir.path().join("rootfs");
    std::fs::write(&rootfs, marker_layer("rootfs")).unwrap();
    let err = store.import(&rootfs, None).unwrap_err();
    assert!(matches!(err, ImageError::InvalidArgument { .. }), "{err}");
    let imported = store.import(&rootfs, Some("mine:1")).unwrap();
    assert_eq!(imported[0].name.as_deref(), Some("mine:1"));
    let info = &imported[0].info;
    assert_eq!(info.config.cmd, vec!["sh"]);
    assert_eq!(info.config.env, vec![spec::DEFAULT_PATH.to_string()]);
    assert_marker(&store, info, "rootfs");
    let rootfs_zst = dir.path().join("rootfs.zst");
    std::fs::write(&rootfs_zst, fixtures::zstd(&marker_layer("zstd"))).unwrap();
    let info = &store.import(&rootfs_zst, Some("z")).unwrap()[0].info;
    assert_eq!(info.layers[0].media_type, spec::LAYER_ZSTD);
    assert_marker(&store, info, "zstd");
}

#[test]
fn a_layout_with_a_tampered_blob_is_refused() {
    let (dir, store) = store();
    let layout = dir.path().join("layout");
    fixtures::write_oci_layout(&layout, &[marker_layer("x")], "v1");
    // Replace the layer blob's content, keeping its name.
    let blobs = layout.join("blobs/sha256");
    let mut replaced = false;
    for e in std::fs::read_dir(&blobs).unwrap() {
        let p = e.unwrap().path();
        if std::fs::read(&p).unwrap().starts_with(&[0x1f, 0x8b]) {
            std::fs::write(&p, fixtures::gzip(&marker_layer("evil"))).unwrap();
            replaced = true;
        }
    }
    assert!(replaced);
    let err = store.import(&layout, None).unwrap_err();
    assert!(matches!(err, ImageError::DigestMismatch { .. }), "{err}");
    assert_eq!(count(&store.root().join("layers/sha256")), 0);
}

/// A collection takes nothing a transfer holds — what it wrote before the collection began,
/// and what it took hold of while the collection ran (a record written after the collection
/// read its records) — and takes it all once the transfer has ended unkept, which it says.
#[tokio::test]
async fn gc_takes_nothing_a_transfer_holds_or_held_while_it_ran() {
    let (dir, store) = store();
    let a = dir.path().join("a");
    std::fs::write(&a, marker_layer("held")).unwrap();
    let t = store.transfer(Default::default());
    let held = store.import_with(&a, Some("a"), &t).unwrap().remove(0).info;
    // Nothing recorded keeps it; the transfer does.
    let report = store.remove_unreferenced(&[]).unwrap();
    assert_eq!(report, GcReport::default());
    store.get(&held.digest).unwrap();

    // A hold taken while a collection runs is kept by it, though released before its sweep
    // (its record written after the collection read the records).
    let b = dir.path().join("b");
    std::fs::write(&b, marker_layer("during")).unwrap();
    let collection = store.begin_collection().expect("no other collection");
    assert!(
        store.begin_collection().is_none(),
        "one collection at a time"
    );
    let late = store.transfer(Default::default());
    let during = store
        .import_with(&b, Some("b"), &late)
        .unwrap()
        .remove(0)
        .info;
    late.kept();
    drop(late);
    let report = collection.remove_unreferenced(&[]).unwrap();
    assert_eq!(report, GcReport::default());
    store.get(&during.digest).unwrap();
    // `held`'s transfer ends unkept, and says so; the next collection takes its content.
    drop(t);
    tokio::time::timeout(std::time::Duration::from_secs(1), store.transfer_ended())
        .await
        .expect("an unkept transfer's end is told");
    let report = store
        .remove_unreferenced(std::slice::from_ref(&during.digest))
        .unwrap();
    assert_eq!(report.blobs_removed, 3, "held's manifest, config and layer");
    assert_eq!(report.layers_removed, 1);
    store.get(&during.digest).unwrap();
    assert!(matches!(
        store.get(&held.digest),
        Err(ImageError::NotFound { .. })
    ));
    assert_eq!(
        count(&store.root().join("tmp")),
        0,
        "removed, not moved aside"
    );
}

/// A cancelled transfer stops at its next entry and puts nothing in place; an add that would
/// leave less than the minimum free is refused naming the free space and the flag.
#[test]
fn a_cancelled_or_roomless_add_puts_nothing_in_place() {
    let (dir, store) = store();
    let a = dir.path().join("a");
    std::fs::write(&a, marker_layer("cancelled")).unwrap();
    let t = store.transfer(Default::default());
    t.cancel();
    let err = store.import_with(&a, Some("a"), &t).unwrap_err();
    assert!(matches!(err, ImageError::Cancelled { .. }), "{err}");
    drop(t);
    store.remove_unreferenced(&[]).unwrap();
    assert_eq!(count(&store.root().join("blobs/sha256")), 0);
    assert_eq!(count(&store.root().join("layers/sha256")), 0);

    // More free space than the filesystem has: every add is refused before it writes.
    store.set_limits(ImageLimits {
        min_free: MinFree::Bytes(u64::MAX / 4),
        ..ImageLimits::default()
    });
    let err = store.import(&a, Some("a")).unwrap_err();
    let shown = err.to_string();
    assert!(matches!(err, ImageError::NoRoom { .. }), "{shown}");
    assert!(
        shown.contains("free;") && shown.contains("--image-min-free"),
        "{shown}"
    );
    store.remove_unreferenced(&[]).unwrap();
    assert_eq!(count(&store.root().join("blobs/sha256")), 0);
    assert_eq!(count(&store.root().join("tmp")), 0);
}

#[test]
fn min_free_is_a_share_or_a_size() {
    assert_eq!(MinFree::default().bytes(100 << 30), 2 << 30);
    assert_eq!(MinFree::default().bytes(10 << 30), 1 << 30);
    assert_eq!(
        MinFree::parse("5%").unwrap().bytes(200 << 20),
        10 << 20,
        "a share has no cap"
    );
    assert_eq!(MinFree::parse("1Gi").unwrap(), MinFree::Bytes(1 << 30));
    assert_eq!(MinFree::parse("0").unwrap().bytes(1 << 40), 0);
    assert!(MinFree::parse("95%").is_err());
    assert!(MinFree::parse("lots").is_err());
    assert_eq!(
        MinFree::default().to_string(),
        "10% or 2.0GiB, whichever is smaller"
    );
}

#[test]
fn gc_removes_what_no_kept_image_reaches() {
    let (dir, store) = store();
    let a = dir.path().join("a");
    let b = dir.path().join("b");
    std::fs::write(&a, marker_layer("a")).unwrap();
    std::fs::write(&b, marker_layer("b")).unwrap();
    let a = store.import(&a, Some("a")).unwrap().remove(0).info;
    let b = store.import(&b, Some("b")).unwrap().remove(0).info;
    let report = store
        .remove_unreferenced(std::slice::from_ref(&a.digest))
        .unwrap();
    assert_eq!(report.blobs_removed, 3, "b's manifest, config and layer");
    assert_eq!(report.layers_removed, 1);
    assert!(report.bytes_freed > 0);
    store.get(&a.digest).unwrap();
    assert!(matches!(
        store.get(&b.digest),
        Err(ImageError::NotFound { .. })
    ));
    assert_eq!(
        store
            .remove_unreferenced(std::slice::from_ref(&a.digest))
            .unwrap(),
        GcReport::default()
    );
}

#[test]
fn busybox_image_is_a_runnable_rootfs_and_deterministic() {
    let busybox = Path::new("/bin/busybox");
    let (_dir, store) = store();
    let info = store.import_busybox(busybox, "sbx/busybox:latest").unwrap();
    let root = store.layer_dirs(&info).remove(0);
    let bin = std::fs::symlink_metadata(root.join("bin/busybox")).unwrap();
    assert!(bin.is_file() && bin.mode() & 0o111 != 0);
    assert_eq!(bin.uid(), 200_000);
    assert_eq!(
        std::fs::read_link(root.join("bin/sh")).unwrap(),
        Path::new("busybox")
    );
    assert!(root.join("bin/ls").is_symlink());
    assert!(!root.join("bin/busybox").is_symlink());
    assert_eq!(
        std::fs::metadata(root.join("tmp")).unwrap().mode() & 0o7777,
        0o1777
    );
    for d in ["root", "home", "var", "run", "proc", "sys", "dev"] {
        assert!(root.join(d).is_dir(), "{d}");
    }
    assert!(
        std::fs::read_to_string(root.join("etc/passwd"))
            .unwrap()
            .starts_with("root:x:0:0:")
    );
    assert!(root.join("etc/group").is_file());
    // E2B's `user`: an account at home in its own /home/user (the store maps ids by 200,000).
    let passwd = std::fs::read_to_string(root.join("etc/passwd")).unwrap();
    assert!(
        passwd.contains("\nuser:x:1000:1000:user:/home/user:/bin/sh\n"),
        "{passwd}"
    );
    let home = std::fs::metadata(root.join("home/user")).unwrap();
    assert!(home.is_dir());
    assert_eq!((home.uid(), home.gid()), (201_000, 201_000));
    assert!(!root.join("etc/hostname").exists());
    // bash by path is busybox's shell, as `bash -l -c` (E2B's SDKs run commands so).
    let out = std::process::Command::new("chroot")
        .arg(&root)
        .args(["/bin/bash", "-l", "-c", "echo $((6*7))"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "42\n", "{out:?}");
    assert_eq!(info.config.cmd, vec!["sh"]);
    assert_eq!(info.config.env, vec![spec::DEFAULT_PATH.to_string()]);
    // The shell runs from the layer (chroot into it).
    let out = std::process::Command::new("chroot")
        .arg(&root)
        .args(["/bin/sh", "-c", "echo hello from $(basename $0)"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "hello from sh",
        "{out:?}"
    );

    let (_dir2, other) = self::store();
    assert_eq!(
        other.import_busybox(busybox, "x").unwrap().digest,
        info.digest,
        "same busybox, same digest"
    );
    let me = std::env::current_exe().unwrap();
    let err = store.import_busybox(&me, "x").unwrap_err();
    assert!(err.to_string().contains("busybox-static"), "{err}");
}

#[test]
fn plain_http_only_for_loopback_or_insecure() {
    let cases = [
        ("127.0.0.1:5000", false, true),
        ("127.1.2.3", false, true),
        ("localhost:5000", false, true),
        ("[::1]:5000", false, true),
        ("index.docker.io", false, false),
        ("10.0.0.1:5000", false, false),
        ("192.168.1.1:5000", false, false),
        ("127.0.0.1.example.com", false, false),
        ("registry.example:5000", true, true),
    ];
    for (registry, insecure, http) in cases {
        let got = client_protocol(registry, insecure);
        let want = if http {
            ClientProtocol::HttpsExcept(vec![registry.to_string()])
        } else {
            ClientProtocol::Https
        };
        assert_eq!(got, want, "{registry} insecure={insecure}");
    }
}

#[test]
fn references_normalise_and_bad_ones_are_refused() {
    let r = pull::parse_reference("busybox").unwrap();
    assert_eq!(r.whole(), "docker.io/library/busybox:latest");
    let d = fixtures::sha256(b"x");
    let r = pull::parse_reference(&format!("127.0.0.1:5000/app@{d}")).unwrap();
    assert_eq!(r.digest(), Some(d.as_str()));
    assert_eq!(r.registry(), "127.0.0.1:5000");
    for bad in ["", "UPPER/case", "a@sha256:12"] {
        assert!(
            matches!(
                pull::parse_reference(bad),
                Err(ImageError::InvalidReference { .. })
            ),
            "{bad:?}"
        );
    }
}

#[test]
fn merged_lookup_follows_the_layers_whiteouts_and_opaque_directories() {
    use std::ffi::OsStr;
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let (lower, upper) = (dir.path().join("lower"), dir.path().join("upper"));
    let ids = IdMap {
        host_uid: nix::unistd::geteuid().as_raw(),
        host_gid: nix::unistd::getegid().as_raw(),
        size: 65536,
    };
    for d in ["tmp", "etc", "gone", "old/inside", "srv"] {
        std::fs::create_dir_all(lower.join(d)).unwrap();
    }
    std::fs::set_permissions(lower.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::create_dir_all(upper.join("old")).unwrap();
    xattr::set(upper.join("old"), "trusted.overlay.opaque", b"y").unwrap();
    // A whiteout: a 0:0 character device.
    nix::sys::stat::mknod(
        &upper.join("gone"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        0,
    )
    .unwrap();
    std::os::unix::fs::symlink("/etc", upper.join("link")).unwrap();
    std::fs::create_dir(upper.join("srv")).unwrap();
    std::fs::set_permissions(upper.join("srv"), std::fs::Permissions::from_mode(0o700)).unwrap();
    let layers = [upper.clone(), lower.clone()];
    let look = |p: &str| {
        let parts: Vec<&OsStr> = p.split('/').map(OsStr::new).collect();
        unpack::merged_lookup(&layers, &parts, ids)
    };
    let tmp = look("tmp").unwrap().unwrap();
    assert!(tmp.is_dir && tmp.mode == 0o1777 && tmp.uid == 0, "{tmp:?}");
    assert_eq!(
        look("srv").unwrap().unwrap().mode,
        0o700,
        "the highest layer wins"
    );
    assert_eq!(look("gone").unwrap(), None, "whited out");
    assert_eq!(
        look("old/inside").unwrap(),
        None,
        "below an opaque directory"
    );
    assert!(look("old").unwrap().is_some());
    assert_eq!(look("nothing").unwrap(), None);
    assert_eq!(
        look("link/passwd").unwrap_err(),
        "/link",
        "never through a symlink"
    );
}

/// A reader that counts what was read from it.
struct Counted<R> {
    inner: R,
    read: std::rc::Rc<std::cell::Cell<u64>>,
}

impl<R: std::io::Read> std::io::Read for Counted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read.set(self.read.get() + n as u64);
        Ok(n)
    }
}

/// The `tar` crate reads a GNU long name or PAX entry whole into memory before the unpack
/// sees an entry: one of 256 MiB (a gzip of a few hundred KiB in a pulled layer; 20 GiB
/// would end sbxd) is refused from its header, having read no more than a block past it.
#[test]
fn an_extension_entry_is_refused_from_its_header_not_read_into_memory() {
    use std::io::Read;
    let (_dir, store) = store();
    for kind in [EntryType::GNULongName, EntryType::XHeader] {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_path("././@LongLink").unwrap();
        h.set_mode(0o644);
        h.set_size(256 << 20);
        h.set_cksum();
        let read = std::rc::Rc::new(std::cell::Cell::new(0));
        let stream = Counted {
            inner: (&h.as_bytes()[..]).chain(std::io::repeat(b'a').take(256 << 20)),
            read: read.clone(),
        };
        let dest = store.tmp_path("long");
        std::fs::create_dir(&dest).unwrap();
        let layer = unpack::Layer {
            image: "test",
            digest: "sha256:x",
            idmap: IdMap::default(),
            cancel: None,
        };
        let e = unpack::unpack(&layer, stream, &dest, &mut store.limits().budget("t"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("at most 1048576"), "{kind:?}: {e}");
        assert!(read.get() <= 1 << 20, "{kind:?}: read {} bytes", read.get());
        std::fs::remove_dir_all(&dest).unwrap();
    }
}
