//! `PgStore`: the [`ObjectStore`] on PostgreSQL, for gateways that share one store.
//!
//! One row per record in `sbx_records`; the unique name index, the owner index and both list
//! orders are indexes of that table, the references a table of their own (`schema.rs`). Every
//! write is one transaction that first takes the global revision (`UPDATE sbx_meta … RETURNING`):
//! the revision row's lock orders all writes, so revisions are assigned in commit order across
//! every gateway on the database, a write's checks see every write before it, and no two writes
//! can deadlock. A write is acknowledged after PostgreSQL's commit (durable with the server's
//! default `synchronous_commit = on`).
//!
//! Code map: this file: connecting, reads and lists, the trait glue and errors; `writes.rs`:
//! create, compare-and-swap update and cascading delete; `schema.rs`: tables and migrations;
//! `fsck.rs`: the integrity check; `import.rs`: copying a whole store in (`sbxd store migrate`).
//!
//! The client is `tokio-postgres` with a `deadpool-postgres` pool: the async client the Rust
//! ecosystem builds on (sqlx and diesel-async sit on top of the same protocol code), with a
//! small pool that recycles broken connections after a server restart.

mod fsck;
mod import;
mod schema;
mod writes;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::{NoTls, Row};
use uuid::Uuid;

use crate::error::StoreError;
use crate::layout::{decode_cursor, encode_cursor};
use crate::record::{Kind, ListQuery, NewRecord, Page, Record, Scope};
use crate::schema::SchemaOutcome;
use crate::store::ObjectStore;

pub use import::CopySummary;
pub use schema::PG_SCHEMA_VERSION;
pub use writes::CHANGE_LOG_REVISIONS;

/// How long a call waits for a pooled connection, or for a new one to be made, before it
/// answers `Unavailable`: a store that is down is said so within seconds, not hung on.
const CONNECT_WAIT: Duration = Duration::from_secs(5);

/// The most connections one gateway holds to the database.
const POOL_SIZE: usize = 16;

/// The columns of a record, in the order [`record_from_row`] reads them.
pub(crate) const COLUMNS: &str = "id, kind, workspace, name, owner, labels, created_at_ms, \
                                  updated_at_ms, body, resource_version, refs";

/// How many rows a list reads per query while it fills a page through a selector.
const LIST_BATCH: i64 = 500;

/// The PostgreSQL-backed object store. Cheap to clone (a shared pool).
#[derive(Clone)]
pub struct PgStore {
    pool: Pool,
    describe: String,
    schema_outcome: SchemaOutcome,
    /// How many revisions the change log keeps ([`CHANGE_LOG_REVISIONS`] unless a test
    /// asks for fewer).
    change_log_keep: u64,
    /// Commits acknowledged and the time their `COMMIT` took, in microseconds.
    commits: Arc<(AtomicU64, AtomicU64)>,
}

impl std::fmt::Debug for PgStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgStore")
            .field("store", &self.describe)
            .finish_non_exhaustive()
    }
}

/// `host:port/dbname` of a connection config, for messages (never its password).
fn where_is(config: &tokio_postgres::Config) -> String {
    use tokio_postgres::config::Host;
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".into(),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    let db = config
        .get_dbname()
        .or(config.get_user())
        .unwrap_or("postgres");
    format!("{host}:{port}/{db}")
}

impl PgStore {
    /// Counts one acknowledged commit that took `took`.
    pub(crate) fn committed(&self, took: std::time::Duration) {
        self.commits.0.fetch_add(1, Ordering::Relaxed);
        self.commits
            .1
            .fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// This store with a change log of the last `revisions` revisions (at least 1) instead of
    /// [`CHANGE_LOG_REVISIONS`]: for tests of the log's trimming.
    pub fn with_change_log_revisions(mut self, revisions: u64) -> PgStore {
        self.change_log_keep = revisions.max(1);
        self
    }

    /// Connects to the database `config` names, then checks (and if needed creates or
    /// migrates) its schema. `Unavailable` when the server cannot be reached, `Schema` for a
    /// version this build cannot use.
    pub async fn connect(config: tokio_postgres::Config) -> Result<PgStore, StoreError> {
        Self::connect_with(config, None).await
    }

    /// [`PgStore::connect`], over TLS when `tls` is given: every connection then requires it
    /// (`sslmode=require`) and checks the server's certificate, and its name against the
    /// host connected to, with `tls`'s roots — a server without TLS, or with a certificate
    /// those roots did not sign, is refused.
    pub async fn connect_with(
        mut config: tokio_postgres::Config,
        tls: Option<rustls::ClientConfig>,
    ) -> Result<PgStore, StoreError> {
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(CONNECT_WAIT);
        }
        if config.get_application_name().is_none() {
            config.application_name("sbxd");
        }
        let describe = format!("PostgreSQL store at {}", where_is(&config));
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let manager = match tls {
            Some(tls) => {
                config.ssl_mode(tokio_postgres::config::SslMode::Require);
                Manager::from_config(
                    config,
                    tokio_postgres_rustls::MakeRustlsConnect::new(tls),
                    manager_config,
                )
            }
            None => Manager::from_config(config, NoTls, manager_config),
        };
        let pool = Pool::builder(manager)
            .max_size(POOL_SIZE)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(CONNECT_WAIT))
            .create_timeout(Some(CONNECT_WAIT))
            .recycle_timeout(Some(CONNECT_WAIT))
            .build()
            .map_err(|e| StoreError::Io(format!("{describe}: building the pool: {e}")))?;
        let mut store = PgStore {
            pool,
            describe,
            schema_outcome: SchemaOutcome::Current,
            change_log_keep: CHANGE_LOG_REVISIONS,
            commits: Arc::default(),
        };
        let mut client = store.client().await?;
        store.schema_outcome = schema::prepare(&mut client, &store.describe).await?;
        drop(client);
        Ok(store)
    }

    /// What `connect` did with the schema.
    pub fn schema_outcome(&self) -> &SchemaOutcome {
        &self.schema_outcome
    }

    /// A pooled connection, or `Unavailable` within [`CONNECT_WAIT`].
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| {
            let detail = match e {
                deadpool_postgres::PoolError::Backend(e) => pg_detail(&e),
                other => other.to_string(),
            };
            StoreError::Unavailable {
                store: self.describe.clone(),
                detail,
            }
        })
    }

    fn err(&self, e: tokio_postgres::Error) -> StoreError {
        pg_error(&self.describe, e)
    }

    async fn one(&self, sql: &str, params: &[&PgParam<'_>]) -> Result<Option<Record>, StoreError> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(sql).await.map_err(|e| self.err(e))?;
        match client
            .query_opt(&stmt, params)
            .await
            .map_err(|e| self.err(e))?
        {
            Some(row) => record_from_row(&row).map(Some),
            None => Ok(None),
        }
    }

    async fn ids(&self, sql: &str, id: Uuid) -> Result<Vec<Uuid>, StoreError> {
        let client = self.client().await?;
        let stmt = client.prepare_cached(sql).await.map_err(|e| self.err(e))?;
        let rows = client.query(&stmt, &[&id]).await.map_err(|e| self.err(e))?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    async fn list_page(&self, q: ListQuery) -> Result<Page, StoreError> {
        let (mut after_ms, mut after_id) = match &q.cursor {
            Some(cursor) => {
                let (ms, id) = decode_cursor(cursor, q.kind)?;
                (to_i64(ms, "cursor time")?, id)
            }
            None => (-1, Uuid::nil()),
        };
        let kind = i16::from(q.kind.tag());
        let (sql, ws) = match q.scope {
            Scope::All => (
                format!(
                    "SELECT {COLUMNS} FROM sbx_records WHERE kind = $1 \
                     AND (created_at_ms, id) > ($2, $3) ORDER BY created_at_ms, id LIMIT $4"
                ),
                None,
            ),
            Scope::Workspace(ws) if ws.is_nil() => {
                return Err(StoreError::invalid("list scope names the nil workspace id"));
            }
            Scope::Workspace(ws) => (
                format!(
                    "SELECT {COLUMNS} FROM sbx_records WHERE workspace = $5 AND kind = $1 \
                     AND (created_at_ms, id) > ($2, $3) ORDER BY created_at_ms, id LIMIT $4"
                ),
                Some(ws),
            ),
        };
        let limit = if q.limit == 0 { usize::MAX } else { q.limit };
        let client = self.client().await?;
        let stmt = client.prepare_cached(&sql).await.map_err(|e| self.err(e))?;
        let mut records = Vec::new();
        let mut more = false;
        'batches: loop {
            let mut params: Vec<&PgParam<'_>> = vec![&kind, &after_ms, &after_id, &LIST_BATCH];
            if let Some(ws) = &ws {
                params.push(ws);
            }
            let rows = client
                .query(&stmt, &params)
                .await
                .map_err(|e| self.err(e))?;
            for row in &rows {
                let rec = record_from_row(row)?;
                after_ms = to_i64(rec.created_at_ms, "record time")?;
                after_id = rec.id;
                if !q.selector.matches(&rec.labels) {
                    continue;
                }
                if records.len() == limit {
                    more = true;
                    break 'batches;
                }
                records.push(rec);
            }
            if (rows.len() as i64) < LIST_BATCH {
                break;
            }
        }
        let next_cursor = match records.last() {
            Some(last) if more => Some(encode_cursor(q.kind, last.created_at_ms, last.id)),
            _ => None,
        };
        Ok(Page {
            records,
            next_cursor,
        })
    }
}

pub(crate) type PgParam<'a> = dyn tokio_postgres::types::ToSql + Sync + 'a;

/// What a PostgreSQL error says, with the server's own message where there is one.
fn pg_detail(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} ({})", db.message(), db.code().code()),
        None => match std::error::Error::source(e) {
            Some(source) => format!("{e}: {source}"),
            None => e.to_string(),
        },
    }
}

/// A PostgreSQL error as a store error: `Unavailable` when the server cannot be reached or
/// is going away (no connection, a connection exception, a shutdown, too many connections),
/// `Io` for anything else the server refused.
pub(crate) fn pg_error(store: &str, e: tokio_postgres::Error) -> StoreError {
    let unavailable = match e.as_db_error() {
        None => true,
        Some(db) => {
            let code = db.code().code();
            // 08: connection exception; 57P0x: admin/crash shutdown, cannot connect now;
            // 53: insufficient resources (too many connections, disk full on the server).
            code.starts_with("08") || code.starts_with("57P") || code.starts_with("53")
        }
    };
    if unavailable {
        StoreError::Unavailable {
            store: store.to_string(),
            detail: pg_detail(&e),
        }
    } else {
        StoreError::Io(format!("{store}: {}", pg_detail(&e)))
    }
}

/// A `u64` of the record model as PostgreSQL's `bigint`.
pub(crate) fn to_i64(v: u64, what: &str) -> Result<i64, StoreError> {
    i64::try_from(v).map_err(|_| StoreError::invalid(format!("{what} {v} does not fit 63 bits")))
}

fn to_u64(v: i64, what: &str) -> Result<u64, StoreError> {
    u64::try_from(v).map_err(|_| StoreError::Corrupt(format!("{what} is negative: {v}")))
}

pub(crate) fn labels_json(labels: &BTreeMap<String, String>) -> serde_json::Value {
    serde_json::Value::Object(
        labels
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
    )
}

/// A row of [`COLUMNS`] as a record.
pub(crate) fn record_from_row(row: &Row) -> Result<Record, StoreError> {
    let id: Uuid = row.get(0);
    let tag: i16 = row.get(1);
    let kind = u8::try_from(tag)
        .ok()
        .and_then(Kind::from_tag)
        .ok_or_else(|| StoreError::Corrupt(format!("record {id} has unknown kind {tag}")))?;
    let labels = match row.get::<_, serde_json::Value>(5) {
        serde_json::Value::Object(map) => map
            .into_iter()
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => Ok((k, s)),
                other => Err(StoreError::Corrupt(format!(
                    "record {id} has label {k:?} = {other}, not a string"
                ))),
            })
            .collect::<Result<BTreeMap<_, _>, _>>()?,
        other => {
            return Err(StoreError::Corrupt(format!(
                "record {id} has labels {other}, not an object"
            )));
        }
    };
    Ok(Record {
        id,
        kind,
        workspace: row.get(2),
        name: row.get(3),
        owner: row.get(4),
        labels,
        created_at_ms: to_u64(row.get(6), "created_at_ms")?,
        updated_at_ms: to_u64(row.get(7), "updated_at_ms")?,
        body: row.get(8),
        resource_version: to_u64(row.get(9), "resource_version")?,
        refs: row.get(10),
    })
}

#[async_trait]
impl ObjectStore for PgStore {
    async fn create_referring(
        &self,
        rec: NewRecord,
        refs: Vec<Uuid>,
    ) -> Result<Record, StoreError> {
        writes::create(self, rec, refs).await
    }

    async fn update(&self, rec: Record) -> Result<Record, StoreError> {
        writes::update(self, rec).await
    }

    async fn delete(&self, id: Uuid, expected_version: u64) -> Result<Vec<Uuid>, StoreError> {
        writes::delete(self, id, expected_version).await
    }

    async fn get(&self, id: Uuid) -> Result<Option<Record>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM sbx_records WHERE id = $1");
        self.one(&sql, &[&id]).await
    }

    async fn get_by_name(
        &self,
        kind: Kind,
        scope: Option<Uuid>,
        name: &str,
    ) -> Result<Option<Record>, StoreError> {
        let kind = i16::from(kind.tag());
        match scope {
            Some(scope) => {
                let sql = format!(
                    "SELECT {COLUMNS} FROM sbx_records \
                     WHERE kind = $1 AND name_scope = $2 AND name = $3"
                );
                self.one(&sql, &[&kind, &scope, &name]).await
            }
            None => {
                let sql = format!(
                    "SELECT {COLUMNS} FROM sbx_records \
                     WHERE kind = $1 AND name_scope IS NULL AND name = $2"
                );
                self.one(&sql, &[&kind, &name]).await
            }
        }
    }

    async fn list(&self, q: ListQuery) -> Result<Page, StoreError> {
        self.list_page(q).await
    }

    async fn owned(&self, owner: Uuid) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT id FROM sbx_records WHERE owner = $1 ORDER BY created_rev",
            owner,
        )
        .await
    }

    async fn referrers(&self, id: Uuid) -> Result<Vec<Uuid>, StoreError> {
        self.ids(
            "SELECT referrer FROM sbx_refs WHERE target = $1 ORDER BY rev, referrer",
            id,
        )
        .await
    }

    async fn current_revision(&self) -> Result<u64, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one("SELECT value FROM sbx_meta WHERE key = 'revision'", &[])
            .await
            .map_err(|e| self.err(e))?;
        to_u64(row.get(0), "revision")
    }

    async fn integrity_problems(&self) -> Result<Vec<crate::IndexProblem>, StoreError> {
        fsck::check(self).await
    }

    fn commit_stats(&self) -> Option<crate::FlushStats> {
        let commits = self.commits.0.load(Ordering::Relaxed);
        Some(crate::FlushStats {
            writes: commits,
            flushes: commits,
            flush_micros: self.commits.1.load(Ordering::Relaxed),
            flush_bytes: 0,
        })
    }

    async fn change_log_start(&self) -> Result<Option<u64>, StoreError> {
        let client = self.client().await?;
        let row = client
            .query_one("SELECT value FROM sbx_meta WHERE key = 'changes_from'", &[])
            .await
            .map_err(|e| self.err(e))?;
        to_u64(row.get(0), "changes_from").map(Some)
    }

    async fn changes_after(
        &self,
        after: u64,
        limit: usize,
    ) -> Result<Vec<crate::Change>, StoreError> {
        use crate::{Change, ChangeOp};
        let mut client = self.client().await?;
        // One snapshot for the log's start and its rows: a trim between two reads would
        // otherwise leave a silent gap.
        let tx = client
            .build_transaction()
            .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
            .read_only(true)
            .start()
            .await
            .map_err(|e| self.err(e))?;
        let from = tx
            .query_one("SELECT value FROM sbx_meta WHERE key = 'changes_from'", &[])
            .await
            .map_err(|e| self.err(e))?;
        let from = to_u64(from.get(0), "changes_from")?;
        if after < from {
            return Err(StoreError::ChangesTooOld {
                requested: after,
                oldest: from,
            });
        }
        let limit = i64::try_from(limit.max(1)).unwrap_or(i64::MAX);
        let stmt = tx
            .prepare_cached(&format!(
                "SELECT {COLUMNS}, revision, op FROM sbx_changes WHERE revision > $1 \
                 ORDER BY revision, id LIMIT $2"
            ))
            .await
            .map_err(|e| self.err(e))?;
        let rows = tx
            .query(&stmt, &[&to_i64(after, "revision")?, &limit])
            .await
            .map_err(|e| self.err(e))?;
        let ncols = rows.first().map_or(0, |r| r.len());
        rows.iter()
            .map(|row| {
                let revision = to_u64(row.get(ncols - 2), "revision")?;
                let op = match row.get::<_, i16>(ncols - 1) {
                    0 => ChangeOp::Created,
                    1 => ChangeOp::Updated,
                    2 => ChangeOp::Deleted,
                    other => {
                        return Err(StoreError::Corrupt(format!(
                            "change at revision {revision} has op {other}"
                        )));
                    }
                };
                Ok(Change {
                    revision,
                    op,
                    record: record_from_row(row)?,
                })
            })
            .collect()
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}
