//! The agent's main loop: register, heartbeat (a long poll that also renews
//! the lease and brings the desired allocations), start and stop tasks as
//! `muster-node` decides, report exits, ship logs, fence when the lease
//! cannot be renewed.

use crate::gpu::GpuBackend;
use crate::runtime::{CgroupPlan, EndReason, ProcessRuntime, RuntimeConfig, TaskExit, TaskLaunch};
use muster_api::client::Client;
use muster_api::protocol::{
    DesiredAllocation, GpuView, HeartbeatRequest, ObservedAllocation, RegisterRequest,
};
use muster_model::Signal;
use muster_node::{Action, Desired, Local};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Everything `muster agent` needs.
#[derive(Clone)]
pub struct AgentConfig {
    /// `http://host:port` of the server.
    pub server: String,
    pub join_token: String,
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
    /// Whom tasks run as when the job's user does not exist here.
    pub task_user: String,
    /// Tasks may run as root on this node.
    pub allow_root_tasks: bool,
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A task's name on this node (its files are named after it): the job, the
/// allocation and its generation.
fn task_key(job: u64, allocation: u64, generation: u64) -> String {
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

/// The name of the local task running `allocation` at `generation`.
fn local_key(tasks: &BTreeMap<String, Task>, allocation: u64, generation: u64) -> Option<String> {
    tasks
        .keys()
        .find(|key| parse_key(key).is_some_and(|(_, a, g)| (a, g) == (allocation, generation)))
        .cloned()
}

#[derive(Debug, Clone)]
struct Task {
    running: bool,
    stopping: bool,
    /// Stopped because the lease could not be renewed.
    fenced: bool,
    exit: Option<TaskExit>,
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
/// agent restart; a new agent finds them through the runtime's pid files.
pub async fn run(
    config: AgentConfig,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), String> {
    tokio::pin!(shutdown);
    let runtime = Arc::new(ProcessRuntime::new(RuntimeConfig {
        state_dir: config.state_dir.clone(),
        supervisor: config.supervisor.clone(),
        cgroups: config.cgroups.clone(),
        task_user: config.task_user.clone(),
        allow_root: config.allow_root_tasks,
    }));
    let inventory = config.backend.inventory().map_err(|e| e.to_string())?;
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
    let epoch = now_ms();
    let register = RegisterRequest {
        name: config.name.clone(),
        address: config.address.clone(),
        epoch,
        gpus,
        cpu_milli: machine_cpu_milli(),
        memory_mib: machine_memory_mib(),
        pool: config.pool.clone(),
        rack: config.rack.clone(),
        backend: inventory.backend.to_string(),
        driver_version: inventory.driver_version.clone(),
        cuda_version: inventory.cuda_version.clone(),
    };
    let joiner = Client::new(&config.server, &config.join_token);
    // Task logs go out on their own task and connection, never in the way
    // of a heartbeat; a task is forgotten only once its log is shipped.
    let logs = crate::logship::LogShipper::start(
        &config.server,
        &config.name,
        Arc::clone(&runtime),
        config.log_shipping.clone(),
    );

    // Tasks of an earlier agent on this node.
    let mut tasks: BTreeMap<String, Task> = BTreeMap::new();
    if let Ok(recovery) = runtime.recover().await {
        for found in recovery.tasks {
            let (running, exit) = match found.status {
                crate::runtime::RecoveredStatus::Running => (true, None),
                crate::runtime::RecoveredStatus::Exited(exit) => (false, Some(exit)),
                crate::runtime::RecoveredStatus::Gone => (false, None),
            };
            tasks.insert(
                found.allocation.clone(),
                Task {
                    running,
                    stopping: false,
                    fenced: false,
                    exit,
                },
            );
        }
    }

    // When this node last renewed its lease, and how long the lease is, kept
    // on disk: a restarted agent that cannot reach the server must still
    // fence the tasks it recovered before their lease runs out.
    let lease_file = config.state_dir.join("lease.json");
    let (mut last_renewal, mut lease_ms) = std::fs::read_to_string(&lease_file)
        .ok()
        .and_then(|text| serde_json::from_str::<serde_json::Value>(&text).ok())
        .and_then(|v| Some((v["last_renewal_ms"].as_u64()?, v["lease_ms"].as_u64()?)))
        .unwrap_or((now_ms(), 10_000));
    let fence_margin = config.fence_margin;
    let save_renewal = |last: u64, lease: u64| {
        let margin = (fence_margin.as_millis() as u64).min(lease / 4);
        // Every task's supervisor kills its task past this deadline, half a
        // margin before the lease ends, whether or not this agent is alive.
        if let Err(error) = runtime.set_fence_deadline((last + lease).saturating_sub(margin / 2)) {
            tracing::error!("cannot write the fence deadline: {error}");
        }
        let text = serde_json::json!({"last_renewal_ms": last, "lease_ms": lease}).to_string();
        let temporary = lease_file.with_extension("tmp");
        if std::fs::write(&temporary, text).is_ok() {
            let _ = std::fs::rename(&temporary, &lease_file);
        }
    };
    let mut unhealthy_gpus: Vec<u32> = Vec::new();
    let mut backoff = Duration::from_millis(200);
    'register: loop {
        // Tasks found again after a restart, or left from before a refused
        // heartbeat, must not outlive the lease while this node registers.
        let margin = (config.fence_margin.as_millis() as u64).min(lease_ms / 4);
        if muster_node::must_fence(now_ms(), last_renewal, lease_ms, margin)
            && tasks.values().any(|t| t.running && !t.stopping)
        {
            tracing::warn!("lease not renewed in time: stopping every task (fenced)");
            apply(&runtime, &uuids, &[], &mut tasks, true).await;
        }
        let sent = now_ms();
        let remaining = (last_renewal + lease_ms)
            .saturating_sub(margin)
            .saturating_sub(sent);
        let limit = Duration::from_millis(if remaining == 0 {
            5_000
        } else {
            remaining.min(5_000)
        });
        let registered = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            result = tokio::time::timeout(limit, joiner.register(&register)) => {
                result.unwrap_or_else(|_| Err(muster_api::client::ClientError::Transport {
                    url: config.server.clone(),
                    reason: "no answer to the registration".to_string(),
                }))
            }
        };
        let registered = match registered {
            Ok(registered) => registered,
            Err(error) => {
                if error.code().is_some() {
                    return Err(format!("the server refused to register this node: {error}"));
                }
                tracing::warn!("cannot register yet: {error}");
                let margin = (config.fence_margin.as_millis() as u64).min(lease_ms / 4);
                if muster_node::must_fence(now_ms(), last_renewal, lease_ms, margin)
                    && tasks.values().any(|t| t.running && !t.stopping)
                {
                    tracing::warn!("lease not renewed in time: stopping every task (fenced)");
                    apply(&runtime, &uuids, &[], &mut tasks, true).await;
                }
                tokio::select! {
                    _ = &mut shutdown => return Ok(()),
                    _ = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(5));
                continue;
            }
        };
        let client = Client::new(&config.server, &registered.node_token);
        logs.set_token(&registered.node_token);
        lease_ms = registered.lease_ms;
        let wait_ms = registered.heartbeat_ms;
        last_renewal = sent;
        save_renewal(last_renewal, lease_ms);
        let mut version = 0u64;
        let mut desired: Vec<DesiredAllocation> = Vec::new();
        loop {
            // Exits since the last round.
            while let Some(exit) = runtime.try_next_exit() {
                if let Some(task) = tasks.get_mut(&exit.allocation) {
                    task.running = false;
                    task.exit = Some(exit);
                }
            }
            logs.update(tasks.iter().map(|(key, task)| (key.as_str(), task.running)));
            let observed: Vec<ObservedAllocation> = tasks
                .iter()
                .filter_map(|(key, task)| {
                    let (_, allocation, generation) = parse_key(key)?;
                    Some(ObservedAllocation {
                        allocation,
                        generation,
                        exited: if task.running {
                            None
                        } else {
                            Some(task.exit.as_ref().and_then(|e| e.exit_code))
                        },
                        fenced: task.fenced
                            || task
                                .exit
                                .as_ref()
                                .is_some_and(|e| e.reason == EndReason::Fenced),
                    })
                })
                .collect();
            // The server renews the lease when the request arrives: count
            // from when it was sent, and give up on an answer once the lease
            // could have run out (a black-holed connection must not delay
            // fencing). The long poll must end well within that budget.
            let margin = (config.fence_margin.as_millis() as u64).min(lease_ms / 4);
            let sent = now_ms();
            let remaining = (last_renewal + lease_ms)
                .saturating_sub(margin)
                .saturating_sub(sent);
            // GPU health, as the backend sees it now (a failed read keeps
            // the last answer).
            // NVML calls block: off the async threads.
            let backend = Arc::clone(&config.backend);
            let telemetry = tokio::task::spawn_blocking(move || backend.telemetry()).await;
            if let Ok(Ok(telemetry)) = telemetry {
                unhealthy_gpus = telemetry
                    .iter()
                    .filter(|gpu| !gpu.healthy)
                    .map(|gpu| gpu.index)
                    .collect();
            }
            let request = HeartbeatRequest {
                epoch,
                observed,
                unhealthy_gpus: unhealthy_gpus.clone(),
                wait_ms: wait_ms.min(remaining / 3),
                known_version: version,
                sequence: 0,
            };
            let limit = if remaining == 0 {
                Duration::from_secs(5)
            } else {
                Duration::from_millis(remaining)
            };
            let answer = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                // A task ended: report it now rather than when the long poll
                // returns (the server handles the abandoned request anyway).
                exit = runtime.next_exit() => {
                    if let Some(task) = tasks.get_mut(&exit.allocation) {
                        task.running = false;
                        task.exit = Some(exit);
                    }
                    continue;
                }
                answer = tokio::time::timeout(limit, client.heartbeat(&config.name, &request)) => {
                    answer.unwrap_or_else(|_| Err(muster_api::client::ClientError::Transport {
                        url: config.server.clone(),
                        reason: "no answer before the lease deadline".to_string(),
                    }))
                }
            };
            let fenced = match answer {
                Ok(answer) => {
                    last_renewal = sent;
                    save_renewal(last_renewal, lease_ms);
                    version = answer.version;
                    desired = answer.desired;
                    false
                }
                Err(error) => {
                    if error.code() == Some(muster_api::protocol::ErrorCode::Conflict)
                        || error.code() == Some(muster_api::protocol::ErrorCode::Unauthenticated)
                        || error.code() == Some(muster_api::protocol::ErrorCode::NotFound)
                    {
                        tracing::warn!("registering again: {error}");
                        continue 'register;
                    }
                    tracing::warn!("heartbeat failed: {error}");
                    let fenced = muster_node::must_fence(now_ms(), last_renewal, lease_ms, margin);
                    tokio::select! {
                        _ = &mut shutdown => return Ok(()),
                        _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    }
                    fenced
                }
            };
            if fenced {
                tracing::warn!("lease not renewed in time: stopping every task (fenced)");
            }
            apply(&runtime, &uuids, &desired, &mut tasks, fenced).await;
            // Forget tasks the server no longer lists once their exit was
            // reported and their logs shipped.
            let listed: std::collections::BTreeSet<(u64, u64)> = desired
                .iter()
                .map(|d| (d.allocation, d.generation))
                .collect();
            let done: Vec<String> = tasks
                .iter()
                .filter(|(key, task)| {
                    !task.running
                        && !parse_key(key).is_some_and(|(_, a, g)| listed.contains(&(a, g)))
                        && logs.shipped_all(key)
                })
                .map(|(key, _)| key.clone())
                .collect();
            for key in done {
                tasks.remove(&key);
                let _ = runtime.forget(&key).await;
            }
        }
    }
}

async fn apply(
    runtime: &Arc<ProcessRuntime>,
    uuids: &BTreeMap<u32, String>,
    desired: &[DesiredAllocation],
    tasks: &mut BTreeMap<String, Task>,
    fenced: bool,
) {
    let wanted: Vec<Desired> = desired
        .iter()
        .map(|d| Desired {
            allocation: d.allocation,
            generation: d.generation,
            job: d.job,
            stop: d.stop,
        })
        .collect();
    let local: Vec<Local> = tasks
        .iter()
        .filter_map(|(key, task)| {
            let (job, allocation, generation) = parse_key(key)?;
            Some(Local {
                allocation,
                generation,
                job,
                running: task.running,
                stopping: task.stopping,
            })
        })
        .collect();
    for action in muster_node::reconcile(&wanted, &local, fenced) {
        match action {
            Action::Start {
                allocation,
                generation,
            } => {
                let Some(spec) = desired
                    .iter()
                    .find(|d| d.allocation == allocation && d.generation == generation)
                else {
                    continue;
                };
                let key = task_key(spec.job, allocation, generation);
                let launch = TaskLaunch {
                    allocation: key.clone(),
                    command: spec.command.clone(),
                    env: spec.env.clone(),
                    working_dir: spec.working_dir.as_ref().map(PathBuf::from),
                    gpu_indices: spec.gpus.clone(),
                    gpu_uuids: spec
                        .gpus
                        .iter()
                        .filter_map(|i| uuids.get(i).cloned())
                        .collect(),
                    stop_signal: Signal::parse(&spec.stop_signal).unwrap_or(Signal::Term),
                    grace_period: Duration::from_millis(spec.grace_period_ms),
                    user: spec.user.clone(),
                    memory_limit_mib: spec.memory_mib,
                };
                match runtime.start(launch).await {
                    Ok(()) => {
                        tasks.insert(
                            key,
                            Task {
                                running: true,
                                stopping: false,
                                fenced: false,
                                exit: None,
                            },
                        );
                    }
                    Err(error) => {
                        // Reported as a failed task (exit code 127, as a
                        // shell would for a missing command).
                        tracing::warn!("cannot start {key}: {error}");
                        // The supervisor wrote why into the task's log when
                        // it got that far; otherwise the agent does.
                        let log = runtime.log_path(&key);
                        if !log.exists() {
                            if let Some(parent) = log.parent() {
                                let _ = std::fs::create_dir_all(parent);
                            }
                            let _ = std::fs::write(&log, format!("muster: {error}\n"));
                        }
                        tasks.insert(
                            key.clone(),
                            Task {
                                running: false,
                                stopping: false,
                                fenced: false,
                                exit: Some(TaskExit {
                                    allocation: key,
                                    exit_code: Some(127),
                                    signal: None,
                                    reason: EndReason::StartFailed {
                                        message: error.to_string(),
                                    },
                                    usage: Default::default(),
                                }),
                            },
                        );
                    }
                }
            }
            Action::Stop {
                allocation,
                generation,
            } => {
                let Some(key) = local_key(tasks, allocation, generation) else {
                    continue;
                };
                let wanted = desired.iter().find(|d| d.allocation == allocation);
                let signal = wanted
                    .and_then(|d| Signal::parse(&d.stop_signal))
                    .unwrap_or(Signal::Term);
                let grace = Duration::from_millis(muster_node::stop_grace_ms(
                    wanted.map(|d| d.grace_period_ms),
                    fenced,
                ));
                if let Some(task) = tasks.get_mut(&key) {
                    task.stopping = true;
                    task.fenced |= fenced;
                }
                let runtime = Arc::clone(runtime);
                tokio::spawn(async move {
                    if let Err(error) = runtime.stop_as(&key, signal, grace, fenced).await {
                        tracing::warn!("cannot stop {key}: {error}");
                    }
                });
            }
        }
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
