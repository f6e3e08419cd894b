//! From the control plane's state to the `/v1` wire types.

use crate::core::Core;
use crate::records::{allocation_state_name, node_state_name};
use muster_api::protocol::{
    DesiredAllocation, EventView, GpuView, JobView, NodeView, QueueView, TaskView,
};
use muster_control::{Allocation, AllocationId, AllocationState, DesiredTask, Job, JobState, Node};
use muster_model::{QueueName, QueueSpec};
use std::collections::BTreeMap;

/// A job as the API shows it; `allocation` finds its allocations (in the
/// hot state, or among those read from the store for a retired job).
pub fn job_view<'a>(
    job: &Job,
    allocation: &dyn Fn(AllocationId) -> Option<&'a Allocation>,
    pending_code: Option<&str>,
    forecast: Option<muster_sched::StartForecast>,
) -> JobView {
    let tasks = job
        .allocations
        .iter()
        .filter_map(|id| allocation(*id))
        .map(|allocation| TaskView {
            rank: allocation.rank,
            node: allocation.node.0.clone(),
            gpus: allocation.gpus.clone(),
            allocation: allocation.id.0,
            generation: allocation.generation,
            state: allocation_state_name(allocation.state).to_string(),
            exit_code: match allocation.state {
                AllocationState::Exited { code } => code,
                _ => None,
            },
            usage: None,
            pulling: None,
        })
        .collect();
    JobView {
        id: job.id.0,
        name: job.spec.name.clone(),
        user: job.user.clone(),
        queue: job.spec.queue.0.clone(),
        priority_class: job.spec.priority_class.name.clone(),
        state: job.state.name().to_string(),
        nodes: job.spec.nodes,
        gpus_per_node: f64::from(job.spec.gpus_per_node.total().0) / 1000.0,
        submitted_ms: job.submitted.0,
        started_ms: job.started.map(|t| t.0),
        finished_ms: job.finished.map(|t| t.0),
        exit_code: job.exit_code,
        failed_rank: job
            .first_failure
            .filter(|_| job.state == JobState::Failed)
            .map(|(rank, _)| rank),
        attempts: job.attempts,
        command: job.spec.command.clone(),
        after: job.spec.after.iter().map(ToString::to_string).collect(),
        tasks,
        pending_reason: if job.state != JobState::Pending {
            None
        } else if pending_code == Some("budget") {
            Some(format!(
                "budget exhausted: queue {} has spent its monthly GPU budget (a hard limit); \
                 its jobs wait until the month ends or an admin raises the budget",
                job.spec.queue
            ))
        } else if let (Some("array-limit"), Some(array)) = (pending_code, job.array) {
            Some(format!(
                "array job {} runs at most {} elements at once; this one starts when one \
                 of those running ends",
                array.array,
                array.limit.unwrap_or(0)
            ))
        } else {
            Some(
                job.pending_reason
                    .clone()
                    .unwrap_or_else(|| "waiting for the next scheduling cycle".to_string()),
            )
        },
        queue_position: job.queue_position,
        estimated_start: forecast
            .filter(|_| job.state == JobState::Pending)
            .map(start_estimate),
        idle_for_s: None,
        warnings: Vec::new(),
        array: job.array.map(|array| muster_api::protocol::ArrayView {
            job: array.array.0,
            index: array.index,
            count: array.count,
            limit: array.limit,
        }),
        pending_code: pending_code
            .filter(|_| job.state == JobState::Pending)
            .map(str::to_string),
        history: job
            .history
            .iter()
            .map(|(at, what)| EventView {
                at_ms: at.0,
                what: what.clone(),
            })
            .collect(),
    }
}

fn start_estimate(forecast: muster_sched::StartForecast) -> muster_api::protocol::StartEstimate {
    use muster_api::protocol::{StartEstimate, StartEstimateKind};
    use muster_sched::StartForecast;
    match forecast {
        StartForecast::At(at) => StartEstimate {
            kind: StartEstimateKind::At,
            at_ms: Some(at.0),
        },
        StartForecast::NotBefore(at) => StartEstimate {
            kind: StartEstimateKind::NotBefore,
            at_ms: Some(at.0),
        },
        StartForecast::Unknown => StartEstimate {
            kind: StartEstimateKind::Unknown,
            at_ms: None,
        },
    }
}

pub fn node_view(core: &Core, node: &Node) -> NodeView {
    let mut gpu_free = vec![1000u32; node.spec.gpus.len()];
    let mut allocations = Vec::new();
    for allocation in core.control().live_allocations(&node.spec.name) {
        allocations.push(allocation.id.0);
        for &(index, milli) in &allocation.gpus {
            if let Some(free) = gpu_free.get_mut(index as usize) {
                *free = free.saturating_sub(u32::from(milli));
            }
        }
    }
    NodeView {
        name: node.spec.name.0.clone(),
        state: if node.pending_approval && node.state == muster_control::NodeState::Ready {
            "pending-approval".to_string()
        } else {
            node_state_name(node.state).to_string()
        },
        cordoned: node.cordoned,
        draining: node.draining,
        pool: node.spec.pool.0.clone(),
        rack: node.spec.rack.0.clone(),
        address: node.address.clone(),
        gpus: node
            .spec
            .gpus
            .iter()
            .map(|gpu| GpuView {
                index: gpu.index,
                uuid: gpu.uuid.clone(),
                model: gpu.model.as_str().to_string(),
                memory_mib: gpu.memory.0,
                nvlink_domain: gpu.nvlink_domain,
            })
            .collect(),
        unhealthy_gpus: node.unhealthy_gpus.clone(),
        gpu_events: Vec::new(),
        gpu_utilization_pct: Vec::new(),
        stack: node.software.stack.clone(),
        drift: node.drift.clone(),
        gpu_free,
        cpu_milli: node.spec.cpu.0,
        memory_mib: node.spec.memory.0,
        backend: node.software.backend.clone(),
        driver_version: node.software.driver.clone(),
        cuda_version: node.software.cuda.clone(),
        last_heartbeat_ms: node.last_heartbeat.0,
        recent_heartbeat_gaps_ms: core.heartbeat_gaps(&node.spec.name),
        allocations,
        excluded: core
            .control()
            .excluded_reason(&node.spec.name)
            .map(str::to_string),
    }
}

/// Every configured queue, and every queue a job names.
pub fn queue_views(core: &Core) -> Vec<QueueView> {
    let mut views: BTreeMap<QueueName, QueueView> = core
        .control()
        .queues()
        .map(|spec| (spec.name.clone(), empty_queue_view(spec)))
        .collect();
    for job in core.control().jobs() {
        if job.state.is_final() {
            continue;
        }
        let view = views
            .entry(job.spec.queue.clone())
            .or_insert_with(|| empty_queue_view(&QueueSpec::best_effort(job.spec.queue.0.clone())));
        match job.state {
            JobState::Pending => view.pending_jobs += 1,
            _ => {
                view.running_jobs += 1;
                let mut milli = 0u64;
                let mut borrowed = 0u64;
                for allocation in core
                    .control()
                    .current_allocations(job)
                    .filter(|a| a.state.holds_resources())
                {
                    let held: u64 = allocation.gpus.iter().map(|&(_, m)| u64::from(m)).sum();
                    milli += held;
                    if core.control().borrows(job, allocation) {
                        borrowed += held;
                    }
                }
                view.in_use_gpus += milli as f64 / 1000.0;
                view.borrowed_gpus += borrowed as f64 / 1000.0;
            }
        }
    }
    views.into_values().collect()
}

pub fn empty_queue_view(spec: &QueueSpec) -> QueueView {
    QueueView {
        name: spec.name.0.clone(),
        guaranteed_gpus: f64::from(spec.guaranteed.0) / 1000.0,
        borrow_limit_gpus: spec.borrow_limit.map(|l| f64::from(l.0) / 1000.0),
        weight: spec.weight,
        idle_timeout_s: spec.idle_timeout.map(|t| t.as_secs()),
        idle_after_s: spec.idle_after.map(|t| t.as_secs()),
        idle_below_pct: spec.idle_below_pct,
        in_use_gpus: 0.0,
        borrowed_gpus: 0.0,
        pending_jobs: 0,
        running_jobs: 0,
        budget: spec.budget.map(|b| b.monthly_cents as f64 / 100.0),
        budget_hard: spec.budget.is_some_and(|b| b.hard),
        spent_this_month: 0.0,
        members_see_jobs: spec.members_see_jobs,
        max_pending: spec.max_pending,
        max_priority_class: spec
            .max_priority_class
            .as_ref()
            .map_or_else(|| "normal".to_string(), |class| class.name.clone()),
        allow_non_preemptible: spec.allow_non_preemptible,
    }
}

pub fn desired_view(task: DesiredTask) -> DesiredAllocation {
    DesiredAllocation {
        allocation: task.allocation.0,
        generation: task.generation,
        job: task.job.0,
        rank: task.rank,
        command: task.command,
        env: task.env,
        working_dir: task.working_dir,
        gpus: task.gpus,
        stop_signal: task.stop_signal.name().to_string(),
        grace_period_ms: task.grace_period_ms,
        stop: task.stop,
        user: Some(task.user),
        // Filled on the way out (crate::users::fill_groups).
        user_group: None,
        memory_mib: (task.memory_mib > 0).then_some(task.memory_mib),
        image: task.image,
        cpu_milli: (task.cpu_milli > 0).then_some(task.cpu_milli),
        // Filled on the way out, as secrets are (crate::secrets::fill).
        registry_auth: None,
        mounts: task
            .mounts
            .into_iter()
            .map(|(source, target, read_only)| muster_api::MountSpec {
                source,
                target,
                read_only: Some(read_only),
            })
            .collect(),
        // Filled on the way out (crate::services::fill_checks).
        checks: Vec::new(),
    }
}
