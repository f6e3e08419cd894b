//! The control plane's durable form, and the rules for what to write and
//! how to read it back. Both the server (through its store) and the fault
//! simulation (through its in-memory copy) use these rules, so the
//! simulation checks the server's own persistence.
//!
//! - After each input, [`ControlPlane::changed_records`] names what its
//!   [`Output`]s changed: each changed job with every allocation of every
//!   attempt, each changed node, each removed node, and the counters
//!   whenever a job changed (allocation ids and generations are issued
//!   with job changes) or a node registered (epochs).
//! - [`ControlPlane::restore`] rebuilds the state from what the store
//!   holds, rebuilds its indexes, gives every node a fresh lease from
//!   `now` (its agent could not renew it while the server was down), and
//!   refuses a state that breaks an invariant, with the reason.

use crate::{Allocation, ControlConfig, ControlPlane, Job, Node, Output};
use muster_model::{JobId, NodeName, QueueSpec, Time};
use std::collections::{BTreeMap, BTreeSet};

/// The counters that hand out ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub next_allocation: u64,
    pub next_generation: u64,
    pub next_epoch: u64,
}

/// Everything that survives a restart.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Records {
    pub jobs: Vec<Job>,
    /// Allocations of the jobs above (every attempt).
    pub allocations: Vec<Allocation>,
    pub nodes: Vec<Node>,
    pub queues: Vec<QueueSpec>,
    /// Pools with a stack policy of their own.
    pub pool_policies: Vec<(muster_model::PoolName, crate::PoolPolicy)>,
    pub counters: Counters,
}

/// What one input changed, to write in one commit.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChangedRecords<'a> {
    pub jobs: Vec<&'a Job>,
    pub allocations: Vec<&'a Allocation>,
    pub nodes: Vec<&'a Node>,
    pub removed_nodes: Vec<NodeName>,
    /// Set when ids, generations or epochs were issued.
    pub counters: Option<Counters>,
}

impl ChangedRecords<'_> {
    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
            && self.allocations.is_empty()
            && self.nodes.is_empty()
            && self.removed_nodes.is_empty()
            && self.counters.is_none()
    }
}

/// Why a stored state cannot be restored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreError(pub String);

impl std::fmt::Display for RestoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the stored state is inconsistent: {}", self.0)
    }
}

impl std::error::Error for RestoreError {}

impl ControlPlane {
    /// The whole durable state (what a store holds after writing every
    /// [`ControlPlane::changed_records`] so far, less retired jobs).
    pub fn records(&self) -> Records {
        Records {
            jobs: self.jobs.values().cloned().collect(),
            allocations: self.allocations.values().cloned().collect(),
            nodes: self.nodes.values().cloned().collect(),
            queues: self.queues.values().cloned().collect(),
            pool_policies: self
                .pool_policies
                .iter()
                .map(|(pool, policy)| (pool.clone(), policy.clone()))
                .collect(),
            counters: self.counters(),
        }
    }

    /// What `outputs` (of one input) changed, to write.
    pub fn changed_records(&self, outputs: &[Output]) -> ChangedRecords<'_> {
        let mut changes = ChangedRecords::default();
        let mut seen_jobs = BTreeSet::new();
        let mut issued = false;
        for output in outputs {
            match output {
                Output::JobChanged(id) => {
                    if !seen_jobs.insert(*id) {
                        continue;
                    }
                    let Some(job) = self.jobs.get(id) else {
                        continue;
                    };
                    changes.jobs.push(job);
                    changes.allocations.extend(self.job_allocations(*id));
                    issued = true;
                }
                Output::NodeChanged(name) => {
                    if let Some(node) = self.nodes.get(name)
                        && !changes.nodes.iter().any(|n| n.spec.name == *name)
                    {
                        changes.nodes.push(node);
                        issued = true;
                    }
                }
                Output::NodeRemoved(name) => changes.removed_nodes.push(name.clone()),
                Output::DesiredChanged(_) | Output::JobRetired(_) | Output::ReasonChanged(_) => {}
            }
        }
        if issued {
            changes.counters = Some(self.counters());
        }
        changes
    }

    /// Rebuilds the state from `records`, checking every invariant. Nodes
    /// get a fresh lease from `now`. Finished jobs past the retention are
    /// dropped from the hot state at the first tick.
    pub fn restore(
        config: ControlConfig,
        records: Records,
        now: Time,
    ) -> Result<ControlPlane, RestoreError> {
        let mut control = ControlPlane::new(config);
        let Records {
            jobs,
            allocations,
            nodes,
            queues,
            pool_policies,
            counters,
        } = records;
        control.pool_policies = pool_policies.into_iter().collect();
        for mut node in nodes {
            node.last_heartbeat = now;
            control.next_epoch = control.next_epoch.max(node.epoch + 1);
            let name = node.spec.name.clone();
            if control.nodes.insert(name.clone(), node).is_some() {
                return Err(RestoreError(format!("node {name} is stored twice")));
            }
        }
        for queue in queues {
            control.queues.insert(queue.name.clone(), queue);
        }
        for job in jobs {
            let id = job.id;
            if job.state.is_final() {
                control
                    .finished
                    .insert((job.finished.unwrap_or(Time(0)), id));
                crate::state::learn_runtime(&mut control.runtimes, &job);
            }
            if matches!(
                job.state,
                crate::JobState::Running | crate::JobState::Stopping
            ) && let Some(due) = crate::state::deadline_of(&job)
            {
                control.deadlines.insert((due, id));
            }
            if control.jobs.insert(id, job).is_some() {
                return Err(RestoreError(format!("job {id} is stored twice")));
            }
        }
        control.next_allocation = counters.next_allocation.max(1);
        control.next_generation = counters.next_generation.max(1);
        control.next_epoch = control.next_epoch.max(counters.next_epoch).max(1);
        let mut allocations = allocations;
        allocations.sort_by_key(|a| a.id);
        for allocation in allocations {
            let id = allocation.id;
            control.next_allocation = control.next_allocation.max(id.0 + 1);
            control.next_generation = control.next_generation.max(allocation.generation + 1);
            if !control.jobs.contains_key(&allocation.job) {
                // An allocation of a job that is no longer hot.
                continue;
            }
            if allocation.state.holds_resources() {
                control
                    .live_by_node
                    .entry(allocation.node.clone())
                    .or_default()
                    .insert(id);
            }
            control.by_job.entry(allocation.job).or_default().push(id);
            if control.allocations.insert(id, allocation).is_some() {
                return Err(RestoreError(format!("allocation {id} is stored twice")));
            }
        }
        control.waiting = control.waiting_from_jobs();
        control.admission_counts = crate::AdmissionCounts::of(&control.jobs);
        control.node_shapes = control.node_shapes_from_nodes();
        // Drift is derived from the stacks, not stored.
        let pools: std::collections::BTreeSet<_> = control
            .nodes
            .values()
            .map(|n| n.spec.pool.clone())
            .collect();
        for pool in pools {
            let names: Vec<_> = control
                .nodes
                .values()
                .filter(|n| n.spec.pool == pool)
                .map(|n| n.spec.name.clone())
                .collect();
            if let Some(first) = names.first() {
                control.apply_stack_policy(first, &mut Vec::new());
            }
        }
        control.check_invariants().map_err(RestoreError)?;
        Ok(control)
    }

    /// The ids of hot jobs (for a shell that must tell hot from retired).
    pub fn is_hot(&self, id: JobId) -> bool {
        self.jobs.contains_key(&id)
    }
}

/// A store kept in memory by the rules a real one is written and read by:
/// each input's [`ChangedRecords`] written over the earlier ones (removed
/// nodes deleted, retired jobs kept), and [`MemoryStore::load`] reading
/// back what a restarting server loads. The fault simulation and the
/// property tests use it; the server's SQLite store follows the same rules.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct MemoryStore {
    pub jobs: BTreeMap<JobId, Job>,
    pub allocations: BTreeMap<crate::AllocationId, Allocation>,
    pub nodes: BTreeMap<NodeName, Node>,
    pub counters: Counters,
}

impl MemoryStore {
    /// Writes what one input changed.
    pub fn write(&mut self, changes: ChangedRecords<'_>) {
        for job in changes.jobs {
            self.jobs.insert(job.id, job.clone());
        }
        for allocation in changes.allocations {
            self.allocations.insert(allocation.id, allocation.clone());
        }
        for node in changes.nodes {
            self.nodes.insert(node.spec.name.clone(), node.clone());
        }
        for name in changes.removed_nodes {
            self.nodes.remove(&name);
        }
        if let Some(counters) = changes.counters {
            self.counters = counters;
        }
    }

    /// What a server restarting at `now` loads: every job not finished,
    /// finished ones within `retention_ms`, their allocations, the nodes
    /// and the counters.
    pub fn load(&self, now: Time, retention_ms: u64) -> Records {
        let hot = |job: &Job| {
            !job.state.is_final()
                || job
                    .finished
                    .is_some_and(|at| now.millis_since(at) < retention_ms)
        };
        let jobs: Vec<Job> = self.jobs.values().filter(|job| hot(job)).cloned().collect();
        let ids: BTreeSet<JobId> = jobs.iter().map(|job| job.id).collect();
        Records {
            jobs,
            allocations: self
                .allocations
                .values()
                .filter(|allocation| ids.contains(&allocation.job))
                .cloned()
                .collect(),
            nodes: self.nodes.values().cloned().collect(),
            queues: Vec::new(),
            pool_policies: Vec::new(),
            counters: self.counters,
        }
    }
}
