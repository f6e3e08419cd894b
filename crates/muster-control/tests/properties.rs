//! Property tests: any sequence of inputs keeps every invariant (checked by
//! `check_invariants` after each one, and by the control plane itself in
//! debug builds), and what the persistence rules write, read back, is the
//! state: `restore(persist(s)) == s`.

use muster_control::{
    ControlConfig, ControlPlane, Input, MemoryStore, Observed, Output, Records, Software,
};
use muster_model::{
    CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, JobSpec, MemoryMib, NodeName, NodeSpec,
    PoolName, RackName, Time,
};
use muster_sched::{SchedulingPolicy, schedule};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

const NODES: [&str; 3] = ["a", "b", "c"];

#[derive(Debug, Clone)]
enum Step {
    Submit {
        gpus: u32,
        nodes: u32,
        retry: bool,
        limited: bool,
        /// Wait for the job this many submissions back, of this kind
        /// (0 ok, 1 any, 2 notok).
        after: Option<(u64, u8)>,
        /// Submit as an array of this many elements, at most 2 at once.
        array: Option<u32>,
    },
    Cancel(u64),
    Register {
        node: usize,
        gpus: u32,
        mixed: bool,
    },
    /// Report on a node: for each of its desired tasks, by the pattern's
    /// bits: running, exited 0, exited 1, fenced, or left out.
    Report {
        node: usize,
        pattern: u32,
        stale_epoch: bool,
    },
    Cycle,
    Tick {
        advance_ms: u64,
    },
    Cordon {
        node: usize,
        cordoned: bool,
    },
    Drain(usize),
    Remove {
        node: usize,
        force: bool,
    },
    GpuHealth {
        node: usize,
        bad: Option<u32>,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => (1u32..=4, 1u32..=2, any::<bool>(), any::<bool>(), prop::option::of((1u64..4, 0u8..3)), prop::option::weighted(0.2, 2u32..=5))
            .prop_map(|(gpus, nodes, retry, limited, after, array)| Step::Submit { gpus, nodes, retry, limited, after, array }),
        1 => (1u64..12).prop_map(Step::Cancel),
        2 => (0..NODES.len(), 1u32..=4, any::<bool>())
            .prop_map(|(node, gpus, mixed)| Step::Register { node, gpus, mixed }),
        5 => (0..NODES.len(), any::<u32>(), prop::bool::weighted(0.1))
            .prop_map(|(node, pattern, stale_epoch)| Step::Report { node, pattern, stale_epoch }),
        4 => Just(Step::Cycle),
        2 => prop_oneof![Just(500u64), Just(5_000), Just(11_000), Just(4_000_000)]
            .prop_map(|advance_ms| Step::Tick { advance_ms }),
        1 => (0..NODES.len(), any::<bool>())
            .prop_map(|(node, cordoned)| Step::Cordon { node, cordoned }),
        1 => (0..NODES.len()).prop_map(Step::Drain),
        1 => (0..NODES.len(), any::<bool>()).prop_map(|(node, force)| Step::Remove { node, force }),
        1 => (0..NODES.len(), prop::option::of(0u32..4))
            .prop_map(|(node, bad)| Step::GpuHealth { node, bad }),
    ]
}

fn spec(name: &str, gpus: u32, mixed: bool) -> NodeSpec {
    NodeSpec {
        name: NodeName::from(name),
        pool: PoolName::from("default"),
        rack: RackName::from("r1"),
        gpus: (0..gpus)
            .map(|index| GpuSpec {
                index,
                uuid: format!("GPU-{name}-{index}"),
                model: GpuModel::new(if mixed && index % 2 == 1 {
                    "L4"
                } else {
                    "H100-80GB"
                }),
                memory: MemoryMib(80 * 1024),
                nvlink_domain: 0,
            })
            .collect(),
        cpu: CpuMilli(64_000),
        memory: MemoryMib(512 * 1024),
    }
}

/// The durable part of a state, for comparison: a pending job's place in
/// line and reason are memory only (the next cycle finds them again), and
/// leases start anew at a restore.
fn durable(records: Records, now: Time) -> Records {
    let mut records = records;
    for job in &mut records.jobs {
        job.queue_position = None;
        if job.state == muster_control::JobState::Pending {
            job.pending_reason = None;
        }
    }
    for node in &mut records.nodes {
        node.last_heartbeat = now;
    }
    records
}

fn run(steps: &[Step]) -> Result<(), TestCaseError> {
    let config = ControlConfig::default();
    let mut control = ControlPlane::new(config.clone());
    let mut store = MemoryStore::default();
    let mut now = Time(1_000);
    let mut next_job = 1u64;
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    for step in steps {
        let outputs: Vec<Output> = match step {
            Step::Submit {
                gpus,
                nodes,
                retry,
                limited,
                after,
                array,
            } => {
                let mut job =
                    JobSpec::simple("job", "default", GpuRequest::Whole(*gpus), vec!["x".into()]);
                job.nodes = *nodes;
                if let Some((back, kind)) = after
                    && next_job > *back
                {
                    job.after = vec![muster_model::Dependency {
                        job: JobId(next_job - back),
                        kind: match kind {
                            0 => muster_model::DependencyKind::Ok,
                            1 => muster_model::DependencyKind::Any,
                            _ => muster_model::DependencyKind::NotOk,
                        },
                    }];
                }
                job.retry.on_node_failure = *retry;
                if *limited {
                    job.max_runtime = Some(std::time::Duration::from_secs(6));
                }
                if let Some(count) = array {
                    job.array = Some(
                        muster_model::ArraySpec::parse(&format!("0-{}%2", count - 1))
                            .expect("a valid array"),
                    );
                }
                let id = JobId(next_job);
                next_job += u64::from(array.unwrap_or(1));
                control
                    .handle(
                        now,
                        Input::Submit {
                            id,
                            spec: job,
                            user: "u".into(),
                        },
                    )
                    .unwrap_or_default()
            }
            Step::Cancel(id) => control
                .handle(now, Input::Cancel { job: JobId(*id) })
                .unwrap_or_default(),
            Step::Register { node, gpus, mixed } => control
                .handle(
                    now,
                    Input::Register {
                        spec: spec(NODES[*node], *gpus, *mixed),
                        address: "10.0.0.1".into(),
                        software: Software::default(),
                    },
                )
                .unwrap_or_default(),
            Step::Report {
                node,
                pattern,
                stale_epoch,
            } => {
                let name = NodeName::from(NODES[*node]);
                let Some(epoch) = control.node(&name).map(|n| n.epoch) else {
                    continue;
                };
                let observed = control
                    .desired(&name)
                    .iter()
                    .enumerate()
                    .filter_map(|(i, task)| {
                        let base = Observed {
                            allocation: task.allocation,
                            generation: task.generation,
                            exited: None,
                            fenced: false,
                            memory_limit: false,
                        };
                        match (pattern >> (3 * i)) & 7 {
                            0..=2 => Some(base),
                            3 => Some(Observed {
                                exited: Some(Some(0)),
                                ..base
                            }),
                            4 => Some(Observed {
                                exited: Some(Some(1)),
                                ..base
                            }),
                            5 => Some(Observed {
                                exited: Some(None),
                                fenced: true,
                                ..base
                            }),
                            6 => Some(Observed {
                                exited: Some(None),
                                ..base
                            }),
                            _ => None,
                        }
                    })
                    .collect();
                let epoch = if *stale_epoch {
                    epoch.saturating_sub(1)
                } else {
                    epoch
                };
                control
                    .handle(
                        now,
                        Input::Heartbeat {
                            node: name,
                            epoch,
                            sequence: 0,
                            observed,
                            unhealthy: None,
                        },
                    )
                    .unwrap_or_default()
            }
            Step::Cycle => {
                let (snapshot, pending) = control.scheduling_input(now);
                match schedule(&snapshot, &pending, &SchedulingPolicy::default(), &mut rng) {
                    Ok(outcome) => control.apply_outcome(now, &outcome),
                    Err(_) => Vec::new(),
                }
            }
            Step::Tick { advance_ms } => {
                now = now.plus_millis(*advance_ms);
                control.handle(now, Input::Tick).unwrap_or_default()
            }
            Step::Cordon { node, cordoned } => control
                .handle(
                    now,
                    Input::Cordon {
                        node: NodeName::from(NODES[*node]),
                        cordoned: *cordoned,
                    },
                )
                .unwrap_or_default(),
            Step::Drain(node) => control
                .handle(
                    now,
                    Input::Drain {
                        node: NodeName::from(NODES[*node]),
                    },
                )
                .unwrap_or_default(),
            Step::Remove { node, force } => control
                .handle(
                    now,
                    Input::RemoveNode {
                        node: NodeName::from(NODES[*node]),
                        force: *force,
                    },
                )
                .unwrap_or_default(),
            Step::GpuHealth { node, bad } => {
                let name = NodeName::from(NODES[*node]);
                let Some(epoch) = control.node(&name).map(|n| n.epoch) else {
                    continue;
                };
                control
                    .handle(
                        now,
                        Input::GpuHealth {
                            node: name,
                            epoch,
                            unhealthy: bad.iter().copied().collect(),
                        },
                    )
                    .unwrap_or_default()
            }
        };
        prop_assert_eq!(control.check_invariants(), Ok(()), "after {:?}", step);
        store.write(control.changed_records(&outputs));
        // What the store holds reads back as the state.
        let restored =
            ControlPlane::restore(config.clone(), store.load(now, config.retention_ms), now)
                .map_err(|e| TestCaseError::fail(format!("after {step:?}: {e}")))?;
        prop_assert_eq!(
            durable(restored.records(), now),
            durable(control.records(), now),
            "after {:?}",
            step
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn any_inputs_keep_the_invariants_and_persist_exactly(steps in prop::collection::vec(step(), 1..60)) {
        run(&steps)?;
    }
}
