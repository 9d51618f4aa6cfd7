//! [`SimWorld`]: the simulated machine — the workloads that exist and everything about them —
//! with the controls a test uses to make things happen behind the driver's back.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use tokio::sync::broadcast;
use uuid::Uuid;

use super::exec::{ExecResult, run_builtin};
use super::faults::SimOp;
use sbx_driver_api::{DriverError, pb};

/// How many watch events and log lines a slow subscriber may fall behind before it lags.
const EVENT_BUFFER: usize = 1024;

/// One call the sim driver received, in arrival order, whatever became of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditEntry {
    pub op: SimOp,
    /// The sandbox id exactly as received (possibly empty or malformed); empty for calls that
    /// take none (list, watch, capabilities).
    pub sandbox_id: String,
    /// The generation the call carried (create and start only).
    pub generation: Option<u64>,
}

/// A line appended to a sandbox's log, or the end of its log (the sandbox is gone).
#[derive(Debug, Clone)]
pub(crate) struct LogEvent {
    pub(crate) sandbox_id: Uuid,
    /// `None`: the sandbox was deleted or lost; followers stop.
    pub(crate) line: Option<LogLine>,
}

/// A line of a sim sandbox's log (stdout, as the sim has no other stream) and when it was
/// appended.
#[derive(Debug, Clone)]
pub(crate) struct LogLine {
    pub(crate) time: sbx_proto::Timestamp,
    pub(crate) text: String,
}

/// A workload whose spec says `exit N`: it ends by itself shortly after it starts. The driver
/// schedules the exit; `instance_id` fences it so it cannot end a later run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SelfExit {
    pub(crate) sandbox_id: Uuid,
    pub(crate) instance_id: String,
    pub(crate) code: i32,
}

/// Everything the machine holds for one sandbox.
#[derive(Debug, Clone)]
struct SimWorkload {
    workspace: String,
    name: String,
    spec: pb::SandboxSpec,
    state: pb::State,
    generation: u64,
    instance_id: String,
    exit_code: i32,
    reason: String,
    started_at: Option<sbx_proto::Timestamp>,
    /// Lines the sim appends ("started generation N", "stopped", "exited with code N").
    /// Exec output is not logged.
    logs: Vec<LogLine>,
    /// The sandbox's `/sandbox` directory, path → contents. Survives stop and start; removed
    /// by delete and by `crash_lose_all`.
    files: BTreeMap<String, String>,
    /// Creation order, so that list answers in a stable order.
    created_seq: u64,
    /// The current run's `run_env` (credentials, settings), for tests to check what a start
    /// was given. Never in a snapshot or a log line.
    run_env: BTreeMap<String, String>,
}

impl SimWorkload {
    fn snapshot(&self, id: Uuid) -> pb::Snapshot {
        let mut warnings = Vec::new();
        if let Some(resources) = &self.spec.resources {
            if resources.cpu_millis > 0 {
                warnings.push("cpu limit not applied: the sim driver has no limits".to_string());
            }
            if resources.memory_bytes > 0 {
                warnings.push("memory limit not applied: the sim driver has no limits".to_string());
            }
        }
        pb::Snapshot {
            sandbox_id: id.to_string(),
            workspace: self.workspace.clone(),
            name: self.name.clone(),
            state: self.state as i32,
            generation: self.generation,
            instance_id: self.instance_id.clone(),
            exit_code: self.exit_code,
            exit_signal: 0,
            reason: self.reason.clone(),
            message: String::new(),
            warnings,
            started_at: self.started_at,
            ..Default::default()
        }
    }
}

/// The exit code a spec's command asks for: `["exit", "N"]` makes the workload end by itself
/// with code N. Any other command runs until stopped.
fn self_exit_code(spec: &pb::SandboxSpec) -> Option<i32> {
    match spec.command.as_slice() {
        [exit, code] if exit == "exit" => code.parse().ok(),
        _ => None,
    }
}

#[derive(Debug, Default)]
struct WorldState {
    workloads: HashMap<Uuid, SimWorkload>,
    audit: Vec<AuditEntry>,
    /// Feeds instance ids and creation order; never reset, so no two runs share an instance id.
    next_seq: u64,
}

#[derive(Debug)]
struct WorldShared {
    state: Mutex<WorldState>,
    /// Changes the driver reports on watch. Sent while the state lock is held, so events
    /// arrive in the order the changes happened.
    watch_tx: broadcast::Sender<pb::WatchEvent>,
    /// Lines appended to any sandbox's log, for `logs` with follow.
    log_tx: broadcast::Sender<LogEvent>,
}

/// The simulated machine. Cloning shares it. It outlives driver instances: drop a
/// [`SimDriver`](super::SimDriver) and open another on the same world, and running workloads
/// are still running with the same instance id and generation.
///
/// The test controls (`exit`, `crash_*`, `set_generation`) model things that happen behind
/// the driver's back. Only `exit` produces a watch event (a real driver notices its process
/// end); the crash variants and `set_generation` are silent and show only in get and list.
#[derive(Debug, Clone)]
pub struct SimWorld {
    shared: Arc<WorldShared>,
}

impl Default for SimWorld {
    fn default() -> Self {
        Self::new()
    }
}

impl SimWorld {
    /// An empty machine.
    pub fn new() -> Self {
        let (watch_tx, _) = broadcast::channel(EVENT_BUFFER);
        let (log_tx, _) = broadcast::channel(EVENT_BUFFER);
        SimWorld {
            shared: Arc::new(WorldShared {
                state: Mutex::new(WorldState::default()),
                watch_tx,
                log_tx,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, WorldState> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn emit(&self, id: Uuid, workload: &SimWorkload) {
        // No receivers is fine: nobody watches.
        let _ = self.shared.watch_tx.send(pb::WatchEvent {
            snapshot: Some(workload.snapshot(id)),
            deleted: false,
        });
    }

    fn append_log(&self, id: Uuid, workload: &mut SimWorkload, text: String) {
        let line = LogLine {
            time: sbx_proto::Timestamp::from(SystemTime::now()),
            text,
        };
        workload.logs.push(line.clone());
        let _ = self.shared.log_tx.send(LogEvent {
            sandbox_id: id,
            line: Some(line),
        });
    }

    // ----- test controls -----

    /// The workload's main process ends by itself with `code`: state EXITED, reason
    /// `Completed` (code 0) or `Error`, a log line and a watch event. `None` when no workload
    /// with this id is running.
    pub fn exit(&self, id: Uuid, code: i32) -> Option<pb::Snapshot> {
        let mut state = self.lock();
        let workload = state.workloads.get_mut(&id)?;
        if workload.state != pb::State::Running {
            return None;
        }
        self.mark_exited(id, workload, code);
        Some(workload.snapshot(id))
    }

    /// The machine loses all state: every workload, its logs and its files are gone (the
    /// audit log stays: it is the test's record, not the machine's). Log followers end; no
    /// watch events are sent.
    pub fn crash_lose_all(&self) {
        let mut state = self.lock();
        for id in state.workloads.keys() {
            let _ = self.shared.log_tx.send(LogEvent {
                sandbox_id: *id,
                line: None,
            });
        }
        state.workloads.clear();
    }

    /// Every workload keeps its state (running ones keep running, same instance id) but its
    /// generation marker is forgotten: it reports generation 0 from now on, so a start with
    /// the generation it was started with answers `GenerationMismatch { running: 0, .. }`.
    pub fn crash_forget_generations(&self) {
        let mut state = self.lock();
        for workload in state.workloads.values_mut() {
            workload.generation = 0;
        }
    }

    /// Overwrites one workload's generation marker. `false` when the id is unknown.
    pub fn set_generation(&self, id: Uuid, generation: u64) -> bool {
        match self.lock().workloads.get_mut(&id) {
            Some(workload) => {
                workload.generation = generation;
                true
            }
            None => false,
        }
    }

    /// What a `get` would answer, without going through a driver (no audit, no faults).
    pub fn snapshot(&self, id: Uuid) -> Option<pb::Snapshot> {
        self.lock().workloads.get(&id).map(|w| w.snapshot(id))
    }

    /// The ids of the running workloads, in creation order.
    pub fn running_ids(&self) -> Vec<Uuid> {
        let state = self.lock();
        let mut running: Vec<(u64, Uuid)> = state
            .workloads
            .iter()
            .filter(|(_, w)| w.state == pb::State::Running)
            .map(|(id, w)| (w.created_seq, *id))
            .collect();
        running.sort();
        running.into_iter().map(|(_, id)| id).collect()
    }

    /// A copy of one sandbox's `/sandbox` files (path → contents), or `None` when unknown.
    /// The spec the last create of `id` carried (for a driver with images, `image` is the
    /// digest the gateway pinned).
    pub fn spec(&self, id: Uuid) -> Option<pb::SandboxSpec> {
        self.lock().workloads.get(&id).map(|w| w.spec.clone())
    }

    pub fn files(&self, id: Uuid) -> Option<BTreeMap<String, String>> {
        self.lock().workloads.get(&id).map(|w| w.files.clone())
    }

    /// Every call received by any driver on this world, in order.
    pub fn audit(&self) -> Vec<AuditEntry> {
        self.lock().audit.clone()
    }

    pub fn clear_audit(&self) {
        self.lock().audit.clear();
    }

    // ----- what the driver does -----

    pub(crate) fn record(&self, op: SimOp, sandbox_id: &str, generation: Option<u64>) {
        self.lock().audit.push(AuditEntry {
            op,
            sandbox_id: sandbox_id.to_string(),
            generation,
        });
    }

    /// Starts `workload` under `generation` as a new instance.
    fn run(
        &self,
        id: Uuid,
        workload: &mut SimWorkload,
        generation: u64,
        seq: u64,
    ) -> Option<SelfExit> {
        workload.state = pb::State::Running;
        workload.generation = generation;
        workload.instance_id = format!("sim-run-{seq}");
        workload.exit_code = 0;
        workload.reason = String::new();
        workload.started_at = Some(sbx_proto::Timestamp::from(SystemTime::now()));
        self.append_log(id, workload, format!("started generation {generation}"));
        self.emit(id, workload);
        self_exit_code(&workload.spec).map(|code| SelfExit {
            sandbox_id: id,
            instance_id: workload.instance_id.clone(),
            code,
        })
    }

    pub(crate) fn create(
        &self,
        id: Uuid,
        req: &pb::CreateRequest,
    ) -> Result<(pb::Snapshot, Option<SelfExit>), DriverError> {
        let mut state = self.lock();
        state.next_seq += 1;
        let seq = state.next_seq;
        let workload = state.workloads.entry(id).or_insert_with(|| SimWorkload {
            workspace: req.workspace.clone(),
            name: req.name.clone(),
            spec: req.spec.clone().unwrap_or_default(),
            state: pb::State::Stopped,
            generation: 0,
            instance_id: String::new(),
            exit_code: 0,
            reason: String::new(),
            started_at: None,
            logs: Vec::new(),
            files: BTreeMap::new(),
            created_seq: seq,
            run_env: BTreeMap::new(),
        });
        if workload.workspace != req.workspace || workload.name != req.name {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} exists as {}/{}, not {}/{}",
                workload.workspace, workload.name, req.workspace, req.name
            )));
        }
        if workload.created_seq != seq && workload.generation == req.generation {
            // Created before under this generation: nothing to do.
            return Ok((workload.snapshot(id), None));
        }
        if workload.state == pb::State::Running {
            return Err(DriverError::GenerationMismatch {
                sandbox_id: id.to_string(),
                running: workload.generation,
                requested: req.generation,
            });
        }
        if req.stopped {
            // Made, not started: Stopped under the create's generation.
            workload.generation = req.generation;
            self.emit(id, workload);
            return Ok((workload.snapshot(id), None));
        }
        workload.run_env = req.run_env.clone().into_iter().collect();
        let self_exit = self.run(id, workload, req.generation, seq);
        Ok((workload.snapshot(id), self_exit))
    }

    pub(crate) fn start(
        &self,
        id: Uuid,
        generation: u64,
        run_env: BTreeMap<String, String>,
    ) -> Result<(pb::Snapshot, Option<SelfExit>), DriverError> {
        let mut state = self.lock();
        state.next_seq += 1;
        let seq = state.next_seq;
        let workload = state
            .workloads
            .get_mut(&id)
            .ok_or_else(|| DriverError::NotFound {
                sandbox_id: id.to_string(),
            })?;
        if workload.state == pb::State::Running {
            if workload.generation == generation {
                return Ok((workload.snapshot(id), None));
            }
            return Err(DriverError::GenerationMismatch {
                sandbox_id: id.to_string(),
                running: workload.generation,
                requested: generation,
            });
        }
        workload.run_env = run_env;
        let self_exit = self.run(id, workload, generation, seq);
        Ok((workload.snapshot(id), self_exit))
    }

    /// The environment the current (or last) run of sandbox `id` was given on top of its
    /// spec's; `None` when the machine has no such sandbox.
    pub fn run_env(&self, id: Uuid) -> Option<BTreeMap<String, String>> {
        self.lock().workloads.get(&id).map(|w| w.run_env.clone())
    }

    /// Stops a running workload. A stopped or exited one is left as it is (an exited one
    /// keeps its exit code).
    pub(crate) fn stop(&self, id: Uuid) -> Result<pb::Snapshot, DriverError> {
        let mut state = self.lock();
        let workload = state
            .workloads
            .get_mut(&id)
            .ok_or_else(|| DriverError::NotFound {
                sandbox_id: id.to_string(),
            })?;
        if matches!(workload.state, pb::State::Running | pb::State::Paused) {
            workload.state = pb::State::Stopped;
            self.append_log(id, workload, "stopped".to_string());
            self.emit(id, workload);
        }
        Ok(workload.snapshot(id))
    }

    /// Pauses a running workload: its state (instance, generation, files) is kept as it is,
    /// nothing runs. A paused one is left as it is.
    pub(crate) fn pause(&self, id: Uuid) -> Result<pb::Snapshot, DriverError> {
        self.switch(id, pb::State::Running, pb::State::Paused, "paused")
    }

    /// Resumes a paused workload: the same instance under the same generation. A running one
    /// is left as it is.
    pub(crate) fn resume(&self, id: Uuid) -> Result<pb::Snapshot, DriverError> {
        self.switch(id, pb::State::Paused, pb::State::Running, "resumed")
    }

    /// Moves a workload from state `from` to `to` (logged as `said`); one already in `to` is
    /// left as it is, one in neither is refused.
    fn switch(
        &self,
        id: Uuid,
        from: pb::State,
        to: pb::State,
        said: &str,
    ) -> Result<pb::Snapshot, DriverError> {
        let mut state = self.lock();
        let workload = state
            .workloads
            .get_mut(&id)
            .ok_or_else(|| DriverError::NotFound {
                sandbox_id: id.to_string(),
            })?;
        if workload.state == from {
            workload.state = to;
            self.append_log(id, workload, said.to_string());
            self.emit(id, workload);
        } else if workload.state != to {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is {}; only a {} workload can be {said}",
                workload.state.as_str_name(),
                from.as_str_name()
            )));
        }
        Ok(workload.snapshot(id))
    }

    /// Removes the sandbox, files and logs included. Whether it existed.
    pub(crate) fn delete(&self, id: Uuid) -> bool {
        let mut state = self.lock();
        let Some(mut workload) = state.workloads.remove(&id) else {
            return false;
        };
        workload.state = pb::State::Stopped;
        let _ = self.shared.watch_tx.send(pb::WatchEvent {
            snapshot: Some(workload.snapshot(id)),
            deleted: true,
        });
        let _ = self.shared.log_tx.send(LogEvent {
            sandbox_id: id,
            line: None,
        });
        true
    }

    pub(crate) fn get(&self, id: Uuid) -> Result<pb::Snapshot, DriverError> {
        self.snapshot(id).ok_or_else(|| DriverError::NotFound {
            sandbox_id: id.to_string(),
        })
    }

    /// Every sandbox, in creation order.
    pub(crate) fn list(&self) -> Vec<pb::Snapshot> {
        let state = self.lock();
        let mut all: Vec<(u64, pb::Snapshot)> = state
            .workloads
            .iter()
            .map(|(id, w)| (w.created_seq, w.snapshot(*id)))
            .collect();
        all.sort_by_key(|(seq, _)| *seq);
        all.into_iter().map(|(_, snapshot)| snapshot).collect()
    }

    pub(crate) fn subscribe_watch(&self) -> broadcast::Receiver<pb::WatchEvent> {
        self.shared.watch_tx.subscribe()
    }

    /// Runs a built-in command in a running sandbox.
    pub(crate) fn exec(&self, id: Uuid, argv: &[String]) -> Result<ExecResult, DriverError> {
        let mut state = self.lock();
        let workload = state
            .workloads
            .get_mut(&id)
            .ok_or_else(|| DriverError::NotFound {
                sandbox_id: id.to_string(),
            })?;
        if workload.state != pb::State::Running {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; exec needs a running workload"
            )));
        }
        Ok(run_builtin(argv, &mut workload.files))
    }

    /// The sandbox's log lines and, when `follow`, a subscription taken under the same lock,
    /// so no line falls between the two.
    pub(crate) fn logs(
        &self,
        id: Uuid,
        follow: bool,
    ) -> Result<(Vec<LogLine>, Option<broadcast::Receiver<LogEvent>>), DriverError> {
        let state = self.lock();
        let workload = state
            .workloads
            .get(&id)
            .ok_or_else(|| DriverError::NotFound {
                sandbox_id: id.to_string(),
            })?;
        let lines = workload.logs.clone();
        let follower = follow.then(|| self.shared.log_tx.subscribe());
        Ok((lines, follower))
    }

    /// Ends the run `exit` names, if that very instance still runs (a stop or restart since
    /// it was scheduled fences it off).
    pub(crate) fn finish_self_exit(&self, exit: &SelfExit) {
        let mut state = self.lock();
        let Some(workload) = state.workloads.get_mut(&exit.sandbox_id) else {
            return;
        };
        if workload.state == pb::State::Running && workload.instance_id == exit.instance_id {
            self.mark_exited(exit.sandbox_id, workload, exit.code);
        }
    }

    fn mark_exited(&self, id: Uuid, workload: &mut SimWorkload, code: i32) {
        workload.state = pb::State::Exited;
        workload.exit_code = code;
        workload.reason = if code == 0 { "Completed" } else { "Error" }.to_string();
        self.append_log(id, workload, format!("exited with code {code}"));
        self.emit(id, workload);
    }
}
