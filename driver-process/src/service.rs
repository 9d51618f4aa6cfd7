//! The driver contract for [`ProcessDriver`]: capabilities and create (the cgroups made, the
//! record written). Start, stop, delete (which removes the cgroups here), a create of a known
//! sandbox, the reads (get, list, watch, logs) and the network calls are the host kit's
//! ([`sbx_host_kit::host_compute_driver!`]); exec and port forwarding are the kit's
//! ([`sbx_host_kit::running`]); where a copy goes is in `copy.rs`.

use std::time::Duration;

use async_trait::async_trait;

use super::cgroup::Limits;
use super::record::{RECORD_FORMAT, SandboxRecord, StoredSpec};
use super::{Inner, ProcessDriver};
use sbx_driver_api::{
    ByteStream, DriverError, DriverStream, ExecInputStream, ForwardInputStream, pb,
};
use sbx_host_kit::service::HostService;
use sbx_host_kit::{Desired, internal, lifecycle, validate_command};
use sbx_host_kit::{running, usage};

sbx_host_kit::host_compute_driver!(ProcessDriver, create = create, networked);

#[async_trait]
impl HostService for ProcessDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        let cgroups = &self.inner.cgroups;
        Ok(pb::CapabilitiesResponse {
            network: self.inner.opts.network.is_some(),
            driver: "process".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: cgroups.has_cpu(),
            memory_limit: cgroups.has_memory(),
            persistent_storage: true,
            images: false,
            exec_stdin: true,
            exec_tty: true,
            copy: true,
            port_forward: true,
            copy_when_stopped: true,
            disk_limit: false,
            stats: true,
            // A process sandbox's workload is the host's processes under a user namespace:
            // nothing saves and restores them here (the oci driver's CRIU does).
            pause: false,
            isolation: format!(
                "pid,mount,uts,ipc,net namespaces; uid 0 of a user namespace = {}, \
                 no capabilities; {}; the host's root filesystem as that uid sees it, with a \
                 private /sandbox and the driver's state hidden",
                sbx_host_kit::uidpool::describe(
                    self.inner.opts.uid_pool.as_ref(),
                    &self.inner.opts.id_map
                ),
                cgroups.describe()
            ),
        })
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        running::exec(self.inner.as_ref(), req, input).await
    }

    async fn copy_from(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        sbx_driver_api::refuse_changes(&req)?;
        self.copy_via(&req.sandbox_id, &req.path)
            .await?
            .copy_from(&req)
            .await
    }

    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        self.copy_via(&req.sandbox_id, &req.path)
            .await?
            .copy_to(&req, data)
            .await
    }

    async fn port_forward(
        &self,
        req: pb::PortForwardStart,
        input: ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
        running::port_forward(self.inner.as_ref(), req, input).await
    }

    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError> {
        let id = sbx_driver_api::parse_sandbox_id(&req.sandbox_id)?;
        let inner = self.inner.as_ref();
        let record = inner.records.require(id)?;
        let running = running::runs(inner, &record);
        let mut out = usage::cgroup_usage(&record.cgroups.dirs).message(running);
        if record.network_allow.is_some()
            && let Some(network) = &inner.opts.network
            && let Some((rx, tx)) = usage::link_traffic(&network.host_link(id))
        {
            (out.has_network, out.network_rx_bytes, out.network_tx_bytes) = (true, rx, tx);
        }
        Ok(out)
    }
}

/// Removes the sandbox's cgroups (before a delete removes its directory), killing
/// stragglers; bounded to 5 s.
pub(super) async fn remove_cgroups(record: &SandboxRecord) -> Result<(), DriverError> {
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

/// A create (see [`ComputeDriver::create`]), run detached by the service: a caller that stops
/// waiting does not cut a launch short.
async fn create(inner: &Inner, mut req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
    let id = lifecycle::create_id(&req)?;
    let run_env = sbx_host_kit::command::run_env(std::mem::take(&mut req.run_env))?;
    let spec = req.spec.unwrap_or_default();
    validate_command("the spec", &spec.command, &spec.env)?;
    let network_allow = sbx_network::requested(spec.network.as_ref(), inner.opts.network.as_ref())?;
    let _serialised = inner.records.lock(id).await;
    if let Some(existing) = inner.records.get(id) {
        let asked = (req.workspace.as_str(), req.name.as_str());
        return lifecycle::create_known(inner, existing, asked, req.generation, run_env).await;
    }

    let paths = inner.paths(id);
    paths
        .make_private()
        .map_err(|e| internal("making the sandbox directory", e))?;
    // Leased to the directory: a create killed before its record leaves a directory that
    // open() removes, and with it the lease's owner.
    let id_map = sbx_host_kit::uidpool::lease_for(inner.opts.uid_pool.as_ref(), &paths.dir)?;
    super::launch::make_persistent_dir(&paths.root, &id_map.unwrap_or(inner.opts.id_map))?;
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
    if resources.disk_bytes > 0 {
        warnings.push(
            "disk limit not applied: the process driver writes to the host's filesystem"
                .to_string(),
        );
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
        network_allow,
        id_map,
    };
    // start_run writes the record (once: each durable write costs two fsyncs). A driver
    // killed before that leaves a directory without a record, which open() removes.
    lifecycle::first_run(inner, record, req.generation, req.stopped, run_env).await
}
