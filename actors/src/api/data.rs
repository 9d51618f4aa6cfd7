//! What goes to a sandbox's driver directly, past the actors: exec, copy in and out,
//! port-forward and logs. None of them changes the sandbox's record, so none needs its actor's
//! mailbox; each checks the sandbox's phase from the store and calls the driver by id. Callers
//! speak the public API both ways; the driver's contract stays in here (`translate.rs`).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use sbx_driver_api::{ByteStream, DriverStream, pb};
use sbx_proto::v1::{self, Phase, Sandbox};

use super::{ExecOptions, Gateway};
use crate::error::{ActorError, Result};
use crate::translate;

/// A stream of answers from a sandbox (exec output, copied bytes, log chunks…).
pub type ActorStream<T> = Pin<Box<dyn Stream<Item = Result<T>> + Send + 'static>>;

/// What a caller sends to an exec after its request: stdin, its end, terminal sizes, signals.
/// Its end is the end of the caller's input.
pub type ExecInputs = Pin<Box<dyn Stream<Item = v1::exec_input::Input> + Send + 'static>>;

/// What a caller sends to a port-forward after its start: data, and the end of its writes.
pub type ForwardInputs =
    Pin<Box<dyn Stream<Item = v1::port_forward_input::Input> + Send + 'static>>;

/// How much of a sandbox's log, and how (the public `LogsRequest` without its sandbox).
#[derive(Debug, Clone, Default)]
pub struct LogOptions {
    pub follow: bool,
    pub tail_lines: u32,
    pub timestamps: bool,
    pub since: Option<sbx_proto::Timestamp>,
}

/// A copy's path the driver refused (missing, not a directory, an entry it would not
/// unpack) is the caller's mistake, said as one: INVALID_ARGUMENT, not the driver's reason.
fn callers_path(e: sbx_driver_api::DriverError) -> ActorError {
    match e {
        sbx_driver_api::DriverError::InvalidArgument(m) => ActorError::InvalidArgument(m),
        e => ActorError::Driver(e),
    }
}

/// A driver's stream in the public API's words.
fn public<T, U>(stream: DriverStream<T>, convert: fn(T) -> U) -> ActorStream<U>
where
    T: Send + 'static,
    U: Send + 'static,
{
    Box::pin(stream.map(move |r| r.map(convert).map_err(ActorError::Driver)))
}

/// `stream`, holding `in_use` (a use of its sandbox, for idleness) until it is dropped.
fn in_use<U: Send + 'static>(
    stream: ActorStream<U>,
    in_use: crate::lifetime::InUse,
) -> ActorStream<U> {
    Box::pin(stream.map(move |item| {
        let _held = &in_use;
        item
    }))
}
use crate::records::StoredSandbox;
use crate::validate::{self, SandboxSelector};

impl Gateway {
    /// Runs a command inside a Ready sandbox, with no input.
    pub async fn exec(
        &self,
        sel: &SandboxSelector,
        command: Vec<String>,
        env: HashMap<String, String>,
        timeout_seconds: u32,
    ) -> Result<ActorStream<v1::ExecOutput>> {
        let opts = ExecOptions {
            env,
            timeout_seconds,
            ..ExecOptions::default()
        };
        self.exec_io(sel, command, opts, Box::pin(futures::stream::empty()))
            .await
    }

    /// Runs a command inside a Ready sandbox with `input` (stdin, terminal sizes, signals) as
    /// the caller sends it. A request for stdin or a terminal from a driver that has neither
    /// is UNIMPLEMENTED, said before anything runs. Input that makes no sense (a resize
    /// without a terminal, a signal that is none, a second request) ends the exec with
    /// INVALID_ARGUMENT, and with it the command.
    pub async fn exec_io(
        &self,
        sel: &SandboxSelector,
        command: Vec<String>,
        opts: ExecOptions,
        input: ExecInputs,
    ) -> Result<ActorStream<v1::ExecOutput>> {
        validate::exec(&command, &opts.env, &opts.workdir)?;
        validate::exec_user(&opts.user)?;
        let sb = self.resolve_for_use(sel, "exec into").await?;
        require_ready(&sb.sandbox, "exec into")?;
        let driver = self.driver_of(&sb).await?;
        let using = self.shared.activity.begin(sb.id());
        // The sandbox's credentials and settings as they are now, then the exec's own
        // variables on top.
        let mut env: std::collections::HashMap<String, String> = crate::owned::run_env(
            self.shared.store.as_ref(),
            &self.shared.config.secrets,
            sb.id(),
        )
        .await?
        .into_iter()
        .collect();
        env.extend(opts.env);
        let request = pb::ExecRequest {
            sandbox_id: sb.id().to_string(),
            command,
            env,
            timeout_seconds: opts.timeout_seconds,
            workdir: opts.workdir,
            stdin: opts.stdin,
            tty: opts.tty.map(translate::tty),
            user: opts.user,
        };
        let (input, refused) = translate::exec_input(input, request.tty.is_some());
        let output = public(
            driver.exec_io(request, input).await?,
            translate::exec_output,
        );
        Ok(in_use(
            Box::pin(translate::until_refused(output, refused)),
            using,
        ))
    }

    /// A path of a Ready sandbox as a tar stream.
    pub async fn copy_from(
        &self,
        sel: &SandboxSelector,
        path: String,
    ) -> Result<ActorStream<v1::CopyChunk>> {
        let path = copy_path(path)?;
        let sb = self.resolve_for_use(sel, "copy from").await?;
        require_settled(&sb.sandbox, "copy from")?;
        let driver = self.driver_of(&sb).await?;
        let using = self.shared.activity.begin(sb.id());
        let req = pb::CopyFromRequest {
            sandbox_id: sb.id().to_string(),
            path,
            changes: false,
        };
        let chunks = driver.copy_from(req).await.map_err(callers_path)?;
        Ok(in_use(
            public(chunks, |c| v1::CopyChunk { data: c.data }),
            using,
        ))
    }

    /// What a sandbox whose workload has ended changed in its root filesystem, as an OCI
    /// layer tar (`CopyFromRequest.changes`; the `oci` driver keeps them apart).
    pub async fn copy_changes(&self, sel: &SandboxSelector) -> Result<ActorStream<v1::CopyChunk>> {
        let sb = self.resolve_sandbox(sel).await?;
        let driver = self.driver_of(&sb).await?;
        let req = pb::CopyFromRequest {
            sandbox_id: sb.id().to_string(),
            path: String::new(),
            changes: true,
        };
        let chunks = driver.copy_from(req).await?;
        Ok(public(chunks, |c| v1::CopyChunk { data: c.data }))
    }

    /// Unpacks the tar `data` in a sandbox at `path` (Ready, or stopped where its driver
    /// can copy then).
    pub async fn copy_to(
        &self,
        sel: &SandboxSelector,
        path: String,
        data: ByteStream,
    ) -> Result<()> {
        let path = copy_path(path)?;
        let sb = self.resolve_for_use(sel, "copy into").await?;
        require_settled(&sb.sandbox, "copy into")?;
        let driver = self.driver_of(&sb).await?;
        let _using = self.shared.activity.begin(sb.id());
        let req = pb::CopyToStart {
            sandbox_id: sb.id().to_string(),
            path,
        };
        driver.copy_to(req, data).await.map_err(callers_path)?;
        Ok(())
    }

    /// A TCP connection to `port` on a Ready sandbox's loopback.
    pub async fn port_forward(
        &self,
        sel: &SandboxSelector,
        port: u32,
        input: ForwardInputs,
    ) -> Result<ActorStream<v1::PortForwardOutput>> {
        self.forward_for(sel, port, input, super::lifetimes::Use::Caller)
            .await
    }

    /// [`Gateway::port_forward`] for a request routed to a service endpoint: a paused sandbox
    /// wakes only as `lifetime::wakes_on_request` says.
    pub async fn routed_forward(
        &self,
        sel: &SandboxSelector,
        port: u32,
        input: ForwardInputs,
    ) -> Result<ActorStream<v1::PortForwardOutput>> {
        self.forward_for(sel, port, input, super::lifetimes::Use::Routed)
            .await
    }

    async fn forward_for(
        &self,
        sel: &SandboxSelector,
        port: u32,
        input: ForwardInputs,
        who: super::lifetimes::Use,
    ) -> Result<ActorStream<v1::PortForwardOutput>> {
        if port == 0 || port > u32::from(u16::MAX) {
            return Err(ActorError::InvalidArgument(format!(
                "port {port} is not a TCP port (1-65535)"
            )));
        }
        let sb = self.resolve_for(sel, "forward a port of", who).await?;
        require_ready(&sb.sandbox, "forward a port of")?;
        let driver = self.driver_of(&sb).await?;
        let using = self.shared.activity.begin(sb.id());
        let req = pb::PortForwardStart {
            sandbox_id: sb.id().to_string(),
            port,
        };
        let input = input.filter_map(|i| std::future::ready(translate::forward_input(i)));
        let output = driver.port_forward(req, Box::pin(input)).await?;
        Ok(in_use(public(output, translate::forward_output), using))
    }

    /// The log of the sandbox `sel` names, as `opts` asks (follow, tail, timestamps, since).
    pub async fn logs(
        &self,
        sel: &SandboxSelector,
        opts: LogOptions,
    ) -> Result<ActorStream<v1::LogChunk>> {
        let sb = self.resolve_sandbox(sel).await?;
        let driver = self.driver_of(&sb).await?;
        // Following a log is watching the sandbox work: a use, for idleness.
        let using = opts.follow.then(|| self.shared.activity.begin(sb.id()));
        let req = pb::LogsRequest {
            sandbox_id: sb.id().to_string(),
            follow: opts.follow,
            tail_lines: opts.tail_lines,
            timestamps: opts.timestamps,
            since: opts.since,
        };
        let chunks = public(driver.logs(req).await?, translate::log_chunk);
        Ok(match using {
            Some(using) => in_use(chunks, using),
            None => chunks,
        })
    }

    /// The driver a sandbox runs on: its node's, or the local driver its spec names. Gateways
    /// sharing a store: only the workspace's holder reaches it (`HeldElsewhere` names the
    /// holder, which sbxd forwards the request to) — a call under this gateway's token after
    /// another took the workspace would be fenced anyway, and a sandbox on a gateway's own
    /// local driver is on that gateway's machine.
    pub(super) async fn driver_of(
        &self,
        sb: &StoredSandbox,
    ) -> Result<Arc<dyn sbx_driver_api::ComputeDriver>> {
        self.router.refuse_unless_held(sb.workspace_id()).await?;
        self.shared.drivers.for_sandbox(&sb.sandbox)
    }
}

fn require_ready(sb: &Sandbox, what: &str) -> Result<()> {
    let phase = sb.phase();
    if phase == Phase::Ready {
        return Ok(());
    }
    // What leads the way to Ready from here.
    let next = match phase {
        Phase::Stopped | Phase::Completed | Phase::Error => format!(
            "; start it first: sbx sandbox start -w {} {}",
            sb.workspace, sb.name
        ),
        Phase::Paused => format!(
            "; resume it first: sbx sandbox resume -w {} {}",
            sb.workspace, sb.name
        ),
        Phase::Provisioning | Phase::Starting => format!(
            "; wait until it is: sbx wait -w {} --for ready {}",
            sb.workspace, sb.name
        ),
        _ => String::new(),
    };
    Err(ActorError::FailedPrecondition(format!(
        "cannot {what} sandbox {:?}: it is {phase:?}, not Ready{next}",
        sb.name
    )))
}

/// A copy goes to the running workload's agent, or, where the driver can
/// (`copy_when_stopped`), to the files of a sandbox that does not run: Ready, or settled
/// without a workload (Stopped, Completed, Error). A sandbox on its way between the two is
/// refused: its files are about to change hands.
fn require_settled(sb: &Sandbox, what: &str) -> Result<()> {
    match sb.phase() {
        Phase::Ready | Phase::Stopped | Phase::Completed | Phase::Error => Ok(()),
        phase => Err(ActorError::FailedPrecondition(format!(
            "cannot {what} sandbox {:?}: it is {phase:?}; wait until it is Ready or Stopped",
            sb.name
        ))),
    }
}

/// A path for a copy: absolute, without NUL, at most 4096 bytes.
fn copy_path(path: String) -> Result<String> {
    if !path.starts_with('/') || path.contains('\0') || path.len() > 4096 {
        return Err(ActorError::InvalidArgument(format!(
            "the sandbox path {} is not an absolute path (at most 4096 bytes, no NUL)",
            crate::limits::quote(&path)
        )));
    }
    Ok(path)
}
