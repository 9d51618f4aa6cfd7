//! Where a copy of an oci sandbox's files goes: to its running agent, or (it does not run) to
//! the agent on the host, over the sandbox's overlay and volume. Exec and port forwarding go
//! through the running agent too, written once in the host kit ([`sbx_host_kit::running`]).

use super::{OciDriver, record, rootfs};
use sbx_driver_api::{DriverError, parse_sandbox_id};
use sbx_host_kit::agent::{CopyVia, Offline};
use sbx_host_kit::running;

impl OciDriver {
    /// Where a copy of sandbox `sandbox_id` goes: its running agent, or (it does not run)
    /// the agent on the host, over the sandbox's overlay and volume, as the sandbox's root;
    /// FailedPrecondition while it is paused (its agent is frozen).
    pub(super) async fn copy_via(&self, sandbox_id: &str) -> Result<CopyVia, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.records.lock(id).await;
        inner.refuse_if_paused(sandbox_id, "copying files")?;
        let record = inner.records.require(id)?;
        let paths = inner.paths(id);
        if running::runs(inner.as_ref(), &record) {
            return Ok(CopyVia::Running(paths.dir));
        }
        let offline = Offline {
            agent: record::init_dir(&inner.state_dir).join("sbx-agent"),
            overlay: Some(rootfs::overlay_options(
                &inner.lower_dirs(&record, &paths)?,
                &paths.upper,
                &paths.work,
            )),
            sandbox: paths.volume,
            mountpoint: paths.dir.join("offline-root"),
            uid: inner.id_map(&record).host_uid,
            gid: inner.id_map(&record).host_gid,
        };
        Ok(CopyVia::Stopped(offline, lock))
    }
}

/// How many 256 KiB chunks of a layer may wait for the reader.
const LAYER_CHUNKS: usize = 8;

impl OciDriver {
    /// What stopped sandbox `sandbox_id` changed in its root filesystem, as an OCI layer tar
    /// (see `changes`). The sandbox's lock is held until the stream ends, so no start runs
    /// meanwhile; FailedPrecondition while its workload runs.
    pub(super) async fn copy_changes(
        &self,
        sandbox_id: &str,
    ) -> Result<sbx_driver_api::DriverStream<sbx_driver_api::pb::CopyChunk>, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.records.lock(id).await;
        let record = inner.records.require(id)?;
        if running::runs(inner.as_ref(), &record) {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} runs: its changes are read once it has stopped"
            )));
        }
        let upper = inner.paths(id).upper;
        let ids = inner.id_map(&record);
        let (tx, rx) = tokio::sync::mpsc::channel(LAYER_CHUNKS);
        tokio::task::spawn_blocking(move || {
            let _lock = lock;
            let out = ChunkWriter {
                tx: tx.clone(),
                buf: Vec::with_capacity(CHUNK),
            };
            if let Err(e) = super::changes::write_layer(&upper, ids, out) {
                // What the sandbox made that a layer cannot say (a `.wh.` name, an owner
                // outside its ids…) is the sandbox's doing, not a failure of ours.
                let error = match e.kind() {
                    std::io::ErrorKind::InvalidData => DriverError::FailedPrecondition(format!(
                        "sandbox {id}'s changes cannot be a layer: {e}"
                    )),
                    _ => DriverError::Internal(format!("reading sandbox {id}'s changes: {e}")),
                };
                // A reader that went away is not an error worth saying.
                let _ = tx.blocking_send(Err(error));
            }
        });
        Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }
}

const CHUNK: usize = 256 * 1024;

/// A `Write` that hands 256 KiB chunks to a stream's channel.
struct ChunkWriter {
    tx: tokio::sync::mpsc::Sender<Result<sbx_driver_api::pb::CopyChunk, DriverError>>,
    buf: Vec<u8>,
}

impl ChunkWriter {
    fn send(&mut self) -> std::io::Result<()> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let data = std::mem::replace(&mut self.buf, Vec::with_capacity(CHUNK));
        self.tx
            .blocking_send(Ok(sbx_driver_api::pb::CopyChunk { data }))
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "the reader left"))
    }
}

impl std::io::Write for ChunkWriter {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        if self.buf.len() >= CHUNK {
            self.send()?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.send()
    }
}
