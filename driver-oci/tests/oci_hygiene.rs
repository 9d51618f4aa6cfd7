//! The oci driver: what a user sees inside a sandbox and in its errors — the command they
//! named, never the driver's init or the runtime (needs root, runc and a static busybox).

mod oci_support;

use oci_support::{TestEnv, create, exec, wait_for};
use sbx_driver_api::pb;

/// `runc exec` of a missing command would exit 255 with the runtime's own message; the user
/// gets 127 and `command not found: NAME`. A main process not found ends in Error naming it.
#[tokio::test]
async fn a_command_not_found_is_told_by_its_name() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "finder", env.spec(&["sleep", "3600"])).await;
    let (code, _, err) = exec(&driver, &id.to_string(), &["nosuchcmd", "arg"]).await;
    assert_eq!(code, 127, "{err}");
    assert_eq!(err.trim(), "command not found: nosuchcmd");
    // Arguments still reach a command that is found, unchanged.
    let (code, out, err) = exec(&driver, &id.to_string(), &["echo", "a  b", "-n"]).await;
    assert_eq!((code, out.as_str()), (0, "a  b -n\n"), "{err}");

    let (main, made) = create(&driver, &env, "lost", env.spec(&["nosuchmain"])).await;
    // The create's own answer is the end: the start waited for the init to look.
    assert_eq!(
        (made.state(), made.exit_code, made.reason.as_str()),
        (pb::State::Exited, 127, "CommandNotFound"),
        "{made:?}"
    );
    let ended = wait_for(&driver, main, pb::State::Exited).await;
    assert_eq!(
        (ended.exit_code, ended.reason.as_str()),
        (127, "CommandNotFound"),
        "{ended:?}"
    );
    assert!(
        ended.message.starts_with("command not found: nosuchmain"),
        "{ended:?}"
    );
    drop(driver);
    env.finish().await;
}

/// Inside, `/etc/hostname` names the sandbox, as `hostname` does (the image's file would name
/// the machine it was built on), and the environment is the fixed base plus the spec's.
#[tokio::test]
async fn hostname_file_and_environment_are_the_sandboxes() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let (id, _) = create(&driver, &env, "named-box", env.spec(&["sleep", "3600"])).await;
    let sid = id.to_string();
    let (_, file, _) = exec(&driver, &sid, &["cat", "/etc/hostname"]).await;
    let (_, name, _) = exec(&driver, &sid, &["hostname"]).await;
    assert_eq!(
        (file.as_str(), name.as_str()),
        ("named-box\n", "named-box\n")
    );
    let (_, shown, _) = exec(&driver, &sid, &["env"]).await;
    let mut keys: Vec<&str> = shown
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .filter(|k| !["PWD", "OLDPWD", "SHLVL", "_"].contains(k))
        .collect();
    keys.sort();
    // HOME, USER and LOGNAME: the exec's user's (root's here).
    assert_eq!(
        keys,
        ["HOME", "HOSTNAME", "LOGNAME", "PATH", "USER"],
        "{shown}"
    );
    drop(driver);
    env.finish().await;
}
