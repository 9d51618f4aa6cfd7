//! The exec of the oci driver: one connection to the sandbox's agent ([`sbx_host_kit::agent`]),
//! which runs the command as its own child inside the container — the workload's namespaces,
//! cgroup, seccomp filter, capabilities, user, environment and working directory, with the
//! request's variables on top. (Watch and logs are the kit's, `host::lifecycle`.)

use super::{OciDriver, record, rootfs};
use sbx_driver_api::{DriverError, DriverStream, ExecInputStream, parse_sandbox_id, pb};
use sbx_host_kit::agent::{CopyVia, Offline};
use sbx_host_kit::{Desired, agent, validate_command};

impl OciDriver {
    pub(super) async fn exec_stream(
        &self,
        req: pb::ExecRequest,
        input: ExecInputStream,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        validate_command("exec", &req.command, &req.env)?;
        let dir = self.running_dir(&req.sandbox_id, "exec")?;
        let sandbox = req.sandbox_id.clone();
        agent::exec(&dir, &sandbox, req, input).await
    }

    /// Whether the sandbox's workload runs, and is meant to (its agent answers then).
    fn runs(&self, record: &record::OciRecord) -> bool {
        record.desired == Desired::Running && self.inner.run_paths(record).live_init().is_some()
    }

    /// The directory of running sandbox `sandbox_id` (where its agent listens), or why there
    /// is none: `what` (exec, copy, port forwarding) needs a running workload.
    pub(super) fn running_dir(
        &self,
        sandbox_id: &str,
        what: &str,
    ) -> Result<std::path::PathBuf, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let record = self.inner.records.require(id)?;
        if !self.runs(&record) {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; {what} needs a running workload"
            )));
        }
        Ok(self.inner.paths(id).dir)
    }

    /// Where a copy of sandbox `sandbox_id` goes: its running agent, or (it does not run)
    /// the agent on the host, over the sandbox's overlay and volume, as the sandbox's root.
    pub(super) async fn copy_via(&self, sandbox_id: &str) -> Result<CopyVia, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.records.lock(id).await;
        let record = inner.records.require(id)?;
        let paths = inner.paths(id);
        if self.runs(&record) {
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
