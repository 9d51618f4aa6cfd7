//! Where a copy of a process sandbox's files goes: to its running agent, or (it does not run)
//! to the agent on the host over its persistent directory. Exec and port forwarding go through
//! the running agent, written once in the host kit ([`sbx_host_kit::running`]).

use super::ProcessDriver;
use super::launch::SANDBOX_MOUNT;
use super::record::SandboxPaths;
use sbx_driver_api::{DriverError, parse_sandbox_id};
use sbx_host_kit::agent::{CopyVia, Offline};
use sbx_host_kit::running;

impl ProcessDriver {
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
        if running::runs(inner.as_ref(), &record) {
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
