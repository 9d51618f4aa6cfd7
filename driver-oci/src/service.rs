//! The driver contract for [`OciDriver`]: capabilities and create (the image resolved into
//! what the sandbox runs). Start, stop, delete, a create of a known sandbox, the reads (get,
//! list, watch, logs) and the network calls are the host kit's
//! ([`sbx_host_kit::host_compute_driver!`]); pause and resume are in `pause.rs`; exec and port
//! forwarding are the kit's ([`sbx_host_kit::running`]); where a copy goes is in `copy.rs`.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;

use async_trait::async_trait;
use nix::unistd::{Gid, Uid, chown};

use super::record::{self, ImageRun, OciRecord, RECORD_FORMAT};
use super::{Inner, OciDriver};
use sbx_driver_api::{
    ByteStream, DriverError, DriverStream, ExecInputStream, ForwardInputStream, pb,
};
use sbx_host_kit::service::HostService;
use sbx_host_kit::{Desired, internal, lifecycle};
use sbx_host_kit::{running, usage};
use sbx_images::ImageInfo;

// The kit's impl with pause and resume added (the kit's macro has no arm for them: the vm
// driver adds its own the same way), and the network calls of its `networked` arm.
sbx_host_kit::host_compute_driver!(@impl OciDriver, create {
    async fn pause(&self, req: pb::PauseRequest) -> Result<pb::Snapshot, DriverError> {
        let inner = Arc::clone(&self.inner);
        lifecycle::detach(async move { inner.pause(req).await }).await
    }

    async fn resume(&self, req: pb::ResumeRequest) -> Result<pb::Snapshot, DriverError> {
        let inner = Arc::clone(&self.inner);
        lifecycle::detach(async move { inner.resume(req).await }).await
    }

    async fn update_network(
        &self,
        req: pb::UpdateNetworkRequest,
    ) -> Result<pb::NetworkStatus, DriverError> {
        let inner = Arc::clone(&self.inner);
        lifecycle::detach(async move {
            let network = inner.opts.network.as_ref();
            sbx_host_kit::sandbox_network::update(&inner.records, network, req).await
        })
        .await
    }

    async fn get_network(
        &self,
        req: pb::GetNetworkRequest,
    ) -> Result<pb::NetworkStatus, DriverError> {
        let network = self.inner.opts.network.as_ref();
        sbx_host_kit::sandbox_network::get(&self.inner.records, network, req).await
    }
});

#[async_trait]
impl HostService for OciDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        Ok(pb::CapabilitiesResponse {
            driver: "oci".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: true,
            memory_limit: true,
            persistent_storage: true,
            images: true,
            exec_stdin: true,
            exec_tty: true,
            copy: true,
            port_forward: true,
            copy_when_stopped: true,
            network: self.inner.opts.network.is_some(),
            disk_limit: true,
            stats: true,
            // The cgroup freezer (see `pause.rs`), where the host has one.
            pause: super::cgroup::freezer_available(),
            isolation: format!(
                "OCI container ({}): user namespace (root = {}), pid/mount/uts/ipc/\
                 net/cgroup namespaces, default capabilities, no_new_privs, seccomp, masked \
                 /proc and /sys, cpu/memory/disk/pids limits; overlay root filesystem from the image",
                self.inner.runtime.binary.display(),
                sbx_host_kit::uidpool::describe(
                    self.inner.opts.uid_pool.as_ref(),
                    &self.inner.opts.id_map
                ),
            ),
        })
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.inner.refuse_if_paused(&req.sandbox_id, "exec")?;
        running::exec(self.inner.as_ref(), req, input).await
    }

    async fn copy_from(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        if req.changes {
            return self.copy_changes(&req.sandbox_id).await;
        }
        self.copy_via(&req.sandbox_id).await?.copy_from(&req).await
    }

    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        self.copy_via(&req.sandbox_id)
            .await?
            .copy_to(&req, data)
            .await
    }

    async fn port_forward(
        &self,
        req: pb::PortForwardStart,
        input: ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
        self.inner
            .refuse_if_paused(&req.sandbox_id, "port forwarding")?;
        running::port_forward(self.inner.as_ref(), req, input).await
    }

    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError> {
        let id = sbx_driver_api::parse_sandbox_id(&req.sandbox_id)?;
        let inner = self.inner.as_ref();
        let record = inner.records.require(id)?;
        let running = running::runs(inner, &record);
        let cgroups = usage::cgroup_usage(&usage::hierarchy_dirs(&record.cgroup_path));
        let mut out = cgroups.message(running);
        // The limits are the record's when the runtime's cgroup is gone (a stopped sandbox).
        if out.cpu_limit_millis == 0 {
            out.cpu_limit_millis = u64::from(record.cpu_millis);
        }
        if out.memory_limit_bytes == 0 {
            out.memory_limit_bytes = record.memory_bytes;
        }
        if let Some((used, size)) = usage::disk_usage(&inner.paths(id).disk, record.disk_bytes) {
            (out.has_disk, out.disk_used_bytes, out.disk_limit_bytes) = (true, used, size);
        }
        if record.network_allow.is_some()
            && let Some(network) = &inner.opts.network
            && let Some((rx, tx)) = usage::link_traffic(&network.host_link(id))
        {
            (out.has_network, out.network_rx_bytes, out.network_tx_bytes) = (true, rx, tx);
        }
        Ok(out)
    }
}

impl Inner {
    /// The image a create names: its manifest digest must be in the store.
    fn image(&self, digest: &str) -> Result<ImageInfo, DriverError> {
        if digest.is_empty() {
            return Err(DriverError::InvalidArgument(
                "the oci driver runs images: the spec's image must be the manifest digest of \
                 an image in the gateway's image store"
                    .to_string(),
            ));
        }
        sbx_host_kit::image_process::stored_image(&self.images, digest)
    }

    /// The sandbox's directories: walkable to the rootfs by the sandbox's root (its host gid)
    /// and by no one else (`record::make_private`), the writable layer and the volume its own,
    /// the overlay's work dir host root's.
    fn make_sandbox_dirs(
        &self,
        paths: &record::SandboxPaths,
        id_map: sbx_images::IdMap,
    ) -> Result<(), DriverError> {
        let io = |what: &str, e: std::io::Error| internal(what, e);
        for dir in [&paths.dir, &paths.disk, &paths.bundle, &paths.rootfs] {
            record::make_walkable_dir(dir).map_err(|e| io("making the sandbox directory", e))?;
        }
        record::make_private(paths, id_map)
            .map_err(|e| io("making the sandbox's state private", e))?;
        let uid = Some(Uid::from_raw(id_map.host_uid));
        let gid = Some(Gid::from_raw(id_map.host_gid));
        for dir in [&paths.upper, &paths.volume] {
            std::fs::create_dir_all(dir).map_err(|e| io("making the sandbox directory", e))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755))
                .map_err(|e| io("setting a sandbox directory's mode", e))?;
            chown(dir, uid, gid).map_err(|e| internal("handing a directory to the sandbox", e))?;
        }
        std::fs::create_dir_all(&paths.work).map_err(|e| io("making the overlay work dir", e))?;
        Ok(())
    }
}

/// What the sandbox runs, from the image's config and the spec: the spec's command (else
/// Entrypoint + Cmd), the image's Env with the spec's variables replacing same-named ones (a
/// default PATH when neither sets one, and HOSTNAME), WorkingDir (else `/`), User.
fn image_run(
    image: &ImageInfo,
    spec: &pb::SandboxSpec,
    hostname: &str,
    layers: Vec<std::path::PathBuf>,
) -> Result<ImageRun, DriverError> {
    let process = sbx_host_kit::image_process::image_process(
        &image.config,
        &spec.command,
        &spec.env,
        hostname,
    );
    process.validate(&spec.image)?;
    Ok(ImageRun {
        digest: image.digest.clone(),
        layers,
        args: process.args,
        env: process.env,
        cwd: process.cwd,
        user: process.user,
    })
}

/// A create (see [`ComputeDriver::create`]), run detached by the service: a caller that stops
/// waiting does not cut a launch short.
async fn create(inner: &Inner, mut req: pb::CreateRequest) -> Result<pb::Snapshot, DriverError> {
    let id = lifecycle::create_id(&req)?;
    let run_env = sbx_host_kit::command::run_env(std::mem::take(&mut req.run_env))?;
    let spec = req.spec.unwrap_or_default();
    let image = inner.image(&spec.image)?;
    let run = image_run(&image, &spec, &req.name, inner.images.layer_dirs(&image))?;
    let network_allow = inner.network_allow(spec.network.as_ref())?;
    let _serialised = inner.records.lock(id).await;
    if let Some(existing) = inner.records.get(id) {
        let asked = (req.workspace.as_str(), req.name.as_str());
        return lifecycle::create_known(inner, existing, asked, req.generation, run_env).await;
    }

    let paths = inner.paths(id);
    record::make_walkable_dir(&paths.dir)
        .map_err(|e| internal("making the sandbox directory", e))?;
    // Leased to the directory: a create killed before its record leaves a directory that
    // open() removes, and with it the lease's owner.
    let id_map = sbx_host_kit::uidpool::lease_for(inner.opts.uid_pool.as_ref(), &paths.dir)?;
    let resources = spec.resources.unwrap_or_default();
    let ids = id_map.unwrap_or(inner.opts.id_map);
    if resources.disk_bytes > 0 {
        super::disk::make(&paths.dir, &paths.disk, resources.disk_bytes)?;
    }
    inner.make_sandbox_dirs(&paths, ids)?;
    let record = OciRecord {
        format: RECORD_FORMAT,
        sandbox_id: id,
        workspace: req.workspace,
        name: req.name,
        image: run,
        cpu_millis: resources.cpu_millis,
        memory_bytes: resources.memory_bytes,
        generation: req.generation,
        desired: Desired::Running,
        launched_at_ms: 0,
        run_id: String::new(),
        cgroup_path: format!("/{}/{id}", inner.opts.cgroup_parent.trim_matches('/')),
        warnings: Vec::new(),
        spec_env: spec.env.into_iter().collect::<BTreeMap<_, _>>(),
        network_allow,
        id_map,
        disk_bytes: resources.disk_bytes,
    };
    // start_run writes the record first; a driver killed before that leaves a directory
    // without a record, which open() removes.
    lifecycle::first_run(inner, record, req.generation, req.stopped, run_env).await
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use sbx_images::ImageConfig;

    fn image(entrypoint: &[&str], cmd: &[&str], env: &[&str], workdir: &str) -> ImageInfo {
        let strings = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        ImageInfo {
            digest: "sha256:aa".into(),
            config_digest: "sha256:bb".into(),
            config: ImageConfig {
                env: strings(env),
                entrypoint: strings(entrypoint),
                cmd: strings(cmd),
                working_dir: workdir.into(),
                user: "app".into(),
                labels: Default::default(),
                exposed_ports: Vec::new(),
            },
            layers: Vec::new(),
            size: 0,
            os: "linux".into(),
            architecture: "amd64".into(),
        }
    }

    fn spec(command: &[&str], env: &[(&str, &str)]) -> pb::SandboxSpec {
        pb::SandboxSpec {
            command: command.iter().map(|s| s.to_string()).collect(),
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<_, _>>(),
            ..Default::default()
        }
    }

    #[test]
    fn the_image_config_is_honoured_and_the_spec_wins() {
        let img = image(
            &["/entry"],
            &["a", "b"],
            &["PATH=/opt/bin", "LANG=C"],
            "/work",
        );
        let run = image_run(
            &img,
            &spec(&[], &[("LANG", "en"), ("X", "1")]),
            "web",
            vec![],
        )
        .unwrap();
        assert_eq!(run.args, ["/entry", "a", "b"]);
        assert_eq!(run.env, ["PATH=/opt/bin", "HOSTNAME=web", "LANG=en", "X=1"]);
        assert_eq!((run.cwd.as_str(), run.user.as_str()), ("/work", "app"));
        let run = image_run(&img, &spec(&["sh", "-c", "x"], &[]), "web", vec![]).unwrap();
        assert_eq!(run.args, ["sh", "-c", "x"], "a spec command replaces both");
    }

    #[test]
    fn defaults_when_the_image_says_nothing() {
        let img = image(&[], &[], &[], "");
        let err = image_run(&img, &spec(&[], &[]), "web", vec![]).unwrap_err();
        assert!(err.to_string().contains("no Entrypoint or Cmd"), "{err}");
        let run = image_run(&img, &spec(&["true"], &[]), "web", vec![]).unwrap();
        assert_eq!(
            run.env[0],
            format!("PATH={}", sbx_host_kit::image_process::DEFAULT_PATH)
        );
        assert_eq!(run.cwd, "/");
        // The daemon's own environment never leaks in.
        assert!(
            !run.env
                .iter()
                .any(|kv| kv.starts_with("CARGO") || kv.starts_with("HOME="))
        );
    }
}
