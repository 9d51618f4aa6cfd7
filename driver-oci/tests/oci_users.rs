//! Who an exec runs as on the oci driver (needs root, runc and a static busybox): the
//! request's user (Docker's `exec -u`), else the image's `User`; its ids, groups, HOME and
//! start directory from the sandbox's own /etc/passwd and /etc/group; a user the sandbox does
//! not have refused naming it, before anything runs.

mod oci_support;

use oci_support::{TestEnv, create};
use sbx_driver_api::conformance::exec_as;
use sbx_driver_api::{DriverError, pb};
use sbx_images::{ImageConfig, ImageInfo, fixtures};

/// Adds `app` (uid 1001, group 1001, in `staff` 50, home /home/app) to a running sandbox,
/// as root: the agent looks users up at each exec. (The built-in image has `user`, 1000.)
const ADD_APP: &str = "echo 'app:x:1001:1001::/home/app:/bin/sh' >> /etc/passwd && \
                       printf 'app:x:1001:\\nstaff:x:50:app\\n' >> /etc/group && \
                       mkdir -p /home/app && chown 1001:1001 /home/app";

/// The busybox image with `app` (uid 1000, home /home/app) and `User: 1000`.
fn image_of_user_1000(env: &TestEnv) -> ImageInfo {
    let tar = fixtures::tar_bytes(&[
        fixtures::TarEntry::file(
            "etc/passwd",
            b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n",
        ),
        fixtures::TarEntry::file("etc/group", b"root:x:0:\napp:x:1000:\n"),
        fixtures::TarEntry::dir("home/app").owner(1000, 1000),
    ]);
    let layer = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(layer.path(), tar).unwrap();
    let config = ImageConfig {
        env: vec!["PATH=/usr/sbin:/usr/bin:/sbin:/bin".into()],
        cmd: vec![
            "sh".into(),
            "-c".into(),
            "id -u > /tmp/main; exec sleep 3600".into(),
        ],
        user: "1000".into(),
        ..ImageConfig::default()
    };
    env.images
        .derive(
            "sbx.local/user-1000:1",
            Some(&env.image),
            Some(layer.path()),
            &config,
        )
        .expect("the test image")
}

#[tokio::test]
async fn an_exec_as_a_named_user_has_its_ids_groups_home_and_owns_what_it_writes() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "users", env.spec(&["sleep", "3600"])).await;
    let sid = id.to_string();
    let (code, _, err) = exec_as(&driver, &sid, "", false, ADD_APP).await.unwrap();
    assert_eq!(code, 0, "{err}");

    let report = "id -u; id -g; id -G; echo \"$HOME $USER $LOGNAME\"; pwd; \
                  touch mine; stat -c %U:%G mine";
    let (code, out, err) = exec_as(&driver, &sid, "app", false, report).await.unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out, "1001\n1001\n1001 50\n/home/app app app\n/home/app\napp:app\n",
        "{err}"
    );
    // By uid and gid too, and `nobody` (home /nonexistent: HOME says so, it starts in `/`).
    let (_, out, _) = exec_as(&driver, &sid, "1001:50", false, "id -u; id -g; pwd")
        .await
        .unwrap();
    assert_eq!(out, "1001\n50\n/home/app\n");
    let (_, out, _) = exec_as(&driver, &sid, "nobody", false, "id -u; echo $HOME; pwd")
        .await
        .unwrap();
    assert_eq!(out, "65534\n/nonexistent\n/\n");
    // An unprivileged user cannot write what root owns: it really is that user.
    let (code, _, _) = exec_as(&driver, &sid, "app", false, "touch /etc/app-was-here")
        .await
        .unwrap();
    assert_ne!(code, 0);
    // No user: the image's (none: root), with root's home and directory.
    let (_, out, _) = exec_as(&driver, &sid, "", false, "id -u; echo $HOME; pwd")
        .await
        .unwrap();
    assert_eq!(out, "0\n/root\n/root\n");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn an_image_whose_user_is_1000_runs_its_workload_and_execs_as_1000() {
    let env = TestEnv::new();
    let image = image_of_user_1000(&env);
    let driver = env.open().await;
    let spec = pb::SandboxSpec {
        image: image.digest.clone(),
        ..Default::default()
    };
    let (id, _) = create(&driver, &env, "u1000", spec).await;
    let sid = id.to_string();
    let script = "id -u; echo \"$HOME $USER\"; pwd; touch f; stat -c %u f";
    let (code, out, err) = exec_as(&driver, &sid, "", false, script).await.unwrap();
    assert_eq!(code, 0, "{err}");
    assert_eq!(out, "1000\n/home/app app\n/home/app\n1000\n");
    // The workload too, and root is still there for an exec that asks for it.
    let (_, out, _) = exec_as(&driver, &sid, "", false, "cat /tmp/main")
        .await
        .unwrap();
    assert_eq!(out, "1000\n");
    let (_, out, _) = exec_as(&driver, &sid, "root", false, "id -u; echo $HOME")
        .await
        .unwrap();
    assert_eq!(out, "0\n/root\n");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_user_the_sandbox_does_not_have_is_refused_naming_it() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "ghosts", env.spec(&["sleep", "3600"])).await;
    let sid = id.to_string();
    let marker = "touch /tmp/ran";
    for (user, named) in [
        ("ghost", "\"ghost\""),
        ("root:nogroup-here", "nogroup-here"),
        // Outside the user namespace's map (0–65535): named with the range.
        ("70000", "0–65535"),
    ] {
        match exec_as(&driver, &sid, user, false, marker).await {
            Err(DriverError::InvalidArgument(message)) => {
                assert!(message.contains(named), "{user}: {message}")
            }
            other => panic!("{user}: {other:?}"),
        }
    }
    let (code, _, _) = exec_as(&driver, &sid, "", false, "test ! -e /tmp/ran")
        .await
        .unwrap();
    assert_eq!(code, 0, "a refused exec ran");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_terminal_exec_as_a_user_has_a_working_tty() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "ptys", env.spec(&["sleep", "3600"])).await;
    let sid = id.to_string();
    let (code, _, err) = exec_as(&driver, &sid, "", false, ADD_APP).await.unwrap();
    assert_eq!(code, 0, "{err}");
    // `tty` names it and the terminal answers the user's ioctls; it stays the host's exec
    // instance's (host root, unmapped: `nobody` inside), so no process of the sandbox, the
    // user's own included, opens it by path (see the agent's server docs).
    let (code, out, _) = exec_as(
        &driver,
        &sid,
        "app",
        true,
        "t=$(tty) && echo \"tty=$t\" && stty size && id -u && \
         stat -c 'owner=%U mode=%a' \"$t\" && { (exec 3<\"$t\") 2>/dev/null || echo by-path-refused; }",
    )
    .await
    .unwrap();
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("tty=/dev/.sbx-pts/"), "{out}");
    assert!(
        out.ends_with("24 80\n1001\nowner=nobody mode=600\nby-path-refused\n"),
        "{out}"
    );
    drop(driver);
    env.finish().await;
}
