//! Dialing the gateway and running one parsed command.
//!
//! Each command first builds its request from the arguments (so a local mistake is reported
//! without touching the network), then connects, calls, and prints.

use std::time::{Duration, SystemTime};

use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::workspace_service_client::WorkspaceServiceClient;
use sbx_proto::v1::{
    DeleteSandboxRequest, GetSandboxRequest, GetWorkspaceRequest, RestartSandboxRequest, Sandbox,
    SandboxRef, StartSandboxRequest, StopSandboxRequest,
};

pub use super::connect::connect;
use super::connect::{Channel, Target};
use super::output::{render_sandbox, render_sandboxes, render_workspace, render_workspaces};
use super::reply::{collect_pages, found_or_absent, print, print_deleted, print_list};
use super::request::{self, describe_sandbox_ref, describe_workspace_ref, sandbox_ref};
use super::wait::{
    Goal, Observation, WaitOptions, WatchSource, progress_for_stderr, wait_for, wait_serving,
};
use super::{
    Cli, CliError, Command, OutputFormat, SandboxActionArgs, SandboxCommand, SandboxCreateArgs,
    SandboxTargetArgs, WaitArgs, WaitCondition, WorkspaceCommand, files, stream,
};

/// The exit status of a process killed by SIGPIPE, used when stdout is closed under us
/// (`sbx sandbox watch | head -1`): quiet, as other Unix tools are.
const BROKEN_PIPE_EXIT: u8 = 141;

/// The conventional exit status after SIGINT (128 + 2), for a Ctrl-C while waiting for Ready.
const INTERRUPTED_EXIT: u8 = 130;

/// The exit status of a command killed by `--timeout`, as timeout(1) has it.
const TIMED_OUT_EXIT: u8 = 124;

/// Runs the command on a fresh single-threaded runtime, prints any error as one
/// `error: …` line on stderr, and returns the process exit code.
pub fn run_to_exit_code(cli: Cli) -> u8 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("error: cannot start the async runtime: {err}");
            return 1;
        }
    };
    let (code, message) = outcome(runtime.block_on(run(cli)));
    if let Some(message) = message {
        eprintln!("{message}");
    }
    code
}

/// The exit code and the stderr line (if any) for a command's result: `Ok(code)` → `code`;
/// a closed stdout → [`BROKEN_PIPE_EXIT`], silently; Ctrl-C while waiting → [`INTERRUPTED_EXIT`]
/// and `error: …`; a usage error (arguments that do not go together, a duration that is none,
/// a command given by hand) → 2, as clap's own; any other error → 1 and `error: …`.
pub fn outcome(result: Result<u8, CliError>) -> (u8, Option<String>) {
    match result {
        Ok(code) => (code, None),
        Err(CliError::Io(err)) if err.kind() == std::io::ErrorKind::BrokenPipe => {
            (BROKEN_PIPE_EXIT, None)
        }
        Err(
            err @ (CliError::Usage(_)
            | CliError::NotATerminal
            | CliError::InvalidLifetime { .. }
            | CliError::InvalidDuration { .. }),
        ) => (2, Some(format!("error: {err}"))),
        Err(err @ CliError::ExecTimedOut { .. }) => (TIMED_OUT_EXIT, Some(format!("error: {err}"))),
        Err(err @ (CliError::Interrupted { .. } | CliError::ExecAbandoned)) => {
            (INTERRUPTED_EXIT, Some(format!("error: {err}")))
        }
        Err(err) => (1, Some(format!("error: {err}"))),
    }
}

/// Runs one command; `Ok` carries the exit code (0, or a remote command's for exec).
pub async fn run(cli: Cli) -> Result<u8, CliError> {
    let flags = cli.flags()?;
    let target = || flags.target();
    match cli.command {
        Command::Workspace(cmd) => run_workspace(&target()?, cmd).await,
        Command::Sandbox(cmd) => run_sandbox(&target()?, cmd).await,
        Command::Provider(cmd) => super::owned::run_provider(&target()?, cmd).await,
        Command::Setting(cmd) => super::owned::run_setting(&target()?, cmd).await,
        Command::Service(cmd) => super::owned::run_service(&target()?, cmd).await,
        Command::Image(cmd) => super::image::run_image(&target()?, cmd).await,
        Command::Identity(cmd) => super::identity::run_identity(&target()?, cmd).await,
        Command::Node(cmd) => super::node::run_node(&target()?, cmd).await,
        Command::Events(args) => super::events::run_events(&target()?, args).await,
        Command::Wait(args) => run_wait(&target()?, &args).await,
        Command::Run(args) => super::job::run_job(&target()?, &args).await,
        Command::Version(args) => super::meta::run_version(&target()?, &args).await,
        Command::Config(cmd) => super::config::run_config(&flags, &cmd),
        Command::Completion(args) => super::meta::run_completion(&args),
    }
}

async fn run_workspace(target: &Target, cmd: WorkspaceCommand) -> Result<u8, CliError> {
    match cmd {
        WorkspaceCommand::Create(args) => {
            let req = request::create_workspace_request(&args)?;
            let mut client = WorkspaceServiceClient::new(connect(target).await?);
            let workspace = client.create_workspace(req).await?.into_inner();
            print(&render_workspace(
                &args.output,
                &workspace,
                SystemTime::now(),
            )?)?;
        }
        WorkspaceCommand::Network(cmd) => {
            return super::network::run_workspace_network(target, cmd).await;
        }
        WorkspaceCommand::Limits(cmd) => {
            return super::limits::run_workspace_limits(target, cmd).await;
        }
        WorkspaceCommand::Lifetime(cmd) => {
            return super::lifetime::run_workspace_lifetime(target, cmd).await;
        }
        WorkspaceCommand::Get(args) => {
            let req = GetWorkspaceRequest {
                workspace: Some(request::workspace_ref(&args.target)),
            };
            let mut client = WorkspaceServiceClient::new(connect(target).await?);
            let workspace = client.get_workspace(req).await?.into_inner();
            print(&render_workspace(
                &args.output,
                &workspace,
                SystemTime::now(),
            )?)?;
        }
        WorkspaceCommand::List(args) => {
            let client = WorkspaceServiceClient::new(connect(target).await?);
            let workspaces = collect_pages(|token| {
                let mut client = client.clone();
                let req = request::list_workspaces_request(&args, &token);
                async move {
                    let page = client.list_workspaces(req).await?.into_inner();
                    Ok((page.workspaces, page.next_page_token))
                }
            })
            .await?;
            let rendered = render_workspaces(&args.output, &workspaces, SystemTime::now())?;
            print_list(&rendered, "No workspaces found.")?;
        }
        WorkspaceCommand::Delete(args) => {
            let req = request::delete_workspace_request(&args);
            let what = req
                .workspace
                .as_ref()
                .map(describe_workspace_ref)
                .unwrap_or_default();
            let mut client = WorkspaceServiceClient::new(connect(target).await?);
            // Looked up first so that -o json|yaml|name can say what was deleted.
            let found = found_or_absent(
                client
                    .get_workspace(GetWorkspaceRequest {
                        workspace: req.workspace.clone(),
                    })
                    .await,
            )?;
            let deleted = client.delete_workspace(req).await?.into_inner().deleted;
            let found = found.map(|w| (w.id, w.name));
            print_deleted(&args.output, deleted, found, &what, "workspace")?;
        }
    }
    Ok(0)
}

async fn run_sandbox(target: &Target, cmd: SandboxCommand) -> Result<u8, CliError> {
    match cmd {
        SandboxCommand::Create(args) => create_sandbox(target, &args).await,
        SandboxCommand::Get(args) => get_sandbox(target, &args).await,
        SandboxCommand::Stop(args) => lifecycle(target, &args, Lifecycle::Stop).await,
        SandboxCommand::Start(args) => lifecycle(target, &args, Lifecycle::Start).await,
        SandboxCommand::Restart(args) => lifecycle(target, &args, Lifecycle::Restart).await,
        SandboxCommand::Pause(args) => lifecycle(target, &args, Lifecycle::Pause).await,
        SandboxCommand::Resume(args) => lifecycle(target, &args, Lifecycle::Resume).await,
        SandboxCommand::Ttl(args) => super::lifetime::run_sandbox_ttl(target, args).await,
        SandboxCommand::Delete(args) => {
            let reference = sandbox_ref(&args.scope, &args.target);
            let what = describe_sandbox_ref(&reference);
            let mut client = SandboxServiceClient::new(connect(target).await?);
            // Looked up first so that -o json|yaml|name can say what was deleted.
            let found = found_or_absent(
                client
                    .get_sandbox(GetSandboxRequest {
                        sandbox: Some(reference.clone()),
                    })
                    .await,
            )?;
            let req = DeleteSandboxRequest {
                sandbox: Some(reference),
            };
            let deleted = client.delete_sandbox(req).await?.into_inner().deleted;
            let found = found.map(|s| (s.id, s.name));
            print_deleted(&args.output, deleted, found, &what, "sandbox")?;
            Ok(0)
        }
        SandboxCommand::List(args) => {
            let client = SandboxServiceClient::new(connect(target).await?);
            let sandboxes = collect_pages(|token| {
                let mut client = client.clone();
                let req = request::list_sandboxes_request(&args, &token);
                async move {
                    let page = client.list_sandboxes(req).await?.into_inner();
                    Ok((page.sandboxes, page.next_page_token))
                }
            })
            .await?;
            let rendered = render_sandboxes(&args.output, &sandboxes, SystemTime::now())?;
            let note = if args.all_workspaces {
                "No sandboxes found in any workspace.".to_string()
            } else {
                format!(
                    "No sandboxes found in workspace {:?}.",
                    sbx_proto::names::workspace_or_default(
                        args.workspace.as_deref().unwrap_or_default()
                    )
                )
            };
            print_list(&rendered, &note)?;
            Ok(0)
        }
        SandboxCommand::Exec(args) => {
            // -t needs a terminal to take the size and keystrokes from.
            if args.tty && !super::terminal::stdin_is_terminal() {
                return Err(CliError::NotATerminal);
            }
            let tty = args
                .tty
                .then(|| super::terminal::tty_request(std::env::var("TERM").ok()));
            let req = request::exec_request(&args, tty)?;
            let mut client = SandboxServiceClient::new(connect(target).await?);
            stream::exec(&mut client, req).await
        }
        SandboxCommand::Cp(args) => {
            let mut client = SandboxServiceClient::new(connect(target).await?);
            let modes = if args.preserve {
                sbx_archive::Modes::Preserve
            } else {
                sbx_archive::Modes::Umask
            };
            super::files::copy(&mut client, args.workspace, args.src, args.dst, modes).await
        }
        SandboxCommand::PortForward(args) => {
            let client = SandboxServiceClient::new(connect(target).await?);
            let sandbox = sbx_proto::v1::SandboxRef {
                id: String::new(),
                workspace: args.workspace.unwrap_or_default(),
                name: args.name,
            };
            super::forward::run(client, sandbox, args.ports).await
        }
        SandboxCommand::Logs(args) => {
            let req = request::logs_request(&args);
            let mut client = SandboxServiceClient::new(connect(target).await?);
            stream::logs(&mut client, req).await
        }
        SandboxCommand::Provider(cmd) => super::owned::run_sandbox_provider(target, cmd).await,
        SandboxCommand::Network(cmd) => super::network::run_sandbox_network(target, cmd).await,
        SandboxCommand::Stats(args) => super::stats::run_sandbox_stats(target, args).await,
        SandboxCommand::Events(args) => super::events::run_sandbox_events(target, args).await,
        SandboxCommand::Watch(args) => {
            let req = request::watch_request(&args);
            let mut client = SandboxServiceClient::new(connect(target).await?);
            stream::watch(&mut client, req, (&args.output).into()).await
        }
    }
}

async fn get_sandbox(target: &Target, args: &SandboxTargetArgs) -> Result<u8, CliError> {
    let sandbox = Some(sandbox_ref(&args.scope, &args.target));
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let answer = client
        .get_sandbox(GetSandboxRequest {
            sandbox: sandbox.clone(),
        })
        .await?
        .into_inner();
    let mut text = render_sandbox(&args.output, &answer, SystemTime::now())?;
    // The table also says what the sandbox's network refused lately (JSON and YAML keep the
    // sandbox as the API gives it; `sbx sandbox network get` has the whole view).
    let networked = answer
        .spec
        .as_ref()
        .and_then(|s| s.network.as_ref())
        .is_some_and(|n| n.mode() == sbx_proto::v1::NetworkMode::Policy);
    if networked && matches!(args.output.format, OutputFormat::Table | OutputFormat::Wide) {
        let network = client
            .get_sandbox_network(sbx_proto::v1::GetSandboxNetworkRequest { sandbox })
            .await;
        text.push_str(&super::network::summary(network.map(|r| r.into_inner())));
    }
    print(&text)?;
    Ok(0)
}

/// The calls that change what a sandbox should be doing, and then wait for it.
#[derive(Debug, Clone, Copy)]
enum Lifecycle {
    Stop,
    Start,
    Restart,
    Pause,
    Resume,
}

impl Lifecycle {
    /// What to wait for after the call; `None`: its answer is the end (pause and resume answer
    /// once Paused, once Ready).
    fn goal(self) -> Option<Goal> {
        match self {
            Lifecycle::Stop => Some(Goal::Stopped),
            Lifecycle::Start | Lifecycle::Restart => Some(Goal::Ready),
            Lifecycle::Pause | Lifecycle::Resume => None,
        }
    }
}

async fn lifecycle(
    gateway: &Target,
    args: &SandboxActionArgs,
    call: Lifecycle,
) -> Result<u8, CliError> {
    let target = &args.target;
    let sandbox = Some(sandbox_ref(&target.scope, &target.target));
    let mut client = SandboxServiceClient::new(connect(gateway).await?);
    let answer = match call {
        Lifecycle::Stop => client.stop_sandbox(StopSandboxRequest { sandbox }).await?,
        Lifecycle::Start => {
            client
                .start_sandbox(StartSandboxRequest { sandbox })
                .await?
        }
        Lifecycle::Restart => {
            client
                .restart_sandbox(RestartSandboxRequest { sandbox })
                .await?
        }
        Lifecycle::Pause => {
            client
                .pause_sandbox(sbx_proto::v1::PauseSandboxRequest { sandbox })
                .await?
        }
        Lifecycle::Resume => {
            client
                .resume_sandbox(sbx_proto::v1::ResumeSandboxRequest { sandbox })
                .await?
        }
    }
    .into_inner();
    let sandbox = if let (false, Some(goal)) = (args.detach, call.goal()) {
        let options = WaitOptions {
            timeout: Duration::from_secs(args.timeout),
            settle: Duration::ZERO,
        };
        present(follow(&client, answer, goal, options).await?)?
    } else {
        answer
    };
    print(&render_sandbox(
        &target.output,
        &sandbox,
        SystemTime::now(),
    )?)?;
    Ok(0)
}

/// Waits for `goal` from `answer` (the gateway's answer to the call that started the wait)
/// on, following the sandbox by id on the watch stream, with progress on stderr; Ctrl-C ends
/// the wait and leaves the sandbox as it is.
async fn follow(
    client: &SandboxServiceClient<Channel>,
    answer: Sandbox,
    goal: Goal,
    options: WaitOptions,
) -> Result<Observation, CliError> {
    follow_with(client, answer, goal, options, progress_for_stderr()).await
}

/// [`follow`] with `progress` instead of stderr's.
pub(crate) async fn follow_with(
    client: &SandboxServiceClient<Channel>,
    answer: Sandbox,
    goal: Goal,
    options: WaitOptions,
    mut progress: Box<dyn super::wait::Progress>,
) -> Result<Observation, CliError> {
    // Followed by id only: the id is the identity; the name could meanwhile mean another
    // sandbox (deleted and re-created by someone else).
    if answer.id.is_empty() {
        return Err(CliError::CreatedWithoutId { name: answer.name });
    }
    let interrupted = CliError::Interrupted {
        name: answer.name.clone(),
        id: answer.id.clone(),
        goal: goal.name(),
    };
    let mut source = WatchSource::new(client.clone(), &answer);
    let waited = tokio::select! {
        waited = wait_for(
            goal,
            Observation::Present(answer),
            &mut source,
            options,
            progress.as_mut(),
        ) => waited,
        // If the handler cannot be installed, wait on without it.
        Ok(()) = tokio::signal::ctrl_c() => Err(interrupted),
    };
    // Clears the spinner however the wait ended (an interrupted wait never reached its own
    // finish call); finishing twice is harmless.
    progress.finish();
    waited
}

/// The sandbox a finished wait for Ready or Stopped saw (such a wait fails when it is gone).
fn present(observation: Observation) -> Result<Sandbox, CliError> {
    match observation {
        Observation::Present(sandbox) => Ok(sandbox),
        Observation::Gone { name, id } => Err(CliError::SandboxGone {
            name,
            id,
            goal: "Ready",
        }),
    }
}

async fn create_sandbox(target: &Target, args: &SandboxCreateArgs) -> Result<u8, CliError> {
    let generated = request::generate_sandbox_name(&mut rand::rng());
    let req = request::create_sandbox_request(args, generated)?;
    if !args.uploads.is_empty() {
        check_uploads(target, args).await?;
    }
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let created = super::image::create_pulling(target, &mut client, req, args.pull).await?;
    let options = WaitOptions {
        timeout: Duration::from_secs(args.timeout),
        settle: Duration::from_millis(args.settle),
    };
    let sandbox = if args.uploads.is_empty() {
        if args.detach {
            created
        } else {
            let goal = if args.stopped {
                Goal::Stopped
            } else {
                Goal::Ready
            };
            present(follow(&client, created, goal, options).await?)?
        }
    } else {
        // Made (Stopped) first, then filled, then started.
        let made = present(follow(&client, created, Goal::Stopped, options).await?)?;
        let this = SandboxRef {
            id: made.id.clone(),
            workspace: String::new(),
            name: String::new(),
        };
        for upload in &args.uploads {
            let copied = files::upload(
                &mut client,
                this.clone(),
                &upload.local,
                upload.dest.clone(),
            )
            .await;
            if let Err(e) = copied {
                eprintln!(
                    "sbx: uploading {} to {}:{} failed; sandbox {:?} (id {}) was created and \
                     left Stopped: copy again with `sbx sandbox cp` and start it, or delete it",
                    upload.local.display(),
                    made.name,
                    upload.dest,
                    made.name,
                    made.id
                );
                return Err(e);
            }
        }
        if args.stopped {
            made
        } else {
            let started = client
                .start_sandbox(StartSandboxRequest {
                    sandbox: Some(this),
                })
                .await?
                .into_inner();
            if args.detach {
                started
            } else {
                present(follow(&client, started, Goal::Ready, options).await?)?
            }
        }
    };
    print(&render_sandbox(&args.output, &sandbox, SystemTime::now())?)?;
    Ok(0)
}

/// Before anything is created: every `--upload`'s local path exists, and the sandbox's
/// driver can copy into a sandbox that has not started.
async fn check_uploads(target: &Target, args: &SandboxCreateArgs) -> Result<(), CliError> {
    for upload in &args.uploads {
        std::fs::symlink_metadata(&upload.local).map_err(|e| CliError::LocalPath {
            path: upload.local.clone(),
            source: e,
        })?;
        if !upload.dest.starts_with('/') {
            return Err(CliError::Usage(format!(
                "--upload {}:{}: the destination must be an absolute path in the sandbox",
                upload.local.display(),
                upload.dest
            )));
        }
    }
    // An older gateway that cannot say is left to answer the copy itself.
    let Ok(info) = super::meta::gateway_info(target).await else {
        return Ok(());
    };
    let driver = args.driver.clone().unwrap_or(info.default_driver);
    match info.drivers.iter().find(|d| d.name == driver) {
        Some(d) if d.error.is_empty() && !d.copy_when_stopped => Err(CliError::Usage(format!(
            "--upload: driver {driver:?} cannot copy files into a sandbox before it starts; \
             create the sandbox, then copy with `sbx sandbox cp` once it is Ready"
        ))),
        _ => Ok(()),
    }
}

/// `sbx wait`: for the gateway to serve, or for a sandbox to reach a state.
async fn run_wait(target: &Target, args: &WaitArgs) -> Result<u8, CliError> {
    let timeout = Duration::from_secs(args.timeout);
    let named = args.name.is_some() || args.id.is_some();
    let goal = match args.condition {
        WaitCondition::Serving => {
            if named || args.workspace.is_some() {
                return Err(CliError::WaitUsage(
                    "--for serving waits for the gateway; it takes no sandbox".to_string(),
                ));
            }
            let serving = wait_serving(target, args.addr_file.as_deref(), timeout).await?;
            print(&format!("{serving}\n"))?;
            return Ok(0);
        }
        WaitCondition::Ready => Goal::Ready,
        WaitCondition::Stopped => Goal::Ended,
        WaitCondition::Completed => Goal::Completed,
        WaitCondition::Deleted => Goal::Deleted,
    };
    if !named {
        return Err(CliError::WaitUsage(format!(
            "--for {} needs the sandbox: NAME (with -w WORKSPACE) or --id UUID",
            goal.name().to_lowercase()
        )));
    }
    if args.addr_file.is_some() {
        return Err(CliError::WaitUsage(
            "--addr-file goes with --for serving only".to_string(),
        ));
    }
    let reference = match &args.id {
        Some(id) => sbx_proto::v1::SandboxRef {
            id: id.to_string(),
            workspace: String::new(),
            name: String::new(),
        },
        None => sbx_proto::v1::SandboxRef {
            id: String::new(),
            workspace: args.workspace.clone().unwrap_or_default(),
            name: args.name.clone().unwrap_or_default(),
        },
    };
    let mut client = SandboxServiceClient::new(connect(target).await?);
    let found = client
        .get_sandbox(GetSandboxRequest {
            sandbox: Some(reference),
        })
        .await;
    let sandbox = match found {
        Ok(answer) => answer.into_inner(),
        // Already gone is what --for deleted waits for.
        Err(status) if status.code() == tonic::Code::NotFound && goal == Goal::Deleted => {
            return Ok(0);
        }
        Err(status) => return Err(status.into()),
    };
    let options = WaitOptions {
        timeout,
        settle: Duration::from_millis(args.settle),
    };
    match follow(&client, sandbox, goal, options).await? {
        Observation::Present(sandbox) => {
            print(&render_sandbox(&args.output, &sandbox, SystemTime::now())?)?
        }
        Observation::Gone { .. } => {}
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use super::*;

    /// Serves `pages` as (items, next token) and records the tokens asked for.
    async fn paginate(pages: Vec<(Vec<u32>, &str)>) -> (Result<Vec<u32>, CliError>, Vec<String>) {
        let mut pages: VecDeque<_> = pages.into();
        let mut asked = Vec::new();
        let result = collect_pages(|token| {
            asked.push(token);
            let page = pages.pop_front();
            async move {
                match page {
                    Some((items, next)) => Ok((items, next.to_string())),
                    None => Err(tonic::Status::internal("asked past the last page")),
                }
            }
        })
        .await;
        (result, asked)
    }

    #[tokio::test]
    async fn pages_are_followed_to_the_end() {
        let (result, asked) =
            paginate(vec![(vec![1, 2], "t1"), (vec![3], "t2"), (vec![], "")]).await;
        assert_eq!(result.unwrap(), [1, 2, 3]);
        assert_eq!(asked, ["", "t1", "t2"]);
    }

    #[tokio::test]
    async fn a_repeated_page_token_stops_the_listing() {
        let (result, asked) = paginate(vec![(vec![1], "t1"), (vec![2], "t1")]).await;
        assert!(
            matches!(&result, Err(CliError::PageTokenRepeated { token }) if token == "t1"),
            "{result:?}"
        );
        assert_eq!(asked.len(), 2);
    }

    #[tokio::test]
    async fn an_unreachable_gateway_is_named_with_its_cause() {
        // Bind and drop a listener: the port is then (almost certainly) closed.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let target = Target::plain(&format!("127.0.0.1:{port}")).unwrap();
        let err = connect(&target).await.unwrap_err();
        let text = err.to_string();
        let prefix = format!("cannot reach sbxd at http://127.0.0.1:{port}: ");
        assert!(text.starts_with(&prefix), "{text}");
        assert!(text.len() > prefix.len(), "no cause in {text:?}");
    }

    #[test]
    fn outcomes() {
        assert_eq!(outcome(Ok(0)), (0, None));
        assert_eq!(outcome(Ok(42)), (42, None));
        let pipe = std::io::Error::from(std::io::ErrorKind::BrokenPipe);
        assert_eq!(outcome(Err(CliError::Io(pipe))), (BROKEN_PIPE_EXIT, None));
        let interrupted = CliError::Interrupted {
            name: "web".into(),
            id: "id-1".into(),
            goal: "Ready",
        };
        let (code, message) = outcome(Err(interrupted));
        assert_eq!(code, 130);
        assert!(message.unwrap().contains("--id id-1"));
        assert_eq!(
            outcome(Err(CliError::Rpc(tonic::Status::not_found(
                "no such sandbox"
            )))),
            (1, Some("error: no such sandbox".to_string()))
        );
    }

    #[test]
    fn a_command_against_no_gateway_fails_with_one_line() {
        use clap::Parser;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let cli = Cli::try_parse_from(["sbx", "--endpoint", &endpoint, "sandbox", "list"]).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (code, message) = outcome(runtime.block_on(run(cli)));
        assert_eq!(code, 1);
        let message = message.unwrap();
        assert!(
            message.starts_with(&format!("error: cannot reach sbxd at {endpoint}: ")),
            "{message}"
        );
        assert!(!message.contains('\n'), "{message:?}");
    }

    #[tokio::test]
    async fn a_malformed_endpoint_is_refused() {
        let err = connect(&Target::plain("http://bad host:1").unwrap())
            .await
            .unwrap_err();
        assert!(matches!(err, CliError::InvalidEndpoint { .. }), "{err:?}");
    }
}
