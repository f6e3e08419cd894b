//! Deterministic fault injection: one control plane (with its durable store)
//! and N node agents over a simulated network, driven by a discrete-event
//! loop from a seed.
//!
//! The control plane is the real [`ControlPlane`], scheduled by the real
//! [`muster_sched::schedule`]; each agent is the real
//! [`muster_node::AgentCore`], the same state machine `muster-agent` runs:
//! this file only carries its outputs out (messages, processes, the lease
//! file, the runtime's fence deadline) and feeds it inputs; it decides
//! nothing for the agent. Everything else (network, processes, crashes,
//! the store) is modelled here, from one [`ChaCha8Rng`]: the same seed gives
//! the same run and the same event-log hash.
//!
//! Faults: message loss, duplication, random latency (so reordering),
//! partitions of one node from the server, agent crashes (the agent forgets,
//! its tasks keep running), host crashes (the tasks die too), server crashes
//! (a restart rebuilds from the store, giving every node a fresh lease; the
//! crash closes every connection, so no request sent before it arrives
//! after it). After every event the run checks the control plane's
//! invariants, every agent core's, that every acknowledged job is known,
//! that no GPU runs two tasks, and that no job ever runs two attempts at
//! once (the ground truth of fencing). At the end everything heals, and
//! every job must have succeeded with nothing left running.

use muster_control::{
    AllocationId, ControlConfig, ControlError, ControlPlane, DesiredTask, Input, JobState,
    MemoryStore, NodeState, Observed, Output, RestoreError, Software,
};
use muster_model::{
    CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, JobSpec, MemoryMib, NodeName, NodeSpec,
    PoolName, RackName, Signal, Time,
};
use muster_node::{
    AdoptedTask, AgentCore, CoreConfig, DesiredTask as NodeDesired, HeartbeatFailure,
    Input as AgentInput, LeaseRecord, ObservedTask, Output as AgentOutput, Report, TaskExit,
    TaskId,
};
use muster_sched::{SchedulingPolicy, schedule};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};
use std::time::Duration;

/// Heartbeat period the server gives agents, milliseconds.
const HEARTBEAT_MS: u64 = 1_000;
/// The signal a stop delivers to a simulated task.
const SIGTERM: i32 = 15;
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
    /// The node's runtime carries out the stops of a fencing agent. Off
    /// (with `task_watchdog`) only to prove that the checker catches a job
    /// running twice: the agent core still decides to fence, but nothing
    /// happens.
    pub fencing: bool,
    /// The runtime kills every task once the fence deadline its agent last
    /// wrote has passed, whether or not the agent is alive (as
    /// `muster-agent`'s runtime supervisors do). Off only to show what the
    /// agent's own fencing must then catch.
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
        sequence: u64,
        spec: NodeSpec,
    },
    Heartbeat {
        sequence: u64,
        epoch: u64,
        observed: Vec<Observed>,
        unhealthy: Vec<u32>,
    },
}

#[derive(Debug, Clone)]
enum Reply {
    Registered {
        sequence: u64,
        epoch: u64,
    },
    Desired {
        sequence: u64,
        desired: Vec<DesiredTask>,
    },
    /// The server refused the heartbeat (an unknown node or an old epoch).
    Refused {
        sequence: u64,
    },
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
    /// The agent core asked to be woken now.
    AgentWake {
        node: usize,
        incarnation: u64,
    },
    ToServer {
        node: usize,
        /// The sending agent's incarnation (its reply goes back there).
        incarnation: u64,
        /// The server's incarnation when it was sent: a server crash closes
        /// the connection it travels on.
        server_incarnation: u64,
        request: Request,
    },
    ToAgent {
        node: usize,
        incarnation: u64,
        reply: Reply,
    },
    TaskExit {
        process: u64,
        exit: TaskExit,
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

/// The durable copy: muster-control's [`MemoryStore`], written and read
/// by the rules `muster-server` writes and reads its store by
/// ([`ControlPlane::changed_records`], [`ControlPlane::restore`] of every
/// job not finished and finished ones within the retention). Retired jobs
/// stay in it, as in the server's store.
type Store = MemoryStore;

fn persist(store: &mut Store, control: &ControlPlane, outputs: &[Output]) {
    store.write(control.changed_records(outputs));
}

fn restore(store: &Store, config: ControlConfig, now: Time) -> Result<ControlPlane, RestoreError> {
    let records = store.load(now, config.retention_ms);
    ControlPlane::restore(config, records, now)
}

/// What the node's disk knows about a task (the runtime's records).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Record {
    job: u64,
    gpus: Vec<u32>,
    stop_signal: Signal,
    grace_period_ms: u64,
    /// The process while it runs, else how it ended.
    state: Result<u64, TaskExit>,
}

#[derive(Debug, Clone)]
struct Agent {
    spec: NodeSpec,
    /// The agent process: `None` while it is down.
    core: Option<AgentCore<DesiredTask>>,
    /// Bumped at every crash: replies and wake-ups of an older incarnation
    /// are dropped.
    incarnation: u64,
    /// The lease file: survives agent restarts.
    lease_on_disk: Option<LeaseRecord>,
    /// The fence deadline the runtime enforces (the last one written).
    fence_deadline: Option<u64>,
    /// The runtime's records, by task.
    records: BTreeMap<TaskId, Record>,
    partitioned: bool,
    /// GPU indices the node's health checks report out of service.
    unhealthy: Vec<u32>,
    /// When the fault that cut this node off began.
    fault_since: Option<u64>,
    /// The wake-up of the core that is scheduled.
    wake_at: Option<u64>,
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
    /// Bumped at every server crash.
    server_incarnation: u64,
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
    /// Why the server could not restart from its store, if it could not.
    restore_failed: Option<String>,
    report: FaultReport,
}

/// How long finished jobs stay in the simulated server's hot state.
const RETENTION_MS: u64 = 20_000;

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
                    core: None,
                    incarnation: 0,
                    lease_on_disk: None,
                    fence_deadline: None,
                    records: BTreeMap::new(),
                    partitioned: false,
                    unhealthy: Vec::new(),
                    fault_since: None,
                    wake_at: None,
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
            // Short, so that retirement (and restoring without retired
            // jobs) happens within a run.
            retention_ms: RETENTION_MS,
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
            server_incarnation: 0,
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
            restore_failed: None,
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
            self.at(start, Event::AgentRestart { node });
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
            Event::AgentWake { node, incarnation } => {
                let agent = &self.agents[node];
                if agent.incarnation == incarnation && agent.wake_at == Some(self.now) {
                    self.agents[node].wake_at = None;
                    self.drive(node, AgentInput::Tick);
                }
            }
            Event::ToServer {
                node,
                incarnation,
                server_incarnation,
                request,
            } => self.server_receives(node, incarnation, server_incarnation, request)?,
            Event::ToAgent {
                node,
                incarnation,
                reply,
            } => self.agent_receives(node, incarnation, reply),
            Event::TaskExit { process, exit } => self.task_exits(process, exit),
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
                self.drive(
                    node,
                    AgentInput::GpuHealth {
                        unhealthy: Vec::new(),
                    },
                );
            }
            Event::Heal => {
                self.healed = true;
                self.log("heal: no more faults".to_string());
                for node in 0..self.agents.len() {
                    self.agents[node].partitioned = false;
                    if !self.agents[node].unhealthy.is_empty() {
                        self.agents[node].unhealthy.clear();
                        self.drive(
                            node,
                            AgentInput::GpuHealth {
                                unhealthy: Vec::new(),
                            },
                        );
                    }
                    if self.agents[node].core.is_none() {
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
        persist(&mut self.store, &self.control, &outputs);
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
        let before = self.control.counters().next_allocation;
        let outputs = self.control.apply_outcome(now, &outcome);
        persist(&mut self.store, &self.control, &outputs);
        let created: Vec<(u64, JobId, u32, String)> = (before
            ..self.control.counters().next_allocation)
            .filter_map(|id| {
                let allocation = self.control.allocation(AllocationId(id))?;
                let job = self.control.job(allocation.job)?;
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
            .nodes()
            .filter(|n| n.state == NodeState::Lost)
            .map(|n| n.spec.name.clone())
            .collect();
        let live: BTreeMap<AllocationId, (NodeName, JobId)> = self
            .control
            .nodes()
            .flat_map(|n| self.control.live_allocations(&n.spec.name))
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
                        .node(name)
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

    /// Feeds the agent core of `node` one input (nothing while the agent
    /// is down) and carries its outputs out.
    fn drive(&mut self, node: usize, input: AgentInput<DesiredTask>) {
        let Some(core) = self.agents[node].core.as_mut() else {
            return;
        };
        let outputs = core.handle(self.now, input);
        self.carry_out(node, outputs);
    }

    /// Does what the agent core asks, as `muster-agent` does with real
    /// messages, processes and files; then schedules its next wake-up.
    fn carry_out(&mut self, node: usize, outputs: Vec<AgentOutput<DesiredTask>>) {
        for output in outputs {
            match output {
                AgentOutput::SendRegister { sequence, .. } => {
                    let what = format!("register {sequence} of node-{node}");
                    let spec = self.agents[node].spec.clone();
                    self.send_to_server(node, what, Request::Register { sequence, spec });
                }
                AgentOutput::SendHeartbeat {
                    sequence,
                    epoch,
                    observed,
                    unhealthy_gpus,
                    ..
                } => {
                    let what = format!(
                        "heartbeat {sequence} of node-{node} ({} tasks)",
                        observed.len()
                    );
                    let observed = observed.iter().map(observed_of).collect();
                    self.send_to_server(
                        node,
                        what,
                        Request::Heartbeat {
                            sequence,
                            epoch,
                            observed,
                            unhealthy: unhealthy_gpus,
                        },
                    );
                }
                AgentOutput::StartTask { task, launch, .. } => self.start(node, task, &launch),
                AgentOutput::StopTask {
                    task,
                    grace_ms,
                    fenced,
                    ..
                } => self.stop(node, task, grace_ms, fenced),
                AgentOutput::WriteLease {
                    last_renewal_ms,
                    lease_ms,
                    fence_deadline_ms,
                } => {
                    let agent = &mut self.agents[node];
                    agent.lease_on_disk = Some(LeaseRecord {
                        last_renewal_ms,
                        lease_ms,
                    });
                    agent.fence_deadline = Some(fence_deadline_ms);
                    agent.fault_since = None;
                    self.log(format!(
                        "node-{node} renewed its lease (sent at {last_renewal_ms}); tasks die at {fence_deadline_ms} unless renewed"
                    ));
                }
                AgentOutput::ForgetTask { task } => {
                    self.agents[node].records.remove(&task);
                }
                AgentOutput::Report(Report::Fenced) => {
                    self.report.fences += 1;
                    self.log(format!("node-{node} fences itself: stopping every task"));
                }
                AgentOutput::Report(Report::RegisterAgain) => {
                    self.log(format!("node-{node} must register again"));
                }
                AgentOutput::Report(Report::NoAnswer { sequence }) => {
                    self.log(format!("node-{node}: no answer to {sequence}"));
                }
            }
        }
        let agent = &self.agents[node];
        let Some(core) = &agent.core else {
            return;
        };
        let wake = core.next_wake_ms().max(self.now + 1);
        if agent.wake_at != Some(wake) {
            let incarnation = agent.incarnation;
            self.agents[node].wake_at = Some(wake);
            self.at(wake, Event::AgentWake { node, incarnation });
        }
    }

    fn send_to_server(&mut self, node: usize, what: String, request: Request) {
        self.log(format!("node-{node} sends {what}"));
        if self.agents[node].partitioned {
            self.log(format!("net: node-{node} partitioned, {what} dropped"));
            return;
        }
        let event = Event::ToServer {
            node,
            incarnation: self.agents[node].incarnation,
            server_incarnation: self.server_incarnation,
            request,
        };
        self.send(&what, event);
    }

    fn server_receives(
        &mut self,
        node: usize,
        incarnation: u64,
        server_incarnation: u64,
        request: Request,
    ) -> Result<(), FaultFailure> {
        if !self.server_up || server_incarnation != self.server_incarnation {
            self.log(format!(
                "server down or restarted: a request of node-{node} is dropped"
            ));
            return Ok(());
        }
        if self.agents[node].partitioned {
            self.log(format!("net: node-{node} partitioned, request dropped"));
            return Ok(());
        }
        let name = self.agents[node].spec.name.clone();
        let reply = match request {
            Request::Register { sequence, spec } => {
                let input = Input::Register {
                    spec,
                    address: format!("10.0.0.{}", node + 1),
                    software: Software::default(),
                };
                match self.server_step(input) {
                    Ok(_) => {
                        let epoch = self.control.node(&name).map_or(0, |n| n.epoch);
                        self.log(format!("server registers {name} epoch {epoch}"));
                        Reply::Registered { sequence, epoch }
                    }
                    Err(error) => return Err(self.fail(format!("register refused: {error}"))),
                }
            }
            Request::Heartbeat {
                sequence,
                epoch,
                observed,
                unhealthy,
            } => {
                // One input, as muster-server sends it: the control plane
                // decides what of it is new.
                let newer = self
                    .control
                    .newer_heartbeat(&name, epoch, sequence)
                    .unwrap_or(true);
                let known = self.control.node(&name).map(|n| n.unhealthy_gpus.clone());
                let input = Input::Heartbeat {
                    node: name.clone(),
                    epoch,
                    sequence,
                    observed,
                    unhealthy: Some(unhealthy),
                };
                match self.server_step(input) {
                    Ok(_) => {
                        let now_unhealthy =
                            self.control.node(&name).map(|n| n.unhealthy_gpus.clone());
                        if now_unhealthy != known {
                            self.log(format!(
                                "server learns {name} GPUs {:?} are unhealthy",
                                now_unhealthy.unwrap_or_default()
                            ));
                        }
                        let desired = self.control.desired(&name);
                        self.log(format!(
                            "server {} {name} (heartbeat {sequence}); desired {}",
                            if newer {
                                "renews"
                            } else {
                                "answers an old heartbeat of"
                            },
                            describe(&desired)
                        ));
                        Reply::Desired { sequence, desired }
                    }
                    Err(error) => {
                        self.log(format!(
                            "server refuses heartbeat {sequence} of {name}: {error}"
                        ));
                        Reply::Refused { sequence }
                    }
                }
            }
        };
        let sequence = match &reply {
            Reply::Registered { sequence, .. }
            | Reply::Desired { sequence, .. }
            | Reply::Refused { sequence } => *sequence,
        };
        self.send(
            &format!("reply {sequence} to node-{node}"),
            Event::ToAgent {
                node,
                incarnation,
                reply,
            },
        );
        Ok(())
    }

    fn agent_receives(&mut self, node: usize, incarnation: u64, reply: Reply) {
        let agent = &self.agents[node];
        if agent.partitioned {
            self.log(format!("net: node-{node} partitioned, reply dropped"));
            return;
        }
        // A reply to an agent process that has since crashed has no
        // connection left to arrive on.
        if agent.core.is_none() || agent.incarnation != incarnation {
            return;
        }
        let lease_ms = self.config.lease_ms;
        let input = match reply {
            Reply::Registered { sequence, epoch } => AgentInput::Registered {
                sequence,
                epoch,
                lease_ms,
                heartbeat_ms: HEARTBEAT_MS,
            },
            Reply::Desired { sequence, desired } => AgentInput::HeartbeatReply {
                sequence,
                version: 0,
                lease_ms,
                desired: desired.into_iter().map(desired_of).collect(),
            },
            Reply::Refused { sequence } => AgentInput::HeartbeatFailed {
                sequence,
                failure: HeartbeatFailure::Refused,
            },
        };
        self.drive(node, input);
    }

    /// The runtime starts a task: a process that ends with code 0 after
    /// its job's run time.
    fn start(&mut self, node: usize, task: TaskId, launch: &DesiredTask) {
        let id = self.next_process;
        self.next_process += 1;
        let attempt = self.attempt_of.get(&task.allocation).copied().unwrap_or(0);
        let run_ms = self
            .workload
            .get((launch.job.0 as usize).wrapping_sub(1))
            .map_or(1_000, |w| w.run_ms);
        self.processes.insert(
            id,
            Process {
                node,
                allocation: task.allocation,
                generation: task.generation,
                job: launch.job,
                attempt,
                rank: launch.rank,
                gpus: launch.gpus.clone(),
                started: self.now,
                stopping: false,
            },
        );
        self.agents[node].records.insert(
            task,
            Record {
                job: launch.job.0,
                gpus: launch.gpus.clone(),
                stop_signal: launch.stop_signal,
                grace_period_ms: launch.grace_period_ms,
                state: Ok(id),
            },
        );
        self.log(format!(
            "node-{node} starts job {} attempt {attempt} rank {} (allocation {} generation {}, process {id})",
            launch.job, launch.rank, task.allocation, task.generation
        ));
        self.at(
            self.now + run_ms,
            Event::TaskExit {
                process: id,
                exit: TaskExit::Code(0),
            },
        );
    }

    /// The runtime stops a task: it honours the signal within 50 ms to 1 s,
    /// and is killed at the end of its grace period.
    fn stop(&mut self, node: usize, task: TaskId, grace_ms: u64, fenced: bool) {
        if fenced && !self.config.fencing {
            self.log(format!(
                "node-{node}: the runtime ignores the fencing stop of allocation {}",
                task.allocation
            ));
            return;
        }
        let Some(Record { state: Ok(id), .. }) = self.agents[node].records.get(&task).cloned()
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
        let after = self.rng.random_range(50..=1_000).min(grace_ms.max(1));
        self.log(format!(
            "node-{node} stops allocation {} generation {} (process {id}, grace {grace_ms} ms)",
            task.allocation, task.generation
        ));
        self.at(
            self.now + after,
            Event::TaskExit {
                process: id,
                exit: TaskExit::Signal(SIGTERM),
            },
        );
    }

    /// The runtime's supervisors: once the fence deadline the agent last
    /// wrote has passed, every task of the node is killed, whether or not
    /// its agent is alive.
    fn watchdog(&mut self) {
        if !self.config.fencing || !self.config.task_watchdog {
            return;
        }
        let expired: Vec<u64> = self
            .processes
            .iter()
            .filter(|(_, process)| {
                self.agents[process.node]
                    .fence_deadline
                    .is_some_and(|deadline| deadline < self.now)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in expired {
            self.log(format!(
                "runtime: process {id} killed (fence deadline passed)"
            ));
            self.task_exits(id, TaskExit::Fenced);
        }
    }

    fn task_exits(&mut self, id: u64, exit: TaskExit) {
        let Some(process) = self.processes.remove(&id) else {
            return;
        };
        let task = TaskId {
            allocation: process.allocation,
            generation: process.generation,
        };
        self.log(format!(
            "process {id} of job {} attempt {} rank {} on node-{} exits {exit:?} (ran {} ms)",
            process.job,
            process.attempt,
            process.rank,
            process.node,
            self.now - process.started
        ));
        if let Some(record) = self.agents[process.node].records.get_mut(&task)
            && record.state == Ok(id)
        {
            record.state = Err(exit);
        }
        self.drive(process.node, AgentInput::TaskExited { task, exit });
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
                if self.agents[node].core.is_none() {
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
                agent.core = None;
                agent.incarnation += 1;
                agent.wake_at = None;
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
                            let task = TaskId {
                                allocation: process.allocation,
                                generation: process.generation,
                            };
                            if let Some(record) = self.agents[node].records.get_mut(&task) {
                                record.state = Err(TaskExit::Vanished);
                            }
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
                self.drive(
                    node,
                    AgentInput::GpuHealth {
                        unhealthy: vec![gpu],
                    },
                );
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
                self.server_incarnation += 1;
                self.report.server_crashes += 1;
                self.log(format!("fault: server crashes for {back} ms"));
                self.at(self.now + back, Event::ServerRestart);
            }
        }
    }

    /// A new agent process on the node: a new epoch, the lease kept on
    /// disk, the tasks the runtime's records list.
    fn agent_restart(&mut self, node: usize) {
        let now = self.now;
        let agent = &mut self.agents[node];
        if agent.core.is_some() {
            return;
        }
        agent.fault_since = None;
        let adopted: Vec<AdoptedTask> = agent
            .records
            .iter()
            .map(|(&task, record)| AdoptedTask {
                task,
                job: Some(record.job),
                gpus: Some(record.gpus.clone()),
                stop_signal: record.stop_signal,
                grace_period_ms: record.grace_period_ms,
                exit: record.state.err(),
            })
            .collect();
        let count = adopted.len();
        let config = CoreConfig {
            fence_margin_ms: self.config.fence_margin_ms,
        };
        let (core, outputs) = AgentCore::new(config, now, agent.lease_on_disk, adopted);
        agent.core = Some(core);
        self.log(format!(
            "agent of node-{node} starts: {count} tasks recovered"
        ));
        self.carry_out(node, outputs);
        let unhealthy = self.agents[node].unhealthy.clone();
        if !unhealthy.is_empty() {
            self.drive(node, AgentInput::GpuHealth { unhealthy });
        }
    }

    fn server_restart(&mut self) {
        if self.server_up {
            return;
        }
        self.server_up = true;
        match restore(&self.store, self.control.config().clone(), Time(self.now)) {
            Ok(control) => self.control = control,
            Err(error) => {
                // Kept for `check`, which reports it.
                self.restore_failed = Some(error.to_string());
            }
        }
        self.log(format!(
            "server restarts from the store: {} jobs",
            self.control.job_count()
        ));
    }

    /// The properties that hold after every event.
    fn check(&self) -> Result<(), FaultFailure> {
        if let Some(error) = &self.restore_failed {
            return Err(self.fail(format!("the server cannot restart: {error}")));
        }
        if self.server_up {
            self.control
                .check_invariants()
                .map_err(|problem| self.fail(format!("control-plane invariant: {problem}")))?;
            for &job in &self.acknowledged {
                let id = JobId(job as u64 + 1);
                // Hot, or retired (finished, and in the store).
                let kept = self.control.job(id).is_some()
                    || self.store.jobs.get(&id).is_some_and(|j| j.state.is_final());
                if !kept {
                    return Err(self.fail(format!(
                        "acknowledged job {} is missing from the control plane",
                        job + 1
                    )));
                }
            }
        }
        for (node, agent) in self.agents.iter().enumerate() {
            if let Some(core) = &agent.core {
                core.check_invariants()
                    .map_err(|problem| self.fail(format!("node-{node} agent core: {problem}")))?;
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
            && self.control.jobs().all(|j| j.state.is_final())
    }

    fn unfinished(&self) -> String {
        let jobs: Vec<String> = self
            .control
            .jobs()
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
        // Every job ever submitted, retired ones included, is in the store
        // as the control plane last wrote it.
        let failed: Vec<String> = self
            .store
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
        self.report.jobs_succeeded = self.store.jobs.len();
        Ok(self.report)
    }
}

/// Counts an attempt once, at its rank-0 allocation.
fn job_rank_zero(control: &ControlPlane, allocation: u64) -> bool {
    control
        .allocation(AllocationId(allocation))
        .is_some_and(|a| a.rank == 0)
}

/// A control-plane task as the agent core takes it.
fn desired_of(desired: DesiredTask) -> NodeDesired<DesiredTask> {
    NodeDesired {
        task: TaskId {
            allocation: desired.allocation.0,
            generation: desired.generation,
        },
        job: desired.job.0,
        gpus: desired.gpus.clone(),
        stop: desired.stop,
        stop_signal: desired.stop_signal,
        grace_period_ms: desired.grace_period_ms,
        launch: desired,
    }
}

/// What the agent core reports, as the control plane takes it.
fn observed_of(observed: &ObservedTask) -> Observed {
    Observed {
        allocation: AllocationId(observed.task.allocation),
        generation: observed.task.generation,
        exited: observed.exited,
        fenced: observed.fenced,
        memory_limit: observed.memory_limit,
    }
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
