//! `sbx image …`: pull with per-layer progress on stderr, import of a file or an OCI layout
//! directory, list, get, delete.
//!
//! Progress: on a terminal, one indicatif bar per layer (bytes done of total); otherwise
//! plain lines, one when the manifest is resolved and one per layer when it is fetched,
//! found cached or unpacked, so a log stays short. An import streams the file in
//! [`CHUNK`]-byte messages (a directory is first tarred into a temp file, which is removed
//! afterwards).

use std::collections::HashMap;
use std::io::{IsTerminal, Read};
use std::path::Path;
use std::time::SystemTime;

use sbx_proto::v1::image_service_client::ImageServiceClient;
use sbx_proto::v1::{
    BuildImageInput, BuildImageStart, DeleteImageRequest, GetImageRequest, ImportImageHeader,
    ImportImageRequest, ListImagesRequest, PullProgress, build_image_input, build_image_output,
    import_image_request, pull_image_response, pull_progress,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::connect::Target;
use super::connect::connect;
use super::output::{human_bytes, render_image, render_images, short_digest};
use super::reply::{found_or_absent, print, print_deleted, print_list};
use super::request::{self, describe_image_ref, image_ref};
use super::{CliError, ImageBuildArgs, ImageCommand, ImageImportArgs, ImagePullArgs, PullPolicy};
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{CreateSandboxRequest, Image, PullImageRequest, Sandbox};
use tonic_types::StatusExt;

/// Bytes per import message (the gateway accepts messages up to 8 MiB).
pub const CHUNK: usize = 1 << 20;

pub async fn run_image(target: &Target, cmd: ImageCommand) -> Result<u8, CliError> {
    match cmd {
        ImageCommand::Pull(args) => pull(target, &args).await?,
        ImageCommand::Import(args) => import(target, &args).await?,
        ImageCommand::Build(args) => build(target, &args).await?,
        ImageCommand::List(args) => {
            let client = ImageServiceClient::new(connect(target).await?);
            let images = super::reply::collect_pages(|token| {
                let mut client = client.clone();
                async move {
                    let page = client
                        .list_images(ListImagesRequest {
                            page_size: 0,
                            page_token: token,
                        })
                        .await?
                        .into_inner();
                    Ok((page.images, page.next_page_token))
                }
            })
            .await?;
            let rendered = render_images(&args.output, &images, SystemTime::now())?;
            print_list(&rendered, "No images found.")?;
        }
        ImageCommand::Get(args) => {
            let mut client = ImageServiceClient::new(connect(target).await?);
            let image = client
                .get_image(GetImageRequest {
                    image: Some(image_ref(&args.target)),
                })
                .await?
                .into_inner();
            print(&render_image(&args.output, &image, SystemTime::now())?)?;
        }
        ImageCommand::Delete(args) => {
            let reference = image_ref(&args.target);
            let what = describe_image_ref(&reference);
            let mut client = ImageServiceClient::new(connect(target).await?);
            // Looked up first so that -o json|yaml|name can say what was deleted.
            let found = found_or_absent(
                client
                    .get_image(GetImageRequest {
                        image: Some(reference.clone()),
                    })
                    .await,
            )?;
            let deleted = client
                .delete_image(DeleteImageRequest {
                    image: Some(reference),
                })
                .await?
                .into_inner()
                .deleted;
            let found = found.map(|i| {
                let name = if i.name.is_empty() { i.digest } else { i.name };
                (i.id, name)
            });
            print_deleted(&args.output, deleted, found, &what, "image")?;
        }
    }
    Ok(0)
}

/// A create that pulls its image as `policy` says: `always` before it; `missing` when the
/// gateway answers IMAGE_NOT_FOUND, then once more. Pull progress goes to stderr.
pub async fn create_pulling(
    target: &Target,
    client: &mut SandboxServiceClient<super::connect::Channel>,
    req: CreateSandboxRequest,
    policy: PullPolicy,
) -> Result<Sandbox, CliError> {
    let image = req
        .spec
        .as_ref()
        .map(|s| s.image.clone())
        .filter(|i| !i.is_empty() && !sbx_proto::image_ref::is_digest(i));
    if let (PullPolicy::Always, Some(image)) = (policy, &image) {
        pull_for_create(target, image).await?;
    }
    match client.create_sandbox(req.clone()).await {
        Ok(created) => Ok(created.into_inner()),
        Err(status)
            if policy == PullPolicy::Missing
                && image.is_some()
                && status
                    .get_details_error_info()
                    .is_some_and(|i| i.reason == "IMAGE_NOT_FOUND") =>
        {
            let image = image.unwrap_or_default();
            eprintln!(
                "image {image} is not in the gateway's store: pulling it (--pull never would not)"
            );
            pull_for_create(target, &image).await?;
            Ok(client.create_sandbox(req).await?.into_inner())
        }
        Err(status) => Err(status.into()),
    }
}

/// The pull a create asks for, with the same progress as `sbx image pull` (on stderr).
async fn pull_for_create(target: &Target, reference: &str) -> Result<(), CliError> {
    let req = PullImageRequest {
        reference: reference.to_string(),
        ..Default::default()
    };
    let image = pulled(target, req).await?;
    eprintln!("pulled {} ({})", image.name, short_digest(&image.digest));
    Ok(())
}

/// A pull, its progress shown on stderr as it comes; the image it ends with.
async fn pulled(target: &Target, req: PullImageRequest) -> Result<Image, CliError> {
    let reference = req.reference.clone();
    let mut client = ImageServiceClient::new(connect(target).await?);
    let mut stream = client.pull_image(req).await?.into_inner();
    let mut shown = Progress::for_stderr();
    while let Some(msg) = stream.message().await? {
        match msg.message {
            Some(pull_image_response::Message::Progress(p)) => shown.show(&p),
            Some(pull_image_response::Message::Image(image)) => {
                shown.finish();
                return Ok(image);
            }
            None => {}
        }
    }
    shown.finish();
    Err(CliError::PullWithoutImage { reference })
}

async fn pull(target: &Target, args: &ImagePullArgs) -> Result<(), CliError> {
    let password = if args.password_stdin {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        Some(line.trim_end_matches(['\r', '\n']).to_string())
    } else {
        None
    };
    let req = request::pull_image_request(args, password);
    let image = pulled(target, req).await?;
    print(&render_image(&args.output, &image, SystemTime::now())?)
}

/// One plain progress line for an event, or `None` for byte counts that are not the end of a
/// layer (they would flood a log).
pub fn progress_line(p: &PullProgress) -> Option<String> {
    use pull_progress::Event;
    match p.event.as_ref()? {
        Event::Resolved(r) => Some(format!(
            "resolved {}: {} layer(s), {}",
            r.digest,
            r.layers,
            human_bytes(r.total_bytes)
        )),
        Event::Layer(l) if l.done >= l.total => Some(format!(
            "layer {}: fetched {}",
            short_digest(&l.digest),
            human_bytes(l.total)
        )),
        Event::Layer(_) => None,
        Event::Cached(l) => Some(format!(
            "layer {}: already present ({})",
            short_digest(&l.digest),
            human_bytes(l.size)
        )),
        Event::Unpacked(l) => Some(format!("layer {}: unpacked", short_digest(&l.digest))),
    }
}

/// How pull progress reaches stderr: bars on a terminal, lines elsewhere.
enum Progress {
    Bars {
        multi: indicatif::MultiProgress,
        bars: HashMap<String, indicatif::ProgressBar>,
    },
    Lines,
}

impl Progress {
    fn for_stderr() -> Progress {
        if std::io::stderr().is_terminal() {
            Progress::Bars {
                multi: indicatif::MultiProgress::new(),
                bars: HashMap::new(),
            }
        } else {
            Progress::Lines
        }
    }

    fn show(&mut self, p: &PullProgress) {
        use pull_progress::Event;
        match self {
            Progress::Lines => {
                if let Some(line) = progress_line(p) {
                    eprintln!("{line}");
                }
            }
            Progress::Bars { multi, bars } => {
                let (digest, done, total, message) = match p.event.as_ref() {
                    Some(Event::Layer(l)) => (&l.digest, l.done, l.total, None),
                    Some(Event::Cached(l)) => (&l.digest, l.size, l.size, Some("cached")),
                    Some(Event::Unpacked(l)) => (&l.digest, 0, 0, Some("unpacked")),
                    Some(Event::Resolved(_)) | None => {
                        if let Some(line) = progress_line(p) {
                            let _ = multi.println(line);
                        }
                        return;
                    }
                };
                let bar = bars.entry(digest.clone()).or_insert_with(|| {
                    let bar = multi.add(indicatif::ProgressBar::new(total));
                    if let Ok(style) = indicatif::ProgressStyle::with_template(
                        "{prefix} [{bar:30}] {bytes}/{total_bytes} {msg}",
                    ) {
                        bar.set_style(style);
                    }
                    bar.set_prefix(short_digest(digest));
                    bar
                });
                if total > 0 {
                    bar.set_length(total);
                    bar.set_position(done);
                }
                if let Some(message) = message {
                    bar.set_message(message);
                }
            }
        }
    }

    fn finish(&mut self) {
        if let Progress::Bars { bars, .. } = self {
            for bar in bars.values() {
                bar.finish();
            }
        }
    }
}

async fn import(target: &Target, args: &ImageImportArgs) -> Result<(), CliError> {
    let shown = args.path.display().to_string();
    let source_error = |cause: String| CliError::ImportSource {
        path: shown.clone(),
        cause,
    };
    let meta = std::fs::metadata(&args.path).map_err(|e| source_error(e.to_string()))?;
    // A directory (an OCI layout) is tarred into a temp file that lives until the upload ends.
    let tarred = if meta.is_dir() {
        Some(tar_directory(&args.path).map_err(|e| source_error(format!("tarring it: {e}")))?)
    } else {
        None
    };
    let file_path = tarred
        .as_ref()
        .map(|t| t.path().to_path_buf())
        .unwrap_or_else(|| args.path.clone());
    let file = std::fs::File::open(&file_path).map_err(|e| source_error(e.to_string()))?;
    let (tx, rx) = mpsc::channel(4);
    let header = ImportImageRequest {
        part: Some(import_image_request::Part::Header(ImportImageHeader {
            name: args.name.clone().unwrap_or_default(),
        })),
    };
    tx.send(header)
        .await
        .map_err(|_| source_error("the upload ended early".into()))?;
    let reader = send_chunks(file, tx, |chunk| ImportImageRequest {
        part: Some(import_image_request::Part::Chunk(chunk)),
    });
    let mut client = ImageServiceClient::new(connect(target).await?);
    let answer = client.import_image(ReceiverStream::new(rx)).await;
    let read = reader
        .await
        .map_err(|e| source_error(format!("reader task: {e}")))?;
    let images = answer?.into_inner().images;
    read.map_err(|e| source_error(e.to_string()))?;
    drop(tarred);
    let rendered = render_images(&args.output, &images, SystemTime::now())?;
    print_list(&rendered, "No images imported.")
}

/// Sends `file` as [`CHUNK`]-byte messages made by `message`, from a blocking task; ends
/// quietly when the call has ended (the gateway refused: its status says why).
fn send_chunks<M: Send + 'static>(
    mut file: std::fs::File,
    tx: mpsc::Sender<M>,
    message: impl Fn(Vec<u8>) -> M + Send + 'static,
) -> tokio::task::JoinHandle<std::io::Result<()>> {
    tokio::task::spawn_blocking(move || {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = file.read(&mut buf)?;
            if n == 0 {
                return Ok(());
            }
            if tx.blocking_send(message(buf[..n].to_vec())).is_err() {
                return Ok(());
            }
        }
    })
}

/// `sbx image build`: the context tarred into a temp file and streamed after the start;
/// steps and RUN output on stderr as they come, the image on stdout.
async fn build(target: &Target, args: &ImageBuildArgs) -> Result<(), CliError> {
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

/// Tars `dir`'s contents (paths relative to it, symlinks kept as links) into a temp file.
pub fn tar_directory(dir: &Path) -> std::io::Result<tempfile::NamedTempFile> {
    let file = tempfile::NamedTempFile::new()?;
    let mut builder = tar::Builder::new(file.reopen()?);
    builder.follow_symlinks(false);
    // Entry by entry, so that the names are `index.json`, `blobs/…` (no `./` prefix).
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        if entry.file_type()?.is_dir() {
            builder.append_dir_all(&name, entry.path())?;
        } else {
            builder.append_path_with_name(entry.path(), &name)?;
        }
    }
    builder.into_inner()?.sync_all()?;
    Ok(file)
}
