//! The cpu and memory limits a sandbox gets when it asks for none: its workspace's default,
//! else the gateway's (`Config::default_resources`; sbxd's `--default-cpu` and
//! `--default-memory`), each field on its own, and only on a driver that can apply it. What
//! applies is copied into the sandbox's spec at create, so `sbx sandbox get` shows it and a
//! later change of a default does not reach the sandbox.

use sbx_drivers::ComputeDriver;
use sbx_proto::v1::{Resources, SandboxSpec, Workspace};

use super::Gateway;
use crate::error::{ActorError, Result};
use crate::validate::WorkspaceSelector;

/// What each layer says, lowest first: the gateway's default, the workspace's, the
/// sandbox's own; 0 in a field means "not said here".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Layers {
    pub gateway: (u32, u64),
    pub workspace: (u32, u64),
    pub sandbox: (u32, u64),
    /// Whether the driver can limit cpu, and memory: a default is never given to a driver
    /// that would only say it did not apply it.
    pub can: (bool, bool),
}

/// The limits that apply, as (cpu_millis, memory_bytes): per field the sandbox's own, else
/// the workspace's, else the gateway's; a default (not the sandbox's own) only where the
/// driver can apply it.
pub(crate) fn effective(l: Layers) -> (u32, u64) {
    fn pick<T: Copy + Default + PartialEq>(own: T, ws: T, gw: T, can: bool) -> T {
        let zero = T::default();
        if own != zero || !can {
            own
        } else if ws != zero {
            ws
        } else {
            gw
        }
    }
    (
        pick(l.sandbox.0, l.workspace.0, l.gateway.0, l.can.0),
        pick(l.sandbox.1, l.workspace.1, l.gateway.1, l.can.1),
    )
}

fn pair(r: Option<&Resources>) -> (u32, u64) {
    r.map_or((0, 0), |r| (r.cpu_millis, r.memory_bytes))
}

impl Gateway {
    /// Fills in the limits `spec` does not set from `ws`'s defaults and the gateway's, for
    /// what `driver` can apply.
    pub(super) async fn apply_default_limits(
        &self,
        spec: &mut SandboxSpec,
        ws: &Workspace,
        driver: &dyn ComputeDriver,
    ) -> Result<()> {
        let gateway = pair(Some(&self.shared.config.default_resources));
        let workspace = pair(ws.default_resources.as_ref());
        if gateway == (0, 0) && workspace == (0, 0) {
            return Ok(());
        }
        let caps = self
            .images
            .driver_capabilities(&spec.driver, driver)
            .await?;
        let layers = Layers {
            gateway,
            workspace,
            sandbox: pair(spec.resources.as_ref()),
            can: (caps.cpu_limit, caps.memory_limit),
        };
        let (cpu_millis, memory_bytes) = effective(layers);
        if (cpu_millis, memory_bytes) != (0, 0) {
            spec.resources = Some(Resources {
                cpu_millis,
                memory_bytes,
            });
        }
        Ok(())
    }

    /// Sets (Some) or clears (None) a workspace's default limits, through its supervisor
    /// (ordered with its delete).
    pub async fn set_workspace_limits(
        &self,
        sel: &WorkspaceSelector,
        resources: Option<Resources>,
    ) -> Result<Workspace> {
        if let Some(r) = &resources {
            crate::validate::memory_limit(
                "the default memory limit",
                r.memory_bytes,
                "the gateway's default",
            )?;
        }
        self.refuse_if_disk_full()?;
        let ws = self.resolve_workspace(sel).await?;
        self.router
            .call_workspace(ws.id(), |reply| {
                crate::protocol::WorkspaceMsg::SetDefaultResources { resources, reply }
            })
            .await?
            .ok_or_else(|| ActorError::WorkspaceNotFound(format!("{:?}", ws.workspace.name)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_field_comes_from_the_nearest_layer_that_says_it_where_the_driver_can() {
        let gb = 1u64 << 30;
        let check = |l: Layers, want: (u32, u64)| assert_eq!(effective(l), want, "{l:?}");
        let base = Layers {
            gateway: (1000, gb),
            workspace: (0, 0),
            sandbox: (0, 0),
            can: (true, true),
        };
        check(base, (1000, gb));
        check(
            Layers {
                workspace: (500, 0),
                ..base
            },
            (500, gb),
        );
        check(
            Layers {
                workspace: (500, 2 * gb),
                sandbox: (0, 64 << 20),
                ..base
            },
            (500, 64 << 20),
        );
        check(
            Layers {
                sandbox: (2000, 3 * gb),
                ..base
            },
            (2000, 3 * gb),
        );
        // A driver without a memory limit gets no default one (its own ask is kept: the
        // driver then says it did not apply it).
        check(
            Layers {
                can: (true, false),
                ..base
            },
            (1000, 0),
        );
        check(
            Layers {
                sandbox: (0, gb),
                can: (false, false),
                ..base
            },
            (0, gb),
        );
        check(Layers::default(), (0, 0));
    }
}
