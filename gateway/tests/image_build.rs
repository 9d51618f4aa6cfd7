//! `sbx image build` through the real sbxd on the oci driver (needs root, runc,
//! busybox-static): a Dockerfile with FROM, ARG, ENV, WORKDIR, COPY, RUN, USER and CMD builds;
//! a sandbox from the result shows each; a second build of the same input runs nothing (every
//! RUN and COPY answered from the cache, the same digest); a change to a copied file re-runs
//! from that step; a RUN has no network but loopback without `--allow`; a failing RUN fails
//! the build naming its line and code; no build leaves a sandbox behind. An image the store
//! lacks is pulled by a create, a run and a build's FROM (`--pull never|missing|always`).

mod common;

use std::path::Path;

use sbx_drivers::image::fixtures::{self, LocalRegistry, TarEntry};

type World = common::DriverWorld;

const DOCKERFILE: &str = r#"# a small application image
FROM sbx.local/busybox:latest
ARG GREETING=hello
ENV APP_HOME=/srv/app MODE=test
WORKDIR $APP_HOME
COPY app.sh ./
COPY data/ ./data/
RUN echo "$GREETING from run" > built.txt \
    && chmod 755 app.sh && touch gone \
    && mkdir -p /home/user && chown 1000:1000 /home/user
RUN rm gone && ls /sys/class/net > /netifs
RUN ln -s /etc/shadow shadow-link && mkfifo pipe && ln built.txt hard-link && mkdir -p deep/a/b && ln -s / deep/a/b/root
USER 1000
RUN id -u > /home/user/uid.txt
LABEL org.example.team="tools" version=1
EXPOSE 8080
CMD ["sh", "-c", "cat /srv/app/built.txt"]
"#;

fn context(dir: &Path, app: &str) {
    std::fs::create_dir_all(dir.join("data/nested")).unwrap();
    std::fs::write(dir.join("Dockerfile"), DOCKERFILE).unwrap();
    std::fs::write(dir.join("app.sh"), app).unwrap();
    std::fs::write(dir.join("data/nested/x.txt"), "nested data\n").unwrap();
}

/// The step lines of a build's stderr.
fn steps(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("step ")).collect()
}

fn exec(w: &World, sandbox: &str, script: &str) -> String {
    let out = w.sbx(&["sandbox", "exec", sandbox, "--", "sh", "-c", script]);
    assert_eq!(out.code, 0, "{script}: {out:?}");
    out.stdout.trim().to_string()
}

#[test]
fn a_dockerfile_builds_runs_and_rebuilds_from_the_cache() {
    let w = World::new("oci", "build");
    let ctx = tempfile::tempdir().unwrap();
    context(ctx.path(), "#!/bin/sh\necho app v1\n");
    let dir = ctx.path().to_str().unwrap();

    let first = w.sbx(&["image", "build", "-t", "app:v1", dir, "-o", "json"]);
    assert_eq!(first.code, 0, "{first:?}");
    let image = first.json();
    let lines = steps(&first.stderr);
    assert_eq!(lines.len(), 14, "{}", first.stderr);
    assert!(
        lines.iter().all(|l| !l.ends_with("(cached)")),
        "nothing is cached the first time: {lines:#?}"
    );
    assert!(
        lines[6].starts_with("step 7/14: RUN echo \"$GREETING from run\" > built.txt && chmod"),
        "{lines:#?}"
    );
    assert_eq!(image["name"], "docker.io/library/app:v1", "{image}");

    // The result shows every instruction.
    let made = w.sbx(&[
        "sandbox", "create", "s1", "--image", "app:v1", "--", "sleep", "3600",
    ]);
    assert_eq!(made.code, 0, "{made:?}");
    assert_eq!(exec(&w, "s1", "pwd"), "/srv/app", "WORKDIR");
    assert_eq!(
        exec(&w, "s1", "echo $MODE $APP_HOME"),
        "test /srv/app",
        "ENV"
    );
    assert_eq!(exec(&w, "s1", "id -u"), "1000", "USER");
    assert_eq!(
        exec(&w, "s1", "cat built.txt"),
        "hello from run",
        "RUN with ARG"
    );
    assert_eq!(
        exec(&w, "s1", "./app.sh"),
        "app v1",
        "COPY, then RUN's chmod"
    );
    assert_eq!(
        exec(&w, "s1", "cat data/nested/x.txt"),
        "nested data",
        "COPY of a dir"
    );
    assert_eq!(
        exec(&w, "s1", "stat -c '%u %a' app.sh data /home/user"),
        "0 755\n0 755\n1000 755",
        "owners: COPY root's, RUN's chown kept"
    );
    assert_eq!(
        exec(
            &w,
            "s1",
            "cat /home/user/uid.txt; stat -c %u /home/user/uid.txt"
        ),
        "1000\n1000",
        "a RUN after USER runs as that user, its files are its"
    );
    assert_eq!(
        exec(&w, "s1", "test -e gone && echo there || echo removed"),
        "removed",
        "a file a later RUN removed is gone (a whiteout)"
    );
    assert_eq!(
        exec(&w, "s1", "cat /netifs"),
        "lo",
        "a RUN without --allow has loopback only"
    );
    // What a RUN planted for the host's reader of its changes came through as what it is:
    // links as links (never followed to the host's files), a FIFO as a FIFO (never opened:
    // the build did not hang), a hard link as a second name of the same file.
    assert_eq!(
        exec(
            &w,
            "s1",
            "readlink shadow-link; readlink deep/a/b/root; test -p pipe && echo fifo; stat -c %h hard-link; cat hard-link"
        ),
        "/etc/shadow\n/\nfifo\n2\nhello from run",
        "planted entries are kept as they are"
    );
    let got = w.sbx(&["image", "get", "app:v1", "-o", "json"]).json();
    assert_eq!(got["cmd"][2], "cat /srv/app/built.txt", "{got}");
    assert_eq!(got["user"], "1000", "{got}");
    assert_eq!(got["exposed_ports"][0], "8080/tcp", "{got}");
    assert_eq!(got["labels"]["org.example.team"], "tools", "{got}");
    assert_eq!(got["labels"]["version"], "1", "{got}");
    // CMD: the image runs as built.
    let ran = w.sbx(&["run", "--rm", "app:v1"]);
    assert_eq!(
        (ran.code, ran.stdout.as_str()),
        (0, "hello from run\n"),
        "{ran:?}"
    );

    // The same input again: every step from the cache, the same image.
    let again = w.sbx(&["image", "build", "-t", "app:v1", dir, "-o", "json"]);
    assert_eq!(again.code, 0, "{again:?}");
    for l in steps(&again.stderr) {
        if l.contains(": RUN ") || l.contains(": COPY ") {
            assert!(l.ends_with("(cached)"), "{l}: {}", again.stderr);
        }
    }
    assert_eq!(again.json()["digest"], image["digest"]);

    // A changed file: it and every step after it run again.
    std::fs::write(ctx.path().join("app.sh"), "#!/bin/sh\necho app v2\n").unwrap();
    let changed = w.sbx(&["image", "build", "-t", "app:v2", dir, "-o", "json"]);
    assert_eq!(changed.code, 0, "{changed:?}");
    let lines = steps(&changed.stderr);
    assert!(
        !lines[4].ends_with("(cached)"),
        "COPY app.sh runs: {lines:#?}"
    );
    assert!(
        !lines[5].ends_with("(cached)"),
        "after a change nothing is taken from the cache: {lines:#?}"
    );
    assert!(
        !lines[6].ends_with("(cached)"),
        "the RUN after it runs: {lines:#?}"
    );
    assert_ne!(changed.json()["digest"], image["digest"]);
    let ran = w.sbx(&["run", "--rm", "app:v2", "--", "./app.sh"]);
    assert_eq!(ran.stdout, "app v2\n", "{ran:?}");
    w.sbx(&["sandbox", "delete", "s1"]).ok();

    // A failing RUN fails the build, naming its line and its code; nothing is left.
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN echo before\nRUN echo failing >&2; exit 3\n",
    )
    .unwrap();
    let failed = w.sbx(&["image", "build", "-t", "bad:v1", dir]);
    assert_ne!(failed.code, 0, "{failed:?}");
    assert!(
        failed.stderr.contains("RUN at line 3 exited with code 3"),
        "{failed:?}"
    );
    assert!(
        failed.stderr.contains("failing"),
        "its output is shown: {failed:?}"
    );
    let left = w.sbx(&["sandbox", "list", "-o", "json"]).json();
    assert_eq!(left, serde_json::json!([]), "no build sandbox is left");
    let missing = w.sbx(&["image", "get", "bad:v1"]);
    assert_ne!(missing.code, 0, "a failed build names no image");

    // What the builder does not do is refused by line, before anything runs.
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nADD https://example.test/x /x\n",
    )
    .unwrap();
    let refused = w.sbx(&["image", "build", dir]);
    assert_ne!(refused.code, 0);
    assert!(refused.stderr.contains("line 2: ADD https"), "{refused:?}");
    w.finish();
}

/// An image with busybox and `/etc/marker`, as an OCI layout pushed to a loopback registry.
fn pushed_image(registry: &LocalRegistry, dir: &Path, marker: &str, reference: &str) {
    let busybox = std::fs::read("/bin/busybox").expect("busybox-static");
    let layer = fixtures::tar_bytes(&[
        TarEntry::dir("bin/"),
        TarEntry::file("bin/busybox", &busybox).mode(0o755),
        TarEntry::symlink("bin/sh", "busybox"),
        TarEntry::symlink("bin/cat", "busybox"),
        TarEntry::symlink("bin/sleep", "busybox"),
        TarEntry::dir("etc/"),
        TarEntry::file("etc/marker", marker.as_bytes()),
    ]);
    fixtures::write_oci_layout(dir, &[layer], "v1");
    registry.push(dir, reference, &[]);
}

#[test]
fn an_image_missing_from_the_store_is_pulled_by_create_run_and_build() {
    if !LocalRegistry::available(
        "an_image_missing_from_the_store_is_pulled_by_create_run_and_build",
    ) {
        return;
    }
    let w = World::new("oci", "pull");
    let work = tempfile::tempdir().unwrap();
    let registry = LocalRegistry::start(&work.path().join("registry"));
    let reference = format!("{}/sbx-test/pulled:v1", registry.addr);
    pushed_image(&registry, &work.path().join("v1"), "one\n", &reference);

    // --pull never: the store lacks it, the create fails and says how to get it.
    let never = w.sbx(&[
        "sandbox", "create", "a", "--image", &reference, "--pull", "never", "--", "sleep", "60",
    ]);
    assert_ne!(never.code, 0, "{never:?}");
    assert!(never.stderr.contains("IMAGE_NOT_FOUND"), "{never:?}");
    assert!(!never.stderr.contains("pulling"), "{never:?}");

    // The default (missing): pulled, with progress, then created.
    let made = w.sbx(&[
        "sandbox", "create", "a", "--image", &reference, "--", "sleep", "60",
    ]);
    assert_eq!(made.code, 0, "{made:?}");
    assert!(
        made.stderr
            .contains("is not in the gateway's store: pulling it"),
        "{made:?}"
    );
    assert!(made.stderr.contains("pulled "), "{made:?}");
    assert_eq!(exec(&w, "a", "cat /etc/marker"), "one");
    // Now it is there: no pull.
    let again = w.sbx(&[
        "run",
        "--rm",
        "--image",
        &reference,
        "--",
        "cat",
        "/etc/marker",
    ]);
    assert_eq!(
        (again.code, again.stdout.as_str()),
        (0, "one\n"),
        "{again:?}"
    );
    assert!(!again.stderr.contains("pulling"), "{again:?}");

    // The tag moves in the registry: missing keeps the store's, always takes the new one.
    pushed_image(&registry, &work.path().join("v2"), "two\n", &reference);
    let kept = w.sbx(&[
        "run",
        "--rm",
        "--image",
        &reference,
        "--",
        "cat",
        "/etc/marker",
    ]);
    assert_eq!(kept.stdout, "one\n", "{kept:?}");
    let fresh = w.sbx(&[
        "run",
        "--rm",
        "--pull",
        "always",
        "--image",
        &reference,
        "--",
        "cat",
        "/etc/marker",
    ]);
    assert_eq!(
        (fresh.code, fresh.stdout.as_str()),
        (0, "two\n"),
        "{fresh:?}"
    );

    // A build FROM an image the store lacks pulls it too.
    let other = format!("{}/sbx-test/base:v1", registry.addr);
    pushed_image(&registry, &work.path().join("base"), "base\n", &other);
    let ctx = work.path().join("ctx");
    std::fs::create_dir_all(&ctx).unwrap();
    std::fs::write(
        ctx.join("Dockerfile"),
        format!("FROM {other}\nRUN cat /etc/marker > /copied\n"),
    )
    .unwrap();
    let built = w.sbx(&[
        "image",
        "build",
        "-t",
        "from-pulled:v1",
        ctx.to_str().unwrap(),
    ]);
    assert_eq!(built.code, 0, "{built:?}");
    assert!(
        built
            .stderr
            .contains("is not in the image store: pulling it"),
        "{built:?}"
    );
    let ran = w.sbx(&[
        "run",
        "--rm",
        "--image",
        "from-pulled:v1",
        "--",
        "cat",
        "/copied",
    ]);
    assert_eq!(ran.stdout, "base\n", "{ran:?}");
    w.sbx(&["sandbox", "delete", "a"]).ok();
    w.finish();
}

/// The README's `sbx image build` example, run as pasted against this test's sbxd (`sbx` is
/// the binary under test, on PATH by a function; nothing else is rewritten).
#[test]
fn the_readme_build_example_runs_as_pasted() {
    let w = World::new("oci", "readme-build");
    let block = common::sh_block_after(&common::readme(), "`sbx image build -t NAME[:TAG]");
    assert!(block.contains("sbx image build -t hello:v1 ."), "{block}");
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("block.sh");
    std::fs::write(
        &script,
        format!("sbx() {{ {:?} \"$@\"; }}\n{block}", common::SBX),
    )
    .unwrap();
    let endpoint = w.sbxd.endpoint();
    let ran = common::run_script(
        &script,
        dir.path(),
        &[("SBX_ENDPOINT", &endpoint)],
        std::time::Duration::from_secs(120),
    );
    assert!(
        ran.status.is_some_and(|s| s.success()),
        "the README's build example failed:\n{}\n{}",
        ran.out,
        ran.err
    );
    assert!(ran.out.contains("hi from the image\n"), "{}", ran.out);
    let builds: Vec<&str> = ran.err.split("step 1/6").collect();
    assert_eq!(builds.len(), 3, "two builds: {}", ran.err);
    assert!(!builds[1].contains("(cached)"), "{}", ran.err);
    assert!(
        builds[2].contains("step 4/6: COPY hello.sh .  (cached)")
            && builds[2].contains("step 5/6: RUN chmod +x hello.sh  (cached)"),
        "{}",
        ran.err
    );
    w.finish();
}

/// The Dockerfile both builders build in [`build_vs_buildah_bud`]: a busybox root from the
/// context, config steps, a COPY and two RUNs.
const BENCH_DOCKERFILE: &str = "FROM scratch\nCOPY rootfs/ /\nENV MODE=bench\nWORKDIR /app\nCOPY app.sh .\n\
     RUN chmod 755 app.sh && echo built > /app/out\n\
     RUN i=0; while [ $i -lt 200 ]; do echo $i > /tmp/f$i; i=$((i+1)); done\n\
     CMD [\"./app.sh\"]\n";

/// Median of `n` timings of `f` (each run must succeed).
fn median_of(n: usize, mut f: impl FnMut() -> std::time::Duration) -> std::time::Duration {
    let mut times: Vec<_> = (0..n).map(|_| f()).collect();
    times.sort();
    times[n / 2]
}

/// `sbx image build` against `buildah bud` (Debian's buildah 1.28, runc, overlay storage, its
/// own root), the same Dockerfile and context (FROM scratch, a busybox root copied in); a
/// fresh build (every step run) and a rebuild with nothing changed (all from the cache),
/// medians of 5. Run by hand (see docs/BENCHMARKS.md):
/// `cargo nextest run -p sbx-gateway --test image_build --run-ignored only --no-capture build_vs_buildah_bud`
#[test]
#[ignore = "a benchmark: run by hand, see docs/BENCHMARKS.md"]
fn build_vs_buildah_bud() {
    use std::process::Command;
    use std::time::Instant;
    assert!(
        fixtures::have("buildah"),
        "needs buildah (apt-get install buildah)"
    );
    let w = World::new("oci", "bench-build");
    let work = tempfile::tempdir().unwrap();
    let ctx = work.path().join("ctx");
    std::fs::create_dir_all(ctx.join("rootfs/bin")).unwrap();
    std::fs::create_dir_all(ctx.join("rootfs/tmp")).unwrap();
    std::fs::copy("/bin/busybox", ctx.join("rootfs/bin/busybox")).expect("busybox-static");
    std::os::unix::fs::symlink("busybox", ctx.join("rootfs/bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", ctx.join("rootfs/bin/cat")).unwrap();
    std::os::unix::fs::symlink("busybox", ctx.join("rootfs/bin/chmod")).unwrap();
    std::fs::write(ctx.join("Dockerfile"), BENCH_DOCKERFILE).unwrap();
    std::fs::write(ctx.join("app.sh"), "#!/bin/sh\ncat /app/out\n").unwrap();
    let ctx_s = ctx.to_str().unwrap();
    let root = work.path().join("buildah-root");
    let runroot = work.path().join("buildah-runroot");
    // buildah's overlay mounts under its root go however the benchmark ends.
    struct Unmount(std::path::PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = Command::new("umount").arg("-R").arg(&self.0).output();
            let _ = Command::new("umount").arg(self.0.join("overlay")).output();
        }
    }
    let _unmount = Unmount(root.clone());
    let buildah = |args: &[&str]| {
        let out = Command::new("buildah")
            .arg("--root")
            .arg(&root)
            .arg("--runroot")
            .arg(&runroot)
            .arg("--storage-driver")
            .arg("overlay")
            .args(args)
            .output()
            .expect("buildah runs");
        assert!(
            out.status.success(),
            "buildah {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };

    let mut round = 0;
    let sbx_fresh = median_of(5, || {
        round += 1;
        let t = Instant::now();
        let tag = format!("bench:s{round}");
        let out = w.sbx(&["image", "build", "--no-cache", "-t", &tag, ctx_s]);
        assert_eq!(out.code, 0, "{out:?}");
        t.elapsed()
    });
    let buildah_fresh = median_of(5, || {
        let t = Instant::now();
        buildah(&[
            "bud",
            "--no-cache",
            "--layers",
            "--tls-verify=false",
            "-t",
            "bench:fresh",
            ctx_s,
        ]);
        t.elapsed()
    });
    let sbx_cached = median_of(5, || {
        let t = Instant::now();
        let out = w.sbx(&["image", "build", "-t", "bench:cached", ctx_s]);
        assert_eq!(out.code, 0, "{out:?}");
        assert!(
            out.stderr.matches("(cached)").count() == 4,
            "{}",
            out.stderr
        );
        t.elapsed()
    });
    let buildah_cached = median_of(5, || {
        let t = Instant::now();
        buildah(&[
            "bud",
            "--layers",
            "--tls-verify=false",
            "-t",
            "bench:cached",
            ctx_s,
        ]);
        t.elapsed()
    });
    // The result runs the same on both: sbx's is checked here.
    let ran = w.sbx(&["run", "--rm", "bench:cached"]);
    assert_eq!(ran.stdout, "built\n", "{ran:?}");
    let ratio = |a: std::time::Duration, b: std::time::Duration| a.as_secs_f64() / b.as_secs_f64();
    println!("fresh build (every step run), median of 5:");
    println!(
        "  sbx image build   {:>8.1} ms",
        sbx_fresh.as_secs_f64() * 1e3
    );
    println!(
        "  buildah bud       {:>8.1} ms",
        buildah_fresh.as_secs_f64() * 1e3
    );
    println!(
        "  sbx / buildah     {:>8.2}",
        ratio(sbx_fresh, buildah_fresh)
    );
    println!("rebuild, nothing changed (every step from the cache), median of 5:");
    println!(
        "  sbx image build   {:>8.1} ms",
        sbx_cached.as_secs_f64() * 1e3
    );
    println!(
        "  buildah bud       {:>8.1} ms",
        buildah_cached.as_secs_f64() * 1e3
    );
    println!(
        "  sbx / buildah     {:>8.2}",
        ratio(sbx_cached, buildah_cached)
    );
    buildah(&["rmi", "--all", "--force"]);
    w.finish();
}

#[test]
fn a_build_whose_caller_goes_away_deletes_its_running_step() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let w = World::new("oci", "build-gone");
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN sleep 600\n",
    )
    .unwrap();
    let mut build = Command::new(common::SBX)
        .args(["image", "build", "-t", "never:v1"])
        .arg(ctx.path())
        .env("SBX_ENDPOINT", w.sbxd.endpoint())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let listed = |w: &World| -> Vec<String> {
        let list = w.sbx(&["sandbox", "list", "-o", "json"]).json();
        list.as_array()
            .unwrap()
            .iter()
            .map(|s| {
                format!(
                    "{} {}",
                    s["name"].as_str().unwrap(),
                    s["phase"].as_str().unwrap()
                )
            })
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !listed(&w)
        .iter()
        .any(|s| s.starts_with("build-") && s.ends_with("Ready"))
    {
        assert!(
            Instant::now() < deadline,
            "the RUN's sandbox never ran: {:?}",
            listed(&w)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Nobody puts anything into a build's step: it becomes an image of the workspace.
    let step = listed(&w)
        .into_iter()
        .find(|s| s.starts_with("build-"))
        .unwrap();
    let step = step.split(' ').next().unwrap().to_string();
    let exec = w.sbx(&["sandbox", "exec", &step, "--", "touch", "/planted"]);
    assert!(
        exec.code != 0
            && exec.stderr.contains("FAILED_PRECONDITION")
            && exec.stderr.contains("runs a step of an image build"),
        "{exec:?}"
    );
    // The caller goes (as a Ctrl-C or a dropped connection would): the step's sandbox goes
    // too, long before its ttl.
    build.kill().unwrap();
    build.wait().unwrap();
    let gone_by = Instant::now() + Duration::from_secs(30);
    while !listed(&w).is_empty() {
        assert!(Instant::now() < gone_by, "left behind: {:?}", listed(&w));
        std::thread::sleep(Duration::from_millis(200));
    }
    let missing = w.sbx(&["image", "get", "never:v1"]);
    assert_ne!(missing.code, 0, "an abandoned build names no image");
    w.finish();
}

#[test]
fn no_cache_never_leaves_a_stale_image_and_docker_semantics_hold() {
    let w = World::new("oci", "build-nocache");
    let ctx = tempfile::tempdir().unwrap();
    let dir = ctx.path().to_str().unwrap();
    // A RUN whose result differs every time, and a config step after it.
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "ARG V=global\nFROM sbx.local/busybox:latest\nARG V\nCOPY f /f\n\
         RUN echo \"$V $(cat /proc/sys/kernel/random/uuid)\" > /stamp\n\
         CMD [\"--flag\"]\nENTRYPOINT [\"echo\"]\nLABEL after=run\n",
    )
    .unwrap();
    std::fs::write(ctx.path().join("f"), "f\n").unwrap();
    let stamp = |tag: &str| {
        let ran = w.sbx(&["run", "--rm", "--image", tag, "--", "cat", "/stamp"]);
        assert_eq!(ran.code, 0, "{ran:?}");
        ran.stdout
    };
    let first = w
        .sbx(&["image", "build", "-t", "s:1", dir, "-o", "json"])
        .json();
    let one = stamp("s:1");
    assert!(
        one.starts_with("global "),
        "an ARG declared again takes the global value: {one}"
    );
    // ENTRYPOINT after a CMD of the same Dockerfile keeps that CMD.
    let ran = w.sbx(&["run", "--rm", "s:1"]);
    assert_eq!(ran.stdout, "--flag\n", "{ran:?}");

    // --no-cache runs the RUN again: the result is the new run's, not the cached one.
    let fresh = w
        .sbx(&[
            "image",
            "build",
            "--no-cache",
            "-t",
            "s:2",
            dir,
            "-o",
            "json",
        ])
        .json();
    assert_ne!(fresh["digest"], first["digest"]);
    let two = stamp("s:2");
    assert_ne!(
        one, two,
        "the image --no-cache answered is the one it built"
    );
    // A build after it takes what --no-cache left, whole.
    let again = w
        .sbx(&["image", "build", "-t", "s:3", dir, "-o", "json"])
        .json();
    assert_eq!(again["digest"], fresh["digest"]);
    assert_eq!(stamp("s:3"), two);

    // A file's time changed, not its bytes (a fresh checkout): still from the cache.
    let f = std::fs::File::options()
        .write(true)
        .open(ctx.path().join("f"))
        .unwrap();
    f.set_modified(std::time::SystemTime::now() + std::time::Duration::from_secs(3600))
        .unwrap();
    let touched = w.sbx(&["image", "build", "-t", "s:4", dir]);
    assert_eq!(touched.code, 0, "{touched:?}");
    assert!(
        touched.stderr.contains("COPY f /f  (cached)")
            && touched.stderr.contains("(cached)\nstep 6/8"),
        "{}",
        touched.stderr
    );
    w.finish();
}

/// A tmpfs mounted on a temp dir, unmounted when dropped (also when the test fails).
struct Tmpfs {
    _dir: tempfile::TempDir,
    path: std::path::PathBuf,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fs");
        std::fs::create_dir(&path).unwrap();
        nix::mount::mount(
            Some("tmpfs"),
            &path,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some(format!("size={size}").as_str()),
        )
        .expect("mount a tmpfs");
        Tmpfs { _dir: dir, path }
    }

    /// Bytes free on it now.
    fn free(&self) -> u64 {
        let st = nix::sys::statvfs::statvfs(&self.path).expect("statvfs");
        st.blocks_available() * st.fragment_size()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// The lowest of `free()` seen every 10 ms until dropped.
struct LowWater {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

impl LowWater {
    fn watch(fs: &Tmpfs) -> LowWater {
        let path = fs.path.clone();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let free = || {
                let st = nix::sys::statvfs::statvfs(&path).expect("statvfs");
                st.blocks_available() * st.fragment_size()
            };
            let mut low = free();
            // Bounded: 120 s of samples at most.
            for _ in 0..12_000 {
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                low = low.min(free());
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            low
        });
        LowWater {
            stop,
            thread: Some(thread),
        }
    }

    fn lowest(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap()
    }
}

impl Drop for LowWater {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A sparse file costs its sandbox nothing; read as a layer, its apparent size is zeros. The
/// step is refused from the entry's header, against the image's size limit (the default,
/// 20 GiB), before a byte of it is written: the store's filesystem (a tmpfs of this test's
/// own, so nothing else moves it) never holds more than a few MiB more than before.
#[test]
fn a_step_that_changes_more_than_the_image_limit_fails_the_build() {
    let fs = Tmpfs::mount("512m");
    let data = common::DataDir {
        dir: tempfile::tempdir_in(&fs.path).unwrap(),
    };
    let parent = format!("sbx-gateway-tests-build-big-{}", common::unique());
    let sbxd = common::Sbxd::start(data.path(), "", &["--oci-cgroup-parent", &parent]);
    let w = World {
        sbxd,
        data,
        cgroup_parent: Some(parent),
    };
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN truncate -s 20G /big\n",
    )
    .unwrap();
    // The base image is in the store before the watch starts.
    w.sbx(&["image", "get", "sbx.local/busybox:latest"]).ok();
    let before = fs.free();
    let low = LowWater::watch(&fs);
    let started = std::time::Instant::now();
    let built = w.sbx(&[
        "image",
        "build",
        "-t",
        "big:1",
        ctx.path().to_str().unwrap(),
    ]);
    let took = started.elapsed();
    let lowest = low.lowest();
    let dropped = before.saturating_sub(lowest);
    eprintln!(
        "refused in {took:?}; the store's filesystem dropped by {dropped} bytes at most; {}",
        built.stderr.trim()
    );
    assert_ne!(built.code, 0, "{built:?}");
    assert!(
        built.stderr.contains("RUN at line 2")
            && built.stderr.contains("/big is 20.0GiB (its apparent size")
            && built.stderr.contains("--image-max-size"),
        "{built:?}"
    );
    assert!(
        dropped < 8 << 20,
        "the store's filesystem dropped by {} MiB meanwhile",
        dropped >> 20
    );
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
    let left = w.sbx(&["sandbox", "list", "-o", "json"]).json();
    assert_eq!(left, serde_json::json!([]));
    let tmp = w.data.path().join("images/tmp");
    let spooled: Vec<_> = std::fs::read_dir(&tmp)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        spooled.is_empty(),
        "nothing of it stays in {}: {spooled:?}",
        tmp.display()
    );
    w.finish();
    drop(fs);
}

/// OCI layers say "deleted" with a name: `.wh.NAME` whites NAME out, `.wh..wh..opq` hides a
/// directory's lower contents. A RUN that makes an entry so named (a file, a directory, a
/// link) would delete or hide the base's files in the result; the build fails instead,
/// naming the path, and no image is made. A real deletion is still a whiteout.
#[test]
fn a_run_that_names_an_entry_like_a_whiteout_fails_the_build_naming_it() {
    let w = World::new("oci", "build-wh");
    let ctx = tempfile::tempdir().unwrap();
    let dir = ctx.path().to_str().unwrap();
    let cases = [
        // Would delete the base's /etc/passwd.
        ("touch /etc/.wh.passwd", "/etc/.wh.passwd"),
        // Would hide every file the base has in /etc.
        ("touch /etc/.wh..wh..opq", "/etc/.wh..wh..opq"),
        // A directory of that name (its contents after it).
        ("mkdir -p /.wh.home/x", "/.wh.home"),
        // A symlink, and a hard link to a file of the step's own.
        ("ln -s passwd /etc/.wh.group", "/etc/.wh.group"),
        ("echo x > /tmp/f && ln /tmp/f /tmp/.wh.f2", "/tmp/.wh.f2"),
    ];
    for (i, (run, path)) in cases.iter().enumerate() {
        std::fs::write(
            ctx.path().join("Dockerfile"),
            format!("FROM sbx.local/busybox:latest\nRUN {run}\n"),
        )
        .unwrap();
        let tag = format!("wh:{i}");
        let built = w.sbx(&["image", "build", "-t", &tag, dir]);
        assert_ne!(built.code, 0, "{run}: the build made an image: {built:?}");
        assert!(
            built.stderr.contains("RUN at line 2") && built.stderr.contains(path),
            "{run}: {built:?}"
        );
        assert_ne!(w.sbx(&["image", "get", &tag]).code, 0, "{run}: no image");
    }
    // A deletion is still a whiteout; what the step did not touch is there.
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN rm /etc/group\n",
    )
    .unwrap();
    let built = w.sbx(&["image", "build", "-t", "wh:ok", dir]);
    assert_eq!(built.code, 0, "{built:?}");
    let ran = w.sbx(&[
        "run",
        "--rm",
        "--image",
        "wh:ok",
        "--",
        "sh",
        "-c",
        "test -e /etc/group && echo group; head -c 5 /etc/passwd",
    ]);
    assert_eq!((ran.code, ran.stdout.as_str()), (0, "root:"), "{ran:?}");
    assert_eq!(
        w.sbx(&["sandbox", "list", "-o", "json"]).json(),
        serde_json::json!([]),
        "no build sandbox is left"
    );
    w.finish();
}

/// The sandbox network of [`a_step_with_network_is_not_the_cached_step_without`], removed
/// from the host however the test ends.
struct NetworkGuard(String);

impl Drop for NetworkGuard {
    fn drop(&mut self) {
        let _ = common::sbxd_command()
            .args(["network", "cleanup", "--network-name", &self.0])
            .output();
        let _ = std::process::Command::new("nft")
            .args(["delete", "table", "inet", &self.0])
            .output();
        let _ = std::process::Command::new("ip")
            .args(["link", "delete", "dev", &format!("{}0", self.0)])
            .output();
        for ns in std::fs::read_dir("/run/netns")
            .into_iter()
            .flatten()
            .flatten()
        {
            let n = ns.file_name().to_string_lossy().into_owned();
            if n.starts_with(&format!("{}-", self.0)) {
                let _ = std::process::Command::new("ip")
                    .args(["netns", "delete", &n])
                    .output();
            }
        }
    }
}

/// A RUN's network allowance is part of its cache key: the same step with and without
/// `--allow` runs twice (what one fetched is never the other's), and an allowance given again
/// in another order or case is the same key.
#[test]
fn a_step_with_network_is_not_the_cached_step_without() {
    let name = format!("nbc{:04x}", std::process::id() & 0xffff);
    let _net = NetworkGuard(name.clone());
    let w = World::with_flags(
        "oci",
        "build-allow",
        &["--network-name", &name, "--network-cidr", "10.253.141.0/24"],
    );
    let ctx = tempfile::tempdir().unwrap();
    let dir = ctx.path().to_str().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        // The interfaces of the step's own network namespace (/proc/net is the reader's).
        "FROM sbx.local/busybox:latest\n\
         RUN sed -n 's/^ *\\([^:]*\\):.*/\\1/p' /proc/net/dev | sort | tr '\\n' ' ' > /netifs\n",
    )
    .unwrap();
    let run_line = |out: &common::CliRun| -> String {
        assert_eq!(out.code, 0, "{out:?}");
        steps(&out.stderr)
            .into_iter()
            .find(|l| l.contains(": RUN "))
            .unwrap_or_else(|| panic!("no RUN step: {}", out.stderr))
            .to_string()
    };
    let netifs = |tag: &str| {
        let ran = w.sbx(&["run", "--rm", "--image", tag, "--", "cat", "/netifs"]);
        assert_eq!(ran.code, 0, "{ran:?}");
        ran.stdout.trim().to_string()
    };
    let none = w.sbx(&["image", "build", "-t", "net:none", dir]);
    assert!(!run_line(&none).ends_with("(cached)"), "{}", none.stderr);
    assert_eq!(netifs("net:none"), "lo");

    let allowed = w.sbx(&[
        "image",
        "build",
        "-t",
        "net:allowed",
        "--allow",
        "pkg.sbx.test:80",
        "--allow",
        "10.253.141.250:443/tcp",
        dir,
    ]);
    assert!(
        !run_line(&allowed).ends_with("(cached)"),
        "the step with network is not the one without: {}",
        allowed.stderr
    );
    assert_eq!(netifs("net:allowed"), "eth0 lo", "it ran with its network");

    // The same allowance, in another order and case: the same step.
    let again = w.sbx(&[
        "image",
        "build",
        "-t",
        "net:again",
        "--allow",
        "10.253.141.250:443/tcp",
        "--allow",
        "PKG.sbx.test:80",
        dir,
    ]);
    assert!(run_line(&again).ends_with("(cached)"), "{}", again.stderr);
    assert_eq!(netifs("net:again"), "eth0 lo");
    // Without: the first build's.
    let without = w.sbx(&["image", "build", "-t", "net:without", dir]);
    assert!(
        run_line(&without).ends_with("(cached)"),
        "{}",
        without.stderr
    );
    assert_eq!(netifs("net:without"), "lo");
    w.finish();
}

/// `sbxd token create` over `w`'s data dir: the token.
fn token(w: &World, name: &str, role: &str, workspaces: &[&str]) -> String {
    let mut command = common::sbxd_command();
    command
        .args(["token", "create", "--data-dir"])
        .arg(w.data.path())
        .args(["--name", name, "--role", role]);
    for ws in workspaces {
        command.args(["--workspace", ws]);
    }
    let made = common::run_bounded(&mut command, "sbxd token create");
    assert_eq!(made.code, 0, "{made:?}");
    made.stdout.lines().last().unwrap_or_default().to_string()
}

fn sbx_as(w: &World, token: &str, args: &[&str]) -> common::CliRun {
    let mut all = vec!["--token", token];
    all.extend_from_slice(args);
    w.sbx(&all)
}

/// The names of the images `token` lists.
fn image_names(w: &World, token: &str, extra: &[&str]) -> Vec<String> {
    let mut args = vec!["image", "list", "-o", "json"];
    args.extend_from_slice(extra);
    let list = sbx_as(w, token, &args).json();
    let mut names: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

/// A revoke 3 s into `RUN sleep 8` ends the build within about a second (the gateway's
/// recheck), deleting the step's sandbox: no image under the build's name, no cache step,
/// no sandbox.
#[test]
fn a_revoke_ends_a_running_build_step_and_nothing_of_it_is_kept() {
    use std::process::{Command, Stdio};
    use std::time::{Duration, Instant};
    let w = World::with_flags("oci", "build-revoke", &["--auth", "token"]);
    let root = token(&w, "root", "admin", &[]);
    let builder = token(&w, "builder", "editor", &[]);
    let before = image_names(&w, &root, &[]);
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN sleep 8 && echo done > /done\n",
    )
    .unwrap();
    let stderr = ctx.path().join("build.err");
    let mut build = Command::new(common::SBX)
        .args(["--token", &builder, "image", "build", "-t", "revoked:v1"])
        .arg(ctx.path())
        .env("SBX_ENDPOINT", w.sbxd.endpoint())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    let running = |w: &World| {
        sbx_as(w, &root, &["sandbox", "list", "-o", "json"])
            .json()
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["name"].as_str().unwrap().starts_with("build-") && s["phase"] == "Ready")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while !running(&w) {
        assert!(Instant::now() < deadline, "the RUN's sandbox never ran");
        std::thread::sleep(Duration::from_millis(100));
    }
    let step_began = Instant::now();
    std::thread::sleep(Duration::from_secs(3));
    let revoked = common::run_bounded(
        common::sbxd_command()
            .args(["token", "revoke", "--data-dir"])
            .arg(w.data.path())
            .arg("builder"),
        "sbxd token revoke",
    );
    assert_eq!(revoked.code, 0, "{revoked:?}");
    let revoked_at = Instant::now();
    let status = common::wait_bounded(&mut build, Duration::from_secs(30), "the build");
    let took = revoked_at.elapsed();
    let said = std::fs::read_to_string(&stderr).unwrap_or_default();
    eprintln!(
        "the build ended {took:?} after the revoke ({:?} into its step): {}",
        step_began.elapsed(),
        said.trim()
    );
    assert!(!status.success(), "a revoked build succeeded: {said}");
    assert!(said.contains("UNAUTHENTICATED"), "{said}");
    assert!(
        took < Duration::from_secs(3),
        "the build went on {took:?} after the revoke"
    );
    assert_eq!(
        image_names(&w, &root, &[]),
        before,
        "the revoked build recorded an image or a cache step"
    );
    let gone_by = Instant::now() + Duration::from_secs(30);
    while !sbx_as(&w, &root, &["sandbox", "list", "-o", "json"])
        .json()
        .as_array()
        .unwrap()
        .is_empty()
    {
        assert!(Instant::now() < gone_by, "the step's sandbox stays");
        std::thread::sleep(Duration::from_millis(200));
    }
    let listed = sbx_as(&w, &root, &["image", "list", "-A", "-o", "json"]);
    assert!(
        !listed.stdout.contains("build-cache") || listed.code != 0,
        "a cache step is recorded somewhere: {listed:?}"
    );
    w.finish_as(&root);
}

/// `sbx.local/*` is the gateway's: a gateway-wide editor can neither tag a build as the
/// default image nor as a cache step whose key it computed offline (the key of the admin's
/// next step, as the attack did); the admin's build runs its own step. A cached step of one
/// workspace is never another's.
#[test]
fn an_editor_can_neither_overwrite_the_gateways_images_nor_poison_a_cached_step() {
    let w = World::with_flags("oci", "build-poison", &["--auth", "token"]);
    let root = token(&w, "root", "admin", &[]);
    let editor = token(&w, "editor", "editor", &[]);
    let busybox = sbx_as(
        &w,
        &root,
        &["image", "get", "sbx.local/busybox:latest", "-o", "json"],
    )
    .json()["digest"]
        .as_str()
        .unwrap()
        .to_string();
    let evil = tempfile::tempdir().unwrap();
    std::fs::write(
        evil.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN echo POISONED-BY-EDITOR > /out\n",
    )
    .unwrap();
    let evil_dir = evil.path().to_str().unwrap();
    let over = sbx_as(
        &w,
        &editor,
        &["image", "build", "-t", "sbx.local/busybox:latest", evil_dir],
    );
    assert_ne!(
        over.code, 0,
        "an editor replaced the default image: {over:?}"
    );
    assert!(over.stderr.contains("sbx.local"), "{over:?}");
    let now = sbx_as(
        &w,
        &root,
        &["image", "get", "sbx.local/busybox:latest", "-o", "json"],
    )
    .json();
    assert_eq!(now["digest"], busybox.as_str(), "{now}");

    // The key of the admin's step as the cache once made it: the base's digest, then the
    // RUN's argv, its ARG environment and its network allowance (none).
    fn key(parts: &[&[u8]]) -> String {
        use sha2::{Digest as _, Sha256};
        let mut h = Sha256::new();
        for p in parts {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p);
        }
        hex::encode(h.finalize())
    }
    let base = key(&[b"sbx-build/1", busybox.as_bytes()]);
    let argv = format!("{:?}", ["/bin/sh", "-c", "echo admin-step > /out"]);
    let step = key(&[
        base.as_bytes(),
        b"RUN",
        argv.as_bytes(),
        b"[]",
        b"allow",
        b"",
    ]);
    let poison = sbx_as(
        &w,
        &editor,
        &[
            "image",
            "build",
            "-t",
            &format!("sbx.local/build-cache:{step}"),
            evil_dir,
        ],
    );
    assert_ne!(poison.code, 0, "an editor wrote a cache step: {poison:?}");
    let ctx = tempfile::tempdir().unwrap();
    std::fs::write(
        ctx.path().join("Dockerfile"),
        "FROM sbx.local/busybox:latest\nRUN echo admin-step > /out\n",
    )
    .unwrap();
    let dir = ctx.path().to_str().unwrap();
    let built = sbx_as(&w, &root, &["image", "build", "-t", "app:v1", dir]);
    assert_eq!(built.code, 0, "{built:?}");
    assert!(!built.stderr.contains("(cached)"), "{}", built.stderr);
    let ran = sbx_as(
        &w,
        &root,
        &["run", "--rm", "--image", "app:v1", "--", "cat", "/out"],
    );
    assert_eq!(ran.stdout, "admin-step\n", "{ran:?}");

    // Workspaces: the same Dockerfile in wa, then wb, runs its step in each; wa again is
    // answered from wa's cache.
    for ws in ["wa", "wb"] {
        sbx_as(&w, &root, &["workspace", "create", ws]).ok();
    }
    let run_step = |ws: &str| -> String {
        let out = sbx_as(&w, &root, &["image", "build", "-w", ws, dir]);
        assert_eq!(out.code, 0, "{out:?}");
        steps(&out.stderr)
            .into_iter()
            .find(|l| l.contains(": RUN "))
            .unwrap_or_else(|| panic!("no RUN step: {}", out.stderr))
            .to_string()
    };
    assert!(!run_step("wa").ends_with("(cached)"));
    let other = run_step("wb");
    assert!(
        !other.ends_with("(cached)"),
        "wb's build took wa's cached step: {other}"
    );
    assert!(run_step("wa").ends_with("(cached)"));
    w.finish_as(&root);
}
