//! The store: where the control plane's state survives restarts.
//!
//! One small trait ([`Store`]) with one implementation here: embedded SQLite
//! through `sqlx` (WAL journal, `synchronous=FULL`, so a committed write
//! survives a crash of the process or the machine). Records are JSON (see
//! [`crate::records`]); a [`Batch`] is written in one transaction, and the
//! writer task ([`crate::writer`]) folds every batch queued meanwhile into
//! one commit.

use crate::records::{AllocationRecord, JobRecord, NodeRecord, PoolRecord, QueueRecord};
use muster_control::accounting::{CostBy, UsageMinute, UsageTotals};
use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store at {path}: {reason}; check that the data directory is writable")]
    Open { path: PathBuf, reason: String },
    #[error("the store failed: {0}")]
    Database(String),
    #[error("a record in the store is damaged: {0}")]
    Record(String),
    #[error("the store's writer has stopped (the server is shutting down)")]
    Closed,
}

fn database(error: sqlx::Error) -> StoreError {
    StoreError::Database(error.to_string())
}

/// The counters that hand out ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub next_job: u64,
    pub next_allocation: u64,
    pub next_generation: u64,
    pub next_epoch: u64,
}

/// A job's row: its record and the columns jobs are found by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRow {
    pub record: String,
    pub state: String,
    pub user: String,
    pub queue: String,
}

/// Changes written together. Records are JSON text; a later record for the
/// same key replaces an earlier one.
#[derive(Debug, Clone, Default)]
pub struct Batch {
    pub jobs: BTreeMap<u64, JobRow>,
    /// allocation id → (job id, record)
    pub allocations: BTreeMap<u64, (u64, String)>,
    /// node name → (record, node token)
    pub nodes: BTreeMap<String, (String, String)>,
    /// Nodes to delete (with their credential).
    pub removed_nodes: BTreeSet<String>,
    /// Jobs that left the server's memory.
    pub retired: BTreeSet<u64>,
    pub queues: BTreeMap<String, String>,
    pub counters: Option<Counters>,
    /// Closed minutes of GPU accounting (added to a row already there).
    pub usage: Vec<UsageMinute>,
    /// Prices per GPU model and GPU-hour (`None`: remove the price).
    pub prices: BTreeMap<String, Option<f64>>,
    /// Deletes accounting minutes older than this (ms since the epoch).
    pub prune_usage_before: Option<u64>,
    /// Pool policies (JSON records; `None`: the pool's is removed).
    pub pools: BTreeMap<String, Option<String>>,
    /// Users (JSON records; `None`: removed).
    pub users: BTreeMap<String, Option<String>>,
    /// Secrets by (name, queue): sealed JSON records; `None`: removed.
    pub secrets: BTreeMap<(String, String), Option<String>>,
    /// Entries to append to the audit log.
    pub audit: Vec<AuditEntry>,
    /// (user, key) → (job, at ms) of submissions with an idempotency key.
    pub idempotency: BTreeMap<(String, String), (u64, u64)>,
    /// Deletes audit entries and idempotency keys older than these (ms).
    pub prune_audit_before: Option<u64>,
    pub prune_idempotency_before: Option<u64>,
}

/// One mutating request, as the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AuditEntry {
    pub at_ms: u64,
    /// The token's user (`admin`, `node:NAME`, `join`, `metrics`), or
    /// `(no token)` / `(unknown token)`.
    pub who: String,
    /// Method and route, e.g. `POST /v1/jobs/{id}/cancel`.
    pub action: String,
    /// The path asked for (with the object's id or name).
    pub object: String,
    /// The client's address.
    pub origin: String,
    pub status: u16,
    /// Whether authorization let it through (not 401 or 403).
    pub allowed: bool,
}

impl Batch {
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
            && self.allocations.is_empty()
            && self.nodes.is_empty()
            && self.removed_nodes.is_empty()
            && self.retired.is_empty()
            && self.queues.is_empty()
            && self.counters.is_none()
            && self.usage.is_empty()
            && self.prices.is_empty()
            && self.prune_usage_before.is_none()
            && self.pools.is_empty()
            && self.users.is_empty()
            && self.secrets.is_empty()
            && self.audit.is_empty()
            && self.idempotency.is_empty()
            && self.prune_audit_before.is_none()
            && self.prune_idempotency_before.is_none()
    }

    /// Folds a later batch into this one (later records win; a node
    /// written after its removal is back).
    pub fn merge(&mut self, later: Batch) {
        self.jobs.extend(later.jobs);
        self.allocations.extend(later.allocations);
        for name in later.removed_nodes {
            self.nodes.remove(&name);
            self.removed_nodes.insert(name);
        }
        for (name, node) in later.nodes {
            self.removed_nodes.remove(&name);
            self.nodes.insert(name, node);
        }
        self.retired.extend(later.retired);
        self.queues.extend(later.queues);
        if later.counters.is_some() {
            self.counters = later.counters;
        }
        self.usage.extend(later.usage);
        self.prices.extend(later.prices);
        self.prune_usage_before = self.prune_usage_before.max(later.prune_usage_before);
        self.pools.extend(later.pools);
        self.users.extend(later.users);
        self.secrets.extend(later.secrets);
        self.audit.extend(later.audit);
        self.idempotency.extend(later.idempotency);
        self.prune_audit_before = self.prune_audit_before.max(later.prune_audit_before);
        self.prune_idempotency_before = self
            .prune_idempotency_before
            .max(later.prune_idempotency_before);
    }
}

/// What the server keeps in memory, as read at start: every job not
/// retired, with its allocations.
#[derive(Debug, Clone, Default)]
pub struct Loaded {
    pub jobs: Vec<JobRecord>,
    pub allocations: Vec<AllocationRecord>,
    /// With each node's token.
    pub nodes: Vec<(NodeRecord, String)>,
    pub queues: Vec<QueueRecord>,
    pub pools: Vec<PoolRecord>,
    pub users: Vec<crate::users::UserRecord>,
    pub secrets: Vec<crate::secrets::SecretRecord>,
    /// Idempotency keys: (user, key, job, at ms).
    pub idempotency: Vec<(String, String, u64, u64)>,
    pub counters: Counters,
}

/// Which retired jobs to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JobFilter {
    /// Any of these states (`None`: any).
    pub states: Option<Vec<String>>,
    pub user: Option<String>,
    pub queue: Option<String>,
}

/// The operations the server needs of a store.
pub trait Store: Send + Sync + 'static {
    fn load(&self) -> impl Future<Output = Result<Loaded, StoreError>> + Send;
    /// Writes the batch in one transaction; returns once it is durable.
    fn write(&self, batch: &Batch) -> impl Future<Output = Result<(), StoreError>> + Send;
}

/// A retired job as stored: its record and its allocations' records.
pub type StoredJob = (JobRecord, Vec<AllocationRecord>);

/// The embedded SQLite store: one file, `muster.db`, in the data directory.
#[derive(Debug, Clone)]
pub struct SqliteStore {
    pool: SqlitePool,
}

const SCHEMA: &str = include_str!("../migrations/sqlite/0001_init.sql");
/// Schema version 2 (`PRAGMA user_version`).
const SCHEMA_2: &str = include_str!("../migrations/sqlite/0002_bounded.sql");
/// Schema version 3: GPU accounting and prices.
const SCHEMA_3: &str = include_str!("../migrations/sqlite/0003_usage.sql");
/// Schema version 4: pool policies.
const SCHEMA_4: &str = include_str!("../migrations/sqlite/0004_pools.sql");
/// Schema version 5: users, the audit log, idempotency keys.
const SCHEMA_5: &str = include_str!("../migrations/sqlite/0005_tenants.sql");

/// How the store is opened.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreOptions {
    /// The most the database may grow to, in MiB (`None`: no limit). Past
    /// it, commits fail and the server turns read-only.
    pub max_mib: Option<u64>,
}

impl SqliteStore {
    pub async fn open(data_dir: &Path) -> Result<SqliteStore, StoreError> {
        SqliteStore::open_with(data_dir, StoreOptions::default()).await
    }

    pub async fn open_with(
        data_dir: &Path,
        store_options: StoreOptions,
    ) -> Result<SqliteStore, StoreError> {
        let path = data_dir.join("muster.db");
        let open_error = |error: sqlx::Error| StoreError::Open {
            path: path.clone(),
            reason: error.to_string(),
        };
        create_private_file(&path).map_err(|error| StoreError::Open {
            path: path.clone(),
            reason: error.to_string(),
        })?;
        let options = SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(false);
        let options = match store_options.max_mib {
            // Pages are 4 KiB.
            Some(mib) => options.pragma("max_page_count", (mib.max(1) * 256).to_string()),
            None => options,
        };
        let pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(options)
            .await
            .map_err(open_error)?;
        sqlx::raw_sql(SCHEMA)
            .execute(&pool)
            .await
            .map_err(open_error)?;
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&pool)
            .await
            .map_err(open_error)?;
        if version < 2 {
            let mut tx = pool.begin().await.map_err(open_error)?;
            sqlx::raw_sql(SCHEMA_2)
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            sqlx::raw_sql("PRAGMA user_version = 2")
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            tx.commit().await.map_err(open_error)?;
        }
        if version < 3 {
            let mut tx = pool.begin().await.map_err(open_error)?;
            sqlx::raw_sql(SCHEMA_3)
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            sqlx::raw_sql("PRAGMA user_version = 3")
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            tx.commit().await.map_err(open_error)?;
        }
        if version < 4 {
            let mut tx = pool.begin().await.map_err(open_error)?;
            sqlx::raw_sql(SCHEMA_4)
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            sqlx::raw_sql("PRAGMA user_version = 4")
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            tx.commit().await.map_err(open_error)?;
        }
        if version < 5 {
            let mut tx = pool.begin().await.map_err(open_error)?;
            sqlx::raw_sql(SCHEMA_5)
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            sqlx::raw_sql("PRAGMA user_version = 5")
                .execute(&mut *tx)
                .await
                .map_err(open_error)?;
            tx.commit().await.map_err(open_error)?;
        }
        Ok(SqliteStore { pool })
    }

    pub async fn close(&self) {
        self.pool.close().await;
    }
}

/// Creates the database file for its owner only (node tokens are in it);
/// SQLite gives its journal files the same mode.
fn create_private_file(path: &Path) -> std::io::Result<()> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    match options.open(path) {
        Ok(_) => Ok(()),
        Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(error) => Err(error),
    }
}

fn parse<T: serde::de::DeserializeOwned>(what: &str, text: &str) -> Result<T, StoreError> {
    serde_json::from_str(text).map_err(|error| StoreError::Record(format!("{what}: {error}")))
}

impl Store for SqliteStore {
    async fn load(&self) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded::default();
        for row in sqlx::query("SELECT id, record FROM jobs WHERE retired = 0 ORDER BY id")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let id: i64 = row.try_get("id").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            loaded.jobs.push(parse(&format!("job {id}"), &record)?);
        }
        for row in sqlx::query(
            "SELECT a.id, a.record FROM allocations a JOIN jobs j ON j.id = a.job \
             WHERE j.retired = 0 ORDER BY a.id",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(database)?
        {
            let id: i64 = row.try_get("id").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            loaded
                .allocations
                .push(parse(&format!("allocation {id}"), &record)?);
        }
        for row in sqlx::query("SELECT name, record, token FROM nodes ORDER BY name")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let name: String = row.try_get("name").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            let token: String = row.try_get("token").map_err(database)?;
            loaded
                .nodes
                .push((parse(&format!("node {name}"), &record)?, token));
        }
        for row in sqlx::query("SELECT name, record FROM queues ORDER BY name")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let name: String = row.try_get("name").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            loaded
                .queues
                .push(parse(&format!("queue {name}"), &record)?);
        }
        for row in sqlx::query("SELECT name, record FROM pools ORDER BY name")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let name: String = row.try_get("name").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            loaded.pools.push(parse(&format!("pool {name}"), &record)?);
        }
        for row in sqlx::query("SELECT name, record FROM users ORDER BY name")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let name: String = row.try_get("name").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            loaded.users.push(parse(&format!("user {name}"), &record)?);
        }
        for row in sqlx::query("SELECT name, queue, record FROM secrets")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let name: String = row.try_get("name").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            loaded
                .secrets
                .push(parse(&format!("secret {name}"), &record)?);
        }
        for row in sqlx::query("SELECT user, key, job, at FROM idempotency ORDER BY rowid")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let job: i64 = row.try_get("job").map_err(database)?;
            let at: i64 = row.try_get("at").map_err(database)?;
            loaded.idempotency.push((
                row.try_get("user").map_err(database)?,
                row.try_get("key").map_err(database)?,
                u64::try_from(job).unwrap_or(0),
                u64::try_from(at).unwrap_or(0),
            ));
        }
        for row in sqlx::query("SELECT key, value FROM meta")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let key: String = row.try_get("key").map_err(database)?;
            let value: i64 = row.try_get("value").map_err(database)?;
            let value = u64::try_from(value).unwrap_or(0);
            match key.as_str() {
                "next_job" => loaded.counters.next_job = value,
                "next_allocation" => loaded.counters.next_allocation = value,
                "next_generation" => loaded.counters.next_generation = value,
                "next_epoch" => loaded.counters.next_epoch = value,
                _ => {}
            }
        }
        Ok(loaded)
    }

    async fn write(&self, batch: &Batch) -> Result<(), StoreError> {
        if batch.is_empty() {
            return Ok(());
        }
        let mut tx = self.pool.begin().await.map_err(database)?;
        for (id, row) in &batch.jobs {
            sqlx::query(
                "INSERT INTO jobs (id, record, state, user, queue) VALUES (?1, ?2, ?3, ?4, ?5) \
                 ON CONFLICT (id) DO UPDATE SET record = excluded.record, \
                 state = excluded.state, user = excluded.user, queue = excluded.queue",
            )
            .bind(to_i64(*id))
            .bind(&row.record)
            .bind(&row.state)
            .bind(&row.user)
            .bind(&row.queue)
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for id in &batch.retired {
            sqlx::query("UPDATE jobs SET retired = 1 WHERE id = ?1")
                .bind(to_i64(*id))
                .execute(&mut *tx)
                .await
                .map_err(database)?;
        }
        for name in &batch.removed_nodes {
            sqlx::query("DELETE FROM nodes WHERE name = ?1")
                .bind(name)
                .execute(&mut *tx)
                .await
                .map_err(database)?;
        }
        for (id, (job, record)) in &batch.allocations {
            sqlx::query(
                "INSERT INTO allocations (id, job, record) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (id) DO UPDATE SET job = excluded.job, record = excluded.record",
            )
            .bind(to_i64(*id))
            .bind(to_i64(*job))
            .bind(record)
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for (name, (record, token)) in &batch.nodes {
            sqlx::query(
                "INSERT INTO nodes (name, record, token) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (name) DO UPDATE SET record = excluded.record, token = excluded.token",
            )
            .bind(name)
            .bind(record)
            .bind(token)
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for (name, record) in &batch.queues {
            sqlx::query(
                "INSERT INTO queues (name, record) VALUES (?1, ?2) \
                 ON CONFLICT (name) DO UPDATE SET record = excluded.record",
            )
            .bind(name)
            .bind(record)
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        if let Some(counters) = batch.counters {
            for (key, value) in [
                ("next_job", counters.next_job),
                ("next_allocation", counters.next_allocation),
                ("next_generation", counters.next_generation),
                ("next_epoch", counters.next_epoch),
            ] {
                sqlx::query(
                    "INSERT INTO meta (key, value) VALUES (?1, ?2) \
                     ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                )
                .bind(key)
                .bind(to_i64(value))
                .execute(&mut *tx)
                .await
                .map_err(database)?;
            }
        }
        for minute in &batch.usage {
            sqlx::query(
                "INSERT INTO usage_minutes (allocation, minute, job, rank, node, pool, gpu_model, \
                 queue, user, allocated_gpu_ms, measured_gpu_ms, used_gpu_ms, idle_gpu_ms, \
                 samples, utilization_sum, peak_utilization, peak_memory_mib) VALUES \
                 (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17) \
                 ON CONFLICT (allocation, minute) DO UPDATE SET \
                 allocated_gpu_ms = allocated_gpu_ms + excluded.allocated_gpu_ms, \
                 measured_gpu_ms = measured_gpu_ms + excluded.measured_gpu_ms, \
                 used_gpu_ms = used_gpu_ms + excluded.used_gpu_ms, \
                 idle_gpu_ms = idle_gpu_ms + excluded.idle_gpu_ms, \
                 samples = samples + excluded.samples, \
                 utilization_sum = utilization_sum + excluded.utilization_sum, \
                 peak_utilization = max(peak_utilization, excluded.peak_utilization), \
                 peak_memory_mib = max(peak_memory_mib, excluded.peak_memory_mib)",
            )
            .bind(to_i64(minute.allocation))
            .bind(to_i64(minute.minute_ms))
            .bind(to_i64(minute.job))
            .bind(i64::from(minute.rank))
            .bind(&minute.node)
            .bind(&minute.pool)
            .bind(&minute.gpu_model)
            .bind(&minute.queue)
            .bind(&minute.user)
            .bind(to_i64(minute.allocated_gpu_ms))
            .bind(to_i64(minute.measured_gpu_ms))
            .bind(to_i64(minute.used_gpu_ms))
            .bind(to_i64(minute.idle_gpu_ms))
            .bind(i64::from(minute.samples))
            .bind(to_i64(minute.utilization_sum))
            .bind(i64::from(minute.peak_utilization))
            .bind(to_i64(minute.peak_memory_mib))
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for (model, price) in &batch.prices {
            match price {
                Some(price) => sqlx::query(
                    "INSERT INTO prices (model, per_gpu_hour) VALUES (?1, ?2) \
                     ON CONFLICT (model) DO UPDATE SET per_gpu_hour = excluded.per_gpu_hour",
                )
                .bind(model)
                .bind(price),
                None => sqlx::query("DELETE FROM prices WHERE model = ?1").bind(model),
            }
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for (name, record) in &batch.pools {
            match record {
                Some(record) => sqlx::query(
                    "INSERT INTO pools (name, record) VALUES (?1, ?2) \
                     ON CONFLICT (name) DO UPDATE SET record = excluded.record",
                )
                .bind(name)
                .bind(record),
                None => sqlx::query("DELETE FROM pools WHERE name = ?1").bind(name),
            }
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for (name, record) in &batch.users {
            match record {
                Some(record) => sqlx::query(
                    "INSERT INTO users (name, record) VALUES (?1, ?2) \
                     ON CONFLICT (name) DO UPDATE SET record = excluded.record",
                )
                .bind(name)
                .bind(record),
                None => sqlx::query("DELETE FROM users WHERE name = ?1").bind(name),
            }
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for ((name, queue), record) in &batch.secrets {
            match record {
                Some(record) => sqlx::query(
                    "INSERT INTO secrets (name, queue, record) VALUES (?1, ?2, ?3) \
                     ON CONFLICT (name, queue) DO UPDATE SET record = excluded.record",
                )
                .bind(name)
                .bind(queue)
                .bind(record),
                None => sqlx::query("DELETE FROM secrets WHERE name = ?1 AND queue = ?2")
                    .bind(name)
                    .bind(queue),
            }
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        // Many rows a statement: each statement costs a round trip to
        // SQLite's thread, more than the row itself.
        for chunk in batch.audit.chunks(ROWS_PER_STATEMENT) {
            let mut insert: sqlx::QueryBuilder<sqlx::Sqlite> = sqlx::QueryBuilder::new(
                "INSERT INTO audit (at, who, action, object, origin, status, allowed) ",
            );
            insert.push_values(chunk, |mut row, entry| {
                row.push_bind(to_i64(entry.at_ms))
                    .push_bind(&entry.who)
                    .push_bind(&entry.action)
                    .push_bind(&entry.object)
                    .push_bind(&entry.origin)
                    .push_bind(i64::from(entry.status))
                    .push_bind(entry.allowed);
            });
            insert.build().execute(&mut *tx).await.map_err(database)?;
        }
        let keys: Vec<_> = batch.idempotency.iter().collect();
        for chunk in keys.chunks(ROWS_PER_STATEMENT) {
            let mut insert: sqlx::QueryBuilder<sqlx::Sqlite> =
                sqlx::QueryBuilder::new("INSERT INTO idempotency (user, key, job, at) ");
            insert.push_values(chunk, |mut row, ((user, key), (job, at))| {
                row.push_bind(user)
                    .push_bind(key)
                    .push_bind(to_i64(*job))
                    .push_bind(to_i64(*at));
            });
            insert.build().execute(&mut *tx).await.map_err(database)?;
        }
        if let Some(before) = batch.prune_audit_before {
            sqlx::query("DELETE FROM audit WHERE at < ?1")
                .bind(to_i64(before))
                .execute(&mut *tx)
                .await
                .map_err(database)?;
        }
        if let Some(before) = batch.prune_idempotency_before {
            sqlx::query("DELETE FROM idempotency WHERE at < ?1")
                .bind(to_i64(before))
                .execute(&mut *tx)
                .await
                .map_err(database)?;
        }
        if let Some(before) = batch.prune_usage_before {
            sqlx::query("DELETE FROM usage_minutes WHERE minute < ?1")
                .bind(to_i64(before))
                .execute(&mut *tx)
                .await
                .map_err(database)?;
        }
        tx.commit().await.map_err(database)
    }
}

impl SqliteStore {
    /// A job as stored (the caller asks for one that left the server's
    /// memory).
    pub async fn retired_job(&self, id: u64) -> Result<Option<StoredJob>, StoreError> {
        // Not necessarily marked retired yet: the caller found it missing
        // from memory, so this is its last record.
        let Some(row) = sqlx::query("SELECT record FROM jobs WHERE id = ?1")
            .bind(to_i64(id))
            .fetch_optional(&self.pool)
            .await
            .map_err(database)?
        else {
            return Ok(None);
        };
        let record: String = row.try_get("record").map_err(database)?;
        let job: JobRecord = parse(&format!("job {id}"), &record)?;
        let allocations = self.allocations_of(&[id]).await?;
        Ok(Some((
            job,
            allocations.into_values().next().unwrap_or_default(),
        )))
    }

    /// Retired jobs matching `filter` with an id below `before` and above
    /// `after`, newest first, at most `limit`.
    pub async fn retired_jobs(
        &self,
        filter: &JobFilter,
        before: Option<u64>,
        after: Option<u64>,
        limit: u32,
    ) -> Result<Vec<StoredJob>, StoreError> {
        let mut query: sqlx::QueryBuilder<sqlx::Sqlite> =
            sqlx::QueryBuilder::new("SELECT id, record FROM jobs WHERE retired = 1 AND id < ");
        query.push_bind(before.map_or(i64::MAX, to_i64));
        query.push(" AND id > ");
        query.push_bind(after.map_or(-1, to_i64));
        if let Some(states) = &filter.states {
            query.push(" AND state IN (");
            let mut list = query.separated(", ");
            for state in states {
                list.push_bind(state.clone());
            }
            query.push(")");
        }
        if let Some(user) = &filter.user {
            query.push(" AND user = ");
            query.push_bind(user.clone());
        }
        if let Some(queue) = &filter.queue {
            query.push(" AND queue = ");
            query.push_bind(queue.clone());
        }
        query.push(" ORDER BY id DESC LIMIT ");
        query.push_bind(i64::from(limit));
        let rows = query
            .build()
            .fetch_all(&self.pool)
            .await
            .map_err(database)?;
        let mut jobs = Vec::with_capacity(rows.len());
        for row in rows {
            let id: i64 = row.try_get("id").map_err(database)?;
            let record: String = row.try_get("record").map_err(database)?;
            let job: JobRecord = parse(&format!("job {id}"), &record)?;
            jobs.push(job);
        }
        let ids: Vec<u64> = jobs.iter().map(|job| job.id).collect();
        let mut allocations = self.allocations_of(&ids).await?;
        Ok(jobs
            .into_iter()
            .map(|job| {
                let list = allocations.remove(&job.id).unwrap_or_default();
                (job, list)
            })
            .collect())
    }

    /// The allocations of `jobs`, by job, oldest first.
    async fn allocations_of(
        &self,
        jobs: &[u64],
    ) -> Result<BTreeMap<u64, Vec<AllocationRecord>>, StoreError> {
        let mut found: BTreeMap<u64, Vec<AllocationRecord>> = BTreeMap::new();
        for chunk in jobs.chunks(500) {
            let mut query: sqlx::QueryBuilder<sqlx::Sqlite> =
                sqlx::QueryBuilder::new("SELECT id, job, record FROM allocations WHERE job IN (");
            let mut list = query.separated(", ");
            for id in chunk {
                list.push_bind(to_i64(*id));
            }
            query.push(") ORDER BY id");
            for row in query
                .build()
                .fetch_all(&self.pool)
                .await
                .map_err(database)?
            {
                let id: i64 = row.try_get("id").map_err(database)?;
                let job: i64 = row.try_get("job").map_err(database)?;
                let record: String = row.try_get("record").map_err(database)?;
                found
                    .entry(u64::try_from(job).unwrap_or(0))
                    .or_default()
                    .push(parse(&format!("allocation {id}"), &record)?);
            }
        }
        Ok(found)
    }
}

impl SqliteStore {
    /// The price list: per GPU model, per GPU-hour.
    pub async fn prices(&self) -> Result<BTreeMap<String, f64>, StoreError> {
        let rows = sqlx::query("SELECT model, per_gpu_hour FROM prices")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?;
        let mut prices = BTreeMap::new();
        for row in rows {
            prices.insert(
                row.try_get("model").map_err(database)?,
                row.try_get("per_gpu_hour").map_err(database)?,
            );
        }
        Ok(prices)
    }

    /// Accounting minutes from `since_ms` on, summed per group of `by` and
    /// GPU model.
    pub async fn usage_totals(
        &self,
        by: CostBy,
        since_ms: u64,
    ) -> Result<Vec<UsageTotals>, StoreError> {
        macro_rules! totals_by {
            ($column:literal) => {
                concat!(
                    "SELECT ",
                    $column,
                    " AS key, gpu_model, sum(allocated_gpu_ms) AS allocated, \
                     sum(measured_gpu_ms) AS measured, sum(used_gpu_ms) AS used, \
                     sum(idle_gpu_ms) AS idle FROM usage_minutes WHERE minute >= ?1 \
                     GROUP BY key, gpu_model"
                )
            };
        }
        let sql = match by {
            CostBy::Queue => totals_by!("queue"),
            CostBy::User => totals_by!("user"),
            CostBy::Job => totals_by!("CAST(job AS TEXT)"),
            CostBy::Pool => totals_by!("pool"),
        };
        let rows = sqlx::query(sql)
            .bind(to_i64(since_ms))
            .fetch_all(&self.pool)
            .await
            .map_err(database)?;
        let mut totals = Vec::with_capacity(rows.len());
        for row in rows {
            let number = |name: &str| -> Result<u64, StoreError> {
                let value: i64 = row.try_get(name).map_err(database)?;
                Ok(u64::try_from(value).unwrap_or(0))
            };
            totals.push(UsageTotals {
                key: row.try_get("key").map_err(database)?,
                gpu_model: row.try_get("gpu_model").map_err(database)?,
                allocated_gpu_ms: number("allocated")?,
                measured_gpu_ms: number("measured")?,
                used_gpu_ms: number("used")?,
                idle_gpu_ms: number("idle")?,
            });
        }
        Ok(totals)
    }

    /// The whole cluster's GPU-milliseconds per minute from `since_ms` on:
    /// (minute, allocated, used), oldest first.
    pub async fn cluster_minutes(&self, since_ms: u64) -> Result<Vec<(u64, u64, u64)>, StoreError> {
        let rows = sqlx::query(
            "SELECT minute, sum(allocated_gpu_ms) AS allocated, sum(used_gpu_ms) AS used \
             FROM usage_minutes WHERE minute >= ?1 GROUP BY minute ORDER BY minute",
        )
        .bind(to_i64(since_ms))
        .fetch_all(&self.pool)
        .await
        .map_err(database)?;
        let mut minutes = Vec::with_capacity(rows.len());
        for row in rows {
            let number = |name: &str| -> Result<u64, StoreError> {
                let value: i64 = row.try_get(name).map_err(database)?;
                Ok(u64::try_from(value).unwrap_or(0))
            };
            minutes.push((number("minute")?, number("allocated")?, number("used")?));
        }
        Ok(minutes)
    }

    /// Audit entries from `since_ms` on (of `who`, if given), newest first,
    /// at most `limit`.
    pub async fn audit(
        &self,
        since_ms: u64,
        who: Option<&str>,
        limit: u32,
    ) -> Result<Vec<AuditEntry>, StoreError> {
        let mut query: sqlx::QueryBuilder<sqlx::Sqlite> = sqlx::QueryBuilder::new(
            "SELECT at, who, action, object, origin, status, allowed FROM audit WHERE at >= ",
        );
        query.push_bind(to_i64(since_ms));
        if let Some(who) = who {
            query.push(" AND who = ");
            query.push_bind(who.to_string());
        }
        query.push(" ORDER BY id DESC LIMIT ");
        query.push_bind(i64::from(limit));
        let rows = query
            .build()
            .fetch_all(&self.pool)
            .await
            .map_err(database)?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            let at: i64 = row.try_get("at").map_err(database)?;
            let status: i64 = row.try_get("status").map_err(database)?;
            entries.push(AuditEntry {
                at_ms: u64::try_from(at).unwrap_or(0),
                who: row.try_get("who").map_err(database)?,
                action: row.try_get("action").map_err(database)?,
                object: row.try_get("object").map_err(database)?,
                origin: row.try_get("origin").map_err(database)?,
                status: u16::try_from(status).unwrap_or(0),
                allowed: row.try_get("allowed").map_err(database)?,
            });
        }
        Ok(entries)
    }

    /// A job's accounting minutes, oldest first (the latest `limit`).
    pub async fn job_usage(&self, job: u64, limit: u32) -> Result<Vec<UsageMinute>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM (SELECT * FROM usage_minutes WHERE job = ?1 \
             ORDER BY minute DESC, allocation DESC LIMIT ?2) ORDER BY minute, allocation",
        )
        .bind(to_i64(job))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(database)?;
        let mut minutes = Vec::with_capacity(rows.len());
        for row in rows {
            let number = |name: &str| -> Result<u64, StoreError> {
                let value: i64 = row.try_get(name).map_err(database)?;
                Ok(u64::try_from(value).unwrap_or(0))
            };
            minutes.push(UsageMinute {
                minute_ms: number("minute")?,
                allocation: number("allocation")?,
                job: number("job")?,
                rank: u32::try_from(number("rank")?).unwrap_or(u32::MAX),
                node: row.try_get("node").map_err(database)?,
                pool: row.try_get("pool").map_err(database)?,
                gpu_model: row.try_get("gpu_model").map_err(database)?,
                queue: row.try_get("queue").map_err(database)?,
                user: row.try_get("user").map_err(database)?,
                allocated_gpu_ms: number("allocated_gpu_ms")?,
                measured_gpu_ms: number("measured_gpu_ms")?,
                used_gpu_ms: number("used_gpu_ms")?,
                idle_gpu_ms: number("idle_gpu_ms")?,
                samples: u32::try_from(number("samples")?).unwrap_or(u32::MAX),
                utilization_sum: number("utilization_sum")?,
                peak_utilization: u32::try_from(number("peak_utilization")?).unwrap_or(100),
                peak_memory_mib: number("peak_memory_mib")?,
            });
        }
        Ok(minutes)
    }
}

/// Rows in one multi-row INSERT (SQLite takes at most 32,766 bound values
/// a statement).
const ROWS_PER_STATEMENT: usize = 500;

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_written_batch_loads_back_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).await.unwrap();
        let mut batch = Batch::default();
        batch.queues.insert(
            "team-a".into(),
            serde_json::to_string(&QueueRecord {
                name: "team-a".into(),
                guaranteed_milli: 8000,
                borrow_limit_milli: None,
                weight: 2,
                idle_timeout_s: Some(1800),
                idle_after_s: Some(600),
                idle_below_pct: Some(10),
                budget_monthly_cents: Some(500_000),
                budget_hard: true,
                members_see_jobs: true,
            })
            .unwrap(),
        );
        batch.counters = Some(Counters {
            next_job: 5,
            next_allocation: 3,
            next_generation: 4,
            next_epoch: 6,
        });
        store.write(&batch).await.unwrap();
        store.close().await;
        let store = SqliteStore::open(dir.path()).await.unwrap();
        let loaded = store.load().await.unwrap();
        assert_eq!(loaded.queues.len(), 1);
        assert_eq!(loaded.queues[0].weight, 2);
        assert_eq!(loaded.counters.next_job, 5);
        assert_eq!(loaded.counters.next_generation, 4);
        assert_eq!(loaded.counters.next_epoch, 6);
        assert_eq!(loaded.queues[0].budget_monthly_cents, Some(500_000));
        assert!(loaded.queues[0].budget_hard);
    }

    /// A hand-computed month: team-a held 2 H100s for 90 minutes (one hour
    /// busy at 80%, half an hour idle), team-b one L4 for an hour without
    /// telemetry; H100s cost 2.50 an hour, L4s have no price.
    #[tokio::test]
    async fn usage_minutes_sum_to_the_hand_computed_cost() {
        let dir = tempfile::tempdir().unwrap();
        let store = SqliteStore::open(dir.path()).await.unwrap();
        let minute = muster_control::accounting::MINUTE_MS;
        let base = 1_000 * minute;
        let mut batch = Batch::default();
        for m in 0..90 {
            let idle = m >= 60;
            batch.usage.push(UsageMinute {
                minute_ms: base + m * minute,
                allocation: 1,
                job: 7,
                rank: 0,
                node: "gpu-1".into(),
                pool: "default".into(),
                gpu_model: "H100-80GB".into(),
                queue: "team-a".into(),
                user: "alice".into(),
                allocated_gpu_ms: 2 * minute,
                measured_gpu_ms: 2 * minute,
                used_gpu_ms: if idle { 0 } else { 2 * minute * 80 / 100 },
                idle_gpu_ms: if idle { 2 * minute } else { 0 },
                samples: 6,
                utilization_sum: if idle { 0 } else { 480 },
                peak_utilization: if idle { 0 } else { 80 },
                peak_memory_mib: 1_000,
            });
        }
        for m in 0..60 {
            batch.usage.push(UsageMinute {
                minute_ms: base + m * minute,
                allocation: 2,
                job: 8,
                node: "gpu-2".into(),
                pool: "inference".into(),
                gpu_model: "L4".into(),
                queue: "team-b".into(),
                user: "bob".into(),
                allocated_gpu_ms: minute,
                ..UsageMinute::default()
            });
        }
        // A minute written twice (a flush after a restart) adds up.
        let mut again = batch.usage[0].clone();
        again.allocated_gpu_ms = 0;
        again.measured_gpu_ms = 0;
        again.used_gpu_ms = 0;
        again.samples = 1;
        batch.usage.push(again);
        batch.prices.insert("H100-80GB".into(), Some(2.5));
        batch.prices.insert("A100".into(), Some(1.0));
        store.write(&batch).await.unwrap();
        let mut batch = Batch::default();
        batch.prices.insert("A100".into(), None);
        store.write(&batch).await.unwrap();
        let prices = store.prices().await.unwrap();
        assert_eq!(prices, BTreeMap::from([("H100-80GB".to_string(), 2.5)]));
        let totals = store.usage_totals(CostBy::Queue, base).await.unwrap();
        let report = muster_control::accounting::cost_report(&totals, &prices);
        assert_eq!(report.len(), 2);
        let a = &report[0];
        assert_eq!(a.key, "team-a");
        assert!((a.allocated_gpu_hours - 3.0).abs() < 1e-9, "{a:?}");
        assert!((a.used_gpu_hours - 1.6).abs() < 1e-9, "{a:?}");
        assert!((a.idle_gpu_hours - 1.0).abs() < 1e-9, "{a:?}");
        assert!((a.cost - 7.5).abs() < 1e-9, "{a:?}");
        assert!((a.waste - 2.5).abs() < 1e-9, "{a:?}");
        let b = &report[1];
        assert_eq!(b.key, "team-b");
        assert_eq!(b.cost, 0.0);
        assert!((b.unpriced_gpu_hours - 1.0).abs() < 1e-9);
        assert!((b.unmeasured_gpu_hours - 1.0).abs() < 1e-9);
        // Grouped by job and by pool; and a window that starts later.
        let by_job = store.usage_totals(CostBy::Job, base).await.unwrap();
        assert!(by_job.iter().any(|t| t.key == "7"));
        let by_pool = store.usage_totals(CostBy::Pool, base).await.unwrap();
        assert!(by_pool.iter().any(|t| t.key == "inference"));
        let late = store
            .usage_totals(CostBy::Queue, base + 60 * minute)
            .await
            .unwrap();
        assert_eq!(late.len(), 1, "team-b's minutes all lie before");
        assert_eq!(late[0].idle_gpu_ms, 60 * minute);
        // A job's minutes read back, the duplicate folded in.
        let minutes = store.job_usage(7, 10_000).await.unwrap();
        assert_eq!(minutes.len(), 90);
        assert_eq!(minutes[0].samples, 7);
        assert_eq!(
            store.job_usage(7, 5).await.unwrap()[0].minute_ms,
            base + 85 * minute
        );
        // The cluster per minute: both jobs' first minute.
        let cluster = store.cluster_minutes(base).await.unwrap();
        assert_eq!(cluster.len(), 90);
        assert_eq!(cluster[0], (base, 3 * minute, 2 * minute * 80 / 100));
        // Pruning drops what lies before the retention.
        let batch = Batch {
            prune_usage_before: Some(base + 30 * minute),
            ..Batch::default()
        };
        store.write(&batch).await.unwrap();
        assert_eq!(store.job_usage(7, 10_000).await.unwrap().len(), 60);
    }
}
