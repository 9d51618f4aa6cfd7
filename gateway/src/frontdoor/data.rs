//! A sandbox's data plane as the gRPC door serves it: exec, copy in and out, port-forward,
//! logs and the stats and events that follow a sandbox. Each call is checked against the
//! sandbox's workspace (editor to act on it, viewer to read it) and audited when it acts,
//! before the stream begins. The streams' own errors are the actor's as they are: the
//! sandbox was found and allowed, so there is nothing left to hide.

use std::time::Duration;

use futures::{Stream, StreamExt};
use sbx_actors::{
    ByteStream, ExecInputs, ExecOptions, ForwardInputs, LogOptions, SandboxFilter, SandboxSelector,
};
use sbx_proto::v1;

use super::{Failure, FrontDoor, audit, describe, visible_page};
use crate::auth::{Caller, Role};

/// A stream of a call's answers, each an item or the failure that ends it.
pub type FrontStream<T> = std::pin::Pin<Box<dyn Stream<Item = Result<T, Failure>> + Send>>;

/// An actor stream as the door answers it.
pub(super) fn front_stream<T: Send + 'static>(
    stream: impl Stream<Item = Result<T, sbx_actors::ActorError>> + Send + 'static,
) -> FrontStream<T> {
    Box::pin(stream.map(|r| r.map_err(Failure::from)))
}

impl FrontDoor {
    /// Runs `command` in the sandbox `sel` names (editor in its workspace), here.
    pub async fn exec_here(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        command: Vec<String>,
        opts: ExecOptions,
        input: ExecInputs,
    ) -> Result<FrontStream<v1::ExecOutput>, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "exec", &describe(sel));
        let output = self.gateway.exec_io(sel, command, opts, input).await;
        let output = output.map_err(|e| FrontDoor::failure(caller, e))?;
        Ok(front_stream(output))
    }

    /// The file or tree at `path` of the sandbox `sel` names, as tar chunks (editor in its
    /// workspace: a copy out can read anything the sandbox holds).
    pub async fn copy_from(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        path: String,
    ) -> Result<FrontStream<v1::CopyChunk>, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "copy from sandbox", &describe(sel));
        let chunks = self.gateway.copy_from(sel, path).await;
        let chunks = chunks.map_err(|e| FrontDoor::failure(caller, e))?;
        Ok(front_stream(chunks))
    }

    /// Writes `data` (a tar stream) at `path` of the sandbox `sel` names (editor in its
    /// workspace). `data` is not read before the call is allowed.
    pub async fn copy_to(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        path: String,
        data: ByteStream,
    ) -> Result<(), Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "copy into sandbox", &describe(sel));
        let copied = self.gateway.copy_to(sel, path, data).await;
        copied.map_err(|e| FrontDoor::failure(caller, e))
    }

    /// Forwards a connection to `port` of the sandbox `sel` names (editor in its
    /// workspace).
    pub async fn port_forward(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        port: u32,
        input: ForwardInputs,
    ) -> Result<FrontStream<v1::PortForwardOutput>, Failure> {
        self.sandbox_access(caller, sel, Role::Editor).await?;
        audit(caller, "port-forward", &describe(sel));
        let output = self.gateway.port_forward(sel, port, input).await;
        let output = output.map_err(|e| FrontDoor::failure(caller, e))?;
        Ok(front_stream(output))
    }

    /// The log of the sandbox `sel` names (viewer in its workspace).
    pub async fn logs(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        opts: LogOptions,
    ) -> Result<FrontStream<v1::LogChunk>, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let chunks = self.gateway.logs(sel, opts).await;
        let chunks = chunks.map_err(|e| FrontDoor::failure(caller, e))?;
        Ok(front_stream(chunks))
    }

    /// Usage samples of the sandbox `sel` names every `interval` (viewer in its workspace).
    pub async fn watch_sandbox_stats(
        &self,
        caller: &Caller,
        sel: &SandboxSelector,
        interval: Duration,
    ) -> Result<FrontStream<v1::SandboxStats>, Failure> {
        self.sandbox_access(caller, sel, Role::Viewer).await?;
        let stats = self.gateway.watch_sandbox_stats(sel, interval).await;
        let stats = stats.map_err(|e| FrontDoor::failure(caller, e))?;
        Ok(front_stream(stats))
    }

    /// The changes of the sandboxes `filter` names from `resource_version` on: of one
    /// workspace (viewer there) or of all, those of workspaces the caller does not see left
    /// out.
    pub async fn watch_sandboxes(
        &self,
        caller: &Caller,
        filter: &SandboxFilter,
        resource_version: u64,
    ) -> Result<FrontStream<v1::SandboxEvent>, Failure> {
        let workspace = filter.workspace.as_deref().unwrap_or_default();
        self.list_access(caller, workspace, filter.all_workspaces)
            .await?;
        let events = self.gateway.watch(filter, resource_version).await;
        let events = events.map_err(|e| FrontDoor::failure(caller, e))?;
        let seen = caller.clone();
        let events = events.filter(move |r| {
            std::future::ready(match r {
                Ok(event) => event
                    .sandbox
                    .as_ref()
                    .is_none_or(|sb| seen.sees(&sb.workspace_id)),
                Err(_) => true,
            })
        });
        Ok(front_stream(events))
    }

    /// The events of the sandbox `sandbox` names (viewer in its workspace), all of them;
    /// else one page of the events of the sandboxes `filter` names (of one workspace: viewer
    /// there; of all: those the caller sees), and the token of the next.
    pub async fn list_events(
        &self,
        caller: &Caller,
        sandbox: Option<&SandboxSelector>,
        filter: &SandboxFilter,
        page_size: u32,
        token: &str,
    ) -> Result<(Vec<v1::Event>, String), Failure> {
        if let Some(sel) = sandbox {
            self.sandbox_access(caller, sel, Role::Viewer).await?;
            let events = self.gateway.sandbox_events(sel).await;
            let events = events.map_err(|e| FrontDoor::failure(caller, e))?;
            return Ok((events, String::new()));
        }
        let workspace = filter.workspace.as_deref().unwrap_or_default();
        self.list_access(caller, workspace, filter.all_workspaces)
            .await?;
        let gateway = &self.gateway;
        visible_page(
            page_size,
            token,
            |size, token| async move { gateway.list_events(filter, size, &token).await },
            |e: &v1::Event| caller.sees(&e.workspace_id),
        )
        .await
        .map_err(|e| FrontDoor::failure(caller, e))
    }
}
