//! Where a copy of an oci sandbox's files goes: to its running agent, or (it does not run) to
//! the agent on the host, over the sandbox's overlay and volume. Exec and port forwarding go
//! through the running agent too, written once in the host kit ([`sbx_host_kit::running`]).

use super::{OciDriver, record, rootfs};
use sbx_driver_api::{DriverError, parse_sandbox_id};
use sbx_host_kit::agent::{CopyVia, Offline};
use sbx_host_kit::running;

impl OciDriver {
    /// Where a copy of sandbox `sandbox_id` goes: its running agent, or (it does not run)
    /// the agent on the host, over the sandbox's overlay and volume, as the sandbox's root.
    pub(super) async fn copy_via(&self, sandbox_id: &str) -> Result<CopyVia, DriverError> {
        let id = parse_sandbox_id(sandbox_id)?;
        let inner = &self.inner;
        let lock = inner.records.lock(id).await;
        let record = inner.records.require(id)?;
        let paths = inner.paths(id);
        if running::runs(inner.as_ref(), &record) {
            return Ok(CopyVia::Running(paths.dir));
        }
        let offline = Offline {
            agent: record::init_dir(&inner.state_dir).join("sbx-agent"),
            overlay: Some(rootfs::overlay_options(
                &inner.lower_dirs(&record, &paths)?,
                &paths.upper,
                &paths.work,
            )),
            sandbox: paths.volume,
            mountpoint: paths.dir.join("offline-root"),
            uid: inner.id_map(&record).host_uid,
            gid: inner.id_map(&record).host_gid,
        };
        Ok(CopyVia::Stopped(offline, lock))
    }
}
