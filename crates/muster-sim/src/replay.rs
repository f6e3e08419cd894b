//! Time replay (Protocols B and C): jobs arrive at their submit times, run
//! for their durations once every task is placed, and leave; a scheduling
//! cycle of the real `muster-sched` engine runs whenever something changed.
//!
//! Policies:
//! - `fifo`: one pooled queue in submit order; nothing passes a blocked job.
//! - `las`: Tiresias-style least attained service: jobs fall through
//!   discretised priority levels as their GPU-time grows; preemptive; any job
//!   that fits may start.
//! - `sjf-oracle`: shortest true duration first, with EASY backfill on true
//!   durations. An oracle: it reads what no real scheduler knows.
//! - `default`: muster's default: a queue per team with guaranteed shares,
//!   fair share by decayed usage, quota reclaim by preemption, EASY backfill
//!   on runtime estimates learned from the team's finished jobs: a job that
//!   has run for a while is expected to take the mean of the team's finished
//!   jobs that ran longer than that (see `muster_sched::RuntimeHistory`).
//!
//! A preempted job loses the work since its last checkpoint
//! ([`ReplayConfig::checkpoint_interval_s`]) and waits again.

use muster_model::{
    CpuMilli, GpuMilli, GpuModel, GpuRequest, JobId, MemoryMib, QueueName, QueueSpec, Time,
};
use muster_sched::{
    Backfill, NodeInput, PendingJob, PendingReason, PlacementPolicy, RunningJob, SchedulingPolicy,
    Snapshot, TaskRequest, UsageLedger, schedule,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::fmt;
use std::str::FromStr;

/// One job of a time-replay trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayJob {
    /// Position in the trace (stable id).
    pub id: u64,
    /// Seconds from the start of the trace.
    pub submit_s: u64,
    /// True run time in seconds.
    pub duration_s: u64,
    /// The team (Philly virtual cluster).
    pub queue: String,
    pub tasks: u32,
    pub gpus_per_task: GpuRequest,
    pub cpu: CpuMilli,
    pub memory: MemoryMib,
    pub gpu_models: Vec<GpuModel>,
}

impl ReplayJob {
    pub fn gpu_milli(&self) -> u64 {
        u64::from(self.gpus_per_task.total().0) * u64::from(self.tasks)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum ReplayPolicy {
    Fifo,
    Las,
    SjfOracle,
    Default,
}

impl ReplayPolicy {
    pub fn name(self) -> &'static str {
        match self {
            ReplayPolicy::Fifo => "fifo",
            ReplayPolicy::Las => "las",
            ReplayPolicy::SjfOracle => "sjf-oracle",
            ReplayPolicy::Default => "default",
        }
    }
}

impl fmt::Display for ReplayPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReplayPolicy {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim() {
            "fifo" => Ok(ReplayPolicy::Fifo),
            "las" => Ok(ReplayPolicy::Las),
            "sjf-oracle" => Ok(ReplayPolicy::SjfOracle),
            "default" => Ok(ReplayPolicy::Default),
            other => Err(format!(
                "unknown replay policy {other:?}; accepted: fifo, las, sjf-oracle, default"
            )),
        }
    }
}

/// Knobs of a replay.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayConfig {
    /// Jobs checkpoint this often; a preemption loses the work since the last
    /// checkpoint. 0: no checkpoints (a preemption loses everything).
    pub checkpoint_interval_s: u64,
    /// LAS: attained-service thresholds in GPU-seconds between priority
    /// levels.
    pub las_thresholds_gpu_s: Vec<u64>,
    /// Fair-share usage half-life.
    pub usage_half_life_s: u64,
    /// How nodes are chosen (the same for every policy, so that the
    /// comparison is about ordering).
    pub placement: PlacementPolicy,
    /// Points kept in the utilisation/queue timeline.
    pub timeline_points: usize,
    /// The `default` policy's queues (guarantees, weights, borrow limits):
    /// `None` for shares proportional to each queue's GPU-time in the
    /// trace. A queue of the trace not named here gets no guarantee.
    pub queues: Option<Vec<QueueSpec>>,
    /// Forecast every job's start when it arrives, with the server's
    /// estimator ([`muster_sched::forecast_starts`]) and these limits, and
    /// report how close the forecasts came ([`ForecastAccuracy`]). `None`:
    /// no forecasts (they cost a plan per arrival).
    pub forecast: Option<muster_sched::ForecastLimits>,
    /// The `default` policy's least-attained-service levels within a
    /// priority class (every replayed job is of class `normal`), as the
    /// server's (`ControlConfig::service_levels`).
    pub service_levels: muster_sched::ServiceLevels,
}

/// The value of the `normal` priority class, every replayed job's.
const NORMAL_CLASS: i32 = 100;

impl Default for ReplayConfig {
    fn default() -> Self {
        ReplayConfig {
            checkpoint_interval_s: 1800,
            las_thresholds_gpu_s: vec![3_600, 36_000, 360_000],
            usage_half_life_s: 7 * 24 * 3600,
            placement: PlacementPolicy::DEFAULT,
            timeline_points: 500,
            queues: None,
            forecast: None,
            service_levels: muster_sched::ServiceLevels::default(),
        }
    }
}

/// How close the start forecasts made when jobs arrived came to when they
/// started (waits counted from submission).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForecastAccuracy {
    /// Jobs that started and waited over 10 minutes.
    pub waited_over_10_min: usize,
    /// Of those, the share whose wait was within 2x of the forecast wait
    /// (half to twice).
    pub within_2x: f64,
    /// Of those, the share forecast too early (waited over twice as long).
    pub too_early: f64,
    /// Of those, the share forecast too late (waited under half as long).
    pub too_late: f64,
    /// Of those, the share with no forecast (unknown) or only "not before".
    pub unknown: f64,
    pub not_before: f64,
    /// Median of actual wait / forecast wait over those with a forecast.
    pub median_ratio: f64,
    /// Every job that waited at all: the share within 2x.
    pub all_waiting_within_2x: f64,
    /// Forecasts made (one per job that did not start on arrival).
    pub forecasts: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QueueResult {
    pub jobs: usize,
    pub mean_jct_s: f64,
    /// Share of all GPU-time used (including work later lost to preemption).
    pub gpu_share: f64,
    /// Guaranteed share given to the queue (0 for pooled policies).
    pub guaranteed_share: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    pub policy: String,
    pub oracle: bool,
    pub jobs: usize,
    pub completed: usize,
    /// Jobs that could never be placed on this cluster (dropped).
    pub unschedulable: usize,
    pub mean_jct_s: f64,
    pub p50_jct_s: f64,
    pub p99_jct_s: f64,
    pub mean_queueing_s: f64,
    pub p50_queueing_s: f64,
    pub p99_queueing_s: f64,
    pub makespan_s: f64,
    pub mean_gpu_utilization: f64,
    pub preemptions: usize,
    /// GPU-seconds of work lost to preemption.
    pub lost_gpu_s: f64,
    pub scheduling_cycles: usize,
    pub per_queue: BTreeMap<String, QueueResult>,
    /// (JCT seconds, fraction of jobs done within it), at most 200 points.
    pub jct_cdf: Vec<(f64, f64)>,
    /// (seconds, busy GPUs, pending jobs), sampled.
    pub timeline: Vec<(f64, f64, usize)>,
    /// With [`ReplayConfig::forecast`]: how good the start forecasts were.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forecast: Option<ForecastAccuracy>,
}

#[derive(Debug, Clone)]
struct Run {
    started_s: u64,
    /// Work left when this run started.
    remaining_s: u64,
}

#[derive(Debug, Clone, Default)]
struct State {
    remaining_s: u64,
    attained_gpu_s: f64,
    first_start_s: Option<u64>,
    finish_s: Option<u64>,
    generation: u64,
    gpu_s_used: f64,
}

/// Guaranteed shares proportional to each queue's GPU-time in the trace,
/// adding up to the cluster's capacity.
pub fn proportional_queues(jobs: &[ReplayJob], capacity_milli: u64) -> Vec<QueueSpec> {
    let mut demand: BTreeMap<&str, f64> = BTreeMap::new();
    for job in jobs {
        *demand.entry(&job.queue).or_default() += job.gpu_milli() as f64 * job.duration_s as f64;
    }
    let total: f64 = demand.values().sum();
    demand
        .into_iter()
        .map(|(name, gpu_time)| QueueSpec {
            name: QueueName::from(name),
            guaranteed: GpuMilli(if total > 0.0 {
                (capacity_milli as f64 * gpu_time / total).floor() as u32
            } else {
                0
            }),
            borrow_limit: None,
            weight: 1,
            idle_timeout: None,
            idle_after: None,
            idle_below_pct: None,
            budget: None,
            members_see_jobs: false,
            max_pending: None,
            max_priority_class: None,
            allow_non_preemptible: false,
        })
        .collect()
}

fn percentile(sorted: &[f64], fraction: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((fraction * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() {
        0.0
    } else {
        values.iter().sum::<f64>() / values.len() as f64
    }
}

const POOLED: &str = "all";

/// Adds a job to running jobs kept sorted by id.
fn insert_running(running: &mut Vec<RunningJob>, job: RunningJob) {
    let at = running.partition_point(|other| other.id < job.id);
    running.insert(at, job);
}

/// Removes job `index` from running jobs kept sorted by id.
fn remove_running(running: &mut Vec<RunningJob>, index: usize) {
    let id = JobId(index as u64);
    if let Ok(at) = running.binary_search_by(|other| other.id.cmp(&id)) {
        running.remove(at);
    }
}

/// Replays `jobs` (sorted by submit time or not) on `nodes` under `policy`.
pub fn replay(
    nodes: &[NodeInput],
    jobs: &[ReplayJob],
    policy: ReplayPolicy,
    config: &ReplayConfig,
    seed: u64,
) -> Result<ReplayResult, muster_sched::ClusterError> {
    let capacity_milli: u64 = muster_sched::ClusterState::new(nodes.to_vec())?.gpu_capacity_milli();
    let queues = match policy {
        ReplayPolicy::Default => match &config.queues {
            None => proportional_queues(jobs, capacity_milli),
            Some(given) => {
                let mut queues = given.clone();
                let named: std::collections::BTreeSet<String> =
                    given.iter().map(|queue| queue.name.0.clone()).collect();
                let missing: std::collections::BTreeSet<&str> = jobs
                    .iter()
                    .map(|job| job.queue.as_str())
                    .filter(|queue| !named.contains(*queue))
                    .collect();
                queues.extend(missing.into_iter().map(QueueSpec::best_effort));
                queues
            }
        },
        _ => vec![QueueSpec::best_effort(POOLED)],
    };
    let scheduling = match policy {
        ReplayPolicy::Fifo => SchedulingPolicy::fifo(config.placement),
        ReplayPolicy::Las => SchedulingPolicy {
            placement: config.placement,
            backfill: Backfill::AnyFit,
            preemption: true,
            fair_share: false,
            aging_step: 0,
            ..SchedulingPolicy::default()
        },
        ReplayPolicy::SjfOracle => SchedulingPolicy {
            placement: config.placement,
            backfill: Backfill::Easy,
            preemption: false,
            fair_share: false,
            aging_step: 0,
            ..SchedulingPolicy::default()
        },
        ReplayPolicy::Default => SchedulingPolicy {
            placement: config.placement,
            ..SchedulingPolicy::default()
        },
    };
    let mut order: Vec<usize> = (0..jobs.len()).collect();
    order.sort_by_key(|&i| (jobs[i].submit_s, jobs[i].id));
    let mut states: Vec<State> = jobs
        .iter()
        .map(|job| State {
            remaining_s: job.duration_s,
            ..State::default()
        })
        .collect();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ledger = UsageLedger::new(config.usage_half_life_s * 1000, Time(0));
    // The scheduler's input is kept from cycle to cycle and updated in
    // place: the nodes are never copied, running jobs keep their
    // allocations, pending jobs their requests (cloning them every cycle
    // was most of the replay's own cost). `snapshot.running` is sorted by
    // id and `pending_jobs` is in arrival order, as they were built before.
    let mut snapshot = Snapshot {
        now: Time::from_secs(0),
        nodes: nodes.to_vec(),
        running: Vec::new(),
        queues: queues.clone(),
        usage: BTreeMap::new(),
        workload: None,
    };
    let mut pending_jobs: Vec<PendingJob> = Vec::new();
    let mut running: BTreeMap<usize, Run> = BTreeMap::new();
    let mut ends: BinaryHeap<Reverse<(u64, usize, u64)>> = BinaryHeap::new();
    // Learned runtime estimates (default policy): per queue (sum, count).
    // Per team, by a slot fixed up front (no name lookups in the loop).
    let mut team_slots: BTreeMap<&str, usize> = BTreeMap::new();
    let team_of: Vec<usize> = jobs
        .iter()
        .map(|job| {
            let next = team_slots.len();
            *team_slots.entry(job.queue.as_str()).or_insert(next)
        })
        .collect();
    let mut learned: Vec<muster_sched::RuntimeHistory> =
        vec![muster_sched::RuntimeHistory::default(); team_slots.len()];
    // Start forecasts made at arrival (kind, time): their own generator, so
    // that forecasting changes none of the replay's decisions.
    let mut forecast_rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_f0ca);
    let mut forecasts: Vec<Option<muster_sched::StartForecast>> = vec![None; jobs.len()];
    let mut arrived: std::collections::BTreeSet<JobId> = std::collections::BTreeSet::new();
    let mut next_arrival = 0;
    let mut now: u64 = order.first().map_or(0, |&i| jobs[i].submit_s);
    let start_s = now;
    let mut preemptions = 0;
    let mut lost_gpu_s = 0.0;
    let mut unschedulable = 0;
    let mut cycles = 0;
    let mut busy_integral = 0.0;
    let mut timeline: Vec<(f64, f64, usize)> = Vec::new();
    let mut busy_milli: u64 = 0;
    let mut last_s = now;
    let queue_of = |job: &ReplayJob| -> QueueName {
        match policy {
            ReplayPolicy::Default => QueueName::from(job.queue.as_str()),
            _ => QueueName::from(POOLED),
        }
    };
    let las_priority = |attained: f64| -> i32 {
        let level = config
            .las_thresholds_gpu_s
            .iter()
            .filter(|&&threshold| attained >= threshold as f64)
            .count();
        1000 - 100 * level as i32
    };
    // Priority and estimate are set before each cycle (see below).
    let pending_job = |index: usize| -> PendingJob {
        let job = &jobs[index];
        PendingJob {
            id: JobId(index as u64),
            queue: queue_of(job),
            priority: 0,
            submitted: Time::from_secs(job.submit_s),
            tasks: job.tasks,
            request: TaskRequest {
                container: false,
                gpus: job.gpus_per_task,
                cpu: job.cpu,
                memory: job.memory,
                gpu_models: job.gpu_models.clone(),
                min_gpu_memory: None,
                pool: None,
                reserved: Default::default(),
            },
            same_rack: None,
            estimated_runtime_ms: None,
            apart: None,
        }
    };

    loop {
        let next_end = ends.peek().map(|Reverse((t, _, _))| *t);
        let next_submit = order.get(next_arrival).map(|&i| jobs[i].submit_s);
        let Some(t) = [next_end, next_submit].into_iter().flatten().min() else {
            break;
        };
        // Advance time: usage, utilisation.
        busy_integral += busy_milli as f64 / 1000.0 * (t - last_s) as f64;
        for &index in running.keys() {
            let gpu = jobs[index].gpu_milli() as f64 / 1000.0 * (t - last_s) as f64;
            states[index].attained_gpu_s += gpu;
            states[index].gpu_s_used += gpu;
        }
        if policy == ReplayPolicy::Default {
            let mut held: BTreeMap<&str, u64> = BTreeMap::new();
            for &index in running.keys() {
                *held.entry(jobs[index].queue.as_str()).or_default() += jobs[index].gpu_milli();
            }
            let held: BTreeMap<QueueName, u64> = held
                .into_iter()
                .map(|(queue, milli)| (QueueName::from(queue), milli))
                .collect();
            ledger.advance(Time::from_secs(t), &held);
        }
        last_s = t;
        now = t;

        while let Some(&Reverse((end, index, generation))) = ends.peek() {
            if end > t {
                break;
            }
            ends.pop();
            if states[index].generation != generation || !running.contains_key(&index) {
                continue; // preempted since
            }
            running.remove(&index);
            remove_running(&mut snapshot.running, index);
            busy_milli -= jobs[index].gpu_milli();
            states[index].finish_s = Some(t);
            states[index].remaining_s = 0;
            learned[team_of[index]].add(jobs[index].duration_s);
        }
        while let Some(&index) = order.get(next_arrival) {
            if jobs[index].submit_s > t {
                break;
            }
            pending_jobs.push(pending_job(index));
            if config.forecast.is_some() {
                arrived.insert(JobId(index as u64));
            }
            next_arrival += 1;
        }
        if pending_jobs.is_empty() {
            continue;
        }

        // One scheduling cycle.
        cycles += 1;
        snapshot.now = Time::from_secs(t);
        snapshot.usage.clone_from(&ledger.gpu_seconds);
        for running_job in &mut snapshot.running {
            let index = running_job.id.0 as usize;
            let Some(run) = running.get(&index) else {
                continue;
            };
            let job = &jobs[index];
            let estimate = match policy {
                ReplayPolicy::SjfOracle => Some(run.remaining_s),
                ReplayPolicy::Default => {
                    let elapsed = t - run.started_s;
                    let done = job.duration_s - run.remaining_s;
                    learned[team_of[index]]
                        .expected_total(done + elapsed)
                        .map(|total| total - done)
                }
                _ => None,
            };
            running_job.priority = match policy {
                ReplayPolicy::Las => las_priority(states[index].attained_gpu_s),
                ReplayPolicy::Default => config.service_levels.running_priority(
                    NORMAL_CLASS,
                    states[index].attained_gpu_s,
                    config.checkpoint_interval_s > 0,
                ),
                _ => 100,
            };
            running_job.expected_end = estimate.map(|e| Time::from_secs(run.started_s + e));
        }
        for pending_job in &mut pending_jobs {
            let index = pending_job.id.0 as usize;
            let job = &jobs[index];
            pending_job.priority = match policy {
                ReplayPolicy::Las => las_priority(states[index].attained_gpu_s),
                ReplayPolicy::Default => config
                    .service_levels
                    .priority(NORMAL_CLASS, states[index].attained_gpu_s),
                ReplayPolicy::SjfOracle => -(job.duration_s.min(i32::MAX as u64) as i32),
                _ => 100,
            };
            pending_job.estimated_runtime_ms = match policy {
                ReplayPolicy::SjfOracle => Some(states[index].remaining_s * 1000),
                ReplayPolicy::Default => {
                    let done = job.duration_s - states[index].remaining_s;
                    learned[team_of[index]]
                        .expected_total(done)
                        .map(|total| (total - done) * 1000)
                }
                _ => None,
            };
        }
        let outcome = schedule(&snapshot, &pending_jobs, &scheduling, &mut rng)?;
        if let Some(limits) = &config.forecast {
            arrived.retain(|id| outcome.pending.contains_key(id));
            if !arrived.is_empty() {
                // Forecasts assume typical ends, not mean ones (see
                // `muster_sched::runtime::FORECAST_QUANTILE`), as the server's.
                let mut ahead = snapshot.clone();
                for running_job in &mut ahead.running {
                    let index = running_job.id.0 as usize;
                    let Some(run) = running.get(&index) else {
                        continue;
                    };
                    let done = jobs[index].duration_s - run.remaining_s;
                    running_job.expected_end = learned[team_of[index]]
                        .forecast_remaining_ms((done + t - run.started_s) * 1000)
                        .map(|remaining| Time::from_secs(t).plus_millis(remaining));
                }
                let mut waiting = pending_jobs.clone();
                for pending_job in &mut waiting {
                    let index = pending_job.id.0 as usize;
                    let done = jobs[index].duration_s - states[index].remaining_s;
                    pending_job.estimated_runtime_ms =
                        learned[team_of[index]].forecast_remaining_ms(done * 1000);
                }
                let made = muster_sched::forecast_starts(
                    &ahead,
                    &waiting,
                    &scheduling,
                    &outcome,
                    Some(&arrived),
                    limits,
                    &mut forecast_rng,
                )?;
                for id in &arrived {
                    forecasts[id.0 as usize] = Some(
                        made.get(id)
                            .copied()
                            .unwrap_or(muster_sched::StartForecast::Unknown),
                    );
                }
            }
            arrived.clear();
        }

        for preemption in &outcome.preemptions {
            let index = preemption.victim.0 as usize;
            let Some(run) = running.remove(&index) else {
                continue;
            };
            remove_running(&mut snapshot.running, index);
            preemptions += 1;
            busy_milli -= jobs[index].gpu_milli();
            let done = t - run.started_s;
            let kept = match config.checkpoint_interval_s {
                0 => 0,
                interval => done / interval * interval,
            };
            lost_gpu_s += (done - kept) as f64 * jobs[index].gpu_milli() as f64 / 1000.0;
            states[index].remaining_s = run.remaining_s - kept.min(run.remaining_s);
            states[index].generation += 1;
            pending_jobs.push(pending_job(index));
        }
        let mut started_any = false;
        for start in &outcome.started {
            let index = start.job.0 as usize;
            let state = &mut states[index];
            state.generation += 1;
            state.first_start_s.get_or_insert(t);
            let run = Run {
                started_s: t,
                remaining_s: state.remaining_s,
            };
            // Priority and expected end are refreshed before each cycle.
            insert_running(
                &mut snapshot.running,
                RunningJob {
                    id: JobId(index as u64),
                    queue: queue_of(&jobs[index]),
                    priority: 0,
                    started: Time::from_secs(t),
                    tasks: start.tasks.clone(),
                    expected_end: None,
                    preemptible: true,
                    checkpoint_interval_ms: (config.checkpoint_interval_s > 0)
                        .then_some(config.checkpoint_interval_s * 1000),
                    service: false,
                },
            );
            running.insert(index, run);
            busy_milli += jobs[index].gpu_milli();
            ends.push(Reverse((t + state.remaining_s, index, state.generation)));
            started_any = true;
        }
        if started_any {
            let started: std::collections::BTreeSet<usize> =
                outcome.started.iter().map(|s| s.job.0 as usize).collect();
            pending_jobs.retain(|job| !started.contains(&(job.id.0 as usize)));
        }
        // Jobs that can never run here are dropped, or the replay never ends.
        let never: Vec<usize> = outcome
            .pending
            .iter()
            .filter(|(_, reason)| matches!(reason, PendingReason::NeverFits { .. }))
            .map(|(id, _)| id.0 as usize)
            .collect();
        if !never.is_empty() {
            unschedulable += never.len();
            pending_jobs.retain(|job| !never.contains(&(job.id.0 as usize)));
        }
        if running.is_empty() && next_arrival >= order.len() && !pending_jobs.is_empty() {
            // Nothing will ever free up: the rest cannot be placed.
            unschedulable += pending_jobs.len();
            pending_jobs.clear();
        }
        timeline.push((
            (t - start_s) as f64,
            busy_milli as f64 / 1000.0,
            pending_jobs.len(),
        ));
    }

    let finished: Vec<usize> = (0..jobs.len())
        .filter(|&i| states[i].finish_s.is_some())
        .collect();
    let mut jct: Vec<f64> = finished
        .iter()
        .map(|&i| (states[i].finish_s.unwrap_or(0) - jobs[i].submit_s) as f64)
        .collect();
    let mut queueing: Vec<f64> = finished
        .iter()
        .map(|&i| (states[i].first_start_s.unwrap_or(0) - jobs[i].submit_s) as f64)
        .collect();
    let makespan = (now - start_s) as f64;
    let forecast = config
        .forecast
        .map(|_| forecast_accuracy(jobs, &states, &forecasts));
    let total_gpu_s: f64 = states.iter().map(|s| s.gpu_s_used).sum();
    let mut per_queue: BTreeMap<String, QueueResult> = BTreeMap::new();
    for &i in &finished {
        let entry = per_queue
            .entry(jobs[i].queue.clone())
            .or_insert(QueueResult {
                jobs: 0,
                mean_jct_s: 0.0,
                gpu_share: 0.0,
                guaranteed_share: 0.0,
            });
        entry.jobs += 1;
        entry.mean_jct_s += (states[i].finish_s.unwrap_or(0) - jobs[i].submit_s) as f64;
    }
    for (i, job) in jobs.iter().enumerate() {
        if let Some(entry) = per_queue.get_mut(&job.queue) {
            entry.gpu_share += states[i].gpu_s_used;
        }
    }
    for (name, entry) in per_queue.iter_mut() {
        entry.mean_jct_s /= entry.jobs.max(1) as f64;
        entry.gpu_share = if total_gpu_s > 0.0 {
            entry.gpu_share / total_gpu_s
        } else {
            0.0
        };
        entry.guaranteed_share = queues.iter().find(|q| q.name.0 == *name).map_or(0.0, |q| {
            f64::from(q.guaranteed.0) / capacity_milli.max(1) as f64
        });
    }
    jct.sort_by(f64::total_cmp);
    queueing.sort_by(f64::total_cmp);
    let cdf_points = jct.len().min(200);
    let jct_cdf = (1..=cdf_points)
        .map(|k| {
            let fraction = k as f64 / cdf_points as f64;
            (percentile(&jct, fraction), fraction)
        })
        .collect();
    let step = timeline
        .len()
        .div_ceil(config.timeline_points.max(1))
        .max(1);
    let timeline = timeline.into_iter().step_by(step).collect();
    Ok(ReplayResult {
        policy: policy.name().to_string(),
        oracle: policy == ReplayPolicy::SjfOracle,
        jobs: jobs.len(),
        completed: finished.len(),
        unschedulable,
        mean_jct_s: mean(&jct),
        p50_jct_s: percentile(&jct, 0.5),
        p99_jct_s: percentile(&jct, 0.99),
        mean_queueing_s: mean(&queueing),
        p50_queueing_s: percentile(&queueing, 0.5),
        p99_queueing_s: percentile(&queueing, 0.99),
        makespan_s: makespan,
        mean_gpu_utilization: if makespan > 0.0 {
            busy_integral / (capacity_milli as f64 / 1000.0 * makespan)
        } else {
            0.0
        },
        preemptions,
        lost_gpu_s,
        scheduling_cycles: cycles,
        per_queue,
        jct_cdf,
        timeline,
        forecast,
    })
}

/// Compares the forecasts made at arrival with the starts that followed.
fn forecast_accuracy(
    jobs: &[ReplayJob],
    states: &[State],
    forecasts: &[Option<muster_sched::StartForecast>],
) -> ForecastAccuracy {
    use muster_sched::StartForecast;
    let mut long = 0usize;
    let (mut within, mut early, mut late, mut unknown, mut not_before) = (0, 0, 0, 0, 0);
    let mut ratios = Vec::new();
    let (mut waiting, mut waiting_within) = (0usize, 0usize);
    for (index, job) in jobs.iter().enumerate() {
        let Some(started) = states[index].first_start_s else {
            continue;
        };
        let waited = started.saturating_sub(job.submit_s) as f64;
        if waited <= 0.0 {
            continue;
        }
        let forecast = forecasts[index];
        let forecast_wait = match forecast {
            Some(StartForecast::At(at) | StartForecast::NotBefore(at)) => {
                Some((at.0 / 1000).saturating_sub(job.submit_s) as f64)
            }
            _ => None,
        };
        let ratio = forecast_wait
            .filter(|&w| w > 0.0)
            .map(|forecast_wait| waited / forecast_wait);
        let good = ratio.is_some_and(|r| (0.5..=2.0).contains(&r));
        waiting += 1;
        waiting_within += usize::from(good);
        if waited <= 600.0 {
            continue;
        }
        long += 1;
        match forecast {
            Some(StartForecast::NotBefore(_)) => not_before += 1,
            Some(StartForecast::At(_)) => {}
            _ => unknown += 1,
        }
        if let Some(ratio) = ratio {
            ratios.push(ratio);
            if ratio > 2.0 {
                early += 1;
            } else if ratio < 0.5 {
                late += 1;
            }
        }
        within += usize::from(good);
    }
    ratios.sort_by(f64::total_cmp);
    let share = |n: usize| {
        if long == 0 {
            0.0
        } else {
            n as f64 / long as f64
        }
    };
    ForecastAccuracy {
        waited_over_10_min: long,
        within_2x: share(within),
        too_early: share(early),
        too_late: share(late),
        unknown: share(unknown),
        not_before: share(not_before),
        median_ratio: percentile(&ratios, 0.5),
        all_waiting_within_2x: if waiting == 0 {
            0.0
        } else {
            waiting_within as f64 / waiting as f64
        },
        forecasts: forecasts.iter().flatten().count(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use muster_model::{GpuModel, GpuSpec, NodeName, NodeSpec, PoolName, RackName};

    fn node(gpus: u32) -> Vec<NodeInput> {
        vec![NodeInput::schedulable(NodeSpec {
            name: NodeName::from("n0"),
            pool: PoolName::from("default"),
            rack: RackName::from("r0"),
            gpus: (0..gpus)
                .map(|index| GpuSpec {
                    index,
                    uuid: format!("GPU-{index}"),
                    model: GpuModel::new("V100"),
                    memory: MemoryMib(16 * 1024),
                    nvlink_domain: 0,
                })
                .collect(),
            cpu: CpuMilli(64_000),
            memory: MemoryMib(1 << 20),
        })]
    }

    fn job(id: u64, submit_s: u64, duration_s: u64, gpus: u32) -> ReplayJob {
        ReplayJob {
            id,
            submit_s,
            duration_s,
            queue: "vc".to_string(),
            tasks: 1,
            gpus_per_task: GpuRequest::Whole(gpus),
            cpu: CpuMilli(0),
            memory: MemoryMib(0),
            gpu_models: Vec::new(),
        }
    }

    #[test]
    fn forecasts_at_arrival_are_scored_against_the_starts_that_followed() {
        // Two 1-GPU jobs of 1,000 s teach the queue; job 2 (2 GPUs, 2,000 s)
        // runs from 1,500 s; job 3 (2 GPUs) arrives at 1,600 s. The forecast
        // assumes job 2 ends as the typical job does, 1,000 s after its
        // start, at 2,500 s: a forecast wait of 900 s. Job 2 really ends at
        // 3,500 s: job 3 waits 1,900 s, 2.11 times the forecast (too early).
        let mut jobs = vec![
            job(0, 0, 1_000, 1),
            job(1, 0, 1_000, 1),
            job(2, 1_500, 2_000, 2),
            job(3, 1_600, 1_000, 2),
        ];
        let config = ReplayConfig {
            forecast: Some(muster_sched::ForecastLimits::default()),
            ..ReplayConfig::default()
        };
        let with = replay(&node(2), &jobs, ReplayPolicy::Default, &config, 1).unwrap();
        let accuracy = with.forecast.clone().expect("forecasts were asked for");
        assert_eq!(accuracy.forecasts, 1);
        assert_eq!(accuracy.waited_over_10_min, 1);
        assert_eq!(accuracy.too_early, 1.0);
        assert_eq!(accuracy.within_2x, 0.0);
        assert!((accuracy.median_ratio - 1_900.0 / 900.0).abs() < 1e-9);
        // Forecasting changes no decision.
        let without = replay(
            &node(2),
            &jobs,
            ReplayPolicy::Default,
            &ReplayConfig::default(),
            1,
        )
        .unwrap();
        assert_eq!(without.forecast, None);
        assert_eq!(
            (with.mean_jct_s, with.p99_jct_s),
            (without.mean_jct_s, without.p99_jct_s)
        );
        // Had job 2 taken 1,500 s, job 3 would have waited 1,400 s: within
        // 2x of the same forecast.
        jobs[2].duration_s = 1_500;
        let closer = replay(&node(2), &jobs, ReplayPolicy::Default, &config, 1).unwrap();
        let accuracy = closer.forecast.expect("forecasts");
        assert_eq!(accuracy.within_2x, 1.0);
        assert!((accuracy.median_ratio - 1_400.0 / 900.0).abs() < 1e-9);
    }

    #[test]
    fn fifo_metrics_match_a_hand_computed_schedule() {
        // A (2 GPUs, 100 s) runs 0-100; B (1 GPU, 50 s) and C (1 GPU, 10 s)
        // wait behind it and both start at 100: B ends 150, C 110.
        let jobs = vec![job(0, 0, 100, 2), job(1, 10, 50, 1), job(2, 20, 10, 1)];
        let result = replay(
            &node(2),
            &jobs,
            ReplayPolicy::Fifo,
            &ReplayConfig::default(),
            1,
        )
        .unwrap();
        assert_eq!(result.completed, 3);
        assert_eq!(result.mean_jct_s, (100.0 + 140.0 + 90.0) / 3.0);
        assert_eq!(result.mean_queueing_s, (0.0 + 90.0 + 80.0) / 3.0);
        assert_eq!(result.p50_jct_s, 100.0);
        assert_eq!(result.p99_jct_s, 140.0);
        assert_eq!(result.makespan_s, 150.0);
        // Busy GPU-seconds: 200 + 20 + 40 over 2 GPUs x 150 s.
        assert!((result.mean_gpu_utilization - 260.0 / 300.0).abs() < 1e-12);
        assert_eq!(result.preemptions, 0);
    }

    #[test]
    fn las_preempts_the_job_with_more_attained_service() {
        // A has 200 GPU-s by t=100, past the 100 GPU-s threshold: B, new,
        // preempts it. A checkpointed at 90 s, loses 10 s on 2 GPUs, and
        // restarts when B ends at 110 with 910 s left.
        let jobs = vec![job(0, 0, 1000, 2), job(1, 100, 10, 1)];
        let config = ReplayConfig {
            checkpoint_interval_s: 30,
            las_thresholds_gpu_s: vec![100],
            ..ReplayConfig::default()
        };
        let result = replay(&node(2), &jobs, ReplayPolicy::Las, &config, 1).unwrap();
        assert_eq!(result.preemptions, 1);
        assert_eq!(result.lost_gpu_s, 20.0);
        assert_eq!(result.mean_jct_s, (1020.0 + 10.0) / 2.0);
    }

    #[test]
    fn sjf_oracle_runs_the_shortest_first_and_is_labelled() {
        // Both wait behind A; C is shorter and goes first.
        let jobs = vec![job(0, 0, 100, 2), job(1, 10, 50, 2), job(2, 20, 10, 2)];
        let result = replay(
            &node(2),
            &jobs,
            ReplayPolicy::SjfOracle,
            &ReplayConfig::default(),
            1,
        )
        .unwrap();
        assert!(result.oracle);
        // A 0-100, C 100-110, B 110-160.
        assert_eq!(result.mean_jct_s, (100.0 + 150.0 + 90.0) / 3.0);
    }

    #[test]
    fn a_job_larger_than_the_cluster_is_dropped_not_waited_for() {
        let jobs = vec![job(0, 0, 100, 4), job(1, 5, 10, 1)];
        let result = replay(
            &node(2),
            &jobs,
            ReplayPolicy::Default,
            &ReplayConfig::default(),
            1,
        )
        .unwrap();
        assert_eq!((result.completed, result.unschedulable), (1, 1));
    }

    #[test]
    fn the_same_seed_gives_the_same_result() {
        let jobs: Vec<ReplayJob> = (0..40)
            .map(|i| ReplayJob {
                queue: format!("vc{}", i % 3),
                ..job(i, i * 7, 30 + (i * 13) % 90, 1 + (i % 2) as u32)
            })
            .collect();
        for policy in [
            ReplayPolicy::Fifo,
            ReplayPolicy::Las,
            ReplayPolicy::SjfOracle,
            ReplayPolicy::Default,
        ] {
            let a = replay(&node(4), &jobs, policy, &ReplayConfig::default(), 3).unwrap();
            let b = replay(&node(4), &jobs, policy, &ReplayConfig::default(), 3).unwrap();
            assert_eq!(a, b);
            assert_eq!(a.completed, 40, "{policy}");
        }
    }

    #[test]
    fn default_gives_queues_shares_proportional_to_their_gpu_time() {
        let jobs = vec![
            ReplayJob {
                queue: "a".into(),
                ..job(0, 0, 300, 1)
            },
            ReplayJob {
                queue: "b".into(),
                ..job(1, 0, 100, 1)
            },
        ];
        let queues = proportional_queues(&jobs, 8000);
        assert_eq!(queues[0].guaranteed, GpuMilli(6000));
        assert_eq!(queues[1].guaranteed, GpuMilli(2000));
    }
}
