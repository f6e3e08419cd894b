//! `muster server`, `muster agent` and `muster up` (both in one process).

use crate::commands::{DEFAULT_SERVER, config_path, default_data_dir};
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use muster_agent::{AgentConfig, GpuBackend, NvmlBackend, SimulatedBackend};
use muster_server::ha::host_name;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

mod agent;
pub use agent::{AgentArgs, agent};
use agent::{IsolationArgs, backend, isolation};

#[derive(Debug, Args)]
pub struct ServerArgs {
    /// Address to listen on (loopback by default: other machines reach the
    /// server once this says so, e.g. 0.0.0.0:7070).
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    #[command(flatten)]
    pub tls: TlsArgs,
    /// Where the store, tokens and logs live (default: the per-user data
    /// directory, or $MUSTER_DATA_DIR).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// A node that has not renewed its lease for this long is lost
    /// [default: 10s; with a PostgreSQL store long enough for nodes to keep
    /// their tasks through a pause of the leader, 21s with the default
    /// --leader-lease; a shorter one than that needs is refused].
    #[arg(long, value_parser = parse_duration_ms)]
    pub lease: Option<u64>,
    /// Placement policy: fgd, best-fit, packing, random or default.
    #[arg(long, default_value = "default")]
    pub placement: muster_sched::PlacementPolicy,
    /// The most bytes kept of each job's output (e.g. 1GiB, 64MiB, 4096),
    /// shared by its tasks (at least 4 KiB each): of each task's log, the
    /// first half and the latest bytes, with a line saying how many were
    /// left out between them.
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    pub max_log_bytes: u64,
    /// How long a finished job stays in the server's memory; older ones are
    /// read from the store when asked for (`muster ps --all`, describe).
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration_ms)]
    pub retention: u64,
    /// Where the cluster's state lives: a PostgreSQL database
    /// (`postgres://USER:PASSWORD@HOST:PORT/DATABASE`, `?sslmode=require`
    /// for TLS), or `sqlite:PATH`. Default: SQLite, muster.db in the data
    /// directory. Read from $MUSTER_STORE too, which keeps a password out
    /// of the process list.
    #[arg(long, env = "MUSTER_STORE", value_name = "URL", value_parser = parse_store, hide_env_values = true)]
    pub store: Option<muster_server::store::StoreLocation>,
    /// With a PostgreSQL store: the URL other servers forward requests to
    /// while this one leads (default: this host's name, or the address
    /// listened on, and the port). Every server on one PostgreSQL database
    /// takes part in electing one leader; see docs/ha.md.
    #[arg(long, value_name = "URL")]
    pub advertise: Option<String>,
    /// With a PostgreSQL store: how long the leader's lease lasts unless
    /// renewed (a quarter of it is the renewal and polling period). A
    /// leader that dies is replaced within about this long; keep it well
    /// under --lease, so that nodes keep their tasks through a failover.
    #[arg(long, value_name = "DURATION", default_value = "4s", value_parser = parse_duration_ms)]
    pub leader_lease: u64,
    /// Copies an existing store (e.g. `sqlite:/var/lib/muster/muster.db`)
    /// into --store before starting, in one transaction; --store must be
    /// empty. Drop the flag once the copy is made.
    #[arg(long, value_name = "STORE", value_parser = parse_store, requires = "store")]
    pub migrate_from: Option<muster_server::store::StoreLocation>,
    /// The most the store (muster.db) may grow to, e.g. 20GiB; past it the
    /// server turns read-only (writes answer 503, /healthz says why)
    /// instead of losing what it acknowledged. Default: no limit.
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub store_max_size: Option<u64>,
    /// A running job whose GPUs all stay below 5% utilisation this long is
    /// shown idle (`muster ps`, `describe`, `/metrics`).
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration_ms)]
    pub idle_after: u64,
    /// What a node whose software stack (driver, CUDA, VBIOS, kernel, ...)
    /// differs from its pool's most common one gets: `report` (shown in
    /// `muster fleet` and the metrics) or `majority` (also kept from new
    /// work, with the reason, until it registers with the pool's stack;
    /// pools of 3 nodes or more).
    #[arg(long, value_name = "POLICY", default_value = "report", value_parser = parse_stack_policy)]
    pub stack_policy: muster_control::StackPolicy,
    /// GPU-hours (all attempts) at which a job falls a level below the
    /// fresh jobs of its priority class, ascending and comma-separated, or
    /// `none`: short jobs go first without anyone saying how long a job
    /// runs (least attained service, as Tiresias). A level is worth 100
    /// minutes of waiting; classes always come first.
    #[arg(long, value_name = "LIST", default_value = "1,10,100", value_parser = parse_service_levels)]
    pub service_levels: muster_sched::ServiceLevels,
    /// How long GPU accounting (per task and minute: `muster cost`, budgets,
    /// per-job usage) is kept.
    #[arg(long, value_name = "DURATION", default_value = "35d", value_parser = parse_duration_ms)]
    pub usage_retention: u64,
    /// Prices per GPU model and GPU-hour to set at start, a YAML map such as
    /// `H100-80GB: 2.50` (`muster prices set` changes them later).
    #[arg(long, value_name = "FILE")]
    pub prices: Option<PathBuf>,
    /// How long the audit log (`muster audit`) keeps an entry.
    #[arg(long, value_name = "DURATION", default_value = "400d", value_parser = parse_duration_ms)]
    pub audit_retention: u64,
    /// Requests a token may make, `N/s:BURST` (agents' own endpoints
    /// aside; past it, 429 with Retry-After), or `off`.
    #[arg(long, value_name = "RATE", default_value = "1000/s:5000", value_parser = parse_rate_limit)]
    pub rate_limit: RateLimitArg,
    #[command(flatten)]
    pub ports: PortArgs,
    #[command(flatten)]
    pub admission: AdmissionArgs,
}

/// What a new node must be to join.
#[derive(Debug, Args)]
pub struct AdmissionArgs {
    /// How long the first start's join token (join.token) admits new
    /// nodes, or `never` (until revoked); `muster nodes token create`
    /// makes others.
    #[arg(long, value_name = "DURATION", default_value = "24h", value_parser = parse_token_ttl)]
    pub join_token_ttl: TokenTtl,
    /// The most GPUs a registering node may claim.
    #[arg(long, value_name = "N", default_value_t = muster_server::DEFAULT_NODE_LIMITS.gpus as u64,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub max_node_gpus: u64,
    /// The most CPUs a registering node may claim.
    #[arg(long, value_name = "N", default_value_t = muster_server::DEFAULT_NODE_LIMITS.cpu_milli / 1000)]
    pub max_node_cpus: u64,
    /// The most memory a registering node may claim, e.g. 16TiB.
    #[arg(long, value_name = "SIZE", default_value = "16TiB", value_parser = parse_bytes)]
    pub max_node_memory: u64,
    /// The most jobs (array elements one each) a user may have pending
    /// unless `muster users set NAME --max-pending` says otherwise, or
    /// `unlimited`; operators and admins have no default limit.
    #[arg(long, value_name = "N", value_parser = parse_count_limit,
          default_value_t = CountLimit(Some(muster_server::DEFAULT_MAX_PENDING_PER_USER)))]
    pub max_pending_per_user: CountLimit,
    /// The most services an ordinary user may have, or `unlimited`
    /// (operators and admins have no limit but the cluster's 1,000).
    #[arg(long, value_name = "N", value_parser = parse_count_limit,
          default_value_t = CountLimit(Some(muster_server::DEFAULT_MAX_SERVICES_PER_USER)))]
    pub max_services_per_user: CountLimit,
    /// The most dev environments (pending or running) an ordinary user may
    /// have at once, or `unlimited`.
    #[arg(long, value_name = "N", value_parser = parse_count_limit,
          default_value_t = CountLimit(Some(muster_server::DEFAULT_MAX_DEV_PER_USER)))]
    pub max_dev_per_user: CountLimit,
    /// New nodes join in `pending-approval`: shown, heartbeating, given no
    /// work (and so no secret) until `muster nodes approve NAME`.
    #[arg(long)]
    pub approve_nodes: bool,
}

/// `--max-pending-per-user` and the other per-user limits: a count, or
/// `None` for unlimited.
#[derive(Debug, Clone, Copy)]
pub struct CountLimit(pub Option<u64>);

impl std::fmt::Display for CountLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(count) => write!(f, "{count}"),
            None => f.write_str("unlimited"),
        }
    }
}

fn parse_count_limit(text: &str) -> Result<CountLimit, String> {
    match text.trim() {
        "unlimited" => Ok(CountLimit(None)),
        number => number
            .parse::<u64>()
            .map(|n| CountLimit(Some(n)))
            .map_err(|_| format!("{text:?} is neither a whole number nor `unlimited`")),
    }
}

impl AdmissionArgs {
    fn limits(&self) -> muster_server::NodeLimits {
        muster_server::NodeLimits {
            gpus: self.max_node_gpus as usize,
            cpu_milli: self.max_node_cpus.saturating_mul(1000),
            memory_mib: self.max_node_memory >> 20,
        }
    }
}

/// `--join-token-ttl`: milliseconds, or `None` for never.
#[derive(Debug, Clone, Copy)]
pub struct TokenTtl(pub Option<u64>);

fn parse_token_ttl(text: &str) -> Result<TokenTtl, String> {
    if text.trim() == "never" {
        return Ok(TokenTtl(None));
    }
    let seconds = crate::cli::parse_duration_s(text)?;
    if seconds == 0 {
        return Err("give a duration of at least 1s, or `never`".to_string());
    }
    Ok(TokenTtl(Some(seconds.saturating_mul(1000))))
}

/// The ports muster gives jobs on their nodes.
#[derive(Debug, Args)]
pub struct PortArgs {
    /// The first of the 20,000 ports jobs get as MUSTER_MASTER_PORT, job N
    /// this plus N modulo 20,000: a gang's rendezvous, a dev environment's
    /// session helper, a service replica's PORT. Pick a range the nodes'
    /// other programs (and their ephemeral ports) leave free.
    #[arg(long, value_name = "PORT", default_value_t = muster_control::DEFAULT_MASTER_PORT_BASE,
          value_parser = clap::value_parser!(u16)
              .range(i64::from(muster_control::MIN_MASTER_PORT_BASE)
                  ..=i64::from(muster_control::MAX_MASTER_PORT_BASE)))]
    pub master_port_base: u16,
}

/// `--rate-limit`: a limit, or none (`off`).
#[derive(Debug, Clone, Copy)]
pub struct RateLimitArg(pub Option<muster_server::RateLimit>);

fn parse_rate_limit(text: &str) -> Result<RateLimitArg, String> {
    muster_server::RateLimit::parse(text).map(RateLimitArg)
}

fn parse_store(text: &str) -> Result<muster_server::store::StoreLocation, String> {
    muster_server::store::StoreLocation::parse(text)
}

fn parse_service_levels(text: &str) -> Result<muster_sched::ServiceLevels, String> {
    if text.trim() == "none" {
        return Ok(muster_sched::ServiceLevels::none());
    }
    let mut thresholds_gpu_s = Vec::new();
    for part in text.split(',') {
        let hours: f64 = part.trim().parse().map_err(|_| {
            format!("{part:?} is not a number of GPU-hours; give e.g. 1,10,100 or none")
        })?;
        if !(hours > 0.0 && hours.is_finite()) {
            return Err(format!("{part:?}: GPU-hours must be above 0"));
        }
        let seconds = (hours * 3600.0).round() as u64;
        if thresholds_gpu_s.last().is_some_and(|&last| last >= seconds) {
            return Err(format!(
                "{text:?}: levels must be given in ascending order, e.g. 1,10,100"
            ));
        }
        thresholds_gpu_s.push(seconds);
    }
    if thresholds_gpu_s.len() > muster_sched::ServiceLevels::MAX_LEVELS {
        return Err(format!(
            "at most {} levels",
            muster_sched::ServiceLevels::MAX_LEVELS
        ));
    }
    Ok(muster_sched::ServiceLevels { thresholds_gpu_s })
}

fn parse_stack_policy(text: &str) -> Result<muster_control::StackPolicy, String> {
    match text {
        "report" => Ok(muster_control::StackPolicy::Report),
        "majority" => Ok(muster_control::StackPolicy::Majority),
        _ => Err(format!(
            "unknown stack policy {text:?}; use report or majority"
        )),
    }
}

/// How the API is served: HTTPS unless told otherwise.
#[derive(Debug, Args)]
pub struct TlsArgs {
    /// Serve plain HTTP instead of HTTPS: tokens and job environments then
    /// cross the network in the clear. For a TLS-terminating proxy in front
    /// of the server, or tests.
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_key", "tls_san"])]
    pub insecure_http: bool,
    /// The server's certificate chain (PEM) instead of the generated one;
    /// replaced files are served without a restart.
    #[arg(long, value_name = "PATH", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The key of --tls-cert (PEM).
    #[arg(long, value_name = "PATH", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Another name or address clients reach the server by, for the
    /// generated certificate (which holds localhost, this host's name and
    /// addresses already). Repeatable.
    #[arg(long, value_name = "NAME")]
    pub tls_san: Vec<String>,
}

impl TlsArgs {
    fn mode(&self, listen: SocketAddr) -> muster_server::tls::TlsMode {
        use muster_server::tls::TlsMode;
        if self.insecure_http {
            return TlsMode::Off;
        }
        if let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) {
            return TlsMode::Files {
                cert: cert.clone(),
                key: key.clone(),
            };
        }
        TlsMode::Generated {
            names: certificate_names(listen, &self.tls_san),
        }
    }
}

/// The names the generated certificate is for: localhost, the loopback
/// addresses, and, when listening beyond loopback, this host's name and
/// addresses (or the one address listened on), and --tls-san.
fn certificate_names(listen: SocketAddr, extra: &[String]) -> Vec<String> {
    let mut names: Vec<String> = vec!["localhost".into(), "127.0.0.1".into(), "::1".into()];
    let ip = listen.ip();
    if ip.is_unspecified() {
        names.push(host_name());
        if let Ok(addresses) = nix::ifaddrs::getifaddrs() {
            for interface in addresses {
                let address = interface.address.as_ref();
                let found = address
                    .and_then(|a| a.as_sockaddr_in().map(|v4| std::net::IpAddr::V4(v4.ip())))
                    .or_else(|| address.and_then(|a| a.as_sockaddr_in6().map(|v6| v6.ip().into())));
                if let Some(found) = found
                    && !found.is_loopback()
                    && !matches!(found, std::net::IpAddr::V6(v6) if v6.is_unicast_link_local())
                {
                    names.push(found.to_string());
                }
            }
        }
    } else if !ip.is_loopback() {
        names.push(host_name());
        names.push(ip.to_string());
    }
    names.extend(extra.iter().cloned());
    let mut seen = std::collections::BTreeSet::new();
    names.retain(|name| seen.insert(name.clone()));
    names
}

#[derive(Debug, Args)]
pub struct UpArgs {
    /// Address of the API.
    #[arg(long, default_value = "127.0.0.1:7070")]
    pub listen: SocketAddr,
    /// Where everything lives (default: the per-user data directory, or
    /// $MUSTER_DATA_DIR).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Simulated GPUs for the local agent (default: real GPUs through NVML
    /// when a driver is found, else 8xH100-80GB simulated).
    #[arg(long, value_name = "SPEC")]
    pub simulate_gpus: Option<String>,
    #[arg(long, default_value = "default")]
    pub placement: muster_sched::PlacementPolicy,
    /// The most bytes kept of each job's output (see `muster server --help`).
    #[arg(long, value_name = "SIZE", default_value = "1GiB", value_parser = parse_size)]
    pub max_log_bytes: u64,
    /// How long a finished job stays in the server's memory.
    #[arg(long, value_name = "DURATION", default_value = "1h", value_parser = parse_duration_ms)]
    pub retention: u64,
    /// A running job whose GPUs all stay below 5% this long is shown idle.
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration_ms)]
    pub idle_after: u64,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    #[command(flatten)]
    pub tls: TlsArgs,
    #[command(flatten)]
    pub ports: PortArgs,
    #[command(flatten)]
    pub admission: AdmissionArgs,
}

/// A size in bytes: a whole number with an optional binary unit (B, KiB,
/// MiB, GiB, TiB), at least the server's smallest log limit.
fn parse_size(text: &str) -> Result<u64, String> {
    let bytes = parse_bytes(text)?;
    if bytes < muster_server::MIN_LOG_BYTES {
        return Err(format!(
            "{text:?} is too small; give at least {} bytes",
            muster_server::MIN_LOG_BYTES
        ));
    }
    Ok(bytes)
}

/// A whole number of bytes with an optional binary unit.
fn parse_bytes(text: &str) -> Result<u64, String> {
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}; use B, KiB, MiB, GiB or TiB (e.g. 64MiB)"
            ));
        }
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .ok_or_else(|| format!("{text:?} is not a size; write e.g. 1GiB, 64MiB or 4096"))
}

/// A rate in bytes per second, written as a size (e.g. 8MiB).
fn parse_rate(text: &str) -> Result<u64, String> {
    let bytes = parse_bytes(text)?;
    if bytes == 0 {
        return Err(format!(
            "{text:?} would ship nothing; give at least 1 byte per second"
        ));
    }
    Ok(bytes)
}

fn parse_duration_ms(text: &str) -> Result<u64, String> {
    crate::cli::parse_duration_s(text).map(|s| s * 1000)
}

fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

#[allow(clippy::too_many_arguments)]
fn server_config(
    listen: SocketAddr,
    data_dir: PathBuf,
    lease_ms: u64,
    placement: muster_sched::PlacementPolicy,
    max_log_bytes: u64,
    retention_ms: u64,
    store_max_bytes: Option<u64>,
    idle_after_ms: u64,
    stack_policy: muster_control::StackPolicy,
) -> muster_server::ServerConfig {
    muster_server::ServerConfig {
        listen,
        lease_ms,
        placement,
        max_log_bytes,
        retention_ms,
        idle_after_ms,
        stack_policy,
        store_max_mib: store_max_bytes.map(|bytes| bytes.div_ceil(1 << 20)),
        ..muster_server::ServerConfig::new(data_dir)
    }
}

/// `--leader-lease`, at least half a second.
fn leader_lease(args: &ServerArgs) -> Duration {
    Duration::from_millis(args.leader_lease.max(500))
}

pub fn server(args: ServerArgs) -> Result<()> {
    init_logging();
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let highly_available_store = matches!(
        args.store,
        Some(muster_server::store::StoreLocation::Postgres(_))
    );
    let lease_ms = if highly_available_store {
        muster_node::lease_through_failover_ms(
            args.lease,
            u64::try_from(leader_lease(&args).as_millis()).unwrap_or(u64::MAX),
            muster_server::ServerConfig::DEFAULT_HEARTBEAT_MS,
            muster_server::ServerConfig::DEFAULT_LEASE_MS,
        )
        .map_err(anyhow::Error::msg)?
    } else {
        args.lease
            .unwrap_or(muster_server::ServerConfig::DEFAULT_LEASE_MS)
    };
    runtime()?.block_on(async {
        let config = muster_server::ServerConfig {
            usage_retention_ms: args.usage_retention,
            prices_file: args.prices.clone(),
            audit_retention_ms: args.audit_retention,
            rate_limit: args.rate_limit.0,
            tls: args.tls.mode(args.listen),
            service_levels: args.service_levels.clone(),
            store: args.store.clone(),
            migrate_from: args.migrate_from.clone(),
            master_port_base: args.ports.master_port_base,
            join_token_ttl_ms: args.admission.join_token_ttl.0,
            node_limits: args.admission.limits(),
            max_pending_per_user: args.admission.max_pending_per_user.0,
            approve_nodes: args.admission.approve_nodes,
            max_services_per_user: args.admission.max_services_per_user.0,
            max_dev_per_user: args.admission.max_dev_per_user.0,
            ..server_config(
                args.listen,
                data_dir.clone(),
                lease_ms,
                args.placement,
                args.max_log_bytes,
                args.retention,
                args.store_max_size,
                args.idle_after,
                args.stack_policy,
            )
        };
        if highly_available_store {
            return highly_available(&args, config).await;
        }
        let handle = muster_server::Server::start(config).await?;
        eprintln!("muster server listening on {}", handle.url());
        eprintln!("store: {}", handle.store_location());
        eprintln!(
            "admin token: {} (owner-only); join token for agents: {}",
            data_dir.join("admin.token").display(),
            data_dir.join("join.token").display()
        );
        let reach = if args.listen.ip().is_unspecified() {
            format!("https://{}:{}", host_name(), handle.addr().port())
        } else {
            handle.url()
        };
        match handle
            .ca_pem()
            .map(|pem| muster_api::tls::fingerprint_of_pem(pem.as_bytes()))
        {
            Some(Ok(fingerprint)) => {
                eprintln!(
                    "cluster CA: {fingerprint} ({})",
                    data_dir.join("tls/ca.pem").display()
                );
                eprintln!(
                    "agents join with: muster agent --server {reach} --join-token-file join.token \
                     --ca-sha256 {fingerprint}"
                );
                eprintln!(
                    "users log in with: muster login --server {reach} --ca-sha256 {fingerprint}"
                );
            }
            Some(Err(error)) => eprintln!("cannot read the cluster CA: {error}"),
            None if !handle.url().starts_with("https") => eprintln!(
                "warning: plain HTTP (--insecure-http): tokens and job environments cross the \
                 network in the clear"
            ),
            None => {}
        }
        if handle.first_start {
            eprintln!(
                "first start: new tokens written; `muster` on this machine reads the admin \
                 token from {} (or pass it with --token-file or MUSTER_TOKEN_FILE)",
                data_dir.join("admin.token").display()
            );
        }
        shutdown_signal().await;
        handle.shutdown().await;
        Ok(())
    })
}

/// `muster server` on PostgreSQL: one of several servers, leader or
/// follower as the election says (muster_server::ha), until stopped.
async fn highly_available(args: &ServerArgs, config: muster_server::ServerConfig) -> Result<()> {
    use muster_server::ha::{HaConfig, Role};
    let scheme = if args.tls.insecure_http {
        "http"
    } else {
        "https"
    };
    let advertise = match &args.advertise {
        Some(url) => url.trim_end_matches('/').to_string(),
        None if args.listen.ip().is_unspecified() => {
            format!("{scheme}://{}:{}", host_name(), args.listen.port())
        }
        None => format!("{scheme}://{}", args.listen),
    };
    if args.listen.port() == 0 {
        bail!("with a PostgreSQL store, --listen needs a fixed port (other servers forward to it)");
    }
    let ha = HaConfig {
        id: HaConfig::new_id(),
        advertise: advertise.clone(),
        lease: leader_lease(args),
    };
    eprintln!(
        "muster server {} on {}: one of the servers sharing it; listening on {}, advertised \
         as {advertise}",
        ha.id,
        config
            .store
            .as_ref()
            .map(|store| store.describe())
            .unwrap_or_default(),
        args.listen
    );
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let (role, mut roles) = tokio::sync::watch::channel(Role::Starting);
    let mut election = tokio::spawn(muster_server::ha::run(config, ha, stopped, role));
    let reporter = tokio::spawn(async move {
        while roles.changed().await.is_ok() {
            let now = roles.borrow_and_update().clone();
            match now {
                Role::Starting => {}
                Role::Leader { term } => eprintln!("leading (term {term})"),
                Role::Follower { leader: Some(url) } => {
                    eprintln!("following the leader at {url} (requests are forwarded to it)")
                }
                Role::Follower { leader: None } => eprintln!("following; no leader yet"),
            }
        }
    });
    let outcome = tokio::select! {
        _ = shutdown_signal() => {
            let _ = stop.send(true);
            (&mut election).await
        }
        ended = &mut election => ended,
    };
    reporter.abort();
    outcome.context("the election task failed")?
}

pub fn up(args: UpArgs) -> Result<()> {
    init_logging();
    let data_dir = args.data_dir.clone().unwrap_or_else(default_data_dir);
    let name = host_name();
    let (backend, notice): (Arc<dyn GpuBackend>, Option<String>) = match &args.simulate_gpus {
        Some(spec) => backend(Some(spec), &name)?,
        None => match NvmlBackend::new() {
            Ok(nvml) => (Arc::new(nvml), None),
            Err(error) => (
                Arc::new(
                    SimulatedBackend::parse("8xH100-80GB", &name).map_err(|e| anyhow!("{e}"))?,
                ),
                Some(format!(
                    "no GPUs found ({error}); running with 8 simulated H100-80GB GPUs"
                )),
            ),
        },
    };
    let isolated = isolation(&args.isolation, &name, &data_dir.join("agent"))?;
    let tls = args.tls.mode(args.listen);
    // The CLI of this user finds the server and token with no flags. The
    // config is written before the port opens (the server makes its token
    // and CA before it listens), so a script that waits for the port and
    // then runs `muster` finds everything; it is written again only when
    // the address bound differs (port 0).
    let config_file = config_path();
    let token_file = data_dir.join("admin.token");
    let ca_file = matches!(tls, muster_server::tls::TlsMode::Generated { .. })
        .then(|| data_dir.join("tls/ca.pem"));
    let scheme = match tls {
        muster_server::tls::TlsMode::Off => "http",
        _ => "https",
    };
    let planned = format!("{scheme}://{}", args.listen);
    let previous = std::fs::read(&config_file).ok();
    write_client_config(&config_file, &planned, &token_file, ca_file.as_deref())?;
    runtime()?.block_on(async {
        let started = muster_server::Server::start(muster_server::ServerConfig {
            tls,
            master_port_base: args.ports.master_port_base,
            join_token_ttl_ms: args.admission.join_token_ttl.0,
            node_limits: args.admission.limits(),
            max_pending_per_user: args.admission.max_pending_per_user.0,
            approve_nodes: args.admission.approve_nodes,
            max_services_per_user: args.admission.max_services_per_user.0,
            max_dev_per_user: args.admission.max_dev_per_user.0,
            ..server_config(
                args.listen,
                data_dir.clone(),
                10_000,
                args.placement,
                args.max_log_bytes,
                args.retention,
                None,
                args.idle_after,
                muster_control::StackPolicy::Report,
            )
        })
        .await;
        let handle = match started {
            Ok(handle) => handle,
            Err(error) => {
                // Another cluster's config stays as it was.
                let _ = match &previous {
                    Some(bytes) => std::fs::write(&config_file, bytes),
                    None => std::fs::remove_file(&config_file),
                };
                return Err(error);
            }
        };
        let url = handle.url();
        if url != planned {
            write_client_config(&config_file, &url, &token_file, ca_file.as_deref())?;
        }
        let agent = AgentConfig {
            server: url.clone(),
            trust: handle.trust(),
            join_token: Some(handle.join_token().to_string()),
            name: name.clone(),
            address: "127.0.0.1".to_string(),
            state_dir: data_dir.join("agent"),
            pool: None,
            rack: None,
            backend,
            fence_margin: Duration::from_millis(muster_node::DEFAULT_FENCE_MARGIN_MS),
            supervisor: isolated.supervisor.clone(),
            cgroups: isolated.cgroups.clone(),
            task_uids: isolated.task_uids,
            namespaces: isolated.namespaces,
            allow_root_tasks: args.isolation.allow_root_tasks,
            task_pids_max: isolated.task_pids_max,
            telemetry_interval: std::time::Duration::from_secs(args.isolation.telemetry_interval),
            container_network: args.isolation.container_network.clone(),
            container_shm_bytes: args.isolation.container_shm,
            log_shipping: muster_agent::logship::LogShipConfig::default(),
        };
        let (stop_agent, agent_stopped) = tokio::sync::oneshot::channel::<()>();
        let cgroups = agent.cgroups.clone();
        let agent_task = tokio::spawn(async move {
            let result = muster_agent::run(agent, async {
                let _ = agent_stopped.await;
            })
            .await;
            cgroups.remove_parents();
            result
        });
        if let Some(notice) = notice {
            eprintln!("notice: {notice}");
        }
        eprintln!(
            "muster is up: API at {url} (data in {})",
            data_dir.display()
        );
        eprintln!(
            "token: {} (the CLI finds it through {})",
            token_file.display(),
            config_file.display()
        );
        if url != DEFAULT_SERVER {
            eprintln!("(not the default address: other users pass --server {url})");
        }
        eprintln!("try, in another terminal:");
        eprintln!("  muster run --gpus 1 -- sh -c 'echo my GPU: $CUDA_VISIBLE_DEVICES'");
        eprintln!("  muster submit examples/jobs/hello.yaml && muster ps");
        eprintln!("  muster nodes");
        shutdown_signal().await;
        let _ = stop_agent.send(());
        let _ = agent_task.await;
        handle.shutdown().await;
        Ok(())
    })
}

/// Writes the client config `muster up` leaves for its user (server, token
/// file, CA file), whole or not at all: a CLI reading it at the same moment
/// sees the old file or the new one.
fn write_client_config(
    file: &std::path::Path,
    url: &str,
    token_file: &std::path::Path,
    ca_file: Option<&std::path::Path>,
) -> Result<()> {
    let mut config = serde_json::json!({ "server": url, "token_file": token_file });
    if let Some(ca_file) = ca_file {
        config["ca_file"] = serde_json::json!(ca_file);
    }
    if let Some(parent) = file.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("cannot create {}", parent.display()))?;
    }
    let partial = file.with_extension("json.partial");
    std::fs::write(&partial, serde_json::to_string_pretty(&config)?)
        .and_then(|()| std::fs::rename(&partial, file))
        .with_context(|| format!("cannot write {}", file.display()))
}

#[cfg(test)]
mod tests {
    #[test]
    fn service_levels_read_in_gpu_hours_ascending_or_none() {
        let levels = super::parse_service_levels("1,10,100").unwrap();
        assert_eq!(levels, muster_sched::ServiceLevels::default());
        assert_eq!(
            super::parse_service_levels("none").unwrap(),
            muster_sched::ServiceLevels::none()
        );
        assert_eq!(
            super::parse_service_levels("0.5").unwrap().thresholds_gpu_s,
            [1_800]
        );
        for bad in ["10,1", "x", "0", "-1", "1,,2", "1,2,3,4,5,6,7,8,9,10"] {
            let error = super::parse_service_levels(bad).expect_err(bad);
            assert!(!error.is_empty());
        }
    }

    #[test]
    fn sizes_read_with_binary_units() {
        assert_eq!(super::parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(super::parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(super::parse_size("4096"), Ok(4096));
        assert_eq!(super::parse_rate("8MiB"), Ok(8 << 20));
        for (text, says) in [
            ("12XB", "unknown unit"),
            ("1GB", "unknown unit"),
            ("", "not a size"),
            ("MiB", "not a size"),
            ("99999999999TiB", "not a size"),
            ("1KiB", "too small"),
        ] {
            let error = super::parse_size(text).expect_err(text);
            assert!(error.contains(says), "{text}: {error}");
        }
        assert!(super::parse_rate("0").is_err());
    }
}

/// `muster gateway`: routes HTTP requests to services' ready replicas.
#[derive(Debug, Args)]
pub struct GatewayArgs {
    /// Where to listen for requests (`http://ADDRESS/NAME/...`, or a host
    /// `NAME.DOMAIN` pointed at it).
    #[arg(long, value_name = "ADDRESS:PORT", default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// A reply from a replica slower than this is answered 504.
    #[arg(long, value_name = "DURATION", default_value = "300s", value_parser = crate::cli::parse_duration_s)]
    pub upstream_timeout: u64,
    /// A request for a service with no ready replica (scaled to zero, or
    /// starting) waits this long for one, then is answered 503.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = crate::cli::parse_duration_s)]
    pub hold: u64,
    /// Route host NAME.DOMAIN to service NAME (a wildcard DNS name pointed
    /// at the gateway); without it only the path routes (`/NAME/...`).
    #[arg(long, value_name = "DOMAIN")]
    pub domain: Option<String>,
    /// The server whose services it serves, and how to reach it.
    #[command(flatten)]
    pub connection: crate::commands::Connection,
}

pub fn gateway(args: GatewayArgs) -> Result<()> {
    init_logging();
    let client = args.connection.client()?;
    runtime()?.block_on(async {
        let handle = muster_server::gateway::start(
            muster_server::gateway::GatewayConfig {
                listen: args.listen,
                upstream_timeout: Duration::from_secs(args.upstream_timeout.max(1)),
                hold: Duration::from_secs(args.hold),
                domain: args.domain.clone(),
            },
            muster_server::gateway::Endpoints::Server(client),
        )
        .await?;
        eprintln!(
            "muster gateway listening on http://{} (http://{}/NAME/... reaches service NAME; \
             metrics at /_muster/metrics)",
            handle.addr, handle.addr
        );
        shutdown_signal().await;
        handle.stop().await;
        Ok(())
    })
}
