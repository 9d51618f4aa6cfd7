//! An exec's user through the actors' `Gateway` API, on the sim driver: checked for its bounds
//! before any driver is asked, then handed to the driver, which says whether the sandbox has
//! that user (the sim's have root alone).

mod common;

use std::time::Duration;

use common::{Env, by_id, wait_phase};
use sbx_actors::{ActorError, ExecOptions};
use sbx_proto::v1::{Phase, exec_output::Chunk};

const T: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exec_user_is_bounded_then_passed_to_the_driver() {
    let env = Env::new().await;
    let gw = env.gw();
    let s = gw
        .create_sandbox(None, "users", common::sleep_spec())
        .await
        .unwrap();
    let sel = by_id(&s);
    wait_phase(gw, &sel, Phase::Ready, T).await;
    let exec = |user: String| {
        let sel = sel.clone();
        async move {
            let opts = ExecOptions {
                user,
                ..Default::default()
            };
            let input = Box::pin(futures::stream::empty());
            let mut out = gw
                .exec_io(&sel, vec!["echo".into(), "ran".into()], opts, input)
                .await?;
            let mut said = Vec::new();
            while let Some(chunk) = futures::StreamExt::next(&mut out).await {
                if let Some(Chunk::Stdout(b)) = chunk?.chunk {
                    said.extend(b);
                }
            }
            Ok::<_, ActorError>(String::from_utf8(said).unwrap())
        }
    };
    // The driver's user: root, by name or id.
    assert_eq!(exec("root".into()).await.unwrap(), "ran\n");
    assert_eq!(exec("0:0".into()).await.unwrap(), "ran\n");
    // One the sandbox does not have: the driver's refusal, naming it, reaches the caller.
    match exec("ghost".into()).await {
        Err(ActorError::Driver(sbx_driver_api::DriverError::InvalidArgument(m))) => {
            assert!(m.contains("ghost"), "{m}")
        }
        other => panic!("{other:?}"),
    }
    // Refused before the driver: a NUL, a newline, over the bound.
    env.world.clear_audit();
    for bad in ["app\0".to_string(), "app\nroot".into(), "u".repeat(257)] {
        match exec(bad.clone()).await {
            Err(ActorError::InvalidArgument(m)) => assert!(m.contains("exec user"), "{m}"),
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    assert!(
        env.world
            .audit()
            .iter()
            .all(|e| e.op != sbx_driver_sim::SimOp::Exec),
        "a refused user reached the driver: {:?}",
        env.world.audit()
    );
    // (The audit does see an exec that reaches the driver.)
    assert_eq!(exec(String::new()).await.unwrap(), "ran\n");
    assert!(
        env.world
            .audit()
            .iter()
            .any(|e| e.op == sbx_driver_sim::SimOp::Exec)
    );
}
