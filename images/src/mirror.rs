//! [`Mirror`] and [`ImageStore::push`]: the store's images copied to a registry that every
//! gateway and node can reach, so that a node fetches by digest what a gateway pulled or
//! imported (with [`ImageStore::pull`] of [`Mirror::reference`], which checks every digest).
//!
//! One repository holds every image: `[PREFIX/]sbx-images`. A node knows an image by its
//! manifest digest only (the driver contract's `spec.image`), so the mirror must be addressable
//! by digest alone; in one repository a layer that several images share is stored and pushed
//! once, and the names images have in the gateways (`docker.io/library/debian:12`, any
//! registry's) need no mapping onto repository names. Each manifest is also tagged
//! `sbx-<hex of its digest>`, so that a registry's garbage collection of untagged manifests
//! (`registry garbage-collect --delete-untagged`) keeps it, and the repository's tag list says
//! what it holds.
//!
//! A push sends the blobs as the store keeps them (config, then layers: compressed as pulled,
//! or as imported — a `docker save` layer and the built-in busybox image's are plain tars),
//! each one only when the registry lacks it, then the manifest's exact bytes: the digest a
//! node asks for is the one the gateways pinned. A manifest already in the mirror ends the
//! push at once (a registry accepts a manifest only once it holds every blob it names).
//! Plain HTTP is spoken to a loopback registry only (or with [`PullOptions::insecure`]), as
//! for pulls ([`super::client_protocol`]).

use std::fmt;
use std::time::Duration;

use oci_client::client::ClientConfig;
use oci_client::errors::OciDistributionError;
use oci_client::{Client, Reference, RegistryOperation};
use tokio::io::AsyncReadExt;

use super::spec::{self, Document};
use super::{ImageError, ImageStore, PullOptions, RegistryAuth, pull};

/// The repository (under the mirror's prefix) that holds every image.
pub const MIRROR_REPOSITORY: &str = "sbx-images";

/// The prefix of the tag each manifest is pushed under (`sbx-<hex>`).
pub const MIRROR_TAG_PREFIX: &str = "sbx-";

/// How long connecting to the mirror may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a read from the mirror may stall.
const READ_TIMEOUT: Duration = Duration::from_secs(120);
/// The size of the reads a blob is streamed to the mirror in.
const PUSH_READ: usize = 1 << 20;

/// Where images are mirrored: a registry (`HOST[:PORT]`) and the repository in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mirror {
    registry: String,
    repository: String,
}

impl Mirror {
    /// Parses `HOST[:PORT][/PREFIX]` (no scheme: HTTPS, or plain HTTP to a loopback
    /// registry). The repository is `PREFIX/sbx-images`, or `sbx-images` without a prefix.
    /// HOST must read as a registry in an image reference: a name with a dot, a port, or
    /// `localhost`.
    pub fn parse(text: &str) -> Result<Mirror, ImageError> {
        let bad = |why: String| ImageError::InvalidReference {
            reference: text.to_string(),
            why,
        };
        if text.contains("://") {
            return Err(bad(
                "an image mirror is HOST:PORT[/PREFIX], without a scheme (HTTPS, or plain \
                 HTTP to a loopback registry)"
                    .into(),
            ));
        }
        let text = text.trim_end_matches('/');
        let (registry, prefix) = match text.split_once('/') {
            Some((registry, prefix)) => (registry, Some(prefix)),
            None => (text, None),
        };
        if registry.is_empty() {
            return Err(bad("no registry: write HOST:PORT[/PREFIX]".into()));
        }
        if prefix.is_some_and(|p| p.contains([':', '@'])) {
            return Err(bad(
                "the prefix is a repository path: no tag or digest".into()
            ));
        }
        let repository = match prefix {
            Some(prefix) => format!("{prefix}/{MIRROR_REPOSITORY}"),
            None => MIRROR_REPOSITORY.to_string(),
        };
        let probe = format!("{registry}/{repository}@sha256:{}", "0".repeat(64));
        let parsed = sbx_proto::image_ref::parse(&probe).map_err(|e| bad(e.reason))?;
        if parsed.domain != registry || parsed.path != repository {
            return Err(bad(format!(
                "{registry:?} does not read as a registry (a name with a dot, a port, or \
                 localhost: mirror.example:5000)"
            )));
        }
        Ok(Mirror {
            registry: registry.to_string(),
            repository,
        })
    }

    /// `HOST[:PORT]`.
    pub fn registry(&self) -> &str {
        &self.registry
    }

    /// `[PREFIX/]sbx-images`.
    pub fn repository(&self) -> &str {
        &self.repository
    }

    /// Where the image with manifest digest `digest` is in the mirror:
    /// `HOST[:PORT]/[PREFIX/]sbx-images@sha256:<hex>`.
    pub fn reference(&self, digest: &str) -> String {
        format!("{}/{}@{digest}", self.registry, self.repository)
    }

    /// The tag a manifest is pushed under: `sbx-<hex>`.
    pub fn tag(digest: &str) -> String {
        format!(
            "{MIRROR_TAG_PREFIX}{}",
            digest.strip_prefix("sha256:").unwrap_or(digest)
        )
    }

    /// The mirror of `reference` (what [`Mirror::reference`] gives), and the digest it pins;
    /// `None` for a reference that names no digest.
    pub fn split_reference(reference: &str) -> Option<(Mirror, String)> {
        let (place, digest) = reference.split_once('@')?;
        if !sbx_proto::image_ref::is_digest(digest) {
            return None;
        }
        let (registry, repository) = place.split_once('/')?;
        let parsed = sbx_proto::image_ref::parse(reference).ok()?;
        if parsed.domain != registry || parsed.path != repository {
            return None;
        }
        Some((
            Mirror {
                registry: registry.to_string(),
                repository: repository.to_string(),
            },
            digest.to_string(),
        ))
    }
}

impl fmt::Display for Mirror {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)
    }
}

/// What a push did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PushReport {
    /// The mirror held the manifest already: nothing was sent.
    pub already_there: bool,
    /// Blobs sent.
    pub blobs_pushed: usize,
    /// Blobs the mirror held already.
    pub blobs_present: usize,
    /// The bytes of the blobs sent.
    pub bytes_pushed: u64,
}

impl ImageStore {
    /// Copies the image whose manifest digest is `digest` from this store to `mirror`: its
    /// config and layer blobs that the mirror lacks, then its manifest, byte for byte, tagged
    /// [`Mirror::tag`]. Reads only (a read-only store pushes too).
    pub async fn push(
        &self,
        digest: &str,
        mirror: &Mirror,
        opts: &PullOptions,
    ) -> Result<PushReport, ImageError> {
        let image = mirror.reference(digest);
        spec::digest_hex(&image, digest)?;
        let store = self.clone();
        let (name, at) = (image.clone(), digest.to_string());
        let (info, manifest_bytes) = tokio::task::spawn_blocking(move || {
            let info = store.read_image(&name, &at)?;
            let bytes = store.read_json_blob(&name, &at)?;
            Ok::<_, ImageError>((info, bytes))
        })
        .await
        .map_err(|e| ImageError::io(&image, "read task", std::io::Error::other(e)))??;
        let media_type = match spec::parse_document(&image, &manifest_bytes)? {
            Document::Image(m) => m.media_type.unwrap_or_else(|| spec::OCI_MANIFEST.into()),
            Document::Index(_) => {
                return Err(ImageError::malformed(
                    &image,
                    format!("{digest} is an index, not an image manifest"),
                ));
            }
        };
        let registry = mirror.registry().to_string();
        let fail = |e: OciDistributionError| pull::map_error(&image, &registry, e);
        let client = Client::new(ClientConfig {
            protocol: super::client_protocol(&registry, opts.insecure),
            connect_timeout: Some(CONNECT_TIMEOUT),
            read_timeout: Some(READ_TIMEOUT),
            // One PUT per blob, streamed from its file, where chunks would be a request each.
            use_monolithic_push: true,
            ..ClientConfig::default()
        });
        let auth = match &opts.auth {
            RegistryAuth::Anonymous => oci_client::secrets::RegistryAuth::Anonymous,
            RegistryAuth::Basic { username, password } => {
                oci_client::secrets::RegistryAuth::Basic(username.clone(), password.clone())
            }
        };
        let by_digest = Reference::with_digest(
            registry.clone(),
            mirror.repository().to_string(),
            digest.to_string(),
        );
        if let Ok(there) = client.fetch_manifest_digest(&by_digest, &auth).await
            && there == digest
        {
            return Ok(PushReport {
                already_there: true,
                ..PushReport::default()
            });
        }
        let target = Reference::with_tag(
            registry.clone(),
            mirror.repository().to_string(),
            Mirror::tag(digest),
        );
        client
            .auth(&target, &auth, RegistryOperation::Push)
            .await
            .map_err(fail)?;
        let mut report = PushReport::default();
        let blobs = std::iter::once(info.config_digest.as_str())
            .chain(info.layers.iter().map(|l| l.digest.as_str()));
        for blob in blobs {
            if client.blob_exists(&target, blob).await.map_err(fail)? {
                report.blobs_present += 1;
                continue;
            }
            let path = self.blob_path(&image, blob)?;
            let file = tokio::fs::File::open(&path)
                .await
                .map_err(|e| ImageError::io(&image, format!("open blob {blob}"), e))?;
            let size = file
                .metadata()
                .await
                .map_err(|e| ImageError::io(&image, format!("stat blob {blob}"), e))?
                .len();
            let chunks = futures::stream::try_unfold(file, |mut file| async move {
                let mut buf = vec![0u8; PUSH_READ];
                let n = file.read(&mut buf).await?;
                if n == 0 {
                    return Ok(None);
                }
                buf.truncate(n);
                Ok(Some((bytes::Bytes::from(buf), file)))
            });
            client
                .push_blob_stream(&target, chunks, blob, Some(size))
                .await
                .map_err(fail)?;
            report.blobs_pushed += 1;
            report.bytes_pushed += size;
        }
        let content_type = media_type.parse().map_err(|_| {
            ImageError::malformed(&image, format!("manifest media type {media_type:?}"))
        })?;
        client
            .push_manifest_raw(&target, manifest_bytes, content_type)
            .await
            .map_err(fail)?;
        tracing::info!(
            image = %digest,
            mirror = %mirror,
            blobs_pushed = report.blobs_pushed,
            blobs_present = report.blobs_present,
            bytes = report.bytes_pushed,
            "image pushed to the mirror"
        );
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mirror_is_a_registry_and_an_optional_prefix() {
        let m = Mirror::parse("127.0.0.1:5000").unwrap();
        assert_eq!(
            (m.registry(), m.repository()),
            ("127.0.0.1:5000", "sbx-images")
        );
        let digest = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(
            m.reference(&digest),
            format!("127.0.0.1:5000/sbx-images@{digest}")
        );
        assert_eq!(Mirror::tag(&digest), format!("sbx-{}", "ab".repeat(32)));
        let m = Mirror::parse("mirror.example/team/ci/").unwrap();
        assert_eq!(
            (m.registry(), m.repository()),
            ("mirror.example", "team/ci/sbx-images")
        );
        assert_eq!(m.to_string(), "mirror.example/team/ci/sbx-images");
        assert_eq!(
            Mirror::parse("localhost/x").unwrap().repository(),
            "x/sbx-images"
        );
        // What a reference gives back.
        let (back, pinned) = Mirror::split_reference(&m.reference(&digest)).unwrap();
        assert_eq!((back, pinned), (m, digest.clone()));
        for not_one in [
            "mirror.example/sbx-images:latest".to_string(),
            "mirror.example/sbx-images".to_string(),
            format!("mirror/sbx-images@{digest}"),
            format!("mirror.example@{digest}"),
        ] {
            assert!(Mirror::split_reference(&not_one).is_none(), "{not_one}");
        }
        for (bad, says) in [
            ("", "no registry"),
            ("/x", "no registry"),
            ("http://127.0.0.1:5000", "without a scheme"),
            ("mirror", "does not read as a registry"),
            ("mirror/x", "does not read as a registry"),
            ("127.0.0.1:5000/x:tag", "no tag or digest"),
            ("127.0.0.1:5000/UPPER", "UPPER"),
        ] {
            let err = Mirror::parse(bad).unwrap_err().to_string();
            assert!(err.contains(says), "{bad:?}: {err}");
        }
    }
}
