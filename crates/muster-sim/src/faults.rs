//! Deterministic fault injection: one control plane (with its durable store)
//! and N node agents over a simulated network, driven by a discrete-event
//! loop from a seed.
//!
//! The control plane is the real [`ControlPlane`], scheduled by the real
//! [`muster_sched::schedule`]; the agents decide with the real
//! [`muster_node::reconcile`] and [`muster_node::must_fence`]. Everything
//! else (network, processes, crashes, the store) is modelled here, from one
//! [`ChaCha8Rng`]: the same seed gives the same run and the same event-log
//! hash.
//!
//! Faults: message loss, duplication, random latency (so reordering),
//! partitions of one node from the server, agent crashes (the agent forgets,
//! its tasks keep running), host crashes (the tasks die too), server crashes
//! (a restart rebuilds from the store, giving every node a fresh lease).
//! After every event the run checks the control plane's invariants, that
//! every acknowledged job is known, that no GPU runs two tasks, and that no
//! job ever runs two attempts at once (the ground truth of fencing). At the
//! end everything heals, and every job must have succeeded with nothing left
//! running.

use muster_control::{
    Allocation, AllocationId, ControlConfig, ControlError, ControlPlane, DesiredTask, Input, Job,
    JobState, Node, NodeState, Observed, Output, Software,
};
use muster_model::{
    CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, JobSpec, MemoryMib, NodeName, NodeSpec,
    PoolName, RackName, Time,
};
use muster_node::{Action, Desired, Local, must_fence, reconcile};
use muster_sched::{SchedulingPolicy, schedule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::Duration;

/// Heartbeat period of an agent, milliseconds.
const HEARTBEAT_MS: u64 = 1_000;
/// Scheduling cycle period.
const CYCLE_MS: u64 = 200;
/// Lease ticker period.
const TICK_MS: u64 = 1_000;
/// How long the client waits for an acknowledgement before submitting again.
const SUBMIT_RETRY_MS: u64 = 2_000;
/// How many events a failure shows.
const LAST_EVENTS: usize = 30;

/// What a fault-injection run simulates.
#[derive(Debug, Clone, PartialEq)]
pub struct FaultConfig {
    /// Agents (nodes), each with 4 or 8 GPUs.
    pub nodes: usize,
    /// Jobs the client submits (about a third of them 2-node gangs).
    pub jobs: usize,
    /// Faults are injected and jobs submitted during this time; then
    /// everything heals.
    pub duration_ms: u64,
    /// How long after healing every job must have succeeded.
    pub settle_ms: u64,
    /// Probability that a message is lost.
    pub loss: f64,
    /// Probability that a message is delivered twice.
    pub duplicate: f64,
    /// Latency of a message: uniform in 1..=this.
    pub max_delay_ms: u64,
    /// Mean time between two injected faults.
    pub mean_fault_gap_ms: u64,
    pub partitions: bool,
    pub agent_crashes: bool,
    pub host_crashes: bool,
    pub server_crashes: bool,
    /// GPUs turn unhealthy for a while (the agent reports it in its next
    /// heartbeat; the server moves the work off them and places none there).
    pub gpu_failures: bool,
    /// Agents fence themselves when they cannot renew their lease. Off only
    /// to prove that the checker catches a job running twice.
    pub fencing: bool,
    /// Agents also fence while (re-)registering, from a last renewal kept on
    /// disk across agent restarts, as `muster-agent` does. Off: the bug this
    /// simulation found in an earlier agent, whose register loop did not.
    pub fence_while_registering: bool,
    /// Each task runs a watchdog that kills it once the lease deadline its
    /// agent last wrote has passed (as `muster-agent`'s task shell does).
    /// Off only to show what the agent's own fencing must then catch.
    pub task_watchdog: bool,
    pub lease_ms: u64,
    pub fence_margin_ms: u64,
}

impl Default for FaultConfig {
    fn default() -> Self {
        FaultConfig {
            nodes: 4,
            jobs: 12,
            duration_ms: 60_000,
            settle_ms: 240_000,
            loss: 0.05,
            duplicate: 0.03,
            max_delay_ms: 400,
            mean_fault_gap_ms: 6_000,
            partitions: true,
            agent_crashes: true,
            host_crashes: true,
            server_crashes: true,
            gpu_failures: true,
            fencing: true,
            fence_while_registering: true,
            task_watchdog: true,
            lease_ms: 10_000,
            fence_margin_ms: 3_000,
        }
    }
}

/// What a passing run observed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FaultReport {
    pub seed: u64,
    /// FNV-1a 64 of the event log's text.
    pub hash: u64,
    pub events: u64,
    /// When the last job ended, simulated milliseconds.
    pub finished_ms: u64,
    pub jobs_succeeded: usize,
    /// Attempts started over all jobs (a job re-queued runs again).
    pub attempts: u64,
    pub partitions: u64,
    pub agent_crashes: u64,
    pub host_crashes: u64,
    pub server_crashes: u64,
    /// Times a GPU turned unhealthy.
    pub gpu_failures: u64,
    /// Times the server found a node lost (its lease expired).
    pub nodes_lost: u64,
    /// Jobs re-placed after their node was lost.
    pub requeues: u64,
    /// Times an agent fenced itself.
    pub fences: u64,
    /// From a node's fault (partition or crash) to the server finding it lost.
    pub detection_ms: Vec<u64>,
    /// From a node's fault to its job's next attempt being placed.
    pub requeue_ms: Vec<u64>,
}

/// A run that broke a property: replay it with the same seed and config.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("seed {seed}: {message} (at {at_ms} ms); last events:\n{}", last_events.join("\n"))]
pub struct FaultFailure {
    pub seed: u64,
    pub message: String,
    pub at_ms: u64,
    pub last_events: Vec<String>,
}

/// Runs one seed.
pub fn run_faults(seed: u64, config: &FaultConfig) -> Result<FaultReport, FaultFailure> {
    World::new(seed, config).run()
}

/// FNV-1a, 64 bits: stable across platforms and Rust versions.
#[derive(Debug, Clone, Copy)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

#[derive(Debug, Clone)]
enum Request {
    Register {
        epoch: u64,
        spec: NodeSpec,
    },
    Heartbeat {
        epoch: u64,
        observed: Vec<Observed>,
        unhealthy: Vec<u32>,
    },
}

#[derive(Debug, Clone)]
enum Reply {
    Registered,
    Desired(Vec<DesiredTask>),
    /// The server refused the heartbeat (an unknown node or an old epoch).
    Reregister,
}

#[derive(Debug, Clone)]
enum Event {
    Submit {
        job: usize,
    },
    SubmitArrives {
        job: usize,
    },
    SubmitAck {
        job: usize,
    },
    Cycle,
    Tick,
    HeartbeatDue {
        node: usize,
        incarnation: u64,
    },
    HeartbeatTimeout {
        node: usize,
        incarnation: u64,
        seq: u64,
    },
    ToServer {
        node: usize,
        incarnation: u64,
        seq: u64,
        request: Request,
    },
    ToAgent {
        node: usize,
        incarnation: u64,
        seq: u64,
        reply: Reply,
    },
    TaskExit {
        process: u64,
        code: Option<i32>,
    },
    Fault,
    PartitionEnd {
        node: usize,
    },
    AgentRestart {
        node: usize,
    },
    ServerRestart,
    GpuHealed {
        node: usize,
    },
    Heal,
}

/// The durable copy, written as `muster-server` writes it: per output, the
/// job with all its allocations, the node, the counters.
#[derive(Debug, Clone, Default)]
struct Store {
    jobs: BTreeMap<JobId, Job>,
    allocations: BTreeMap<AllocationId, Allocation>,
    nodes: BTreeMap<NodeName, Node>,
    next_allocation: u64,
    next_generation: u64,
}

impl Store {
    fn persist(&mut self, control: &ControlPlane, outputs: &[Output]) {
        let mut jobs_changed = false;
        for output in outputs {
            match output {
                Output::JobChanged(id) => {
                    if let Some(job) = control.jobs.get(id) {
                        self.jobs.insert(*id, job.clone());
                        jobs_changed = true;
                    }
                    for allocation in control.allocations.values().filter(|a| a.job == *id) {
                        self.allocations.insert(allocation.id, allocation.clone());
                    }
                }
                Output::NodeChanged(name) => {
                    if let Some(node) = control.nodes.get(name) {
                        self.nodes.insert(name.clone(), node.clone());
                    }
                }
                Output::DesiredChanged(_) => {}
            }
        }
        if jobs_changed {
            self.next_allocation = control.next_allocation;
            self.next_generation = control.next_generation;
        }
    }

    fn restore(&self, config: ControlConfig, now: Time) -> ControlPlane {
        let mut control = ControlPlane::new(config);
        for (name, node) in &self.nodes {
            let mut node = node.clone();
            node.last_heartbeat = now;
            control.nodes.insert(name.clone(), node);
        }
        control.jobs = self.jobs.clone();
        control.next_allocation = self.next_allocation.max(1);
        control.next_generation = self.next_generation.max(1);
        for (id, allocation) in &self.allocations {
            control.next_allocation = control.next_allocation.max(id.0 + 1);
            control.next_generation = control.next_generation.max(allocation.generation + 1);
            control.allocations.insert(*id, allocation.clone());
        }
        control
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LocalTask {
    /// Its job, as the real agent keeps it in the task's name.
    job: Option<u64>,
    running: bool,
    stopping: bool,
    /// Exit code once exited (`None`: killed by a signal, or gone).
    exit: Option<i32>,
}

/// What the node's disk knows about a task (the runtime's pid files).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    Running(u64),
    Exited(Option<i32>),
    /// The host restarted under it.
    Gone,
}

#[derive(Debug, Clone)]
struct Agent {
    spec: NodeSpec,
    up: bool,
    /// Bumped at every crash: messages and timers of an older incarnation
    /// are dropped.
    incarnation: u64,
    epoch: u64,
    registered: bool,
    next_seq: u64,
    in_flight: Option<(u64, u64)>,
    last_renewal: u64,
    /// Kept on disk: survives agent restarts.
    last_renewal_on_disk: u64,
    desired: Vec<DesiredTask>,
    tasks: BTreeMap<(u64, u64), LocalTask>,
    records: BTreeMap<(u64, u64), Record>,
    partitioned: bool,
    fenced: bool,
    /// GPU indices the node's health checks report out of service.
    unhealthy: Vec<u32>,
    /// When the fault that cut this node off began.
    fault_since: Option<u64>,
}

#[derive(Debug, Clone)]
struct Process {
    node: usize,
    allocation: u64,
    generation: u64,
    job: JobId,
    attempt: u32,
    rank: u32,
    gpus: Vec<u32>,
    started: u64,
    stopping: bool,
}

#[derive(Debug, Clone)]
struct WorkJob {
    spec: JobSpec,
    submit_at: u64,
    run_ms: u64,
}

struct World<'a> {
    seed: u64,
    config: &'a FaultConfig,
    rng: ChaCha8Rng,
    now: u64,
    next_event: u64,
    queue: BinaryHeap<Reverse<(u64, u64)>>,
    pending_events: BTreeMap<u64, Event>,
    hash: Fnv,
    recent: VecDeque<String>,
    server_up: bool,
    control: ControlPlane,
    store: Store,
    agents: Vec<Agent>,
    processes: BTreeMap<u64, Process>,
    next_process: u64,
    workload: Vec<WorkJob>,
    acknowledged: BTreeSet<usize>,
    /// Allocation id → the job's attempt it belongs to.
    attempt_of: BTreeMap<u64, u32>,
    /// Jobs whose node was lost, with when the fault began.
    lost_jobs: BTreeMap<JobId, u64>,
    healed: bool,
    report: FaultReport,
}

fn node_spec(index: usize, gpus: u32) -> NodeSpec {
    let name = format!("node-{index}");
    NodeSpec {
        name: NodeName::from(name.as_str()),
        pool: PoolName::from("default"),
        rack: RackName::from(format!("r{}", index / 4).as_str()),
        gpus: (0..gpus)
            .map(|i| GpuSpec {
                index: i,
                uuid: format!("GPU-{name}-{i}"),
                model: GpuModel::new("H100-80GB"),
                memory: MemoryMib(80 * 1024),
                nvlink_domain: 0,
            })
            .collect(),
        cpu: CpuMilli(64_000),
        memory: MemoryMib(512 * 1024),
    }
}

impl<'a> World<'a> {
    fn new(seed: u64, config: &'a FaultConfig) -> Self {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let agents = (0..config.nodes)
            .map(|i| {
                let gpus = if rng.random_bool(0.5) { 8 } else { 4 };
                Agent {
                    spec: node_spec(i, gpus),
                    up: true,
                    incarnation: 0,
                    epoch: 1,
                    registered: false,
                    next_seq: 0,
                    in_flight: None,
                    last_renewal: 0,
                    last_renewal_on_disk: 0,
                    desired: Vec::new(),
                    tasks: BTreeMap::new(),
                    records: BTreeMap::new(),
                    partitioned: false,
                    fenced: false,
                    unhealthy: Vec::new(),
                    fault_since: None,
                }
            })
            .collect();
        let workload = (0..config.jobs)
            .map(|i| {
                let gang = config.nodes >= 2 && rng.random_bool(0.35);
                let gpus = if gang {
                    [2, 4][rng.random_range(0..2)]
                } else {
                    [1, 2, 4][rng.random_range(0..3)]
                };
                let mut spec = JobSpec::simple(
                    &format!("job-{i}"),
                    "default",
                    GpuRequest::Whole(gpus),
                    vec!["train".to_string()],
                );
                spec.nodes = if gang { 2 } else { 1 };
                spec.preemptible = false;
                spec.checkpoint.grace_period = Duration::from_millis(1_000);
                // A fenced task exits non-zero; the job must still finish.
                spec.retry.on_exit_failure = true;
                spec.retry.max_attempts = 1_000;
                WorkJob {
                    spec,
                    submit_at: rng.random_range(0..config.duration_ms.max(1) * 4 / 5 + 1),
                    run_ms: rng.random_range(3_000..30_000),
                }
            })
            .collect();
        let control_config = ControlConfig {
            lease_ms: config.lease_ms,
            ..ControlConfig::default()
        };
        World {
            seed,
            config,
            rng,
            now: 0,
            next_event: 0,
            queue: BinaryHeap::new(),
            pending_events: BTreeMap::new(),
            hash: Fnv::new(),
            recent: VecDeque::new(),
            server_up: true,
            control: ControlPlane::new(control_config),
            store: Store::default(),
            agents,
            processes: BTreeMap::new(),
            next_process: 1,
            workload,
            acknowledged: BTreeSet::new(),
            attempt_of: BTreeMap::new(),
            lost_jobs: BTreeMap::new(),
            healed: false,
            report: FaultReport {
                seed,
                ..FaultReport::default()
            },
        }
    }

    fn at(&mut self, time: u64, event: Event) {
        let id = self.next_event;
        self.next_event += 1;
        self.queue.push(Reverse((time, id)));
        self.pending_events.insert(id, event);
    }

    fn log(&mut self, text: String) {
        let line = format!("{:>8} {text}", self.now);
        self.hash.write(line.as_bytes());
        self.hash.write(b"\n");
        if self.recent.len() == LAST_EVENTS {
            self.recent.pop_front();
        }
        self.recent.push_back(line);
    }

    fn fail(&self, message: String) -> FaultFailure {
        FaultFailure {
            seed: self.seed,
            message,
            at_ms: self.now,
            last_events: self.recent.iter().cloned().collect(),
        }
    }

    fn run(mut self) -> Result<FaultReport, FaultFailure> {
        for node in 0..self.agents.len() {
            let start = self.rng.random_range(0..HEARTBEAT_MS);
            self.at(
                start,
                Event::HeartbeatDue {
                    node,
                    incarnation: 0,
                },
            );
        }
        for job in 0..self.workload.len() {
            let at = self.workload[job].submit_at;
            self.at(at, Event::Submit { job });
        }
        self.at(CYCLE_MS, Event::Cycle);
        self.at(TICK_MS, Event::Tick);
        let first_fault = self.fault_gap();
        self.at(first_fault, Event::Fault);
        self.at(self.config.duration_ms, Event::Heal);
        let deadline = self.config.duration_ms + self.config.settle_ms;
        while let Some(Reverse((time, id))) = self.queue.pop() {
            let Some(event) = self.pending_events.remove(&id) else {
                continue;
            };
            if time > deadline {
                return Err(self.fail(self.unfinished()));
            }
            self.now = time;
            self.report.events += 1;
            self.apply(event)?;
            self.watchdog();
            self.check()?;
            if self.healed && self.finished() {
                return self.conclude();
            }
        }
        Err(self.fail("the event queue ran dry".to_string()))
    }

    fn fault_gap(&mut self) -> u64 {
        let mean = self.config.mean_fault_gap_ms.max(2);
        self.rng.random_range(mean / 2..mean * 3 / 2)
    }

    fn delay(&mut self) -> u64 {
        self.rng.random_range(1..=self.config.max_delay_ms.max(1))
    }

    /// Sends over the network: lost, delayed, maybe duplicated.
    fn send(&mut self, what: &str, event: Event) {
        if !self.healed && self.rng.random_bool(self.config.loss.clamp(0.0, 1.0)) {
            self.log(format!("net lost {what}"));
            return;
        }
        let copies = if !self.healed && self.rng.random_bool(self.config.duplicate.clamp(0.0, 1.0))
        {
            self.log(format!("net duplicated {what}"));
            2
        } else {
            1
        };
        for _ in 0..copies {
            let at = self.now + self.delay();
            self.at(at, event.clone());
        }
    }

    fn apply(&mut self, event: Event) -> Result<(), FaultFailure> {
        match event {
            Event::Submit { job } => {
                if self.acknowledged.contains(&job) {
                    return Ok(());
                }
                self.log(format!("client submits job {}", job + 1));
                self.send(&format!("submit {}", job + 1), Event::SubmitArrives { job });
                self.at(self.now + SUBMIT_RETRY_MS, Event::Submit { job });
            }
            Event::SubmitArrives { job } => {
                if !self.server_up {
                    self.log(format!("server down: submit {} dropped", job + 1));
                    return Ok(());
                }
                let input = Input::Submit {
                    id: JobId(job as u64 + 1),
                    spec: self.workload[job].spec.clone(),
                    user: "alice".to_string(),
                };
                match self.server_step(input) {
                    Ok(_) => self.log(format!("server accepts job {}", job + 1)),
                    Err(ControlError::Conflict(_)) => {
                        self.log(format!("server already has job {}", job + 1))
                    }
                    Err(error) => return Err(self.fail(format!("submit refused: {error}"))),
                }
                self.send(&format!("ack {}", job + 1), Event::SubmitAck { job });
            }
            Event::SubmitAck { job } => {
                if self.acknowledged.insert(job) {
                    self.log(format!("client: job {} acknowledged", job + 1));
                }
            }
            Event::Cycle => {
                self.cycle()?;
                self.at(self.now + CYCLE_MS, Event::Cycle);
            }
            Event::Tick => {
                self.tick();
                self.at(self.now + TICK_MS, Event::Tick);
            }
            Event::HeartbeatDue { node, incarnation } => self.heartbeat_due(node, incarnation),
            Event::HeartbeatTimeout {
                node,
                incarnation,
                seq,
            } => self.heartbeat_timeout(node, incarnation, seq),
            Event::ToServer {
                node,
                incarnation,
                seq,
                request,
            } => self.server_receives(node, incarnation, seq, request)?,
            Event::ToAgent {
                node,
                incarnation,
                seq,
                reply,
            } => self.agent_receives(node, incarnation, seq, reply),
            Event::TaskExit { process, code } => self.task_exits(process, code),
            Event::Fault => {
                if !self.healed {
                    self.inject_fault();
                    let next = self.now + self.fault_gap();
                    self.at(next, Event::Fault);
                }
            }
            Event::PartitionEnd { node } => {
                if self.agents[node].partitioned {
                    self.agents[node].partitioned = false;
                    self.log(format!("partition of node-{node} heals"));
                }
            }
            Event::AgentRestart { node } => self.agent_restart(node),
            Event::ServerRestart => self.server_restart(),
            Event::GpuHealed { node } => {
                self.agents[node].unhealthy.clear();
                self.log(format!("node-{node} GPUs healthy again"));
            }
            Event::Heal => {
                self.healed = true;
                self.log("heal: no more faults".to_string());
                for node in 0..self.agents.len() {
                    self.agents[node].partitioned = false;
                    self.agents[node].unhealthy.clear();
                    if !self.agents[node].up {
                        self.agent_restart(node);
                    }
                }
                if !self.server_up {
                    self.server_restart();
                }
            }
        }
        Ok(())
    }

    fn server_step(&mut self, input: Input) -> Result<Vec<Output>, ControlError> {
        let outputs = self.control.handle(Time(self.now), input)?;
        self.store.persist(&self.control, &outputs);
        Ok(outputs)
    }

    fn cycle(&mut self) -> Result<(), FaultFailure> {
        if !self.server_up {
            return Ok(());
        }
        let now = Time(self.now);
        let (snapshot, pending) = self.control.scheduling_input(now);
        if pending.is_empty() {
            return Ok(());
        }
        let outcome = schedule(
            &snapshot,
            &pending,
            &SchedulingPolicy::default(),
            &mut self.rng,
        )
        .map_err(|error| self.fail(format!("the scheduler refused the cluster: {error}")))?;
        let before = self.control.next_allocation;
        let outputs = self.control.apply_outcome(now, &outcome);
        self.store.persist(&self.control, &outputs);
        let created: Vec<(u64, JobId, u32, String)> = (before..self.control.next_allocation)
            .filter_map(|id| {
                let allocation = self.control.allocations.get(&AllocationId(id))?;
                let job = self.control.jobs.get(&allocation.job)?;
                Some((id, job.id, job.attempts, allocation.node.0.clone()))
            })
            .collect();
        for (id, job, attempt, node) in created {
            self.attempt_of.insert(id, attempt);
            self.report.attempts += u64::from(job_rank_zero(&self.control, id));
            self.log(format!(
                "server places job {job} attempt {attempt}: allocation {id} on {node}"
            ));
            if let Some(since) = self.lost_jobs.remove(&job) {
                self.report.requeues += 1;
                self.report.requeue_ms.push(self.now - since);
            }
        }
        Ok(())
    }

    fn tick(&mut self) {
        if !self.server_up {
            return;
        }
        let before: BTreeSet<NodeName> = self
            .control
            .nodes
            .values()
            .filter(|n| n.state == NodeState::Lost)
            .map(|n| n.spec.name.clone())
            .collect();
        let live: BTreeMap<AllocationId, (NodeName, JobId)> = self
            .control
            .allocations
            .values()
            .filter(|a| a.state.holds_resources())
            .map(|a| (a.id, (a.node.clone(), a.job)))
            .collect();
        if let Err(error) = self.server_step(Input::Tick) {
            self.log(format!("tick refused: {error}"));
            return;
        }
        let newly_lost: Vec<usize> = (0..self.agents.len())
            .filter(|&i| {
                let name = &self.agents[i].spec.name;
                !before.contains(name)
                    && self
                        .control
                        .nodes
                        .get(name)
                        .is_some_and(|n| n.state == NodeState::Lost)
            })
            .collect();
        for node in newly_lost {
            let name = self.agents[node].spec.name.clone();
            let since = self.agents[node].fault_since.unwrap_or(self.now);
            self.report.nodes_lost += 1;
            self.report.detection_ms.push(self.now - since);
            self.log(format!("server: lease of {name} expired; node lost"));
            for (_, (on, job)) in live.iter().filter(|(_, (on, _))| *on == name) {
                let _ = on;
                self.lost_jobs.entry(*job).or_insert(since);
            }
        }
    }

    fn heartbeat_due(&mut self, node: usize, incarnation: u64) {
        let agent = &self.agents[node];
        if !agent.up || agent.incarnation != incarnation || agent.in_flight.is_some() {
            return;
        }
        // As muster-agent: before (re-)registering, fence the tasks that
        // would outlive the lease.
        if !agent.registered
            && self.config.fencing
            && self.config.fence_while_registering
            && must_fence(
                self.now,
                agent.last_renewal,
                self.config.lease_ms,
                self.config.fence_margin_ms,
            )
            && agent.tasks.values().any(|t| t.running && !t.stopping)
        {
            self.reconcile(node, true);
        }
        let agent = &self.agents[node];
        let seq = agent.next_seq;
        let (request, what, limit) = if agent.registered {
            let observed: Vec<Observed> = agent
                .tasks
                .iter()
                .map(|(&(allocation, generation), task)| Observed {
                    allocation: AllocationId(allocation),
                    generation,
                    exited: if task.running { None } else { Some(task.exit) },
                    // The simulated jobs retry on a non-zero exit instead.
                    fenced: false,
                })
                .collect();
            // As muster-agent: give up on an answer once the lease could
            // have run out (less the margin).
            let margin = self.config.fence_margin_ms;
            let remaining = (agent.last_renewal + self.config.lease_ms)
                .saturating_sub(margin)
                .saturating_sub(self.now);
            let limit = if remaining == 0 { 5_000 } else { remaining };
            let what = format!("heartbeat {seq} of node-{node} ({} tasks)", observed.len());
            (
                Request::Heartbeat {
                    epoch: agent.epoch,
                    observed,
                    unhealthy: agent.unhealthy.clone(),
                },
                what,
                limit,
            )
        } else {
            (
                Request::Register {
                    epoch: agent.epoch,
                    spec: agent.spec.clone(),
                },
                format!("register {seq} of node-{node} epoch {}", agent.epoch),
                {
                    let remaining = (agent.last_renewal + self.config.lease_ms)
                        .saturating_sub(self.config.fence_margin_ms)
                        .saturating_sub(self.now);
                    if remaining == 0 {
                        2_000
                    } else {
                        remaining.min(2_000)
                    }
                },
            )
        };
        let agent = &mut self.agents[node];
        agent.next_seq += 1;
        agent.in_flight = Some((seq, self.now));
        let partitioned = agent.partitioned;
        self.log(format!("node-{node} sends {what}"));
        self.at(
            self.now + limit,
            Event::HeartbeatTimeout {
                node,
                incarnation,
                seq,
            },
        );
        if partitioned {
            self.log(format!("net: node-{node} partitioned, {what} dropped"));
            return;
        }
        self.send(
            &what,
            Event::ToServer {
                node,
                incarnation,
                seq,
                request,
            },
        );
    }

    fn server_receives(
        &mut self,
        node: usize,
        incarnation: u64,
        seq: u64,
        request: Request,
    ) -> Result<(), FaultFailure> {
        if !self.server_up {
            self.log(format!("server down: request {seq} of node-{node} dropped"));
            return Ok(());
        }
        if self.agents[node].partitioned {
            self.log(format!(
                "net: node-{node} partitioned, request {seq} dropped"
            ));
            return Ok(());
        }
        let name = self.agents[node].spec.name.clone();
        let reply = match request {
            Request::Register { epoch, spec } => {
                let input = Input::Register {
                    spec,
                    address: format!("10.0.0.{}", node + 1),
                    epoch,
                    software: Software::default(),
                };
                match self.server_step(input) {
                    Ok(_) => {
                        self.log(format!("server registers {name} epoch {epoch}"));
                        Reply::Registered
                    }
                    Err(error) => return Err(self.fail(format!("register refused: {error}"))),
                }
            }
            Request::Heartbeat {
                epoch,
                observed,
                unhealthy,
            } => {
                // As muster-server does: a changed health report first.
                let known = self
                    .control
                    .nodes
                    .get(&name)
                    .map(|n| n.unhealthy_gpus.clone());
                if known.is_some_and(|known| known != unhealthy) {
                    let health = Input::GpuHealth {
                        node: name.clone(),
                        epoch,
                        unhealthy: unhealthy.clone(),
                    };
                    if self.server_step(health).is_ok() {
                        self.log(format!(
                            "server learns {name} GPUs {unhealthy:?} are unhealthy"
                        ));
                    }
                }
                let input = Input::Heartbeat {
                    node: name.clone(),
                    epoch,
                    sequence: seq + 1,
                    observed,
                };
                match self.server_step(input) {
                    Ok(_) => {
                        let desired = self.control.desired(&name);
                        self.log(format!(
                            "server renews {name} (heartbeat {seq}); desired {}",
                            describe(&desired)
                        ));
                        Reply::Desired(desired)
                    }
                    Err(error) => {
                        self.log(format!("server refuses heartbeat {seq} of {name}: {error}"));
                        Reply::Reregister
                    }
                }
            }
        };
        self.send(
            &format!("reply {seq} to node-{node}"),
            Event::ToAgent {
                node,
                incarnation,
                seq,
                reply,
            },
        );
        Ok(())
    }

    fn agent_receives(&mut self, node: usize, incarnation: u64, seq: u64, reply: Reply) {
        let agent = &self.agents[node];
        if agent.partitioned {
            self.log(format!("net: node-{node} partitioned, reply {seq} dropped"));
            return;
        }
        let Some((in_flight, sent)) = agent.in_flight else {
            return;
        };
        if !agent.up || agent.incarnation != incarnation || in_flight != seq {
            return;
        }
        let agent = &mut self.agents[node];
        agent.in_flight = None;
        match reply {
            Reply::Registered => {
                agent.registered = true;
                agent.last_renewal = self.now;
                agent.last_renewal_on_disk = self.now;
                self.log(format!("node-{node} registered"));
                self.at(self.now + 1, Event::HeartbeatDue { node, incarnation });
            }
            Reply::Desired(desired) => {
                agent.last_renewal = sent;
                agent.last_renewal_on_disk = sent;
                agent.fault_since = None;
                agent.desired = desired;
                self.log(format!("node-{node} renewed its lease (sent at {sent})"));
                self.reconcile(node, false);
                self.at(
                    self.now + HEARTBEAT_MS,
                    Event::HeartbeatDue { node, incarnation },
                );
            }
            Reply::Reregister => {
                agent.registered = false;
                self.log(format!("node-{node} must register again"));
                self.at(self.now + 1, Event::HeartbeatDue { node, incarnation });
            }
        }
    }

    fn heartbeat_timeout(&mut self, node: usize, incarnation: u64, seq: u64) {
        let agent = &self.agents[node];
        if !agent.up
            || agent.incarnation != incarnation
            || agent.in_flight.map(|f| f.0) != Some(seq)
        {
            return;
        }
        let registered = agent.registered;
        let fence_now = self.config.fencing
            && (registered || self.config.fence_while_registering)
            && must_fence(
                self.now,
                agent.last_renewal,
                self.config.lease_ms,
                self.config.fence_margin_ms,
            );
        self.agents[node].in_flight = None;
        self.log(format!("node-{node}: no answer to {seq}"));
        if registered || fence_now {
            self.reconcile(node, fence_now);
        }
        let wait = if registered { 250 } else { 1_000 };
        self.at(self.now + wait, Event::HeartbeatDue { node, incarnation });
    }

    /// The agent's `apply`: reconcile, carry the actions out, forget what
    /// is done.
    fn reconcile(&mut self, node: usize, fenced: bool) {
        let agent = &self.agents[node];
        if fenced && !agent.fenced {
            self.report.fences += 1;
            self.log(format!("node-{node} fences itself: stopping every task"));
        }
        self.agents[node].fenced = fenced;
        let agent = &self.agents[node];
        let wanted: Vec<Desired> = agent
            .desired
            .iter()
            .map(|d| Desired {
                allocation: d.allocation.0,
                generation: d.generation,
                job: d.job.0,
                stop: d.stop,
            })
            .collect();
        let local: Vec<Local> = agent
            .tasks
            .iter()
            .map(|(&(allocation, generation), task)| Local {
                allocation,
                generation,
                job: task.job,
                running: task.running,
                stopping: task.stopping,
            })
            .collect();
        for action in reconcile(&wanted, &local, fenced) {
            match action {
                Action::Start {
                    allocation,
                    generation,
                } => self.start(node, allocation, generation),
                Action::Stop {
                    allocation,
                    generation,
                } => self.stop(node, allocation, generation),
            }
        }
        let agent = &mut self.agents[node];
        let listed: BTreeSet<(u64, u64)> = agent
            .desired
            .iter()
            .map(|d| (d.allocation.0, d.generation))
            .collect();
        let done: Vec<(u64, u64)> = agent
            .tasks
            .iter()
            .filter(|(key, task)| !task.running && !listed.contains(key))
            .map(|(key, _)| *key)
            .collect();
        for key in done {
            agent.tasks.remove(&key);
            agent.records.remove(&key);
        }
    }

    fn start(&mut self, node: usize, allocation: u64, generation: u64) {
        let Some(task) = self.agents[node]
            .desired
            .iter()
            .find(|d| d.allocation.0 == allocation && d.generation == generation)
            .cloned()
        else {
            return;
        };
        let id = self.next_process;
        self.next_process += 1;
        let attempt = self.attempt_of.get(&allocation).copied().unwrap_or(0);
        let run_ms = self
            .workload
            .get((task.job.0 as usize).wrapping_sub(1))
            .map_or(1_000, |w| w.run_ms);
        self.processes.insert(
            id,
            Process {
                node,
                allocation,
                generation,
                job: task.job,
                attempt,
                rank: task.rank,
                gpus: task.gpus.clone(),
                started: self.now,
                stopping: false,
            },
        );
        let agent = &mut self.agents[node];
        agent
            .records
            .insert((allocation, generation), Record::Running(id));
        agent.tasks.insert(
            (allocation, generation),
            LocalTask {
                job: Some(task.job.0),
                running: true,
                stopping: false,
                exit: None,
            },
        );
        self.log(format!(
            "node-{node} starts job {} attempt {attempt} rank {} (allocation {allocation} generation {generation}, process {id})",
            task.job, task.rank
        ));
        self.at(
            self.now + run_ms,
            Event::TaskExit {
                process: id,
                code: Some(0),
            },
        );
    }

    fn stop(&mut self, node: usize, allocation: u64, generation: u64) {
        let agent = &mut self.agents[node];
        if let Some(task) = agent.tasks.get_mut(&(allocation, generation)) {
            task.stopping = true;
        }
        let Some(Record::Running(id)) = agent.records.get(&(allocation, generation)).copied()
        else {
            return;
        };
        let Some(process) = self.processes.get_mut(&id) else {
            return;
        };
        if process.stopping {
            return;
        }
        process.stopping = true;
        // Tasks here honour the stop signal within their grace (1 s).
        let after = self.rng.random_range(50..=1_000);
        self.log(format!(
            "node-{node} stops allocation {allocation} generation {generation} (process {id})"
        ));
        self.at(
            self.now + after,
            Event::TaskExit {
                process: id,
                code: None,
            },
        );
    }

    /// The watchdog in each task's process group (as `muster-agent` runs
    /// it): once the lease deadline the agent last wrote to disk has passed,
    /// the task kills itself, whether or not its agent is alive.
    fn watchdog(&mut self) {
        if !self.config.fencing || !self.config.task_watchdog {
            return;
        }
        let lease = self.config.lease_ms;
        let half_margin = self.config.fence_margin_ms / 2;
        let expired: Vec<u64> = self
            .processes
            .iter()
            .filter(|(_, process)| {
                let disk = self.agents[process.node].last_renewal_on_disk;
                (disk + lease).saturating_sub(half_margin) < self.now
            })
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            self.log(format!(
                "watchdog: process {id} kills itself (lease deadline passed)"
            ));
            self.task_exits(id, None);
        }
    }

    fn task_exits(&mut self, id: u64, code: Option<i32>) {
        let Some(process) = self.processes.remove(&id) else {
            return;
        };
        let key = (process.allocation, process.generation);
        self.log(format!(
            "process {id} of job {} attempt {} rank {} on node-{} exits {code:?} (ran {} ms)",
            process.job,
            process.attempt,
            process.rank,
            process.node,
            self.now - process.started
        ));
        let agent = &mut self.agents[process.node];
        if agent.records.get(&key) == Some(&Record::Running(id)) {
            agent.records.insert(key, Record::Exited(code));
        }
        if agent.up
            && let Some(task) = agent.tasks.get_mut(&key)
        {
            task.running = false;
            task.exit = code;
        }
    }

    fn inject_fault(&mut self) {
        let mut kinds = Vec::new();
        if self.config.partitions {
            kinds.push(0);
        }
        if self.config.agent_crashes {
            kinds.push(1);
        }
        if self.config.host_crashes {
            kinds.push(2);
        }
        if self.config.server_crashes {
            kinds.push(3);
        }
        if self.config.gpu_failures {
            kinds.push(4);
        }
        if kinds.is_empty() {
            return;
        }
        let kind = kinds[self.rng.random_range(0..kinds.len())];
        let node = self.rng.random_range(0..self.agents.len().max(1));
        match kind {
            0 => {
                if self.agents[node].partitioned {
                    return;
                }
                let heal = self.rng.random_range(2_000..25_000);
                self.agents[node].partitioned = true;
                if self.agents[node].fault_since.is_none() {
                    self.agents[node].fault_since = Some(self.now);
                }
                self.report.partitions += 1;
                self.log(format!("fault: node-{node} partitioned for {heal} ms"));
                self.at(self.now + heal, Event::PartitionEnd { node });
            }
            1 | 2 => {
                if !self.agents[node].up {
                    return;
                }
                let host = kind == 2;
                // A supervisor restarts a crashed agent promptly; a host
                // takes longer to come back.
                let back = if host {
                    self.rng.random_range(1_000..20_000)
                } else {
                    self.rng.random_range(500..4_000)
                };
                let agent = &mut self.agents[node];
                agent.up = false;
                agent.incarnation += 1;
                agent.registered = false;
                agent.in_flight = None;
                agent.tasks.clear();
                agent.desired.clear();
                agent.fenced = false;
                if agent.fault_since.is_none() {
                    agent.fault_since = Some(self.now);
                }
                if host {
                    self.report.host_crashes += 1;
                    self.log(format!("fault: host node-{node} crashes for {back} ms"));
                    let killed: Vec<u64> = self
                        .processes
                        .iter()
                        .filter(|(_, p)| p.node == node)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in killed {
                        if let Some(process) = self.processes.remove(&id) {
                            self.log(format!(
                                "process {id} of job {} dies with its host",
                                process.job
                            ));
                            self.agents[node]
                                .records
                                .insert((process.allocation, process.generation), Record::Gone);
                        }
                    }
                } else {
                    self.report.agent_crashes += 1;
                    self.log(format!(
                        "fault: agent of node-{node} crashes for {back} ms (tasks keep running)"
                    ));
                }
                self.at(self.now + back, Event::AgentRestart { node });
            }
            4 => {
                let gpus = self.agents[node].spec.gpus.len() as u32;
                if gpus == 0 || !self.agents[node].unhealthy.is_empty() {
                    return;
                }
                let gpu = self.rng.random_range(0..gpus);
                let back = self.rng.random_range(2_000..20_000);
                self.agents[node].unhealthy = vec![gpu];
                self.report.gpu_failures += 1;
                self.log(format!(
                    "fault: GPU {gpu} of node-{node} unhealthy for {back} ms"
                ));
                self.at(self.now + back, Event::GpuHealed { node });
            }
            _ => {
                if !self.server_up {
                    return;
                }
                let back = self.rng.random_range(1_000..15_000);
                self.server_up = false;
                self.report.server_crashes += 1;
                self.log(format!("fault: server crashes for {back} ms"));
                self.at(self.now + back, Event::ServerRestart);
            }
        }
    }

    fn agent_restart(&mut self, node: usize) {
        let now = self.now;
        let jobs_of: BTreeMap<u64, u64> = self
            .processes
            .iter()
            .map(|(&id, process)| (id, process.job.0))
            .collect();
        let agent = &mut self.agents[node];
        if agent.up {
            return;
        }
        agent.up = true;
        agent.epoch = (agent.epoch + 1).max(now);
        agent.registered = false;
        agent.in_flight = None;
        agent.last_renewal = agent.last_renewal_on_disk;
        agent.fault_since = None;
        let recovered: Vec<((u64, u64), LocalTask)> = agent
            .records
            .iter()
            .map(|(key, record)| {
                let task = match record {
                    Record::Running(id) => LocalTask {
                        job: jobs_of.get(id).copied(),
                        running: true,
                        stopping: false,
                        exit: None,
                    },
                    Record::Exited(code) => LocalTask {
                        job: None,
                        running: false,
                        stopping: false,
                        exit: *code,
                    },
                    Record::Gone => LocalTask {
                        job: None,
                        running: false,
                        stopping: false,
                        exit: None,
                    },
                };
                (*key, task)
            })
            .collect();
        agent.tasks = recovered.into_iter().collect();
        let incarnation = agent.incarnation;
        let (epoch, count) = (agent.epoch, agent.tasks.len());
        self.log(format!(
            "agent of node-{node} restarts: epoch {epoch}, {count} tasks recovered"
        ));
        self.at(now + 1, Event::HeartbeatDue { node, incarnation });
    }

    fn server_restart(&mut self) {
        if self.server_up {
            return;
        }
        self.server_up = true;
        self.control = self
            .store
            .restore(self.control.config.clone(), Time(self.now));
        self.log(format!(
            "server restarts from the store: {} jobs, {} allocations",
            self.control.jobs.len(),
            self.control.allocations.len()
        ));
    }

    /// The properties that hold after every event.
    fn check(&self) -> Result<(), FaultFailure> {
        if self.server_up {
            self.control
                .check_invariants()
                .map_err(|problem| self.fail(format!("control-plane invariant: {problem}")))?;
            for &job in &self.acknowledged {
                if !self.control.jobs.contains_key(&JobId(job as u64 + 1)) {
                    return Err(self.fail(format!(
                        "acknowledged job {} is missing from the control plane",
                        job + 1
                    )));
                }
            }
        }
        // Ground truth: one attempt of a job at a time; one task per GPU.
        let mut attempts: BTreeMap<JobId, (u64, &Process)> = BTreeMap::new();
        let mut gpus: BTreeMap<(usize, u32), u64> = BTreeMap::new();
        for (&id, process) in &self.processes {
            match attempts.get(&process.job) {
                Some(&(other_id, other)) if other.attempt != process.attempt => {
                    return Err(self.fail(format!(
                        "job {} runs twice: attempt {} (generation {}) on node-{} since {} ms \
                         (process {other_id}) and attempt {} (generation {}) on node-{} since {} ms \
                         (process {id})",
                        process.job,
                        other.attempt,
                        other.generation,
                        other.node,
                        other.started,
                        process.attempt,
                        process.generation,
                        process.node,
                        process.started
                    )));
                }
                Some(_) => {}
                None => {
                    attempts.insert(process.job, (id, process));
                }
            }
            for &gpu in &process.gpus {
                if let Some(other) = gpus.insert((process.node, gpu), id) {
                    return Err(self.fail(format!(
                        "GPU {gpu} of node-{} runs two tasks: processes {other} and {id}",
                        process.node
                    )));
                }
            }
        }
        Ok(())
    }

    fn finished(&self) -> bool {
        self.server_up
            && self.acknowledged.len() == self.workload.len()
            && self.processes.is_empty()
            && self.control.jobs.values().all(|j| j.state.is_final())
    }

    fn unfinished(&self) -> String {
        let jobs: Vec<String> = self
            .control
            .jobs
            .values()
            .filter(|j| !j.state.is_final())
            .map(|j| format!("job {} {}", j.id, j.state.name()))
            .collect();
        format!(
            "not finished {} ms after healing: {} of {} jobs acknowledged; unfinished: [{}]; {} processes running",
            self.config.settle_ms,
            self.acknowledged.len(),
            self.workload.len(),
            jobs.join(", "),
            self.processes.len()
        )
    }

    fn conclude(mut self) -> Result<FaultReport, FaultFailure> {
        let failed: Vec<String> = self
            .control
            .jobs
            .values()
            .filter(|j| j.state != JobState::Succeeded)
            .map(|j| {
                let last = j.history.last().map_or("", |(_, note)| note.as_str());
                format!("job {} {} ({last})", j.id, j.state.name())
            })
            .collect();
        if !failed.is_empty() {
            return Err(self.fail(format!(
                "every job should have succeeded: {}",
                failed.join(", ")
            )));
        }
        self.log("all jobs succeeded".to_string());
        self.report.hash = self.hash.0;
        self.report.finished_ms = self.now;
        self.report.jobs_succeeded = self.control.jobs.len();
        Ok(self.report)
    }
}

/// Counts an attempt once, at its rank-0 allocation.
fn job_rank_zero(control: &ControlPlane, allocation: u64) -> bool {
    control
        .allocations
        .get(&AllocationId(allocation))
        .is_some_and(|a| a.rank == 0)
}

fn describe(desired: &[DesiredTask]) -> String {
    let parts: Vec<String> = desired
        .iter()
        .map(|d| {
            format!(
                "{}/{}{}",
                d.allocation,
                d.generation,
                if d.stop { " stop" } else { "" }
            )
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv_matches_the_reference_values() {
        let mut hash = Fnv::new();
        hash.write(b"a");
        assert_eq!(hash.0, 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn a_quiet_run_succeeds() {
        let config = FaultConfig {
            loss: 0.0,
            duplicate: 0.0,
            partitions: false,
            agent_crashes: false,
            host_crashes: false,
            server_crashes: false,
            ..FaultConfig::default()
        };
        let report = run_faults(1, &config).unwrap_or_else(|failure| panic!("{failure}"));
        assert_eq!(report.jobs_succeeded, config.jobs);
        assert_eq!(report.nodes_lost, 0);
    }
}
