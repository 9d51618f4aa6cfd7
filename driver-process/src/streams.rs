//! The exec of the process driver: one connection to the sandbox's agent
//! ([`sbx_host_kit::agent`]), which runs the command as its own child — in the sandbox's
//! namespaces and cgroups, in a user namespace like the workload's, with the workload's
//! environment and the request's variables on top, from `/sandbox` unless the request names
//! a working directory. (Watch and logs are the kit's, `host::lifecycle`.)

use super::ProcessDriver;
use super::launch::SANDBOX_MOUNT;
use super::record::{SandboxPaths, SandboxRecord};
use sbx_driver_api::{DriverError, DriverStream, ExecInputStream, parse_sandbox_id, pb};
use sbx_host_kit::agent::{CopyVia, Offline};
use sbx_host_kit::{Desired, agent, validate_command};

impl ProcessDriver {
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
    fn runs(&self, record: &SandboxRecord) -> bool {
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

    /// Where a copy of `path` in sandbox `sandbox_id` goes: its running agent, or (it does
    /// not run) the agent on the host over its persistent directory — the only files a
    /// process sandbox keeps, so a path elsewhere is refused.
    pub(super) async fn copy_via(
        &self,
        sandbox_id: &str,
        path: &str,
    ) -> Result<CopyVia, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.records.lock(id).await;
        let record = inner.records.require(id)?;
        let paths = SandboxPaths::new(&inner.state_dir, id);
        if self.runs(&record) {
            return Ok(CopyVia::Running(paths.dir));
        }
        let lexical = std::path::Path::new(path);
        let in_sandbox = lexical.starts_with(SANDBOX_MOUNT)
            && !lexical
                .components()
                .any(|c| c == std::path::Component::ParentDir);
        if !in_sandbox {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running, and a stopped process sandbox keeps only \
                 {SANDBOX_MOUNT} (its persistent directory): copy to or from a path under \
                 {SANDBOX_MOUNT} (without ..), or start the sandbox first"
            )));
        }
        let offline = Offline {
            agent: inner.tools.agent.clone(),
            overlay: None,
            sandbox: paths.root,
            mountpoint: paths.dir.join("offline-root"),
            uid: record.id_map.unwrap_or(inner.opts.id_map).host_uid,
            gid: record.id_map.unwrap_or(inner.opts.id_map).host_gid,
        };
        Ok(CopyVia::Stopped(offline, lock))
    }
}
