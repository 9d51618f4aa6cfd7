//! Errors that lead the way (issue 46, item 4), through the real sbxd and the real `sbx`: a
//! sandbox name one typo away is answered with the names it may have meant; an exec into a
//! stopped sandbox says how to start it; a create of an image the store lacks and no registry
//! gives names the store's images it may have meant (the default driver: needs root, runc
//! and a static busybox).

mod common;

use common::{CgroupParent, DataDir, Sbxd, assert_oci_left_nothing, sbx, unique};

#[test]
fn a_name_typo_is_answered_with_the_names_it_may_have_meant() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &[]);
    let ep = d.endpoint();
    for name in ["web", "worker", "db"] {
        let made = sbx(&ep, &["sandbox", "create", name, "--", "sleep", "1000"]);
        assert_eq!(made.code, 0, "{made:?}");
    }
    let got = sbx(&ep, &["sandbox", "get", "wbe"]);
    assert_ne!(got.code, 0);
    assert!(
        got.stderr
            .contains(r#"sandbox "wbe" in workspace "default" not found (did you mean "web"?)"#),
        "{got:?}"
    );
    let exec = sbx(
        &ep,
        &["sandbox", "exec", "-w", "default", "wroker", "--", "true"],
    );
    assert!(
        exec.stderr.contains(r#"(did you mean "worker"?)"#),
        "{exec:?}"
    );
    // Nothing near: no suggestion.
    let far = sbx(&ep, &["sandbox", "get", "postgres"]);
    assert!(
        far.stderr.contains("not found") && !far.stderr.contains("did you mean"),
        "{far:?}"
    );
    for name in ["web", "worker", "db"] {
        assert_eq!(sbx(&ep, &["sandbox", "delete", name]).code, 0);
    }
}

#[test]
fn an_exec_into_a_stopped_sandbox_says_how_to_start_it() {
    let data = DataDir::new();
    let d = Sbxd::start(data.path(), "process", &[]);
    let ep = d.endpoint();
    assert_eq!(
        sbx(&ep, &["sandbox", "create", "web", "--", "sleep", "1000"]).code,
        0
    );
    assert_eq!(sbx(&ep, &["sandbox", "stop", "web"]).code, 0);
    let exec = sbx(&ep, &["sandbox", "exec", "web", "--", "true"]);
    assert_ne!(exec.code, 0);
    assert!(
        exec.stderr
            .contains("it is Stopped, not Ready; start it first: sbx sandbox start -w default web"),
        "{exec:?}"
    );
    assert_eq!(sbx(&ep, &["sandbox", "start", "web"]).code, 0);
    assert_eq!(sbx(&ep, &["sandbox", "exec", "web", "--", "true"]).code, 0);
    assert_eq!(sbx(&ep, &["sandbox", "delete", "web"]).code, 0);
}

#[test]
fn a_create_of_an_image_the_store_lacks_names_the_images_it_may_have_meant() {
    let data = DataDir::new();
    let parent = CgroupParent(format!("sbx-gateway-tests-first-day-{}", unique()));
    let mut d = Sbxd::start(data.path(), "", &["--oci-cgroup-parent", &parent.0]);
    let ep = d.endpoint();
    // The built-in image is there; one letter off is no image, and no registry has it.
    let made = sbx(
        &ep,
        &[
            "sandbox",
            "create",
            "x",
            "--image",
            "sbx.local/busybx:latest",
            "--",
            "true",
        ],
    );
    assert_ne!(made.code, 0, "{made:?}");
    assert!(
        made.stderr.contains(r#"image "sbx.local/busybx:latest" is not in the gateway's store and could not be pulled"#)
            && made.stderr.contains(r#"(did you mean "sbx.local/busybox:latest"?)"#)
            && made.stderr.contains("`sbx image list` shows what the store has"),
        "{made:?}"
    );
    d.sigterm(std::time::Duration::from_secs(30));
    assert_oci_left_nothing(data.path(), &parent.0);
}
