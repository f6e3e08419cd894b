//! The agent core through its public inputs and outputs: unit scenarios,
//! then property tests over random inputs (answers, failures, duplicates,
//! exits, time) that check the safety rules after every step.

use muster_model::Signal;
use muster_node::{
    ANSWER_MARGIN_MS, AdoptedTask, AgentCore, CoreConfig, DesiredTask, FAILOVER_RESERVE_MS,
    FENCED_GRACE_MS, HEARTBEAT_RETRY_MS, HeartbeatFailure, Input, LeaseRecord, Output,
    REGISTER_BACKOFF_MAX_MS, REGISTER_BACKOFF_MIN_MS, Report, TaskExit, TaskId,
};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const LEASE_MS: u64 = 10_000;
const HEARTBEAT_MS: u64 = 2_000;
const MARGIN_MS: u64 = 3_000;
/// `min(margin, lease / 4)`.
const EFFECTIVE_MARGIN_MS: u64 = 2_500;

fn id(allocation: u64, generation: u64) -> TaskId {
    TaskId {
        allocation,
        generation,
    }
}

fn want(allocation: u64, generation: u64, job: u64, gpus: &[u32]) -> DesiredTask<u64> {
    DesiredTask {
        task: id(allocation, generation),
        job,
        gpus: gpus.to_vec(),
        stop: false,
        stop_signal: Signal::Usr1,
        grace_period_ms: 30_000,
        launch: allocation * 1000 + generation,
    }
}

fn stop(mut desired: DesiredTask<u64>) -> DesiredTask<u64> {
    desired.stop = true;
    desired
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Register,
    Heartbeat,
}

/// One agent core, a clock, and the request it has in flight.
struct Node {
    core: AgentCore<u64>,
    now: u64,
    in_flight: Option<(Kind, u64)>,
    sent: Vec<Output<u64>>,
    /// The outputs of `AgentCore::new`.
    first: Vec<Output<u64>>,
    /// Registrations answered (each issues the next epoch, from 77).
    registrations: u64,
}

impl Node {
    fn fresh() -> Node {
        Node::with(None, Vec::new())
    }

    fn with(lease: Option<LeaseRecord>, adopted: Vec<AdoptedTask>) -> Node {
        let config = CoreConfig {
            fence_margin_ms: MARGIN_MS,
        };
        let (core, outputs) = AgentCore::new(config, 1_000, lease, adopted);
        let mut node = Node {
            core,
            now: 1_000,
            in_flight: None,
            sent: Vec::new(),
            first: Vec::new(),
            registrations: 0,
        };
        node.note(&outputs);
        node.first = outputs;
        node
    }

    fn note(&mut self, outputs: &[Output<u64>]) {
        for output in outputs {
            match output {
                Output::SendRegister { sequence, .. } => {
                    self.in_flight = Some((Kind::Register, *sequence));
                    self.sent.push(output.clone());
                }
                Output::SendHeartbeat { sequence, .. } => {
                    self.in_flight = Some((Kind::Heartbeat, *sequence));
                    self.sent.push(output.clone());
                }
                _ => {}
            }
        }
    }

    fn step(&mut self, input: Input<u64>) -> Vec<Output<u64>> {
        let outputs = self.core.handle(self.now, input);
        self.note(&outputs);
        assert_eq!(self.core.check_invariants(), Ok(()));
        outputs
    }

    fn advance(&mut self, millis: u64) -> Vec<Output<u64>> {
        self.now += millis;
        self.step(Input::Tick)
    }

    fn sequence(&self) -> u64 {
        self.in_flight.expect("a request in flight").1
    }

    /// Answers the registration in flight.
    fn registered(&mut self) -> Vec<Output<u64>> {
        self.registered_for(LEASE_MS)
    }

    /// Answers the registration in flight, with a lease of `lease_ms`.
    fn registered_for(&mut self, lease_ms: u64) -> Vec<Output<u64>> {
        let (kind, sequence) = self.in_flight.take().expect("a request in flight");
        assert_eq!(kind, Kind::Register);
        self.registrations += 1;
        self.step(Input::Registered {
            sequence,
            epoch: 76 + self.registrations,
            lease_ms,
            heartbeat_ms: HEARTBEAT_MS,
        })
    }

    /// Answers the heartbeat in flight.
    fn reply(&mut self, desired: Vec<DesiredTask<u64>>) -> Vec<Output<u64>> {
        self.reply_for(LEASE_MS, desired)
    }

    /// Answers the heartbeat in flight, with a lease of `lease_ms`.
    fn reply_for(&mut self, lease_ms: u64, desired: Vec<DesiredTask<u64>>) -> Vec<Output<u64>> {
        let (kind, sequence) = self.in_flight.take().expect("a request in flight");
        assert_eq!(kind, Kind::Heartbeat);
        self.step(Input::HeartbeatReply {
            sequence,
            version: 1,
            lease_ms,
            desired,
        })
    }

    fn exit(&mut self, task: TaskId, exit: TaskExit) -> Vec<Output<u64>> {
        self.step(Input::TaskExited { task, exit })
    }
}

fn registered_node() -> Node {
    let mut node = Node::fresh();
    node.registered();
    node
}

fn starts(outputs: &[Output<u64>]) -> Vec<TaskId> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::StartTask { task, .. } => Some(*task),
            _ => None,
        })
        .collect()
}

fn stops(outputs: &[Output<u64>]) -> Vec<(TaskId, u64, bool)> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::StopTask {
                task,
                grace_ms,
                fenced,
                ..
            } => Some((*task, *grace_ms, *fenced)),
            _ => None,
        })
        .collect()
}

fn forgets(outputs: &[Output<u64>]) -> Vec<TaskId> {
    outputs
        .iter()
        .filter_map(|o| match o {
            Output::ForgetTask { task } => Some(*task),
            _ => None,
        })
        .collect()
}

fn heartbeat(outputs: &[Output<u64>]) -> Option<&Output<u64>> {
    outputs
        .iter()
        .find(|o| matches!(o, Output::SendHeartbeat { .. }))
}

#[test]
fn registers_first_then_heartbeats_with_increasing_sequences() {
    let mut node = Node::fresh();
    assert!(matches!(
        node.sent[..],
        [Output::SendRegister { sequence: 1, .. }]
    ));
    assert_eq!(
        node.core.epoch(),
        0,
        "no epoch before the server issues one"
    );
    let outputs = node.registered();
    assert_eq!(node.core.epoch(), 77, "the epoch the server issued");
    assert!(outputs.iter().any(|o| matches!(
        o,
        Output::WriteLease {
            last_renewal_ms: 1_000,
            lease_ms: LEASE_MS,
            fence_deadline_ms: 9_750,
        }
    )));
    let Some(Output::SendHeartbeat {
        sequence,
        wait_ms,
        deadline_ms,
        ..
    }) = heartbeat(&outputs)
    else {
        panic!("a heartbeat at once: {outputs:?}");
    };
    assert_eq!(*sequence, 2);
    // The lease left before fencing bounds the wait and the request, less
    // a reserve for one more try, and so does the long poll plus a
    // margin: a server that stopped answering is left in time to try
    // another before the fence.
    let remaining = 1_000 + LEASE_MS - EFFECTIVE_MARGIN_MS - 1_000;
    let budget = remaining - FAILOVER_RESERVE_MS;
    assert_eq!(
        *wait_ms,
        HEARTBEAT_MS
            .min(remaining / 3)
            .min(budget - ANSWER_MARGIN_MS)
    );
    assert_eq!(
        *deadline_ms,
        1_000 + budget.min(*wait_ms + ANSWER_MARGIN_MS)
    );
    assert!(*deadline_ms + FAILOVER_RESERVE_MS <= 1_000 + remaining);
    // A changed desired set (version 0 to 1): the next long poll goes at
    // once.
    let outputs = node.reply(Vec::new());
    assert!(matches!(
        heartbeat(&outputs),
        Some(Output::SendHeartbeat { sequence: 3, wait_ms, .. }) if *wait_ms > 0
    ));
    // Unchanged: the next one goes a heartbeat period after the last was
    // sent.
    let outputs = node.reply(Vec::new());
    assert!(heartbeat(&outputs).is_none());
    assert!(heartbeat(&node.advance(HEARTBEAT_MS - 1)).is_none());
    let outputs = node.advance(1);
    assert!(matches!(
        heartbeat(&outputs),
        Some(Output::SendHeartbeat { sequence: 4, .. })
    ));
}

#[test]
fn a_reply_to_an_older_request_is_ignored() {
    let mut node = registered_node();
    let old = node.sequence();
    // The request times out; the next one goes out.
    node.now += LEASE_MS;
    node.step(Input::Tick);
    node.advance(HEARTBEAT_RETRY_MS);
    assert!(node.sequence() > old);
    // A late (or duplicated) answer to the old request starts nothing.
    let outputs = node.step(Input::HeartbeatReply {
        sequence: old,
        version: 9,
        lease_ms: LEASE_MS,
        desired: vec![want(1, 1, 1, &[0])],
    });
    assert!(outputs.is_empty(), "{outputs:?}");
    // The answer to the newest one counts.
    let outputs = node.reply(vec![want(1, 1, 1, &[0])]);
    assert_eq!(starts(&outputs), vec![id(1, 1)]);
}

/// Issue 9, fault-simulation seed 63111: allocation 14 was placed on the GPU
/// that allocation 7 still held; the agent started 14 before stopping 7.
#[test]
fn a_start_waits_until_the_task_on_its_gpus_is_gone() {
    let mut node = registered_node();
    node.reply(vec![want(7, 7, 3, &[0, 1])]);
    node.advance(HEARTBEAT_MS);
    let outputs = node.reply(vec![want(14, 14, 12, &[1, 2])]);
    assert_eq!(stops(&outputs), vec![(id(7, 7), 30_000, false)]);
    assert!(starts(&outputs).is_empty(), "{outputs:?}");
    // The exit is news: reported at once.
    let outputs = node.exit(id(7, 7), TaskExit::Signal(15));
    let Some(Output::SendHeartbeat { observed, .. }) = heartbeat(&outputs) else {
        panic!("the exit is reported at once: {outputs:?}");
    };
    assert!(
        observed
            .iter()
            .any(|o| o.task == id(7, 7) && o.exited == Some(None))
    );
    let outputs = node.reply(vec![want(14, 14, 12, &[1, 2])]);
    assert_eq!(starts(&outputs), vec![id(14, 14)]);
    assert_eq!(forgets(&outputs), vec![id(7, 7)]);
}

#[test]
fn stops_come_before_starts() {
    let mut node = registered_node();
    node.reply(vec![want(1, 1, 1, &[0]), want(2, 2, 2, &[1])]);
    node.advance(HEARTBEAT_MS);
    let outputs = node.reply(vec![want(1, 1, 1, &[0]), want(3, 3, 3, &[2])]);
    let first_start = outputs
        .iter()
        .position(|o| matches!(o, Output::StartTask { .. }));
    let stop = outputs
        .iter()
        .position(|o| matches!(o, Output::StopTask { .. }));
    assert!(stop < first_start, "{outputs:?}");
    assert_eq!(starts(&outputs), vec![id(3, 3)]);
}

#[test]
fn a_new_attempt_waits_for_the_old_attempt_of_its_job() {
    let mut node = registered_node();
    node.reply(vec![want(7, 3, 100, &[0])]);
    node.advance(HEARTBEAT_MS);
    // Job 100's next attempt, on other GPUs, and a new generation of 7.
    let outputs = node.reply(vec![want(9, 8, 100, &[1])]);
    assert_eq!(stops(&outputs).len(), 1);
    assert!(starts(&outputs).is_empty());
    node.advance(HEARTBEAT_MS);
    assert!(starts(&node.reply(vec![want(9, 8, 100, &[1])])).is_empty());
    node.exit(id(7, 3), TaskExit::Signal(15));
    let outputs = node.reply(vec![want(9, 8, 100, &[1])]);
    assert_eq!(starts(&outputs), vec![id(9, 8)]);
}

#[test]
fn shares_of_one_gpu_that_the_server_wants_run_together() {
    let mut node = registered_node();
    let outputs = node.reply(vec![want(1, 1, 1, &[0]), want(2, 2, 2, &[0])]);
    assert_eq!(starts(&outputs), vec![id(1, 1), id(2, 2)]);
}

#[test]
fn a_task_marked_stop_gets_its_jobs_signal_and_grace() {
    let mut node = registered_node();
    node.reply(vec![want(1, 1, 1, &[0])]);
    node.advance(HEARTBEAT_MS);
    let outputs = node.reply(vec![stop(want(1, 1, 1, &[0]))]);
    assert!(outputs.iter().any(|o| matches!(
        o,
        Output::StopTask {
            signal: Signal::Usr1,
            grace_ms: 30_000,
            fenced: false,
            ..
        }
    )));
    // Not stopped twice.
    node.advance(HEARTBEAT_MS);
    assert!(stops(&node.reply(vec![stop(want(1, 1, 1, &[0]))])).is_empty());
}

#[test]
fn fences_a_margin_before_the_lease_ends_and_starts_nothing_until_renewed() {
    let mut node = registered_node();
    let renewed_at = node.now;
    node.reply(vec![want(1, 1, 1, &[0])]);
    assert_eq!(
        node.core.fence_at_ms(),
        renewed_at + LEASE_MS - EFFECTIVE_MARGIN_MS
    );
    assert_eq!(
        node.core.fence_deadline_ms(),
        renewed_at + LEASE_MS - EFFECTIVE_MARGIN_MS / 2
    );
    // Nothing answers from now on.
    let mut fenced_at = None;
    while fenced_at.is_none() {
        let wake = node.core.next_wake_ms();
        assert!(wake > node.now);
        node.now = wake;
        let outputs = node.step(Input::Tick);
        if let Some(&(task, grace, fenced)) = stops(&outputs).first() {
            assert_eq!((task, grace, fenced), (id(1, 1), FENCED_GRACE_MS, true));
            assert!(outputs.contains(&Output::Report(Report::Fenced)));
            fenced_at = Some(node.now);
        }
    }
    assert_eq!(fenced_at, Some(renewed_at + LEASE_MS - EFFECTIVE_MARGIN_MS));
    assert!(node.core.fenced());
    // Its exit is reported as fenced, at once.
    let outputs = node.exit(id(1, 1), TaskExit::Signal(9));
    let Some(Output::SendHeartbeat { observed, .. }) = heartbeat(&outputs) else {
        panic!("{outputs:?}");
    };
    assert!(
        observed
            .iter()
            .any(|o| o.task == id(1, 1) && o.fenced && o.exited == Some(None)),
        "{observed:?}"
    );
    // Renewed: the task is not started again (it ran here).
    let outputs = node.reply(vec![want(1, 1, 1, &[0])]);
    assert!(starts(&outputs).is_empty());
    assert!(!node.core.fenced());
}

#[test]
fn a_task_is_forgotten_only_once_its_exit_was_reported_and_it_is_no_longer_listed() {
    let mut node = registered_node();
    node.reply(vec![want(1, 1, 1, &[0])]);
    node.reply(vec![want(1, 1, 1, &[0])]);
    // It exits while the server still lists it; its exit goes out at once.
    let outputs = node.exit(id(1, 1), TaskExit::Code(0));
    assert!(heartbeat(&outputs).is_some());
    // An answer that still lists it: kept.
    let outputs = node.reply(vec![want(1, 1, 1, &[0])]);
    assert!(forgets(&outputs).is_empty());
    node.advance(HEARTBEAT_MS);
    let outputs = node.reply(Vec::new());
    assert_eq!(forgets(&outputs), vec![id(1, 1)]);
    assert_eq!(node.core.tasks().count(), 0);
}

#[test]
fn an_exit_not_yet_reported_is_kept_even_when_the_server_stops_listing_it() {
    let mut node = registered_node();
    node.reply(vec![want(1, 1, 1, &[0])]);
    // A short request is in flight (it reports the start): not abandoned.
    let outputs = node.exit(id(1, 1), TaskExit::Code(3));
    assert!(heartbeat(&outputs).is_none());
    let outputs = node.reply(Vec::new());
    assert!(
        forgets(&outputs).is_empty(),
        "not reported yet: {outputs:?}"
    );
    let Some(Output::SendHeartbeat { observed, .. }) = heartbeat(&outputs) else {
        panic!("the exit goes out at once: {outputs:?}");
    };
    assert_eq!(observed[0].exited, Some(Some(3)));
    let outputs = node.reply(Vec::new());
    assert_eq!(forgets(&outputs), vec![id(1, 1)]);
}

#[test]
fn a_refused_heartbeat_registers_again_and_takes_the_new_epoch() {
    let mut node = registered_node();
    let sequence = node.sequence();
    node.in_flight = None;
    let outputs = node.step(Input::HeartbeatFailed {
        sequence,
        failure: HeartbeatFailure::Refused,
    });
    assert!(outputs.contains(&Output::Report(Report::RegisterAgain)));
    assert!(outputs.iter().any(|o| matches!(
        o,
        Output::SendRegister { sequence: s, .. } if *s == sequence + 1
    )));
    assert!(!node.core.registered());
    node.registered();
    assert_eq!(node.core.epoch(), 78);
    let heartbeat = node.sent.iter().rev().find_map(|o| match o {
        Output::SendHeartbeat { epoch, .. } => Some(*epoch),
        _ => None,
    });
    assert_eq!(heartbeat, Some(78), "heartbeats carry the new epoch");
}

/// A leader paused with a 20 s node lease (the high-availability
/// default): the agent's tries against servers that do not answer are cut
/// so that several fit before the fence, each after the first asks for no
/// wait (a new leader answers it at once) and has a whole answer margin,
/// and none leaves less than a reserve for the next unless the fence is
/// that close.
#[test]
fn a_server_that_stops_answering_leaves_time_for_tries_elsewhere_before_the_fence() {
    const LEASE: u64 = 20_000;
    let mut node = Node::fresh();
    node.registered_for(LEASE);
    let renewed_at = node.now;
    node.reply_for(LEASE, vec![want(1, 1, 1, &[0])]);
    // The task's start is news: reported at once, and answered.
    node.reply_for(LEASE, vec![want(1, 1, 1, &[0])]);
    let fence = node.core.fence_at_ms();
    assert_eq!(fence, renewed_at + LEASE - MARGIN_MS);
    // Nothing answers from now on: each try runs to its deadline.
    // (sent, wait, deadline) of each try.
    let mut tries: Vec<(u64, u64, u64)> = Vec::new();
    while !node.core.fenced() {
        let wake = node.core.next_wake_ms();
        assert!(wake > node.now);
        node.now = wake;
        for output in node.step(Input::Tick) {
            if let Output::SendHeartbeat {
                wait_ms,
                deadline_ms,
                ..
            } = output
            {
                tries.push((node.now, wait_ms, deadline_ms));
            }
        }
    }
    assert!(
        tries.len() >= 4,
        "four tries (two on each of two servers) before the fence: {tries:?}"
    );
    for (index, &(sent, wait, deadline)) in tries.iter().enumerate() {
        assert!(
            deadline <= fence,
            "try {index} ends by the fence: {tries:?}"
        );
        if index > 0 {
            assert_eq!(wait, 0, "a try after one unanswered asks for no wait");
            assert_eq!(sent, tries[index - 1].2 + HEARTBEAT_RETRY_MS, "{tries:?}");
        }
        let last = index + 1 == tries.len();
        if !last {
            assert!(
                deadline - sent >= ANSWER_MARGIN_MS,
                "try {index} waits a whole answer margin: {tries:?}"
            );
        }
        if sent + 2 * FAILOVER_RESERVE_MS <= fence {
            assert!(
                deadline + FAILOVER_RESERVE_MS <= fence,
                "try {index} leaves a reserve for the next: {tries:?}"
            );
        }
    }
}

#[test]
fn network_failures_retry_heartbeats_soon_and_registrations_with_a_doubling_backoff() {
    let mut node = Node::fresh();
    let mut pause = REGISTER_BACKOFF_MIN_MS;
    for _ in 0..8 {
        let (_, sequence) = node.in_flight.take().expect("a registration");
        assert!(node.step(Input::RegisterFailed { sequence }).is_empty());
        assert_eq!(node.core.next_wake_ms(), node.now + pause);
        node.advance(pause);
        pause = (pause * 2).min(REGISTER_BACKOFF_MAX_MS);
    }
    assert_eq!(pause, REGISTER_BACKOFF_MAX_MS);
    node.registered();
    let (_, sequence) = node.in_flight.take().expect("a heartbeat");
    node.step(Input::HeartbeatFailed {
        sequence,
        failure: HeartbeatFailure::Transport,
    });
    assert_eq!(node.core.next_wake_ms(), node.now + HEARTBEAT_RETRY_MS);
}

#[test]
fn a_restarted_agent_fences_adopted_tasks_that_would_outlive_the_old_lease() {
    let adopted = vec![
        AdoptedTask {
            task: id(4, 4),
            job: Some(4),
            gpus: Some(vec![0]),
            stop_signal: Signal::Term,
            grace_period_ms: 20_000,
            exit: None,
        },
        AdoptedTask {
            task: id(5, 5),
            job: None,
            gpus: None,
            stop_signal: Signal::Term,
            grace_period_ms: 20_000,
            exit: Some(TaskExit::Code(1)),
        },
    ];
    // The last renewal was long ago: fence at once, then register.
    let lease = LeaseRecord {
        last_renewal_ms: 0,
        lease_ms: 4_000,
    };
    let config = CoreConfig {
        fence_margin_ms: MARGIN_MS,
    };
    let (core, outputs) = AgentCore::<u64>::new(config, 5_000, Some(lease), adopted);
    assert_eq!(stops(&outputs), vec![(id(4, 4), FENCED_GRACE_MS, true)]);
    assert!(
        outputs
            .iter()
            .position(|o| matches!(o, Output::StopTask { .. }))
            < outputs
                .iter()
                .position(|o| matches!(o, Output::SendRegister { .. }))
    );
    assert_eq!(core.tasks().count(), 2);
    // Within the lease, the adopted task keeps running and is reported.
    let mut node = adopted_within_lease(None);
    assert!(stops(&node.first).is_empty());
    let outputs = node.registered();
    let Some(Output::SendHeartbeat { observed, .. }) = heartbeat(&outputs) else {
        panic!("{outputs:?}");
    };
    assert_eq!(observed.len(), 1);
    assert_eq!(observed[0].exited, None);
    // The server still wants it: kept; a task on its GPU waits.
    let outputs = node.reply(vec![want(4, 4, 4, &[0])]);
    assert!(stops(&outputs).is_empty() && starts(&outputs).is_empty());
}

#[test]
fn a_task_gone_without_a_record_is_reported_as_the_node_s_failure_not_the_task_s() {
    // Its host restarted: the runtime's record names the task, but no
    // process and no exit record are left.
    let mut node = adopted_within_lease(Some(TaskExit::Vanished));
    let outputs = node.registered();
    let Some(Output::SendHeartbeat { observed, .. }) = heartbeat(&outputs) else {
        panic!("{outputs:?}");
    };
    assert_eq!(observed.len(), 1);
    assert_eq!(observed[0].exited, Some(None), "ended, with no code");
    assert!(observed[0].fenced, "the node failed: re-queued, not failed");
}

#[test]
fn an_adopted_task_of_unknown_gpus_holds_back_every_start_until_it_is_gone() {
    let adopted = vec![AdoptedTask {
        task: id(4, 4),
        job: None,
        gpus: None,
        stop_signal: Signal::Term,
        grace_period_ms: 20_000,
        exit: None,
    }];
    let mut node = Node::with(None, adopted);
    node.registered();
    let outputs = node.reply(vec![want(6, 6, 6, &[3])]);
    assert_eq!(stops(&outputs).len(), 1);
    assert!(starts(&outputs).is_empty());
    node.exit(id(4, 4), TaskExit::Signal(15));
    assert_eq!(
        starts(&node.reply(vec![want(6, 6, 6, &[3])])),
        vec![id(6, 6)]
    );
}

#[test]
fn a_failed_start_is_reported_as_exit_code_127() {
    let mut node = registered_node();
    node.reply(vec![want(1, 1, 1, &[0])]);
    node.reply(vec![want(1, 1, 1, &[0])]);
    let outputs = node.step(Input::StartFailed { task: id(1, 1) });
    let Some(Output::SendHeartbeat { observed, .. }) = heartbeat(&outputs) else {
        panic!("{outputs:?}");
    };
    assert_eq!(observed[0].exited, Some(Some(127)));
}

#[test]
fn a_long_poll_is_abandoned_for_news_and_its_answer_ignored() {
    let mut node = registered_node();
    node.reply(vec![want(1, 1, 1, &[0]), want(2, 2, 2, &[1])]);
    node.advance(HEARTBEAT_MS);
    node.reply(vec![want(1, 1, 1, &[0]), want(2, 2, 2, &[1])]);
    let poll = node.sequence();
    let outputs = node.exit(id(1, 1), TaskExit::Code(0));
    let Some(Output::SendHeartbeat {
        sequence, wait_ms, ..
    }) = heartbeat(&outputs)
    else {
        panic!("{outputs:?}");
    };
    assert_eq!((*sequence, *wait_ms), (poll + 1, 0));
    let late = node.step(Input::HeartbeatReply {
        sequence: poll,
        version: 3,
        lease_ms: LEASE_MS,
        desired: Vec::new(),
    });
    assert!(late.is_empty(), "{late:?}");
}

#[test]
fn gpu_health_changes_are_reported_at_once() {
    let mut node = registered_node();
    node.reply(Vec::new());
    let outputs = node.step(Input::GpuHealth {
        unhealthy: vec![3, 1, 3],
    });
    assert!(matches!(
        heartbeat(&outputs),
        Some(Output::SendHeartbeat { unhealthy_gpus, .. }) if unhealthy_gpus == &vec![1, 3]
    ));
}

// Property tests: random inputs, the rules checked after every step.

#[derive(Debug, Clone)]
enum Step {
    Advance(u64),
    Answer(Vec<(u64, u64, u64, Vec<u32>, bool)>),
    StaleAnswer(Vec<(u64, u64, u64, Vec<u32>, bool)>),
    Fail(bool),
    Exit(usize, i32),
    Health(Vec<u32>),
}

fn desired_strategy() -> impl Strategy<Value = Vec<(u64, u64, u64, Vec<u32>, bool)>> {
    prop::collection::vec(
        (
            1..6u64,
            1..3u64,
            1..4u64,
            prop::collection::vec(0..4u32, 0..3),
            prop::bool::weighted(0.2),
        ),
        0..4,
    )
}

fn step_strategy() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1..4_000u64).prop_map(Step::Advance),
        4 => desired_strategy().prop_map(Step::Answer),
        1 => desired_strategy().prop_map(Step::StaleAnswer),
        1 => any::<bool>().prop_map(Step::Fail),
        3 => (0..8usize, 0..3i32).prop_map(|(i, c)| Step::Exit(i, c)),
        1 => prop::collection::vec(0..4u32, 0..2).prop_map(Step::Health),
    ]
}

fn to_desired(entries: &[(u64, u64, u64, Vec<u32>, bool)]) -> Vec<DesiredTask<u64>> {
    // One entry per task, as the server lists them.
    let mut seen = BTreeSet::new();
    entries
        .iter()
        .filter(|(a, g, ..)| seen.insert((*a, *g)))
        .map(|(a, g, job, gpus, stop_it)| {
            let mut gpus = gpus.clone();
            gpus.sort_unstable();
            gpus.dedup();
            DesiredTask {
                stop: *stop_it,
                ..want(*a, *g, *job, &gpus)
            }
        })
        .collect()
}

/// What the harness knows of a task from the outputs alone.
#[derive(Debug, Clone)]
struct Seen {
    job: u64,
    gpus: Vec<u32>,
    live: bool,
    stop_issued: bool,
    /// The first heartbeat whose observed set carried its exit.
    exit_sent_in: Option<u64>,
}

struct Model {
    tasks: BTreeMap<TaskId, Seen>,
    last_sequence: u64,
    /// Send time of each request.
    sent_at: BTreeMap<u64, u64>,
    renewed_at: u64,
    lease_ms: u64,
    /// The request an answer is given to in this step.
    answering: Option<u64>,
}

fn check_outputs(
    model: &mut Model,
    now: u64,
    outputs: &[Output<u64>],
    answer: Option<(u64, &[DesiredTask<u64>])>,
) -> Result<(), TestCaseError> {
    let first_start = outputs
        .iter()
        .position(|o| matches!(o, Output::StartTask { .. }));
    let last_stop = outputs
        .iter()
        .rposition(|o| matches!(o, Output::StopTask { .. }));
    if let (Some(start), Some(stop)) = (first_start, last_stop) {
        prop_assert!(stop < start, "a stop after a start: {outputs:?}");
    }
    for output in outputs {
        match output {
            Output::SendRegister { sequence, .. } => {
                prop_assert!(*sequence > model.last_sequence);
                model.last_sequence = *sequence;
                model.sent_at.insert(*sequence, now);
            }
            Output::SendHeartbeat {
                sequence, observed, ..
            } => {
                prop_assert!(*sequence > model.last_sequence);
                model.last_sequence = *sequence;
                model.sent_at.insert(*sequence, now);
                for report in observed {
                    let seen = model.tasks.get_mut(&report.task);
                    prop_assert!(seen.is_some(), "reports an unknown task");
                    if let Some(seen) = seen {
                        prop_assert_eq!(report.exited.is_some(), !seen.live);
                        if !seen.live && seen.exit_sent_in.is_none() {
                            seen.exit_sent_in = Some(*sequence);
                        }
                    }
                }
            }
            Output::StartTask {
                task, job, gpus, ..
            } => {
                // Only from an answer just taken, and only what it wants.
                let Some((_, desired)) = answer else {
                    return Err(TestCaseError::fail("a start without an answer"));
                };
                let wanted = |id: &TaskId| desired.iter().any(|d| d.task == *id && !d.stop);
                prop_assert!(wanted(task));
                prop_assert!(!model.tasks.contains_key(task), "started twice");
                for (other, seen) in &model.tasks {
                    if !seen.live || wanted(other) {
                        continue;
                    }
                    prop_assert!(other.allocation != task.allocation);
                    prop_assert!(seen.job != *job, "two attempts of job {job}");
                    prop_assert!(
                        !seen.gpus.iter().any(|g| gpus.contains(g)),
                        "{task:?} starts on a GPU of {other:?}"
                    );
                }
                model.tasks.insert(
                    *task,
                    Seen {
                        job: *job,
                        gpus: gpus.clone(),
                        live: true,
                        stop_issued: false,
                        exit_sent_in: None,
                    },
                );
            }
            Output::StopTask { task, .. } => {
                let seen = model.tasks.get_mut(task);
                prop_assert!(seen.is_some());
                if let Some(seen) = seen {
                    prop_assert!(seen.live && !seen.stop_issued, "stopped twice");
                    seen.stop_issued = true;
                }
            }
            Output::ForgetTask { task } => {
                let Some((sequence, desired)) = answer else {
                    return Err(TestCaseError::fail("forgotten without an answer"));
                };
                let seen = model.tasks.remove(task);
                prop_assert!(seen.is_some());
                if let Some(seen) = seen {
                    prop_assert!(!seen.live);
                    prop_assert!(seen.exit_sent_in.is_some_and(|s| s <= sequence));
                    prop_assert!(!desired.iter().any(|d| d.task == *task));
                }
            }
            Output::WriteLease {
                last_renewal_ms,
                lease_ms,
                fence_deadline_ms,
            } => {
                prop_assert!(*fence_deadline_ms < last_renewal_ms + lease_ms);
                // Renewed from when the answered request was sent.
                let answered = model.answering.and_then(|s| model.sent_at.get(&s));
                prop_assert_eq!(answered, Some(last_renewal_ms));
                model.renewed_at = *last_renewal_ms;
                model.lease_ms = *lease_ms;
            }
            Output::Report(_) => {}
        }
    }
    // Fencing: past the margin before the lease ends, every live task has
    // been told to stop.
    let margin = MARGIN_MS.min(model.lease_ms / 4);
    if now + margin >= model.renewed_at + model.lease_ms {
        for (task, seen) in &model.tasks {
            prop_assert!(
                !seen.live || seen.stop_issued,
                "{task:?} runs past the fence time"
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn the_rules_hold_whatever_arrives(steps in prop::collection::vec(step_strategy(), 1..80)) {
        let config = CoreConfig { fence_margin_ms: MARGIN_MS };
        let mut now = 1_000;
        let (mut core, outputs) = AgentCore::<u64>::new(config, now, None, Vec::new());
        let mut model = Model {
            tasks: BTreeMap::new(),
            last_sequence: 0,
            sent_at: BTreeMap::new(),
            renewed_at: now,
            lease_ms: muster_node::DEFAULT_LEASE_MS,
            answering: None,
        };
        check_outputs(&mut model, now, &outputs, None)?;
        for step in steps {
            let in_flight = model.last_sequence;
            model.answering = None;
            let (outputs, answer) = match step {
                Step::Advance(millis) => {
                    now += millis;
                    (core.handle(now, Input::Tick), None)
                }
                Step::Answer(entries) | Step::StaleAnswer(entries) if !core.registered() => {
                    let _ = entries;
                    model.answering = Some(in_flight);
                    let input = Input::Registered {
                        sequence: in_flight,
                        epoch: 1,
                        lease_ms: LEASE_MS,
                        heartbeat_ms: HEARTBEAT_MS,
                    };
                    (core.handle(now, input), None)
                }
                Step::Answer(entries) => {
                    let desired = to_desired(&entries);
                    model.answering = Some(in_flight);
                    let input = Input::HeartbeatReply {
                        sequence: in_flight,
                        version: 1,
                        lease_ms: LEASE_MS,
                        desired: desired.clone(),
                    };
                    (core.handle(now, input), Some((in_flight, desired)))
                }
                Step::StaleAnswer(entries) => {
                    let input = Input::HeartbeatReply {
                        sequence: in_flight.saturating_sub(1),
                        version: 1,
                        lease_ms: LEASE_MS,
                        desired: to_desired(&entries),
                    };
                    let outputs = core.handle(now, input);
                    let acted = outputs.iter().any(|o| {
                        matches!(o, Output::StartTask { .. } | Output::ForgetTask { .. })
                    });
                    prop_assert!(!acted, "acted on a stale answer");
                    (outputs, None)
                }
                Step::Fail(refused) => {
                    let input = if core.registered() {
                        Input::HeartbeatFailed {
                            sequence: in_flight,
                            failure: if refused {
                                HeartbeatFailure::Refused
                            } else {
                                HeartbeatFailure::Transport
                            },
                        }
                    } else {
                        Input::RegisterFailed { sequence: in_flight }
                    };
                    (core.handle(now, input), None)
                }
                Step::Exit(index, code) => {
                    let live: Vec<TaskId> = model
                        .tasks
                        .iter()
                        .filter(|(_, seen)| seen.live)
                        .map(|(id, _)| *id)
                        .collect();
                    if live.is_empty() {
                        continue;
                    }
                    let task = live[index % live.len()];
                    if let Some(seen) = model.tasks.get_mut(&task) {
                        seen.live = false;
                    }
                    let exit = match code {
                        0 => TaskExit::Code(0),
                        1 => TaskExit::Signal(15),
                        _ => TaskExit::Fenced,
                    };
                    (core.handle(now, Input::TaskExited { task, exit }), None)
                }
                Step::Health(unhealthy) => (core.handle(now, Input::GpuHealth { unhealthy }), None),
            };
            let answer = answer.as_ref().map(|(s, d)| (*s, d.as_slice()));
            check_outputs(&mut model, now, &outputs, answer)?;
            prop_assert_eq!(core.check_invariants(), Ok(()));
            prop_assert!(core.next_wake_ms() > now);
        }
    }
}

/// A node restarted within its lease (renewed at 500 ms) that finds job 4's
/// task on GPU 0 again, ended as `exit` says (`None`: still running).
fn adopted_within_lease(exit: Option<TaskExit>) -> Node {
    let lease = LeaseRecord {
        last_renewal_ms: 500,
        lease_ms: LEASE_MS,
    };
    let adopted = vec![AdoptedTask {
        task: id(4, 4),
        job: Some(4),
        gpus: Some(vec![0]),
        stop_signal: Signal::Term,
        grace_period_ms: 20_000,
        exit,
    }];
    Node::with(Some(lease), adopted)
}

/// The node lease of servers sharing a store: by default long enough for
/// a takeover at the default leader lease (4 s) and heartbeat period
/// (2 s), with a leader lease to spare; a shorter one than a takeover
/// needs is refused, saying what would do.
#[test]
fn a_node_lease_outlasts_a_takeover_by_default_and_a_shorter_one_is_refused() {
    use muster_node::{lease_through_failover_ms, least_lease_through_failover_ms};
    // 7 s of takeover, 4 s of heartbeats, 3 s of margin, 3 s of a try.
    assert_eq!(least_lease_through_failover_ms(4_000, 2_000), 17_000);
    assert_eq!(
        lease_through_failover_ms(None, 4_000, 2_000, 10_000),
        Ok(21_000)
    );
    assert_eq!(
        lease_through_failover_ms(None, 500, 2_000, 10_000),
        Ok(11_375)
    );
    assert_eq!(
        lease_through_failover_ms(Some(17_000), 4_000, 2_000, 10_000),
        Ok(17_000)
    );
    let refused = lease_through_failover_ms(Some(10_000), 4_000, 2_000, 10_000)
        .expect_err("10 s under a 4 s leader lease");
    assert!(
        refused.contains("give --lease 17000 ms or more"),
        "says what would do: {refused}"
    );
    // The default is never under what it takes, whatever the leader lease.
    for leader in [500, 1_000, 2_000, 4_000, 10_000, 30_000] {
        let lease = lease_through_failover_ms(None, leader, 2_000, 10_000).expect("a default");
        assert!(lease >= least_lease_through_failover_ms(leader, 2_000));
    }
}
