//! The agent's main loop: the shell around `muster_node::AgentCore`, which
//! decides everything (registration, heartbeats and their sequence numbers,
//! the lease and fencing, which tasks to start, stop and forget). This file
//! sends the requests, starts and stops tasks through the runtime, writes
//! the lease file and the runtime's fence deadline, hands task logs to the
//! log shipper, and feeds the core answers, exits, GPU health and time.

use crate::gpu::GpuBackend;
use crate::runtime::{
    CgroupPlan, EndReason, ProcessRuntime, RecoveredStatus, RuntimeConfig, TaskExit, TaskLaunch,
};
use muster_api::client::{Client, ClientError};
use muster_api::protocol::{
    DesiredAllocation, ErrorCode, GpuView, HeartbeatRequest, HeartbeatResponse, ObservedAllocation,
    RegisterRequest, RegisterResponse,
};
use muster_model::Signal;
use muster_node::{
    self as node, AdoptedTask, AgentCore, CoreConfig, DesiredTask, HeartbeatFailure, Input,
    LeaseRecord, Output, Report, TaskId,
};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Everything `muster agent` needs.
#[derive(Clone)]
pub struct AgentConfig {
    /// `https://host:port` of the server.
    pub server: String,
    /// What the server's certificate is trusted through (the cluster CA's
    /// fingerprint or file).
    pub trust: muster_api::tls::Trust,
    /// The join token: needed only to join as a new node (no credential
    /// in the state directory yet, or the credential was revoked).
    pub join_token: Option<String>,
    pub name: String,
    /// How other nodes reach this one (a gang's master address).
    pub address: String,
    pub state_dir: PathBuf,
    pub pool: Option<String>,
    pub rack: Option<String>,
    pub backend: Arc<dyn GpuBackend>,
    /// Stop tasks this long before the lease would run out.
    pub fence_margin: Duration,
    /// How task logs are shipped (a rate cap for the node, a chunk size).
    pub log_shipping: crate::logship::LogShipConfig,
    /// The program each task's supervisor runs as (`PROGRAM supervise ...`):
    /// the `muster` binary, by absolute path.
    pub supervisor: PathBuf,
    /// The node's task cgroups (see `runtime::cgroup::detect`).
    pub cgroups: CgroupPlan,
    /// The uids tasks get, one each, when the job's user has no account
    /// here (`None`: the agent is not root and cannot switch users).
    pub task_uids: Option<crate::runtime::uids::UidRange>,
    /// Each task in a PID and mount namespace of its own.
    pub namespaces: bool,
    /// Tasks may run as root on this node.
    pub allow_root_tasks: bool,
    /// The most processes and threads one task may have at once.
    pub task_pids_max: Option<u64>,
    /// How often GPU and node telemetry is sent to the server.
    pub telemetry_interval: Duration,
    /// Container tasks' network (`host`, `bridge` or `none`).
    pub container_network: String,
    /// Container tasks' `/dev/shm` (`None`: half the memory limit).
    pub container_shm_bytes: Option<u64>,
}

/// The node's credential, in its state directory (mode 0600).
pub const CREDENTIAL_FILE: &str = "node.credential";

fn read_credential(path: &std::path::Path) -> Result<Option<String>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => Ok(Some(text.trim().to_string())),
        Ok(_) => Ok(None),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(error) => Err(format!(
            "cannot read the node credential {}: {error}",
            path.display()
        )),
    }
}

/// Writes the credential for the owner only, replacing the file whole.
fn write_credential(path: &std::path::Path, token: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let temporary = path.with_extension("new");
    let write = || -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
        }
        let _ = std::fs::remove_file(&temporary);
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temporary)?;
        file.write_all(token.as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)
    };
    write().map_err(|error| {
        // Nothing half-written is left in the state directory.
        let _ = std::fs::remove_file(&temporary);
        format!(
            "cannot keep the node credential in {}: {error}; check that the state directory is \
             writable",
            path.display()
        )
    })
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A task's name on this node (its files are named after it): the job, the
/// allocation and its generation.
pub(crate) fn task_key(job: u64, allocation: u64, generation: u64) -> String {
    format!("j{job}-a{allocation}-g{generation}")
}

/// (job, allocation, generation) of a task name; the job is `None` for a
/// name without one.
fn parse_key(key: &str) -> Option<(Option<u64>, u64, u64)> {
    let (job, rest) = match key.strip_prefix('j').and_then(|k| k.split_once('-')) {
        Some((job, rest)) => (Some(job.parse().ok()?), rest),
        None => (None, key),
    };
    let (allocation, generation) = rest.strip_prefix('a')?.split_once("-g")?;
    Some((job, allocation.parse().ok()?, generation.parse().ok()?))
}

fn machine_cpu_milli() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64) * 1000
}

fn machine_memory_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("MemTotal:"))
                .and_then(|rest| {
                    rest.trim()
                        .trim_end_matches("kB")
                        .trim()
                        .parse::<u64>()
                        .ok()
                })
        })
        .map_or(1024, |kib| kib / 1024)
}

/// Runs the agent until `shutdown` resolves. Tasks keep running across an
/// agent restart; a new agent finds them through the runtime's records.
///
/// Every decision is `muster_node::AgentCore`'s; this loop only carries its
/// outputs out (HTTP requests, runtime starts and stops, the lease file and
/// the runtime's fence deadline) and feeds it what happens (answers,
/// failures, task exits, GPU health, time).
pub async fn run(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    tokio::pin!(shutdown);
    let base = Client::with_trust(&config.server, "", &config.trust)?;
    let inventory = config.backend.inventory().map_err(|e| e.to_string())?;
    let runtime = Arc::new(ProcessRuntime::new(RuntimeConfig {
        state_dir: config.state_dir.clone(),
        supervisor: config.supervisor.clone(),
        cgroups: config.cgroups.clone(),
        task_uids: config.task_uids,
        namespaces: config.namespaces,
        allow_root: config.allow_root_tasks,
        task_pids_max: config.task_pids_max,
        // Simulated GPUs have no devices to pass to a container.
        container_gpus: inventory.backend != "simulated",
        container_network: config.container_network.clone(),
        container_shm_bytes: config.container_shm_bytes,
    }));
    let gpus: Vec<GpuView> = inventory
        .gpus
        .iter()
        .map(|gpu| GpuView {
            index: gpu.index,
            uuid: gpu.uuid.clone(),
            model: gpu.model.to_string(),
            memory_mib: gpu.memory.0,
            nvlink_domain: gpu.nvlink_domain,
        })
        .collect();
    let uuids: BTreeMap<u32, String> = gpus.iter().map(|g| (g.index, g.uuid.clone())).collect();
    let register = RegisterRequest {
        name: config.name.clone(),
        address: config.address.clone(),
        gpus,
        cpu_milli: machine_cpu_milli(),
        memory_mib: machine_memory_mib(),
        pool: config.pool.clone(),
        rack: config.rack.clone(),
        backend: inventory.backend.to_string(),
        driver_version: inventory.driver_version.clone(),
        cuda_version: inventory.cuda_version.clone(),
        stack: {
            let mut stack = crate::stack::node_stack(&inventory);
            // A reachable Docker engine: this node runs container tasks.
            if let Some(version) = crate::container::engine_version().await {
                stack.insert(muster_model::CONTAINER_ENGINE.to_string(), version);
            }
            stack
        },
    };
    // Task logs go out on their own task and connection, never in the way
    // of a heartbeat; a task is forgotten only once its log is shipped.
    let logs = crate::logship::LogShipper::start(
        base.clone(),
        &config.name,
        Arc::clone(&runtime),
        config.log_shipping.clone(),
    );

    // Tasks of an earlier agent on this node.
    let mut keys: BTreeMap<TaskId, String> = BTreeMap::new();
    let mut adopted = Vec::new();
    match runtime.recover().await {
        Ok(recovery) => {
            for (path, why) in &recovery.unreadable {
                tracing::warn!("cannot read the task record {}: {why}", path.display());
            }
            for found in recovery.tasks {
                let Some((job, allocation, generation)) = parse_key(&found.allocation) else {
                    tracing::warn!("a task of unknown name {} is left alone", found.allocation);
                    continue;
                };
                let task = TaskId {
                    allocation,
                    generation,
                };
                adopted.push(AdoptedTask {
                    task,
                    job,
                    gpus: Some(found.gpu_indices.clone()),
                    stop_signal: found.stop_signal,
                    grace_period_ms: found.grace_period.as_millis() as u64,
                    exit: match &found.status {
                        RecoveredStatus::Running => None,
                        RecoveredStatus::Exited(exit) => Some(ended(exit)),
                        RecoveredStatus::Gone => Some(node::TaskExit::Vanished),
                    },
                });
                keys.insert(task, found.allocation);
            }
        }
        Err(error) => tracing::error!("cannot recover the tasks of an earlier agent: {error}"),
    }
    // When this node last renewed its lease, and how long the lease is, kept
    // on disk: a restarted agent that cannot reach the server must still
    // fence the tasks it recovered before their lease runs out.
    let lease_file = config.state_dir.join("lease.json");
    let lease = std::fs::read_to_string(&lease_file)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| {
            Some(LeaseRecord {
                last_renewal_ms: v["last_renewal_ms"].as_u64()?,
                lease_ms: v["lease_ms"].as_u64()?,
            })
        });
    let core_config = CoreConfig {
        fence_margin_ms: config.fence_margin.as_millis() as u64,
    };
    let (mut core, outputs) = AgentCore::new(core_config, now_ms(), lease, adopted);
    let credential_file = config.state_dir.join(CREDENTIAL_FILE);
    let credential = read_credential(&credential_file)?;
    if credential.is_none() && config.join_token.is_none() {
        return Err(format!(
            "this node has no credential yet ({} is missing): pass the join token with \
             --join-token-file or MUSTER_JOIN_TOKEN to join the cluster",
            credential_file.display()
        ));
    }
    let mut shell = Shell {
        credential,
        credential_file,
        join_token: config.join_token.clone(),
        client: None,
        register,
        runtime: Arc::clone(&runtime),
        uuids,
        logs,
        lease_file,
        keys,
        forgotten: BTreeSet::new(),
        in_flight: None,
        starts: futures_util::stream::FuturesUnordered::new(),
        server: base.clone(),
        backend: Arc::clone(&config.backend),
        checks: Arc::new(crate::checks::Checks::default()),
        check_client: Arc::new(std::sync::Mutex::new(None)),
    };
    let (_stop_checks, checks_stopped) = tokio::sync::watch::channel(false);
    let check_runner = tokio::spawn(Arc::clone(&shell.checks).run(
        Arc::clone(&shell.check_client),
        config.name.clone(),
        checks_stopped,
    ));
    // Stops the check runner however this function returns.
    struct AbortOnDrop(tokio::task::JoinHandle<()>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let _check_runner = AbortOnDrop(check_runner);
    shell.carry_out(&mut core, outputs).await?;
    let mut health = tokio::time::interval(Duration::from_secs(1));
    health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut telemetry =
        tokio::time::interval(config.telemetry_interval.max(Duration::from_secs(1)));
    telemetry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut node_sampler = crate::nodestats::NodeSampler::default();
    // The GPUs' total memory, for their samples.
    let memory_totals: BTreeMap<u32, u64> = config
        .backend
        .inventory()
        .map(|inventory| {
            inventory
                .gpus
                .iter()
                .map(|gpu| (gpu.index, gpu.memory.0))
                .collect()
        })
        .unwrap_or_default();
    loop {
        shell.ship_and_forget(&core).await;
        let wake = core.next_wake_ms();
        let sleep = tokio::time::sleep(Duration::from_millis(wake.saturating_sub(now_ms())));
        let input = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            answer = async {
                match shell.in_flight.as_mut() {
                    Some(request) => request.await,
                    None => std::future::pending().await,
                }
            } => {
                shell.in_flight = None;
                match shell.answered(answer) {
                    Ok(input) => input,
                    Err(refused) => return Err(refused),
                }
            }
            Some(failed) = futures_util::StreamExt::next(&mut shell.starts),
                if !shell.starts.is_empty() =>
            {
                match failed {
                    Some(task) => Input::StartFailed { task },
                    None => continue,
                }
            }
            exit = runtime.next_exit() => {
                tracing::info!(
                    task = %exit.allocation,
                    code = ?exit.exit_code,
                    signal = ?exit.signal,
                    reason = ?exit.reason,
                    cpu_ms = ?exit.usage.cpu_ms,
                    memory_peak_bytes = ?exit.usage.memory_peak_bytes,
                    "task ended"
                );
                config.backend.task_ended(&exit.allocation);
                let Some(task) = task_of(&exit.allocation) else {
                    continue;
                };
                Input::TaskExited { task, exit: ended(&exit) }
            }
            _ = health.tick() => {
                // NVML calls block: off the async threads. A failed read
                // keeps the last answer.
                let backend = Arc::clone(&config.backend);
                match tokio::task::spawn_blocking(move || backend.telemetry()).await {
                    Ok(Ok(telemetry)) => Input::GpuHealth {
                        unhealthy: telemetry
                            .iter()
                            .filter(|gpu| !gpu.healthy)
                            .map(|gpu| gpu.index)
                            .collect(),
                    },
                    _ => Input::Tick,
                }
            }
            _ = telemetry.tick() => {
                // Sent apart from heartbeats, and never waited for: a slow
                // or failed send loses one sample, nothing else.
                if let (Some(client), true) = (shell.client.clone(), core.registered()) {
                    let backend = Arc::clone(&config.backend);
                    let gpus = tokio::task::spawn_blocking(move || backend.telemetry())
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .unwrap_or_default();
                    let report = muster_api::protocol::TelemetryReport {
                        epoch: core.epoch(),
                        sampled_ms: now_ms(),
                        gpus: gpus
                            .iter()
                            .map(|gpu| gpu_sample(gpu, &memory_totals))
                            .collect(),
                        node: node_sampler.sample(),
                    };
                    let name = config.name.clone();
                    tokio::spawn(async move {
                        if let Err(error) = client.push_telemetry(&name, &report).await {
                            tracing::debug!("telemetry not sent: {error}");
                        }
                    });
                }
                Input::Tick
            }
            _ = sleep => Input::Tick,
        };
        let outputs = core.handle(now_ms(), input);
        shell.carry_out(&mut core, outputs).await?;
    }
}

/// One GPU's telemetry as the API carries it.
fn gpu_sample(
    gpu: &crate::gpu::GpuTelemetry,
    memory_totals: &BTreeMap<u32, u64>,
) -> muster_api::protocol::GpuSample {
    muster_api::protocol::GpuSample {
        index: gpu.index,
        utilization_pct: gpu.utilization_pct.min(100),
        memory_used_mib: gpu.memory_used.0,
        memory_total_mib: memory_totals.get(&gpu.index).copied().unwrap_or(0),
        power_watts: gpu.power_milliwatts.map(|mw| f64::from(mw) / 1000.0),
        temperature_c: gpu.temperature_c,
        sm_clock_mhz: gpu.sm_clock_mhz,
        ecc_uncorrected: gpu.ecc_errors,
        xid: gpu.xid,
        pcie_tx_bytes: gpu.pcie_tx_bytes,
        pcie_rx_bytes: gpu.pcie_rx_bytes,
        healthy: gpu.healthy,
    }
}

/// A request in flight, resolving to its answer.
type InFlight = Pin<Box<dyn Future<Output = Answer> + Send>>;

/// A task's start, resolving to the task when it could not be started.
type Starting = Pin<Box<dyn Future<Output = Option<TaskId>> + Send>>;

enum Answer {
    Register {
        sequence: u64,
        result: Result<RegisterResponse, ClientError>,
    },
    Heartbeat {
        sequence: u64,
        result: Result<HeartbeatResponse, ClientError>,
    },
}

/// What the agent's loop holds besides the core: connections, the runtime,
/// the names of the tasks, the request in flight.
struct Shell {
    /// This node's own credential (from an earlier registration), kept in
    /// the state directory; registrations use it, else the join token.
    credential: Option<String>,
    credential_file: PathBuf,
    join_token: Option<String>,
    /// With the node's token, once registered.
    client: Option<Client>,
    register: RegisterRequest,
    runtime: Arc<ProcessRuntime>,
    uuids: BTreeMap<u32, String>,
    logs: crate::logship::LogShipper,
    lease_file: PathBuf,
    /// Each task's name on this node.
    keys: BTreeMap<TaskId, String>,
    /// Tasks the core forgot, kept until their log is shipped.
    forgotten: BTreeSet<String>,
    in_flight: Option<InFlight>,
    /// Starts under way, each resolving to its task when it failed: tasks
    /// start side by side, and the loop (heartbeats, exits) goes on
    /// meanwhile.
    starts: futures_util::stream::FuturesUnordered<Starting>,
    /// The server, with no token: each request's client is made from it.
    server: Client,
    backend: Arc<dyn GpuBackend>,
    /// Services' command checks run beside their tasks, and the client
    /// their results go with.
    checks: Arc<crate::checks::Checks>,
    check_client: Arc<std::sync::Mutex<Option<Client>>>,
}

impl Shell {
    /// Takes in the command checks the server's answer names.
    fn update_checks(&self, desired: &[DesiredAllocation]) {
        let config = self.runtime.config();
        let root = crate::supervise::running_as_root();
        self.checks.update(desired, |task| {
            let key = task_key(task.job, task.allocation, task.generation);
            let plan = crate::runtime::record::UserPlan {
                job_user: task.user.clone(),
                dynamic_uid: self.runtime.task_uid(&key),
                dynamic_gid: self.runtime.task_gid(task.user_group),
                fallback: None,
                allow_root: config.allow_root,
            };
            // As the task's user; as root, never without one (the task has
            // not started yet: looked up again at the next answer).
            let user = crate::supervise::choose_user(root, &plan, crate::supervise::lookup_user)
                .ok()
                .flatten()
                .map(|user| (user.uid, user.gid));
            crate::checks::TaskContext {
                job: task.job,
                env: crate::runtime::check_environment(&task.env, |name| std::env::var(name).ok()),
                working_dir: task.working_dir.clone(),
                user,
                needs_user: root,
                procs: config.cgroups.task(&key).procs_files(),
                cgroup: config.cgroups.task(&key),
                container: task
                    .image
                    .is_some()
                    .then(|| (self.runtime.state_dir().to_path_buf(), key.clone())),
            }
        });
    }

    /// Carries the core's outputs out, in order, until nothing is left
    /// (a start is only begun here: the loop takes in its failure, if it
    /// fails). Err: the server refused this node for good.
    async fn carry_out(
        &mut self,
        core: &mut AgentCore<DesiredAllocation>,
        outputs: Vec<Output<DesiredAllocation>>,
    ) -> Result<(), String> {
        let mut queue: VecDeque<Output<DesiredAllocation>> = outputs.into();
        while let Some(output) = queue.pop_front() {
            match output {
                Output::SendRegister {
                    sequence,
                    deadline_ms,
                    ..
                } => {
                    let token = self
                        .credential
                        .clone()
                        .or_else(|| self.join_token.clone())
                        .unwrap_or_default();
                    let joiner = self.server.with_token(&token);
                    let request = self.register.clone();
                    let limit = self.limit(deadline_ms);
                    self.in_flight = Some(Box::pin(async move {
                        let result = tokio::time::timeout(limit, joiner.register(&request))
                            .await
                            .unwrap_or_else(|_| {
                                joiner.skip_server();
                                Err(no_answer(joiner.base()))
                            });
                        Answer::Register { sequence, result }
                    }));
                }
                Output::SendHeartbeat {
                    sequence,
                    epoch,
                    observed,
                    unhealthy_gpus,
                    known_version,
                    wait_ms,
                    deadline_ms,
                } => {
                    let Some(client) = self.client.clone() else {
                        // Registered without a token: cannot happen; register
                        // again.
                        let input = Input::HeartbeatFailed {
                            sequence,
                            failure: HeartbeatFailure::Refused,
                        };
                        queue.extend(core.handle(now_ms(), input));
                        continue;
                    };
                    let request = HeartbeatRequest {
                        epoch,
                        observed: observed
                            .iter()
                            .map(|o| ObservedAllocation {
                                allocation: o.task.allocation,
                                generation: o.task.generation,
                                exited: o.exited,
                                fenced: o.fenced,
                                memory_limit: o.memory_limit,
                            })
                            .collect(),
                        unhealthy_gpus,
                        wait_ms,
                        known_version,
                        sequence,
                        pulling: self
                            .runtime
                            .pulling()
                            .into_iter()
                            .filter_map(|(key, status)| {
                                Some(muster_api::protocol::PullStatus {
                                    allocation: task_of(&key)?.allocation,
                                    status,
                                })
                            })
                            .collect(),
                    };
                    let name = self.register.name.clone();
                    let limit = self.limit(deadline_ms);
                    self.in_flight = Some(Box::pin(async move {
                        let result = tokio::time::timeout(limit, client.heartbeat(&name, &request))
                            .await
                            .unwrap_or_else(|_| {
                                client.skip_server();
                                Err(no_answer(client.base()))
                            });
                        Answer::Heartbeat { sequence, result }
                    }));
                }
                Output::StartTask {
                    task,
                    job,
                    gpus,
                    launch: spec,
                } => {
                    let key = task_key(job, task.allocation, task.generation);
                    self.keys.insert(task, key.clone());
                    let launch = TaskLaunch {
                        allocation: key.clone(),
                        command: spec.command.clone(),
                        env: spec.env.clone(),
                        working_dir: spec.working_dir.as_ref().map(PathBuf::from),
                        gpu_uuids: gpus
                            .iter()
                            .filter_map(|i| self.uuids.get(i).cloned())
                            .collect(),
                        gpu_indices: gpus,
                        stop_signal: Signal::parse(&spec.stop_signal).unwrap_or(Signal::Term),
                        grace_period: Duration::from_millis(spec.grace_period_ms),
                        user: spec.user.clone(),
                        user_group: spec.user_group,
                        memory_limit_mib: spec.memory_mib,
                        image: spec.image.clone(),
                        cpu_milli: spec.cpu_milli,
                        registry_auth: spec.registry_auth.clone(),
                        mounts: spec
                            .mounts
                            .iter()
                            .map(|m| {
                                (
                                    m.source.clone(),
                                    m.target.clone(),
                                    m.read_only.unwrap_or(false),
                                )
                            })
                            .collect(),
                    };
                    let env = launch.env.clone();
                    let indices = launch.gpu_indices.clone();
                    let runtime = Arc::clone(&self.runtime);
                    let backend = Arc::clone(&self.backend);
                    // Polled by the loop itself (not spawned), so the
                    // backend hears of the start before the loop can take
                    // in the task's exit.
                    self.starts.push(Box::pin(async move {
                        match runtime.start(launch).await {
                            Ok(()) => {
                                backend.task_started(&key, &indices, &env);
                                None
                            }
                            Err(error) => {
                                // Reported as a failed task (exit code 127,
                                // as a shell would for a missing command).
                                // The supervisor wrote why into the task's
                                // log when it got that far; otherwise the
                                // agent does.
                                tracing::warn!("cannot start {key}: {error}");
                                let log = runtime.log_path(&key);
                                if !log.exists() {
                                    if let Some(parent) = log.parent() {
                                        let _ = std::fs::create_dir_all(parent);
                                    }
                                    let _ = std::fs::write(&log, format!("muster: {error}\n"));
                                }
                                Some(task)
                            }
                        }
                    }));
                }
                Output::StopTask {
                    task,
                    signal,
                    grace_ms,
                    fenced,
                } => {
                    let Some(key) = self.keys.get(&task).cloned() else {
                        continue;
                    };
                    let runtime = Arc::clone(&self.runtime);
                    let grace = Duration::from_millis(grace_ms);
                    tokio::spawn(async move {
                        if let Err(error) = runtime.stop_as(&key, signal, grace, fenced).await {
                            tracing::warn!("cannot stop {key}: {error}");
                        }
                    });
                }
                Output::WriteLease {
                    last_renewal_ms,
                    lease_ms,
                    fence_deadline_ms,
                } => {
                    // Every task's supervisor kills its task past this
                    // deadline, whether or not this agent is alive.
                    if let Err(error) = self.runtime.set_fence_deadline(fence_deadline_ms) {
                        tracing::error!("cannot write the fence deadline: {error}");
                    }
                    let text = serde_json::json!({
                        "last_renewal_ms": last_renewal_ms,
                        "lease_ms": lease_ms,
                    })
                    .to_string();
                    let temporary = self.lease_file.with_extension("tmp");
                    if let Err(error) = std::fs::write(&temporary, text)
                        .and_then(|()| std::fs::rename(&temporary, &self.lease_file))
                    {
                        tracing::error!("cannot write {}: {error}", self.lease_file.display());
                    }
                }
                Output::ForgetTask { task } => {
                    if let Some(key) = self.keys.remove(&task) {
                        self.forgotten.insert(key);
                    }
                }
                Output::Report(Report::Fenced) => {
                    tracing::warn!("lease not renewed in time: stopping every task (fenced)");
                }
                Output::Report(Report::RegisterAgain) => {
                    tracing::warn!("the server refused a heartbeat: registering again");
                }
                Output::Report(Report::NoAnswer { sequence }) => {
                    tracing::warn!("no answer to request {sequence} in time");
                }
            }
        }
        Ok(())
    }

    /// How long a request may take, from its deadline.
    fn limit(&self, deadline_ms: u64) -> Duration {
        Duration::from_millis(deadline_ms.saturating_sub(now_ms()))
    }

    /// The core's input for an answer. Err: the server refused to register
    /// this node (not a network failure): the agent stops.
    fn answered(&mut self, answer: Answer) -> Result<Input<DesiredAllocation>, String> {
        Ok(match answer {
            Answer::Register {
                sequence,
                result: Ok(registered),
            } => {
                if self.credential.as_deref() != Some(registered.node_token.as_str()) {
                    write_credential(&self.credential_file, &registered.node_token)?;
                    self.credential = Some(registered.node_token.clone());
                }
                self.client = Some(self.server.with_token(&registered.node_token));
                *self
                    .check_client
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = self.client.clone();
                self.logs.set_token(&registered.node_token);
                tracing::info!(epoch = registered.epoch, "registered");
                Input::Registered {
                    sequence,
                    epoch: registered.epoch,
                    lease_ms: registered.lease_ms,
                    heartbeat_ms: registered.heartbeat_ms,
                }
            }
            Answer::Register {
                sequence,
                result: Err(error),
            } => {
                match error.code() {
                    // The credential was revoked (an admin reset the
                    // identity, or removed the node): join anew with the
                    // join token, if this agent has it.
                    Some(ErrorCode::Unauthenticated) if self.credential.is_some() => {
                        let Some(_) = &self.join_token else {
                            return Err(format!(
                                "the server no longer accepts this node's credential ({error}); \
                                 an admin reset its identity or removed it: restart the agent \
                                 with the join token (--join-token-file or MUSTER_JOIN_TOKEN) \
                                 to join again"
                            ));
                        };
                        tracing::warn!(
                            "the node's credential was refused (identity reset or node \
                             removed): joining again with the join token"
                        );
                        let _ = std::fs::remove_file(&self.credential_file);
                        self.credential = None;
                    }
                    // The server cannot save anything now: try again.
                    Some(ErrorCode::Unavailable | ErrorCode::Internal) | None => {
                        tracing::warn!("cannot register yet: {error}");
                    }
                    Some(_) => {
                        return Err(format!("the server refused to register this node: {error}"));
                    }
                }
                Input::RegisterFailed { sequence }
            }
            Answer::Heartbeat {
                sequence,
                result: Ok(answer),
            } => {
                if let Some(client) = &self.client {
                    crate::tunnels::open(
                        client,
                        &self.register.name,
                        self.runtime.state_dir(),
                        &answer.tunnels,
                    );
                }
                self.update_checks(&answer.desired);
                Input::HeartbeatReply {
                    sequence,
                    version: answer.version,
                    lease_ms: answer.lease_ms,
                    desired: answer.desired.into_iter().map(desired).collect(),
                }
            }
            Answer::Heartbeat {
                sequence,
                result: Err(error),
            } => {
                let refused = matches!(
                    error.code(),
                    Some(ErrorCode::Conflict | ErrorCode::Unauthenticated | ErrorCode::NotFound)
                );
                if !refused {
                    tracing::warn!("heartbeat failed: {error}");
                }
                Input::HeartbeatFailed {
                    sequence,
                    failure: if refused {
                        HeartbeatFailure::Refused
                    } else {
                        HeartbeatFailure::Transport
                    },
                }
            }
        })
    }

    /// Tells the log shipper which tasks there are, and forgets, in the
    /// runtime, the tasks the core forgot once their logs are shipped.
    async fn ship_and_forget(&mut self, core: &AgentCore<DesiredAllocation>) {
        let known: Vec<(String, bool)> = core
            .tasks()
            .filter_map(|(task, exit)| Some((self.keys.get(&task)?.clone(), exit.is_none())))
            .chain(self.forgotten.iter().map(|key| (key.clone(), false)))
            .collect();
        self.logs
            .update(known.iter().map(|(key, running)| (key.as_str(), *running)));
        let shipped: Vec<String> = self
            .forgotten
            .iter()
            .filter(|key| self.logs.shipped_all(key))
            .cloned()
            .collect();
        for key in shipped {
            self.forgotten.remove(&key);
            if let Err(error) = self.runtime.forget(&key).await {
                tracing::warn!("cannot forget {key}: {error}");
            }
        }
    }
}

fn no_answer(url: &str) -> ClientError {
    ClientError::Transport {
        url: url.to_string(),
        reason: "no answer before the lease deadline".to_string(),
        sent: true,
    }
}

/// A desired allocation as the core takes it (the allocation itself is
/// what a start needs).
fn desired(allocation: DesiredAllocation) -> DesiredTask<DesiredAllocation> {
    DesiredTask {
        task: TaskId {
            allocation: allocation.allocation,
            generation: allocation.generation,
        },
        job: allocation.job,
        gpus: allocation.gpus.clone(),
        stop: allocation.stop,
        stop_signal: Signal::parse(&allocation.stop_signal).unwrap_or(Signal::Term),
        grace_period_ms: allocation.grace_period_ms,
        launch: allocation,
    }
}

/// The task a runtime name stands for.
fn task_of(key: &str) -> Option<TaskId> {
    let (_, allocation, generation) = parse_key(key)?;
    Some(TaskId {
        allocation,
        generation,
    })
}

/// How a task ended, as the core takes it.
fn ended(exit: &TaskExit) -> node::TaskExit {
    match (&exit.reason, exit.exit_code, exit.signal) {
        (EndReason::Fenced, _, _) => node::TaskExit::Fenced,
        (EndReason::MemoryLimit, code, _) => node::TaskExit::MemoryLimit(code),
        (_, Some(code), _) => node::TaskExit::Code(code),
        (_, None, Some(signal)) => node::TaskExit::Signal(signal),
        (_, None, None) => node::TaskExit::Vanished,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn task_keys_round_trip() {
        assert_eq!(
            super::parse_key(&super::task_key(7, 12, 345)),
            Some((Some(7), 12, 345))
        );
        assert_eq!(super::parse_key("a12-g345"), Some((None, 12, 345)));
        assert_eq!(super::parse_key("junk"), None);
    }
}
