//! Images as gateway objects: records that map a name to a manifest digest of the image
//! store, the resolution and pinning of a sandbox's image at create, and deletion that keeps
//! every pinned digest.
//!
//! - A record is `Kind::Image`, global, named by the normalised reference
//!   (`docker.io/library/busybox:latest`), with the prost-encoded public `Image` as body. The
//!   same digest under two names is two records; a pull of a name to a new digest re-tags its
//!   record (a compare-and-swap update).
//! - At sandbox create, for a driver whose capabilities say `images` (asked once per driver,
//!   then cached), the gateway resolves `spec.image` (empty: `Config::default_image`; a name;
//!   `name@sha256:…`; a bare `sha256:…`) to a record and pins its digest in
//!   `spec.image_digest`. The driver is only ever given that digest, so a later re-tag changes
//!   nothing under an existing sandbox.
//! - A delete is refused while any sandbox pins the record's digest. After it, the image
//!   store's garbage collection keeps the digests of the remaining records *and* of every
//!   sandbox (a sandbox may pin a digest its name was re-tagged away from).
//!
//! Races: the image store's garbage collection must not run while content is being added
//! (a blob fetched before its record is written looks unreferenced), and a create that
//! resolved an image must not lose it to a delete before its sandbox record is written. So
//! pulls, imports and creates hold [`Images::lock`] for reading until their record is written;
//! an image delete checks, deletes and collects under the write lock. A delete therefore waits
//! for pulls in flight.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use sbx_driver_api::ComputeDriver;
use sbx_images::{ImageInfo, ImageStore, PullOptions, PullProgress};
use sbx_proto::image_ref;
use sbx_proto::v1::{Image, ImageConfig, ImageLayer, SandboxSpec};
use sbx_storage::{Kind, ListQuery, NewRecord, ObjectStore, Record, Scope, StoreError};
use tokio::sync::{Mutex, RwLock, RwLockReadGuard};
use uuid::Uuid;

use crate::error::{ActorError, ImageFailure, Result};
use crate::records::{StoredSandbox, now_ms, timestamp};
use crate::validate::ImageDefault;

/// How many times a record write that lost a race (a concurrent create or re-tag of the same
/// name) is tried again before giving up.
const MAX_WRITE_ATTEMPTS: usize = 8;
/// The longest the capabilities probe of one driver may delay the gateway's start.
const STARTUP_PROBE: Duration = Duration::from_secs(2);

/// How a request names an image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageSelector {
    /// Authoritative: this record or nothing.
    Id(Uuid),
    /// A normalised name (`docker.io/library/busybox:latest`).
    Name(String),
    /// A manifest digest, optionally with the name it was given under (`name@sha256:…`).
    Digest {
        name: Option<String>,
        digest: String,
    },
}

impl ImageSelector {
    /// By id when `id` is set, else by `reference` (a name, `name@sha256:…` or `sha256:…`).
    pub fn parse(id: &str, reference: &str) -> Result<ImageSelector> {
        if !id.is_empty() {
            return Uuid::parse_str(id).map(ImageSelector::Id).map_err(|_| {
                ActorError::InvalidArgument(format!("image id {id:?} is not a UUID"))
            });
        }
        if reference.is_empty() {
            return Err(ActorError::InvalidArgument(
                "name the image by id, by name (name:tag) or by digest (sha256:…)".into(),
            ));
        }
        if image_ref::is_digest(reference) {
            return Ok(ImageSelector::Digest {
                name: None,
                digest: reference.to_string(),
            });
        }
        let parsed = image_ref::parse(reference)
            .map_err(|e| ActorError::InvalidImageReference(e.to_string()))?;
        Ok(match parsed.digest.clone() {
            Some(digest) => ImageSelector::Digest {
                name: Some(parsed.name()),
                digest,
            },
            None => ImageSelector::Name(parsed.name()),
        })
    }

    fn describe(&self) -> String {
        match self {
            ImageSelector::Id(id) => format!("with id {id}"),
            ImageSelector::Name(name) => format!("{name:?}"),
            ImageSelector::Digest { name: None, digest } => digest.clone(),
            ImageSelector::Digest {
                name: Some(name),
                digest,
            } => format!("{name}@{digest}"),
        }
    }
}

/// The normalised record name for a name given by a user (refusing a digest).
pub fn record_name(given: &str) -> Result<String> {
    let parsed =
        image_ref::parse(given).map_err(|e| ActorError::InvalidImageReference(e.to_string()))?;
    if parsed.digest.is_some() {
        return Err(ActorError::InvalidImageReference(format!(
            "image name {given:?} carries a digest; name an image as name:tag"
        )));
    }
    Ok(parsed.name())
}

/// An image as stored, with the record it came from (for compare-and-swap writes).
#[derive(Debug, Clone)]
pub struct StoredImage {
    pub record: Record,
    pub image: Image,
}

impl StoredImage {
    pub fn from_record(record: Record) -> Result<StoredImage> {
        let mut image = Image::decode(record.body.as_slice()).map_err(|e| {
            ActorError::Internal(format!("image record {} does not decode: {e}", record.id))
        })?;
        image.id = record.id.to_string();
        image.name = record.name.clone();
        image.resource_version = record.resource_version;
        image.created_at = Some(timestamp(record.created_at_ms));
        image.updated_at = Some(timestamp(record.updated_at_ms));
        Ok(StoredImage { record, image })
    }
}

/// The public message for an image of the store (id, name and times come from the record).
pub fn image_message(info: &ImageInfo) -> Image {
    Image {
        digest: info.digest.clone(),
        config: Some(ImageConfig {
            entrypoint: info.config.entrypoint.clone(),
            cmd: info.config.cmd.clone(),
            env: info.config.env.clone(),
            working_dir: info.config.working_dir.clone(),
            user: info.config.user.clone(),
            labels: info.config.labels.clone().into_iter().collect(),
            exposed_ports: info.config.exposed_ports.clone(),
        }),
        layers: info
            .layers
            .iter()
            .map(|l| ImageLayer {
                digest: l.digest.clone(),
                size: l.size,
            })
            .collect(),
        size: info.size,
        os: info.os.clone(),
        architecture: info.architecture.clone(),
        ..Default::default()
    }
}

/// The body omits what the record itself carries, so the two can never disagree.
fn encode_body(image: &Image) -> Vec<u8> {
    let mut body = image.clone();
    body.id = String::new();
    body.name = String::new();
    body.resource_version = 0;
    body.created_at = None;
    body.updated_at = None;
    body.encode_to_vec()
}

/// Every record of `kind` in `scope`, reading every page.
pub(crate) async fn list_every_page(
    store: &dyn ObjectStore,
    kind: Kind,
    scope: Scope,
) -> Result<Vec<Record>> {
    let mut all = Vec::new();
    let mut cursor = None;
    loop {
        let mut q = ListQuery::new(kind, scope, 1000);
        q.cursor = cursor;
        let page = store.list(q).await?;
        all.extend(page.records);
        match page.next_cursor {
            Some(c) => cursor = Some(c),
            None => return Ok(all),
        }
    }
}

/// The image side of a gateway: the records, the content store and the lock between them.
pub struct Images {
    store: Arc<dyn ObjectStore>,
    content: Option<ImageStore>,
    default_image: String,
    max_import_bytes: u64,
    driver_call_timeout: Duration,
    /// How long a pull may take (see `Config::pull_timeout`).
    pull_timeout: Duration,
    /// Between the image records and those who read or change them: read to pin an image
    /// (sandbox create) or to record one (the end of a pull or import), write to delete one.
    /// Never held across a download or an unpacking, so a slow registry stalls no create and
    /// no delete.
    lock: RwLock<()>,
    /// Held (read) by every pull and import while it adds content to the store, and (write)
    /// by garbage collection, which would take content no record holds yet. Collection never
    /// waits for it: with an add under way it is owed, and the last add to finish does it.
    adding: RwLock<()>,
    /// A collection was skipped for an add under way.
    collection_owed: std::sync::atomic::AtomicBool,
    /// Each driver's capabilities (by name); filled at start or on first use.
    capabilities: Mutex<HashMap<String, sbx_driver_api::pb::CapabilitiesResponse>>,
}

/// What a sandbox create holds while its record is written: the read lock that keeps the
/// pinned image from being deleted meanwhile.
pub type PinGuard<'a> = RwLockReadGuard<'a, ()>;

impl Images {
    pub fn new(store: Arc<dyn ObjectStore>, config: &crate::Config) -> Images {
        Images {
            store,
            content: config.image_store.clone(),
            default_image: config.default_image.clone(),
            max_import_bytes: config.max_image_import_bytes,
            driver_call_timeout: config.driver_call_timeout,
            pull_timeout: config.pull_timeout,
            lock: RwLock::new(()),
            adding: RwLock::new(()),
            collection_owed: std::sync::atomic::AtomicBool::new(false),
            capabilities: Mutex::new(HashMap::new()),
        }
    }

    fn content(&self) -> Result<&ImageStore> {
        self.content
            .as_ref()
            .ok_or_else(|| ActorError::FailedPrecondition("this gateway has no image store".into()))
    }

    /// Where an import's upload is spooled (the image store's `tmp/`), and the largest upload.
    pub fn spool(&self) -> Result<(PathBuf, u64)> {
        Ok((self.content()?.root().join("tmp"), self.max_import_bytes))
    }

    /// Asks every driver's capabilities once at start, each within a short deadline (a
    /// driver that does not answer is asked again at its first sandbox create).
    pub async fn probe_drivers(&self, drivers: &crate::DriverSet) {
        let saved = self.driver_call_timeout;
        for (name, driver) in drivers.iter() {
            let within = saved.min(STARTUP_PROBE);
            match tokio::time::timeout(within, driver.capabilities()).await {
                Ok(Ok(caps)) => {
                    self.capabilities.lock().await.insert(name.clone(), caps);
                }
                Ok(Err(e)) => tracing::warn!(driver = %name, "capabilities at start: {e}"),
                Err(_) => {
                    tracing::warn!(driver = %name, "capabilities at start: no answer within {within:?}")
                }
            }
        }
    }

    /// Whether the driver runs sandboxes from images (asked once, then remembered).
    pub async fn driver_has_images(&self, name: &str, driver: &dyn ComputeDriver) -> Result<bool> {
        Ok(self.driver_capabilities(name, driver).await?.images)
    }

    /// The driver's capabilities (asked once, then remembered: a driver's are fixed when it
    /// opens).
    pub async fn driver_capabilities(
        &self,
        name: &str,
        driver: &dyn ComputeDriver,
    ) -> Result<sbx_driver_api::pb::CapabilitiesResponse> {
        if let Some(known) = self.capabilities.lock().await.get(name) {
            return Ok(known.clone());
        }
        let caps = tokio::time::timeout(self.driver_call_timeout, driver.capabilities())
            .await
            .map_err(|_| {
                ActorError::Unavailable(format!(
                    "driver {name:?} did not answer capabilities within {:?}",
                    self.driver_call_timeout
                ))
            })?
            .map_err(|e| ActorError::Unavailable(format!("driver {name:?} capabilities: {e}")))?;
        self.capabilities
            .lock()
            .await
            .insert(name.to_string(), caps.clone());
        Ok(caps)
    }

    /// For a driver with images: resolves `spec.image` (empty: the default image), pins its
    /// digest in `spec.image_digest` and records the reference used in `spec.image`. Answers
    /// the guard to hold until the sandbox record is written, and what the command check needs.
    pub async fn pin(&self, spec: &mut SandboxSpec) -> Result<(PinGuard<'_>, ImageDefault)> {
        self.content()?;
        let guard = self.lock.read().await;
        if spec.image.is_empty() {
            spec.image = self.default_image.clone();
        }
        let selector = ImageSelector::parse("", &spec.image)?;
        let stored = self.resolve(&selector).await?;
        // The record is there; its content must be too, or the driver could not run it.
        let content = self.content()?.clone();
        let digest = stored.image.digest.clone();
        let info = tokio::task::spawn_blocking(move || content.get(&digest))
            .await
            .map_err(|e| ActorError::Internal(format!("image lookup task: {e}")))??;
        spec.image_digest = info.digest.clone();
        let runs = !info.config.entrypoint.is_empty() || !info.config.cmd.is_empty();
        Ok((
            guard,
            ImageDefault {
                name: format!("{} ({})", stored.image.name, info.digest),
                runs,
            },
        ))
    }

    pub async fn pull(
        &self,
        reference: &str,
        options: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
    ) -> Result<Image> {
        let parsed = image_ref::parse(reference)
            .map_err(|e| ActorError::InvalidImageReference(e.to_string()))?;
        let name = parsed.name();
        let full = match &parsed.digest {
            Some(d) => format!("{name}@{d}"),
            None => name.clone(),
        };
        let content = self.content()?;
        let info = {
            let _adding = self.adding.read().await;
            let pulled =
                tokio::time::timeout(self.pull_timeout, content.pull(&full, options, progress))
                    .await;
            match pulled {
                Ok(Ok(info)) => {
                    let _pinning = self.lock.read().await;
                    self.record(&name, &info).await
                }
                Ok(Err(e)) => Err(self.failed_add(e.into())),
                Err(_) => Err(self.failed_add(ActorError::Image {
                    kind: ImageFailure::Deadline,
                    message: format!(
                        "pulling {full} took longer than the gateway allows ({:?}, sbxd serve \
                         --pull-timeout); nothing of it is kept",
                        self.pull_timeout
                    ),
                })),
            }
        };
        self.collect_if_owed().await;
        info
    }

    /// A pull or import that failed: what it stored (blobs, unpacked layers) is no image's, and
    /// is collected as soon as no add is under way ([`Images::collect_if_owed`]).
    fn failed_add(&self, e: ActorError) -> ActorError {
        self.collection_owed
            .store(true, std::sync::atomic::Ordering::SeqCst);
        e
    }

    /// Imports an image file (OCI layout tar, docker save tar, rootfs tar). `name` overrides
    /// the names the archive carries; an image without any name is refused.
    pub async fn import(&self, path: &Path, name: Option<&str>) -> Result<Vec<Image>> {
        let name = name.map(record_name).transpose()?;
        let content = self.content()?.clone();
        let added = {
            let _adding = self.adding.read().await;
            let path_buf = path.to_path_buf();
            let given = name.clone();
            let imported =
                tokio::task::spawn_blocking(move || content.import(&path_buf, given.as_deref()))
                    .await
                    .map_err(|e| ActorError::Internal(format!("image import task: {e}")));
            match imported {
                Ok(Ok(imported)) => self.record_imported(path, name, imported).await,
                Ok(Err(e)) => Err(self.failed_add(e.into())),
                Err(e) => Err(self.failed_add(e)),
            }
        };
        self.collect_if_owed().await;
        added
    }

    /// Records what an import of `path` added (under `name`, else the archive's names).
    async fn record_imported(
        &self,
        path: &Path,
        name: Option<String>,
        imported: Vec<sbx_images::ImportedImage>,
    ) -> Result<Vec<Image>> {
        let _pinning = self.lock.read().await;
        if imported.is_empty() {
            return Err(ActorError::Image {
                kind: ImageFailure::BadContent,
                message: format!("{} holds no image", path.display()),
            });
        }
        let mut out = Vec::new();
        for one in imported {
            let Some(raw) = one.name.or_else(|| name.clone()) else {
                return Err(ActorError::Image {
                    kind: ImageFailure::InvalidArgument,
                    message: format!(
                        "image {} from {} has no name; give one (name:tag)",
                        one.info.digest,
                        path.display()
                    ),
                });
            };
            out.push(self.record(&record_name(&raw)?, &one.info).await?);
        }
        Ok(out)
    }

    /// The built-in image: recorded from `busybox` unless a record of `name` exists.
    pub async fn ensure_busybox(&self, busybox: &Path, name: &str) -> Result<Option<Image>> {
        let name = record_name(name)?;
        if self
            .store
            .get_by_name(Kind::Image, None, &name)
            .await?
            .is_some()
        {
            return Ok(None);
        }
        let content = self.content()?.clone();
        let _adding = self.adding.read().await;
        let (path, given) = (busybox.to_path_buf(), name.clone());
        let info = tokio::task::spawn_blocking(move || content.import_busybox(&path, &given))
            .await
            .map_err(|e| ActorError::Internal(format!("busybox image task: {e}")))??;
        let _pinning = self.lock.read().await;
        self.record(&name, &info).await.map(Some)
    }

    /// Creates the record of `name`, or re-tags it to this image (compare-and-swap).
    async fn record(&self, name: &str, info: &ImageInfo) -> Result<Image> {
        let mut image = image_message(info);
        for _ in 0..MAX_WRITE_ATTEMPTS {
            let written = match self.store.get_by_name(Kind::Image, None, name).await? {
                Some(record) => {
                    let current = StoredImage::from_record(record.clone())?;
                    image.id = current.image.id.clone();
                    if encode_body(&current.image) == encode_body(&image) {
                        return Ok(current.image);
                    }
                    if current.image.digest != image.digest {
                        tracing::info!(image = name, from = %current.image.digest, to = %image.digest, "re-tagged");
                    }
                    let mut update = record;
                    update.body = encode_body(&image);
                    update.updated_at_ms = now_ms();
                    self.store.update(update).await
                }
                None => {
                    let new = NewRecord {
                        id: Uuid::new_v4(),
                        kind: Kind::Image,
                        workspace: None,
                        name: name.to_string(),
                        owner: None,
                        labels: Default::default(),
                        created_at_ms: now_ms(),
                        body: encode_body(&image),
                    };
                    self.store.create(new).await
                }
            };
            match written {
                Ok(record) => return Ok(StoredImage::from_record(record)?.image),
                Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => continue,
                Err(StoreError::Invalid { reason }) => {
                    return Err(ActorError::InvalidImageReference(format!(
                        "image name {name:?}: {reason}"
                    )));
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(ActorError::Unavailable(format!(
            "image {name}: {MAX_WRITE_ATTEMPTS} concurrent writes of its record in a row; try again"
        )))
    }

    /// The image store itself (for reads that need no record).
    pub fn content_store(&self) -> Result<ImageStore> {
        self.content().cloned()
    }

    /// What the store holds of the image with this manifest digest.
    pub async fn content_of(&self, digest: &str) -> Result<ImageInfo> {
        let content = self.content()?.clone();
        let digest = digest.to_string();
        tokio::task::spawn_blocking(move || content.get(&digest))
            .await
            .map_err(|e| ActorError::Internal(format!("image lookup task: {e}")))?
            .map_err(Into::into)
    }

    /// A new image from `parent` (see [`ImageStore::derive`]), recorded under `name`.
    pub async fn derive(
        &self,
        name: &str,
        parent: Option<ImageInfo>,
        layer: Option<PathBuf>,
        config: sbx_images::ImageConfig,
    ) -> Result<(Image, ImageInfo)> {
        let name = record_name(name)?;
        let content = self.content()?.clone();
        let added = {
            let _adding = self.adding.read().await;
            let shown = name.clone();
            let derived = tokio::task::spawn_blocking(move || {
                content.derive(&shown, parent.as_ref(), layer.as_deref(), &config)
            })
            .await
            .map_err(|e| ActorError::Internal(format!("image build task: {e}")));
            match derived {
                Ok(Ok(info)) => {
                    let _pinning = self.lock.read().await;
                    self.record(&name, &info).await.map(|image| (image, info))
                }
                Ok(Err(e)) => Err(self.failed_add(e.into())),
                Err(e) => Err(self.failed_add(e)),
            }
        };
        self.collect_if_owed().await;
        added
    }

    /// Records `name` as the image with this digest (a re-tag when it names another).
    pub async fn tag(&self, name: &str, info: &ImageInfo) -> Result<Image> {
        let name = record_name(name)?;
        let _adding = self.adding.read().await;
        let _pinning = self.lock.read().await;
        self.record(&name, info).await
    }

    pub async fn get(&self, selector: &ImageSelector) -> Result<Image> {
        Ok(self.resolve(selector).await?.image)
    }

    pub async fn list(&self) -> Result<Vec<StoredImage>> {
        list_every_page(self.store.as_ref(), Kind::Image, Scope::All)
            .await?
            .into_iter()
            .map(StoredImage::from_record)
            .collect()
    }

    /// Deletes an image record, refused while a sandbox pins its digest; then collects the
    /// content nothing keeps. Answers false for an id with no record.
    pub async fn delete(&self, selector: &ImageSelector) -> Result<bool> {
        self.content()?;
        let exclusive = self.lock.write().await;
        let stored = match self.resolve(selector).await {
            Ok(s) => s,
            Err(ActorError::ImageNotFound(_)) if matches!(selector, ImageSelector::Id(_)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let sandboxes = list_every_page(self.store.as_ref(), Kind::Sandbox, Scope::All).await?;
        let mut users = Vec::new();
        for record in sandboxes {
            let sb = StoredSandbox::from_record(record)?.sandbox;
            let digest = sb
                .spec
                .as_ref()
                .map(|s| s.image_digest.clone())
                .unwrap_or_default();
            if digest == stored.image.digest {
                users.push(format!("{}/{}", sb.workspace, sb.name));
            }
        }
        if !users.is_empty() {
            users.sort();
            return Err(ActorError::ImageInUse {
                image: stored.image.name,
                digest: stored.image.digest,
                users,
            });
        }
        match self
            .store
            .delete(stored.record.id, stored.record.resource_version)
            .await
        {
            Ok(_) => {}
            Err(StoreError::NotFound { .. }) => return Ok(false),
            Err(StoreError::Conflict { .. }) => {
                return Err(ActorError::Unavailable(format!(
                    "image {} was re-tagged while it was being deleted; try again",
                    stored.image.name
                )));
            }
            Err(e) => return Err(e.into()),
        }
        tracing::info!(image = %stored.image.name, digest = %stored.image.digest, "image deleted");
        drop(exclusive);
        self.collect().await;
        Ok(true)
    }

    /// Removes the content no image record and no sandbox holds — unless a pull or import is
    /// adding content now (which no record holds yet): then it is owed, and done when the last
    /// add ends ([`Images::collect_if_owed`]). It never waits for a download.
    async fn collect(&self) {
        use std::sync::atomic::Ordering;
        let Ok(content) = self.content().cloned() else {
            return;
        };
        let Ok(_collecting) = self.adding.try_write() else {
            self.collection_owed.store(true, Ordering::SeqCst);
            tracing::debug!("image store collection owed: an add is under way");
            return;
        };
        self.collection_owed.store(false, Ordering::SeqCst);
        // What is kept is read now, while no add can record anything new.
        let mut keep = BTreeSet::new();
        let held = async {
            for record in list_every_page(self.store.as_ref(), Kind::Sandbox, Scope::All).await? {
                let sb = StoredSandbox::from_record(record)?.sandbox;
                if let Some(spec) = sb.spec.filter(|s| !s.image_digest.is_empty()) {
                    keep.insert(spec.image_digest);
                }
            }
            for rest in self.list().await? {
                keep.insert(rest.image.digest);
            }
            Ok::<_, ActorError>(())
        };
        if let Err(e) = held.await {
            tracing::warn!("image store collection: what is kept could not be read: {e}");
            return;
        }
        let keep: Vec<String> = keep.into_iter().collect();
        match tokio::task::spawn_blocking(move || content.remove_unreferenced(&keep)).await {
            Ok(Ok(report)) => tracing::debug!(
                blobs = report.blobs_removed,
                layers = report.layers_removed,
                bytes = report.bytes_freed,
                "image store collected"
            ),
            Ok(Err(e)) => tracing::warn!("image store garbage collection: {e}"),
            Err(e) => tracing::warn!("image store garbage collection task: {e}"),
        }
    }

    /// [`Images::collect`] when one was skipped for an add (and this caller's add is over).
    async fn collect_if_owed(&self) {
        if self
            .collection_owed
            .load(std::sync::atomic::Ordering::SeqCst)
        {
            self.collect().await;
        }
    }

    async fn resolve(&self, selector: &ImageSelector) -> Result<StoredImage> {
        let not_found = || ActorError::ImageNotFound(selector.describe());
        match selector {
            ImageSelector::Id(id) => {
                match self.store.get(*id).await?.filter(|r| r.kind == Kind::Image) {
                    Some(r) => StoredImage::from_record(r),
                    None => Err(not_found()),
                }
            }
            ImageSelector::Name(name) => {
                match self.store.get_by_name(Kind::Image, None, name).await? {
                    Some(r) => StoredImage::from_record(r),
                    None => Err(not_found()),
                }
            }
            ImageSelector::Digest { name, digest } => {
                if let Some(name) = name
                    && let Some(r) = self.store.get_by_name(Kind::Image, None, name).await?
                {
                    let named = StoredImage::from_record(r)?;
                    if &named.image.digest == digest {
                        return Ok(named);
                    }
                }
                self.list()
                    .await?
                    .into_iter()
                    .find(|s| &s.image.digest == digest)
                    .ok_or_else(not_found)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: &str = "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    #[test]
    fn selectors() {
        let id = Uuid::new_v4();
        assert_eq!(
            ImageSelector::parse(&id.to_string(), "ignored").unwrap(),
            ImageSelector::Id(id)
        );
        assert_eq!(
            ImageSelector::parse("", "busybox").unwrap(),
            ImageSelector::Name("docker.io/library/busybox:latest".into())
        );
        assert_eq!(
            ImageSelector::parse("", D).unwrap(),
            ImageSelector::Digest {
                name: None,
                digest: D.into()
            }
        );
        assert_eq!(
            ImageSelector::parse("", &format!("busybox@{D}")).unwrap(),
            ImageSelector::Digest {
                name: Some("docker.io/library/busybox:latest".into()),
                digest: D.into()
            }
        );
        assert!(matches!(
            ImageSelector::parse("", "Bad Name"),
            Err(ActorError::InvalidImageReference(m)) if m.contains("Bad Name")
        ));
        assert!(matches!(
            ImageSelector::parse("x", ""),
            Err(ActorError::InvalidArgument(_))
        ));
        assert!(matches!(
            ImageSelector::parse("", ""),
            Err(ActorError::InvalidArgument(_))
        ));
    }

    #[test]
    fn record_names_are_normalised_and_never_digests() {
        assert_eq!(record_name("app:v1").unwrap(), "docker.io/library/app:v1");
        assert!(record_name(&format!("app@{D}")).is_err());
        assert!(record_name("").is_err());
    }
}
