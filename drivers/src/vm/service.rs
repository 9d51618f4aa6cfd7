//! The driver contract for [`VmDriver`]: the lifecycle calls. Streams are in `streams.rs`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::record::{self, RECORD_FORMAT, VmRecord, VmSpec};
use super::{Inner, VmDriver, qemu};
use crate::host::contract::{self, Known};
use crate::host::{Desired, feed, internal, locked, validate_command};
use crate::{ComputeDriver, DriverError, DriverStream, parse_sandbox_id, pb};

/// The least memory a guest boots with.
const MIN_MEMORY_MIB: u64 = 128;

/// The guest runs the command through a shell script: variable names must be identifiers.
pub(super) fn validate_env_names<'a>(
    what: &str,
    env: impl IntoIterator<Item = &'a String>,
) -> Result<(), DriverError> {
    for key in env {
        let mut chars = key.chars();
        let first_ok = chars
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
        if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(DriverError::InvalidArgument(format!(
                "{what}: environment variable {key:?} is not a shell identifier (letters, digits \
                 and _, not starting with a digit), which the vm driver needs"
            )));
        }
    }
    Ok(())
}

/// Makes the sandbox's persistent disk: a raw image (`qemu-img`) with an ext4 filesystem, made
/// under a temporary name and renamed, so a killed driver never leaves half a disk.
async fn make_disk(path: &std::path::Path, size_mib: u64) -> Result<(), DriverError> {
    let tmp = path.with_extension("img.tmp");
    let run = |program: &str, args: Vec<String>| {
        let program = program.to_string();
        async move {
            let out = tokio::process::Command::new(&program)
                .args(&args)
                .stdin(std::process::Stdio::null())
                .output()
                .await
                .map_err(|e| internal(&format!("running {program}"), e))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(DriverError::Internal(format!(
                    "{program} failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )))
            }
        }
    };
    let tmp_s = tmp.display().to_string();
    run(
        "qemu-img",
        vec![
            "create".into(),
            "-q".into(),
            "-f".into(),
            "raw".into(),
            tmp_s.clone(),
            format!("{size_mib}M"),
        ],
    )
    .await?;
    run(
        "mkfs.ext4",
        vec![
            "-q".into(),
            "-F".into(),
            "-L".into(),
            "sandbox".into(),
            tmp_s,
        ],
    )
    .await?;
    std::fs::rename(&tmp, path).map_err(|e| internal("placing the disk image", e))
}

#[async_trait]
impl ComputeDriver for VmDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        Ok(pb::CapabilitiesResponse {
            driver: "vm".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: true,
            memory_limit: true,
            persistent_storage: true,
            images: false,
            isolation: format!(
                "QEMU microVM ({}), its own kernel ({}); a persistent ext4 disk at /sandbox; \
                 no network",
                match self.inner.accel {
                    qemu::Accel::Kvm => "KVM",
                    _ => "TCG emulation",
                },
                self.inner.assets.kernel_version
            ),
        })
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let ops = self.ops();
        detach(async move { ops.create(req).await }).await
    }

    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let ops = self.ops();
        detach(async move { ops.start(req).await }).await
    }

    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let ops = self.ops();
        detach(async move { ops.stop(req).await }).await
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        let ops = self.ops();
        detach(async move { ops.delete(req).await }).await
    }

    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let rec = self.inner.require(id)?;
        Ok(self.inner.snapshot(&rec))
    }

    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        let mut records: Vec<VmRecord> = locked(&self.inner.records).values().cloned().collect();
        records.sort_by_key(|r| r.sandbox_id);
        Ok(records.iter().map(|r| self.inner.snapshot(r)).collect())
    }

    async fn watch(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        self.watch_stream()
    }

    async fn exec(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.exec_stream(req).await
    }

    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        self.logs_stream(req)
    }
}

/// The lifecycle calls, run by [`detach`] so that a caller giving up (a deadline, a dropped
/// connection) cannot cut one short between launching QEMU and recording it: a VM nobody
/// recorded would be booted a second time on the same disk.
pub(super) struct Ops {
    pub(super) inner: Arc<Inner>,
}

/// Runs `op` as its own task and waits for it; if the caller stops waiting, the task still
/// finishes (holding the sandbox's lock, so later calls for the sandbox queue behind it).
async fn detach<T: Send + 'static>(
    op: impl Future<Output = Result<T, DriverError>> + Send + 'static,
) -> Result<T, DriverError> {
    tokio::spawn(op)
        .await
        .map_err(|e| internal("a lifecycle call's task failed", e))?
}

impl VmDriver {
    fn ops(&self) -> Ops {
        Ops {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl Ops {
    pub(super) async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        sbx_proto::names::validate_name(&req.name).map_err(|e| {
            DriverError::InvalidArgument(format!("sandbox name {:?}: {e}", req.name))
        })?;
        let spec = req.spec.unwrap_or_default();
        validate_command("the spec", &spec.command, &spec.env)?;
        validate_env_names("the spec", spec.env.keys())?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;

        if let Some(existing) = inner.record(id) {
            let snapshot = inner.snapshot(&existing);
            let wants_running = existing.desired == Desired::Running;
            let known = (existing.workspace.as_str(), existing.name.as_str());
            let asked = (req.workspace.as_str(), req.name.as_str());
            return match contract::known_create(
                known,
                asked,
                req.generation,
                snapshot,
                wants_running,
            )? {
                Known::Answer(snapshot) => Ok(snapshot),
                Known::Launch => {
                    inner.terminate(&existing, Duration::ZERO).await?;
                    inner.start_run(existing, req.generation).await
                }
            };
        }

        let paths = inner.paths(id);
        std::fs::create_dir_all(&paths.dir)
            .map_err(|e| internal("making the sandbox directory", e))?;
        if !paths.disk.exists() {
            make_disk(&paths.disk, inner.opts.disk_mib).await?;
        }
        let resources = spec.resources.unwrap_or_default();
        let memory_mib = match resources.memory_bytes {
            0 => inner.opts.memory_mib,
            bytes => (bytes / (1024 * 1024)).max(MIN_MEMORY_MIB),
        };
        let cpus = resources.cpu_millis.div_ceil(1000).max(1);
        let mut warnings = Vec::new();
        if !spec.image.is_empty() {
            warnings.push(format!(
                "image {:?} ignored: the vm driver boots every guest from its busybox initramfs",
                spec.image
            ));
        }
        if inner.assets.compressed_kernel {
            warnings.push(
                "the kernel boots from its compressed image (slower): no xz, zstd or gzip on the \
                 host unpacked it"
                    .to_string(),
            );
        }
        if resources.memory_bytes > 0 && resources.memory_bytes < MIN_MEMORY_MIB * 1024 * 1024 {
            warnings.push(format!(
                "memory raised to the {MIN_MEMORY_MIB} MiB a guest needs to boot"
            ));
        }
        let rec = VmRecord {
            format: RECORD_FORMAT,
            sandbox_id: id,
            workspace: req.workspace,
            name: req.name,
            spec: VmSpec {
                command: spec.command,
                env: spec.env.into_iter().collect(),
                memory_mib,
                cpus,
                image: spec.image,
            },
            desired: Desired::Running,
            run_id: String::new(),
            launched_at_ms: 0,
            console_offset: 0,
            qemu: None,
            warnings,
        };
        inner.start_run(rec, req.generation).await
    }

    pub(super) async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;
        let rec = inner.require(id)?;
        let snapshot = inner.snapshot(&rec);
        let wants_running = rec.desired == Desired::Running;
        if let Known::Answer(snapshot) =
            contract::known_start(snapshot, wants_running, req.generation)?
        {
            return Ok(snapshot);
        }
        // Whatever is left of an earlier run (a half-finished stop) goes first.
        inner.terminate(&rec, Duration::ZERO).await?;
        inner.start_run(rec, req.generation).await
    }

    pub(super) async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;
        let mut rec = inner.require(id)?;
        let grace = match req.grace_period_ms {
            0 => inner.opts.default_grace,
            ms => Duration::from_millis(u64::from(ms)),
        };
        if rec.desired != Desired::Stopped {
            rec.desired = Desired::Stopped;
            inner.save(&rec)?;
        }
        inner.terminate(&rec, grace).await?;
        let snapshot = inner.snapshot(&rec);
        feed::publish(inner.as_ref(), id, &snapshot);
        Ok(snapshot)
    }

    pub(super) async fn delete(
        &self,
        req: pb::DeleteRequest,
    ) -> Result<pb::DeleteResponse, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;
        let Some(mut rec) = inner.record(id) else {
            return Ok(pb::DeleteResponse { deleted: false });
        };
        if rec.desired != Desired::Stopped {
            rec.desired = Desired::Stopped;
            inner.save(&rec)?;
        }
        // Nothing to keep: the disk goes too, so no graceful power-off.
        inner.terminate(&rec, Duration::ZERO).await?;
        let last = inner.snapshot(&rec);
        let paths = inner.paths(id);
        // Rename first: a driver killed during the removal leaves trash (emptied at open).
        let trash = record::trash_dir(&inner.state_dir).join(format!("{id}-{}", Uuid::new_v4()));
        std::fs::rename(&paths.dir, &trash)
            .map_err(|e| internal("moving the sandbox to the trash", e))?;
        locked(&inner.records).remove(&id);
        locked(&inner.finished).remove(&id);
        locked(&inner.exec_locks).remove(&id);
        if let Err(e) = std::fs::remove_dir_all(&trash) {
            tracing::warn!(sandbox_id = %id, error = %e, "deleted sandbox's files not all removed");
        }
        feed::publish_deleted(inner.as_ref(), id, last);
        let mut locks = locked(&inner.locks);
        if locks
            .get(&id)
            .is_some_and(|l| std::sync::Arc::strong_count(l) <= 2)
        {
            locks.remove(&id);
        }
        Ok(pb::DeleteResponse { deleted: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_names_must_be_identifiers() {
        let ok = ["A".to_string(), "_x1".to_string(), "PATH".to_string()];
        assert!(validate_env_names("t", ok.iter()).is_ok());
        for bad in ["1A", "A-B", "A B", "", "Ä"] {
            let err = validate_env_names("t", [bad.to_string()].iter()).unwrap_err();
            assert!(
                matches!(err, DriverError::InvalidArgument(ref m) if m.contains("identifier")),
                "{bad}: {err}"
            );
        }
    }
}
