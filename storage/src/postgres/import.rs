//! Copying a whole store into an empty PostgreSQL store (`sbxd store migrate --to`), then
//! checking the copy against the original record by record.
//!
//! The copy keeps every record as it is — its id, names, times, body and resource version —
//! the global revision, and the order of each owner index and reference index, so a client's
//! resource versions mean the same on the copy. It is one transaction: a copy that fails
//! leaves the database as empty as it found it.

use super::{PgStore, labels_json, to_i64};
use crate::error::StoreError;
use crate::record::{Kind, ListQuery, Record, Scope};
use crate::store::ObjectStore;

/// What a copy held.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopySummary {
    /// Records copied (and found equal in the copy).
    pub records: usize,
    /// The revision of both stores.
    pub revision: u64,
}

/// Every record of `from`, in list order, kind by kind.
async fn every_record(from: &dyn ObjectStore) -> Result<Vec<Record>, StoreError> {
    let mut out = Vec::new();
    for kind in Kind::ALL {
        out.extend(
            from.list(ListQuery::new(kind, Scope::All, 0))
                .await?
                .records,
        );
    }
    Ok(out)
}

impl PgStore {
    /// Copies every record of `from` (which nothing may write meanwhile: a stopped gateway's
    /// store) into this store, which must hold no record, then checks the copy: every record,
    /// owner index and reference index equal, the same revision, no integrity problem.
    pub async fn copy_from(&self, from: &dyn ObjectStore) -> Result<CopySummary, StoreError> {
        let records = every_record(from).await?;
        let revision = from.current_revision().await?;
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(|e| self.err(e))?;
        let held: i64 = tx
            .query_one("SELECT count(*) FROM sbx_records", &[])
            .await
            .map_err(|e| self.err(e))?
            .get(0);
        if held > 0 {
            return Err(StoreError::invalid(format!(
                "{} already holds {held} record(s); a copy goes into an empty database only",
                self.describe
            )));
        }
        let insert = tx
            .prepare_cached(
                "INSERT INTO sbx_records (id, kind, workspace, name, name_scope, owner, labels, \
                 created_at_ms, updated_at_ms, body, resource_version, refs, created_rev) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            )
            .await
            .map_err(|e| self.err(e))?;
        let insert_ref = tx
            .prepare_cached("INSERT INTO sbx_refs (target, referrer, rev) VALUES ($1, $2, $3)")
            .await
            .map_err(|e| self.err(e))?;
        for rec in &records {
            // The owner index's order: the position in the original's list of the owner, a
            // number below every revision a later create takes.
            let position = match rec.owner {
                Some(owner) => from.owned(owner).await?.iter().position(|id| *id == rec.id),
                None => None,
            };
            let created_rev = position.map_or(0, |p| p as i64 + 1);
            tx.execute(
                &insert,
                &[
                    &rec.id,
                    &i16::from(rec.kind.tag()),
                    &rec.workspace,
                    &rec.name,
                    &rec.name_scope(),
                    &rec.owner,
                    &labels_json(&rec.labels),
                    &to_i64(rec.created_at_ms, "created_at_ms")?,
                    &to_i64(rec.updated_at_ms, "updated_at_ms")?,
                    &rec.body,
                    &to_i64(rec.resource_version, "resource_version")?,
                    &rec.refs,
                    &created_rev,
                ],
            )
            .await
            .map_err(|e| self.err(e))?;
            for (position, referrer) in from.referrers(rec.id).await?.iter().enumerate() {
                tx.execute(&insert_ref, &[&rec.id, referrer, &(position as i64 + 1)])
                    .await
                    .map_err(|e| self.err(e))?;
            }
        }
        tx.execute(
            // The copy has no change log: it begins at the copied revision.
            "UPDATE sbx_meta SET value = $1 WHERE key IN ('revision', 'changes_from')",
            &[&to_i64(revision, "revision")?],
        )
        .await
        .map_err(|e| self.err(e))?;
        tx.commit().await.map_err(|e| self.err(e))?;
        drop(client);
        self.check_copy_of(from, &records, revision).await?;
        Ok(CopySummary {
            records: records.len(),
            revision,
        })
    }

    /// The copy against the original: `Corrupt` naming the first difference.
    async fn check_copy_of(
        &self,
        from: &dyn ObjectStore,
        records: &[Record],
        revision: u64,
    ) -> Result<(), StoreError> {
        let differs = |what: String| {
            StoreError::Corrupt(format!("the copy in {} differs: {what}", self.describe))
        };
        for rec in records {
            if self.get(rec.id).await?.as_ref() != Some(rec) {
                return Err(differs(format!(
                    "record {} ({} {:?})",
                    rec.id, rec.kind, rec.name
                )));
            }
            if self.owned(rec.id).await? != from.owned(rec.id).await? {
                return Err(differs(format!("what record {} owns", rec.id)));
            }
            if self.referrers(rec.id).await? != from.referrers(rec.id).await? {
                return Err(differs(format!("what refers to record {}", rec.id)));
            }
        }
        let copied = every_record(self).await?.len();
        if copied != records.len() {
            return Err(differs(format!(
                "{copied} records, the original {}",
                records.len()
            )));
        }
        let copy_revision = self.current_revision().await?;
        if copy_revision != revision {
            return Err(differs(format!(
                "revision {copy_revision}, the original {revision}"
            )));
        }
        let problems = self.integrity_problems().await?;
        if let Some(first) = problems.first() {
            return Err(differs(format!(
                "{} integrity problem(s), the first: {first}",
                problems.len()
            )));
        }
        Ok(())
    }
}
