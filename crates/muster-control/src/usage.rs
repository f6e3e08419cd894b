//! What telemetry says of running tasks, and the idle rule: each task's
//! GPU usage (samples, mean and peak utilisation, peak memory, idle since)
//! folded from its node's readings, and when a job counts as idle. Pure: the
//! shell keeps the map (memory only) and passes the time.

use crate::{ControlPlane, JobState};
use std::collections::BTreeMap;

/// One GPU's reading in a node's telemetry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuReading {
    pub index: u32,
    pub utilization_pct: u32,
    pub memory_used_mib: u64,
}

/// Below this utilisation (percent) an allocated GPU counts as idle (a
/// queue may set its own: `QueueSpec::idle_below_pct`).
pub const IDLE_UTILIZATION_PCT: u32 = 5;

/// A task's GPU usage as telemetry saw it (memory only: one entry per
/// allocation in the hot state of a node that reports).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocationUsage {
    pub samples: u64,
    pub utilization_sum: u64,
    pub peak_utilization: u32,
    pub peak_memory_mib: u64,
    /// Since when every sample has been below [`IDLE_UTILIZATION_PCT`].
    pub idle_since_ms: Option<u64>,
}

/// Per node, per allocation.
pub type UsageByNode = BTreeMap<String, BTreeMap<u64, AllocationUsage>>;

/// Folds a node's report into the usage of the tasks running there (each
/// sample: the mean utilisation of a task's GPUs, their memory summed), and
/// forgets allocations the state no longer holds. Returns each sample:
/// (allocation, utilisation, memory MiB).
pub fn record_usage(
    usage: &mut BTreeMap<u64, AllocationUsage>,
    control: &ControlPlane,
    node: &muster_model::NodeName,
    readings: &[GpuReading],
    now_ms: u64,
) -> Vec<(u64, u32, u64)> {
    let mut taken = Vec::new();
    for allocation in control.live_allocations(node) {
        if allocation.state != crate::AllocationState::Running {
            continue;
        }
        let samples: Vec<&GpuReading> = readings
            .iter()
            .filter(|sample| {
                allocation
                    .gpus
                    .iter()
                    .any(|(index, _)| *index == sample.index)
            })
            .collect();
        if samples.is_empty() {
            continue;
        }
        let utilization = samples
            .iter()
            .map(|s| u64::from(s.utilization_pct.min(100)))
            .sum::<u64>()
            / samples.len() as u64;
        let memory: u64 = samples.iter().map(|s| s.memory_used_mib).sum();
        taken.push((allocation.id.0, utilization as u32, memory));
        let below = control
            .job(allocation.job)
            .map_or(IDLE_UTILIZATION_PCT, |job| control.idle_below_pct_of(job));
        let entry = usage.entry(allocation.id.0).or_default();
        entry.samples += 1;
        entry.utilization_sum += utilization;
        entry.peak_utilization = entry.peak_utilization.max(utilization as u32);
        entry.peak_memory_mib = entry.peak_memory_mib.max(memory);
        entry.idle_since_ms = if utilization < u64::from(below) {
            Some(entry.idle_since_ms.unwrap_or(now_ms))
        } else {
            None
        };
    }
    usage.retain(|id, _| control.allocation(crate::AllocationId(*id)).is_some());
    taken
}

/// How long (ms) running job `job` has had every task idle, if at least
/// `threshold_ms`; `None` otherwise (or with no telemetry for a task).
pub fn idle_for_ms(
    control: &ControlPlane,
    usage: &UsageByNode,
    job: &crate::Job,
    now_ms: u64,
    threshold_ms: u64,
) -> Option<u64> {
    let since = job.allocations.iter().map(|id| {
        let allocation = control.allocation(*id)?;
        usage.get(&allocation.node.0)?.get(&id.0)?.idle_since_ms
    });
    idle_for(job.state == JobState::Running, since, now_ms, threshold_ms)
}

/// The idle rule: a running job is idle once every task has been idle (its
/// `idle_since`) for at least `threshold_ms`; for how long (ms).
pub fn idle_for(
    running: bool,
    idle_since: impl IntoIterator<Item = Option<u64>>,
    now_ms: u64,
    threshold_ms: u64,
) -> Option<u64> {
    if !running {
        return None;
    }
    let mut latest = None;
    for since in idle_since {
        latest = Some(latest.unwrap_or(0).max(since?));
    }
    let idle = now_ms.saturating_sub(latest?);
    (idle >= threshold_ms).then_some(idle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_idle_once_every_task_has_been_idle_for_the_threshold() {
        // The latest start of idleness counts: the job is as idle as its
        // busiest task.
        assert_eq!(
            idle_for(true, [Some(1_000), Some(4_000)], 10_000, 5_000),
            Some(6_000)
        );
        assert_eq!(
            idle_for(true, [Some(1_000), Some(6_000)], 10_000, 5_000),
            None
        );
        // A task without an idle reading, or a job not running: not idle.
        assert_eq!(idle_for(true, [Some(1_000), None], 10_000, 0), None);
        assert_eq!(idle_for(false, [Some(1_000)], 10_000, 0), None);
        assert_eq!(idle_for(true, std::iter::empty(), 10_000, 0), None);
    }
}
