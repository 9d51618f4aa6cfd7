//! `sbx image …`: the images of the gateway's store. This file: the noun's commands and their
//! targets, list, get and delete, and how an image is shown; `pull.rs` pulls (also for a
//! create whose image is missing), `import.rs` uploads a file or a directory, `build.rs`
//! builds from a Dockerfile, `prune.rs` removes what no sandbox uses.

use std::time::SystemTime;

use clap::{Args, Subcommand};
use sbx_proto::v1::image_service_client::ImageServiceClient;
use sbx_proto::v1::{DeleteImageRequest, GetImageRequest, Image, ImageRef, ListImagesRequest};
use serde::Serialize;
use uuid::Uuid;

use crate::CliError;
use crate::args::parse_name;
use crate::connect::{Target, connect};
use crate::output::{
    OutputArgs, OutputFormat, Style, age, human_bytes, render_list, render_structured,
    render_table, rfc3339,
};
use crate::reply::{collect_pages, found_or_absent, print, print_deleted, print_list};

pub mod build;
pub mod import;
pub mod prune;
pub mod pull;

pub use build::ImageBuildArgs;
pub use import::ImageImportArgs;
pub use prune::ImagePruneArgs;
pub use pull::{ImagePullArgs, PullPolicy, create_pulling};

/// `sbx image …`
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// Pull an image from its registry into a workspace (or, --publish, the gateway's images),
    /// showing the bytes of each layer on stderr.
    Pull(ImagePullArgs),
    /// Import an image from a file (OCI layout tar, docker save tar, rootfs tar) or an OCI
    /// layout directory.
    Import(ImageImportArgs),
    /// List a workspace's images and the gateway's (every page), with what each takes
    /// unpacked.
    #[command(visible_alias = "ls")]
    List(ImageListArgs),
    /// Show one image, by reference (name:tag, name@sha256:…, sha256:…) or by --id.
    Get(ImageTargetArgs),
    /// Delete an image. Refused while a sandbox pins its digest.
    #[command(visible_alias = "rm")]
    Delete(ImageTargetArgs),
    /// Build an image from a Dockerfile, each RUN in a sandbox (no network unless --allow),
    /// each step cached.
    Build(ImageBuildArgs),
    /// Remove the images no sandbox uses (the build cache; --all: every one but the default
    /// image) and say how much that freed.
    Prune(ImagePruneArgs),
}

/// A clap value parser: an image reference by the gateway's rule (`sbx_proto::image_ref`),
/// or a bare `sha256:…` digest.
pub fn parse_image_reference(input: &str) -> Result<String, CliError> {
    if !sbx_proto::image_ref::is_digest(input) {
        sbx_proto::image_ref::parse(input)
            .map_err(|source| CliError::InvalidImageReference { source })?;
    }
    Ok(input.to_string())
}

#[derive(Debug, Clone, Args)]
pub struct ImageListArgs {
    /// The workspace whose images are listed, with the gateway's (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// The images of every workspace you see, and the gateway's.
    #[arg(short = 'A', long, conflicts_with = "workspace")]
    pub all_workspaces: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Names one image: exactly one of REF or `--id`.
#[derive(Debug, Clone, Args)]
#[group(id = "image_target", required = true, multiple = false)]
pub struct ImageTarget {
    /// The image: name[:tag], name@sha256:… or sha256:….
    #[arg(value_parser = parse_image_reference)]
    pub reference: Option<String>,
    /// The image's UUID (authoritative).
    #[arg(long, value_name = "UUID")]
    pub id: Option<Uuid>,
}

#[derive(Debug, Clone, Args)]
pub struct ImageTargetArgs {
    #[command(flatten)]
    pub target: ImageTarget,
    /// The workspace the image is looked up from: its images, then the gateway's (default:
    /// "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// Names an image: by id when `--id` was given, else by reference.
pub fn image_ref(target: &ImageTarget, workspace: Option<&str>) -> ImageRef {
    let workspace = workspace.unwrap_or_default().to_string();
    match target.id {
        Some(id) => ImageRef {
            id: id.to_string(),
            reference: String::new(),
            workspace,
        },
        None => ImageRef {
            id: String::new(),
            reference: target.reference.clone().unwrap_or_default(),
            workspace,
        },
    }
}

/// `image "busybox"` or `image with id …`, for messages.
pub fn describe_image_ref(r: &ImageRef) -> String {
    if r.id.is_empty() {
        format!("image {:?}", r.reference)
    } else {
        format!("image with id {}", r.id)
    }
}

/// What `sbx image get -o json|yaml` prints.
#[derive(Debug, Clone, Serialize)]
pub struct ImageView {
    pub id: String,
    pub name: String,
    /// Its workspace; empty: the gateway's (every workspace runs it).
    pub workspace: String,
    pub digest: String,
    pub size: u64,
    /// What its unpacked layers take on disk (0: not measured).
    pub unpacked_size: u64,
    pub os: String,
    pub architecture: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub env: Vec<String>,
    pub working_dir: String,
    pub user: String,
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub labels: std::collections::BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub exposed_ports: Vec<String>,
    pub layers: Vec<ImageLayerView>,
    pub created_at: Option<String>,
    pub updated_at: Option<String>,
    pub resource_version: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ImageLayerView {
    pub digest: String,
    pub size: u64,
}

pub fn image_view(image: &Image) -> ImageView {
    let config = image.config.clone().unwrap_or_default();
    ImageView {
        id: image.id.clone(),
        name: image.name.clone(),
        workspace: image.workspace.clone(),
        digest: image.digest.clone(),
        size: image.size,
        unpacked_size: image.unpacked_size,
        os: image.os.clone(),
        architecture: image.architecture.clone(),
        entrypoint: config.entrypoint,
        cmd: config.cmd,
        env: config.env,
        working_dir: config.working_dir,
        user: config.user,
        labels: config.labels.into_iter().collect(),
        exposed_ports: config.exposed_ports,
        layers: image
            .layers
            .iter()
            .map(|l| ImageLayerView {
                digest: l.digest.clone(),
                size: l.size,
            })
            .collect(),
        created_at: rfc3339(image.created_at.as_ref()),
        updated_at: rfc3339(image.updated_at.as_ref()),
        resource_version: image.resource_version,
    }
}

/// `sha256:` and the first 12 hex digits, as image tables show a digest.
pub fn short_digest(digest: &str) -> String {
    match digest.strip_prefix("sha256:") {
        Some(hex) => format!("sha256:{}", &hex[..hex.len().min(12)]),
        None => digest.to_string(),
    }
}

pub const IMAGE_COLUMNS: &[&str] = &[
    "WORKSPACE",
    "NAME",
    "DIGEST",
    "SIZE",
    "UNPACKED",
    "ID",
    "AGE",
];

pub fn image_table(images: &[Image], now: SystemTime, style: Style) -> String {
    let rows: Vec<Vec<String>> = images
        .iter()
        .map(|i| {
            vec![
                // The gateway's images (the built-in one, what an admin published) are every
                // workspace's.
                match i.workspace.as_str() {
                    "" => "*".to_string(),
                    w => w.to_string(),
                },
                i.name.clone(),
                short_digest(&i.digest),
                human_bytes(i.size),
                match i.unpacked_size {
                    0 => "-".to_string(),
                    n => human_bytes(n),
                },
                i.id.clone(),
                age(now, i.created_at.as_ref()),
            ]
        })
        .collect();
    render_table(IMAGE_COLUMNS, &rows, style)
}

/// Images: a table (`-o wide` shows the same columns), `image/NAME` lines (the digest for an
/// image without a name), or JSON / YAML.
pub fn render_images(
    style: impl Into<Style>,
    images: &[Image],
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    render_list(
        style,
        images,
        ("image", |i| {
            if i.name.is_empty() {
                &i.digest
            } else {
                &i.name
            }
        }),
        |rows| image_table(rows, now, style),
        image_view,
    )
}

pub fn render_image(
    style: impl Into<Style>,
    image: &Image,
    now: SystemTime,
) -> Result<String, CliError> {
    let style = style.into();
    match style.format {
        OutputFormat::Json | OutputFormat::Yaml => {
            render_structured(style.format, &image_view(image))
        }
        _ => render_images(style, std::slice::from_ref(image), now),
    }
}

pub async fn run_image(target: &Target, cmd: ImageCommand) -> Result<u8, CliError> {
    match cmd {
        ImageCommand::Pull(args) => pull::pull(target, &args).await?,
        ImageCommand::Import(args) => import::import(target, &args).await?,
        ImageCommand::Build(args) => build::build(target, &args).await?,
        ImageCommand::Prune(args) => prune::prune(target, &args).await?,
        ImageCommand::List(args) => {
            let client = ImageServiceClient::new(connect(target).await?);
            let images = collect_pages(|token| {
                let mut client = client.clone();
                let (workspace, all_workspaces) = (
                    args.workspace.clone().unwrap_or_default(),
                    args.all_workspaces,
                );
                async move {
                    let page = client
                        .list_images(ListImagesRequest {
                            page_size: 0,
                            page_token: token,
                            workspace,
                            all_workspaces,
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
                    image: Some(image_ref(&args.target, args.workspace.as_deref())),
                })
                .await?
                .into_inner();
            print(&render_image(&args.output, &image, SystemTime::now())?)?;
        }
        ImageCommand::Delete(args) => {
            let reference = image_ref(&args.target, args.workspace.as_deref());
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
