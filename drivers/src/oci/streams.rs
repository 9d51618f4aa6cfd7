//! The exec of the oci driver: one connection to the sandbox's agent ([`crate::host::agent`]),
//! which runs the command as its own child inside the container — the workload's namespaces,
//! cgroup, seccomp filter, capabilities, user, environment and working directory, with the
//! request's variables on top. (Watch and logs are the kit's, `host::lifecycle`.)

use super::OciDriver;
use crate::host::{Desired, agent, validate_command};
use crate::{DriverError, DriverStream, ExecInputStream, parse_sandbox_id, pb};

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

    /// The directory of running sandbox `sandbox_id` (where its agent listens), or why there
    /// is none: `what` (exec, copy, port forwarding) needs a running workload.
    pub(super) fn running_dir(
        &self,
        sandbox_id: &str,
        what: &str,
    ) -> Result<std::path::PathBuf, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let record = self.inner.records.require(id)?;
        let run = self.inner.run_paths(&record);
        let running = record.desired == Desired::Running && run.live_init().is_some();
        if !running {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; {what} needs a running workload"
            )));
        }
        Ok(self.inner.paths(id).dir)
    }
}
