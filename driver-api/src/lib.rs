//! The driver boundary: the [`ComputeDriver`] trait that the gateway calls, the errors and
//! streams of its contract, and (feature `conformance`) the suite every driver passes.
//!
//! The trait mirrors the `sbx.driver.v1` contract message for message, so that a driver runs
//! in process or behind a Unix socket with the same behaviour.
//!
//! **Invariant:** a driver resolves a sandbox by its id only. Nothing in this crate looks a
//! sandbox up by name; workspace and name are stored to be reported back, never to be matched.

use std::pin::Pin;

use async_trait::async_trait;
use futures::Stream;
pub use sbx_proto::driver as pb;
use uuid::Uuid;

#[cfg(feature = "conformance")]
pub mod conformance;
mod error;

pub use error::DriverError;

/// Locks `m`, taking the data of a poisoned mutex as it is: every writer keeps it consistent
/// at each step, so a panic elsewhere must not wedge the driver.
pub fn locked<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// A stream of results from a driver (watch events, exec output, log chunks).
pub type DriverStream<T> = Pin<Box<dyn Stream<Item = Result<T, DriverError>> + Send + 'static>>;

/// What a caller sends to an exec after its request: stdin, its end, terminal sizes, signals
/// (never another `start`). Its end is the end of stdin.
pub type ExecInputStream = Pin<Box<dyn Stream<Item = pb::ExecInput> + Send + 'static>>;

/// The bytes of a tar a caller sends to [`ComputeDriver::copy_to`], in order. Its end is the
/// end of the data, and the copy is then taken whole: an upload that failed must never end it
/// (see [`upload`]).
pub type ByteStream = Pin<Box<dyn Stream<Item = Vec<u8>> + Send + 'static>>;

/// A client-streamed upload as a [`ByteStream`], and what ends it early: the stream ends only
/// when `input` ended cleanly; at `input`'s first error it stops where it is — it never ends,
/// so no driver takes what came for the whole — and the second half resolves with that error
/// (it never resolves otherwise). The caller races the copy against it and drops the copy on
/// an error (the copy's connection then ends mid-stream, which the agent refuses; the file it
/// was writing is left under no name). `data` picks the bytes out of each message.
pub fn upload<T, E, S>(
    input: S,
    data: fn(T) -> Option<Vec<u8>>,
) -> (
    ByteStream,
    impl std::future::Future<Output = E> + Send + 'static,
)
where
    S: Stream<Item = Result<T, E>> + Send + 'static,
    T: Send + 'static,
    E: Send + 'static,
{
    use futures::StreamExt;
    let (failed_tx, failed_rx) = futures::channel::oneshot::channel::<E>();
    let mut failed_tx = Some(failed_tx);
    let bytes = input
        .filter_map(move |item| {
            std::future::ready(match item {
                Ok(message) => data(message).map(Ok),
                Err(e) => Some(Err(e)),
            })
        })
        .flat_map(move |item| match item {
            Ok(bytes) => futures::stream::once(std::future::ready(bytes)).boxed(),
            Err(e) => {
                if let Some(tx) = failed_tx.take() {
                    let _ = tx.send(e);
                }
                futures::stream::pending().boxed()
            }
        });
    let failed = async move {
        match failed_rx.await {
            Ok(e) => e,
            // The upload's stream is gone (the copy finished with it): nothing failed.
            Err(_) => std::future::pending().await,
        }
    };
    (Box::pin(bytes), failed)
}

/// What a caller sends on a forwarded connection after its start: data and its half-close.
pub type ForwardInputStream = Pin<Box<dyn Stream<Item = pb::PortForwardInput> + Send + 'static>>;

/// An input stream with nothing in it (an exec without stdin).
/// Refuses a copy of a sandbox's root-filesystem changes (`CopyFromRequest.changes`), for a
/// driver that keeps none apart from the rest.
pub fn refuse_changes(req: &pb::CopyFromRequest) -> Result<(), DriverError> {
    match req.changes {
        true => Err(DriverError::Unimplemented(
            "a sandbox's root-filesystem changes: this driver keeps none apart".into(),
        )),
        false => Ok(()),
    }
}

pub fn no_exec_input() -> ExecInputStream {
    Box::pin(futures::stream::empty())
}

/// A compute driver: something that runs sandbox workloads.
///
/// Every method that names a sandbox takes its id as sent on the wire (a string), and answers
/// [`DriverError::InvalidArgument`] when it is empty or not a UUID — see [`parse_sandbox_id`].
///
/// Semantics every implementation keeps (the conformance suite checks them):
/// - `create` makes the sandbox's resources and starts its workload under the request's
///   generation; it is idempotent for the same id and generation.
/// - `start` of a workload running under the same generation does nothing; under another
///   generation it answers [`DriverError::GenerationMismatch`].
/// - `stop` of a stopped workload does nothing.
/// - `delete` of an absent sandbox answers `deleted = false`.
/// - A workload outlives the driver instance that started it; a new instance opened on the
///   same state finds it again by id, with the same instance id and generation.
#[async_trait]
pub trait ComputeDriver: Send + Sync + 'static {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError>;
    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError>;
    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError>;
    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError>;
    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError>;
    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError>;
    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError>;
    /// Changes the driver observes from now on (for example a workload that exits by itself).
    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError>;
    /// Runs a command in a running sandbox, with `input` (stdin, resizes, signals) as the
    /// caller sends it. A driver without the `exec_stdin`/`exec_tty` capability answers
    /// [`DriverError::Unimplemented`] to a request that asks for stdin or a terminal.
    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError>;
    /// [`ComputeDriver::exec_io`] with no input.
    async fn exec(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.exec_io(req, no_exec_input()).await
    }
    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError>;

    /// A path of a running sandbox as a tar stream (the `copy` capability).
    async fn copy_from(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        let _ = req;
        Err(DriverError::Unimplemented(
            "copying files: this driver cannot".into(),
        ))
    }

    /// Unpacks the tar `data` in a running sandbox at `req.path` (the `copy` capability).
    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        let _ = (req, data);
        Err(DriverError::Unimplemented(
            "copying files: this driver cannot".into(),
        ))
    }

    /// A TCP connection to `req.port` on a running sandbox's loopback (the `port_forward`
    /// capability). Dropping the output stream closes the connection.
    async fn port_forward(
        &self,
        req: pb::PortForwardStart,
        input: ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
        let _ = (req, input);
        Err(DriverError::Unimplemented(
            "port forwarding: this driver cannot".into(),
        ))
    }

    /// Replaces a networked sandbox's egress allowlist while it runs (the `network`
    /// capability): persisted in the driver's record first, then applied in one firewall
    /// transaction.
    async fn update_network(
        &self,
        req: pb::UpdateNetworkRequest,
    ) -> Result<pb::NetworkStatus, DriverError> {
        let _ = req;
        Err(DriverError::Unimplemented(
            "a sandbox network: this driver has none".into(),
        ))
    }

    /// What a sandbox uses now (the `stats` capability): counters since its workload started,
    /// figures of this moment, its limits. NotFound for a sandbox the driver does not know.
    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError> {
        let _ = req;
        Err(DriverError::Unimplemented(
            "usage figures: this driver reads none".into(),
        ))
    }

    /// Saves a running workload's processes and memory to disk and ends them (the `pause`
    /// capability); the snapshot then says `Paused` under the same generation. Pause of a
    /// paused workload does nothing; `FailedPrecondition` when it does not run. A pause that
    /// fails leaves the workload running.
    async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        parse_sandbox_id(&req.sandbox_id)?;
        Err(DriverError::Unimplemented(
            "pausing a sandbox: this driver cannot save a workload's memory".into(),
        ))
    }

    /// Brings a paused workload back: the same processes, memory, open files and sockets,
    /// under the same generation. Resume of a running workload does nothing;
    /// `FailedPrecondition` when it is not paused. A resume that fails keeps what was saved.
    async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        parse_sandbox_id(&req.sandbox_id)?;
        Err(DriverError::Unimplemented(
            "resuming a sandbox: this driver cannot pause one".into(),
        ))
    }

    /// A sandbox's network: policy, address and recent denials (the `network` capability;
    /// without it, every sandbox has loopback only and no denials).
    async fn get_network(
        &self,
        req: pb::GetNetworkRequest,
    ) -> Result<pb::NetworkStatus, DriverError> {
        parse_sandbox_id(&req.sandbox_id)?;
        Ok(pb::NetworkStatus {
            policy: Some(pb::NetworkPolicy {
                mode: pb::NetworkMode::None as i32,
                allow: Vec::new(),
            }),
            ..Default::default()
        })
    }
}

/// Parses the sandbox id of a driver request: empty or malformed ids are
/// [`DriverError::InvalidArgument`].
pub fn parse_sandbox_id(id: &str) -> Result<Uuid, DriverError> {
    if id.is_empty() {
        return Err(DriverError::InvalidArgument(
            "sandbox_id is empty; every driver request must name its sandbox by id".into(),
        ));
    }
    Uuid::parse_str(id)
        .map_err(|e| DriverError::InvalidArgument(format!("sandbox_id {id:?} is not a UUID: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_and_malformed_ids_are_invalid_arguments() {
        for bad in ["", "demo", "123", "00000000-0000-0000-0000-00000000000g"] {
            assert!(
                matches!(parse_sandbox_id(bad), Err(DriverError::InvalidArgument(_))),
                "{bad:?}"
            );
        }
        let id = Uuid::new_v4();
        assert_eq!(parse_sandbox_id(&id.to_string()).unwrap(), id);
    }
}
