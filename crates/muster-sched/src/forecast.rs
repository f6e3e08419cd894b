//! When will a pending job start? The scheduler's own plan, run ahead.
//!
//! [`forecast_starts`] takes a cycle's snapshot and outcome and replays the
//! future with the same engine: running jobs end at their expected ends
//! (the caller fills them from runtime estimates: the spec's, those learned
//! from the queue's finished jobs ([`crate::RuntimeHistory`]), or
//! `max_runtime`), and at each end the engine runs a cycle over the jobs
//! still waiting, with the same policy (order, quotas, reservations,
//! backfill). A job the plan starts at time T is forecast to start at T.
//!
//! Bounded: at most [`ForecastLimits::jobs`] pending jobs are planned (in
//! the cycle's order; the rest start no earlier than the plan's end), in at
//! most [`ForecastLimits::steps`] cycles, up to [`ForecastLimits::horizon_ms`]
//! ahead. Ends close together share a step: a step takes every end within
//! a sixteenth of its distance from now (at least a minute) of the next
//! one, and the jobs it starts are forecast at its last end, so a forecast
//! is late by at most about 6%, never early for that reason.
//!
//! What the plan does not know: jobs yet to be submitted, preempted jobs
//! coming back (a victim leaves the plan), nodes joining or failing, and
//! estimates that are wrong. Planned starts are never victims.

use crate::cluster::ClusterError;
use crate::schedule::{
    Allocation, Outcome, PendingJob, PendingReason, RunningJob, SchedulingPolicy, Snapshot,
    schedule,
};
use muster_model::{JobId, Time};
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};

/// A pending job's forecast start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartForecast {
    /// The plan starts it then.
    At(Time),
    /// The plan ended (steps, horizon or jobs planned) before it started:
    /// not before then.
    NotBefore(Time),
    /// Cannot be told: it waits on running jobs with no runtime estimate,
    /// or no node could ever hold it.
    Unknown,
}

/// How far a forecast plans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ForecastLimits {
    /// Pending jobs planned, in the cycle's order.
    pub jobs: usize,
    /// Future cycles run.
    pub steps: usize,
    /// How far ahead of the snapshot's time.
    pub horizon_ms: u64,
}

impl Default for ForecastLimits {
    fn default() -> Self {
        ForecastLimits {
            jobs: 1_000,
            steps: 64,
            horizon_ms: 30 * 24 * 3_600_000,
        }
    }
}

/// The least distance between two steps of the plan.
const MIN_STEP_MS: u64 = 60_000;

/// Forecasts the start of every job `outcome` left pending (those the cycle
/// considered, in its order), by running the engine ahead from `snapshot`
/// with the cycle's decisions applied. With `targets`, the plan stops as
/// soon as each of them has a forecast (the others keep what they had by
/// then, or [`StartForecast::NotBefore`]).
///
/// `pending` and `snapshot` are the cycle's input; running jobs' ends come
/// from `expected_end`, planned jobs' from `estimated_runtime_ms`.
pub fn forecast_starts<R: Rng>(
    snapshot: &Snapshot,
    pending: &[PendingJob],
    policy: &SchedulingPolicy,
    outcome: &Outcome,
    targets: Option<&BTreeSet<JobId>>,
    limits: &ForecastLimits,
    rng: &mut R,
) -> Result<BTreeMap<JobId, StartForecast>, ClusterError> {
    let now = snapshot.now;
    let by_id: BTreeMap<JobId, &PendingJob> = pending.iter().map(|job| (job.id, job)).collect();
    let mut forecasts = BTreeMap::new();
    let mut waiting: Vec<PendingJob> = Vec::new();
    let mut beyond: Vec<JobId> = Vec::new();
    for id in &outcome.order {
        let (Some(reason), Some(job)) = (outcome.pending.get(id), by_id.get(id)) else {
            continue;
        };
        if matches!(reason, PendingReason::NeverFits { .. }) {
            forecasts.insert(*id, StartForecast::Unknown);
        } else if waiting.len() < limits.jobs {
            waiting.push((*job).clone());
        } else {
            beyond.push(*id);
        }
    }
    let mut open_targets = targets.map(|targets| {
        waiting
            .iter()
            .filter(|job| targets.contains(&job.id))
            .count()
    });
    if waiting.is_empty() || open_targets == Some(0) {
        for id in beyond {
            forecasts.insert(id, StartForecast::NotBefore(now));
        }
        return Ok(forecasts);
    }

    // The cluster as the cycle leaves it.
    let mut plan = Snapshot {
        now,
        nodes: snapshot.nodes.clone(),
        running: snapshot.running.clone(),
        queues: snapshot.queues.clone(),
        usage: snapshot.usage.clone(),
        workload: snapshot.workload.clone(),
    };
    apply(&mut plan, &by_id, outcome, now);

    let horizon = now.plus_millis(limits.horizon_ms);
    let mut t = now;
    let mut steps = 0;
    while !waiting.is_empty() && steps < limits.steps {
        // The next end (one overdue ends at the next step), and every end
        // close after it.
        let Some(next) = plan.running.iter().filter_map(|job| job.expected_end).min() else {
            break;
        };
        let next = next.max(t.plus_millis(1_000));
        let window = (next.millis_since(now) / 16).max(MIN_STEP_MS);
        let close = next.plus_millis(window);
        let step = plan
            .running
            .iter()
            .filter_map(|job| job.expected_end)
            .filter(|&end| end <= close)
            .max()
            .unwrap_or(next)
            .max(next);
        if step > horizon {
            break;
        }
        plan.running
            .retain(|job| job.expected_end.is_none_or(|end| end > step));
        plan.now = step;
        t = step;
        steps += 1;
        let decided = schedule(&plan, &waiting, policy, rng)?;
        if decided.started.is_empty() {
            continue;
        }
        let by_id: BTreeMap<JobId, &PendingJob> = waiting.iter().map(|job| (job.id, job)).collect();
        apply(&mut plan, &by_id, &decided, step);
        let started: BTreeSet<JobId> = decided.started.iter().map(|start| start.job).collect();
        for id in &started {
            forecasts.insert(*id, StartForecast::At(step));
            if let (Some(open), Some(targets)) = (open_targets.as_mut(), targets)
                && targets.contains(id)
            {
                *open -= 1;
            }
        }
        waiting.retain(|job| !started.contains(&job.id));
        if open_targets == Some(0) {
            break;
        }
    }
    // Nothing left to end: what they wait for has no estimate.
    let stuck = plan.running.iter().all(|job| job.expected_end.is_none());
    for job in &waiting {
        forecasts.insert(
            job.id,
            if stuck {
                StartForecast::Unknown
            } else {
                StartForecast::NotBefore(t)
            },
        );
    }
    for id in beyond {
        forecasts.insert(id, StartForecast::NotBefore(t));
    }
    Ok(forecasts)
}

/// A cycle's decisions, applied to the plan at `at`: victims leave, started
/// jobs run until their estimate says (forever without one).
fn apply(plan: &mut Snapshot, jobs: &BTreeMap<JobId, &PendingJob>, outcome: &Outcome, at: Time) {
    let victims: BTreeSet<JobId> = outcome
        .preemptions
        .iter()
        .map(|preemption| preemption.victim)
        .collect();
    if !victims.is_empty() {
        plan.running.retain(|job| !victims.contains(&job.id));
    }
    for start in &outcome.started {
        if let Some(job) = jobs.get(&start.job) {
            plan.running.push(planned(job, &start.tasks, at));
        }
    }
}

fn planned(job: &PendingJob, tasks: &[Allocation], at: Time) -> RunningJob {
    RunningJob {
        id: job.id,
        queue: job.queue.clone(),
        priority: job.priority,
        started: at,
        tasks: tasks.to_vec(),
        expected_end: job.estimated_runtime_ms.map(|ms| at.plus_millis(ms)),
        preemptible: false,
        checkpoint_interval_ms: None,
        service: false,
    }
}
