//! Create / update / delete semantics: uniqueness, compare-and-swap, cascades, validation,
//! revisions, concurrent creates.

use std::collections::BTreeMap;
use std::sync::Arc;

use uuid::Uuid;

use super::{
    assert_integrity, labels, new_sandbox, new_setting, new_workspace, sandbox, workspace,
};
use crate::{Kind, ListQuery, ObjectStore, Record, Scope, StoreError};

/// Must-create: a taken name, or a taken id under another name, fails `AlreadyExists` naming
/// the existing record's id, and writes nothing.
pub async fn must_create_conflict_names_the_existing_id(store: Arc<dyn ObjectStore>) {
    let first = workspace(&*store, "team").await;
    let err = store.create(new_workspace("team")).await.unwrap_err();
    assert!(
        matches!(err, StoreError::AlreadyExists { existing, kind: Kind::Workspace, .. } if existing == first.id),
        "{err:?}"
    );
    // The same id under another name is taken too.
    let mut same_id = new_workspace("other");
    same_id.id = first.id;
    let err = store.create(same_id).await.unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { existing, .. } if existing == first.id));
    assert!(
        store
            .get_by_name(Kind::Workspace, None, "other")
            .await
            .unwrap()
            .is_none()
    );
}

/// Compare-and-swap: an update or delete with a stale version is a `Conflict` naming both
/// versions; immutable fields cannot change even with the right version; a missing record is
/// `NotFound`.
pub async fn compare_and_swap_refuses_stale_versions(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let sb = sandbox(&*store, &ws, "web").await;
    let mut change = sb.clone();
    change.labels = labels(&[("app", "web")]);
    change.body = b"v2".to_vec();
    change.updated_at_ms = 9_999;
    let v2 = store.update(change.clone()).await.unwrap();
    assert!(v2.resource_version > sb.resource_version);
    assert_eq!(v2.body, b"v2");
    assert_eq!(v2.updated_at_ms, 9_999);
    assert_eq!(v2.created_at_ms, sb.created_at_ms);
    assert_eq!(store.get(sb.id).await.unwrap(), Some(v2.clone()));

    // A second writer holding the old version loses.
    let err = store.update(change).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Conflict { id, expected, actual }
            if id == sb.id && expected == sb.resource_version && actual == v2.resource_version),
        "{err:?}"
    );
    let err = store.delete(sb.id, sb.resource_version).await.unwrap_err();
    assert!(matches!(err, StoreError::Conflict { .. }), "{err:?}");

    // Immutable fields cannot change, even with the right version.
    for edit in [
        |r: &mut Record| r.name = "renamed".into(),
        |r: &mut Record| r.workspace = Some(Uuid::new_v4()),
        |r: &mut Record| r.owner = Some(Uuid::new_v4()),
        |r: &mut Record| r.created_at_ms += 1,
        |r: &mut Record| r.kind = Kind::Setting,
    ] {
        let mut bad = v2.clone();
        edit(&mut bad);
        let err = store.update(bad).await.unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{err:?}");
    }
    let mut ghost = v2.clone();
    ghost.id = Uuid::new_v4();
    assert!(matches!(
        store.update(ghost).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(
        store.delete(Uuid::new_v4(), 1).await,
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(store.get(sb.id).await.unwrap(), Some(v2));
}

/// A name is unique per `(kind, workspace)`: the same sandbox name in two workspaces is two
/// records, found by name in each; twice in one workspace is `AlreadyExists`.
pub async fn same_name_in_two_workspaces_but_not_twice_in_one(store: Arc<dyn ObjectStore>) {
    let a = workspace(&*store, "a").await;
    let b = workspace(&*store, "b").await;
    let in_a = sandbox(&*store, &a, "web").await;
    let in_b = sandbox(&*store, &b, "web").await;
    let err = store.create(new_sandbox(a.id, "web")).await.unwrap_err();
    assert!(matches!(err, StoreError::AlreadyExists { existing, .. } if existing == in_a.id));
    let got_a = store
        .get_by_name(Kind::Sandbox, Some(a.id), "web")
        .await
        .unwrap();
    let got_b = store
        .get_by_name(Kind::Sandbox, Some(b.id), "web")
        .await
        .unwrap();
    assert_eq!(got_a.map(|r| r.id), Some(in_a.id));
    assert_eq!(got_b.map(|r| r.id), Some(in_b.id));
}

/// A deleted record's name can be taken again, by a record with a new id that the name then
/// finds.
pub async fn a_name_is_reusable_after_delete(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let old = sandbox(&*store, &ws, "web").await;
    assert_eq!(
        store.delete(old.id, old.resource_version).await.unwrap(),
        vec![old.id]
    );
    assert!(store.get(old.id).await.unwrap().is_none());
    let new = sandbox(&*store, &ws, "web").await;
    assert_ne!(new.id, old.id);
    let got = store
        .get_by_name(Kind::Sandbox, Some(ws.id), "web")
        .await
        .unwrap();
    assert_eq!(got.map(|r| r.id), Some(new.id));
}

/// Deleting an owner deletes what it owns, recursively, in one transaction (one revision
/// bump), the owner first in the answer; other owners keep theirs, a new record of the old
/// name inherits nothing, and deleting an owned record detaches it from its owner.
pub async fn deleting_an_owner_cascades_in_one_transaction(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let sb = sandbox(&*store, &ws, "web").await;
    let other = sandbox(&*store, &ws, "db").await;
    let s1 = store.create(new_setting(&sb, "env")).await.unwrap();
    let s2 = store.create(new_setting(&sb, "ports")).await.unwrap();
    // A setting owned by a setting: the cascade is recursive.
    let nested = store.create(new_setting(&s1, "env-extra")).await.unwrap();
    // Names are unique per (kind, workspace), so settings carry their own names.
    let kept = store.create(new_setting(&other, "db-env")).await.unwrap();
    let mut owned = store.owned(sb.id).await.unwrap();
    owned.sort();
    let mut expected = vec![s1.id, s2.id];
    expected.sort();
    assert_eq!(owned, expected);

    let before = store.current_revision().await.unwrap();
    let deleted = store.delete(sb.id, sb.resource_version).await.unwrap();
    assert_eq!(deleted[0], sb.id, "the record itself comes first");
    let mut rest = deleted[1..].to_vec();
    rest.sort();
    let mut want = vec![s1.id, s2.id, nested.id];
    want.sort();
    assert_eq!(rest, want);
    // One transaction: one revision bump for the four deletions.
    assert_eq!(store.current_revision().await.unwrap(), before + 1);
    for id in &deleted {
        assert!(store.get(*id).await.unwrap().is_none(), "{id} survived");
        assert!(store.owned(*id).await.unwrap().is_empty());
    }
    assert_eq!(store.get(kept.id).await.unwrap(), Some(kept.clone()));
    assert_eq!(store.owned(other.id).await.unwrap(), vec![kept.id]);

    // A new sandbox with the old name inherits nothing.
    let reborn = sandbox(&*store, &ws, "web").await;
    assert!(store.owned(reborn.id).await.unwrap().is_empty());
    let settings = store
        .list(ListQuery::new(Kind::Setting, Scope::Workspace(ws.id), 0))
        .await
        .unwrap();
    assert_eq!(settings.records, vec![kept]);
    assert_integrity(&*store).await;

    // Deleting an owned record detaches it from its surviving owner.
    let s3 = store.create(new_setting(&reborn, "x")).await.unwrap();
    store.delete(s3.id, s3.resource_version).await.unwrap();
    assert!(store.owned(reborn.id).await.unwrap().is_empty());
}

/// A workspace that still holds records is not deleted (`NotEmpty`, counting them); once
/// empty it is, and nothing can be created in it any more.
pub async fn a_workspace_with_records_is_not_deleted(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let sb = sandbox(&*store, &ws, "web").await;
    store.create(new_setting(&sb, "env")).await.unwrap();
    let err = store.delete(ws.id, ws.resource_version).await.unwrap_err();
    assert!(
        matches!(err, StoreError::NotEmpty { workspace, remaining: 2 } if workspace == ws.id),
        "{err:?}"
    );
    assert!(store.get(ws.id).await.unwrap().is_some());
    store.delete(sb.id, sb.resource_version).await.unwrap();
    assert_eq!(
        store.delete(ws.id, ws.resource_version).await.unwrap(),
        vec![ws.id]
    );
    // The workspace is gone: nothing can be created in it any more.
    let err = store.create(new_sandbox(ws.id, "late")).await.unwrap_err();
    assert!(matches!(err, StoreError::WorkspaceNotFound { workspace } if workspace == ws.id));
}

/// A scoped record's workspace must exist and be a workspace (`WorkspaceNotFound`), an owner
/// must exist (`OwnerNotFound`), and an owner in another workspace is `Invalid`.
pub async fn workspaces_and_owners_must_exist(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let missing = Uuid::new_v4();
    let err = store.create(new_sandbox(missing, "web")).await.unwrap_err();
    assert!(matches!(err, StoreError::WorkspaceNotFound { workspace } if workspace == missing));
    // A sandbox id is not a workspace.
    let sb = sandbox(&*store, &ws, "web").await;
    let err = store.create(new_sandbox(sb.id, "web2")).await.unwrap_err();
    assert!(
        matches!(err, StoreError::WorkspaceNotFound { .. }),
        "{err:?}"
    );
    let mut orphan = new_setting(&sb, "env");
    orphan.owner = Some(missing);
    let err = store.create(orphan).await.unwrap_err();
    assert!(matches!(err, StoreError::OwnerNotFound { owner } if owner == missing));
    // An owner in another workspace is refused.
    let other = workspace(&*store, "other").await;
    let mut cross = new_setting(&sb, "env");
    cross.workspace = Some(other.id);
    assert!(matches!(
        store.create(cross).await,
        Err(StoreError::Invalid { .. })
    ));
}

/// Bad names, a missing or nil workspace, a global kind in a workspace, a nil id, a setting
/// without owner, a record owning itself and malformed labels are `Invalid`, and nothing is
/// written (the revision stays).
pub async fn invalid_records_are_never_written(store: Arc<dyn ObjectStore>) {
    let ws = workspace(&*store, "team").await;
    let sb = sandbox(&*store, &ws, "web").await;
    let revision = store.current_revision().await.unwrap();
    let mut cases = Vec::new();
    for name in ["", "UPPER", "-edge", "has space", &"x".repeat(64)] {
        cases.push(("bad name", new_sandbox(ws.id, name)));
    }
    let mut no_ws = new_sandbox(ws.id, "a");
    no_ws.workspace = None;
    cases.push(("scoped without workspace", no_ws));
    cases.push(("nil workspace", new_sandbox(Uuid::nil(), "b")));
    let mut global_in_ws = new_workspace("c");
    global_in_ws.workspace = Some(ws.id);
    cases.push(("global kind in a workspace", global_in_ws));
    let mut nil_id = new_workspace("d");
    nil_id.id = Uuid::nil();
    cases.push(("nil id", nil_id));
    let mut unowned = new_setting(&sb, "e");
    unowned.owner = None;
    cases.push(("setting without owner", unowned));
    let mut self_owned = new_sandbox(ws.id, "f");
    self_owned.owner = Some(self_owned.id);
    cases.push(("owns itself", self_owned));
    let mut bad_label = new_sandbox(ws.id, "g");
    bad_label.labels = labels(&[("app", "a,b")]);
    cases.push(("label value with a comma", bad_label));
    for (why, rec) in cases {
        let err = store.create(rec).await.unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{why}: {err:?}");
    }
    let mut bad_update = sb.clone();
    bad_update.labels = labels(&[("", "x")]);
    assert!(matches!(
        store.update(bad_update).await,
        Err(StoreError::Invalid { .. })
    ));
    assert_eq!(
        store.current_revision().await.unwrap(),
        revision,
        "nothing was written"
    );
    let all = store
        .list(ListQuery::new(Kind::Sandbox, Scope::All, 0))
        .await
        .unwrap();
    assert_eq!(all.records, vec![sb]);
}

/// One global revision, 0 in an empty store, bumped by one with every write (create, update,
/// delete) and becoming the written record's version; a failed write does not bump it.
pub async fn revisions_increase_with_every_write(store: Arc<dyn ObjectStore>) {
    assert_eq!(store.current_revision().await.unwrap(), 0);
    let ws = store.create(new_workspace("team")).await.unwrap();
    assert_eq!(ws.resource_version, 1);
    let sb = store.create(new_sandbox(ws.id, "web")).await.unwrap();
    assert_eq!(sb.resource_version, 2);
    let updated = store.update(sb.clone()).await.unwrap();
    assert_eq!(updated.resource_version, 3);
    store.delete(sb.id, 3).await.unwrap();
    assert_eq!(store.current_revision().await.unwrap(), 4);
    // A failed write does not bump it.
    let _ = store.create(new_workspace("team")).await.unwrap_err();
    assert_eq!(store.current_revision().await.unwrap(), 4);
}

/// Concurrent creates of the same names: exactly one winner per name, every other attempt
/// `AlreadyExists` naming that winner, and only the winners bump the revision.
pub async fn concurrent_creates_of_one_name_have_one_winner(store: Arc<dyn ObjectStore>) {
    // A store may run concurrent writes in one transaction: a refused write must not disturb
    // the others in its batch, and later writes must see earlier ones.
    let ws = workspace(&*store, "team").await;
    let attempts: Vec<_> = (0..48)
        .map(|i| {
            let store = Arc::clone(&store);
            let rec = new_sandbox(ws.id, &format!("name-{}", i % 6));
            tokio::spawn(async move { (rec.name.clone(), store.create(rec).await) })
        })
        .collect();
    let mut winners = BTreeMap::new();
    let mut refused = Vec::new();
    for a in attempts {
        match a.await.unwrap() {
            (name, Ok(rec)) => assert!(winners.insert(name, rec.id).is_none(), "two winners"),
            (name, Err(StoreError::AlreadyExists { existing, .. })) => {
                refused.push((name, existing))
            }
            (_, Err(other)) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(winners.len(), 6);
    assert_eq!(refused.len(), 42);
    for (name, existing) in refused {
        assert_eq!(
            winners[&name], existing,
            "refusal names the winner of {name}"
        );
    }
    assert_eq!(store.current_revision().await.unwrap(), 1 + 6);
}

/// Images are global records named by a normalised image reference, not a DNS-1123 label;
/// their names are unique like any other kind's, and a delete is a plain delete.
pub async fn image_records_follow_the_image_reference_rule(store: Arc<dyn ObjectStore>) {
    let image = |name: &str| {
        let mut rec = new_workspace("x");
        rec.kind = Kind::Image;
        rec.name = name.into();
        rec
    };
    let busybox = store
        .create(image("docker.io/library/busybox:latest"))
        .await
        .unwrap();
    let local = store
        .create(image("localhost:5000/team/app:v1.2"))
        .await
        .unwrap();
    assert_eq!(
        store
            .get_by_name(Kind::Image, None, "docker.io/library/busybox:latest")
            .await
            .unwrap()
            .map(|r| r.id),
        Some(busybox.id)
    );
    let err = store
        .create(image("docker.io/library/busybox:latest"))
        .await
        .unwrap_err();
    assert!(
        matches!(err, StoreError::AlreadyExists { existing, .. } if existing == busybox.id),
        "{err:?}"
    );
    // A DNS-1123 label is not an image name, nor an unnormalised reference, nor a digest.
    for bad in [
        "busybox",
        "docker.io/library/busybox",
        "docker.io/library/BusyBox:latest",
        "sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    ] {
        let err = store.create(image(bad)).await.unwrap_err();
        assert!(matches!(err, StoreError::Invalid { .. }), "{bad}: {err:?}");
    }
    // And an image name is not a workspace name.
    let err = store
        .create(new_workspace("docker.io/library/busybox:latest"))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Invalid { .. }), "{err:?}");
    let mut in_ws = image("docker.io/library/alpine:3");
    in_ws.workspace = Some(Uuid::new_v4());
    assert!(matches!(
        store.create(in_ws).await,
        Err(StoreError::Invalid { .. })
    ));
    assert_integrity(&*store).await;
    store
        .delete(local.id, local.resource_version)
        .await
        .unwrap();
    assert!(store.get(local.id).await.unwrap().is_none());
    let all = store
        .list(ListQuery::new(Kind::Image, Scope::All, 0))
        .await
        .unwrap();
    assert_eq!(
        all.records.iter().map(|r| r.id).collect::<Vec<_>>(),
        vec![busybox.id]
    );
}
