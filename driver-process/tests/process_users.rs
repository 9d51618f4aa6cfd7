//! Who an exec runs as on the process driver (needs root, unshare/setpriv and the uid map
//! grants): its sandbox's root is an unprivileged host uid and its userland the host's, so
//! `user` names a user of the host's /etc/passwd as seen inside the sandbox's user namespace:
//! only ids the namespace maps (0–65535 by default), others refused naming the range. The
//! agent keeps CAP_SETUID/CAP_SETGID over its own namespace for that, and no exec gets them.

mod process_support;

use process_support::{TestEnv, create_req, spec};
use sbx_driver_api::conformance::exec_as;
use sbx_driver_api::{ComputeDriver, DriverError};
use uuid::Uuid;

async fn sandbox(env: &TestEnv) -> (sbx_driver_process::ProcessDriver, String) {
    let driver = env.open();
    let id = Uuid::new_v4();
    driver
        .create(create_req(id, "users", spec(&["sleep", "3600"]), 1))
        .await
        .unwrap();
    (driver, id.to_string())
}

#[tokio::test]
async fn an_exec_as_a_host_user_inside_the_namespace_has_its_ids_and_home() {
    let env = TestEnv::new();
    let (driver, sid) = sandbox(&env).await;
    let (code, _, err) = exec_as(&driver, &sid, "", false, "mkdir -m 777 /sandbox/shared")
        .await
        .unwrap();
    assert_eq!(code, 0, "{err}");
    // `daemon` (uid 1, home /usr/sbin in Debian's passwd); it starts in the sandbox's
    // directory, /sandbox, as every exec of this driver does.
    let script = "id -u; id -g; echo \"$HOME $USER $LOGNAME\"; pwd; \
                  touch /sandbox/shared/f; stat -c %U /sandbox/shared/f";
    let (code, out, err) = exec_as(&driver, &sid, "daemon", false, script)
        .await
        .unwrap();
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out, "1\n1\n/usr/sbin daemon daemon\n/sandbox\ndaemon\n");
    // No user: root, as before, with the sandbox's HOME (its persistent directory).
    let (_, out, _) = exec_as(&driver, &sid, "", false, "id -u; echo \"$HOME\"; pwd")
        .await
        .unwrap();
    assert_eq!(out, "0\n/sandbox\n/sandbox\n");
    // `nobody`: its passwd home, though it is not there.
    let (_, out, _) = exec_as(&driver, &sid, "nobody", false, "id -u; echo $HOME")
        .await
        .unwrap();
    assert_eq!(out, "65534\n/nonexistent\n");
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn execs_hold_no_capability_though_the_agent_can_switch_users() {
    let env = TestEnv::new();
    let (driver, sid) = sandbox(&env).await;
    // Root's exec, and a user's: nothing effective, permitted or in the bounding set (the
    // agent's CAP_SETUID, CAP_SETGID and CAP_SETPCAP stay the agent's).
    for user in ["", "daemon"] {
        let (code, out, err) = exec_as(
            &driver,
            &sid,
            user,
            false,
            "grep -E '^Cap(Prm|Eff|Bnd|Amb)' /proc/self/status",
        )
        .await
        .unwrap();
        assert_eq!(code, 0, "{err}");
        let sets: Vec<&str> = out.lines().collect();
        assert_eq!(sets.len(), 4, "{out}");
        for set in sets {
            assert!(set.ends_with("0000000000000000"), "{user:?}: {out}");
        }
    }
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_user_outside_the_namespace_or_the_passwd_is_refused_naming_it() {
    let env = TestEnv::new();
    let (driver, sid) = sandbox(&env).await;
    for (user, named) in [
        ("70000", "0–65535"),
        ("no-such-user-here", "no-such-user-here"),
    ] {
        match exec_as(&driver, &sid, user, false, "true").await {
            Err(DriverError::InvalidArgument(message)) => {
                assert!(message.contains(named), "{user}: {message}")
            }
            other => panic!("{user}: {other:?}"),
        }
    }
    drop(driver);
    env.finish().await;
}

#[tokio::test]
async fn a_terminal_exec_as_a_user_has_a_working_tty() {
    let env = TestEnv::new();
    let (driver, sid) = sandbox(&env).await;
    let (code, out, _) = exec_as(&driver, &sid, "daemon", true, "tty && stty size && id -u")
        .await
        .unwrap();
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("/dev/pts/"), "{out}");
    assert!(out.ends_with("24 80\n1\n"), "{out}");
    drop(driver);
    env.finish().await;
}
