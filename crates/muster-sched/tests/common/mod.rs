//! Checks shared by the scenario and property tests for clusters whose nodes
//! may mix GPU models (`muster_testkit::check_outcome` takes a node's first
//! GPU's model as the node's).

use muster_model::{GpuModel, JobId, NodeName, TopologyStrength};
use muster_sched::{Allocation, NodeInput, Outcome, PendingJob, Snapshot};
use muster_testkit::MakeNode;
use std::collections::{BTreeMap, BTreeSet};

/// A node with one GPU per entry of `models`, GPU `i` of model `models[i]`.
#[allow(dead_code)]
pub fn mixed_node(name: &str, models: &[&str]) -> NodeInput {
    let mut node = MakeNode::new(name).gpus(models.len() as u32, "X").build();
    for (gpu, model) in node.spec.gpus.iter_mut().zip(models) {
        gpu.model = GpuModel::new(model);
    }
    node
}

/// Every invariant of an outcome on real nodes: each GPU, and each node's
/// CPU and memory, hold at most their capacity (running jobs that stay plus
/// starts); GPU indices exist; a task's GPUs are healthy and of a model the
/// job accepts; a gang has one task per real node, in one rack if required;
/// preemption victims were running; every pending job started or has a
/// reason; no start lands on an excluded node.
pub fn check_real_nodes(
    snapshot: &Snapshot,
    pending: &[PendingJob],
    outcome: &Outcome,
) -> Result<(), String> {
    // Names whose first node the engine left out (a later duplicate is left
    // out while the first is kept).
    let excluded: BTreeSet<&NodeName> = outcome
        .excluded_nodes
        .iter()
        .filter(|(_, why)| !why.contains("appears more than once"))
        .map(|(n, _)| n)
        .collect();
    // The first node of each name, as the engine keeps it.
    let mut nodes: BTreeMap<&NodeName, &NodeInput> = BTreeMap::new();
    for node in &snapshot.nodes {
        nodes.entry(&node.spec.name).or_insert(node);
    }
    let running: BTreeSet<JobId> = snapshot.running.iter().map(|r| r.id).collect();
    let preempted: BTreeSet<JobId> = outcome.preemptions.iter().map(|p| p.victim).collect();
    if let Some(victim) = preempted.iter().find(|v| !running.contains(v)) {
        return Err(format!("preempted {victim}, which was not running"));
    }
    let mut gpu: BTreeMap<(&NodeName, u32), u32> = BTreeMap::new();
    let mut cpu: BTreeMap<&NodeName, u64> = BTreeMap::new();
    let mut memory: BTreeMap<&NodeName, u64> = BTreeMap::new();
    let mut add = |allocation: &Allocation, owner: JobId, new: bool| -> Result<(), String> {
        let Some(node) = nodes.get(&allocation.node) else {
            return Err(format!("job {owner}: unknown node {}", allocation.node));
        };
        if new && excluded.contains(&allocation.node) {
            return Err(format!(
                "job {owner} started on excluded {}",
                allocation.node
            ));
        }
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
                    "GPU {index} of {} over-committed ({used})",
                    allocation.node
                ));
            }
        }
        let c = cpu.entry(&node.spec.name).or_default();
        *c += allocation.cpu.0;
        if *c > node.spec.cpu.0 {
            return Err(format!("CPU of {} exceeded: {c}", allocation.node));
        }
        let m = memory.entry(&node.spec.name).or_default();
        *m += allocation.memory.0;
        if *m > node.spec.memory.0 {
            return Err(format!("memory of {} exceeded: {m}", allocation.node));
        }
        Ok(())
    };
    for job in &snapshot.running {
        if !preempted.contains(&job.id) {
            for allocation in &job.tasks {
                add(allocation, job.id, false)?;
            }
        }
    }
    let jobs: BTreeMap<JobId, &PendingJob> = pending.iter().map(|j| (j.id, j)).collect();
    let mut started = BTreeSet::new();
    for start in &outcome.started {
        let job = jobs
            .get(&start.job)
            .ok_or_else(|| format!("started unknown job {}", start.job))?;
        if !started.insert(start.job) {
            return Err(format!("job {} started twice", start.job));
        }
        if start.tasks.len() != job.tasks as usize {
            return Err(format!("gang {} got {} tasks", job.id, start.tasks.len()));
        }
        let distinct: BTreeSet<&NodeName> = start.tasks.iter().map(|t| &t.node).collect();
        if distinct.len() != start.tasks.len() {
            return Err(format!("job {}: two tasks on one node", job.id));
        }
        let mut racks = BTreeSet::new();
        for task in &start.tasks {
            add(task, job.id, true)?;
            let node = nodes[&task.node];
            if node.cordoned || !node.healthy {
                return Err(format!("job {} on unusable node {}", job.id, task.node));
            }
            let granted: u32 = task.gpus.iter().map(|&(_, m)| u32::from(m)).sum();
            if granted != job.request.gpus.total().0 {
                return Err(format!("job {} got {granted} thousandths", job.id));
            }
            for &(index, _) in &task.gpus {
                let model = &node.spec.gpus[index as usize].model;
                if !job.request.gpu_models.is_empty() && !job.request.gpu_models.contains(model) {
                    return Err(format!("job {} on a {model} it did not ask for", job.id));
                }
                if node.unhealthy_gpus.contains(&index) {
                    return Err(format!("job {} on unhealthy GPU {index}", job.id));
                }
            }
            let models: BTreeSet<&GpuModel> = task
                .gpus
                .iter()
                .map(|&(index, _)| &node.spec.gpus[index as usize].model)
                .collect();
            if models.len() > 1 {
                return Err(format!("job {}: one task on two GPU models", job.id));
            }
            racks.insert(&node.spec.rack);
        }
        if job.same_rack == Some(TopologyStrength::Required) && racks.len() > 1 {
            return Err(format!("job {} spans racks", job.id));
        }
    }
    for job in pending {
        if !started.contains(&job.id) && !outcome.pending.contains_key(&job.id) {
            return Err(format!("job {} neither started nor given a reason", job.id));
        }
    }
    Ok(())
}
