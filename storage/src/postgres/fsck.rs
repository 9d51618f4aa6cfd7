//! The PostgreSQL store's integrity check: what the database's own constraints do not hold
//! (the unique name index and the primary keys are PostgreSQL's to keep), checked as the sled
//! store's `verify_indexes` checks its trees: every record's kind, name, name scope, workspace
//! and owner; every reference against the records and the reference table, both ways; the
//! schema version and the revision against every record's version. Reads one snapshot
//! (a repeatable-read transaction), so it may run while writes go on.

use std::collections::{HashMap, HashSet};

use uuid::Uuid;

use super::{COLUMNS, PG_SCHEMA_VERSION, PgStore, record_from_row};
use crate::error::StoreError;
use crate::record::{Kind, Record};
use crate::store::IndexProblem;

pub(super) async fn check(store: &PgStore) -> Result<Vec<IndexProblem>, StoreError> {
    let mut client = store.client().await?;
    let tx = client
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .read_only(true)
        .start()
        .await
        .map_err(|e| store.err(e))?;
    let mut problems = Vec::new();
    let mut report = |tree: &'static str, detail: String| {
        problems.push(IndexProblem { tree, detail });
    };

    let meta: HashMap<String, i64> = tx
        .query("SELECT key, value FROM sbx_meta", &[])
        .await
        .map_err(|e| store.err(e))?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let newest_change: Option<i64> = tx
        .query_one("SELECT max(revision) FROM sbx_changes", &[])
        .await
        .map_err(|e| store.err(e))?
        .get(0);
    let revision = check_meta(&meta, newest_change, &mut report);

    let mut records: HashMap<Uuid, Record> = HashMap::new();
    let mut name_scopes: HashMap<Uuid, Option<Uuid>> = HashMap::new();
    let sql = format!("SELECT {COLUMNS}, name_scope FROM sbx_records");
    for row in tx.query(&sql, &[]).await.map_err(|e| store.err(e))? {
        match record_from_row(&row) {
            Ok(rec) => {
                name_scopes.insert(rec.id, row.get(11));
                records.insert(rec.id, rec);
            }
            Err(e) => report("sbx_records", e.to_string()),
        }
    }
    let refs: Vec<(Uuid, Uuid)> = tx
        .query("SELECT target, referrer FROM sbx_refs", &[])
        .await
        .map_err(|e| store.err(e))?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    tx.commit().await.map_err(|e| store.err(e))?;

    for rec in records.values() {
        check_record(rec, &records, &name_scopes, revision, &mut report);
    }
    check_refs(&records, &refs, &mut report);
    Ok(problems)
}

/// `sbx_meta` (the schema version, the revision, where the change log starts) and the newest
/// change against the revision; returns the revision (0 when there is none, reported).
fn check_meta(
    meta: &HashMap<String, i64>,
    newest_change: Option<i64>,
    report: &mut impl FnMut(&'static str, String),
) -> i64 {
    if meta.get("schema_version") != Some(&i64::from(PG_SCHEMA_VERSION)) {
        report(
            "sbx_meta",
            format!(
                "schema_version is {:?}, expected {PG_SCHEMA_VERSION}",
                meta.get("schema_version")
            ),
        );
    }
    let revision = meta.get("revision").copied().unwrap_or_else(|| {
        report("sbx_meta", "no revision row".into());
        0
    });
    match meta.get("changes_from") {
        None => report("sbx_meta", "no changes_from row".into()),
        Some(from) if *from > revision => report(
            "sbx_meta",
            format!("changes_from {from} is beyond the revision {revision}"),
        ),
        Some(_) => {}
    }
    if let Some(newest) = newest_change.filter(|n| *n > revision) {
        report(
            "sbx_changes",
            format!("a change at revision {newest}, beyond the revision {revision}"),
        );
    }
    revision
}

/// One record: its version against the revision, its name and name scope, its workspace and
/// its owner.
fn check_record(
    rec: &Record,
    records: &HashMap<Uuid, Record>,
    name_scopes: &HashMap<Uuid, Option<Uuid>>,
    revision: i64,
    report: &mut impl FnMut(&'static str, String),
) {
    let id = rec.id;
    if rec.resource_version > revision.max(0) as u64 {
        report(
            "sbx_meta",
            format!(
                "record {id} has version {} above the stored revision {revision}",
                rec.resource_version
            ),
        );
    }
    if rec.kind.validate_name(&rec.name).is_err() {
        report(
            "sbx_records",
            format!("record {id} has invalid name {:?}", rec.name),
        );
    }
    if name_scopes.get(&id).copied().flatten() != rec.name_scope() {
        report(
            "sbx_records",
            format!("record {id} has the wrong name scope"),
        );
    }
    match (rec.kind.is_scoped(), rec.workspace) {
        (true, Some(ws)) => match records.get(&ws) {
            Some(w) if w.kind == Kind::Workspace => {}
            _ => report(
                "sbx_records",
                format!("record {id} is in missing workspace {ws}"),
            ),
        },
        (true, None) => report(
            "sbx_records",
            format!("scoped record {id} has no workspace"),
        ),
        (false, Some(_)) => report("sbx_records", format!("global record {id} has a workspace")),
        (false, None) => {}
    }
    match rec.owner {
        Some(owner) => match records.get(&owner) {
            Some(o) if o.workspace == rec.workspace => {}
            Some(_) => report(
                "sbx_records",
                format!("record {id} is owned by {owner} of another workspace"),
            ),
            None => report(
                "sbx_records",
                format!("record {id} has missing owner {owner}"),
            ),
        },
        None if rec.kind.is_owned() => {
            report("sbx_records", format!("owned record {id} has no owner"))
        }
        None => {}
    }
}

/// Every reference row against the records, and every record's references against the rows.
fn check_refs(
    records: &HashMap<Uuid, Record>,
    refs: &[(Uuid, Uuid)],
    report: &mut impl FnMut(&'static str, String),
) {
    let rows: HashSet<(Uuid, Uuid)> = refs.iter().copied().collect();
    for (target, referrer) in refs {
        if !records.contains_key(target) {
            report(
                "sbx_refs",
                format!("{referrer} refers to missing record {target}"),
            );
        }
        match records.get(referrer) {
            Some(r) if r.refs.contains(target) => {}
            Some(_) => report(
                "sbx_refs",
                format!("{referrer} → {target} is not among the referrer's refs"),
            ),
            None => report(
                "sbx_refs",
                format!("missing record {referrer} refers to {target}"),
            ),
        }
    }
    for rec in records.values() {
        for target in &rec.refs {
            if !rows.contains(&(*target, rec.id)) {
                report(
                    "sbx_refs",
                    format!("record {} refers to {target} with no row", rec.id),
                );
            }
        }
    }
}
