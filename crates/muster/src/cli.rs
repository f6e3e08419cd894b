//! The command line: one `Command` per subcommand.

use clap::{Args, Parser, Subcommand, ValueEnum};
use muster_sim::{NamedPolicy, ReplayPolicy};
use std::path::PathBuf;

#[derive(Debug, Parser)]
#[command(
    name = "muster",
    version,
    about = "A GPU cluster orchestrator: server, agent, simulator and CLI in one binary"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the server and one local agent in one process (real GPUs when
    /// NVML finds some, otherwise simulated ones); the CLI then works with
    /// no further configuration.
    Up(crate::cluster::UpArgs),
    /// Run the control plane: API, store, scheduler.
    Server(crate::cluster::ServerArgs),
    /// Run a node agent that joins a server.
    Agent(crate::cluster::AgentArgs),
    /// Submit a command and follow it: streams its output and exits with its
    /// exit code (Ctrl-C asks whether to cancel).
    Run(crate::commands::RunArgs),
    /// Submit a job spec (YAML) and print the job id.
    Submit(crate::commands::SubmitArgs),
    /// Submit a Slurm batch script: its #SBATCH options become the job's,
    /// and it runs on every node of the job with the SLURM_* variables.
    Sbatch(crate::commands::SbatchArgs),
    /// List jobs.
    Ps(crate::commands::PsArgs),
    /// Show a job: state history, placement, and why it is pending.
    Describe(crate::commands::JobArgs),
    /// Print a job's output.
    Logs(crate::commands::LogsArgs),
    /// Cancel a job (its processes get the stop signal, then are killed).
    Cancel(crate::commands::CancelArgs),
    /// List nodes, or show one (`muster nodes NAME`).
    Nodes(crate::commands::NodesArgs),
    /// Stop placing new work on a node.
    Cordon(crate::commands::NodeActionArgs),
    /// Place work on a node again.
    Uncordon(crate::commands::NodeActionArgs),
    /// Cordon a node and move its work elsewhere.
    Drain(crate::commands::NodeActionArgs),
    /// List pools (named by the agents' --pool), or set a pool's stack
    /// policy (`muster pools set gpu-a --stack-policy required --require
    /// driver=550.90`).
    Pools(crate::commands::PoolsArgs),
    /// Each pool's software stack (driver, CUDA, VBIOS, kernel, NCCL,
    /// container runtime) and the nodes that differ from it.
    Fleet(crate::commands::FleetArgs),
    /// List queues, or set one (`muster queues set NAME --guaranteed 8`).
    Queues(crate::commands::QueuesArgs),
    /// Services: replicas of a command or image kept running, checked,
    /// replaced when they fail and updated one at a time (`muster services
    /// create -f svc.yaml`, `scale`, `update`, `rollback`, `describe`).
    Services(crate::commands::ServicesArgs),
    /// Interactive environments: `muster dev start NAME --gpus 1` in a
    /// project directory, then `muster dev shell NAME`, `muster dev forward
    /// NAME 8888` (through the server: nodes need no inbound port); idle
    /// ones are reclaimed.
    Dev(crate::commands::DevArgs),
    /// Route HTTP requests to services' ready replicas
    /// (`http://GATEWAY/NAME/...` or a host `NAME.DOMAIN`), with retries of
    /// idempotent requests, draining, and per-service metrics.
    Gateway(crate::cluster::GatewayArgs),
    /// Users and their roles (admin): `muster users add alice --role user
    /// --queues team-a` prints its token once.
    Users(crate::commands::UsersArgs),
    /// Keep a token (read from standard input) and the server in the client
    /// config, after checking them: `muster login --server https://...`.
    Login(crate::commands::LoginArgs),
    /// Secrets (admin): `muster secrets set hf < token.txt`, then
    /// `env: {HF_TOKEN: {secret: hf}}` in a spec or `muster run --secret
    /// HF_TOKEN=hf`.
    Secrets(crate::commands::SecretsArgs),
    /// The audit log (admin): every change, who, from where, allowed or not.
    Audit(crate::commands::AuditArgs),
    /// A live view of the cluster: nodes with a bar per GPU, jobs with their
    /// utilisation (`--once` prints one frame).
    Top(crate::commands::TopArgs),
    /// GPU-hours allocated, used and idle, and their cost, per queue, user,
    /// job or pool (`muster cost --since 30d --by queue`).
    Cost(crate::commands::CostArgs),
    /// The price of a GPU-hour per model (`muster prices set H100-80GB 2.50`).
    Prices(crate::commands::PricesArgs),
    /// The cluster's finished jobs, for what-if replays: `muster history
    /// export --since 30d > jobs.csv`, then `muster sim replay --trace
    /// jobs.csv --format muster`.
    History(crate::commands::HistoryArgs),
    /// Print shell completions.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Replay traces through the scheduler and compare placement policies.
    Sim(SimArgs),
    /// Measure a cluster: submissions/s, heartbeat cost, idle agent, submit-to-running.
    Bench(crate::bench::BenchArgs),
}

#[derive(Debug, Args)]
pub struct SimArgs {
    #[command(subcommand)]
    pub command: SimCommand,
}

#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// Allocation under load (traces/README.md, protocol A): tasks arrive
    /// until 130% of the GPU capacity is asked, each placed at once or
    /// dropped; reports the GPU allocation ratio per policy.
    Alloc(AllocArgs),
    /// Time replay (traces/README.md, protocols B and C): jobs arrive at
    /// their submit times and run for their durations; reports job
    /// completion time, queueing delay, utilisation and preemptions per
    /// scheduling policy.
    Replay(ReplayArgs),
    /// Deterministic fault injection: one control plane and N agents over a
    /// simulated network with seeded loss, delay, duplication, partitions
    /// and crashes; checks invariants after every event (a job never runs
    /// twice) and that every job finishes once healed. A failing seed is
    /// printed with its last events and a command to replay it.
    Faults(FaultsArgs),
    /// Writes another task mix built from a pod list (more or fewer sharing,
    /// multi-GPU or CPU-only tasks, GPU-model constraints, heavier CPU), to
    /// check that a placement policy holds up beyond the published traces.
    Mix(MixArgs),
    /// Serving beside training: autoscaled services whose request rate
    /// follows a day's curve and a stream of training jobs, minute by
    /// minute through the production autoscaler and scheduler, with the
    /// inference pool dedicated to serving or lent to training (borrowers
    /// preempted when a service needs room); prints the trade-off.
    Services(ServicesSimArgs),
}

#[derive(Debug, Args)]
pub struct ServicesSimArgs {
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub inference_nodes: u32,
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(u32).range(0..=10000))]
    pub general_nodes: u32,
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub gpus_per_node: u32,
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub services: u32,
    /// Each service's busiest request rate (requests/s).
    #[arg(long, default_value_t = 160.0)]
    pub peak_rps: f64,
    /// The quietest hour's rate, as a share of the peak.
    #[arg(long, default_value_t = 0.15)]
    pub trough: f64,
    /// The autoscaler's target, requests/s a replica (a replica serves 25% more).
    #[arg(long, default_value_t = 20.0)]
    pub target_rps: f64,
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub max_replicas: u32,
    /// Seconds from a replica's start to its first request (model loading).
    #[arg(long, default_value_t = 120)]
    pub replica_startup: u64,
    /// Seconds of grace a preempted borrower gets before a replica starts
    /// in its place.
    #[arg(long, default_value_t = 30)]
    pub grace: u64,
    /// Training's offered load, as a share of all the cluster's GPUs.
    #[arg(long, default_value_t = 0.9)]
    pub training_load: f64,
    #[arg(long, default_value_t = 48, value_parser = clap::value_parser!(u64).range(1..=24 * 365))]
    pub hours: u64,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also write the results as JSON.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("change").required(true).multiple(false)))]
pub struct MixArgs {
    /// The pod list to draw from; the node list is read for --gpu-spec only
    /// (models are drawn from its GPUs).
    #[command(flatten)]
    pub files: OpenbFiles,

    /// PCT of the GPU tasks share one GPU (redrawn from the list's sharing and whole-GPU tasks).
    #[arg(long, value_name = "PCT", group = "change", value_parser = clap::value_parser!(u8).range(0..=100))]
    pub share: Option<u8>,

    /// PCT of the GPU tasks ask for more than one GPU.
    #[arg(long, value_name = "PCT", group = "change", value_parser = clap::value_parser!(u8).range(0..=100))]
    pub multi_gpu: Option<u8>,

    /// PCT of all tasks are CPU-only.
    #[arg(long, value_name = "PCT", group = "change", value_parser = clap::value_parser!(u8).range(0..=100))]
    pub cpu_only: Option<u8>,

    /// PCT of the GPU tasks may run on one GPU model only (drawn in proportion to the GPUs that could hold the task).
    #[arg(long, value_name = "PCT", group = "change", value_parser = clap::value_parser!(u8).range(0..=100))]
    pub gpu_spec: Option<u8>,

    /// Scale every task's CPU request to PCT percent (200: twice).
    #[arg(long, value_name = "PCT", group = "change", value_parser = clap::value_parser!(u32).range(1..=10000))]
    pub cpu_scale: Option<u32>,

    /// Seed for the draws.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,

    /// Where to write the new pod list.
    #[arg(long, value_name = "FILE")]
    pub out: PathBuf,
}

#[derive(Debug, Args)]
pub struct FaultsArgs {
    /// Number of seeds to run (START, START+1, ...).
    #[arg(long, value_name = "N", default_value_t = 200, value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,

    /// First seed.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub start: u64,

    /// Agents (nodes) per simulation, each with 4 or 8 GPUs.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..=64))]
    pub nodes: u64,

    /// Jobs submitted per simulation (about a third are 2-node gangs).
    #[arg(long = "sim-jobs", value_name = "N", default_value_t = 12)]
    pub sim_jobs: u64,

    /// Seconds of simulated time with faults, before everything heals.
    #[arg(long, value_name = "SECONDS", default_value_t = 60)]
    pub duration: u64,

    /// Probability that a message is lost.
    #[arg(long, value_name = "P", default_value_t = 0.05)]
    pub loss: f64,

    /// Probability that a message is delivered twice.
    #[arg(long, value_name = "P", default_value_t = 0.03)]
    pub duplicate: f64,

    /// Largest message latency, milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 400)]
    pub max_delay_ms: u64,

    /// Turn off partitions.
    #[arg(long)]
    pub no_partitions: bool,

    /// Turn off agent and host crashes.
    #[arg(long)]
    pub no_agent_crashes: bool,

    /// Turn off server crashes.
    #[arg(long)]
    pub no_server_crashes: bool,

    /// No GPUs turning unhealthy.
    #[arg(long)]
    pub no_gpu_failures: bool,

    /// The runtime does not kill tasks at the fence deadline their agent
    /// wrote (only the agent's own fencing remains).
    #[arg(long)]
    pub no_task_watchdog: bool,

    /// The runtime ignores fencing altogether: the agent core's fencing
    /// stops and the fence deadline (a broken node: shows the checker fail).
    #[arg(long)]
    pub no_fencing: bool,

    /// Simulations run at once (default: the number of cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: Option<u64>,
}

/// An openb node list and pod list (traces/README.md).
#[derive(Debug, Args)]
pub struct OpenbFiles {
    /// Node list (openb format: sn,cpu_milli,memory_mib,gpu,model).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "../shared/traces/openb/openb_node_list_gpu_node.csv"
    )]
    pub nodes: PathBuf,

    /// Pod list (openb format: name,cpu_milli,memory_mib,num_gpu,gpu_milli[,gpu_spec,...]).
    #[arg(
        long,
        value_name = "FILE",
        default_value = "../shared/traces/openb/openb_pod_list_default.csv"
    )]
    pub tasks: PathBuf,
}

#[derive(Debug, Args)]
pub struct AllocArgs {
    #[command(flatten)]
    pub files: OpenbFiles,

    /// Placement policies to compare, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "fgd,best-fit,packing,random,default"
    )]
    pub policies: Vec<NamedPolicy>,

    /// Number of seeds (0, 1, ... N-1); results are medians over seeds.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..))]
    pub seeds: u64,

    /// Simulations run at once (default: the number of cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: Option<u64>,

    /// Which node wins between nodes of equal score: `random` (a fixed
    /// random order per seed, as the published simulator), `name` (the
    /// smallest name), `fixed` (the server's own order, by rack and
    /// then pseudo-random, the same for every seed), `smallest-first` or `largest-first` (by GPUs,
    /// CPUs, memory; then the random order).
    #[arg(long, value_name = "ORDER", default_value = "random", value_parser = parse_ties)]
    pub ties: muster_sim::Ties,

    /// Output folder for results.json and alloc.svg (created if missing).
    #[arg(long, value_name = "DIR", default_value = "out/alloc")]
    pub out: PathBuf,
}

fn parse_scale(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(factor) if factor.is_finite() && factor > 0.0 && factor <= 100.0 => Ok(factor),
        _ => Err(format!(
            "{text:?} is not a scale factor; give a number above 0, at most 100 (e.g. 1.25)"
        )),
    }
}

fn parse_ties(text: &str) -> Result<muster_sim::Ties, String> {
    match text {
        "random" => Ok(muster_sim::Ties::Random),
        "name" => Ok(muster_sim::Ties::Name),
        "fixed" => Ok(muster_sim::Ties::Fixed),
        "smallest-first" => Ok(muster_sim::Ties::SmallestFirst),
        "largest-first" => Ok(muster_sim::Ties::LargestFirst),
        _ => Err(format!(
            "unknown tie order {text:?}; use random, name, fixed, smallest-first or \
             largest-first"
        )),
    }
}

/// The format of a time-replay trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TraceFormat {
    /// Microsoft Philly derived job list: timestamp,duration,num_gpus,gpu_time,cluster.
    Philly,
    /// Alibaba openb pod list with creation_time and deletion_time.
    Openb,
    /// A muster cluster's own history (`muster history export`).
    Muster,
}

impl TraceFormat {
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Philly => "philly",
            TraceFormat::Openb => "openb",
            TraceFormat::Muster => "muster",
        }
    }
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The job list to replay.
    #[arg(
        long,
        value_name = "FILE",
        default_value = "../shared/traces/philly/philly_2017-09_2017-10.csv"
    )]
    pub trace: PathBuf,

    /// The trace's format.
    #[arg(long, value_enum, default_value = "philly")]
    pub format: TraceFormat,

    /// The cluster as a cluster spec (YAML, see docs/cluster-spec.md).
    /// Not with --nodes-csv.
    #[arg(
        long,
        value_name = "SPEC",
        default_value = "examples/clusters/philly.yaml"
    )]
    pub cluster: PathBuf,

    /// The cluster as an openb node list (sn,cpu_milli,memory_mib,gpu,model),
    /// instead of --cluster.
    #[arg(long, value_name = "FILE", conflicts_with = "cluster")]
    pub nodes_csv: Option<PathBuf>,

    /// The cluster as a running server has it now (its nodes, GPUs, CPU,
    /// memory, pools and racks), instead of --cluster: the URL of the
    /// server; the token and CA come as for any command ($MUSTER_TOKEN,
    /// $MUSTER_CA_SHA256, the client config).
    #[arg(long, value_name = "URL", conflicts_with_all = ["cluster", "nodes_csv"])]
    pub cluster_from: Option<String>,

    /// The `default` policy's queues, a YAML map such as `team-a:
    /// {guaranteed_gpus: 16, weight: 2, borrow_limit_gpus: 32}` (default:
    /// guarantees proportional to each queue's GPU-time in the trace).
    #[arg(long, value_name = "FILE")]
    pub queues: Option<PathBuf>,

    /// Replay on a cluster with this many times the nodes (1.25: a quarter
    /// more, copies of the nodes in order; 0.5: the first half).
    #[arg(long, value_name = "FACTOR", default_value_t = 1.0, value_parser = parse_scale)]
    pub scale_nodes: f64,

    /// Forecast each job's start when it arrives, as the server does for
    /// pending jobs (the scheduler's plan run ahead on learned runtime
    /// estimates), and report how close the forecasts came: the share of
    /// jobs that waited over 10 minutes whose wait was within 2x of the
    /// forecast. Costs a plan per arrival.
    #[arg(long)]
    pub forecast: bool,

    /// Scheduling policies to compare, comma-separated: fifo, las,
    /// sjf-oracle (reads true durations: an oracle), default.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "fifo,las,sjf-oracle,default"
    )]
    pub policies: Vec<ReplayPolicy>,

    /// Output folder for results.json and the plots (created if missing).
    #[arg(long, value_name = "DIR", default_value = "out/replay")]
    pub out: PathBuf,

    /// Seed of the scheduler's random choices.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub seed: u64,

    /// Node placement used under every policy (fgd-consolidate, fgd,
    /// best-fit, packing, random, default).
    #[arg(long, value_name = "POLICY", default_value = "default")]
    pub placement: muster_sched::PlacementPolicy,

    /// How often jobs checkpoint: a preempted job loses the work since its
    /// last checkpoint. A duration like 30m, 1h, 90s or 1h30m; 0: never
    /// (a preemption loses everything).
    #[arg(long, value_name = "DURATION", default_value = "30m", value_parser = parse_duration_s)]
    pub checkpoint_interval: u64,

    /// Policies replayed at once (default: the number of cores).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub jobs: Option<u64>,
}

/// Parses a duration into seconds: whole seconds (`1800`), or parts with
/// the units d, h, m, s, each at most once and largest first (`1h30m`); the
/// job spec's own duration syntax.
pub fn parse_duration_s(text: &str) -> Result<u64, String> {
    muster_api::parse_duration_text(text)
        .map(|duration| duration.as_secs())
        .map_err(|error| format!("{error}, got {:?}", text.trim()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_into_seconds() {
        assert_eq!(parse_duration_s("30m"), Ok(1800));
        assert_eq!(parse_duration_s("1h30m"), Ok(5400));
        assert_eq!(parse_duration_s("1d"), Ok(86_400));
        assert_eq!(parse_duration_s("90s"), Ok(90));
        assert_eq!(parse_duration_s("0"), Ok(0));
        assert_eq!(parse_duration_s("1800"), Ok(1800));
        assert!(parse_duration_s("30 minutes").is_err());
        assert!(parse_duration_s("30m1h").is_err());
        assert!(parse_duration_s("").is_err());
        assert!(parse_duration_s("1.5h").is_err());
    }

    #[test]
    fn every_command_s_arguments_are_well_formed() {
        // clap checks a command's arguments only when it is built: a
        // duplicate name (a flag added to Connection that a command also
        // had) broke `muster login` alone, at run time.
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
