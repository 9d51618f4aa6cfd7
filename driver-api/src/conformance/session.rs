//! [`Session`]: one check's view of the driver under test — calls with deadlines, waiting for
//! a state, and the sandboxes to delete when the check ends, however it ends.

use std::any::Any;
use std::future::Future;
use std::panic::{AssertUnwindSafe, resume_unwind};
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use tokio::time::{Instant, sleep, timeout};
use uuid::Uuid;

use super::DriverHarness;
use crate::{ComputeDriver, DriverError, DriverStream, pb};

/// How often a wait polls `get`.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// What an exec produced.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct ExecOutcome {
    pub(crate) stdout: String,
    pub(crate) stderr: String,
    /// `None` when the stream ended without an exit chunk.
    pub(crate) exit_code: Option<i32>,
}

pub(crate) struct Session<'h> {
    pub(crate) h: &'h dyn DriverHarness,
    /// The instance under test; `None` only inside `kill_and_reopen`, between the kill and
    /// the reopen, so that the kill receives the suite's only reference.
    instance: Option<Arc<dyn ComputeDriver>>,
    /// Every id this check created, so that they are deleted whatever happens.
    created: Vec<String>,
    check: &'static str,
}

/// Runs `body` as check `check` on a fresh session, then deletes what it created. A panic in
/// `body` is re-raised after the cleanup.
pub(crate) async fn run_check<'h, F>(h: &'h dyn DriverHarness, check: &'static str, body: F)
where
    F: for<'s> FnOnce(&'s mut Session<'h>) -> futures::future::BoxFuture<'s, ()>,
{
    let driver = h.open().await;
    let mut session = Session {
        h,
        instance: Some(driver),
        created: Vec::new(),
        check,
    };
    let outcome = AssertUnwindSafe(body(&mut session)).catch_unwind().await;
    session.finish(outcome).await;
}

impl<'h> Session<'h> {
    /// Awaits `call` for at most the harness's call timeout; panics when it does not answer.
    pub(crate) async fn call<T>(&self, what: &str, call: impl Future<Output = T>) -> T {
        let deadline = self.h.call_timeout();
        match timeout(deadline, call).await {
            Ok(answer) => answer,
            Err(_) => panic!(
                "[{}] driver call {what} did not answer within {deadline:?}",
                self.check
            ),
        }
    }

    /// A create request for a new sandbox id, remembered for cleanup.
    pub(crate) fn create_request(
        &mut self,
        workspace: &str,
        name: &str,
        spec: pb::SandboxSpec,
        generation: u64,
    ) -> pb::CreateRequest {
        let sandbox_id = Uuid::new_v4().to_string();
        self.created.push(sandbox_id.clone());
        pb::CreateRequest {
            run_env: Default::default(),
            sandbox_id,
            workspace: workspace.to_string(),
            name: name.to_string(),
            spec: Some(spec),
            generation,
            stopped: false,
        }
    }

    /// Creates a sandbox with the long-running spec and waits until it runs.
    pub(crate) async fn create_running(
        &mut self,
        workspace: &str,
        name: &str,
        generation: u64,
    ) -> pb::Snapshot {
        let req = self.create_request(workspace, name, self.h.long_running_spec(), generation);
        let id = req.sandbox_id.clone();
        let created = self.create(req).await;
        assert_eq!(
            created.sandbox_id, id,
            "[{}] create answered another sandbox id",
            self.check
        );
        self.wait_for_state(&id, pb::State::Running).await
    }

    pub(crate) async fn create(&self, req: pb::CreateRequest) -> pb::Snapshot {
        let what = format!("create {}/{} ({})", req.workspace, req.name, req.sandbox_id);
        let answer = self.call(&what, self.driver().create(req)).await;
        answer.unwrap_or_else(|e| panic!("[{}] {what} failed: {e}", self.check))
    }

    pub(crate) async fn try_start(
        &self,
        id: &str,
        generation: u64,
    ) -> Result<pb::Snapshot, DriverError> {
        let req = pb::StartRequest {
            run_env: Default::default(),
            sandbox_id: id.to_string(),
            generation,
        };
        self.call(&format!("start {id}"), self.driver().start(req))
            .await
    }

    pub(crate) async fn start(&self, id: &str, generation: u64) -> pb::Snapshot {
        let answer = self.try_start(id, generation).await;
        answer.unwrap_or_else(|e| {
            panic!(
                "[{}] start {id} generation {generation} failed: {e}",
                self.check
            )
        })
    }

    pub(crate) async fn try_stop(&self, id: &str) -> Result<pb::Snapshot, DriverError> {
        let req = pb::StopRequest {
            sandbox_id: id.to_string(),
            grace_period_ms: 0,
        };
        self.call(&format!("stop {id}"), self.driver().stop(req))
            .await
    }

    /// Stops and waits until the driver reports the sandbox stopped.
    pub(crate) async fn stop(&self, id: &str) -> pb::Snapshot {
        let answer = self.try_stop(id).await;
        answer.unwrap_or_else(|e| panic!("[{}] stop {id} failed: {e}", self.check));
        self.wait_for_state(id, pb::State::Stopped).await
    }

    pub(crate) async fn try_delete(&self, id: &str) -> Result<bool, DriverError> {
        let req = pb::DeleteRequest {
            sandbox_id: id.to_string(),
        };
        let answer = self
            .call(&format!("delete {id}"), self.driver().delete(req))
            .await;
        answer.map(|r| r.deleted)
    }

    pub(crate) async fn delete(&self, id: &str) -> bool {
        let answer = self.try_delete(id).await;
        answer.unwrap_or_else(|e| panic!("[{}] delete {id} failed: {e}", self.check))
    }

    pub(crate) async fn try_get(&self, id: &str) -> Result<pb::Snapshot, DriverError> {
        let req = pb::GetRequest {
            sandbox_id: id.to_string(),
        };
        self.call(&format!("get {id}"), self.driver().get(req))
            .await
    }

    pub(crate) async fn get(&self, id: &str) -> pb::Snapshot {
        let answer = self.try_get(id).await;
        answer.unwrap_or_else(|e| panic!("[{}] get {id} failed: {e}", self.check))
    }

    pub(crate) async fn stats(&self, id: &str) -> Result<pb::SandboxUsage, DriverError> {
        let req = pb::StatsRequest {
            sandbox_id: id.to_string(),
        };
        self.call(&format!("stats of {id}"), self.driver().stats(req))
            .await
    }

    pub(crate) async fn list(&self) -> Vec<pb::Snapshot> {
        let answer = self.call("list", self.driver().list()).await;
        answer.unwrap_or_else(|e| panic!("[{}] list failed: {e}", self.check))
    }

    pub(crate) async fn capabilities(&self) -> pb::CapabilitiesResponse {
        let answer = self
            .call("capabilities", self.driver().capabilities())
            .await;
        answer.unwrap_or_else(|e| panic!("[{}] capabilities failed: {e}", self.check))
    }

    /// The entries of `list` with this id.
    pub(crate) async fn listed(&self, id: &str) -> Vec<pb::Snapshot> {
        self.list()
            .await
            .into_iter()
            .filter(|s| s.sandbox_id == id)
            .collect()
    }

    pub(crate) async fn try_exec(
        &self,
        id: &str,
        command: Vec<String>,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let req = pb::ExecRequest {
            sandbox_id: id.to_string(),
            command,
            ..Default::default()
        };
        self.call(&format!("exec in {id}"), self.driver().exec(req))
            .await
    }

    /// Runs `command` in sandbox `id` and collects its output until the stream ends.
    pub(crate) async fn exec(&self, id: &str, command: Vec<String>) -> ExecOutcome {
        let what = format!("exec {command:?} in {id}");
        let mut stream = match self.try_exec(id, command).await {
            Ok(stream) => stream,
            Err(e) => panic!("[{}] {what} failed: {e}", self.check),
        };
        let collect = async {
            let mut outcome = ExecOutcome::default();
            while let Some(item) = stream.next().await {
                let item =
                    item.unwrap_or_else(|e| panic!("[{}] {what}: stream failed: {e}", self.check));
                match item.chunk {
                    Some(pb::exec_output::Chunk::Stdout(b)) => {
                        outcome.stdout.push_str(&String::from_utf8_lossy(&b))
                    }
                    Some(pb::exec_output::Chunk::Stderr(b)) => {
                        outcome.stderr.push_str(&String::from_utf8_lossy(&b))
                    }
                    Some(pb::exec_output::Chunk::Exit(exit)) => outcome.exit_code = Some(exit.code),
                    None => {}
                }
            }
            outcome
        };
        self.call(&format!("{what} (output stream)"), collect).await
    }

    /// Polls `get` until the sandbox is in `state`, for at most the settle timeout.
    pub(crate) async fn wait_for_state(&self, id: &str, state: pb::State) -> pb::Snapshot {
        let settle = self.h.settle_timeout();
        let give_up = Instant::now() + settle;
        loop {
            let last = self.try_get(id).await;
            if let Ok(snapshot) = &last
                && snapshot.state == state as i32
            {
                return snapshot.clone();
            }
            if Instant::now() >= give_up {
                panic!(
                    "[{}] sandbox {id} did not reach {state:?} within {settle:?}; last get: {}",
                    self.check,
                    describe(&last)
                );
            }
            sleep(POLL_INTERVAL).await;
        }
    }

    /// Crashes the driver instance (harness.kill) and opens a new one on the same state.
    /// The session holds the only reference the suite has, so the kill really ends it.
    pub(crate) async fn kill_and_reopen(&mut self) {
        if let Some(old) = self.instance.take() {
            self.h.kill(old).await;
        }
        self.instance = Some(self.h.open().await);
    }

    /// The driver instance under test.
    pub(crate) fn driver(&self) -> &Arc<dyn ComputeDriver> {
        match &self.instance {
            Some(driver) => driver,
            // Only kill_and_reopen empties it, and it refills it before returning.
            None => panic!("[{}] no driver instance is open", self.check),
        }
    }

    pub(crate) fn check(&self) -> &'static str {
        self.check
    }

    /// Deletes every sandbox the check created. On success, also checks that each delete
    /// took; after a failure, re-raises the failure once the cleanup is done.
    async fn finish(self, outcome: Result<(), Box<dyn Any + Send>>) {
        let mut problems = Vec::new();
        // A failure inside kill_and_reopen can leave no instance: open one to clean up with.
        let driver = match &self.instance {
            Some(driver) => driver.clone(),
            None => self.h.open().await,
        };
        for id in &self.created {
            let deleted = timeout(
                self.h.call_timeout(),
                driver.delete(pb::DeleteRequest {
                    sandbox_id: id.clone(),
                }),
            )
            .await;
            match deleted {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => problems.push(format!("delete {id} failed: {e}")),
                Err(_) => problems.push(format!("delete {id} did not answer")),
            }
        }
        if let Err(panic) = outcome {
            eprintln!(
                "conformance check {} failed; cleaned up {} sandboxes{}",
                self.check,
                self.created.len(),
                if problems.is_empty() {
                    String::new()
                } else {
                    format!(" with problems: {problems:?}")
                }
            );
            resume_unwind(panic);
        }
        assert!(
            problems.is_empty(),
            "[{}] cleanup failed: {problems:?}",
            self.check
        );
        let session = Session {
            instance: Some(driver),
            ..self
        };
        for id in &session.created {
            let gone = session.try_get(id).await;
            assert!(
                matches!(gone, Err(DriverError::NotFound { .. })),
                "[{}] sandbox {id} is still there after delete: {}",
                session.check,
                describe(&gone)
            );
        }
    }
}

/// A snapshot or error in a few words, for failure messages.
pub(crate) fn describe(answer: &Result<pb::Snapshot, DriverError>) -> String {
    match answer {
        Ok(s) => format!(
            "{:?} generation {} instance {:?} exit {} ({}/{})",
            pb::State::try_from(s.state).unwrap_or(pb::State::Unspecified),
            s.generation,
            s.instance_id,
            s.exit_code,
            s.workspace,
            s.name
        ),
        Err(e) => format!("error: {e}"),
    }
}

pub(crate) fn state_of(snapshot: &pb::Snapshot) -> pb::State {
    pb::State::try_from(snapshot.state).unwrap_or(pb::State::Unspecified)
}

/// Asserts that `id` is exactly as `before` showed it: same state, generation, instance id,
/// workspace and name.
pub(crate) async fn assert_untouched(
    s: &Session<'_>,
    id: &str,
    before: &pb::Snapshot,
    after_what: &str,
) {
    let now = s.get(id).await;
    let key = |x: &pb::Snapshot| {
        (
            x.state,
            x.generation,
            x.instance_id.clone(),
            x.workspace.clone(),
            x.name.clone(),
        )
    };
    assert_eq!(
        key(&now),
        key(before),
        "[{}] {after_what} changed another sandbox ({id}): was {}, now {}",
        s.check(),
        describe(&Ok(before.clone())),
        describe(&Ok(now.clone()))
    );
}
