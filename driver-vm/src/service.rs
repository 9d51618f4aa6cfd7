//! The driver contract for [`VmDriver`]: capabilities and create (the disk made). Every
//! lifecycle call runs as its own task; start, stop, delete, a create of a known sandbox and
//! the reads (get, list, watch, logs) are the host kit's
//! ([`sbx_host_kit::host_compute_driver!`]); pause and resume are in `pause.rs`, exec in
//! `streams.rs`, copy and port-forward (through exec) in `files.rs`.

use std::sync::Arc;

use async_trait::async_trait;

use std::path::{Path, PathBuf};

use super::base::Made;
use super::record::{GuestProcess, RECORD_FORMAT, VmRecord, VmSpec};
use super::{Inner, VmDriver, qemu};
use sbx_driver_api::{
    ByteStream, DriverError, DriverStream, ExecInputStream, ForwardInputStream, pb,
};
use sbx_host_kit::image_process::{image_process, stored_image};
use sbx_host_kit::service::HostService;
use sbx_host_kit::{Desired, internal, lifecycle, validate_command};
use sbx_images::ImageInfo;

/// The least memory a guest boots with: measured, 192 MiB ran out of memory while booting
/// (the kernel, the initramfs in memory, the agents of 29 exec channels and two loggers),
/// 256 MiB boots and leaves a workload room (`vm_a_command_past_its_memory_is_oom_killed`).
const MIN_MEMORY_MIB: u64 = 256;

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

/// Makes the sandbox's persistent disk: a sparse raw image (made 0600: it holds what the guest
/// keeps in `/sandbox`) with an ext4 filesystem, made under a temporary name and renamed, so a
/// killed driver never leaves half a disk.
async fn make_disk(path: &std::path::Path, size_mib: u64) -> Result<(), DriverError> {
    let tmp = path.with_extension("img.tmp");
    private_file(&tmp)
        .and_then(|file| file.set_len(size_mib << 20))
        .map_err(|e| internal("making the disk image", e))?;
    run_tool(
        "mkfs.ext4",
        vec![
            "-q".into(),
            "-F".into(),
            "-L".into(),
            "sandbox".into(),
            tmp.display().to_string(),
        ],
    )
    .await?;
    std::fs::rename(&tmp, path).map_err(|e| internal("placing the disk image", e))
}

/// A new, empty file of the driver's at `path` (what was there goes), host root's, made 0600:
/// the tools that fill it (`mkfs.ext4`, `qemu-img create`) keep the mode of a file that is
/// there.
fn private_file(path: &Path) -> std::io::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// Runs a tool to its end: an error with its stderr when it fails.
async fn run_tool(program: &str, args: Vec<String>) -> Result<(), DriverError> {
    let out = tokio::process::Command::new(program)
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

// The kit's impl with pause and resume added (the kit's macro has no arm for them yet: its
// `@impl` arm takes the extra methods of the networked drivers the same way).
sbx_host_kit::host_compute_driver!(@impl VmDriver, create {
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
impl HostService for VmDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        Ok(pb::CapabilitiesResponse {
            network: self.inner.opts.network.is_some(),
            driver: "vm".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: true,
            memory_limit: true,
            persistent_storage: true,
            images: self.inner.opts.images.is_some(),
            exec_stdin: true,
            exec_tty: true,
            copy: true,
            port_forward: true,
            copy_when_stopped: true,
            disk_limit: false,
            stats: true,
            pause: true,
            isolation: format!(
                "QEMU microVM ({}), its own kernel ({}); QEMU runs as a host uid of the \
                 sandbox's own ({}), with no capabilities and a seccomp filter; {}a persistent \
                 ext4 disk at /sandbox; {}",
                match self.inner.accel {
                    qemu::Accel::Kvm => "KVM",
                    _ => "TCG emulation",
                },
                self.inner.assets.kernel_version,
                sbx_host_kit::uidpool::describe(
                    Some(&self.inner.opts.uid_pool),
                    &sbx_images::IdMap::default()
                ),
                match self.inner.opts.images {
                    Some(_) => "the image's root filesystem on a copy-on-write disk; ",
                    None => "",
                },
                match self.inner.opts.network {
                    Some(_) => "a NIC on a tap that passes only its own address and MAC",
                    None => "no network",
                }
            ),
        })
    }

    async fn exec_io(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        self.exec_stream(req, input).await
    }

    async fn copy_from(
        &self,
        req: pb::CopyFromRequest,
    ) -> Result<DriverStream<pb::CopyChunk>, DriverError> {
        sbx_driver_api::refuse_changes(&req)?;
        let helper = self.inner.helper_for(&req.sandbox_id).await?;
        let stream = self.copy_from_vm(req).await?;
        Ok(super::helper::hold(stream, helper))
    }

    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        let Some(helper) = self.inner.helper_for(&req.sandbox_id).await? else {
            return self.copy_to_vm(req, data).await;
        };
        // Through a helper (the sandbox's lock held): a caller gone quiet has the helper ended
        // by its watchdog, and the copy fails.
        let data = super::helper::watched(data, &helper);
        let copied = self.copy_to_vm(req, data).await;
        let copied = copied.map_err(|e| helper.explain(e));
        drop(helper);
        copied
    }

    async fn port_forward(
        &self,
        req: pb::PortForwardStart,
        input: ForwardInputStream,
    ) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
        self.port_forward_vm(req, input).await
    }

    /// A VM's usage is its QEMU process's, as the host pays it: CPU time (under TCG the
    /// emulation's own work included) and resident memory (guest memory it touched included),
    /// against the VM's cpus and memory; its disk is the image's allocated bytes against its
    /// size. The guest's processes are not counted from here (no pids). A paused VM has no
    /// QEMU: not running, no CPU or memory (its saved state is on the driver's disk).
    async fn stats(&self, req: pb::StatsRequest) -> Result<pb::SandboxUsage, DriverError> {
        let id = sbx_driver_api::parse_sandbox_id(&req.sandbox_id)?;
        let record = self.inner.records.require(id)?;
        let mut out = pb::SandboxUsage {
            cpu_limit_millis: u64::from(record.spec.cpus) * 1000,
            memory_limit_bytes: record.spec.memory_mib << 20,
            ..Default::default()
        };
        if record.desired == Desired::Running
            && let Some(qemu) = self.vm_identity(id)
            && let Some((cpu_nanos, rss)) = sbx_host_kit::usage::process_usage(&qemu)
        {
            (out.running, out.cpu_nanos, out.memory_bytes) = (true, cpu_nanos, rss);
        }
        // What crossed its link (the veth into the bridge), as for any networked sandbox.
        if record.network_allow.is_some()
            && let Some(network) = &self.inner.opts.network
            && let Some((rx, tx)) = sbx_host_kit::usage::link_traffic(&network.host_link(id))
        {
            (out.has_network, out.network_rx_bytes, out.network_tx_bytes) = (true, rx, tx);
        }
        let disk = super::record::VmPaths::new(&self.inner.state_dir, id).disk;
        if let Ok(meta) = std::fs::symlink_metadata(&disk)
            && meta.is_file()
        {
            use std::os::unix::fs::MetadataExt;
            out.has_disk = true;
            out.disk_used_bytes = meta.blocks() * 512;
            out.disk_limit_bytes = meta.len();
        }
        Ok(out)
    }
}

/// A create: the disk made, the record written, the first run started unless asked stopped.
/// It runs as a task of its own (the kit's `detach`), so a caller giving up (a deadline, a
/// dropped connection) cannot cut it short between launching QEMU and recording it: a VM
/// nobody recorded would be booted a second time on the same disk.
async fn create(
    inner: &Arc<Inner>,
    mut req: pb::CreateRequest,
) -> Result<pb::Snapshot, DriverError> {
    let id = lifecycle::create_id(&req)?;
    let run_env = sbx_host_kit::command::run_env(std::mem::take(&mut req.run_env))?;
    let spec = req.spec.unwrap_or_default();
    let image = inner.image_process(&spec, &req.name)?;
    if image.is_none() {
        validate_command("the spec", &spec.command, &spec.env)?;
        validate_env_names("the spec", spec.env.keys())?;
    }
    // On the gateway's network (a tap in the sandbox's namespace) or loopback only.
    let network_allow = sbx_network::requested(spec.network.as_ref(), inner.opts.network.as_ref())?;
    let inner = inner.as_ref();
    let _serialised = inner.records.lock(id).await;
    if let Some(existing) = inner.records.get(id) {
        let asked = (req.workspace.as_str(), req.name.as_str());
        return lifecycle::create_known(inner, existing, asked, req.generation, run_env).await;
    }

    let paths = inner.paths(id);
    {
        use std::os::unix::fs::DirBuilderExt;
        match std::fs::DirBuilder::new().mode(0o700).create(&paths.dir) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
                return Err(internal("making the sandbox directory", e));
            }
            _ => {}
        }
    }
    // Leased to the directory: a create killed before its record leaves a directory that
    // open() removes, and with it the lease's owner.
    let id_map = inner.opts.uid_pool.lease(&paths.dir)?;
    if !paths.disk.exists() {
        make_disk(&paths.disk, inner.opts.disk_mib).await?;
    }
    let (process, root_base) = match image {
        Some((process, info)) => (
            Some(process),
            Some(inner.make_root(info, &paths.root).await?),
        ),
        None => (None, None),
    };
    let resources = spec.resources.unwrap_or_default();
    let memory_mib = match resources.memory_bytes {
        0 => inner.opts.memory_mib,
        bytes => (bytes / (1024 * 1024)).max(MIN_MEMORY_MIB),
    };
    let cpus = resources.cpu_millis.div_ceil(1000).max(1);
    let mut warnings = Vec::new();
    if inner.assets.compressed_kernel {
        warnings.push(
            "the kernel boots from its compressed image (slower): no xz, zstd or gzip on the \
                 host unpacked it"
                .to_string(),
        );
    }
    if resources.disk_bytes > 0 {
        warnings.push(
            "disk limit not applied: a guest's disk is the vm driver's own image".to_string(),
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
            process,
        },
        desired: Desired::Running,
        run_id: String::new(),
        launched_at_ms: 0,
        console_offset: 0,
        qemu: None,
        warnings,
        paused: false,
        network_allow,
        id_map: Some(id_map),
        root_base,
    };
    lifecycle::first_run(inner, rec, req.generation, req.stopped, run_env).await
}

impl Inner {
    /// What a sandbox of an image runs, from the spec's image (a manifest digest in the
    /// gateway's image store); `None` for a spec without one, which boots the busybox
    /// initramfs as its root.
    fn image_process(
        &self,
        spec: &pb::SandboxSpec,
        hostname: &str,
    ) -> Result<Option<(GuestProcess, ImageInfo)>, DriverError> {
        if spec.image.is_empty() {
            return Ok(None);
        }
        let Some(store) = &self.opts.images else {
            return Err(DriverError::InvalidArgument(format!(
                "image {}: this vm driver was opened without the gateway's image store; give \
                 no image to boot the busybox initramfs",
                spec.image
            )));
        };
        let info = stored_image(store, &spec.image)?;
        let p = image_process(&info.config, &spec.command, &spec.env, hostname);
        let env = p.validate(&spec.image)?;
        validate_env_names(
            "the image's and the spec's environment",
            env.iter().map(|(k, _)| k),
        )?;
        let process = GuestProcess {
            digest: info.digest.clone(),
            args: p.args,
            env: p.env,
            cwd: p.cwd,
            user: p.user,
        };
        Ok(Some((process, info)))
    }

    /// The sandbox's root disk: a qcow2 (0600) whose backing file is the image's base (built
    /// first when it is not there), made under a temporary name and renamed; the base's path.
    /// A root disk already there (a create killed after it) is kept, over its own base.
    async fn make_root(&self, info: ImageInfo, path: &Path) -> Result<PathBuf, DriverError> {
        if path.exists()
            && let Some(base) = super::base::backing_of(path, &self.state_dir.join("bases"))
        {
            return Ok(base);
        }
        let Some(store) = self.opts.images.clone() else {
            return Err(DriverError::FailedPrecondition(
                "the sandbox has an image and the driver no image store".to_string(),
            ));
        };
        let digest = info.digest.clone();
        let bases = Arc::clone(&self.bases);
        let started = std::time::Instant::now();
        let (base, made) = tokio::task::spawn_blocking(move || bases.ensure(&store, &info))
            .await
            .map_err(|e| internal("the base disk's build", e))??;
        if made == Made::Built {
            tracing::info!(%digest, took = ?started.elapsed(), base = %base.display(), "built an image's base disk");
        }
        let tmp = path.with_extension("qcow2.tmp");
        private_file(&tmp).map_err(|e| internal("making the root disk", e))?;
        run_tool(
            "qemu-img",
            vec![
                "create".into(),
                "-q".into(),
                "-f".into(),
                "qcow2".into(),
                "-F".into(),
                "raw".into(),
                "-b".into(),
                base.display().to_string(),
                tmp.display().to_string(),
            ],
        )
        .await?;
        std::fs::rename(&tmp, path).map_err(|e| internal("placing the root disk", e))?;
        Ok(base)
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
