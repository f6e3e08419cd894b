//! Builders and shared invariant checks for muster's tests (a dev-dependency
//! only; never part of a shipped binary).
//!
//! `MakeNode` and `MakeJob` build model values with sensible defaults, so a
//! test states only what matters to it; `check_outcome` verifies an
//! [`Outcome`] against the snapshot it came from (no GPU share over-committed,
//! no node capacity exceeded, gangs all-or-nothing, constraints honoured).

pub mod docker;
pub mod postgres;

use muster_model::{
    CpuMilli, GpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, MemoryMib, NodeName, NodeSpec,
    PoolName, QueueName, RackName, Time, TopologyStrength,
};
use muster_sched::{Allocation, NodeInput, Outcome, PendingJob, RunningJob, Snapshot, TaskRequest};
use std::collections::{BTreeMap, BTreeSet};

/// Builds a node: 8 x H100-80GB, 64 CPUs, 512 GiB, pool `default`, rack `r0`.
#[derive(Debug, Clone)]
pub struct MakeNode {
    input: NodeInput,
}

impl MakeNode {
    pub fn new(name: &str) -> Self {
        let mut node = MakeNode {
            input: NodeInput::schedulable(NodeSpec {
                name: NodeName::from(name),
                pool: PoolName::from("default"),
                rack: RackName::from("r0"),
                gpus: Vec::new(),
                cpu: CpuMilli(64_000),
                memory: MemoryMib(512 * 1024),
            }),
        };
        node = node.gpus(8, "H100-80GB");
        node
    }

    /// `count` GPUs of `model` in one NVLink domain (80 GiB each).
    pub fn gpus(mut self, count: u32, model: &str) -> Self {
        let name = self.input.spec.name.0.clone();
        self.input.spec.gpus = (0..count)
            .map(|index| GpuSpec {
                index,
                uuid: format!("GPU-{name}-{index}"),
                model: GpuModel::new(model),
                memory: MemoryMib(80 * 1024),
                nvlink_domain: 0,
            })
            .collect();
        self
    }

    pub fn gpu_memory_gib(mut self, gib: u64) -> Self {
        for gpu in &mut self.input.spec.gpus {
            gpu.memory = MemoryMib(gib * 1024);
        }
        self
    }

    /// Splits the GPUs into NVLink domains of `size` GPUs each.
    pub fn nvlink_domains_of(mut self, size: u32) -> Self {
        for gpu in &mut self.input.spec.gpus {
            gpu.nvlink_domain = gpu.index / size.max(1);
        }
        self
    }

    pub fn cpus(mut self, cpus: u64) -> Self {
        self.input.spec.cpu = CpuMilli(cpus * 1000);
        self
    }

    pub fn memory_gib(mut self, gib: u64) -> Self {
        self.input.spec.memory = MemoryMib(gib * 1024);
        self
    }

    pub fn pool(mut self, pool: &str) -> Self {
        self.input.spec.pool = PoolName::from(pool);
        self
    }

    pub fn rack(mut self, rack: &str) -> Self {
        self.input.spec.rack = RackName::from(rack);
        self
    }

    pub fn cordoned(mut self) -> Self {
        self.input.cordoned = true;
        self
    }

    pub fn unhealthy(mut self) -> Self {
        self.input.healthy = false;
        self
    }

    pub fn unhealthy_gpu(mut self, index: u32) -> Self {
        self.input.unhealthy_gpus.push(index);
        self
    }

    /// A node with no container engine.
    pub fn without_containers(mut self) -> Self {
        self.input.containers = false;
        self
    }

    /// A node of an inference pool.
    pub fn inference(mut self) -> Self {
        self.input.reserved = true;
        self
    }

    pub fn build(self) -> NodeInput {
        self.input
    }
}

/// `count` nodes named `prefix-000`.., in racks of `per_rack`.
pub fn make_nodes(prefix: &str, count: usize, per_rack: usize) -> Vec<NodeInput> {
    (0..count)
        .map(|i| {
            MakeNode::new(&format!("{prefix}-{i:03}"))
                .rack(&format!("rack-{:02}", i / per_rack.max(1)))
                .build()
        })
        .collect()
}

/// Builds a pending job: 1 task of 1 GPU, 1 CPU, 1 GiB, queue `default`,
/// priority 100, submitted at time 0.
#[derive(Debug, Clone)]
pub struct MakeJob {
    job: PendingJob,
}

impl MakeJob {
    pub fn new(id: u64) -> Self {
        MakeJob {
            job: PendingJob {
                id: JobId(id),
                queue: QueueName::from("default"),
                priority: 100,
                submitted: Time(0),
                tasks: 1,
                request: TaskRequest {
                    container: false,
                    gpus: GpuRequest::Whole(1),
                    cpu: CpuMilli(1000),
                    memory: MemoryMib(1024),
                    gpu_models: Vec::new(),
                    min_gpu_memory: None,
                    pool: None,
                    reserved: Default::default(),
                },
                same_rack: None,
                estimated_runtime_ms: None,
                apart: None,
            },
        }
    }

    pub fn gpus(mut self, count: u32) -> Self {
        self.job.request.gpus = GpuRequest::Whole(count);
        self
    }

    /// A share of one GPU, in thousandths.
    pub fn share(mut self, milli: u32) -> Self {
        self.job.request.gpus = GpuRequest::Shared(GpuMilli(milli));
        self
    }

    pub fn tasks(mut self, tasks: u32) -> Self {
        self.job.tasks = tasks;
        self
    }

    pub fn cpus(mut self, cpus: u64) -> Self {
        self.job.request.cpu = CpuMilli(cpus * 1000);
        self
    }

    pub fn cpu_milli(mut self, milli: u64) -> Self {
        self.job.request.cpu = CpuMilli(milli);
        self
    }

    pub fn memory_gib(mut self, gib: u64) -> Self {
        self.job.request.memory = MemoryMib(gib * 1024);
        self
    }

    pub fn models(mut self, models: &[&str]) -> Self {
        self.job.request.gpu_models = models.iter().map(|m| GpuModel::new(m)).collect();
        self
    }

    pub fn min_gpu_memory_gib(mut self, gib: u64) -> Self {
        self.job.request.min_gpu_memory = Some(MemoryMib(gib * 1024));
        self
    }

    pub fn pool(mut self, pool: &str) -> Self {
        self.job.request.pool = Some(PoolName::from(pool));
        self
    }

    /// The job names an image: it runs in containers.
    pub fn in_container(mut self) -> Self {
        self.job.request.container = true;
        self
    }

    pub fn queue(mut self, queue: &str) -> Self {
        self.job.queue = QueueName::from(queue);
        self
    }

    pub fn priority(mut self, priority: i32) -> Self {
        self.job.priority = priority;
        self
    }

    pub fn submitted_secs(mut self, secs: u64) -> Self {
        self.job.submitted = Time::from_secs(secs);
        self
    }

    pub fn same_rack(mut self, strength: TopologyStrength) -> Self {
        self.job.same_rack = Some(strength);
        self
    }

    pub fn estimate_secs(mut self, secs: u64) -> Self {
        self.job.estimated_runtime_ms = Some(secs * 1000);
        self
    }

    /// A replica of service `group`: off `nodes` (and the group's other
    /// replicas), their racks first with `racks`, never on them with
    /// `required`.
    pub fn apart(mut self, group: &str, nodes: &[&str], racks: bool, required: bool) -> Self {
        self.job.apart = Some(muster_sched::Apart {
            group: group.to_string(),
            nodes: nodes.iter().map(|node| NodeName::from(*node)).collect(),
            racks,
            required,
        });
        self
    }

    /// What it may do on inference pools' nodes (default: not go there).
    pub fn reserved(mut self, access: muster_sched::ReservedAccess) -> Self {
        self.job.request.reserved = access;
        self
    }

    pub fn build(self) -> PendingJob {
        self.job
    }
}

/// A running job built from a started pending job's allocations.
pub fn running_from(
    job: &PendingJob,
    tasks: Vec<Allocation>,
    started: Time,
    expected_end: Option<Time>,
) -> RunningJob {
    RunningJob {
        id: job.id,
        queue: job.queue.clone(),
        priority: job.priority,
        started,
        tasks,
        expected_end,
        preemptible: true,
        checkpoint_interval_ms: None,
        service: false,
    }
}

/// Runs every check of an outcome against the snapshot and pending jobs it
/// came from; returns the first violation found.
pub fn check_outcome(
    snapshot: &Snapshot,
    pending: &[PendingJob],
    outcome: &Outcome,
) -> Result<(), String> {
    let nodes: BTreeMap<&NodeName, &NodeInput> =
        snapshot.nodes.iter().map(|n| (&n.spec.name, n)).collect();
    let jobs: BTreeMap<JobId, &PendingJob> = pending.iter().map(|j| (j.id, j)).collect();
    let preempted: BTreeSet<JobId> = outcome.preemptions.iter().map(|p| p.victim).collect();
    // Usage per node: running jobs that stay, plus starts.
    let mut gpu: BTreeMap<(&NodeName, u32), u32> = BTreeMap::new();
    let mut cpu: BTreeMap<&NodeName, u64> = BTreeMap::new();
    let mut memory: BTreeMap<&NodeName, u64> = BTreeMap::new();
    let mut add = |allocation: &'_ Allocation, owner: JobId| -> Result<(), String> {
        let node = nodes
            .get(&allocation.node)
            .ok_or_else(|| format!("job {owner}: unknown node {}", allocation.node))?;
        for &(index, milli) in &allocation.gpus {
            if index as usize >= node.spec.gpus.len() {
                return Err(format!(
                    "job {owner}: GPU {index} not on {}",
                    allocation.node
                ));
            }
            let used = gpu.entry((&node.spec.name, index)).or_default();
            *used += u32::from(milli);
            if *used > 1000 {
                return Err(format!(
                    "GPU {index} of {} over-committed ({used} thousandths)",
                    allocation.node
                ));
            }
        }
        let c = cpu.entry(&node.spec.name).or_default();
        *c += allocation.cpu.0;
        if *c > node.spec.cpu.0 {
            return Err(format!("CPU of {} exceeded", allocation.node));
        }
        let m = memory.entry(&node.spec.name).or_default();
        *m += allocation.memory.0;
        if *m > node.spec.memory.0 {
            return Err(format!("memory of {} exceeded", allocation.node));
        }
        Ok(())
    };
    for job in &snapshot.running {
        if preempted.contains(&job.id) {
            continue;
        }
        for allocation in &job.tasks {
            add(allocation, job.id)?;
        }
    }
    let mut started = BTreeSet::new();
    for start in &outcome.started {
        let job = jobs
            .get(&start.job)
            .ok_or_else(|| format!("started unknown job {}", start.job))?;
        if !started.insert(start.job) {
            return Err(format!("job {} started twice", start.job));
        }
        if start.tasks.len() != job.tasks as usize {
            return Err(format!(
                "gang {} got {} of {} tasks",
                job.id,
                start.tasks.len(),
                job.tasks
            ));
        }
        let distinct: BTreeSet<&NodeName> = start.tasks.iter().map(|t| &t.node).collect();
        if distinct.len() != start.tasks.len() {
            return Err(format!("job {}: two tasks on one node", job.id));
        }
        let mut racks = BTreeSet::new();
        for task in &start.tasks {
            add(task, job.id)?;
            let node = nodes[&task.node];
            if !node.healthy || node.spec.gpus.is_empty() && job.request.gpus.gpu_count() > 0 {
                return Err(format!("job {} on unusable node {}", job.id, task.node));
            }
            if node.cordoned {
                return Err(format!("job {} on cordoned node {}", job.id, task.node));
            }
            if let Some(pool) = &job.request.pool
                && &node.spec.pool != pool
            {
                return Err(format!("job {} outside pool {pool}", job.id));
            }
            if !job.request.gpu_models.is_empty()
                && job.request.gpus.gpu_count() > 0
                && !node
                    .spec
                    .gpus
                    .first()
                    .is_some_and(|gpu| job.request.gpu_models.contains(&gpu.model))
            {
                return Err(format!("job {} on a GPU model it did not ask for", job.id));
            }
            let granted: u32 = task.gpus.iter().map(|&(_, m)| u32::from(m)).sum();
            if granted != job.request.gpus.total().0 {
                return Err(format!("job {} got {granted} thousandths per task", job.id));
            }
            for &(index, _) in &task.gpus {
                if node.unhealthy_gpus.contains(&index) {
                    return Err(format!("job {} on unhealthy GPU {index}", job.id));
                }
            }
            racks.insert(&node.spec.rack);
        }
        if job.same_rack == Some(TopologyStrength::Required) && racks.len() > 1 {
            return Err(format!("job {} spans racks against its constraint", job.id));
        }
    }
    for job in pending {
        if !started.contains(&job.id) && !outcome.pending.contains_key(&job.id) {
            return Err(format!("job {} neither started nor given a reason", job.id));
        }
    }
    Ok(())
}
