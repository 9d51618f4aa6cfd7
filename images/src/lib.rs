//! The OCI image store: the content of the images that `oci` sandboxes run.
//!
//! The gateway keeps image *records* (names, which manifest digest a name pins) in its own
//! store; this module keeps their *content* on disk, unpacked once per layer so that a sandbox's
//! root filesystem is an overlay of read-only layer directories. The gateway writes the store
//! ([`ImageStore::open`]: pull, import, gc); the oci driver only reads it
//! ([`ImageStore::open_read_only`]).
//!
//! # Layout
//!
//! ```text
//! <root>/                    e.g. DATA/images, mode 0700
//!   store.json               format version and the id map the layers were unpacked with
//!   blobs/sha256/<hex>       content-addressed blobs: manifests, configs, compressed layers
//!   layers/sha256/<diffhex>/ each layer unpacked once (by its diff_id), ready to be an overlay lowerdir
//!   tmp/                     in-progress downloads and unpacks; emptied at open
//! ```
//!
//! Nothing half-written is ever visible under `blobs/` or `layers/`: a blob is streamed to
//! `tmp/` while its sha256 is computed, checked against the digest it was asked for
//! ([`ImageError::DigestMismatch`] otherwise, and the bytes are dropped), fsynced and renamed
//! into place. A layer is unpacked into `tmp/unpack-<uuid>/`, its uncompressed sha256 checked
//! against the diff_id of the image config, the file system synced, and the directory renamed
//! into `layers/` (`RENAME_NOREPLACE`: when a concurrent pull got there first, ours is
//! discarded). A failed unpack removes its directory. Every image in the store has a manifest
//! blob, also those imported from a `docker save` archive or a root-filesystem tar (the store
//! writes one for them).
//!
//! # Ownership
//!
//! Sandboxes run in a user namespace whose uid 0 is host uid [`IdMap::host_uid`] (200000 by
//! default, 65536 ids). Every entry is unpacked with its owner shifted (host = base + id), so
//! the layers are owned right inside the sandbox without an idmapped mount; an id at or above
//! the map's size refuses the layer. The map is recorded in `store.json`, and opening the store
//! with another map is refused ([`ImageError::IdMapMismatch`]): the layers would have the wrong
//! owners.
//!
//! # Hostile input
//!
//! Layers come from registries and files nobody here controls. `unpack.rs` creates every entry
//! relative to directory fds opened without following symlinks and refuses a layer whose
//! entries would land outside it; see its docs for the rules. Manifests and configs are read
//! with a size cap ([`spec::MAX_JSON`], 16 MiB).
//!
//! # Overlay order
//!
//! [`ImageStore::layer_dirs`] lists the layers lowest (the base) first, as the manifest does.
//! overlayfs's `lowerdir=` wants the *highest* first: reverse the list. Whiteouts are overlay's
//! own format (a 0:0 character device; `trusted.overlay.opaque=y` on an opaque directory), so
//! the layers are meant for an overlay mounted by the host's root, not with `userxattr`.
//!
//! # Mirrors
//!
//! [`ImageStore::push`] copies an image to a registry every node can reach ([`Mirror`]), from
//! which a node's own store pulls it by digest; see `mirror.rs`.
//!
//! # Garbage collection
//!
//! [`ImageStore::remove_unreferenced`] keeps what the given manifests reach and what a
//! transfer under way holds, and removes the rest; it runs beside pulls and imports, never
//! waiting for one (see `transfer.rs`).
//!
//! # Free disk
//!
//! Every add takes what it writes from the store filesystem's free space first and is
//! refused before it would leave less than `--image-min-free` free (see `limits.rs`).
//!
//! # Dockerfile builds
//!
//! [`build`] holds a build's pure parts: the Dockerfile parsed into steps and the layer a
//! COPY makes from the build context. The build itself (sandboxes for RUN, the cache, the
//! records) is the `sbx-build` crate's, above the actors.

pub mod build;
mod busybox;
pub mod elf;
mod error;
/// Test fixtures (feature `fixtures`, which only dev-dependencies turn on: no daemon links
/// them).
#[cfg(any(test, feature = "fixtures"))]
pub mod fixtures;
mod limits;
pub use limits::ImageLimits;
pub use limits::{Budget, LayerMeter, MinFree, Room};
mod transfer;
pub use transfer::{Collection, Transfer};
mod import;
mod mirror;
mod pull;
mod spec;
mod unpack;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};

pub use elf::{BUSYBOX_PATHS, find_static_busybox};
pub use error::ImageError;
pub use mirror::{MIRROR_REPOSITORY, Mirror, PushReport};
pub use pull::client_protocol;
use spec::{Compression, ConfigFile, ContainerConfig, Descriptor, Document, Manifest};
pub use unpack::MergedEntry;

/// Where the sandbox's ids live on the host: container id N is host id base + N, for N < size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdMap {
    pub host_uid: u32,
    pub host_gid: u32,
    pub size: u32,
}

impl Default for IdMap {
    fn default() -> Self {
        IdMap {
            host_uid: 200_000,
            host_gid: 200_000,
            size: 65_536,
        }
    }
}

/// An image the store holds: its manifest digest, its config and its layers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    /// The manifest digest (`sha256:<hex>`): the image's identity.
    pub digest: String,
    pub config_digest: String,
    pub config: ImageConfig,
    /// Lowest (base) first.
    pub layers: Vec<LayerInfo>,
    /// The sum of the (compressed) layer sizes.
    pub size: u64,
    pub os: String,
    pub architecture: String,
}

/// What an image says about how to run it (the `config` object of the image config).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    pub working_dir: String,
    pub user: String,
    pub labels: BTreeMap<String, String>,
    /// `8080/tcp`, as EXPOSE says them.
    pub exposed_ports: Vec<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerInfo {
    /// The blob digest (of the compressed layer as stored).
    pub digest: String,
    /// The digest of the uncompressed tar: the name of its directory under `layers/`.
    pub diff_id: String,
    pub size: u64,
    pub media_type: String,
}

/// How to reach a registry.
#[derive(Debug, Clone, Default)]
pub struct PullOptions {
    /// Plain HTTP to any registry (loopback registries get it without this).
    pub insecure: bool,
    pub auth: RegistryAuth,
}

#[derive(Debug, Clone, Default)]
pub enum RegistryAuth {
    #[default]
    Anonymous,
    Basic {
        username: String,
        password: String,
    },
}

/// What a pull reports as it goes.
#[derive(Debug, Clone)]
pub enum PullProgress {
    /// The manifest is known: this many layers, this many compressed bytes in all.
    Resolved {
        digest: String,
        layers: usize,
        total_bytes: u64,
    },
    /// Bytes of a layer downloaded so far (reported at most every [`pull::PROGRESS_STEP`]
    /// bytes, and at the end).
    Layer {
        digest: String,
        done: u64,
        total: u64,
    },
    /// The layer was already in the store.
    LayerCached { digest: String, size: u64 },
    /// The layer is unpacked and in place.
    LayerUnpacked { digest: String },
}

/// One image an import brought in, with the name its source gave it (or the caller's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImportedImage {
    pub name: Option<String>,
    pub info: ImageInfo,
}

/// What [`ImageStore::remove_unreferenced`] removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub blobs_removed: usize,
    pub layers_removed: usize,
    pub bytes_freed: u64,
}

const STORE_FORMAT: u32 = 1;

#[derive(Debug, Serialize, Deserialize)]
struct StoreFile {
    format: u32,
    idmap: IdMap,
}

/// The on-disk image store. Cheap to clone; every clone is the same store.
#[derive(Debug, Clone)]
pub struct ImageStore {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    idmap: IdMap,
    read_only: bool,
    /// How large an image a pull or import may add ([`ImageStore::set_limits`]).
    limits: std::sync::Mutex<ImageLimits>,
    /// What the transfers under way hold from garbage collection (`transfer.rs`).
    holds: Arc<transfer::Holds>,
}

impl ImageStore {
    /// Opens (creating it when absent) the store at `root` for writing: pulls, imports and gc.
    /// Empties `tmp/` (what an interrupted pull left). Refuses a store recorded with another id
    /// map.
    pub fn open(root: PathBuf, idmap: IdMap) -> Result<ImageStore, ImageError> {
        let shown = root.display().to_string();
        let io = |what: &str, e| ImageError::io(&shown, what.to_string(), e);
        for dir in ["blobs/sha256", "layers/sha256", "tmp"] {
            std::fs::create_dir_all(root.join(dir)).map_err(|e| io("create the store", e))?;
        }
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| io("chmod the store to 0700", e))?;
        let store_file = root.join("store.json");
        match std::fs::read(&store_file) {
            Ok(bytes) => {
                let stored = parse_store_file(&root, &bytes)?;
                if stored.idmap != idmap {
                    return Err(ImageError::IdMapMismatch {
                        root,
                        stored: stored.idmap,
                        requested: idmap,
                    });
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let bytes = serde_json::to_vec_pretty(&StoreFile {
                    format: STORE_FORMAT,
                    idmap,
                })
                .map_err(|e| io("encode store.json", e.into()))?;
                let tmp = root
                    .join("tmp")
                    .join(format!("store-{}.json", uuid::Uuid::new_v4()));
                write_synced(&tmp, &bytes).map_err(|e| io("write store.json", e))?;
                std::fs::rename(&tmp, &store_file).map_err(|e| io("rename store.json", e))?;
                sync_dir(&root).map_err(|e| io("sync the store directory", e))?;
            }
            Err(e) => return Err(io("read store.json", e)),
        }
        let tmp = root.join("tmp");
        let entries = std::fs::read_dir(&tmp).map_err(|e| io("list tmp/", e))?;
        for entry in entries {
            let path = entry.map_err(|e| io("list tmp/", e))?.path();
            let removed = if path.is_dir() && !path.is_symlink() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            removed.map_err(|e| io(&format!("empty tmp/ ({})", path.display()), e))?;
        }
        Ok(ImageStore {
            inner: Arc::new(Inner {
                root,
                idmap,
                read_only: false,
                limits: std::sync::Mutex::new(ImageLimits::default()),
                holds: Default::default(),
            }),
        })
    }

    /// Opens an existing store to read it only (the oci driver): no `tmp/` cleanup, no writes;
    /// pull, import and gc answer [`ImageError::ReadOnly`].
    pub fn open_read_only(root: PathBuf) -> Result<ImageStore, ImageError> {
        let bytes = std::fs::read(root.join("store.json")).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                ImageError::not_found(
                    &root.display().to_string(),
                    "no store.json: not an image store (the gateway creates it)",
                )
            } else {
                ImageError::io(&root.display().to_string(), "read store.json", e)
            }
        })?;
        let stored = parse_store_file(&root, &bytes)?;
        Ok(ImageStore {
            inner: Arc::new(Inner {
                root,
                idmap: stored.idmap,
                read_only: true,
                limits: std::sync::Mutex::new(ImageLimits::default()),
                holds: Default::default(),
            }),
        })
    }

    /// How large an image a pull or import may add from now on.
    pub fn set_limits(&self, limits: ImageLimits) {
        *self.inner.limits.lock().unwrap_or_else(|p| p.into_inner()) = limits;
    }

    /// The limits a pull or import checks ([`ImageStore::set_limits`]).
    pub fn limits(&self) -> ImageLimits {
        *self.inner.limits.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    pub(crate) fn holds(&self) -> &Arc<transfer::Holds> {
        &self.inner.holds
    }

    /// The free space of the store's filesystem, for what an add of `image` writes (an upload
    /// spooled into `tmp/` too).
    pub fn room(&self, image: &str) -> Room {
        Room::new(image, self.root().to_path_buf(), self.limits().min_free)
    }

    /// A budget for `image` (the limits), taking each entry from the free space too and ending
    /// when `transfer` is cancelled.
    pub fn budget_for(&self, image: &str, transfer: &Transfer) -> Budget {
        self.limits()
            .budget(image)
            .watching(self.room(image), transfer.cancel_token().clone())
    }

    /// What the image's unpacked layers take on disk (allocated blocks, directories too; a
    /// layer shared with other images counts in each). Walks the layers: blocking.
    pub fn unpacked_size(&self, info: &ImageInfo) -> u64 {
        self.layer_dirs(info).iter().map(|d| disk_usage(d)).sum()
    }

    pub fn idmap(&self) -> IdMap {
        self.inner.idmap
    }

    /// The stored image with this manifest digest, with its layers checked to be unpacked.
    pub fn get(&self, manifest_digest: &str) -> Result<ImageInfo, ImageError> {
        let info = self.read_image(manifest_digest, manifest_digest)?;
        for layer in &info.layers {
            let dir = self.layer_dir(manifest_digest, &layer.diff_id)?;
            if !dir.is_dir() {
                return Err(ImageError::not_found(
                    manifest_digest,
                    format!(
                        "layer {} (diff_id {}) is not unpacked in {}",
                        layer.digest,
                        layer.diff_id,
                        self.root().display()
                    ),
                ));
            }
        }
        Ok(info)
    }

    /// Holds every blob and layer of the stored image `manifest_digest` for `transfer` (so
    /// that a record written for it finds it whole), then checks it is whole.
    pub fn hold_image(&self, manifest_digest: &str, transfer: &Transfer) -> Result<(), ImageError> {
        transfer.hold(manifest_digest);
        let info = self.read_image(manifest_digest, manifest_digest)?;
        transfer.hold(&info.config_digest);
        for layer in &info.layers {
            transfer.hold(&layer.digest);
            transfer.hold(&layer.diff_id);
        }
        self.get(manifest_digest).map(|_| ())
    }

    /// The unpacked layer directories of the image, lowest (base) first, as in the manifest.
    /// overlayfs's `lowerdir=` lists the highest first: reverse this for it.
    pub fn layer_dirs(&self, info: &ImageInfo) -> Vec<PathBuf> {
        info.layers
            .iter()
            .map(|l| {
                let hex = l.diff_id.strip_prefix("sha256:").unwrap_or(&l.diff_id);
                self.root().join("layers/sha256").join(hex)
            })
            .collect()
    }

    /// Removes every blob and layer directory that none of these manifests (the images still
    /// recorded) reaches and no transfer holds. A kept digest the store does not hold is
    /// skipped. Refused while another collection is under way. See [`Collection`] for the
    /// order a caller that reads its records must keep.
    pub fn remove_unreferenced(&self, keep: &[String]) -> Result<GcReport, ImageError> {
        self.writable("garbage collection")?;
        let Some(collection) = self.begin_collection() else {
            return Err(ImageError::InvalidArgument {
                image: self.root().display().to_string(),
                why: "a garbage collection is under way already".into(),
            });
        };
        collection.remove_unreferenced(keep)
    }

    /// The sweep of a [`Collection`].
    fn collect(&self, keep: &[String]) -> Result<GcReport, ImageError> {
        self.writable("garbage collection")?;
        let mut blobs = HashSet::new();
        let mut layers = HashSet::new();
        for digest in keep {
            let info = match self.read_image(digest, digest) {
                Ok(info) => info,
                Err(ImageError::NotFound { .. }) => {
                    tracing::warn!(image = %digest, "kept image is not in the store; nothing kept for it");
                    continue;
                }
                Err(e) => return Err(e),
            };
            blobs.insert(hex_of(&info.digest));
            blobs.insert(hex_of(&info.config_digest));
            for l in &info.layers {
                blobs.insert(hex_of(&l.digest));
                layers.insert(hex_of(&l.diff_id));
            }
        }
        let shown = self.root().display().to_string();
        let mut report = GcReport::default();
        for (dir, keep, is_layer) in [
            ("blobs/sha256", &blobs, false),
            ("layers/sha256", &layers, true),
        ] {
            let dir = self.root().join(dir);
            let entries = std::fs::read_dir(&dir)
                .map_err(|e| ImageError::io(&shown, format!("list {}", dir.display()), e))?;
            for entry in entries {
                let entry = entry
                    .map_err(|e| ImageError::io(&shown, format!("list {}", dir.display()), e))?;
                let name = entry.file_name().to_string_lossy().into_owned();
                if keep.contains(&name) {
                    continue;
                }
                let path = entry.path();
                // Out of place at once (a rename, under the holds' lock), then removed.
                let doomed = self.tmp_path("gc");
                let taken = self
                    .holds()
                    .take_unless_held(&name, || std::fs::rename(&path, &doomed))
                    .map_err(|e| ImageError::io(&shown, format!("remove {}", path.display()), e))?;
                if !taken {
                    continue;
                }
                let bytes = disk_usage(&doomed);
                let removed = if is_layer && !doomed.is_symlink() && doomed.is_dir() {
                    std::fs::remove_dir_all(&doomed)
                } else {
                    std::fs::remove_file(&doomed)
                };
                removed
                    .map_err(|e| ImageError::io(&shown, format!("remove {}", path.display()), e))?;
                report.bytes_freed += bytes;
                if is_layer {
                    report.layers_removed += 1;
                } else {
                    report.blobs_removed += 1;
                }
            }
        }
        tracing::info!(
            store = %shown,
            blobs = report.blobs_removed,
            layers = report.layers_removed,
            bytes = report.bytes_freed,
            "removed unreferenced image content"
        );
        Ok(report)
    }

    fn writable(&self, what: &str) -> Result<(), ImageError> {
        if self.inner.read_only {
            return Err(ImageError::ReadOnly {
                root: self.root().to_path_buf(),
                what: what.to_string(),
            });
        }
        Ok(())
    }

    fn blob_path(&self, image: &str, digest: &str) -> Result<PathBuf, ImageError> {
        Ok(self
            .root()
            .join("blobs/sha256")
            .join(spec::digest_hex(image, digest)?))
    }

    fn layer_dir(&self, image: &str, diff_id: &str) -> Result<PathBuf, ImageError> {
        Ok(self
            .root()
            .join("layers/sha256")
            .join(spec::digest_hex(image, diff_id)?))
    }

    fn has_blob(&self, image: &str, digest: &str) -> Result<bool, ImageError> {
        Ok(self.blob_path(image, digest)?.is_file())
    }

    fn tmp_path(&self, kind: &str) -> PathBuf {
        self.root()
            .join("tmp")
            .join(format!("{kind}-{}", uuid::Uuid::new_v4()))
    }

    /// A writer for a new blob in `tmp/`, of `transfer`; [`BlobWriter::commit`] puts it in
    /// place.
    fn blob_writer(&self, image: &str, transfer: &Transfer) -> Result<BlobWriter, ImageError> {
        self.writable("writing a blob")?;
        transfer.check(image)?;
        let path = self.tmp_path("blob");
        let file = File::create_new(&path)
            .map_err(|e| ImageError::io(image, format!("create {}", path.display()), e))?;
        Ok(BlobWriter {
            store: self.clone(),
            image: image.to_string(),
            file: Some(file),
            path,
            hasher: Sha256::new(),
            size: 0,
            room: self.room(image),
            transfer: transfer.clone(),
            refused: None,
        })
    }

    /// Streams `reader` into a blob; `expected` is the digest it must have (None: whatever it
    /// hashes to). Returns the digest and size.
    fn store_blob(
        &self,
        image: &str,
        reader: &mut dyn Read,
        expected: Option<&str>,
        transfer: &Transfer,
    ) -> Result<(String, u64), ImageError> {
        if let Some(d) = expected {
            spec::digest_hex(image, d)?;
        }
        let mut w = self.blob_writer(image, transfer)?;
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            let n = match reader.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(ImageError::malformed(
                        image,
                        format!("reading {}: {e}", expected.unwrap_or("a blob")),
                    ));
                }
            };
            w.put(&buf[..n], expected.unwrap_or("a blob"))?;
        }
        w.commit(expected)
    }

    fn store_bytes(
        &self,
        image: &str,
        bytes: &[u8],
        expected: Option<&str>,
        transfer: &Transfer,
    ) -> Result<String, ImageError> {
        self.store_blob(image, &mut &bytes[..], expected, transfer)
            .map(|(d, _)| d)
    }

    /// Whether the blob is stored, held by `transfer` first (so that it stays once found).
    fn holds_blob(
        &self,
        image: &str,
        digest: &str,
        transfer: &Transfer,
    ) -> Result<bool, ImageError> {
        transfer.hold(digest);
        self.has_blob(image, digest)
    }

    /// Whether the layer is unpacked, held by `transfer` first.
    fn holds_layer(
        &self,
        image: &str,
        diff_id: &str,
        transfer: &Transfer,
    ) -> Result<bool, ImageError> {
        transfer.hold(diff_id);
        Ok(self.layer_dir(image, diff_id)?.is_dir())
    }

    /// A JSON blob (manifest or config) from the store, at most [`spec::MAX_JSON`] bytes.
    fn read_json_blob(&self, image: &str, digest: &str) -> Result<Vec<u8>, ImageError> {
        let path = self.blob_path(image, digest)?;
        let file = File::open(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                ImageError::not_found(
                    image,
                    format!("blob {digest} is not in {}", self.root().display()),
                )
            } else {
                ImageError::io(image, format!("open blob {digest}"), e)
            }
        })?;
        read_capped(image, digest, file)
    }

    /// The image whose manifest blob has this digest, as the store holds it.
    fn read_image(&self, image: &str, digest: &str) -> Result<ImageInfo, ImageError> {
        let bytes = self.read_json_blob(image, digest)?;
        let Document::Image(manifest) = spec::parse_document(image, &bytes)? else {
            return Err(ImageError::malformed(
                image,
                format!("{digest} is an index, not an image manifest"),
            ));
        };
        let config_bytes = self.read_json_blob(image, &manifest.config.digest)?;
        let config = spec::parse_config(image, &config_bytes)?;
        image_info(image, digest, &manifest, &config)
    }

    /// Unpacks the layer blob `blob` into `layers/`, unless a layer with `expected_diff_id` is
    /// already there. Returns the diff_id (the sha256 of the uncompressed tar).
    fn unpack_layer(
        &self,
        image: &str,
        blob: &str,
        compression: Compression,
        expected_diff_id: Option<&str>,
        budget: &mut Budget,
        transfer: &Transfer,
    ) -> Result<String, ImageError> {
        self.writable("unpacking a layer")?;
        transfer.check(image)?;
        if let Some(diff_id) = expected_diff_id
            && self.holds_layer(image, diff_id, transfer)?
        {
            return Ok(diff_id.to_string());
        }
        let blob_path = self.blob_path(image, blob)?;
        let file = File::open(&blob_path)
            .map_err(|e| ImageError::io(image, format!("open layer blob {blob}"), e))?;
        let tmp = self.tmp_path("unpack");
        let result = (|| {
            std::fs::create_dir(&tmp)
                .map_err(|e| ImageError::io(image, format!("create {}", tmp.display()), e))?;
            let decoded = compression
                .reader(std::io::BufReader::new(file))
                .map_err(|e| ImageError::malformed(image, format!("layer {blob}: {e}")))?;
            let mut hashing = HashingReader {
                inner: decoded,
                hasher: Sha256::new(),
            };
            let layer = unpack::Layer {
                image,
                digest: blob,
                idmap: self.idmap(),
                cancel: Some(transfer.cancel_token()),
            };
            let stats = unpack::unpack(&layer, &mut hashing, &tmp, budget)?;
            // The tar's end-of-archive blocks and anything after them count for the diff_id,
            // and a truncated compressed stream shows here if not before.
            std::io::copy(&mut hashing, &mut std::io::sink()).map_err(|e| {
                ImageError::malformed(
                    image,
                    format!("layer {blob}: reading past the tar's end: {e}"),
                )
            })?;
            let diff_id = format!("sha256:{}", hex::encode(hashing.hasher.finalize()));
            if let Some(expected) = expected_diff_id
                && expected != diff_id
            {
                return Err(ImageError::DigestMismatch {
                    image: format!("{image} (layer {blob}, uncompressed)"),
                    expected: expected.to_string(),
                    actual: diff_id,
                });
            }
            if stats.devices_skipped > 0 {
                tracing::info!(
                    image,
                    layer = blob,
                    devices = stats.devices_skipped,
                    "device nodes in the layer were not created"
                );
            }
            let dir = std::fs::File::open(&tmp)
                .map_err(|e| ImageError::io(image, "open the unpacked layer", e))?;
            nix::unistd::syncfs(&dir)
                .map_err(|e| ImageError::io(image, "sync the unpacked layer", e.into()))?;
            Ok(diff_id)
        })();
        let diff_id = match result {
            Ok(d) => d,
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(e);
            }
        };
        let target = self.layer_dir(image, &diff_id)?;
        // Held before it is in place; nothing is put in place once the add is cancelled.
        transfer.hold(&diff_id);
        if let Err(e) = transfer.check(image) {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        match renameat2(
            AT_FDCWD,
            &tmp,
            AT_FDCWD,
            &target,
            RenameFlags::RENAME_NOREPLACE,
        ) {
            Ok(()) => {
                sync_dir(&self.root().join("layers/sha256"))
                    .map_err(|e| ImageError::io(image, "sync layers/", e))?;
            }
            Err(Errno::EEXIST | Errno::ENOTEMPTY) => {
                // Another pull unpacked the same layer meanwhile: theirs is as good as ours.
                let _ = std::fs::remove_dir_all(&tmp);
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(ImageError::io(
                    image,
                    format!("rename the layer into {}", target.display()),
                    e.into(),
                ));
            }
        }
        Ok(diff_id)
    }

    /// Stores the manifest bytes and returns the image they describe (its config and layer
    /// blobs must be stored already).
    fn finish_image(
        &self,
        image: &str,
        manifest_bytes: &[u8],
        transfer: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        let digest = self.store_bytes(image, manifest_bytes, None, transfer)?;
        self.read_image(image, &digest)
    }

    /// Writes the config and manifest of a one-layer image whose layer blob and directory are
    /// already stored (root-filesystem tars and the busybox image).
    fn single_layer_image(
        &self,
        image: &str,
        layer: Descriptor,
        diff_id: String,
        config: ContainerConfig,
        transfer: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        let config = ConfigFile {
            architecture: "amd64".into(),
            os: "linux".into(),
            config: Some(config),
            rootfs: spec::RootFs {
                kind: "layers".into(),
                diff_ids: vec![diff_id],
            },
        };
        let config_bytes =
            serde_json::to_vec(&config).map_err(|e| ImageError::malformed(image, e.to_string()))?;
        self.write_manifest(image, &config_bytes, vec![layer], transfer)
    }

    /// A new image: `parent`'s layers (none: an image from scratch), then `layer` when given
    /// (an uncompressed layer tar in a file, stored as a blob and unpacked as every layer is),
    /// run as `config` says. Blocking: call it from `spawn_blocking`.
    pub fn derive(
        &self,
        image: &str,
        parent: Option<&ImageInfo>,
        layer: Option<&Path>,
        config: &ImageConfig,
    ) -> Result<ImageInfo, ImageError> {
        let transfer = self.transfer(Default::default());
        self.derive_with(image, parent, layer, config, &transfer)
    }

    /// [`ImageStore::derive`] as `transfer`: what it writes and uses is held until it ends,
    /// and it stops once cancelled.
    pub fn derive_with(
        &self,
        image: &str,
        parent: Option<&ImageInfo>,
        layer: Option<&Path>,
        config: &ImageConfig,
        transfer: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        self.writable("building an image")?;
        transfer.check(image)?;
        let mut layers: Vec<Descriptor> = Vec::new();
        let mut diff_ids: Vec<String> = Vec::new();
        if let Some(parent) = parent {
            for l in &parent.layers {
                // The parent's content is this image's too: it stays while the add runs.
                transfer.hold(&l.digest);
                transfer.hold(&l.diff_id);
                layers.push(Descriptor::new(&l.media_type, l.digest.clone(), l.size));
                diff_ids.push(l.diff_id.clone());
            }
        }
        if let Some(path) = layer {
            let mut file =
                File::open(path).map_err(|e| ImageError::io(image, "open the new layer", e))?;
            let (digest, size) = self.store_blob(image, &mut file, None, transfer)?;
            let mut budget = self.budget_for(image, transfer);
            let diff_id = self.unpack_layer(
                image,
                &digest,
                Compression::None,
                None,
                &mut budget,
                transfer,
            )?;
            layers.push(Descriptor::new(spec::LAYER_TAR, digest, size));
            diff_ids.push(diff_id);
        }
        self.limits().check_layers(image, layers.len())?;
        // The whole image counts, its parent's layers too.
        let sizes: Vec<u64> = layers.iter().map(|l| l.size).collect();
        self.limits().check_manifest(image, &sizes)?;
        let listed = |v: &Vec<String>| (!v.is_empty()).then(|| v.clone());
        let file = ConfigFile {
            architecture: parent.map_or("amd64", |p| p.architecture.as_str()).into(),
            os: "linux".into(),
            config: Some(ContainerConfig {
                env: listed(&config.env),
                entrypoint: listed(&config.entrypoint),
                cmd: listed(&config.cmd),
                working_dir: (!config.working_dir.is_empty()).then(|| config.working_dir.clone()),
                user: (!config.user.is_empty()).then(|| config.user.clone()),
                labels: (!config.labels.is_empty()).then(|| config.labels.clone()),
                exposed_ports: (!config.exposed_ports.is_empty()).then(|| {
                    config
                        .exposed_ports
                        .iter()
                        .map(|p| (p.clone(), serde_json::json!({})))
                        .collect()
                }),
            }),
            rootfs: spec::RootFs {
                kind: "layers".into(),
                diff_ids,
            },
        };
        let config_bytes =
            serde_json::to_vec(&file).map_err(|e| ImageError::malformed(image, e.to_string()))?;
        self.write_manifest(image, &config_bytes, layers, transfer)
    }

    /// What `path` (absolute, inside the image) is in `info`'s merged root filesystem, or
    /// None. Refused (InvalidArgument) when an ancestor is a symlink: the path is not one the
    /// image holds as written.
    pub fn lookup(&self, info: &ImageInfo, path: &str) -> Result<Option<MergedEntry>, ImageError> {
        let mut layers = self.layer_dirs(info);
        layers.reverse();
        let parts: Vec<&std::ffi::OsStr> = Path::new(path)
            .components()
            .filter_map(|c| match c {
                std::path::Component::Normal(p) => Some(p),
                _ => None,
            })
            .collect();
        unpack::merged_lookup(&layers, &parts, self.idmap()).map_err(|at| {
            ImageError::InvalidArgument {
                image: info.digest.clone(),
                why: format!("{at} is a symlink in the image; name the path it points to"),
            }
        })
    }

    /// Stores an image config and an OCI manifest for it and these (stored) layers.
    fn write_manifest(
        &self,
        image: &str,
        config_bytes: &[u8],
        layers: Vec<Descriptor>,
        transfer: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        let config_digest = self.store_bytes(image, config_bytes, None, transfer)?;
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(spec::OCI_MANIFEST.into()),
            config: Descriptor::new(spec::OCI_CONFIG, config_digest, config_bytes.len() as u64),
            layers,
        };
        let bytes = serde_json::to_vec(&manifest)
            .map_err(|e| ImageError::malformed(image, e.to_string()))?;
        self.finish_image(image, &bytes, transfer)
    }
}

fn parse_store_file(root: &Path, bytes: &[u8]) -> Result<StoreFile, ImageError> {
    let shown = root.display().to_string();
    let stored: StoreFile = serde_json::from_slice(bytes)
        .map_err(|e| ImageError::malformed(&shown, format!("store.json: {e}")))?;
    if stored.format != STORE_FORMAT {
        return Err(ImageError::malformed(
            &shown,
            format!(
                "store.json has format {}, this build knows {STORE_FORMAT}",
                stored.format
            ),
        ));
    }
    Ok(stored)
}

/// The public description of a stored image.
fn image_info(
    image: &str,
    digest: &str,
    manifest: &Manifest,
    config: &ConfigFile,
) -> Result<ImageInfo, ImageError> {
    let diff_ids = &config.rootfs.diff_ids;
    if diff_ids.len() != manifest.layers.len() {
        return Err(ImageError::malformed(
            image,
            format!(
                "manifest has {} layers but the config {} diff_ids",
                manifest.layers.len(),
                diff_ids.len()
            ),
        ));
    }
    let layers = manifest
        .layers
        .iter()
        .zip(diff_ids)
        .map(|(l, diff_id)| LayerInfo {
            digest: l.digest.clone(),
            diff_id: diff_id.clone(),
            size: l.size,
            media_type: l.media_type.clone(),
        })
        .collect::<Vec<_>>();
    let c = config.config.clone().unwrap_or_default();
    Ok(ImageInfo {
        digest: digest.to_string(),
        config_digest: manifest.config.digest.clone(),
        size: layers.iter().map(|l| l.size).sum(),
        layers,
        config: ImageConfig {
            env: c.env.unwrap_or_default(),
            entrypoint: c.entrypoint.unwrap_or_default(),
            cmd: c.cmd.unwrap_or_default(),
            working_dir: c.working_dir.unwrap_or_default(),
            user: c.user.unwrap_or_default(),
            labels: c.labels.unwrap_or_default(),
            exposed_ports: c
                .exposed_ports
                .map(|p| p.into_keys().collect())
                .unwrap_or_default(),
        },
        os: config.os.clone(),
        architecture: config.architecture.clone(),
    })
}

/// A blob being written to `tmp/` while it is hashed, each chunk taken from the store's free
/// space first. Dropped without [`Self::commit`], it removes its file.
struct BlobWriter {
    store: ImageStore,
    image: String,
    file: Option<File>,
    path: PathBuf,
    hasher: Sha256,
    size: u64,
    room: Room,
    transfer: Transfer,
    /// Why a write through [`Write`] was refused (no room, cancelled), for the caller.
    refused: Option<ImageError>,
}

impl Write for BlobWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Err(e) = self.guard(buf.len() as u64, "a blob") {
            let shown = e.to_string();
            self.refused = Some(e);
            return Err(std::io::Error::other(shown));
        }
        let file = self
            .file
            .as_mut()
            .ok_or_else(|| std::io::Error::other("blob already committed"))?;
        let n = file.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl BlobWriter {
    /// The add goes on, and the store's filesystem has room for `bytes` more of `what`.
    fn guard(&mut self, bytes: u64, what: &str) -> Result<(), ImageError> {
        self.transfer.check(&self.image)?;
        self.room.take(bytes, what)
    }

    /// Writes `buf` of `what` (a blob's digest): refused when cancelled or out of room.
    fn put(&mut self, buf: &[u8], what: &str) -> Result<(), ImageError> {
        self.guard(buf.len() as u64, what)?;
        let file = self.file.as_mut().ok_or_else(|| {
            ImageError::io(
                &self.image,
                "write a blob",
                std::io::Error::other("blob already committed"),
            )
        })?;
        file.write_all(buf)
            .map_err(|e| ImageError::io(&self.image, "write a blob to tmp/", e))?;
        self.hasher.update(buf);
        self.size += buf.len() as u64;
        Ok(())
    }

    /// What a failed [`Write`] call was: the refusal it stashed, else `e`.
    fn failure(&mut self, what: &str, e: std::io::Error) -> ImageError {
        self.refused
            .take()
            .unwrap_or_else(|| ImageError::io(&self.image, what.to_string(), e))
    }

    /// Checks the digest, fsyncs, and renames the blob into `blobs/` (a blob already there is
    /// the same content: ours is dropped). Returns the digest and size.
    fn commit(mut self, expected: Option<&str>) -> Result<(String, u64), ImageError> {
        let image = self.image.clone();
        let digest = format!(
            "sha256:{}",
            hex::encode(std::mem::take(&mut self.hasher).finalize())
        );
        if let Some(expected) = expected
            && expected != digest
        {
            return Err(ImageError::DigestMismatch {
                image,
                expected: expected.to_string(),
                actual: digest,
            });
        }
        let file = self.file.take().expect("a blob is committed once");
        file.sync_all()
            .map_err(|e| ImageError::io(&image, "fsync a blob", e))?;
        drop(file);
        let target = self.store.blob_path(&image, &digest)?;
        // Held before it is in place; nothing is put in place once the add is cancelled.
        self.transfer.hold(&digest);
        self.transfer.check(&image)?;
        match renameat2(
            AT_FDCWD,
            &self.path,
            AT_FDCWD,
            &target,
            RenameFlags::RENAME_NOREPLACE,
        ) {
            Ok(()) => {
                sync_dir(&self.store.root().join("blobs/sha256"))
                    .map_err(|e| ImageError::io(&image, "sync blobs/", e))?;
            }
            Err(Errno::EEXIST) => {}
            Err(e) => {
                return Err(ImageError::io(
                    &image,
                    format!("rename blob {digest} into place"),
                    e.into(),
                ));
            }
        }
        Ok((digest, self.size))
    }
}

impl Drop for BlobWriter {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Reads at most [`spec::MAX_JSON`] bytes; more is malformed.
fn read_capped(image: &str, what: &str, r: impl Read) -> Result<Vec<u8>, ImageError> {
    let mut bytes = Vec::new();
    r.take(spec::MAX_JSON + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| ImageError::io(image, format!("read {what}"), e))?;
    if bytes.len() as u64 > spec::MAX_JSON {
        return Err(ImageError::malformed(
            image,
            format!("{what} is larger than {} MiB", spec::MAX_JSON >> 20),
        ));
    }
    Ok(bytes)
}

fn hex_of(digest: &str) -> String {
    digest.strip_prefix("sha256:").unwrap_or(digest).to_string()
}

fn write_synced(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let mut f = File::create_new(path)?;
    f.write_all(bytes)?;
    f.sync_all()
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// What `path` and everything under it take on disk (allocated blocks), not following
/// symlinks.
fn disk_usage(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    let own = meta.blocks().saturating_mul(512);
    if !meta.is_dir() {
        return own;
    }
    own + std::fs::read_dir(path)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| disk_usage(&e.path()))
                .sum::<u64>()
        })
        .unwrap_or(0)
}
