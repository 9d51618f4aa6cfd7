//! `sbx image import`: a file (OCI layout tar, docker save tar, rootfs tar), streamed in
//! [`CHUNK`]-byte messages, or an OCI layout directory, first tarred into a temp file (removed
//! afterwards).

use std::io::Read;
use std::path::Path;
use std::time::SystemTime;

use clap::Args;
use sbx_proto::v1::image_service_client::ImageServiceClient;
use sbx_proto::v1::{ImportImageHeader, ImportImageRequest, import_image_request};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::{parse_image_reference, render_images};
use crate::CliError;
use crate::connect::{Target, connect};
use crate::output::OutputArgs;
use crate::reply::print_list;

/// Bytes per import message (the gateway accepts messages up to 8 MiB).
pub const CHUNK: usize = 1 << 20;

#[derive(Debug, Clone, Args)]
pub struct ImageImportArgs {
    /// The file (streamed as it is) or OCI layout directory (tarred, then streamed).
    #[arg(value_name = "FILE|DIR")]
    pub path: std::path::PathBuf,
    /// The name to record the image under, NAME:TAG (default: the names the archive carries).
    #[arg(long, value_name = "NAME:TAG", value_parser = parse_image_reference)]
    pub name: Option<String>,
    /// The workspace the images land in (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = crate::args::parse_name)]
    pub workspace: Option<String>,
    /// Make them the gateway's, run by every workspace (a gateway-wide admin only).
    #[arg(long, conflicts_with = "workspace")]
    pub publish: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

pub(super) async fn import(target: &Target, args: &ImageImportArgs) -> Result<(), CliError> {
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
            workspace: args.workspace.clone().unwrap_or_default(),
            publish: args.publish,
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
pub(super) fn send_chunks<M: Send + 'static>(
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
