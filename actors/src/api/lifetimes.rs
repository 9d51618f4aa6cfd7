//! Lifetimes at the API: a sandbox's ttl moved, pause and resume asked, a workspace's default
//! lifetime set, a lifetime checked before anything is written (a bad one is refused at create
//! or update, naming the field, never discovered at its deadline), and the automatic resume of
//! a paused sandbox before a use. The deadlines themselves are the sandbox actors'
//! (`crate::lifetime`).

use std::time::Duration;

use sbx_driver_api::ComputeDriver;
use sbx_proto::v1::{Lifetime, LifetimeAction, Phase, Sandbox, SandboxSpec, Workspace};

use super::Gateway;
use crate::error::{ActorError, Result};
use crate::protocol::SandboxMsg;
use crate::records::StoredSandbox;
use crate::validate::{SandboxSelector, WorkspaceSelector};

/// Checks a lifetime's fields: every duration at most `max`, no DELETE on idle, known actions.
/// `at` prefixes the field names ("lifetime", "default_lifetime").
pub fn check_lifetime(l: &Lifetime, max: Duration, at: &str) -> Result<()> {
    for (field, secs) in [
        ("ttl_seconds", l.ttl_seconds),
        ("idle_timeout_seconds", l.idle_timeout_seconds),
        ("delete_after_seconds", l.delete_after_seconds),
    ] {
        if secs > max.as_secs() {
            return Err(ActorError::InvalidArgument(format!(
                "{at}.{field} is {secs} s, more than the gateway's maximum of {} s (sbxd serve \
                 --max-ttl)",
                max.as_secs()
            )));
        }
    }
    for (field, value) in [("on_ttl", l.on_ttl), ("on_idle", l.on_idle)] {
        if LifetimeAction::try_from(value).is_err() {
            return Err(ActorError::InvalidArgument(format!(
                "{at}.{field} is {value}, not an action (delete, stop or pause)"
            )));
        }
    }
    if l.on_idle() == LifetimeAction::Delete {
        return Err(ActorError::InvalidArgument(format!(
            "{at}.on_idle cannot be delete: an idle sandbox is stopped or paused (give \
             delete_after to delete it once stopped)"
        )));
    }
    Ok(())
}

/// Whether a lifetime ever pauses its sandbox.
fn pauses(l: &Lifetime) -> Option<&'static str> {
    if l.ttl_seconds > 0 && l.on_ttl() == LifetimeAction::Pause {
        Some("on_ttl")
    } else if l.idle_timeout_seconds > 0 && l.on_idle() == LifetimeAction::Pause {
        Some("on_idle")
    } else {
        None
    }
}

impl Gateway {
    /// A create's lifetime: its own, else the workspace's default, copied in; checked, and a
    /// pause refused on a driver that cannot pause.
    pub(super) async fn settle_lifetime(
        &self,
        spec: &mut SandboxSpec,
        ws: &Workspace,
        driver: &dyn ComputeDriver,
    ) -> Result<()> {
        let from_workspace = spec.lifetime.is_none();
        if from_workspace {
            spec.lifetime = ws.default_lifetime;
        }
        let Some(l) = &spec.lifetime else {
            return Ok(());
        };
        let at = if from_workspace {
            "the workspace's default_lifetime"
        } else {
            "spec.lifetime"
        };
        check_lifetime(l, self.shared.config.lifetimes.max_ttl, at)?;
        if let Some(field) = pauses(l) {
            let caps = self
                .images
                .driver_capabilities(&spec.driver, driver)
                .await?;
            if !caps.pause {
                return Err(ActorError::FailedPrecondition(format!(
                    "{at}.{field} is pause, but driver {:?} cannot pause a sandbox (no `pause` \
                     capability): give stop or delete",
                    spec.driver
                )));
            }
        }
        Ok(())
    }

    /// Sets (Some) or clears (None) a workspace's default lifetime, through its supervisor.
    pub async fn set_workspace_lifetime(
        &self,
        sel: &WorkspaceSelector,
        lifetime: Option<Lifetime>,
    ) -> Result<Workspace> {
        if let Some(l) = &lifetime {
            check_lifetime(l, self.shared.config.lifetimes.max_ttl, "default_lifetime")?;
        }
        self.refuse_if_disk_full()?;
        let ws = self.resolve_workspace(sel).await?;
        self.router
            .call_workspace(ws.id(), |reply| {
                crate::protocol::WorkspaceMsg::SetDefaultLifetime { lifetime, reply }
            })
            .await?
            .ok_or_else(|| ActorError::WorkspaceNotFound(format!("{:?}", ws.workspace.name)))
    }

    /// Moves a sandbox's ttl deadline to now + `seconds` (0: none), through its actor.
    pub async fn set_sandbox_ttl(&self, sel: &SandboxSelector, seconds: u64) -> Result<Sandbox> {
        let max = self.shared.config.lifetimes.max_ttl.as_secs();
        if seconds > max {
            return Err(ActorError::InvalidArgument(format!(
                "ttl_seconds is {seconds} s, more than the gateway's maximum of {max} s (sbxd \
                 serve --max-ttl)"
            )));
        }
        self.refuse_if_disk_full()?;
        let sb = self.resolve_sandbox(sel).await?;
        self.command(&sb, move |reply| SandboxMsg::SetTtl { seconds, reply })
            .await?
            .ok_or_else(|| super::not_found_id(sb.id()))
    }

    /// Saves a Ready sandbox's processes and memory (answers once Paused).
    pub async fn pause_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.change_sandbox(sel, SandboxMsg::Pause).await
    }

    /// Brings a paused sandbox back (answers once Ready).
    pub async fn resume_sandbox(&self, sel: &SandboxSelector) -> Result<Sandbox> {
        self.change_sandbox(sel, SandboxMsg::Resume).await
    }

    /// The sandbox `sel` names, for a use that needs its workload running (`what`: "exec
    /// into"…): a paused one is resumed first when its lifetime says so (`auto_resume`, on by
    /// default when a deadline paused it), else refused, saying how to resume it.
    pub(super) async fn resolve_for_use(
        &self,
        sel: &SandboxSelector,
        what: &str,
    ) -> Result<StoredSandbox> {
        self.resolve_for(sel, what, Use::Caller).await
    }

    /// [`Gateway::resolve_for_use`] for `who` uses it: a caller (auto_resume's rule), or a
    /// request routed to a service endpoint (wake_on_request's, stricter: see
    /// `lifetime::wakes_on_request`).
    pub(super) async fn resolve_for(
        &self,
        sel: &SandboxSelector,
        what: &str,
        who: Use,
    ) -> Result<StoredSandbox> {
        let sb = self.resolve_sandbox(sel).await?;
        // An image build's step: what runs in it becomes a gateway-wide image, so no call
        // puts anything in it (reading its files is harmless).
        if what != "copy from"
            && sb
                .sandbox
                .spec
                .as_ref()
                .is_some_and(|s| s.labels.contains_key(crate::validate::BUILD_LABEL))
        {
            return Err(ActorError::FailedPrecondition(format!(
                "cannot {what} sandbox {:?}: it runs a step of an image build, whose changes                  become the image",
                sb.sandbox.name
            )));
        }
        let phase = sb.sandbox.phase();
        // Being resumed (by a call, or another use): wait for it in the actor's mailbox.
        let resuming = phase == Phase::Starting && sb.sandbox.reason == "Resuming";
        if !resuming && !matches!(phase, Phase::Paused | Phase::Pausing) {
            return Ok(sb);
        }
        let wakes = match who {
            Use::Caller => crate::lifetime::auto_resumes(&sb.sandbox),
            Use::Routed => {
                crate::lifetime::wakes_on_request(&sb.sandbox, std::time::SystemTime::now())
            }
        };
        if !resuming && !wakes {
            return Err(ActorError::FailedPrecondition(match who {
                Use::Caller => format!(
                    "cannot {what} sandbox {:?}: it is paused ({}); resume it first (sbx \
                     sandbox resume), or create it with auto_resume",
                    sb.sandbox.name, sb.sandbox.reason
                ),
                // Said to whoever sent a request: nothing of the sandbox but that it sleeps.
                Use::Routed => "the sandbox is paused: a request wakes it only when it was \
                                created with --wake-on-request and its idleness paused it"
                    .to_string(),
            }));
        }
        tracing::info!(sandbox = %sb.id(), what, "resuming a paused sandbox for a use");
        self.command(&sb, SandboxMsg::Resume)
            .await?
            .ok_or_else(|| super::not_found_id(sb.id()))?;
        self.resolve_sandbox(&SandboxSelector::Id(sb.id())).await
    }
}

/// Who uses a sandbox, for whether a use resumes a paused one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    /// A caller of the API (authenticated): exec, copy, port-forward.
    Caller,
    /// A request routed to a service endpoint (nobody authenticates it).
    Routed,
}
