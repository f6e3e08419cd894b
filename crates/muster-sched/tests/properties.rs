//! Property tests: for arbitrary clusters and jobs, no GPU share is
//! over-committed, no node capacity exceeded, gangs are all-or-nothing,
//! constraints hold, the same inputs and seed give the same outcome, and the
//! indexed placer decides exactly as the scanning one.

use muster_model::{GpuMilli, GpuModel, GpuRequest, TopologyStrength};
use muster_sched::{
    Backfill, ClusterState, ModelMask, NodeInput, PendingJob, PlacementPolicy, Placer, Scale,
    SchedulingPolicy, Scorer, Snapshot, TaskShape, TypicalWorkload, schedule,
};
use muster_testkit::{MakeJob, MakeNode, check_outcome, running_from};
use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

mod common;
use common::check_real_nodes;

const MODELS: [&str; 3] = ["H100-80GB", "A100-40GB", "L4"];

fn node_strategy() -> impl Strategy<Value = (u32, usize, u64, u8, bool, bool, u8)> {
    (
        prop_oneof![Just(1u32), Just(2), Just(4), Just(8)],
        0..MODELS.len(),
        prop_oneof![Just(8u64), Just(32), Just(96)],
        0u8..3,        // rack
        any::<bool>(), // cordoned (rare below)
        any::<bool>(), // pool inference
        0u8..10,       // unhealthy gpu chance
    )
}

fn build_nodes(raw: &[(u32, usize, u64, u8, bool, bool, u8)]) -> Vec<NodeInput> {
    raw.iter()
        .enumerate()
        .map(|(i, &(gpus, model, cpus, rack, cordon, inference, sick))| {
            let mut node = MakeNode::new(&format!("node-{i:02}"))
                .gpus(gpus, MODELS[model])
                .cpus(cpus)
                .rack(&format!("rack-{rack}"))
                .pool(if inference { "inference" } else { "default" });
            if cordon && i % 5 == 0 {
                node = node.cordoned();
            }
            if sick == 0 {
                node = node.unhealthy_gpu(0);
            }
            node.build()
        })
        .collect()
}

/// [`build_nodes`], then node `i` mixes `mix[i]` models (1: one model, up to
/// 3, interleaved: GPU `g` has model `(model + g) % mix`), and where
/// `mix[i]` is 0 the node has 65 GPUs (the engine leaves it out).
fn build_mixed_nodes(raw: &[(u32, usize, u64, u8, bool, bool, u8)], mix: &[u8]) -> Vec<NodeInput> {
    let mut nodes = build_nodes(raw);
    for (i, node) in nodes.iter_mut().enumerate() {
        let mix = mix.get(i).copied().unwrap_or(1);
        if mix == 0 {
            *node = MakeNode::new(&node.spec.name.0).gpus(65, MODELS[0]).build();
            continue;
        }
        let first = raw[i].1;
        for (g, gpu) in node.spec.gpus.iter_mut().enumerate() {
            gpu.model = GpuModel::new(MODELS[(first + g % usize::from(mix)) % MODELS.len()]);
        }
    }
    nodes
}

fn job_strategy() -> impl Strategy<Value = (u8, u32, u32, u64, u8, i32, u8, Option<u64>)> {
    (
        0u8..4,     // kind: whole, share, cpu-only, gang
        1u32..9,    // gpus
        1u32..1000, // share
        1u64..40,   // cpus
        0u8..5,     // constraint
        prop_oneof![Just(0), Just(100), Just(200)],
        0u8..3, // queue
        proptest::option::of(1u64..5000),
    )
}

fn build_job(id: u64, raw: (u8, u32, u32, u64, u8, i32, u8, Option<u64>)) -> PendingJob {
    let (kind, gpus, share, cpus, constraint, priority, queue, estimate) = raw;
    let mut job = MakeJob::new(id)
        .cpus(cpus)
        .priority(priority)
        .queue(["a", "b", "c"][queue as usize])
        .submitted_secs(id);
    job = match kind {
        0 => job.gpus(gpus),
        1 => job.share(share),
        2 => job.gpus(0),
        _ => job.gpus(gpus).tasks(1 + gpus % 3),
    };
    job = match constraint {
        0 => job.models(&[MODELS[(gpus as usize) % MODELS.len()]]),
        1 => job.pool("inference"),
        2 => job.same_rack(TopologyStrength::Required),
        3 => job.min_gpu_memory_gib(80),
        _ => job,
    };
    if let Some(secs) = estimate {
        job = job.estimate_secs(secs);
    }
    job.build()
}

fn policy_strategy() -> impl Strategy<Value = SchedulingPolicy> {
    (
        prop_oneof![
            Just(PlacementPolicy::Fgd),
            Just(PlacementPolicy::FgdConsolidate),
            Just(PlacementPolicy::BestFit),
            Just(PlacementPolicy::Packing),
            Just(PlacementPolicy::Random),
        ],
        prop_oneof![
            Just(Backfill::None),
            Just(Backfill::Easy),
            Just(Backfill::AnyFit)
        ],
        any::<bool>(),
    )
        .prop_map(|(placement, backfill, preemption)| SchedulingPolicy {
            placement,
            backfill,
            preemption,
            ..SchedulingPolicy::default()
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Two cycles: the first places jobs into an empty cluster, the second
    /// runs with those as running jobs and a new batch pending.
    #[test]
    fn outcomes_respect_capacity_gangs_and_constraints(
        raw_nodes in proptest::collection::vec(node_strategy(), 1..12),
        raw_first in proptest::collection::vec(job_strategy(), 0..30),
        raw_second in proptest::collection::vec(job_strategy(), 0..30),
        policy in policy_strategy(),
        seed in any::<u64>(),
    ) {
        let nodes = build_nodes(&raw_nodes);
        let first: Vec<PendingJob> = raw_first.into_iter().enumerate()
            .map(|(i, raw)| build_job(i as u64, raw)).collect();
        let mut snapshot = Snapshot { nodes, ..Snapshot::default() };
        let outcome = schedule(&snapshot, &first, &policy, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
        prop_assert_eq!(check_outcome(&snapshot, &first, &outcome), Ok(()));

        // Same inputs, same seed: same outcome.
        let again = schedule(&snapshot, &first, &policy, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
        prop_assert_eq!(&outcome, &again);

        for start in &outcome.started {
            let job = first.iter().find(|j| j.id == start.job).unwrap();
            snapshot.running.push(running_from(job, start.tasks.clone(), snapshot.now, None));
        }
        snapshot.now = muster_model::Time::from_secs(3600);
        let second: Vec<PendingJob> = raw_second.into_iter().enumerate()
            .map(|(i, raw)| build_job(1000 + i as u64, raw)).collect();
        let outcome = schedule(&snapshot, &second, &policy, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
        prop_assert_eq!(check_outcome(&snapshot, &second, &outcome), Ok(()));
        for preemption in &outcome.preemptions {
            let victim = snapshot.running.iter().find(|r| r.id == preemption.victim).unwrap();
            let preemptor = second.iter().find(|j| j.id == preemption.for_job).unwrap();
            prop_assert!(outcome.started.iter().any(|s| s.job == preemptor.id),
                "a preemption must make its preemptor placeable");
            if victim.queue == preemptor.queue {
                prop_assert!(victim.priority < preemptor.priority);
            }
        }
    }

    /// The indexed placer makes exactly the decisions of the scanning one,
    /// for tasks and gangs, through a sequence of placements and releases.
    #[test]
    fn indexed_placer_decides_as_the_scan_does(
        raw_nodes in proptest::collection::vec(node_strategy(), 1..16),
        mix in proptest::collection::vec(prop_oneof![4 => Just(1u8), 1 => Just(2), 1 => Just(3)], 16),
        raw_tasks in proptest::collection::vec((0u8..3, 1u32..9, 1u32..1000, 1u64..30, 0usize..4, 0usize..3), 1..80),
        policy in prop_oneof![Just(PlacementPolicy::Fgd), Just(PlacementPolicy::FgdConsolidate), Just(PlacementPolicy::BestFit), Just(PlacementPolicy::Packing)],
    ) {
        let mut cluster = ClusterState::new(build_mixed_nodes(&raw_nodes, &mix)).unwrap();
        // Memory varies so that shapes differing only in memory share an
        // index, and nodes whose memory is taken (512 GiB each) are skipped
        // when it is read.
        let shapes: Vec<TaskShape> = raw_tasks.iter().map(|&(kind, gpus, share, cpus, model, memory)| {
            let models = if model < MODELS.len() {
                cluster.model_mask(&[GpuModel::new(MODELS[model])])
            } else {
                ModelMask::ANY
            };
            TaskShape {
                container: false,
                gpus: match kind {
                    0 => GpuRequest::Whole(gpus % 5),
                    1 => GpuRequest::Shared(GpuMilli(share)),
                    _ => GpuRequest::Whole(0),
                },
                cpu_milli: cpus * 1000,
                memory_mib: [1024, 64 * 1024, 300 * 1024][memory],
                models,
                pool: None,
                min_gpu_memory_mib: 0,
                reserved: Default::default(),
            }
        }).collect();
        let workload = TypicalWorkload::from_tasks(shapes.iter(), 0.95);
        let scorer = Scorer::new(policy, workload, Scale::of(&cluster));
        let mut indexed = Placer::new(cluster.clone(), scorer.clone());
        let mut scanning = Placer::new_scanning(cluster, scorer);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut placed = Vec::new();
        let none = |_: u32| false;
        for (i, shape) in shapes.iter().enumerate() {
            // Every third shape, a gang of two or three is chosen first (and
            // not taken): the same nodes and GPUs, or the same failure.
            if i % 3 == 2 {
                let tasks = 2 + (i as u32 / 3) % 2;
                let a = indexed.choose_gang(shape, tasks, None, &none, &mut rng);
                let b = scanning.choose_gang(shape, tasks, None, &none, &mut rng);
                prop_assert_eq!(&a, &b, "gang at task {}", i);
            }
            let a = indexed.place(shape, &none, &mut rng);
            let b = scanning.place(shape, &none, &mut rng);
            prop_assert_eq!(&a, &b, "task {}", i);
            if let Some(placement) = a {
                placed.push(placement);
            }
            // Every fifth task, the oldest placement ends.
            if i % 5 == 4 && !placed.is_empty() {
                let done = placed.remove(0);
                indexed.release(&done);
                scanning.release(&done);
            }
        }
    }

    /// Nodes mixing GPU models and nodes the engine leaves out, over two
    /// cycles (the second with the first's starts running): no GPU, and no
    /// real node's CPU or memory, is over-committed; each task's GPUs are of
    /// one model the job accepts; a gang has one task per real node; and the
    /// left-out nodes are named.
    #[test]
    fn mixed_and_bad_nodes_keep_real_nodes_within_capacity(
        raw_nodes in proptest::collection::vec(node_strategy(), 1..10),
        mix in proptest::collection::vec(prop_oneof![3 => Just(1u8), 3 => Just(2), 2 => Just(3), 1 => Just(0)], 10),
        raw_first in proptest::collection::vec(job_strategy(), 0..30),
        raw_second in proptest::collection::vec(job_strategy(), 0..30),
        policy in policy_strategy(),
        seed in any::<u64>(),
    ) {
        let nodes = build_mixed_nodes(&raw_nodes, &mix);
        let bad = mix.iter().take(nodes.len()).filter(|&&m| m == 0).count();
        let first: Vec<PendingJob> = raw_first.into_iter().enumerate()
            .map(|(i, raw)| build_job(i as u64, raw)).collect();
        let mut snapshot = Snapshot { nodes, ..Snapshot::default() };
        let outcome = schedule(&snapshot, &first, &policy, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
        prop_assert_eq!(check_real_nodes(&snapshot, &first, &outcome), Ok(()));
        prop_assert_eq!(outcome.excluded_nodes.len(), bad);
        for start in &outcome.started {
            let job = first.iter().find(|j| j.id == start.job).unwrap();
            snapshot.running.push(running_from(job, start.tasks.clone(), snapshot.now, None));
        }
        snapshot.now = muster_model::Time::from_secs(3600);
        let second: Vec<PendingJob> = raw_second.into_iter().enumerate()
            .map(|(i, raw)| build_job(1000 + i as u64, raw)).collect();
        let outcome = schedule(&snapshot, &second, &policy, &mut ChaCha8Rng::seed_from_u64(seed)).unwrap();
        prop_assert_eq!(check_real_nodes(&snapshot, &second, &outcome), Ok(()));
    }
}
