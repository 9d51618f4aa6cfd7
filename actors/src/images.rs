//! Images as gateway objects: records that map a name to a manifest digest of the image
//! store, the resolution and pinning of a sandbox's image at create, and deletion that keeps
//! every pinned digest.
//!
//! - A record is `Kind::Image`, global, named by the normalised reference
//!   (`docker.io/library/busybox:latest`), with the prost-encoded public `Image` as body. The
//!   same digest under two names is two records; a pull of a name to a new digest re-tags its
//!   record (a compare-and-swap update).
//! - **Scopes.** An image belongs to a workspace or to the gateway ([`ImageScope`]). A
//!   workspace's image is a record *owned* by the workspace's record: its name is unique in
//!   the workspace (the store's name scope is the owner), it dies with the workspace, and
//!   another workspace's `app:v1` is another record. The gateway's images have no owner: the
//!   built-in `sbx.local/busybox:latest` and what a gateway-wide admin published. A caller in
//!   workspace W sees W's images and the gateway's — a name is looked up in W first, then
//!   among the gateway's; an id or a digest of another workspace's image is not found, as an
//!   image nobody has. `sbx.local/*` is the gateway's own ([`RESERVED_PREFIX`]): no client
//!   writes a name there (pull, import, build, tag), in any scope; the gateway writes the
//!   built-in image and each workspace's build cache there. Records from before scopes have
//!   no owner: they stay the gateway's, run by every workspace as before ([`Images::migrate`]
//!   drops only the build cache among them, which no key names any more).
//! - At sandbox create, for a driver whose capabilities say `images` (asked once per driver,
//!   then cached), the gateway resolves `spec.image` (empty: `Config::default_image`; a name;
//!   `name@sha256:…`; a bare `sha256:…`) in the sandbox's workspace to a record and pins its
//!   digest in `spec.image_digest`. The driver is only ever given that digest, so a later
//!   re-tag changes nothing under an existing sandbox.
//! - A delete is refused while any sandbox pins the record's digest. After it, the image
//!   store's garbage collection keeps the digests of the remaining records *and* of every
//!   sandbox (a sandbox may pin a digest its name was re-tagged away from).
//!
//! Races: a create that resolved an image must not lose it to a delete before its sandbox
//! record is written, so creates and the end of every add hold [`Images::lock`] for reading
//! until their record is written; a delete checks and deletes under the write lock, and a
//! collection reads what it keeps under it. Content an add wrote and has not recorded yet is
//! held by its transfer (`sbx_images::Transfer`): a collection never takes it, and never
//! waits for it — a delete frees its image's disk at once, whatever pulls run. A transfer
//! that ends without a record (failed, cancelled, its caller gone or revoked) is collected
//! after: at once by its own call when it failed there, else by [`Images::collect_forever`].
//! An add whose transfer is cancelled records nothing.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use sbx_driver_api::ComputeDriver;
use sbx_images::{ImageInfo, ImageStore, PullOptions, PullProgress, Transfer};
use sbx_proto::image_ref;
use sbx_proto::v1::{Image, ImageConfig, ImageLayer, SandboxSpec};
use sbx_storage::{Kind, ListQuery, NewRecord, ObjectStore, Record, Scope, StoreError};
use tokio::sync::{Mutex, RwLock, RwLockReadGuard};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

use crate::error::{ActorError, ImageFailure, Result};
use crate::records::{StoredSandbox, now_ms, timestamp};
use crate::validate::ImageDefault;

mod prune;
pub use prune::Pruned;

/// How many times a record write that lost a race (a concurrent create or re-tag of the same
/// name) is tried again before giving up.
const MAX_WRITE_ATTEMPTS: usize = 8;
/// The longest the capabilities probe of one driver may delay the gateway's start.
const STARTUP_PROBE: Duration = Duration::from_secs(2);

/// The name a Dockerfile build's cache images are recorded under (the step's key as the tag),
/// in the build's workspace; a reserved name (below), so no client plants one.
pub const BUILD_CACHE_REPOSITORY: &str = "sbx.local/build-cache";

/// The gateway's own names: the built-in image and the build cache. No client writes one.
pub const RESERVED_PREFIX: &str = "sbx.local/";

/// Whether a normalised name is the gateway's own ([`RESERVED_PREFIX`]).
pub fn is_reserved(name: &str) -> bool {
    name.starts_with(RESERVED_PREFIX)
}

/// Where an image record is, and whose images a lookup sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageScope {
    /// A workspace's own images (by its id). A lookup from here sees them, then the
    /// gateway's.
    Workspace(Uuid),
    /// The gateway's: the built-in image and what an admin published. A lookup from here
    /// sees those only.
    Gateway,
}

impl ImageScope {
    /// The record owner of an image in this scope.
    fn owner(self) -> Option<Uuid> {
        match self {
            ImageScope::Workspace(id) => Some(id),
            ImageScope::Gateway => None,
        }
    }

    /// Whether a lookup from this scope sees a record owned by `owner`.
    fn sees(self, owner: Option<Uuid>) -> bool {
        owner.is_none() || owner == self.owner()
    }
}

/// Who writes an image name: a client (never a name of [`RESERVED_PREFIX`]) or the gateway
/// itself (the built-in image, a build's cache steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writer {
    Client,
    Gateway,
}

/// Refused: a client writing a name of the gateway's own.
pub fn reserved(name: &str) -> ActorError {
    ActorError::Image {
        kind: ImageFailure::Reserved,
        message: format!(
            "{name} is the gateway's own ({RESERVED_PREFIX}* names the built-in image and the \
             build cache): no client writes it; name the image otherwise"
        ),
    }
}

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

/// The public message for an image of the store (id, name, workspace and times come from the
/// record); `unpacked` is what its layers take on disk.
pub fn image_message(info: &ImageInfo, unpacked: u64) -> Image {
    Image {
        unpacked_size: unpacked,
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

/// The body omits what the record itself carries (the workspace is its owner), so the two
/// can never disagree.
fn encode_body(image: &Image) -> Vec<u8> {
    let mut body = image.clone();
    body.id = String::new();
    body.name = String::new();
    body.workspace = String::new();
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
    /// (sandbox create) or to record one (the end of a pull or import), write to delete one
    /// and to read what a collection keeps. Never held across a download or an unpacking, so
    /// a slow registry stalls no create and no delete.
    lock: RwLock<()>,
    /// One collection at a time (they would each read the records for nothing).
    collecting: Mutex<()>,
    /// Each driver's capabilities (by name); filled at start or on first use.
    capabilities: Mutex<HashMap<String, sbx_driver_api::pb::CapabilitiesResponse>>,
}

/// Where a tagged image goes, who writes it, and (for a build's result) the build cache
/// entries its steps made or took (record ids), deleted with it.
#[derive(Debug, Clone)]
pub struct Built {
    pub into: ImageScope,
    pub writer: Writer,
    pub build_cache: Vec<String>,
}

/// What a sandbox create holds while its record is written: the read lock that keeps the
/// pinned image from being deleted meanwhile.
pub type PinGuard<'a> = RwLockReadGuard<'a, ()>;

/// The error of an add that failed because its transfer was cancelled (its caller went away
/// or was revoked).
fn cancelled(what: &str) -> ActorError {
    ActorError::Image {
        kind: ImageFailure::Cancelled,
        message: format!("{what}: cancelled; nothing of it is kept"),
    }
}

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
            collecting: Mutex::new(()),
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

    /// For a driver with images: resolves `spec.image` (empty: the default image) as seen from
    /// `workspace` (its images, then the gateway's), pins its digest in `spec.image_digest`
    /// and records the reference used in `spec.image`. Answers the guard to hold until the
    /// sandbox record is written, and what the command check needs.
    pub async fn pin(
        &self,
        spec: &mut SandboxSpec,
        workspace: Uuid,
    ) -> Result<(PinGuard<'_>, ImageDefault)> {
        self.content()?;
        let guard = self.lock.read().await;
        if spec.image.is_empty() {
            spec.image = self.default_image.clone();
        }
        let selector = ImageSelector::parse("", &spec.image)?;
        let stored = self
            .resolve(&selector, ImageScope::Workspace(workspace))
            .await?;
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

    /// Pulls `reference` into `into`, as `writer`; ends (nothing recorded) once `cancel` is.
    pub async fn pull(
        &self,
        reference: &str,
        options: &PullOptions,
        progress: &(dyn Fn(PullProgress) + Send + Sync),
        into: ImageScope,
        cancel: CancellationToken,
    ) -> Result<Image> {
        let parsed = image_ref::parse(reference)
            .map_err(|e| ActorError::InvalidImageReference(e.to_string()))?;
        let name = parsed.name();
        if is_reserved(&name) {
            return Err(reserved(&name));
        }
        let full = match &parsed.digest {
            Some(d) => format!("{name}@{d}"),
            None => name.clone(),
        };
        let content = self.content()?;
        let transfer = content.transfer(cancel);
        let pulled = tokio::time::timeout(
            self.pull_timeout,
            content.pull_with(&full, options, progress, &transfer),
        )
        .await;
        let added = match pulled {
            Ok(Ok(info)) => {
                let unpacked = self.measure(&info).await;
                self.record_added(&transfer, &full, |images| async move {
                    images.record(&name, &info, unpacked, into).await
                })
                .await
            }
            Ok(Err(e)) => Err(e.into()),
            Err(_) => {
                transfer.cancel();
                Err(ActorError::Image {
                    kind: ImageFailure::Deadline,
                    message: format!(
                        "pulling {full} took longer than the gateway allows ({:?}, sbxd serve \
                         --pull-timeout); nothing of it is kept",
                        self.pull_timeout
                    ),
                })
            }
        };
        self.finish_add(transfer, added).await
    }

    /// The end of an add whose content is in the store: `record` it under the records' read
    /// lock, unless the transfer was cancelled meanwhile; the transfer then keeps nothing
    /// from collection.
    async fn record_added<'a, T, F, Fut>(
        &'a self,
        transfer: &Transfer,
        what: &str,
        record: F,
    ) -> Result<T>
    where
        F: FnOnce(&'a Images) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let _pinning = self.lock.read().await;
        if transfer.is_cancelled() {
            return Err(cancelled(what));
        }
        let recorded = record(self).await;
        if recorded.is_ok() {
            transfer.kept();
        }
        recorded
    }

    /// After an add: one that failed leaves nothing — its transfer ends here and what it
    /// wrote is collected before the answer (a part of it an unpack still holds is collected
    /// when that ends, by [`Images::collect_forever`]).
    async fn finish_add<T>(&self, transfer: Transfer, added: Result<T>) -> Result<T> {
        drop(transfer);
        if added.is_err() {
            self.collect().await;
        }
        added
    }

    /// What an image's layers take on disk (0 when it cannot be read).
    async fn measure(&self, info: &ImageInfo) -> u64 {
        let (Ok(content), info) = (self.content().cloned(), info.clone()) else {
            return 0;
        };
        tokio::task::spawn_blocking(move || content.unpacked_size(&info))
            .await
            .unwrap_or(0)
    }

    /// Imports an image file (OCI layout tar, docker save tar, rootfs tar) into `into`. `name`
    /// overrides the names the archive carries; an image without any name is refused, and so
    /// is a name of the gateway's own (`sbx.local/*`), given or carried.
    pub async fn import(
        &self,
        path: &Path,
        name: Option<&str>,
        into: ImageScope,
        cancel: CancellationToken,
    ) -> Result<Vec<Image>> {
        let name = name.map(record_name).transpose()?;
        if let Some(name) = name.as_deref().filter(|n| is_reserved(n)) {
            return Err(reserved(name));
        }
        let content = self.content()?.clone();
        let transfer = content.transfer(cancel);
        let (path_buf, given, held) = (path.to_path_buf(), name.clone(), transfer.clone());
        let imported = tokio::task::spawn_blocking(move || {
            content.import_with(&path_buf, given.as_deref(), &held)
        })
        .await
        .map_err(|e| ActorError::Internal(format!("image import task: {e}")));
        let added = match imported {
            Ok(Ok(imported)) => {
                self.record_imported(path, name, imported, into, &transfer)
                    .await
            }
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(e),
        };
        self.finish_add(transfer, added).await
    }

    /// Records what an import of `path` added (under `name`, else the archive's names): all
    /// of them or, when one is refused, none.
    async fn record_imported(
        &self,
        path: &Path,
        name: Option<String>,
        imported: Vec<sbx_images::ImportedImage>,
        into: ImageScope,
        transfer: &Transfer,
    ) -> Result<Vec<Image>> {
        if imported.is_empty() {
            return Err(ActorError::Image {
                kind: ImageFailure::BadContent,
                message: format!("{} holds no image", path.display()),
            });
        }
        let mut named = Vec::new();
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
            let normal = record_name(&raw)?;
            if is_reserved(&normal) {
                return Err(reserved(&normal));
            }
            let unpacked = self.measure(&one.info).await;
            named.push((normal, one.info, unpacked));
        }
        self.record_added(transfer, &path.display().to_string(), |images| async move {
            let mut out = Vec::new();
            for (name, info, unpacked) in &named {
                out.push(images.record(name, info, *unpacked, into).await?);
            }
            Ok(out)
        })
        .await
    }

    /// The built-in image: recorded (the gateway's) from `busybox` unless a record of `name`
    /// exists.
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
        let transfer = content.transfer(CancellationToken::new());
        let (path, given, held) = (busybox.to_path_buf(), name.clone(), transfer.clone());
        let info =
            tokio::task::spawn_blocking(move || content.import_busybox_with(&path, &given, &held))
                .await
                .map_err(|e| ActorError::Internal(format!("busybox image task: {e}")))??;
        let unpacked = self.measure(&info).await;
        let recorded = self
            .record_added(&transfer, &name.clone(), |images| async move {
                images
                    .record(&name, &info, unpacked, ImageScope::Gateway)
                    .await
            })
            .await;
        self.finish_add(transfer, recorded).await.map(Some)
    }

    /// Creates the record of `name` in `scope`, or re-tags it to this image (compare-and-swap).
    async fn record(
        &self,
        name: &str,
        info: &ImageInfo,
        unpacked: u64,
        scope: ImageScope,
    ) -> Result<Image> {
        self.record_built(name, info, unpacked, scope, Vec::new())
            .await
    }

    /// [`Images::record`], the image naming the build cache entries its build made or took
    /// (record ids), which go with it.
    async fn record_built(
        &self,
        name: &str,
        info: &ImageInfo,
        unpacked: u64,
        scope: ImageScope,
        build_cache: Vec<String>,
    ) -> Result<Image> {
        let mut image = image_message(info, unpacked);
        image.build_cache = build_cache;
        let owner = scope.owner();
        for _ in 0..MAX_WRITE_ATTEMPTS {
            let written = match self.store.get_by_name(Kind::Image, owner, name).await? {
                Some(record) => {
                    let current = StoredImage::from_record(record.clone())?;
                    image.id = current.image.id.clone();
                    if encode_body(&current.image) == encode_body(&image) {
                        return self.shown(current).await;
                    }
                    if current.image.digest != image.digest {
                        tracing::info!(image = name, ?scope, from = %current.image.digest, to = %image.digest, "re-tagged");
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
                        owner,
                        labels: Default::default(),
                        created_at_ms: now_ms(),
                        body: encode_body(&image),
                    };
                    self.store.create(new).await
                }
            };
            match written {
                Ok(record) => return self.shown(StoredImage::from_record(record)?).await,
                Err(StoreError::Conflict { .. } | StoreError::AlreadyExists { .. }) => continue,
                Err(StoreError::OwnerNotFound { .. }) => {
                    return Err(ActorError::WorkspaceNotFound(format!(
                        "the workspace image {name} was to be recorded in (it was deleted)"
                    )));
                }
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

    /// The public message of a stored image, its workspace named.
    async fn shown(&self, stored: StoredImage) -> Result<Image> {
        let mut image = stored.image;
        if let Some(owner) = stored.record.owner {
            image.workspace = match self.store.get(owner).await? {
                Some(ws) if ws.kind == Kind::Workspace => ws.name,
                // Its workspace is being deleted with it.
                _ => owner.to_string(),
            };
        }
        Ok(image)
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

    /// A new image from `parent` (see [`ImageStore::derive`]), recorded under `name` in
    /// `into` as `writer`; nothing is recorded once `cancel` is.
    #[allow(clippy::too_many_arguments)]
    pub async fn derive(
        &self,
        name: &str,
        parent: Option<ImageInfo>,
        layer: Option<PathBuf>,
        config: sbx_images::ImageConfig,
        into: ImageScope,
        writer: Writer,
        cancel: CancellationToken,
    ) -> Result<(Image, ImageInfo)> {
        let name = record_name(name)?;
        if writer == Writer::Client && is_reserved(&name) {
            return Err(reserved(&name));
        }
        let content = self.content()?.clone();
        let transfer = content.transfer(cancel);
        let (shown, held) = (name.clone(), transfer.clone());
        let derived = tokio::task::spawn_blocking(move || {
            content.derive_with(&shown, parent.as_ref(), layer.as_deref(), &config, &held)
        })
        .await
        .map_err(|e| ActorError::Internal(format!("image build task: {e}")));
        let added = match derived {
            Ok(Ok(info)) => {
                let unpacked = self.measure(&info).await;
                self.record_added(&transfer, &name.clone(), |images| async move {
                    let image = images.record(&name, &info, unpacked, into).await?;
                    Ok((image, info))
                })
                .await
            }
            Ok(Err(e)) => Err(e.into()),
            Err(e) => Err(e),
        };
        self.finish_add(transfer, added).await
    }

    /// Records `name` in `into` as the image with this digest (a re-tag when it names
    /// another), as `writer`; refused once `cancel` is.
    pub async fn tag(
        &self,
        name: &str,
        info: &ImageInfo,
        built: Built,
        cancel: CancellationToken,
    ) -> Result<Image> {
        let Built {
            into,
            writer,
            build_cache,
        } = built;
        let name = record_name(name)?;
        if writer == Writer::Client && is_reserved(&name) {
            return Err(reserved(&name));
        }
        let content = self.content()?;
        let transfer = content.transfer(cancel);
        // The content is held from the moment it is looked at until its record is written.
        let held = tokio::task::spawn_blocking({
            let (content, digest, transfer) =
                (content.clone(), info.digest.clone(), transfer.clone());
            move || content.hold_image(&digest, &transfer)
        })
        .await
        .map_err(|e| ActorError::Internal(format!("image tag task: {e}")))?;
        let tagged = match held {
            Ok(()) => {
                let unpacked = self.measure(info).await;
                self.record_added(&transfer, &name.clone(), |images| async move {
                    images
                        .record_built(&name, info, unpacked, into, build_cache)
                        .await
                })
                .await
            }
            Err(e) => Err(e.into()),
        };
        self.finish_add(transfer, tagged).await
    }

    /// The image `selector` names, as seen from `scope`.
    pub async fn get(&self, selector: &ImageSelector, scope: ImageScope) -> Result<Image> {
        let stored = self.resolve(selector, scope).await?;
        self.shown(stored).await
    }

    /// The image recorded under `name` in `scope` itself (not the gateway's when `scope` is
    /// a workspace's): a build's cache step.
    pub async fn get_own(&self, name: &str, scope: ImageScope) -> Result<Option<Image>> {
        match self
            .store
            .get_by_name(Kind::Image, scope.owner(), name)
            .await?
        {
            Some(record) => Ok(Some(StoredImage::from_record(record)?.image)),
            None => Ok(None),
        }
    }

    /// Every image record, of every scope.
    pub async fn list(&self) -> Result<Vec<StoredImage>> {
        list_every_page(self.store.as_ref(), Kind::Image, Scope::All)
            .await?
            .into_iter()
            .map(StoredImage::from_record)
            .collect()
    }

    /// A page of the images `sees` admits (by owner: `None` is the gateway's), in creation
    /// order, their workspaces named. Store pages are read on until `limit` images or the
    /// end, so other scopes' images show neither in the items nor in the pages' shape.
    pub async fn list_page(
        &self,
        limit: usize,
        page_token: &str,
        sees: impl Fn(Option<Uuid>) -> bool,
    ) -> Result<(Vec<Image>, String)> {
        let mut items = Vec::new();
        let mut cursor = (!page_token.is_empty()).then(|| page_token.to_string());
        let mut names: HashMap<Uuid, String> = HashMap::new();
        loop {
            let mut q = ListQuery::new(Kind::Image, Scope::All, limit - items.len());
            q.cursor = cursor.take();
            let page = self.store.list(q).await.map_err(|e| match e {
                StoreError::Invalid { .. } => ActorError::InvalidArgument(e.to_string()),
                other => other.into(),
            })?;
            for record in page.records {
                if !sees(record.owner) {
                    continue;
                }
                let owner = record.owner;
                let mut image = StoredImage::from_record(record)?.image;
                if let Some(owner) = owner {
                    image.workspace = match names.get(&owner) {
                        Some(name) => name.clone(),
                        None => {
                            let name = match self.store.get(owner).await? {
                                Some(ws) if ws.kind == Kind::Workspace => ws.name,
                                _ => owner.to_string(),
                            };
                            names.insert(owner, name.clone());
                            name
                        }
                    };
                }
                items.push(image);
            }
            match page.next_cursor {
                Some(next) if items.len() < limit => cursor = Some(next),
                next => return Ok((items, next.unwrap_or_default())),
            }
        }
    }

    /// Deletes an image record, as seen from `scope`, refused while a sandbox pins its digest;
    /// then collects the content nothing keeps. Answers false for an id with no record.
    pub async fn delete(&self, selector: &ImageSelector, scope: ImageScope) -> Result<bool> {
        self.content()?;
        let exclusive = self.lock.write().await;
        let stored = match self.resolve(selector, scope).await {
            Ok(s) => s,
            Err(ActorError::ImageNotFound(_)) if matches!(selector, ImageSelector::Id(_)) => {
                return Ok(false);
            }
            Err(e) => return Err(e),
        };
        let sandboxes = list_every_page(self.store.as_ref(), Kind::Sandbox, Scope::All).await?;
        let mut users = Vec::new();
        let mut pinned = BTreeSet::new();
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
            pinned.insert(digest);
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
        self.drop_build_cache(&stored.image.build_cache, &pinned)
            .await;
        drop(exclusive);
        self.collect().await;
        Ok(true)
    }

    /// Removes the content no image record, no sandbox and no transfer under way holds
    /// (`sbx_images::Transfer`): it never waits for a download, nor a download for it.
    pub async fn collect(&self) {
        let Ok(content) = self.content().cloned() else {
            return;
        };
        let _one = self.collecting.lock().await;
        // Begun before what is kept is read: a transfer that records and lets go meanwhile
        // is remembered by the collection.
        let Some(collection) = content.begin_collection() else {
            return;
        };
        let mut keep = BTreeSet::new();
        let held = async {
            // Under the write lock: no create is between pinning an image and writing its
            // sandbox, no add between its content and its record.
            let _exclusive = self.lock.write().await;
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
        match tokio::task::spawn_blocking(move || collection.remove_unreferenced(&keep)).await {
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

    /// Collects whenever a transfer ends holding content nobody recorded (a pull whose
    /// caller went away mid-unpack, a cancelled add): runs until aborted.
    pub async fn collect_forever(self: Arc<Self>) {
        let Ok(content) = self.content().cloned() else {
            return;
        };
        loop {
            content.transfer_ended().await;
            self.collect().await;
        }
    }

    /// At start: the build cache of before image scopes (gateway records named
    /// `sbx.local/build-cache:*`, whose keys no build names any more) goes, except what a
    /// sandbox pins; every other record without an owner stays the gateway's, run by every
    /// workspace as before. Then each image without its unpacked size is measured.
    pub async fn migrate(&self, cache_repository: &str) -> Result<()> {
        self.content()?;
        let prefix = format!("{cache_repository}:");
        let mut dropped = 0;
        for stored in self.list().await? {
            if stored.record.owner.is_none() && stored.image.name.starts_with(&prefix) {
                match self
                    .delete(&ImageSelector::Id(stored.record.id), ImageScope::Gateway)
                    .await
                {
                    Ok(_) => dropped += 1,
                    Err(ActorError::ImageInUse { .. }) => {}
                    Err(e) => {
                        tracing::warn!(image = %stored.image.name, "the old build cache step stays: {e}")
                    }
                }
            }
        }
        if dropped > 0 {
            tracing::info!(
                steps = dropped,
                "dropped the build cache of before image scopes (a build runs those steps again)"
            );
        }
        for stored in self.list().await? {
            if stored.image.unpacked_size != 0 {
                continue;
            }
            let Ok(info) = self.content_of(&stored.image.digest).await else {
                continue;
            };
            let mut image = stored.image.clone();
            image.unpacked_size = self.measure(&info).await;
            let mut update = stored.record;
            update.body = encode_body(&image);
            // Lost to a concurrent re-tag: that one measured its own.
            let _ = self.store.update(update).await;
        }
        Ok(())
    }

    async fn resolve(&self, selector: &ImageSelector, scope: ImageScope) -> Result<StoredImage> {
        let not_found = || ActorError::ImageNotFound(selector.describe());
        match selector {
            ImageSelector::Id(id) => {
                match self
                    .store
                    .get(*id)
                    .await?
                    .filter(|r| r.kind == Kind::Image && scope.sees(r.owner))
                {
                    Some(r) => StoredImage::from_record(r),
                    None => Err(not_found()),
                }
            }
            ImageSelector::Name(name) => match self.by_name(name, scope).await? {
                Some(r) => StoredImage::from_record(r),
                None => Err(not_found()),
            },
            ImageSelector::Digest { name, digest } => {
                if let Some(name) = name
                    && let Some(r) = self.by_name(name, scope).await?
                {
                    let named = StoredImage::from_record(r)?;
                    if &named.image.digest == digest {
                        return Ok(named);
                    }
                }
                // The scope's own first, then the gateway's.
                let mut found: Option<StoredImage> = None;
                for s in self.list().await? {
                    if &s.image.digest != digest || !scope.sees(s.record.owner) {
                        continue;
                    }
                    let own = s.record.owner.is_some();
                    if found.is_none() || own {
                        found = Some(s);
                        if own {
                            break;
                        }
                    }
                }
                found.ok_or_else(not_found)
            }
        }
    }

    /// The record of `name` seen from `scope`: the scope's own, else the gateway's.
    async fn by_name(&self, name: &str, scope: ImageScope) -> Result<Option<Record>> {
        if let Some(owner) = scope.owner()
            && let Some(r) = self
                .store
                .get_by_name(Kind::Image, Some(owner), name)
                .await?
        {
            return Ok(Some(r));
        }
        Ok(self.store.get_by_name(Kind::Image, None, name).await?)
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
