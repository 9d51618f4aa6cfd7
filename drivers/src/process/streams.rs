//! The exec of the process driver: one connection to the sandbox's agent
//! ([`crate::host::agent`]), which runs the command as its own child — in the sandbox's
//! namespaces and cgroups, in a user namespace like the workload's, with the workload's
//! environment and the request's variables on top, from `/sandbox` unless the request names
//! a working directory. (Watch and logs are the kit's, `host::lifecycle`.)

use super::ProcessDriver;
use crate::host::{Desired, agent, validate_command};
use crate::{DriverError, DriverStream, ExecInputStream, parse_sandbox_id, pb};

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

    /// The directory of running sandbox `sandbox_id` (where its agent listens), or why there
    /// is none: `what` (exec, copy, port forwarding) needs a running workload.
    pub(super) fn running_dir(
        &self,
        sandbox_id: &str,
        what: &str,
    ) -> Result<std::path::PathBuf, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let record = self.inner.records.require(id)?;
        let running = record.desired == Desired::Running
            && self.inner.run_paths(&record).live_init().is_some();
        if !running {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; {what} needs a running workload"
            )));
        }
        Ok(self.inner.paths(id).dir)
    }
}
