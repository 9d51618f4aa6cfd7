//! The README's "A 60-second tour", run as pasted: the ```sh block after that heading is
//! extracted from README.md, only what a test must change is rewritten (its data dir and
//! address file under a temp dir (sbxd serves on its Unix socket there), PATH to the binaries this test was
//! built with; the `cargo build` line is left out: cargo built them), and it runs under
//! `bash -euo pipefail` on the default driver (oci: needs root, runc, busybox-static) within
//! [`TOUR_LIMIT`]. The script runs in its own process group, which is killed whole however
//! the test ends, so no sbxd or watch of it outlives the test; its sandboxes are removed by
//! the data dir's guard. So the README cannot drift from what sbx does.
//!
//! The README's vm install lines are checked against `.ci/run`'s order too.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{DataDir, SBX, oci_containers, readme, sh_block_after};

/// How long the whole tour may take (it is a 60-second tour; a debug build is slower).
const TOUR_LIMIT: Duration = Duration::from_secs(120);

const HEADING: &str = "## A 60-second tour";

/// Rewrites the tour for the test: drops `cargo build`, points PATH at `bin_dir`, moves the
/// data dir and address file under `tmp` (sbxd's Unix socket is in the data dir). Panics when the tour no
/// longer has what is rewritten (so a changed tour is looked at, not run half-rewritten).
fn rewrite(tour: &str, bin_dir: &Path, tmp: &Path) -> String {
    let mut lines = Vec::new();
    let mut saw = (false, false);
    for line in tour.lines() {
        if line.starts_with("cargo build") {
            saw.0 = true;
            continue;
        }
        if line.starts_with("export PATH=") {
            saw.1 = true;
            lines.push(format!("export PATH={}:$PATH", bin_dir.display()));
            continue;
        }
        lines.push(line.to_string());
    }
    assert!(
        saw.0 && saw.1,
        "the tour lost its cargo build or PATH line:\n{tour}"
    );
    let script = lines.join("\n") + "\n";
    assert!(script.contains("/tmp/sbx-tour.addr") && script.contains("sbxd serve "));
    let script = script
        .replace(
            "/tmp/sbx-tour.addr",
            &tmp.join("addr").display().to_string(),
        )
        .replace("/tmp/sbx-tour", &tmp.join("data").display().to_string());
    assert!(!script.contains("/tmp/sbx-tour"), "{script}");
    script
}

#[test]
fn the_tour_runs_as_pasted() {
    let tour = sh_block_after(&readme(), HEADING);
    assert!(
        !tour.contains("image pull"),
        "the tour must not need a registry"
    );
    let tmp = DataDir::new();
    // `SBX_TOUR_BIN_DIR`: the binaries to tour with (scripts/package-check: the installed
    // package's, /usr/bin); else those this test was built with.
    let built = Path::new(SBX).parent().unwrap().to_path_buf();
    let bin_dir = std::env::var_os("SBX_TOUR_BIN_DIR").map_or(built, std::path::PathBuf::from);
    let bin_dir = bin_dir.as_path();
    let script = rewrite(&tour, bin_dir, tmp.path());
    let script_path = tmp.path().join("tour.sh");
    std::fs::write(&script_path, &script).unwrap();
    let run = common::run_script(&script_path, tmp.path(), &[], TOUR_LIMIT);
    let (out, err, took) = (run.out, run.err, run.took);
    let report = format!("script:\n{script}\nstdout:\n{out}\nstderr:\n{err}");
    let status = run.status;
    let status = status.unwrap_or_else(|| panic!("the tour ran over {TOUR_LIMIT:?}\n{report}"));
    assert!(status.success(), "the tour failed: {status}\n{report}");
    // What the tour's comments say happens.
    assert!(
        out.contains("hello"),
        "logs show the workload's output\n{report}"
    );
    assert!(
        out.contains("kept"),
        "the note survived the restart\n{report}"
    );
    assert!(
        out.contains("hi\nexit 7\n"),
        "sbx run prints the job's output and exits with its code\n{report}"
    );
    assert!(
        out.contains("sbx.local/busybox"),
        "the built-in image is listed\n{report}"
    );
    assert!(
        out.contains("as user in /home/user\n"),
        "exec -u runs as that user, in its home\n{report}"
    );
    // `0 <first> 65536`: a range of the sandbox's own from the default uid pool.
    let mapped = out.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() == 3
            && f[0] == "0"
            && f[2] == "65536"
            && f[1].parse::<u32>().is_ok_and(|u| u >= 1_000_000)
    });
    assert!(mapped, "root inside maps to a range of its own\n{report}");
    assert!(
        err.contains("IMAGE_IN_USE"),
        "removing the pinned image is refused\n{report}"
    );
    assert!(
        !err.contains("sbx::audit") && !out.contains("sbx::audit"),
        "sbxd's log goes to its file, not between the tour's lines\n{report}"
    );
    assert!(
        oci_containers(&tmp.path().join("data")).is_empty(),
        "the tour's cascade delete leaves no container\n{report}"
    );
    eprintln!("the tour took {took:?}");
}

#[test]
fn the_rewrite_touches_only_what_a_test_must() {
    let tour = "cargo build --release -p sbx-gateway\nexport PATH=$PWD/target/release:$PATH\n\
                sbxd serve --data-dir /tmp/sbx-tour --addr-file /tmp/sbx-tour.addr &\n\
                sbx workspace create demo\n";
    let script = rewrite(tour, Path::new("/b"), Path::new("/t"));
    assert_eq!(
        script,
        "export PATH=/b:$PATH\n\
         sbxd serve --data-dir /t/data --addr-file /t/addr &\n\
         sbx workspace create demo\n"
    );
}

/// The README's vm install installs qemu-utils in a command of its own, after the rest, as
/// `.ci/run` does.
#[test]
fn the_vm_install_lines_follow_ci() {
    let text = readme();
    let installs: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("apt-get install") && l.contains("qemu"))
        .collect();
    assert_eq!(installs.len(), 2, "{installs:?}");
    assert!(
        installs[0].contains("qemu-system-x86") && !installs[0].contains("qemu-utils"),
        "{installs:?}"
    );
    assert!(installs[1].ends_with(" qemu-utils"), "{installs:?}");
    for package in [
        "linux-image-amd64",
        "busybox-static",
        "e2fsprogs",
        "xz-utils",
    ] {
        assert!(installs[0].contains(package), "{package} in {installs:?}");
    }
    let ci =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../.ci/run")).unwrap();
    let system = ci.find("qemu-system-x86").expect(".ci/run installs qemu");
    let utils = ci.find("install -y -qq --no-install-recommends qemu-utils");
    assert!(
        utils.is_some_and(|u| u > system),
        ".ci/run installs qemu-utils on its own, after qemu-system-x86"
    );
}
