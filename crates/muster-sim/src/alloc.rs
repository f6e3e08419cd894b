//! Protocol A of `traces/README.md`: allocation under load, as in the FGD
//! paper (ATC'23).
//!
//! For one seed, the arrival list is the whole pod list, inflated with tasks
//! drawn with replacement (or deflated by removing random tasks) until its
//! GPU request is as close to 130% of the cluster's GPU capacity as it can be
//! without passing it, then shuffled. Tasks are submitted one by one; each is
//! placed at once or dropped (no queue, no departures). The GPU allocation
//! ratio is recorded each time the arrived request crosses another 1% of
//! capacity, from 0% to 130%.
//!
//! The arrival list depends only on the seed (stream 0 of a ChaCha8 RNG
//! seeded with it), so every policy sees the same arrivals; the `random`
//! policy draws from stream 1 of the same seed.

use crate::trace::TraceTask;
use muster_sched::{
    ClusterError, ClusterState, NodeInput, PlacementPolicy, Placer, Scale, Scorer, TaskShape,
    TypicalWorkload, UnknownPolicy,
};
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::Serialize;
use std::str::FromStr;

/// The arrived load the protocol goes up to, in percent of GPU capacity.
pub const MAX_LOAD_PCT: u64 = 130;
/// Points of the allocation curve: one per 1% of arrived load, 0..=130.
pub const LOAD_POINTS: usize = MAX_LOAD_PCT as usize + 1;
/// The share of tasks FGD's typical workload covers.
pub const TYPICAL_COVERAGE: f64 = 0.95;

/// Error setting up the experiment.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AllocationError {
    #[error("invalid cluster: {0}")]
    Cluster(#[from] ClusterError),
    #[error("the cluster has no GPUs; allocation under load needs GPU capacity")]
    NoGpus,
    #[error("the pod list has no tasks")]
    NoTasks,
}

/// A placement policy with the name it is reported under (`default` stays
/// `default` even though it is one of the others).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NamedPolicy {
    pub name: String,
    pub policy: PlacementPolicy,
}

impl FromStr for NamedPolicy {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let policy: PlacementPolicy = text.parse()?;
        let name = if text.trim().eq_ignore_ascii_case("default") {
            "default".to_string()
        } else {
            policy.name().to_string()
        };
        Ok(NamedPolicy { name, policy })
    }
}

/// The arrival list for one seed, as indices into the pod list (`requests`
/// holds each task's GPU request in thousandths).
///
/// Below 130% of `capacity_milli`, tasks drawn uniformly with replacement are
/// appended until the next draw would pass 130% (that draw is not taken);
/// above, tasks chosen uniformly at random are removed until the total is at
/// or below 130%. Then the list is shuffled.
pub fn arrival_list<R: Rng>(requests: &[u64], capacity_milli: u64, rng: &mut R) -> Vec<usize> {
    let limit = capacity_milli.saturating_mul(MAX_LOAD_PCT);
    let mut list: Vec<usize> = (0..requests.len()).collect();
    let mut total: u64 = requests.iter().sum();
    if total.saturating_mul(100) < limit {
        // Draws of CPU-only tasks add nothing; some task must ask for GPUs
        // or the loop would not end.
        if total > 0 {
            loop {
                let index = rng.random_range(0..requests.len());
                let next = total + requests[index];
                if next.saturating_mul(100) > limit {
                    break;
                }
                list.push(index);
                total = next;
            }
        }
    } else {
        while total.saturating_mul(100) > limit && !list.is_empty() {
            let position = rng.random_range(0..list.len());
            total -= requests[list.swap_remove(position)];
        }
    }
    list.shuffle(rng);
    list
}

/// One run of the protocol: one policy, one seed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationCurve {
    /// Allocated GPU capacity (thousandths) when the arrived request reached
    /// each 1% of capacity, 0%..=130%. Points the arrival list does not reach
    /// (it ends just below 130%) hold the final allocation.
    pub allocated_milli: Vec<u64>,
    pub arrived_tasks: usize,
    pub placed_tasks: usize,
    pub dropped_tasks: usize,
}

/// Which node wins between nodes of equal score.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ties {
    /// A fixed random order of the nodes drawn per run (per seed), as the
    /// published FGD simulator breaks ties (`traces/README.md`).
    #[default]
    Random,
    /// The node with the smallest name.
    Name,
    /// One pseudo-random order for every run (`seeded_rank` with seed 0):
    /// what a server would use, fixed across its scheduling cycles.
    Fixed,
    /// The smallest node first (fewest GPUs, then CPUs, then memory; then
    /// the per-run random order): large nodes stay free for large tasks.
    SmallestFirst,
    /// The largest node first (the opposite, for comparison).
    LargestFirst,
}

/// A cluster and a pod list, ready to run Protocol A for any policy and seed.
#[derive(Debug, Clone)]
pub struct AllocationExperiment {
    cluster: ClusterState,
    ties: Ties,
    shapes: Vec<TaskShape>,
    requests: Vec<u64>,
    workload: TypicalWorkload,
    scale: Scale,
}

impl AllocationExperiment {
    /// Builds the cluster from `nodes` and interns the pod list's tasks. The
    /// typical workload (for FGD) is the shapes covering 95% of the pod list.
    pub fn new(nodes: Vec<NodeInput>, tasks: &[TraceTask]) -> Result<Self, AllocationError> {
        let mut cluster = ClusterState::new(nodes)?;
        if cluster.gpu_capacity_milli() == 0 {
            return Err(AllocationError::NoGpus);
        }
        if tasks.is_empty() {
            return Err(AllocationError::NoTasks);
        }
        let shapes: Vec<TaskShape> = tasks.iter().map(|task| task.shape(&mut cluster)).collect();
        let requests = tasks.iter().map(TraceTask::gpu_milli).collect();
        let workload = TypicalWorkload::from_tasks(shapes.iter(), TYPICAL_COVERAGE);
        let scale = Scale::of(&cluster);
        Ok(AllocationExperiment {
            cluster,
            ties: Ties::default(),
            shapes,
            requests,
            workload,
            scale,
        })
    }

    pub fn cluster(&self) -> &ClusterState {
        &self.cluster
    }

    /// How ties between nodes of equal score are broken (a random order per
    /// seed by default, as in the published protocol).
    pub fn with_ties(mut self, ties: Ties) -> Self {
        self.ties = ties;
        self
    }

    /// The cluster as run `seed` sees it: its nodes in that run's tie order.
    pub fn cluster_for(&self, seed: u64) -> ClusterState {
        match self.ties {
            Ties::Name => self.cluster.reordered(|name| name.clone()),
            // A stream of its own: the arrival list and the `random`
            // policy use the seed too.
            Ties::Random => self
                .cluster
                .reordered(|name| muster_sched::seeded_rank(seed ^ 0x7469_6573, name)),
            Ties::Fixed => self
                .cluster
                .reordered(|name| muster_sched::seeded_rank(0, name)),
            Ties::SmallestFirst | Ties::LargestFirst => {
                let size = |name: &muster_model::NodeName| {
                    let index = self.cluster.node_index(name).unwrap_or(0) as usize;
                    let node = &self.cluster.nodes[index];
                    (node.gpu_index.len(), node.cpu_milli, node.memory_mib)
                };
                // Largest first: the sizes negated.
                let sign: i128 = if self.ties == Ties::LargestFirst {
                    -1
                } else {
                    1
                };
                self.cluster.reordered(|name| {
                    let (gpus, cpu, memory) = size(name);
                    (
                        sign * gpus as i128,
                        sign * i128::from(cpu),
                        sign * i128::from(memory),
                        muster_sched::seeded_rank(seed ^ 0x7469_6573, name),
                    )
                })
            }
        }
    }

    pub fn capacity_milli(&self) -> u64 {
        self.cluster.gpu_capacity_milli()
    }

    /// Tasks in the pod list.
    pub fn task_count(&self) -> usize {
        self.shapes.len()
    }

    pub fn workload(&self) -> &TypicalWorkload {
        &self.workload
    }

    /// The arrival list of `seed` (the same for every policy).
    pub fn arrivals(&self, seed: u64) -> Vec<usize> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        arrival_list(&self.requests, self.capacity_milli(), &mut rng)
    }

    /// Runs the protocol for one policy and seed.
    pub fn run(&self, policy: PlacementPolicy, seed: u64) -> AllocationCurve {
        self.run_arrivals(policy, &self.arrivals(seed), seed)
    }

    /// Submits `arrivals` (indices into the pod list) one by one; `seed`
    /// drives the `random` policy only.
    pub fn run_arrivals(
        &self,
        policy: PlacementPolicy,
        arrivals: &[usize],
        seed: u64,
    ) -> AllocationCurve {
        let capacity = self.capacity_milli();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        rng.set_stream(1);
        let scorer = Scorer::new(policy, self.workload.clone(), self.scale);
        let mut placer = Placer::new(self.cluster_for(seed), scorer);
        let mut allocated_milli = Vec::with_capacity(LOAD_POINTS);
        allocated_milli.push(0);
        let mut arrived = 0u64;
        let mut allocated = 0u64;
        let mut placed_tasks = 0;
        for &index in arrivals {
            let shape = &self.shapes[index];
            arrived += self.requests[index];
            if placer.place(shape, &|_| false, &mut rng).is_some() {
                allocated += u64::from(shape.gpus.total().0);
                placed_tasks += 1;
            }
            debug_assert_eq!(allocated, placer.cluster().gpu_allocated_milli());
            while allocated_milli.len() < LOAD_POINTS
                && arrived * 100 >= allocated_milli.len() as u64 * capacity
            {
                allocated_milli.push(allocated);
            }
        }
        allocated_milli.resize(LOAD_POINTS, allocated);
        AllocationCurve {
            allocated_milli,
            arrived_tasks: arrivals.len(),
            placed_tasks,
            dropped_tasks: arrivals.len() - placed_tasks,
        }
    }
}

/// One policy's results over its seeds (medians at each point).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PolicyResult {
    pub policy: String,
    pub seeds: Vec<u64>,
    /// GPU allocation ratio (%) at each 1% of arrived load, 0..=130.
    pub alloc_ratio_pct: Vec<f64>,
    pub alloc_ratio_at_100: f64,
    pub alloc_ratio_at_130: f64,
    /// Capacity minus allocation at 100% arrived load, in GPUs.
    pub unallocated_gpus_at_100: f64,
    /// Per seed, in the order of `seeds`.
    pub alloc_ratio_at_100_per_seed: Vec<f64>,
    pub alloc_ratio_at_130_per_seed: Vec<f64>,
    pub arrived_tasks: f64,
    pub dropped_tasks: f64,
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

fn median(mut values: Vec<f64>) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    if values.len() % 2 == 1 {
        values[middle]
    } else {
        (values[middle - 1] + values[middle]) / 2.0
    }
}

/// Medians over seeds of one policy's curves (`curves[i]` ran with
/// `seeds[i]`), rounded to 3 decimals so output is stable.
pub fn summarize(
    policy: &str,
    seeds: &[u64],
    curves: &[AllocationCurve],
    capacity_milli: u64,
) -> PolicyResult {
    let capacity = capacity_milli.max(1) as f64;
    let pct = |milli: f64| 100.0 * milli / capacity;
    let median_at = |point: usize| {
        median(
            curves
                .iter()
                .map(|curve| curve.allocated_milli.get(point).copied().unwrap_or(0) as f64)
                .collect(),
        )
    };
    let alloc_ratio_pct: Vec<f64> = (0..LOAD_POINTS)
        .map(|point| round3(pct(median_at(point))))
        .collect();
    let per_seed = |point: usize| -> Vec<f64> {
        curves
            .iter()
            .map(|curve| {
                round3(pct(
                    curve.allocated_milli.get(point).copied().unwrap_or(0) as f64
                ))
            })
            .collect()
    };
    PolicyResult {
        policy: policy.to_string(),
        seeds: seeds.to_vec(),
        alloc_ratio_at_100: alloc_ratio_pct[100],
        alloc_ratio_at_130: alloc_ratio_pct[MAX_LOAD_PCT as usize],
        unallocated_gpus_at_100: round3((capacity_milli as f64 - median_at(100)) / 1000.0),
        alloc_ratio_pct,
        alloc_ratio_at_100_per_seed: per_seed(100),
        alloc_ratio_at_130_per_seed: per_seed(MAX_LOAD_PCT as usize),
        arrived_tasks: median(curves.iter().map(|c| c.arrived_tasks as f64).collect()),
        dropped_tasks: median(curves.iter().map(|c| c.dropped_tasks as f64).collect()),
    }
}

/// Everything `results.json` holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocationReport {
    pub protocol: String,
    pub nodes_file: String,
    pub tasks_file: String,
    pub nodes: usize,
    pub gpus: f64,
    pub tasks: usize,
    pub policies: Vec<PolicyResult>,
}

impl AllocationReport {
    pub fn new(
        experiment: &AllocationExperiment,
        nodes_file: &str,
        tasks_file: &str,
        policies: Vec<PolicyResult>,
    ) -> Self {
        AllocationReport {
            protocol: "allocation under load (traces/README.md, protocol A)".to_string(),
            nodes_file: nodes_file.to_string(),
            tasks_file: tasks_file.to_string(),
            nodes: experiment.cluster().len(),
            gpus: round3(experiment.capacity_milli() as f64 / 1000.0),
            tasks: experiment.task_count(),
            policies,
        }
    }

    /// Pretty JSON with a final newline; the same report gives the same bytes.
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        let mut text = serde_json::to_string_pretty(self)?;
        text.push('\n');
        Ok(text)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{parse_openb_nodes, parse_openb_tasks};

    /// 2 nodes x 2 GPUs, 16 CPUs each: 4 GPUs, 130% is 5.2 GPUs.
    const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n\
                         n0,16000,65536,2,T4\n\
                         n1,16000,65536,2,T4\n";

    fn experiment(tasks: &str) -> AllocationExperiment {
        let nodes = parse_openb_nodes(NODES, "nodes.csv").unwrap();
        let text = format!("name,cpu_milli,memory_mib,num_gpu,gpu_milli\n{tasks}");
        let tasks = parse_openb_tasks(&text, "pods.csv").unwrap();
        AllocationExperiment::new(nodes, &tasks).unwrap()
    }

    #[test]
    fn tie_orders_are_per_seed_fixed_or_by_size() {
        let text = "sn,cpu_milli,memory_mib,gpu,model\n\
                    a,16000,65536,8,T4\nb,8000,65536,2,T4\nc,32000,65536,4,T4\n\
                    d,16000,65536,2,T4\ne,4000,65536,1,T4\nf,64000,65536,8,T4\n";
        let nodes = parse_openb_nodes(text, "nodes.csv").unwrap();
        let tasks = parse_openb_tasks(
            "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1000,1024,1,1000\n",
            "pods.csv",
        )
        .unwrap();
        let experiment = AllocationExperiment::new(nodes, &tasks).unwrap();
        let order = |ties: Ties, seed: u64| -> Vec<String> {
            let cluster = experiment.clone().with_ties(ties).cluster_for(seed);
            cluster.nodes.iter().map(|n| n.name.0.clone()).collect()
        };
        assert_eq!(order(Ties::Name, 3), ["a", "b", "c", "d", "e", "f"]);
        assert_eq!(
            order(Ties::Fixed, 1),
            order(Ties::Fixed, 2),
            "one order for every run"
        );
        assert!(
            (0..6).any(|seed| order(Ties::Random, seed) != order(Ties::Random, 0)),
            "an order per run"
        );
        assert_eq!(order(Ties::Random, 4), order(Ties::Random, 4));
        let sizes = |names: Vec<String>| -> Vec<usize> {
            let cluster = experiment.cluster();
            names
                .iter()
                .map(|name| {
                    let index = cluster.node_index(&muster_model::NodeName::from(name.as_str()));
                    cluster.nodes[index.unwrap() as usize].gpu_index.len()
                })
                .collect()
        };
        assert_eq!(sizes(order(Ties::SmallestFirst, 0)), [1, 2, 2, 4, 8, 8]);
        assert_eq!(sizes(order(Ties::LargestFirst, 0)), [8, 8, 4, 2, 2, 1]);
        // Within a size, CPUs decide: b (8 CPUs) before d (16).
        let smallest = order(Ties::SmallestFirst, 0);
        assert_eq!(&smallest[1..3], ["b", "d"]);
    }

    fn total(requests: &[u64], list: &[usize]) -> u64 {
        list.iter().map(|&index| requests[index]).sum()
    }

    #[test]
    fn a_light_pod_list_is_inflated_to_just_below_130_percent() {
        // 1 + 0.5 + 0 GPUs against 4 GPUs: 5.2 GPUs is 130%.
        let requests = [1000, 500, 0];
        for seed in 0..20 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let list = arrival_list(&requests, 4000, &mut rng);
            let sum = total(&requests, &list);
            assert!(sum <= 5200, "seed {seed}: {sum} passes 130%");
            // The draw that stopped it would have passed: at least 5200 - 1000.
            assert!(sum > 4200, "seed {seed}: stopped early at {sum}");
            for index in 0..3 {
                assert!(list.contains(&index), "every pod-list task arrives");
            }
        }
    }

    #[test]
    fn inflation_stops_at_exactly_130_percent_when_it_is_reached() {
        // Whole GPUs only: 5 GPUs fit under 5.2, a sixth would pass.
        let requests = [1000];
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        assert_eq!(arrival_list(&requests, 4000, &mut rng), vec![0; 5]);
        // Capacity 10 GPUs: 13 GPUs is exactly 130% and is taken.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        assert_eq!(arrival_list(&requests, 10_000, &mut rng).len(), 13);
    }

    #[test]
    fn a_heavy_pod_list_is_deflated_to_at_most_130_percent() {
        // 8 GPUs asked of 4: random tasks go until at most 5.2 GPUs remain.
        let requests = [2000, 2000, 2000, 1000, 1000, 0];
        for seed in 0..20 {
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let list = arrival_list(&requests, 4000, &mut rng);
            let sum = total(&requests, &list);
            assert!(sum <= 5200, "seed {seed}: {sum}");
            let mut sorted = list.clone();
            sorted.sort_unstable();
            sorted.dedup();
            assert_eq!(sorted.len(), list.len(), "removal never duplicates");
        }
    }

    #[test]
    fn an_exact_130_percent_list_is_only_shuffled() {
        let requests = [2600, 2600];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let mut list = arrival_list(&requests, 4000, &mut rng);
        list.sort_unstable();
        assert_eq!(list, vec![0, 1]);
    }

    #[test]
    fn a_pod_list_without_gpu_requests_is_not_inflated() {
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        assert_eq!(arrival_list(&[0, 0], 4000, &mut rng).len(), 2);
    }

    #[test]
    fn the_curve_records_allocation_at_each_percent_of_arrived_load() {
        // Two 2-GPU tasks fill the cluster; then 1 GPU arrives and is dropped.
        let experiment = experiment("a,1000,1024,2,1000\n");
        let curve = experiment.run_arrivals(PlacementPolicy::BestFit, &[0, 0, 0], 0);
        assert_eq!(curve.allocated_milli.len(), LOAD_POINTS);
        // The first task (2 of 4 GPUs = 50%) reaches points 1..=50 at once.
        assert_eq!(curve.allocated_milli[0], 0);
        assert_eq!(curve.allocated_milli[1], 2000);
        assert_eq!(curve.allocated_milli[50], 2000);
        assert_eq!(curve.allocated_milli[51], 4000);
        assert_eq!(curve.allocated_milli[100], 4000);
        // The third (dropped: the cluster is full) brings 101..=130.
        assert_eq!(curve.allocated_milli[130], 4000);
        assert_eq!((curve.placed_tasks, curve.dropped_tasks), (2, 1));
    }

    #[test]
    fn unplaceable_tasks_are_dropped_and_the_tail_holds_the_final_allocation() {
        // A 4-GPU task fits no 2-GPU node; a 1-GPU task of 4 CPUs fits.
        // Arrivals: 4 GPUs (dropped) then 1 GPU: 125% arrived in total.
        let experiment = experiment("big,1000,1024,4,1000\nsmall,4000,1024,1,1000\n");
        let curve = experiment.run_arrivals(PlacementPolicy::Fgd, &[0, 1], 0);
        assert_eq!((curve.placed_tasks, curve.dropped_tasks), (1, 1));
        assert!(curve.allocated_milli[..=100].iter().all(|&a| a == 0));
        assert_eq!(curve.allocated_milli[101], 1000);
        assert_eq!(curve.allocated_milli[125], 1000);
        assert_eq!(
            curve.allocated_milli[130], 1000,
            "points past the end of the list hold the final allocation"
        );
    }

    #[test]
    fn cpu_only_tasks_take_cpu_on_gpu_nodes() {
        // Two 16-CPU tasks without GPUs fill both nodes' CPUs: the GPU task
        // that follows cannot be placed anywhere.
        let experiment = experiment("cpu,16000,1024,0,0\ngpu,1000,1024,1,1000\n");
        let curve = experiment.run_arrivals(PlacementPolicy::BestFit, &[0, 0, 1], 0);
        assert_eq!((curve.placed_tasks, curve.dropped_tasks), (2, 1));
        assert_eq!(curve.allocated_milli[130], 0);
    }

    #[test]
    fn shares_pack_onto_one_gpu_and_count_as_fractions() {
        // Four quarter-GPU tasks: best-fit stacks them on one GPU (1 of 4
        // GPUs = 25%); each arrives as 6.25% of capacity.
        let experiment = experiment("q,1000,1024,1,250\n");
        let curve = experiment.run_arrivals(PlacementPolicy::BestFit, &[0, 0, 0, 0], 0);
        assert_eq!(curve.allocated_milli[6], 250);
        assert_eq!(curve.allocated_milli[7], 500);
        assert_eq!(curve.allocated_milli[25], 1000);
        assert_eq!(curve.allocated_milli[130], 1000);
        let result = summarize("best-fit", &[0], &[curve], experiment.capacity_milli());
        assert_eq!(result.alloc_ratio_at_100, 25.0);
        assert_eq!(result.unallocated_gpus_at_100, 3.0);
    }

    #[test]
    fn every_policy_places_the_same_seeded_arrivals() {
        let experiment = experiment("a,1000,1024,1,1000\nb,2000,2048,1,500\nc,1000,1024,0,0\n");
        let arrivals = experiment.arrivals(7);
        assert!(total(&experiment.requests, &arrivals) <= 5200);
        for policy in PlacementPolicy::ALL {
            let curve = experiment.run(policy, 7);
            assert_eq!(curve.arrived_tasks, arrivals.len(), "{policy}");
            assert!(
                curve.allocated_milli.windows(2).all(|w| w[0] <= w[1]),
                "{policy}: the allocation never falls without departures"
            );
            // Free GPUs hold 0, 500 or 1000: a task is dropped only when no
            // GPU is whole, so at least half of each GPU is taken by then.
            assert!(curve.allocated_milli[100] >= 2000, "{policy}: {curve:?}");
            assert!(curve.allocated_milli[130] <= 4000);
        }
    }

    #[test]
    fn medians_over_seeds() {
        let curve = |at_100: u64| AllocationCurve {
            allocated_milli: (0..LOAD_POINTS as u64)
                .map(|p| p.min(100) * at_100 / 100)
                .collect(),
            arrived_tasks: 10,
            placed_tasks: 9,
            dropped_tasks: 1,
        };
        let curves = [curve(3000), curve(2000), curve(3500), curve(4000)];
        let result = summarize("x", &[0, 1, 2, 3], &curves, 4000);
        // Median of 3000, 2000, 3500, 4000 is 3250: 81.25%, 0.75 GPU free.
        assert_eq!(result.alloc_ratio_at_100, 81.25);
        assert_eq!(result.alloc_ratio_at_130, 81.25);
        assert_eq!(result.unallocated_gpus_at_100, 0.75);
        assert_eq!(result.alloc_ratio_pct.len(), LOAD_POINTS);
        assert_eq!(
            result.alloc_ratio_at_100_per_seed,
            vec![75.0, 50.0, 87.5, 100.0]
        );
        assert_eq!(result.dropped_tasks, 1.0);
    }

    #[test]
    fn the_same_seeds_give_byte_identical_results() {
        let tasks = "a,2000,4096,1,1000\nb,1000,2048,1,300\nc,4000,1024,2,1000\n\
                     d,500,512,1,700\ne,1000,1024,0,0\n";
        let report = || {
            let experiment = experiment(tasks);
            let seeds = [0, 1, 2];
            let policies = ["fgd", "best-fit", "packing", "random", "default"]
                .iter()
                .map(|name| {
                    let named: NamedPolicy = name.parse().unwrap();
                    let curves: Vec<_> = seeds
                        .iter()
                        .map(|&seed| experiment.run(named.policy, seed))
                        .collect();
                    summarize(&named.name, &seeds, &curves, experiment.capacity_milli())
                })
                .collect();
            AllocationReport::new(&experiment, "nodes.csv", "pods.csv", policies)
                .to_json()
                .unwrap()
        };
        let first = report();
        assert_eq!(first, report());
        assert!(first.contains("\"policy\": \"default\""));
        assert!(first.contains("\"alloc_ratio_at_130\""));
    }

    #[test]
    fn policy_names_keep_default() {
        let named: NamedPolicy = "default".parse().unwrap();
        assert_eq!(named.name, "default");
        assert_eq!(named.policy, PlacementPolicy::DEFAULT);
        let named: NamedPolicy = "bestfit".parse().unwrap();
        assert_eq!(named.name, "best-fit");
        assert!("first-fit".parse::<NamedPolicy>().is_err());
    }
}
