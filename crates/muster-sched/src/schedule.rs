//! One scheduling cycle: order, admit, place, preempt, reserve, backfill.

use crate::cluster::{ClusterError, ClusterState, NodeIndex, NodeInput, TaskPlacement, TaskShape};
use crate::placer::{FilterCounts, GangFailure, Placer};
use crate::policy::{PlacementPolicy, Scale, Scorer, TypicalWorkload};
use muster_model::{
    CpuMilli, GpuMilli, GpuModel, GpuRequest, JobId, JobSpec, MemoryMib, NodeName, PoolName,
    QueueName, QueueSpec, Time, TopologyStrength,
};
use rand::Rng;
use std::collections::{BTreeMap, BTreeSet};

/// What each task of a job asks of its node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskRequest {
    pub gpus: GpuRequest,
    pub cpu: CpuMilli,
    pub memory: MemoryMib,
    /// Empty: any model.
    pub gpu_models: Vec<GpuModel>,
    pub min_gpu_memory: Option<MemoryMib>,
    pub pool: Option<PoolName>,
    /// The job runs in a container (it names an image).
    pub container: bool,
    /// What it may do on inference pools' nodes.
    pub reserved: crate::cluster::ReservedAccess,
}

impl TaskRequest {
    pub fn of(spec: &JobSpec) -> Self {
        TaskRequest {
            container: spec.image.is_some(),
            reserved: if spec.service.is_some() {
                crate::cluster::ReservedAccess::Service
            } else if spec.preemptible {
                crate::cluster::ReservedAccess::Borrow
            } else {
                crate::cluster::ReservedAccess::No
            },
            gpus: spec.gpus_per_node,
            cpu: spec.cpu_per_node,
            memory: spec.memory_per_node,
            gpu_models: spec.gpu_models.clone(),
            min_gpu_memory: spec.min_gpu_memory,
            pool: spec.pool.clone(),
        }
    }

    /// The request with names interned against `cluster` (a set of GPU
    /// models new to the cluster is added to its table).
    pub fn shape(&self, cluster: &mut ClusterState) -> TaskShape {
        TaskShape {
            gpus: self.gpus,
            cpu_milli: self.cpu.0,
            memory_mib: self.memory.0,
            models: cluster.model_mask(&self.gpu_models),
            pool: self
                .pool
                .as_ref()
                .map(|pool| cluster.pool_index(pool).unwrap_or(u16::MAX)),
            min_gpu_memory_mib: self.min_gpu_memory.map_or(0, |m| m.0),
            container: self.container,
            reserved: self.reserved,
        }
    }
}

/// A job waiting to be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingJob {
    pub id: JobId,
    pub queue: QueueName,
    /// The value of the job's priority class.
    pub priority: i32,
    pub submitted: Time,
    /// Number of tasks (one per node).
    pub tasks: u32,
    pub request: TaskRequest,
    pub same_rack: Option<TopologyStrength>,
    /// From the spec or from history; used by backfill only.
    pub estimated_runtime_ms: Option<u64>,
    /// Keep away from these nodes (a service's replicas spread out).
    pub apart: Option<Apart>,
}

/// Nodes a job should keep off: the nodes of its service's other replicas.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Apart {
    /// Jobs of one group (a service) keep apart from each other's nodes,
    /// those placed in this cycle too.
    pub group: String,
    pub nodes: Vec<NodeName>,
    /// Keep off their racks too, first (then only off the nodes).
    pub racks: bool,
    /// Never on them (replicas that serve on a fixed port); otherwise, with
    /// no other room, on them rather than not at all.
    pub required: bool,
}

impl PendingJob {
    pub fn total_gpu(&self) -> u64 {
        u64::from(self.request.gpus.total().0) * u64::from(self.tasks)
    }
}

/// One task of a running job, bound to a node and concrete GPUs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Allocation {
    pub node: NodeName,
    /// (GPU index, thousandths taken).
    pub gpus: Vec<(u32, u16)>,
    pub cpu: CpuMilli,
    pub memory: MemoryMib,
}

/// A job holding resources.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningJob {
    pub id: JobId,
    pub queue: QueueName,
    pub priority: i32,
    pub started: Time,
    pub tasks: Vec<Allocation>,
    /// When it is expected to end (start + estimate), if known.
    pub expected_end: Option<Time>,
    pub preemptible: bool,
    /// How often it checkpoints; `None`: a preemption loses all its work.
    pub checkpoint_interval_ms: Option<u64>,
    /// A service's replica. Any other job on an inference pool's nodes
    /// borrows them: a replica may preempt it (see [`Cycle::borrowing`]).
    pub service: bool,
}

impl RunningJob {
    pub fn total_gpu(&self) -> u64 {
        self.tasks
            .iter()
            .flat_map(|task| task.gpus.iter())
            .map(|&(_, milli)| u64::from(milli))
            .sum()
    }

    /// Work a preemption at `now` would lose: time since its last checkpoint.
    pub fn work_lost_ms(&self, now: Time) -> u64 {
        let ran = now.millis_since(self.started);
        match self.checkpoint_interval_ms {
            Some(interval) if interval > 0 => ran % interval,
            _ => ran,
        }
    }
}

/// The cluster and its work, as one cycle sees them.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    pub now: Time,
    pub nodes: Vec<NodeInput>,
    pub running: Vec<RunningJob>,
    pub queues: Vec<QueueSpec>,
    /// Decayed GPU-seconds per queue (see [`crate::UsageLedger`]).
    pub usage: BTreeMap<QueueName, f64>,
    /// The mix of requests FGD measures fragmentation against; `None`: the
    /// shapes of the pending and running tasks.
    pub workload: Option<Vec<(TaskRequest, u64)>>,
}

/// How jobs may pass a blocked job ahead of them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backfill {
    /// Nothing passes the first blocked job.
    None,
    /// EASY: the first blocked job holds a reservation; later jobs start only
    /// where they cannot delay it.
    Easy,
    /// Any job that fits starts (may starve large jobs).
    AnyFit,
}

/// The knobs of a cycle.
#[derive(Debug, Clone, PartialEq)]
pub struct SchedulingPolicy {
    pub placement: PlacementPolicy,
    pub backfill: Backfill,
    pub preemption: bool,
    /// Order queues by decayed usage over weight (otherwise by name).
    pub fair_share: bool,
    /// A waiting job gains `aging_step` priority every `aging_interval_ms`.
    pub aging_interval_ms: u64,
    pub aging_step: i32,
    /// Seconds of future use that each GPU a queue holds now counts as, when
    /// comparing queues for fair share within a cycle.
    pub fair_share_horizon_s: f64,
    /// Shapes covering this fraction of tasks are FGD's typical workload.
    pub typical_coverage: f64,
}

impl Default for SchedulingPolicy {
    fn default() -> Self {
        SchedulingPolicy {
            placement: PlacementPolicy::DEFAULT,
            backfill: Backfill::Easy,
            preemption: true,
            fair_share: true,
            aging_interval_ms: 60_000,
            aging_step: 1,
            fair_share_horizon_s: 3600.0,
            typical_coverage: 0.95,
        }
    }
}

impl SchedulingPolicy {
    /// First come, first served: no fair share, no preemption, no backfill.
    pub fn fifo(placement: PlacementPolicy) -> Self {
        SchedulingPolicy {
            placement,
            backfill: Backfill::None,
            preemption: false,
            fair_share: false,
            aging_step: 0,
            ..SchedulingPolicy::default()
        }
    }

    pub fn effective_priority(&self, job: &PendingJob, now: Time) -> i64 {
        let waited = now.millis_since(job.submitted);
        let steps = waited.checked_div(self.aging_interval_ms).unwrap_or(0);
        i64::from(job.priority) + steps as i64 * i64::from(self.aging_step)
    }
}

/// A job started this cycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStart {
    pub job: JobId,
    pub tasks: Vec<Allocation>,
    /// Jobs that must stop first (their resources are counted as free).
    pub after_preempting: Vec<JobId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PreemptionCause {
    /// The preemptor has a higher priority class.
    Priority,
    /// The preemptor's queue takes back its guaranteed quota.
    QuotaReclaim,
    /// The preemptor is a service's replica; the victim borrowed its
    /// inference pool.
    Borrowed,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Preemption {
    pub victim: JobId,
    pub for_job: JobId,
    pub cause: PreemptionCause,
    pub work_lost_ms: u64,
}

/// Capacity held for a blocked job so that backfill cannot starve it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reservation {
    pub job: JobId,
    /// When the capacity is expected to be free; `None` when a job in the way
    /// has no runtime estimate.
    pub start: Option<Time>,
    pub nodes: Vec<NodeName>,
}

/// Why a job was left pending, as data (worded by `muster describe`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PendingReason {
    /// The queue is at its ceiling (guarantee plus borrowing limit).
    QuotaExceeded {
        queue: QueueName,
        in_use: GpuMilli,
        requested: GpuMilli,
        ceiling: GpuMilli,
    },
    /// Fewer nodes than the job has tasks could ever hold one of them as the
    /// cluster stands (wrong pool, model, too large, cordoned): counts per
    /// filter. With some that could (`could_ever_fit` above 0) the job is
    /// too wide: more nodes than the cluster has for it.
    NeverFits { filters: FilterCounts, tasks: u32 },
    /// Only cordoned or lost nodes could hold it: it waits for them.
    NodesUnavailable { filters: FilterCounts },
    /// Not enough free capacity now.
    NoCapacity {
        filters: FilterCounts,
        gang: Option<GangFailure>,
    },
    /// It would fit, but only on capacity reserved for an earlier job.
    BehindReservation { holder: JobId, start: Option<Time> },
    /// Earlier jobs are blocked and backfill is off.
    BehindBlockedJob { blocker: JobId },
    /// This job holds the reservation and waits for it.
    HoldsReservation { start: Option<Time> },
}

/// What a cycle decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Outcome {
    pub started: Vec<JobStart>,
    pub preemptions: Vec<Preemption>,
    pub reservation: Option<Reservation>,
    pub pending: BTreeMap<JobId, PendingReason>,
    /// Pending jobs in the order the cycle considered them.
    pub order: Vec<JobId>,
    /// Nodes of the snapshot the engine left out of this cycle (nothing is
    /// placed there; their running jobs hold nothing the cycle sees), in name
    /// order, each with the reason in words, e.g. "node gpu-9 has 65 GPUs;
    /// the scheduler takes at most 64 per node". See [`ClusterState::excluded_nodes`].
    pub excluded_nodes: Vec<(NodeName, String)>,
}

/// A running job as the cycle tracks it.
struct Live<'a> {
    /// The snapshot's job, or one started in this cycle.
    job: std::borrow::Cow<'a, RunningJob>,
    /// The job's queue's slot in [`Queues`].
    queue: usize,
    placements: Vec<TaskPlacement>,
    preempted: bool,
}

struct QueueState {
    spec: QueueSpec,
    in_use: u64,
    usage: f64,
    /// The lowest priority among the queue's preemptible running jobs at the
    /// cycle's start (`None`: it has none). Jobs started in the cycle are
    /// never victims, and one preempted only raises the true minimum, so
    /// this bounds who can be a victim from below.
    lowest_victim_priority: Option<i32>,
}

/// The cycle's queues, each in a slot: running jobs and the preemption search
/// refer to queues by slot instead of comparing names.
#[derive(Default)]
struct Queues {
    slots: BTreeMap<QueueName, usize>,
    states: Vec<QueueState>,
}

impl Queues {
    fn slot(&self, name: &QueueName) -> Option<usize> {
        self.slots.get(name).copied()
    }

    /// The queue's slot, adding it with `make` if it is new.
    fn slot_or_insert(&mut self, name: &QueueName, make: impl FnOnce() -> QueueState) -> usize {
        if let Some(slot) = self.slot(name) {
            return slot;
        }
        self.states.push(make());
        self.slots.insert(name.clone(), self.states.len() - 1);
        self.states.len() - 1
    }
}

impl QueueState {
    fn ceiling(&self) -> Option<u64> {
        self.spec.ceiling().map(|c| u64::from(c.0))
    }

    fn guaranteed(&self) -> u64 {
        u64::from(self.spec.guaranteed.0)
    }
}

/// A running task's allocation as placements on the cluster's sub-nodes:
/// each GPU goes to the sub-node holding it (GPU indices the node lacks are
/// dropped); CPU and memory go first to the sub-nodes of its GPUs, then (for
/// a CPU-only task first) to a sub-node with room for all that is left, then
/// spill over the others in order, so a node is never counted with more free
/// than it has. Empty for a node the cluster does not have or left out.
fn to_placements(cluster: &ClusterState, allocation: &Allocation) -> Vec<TaskPlacement> {
    let subs = cluster.sub_nodes(&allocation.node);
    if subs.len() == 1 {
        // The common case: the node is one sub-node, GPU index = position.
        let node = subs.start;
        let count = cluster.nodes[node as usize].gpu_index.len() as u32;
        return vec![TaskPlacement {
            node,
            gpus: allocation
                .gpus
                .iter()
                .filter(|&&(index, _)| index < count)
                .map(|&(index, milli)| crate::cluster::GpuGrant { index, milli })
                .collect(),
            cpu_milli: allocation.cpu.0,
            memory_mib: allocation.memory.0,
        }];
    }
    let mut parts: Vec<TaskPlacement> = Vec::new();
    for &(index, milli) in &allocation.gpus {
        let found = subs.clone().find_map(|node| {
            let info = &cluster.nodes[node as usize];
            let local = info.gpu_index.iter().position(|&real| real == index)?;
            Some((node, local as u32))
        });
        let Some((node, local)) = found else { continue };
        let grant = crate::cluster::GpuGrant {
            index: local,
            milli,
        };
        match parts.iter_mut().find(|part| part.node == node) {
            Some(part) => part.gpus.push(grant),
            None => parts.push(TaskPlacement {
                node,
                gpus: vec![grant],
                cpu_milli: 0,
                memory_mib: 0,
            }),
        }
    }
    let (cpu, memory) = (allocation.cpu.0, allocation.memory.0);
    let mut order: Vec<NodeIndex> = parts.iter().map(|part| part.node).collect();
    if order.is_empty()
        && let Some(roomy) = subs.clone().find(|&node| {
            let free = &cluster.free[node as usize];
            free.cpu_milli >= cpu && free.memory_mib >= memory
        })
    {
        order.push(roomy);
    }
    let rest: Vec<NodeIndex> = subs.clone().filter(|node| !order.contains(node)).collect();
    order.extend(rest);
    let spill = |total: u64, free_of: &dyn Fn(NodeIndex) -> u64| -> Vec<u64> {
        let mut left = total;
        let mut taken: Vec<u64> = order
            .iter()
            .map(|&node| {
                let take = left.min(free_of(node));
                left -= take;
                take
            })
            .collect();
        // More than the node has free: count the rest on the first.
        taken[0] += left;
        taken
    };
    let cpu_taken = spill(cpu, &|node| cluster.free[node as usize].cpu_milli);
    let memory_taken = spill(memory, &|node| cluster.free[node as usize].memory_mib);
    for (position, &node) in order.iter().enumerate() {
        let (cpu_milli, memory_mib) = (cpu_taken[position], memory_taken[position]);
        match parts.iter_mut().find(|part| part.node == node) {
            Some(part) => {
                part.cpu_milli = cpu_milli;
                part.memory_mib = memory_mib;
            }
            None if cpu_milli > 0 || memory_mib > 0 => parts.push(TaskPlacement {
                node,
                gpus: Vec::new(),
                cpu_milli,
                memory_mib,
            }),
            None => {}
        }
    }
    parts
}

/// A placement as an allocation on the real node, with its GPU indices.
fn to_allocation(cluster: &ClusterState, placement: &TaskPlacement) -> Allocation {
    let info = &cluster.nodes[placement.node as usize];
    Allocation {
        node: info.name.clone(),
        gpus: placement
            .gpus
            .iter()
            .map(|grant| {
                let index = info
                    .gpu_index
                    .get(grant.index as usize)
                    .copied()
                    .unwrap_or(grant.index);
                (index, grant.milli)
            })
            .collect(),
        cpu: CpuMilli(placement.cpu_milli),
        memory: MemoryMib(placement.memory_mib),
    }
}

/// Runs one scheduling cycle.
///
/// Never returns `Err`: nodes the engine cannot take are left out of the
/// cycle and listed in [`Outcome::excluded_nodes`] (the `Result` is kept so
/// callers need not change).
pub fn schedule<R: Rng>(
    snapshot: &Snapshot,
    pending: &[PendingJob],
    policy: &SchedulingPolicy,
    rng: &mut R,
) -> Result<Outcome, ClusterError> {
    let now = snapshot.now;
    let mut cluster = ClusterState::build(&snapshot.nodes);
    let mut queues = Queues::default();
    for spec in &snapshot.queues {
        queues.slot_or_insert(&spec.name, || QueueState {
            spec: spec.clone(),
            in_use: 0,
            usage: snapshot.usage.get(&spec.name).copied().unwrap_or(0.0),
            lowest_victim_priority: None,
        });
    }
    let queue_entry = |queues: &mut Queues, name: &QueueName| {
        queues.slot_or_insert(name, || QueueState {
            spec: QueueSpec::best_effort(name.0.clone()),
            in_use: 0,
            usage: snapshot.usage.get(name).copied().unwrap_or(0.0),
            lowest_victim_priority: None,
        })
    };

    // Room for every job that could start, at once (growing by doubling
    // would touch twice the memory).
    let mut live: Vec<Live> = Vec::with_capacity(snapshot.running.len() + pending.len());
    let mut victims: Vec<usize> = Vec::new();
    for job in &snapshot.running {
        let mut placements: Vec<TaskPlacement> = Vec::with_capacity(job.tasks.len());
        for allocation in &job.tasks {
            // Placed one by one: a CPU-only task on a node mixing GPU models
            // goes to a sub-node with room left after the ones before.
            for placement in to_placements(&cluster, allocation) {
                cluster.take(&placement);
                placements.push(placement);
            }
        }
        let queue = queue_entry(&mut queues, &job.queue);
        let state = &mut queues.states[queue];
        state.in_use += job.total_gpu();
        if job.preemptible {
            state.lowest_victim_priority = Some(
                state
                    .lowest_victim_priority
                    .map_or(job.priority, |lowest| lowest.min(job.priority)),
            );
            victims.push(live.len());
        }
        live.push(Live {
            job: std::borrow::Cow::Borrowed(job),
            queue,
            placements,
            preempted: false,
        });
    }
    for job in pending {
        queue_entry(&mut queues, &job.queue);
    }

    // Every pending job's shape, interned before the placer takes the cluster.
    let shapes: Vec<TaskShape> = pending
        .iter()
        .map(|job| job.request.shape(&mut cluster))
        .collect();
    let workload = match &snapshot.workload {
        Some(mix) => {
            let shapes: Vec<(TaskShape, u64)> = mix
                .iter()
                .map(|(request, count)| (request.shape(&mut cluster), *count))
                .collect();
            TypicalWorkload::from_tasks(
                shapes
                    .iter()
                    .flat_map(|(shape, count)| std::iter::repeat_n(shape, *count as usize)),
                policy.typical_coverage,
            )
        }
        None => TypicalWorkload::from_tasks(shapes.iter(), policy.typical_coverage),
    };
    let excluded_nodes = cluster.excluded_nodes.clone();
    let scorer = Scorer::new(policy.placement, workload, Scale::of(&cluster));
    let mut cycle = Cycle {
        now,
        policy,
        placer: Placer::new(cluster, scorer),
        queues,
        live,
        victims,
        outcome: Outcome {
            excluded_nodes,
            started: Vec::with_capacity(pending.len()),
            order: Vec::with_capacity(pending.len()),
            ..Outcome::default()
        },
        reservation: None,
        failed: BTreeMap::new(),
        preemption_failed: BTreeSet::new(),
        apart_placed: BTreeMap::new(),
        blocker: None,
        pending: Vec::with_capacity(pending.len()),
    };

    // Per queue (in name order, with the queue's slot), by effective
    // priority, then submit time, then id.
    let mut by_name: BTreeMap<&QueueName, Vec<(&PendingJob, TaskShape)>> = BTreeMap::new();
    for (job, shape) in pending.iter().zip(shapes) {
        by_name.entry(&job.queue).or_default().push((job, shape));
    }
    let mut per_queue: Vec<(usize, Vec<(&PendingJob, TaskShape)>)> = by_name
        .into_iter()
        .filter_map(|(name, jobs)| Some((cycle.queues.slot(name)?, jobs)))
        .collect();
    for (_, jobs) in &mut per_queue {
        // Each key computed once (not once per comparison); ids are unique,
        // so the order is total and an unstable sort gives the same one.
        let mut keyed: Vec<(LineKey, (&PendingJob, TaskShape))> = jobs
            .drain(..)
            .map(|(job, shape)| {
                let key = (
                    std::cmp::Reverse(policy.effective_priority(job, now)),
                    job.submitted,
                    job.id,
                );
                (key, (job, shape))
            })
            .collect();
        keyed.sort_unstable_by(|(a, _), (b, _)| b.cmp(a)); // pop from the back
        jobs.extend(keyed.into_iter().map(|(_, job)| job));
    }
    // Each queue's head's effective priority, computed when it becomes the
    // head.
    let mut heads: Vec<Option<i64>> = per_queue
        .iter()
        .map(|(_, jobs)| {
            jobs.last()
                .map(|(head, _)| policy.effective_priority(head, now))
        })
        .collect();
    loop {
        let mut best: Option<(usize, (i64, f64, Time))> = None;
        for (position, (slot, jobs)) in per_queue.iter().enumerate() {
            let (Some((head, _)), Some(priority)) = (jobs.last(), heads[position]) else {
                continue;
            };
            let share = if policy.fair_share {
                let state = &cycle.queues.states[*slot];
                (state.usage + state.in_use as f64 / 1000.0 * policy.fair_share_horizon_s)
                    / f64::from(state.spec.weight.max(1))
            } else {
                0.0
            };
            let key = (priority, share, head.submitted);
            let better = match &best {
                None => true,
                Some((_, (priority, best_share, submitted))) => {
                    key.0 > *priority
                        || (key.0 == *priority
                            && (key.1 < *best_share
                                || (key.1 == *best_share && key.2 < *submitted)))
                }
            };
            if better {
                best = Some((position, key));
            }
        }
        let Some((position, _)) = best else { break };
        let Some((job, shape)) = per_queue[position].1.pop() else {
            break;
        };
        heads[position] = per_queue[position]
            .1
            .last()
            .map(|(head, _)| policy.effective_priority(head, now));
        cycle.outcome.order.push(job.id);
        cycle.consider(job, shape, per_queue[position].0, rng);
    }
    // Built at once from the reasons in id order (one insert at a time, in
    // the order considered, costs a search and a node split each).
    // Every job considered either started or is left pending, once.
    debug_assert_eq!(
        cycle.outcome.order.len(),
        cycle.outcome.started.len() + cycle.pending.len()
    );
    let mut pending = std::mem::take(&mut cycle.pending);
    pending.sort_unstable_by_key(|(id, _)| *id);
    cycle.outcome.pending = pending.into_iter().collect();
    Ok(cycle.outcome)
}

/// A pending job's place in its queue's line: effective priority (highest
/// first), then submit time, then id.
type LineKey = (std::cmp::Reverse<i64>, Time, JobId);

/// Failure memo key: shape, tasks, topology, whether reserved nodes were
/// excluded. Within a cycle free capacity only shrinks (until a preemption),
/// so a failed key fails again.
type FailureKey = (TaskShape, u32, Option<TopologyStrength>, bool);

/// Preemption memo key: shape, tasks, topology, priority, queue (its slot).
type PreemptionKey = (TaskShape, u32, Option<TopologyStrength>, i32, usize);

struct Cycle<'a> {
    now: Time,
    policy: &'a SchedulingPolicy,
    placer: Placer,
    queues: Queues,
    live: Vec<Live<'a>>,
    /// Positions in `live` of the jobs that may be preempted (running at
    /// the cycle's start and preemptible).
    victims: Vec<usize>,
    outcome: Outcome,
    /// The reservation's holder, shadow time, and node set.
    reservation: Option<(JobId, Option<Time>, BTreeSet<NodeIndex>)>,
    failed: BTreeMap<FailureKey, PendingReason>,
    preemption_failed: BTreeSet<PreemptionKey>,
    /// Nodes given this cycle to each [`Apart::group`].
    apart_placed: BTreeMap<String, Vec<NodeName>>,
    blocker: Option<JobId>,
    /// The reason of each job left pending, in the order considered (the
    /// outcome's map is built from it at the end).
    pending: Vec<(JobId, PendingReason)>,
}

impl Cycle<'_> {
    /// Places `job` (of the queue in `slot`) or says why it waits.
    fn consider<R: Rng>(&mut self, job: &PendingJob, shape: TaskShape, slot: usize, rng: &mut R) {
        if let Some(blocker) = self.blocker {
            self.pending
                .push((job.id, PendingReason::BehindBlockedJob { blocker }));
            return;
        }
        let total = job.total_gpu();
        let queue = &self.queues.states[slot];
        if let Some(ceiling) = queue.ceiling()
            && queue.in_use + total > ceiling
        {
            self.pending.push((
                job.id,
                PendingReason::QuotaExceeded {
                    queue: job.queue.clone(),
                    in_use: GpuMilli(queue.in_use as u32),
                    requested: GpuMilli(total as u32),
                    ceiling: GpuMilli(ceiling as u32),
                },
            ));
            return;
        }
        // Backfill: a job that would end before the reservation starts may use
        // the reserved nodes; any other job must keep off them.
        let keep_off = self.reservation.as_ref().is_some_and(|(_, start, _)| {
            let ends_in_time = match (start, job.estimated_runtime_ms) {
                (Some(start), Some(estimate)) => self.now.plus_millis(estimate) <= *start,
                _ => false,
            };
            !ends_in_time
        });
        let key: FailureKey = (shape, job.tasks, job.same_rack, keep_off);
        // A job like one that failed this cycle fails too (most of a long
        // queue): answered before anything is built for it.
        if job.apart.is_none()
            && let Some(reason) = self.failed.get(&key)
        {
            let reason = reason.clone();
            self.after_failure(job, &shape, slot, reason, rng);
            return;
        }
        let excluded_nodes: Option<BTreeSet<NodeIndex>> = self
            .reservation
            .as_ref()
            .filter(|_| keep_off)
            .map(|(_, _, nodes)| nodes.clone());
        if let Some(apart) = &job.apart {
            match self.place_apart(job, &shape, apart, excluded_nodes.as_ref(), rng) {
                Ok(()) => return,
                // Not by preemption either: a victim's node could be one
                // it must keep off.
                Err(Some(reason)) => {
                    self.pending.push((job.id, reason));
                    return;
                }
                // Anywhere, as any job.
                Err(None) => {}
            }
        }
        if let Some(reason) = self.failed.get(&key) {
            let reason = reason.clone();
            self.after_failure(job, &shape, slot, reason, rng);
            return;
        }
        let excluded = |node: NodeIndex| excluded_nodes.as_ref().is_some_and(|s| s.contains(&node));
        let placed = self
            .placer
            .choose_gang(&shape, job.tasks, job.same_rack, &excluded, rng);
        match placed {
            Ok(placements) => self.start(job, placements, Vec::new()),
            Err(gang) => {
                let filters = self.placer.diagnose(&shape, &excluded);
                let reason = if filters.never_fits(job.tasks) {
                    if filters.could_fit_when_available >= job.tasks {
                        PendingReason::NodesUnavailable { filters }
                    } else {
                        PendingReason::NeverFits {
                            filters,
                            tasks: job.tasks,
                        }
                    }
                } else if excluded_nodes.is_some()
                    && filters.feasible + filters.reserved >= job.tasks
                    && filters.feasible < job.tasks
                {
                    let (holder, start, _) = self
                        .reservation
                        .as_ref()
                        .map(|(holder, start, nodes)| (*holder, *start, nodes.len()))
                        .unwrap_or((job.id, None, 0));
                    PendingReason::BehindReservation { holder, start }
                } else {
                    PendingReason::NoCapacity {
                        filters,
                        gang: (job.tasks > 1).then_some(gang),
                    }
                };
                self.failed.insert(key, reason.clone());
                self.after_failure(job, &shape, slot, reason, rng);
            }
        }
    }

    /// Places `job` off the nodes (and first the racks) of `apart`; `Err(None)`
    /// when it may go anywhere instead, `Err(Some(reason))` when it must wait.
    fn place_apart<R: Rng>(
        &mut self,
        job: &PendingJob,
        shape: &TaskShape,
        apart: &Apart,
        reserved: Option<&BTreeSet<NodeIndex>>,
        rng: &mut R,
    ) -> Result<(), Option<PendingReason>> {
        let cluster = self.placer.cluster();
        let mut nodes: BTreeSet<NodeIndex> = BTreeSet::new();
        let placed = self.apart_placed.get(&apart.group);
        for name in apart.nodes.iter().chain(placed.into_iter().flatten()) {
            nodes.extend(cluster.sub_nodes(name));
        }
        if nodes.is_empty() {
            return Err(None);
        }
        let mut tries = Vec::with_capacity(2);
        if apart.racks {
            let racks: BTreeSet<u16> = nodes
                .iter()
                .map(|&node| cluster.nodes[node as usize].rack)
                .collect();
            let in_racks: BTreeSet<NodeIndex> = (0..cluster.len() as NodeIndex)
                .filter(|&node| racks.contains(&cluster.nodes[node as usize].rack))
                .collect();
            tries.push(in_racks);
        }
        tries.push(nodes);
        for avoid in &tries {
            let excluded = |node: NodeIndex| {
                avoid.contains(&node) || reserved.is_some_and(|set| set.contains(&node))
            };
            if let Ok(placements) =
                self.placer
                    .choose_gang(shape, job.tasks, job.same_rack, &excluded, rng)
            {
                self.start(job, placements, Vec::new());
                return Ok(());
            }
        }
        if !apart.required {
            return Err(None);
        }
        let avoid = tries.last().cloned().unwrap_or_default();
        let excluded = |node: NodeIndex| {
            avoid.contains(&node) || reserved.is_some_and(|set| set.contains(&node))
        };
        let filters = self.placer.diagnose(shape, &excluded);
        Err(Some(PendingReason::NoCapacity {
            filters,
            gang: None,
        }))
    }

    fn after_failure<R: Rng>(
        &mut self,
        job: &PendingJob,
        shape: &TaskShape,
        slot: usize,
        reason: PendingReason,
        rng: &mut R,
    ) {
        let capacity_bound = matches!(reason, PendingReason::NoCapacity { .. });
        if capacity_bound && self.policy.preemption {
            // A job like one that found no victims finds none either, until
            // a preemption changes the cluster.
            let key = (*shape, job.tasks, job.same_rack, job.priority, slot);
            if !self.preemption_failed.contains(&key) {
                if self.try_preempt(job, shape, rng) {
                    return;
                }
                self.preemption_failed.insert(key);
            }
        }
        let reason = if capacity_bound {
            match self.policy.backfill {
                Backfill::None => {
                    self.blocker = Some(job.id);
                    reason
                }
                Backfill::Easy if self.reservation.is_none() => {
                    match self.reserve(job, shape, rng) {
                        Some(start) => PendingReason::HoldsReservation { start },
                        None => reason,
                    }
                }
                _ => reason,
            }
        } else {
            reason
        };
        self.pending.push((job.id, reason));
    }

    fn start(&mut self, job: &PendingJob, placements: Vec<TaskPlacement>, victims: Vec<JobId>) {
        for placement in &placements {
            self.placer.commit(placement);
        }
        // Every pending job's queue has a slot already (see `schedule`).
        let queue = self.queues.slot_or_insert(&job.queue, || QueueState {
            spec: QueueSpec::best_effort(job.queue.0.clone()),
            in_use: 0,
            usage: 0.0,
            lowest_victim_priority: None,
        });
        self.queues.states[queue].in_use += job.total_gpu();
        let cluster = self.placer.cluster();
        let tasks: Vec<Allocation> = placements
            .iter()
            .map(|placement| to_allocation(cluster, placement))
            .collect();
        if let Some(apart) = &job.apart {
            self.apart_placed
                .entry(apart.group.clone())
                .or_default()
                .extend(tasks.iter().map(|task| task.node.clone()));
        }
        self.live.push(Live {
            job: std::borrow::Cow::Owned(RunningJob {
                id: job.id,
                queue: job.queue.clone(),
                priority: job.priority,
                started: self.now,
                // Never read: a job started in this cycle is no victim, and
                // reservations read `placements`.
                tasks: Vec::new(),
                expected_end: job
                    .estimated_runtime_ms
                    .map(|estimate| self.now.plus_millis(estimate)),
                preemptible: false, // not a victim within its own cycle
                checkpoint_interval_ms: None,
                service: false,
            }),
            queue,
            placements,
            preempted: false,
        });
        self.outcome.started.push(JobStart {
            job: job.id,
            tasks,
            after_preempting: victims,
        });
    }

    /// Whether `victim` may make way for `job`, given how much GPU its queue
    /// has already given up in this search. Cross-queue preemption never
    /// leaves the victim's queue below its guarantee while the preemptor's
    /// queue is above its own, so the victim can never reclaim it back.
    fn eligible(
        &self,
        job: &PendingJob,
        job_queue: usize,
        live: &Live,
        already_taken: u64,
    ) -> Option<PreemptionCause> {
        let victim = &live.job;
        if !victim.preemptible {
            return None;
        }
        if job.request.reserved == crate::cluster::ReservedAccess::Service && self.borrowing(live) {
            return Some(PreemptionCause::Borrowed);
        }
        if live.queue == job_queue {
            return (victim.priority < job.priority).then_some(PreemptionCause::Priority);
        }
        let preemptor = &self.queues.states[job_queue];
        let owner = &self.queues.states[live.queue];
        let preemptor_after = preemptor.in_use + job.total_gpu();
        let preemptor_within = preemptor_after <= preemptor.guaranteed();
        let owner_in_use = owner.in_use.saturating_sub(already_taken);
        if owner_in_use <= owner.guaranteed() {
            return None; // a queue within its guarantee is protected
        }
        let owner_after = owner_in_use.saturating_sub(victim.total_gpu());
        if !preemptor_within && owner_after < owner.guaranteed() {
            return None;
        }
        if preemptor_within {
            Some(PreemptionCause::QuotaReclaim)
        } else if victim.priority < job.priority {
            Some(PreemptionCause::Priority)
        } else {
            None
        }
    }

    /// Whether `live` borrows an inference pool: it is no service and one
    /// of its tasks is on such a node.
    fn borrowing(&self, live: &Live) -> bool {
        let nodes = &self.placer.cluster().nodes;
        !live.job.service
            && live
                .placements
                .iter()
                .any(|placement| nodes[placement.node as usize].reserved)
    }

    fn victim_cost(&self, victim: &RunningJob) -> (i32, u64, JobId) {
        (victim.priority, victim.work_lost_ms(self.now), victim.id)
    }

    /// Finds the cheapest set of running jobs whose removal lets `job` be
    /// placed (lowest priority, then least work lost since a checkpoint, then
    /// fewest victims), and if there is one, preempts them and starts `job`.
    fn try_preempt<R: Rng>(&mut self, job: &PendingJob, shape: &TaskShape, rng: &mut R) -> bool {
        let Some(job_queue) = self.queues.slot(&job.queue) else {
            return false;
        };
        // Who could be a victim at all (see `eligible`): a lower priority
        // job of the same queue; of a queue above its guarantee, any job
        // while this job's queue stays within its own, else a lower priority
        // one. Most cycles have none: skip the scan.
        let preemptor = &self.queues.states[job_queue];
        let preemptor_within = preemptor.in_use + job.total_gpu() <= preemptor.guaranteed();
        let service = job.request.reserved == crate::cluster::ReservedAccess::Service;
        let possible = self.queues.states.iter().enumerate().any(|(slot, state)| {
            state.lowest_victim_priority.is_some_and(|lowest| {
                if slot == job_queue {
                    lowest < job.priority
                } else {
                    state.in_use > state.guaranteed() && (preemptor_within || lowest < job.priority)
                }
            })
        }) || (service
            && self
                .live
                .iter()
                .any(|live| !live.preempted && self.borrowing(live)));
        if !possible {
            return false;
        }
        let mut candidates: Vec<usize> = self
            .victims
            .iter()
            .copied()
            .filter(|&i| !self.live[i].preempted)
            .filter(|&i| self.eligible(job, job_queue, &self.live[i], 0).is_some())
            .collect();
        if candidates.is_empty() {
            return false;
        }
        candidates.sort_by_key(|&i| self.victim_cost(&self.live[i].job));

        // Trial on a scanning copy of the cluster: release candidates cheapest
        // first until the job fits, then put back every victim it can spare.
        let mut trial =
            Placer::new_scanning(self.placer.cluster().clone(), self.placer.scorer().clone());
        let mut chosen: Vec<usize> = Vec::new();
        let mut taken_per_queue: Vec<u64> = vec![0; self.queues.states.len()];
        let none = |_: NodeIndex| false;
        let mut fits = false;
        for &candidate in &candidates {
            let entry = &self.live[candidate];
            let taken = taken_per_queue[entry.queue];
            if self.eligible(job, job_queue, entry, taken).is_none() {
                continue;
            }
            let relevant = self.live[candidate]
                .placements
                .iter()
                .any(|p| trial.cluster().static_filter(p.node, shape).is_none());
            if !relevant {
                continue;
            }
            for placement in &self.live[candidate].placements {
                trial.release(placement);
            }
            taken_per_queue[entry.queue] += entry.job.total_gpu();
            chosen.push(candidate);
            if trial
                .choose_gang(shape, job.tasks, job.same_rack, &none, rng)
                .is_ok()
            {
                fits = true;
                break;
            }
        }
        if !fits {
            return false;
        }
        // Spare the most expensive victims first.
        for position in (0..chosen.len()).rev() {
            let candidate = chosen[position];
            for placement in &self.live[candidate].placements {
                trial.commit(placement);
            }
            if trial
                .choose_gang(shape, job.tasks, job.same_rack, &none, rng)
                .is_ok()
            {
                chosen.remove(position);
            } else {
                for placement in &self.live[candidate].placements {
                    trial.release(placement);
                }
            }
        }
        // Apply: release the victims for real, then place with the policy.
        let mut victims = Vec::new();
        for &candidate in &chosen {
            let cause = self
                .eligible(job, job_queue, &self.live[candidate], 0)
                .unwrap_or(PreemptionCause::Priority);
            let entry = &mut self.live[candidate];
            entry.preempted = true;
            for placement in &entry.placements {
                self.placer.release(placement);
            }
            let victim: &RunningJob = &entry.job;
            let owner = &mut self.queues.states[entry.queue];
            owner.in_use = owner.in_use.saturating_sub(victim.total_gpu());
            self.outcome.preemptions.push(Preemption {
                victim: victim.id,
                for_job: job.id,
                cause,
                work_lost_ms: victim.work_lost_ms(self.now),
            });
            victims.push(victim.id);
        }
        self.failed.clear();
        self.preemption_failed.clear();
        match self
            .placer
            .choose_gang(shape, job.tasks, job.same_rack, &none, rng)
        {
            Ok(placements) => {
                self.start(job, placements, victims);
                true
            }
            Err(_) => false,
        }
    }

    /// EASY backfill: finds when and where the blocked `job` could start as
    /// running jobs end (known ends first, in order), and holds those nodes.
    fn reserve<R: Rng>(
        &mut self,
        job: &PendingJob,
        shape: &TaskShape,
        rng: &mut R,
    ) -> Option<Option<Time>> {
        let mut order: Vec<usize> = (0..self.live.len())
            .filter(|&i| !self.live[i].preempted)
            .collect();
        order.sort_by_key(|&i| {
            let entry = &self.live[i].job;
            (
                entry.expected_end.is_none(),
                entry.expected_end,
                entry.started,
                entry.id,
            )
        });
        let mut trial =
            Placer::new_scanning(self.placer.cluster().clone(), self.placer.scorer().clone());
        let none = |_: NodeIndex| false;
        let needed = job.tasks as usize;
        let mut feasible: BTreeSet<NodeIndex> = (0..trial.cluster().len() as NodeIndex)
            .filter(|&node| trial.cluster().fits(node, shape))
            .collect();
        for i in order {
            let entry = &self.live[i];
            for placement in &entry.placements {
                trial.release(placement);
                if trial.cluster().fits(placement.node, shape) {
                    feasible.insert(placement.node);
                }
            }
            if feasible.len() < needed {
                continue;
            }
            if let Ok(placements) = trial.choose_gang(shape, job.tasks, job.same_rack, &none, rng) {
                let start = entry.job.expected_end;
                let nodes: BTreeSet<NodeIndex> = placements.iter().map(|p| p.node).collect();
                let cluster = self.placer.cluster();
                // Real node names (sub-nodes of one node are adjacent).
                let mut names: Vec<NodeName> = nodes
                    .iter()
                    .map(|&n| cluster.nodes[n as usize].name.clone())
                    .collect();
                names.dedup();
                self.outcome.reservation = Some(Reservation {
                    job: job.id,
                    start,
                    nodes: names,
                });
                self.failed.clear();
                self.reservation = Some((job.id, start, nodes));
                return Some(start);
            }
        }
        None
    }
}

fn gpus(milli: GpuMilli) -> String {
    if milli.0.is_multiple_of(1000) {
        format!("{}", milli.0 / 1000)
    } else {
        format!("{:.3}", f64::from(milli.0) / 1000.0)
    }
}

fn filter_words(filters: &FilterCounts) -> String {
    let mut parts: Vec<String> = filters
        .rejected
        .iter()
        .filter(|(_, count)| **count > 0)
        .map(|(reason, count)| {
            let why = match reason {
                crate::FilterReason::Pool => "are in another pool",
                crate::FilterReason::Cordoned => "are cordoned",
                crate::FilterReason::Unhealthy => "are unhealthy",
                crate::FilterReason::GpuModel => "have another GPU model",
                crate::FilterReason::GpuMemory => "have too little GPU memory",
                crate::FilterReason::Containers => "cannot run containers (no Docker engine)",
                crate::FilterReason::Reserved => {
                    "are in an inference pool (services, and only preemptible other work)"
                }
                crate::FilterReason::Gpus => "have too few free GPUs",
                crate::FilterReason::Cpu => "have too little free CPU",
                crate::FilterReason::Memory => "have too little free memory",
            };
            format!("{count} {why}")
        })
        .collect();
    if filters.reserved > 0 {
        parts.push(format!("{} are held for a reservation", filters.reserved));
    }
    if parts.is_empty() {
        "the cluster has no nodes".to_string()
    } else {
        parts.join(", ")
    }
}

/// The nodes of `nodes` that could hold one task of `request` if each were
/// ready, uncordoned, healthy and empty (a node mixing GPU models is named
/// once): the test a submission takes before it is queued; a job needs as
/// many as it has tasks. Nodes the engine cannot take at all are left out.
pub fn nodes_that_could_ever_hold(nodes: &[NodeInput], request: &TaskRequest) -> Vec<NodeName> {
    let mut cluster = ClusterState::build(nodes);
    let shape = request.shape(&mut cluster);
    let mut names: Vec<NodeName> = Vec::new();
    for node in 0..cluster.len() as NodeIndex {
        let name = &cluster.nodes[node as usize].name;
        if names.last() != Some(name) && cluster.could_ever_fit(node, &shape) {
            names.push(name.clone());
        }
    }
    names
}

impl PendingReason {
    /// A short code for the reason, for columns and scripts (the sentence
    /// is [`PendingReason`]'s `Display`): `quota`, `never-fits`, `too-wide`,
    /// `nodes-cordoned`, `nodes-lost`, `nodes-unavailable` (both),
    /// `capacity`, `rack` (a gang that needs one rack finds none large
    /// enough), `reservation` (behind or holding one), `blocked` (behind a
    /// blocked job, backfill off).
    pub fn code(&self) -> &'static str {
        match self {
            PendingReason::QuotaExceeded { .. } => "quota",
            PendingReason::NeverFits { filters, .. } if filters.could_ever_fit > 0 => "too-wide",
            PendingReason::NeverFits { .. } => "never-fits",
            PendingReason::NodesUnavailable { filters } => {
                let count = |reason| filters.rejected.get(&reason).copied().unwrap_or(0);
                match (
                    count(crate::FilterReason::Cordoned),
                    count(crate::FilterReason::Unhealthy),
                ) {
                    (_, 0) => "nodes-cordoned",
                    (0, _) => "nodes-lost",
                    _ => "nodes-unavailable",
                }
            }
            PendingReason::NoCapacity {
                gang: Some(GangFailure::NoRackLargeEnough { .. }),
                ..
            } => "rack",
            PendingReason::NoCapacity { .. } => "capacity",
            PendingReason::BehindReservation { .. } | PendingReason::HoldsReservation { .. } => {
                "reservation"
            }
            PendingReason::BehindBlockedJob { .. } => "blocked",
        }
    }
}

impl std::fmt::Display for PendingReason {
    /// The reason in words, for `muster describe`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PendingReason::QuotaExceeded {
                queue,
                in_use,
                requested,
                ceiling,
            } => write!(
                f,
                "queue {queue} holds {} GPUs of its limit of {}; this job needs {} more \
                 (waits until the queue's jobs finish, or ask an admin to raise the limit)",
                gpus(*in_use),
                gpus(*ceiling),
                gpus(*requested)
            ),
            PendingReason::NeverFits { filters, tasks } if filters.could_ever_fit > 0 => {
                write!(
                    f,
                    "too wide for the cluster: it needs {tasks} nodes, and only {} nodes could \
                     ever hold one of its tasks",
                    filters.could_ever_fit
                )?;
                if filters.rejected.values().any(|count| *count > 0) || filters.reserved > 0 {
                    write!(f, " (of the others, {})", filter_words(filters))?;
                }
                write!(
                    f,
                    "; ask for fewer nodes (with more GPUs each), or it starts when more such \
                     nodes join"
                )
            }
            PendingReason::NeverFits { filters, .. } => write!(
                f,
                "no node can ever run this job as the cluster stands: only {} nodes could \
                 hold one task even when empty ({}); ask for fewer GPUs, CPUs or memory, \
                 another pool or GPU model, or fewer nodes",
                filters.could_ever_fit,
                filter_words(filters)
            ),
            PendingReason::NodesUnavailable { filters } => write!(
                f,
                "waiting for nodes to come back: only {} nodes could hold one task now, {} \
                 once cordoned or lost nodes are back ({}); `muster uncordon` or the \
                 nodes' agents bring them back",
                filters.could_ever_fit,
                filters.could_fit_when_available,
                filter_words(filters)
            ),
            PendingReason::NoCapacity { filters, gang } => {
                match gang {
                    Some(crate::GangFailure::NoRackLargeEnough {
                        largest_rack,
                        needed,
                    }) => write!(
                        f,
                        "waiting for {needed} free nodes in one rack (the job requires one \
                         rack; the best rack has {largest_rack} now)"
                    )?,
                    Some(crate::GangFailure::TooFewNodes { feasible, needed }) => write!(
                        f,
                        "waiting for capacity: {feasible} of the {needed} nodes it needs are \
                         free now"
                    )?,
                    None => write!(f, "waiting for capacity")?,
                }
                write!(f, "; of the other nodes, {}", filter_words(filters))
            }
            PendingReason::BehindReservation { holder, start } => {
                write!(
                    f,
                    "it fits only on nodes held for job {holder}, which is next in line"
                )?;
                if let Some(start) = start {
                    write!(
                        f,
                        " and expected to start at t={}s; a runtime estimate that ends \
                         before then would let it run now",
                        start.0 / 1000
                    )?;
                }
                Ok(())
            }
            PendingReason::BehindBlockedJob { blocker } => write!(
                f,
                "waiting behind job {blocker}, which is blocked (backfill is off)"
            ),
            PendingReason::HoldsReservation { start } => match start {
                Some(start) => write!(
                    f,
                    "next in line: capacity is reserved for it, expected free at t={}s",
                    start.0 / 1000
                ),
                None => write!(
                    f,
                    "next in line: capacity is reserved for it as running jobs end \
                     (their end times are not known)"
                ),
            },
        }
    }
}
