//! [`ImageStore::import`]: images from files, in the three forms people have them in.
//!
//! The form is told by content, never by file name:
//! - a directory with `index.json`, or a tar with `index.json` at its top: an OCI image layout
//!   (`skopeo copy … oci:DIR`, `docker save` of Docker 25+, which also has a `manifest.json`);
//! - a tar with `manifest.json` at its top: a `docker save` archive;
//! - any other tar: a root filesystem, imported as a one-layer image.
//!
//! Each may be gzip or zstd compressed (told by magic bytes). A compressed archive of the first
//! two kinds is decompressed into `tmp/` first, since its blobs are read out of order; a
//! compressed root filesystem is stored as it is (its blob is the compressed file).

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::spec::{self, Compression, ContainerConfig, Descriptor, Document};
use super::{ImageError, ImageInfo, ImageStore, ImportedImage, Transfer, read_capped, unpack};

/// How deep image indexes may nest (an index of indexes of manifests is 2; real ones are 1).
const MAX_INDEX_DEPTH: usize = 4;

/// Where an OCI layout's files are read from.
trait Source {
    /// The file at this path inside the layout (`index.json`, `blobs/sha256/<hex>`), or None.
    fn open(&self, name: &str) -> std::io::Result<Option<Box<dyn Read + '_>>>;
}

struct DirSource {
    root: PathBuf,
}

impl Source for DirSource {
    fn open(&self, name: &str) -> std::io::Result<Option<Box<dyn Read + '_>>> {
        match File::open(self.root.join(name)) {
            Ok(f) => Ok(Some(Box::new(f))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    }
}

/// An uncompressed tar, indexed once: every regular file's data offset and size by its path.
struct TarSource {
    path: PathBuf,
    files: HashMap<String, (u64, u64)>,
}

impl TarSource {
    fn index(image: &str, path: &Path) -> Result<TarSource, ImageError> {
        let file = File::open(path).map_err(|e| ImageError::io(image, "open the archive", e))?;
        let mut archive = tar::Archive::new(file);
        let entries = archive
            .entries_with_seek()
            .map_err(|e| ImageError::malformed(image, format!("not a tar archive: {e}")))?;
        let mut files = HashMap::new();
        for entry in entries {
            let entry =
                entry.map_err(|e| ImageError::malformed(image, format!("reading the tar: {e}")))?;
            if !matches!(
                entry.header().entry_type(),
                tar::EntryType::Regular | tar::EntryType::Continuous
            ) {
                continue;
            }
            let Ok(rel) = unpack::normalize(&entry.path_bytes()) else {
                continue;
            };
            let key = rel
                .iter()
                .map(|c| c.to_string_lossy())
                .collect::<Vec<_>>()
                .join("/");
            files.insert(key, (entry.raw_file_position(), entry.size()));
        }
        Ok(TarSource {
            path: path.to_path_buf(),
            files,
        })
    }

    fn has(&self, name: &str) -> bool {
        self.files.contains_key(name)
    }
}

impl Source for TarSource {
    fn open(&self, name: &str) -> std::io::Result<Option<Box<dyn Read + '_>>> {
        let key = name.strip_prefix("./").unwrap_or(name);
        let Some(&(offset, size)) = self.files.get(key) else {
            return Ok(None);
        };
        let mut f = File::open(&self.path)?;
        f.seek(SeekFrom::Start(offset))?;
        Ok(Some(Box::new(f.take(size))))
    }
}

/// The archive forms, as told by the names at the top of a tar.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Form {
    OciLayout,
    DockerArchive,
    RootFs,
}

#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct DockerEntry {
    config: String,
    #[serde(default)]
    repo_tags: Option<Vec<String>>,
    layers: Vec<String>,
}

impl ImageStore {
    /// Imports a file: an OCI image layout (a directory or a tar of one), a `docker save`
    /// archive, or a plain root-filesystem tar (optionally gzip/zstd compressed). Blocking:
    /// call it from `spawn_blocking`.
    ///
    /// `name` overrides (or, for a root-filesystem tar, which has none, sets) the name of every
    /// image imported; otherwise a docker archive's `RepoTags` (one [`ImportedImage`] per tag)
    /// and an OCI layout's `org.opencontainers.image.ref.name` annotations name them, and an
    /// image without one has `name: None`.
    pub fn import(
        &self,
        path: &Path,
        name: Option<&str>,
    ) -> Result<Vec<ImportedImage>, ImageError> {
        let transfer = self.transfer(Default::default());
        self.import_with(path, name, &transfer)
    }

    /// [`ImageStore::import`] as `transfer`: what it writes and uses is held until it ends,
    /// and it stops once cancelled.
    pub fn import_with(
        &self,
        path: &Path,
        name: Option<&str>,
        t: &Transfer,
    ) -> Result<Vec<ImportedImage>, ImageError> {
        self.writable("import")?;
        // How errors name the import: the name it is given, else its file — except a file of
        // the store's own (an upload spooled in tmp/), whose host path is nobody's business.
        let image = match name {
            Some(name) => name.to_string(),
            None if path.starts_with(self.root()) => "the uploaded image".to_string(),
            None => path.display().to_string(),
        };
        let meta =
            std::fs::metadata(path).map_err(|e| ImageError::io(&image, "stat the import", e))?;
        if meta.is_dir() {
            return self.import_layout(
                &image,
                &DirSource {
                    root: path.to_path_buf(),
                },
                name,
                t,
            );
        }
        let mut head = [0u8; 4];
        let n = File::open(path)
            .and_then(|mut f| f.read(&mut head))
            .map_err(|e| ImageError::io(&image, "read the import", e))?;
        match Compression::sniff(&head[..n]) {
            Compression::None => {
                let tar = TarSource::index(&image, path)?;
                self.import_tar(&image, path, &tar, Compression::None, name, t)
            }
            compression => {
                let file =
                    File::open(path).map_err(|e| ImageError::io(&image, "open the import", e))?;
                let form = scan_form(&image, compression, file)?;
                if form == Form::RootFs {
                    return self.import_rootfs(&image, path, compression, name, t);
                }
                // Decompress, to read the blobs in the order the manifests name them.
                let tmp = self.tmp_path("import");
                let result = (|| {
                    let file = File::open(path)
                        .map_err(|e| ImageError::io(&image, "open the import", e))?;
                    let mut decoded = compression
                        .reader(std::io::BufReader::new(file))
                        .map_err(|e| ImageError::malformed(&image, e.to_string()))?;
                    let mut out = File::create_new(&tmp).map_err(|e| {
                        ImageError::io(&image, format!("create {}", tmp.display()), e)
                    })?;
                    // Paid for from the free space as it is written (a bomb is refused).
                    let mut room = self.room(&image);
                    let mut buf = vec![0u8; 256 * 1024];
                    loop {
                        let n = match decoded.read(&mut buf) {
                            Ok(0) => break,
                            Ok(n) => n,
                            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                            Err(e) => {
                                return Err(ImageError::malformed(
                                    &image,
                                    format!("decompressing: {e}"),
                                ));
                            }
                        };
                        t.check(&image)?;
                        room.take(n as u64, "the decompressed archive")?;
                        out.write_all(&buf[..n]).map_err(|e| {
                            ImageError::io(&image, format!("write {}", tmp.display()), e)
                        })?;
                    }
                    let tar = TarSource::index(&image, &tmp)?;
                    self.import_tar(&image, &tmp, &tar, Compression::None, name, t)
                })();
                let _ = std::fs::remove_file(&tmp);
                result
            }
        }
    }

    fn import_tar(
        &self,
        image: &str,
        path: &Path,
        tar: &TarSource,
        compression: Compression,
        name: Option<&str>,
        t: &Transfer,
    ) -> Result<Vec<ImportedImage>, ImageError> {
        if tar.has("index.json") {
            self.import_layout(image, tar, name, t)
        } else if tar.has("manifest.json") {
            self.import_docker(image, tar, name, t)
        } else {
            self.import_rootfs(image, path, compression, name, t)
        }
    }

    fn import_layout(
        &self,
        image: &str,
        src: &dyn Source,
        name: Option<&str>,
        t: &Transfer,
    ) -> Result<Vec<ImportedImage>, ImageError> {
        let index_bytes = read_source_json(image, src, "index.json")?;
        let Document::Index(index) = spec::parse_document(image, &index_bytes)? else {
            return Err(ImageError::malformed(
                image,
                "index.json is not an image index",
            ));
        };
        if index.manifests.is_empty() {
            return Err(ImageError::malformed(image, "index.json lists no images"));
        }
        let mut out = Vec::new();
        for desc in &index.manifests {
            let ref_name = desc
                .annotations
                .as_ref()
                .and_then(|a| a.get(spec::REF_NAME))
                .cloned();
            let info = self.ingest_from_source(image, src, desc, 0, t)?;
            out.push(ImportedImage {
                name: name.map(str::to_string).or(ref_name),
                info,
            });
        }
        Ok(out)
    }

    /// Stores the image (or the linux/amd64 image of the index) that `desc` names, with its
    /// config and layers, from an OCI layout.
    fn ingest_from_source(
        &self,
        image: &str,
        src: &dyn Source,
        desc: &Descriptor,
        depth: usize,
        t: &Transfer,
    ) -> Result<ImageInfo, ImageError> {
        if depth > MAX_INDEX_DEPTH {
            return Err(ImageError::malformed(
                image,
                format!("image indexes nest deeper than {MAX_INDEX_DEPTH}"),
            ));
        }
        if let Some(p) = &desc.platform {
            spec::runnable_here(image, &p.os, &p.architecture)?;
        }
        let bytes = read_verified_blob(image, src, &desc.digest)?;
        let manifest = match spec::parse_document(image, &bytes)? {
            Document::Index(index) => {
                let chosen = spec::choose_platform(image, &index)?;
                return self.ingest_from_source(image, src, chosen, depth + 1, t);
            }
            Document::Image(m) => m,
        };
        let limits = self.limits();
        let claimed: Vec<u64> = manifest.layers.iter().map(|l| l.size).collect();
        limits.check_manifest(image, &claimed)?;
        let mut budget = self.budget_for(image, t);
        let config_bytes = read_verified_blob(image, src, &manifest.config.digest)?;
        self.store_bytes(image, &config_bytes, Some(&manifest.config.digest), t)?;
        let config = spec::parse_config(image, &config_bytes)?;
        spec::runnable_here(image, &config.os, &config.architecture)?;
        if config.rootfs.diff_ids.len() != manifest.layers.len() {
            return Err(ImageError::malformed(
                image,
                format!(
                    "manifest {} has {} layers but its config {} diff_ids",
                    desc.digest,
                    manifest.layers.len(),
                    config.rootfs.diff_ids.len()
                ),
            ));
        }
        for (layer, diff_id) in manifest.layers.iter().zip(&config.rootfs.diff_ids) {
            let compression = Compression::from_media_type(image, &layer.media_type)?;
            if !self.holds_blob(image, &layer.digest, t)? {
                let mut r = open_blob(image, src, &layer.digest)?;
                let (_, size) = self.store_blob(image, &mut r, Some(&layer.digest), t)?;
                if size != layer.size {
                    return Err(ImageError::malformed(
                        image,
                        format!(
                            "its manifest says layer {} is {} bytes; it is {size}",
                            layer.digest, layer.size
                        ),
                    ));
                }
            }
            if self.holds_layer(image, diff_id, t)? {
                budget.take_cached(layer.size)?;
            }
            self.unpack_layer(
                image,
                &layer.digest,
                compression,
                Some(diff_id),
                &mut budget,
                t,
            )?;
        }
        self.finish_image(image, &bytes, t)
    }

    fn import_docker(
        &self,
        image: &str,
        tar: &TarSource,
        name: Option<&str>,
        t: &Transfer,
    ) -> Result<Vec<ImportedImage>, ImageError> {
        let bytes = read_source_json(image, tar, "manifest.json")?;
        let entries: Vec<DockerEntry> = serde_json::from_slice(&bytes)
            .map_err(|e| ImageError::malformed(image, format!("manifest.json: {e}")))?;
        if entries.is_empty() {
            return Err(ImageError::malformed(
                image,
                "manifest.json lists no images",
            ));
        }
        let mut out = Vec::new();
        let limits = self.limits();
        for entry in entries {
            limits.check_layers(image, entry.layers.len())?;
            let mut budget = self.budget_for(image, t);
            let config_bytes = read_source_json(image, tar, &entry.config)?;
            let config = spec::parse_config(image, &config_bytes)?;
            spec::runnable_here(image, &config.os, &config.architecture)?;
            if config.rootfs.diff_ids.len() != entry.layers.len() {
                return Err(ImageError::malformed(
                    image,
                    format!(
                        "{} names {} layers but its config {} diff_ids",
                        entry.config,
                        entry.layers.len(),
                        config.rootfs.diff_ids.len()
                    ),
                ));
            }
            let mut layers = Vec::new();
            for (path, diff_id) in entry.layers.iter().zip(&config.rootfs.diff_ids) {
                let mut r = tar
                    .open(path)
                    .map_err(|e| ImageError::io(image, format!("read layer {path}"), e))?
                    .ok_or_else(|| {
                        ImageError::malformed(
                            image,
                            format!("manifest.json names layer {path:?}, which the archive lacks"),
                        )
                    })?;
                let (digest, size) = self.store_blob(image, &mut r, None, t)?;
                let compression = self.sniff_blob(image, &digest)?;
                if self.holds_layer(image, diff_id, t)? {
                    budget.take_cached(size)?;
                }
                self.unpack_layer(image, &digest, compression, Some(diff_id), &mut budget, t)?;
                layers.push(Descriptor::new(compression.media_type(), digest, size));
            }
            let info = self.write_manifest(image, &config_bytes, layers, t)?;
            let names: Vec<Option<String>> = match (name, entry.repo_tags) {
                (Some(n), _) => vec![Some(n.to_string())],
                (None, Some(tags)) if !tags.is_empty() => tags.into_iter().map(Some).collect(),
                (None, _) => vec![None],
            };
            out.extend(names.into_iter().map(|name| ImportedImage {
                name,
                info: info.clone(),
            }));
        }
        Ok(out)
    }

    fn import_rootfs(
        &self,
        image: &str,
        path: &Path,
        compression: Compression,
        name: Option<&str>,
        t: &Transfer,
    ) -> Result<Vec<ImportedImage>, ImageError> {
        let Some(name) = name else {
            return Err(ImageError::InvalidArgument {
                image: image.to_string(),
                why: "a root-filesystem tar has no name of its own: give the image a name".into(),
            });
        };
        let mut file = File::open(path).map_err(|e| ImageError::io(image, "open the import", e))?;
        let (digest, size) = self.store_blob(image, &mut file, None, t)?;
        let mut budget = self.budget_for(image, t);
        let diff_id = self.unpack_layer(image, &digest, compression, None, &mut budget, t)?;
        let layer = Descriptor::new(compression.media_type(), digest, size);
        let info = self.single_layer_image(image, layer, diff_id, default_config(), t)?;
        Ok(vec![ImportedImage {
            name: Some(name.to_string()),
            info,
        }])
    }

    fn sniff_blob(&self, image: &str, digest: &str) -> Result<Compression, ImageError> {
        let mut head = [0u8; 4];
        let n = File::open(self.blob_path(image, digest)?)
            .and_then(|mut f| f.read(&mut head))
            .map_err(|e| ImageError::io(image, format!("read blob {digest}"), e))?;
        Ok(Compression::sniff(&head[..n]))
    }
}

/// The config of an image that brings none: a shell, with the usual `PATH`.
pub fn default_config() -> ContainerConfig {
    ContainerConfig {
        env: Some(vec![spec::DEFAULT_PATH.to_string()]),
        cmd: Some(vec!["sh".to_string()]),
        ..ContainerConfig::default()
    }
}

/// Which form a compressed tar is, from the names at its top (reads until it knows).
fn scan_form(image: &str, compression: Compression, file: File) -> Result<Form, ImageError> {
    let decoded = compression
        .reader(std::io::BufReader::new(file))
        .map_err(|e| ImageError::malformed(image, e.to_string()))?;
    let mut archive = tar::Archive::new(decoded);
    let entries = archive
        .entries()
        .map_err(|e| ImageError::malformed(image, format!("not a tar archive: {e}")))?;
    let mut docker = false;
    for entry in entries {
        let entry =
            entry.map_err(|e| ImageError::malformed(image, format!("reading the archive: {e}")))?;
        match unpack::normalize(&entry.path_bytes()).as_deref() {
            Ok([one]) if one == "index.json" => return Ok(Form::OciLayout),
            Ok([one]) if one == "manifest.json" => docker = true,
            _ => {}
        }
    }
    Ok(if docker {
        Form::DockerArchive
    } else {
        Form::RootFs
    })
}

fn open_blob<'a>(
    image: &str,
    src: &'a dyn Source,
    digest: &str,
) -> Result<Box<dyn Read + 'a>, ImageError> {
    let hex = spec::digest_hex(image, digest)?;
    src.open(&format!("blobs/sha256/{hex}"))
        .map_err(|e| ImageError::io(image, format!("read blob {digest}"), e))?
        .ok_or_else(|| ImageError::malformed(image, format!("the layout lacks blob {digest}")))
}

/// A manifest or config blob of a layout, checked against its digest.
fn read_verified_blob(image: &str, src: &dyn Source, digest: &str) -> Result<Vec<u8>, ImageError> {
    let bytes = read_capped(image, digest, open_blob(image, src, digest)?)?;
    let actual = spec::sha256_digest(&bytes);
    if actual != digest {
        return Err(ImageError::DigestMismatch {
            image: image.to_string(),
            expected: digest.to_string(),
            actual,
        });
    }
    Ok(bytes)
}

fn read_source_json(image: &str, src: &dyn Source, name: &str) -> Result<Vec<u8>, ImageError> {
    let r = src
        .open(name)
        .map_err(|e| ImageError::io(image, format!("read {name}"), e))?
        .ok_or_else(|| ImageError::malformed(image, format!("the archive has no {name}")))?;
    read_capped(image, name, r)
}
