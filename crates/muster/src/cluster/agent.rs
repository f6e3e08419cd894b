//! `muster agent`: its flags, the isolation it gives tasks, and the GPU
//! backend (also what `muster up` runs in-process).

use super::{init_logging, parse_bytes, parse_rate, runtime, shutdown_signal};
use crate::commands::default_data_dir;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use muster_agent::{AgentConfig, GpuBackend, NvmlBackend, SimulatedBackend};
use muster_server::ha::host_name;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct AgentArgs {
    /// The server's URL (https://HOST:7070), or several, separated by
    /// commas (servers sharing a PostgreSQL store: the agent moves to the
    /// next when one does not answer).
    #[arg(long, env = "MUSTER_SERVER")]
    pub server: String,
    /// The cluster CA's fingerprint (sha256:...), which `muster server`
    /// prints at start beside the join command: the agent trusts the
    /// server's certificate only if that CA signed it.
    #[arg(long, value_name = "FINGERPRINT", env = "MUSTER_CA_SHA256")]
    pub ca_sha256: Option<String>,
    /// The CA certificate(s) to trust, a PEM file (instead of, or with,
    /// --ca-sha256). With neither, the system's roots.
    #[arg(long, value_name = "PATH", env = "MUSTER_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// A file holding the join token (the server's join.token), or set
    /// MUSTER_JOIN_TOKEN. Needed only to join as a new node: the agent then
    /// keeps its own credential in its state directory (node.credential)
    /// and registers with that. Never pass a secret on the command line.
    #[arg(long, value_name = "PATH")]
    pub join_token_file: Option<PathBuf>,
    /// The node's name (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// The address other nodes reach this one at (default: the host name).
    #[arg(long)]
    pub address: Option<String>,
    /// Simulated GPUs instead of NVML, e.g. 8xH100-80GB or 2xA100-40GB,4xL4.
    #[arg(long, value_name = "SPEC")]
    pub simulate_gpus: Option<String>,
    #[arg(long)]
    pub pool: Option<String>,
    #[arg(long)]
    pub rack: Option<String>,
    /// Where task logs and pid files live (default: DATA_DIR/agent-NAME).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    #[command(flatten)]
    pub isolation: IsolationArgs,
    /// Task logs are sent to the server at most this fast, per second, for
    /// the whole node (e.g. 8MiB); heartbeats never wait for them.
    #[arg(long, value_name = "SIZE", default_value = "8MiB", value_parser = parse_rate)]
    pub log_rate: u64,
}

/// How tasks are kept apart from the agent and from each other.
#[derive(Debug, Args)]
pub struct IsolationArgs {
    /// Task cgroups: auto (v2 where it has the memory controller, else v1,
    /// else none), v2, v1, or none (process groups and a subreaper only).
    #[arg(long, value_name = "KIND", default_value = "auto", value_parser = parse_cgroups)]
    pub cgroups: muster_agent::CgroupChoice,
    /// The cgroup v2 hierarchy to use (default: the first cgroup2 mount).
    #[arg(long, value_name = "PATH")]
    pub cgroup_v2_root: Option<PathBuf>,
    /// The uids tasks get, one each for its life, when the agent runs as
    /// root and the job's user has no account on this node (no two tasks
    /// ever share one). No account or group of /etc/passwd or /etc/group
    /// may have an id in it.
    #[arg(long, value_name = "FIRST-LAST", default_value = muster_agent::runtime::uids::DEFAULT_TASK_UID_RANGE, value_parser = parse_uid_range)]
    pub task_uid_range: muster_agent::runtime::uids::UidRange,
    /// Each task in a PID and mount namespace of its own (it sees only its
    /// own processes, and gets a private /tmp and /dev/shm): auto (where
    /// the agent is root and the kernel allows it), on (refuse to start
    /// without), or off. The network stays the host's.
    #[arg(long, value_name = "MODE", default_value = "auto", value_parser = ["auto", "on", "off"])]
    pub task_namespaces: String,
    /// Let tasks run as root on this node (a job submitted as root). Off by
    /// default.
    #[arg(long)]
    pub allow_root_tasks: bool,
    /// The most processes and threads one task may have at once, where the
    /// node has a pids cgroup controller (0: no limit; default 4096, and
    /// never above a quarter of the host's pid_max). A fork bomb then
    /// starves neither its neighbours nor the agent.
    #[arg(long, value_name = "N")]
    pub task_pids_max: Option<u64>,
    /// Container tasks' network: host (NCCL and a gang's rendezvous need
    /// the node's interfaces), bridge or none.
    #[arg(long, value_name = "MODE", default_value = "host", value_parser = ["host", "bridge", "none"])]
    pub container_network: String,
    /// Container tasks' /dev/shm, e.g. 16GiB (default: half the task's
    /// memory limit, 8 GiB without one; Docker's own 64 MiB starves
    /// DataLoader workers and NCCL).
    #[arg(long, value_name = "SIZE", value_parser = parse_bytes)]
    pub container_shm: Option<u64>,
    /// How often the node sends GPU and node telemetry (utilisation,
    /// memory, power, temperature, clocks, ECC; CPU, memory, network) to the
    /// server, for `/metrics`.
    #[arg(long, value_name = "DURATION", default_value = "10s", env = "MUSTER_TELEMETRY_INTERVAL", value_parser = crate::cli::parse_duration_s)]
    pub telemetry_interval: u64,
}

fn parse_uid_range(text: &str) -> Result<muster_agent::runtime::uids::UidRange, String> {
    muster_agent::runtime::uids::UidRange::parse(text)
}

/// The node's task isolation beyond cgroups, checked and said once at
/// start.
pub struct TaskIsolation {
    pub cgroups: muster_agent::CgroupPlan,
    pub supervisor: PathBuf,
    /// `None`: the agent is not root.
    pub task_uids: Option<muster_agent::runtime::uids::UidRange>,
    pub namespaces: bool,
    pub task_pids_max: Option<u64>,
}

fn parse_cgroups(text: &str) -> Result<muster_agent::CgroupChoice, String> {
    muster_agent::CgroupChoice::parse(text)
        .ok_or_else(|| format!("unknown cgroup kind {text:?}; use auto, v2, v1 or none"))
}

/// The node's task isolation, said once at start: which cgroups, as whom,
/// in which namespaces.
pub(super) fn isolation(
    args: &IsolationArgs,
    name: &str,
    state_dir: &std::path::Path,
) -> Result<TaskIsolation> {
    let supervisor = std::env::current_exe()
        .context("cannot find this program's own path (to start task supervisors)")?;
    let (plan, skipped) = muster_agent::runtime::cgroup::detect(
        args.cgroups,
        &muster_agent::runtime::cgroup::agent_dir_name(name, state_dir),
        args.cgroup_v2_root.as_deref(),
    )
    .map_err(|why| {
        anyhow!(
            "cannot use the cgroups asked for ({why}); run the agent as root, or pass \
                     --cgroups auto or none"
        )
    })?;
    for why in skipped {
        eprintln!("task isolation: not using {why}");
    }
    eprintln!("task isolation: {}", plan.describe());
    let root = muster_agent::supervise::running_as_root();
    let task_uids = if root {
        muster_agent::runtime::uids::check_free(args.task_uid_range).map_err(|why| anyhow!(why))?;
        eprintln!(
            "task isolation: tasks run as the job's user where it has an account here, else \
             each as a uid of its own from {} (never shared while it runs){}",
            args.task_uid_range,
            if args.allow_root_tasks {
                "; root is allowed (--allow-root-tasks)"
            } else {
                "; never as root"
            }
        );
        Some(args.task_uid_range)
    } else {
        eprintln!(
            "task isolation: the agent is not root, so tasks run as its own user and can read \
             what it can (its state directory, tokens) and each other; run the agent as root to \
             isolate them"
        );
        None
    };
    let namespaces = match args.task_namespaces.as_str() {
        "off" => {
            eprintln!(
                "task isolation: no namespaces (--task-namespaces off): tasks see each other's processes and share /tmp"
            );
            false
        }
        mode => {
            let available = if root {
                muster_agent::taskinit::namespaces_available(&supervisor)
            } else {
                Err("the agent is not root".to_string())
            };
            match available {
                Ok(()) => {
                    eprintln!(
                        "task isolation: each task in a PID and mount namespace of its own (its \
                         own /proc, a private /tmp and /dev/shm; the host's network)"
                    );
                    true
                }
                Err(why) if mode == "on" => {
                    return Err(anyhow!(
                        "--task-namespaces on, but this host cannot give tasks namespaces: {why}"
                    ));
                }
                Err(why) => {
                    eprintln!(
                        "task isolation: no PID and mount namespaces ({why}): tasks see each \
                         other's processes and share /tmp"
                    );
                    false
                }
            }
        }
    };
    let host_pid_max = muster_agent::runtime::host_pid_max();
    let task_pids_max = match args.task_pids_max {
        Some(0) => None,
        Some(max) => Some(max),
        None => Some(muster_agent::runtime::default_task_pids_max(host_pid_max)),
    };
    Ok(TaskIsolation {
        cgroups: plan,
        supervisor,
        task_uids,
        namespaces,
        task_pids_max,
    })
}

pub(super) fn backend(
    simulate: Option<&str>,
    name: &str,
) -> Result<(Arc<dyn GpuBackend>, Option<String>)> {
    match simulate {
        Some(spec) => Ok((
            Arc::new(SimulatedBackend::parse(spec, name).map_err(|e| anyhow!("{e}"))?),
            None,
        )),
        None => match NvmlBackend::new() {
            Ok(nvml) => Ok((Arc::new(nvml), None)),
            Err(error) => Err(anyhow!("{error}")),
        },
    }
}

/// The join token, from `--join-token-file` or `MUSTER_JOIN_TOKEN`.
fn join_token(file: Option<&std::path::Path>) -> Result<Option<String>> {
    if let Some(path) = file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the join token from {}", path.display()))?;
        let token = text.trim();
        if token.is_empty() {
            bail!(
                "{} is empty; it should hold the server's join token",
                path.display()
            );
        }
        return Ok(Some(token.to_string()));
    }
    Ok(std::env::var("MUSTER_JOIN_TOKEN")
        .ok()
        .map(|token| token.trim().to_string())
        .filter(|token| !token.is_empty()))
}

pub fn agent(args: AgentArgs) -> Result<()> {
    init_logging();
    let name = args.name.clone().unwrap_or_else(host_name);
    let (backend, _) = backend(args.simulate_gpus.as_deref(), &name)?;
    let state_dir = args
        .state_dir
        .clone()
        .unwrap_or_else(|| default_data_dir().join(format!("agent-{name}")));
    let isolated = isolation(&args.isolation, &name, &state_dir)?;
    let trust = crate::commands::trust_of(args.ca_sha256.as_deref(), args.ca_file.as_deref())?;
    if args.server.starts_with("https://") && trust.is_empty() {
        eprintln!(
            "note: no --ca-sha256 or --ca-file: the server's certificate must be trusted by \
             the system's roots"
        );
    }
    let config = AgentConfig {
        server: args.server.clone(),
        trust,
        join_token: join_token(args.join_token_file.as_deref())?,
        name: name.clone(),
        address: args.address.clone().unwrap_or_else(host_name),
        state_dir,
        pool: args.pool.clone(),
        rack: args.rack.clone(),
        backend,
        fence_margin: Duration::from_millis(muster_node::DEFAULT_FENCE_MARGIN_MS),
        supervisor: isolated.supervisor,
        cgroups: isolated.cgroups,
        task_uids: isolated.task_uids,
        namespaces: isolated.namespaces,
        allow_root_tasks: args.isolation.allow_root_tasks,
        task_pids_max: isolated.task_pids_max,
        telemetry_interval: std::time::Duration::from_secs(args.isolation.telemetry_interval),
        container_network: args.isolation.container_network.clone(),
        container_shm_bytes: args.isolation.container_shm,
        log_shipping: muster_agent::logship::LogShipConfig {
            rate_bytes_per_s: args.log_rate,
            ..muster_agent::logship::LogShipConfig::default()
        },
    };
    runtime()?.block_on(async {
        eprintln!("muster agent {name} joining {}", args.server);
        let cgroups = config.cgroups.clone();
        let result = muster_agent::run(config, shutdown_signal()).await;
        cgroups.remove_parents();
        result.map_err(|e| anyhow!(e))
    })
}
