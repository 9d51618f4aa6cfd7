//! Property test: the sled store against a plain in-memory model, over random sequences of
//! create / update / delete / list (with pagination and selectors).

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::labels;
use proptest::prelude::*;
use sbx_storage::{
    Kind, LabelSelector, ListQuery, NewRecord, ObjectStore, Record, Scope, SledStore, StoreError,
};
use uuid::Uuid;

const NAMES: [&str; 7] = [
    "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "Bad_Name",
];
const SELECTORS: [&str; 6] = ["", "app=web", "app!=web", "tier", "!tier", "app=db,tier"];

fn label_set(i: u8) -> BTreeMap<String, String> {
    match i % 5 {
        0 => labels(&[]),
        1 => labels(&[("app", "web")]),
        2 => labels(&[("app", "db")]),
        3 => labels(&[("app", "web"), ("tier", "gold")]),
        _ => labels(&[("tier", "gold")]),
    }
}

#[derive(Debug, Clone)]
enum Op {
    Create {
        kind: Kind,
        /// Index into every id seen so far: the workspace (scoped kinds) ...
        scope: u8,
        /// ... and the owner (settings; sandboxes get one when `owned`).
        owner: u8,
        owned: bool,
        name: u8,
        created: u8,
        labels: u8,
        /// Reuse an existing id instead of a fresh one.
        reuse_id: Option<u8>,
        fresh: u128,
    },
    Update {
        target: u8,
        stale: bool,
        labels: u8,
    },
    Delete {
        target: u8,
        stale: bool,
    },
    List {
        kind: Kind,
        scope: Option<u8>,
        selector: u8,
        limit: u8,
    },
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Workspace),
        Just(Kind::Sandbox),
        Just(Kind::Setting)
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (kind(), any::<u8>(), any::<u8>(), prop::bool::weighted(0.2), 0..7u8, 0..3u8,
              any::<u8>(), prop::option::weighted(0.05, any::<u8>()), any::<u128>())
            .prop_map(|(kind, scope, owner, owned, name, created, labels, reuse_id, fresh)| {
                Op::Create { kind, scope, owner, owned, name, created, labels, reuse_id, fresh }
            }),
        2 => (any::<u8>(), prop::bool::weighted(0.2), any::<u8>())
            .prop_map(|(target, stale, labels)| Op::Update { target, stale, labels }),
        2 => (any::<u8>(), prop::bool::weighted(0.2))
            .prop_map(|(target, stale)| Op::Delete { target, stale }),
        2 => (kind(), prop::option::of(any::<u8>()), 0..6u8, 0..5u8)
            .prop_map(|(kind, scope, selector, limit)| Op::List { kind, scope, selector, limit }),
    ]
}

/// The error, reduced to what both implementations must agree on.
fn outcome(err: &StoreError) -> String {
    match err {
        StoreError::AlreadyExists { existing, .. } => format!("exists {existing}"),
        StoreError::NotFound { id } => format!("not found {id}"),
        StoreError::Conflict {
            expected, actual, ..
        } => format!("conflict {expected} {actual}"),
        StoreError::WorkspaceNotFound { workspace } => format!("no workspace {workspace}"),
        StoreError::OwnerNotFound { owner } => format!("no owner {owner}"),
        StoreError::NotEmpty {
            workspace,
            remaining,
        } => format!("not empty {workspace} {remaining}"),
        StoreError::Invalid { .. } => "invalid".into(),
        other => format!("fault {other}"),
    }
}

/// The in-memory model: a map of records and a revision counter.
#[derive(Default)]
struct Model {
    records: BTreeMap<Uuid, Record>,
    revision: u64,
}

impl Model {
    fn create(&mut self, rec: &NewRecord) -> Result<Record, String> {
        let scoped_ok = match (rec.kind.is_scoped(), rec.workspace) {
            (true, Some(ws)) => !ws.is_nil(),
            (false, None) => true,
            _ => false,
        };
        if sbx_proto::names::validate_name(&rec.name).is_err()
            || !scoped_ok
            || (rec.kind.is_owned() && rec.owner.is_none())
            || rec.owner == Some(rec.id)
        {
            return Err("invalid".into());
        }
        if self.records.contains_key(&rec.id) {
            return Err(format!("exists {}", rec.id));
        }
        if let Some(existing) = self.records.values().find(|r| {
            r.kind == rec.kind && r.name_scope() == rec.name_scope() && r.name == rec.name
        }) {
            return Err(format!("exists {}", existing.id));
        }
        if let Some(ws) = rec.workspace
            && !matches!(self.records.get(&ws), Some(w) if w.kind == Kind::Workspace)
        {
            return Err(format!("no workspace {ws}"));
        }
        if let Some(owner) = rec.owner {
            match self.records.get(&owner) {
                None => return Err(format!("no owner {owner}")),
                Some(o) if o.workspace != rec.workspace => return Err("invalid".into()),
                Some(_) => {}
            }
        }
        self.revision += 1;
        let stored = Record {
            id: rec.id,
            kind: rec.kind,
            workspace: rec.workspace,
            name: rec.name.clone(),
            owner: rec.owner,
            labels: rec.labels.clone(),
            created_at_ms: rec.created_at_ms,
            body: rec.body.clone(),
            resource_version: self.revision,
            updated_at_ms: rec.created_at_ms,
            refs: Vec::new(),
        };
        self.records.insert(rec.id, stored.clone());
        Ok(stored)
    }

    fn update(&mut self, rec: &Record) -> Result<Record, String> {
        let Some(stored) = self.records.get_mut(&rec.id) else {
            return Err(format!("not found {}", rec.id));
        };
        if stored.resource_version != rec.resource_version {
            return Err(format!(
                "conflict {} {}",
                rec.resource_version, stored.resource_version
            ));
        }
        self.revision += 1;
        stored.labels = rec.labels.clone();
        stored.body = rec.body.clone();
        stored.updated_at_ms = rec.updated_at_ms;
        stored.resource_version = self.revision;
        Ok(stored.clone())
    }

    /// On refusal, every acceptable error: when the cascade holds several non-empty
    /// workspaces, the store may name any of them.
    fn delete(&mut self, id: Uuid, expected: u64) -> Result<(Uuid, BTreeSet<Uuid>), Vec<String>> {
        let Some(root) = self.records.get(&id) else {
            return Err(vec![format!("not found {id}")]);
        };
        if root.resource_version != expected {
            return Err(vec![format!(
                "conflict {expected} {}",
                root.resource_version
            )]);
        }
        let mut doomed = BTreeSet::from([id]);
        loop {
            let more: Vec<Uuid> = self
                .records
                .values()
                .filter(|r| r.owner.is_some_and(|o| doomed.contains(&o)) && !doomed.contains(&r.id))
                .map(|r| r.id)
                .collect();
            if more.is_empty() {
                break;
            }
            doomed.extend(more);
        }
        let mut not_empty = Vec::new();
        for ws in doomed
            .iter()
            .filter(|d| self.records[d].kind == Kind::Workspace)
        {
            let remaining = self
                .records
                .values()
                .filter(|r| r.workspace == Some(*ws) && !doomed.contains(&r.id))
                .count();
            if remaining > 0 {
                not_empty.push(format!("not empty {ws} {remaining}"));
            }
        }
        if !not_empty.is_empty() {
            return Err(not_empty);
        }
        for d in &doomed {
            self.records.remove(d);
        }
        self.revision += 1;
        doomed.remove(&id);
        Ok((id, doomed))
    }

    fn list(&self, kind: Kind, scope: Scope, selector: &LabelSelector) -> Vec<Record> {
        let mut out: Vec<Record> = self
            .records
            .values()
            .filter(|r| r.kind == kind)
            .filter(|r| match scope {
                Scope::All => true,
                Scope::Workspace(ws) => r.workspace == Some(ws),
            })
            .filter(|r| selector.matches(&r.labels))
            .cloned()
            .collect();
        out.sort_by_key(|r| (r.created_at_ms, r.id));
        out
    }

    fn owned(&self, owner: Uuid) -> BTreeSet<Uuid> {
        self.records
            .values()
            .filter(|r| r.owner == Some(owner))
            .map(|r| r.id)
            .collect()
    }
}

fn pick(ids: &[Uuid], i: u8) -> Option<Uuid> {
    (!ids.is_empty()).then(|| ids[i as usize % ids.len()])
}

/// Mostly a live record of one of `kinds` (so operations get far), sometimes any id ever seen
/// (deleted, of the wrong kind or never created).
fn pick_live(model: &Model, ids: &[Uuid], i: u8, kinds: &[Kind]) -> Uuid {
    let live: Vec<Uuid> = model
        .records
        .values()
        .filter(|r| kinds.contains(&r.kind))
        .map(|r| r.id)
        .collect();
    if i.is_multiple_of(8) || live.is_empty() {
        pick(ids, i / 8).unwrap()
    } else {
        live[i as usize % live.len()]
    }
}

async fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open(&dir.path().join("db")).unwrap();
    let mut model = Model::default();
    // Every id ever created or tried, so operations also hit deleted and unknown ids.
    let mut ids: Vec<Uuid> = vec![Uuid::from_u128(42)];
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Create {
                kind,
                scope,
                owner,
                owned,
                name,
                created,
                labels,
                reuse_id,
                fresh,
            } => {
                let id = match reuse_id {
                    Some(i) => pick(&ids, i).unwrap(),
                    None => Uuid::from_u128(fresh | 1),
                };
                let owner_id = (kind == Kind::Setting || owned)
                    .then(|| pick_live(&model, &ids, owner, &[Kind::Sandbox, Kind::Setting]));
                let workspace = match owner_id.and_then(|o| model.records.get(&o)) {
                    // Usually the owner's workspace, as the actor layer would do.
                    Some(o) if !scope.is_multiple_of(4) => o.workspace,
                    _ => kind
                        .is_scoped()
                        .then(|| pick_live(&model, &ids, scope, &[Kind::Workspace])),
                };
                let rec = NewRecord {
                    id,
                    kind,
                    workspace,
                    name: NAMES[name as usize].to_string(),
                    owner: owner_id,
                    labels: label_set(labels),
                    created_at_ms: created as u64,
                    body: vec![step as u8],
                };
                let want = model.create(&rec);
                let got = store.create(rec).await.map_err(|e| outcome(&e));
                prop_assert_eq!(&got, &want, "step {}: create", step);
                if !ids.contains(&id) {
                    ids.push(id);
                }
            }
            Op::Update {
                target,
                stale,
                labels,
            } => {
                let id = pick_live(&model, &ids, target, &Kind::ALL);
                let Some(mut rec) = store.get(id).await.unwrap() else {
                    let mut ghost = model.records.values().next().cloned().unwrap_or(Record {
                        id,
                        kind: Kind::Workspace,
                        workspace: None,
                        name: "ghost".into(),
                        owner: None,
                        labels: BTreeMap::new(),
                        created_at_ms: 0,
                        body: vec![],
                        resource_version: 1,
                        updated_at_ms: 0,
                        refs: Vec::new(),
                    });
                    ghost.id = id;
                    let got = store.update(ghost.clone()).await.map_err(|e| outcome(&e));
                    prop_assert_eq!(got, model.update(&ghost), "step {}: update missing", step);
                    continue;
                };
                prop_assert_eq!(Some(&rec), model.records.get(&id), "step {}: get", step);
                if stale {
                    rec.resource_version -= 1;
                }
                rec.labels = label_set(labels);
                rec.body.push(step as u8);
                rec.updated_at_ms = 100 + step as u64;
                let want = model.update(&rec);
                let got = store.update(rec).await.map_err(|e| outcome(&e));
                prop_assert_eq!(got, want, "step {}: update", step);
            }
            Op::Delete { target, stale } => {
                let id = pick_live(&model, &ids, target, &Kind::ALL);
                let version = model
                    .records
                    .get(&id)
                    .map(|r| r.resource_version - u64::from(stale))
                    .unwrap_or(1);
                let want = model.delete(id, version);
                let got = store
                    .delete(id, version)
                    .await
                    .map_err(|e| outcome(&e))
                    .map(|ids| (ids[0], ids[1..].iter().copied().collect::<BTreeSet<_>>()));
                match (&got, &want) {
                    (Err(e), Err(acceptable)) => {
                        prop_assert!(
                            acceptable.contains(e),
                            "step {}: delete: {} not in {:?}",
                            step,
                            e,
                            acceptable
                        )
                    }
                    _ => prop_assert_eq!(
                        got,
                        want.map_err(|e| e[0].clone()),
                        "step {}: delete",
                        step
                    ),
                }
            }
            Op::List {
                kind,
                scope,
                selector,
                limit,
            } => {
                let scope = match scope.map(|i| pick_live(&model, &ids, i, &[Kind::Workspace])) {
                    Some(ws) => Scope::Workspace(ws),
                    None => Scope::All,
                };
                let selector = LabelSelector::parse(SELECTORS[selector as usize]).unwrap();
                let want = model.list(kind, scope, &selector);
                let limit = limit as usize; // 0 = everything in one page
                let mut got = Vec::new();
                let mut cursor = None;
                for _ in 0..=want.len() + 1 {
                    let page = store
                        .list(ListQuery {
                            kind,
                            scope,
                            selector: selector.clone(),
                            limit,
                            cursor,
                        })
                        .await
                        .unwrap();
                    if limit > 0 {
                        prop_assert!(page.records.len() <= limit);
                    }
                    if page.next_cursor.is_some() {
                        prop_assert_eq!(page.records.len(), limit, "short page before the end");
                    }
                    got.extend(page.records);
                    cursor = page.next_cursor;
                    if cursor.is_none() {
                        break;
                    }
                }
                prop_assert!(cursor.is_none(), "pagination did not end");
                prop_assert_eq!(got, want, "step {}: list", step);
            }
        }
    }
    if std::env::var("SBX_MODEL_STATS").is_ok() {
        eprintln!(
            "records {} revision {}",
            model.records.len(),
            model.revision
        );
    }
    // Final state: records, owner index, revision, and a clean fsck.
    prop_assert_eq!(store.current_revision().await.unwrap(), model.revision);
    for id in &ids {
        let stored = store.get(*id).await.unwrap();
        prop_assert_eq!(stored.as_ref(), model.records.get(id));
        let owned: BTreeSet<Uuid> = store.owned(*id).await.unwrap().into_iter().collect();
        prop_assert_eq!(owned, model.owned(*id));
    }
    let problems = store.verify_indexes().unwrap();
    prop_assert!(problems.is_empty(), "fsck: {:?}", problems);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        max_shrink_iters: 200,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn store_matches_the_model(ops in prop::collection::vec(op(), 1..80)) {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(run(ops))?;
    }
}
