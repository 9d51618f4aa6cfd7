//! `sbx image pull`, and the pull a create asks for (`--pull`): per-layer progress on stderr.
//!
//! Progress: on a terminal, one indicatif bar per layer (bytes done of total); otherwise
//! plain lines, one when the manifest is resolved and one per layer when it is fetched,
//! found cached or unpacked, so a log stays short.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::time::SystemTime;

use clap::Args;
use sbx_proto::v1::image_service_client::ImageServiceClient;
use sbx_proto::v1::sandbox_service_client::SandboxServiceClient;
use sbx_proto::v1::{
    CreateSandboxRequest, Image, PullImageRequest, PullProgress, Sandbox, pull_image_response,
    pull_progress,
};
use tonic_types::StatusExt;

use super::{parse_image_reference, render_image, short_digest};
use crate::CliError;
use crate::connect::{Channel, Target, connect};
use crate::output::{OutputArgs, human_bytes};
use crate::reply::print;

/// When `sbx sandbox create` and `sbx run` pull their image first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PullPolicy {
    /// Never: a create of an image the store lacks fails (IMAGE_NOT_FOUND).
    Never,
    /// When the gateway answers IMAGE_NOT_FOUND: pulled (progress on stderr), then created.
    #[default]
    Missing,
    /// Before the create, every time (a tag that moved is re-pulled).
    Always,
}

#[derive(Debug, Clone, Args)]
pub struct ImagePullArgs {
    /// What to pull: [registry/]name[:tag][@sha256:…] (default registry docker.io, tag latest).
    #[arg(value_parser = parse_image_reference)]
    pub reference: String,
    /// Plain HTTP to the registry (loopback registries get it anyway).
    #[arg(long)]
    pub insecure: bool,
    /// The registry user (with --password-stdin).
    #[arg(long, value_name = "USER", requires = "password_stdin")]
    pub username: Option<String>,
    /// Read the registry password from stdin (one line).
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
    /// The workspace the image lands in (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = crate::args::parse_name)]
    pub workspace: Option<String>,
    /// Make it the gateway's, run by every workspace (a gateway-wide admin only).
    #[arg(long, conflicts_with = "workspace")]
    pub publish: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// The pull request; `password` is what --password-stdin read (None without it).
pub fn pull_image_request(args: &ImagePullArgs, password: Option<String>) -> PullImageRequest {
    PullImageRequest {
        reference: args.reference.clone(),
        insecure: args.insecure,
        username: args.username.clone().unwrap_or_default(),
        password: password.unwrap_or_default(),
        workspace: args.workspace.clone().unwrap_or_default(),
        publish: args.publish,
    }
}

/// A create that pulls its image as `policy` says: `always` before it; `missing` when the
/// gateway answers IMAGE_NOT_FOUND, then once more. Pull progress goes to stderr.
pub async fn create_pulling(
    target: &Target,
    client: &mut SandboxServiceClient<Channel>,
    req: CreateSandboxRequest,
    policy: PullPolicy,
) -> Result<Sandbox, CliError> {
    let image = req
        .spec
        .as_ref()
        .map(|s| s.image.clone())
        .filter(|i| !i.is_empty() && !sbx_proto::image_ref::is_digest(i));
    // Into the sandbox's workspace: what its create then sees.
    let workspace = req.workspace.clone();
    if let (PullPolicy::Always, Some(image)) = (policy, &image) {
        pull_for_create(target, image, &workspace).await?;
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
            if let Err(e) = pull_for_create(target, &image, &workspace).await {
                // A typo pulls from a registry that has no such image, or none at all: the
                // images the store has that it may have meant say more than the registry.
                let similar = similar_images(target, &image, &workspace).await;
                return Err(CliError::ImageUnavailable {
                    image,
                    cause: e.message(None),
                    similar,
                });
            }
            Ok(client.create_sandbox(req).await?.into_inner())
        }
        Err(status) => Err(status.into()),
    }
}

/// The names of the images `workspace` sees (its own and the gateway's) within two edits of
/// `image`, compared without their tags when `image` has none (`pyhton` → `python:3.12`);
/// none when they cannot be listed.
async fn similar_images(target: &Target, image: &str, workspace: &str) -> Vec<String> {
    let Ok(channel) = connect(target).await else {
        return Vec::new();
    };
    let request = sbx_proto::v1::ListImagesRequest {
        workspace: workspace.to_string(),
        ..Default::default()
    };
    let Ok(listed) = ImageServiceClient::new(channel).list_images(request).await else {
        return Vec::new();
    };
    let names: Vec<String> = listed
        .into_inner()
        .images
        .into_iter()
        .map(|i| i.name)
        .collect();
    // Each name in the short form people type (`python:3.12`, not `docker.io/library/…`).
    let short = |name: &str| {
        name.trim_start_matches("docker.io/")
            .trim_start_matches("library/")
            .to_string()
    };
    let typed = short(image);
    let shorts: Vec<String> = names.iter().map(|n| short(n)).collect();
    let mut similar = sbx_proto::names::similar(&typed, shorts.iter().map(String::as_str));
    if similar.is_empty() && !typed.contains(':') {
        // `pyhton` for `python:3.12`: the repositories compared, the whole names offered.
        let repos: Vec<&str> = shorts
            .iter()
            .map(|n| n.rsplit_once(':').map_or(n.as_str(), |(repo, _)| repo))
            .collect();
        let near = sbx_proto::names::similar(&typed, repos.iter().copied());
        similar = shorts
            .iter()
            .zip(&repos)
            .filter(|(_, repo)| near.iter().any(|n| n == *repo))
            .map(|(name, _)| name.clone())
            .take(3)
            .collect();
    }
    similar
}

/// The pull a create asks for, with the same progress as `sbx image pull` (on stderr).
async fn pull_for_create(
    target: &Target,
    reference: &str,
    workspace: &str,
) -> Result<(), CliError> {
    let req = PullImageRequest {
        reference: reference.to_string(),
        workspace: workspace.to_string(),
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

pub(super) async fn pull(target: &Target, args: &ImagePullArgs) -> Result<(), CliError> {
    let password = if args.password_stdin {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        Some(line.trim_end_matches(['\r', '\n']).to_string())
    } else {
        None
    };
    let req = pull_image_request(args, password);
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
