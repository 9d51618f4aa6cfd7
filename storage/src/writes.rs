//! The write operations: create, compare-and-swap update and cascading delete. A batch of them
//! runs as one sled transaction over every tree (see `committer.rs` for why batches); each
//! operation bumps the global revision and sees the writes of the operations before it.

use std::collections::HashSet;

use sled::Transactional;
use sled::transaction::{ConflictableTransactionError, TransactionalTree};
use uuid::Uuid;

use crate::envelope::{decode_record, encode_record};
use crate::error::StoreError;
use crate::idsets::TxSets;
use crate::layout::{
    META_REVISION, decode_u64, decode_uuid, encode_u64, name_key, order_all_key, order_ws_key,
    record_key,
};
use crate::record::{Kind, NewRecord, Record};
use crate::selector::validate_labels;
use crate::trees::Trees;

type TxResult<T> = Result<T, ConflictableTransactionError<StoreError>>;

fn abort<T>(err: StoreError) -> TxResult<T> {
    Err(ConflictableTransactionError::Abort(err))
}

/// The trees of one write transaction, by name.
struct Tx<'a> {
    records: &'a TransactionalTree,
    names: &'a TransactionalTree,
    /// owner → what it owns.
    owners: TxSets<'a>,
    /// record → the records that refer to it.
    refs: TxSets<'a>,
    order_all: &'a TransactionalTree,
    order_ws: &'a TransactionalTree,
    ws_counts: &'a TransactionalTree,
    meta: &'a TransactionalTree,
}

impl Tx<'_> {
    fn record(&self, id: Uuid) -> TxResult<Option<Record>> {
        match self.records.get(record_key(id))? {
            Some(raw) => match decode_record(&raw) {
                Ok(rec) => Ok(Some(rec)),
                Err(e) => abort(e),
            },
            None => Ok(None),
        }
    }

    fn ws_count(&self, ws: Uuid) -> TxResult<u64> {
        match self.ws_counts.get(ws.as_bytes())? {
            Some(raw) => decode_u64(&raw, "workspace count").or_else(abort),
            None => Ok(0),
        }
    }

    fn set_ws_count(&self, ws: Uuid, count: u64) -> TxResult<()> {
        if count == 0 {
            self.ws_counts.remove(ws.as_bytes())?;
        } else {
            self.ws_counts.insert(ws.as_bytes(), &encode_u64(count))?;
        }
        Ok(())
    }

    /// Bumps and returns the global revision.
    fn next_revision(&self) -> TxResult<u64> {
        let current = match self.meta.get(META_REVISION)? {
            Some(raw) => decode_u64(&raw, "stored revision").or_else(abort)?,
            None => 0,
        };
        let next = current + 1;
        self.meta.insert(META_REVISION, &encode_u64(next))?;
        Ok(next)
    }
}

/// One write, as queued for the committer.
#[derive(Debug, Clone)]
pub(crate) enum WriteOp {
    /// A record and the records it refers to.
    Create(NewRecord, Vec<Uuid>),
    Update(Record),
    Delete {
        id: Uuid,
        expected_version: u64,
    },
}

/// What a successful write returns.
#[derive(Debug, Clone)]
pub(crate) enum WriteOutcome {
    Written(Record),
    Deleted(Vec<Uuid>),
}

/// Runs `ops` in order inside one sled transaction. Each operation that is refused (a request
/// error such as `AlreadyExists` or `Conflict`) is refused before it writes anything, so it gets
/// its own error and the others go on. A fault (`Io`, `Corrupt`) fails the whole batch and
/// nothing is written.
pub(crate) fn apply_batch(
    trees: &Trees,
    ops: &[WriteOp],
) -> Result<Vec<Result<WriteOutcome, StoreError>>, StoreError> {
    let results = (
        &trees.records,
        &trees.names,
        &trees.owners,
        &trees.refs,
        &trees.order_all,
        &trees.order_ws,
        &trees.ws_counts,
        &trees.meta,
    )
        .transaction(
            |(records, names, owners, refs, order_all, order_ws, ws_counts, meta)| {
                let tx = Tx {
                    records,
                    names,
                    owners: TxSets {
                        tree: owners,
                        what: "owner index",
                    },
                    refs: TxSets {
                        tree: refs,
                        what: "reference index",
                    },
                    order_all,
                    order_ws,
                    ws_counts,
                    meta,
                };
                let mut results = Vec::with_capacity(ops.len());
                for op in ops {
                    let result = match op {
                        WriteOp::Create(rec, refs) => {
                            create(&tx, rec, refs).map(WriteOutcome::Written)
                        }
                        WriteOp::Update(rec) => update(&tx, rec).map(WriteOutcome::Written),
                        WriteOp::Delete {
                            id,
                            expected_version,
                        } => delete(&tx, *id, *expected_version).map(WriteOutcome::Deleted),
                    };
                    match result {
                        Ok(outcome) => results.push(Ok(outcome)),
                        Err(ConflictableTransactionError::Abort(e)) if e.is_request_error() => {
                            results.push(Err(e))
                        }
                        Err(other) => return Err(other),
                    }
                }
                Ok(results)
            },
        )?;
    Ok(results)
}

/// The latest time a record may carry, in milliseconds since 1970 (`i64::MAX`: a store on a
/// database keeps times as signed 64-bit integers; this is some 292 million years away).
pub const MAX_TIME_MS: u64 = i64::MAX as u64;

/// Checks an update of `stored` to `rec` as every store does, before it writes: the labels,
/// the time, no immutable field changed, then the version (`Conflict`).
pub(crate) fn validate_update(stored: &Record, rec: &Record) -> Result<(), StoreError> {
    validate_labels(&rec.labels)?;
    if rec.updated_at_ms > MAX_TIME_MS {
        return Err(StoreError::invalid(format!(
            "record {} has updated_at_ms {}, past the latest time a record may carry ({MAX_TIME_MS})",
            rec.id, rec.updated_at_ms
        )));
    }
    let immutable = [
        ("kind", stored.kind != rec.kind),
        ("workspace", stored.workspace != rec.workspace),
        ("name", stored.name != rec.name),
        ("owner", stored.owner != rec.owner),
        ("created_at_ms", stored.created_at_ms != rec.created_at_ms),
    ];
    if let Some((field, _)) = immutable.iter().find(|(_, changed)| *changed) {
        return Err(StoreError::invalid(format!(
            "update of record {} changes its {field}, which is immutable",
            rec.id
        )));
    }
    if stored.resource_version != rec.resource_version {
        return Err(StoreError::Conflict {
            id: rec.id,
            expected: rec.resource_version,
            actual: stored.resource_version,
        });
    }
    Ok(())
}

/// The most records one record may refer to.
pub const MAX_REFS: usize = 64;

/// Checks what can be checked without reading the store.
pub(crate) fn validate_new(rec: &NewRecord, refs: &[Uuid]) -> Result<(), StoreError> {
    if refs.len() > MAX_REFS {
        return Err(StoreError::invalid(format!(
            "record {} refers to {} records; at most {MAX_REFS}",
            rec.id,
            refs.len()
        )));
    }
    let mut seen = HashSet::new();
    for r in refs {
        if r.is_nil() || *r == rec.id || !seen.insert(*r) {
            return Err(StoreError::invalid(format!(
                "record {} cannot refer to {r} (nil, itself, or twice)",
                rec.id
            )));
        }
    }
    if rec.id.is_nil() {
        return Err(StoreError::invalid("record id is the nil UUID"));
    }
    if rec.created_at_ms > MAX_TIME_MS {
        return Err(StoreError::invalid(format!(
            "record {} has created_at_ms {}, past the latest time a record may carry ({MAX_TIME_MS})",
            rec.id, rec.created_at_ms
        )));
    }
    rec.kind
        .validate_name(&rec.name)
        .map_err(|e| StoreError::invalid(format!("{} name {:?}: {e}", rec.kind, rec.name)))?;
    match (rec.kind.is_scoped(), rec.workspace) {
        (true, None) => {
            return Err(StoreError::invalid(format!(
                "a {} must belong to a workspace",
                rec.kind
            )));
        }
        (true, Some(ws)) if ws.is_nil() => {
            return Err(StoreError::invalid(format!(
                "a {} names the nil workspace id",
                rec.kind
            )));
        }
        (false, Some(_)) => {
            return Err(StoreError::invalid(format!(
                "a {} is global and cannot belong to a workspace",
                rec.kind
            )));
        }
        _ => {}
    }
    match rec.owner {
        None if rec.kind.is_owned() => {
            return Err(StoreError::invalid(format!(
                "a {} must have an owner",
                rec.kind
            )));
        }
        Some(owner) if owner.is_nil() || owner == rec.id => {
            return Err(StoreError::invalid(format!(
                "record {} cannot be owned by {owner}",
                rec.id
            )));
        }
        _ => {}
    }
    validate_labels(&rec.labels)
}

fn create(tx: &Tx<'_>, rec: &NewRecord, refs: &[Uuid]) -> TxResult<Record> {
    validate_new(rec, refs).or_else(abort)?;
    let nkey = name_key(rec.kind, rec.name_scope(), &rec.name);
    if tx.records.get(record_key(rec.id))?.is_some() {
        return abort(StoreError::AlreadyExists {
            kind: rec.kind,
            name: rec.name.clone(),
            existing: rec.id,
        });
    }
    if let Some(raw) = tx.names.get(&nkey)? {
        let existing = decode_uuid(&raw, "name index value").or_else(abort)?;
        return abort(StoreError::AlreadyExists {
            kind: rec.kind,
            name: rec.name.clone(),
            existing,
        });
    }
    if let Some(ws) = rec.workspace {
        match tx.record(ws)? {
            Some(w) if w.kind == Kind::Workspace => {}
            _ => return abort(StoreError::WorkspaceNotFound { workspace: ws }),
        }
    }
    if let Some(owner) = rec.owner {
        let Some(o) = tx.record(owner)? else {
            return abort(StoreError::OwnerNotFound { owner });
        };
        if o.workspace != rec.workspace {
            return abort(StoreError::invalid(format!(
                "owner {owner} is not in the same workspace as record {}",
                rec.id
            )));
        }
    }
    // A reference is to a record of the same workspace, or a global one; one elsewhere is as
    // good as missing to this creator.
    for target in refs {
        match tx.record(*target)? {
            Some(t) if t.workspace.is_none() || t.workspace == rec.workspace => {}
            _ => return abort(StoreError::ReferenceNotFound { id: *target }),
        }
    }
    if let Some(owner) = rec.owner {
        tx.owners.add(owner, rec.id)?;
    }
    for target in refs {
        tx.refs.add(*target, rec.id)?;
    }
    let stored = Record::from_new(rec.clone(), refs.to_vec(), tx.next_revision()?);
    tx.records
        .insert(&record_key(rec.id), encode_record(&stored))?;
    tx.names.insert(nkey.as_slice(), rec.id.as_bytes())?;
    tx.order_all
        .insert(&order_all_key(rec.kind, rec.created_at_ms, rec.id), &[][..])?;
    if let Some(ws) = rec.workspace {
        tx.order_ws.insert(
            &order_ws_key(ws, rec.kind, rec.created_at_ms, rec.id)[..],
            &[][..],
        )?;
        tx.set_ws_count(ws, tx.ws_count(ws)? + 1)?;
    }
    Ok(stored)
}

fn update(tx: &Tx<'_>, rec: &Record) -> TxResult<Record> {
    let Some(stored) = tx.record(rec.id)? else {
        return abort(StoreError::NotFound { id: rec.id });
    };
    validate_update(&stored, rec).or_else(abort)?;
    let updated = Record {
        labels: rec.labels.clone(),
        body: rec.body.clone(),
        updated_at_ms: rec.updated_at_ms,
        resource_version: tx.next_revision()?,
        ..stored
    };
    tx.records
        .insert(&record_key(rec.id), encode_record(&updated))?;
    Ok(updated)
}

fn delete(tx: &Tx<'_>, id: Uuid, expected: u64) -> TxResult<Vec<Uuid>> {
    let Some(root) = tx.record(id)? else {
        return abort(StoreError::NotFound { id });
    };
    if root.resource_version != expected {
        return abort(StoreError::Conflict {
            id,
            expected,
            actual: root.resource_version,
        });
    }
    // Breadth-first over the owner index; `seen` guards against a corrupt cycle.
    let mut doomed = vec![root];
    let mut seen: HashSet<Uuid> = HashSet::from([id]);
    let mut next = 0;
    while next < doomed.len() {
        let owner = doomed[next].id;
        next += 1;
        for child in tx.owners.members(owner)? {
            if !seen.insert(child) {
                continue;
            }
            match tx.record(child)? {
                Some(rec) => doomed.push(rec),
                None => tracing::warn!(%owner, %child, "owner index lists a missing record"),
            }
        }
    }
    // A record that something outside this delete refers to keeps everything.
    for rec in &doomed {
        let by: Vec<Uuid> = tx
            .refs
            .members(rec.id)?
            .into_iter()
            .filter(|r| !seen.contains(r))
            .collect();
        if !by.is_empty() {
            return abort(StoreError::Referenced { id: rec.id, by });
        }
    }
    for ws in doomed.iter().filter(|r| r.kind == Kind::Workspace) {
        let inside = doomed.iter().filter(|r| r.workspace == Some(ws.id)).count() as u64;
        let remaining = tx.ws_count(ws.id)?.saturating_sub(inside);
        if remaining > 0 {
            return abort(StoreError::NotEmpty {
                workspace: ws.id,
                remaining,
            });
        }
    }
    for rec in &doomed {
        tx.records.remove(&record_key(rec.id))?;
        tx.names
            .remove(name_key(rec.kind, rec.name_scope(), &rec.name))?;
        tx.order_all
            .remove(&order_all_key(rec.kind, rec.created_at_ms, rec.id)[..])?;
        tx.owners.clear(rec.id)?;
        tx.refs.clear(rec.id)?;
        if let Some(ws) = rec.workspace {
            tx.order_ws
                .remove(&order_ws_key(ws, rec.kind, rec.created_at_ms, rec.id)[..])?;
            tx.set_ws_count(ws, tx.ws_count(ws)?.saturating_sub(1))?;
        }
        if rec.kind == Kind::Workspace {
            tx.ws_counts.remove(rec.id.as_bytes())?;
        }
        // Detach from an owner that survives this delete.
        if let Some(owner) = rec.owner
            && !seen.contains(&owner)
        {
            tx.owners.remove(owner, rec.id)?;
        }
        // And from what it refers to that survives.
        for target in rec.refs.iter().filter(|t| !seen.contains(t)) {
            tx.refs.remove(*target, rec.id)?;
        }
    }
    tx.next_revision()?;
    Ok(doomed.iter().map(|r| r.id).collect())
}
