//! `sbx.v1.SandboxService` over the actor API.

use futures::StreamExt;
use sbx_actors::{ExecOptions, LogOptions, SandboxFilter, SandboxSelector};
use sbx_proto::v1;
use sbx_proto::v1::sandbox_service_server::SandboxService;
use sbx_proto::v1::{
    CreateSandboxRequest, DeleteSandboxRequest, DeleteSandboxResponse, ExecInput, ExecOutput,
    GetSandboxRequest, ListSandboxesRequest, ListSandboxesResponse, LogChunk, LogsRequest,
    RestartSandboxRequest, Sandbox, SandboxEvent, SandboxRef, StartSandboxRequest,
    StopSandboxRequest, WatchSandboxesRequest,
};
use tonic::{Request, Response, Status};

use super::SbxService;
use super::access::{audit, error_for};
use super::status::actor_error_to_status;
use super::streams::{self, ResponseStream, forward, invalid_input};
use crate::auth::{self, Role};

/// The selector of a request's sandbox reference (a missing reference is an empty one, which
/// the selector refuses with INVALID_ARGUMENT).
pub(super) fn selector(r: Option<SandboxRef>) -> Result<SandboxSelector, Status> {
    SandboxSelector::from_ref(&r.unwrap_or_default()).map_err(|e| actor_error_to_status(&e))
}

/// A selector in the audit log: the id, or workspace/name.
pub(super) fn describe(sel: &SandboxSelector) -> String {
    match sel {
        SandboxSelector::Id(id) => id.to_string(),
        SandboxSelector::Name { workspace, name } => qualified(workspace.as_deref(), name),
    }
}

/// workspace/name, the workspace "default" when none is named.
pub(super) fn qualified(workspace: Option<&str>, name: &str) -> String {
    format!(
        "{}/{name}",
        workspace.unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE)
    )
}

/// The filter of a list or a watch: an empty workspace means "default".
fn filter(workspace: String, all_workspaces: bool, label_selector: String) -> SandboxFilter {
    SandboxFilter {
        workspace: (!workspace.is_empty()).then_some(workspace),
        all_workspaces,
        label_selector,
    }
}

#[tonic::async_trait]
impl SandboxService for SbxService {
    async fn create_sandbox(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let workspace = (!req.workspace.is_empty()).then_some(req.workspace.as_str());
        self.require_by_name(
            &caller,
            workspace.unwrap_or(sbx_proto::names::DEFAULT_WORKSPACE),
            Role::Editor,
        )
        .await?;
        let spec = req.spec.unwrap_or_default();
        if let Some(mirror) = &self.image_mirror {
            mirror.fetch_for(&self.gateway, &spec).await;
        }
        let created = self
            .gateway
            .create_sandbox_with(workspace, &req.name, spec, req.stopped, &req.providers)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "create sandbox", &created.id);
        Ok(Response::new(created))
    }

    async fn get_sandbox(
        &self,
        request: Request<GetSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let sandbox = self
            .gateway
            .get_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(sandbox))
    }

    async fn list_sandboxes(
        &self,
        request: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        self.list_access(&caller, &req.workspace, req.all_workspaces)
            .await?;
        let filter = filter(req.workspace, req.all_workspaces, req.label_selector);
        let (sandboxes, next_page_token) = super::access::visible_page(
            req.page_size,
            &req.page_token,
            |size, token| {
                let (gateway, filter) = (&self.gateway, &filter);
                async move { gateway.list_sandboxes(filter, size, &token).await }
            },
            |sb: &v1::Sandbox| caller.sees(&sb.workspace_id),
        )
        .await
        .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(ListSandboxesResponse {
            sandboxes,
            next_page_token,
        }))
    }

    async fn get_sandbox_network(
        &self,
        request: Request<v1::GetSandboxNetworkRequest>,
    ) -> Result<Response<v1::SandboxNetwork>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let network = self
            .gateway
            .get_sandbox_network(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(network))
    }

    async fn update_sandbox_network(
        &self,
        request: Request<v1::UpdateSandboxNetworkRequest>,
    ) -> Result<Response<v1::SandboxNetwork>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let policy = req.policy.unwrap_or_default();
        let entries = policy.allow.len();
        let network = self
            .gateway
            .update_sandbox_network(&sel, policy)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(
            &caller,
            &format!("update sandbox network ({entries} allow entries)"),
            &network.sandbox_id,
        );
        Ok(Response::new(network))
    }

    async fn start_sandbox(
        &self,
        request: Request<StartSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let sandbox = self
            .gateway
            .start_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "start sandbox", &sandbox.id);
        Ok(Response::new(sandbox))
    }

    async fn stop_sandbox(
        &self,
        request: Request<StopSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let sandbox = self
            .gateway
            .stop_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "stop sandbox", &sandbox.id);
        Ok(Response::new(sandbox))
    }

    async fn set_sandbox_ttl(
        &self,
        request: Request<v1::SetSandboxTtlRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let sandbox = self
            .gateway
            .set_sandbox_ttl(&sel, req.ttl_seconds)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "set sandbox ttl", &sandbox.id);
        Ok(Response::new(sandbox))
    }

    async fn pause_sandbox(
        &self,
        request: Request<v1::PauseSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let sandbox = self
            .gateway
            .pause_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "pause sandbox", &sandbox.id);
        Ok(Response::new(sandbox))
    }

    async fn resume_sandbox(
        &self,
        request: Request<v1::ResumeSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let sandbox = self
            .gateway
            .resume_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "resume sandbox", &sandbox.id);
        Ok(Response::new(sandbox))
    }

    async fn restart_sandbox(
        &self,
        request: Request<RestartSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        let sandbox = self
            .gateway
            .restart_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        audit(&caller, "restart sandbox", &sandbox.id);
        Ok(Response::new(sandbox))
    }

    async fn delete_sandbox(
        &self,
        request: Request<DeleteSandboxRequest>,
    ) -> Result<Response<DeleteSandboxResponse>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "delete sandbox", &describe(&sel));
        let deleted = self
            .gateway
            .delete_sandbox(&sel)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(DeleteSandboxResponse { deleted }))
    }

    type WatchSandboxesStream = ResponseStream<SandboxEvent>;

    async fn watch_sandboxes(
        &self,
        request: Request<WatchSandboxesRequest>,
    ) -> Result<Response<Self::WatchSandboxesStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        self.list_access(&caller, &req.workspace, req.all_workspaces)
            .await?;
        let filter = filter(req.workspace, req.all_workspaces, req.label_selector);
        let events = self
            .gateway
            .watch(&filter, req.resource_version)
            .await
            .map_err(|e| error_for(&caller, e))?;
        let seen = caller.clone();
        let events = events
            .filter(move |r| {
                std::future::ready(match r {
                    Ok(event) => event
                        .sandbox
                        .as_ref()
                        .is_none_or(|sb| seen.sees(&sb.workspace_id)),
                    Err(_) => true,
                })
            })
            .map(|r| r.map_err(|e| actor_error_to_status(&e)));
        let events = caller.until_revoked(events);
        Ok(Response::new(streams::forward_buffered(
            events,
            self.shutdown.clone(),
            streams::WATCH_STREAM_BUFFER,
        )))
    }

    type ExecStream = ResponseStream<ExecOutput>;

    async fn exec(
        &self,
        request: Request<tonic::Streaming<ExecInput>>,
    ) -> Result<Response<Self::ExecStream>, Status> {
        let caller = auth::caller(&request)?;
        let mut messages = request.into_inner();
        let req = streams::exec_start(&mut messages).await?;
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "exec", &describe(&sel));
        let input = streams::exec_inputs(messages);
        let opts = ExecOptions {
            env: req.env,
            timeout_seconds: req.timeout_seconds,
            workdir: req.workdir,
            stdin: req.stdin,
            tty: req.tty,
        };
        let output = self
            .gateway
            .exec_io(&sel, req.command, opts, input)
            .await
            .map_err(|e| error_for(&caller, e))?;
        let output = caller.until_revoked(output.map(|r| r.map_err(|e| actor_error_to_status(&e))));
        Ok(Response::new(forward(output, self.shutdown.clone())))
    }

    type CopyFromSandboxStream = ResponseStream<v1::CopyChunk>;

    async fn copy_from_sandbox(
        &self,
        request: Request<v1::CopyFromSandboxRequest>,
    ) -> Result<Response<Self::CopyFromSandboxStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "copy from sandbox", &describe(&sel));
        let chunks = self
            .gateway
            .copy_from(&sel, req.path)
            .await
            .map_err(|e| error_for(&caller, e))?;
        let chunks = caller.until_revoked(chunks.map(|r| r.map_err(|e| actor_error_to_status(&e))));
        Ok(Response::new(forward(chunks, self.shutdown.clone())))
    }

    async fn copy_to_sandbox(
        &self,
        request: Request<tonic::Streaming<v1::CopyToSandboxInput>>,
    ) -> Result<Response<v1::CopyToSandboxResponse>, Status> {
        use v1::copy_to_sandbox_input::Input;
        let caller = auth::caller(&request)?;
        let mut messages = request.into_inner();
        let start = match messages.message().await? {
            Some(v1::CopyToSandboxInput {
                input: Some(Input::Start(start)),
            }) => start,
            _ => {
                return Err(invalid_input(
                    "the first message of a copy must be its start (sandbox and path)",
                ));
            }
        };
        let sel = selector(start.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "copy into sandbox", &describe(&sel));
        // The upload ends at its caller's revocation (checked every second) as at any other
        // error of its stream, and is then never taken whole: the copy is dropped mid-stream.
        let messages = caller.until_revoked(messages);
        let (data, failed) = sbx_actors::upload(messages, |m: v1::CopyToSandboxInput| match m {
            v1::CopyToSandboxInput {
                input: Some(Input::Data(bytes)),
            } => Some(bytes),
            _ => None,
        });
        tokio::select! {
            copied = self.gateway.copy_to(&sel, start.path, data) => copied
                .map(|_| Response::new(v1::CopyToSandboxResponse {}))
                .map_err(|e| error_for(&caller, e)),
            status = failed => Err(status),
        }
    }

    type PortForwardStream = ResponseStream<v1::PortForwardOutput>;

    async fn port_forward(
        &self,
        request: Request<tonic::Streaming<v1::PortForwardInput>>,
    ) -> Result<Response<Self::PortForwardStream>, Status> {
        use v1::port_forward_input::Input as In;
        let caller = auth::caller(&request)?;
        let mut messages = request.into_inner();
        let start = match messages.message().await? {
            Some(v1::PortForwardInput {
                input: Some(In::Start(start)),
            }) => start,
            _ => {
                return Err(invalid_input(
                    "the first message of a port-forward must be its start (sandbox and port)",
                ));
            }
        };
        let sel = selector(start.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Editor).await?;
        audit(&caller, "port-forward", &describe(&sel));
        // The caller's stream ends at its first error; a message without input is skipped.
        let input = messages
            .take_while(|m| std::future::ready(m.is_ok()))
            .filter_map(|m| std::future::ready(m.ok().and_then(|m| m.input)));
        let output = self
            .gateway
            .port_forward(&sel, start.port, Box::pin(input))
            .await
            .map_err(|e| error_for(&caller, e))?;
        let output = caller.until_revoked(output.map(|r| r.map_err(|e| actor_error_to_status(&e))));
        Ok(Response::new(forward(output, self.shutdown.clone())))
    }

    type LogsStream = ResponseStream<LogChunk>;

    async fn logs(
        &self,
        request: Request<LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let opts = LogOptions {
            follow: req.follow,
            tail_lines: req.tail_lines,
            timestamps: req.timestamps,
            since: req.since,
        };
        let chunks = self
            .gateway
            .logs(&sel, opts)
            .await
            .map_err(|e| error_for(&caller, e))?;
        let chunks = caller.until_revoked(chunks.map(|r| r.map_err(|e| actor_error_to_status(&e))));
        Ok(Response::new(forward(chunks, self.shutdown.clone())))
    }

    async fn get_sandbox_stats(
        &self,
        request: Request<v1::GetSandboxStatsRequest>,
    ) -> Result<Response<v1::SandboxStats>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let history = std::time::Duration::from_secs(u64::from(req.history_seconds));
        let stats = self
            .gateway
            .sandbox_stats(&sel, history)
            .await
            .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(stats))
    }

    async fn list_events(
        &self,
        request: Request<v1::ListEventsRequest>,
    ) -> Result<Response<v1::ListEventsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        if req.sandbox.is_some() {
            let sel = selector(req.sandbox)?;
            self.sandbox_access(&caller, &sel, Role::Viewer).await?;
            let events = self
                .gateway
                .sandbox_events(&sel)
                .await
                .map_err(|e| error_for(&caller, e))?;
            return Ok(Response::new(v1::ListEventsResponse {
                events,
                next_page_token: String::new(),
            }));
        }
        self.list_access(&caller, &req.workspace, req.all_workspaces)
            .await?;
        let filter = filter(req.workspace, req.all_workspaces, String::new());
        let (events, next_page_token) = super::access::visible_page(
            req.page_size,
            &req.page_token,
            |size, token| {
                let (gateway, filter) = (&self.gateway, &filter);
                async move { gateway.list_events(filter, size, &token).await }
            },
            |e: &v1::Event| caller.sees(&e.workspace_id),
        )
        .await
        .map_err(|e| error_for(&caller, e))?;
        Ok(Response::new(v1::ListEventsResponse {
            events,
            next_page_token,
        }))
    }

    type WatchSandboxStatsStream = ResponseStream<v1::SandboxStats>;

    async fn watch_sandbox_stats(
        &self,
        request: Request<v1::WatchSandboxStatsRequest>,
    ) -> Result<Response<Self::WatchSandboxStatsStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        self.sandbox_access(&caller, &sel, Role::Viewer).await?;
        let interval = match req.interval_ms {
            0 => std::time::Duration::from_secs(2),
            ms => std::time::Duration::from_millis(u64::from(ms)),
        };
        let stats = self
            .gateway
            .watch_sandbox_stats(&sel, interval)
            .await
            .map_err(|e| error_for(&caller, e))?;
        let stats = caller.until_revoked(stats.map(|r| r.map_err(|e| actor_error_to_status(&e))));
        Ok(Response::new(forward(stats, self.shutdown.clone())))
    }
}
