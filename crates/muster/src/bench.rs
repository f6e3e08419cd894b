//! `muster bench`: measurements of a running cluster (issue 4), all on
//! 127.0.0.1. Each bench starts what it needs (an in-process server, or a
//! server and an agent as child processes of this binary, so their CPU time
//! and memory can be read from /proc) unless `--server` names one.

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Subcommand, ValueEnum};
use muster_api::client::{Client, JobFilter};
use muster_api::protocol::{GpuView, HeartbeatRequest, RegisterRequest};
use muster_api::tls::Trust;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Durable submissions per second: many concurrent clients submit small
    /// jobs that are never placed (acknowledged = HTTP 201, sent only after
    /// the SQLite commit).
    Submit(SubmitBench),
    /// Server CPU and memory with N simulated agents heartbeating (8
    /// simulated GPUs each) from this process.
    Agents(AgentsBench),
    /// CPU and memory of one real idle agent (simulated GPUs).
    IdleAgent(IdleAgentBench),
    /// Time from submitting a 1-GPU job to seeing it running, on an idle
    /// cluster of one real agent (simulated GPUs).
    SubmitToRunning(SubmitToRunningBench),
    /// Container start overhead: time from submitting a job to its first
    /// output line in `muster logs`, as a process and as a container of a
    /// local image, alternating, through one real agent.
    FirstOutput(FirstOutputBench),
    /// CPU and memory of the task supervisors: N long-running tasks through
    /// one real agent, measured per supervisor process.
    Supervision(SupervisionBench),
    /// Short jobs (`true`) through one real agent, back to back: jobs per
    /// second over the first and the last 1,000, and what is left behind.
    ShortJobs(ShortJobsBench),
    /// Whether cost follows live work or history: many short jobs through
    /// 8 real agents; at 10%, 50% and 100% of them finished, jobs/s, the
    /// server's RSS, heartbeat latency (p50, p99) and `GET /v1/jobs` time.
    History(HistoryBench),
    /// One scheduling cycle of the server's control plane (snapshot,
    /// engine, applying the outcome) over N simulated nodes and M pending
    /// jobs.
    Cycle(CycleBench),
    /// Rendering `GET /metrics`: N nodes of 8 GPUs with telemetry, M
    /// running one-GPU jobs (in process, the server's own renderer).
    Metrics(MetricsBench),
    /// Failover: two server processes on one PostgreSQL database; the
    /// leader is killed (SIGKILL), and the time from its death to the first
    /// submission the new leader accepts is measured, round after round.
    Failover(FailoverBench),
    /// A service replica's death under load through a gateway: from the
    /// kill (SIGKILL of its process) to its leaving the endpoints (traffic
    /// on the others) and to a replacement being ready; requests failed.
    ReplicaDeath(ReplicaDeathBench),
    /// Gateway overhead: the same GETs to a local HTTP backend, directly
    /// and through `muster gateway` (in this process), alternating rounds;
    /// latency percentiles of each, the added latency, and requests/s.
    Gateway(GatewayBench),
}

#[derive(Debug, Args)]
pub struct ReplicaDeathBench {
    /// Replicas killed, one a round (each round waits for 3 ready first).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// Concurrent clients sending GETs through the gateway.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub clients: u64,
}

#[derive(Debug, Args)]
pub struct GatewayBench {
    /// Concurrent clients (each with its own keep-alive connection pool).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub clients: u64,
    /// Requests per round and path.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    pub requests: u64,
    /// Rounds of each path, alternating (direct, gateway, direct, ...).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// Bytes in each reply.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(0..=1_048_576))]
    pub reply_bytes: u64,
}

#[derive(Debug, Args)]
pub struct FailoverBench {
    /// The PostgreSQL database the two servers share (an empty one, e.g.
    /// made with `createdb`; the bench leaves its jobs there).
    #[arg(long, value_name = "URL")]
    pub store: String,
    /// Leader deaths to measure (the killed server comes back as a
    /// follower before the next).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub rounds: u64,
    /// The servers' --leader-lease.
    #[arg(long, default_value = "4s")]
    pub leader_lease: String,
}

#[derive(Debug, Args)]
pub struct MetricsBench {
    /// Nodes (8 GPUs each, with a fresh telemetry report each).
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub nodes: u64,
    /// Running one-GPU jobs (at most 8 per node).
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(0..=800_000))]
    pub jobs: u64,
    /// Scrapes to time.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    pub scrapes: u64,
}

#[derive(Debug, Args)]
pub struct HistoryBench {
    /// Jobs in all.
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(100..=10_000_000))]
    pub count: u64,
    /// Real agents (8 simulated GPUs each; each job takes one).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub agents: u64,
    /// The most jobs submitted and not yet ended at any time.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub window: u64,
    /// The server's retention of finished jobs in memory (`muster server
    /// --retention`).
    #[arg(long, default_value = "60s")]
    pub retention: String,
}

#[derive(Debug, Args)]
pub struct CycleBench {
    /// The task shapes: an openb pod list (as `cargo bench -p muster-sched`
    /// uses); each pending job is one of its tasks at random, and 0.5% are
    /// gangs of 2 to 4 eight-GPU tasks.
    #[arg(
        long,
        default_value = "../shared/traces/openb/openb_pod_list_default.csv"
    )]
    pub tasks: PathBuf,
    /// Simulated nodes (8 GPUs each, 5 models as the engine's benchmark).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub nodes: u64,
    /// Pending jobs (the engine's benchmark mix: whole GPUs and shares).
    #[arg(long, default_value_t = 100_000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub pending: u64,
    /// Cycles to time (the first places most jobs; later ones find the
    /// cluster full).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub cycles: u64,
    /// Before each cycle after the first, this many running jobs end (their
    /// agents report exit 0) and as many new ones are submitted: a busy
    /// cluster's steady state, a second of it per cycle.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=100_000))]
    pub churn: u64,
}

#[derive(Debug, Args)]
pub struct SupervisionBench {
    /// Concurrent tasks (each asks for 1/8 of a GPU, 0.01 CPU, 16 MiB).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=512))]
    pub tasks: u64,
    /// Measurement window (after every task runs and a 5 s warm-up).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub duration: Duration,
}

#[derive(Debug, Args)]
pub struct ShortJobsBench {
    /// Jobs in all.
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(2..=1_000_000))]
    pub count: u64,
    /// The most jobs submitted and not yet ended at any time.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub window: u64,
    /// The agent's simulated GPUs (each job takes one).
    #[arg(long, default_value = "8xH100-80GB")]
    pub simulate_gpus: String,
    /// A flag for the agent, e.g. `--agent-arg=--task-namespaces=off`
    /// (repeat for several): what a part of task isolation costs.
    #[arg(long, value_name = "FLAG", allow_hyphen_values = true)]
    pub agent_arg: Vec<String>,
}

#[derive(Debug, Args)]
pub struct SubmitBench {
    /// Concurrent clients (each its own HTTP connection).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub clients: u64,
    /// Submissions in all.
    #[arg(long, default_value_t = 20_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub count: u64,
    /// Stop submitting after this long even if --count is not reached.
    #[arg(long, default_value = "120s", value_parser = parse_duration)]
    pub max_time: Duration,
    /// A running server (default: start one in this process, in a temporary
    /// data directory). Its jobs stay pending in pool `muster-bench-unplaced`.
    #[arg(long, value_name = "URL")]
    pub server: Option<String>,
    /// The admin token of --server (default: --token-file,
    /// $MUSTER_TOKEN_FILE, $MUSTER_TOKEN, as for every command; prefer
    /// those: a value on the command line is visible in /proc).
    #[arg(long)]
    pub token: Option<String>,
    /// A file holding the admin token of --server.
    #[arg(long, value_name = "PATH", conflicts_with = "token")]
    pub token_file: Option<std::path::PathBuf>,
    /// Serve the in-process server over plain HTTP instead of HTTPS (to
    /// measure what TLS costs).
    #[arg(long, conflicts_with = "server")]
    pub plain_http: bool,
    /// The in-process server's store: `sqlite` (a temporary muster.db, the
    /// default), `sqlite:PATH`, or a PostgreSQL URL. Give it several times
    /// to measure each in turn in one run, e.g. `--store sqlite --store
    /// postgres://muster@127.0.0.1/bench`.
    #[arg(long, value_name = "STORE", conflicts_with = "server")]
    pub store: Vec<String>,
}

/// How the simulated agents heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HeartbeatMode {
    /// As the real agent: a long poll of `wait_ms` = the heartbeat interval,
    /// the next one sent as soon as the answer comes.
    LongPoll,
    /// `wait_ms` 0, one heartbeat per interval.
    Poll,
}

#[derive(Debug, Args)]
pub struct AgentsBench {
    /// Simulated agents.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..=50_000))]
    pub count: u64,
    /// Heartbeat interval.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub heartbeat: Duration,
    /// Measurement window (after every agent registered and --warmup).
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub duration: Duration,
    /// Time heartbeating before the window starts.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub warmup: Duration,
    #[arg(long, value_enum, default_value = "long-poll")]
    pub mode: HeartbeatMode,
    /// Each agent also sends a telemetry report (8 GPUs, 2 interfaces) this
    /// often, as `muster agent` does (0: none).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub telemetry: Duration,
    /// A running server (default: start one as a child process). Its CPU is
    /// measured only with --server-pid.
    #[arg(long, value_name = "URL", requires = "join_token")]
    pub server: Option<String>,
    /// The join token of --server.
    #[arg(long, env = "MUSTER_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// The process id of --server, to read its CPU time and memory.
    #[arg(long, requires = "server")]
    pub server_pid: Option<u32>,
    /// Start the child server with plain HTTP instead of HTTPS (to measure
    /// what TLS costs).
    #[arg(long, conflicts_with = "server")]
    pub plain_http: bool,
}

#[derive(Debug, Args)]
pub struct IdleAgentBench {
    /// Measurement window (after the agent is ready and a 5 s warm-up).
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub duration: Duration,
    /// The agent's simulated GPUs.
    #[arg(long, default_value = "8xH100-80GB")]
    pub simulate_gpus: String,
}

#[derive(Debug, Args)]
pub struct SubmitToRunningBench {
    /// Jobs submitted one after the other.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub count: u64,
    /// The agent's simulated GPUs.
    #[arg(long, default_value = "8xH100-80GB")]
    pub simulate_gpus: String,
}

#[derive(Debug, Args)]
pub struct FirstOutputBench {
    /// Jobs of each kind (process, container).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    pub count: u64,
    /// A local image with `sh` (e.g. one imported from busybox-static; see
    /// docs/benchmarks.md).
    #[arg(long, default_value = "muster-test-busybox:2")]
    pub image: String,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    crate::cli::parse_duration_s(text).map(Duration::from_secs)
}

pub fn run(args: BenchArgs) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    runtime.block_on(async {
        match args.command {
            BenchCommand::Submit(args) => submit(args).await,
            BenchCommand::Agents(args) => agents(args).await,
            BenchCommand::IdleAgent(args) => idle_agent(args).await,
            BenchCommand::SubmitToRunning(args) => submit_to_running(args).await,
            BenchCommand::FirstOutput(args) => first_output(args).await,
            BenchCommand::Supervision(args) => supervision(args).await,
            BenchCommand::ShortJobs(args) => short_jobs(args).await,
            BenchCommand::History(args) => history(args).await,
            BenchCommand::Cycle(args) => cycle(args),
            BenchCommand::Metrics(args) => metrics(args),
            BenchCommand::Failover(args) => failover(args).await,
            BenchCommand::Gateway(args) => gateway(args).await,
            BenchCommand::ReplicaDeath(args) => replica_death(args).await,
        }
    })
}

// ---------------------------------------------------------------------------
// Measuring

/// Latencies in microseconds.
#[derive(Debug, Default)]
struct Latencies(Vec<u64>);

impl Latencies {
    fn push(&mut self, duration: Duration) {
        self.0
            .push(duration.as_micros().min(u128::from(u64::MAX)) as u64);
    }

    fn extend(&mut self, other: Latencies) {
        self.0.extend(other.0);
    }

    /// Nearest-rank percentile in milliseconds.
    fn percentile_ms(&mut self, p: f64) -> f64 {
        if self.0.is_empty() {
            return f64::NAN;
        }
        self.0.sort_unstable();
        let rank = ((p / 100.0) * self.0.len() as f64).ceil() as usize;
        let index = rank.clamp(1, self.0.len()) - 1;
        self.0[index] as f64 / 1000.0
    }

    fn summary(&mut self) -> String {
        format!(
            "p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} samples)",
            self.percentile_ms(50.0),
            self.percentile_ms(90.0),
            self.percentile_ms(99.0),
            self.percentile_ms(100.0),
            self.0.len()
        )
    }
}

/// Clock ticks per second of /proc/PID/stat's times, and whether it was
/// read (`getconf CLK_TCK`) or assumed (100).
fn clock_ticks() -> (f64, bool) {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .stderr(Stdio::null())
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|text| text.trim().parse::<f64>().ok())
        .filter(|ticks| *ticks > 0.0)
        .map_or((100.0, false), |ticks| (ticks, true))
}

/// utime + stime of a process (all its threads), in clock ticks.
fn cpu_ticks(pid: u32) -> Result<u64> {
    let path = format!("/proc/{pid}/stat");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    // The command name (field 2) may hold spaces: fields start after ')'.
    let rest = text
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow!("unexpected format of {path}"))?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is field 3 (state); utime is field 14, stime field 15.
    let field = |index: usize| -> Result<u64> {
        fields
            .get(index)
            .and_then(|value| value.parse().ok())
            .ok_or_else(|| anyhow!("unexpected format of {path}"))
    };
    Ok(field(11)? + field(12)?)
}

/// A `/proc/PID/status` value in KiB (`VmRSS`, `VmHWM`).
fn status_kib(pid: u32, key: &str) -> Result<u64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    text.lines()
        .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .ok_or_else(|| anyhow!("no {key} in {path}"))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// CPU time of a process over a window.
struct CpuWindow {
    pid: u32,
    ticks: u64,
    started: Instant,
}

impl CpuWindow {
    fn start(pid: u32) -> Result<CpuWindow> {
        Ok(CpuWindow {
            pid,
            ticks: cpu_ticks(pid)?,
            started: Instant::now(),
        })
    }

    /// CPU used since the start, as a percentage of one core.
    fn percent_of_core(&self, ticks_per_second: f64) -> Result<f64> {
        let used = cpu_ticks(self.pid)?.saturating_sub(self.ticks) as f64 / ticks_per_second;
        Ok(100.0 * used / self.started.elapsed().as_secs_f64())
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|| "unknown".to_string())
}

// ---------------------------------------------------------------------------
// Child processes

/// A child process of this binary, stopped (TERM, then KILL) when dropped.
struct ChildProcess {
    what: &'static str,
    child: std::process::Child,
}

impl ChildProcess {
    fn spawn(what: &'static str, args: &[String], log: &Path) -> Result<ChildProcess> {
        let exe = std::env::current_exe().context("cannot find this program's own path")?;
        let log_file = std::fs::File::create(log)
            .with_context(|| format!("cannot create {}", log.display()))?;
        let child = std::process::Command::new(&exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("cannot start {} {}", exe.display(), args.join(" ")))?;
        Ok(ChildProcess { what, child })
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the process has exited.
    fn check_alive(&mut self, log: &Path) -> Result<()> {
        if let Ok(Some(status)) = self.child.try_wait() {
            let tail = std::fs::read_to_string(log).unwrap_or_default();
            let tail: Vec<&str> = tail.lines().rev().take(10).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            bail!(
                "the {} process exited ({status}); its log ({}):\n{}",
                self.what,
                log.display(),
                tail.join("\n")
            );
        }
        Ok(())
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client of `url` trusting its certificate as `trust` says.
fn connect(url: &str, token: &str, trust: &Trust) -> Result<Client> {
    Client::with_trust(url, token, trust).map_err(|e| anyhow!(e))
}

/// The CA to trust a server given with --server by: $MUSTER_CA_SHA256 or
/// $MUSTER_CA_FILE (else the system's roots).
fn env_trust() -> Result<Trust> {
    crate::commands::trust_of(
        std::env::var("MUSTER_CA_SHA256").ok().as_deref(),
        std::env::var_os("MUSTER_CA_FILE")
            .map(PathBuf::from)
            .as_deref(),
    )
}

impl ChildServer {
    fn client(&self, token: &str) -> Result<Client> {
        connect(&self.url, token, &self.trust)
    }
}

/// A free port on 127.0.0.1 (free when asked; the server binds it next).
fn free_port() -> Result<u16> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("cannot bind to 127.0.0.1")?;
    Ok(listener.local_addr()?.port())
}

/// A server child process in a temporary data directory.
struct ChildServer {
    process: ChildProcess,
    url: String,
    /// Its generated cluster CA.
    trust: Trust,
    admin_token: String,
    join_token: String,
    log: PathBuf,
    data_dir: PathBuf,
}

async fn start_child_server(dir: &Path, lease: Duration) -> Result<ChildServer> {
    start_child_server_with(dir, lease, &[]).await
}

async fn start_child_server_with(
    dir: &Path,
    lease: Duration,
    extra: &[String],
) -> Result<ChildServer> {
    let port = free_port()?;
    let data_dir = dir.join("server");
    let log = dir.join("server.log");
    let args = vec![
        "server".to_string(),
        "--listen".to_string(),
        format!("127.0.0.1:{port}"),
        "--data-dir".to_string(),
        data_dir.display().to_string(),
        "--lease".to_string(),
        format!("{}s", lease.as_secs().max(1)),
        // A benchmark measures what the server can take, not the limit.
        "--rate-limit".to_string(),
        "off".to_string(),
    ];
    let args: Vec<String> = args.into_iter().chain(extra.iter().cloned()).collect();
    let plain = extra.iter().any(|arg| arg == "--insecure-http");
    let mut process = ChildProcess::spawn("server", &args, &log)?;
    let url = format!(
        "{}://127.0.0.1:{port}",
        if plain { "http" } else { "https" }
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        process.check_alive(&log)?;
        let tokens = (
            std::fs::read_to_string(data_dir.join("admin.token")),
            std::fs::read_to_string(data_dir.join("join.token")),
            std::fs::read(data_dir.join("tls/ca.pem")),
        );
        if let (Ok(admin), Ok(join), ca) = tokens
            && (plain || ca.is_ok())
        {
            let admin = admin.trim().to_string();
            let trust = Trust {
                ca_pem: ca.ok(),
                ca_sha256: None,
            };
            if !admin.is_empty() && connect(&url, &admin, &trust)?.queues().await.is_ok() {
                eprintln!(
                    "started a server child process (pid {}) at {url}, data in {}",
                    process.pid(),
                    data_dir.display()
                );
                return Ok(ChildServer {
                    process,
                    url,
                    trust,
                    admin_token: admin,
                    join_token: join.trim().to_string(),
                    log,
                    data_dir,
                });
            }
        }
        if Instant::now() > deadline {
            bail!(
                "the server child process did not answer at {url} within 20 s; see {}",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A real agent child process joined to `server`, waited for until its
/// node is ready.
async fn start_child_agent(dir: &Path, server: &ChildServer, gpus: &str) -> Result<ChildProcess> {
    start_named_agent(dir, server, gpus, "bench-agent", "agent", &[]).await
}

/// A real agent child process named `name`, its state in `dir/STATE` and
/// its output in `dir/STATE.log`.
async fn start_named_agent(
    dir: &Path,
    server: &ChildServer,
    gpus: &str,
    name: &str,
    state: &str,
    extra: &[String],
) -> Result<ChildProcess> {
    let log = dir.join(format!("{state}.log"));
    let args = vec![
        "agent".to_string(),
        "--server".to_string(),
        server.url.clone(),
        "--join-token-file".to_string(),
        server.data_dir.join("join.token").display().to_string(),
        "--name".to_string(),
        name.to_string(),
        "--address".to_string(),
        "127.0.0.1".to_string(),
        "--simulate-gpus".to_string(),
        gpus.to_string(),
        "--state-dir".to_string(),
        dir.join(state).display().to_string(),
    ];
    let ca = server.data_dir.join("tls/ca.pem");
    let mut args: Vec<String> = if server.trust.ca_pem.is_some() {
        args.into_iter()
            .chain(["--ca-file".to_string(), ca.display().to_string()])
            .collect()
    } else {
        args
    };
    args.extend(extra.iter().cloned());
    let mut process = ChildProcess::spawn("agent", &args, &log)?;
    let admin = server.client(&server.admin_token)?;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        process.check_alive(&log)?;
        if let Ok(node) = admin.node(name).await
            && node.state == "ready"
        {
            eprintln!(
                "started an agent child process (pid {}), node {name} with {} GPUs is ready",
                process.pid(),
                node.gpus.len()
            );
            return Ok(process);
        }
        if Instant::now() > deadline {
            let state = admin
                .node(name)
                .await
                .map_or_else(|e| format!("not known ({e})"), |n| n.state);
            bail!(
                "the agent's node did not become ready within 20 s (state: {state}); see {}",
                log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn temp_dir() -> Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix("muster-bench-")
        .tempdir()
        .context("cannot create a temporary directory")
}

// ---------------------------------------------------------------------------
// muster bench failover

async fn failover(args: FailoverBench) -> Result<()> {
    let location = muster_server::store::StoreLocation::parse(&args.store)
        .map_err(|error| anyhow!("--store: {error}"))?;
    if location.backend() != muster_server::store::Backend::Postgres {
        bail!("--store must be a PostgreSQL database (postgres://...)");
    }
    let store = muster_server::store::SqlStore::open_at(&location, Default::default()).await?;
    let dir = temp_dir()?;
    let names = ["a", "b"];
    let ports = [free_port()?, free_port()?];
    let urls = ports.map(|port| format!("https://127.0.0.1:{port}"));
    let start = |index: usize, generation: u64| -> Result<ChildProcess> {
        let data = dir.path().join(names[index]);
        let log = dir
            .path()
            .join(format!("{}-{generation}.log", names[index]));
        let args: Vec<String> = [
            "server",
            "--listen",
            &format!("127.0.0.1:{}", ports[index]),
            "--data-dir",
            &data.display().to_string(),
            "--store",
            &args.store,
            "--advertise",
            &urls[index],
            "--leader-lease",
            &args.leader_lease,
            "--rate-limit",
            "off",
        ]
        .iter()
        .map(|arg| arg.to_string())
        .collect();
        ChildProcess::spawn("server", &args, &log)
    };
    let mut servers: [Option<ChildProcess>; 2] = [Some(start(0, 0)?), None];
    let identity = dir.path().join("a");
    let deadline = Instant::now() + Duration::from_secs(30);
    // Every file the second server needs, each written whole (tokens and
    // the secrets key are linked into place once written): the secrets key
    // comes after the tokens, and copying before it was there failed the
    // start.
    while !muster_server::ha::SHARED_FILES
        .iter()
        .all(|name| identity.join(name).exists())
    {
        if Instant::now() > deadline {
            bail!(
                "the first server did not start; see {}",
                dir.path().display()
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What every server of the cluster shares (docs/ha.md).
    muster_server::ha::share_identity(&identity, &dir.path().join("b"))?;
    servers[1] = Some(start(1, 0)?);
    let token = std::fs::read_to_string(identity.join("admin.token"))?
        .trim()
        .to_string();
    let trust = Trust {
        ca_pem: Some(std::fs::read(identity.join("tls/ca.pem"))?),
        ca_sha256: None,
    };
    let client = connect(&urls.join(","), &token, &trust)?;
    let spec = serde_json::json!({
        "name": "failover",
        "command": ["true"],
        "queue": "bench",
        "pool": "muster-bench-unplaced",
    });
    let answers = |url: &str| {
        let client = connect(url, &token, &trust);
        async move {
            match client {
                Ok(client) => client.queues().await.is_ok(),
                Err(_) => false,
            }
        }
    };
    for url in &urls {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !answers(url).await {
            if Instant::now() > deadline {
                bail!(
                    "{url} does not answer; see the logs in {}",
                    dir.path().display()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    println!(
        "muster bench failover: 2 servers on {}, --leader-lease {}",
        location.describe(),
        args.leader_lease
    );
    let mut times = Vec::new();
    for round in 0..args.rounds {
        let Some((leader, term)) = store.leader().await? else {
            bail!("no server leads");
        };
        let index = urls
            .iter()
            .position(|url| *url == leader)
            .ok_or_else(|| anyhow!("the leader {leader} is neither server"))?;
        client.submit(spec.clone()).await?;
        if let Some(mut server) = servers[index].take() {
            let _ = server.child.kill();
            let _ = server.child.wait();
        }
        let killed = Instant::now();
        loop {
            if client.submit_once(spec.clone()).await.is_ok() {
                break;
            }
            if killed.elapsed() > Duration::from_secs(60) {
                bail!("no server accepted a submission within 60 s of the leader's death");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let took = killed.elapsed();
        let now_leads = store.leader().await?.map(|(_, term)| term).unwrap_or(0);
        println!(
            "  round {}: {} (term {term}) killed; a submission accepted {:.2} s later (term \
             {now_leads})",
            round + 1,
            names[index],
            took.as_secs_f64()
        );
        times.push(took.as_secs_f64());
        servers[index] = Some(start(index, round + 1)?);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !answers(&urls[index]).await {
            if Instant::now() > deadline {
                bail!("{} did not come back", urls[index]);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    times.sort_by(f64::total_cmp);
    println!(
        "  leader death to the first accepted submission: median {:.2} s, min {:.2} s, max \
         {:.2} s ({} rounds)",
        times[times.len() / 2],
        times[0],
        times[times.len() - 1],
        times.len()
    );
    store.close().await;
    Ok(())
}

// ---------------------------------------------------------------------------
// muster bench submit

async fn submit(args: SubmitBench) -> Result<()> {
    if args.store.len() <= 1 {
        submit_to(&args, args.store.first().map(String::as_str)).await?;
        return Ok(());
    }
    let mut results = Vec::new();
    for store in &args.store {
        results.push((store.clone(), submit_to(&args, Some(store)).await?));
    }
    println!("side by side ({} clients):", args.clients);
    println!(
        "  {:<40} {:>14} {:>10} {:>10}",
        "store", "submissions/s", "p50 ms", "p99 ms"
    );
    for (store, (rate, p50, p99)) in results {
        let shown = muster_server::store::StoreLocation::parse(&store)
            .map(|location| location.describe())
            .unwrap_or(store);
        println!("  {shown:<40} {rate:>14.0} {p50:>10.2} {p99:>10.2}");
    }
    Ok(())
}

/// One run of `muster bench submit`; returns (submissions/s, p50 ms,
/// p99 ms).
async fn submit_to(args: &SubmitBench, store: Option<&str>) -> Result<(f64, f64, f64)> {
    let store = match store {
        None | Some("sqlite") => None,
        Some(text) => Some(
            muster_server::store::StoreLocation::parse(text)
                .map_err(|error| anyhow!("--store: {error}"))?,
        ),
    };
    let mut in_process = None;
    let mut _dir = None;
    // Only a running server needs one (the in-process one makes its own).
    let given = match &args.server {
        Some(_) => crate::commands::given_token(args.token.as_deref(), args.token_file.as_deref())?,
        None => None,
    };
    let (url, token, trust) = match (&args.server, &given) {
        (Some(url), Some(token)) => (url.clone(), token.clone(), env_trust()?),
        (Some(_), None) => {
            bail!("--server needs --token-file (or MUSTER_TOKEN_FILE, MUSTER_TOKEN)")
        }
        (None, _) => {
            let dir = temp_dir()?;
            let config = muster_server::ServerConfig {
                store,
                listen: SocketAddr::from(([127, 0, 0, 1], 0)),
                // A benchmark measures what the server takes, not the limit.
                rate_limit: None,
                tls: if args.plain_http {
                    muster_server::tls::TlsMode::Off
                } else {
                    muster_server::tls::TlsMode::Generated {
                        names: vec!["localhost".into(), "127.0.0.1".into()],
                    }
                },
                ..muster_server::ServerConfig::new(dir.path().join("server"))
            };
            let handle = muster_server::Server::start(config)
                .await
                .context("cannot start the in-process server")?;
            let url = handle.url();
            eprintln!(
                "started an in-process server at {url} (data in {}, store {}; it shares this \
                 process's CPU with the clients)",
                handle.data_dir().display(),
                handle.store_location()
            );
            let token = handle.admin_token().to_string();
            let trust = handle.trust();
            in_process = Some(handle);
            _dir = Some(dir);
            (url, token, trust)
        }
    };
    let probe = connect(&url, &token, &trust)?;
    probe
        .queues()
        .await
        .with_context(|| format!("cannot use the server at {url}"))?;

    let spec = serde_json::json!({
        "name": "b",
        "command": ["true"],
        "queue": "bench",
        "pool": "muster-bench-unplaced",
    });
    let next = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let first_error = Arc::new(std::sync::Mutex::new(None::<String>));
    let start_gate = Arc::new(tokio::sync::Barrier::new(args.clients as usize + 1));
    let mut clients = Vec::new();
    for _ in 0..args.clients {
        let client = connect(&url, &token, &trust)?;
        let (next, errors, first_error, gate, spec) = (
            next.clone(),
            errors.clone(),
            first_error.clone(),
            start_gate.clone(),
            spec.clone(),
        );
        let (count, max_time) = (args.count, args.max_time);
        clients.push(tokio::spawn(async move {
            // Opens this client's connection before the clock starts.
            let _ = client.queues().await;
            gate.wait().await;
            let deadline = Instant::now() + max_time;
            let mut latencies = Latencies::default();
            while next.fetch_add(1, Ordering::Relaxed) < count && Instant::now() < deadline {
                let sent = Instant::now();
                match client.submit(spec.clone()).await {
                    Ok(_) => latencies.push(sent.elapsed()),
                    Err(error) => {
                        errors.fetch_add(1, Ordering::Relaxed);
                        if let Ok(mut first) = first_error.lock() {
                            first.get_or_insert_with(|| error.to_string());
                        }
                    }
                }
            }
            latencies
        }));
    }
    eprintln!(
        "submitting {} jobs from {} clients (at most {:?}), load average {}",
        args.count,
        args.clients,
        args.max_time,
        load_average()
    );
    start_gate.wait().await;
    let started = Instant::now();
    let mut latencies = Latencies::default();
    for client in clients {
        latencies.extend(client.await.context("a client task failed")?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let acknowledged = latencies.0.len();
    let errors = errors.load(Ordering::Relaxed);
    let store_shown = in_process
        .as_ref()
        .map(|handle| format!(", store {}", handle.store_location()))
        .unwrap_or_default();
    println!(
        "muster bench submit: {} clients, {url}{store_shown}",
        args.clients
    );
    println!(
        "  acknowledged (HTTP 201, durable): {acknowledged} in {elapsed:.2} s = {:.0} submissions/s",
        acknowledged as f64 / elapsed
    );
    println!("  latency: {}", latencies.summary());
    let (p50, p99) = (latencies.percentile_ms(50.0), latencies.percentile_ms(99.0));
    println!("  errors: {errors}");
    if let Ok(first) = first_error.lock()
        && let Some(first) = first.as_ref()
    {
        println!("  first error: {first}");
    }
    println!("  load average at the end: {}", load_average());
    if let Some(handle) = in_process {
        handle.shutdown().await;
    } else {
        println!(
            "  note: the {acknowledged} jobs stay pending in queue `bench`, pool \
             `muster-bench-unplaced`"
        );
    }
    Ok((acknowledged as f64 / elapsed, p50, p99))
}

// ---------------------------------------------------------------------------
// muster bench agents

fn max_open_files() -> Option<u64> {
    std::fs::read_to_string("/proc/self/limits")
        .ok()?
        .lines()
        .find(|line| line.starts_with("Max open files"))?
        .split_whitespace()
        .nth(3)?
        .parse()
        .ok()
}

/// A telemetry report as an agent of 8 GPUs sends it.
fn bench_report(epoch: u64, seed: u32) -> muster_api::protocol::TelemetryReport {
    use muster_api::protocol::{GpuSample, InterfaceSample, NodeSample, TelemetryReport};
    TelemetryReport {
        epoch,
        sampled_ms: 0,
        gpus: (0..8)
            .map(|index| GpuSample {
                index,
                utilization_pct: (seed * 7 + index * 13) % 101,
                memory_used_mib: 40_000,
                memory_total_mib: 81_920,
                power_watts: Some(420.5),
                temperature_c: Some(62),
                sm_clock_mhz: Some(1_980),
                ecc_uncorrected: Some(0),
                xid: None,
                pcie_tx_bytes: None,
                pcie_rx_bytes: None,
                healthy: true,
            })
            .collect(),
        node: NodeSample {
            cpu_busy_pct: Some(37.5),
            memory_used_mib: Some(200_000),
            memory_total_mib: Some(524_288),
            network: ["eth0", "ib0"]
                .iter()
                .map(|name| InterfaceSample {
                    interface: name.to_string(),
                    receive_bytes: 1 << 40,
                    transmit_bytes: 1 << 39,
                })
                .collect(),
        },
    }
}

fn simulated_gpus(agent: u64) -> Vec<GpuView> {
    (0..8)
        .map(|index| GpuView {
            index,
            uuid: format!("GPU-bench-{agent:05}-{index}"),
            model: "H100-80GB".to_string(),
            memory_mib: 81_559,
            nvlink_domain: 0,
        })
        .collect()
}

/// What one simulated agent measured in the window.
#[derive(Default)]
struct AgentTally {
    latencies: Latencies,
    /// Round trip minus the requested wait (long poll).
    overshoot: Latencies,
    errors: u64,
    first_error: Option<String>,
}

async fn agents(args: AgentsBench) -> Result<()> {
    let needed = args.count + 64;
    if let Some(limit) = max_open_files()
        && limit < needed
    {
        bail!(
            "{} agents need about {needed} open files; the limit is {limit} (raise it with \
             `ulimit -n {needed}`)",
            args.count
        );
    }
    let heartbeat_ms = args.heartbeat.as_millis() as u64;
    if heartbeat_ms == 0 {
        bail!("--heartbeat must be above 0");
    }
    let dir = temp_dir()?;
    // The server holds a long poll at most lease / 2: the lease is at least
    // twice the heartbeat.
    let lease = (args.heartbeat * 2).max(Duration::from_secs(10));
    let (mut server, url, join_token, server_pid, trust) = match &args.server {
        Some(url) => {
            let token = args
                .join_token
                .clone()
                .ok_or_else(|| anyhow!("--server needs --join-token"))?;
            (None, url.clone(), token, args.server_pid, env_trust()?)
        }
        None => {
            let extra = if args.plain_http {
                vec!["--insecure-http".to_string()]
            } else {
                Vec::new()
            };
            let server = start_child_server_with(dir.path(), lease, &extra).await?;
            let (url, token, pid, trust) = (
                server.url.clone(),
                server.join_token.clone(),
                server.process.pid(),
                server.trust.clone(),
            );
            (Some(server), url, token, Some(pid), trust)
        }
    };

    // Register every agent, 64 at a time.
    let registered_at = Instant::now();
    let mut nodes: Vec<(u64, String, String, u64)> = Vec::with_capacity(args.count as usize);
    let joiner = connect(&url, &join_token, &trust)?;
    let names: Vec<u64> = (0..args.count).collect();
    for chunk in names.chunks(64) {
        let mut calls = Vec::new();
        for &agent in chunk {
            let joiner = joiner.clone();
            let request = RegisterRequest {
                name: format!("bench-{agent:05}"),
                address: "127.0.0.1".to_string(),
                gpus: simulated_gpus(agent),
                cpu_milli: 64_000,
                memory_mib: 512 * 1024,
                pool: Some("muster-bench".to_string()),
                rack: None,
                backend: "simulated".to_string(),
                driver_version: None,
                cuda_version: None,
                stack: Default::default(),
            };
            calls.push(tokio::spawn(async move {
                let answer =
                    tokio::time::timeout(Duration::from_secs(30), joiner.register(&request)).await;
                (agent, request.name, answer)
            }));
        }
        for call in calls {
            let (agent, name, answer) = call.await.context("a registration task failed")?;
            match answer {
                Ok(Ok(answer)) => nodes.push((agent, name, answer.node_token, answer.epoch)),
                Ok(Err(error)) => {
                    return Err(anyhow!(error))
                        .with_context(|| format!("cannot register {name} at {url}"));
                }
                Err(_) => bail!("registering {name} at {url} took over 30 s"),
            }
        }
        if let Some(server) = server.as_mut() {
            server.process.check_alive(&server.log)?;
        }
    }
    eprintln!(
        "registered {} agents in {:.1} s",
        nodes.len(),
        registered_at.elapsed().as_secs_f64()
    );

    let measuring = Arc::new(AtomicBool::new(false));
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let count = nodes.len() as u64;
    let mut tasks = Vec::with_capacity(nodes.len());
    // Telemetry reports sent and refused in the window.
    let reports = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let report_errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let telemetry_ms = args.telemetry.as_millis() as u64;
    for (position, (_, name, token, epoch)) in nodes.into_iter().enumerate() {
        // Each agent its own client and connections, as real agents.
        let client = connect(&url, &token, &trust)?;
        if telemetry_ms > 0 {
            let client = client.clone();
            let name = name.clone();
            let mut stopped = stopped.clone();
            let measuring = measuring.clone();
            let (reports, report_errors) = (reports.clone(), report_errors.clone());
            let offset = Duration::from_millis(telemetry_ms * position as u64 / count);
            tokio::spawn(async move {
                tokio::select! {
                    _ = tokio::time::sleep(offset) => {}
                    _ = stopped.wait_for(|stop| *stop) => return,
                }
                let mut ticker = tokio::time::interval(Duration::from_millis(telemetry_ms));
                loop {
                    tokio::select! {
                        _ = ticker.tick() => {}
                        _ = stopped.wait_for(|stop| *stop) => return,
                    }
                    let report = bench_report(epoch, position as u32);
                    let sent = client.push_telemetry(&name, &report).await;
                    if measuring.load(Ordering::Relaxed) {
                        match sent {
                            Ok(_) => reports.fetch_add(1, Ordering::Relaxed),
                            Err(_) => report_errors.fetch_add(1, Ordering::Relaxed),
                        };
                    }
                }
            });
        }
        let measuring = measuring.clone();
        let mut stopped = stopped.clone();
        let mode = args.mode;
        // Spread over one interval, as a real fleet is.
        let offset = Duration::from_millis(heartbeat_ms * position as u64 / count);
        tasks.push(tokio::spawn(async move {
            let mut tally = AgentTally::default();
            tokio::select! {
                _ = tokio::time::sleep(offset) => {}
                _ = stopped.wait_for(|stop| *stop) => return tally,
            }
            let wait_ms = match mode {
                HeartbeatMode::LongPoll => heartbeat_ms,
                HeartbeatMode::Poll => 0,
            };
            let mut version = 0;
            let mut ticker = tokio::time::interval(Duration::from_millis(heartbeat_ms));
            ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                if mode == HeartbeatMode::Poll {
                    tokio::select! {
                        _ = ticker.tick() => {}
                        _ = stopped.wait_for(|stop| *stop) => return tally,
                    }
                }
                let request = HeartbeatRequest {
                    pulling: Vec::new(),
                    epoch,
                    observed: Vec::new(),
                    wait_ms,
                    known_version: version,
                    unhealthy_gpus: Vec::new(),
                    sequence: 0,
                };
                let sent = Instant::now();
                let answer = tokio::select! {
                    answer = client.heartbeat(&name, &request) => answer,
                    _ = stopped.wait_for(|stop| *stop) => return tally,
                };
                let took = sent.elapsed();
                let counted = measuring.load(Ordering::Relaxed);
                match answer {
                    Ok(answer) => {
                        version = answer.version;
                        if counted {
                            tally.latencies.push(took);
                            tally
                                .overshoot
                                .push(took.saturating_sub(Duration::from_millis(wait_ms)));
                        }
                    }
                    Err(error) => {
                        if counted {
                            tally.errors += 1;
                        }
                        tally.first_error.get_or_insert_with(|| error.to_string());
                        tokio::select! {
                            _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                            _ = stopped.wait_for(|stop| *stop) => return tally,
                        }
                    }
                }
            }
        }));
    }

    let (ticks_per_second, ticks_read) = clock_ticks();
    eprintln!(
        "heartbeating every {:?} ({:?}); warm-up {:?}, then measuring for {:?}; load average {}",
        args.heartbeat,
        args.mode,
        args.warmup,
        args.duration,
        load_average()
    );
    tokio::time::sleep(args.warmup).await;
    let load_before = load_average();
    let server_window = server_pid.map(CpuWindow::start).transpose()?;
    let own_window = CpuWindow::start(std::process::id())?;
    measuring.store(true, Ordering::Relaxed);
    let window_started = Instant::now();
    let mut remaining = args.duration;
    while !remaining.is_zero() {
        let step = remaining.min(Duration::from_secs(1));
        tokio::time::sleep(step).await;
        remaining -= step;
        if let Some(server) = server.as_mut() {
            server.process.check_alive(&server.log)?;
        }
    }
    measuring.store(false, Ordering::Relaxed);
    let window = window_started.elapsed().as_secs_f64();
    let server_cpu = server_window
        .as_ref()
        .map(|w| w.percent_of_core(ticks_per_second))
        .transpose()?;
    let own_cpu = own_window.percent_of_core(ticks_per_second)?;
    let server_memory = server_pid
        .map(|pid| Ok::<_, anyhow::Error>((status_kib(pid, "VmRSS")?, status_kib(pid, "VmHWM")?)))
        .transpose()?;
    let load_after = load_average();
    let _ = stop.send(true);
    let mut tally = AgentTally::default();
    for task in tasks {
        if let Ok(Ok(one)) = tokio::time::timeout(Duration::from_secs(15), task).await {
            tally.latencies.extend(one.latencies);
            tally.overshoot.extend(one.overshoot);
            tally.errors += one.errors;
            if tally.first_error.is_none() {
                tally.first_error = one.first_error;
            }
        }
    }

    let served = tally.latencies.0.len();
    println!(
        "muster bench agents: {count} agents x 8 simulated GPUs, heartbeat {:?} ({:?}), \
         window {window:.1} s",
        args.heartbeat, args.mode
    );
    println!(
        "  heartbeats served: {served} = {:.1}/s (expected {:.1}/s)",
        served as f64 / window,
        count as f64 * 1000.0 / heartbeat_ms as f64
    );
    match server_cpu {
        Some(cpu) => println!(
            "  server CPU: {cpu:.2}% of one core (utime+stime from /proc/{}/stat, {} ticks/s{})",
            server_pid.unwrap_or_default(),
            ticks_per_second,
            if ticks_read {
                ""
            } else {
                ", assumed: getconf CLK_TCK failed"
            }
        ),
        None => println!("  server CPU: not measured (pass --server-pid)"),
    }
    if let Some((rss, hwm)) = server_memory {
        println!(
            "  server memory: VmRSS {:.1} MiB (peak VmHWM {:.1} MiB)",
            mib(rss),
            mib(hwm)
        );
    }
    println!("  this process (the {count} simulated agents): {own_cpu:.1}% of one core");
    println!("  heartbeat round trip: {}", tally.latencies.summary());
    if args.mode == HeartbeatMode::LongPoll {
        println!(
            "  round trip minus the long poll's wait: {}",
            tally.overshoot.summary()
        );
    }
    if telemetry_ms > 0 {
        println!(
            "  telemetry reports served: {} = {:.1}/s (expected {:.1}/s), refused {}",
            reports.load(Ordering::Relaxed),
            reports.load(Ordering::Relaxed) as f64 / window,
            count as f64 * 1000.0 / telemetry_ms as f64,
            report_errors.load(Ordering::Relaxed)
        );
    }
    println!("  errors: {}", tally.errors);
    if let Some(first) = &tally.first_error {
        println!("  first error: {first}");
    }
    println!("  load average: {load_before} at the start, {load_after} at the end");
    if let Some(server) = &server {
        eprintln!(
            "(server log: {}; removed with {})",
            server.log.display(),
            server.data_dir.display()
        );
    }
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------
// muster bench idle-agent

async fn idle_agent(args: IdleAgentBench) -> Result<()> {
    let dir = temp_dir()?;
    let mut server = start_child_server(dir.path(), Duration::from_secs(10)).await?;
    let mut agent = start_child_agent(dir.path(), &server, &args.simulate_gpus).await?;
    let agent_log = dir.path().join("agent.log");
    let warmup = Duration::from_secs(5);
    eprintln!(
        "warm-up {warmup:?}, then measuring for {:?}; load average {}",
        args.duration,
        load_average()
    );
    tokio::time::sleep(warmup).await;
    let (ticks_per_second, ticks_read) = clock_ticks();
    let load_before = load_average();
    let agent_window = CpuWindow::start(agent.pid())?;
    let server_window = CpuWindow::start(server.process.pid())?;
    let deadline = Instant::now() + args.duration;
    while Instant::now() < deadline {
        tokio::time::sleep(
            deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(1)),
        )
        .await;
        agent.check_alive(&agent_log)?;
        server.process.check_alive(&server.log)?;
    }
    let agent_cpu = agent_window.percent_of_core(ticks_per_second)?;
    let server_cpu = server_window.percent_of_core(ticks_per_second)?;
    let rss = status_kib(agent.pid(), "VmRSS")?;
    let hwm = status_kib(agent.pid(), "VmHWM")?;
    println!(
        "muster bench idle-agent: one agent ({}), {:?} window",
        args.simulate_gpus, args.duration
    );
    println!(
        "  agent CPU: {agent_cpu:.3}% of one core ({} ticks/s{})",
        ticks_per_second,
        if ticks_read {
            ""
        } else {
            ", assumed: getconf CLK_TCK failed"
        }
    );
    println!(
        "  agent memory: VmRSS {:.1} MiB (peak VmHWM {:.1} MiB)",
        mib(rss),
        mib(hwm)
    );
    println!("  server CPU meanwhile: {server_cpu:.3}% of one core");
    println!(
        "  load average: {load_before} at the start, {} at the end",
        load_average()
    );
    drop(agent);
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------
// muster bench submit-to-running

fn is_terminal(state: &str) -> bool {
    matches!(
        state,
        "succeeded" | "failed" | "cancelled" | "timed_out" | "idle_stopped"
    )
}

async fn submit_to_running(args: SubmitToRunningBench) -> Result<()> {
    let dir = temp_dir()?;
    let mut server = start_child_server(dir.path(), Duration::from_secs(10)).await?;
    let mut agent = start_child_agent(dir.path(), &server, &args.simulate_gpus).await?;
    let agent_log = dir.path().join("agent.log");
    let client = server.client(&server.admin_token)?;
    let spec = serde_json::json!({
        "name": "bench-s2r",
        "command": ["sleep", "5"],
        "gpus": 1,
    });
    eprintln!(
        "submitting {} jobs one after the other; load average {}",
        args.count,
        load_average()
    );
    let load_before = load_average();
    let mut latencies = Latencies::default();
    let mut started = Latencies::default();
    let mut timeouts = 0u64;
    for _ in 0..args.count {
        let sent = Instant::now();
        let id = client
            .submit(spec.clone())
            .await
            .context("cannot submit the job")?;
        let deadline = sent + Duration::from_secs(30);
        let mut running = false;
        let mut task_running = false;
        while Instant::now() < deadline {
            let job = client.job(id).await.context("cannot read the job")?;
            if !running && job.state == "running" {
                latencies.push(sent.elapsed());
                running = true;
            }
            if running && !job.tasks.is_empty() && job.tasks.iter().all(|t| t.state == "running") {
                started.push(sent.elapsed());
                task_running = true;
                break;
            }
            if is_terminal(&job.state) {
                bail!("job {id} ended ({}) before it was seen running", job.state);
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if !running || !task_running {
            timeouts += 1;
        }
        client
            .cancel(id)
            .await
            .with_context(|| format!("cannot cancel job {id}"))?;
        // Back to an idle cluster before the next one.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let job = client.job(id).await.context("cannot read the job")?;
            if is_terminal(&job.state) {
                break;
            }
            if Instant::now() > deadline {
                bail!("job {id} did not end within 30 s of its cancellation");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agent.check_alive(&agent_log)?;
        server.process.check_alive(&server.log)?;
    }
    println!(
        "muster bench submit-to-running: {} jobs (sleep 5, 1 GPU), one agent ({})",
        args.count, args.simulate_gpus
    );
    println!(
        "  from before the submit request to GET /v1/jobs/ID showing running (polled every \
         10 ms): {}",
        latencies.summary()
    );
    println!(
        "  ... to its task showing running (the agent started the process and reported it): {}",
        started.summary()
    );
    println!("  not running within 30 s: {timeouts}");
    println!(
        "  load average: {load_before} at the start, {} at the end",
        load_average()
    );
    drop(agent);
    drop(server);
    Ok(())
}

async fn first_output(args: FirstOutputBench) -> Result<()> {
    let dir = temp_dir()?;
    let mut server = start_child_server(dir.path(), Duration::from_secs(10)).await?;
    let mut agent = start_child_agent(dir.path(), &server, "1xH100-80GB").await?;
    let agent_log = dir.path().join("agent.log");
    let client = server.client(&server.admin_token)?;
    let mut process = Latencies::default();
    let mut container = Latencies::default();
    for round in 0..args.count * 2 {
        let boxed = round % 2 == 1;
        let mut spec = serde_json::json!({
            "name": "bench-first-output",
            "command": ["sh", "-c", "echo first; sleep 30"],
        });
        if boxed {
            spec["image"] = serde_json::json!(args.image);
        }
        let sent = Instant::now();
        let id = client
            .submit(spec)
            .await
            .context("cannot submit the job (with --image, does the agent reach Docker?)")?;
        let deadline = sent + Duration::from_secs(60);
        loop {
            let logs = client.logs(id, 0, 0, None, false).await;
            if logs.is_ok_and(|logs| String::from_utf8_lossy(&logs.data).contains("first")) {
                let took = sent.elapsed();
                if boxed {
                    container.push(took);
                } else {
                    process.push(took);
                }
                break;
            }
            let job = client.job(id).await.context("cannot read the job")?;
            if is_terminal(&job.state) {
                bail!("job {id} ended ({}) before its first output", job.state);
            }
            if Instant::now() > deadline {
                bail!("job {id} wrote nothing within 60 s");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        client.cancel(id).await.context("cannot cancel")?;
        let deadline = Instant::now() + Duration::from_secs(60);
        while !is_terminal(&client.job(id).await.context("cannot read the job")?.state) {
            if Instant::now() > deadline {
                bail!("job {id} did not end within 60 s of its cancellation");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agent.check_alive(&agent_log)?;
        server.process.check_alive(&server.log)?;
    }
    println!(
        "muster bench first-output: {} jobs of each kind, alternating, one agent; from before \
         the submit request to `first` in the job's log (polled every 5 ms)",
        args.count
    );
    println!("  process:              {}", process.summary());
    println!("  container ({}): {}", args.image, container.summary());
    drop(agent);
    drop(server);
    Ok(())
}

// ---------------------------------------------------------------------------
// muster bench supervision, muster bench short-jobs

/// The pids of the supervisors of the agent whose state is `state_dir`
/// (command line `muster supervise STATE_DIR KEY`).
fn supervisors(state_dir: &Path) -> Vec<u32> {
    let wanted = [
        b"supervise".as_slice(),
        state_dir.as_os_str().as_encoded_bytes(),
    ];
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let arguments: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        if arguments.len() >= 3 && arguments[1] == wanted[0] && arguments[2] == wanted[1] {
            found.push(pid);
        }
    }
    found.sort_unstable();
    found
}

/// `Pss` and private (`Private_Clean` + `Private_Dirty`) memory of a
/// process, in KiB, from `/proc/PID/smaps_rollup`.
fn pss_and_private_kib(pid: u32) -> Result<(u64, u64)> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    let value = |key: &str| -> u64 {
        text.lines()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix(':'))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    Ok((
        value("Pss"),
        value("Private_Clean") + value("Private_Dirty"),
    ))
}

fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

async fn supervision(args: SupervisionBench) -> Result<()> {
    let dir = temp_dir()?;
    let mut server = start_child_server(dir.path(), Duration::from_secs(10)).await?;
    let mut agent = start_child_agent(dir.path(), &server, "8xH100-80GB").await?;
    let agent_log = dir.path().join("agent.log");
    let state_dir = dir.path().join("agent");
    let client = server.client(&server.admin_token)?;
    let spec = serde_json::json!({
        "name": "bench-supervision",
        "command": ["sleep", "100000"],
        "gpus": 0.125,
        "cpus": 0.01,
        "memory": "16MiB",
    });
    let mut ids = Vec::new();
    for _ in 0..args.tasks {
        ids.push(client.submit(spec.clone()).await.context("cannot submit")?);
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        agent.check_alive(&agent_log)?;
        server.process.check_alive(&server.log)?;
        let running = supervisors(&state_dir).len() as u64;
        if running >= args.tasks {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "only {running} of {} tasks run after 120 s (a 1/8-GPU task each on 8 GPUs \
                 fits 64); see {}",
                args.tasks,
                agent_log.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (ticks_per_second, ticks_read) = clock_ticks();
    let pids = supervisors(&state_dir);
    let load_before = load_average();
    let windows: Vec<CpuWindow> = pids
        .iter()
        .map(|&pid| CpuWindow::start(pid))
        .collect::<Result<_>>()?;
    let agent_window = CpuWindow::start(agent.pid())?;
    tokio::time::sleep(args.duration).await;
    let mut cpu = Vec::new();
    let mut pss = Vec::new();
    let mut private = Vec::new();
    let mut rss = Vec::new();
    for window in &windows {
        cpu.push(window.percent_of_core(ticks_per_second)?);
        let (p, u) = pss_and_private_kib(window.pid)?;
        pss.push(mib(p));
        private.push(mib(u));
        rss.push(mib(status_kib(window.pid, "VmRSS")?));
    }
    let agent_cpu = agent_window.percent_of_core(ticks_per_second)?;
    let total_cpu: f64 = cpu.iter().sum();
    let max_cpu = cpu.iter().copied().fold(0.0, f64::max);
    let total_pss: f64 = pss.iter().sum();
    println!(
        "muster bench supervision: {} tasks (sleep) through one agent, {} s window, load \
         average {load_before} before",
        pids.len(),
        args.duration.as_secs()
    );
    println!(
        "  per supervisor: CPU median {:.4}% of a core (max {:.4}%, all together {:.3}%; \
         one clock tick over the window is {:.4}%)",
        median(&mut cpu.clone()),
        max_cpu,
        total_cpu,
        100.0 / ticks_per_second / args.duration.as_secs_f64()
    );
    println!(
        "  per supervisor: memory median PSS {:.2} MiB, private {:.2} MiB, RSS {:.2} MiB \
         (RSS counts the binary's shared pages; all PSS together {:.1} MiB)",
        median(&mut pss),
        median(&mut private),
        median(&mut rss),
        total_pss
    );
    println!("  the agent meanwhile: {agent_cpu:.3}% of a core");
    if !ticks_read {
        println!("  (CLK_TCK could not be read; 100 assumed)");
    }
    for id in ids {
        let _ = client.cancel(id).await;
    }
    println!(
        "  supervisors left 60 s after cancelling every job: {}",
        supervisors_left(&state_dir, Duration::from_secs(60)).await
    );
    Ok(())
}

/// How many supervisors of the agent at `state_dir` still run after
/// waiting up to `limit` for them all to exit.
async fn supervisors_left(state_dir: &Path, limit: Duration) -> usize {
    let deadline = Instant::now() + limit;
    while !supervisors(state_dir).is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    supervisors(state_dir).len()
}

async fn short_jobs(args: ShortJobsBench) -> Result<()> {
    let dir = temp_dir()?;
    let mut server = start_child_server(dir.path(), Duration::from_secs(10)).await?;
    let mut agent = start_named_agent(
        dir.path(),
        &server,
        &args.simulate_gpus,
        "bench-agent",
        "agent",
        &args.agent_arg,
    )
    .await?;
    let agent_log = dir.path().join("agent.log");
    let state_dir = dir.path().join("agent");
    let client = server.client(&server.admin_token)?;
    let spec = serde_json::json!({
        "name": "bench-true",
        "command": ["true"],
        "gpus": 1,
        "cpus": 0.01,
        "memory": "16MiB",
    });
    let (ticks_per_second, _) = clock_ticks();
    let server_window = CpuWindow::start(server.process.pid())?;
    let agent_window = CpuWindow::start(agent.pid())?;
    let server_rss_before = status_kib(server.process.pid(), "VmRSS")?;
    let load_before = load_average();
    let started = Instant::now();
    let mut outstanding: std::collections::VecDeque<u64> = std::collections::VecDeque::new();
    let mut submitted = 0u64;
    let mut finished: Vec<u64> = Vec::new();
    let mut failed = 0u64;
    let mut last_progress = Instant::now();
    while finished.len() as u64 + failed < args.count {
        while submitted < args.count && (outstanding.len() as u64) < args.window {
            outstanding.push_back(client.submit(spec.clone()).await.context("cannot submit")?);
            submitted += 1;
        }
        // Jobs end about in submission order: look at the oldest.
        let Some(&oldest) = outstanding.front() else {
            break;
        };
        let job = client.job(oldest).await.context("cannot read a job")?;
        if is_terminal(&job.state) {
            outstanding.pop_front();
            match (job.state.as_str(), job.finished_ms) {
                ("succeeded", Some(at)) => finished.push(at),
                _ => failed += 1,
            }
            last_progress = Instant::now();
            continue;
        }
        if last_progress.elapsed() > Duration::from_secs(60) {
            bail!(
                "no job ended for 60 s (job {oldest} is {}); see {}",
                job.state,
                agent_log.display()
            );
        }
        agent.check_alive(&agent_log)?;
        server.process.check_alive(&server.log)?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    let server_cpu = server_window.percent_of_core(ticks_per_second)?;
    let agent_cpu = agent_window.percent_of_core(ticks_per_second)?;
    let server_rss_after = status_kib(server.process.pid(), "VmRSS")?;
    finished.sort_unstable();
    let rate = |slice: &[u64]| -> f64 {
        match (slice.first(), slice.last()) {
            (Some(first), Some(last)) if last > first => {
                (slice.len() - 1) as f64 / ((last - first) as f64 / 1000.0)
            }
            _ => f64::NAN,
        }
    };
    let block = 1000.min(finished.len());
    println!(
        "muster bench short-jobs: {} jobs of `true` (1 GPU each) through one agent ({}), at \
         most {} outstanding; load average {load_before} before",
        args.count, args.simulate_gpus, args.window
    );
    println!(
        "  {:.1} s in all: {:.1} jobs/s; succeeded {}, otherwise {failed}",
        elapsed.as_secs_f64(),
        args.count as f64 / elapsed.as_secs_f64(),
        finished.len()
    );
    println!(
        "  jobs/s by the server's end times: first {block} {:.1}, last {block} {:.1}",
        rate(&finished[..block]),
        rate(&finished[finished.len() - block..])
    );
    println!(
        "  CPU over the run: server {server_cpu:.1}%, agent {agent_cpu:.1}% of a core; server \
         RSS {:.1} -> {:.1} MiB",
        mib(server_rss_before),
        mib(server_rss_after)
    );
    println!(
        "  supervisors left afterwards: {}",
        supervisors_left(&state_dir, Duration::from_secs(10)).await
    );
    Ok(())
}

/// The p-th percentile (0 to 100) of sorted durations, in milliseconds.
fn percentile_ms(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)].as_secs_f64() * 1000.0
}

/// One measurement of `muster bench history`.
struct HistoryPoint {
    finished: u64,
    jobs_per_second: f64,
    rss_mib: f64,
    heartbeat: (f64, f64),
    list: (f64, f64),
    list_succeeded: (f64, f64),
}

async fn history(args: HistoryBench) -> Result<()> {
    let dir = temp_dir()?;
    let extra = vec!["--retention".to_string(), args.retention.clone()];
    let mut server = start_child_server_with(dir.path(), Duration::from_secs(10), &extra).await?;
    let mut agents = Vec::new();
    for index in 0..args.agents {
        let name = format!("bench-{index}");
        agents
            .push(start_named_agent(dir.path(), &server, "8xH100-80GB", &name, &name, &[]).await?);
    }
    let client = server.client(&server.admin_token)?;
    // A probe node that takes no work: its heartbeats go the way every
    // agent's do (lock, the control plane, the durability barrier).
    let joiner = server.client(&server.join_token)?;
    let probe = joiner
        .register(&RegisterRequest {
            name: "bench-probe".to_string(),
            address: "127.0.0.1".to_string(),
            gpus: Vec::new(),
            cpu_milli: 1000,
            memory_mib: 1024,
            pool: Some("muster-bench-probe".to_string()),
            rack: None,
            backend: "simulated".to_string(),
            driver_version: None,
            cuda_version: None,
            stack: Default::default(),
        })
        .await
        .context("cannot register the probe node")?;
    let probe_client = server.client(&probe.node_token)?;
    let spec = serde_json::json!({
        "name": "bench-true",
        "command": ["true"],
        "gpus": 1,
        "cpus": 0.01,
        "memory": "16MiB",
    });
    let checkpoints: Vec<u64> = [10, 50, 100]
        .iter()
        .map(|percent| (args.count * percent / 100).max(1))
        .collect();
    let load_before = load_average();
    let started = Instant::now();
    let mut outstanding: std::collections::VecDeque<u64> = std::collections::VecDeque::new();
    let mut submitted = 0u64;
    let mut ended = 0u64;
    let mut failed = 0u64;
    let mut points = Vec::new();
    let mut sequence = 0u64;
    let mut segment = (Instant::now(), 0u64);
    let mut last_progress = Instant::now();
    while ended < args.count {
        while submitted < args.count && (outstanding.len() as u64) < args.window {
            outstanding.push_back(client.submit(spec.clone()).await.context("cannot submit")?);
            submitted += 1;
        }
        let Some(&oldest) = outstanding.front() else {
            break;
        };
        let job = client.job(oldest).await.context("cannot read a job")?;
        if is_terminal(&job.state) {
            outstanding.pop_front();
            ended += 1;
            if job.state != "succeeded" {
                failed += 1;
            }
            last_progress = Instant::now();
            if checkpoints.contains(&ended) {
                let rate = (ended - segment.1) as f64 / segment.0.elapsed().as_secs_f64();
                // Heartbeats: 2,000 in a row, answered at once (enough that
                // the 99th percentile is not the second-worst sample).
                let mut beats = Vec::with_capacity(HISTORY_BEATS);
                for _ in 0..HISTORY_BEATS {
                    sequence += 1;
                    let request = HeartbeatRequest {
                        pulling: Vec::new(),
                        epoch: probe.epoch,
                        observed: Vec::new(),
                        wait_ms: 0,
                        known_version: 0,
                        unhealthy_gpus: Vec::new(),
                        sequence,
                    };
                    let sent = Instant::now();
                    probe_client
                        .heartbeat("bench-probe", &request)
                        .await
                        .context("a probe heartbeat failed")?;
                    beats.push(sent.elapsed());
                }
                beats.sort_unstable();
                let time_list = async |filter: &JobFilter| -> Result<(f64, f64)> {
                    let mut took = Vec::with_capacity(HISTORY_LISTS);
                    for _ in 0..HISTORY_LISTS {
                        let sent = Instant::now();
                        client.jobs(filter).await.context("cannot list jobs")?;
                        took.push(sent.elapsed());
                    }
                    took.sort_unstable();
                    Ok((percentile_ms(&took, 50.0), percentile_ms(&took, 99.0)))
                };
                let list = time_list(&JobFilter::default()).await?;
                let list_succeeded = time_list(&JobFilter {
                    state: Some("succeeded".to_string()),
                    ..JobFilter::default()
                })
                .await?;
                let point = HistoryPoint {
                    finished: ended,
                    jobs_per_second: rate,
                    rss_mib: mib(status_kib(server.process.pid(), "VmRSS")?),
                    heartbeat: (percentile_ms(&beats, 50.0), percentile_ms(&beats, 99.0)),
                    list,
                    list_succeeded,
                };
                eprintln!(
                    "{} finished: {:.1} jobs/s, server RSS {:.1} MiB, heartbeat p50 {:.2} ms \
                     p99 {:.2} ms, GET /v1/jobs p50 {:.2} ms",
                    point.finished,
                    point.jobs_per_second,
                    point.rss_mib,
                    point.heartbeat.0,
                    point.heartbeat.1,
                    point.list.0
                );
                points.push(point);
                segment = (Instant::now(), ended);
            }
            continue;
        }
        if last_progress.elapsed() > Duration::from_secs(60) {
            bail!(
                "no job ended for 60 s (job {oldest} is {}); see the logs in {}",
                job.state,
                dir.path().display()
            );
        }
        for (index, agent) in agents.iter_mut().enumerate() {
            agent.check_alive(&dir.path().join(format!("bench-{index}.log")))?;
        }
        server.process.check_alive(&server.log)?;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = started.elapsed();
    println!(
        "muster bench history: {} jobs of `true` (1 GPU each) through {} agents (8 simulated \
         GPUs each), at most {} outstanding, retention {}; load average {load_before} before",
        args.count, args.agents, args.window, args.retention
    );
    println!(
        "  {:.1} s in all ({:.1} jobs/s); not succeeded: {failed}",
        elapsed.as_secs_f64(),
        args.count as f64 / elapsed.as_secs_f64()
    );
    println!(
        "  {:>9} {:>8} {:>8} {:>17} {:>17} {:>25}",
        "finished",
        "jobs/s",
        "RSS MiB",
        "heartbeat p50/p99",
        "GET /v1/jobs p50/p99",
        "?state=succeeded p50/p99"
    );
    for point in &points {
        println!(
            "  {:>9} {:>8.1} {:>8.1} {:>8.2}/{:<8.2} {:>9.2}/{:<10.2} {:>12.2}/{:<12.2}",
            point.finished,
            point.jobs_per_second,
            point.rss_mib,
            point.heartbeat.0,
            point.heartbeat.1,
            point.list.0,
            point.list.1,
            point.list_succeeded.0,
            point.list_succeeded.1
        );
    }
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        println!(
            "  last / first: jobs/s {:.2}, RSS {:.2}, heartbeat p99 {:.2}, GET /v1/jobs p50 {:.2}",
            last.jobs_per_second / first.jobs_per_second,
            last.rss_mib / first.rss_mib,
            last.heartbeat.1 / first.heartbeat.1,
            last.list.0 / first.list.0
        );
    }
    Ok(())
}

/// One scheduling cycle of the control plane, as the server runs it, over
/// simulated nodes and pending jobs shaped as the engine's own benchmark.
/// Probe heartbeats and `GET /v1/jobs` calls timed at each checkpoint of
/// `muster bench history`.
const HISTORY_BEATS: usize = 2_000;
const HISTORY_LISTS: usize = 100;

fn metrics(args: MetricsBench) -> Result<()> {
    use muster_api::protocol::{GpuSample, InterfaceSample, NodeSample, TelemetryReport};
    use muster_control::{ControlConfig, ControlPlane, Input, Software};
    use muster_model::{
        CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, JobSpec, MemoryMib, NodeName, NodeSpec,
        PoolName, QueueName, RackName, Time,
    };
    use rand::SeedableRng;
    if args.jobs > args.nodes * 8 {
        bail!(
            "--jobs {} is more than the {} GPUs",
            args.jobs,
            args.nodes * 8
        );
    }
    let mut control = ControlPlane::new(ControlConfig::default());
    let now = Time(1_000_000);
    let mut telemetry = std::collections::BTreeMap::new();
    for index in 0..args.nodes {
        let name = format!("node-{index:05}");
        let spec = NodeSpec {
            name: NodeName(name.clone()),
            pool: PoolName::from(if index % 2 == 0 {
                "training"
            } else {
                "default"
            }),
            rack: RackName(format!("rack-{:04}", index / 16)),
            gpus: (0..8)
                .map(|gpu| GpuSpec {
                    index: gpu,
                    uuid: format!("GPU-{name}-{gpu}"),
                    model: GpuModel::new("H100-80GB"),
                    memory: MemoryMib(81_920),
                    nvlink_domain: 0,
                })
                .collect(),
            cpu: CpuMilli(96_000),
            memory: MemoryMib(1_048_576),
        };
        control
            .handle(
                now,
                Input::Register {
                    spec,
                    address: "10.0.0.1".to_string(),
                    software: Software::default(),
                },
            )
            .map_err(|error| anyhow!("{error}"))?;
        let epoch = control
            .node(&NodeName(name.clone()))
            .map_or(0, |node| node.epoch);
        telemetry.insert(
            name,
            muster_server::metrics::NodeTelemetry {
                received_ms: now.0,
                report: TelemetryReport {
                    epoch,
                    sampled_ms: now.0,
                    gpus: (0..8)
                        .map(|gpu| GpuSample {
                            index: gpu,
                            utilization_pct: (index as u32 * 7 + gpu * 13) % 101,
                            memory_used_mib: 40_000,
                            memory_total_mib: 81_920,
                            power_watts: Some(420.5),
                            temperature_c: Some(62),
                            sm_clock_mhz: Some(1_980),
                            ecc_uncorrected: Some(0),
                            xid: None,
                            pcie_tx_bytes: None,
                            pcie_rx_bytes: None,
                            healthy: true,
                        })
                        .collect(),
                    node: NodeSample {
                        cpu_busy_pct: Some(37.5),
                        memory_used_mib: Some(200_000),
                        memory_total_mib: Some(1_048_576),
                        network: ["eth0", "ib0"]
                            .iter()
                            .map(|name| InterfaceSample {
                                interface: name.to_string(),
                                receive_bytes: 1 << 40,
                                transmit_bytes: 1 << 39,
                            })
                            .collect(),
                    },
                },
            },
        );
    }
    for id in 1..=args.jobs {
        let mut spec = JobSpec::simple("bench", "team-0", GpuRequest::Whole(1), vec!["x".into()]);
        spec.queue = QueueName(format!("team-{}", id % 8));
        spec.cpu_per_node = CpuMilli(1_000);
        control
            .handle(
                now,
                Input::Submit {
                    id: JobId(id),
                    spec,
                    user: format!("user-{}", id % 50),
                },
            )
            .map_err(|error| anyhow!("{error}"))?;
    }
    let (snapshot, pending) = control.scheduling_input(now);
    let outcome = muster_sched::schedule(
        &snapshot,
        &pending,
        &muster_sched::SchedulingPolicy::default(),
        &mut rand_chacha::ChaCha8Rng::seed_from_u64(7),
    )
    .map_err(|error| anyhow!("{error}"))?;
    control.apply_outcome(now, &outcome);
    // The agents say their tasks run (the accounting charges running ones).
    let names: Vec<NodeName> = control.nodes().map(|n| n.spec.name.clone()).collect();
    for name in names {
        let observed: Vec<muster_control::Observed> = control
            .desired(&name)
            .into_iter()
            .map(|task| muster_control::Observed {
                allocation: task.allocation,
                generation: task.generation,
                exited: None,
                fenced: false,
                memory_limit: false,
            })
            .collect();
        let epoch = control.node(&name).map_or(0, |node| node.epoch);
        control
            .handle(
                now,
                Input::Heartbeat {
                    node: name,
                    epoch,
                    sequence: 0,
                    observed,
                    unhealthy: None,
                },
            )
            .map_err(|error| anyhow!("{error}"))?;
    }
    let mut times = Vec::new();
    let mut bytes = 0;
    let mut lines = 0;
    for _ in 0..args.scrapes {
        let started = Instant::now();
        let text = muster_server::metrics::render(
            &control,
            &telemetry,
            &muster_server::metrics::UsageByNode::new(),
            muster_server::DEFAULT_IDLE_AFTER_MS,
            &muster_server::metrics::Instruments::default(),
            &std::collections::BTreeMap::new(),
            now.0,
        );
        times.push(started.elapsed());
        bytes = text.len();
        lines = text.lines().filter(|line| !line.starts_with('#')).count();
    }
    times.sort_unstable();
    println!(
        "muster bench metrics: {} nodes x 8 GPUs, {} running jobs: {} series, {:.1} MiB; \
         render median {:.1} ms (p90 {:.1} ms, min {:.1} ms) over {} scrapes",
        args.nodes,
        outcome.started.len(),
        lines,
        bytes as f64 / (1024.0 * 1024.0),
        percentile_ms(&times, 50.0),
        percentile_ms(&times, 90.0),
        percentile_ms(&times, 0.0),
        args.scrapes
    );
    accounting(&control)
}

/// The GPU accounting at this size: the server's once-a-second charge of
/// every running task, and writing a minute's rows to a real store.
fn accounting(control: &muster_control::ControlPlane) -> Result<()> {
    use muster_control::accounting::{Ledger, MINUTE_MS};
    use muster_server::store::{Batch, SqlStore, Store};
    let start = 1_000_000 * MINUTE_MS;
    let mut ledger = Ledger::default();
    ledger.accrue(control, start);
    let mut ticks = Vec::new();
    let mut minutes = Vec::new();
    for second in 1..=180 {
        let started = Instant::now();
        let closed = ledger.accrue(control, start + second * 1_000);
        ticks.push(started.elapsed());
        if !closed.is_empty() {
            minutes.push(closed);
        }
    }
    ticks.sort_unstable();
    let dir = tempfile::tempdir().context("a temporary directory")?;
    let rows = minutes.first().map_or(0, Vec::len);
    // On a thread of its own: the benchmarks run inside a runtime already.
    let path = dir.path().to_path_buf();
    let mut writes = std::thread::spawn(move || -> Result<Vec<Duration>> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("a runtime")?;
        rt.block_on(async {
            let store = SqlStore::open(&path).await?;
            let mut writes = Vec::new();
            for minute in minutes {
                let batch = Batch {
                    usage: minute,
                    ..Batch::default()
                };
                let started = Instant::now();
                store.write(&batch).await?;
                writes.push(started.elapsed());
            }
            store.close().await;
            Ok(writes)
        })
    })
    .join()
    .map_err(|_| anyhow!("the store benchmark panicked"))??;
    writes.sort_unstable();
    println!(
        "muster bench metrics: accounting of {} running tasks: a charge median {:.2} ms \
         (p90 {:.2} ms, max {:.2} ms, the minute's close included) over {} seconds; a \
         minute's {rows} rows written in {:.1} ms (median of {})",
        ledger.open_accounts(),
        percentile_ms(&ticks, 50.0),
        percentile_ms(&ticks, 90.0),
        percentile_ms(&ticks, 100.0),
        ticks.len(),
        percentile_ms(&writes, 50.0),
        writes.len()
    );
    Ok(())
}

fn cycle(args: CycleBench) -> Result<()> {
    use muster_control::{ControlConfig, ControlPlane, Input, Software};
    use muster_model::{
        CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, JobSpec, MemoryMib, NodeName, NodeSpec,
        PoolName, QueueName, RackName, Time,
    };
    use rand::{Rng, SeedableRng};
    const MODELS: [&str; 5] = ["G2", "G3", "V100M32", "V100M16", "T4"];
    const MODEL_WEIGHTS: [u32; 5] = [55, 10, 15, 10, 10];
    let text = std::fs::read_to_string(&args.tasks)
        .with_context(|| format!("cannot read the task shapes {}", args.tasks.display()))?;
    let shapes = muster_sim::trace::parse_openb_tasks(&text, &args.tasks.display().to_string())
        .map_err(|error| anyhow!("{error}"))?;
    if shapes.is_empty() {
        bail!("{} lists no tasks", args.tasks.display());
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut control = ControlPlane::new(ControlConfig::default());
    let now = Time(1_000_000);
    let built = Instant::now();
    let total: u32 = MODEL_WEIGHTS.iter().sum();
    for index in 0..args.nodes {
        let mut pick = rng.random_range(0..total);
        let mut model = 0;
        while pick >= MODEL_WEIGHTS[model] {
            pick -= MODEL_WEIGHTS[model];
            model += 1;
        }
        let name = format!("node-{index:05}");
        let spec = NodeSpec {
            name: NodeName(name.clone()),
            pool: PoolName::from("default"),
            rack: RackName(format!("rack-{:04}", index / 16)),
            gpus: (0..8)
                .map(|gpu| GpuSpec {
                    index: gpu,
                    uuid: format!("GPU-{name}-{gpu}"),
                    model: GpuModel::new(MODELS[model]),
                    memory: MemoryMib(32 * 1024),
                    nvlink_domain: gpu / 4,
                })
                .collect(),
            cpu: CpuMilli(96_000),
            memory: MemoryMib(393_216),
        };
        control
            .handle(
                now,
                Input::Register {
                    spec,
                    address: "10.0.0.1".to_string(),
                    software: Software::default(),
                },
            )
            .map_err(|error| anyhow!("{error}"))?;
    }
    let job_of = |id: u64, rng: &mut rand_chacha::ChaCha8Rng| {
        let gang = id.is_multiple_of(200);
        let mut spec = if gang {
            let mut spec = JobSpec::simple(
                "bench-gang",
                "team-0",
                GpuRequest::Whole(8),
                vec!["true".into()],
            );
            spec.nodes = rng.random_range(2..=4);
            spec.cpu_per_node = CpuMilli(32_000);
            spec.memory_per_node = MemoryMib(65_536);
            spec
        } else {
            let task = &shapes[rng.random_range(0..shapes.len())];
            let mut spec = JobSpec::simple("bench", "team-0", task.gpus, vec!["true".into()]);
            spec.cpu_per_node = task.cpu;
            spec.memory_per_node = task.memory;
            spec.gpu_models = task.gpu_models.clone();
            spec
        };
        spec.queue = QueueName(format!("team-{}", id % 4));
        spec
    };
    for id in 1..=args.pending {
        let spec = job_of(id, &mut rng);
        control
            .handle(
                Time(now.0 + id),
                Input::Submit {
                    id: JobId(id),
                    spec,
                    user: "bench".to_string(),
                },
            )
            .map_err(|error| anyhow!("{error}"))?;
    }
    let mut next_id = args.pending + 1;
    eprintln!(
        "built {} nodes and {} pending jobs in {:.1} s",
        args.nodes,
        args.pending,
        built.elapsed().as_secs_f64()
    );
    // What each submission pays for the check that some node could ever
    // hold it (`ControlPlane::never_fits`), at this many nodes.
    let probe = JobSpec::simple("probe", "team-0", GpuRequest::Whole(1), vec!["true".into()]);
    let mut checks: Vec<Duration> = (0..100)
        .map(|_| {
            let started = Instant::now();
            std::hint::black_box(control.never_fits(&probe));
            started.elapsed()
        })
        .collect();
    checks.sort_unstable();
    let policy = muster_sched::SchedulingPolicy::default();
    println!(
        "submit-time check (could any node ever hold the job): {:.3} ms per submission \
         (median of 100, p99 {:.3} ms)",
        percentile_ms(&checks, 50.0),
        percentile_ms(&checks, 99.0)
    );
    println!(
        "muster bench cycle: {} nodes (8 GPUs each), {} pending jobs shaped like {} (+0.5% \
         gangs), policy {:?}",
        args.nodes,
        args.pending,
        args.tasks.display(),
        policy.placement
    );
    println!(
        "  {:>5} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "cycle", "snapshot s", "engine s", "apply s", "total s", "started", "ended+new"
    );
    for number in 1..=args.cycles {
        let at = Time(now.0 + args.pending + number * 1000);
        // A second of a busy cluster: some jobs end, as many arrive.
        let mut churned = 0;
        if number > 1 && args.churn > 0 {
            let ending: Vec<(NodeName, muster_control::Observed)> = control
                .running_allocations()
                .take(args.churn as usize)
                .map(|a| {
                    (
                        a.node.clone(),
                        muster_control::Observed {
                            allocation: a.id,
                            generation: a.generation,
                            exited: Some(Some(0)),
                            fenced: false,
                            memory_limit: false,
                        },
                    )
                })
                .collect();
            for (node, observed) in ending {
                let epoch = control.node(&node).map_or(0, |n| n.epoch);
                control
                    .handle(
                        at,
                        Input::Heartbeat {
                            node,
                            epoch,
                            sequence: 0,
                            observed: vec![observed],
                            unhealthy: None,
                        },
                    )
                    .map_err(|error| anyhow!("{error}"))?;
            }
            for _ in 0..args.churn {
                let spec = job_of(next_id, &mut rng);
                control
                    .handle(
                        at,
                        Input::Submit {
                            id: JobId(next_id),
                            spec,
                            user: "bench".to_string(),
                        },
                    )
                    .map_err(|error| anyhow!("{error}"))?;
                next_id += 1;
            }
            churned = args.churn;
        }
        let started = Instant::now();
        let (snapshot, pending) = control.scheduling_input(at);
        let snapshot_took = started.elapsed();
        let engine = Instant::now();
        let outcome = muster_sched::schedule(&snapshot, &pending, &policy, &mut rng)
            .map_err(|error| anyhow!("{error}"))?;
        let engine_took = engine.elapsed();
        let apply = Instant::now();
        control.apply_outcome(at, &outcome);
        let apply_took = apply.elapsed();
        println!(
            "  {number:>5} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>9} {:>9}",
            snapshot_took.as_secs_f64(),
            engine_took.as_secs_f64(),
            apply_took.as_secs_f64(),
            started.elapsed().as_secs_f64(),
            outcome.started.len(),
            churned
        );
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Gateway overhead

/// A minimal HTTP/1.1 backend on loopback (hyper) answering every request
/// with `reply` bytes.
async fn backend(reply: bytes::Bytes) -> Result<std::net::SocketAddr> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let _ = stream.set_nodelay(true);
            let reply = reply.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_request| {
                    let reply = reply.clone();
                    async move {
                        Ok::<_, std::convert::Infallible>(hyper::Response::new(
                            http_body_util::Full::new(reply),
                        ))
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(addr)
}

/// `requests` GETs of `url` from `clients` clients; latencies and
/// requests/s.
async fn get_load(url: &str, clients: u64, requests: u64) -> Result<(Latencies, f64)> {
    let remaining = Arc::new(std::sync::atomic::AtomicU64::new(requests));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..clients {
        let remaining = remaining.clone();
        let url = url.to_string();
        tasks.push(tokio::spawn(async move {
            let http = reqwest::Client::builder()
                .no_proxy()
                .tcp_nodelay(true)
                .build()
                .context("an HTTP client")?;
            let mut latencies = Latencies::default();
            while remaining
                .fetch_update(
                    std::sync::atomic::Ordering::Relaxed,
                    std::sync::atomic::Ordering::Relaxed,
                    |left| left.checked_sub(1),
                )
                .is_ok()
            {
                let sent = Instant::now();
                let response = http.get(&url).send().await.context("a GET")?;
                anyhow::ensure!(
                    response.status().is_success(),
                    "{url} answered {}",
                    response.status()
                );
                response.bytes().await.context("a reply")?;
                latencies.push(sent.elapsed());
            }
            Ok::<Latencies, anyhow::Error>(latencies)
        }));
    }
    let mut all = Latencies::default();
    for task in tasks {
        all.extend(task.await.context("a client task")??);
    }
    let rate = requests as f64 / started.elapsed().as_secs_f64();
    Ok((all, rate))
}

/// One round of `muster bench gateway`: direct p50, p99 (ms) and rate,
/// then the same through the gateway.
type GatewayRound = (f64, f64, f64, f64, f64, f64);

async fn gateway(args: GatewayBench) -> Result<()> {
    // reqwest's TLS needs the process's cryptography chosen (plain HTTP
    // here, but the client is built with TLS support).
    muster_api::tls::provider();
    let reply = bytes::Bytes::from(vec![b'x'; args.reply_bytes as usize]);
    let backend = backend(reply).await?;
    let table = muster_api::protocol::EndpointTable {
        instance: 0,
        version: 1,
        auth: Default::default(),
        services: std::collections::BTreeMap::from([(
            "bench".to_string(),
            vec![muster_api::protocol::Endpoint {
                job: 1,
                revision: 1,
                address: backend.to_string(),
            }],
        )]),
    };
    let gateway = muster_server::gateway::start(
        muster_server::gateway::GatewayConfig {
            listen: "127.0.0.1:0".parse()?,
            upstream_timeout: Duration::from_secs(30),
            hold: Duration::ZERO,
            domain: None,
        },
        muster_server::gateway::Endpoints::Fixed(table),
    )
    .await?;
    let direct_url = format!("http://{backend}/hello");
    let gateway_url = format!("http://{}/bench/hello", gateway.addr);
    // Warm both paths (connections, pools) before measuring.
    get_load(&direct_url, args.clients, 200).await?;
    get_load(&gateway_url, args.clients, 200).await?;
    println!(
        "{} clients, {} GETs a round, {} rounds of each path alternating, {}-byte replies",
        args.clients, args.requests, args.rounds, args.reply_bytes
    );
    let mut rows: Vec<GatewayRound> = Vec::new();
    for round in 1..=args.rounds {
        let (mut direct, direct_rate) = get_load(&direct_url, args.clients, args.requests).await?;
        let (mut via, via_rate) = get_load(&gateway_url, args.clients, args.requests).await?;
        let row = (
            direct.percentile_ms(50.0),
            direct.percentile_ms(99.0),
            direct_rate,
            via.percentile_ms(50.0),
            via.percentile_ms(99.0),
            via_rate,
        );
        println!(
            "round {round}: direct p50 {:.3} ms p99 {:.3} ms {:.0}/s; gateway p50 {:.3} ms p99 {:.3} ms {:.0}/s; added p50 {:.3} ms p99 {:.3} ms",
            row.0,
            row.1,
            row.2,
            row.3,
            row.4,
            row.5,
            row.3 - row.0,
            row.4 - row.1
        );
        rows.push(row);
    }
    let column = |pick: fn(&GatewayRound) -> f64| {
        let mut values: Vec<f64> = rows.iter().map(pick).collect();
        median(&mut values)
    };
    let added_p50 = column(|row| row.3 - row.0);
    let added_p99 = column(|row| row.4 - row.1);
    println!(
        "median of rounds: direct p50 {:.3} ms p99 {:.3} ms {:.0}/s; gateway p50 {:.3} ms p99 {:.3} ms {:.0}/s",
        column(|row| row.0),
        column(|row| row.1),
        column(|row| row.2),
        column(|row| row.3),
        column(|row| row.4),
        column(|row| row.5)
    );
    println!(
        "added by the gateway (median of rounds): p50 {added_p50:.3} ms, p99 {added_p99:.3} ms \
         (target p99 under 2 ms: {}); gateway at {:.0}% of the direct rate",
        if added_p99 < 2.0 { "met" } else { "not met" },
        100.0 * column(|row| row.5) / column(|row| row.2)
    );
    gateway.stop().await;
    Ok(())
}

// ---------------------------------------------------------------------------
// A replica's death

/// The pids of the processes whose environment names job `job` and whose
/// command starts with `program`.
fn pids_of_job(job: u64, program: &str) -> Vec<i32> {
    let marker = format!("MUSTER_JOB_ID={job}\0");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let pid: i32 = entry.file_name().to_str()?.parse().ok()?;
            let environ = std::fs::read(entry.path().join("environ")).ok()?;
            let cmdline = std::fs::read(entry.path().join("cmdline")).ok()?;
            (String::from_utf8_lossy(&environ).contains(&marker)
                && String::from_utf8_lossy(&cmdline).starts_with(program))
            .then_some(pid)
        })
        .collect()
}

async fn replica_death(args: ReplicaDeathBench) -> Result<()> {
    muster_api::tls::provider();
    let dir = temp_dir()?;
    let mut server = start_child_server(dir.path(), Duration::from_secs(10)).await?;
    let mut agent = start_child_agent(dir.path(), &server, "1xH100-80GB").await?;
    let agent_log = dir.path().join("agent.log");
    let client = server.client(&server.admin_token)?;
    let spec = serde_json::json!({
        "kind": "service",
        "name": "bench-web",
        "replicas": 3,
        "gpus": 0,
        "cpus": 0.25,
        "memory": "256MiB",
        // http.server takes its port as its last argument.
        "command": ["sh", "-c", "exec python3 -m http.server --bind 127.0.0.1 \"$PORT\""],
        "readiness": {"http": "/", "period": 1, "timeout": 1, "failure_threshold": 1},
        "restart": {"initial": 1, "max": 4},
        "drain": 1,
    });
    client
        .create_service(spec)
        .await
        .context("cannot create the service")?;
    let gateway = muster_server::gateway::start(
        muster_server::gateway::GatewayConfig {
            listen: "127.0.0.1:0".parse()?,
            upstream_timeout: Duration::from_secs(30),
            hold: Duration::from_secs(10),
            domain: None,
        },
        muster_server::gateway::Endpoints::Server(client.clone()),
    )
    .await?;
    let url = format!("http://{}/bench-web/", gateway.addr);
    let ready = |view: &muster_api::protocol::ServiceView| view.ready;
    let mut out = Latencies::default();
    let mut replaced = Latencies::default();
    let failures = Arc::new(AtomicU64::new(0));
    let answered = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut load = Vec::new();
    for _ in 0..args.clients {
        let (failures, answered, stop, url) = (
            failures.clone(),
            answered.clone(),
            stop.clone(),
            url.clone(),
        );
        load.push(tokio::spawn(async move {
            let http = match reqwest::Client::builder().no_proxy().build() {
                Ok(http) => http,
                Err(_) => return,
            };
            while !stop.load(Ordering::Relaxed) {
                match http.get(&url).send().await {
                    Ok(response) if response.status().is_success() => {
                        let _ = response.bytes().await;
                        answered.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        failures.fetch_add(1, Ordering::Relaxed);
                        // Before the first replica is ready, or a real failure.
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                }
            }
        }));
    }
    let mut counted_failures = 0u64;
    for round in 1..=args.rounds {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let view = client.service("bench-web").await?;
            if ready(&view) == 3 && view.replica_list.len() == 3 {
                break;
            }
            if Instant::now() > deadline {
                bail!("the service did not get 3 ready replicas within 60 s: {view:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Let the gateway learn the table, then count from here.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = failures.load(Ordering::Relaxed);
        let view = client.service("bench-web").await?;
        let victim = view.replica_list[0].job;
        let pids = pids_of_job(victim, "python3");
        if pids.is_empty() {
            bail!("the process of replica job {victim} was not found");
        }
        let killed = Instant::now();
        for pid in pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let mut gone = None;
        loop {
            if gone.is_none() {
                let endpoints = client.service_endpoints("bench-web").await?;
                if !endpoints
                    .endpoints
                    .iter()
                    .any(|endpoint| endpoint.job == victim)
                {
                    gone = Some(killed.elapsed());
                }
            }
            let view = client.service("bench-web").await?;
            if gone.is_some()
                && ready(&view) == 3
                && !view
                    .replica_list
                    .iter()
                    .any(|replica| replica.job == victim)
            {
                break;
            }
            if killed.elapsed() > Duration::from_secs(60) {
                bail!("no replacement ready within 60 s of the kill: {view:?}");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let ready_after = killed.elapsed();
        let failed = failures.load(Ordering::Relaxed) - before;
        counted_failures += failed;
        let gone = gone.unwrap_or(ready_after);
        println!(
            "round {round}: out of the endpoints after {:.1} ms, a replacement ready after {:.0} ms, {failed} requests failed",
            gone.as_secs_f64() * 1000.0,
            ready_after.as_secs_f64() * 1000.0
        );
        out.push(gone);
        replaced.push(ready_after);
        agent.check_alive(&agent_log)?;
        server.process.check_alive(&server.log)?;
    }
    stop.store(true, Ordering::Relaxed);
    for task in load {
        let _ = task.await;
    }
    println!(
        "muster bench replica-death: 3 replicas of python3's http.server (readiness: GET / every \
         1 s), {} clients through an in-process gateway; SIGKILL of one replica's process a round",
        args.clients
    );
    println!(
        "  out of the endpoints (traffic on the others): {}",
        out.summary()
    );
    println!(
        "  a replacement ready:                         {}",
        replaced.summary()
    );
    println!(
        "  requests: {} answered, {counted_failures} failed during the rounds",
        answered.load(Ordering::Relaxed)
    );
    gateway.stop().await;
    drop(agent);
    drop(server);
    Ok(())
}
