//! The PostgreSQL store's tables, its schema version and the migrations between versions.
//!
//! History:
//! - **1**: `sbx_meta` (the schema version and the global revision), `sbx_records` (one row
//!   per record, with its unique name index, owner index and both list orders as indexes of
//!   the table), `sbx_refs` (who refers to whom, in the order written).
//! - **2** (current): `sbx_changes`, the change log — a copy of each record of a logged kind
//!   (`Kind::in_change_log`) as each write left it, by revision — and `changes_from` in
//!   `sbx_meta`, the revision after which the log is complete (a database migrated from 1
//!   starts its log at the revision it had).
//!
//! Every gateway that opens the store runs [`prepare`]; a transaction-scoped advisory lock
//! makes concurrent openers take turns, so two gateways starting at once never both create the
//! tables or both migrate.

use tokio_postgres::Client;

use crate::error::StoreError;
use crate::schema::SchemaOutcome;

/// The schema version this build writes on PostgreSQL.
pub const PG_SCHEMA_VERSION: u32 = 2;

/// The advisory lock key every opener holds while it checks or migrates the schema (any
/// fixed number; "sbx" in ASCII).
const SCHEMA_LOCK: i64 = 0x73_62_78;

/// Version 0 (nothing) → 1: every table and index.
const CREATE_V1: &str = "
CREATE TABLE sbx_meta (
    key   text PRIMARY KEY,
    value bigint NOT NULL
);
INSERT INTO sbx_meta (key, value) VALUES ('schema_version', 1), ('revision', 0);
CREATE TABLE sbx_records (
    id               uuid PRIMARY KEY,
    kind             smallint NOT NULL,
    workspace        uuid,
    name             text NOT NULL,
    -- Where the name is unique: the owner of an owned record, else its workspace (NULL:
    -- global).
    name_scope       uuid,
    owner            uuid,
    labels           jsonb NOT NULL,
    created_at_ms    bigint NOT NULL CHECK (created_at_ms >= 0),
    updated_at_ms    bigint NOT NULL CHECK (updated_at_ms >= 0),
    body             bytea NOT NULL,
    resource_version bigint NOT NULL,
    refs             uuid[] NOT NULL,
    -- The revision that created the record: the order of the owner index.
    created_rev      bigint NOT NULL
);
CREATE UNIQUE INDEX sbx_records_name ON sbx_records (kind, name_scope, name) NULLS NOT DISTINCT;
CREATE INDEX sbx_records_owner ON sbx_records (owner, created_rev) WHERE owner IS NOT NULL;
CREATE INDEX sbx_records_order_all ON sbx_records (kind, created_at_ms, id);
CREATE INDEX sbx_records_order_ws ON sbx_records (workspace, kind, created_at_ms, id)
    WHERE workspace IS NOT NULL;
CREATE TABLE sbx_refs (
    target   uuid NOT NULL,
    referrer uuid NOT NULL,
    -- The revision that wrote the reference: the order `referrers` answers in.
    rev      bigint NOT NULL,
    PRIMARY KEY (target, referrer)
);
CREATE INDEX sbx_refs_referrer ON sbx_refs (referrer);
";

/// Version 1 → 2: the change log. `op` is 0 created, 1 updated, 2 deleted; the other columns
/// are `sbx_records`' (for a delete, the record as it was, `resource_version` the delete's
/// revision).
const ADD_CHANGES_V2: &str = "
CREATE TABLE sbx_changes (
    revision         bigint NOT NULL,
    op               smallint NOT NULL CHECK (op BETWEEN 0 AND 2),
    id               uuid NOT NULL,
    kind             smallint NOT NULL,
    workspace        uuid,
    name             text NOT NULL,
    owner            uuid,
    labels           jsonb NOT NULL,
    created_at_ms    bigint NOT NULL,
    updated_at_ms    bigint NOT NULL,
    body             bytea NOT NULL,
    resource_version bigint NOT NULL,
    refs             uuid[] NOT NULL,
    PRIMARY KEY (revision, id)
);
INSERT INTO sbx_meta (key, value)
    SELECT 'changes_from', value FROM sbx_meta WHERE key = 'revision';
";

/// `MIGRATIONS[v]` turns a version-`v` database into version `v + 1`; [`prepare`] then sets
/// the version in `sbx_meta` (the first creates it).
const MIGRATIONS: &[&str] = &[CREATE_V1, ADD_CHANGES_V2];

/// Checks (and if needed creates or migrates) the schema of the database behind `client`, in
/// one transaction under the schema lock. `store` names the store for errors.
pub(crate) async fn prepare(client: &mut Client, store: &str) -> Result<SchemaOutcome, StoreError> {
    let db = |e| super::pg_error(store, e);
    let tx = client.transaction().await.map_err(db)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK])
        .await
        .map_err(db)?;
    let has_meta: bool = tx
        .query_one("SELECT to_regclass('sbx_meta') IS NOT NULL", &[])
        .await
        .map_err(db)?
        .get(0);
    let found: u32 = if has_meta {
        let row = tx
            .query_opt(
                "SELECT value FROM sbx_meta WHERE key = 'schema_version'",
                &[],
            )
            .await
            .map_err(db)?;
        let refuse = |found: String, reason: &str| StoreError::Schema {
            store: store.to_string(),
            found,
            supported: PG_SCHEMA_VERSION,
            reason: reason.to_string(),
        };
        let Some(row) = row else {
            return Err(refuse(
                "none".into(),
                "sbx_meta exists but holds no schema_version: not a database this build wrote",
            ));
        };
        let value: i64 = row.get(0);
        match u32::try_from(value) {
            Ok(v) if (1..=PG_SCHEMA_VERSION).contains(&v) => v,
            Ok(v) if v > PG_SCHEMA_VERSION => {
                return Err(refuse(
                    v.to_string(),
                    "written by a newer sbx; upgrade this gateway",
                ));
            }
            _ => return Err(refuse(value.to_string(), "not a version any sbx wrote")),
        }
    } else {
        0
    };
    for step in &MIGRATIONS[found as usize..] {
        tx.batch_execute(step).await.map_err(db)?;
    }
    if found < PG_SCHEMA_VERSION {
        tx.execute(
            "UPDATE sbx_meta SET value = $1 WHERE key = 'schema_version'",
            &[&i64::from(PG_SCHEMA_VERSION)],
        )
        .await
        .map_err(db)?;
    }
    tx.commit().await.map_err(db)?;
    Ok(match found {
        0 => SchemaOutcome::Initialized,
        v if v == PG_SCHEMA_VERSION => SchemaOutcome::Current,
        from => SchemaOutcome::Migrated { from },
    })
}
