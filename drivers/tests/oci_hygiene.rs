//! The oci driver: what a user sees inside a sandbox and in its errors — the command they
//! named, never the driver's init or the runtime (needs root, runc and a static busybox).

mod oci_support;

use oci_support::{TestEnv, create, exec, wait_for};
use sbx_drivers::pb;

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

    let (main, _) = create(&driver, &env, "lost", env.spec(&["nosuchmain"])).await;
    let ended = wait_for(&driver, main, pb::State::Exited).await;
    assert_eq!(
        (ended.exit_code, ended.reason.as_str()),
        (127, "Error"),
        "{ended:?}"
    );
    assert!(
        ended.message.starts_with("command not found: nosuchmain"),
        "{ended:?}"
    );
    drop(driver);
    env.finish().await;
}
