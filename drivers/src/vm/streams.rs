//! The exec of the vm driver, through the guest's agent. (Watch and logs, of the console log
//! file, are the kit's, `host::lifecycle`.)

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::service::validate_env_names;
use super::{Inner, VmDriver, guest};
use crate::host::Desired;
use crate::host::logfile::CHUNK;
use crate::host::validate_command;
use crate::{DriverError, DriverStream, parse_sandbox_id, pb};

/// How long an exec may run when the request sets no timeout.
const DEFAULT_EXEC_TIMEOUT: Duration = Duration::from_secs(3600);

impl VmDriver {
    pub(super) async fn exec_stream(
        &self,
        req: pb::ExecRequest,
    ) -> Result<DriverStream<pb::ExecOutput>, DriverError> {
        let id = parse_sandbox_id(&req.sandbox_id)?;
        validate_command("exec", &req.command, &req.env)?;
        validate_env_names("exec", req.env.keys())?;
        let rec = self.inner.records.require(id)?;
        if rec.desired != Desired::Running || !Inner::is_alive(&rec) {
            return Err(DriverError::FailedPrecondition(format!(
                "sandbox {id} is not running; exec needs a running vm"
            )));
        }
        let timeout = match req.timeout_seconds {
            0 => DEFAULT_EXEC_TIMEOUT,
            s => Duration::from_secs(u64::from(s)),
        };
        let _one_at_a_time = self.inner.exec_locks.lock(id).await;
        let request_id = self.inner.exec_ids.fetch_add(1, Ordering::Relaxed);
        let env = req.env.into_iter().collect();
        let agent = self.inner.paths(id).agent;
        let result = guest::exec(&agent, request_id, &env, &req.command, timeout).await?;
        let mut items: Vec<Result<pb::ExecOutput, DriverError>> = Vec::new();
        let chunk = |c| Ok(pb::ExecOutput { chunk: Some(c) });
        for piece in result.stdout.chunks(CHUNK) {
            items.push(chunk(pb::exec_output::Chunk::Stdout(piece.to_vec())));
        }
        for piece in result.stderr.chunks(CHUNK) {
            items.push(chunk(pb::exec_output::Chunk::Stderr(piece.to_vec())));
        }
        items.push(chunk(pb::exec_output::Chunk::Exit(pb::ExecExit {
            code: result.code,
            signal: 0,
        })));
        Ok(Box::pin(futures::stream::iter(items)))
    }
}
