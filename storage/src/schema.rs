//! The schema version in the `meta` tree, checked at open, and the migrations between versions.
//!
//! History:
//! - **1**: `records`, `names`, `owners`, `order_all`, `meta`. Listing one workspace scanned the
//!   global order index, and the empty-workspace check scanned it too.
//! - **2** (current): adds `order_ws` (a per-workspace order index) and `ws_counts` (records per
//!   workspace, for the `NotEmpty` check inside a transaction, where sled cannot range-scan).
//!   Migration 1 → 2 builds both from the records.

use std::collections::BTreeMap;
use std::path::Path;

use sled::Transactional;
use sled::transaction::ConflictableTransactionError;
use uuid::Uuid;

use crate::envelope::decode_record;
use crate::error::StoreError;
use crate::layout::{
    META_REVISION, META_SCHEMA_VERSION, TREE_META, TREE_ORDER_WS, TREE_RECORDS, TREE_WS_COUNTS,
    encode_u64, order_ws_key,
};

/// The schema version this build writes.
pub const SCHEMA_VERSION: u32 = 2;

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
const MIGRATIONS: &[(u32, Migration)] = &[(1, migrate_1_to_2)];

/// Checks (and if needed writes or migrates) the schema version of `db`, opened from `path`.
pub fn prepare(db: &sled::Db, path: &Path) -> Result<SchemaOutcome, StoreError> {
    let meta = db.open_tree(TREE_META)?;
    let refuse = |found: String, reason: &str| StoreError::Schema {
        path: path.to_path_buf(),
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
