//! Process driver: what a user sees inside a sandbox and in its errors — the command they
//! named, never the driver's wrappers (needs root).

mod process_support;

use std::time::Duration;

use process_support::*;
use sbx_drivers::{ComputeDriver, pb};
use uuid::Uuid;

const SETTLE: Duration = Duration::from_secs(15);

/// An exec of a missing command answers 127 and names the command; a main process that is
/// not found ends the sandbox in Error with a message that names it too.
#[tokio::test]
async fn a_command_not_found_is_told_by_its_name() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "finder", spec(&["sleep", "1000"]), 1))
        .await
        .unwrap();
    let missing = exec(&driver, id, &["nosuchcmd", "arg"], 0).await;
    assert_eq!(missing.exit.map(|e| e.code), Some(127), "{missing:?}");
    assert_eq!(
        missing.stderr.trim(),
        "command not found: nosuchcmd",
        "{missing:?}"
    );

    let main = Uuid::new_v4();
    driver
        .create(create_req(main, "lost", spec(&["nosuchmain"]), 1))
        .await
        .unwrap();
    let ended = wait_for_state(&driver, main, pb::State::Exited, SETTLE).await;
    assert_eq!(
        (ended.exit_code, ended.reason.as_str()),
        (127, "Error"),
        "{ended:?}"
    );
    assert!(
        ended.message.starts_with("command not found: nosuchmain"),
        "{ended:?}"
    );
    // A command that itself exits 127 is not taken for a missing one.
    let own = Uuid::new_v4();
    driver
        .create(create_req(own, "own", spec(&["sh", "-c", "exit 127"]), 1))
        .await
        .unwrap();
    let ended = wait_for_state(&driver, own, pb::State::Exited, SETTLE).await;
    assert_eq!(ended.exit_code, 127, "{ended:?}");
    assert!(!ended.message.contains("not found"), "{ended:?}");
    drop(driver);
    env.finish().await;
}
