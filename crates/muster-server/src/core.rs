//! The shell's shared state: the control plane behind a lock, the writer
//! that makes its changes durable, and the signals that wake the scheduler,
//! the agents' long polls and the log followers.
//!
//! Every change goes the same way: lock, feed the control plane an input
//! (with the time read here), turn its [`Output`]s into store records and
//! queue them while still locked (so writes keep the order of the changes),
//! bump the desired version of each node whose allocations changed, unlock,
//! then wait for the commit where the caller must not answer before it.

use crate::records::{AllocationRecord, JobRecord, NodeRecord};
use crate::store::{Batch, Counters, Loaded, StoreError};
use crate::writer::{Durable, Writer};
use muster_control::{AllocationId, ControlConfig, ControlError, ControlPlane, Input, Output};
use muster_model::{JobId, NodeName, QueueSpec, Time};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::{Notify, watch};

/// The wall clock, in milliseconds since the Unix epoch: the only place the
/// server reads it.
pub fn now() -> Time {
    Time(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0),
    )
}

/// The control plane and what the shell keeps beside it.
#[derive(Debug)]
pub struct Core {
    pub control: ControlPlane,
    pub next_job: u64,
    /// Each node's bearer token.
    pub node_tokens: BTreeMap<NodeName, String>,
    /// Allocations of every attempt of each job, oldest first.
    pub job_allocations: BTreeMap<JobId, Vec<AllocationId>>,
    /// Per node, the version of its desired allocations.
    versions: BTreeMap<NodeName, watch::Sender<u64>>,
    version_counter: u64,
    /// Per node, when its last heartbeat arrived and the latest gaps
    /// between heartbeats (for operators and the heartbeat tests).
    heartbeats: BTreeMap<NodeName, HeartbeatGaps>,
}

/// How many gaps between heartbeats are kept per node.
pub const HEARTBEAT_GAPS_KEPT: usize = 32;

/// When a node's heartbeats arrived lately.
#[derive(Debug)]
struct HeartbeatGaps {
    last: std::time::Instant,
    /// Milliseconds between consecutive heartbeats, oldest first, at most
    /// [`HEARTBEAT_GAPS_KEPT`].
    gaps: std::collections::VecDeque<u64>,
}

impl Core {
    /// Rebuilds the state from what the store holds. Nodes get a fresh
    /// lease from `now`: their agents could not renew it while the server
    /// was down.
    pub fn restore(config: ControlConfig, loaded: Loaded, now: Time) -> Result<Core, StoreError> {
        let mut control = ControlPlane::new(config);
        let record = |error: crate::records::RecordError| StoreError::Record(error.to_string());
        let mut node_tokens = BTreeMap::new();
        for (node, token) in loaded.nodes {
            let mut node = node.into_node().map_err(record)?;
            node.last_heartbeat = now;
            node_tokens.insert(node.spec.name.clone(), token);
            control.nodes.insert(node.spec.name.clone(), node);
        }
        for queue in loaded.queues {
            let spec = QueueSpec::from(queue);
            control.queues.insert(spec.name.clone(), spec);
        }
        let mut next_job = loaded.counters.next_job.max(1);
        for job in loaded.jobs {
            let job = job.into_job().map_err(record)?;
            next_job = next_job.max(job.id.0 + 1);
            control.jobs.insert(job.id, job);
        }
        let mut job_allocations: BTreeMap<JobId, Vec<AllocationId>> = BTreeMap::new();
        control.next_allocation = loaded.counters.next_allocation.max(1);
        control.next_generation = loaded.counters.next_generation.max(1);
        for allocation in loaded.allocations {
            let allocation = allocation.into_allocation().map_err(record)?;
            control.next_allocation = control.next_allocation.max(allocation.id.0 + 1);
            control.next_generation = control.next_generation.max(allocation.generation + 1);
            job_allocations
                .entry(allocation.job)
                .or_default()
                .push(allocation.id);
            control.allocations.insert(allocation.id, allocation);
        }
        if let Err(problem) = control.check_invariants() {
            tracing::warn!(%problem, "the restored state breaks an invariant");
        }
        // Versions start from the clock, so an agent's version from before a
        // restart never matches a new one by chance.
        let version_counter = now.0;
        let versions = control
            .nodes
            .keys()
            .map(|name| (name.clone(), watch::channel(version_counter).0))
            .collect();
        Ok(Core {
            control,
            next_job,
            node_tokens,
            job_allocations,
            versions,
            version_counter,
            heartbeats: BTreeMap::new(),
        })
    }

    /// Notes that a heartbeat from `node` arrived at `at` (a monotonic
    /// clock: gaps must not jump with the wall clock).
    pub fn note_heartbeat(&mut self, node: &NodeName, at: std::time::Instant) {
        match self.heartbeats.get_mut(node) {
            Some(seen) => {
                let gap = at.saturating_duration_since(seen.last);
                seen.last = at;
                if seen.gaps.len() == HEARTBEAT_GAPS_KEPT {
                    seen.gaps.pop_front();
                }
                seen.gaps
                    .push_back(u64::try_from(gap.as_millis()).unwrap_or(u64::MAX));
            }
            None => {
                self.heartbeats.insert(
                    node.clone(),
                    HeartbeatGaps {
                        last: at,
                        gaps: std::collections::VecDeque::new(),
                    },
                );
            }
        }
    }

    /// The latest gaps between `node`'s heartbeats, in milliseconds,
    /// oldest first.
    pub fn heartbeat_gaps(&self, node: &NodeName) -> Vec<u64> {
        self.heartbeats
            .get(node)
            .map(|seen| seen.gaps.iter().copied().collect())
            .unwrap_or_default()
    }

    pub fn counters(&self) -> Counters {
        Counters {
            next_job: self.next_job,
            next_allocation: self.control.next_allocation,
            next_generation: self.control.next_generation,
        }
    }

    /// A receiver of `node`'s desired version (created on first use).
    pub fn watch_desired(&mut self, node: &NodeName) -> watch::Receiver<u64> {
        let counter = self.version_counter;
        self.versions
            .entry(node.clone())
            .or_insert_with(|| watch::channel(counter).0)
            .subscribe()
    }

    /// Records what changed since the next allocation id was
    /// `allocations_before`, and bumps the desired version of each node
    /// whose allocations changed.
    fn record(&mut self, allocations_before: u64, outputs: &[Output], batch: &mut Batch) {
        for id in allocations_before..self.control.next_allocation {
            if let Some(allocation) = self.control.allocations.get(&AllocationId(id)) {
                let list = self.job_allocations.entry(allocation.job).or_default();
                if !list.contains(&allocation.id) {
                    list.push(allocation.id);
                }
            }
        }
        for output in outputs {
            match output {
                Output::JobChanged(id) => {
                    let Some(job) = self.control.jobs.get(id) else {
                        continue;
                    };
                    match serde_json::to_string(&JobRecord::from(job)) {
                        Ok(text) => {
                            batch.jobs.insert(id.0, text);
                        }
                        Err(error) => tracing::error!(job = id.0, %error, "cannot encode a job"),
                    }
                    for allocation_id in self.job_allocations.get(id).into_iter().flatten() {
                        let Some(allocation) = self.control.allocations.get(allocation_id) else {
                            continue;
                        };
                        if let Ok(text) = serde_json::to_string(&AllocationRecord::from(allocation))
                        {
                            batch.allocations.insert(allocation_id.0, (id.0, text));
                        }
                    }
                }
                Output::NodeChanged(name) => {
                    let Some(node) = self.control.nodes.get(name) else {
                        continue;
                    };
                    let token = self.node_tokens.get(name).cloned().unwrap_or_default();
                    if let Ok(text) = serde_json::to_string(&NodeRecord::from(node)) {
                        batch.nodes.insert(name.0.clone(), (text, token));
                    }
                }
                Output::DesiredChanged(name) => {
                    self.version_counter += 1;
                    let version = self.version_counter;
                    match self.versions.get(name) {
                        Some(sender) => {
                            sender.send_replace(version);
                        }
                        None => {
                            self.versions
                                .insert(name.clone(), watch::channel(version).0);
                        }
                    }
                }
            }
        }
        if !batch.jobs.is_empty() || !batch.allocations.is_empty() {
            batch.counters = Some(self.counters());
        }
    }
}

/// Settings of the shell the handlers need.
#[derive(Debug, Clone)]
pub struct Settings {
    pub data_dir: PathBuf,
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
}

/// What every task and handler shares.
#[derive(Debug)]
pub struct Shared {
    pub settings: Settings,
    core: Mutex<Core>,
    pub writer: Writer,
    /// Wakes the scheduling loop (a submission, an exit, a registration).
    pub wake_scheduler: Notify,
    /// Bumped on every job change and log append (wakes log followers).
    pub changes: watch::Sender<u64>,
    pub admin_token: String,
    pub join_token: String,
    /// Task logs, bounded per task.
    pub logs: std::sync::Arc<crate::logstore::LogStore>,
    /// Becomes true when the server shuts down (ends long polls).
    pub shutdown: watch::Receiver<bool>,
}

impl Shared {
    pub fn new(
        settings: Settings,
        core: Core,
        writer: Writer,
        admin_token: String,
        join_token: String,
        logs: crate::logstore::LogStore,
        shutdown: watch::Receiver<bool>,
    ) -> Shared {
        Shared {
            settings,
            core: Mutex::new(core),
            writer,
            wake_scheduler: Notify::new(),
            changes: watch::channel(0).0,
            admin_token,
            join_token,
            logs: std::sync::Arc::new(logs),
            shutdown,
        }
    }

    /// The state, locked. Never held across an `.await`.
    pub fn lock(&self) -> MutexGuard<'_, Core> {
        self.core
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Feeds one input to the control plane and queues what changed, with
    /// `extra` records in the same commit.
    pub fn apply(
        &self,
        input: Input,
        extra: Batch,
    ) -> Result<(Vec<Output>, Durable), ControlError> {
        let (outputs, durable, ()) = self.apply_with(|_| (input, ()), extra)?;
        Ok((outputs, durable))
    }

    /// As [`Shared::apply`], with the input made under the same lock (to
    /// assign a job id or issue a node token, say).
    pub fn apply_with<R>(
        &self,
        make: impl FnOnce(&mut Core) -> (Input, R),
        extra: Batch,
    ) -> Result<(Vec<Output>, Durable, R), ControlError> {
        let (outputs, durable, made) = {
            let mut core = self.lock();
            let allocations_before = core.control.next_allocation;
            let (input, made) = make(&mut core);
            let outputs = core.control.handle(now(), input)?;
            let mut batch = extra;
            core.record(allocations_before, &outputs, &mut batch);
            (outputs, self.writer.queue(batch), made)
        };
        self.after(&outputs, true);
        Ok((outputs, durable, made))
    }

    /// Applies a scheduling cycle's outcome and queues what changed.
    pub fn apply_outcome(&self, outcome: &muster_sched::Outcome) {
        let outputs = {
            let mut core = self.lock();
            let allocations_before = core.control.next_allocation;
            let outputs = core.control.apply_outcome(now(), outcome);
            let mut batch = Batch::default();
            core.record(allocations_before, &outputs, &mut batch);
            self.writer.queue_quietly(batch);
            outputs
        };
        self.after(&outputs, false);
    }

    /// Wakes who must know about `outputs`.
    fn after(&self, outputs: &[Output], wake_scheduler: bool) {
        if outputs.is_empty() {
            return;
        }
        if outputs.iter().any(|o| matches!(o, Output::JobChanged(_))) {
            self.changes.send_modify(|version| *version += 1);
        }
        if wake_scheduler {
            self.wake_scheduler.notify_one();
        }
    }
}
