//! The driver contract for [`ProcessDriver`]: the lifecycle calls. Streams (watch, exec, logs)
//! are in `streams.rs`.

use std::time::Duration;

use async_trait::async_trait;
use uuid::Uuid;

use super::ProcessDriver;
use super::cgroup::Limits;
use super::record::{self, RECORD_FORMAT, SandboxRecord, StoredSpec};
use crate::host::contract::{self, Known};
use crate::host::{Desired, feed, internal, locked, validate_command};
use crate::{ComputeDriver, DriverError, DriverStream, parse_sandbox_id, pb};

#[async_trait]
impl ComputeDriver for ProcessDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        let cgroups = &self.inner.cgroups;
        Ok(pb::CapabilitiesResponse {
            driver: "process".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: cgroups.has_cpu(),
            memory_limit: cgroups.has_memory(),
            persistent_storage: true,
            images: false,
            isolation: format!(
                "pid,mount,uts,ipc,net namespaces; uid 0 of a user namespace = host uid {}, \
                 no capabilities; {}; the host's root filesystem as that uid sees it, with a \
                 private /sandbox and the driver's state hidden",
                self.inner.tools.jail.id_map.host_uid,
                cgroups.describe()
            ),
        })
    }

    async fn create(&self, req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        sbx_proto::names::validate_name(&req.name).map_err(|e| {
            DriverError::InvalidArgument(format!("sandbox name {:?}: {e}", req.name))
        })?;
        let spec = req.spec.unwrap_or_default();
        validate_command("the spec", &spec.command, &spec.env)?;
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
                // Known but not running (a create retried after an interrupted launch, or
                // under a new generation): start it.
                Known::Launch => {
                    inner.terminate(&existing, Duration::ZERO).await?;
                    inner.start_run(existing, req.generation).await
                }
            };
        }

        let paths = inner.paths(id);
        super::launch::make_persistent_dir(&paths.root, &inner.tools.jail.id_map)?;
        let resources = spec.resources.unwrap_or_default();
        let limits = Limits {
            cpu_millis: resources.cpu_millis,
            memory_bytes: resources.memory_bytes,
        };
        let (cgroups, mut warnings) =
            inner
                .cgroups
                .create_sandbox(&inner.opts.cgroup_parent, id, limits);
        if inner.tools.bash.is_none() {
            warnings.push(super::launch::NO_BASH_WARNING.to_string());
        }
        if !spec.image.is_empty() {
            warnings.push(format!(
                "image {:?} ignored: the process driver runs host programs on the host's root filesystem",
                spec.image
            ));
        }
        let record = SandboxRecord {
            format: RECORD_FORMAT,
            sandbox_id: id,
            workspace: req.workspace,
            name: req.name,
            spec: StoredSpec {
                command: spec.command,
                env: spec.env.into_iter().collect(),
                cpu_millis: resources.cpu_millis,
                memory_bytes: resources.memory_bytes,
                image: spec.image,
            },
            generation: req.generation,
            desired: Desired::Running,
            launched_at_ms: 0,
            oom_kills_at_launch: 0,
            run_id: String::new(),
            cgroups,
            warnings,
        };
        // start_run writes the record (once: each durable write costs two fsyncs). A driver
        // killed before that leaves a directory without a record, which open() removes.
        inner.start_run(record, req.generation).await
    }

    async fn start(&self, req: pb::StartRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;
        let record = inner.require(id)?;
        let snapshot = inner.snapshot(&record);
        let wants_running = record.desired == Desired::Running;
        if let Known::Answer(snapshot) =
            contract::known_start(snapshot, wants_running, req.generation)?
        {
            return Ok(snapshot);
        }
        // Whatever is left of an earlier run (a half-finished stop) goes first.
        inner.terminate(&record, Duration::ZERO).await?;
        inner.start_run(record, req.generation).await
    }

    async fn stop(&self, req: pb::StopRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;
        let mut record = inner.require(id)?;
        let grace = match req.grace_period_ms {
            0 => inner.opts.default_grace,
            ms => Duration::from_millis(u64::from(ms)),
        };
        if record.desired != Desired::Stopped {
            record.desired = Desired::Stopped;
            inner.save(&record)?;
        }
        inner.terminate(&record, grace).await?;
        let snapshot = inner.snapshot(&record);
        feed::publish(inner.as_ref(), id, &snapshot);
        Ok(snapshot)
    }

    async fn delete(&self, req: pb::DeleteRequest) -> Result<pb::DeleteResponse, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.lock_for(id);
        let _serialised = lock.lock().await;
        let Some(mut record) = inner.record(id) else {
            return Ok(pb::DeleteResponse { deleted: false });
        };
        if record.desired != Desired::Stopped {
            record.desired = Desired::Stopped;
            inner.save(&record)?;
        }
        inner.terminate(&record, inner.opts.default_grace).await?;
        let last = inner.snapshot(&record);
        remove_cgroups(&record).await?;
        let paths = inner.paths(id);
        // Rename first: a driver killed during the removal leaves trash (emptied at open), not a
        // half-deleted sandbox.
        let trash = record::trash_dir(&inner.state_dir).join(format!("{id}-{}", Uuid::new_v4()));
        std::fs::rename(&paths.dir, &trash)
            .map_err(|e| internal("moving the sandbox to the trash", e))?;
        locked(&inner.records).remove(&id);
        if let Err(e) = std::fs::remove_dir_all(&trash) {
            tracing::warn!(sandbox_id = %id, error = %e, "deleted sandbox's files not all removed");
        }
        feed::publish_deleted(inner.as_ref(), id, last);
        // Forget the sandbox's lock unless another call waits on it (the map's and ours are the
        // only references): a waiter must keep serialising against later calls for this id.
        let mut locks = locked(&inner.locks);
        if locks
            .get(&id)
            .is_some_and(|l| std::sync::Arc::strong_count(l) <= 2)
        {
            locks.remove(&id);
        }
        Ok(pb::DeleteResponse { deleted: true })
    }

    async fn get(&self, req: pb::GetRequest) -> Result<pb::Snapshot, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        let record = self.inner.require(id)?;
        Ok(self.inner.snapshot(&record))
    }

    async fn list(&self) -> Result<Vec<pb::Snapshot>, DriverError> {
        let mut records: Vec<SandboxRecord> =
            locked(&self.inner.records).values().cloned().collect();
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
        self.exec_stream(req)
    }

    async fn logs(&self, req: pb::LogsRequest) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        self.logs_stream(req)
    }
}

/// Removes the sandbox's cgroups, killing stragglers; bounded to 5 s.
async fn remove_cgroups(record: &SandboxRecord) -> Result<(), DriverError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    loop {
        match record.cgroups.remove() {
            Ok(()) => return Ok(()),
            Err(e) if tokio::time::Instant::now() >= deadline => {
                return Err(internal("removing the sandbox's cgroup", e));
            }
            Err(_) => {
                record.cgroups.kill_all();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}
