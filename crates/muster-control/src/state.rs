use crate::AdmissionCounts;
use crate::records::Counters;
use muster_model::{
    CpuMilli, JobId, JobSpec, MemoryMib, NodeName, NodeSpec, QueueName, QueueSpec, Time,
};
use muster_sched::{
    Allocation as SchedAllocation, NodeInput, Outcome, PendingJob, RunningJob, Snapshot,
    TaskRequest,
};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// What a start needs to know of each node that can take work now: free
/// GPU thousandths, CPU and memory, which GPUs went bad, and its address.
/// Hashed, not ordered: a cycle looks a node up once per task it starts
/// (a search of an ordered map compares names on the heap at every step).
type FreeResources = muster_model::hashing::LookupMap<NodeName, FreeNode>;

struct FreeNode {
    gpus: Vec<u32>,
    cpu: u64,
    memory: u64,
    unhealthy: Vec<u32>,
    address: String,
}

/// An allocation's id, unique for the life of the cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct AllocationId(pub u64);

impl fmt::Display for AllocationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum JobState {
    Pending,
    Running,
    /// Its tasks are being stopped (cancel, preemption, a failed task, a
    /// lost node); what follows depends on [`StopCause`].
    Stopping,
    Succeeded,
    Failed,
    Cancelled,
    /// It ran into its `max_runtime` and was stopped.
    TimedOut,
    /// Its GPUs stayed idle for its `idle_timeout` and it was stopped.
    IdleStopped,
}

impl JobState {
    pub fn name(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Stopping => "stopping",
            JobState::Succeeded => "succeeded",
            JobState::Failed => "failed",
            JobState::Cancelled => "cancelled",
            JobState::TimedOut => "timed_out",
            JobState::IdleStopped => "idle_stopped",
        }
    }

    pub fn parse(text: &str) -> Option<JobState> {
        [
            JobState::Pending,
            JobState::Running,
            JobState::Stopping,
            JobState::Succeeded,
            JobState::Failed,
            JobState::Cancelled,
            JobState::TimedOut,
            JobState::IdleStopped,
        ]
        .into_iter()
        .find(|state| state.name() == text)
    }

    pub fn is_final(self) -> bool {
        matches!(
            self,
            JobState::Succeeded
                | JobState::Failed
                | JobState::Cancelled
                | JobState::TimedOut
                | JobState::IdleStopped
        )
    }
}

/// Why a job's tasks are being stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StopCause {
    Cancel,
    Preempted,
    /// A task exited non-zero; the others are stopped.
    TaskFailed,
    NodeLost,
    /// It reached its `max_runtime`.
    TimeLimit,
    /// Its GPUs were idle for its `idle_timeout`.
    Idle,
}

/// An allocation's state as the control plane knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocationState {
    /// Issued to the node; not yet reported running.
    Assigned,
    Running,
    /// The node has been told to stop it.
    Stopping,
    Exited {
        code: Option<i32>,
    },
    /// Its node was lost; it may still run there until fenced.
    Lost,
}

impl AllocationState {
    /// Whether it holds its node's resources.
    pub fn holds_resources(self) -> bool {
        matches!(
            self,
            AllocationState::Assigned | AllocationState::Running | AllocationState::Stopping
        )
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub id: AllocationId,
    pub job: JobId,
    pub rank: u32,
    pub node: NodeName,
    /// (GPU index, thousandths)
    pub gpus: Vec<(u32, u16)>,
    pub cpu: CpuMilli,
    pub memory: MemoryMib,
    pub generation: u64,
    pub state: AllocationState,
    /// The environment the task sees (the contract of DESIGN.md §5 plus the
    /// spec's own variables).
    pub env: BTreeMap<String, String>,
    pub assigned: Time,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    pub user: String,
    pub submitted: Time,
    pub state: JobState,
    pub stop_cause: Option<StopCause>,
    /// Attempts started (the first included).
    pub attempts: u32,
    pub exit_code: Option<i32>,
    /// The first rank of the current attempt that failed on its own (not
    /// stopped by muster), and how: its exit code (`None`: a signal). A
    /// gang's outcome is this rank's, not that of the ranks stopped after.
    pub first_failure: Option<(u32, Option<i32>)>,
    pub started: Option<Time>,
    pub finished: Option<Time>,
    /// Allocations of the current attempt.
    pub allocations: Vec<AllocationId>,
    pub history: Vec<(Time, String)>,
    /// From the last scheduling cycle, in words; and the place in line.
    pub pending_reason: Option<String>,
    pub queue_position: Option<u32>,
    /// The array it is an element of, if any.
    pub array: Option<muster_model::ArrayElement>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeState {
    Ready,
    /// Its lease expired.
    Lost,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Software {
    pub backend: String,
    pub driver: Option<String>,
    pub cuda: Option<String>,
    /// The rest of the stack: component to version (`vbios`, `kernel`,
    /// `nccl`, `container_runtime`, ...).
    pub stack: BTreeMap<String, String>,
}

impl Software {
    /// Whether the node's agent reached a container engine (the
    /// [`muster_model::CONTAINER_ENGINE`] entry of its stack).
    pub fn runs_containers(&self) -> bool {
        self.stack.contains_key(muster_model::CONTAINER_ENGINE)
    }

    /// Every component with its version, the driver and CUDA included (for
    /// [`crate::fleet`]).
    pub fn components(&self) -> BTreeMap<&str, &str> {
        let mut components: BTreeMap<&str, &str> = self
            .stack
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        if let Some(driver) = &self.driver {
            components.insert("driver", driver);
        }
        if let Some(cuda) = &self.cuda {
            components.insert("cuda", cuda);
        }
        components
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Node {
    pub spec: NodeSpec,
    /// Where its tasks can be reached (the master address of a gang).
    pub address: String,
    /// The agent process instance; a restart registers a new epoch.
    pub epoch: u64,
    pub state: NodeState,
    pub cordoned: bool,
    pub draining: bool,
    pub last_heartbeat: Time,
    pub software: Software,
    /// Under [`StackPolicy::Majority`]: how its stack differs from its
    /// pool's (`stack drift: driver 550.54 vs 550.90`); it takes no new work
    /// until it registers with the pool's stack. Recomputed, not persisted.
    pub drift: Option<String>,
    /// GPU indices out of service (reported by the agent's health checks).
    pub unhealthy_gpus: Vec<u32>,
    /// Joined under [`ControlConfig::approve_nodes`] and not yet approved
    /// (`muster nodes approve`): it heartbeats, is shown, and takes no work
    /// (so no secret reaches it).
    pub pending_approval: bool,
}

/// A task as the node must run (or stop) it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredTask {
    pub allocation: AllocationId,
    pub generation: u64,
    pub job: JobId,
    pub rank: u32,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<String>,
    pub gpus: Vec<u32>,
    pub stop_signal: muster_model::Signal,
    pub grace_period_ms: u64,
    pub stop: bool,
    /// The job's user (the task runs as this user where it exists).
    pub user: String,
    /// The job's memory per node, the task's memory limit (0: none asked).
    pub memory_mib: u64,
    /// The container image the task runs in (`None`: on the node itself).
    pub image: Option<String>,
    /// The job's CPUs per node, in thousandths (a container's CPU limit).
    pub cpu_milli: u64,
    /// Host paths the container sees: (source, target, read only).
    pub mounts: Vec<(String, String, bool)>,
}

/// What an agent reports about one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    pub allocation: AllocationId,
    pub generation: u64,
    pub exited: Option<Option<i32>>,
    /// The node stopped it because it could not renew its lease, or it is
    /// gone with no record of how it ended: the task did not fail, its node
    /// did (the job is re-queued per its retry policy for node failures).
    pub fenced: bool,
    /// The kernel killed it (or a process of it) at its memory limit.
    pub memory_limit: bool,
}

// Inputs are handled one at a time as they come, never held in bulk: the
// size of the largest (a submission) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    Submit {
        id: JobId,
        spec: JobSpec,
        user: String,
    },
    Cancel {
        job: JobId,
    },
    /// The shell found the running job's GPUs idle for its `idle_timeout`
    /// (from telemetry): it is stopped and ends `idle_stopped`. Ignored for
    /// a job that is not running or has no `idle_timeout`.
    StopIdle {
        job: JobId,
    },
    /// Cancels every unfinished element of array job `array`.
    CancelArray {
        array: JobId,
    },
    /// A node's agent registers: the control plane issues the node's next
    /// epoch (cluster-wide, only moving forward), read back with
    /// [`ControlPlane::node`]. The spec must pass [`NodeSpec::problems`].
    Register {
        spec: NodeSpec,
        address: String,
        software: Software,
    },
    Heartbeat {
        node: NodeName,
        epoch: u64,
        /// Strictly increasing per agent epoch; a heartbeat not newer than
        /// the last one applied for the epoch (a duplicate, or one overtaken
        /// by a later one) renews the lease but reports nothing. 0: an agent
        /// that does not number its heartbeats (always applied).
        sequence: u64,
        observed: Vec<Observed>,
        /// The GPU indices the agent's health checks find out of service
        /// (`None`: not reported); applied, as [`Input::GpuHealth`], before
        /// the tasks, and only from a newer heartbeat.
        unhealthy: Option<Vec<u32>>,
    },
    /// An agent's view of its GPUs' health: the indices out of service.
    GpuHealth {
        node: NodeName,
        epoch: u64,
        unhealthy: Vec<u32>,
    },
    /// Time passed: expire leases.
    Tick,
    Cordon {
        node: NodeName,
        cordoned: bool,
    },
    Drain {
        node: NodeName,
    },
    /// An operator admits a node that waits for approval.
    Approve {
        node: NodeName,
    },
    /// Forgets a node. Refused while it holds work unless `force`, which
    /// re-queues that work (its tasks are lost: the agent, if still there,
    /// is refused and stops them).
    RemoveNode {
        node: NodeName,
        force: bool,
    },
    SetQueue(QueueSpec),
    /// Sets (or, with `None`, removes) a pool's stack policy; the pool's
    /// nodes' drift follows at once.
    SetPoolPolicy {
        pool: muster_model::PoolName,
        policy: Option<PoolPolicy>,
    },
    /// The queues whose monthly budget is spent under a hard limit (the
    /// shell sums their cost): their pending jobs wait, `budget exhausted`,
    /// until a later input leaves them out. Replaces the previous set.
    HoldBudgets {
        queues: BTreeSet<QueueName>,
    },
}

/// What changed, for the shell to persist and to wake agents.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Output {
    JobChanged(JobId),
    /// Only the pending job's reason (the words a cycle found) changed: shown
    /// at once, not written to the store (a restarted server finds it again
    /// in its first cycle, as it does the place in line). Writing the first
    /// reason of every new job doubled the rows a burst of submissions
    /// wrote.
    ReasonChanged(JobId),
    NodeChanged(NodeName),
    /// The node's desired allocations changed.
    DesiredChanged(NodeName),
    /// The node is gone (its record and credential are to be deleted).
    NodeRemoved(NodeName),
    /// The finished job left the hot state (the retention passed); a store
    /// keeps it.
    JobRetired(JobId),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlError {
    JobNotFound(JobId),
    NodeNotFound(NodeName),
    Conflict(String),
    /// The input is malformed (a node spec the cluster cannot take).
    Invalid(String),
}

impl fmt::Display for ControlError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ControlError::JobNotFound(id) => write!(f, "no job {id}; `muster ps` lists jobs"),
            ControlError::NodeNotFound(name) => {
                write!(f, "no node {name}; `muster nodes` lists nodes")
            }
            ControlError::Conflict(message) | ControlError::Invalid(message) => {
                f.write_str(message)
            }
        }
    }
}

impl std::error::Error for ControlError {}

/// Half-life of queues' decayed GPU usage (fair share): one week.
pub const USAGE_HALF_LIFE_MS: u64 = 7 * 24 * 3600 * 1000;

/// How many `MUSTER_MASTER_PORT`s jobs take in turn from
/// [`ControlConfig::master_port_base`] on.
pub const MASTER_PORTS: u16 = 20_000;

/// The default [`ControlConfig::master_port_base`] (PyTorch's customary
/// rendezvous port).
pub const DEFAULT_MASTER_PORT_BASE: u16 = 29_500;

/// The lowest [`ControlConfig::master_port_base`]: jobs' ports stay out of
/// the privileged ones.
pub const MIN_MASTER_PORT_BASE: u16 = 1024;

/// The highest [`ControlConfig::master_port_base`] whose ports all exist.
pub const MAX_MASTER_PORT_BASE: u16 = u16::MAX - MASTER_PORTS;

/// Why `base` cannot be a [`ControlConfig::master_port_base`], if it
/// cannot: outside [`MIN_MASTER_PORT_BASE`]..=[`MAX_MASTER_PORT_BASE`].
pub fn check_master_port_base(base: u16) -> Result<(), String> {
    if (MIN_MASTER_PORT_BASE..=MAX_MASTER_PORT_BASE).contains(&base) {
        Ok(())
    } else {
        Err(format!(
            "the master port base {base} is outside {MIN_MASTER_PORT_BASE}..={MAX_MASTER_PORT_BASE} \
             (its {MASTER_PORTS} ports must be unprivileged and exist); pick one inside"
        ))
    }
}

/// Job `job`'s `MUSTER_MASTER_PORT` when the range starts at `base`: `base`
/// plus the job's id modulo [`MASTER_PORTS`]. A `base` past
/// [`MAX_MASTER_PORT_BASE`] (refused where a configuration is read, see
/// [`check_master_port_base`]) counts as that, so the port always exists.
pub fn master_port(base: u16, job: JobId) -> u16 {
    base.min(MAX_MASTER_PORT_BASE) + (job.0 % u64::from(MASTER_PORTS)) as u16
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlConfig {
    /// A node whose last heartbeat is older than this is lost.
    pub lease_ms: u64,
    /// Base of the `MUSTER_MASTER_PORT` range.
    pub master_port_base: u16,
    /// How long a finished job stays in the hot state after it ended; the
    /// shell keeps it queryable from its store after that.
    pub retention_ms: u64,
    /// What a node whose software stack differs from its pool's gets.
    pub stack_policy: StackPolicy,
    /// Least-attained-service levels within a priority class: the
    /// engine's priority of a job is
    /// [`muster_sched::ServiceLevels::priority`] of its class and the GPU
    /// time its attempts have had.
    pub service_levels: muster_sched::ServiceLevels,
    /// New nodes (names the control plane does not know) wait for an
    /// operator's [`Input::Approve`] before they take work.
    pub approve_nodes: bool,
}

/// What happens to a node whose software stack (driver, CUDA, VBIOS,
/// kernel, ...) differs from its pool's most common one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StackPolicy {
    /// Shown (`muster fleet`, metrics), nothing more.
    #[default]
    Report,
    /// Also kept from new work, with the reason, until it registers with
    /// its pool's stack (pools of at least 3 nodes: with fewer, no version
    /// is a majority).
    Majority,
    /// Kept from new work unless it reports the versions a pool's policy
    /// requires ([`PoolPolicy::required`]; a component it does not report
    /// differs). Only as a pool's policy.
    Required,
}

impl StackPolicy {
    pub fn name(self) -> &'static str {
        match self {
            StackPolicy::Report => "report",
            StackPolicy::Majority => "majority",
            StackPolicy::Required => "required",
        }
    }

    pub fn parse(text: &str) -> Option<StackPolicy> {
        Some(match text {
            "report" => StackPolicy::Report,
            "majority" => StackPolicy::Majority,
            "required" => StackPolicy::Required,
            _ => return None,
        })
    }
}

/// A pool's own stack policy, over the server's default
/// ([`ControlConfig::stack_policy`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PoolPolicy {
    pub stack: StackPolicy,
    /// Under [`StackPolicy::Required`]: component (`driver`, `cuda`,
    /// `vbios`, `kernel`, `nccl`, ...) → the version every node must report.
    pub required: BTreeMap<String, String>,
    /// Host paths container jobs in the pool may mount (each path, and
    /// everything under it).
    pub mounts: Vec<String>,
    /// An inference pool keeps its nodes for services' replicas: other work
    /// runs there only if it may be preempted, and any replica preempts it.
    pub inference: bool,
}

impl PoolPolicy {
    /// Whether `path` is one of the allowed mounts or under one.
    pub fn allows_mount(&self, path: &str) -> bool {
        let path = path.trim_end_matches('/');
        self.mounts.iter().any(|allowed| {
            let allowed = allowed.trim_end_matches('/');
            allowed.is_empty()
                || path == allowed
                || path
                    .strip_prefix(allowed)
                    .is_some_and(|rest| rest.starts_with('/'))
        })
    }
}

/// The most nodes that wait for approval at once
/// ([`ControlConfig::approve_nodes`]).
pub const MAX_PENDING_APPROVAL: usize = 1_024;

/// The default retention of finished jobs in the hot state: one hour.
pub const DEFAULT_RETENTION_MS: u64 = 3_600_000;

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            lease_ms: 10_000,
            master_port_base: DEFAULT_MASTER_PORT_BASE,
            retention_ms: DEFAULT_RETENTION_MS,
            stack_policy: StackPolicy::Report,
            service_levels: muster_sched::ServiceLevels::default(),
            approve_nodes: false,
        }
    }
}

/// The control plane's state. Its fields are private: inputs go through
/// [`ControlPlane::handle`] and [`ControlPlane::apply_outcome`], reads
/// through the accessors, and the durable form through
/// [`ControlPlane::records`], [`ControlPlane::changed_records`] and
/// [`ControlPlane::restore`]. In debug builds every input is followed by
/// [`ControlPlane::check_invariants`].
#[derive(Debug, Clone, PartialEq)]
pub struct ControlPlane {
    pub(crate) config: ControlConfig,
    /// How many jobs each user and each queue has pending (array elements
    /// one each), kept with every change of a job's state: what submission
    /// limits are checked against.
    pub(crate) admission_counts: AdmissionCounts,
    /// The hot state: every job not finished, and finished ones for
    /// [`ControlConfig::retention_ms`] after they ended.
    pub(crate) jobs: BTreeMap<JobId, Job>,
    pub(crate) nodes: BTreeMap<NodeName, Node>,
    pub(crate) allocations: BTreeMap<AllocationId, Allocation>,
    pub(crate) queues: BTreeMap<QueueName, QueueSpec>,
    pub(crate) next_allocation: u64,
    pub(crate) next_generation: u64,
    /// The next epoch a registration gets (cluster-wide: an epoch is never
    /// issued twice, to any node).
    pub(crate) next_epoch: u64,
    /// Allocations holding resources, per node (heartbeats, drains and
    /// desired sets cost what the node runs, not the cluster's history).
    pub(crate) live_by_node: BTreeMap<NodeName, BTreeSet<AllocationId>>,
    /// Every attempt's allocations of each job in the hot state, oldest
    /// first.
    pub(crate) by_job: BTreeMap<JobId, Vec<AllocationId>>,
    /// Finished jobs by when they ended: the retirement order.
    pub(crate) finished: BTreeSet<(Time, JobId)>,
    /// Run times of each queue's jobs that succeeded, failed or timed out
    /// (fixed size per queue, fading; rebuilt at restart from the jobs
    /// kept): estimates for jobs whose spec gives none. At most
    /// [`MAX_RUNTIME_HISTORIES`] queues (any name may be submitted to).
    pub(crate) runtimes: BTreeMap<QueueName, muster_sched::RuntimeHistory>,
    /// The latest start forecast of each pending job ([`Self::set_forecasts`];
    /// in memory only, replaced whole).
    pub(crate) forecasts: BTreeMap<JobId, muster_sched::StartForecast>,
    /// GPU-seconds of the ended attempts of jobs not yet ended (in memory
    /// only: a restarted server counts from the attempt running then).
    pub(crate) attained: BTreeMap<JobId, f64>,
    /// The last cycle's reason for each pending job, as data: words are
    /// formatted only when it changes.
    pub(crate) last_reasons: BTreeMap<JobId, muster_sched::PendingReason>,
    /// Decayed GPU-seconds per queue, for fair share; advanced by ticks (not
    /// persisted: a restarted server starts its fair-share history anew).
    pub(crate) usage: muster_sched::UsageLedger,
    /// Per node, the newest heartbeat sequence applied in its current epoch
    /// (in memory only: a restarted server has no connection left from
    /// before, so no old request reaches it; a registration starts a new
    /// epoch, whose heartbeats are numbered anew).
    pub(crate) heartbeat_sequences: BTreeMap<NodeName, u64>,
    /// Running jobs a task of which hit its memory limit (their failure says
    /// so); emptied as each job settles.
    pub(crate) memory_limited: BTreeSet<JobId>,
    /// Nodes the last scheduling cycle left out, with why (memory only).
    pub(crate) excluded: BTreeMap<NodeName, String>,
    /// Pools with a stack policy of their own.
    pub(crate) pool_policies: BTreeMap<muster_model::PoolName, PoolPolicy>,
    /// Queues over a hard budget ([`Input::HoldBudgets`]; memory only: the
    /// shell recomputes it from its store).
    pub(crate) budget_held: BTreeSet<QueueName>,
    /// When each running job with a `max_runtime` reaches it (an entry may
    /// outlive its attempt: checked against the job when due).
    pub(crate) deadlines: BTreeSet<(Time, JobId)>,
    /// (dependency, dependent): a pending job waiting for a job of the hot
    /// state that has not ended, or for an array job an element of which
    /// has not (one entry per dependency as written, whatever the array's
    /// size). An entry leaves when the dependency ends (met: the dependent
    /// may start once nothing else holds it; not met: the dependent is
    /// cancelled) or the dependent leaves pending.
    pub(crate) waiting: BTreeSet<(JobId, JobId)>,
    /// Registered nodes by shape ([`NodeShape`]): the submit-time check
    /// ([`ControlPlane::never_fits`]) asks one node of each.
    pub(crate) node_shapes: BTreeMap<NodeShape, BTreeSet<NodeName>>,
}

/// The value for `id` from `entries`, an iterator in id order that is
/// advanced past every key before `id` (and past `id`, if found).
fn next_of<K: std::borrow::Borrow<JobId>, V, I: Iterator<Item = (K, V)>>(
    entries: &mut std::iter::Peekable<I>,
    id: &JobId,
) -> Option<V> {
    while entries.peek().is_some_and(|(key, _)| key.borrow() < id) {
        entries.next();
    }
    if entries.peek().is_some_and(|(key, _)| key.borrow() == id) {
        entries.next().map(|(_, value)| value)
    } else {
        None
    }
}

/// The `SLURM_*` variables a batch script reads, for rank `rank` of `job`
/// starting on `tasks` (one task per node: a rank is a node). Static ones
/// (`SLURM_SUBMIT_DIR`, `SLURM_NTASKS_PER_NODE`, `SLURM_CPUS_PER_TASK`) come
/// from the job's own environment, as `muster sbatch` wrote them.
fn slurm_variables(job: &Job, rank: usize, tasks: &[SchedAllocation]) -> Vec<(String, String)> {
    let per_node: usize = job
        .spec
        .env
        .get("SLURM_NTASKS_PER_NODE")
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let nodes: Vec<&str> = tasks.iter().map(|task| task.node.0.as_str()).collect();
    let id = job.id.0.to_string();
    let mut variables = vec![
        ("SLURM_JOB_ID", id.clone()),
        ("SLURM_JOBID", id),
        ("SLURM_JOB_NAME", job.spec.name.clone()),
        ("SLURM_PROCID", rank.to_string()),
        ("SLURM_NODEID", rank.to_string()),
        ("SLURM_LOCALID", "0".to_string()),
        ("SLURM_NNODES", tasks.len().to_string()),
        ("SLURM_JOB_NUM_NODES", tasks.len().to_string()),
        ("SLURM_NTASKS", (tasks.len() * per_node).to_string()),
        ("SLURM_NPROCS", (tasks.len() * per_node).to_string()),
        ("SLURM_JOB_NODELIST", nodes.join(",")),
        ("SLURM_NODELIST", nodes.join(",")),
        (
            "SLURMD_NODENAME",
            nodes.get(rank).copied().unwrap_or("").to_string(),
        ),
        (
            "SLURM_GPUS_ON_NODE",
            job.spec.gpus_per_node.gpu_count().to_string(),
        ),
        (
            "SLURM_CPUS_ON_NODE",
            job.spec.cpu_per_node.0.div_ceil(1000).to_string(),
        ),
        ("SLURM_JOB_ACCOUNT", job.spec.queue.0.clone()),
        ("SLURM_JOB_QOS", job.spec.priority_class.name.clone()),
        ("SLURM_CLUSTER_NAME", "muster".to_string()),
        ("SLURM_RESTART_COUNT", job.attempts.to_string()),
    ];
    if let Some(pool) = &job.spec.pool {
        variables.push(("SLURM_JOB_PARTITION", pool.0.clone()));
    }
    if let Some(dir) = &job.spec.working_dir {
        variables.push(("SLURM_SUBMIT_DIR", dir.clone()));
    }
    if let Some(array) = job.array {
        variables.extend([
            ("SLURM_ARRAY_JOB_ID", array.array.0.to_string()),
            ("SLURM_ARRAY_TASK_ID", array.index.to_string()),
            ("SLURM_ARRAY_TASK_COUNT", array.count.to_string()),
        ]);
    }
    variables
        .into_iter()
        .map(|(key, value)| (key.to_string(), value))
        .collect()
}

/// Notes a change; duplicates are removed once the input is handled
/// ([`dedup_outputs`]), so that noting costs O(1) however many changes one
/// input makes (a cycle may start tens of thousands of jobs).
fn changed(outputs: &mut Vec<Output>, output: Output) {
    outputs.push(output);
}

/// When the current attempt of `job` reaches its `max_runtime`, if it has
/// one and has started.
pub(crate) fn deadline_of(job: &Job) -> Option<Time> {
    let limit = job.spec.max_runtime?;
    let limit_ms = u64::try_from(limit.as_millis()).unwrap_or(u64::MAX);
    Some(job.started?.plus_millis(limit_ms))
}

/// What decides whether a node could ever hold a task: its pool, CPU,
/// memory and GPUs (model, memory, NVLink domain, in order), and whether it
/// runs containers. Nodes alike in these answer alike.
pub(crate) type NodeShape = (
    muster_model::PoolName,
    muster_model::CpuMilli,
    muster_model::MemoryMib,
    Vec<(muster_model::GpuModel, muster_model::MemoryMib, u32)>,
    bool,
);

pub(crate) fn node_shape(spec: &muster_model::NodeSpec, software: &Software) -> NodeShape {
    (
        spec.pool.clone(),
        spec.cpu,
        spec.memory,
        spec.gpus
            .iter()
            .map(|g| (g.model.clone(), g.memory, g.nvlink_domain))
            .collect(),
        software.runs_containers(),
    )
}

/// Why `dependency` can never be met now that its job ended as `state`
/// (`None`: it is met). For a submission naming a job that already ended.
/// Which runtime estimate: the mean of similar finished jobs (backfill and
/// reservations, where work must fit) or the typical one (start forecasts,
/// where when jobs end matters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Estimate {
    Mean,
    Forecast,
}

/// Learns an ended job's last attempt's run time into its queue's history:
/// jobs that succeeded, failed or ran out of time (a cancelled or
/// idle-stopped job says how long someone let it run, not how long its work
/// takes).
pub(crate) fn learn_runtime(
    runtimes: &mut BTreeMap<QueueName, muster_sched::RuntimeHistory>,
    job: &Job,
) {
    if !matches!(
        job.state,
        JobState::Succeeded | JobState::Failed | JobState::TimedOut
    ) {
        return;
    }
    let (Some(started), Some(finished)) = (job.started, job.finished) else {
        return;
    };
    if !runtimes.contains_key(&job.spec.queue) && runtimes.len() >= MAX_RUNTIME_HISTORIES {
        // The queue that has taught the least makes room.
        let least = runtimes
            .iter()
            .min_by(|a, b| a.1.jobs().total_cmp(&b.1.jobs()))
            .map(|(queue, _)| queue.clone());
        if let Some(least) = least {
            runtimes.remove(&least);
        }
    }
    runtimes
        .entry(job.spec.queue.clone())
        .or_default()
        .add(finished.millis_since(started) / 1000);
}

/// Queues whose run times are learned at once (each about 1.2 KB): queues
/// need not be configured, so a client submitting to ever new names must
/// not grow the state without end.
pub const MAX_RUNTIME_HISTORIES: usize = 4_096;

/// GPUs `job` holds while it runs (all its nodes), in GPUs.
fn job_gpus(job: &Job) -> f64 {
    f64::from(job.spec.gpus_per_node.total().0) / 1000.0 * f64::from(job.spec.nodes)
}

pub fn never_met(dependency: &muster_model::Dependency, state: JobState) -> Option<String> {
    (!dependency.kind.met_by(state == JobState::Succeeded)).then(|| {
        format!(
            "after: job {} already {}, so this job would wait for it {} forever",
            dependency.job,
            state.name(),
            dependency.kind.waiting_for()
        )
    })
}

/// Why `dependency` can never be met now that the jobs it names in `ended`
/// have ended (`None`: as far as they go, it is met): its job, or elements
/// of the array job it names (an array's dependency is on every element:
/// `ok` fails as soon as one element did not succeed, `notok` once all
/// succeeded, so for `notok` `ended` must be all of them). Empty `ended`:
/// nothing to say yet.
pub fn never_met_by(dependency: &muster_model::Dependency, ended: &[&Job]) -> Option<String> {
    let first = ended.first()?;
    let array = ended
        .iter()
        .any(|job| job.array.is_some_and(|a| a.array == dependency.job));
    if !array {
        return never_met(dependency, first.state);
    }
    let failed = ended.iter().find(|job| job.state != JobState::Succeeded);
    match (dependency.kind, failed) {
        (muster_model::DependencyKind::Ok, Some(job)) => Some(format!(
            "after: element {} of array job {} {}, so this job would wait for every element \
             to succeed forever",
            job.array.map_or(0, |a| a.index),
            dependency.job,
            job.state.name()
        )),
        (muster_model::DependencyKind::NotOk, None) => Some(format!(
            "after: every element of array job {} succeeded, so this job would wait for one \
             to fail forever",
            dependency.job
        )),
        _ => None,
    }
}

/// A report from `node` must carry its current epoch: one from before it
/// registered again is refused.
fn check_epoch(node: &Node, epoch: u64) -> Result<(), ControlError> {
    if node.epoch == epoch {
        return Ok(());
    }
    Err(ControlError::Conflict(format!(
        "node {} registered again since (epoch {} is current, not {epoch}); register \
         before sending reports",
        node.spec.name, node.epoch
    )))
}

/// Removes repeated outputs, keeping the first of each in order.
fn dedup_outputs(outputs: &mut Vec<Output>) {
    let keep: Vec<bool> = {
        let mut seen = muster_model::hashing::LookupSet::with_capacity_and_hasher(
            outputs.len(),
            Default::default(),
        );
        outputs.iter().map(|output| seen.insert(output)).collect()
    };
    let mut keep = keep.into_iter();
    outputs.retain(|_| keep.next().unwrap_or(true));
}

impl ControlPlane {
    pub fn new(config: ControlConfig) -> Self {
        ControlPlane {
            config,
            admission_counts: AdmissionCounts::default(),
            jobs: BTreeMap::new(),
            nodes: BTreeMap::new(),
            allocations: BTreeMap::new(),
            queues: BTreeMap::new(),
            next_allocation: 1,
            next_generation: 1,
            next_epoch: 1,
            live_by_node: BTreeMap::new(),
            by_job: BTreeMap::new(),
            finished: BTreeSet::new(),
            runtimes: BTreeMap::new(),
            forecasts: BTreeMap::new(),
            attained: BTreeMap::new(),
            last_reasons: BTreeMap::new(),
            usage: muster_sched::UsageLedger::new(USAGE_HALF_LIFE_MS, Time(0)),
            heartbeat_sequences: BTreeMap::new(),
            memory_limited: BTreeSet::new(),
            excluded: BTreeMap::new(),
            budget_held: BTreeSet::new(),
            pool_policies: BTreeMap::new(),
            deadlines: BTreeSet::new(),
            waiting: BTreeSet::new(),
            node_shapes: BTreeMap::new(),
        }
    }

    /// The queues held at their hard budget ([`Input::HoldBudgets`]).
    pub fn budget_holds(&self) -> &BTreeSet<QueueName> {
        &self.budget_held
    }

    pub fn config(&self) -> &ControlConfig {
        &self.config
    }

    /// A job of the hot state.
    pub fn job(&self, id: JobId) -> Option<&Job> {
        self.jobs.get(&id)
    }

    /// The hot state's jobs, by id.
    pub fn jobs(&self) -> impl DoubleEndedIterator<Item = &Job> {
        self.jobs.values()
    }

    /// The hot state's jobs with an id below `before` (all: `None`),
    /// newest first.
    pub fn jobs_newest_first(&self, before: Option<JobId>) -> impl Iterator<Item = &Job> {
        let end = before.map_or(std::ops::Bound::Unbounded, std::ops::Bound::Excluded);
        self.jobs
            .range((std::ops::Bound::Unbounded, end))
            .rev()
            .map(|(_, job)| job)
    }

    pub fn job_count(&self) -> usize {
        self.jobs.len()
    }

    pub fn node(&self, name: &NodeName) -> Option<&Node> {
        self.nodes.get(name)
    }

    pub fn nodes(&self) -> impl Iterator<Item = &Node> {
        self.nodes.values()
    }

    pub fn allocation(&self, id: AllocationId) -> Option<&Allocation> {
        self.allocations.get(&id)
    }

    /// The allocations running (reported so) on any node, node by node.
    pub fn running_allocations(&self) -> impl Iterator<Item = &Allocation> {
        self.live_by_node
            .values()
            .flatten()
            .filter_map(|id| self.allocations.get(id))
            .filter(|a| a.state == AllocationState::Running)
    }

    /// The allocations holding resources on `node`.
    pub fn live_allocations(&self, node: &NodeName) -> impl Iterator<Item = &Allocation> {
        self.live_by_node
            .get(node)
            .into_iter()
            .flatten()
            .filter_map(|id| self.allocations.get(id))
    }

    /// Every attempt's allocations of a job in the hot state, oldest first.
    pub fn job_allocations(&self, job: JobId) -> impl Iterator<Item = &Allocation> {
        self.by_job
            .get(&job)
            .into_iter()
            .flatten()
            .filter_map(|id| self.allocations.get(id))
    }

    /// The allocations of a job's current attempt.
    pub fn current_allocations(&self, job: &Job) -> impl Iterator<Item = &Allocation> {
        job.allocations
            .iter()
            .filter_map(|id| self.allocations.get(id))
    }

    pub fn queues(&self) -> impl Iterator<Item = &QueueSpec> {
        self.queues.values()
    }

    /// The next allocation id and generation to be issued, and the next
    /// epoch.
    pub fn counters(&self) -> Counters {
        Counters {
            next_allocation: self.next_allocation,
            next_generation: self.next_generation,
            next_epoch: self.next_epoch,
        }
    }

    /// Why the last scheduling cycle left a node out (a spec the engine
    /// cannot take), if it did.
    pub fn excluded_reason(&self, node: &NodeName) -> Option<&str> {
        self.excluded.get(node).map(String::as_str)
    }

    /// Withdraws a submission that was never acknowledged (its commit
    /// failed): the job goes as if never submitted, if it has not started.
    pub fn withdraw(&mut self, id: JobId) -> Result<(), ControlError> {
        let job = self.jobs.get(&id).ok_or(ControlError::JobNotFound(id))?;
        if job.state != JobState::Pending || job.attempts > 0 {
            return Err(ControlError::Conflict(format!(
                "job {id} is {} and cannot be withdrawn",
                job.state.name()
            )));
        }
        let after: Vec<JobId> = job.spec.after.iter().map(|d| d.job).collect();
        self.admission_counts
            .changed(&job.user, &job.spec, Some(JobState::Pending), None);
        self.jobs.remove(&id);
        self.by_job.remove(&id);
        self.last_reasons.remove(&id);
        for dependency in after {
            self.waiting.remove(&(dependency, id));
        }
        // A job waiting for this one (it could only have guessed the id)
        // waits for a job that never was: as for one long gone, it is met.
        let dependents: Vec<(JobId, JobId)> = self
            .waiting
            .range((id, JobId(0))..=(id, JobId(u64::MAX)))
            .copied()
            .collect();
        for entry in dependents {
            self.waiting.remove(&entry);
        }
        self.debug_check();
        Ok(())
    }

    /// The dependency index as the jobs say it should be.
    pub(crate) fn waiting_from_jobs(&self) -> BTreeSet<(JobId, JobId)> {
        self.jobs
            .values()
            .filter(|job| job.state == JobState::Pending)
            .flat_map(|job| {
                job.spec.after.iter().filter_map(|dependency| {
                    self.dependency_open(dependency.job)
                        .then_some((dependency.job, job.id))
                })
            })
            .collect()
    }

    fn forget_shape(&mut self, shape: NodeShape, name: &NodeName) {
        if let Some(names) = self.node_shapes.get_mut(&shape) {
            names.remove(name);
            if names.is_empty() {
                self.node_shapes.remove(&shape);
            }
        }
    }

    /// The index of node shapes as the nodes say it should be.
    pub(crate) fn node_shapes_from_nodes(&self) -> BTreeMap<NodeShape, BTreeSet<NodeName>> {
        let mut shapes: BTreeMap<NodeShape, BTreeSet<NodeName>> = BTreeMap::new();
        for node in self.nodes.values() {
            shapes
                .entry(node_shape(&node.spec, &node.software))
                .or_default()
                .insert(node.spec.name.clone());
        }
        shapes
    }

    /// Why no registered node could ever hold a job of `spec` (each node
    /// taken as ready, uncordoned, healthy and empty), in words naming the
    /// largest node; `None` when enough could, or when the cluster has no
    /// nodes yet (jobs queue for the nodes to come). The engine's own rule
    /// ([`muster_sched::nodes_that_could_ever_hold`]), applied to one node
    /// of each distinct shape.
    pub fn never_fits(&self, spec: &JobSpec) -> Option<String> {
        if self.nodes.is_empty() {
            return None;
        }
        // Nodes alike (pool, CPU, memory, GPUs, containers) answer alike:
        // one of each.
        let mut count: BTreeMap<&NodeName, usize> = BTreeMap::new();
        let inputs: Vec<NodeInput> = self
            .node_shapes
            .values()
            .filter_map(|names| {
                let node = self.nodes.get(names.first()?)?;
                count.insert(&node.spec.name, names.len());
                Some(NodeInput {
                    containers: node.software.runs_containers(),
                    reserved: self.is_inference_pool(&node.spec.pool),
                    ..NodeInput::schedulable(node.spec.clone())
                })
            })
            .collect();
        let request = TaskRequest::of(spec);
        let holding: usize = muster_sched::nodes_that_could_ever_hold(&inputs, &request)
            .iter()
            .map(|name| count.get(name).copied().unwrap_or(0))
            .sum();
        if holding >= spec.nodes as usize {
            return None;
        }
        let largest = self
            .nodes
            .values()
            .max_by_key(|n| (n.spec.gpus.len(), n.spec.cpu, n.spec.memory))?;
        let models: BTreeSet<&str> = largest.spec.gpus.iter().map(|g| g.model.as_str()).collect();
        let gpus = if models.is_empty() {
            "no GPUs".to_string()
        } else {
            format!(
                "{} GPUs ({})",
                largest.spec.gpus.len(),
                models.into_iter().collect::<Vec<_>>().join(", ")
            )
        };
        let asks = format!(
            "{} node(s) x {} GPU(s){}, {} CPU(s), {} MiB of memory",
            spec.nodes,
            f64::from(spec.gpus_per_node.total().0) / 1000.0,
            if spec.gpu_models.is_empty() {
                String::new()
            } else {
                format!(
                    " of {}",
                    spec.gpu_models
                        .iter()
                        .map(|m| m.as_str())
                        .collect::<Vec<_>>()
                        .join(" or ")
                )
            },
            spec.cpu_per_node.0 as f64 / 1000.0,
            spec.memory_per_node.0
        );
        // A job in containers also needs nodes that run them: say how many.
        let containers = spec.image.as_ref().map_or(String::new(), |image| {
            let running = self
                .nodes
                .values()
                .filter(|node| node.software.runs_containers())
                .count();
            format!(
                " It runs in containers (image {image}), and {running} of the {} registered \
                 nodes can run containers (an agent whose Docker engine answers says so at \
                 registration).",
                self.nodes.len()
            )
        });
        // Inference pools take other work only if it may be preempted.
        let reserved = if spec.service.is_none() && !spec.preemptible {
            let held = self
                .nodes
                .values()
                .filter(|node| self.is_inference_pool(&node.spec.pool))
                .count();
            if held > 0 {
                format!(
                    " {held} of the nodes are in an inference pool, which takes services' \
                     replicas and only preemptible other work (`preemptible: true`).",
                )
            } else {
                String::new()
            }
        } else {
            String::new()
        };
        Some(format!(
            "no registered node can ever hold this job: it asks for {asks} per node, and \
             {holding} of the {} nodes could hold a task; the largest node, {}, has {gpus}, \
             {} CPU(s) and {} MiB (pool {}).{containers}{reserved} Ask for less, or pass \
             --allow-pending to queue it for nodes still to come",
            self.nodes.len(),
            largest.spec.name,
            largest.spec.cpu.0 as f64 / 1000.0,
            largest.spec.memory.0,
            largest.spec.pool
        ))
    }

    /// A short code for why job `id` is pending (`None`: it is not):
    /// `dependency`, the last cycle's reason's
    /// [`muster_sched::PendingReason::code`], `budget` (its queue's hard
    /// budget is spent), `array-limit` (an element its
    /// array's limit kept from the last cycle), or `unscheduled` (no cycle
    /// has looked at it yet).
    pub fn pending_code(&self, id: JobId) -> Option<&'static str> {
        let job = self.jobs.get(&id)?;
        if job.state != JobState::Pending {
            return None;
        }
        if self.is_waiting(job) {
            return Some("dependency");
        }
        if self.budget_held.contains(&job.spec.queue) {
            return Some("budget");
        }
        if let Some(reason) = self.last_reasons.get(&id) {
            return Some(reason.code());
        }
        // Not offered to the last cycle: an element of an array with a
        // limit is offered only while the array has room below it.
        Some(match job.array {
            Some(array) if array.limit.is_some() => "array-limit",
            _ => "unscheduled",
        })
    }

    /// Marks the nodes of `node`'s pool whose stack breaks the pool's
    /// policy (or clears the mark of those that no longer do).
    pub(crate) fn apply_stack_policy(&mut self, node: &NodeName, outputs: &mut Vec<Output>) {
        let Some(pool) = self.nodes.get(node).map(|n| n.spec.pool.clone()) else {
            return;
        };
        // Under `report` no node of the pool is marked (a change of policy
        // refreshes the whole pool; a registering node starts unmarked):
        // nothing to do, and 32,768 nodes registering after a restart do
        // not each walk every node.
        if self.stack_policy_of(&pool).stack == StackPolicy::Report {
            return;
        }
        self.refresh_pool_drift(&pool, outputs);
    }

    /// Recomputes the drift of every node of `pool`.
    pub(crate) fn refresh_pool_drift(
        &mut self,
        pool: &muster_model::PoolName,
        outputs: &mut Vec<Output>,
    ) {
        let drift = self.drift_of_pool(pool);
        for found in self.nodes.values_mut().filter(|n| &n.spec.pool == pool) {
            let now = drift.get(&found.spec.name).cloned();
            if found.drift != now {
                found.drift = now;
                outputs.push(Output::NodeChanged(found.spec.name.clone()));
            }
        }
    }

    /// `pool`'s stack policy: its own, else the server's.
    pub fn stack_policy_of(&self, pool: &muster_model::PoolName) -> PoolPolicy {
        self.pool_policies.get(pool).cloned().unwrap_or(PoolPolicy {
            stack: self.config.stack_policy,
            required: BTreeMap::new(),
            mounts: Vec::new(),
            inference: false,
        })
    }

    /// Whether `allocation` of `job` borrows an inference pool: the job is
    /// no service and the allocation's node is in such a pool (the
    /// engine's own rule, for views).
    pub fn borrows(&self, job: &Job, allocation: &Allocation) -> bool {
        job.spec.service.is_none()
            && self
                .nodes
                .get(&allocation.node)
                .is_some_and(|node| self.is_inference_pool(&node.spec.pool))
    }

    /// Whether `pool` is an inference pool (see [`PoolPolicy::inference`]).
    pub fn is_inference_pool(&self, pool: &muster_model::PoolName) -> bool {
        self.pool_policies
            .get(pool)
            .is_some_and(|policy| policy.inference)
    }

    /// Pools with a policy of their own.
    pub fn pool_policies(&self) -> &BTreeMap<muster_model::PoolName, PoolPolicy> {
        &self.pool_policies
    }

    /// Each node of `pool` that breaks its policy, with the reason: under
    /// `majority` the nodes that differ from the pool's most common stack
    /// (pools of 3 nodes or more), under `required` those that do not
    /// report a required version.
    pub(crate) fn drift_of_pool(
        &self,
        pool: &muster_model::PoolName,
    ) -> BTreeMap<NodeName, String> {
        let policy = self.stack_policy_of(pool);
        match policy.stack {
            StackPolicy::Report => return BTreeMap::new(),
            StackPolicy::Required => {
                let mut drift = BTreeMap::new();
                for node in self.nodes.values().filter(|n| &n.spec.pool == pool) {
                    let components = node.software.components();
                    let differences: Vec<String> = policy
                        .required
                        .iter()
                        .filter(|(component, version)| {
                            components.get(component.as_str()) != Some(&version.as_str())
                        })
                        .map(|(component, version)| {
                            format!(
                                " {component} {} vs required {version}",
                                components
                                    .get(component.as_str())
                                    .copied()
                                    .unwrap_or(crate::fleet::NONE)
                            )
                        })
                        .collect();
                    if !differences.is_empty() {
                        drift.insert(
                            node.spec.name.clone(),
                            format!("stack drift:{}", differences.join(",")),
                        );
                    }
                }
                return drift;
            }
            StackPolicy::Majority => {}
        }
        let members: Vec<crate::fleet::NodeStack<'_>> = self
            .nodes
            .values()
            .filter(|n| &n.spec.pool == pool)
            .map(crate::fleet::node_stack)
            .collect();
        let mut drift: BTreeMap<NodeName, String> = BTreeMap::new();
        if members.len() < 3 {
            return drift;
        }
        for stack in crate::fleet::pool_stacks(&members) {
            for found in stack.drift {
                let entry = drift
                    .entry(NodeName(found.node.clone()))
                    .or_insert_with(|| "stack drift:".to_string());
                if !entry.ends_with(':') {
                    entry.push(',');
                }
                entry.push_str(&format!(
                    " {} {} vs {}",
                    found.component, found.version, found.expected
                ));
            }
        }
        drift
    }

    /// Below what utilisation (percent) `job`'s GPUs count as idle: its
    /// queue's `idle_below_pct`, else [`crate::usage::IDLE_UTILIZATION_PCT`].
    pub fn idle_below_pct_of(&self, job: &Job) -> u32 {
        self.queues
            .get(&job.spec.queue)
            .and_then(|queue| queue.idle_below_pct)
            .unwrap_or(crate::usage::IDLE_UTILIZATION_PCT)
    }

    /// How long `job`'s GPUs must stay idle for it to be shown idle: its
    /// queue's `idle_after`, else `default_ms` (the server's).
    pub fn idle_after_ms_of(&self, job: &Job, default_ms: u64) -> u64 {
        self.queues
            .get(&job.spec.queue)
            .and_then(|queue| queue.idle_after)
            .map_or(default_ms, |after| {
                u64::try_from(after.as_millis()).unwrap_or(u64::MAX)
            })
    }

    /// How long `job`'s GPUs may stay idle before it is stopped: the
    /// shorter of its own `idle_timeout` and its queue's (`None`: never).
    pub fn idle_timeout_of(&self, job: &Job) -> Option<std::time::Duration> {
        let queue = self
            .queues
            .get(&job.spec.queue)
            .and_then(|queue| queue.idle_timeout);
        match (job.spec.idle_timeout, queue) {
            (Some(own), Some(queue)) => Some(own.min(queue)),
            (own, queue) => own.or(queue),
        }
    }

    /// The elements of array job `array` in the hot state (its first
    /// element, whose id the array has, may have been retired already).
    pub fn array_elements(&self, array: JobId) -> Vec<JobId> {
        self.jobs
            .range(array..)
            .take_while(|(_, job)| job.array.is_some_and(|a| a.array == array))
            .map(|(id, _)| *id)
            .collect()
    }

    /// The jobs a dependency on `id` waits for: job `id`, or, when `id` is
    /// an array job's, every element of it in the hot state. Empty: the
    /// hot state has none.
    pub fn dependency_targets(&self, id: JobId) -> Vec<JobId> {
        let elements = self.array_elements(id);
        if !elements.is_empty() {
            elements
        } else if self.jobs.contains_key(&id) {
            vec![id]
        } else {
            Vec::new()
        }
    }

    /// Whether `id` is an array job's id (its first element may have been
    /// retired already).
    fn is_array(&self, id: JobId) -> bool {
        self.jobs
            .range(id..)
            .next()
            .is_some_and(|(_, job)| job.array.is_some_and(|a| a.array == id))
    }

    /// Whether a dependency on `id` names a job of the hot state still to
    /// end (for an array job: an element still to end; elements end
    /// mostly in order, so the first one found usually answers).
    fn dependency_open(&self, id: JobId) -> bool {
        let mut elements = self
            .jobs
            .range(id..)
            .take_while(|(_, job)| job.array.is_some_and(|a| a.array == id))
            .peekable();
        if elements.peek().is_none() {
            return self.jobs.get(&id).is_some_and(|job| !job.state.is_final());
        }
        elements.any(|(_, job)| !job.state.is_final())
    }

    /// Whether `job` still waits for a dependency (one in the hot state
    /// that has not ended).
    pub fn is_waiting(&self, job: &Job) -> bool {
        job.spec
            .after
            .iter()
            .any(|dependency| self.waiting.contains(&(dependency.job, job.id)))
    }

    /// The pending reason of a job held by its dependencies (`None`: none
    /// holds it), naming the first one `holds` says still holds it.
    fn waiting_reason(&self, spec: &JobSpec, holds: impl Fn(JobId) -> bool) -> Option<String> {
        let holding: Vec<&muster_model::Dependency> =
            spec.after.iter().filter(|d| holds(d.job)).collect();
        let first = holding.first()?;
        let more = match holding.len() - 1 {
            0 => String::new(),
            1 => " and 1 more job".to_string(),
            n => format!(" and {n} more jobs"),
        };
        let what = if self.is_array(first.job) {
            format!("array job {} (every element)", first.job)
        } else {
            format!("job {}", first.job)
        };
        Some(format!(
            "waiting for {what} {}{more} (after: {})",
            first.kind.waiting_for(),
            spec.after
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ))
    }

    /// A job just ended: the jobs waiting for it go on (met) or are
    /// cancelled (not met), and so on for those they hold in turn. A job
    /// waiting for an array goes on once every element has ended as it
    /// asks (one failed element cancels a job waiting for all to succeed).
    fn release_dependents(&mut self, now: Time, ended: JobId, outputs: &mut Vec<Output>) {
        let mut work = vec![ended];
        while let Some(ended) = work.pop() {
            let Some((succeeded, state, element)) = self
                .jobs
                .get(&ended)
                .map(|job| (job.state == JobState::Succeeded, job.state, job.array))
            else {
                continue;
            };
            // Jobs waiting for this one, and, for an element, for its array
            // (under the array's id, once per dependent, whatever its size).
            let mut keys = vec![ended];
            if let Some(array) = element.map(|a| a.array).filter(|&array| array != ended) {
                keys.push(array);
            }
            for key in keys {
                let entries: Vec<(JobId, JobId)> = self
                    .waiting
                    .range((key, JobId(0))..=(key, JobId(u64::MAX)))
                    .copied()
                    .collect();
                if entries.is_empty() {
                    continue;
                }
                let whole_array = self.is_array(key);
                // Asked once for all the array's dependents.
                let open = whole_array && self.dependency_open(key);
                for entry in entries {
                    let dependent = entry.1;
                    let Some(job) = self.jobs.get(&dependent) else {
                        self.waiting.remove(&entry);
                        continue;
                    };
                    let Some(dependency) = job.spec.after.iter().find(|d| d.job == key).copied()
                    else {
                        self.waiting.remove(&entry);
                        continue;
                    };
                    // Met (`Some(true)`), never (`Some(false)`), or not yet.
                    let verdict = if !whole_array {
                        Some(dependency.kind.met_by(succeeded))
                    } else if dependency.kind == muster_model::DependencyKind::Ok && !succeeded {
                        Some(false)
                    } else if open {
                        None
                    } else {
                        let targets = self.dependency_targets(key);
                        let ended_jobs: Vec<&Job> =
                            targets.iter().filter_map(|id| self.jobs.get(id)).collect();
                        Some(never_met_by(&dependency, &ended_jobs).is_none())
                    };
                    let Some(met) = verdict else {
                        continue;
                    };
                    self.waiting.remove(&entry);
                    if met {
                        let reason = self.waiting_reason(&job.spec, |other| {
                            self.waiting.contains(&(other, dependent))
                        });
                        let what = if whole_array {
                            format!("array job {key}")
                        } else {
                            format!("job {key}")
                        };
                        if let Some(job) = self.jobs.get_mut(&dependent) {
                            job.pending_reason = reason;
                            job.history
                                .push((now, format!("{what} ended as this job waited for it")));
                        }
                        changed(outputs, Output::JobChanged(dependent));
                    } else {
                        let note = match element.filter(|_| whole_array) {
                            Some(element)
                                if dependency.kind == muster_model::DependencyKind::Ok =>
                            {
                                format!(
                                    "cancelled: element {} of array job {key} {}, and this job \
                                     waited for every element to succeed",
                                    element.index,
                                    state.name()
                                )
                            }
                            Some(_) => format!(
                                "cancelled: every element of array job {key} succeeded, and \
                                 this job waited for one to fail"
                            ),
                            None => format!(
                                "cancelled: job {key} {}, and this job waited for it {}",
                                state.name(),
                                dependency.kind.waiting_for()
                            ),
                        };
                        self.cancel_pending(now, dependent, note, outputs);
                        work.push(dependent);
                    }
                }
            }
        }
    }

    /// Ends a pending job as cancelled with `note`, leaving the index of
    /// dependencies.
    fn cancel_pending(&mut self, now: Time, id: JobId, note: String, outputs: &mut Vec<Output>) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        if job.state != JobState::Pending {
            return;
        }
        job.state = JobState::Cancelled;
        self.admission_counts.changed(
            &job.user,
            &job.spec,
            Some(JobState::Pending),
            Some(JobState::Cancelled),
        );
        job.finished = Some(now);
        job.pending_reason = None;
        job.queue_position = None;
        job.history.push((now, note));
        let after: Vec<JobId> = job.spec.after.iter().map(|d| d.job).collect();
        self.finished.insert((now, id));
        self.last_reasons.remove(&id);
        self.attained.remove(&id);
        for dependency in after {
            self.waiting.remove(&(dependency, id));
        }
        outputs.push(Output::JobChanged(id));
    }

    /// In debug builds, panics when an invariant does not hold.
    fn debug_check(&self) {
        #[cfg(debug_assertions)]
        if let Err(problem) = self.check_invariants() {
            panic!("the control plane broke an invariant: {problem}");
        }
    }

    /// Moves an allocation to `state`, keeping the per-node index.
    fn set_allocation_state(&mut self, id: AllocationId, state: AllocationState) {
        let Some(allocation) = self.allocations.get_mut(&id) else {
            return;
        };
        let was = allocation.state.holds_resources();
        allocation.state = state;
        let now = state.holds_resources();
        if was && !now {
            if let Some(live) = self.live_by_node.get_mut(&allocation.node) {
                live.remove(&id);
                if live.is_empty() {
                    self.live_by_node.remove(&allocation.node);
                }
            }
        } else if !was && now {
            self.live_by_node
                .entry(allocation.node.clone())
                .or_default()
                .insert(id);
        }
    }

    /// The live allocations on `node` that `which` picks are lost (they may
    /// still run there until the node fences them) and their jobs stopped
    /// for `cause`.
    fn lose_work(
        &mut self,
        now: Time,
        node: &NodeName,
        which: impl Fn(&Allocation) -> bool,
        cause: StopCause,
        why: &str,
        outputs: &mut Vec<Output>,
    ) {
        let mut jobs = BTreeSet::new();
        for id in self.live_ids(node) {
            let Some(job) = self
                .allocations
                .get(&id)
                .filter(|a| which(a))
                .map(|a| a.job)
            else {
                continue;
            };
            jobs.insert(job);
            self.set_allocation_state(id, AllocationState::Lost);
        }
        for job in jobs {
            self.stop_job(now, job, cause, why, outputs);
        }
    }

    /// Live allocation ids on `node`, copied (for loops that change them).
    fn live_ids(&self, node: &NodeName) -> Vec<AllocationId> {
        self.live_by_node
            .get(node)
            .map(|live| live.iter().copied().collect())
            .unwrap_or_default()
    }

    pub fn handle(&mut self, now: Time, input: Input) -> Result<Vec<Output>, ControlError> {
        let mut result = self.handle_input(now, input);
        if let Ok(outputs) = &mut result {
            dedup_outputs(outputs);
        }
        self.debug_check();
        result
    }

    fn handle_input(&mut self, now: Time, input: Input) -> Result<Vec<Output>, ControlError> {
        let mut outputs = Vec::new();
        match input {
            Input::Submit { id, spec, user } => {
                // An array's elements take ids `id`, `id + 1`, ... (the
                // shell reserves them).
                let count = spec.array.as_ref().map_or(1, |array| array.len() as u64);
                if count == 0 {
                    return Err(ControlError::Invalid("array: no indices".to_string()));
                }
                if let Some((&taken, _)) = self.jobs.range(id..JobId(id.0 + count)).next() {
                    return Err(ControlError::Conflict(format!(
                        "job {taken} already exists"
                    )));
                }
                // Dependencies name jobs of the hot state (the shell looks
                // older ones up in its store and keeps only those still to
                // come); one already ended must have ended the right way.
                // A dependency on an array job is on every element of it.
                let mut waits_for = Vec::new();
                for dependency in &spec.after {
                    let targets = self.dependency_targets(dependency.job);
                    if targets.is_empty() {
                        return Err(ControlError::Invalid(format!(
                            "after: there is no job {} (or it ended too long ago to be \
                             waited for here)",
                            dependency.job
                        )));
                    }
                    let (ended, open): (Vec<&Job>, Vec<&Job>) = targets
                        .iter()
                        .filter_map(|target| self.jobs.get(target))
                        .partition(|job| job.state.is_final());
                    // All ended: met or never. Some still to end: an array
                    // waited for to succeed already failed if one did.
                    let never =
                        if open.is_empty() || dependency.kind == muster_model::DependencyKind::Ok {
                            never_met_by(dependency, &ended)
                        } else {
                            None
                        };
                    if let Some(why) = never {
                        return Err(ControlError::Invalid(why));
                    }
                    if !open.is_empty() {
                        waits_for.push(dependency.job);
                    }
                }
                let pending_reason = self.waiting_reason(&spec, |job| waits_for.contains(&job));
                let mut spec = spec;
                let elements: Vec<(JobId, Option<muster_model::ArrayElement>)> =
                    match spec.array.take() {
                        None => vec![(id, None)],
                        Some(array) => array
                            .indices
                            .iter()
                            .enumerate()
                            .map(|(position, &index)| {
                                (
                                    JobId(id.0 + position as u64),
                                    Some(muster_model::ArrayElement {
                                        array: id,
                                        index,
                                        count: count as u32,
                                        limit: array.limit,
                                    }),
                                )
                            })
                            .collect(),
                    };
                for (element, array) in elements {
                    for &dependency in &waits_for {
                        self.waiting.insert((dependency, element));
                    }
                    let history = match array {
                        None => "submitted".to_string(),
                        Some(array) => format!(
                            "submitted as element {} of array job {}",
                            array.index, array.array
                        ),
                    };
                    self.jobs.insert(
                        element,
                        Job {
                            id: element,
                            spec: spec.clone(),
                            user: user.clone(),
                            submitted: now,
                            state: JobState::Pending,
                            stop_cause: None,
                            attempts: 0,
                            exit_code: None,
                            first_failure: None,
                            started: None,
                            finished: None,
                            allocations: Vec::new(),
                            history: vec![(now, history)],
                            pending_reason: pending_reason.clone(),
                            queue_position: None,
                            array,
                        },
                    );
                    self.admission_counts
                        .changed(&user, &spec, None, Some(JobState::Pending));
                    outputs.push(Output::JobChanged(element));
                }
            }
            Input::Cancel { job } => self.cancel(now, job, &mut outputs)?,
            Input::StopIdle { job } => {
                let stoppable = self.jobs.get(&job).and_then(|found| {
                    let timeout = self.idle_timeout_of(found)?;
                    (found.state == JobState::Running).then_some(timeout)
                });
                if let Some(timeout) = stoppable {
                    let why = format!(
                        "its GPUs were idle (below 5%) for its idle_timeout of {} s",
                        timeout.as_secs()
                    );
                    self.stop_job(now, job, StopCause::Idle, &why, &mut outputs);
                }
            }
            Input::CancelArray { array } => {
                let elements = self.array_elements(array);
                if elements.is_empty() {
                    return Err(match self.jobs.get(&array) {
                        Some(_) => ControlError::Conflict(format!(
                            "job {array} is not an array job; cancel it as a job"
                        )),
                        None => ControlError::JobNotFound(array),
                    });
                }
                for element in elements {
                    self.cancel(now, element, &mut outputs)?;
                }
            }
            Input::Register {
                spec,
                address,
                software,
            } => {
                let problems = spec.problems();
                if !problems.is_empty() {
                    return Err(ControlError::Invalid(format!(
                        "node {} cannot join: {}",
                        spec.name,
                        problems.join("; ")
                    )));
                }
                let name = spec.name.clone();
                // Under approval, whoever holds a join token cannot fill the
                // cluster with nodes that wait: at most MAX_PENDING_APPROVAL.
                if self.config.approve_nodes && !self.nodes.contains_key(&name) {
                    let waiting = self.nodes.values().filter(|n| n.pending_approval).count();
                    if waiting >= MAX_PENDING_APPROVAL {
                        return Err(ControlError::Conflict(format!(
                            "node {name} cannot join: {waiting} nodes already wait for approval \
                             (`muster nodes approve NAME`, or `muster nodes remove NAME`)"
                        )));
                    }
                }
                if let Some(old) = self.nodes.get(&name) {
                    // Work placed on GPUs the node no longer has (or no
                    // longer has room for) cannot run there: re-queued.
                    let shrunk = old.spec.gpus.len() > spec.gpus.len()
                        || old.spec.cpu > spec.cpu
                        || old.spec.memory > spec.memory;
                    if shrunk {
                        let (gpus, cpu, memory) = (spec.gpus.len(), spec.cpu, spec.memory);
                        let cut = old.spec.cpu > cpu || old.spec.memory > memory;
                        self.lose_work(
                            now,
                            &name,
                            |a| cut || a.gpus.iter().any(|(i, _)| *i as usize >= gpus),
                            StopCause::NodeLost,
                            &format!("node {name} registered with fewer resources"),
                            &mut outputs,
                        );
                    }
                }
                let (cordoned, draining, unhealthy_gpus, pending_approval) = self
                    .nodes
                    .get(&name)
                    .map_or((false, false, Vec::new(), self.config.approve_nodes), |n| {
                        (
                            n.cordoned,
                            n.draining,
                            n.unhealthy_gpus.clone(),
                            n.pending_approval,
                        )
                    });
                let unhealthy_gpus = unhealthy_gpus
                    .into_iter()
                    .filter(|&i| (i as usize) < spec.gpus.len())
                    .collect();
                let epoch = self.next_epoch;
                self.next_epoch += 1;
                self.heartbeat_sequences.remove(&name);
                if let Some(old) = self.nodes.get(&name) {
                    let old = node_shape(&old.spec, &old.software);
                    self.forget_shape(old, &name);
                }
                self.node_shapes
                    .entry(node_shape(&spec, &software))
                    .or_default()
                    .insert(name.clone());
                self.nodes.insert(
                    name.clone(),
                    Node {
                        spec,
                        address,
                        epoch,
                        state: NodeState::Ready,
                        cordoned,
                        draining,
                        last_heartbeat: now,
                        software,
                        unhealthy_gpus,
                        drift: None,
                        pending_approval,
                    },
                );
                outputs.push(Output::NodeChanged(name.clone()));
                outputs.push(Output::DesiredChanged(name.clone()));
                self.apply_stack_policy(&name, &mut outputs);
            }
            Input::Heartbeat {
                node,
                epoch,
                sequence,
                observed,
                unhealthy,
            } => {
                // An old or duplicated heartbeat still renews the lease (the
                // agent was alive when it sent it, and counts its own lease
                // from then, never later), but reports nothing: neither its
                // tasks nor its GPUs' health, both as old as it is.
                let newer = self.newer_heartbeat(&node, epoch, sequence)?;
                if newer && let Some(unhealthy) = unhealthy {
                    self.gpu_health(now, &node, epoch, unhealthy, &mut outputs)?;
                }
                let observed = if newer { Some(&observed[..]) } else { None };
                self.heartbeat(now, &node, epoch, observed, &mut outputs)?;
                if newer && sequence > 0 {
                    self.heartbeat_sequences.insert(node, sequence);
                }
            }
            Input::GpuHealth {
                node,
                epoch,
                unhealthy,
            } => self.gpu_health(now, &node, epoch, unhealthy, &mut outputs)?,
            Input::Tick => {
                self.account_usage(now);
                self.enforce_time_limits(now, &mut outputs);
                self.expire_leases(now, &mut outputs);
                self.retire(now, &mut outputs);
            }
            Input::Approve { node } => {
                let entry = self
                    .nodes
                    .get_mut(&node)
                    .ok_or_else(|| ControlError::NodeNotFound(node.clone()))?;
                if entry.pending_approval {
                    entry.pending_approval = false;
                    outputs.push(Output::NodeChanged(node.clone()));
                    outputs.push(Output::DesiredChanged(node));
                }
            }
            Input::Cordon { node, cordoned } => {
                let entry = self
                    .nodes
                    .get_mut(&node)
                    .ok_or_else(|| ControlError::NodeNotFound(node.clone()))?;
                entry.cordoned = cordoned;
                if !cordoned {
                    entry.draining = false;
                }
                outputs.push(Output::NodeChanged(node));
            }
            Input::Drain { node } => {
                let entry = self
                    .nodes
                    .get_mut(&node)
                    .ok_or_else(|| ControlError::NodeNotFound(node.clone()))?;
                entry.cordoned = true;
                entry.draining = true;
                outputs.push(Output::NodeChanged(node.clone()));
                let jobs: BTreeSet<JobId> = self.live_allocations(&node).map(|a| a.job).collect();
                for job in jobs {
                    self.stop_job(now, job, StopCause::Preempted, "node drained", &mut outputs);
                }
            }
            Input::RemoveNode { node, force } => {
                if !self.nodes.contains_key(&node) {
                    return Err(ControlError::NodeNotFound(node));
                }
                let jobs: BTreeSet<JobId> = self.live_allocations(&node).map(|a| a.job).collect();
                if !jobs.is_empty() && !force {
                    let list: Vec<String> = jobs.iter().map(ToString::to_string).collect();
                    return Err(ControlError::Conflict(format!(
                        "node {node} holds work of job(s) {}; drain it first \
                         (`muster nodes drain {node}`), or remove it with --force to re-queue \
                         that work",
                        list.join(", ")
                    )));
                }
                self.lose_work(
                    now,
                    &node,
                    |_| true,
                    StopCause::Preempted,
                    &format!("node {node} removed"),
                    &mut outputs,
                );
                if let Some(removed) = self.nodes.remove(&node) {
                    self.forget_shape(node_shape(&removed.spec, &removed.software), &node);
                    // The pool's majority may have changed.
                    let other = self
                        .nodes
                        .values()
                        .find(|n| n.spec.pool == removed.spec.pool)
                        .map(|n| n.spec.name.clone());
                    if let Some(other) = other {
                        self.apply_stack_policy(&other, &mut outputs);
                    }
                }
                self.heartbeat_sequences.remove(&node);
                self.excluded.remove(&node);
                outputs.retain(|o| !matches!(o, Output::NodeChanged(n) if *n == node));
                outputs.push(Output::DesiredChanged(node.clone()));
                outputs.push(Output::NodeRemoved(node));
            }
            Input::SetQueue(spec) => {
                self.queues.insert(spec.name.clone(), spec);
            }
            Input::SetPoolPolicy { pool, policy } => {
                if let Some(policy) = &policy
                    && policy.stack == StackPolicy::Required
                    && policy.required.is_empty()
                {
                    return Err(ControlError::Invalid(
                        "the required policy needs the versions to require (component=version)"
                            .to_string(),
                    ));
                }
                match policy {
                    Some(policy) => self.pool_policies.insert(pool.clone(), policy),
                    None => self.pool_policies.remove(&pool),
                };
                self.refresh_pool_drift(&pool, &mut outputs);
            }
            Input::HoldBudgets { queues } => {
                if queues != self.budget_held {
                    let changed_queues: BTreeSet<QueueName> = queues
                        .symmetric_difference(&self.budget_held)
                        .cloned()
                        .collect();
                    for job in self.jobs.values() {
                        if job.state == JobState::Pending
                            && changed_queues.contains(&job.spec.queue)
                        {
                            outputs.push(Output::JobChanged(job.id));
                        }
                    }
                    self.budget_held = queues;
                }
            }
        }
        Ok(outputs)
    }

    /// The node's GPUs out of service are `unhealthy`: work on a GPU that
    /// went bad moves elsewhere, as if its node had failed (per the job's
    /// retry policy), and nothing new lands there.
    fn gpu_health(
        &mut self,
        now: Time,
        node: &NodeName,
        epoch: u64,
        mut unhealthy: Vec<u32>,
        outputs: &mut Vec<Output>,
    ) -> Result<(), ControlError> {
        let entry = self
            .nodes
            .get_mut(node)
            .ok_or_else(|| ControlError::NodeNotFound(node.clone()))?;
        check_epoch(entry, epoch)?;
        unhealthy.sort_unstable();
        unhealthy.dedup();
        unhealthy.retain(|&index| (index as usize) < entry.spec.gpus.len());
        if entry.unhealthy_gpus != unhealthy {
            entry.unhealthy_gpus = unhealthy.clone();
            outputs.push(Output::NodeChanged(node.clone()));
            // Work on a GPU that went bad moves elsewhere, as if its
            // node had failed (per the job's retry policy).
            let jobs: BTreeSet<JobId> = self
                .live_allocations(node)
                .filter(|a| {
                    matches!(
                        a.state,
                        AllocationState::Assigned | AllocationState::Running
                    ) && a.gpus.iter().any(|(index, _)| unhealthy.contains(index))
                })
                .map(|a| a.job)
                .collect();
            for job in jobs {
                self.stop_job(
                    now,
                    job,
                    StopCause::NodeLost,
                    &format!("a GPU of node {node} is unhealthy"),
                    outputs,
                );
            }
        }
        Ok(())
    }

    /// Stops running jobs that reached their `max_runtime`: their stop
    /// signal and grace period, then the kill, as for a cancel.
    fn enforce_time_limits(&mut self, now: Time, outputs: &mut Vec<Output>) {
        while let Some(&(due, id)) = self.deadlines.first() {
            if due > now {
                break;
            }
            self.deadlines.pop_first();
            let Some(job) = self.jobs.get(&id) else {
                continue;
            };
            let limit = job.spec.max_runtime.unwrap_or_default();
            if job.state == JobState::Running {
                self.stop_job(
                    now,
                    id,
                    StopCause::TimeLimit,
                    &format!("time limit reached ({} s)", limit.as_secs_f64()),
                    outputs,
                );
            }
        }
    }

    /// Takes finished jobs older than the retention out of the hot state,
    /// with their allocations.
    fn retire(&mut self, now: Time, outputs: &mut Vec<Output>) {
        let horizon = now.0.saturating_sub(self.config.retention_ms);
        while let Some(&(finished, id)) = self.finished.first() {
            if finished.0 > horizon {
                break;
            }
            self.finished.pop_first();
            self.jobs.remove(&id);
            for allocation in self.by_job.remove(&id).unwrap_or_default() {
                // A finished job's allocations hold nothing (invariant).
                self.allocations.remove(&allocation);
            }
            self.last_reasons.remove(&id);
            self.memory_limited.remove(&id);
            self.attained.remove(&id);
            outputs.push(Output::JobRetired(id));
        }
    }

    fn cancel(
        &mut self,
        now: Time,
        id: JobId,
        outputs: &mut Vec<Output>,
    ) -> Result<(), ControlError> {
        let job = self
            .jobs
            .get_mut(&id)
            .ok_or(ControlError::JobNotFound(id))?;
        match job.state {
            JobState::Pending => {
                self.cancel_pending(now, id, "cancelled".to_string(), outputs);
                self.release_dependents(now, id, outputs);
            }
            JobState::Running | JobState::Stopping => {
                self.stop_job(now, id, StopCause::Cancel, "cancel requested", outputs);
            }
            _ => {}
        }
        Ok(())
    }

    /// Tells the nodes to stop a job's tasks; the job ends (or is
    /// re-queued) once all have exited.
    fn stop_job(
        &mut self,
        now: Time,
        id: JobId,
        cause: StopCause,
        why: &str,
        outputs: &mut Vec<Output>,
    ) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        if job.state.is_final() {
            return;
        }
        // A cancel overrides other causes; otherwise the first cause stays.
        if job.stop_cause.is_none() || cause == StopCause::Cancel {
            job.stop_cause = Some(cause);
        }
        let was = job.state;
        job.state = JobState::Stopping;
        self.admission_counts
            .changed(&job.user, &job.spec, Some(was), Some(job.state));
        job.history.push((now, format!("stopping: {why}")));
        changed(outputs, Output::JobChanged(id));
        for allocation_id in job.allocations.clone() {
            if let Some(allocation) = self.allocations.get_mut(&allocation_id)
                && matches!(
                    allocation.state,
                    AllocationState::Assigned | AllocationState::Running
                )
            {
                // Stopping holds resources as Assigned and Running do: the
                // per-node index is unchanged.
                allocation.state = AllocationState::Stopping;
                changed(outputs, Output::DesiredChanged(allocation.node.clone()));
            }
        }
        self.settle(now, id, outputs);
    }

    /// Finishes a stopping or running job whose allocations have all ended.
    fn settle(&mut self, now: Time, id: JobId, outputs: &mut Vec<Output>) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        if !matches!(job.state, JobState::Running | JobState::Stopping) {
            return;
        }
        let states: Vec<AllocationState> = job
            .allocations
            .iter()
            .filter_map(|a| self.allocations.get(a).map(|a| a.state))
            .collect();
        if states.iter().any(|s| s.holds_resources()) {
            return;
        }
        let codes: Vec<Option<i32>> = states
            .iter()
            .map(|s| match s {
                AllocationState::Exited { code } => *code,
                _ => None,
            })
            .collect();
        let any_lost = states.contains(&AllocationState::Lost);
        let failed_code = codes.iter().flatten().find(|&&c| c != 0).copied();
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        let (state, note) = match job.stop_cause {
            Some(StopCause::Cancel) => (JobState::Cancelled, "cancelled".to_string()),
            Some(StopCause::TimeLimit) => (JobState::TimedOut, "timed out".to_string()),
            Some(StopCause::Idle) => (
                JobState::IdleStopped,
                "stopped: its GPUs were idle".to_string(),
            ),
            Some(StopCause::Preempted) => (JobState::Pending, "preempted; re-queued".to_string()),
            Some(StopCause::NodeLost) if job.spec.retry.on_node_failure => {
                (JobState::Pending, "node lost; re-queued".to_string())
            }
            Some(StopCause::NodeLost) => (JobState::Failed, "failed: node lost".to_string()),
            _ if any_lost && job.spec.retry.on_node_failure => {
                (JobState::Pending, "node lost; re-queued".to_string())
            }
            _ if failed_code.is_some() || any_lost || codes.iter().any(Option::is_none) => {
                // The rank that failed first on its own, else the first
                // failing code in rank order.
                let (first_rank, code) = match job.first_failure {
                    Some((rank, code)) => (Some(rank), code),
                    None => (
                        None,
                        failed_code.or(codes.iter().flatten().copied().find(|&c| c != 0)),
                    ),
                };
                let rank_note = first_rank
                    .filter(|_| job.spec.nodes > 1)
                    .map_or(String::new(), |rank| format!(" (rank {rank})"));
                job.exit_code = code;
                if job.spec.retry.on_exit_failure && job.attempts < job.spec.retry.max_attempts {
                    (
                        JobState::Pending,
                        match code {
                            Some(code) => format!("failed (exit code {code}{rank_note}); retrying"),
                            None => format!("failed (killed by a signal{rank_note}); retrying"),
                        },
                    )
                } else {
                    (
                        JobState::Failed,
                        match code {
                            _ if self.memory_limited.contains(&id) => {
                                format!("failed: killed by the memory limit{rank_note}")
                            }
                            Some(code) => format!("failed: exit code {code}{rank_note}"),
                            None => format!("failed: killed by a signal{rank_note}"),
                        },
                    )
                }
            }
            _ => {
                job.exit_code = Some(0);
                (JobState::Succeeded, "succeeded".to_string())
            }
        };
        // The attempt's GPU time counts towards the job's service level.
        if let Some(started) = job.started {
            *self.attained.entry(id).or_default() +=
                job_gpus(job) * now.millis_since(started) as f64 / 1000.0;
        }
        let was = job.state;
        job.state = state;
        self.admission_counts
            .changed(&job.user, &job.spec, Some(was), Some(state));
        job.stop_cause = None;
        job.history.push((now, note));
        self.memory_limited.remove(&id);
        // The attempt ended: its time limit goes with it (the index holds
        // running work only, not history).
        if let Some(due) = deadline_of(job) {
            self.deadlines.remove(&(due, id));
        }
        if state == JobState::Pending {
            job.allocations.clear();
            job.first_failure = None;
        } else {
            self.ended(now, id, outputs);
            return;
        }
        changed(outputs, Output::JobChanged(id));
    }

    /// What follows once job `id` reached a final state: it is timed and
    /// indexed for retirement, its per-job memory goes, its queue learns its
    /// run time, and its dependents are released.
    fn ended(&mut self, now: Time, id: JobId, outputs: &mut Vec<Output>) {
        let Some(job) = self.jobs.get_mut(&id) else {
            return;
        };
        job.finished = Some(now);
        self.finished.insert((now, id));
        self.last_reasons.remove(&id);
        self.attained.remove(&id);
        self.forecasts.remove(&id);
        learn_runtime(&mut self.runtimes, job);
        changed(outputs, Output::JobChanged(id));
        self.release_dependents(now, id, outputs);
    }

    /// Whether a heartbeat of `node` at `epoch` numbered `sequence` is newer
    /// than every one applied for that epoch (an error for an unknown node
    /// or another epoch, as the heartbeat itself would give).
    pub fn newer_heartbeat(
        &self,
        node: &NodeName,
        epoch: u64,
        sequence: u64,
    ) -> Result<bool, ControlError> {
        let entry = self
            .nodes
            .get(node)
            .ok_or_else(|| ControlError::NodeNotFound(node.clone()))?;
        check_epoch(entry, epoch)?;
        if sequence == 0 {
            return Ok(true);
        }
        let last = self.heartbeat_sequences.get(node).copied().unwrap_or(0);
        Ok(sequence > last)
    }

    fn heartbeat(
        &mut self,
        now: Time,
        name: &NodeName,
        epoch: u64,
        observed: Option<&[Observed]>,
        outputs: &mut Vec<Output>,
    ) -> Result<(), ControlError> {
        let node = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| ControlError::NodeNotFound(name.clone()))?;
        check_epoch(node, epoch)?;
        node.last_heartbeat = now;
        if node.state == NodeState::Lost {
            node.state = NodeState::Ready;
            changed(outputs, Output::NodeChanged(name.clone()));
        }
        let Some(observed) = observed else {
            return Ok(());
        };
        let reported: BTreeMap<AllocationId, &Observed> =
            observed.iter().map(|o| (o.allocation, o)).collect();
        let mut touched = BTreeSet::new();
        let mut fenced_jobs = BTreeSet::new();
        let mut vanished_jobs = BTreeSet::new();
        let mut memory_limited = Vec::new();
        let live = self.live_ids(name);
        // An exit reported for a task of this node that no longer holds
        // resources: one the node was declared lost with before the exit
        // reached a server (its lease ran out first).
        let late: Vec<(AllocationId, u64, Option<i32>)> = observed
            .iter()
            .filter(|o| !o.fenced && live.binary_search(&o.allocation).is_err())
            .filter_map(|o| o.exited.map(|code| (o.allocation, o.generation, code)))
            .collect();
        // Only allocations holding resources change on a report: what has
        // exited stays so, and what was lost only by the rule below.
        for id in live {
            let Some(allocation) = self.allocations.get(&id) else {
                continue;
            };
            let (job, rank, state, generation) = (
                allocation.job,
                allocation.rank,
                allocation.state,
                allocation.generation,
            );
            match reported.get(&id) {
                // Reports carrying an older generation are stale: dropped.
                Some(report) if report.generation != generation => {}
                Some(report) if report.fenced && report.exited.is_some() => {
                    self.set_allocation_state(id, AllocationState::Lost);
                    fenced_jobs.insert(job);
                    changed(outputs, Output::DesiredChanged(name.clone()));
                }
                Some(report) => match (state, report.exited) {
                    (AllocationState::Assigned, None) => {
                        self.set_allocation_state(id, AllocationState::Running);
                        touched.insert(job);
                    }
                    (_, Some(code)) => {
                        // The first rank to fail on its own while the job
                        // runs (not one muster stopped) decides its outcome.
                        if code != Some(0)
                            && state != AllocationState::Stopping
                            && let Some(entry) = self.jobs.get_mut(&job)
                            && entry.state == JobState::Running
                            && entry.first_failure.is_none()
                        {
                            entry.first_failure = Some((rank, code));
                        }
                        self.set_allocation_state(id, AllocationState::Exited { code });
                        touched.insert(job);
                        if report.memory_limit {
                            memory_limited.push((job, rank));
                        }
                        changed(outputs, Output::DesiredChanged(name.clone()));
                    }
                    _ => {}
                },
                // Running here before, not reported now: the agent lost
                // track of it (it restarted and found no record). Without
                // evidence of how it ended it is lost, as on a lost node:
                // the job is re-queued per its retry policy, never taken
                // as failed or succeeded.
                None if matches!(state, AllocationState::Running | AllocationState::Stopping) => {
                    self.set_allocation_state(id, AllocationState::Lost);
                    vanished_jobs.insert(job);
                    changed(outputs, Output::DesiredChanged(name.clone()));
                }
                None => {}
            }
        }
        for (job, rank) in memory_limited {
            if let Some(job) = self.jobs.get_mut(&job) {
                job.history.push((
                    now,
                    format!("rank {rank} on {name} killed by its memory limit"),
                ));
                self.memory_limited.insert(job.id);
            }
        }
        for job in fenced_jobs {
            self.stop_job(
                now,
                job,
                StopCause::NodeLost,
                &format!(
                    "node {name} fenced its task (lease not renewed) or lost it (no exit record)"
                ),
                outputs,
            );
        }
        for job in vanished_jobs {
            self.stop_job(
                now,
                job,
                StopCause::NodeLost,
                &format!("node {name} no longer reports a task of it (lost)"),
                outputs,
            );
        }
        for job in touched {
            self.after_task_change(now, job, outputs);
        }
        for (id, generation, code) in late {
            self.late_exit(now, name, id, generation, code, outputs);
        }
        Ok(())
    }

    /// A task that ended on its own, reported only after its node was
    /// declared lost (the exit reached no server in time). If its job was
    /// re-queued for that loss and has not started again, the job is
    /// settled as its last attempt ended, never run again: succeeded once
    /// every rank of that attempt is known to have exited 0, failed (or
    /// retried, per its policy for failures) once every rank is known to
    /// have exited and one did not with 0. Otherwise (a rank muster stopped,
    /// or still unknown) it stays re-queued.
    fn late_exit(
        &mut self,
        now: Time,
        node: &NodeName,
        id: AllocationId,
        generation: u64,
        code: Option<i32>,
        outputs: &mut Vec<Output>,
    ) {
        let Some(allocation) = self.allocations.get(&id) else {
            return;
        };
        if allocation.state != AllocationState::Lost
            || allocation.generation != generation
            || allocation.node != *node
        {
            return;
        }
        let (job_id, assigned) = (allocation.job, allocation.assigned);
        let Some(job) = self.jobs.get(&job_id) else {
            return;
        };
        if job.state != JobState::Pending || !job.allocations.is_empty() {
            return;
        }
        // The ranks of the job's last attempt (assigned together), which
        // this allocation must be one of.
        let all = self.by_job.get(&job_id).map_or(&[][..], Vec::as_slice);
        let assigned_of = |a: &AllocationId| self.allocations.get(a).map(|a| a.assigned);
        if all.iter().any(|a| assigned_of(a) > Some(assigned)) {
            return;
        }
        let attempt: Vec<AllocationId> = all
            .iter()
            .filter(|a| assigned_of(a) == Some(assigned))
            .copied()
            .collect();
        self.set_allocation_state(id, AllocationState::Exited { code });
        changed(outputs, Output::JobChanged(job_id));
        let codes: Option<Vec<i32>> = attempt
            .iter()
            .map(|a| match self.allocations.get(a).map(|a| a.state) {
                Some(AllocationState::Exited { code }) => code,
                _ => None,
            })
            .collect();
        let Some(codes) = codes else {
            return;
        };
        let failed = codes.iter().find(|&&c| c != 0).copied();
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return;
        };
        let (state, note) = match failed {
            None => (
                JobState::Succeeded,
                format!("succeeded (its exit was reported after node {node} was declared lost)"),
            ),
            Some(code)
                if job.spec.retry.on_exit_failure && job.attempts < job.spec.retry.max_attempts =>
            {
                job.exit_code = Some(code);
                job.history.push((
                    now,
                    format!(
                        "failed (exit code {code}, reported after node {node} was declared \
                         lost); retrying"
                    ),
                ));
                return;
            }
            Some(code) => (
                JobState::Failed,
                format!("failed: exit code {code} (reported after node {node} was declared lost)"),
            ),
        };
        job.exit_code = Some(failed.unwrap_or(0));
        job.state = state;
        self.admission_counts
            .changed(&job.user, &job.spec, Some(JobState::Pending), Some(state));
        job.history.push((now, note));
        job.pending_reason = None;
        job.queue_position = None;
        self.ended(now, job_id, outputs);
    }

    fn after_task_change(&mut self, now: Time, id: JobId, outputs: &mut Vec<Output>) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        changed(outputs, Output::JobChanged(id));
        let failed = job.allocations.iter().any(|a| {
            self.allocations.get(a).is_some_and(
                |a| matches!(a.state, AllocationState::Exited { code } if code != Some(0)),
            )
        });
        if job.state == JobState::Running && failed {
            self.stop_job(now, id, StopCause::TaskFailed, "a task failed", outputs);
        } else {
            self.settle(now, id, outputs);
        }
    }

    /// Adds each queue's held GPUs since the last tick to its decayed usage.
    fn account_usage(&mut self, now: Time) {
        if self.usage.updated == Time(0) {
            self.usage.updated = now;
            return;
        }
        let mut held: BTreeMap<QueueName, u64> = BTreeMap::new();
        let live = self
            .live_by_node
            .values()
            .flatten()
            .filter_map(|id| self.allocations.get(id));
        for allocation in live {
            if let Some(job) = self.jobs.get(&allocation.job) {
                let milli: u64 = allocation.gpus.iter().map(|g| u64::from(g.1)).sum();
                *held.entry(job.spec.queue.clone()).or_default() += milli;
            }
        }
        self.usage.advance(now, &held);
    }

    fn expire_leases(&mut self, now: Time, outputs: &mut Vec<Output>) {
        let expired: Vec<NodeName> = self
            .nodes
            .values()
            .filter(|n| {
                n.state == NodeState::Ready
                    && now.millis_since(n.last_heartbeat) > self.config.lease_ms
            })
            .map(|n| n.spec.name.clone())
            .collect();
        for name in expired {
            if let Some(node) = self.nodes.get_mut(&name) {
                node.state = NodeState::Lost;
            }
            changed(outputs, Output::NodeChanged(name.clone()));
            self.lose_work(
                now,
                &name,
                |_| true,
                StopCause::NodeLost,
                &format!("node {name} lost"),
                outputs,
            );
        }
    }

    fn node_inputs(&self) -> Vec<NodeInput> {
        self.nodes
            .values()
            .map(|node| NodeInput {
                containers: node.software.runs_containers(),
                reserved: self.is_inference_pool(&node.spec.pool),
                spec: node.spec.clone(),
                cordoned: node.cordoned || node.drift.is_some() || node.pending_approval,
                healthy: node.state == NodeState::Ready,
                unhealthy_gpus: node.unhealthy_gpus.clone(),
            })
            .collect()
    }

    /// A snapshot and the pending jobs, for one scheduling cycle.
    pub fn scheduling_input(&self, now: Time) -> (Snapshot, Vec<PendingJob>) {
        let mut running = Vec::new();
        // Elements of arrays with a limit that hold resources, per array:
        // an array at its limit offers no element this cycle, one below it
        // only as many as it has room for (lowest ids first).
        let mut array_active: BTreeMap<JobId, u32> = BTreeMap::new();
        // The nodes each service's replicas hold (new replicas keep off them).
        let mut service_nodes: BTreeMap<&str, Vec<NodeName>> = BTreeMap::new();
        for job in self.jobs.values() {
            if !matches!(job.state, JobState::Running | JobState::Stopping) {
                continue;
            }
            let tasks: Vec<SchedAllocation> = job
                .allocations
                .iter()
                .filter_map(|a| self.allocations.get(a))
                .filter(|a| a.state.holds_resources())
                .map(|a| SchedAllocation {
                    node: a.node.clone(),
                    gpus: a.gpus.clone(),
                    cpu: a.cpu,
                    memory: a.memory,
                })
                .collect();
            if tasks.is_empty() {
                continue;
            }
            let stopping = job.state == JobState::Stopping;
            if let Some(service) = &job.spec.service {
                service_nodes
                    .entry(service.name.as_str())
                    .or_default()
                    .extend(tasks.iter().map(|task| task.node.clone()));
            }
            if let Some(array) = job.array.filter(|array| array.limit.is_some()) {
                *array_active.entry(array.array).or_insert(0) += 1;
            }
            running.push(RunningJob {
                id: job.id,
                queue: job.spec.queue.clone(),
                priority: self.config.service_levels.running_priority(
                    job.spec.priority_class.value,
                    self.attained_gpu_s(job, now),
                    job.spec.checkpoint.interval.is_some(),
                ),
                started: job.started.unwrap_or(job.submitted),
                tasks,
                expected_end: if stopping {
                    Some(now)
                } else {
                    let started = job.started.unwrap_or(now);
                    self.estimated_remaining_ms(job, now.millis_since(started), Estimate::Mean)
                        .map(|remaining| now.plus_millis(remaining))
                },
                preemptible: job.spec.preemptible && !stopping,
                checkpoint_interval_ms: job.spec.checkpoint.interval.map(|d| d.as_millis() as u64),
                service: job.spec.service.is_some(),
            });
        }
        // Sized once: growing a vector of 100,000 jobs by doubling touches
        // (and faults in) twice the memory.
        let pending_jobs = self
            .jobs
            .values()
            .filter(|job| job.state == JobState::Pending)
            .count();
        let mut pending = Vec::with_capacity(pending_jobs);
        let mut held = |job: &&Job| {
            if job.state != JobState::Pending
                || self.is_waiting(job)
                || self.budget_held.contains(&job.spec.queue)
            {
                return false;
            }
            match job.array {
                Some(muster_model::ArrayElement {
                    array,
                    limit: Some(limit),
                    ..
                }) => {
                    let active = array_active.entry(array).or_insert(0);
                    if *active >= limit {
                        return false;
                    }
                    *active += 1;
                    true
                }
                _ => true,
            }
        };
        pending.extend(
            self.jobs
                .values()
                .filter(|job| held(job))
                .map(|job| PendingJob {
                    id: job.id,
                    queue: job.spec.queue.clone(),
                    priority: self.engine_priority(job, now),
                    submitted: job.submitted,
                    tasks: job.spec.nodes,
                    request: TaskRequest::of(&job.spec),
                    same_rack: job.spec.topology.map(|t| t.same_rack),
                    estimated_runtime_ms: self.estimated_remaining_ms(job, 0, Estimate::Mean),
                    apart: job
                        .spec
                        .service
                        .as_ref()
                        .map(|service| muster_sched::Apart {
                            group: service.name.clone(),
                            nodes: service_nodes
                                .get(service.name.as_str())
                                .cloned()
                                .unwrap_or_default(),
                            racks: service.spread == muster_model::Spread::Racks,
                            required: service.port.is_some(),
                        }),
                }),
        );
        let snapshot = Snapshot {
            now,
            nodes: self.node_inputs(),
            running,
            queues: self.queues.values().cloned().collect(),
            usage: self.usage.gpu_seconds.clone(),
            workload: None,
        };
        (snapshot, pending)
    }

    /// GPU-seconds `job` has had: its ended attempts' and, while it runs,
    /// the current one's.
    pub fn attained_gpu_s(&self, job: &Job, now: Time) -> f64 {
        let ended = self.attained.get(&job.id).copied().unwrap_or(0.0);
        let running = match (job.state, job.started) {
            (JobState::Running | JobState::Stopping, Some(started)) => {
                job_gpus(job) * now.millis_since(started) as f64 / 1000.0
            }
            _ => 0.0,
        };
        ended + running
    }

    /// The engine's priority of pending `job`: its class, less a level for
    /// each threshold of GPU time it has passed
    /// ([`ControlConfig::service_levels`]; a running job's is
    /// [`muster_sched::ServiceLevels::running_priority`]).
    pub fn engine_priority(&self, job: &Job, now: Time) -> i32 {
        self.config
            .service_levels
            .priority(job.spec.priority_class.value, self.attained_gpu_s(job, now))
    }

    /// How much longer `job` is expected to run, having run `elapsed_ms` of
    /// its current attempt: what its spec says (`estimated_runtime`), else
    /// what its queue's finished jobs say (no more than its `max_runtime`),
    /// else its `max_runtime`; `None` when none of them is known.
    pub fn estimated_remaining_ms(
        &self,
        job: &Job,
        elapsed_ms: u64,
        estimate: Estimate,
    ) -> Option<u64> {
        let max = job.spec.max_runtime.map(|d| d.as_millis() as u64);
        if let Some(given) = job.spec.estimated_runtime {
            return Some((given.as_millis() as u64).saturating_sub(elapsed_ms));
        }
        let learned = self
            .runtimes
            .get(&job.spec.queue)
            .and_then(|history| match estimate {
                Estimate::Mean => history.expected_remaining_ms(elapsed_ms),
                Estimate::Forecast => history.forecast_remaining_ms(elapsed_ms),
            });
        let left_by_max = max.map(|max| max.saturating_sub(elapsed_ms));
        match (learned, left_by_max) {
            (Some(learned), Some(left)) => Some(learned.min(left)),
            (learned, left) => learned.or(left),
        }
    }

    /// The scheduling input with start forecasts' estimates: running jobs
    /// end, and pending ones run, as the typical job of their queue does
    /// ([`muster_sched::runtime::FORECAST_QUANTILE`]), where the spec gives
    /// no estimate.
    pub fn forecast_input(
        &self,
        snapshot: Snapshot,
        pending: Vec<PendingJob>,
    ) -> (Snapshot, Vec<PendingJob>) {
        let now = snapshot.now;
        let mut ahead = snapshot;
        for running in &mut ahead.running {
            let Some(job) = self.jobs.get(&running.id) else {
                continue;
            };
            if job.state == JobState::Stopping {
                continue;
            }
            let elapsed = now.millis_since(job.started.unwrap_or(now));
            running.expected_end = self
                .estimated_remaining_ms(job, elapsed, Estimate::Forecast)
                .map(|remaining| now.plus_millis(remaining));
        }
        let mut waiting = pending;
        for pending in &mut waiting {
            if let Some(job) = self.jobs.get(&pending.id) {
                pending.estimated_runtime_ms =
                    self.estimated_remaining_ms(job, 0, Estimate::Forecast);
            }
        }
        (ahead, waiting)
    }

    /// Replaces the start forecasts (those of jobs no longer pending are
    /// dropped).
    pub fn set_forecasts(&mut self, forecasts: BTreeMap<JobId, muster_sched::StartForecast>) {
        self.forecasts = forecasts;
        let jobs = &self.jobs;
        self.forecasts.retain(|id, _| {
            jobs.get(id)
                .is_some_and(|job| job.state == JobState::Pending)
        });
    }

    /// A pending job's latest start forecast.
    pub fn start_forecast(&self, id: JobId) -> Option<muster_sched::StartForecast> {
        self.forecasts.get(&id).copied()
    }

    /// Free GPU thousandths per (node, GPU), CPU and memory per node, as the
    /// allocations holding resources leave them now.
    fn free_now(&self) -> FreeResources {
        // Only nodes that can take work now: ready and not cordoned.
        let mut free: FreeResources = self
            .nodes
            .values()
            .filter(|n| {
                n.state == NodeState::Ready
                    && !n.cordoned
                    && n.drift.is_none()
                    && !n.pending_approval
            })
            .map(|n| {
                (
                    n.spec.name.clone(),
                    FreeNode {
                        gpus: vec![1000; n.spec.gpus.len()],
                        cpu: n.spec.cpu.0,
                        memory: n.spec.memory.0,
                        unhealthy: n.unhealthy_gpus.clone(),
                        address: n.address.clone(),
                    },
                )
            })
            .collect();
        for (name, ids) in &self.live_by_node {
            let Some(node) = free.get_mut(name) else {
                continue;
            };
            for allocation in ids.iter().filter_map(|id| self.allocations.get(id)) {
                for &(index, milli) in &allocation.gpus {
                    if let Some(slot) = node.gpus.get_mut(index as usize) {
                        *slot = slot.saturating_sub(u32::from(milli));
                    }
                }
                node.cpu = node.cpu.saturating_sub(allocation.cpu.0);
                node.memory = node.memory.saturating_sub(allocation.memory.0);
            }
        }
        free
    }

    /// Applies a cycle's decisions that still hold: a start whose job is
    /// still pending and whose nodes are ready, uncordoned and still have the
    /// room; a preemption whose victim still runs. A start that needs
    /// preemptions waits for its victims to exit (next cycles place it).
    pub fn apply_outcome(&mut self, now: Time, outcome: &Outcome) -> Vec<Output> {
        let mut outputs = self.apply_outcome_inner(now, outcome);
        dedup_outputs(&mut outputs);
        self.debug_check();
        outputs
    }

    fn apply_outcome_inner(&mut self, now: Time, outcome: &Outcome) -> Vec<Output> {
        // A start notes its job and each task's node; a pending job, itself.
        let mut outputs =
            Vec::with_capacity(outcome.started.len() * 2 + outcome.pending.len() + 16);
        // Nodes the engine could not take, with why (shown to operators).
        let excluded: BTreeMap<NodeName, String> = outcome
            .excluded_nodes
            .iter()
            .filter(|(name, _)| self.nodes.contains_key(name))
            .cloned()
            .collect();
        for (name, reason) in &excluded {
            if self.excluded.get(name) != Some(reason) {
                changed(&mut outputs, Output::NodeChanged(name.clone()));
            }
        }
        self.excluded = excluded;
        for preemption in &outcome.preemptions {
            let still_running = self
                .jobs
                .get(&preemption.victim)
                .is_some_and(|j| j.state == JobState::Running);
            if still_running {
                self.stop_job(
                    now,
                    preemption.victim,
                    StopCause::Preempted,
                    &format!("preempted for job {}", preemption.for_job),
                    &mut outputs,
                );
            }
        }
        // Free resources as they are now, computed once and kept up to date
        // as starts are applied.
        let mut free = self.free_now();
        for start in &outcome.started {
            if !start.after_preempting.is_empty() {
                continue;
            }
            let pending = self
                .jobs
                .get(&start.job)
                .is_some_and(|j| j.state == JobState::Pending);
            if !pending {
                continue;
            }
            let Some(master) = Self::take_if_fits(&mut free, &start.tasks) else {
                continue;
            };
            self.start_job(now, start.job, &start.tasks, master, &mut outputs);
        }
        // Every job the cycle considered either started or is pending: a
        // pending job's place in line counts the pending ones before it.
        let started: BTreeSet<JobId> = outcome.started.iter().map(|s| s.job).collect();
        let mut positions: Vec<(JobId, u32)> = outcome
            .order
            .iter()
            .filter(|id| !started.contains(id))
            .enumerate()
            .map(|(position, id)| (*id, position as u32 + 1))
            .collect();
        positions.sort_unstable_by_key(|(id, _)| *id);
        // The reasons, places and jobs are each walked once in id order (a
        // million pending jobs cost a walk, not a million searches).
        let mut positions = positions.into_iter().peekable();
        let mut last = std::mem::take(&mut self.last_reasons)
            .into_iter()
            .peekable();
        let mut jobs = self.jobs.iter_mut().peekable();
        let mut kept = Vec::with_capacity(outcome.pending.len());
        for (id, reason) in &outcome.pending {
            let position = next_of(&mut positions, id);
            let previous = next_of(&mut last, id);
            let Some(job) = next_of(&mut jobs, id) else {
                continue;
            };
            if job.state != JobState::Pending {
                continue;
            }
            // The place in line changes whenever the line moves: it is kept
            // in memory only (recomputed every cycle), so that a placement
            // does not rewrite every pending job.
            job.queue_position = position;
            match previous {
                Some(previous) if previous == *reason && job.pending_reason.is_some() => {
                    kept.push((*id, previous));
                }
                _ => {
                    job.pending_reason = Some(reason.to_string());
                    kept.push((*id, reason.clone()));
                    changed(&mut outputs, Output::ReasonChanged(*id));
                }
            }
        }
        drop(jobs);
        self.last_reasons = kept.into_iter().collect();
        outputs
    }

    /// Whether `tasks` (one per node) still fit: nodes ready, uncordoned,
    /// their GPUs healthy and free in `free`; if so, takes them from `free`
    /// and answers the first task's node address (the gang's master).
    fn take_if_fits(free: &mut FreeResources, tasks: &[SchedAllocation]) -> Option<String> {
        // One task per node (a gang has a few: compare them pairwise).
        let distinct = tasks
            .iter()
            .enumerate()
            .all(|(i, task)| tasks[..i].iter().all(|other| other.node != task.node));
        let fits = distinct
            && tasks.iter().all(|task| {
                let Some(node) = free.get(&task.node) else {
                    return false; // gone, not ready or cordoned
                };
                // A GPU may have gone bad since the snapshot.
                !task
                    .gpus
                    .iter()
                    .any(|(index, _)| node.unhealthy.contains(index))
                    && task.gpus.iter().all(|&(index, milli)| {
                        node.gpus
                            .get(index as usize)
                            .is_some_and(|slot| *slot >= u32::from(milli))
                    })
                    && node.cpu >= task.cpu.0
                    && node.memory >= task.memory.0
            });
        if !fits {
            return None;
        }
        let mut master = None;
        for task in tasks {
            if let Some(node) = free.get_mut(&task.node) {
                for &(index, milli) in &task.gpus {
                    if let Some(slot) = node.gpus.get_mut(index as usize) {
                        *slot -= u32::from(milli);
                    }
                }
                node.cpu -= task.cpu.0;
                node.memory -= task.memory.0;
                master.get_or_insert_with(|| node.address.clone());
            }
        }
        Some(master.unwrap_or_else(|| "127.0.0.1".to_string()))
    }

    /// Job `job`'s `MUSTER_MASTER_PORT` (a gang's rendezvous; a dev
    /// environment's session helper; a service replica's `PORT` unless the
    /// service fixes one).
    pub fn master_port(&self, job: JobId) -> u16 {
        master_port(self.config.master_port_base, job)
    }

    /// The port a service replica serves on: the service's fixed port, or
    /// the one muster gives it in `PORT` (its job's `MUSTER_MASTER_PORT`).
    pub fn replica_port(&self, job: &Job) -> Option<u16> {
        let service = job.spec.service.as_ref()?;
        Some(service.port.unwrap_or_else(|| self.master_port(job.id)))
    }

    fn start_job(
        &mut self,
        now: Time,
        id: JobId,
        tasks: &[SchedAllocation],
        master: String,
        outputs: &mut Vec<Output>,
    ) {
        let Some(job) = self.jobs.get(&id) else {
            return;
        };
        let port = self.master_port(id).to_string();
        let nnodes = tasks.len().to_string();
        let gpus_per_node = job.spec.gpus_per_node.gpu_count().max(1).to_string();
        let job_id = id.0.to_string();
        let mut created = Vec::with_capacity(tasks.len());
        for (rank, task) in tasks.iter().enumerate() {
            let rank_text = rank.to_string();
            let contract = [
                ("MUSTER_JOB_ID", &job_id),
                ("MUSTER_NODE_RANK", &rank_text),
                ("MUSTER_NNODES", &nnodes),
                ("MUSTER_MASTER_ADDR", &master),
                ("MUSTER_MASTER_PORT", &port),
                ("PET_NNODES", &nnodes),
                ("PET_NODE_RANK", &rank_text),
                ("PET_MASTER_ADDR", &master),
                ("PET_MASTER_PORT", &port),
                ("PET_NPROC_PER_NODE", &gpus_per_node),
            ];
            // Built in one go from the entries (the contract's last, so it
            // wins over a job variable of the same name), not one insert at
            // a time: this runs once per task started.
            let mut entries: Vec<(String, String)> =
                Vec::with_capacity(job.spec.env.len() + contract.len());
            entries.extend(
                job.spec
                    .env
                    .iter()
                    .map(|(key, value)| (key.clone(), value.clone())),
            );
            entries.extend(
                contract
                    .iter()
                    .map(|(key, value)| ((*key).to_string(), (*value).clone())),
            );
            if let Some(array) = job.array {
                entries.extend([
                    ("MUSTER_ARRAY_JOB_ID".to_string(), array.array.0.to_string()),
                    ("MUSTER_ARRAY_INDEX".to_string(), array.index.to_string()),
                    ("MUSTER_ARRAY_COUNT".to_string(), array.count.to_string()),
                ]);
            }
            if job.spec.slurm_env {
                entries.extend(slurm_variables(job, rank, tasks));
            }
            if let Some(service) = &job.spec.service {
                let serve = service.port.map_or_else(|| port.clone(), |p| p.to_string());
                entries.extend([
                    ("PORT".to_string(), serve.clone()),
                    ("MUSTER_SERVICE_PORT".to_string(), serve),
                    ("MUSTER_SERVICE".to_string(), service.name.clone()),
                    (
                        "MUSTER_SERVICE_REVISION".to_string(),
                        service.revision.to_string(),
                    ),
                ]);
            }
            let env: BTreeMap<String, String> = entries.into_iter().collect();
            let allocation = Allocation {
                id: AllocationId(self.next_allocation),
                job: id,
                rank: rank as u32,
                node: task.node.clone(),
                gpus: task.gpus.clone(),
                cpu: task.cpu,
                memory: task.memory,
                generation: self.next_generation,
                state: AllocationState::Assigned,
                env,
                assigned: now,
            };
            self.next_allocation += 1;
            self.next_generation += 1;
            changed(outputs, Output::DesiredChanged(task.node.clone()));
            created.push(allocation.id);
            match self.live_by_node.get_mut(&allocation.node) {
                Some(live) => {
                    live.insert(allocation.id);
                }
                None => {
                    self.live_by_node
                        .insert(allocation.node.clone(), BTreeSet::from([allocation.id]));
                }
            }
            self.by_job.entry(id).or_default().push(allocation.id);
            self.allocations.insert(allocation.id, allocation);
        }
        if let Some(job) = self.jobs.get_mut(&id) {
            let was = job.state;
            job.state = JobState::Running;
            self.admission_counts
                .changed(&job.user, &job.spec, Some(was), Some(job.state));
            job.attempts += 1;
            job.started = Some(now);
            if let Some(due) = deadline_of(job) {
                self.deadlines.insert((due, id));
            }
            job.allocations = created;
            job.pending_reason = None;
            job.queue_position = None;
            let mut line = String::from("started on ");
            for (position, task) in tasks.iter().enumerate() {
                if position > 0 {
                    line.push_str(", ");
                }
                line.push_str(&task.node.0);
            }
            job.history.push((now, line));
            changed(outputs, Output::JobChanged(id));
        }
    }

    /// What `node` must run and stop now.
    pub fn desired(&self, node: &NodeName) -> Vec<DesiredTask> {
        self.live_allocations(node)
            .filter_map(|a| {
                let job = self.jobs.get(&a.job)?;
                Some(DesiredTask {
                    allocation: a.id,
                    generation: a.generation,
                    job: a.job,
                    rank: a.rank,
                    command: job.spec.command.clone(),
                    env: a.env.clone(),
                    working_dir: job.spec.working_dir.clone(),
                    gpus: a.gpus.iter().map(|g| g.0).collect(),
                    stop_signal: job.spec.checkpoint.signal,
                    grace_period_ms: job.spec.checkpoint.grace_period.as_millis() as u64,
                    stop: a.state == AllocationState::Stopping,
                    user: job.user.clone(),
                    memory_mib: job.spec.memory_per_node.0,
                    image: job.spec.image.clone(),
                    cpu_milli: job.spec.cpu_per_node.0,
                    mounts: job
                        .spec
                        .mounts
                        .iter()
                        .map(|m| (m.source.clone(), m.target.clone(), m.read_only))
                        .collect(),
                })
            })
            .collect()
    }

    /// Recomputes derived state from scratch and checks every invariant.
    pub fn check_invariants(&self) -> Result<(), String> {
        if self.admission_counts != AdmissionCounts::of(&self.jobs) {
            return Err(format!(
                "the admission counts {:?} are not those of the jobs {:?}",
                self.admission_counts,
                AdmissionCounts::of(&self.jobs)
            ));
        }
        // No array runs more elements at once than its limit.
        let mut active: BTreeMap<JobId, u32> = BTreeMap::new();
        for job in self.jobs.values() {
            if let Some(array) = job.array {
                if job.id.0 < array.array.0 || job.id.0 >= array.array.0 + u64::from(array.count) {
                    return Err(format!(
                        "job {} is outside its array {} of {} elements",
                        job.id, array.array, array.count
                    ));
                }
                if let Some(limit) = array.limit
                    && matches!(job.state, JobState::Running | JobState::Stopping)
                {
                    let count = active.entry(array.array).or_insert(0);
                    *count += 1;
                    if *count > limit {
                        return Err(format!(
                            "array {} runs more than its limit of {limit} elements",
                            array.array
                        ));
                    }
                }
            }
        }
        let mut used: BTreeMap<(&NodeName, u32), u32> = BTreeMap::new();
        let mut cpu: BTreeMap<&NodeName, u64> = BTreeMap::new();
        let mut memory: BTreeMap<&NodeName, u64> = BTreeMap::new();
        for allocation in self.allocations.values() {
            let job = self
                .jobs
                .get(&allocation.job)
                .ok_or_else(|| format!("allocation {} of unknown job", allocation.id))?;
            if !allocation.state.holds_resources() {
                continue;
            }
            if job.state.is_final() || job.state == JobState::Pending {
                return Err(format!(
                    "allocation {} holds resources for {} job {}",
                    allocation.id,
                    job.state.name(),
                    job.id
                ));
            }
            if !job.allocations.contains(&allocation.id) {
                return Err(format!(
                    "allocation {} is not in job {}'s current attempt",
                    allocation.id, job.id
                ));
            }
            let node = self
                .nodes
                .get(&allocation.node)
                .ok_or_else(|| format!("allocation {} on unknown node", allocation.id))?;
            if node.pending_approval {
                return Err(format!(
                    "allocation {} is on node {}, which waits for approval",
                    allocation.id, allocation.node
                ));
            }
            if matches!(
                allocation.state,
                AllocationState::Assigned | AllocationState::Running
            ) && allocation
                .gpus
                .iter()
                .any(|(index, _)| node.unhealthy_gpus.contains(index))
            {
                return Err(format!(
                    "allocation {} runs on an unhealthy GPU of {}",
                    allocation.id, allocation.node
                ));
            }
            for &(index, milli) in &allocation.gpus {
                if index as usize >= node.spec.gpus.len() {
                    return Err(format!("allocation {} uses a missing GPU", allocation.id));
                }
                let total = used.entry((&allocation.node, index)).or_default();
                *total += u32::from(milli);
                if *total > 1000 {
                    return Err(format!(
                        "GPU {index} of {} is in allocations summing to {total} thousandths",
                        allocation.node
                    ));
                }
            }
            let c = cpu.entry(&allocation.node).or_default();
            *c += allocation.cpu.0;
            let m = memory.entry(&allocation.node).or_default();
            *m += allocation.memory.0;
            if *c > node.spec.cpu.0 || *m > node.spec.memory.0 {
                return Err(format!("{} is over its CPU or memory", allocation.node));
            }
        }
        let mut generations = BTreeSet::new();
        for allocation in self.allocations.values() {
            if !generations.insert(allocation.generation) {
                return Err(format!("generation {} issued twice", allocation.generation));
            }
            if allocation.generation >= self.next_generation {
                return Err("a generation at or above the next one".to_string());
            }
        }
        let mut live: BTreeMap<NodeName, BTreeSet<AllocationId>> = BTreeMap::new();
        let mut by_job: BTreeMap<JobId, Vec<AllocationId>> = BTreeMap::new();
        for allocation in self.allocations.values() {
            if allocation.id.0 >= self.next_allocation {
                return Err(format!(
                    "allocation {} at or above the next id",
                    allocation.id
                ));
            }
            if allocation.state.holds_resources() {
                live.entry(allocation.node.clone())
                    .or_default()
                    .insert(allocation.id);
            }
            by_job
                .entry(allocation.job)
                .or_default()
                .push(allocation.id);
        }
        if live != self.live_by_node {
            return Err("the per-node index of live allocations is out of date".to_string());
        }
        let mut indexed = self.by_job.clone();
        for list in indexed.values_mut() {
            list.sort_unstable();
        }
        if by_job != indexed {
            return Err("the per-job index of allocations is out of date".to_string());
        }
        let finished: BTreeSet<(Time, JobId)> = self
            .jobs
            .values()
            .filter(|job| job.state.is_final())
            .map(|job| (job.finished.unwrap_or(Time(0)), job.id))
            .collect();
        if finished != self.finished {
            return Err("the index of finished jobs is out of date".to_string());
        }
        // Every running job with a time limit is indexed; an entry is only
        // ever for a running or stopping job's current attempt (a stopping
        // job's entry may already be spent).
        let running: BTreeSet<(Time, JobId)> = self
            .jobs
            .values()
            .filter(|job| job.state == JobState::Running)
            .filter_map(|job| Some((deadline_of(job)?, job.id)))
            .collect();
        let stale = self.deadlines.iter().any(|&(due, id)| {
            !self.jobs.get(&id).is_some_and(|job| {
                matches!(job.state, JobState::Running | JobState::Stopping)
                    && deadline_of(job) == Some(due)
            })
        });
        if !running.is_subset(&self.deadlines) || stale {
            return Err("the index of time limits is out of date".to_string());
        }
        if self.waiting != self.waiting_from_jobs() {
            return Err("the index of dependencies is out of date".to_string());
        }
        {
            let pools: BTreeSet<&muster_model::PoolName> =
                self.nodes.values().map(|n| &n.spec.pool).collect();
            for pool in pools {
                let drift = self.drift_of_pool(pool);
                for node in self.nodes.values().filter(|n| &n.spec.pool == pool) {
                    if node.drift.as_ref() != drift.get(&node.spec.name) {
                        return Err(format!(
                            "node {}'s stack drift is out of date",
                            node.spec.name
                        ));
                    }
                }
            }
        }
        if self.node_shapes != self.node_shapes_from_nodes() {
            return Err("the index of node shapes is out of date".to_string());
        }
        for node in self.nodes.values() {
            if node.epoch >= self.next_epoch {
                return Err(format!(
                    "node {} has epoch {}, at or above the next one",
                    node.spec.name, node.epoch
                ));
            }
        }
        for job in self.jobs.values() {
            if job.state.is_final() && job.finished.is_none() {
                return Err(format!(
                    "job {} is {} with no end time",
                    job.id,
                    job.state.name()
                ));
            }
            for id in &job.allocations {
                if !self.allocations.contains_key(id) {
                    return Err(format!("job {} names a missing allocation {id}", job.id));
                }
            }
            if job.state == JobState::Running {
                let live = job
                    .allocations
                    .iter()
                    .filter(|a| {
                        self.allocations
                            .get(a)
                            .is_some_and(|a| a.state.holds_resources())
                    })
                    .count();
                if live == 0 {
                    return Err(format!("job {} is running with no live allocation", job.id));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Jobs' ports stay within the range the base starts, which must be
    /// unprivileged and fit below 65,536; a base the configuration would
    /// refuse still gives ports that exist.
    #[test]
    fn master_ports_stay_in_their_range() {
        assert_eq!(master_port(DEFAULT_MASTER_PORT_BASE, JobId(1)), 29_501);
        assert_eq!(master_port(10_000, JobId(20_003)), 10_003);
        let last = JobId(u64::from(MASTER_PORTS) - 1);
        assert_eq!(master_port(MAX_MASTER_PORT_BASE, last), u16::MAX - 1);
        assert_eq!(master_port(u16::MAX, last), u16::MAX - 1);
        assert!(check_master_port_base(MIN_MASTER_PORT_BASE).is_ok());
        assert!(check_master_port_base(MAX_MASTER_PORT_BASE).is_ok());
        for refused in [
            0,
            MIN_MASTER_PORT_BASE - 1,
            MAX_MASTER_PORT_BASE + 1,
            u16::MAX,
        ] {
            let error = check_master_port_base(refused).expect_err("refused");
            assert!(error.contains("1024..=45535"), "{error}");
        }
    }

    fn ended(queue: &str, seconds: u64) -> Job {
        Job {
            id: JobId(1),
            spec: JobSpec::simple(
                "job",
                queue,
                muster_model::GpuRequest::Whole(1),
                vec!["x".into()],
            ),
            user: "alice".into(),
            submitted: Time(0),
            state: JobState::Succeeded,
            stop_cause: None,
            attempts: 1,
            exit_code: Some(0),
            first_failure: None,
            started: Some(Time(0)),
            finished: Some(Time::from_secs(seconds)),
            allocations: Vec::new(),
            history: Vec::new(),
            pending_reason: None,
            queue_position: None,
            array: None,
        }
    }

    /// Any queue name may be submitted to: the run-time histories stay
    /// bounded, and the queue that taught the least makes room.
    #[test]
    fn run_time_histories_are_bounded_by_queue_count() {
        let mut runtimes = BTreeMap::new();
        for _ in 0..3 {
            learn_runtime(&mut runtimes, &ended("busy", 100));
        }
        for n in 0..MAX_RUNTIME_HISTORIES + 10 {
            learn_runtime(&mut runtimes, &ended(&format!("q{n}"), 100));
        }
        assert_eq!(runtimes.len(), MAX_RUNTIME_HISTORIES);
        assert!(runtimes.contains_key(&QueueName::from("busy")));
        assert!(runtimes.contains_key(&QueueName::from(
            format!("q{}", MAX_RUNTIME_HISTORIES + 9).as_str()
        )));
        // A cancelled job teaches nothing.
        let mut cancelled = ended("other", 5);
        cancelled.state = JobState::Cancelled;
        learn_runtime(&mut runtimes, &cancelled);
        assert!(!runtimes.contains_key(&QueueName::from("other")));
    }
}
