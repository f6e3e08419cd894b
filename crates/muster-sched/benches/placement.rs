//! `cargo bench -p muster-sched`: one scheduling cycle over 100,000 pending
//! tasks shaped like the openb trace (plus some multi-node gangs) on generated
//! clusters of 1,000 and 10,000 eight-GPU nodes, per placement policy; and the
//! indexed placer against the straightforward scan, checking they agree.
//!
//! Set `MUSTER_BENCH_QUICK=1` for a small run, `MUSTER_BENCH_NODES=10000`
//! and `MUSTER_BENCH_POLICY=fgd` to run one case (and not the indexed
//! against scanning comparison). Figures go to stdout; see
//! docs/benchmarks.md for recorded results.

use muster_model::{CpuMilli, GpuModel, GpuRequest, GpuSpec, JobId, MemoryMib, NodeName, NodeSpec};
use muster_model::{PoolName, QueueName, RackName, Time};
use muster_sched::{
    ClusterState, NodeInput, PendingJob, PlacementPolicy, Placer, Scale, SchedulingPolicy, Scorer,
    Snapshot, TaskRequest, TaskShape, TypicalWorkload, schedule,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::time::Instant;

const MODELS: [&str; 5] = ["G2", "G3", "V100M32", "V100M16", "T4"];
const MODEL_WEIGHTS: [u32; 5] = [55, 10, 15, 10, 10];

/// (cpu milli, memory MiB, gpu request, allowed models)
type Shape = (u64, u64, GpuRequest, Vec<GpuModel>);

fn openb_shapes() -> Vec<Shape> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../../shared/traces/openb/openb_pod_list_default.csv"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|error| {
        eprintln!("cannot read {path} ({error}); using a built-in openb-like mix");
        String::new()
    });
    let mut shapes = Vec::new();
    for line in text.lines().skip(1) {
        let fields: Vec<&str> = line.split(',').collect();
        if fields.len() < 6 {
            continue;
        }
        let (Ok(cpu), Ok(memory), Ok(count), Ok(milli)) = (
            fields[1].parse::<u64>(),
            fields[2].parse::<u64>(),
            fields[3].parse::<u32>(),
            fields[4].parse::<u32>(),
        ) else {
            continue;
        };
        let Some(gpus) = GpuRequest::from_count_and_share(count, milli) else {
            continue;
        };
        let models = fields[5]
            .split('|')
            .filter(|m| !m.is_empty())
            .map(GpuModel::new)
            .collect();
        shapes.push((cpu, memory, gpus, models));
    }
    if shapes.is_empty() {
        shapes = vec![
            (12_000, 16_384, GpuRequest::Whole(1), vec![]),
            (
                6_000,
                12_288,
                GpuRequest::Shared(muster_model::GpuMilli(460)),
                vec![],
            ),
            (8_000, 30_517, GpuRequest::Whole(0), vec![]),
            (32_000, 65_536, GpuRequest::Whole(8), vec![]),
            (16_000, 32_768, GpuRequest::Whole(2), vec![]),
        ];
    }
    shapes
}

fn cluster(nodes: usize, rng: &mut ChaCha8Rng) -> Vec<NodeInput> {
    let total: u32 = MODEL_WEIGHTS.iter().sum();
    (0..nodes)
        .map(|i| {
            let mut pick = rng.random_range(0..total);
            let mut model = 0;
            while pick >= MODEL_WEIGHTS[model] {
                pick -= MODEL_WEIGHTS[model];
                model += 1;
            }
            let name = format!("node-{i:05}");
            NodeInput::schedulable(NodeSpec {
                gpus: (0..8)
                    .map(|index| GpuSpec {
                        index,
                        uuid: format!("GPU-{name}-{index}"),
                        model: GpuModel::new(MODELS[model]),
                        memory: MemoryMib(32 * 1024),
                        nvlink_domain: index / 4,
                    })
                    .collect(),
                name: NodeName(name),
                pool: PoolName::from("default"),
                rack: RackName(format!("rack-{:04}", i / 16)),
                cpu: CpuMilli(96_000),
                memory: MemoryMib(393_216),
            })
        })
        .collect()
}

fn pending(count: usize, shapes: &[Shape], rng: &mut ChaCha8Rng) -> Vec<PendingJob> {
    (0..count)
        .map(|i| {
            let gang = i % 200 == 199; // 0.5% multi-node gangs of 2-4 x 8 GPUs
            let (cpu, memory, gpus, models) = if gang {
                (32_000, 65_536, GpuRequest::Whole(8), Vec::new())
            } else {
                shapes[rng.random_range(0..shapes.len())].clone()
            };
            PendingJob {
                id: JobId(i as u64),
                queue: QueueName(format!("team-{}", i % 4)),
                priority: 100,
                submitted: Time(i as u64),
                tasks: if gang { rng.random_range(2..=4) } else { 1 },
                request: TaskRequest {
                    container: false,
                    gpus,
                    cpu: CpuMilli(cpu),
                    memory: MemoryMib(memory),
                    gpu_models: models,
                    min_gpu_memory: None,
                    pool: None,
                    reserved: Default::default(),
                },
                same_rack: None,
                estimated_runtime_ms: None,
                apart: None,
            }
        })
        .collect()
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() {
    let quick = std::env::var_os("MUSTER_BENCH_QUICK").is_some();
    let shapes = openb_shapes();
    let tasks = if quick { 10_000 } else { 100_000 };
    let sizes: Vec<usize> = match std::env::var("MUSTER_BENCH_NODES") {
        Ok(list) => list
            .split(',')
            .filter_map(|n| n.trim().parse().ok())
            .collect(),
        Err(_) if quick => vec![1_000],
        Err(_) => vec![1_000, 10_000],
    };
    let only: Option<PlacementPolicy> = std::env::var("MUSTER_BENCH_POLICY")
        .ok()
        .and_then(|name| name.parse().ok());
    let runs = if quick { 1 } else { 3 };
    println!(
        "one scheduling cycle, {tasks} pending jobs shaped like openb (+0.5% gangs), median of {runs}"
    );
    println!("| nodes | policy | placed tasks | cycle time (s) | placements/s |");
    println!("|---:|---|---:|---:|---:|");
    for &nodes in &sizes {
        let mut rng = ChaCha8Rng::seed_from_u64(42);
        let snapshot = Snapshot {
            nodes: cluster(nodes, &mut rng),
            ..Snapshot::default()
        };
        let jobs = pending(tasks, &shapes, &mut rng);
        // Rounds of one cycle per policy, the policies in turn, so that
        // each is timed in the same state of the process (the first cycle
        // of a process pays for growing its heap: measured one policy after
        // another, the first ran 5-8% slower than when run last).
        let policies: Vec<PlacementPolicy> = PlacementPolicy::ALL
            .into_iter()
            .filter(|&placement| only.is_none_or(|only| only == placement))
            .filter(|&placement| {
                // Random scans every node per task: 10^9 filter checks.
                placement != PlacementPolicy::Random || nodes <= 1_000 || quick
            })
            .collect();
        let mut times = vec![Vec::new(); policies.len()];
        let mut placed = vec![0; policies.len()];
        for run in 0..runs {
            for (at, &placement) in policies.iter().enumerate() {
                let policy = SchedulingPolicy {
                    placement,
                    preemption: false,
                    ..SchedulingPolicy::default()
                };
                let started = Instant::now();
                let outcome = schedule(
                    &snapshot,
                    &jobs,
                    &policy,
                    &mut ChaCha8Rng::seed_from_u64(run as u64),
                )
                .expect("generated cluster is valid");
                times[at].push(started.elapsed().as_secs_f64());
                placed[at] = outcome.started.iter().map(|s| s.tasks.len()).sum::<usize>();
            }
        }
        for placement in PlacementPolicy::ALL {
            let Some(at) = policies.iter().position(|&p| p == placement) else {
                if placement == PlacementPolicy::Random && only.is_none() {
                    println!("| {nodes} | random | (skipped: scans all nodes per task) | | |");
                }
                continue;
            };
            let time = median(std::mem::take(&mut times[at]));
            println!(
                "| {nodes} | {placement} | {} | {time:.3} | {:.0} |",
                placed[at],
                placed[at] as f64 / time
            );
        }
    }

    if only.is_some() {
        // One case asked for (e.g. to profile it): nothing else.
        return;
    }

    // Start forecasts after a cycle of the default policy (what the server
    // runs after every cycle, on a thread of its own): the largest cluster,
    // jobs with estimates of 10 minutes to 10 hours, so the plan runs its
    // full 64 steps over the first 1,000 jobs in line.
    let nodes = *sizes.iter().max().unwrap_or(&1_000);
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let snapshot = Snapshot {
        nodes: cluster(nodes, &mut rng),
        ..Snapshot::default()
    };
    let mut jobs = pending(tasks, &shapes, &mut rng);
    for job in &mut jobs {
        job.estimated_runtime_ms = Some(rng.random_range(600..36_000) * 1000);
    }
    let policy = SchedulingPolicy {
        preemption: false,
        ..SchedulingPolicy::default()
    };
    let outcome = schedule(&snapshot, &jobs, &policy, &mut ChaCha8Rng::seed_from_u64(0))
        .expect("generated cluster is valid");
    // The cluster as the cycle left it: its starts run until their estimates.
    let mut after = snapshot.clone();
    let by_id: std::collections::BTreeMap<_, _> = jobs.iter().map(|j| (j.id, j)).collect();
    for start in &outcome.started {
        let job = by_id[&start.job];
        after.running.push(muster_sched::RunningJob {
            id: job.id,
            queue: job.queue.clone(),
            priority: job.priority,
            started: Time(0),
            tasks: start.tasks.clone(),
            expected_end: job.estimated_runtime_ms.map(Time),
            preemptible: false,
            checkpoint_interval_ms: None,
            service: false,
        });
    }
    let waiting: Vec<PendingJob> = jobs
        .iter()
        .filter(|job| outcome.pending.contains_key(&job.id))
        .cloned()
        .collect();
    let next =
        schedule(&after, &waiting, &policy, &mut ChaCha8Rng::seed_from_u64(0)).expect("valid");
    let mut times = Vec::new();
    let mut forecast = 0;
    for run in 0..runs {
        let started = Instant::now();
        let made = muster_sched::forecast_starts(
            &after,
            &waiting,
            &policy,
            &next,
            None,
            &muster_sched::ForecastLimits::default(),
            &mut ChaCha8Rng::seed_from_u64(run as u64),
        )
        .expect("valid");
        times.push(started.elapsed().as_secs_f64());
        forecast = made
            .values()
            .filter(|f| matches!(f, muster_sched::StartForecast::At(_)))
            .count();
    }
    println!();
    println!(
        "start forecast after a cycle: {nodes} nodes, {} running, {} pending: {forecast} jobs given a start in {:.3} s (median of {runs})",
        after.running.len(),
        waiting.len(),
        median(times)
    );
    // Indexed against straightforward: same decisions, and how much faster.
    let nodes = if quick { 200 } else { 1_000 };
    let count = if quick { 2_000 } else { 10_000 };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut state = ClusterState::new(cluster(nodes, &mut rng)).expect("valid");
    let jobs = pending(count, &shapes, &mut rng);
    let task_shapes: Vec<TaskShape> = jobs
        .iter()
        .filter(|job| job.tasks == 1)
        .map(|job| job.request.shape(&mut state))
        .collect();
    println!();
    println!(
        "indexed placer against the straightforward scan, {nodes} nodes, {} tasks ({})",
        task_shapes.len(),
        PlacementPolicy::DEFAULT
    );
    let workload = TypicalWorkload::from_tasks(task_shapes.iter(), 0.95);
    let scorer = Scorer::new(PlacementPolicy::DEFAULT, workload, Scale::of(&state));
    let none = |_: u32| false;
    let mut results = Vec::new();
    for indexed in [true, false] {
        let mut placer = if indexed {
            Placer::new(state.clone(), scorer.clone())
        } else {
            Placer::new_scanning(state.clone(), scorer.clone())
        };
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let started = Instant::now();
        let decisions: Vec<_> = task_shapes
            .iter()
            .map(|shape| placer.place(shape, &none, &mut rng))
            .collect();
        let time = started.elapsed().as_secs_f64();
        let placed = decisions.iter().filter(|d| d.is_some()).count();
        println!(
            "  {}: {placed} placed in {time:.3} s ({:.0} placements/s)",
            if indexed { "indexed " } else { "scanning" },
            placed as f64 / time
        );
        results.push((decisions, time));
    }
    let same = results[0].0 == results[1].0;
    println!(
        "  same decisions: {same}; speed-up {:.1}x",
        results[1].1 / results[0].1
    );
    assert!(same, "indexed and scanning placers disagree");
}
