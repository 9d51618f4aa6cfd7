//! Housekeeping of the image store through the real sbxd on the oci driver (needs root, runc,
//! busybox-static): `sbx image rm` of a built image takes the build cache entries only it
//! used (those another image's build used stay); `sbx image prune` removes the build cache
//! left by re-tagged builds, and reports the bytes freed, which the store's blobs on disk
//! lose; `--all` removes every image no sandbox uses but never one a sandbox uses, nor the
//! built-in image.

mod common;

use std::path::Path;

type World = common::DriverWorld;

/// The names of the images of workspace "default" (its own, without the gateway's).
fn own_images(w: &World) -> Vec<String> {
    let list = w.sbx(&["image", "list", "-o", "json"]).json();
    let mut names: Vec<String> = list
        .as_array()
        .expect("a list")
        .iter()
        .filter(|i| i["workspace"] == "default")
        .map(|i| i["name"].as_str().unwrap_or_default().to_string())
        .collect();
    names.sort();
    names
}

fn cache_of(names: &[String]) -> Vec<String> {
    names
        .iter()
        .filter(|n| n.starts_with("sbx.local/build-cache:"))
        .cloned()
        .collect()
}

/// What the image store's blobs take on disk, in bytes.
fn blob_bytes(w: &World) -> u64 {
    let dir = w.data.path().join("images/blobs/sha256");
    std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Builds `dockerfile` as `name`.
fn build(w: &World, dir: &Path, name: &str, dockerfile: &str) {
    std::fs::write(dir.join("Dockerfile"), dockerfile).unwrap();
    let built = w.sbx(&["image", "build", "-t", name, dir.to_str().unwrap()]);
    assert_eq!(built.code, 0, "{built:?}");
}

const BASE: &str = "FROM sbx.local/busybox:latest\nRUN head -c 300000 /dev/urandom > /shared\n";

/// (4) `sbx image rm` of a built image takes its cache entries, but not those another
/// image's build used.
#[test]
fn removing_a_built_image_takes_the_cache_only_it_used() {
    let w = World::new("oci", "prune-rm");
    let ctx = tempfile::tempdir().unwrap();
    build(
        &w,
        ctx.path(),
        "x:v1",
        &format!("{BASE}RUN echo x > /x\nENV WHO=x\n"),
    );
    let after_x = cache_of(&own_images(&w));
    build(&w, ctx.path(), "y:v1", &format!("{BASE}RUN echo y > /y\n"));
    let after_y = cache_of(&own_images(&w));
    // x's build made three entries (two RUNs, the ENV's config); y's took x's first RUN
    // from the cache and made one of its own.
    assert_eq!(after_x.len(), 3, "{after_x:?}");
    let ys_own: Vec<&String> = after_y.iter().filter(|n| !after_x.contains(n)).collect();
    assert_eq!(ys_own.len(), 1, "{after_x:?} {after_y:?}");

    let removed = w.sbx(&["image", "rm", "x:v1"]);
    assert_eq!(removed.code, 0, "{removed:?}");
    let left = cache_of(&own_images(&w));
    // What stays: y's own entry and the one x's first RUN made, which y's build used.
    assert_eq!(left.len(), 2, "x's own cache entries stayed: {left:?}");
    assert!(left.contains(ys_own[0]), "{left:?}");
    assert_eq!(
        left.iter().filter(|n| after_x.contains(n)).count(),
        1,
        "{left:?}"
    );
    // y still builds from its cache, every step.
    std::fs::write(
        ctx.path().join("Dockerfile"),
        format!("{BASE}RUN echo y > /y\n"),
    )
    .unwrap();
    let again = w.sbx(&["image", "build", "-t", "y:v1", ctx.path().to_str().unwrap()]);
    assert_eq!(again.code, 0, "{again:?}");
    assert_eq!(
        again.stderr.matches("(cached)").count(),
        2,
        "{}",
        again.stderr
    );

    let y_removed = w.sbx(&["image", "rm", "y:v1"]);
    assert_eq!(y_removed.code, 0, "{y_removed:?}");
    assert_eq!(cache_of(&own_images(&w)), Vec::<String>::new());
    w.finish();
}

/// (1) A build re-tagged by another leaves its cache behind; after `sbx image rm`, `sbx
/// image prune` removes every `sbx.local/build-cache:*` image, says so, and the bytes it
/// reports leave the store's blobs.
#[test]
fn prune_removes_the_build_cache_and_says_what_it_freed() {
    let w = World::new("oci", "prune-cache");
    let ctx = tempfile::tempdir().unwrap();
    build(
        &w,
        ctx.path(),
        "x:v1",
        &format!("{BASE}RUN echo one > /one\n"),
    );
    // The same name again, from another Dockerfile: the first build's cache is nobody's.
    build(
        &w,
        ctx.path(),
        "x:v1",
        "FROM sbx.local/busybox:latest\nRUN echo two > /two\n",
    );
    let removed = w.sbx(&["image", "rm", "x:v1"]);
    assert_eq!(removed.code, 0, "{removed:?}");
    let orphans = cache_of(&own_images(&w));
    assert!(
        !orphans.is_empty(),
        "the first build's cache is there to prune"
    );
    let before = blob_bytes(&w);

    let pruned = w.sbx(&["image", "prune", "-o", "json"]);
    assert_eq!(pruned.code, 0, "{pruned:?}");
    let answer = pruned.json();
    let freed = answer["bytes_freed"].as_u64().expect("bytes_freed");
    let after = blob_bytes(&w);
    eprintln!(
        "pruned {} cache images, {freed} bytes freed; blobs {before} -> {after}",
        orphans.len()
    );
    assert_eq!(cache_of(&own_images(&w)), Vec::<String>::new());
    let mut names: Vec<String> = answer["removed"]
        .as_array()
        .expect("removed")
        .iter()
        .map(|n| n.as_str().unwrap_or_default().to_string())
        .collect();
    names.sort();
    assert_eq!(names, orphans);
    assert!(
        freed > 300_000,
        "the 300 kB step's layer was freed: {answer}"
    );
    assert!(before - after >= 300_000, "blobs {before} -> {after}");
    // Nothing is left to prune: said so.
    let again = w.sbx(&["image", "prune"]);
    assert_eq!(again.stdout, "removed 0 images, freed 0B\n", "{again:?}");
    w.finish();
}

/// (2) `--all` removes every image no sandbox uses, never one a sandbox uses (nor the cache
/// image that is the same content), nor the built-in image, even when the gateway's own are
/// pruned.
#[test]
fn prune_all_keeps_what_a_sandbox_uses_and_the_built_in_image() {
    let w = World::new("oci", "prune-all");
    let ctx = tempfile::tempdir().unwrap();
    build(
        &w,
        ctx.path(),
        "used:v1",
        "FROM sbx.local/busybox:latest\nRUN echo u > /u\n",
    );
    build(
        &w,
        ctx.path(),
        "loose:v1",
        "FROM sbx.local/busybox:latest\nRUN echo l > /l\n",
    );
    // Another workspace's image and build cache: not "default"'s to prune.
    assert_eq!(w.sbx(&["workspace", "create", "other"]).code, 0);
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN echo o > /o\n",
    )
    .unwrap();
    let theirs = w.sbx(&[
        "image",
        "build",
        "-w",
        "other",
        "-t",
        "theirs:v1",
        ctx.path().to_str().unwrap(),
    ]);
    assert_eq!(theirs.code, 0, "{theirs:?}");
    let other_images = || {
        let list = w
            .sbx(&["image", "list", "-w", "other", "-o", "json"])
            .json();
        list.as_array()
            .expect("a list")
            .iter()
            .filter(|i| i["workspace"] == "other")
            .count()
    };
    let others_before = other_images();
    assert!(others_before >= 2, "the image and its cache");
    let made = w.sbx(&[
        "sandbox", "create", "s1", "--image", "used:v1", "--", "sleep", "3600",
    ]);
    assert_eq!(made.code, 0, "{made:?}");

    let pruned = w.sbx(&["image", "prune", "--all", "-o", "json"]).json();
    let removed: Vec<&str> = pruned["removed"]
        .as_array()
        .expect("removed")
        .iter()
        .filter_map(|n| n.as_str())
        .collect();
    assert!(removed.contains(&"docker.io/library/loose:v1"), "{pruned}");
    assert!(!removed.contains(&"docker.io/library/used:v1"), "{pruned}");
    let left = own_images(&w);
    assert!(
        left.contains(&"docker.io/library/used:v1".to_string()),
        "{left:?}"
    );
    assert!(
        !left.contains(&"docker.io/library/loose:v1".to_string()),
        "{left:?}"
    );
    assert_eq!(
        other_images(),
        others_before,
        "another workspace's images went"
    );
    // The sandbox's image runs on.
    let ran = w.sbx(&["sandbox", "exec", "s1", "--", "cat", "/u"]);
    assert_eq!(ran.stdout, "u\n", "{ran:?}");

    // The gateway's own, with no sandbox at all: the built-in image stays.
    assert_eq!(w.sbx(&["sandbox", "delete", "s1"]).code, 0);
    let gateway = w
        .sbx(&["image", "prune", "--gateway", "--all", "-o", "json"])
        .json();
    assert_eq!(gateway["removed"], serde_json::json!([]), "{gateway}");
    let builtin = w.sbx(&["image", "get", "sbx.local/busybox:latest"]);
    assert_eq!(builtin.code, 0, "{builtin:?}");
    let fresh = w.sbx(&["run", "--rm", "--", "echo", "still here"]);
    assert_eq!(fresh.stdout, "still here\n", "{fresh:?}");
    w.finish();
}
