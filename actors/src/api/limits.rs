//! The cpu, memory and disk limits a sandbox gets when it asks for none: its workspace's default,
//! else the gateway's (`Config::default_resources`; sbxd's `--default-cpu` and
//! `--default-memory`), each field on its own, and only on a driver that can apply it. What
//! applies is copied into the sandbox's spec at create, so `sbx sandbox get` shows it and a
//! later change of a default does not reach the sandbox.

use sbx_driver_api::ComputeDriver;
use sbx_proto::v1::{Resources, SandboxSpec, Workspace};

use super::Gateway;
use crate::error::{ActorError, Result};
use crate::validate::WorkspaceSelector;

/// What each layer says, lowest first: the gateway's default, the workspace's, the
/// sandbox's own; 0 in a field means "not said here".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Layers {
    pub gateway: Limits,
    pub workspace: Limits,
    pub sandbox: Limits,
    /// Whether the driver can limit cpu, memory, and disk: a default is never given to a
    /// driver that would only say it did not apply it.
    pub can: (bool, bool, bool),
}

/// (cpu_millis, memory_bytes, disk_bytes); 0: none.
pub(crate) type Limits = (u32, u64, u64);

/// The limits that apply: per field the sandbox's own, else the workspace's, else the
/// gateway's; a default (not the sandbox's own) only where the driver can apply it.
pub(crate) fn effective(l: Layers) -> Limits {
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
        pick(l.sandbox.2, l.workspace.2, l.gateway.2, l.can.2),
    )
}

/// The cpu and memory a sandbox of `spec` in `ws` will ask of its node: its own limits, else
/// the workspace's defaults, else the gateway's, as if its driver could limit both (what a
/// placement reserves; [`Gateway::apply_default_limits`] may then lower it).
pub(crate) fn asked(spec: &SandboxSpec, ws: &Workspace, gateway: &Resources) -> (u64, u64) {
    let (cpu, memory, _) = effective(Layers {
        gateway: limits(Some(gateway)),
        workspace: limits(ws.default_resources.as_ref()),
        sandbox: limits(spec.resources.as_ref()),
        can: (true, true, true),
    });
    (u64::from(cpu), memory)
}

fn limits(r: Option<&Resources>) -> Limits {
    r.map_or((0, 0, 0), |r| (r.cpu_millis, r.memory_bytes, r.disk_bytes))
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
        let gateway = limits(Some(&self.shared.config.default_resources));
        let workspace = limits(ws.default_resources.as_ref());
        if gateway == (0, 0, 0) && workspace == (0, 0, 0) {
            return Ok(());
        }
        let caps = self
            .images
            .driver_capabilities(&spec.driver, driver)
            .await?;
        let layers = Layers {
            gateway,
            workspace,
            sandbox: limits(spec.resources.as_ref()),
            can: (caps.cpu_limit, caps.memory_limit, caps.disk_limit),
        };
        let (cpu_millis, memory_bytes, disk_bytes) = effective(layers);
        if (cpu_millis, memory_bytes, disk_bytes) != (0, 0, 0) {
            spec.resources = Some(Resources {
                cpu_millis,
                memory_bytes,
                disk_bytes,
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
            crate::validate::disk_limit(
                "the default disk limit",
                r.disk_bytes,
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
        let check = |l: Layers, want: Limits| assert_eq!(effective(l), want, "{l:?}");
        let base = Layers {
            gateway: (1000, gb, 10 * gb),
            workspace: (0, 0, 0),
            sandbox: (0, 0, 0),
            can: (true, true, true),
        };
        check(base, (1000, gb, 10 * gb));
        check(
            Layers {
                workspace: (500, 0, 0),
                ..base
            },
            (500, gb, 10 * gb),
        );
        check(
            Layers {
                workspace: (500, 2 * gb, 20 * gb),
                sandbox: (0, 64 << 20, 0),
                ..base
            },
            (500, 64 << 20, 20 * gb),
        );
        check(
            Layers {
                sandbox: (2000, 3 * gb, gb),
                ..base
            },
            (2000, 3 * gb, gb),
        );
        // A driver without a memory or disk limit gets no default one (its own ask is kept:
        // the driver then says it did not apply it).
        check(
            Layers {
                can: (true, false, false),
                ..base
            },
            (1000, 0, 0),
        );
        check(
            Layers {
                sandbox: (0, gb, gb),
                can: (false, false, false),
                ..base
            },
            (0, gb, gb),
        );
        check(Layers::default(), (0, 0, 0));
    }
}
