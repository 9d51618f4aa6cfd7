//! The driver contract for [`VmDriver`]: capabilities and create (the disk made). Every
//! lifecycle call runs as its own task; start, stop, delete, a create of a known sandbox and
//! the reads (get, list, watch, logs) are the host kit's
//! ([`sbx_host_kit::host_compute_driver!`]); pause and resume are in `pause.rs`, exec in
//! `streams.rs`, copy and port-forward (through exec) in `files.rs`.

use std::sync::Arc;

use async_trait::async_trait;

use super::record::{RECORD_FORMAT, VmRecord, VmSpec};
use super::{Inner, VmDriver, qemu};
use sbx_driver_api::{
    ByteStream, DriverError, DriverStream, ExecInputStream, ForwardInputStream, pb,
};
use sbx_host_kit::service::HostService;
use sbx_host_kit::{Desired, internal, lifecycle, validate_command};

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
});

#[async_trait]
impl HostService for VmDriver {
    async fn capabilities(&self) -> Result<pb::CapabilitiesResponse, DriverError> {
        Ok(pb::CapabilitiesResponse {
            network: false,
            driver: "vm".to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            exec: true,
            logs: true,
            watch: true,
            cpu_limit: true,
            memory_limit: true,
            persistent_storage: true,
            images: false,
            exec_stdin: true,
            exec_tty: true,
            copy: true,
            port_forward: true,
            copy_when_stopped: false,
            disk_limit: false,
            stats: true,
            pause: true,
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
        self.copy_from_vm(req).await
    }

    async fn copy_to(
        &self,
        req: pb::CopyToStart,
        data: ByteStream,
    ) -> Result<pb::CopyToResponse, DriverError> {
        self.copy_to_vm(req, data).await
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
    validate_command("the spec", &spec.command, &spec.env)?;
    validate_env_names("the spec", spec.env.keys())?;
    // A guest has no network device: loopback only, and a policy is refused.
    sbx_network::requested(spec.network.as_ref(), None)?;
    let inner = inner.as_ref();
    let _serialised = inner.records.lock(id).await;
    if let Some(existing) = inner.records.get(id) {
        let asked = (req.workspace.as_str(), req.name.as_str());
        return lifecycle::create_known(inner, existing, asked, req.generation, run_env).await;
    }

    let paths = inner.paths(id);
    std::fs::create_dir_all(&paths.dir).map_err(|e| internal("making the sandbox directory", e))?;
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
        },
        desired: Desired::Running,
        run_id: String::new(),
        launched_at_ms: 0,
        console_offset: 0,
        qemu: None,
        warnings,
        paused: false,
    };
    lifecycle::first_run(inner, rec, req.generation, req.stopped, run_env).await
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
