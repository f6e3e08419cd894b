//! The store: where the control plane's state survives restarts.
//!
//! One small trait ([`Store`]) and one implementation, [`SqlStore`], on
//! either of two databases through `sqlx`'s `Any` driver: embedded SQLite
//! (the default: one file in the data directory, WAL journal,
//! `synchronous=FULL`, so a committed write survives a crash of the process
//! or the machine) or PostgreSQL (`--store postgres://...`, for a store that
//! outlives the server's machine). Both run the same statements, written in
//! the SQL they share (`$N` parameters, `ON CONFLICT` upserts); the few
//! words they spell differently are in [`Backend`], and the schema's
//! migrations for both are listed together in [`MIGRATIONS`]. Records are
//! JSON (see [`crate::records`]); a [`Batch`] is written in one transaction,
//! and the writer task ([`crate::writer`]) folds every batch queued
//! meanwhile into one commit.

use crate::records::{AllocationRecord, JobRecord, NodeRecord, PoolRecord, QueueRecord};
use muster_control::accounting::{CostBy, UsageMinute, UsageTotals};
use sqlx::AnyPool;
use sqlx::any::{AnyConnectOptions, AnyPoolOptions, AnyRow};
use sqlx::{AssertSqlSafe, ConnectOptions, Row};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store at {location}: {reason}; {hint}")]
    Open {
        location: String,
        reason: String,
        hint: &'static str,
    },
    #[error("the store failed: {0}")]
    Database(String),
    #[error("a record in the store is damaged: {0}")]
    Record(String),
    #[error("the store's writer has stopped (the server is shutting down)")]
    Closed,
    #[error(
        "this server is no longer the leader: it wrote in term {mine}, and the store is in term \
         {current} (another server took over); nothing was written"
    )]
    Deposed { mine: i64, current: i64 },
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
    /// Services (JSON records; `None`: removed).
    pub services: BTreeMap<String, Option<String>>,
    /// Join tokens by id (JSON records; `None`: removed).
    pub join_tokens: BTreeMap<String, Option<String>>,
    /// Secrets by (name, queue): sealed JSON records; `None`: removed.
    pub secrets: BTreeMap<(String, String), Option<String>>,
    /// Entries to append to the audit log.
    pub audit: Vec<AuditEntry>,
    /// (user, key) → (job, at ms) of submissions with an idempotency key.
    pub idempotency: BTreeMap<(String, String), (u64, u64)>,
    /// Deletes audit entries and idempotency keys older than these (ms).
    pub prune_audit_before: Option<u64>,
    pub prune_idempotency_before: Option<u64>,
    /// The next user's group number (see `crate::users::Users::group_of`).
    pub next_task_group: Option<u64>,
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
            && self.services.is_empty()
            && self.join_tokens.is_empty()
            && self.secrets.is_empty()
            && self.audit.is_empty()
            && self.idempotency.is_empty()
            && self.prune_audit_before.is_none()
            && self.prune_idempotency_before.is_none()
            && self.next_task_group.is_none()
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
        self.services.extend(later.services);
        self.join_tokens.extend(later.join_tokens);
        self.secrets.extend(later.secrets);
        self.audit.extend(later.audit);
        self.idempotency.extend(later.idempotency);
        self.prune_audit_before = self.prune_audit_before.max(later.prune_audit_before);
        self.prune_idempotency_before = self
            .prune_idempotency_before
            .max(later.prune_idempotency_before);
        self.next_task_group = self.next_task_group.max(later.next_task_group);
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
    pub services: Vec<crate::services::ServiceRecord>,
    pub join_tokens: Vec<crate::jointokens::JoinTokenRecord>,
    pub secrets: Vec<crate::secrets::SecretRecord>,
    /// Idempotency keys: (user, key, job, at ms).
    pub idempotency: Vec<(String, String, u64, u64)>,
    pub counters: Counters,
    /// The next user's group number, as stored (0: none stored).
    pub next_task_group: u64,
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

/// Which database a [`SqlStore`] is on, and the words the two spell
/// differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

impl Backend {
    /// The larger of two numbers (a scalar function).
    fn greatest(self) -> &'static str {
        match self {
            Backend::Sqlite => "max",
            Backend::Postgres => "greatest",
        }
    }

    /// The column that orders rows as they were inserted, where the table
    /// has no key of its own.
    fn insertion_order(self) -> &'static str {
        match self {
            Backend::Sqlite => "rowid",
            Backend::Postgres => "id",
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Backend::Sqlite => "SQLite",
            Backend::Postgres => "PostgreSQL",
        }
    }
}

/// Where the store is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreLocation {
    /// An SQLite database file (the default: `muster.db` in the data
    /// directory).
    Sqlite(PathBuf),
    /// A PostgreSQL database, by URL
    /// (`postgres://USER:PASSWORD@HOST:PORT/DATABASE?sslmode=...`).
    Postgres(String),
}

impl StoreLocation {
    /// The default store: `muster.db` in the data directory.
    pub fn in_data_dir(data_dir: &Path) -> Self {
        StoreLocation::Sqlite(data_dir.join("muster.db"))
    }

    /// Reads `--store`: `sqlite:PATH` or a `postgres://` (or
    /// `postgresql://`) URL.
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.starts_with("postgres://") || text.starts_with("postgresql://") {
            return Ok(StoreLocation::Postgres(text.to_string()));
        }
        if let Some(path) = text.strip_prefix("sqlite:") {
            let path = path.strip_prefix("//").unwrap_or(path);
            if path.is_empty() {
                return Err(
                    "`sqlite:` needs a file path, e.g. sqlite:/var/lib/muster/muster.db".into(),
                );
            }
            return Ok(StoreLocation::Sqlite(PathBuf::from(path)));
        }
        Err(format!(
            "`{text}` is not a store: give sqlite:PATH (a file) or a PostgreSQL URL \
             postgres://USER:PASSWORD@HOST:PORT/DATABASE"
        ))
    }

    pub fn backend(&self) -> Backend {
        match self {
            StoreLocation::Sqlite(_) => Backend::Sqlite,
            StoreLocation::Postgres(_) => Backend::Postgres,
        }
    }

    /// For messages and logs: a PostgreSQL URL without its password.
    pub fn describe(&self) -> String {
        match self {
            StoreLocation::Sqlite(path) => format!("sqlite:{}", path.display()),
            StoreLocation::Postgres(url) => redact_password(url),
        }
    }
}

/// `postgres://user:secret@host/db` → `postgres://user:***@host/db`.
fn redact_password(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end],
            &rest[..colon],
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

/// One step of the schema, for each database: applied in order to a store
/// whose version is below it, in one transaction with the new version.
pub struct Migration {
    pub version: i64,
    pub sqlite: &'static str,
    pub postgres: &'static str,
}

/// Every schema version, for both databases. SQLite keeps its version in
/// `PRAGMA user_version` (version 1 left it at 0; its statements are
/// idempotent), PostgreSQL in the table `schema_version`.
pub const MIGRATIONS: [Migration; 8] = [
    Migration {
        version: 1,
        sqlite: include_str!("../migrations/sqlite/0001_init.sql"),
        postgres: include_str!("../migrations/postgres/0001_init.sql"),
    },
    Migration {
        version: 2,
        sqlite: include_str!("../migrations/sqlite/0002_bounded.sql"),
        postgres: include_str!("../migrations/postgres/0002_bounded.sql"),
    },
    Migration {
        version: 3,
        sqlite: include_str!("../migrations/sqlite/0003_usage.sql"),
        postgres: include_str!("../migrations/postgres/0003_usage.sql"),
    },
    Migration {
        version: 4,
        sqlite: include_str!("../migrations/sqlite/0004_pools.sql"),
        postgres: include_str!("../migrations/postgres/0004_pools.sql"),
    },
    Migration {
        version: 5,
        sqlite: include_str!("../migrations/sqlite/0005_tenants.sql"),
        postgres: include_str!("../migrations/postgres/0005_tenants.sql"),
    },
    Migration {
        version: 6,
        sqlite: include_str!("../migrations/sqlite/0006_leader.sql"),
        postgres: include_str!("../migrations/postgres/0006_leader.sql"),
    },
    Migration {
        version: 7,
        sqlite: include_str!("../migrations/sqlite/0007_services.sql"),
        postgres: include_str!("../migrations/postgres/0007_services.sql"),
    },
    Migration {
        version: 8,
        sqlite: include_str!("../migrations/sqlite/0008_join_tokens.sql"),
        postgres: include_str!("../migrations/postgres/0008_join_tokens.sql"),
    },
];

/// Any PostgreSQL advisory-lock key will do, as long as every server uses
/// the same one: servers starting together migrate one at a time.
const MIGRATION_LOCK: i64 = 0x6d75_7374_6572; // "muster"

/// How the store is opened.
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreOptions {
    /// The most an SQLite database may grow to, in MiB (`None`: no limit).
    /// Past it, commits fail and the server turns read-only. (A PostgreSQL
    /// database is bounded by its server's own settings.)
    pub max_mib: Option<u64>,
    /// PostgreSQL ends a session of this store that sits idle inside a
    /// transaction this long (a leader's: see
    /// [`crate::ha::idle_transaction_limit`]); `None`: the database's
    /// setting.
    pub idle_transaction_limit: Option<Duration>,
}

/// The store, on SQLite or PostgreSQL.
#[derive(Debug, Clone)]
pub struct SqlStore {
    pool: AnyPool,
    backend: Backend,
    location: String,
    /// The leader's term every write carries (see [`SqlStore::fenced`]).
    term: Option<i64>,
}

impl SqlStore {
    /// The SQLite store in `data_dir` (`muster.db`).
    pub async fn open(data_dir: &Path) -> Result<SqlStore, StoreError> {
        SqlStore::open_at(
            &StoreLocation::in_data_dir(data_dir),
            StoreOptions::default(),
        )
        .await
    }

    /// Opens the store at `location`, creating its schema or bringing it up
    /// to date.
    pub async fn open_at(
        location: &StoreLocation,
        store_options: StoreOptions,
    ) -> Result<SqlStore, StoreError> {
        sqlx::any::install_default_drivers();
        let described = location.describe();
        let hint = match location {
            StoreLocation::Sqlite(_) => "check that the data directory is writable",
            StoreLocation::Postgres(_) => {
                "check that PostgreSQL is running there, that the database exists and that the \
                 user may create tables in it"
            }
        };
        let open_error = |reason: String| StoreError::Open {
            location: described.clone(),
            reason,
            hint,
        };
        let pool = match location {
            StoreLocation::Sqlite(path) => {
                create_private_file(path).map_err(|error| open_error(error.to_string()))?;
                let url = sqlx::sqlite::SqliteConnectOptions::new()
                    .filename(path)
                    .create_if_missing(true)
                    .to_url_lossy();
                let options = AnyConnectOptions::from_url(&url)
                    .map_err(|error| open_error(error.to_string()))?;
                // Pages are 4 KiB.
                let page_limit = store_options
                    .max_mib
                    .map(|mib| format!("PRAGMA max_page_count = {};", mib.max(1) * 256))
                    .unwrap_or_default();
                let pragmas = format!(
                    "PRAGMA busy_timeout = 10000; PRAGMA journal_mode = WAL; \
                     PRAGMA synchronous = FULL; PRAGMA foreign_keys = OFF; {page_limit}"
                );
                AnyPoolOptions::new()
                    .max_connections(2)
                    .after_connect(move |connection, _| {
                        let pragmas = pragmas.clone();
                        Box::pin(async move {
                            sqlx::raw_sql(AssertSqlSafe(pragmas))
                                .execute(connection)
                                .await
                                .map(|_| ())
                        })
                    })
                    .connect_with(options)
                    .await
                    .map_err(|error| open_error(error.to_string()))?
            }
            StoreLocation::Postgres(url) => {
                let options = url
                    .parse::<AnyConnectOptions>()
                    .map_err(|error| open_error(error.to_string()))?;
                let settings = store_options
                    .idle_transaction_limit
                    .map(|limit| {
                        format!(
                            "SET idle_in_transaction_session_timeout = {}",
                            limit.as_millis().max(1)
                        )
                    })
                    .unwrap_or_default();
                AnyPoolOptions::new()
                    .max_connections(8)
                    .acquire_timeout(Duration::from_secs(10))
                    .after_connect(move |connection, _| {
                        let settings = settings.clone();
                        Box::pin(async move {
                            if !settings.is_empty() {
                                sqlx::raw_sql(AssertSqlSafe(settings))
                                    .execute(connection)
                                    .await?;
                            }
                            Ok(())
                        })
                    })
                    .connect_with(options)
                    .await
                    .map_err(|error| open_error(error.to_string()))?
            }
        };
        let store = SqlStore {
            pool,
            backend: location.backend(),
            location: described.clone(),
            term: None,
        };
        store
            .migrate()
            .await
            .map_err(|error| open_error(error.to_string()))?;
        Ok(store)
    }

    /// Applies the migrations the store has not had.
    async fn migrate(&self) -> Result<(), sqlx::Error> {
        match self.backend {
            Backend::Sqlite => {
                // The write lock first (IMMEDIATE), then the version: two
                // stores opened at once migrate one after the other.
                let mut connection = self.pool.acquire().await?;
                sqlx::raw_sql("BEGIN IMMEDIATE")
                    .execute(&mut *connection)
                    .await?;
                let migrated = async {
                    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
                        .fetch_one(&mut *connection)
                        .await?;
                    for migration in MIGRATIONS.iter().filter(|m| m.version > version) {
                        sqlx::raw_sql(migration.sqlite)
                            .execute(&mut *connection)
                            .await?;
                        sqlx::raw_sql(AssertSqlSafe(format!(
                            "PRAGMA user_version = {}",
                            migration.version
                        )))
                        .execute(&mut *connection)
                        .await?;
                    }
                    Ok::<(), sqlx::Error>(())
                }
                .await;
                let end = if migrated.is_ok() {
                    "COMMIT"
                } else {
                    "ROLLBACK"
                };
                sqlx::raw_sql(end).execute(&mut *connection).await?;
                migrated?;
            }
            Backend::Postgres => {
                let mut tx = self.pool.begin().await?;
                // One server at a time; the others find the work done.
                sqlx::query("SELECT pg_advisory_xact_lock($1)")
                    .bind(MIGRATION_LOCK)
                    .execute(&mut *tx)
                    .await?;
                sqlx::raw_sql(
                    "CREATE TABLE IF NOT EXISTS schema_version (version BIGINT NOT NULL)",
                )
                .execute(&mut *tx)
                .await?;
                let version: Option<i64> =
                    sqlx::query_scalar("SELECT max(version) FROM schema_version")
                        .fetch_one(&mut *tx)
                        .await?;
                let version = version.unwrap_or(0);
                for migration in MIGRATIONS.iter().filter(|m| m.version > version) {
                    sqlx::raw_sql(migration.postgres).execute(&mut *tx).await?;
                }
                if let Some(latest) = MIGRATIONS.last()
                    && latest.version > version
                {
                    sqlx::query("DELETE FROM schema_version")
                        .execute(&mut *tx)
                        .await?;
                    sqlx::query("INSERT INTO schema_version (version) VALUES ($1)")
                        .bind(latest.version)
                        .execute(&mut *tx)
                        .await?;
                }
                tx.commit().await?;
            }
        }
        Ok(())
    }

    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// Where the store is, for messages (no password).
    pub fn location(&self) -> &str {
        &self.location
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

/// A value bound to a statement built at run time.
#[derive(Debug, Clone)]
enum Value {
    Int(i64),
    Text(String),
    Real(f64),
}

/// A statement with numbered parameters (`$1`, `$2`, ...: both databases
/// read them) and their values, built piece by piece.
#[derive(Debug, Default)]
struct Statement {
    sql: String,
    values: Vec<Value>,
}

impl Statement {
    fn new(sql: &str) -> Self {
        Statement {
            sql: sql.to_string(),
            values: Vec::new(),
        }
    }

    fn push(&mut self, sql: &str) -> &mut Self {
        self.sql.push_str(sql);
        self
    }

    /// Appends a parameter for `value`.
    fn bind(&mut self, value: Value) -> &mut Self {
        self.values.push(value);
        self.sql.push('$');
        self.sql.push_str(&self.values.len().to_string());
        self
    }

    /// Appends `(v1, v2, ...)`.
    fn bind_list(&mut self, values: impl IntoIterator<Item = Value>) -> &mut Self {
        self.sql.push('(');
        for (i, value) in values.into_iter().enumerate() {
            if i > 0 {
                self.sql.push_str(", ");
            }
            self.bind(value);
        }
        self.sql.push(')');
        self
    }

    fn query(&self) -> sqlx::query::Query<'_, sqlx::Any, <sqlx::Any as sqlx::Database>::Arguments> {
        let mut query = sqlx::query(AssertSqlSafe(self.sql.as_str()));
        for value in &self.values {
            query = match value {
                Value::Int(number) => query.bind(*number),
                Value::Text(text) => query.bind(text.as_str()),
                Value::Real(real) => query.bind(*real),
            };
        }
        query
    }

    async fn execute(&self, executor: &mut sqlx::AnyConnection) -> Result<(), StoreError> {
        self.query()
            .execute(executor)
            .await
            .map(|_| ())
            .map_err(database)
    }

    async fn fetch_all(&self, pool: &AnyPool) -> Result<Vec<AnyRow>, StoreError> {
        self.query().fetch_all(pool).await.map_err(database)
    }
}

/// Inserts `rows` (each the values of `columns`) into `table`, many rows a
/// statement, with `tail` (e.g. an `ON CONFLICT` clause) after each.
async fn insert_rows(
    executor: &mut sqlx::AnyConnection,
    table_and_columns: &str,
    tail: &str,
    rows: Vec<Vec<Value>>,
) -> Result<(), StoreError> {
    let mut rows = rows.into_iter().peekable();
    while rows.peek().is_some() {
        let mut statement = Statement::new("INSERT INTO ");
        statement.push(table_and_columns).push(" VALUES ");
        for (i, row) in rows.by_ref().take(ROWS_PER_STATEMENT).enumerate() {
            if i > 0 {
                statement.push(", ");
            }
            statement.bind_list(row);
        }
        statement.push(" ").push(tail);
        statement.execute(executor).await?;
    }
    Ok(())
}

fn text(value: &str) -> Value {
    Value::Text(value.to_string())
}

fn int(value: u64) -> Value {
    Value::Int(to_i64(value))
}

fn number(row: &AnyRow, name: &str) -> Result<u64, StoreError> {
    let value: i64 = row.try_get(name).map_err(database)?;
    Ok(u64::try_from(value).unwrap_or(0))
}

fn string(row: &AnyRow, name: &str) -> Result<String, StoreError> {
    row.try_get(name).map_err(database)
}

impl SqlStore {
    /// `(key, record)` of every row of `sql`'s result, parsed.
    async fn records<T: serde::de::DeserializeOwned>(
        &self,
        sql: &'static str,
        what: &str,
    ) -> Result<Vec<T>, StoreError> {
        let mut records = Vec::new();
        for row in sqlx::query(sql)
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let key: String = match row.try_get::<i64, _>(0) {
                Ok(id) => id.to_string(),
                Err(_) => string(&row, "key")?,
            };
            let record = string(&row, "record")?;
            records.push(parse(&format!("{what} {key}"), &record)?);
        }
        Ok(records)
    }
}

impl Store for SqlStore {
    async fn load(&self) -> Result<Loaded, StoreError> {
        let mut loaded = Loaded {
            jobs: self
                .records(
                    "SELECT id, record FROM jobs WHERE retired = 0 ORDER BY id",
                    "job",
                )
                .await?,
            allocations: self
                .records(
                    "SELECT a.id, a.record FROM allocations a JOIN jobs j ON j.id = a.job \
                     WHERE j.retired = 0 ORDER BY a.id",
                    "allocation",
                )
                .await?,
            queues: self
                .records(
                    "SELECT name AS key, record FROM queues ORDER BY name",
                    "queue",
                )
                .await?,
            pools: self
                .records(
                    "SELECT name AS key, record FROM pools ORDER BY name",
                    "pool",
                )
                .await?,
            users: self
                .records(
                    "SELECT name AS key, record FROM users ORDER BY name",
                    "user",
                )
                .await?,
            services: self
                .records(
                    "SELECT name AS key, record FROM services ORDER BY name",
                    "service",
                )
                .await?,
            join_tokens: self
                .records(
                    "SELECT name AS key, record FROM join_tokens ORDER BY name",
                    "join token",
                )
                .await?,
            secrets: self
                .records(
                    "SELECT name AS key, record FROM secrets ORDER BY name, queue",
                    "secret",
                )
                .await?,
            ..Loaded::default()
        };
        for row in sqlx::query("SELECT name, record, token FROM nodes ORDER BY name")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let name = string(&row, "name")?;
            let record = string(&row, "record")?;
            loaded.nodes.push((
                parse(&format!("node {name}"), &record)?,
                string(&row, "token")?,
            ));
        }
        let keys = Statement::new(&format!(
            "SELECT \"user\", key, job, at FROM idempotency ORDER BY {}",
            self.backend.insertion_order()
        ));
        for row in keys.fetch_all(&self.pool).await? {
            loaded.idempotency.push((
                string(&row, "user")?,
                string(&row, "key")?,
                number(&row, "job")?,
                number(&row, "at")?,
            ));
        }
        for row in sqlx::query("SELECT key, value FROM meta")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?
        {
            let value = number(&row, "value")?;
            match string(&row, "key")?.as_str() {
                "next_job" => loaded.counters.next_job = value,
                "next_allocation" => loaded.counters.next_allocation = value,
                "next_generation" => loaded.counters.next_generation = value,
                "next_epoch" => loaded.counters.next_epoch = value,
                "next_task_group" => loaded.next_task_group = value,
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
        if let Some(mine) = self.term {
            // Shared with other writes, exclusive of a takeover: a server
            // taking the lease waits for this commit, and this write sees
            // a takeover that committed first.
            let current: Option<i64> =
                sqlx::query_scalar("SELECT term FROM leader WHERE id = 1 FOR SHARE")
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(database)?;
            if current != Some(mine) {
                return Err(StoreError::Deposed {
                    mine,
                    current: current.unwrap_or(0),
                });
            }
        }
        insert_rows(
            &mut tx,
            "jobs (id, record, state, \"user\", queue)",
            "ON CONFLICT (id) DO UPDATE SET record = excluded.record, \
             state = excluded.state, \"user\" = excluded.\"user\", queue = excluded.queue",
            batch
                .jobs
                .iter()
                .map(|(id, row)| {
                    vec![
                        int(*id),
                        text(&row.record),
                        text(&row.state),
                        text(&row.user),
                        text(&row.queue),
                    ]
                })
                .collect(),
        )
        .await?;
        let retired: Vec<u64> = batch.retired.iter().copied().collect();
        for chunk in retired.chunks(ROWS_PER_STATEMENT) {
            let mut statement = Statement::new("UPDATE jobs SET retired = 1 WHERE id IN ");
            statement.bind_list(chunk.iter().map(|id| int(*id)));
            statement.execute(&mut tx).await?;
        }
        for name in &batch.removed_nodes {
            sqlx::query("DELETE FROM nodes WHERE name = $1")
                .bind(name.as_str())
                .execute(&mut *tx)
                .await
                .map_err(database)?;
        }
        insert_rows(
            &mut tx,
            "allocations (id, job, record)",
            "ON CONFLICT (id) DO UPDATE SET job = excluded.job, record = excluded.record",
            batch
                .allocations
                .iter()
                .map(|(id, (job, record))| vec![int(*id), int(*job), text(record)])
                .collect(),
        )
        .await?;
        insert_rows(
            &mut tx,
            "nodes (name, record, token)",
            "ON CONFLICT (name) DO UPDATE SET record = excluded.record, token = excluded.token",
            batch
                .nodes
                .iter()
                .map(|(name, (record, token))| vec![text(name), text(record), text(token)])
                .collect(),
        )
        .await?;
        insert_rows(
            &mut tx,
            "queues (name, record)",
            "ON CONFLICT (name) DO UPDATE SET record = excluded.record",
            batch
                .queues
                .iter()
                .map(|(name, record)| vec![text(name), text(record)])
                .collect(),
        )
        .await?;
        if let Some(counters) = batch.counters {
            insert_rows(
                &mut tx,
                "meta (key, value)",
                "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                [
                    ("next_job", counters.next_job),
                    ("next_allocation", counters.next_allocation),
                    ("next_generation", counters.next_generation),
                    ("next_epoch", counters.next_epoch),
                ]
                .into_iter()
                .map(|(key, value)| vec![text(key), int(value)])
                .collect(),
            )
            .await?;
        }
        let greatest = self.backend.greatest();
        if let Some(next) = batch.next_task_group {
            // Only ever up: a number once given is never given again.
            let upsert = format!(
                "ON CONFLICT (key) DO UPDATE SET value = {greatest}(meta.value, excluded.value)"
            );
            insert_rows(
                &mut tx,
                "meta (key, value)",
                &upsert,
                vec![vec![text("next_task_group"), int(next)]],
            )
            .await?;
        }
        // One statement a minute: a batch may hold a minute twice (both
        // add up), which one multi-row upsert may not.
        let add_usage = format!(
            "INSERT INTO usage_minutes (allocation, minute, job, rank, node, pool, gpu_model, \
             queue, \"user\", allocated_gpu_ms, measured_gpu_ms, used_gpu_ms, idle_gpu_ms, \
             samples, utilization_sum, peak_utilization, peak_memory_mib) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17) \
             ON CONFLICT (allocation, minute) DO UPDATE SET \
             allocated_gpu_ms = usage_minutes.allocated_gpu_ms + excluded.allocated_gpu_ms, \
             measured_gpu_ms = usage_minutes.measured_gpu_ms + excluded.measured_gpu_ms, \
             used_gpu_ms = usage_minutes.used_gpu_ms + excluded.used_gpu_ms, \
             idle_gpu_ms = usage_minutes.idle_gpu_ms + excluded.idle_gpu_ms, \
             samples = usage_minutes.samples + excluded.samples, \
             utilization_sum = usage_minutes.utilization_sum + excluded.utilization_sum, \
             peak_utilization = {greatest}(usage_minutes.peak_utilization, \
             excluded.peak_utilization), \
             peak_memory_mib = {greatest}(usage_minutes.peak_memory_mib, \
             excluded.peak_memory_mib)"
        );
        for minute in &batch.usage {
            sqlx::query(AssertSqlSafe(add_usage.as_str()))
                .bind(to_i64(minute.allocation))
                .bind(to_i64(minute.minute_ms))
                .bind(to_i64(minute.job))
                .bind(i64::from(minute.rank))
                .bind(minute.node.as_str())
                .bind(minute.pool.as_str())
                .bind(minute.gpu_model.as_str())
                .bind(minute.queue.as_str())
                .bind(minute.user.as_str())
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
                    "INSERT INTO prices (model, per_gpu_hour) VALUES ($1, $2) \
                     ON CONFLICT (model) DO UPDATE SET per_gpu_hour = excluded.per_gpu_hour",
                )
                .bind(model.as_str())
                .bind(*price),
                None => sqlx::query("DELETE FROM prices WHERE model = $1").bind(model.as_str()),
            }
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        for (table, records) in [
            ("pools", &batch.pools),
            ("users", &batch.users),
            ("services", &batch.services),
            ("join_tokens", &batch.join_tokens),
        ] {
            for (name, record) in records {
                let sql = match record {
                    Some(_) => format!(
                        "INSERT INTO {table} (name, record) VALUES ($1, $2) \
                         ON CONFLICT (name) DO UPDATE SET record = excluded.record"
                    ),
                    None => format!("DELETE FROM {table} WHERE name = $1"),
                };
                let mut query = sqlx::query(AssertSqlSafe(sql)).bind(name.as_str());
                if let Some(record) = record {
                    query = query.bind(record.as_str());
                }
                query.execute(&mut *tx).await.map_err(database)?;
            }
        }
        for ((name, queue), record) in &batch.secrets {
            match record {
                Some(record) => sqlx::query(
                    "INSERT INTO secrets (name, queue, record) VALUES ($1, $2, $3) \
                     ON CONFLICT (name, queue) DO UPDATE SET record = excluded.record",
                )
                .bind(name.as_str())
                .bind(queue.as_str())
                .bind(record.as_str()),
                None => sqlx::query("DELETE FROM secrets WHERE name = $1 AND queue = $2")
                    .bind(name.as_str())
                    .bind(queue.as_str()),
            }
            .execute(&mut *tx)
            .await
            .map_err(database)?;
        }
        insert_rows(
            &mut tx,
            "audit (at, who, action, object, origin, status, allowed)",
            "",
            batch
                .audit
                .iter()
                .map(|entry| {
                    vec![
                        int(entry.at_ms),
                        text(&entry.who),
                        text(&entry.action),
                        text(&entry.object),
                        text(&entry.origin),
                        Value::Int(i64::from(entry.status)),
                        Value::Int(i64::from(entry.allowed)),
                    ]
                })
                .collect(),
        )
        .await?;
        insert_rows(
            &mut tx,
            "idempotency (\"user\", key, job, at)",
            "",
            batch
                .idempotency
                .iter()
                .map(|((user, key), (job, at))| vec![text(user), text(key), int(*job), int(*at)])
                .collect(),
        )
        .await?;
        for (table, column, before) in [
            ("audit", "at", batch.prune_audit_before),
            ("idempotency", "at", batch.prune_idempotency_before),
            ("usage_minutes", "minute", batch.prune_usage_before),
        ] {
            if let Some(before) = before {
                sqlx::query(AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE {column} < $1"
                )))
                .bind(to_i64(before))
                .execute(&mut *tx)
                .await
                .map_err(database)?;
            }
        }
        tx.commit().await.map_err(database)
    }
}

impl SqlStore {
    /// A job as stored (the caller asks for one that left the server's
    /// memory).
    pub async fn retired_job(&self, id: u64) -> Result<Option<StoredJob>, StoreError> {
        // Not necessarily marked retired yet: the caller found it missing
        // from memory, so this is its last record.
        let Some(row) = sqlx::query("SELECT record FROM jobs WHERE id = $1")
            .bind(to_i64(id))
            .fetch_optional(&self.pool)
            .await
            .map_err(database)?
        else {
            return Ok(None);
        };
        let record = string(&row, "record")?;
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
        let mut query = Statement::new("SELECT id, record FROM jobs WHERE retired = 1 AND id < ");
        query.bind(Value::Int(before.map_or(i64::MAX, to_i64)));
        query.push(" AND id > ");
        query.bind(Value::Int(after.map_or(-1, to_i64)));
        if let Some(states) = &filter.states {
            if states.is_empty() {
                return Ok(Vec::new());
            }
            query.push(" AND state IN ");
            query.bind_list(states.iter().map(|state| text(state)));
        }
        if let Some(user) = &filter.user {
            query.push(" AND \"user\" = ");
            query.bind(text(user));
        }
        if let Some(queue) = &filter.queue {
            query.push(" AND queue = ");
            query.bind(text(queue));
        }
        query.push(" ORDER BY id DESC LIMIT ");
        query.bind(Value::Int(i64::from(limit)));
        let rows = query.fetch_all(&self.pool).await?;
        let mut jobs = Vec::with_capacity(rows.len());
        for row in rows {
            let id = number(&row, "id")?;
            let record = string(&row, "record")?;
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
        for chunk in jobs.chunks(ROWS_PER_STATEMENT) {
            let mut query = Statement::new("SELECT id, job, record FROM allocations WHERE job IN ");
            query.bind_list(chunk.iter().map(|id| int(*id)));
            query.push(" ORDER BY id");
            for row in query.fetch_all(&self.pool).await? {
                let id = number(&row, "id")?;
                let record = string(&row, "record")?;
                found
                    .entry(number(&row, "job")?)
                    .or_default()
                    .push(parse(&format!("allocation {id}"), &record)?);
            }
        }
        Ok(found)
    }

    /// The price list: per GPU model, per GPU-hour.
    pub async fn prices(&self) -> Result<BTreeMap<String, f64>, StoreError> {
        let rows = sqlx::query("SELECT model, per_gpu_hour FROM prices")
            .fetch_all(&self.pool)
            .await
            .map_err(database)?;
        let mut prices = BTreeMap::new();
        for row in rows {
            prices.insert(
                string(&row, "model")?,
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
        // Sums are cast back to whole numbers: PostgreSQL widens a sum of
        // BIGINTs to NUMERIC.
        macro_rules! totals_by {
            ($column:literal) => {
                concat!(
                    "SELECT ",
                    $column,
                    " AS key, gpu_model, CAST(sum(allocated_gpu_ms) AS BIGINT) AS allocated, \
                     CAST(sum(measured_gpu_ms) AS BIGINT) AS measured, \
                     CAST(sum(used_gpu_ms) AS BIGINT) AS used, \
                     CAST(sum(idle_gpu_ms) AS BIGINT) AS idle FROM usage_minutes \
                     WHERE minute >= $1 GROUP BY 1, gpu_model"
                )
            };
        }
        let sql = match by {
            CostBy::Queue => totals_by!("queue"),
            CostBy::User => totals_by!("\"user\""),
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
            totals.push(UsageTotals {
                key: string(&row, "key")?,
                gpu_model: string(&row, "gpu_model")?,
                allocated_gpu_ms: number(&row, "allocated")?,
                measured_gpu_ms: number(&row, "measured")?,
                used_gpu_ms: number(&row, "used")?,
                idle_gpu_ms: number(&row, "idle")?,
            });
        }
        Ok(totals)
    }

    /// The whole cluster's GPU-milliseconds per minute from `since_ms` on:
    /// (minute, allocated, used), oldest first.
    pub async fn cluster_minutes(&self, since_ms: u64) -> Result<Vec<(u64, u64, u64)>, StoreError> {
        let rows = sqlx::query(
            "SELECT minute, CAST(sum(allocated_gpu_ms) AS BIGINT) AS allocated, \
             CAST(sum(used_gpu_ms) AS BIGINT) AS used \
             FROM usage_minutes WHERE minute >= $1 GROUP BY minute ORDER BY minute",
        )
        .bind(to_i64(since_ms))
        .fetch_all(&self.pool)
        .await
        .map_err(database)?;
        let mut minutes = Vec::with_capacity(rows.len());
        for row in rows {
            minutes.push((
                number(&row, "minute")?,
                number(&row, "allocated")?,
                number(&row, "used")?,
            ));
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
        let mut query = Statement::new(
            "SELECT at, who, action, object, origin, status, allowed FROM audit WHERE at >= ",
        );
        query.bind(int(since_ms));
        if let Some(who) = who {
            query.push(" AND who = ");
            query.bind(text(who));
        }
        query.push(" ORDER BY id DESC LIMIT ");
        query.bind(Value::Int(i64::from(limit)));
        let rows = query.fetch_all(&self.pool).await?;
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            entries.push(AuditEntry {
                at_ms: number(&row, "at")?,
                who: string(&row, "who")?,
                action: string(&row, "action")?,
                object: string(&row, "object")?,
                origin: string(&row, "origin")?,
                status: u16::try_from(number(&row, "status")?).unwrap_or(0),
                allowed: number(&row, "allowed")? != 0,
            });
        }
        Ok(entries)
    }

    /// A job's accounting minutes, oldest first (the latest `limit`).
    pub async fn job_usage(&self, job: u64, limit: u32) -> Result<Vec<UsageMinute>, StoreError> {
        let rows = sqlx::query(
            "SELECT * FROM (SELECT * FROM usage_minutes WHERE job = $1 \
             ORDER BY minute DESC, allocation DESC LIMIT $2) AS latest \
             ORDER BY minute, allocation",
        )
        .bind(to_i64(job))
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await
        .map_err(database)?;
        let mut minutes = Vec::with_capacity(rows.len());
        for row in rows {
            minutes.push(UsageMinute {
                minute_ms: number(&row, "minute")?,
                allocation: number(&row, "allocation")?,
                job: number(&row, "job")?,
                rank: u32::try_from(number(&row, "rank")?).unwrap_or(u32::MAX),
                node: string(&row, "node")?,
                pool: string(&row, "pool")?,
                gpu_model: string(&row, "gpu_model")?,
                queue: string(&row, "queue")?,
                user: string(&row, "user")?,
                allocated_gpu_ms: number(&row, "allocated_gpu_ms")?,
                measured_gpu_ms: number(&row, "measured_gpu_ms")?,
                used_gpu_ms: number(&row, "used_gpu_ms")?,
                idle_gpu_ms: number(&row, "idle_gpu_ms")?,
                samples: u32::try_from(number(&row, "samples")?).unwrap_or(u32::MAX),
                utilization_sum: number(&row, "utilization_sum")?,
                peak_utilization: u32::try_from(number(&row, "peak_utilization")?).unwrap_or(100),
                peak_memory_mib: number(&row, "peak_memory_mib")?,
            });
        }
        Ok(minutes)
    }
}

/// Rows in one multi-row statement (SQLite takes at most 32,766 bound
/// values a statement, PostgreSQL 65,535).
const ROWS_PER_STATEMENT: usize = 500;

fn to_i64(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
mod copy;
mod election;
pub use copy::CopyCounts;
pub use election::Leadership;

#[cfg(test)]
mod tests;
