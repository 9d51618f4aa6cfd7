//! `sbx.v1.SandboxService`: adapters over the front door's sandboxes and their data plane
//! ([`crate::frontdoor`]); what is left here is the streams' transport (the first message of
//! a client stream, the end at shutdown or at the caller's revocation).

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
use super::status::{actor_error_to_status, failed};
use super::streams::{self, ResponseStream, forward, invalid_input};
use crate::auth;
use crate::frontdoor::{FrontStream, NewSandbox, SandboxChange};

/// The selector of a request's sandbox reference (a missing reference is an empty one, which
/// the selector refuses with INVALID_ARGUMENT).
pub(super) fn selector(r: Option<SandboxRef>) -> Result<SandboxSelector, Status> {
    SandboxSelector::from_ref(&r.unwrap_or_default()).map_err(|e| actor_error_to_status(&e))
}

/// The filter of a list or a watch: an empty workspace means "default".
fn filter(workspace: String, all_workspaces: bool, label_selector: String) -> SandboxFilter {
    SandboxFilter {
        workspace: (!workspace.is_empty()).then_some(workspace),
        all_workspaces,
        label_selector,
    }
}

/// A front-door stream as a gRPC one, ended at the caller's revocation.
fn statuses<T: Send + 'static>(
    caller: &auth::Caller,
    stream: FrontStream<T>,
) -> std::pin::Pin<Box<dyn futures::Stream<Item = Result<T, Status>> + Send>> {
    caller.until_revoked(stream.map(|r| r.map_err(failed)))
}

#[tonic::async_trait]
impl SandboxService for SbxService {
    async fn create_sandbox(
        &self,
        request: Request<CreateSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let new = NewSandbox {
            workspace: (!req.workspace.is_empty()).then_some(req.workspace.as_str()),
            name: &req.name,
            spec: req.spec.unwrap_or_default(),
            stopped: req.stopped,
            providers: &req.providers,
        };
        let created = self.front.new_sandbox(&caller, new).await;
        created.map(Response::new).map_err(failed)
    }

    async fn get_sandbox(
        &self,
        request: Request<GetSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        let sandbox = self.front.get_sandbox(&caller, &sel).await;
        sandbox.map(Response::new).map_err(failed)
    }

    async fn list_sandboxes(
        &self,
        request: Request<ListSandboxesRequest>,
    ) -> Result<Response<ListSandboxesResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let filter = filter(req.workspace, req.all_workspaces, req.label_selector);
        let (sandboxes, next_page_token) = self
            .front
            .list_sandbox_page(&caller, &filter, req.page_size, &req.page_token)
            .await
            .map_err(failed)?;
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
        let network = self.front.get_sandbox_network(&caller, &sel).await;
        network.map(Response::new).map_err(failed)
    }

    async fn update_sandbox_network(
        &self,
        request: Request<v1::UpdateSandboxNetworkRequest>,
    ) -> Result<Response<v1::SandboxNetwork>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let policy = req.policy.unwrap_or_default();
        let network = self
            .front
            .update_sandbox_network(&caller, &sel, policy)
            .await;
        network.map(Response::new).map_err(failed)
    }

    async fn start_sandbox(
        &self,
        request: Request<StartSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let sandbox = request.get_ref().sandbox.clone();
        self.change(&request, sandbox, SandboxChange::Start).await
    }

    async fn stop_sandbox(
        &self,
        request: Request<StopSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let sandbox = request.get_ref().sandbox.clone();
        self.change(&request, sandbox, SandboxChange::Stop).await
    }

    async fn set_sandbox_ttl(
        &self,
        request: Request<v1::SetSandboxTtlRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let req = request.get_ref();
        let (sandbox, ttl) = (req.sandbox.clone(), SandboxChange::Ttl(req.ttl_seconds));
        self.change(&request, sandbox, ttl).await
    }

    async fn pause_sandbox(
        &self,
        request: Request<v1::PauseSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let sandbox = request.get_ref().sandbox.clone();
        self.change(&request, sandbox, SandboxChange::Pause).await
    }

    async fn resume_sandbox(
        &self,
        request: Request<v1::ResumeSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let sandbox = request.get_ref().sandbox.clone();
        self.change(&request, sandbox, SandboxChange::Resume).await
    }

    async fn restart_sandbox(
        &self,
        request: Request<RestartSandboxRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        let sandbox = request.get_ref().sandbox.clone();
        self.change(&request, sandbox, SandboxChange::Restart).await
    }

    async fn delete_sandbox(
        &self,
        request: Request<DeleteSandboxRequest>,
    ) -> Result<Response<DeleteSandboxResponse>, Status> {
        let caller = auth::caller(&request)?;
        let sel = selector(request.into_inner().sandbox)?;
        let deleted = self.front.remove_sandbox(&caller, &sel).await;
        let deleted = deleted.map_err(failed)?;
        Ok(Response::new(DeleteSandboxResponse { deleted }))
    }

    type WatchSandboxesStream = ResponseStream<SandboxEvent>;

    async fn watch_sandboxes(
        &self,
        request: Request<WatchSandboxesRequest>,
    ) -> Result<Response<Self::WatchSandboxesStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let filter = filter(req.workspace, req.all_workspaces, req.label_selector);
        let events = self
            .front
            .watch_sandboxes(&caller, &filter, req.resource_version)
            .await
            .map_err(failed)?;
        Ok(Response::new(streams::forward_buffered(
            statuses(&caller, events),
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
        let input = streams::exec_inputs(messages);
        let opts = ExecOptions {
            env: req.env,
            timeout_seconds: req.timeout_seconds,
            workdir: req.workdir,
            stdin: req.stdin,
            tty: req.tty,
            user: req.user,
        };
        let output = self
            .front
            .exec_here(&caller, &sel, req.command, opts, input)
            .await
            .map_err(failed)?;
        Ok(Response::new(forward(
            statuses(&caller, output),
            self.shutdown.clone(),
        )))
    }

    type CopyFromSandboxStream = ResponseStream<v1::CopyChunk>;

    async fn copy_from_sandbox(
        &self,
        request: Request<v1::CopyFromSandboxRequest>,
    ) -> Result<Response<Self::CopyFromSandboxStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let chunks = self.front.copy_from(&caller, &sel, req.path).await;
        let chunks = chunks.map_err(failed)?;
        Ok(Response::new(forward(
            statuses(&caller, chunks),
            self.shutdown.clone(),
        )))
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
        // The upload ends at its caller's revocation (checked every second) as at any other
        // error of its stream, and is then never taken whole: the copy is dropped mid-stream.
        // Nothing of it is read before the front door has allowed the copy.
        let messages = caller.until_revoked(messages);
        let (data, failed_upload) =
            sbx_actors::upload(messages, |m: v1::CopyToSandboxInput| match m {
                v1::CopyToSandboxInput {
                    input: Some(Input::Data(bytes)),
                } => Some(bytes),
                _ => None,
            });
        tokio::select! {
            copied = self.front.copy_to(&caller, &sel, start.path, data) => copied
                .map(|_| Response::new(v1::CopyToSandboxResponse {}))
                .map_err(failed),
            status = failed_upload => Err(status),
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
        // The caller's stream ends at its first error; a message without input is skipped.
        let input = messages
            .take_while(|m| std::future::ready(m.is_ok()))
            .filter_map(|m| std::future::ready(m.ok().and_then(|m| m.input)));
        let output = self
            .front
            .port_forward(&caller, &sel, start.port, Box::pin(input))
            .await
            .map_err(failed)?;
        Ok(Response::new(forward(
            statuses(&caller, output),
            self.shutdown.clone(),
        )))
    }

    type LogsStream = ResponseStream<LogChunk>;

    async fn logs(
        &self,
        request: Request<LogsRequest>,
    ) -> Result<Response<Self::LogsStream>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let opts = LogOptions {
            follow: req.follow,
            tail_lines: req.tail_lines,
            timestamps: req.timestamps,
            since: req.since,
        };
        let chunks = self.front.logs(&caller, &sel, opts).await;
        let chunks = chunks.map_err(failed)?;
        Ok(Response::new(forward(
            statuses(&caller, chunks),
            self.shutdown.clone(),
        )))
    }

    async fn get_sandbox_stats(
        &self,
        request: Request<v1::GetSandboxStatsRequest>,
    ) -> Result<Response<v1::SandboxStats>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sel = selector(req.sandbox)?;
        let history = std::time::Duration::from_secs(u64::from(req.history_seconds));
        let stats = self.front.sandbox_stats(&caller, &sel, history).await;
        stats.map(Response::new).map_err(failed)
    }

    async fn list_events(
        &self,
        request: Request<v1::ListEventsRequest>,
    ) -> Result<Response<v1::ListEventsResponse>, Status> {
        let caller = auth::caller(&request)?;
        let req = request.into_inner();
        let sandbox = match req.sandbox {
            Some(r) => Some(selector(Some(r))?),
            None => None,
        };
        let filter = filter(req.workspace, req.all_workspaces, String::new());
        let (events, next_page_token) = self
            .front
            .list_events(
                &caller,
                sandbox.as_ref(),
                &filter,
                req.page_size,
                &req.page_token,
            )
            .await
            .map_err(failed)?;
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
        let interval = match req.interval_ms {
            0 => std::time::Duration::from_secs(2),
            ms => std::time::Duration::from_millis(u64::from(ms)),
        };
        let stats = self
            .front
            .watch_sandbox_stats(&caller, &sel, interval)
            .await
            .map_err(failed)?;
        Ok(Response::new(forward(
            statuses(&caller, stats),
            self.shutdown.clone(),
        )))
    }
}

impl SbxService {
    /// The adapter of every call that changes a sandbox's state: the caller, the sandbox
    /// `sandbox` names, one front-door call.
    async fn change<T>(
        &self,
        request: &Request<T>,
        sandbox: Option<SandboxRef>,
        change: SandboxChange,
    ) -> Result<Response<Sandbox>, Status> {
        let caller = auth::caller(request)?;
        let sel = selector(sandbox)?;
        let changed = self.front.change_sandbox(&caller, &sel, change).await;
        changed.map(Response::new).map_err(failed)
    }
}
