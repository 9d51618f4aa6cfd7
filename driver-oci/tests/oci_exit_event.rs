//! A workload's end reaches the oci driver's watch as an event, not at its next poll (needs
//! root, runc and busybox-static): the feed waits on the run's init by its pidfd, which turns
//! readable the moment it ends. With a poll every 5 s, three workloads that exit 4 after
//! 0.5 s are each seen Exited, code 4, within a second of their end (8-14 ms measured; a poll
//! would see each anywhere in 5 s, all three within a second one time in 125). The bound is
//! loose for a loaded CI machine.

mod oci_support;

use std::time::{Duration, Instant};

use futures::StreamExt;
use oci_support::{TestEnv, create};
use sbx_driver_api::{ComputeDriver, pb};
use sbx_driver_oci::{OciDriver, OciDriverOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workloads_exit_reaches_the_watch_at_once_not_at_the_next_poll() {
    let env = TestEnv::new();
    let options = OciDriverOptions {
        poll_interval: Duration::from_secs(5),
        ..env.options()
    };
    let driver = OciDriver::open(env.state_dir(), env.images.clone(), options)
        .await
        .unwrap();
    let mut events = driver.watch().await.unwrap();
    let mut lates = Vec::new();
    for round in 0..3 {
        let spec = env.spec(&["sh", "-c", "sleep 0.5; exit 4"]);
        let (id, made) = create(&driver, &env, &format!("ends-{round}"), spec).await;
        assert_eq!(made.state(), pb::State::Running, "{made:?}");
        let began = Instant::now();
        let exited = loop {
            let event = tokio::time::timeout(Duration::from_secs(15), events.next())
                .await
                .expect("the exit was not seen within 15 s")
                .expect("the watch ended")
                .unwrap();
            let Some(snapshot) = event.snapshot else {
                continue;
            };
            if snapshot.sandbox_id == id.to_string() && snapshot.state() == pb::State::Exited {
                break snapshot;
            }
        };
        let late = began.elapsed().saturating_sub(Duration::from_millis(500));
        assert_eq!(exited.exit_code, 4, "{exited:?}");
        lates.push(late);
    }
    eprintln!("the exits reached the watch {lates:?} after the workloads' 0.5 s");
    for late in &lates {
        assert!(
            *late < Duration::from_secs(1),
            "an exit reached the watch {late:?} late: {lates:?}"
        );
    }
    drop(events);
    drop(driver);
    env.finish().await;
}
