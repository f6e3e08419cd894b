//! The store: where the control plane's state survives restarts.
//!
//! One small trait ([`Store`]) with one implementation here: embedded SQLite
//! through `sqlx` (WAL journal, `synchronous=FULL`, so a committed write
//! survives a crash of the process or the machine). Records are JSON (see
//! [`crate::records`]); a [`Batch`] is written in one transaction, and the
//! writer task ([`crate::writer`]) folds every batch queued meanwhile into
//! one commit.

use crate::records::{AllocationRecord, JobRecord, NodeRecord, QueueRecord};
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
    }
}
