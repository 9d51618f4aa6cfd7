//! Providers, attachments, settings and service endpoints: what hangs off a sandbox or a
//! workspace never outlives its owner, never re-attaches to a new object of the same name, and
//! a reference never dangles — with the two races that matter driven both ways by a gate in
//! the store.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use common::*;
use sbx_actors::{
    ActorError, DriverSet, Gateway, ProviderSelector, SandboxSelector, WorkspaceSelector,
};
use sbx_driver_sim::{SimDriver, SimFaults, SimWorld};
use sbx_proto::v1::{Phase, Sandbox};
use sbx_storage::{
    Kind, ListQuery, NewRecord, ObjectStore, Page, Record, Scope, SledStore, StoreError,
};
use tokio::sync::oneshot;
use uuid::Uuid;

/// Which store call the gate holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// The next `create_referring` (an attach's transaction).
    Attach,
    /// The next `delete` of this id.
    Delete(Uuid),
}

struct Armed {
    what: Held,
    reached: oneshot::Sender<()>,
    release: oneshot::Receiver<()>,
}

/// A store that can hold one chosen write at its door until the test lets it in: the write has
/// been asked for (its caller checked what it checks first) but not committed.
struct GatedStore {
    inner: Arc<SledStore>,
    armed: Mutex<Option<Armed>>,
}

/// The test's side of an armed gate.
struct GateHandle {
    reached: oneshot::Receiver<()>,
    release: oneshot::Sender<()>,
}

impl GatedStore {
    fn arm(&self, what: Held) -> GateHandle {
        let (reached_tx, reached) = oneshot::channel();
        let (release, release_rx) = oneshot::channel();
        *self.armed.lock().unwrap() = Some(Armed {
            what,
            reached: reached_tx,
            release: release_rx,
        });
        GateHandle { reached, release }
    }

    async fn pass(&self, what: Held) {
        let armed = {
            let mut slot = self.armed.lock().unwrap();
            match slot.as_ref() {
                Some(a) if a.what == what => slot.take(),
                _ => None,
            }
        };
        if let Some(a) = armed {
            let _ = a.reached.send(());
            let _ = a.release.await;
        }
    }
}

#[async_trait]
impl ObjectStore for GatedStore {
    async fn create(&self, rec: NewRecord) -> Result<Record, StoreError> {
        self.inner.create(rec).await
    }
    async fn create_referring(
        &self,
        rec: NewRecord,
        refs: Vec<Uuid>,
    ) -> Result<Record, StoreError> {
        self.pass(Held::Attach).await;
        self.inner.create_referring(rec, refs).await
    }
    async fn update(&self, rec: Record) -> Result<Record, StoreError> {
        self.inner.update(rec).await
    }
    async fn delete(&self, id: Uuid, expected_version: u64) -> Result<Vec<Uuid>, StoreError> {
        self.pass(Held::Delete(id)).await;
        self.inner.delete(id, expected_version).await
    }
    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        self.inner.get(id).await
    }
    async fn get_by_name(
        &self,
        kind: Kind,
        scope: Option<Uuid>,
        name: &str,
    ) -> Result<Option<Record>, StoreError> {
        self.inner.get_by_name(kind, scope, name).await
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
    sled: Arc<SledStore>,
    store: Arc<GatedStore>,
    world: SimWorld,
    gw: Arc<Gateway>,
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let sled = Arc::new(SledStore::open(&dir.path().join("store")).unwrap());
    let store = Arc::new(GatedStore {
        inner: Arc::clone(&sled),
        armed: Mutex::new(None),
    });
    let world = SimWorld::new();
    let driver = Arc::new(SimDriver::new(world.clone(), SimFaults::default()));
    let gw = Gateway::start(
        store.clone() as Arc<dyn ObjectStore>,
        DriverSet::single("sim", driver),
        test_config(),
    )
    .await
    .unwrap();
    assert!(gw.wait_attached(Duration::from_secs(10)).await);
    Setup {
        _dir: dir,
        sled,
        store,
        world,
        gw: Arc::new(gw),
    }
}

const SECRET: &str = "ghp_s3cr3t-value-never-shown";

fn creds(pairs: &[(&str, &str)]) -> HashMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn by_name(ws: &str, name: &str) -> SandboxSelector {
    SandboxSelector::Name {
        workspace: Some(ws.to_string()),
        name: name.to_string(),
    }
}

fn provider_named(ws: &str, name: &str) -> ProviderSelector {
    ProviderSelector::Name {
        workspace: Some(ws.to_string()),
        name: name.to_string(),
    }
}

async fn ready_sandbox(s: &Setup, ws: &str, name: &str, providers: &[&str]) -> Sandbox {
    let providers: Vec<String> = providers.iter().map(|p| p.to_string()).collect();
    let sb =
        s.gw.create_sandbox_with(Some(ws), name, sleep_spec(), false, &providers)
            .await
            .unwrap();
    wait_phase(&s.gw, &by_id(&sb), Phase::Ready, Duration::from_secs(10)).await
}

/// Every owned record's owner exists, every reference's target exists, and the indexes agree.
async fn assert_no_orphans(s: &Setup) {
    // The store's check runs with no write under way (events are written a moment after).
    assert!(s.gw.events_written(Duration::from_secs(10)).await);
    let problems = s.sled.verify_indexes().unwrap();
    assert!(problems.is_empty(), "fsck: {problems:#?}");
    for kind in [
        Kind::Setting,
        Kind::Attachment,
        Kind::Service,
        Kind::Provider,
    ] {
        let records = s
            .sled
            .list(ListQuery::new(kind, Scope::All, 0))
            .await
            .unwrap()
            .records;
        for r in records {
            if let Some(owner) = r.owner {
                assert!(
                    s.sled.get(owner).await.unwrap().is_some(),
                    "{kind} {} is owned by missing {owner}",
                    r.id
                );
            }
            for target in &r.refs {
                assert!(
                    s.sled.get(*target).await.unwrap().is_some(),
                    "{kind} {} refers to missing {target}",
                    r.id
                );
            }
        }
    }
}

#[tokio::test]
async fn credentials_reach_every_start_and_no_answer_shows_them() {
    let s = setup().await;
    let gw = &s.gw;
    let p = gw
        .create_provider(
            None,
            "github",
            "github",
            creds(&[("GITHUB_TOKEN", SECRET)]),
            creds(&[("host", "git.example.test")]),
        )
        .await
        .unwrap();
    assert_eq!(p.credentials.len(), 1);
    assert_eq!(p.credentials[0].name, "GITHUB_TOKEN");
    assert_eq!(p.credentials[0].fingerprint.len(), 16);
    let sb = ready_sandbox(&s, "default", "agent", &["github"]).await;
    let env = s.world.run_env(uuid(&sb)).unwrap();
    assert_eq!(env.get("GITHUB_TOKEN").map(String::as_str), Some(SECRET));

    // A rotated credential reaches the next start.
    gw.update_provider(
        &provider_named("default", "github"),
        creds(&[("GITHUB_TOKEN", "rotated")]),
        &[],
        HashMap::new(),
        &[],
    )
    .await
    .unwrap();
    gw.restart_sandbox(&by_id(&sb)).await.unwrap();
    wait_phase(gw, &by_id(&sb), Phase::Ready, Duration::from_secs(10)).await;
    let env = s.world.run_env(uuid(&sb)).unwrap();
    assert_eq!(env.get("GITHUB_TOKEN").map(String::as_str), Some("rotated"));

    // No read answers a value: get, list, attachments, the sandbox itself.
    let shown = format!(
        "{:?} {:?} {:?} {:?} {:?}",
        gw.get_provider(&provider_named("default", "github"))
            .await
            .unwrap(),
        gw.list_providers(None, true, 0, "").await.unwrap().items,
        gw.list_attachments(&by_id(&sb)).await.unwrap(),
        gw.get_sandbox(&by_id(&sb)).await.unwrap(),
        gw.list_sandboxes(&Default::default(), 0, "")
            .await
            .unwrap()
            .items,
    );
    for value in [SECRET, "rotated"] {
        assert!(!shown.contains(value), "a read showed {value}: {shown}");
    }
    // Nor the store, in the clear.
    let raw = s
        .sled
        .get(Uuid::parse_str(&p.id).unwrap())
        .await
        .unwrap()
        .unwrap();
    assert!(!raw.body.windows(7).any(|w| w == b"rotated"));
}

#[tokio::test]
async fn a_referenced_provider_is_not_deleted_and_every_user_is_named() {
    let s = setup().await;
    let gw = &s.gw;
    gw.create_workspace("team", HashMap::new()).await.unwrap();
    gw.create_provider(
        Some("team"),
        "openai",
        "openai",
        creds(&[("OPENAI_API_KEY", SECRET)]),
        HashMap::new(),
    )
    .await
    .unwrap();
    ready_sandbox(&s, "team", "b", &["openai"]).await;
    ready_sandbox(&s, "team", "a", &[]).await;
    gw.attach_provider(&by_name("team", "a"), "openai")
        .await
        .unwrap();
    match gw
        .delete_provider(&provider_named("team", "openai"), false)
        .await
    {
        Err(ActorError::ProviderInUse { provider, users }) => {
            assert_eq!(provider, "team/openai");
            assert_eq!(users, vec!["team/a", "team/b"]);
        }
        other => panic!("delete of a provider in use: {other:?}"),
    }
    // Forced: both detached, and said so.
    let (deleted, detached) = gw
        .delete_provider(&provider_named("team", "openai"), true)
        .await
        .unwrap();
    assert!(deleted);
    assert_eq!(detached, vec!["team/a", "team/b"]);
    assert!(
        gw.list_attachments(&by_name("team", "a"))
            .await
            .unwrap()
            .is_empty()
    );

    // A provider made again under the old name binds to nothing: the old sandboxes' next
    // start has none of its credentials.
    gw.create_provider(
        Some("team"),
        "openai",
        "openai",
        creds(&[("OPENAI_API_KEY", "new-key")]),
        HashMap::new(),
    )
    .await
    .unwrap();
    let b = gw.get_sandbox(&by_name("team", "b")).await.unwrap();
    gw.restart_sandbox(&by_id(&b)).await.unwrap();
    wait_phase(gw, &by_id(&b), Phase::Ready, Duration::from_secs(10)).await;
    let env = s.world.run_env(uuid(&b)).unwrap();
    assert!(!env.contains_key("OPENAI_API_KEY"), "{env:?}");
    assert!(gw.list_attachments(&by_id(&b)).await.unwrap().is_empty());
    assert_no_orphans(&s).await;
}

/// The attach reads the provider, then (held at the store's door) the provider's delete
/// commits, then the attach's transaction runs: it finds the provider gone and writes nothing.
#[tokio::test]
async fn delete_between_an_attachs_check_and_its_write_leaves_no_attachment() {
    let s = setup().await;
    let gw = Arc::clone(&s.gw);
    gw.create_provider(
        None,
        "p",
        "generic",
        creds(&[("TOKEN", SECRET)]),
        HashMap::new(),
    )
    .await
    .unwrap();
    let sb = ready_sandbox(&s, "default", "sb", &[]).await;
    let gate = s.store.arm(Held::Attach);
    let attach = {
        let gw = Arc::clone(&gw);
        let sel = by_id(&sb);
        tokio::spawn(async move { gw.attach_provider(&sel, "p").await })
    };
    gate.reached.await.unwrap();
    let (deleted, detached) = gw
        .delete_provider(&provider_named("default", "p"), false)
        .await
        .unwrap();
    assert!(deleted && detached.is_empty());
    gate.release.send(()).unwrap();
    match attach.await.unwrap() {
        Err(ActorError::ObjectNotFound {
            kind: "provider", ..
        }) => {}
        other => panic!("an attach to a provider deleted under it: {other:?}"),
    }
    assert!(gw.list_attachments(&by_id(&sb)).await.unwrap().is_empty());
    assert_no_orphans(&s).await;
}

/// The delete looks (no attachment yet), then (held at the store's door) an attach commits,
/// then the delete's transaction runs: the provider is referred to, and the delete, looking
/// again, refuses and names the sandbox.
#[tokio::test]
async fn attach_between_a_deletes_check_and_its_write_keeps_the_provider() {
    let s = setup().await;
    let gw = Arc::clone(&s.gw);
    let p = gw
        .create_provider(
            None,
            "p",
            "generic",
            creds(&[("TOKEN", SECRET)]),
            HashMap::new(),
        )
        .await
        .unwrap();
    let sb = ready_sandbox(&s, "default", "sb", &[]).await;
    let gate = s.store.arm(Held::Delete(Uuid::parse_str(&p.id).unwrap()));
    let delete = {
        let gw = Arc::clone(&gw);
        tokio::spawn(async move {
            gw.delete_provider(&provider_named("default", "p"), false)
                .await
        })
    };
    gate.reached.await.unwrap();
    gw.attach_provider(&by_id(&sb), "p").await.unwrap();
    gate.release.send(()).unwrap();
    match delete.await.unwrap() {
        Err(ActorError::ProviderInUse { users, .. }) => assert_eq!(users, vec!["default/sb"]),
        other => panic!("a delete that lost the race to an attach: {other:?}"),
    }
    assert!(
        gw.get_provider(&provider_named("default", "p"))
            .await
            .is_ok()
    );
    // And the attachment works: the next start has the credential.
    gw.restart_sandbox(&by_id(&sb)).await.unwrap();
    wait_phase(&gw, &by_id(&sb), Phase::Ready, Duration::from_secs(10)).await;
    assert_eq!(
        s.world
            .run_env(uuid(&sb))
            .unwrap()
            .get("TOKEN")
            .map(String::as_str),
        Some(SECRET)
    );
    assert_no_orphans(&s).await;
}

/// A settings write that reaches the sandbox's actor after its delete (queued behind it in
/// the mailbox while the delete's transaction is held) is NOT_FOUND and writes nothing; one
/// before it dies with the sandbox; a new sandbox of the same name inherits neither settings
/// nor services.
#[tokio::test]
async fn settings_and_services_die_with_their_sandbox_and_never_reattach() {
    let s = setup().await;
    let gw = Arc::clone(&s.gw);
    let sb = ready_sandbox(&s, "default", "agent", &[]).await;
    gw.set_settings(
        &by_id(&sb),
        creds(&[("approval-mode", "suggest"), ("team", "blue")]),
    )
    .await
    .unwrap();
    gw.expose_service(&by_id(&sb), 8000, "web").await.unwrap();
    assert_eq!(
        s.world
            .run_env(uuid(&sb))
            .unwrap()
            .get("SBX_SETTING_APPROVAL_MODE"),
        None,
        "the running workload started before the setting"
    );
    let gate = s.store.arm(Held::Delete(uuid(&sb)));
    let delete = {
        let gw = Arc::clone(&gw);
        let sel = by_id(&sb);
        tokio::spawn(async move { gw.delete_sandbox(&sel).await })
    };
    gate.reached.await.unwrap();
    let late = {
        let gw = Arc::clone(&gw);
        let sel = by_id(&sb);
        tokio::spawn(async move {
            gw.set_settings(&sel, creds(&[("approval-mode", "full-auto")]))
                .await
        })
    };
    // Give the late write time to queue behind the delete in the actor's mailbox.
    tokio::time::sleep(Duration::from_millis(50)).await;
    gate.release.send(()).unwrap();
    assert!(delete.await.unwrap().unwrap());
    match late.await.unwrap() {
        Err(ActorError::SandboxNotFound { .. }) => {}
        other => panic!("a settings write after the delete: {other:?}"),
    }
    assert_no_orphans(&s).await;
    let settings = s
        .sled
        .list(ListQuery::new(Kind::Setting, Scope::All, 0))
        .await
        .unwrap()
        .records;
    assert!(settings.is_empty(), "{settings:?}");

    let again = ready_sandbox(&s, "default", "agent", &[]).await;
    assert!(
        gw.list_settings(&by_id(&again), 0, "")
            .await
            .unwrap()
            .items
            .is_empty()
    );
    assert!(matches!(
        gw.get_setting(&by_id(&again), "approval-mode").await,
        Err(ActorError::ObjectNotFound {
            kind: "setting",
            ..
        })
    ));
    assert!(
        gw.list_services(Some(&by_id(&again)), None, false)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        gw.route_service_host("web--agent--default.localhost")
            .await
            .is_err()
    );
    let env = s.world.run_env(uuid(&again)).unwrap();
    assert!(!env.contains_key("SBX_SETTING_APPROVAL_MODE"), "{env:?}");
}

#[tokio::test]
async fn settings_reach_the_next_start_and_bad_ones_are_refused_whole() {
    let s = setup().await;
    let gw = &s.gw;
    let sb = ready_sandbox(&s, "default", "agent", &[]).await;
    gw.set_settings(
        &by_id(&sb),
        creds(&[("approval-mode", "auto-edit"), ("max-steps", "40")]),
    )
    .await
    .unwrap();
    gw.restart_sandbox(&by_id(&sb)).await.unwrap();
    wait_phase(gw, &by_id(&sb), Phase::Ready, Duration::from_secs(10)).await;
    let env = s.world.run_env(uuid(&sb)).unwrap();
    assert_eq!(env["SBX_SETTING_APPROVAL_MODE"], "auto-edit");
    assert_eq!(env["SBX_SETTING_MAX_STEPS"], "40");
    // One bad value refuses the whole request: nothing of it is written.
    match gw
        .set_settings(
            &by_id(&sb),
            creds(&[("approval-mode", "yolo"), ("other", "x")]),
        )
        .await
    {
        Err(ActorError::InvalidArgument(msg)) => assert!(msg.contains("suggest"), "{msg}"),
        other => panic!("{other:?}"),
    }
    assert!(gw.get_setting(&by_id(&sb), "other").await.is_err());
    assert_eq!(
        gw.get_setting(&by_id(&sb), "approval-mode")
            .await
            .unwrap()
            .value,
        "auto-edit"
    );
    assert!(gw.delete_setting(&by_id(&sb), "max-steps").await.unwrap());
    assert!(!gw.delete_setting(&by_id(&sb), "max-steps").await.unwrap());
    // Listing pages in key order to the end.
    let many: HashMap<String, String> = (0..250)
        .map(|i| (format!("k-{i:03}"), "v".to_string()))
        .collect();
    gw.set_settings(&by_id(&sb), many).await.unwrap();
    let mut keys = Vec::new();
    let mut token = String::new();
    for _ in 0..10 {
        let page = gw.list_settings(&by_id(&sb), 100, &token).await.unwrap();
        keys.extend(page.items.into_iter().map(|s| s.key));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(keys.len(), 251);
    assert!(keys.windows(2).all(|w| w[0] < w[1]), "key order");
}

/// A sandbox with more than a thousand owned records is deleted in one transaction, and a
/// workspace is refused deletion naming every blocker, then cascaded to nothing.
#[tokio::test]
async fn owned_records_cascade_and_workspace_blockers_are_named() {
    let s = setup().await;
    let gw = &s.gw;
    gw.create_workspace("team", HashMap::new()).await.unwrap();
    gw.create_provider(
        Some("team"),
        "github",
        "github",
        creds(&[("GITHUB_TOKEN", SECRET)]),
        HashMap::new(),
    )
    .await
    .unwrap();
    let big = ready_sandbox(&s, "team", "big", &["github"]).await;
    let settings: HashMap<String, String> = (0..1_500)
        .map(|i| (format!("k-{i}"), format!("{i}")))
        .collect();
    gw.set_settings(&by_id(&big), settings).await.unwrap();
    gw.expose_service(&by_id(&big), 8000, "web").await.unwrap();
    // 1,500 settings, an attachment, a service and its events (Created, Started).
    let events = two_events(gw, &big).await;
    assert_eq!(
        s.sled.owned(uuid(&big)).await.unwrap().len(),
        1_502 + events
    );
    match gw
        .delete_workspace(&WorkspaceSelector::Name("team".into()), false)
        .await
    {
        Err(ActorError::WorkspaceNotEmpty { blockers, .. }) => assert_eq!(
            blockers,
            vec![
                "sandbox team/big",
                "service team/big/web",
                "provider team/github"
            ]
        ),
        other => panic!("{other:?}"),
    }
    let small = ready_sandbox(&s, "team", "small", &[]).await;
    assert!(gw.delete_sandbox(&by_id(&big)).await.unwrap());
    assert!(s.sled.owned(uuid(&big)).await.unwrap().is_empty());
    assert_no_orphans(&s).await;
    gw.set_settings(&by_id(&small), creds(&[("k", "v")]))
        .await
        .unwrap();
    assert!(
        gw.delete_workspace(&WorkspaceSelector::Name("team".into()), true)
            .await
            .unwrap()
    );
    for kind in Kind::ALL {
        let left: Vec<Record> = s
            .sled
            .list(ListQuery::new(kind, Scope::All, 0))
            .await
            .unwrap()
            .records
            .into_iter()
            .filter(|r| r.kind != Kind::Workspace && r.kind != Kind::Image)
            .collect();
        assert!(left.is_empty(), "{kind} left after the cascade: {left:?}");
    }
    assert_no_orphans(&s).await;
}

#[tokio::test]
async fn a_service_host_routes_by_the_endpoints_own_sandbox() {
    let s = setup().await;
    let gw = &s.gw;
    for ws in ["red", "blue"] {
        gw.create_workspace(ws, HashMap::new()).await.unwrap();
    }
    let red = ready_sandbox(&s, "red", "app", &[]).await;
    let blue = ready_sandbox(&s, "blue", "app", &[]).await;
    let e = gw.expose_service(&by_id(&red), 8000, "").await.unwrap();
    assert_eq!(e.name, "web");
    assert_eq!(e.host, "web--app--red.localhost");
    gw.expose_service(&by_id(&blue), 9000, "web").await.unwrap();
    let t = gw
        .route_service_host("web--app--red.localhost:8080")
        .await
        .unwrap();
    assert_eq!((t.sandbox_id, t.port), (uuid(&red), 8000));
    let t = gw
        .route_service_host("WEB--app--blue.localhost")
        .await
        .unwrap();
    assert_eq!((t.sandbox_id, t.port), (uuid(&blue), 9000));
    for bad in [
        "web--app--green.localhost",
        "web--app--red.example",
        "nope",
        "",
    ] {
        assert!(gw.route_service_host(bad).await.is_err(), "{bad}");
    }
    assert!(matches!(
        gw.expose_service(&by_id(&red), 8001, "web").await,
        Err(ActorError::NameTaken { .. })
    ));
    for (name, port) in [("a--b", 80), ("web2", 0), ("web3", 70_000)] {
        assert!(matches!(
            gw.expose_service(&by_id(&red), port, name).await,
            Err(ActorError::InvalidArgument(_) | ActorError::InvalidName { .. })
        ));
    }
    // Deleted with its sandbox: the Host no longer routes, and the other workspace's does.
    gw.delete_sandbox(&by_id(&red)).await.unwrap();
    assert!(
        gw.route_service_host("web--app--red.localhost")
            .await
            .is_err()
    );
    assert!(
        gw.route_service_host("web--app--blue.localhost")
            .await
            .is_ok()
    );
}

/// The measurement of issue 16: deleting a sandbox that owns 10,000 settings. The store's
/// delete is one transaction (the global revision moves by one), and the API's delete (its
/// actor records Deleting, asks the driver, deletes the record) is timed around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_owning_ten_thousand_settings_is_deleted_in_one_transaction() {
    let s = setup().await;
    let gw = &s.gw;
    let sb = ready_sandbox(&s, "default", "big", &[]).await;
    let settings: HashMap<String, String> = (0..10_000)
        .map(|i| (format!("k-{i}"), "v".to_string()))
        .collect();
    let began = std::time::Instant::now();
    gw.set_settings(&by_id(&sb), settings).await.unwrap();
    let set_took = began.elapsed();
    // It owns its settings and its events (Created, Started).
    let events = two_events(gw, &sb).await;
    assert_eq!(
        s.sled.owned(uuid(&sb)).await.unwrap().len(),
        10_000 + events
    );

    let before = s.sled.current_revision().await.unwrap();
    let began = std::time::Instant::now();
    assert!(gw.delete_sandbox(&by_id(&sb)).await.unwrap());
    let delete_took = began.elapsed();
    let after = s.sled.current_revision().await.unwrap();
    // Deleting recorded (one write), then the record and its 10,000 settings (one).
    assert_eq!(after - before, 2, "revisions the delete used");
    assert!(s.sled.owned(uuid(&sb)).await.unwrap().is_empty());
    let left = s
        .sled
        .list(ListQuery::new(Kind::Setting, Scope::All, 0))
        .await
        .unwrap()
        .records;
    assert!(left.is_empty());
    assert_no_orphans(&s).await;

    // The store's delete alone, on a second sandbox record with 10,000 settings.
    let ws = s
        .sled
        .get_by_name(Kind::Workspace, None, "default")
        .await
        .unwrap()
        .unwrap();
    let owner = s
        .sled
        .create(NewRecord {
            id: Uuid::new_v4(),
            kind: Kind::Sandbox,
            workspace: Some(ws.id),
            name: "raw".into(),
            owner: None,
            labels: Default::default(),
            created_at_ms: 1,
            body: Vec::new(),
        })
        .await
        .unwrap();
    for i in 0..10_000 {
        s.sled
            .create(NewRecord {
                id: Uuid::new_v4(),
                kind: Kind::Setting,
                workspace: Some(ws.id),
                name: format!("k-{i}"),
                owner: Some(owner.id),
                labels: Default::default(),
                created_at_ms: 2,
                body: Vec::new(),
            })
            .await
            .unwrap();
    }
    let before = s.sled.current_revision().await.unwrap();
    let began = std::time::Instant::now();
    let deleted = s
        .sled
        .delete(owner.id, owner.resource_version)
        .await
        .unwrap();
    let store_took = began.elapsed();
    assert_eq!(deleted.len(), 10_001);
    assert_eq!(
        s.sled.current_revision().await.unwrap() - before,
        1,
        "one transaction"
    );
    println!(
        "10,000 settings: set in one request {set_took:?}; sandbox delete through the API {delete_took:?}; the store's cascading delete alone {store_took:?} (one transaction)"
    );
}

/// A create asking for a network policy from a driver without a network (here the sim) is
/// FAILED_PRECONDITION before anything is written: no sandbox is left parked in Error, and
/// the policy is never ignored. Mode none is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_network_policy_on_a_driver_without_a_network_is_refused_before_any_write() {
    use sbx_proto::v1::{NetworkMode, NetworkPolicy};
    let s = setup().await;
    let mut spec = sleep_spec();
    spec.network = Some(NetworkPolicy {
        mode: NetworkMode::Policy as i32,
        allow: vec!["10.0.0.1:443".into()],
    });
    let err =
        s.gw.create_sandbox_with(None, "netted", spec, false, &[])
            .await
            .unwrap_err();
    assert!(
        matches!(&err, sbx_actors::ActorError::FailedPrecondition(m) if m.contains("no network")),
        "{err:?}"
    );
    let listed =
        s.gw.list_sandboxes(&Default::default(), 0, "")
            .await
            .unwrap();
    assert!(
        listed.items.is_empty(),
        "a record was written: {:?}",
        listed.items
    );
    let mut none = sleep_spec();
    none.network = Some(NetworkPolicy {
        mode: NetworkMode::None as i32,
        allow: Vec::new(),
    });
    s.gw.create_sandbox_with(None, "plain", none, false, &[])
        .await
        .unwrap();
}

/// The events of a sandbox just made Ready: Created and Started, written by tasks of their
/// own a moment after the changes they tell of (bounded: 10 s).
async fn two_events(gw: &sbx_actors::Gateway, sb: &sbx_proto::v1::Sandbox) -> usize {
    let began = std::time::Instant::now();
    loop {
        let events = gw.sandbox_events(&by_id(sb)).await.unwrap();
        if events.len() == 2 {
            return 2;
        }
        assert!(
            began.elapsed() < std::time::Duration::from_secs(10),
            "{events:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
