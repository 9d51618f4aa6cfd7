//! `sbx image build`: a Dockerfile and its context, each RUN in a sandbox of the gateway's.

use std::time::SystemTime;

use clap::Args;
use sbx_proto::v1::image_service_client::ImageServiceClient;
use sbx_proto::v1::{BuildImageInput, BuildImageStart, build_image_input, build_image_output};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::import::{send_chunks, tar_directory};
use super::{parse_image_reference, render_image};
use crate::CliError;
use crate::args::{parse_key_value, parse_name};
use crate::connect::{Target, connect};
use crate::output::OutputArgs;
use crate::reply::print;
use crate::size;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Examples:
  sbx image build -t app:v1 .                       ./Dockerfile, the current directory as context
  sbx image build -t app:v1 -f ci/Dockerfile src    another Dockerfile, src/ as context
  sbx image build -t tools --allow deb.debian.org:80 .   RUN may reach that host (port 80)

Supported: FROM (an image of the store, pulled when missing, or scratch), RUN, COPY and ADD from
the context (numeric --chown, --chmod), ENV, ARG, WORKDIR, USER, ENTRYPOINT, CMD, LABEL, EXPOSE,
SHELL. Refused with the line named: multi-stage builds, ADD of a URL or an archive, RUN flags,
HEALTHCHECK, ONBUILD, STOPSIGNAL, VOLUME.

Each RUN runs in a sandbox of the workspace, from the build's state so far, and is deleted
after. Each step's result is kept as the image sbx.local/build-cache:KEY; a step whose inputs
did not change is not run again (--no-cache runs every step). Step lines and RUN output go to
stderr; the image is printed on stdout.")]
pub struct ImageBuildArgs {
    /// The build context: the directory whose files COPY and ADD name (sent to the gateway
    /// as a tar; .dockerignore is not read).
    #[arg(value_name = "CONTEXT", id = "build_context")]
    pub context: std::path::PathBuf,
    /// The result's name, NAME[:TAG] (default: none; the image is shown by digest).
    #[arg(short = 't', long = "tag", value_name = "NAME[:TAG]", value_parser = parse_image_reference)]
    pub tag: Option<String>,
    /// The Dockerfile (default: CONTEXT/Dockerfile).
    #[arg(short = 'f', long = "file", value_name = "PATH")]
    pub file: Option<std::path::PathBuf>,
    /// A value for an ARG the Dockerfile declares, NAME=VALUE; repeatable.
    #[arg(long = "build-arg", value_name = "NAME=VALUE", value_parser = parse_key_value)]
    pub build_args: Vec<(String, String)>,
    /// What every RUN may reach, as `sbx sandbox create --allow` takes it; repeatable.
    /// Without it a RUN has loopback only.
    #[arg(long = "allow", value_name = "ENTRY")]
    pub allow: Vec<String>,
    /// Run every step, whatever the cache holds.
    #[arg(long)]
    pub no_cache: bool,
    /// The workspace RUN steps run in, whose image the result is and whose cache the steps
    /// use (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// Make the result the gateway's, run by every workspace (a gateway-wide admin only);
    /// the cache steps stay the workspace's.
    #[arg(long)]
    pub publish: bool,
    /// The driver RUN steps run on (default: the gateway's; it must keep a sandbox's changes,
    /// as oci does).
    #[arg(long, value_name = "DRIVER")]
    pub driver: Option<String>,
    /// The longest one RUN may take: 90s, 10m, 1h (default 30m).
    #[arg(long, value_name = "DURATION", value_parser = size::parse_lifetime)]
    pub run_timeout: Option<u64>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// `sbx image build`: the context tarred into a temp file and streamed after the start;
/// steps and RUN output on stderr as they come, the image on stdout.
pub(super) async fn build(target: &Target, args: &ImageBuildArgs) -> Result<(), CliError> {
    use build_image_input::Input;
    use build_image_output::Output;
    let shown = args.context.display().to_string();
    let source_error = |path: &str, cause: String| CliError::ImportSource {
        path: path.to_string(),
        cause,
    };
    if !args.context.is_dir() {
        return Err(source_error(
            &shown,
            "the build context must be a directory".into(),
        ));
    }
    let dockerfile_path = args
        .file
        .clone()
        .unwrap_or_else(|| args.context.join("Dockerfile"));
    let dockerfile = std::fs::read_to_string(&dockerfile_path)
        .map_err(|e| source_error(&dockerfile_path.display().to_string(), e.to_string()))?;
    let tarred = tar_directory(&args.context)
        .map_err(|e| source_error(&shown, format!("tarring it: {e}")))?;
    let file =
        std::fs::File::open(tarred.path()).map_err(|e| source_error(&shown, e.to_string()))?;
    let (tx, rx) = mpsc::channel(4);
    let start = BuildImageInput {
        input: Some(Input::Start(BuildImageStart {
            workspace: args.workspace.clone().unwrap_or_default(),
            name: args.tag.clone().unwrap_or_default(),
            dockerfile,
            build_args: args.build_args.iter().cloned().collect(),
            allow: args.allow.clone(),
            no_cache: args.no_cache,
            driver: args.driver.clone().unwrap_or_default(),
            run_timeout_seconds: args
                .run_timeout
                .map_or(0, |s| u32::try_from(s).unwrap_or(u32::MAX)),
            publish: args.publish,
        })),
    };
    tx.send(start)
        .await
        .map_err(|_| source_error(&shown, "the upload ended early".into()))?;
    let reader = send_chunks(file, tx, |chunk| BuildImageInput {
        input: Some(Input::Context(chunk)),
    });
    let mut client = ImageServiceClient::new(connect(target).await?);
    let mut stream = client
        .build_image(ReceiverStream::new(rx))
        .await?
        .into_inner();
    let mut stderr = std::io::stderr();
    let mut at_line_start = true;
    while let Some(msg) = stream.message().await? {
        match msg.output {
            Some(Output::Step(step)) => {
                if !at_line_start {
                    eprintln!();
                }
                eprintln!(
                    "step {}/{}: {}{}",
                    step.index,
                    step.count,
                    step.instruction,
                    if step.cached { "  (cached)" } else { "" }
                );
                at_line_start = true;
            }
            Some(Output::Log(log)) => {
                use std::io::Write as _;
                let _ = stderr.write_all(&log.data);
                let _ = stderr.flush();
                at_line_start = log.data.ends_with(b"\n");
            }
            Some(Output::Image(image)) => {
                if !at_line_start {
                    eprintln!();
                }
                let _ = reader.await;
                drop(tarred);
                return print(&render_image(&args.output, &image, SystemTime::now())?);
            }
            None => {}
        }
    }
    Err(CliError::BuildWithoutImage { context: shown })
}
