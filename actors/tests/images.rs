//! Images as gateway objects, against a real sled store, a real image store in a temp dir and
//! the sim driver reporting `images`: records, re-tags, resolution and pinning at create,
//! deletion refused while pinned, and the races between the two.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sbx_actors::{
    ActorError, Config, DriverSet, Gateway, ImageScope, ImageSelector, RestartPolicy,
};
use sbx_driver_sim::{SimDriver, SimFaults, SimWorld};
use sbx_images::{IdMap, ImageStore};
use sbx_proto::v1::{Image, Sandbox, SandboxSpec};
use sbx_storage::{Kind, ListQuery, ObjectStore, Scope, SledStore};
use tempfile::TempDir;
use uuid::Uuid;

const DEFAULT: &str = "localhost/base:latest";
const T: Duration = Duration::from_secs(10);

struct Env {
    dir: TempDir,
    store: Arc<dyn ObjectStore>,
    world: SimWorld,
    /// A sim driver without images, for "behaviour stays as today".
    plain_world: SimWorld,
    gw: Gateway,
}

async fn env() -> Env {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(SledStore::open(&dir.path().join("db")).unwrap());
    env_over(dir, store).await
}

/// A gateway over the store and the image store of `dir` (a second one after a first's
/// shutdown: a restart).
async fn env_over(dir: TempDir, store: Arc<dyn ObjectStore>) -> Env {
    let images = ImageStore::open(dir.path().join("images"), IdMap::default()).unwrap();
    let world = SimWorld::new();
    let plain_world = SimWorld::new();
    let drivers = DriverSet::single(
        "sim",
        Arc::new(SimDriver::new(world.clone(), SimFaults::default()).with_images(true)),
    )
    .with(
        "plain",
        Arc::new(SimDriver::new(plain_world.clone(), SimFaults::default())),
    );
    let config = Config {
        driver_call_timeout: Duration::from_millis(500),
        retry_backoff: Duration::from_millis(10),
        reconcile_interval: Duration::ZERO,
        request_timeout: Duration::from_secs(20),
        sandbox_restarts: RestartPolicy {
            base_backoff: Duration::from_millis(5),
            ..RestartPolicy::default()
        },
        image_store: Some(images),
        default_image: DEFAULT.into(),
        ..Config::default()
    };
    let gw = Gateway::start(Arc::clone(&store), drivers, config)
        .await
        .unwrap();
    assert!(gw.wait_attached(T).await);
    Env {
        dir,
        store,
        world,
        plain_world,
        gw,
    }
}

/// A root-filesystem tar whose one file holds `content` (so different contents, different
/// digests).
fn rootfs_tar(dir: &Path, file: &str, content: &str) -> PathBuf {
    let path = dir.join(format!("{file}-{}.tar", Uuid::new_v4()));
    let mut builder = tar::Builder::new(std::fs::File::create(&path).unwrap());
    let mut header = tar::Header::new_gnu();
    header.set_size(content.len() as u64);
    header.set_mode(0o644);
    header.set_uid(0);
    header.set_gid(0);
    header.set_entry_type(tar::EntryType::Regular);
    builder
        .append_data(&mut header, format!("etc/{file}"), content.as_bytes())
        .unwrap();
    builder.finish().unwrap();
    path
}

/// Imports into the default workspace.
async fn import(env: &Env, name: &str, content: &str) -> Image {
    import_into(env, name, content, default_scope(env).await).await
}

async fn import_into(env: &Env, name: &str, content: &str, scope: ImageScope) -> Image {
    let tar = rootfs_tar(env.dir.path(), "marker", content);
    let mut images = env
        .gw
        .import_image(&tar, Some(name), scope, Default::default())
        .await
        .unwrap();
    assert_eq!(images.len(), 1);
    images.remove(0)
}

fn spec(image: &str, command: &[&str]) -> SandboxSpec {
    SandboxSpec {
        image: image.into(),
        command: command.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn sandbox_id(sb: &Sandbox) -> Uuid {
    Uuid::parse_str(&sb.id).unwrap()
}

/// The image the sim driver was given for this sandbox (once its create reached it).
async fn driver_image(world: &SimWorld, sb: &Sandbox) -> String {
    let id = sandbox_id(sb);
    let deadline = tokio::time::Instant::now() + T;
    loop {
        if let Some(spec) = world.spec(id) {
            return spec.image;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the driver never got sandbox {}",
            sb.name
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn by_name(name: &str) -> ImageSelector {
    ImageSelector::parse("", name).unwrap()
}

/// The images of the default workspace (and the gateway's).
async fn default_scope(env: &Env) -> ImageScope {
    env.gw.image_scope(None, false).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_pins_the_digest_and_a_retag_changes_nothing_under_it() {
    let env = env().await;
    let v1 = import(&env, "app:v1", "one").await;
    assert_eq!(v1.name, "docker.io/library/app:v1");
    assert!(v1.digest.starts_with("sha256:"), "{}", v1.digest);
    assert_eq!(v1.config.as_ref().unwrap().cmd, vec!["sh".to_string()]);

    let first = env
        .gw
        .create_sandbox(None, "first", spec("app:v1", &["sleep", "1"]))
        .await
        .unwrap();
    let pinned = first.spec.as_ref().unwrap();
    assert_eq!(pinned.image_digest, v1.digest);
    assert_eq!(pinned.image, "app:v1", "the reference is kept as given");
    assert_eq!(driver_image(&env.world, &first).await, v1.digest);

    // Re-tag: the same name now names another digest, by an update of the same record.
    let v2 = import(&env, "app:v1", "two").await;
    assert_ne!(v2.digest, v1.digest);
    assert_eq!(v2.id, v1.id, "a re-tag updates the record");
    assert!(v2.resource_version > v1.resource_version);
    let records = env
        .store
        .list(ListQuery::new(Kind::Image, Scope::All, 0))
        .await
        .unwrap();
    assert_eq!(records.records.len(), 1);

    // The existing sandbox keeps its digest, in the record and through a restart.
    let sel = sbx_actors::SandboxSelector::Id(sandbox_id(&first));
    let restarted = env.gw.restart_sandbox(&sel).await.unwrap();
    assert_eq!(restarted.spec.unwrap().image_digest, v1.digest);
    assert_eq!(env.world.spec(sandbox_id(&first)).unwrap().image, v1.digest);

    // A new sandbox gets the new digest.
    let second = env
        .gw
        .create_sandbox(None, "second", spec("docker.io/library/app:v1", &["sleep"]))
        .await
        .unwrap();
    assert_eq!(second.spec.unwrap().image_digest, v2.digest);

    // The old digest is still usable by digest only while some record holds it: none does.
    let err = env
        .gw
        .create_sandbox(None, "third", spec(&v1.digest, &["sleep"]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ActorError::ImageNotFound(m) if m.contains(&v1.digest)),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn references_resolve_by_name_digest_and_name_at_digest_and_empty_is_the_default() {
    let env = env().await;
    let base = import(&env, DEFAULT, "base").await;
    let app = import(&env, "localhost:5000/team/app:v1", "app").await;
    // The same digest under a second name is a second record.
    let alias = import(&env, "alias:1", "app").await;
    assert_eq!(alias.digest, app.digest);
    assert_ne!(alias.id, app.id);

    let cases = [
        ("", base.digest.clone()),
        ("localhost:5000/team/app:v1", app.digest.clone()),
        (app.digest.as_str(), app.digest.clone()),
        (
            &format!("localhost:5000/team/app:v1@{}", app.digest),
            app.digest.clone(),
        ),
    ];
    for (i, (image, digest)) in cases.iter().enumerate() {
        let sb = env
            .gw
            .create_sandbox(None, &format!("sb{i}"), spec(image, &["sleep"]))
            .await
            .unwrap();
        assert_eq!(&sb.spec.as_ref().unwrap().image_digest, digest, "{image:?}");
        assert_eq!(&driver_image(&env.world, &sb).await, digest, "{image:?}");
    }
    let defaulted = env
        .gw
        .get_sandbox(&sbx_actors::SandboxSelector::Name {
            workspace: None,
            name: "sb0".into(),
        })
        .await
        .unwrap();
    assert_eq!(defaulted.spec.unwrap().image, DEFAULT);

    // Unknown names and digests are NOT_FOUND naming them; a bad reference is refused as such.
    let unknown_digest = format!("sha256:{}", "f".repeat(64));
    for (image, named) in [
        ("nope:1", "docker.io/library/nope:1"),
        (unknown_digest.as_str(), unknown_digest.as_str()),
    ] {
        let err = env
            .gw
            .create_sandbox(None, "x", spec(image, &["sleep"]))
            .await
            .unwrap_err();
        assert!(
            matches!(&err, ActorError::ImageNotFound(m) if m.contains(named)),
            "{image}: {err}"
        );
    }
    let err = env
        .gw
        .create_sandbox(None, "x", spec("Not A Ref", &["sleep"]))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ActorError::InvalidImageReference(m) if m.contains("Not A Ref")),
        "{err}"
    );
    // Nothing was written for the refused creates.
    assert!(
        env.store
            .get_by_name(Kind::Sandbox, Some(ws_id(&env).await), "x")
            .await
            .unwrap()
            .is_none()
    );
}

async fn ws_id(env: &Env) -> Uuid {
    env.store
        .get_by_name(Kind::Workspace, None, "default")
        .await
        .unwrap()
        .unwrap()
        .id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_command_runs_the_image_default_and_drivers_without_images_are_unchanged() {
    let env = env().await;
    let app = import(&env, "app:v1", "app").await;
    // The rootfs import's config runs `sh`: an empty command is the image's default.
    let sb = env
        .gw
        .create_sandbox(None, "default-cmd", spec("app:v1", &[]))
        .await
        .unwrap();
    assert!(sb.spec.as_ref().unwrap().command.is_empty());
    assert_eq!(driver_image(&env.world, &sb).await, app.digest);

    // A driver without images: no resolution, no pin; the image field passes through as is,
    // and an empty command is refused as always.
    let mut plain = spec("whatever-text", &["sleep"]);
    plain.driver = "plain".into();
    let sb = env.gw.create_sandbox(None, "plain", plain).await.unwrap();
    assert_eq!(sb.spec.as_ref().unwrap().image_digest, "");
    let deadline = tokio::time::Instant::now() + T;
    while env.plain_world.spec(sandbox_id(&sb)).is_none() {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        env.plain_world.spec(sandbox_id(&sb)).unwrap().image,
        "whatever-text"
    );
    let mut empty = spec("", &[]);
    empty.driver = "plain".into();
    let err = env
        .gw
        .create_sandbox(None, "plain-empty", empty)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, ActorError::InvalidArgument(m) if m.contains("give the argv")),
        "{err}"
    );
    // A pin sent by a client is ignored: output only.
    let mut forged = spec("", &["sleep"]);
    forged.driver = "plain".into();
    forged.image_digest = app.digest.clone();
    let sb = env.gw.create_sandbox(None, "forged", forged).await.unwrap();
    assert_eq!(sb.spec.unwrap().image_digest, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_is_refused_while_pinned_naming_every_user_then_collects() {
    let env = env().await;
    // The gateway's: every workspace runs it.
    let app = import_into(&env, "app:v1", "app", ImageScope::Gateway).await;
    let other = import(&env, "other:v1", "other").await;
    env.gw
        .create_workspace("team", Default::default())
        .await
        .unwrap();
    env.gw
        .create_sandbox(None, "web", spec("app:v1", &["sleep"]))
        .await
        .unwrap();
    let api = env
        .gw
        .create_sandbox(Some("team"), "api", spec("app:v1", &["sleep"]))
        .await
        .unwrap();
    let err = env
        .gw
        .delete_image(&by_name("app:v1"), default_scope(&env).await)
        .await
        .unwrap_err();
    match &err {
        ActorError::ImageInUse { users, digest, .. } => {
            assert_eq!(users, &vec!["default/web".to_string(), "team/api".into()]);
            assert_eq!(digest, &app.digest);
        }
        other => panic!("expected ImageInUse, got {other}"),
    }
    assert!(err.to_string().contains("default/web"), "{err}");
    assert!(
        env.gw
            .get_image(&by_name("app:v1"), default_scope(&env).await)
            .await
            .is_ok()
    );

    // An unused image goes, and its content with it; the pinned one's content stays.
    assert!(
        env.gw
            .delete_image(&by_name("other:v1"), default_scope(&env).await)
            .await
            .unwrap()
    );
    let content = ImageStore::open(env.dir.path().join("images"), IdMap::default()).unwrap();
    assert!(
        content.get(&other.digest).is_err(),
        "other's content stayed"
    );
    assert!(content.get(&app.digest).is_ok());
    assert!(matches!(
        env.gw
            .get_image(&by_name("other:v1"), default_scope(&env).await)
            .await,
        Err(ActorError::ImageNotFound(_))
    ));

    // Once no sandbox pins it, the delete goes through.
    for sel in [
        sbx_actors::SandboxSelector::Name {
            workspace: None,
            name: "web".into(),
        },
        sbx_actors::SandboxSelector::Id(sandbox_id(&api)),
    ] {
        assert!(env.gw.delete_sandbox(&sel).await.unwrap());
    }
    let id = ImageSelector::Id(Uuid::parse_str(&app.id).unwrap());
    assert!(
        env.gw
            .delete_image(&id, default_scope(&env).await)
            .await
            .unwrap()
    );
    assert!(
        !env.gw
            .delete_image(&id, default_scope(&env).await)
            .await
            .unwrap(),
        "by id: absent is false"
    );
    assert!(content.get(&app.digest).is_err());
    assert!(matches!(
        env.gw
            .delete_image(&by_name("app:v1"), default_scope(&env).await)
            .await,
        Err(ActorError::ImageNotFound(_))
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retagged_away_digest_is_kept_while_a_sandbox_pins_it() {
    let env = env().await;
    let v1 = import(&env, "app:v1", "one").await;
    let sb = env
        .gw
        .create_sandbox(None, "old", spec("app:v1", &["sleep"]))
        .await
        .unwrap();
    let v2 = import(&env, "app:v1", "two").await;
    let scratch = import(&env, "scratch:1", "scratch").await;
    // The record now names v2: no sandbox pins it through that record, so delete works…
    assert!(
        env.gw
            .delete_image(&by_name("scratch:1"), default_scope(&env).await)
            .await
            .unwrap()
    );
    // …and the collection after it keeps v1, which the sandbox still runs.
    let content = ImageStore::open(env.dir.path().join("images"), IdMap::default()).unwrap();
    assert!(
        content.get(&v1.digest).is_ok(),
        "a pinned digest was collected"
    );
    assert!(content.get(&v2.digest).is_ok());
    assert!(content.get(&scratch.digest).is_err());
    assert_eq!(driver_image(&env.world, &sb).await, v1.digest);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creates_and_deletes_of_images_do_not_race() {
    let env = Arc::new(env().await);
    // Seeded rounds: a create of a sandbox on the image and a delete of the image at once.
    // Either the delete wins (the create then finds no image) or the create wins (the
    // delete is then refused naming it); never a sandbox pinning a deleted image.
    for round in 0..20 {
        let name = format!("race:{round}");
        let image = import(&env, &name, &format!("race {round}")).await;
        let (e1, e2) = (Arc::clone(&env), Arc::clone(&env));
        let (n1, n2) = (name.clone(), name.clone());
        let create = tokio::spawn(async move {
            e1.gw
                .create_sandbox(None, &format!("r{round}"), spec(&n1, &["sleep"]))
                .await
        });
        let delete = tokio::spawn(async move {
            e2.gw
                .delete_image(&by_name(&n2), default_scope(&e2).await)
                .await
        });
        let (created, deleted) = (create.await.unwrap(), delete.await.unwrap());
        match (&created, &deleted) {
            (Ok(sb), Err(ActorError::ImageInUse { users, .. })) => {
                assert_eq!(users, &vec![format!("default/{}", sb.name)]);
                assert_eq!(sb.spec.as_ref().unwrap().image_digest, image.digest);
            }
            (Err(ActorError::ImageNotFound(_)), Ok(true)) => {}
            other => panic!("round {round}: {other:?}"),
        }
    }
}

/// A store from before image scopes: its records have no owner. After a restart they are the
/// gateway's, as they were — every workspace runs them (each is measured) — except its build
/// cache, which no key names any more: that goes (and its content with it), unless a sandbox
/// pins it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_from_before_scopes_stay_the_gateways_and_their_build_cache_goes() {
    use prost::Message;
    let env = env().await;
    let old = import_into(&env, "app:v1", "old", ImageScope::Gateway).await;
    let cached = import_into(&env, "cached:v1", "cached step", ImageScope::Gateway).await;
    let pinned = import_into(&env, "pinned:v1", "pinned step", ImageScope::Gateway).await;
    // As the old gateway wrote them: no owner, not measured, the cache under the gateway's
    // name.
    for (image, name) in [
        (&old, None),
        (&cached, Some("sbx.local/build-cache:0123abcd")),
        (&pinned, Some("sbx.local/build-cache:4567ef01")),
    ] {
        let record = env
            .store
            .get(Uuid::parse_str(&image.id).unwrap())
            .await
            .unwrap()
            .unwrap();
        let mut body = Image::decode(record.body.as_slice()).unwrap();
        body.unpacked_size = 0;
        match name {
            None => {
                let mut update = record;
                update.body = body.encode_to_vec();
                env.store.update(update).await.unwrap();
            }
            Some(name) => {
                env.store
                    .delete(record.id, record.resource_version)
                    .await
                    .unwrap();
                env.store
                    .create(sbx_storage::NewRecord {
                        id: Uuid::new_v4(),
                        kind: Kind::Image,
                        workspace: None,
                        name: name.into(),
                        owner: None,
                        labels: Default::default(),
                        created_at_ms: 1,
                        body: body.encode_to_vec(),
                    })
                    .await
                    .unwrap();
            }
        }
    }
    let user = env
        .gw
        .create_sandbox(
            None,
            "user",
            spec("sbx.local/build-cache:4567ef01", &["sleep"]),
        )
        .await
        .unwrap();
    let Env { dir, store, gw, .. } = env;
    assert!(gw.shutdown().await);
    drop(gw);
    let env = env_over(dir, store).await;
    let content = ImageStore::open_read_only(env.dir.path().join("images")).unwrap();
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let names: Vec<String> = env
            .store
            .list(ListQuery::new(Kind::Image, Scope::All, 0))
            .await
            .unwrap()
            .records
            .into_iter()
            .map(|r| r.name)
            .collect();
        if !names.contains(&"sbx.local/build-cache:0123abcd".to_string())
            && content.get(&cached.digest).is_err()
        {
            assert!(
                names.contains(&"sbx.local/build-cache:4567ef01".to_string()),
                "a pinned step stays: {names:?}"
            );
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the old build cache stays: {names:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The old image: every workspace runs it, measured now.
    env.gw
        .create_workspace("team", Default::default())
        .await
        .unwrap();
    for ws in [None, Some("team")] {
        let sb = env
            .gw
            .create_sandbox(ws, "from-old", spec("app:v1", &["sleep"]))
            .await
            .unwrap();
        assert_eq!(sb.spec.unwrap().image_digest, old.digest);
    }
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let now = env
            .gw
            .get_image(&by_name("app:v1"), ImageScope::Gateway)
            .await
            .unwrap();
        if now.unpacked_size > 0 {
            assert!(now.workspace.is_empty(), "{now:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never measured");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(content.get(&pinned.digest).is_ok());
    drop(user);
}
