//! `verify_indexes`: an offline-style consistency check (fsck) of records against every index.

use std::collections::{BTreeMap, HashMap, HashSet};

use uuid::Uuid;

use crate::envelope::decode_record;
use crate::error::StoreError;
use crate::idsets::{SetEntry, classify};
use crate::layout::{
    META_SCHEMA_VERSION, decode_id_list, decode_u64, name_key, order_all_key, order_ws_key,
};
use crate::record::{Kind, Record};
use crate::schema::SCHEMA_VERSION;
use crate::sled_store::SledStore;
use crate::store::IndexProblem;
use crate::trees::Trees;

/// Every set of an id-set tree (`idsets.rs`), checking its shape: each chunk under a head
/// that counts it, no head without chunks.
fn read_sets(
    tree: &sled::Tree,
    name: &'static str,
    report: &mut impl FnMut(&'static str, String),
) -> Result<HashMap<Uuid, Vec<Uuid>>, StoreError> {
    let mut heads: HashMap<Uuid, u32> = HashMap::new();
    let mut chunks: BTreeMap<(Uuid, u32), Vec<Uuid>> = BTreeMap::new();
    for entry in tree.iter() {
        let (key, value) = entry?;
        match classify(&key) {
            SetEntry::Head(key) => match <[u8; 4]>::try_from(&value[..]) {
                Ok(raw) => {
                    heads.insert(key, u32::from_be_bytes(raw));
                }
                Err(_) => report(name, format!("head of {key} is {} bytes", value.len())),
            },
            SetEntry::Chunk(key, index) => match decode_id_list(&value) {
                Ok(ids) => {
                    chunks.insert((key, index), ids);
                }
                Err(e) => report(name, format!("chunk {index} of {key}: {e}")),
            },
            SetEntry::Malformed => report(name, format!("key {key:02x?} is malformed")),
        }
    }
    let mut sets: HashMap<Uuid, Vec<Uuid>> = HashMap::new();
    for ((key, index), ids) in chunks {
        if heads.get(&key).is_none_or(|count| index >= *count) {
            report(
                name,
                format!("chunk {index} of {key} is beyond its head's count"),
            );
        }
        sets.entry(key).or_default().extend(ids);
    }
    for key in heads.keys() {
        if !sets.contains_key(key) {
            report(name, format!("head of {key} has no chunk"));
        }
    }
    Ok(sets)
}

impl SledStore {
    /// Checks that the records and every index agree: the name index, the owner index, both
    /// order indexes, the per-workspace counts, and that the stored revision is at least every
    /// record's version. Returns the problems found (empty for a healthy store). Reads a
    /// snapshot tree by tree, so run it while no writes are in flight.
    pub fn verify_indexes(&self) -> Result<Vec<IndexProblem>, StoreError> {
        let trees = &self.inner.trees;
        let mut problems = Vec::new();
        let mut report = |tree: &'static str, detail: String| {
            problems.push(IndexProblem { tree, detail });
        };

        let records = read_records(trees, &mut report)?;
        let owned = read_sets(&trees.owners, "owners", &mut report)?;
        let referred = read_sets(&trees.refs, "refs", &mut report)?;
        let read = Snapshot {
            records,
            owned,
            referred,
        };

        let revision = self.revision()?;
        let mut counts: BTreeMap<Uuid, u64> = BTreeMap::new();
        for rec in read.records.values() {
            check_record(trees, &read, rec, revision, &mut counts, &mut report)?;
        }
        check_names(trees, &read.records, &mut report)?;
        check_set_members(&read, &mut report);
        check_orders(trees, &read.records, &mut report)?;
        check_counts(trees, &counts, &mut report)?;

        let schema = trees.meta.get(META_SCHEMA_VERSION)?;
        if schema.as_deref() != Some(&SCHEMA_VERSION.to_be_bytes()[..]) {
            report("meta", format!("schema version is {schema:02x?}"));
        }
        Ok(problems)
    }
}

/// What [`SledStore::verify_indexes`] reads first and checks every index against: every
/// record by its id, and the owner and reference sets.
struct Snapshot {
    records: HashMap<Uuid, Record>,
    owned: HashMap<Uuid, Vec<Uuid>>,
    referred: HashMap<Uuid, Vec<Uuid>>,
}

/// Every record, by its id; a record under another key, or one that does not decode, is
/// reported.
fn read_records(
    trees: &Trees,
    report: &mut impl FnMut(&'static str, String),
) -> Result<HashMap<Uuid, Record>, StoreError> {
    let mut records: HashMap<Uuid, Record> = HashMap::new();
    for entry in trees.records.iter() {
        let (key, value) = entry?;
        match decode_record(&value) {
            Ok(rec) if rec.id.as_bytes()[..] == key[..] => {
                records.insert(rec.id, rec);
            }
            Ok(rec) => report("records", format!("key {key:02x?} holds record {}", rec.id)),
            Err(e) => report("records", format!("key {key:02x?}: {e}")),
        }
    }

    Ok(records)
}

/// One record against the indexes: its version, name, name entry, order entries, scope,
/// owner and references; its workspace's count goes into `counts`.
fn check_record(
    trees: &Trees,
    read: &Snapshot,
    rec: &Record,
    revision: u64,
    counts: &mut BTreeMap<Uuid, u64>,
    report: &mut impl FnMut(&'static str, String),
) -> Result<(), StoreError> {
    let (records, owned, referred) = (&read.records, &read.owned, &read.referred);
    let id = rec.id;
    if rec.resource_version > revision {
        report(
            "meta",
            format!(
                "record {id} has version {} above the stored revision {revision}",
                rec.resource_version
            ),
        );
    }
    if rec.kind.validate_name(&rec.name).is_err() {
        report(
            "records",
            format!("record {id} has invalid name {:?}", rec.name),
        );
    }
    match trees
        .names
        .get(name_key(rec.kind, rec.name_scope(), &rec.name))?
    {
        Some(raw) if raw[..] == id.as_bytes()[..] => {}
        Some(raw) => report("names", format!("name of record {id} points to {raw:02x?}")),
        None => report("names", format!("record {id} ({}) is missing", rec.name)),
    }
    if !trees
        .order_all
        .contains_key(order_all_key(rec.kind, rec.created_at_ms, id))?
    {
        report("order_all", format!("record {id} is missing"));
    }
    match (rec.kind.is_scoped(), rec.workspace) {
        (true, Some(ws)) => {
            *counts.entry(ws).or_default() += 1;
            if !matches!(records.get(&ws), Some(w) if w.kind == Kind::Workspace) {
                report(
                    "records",
                    format!("record {id} is in missing workspace {ws}"),
                );
            }
            if !trees
                .order_ws
                .contains_key(order_ws_key(ws, rec.kind, rec.created_at_ms, id))?
            {
                report("order_ws", format!("record {id} is missing"));
            }
        }
        (false, None) => {}
        _ => report(
            "records",
            format!("record {id} has the wrong scope for a {}", rec.kind),
        ),
    }
    if let Some(owner) = rec.owner {
        let listed = owned.get(&owner).is_some_and(|ids| ids.contains(&id));
        if !records.contains_key(&owner) {
            report(
                "owners",
                format!("record {id} is owned by missing record {owner}"),
            );
        } else if !listed {
            report(
                "owners",
                format!("record {id} is not listed under its owner {owner}"),
            );
        }
    }
    for target in &rec.refs {
        if !records.contains_key(target) {
            report(
                "refs",
                format!("record {id} refers to missing record {target}"),
            );
        } else if !referred.get(target).is_some_and(|ids| ids.contains(&id)) {
            report(
                "refs",
                format!("record {id} is not listed as referring to {target}"),
            );
        }
    }
    Ok(())
}

/// Every name entry points to a record of that name.
fn check_names(
    trees: &Trees,
    records: &HashMap<Uuid, Record>,
    report: &mut impl FnMut(&'static str, String),
) -> Result<(), StoreError> {
    for entry in trees.names.iter() {
        let (key, value) = entry?;
        let target = Uuid::from_slice(&value).ok();
        let ok = target
            .and_then(|t| records.get(&t))
            .is_some_and(|r| name_key(r.kind, r.name_scope(), &r.name)[..] == key[..]);
        if !ok {
            report(
                "names",
                format!("entry {key:02x?} points to no matching record"),
            );
        }
    }

    Ok(())
}

/// Every member of an owner or reference set, once, owned by or referring to its set's
/// record, which exists.
fn check_set_members(read: &Snapshot, report: &mut impl FnMut(&'static str, String)) {
    let (records, owned, referred) = (&read.records, &read.owned, &read.referred);
    for (owner, ids) in owned {
        if !records.contains_key(owner) {
            report("owners", format!("entry for missing owner {owner}"));
        }
        let mut seen = HashSet::new();
        for member in ids {
            if !seen.insert(*member) {
                report("owners", format!("{owner} lists {member} twice"));
            }
            if records.get(member).and_then(|r| r.owner) != Some(*owner) {
                report("owners", format!("{owner} lists {member}, not owned by it"));
            }
        }
    }
    for (target, ids) in referred {
        if !records.contains_key(target) {
            report("refs", format!("entry for missing record {target}"));
        }
        let mut seen = HashSet::new();
        for member in ids {
            if !seen.insert(*member) {
                report("refs", format!("{target} lists {member} twice"));
            }
            if !records.get(member).is_some_and(|r| r.refs.contains(target)) {
                report(
                    "refs",
                    format!("{target} lists {member}, which does not refer to it"),
                );
            }
        }
    }
}

/// Every entry of both order indexes matches a record.
fn check_orders(
    trees: &Trees,
    records: &HashMap<Uuid, Record>,
    report: &mut impl FnMut(&'static str, String),
) -> Result<(), StoreError> {
    for entry in trees.order_all.iter() {
        let (key, _) = entry?;
        let ok = key.len() == 25
            && Uuid::from_slice(&key[9..])
                .ok()
                .and_then(|id| records.get(&id))
                .is_some_and(|r| order_all_key(r.kind, r.created_at_ms, r.id)[..] == key[..]);
        if !ok {
            report("order_all", format!("entry {key:02x?} matches no record"));
        }
    }
    for entry in trees.order_ws.iter() {
        let (key, _) = entry?;
        let ok = key.len() == 41
            && Uuid::from_slice(&key[25..])
                .ok()
                .and_then(|id| records.get(&id))
                .is_some_and(|r| {
                    r.workspace.is_some_and(|ws| {
                        order_ws_key(ws, r.kind, r.created_at_ms, r.id)[..] == key[..]
                    })
                });
        if !ok {
            report("order_ws", format!("entry {key:02x?} matches no record"));
        }
    }

    Ok(())
}

/// The per-workspace counts are the records each workspace holds (`counts`).
fn check_counts(
    trees: &Trees,
    counts: &BTreeMap<Uuid, u64>,
    report: &mut impl FnMut(&'static str, String),
) -> Result<(), StoreError> {
    let mut stored_counts: BTreeMap<Uuid, u64> = BTreeMap::new();
    for entry in trees.ws_counts.iter() {
        let (key, value) = entry?;
        match (Uuid::from_slice(&key), decode_u64(&value, "count")) {
            (Ok(ws), Ok(n)) => {
                stored_counts.insert(ws, n);
            }
            _ => report("ws_counts", format!("entry {key:02x?} does not decode")),
        }
    }
    for ws in counts
        .keys()
        .chain(stored_counts.keys())
        .collect::<HashSet<_>>()
    {
        let (real, stored) = (
            counts.get(ws).copied().unwrap_or(0),
            stored_counts.get(ws).copied().unwrap_or(0),
        );
        if real != stored {
            report(
                "ws_counts",
                format!("workspace {ws} holds {real} record(s), the count says {stored}"),
            );
        }
    }

    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::layout::{META_REVISION, encode_u64};
    use crate::record::NewRecord;
    use crate::store::ObjectStore;

    fn new(kind: Kind, workspace: Option<Uuid>, owner: Option<Uuid>, name: &str) -> NewRecord {
        NewRecord {
            id: Uuid::new_v4(),
            kind,
            workspace,
            name: name.into(),
            owner,
            labels: BTreeMap::new(),
            created_at_ms: 7,
            body: Vec::new(),
        }
    }

    /// Builds a small healthy store, applies `corrupt` to its trees by hand, and checks that
    /// fsck reports a problem in `tree`.
    async fn check(tree: &str, corrupt: impl FnOnce(&SledStore, &Record, &Record, &Record)) {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open(&dir.path().join("db")).unwrap();
        let ws = store
            .create(new(Kind::Workspace, None, None, "ws"))
            .await
            .unwrap();
        let sb = store
            .create(new(Kind::Sandbox, Some(ws.id), None, "sb"))
            .await
            .unwrap();
        let set = store
            .create(new(Kind::Setting, Some(ws.id), Some(sb.id), "set"))
            .await
            .unwrap();
        assert_eq!(store.verify_indexes().unwrap(), vec![], "healthy store");
        corrupt(&store, &ws, &sb, &set);
        let problems = store.verify_indexes().unwrap();
        assert!(
            problems.iter().any(|p| p.tree == tree),
            "corrupting {tree} went unnoticed: {problems:?}"
        );
    }

    #[tokio::test]
    async fn fsck_reports_hand_made_corruption() {
        let t = |s: &SledStore| s.inner.trees.clone();
        check("names", |s, _, sb, _| {
            t(s).names
                .remove(name_key(sb.kind, sb.workspace, &sb.name))
                .unwrap();
        })
        .await;
        check("names", |s, _, sb, _| {
            t(s).names
                .insert(
                    name_key(Kind::Sandbox, sb.workspace, "ghost"),
                    sb.id.as_bytes(),
                )
                .unwrap();
        })
        .await;
        // The owner's set: its head gone (its chunk is then beyond it), then a chunk listing a
        // record it does not own.
        check("owners", |s, _, sb, _| {
            t(s).owners.remove(sb.id.as_bytes()).unwrap();
        })
        .await;
        check("owners", |s, ws, sb, set| {
            for (key, value) in crate::idsets::chunked(sb.id, &[set.id, ws.id]) {
                t(s).owners.insert(key, value).unwrap();
            }
        })
        .await;
        check("refs", |s, ws, _, set| {
            for (key, value) in crate::idsets::chunked(ws.id, &[set.id]) {
                t(s).refs.insert(key, value).unwrap();
            }
        })
        .await;
        check("order_all", |s, _, sb, _| {
            t(s).order_all
                .remove(order_all_key(sb.kind, sb.created_at_ms, sb.id))
                .unwrap();
        })
        .await;
        check("order_ws", |s, ws, sb, _| {
            t(s).order_ws
                .insert(&order_ws_key(ws.id, sb.kind, 99, sb.id)[..], &[][..])
                .unwrap();
        })
        .await;
        check("ws_counts", |s, ws, _, _| {
            t(s).ws_counts
                .insert(ws.id.as_bytes(), &encode_u64(1))
                .unwrap();
        })
        .await;
        check("meta", |s, _, _, _| {
            t(s).meta.insert(META_REVISION, &encode_u64(1)).unwrap();
        })
        .await;
        check("records", |s, _, sb, _| {
            t(s).records
                .insert(sb.id.as_bytes(), &b"\xff\xff"[..])
                .unwrap();
        })
        .await;
    }
}

/// What [`SledStore::check_integrity`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntegrityReport {
    /// The store's revision: the last commit it holds.
    pub revision: u64,
    /// The last commit acknowledged, as the mark beside the store says (`None`: no mark, a
    /// store made before marks or never written).
    pub high_water: Option<u64>,
    /// Records and indexes that disagree ([`SledStore::verify_indexes`]).
    pub problems: Vec<IndexProblem>,
}

impl IntegrityReport {
    /// Whether acknowledged commits are missing: the store is older than its mark.
    pub fn lost_commits(&self) -> bool {
        self.high_water.is_some_and(|mark| mark > self.revision)
    }

    pub fn healthy(&self) -> bool {
        !self.lost_commits() && self.problems.is_empty()
    }

    /// What is wrong, in a few lines (empty when healthy).
    pub fn describe(&self) -> String {
        let mut lines = Vec::new();
        if let Some(mark) = self.high_water.filter(|_| self.lost_commits()) {
            lines.push(format!(
                "the store holds commits up to revision {}, but revision {mark} was acknowledged: \
                 {} acknowledged commit(s) are missing (the store was truncated, damaged or \
                 replaced by an older copy)",
                self.revision,
                mark - self.revision
            ));
        }
        for problem in self.problems.iter().take(20) {
            lines.push(problem.to_string());
        }
        if self.problems.len() > 20 {
            lines.push(format!(
                "… and {} more index problems",
                self.problems.len() - 20
            ));
        }
        lines.join("\n")
    }
}

impl SledStore {
    /// The store against its high-water mark and its own indexes. Run it before serving.
    pub fn check_integrity(&self) -> Result<IntegrityReport, StoreError> {
        Ok(IntegrityReport {
            revision: self.revision()?,
            high_water: crate::committer::read_high_water(self.path())?,
            problems: self.verify_indexes()?,
        })
    }

    /// Takes the store as it is from now on: its mark is set to its revision (after an
    /// operator chose to accept a loss, or restored a backup on purpose).
    pub fn accept_as_is(&self) -> Result<(), StoreError> {
        let mark = crate::committer::HighWater::open(self.path())?;
        mark.reset(self.revision()?)
            .map_err(|e| StoreError::Io(format!("writing the high-water mark: {e}")))
    }
}
