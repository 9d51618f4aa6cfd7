//! A store write outlives the future that asked for it (see `ObjectStore`): a sandbox create
//! queued by a workspace supervisor that is killed (or whose gateway shuts down) before the
//! store answers is still committed — possibly after the replacement supervisor has listed the
//! workspace's sandboxes. That record then has no actor and no supervisor that knows it.
//!
//! This is the stuck-Provisioning sandbox of the in-process soak (issue 13: "chaos seed 10:
//! ws-0/sb-0 … desired Running phase Provisioning (: )" through the whole 60 s settle window):
//! the reconciler routed the record's observations to its supervisor, heard "unknown", and did
//! nothing, every 100 ms. Here the store holds the create (`HeldStore`, which like the real
//! committer runs writes in queue order whether or not their caller still waits) until the
//! replacement has listed, so the window is hit every time.

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use common::{eventually, sleep_spec, test_config};
use futures::future::BoxFuture;
use sbx_actors::{ActorError, DriverSet, Gateway, SandboxSelector, WorkspaceSelector};
use sbx_driver_api::pb;
use sbx_driver_sim::{SimDriver, SimFaults, SimWorld};
use sbx_proto::v1::{Phase, Sandbox};
use sbx_storage::{Kind, ListQuery, NewRecord, ObjectStore, Page, Record, SledStore, StoreError};
use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

/// A store whose writes run one at a time, in the order they were asked, on a task of their
/// own (so a write whose caller was killed still happens), and can be held back.
struct HeldStore {
    inner: Arc<dyn ObjectStore>,
    queue: mpsc::UnboundedSender<BoxFuture<'static, ()>>,
    held: watch::Sender<bool>,
    sandbox_creates: AtomicUsize,
}

impl HeldStore {
    fn new(inner: Arc<dyn ObjectStore>) -> Arc<HeldStore> {
        let (queue, mut jobs) = mpsc::unbounded_channel::<BoxFuture<'static, ()>>();
        let (held, mut gate) = watch::channel(false);
        tokio::spawn(async move {
            while let Some(job) = jobs.recv().await {
                if gate.wait_for(|held| !held).await.is_err() {
                    return;
                }
                job.await;
            }
        });
        Arc::new(HeldStore {
            inner,
            queue,
            held,
            sandbox_creates: AtomicUsize::new(0),
        })
    }

    fn hold(&self, held: bool) {
        self.held.send_replace(held);
    }

    /// Sandbox creates asked so far (queued or done).
    fn sandbox_creates(&self) -> usize {
        self.sandbox_creates.load(Ordering::SeqCst)
    }

    async fn write<T: Send + 'static>(
        &self,
        write: impl Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (reply, answer) = oneshot::channel();
        self.queue
            .send(Box::pin(async move {
                let _ = reply.send(write.await);
            }))
            .map_err(|_| StoreError::Io("the held store's writer has stopped".into()))?;
        answer
            .await
            .map_err(|_| StoreError::Io("the held store dropped a write".into()))?
    }
}

#[async_trait]
impl ObjectStore for HeldStore {
    async fn create(&self, rec: NewRecord) -> Result<Record, StoreError> {
        if rec.kind == Kind::Sandbox {
            self.sandbox_creates.fetch_add(1, Ordering::SeqCst);
        }
        let inner = Arc::clone(&self.inner);
        self.write(async move { inner.create(rec).await }).await
    }
    async fn create_referring(
        &self,
        rec: NewRecord,
        refs: Vec<Uuid>,
    ) -> Result<Record, StoreError> {
        let inner = Arc::clone(&self.inner);
        self.write(async move { inner.create_referring(rec, refs).await })
            .await
    }
    async fn update(&self, rec: Record) -> Result<Record, StoreError> {
        let inner = Arc::clone(&self.inner);
        self.write(async move { inner.update(rec).await }).await
    }
    async fn delete(&self, id: Uuid, expected_version: u64) -> Result<Vec<Uuid>, StoreError> {
        let inner = Arc::clone(&self.inner);
        self.write(async move { inner.delete(id, expected_version).await })
            .await
    }
    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }
    async fn get_by_name(
        &self,
        kind: Kind,
        workspace: Option<Uuid>,
        name: &str,
    ) -> Result<Option<Record>, StoreError> {
        self.inner.get_by_name(kind, workspace, name).await
    }
    async fn list(&self, q: ListQuery) -> Result<Page, StoreError> {
        self.inner.list(q).await
    }
    async fn owned(&self, owner: Uuid) -> Result<Vec<Uuid>, StoreError> {
        self.inner.owned(owner).await
    }
    async fn referrers(&self, id: Uuid) -> Result<Vec<Uuid>, StoreError> {
        self.inner.referrers(id).await
    }
    async fn current_revision(&self) -> Result<u64, StoreError> {
        self.inner.current_revision().await
    }

    async fn integrity_problems(&self) -> Result<Vec<sbx_storage::IndexProblem>, StoreError> {
        self.inner.integrity_problems().await
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }
}

struct Setup {
    _dir: tempfile::TempDir,
    store: Arc<HeldStore>,
    world: SimWorld,
    gw: Arc<Gateway>,
    ws: Uuid,
}

async fn start_gateway(store: &Arc<HeldStore>, world: &SimWorld) -> Arc<Gateway> {
    let driver = Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
    let gw = Gateway::start(
        Arc::clone(store) as Arc<dyn ObjectStore>,
        DriverSet::single("sim", driver),
        test_config(),
    )
    .await
    .expect("the gateway starts");
    assert!(gw.wait_attached(Duration::from_secs(10)).await);
    Arc::new(gw)
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let sled: Arc<dyn ObjectStore> = Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
    let store = HeldStore::new(sled);
    let world = SimWorld::new();
    let gw = start_gateway(&store, &world).await;
    let ws = gw.create_workspace("ws", HashMap::new()).await.unwrap();
    let ws = Uuid::parse_str(&ws.id).unwrap();
    Setup {
        _dir: dir,
        store,
        world,
        gw,
        ws,
    }
}

/// Holds the store and starts creating sandbox `sb`; returns once that create is queued.
async fn create_held(s: &Setup) -> tokio::task::JoinHandle<Result<Sandbox, ActorError>> {
    s.store.hold(true);
    let before = s.store.sandbox_creates();
    let gw = Arc::clone(&s.gw);
    let creating =
        tokio::spawn(async move { gw.create_sandbox(Some("ws"), "sb", sleep_spec()).await });
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.store.sandbox_creates() > before
        })
        .await,
        "the supervisor never asked the store to create the sandbox"
    );
    creating
}

fn by_name() -> SandboxSelector {
    SandboxSelector::Name {
        workspace: Some("ws".into()),
        name: "sb".into(),
    }
}

/// Sweeps until the sandbox is Ready and running in the driver under its generation; panics
/// with its state after 40 sweeps (far more than a live actor needs without faults).
async fn sweeps_bring_it_up(gw: &Gateway, world: &SimWorld, ws: Uuid) {
    let mut last = None;
    for _ in 0..40 {
        gw.reconcile_now().await.expect("a sweep runs");
        let sb = gw.get_sandbox(&by_name()).await.expect("the record exists");
        let id = Uuid::parse_str(&sb.id).unwrap();
        let runs = world
            .snapshot(id)
            .is_some_and(|w| w.state() == pb::State::Running && w.generation == sb.generation);
        if sb.phase() == Phase::Ready && runs {
            let children = gw.supervised_sandboxes(ws).await.unwrap().unwrap();
            assert_eq!(
                children,
                vec![id],
                "the supervisor owns the sandbox it brought up"
            );
            return;
        }
        last = Some(sb);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sb = last.unwrap();
    let children = gw.supervised_sandboxes(ws).await.unwrap();
    panic!(
        "sandbox {} stayed {:?} ({}: {}) through 40 sweeps; its supervisor owns {children:?} — \
         a record nobody supervises is never driven",
        sb.id,
        sb.phase(),
        sb.reason,
        sb.message
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_committed_after_its_supervisor_restarted_is_driven_by_the_reconciler() {
    let s = setup().await;
    let creating = create_held(&s).await;
    let first = s.gw.workspace_supervisor(s.ws).await.unwrap().unwrap();
    first.kill();
    // The replacement lists the workspace while the create is still queued (it finds nothing).
    // Its mailbox is not asked meanwhile: it may be waiting on the held store.
    assert!(
        eventually(Duration::from_secs(10), || async {
            matches!(s.gw.workspace_supervisor(s.ws).await, Ok(Some(sup)) if sup.get_id() != first.get_id())
        })
        .await,
        "the workspace supervisor was not restarted"
    );
    // The gateway rides out the restart and asks the replacement again; that create queues
    // behind the first, which takes the name.
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.store.sandbox_creates() >= 2
        })
        .await,
        "the gateway did not send the create again"
    );
    s.store.hold(false);
    match creating.await.unwrap() {
        Err(ActorError::NameTaken { .. }) => {}
        other => panic!("the second create should find the name taken by the first, got {other:?}"),
    }
    let sb = s.gw.get_sandbox(&by_name()).await.unwrap();
    assert_eq!(sb.phase(), Phase::Provisioning, "{sb:?}");
    assert_eq!(
        s.gw.supervised_sandboxes(s.ws).await.unwrap(),
        Some(vec![]),
        "the record landed after the replacement listed the workspace: nobody supervises it"
    );
    sweeps_bring_it_up(&s.gw, &s.world, s.ws).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_committed_after_a_gateway_restart_is_driven_by_the_reconciler() {
    let mut s = setup().await;
    let creating = create_held(&s).await;
    assert!(
        s.gw.shutdown().await,
        "actors let go of the gateway context"
    );
    // The caller hears that the gateway went away; its create is still queued.
    assert!(
        creating.await.unwrap().is_err(),
        "a create whose gateway shut down cannot have been answered"
    );
    s.gw = start_gateway(&s.store, &s.world).await;
    assert_eq!(s.gw.supervised_sandboxes(s.ws).await.unwrap(), Some(vec![]));
    s.store.hold(false);
    assert!(
        eventually(Duration::from_secs(10), || async {
            s.gw.get_sandbox(&by_name()).await.is_ok()
        })
        .await,
        "the queued create never landed"
    );
    sweeps_bring_it_up(&s.gw, &s.world, s.ws).await;
    let _ =
        s.gw.delete_workspace(&WorkspaceSelector::Name("ws".into()), true)
            .await;
}
