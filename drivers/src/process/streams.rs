//! The streaming calls of the process driver: watch (a poller over every sandbox), exec (a
//! command in the sandbox's namespaces and cgroups) and logs (tail and follow of the log file).

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::{Inner, ProcessDriver, launch};
use crate::host::exec;
use crate::host::logfile::log_stream;
use crate::host::{Desired, feed, internal, locked, procfs, validate_command};
use crate::{DriverError, DriverStream, parse_sandbox_id, pb};

impl ProcessDriver {
    pub(super) fn watch_stream(&self) -> Result<DriverStream<pb::WatchEvent>, DriverError> {
        let events = feed::watch(&self.inner, "process", self.inner.opts.poll_interval);
        Ok(Box::pin(events.take_until(self.dropped())))
    }

    pub(super) fn exec_stream(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        let record = self.inner.require(id)?;
        let init = self
            .inner
            .run_paths(&record)
            .read_init()
            .filter(procfs::is_alive);
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

    pub(super) fn logs_stream(
        &self,
        req: pb::LogsRequest,
    ) -> Result<DriverStream<pb::LogChunk>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        self.inner.require(id)?;
        let log = self.inner.paths(id).log;
        let weak = Arc::downgrade(&self.inner);
        let interval = self
            .inner
            .opts
            .poll_interval
            .min(Duration::from_millis(100));
        let exists = move || {
            weak.upgrade()
                .is_some_and(|inner| sandbox_exists(&inner, id))
        };
        let stream = log_stream(log, req.tail_lines, req.follow, interval, exists)?;
        Ok(Box::pin(stream.take_until(self.dropped())))
    }
}

fn sandbox_exists(inner: &Inner, id: uuid::Uuid) -> bool {
    locked(&inner.records).contains_key(&id)
}
