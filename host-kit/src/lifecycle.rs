//! The driver contract's calls that every host driver answers the same way, over its
//! [`RecordCache`], and [`HostDriver`], what differs: how a run starts and ends, what a
//! snapshot sees, what a delete removes besides the sandbox's directory.
//!
//! Every lifecycle call of a sandbox holds its lock (a create, start, stop or delete of one
//! sandbox waits for the one before it; calls for other sandboxes do not wait). A stop or a
//! delete makes "desired: stopped" durable before it ends the workload, so a driver killed
//! meanwhile reopens to a sandbox whose stop it finishes. Reads (get, list, watch, logs) take
//! no lock: they read the cache.

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::watch;
use uuid::Uuid;

use super::command::RunEnv;

use super::Desired;
use super::contract::{self, Known};
use super::feed::{self, SnapshotFeed, Watched};
use super::logfile::{LogQuery, log_stream};
use super::records::{HostRecord, RecordCache};
use sbx_driver_api::{DriverError, DriverStream, parse_sandbox_id, pb};

/// The accessors of [`HostDriver`] that every host driver's state answers alike, written once:
/// inside `impl HostDriver for …`, `sbx_host_kit::host_driver_state!();` reads the fields
/// `records` and `feed` and the options `opts.default_grace` and `opts.poll_interval`.
#[macro_export]
macro_rules! host_driver_state {
    () => {
        fn records(&self) -> &$crate::records::RecordCache<Self::Record> {
            &self.records
        }

        fn feed(&self) -> &$crate::feed::SnapshotFeed {
            &self.feed
        }

        fn default_grace(&self) -> ::std::time::Duration {
            self.opts.default_grace
        }

        fn poll_interval(&self) -> ::std::time::Duration {
            self.opts.poll_interval
        }
    };
}

/// What a host driver does its own way. The lifecycle calls here use it under the sandbox's
/// lock.
pub trait HostDriver: Send + Sync + 'static {
    type Record: HostRecord;
    /// The driver's name, in its watch's errors.
    const NAME: &'static str;

    fn records(&self) -> &RecordCache<Self::Record>;
    fn feed(&self) -> &SnapshotFeed;
    /// What the sandbox looks like now, from its record and what the driver finds.
    fn snapshot(&self, record: &Self::Record) -> pb::Snapshot;
    /// How long a stop waits for the workload to end by itself when the request says 0.
    fn default_grace(&self) -> Duration;
    /// How often the watch's poller looks for workloads that changed by themselves.
    fn poll_interval(&self) -> Duration;
    /// The sandbox's log file (what `logs` tails and follows).
    fn log_file(&self, id: Uuid) -> PathBuf;
    /// How often a followed log is read: the poll interval, at most 100 ms.
    fn log_poll_interval(&self) -> Duration {
        self.poll_interval().min(Duration::from_millis(100))
    }
    /// How long a delete waits for the workload to end by itself.
    fn delete_grace(&self) -> Duration {
        self.default_grace()
    }

    /// Starts a new run under `generation`, the record durable before the launch, with
    /// `run_env` on top of the spec's environment (never stored); publishes the new snapshot.
    fn start_run(
        &self,
        record: Self::Record,
        generation: u64,
        run_env: RunEnv,
    ) -> impl Future<Output = Result<pb::Snapshot, DriverError>> + Send;
    /// Ends the workload, waiting `grace` for it to end by itself. Bounded.
    fn terminate(
        &self,
        record: &Self::Record,
        grace: Duration,
    ) -> impl Future<Output = Result<(), DriverError>> + Send;
    /// What a delete removes, once the workload has ended, before the sandbox's directory.
    fn before_removal(
        &self,
        _record: &Self::Record,
    ) -> impl Future<Output = Result<(), DriverError>> + Send {
        async { Ok(()) }
    }
    /// What the driver lets go of once the sandbox's directory is gone (its uid range).
    fn after_removal(&self, _record: &Self::Record) {}
    /// What the driver forgets of a deleted sandbox besides its record.
    fn forget(&self, _id: Uuid) {}
    /// The process whose end is the run's end (its init), while it runs: the feed waits on
    /// it, so an exit is published at once ([`Watched::run_init`]). None: found by polling.
    fn live_init(&self, _record: &Self::Record) -> Option<super::procfs::ProcessIdentity> {
        None
    }
}

impl<D: HostDriver> Watched for D {
    fn feed(&self) -> &SnapshotFeed {
        HostDriver::feed(self)
    }

    fn current(&self) -> Vec<(Uuid, pb::Snapshot)> {
        let records = self.records().all();
        records
            .iter()
            .map(|r| (r.sandbox_id(), self.snapshot(r)))
            .collect()
    }

    fn exists(&self, id: Uuid) -> bool {
        self.records().contains(id)
    }

    fn run_init(&self, id: Uuid) -> Option<super::procfs::ProcessIdentity> {
        self.live_init(&self.records().get(id)?)
    }
}

/// Held by a driver and dropped with it, which ends the watch and log streams it handed out.
#[derive(Debug)]
pub struct Alive(watch::Sender<()>);

impl Default for Alive {
    fn default() -> Alive {
        Alive::new()
    }
}

impl Alive {
    pub fn new() -> Alive {
        Alive(watch::channel(()).0)
    }

    /// Resolves when the driver holding this is dropped.
    pub fn dropped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut alive = self.0.subscribe();
        async move { while alive.changed().await.is_ok() {} }
    }
}

/// Runs a lifecycle call `op` as its own task and waits for it; if the caller stops waiting (its
/// deadline passed, its connection went), the task still finishes, holding the sandbox's lock,
/// so later calls for the sandbox queue behind it. Without it a stop whose grace period outlasts
/// the caller's deadline would be cut off before its SIGKILL on every retry, and never end a
/// workload that ignores SIGTERM.
pub async fn detach<T: Send + 'static>(
    op: impl Future<Output = Result<T, DriverError>> + Send + 'static,
) -> Result<T, DriverError> {
    tokio::spawn(op)
        .await
        .map_err(|e| super::internal("a lifecycle call's task failed", e))?
}

/// The id a create names, and its name checked (DNS-1123 label).
pub fn create_id(req: &pb::CreateRequest) -> Result<Uuid, DriverError> {
    let id = parse_sandbox_id(&req.sandbox_id)?;
    sbx_proto::names::validate_name(&req.name)
        .map_err(|e| DriverError::InvalidArgument(format!("sandbox name {:?}: {e}", req.name)))?;
    Ok(id)
}

/// A create of a sandbox the driver already has (the caller holds its lock): the contract's
/// rules ([`contract::known_create`]); when they say launch, whatever is left of the earlier
/// run ends and a new one starts.
pub async fn create_known<D: HostDriver>(
    driver: &D,
    existing: D::Record,
    (workspace, name): (&str, &str),
    generation: u64,
    run_env: RunEnv,
) -> Result<pb::Snapshot, DriverError> {
    let snapshot = driver.snapshot(&existing);
    let wants_running = existing.desired() == Desired::Running;
    let known = (existing.workspace(), existing.name());
    match contract::known_create(
        known,
        (workspace, name),
        generation,
        snapshot,
        wants_running,
    )? {
        Known::Answer(snapshot) => Ok(snapshot),
        // Known but not running (a create retried after an interrupted launch, or under a
        // new generation): start it.
        Known::Launch => {
            driver.terminate(&existing, Duration::ZERO).await?;
            driver.start_run(existing, generation, run_env).await
        }
    }
}

/// The first run of a sandbox just made (its record not yet written): launched under
/// `generation`, or, for a create that asks for the sandbox `stopped`, none: the record is
/// written wanting stopped and its snapshot (Stopped) published, so that the sandbox's files
/// exist before its first start.
pub async fn first_run<D: HostDriver>(
    driver: &D,
    mut record: D::Record,
    generation: u64,
    stopped: bool,
    run_env: RunEnv,
) -> Result<pb::Snapshot, DriverError> {
    if !stopped {
        return driver.start_run(record, generation, run_env).await;
    }
    record.set_desired(Desired::Stopped);
    driver.records().save(&record)?;
    let snapshot = driver.snapshot(&record);
    feed::publish(driver, record.sandbox_id(), &snapshot);
    Ok(snapshot)
}

pub async fn start<D: HostDriver>(
    driver: &D,
    req: pb::StartRequest,
) -> Result<pb::Snapshot, DriverError> {
    let id = parse_sandbox_id(&req.sandbox_id)?;
    let run_env = super::command::run_env(req.run_env)?;
    let _serialised = driver.records().lock(id).await;
    let record = driver.records().require(id)?;
    let snapshot = driver.snapshot(&record);
    let wants_running = record.desired() == Desired::Running;
    if let Known::Answer(snapshot) = contract::known_start(snapshot, wants_running, req.generation)?
    {
        return Ok(snapshot);
    }
    // Whatever is left of an earlier run (a half-finished stop) goes first.
    driver.terminate(&record, Duration::ZERO).await?;
    driver.start_run(record, req.generation, run_env).await
}

pub async fn stop<D: HostDriver>(
    driver: &D,
    req: pb::StopRequest,
) -> Result<pb::Snapshot, DriverError> {
    let id = parse_sandbox_id(&req.sandbox_id)?;
    let _serialised = driver.records().lock(id).await;
    let record = driver.records().require(id)?;
    let grace = match req.grace_period_ms {
        0 => driver.default_grace(),
        ms => Duration::from_millis(u64::from(ms)),
    };
    let record = persist_stopped(driver, record)?;
    driver.terminate(&record, grace).await?;
    let snapshot = driver.snapshot(&record);
    feed::publish(driver, id, &snapshot);
    Ok(snapshot)
}

/// A delete: the workload ended (after [`HostDriver::delete_grace`]), what the driver made
/// outside the sandbox's directory removed, the directory removed through the trash, the
/// last snapshot published as deleted, the sandbox's lock forgotten.
pub async fn delete<D: HostDriver>(
    driver: &D,
    req: pb::DeleteRequest,
) -> Result<pb::DeleteResponse, DriverError> {
    let id = parse_sandbox_id(&req.sandbox_id)?;
    let records = driver.records();
    let _serialised = records.lock(id).await;
    let Some(record) = records.get(id) else {
        return Ok(pb::DeleteResponse { deleted: false });
    };
    let record = persist_stopped(driver, record)?;
    driver.terminate(&record, driver.delete_grace()).await?;
    let last = driver.snapshot(&record);
    driver.before_removal(&record).await?;
    records.remove(id)?;
    driver.after_removal(&record);
    driver.forget(id);
    crate::ptys::forget(id);
    feed::publish_deleted(driver, id, last);
    records.forget_lock(id);
    Ok(pb::DeleteResponse { deleted: true })
}

/// The record with "desired: stopped", written first if it said otherwise.
fn persist_stopped<D: HostDriver>(
    driver: &D,
    mut record: D::Record,
) -> Result<D::Record, DriverError> {
    if record.desired() != Desired::Stopped {
        record.set_desired(Desired::Stopped);
        driver.records().save(&record)?;
    }
    Ok(record)
}

pub fn get<D: HostDriver>(driver: &D, req: &pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
    let id = parse_sandbox_id(&req.sandbox_id)?;
    let record = driver.records().require(id)?;
    Ok(driver.snapshot(&record))
}

/// Every sandbox's snapshot, by id.
pub fn list<D: HostDriver>(driver: &D) -> Vec<pb::Snapshot> {
    let records = driver.records().sorted();
    records.iter().map(|r| driver.snapshot(r)).collect()
}

/// The watch feed ([`feed::watch`]), ended when the driver is dropped.
pub fn watch<D: HostDriver>(driver: &Arc<D>, alive: &Alive) -> DriverStream<pb::WatchEvent> {
    let events = feed::watch(driver, D::NAME, driver.poll_interval());
    Box::pin(events.take_until(alive.dropped()))
}

/// The sandbox's log: its last lines (from `since`), then (when following) what is appended,
/// until the sandbox is deleted or the driver dropped; each chunk with its stream and time
/// (see [`super::logfile`]).
pub fn logs<D: HostDriver>(
    driver: &Arc<D>,
    req: &pb::LogsRequest,
    alive: &Alive,
) -> Result<DriverStream<pb::LogChunk>, DriverError> {
    let id = parse_sandbox_id(&req.sandbox_id)?;
    driver.records().require(id)?;
    let weak = Arc::downgrade(driver);
    let exists = move || weak.upgrade().is_some_and(|d| d.records().contains(id));
    let stream = log_stream(
        driver.log_file(id),
        LogQuery::from(req),
        driver.log_poll_interval(),
        exists,
    )?;
    Ok(Box::pin(stream.take_until(alive.dropped())))
}
