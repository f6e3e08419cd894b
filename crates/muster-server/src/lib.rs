//! muster's control-plane shell: the tokio process around the pure
//! [`muster_control::ControlPlane`].
//!
//! It owns:
//! - the `/v1` HTTP API (axum) and its OpenAPI document, with bearer-token
//!   authentication on by default (admin, join and per-node tokens);
//! - the store: embedded SQLite (WAL, `synchronous=FULL`) behind the small
//!   [`store::Store`] trait, written by one task with group commit, so a
//!   submission is acknowledged only once durable;
//! - the scheduling loop (the engine runs on a blocking thread) and the
//!   lease ticker;
//! - the wall clock and randomness, which it passes to the pure crates.
//!
//! It must not decide anything: which job runs where, what a heartbeat
//! means, when a lease ends are decided in `muster-control` and
//! `muster-sched`. This crate reads the clock, moves bytes, stores records
//! and wakes whoever waits.
//!
//! ```no_run
//! # async fn run() -> anyhow::Result<()> {
//! let config = muster_server::ServerConfig::new("/var/lib/muster".into());
//! let server = muster_server::Server::start(config).await?;
//! println!("listening on {}", server.addr());
//! tokio::signal::ctrl_c().await?;
//! server.shutdown().await;
//! # Ok(())
//! # }
//! ```

mod accounting;
mod api;
mod auth;
mod core;
mod dashboard;
mod dev;
mod error;
mod forward;
pub mod gateway;
pub mod ha;
mod history;
mod idempotency;
pub mod jointokens;
mod logstore;
mod loops;
pub mod metrics;
mod ratelimit;
mod records;
pub mod secrets;
mod services;
mod sessions;
pub mod store;
pub mod tls;
pub mod users;
mod views;
mod writer;

use crate::core::{Core, Settings, Shared, now};
use crate::store::{SqlStore, Store};
use anyhow::Context;
use muster_control::ControlConfig;
use muster_sched::{PlacementPolicy, SchedulingPolicy};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use api::{USER_HEADER, openapi_document};
pub use error::MAX_BODY_BYTES;

/// The server's settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Where to listen; port 0 picks a free one (see [`ServerHandle::addr`]).
    pub listen: SocketAddr,
    /// The store, the tokens and the logs live here.
    pub data_dir: PathBuf,
    /// A node whose last heartbeat is older than this is lost.
    pub lease_ms: u64,
    /// How often agents are told to send heartbeats.
    pub heartbeat_ms: u64,
    /// How often the scheduler runs when nothing wakes it.
    pub schedule_interval_ms: u64,
    pub placement: PlacementPolicy,
    /// The most bytes kept of one job's output, shared by its tasks: of each
    /// task's log the first half and the latest bytes, with a marker for
    /// what is left out (see [`DEFAULT_MAX_LOG_BYTES`]).
    pub max_log_bytes: u64,
    /// How long a finished job stays in memory; after that it is read from
    /// the store when asked for.
    pub retention_ms: u64,
    /// The most the store may grow to, in MiB (`None`: no limit); past
    /// it the server turns read-only.
    pub store_max_mib: Option<u64>,
    /// Where the store is (`None`: SQLite, `muster.db` in the data
    /// directory).
    pub store: Option<store::StoreLocation>,
    /// A store to copy into `store` before starting (which must then be
    /// empty): moving a cluster from SQLite to PostgreSQL.
    pub migrate_from: Option<store::StoreLocation>,
    /// The leader's term, when this server leads several on one PostgreSQL
    /// store (see [`ha`]): every write carries it, and fails once another
    /// server holds a later one.
    pub fence_term: Option<i64>,
    /// The leader's own lease (with [`ServerConfig::fence_term`]): no
    /// heartbeat is answered while it may have lapsed.
    pub leadership: Option<Arc<ha::LeaseClock>>,
    /// A running job whose GPUs all stay below 5% utilisation this long is
    /// shown idle (`ps`, `describe`, `/metrics`).
    pub idle_after_ms: u64,
    /// What a node whose software stack differs from its pool's gets.
    pub stack_policy: muster_control::StackPolicy,
    /// Least-attained-service levels within a priority class.
    pub service_levels: muster_sched::ServiceLevels,
    /// How long GPU accounting minutes (per task and minute, behind `muster
    /// cost`, budgets and per-job usage) are kept.
    pub usage_retention_ms: u64,
    /// Prices per GPU model and GPU-hour to set at start (a YAML map, e.g.
    /// `H100-80GB: 2.50`); `muster prices set` changes them later.
    pub prices_file: Option<PathBuf>,
    /// How long the audit log keeps an entry (400 days by default).
    pub audit_retention_ms: u64,
    /// Requests a token may make (agents' own endpoints aside): `None`, no
    /// limit.
    pub rate_limit: Option<ratelimit::RateLimit>,
    /// HTTPS (a generated cluster CA, or the operator's certificate) or
    /// plain HTTP. The library's default is plain HTTP; `muster server`'s
    /// is the generated CA.
    pub tls: tls::TlsMode,
    /// The first of the [`muster_control::MASTER_PORTS`] ports jobs get as
    /// `MUSTER_MASTER_PORT` (job N: this plus N modulo their number).
    pub master_port_base: u16,
    /// How long the first start's join token (`join.token`) admits new
    /// nodes (`None`: until revoked).
    pub join_token_ttl_ms: Option<u64>,
    /// New nodes wait for `muster nodes approve` before they take work.
    pub approve_nodes: bool,
    /// The most services an ordinary user may have.
    pub max_services_per_user: Option<u64>,
    /// The most dev environments an ordinary user may have at once.
    pub max_dev_per_user: Option<u64>,
    /// The most a registering node may claim.
    pub node_limits: NodeLimits,
    /// The most jobs (array elements one each) an ordinary user may have
    /// pending, unless `muster users set NAME --max-pending` says otherwise
    /// (`None`: no limit).
    pub max_pending_per_user: Option<u64>,
}

/// [`ServerConfig::max_pending_per_user`] unless the operator says
/// otherwise.
pub const DEFAULT_MAX_PENDING_PER_USER: u64 = 10_000;

pub use muster_control::{DEFAULT_NODE_LIMITS, NodeLimits};

/// [`ServerConfig::join_token_ttl_ms`] unless the operator says otherwise.
pub const DEFAULT_JOIN_TOKEN_TTL_MS: u64 = 24 * 3_600_000;

/// [`ServerConfig::max_services_per_user`] unless the operator says
/// otherwise.
pub const DEFAULT_MAX_SERVICES_PER_USER: u64 = 20;

/// [`ServerConfig::max_dev_per_user`] unless the operator says otherwise.
pub const DEFAULT_MAX_DEV_PER_USER: u64 = 4;

pub use ratelimit::RateLimit;

/// The default per-token limit: 1,000 requests a second, bursts of 5,000.
pub const DEFAULT_RATE_LIMIT: RateLimit = RateLimit {
    per_second: 1_000.0,
    burst: 5_000.0,
};

/// The default idle threshold: 30 minutes.
pub const DEFAULT_IDLE_AFTER_MS: u64 = 30 * 60 * 1000;

/// The default per-job log limit: 1 GiB.
pub const DEFAULT_MAX_LOG_BYTES: u64 = 1 << 30;
pub use logstore::MIN_LOG_BYTES;

impl ServerConfig {
    /// The node lease of a server on its own (`--lease`); servers sharing
    /// a PostgreSQL store take `muster_node::lease_through_failover_ms`.
    pub const DEFAULT_LEASE_MS: u64 = 10_000;

    /// How often agents are told to send heartbeats.
    pub const DEFAULT_HEARTBEAT_MS: u64 = 2_000;

    /// The defaults, listening on 127.0.0.1:7070.
    pub fn new(data_dir: PathBuf) -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 7070)),
            data_dir,
            lease_ms: Self::DEFAULT_LEASE_MS,
            heartbeat_ms: Self::DEFAULT_HEARTBEAT_MS,
            schedule_interval_ms: 200,
            placement: PlacementPolicy::default(),
            max_log_bytes: DEFAULT_MAX_LOG_BYTES,
            retention_ms: muster_control::DEFAULT_RETENTION_MS,
            store_max_mib: None,
            store: None,
            migrate_from: None,
            fence_term: None,
            leadership: None,
            idle_after_ms: DEFAULT_IDLE_AFTER_MS,
            stack_policy: muster_control::StackPolicy::Report,
            service_levels: muster_sched::ServiceLevels::default(),
            usage_retention_ms: accounting::DEFAULT_USAGE_RETENTION_MS,
            prices_file: None,
            audit_retention_ms: 400 * 86_400_000,
            rate_limit: Some(DEFAULT_RATE_LIMIT),
            tls: tls::TlsMode::Off,
            master_port_base: muster_control::DEFAULT_MASTER_PORT_BASE,
            join_token_ttl_ms: Some(DEFAULT_JOIN_TOKEN_TTL_MS),
            approve_nodes: false,
            max_services_per_user: Some(DEFAULT_MAX_SERVICES_PER_USER),
            max_dev_per_user: Some(DEFAULT_MAX_DEV_PER_USER),
            node_limits: DEFAULT_NODE_LIMITS,
            max_pending_per_user: Some(DEFAULT_MAX_PENDING_PER_USER),
        }
    }
}

/// Serves the API on `listener` (TCP, or connections whose TLS handshake
/// is done) until `stopped`. `tap_io` makes the peer's address each
/// connection's info whatever the listener, for the audit log.
async fn serve<L>(
    listener: L,
    router: axum::Router,
    stopped: impl Future<Output = ()> + Send + 'static,
) where
    L: axum::serve::Listener<Addr = SocketAddr>,
{
    use axum::serve::ListenerExt;
    let serve = axum::serve(
        listener.tap_io(|_| {}),
        router.into_make_service_with_connect_info::<SocketAddr>(),
    )
    .with_graceful_shutdown(stopped);
    if let Err(error) = serve.await {
        tracing::error!(%error, "the API server failed");
    }
}

/// Starts a server.
#[derive(Debug)]
pub struct Server;

/// A running server.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    admin_token: String,
    join_token: String,
    metrics_token: String,
    data_dir: PathBuf,
    /// The cluster CA, when serving the generated certificate.
    ca_pem: Option<String>,
    https: bool,
    /// Whether this start created the data directory's tokens (a new
    /// cluster).
    pub first_start: bool,
    shutdown: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    writer_task: JoinHandle<()>,
    store: SqlStore,
    /// Weak: the writer ends once the last strong handle is gone.
    shared: std::sync::Weak<Shared>,
    /// Held while the server runs (an exclusive lock on `server.lock`).
    _lock: std::fs::File,
}

fn create_private_dir(path: &std::path::Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        builder.mode(0o700);
    }
    builder.create(path)
}

impl Server {
    /// Opens (or creates) the data directory, loads the store, rebuilds the
    /// control plane, and starts the API, the scheduler and the lease
    /// ticker.
    pub async fn start(config: ServerConfig) -> anyhow::Result<ServerHandle> {
        muster_control::check_master_port_base(config.master_port_base)
            .map_err(|error| anyhow::anyhow!("{error} (--master-port-base)"))?;
        let data_dir = config.data_dir.clone();
        create_private_dir(&data_dir).with_context(|| {
            format!(
                "cannot create the data directory {}; choose a writable one",
                data_dir.display()
            )
        })?;
        create_private_dir(&data_dir.join("logs"))
            .with_context(|| format!("cannot create {}", data_dir.join("logs").display()))?;
        // One server per data directory: a second one would share the store.
        let lock_path = data_dir.join("server.lock");
        let lock = std::fs::File::create(&lock_path)
            .with_context(|| format!("cannot create {}", lock_path.display()))?;
        if lock.try_lock().is_err() {
            anyhow::bail!(
                "another muster server is using {}; stop it, or pass another --data-dir",
                data_dir.display()
            );
        }
        let (admin_token, first_start) = auth::load_or_create(&data_dir.join("admin.token"))?;
        let (join_token, _) = auth::load_or_create(&data_dir.join("join.token"))?;
        let (metrics_token, _) = auth::load_or_create(&data_dir.join("metrics.token"))?;
        let tls = tls::Tls::start(&config.tls, &data_dir)?.map(Arc::new);

        let location = config
            .store
            .clone()
            .unwrap_or_else(|| store::StoreLocation::in_data_dir(&data_dir));
        let store_options = store::StoreOptions {
            max_mib: config.store_max_mib,
            idle_transaction_limit: config
                .leadership
                .as_ref()
                .map(|clock| ha::idle_transaction_limit(clock.lease())),
        };
        let store = SqlStore::open_at(&location, store_options).await?;
        let store = match config.fence_term {
            Some(term) => store.fenced(term),
            None => store,
        };
        if let Some(source) = &config.migrate_from {
            if *source == location {
                anyhow::bail!(
                    "--migrate-from names the store itself ({}); name the old store",
                    location.describe()
                );
            }
            if let store::StoreLocation::Sqlite(path) = source
                && !path.exists()
            {
                anyhow::bail!(
                    "--migrate-from: {} does not exist; give the old server's muster.db",
                    path.display()
                );
            }
            let old = SqlStore::open_at(source, store::StoreOptions::default()).await?;
            let counts = store.copy_from(&old).await.with_context(|| {
                format!(
                    "cannot copy {} into {}",
                    source.describe(),
                    location.describe()
                )
            })?;
            old.close().await;
            tracing::info!(
                from = %source.describe(),
                to = %location.describe(),
                rows = ?counts,
                "store copied"
            );
        }
        tracing::info!(store = %store.location(), backend = store.backend().name(), "store open");
        if let Some(path) = &config.prices_file {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("cannot read the price list {}", path.display()))?;
            let prices = muster_api::prices::parse_price_list(&text).map_err(|error| {
                anyhow::anyhow!("the price list {} is not valid: {error}", path.display())
            })?;
            store
                .write(&store::Batch {
                    prices: prices.into_iter().map(|(m, p)| (m, Some(p))).collect(),
                    ..store::Batch::default()
                })
                .await?;
        }
        let prices = store.prices().await?;
        let mut loaded = store.load().await?;
        let stored_services = std::mem::take(&mut loaded.services);
        let secrets_key = secrets::load_key(&data_dir.join("secrets.key"))?;
        // The first start's join token is one of the join tokens: made a
        // record (with its expiry) the first time this store sees it.
        let mut join_tokens = jointokens::JoinTokens::load(std::mem::take(&mut loaded.join_tokens));
        if join_tokens.of_token(&join_token).is_none() {
            let (record, evicted) = join_tokens
                .create(
                    join_token.clone(),
                    now().0,
                    config.join_token_ttl_ms,
                    None,
                    None,
                    true,
                )
                .map_err(|why| anyhow::anyhow!(why))?;
            store
                .write(&store::Batch {
                    join_tokens: evicted
                        .map(|gone| (gone, None))
                        .into_iter()
                        .chain(std::iter::once((
                            record.id.clone(),
                            Some(serde_json::to_string(&record)?),
                        )))
                        .collect(),
                    ..store::Batch::default()
                })
                .await?;
        }
        let (users, numbered) =
            users::Users::load(std::mem::take(&mut loaded.users), loaded.next_task_group);
        if !numbered.is_empty() {
            // Users of a server before group numbers: numbered once, kept.
            let mut batch = store::Batch {
                next_task_group: Some(u64::from(users.next_group())),
                ..store::Batch::default()
            };
            for record in &numbered {
                batch
                    .users
                    .insert(record.name.clone(), Some(serde_json::to_string(record)?));
            }
            store.write(&batch).await?;
        }
        let tenants = users::Tenants {
            join_tokens,
            users,
            keys: idempotency::Keys::load(std::mem::take(&mut loaded.idempotency), now().0),
            secrets: secrets::Secrets::new(secrets_key, std::mem::take(&mut loaded.secrets)),
        };
        let control_config = ControlConfig {
            lease_ms: config.lease_ms,
            retention_ms: config.retention_ms,
            stack_policy: config.stack_policy,
            service_levels: config.service_levels.clone(),
            master_port_base: config.master_port_base,
            approve_nodes: config.approve_nodes,
        };
        let core = Core::restore(control_config, loaded, now())
            .with_context(|| format!("cannot load the state in {}", data_dir.display()))?;
        tracing::info!(
            jobs = core.control().job_count(),
            nodes = core.control().nodes().count(),
            "state loaded"
        );
        let instruments = metrics::Instruments::default();
        let (writer, writer_task) =
            writer::Writer::start_observed(store.clone(), instruments.commit_seconds.clone());
        let (shutdown, shutdown_receiver) = watch::channel(false);
        let shared = Arc::new(Shared::new(
            Settings {
                lease_ms: config.lease_ms,
                heartbeat_ms: config.heartbeat_ms,
                idle_after_ms: config.idle_after_ms,
                usage_retention_ms: config.usage_retention_ms,
                audit_retention_ms: config.audit_retention_ms,
                rate_limit: config.rate_limit,
                node_limits: config.node_limits,
                max_pending_per_user: config.max_pending_per_user,
                max_services_per_user: config.max_services_per_user,
                max_dev_per_user: config.max_dev_per_user,
                https: !matches!(config.tls, tls::TlsMode::Off),
                leadership: config.leadership.clone(),
            },
            core,
            writer,
            store.clone(),
            admin_token.clone(),
            metrics_token.clone(),
            instruments,
            accounting::Accounting::with_prices(prices),
            tenants,
            logstore::LogStore::new(data_dir.join("logs"), config.max_log_bytes),
            shutdown_receiver.clone(),
        ));

        services::load(&shared, stored_services);

        let listener = tokio::net::TcpListener::bind(config.listen)
            .await
            .with_context(|| {
                format!(
                    "cannot listen on {}; is another server running there?",
                    config.listen
                )
            })?;
        let addr = listener.local_addr()?;
        let router = api::router(shared.clone());
        let mut stop = shutdown_receiver.clone();
        let stopped = async move {
            let _ = stop.wait_for(|stop| *stop).await;
        };
        let mut tasks = Vec::new();
        let http = match &tls {
            None => tokio::spawn(serve(listener, router, stopped)),
            Some(tls) => {
                tasks.push(tokio::spawn(tls.clone().watch(shutdown_receiver.clone())));
                let listener = tls.listener(listener, shutdown_receiver.clone())?;
                tokio::spawn(serve(listener, router, stopped))
            }
        };
        let policy = SchedulingPolicy {
            placement: config.placement,
            ..SchedulingPolicy::default()
        };
        let scheduler = tokio::spawn(loops::scheduling_loop(
            shared.clone(),
            policy,
            Duration::from_millis(config.schedule_interval_ms),
            shutdown_receiver.clone(),
        ));
        tasks.push(tokio::spawn(services::run(
            shared.clone(),
            shutdown_receiver.clone(),
        )));
        let weak_shared = Arc::downgrade(&shared);
        let ticker = tokio::spawn(loops::lease_ticker(shared, shutdown_receiver));
        tracing::info!(%addr, data_dir = %data_dir.display(), "muster server started");
        Ok(ServerHandle {
            addr,
            admin_token,
            join_token,
            metrics_token,
            data_dir,
            first_start,
            shutdown,
            ca_pem: tls.as_ref().and_then(|tls| tls.ca_pem.clone()),
            https: tls.is_some(),
            tasks: tasks.into_iter().chain([http, scheduler, ticker]).collect(),
            writer_task,
            store,
            shared: weak_shared,
            _lock: lock,
        })
    }
}

impl ServerHandle {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Why the server turned read-only (a commit failed: a full disk, or
    /// another server took the lead), if it did.
    pub fn read_only_reason(&self) -> Option<String> {
        self.shared
            .upgrade()
            .and_then(|shared| shared.read_only_reason())
    }

    /// Where the store is (a PostgreSQL URL without its password).
    pub fn store_location(&self) -> &str {
        self.store.location()
    }

    /// The admin token (users and admins).
    pub fn admin_token(&self) -> &str {
        &self.admin_token
    }

    /// The token that reads `/metrics` (and nothing else).
    pub fn metrics_token(&self) -> &str {
        &self.metrics_token
    }

    /// `https://ADDR` or `http://ADDR`.
    pub fn url(&self) -> String {
        let scheme = if self.https { "https" } else { "http" };
        format!("{scheme}://{}", self.addr)
    }

    /// The generated cluster CA (PEM), when it is what is served.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// What a client trusts to reach this server: its generated CA.
    pub fn trust(&self) -> muster_api::tls::Trust {
        muster_api::tls::Trust {
            ca_pem: self.ca_pem.as_ref().map(|pem| pem.as_bytes().to_vec()),
            ca_sha256: None,
        }
    }

    /// The join token (agents registering).
    pub fn join_token(&self) -> &str {
        &self.join_token
    }

    pub fn data_dir(&self) -> &std::path::Path {
        &self.data_dir
    }

    /// Stops accepting requests, ends long polls, lets the loops finish,
    /// writes what is queued and closes the store.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for task in self.tasks {
            match tokio::time::timeout(Duration::from_secs(15), task).await {
                Ok(Ok(())) => {}
                Ok(Err(error)) => tracing::error!(%error, "a server task failed"),
                Err(_) => tracing::warn!("a server task did not stop within 15 s"),
            }
        }
        // The writer ends once every handle to it is gone and its queue is
        // written.
        if tokio::time::timeout(Duration::from_secs(15), self.writer_task)
            .await
            .is_err()
        {
            tracing::warn!("the store's writer did not finish within 15 s");
        }
        self.store.close().await;
        tracing::info!("muster server stopped");
    }
}
