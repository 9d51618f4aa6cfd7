//! [`ImageError`]: everything the image store can refuse, each naming what it is about.

use std::path::PathBuf;

use super::IdMap;

/// An image store failure. Every variant names the image (a reference, a manifest digest, an
/// imported file) or the store it is about.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A reference that is not `[registry/]name[:tag][@sha256:hex]`, or a digest that is not
    /// `sha256:` and 64 lowercase hex digits.
    #[error("invalid image reference {reference:?}: {why}")]
    InvalidReference { reference: String, why: String },

    /// An unknown image, manifest, tag or blob: a registry's 404 for a manifest, a manifest
    /// digest the store does not hold, or an image whose layers are not unpacked.
    #[error("image {image} not found: {why}")]
    NotFound { image: String, why: String },

    /// The registry could not be reached (connection refused, DNS, TLS, timeout) or answered
    /// with a server error (5xx), in a pull or a push to an image mirror.
    #[error("registry {registry} is unavailable for {image}: {why}")]
    Unavailable {
        registry: String,
        image: String,
        why: String,
    },

    /// The registry refused the credentials (401/403), or wants some and none were given.
    #[error("registry {registry} refused access to {image}: {why}")]
    Unauthorized {
        registry: String,
        image: String,
        why: String,
    },

    /// An image index with no `linux/amd64` manifest, or an image (its descriptor's platform
    /// or its config) made for another os or architecture.
    #[error("image {image} has no linux/amd64 manifest (it has: {available})")]
    Platform { image: String, available: String },

    /// Content whose sha256 is not the digest it was asked for: a blob, a manifest pulled by
    /// digest, or an unpacked layer whose uncompressed digest is not the config's diff_id.
    /// Such content is never stored.
    #[error("digest mismatch in {image}: expected {expected}, got {actual}")]
    DigestMismatch {
        image: String,
        expected: String,
        actual: String,
    },

    /// A manifest, index, config or archive that cannot be parsed or is inconsistent (layer and
    /// diff_id counts differ, an unsupported media type, a truncated or corrupt tar, gzip or zstd
    /// stream).
    #[error("image {image} is malformed: {why}")]
    Malformed { image: String, why: String },

    /// A layer entry that would escape the layer directory or that cannot be represented safely
    /// (an absolute path, `..`, a symlinked parent, a hard link to something not in the layer,
    /// an owner outside the id map). The whole layer is refused.
    #[error("image {image}: layer {layer} is unsafe at entry {entry:?}: {why}")]
    UnsafeLayer {
        image: String,
        layer: String,
        entry: String,
        why: String,
    },

    /// A store opened with another id map than the one its layers were unpacked with.
    #[error(
        "image store {} was unpacked with id map {stored:?}, not {requested:?}; \
         use the recorded map or a new store",
        root.display()
    )]
    IdMapMismatch {
        root: PathBuf,
        stored: IdMap,
        requested: IdMap,
    },

    /// A write (pull, import, gc) through a store opened with [`super::ImageStore::open_read_only`].
    #[error("image store {} is open read-only; {what} needs a writable store", root.display())]
    ReadOnly { root: PathBuf, what: String },

    /// An argument the operation cannot use (a root-filesystem tar without a name, a busybox
    /// that is not a static ELF program).
    #[error("{image}: {why}")]
    InvalidArgument { image: String, why: String },

    /// The image is larger than the store takes ([`super::ImageLimits`]): more layers, more
    /// bytes unpacked or claimed by its manifest, or more files. Nothing of it is kept.
    #[error("image {image}: {why} (the limit: {limit})")]
    TooLarge {
        image: String,
        why: String,
        /// The limit passed and the flag that sets it.
        limit: String,
    },

    /// The add would leave less of the store's filesystem free than `--image-min-free` keeps
    /// ([`super::MinFree`]): refused before the bytes were written; nothing of it is kept.
    #[error("image {image}: {why}")]
    NoRoom { image: String, why: String },

    /// The add was cancelled (its caller went away, or its credential was revoked): nothing
    /// of it is kept.
    #[error("image {image}: the add was cancelled; nothing of it is kept")]
    Cancelled { image: String },

    /// A local file system operation failed.
    #[error("image {image}: {what}: {source}")]
    Io {
        image: String,
        what: String,
        #[source]
        source: std::io::Error,
    },
}

impl ImageError {
    pub fn io(image: &str, what: impl Into<String>, source: std::io::Error) -> Self {
        ImageError::Io {
            image: image.to_string(),
            what: what.into(),
            source,
        }
    }

    pub fn malformed(image: &str, why: impl Into<String>) -> Self {
        ImageError::Malformed {
            image: image.to_string(),
            why: why.into(),
        }
    }

    pub fn not_found(image: &str, why: impl Into<String>) -> Self {
        ImageError::NotFound {
            image: image.to_string(),
            why: why.into(),
        }
    }
}
