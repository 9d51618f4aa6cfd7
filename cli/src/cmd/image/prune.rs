//! `sbx image prune`: removes the images no sandbox uses, of a workspace or of the gateway,
//! and says what went and the bytes it freed (`removed 3 images, freed 12.4MiB`, sizes as `sbx image list` shows them).

use clap::Args;
use sbx_proto::v1::PruneImagesRequest;
use sbx_proto::v1::image_service_client::ImageServiceClient;
use serde::Serialize;

use crate::CliError;
use crate::args::parse_name;
use crate::connect::{Target, connect};
use crate::output::{OutputArgs, OutputFormat, human_bytes, render_structured};
use crate::reply::print;

#[derive(Debug, Clone, Args)]
#[command(after_help = "\
Without --all, only the build cache goes (the sbx.local/build-cache:* images `sbx image build` \
keeps for each step) and content no image names; with --all, every image of the workspace that \
no sandbox (of any workspace) uses, except the gateway's default image, which is never pruned. \
An image a sandbox uses always stays, whatever its state. Needs an admin of the workspace \
(--gateway: a gateway-wide admin).

Examples:
  sbx image prune                 # the build cache of workspace \"default\"
  sbx image prune -w team --all   # every image of \"team\" no sandbox uses
  sbx image prune --gateway --all # the gateway's own images no sandbox uses")]
pub struct ImagePruneArgs {
    /// The workspace whose images are pruned (default: "default").
    #[arg(short = 'w', long, value_name = "WORKSPACE", value_parser = parse_name)]
    pub workspace: Option<String>,
    /// Every image no sandbox uses, not only the build cache.
    #[arg(short = 'a', long)]
    pub all: bool,
    /// The gateway's own images (published ones) instead of a workspace's.
    #[arg(long, conflicts_with = "workspace")]
    pub gateway: bool,
    #[command(flatten)]
    pub output: OutputArgs,
}

/// What `sbx image prune -o json|yaml` prints.
#[derive(Debug, Clone, Serialize)]
pub struct PrunedView {
    pub removed: Vec<String>,
    pub bytes_freed: u64,
}

/// The line a person reads: `removed 3 images, freed 12.4MiB`.
pub fn pruned_line(view: &PrunedView) -> String {
    let n = view.removed.len();
    let noun = if n == 1 { "image" } else { "images" };
    format!(
        "removed {n} {noun}, freed {}\n",
        human_bytes(view.bytes_freed)
    )
}

pub async fn prune(target: &Target, args: &ImagePruneArgs) -> Result<(), CliError> {
    let mut client = ImageServiceClient::new(connect(target).await?);
    let answer = client
        .prune_images(PruneImagesRequest {
            workspace: args.workspace.clone().unwrap_or_default(),
            all: args.all,
            gateway: args.gateway,
        })
        .await?
        .into_inner();
    let view = PrunedView {
        removed: answer.removed,
        bytes_freed: answer.bytes_freed,
    };
    let text = match args.output.format {
        OutputFormat::Json | OutputFormat::Yaml => render_structured(args.output.format, &view)?,
        OutputFormat::Name => view
            .removed
            .iter()
            .map(|n| format!("image/{n}\n"))
            .collect(),
        OutputFormat::Table | OutputFormat::Wide => {
            let mut lines: String = view
                .removed
                .iter()
                .map(|n| format!("deleted {n}\n"))
                .collect();
            lines.push_str(&pruned_line(&view));
            lines
        }
    };
    print(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_counts_and_sizes() {
        let view = PrunedView {
            removed: vec!["a".into(), "b".into(), "c".into()],
            bytes_freed: 13_002_342,
        };
        assert_eq!(pruned_line(&view), "removed 3 images, freed 12.4MiB\n");
        let one = PrunedView {
            removed: vec!["a".into()],
            bytes_freed: 0,
        };
        assert_eq!(pruned_line(&one), "removed 1 image, freed 0B\n");
    }
}
