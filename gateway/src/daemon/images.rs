//! sbxd's image settings and the built-in default image.
//!
//! A sandbox on a driver with images that names none runs `--default-image` (default
//! [`sbx_actors::DEFAULT_IMAGE`], `sbx.local/busybox:latest`). That built-in image is made
//! at start from the host's static busybox (`--busybox`, else the first of [`BUSYBOX_PATHS`])
//! — once: when its record exists, nothing is done — and only when the driver reports
//! `images`. A dynamically linked busybox would not run inside an image, so it is refused
//! with the package that has a static one.
//!
//! `--image-mirror` names the registry images are copied to for the nodes
//! (`crate::grpc::ImageMirror`, `sbx_drivers::remote::images`).

use std::path::PathBuf;
use std::sync::Arc;

use clap::Args;
use sbx_actors::{DEFAULT_IMAGE, Gateway};
use sbx_drivers::image::{ImageStore, MinFree, Mirror};
use sbx_drivers::remote::images::ImageSource;

use crate::grpc::ImageMirror;

pub use sbx_drivers::BUSYBOX_PATHS;

/// The image flags of `sbxd serve`.
#[derive(Debug, Clone, Args)]
pub struct ImageArgs {
    /// The image (a name) a sandbox runs when its spec names none, on drivers with images.
    /// The built-in `sbx.local/busybox:latest` is made from the host's static busybox.
    #[arg(long, env = "SBX_DEFAULT_IMAGE", default_value = DEFAULT_IMAGE, value_name = "NAME")]
    pub default_image: String,

    /// The static busybox the built-in default image is made from (default: /bin/busybox,
    /// else /usr/bin/busybox).
    #[arg(long = "busybox", env = "SBX_BUSYBOX", value_name = "PATH")]
    pub image_busybox: Option<PathBuf>,

    /// sim driver (testing): report the `images` capability, so that sandboxes resolve and
    /// pin an image.
    #[arg(long, env = "SBX_SIM_IMAGES")]
    pub sim_images: bool,

    /// A registry every gateway and node reaches (HOST:PORT[/PREFIX]; HTTPS, or plain HTTP
    /// to a loopback registry): every image pulled or imported is pushed to its repository
    /// [PREFIX/]sbx-images (a push that fails fails the pull or import, the image recorded
    /// still), and creates on nodes name it, so that a node fetches by digest an image it
    /// lacks. A gateway sharing a store fetches from it what another one pulled.
    #[arg(long, env = "SBX_IMAGE_MIRROR", value_name = "HOST:PORT[/PREFIX]",
          value_parser = parse_image_mirror)]
    pub image_mirror: Option<Mirror>,

    /// The largest image import accepted, in MiB.
    #[arg(
        long,
        env = "SBX_MAX_IMPORT_MIB",
        default_value_t = 8192,
        value_name = "MIB"
    )]
    pub max_import_mib: u64,

    /// The most an image pull may take, from its first request to the registry to its record
    /// (30s, 15m, 1h): a registry that sends a byte now and then is cut here, and nothing of
    /// the pull is kept. Connecting may take 30 s and a read may stall 120 s within it.
    #[arg(
        long,
        env = "SBX_PULL_TIMEOUT",
        default_value = "30m",
        value_name = "DURATION",
        value_parser = super::access::parse_ttl
    )]
    pub pull_timeout: std::time::Duration,

    /// The most layers an image pulled or imported may have (Docker's limit).
    #[arg(
        long,
        env = "SBX_IMAGE_MAX_LAYERS",
        default_value_t = 127,
        value_name = "N"
    )]
    pub image_max_layers: usize,

    /// The most an image pulled or imported may take unpacked (its files' bytes, and 4 KiB
    /// for each entry), and its manifest may claim: 20Gi, 512Mi, …
    #[arg(
        long,
        env = "SBX_IMAGE_MAX_SIZE",
        default_value = "20Gi",
        value_name = "SIZE",
        value_parser = sbx_proto::quantity::size_arg
    )]
    pub image_max_size: u64,

    /// The most entries (files, directories, links) an image pulled or imported may hold.
    #[arg(
        long,
        env = "SBX_IMAGE_MAX_FILES",
        default_value_t = 500_000,
        value_name = "N"
    )]
    pub image_max_files: u64,

    /// What a pull, an import, a build's layer or an upload must leave free on the image
    /// store's filesystem (checked as it writes, each file of a layer before its bytes; the
    /// refusal names the free space): a size (5Gi, 0 for none) or a share of the filesystem
    /// (15%). Default: 10% of it or 2 GiB, whichever is smaller.
    #[arg(
        long,
        env = "SBX_IMAGE_MIN_FREE",
        value_name = "SIZE|PERCENT",
        value_parser = parse_min_free
    )]
    pub image_min_free: Option<MinFree>,
}

/// `--image-min-free` (clap's value parser).
fn parse_min_free(text: &str) -> Result<MinFree, String> {
    MinFree::parse(text)
}

/// `--image-mirror` (clap's value parser).
fn parse_image_mirror(text: &str) -> Result<Mirror, String> {
    Mirror::parse(text).map_err(|e| e.to_string())
}

impl ImageArgs {
    /// The limits `--image-max-layers`, `--image-max-size` and `--image-max-files` set.
    pub fn limits(&self) -> sbx_drivers::image::ImageLimits {
        sbx_drivers::image::ImageLimits {
            max_layers: self.image_max_layers,
            max_size: self.image_max_size,
            max_files: self.image_max_files,
            min_free: self.image_min_free.unwrap_or_default(),
        }
    }
}

/// Why the built-in image could not be made.
#[derive(Debug, thiserror::Error)]
pub enum BusyboxError {
    /// No static busybox to make the built-in image from.
    #[error(
        "cannot make the built-in image {image}: {why}; or pass --busybox PATH, or set \
         --default-image"
    )]
    Busybox { image: String, why: String },
    #[error("the built-in image {image}: {source}")]
    Record {
        image: String,
        #[source]
        source: sbx_actors::ActorError,
    },
}

/// At start: when the default driver runs images and the default image is the built-in one
/// without a record, makes it from the host's busybox and records it.
pub async fn ensure_default_image(gateway: &Gateway, args: &ImageArgs) -> Result<(), BusyboxError> {
    let image = args.default_image.as_str();
    if image != DEFAULT_IMAGE {
        return Ok(());
    }
    match gateway.driver_has_images("").await {
        Ok(true) => {}
        Ok(false) => return Ok(()),
        Err(e) => {
            tracing::warn!(
                "cannot tell whether the driver runs images ({e}); the built-in image is made at the next start"
            );
            return Ok(());
        }
    }
    let record = |source| BusyboxError::Record {
        image: image.to_string(),
        source,
    };
    let selector = sbx_actors::ImageSelector::parse("", image).map_err(record)?;
    if gateway
        .get_image(&selector, sbx_actors::ImageScope::Gateway)
        .await
        .is_ok()
    {
        return Ok(());
    }
    let busybox = sbx_drivers::find_static_busybox(args.image_busybox.as_deref(), &BUSYBOX_PATHS)
        .map_err(|why| BusyboxError::Busybox {
        image: image.to_string(),
        why,
    })?;
    if let Some(made) = gateway
        .ensure_busybox_image(&busybox, image)
        .await
        .map_err(record)?
    {
        tracing::info!(image = %made.name, digest = %made.digest, busybox = %busybox.display(), "built the default image");
    }
    Ok(())
}

/// The image mirror `--image-mirror` names, over this gateway's store `images`; `None`
/// without the flag.
pub fn image_mirror(args: &ImageArgs, images: &ImageStore) -> Option<Arc<ImageMirror>> {
    let mirror = args.image_mirror.clone()?;
    tracing::info!(%mirror, "images are mirrored for the nodes");
    let source = Arc::new(ImageSource::new(mirror, Some(images.clone())));
    Some(Arc::new(ImageMirror::new(
        source,
        args.default_image.clone(),
    )))
}

/// At start, in the background: the default image pushed to the mirror when this gateway's
/// store holds it (a failure is logged; a create on a node tries again).
pub fn mirror_default_image(gateway: &Arc<Gateway>, mirror: Option<&Arc<ImageMirror>>) {
    let Some(mirror) = mirror.cloned() else {
        return;
    };
    let gateway = Arc::clone(gateway);
    tokio::spawn(async move { mirror.push_default(&gateway).await });
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    #[test]
    fn an_image_mirror_is_a_registry_with_an_optional_prefix() {
        let serve = |extra: &[&str]| {
            let argv = ["sbxd", "serve"].iter().chain(extra).copied();
            super::super::Sbxd::try_parse_from(argv).map(|s| match s.command {
                super::super::Command::Serve(args) => args.images.image_mirror,
                _ => unreachable!("parsed serve"),
            })
        };
        assert_eq!(serve(&[]).unwrap(), None);
        let mirror = serve(&["--image-mirror", "127.0.0.1:5000/team"])
            .unwrap()
            .unwrap();
        assert_eq!(mirror.to_string(), "127.0.0.1:5000/team/sbx-images");
        let err = serve(&["--image-mirror", "mirror"])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--image-mirror") && err.contains("does not read as a registry"),
            "{err}"
        );
    }
}
