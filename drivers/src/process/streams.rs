//! The exec of the process driver: a command in the sandbox's namespaces and cgroups. (Watch
//! and logs are the kit's, `host::lifecycle`.)

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::{ProcessDriver, launch};
use crate::host::exec;
use crate::host::{Desired, internal, validate_command};
use crate::{DriverError, DriverStream, parse_sandbox_id, pb};

impl ProcessDriver {
    pub(super) fn exec_stream(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let record = self.inner.records.require(id)?;
        let init = self.inner.run_paths(&record).live_init();
        let init = match (init, record.desired) {
            (Some(init), Desired::Running) => init,
            _ => {
                return Err(DriverError::FailedPrecondition(format!(
                    "sandbox {id} is not running; exec needs a running workload"
                )));
            }
        };
        let mut command =
            launch::exec_command(&self.inner.tools, &init, &record.cgroups.dirs, &req.command);
        command
            .env_clear()
            .envs(launch::workload_env(&record))
            .envs(req.env)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true);
        let child = command
            .spawn()
            .map_err(|e| internal("spawning nsenter", e))?;
        let Some(pid) = child.id() else {
            return Err(DriverError::Internal("nsenter ended at once".to_string()));
        };
        // nsenter leads its own process group; the command it forks inside the sandbox is in it.
        let group = Pid::from_raw(pid as i32);
        let timeout =
            (req.timeout_seconds > 0).then(|| Duration::from_secs(u64::from(req.timeout_seconds)));
        exec::stream_output(
            child,
            timeout,
            move || {
                let _ = killpg(group, Signal::SIGKILL);
            },
            || {},
        )
    }
}
