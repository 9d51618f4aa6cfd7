//! The vm driver runs a user's image, end to end through sbxd and the `sbx` CLI: an image
//! built here (an OCI layout with a marker file, Env, WorkingDir and Cmd), pushed with skopeo
//! to a docker-registry on 127.0.0.1 and pulled with `sbx image pull`, boots as the guest's
//! root; the marker is read back, Env and WorkingDir apply; a change under /etc survives a
//! stop and a start and a SIGKILL of sbxd; two VMs of the image do not see each other's
//! changes; delete leaves no VM and no disk.
//!
//! Needs what `vm_e2e.rs` needs, and docker-registry and skopeo (CI installs them).

mod common;
mod vm_support;

use common::{DataDir, sbx};
use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};
use vm_support::{QemuReaper, qemus_under, start_sbxd};

/// busybox, the applets the test uses, a marker, /work (the WorkingDir).
fn layer() -> Vec<u8> {
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static");
    let mut entries = vec![
        TarEntry::dir("bin/"),
        TarEntry::file("bin/busybox", &busybox).mode(0o755),
    ];
    for applet in [
        "sh", "cat", "sleep", "echo", "pwd", "test", "sync", "id", "ls", "mkdir", "rm",
    ] {
        entries.push(TarEntry::symlink(&format!("bin/{applet}"), "busybox"));
    }
    entries.extend([
        TarEntry::dir("etc/"),
        TarEntry::file("etc/marker", b"from-the-pulled-image\n"),
        TarEntry::dir("work/"),
    ]);
    fixtures::tar_bytes(&entries)
}

#[test]
fn a_pulled_image_boots_as_the_vms_root_and_keeps_its_changes_until_delete() {
    vm_support::require_vm_tools();
    if !LocalRegistry::available("a_pulled_image_boots_as_the_vms_root") {
        return;
    }
    let data = DataDir::new();
    let _reaper = QemuReaper(data.path().to_path_buf());
    let work = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(&work.path().join("registry"));
    let layout = work.path().join("layout");
    fixtures::write_oci_layout_with_config(
        &layout,
        &[layer()],
        "v1",
        serde_json::json!({
            "Env": ["PATH=/bin", "GREETING=hello-from-the-image"],
            "WorkingDir": "/work",
            "Cmd": ["sleep", "3600"],
        }),
    );
    let reference = format!("{}/sbx-test/vm-root:v1", registry.addr);
    registry.push(&layout, &reference, &[]);

    let mut d = start_sbxd(data.path(), "vm");
    let ep = d.endpoint();
    let pulled = sbx(&ep, &["image", "pull", &reference]);
    assert_eq!(pulled.code, 0, "{pulled:?}");
    for name in ["va", "vb"] {
        let began = std::time::Instant::now();
        let created = sbx(
            &ep,
            &["sandbox", "create", "-n", name, "--image", &reference],
        );
        assert_eq!(created.code, 0, "{created:?}");
        eprintln!("timing: create→Ready of {name}: {:?}", began.elapsed());
    }
    let exec = |ep: &str, name: &str, script: &str| {
        sbx(ep, &["sandbox", "exec", name, "--", "sh", "-c", script])
    };
    let seen = exec(&ep, "va", "cat /etc/marker; echo $GREETING; pwd");
    assert_eq!(
        seen.ok().lines().collect::<Vec<_>>(),
        ["from-the-pulled-image", "hello-from-the-image", "/work"],
        "{seen:?}"
    );
    exec(&ep, "va", "echo changed-in-va > /etc/changed && sync").ok();
    let other = exec(&ep, "vb", "test -e /etc/changed");
    assert_eq!(other.code, 1, "vb sees va's change: {other:?}");

    sbx(&ep, &["sandbox", "stop", "va"]).ok();
    sbx(&ep, &["sandbox", "start", "va"]).ok();
    let kept = exec(&ep, "va", "cat /etc/changed /etc/marker");
    assert_eq!(
        kept.ok(),
        "changed-in-va\nfrom-the-pulled-image\n",
        "after a stop and a start"
    );

    d.sigkill();
    drop(d);
    let d = start_sbxd(data.path(), "vm");
    let ep = d.endpoint();
    let kept = exec(&ep, "va", "cat /etc/changed");
    assert_eq!(kept.ok(), "changed-in-va\n", "after a SIGKILL of sbxd");
    let other = exec(&ep, "vb", "test -e /etc/changed");
    assert_eq!(other.code, 1, "{other:?}");

    for name in ["va", "vb"] {
        sbx(&ep, &["sandbox", "delete", name]).ok();
    }
    let vms = data.path().join("drivers/vm/vms");
    let left: Vec<_> = std::fs::read_dir(&vms)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "sandbox directories left: {left:?}");
    assert!(
        qemus_under(data.path()).is_empty(),
        "{:?}",
        qemus_under(data.path())
    );
}
