//! The oci driver: what a user sees inside a sandbox and in its errors — the command they
//! named, never the driver's init or the runtime (needs root, runc and a static busybox).

mod oci_support;

use std::time::Duration;

use oci_support::{TestEnv, exec};
use sbx_drivers::oci::OciDriver;
use sbx_drivers::{ComputeDriver, pb};
use uuid::Uuid;

async fn create(driver: &OciDriver, name: &str, spec: pb::SandboxSpec) -> Uuid {
    let id = Uuid::new_v4();
    driver
        .create(pb::CreateRequest {
            sandbox_id: id.to_string(),
            workspace: "ws".into(),
            name: name.into(),
            spec: Some(spec),
            generation: 1,
        })
        .await
        .unwrap_or_else(|e| panic!("create {name}: {e}"));
    id
}

/// Waits (bounded, 15 s) until the sandbox is in `state`.
async fn wait_for(driver: &OciDriver, id: Uuid, state: pb::State) -> pb::Snapshot {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let s = driver
            .get(pb::GetRequest {
                sandbox_id: id.to_string(),
            })
            .await
            .unwrap();
        if s.state == state as i32 {
            return s;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "sandbox {id} not {state:?} in time: {s:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `runc exec` of a missing command would exit 255 with the runtime's own message; the user
/// gets 127 and `command not found: NAME`. A main process not found ends in Error naming it.
#[tokio::test]
async fn a_command_not_found_is_told_by_its_name() {
    let env = TestEnv::new();
    let driver = env.open().await;
    let id = create(&driver, "finder", env.spec(&["sleep", "3600"])).await;
    let (code, _, err) = exec(&driver, &id.to_string(), &["nosuchcmd", "arg"]).await;
    assert_eq!(code, 127, "{err}");
    assert_eq!(err.trim(), "command not found: nosuchcmd");
    // Arguments still reach a command that is found, unchanged.
    let (code, out, err) = exec(&driver, &id.to_string(), &["echo", "a  b", "-n"]).await;
    assert_eq!((code, out.as_str()), (0, "a  b -n\n"), "{err}");

    let main = create(&driver, "lost", env.spec(&["nosuchmain"])).await;
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
