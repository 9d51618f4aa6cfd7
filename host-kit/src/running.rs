//! What a driver whose sandboxes' init is a host process (oci, process) does with a running
//! sandbox's agent: find it (the sandbox must run, and be meant to), exec through it, forward
//! a port through it. The vm driver reaches its guest's agent over virtio-serial instead.

use std::path::PathBuf;

use futures::StreamExt;

use sbx_driver_api::{
    DriverError, DriverStream, ExecInputStream, ForwardInputStream, parse_sandbox_id, pb,
};
use uuid::Uuid;

use crate::records::HostRecord;
use crate::{Desired, HostDriver, RunDir, agent, validate_command};

/// A host driver whose sandboxes run an init of theirs on this host, next to their agent.
pub trait RunsInit: HostDriver {
    /// The run directory of the sandbox's current run.
    fn run_dir(&self, record: &Self::Record) -> RunDir;

    /// The sandbox's directory, where its agent's socket is.
    fn agent_dir(&self, id: Uuid) -> PathBuf;
}

/// Whether the sandbox's workload runs, and is meant to (its agent answers then).
pub fn runs<D: RunsInit>(driver: &D, record: &D::Record) -> bool {
    record.desired() == Desired::Running && driver.run_dir(record).live_init().is_some()
}

/// The directory of running sandbox `sandbox_id` (where its agent listens), or why there is
/// none: `what` (exec, copy, port forwarding) needs a running workload.
pub fn running_dir<D: RunsInit>(
    driver: &D,
    sandbox_id: &str,
    what: &str,
) -> Result<PathBuf, DriverError> {
    let id = parse_sandbox_id(sandbox_id)?;
    let record = driver.records().require(id)?;
    if !runs(driver, &record) {
        return Err(DriverError::FailedPrecondition(format!(
            "sandbox {id} is not running; {what} needs a running workload"
        )));
    }
    Ok(driver.agent_dir(id))
}

/// An exec: one connection to the running sandbox's agent, which runs the command as its own
/// child, inside everything the workload is inside.
pub async fn exec<D: RunsInit>(
    driver: &D,
    req: pb::ExecRequest,
    input: ExecInputStream,
) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
    validate_command("exec", &req.command, &req.env)?;
    let dir = running_dir(driver, &req.sandbox_id, "exec")?;
    let sandbox = req.sandbox_id.clone();
    let id = parse_sandbox_id(&sandbox)?;
    let stream = agent::exec(&dir, &sandbox, req, input)
        .await
        .inspect_err(|e| crate::ptys::note_refusal(id, e))?;
    // A terminal refused comes as the stream's error: counted as it passes.
    Ok(Box::pin(stream.inspect(move |item| {
        if let Err(e) = item {
            crate::ptys::note_refusal(id, e);
        }
    })))
}

/// A port forward: a connection to a port on the running sandbox's loopback, through its
/// agent.
pub async fn port_forward<D: RunsInit>(
    driver: &D,
    req: pb::PortForwardStart,
    input: ForwardInputStream,
) -> Result<DriverStream<pb::PortForwardOutput>, DriverError> {
    let dir = running_dir(driver, &req.sandbox_id, "port forwarding")?;
    agent::port_forward(&dir, &req, input).await
}
