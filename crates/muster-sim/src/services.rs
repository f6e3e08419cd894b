//! Serving beside training (issue 16): autoscaled services whose request
//! rate follows a day's curve, and a stream of training jobs, on a cluster
//! with an inference pool, minute by minute through the production rules:
//! `muster_control::services::autoscale` sets each service's replicas, and
//! `muster_sched::schedule` (with preemption) places replicas and training,
//! the inference pool's nodes filtered and borrowers preempted exactly as
//! the server's cycle does. Compares two ways to run the pool:
//!
//! - `dedicated`: training never runs on the inference pool;
//! - `borrow`: training borrows idle inference GPUs as preemptible work, and
//!   a replica that needs room preempts it (its work since its last
//!   checkpoint is lost; it is queued again).
//!
//! Pure and deterministic (a seed draws the training jobs).

use muster_control::services::{AutoscalerState, Load, autoscale};
use muster_model::{
    Autoscale, CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, MemoryMib, NodeName, NodeSpec,
    PoolName, QueueName, QueueSpec, RackName, ScaleMetric, Time,
};
use muster_sched::{
    Allocation, NodeInput, PendingJob, ReservedAccess, RunningJob, SchedulingPolicy, Snapshot,
    TaskRequest, schedule,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// What to simulate.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceMixConfig {
    /// Nodes of the inference pool and of the general pool.
    pub inference_nodes: u32,
    pub general_nodes: u32,
    pub gpus_per_node: u32,
    /// Services, one GPU a replica.
    pub services: u32,
    /// Each service's busiest request rate (requests/s); the quietest hour
    /// is `trough` of it.
    pub peak_rps: f64,
    pub trough: f64,
    /// The autoscaler's target, requests/s a replica; a replica serves at
    /// most `capacity_rps`.
    pub target_rps: f64,
    pub capacity_rps: f64,
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub window: Duration,
    /// From a replica's start to its first request (model loading).
    pub replica_startup: Duration,
    /// A borrower's grace period: a replica that preempts starts this
    /// much later.
    pub grace: Duration,
    /// Training's offered load: GPU-time asked per hour, as a share of all
    /// the cluster's GPUs.
    pub training_load: f64,
    /// Mean training job length (exponentially distributed, 5 min to 24 h).
    pub mean_job: Duration,
    pub checkpoint_interval: Duration,
    pub hours: u64,
    pub step: Duration,
    pub seed: u64,
}

impl Default for ServiceMixConfig {
    fn default() -> Self {
        ServiceMixConfig {
            inference_nodes: 4,
            general_nodes: 12,
            gpus_per_node: 8,
            services: 4,
            peak_rps: 160.0,
            trough: 0.15,
            target_rps: 20.0,
            capacity_rps: 25.0,
            min_replicas: 1,
            max_replicas: 8,
            window: Duration::from_secs(600),
            replica_startup: Duration::from_secs(120),
            grace: Duration::from_secs(30),
            training_load: 0.9,
            mean_job: Duration::from_secs(3 * 3600),
            checkpoint_interval: Duration::from_secs(1800),
            hours: 48,
            step: Duration::from_secs(60),
            seed: 1,
        }
    }
}

/// How the inference pool is run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolSharing {
    Dedicated,
    Borrow,
}

impl PoolSharing {
    pub fn name(self) -> &'static str {
        match self {
            PoolSharing::Dedicated => "dedicated",
            PoolSharing::Borrow => "borrow",
        }
    }
}

/// What one run measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ServiceMixResult {
    pub sharing: PoolSharing,
    /// Requests served within the ready replicas' capacity, of all offered.
    pub served_pct: f64,
    /// Replica-minutes the autoscaler asked for that were not ready.
    pub replica_minutes_short: f64,
    /// Mean wait of a replica from being asked for to running (minutes).
    pub replica_wait_min: f64,
    pub replica_starts: u64,
    pub training_jobs_done: u64,
    pub training_gpu_hours_done: f64,
    /// Mean completion time of the training jobs that finished (hours).
    pub training_jct_h: f64,
    pub training_preemptions: u64,
    pub training_gpu_hours_lost: f64,
    /// Allocated GPU time over the whole cluster's (%).
    pub cluster_allocated_pct: f64,
    /// Allocated GPU time of the inference pool's GPUs (%).
    pub inference_allocated_pct: f64,
}

struct TrainingJob {
    gpus: u32,
    submitted_s: u64,
    /// Work left (s).
    remaining_s: u64,
    /// Since its (re)start, and its last checkpoint.
    started_s: Option<u64>,
    node: Option<NodeName>,
    gpu_indices: Vec<u32>,
}

struct ReplicaJob {
    service: u32,
    asked_s: u64,
    started_s: Option<u64>,
    node: Option<NodeName>,
    gpu_index: u32,
}

/// One service's request rate at `t` seconds: a day's sine between
/// `trough` and 1 of the peak, each service's day shifted a little.
pub fn request_rate(config: &ServiceMixConfig, service: u32, t: u64) -> f64 {
    let shift = f64::from(service) * 3600.0 * 2.0;
    let phase = ((t as f64 + shift) / 86_400.0) * std::f64::consts::TAU;
    // Lowest at 04:00, highest at 16:00.
    let wave = (1.0 - (phase - std::f64::consts::TAU * 4.0 / 24.0).cos()) / 2.0;
    config.peak_rps * (config.trough + (1.0 - config.trough) * wave)
}

fn nodes(config: &ServiceMixConfig) -> Vec<NodeInput> {
    let mut nodes = Vec::new();
    for (pool, count, reserved) in [
        ("inference", config.inference_nodes, true),
        ("general", config.general_nodes, false),
    ] {
        for i in 0..count {
            let name = format!("{pool}-{i:03}");
            let mut input = NodeInput::schedulable(NodeSpec {
                name: NodeName::from(name.as_str()),
                pool: PoolName::from(pool),
                rack: RackName::from(pool),
                gpus: (0..config.gpus_per_node)
                    .map(|index| GpuSpec {
                        index,
                        uuid: format!("GPU-{name}-{index}"),
                        model: GpuModel::new("H100-80GB"),
                        memory: MemoryMib(80 * 1024),
                        nvlink_domain: 0,
                    })
                    .collect(),
                cpu: CpuMilli(u64::from(config.gpus_per_node) * 16_000),
                memory: MemoryMib(u64::from(config.gpus_per_node) * 128 * 1024),
            });
            input.reserved = reserved;
            nodes.push(input);
        }
    }
    nodes
}

/// Runs the mix with the inference pool run as `sharing`.
pub fn run_service_mix(config: &ServiceMixConfig, sharing: PoolSharing) -> ServiceMixResult {
    let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
    let step_s = config.step.as_secs().max(1);
    let end_s = config.hours * 3600;
    let total_gpus =
        u64::from(config.gpus_per_node) * u64::from(config.inference_nodes + config.general_nodes);
    let inference_gpus = u64::from(config.gpus_per_node) * u64::from(config.inference_nodes);
    let sizes = [(1u32, 0.5), (2, 0.2), (4, 0.15), (8, 0.15)];
    let mean_gpus: f64 = sizes
        .iter()
        .map(|(gpus, share)| f64::from(*gpus) * share)
        .sum();
    let mean_job_s = config.mean_job.as_secs_f64().max(1.0);
    // Arrivals per second for the offered load.
    let arrivals_per_s = config.training_load * total_gpus as f64 / (mean_gpus * mean_job_s);
    let rule = Autoscale {
        min_replicas: config.min_replicas,
        max_replicas: config.max_replicas,
        metric: ScaleMetric::RequestRate(config.target_rps),
        window: config.window,
    };
    let policy = SchedulingPolicy {
        preemption: true,
        ..SchedulingPolicy::default()
    };
    let snapshot_nodes = nodes(config);
    let mut training: BTreeMap<u64, TrainingJob> = BTreeMap::new();
    let mut replicas: BTreeMap<u64, ReplicaJob> = BTreeMap::new();
    let mut autoscalers: Vec<AutoscalerState> = (0..config.services)
        .map(|_| AutoscalerState::default())
        .collect();
    let mut desired: Vec<u32> = vec![config.min_replicas; config.services as usize];
    let mut next_id = 1u64;
    let mut result = ServiceMixResult {
        sharing,
        served_pct: 0.0,
        replica_minutes_short: 0.0,
        replica_wait_min: 0.0,
        replica_starts: 0,
        training_jobs_done: 0,
        training_gpu_hours_done: 0.0,
        training_jct_h: 0.0,
        training_preemptions: 0,
        training_gpu_hours_lost: 0.0,
        cluster_allocated_pct: 0.0,
        inference_allocated_pct: 0.0,
    };
    let (mut offered, mut served) = (0.0, 0.0);
    let (mut allocated_gpu_s, mut inference_gpu_s, mut training_gpu_s) = (0.0, 0.0, 0.0);
    let mut jct_sum_s = 0.0;
    let mut wait_sum_s = 0.0;
    let mut t = 0;
    while t < end_s {
        // Training arrivals this step (Bernoulli per sub-interval keeps the
        // mean; steps are short against job lengths).
        let expected = arrivals_per_s * step_s as f64;
        let mut arrivals = expected.floor() as u64;
        if rng.random::<f64>() < expected.fract() {
            arrivals += 1;
        }
        for _ in 0..arrivals {
            let draw: f64 = rng.random();
            let mut cumulative = 0.0;
            let mut gpus = 1;
            for (size, share) in sizes {
                cumulative += share;
                if draw < cumulative {
                    gpus = size;
                    break;
                }
            }
            let u: f64 = rng.random::<f64>().max(1e-12);
            let length = (-u.ln() * mean_job_s).clamp(300.0, 86_400.0) as u64;
            training.insert(
                next_id,
                TrainingJob {
                    gpus,
                    submitted_s: t,
                    remaining_s: length,
                    started_s: None,
                    node: None,
                    gpu_indices: Vec::new(),
                },
            );
            next_id += 1;
        }
        // Services: the load, the autoscaler, the replicas asked for.
        for service in 0..config.services {
            let rate = request_rate(config, service, t);
            let index = service as usize;
            let mine: Vec<u64> = replicas
                .iter()
                .filter(|(_, replica)| replica.service == service)
                .map(|(&id, _)| id)
                .collect();
            let ready = mine
                .iter()
                .filter(|id| {
                    replicas[*id]
                        .started_s
                        .is_some_and(|started| t >= started + config.replica_startup.as_secs())
                })
                .count() as u32;
            let load = Load {
                request_rate: rate,
                ready,
                ..Load::default()
            };
            let (count, _) = autoscale(
                Time::from_secs(t),
                &rule,
                desired[index],
                &load,
                &mut autoscalers[index],
            );
            desired[index] = count;
            offered += rate * step_s as f64;
            served += rate.min(f64::from(ready) * config.capacity_rps) * step_s as f64;
            let need = (rate / config.target_rps).ceil() as u32;
            result.replica_minutes_short += f64::from(
                need.clamp(config.min_replicas, config.max_replicas)
                    .saturating_sub(ready),
            ) * step_s as f64
                / 60.0;
            let have = mine.len() as u32;
            if have < count {
                for _ in have..count {
                    replicas.insert(
                        next_id,
                        ReplicaJob {
                            service,
                            asked_s: t,
                            started_s: None,
                            node: None,
                            gpu_index: 0,
                        },
                    );
                    next_id += 1;
                }
            } else if have > count {
                // Pending ones first, then the newest.
                let mut order = mine.clone();
                order.sort_by_key(|id| {
                    let replica = &replicas[id];
                    (
                        replica.started_s.is_some(),
                        std::cmp::Reverse(replica.started_s),
                    )
                });
                for id in order.into_iter().take((have - count) as usize) {
                    replicas.remove(&id);
                }
            }
        }
        // One scheduling cycle.
        let mut running = Vec::new();
        for (&id, job) in &training {
            if let (Some(started), Some(node)) = (job.started_s, &job.node) {
                running.push(RunningJob {
                    id: JobId(id),
                    queue: QueueName::from("training"),
                    priority: 100,
                    started: Time::from_secs(started),
                    tasks: vec![allocation(node, &job.gpu_indices, job.gpus)],
                    expected_end: Some(Time::from_secs(started + job.remaining_s)),
                    preemptible: true,
                    checkpoint_interval_ms: Some(config.checkpoint_interval.as_millis() as u64),
                    service: false,
                });
            }
        }
        for (&id, replica) in &replicas {
            if let (Some(started), Some(node)) = (replica.started_s, &replica.node) {
                running.push(RunningJob {
                    id: JobId(id),
                    queue: QueueName::from("serving"),
                    priority: 1000,
                    started: Time::from_secs(started),
                    tasks: vec![allocation(node, &[replica.gpu_index], 1)],
                    expected_end: None,
                    preemptible: false,
                    checkpoint_interval_ms: None,
                    service: true,
                });
            }
        }
        let mut pending = Vec::new();
        for (&id, replica) in &replicas {
            if replica.started_s.is_none() {
                pending.push(PendingJob {
                    id: JobId(id),
                    queue: QueueName::from("serving"),
                    priority: 1000,
                    submitted: Time::from_secs(replica.asked_s),
                    tasks: 1,
                    request: request(1, Some("inference"), ReservedAccess::Service),
                    same_rack: None,
                    estimated_runtime_ms: None,
                    apart: None,
                });
            }
        }
        let access = match sharing {
            PoolSharing::Dedicated => ReservedAccess::No,
            PoolSharing::Borrow => ReservedAccess::Borrow,
        };
        for (&id, job) in &training {
            if job.started_s.is_none() {
                pending.push(PendingJob {
                    id: JobId(id),
                    queue: QueueName::from("training"),
                    priority: 100,
                    submitted: Time::from_secs(job.submitted_s),
                    tasks: 1,
                    request: request(job.gpus, None, access),
                    same_rack: None,
                    estimated_runtime_ms: Some(job.remaining_s * 1000),
                    apart: None,
                });
            }
        }
        let snapshot = Snapshot {
            now: Time::from_secs(t),
            nodes: snapshot_nodes.clone(),
            running,
            queues: vec![
                QueueSpec::best_effort("serving"),
                QueueSpec::best_effort("training"),
            ],
            usage: BTreeMap::new(),
            workload: None,
        };
        let mut cycle_rng = ChaCha8Rng::seed_from_u64(config.seed ^ t);
        if let Ok(outcome) = schedule(&snapshot, &pending, &policy, &mut cycle_rng) {
            for preemption in &outcome.preemptions {
                if let Some(job) = training.get_mut(&preemption.victim.0) {
                    let ran = t.saturating_sub(job.started_s.unwrap_or(t));
                    let interval = config.checkpoint_interval.as_secs().max(1);
                    let kept = ran - ran % interval;
                    let lost = ran - kept;
                    job.remaining_s = job.remaining_s.saturating_sub(kept);
                    result.training_gpu_hours_lost += (lost * u64::from(job.gpus)) as f64 / 3600.0;
                    result.training_preemptions += 1;
                    job.started_s = None;
                    job.node = None;
                    job.gpu_indices.clear();
                }
            }
            for start in &outcome.started {
                let Some(task) = start.tasks.first() else {
                    continue;
                };
                let gpus: Vec<u32> = task.gpus.iter().map(|(index, _)| *index).collect();
                if let Some(job) = training.get_mut(&start.job.0) {
                    job.started_s = Some(t);
                    job.node = Some(task.node.clone());
                    job.gpu_indices = gpus;
                } else if let Some(replica) = replicas.get_mut(&start.job.0) {
                    // After preempting, the borrowers' grace runs first.
                    let delay = if start.after_preempting.is_empty() {
                        0
                    } else {
                        config.grace.as_secs()
                    };
                    let t = t + delay;
                    replica.started_s = Some(t);
                    replica.node = Some(task.node.clone());
                    replica.gpu_index = gpus.first().copied().unwrap_or(0);
                    result.replica_starts += 1;
                    wait_sum_s += (t - replica.asked_s) as f64;
                }
            }
        }
        // Time passes: GPUs held, training progresses and ends.
        for job in training.values() {
            if let Some(node) = &job.node {
                let held = f64::from(job.gpus) * step_s as f64;
                allocated_gpu_s += held;
                training_gpu_s += held;
                if node.0.starts_with("inference") {
                    inference_gpu_s += held;
                }
            }
        }
        let replicas_running = replicas
            .values()
            .filter(|replica| replica.node.is_some())
            .count() as f64;
        allocated_gpu_s += replicas_running * step_s as f64;
        inference_gpu_s += replicas_running * step_s as f64;
        let mut done = Vec::new();
        for (&id, job) in training.iter_mut() {
            if job.started_s.is_some() {
                if job.remaining_s <= step_s {
                    done.push(id);
                } else {
                    job.remaining_s -= step_s;
                }
            }
        }
        for id in done {
            if let Some(job) = training.remove(&id) {
                result.training_jobs_done += 1;
                jct_sum_s += (t + step_s - job.submitted_s) as f64;
            }
        }
        t += step_s;
    }
    // Work done: GPU time the training held, less what preemption lost.
    result.training_gpu_hours_done =
        (training_gpu_s / 3600.0 - result.training_gpu_hours_lost).max(0.0);
    result.served_pct = if offered > 0.0 {
        100.0 * served / offered
    } else {
        100.0
    };
    result.replica_wait_min = if result.replica_starts > 0 {
        wait_sum_s / result.replica_starts as f64 / 60.0
    } else {
        0.0
    };
    result.training_jct_h = if result.training_jobs_done > 0 {
        jct_sum_s / result.training_jobs_done as f64 / 3600.0
    } else {
        0.0
    };
    let span = end_s as f64;
    result.cluster_allocated_pct = 100.0 * allocated_gpu_s / (total_gpus as f64 * span);
    result.inference_allocated_pct = 100.0 * inference_gpu_s / (inference_gpus as f64 * span);
    result
}

fn allocation(node: &NodeName, gpus: &[u32], count: u32) -> Allocation {
    Allocation {
        node: node.clone(),
        gpus: gpus.iter().map(|&index| (index, 1000)).collect(),
        cpu: CpuMilli(u64::from(count) * 8_000),
        memory: MemoryMib(u64::from(count) * 64 * 1024),
    }
}

fn request(gpus: u32, pool: Option<&str>, reserved: ReservedAccess) -> TaskRequest {
    TaskRequest {
        gpus: GpuRequest::Whole(gpus),
        cpu: CpuMilli(u64::from(gpus) * 8_000),
        memory: MemoryMib(u64::from(gpus) * 64 * 1024),
        gpu_models: Vec::new(),
        min_gpu_memory: None,
        pool: pool.map(PoolName::from),
        container: false,
        reserved,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ServiceMixConfig {
        ServiceMixConfig {
            inference_nodes: 2,
            general_nodes: 4,
            services: 2,
            peak_rps: 120.0,
            hours: 24,
            step: Duration::from_secs(120),
            ..ServiceMixConfig::default()
        }
    }

    #[test]
    fn the_request_rate_follows_a_day_between_trough_and_peak() {
        let config = small();
        let rates: Vec<f64> = (0..24)
            .map(|h| request_rate(&config, 0, h * 3600))
            .collect();
        let low = rates.iter().copied().fold(f64::MAX, f64::min);
        let high = rates.iter().copied().fold(0.0, f64::max);
        assert!(
            (low - config.peak_rps * config.trough).abs() < 1.0,
            "{rates:?}"
        );
        assert!((high - config.peak_rps).abs() < 1.0, "{rates:?}");
        assert!(rates[4] < rates[16], "quiet at 04:00, busy at 16:00");
    }

    #[test]
    fn borrowing_uses_idle_inference_gpus_for_training_and_yields_to_serving() {
        let config = small();
        let dedicated = run_service_mix(&config, PoolSharing::Dedicated);
        let borrow = run_service_mix(&config, PoolSharing::Borrow);
        // Serving is as good either way: replicas preempt borrowers.
        assert!(dedicated.served_pct > 95.0, "{dedicated:?}");
        assert!(
            borrow.served_pct > dedicated.served_pct - 2.0,
            "{borrow:?} {dedicated:?}"
        );
        // Training gets the idle inference GPUs, and pays with preemptions.
        assert_eq!(dedicated.training_preemptions, 0);
        assert!(borrow.training_preemptions > 0, "{borrow:?}");
        assert!(
            borrow.training_gpu_hours_done > dedicated.training_gpu_hours_done,
            "{borrow:?} {dedicated:?}"
        );
        assert!(borrow.inference_allocated_pct > dedicated.inference_allocated_pct);
        // Deterministic.
        assert_eq!(run_service_mix(&config, PoolSharing::Borrow), borrow);
    }
}
