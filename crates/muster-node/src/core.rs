//! [`AgentCore`]: every decision of a node agent, as a state machine with
//! no I/O. The shell (`muster-agent`, or the fault simulation in
//! `muster-sim`) feeds it [`Input`]s with the time, and carries out the
//! [`Output`]s it returns, in order.
//!
//! The rules, in one place:
//! - **Register** first (again after the server refuses a heartbeat as
//!   conflict, unauthenticated or not found); each registration gets a new
//!   epoch from the server, which the heartbeats carry, with a doubling backoff from
//!   [`REGISTER_BACKOFF_MIN_MS`] to [`REGISTER_BACKOFF_MAX_MS`] after a
//!   failure.
//! - **Heartbeats**: one request at a time, each with the next sequence
//!   number of this epoch; a heartbeat period after the last one was sent,
//!   at once after a short one or a changed desired set (a long poll then
//!   waits at the server), and at once with news (a start or exit not yet
//!   reported, a GPU health change: a long poll in flight is abandoned for
//!   it, and the request asks for no wait). Only the answer to the newest
//!   request counts; the answer to an older one (late, duplicated, or
//!   abandoned) is ignored. The lease counts from when the answered request
//!   was sent. A request is given up at the fence time (a registration
//!   after [`REQUEST_LIMIT_MS`] at most), or after [`REQUEST_LIMIT_MS`] when
//!   no lease is left; a heartbeat also after its long poll plus
//!   [`ANSWER_MARGIN_MS`], and early enough to leave
//!   [`FAILOVER_RESERVE_MS`] for another try while the time left holds two
//!   (the shell sends it to the next server). A try after one that got no
//!   answer asks for no wait.
//! - **Fencing**: once `now - last renewal + margin >= lease` (margin:
//!   `min(fence margin, lease / 4)`) every task is stopped with a short
//!   grace, and nothing starts until a heartbeat is answered again. The
//!   fence deadline (`last renewal + lease - margin / 2`) is handed to the
//!   runtime, whose supervisors kill every task past it even when the agent
//!   is dead or hung.
//! - **Reconcile** on each answer: stop what the server marks stop, does
//!   not list, or lists at another generation; then start what it wants
//!   and is not here, but only once no task it replaces still runs (same
//!   allocation, same job, or a GPU in common), so two attempts of a job
//!   never overlap on a node and no GPU runs two tasks. Stops come before
//!   starts. Starts are made only when an answer arrives, from that
//!   answer: the server may treat a task that a later heartbeat does not
//!   report as not running, so a start from an older answer is unsafe.
//! - **Forget** a task once it has ended, a heartbeat reported how, and an
//!   answer to that heartbeat (or a later one) no longer lists it.

use crate::{TaskExit, stop_grace_ms};
use muster_model::Signal;
use std::collections::BTreeMap;

/// How long a request may wait for its answer when no lease is left to
/// bound it (before the first registration, or after the lease ran out).
pub const REQUEST_LIMIT_MS: u64 = 5_000;

/// How much longer than its long poll a heartbeat's answer may take before
/// it is given up (and sent again, to the next server when there are
/// several).
pub const ANSWER_MARGIN_MS: u64 = 3_000;
/// The pause after a heartbeat failed on the network before the next one.
pub const HEARTBEAT_RETRY_MS: u64 = 250;
/// What a heartbeat leaves of the time before the fence for one more try
/// (a pause and an answer margin), while the time left holds two.
pub const FAILOVER_RESERVE_MS: u64 = ANSWER_MARGIN_MS + HEARTBEAT_RETRY_MS;
/// The first pause after a failed registration; it doubles each time.
pub const REGISTER_BACKOFF_MIN_MS: u64 = 200;
/// The longest pause between two registrations.
pub const REGISTER_BACKOFF_MAX_MS: u64 = 5_000;
/// The lease assumed before the server told the real one.
pub const DEFAULT_LEASE_MS: u64 = 10_000;
/// The heartbeat period assumed before the server told the real one.
pub const DEFAULT_HEARTBEAT_MS: u64 = 2_000;

/// One task on the node: an allocation at one generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskId {
    pub allocation: u64,
    pub generation: u64,
}

/// A task the control plane wants on this node (or wants stopped, when
/// `stop` is set). `launch` is what the shell needs to start it (command,
/// environment...), handed back in [`Output::StartTask`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DesiredTask<L> {
    pub task: TaskId,
    pub job: u64,
    pub gpus: Vec<u32>,
    pub stop: bool,
    pub stop_signal: Signal,
    pub grace_period_ms: u64,
    pub launch: L,
}

/// A task found again when the agent starts (a previous agent started it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdoptedTask {
    pub task: TaskId,
    /// `None`: its job could not be read.
    pub job: Option<u64>,
    /// `None`: its GPUs could not be read (it then holds back every start
    /// until it is gone).
    pub gpus: Option<Vec<u32>>,
    pub stop_signal: Signal,
    pub grace_period_ms: u64,
    /// `None` while it runs.
    pub exit: Option<TaskExit>,
}

/// What a previous agent on this node last knew of its lease (kept on disk):
/// a restarted agent that cannot reach the server must still fence the
/// tasks it found before that lease runs out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseRecord {
    pub last_renewal_ms: u64,
    pub lease_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoreConfig {
    /// Stop tasks this long before the lease would run out (cut to a
    /// quarter of the lease).
    pub fence_margin_ms: u64,
}

/// Why a heartbeat got no usable answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeartbeatFailure {
    /// The server does not know this node or its epoch (conflict,
    /// unauthenticated, not found): register again.
    Refused,
    /// No answer (network, timeout, server error): retry; fence when the
    /// lease runs out.
    Transport,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input<L> {
    /// Time passed (call it at [`AgentCore::next_wake_ms`] at the latest).
    Tick,
    /// The answer to [`Output::SendRegister`].
    Registered {
        sequence: u64,
        /// The epoch the server issued to this registration: heartbeats
        /// carry it until the next registration.
        epoch: u64,
        lease_ms: u64,
        heartbeat_ms: u64,
    },
    /// No answer to [`Output::SendRegister`] (the shell stops on a refusal:
    /// the server does not want this node at all).
    RegisterFailed {
        sequence: u64,
    },
    /// The answer to [`Output::SendHeartbeat`].
    HeartbeatReply {
        sequence: u64,
        version: u64,
        lease_ms: u64,
        desired: Vec<DesiredTask<L>>,
    },
    HeartbeatFailed {
        sequence: u64,
        failure: HeartbeatFailure,
    },
    /// The runtime could not start a task (reported as exit code 127, as a
    /// shell does for a missing command).
    StartFailed {
        task: TaskId,
    },
    TaskExited {
        task: TaskId,
        exit: TaskExit,
    },
    /// The GPU indices the node's health checks find out of service now.
    GpuHealth {
        unhealthy: Vec<u32>,
    },
}

/// What the node reports of one task in a heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObservedTask {
    pub task: TaskId,
    /// `None` while it runs; then its exit code (`None` inside: a signal,
    /// or it vanished).
    pub exited: Option<Option<i32>>,
    /// The node failed, not the task: it was stopped because the lease
    /// could not be renewed, or it is gone with no record of how it ended
    /// (its host restarted). The control plane re-queues its job as a lost
    /// node's, never takes it as failed.
    pub fenced: bool,
    /// It ended at its memory limit.
    pub memory_limit: bool,
}

/// Something worth a line in the agent's log (and a count in the
/// simulation).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Report {
    /// The lease could not be renewed in time: every task is being stopped.
    Fenced,
    /// The server refused a heartbeat: registering again.
    RegisterAgain,
    /// A request got no answer in time.
    NoAnswer { sequence: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output<L> {
    /// Send the registration; give up on it at `deadline_ms`.
    SendRegister {
        sequence: u64,
        deadline_ms: u64,
    },
    /// Send a heartbeat; give up on it at `deadline_ms`. A heartbeat still
    /// in flight is abandoned (its answer will be ignored).
    SendHeartbeat {
        sequence: u64,
        epoch: u64,
        observed: Vec<ObservedTask>,
        unhealthy_gpus: Vec<u32>,
        known_version: u64,
        /// How long the server may hold it (long poll).
        wait_ms: u64,
        deadline_ms: u64,
    },
    StartTask {
        task: TaskId,
        job: u64,
        gpus: Vec<u32>,
        launch: L,
    },
    StopTask {
        task: TaskId,
        signal: Signal,
        grace_ms: u64,
        fenced: bool,
    },
    /// Persist the lease (for a restarted agent) and hand the fence
    /// deadline to the runtime: every task must be dead by then unless a
    /// later deadline replaces it.
    WriteLease {
        last_renewal_ms: u64,
        lease_ms: u64,
        fence_deadline_ms: u64,
    },
    /// Drop everything kept about a task (records, logs position).
    ForgetTask {
        task: TaskId,
    },
    Report(Report),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TaskState {
    Running,
    Stopping,
    Exited {
        exit: TaskExit,
        /// The first heartbeat that reported the exit.
        reported_in: Option<u64>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Task {
    job: Option<u64>,
    gpus: Option<Vec<u32>>,
    stop_signal: Signal,
    grace_period_ms: u64,
    state: TaskState,
    /// Stopped because the node fenced itself (or killed by the fence
    /// deadline).
    fenced: bool,
    /// Reported running by a heartbeat already.
    reported_running: bool,
}

impl Task {
    fn live(&self) -> bool {
        matches!(self.state, TaskState::Running | TaskState::Stopping)
    }

    fn observed(&self, task: TaskId) -> ObservedTask {
        ObservedTask {
            task,
            exited: match self.state {
                TaskState::Running | TaskState::Stopping => None,
                TaskState::Exited { exit, .. } => Some(exit.code()),
            },
            fenced: self.fenced
                || matches!(
                    self.state,
                    TaskState::Exited {
                        exit: TaskExit::Vanished,
                        ..
                    }
                ),
            memory_limit: matches!(
                self.state,
                TaskState::Exited {
                    exit: TaskExit::MemoryLimit(_),
                    ..
                }
            ),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RequestKind {
    Register,
    Heartbeat { long_poll: bool },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Request {
    kind: RequestKind,
    sequence: u64,
    sent_ms: u64,
    deadline_ms: u64,
}

/// The node agent's state machine. See the module documentation for its
/// rules.
#[derive(Debug, Clone)]
pub struct AgentCore<L> {
    config: CoreConfig,
    epoch: u64,
    registered: bool,
    lease_ms: u64,
    heartbeat_ms: u64,
    last_renewal_ms: u64,
    /// The last sequence number used (0: none yet).
    sequence: u64,
    in_flight: Option<Request>,
    /// When the next request goes out (when none is in flight).
    next_send_ms: u64,
    register_backoff_ms: u64,
    /// The desired set of the newest answer, and its version.
    desired: BTreeMap<TaskId, DesiredTask<L>>,
    version: u64,
    tasks: BTreeMap<TaskId, Task>,
    fenced: bool,
    /// The last heartbeat got no answer (network, timeout, server error).
    unanswered: bool,
    unhealthy_gpus: Vec<u32>,
    /// The unhealthy GPUs the server was last told of.
    unhealthy_reported: Vec<u32>,
}

impl<L: Clone> AgentCore<L> {
    /// A new agent process: `lease` is what a previous agent here kept on
    /// disk; `adopted` the tasks it left. Its epoch is issued by the server
    /// at each registration. Returns the core and its first outputs (fencing
    /// what would outlive that lease, then the registration).
    pub fn new(
        config: CoreConfig,
        now_ms: u64,
        lease: Option<LeaseRecord>,
        adopted: Vec<AdoptedTask>,
    ) -> (Self, Vec<Output<L>>) {
        let lease = lease.unwrap_or(LeaseRecord {
            last_renewal_ms: now_ms,
            lease_ms: DEFAULT_LEASE_MS,
        });
        let tasks = adopted
            .into_iter()
            .map(|found| {
                let state = match found.exit {
                    None => TaskState::Running,
                    Some(exit) => TaskState::Exited {
                        exit,
                        reported_in: None,
                    },
                };
                let fenced = found.exit == Some(TaskExit::Fenced);
                let task = Task {
                    job: found.job,
                    gpus: found.gpus,
                    stop_signal: found.stop_signal,
                    grace_period_ms: found.grace_period_ms,
                    state,
                    fenced,
                    reported_running: false,
                };
                (found.task, task)
            })
            .collect();
        let mut core = AgentCore {
            config,
            epoch: 0,
            registered: false,
            lease_ms: lease.lease_ms,
            heartbeat_ms: DEFAULT_HEARTBEAT_MS,
            last_renewal_ms: lease.last_renewal_ms,
            sequence: 0,
            in_flight: None,
            next_send_ms: now_ms,
            register_backoff_ms: REGISTER_BACKOFF_MIN_MS,
            desired: BTreeMap::new(),
            version: 0,
            tasks,
            fenced: false,
            unanswered: false,
            unhealthy_gpus: Vec::new(),
            unhealthy_reported: Vec::new(),
        };
        let outputs = core.handle(now_ms, Input::Tick);
        (core, outputs)
    }

    /// The epoch of the last registration (0 before the first).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn registered(&self) -> bool {
        self.registered
    }

    pub fn fenced(&self) -> bool {
        self.fenced
    }

    /// The fence margin in force: the configured one, at most a quarter of
    /// the lease.
    pub fn fence_margin_ms(&self) -> u64 {
        self.config.fence_margin_ms.min(self.lease_ms / 4)
    }

    /// When the node fences itself unless a heartbeat is answered first.
    pub fn fence_at_ms(&self) -> u64 {
        (self.last_renewal_ms + self.lease_ms).saturating_sub(self.fence_margin_ms())
    }

    /// The deadline handed to the runtime: half a margin after the agent's
    /// own fencing, still half a margin before the lease ends.
    pub fn fence_deadline_ms(&self) -> u64 {
        (self.last_renewal_ms + self.lease_ms).saturating_sub(self.fence_margin_ms() / 2)
    }

    /// The latest time the shell must call [`Input::Tick`] at, if nothing
    /// else happens before.
    pub fn next_wake_ms(&self) -> u64 {
        let send_or_give_up = match self.in_flight {
            Some(request) => request.deadline_ms,
            None => self.next_send_ms,
        };
        if !self.fenced && self.tasks.values().any(Task::live) {
            send_or_give_up.min(self.fence_at_ms())
        } else {
            send_or_give_up
        }
    }

    /// The tasks this node has, running or ended and not yet forgotten.
    pub fn tasks(&self) -> impl Iterator<Item = (TaskId, Option<TaskExit>)> + '_ {
        self.tasks.iter().map(|(&id, task)| {
            let exit = match task.state {
                TaskState::Exited { exit, .. } => Some(exit),
                _ => None,
            };
            (id, exit)
        })
    }

    /// Takes one input at `now_ms` and returns what the shell must do, in
    /// order.
    pub fn handle(&mut self, now_ms: u64, input: Input<L>) -> Vec<Output<L>> {
        let mut outputs = Vec::new();
        match input {
            Input::Tick => {}
            Input::Registered {
                sequence,
                epoch,
                lease_ms,
                heartbeat_ms,
            } => {
                if let Some(request) = self.answered(sequence, RequestKind::Register) {
                    self.registered = true;
                    self.unanswered = false;
                    self.epoch = epoch;
                    self.register_backoff_ms = REGISTER_BACKOFF_MIN_MS;
                    self.lease_ms = lease_ms.max(1);
                    self.heartbeat_ms = heartbeat_ms;
                    self.version = 0;
                    self.renew(request.sent_ms, &mut outputs);
                    self.next_send_ms = now_ms;
                }
            }
            Input::RegisterFailed { sequence } => {
                if self.answered(sequence, RequestKind::Register).is_some() {
                    self.register_failed(now_ms);
                }
            }
            Input::HeartbeatReply {
                sequence,
                version,
                lease_ms,
                desired,
            } => {
                if let Some(request) = self.answered_heartbeat(sequence) {
                    // The next heartbeat goes a period after this one was
                    // sent; at once (a long poll) after a short request or
                    // when the desired set changed, so that a server that
                    // holds heartbeats always has one to answer with news.
                    let long_poll = request.kind == RequestKind::Heartbeat { long_poll: true };
                    self.next_send_ms = if long_poll && version == self.version {
                        request.sent_ms + self.heartbeat_ms
                    } else {
                        now_ms
                    };
                    self.lease_ms = lease_ms.max(1);
                    self.version = version;
                    self.renew(request.sent_ms, &mut outputs);
                    self.fenced = false;
                    self.unanswered = false;
                    self.desired = desired.into_iter().map(|d| (d.task, d)).collect();
                    self.reconcile(&mut outputs);
                    self.forget(sequence, &mut outputs);
                }
            }
            Input::HeartbeatFailed { sequence, failure } => {
                if self.answered_heartbeat(sequence).is_some() {
                    match failure {
                        HeartbeatFailure::Refused => {
                            self.registered = false;
                            self.version = 0;
                            self.next_send_ms = now_ms;
                            outputs.push(Output::Report(Report::RegisterAgain));
                        }
                        HeartbeatFailure::Transport => {
                            self.unanswered = true;
                            self.next_send_ms = now_ms + HEARTBEAT_RETRY_MS;
                        }
                    }
                }
            }
            Input::StartFailed { task } => {
                self.exited(task, TaskExit::Code(127));
            }
            Input::TaskExited { task, exit } => {
                self.exited(task, exit);
            }
            Input::GpuHealth { mut unhealthy } => {
                unhealthy.sort_unstable();
                unhealthy.dedup();
                self.unhealthy_gpus = unhealthy;
            }
        }
        self.expire_request(now_ms, &mut outputs);
        self.fence_if_due(now_ms, &mut outputs);
        self.send_if_due(now_ms, &mut outputs);
        debug_assert_eq!(self.check_invariants(), Ok(()));
        debug_assert!(stops_before_starts(&outputs), "a start before a stop");
        outputs
    }

    /// The request answered, if `sequence` is the one in flight and of
    /// this kind; an answer to any other request is ignored.
    fn answered(&mut self, sequence: u64, kind: RequestKind) -> Option<Request> {
        let request = self.in_flight?;
        let same_kind = matches!(
            (request.kind, kind),
            (RequestKind::Register, RequestKind::Register)
                | (RequestKind::Heartbeat { .. }, RequestKind::Heartbeat { .. })
        );
        if request.sequence != sequence || !same_kind {
            return None;
        }
        self.in_flight = None;
        Some(request)
    }

    fn answered_heartbeat(&mut self, sequence: u64) -> Option<Request> {
        self.answered(sequence, RequestKind::Heartbeat { long_poll: false })
    }

    fn register_failed(&mut self, now_ms: u64) {
        self.next_send_ms = now_ms + self.register_backoff_ms;
        self.register_backoff_ms = (self.register_backoff_ms * 2).min(REGISTER_BACKOFF_MAX_MS);
    }

    fn renew(&mut self, sent_ms: u64, outputs: &mut Vec<Output<L>>) {
        // One request at a time: an answered request was sent after the
        // last renewal, except a lease record from a skewed clock.
        self.last_renewal_ms = self.last_renewal_ms.max(sent_ms);
        outputs.push(Output::WriteLease {
            last_renewal_ms: self.last_renewal_ms,
            lease_ms: self.lease_ms,
            fence_deadline_ms: self.fence_deadline_ms(),
        });
    }

    fn exited(&mut self, id: TaskId, exit: TaskExit) {
        let Some(task) = self.tasks.get_mut(&id) else {
            return;
        };
        if !task.live() {
            return;
        }
        task.fenced |= exit == TaskExit::Fenced;
        task.state = TaskState::Exited {
            exit,
            reported_in: None,
        };
    }

    /// Gives up on a request past its deadline, as a network failure.
    fn expire_request(&mut self, now_ms: u64, outputs: &mut Vec<Output<L>>) {
        let Some(request) = self.in_flight else {
            return;
        };
        if now_ms < request.deadline_ms {
            return;
        }
        self.in_flight = None;
        outputs.push(Output::Report(Report::NoAnswer {
            sequence: request.sequence,
        }));
        match request.kind {
            RequestKind::Register => self.register_failed(now_ms),
            RequestKind::Heartbeat { .. } => {
                self.unanswered = true;
                self.next_send_ms = now_ms + HEARTBEAT_RETRY_MS;
            }
        }
    }

    fn fence_if_due(&mut self, now_ms: u64, outputs: &mut Vec<Output<L>>) {
        if now_ms < self.fence_at_ms() {
            return;
        }
        let live: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(_, task)| task.state == TaskState::Running)
            .map(|(&id, _)| id)
            .collect();
        if !self.fenced {
            self.fenced = true;
            if !live.is_empty() {
                outputs.push(Output::Report(Report::Fenced));
            }
        }
        for id in live {
            self.stop(id, true, outputs);
        }
        // Tasks already stopping keep their stop; the runtime's fence
        // deadline cuts their grace.
        for task in self.tasks.values_mut() {
            if task.state == TaskState::Stopping {
                task.fenced = true;
            }
        }
    }

    fn stop(&mut self, id: TaskId, fenced: bool, outputs: &mut Vec<Output<L>>) {
        let Some(task) = self.tasks.get_mut(&id) else {
            return;
        };
        debug_assert_eq!(task.state, TaskState::Running);
        let (signal, grace) = match self.desired.get(&id) {
            Some(desired) => (desired.stop_signal, desired.grace_period_ms),
            None => (task.stop_signal, task.grace_period_ms),
        };
        task.state = TaskState::Stopping;
        task.fenced |= fenced;
        outputs.push(Output::StopTask {
            task: id,
            signal,
            grace_ms: stop_grace_ms(Some(grace), fenced),
            fenced,
        });
    }

    /// Whether the server wants `id` to run.
    fn wanted(&self, id: &TaskId) -> bool {
        !self.fenced && self.desired.get(id).is_some_and(|d| !d.stop)
    }

    fn reconcile(&mut self, outputs: &mut Vec<Output<L>>) {
        // Stops first: what is not wanted (marked stop, not listed, another
        // generation).
        let unwanted: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(id, task)| task.state == TaskState::Running && !self.wanted(id))
            .map(|(&id, _)| id)
            .collect();
        for id in unwanted {
            self.stop(id, self.fenced, outputs);
        }
        // Starts are made only here, from the answer just taken: the server
        // may treat a task that a later heartbeat does not report as not
        // running, so a start from an older answer could outlive that.
        if self.fenced {
            return;
        }
        let starts: Vec<TaskId> = self
            .desired
            .values()
            .filter(|d| !d.stop && !self.tasks.contains_key(&d.task) && !self.held_back(d))
            .map(|d| d.task)
            .collect();
        for id in starts {
            let Some(desired) = self.desired.get(&id) else {
                continue;
            };
            // Two starts of one answer may conflict with each other only if
            // the server double-booked a GPU or placed one job twice here;
            // the second waits.
            if self.held_back(desired) {
                continue;
            }
            outputs.push(Output::StartTask {
                task: id,
                job: desired.job,
                gpus: desired.gpus.clone(),
                launch: desired.launch.clone(),
            });
            self.tasks.insert(
                id,
                Task {
                    job: Some(desired.job),
                    gpus: Some(desired.gpus.clone()),
                    stop_signal: desired.stop_signal,
                    grace_period_ms: desired.grace_period_ms,
                    state: TaskState::Running,
                    fenced: false,
                    reported_running: false,
                },
            );
        }
    }

    /// Whether a start must wait: a task it replaces (another generation of
    /// its allocation, another task of its job that is not wanted, a task of
    /// unknown job or GPUs that is not wanted, or one holding one of its
    /// GPUs that is not wanted) still runs.
    fn held_back(&self, desired: &DesiredTask<L>) -> bool {
        self.tasks.iter().any(|(id, task)| {
            if !task.live() || *id == desired.task {
                return false;
            }
            if id.allocation == desired.task.allocation {
                return true;
            }
            if self.wanted(id) {
                // The server placed both; a job's tasks on one node, or
                // shares of one GPU, may run together.
                return false;
            }
            let same_job = task.job.is_none_or(|job| job == desired.job);
            let shares_gpu = task
                .gpus
                .as_ref()
                .is_none_or(|gpus| gpus.iter().any(|g| desired.gpus.contains(g)));
            same_job || shares_gpu
        })
    }

    /// Forgets the tasks that ended, whose end the heartbeat `sequence` (or
    /// an earlier one) reported, and that its answer no longer lists.
    fn forget(&mut self, sequence: u64, outputs: &mut Vec<Output<L>>) {
        let done: Vec<TaskId> = self
            .tasks
            .iter()
            .filter(|(id, task)| {
                matches!(task.state, TaskState::Exited { reported_in: Some(s), .. } if s <= sequence)
                    && !self.desired.contains_key(id)
            })
            .map(|(&id, _)| id)
            .collect();
        for id in done {
            self.tasks.remove(&id);
            outputs.push(Output::ForgetTask { task: id });
        }
    }

    /// Something the server should hear about now rather than at the next
    /// period: an exit, a start, or a change of GPU health.
    fn news(&self) -> bool {
        self.unhealthy_gpus != self.unhealthy_reported
            || self.tasks.values().any(|task| match task.state {
                TaskState::Running => !task.reported_running,
                TaskState::Stopping => false,
                TaskState::Exited { reported_in, .. } => reported_in.is_none(),
            })
    }

    fn send_if_due(&mut self, now_ms: u64, outputs: &mut Vec<Output<L>>) {
        let news = self.registered && self.news();
        match self.in_flight {
            // A long poll in flight is abandoned for news (the answer to it
            // will be ignored); any other request is waited for.
            Some(Request {
                kind: RequestKind::Heartbeat { long_poll: true },
                ..
            }) if news => {}
            Some(_) => return,
            None if news || now_ms >= self.next_send_ms => {}
            None => return,
        }
        self.sequence += 1;
        let sequence = self.sequence;
        let remaining = self.fence_at_ms().saturating_sub(now_ms);
        if !self.registered {
            let limit = if remaining == 0 {
                REQUEST_LIMIT_MS
            } else {
                remaining.min(REQUEST_LIMIT_MS)
            };
            self.in_flight = Some(Request {
                kind: RequestKind::Register,
                sequence,
                sent_ms: now_ms,
                deadline_ms: now_ms + limit,
            });
            outputs.push(Output::SendRegister {
                sequence,
                deadline_ms: now_ms + limit,
            });
            return;
        }
        // The server renews the lease when the request arrives: the lease
        // counts from when it was sent. An answer is given up once the
        // lease could have run out (a black-holed connection must not delay
        // fencing), once the long poll plus [`ANSWER_MARGIN_MS`] has
        // passed, and early enough to leave [`FAILOVER_RESERVE_MS`] for
        // one more try while there is room for two: a server that stopped
        // answering (paused, or a leader deposed) is left in time to try
        // another before the fence. A try after one that got no answer asks
        // for no wait: the next server may be a new leader, whose first
        // answer is worth having at once.
        let budget = if remaining == 0 {
            REQUEST_LIMIT_MS
        } else if remaining >= 2 * FAILOVER_RESERVE_MS {
            remaining - FAILOVER_RESERVE_MS
        } else {
            remaining
        };
        let wait_ms = if news || self.unanswered {
            0
        } else {
            self.heartbeat_ms
                .min(remaining / 3)
                .min(budget.saturating_sub(ANSWER_MARGIN_MS))
        };
        let limit = budget.min(wait_ms + ANSWER_MARGIN_MS);
        let observed: Vec<ObservedTask> = self
            .tasks
            .iter()
            .map(|(&id, task)| task.observed(id))
            .collect();
        for task in self.tasks.values_mut() {
            match &mut task.state {
                TaskState::Running | TaskState::Stopping => task.reported_running = true,
                TaskState::Exited { reported_in, .. } => {
                    reported_in.get_or_insert(sequence);
                }
            }
        }
        self.unhealthy_reported = self.unhealthy_gpus.clone();
        self.in_flight = Some(Request {
            kind: RequestKind::Heartbeat {
                long_poll: wait_ms > 0,
            },
            sequence,
            sent_ms: now_ms,
            deadline_ms: now_ms + limit,
        });
        outputs.push(Output::SendHeartbeat {
            sequence,
            epoch: self.epoch,
            observed,
            unhealthy_gpus: self.unhealthy_gpus.clone(),
            known_version: self.version,
            wait_ms,
            deadline_ms: now_ms + limit,
        });
    }

    /// Checks the state is one the rules can reach.
    pub fn check_invariants(&self) -> Result<(), String> {
        if let Some(request) = self.in_flight
            && request.sequence != self.sequence
        {
            return Err(format!(
                "request {} in flight but {} was the last sent",
                request.sequence, self.sequence
            ));
        }
        for (id, task) in &self.tasks {
            if self.fenced && task.state == TaskState::Running {
                return Err(format!("fenced, yet {id:?} runs without a stop"));
            }
            if let TaskState::Exited {
                reported_in: Some(sequence),
                ..
            } = task.state
                && sequence > self.sequence
            {
                return Err(format!("{id:?} reported in a heartbeat not yet sent"));
            }
            if self.fenced && task.live() && !task.fenced {
                return Err(format!("fenced, yet {id:?} is not marked fenced"));
            }
        }
        Ok(())
    }
}

fn stops_before_starts<L>(outputs: &[Output<L>]) -> bool {
    let first_start = outputs
        .iter()
        .position(|o| matches!(o, Output::StartTask { .. }));
    let last_stop = outputs
        .iter()
        .rposition(|o| matches!(o, Output::StopTask { .. }));
    match (first_start, last_stop) {
        (Some(start), Some(stop)) => stop < start,
        _ => true,
    }
}
