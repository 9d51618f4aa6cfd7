//! Process driver: what a user sees inside a sandbox and in its errors — the command they
//! named, never the driver's wrappers (needs root).

mod process_support;

use std::time::Duration;

use process_support::*;
use sbx_driver_api::{ComputeDriver, pb};
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
    let made = driver
        .create(create_req(main, "lost", spec(&["nosuchmain"]), 1))
        .await
        .unwrap();
    // The create's own answer is the end: the start waited for the shim to look.
    assert_eq!(
        (made.state(), made.exit_code, made.reason.as_str()),
        (pb::State::Exited, 127, "CommandNotFound"),
        "{made:?}"
    );
    let ended = wait_for_state(&driver, main, pb::State::Exited, SETTLE).await;
    assert_eq!(
        (ended.exit_code, ended.reason.as_str()),
        (127, "CommandNotFound"),
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

/// Inside, the workload sees a fixed environment (none of the driver's variables, a default
/// PATH, the spec's own) and, in `ps`, its own command as the child of pid 1 — pid 1 itself
/// a short command line naming the shim's file, not the shim's script.
#[tokio::test]
async fn the_workload_sees_its_own_environment_and_command() {
    let env = TestEnv::new();
    let driver = env.open();
    let id = Uuid::new_v4();
    let mut with_env = spec(&["sleep", "1000"]);
    with_env.env.insert("MINE".into(), "1".into());
    driver
        .create(create_req(id, "clean", with_env, 1))
        .await
        .unwrap();
    let shown = exec(&driver, id, &["env"], 0).await;
    let mut keys: Vec<&str> = shown
        .stdout
        .lines()
        .filter_map(|l| l.split_once('=').map(|(k, _)| k))
        .filter(|k| !["PWD", "OLDPWD", "SHLVL", "_"].contains(k))
        .collect();
    keys.sort();
    assert_eq!(
        keys,
        ["HOME", "HOSTNAME", "MINE", "PATH", "SBX_SANDBOX_ID"],
        "{shown:?}"
    );
    assert!(
        shown
            .stdout
            .lines()
            .any(|l| l == "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"),
        "{shown:?}"
    );

    // Running is reported once the shim is up; the main process may still be on its way
    // through the jail (unshare, setpriv, the lookup) to its own exec: look again for a while.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let (ps, rows) = loop {
        let ps = exec(&driver, id, &["ps", "-e", "-o", "pid=,ppid=,args="], 0).await;
        let rows: Vec<(u32, u32, String)> = ps
            .stdout
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                let pid = it.next()?.parse().ok()?;
                let ppid = it.next()?.parse().ok()?;
                Some((pid, ppid, it.collect::<Vec<_>>().join(" ")))
            })
            .collect();
        if rows.iter().any(|r| r.1 == 1 && r.2 == "sleep 1000")
            || std::time::Instant::now() >= deadline
        {
            break (ps, rows);
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    let init = rows
        .iter()
        .find(|r| r.0 == 1)
        .unwrap_or_else(|| panic!("pid 1 not listed: {ps:?}"));
    assert!(
        init.2.starts_with("/bin/sh /") && init.2.contains("/sbx-shim "),
        "pid 1 is not the shim's file: {:?}",
        init.2
    );
    assert!(!init.2.contains("jail()"), "{:?}", init.2);
    assert!(
        rows.iter().any(|r| r.1 == 1 && r.2 == "sleep 1000"),
        "the workload is not pid 1's child as itself: {rows:?}"
    );
    drop(driver);
    env.finish().await;
}
