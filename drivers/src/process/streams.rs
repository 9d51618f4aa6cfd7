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
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let record = self.inner.records.require(id)?;
        let running = record.desired == Desired::Running
            && self.inner.run_paths(&record).live_init().is_some();
        if !running {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; exec needs a running workload"
            )));
        }
        let dir = self.inner.paths(id).dir;
        let sandbox = req.sandbox_id.clone();
        agent::exec(&dir, &sandbox, req, input).await
    }
}
