//! The schema version in the `meta` tree, checked at open, and the migrations between versions.
//!
//! History:
//! - **1**: `records`, `names`, `owners`, `order_all`, `meta`. Listing one workspace scanned the
//!   global order index, and the empty-workspace check scanned it too.
//! - **2**: adds `order_ws` (a per-workspace order index) and `ws_counts` (records per
//!   workspace, for the `NotEmpty` check inside a transaction, where sled cannot range-scan).
//!   Migration 1 → 2 builds both from the records.
//! - **3** (current): `owners` holds chunked id sets (`idsets.rs`) instead of one list per
//!   owner; `refs` (new) holds, chunked the same way, who refers to each record; an owned
//!   record's name is unique per owner (its `names` key carries the owner, not the workspace).
//!   Migration 2 → 3 rebuilds `owners` and the owned records' `names` entries from the records
//!   (no record of version 2 refers to another, so `refs` starts empty).

use std::collections::BTreeMap;
use std::path::Path;

use sled::Transactional;
use sled::transaction::ConflictableTransactionError;
use uuid::Uuid;

use crate::envelope::decode_record;
use crate::error::StoreError;
use crate::layout::{
    META_REVISION, META_SCHEMA_VERSION, TREE_META, TREE_NAMES, TREE_ORDER_WS, TREE_OWNERS,
    TREE_RECORDS, TREE_WS_COUNTS, decode_id_list, encode_u64, name_key, order_ws_key,
};

/// The schema version this build writes.
pub const SCHEMA_VERSION: u32 = 3;

/// What opening found and did, for logs and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SchemaOutcome {
    /// An empty database: the current version was written.
    Initialized,
    /// The database already had the current version.
    Current,
    /// The database was migrated from `from` to the current version.
    Migrated { from: u32 },
}

type Migration = fn(&sled::Db) -> Result<(), StoreError>;

/// `(from, step)`: `step` turns a version-`from` database into version `from + 1`, including
/// writing the new version number, in one transaction.
const MIGRATIONS: &[(u32, Migration)] = &[(1, migrate_1_to_2), (2, migrate_2_to_3)];

/// Checks (and if needed writes or migrates) the schema version of `db`, opened from `path`.
pub fn prepare(db: &sled::Db, path: &Path) -> Result<SchemaOutcome, StoreError> {
    let meta = db.open_tree(TREE_META)?;
    let refuse = |found: String, reason: &str| StoreError::Schema {
        store: format!("sled store at {}", path.display()),
        found,
        supported: SCHEMA_VERSION,
        reason: reason.to_string(),
    };
    let Some(raw) = meta.get(META_SCHEMA_VERSION)? else {
        // No version: only a database with no data at all may be initialized.
        for name in db.tree_names() {
            let tree = db.open_tree(&name)?;
            if !tree.is_empty() {
                return Err(refuse(
                    "none".into(),
                    &format!(
                        "the database has data (tree {:?}) but no schema version; refusing to guess",
                        String::from_utf8_lossy(&name)
                    ),
                ));
            }
        }
        meta.transaction(|m| {
            m.insert(META_SCHEMA_VERSION, &SCHEMA_VERSION.to_be_bytes())?;
            m.insert(META_REVISION, &encode_u64(0))?;
            Ok::<_, ConflictableTransactionError<StoreError>>(())
        })?;
        db.flush()?;
        return Ok(SchemaOutcome::Initialized);
    };
    let found = read_version(&raw)
        .ok_or_else(|| refuse(format!("{raw:02x?}"), "the stored version is not a u32"))?;
    if found == SCHEMA_VERSION {
        return Ok(SchemaOutcome::Current);
    }
    if found > SCHEMA_VERSION {
        return Err(refuse(
            found.to_string(),
            "written by a newer build; upgrade this binary",
        ));
    }
    let mut version = found;
    while version < SCHEMA_VERSION {
        let Some((_, step)) = MIGRATIONS.iter().find(|(from, _)| *from == version) else {
            return Err(refuse(
                found.to_string(),
                &format!("no migration is known from version {version}"),
            ));
        };
        step(db)?;
        let now = meta
            .get(META_SCHEMA_VERSION)?
            .as_deref()
            .and_then(read_version);
        if now != Some(version + 1) {
            return Err(StoreError::Corrupt(format!(
                "migration from schema version {version} left version {now:?}"
            )));
        }
        tracing::info!(from = version, to = version + 1, path = %path.display(), "migrated store schema");
        version += 1;
    }
    db.flush()?;
    Ok(SchemaOutcome::Migrated { from: found })
}

fn read_version(raw: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(raw.try_into().ok()?))
}

/// 1 → 2: builds `order_ws` and `ws_counts` from the records. The database is opened
/// exclusively (sled holds a file lock), so the scan outside the transaction sees every record;
/// the transaction writes the new entries and the new version together, so a crash leaves either
/// version 1 untouched or a complete version 2.
fn migrate_1_to_2(db: &sled::Db) -> Result<(), StoreError> {
    let records = db.open_tree(TREE_RECORDS)?;
    let order_ws = db.open_tree(TREE_ORDER_WS)?;
    let ws_counts = db.open_tree(TREE_WS_COUNTS)?;
    let meta = db.open_tree(TREE_META)?;
    let mut order_keys = Vec::new();
    let mut counts: BTreeMap<Uuid, u64> = BTreeMap::new();
    for entry in records.iter() {
        let (_, value) = entry?;
        let rec = decode_record(&value)?;
        if let Some(ws) = rec.workspace {
            order_keys.push(order_ws_key(ws, rec.kind, rec.created_at_ms, rec.id));
            *counts.entry(ws).or_default() += 1;
        }
    }
    (&order_ws, &ws_counts, &meta).transaction(|(order_ws, ws_counts, meta)| {
        if meta
            .get(META_SCHEMA_VERSION)?
            .as_deref()
            .and_then(read_version)
            != Some(1)
        {
            return Err(ConflictableTransactionError::Abort(StoreError::Corrupt(
                "schema version changed during migration 1 -> 2".into(),
            )));
        }
        for key in &order_keys {
            order_ws.insert(&key[..], &[][..])?;
        }
        for (ws, count) in &counts {
            ws_counts.insert(ws.as_bytes(), &encode_u64(*count))?;
        }
        meta.insert(META_SCHEMA_VERSION, &2u32.to_be_bytes())?;
        Ok(())
    })?;
    Ok(())
}

/// 2 → 3: the owner index as chunked sets, and owned records named per owner. Built from the
/// records outside the transaction (the database is opened exclusively), written in one
/// transaction with the new version, so a crash leaves version 2 untouched or a whole version 3.
fn migrate_2_to_3(db: &sled::Db) -> Result<(), StoreError> {
    let records = db.open_tree(TREE_RECORDS)?;
    let names = db.open_tree(TREE_NAMES)?;
    let owners = db.open_tree(TREE_OWNERS)?;
    let meta = db.open_tree(TREE_META)?;
    let mut owned: BTreeMap<Uuid, Vec<(u64, Uuid)>> = BTreeMap::new();
    let mut renames = Vec::new();
    for entry in records.iter() {
        let (_, value) = entry?;
        let rec = decode_record(&value)?;
        if let Some(owner) = rec.owner {
            owned
                .entry(owner)
                .or_default()
                .push((rec.created_at_ms, rec.id));
            renames.push((
                name_key(rec.kind, rec.workspace, &rec.name),
                name_key(rec.kind, rec.name_scope(), &rec.name),
                rec.id,
            ));
        }
    }
    // Version 2's lists keep their order (creation order); an owned record a list missed
    // goes after, by creation time.
    let mut old_owner_keys = Vec::new();
    let mut old_lists: BTreeMap<Uuid, Vec<Uuid>> = BTreeMap::new();
    for entry in owners.iter() {
        let (key, value) = entry?;
        if let (Ok(owner), Ok(ids)) = (Uuid::from_slice(&key), decode_id_list(&value)) {
            old_lists.insert(owner, ids);
        }
        old_owner_keys.push(key);
    }
    let mut new_owner_entries = Vec::new();
    for (owner, mut members) in owned {
        members.sort();
        let mut missed: std::collections::BTreeSet<Uuid> =
            members.iter().map(|(_, id)| *id).collect();
        let mut ids: Vec<Uuid> = old_lists
            .remove(&owner)
            .unwrap_or_default()
            .into_iter()
            .filter(|id| missed.remove(id))
            .collect();
        ids.extend(
            members
                .into_iter()
                .map(|(_, id)| id)
                .filter(|id| missed.contains(id)),
        );
        new_owner_entries.extend(crate::idsets::chunked(owner, &ids));
    }
    (&names, &owners, &meta).transaction(|(names, owners, meta)| {
        if meta
            .get(META_SCHEMA_VERSION)?
            .as_deref()
            .and_then(read_version)
            != Some(2)
        {
            return Err(ConflictableTransactionError::Abort(StoreError::Corrupt(
                "schema version changed during migration 2 -> 3".into(),
            )));
        }
        for key in &old_owner_keys {
            owners.remove(key)?;
        }
        for (key, value) in &new_owner_entries {
            owners.insert(key.as_slice(), value.as_slice())?;
        }
        for (old, new, id) in &renames {
            // Only the record's own entry moves (a version-2 name clash between two owners'
            // records of one workspace could not exist: the old key was unique).
            if names.get(old)?.as_deref() == Some(&id.as_bytes()[..]) {
                names.remove(old.as_slice())?;
            }
            names.insert(new.as_slice(), id.as_bytes().as_slice())?;
        }
        meta.insert(META_SCHEMA_VERSION, &3u32.to_be_bytes())?;
        Ok(())
    })?;
    Ok(())
}
