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
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let record = self.inner.records.require(id)?;
        let run = self.inner.run_paths(&record);
        let running = record.desired == Desired::Running && run.live_init().is_some();
        if !running {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; exec needs a running workload"
            )));
        }
        let sandbox = req.sandbox_id.clone();
        agent::exec(&self.inner.paths(id).dir, &sandbox, req, input).await
    }
}
