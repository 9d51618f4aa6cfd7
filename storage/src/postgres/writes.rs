//! The PostgreSQL store's writes: create, compare-and-swap update and cascading delete, each
//! one transaction that first takes the global revision. Holding the revision row's lock until
//! commit makes the writes of every gateway on the database take turns, so each write's checks
//! (a taken name, a missing owner, a version) see every write committed before it, and the
//! revisions come in commit order. A refused write rolls back: it bumps nothing.

use std::collections::HashSet;

use deadpool_postgres::Transaction;
use uuid::Uuid;

use super::{COLUMNS, PgStore, labels_json, record_from_row, to_i64};
use crate::error::StoreError;
use crate::record::{Kind, NewRecord, Record};
use crate::writes::{validate_new, validate_update};

/// Commits on success (the write is acknowledged only once the commit returned), rolls back
/// on a refusal.
async fn finish<T>(
    store: &PgStore,
    tx: Transaction<'_>,
    result: Result<T, StoreError>,
) -> Result<T, StoreError> {
    match result {
        Ok(value) => {
            let began = std::time::Instant::now();
            tx.commit().await.map_err(|e| store.err(e))?;
            store.committed(began.elapsed());
            Ok(value)
        }
        Err(e) => {
            // A rollback that fails (the connection is gone) rolls back all the same.
            let _ = tx.rollback().await;
            Err(e)
        }
    }
}

/// Bumps and returns the global revision, taking the lock that orders every write.
async fn take_revision(store: &PgStore, tx: &Transaction<'_>) -> Result<u64, StoreError> {
    let stmt = tx
        .prepare_cached(
            "UPDATE sbx_meta SET value = value + 1 WHERE key = 'revision' RETURNING value",
        )
        .await
        .map_err(|e| store.err(e))?;
    let row = tx.query_one(&stmt, &[]).await.map_err(|e| store.err(e))?;
    let value: i64 = row.get(0);
    u64::try_from(value).map_err(|_| StoreError::Corrupt(format!("revision is negative: {value}")))
}

/// How many revisions the change log keeps: a gateway's watch resumes from any of the last
/// this many writes (the event history a gateway keeps in memory is 10,000 events by default).
pub const CHANGE_LOG_REVISIONS: u64 = 10_000;

/// A write trims the change log every this many revisions at most (every quarter of what it
/// keeps, if that is fewer).
const TRIM_EVERY: u64 = 256;

/// Logs, at `revision`, the records `ids` (those of a logged kind) as they stand now in
/// `sbx_records`: called after a create or update wrote them, and before a delete removes
/// them (`op` 2, their version then the delete's revision). Trims the log to the store's
/// `change_log_keep` revisions every [`TRIM_EVERY`] revisions (or a quarter of what it keeps),
/// and moves `changes_from` past what it trimmed.
async fn log_changes(
    store: &PgStore,
    tx: &Transaction<'_>,
    revision: u64,
    op: i16,
    ids: &[Uuid],
) -> Result<(), StoreError> {
    let logged: Vec<i16> = Kind::ALL
        .iter()
        .filter(|k| k.in_change_log())
        .map(|k| i16::from(k.tag()))
        .collect();
    let rev = to_i64(revision, "revision")?;
    rows(
        store,
        tx,
        "INSERT INTO sbx_changes (revision, op, id, kind, workspace, name, owner, labels, \
         created_at_ms, updated_at_ms, body, resource_version, refs) \
         SELECT $1, $2::smallint, id, kind, workspace, name, owner, labels, created_at_ms, updated_at_ms, \
         body, CASE WHEN $2::smallint = 2 THEN $1 ELSE resource_version END, refs \
         FROM sbx_records WHERE id = ANY($3) AND kind = ANY($4)",
        &[&rev, &op, &ids, &logged],
    )
    .await?;
    let keep = store.change_log_keep;
    if revision.is_multiple_of((keep / 4).clamp(1, TRIM_EVERY)) && revision > keep {
        let keep_after = to_i64(revision - keep, "revision")?;
        rows(
            store,
            tx,
            "DELETE FROM sbx_changes WHERE revision <= $1",
            &[&keep_after],
        )
        .await?;
        rows(
            store,
            tx,
            "UPDATE sbx_meta SET value = GREATEST(value, $1) WHERE key = 'changes_from'",
            &[&keep_after],
        )
        .await?;
    }
    Ok(())
}

/// The rows `sql` answers for `params`, inside the transaction.
async fn rows(
    store: &PgStore,
    tx: &Transaction<'_>,
    sql: &str,
    params: &[&super::PgParam<'_>],
) -> Result<Vec<tokio_postgres::Row>, StoreError> {
    let stmt = tx.prepare_cached(sql).await.map_err(|e| store.err(e))?;
    tx.query(&stmt, params).await.map_err(|e| store.err(e))
}

async fn record(
    store: &PgStore,
    tx: &Transaction<'_>,
    id: Uuid,
) -> Result<Option<Record>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM sbx_records WHERE id = $1");
    match rows(store, tx, &sql, &[&id]).await?.first() {
        Some(row) => record_from_row(row).map(Some),
        None => Ok(None),
    }
}

/// The id of the record holding `name` of `kind` in `scope`, if any.
async fn name_holder(
    store: &PgStore,
    tx: &Transaction<'_>,
    kind: Kind,
    scope: Option<Uuid>,
    name: &str,
) -> Result<Option<Uuid>, StoreError> {
    let kind = i16::from(kind.tag());
    let found = match scope {
        Some(scope) => {
            let sql =
                "SELECT id FROM sbx_records WHERE kind = $1 AND name_scope = $2 AND name = $3";
            rows(store, tx, sql, &[&kind, &scope, &name]).await?
        }
        None => {
            let sql =
                "SELECT id FROM sbx_records WHERE kind = $1 AND name_scope IS NULL AND name = $2";
            rows(store, tx, sql, &[&kind, &name]).await?
        }
    };
    Ok(found.first().map(|r| r.get(0)))
}

pub(super) async fn create(
    store: &PgStore,
    rec: NewRecord,
    refs: Vec<Uuid>,
) -> Result<Record, StoreError> {
    validate_new(&rec, &refs)?;
    let mut client = store.client().await?;
    let tx = client.transaction().await.map_err(|e| store.err(e))?;
    let result = create_in(store, &tx, rec, refs).await;
    finish(store, tx, result).await
}

async fn create_in(
    store: &PgStore,
    tx: &Transaction<'_>,
    rec: NewRecord,
    refs: Vec<Uuid>,
) -> Result<Record, StoreError> {
    let revision = take_revision(store, tx).await?;
    let taken = |existing| StoreError::AlreadyExists {
        kind: rec.kind,
        name: rec.name.clone(),
        existing,
    };
    if !rows(
        store,
        tx,
        "SELECT 1 FROM sbx_records WHERE id = $1",
        &[&rec.id],
    )
    .await?
    .is_empty()
    {
        return Err(taken(rec.id));
    }
    if let Some(existing) = name_holder(store, tx, rec.kind, rec.name_scope(), &rec.name).await? {
        return Err(taken(existing));
    }
    if let Some(ws) = rec.workspace {
        let kind = rows(
            store,
            tx,
            "SELECT kind FROM sbx_records WHERE id = $1",
            &[&ws],
        )
        .await?;
        if kind.first().map(|r| r.get::<_, i16>(0)) != Some(i16::from(Kind::Workspace.tag())) {
            return Err(StoreError::WorkspaceNotFound { workspace: ws });
        }
    }
    if let Some(owner) = rec.owner {
        let found = rows(
            store,
            tx,
            "SELECT workspace FROM sbx_records WHERE id = $1",
            &[&owner],
        )
        .await?;
        let Some(row) = found.first() else {
            return Err(StoreError::OwnerNotFound { owner });
        };
        if row.get::<_, Option<Uuid>>(0) != rec.workspace {
            return Err(StoreError::invalid(format!(
                "owner {owner} is not in the same workspace as record {}",
                rec.id
            )));
        }
    }
    // A reference is to a record of the same workspace, or a global one; one elsewhere is as
    // good as missing to this creator.
    if !refs.is_empty() {
        let found = rows(
            store,
            tx,
            "SELECT id, workspace FROM sbx_records WHERE id = ANY($1)",
            &[&refs],
        )
        .await?;
        let reachable: HashSet<Uuid> = found
            .iter()
            .filter(|r| {
                let ws: Option<Uuid> = r.get(1);
                ws.is_none() || ws == rec.workspace
            })
            .map(|r| r.get(0))
            .collect();
        if let Some(missing) = refs.iter().find(|t| !reachable.contains(t)) {
            return Err(StoreError::ReferenceNotFound { id: *missing });
        }
    }
    let stored = Record::from_new(rec, refs, revision);
    let version = to_i64(revision, "revision")?;
    let stmt = tx
        .prepare_cached(
            "INSERT INTO sbx_records (id, kind, workspace, name, name_scope, owner, labels, \
             created_at_ms, updated_at_ms, body, resource_version, refs, created_rev) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8, $9, $10, $11, $10)",
        )
        .await
        .map_err(|e| store.err(e))?;
    tx.execute(
        &stmt,
        &[
            &stored.id,
            &i16::from(stored.kind.tag()),
            &stored.workspace,
            &stored.name,
            &stored.name_scope(),
            &stored.owner,
            &labels_json(&stored.labels),
            &to_i64(stored.created_at_ms, "created_at_ms")?,
            &stored.body,
            &version,
            &stored.refs,
        ],
    )
    .await
    .map_err(|e| store.err(e))?;
    if !stored.refs.is_empty() {
        let stmt = tx
            .prepare_cached(
                "INSERT INTO sbx_refs (target, referrer, rev) SELECT t, $2, $3 FROM unnest($1::uuid[]) AS t",
            )
            .await
            .map_err(|e| store.err(e))?;
        tx.execute(&stmt, &[&stored.refs, &stored.id, &version])
            .await
            .map_err(|e| store.err(e))?;
    }
    if stored.kind.in_change_log() {
        log_changes(store, tx, revision, 0, &[stored.id]).await?;
    }
    Ok(stored)
}

pub(super) async fn update(store: &PgStore, rec: Record) -> Result<Record, StoreError> {
    let mut client = store.client().await?;
    let tx = client.transaction().await.map_err(|e| store.err(e))?;
    let result = update_in(store, &tx, rec).await;
    finish(store, tx, result).await
}

async fn update_in(
    store: &PgStore,
    tx: &Transaction<'_>,
    rec: Record,
) -> Result<Record, StoreError> {
    let revision = take_revision(store, tx).await?;
    let Some(stored) = record(store, tx, rec.id).await? else {
        return Err(StoreError::NotFound { id: rec.id });
    };
    validate_update(&stored, &rec)?;
    let updated = Record {
        labels: rec.labels,
        body: rec.body,
        updated_at_ms: rec.updated_at_ms,
        resource_version: revision,
        ..stored
    };
    let stmt = tx
        .prepare_cached(
            "UPDATE sbx_records SET labels = $2, body = $3, updated_at_ms = $4, \
             resource_version = $5 WHERE id = $1",
        )
        .await
        .map_err(|e| store.err(e))?;
    tx.execute(
        &stmt,
        &[
            &updated.id,
            &labels_json(&updated.labels),
            &updated.body,
            &to_i64(updated.updated_at_ms, "updated_at_ms")?,
            &to_i64(revision, "revision")?,
        ],
    )
    .await
    .map_err(|e| store.err(e))?;
    if updated.kind.in_change_log() {
        log_changes(store, tx, revision, 1, &[updated.id]).await?;
    }
    Ok(updated)
}

pub(super) async fn delete(
    store: &PgStore,
    id: Uuid,
    expected: u64,
) -> Result<Vec<Uuid>, StoreError> {
    let mut client = store.client().await?;
    let tx = client.transaction().await.map_err(|e| store.err(e))?;
    let result = delete_in(store, &tx, id, expected).await;
    finish(store, tx, result).await
}

async fn delete_in(
    store: &PgStore,
    tx: &Transaction<'_>,
    id: Uuid,
    expected: u64,
) -> Result<Vec<Uuid>, StoreError> {
    let revision = take_revision(store, tx).await?;
    let Some(root) = record(store, tx, id).await? else {
        return Err(StoreError::NotFound { id });
    };
    if root.resource_version != expected {
        return Err(StoreError::Conflict {
            id,
            expected,
            actual: root.resource_version,
        });
    }
    // Breadth-first over the owner index, level by level, each owner's records in the order
    // they were created; `seen` guards against a corrupt cycle.
    let mut doomed: Vec<(Uuid, Kind)> = vec![(root.id, root.kind)];
    let mut seen: HashSet<Uuid> = HashSet::from([id]);
    let mut level = vec![id];
    while !level.is_empty() {
        let children = rows(
            store,
            tx,
            "SELECT id, kind FROM sbx_records WHERE owner = ANY($1) \
             ORDER BY array_position($1, owner), created_rev",
            &[&level],
        )
        .await?;
        level = Vec::new();
        for row in children {
            let child: Uuid = row.get(0);
            if !seen.insert(child) {
                continue;
            }
            let tag: i16 = row.get(1);
            let kind = u8::try_from(tag)
                .ok()
                .and_then(Kind::from_tag)
                .ok_or_else(|| StoreError::Corrupt(format!("record {child} has kind {tag}")))?;
            doomed.push((child, kind));
            level.push(child);
        }
    }
    let ids: Vec<Uuid> = doomed.iter().map(|(id, _)| *id).collect();
    // A record that something outside this delete refers to keeps everything.
    let referred = rows(
        store,
        tx,
        "SELECT target, referrer FROM sbx_refs WHERE target = ANY($1) \
         AND NOT (referrer = ANY($1)) ORDER BY array_position($1, target), rev, referrer",
        &[&ids],
    )
    .await?;
    if let Some(first) = referred.first() {
        let target: Uuid = first.get(0);
        let by = referred
            .iter()
            .filter(|r| r.get::<_, Uuid>(0) == target)
            .map(|r| r.get(1))
            .collect();
        return Err(StoreError::Referenced { id: target, by });
    }
    for (ws, _) in doomed.iter().filter(|(_, kind)| *kind == Kind::Workspace) {
        let left = rows(
            store,
            tx,
            "SELECT count(*) FROM sbx_records WHERE workspace = $1 AND NOT (id = ANY($2))",
            &[ws, &ids],
        )
        .await?;
        let remaining: i64 = left.first().map(|r| r.get(0)).unwrap_or(0);
        if remaining > 0 {
            return Err(StoreError::NotEmpty {
                workspace: *ws,
                remaining: remaining as u64,
            });
        }
    }
    if doomed.iter().any(|(_, kind)| kind.in_change_log()) {
        let mut logged: Vec<Uuid> = doomed
            .iter()
            .filter(|(_, kind)| kind.in_change_log())
            .map(|(id, _)| *id)
            .collect();
        logged.sort();
        log_changes(store, tx, revision, 2, &logged).await?;
    }
    rows(
        store,
        tx,
        "DELETE FROM sbx_refs WHERE referrer = ANY($1) OR target = ANY($1)",
        &[&ids],
    )
    .await?;
    rows(
        store,
        tx,
        "DELETE FROM sbx_records WHERE id = ANY($1)",
        &[&ids],
    )
    .await?;
    Ok(ids)
}
