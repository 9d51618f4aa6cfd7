//! [`ImageStore::pull`]: images from a registry over the OCI distribution protocol.
//!
//! `oci-client` speaks the protocol (Docker v2 and OCI media types, anonymous, basic and
//! bearer-token auth); the store resolves indexes itself (linux/amd64, the same rule as for
//! OCI layouts) so that it stores the exact manifest bytes it was served. Blobs are streamed to
//! `tmp/` while hashed, never held whole in memory; layers already stored are not fetched
//! again. Plain HTTP is used only for loopback registries (127.0.0.0/8, ::1, localhost) or with
//! [`PullOptions::insecure`]; every other registry is spoken to over HTTPS only.

use std::net::IpAddr;
use std::time::Duration;

use futures::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol, linux_amd64_resolver};
use oci_client::errors::{OciDistributionError, OciErrorCode};
use oci_client::manifest::OciDescriptor;
use oci_client::{Client, Reference};

use super::spec::{self, Compression, Document};
use super::{ImageError, ImageInfo, ImageStore, PullOptions, PullProgress, RegistryAuth, Transfer};

/// Progress of a layer download is reported at most once per this many bytes (and at its end).
pub const PROGRESS_STEP: u64 = 1 << 20;
/// How long connecting to a registry may take (a registry that does not answer in 30 s is
/// down for our purposes).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a read from a registry may stall.
const READ_TIMEOUT: Duration = Duration::from_secs(120);

const ACCEPTED_MANIFESTS: &[&str] = &[
    spec::OCI_MANIFEST,
    spec::OCI_INDEX,
    spec::DOCKER_MANIFEST,
    spec::DOCKER_LIST,
];

/// The protocol the client uses for `registry` (`host[:port]`): plain HTTP only for a loopback
/// registry or when `insecure`, HTTPS otherwise.
pub fn client_protocol(registry: &str, insecure: bool) -> ClientProtocol {
    if insecure || is_loopback(registry) {
        ClientProtocol::HttpsExcept(vec![registry.to_string()])
    } else {
        ClientProtocol::Https
    }
}

/// Whether `host[:port]` (or `[v6]:port`) names this machine.
fn is_loopback(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else if registry.matches(':').count() > 1 {
        registry // a bare IPv6 address
    } else {
        registry.split(':').next().unwrap_or("")
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Parses `reference` by the project's image reference rule and gives oci-client's form of it.
pub fn parse_reference(reference: &str) -> Result<Reference, ImageError> {
    let r = sbx_proto::image_ref::parse(reference).map_err(|e| ImageError::InvalidReference {
        reference: reference.to_string(),
        why: e.reason,
    })?;
    Ok(match (r.tag, r.digest) {
        (Some(tag), Some(digest)) => Reference::with_tag_and_digest(r.domain, r.path, tag, digest),
        (None, Some(digest)) => Reference::with_digest(r.domain, r.path, digest),
        (tag, None) => {
            Reference::with_tag(r.domain, r.path, tag.unwrap_or_else(|| "latest".into()))
        }
    })
}

impl ImageStore {
    /// Pulls `reference` over the OCI distribution protocol, reporting progress as it goes,
    /// and returns the stored image (its linux/amd64 manifest when the reference names an
    /// index).
    pub async fn pull(
        &self,
        reference: &str,
        opts: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
    ) -> Result<ImageInfo, ImageError> {
        let transfer = self.transfer(Default::default());
        self.pull_with(reference, opts, progress, &transfer).await
    }

    /// [`ImageStore::pull`] as `transfer`: what it fetches and uses is held until it ends, and
    /// it stops at its next chunk once cancelled (a stalled registry too).
    pub async fn pull_with(
        &self,
        reference: &str,
        opts: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
        transfer: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        let cancel = transfer.cancel_token().clone();
        let image = reference.to_string();
        tokio::select! {
            pulled = self.pull_in(reference, opts, progress, transfer) => pulled,
            () = cancel.cancelled() => Err(ImageError::Cancelled { image }),
        }
    }

    async fn pull_in(
        &self,
        reference: &str,
        opts: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
        transfer: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        self.writable("pull")?;
        let r = parse_reference(reference)?;
        let image = r.whole();
        let registry = r.resolve_registry().to_string();
        let fail = |e: OciDistributionError| map_error(&image, &registry, e);
        let client = Client::new(ClientConfig {
            protocol: client_protocol(&registry, opts.insecure),
            platform_resolver: Some(Box::new(linux_amd64_resolver)),
            connect_timeout: Some(CONNECT_TIMEOUT),
            read_timeout: Some(READ_TIMEOUT),
            ..ClientConfig::default()
        });
        let auth = match &opts.auth {
            RegistryAuth::Anonymous => oci_client::secrets::RegistryAuth::Anonymous,
            RegistryAuth::Basic { username, password } => {
                oci_client::secrets::RegistryAuth::Basic(username.clone(), password.clone())
            }
        };

        // The manifest, through at most a few indexes.
        let mut target = r.clone();
        let mut depth = 0;
        let (manifest, manifest_bytes) = loop {
            let (bytes, _) = client
                .pull_manifest_raw(&target, &auth, ACCEPTED_MANIFESTS)
                .await
                .map_err(fail)?;
            if bytes.len() as u64 > spec::MAX_JSON {
                return Err(ImageError::malformed(
                    &image,
                    "manifest is larger than 16 MiB",
                ));
            }
            if let Some(pinned) = target.digest() {
                let actual = spec::sha256_digest(&bytes);
                if actual != pinned {
                    return Err(ImageError::DigestMismatch {
                        image: image.clone(),
                        expected: pinned.to_string(),
                        actual,
                    });
                }
            }
            match spec::parse_document(&image, &bytes)? {
                Document::Image(m) => break (m, bytes),
                Document::Index(index) => {
                    depth += 1;
                    if depth > 4 {
                        return Err(ImageError::malformed(
                            &image,
                            "image indexes nest deeper than 4",
                        ));
                    }
                    let chosen = spec::choose_platform(&image, &index)?;
                    spec::digest_hex(&image, &chosen.digest)?;
                    target = r.clone_with_digest(chosen.digest.clone());
                }
            }
        };
        let limits = self.limits();
        let claimed: Vec<u64> = manifest.layers.iter().map(|l| l.size).collect();
        limits.check_manifest(&image, &claimed)?;
        let mut budget = self.budget_for(&image, transfer);
        let manifest_digest = spec::sha256_digest(&manifest_bytes);
        progress(PullProgress::Resolved {
            digest: manifest_digest.clone(),
            layers: manifest.layers.len(),
            total_bytes: manifest.layers.iter().map(|l| l.size).sum(),
        });

        // The config.
        let config_desc = descriptor(&manifest.config);
        if manifest.config.size > spec::MAX_JSON {
            return Err(ImageError::malformed(
                &image,
                "config is larger than 16 MiB",
            ));
        }
        let mut config_bytes = Vec::new();
        client
            .pull_blob(&r, &config_desc, &mut config_bytes)
            .await
            .map_err(fail)?;
        self.store_bytes(
            &image,
            &config_bytes,
            Some(&manifest.config.digest),
            transfer,
        )?;
        let config = spec::parse_config(&image, &config_bytes)?;
        spec::runnable_here(&image, &config.os, &config.architecture)?;
        if config.rootfs.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::malformed(
                &image,
                format!(
                    "manifest has {} layers but the config {} diff_ids",
                    manifest.layers.len(),
                    config.rootfs.diff_ids.len()
                ),
            ));
        }

        // The layers, one after the other.
        for (layer, diff_id) in manifest.layers.iter().zip(&config.rootfs.diff_ids) {
            let compression = Compression::from_media_type(&image, &layer.media_type)?;
            transfer.hold(&layer.digest);
            if self.holds_layer(&image, diff_id, transfer)? {
                budget.take_cached(layer.size)?;
                progress(PullProgress::LayerCached {
                    digest: layer.digest.clone(),
                    size: layer.size,
                });
                continue;
            }
            if !self.holds_blob(&image, &layer.digest, transfer)? {
                self.download_blob(&client, &r, &image, layer, progress, transfer)
                    .await?;
            }
            let store = self.clone();
            let (img, blob, diff) = (image.clone(), layer.digest.clone(), diff_id.clone());
            // The unpack holds the transfer too: should this future be dropped, what it puts
            // in place stays held until it ends.
            let held = transfer.clone();
            let (unpacked, spent) = tokio::task::spawn_blocking(move || {
                let unpacked =
                    store.unpack_layer(&img, &blob, compression, Some(&diff), &mut budget, &held);
                (unpacked, budget)
            })
            .await
            .map_err(|e| ImageError::io(&image, "unpack task", std::io::Error::other(e)))?;
            unpacked?;
            budget = spent;
            progress(PullProgress::LayerUnpacked {
                digest: layer.digest.clone(),
            });
        }
        let info = self.finish_image(&image, &manifest_bytes, transfer)?;
        tracing::info!(image = %image, digest = %info.digest, layers = info.layers.len(), "image pulled");
        Ok(info)
    }

    async fn download_blob(
        &self,
        client: &Client,
        r: &Reference,
        image: &str,
        layer: &spec::Descriptor,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
        transfer: &Transfer,
    ) -> Result<(), ImageError> {
        let registry = r.resolve_registry();
        spec::digest_hex(image, &layer.digest)?;
        let mut stream = client
            .pull_blob_stream(r, &descriptor(layer))
            .await
            .map_err(|e| map_error(image, registry, e))?;
        let mut writer = self.blob_writer(image, transfer)?;
        let (mut done, mut reported) = (0u64, 0u64);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                // oci-client's verifying stream ends with its digest check.
                if let Some(oci_client::errors::DigestError::VerificationError {
                    expected,
                    actual,
                }) = e.get_ref().and_then(|inner| inner.downcast_ref())
                {
                    return ImageError::DigestMismatch {
                        image: image.to_string(),
                        expected: expected.clone(),
                        actual: actual.clone(),
                    };
                }
                ImageError::Unavailable {
                    registry: registry.to_string(),
                    image: image.to_string(),
                    why: format!("download of layer {} broke off: {e}", layer.digest),
                }
            })?;
            done += chunk.len() as u64;
            // What the manifest claimed, and no more: a registry that sends more lies.
            if done > layer.size {
                return Err(ImageError::malformed(
                    image,
                    format!(
                        "the registry sent more of layer {} than the {} bytes its manifest \
                         claims",
                        layer.digest, layer.size
                    ),
                ));
            }
            writer.put(&chunk, &format!("layer {}", layer.digest))?;
            if done - reported >= PROGRESS_STEP {
                reported = done;
                progress(PullProgress::Layer {
                    digest: layer.digest.clone(),
                    done,
                    total: layer.size,
                });
            }
        }
        if reported != done || done == 0 {
            progress(PullProgress::Layer {
                digest: layer.digest.clone(),
                done,
                total: layer.size,
            });
        }
        let digest = layer.digest.clone();
        tokio::task::spawn_blocking(move || writer.commit(Some(&digest)))
            .await
            .map_err(|e| ImageError::io(image, "blob commit task", std::io::Error::other(e)))??;
        Ok(())
    }
}

fn descriptor(d: &spec::Descriptor) -> OciDescriptor {
    OciDescriptor {
        media_type: d.media_type.clone(),
        digest: d.digest.clone(),
        size: i64::try_from(d.size).unwrap_or(i64::MAX),
        ..OciDescriptor::default()
    }
}

/// The store's error for what oci-client answered.
pub(crate) fn map_error(image: &str, registry: &str, e: OciDistributionError) -> ImageError {
    let unavailable = |why: String| ImageError::Unavailable {
        registry: registry.to_string(),
        image: image.to_string(),
        why,
    };
    let unauthorized = |why: String| ImageError::Unauthorized {
        registry: registry.to_string(),
        image: image.to_string(),
        why,
    };
    match e {
        OciDistributionError::RequestError(e) => {
            let mut why = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                why.push_str(&format!(": {s}"));
                source = s.source();
            }
            unavailable(why)
        }
        OciDistributionError::UnauthorizedError { url } => unauthorized(format!("401 for {url}")),
        OciDistributionError::AuthenticationFailure(why) => unauthorized(why),
        OciDistributionError::RegistryError { envelope, url } => {
            let why = format!("{envelope} ({url})");
            let codes = envelope.errors.iter().map(|e| &e.code).collect::<Vec<_>>();
            if codes.iter().any(|c| {
                matches!(
                    c,
                    OciErrorCode::ManifestUnknown
                        | OciErrorCode::NameUnknown
                        | OciErrorCode::BlobUnknown
                        | OciErrorCode::NotFound
                )
            }) {
                ImageError::not_found(image, why)
            } else if codes
                .iter()
                .any(|c| matches!(c, OciErrorCode::Unauthorized | OciErrorCode::Denied))
            {
                unauthorized(why)
            } else {
                unavailable(why)
            }
        }
        OciDistributionError::ServerError { code, url, message } => {
            let why = format!("HTTP {code} for {url}: {message}");
            match code {
                404 => ImageError::not_found(image, why),
                401 | 403 => unauthorized(why),
                _ => unavailable(why),
            }
        }
        OciDistributionError::ImageManifestNotFoundError(why) => ImageError::not_found(image, why),
        OciDistributionError::DigestError(oci_client::errors::DigestError::VerificationError {
            expected,
            actual,
        }) => ImageError::DigestMismatch {
            image: image.to_string(),
            expected,
            actual,
        },
        e @ (OciDistributionError::ManifestParsingError(_)
        | OciDistributionError::VersionedParsingError(_)
        | OciDistributionError::UnsupportedMediaTypeError(_)
        | OciDistributionError::UnsupportedSchemaVersionError(_)
        | OciDistributionError::JsonError(_)
        | OciDistributionError::SpecViolationError(_)) => {
            ImageError::malformed(image, e.to_string())
        }
        e => unavailable(e.to_string()),
    }
}
