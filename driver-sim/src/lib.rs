//! `sim`: an in-memory [`ComputeDriver`] for tests and benchmarks, with seeded fault injection.
//!
//! - [`SimWorld`] is the simulated machine. It outlives driver instances: drop a [`SimDriver`]
//!   and open another on the same world, as a controller restart would, and every workload is
//!   where it was. It holds the audit log of every call received and the test controls
//!   (`exit`, `crash_lose_all`, `crash_forget_generations`, `set_generation`, …).
//! - [`SimDriver`] implements the driver contract on a world, with the faults of
//!   [`SimFaults`] (latency, jitter, injected `Unavailable`, calls that never answer, lost
//!   replies, `fail_all`), changeable at run time through [`SimDriver::faults`].
//!
//! Workloads: a spec whose command is `["exit", "N"]` ends by itself with code N about
//! [`SELF_EXIT_DELAY`] after each start; any other command runs until stopped. `exec` runs a
//! tiny built-in command set (`echo`, `exit`, `cat`, `write` on an in-memory `/sandbox` that
//! survives stop and start; see `exec.rs`). Logs hold the lines the sim appends ("started
//! generation N", "stopped", "exited with code N"); exec output is not logged.
//!
//! A call goes: audit entry → fault decision (delay, then fail / hang / proceed) → id check →
//! effect → (when the decision says so) the reply is lost and the call answers `Unavailable`.
//! Streams returned by watch and logs (follow) end when the driver instance is dropped, as a
//! real driver's connections would.

mod exec;
mod faults;
mod world;

#[cfg(test)]
mod tests;

use std::convert::Infallible;
use std::time::Duration;

use async_trait::async_trait;
use futures::StreamExt;
use tokio::sync::watch;
use tokio_stream::wrappers::BroadcastStream;
use tokio_stream::wrappers::errors::BroadcastStreamRecvError;

pub use faults::{SimFaultHandle, SimFaults, SimOp};
pub use world::{AuditEntry, SimWorld};

use faults::FaultOutcome;
use sbx_driver_api::{ComputeDriver, DriverError, DriverStream, parse_sandbox_id, pb};
use sbx_host_kit::logfile::{Entry, LogQuery, tail_entries};
use world::{LogEvent, LogLine, SelfExit};

/// How long after its start a workload whose spec is `exit N` ends by itself.
pub const SELF_EXIT_DELAY: Duration = Duration::from_millis(10);

/// The in-memory driver. See the module docs.
#[derive(Debug)]
pub struct SimDriver {
    world: SimWorld,
    faults: SimFaultHandle,
    /// Whether capabilities report `images` (the gateway then resolves and pins an image for
    /// every sandbox; the sim records the spec it got, see [`SimWorld::spec`]).
    images: bool,
    /// Dropped with the driver: its receivers end the streams this instance handed out.
    alive: watch::Sender<()>,
}

impl SimDriver {
    pub fn new(world: SimWorld, faults: SimFaults) -> Self {
        let (alive, _) = watch::channel(());
        SimDriver {
            world,
            faults: SimFaultHandle::new(faults),
            images: false,
            alive,
        }
    }

    /// Makes capabilities report `images` (a driver that runs sandboxes from images).
    pub fn with_images(mut self, images: bool) -> Self {
        self.images = images;
        self
    }

    /// The world this driver acts on.
    pub fn world(&self) -> &SimWorld {
        &self.world
    }

    /// A handle on this driver's faults that stays usable after the driver is handed away.
    pub fn faults(&self) -> SimFaultHandle {
        self.faults.clone()
    }

    /// Replaces the faults (and reseeds). Same as `self.faults().set_faults(faults)`.
    pub fn set_faults(&self, faults: SimFaults) {
        self.faults.set_faults(faults);
    }

    /// Makes every call fail with `Unavailable`, or lets calls through again.
    pub fn fail_all(&self, fail_all: bool) {
        self.faults.fail_all(fail_all);
    }

    /// Records the call, then applies the injected delay and fault.
    async fn admit(
        &self,
        op: SimOp,
        sandbox_id: &str,
        generation: Option<u64>,
    ) -> Result<Admission, DriverError> {
        self.world.record(op, sandbox_id, generation);
        let decision = self.faults.decide(op);
        if !decision.delay.is_zero() {
            tokio::time::sleep(decision.delay).await;
        }
        match decision.outcome {
            FaultOutcome::Proceed => Ok(Admission { lost_reply: None }),
            FaultOutcome::LoseReply(message) => Ok(Admission {
                lost_reply: Some(message),
            }),
            FaultOutcome::Fail(message) => Err(DriverError::Unavailable(message)),
            FaultOutcome::Hang => match std::future::pending::<Infallible>().await {},
        }
    }

    /// Resolves when this driver instance is dropped.
    fn dropped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut alive = self.alive.subscribe();
        async move { while alive.changed().await.is_ok() {} }
    }

    fn schedule_self_exit(&self, exit: Option<SelfExit>) {
        if let Some(exit) = exit {
            let world = self.world.clone();
            tokio::spawn(async move {
                tokio::time::sleep(SELF_EXIT_DELAY).await;
                world.finish_self_exit(&exit);
            });
        }
    }

    // The effects of each call, once admitted.

    fn create_now(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        // As the host drivers without a network: a policy is refused, never ignored.
        let network = req.spec.as_ref().and_then(|s| s.network.as_ref());
        sbx_network::requested(network, None)?;
        let (snapshot, self_exit) = self.world.create(id, &req)?;
        self.schedule_self_exit(self_exit);
        Ok(snapshot)
    }

    fn start_now(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let (snapshot, self_exit) =
            self.world
                .start(id, req.generation, req.run_env.into_iter().collect())?;
        self.schedule_self_exit(self_exit);
        Ok(snapshot)
    }

    fn watch_now(&self) -> DriverStream<pb::WatchEvent> {
        let events = BroadcastStream::new(self.world.subscribe_watch()).map(|event| {
            event.map_err(|BroadcastStreamRecvError::Lagged(missed)| {
                DriverError::Unavailable(format!(
                    "sim: watch fell {missed} events behind; list again to resynchronise"
                ))
            })
        });
        Box::pin(events.take_until(self.dropped()))
    }

    fn exec_now(
        &self,
        req: pb::ExecRequest,
        input: sbx_driver_api::ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        // What the host drivers refuse (empty, NUL in an argument, '=' in a name), refused alike.
        sbx_host_kit::validate_command("exec", &req.command, &req.env)?;
        if req.tty.is_some() {
            return Err(DriverError::Unimplemented(
                "exec with a terminal: the sim driver's exec has none".to_string(),
            ));
        }
        if !req.workdir.is_empty() && req.workdir != "/sandbox" {
            return Err(DriverError::InvalidArgument(format!(
                "the working directory {}: the sim has only /sandbox",
                sbx_proto::quote::quote(&req.workdir)
            )));
        }
        // The sim's sandboxes have root alone, as an image without /etc/passwd but root would.
        if !matches!(req.user.as_str(), "" | "root" | "0" | "root:root" | "0:0") {
            return Err(DriverError::InvalidArgument(format!(
                "user {}: the sim's sandboxes have only root",
                sbx_proto::quote::quote(&req.user)
            )));
        }
        if req.stdin && req.command == ["cat"] {
            // The one built-in that reads stdin: it writes back what it reads, until its end.
            // `echo` has no effect: it only checks that the sandbox exists and runs.
            self.world.exec(id, &["echo".to_string()])?;
            return Ok(exec::cat_stdin(input));
        }
        let result = self.world.exec(id, &req.command)?;
        use pb::exec_output::Chunk;
        let mut chunks = Vec::new();
        if !result.stdout.is_empty() {
            chunks.push(Chunk::Stdout(result.stdout));
        }
        if !result.stderr.is_empty() {
            chunks.push(Chunk::Stderr(result.stderr));
        }
        chunks.push(Chunk::Exit(pb::ExecExit {
            code: result.code,
            signal: 0,
            timed_out: false,
        }));
        let outputs = chunks
            .into_iter()
            .map(|chunk| Ok(pb::ExecOutput { chunk: Some(chunk) }));
        Ok(Box::pin(futures::stream::iter(outputs)))
    }

    fn logs_now(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let query = LogQuery::from(&req);
        let (lines, follower) = self.world.logs(id, req.follow)?;
        let entry = |line: LogLine| Entry {
            time: Some(line.time),
            stream: pb::LogStream::Stdout,
            data: format!("{}\n", line.text).into_bytes(),
            ends_line: true,
        };
        let admitted: Vec<Entry> = lines
            .into_iter()
            .map(entry)
            .filter(|e| query.admits(e))
            .collect();
        let past = query.chunks(tail_entries(&admitted, req.tail_lines).to_vec());
        let past = futures::stream::iter(past.into_iter().map(Ok));
        let Some(follower) = follower else {
            return Ok(Box::pin(past));
        };
        let future = BroadcastStream::new(follower)
            .filter_map(move |event| {
                std::future::ready(match event {
                    Ok(LogEvent { sandbox_id, line }) if sandbox_id == id => Some(Ok(line)),
                    Ok(_) => None,
                    Err(BroadcastStreamRecvError::Lagged(missed)) => {
                        Some(Err(DriverError::Unavailable(format!(
                            "sim: log follower fell {missed} lines behind"
                        ))))
                    }
                })
            })
            // `None`: the sandbox is gone, the log ends.
            .take_while(|event| std::future::ready(!matches!(event, Ok(None))))
            .filter_map(move |event| {
                std::future::ready(match event {
                    Ok(line) => query
                        .chunks(line.map(entry).into_iter().collect())
                        .pop()
                        .map(Ok),
                    Err(e) => Some(Err(e)),
                })
            })
            .take_until(self.dropped());
        Ok(Box::pin(past.chain(future)))
    }
}

/// A call let through by the fault injector, which may still lose its reply.
struct Admission {
    /// Set when the reply is to be lost: the call acts, then answers `Unavailable` with this.
    lost_reply: Option<String>,
}

impl Admission {
    fn answer<T>(self, result: Result<T, DriverError>) -> Result<T, DriverError> {
        match (self.lost_reply, result) {
            (Some(message), Ok(_)) => Err(DriverError::Unavailable(message)),
            (_, result) => result,
        }
    }
}

#[async_trait]
impl ComputeDriver for SimDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        let admission = self.admit(SimOp::Capabilities, "", None).await?;
        admission.answer(Ok(pb::CapabilitiesResponse {
            network: false,
            disk_limit: false,
            // A simulated workload uses nothing: its figures are zeros, its state the world's.
            stats: true,
            pause: true,
            driver: "sim".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: false,
            memory_limit: false,
            persistent_storage: true,
            images: self.images,
            exec_stdin: true,
            exec_tty: false,
            copy: false,
            port_forward: false,
            copy_when_stopped: false,
            isolation: "none: an in-memory simulation".to_string(),
        }))
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let admission = self
            .admit(SimOp::Create, &req.sandbox_id, Some(req.generation))
            .await?;
        admission.answer(self.create_now(req))
    }

    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let admission = self
            .admit(SimOp::Start, &req.sandbox_id, Some(req.generation))
            .await?;
        admission.answer(self.start_now(req))
    }

    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let admission = self.admit(SimOp::Stop, &req.sandbox_id, None).await?;
        admission.answer(parse_sandbox_id(&req.sandbox_id).and_then(|id| self.world.stop(id)))
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        let admission = self.admit(SimOp::Delete, &req.sandbox_id, None).await?;
        let deleted = parse_sandbox_id(&req.sandbox_id).map(|id| self.world.delete(id));
        admission.answer(deleted.map(|deleted| pb::DeleteResponse { deleted }))
    }

    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        let admission = self.admit(SimOp::Get, &req.sandbox_id, None).await?;
        admission.answer(parse_sandbox_id(&req.sandbox_id).and_then(|id| self.world.get(id)))
    }

    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError> {
        let admission = self.admit(SimOp::Stats, &req.sandbox_id, None).await?;
        let snapshot = parse_sandbox_id(&req.sandbox_id).and_then(|id| self.world.get(id));
        admission.answer(snapshot.map(|s| pb::SandboxUsage {
            running: s.state == pb::State::Running as i32,
            ..Default::default()
        }))
    }

    async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        let admission = self.admit(SimOp::Pause, &req.sandbox_id, None).await?;
        admission.answer(parse_sandbox_id(&req.sandbox_id).and_then(|id| self.world.pause(id)))
    }

    async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        let admission = self.admit(SimOp::Resume, &req.sandbox_id, None).await?;
        admission.answer(parse_sandbox_id(&req.sandbox_id).and_then(|id| self.world.resume(id)))
    }

    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        let admission = self.admit(SimOp::List, "", None).await?;
        admission.answer(Ok(self.world.list()))
    }

    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        let admission = self.admit(SimOp::Watch, "", None).await?;
        admission.answer(Ok(self.watch_now()))
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: sbx_driver_api::ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let admission = self.admit(SimOp::Exec, &req.sandbox_id, None).await?;
        admission.answer(self.exec_now(req, input))
    }

    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        let admission = self.admit(SimOp::Logs, &req.sandbox_id, None).await?;
        admission.answer(self.logs_now(req))
    }
}
