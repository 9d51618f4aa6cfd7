//! The parts of the OCI image spec (and Docker's v2 schema, which has the same shape) that the
//! store reads and writes: descriptors, manifests, indexes and image configs.
//!
//! Own small serde types rather than `oci-spec`'s builders: the store must accept what real
//! registries serve (missing `mediaType`, `null` lists in Docker configs) and write manifests
//! byte-for-byte the same for the same input, so that their digests are stable.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

use super::ImageError;

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const LAYER_TAR: &str = "application/vnd.oci.image.layer.v1.tar";
pub const LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
pub const LAYER_ZSTD: &str = "application/vnd.oci.image.layer.v1.tar+zstd";
/// The annotation an OCI layout's index.json names its images with.
pub const REF_NAME: &str = "org.opencontainers.image.ref.name";

/// The largest manifest, index or config the store reads (16 MiB; real ones are a few KiB,
/// configs with a long history a few hundred): a hostile source cannot make it hold more.
pub const MAX_JSON: u64 = 16 << 20;

/// The `PATH` that images without one get (the Debian default for root).
pub const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    #[serde(default)]
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<BTreeMap<String, String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub platform: Option<Platform>,
}

impl Descriptor {
    pub fn new(media_type: &str, digest: String, size: u64) -> Self {
        Descriptor {
            media_type: media_type.to_string(),
            digest,
            size,
            annotations: None,
            platform: None,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub variant: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Index {
    #[serde(default)]
    pub manifests: Vec<Descriptor>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct ConfigFile {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<ContainerConfig>,
    pub rootfs: RootFs,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ContainerConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cmd: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub working_dir: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub labels: Option<BTreeMap<String, String>>,
    /// `{"8080/tcp": {}}`, as OCI writes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exposed_ports: Option<BTreeMap<String, serde_json::Value>>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct RootFs {
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub diff_ids: Vec<String>,
}

/// A manifest document: one image, or an index of them.
pub enum Document {
    Image(Manifest),
    Index(Index),
}

/// Parses a manifest or an index, telling them apart by media type or, where it is missing
/// (it is optional in OCI), by which list the document has.
pub fn parse_document(image: &str, bytes: &[u8]) -> Result<Document, ImageError> {
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| ImageError::malformed(image, format!("manifest is not JSON: {e}")))?;
    let media = value
        .get("mediaType")
        .and_then(|m| m.as_str())
        .unwrap_or("");
    let is_index = match media {
        OCI_INDEX | DOCKER_LIST => true,
        OCI_MANIFEST | DOCKER_MANIFEST => false,
        "" => value.get("manifests").is_some(),
        other => {
            return Err(ImageError::malformed(
                image,
                format!("unsupported manifest media type {other:?}"),
            ));
        }
    };
    if is_index {
        serde_json::from_value(value)
            .map(Document::Index)
            .map_err(|e| ImageError::malformed(image, format!("bad image index: {e}")))
    } else {
        let m: Manifest = serde_json::from_value(value)
            .map_err(|e| ImageError::malformed(image, format!("bad image manifest: {e}")))?;
        if m.schema_version != 2 {
            return Err(ImageError::malformed(
                image,
                format!(
                    "manifest schema version {} (only 2 is supported)",
                    m.schema_version
                ),
            ));
        }
        Ok(Document::Image(m))
    }
}

pub fn parse_config(image: &str, bytes: &[u8]) -> Result<ConfigFile, ImageError> {
    serde_json::from_slice(bytes)
        .map_err(|e| ImageError::malformed(image, format!("bad image config: {e}")))
}

/// Refuses an image made for another machine: a config (or a descriptor's platform) that names
/// an os other than linux or an architecture other than amd64. Empty fields say nothing.
pub fn runnable_here(image: &str, os: &str, architecture: &str) -> Result<(), ImageError> {
    if matches!(os, "" | "linux") && matches!(architecture, "" | "amd64") {
        return Ok(());
    }
    Err(ImageError::Platform {
        image: image.to_string(),
        available: format!("{}/{}", or_unspecified(os), or_unspecified(architecture)),
    })
}

fn or_unspecified(field: &str) -> &str {
    if field.is_empty() {
        "unspecified"
    } else {
        field
    }
}

/// The entry of an index for linux/amd64, or its only entry when it has one without a
/// platform.
pub fn choose_platform<'a>(image: &str, index: &'a Index) -> Result<&'a Descriptor, ImageError> {
    let linux_amd64 = index.manifests.iter().find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == "amd64")
    });
    if let Some(d) = linux_amd64 {
        return Ok(d);
    }
    if let [only] = index.manifests.as_slice()
        && only
            .platform
            .as_ref()
            .is_none_or(|p| runnable_here(image, &p.os, &p.architecture).is_ok())
    {
        return Ok(only);
    }
    let available = index
        .manifests
        .iter()
        .map(|d| match &d.platform {
            Some(p) => format!("{}/{}", p.os, p.architecture),
            None => "unspecified".to_string(),
        })
        .collect::<Vec<_>>();
    Err(ImageError::Platform {
        image: image.to_string(),
        available: if available.is_empty() {
            "nothing".to_string()
        } else {
            available.join(", ")
        },
    })
}

/// `sha256:<hex>` of these bytes.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// The hex part of a `sha256:` digest, checked to be 64 lowercase hex digits (so it is safe as
/// a file name).
pub fn digest_hex<'a>(image: &str, digest: &'a str) -> Result<&'a str, ImageError> {
    let bad = |why: &str| ImageError::InvalidReference {
        reference: format!("{digest} (in {image})"),
        why: why.to_string(),
    };
    if !sbx_proto::image_ref::is_digest(digest) {
        return Err(bad("a digest is sha256: and 64 lowercase hex digits"));
    }
    Ok(&digest["sha256:".len()..])
}

/// How a layer blob is compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// From a layer media type (OCI and Docker, distributable or not).
    pub fn from_media_type(image: &str, media_type: &str) -> Result<Self, ImageError> {
        let m = media_type;
        if !m.contains(".tar") && !m.contains("layer") {
            return Err(ImageError::malformed(
                image,
                format!("layer media type {m:?} is not a tar layer"),
            ));
        }
        if m.ends_with("+gzip") || m.ends_with(".tar.gzip") {
            Ok(Compression::Gzip)
        } else if m.ends_with("+zstd") || m.ends_with(".tar.zstd") {
            Ok(Compression::Zstd)
        } else if m.ends_with(".tar") {
            Ok(Compression::None)
        } else {
            Err(ImageError::malformed(
                image,
                format!("unsupported layer media type {m:?} (tar, tar+gzip and tar+zstd are)"),
            ))
        }
    }

    /// From the first bytes of the data (gzip `1f 8b`, zstd `28 b5 2f fd`; anything else is
    /// taken as a plain tar).
    pub fn sniff(head: &[u8]) -> Self {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }

    pub fn media_type(self) -> &'static str {
        match self {
            Compression::None => LAYER_TAR,
            Compression::Gzip => LAYER_GZIP,
            Compression::Zstd => LAYER_ZSTD,
        }
    }

    /// The decompressed stream of `r`.
    pub fn reader<'a>(
        self,
        r: impl std::io::Read + 'a,
    ) -> std::io::Result<Box<dyn std::io::Read + 'a>> {
        Ok(match self {
            Compression::None => Box::new(r),
            Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(r)),
            Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(r)?),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn images_for_other_machines_are_refused_naming_what_they_are_for() {
        assert!(runnable_here("i", "linux", "amd64").is_ok());
        assert!(runnable_here("i", "", "").is_ok());
        for (os, arch, named) in [
            ("linux", "arm64", "linux/arm64"),
            ("windows", "amd64", "windows/amd64"),
            ("", "s390x", "unspecified/s390x"),
        ] {
            let err = runnable_here("img", os, arch).unwrap_err().to_string();
            assert!(err.contains(named) && err.contains("img"), "{err}");
        }
        // An index whose only entry is for arm64 has nothing for this machine.
        let index: Index = serde_json::from_value(serde_json::json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": OCI_MANIFEST,
                "digest": "sha256:00",
                "size": 1,
                "platform": {"os": "linux", "architecture": "arm64"},
            }],
        }))
        .unwrap();
        let err = choose_platform("img", &index).unwrap_err().to_string();
        assert!(err.contains("linux/arm64"), "{err}");
    }
}
