//! The driver conformance suite against the sim driver, one test per check, each on a fresh
//! world; then the suite against deliberately broken drivers, to show each check can fail.

#[macro_use]
mod sim_support;

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use futures::FutureExt;
use sbx_drivers::conformance::{self, DriverHarness};
use sbx_drivers::sim::{SimDriver, SimFaults, SimOp, SimWorld};
use sbx_drivers::{ComputeDriver, DriverError, DriverStream, pb};

/// The bugs a [`BrokenDriver`] has, each one a promise of the contract broken.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bug {
    None,
    /// Stop also stops every other sandbox with the same name (resolution by name).
    StopByName,
    /// Start under another generation while running answers Ok (no GenerationMismatch).
    IgnoreGenerationMismatch,
    /// Delete of an absent sandbox fails with NotFound instead of deleted = false.
    DeleteAbsentIsNotFound,
    /// Get with an empty id answers NotFound instead of InvalidArgument.
    EmptyIdIsNotFound,
    /// A new driver instance finds a fresh, empty machine (state lost on restart).
    ForgetOnRestart,
    /// List reports the workspace as empty.
    ListDropsWorkspace,
    /// Exec answers exit code 0 whatever the command did.
    ExecAlwaysZero,
    /// Start of an exited workload answers FailedPrecondition.
    CannotRestartExited,
}

struct SimHarness {
    world: SimWorld,
    bug: Bug,
}

impl SimHarness {
    fn new() -> Self {
        SimHarness {
            world: SimWorld::new(),
            bug: Bug::None,
        }
    }

    fn broken(bug: Bug) -> Self {
        SimHarness {
            world: SimWorld::new(),
            bug,
        }
    }
}

#[async_trait]
impl DriverHarness for SimHarness {
    sim_harness_answers!();

    async fn open(&self) -> Arc<dyn ComputeDriver> {
        let world = if self.bug == Bug::ForgetOnRestart && !self.world.audit().is_empty() {
            SimWorld::new()
        } else {
            self.world.clone()
        };
        let sim = SimDriver::new(world, SimFaults::default());
        if self.bug == Bug::None {
            Arc::new(sim)
        } else {
            Arc::new(BrokenDriver { sim, bug: self.bug })
        }
    }

    async fn kill(&self, driver: Arc<dyn ComputeDriver>) {
        drop(driver);
    }

    fn call_timeout(&self) -> Duration {
        Duration::from_secs(5)
    }
}

sbx_drivers::conformance_suite! {
    #[tokio::test]
    harness: SimHarness::new(),
}

#[tokio::test]
async fn run_all_passes_on_one_shared_world_and_leaves_it_empty() {
    let h = SimHarness::new();
    conformance::run_all(&h).await;
    let leftovers = SimDriver::new(h.world.clone(), SimFaults::default())
        .list()
        .await
        .unwrap();
    assert!(
        leftovers.is_empty(),
        "the suite must delete what it creates: {leftovers:?}"
    );
    assert!(h.world.audit().iter().any(|e| e.op == SimOp::Delete));
}

/// A sim driver with one bug.
struct BrokenDriver {
    sim: SimDriver,
    bug: Bug,
}

#[async_trait]
impl ComputeDriver for BrokenDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        self.sim.capabilities().await
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        self.sim.create(req).await
    }

    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let get = pb::GetRequest {
            sandbox_id: req.sandbox_id.clone(),
        };
        match (self.bug, self.sim.start(req).await) {
            (Bug::IgnoreGenerationMismatch, Err(DriverError::GenerationMismatch { .. })) => {
                self.sim.get(get).await
            }
            (Bug::CannotRestartExited, Ok(s)) if s.generation > 1 => {
                Err(DriverError::FailedPrecondition("exited".into()))
            }
            (_, answer) => answer,
        }
    }

    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let target = self.sim.stop(req).await?;
        if self.bug == Bug::StopByName {
            for other in self.sim.list().await? {
                if other.name == target.name && other.sandbox_id != target.sandbox_id {
                    let stop = pb::StopRequest {
                        sandbox_id: other.sandbox_id,
                        grace_period_ms: 0,
                    };
                    self.sim.stop(stop).await?;
                }
            }
        }
        Ok(target)
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        let sandbox_id = req.sandbox_id.clone();
        let answer = self.sim.delete(req).await?;
        if self.bug == Bug::DeleteAbsentIsNotFound && !answer.deleted {
            return Err(DriverError::NotFound { sandbox_id });
        }
        Ok(answer)
    }

    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        if self.bug == Bug::EmptyIdIsNotFound && req.sandbox_id.is_empty() {
            return Err(DriverError::NotFound {
                sandbox_id: String::new(),
            });
        }
        self.sim.get(req).await
    }

    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        let mut list = self.sim.list().await?;
        if self.bug == Bug::ListDropsWorkspace {
            list.iter_mut().for_each(|s| s.workspace.clear());
        }
        Ok(list)
    }

    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        self.sim.watch().await
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: sbx_drivers::ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        use futures::StreamExt;
        let stream = self.sim.exec_io(req, input).await?;
        if self.bug != Bug::ExecAlwaysZero {
            return Ok(stream);
        }
        Ok(Box::pin(stream.map(|item| {
            item.map(|mut out| {
                if let Some(pb::exec_output::Chunk::Exit(exit)) = &mut out.chunk {
                    exit.code = 0;
                }
                out
            })
        })))
    }

    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        self.sim.logs(req).await
    }
}

fn panic_text(panic: &Box<dyn Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Runs `check` against a driver with `bug`, asserts it fails with a message containing
/// `expected`, and that it still cleaned up.
async fn assert_catches<F>(bug: Bug, check: F, expected: &str)
where
    F: AsyncFnOnce(&SimHarness),
{
    let h = SimHarness::broken(bug);
    let outcome = AssertUnwindSafe(check(&h)).catch_unwind().await;
    let Err(panic) = outcome else {
        panic!("the suite did not notice {bug:?}");
    };
    let text = panic_text(&panic);
    assert!(
        text.contains(expected),
        "{bug:?} failed for another reason: {text}"
    );
    let snapshots = SimDriver::new(h.world.clone(), SimFaults::default())
        .list()
        .await
        .unwrap();
    assert!(
        bug == Bug::ForgetOnRestart || snapshots.is_empty(),
        "a failed check must still clean up: {snapshots:?}"
    );
}

#[tokio::test]
async fn suite_catches_broken_drivers() {
    assert_catches(
        Bug::StopByName,
        async |h| conformance::same_name_in_two_workspaces(h).await,
        "stop of alpha/demo changed another sandbox",
    )
    .await;
    assert_catches(
        Bug::IgnoreGenerationMismatch,
        async |h| conformance::generation_round_trip_and_mismatch(h).await,
        "start under another generation while running",
    )
    .await;
    assert_catches(
        Bug::DeleteAbsentIsNotFound,
        async |h| conformance::idempotent_stop_start_delete(h).await,
        "delete",
    )
    .await;
    assert_catches(
        Bug::EmptyIdIsNotFound,
        async |h| conformance::empty_and_malformed_ids_are_invalid(h).await,
        "get with sandbox id \"\" must be InvalidArgument",
    )
    .await;
    assert_catches(
        Bug::ForgetOnRestart,
        async |h| conformance::workloads_survive_driver_restart(h).await,
        "not found",
    )
    .await;
    assert_catches(
        Bug::ListDropsWorkspace,
        async |h| conformance::list_round_trips_workspace_and_name(h).await,
        "list entry of",
    )
    .await;
    assert_catches(
        Bug::ExecAlwaysZero,
        async |h| conformance::exec_returns_stdout_and_exit_code(h).await,
        "exec of a command that exits 3",
    )
    .await;
    assert_catches(
        Bug::CannotRestartExited,
        async |h| conformance::self_exit_shows_exited_with_code(h).await,
        "start",
    )
    .await;
}

/// The mutant harness itself can fail: a driver without a bug is not "caught".
#[tokio::test]
#[should_panic(expected = "the suite did not notice None")]
async fn assert_catches_fails_on_a_correct_driver() {
    assert_catches(
        Bug::None,
        async |h| conformance::same_name_in_two_workspaces(h).await,
        "",
    )
    .await;
}
