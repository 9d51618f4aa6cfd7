//! Images on nodes: a node has every image its sandboxes use, fetched by digest from the image
//! mirror the gateways push to.
//!
//! - A gateway started with `--image-mirror` pushes every image it pulls or imports to the
//!   mirror (`sbx_images::ImageStore::push`), and its creates on nodes carry the request header
//!   [`IMAGE_SOURCE_HEADER`]: `sbx-image-source: HOST[:PORT]/[PREFIX/]sbx-images@sha256:<hex>`,
//!   the mirror's reference of the image the create's `spec.image` pins ([`ImageSource`]).
//!   Before it sends such a create it makes sure the mirror has the image when its own store
//!   holds it (once per image and process): so images it held before the mirror was
//!   configured, the built-in default image, and a push that failed get there too.
//! - `sbxd node --driver oci` keeps an image store of its own ([`NodeImages`]). Before a create
//!   reaches its driver, an image the store lacks is pulled from the header's reference (each
//!   blob checked against its digest, as every pull is); a create without the header whose
//!   image the node lacks is refused, saying so.
//! - A gateway whose own store lacks an image another gateway of its store pulled fetches it
//!   from the mirror before a create pins it ([`ImageSource::fetch`]).
//!
//! A header rather than a field of `CreateRequest`: the gateway's node link adds it, where the
//! create itself is made by the sandbox actor, which names no mirror.
//!
//! The mirror is a registry, not the gateway that pulled the image: every gateway and node
//! reaches it, it outlives any one gateway, and it serves content by digest. A gateway as the
//! source would have to be alive at every create on a node that lacks the image, and each
//! gateway's store is its own.
//!
//! Fetches and pushes run in tasks of their own, one per image at a time: a create that stops
//! waiting (its deadline, its caller gone) leaves the transfer going, and the retried create
//! waits for the same one instead of starting another.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::{BoxFuture, Shared};

use crate::DriverError;
use crate::image::{IdMap, ImageError, ImageStore, Mirror, PullOptions};

/// The request header of a create that names where its image is fetched from.
pub const IMAGE_SOURCE_HEADER: &str = "sbx-image-source";

/// The longest a node's fetch of one image may take (as `sbxd serve --pull-timeout`'s
/// default).
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(30 * 60);

/// A transfer under way, as every waiter of it awaits it.
type Flight = Shared<BoxFuture<'static, Result<(), Failure>>>;

/// One transfer per key at a time, in a task of its own; its answer shared by every waiter.
struct Flights {
    running: Mutex<HashMap<String, Flight>>,
}

/// Why a transfer failed: whether retrying can help, and what to say.
#[derive(Debug, Clone)]
struct Failure {
    transient: bool,
    message: String,
}

impl Flights {
    fn new() -> Arc<Flights> {
        Arc::new(Flights {
            running: Mutex::new(HashMap::new()),
        })
    }

    /// Runs `work` for `key` unless a run for it is under way; answers that run's outcome.
    async fn run(
        self: &Arc<Self>,
        key: &str,
        work: impl Future<Output = Result<(), Failure>> + Send + 'static,
    ) -> Result<(), Failure> {
        let flight = {
            let mut running = self.running.lock().unwrap_or_else(|p| p.into_inner());
            match running.get(key) {
                Some(flight) => flight.clone(),
                None => {
                    let flights = Arc::clone(self);
                    let owned = key.to_string();
                    let task = tokio::spawn(async move {
                        let outcome = work.await;
                        flights
                            .running
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .remove(&owned);
                        outcome
                    });
                    let flight = async move {
                        task.await.unwrap_or_else(|e| {
                            Err(Failure {
                                transient: true,
                                message: format!("the transfer task ended: {e}"),
                            })
                        })
                    }
                    .boxed()
                    .shared();
                    running.insert(key.to_string(), flight.clone());
                    flight
                }
            }
        };
        flight.await
    }
}

/// A gateway's side: the mirror it pushes to and names in its creates on nodes, and its own
/// store (the images it can push). Shared by the gateway's node links and its image service.
pub struct ImageSource {
    mirror: Mirror,
    local: Option<ImageStore>,
    /// Images known to be in the mirror (pushed or found there by this process).
    mirrored: Mutex<HashSet<String>>,
    pushes: Arc<Flights>,
    fetches: Arc<Flights>,
}

impl std::fmt::Debug for ImageSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ImageSource")
            .field("mirror", &self.mirror)
            .finish_non_exhaustive()
    }
}

impl ImageSource {
    /// Pushes to and names `mirror`; `local`: the gateway's image store (pushed from).
    pub fn new(mirror: Mirror, local: Option<ImageStore>) -> ImageSource {
        ImageSource {
            mirror,
            local,
            mirrored: Mutex::new(HashSet::new()),
            pushes: Flights::new(),
            fetches: Flights::new(),
        }
    }

    pub fn mirror(&self) -> &Mirror {
        &self.mirror
    }

    /// Copies the image `digest` of the gateway's store to the mirror (what the mirror lacks
    /// of it). A push of the same image under way is waited for, not repeated.
    pub async fn push(&self, digest: &str) -> Result<(), String> {
        let Some(local) = self.local.clone() else {
            return Err("this gateway has no image store".to_string());
        };
        let mirror = self.mirror.clone();
        let owned = digest.to_string();
        let pushed = self
            .pushes
            .run(digest, async move {
                local
                    .push(&owned, &mirror, &PullOptions::default())
                    .await
                    .map(drop)
                    .map_err(|e| Failure {
                        transient: transient(&e),
                        message: e.to_string(),
                    })
            })
            .await;
        match pushed {
            Ok(()) => {
                self.mirrored
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(digest.to_string());
                Ok(())
            }
            Err(failure) => Err(failure.message),
        }
    }

    /// The header value of a create of image `digest` (a manifest digest; `None` for anything
    /// else), once the mirror has the image if this gateway's store holds it. A push that
    /// fails is logged, never the create's failure: the node may hold the image already, and
    /// says so if it cannot fetch it.
    pub async fn prepare(&self, digest: &str) -> Option<String> {
        if !sbx_proto::image_ref::is_digest(digest) {
            return None;
        }
        let known = self
            .mirrored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(digest);
        if !known
            && self.holds(digest).await
            && let Err(why) = self.push(digest).await
        {
            tracing::warn!(image = %digest, mirror = %self.mirror, "the image mirror lacks the image and this gateway could not push it (nodes that lack it cannot fetch it): {why}");
        }
        Some(self.mirror.reference(digest))
    }

    /// Pulls the image `digest` from the mirror into the gateway's own store when it lacks
    /// it (a gateway sharing a store with the one that pulled or imported it). Answers whether
    /// it fetched anything.
    pub async fn fetch(&self, digest: &str) -> Result<bool, String> {
        let Some(local) = self.local.clone() else {
            return Err("this gateway has no image store".to_string());
        };
        if !sbx_proto::image_ref::is_digest(digest) || self.holds(digest).await {
            return Ok(false);
        }
        let reference = self.mirror.reference(digest);
        self.fetches
            .run(digest, async move {
                match tokio::time::timeout(
                    FETCH_TIMEOUT,
                    local.pull(&reference, &PullOptions::default(), &|_| {}),
                )
                .await
                {
                    Ok(Ok(_)) => {
                        tracing::info!(from = %reference, "image fetched from the mirror");
                        Ok(())
                    }
                    Ok(Err(e)) => Err(Failure {
                        transient: transient(&e),
                        message: e.to_string(),
                    }),
                    Err(_) => Err(Failure {
                        transient: true,
                        message: format!("the fetch took longer than {FETCH_TIMEOUT:?}"),
                    }),
                }
            })
            .await
            .map_err(|failure| failure.message)?;
        self.mirrored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(digest.to_string());
        Ok(true)
    }

    async fn holds(&self, digest: &str) -> bool {
        let Some(local) = self.local.clone() else {
            return false;
        };
        let digest = digest.to_string();
        tokio::task::spawn_blocking(move || local.get(&digest).is_ok())
            .await
            .unwrap_or(false)
    }
}

/// Whether retrying a push or a fetch later can succeed: the registry was unreachable or
/// failing, or a local file operation failed.
fn transient(e: &ImageError) -> bool {
    matches!(e, ImageError::Unavailable { .. } | ImageError::Io { .. })
}

/// A node's side: its own image store (which its oci driver runs images from), filled from the
/// mirror a create names.
pub struct NodeImages {
    store: ImageStore,
    fetches: Arc<Flights>,
    /// Images fetched since the node started.
    fetched: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for NodeImages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeImages")
            .field("store", &self.store.root())
            .finish_non_exhaustive()
    }
}

impl NodeImages {
    /// Opens (creating it when absent) the node's writable store at `root`.
    pub fn open(root: std::path::PathBuf, idmap: IdMap) -> Result<NodeImages, DriverError> {
        let store = ImageStore::open(root.clone(), idmap).map_err(|e| {
            DriverError::Unavailable(format!("the node's image store {}: {e}", root.display()))
        })?;
        Ok(NodeImages {
            store,
            fetches: Flights::new(),
            fetched: Arc::new(std::sync::atomic::AtomicU64::new(0)),
        })
    }

    /// The store (for the driver, which reads it).
    pub fn store(&self) -> &ImageStore {
        &self.store
    }

    /// How many images were fetched from a mirror since the node started.
    pub fn fetched(&self) -> u64 {
        self.fetched.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Makes sure the store holds `image` (a create's `spec.image`) before the create runs:
    /// pulls it from `source` (the create's [`IMAGE_SOURCE_HEADER`]) when it lacks it. An
    /// image that is not a manifest digest is left to the driver (which refuses it).
    pub async fn ensure(&self, image: &str, source: Option<&str>) -> Result<(), DriverError> {
        if !sbx_proto::image_ref::is_digest(image) || self.holds(image).await {
            return Ok(());
        }
        let root = self.store.root().display().to_string();
        let Some(source) = source else {
            return Err(DriverError::FailedPrecondition(format!(
                "image {image} is not in this node's image store ({root}) and the create names \
                 no image mirror to fetch it from: start the gateways with --image-mirror \
                 HOST:PORT (a registry every gateway and node reaches)"
            )));
        };
        let mirror = match Mirror::split_reference(source) {
            Some((mirror, pinned)) if pinned == image => mirror,
            _ => {
                return Err(DriverError::InvalidArgument(format!(
                    "the {IMAGE_SOURCE_HEADER} header {source:?} does not name image {image} \
                     (HOST:PORT/REPOSITORY@{image})"
                )));
            }
        };
        let store = self.store.clone();
        let reference = source.to_string();
        let digest = image.to_string();
        let count = Arc::clone(&self.fetched);
        let fetched = self
            .fetches
            .run(image, async move {
                let began = std::time::Instant::now();
                let pulled = tokio::time::timeout(
                    FETCH_TIMEOUT,
                    store.pull(&reference, &PullOptions::default(), &|_| {}),
                )
                .await;
                match pulled {
                    Ok(Ok(info)) if info.digest == digest => {
                        count.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        tracing::info!(image = %digest, from = %reference, layers = info.layers.len(), bytes = info.size, took = ?began.elapsed(), "image fetched from the mirror");
                        Ok(())
                    }
                    Ok(Ok(info)) => Err(Failure {
                        transient: false,
                        message: format!("the mirror served {} for it", info.digest),
                    }),
                    Ok(Err(e)) => Err(Failure {
                        transient: transient(&e),
                        message: e.to_string(),
                    }),
                    Err(_) => Err(Failure {
                        transient: true,
                        message: format!("the fetch took longer than {FETCH_TIMEOUT:?}"),
                    }),
                }
            })
            .await;
        fetched.map_err(|failure| {
            let message = format!(
                "image {image} is not in this node's image store and cannot be fetched from \
                 the image mirror {mirror}: {}",
                failure.message
            );
            tracing::warn!("{message}");
            if failure.transient {
                DriverError::Unavailable(message)
            } else {
                DriverError::FailedPrecondition(message)
            }
        })
    }

    async fn holds(&self, digest: &str) -> bool {
        let store = self.store.clone();
        let digest = digest.to_string();
        tokio::task::spawn_blocking(move || store.get(&digest).is_ok())
            .await
            .unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    fn digest(byte: &str) -> String {
        format!("sha256:{}", byte.repeat(64))
    }

    #[tokio::test]
    async fn one_transfer_per_key_at_a_time_and_every_waiter_gets_its_answer() {
        let flights = Flights::new();
        let runs = Arc::new(AtomicUsize::new(0));
        let (release, wait) = tokio::sync::oneshot::channel::<()>();
        let counted = Arc::clone(&runs);
        let first = {
            let flights = Arc::clone(&flights);
            tokio::spawn(async move {
                flights
                    .run("a", async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        let _ = wait.await;
                        Err(Failure {
                            transient: true,
                            message: "down".into(),
                        })
                    })
                    .await
            })
        };
        tokio::task::yield_now().await;
        while runs.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        // A second run of "a" while the first is under way joins it.
        let counted = Arc::clone(&runs);
        let second = {
            let flights = Arc::clone(&flights);
            tokio::spawn(async move {
                flights
                    .run("a", async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        Ok(())
                    })
                    .await
            })
        };
        tokio::task::yield_now().await;
        release.send(()).unwrap();
        for joined in [first, second] {
            let failure = joined.await.unwrap().unwrap_err();
            assert_eq!(failure.message, "down");
        }
        assert_eq!(runs.load(Ordering::SeqCst), 1);
        // Once it is over, a new run runs.
        flights.run("a", async { Ok(()) }).await.unwrap();
        assert!(flights.running.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_node_refuses_what_it_lacks_and_cannot_fetch_naming_image_and_mirror() {
        let dir = tempfile::tempdir().unwrap();
        let node = NodeImages::open(dir.path().join("images"), IdMap::default()).unwrap();
        let image = digest("a");
        // Not a digest: the driver's to refuse.
        node.ensure("", None).await.unwrap();
        node.ensure("busybox:latest", None).await.unwrap();
        // No source.
        let err = node.ensure(&image, None).await.unwrap_err();
        assert!(
            matches!(&err, DriverError::FailedPrecondition(m) if m.contains(&image) && m.contains("--image-mirror")),
            "{err}"
        );
        // A source that names another image, or is no mirror reference.
        let other = format!("127.0.0.1:9/sbx-images@{}", digest("b"));
        for bad in [other.as_str(), "127.0.0.1:9/sbx-images:latest"] {
            let err = node.ensure(&image, Some(bad)).await.unwrap_err();
            assert!(
                matches!(&err, DriverError::InvalidArgument(m) if m.contains(IMAGE_SOURCE_HEADER)),
                "{err}"
            );
        }
        // A mirror nobody listens on: transient, naming the image and the mirror.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mirror = Mirror::parse(&format!("127.0.0.1:{port}/p")).unwrap();
        let err = node
            .ensure(&image, Some(&mirror.reference(&image)))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, DriverError::Unavailable(m) if m.contains(&image) && m.contains(&mirror.to_string())),
            "{err}"
        );
        assert_eq!(
            std::fs::read_dir(node.store().root().join("tmp"))
                .unwrap()
                .count(),
            0
        );
    }

    #[tokio::test]
    async fn a_gateway_names_the_mirror_for_digests_only() {
        let mirror = Mirror::parse("127.0.0.1:1/x").unwrap();
        let source = ImageSource::new(mirror.clone(), None);
        let image = digest("c");
        assert_eq!(
            source.prepare(&image).await,
            Some(format!("127.0.0.1:1/x/sbx-images@{image}"))
        );
        assert_eq!(source.prepare("busybox").await, None);
        assert_eq!(source.prepare("").await, None);
        assert!(source.push(&image).await.is_err());
    }
}
