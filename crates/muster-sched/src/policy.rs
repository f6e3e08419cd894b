//! Placement policies: how a node and its GPUs are chosen for one task.
//!
//! Every policy scores a feasible node with an integer level (higher is
//! better); ties go to the first node in the cluster's order: by rack, then
//! a fixed pseudo-random order within the rack, or another order through
//! [`ClusterState::reordered`] (the published FGD simulator's is a random
//! permutation drawn per run). It
//! matters: coarse levels plus a fixed tie order pack work onto the same
//! nodes, and which order changes the result by up to a point.
//!
//! muster's default, [`PlacementPolicy::FgdConsolidate`], makes that packing
//! deliberate: among nodes at the same FGD level it takes one that already
//! runs GPU work, then one that runs only CPU work, and only then an empty
//! node, so whole nodes stay free for the large tasks that need them.

use crate::cluster::{ClusterState, ModelMask, NodeFree, NodeIndex, NodeStatic, TaskShape};
use muster_model::GpuRequest;
use std::fmt;
use std::str::FromStr;

/// How a node is chosen among those a task fits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PlacementPolicy {
    /// Fragmentation Gradient Descent (ATC'23): the node whose fragmentation,
    /// measured against the typical workload, grows least.
    Fgd,
    /// FGD's levels, and within a level the node already in use: one with
    /// GPU work first, then one with only CPU work, then an empty one (then
    /// the first in the cluster order). Keeps whole nodes free for large tasks.
    FgdConsolidate,
    /// The node left with the least CPU and GPU after placement.
    BestFit,
    /// GPU packing as the published simulator scores it: shared GPUs that
    /// already run work first (the fuller the better), then whole free GPUs
    /// on a node in use (the fewer the better), then an empty node (the
    /// fewer GPUs the better).
    Packing,
    /// A node drawn uniformly at random among those the task fits.
    Random,
}

impl PlacementPolicy {
    pub const ALL: [PlacementPolicy; 5] = [
        PlacementPolicy::FgdConsolidate,
        PlacementPolicy::Fgd,
        PlacementPolicy::BestFit,
        PlacementPolicy::Packing,
        PlacementPolicy::Random,
    ];

    /// muster's default: the best one measured (docs/scheduling-results.md).
    pub const DEFAULT: PlacementPolicy = PlacementPolicy::FgdConsolidate;

    /// Whether the policy scores by fragmentation (and needs the typical
    /// workload).
    pub fn uses_fragmentation(self) -> bool {
        matches!(self, PlacementPolicy::Fgd | PlacementPolicy::FgdConsolidate)
    }

    pub fn name(self) -> &'static str {
        match self {
            PlacementPolicy::Fgd => "fgd",
            PlacementPolicy::FgdConsolidate => "fgd-consolidate",
            PlacementPolicy::BestFit => "best-fit",
            PlacementPolicy::Packing => "packing",
            PlacementPolicy::Random => "random",
        }
    }
}

impl Default for PlacementPolicy {
    fn default() -> Self {
        PlacementPolicy::DEFAULT
    }
}

impl fmt::Display for PlacementPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Error for an unknown policy name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownPolicy(pub String);

impl fmt::Display for UnknownPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown placement policy {:?}; accepted: fgd-consolidate, fgd, best-fit, packing, random, default",
            self.0
        )
    }
}

impl std::error::Error for UnknownPolicy {}

impl FromStr for PlacementPolicy {
    type Err = UnknownPolicy;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text.trim().to_ascii_lowercase().as_str() {
            "default" => Ok(PlacementPolicy::DEFAULT),
            "fgd" => Ok(PlacementPolicy::Fgd),
            "fgd-consolidate" => Ok(PlacementPolicy::FgdConsolidate),
            "best-fit" | "bestfit" | "best_fit" => Ok(PlacementPolicy::BestFit),
            "packing" => Ok(PlacementPolicy::Packing),
            "random" => Ok(PlacementPolicy::Random),
            _ => Err(UnknownPolicy(text.to_string())),
        }
    }
}

/// One shape of the typical workload, with its share of tasks.
#[derive(Debug, Clone, PartialEq)]
pub struct TypicalShape {
    pub gpus: GpuRequest,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub models: ModelMask,
    /// Fraction of tasks with this shape (the weights sum to 1).
    pub weight: f64,
}

/// The observed mix of requests that FGD measures fragmentation against.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TypicalWorkload {
    shapes: Vec<TypicalShape>,
    /// The distinct GPU requests of `shapes`, and for each shape its entry.
    requests: Vec<GpuRequest>,
    /// `shapes` column by column, for the hot loop.
    columns: ShapeColumns,
    /// Shape indices by CPU (then index), and their CPUs: with no memory in
    /// any shape, fragmentation is a step function of free CPU, read off a
    /// prefix sum (see [`GpuProfile`]).
    by_cpu: Vec<usize>,
    /// The CPU of `shapes` in `by_cpu`'s order.
    sorted_cpu: Vec<u64>,
    total_weight: f64,
    memory_free: bool,
    /// The distinct shares the typical shapes ask, smallest first.
    share_sizes: Vec<u16>,
    /// For each free capacity 0..=1000, how many of `share_sizes` fit in it.
    shares_fitting: PerCapacity<u8>,
    /// CPU (thousandths of a core) the typical GPU shapes ask per whole GPU,
    /// weighted by frequency: the rate at which a node's CPUs feed its GPUs.
    cpu_per_gpu: f64,
    /// `1000 / cpu_per_gpu` (0 without GPU shapes).
    gpu_milli_per_cpu: f64,
    /// For each free capacity 0..=1000 a shared GPU is left with, the idle
    /// capacity it is expected to end with (see
    /// [`TypicalWorkload::expected_share_waste`]); empty (a `Default`
    /// workload, with no shapes): every gap counts as dead.
    share_waste: Vec<f64>,
    /// Gaps smaller than this stay empty (see
    /// [`TypicalWorkload::dead_gaps_below`]).
    dead_below: u16,
    /// [`TypicalWorkload::waste_rank`] of each free capacity 0..=1000;
    /// all 0 for a `Default` workload: FGD alone decides.
    waste_ranks: PerCapacity<u8>,
}

/// A value for each free capacity of a GPU, 0..=1000 thousandths, read
/// without a bounds check (a capacity above 1000 reads 1000's).
#[derive(Debug, Clone, PartialEq)]
struct PerCapacity<T>(Box<[T; 1001]>);

impl<T: Copy> PerCapacity<T> {
    fn from_fn(mut f: impl FnMut(u16) -> T) -> Self {
        PerCapacity(Box::new(std::array::from_fn(|free| f(free as u16))))
    }

    #[inline]
    fn get(&self, free: u16) -> T {
        self.0[usize::from(free.min(1000))]
    }
}

impl<T: Copy + Default> Default for PerCapacity<T> {
    fn default() -> Self {
        PerCapacity::from_fn(|_| T::default())
    }
}

#[derive(Debug, Clone, PartialEq, Default)]
struct ShapeColumns {
    cpu_milli: Vec<u64>,
    memory_mib: Vec<u64>,
    models: Vec<ModelMask>,
    weight: Vec<f64>,
    request: Vec<usize>,
}

impl TypicalWorkload {
    pub fn new(shapes: Vec<TypicalShape>) -> Self {
        let mut requests: Vec<GpuRequest> = Vec::new();
        let request_of = shapes
            .iter()
            .map(
                |shape| match requests.iter().position(|r| *r == shape.gpus) {
                    Some(index) => index,
                    None => {
                        requests.push(shape.gpus);
                        requests.len() - 1
                    }
                },
            )
            .collect();
        let columns = ShapeColumns {
            cpu_milli: shapes.iter().map(|s| s.cpu_milli).collect(),
            memory_mib: shapes.iter().map(|s| s.memory_mib).collect(),
            models: shapes.iter().map(|s| s.models).collect(),
            weight: shapes.iter().map(|s| s.weight).collect(),
            request: request_of,
        };
        let mut by_cpu: Vec<usize> = (0..shapes.len()).collect();
        by_cpu.sort_by_key(|&j| (shapes[j].cpu_milli, j));
        let sorted_cpu = by_cpu.iter().map(|&j| shapes[j].cpu_milli).collect();
        let total_weight = shapes.iter().map(|s| s.weight).sum();
        let memory_free = shapes.iter().all(|s| s.memory_mib == 0);
        let share_weights = share_weights(&shapes);
        let share_sizes: Vec<u16> = share_weights.iter().map(|&(size, _)| size).collect();
        let (cpu, gpus) =
            shapes
                .iter()
                .filter(|s| s.gpus.total().0 > 0)
                .fold((0.0, 0.0), |(cpu, gpus), s| {
                    (
                        cpu + s.weight * s.cpu_milli as f64,
                        gpus + s.weight * f64::from(s.gpus.total().0),
                    )
                });
        let cpu_per_gpu = if gpus > 0.0 { cpu / gpus * 1000.0 } else { 0.0 };
        let shares_fitting = PerCapacity::from_fn(|free| {
            share_sizes.partition_point(|&size| size <= free).min(255) as u8
        });
        let (share_waste, dead_below) = share_waste_table(&share_weights);
        let classes: Vec<u32> = share_waste
            .iter()
            .map(|&waste| waste_class(waste))
            .collect();
        let worst = classes.iter().copied().max().unwrap_or(0);
        let waste_ranks = PerCapacity::from_fn(|free| {
            classes
                .get(usize::from(free))
                .map_or(0, |&class| (worst - class).min(u32::from(u8::MAX)) as u8)
        });
        TypicalWorkload {
            share_sizes,
            shares_fitting,
            cpu_per_gpu,
            gpu_milli_per_cpu: if cpu_per_gpu > 0.0 {
                1000.0 / cpu_per_gpu
            } else {
                0.0
            },
            share_waste,
            dead_below,
            waste_ranks,
            shapes,
            requests,
            columns,
            by_cpu,
            sorted_cpu,
            total_weight,
            memory_free,
        }
    }

    /// Idle GPU capacity (thousandths) that `cpu` free cannot feed at the
    /// typical workload's CPU per GPU: what a stream of typical tasks would
    /// leave idle on the node for want of CPU. 0 without GPU shapes.
    pub fn cpu_stranded(&self, idle: u64, cpu: u64) -> f64 {
        if self.cpu_per_gpu <= 0.0 {
            return 0.0;
        }
        // Most nodes have CPU to spare: a multiplication shows it, where
        // the division below is slow.
        // The margin (far above two roundings' error) makes the shortcut
        // answer 0 only where the division would: there the division's
        // quotient is certainly above `idle`.
        if cpu as f64 * self.gpu_milli_per_cpu > idle as f64 * (1.0 + 1e-9) {
            return 0.0;
        }
        (idle as f64 - cpu as f64 * 1000.0 / self.cpu_per_gpu).max(0.0)
    }

    /// CPU (thousandths of a core) the typical GPU shapes ask per whole GPU.
    pub fn cpu_per_gpu(&self) -> f64 {
        self.cpu_per_gpu
    }

    /// The idle capacity (thousandths) a shared GPU left with `free`
    /// thousandths is expected to end with, if typical shares keep coming:
    /// all of it when the gap is dead (smaller than
    /// [`TypicalWorkload::dead_gaps_below`], or no typical share fits it);
    /// otherwise the mean, weighted by frequency, over the typical shares
    /// that fit of what the gap they leave ends with. A gap that a common
    /// share fills exactly ends with little; one that only rare shares fit,
    /// or that every fitting share leaves dead, with much.
    pub fn expected_share_waste(&self, free: u16) -> f64 {
        self.share_waste
            .get(usize::from(free))
            .copied()
            .unwrap_or(f64::from(free))
    }

    /// Gaps on a shared GPU smaller than this are dead: the only typical
    /// shares that fit them are outnumbered by the slivers that larger
    /// shares leave. A share of more than half a GPU has a GPU to itself
    /// and leaves a sliver only smaller shares fill; going through the
    /// slivers from the smallest, each takes the shares that fit it and
    /// no smaller sliver took, and a sliver size is oversubscribed when
    /// it comes more often than they do. Every typical share that fits the
    /// largest oversubscribed sliver is spoken for, so a gap only those fit
    /// stays empty; the first typical share larger than that sliver is
    /// where gaps come alive. On openb, the 810-thousandths share (13% of
    /// tasks) leaves 190 and the shares of 190 or less are 1.3% of tasks:
    /// gaps under 220 (the next share size) are dead. 0 when no sliver is
    /// oversubscribed.
    pub fn dead_gaps_below(&self) -> u16 {
        self.dead_below
    }

    /// How little waste a shared GPU left with `free` thousandths is
    /// expected to end with: [`TypicalWorkload::expected_share_waste`] in
    /// steps of [`WASTE_STEP`], counted down from the largest any gap has
    /// (0: the most waste). Dense, so that a placer's index of a share's
    /// levels stays short: on openb every gap is expected to end with less
    /// than 220, 23 ranks. A table read.
    #[inline]
    fn waste_rank(&self, free: u16) -> u32 {
        u32::from(self.waste_ranks.get(free))
    }

    pub fn shapes(&self) -> &[TypicalShape] {
        &self.shapes
    }

    /// The most common shapes (CPU, GPU count, GPU share, GPU models: memory
    /// is not part of a shape, as in the FGD paper) that together cover
    /// `coverage` (e.g. 0.95) of `shapes`, weighted by frequency. Ties in
    /// frequency go to the smaller shape, so the result does not depend on
    /// the input order.
    pub fn from_tasks<'a>(shapes: impl IntoIterator<Item = &'a TaskShape>, coverage: f64) -> Self {
        let mut counts: std::collections::BTreeMap<(GpuRequest, u64, u64, ModelMask), u64> =
            std::collections::BTreeMap::new();
        let mut total = 0u64;
        for shape in shapes {
            *counts
                .entry((shape.gpus, shape.cpu_milli, 0, shape.models))
                .or_default() += 1;
            total += 1;
        }
        if total == 0 {
            return TypicalWorkload::default();
        }
        let mut ranked: Vec<_> = counts.into_iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut taken = Vec::new();
        let mut covered = 0u64;
        for (key, count) in ranked {
            if covered as f64 >= coverage * total as f64 {
                break;
            }
            covered += count;
            taken.push((key, count));
        }
        let shapes = taken
            .into_iter()
            .map(
                |((gpus, cpu_milli, memory_mib, models), count)| TypicalShape {
                    gpus,
                    cpu_milli,
                    memory_mib,
                    models,
                    weight: count as f64 / covered as f64,
                },
            )
            .collect();
        TypicalWorkload::new(shapes)
    }

    /// Expected fragmentation of a node, in thousandths of a GPU: the idle GPU
    /// capacity that the typical workload cannot use, weighted by frequency.
    ///
    /// A shape that cannot run on the node (CPU, memory, model, or not enough
    /// GPUs) makes all idle capacity a fragment; one that can makes a fragment
    /// of the GPUs with less free than it asks per GPU; CPU-only shapes count
    /// all idle GPU capacity.
    pub fn fragmentation(&self, node: &NodeStatic, free: &[u16], cpu: u64, memory: u64) -> f64 {
        let mut profile = GpuProfile::default();
        self.profile_into(free, node, &mut profile);
        self.fragmentation_with(&profile, node, cpu, memory)
    }

    /// The GPU side of [`TypicalWorkload::fragmentation`]: idle capacity, and
    /// the fragment each distinct typical GPU request sees if its CPU, memory
    /// and model fit. Shared by every shape that leaves the GPUs alike.
    /// `node` gives the model (its free GPUs are `free`).
    pub fn profile_into(&self, free: &[u16], node: &NodeStatic, profile: &mut GpuProfile) {
        let mut sorted = [0u16; 64];
        let count = free.len().min(64);
        sorted[..count].copy_from_slice(&free[..count]);
        let sorted = &mut sorted[..count];
        sorted.sort_unstable();
        let idle: u64 = sorted.iter().map(|&slot| u64::from(slot)).sum();
        let whole = sorted
            .iter()
            .rev()
            .take_while(|&&slot| slot == 1000)
            .count() as u32;
        let largest = sorted.last().copied().unwrap_or(0);
        profile.idle = idle;
        profile.fragment.clear();
        profile
            .fragment
            .extend(self.requests.iter().map(|request| match *request {
                GpuRequest::Whole(0) => idle,
                GpuRequest::Whole(count) if whole < count => idle,
                GpuRequest::Whole(_) => idle - 1000 * u64::from(whole),
                GpuRequest::Shared(share) => {
                    let need = share.0 as u16;
                    if largest < need {
                        idle
                    } else {
                        sorted
                            .iter()
                            .take_while(|&&slot| slot < need)
                            .map(|&slot| u64::from(slot))
                            .sum()
                    }
                }
            }));
        // What the shapes that fit save, cumulated in CPU order.
        profile.model = node.model;
        profile.saved.clear();
        let mut saved = 0.0;
        for &j in &self.by_cpu {
            if node.accepts(self.columns.models[j]) {
                let frag = profile.fragment[self.columns.request[j]];
                saved += self.columns.weight[j] * (idle - frag) as f64;
            }
            profile.saved.push(saved);
        }
    }

    /// How many typical shapes ask at most `cpu`: the row of a
    /// [`WeightTable`] or of a profile's savings that applies.
    fn cpu_fitting(&self, cpu: u64) -> usize {
        // Most nodes FGD scores have CPU for every typical shape: no search.
        match self.sorted_cpu.last() {
            Some(&largest) if cpu >= largest => self.sorted_cpu.len(),
            _ => self.sorted_cpu.partition_point(|&c| c <= cpu),
        }
    }

    /// Fragmentation of `node` if its GPUs had `profile`, with `cpu` and
    /// `memory` free.
    pub fn fragmentation_with(
        &self,
        profile: &GpuProfile,
        node: &NodeStatic,
        cpu: u64,
        memory: u64,
    ) -> f64 {
        if profile.idle == 0 {
            return 0.0;
        }
        let idle = profile.idle;
        if self.memory_free && profile.model == node.model {
            return idle as f64 * self.total_weight - profile.saved.get(self.cpu_fitting(cpu));
        }
        let columns = &self.columns;
        let mut total = 0.0;
        for j in 0..columns.weight.len() {
            let fits = (columns.cpu_milli[j] <= cpu) & (columns.memory_mib[j] <= memory)
                && node.accepts(columns.models[j]);
            let frag = if fits {
                profile.fragment[columns.request[j]]
            } else {
                idle
            };
            total += columns.weight[j] * frag as f64;
        }
        total
    }
}

/// See [`TypicalWorkload::profile_into`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuProfile {
    idle: u64,
    fragment: Vec<u64>,
    model: u32,
    /// `saved.get(k)`: the weighted fragment the first `k` shapes by CPU avoid
    /// (those of the profile's model), against counting all idle capacity.
    saved: Saved,
}

/// [`GpuProfile`]'s cumulated savings: `get(0)` is 0, `get(k)` what the
/// first `k` typical shapes by CPU save. Held inside the profile for up to
/// [`Saved::INLINE`] shapes, so that reading one costs no pointer chase
/// (scoring is bound by memory latency: a profile is rarely in the cache
/// when a node is re-scored).
#[derive(Debug, Clone, PartialEq)]
struct Saved {
    inline: [f64; Saved::INLINE],
    len: usize,
    /// Past [`Saved::INLINE`] shapes.
    heap: Vec<f64>,
}

impl Default for Saved {
    fn default() -> Self {
        Saved {
            inline: [0.0; Saved::INLINE],
            len: 0,
            heap: Vec::new(),
        }
    }
}

impl Saved {
    const INLINE: usize = 48;

    fn clear(&mut self) {
        self.len = 0;
        self.heap.clear();
    }

    /// Appends what the next shape saves (the first, 0 at index 0, is
    /// implied).
    fn push(&mut self, value: f64) {
        if self.len + 1 < Self::INLINE && self.heap.is_empty() {
            self.inline[self.len + 1] = value;
        } else {
            if self.heap.is_empty() {
                self.heap.extend_from_slice(&self.inline[..=self.len]);
            }
            self.heap.push(value);
        }
        self.len += 1;
    }

    fn get(&self, k: usize) -> f64 {
        if self.heap.is_empty() {
            self.inline[k]
        } else {
            self.heap[k]
        }
    }
}

/// GPU profiles by what they depend on: the GPU model and the free capacity
/// of each GPU, sorted (a profile does not care which GPU is which). Nodes in
/// equal GPU states share one, and so do the shapes that leave a node's GPUs
/// alike. Valid for one [`TypicalWorkload`] and one cluster's model ids;
/// bounded (it starts over past [`ProfileCache::LIMIT`] profiles).
#[derive(Debug, Clone, Default)]
pub struct ProfileCache {
    /// Nodes of at most [`PACKED_GPUS`] GPUs: the key packed in a number.
    packed: muster_model::hashing::LookupMap<u128, u32>,
    /// Larger nodes: the model's two halves, then the sorted free capacity.
    long: muster_model::hashing::LookupMap<Vec<u16>, u32>,
    profiles: Vec<GpuProfile>,
    key: Vec<u16>,
}

/// GPUs whose free capacity (0..=1000, 10 bits each) packs into a `u128`
/// beside the model (32 bits).
const PACKED_GPUS: usize = 9;

impl ProfileCache {
    /// Most profiles kept (each is a few hundred bytes).
    pub const LIMIT: usize = 1 << 16;

    fn get_or_compute(
        &mut self,
        workload: &TypicalWorkload,
        free: &[u16],
        node: &NodeStatic,
    ) -> &GpuProfile {
        let mut buffer = [0u16; 64];
        let after = &mut buffer[..free.len().min(64)];
        after.copy_from_slice(&free[..after.len()]);
        after.sort_unstable();
        let packed = (after.len() <= PACKED_GPUS).then(|| {
            after.iter().fold(u128::from(node.model), |key, &slot| {
                (key << 10) | u128::from(slot.min(1023))
            }) | ((after.len() as u128) << 122)
        });
        let found = match packed {
            Some(key) => self.packed.get(&key),
            None => {
                self.key.clear();
                self.key
                    .extend([(node.model >> 16) as u16, node.model as u16]);
                self.key.extend_from_slice(after);
                self.long.get(self.key.as_slice())
            }
        };
        if let Some(&position) = found {
            return &self.profiles[position as usize];
        }
        if self.profiles.len() >= Self::LIMIT {
            self.packed.clear();
            self.long.clear();
            self.profiles.clear();
        }
        let mut profile = GpuProfile::default();
        workload.profile_into(after, node, &mut profile);
        let position = self.profiles.len() as u32;
        match packed {
            Some(key) => {
                self.packed.insert(key, position);
            }
            None => {
                self.long.insert(self.key.clone(), position);
            }
        }
        self.profiles.push(profile);
        &self.profiles[position as usize]
    }
}

/// The distinct shares the typical shapes ask and their weights, smallest
/// first (at most 1,000 sizes however many shapes, so what is built from
/// them is bounded).
fn share_weights(shapes: &[TypicalShape]) -> Vec<(u16, f64)> {
    let mut by_size = vec![0.0; 1001];
    for shape in shapes {
        if let GpuRequest::Shared(size) = shape.gpus {
            by_size[size.0.clamp(1, 1000) as usize] += shape.weight;
        }
    }
    by_size
        .iter()
        .enumerate()
        .filter(|&(_, &weight)| weight > 0.0)
        .map(|(size, &weight)| (size as u16, weight))
        .collect()
}

/// [`TypicalWorkload::expected_share_waste`] for every free capacity
/// 0..=1000, and [`TypicalWorkload::dead_gaps_below`], from the typical
/// shares' [`share_weights`] (GPU models are not considered).
fn share_waste_table(sizes: &[(u16, f64)]) -> (Vec<f64>, u16) {
    // The slivers of shares over half a GPU, smallest first, each against
    // the shares no smaller sliver took.
    let mut slivers: Vec<(u16, f64)> = sizes
        .iter()
        .filter(|&&(size, _)| size > 500)
        .map(|&(size, weight)| (1000 - size, weight))
        .collect();
    slivers.sort_by_key(|&(sliver, _)| sliver);
    let small: Vec<(u16, f64)> = sizes
        .iter()
        .copied()
        .filter(|&(size, _)| size <= 500)
        .collect();
    let mut next = 0;
    let mut spare = 0.0;
    let mut oversubscribed = None;
    for &(sliver, demand) in &slivers {
        let mut supply = spare;
        while next < small.len() && small[next].0 <= sliver {
            supply += small[next].1;
            next += 1;
        }
        if demand > supply {
            oversubscribed = Some(sliver);
            spare = 0.0;
        } else {
            spare = supply - demand;
        }
    }
    let dead_below = oversubscribed.map_or(0, |sliver| {
        sizes
            .iter()
            .map(|&(size, _)| size)
            .find(|&size| size > sliver)
            .unwrap_or(1001)
    });
    let mut waste = vec![0.0; 1001];
    for free in 1..=1000usize {
        let (mut weight, mut sum) = (0.0, 0.0);
        if free >= usize::from(dead_below) {
            for &(size, w) in sizes
                .iter()
                .take_while(|&&(size, _)| usize::from(size) <= free)
            {
                weight += w;
                sum += w * waste[free - usize::from(size)];
            }
        }
        waste[free] = if weight > 0.0 {
            sum / weight
        } else {
            free as f64
        };
    }
    (waste, dead_below)
}

/// A waste (thousandths) in steps of [`WASTE_STEP`].
fn waste_class(waste: f64) -> u32 {
    ((waste / WASTE_STEP).round() as u32).min(WASTE_CLASSES - 1)
}

/// How finely `fgd-consolidate` compares the waste a share's GPU is
/// expected to end with (thousandths): a hundredth of a GPU. Within a
/// step, FGD's score decides.
const WASTE_STEP: f64 = 10.0;

/// Steps of expected waste, 0..=1000 thousandths.
const WASTE_CLASSES: u32 = 101;

/// FGD's levels (0..=100) times the consolidation tiers: the part of
/// `fgd-consolidate`'s level below the share's waste class.
const FGD_KEYS: u32 = 101 * CONSOLIDATION_TIERS;

/// The highest score level any policy gives: FGD, best-fit and packing
/// score 0..=100; `fgd-consolidate` splits each FGD level into
/// [`CONSOLIDATION_TIERS`] tiers, and puts a share's levels above one
/// another by the waste its GPU is expected to end with (least waste
/// highest; [`WASTE_CLASSES`] steps).
pub const MAX_LEVEL: u32 = WASTE_CLASSES * FGD_KEYS - 1;

/// Tiers within an FGD level for `fgd-consolidate`: empty node, node with
/// only CPU work, node with GPU work.
pub const CONSOLIDATION_TIERS: u32 = 3;

/// How much of a node is already in use, for `fgd-consolidate`: 2 if any GPU
/// is (partly) allocated, 1 if only CPU or memory is, 0 if it is empty.
pub fn consolidation_tier(info: &NodeStatic, free: &NodeFree) -> u32 {
    let gpu_in_use = free
        .gpu
        .iter()
        .zip(&info.gpu_healthy)
        .fold(false, |any, (&slot, &healthy)| {
            any | (healthy & (slot < 1000))
        });
    if gpu_in_use {
        2
    } else if free.cpu_milli < info.cpu_milli || free.memory_mib < info.memory_mib {
        1
    } else {
        0
    }
}

/// How much a GPU that a placement strands for want of CPU counts against
/// it, beside FGD's fragmentation (see [`Scorer::evaluate`] for
/// `fgd-consolidate`). Less than a fragment: a fragment is certain loss for
/// the next task of a typical shape, a stranded GPU only for the tasks that
/// ask more CPU per GPU than the typical rate (CPU-light tasks, such as
/// openb's GPU shares asking 3 CPUs, still use it). At full weight, CPU-heavy
/// work crowds onto the CPU-rich nodes that big CPU-heavy tasks need (a mix
/// with 30% multi-GPU tasks lost 0.58 points to FGD); at a third every openb
/// trace and all 32 muster mixes are at or above FGD
/// (docs/scheduling-results.md, "CPU stranding").
pub const STRANDED_WEIGHT: f64 = 1.0 / 3.0;

/// The GPUs chosen on a node: a bit per GPU index; each takes the task's
/// per-GPU share.
pub type GpuPick = u64;

/// A feasible node's score and the GPUs the task would take there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Evaluation {
    pub level: u32,
    pub pick: GpuPick,
}

/// Normalisers for scores that compare nodes of different sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scale {
    pub cpu_milli: f64,
    pub gpus: f64,
}

impl Scale {
    /// The largest node's CPU and GPU count (128 CPUs and 8 GPUs on openb).
    pub fn of(cluster: &ClusterState) -> Self {
        let cpu = cluster
            .nodes
            .iter()
            .map(|n| n.cpu_milli)
            .max()
            .unwrap_or(1)
            .max(1);
        let gpus = cluster
            .nodes
            .iter()
            .map(|n| n.gpu_healthy.len())
            .max()
            .unwrap_or(1)
            .max(1);
        Scale {
            cpu_milli: cpu as f64,
            gpus: gpus as f64,
        }
    }
}

/// Everything a policy needs to score nodes.
#[derive(Debug, Clone)]
pub struct Scorer {
    pub policy: PlacementPolicy,
    pub workload: TypicalWorkload,
    pub scale: Scale,
    /// [`WeightTable`]s by GPU model id, built when first needed (model ids
    /// are the cluster's: a scorer serves one cluster).
    tables: std::sync::Arc<Vec<std::sync::OnceLock<WeightTable>>>,
    /// FGD's levels for shares, whole GPUs and CPU only (see
    /// [`Scorer::fgd_steps`]).
    steps: [&'static SigmoidSteps; 3],
}

/// For one GPU model, the typical shapes' weights cumulated so that a node's
/// FGD fragmentation is a sum over its GPUs, with no per-state table: row `k`
/// holds, of the first `k` typical shapes by CPU that accept the model, the
/// weight of the whole-GPU shapes asking at most `m` GPUs (`whole[m]`) and
/// of the shares of at most the `q`-th smallest share size (`share[q + 1]`,
/// `share[0]` = 0). A shape asking `c` whole GPUs saves (against counting all
/// idle capacity as fragment) 1000 x the free whole GPUs if there are at
/// least `c`; a share of `s` saves the free capacity of the GPUs with at
/// least `s` free; so what the first `k` shapes save is
/// `1000 x whole x whole[whole] + sum over GPUs of free x share[q(free)]`.
/// Reading a row costs no cache miss, where a per-state profile
/// ([`ProfileCache`]) costs two (measured in docs/benchmarks.md).
#[derive(Debug, Clone)]
struct WeightTable {
    whole_columns: usize,
    whole: Vec<f64>,
    share_columns: usize,
    share: Vec<f64>,
}

/// GPU model ids with a [`WeightTable`]; a node of a larger id (a cluster
/// with more models) is scored through [`ProfileCache`].
const TABLED_MODELS: usize = 64;

impl WeightTable {
    fn build(workload: &TypicalWorkload, node: &NodeStatic) -> Self {
        let whole_columns = workload
            .shapes
            .iter()
            .filter_map(|shape| match shape.gpus {
                GpuRequest::Whole(count) => Some(count as usize),
                GpuRequest::Shared(_) => None,
            })
            .max()
            .unwrap_or(0)
            + 1;
        let share_columns = workload.share_sizes.len() + 1;
        let rows = workload.by_cpu.len() + 1;
        let mut table = WeightTable {
            whole_columns,
            whole: Vec::with_capacity(rows * whole_columns),
            share_columns,
            share: Vec::with_capacity(rows * share_columns),
        };
        let mut whole = vec![0.0; whole_columns];
        let mut share = vec![0.0; share_columns - 1];
        table.push_row(&whole, &share);
        for &j in &workload.by_cpu {
            if node.accepts(workload.columns.models[j]) {
                let weight = workload.columns.weight[j];
                match workload.shapes[j].gpus {
                    GpuRequest::Whole(0) => {}
                    GpuRequest::Whole(count) => whole[count as usize] += weight,
                    GpuRequest::Shared(size) => {
                        let q = workload
                            .share_sizes
                            .partition_point(|&s| u32::from(s) < size.0);
                        share[q] += weight;
                    }
                }
            }
            table.push_row(&whole, &share);
        }
        table
    }

    fn push_row(&mut self, whole: &[f64], share: &[f64]) {
        let mut sum = 0.0;
        for &weight in whole {
            sum += weight;
            self.whole.push(sum);
        }
        self.share.push(0.0);
        let mut sum = 0.0;
        for &weight in share {
            sum += weight;
            self.share.push(sum);
        }
    }
}

/// Whole GPUs for a task: the NVLink domain with the fewest free whole GPUs
/// that still holds all of them (lowest domain on ties), lowest indices first;
/// if no single domain can, the lowest-numbered free GPUs.
pub fn pick_whole_gpus(node: &NodeStatic, free: &[u16], count: u32) -> Option<GpuPick> {
    if count == 0 {
        return Some(0);
    }
    let domain_of = |index: usize| node.nvlink_domain.get(index).copied().unwrap_or(0);
    let whole = |index: usize| free[index] == 1000;
    let total = (0..free.len()).filter(|&i| whole(i)).count() as u32;
    if total < count {
        return None;
    }
    // The domain with the fewest free whole GPUs that still holds them all.
    let mut best: Option<(u32, u32)> = None; // (free in domain, domain)
    for index in 0..free.len() {
        if !whole(index) {
            continue;
        }
        let domain = domain_of(index);
        if (0..index).any(|i| whole(i) && domain_of(i) == domain) {
            continue; // counted with an earlier GPU of the domain
        }
        let in_domain = (index..free.len())
            .filter(|&i| whole(i) && domain_of(i) == domain)
            .count() as u32;
        if in_domain >= count && best.is_none_or(|b| (in_domain, domain) < b) {
            best = Some((in_domain, domain));
        }
    }
    let mut pick = 0u64;
    let mut taken = 0;
    for index in 0..free.len() {
        if taken == count {
            break;
        }
        if whole(index) && best.is_none_or(|(_, d)| d == domain_of(index)) {
            pick |= 1 << index;
            taken += 1;
        }
    }
    Some(pick)
}

/// FGD's score for a drop in fragmentation: `levels / (1 + e^(-drop/1000))`
/// truncated to a level in `0..=levels`. The definition; scoring reads it
/// from [`SigmoidSteps`].
fn sigmoid_level(drop: f64, levels: f64) -> u32 {
    let value = levels / (1.0 + (-drop / 1000.0).exp());
    value.clamp(0.0, levels) as u32
}

/// [`sigmoid_level`] for one number of levels, read from the drops where
/// each level starts instead of computed: an exponential and two divisions
/// were a quarter of an FGD scoring (docs/benchmarks.md). The same levels
/// for every drop, as long as the formula never decreases as the drop grows
/// (the test `the_sigmoid_steps_agree_with_the_formula` sweeps it): each
/// threshold is the least `f64` at which the formula reaches its level,
/// found by bisection over the `f64`s in order.
#[derive(Debug)]
struct SigmoidSteps {
    levels: u32,
    /// `starts[l]`: the least drop whose level is more than `l`; infinite
    /// for `l = levels`.
    starts: Vec<f64>,
    /// For each [`SigmoidSteps::CELL`]-wide cell of drops from
    /// [`SigmoidSteps::LOW`], the level at its start and the first start
    /// at or above it: a drop in the cell has that level, or one more from
    /// that start on (levels start at least 40 apart, and a cell is 32
    /// wide), read in one step.
    cells: Vec<(f64, u32)>,
}

impl SigmoidSteps {
    const LOW: f64 = -6000.0;
    const CELL: f64 = 32.0;
    const CELLS: usize = 375;

    fn new(levels: u32) -> Self {
        // f64s in order as integers (finite values).
        let key = |x: f64| {
            let bits = x.to_bits() as i64;
            if bits < 0 { i64::MIN - bits } else { bits }
        };
        let value = |k: i64| f64::from_bits((if k < 0 { i64::MIN - k } else { k }) as u64);
        let f = |drop: f64| sigmoid_level(drop, f64::from(levels));
        let starts: Vec<f64> = (1..=levels)
            .map(|level| {
                // f(low) < level <= f(high): a drop of a million has every
                // level (the exponential underflows to 0).
                let (mut low, mut high) = (key(-1e6), key(1e6));
                while i128::from(high) - i128::from(low) > 1 {
                    let middle = ((i128::from(low) + i128::from(high)) / 2) as i64;
                    if f(value(middle)) >= level {
                        high = middle;
                    } else {
                        low = middle;
                    }
                }
                value(high)
            })
            .chain([f64::INFINITY])
            .collect();
        let cells = (0..Self::CELLS)
            .map(|cell| {
                let level = f(Self::LOW + cell as f64 * Self::CELL);
                (starts[level as usize], level)
            })
            .collect();
        SigmoidSteps {
            levels,
            starts,
            cells,
        }
    }

    #[inline]
    fn level(&self, drop: f64) -> u32 {
        let cell = ((drop - Self::LOW) / Self::CELL).clamp(0.0, (Self::CELLS - 1) as f64) as usize;
        let (next, base) = self.cells[cell];
        // At most one level starts within a cell: one step up, without a
        // branch to mispredict.
        let level = (base + u32::from(drop >= next)).min(self.levels);
        // Checked against the starts around it (a drop outside the cells,
        // or one that rounding put in the next cell, walks on).
        let low = level == 0 || drop >= self.starts[level as usize - 1];
        let high = level == self.levels || drop < self.starts[level as usize];
        if low && high {
            level
        } else {
            self.walk(drop, level)
        }
    }

    /// The level of `drop` from `level` on, a start at a time.
    #[cold]
    fn walk(&self, drop: f64, mut level: u32) -> u32 {
        while level < self.levels && drop >= self.starts[level as usize] {
            level += 1;
        }
        while level > 0 && drop < self.starts[level as usize - 1] {
            level -= 1;
        }
        level
    }
}

impl Scorer {
    pub fn new(policy: PlacementPolicy, workload: TypicalWorkload, scale: Scale) -> Self {
        Scorer {
            policy,
            workload,
            scale,
            tables: std::sync::Arc::new(
                (0..TABLED_MODELS)
                    .map(|_| std::sync::OnceLock::new())
                    .collect(),
            ),
            steps: {
                static STEPS: std::sync::LazyLock<[SigmoidSteps; 3]> =
                    std::sync::LazyLock::new(|| {
                        [
                            SigmoidSteps::new(100),
                            SigmoidSteps::new(50),
                            SigmoidSteps::new(25),
                        ]
                    });
                let steps: &'static [SigmoidSteps; 3] = &STEPS;
                [&steps[0], &steps[1], &steps[2]]
            },
        }
    }

    /// Whether a node's level for a shape that fits it is the same whatever
    /// memory the shape asks: true for every policy but an FGD whose typical
    /// shapes ask for memory (those from [`TypicalWorkload::from_tasks`] do
    /// not, as in the FGD paper).
    pub fn levels_ignore_memory(&self) -> bool {
        !self.policy.uses_fragmentation() || self.workload.memory_free
    }

    /// Scores `node` for `shape`, or `None` when the task does not fit.
    pub fn evaluate(
        &self,
        cluster: &ClusterState,
        node: NodeIndex,
        shape: &TaskShape,
    ) -> Option<Evaluation> {
        if !cluster.fits(node, shape) {
            return None;
        }
        let info = &cluster.nodes[node as usize];
        let free = &cluster.free[node as usize];
        Some(self.evaluate_fitting(info, free, shape))
    }

    /// The node's fragmentation now, which every shape's FGD score starts
    /// from (computed once per node change by the index), GPU profiles
    /// shared through `cache`.
    pub fn fragmentation_now(
        &self,
        cluster: &ClusterState,
        node: NodeIndex,
        cache: &mut ProfileCache,
    ) -> f64 {
        if !self.policy.uses_fragmentation() {
            return 0.0;
        }
        let info = &cluster.nodes[node as usize];
        let free = &cluster.free[node as usize];
        self.fragmentation_of(info, &free.gpu, free.cpu_milli, free.memory_mib, cache)
    }

    /// What scoring `node` reads of it now (see [`NodeNow`]); its
    /// fragmentation is [`Scorer::fragmentation_now`].
    pub(crate) fn node_now(
        &self,
        cluster: &ClusterState,
        node: NodeIndex,
        cache: &mut ProfileCache,
    ) -> NodeNow {
        let info = &cluster.nodes[node as usize];
        let free = &cluster.free[node as usize];
        let len = free.gpu.len();
        // `table` builds the model's table if it is not yet: the fast
        // path reads it without building it.
        let table = (self.policy.uses_fragmentation() && len <= 8)
            .then(|| self.table(info))
            .flatten();
        let Some(table) = table else {
            return NodeNow {
                fragmentation: self.fragmentation_now(cluster, node, cache),
                ..NodeNow::default()
            };
        };
        let mut slots = [0u16; 8];
        slots[..len].copy_from_slice(&free.gpu);
        let (idle, whole) = idle_and_whole(&slots);
        NodeNow {
            // [`Scorer::fragmentation_of`]'s sum, over the padded GPUs (their
            // zeros add exactly nothing).
            fragmentation: Tabled::row(&self.workload, table, free.cpu_milli).fragmentation(
                &slots,
                idle,
                whole,
                |_, slot| slot,
            ),
            cpu: free.cpu_milli,
            memory: free.memory_mib,
            slots,
            idle: idle as u32,
            most: slots.iter().copied().max().unwrap_or(0),
            model: info.model as u8,
            whole: whole as u8,
            tier: consolidation_tier(info, free) as u8,
            fast: true,
        }
    }

    /// [`Scorer::evaluation_passing_static`] for `node`, read from `now`,
    /// its [`Scorer::node_now`], where that is complete; the same
    /// evaluation to the last bit (a test holds them together). Not
    /// inlined, so that the indexes of the other policies keep theirs.
    #[inline(never)]
    pub(crate) fn evaluation_now(
        &self,
        cluster: &ClusterState,
        node: NodeIndex,
        now: &NodeNow,
        shape: &TaskShape,
        cache: &mut ProfileCache,
    ) -> Option<Evaluation> {
        if !now.fast {
            return self.evaluation_passing_static(cluster, node, shape, now.fragmentation, cache);
        }
        // [`ClusterState::has_room`], from the record (most re-scorings end
        // here).
        let gpus_fit = match shape.gpus {
            GpuRequest::Whole(count) => u32::from(now.whole) >= count,
            GpuRequest::Shared(share) => u32::from(now.most) >= share.0,
        };
        if !(gpus_fit && now.cpu >= shape.cpu_milli && now.memory >= shape.memory_mib) {
            return None;
        }
        // Built by [`Scorer::node_now`].
        let Some(table) = self
            .tables
            .get(usize::from(now.model))
            .and_then(|table| table.get())
        else {
            return self.evaluation_passing_static(cluster, node, shape, now.fragmentation, cache);
        };
        let cpu_after = now.cpu - shape.cpu_milli;
        let after = AfterFragmentation {
            slots: &now.slots,
            cpu: cpu_after,
            idle: u64::from(now.idle),
            whole: usize::from(now.whole),
            sum: Summing::Tabled(Tabled::row(&self.workload, table, cpu_after)),
        };
        let (evaluation, rank) = self.evaluate_fgd_after(
            after,
            now.cpu,
            u64::from(now.idle),
            shape,
            now.fragmentation,
        );
        Some(self.fgd_evaluation(evaluation, rank, || u32::from(now.tier)))
    }

    /// The GPUs a task takes on `node`, known to pass the static filters
    /// for `shape`, given its current fragmentation; `None` without room.
    /// Whole GPUs come from [`pick_whole_gpus`] unscored (which ones does
    /// not depend on the level, for any policy); a share's GPU is the one
    /// the policy scores best.
    pub fn pick_passing_static(
        &self,
        cluster: &ClusterState,
        node: NodeIndex,
        shape: &TaskShape,
        fragmentation_now: f64,
        cache: &mut ProfileCache,
    ) -> Option<GpuPick> {
        match shape.gpus {
            GpuRequest::Whole(count) => {
                if !cluster.has_room(node, shape) {
                    return None;
                }
                let info = &cluster.nodes[node as usize];
                let free = &cluster.free[node as usize];
                Some(pick_whole_gpus(info, &free.gpu, count).unwrap_or_default())
            }
            GpuRequest::Shared(_) => self
                .evaluation_passing_static(cluster, node, shape, fragmentation_now, cache)
                .map(|evaluation| evaluation.pick),
        }
    }

    /// The level [`Scorer::evaluate`] gives `node`, known to pass the
    /// static filters for `shape`, given its current fragmentation, and a
    /// share's GPU, without choosing which whole GPUs the task would take
    /// (a level does not depend on which: `pick` is 0 for them), for
    /// indexes that re-score nodes; `None` without room.
    pub fn evaluation_passing_static(
        &self,
        cluster: &ClusterState,
        node: NodeIndex,
        shape: &TaskShape,
        fragmentation_now: f64,
        cache: &mut ProfileCache,
    ) -> Option<Evaluation> {
        if !cluster.has_room(node, shape) {
            return None;
        }
        let info = &cluster.nodes[node as usize];
        let free = &cluster.free[node as usize];
        Some(self.evaluate_fitting_from(info, free, shape, fragmentation_now, Some(cache), false))
    }

    /// Scores a node the task is known to fit.
    pub fn evaluate_fitting(
        &self,
        info: &NodeStatic,
        free: &NodeFree,
        shape: &TaskShape,
    ) -> Evaluation {
        let before = if self.policy.uses_fragmentation() {
            self.fragmentation_of(
                info,
                &free.gpu,
                free.cpu_milli,
                free.memory_mib,
                &mut ProfileCache::default(),
            )
        } else {
            0.0
        };
        self.evaluate_fitting_from(info, free, shape, before, None, true)
    }

    /// The level, and with `want_pick` the GPUs the task would take (for
    /// whole GPUs, without it, `pick` is 0: no level depends on which whole
    /// GPUs are taken).
    fn evaluate_fitting_from(
        &self,
        info: &NodeStatic,
        free: &NodeFree,
        shape: &TaskShape,
        before: f64,
        cache: Option<&mut ProfileCache>,
        want_pick: bool,
    ) -> Evaluation {
        match self.policy {
            PlacementPolicy::FgdConsolidate | PlacementPolicy::Fgd => {
                let (evaluation, waste_rank) =
                    self.evaluate_fgd(info, free, shape, before, cache, want_pick);
                self.fgd_evaluation(evaluation, waste_rank, || consolidation_tier(info, free))
            }
            PlacementPolicy::BestFit | PlacementPolicy::Packing | PlacementPolicy::Random => {
                let cpu_after = free.cpu_milli - shape.cpu_milli;
                let pick = match shape.gpus {
                    GpuRequest::Shared(share) => {
                        let need = share.0 as u16;
                        let index = free
                            .gpu
                            .iter()
                            .enumerate()
                            .filter(|(_, slot)| **slot >= need)
                            .min_by_key(|(index, slot)| (**slot, *index))
                            .map(|(index, _)| index)
                            .unwrap_or(0);
                        1 << index
                    }
                    GpuRequest::Whole(count) if want_pick => {
                        pick_whole_gpus(info, &free.gpu, count).unwrap_or_default()
                    }
                    GpuRequest::Whole(_) => 0,
                };
                let gpu_idle_after = free.idle_gpu_milli() - shape.gpus.total().0 as u64;
                let level = match self.policy {
                    PlacementPolicy::BestFit => {
                        let left = 0.5 * cpu_after as f64 / self.scale.cpu_milli
                            + 0.5 * gpu_idle_after as f64 / (self.scale.gpus * 1000.0);
                        (100.0 * (1.0 - left)).clamp(0.0, 100.0) as u32
                    }
                    PlacementPolicy::Packing => packing_level(info, free, shape.gpus),
                    _ => 0,
                };
                Evaluation { level, pick }
            }
        }
    }

    /// The level of an FGD policy from FGD's evaluation and, for
    /// `fgd-consolidate`, a share's waste rank and the node's
    /// [`consolidation_tier`].
    #[inline(always)]
    fn fgd_evaluation(
        &self,
        evaluation: Evaluation,
        waste_rank: u32,
        tier: impl FnOnce() -> u32,
    ) -> Evaluation {
        match self.policy {
            PlacementPolicy::FgdConsolidate => Evaluation {
                level: waste_rank * FGD_KEYS + evaluation.level * CONSOLIDATION_TIERS + tier(),
                pick: evaluation.pick,
            },
            _ => evaluation,
        }
    }

    /// FGD's levels for a task asking `gpus`: 100 (the published FGD,
    /// `fgd`), or, for `fgd-consolidate`, as fine as what the task asks: 100
    /// for a share of a GPU (its drops in fragmentation are fractions of a
    /// GPU), 50 for whole GPUs, 25 for CPU only. Coarser levels leave nodes
    /// whose fragmentation barely differs level, so the consolidation tiers
    /// and the cluster's order decide between them and work packs onto
    /// fewer nodes; measured on the eight openb traces in
    /// docs/scheduling-results.md ("Score resolution").
    fn fgd_steps(&self, gpus: GpuRequest) -> &'static SigmoidSteps {
        match (self.policy, gpus) {
            (PlacementPolicy::FgdConsolidate, GpuRequest::Whole(0)) => self.steps[2],
            (PlacementPolicy::FgdConsolidate, GpuRequest::Whole(_)) => self.steps[1],
            _ => self.steps[0],
        }
    }

    /// FGD's fragmentation of `info` with `slots` free on its GPUs and
    /// `cpu` and `memory` free: through the model's [`WeightTable`] when the
    /// typical shapes ask no memory (always, for shapes from a trace),
    /// otherwise through a GPU profile from `cache`. One node always goes
    /// the same way, so drops in fragmentation compare like with like.
    fn fragmentation_of(
        &self,
        info: &NodeStatic,
        slots: &[u16],
        cpu: u64,
        memory: u64,
        cache: &mut ProfileCache,
    ) -> f64 {
        let (idle, whole) = idle_and_whole(slots);
        if idle == 0 {
            return 0.0;
        }
        match Tabled::of(self, info, cpu) {
            Some(tabled) => tabled.fragmentation(slots, idle, whole, |_, slot| slot),
            None => {
                let workload = &self.workload;
                let profile = cache.get_or_compute(workload, slots, info);
                workload.fragmentation_with(profile, info, cpu, memory)
            }
        }
    }

    /// The [`WeightTable`] that scores `info`, or `None` where GPU profiles
    /// do: typical shapes that ask memory, model ids past
    /// [`TABLED_MODELS`], more than 255 share sizes.
    fn table(&self, info: &NodeStatic) -> Option<&WeightTable> {
        let workload = &self.workload;
        let model = info.model as usize;
        if !workload.memory_free || model >= TABLED_MODELS || workload.share_sizes.len() > 255 {
            return None;
        }
        Some(self.tables[model].get_or_init(|| WeightTable::build(workload, info)))
    }

    /// What `fgd-consolidate` adds to a node's fragmentation after a
    /// placement: the GPU capacity it newly strands for want of CPU
    /// ([`TypicalWorkload::cpu_stranded`] after minus before), never less
    /// than 0, counted at [`STRANDED_WEIGHT`]. FGD's typical shapes only see
    /// the next task, so a CPU-only or CPU-heavy task that leaves a node too
    /// few CPUs for its idle GPUs looks harmless to them as long as the
    /// shapes still fit one at a time; counting the GPUs a stream of typical
    /// tasks could no longer feed steers such tasks to CPU-rich nodes.
    /// One-sided: a placement that *relieves* stranding earns nothing, or
    /// nodes that are CPU-poor by build (16 CPUs for 2 GPUs) would draw every
    /// light task and model-bound tasks lose those GPUs. Measured in
    /// docs/scheduling-results.md ("CPU stranding").
    fn stranding(before: f64, after: f64) -> f64 {
        (after - before).max(0.0) * STRANDED_WEIGHT
    }

    /// FGD's score: the sigmoid level of the drop in fragmentation; a shared
    /// task takes the GPU that scores best (lowest index on ties), whole GPUs
    /// come from [`pick_whole_gpus`]. With the level, for `fgd-consolidate`
    /// and a share, the rank of the waste the chosen GPU is expected to end
    /// with (higher is less; 0 otherwise): such a share takes, before FGD's
    /// level is asked, the GPU whose gap after it is expected to end least
    /// wasted ([`TypicalWorkload::expected_share_waste`], in steps of
    /// [`WASTE_STEP`]). FGD looks one task ahead and fills the tightest gap
    /// it can, so a 230 share lands beside a 650 one and leaves 120 that
    /// nothing typical fills, where a fresh GPU would have taken a 470 and
    /// a 230 more; measured in docs/scheduling-results.md ("Shares by
    /// expected waste").
    fn evaluate_fgd(
        &self,
        info: &NodeStatic,
        free: &NodeFree,
        shape: &TaskShape,
        before: f64,
        cache: Option<&mut ProfileCache>,
        want_pick: bool,
    ) -> (Evaluation, u32) {
        // The node's GPUs in an array of a size known when compiling, so
        // that the loops over them unroll: eight (most nodes), or 64 (a node
        // has at most 64 GPUs here; the rest are not scored). Past the
        // node's GPUs the array holds zeros, as an unhealthy GPU does: a GPU
        // with nothing free fits no share and is no whole GPU, and adds
        // exactly nothing to a fragmentation.
        let (mut evaluation, rank) = if free.gpu.len() <= 8 {
            self.evaluate_fgd_on::<8>(info, free, shape, before, cache)
        } else {
            self.evaluate_fgd_on::<64>(info, free, shape, before, cache)
        };
        if let GpuRequest::Whole(count) = shape.gpus
            && want_pick
        {
            evaluation.pick = pick_whole_gpus(info, &free.gpu, count).unwrap_or_default();
        }
        (evaluation, rank)
    }

    /// [`Scorer::evaluate_fgd`] with the node's first `N` GPUs (at most)
    /// in an array of `N`.
    #[inline(always)]
    fn evaluate_fgd_on<const N: usize>(
        &self,
        info: &NodeStatic,
        free: &NodeFree,
        shape: &TaskShape,
        before: f64,
        cache: Option<&mut ProfileCache>,
    ) -> (Evaluation, u32) {
        let len = free.gpu.len().min(N);
        let mut slots = [0u16; N];
        slots[..len].copy_from_slice(&free.gpu[..len]);
        let cpu_after = free.cpu_milli - shape.cpu_milli;
        let memory_after = free.memory_mib - shape.memory_mib;
        let after =
            AfterFragmentation::new(self, info, &slots, len, cpu_after, memory_after, cache);
        let idle_before = if len == free.gpu.len() {
            after.idle
        } else {
            free.idle_gpu_milli()
        };
        self.evaluate_fgd_after(after, free.cpu_milli, idle_before, shape, before)
    }

    /// [`Scorer::evaluate_fgd`] from a node's GPUs in `after` (zeros past
    /// the node's), its free CPU and idle GPU capacity now and its
    /// fragmentation now; `pick` is 0 for whole GPUs.
    #[inline(always)]
    fn evaluate_fgd_after<const N: usize>(
        &self,
        mut after: AfterFragmentation<'_, N>,
        cpu_before: u64,
        idle_before: u64,
        shape: &TaskShape,
        before: f64,
    ) -> (Evaluation, u32) {
        let cpu_after = after.cpu;
        let steps = self.fgd_steps(shape.gpus);
        let slots = after.slots;
        let idle_after = match shape.gpus {
            GpuRequest::Shared(share) => idle_before - u64::from(share.0),
            GpuRequest::Whole(count) => idle_before.saturating_sub(1000 * u64::from(count)),
        };
        // `fgd-consolidate` also counts GPUs the placement strands for want
        // of CPU (see [`Scorer::stranding`]); the same for every GPU a share
        // could take. Nothing stranded after, nothing newly stranded: the
        // stranding before is asked only otherwise.
        let stranding = if self.policy == PlacementPolicy::FgdConsolidate {
            let stranded = self.workload.cpu_stranded(idle_after, cpu_after);
            if stranded > 0.0 {
                Self::stranding(
                    self.workload.cpu_stranded(idle_before, cpu_before),
                    stranded,
                )
            } else {
                0.0
            }
        } else {
            0.0
        };
        match shape.gpus {
            GpuRequest::Shared(share) => {
                let need = share.0 as u16;
                // The best waste rank first (a table read per GPU), so that
                // FGD scores only the GPUs that have it: in one pass, each
                // fitting GPU's rank counted from 1 (0: it does not fit),
                // the best, and the GPUs that have it. Without branching on
                // the GPUs' values (a node's free capacities are as good as
                // random to a branch predictor, and a missed branch costs
                // about what a GPU's term does).
                let by_waste = u32::from(self.policy == PlacementPolicy::FgdConsolidate);
                let mut top = 0u32;
                let mut tied = 0u64;
                for (index, &slot) in slots.iter().enumerate() {
                    let fits = slot >= need;
                    let rank = u32::from(fits)
                        * (by_waste * self.workload.waste_rank(slot.max(need) - need) + 1);
                    let bit = 1u64 << index;
                    tied = if rank > top {
                        bit
                    } else if rank == top && fits {
                        tied | bit
                    } else {
                        tied
                    };
                    top = top.max(rank);
                }
                let top_rank = top.saturating_sub(1);
                // (level, GPU)
                let mut best: Option<(u32, usize)> = None;
                let mut candidates = tied;
                while candidates != 0 {
                    let index = candidates.trailing_zeros() as usize;
                    candidates &= candidates - 1;
                    // Of GPUs with equal free capacity (which score the
                    // same), the lowest-numbered one.
                    let mut later = candidates;
                    while later != 0 {
                        let other = later.trailing_zeros() as usize;
                        later &= later - 1;
                        if slots[other] == slots[index] {
                            candidates &= !(1 << other);
                        }
                    }
                    let frag = after.with_share(index, need) + stranding;
                    // Integer levels, as for nodes: ties go to the
                    // lowest-numbered GPU.
                    let level = steps.level(before - frag);
                    best = match best {
                        Some((l, _)) if level <= l => best,
                        _ => Some((level, index)),
                    };
                }
                let (rank, (level, index)) = match best {
                    Some(best) => (top_rank, best),
                    None => (0, (steps.level(0.0), 0)),
                };
                (
                    Evaluation {
                        level,
                        pick: 1 << index,
                    },
                    rank,
                )
            }
            GpuRequest::Whole(count) => {
                // Fragmentation depends on how many whole GPUs are taken,
                // not which: score the state with the first `count` taken.
                let frag = after.with_whole(count) + stranding;
                (
                    Evaluation {
                        level: steps.level(before - frag),
                        pick: 0,
                    },
                    0,
                )
            }
        }
    }
}

/// FGD's fragmentation of one node's GPUs after a placement, for the GPUs a
/// scoring tries ([`Scorer::evaluate_fgd`]): the same numbers as
/// [`Scorer::fragmentation_of`] on the node's GPUs with the placement
/// taken (the same sum, [`Tabled::fragmentation`], so equal to the last
/// bit), without copying the GPUs and with the [`WeightTable`] row found
/// and the node's idle capacity and whole GPUs counted once per scoring.
/// A node scored through GPU profiles goes through
/// [`Scorer::fragmentation_of`] for each.
struct AfterFragmentation<'a, const N: usize> {
    /// The node's GPUs, zeros past the node's.
    slots: &'a [u16; N],
    /// Free CPU after the placement.
    cpu: u64,
    idle: u64,
    whole: usize,
    sum: Summing<'a>,
}

/// How an [`AfterFragmentation`] sums: through a weight table's row for
/// the CPU left, or through GPU profiles.
enum Summing<'a> {
    Tabled(Tabled<'a>),
    Profiled {
        scorer: &'a Scorer,
        info: &'a NodeStatic,
        /// The node's GPUs (the first of `slots`).
        len: usize,
        /// Free memory after the placement.
        memory: u64,
        cache: Option<&'a mut ProfileCache>,
    },
}

/// Free GPU capacity (thousandths) and whole free GPUs.
#[inline]
fn idle_and_whole(slots: &[u16]) -> (u64, usize) {
    slots.iter().fold((0, 0), |(idle, whole), &slot| {
        (idle + u64::from(slot), whole + usize::from(slot == 1000))
    })
}

/// What scoring a node under FGD reads of it, kept by a placer beside
/// every node ([`Scorer::node_now`]), so that re-scoring a changed node
/// for shape after shape (most of the default's upkeep: 2.3 million FGD
/// scorings a cycle in `cargo bench -p muster-sched`) reads one record of
/// 56 bytes instead of the node's free and static records, and neither
/// counts the node's GPUs nor finds its weight table again. Complete
/// (`fast`) for nodes of at most eight GPUs that a [`WeightTable`] scores;
/// other nodes are scored from the cluster ([`Scorer::evaluation_now`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct NodeNow {
    /// FGD's fragmentation of the node now.
    fragmentation: f64,
    cpu: u64,
    memory: u64,
    /// Free thousandths on each GPU, zeros past the node's GPUs.
    slots: [u16; 8],
    /// The sum of `slots`.
    idle: u32,
    /// The most any one GPU has free.
    most: u16,
    /// The node's GPU model (its weight table's index).
    model: u8,
    /// GPUs with everything free.
    whole: u8,
    /// [`consolidation_tier`].
    tier: u8,
    /// Whether the fields after `fragmentation` are filled in.
    fast: bool,
}

// One cache line at most.
const _: () = assert!(std::mem::size_of::<NodeNow>() <= 64);

impl NodeNow {
    /// FGD's fragmentation of the node now ([`Scorer::fragmentation_now`]).
    pub(crate) fn fragmentation(&self) -> f64 {
        self.fragmentation
    }
}

/// A [`WeightTable`]'s row for a node's free CPU.
struct Tabled<'a> {
    workload: &'a TypicalWorkload,
    whole_row: &'a [f64],
    share_row: &'a [f64],
}

impl<'a> Tabled<'a> {
    /// The row of `info`'s table for `cpu` free, if a table scores it.
    #[inline]
    fn of(scorer: &'a Scorer, info: &NodeStatic, cpu: u64) -> Option<Self> {
        Some(Self::row(&scorer.workload, scorer.table(info)?, cpu))
    }

    /// The row of `table` for `cpu` free.
    #[inline]
    fn row(workload: &'a TypicalWorkload, table: &'a WeightTable, cpu: u64) -> Self {
        let k = workload.cpu_fitting(cpu);
        Tabled {
            workload,
            whole_row: &table.whole[k * table.whole_columns..][..table.whole_columns],
            share_row: &table.share[k * table.share_columns..][..table.share_columns],
        }
    }

    /// FGD's fragmentation of GPUs with `slot_after(i, slots[i])` free, of
    /// which `idle` thousandths and `whole` whole GPUs: the idle capacity
    /// times all the typical shapes' weight, less what they save (see
    /// [`WeightTable`]), summed GPU by GPU in order.
    #[inline]
    fn fragmentation(
        &self,
        slots: &[u16],
        idle: u64,
        whole: usize,
        mut slot_after: impl FnMut(usize, u16) -> u16,
    ) -> f64 {
        if idle == 0 {
            return 0.0;
        }
        let columns = self.whole_row.len();
        // (Counts as `u32`: converted in one instruction, where a `u64`
        // takes several; the same value.)
        let mut saved = 1000.0 * f64::from(whole as u32) * self.whole_row[whole.min(columns - 1)];
        for (i, &slot) in slots.iter().enumerate() {
            let slot = slot_after(i, slot);
            let q = self.workload.shares_fitting.get(slot);
            saved += f64::from(slot) * self.share_row[usize::from(q)];
        }
        f64::from(idle as u32) * self.workload.total_weight - saved
    }
}

impl<'a, const N: usize> AfterFragmentation<'a, N> {
    fn new(
        scorer: &'a Scorer,
        info: &'a NodeStatic,
        slots: &'a [u16; N],
        len: usize,
        cpu: u64,
        memory: u64,
        cache: Option<&'a mut ProfileCache>,
    ) -> Self {
        let (idle, whole) = idle_and_whole(slots);
        let sum = match Tabled::of(scorer, info, cpu) {
            Some(tabled) => Summing::Tabled(tabled),
            None => Summing::Profiled {
                scorer,
                info,
                len,
                memory,
                cache,
            },
        };
        AfterFragmentation {
            slots,
            cpu,
            idle,
            whole,
            sum,
        }
    }

    /// With a share of `need` taken from GPU `index`.
    #[inline]
    fn with_share(&mut self, index: usize, need: u16) -> f64 {
        let slot = self.slots[index];
        let idle = self.idle - u64::from(need);
        let whole = self.whole - usize::from(slot == 1000 && need > 0);
        self.after(
            idle,
            whole,
            |i, free| if i == index { free - need } else { free },
        )
    }

    /// With `count` whole GPUs taken (the first ones: fragmentation depends
    /// on how many, not which).
    #[inline]
    fn with_whole(&mut self, count: u32) -> f64 {
        let taken = (count as usize).min(self.whole);
        let idle = self.idle - 1000 * taken as u64;
        let whole = self.whole - taken;
        let mut left = taken;
        self.after(idle, whole, |_, free| {
            // Without a branch on the GPU's value (see `evaluate_fgd`).
            let take = left > 0 && free == 1000;
            left -= usize::from(take);
            if take { 0 } else { free }
        })
    }

    /// With `slot_after(i, slots[i])` free on each GPU, of which `idle`
    /// thousandths and `whole` whole GPUs.
    #[inline]
    fn after(
        &mut self,
        idle: u64,
        whole: usize,
        mut slot_after: impl FnMut(usize, u16) -> u16,
    ) -> f64 {
        match &mut self.sum {
            Summing::Tabled(tabled) => tabled.fragmentation(self.slots, idle, whole, slot_after),
            Summing::Profiled {
                scorer,
                info,
                len,
                memory,
                cache,
            } => {
                let mut buffer = [0u16; N];
                for (i, (after, &slot)) in buffer.iter_mut().zip(self.slots).enumerate() {
                    *after = slot_after(i, slot);
                }
                let mut local = ProfileCache::default();
                let cache = match cache.as_deref_mut() {
                    Some(cache) => cache,
                    None => &mut local,
                };
                scorer.fragmentation_of(info, &buffer[..*len], self.cpu, *memory, cache)
            }
        }
    }
}

/// The published simulator's GPU packing score (levels 0..=100): a task
/// that fits on GPUs already in use scores 100 minus a tenth of their free
/// percentage (at least 50); one that needs fully free GPUs of a node in use
/// scores 50 minus how many (at least 33); on a node with every GPU free,
/// 33 minus the node's GPU count (at least that count). CPU-only tasks score
/// 0 everywhere, so the name decides.
fn packing_level(info: &NodeStatic, free: &NodeFree, gpus: GpuRequest) -> u32 {
    if gpus.total().0 == 0 {
        return 0;
    }
    // Healthy GPUs' free capacity, on the stack (a node has at most 64).
    let mut buffer = [0u16; 64];
    let mut len = 0;
    for (&slot, &healthy) in free.gpu.iter().zip(&info.gpu_healthy) {
        if healthy && len < buffer.len() {
            buffer[len] = slot;
            len += 1;
        }
    }
    let slots = &mut buffer[..len];
    let fully_free = slots.iter().filter(|&&slot| slot == 1000).count() as u32;
    if fully_free == len as u32 {
        return (MAX_PACKING / 3).saturating_sub(fully_free).max(fully_free);
    }
    // The task takes the tightest GPUs that fit.
    slots.sort_unstable();
    let need = gpus.per_gpu().0 as u16;
    let (mut whole_used, mut free_percent) = (0u32, 0u32);
    for &slot in slots
        .iter()
        .filter(|&&slot| slot >= need)
        .take(gpus.gpu_count() as usize)
    {
        whole_used += u32::from(slot == 1000);
        free_percent += u32::from(slot) * 100 / 1000;
    }
    if whole_used > 0 {
        return (MAX_PACKING / 2)
            .saturating_sub(whole_used)
            .max(MAX_PACKING / 3);
    }
    (MAX_PACKING.saturating_sub(free_percent / 10)).max(MAX_PACKING / 2)
}

const MAX_PACKING: u32 = 100;

#[cfg(test)]
mod tests {
    use super::*;
    use muster_model::GpuMilli;

    fn node(gpus: usize) -> NodeStatic {
        NodeStatic {
            name: muster_model::NodeName::from("n"),
            real: 0,
            pool: 0,
            rack: 0,
            model: 0,
            accepted_by: crate::cluster::Bits::default(),
            gpu_memory_mib: 80 * 1024,
            cpu_milli: 64_000,
            memory_mib: 1 << 20,
            gpu_index: (0..gpus as u32).collect(),
            nvlink_domain: vec![0; gpus],
            cordoned: false,
            healthy: true,
            gpu_healthy: vec![true; gpus],
            containers: true,
            reserved: false,
        }
    }

    fn shape(gpus: GpuRequest, cpu_milli: u64, weight: f64) -> TypicalShape {
        TypicalShape {
            gpus,
            cpu_milli,
            memory_mib: 0,
            models: ModelMask::ANY,
            weight,
        }
    }

    /// `fgd` and `fgd-consolidate` scorers of typical one-GPU tasks asking
    /// `cpu_milli`, on nodes of at most `max_cpu_milli` and `max_gpus`.
    fn one_gpu_scorers(cpu_milli: u64, max_cpu_milli: f64, max_gpus: f64) -> (Scorer, Scorer) {
        let workload = TypicalWorkload::new(vec![shape(GpuRequest::Whole(1), cpu_milli, 1.0)]);
        let scale = Scale {
            cpu_milli: max_cpu_milli,
            gpus: max_gpus,
        };
        (
            Scorer::new(PlacementPolicy::Fgd, workload.clone(), scale),
            Scorer::new(PlacementPolicy::FgdConsolidate, workload, scale),
        )
    }

    #[test]
    fn fragmentation_matches_a_hand_computed_example() {
        // Free: 1000, 1000, 600, 200 thousandths; 8 CPUs free.
        let free = [1000, 1000, 600, 200];
        let workload = TypicalWorkload::new(vec![
            // 2 whole GPUs: fits; partial GPUs 600 + 200 are fragments.
            shape(GpuRequest::Whole(2), 1000, 0.25),
            // 3 whole GPUs: does not fit: all 2800 idle is fragment.
            shape(GpuRequest::Whole(3), 1000, 0.25),
            // half a GPU: fits; only the 200 below 500 is fragment.
            shape(GpuRequest::Shared(GpuMilli(500)), 1000, 0.25),
            // CPU-only: all idle GPU capacity is fragment... but it needs
            // 16 CPUs and cannot run at all: still all idle.
            shape(GpuRequest::Whole(0), 16_000, 0.25),
        ]);
        let frag = workload.fragmentation(&node(4), &free, 8_000, 1 << 20);
        let expected = 0.25 * 800.0 + 0.25 * 2800.0 + 0.25 * 200.0 + 0.25 * 2800.0;
        assert!((frag - expected).abs() < 1e-9, "{frag} != {expected}");
    }

    #[test]
    fn the_cpu_step_function_agrees_with_the_shape_loop() {
        let mut shapes = Vec::new();
        for (i, gpus) in [
            GpuRequest::Whole(0),
            GpuRequest::Whole(1),
            GpuRequest::Whole(2),
            GpuRequest::Whole(4),
            GpuRequest::Shared(GpuMilli(250)),
            GpuRequest::Shared(GpuMilli(600)),
        ]
        .into_iter()
        .enumerate()
        {
            let mut typical = shape(gpus, 2_000 * (i as u64 % 4), 0.1 + i as f64 / 50.0);
            // Set 1 holds model 1 only.
            typical.models = if i == 3 { ModelMask(1) } else { ModelMask::ANY };
            shapes.push(typical);
        }
        let fast = TypicalWorkload::new(shapes);
        let mut slow = fast.clone();
        slow.memory_free = false;
        for free in [
            vec![1000, 1000, 1000, 1000],
            vec![1000, 400, 0, 750],
            vec![200, 200, 100, 0],
            vec![0, 0, 0, 0],
        ] {
            for cpu in [0, 1_000, 2_000, 3_999, 4_000, 6_000, 64_000] {
                for model in [0u32, 1] {
                    let mut info = node(4);
                    info.model = model;
                    if model == 1 {
                        info.accepted_by.insert(1);
                    }
                    let a = fast.fragmentation(&info, &free, cpu, 1 << 20);
                    let b = slow.fragmentation(&info, &free, cpu, 1 << 20);
                    assert!(
                        (a - b).abs() < 1e-6,
                        "{free:?} cpu {cpu} model {model}: {a} != {b}"
                    );
                }
            }
        }
    }

    /// Typical shapes of every kind, two held to model 1 (mask 1), shares
    /// of sizes that fall between and on free capacities.
    fn mixed_workload() -> TypicalWorkload {
        let mut shapes = Vec::new();
        for (i, gpus) in [
            GpuRequest::Whole(0),
            GpuRequest::Whole(1),
            GpuRequest::Whole(2),
            GpuRequest::Whole(8),
            GpuRequest::Shared(GpuMilli(110)),
            GpuRequest::Shared(GpuMilli(470)),
            GpuRequest::Shared(GpuMilli(470)),
            GpuRequest::Shared(GpuMilli(810)),
            GpuRequest::Whole(1),
        ]
        .into_iter()
        .enumerate()
        {
            let mut typical = shape(gpus, 1_000 * (i as u64 * 7 % 20), 0.05 + i as f64 / 40.0);
            if i == 2 || i == 6 {
                typical.models = ModelMask(1);
            }
            shapes.push(typical);
        }
        TypicalWorkload::new(shapes)
    }

    /// [`mixed_workload`] with one typical shape asking memory: no weight
    /// table scores it, GPU profiles do.
    fn memory_asking_workload() -> TypicalWorkload {
        let mut shapes = mixed_workload().shapes().to_vec();
        shapes[3].memory_mib = 4_096;
        TypicalWorkload::new(shapes)
    }

    /// A random node state for [`mixed_workload`]: free GPUs (often whole,
    /// empty or a typical gap), free CPU, and the node (model 0 or 1).
    fn random_state(rng: &mut impl rand::Rng) -> (NodeStatic, Vec<u16>, u64) {
        let gpus = rng.random_range(1..=8);
        let free: Vec<u16> = (0..gpus)
            .map(|_| match rng.random_range(0..4) {
                0 => 0,
                1 => 1000,
                2 => [110, 190, 470, 530, 810, 890][rng.random_range(0..6)],
                _ => rng.random_range(0..=1000),
            })
            .collect();
        let cpu = rng.random_range(0..24) * 1_000 + rng.random_range(0..2) * 500;
        let model = rng.random_range(0..2u32);
        let mut info = node(gpus);
        info.model = model;
        if model == 1 {
            info.accepted_by.insert(1);
        }
        (info, free, cpu)
    }

    /// A node scored from its [`NodeNow`] (as a placer's indexes do) gets
    /// the evaluation, to the last bit, that scoring it from the cluster
    /// gets: nodes of one to ten GPUs (those past eight scored from the
    /// cluster either way), unhealthy GPUs, two models, CPU and memory
    /// short or plenty, shares, whole GPUs and CPU only, under both FGDs.
    #[test]
    fn a_node_scored_from_its_record_scores_as_from_the_cluster() {
        use muster_model::{CpuMilli, GpuModel, GpuSpec, MemoryMib, NodeSpec};
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(23);
        let inputs: Vec<crate::cluster::NodeInput> = (0..60)
            .map(|i| {
                let gpus = 1 + i % 10;
                crate::cluster::NodeInput::schedulable(NodeSpec {
                    name: muster_model::NodeName(format!("n{i}")),
                    gpus: (0..gpus)
                        .map(|index| GpuSpec {
                            index: index as u32,
                            uuid: format!("GPU-{i}-{index}"),
                            model: GpuModel::new(["A", "B"][i % 2]),
                            memory: MemoryMib(32 * 1024),
                            nvlink_domain: index as u32 / 4,
                        })
                        .collect(),
                    pool: muster_model::PoolName::from("default"),
                    rack: muster_model::RackName("r".into()),
                    cpu: CpuMilli(24_000),
                    memory: MemoryMib(1 << 16),
                })
            })
            .collect();
        let mut cluster = ClusterState::new(inputs).expect("nodes");
        let scale = Scale::of(&cluster);
        for (policy, workload) in [
            (PlacementPolicy::Fgd, mixed_workload()),
            (PlacementPolicy::FgdConsolidate, mixed_workload()),
            // Typical shapes asking memory: no weight table, every node
            // scored from the cluster.
            (PlacementPolicy::FgdConsolidate, memory_asking_workload()),
        ] {
            let tabled = workload.memory_free;
            let scorer = Scorer::new(policy, workload, scale);
            let mut cache = ProfileCache::default();
            let mut fast = 0;
            for _ in 0..40 {
                for node in 0..cluster.len() {
                    let gpus = cluster.nodes[node].gpu_healthy.len();
                    let (_, free, cpu) = random_state(&mut rng);
                    for index in 0..gpus {
                        let healthy = rng.random_range(0..8) > 0;
                        cluster.nodes[node].gpu_healthy[index] = healthy;
                        cluster.free[node].gpu[index] = if healthy {
                            free.get(index).copied().unwrap_or(1000)
                        } else {
                            0
                        };
                    }
                    cluster.free[node].cpu_milli = cpu;
                    cluster.free[node].memory_mib = rng.random_range(0..1u64 << 16);
                }
                for node in 0..cluster.len() as NodeIndex {
                    let now = scorer.node_now(&cluster, node, &mut cache);
                    fast += usize::from(now.fast);
                    let before = scorer.fragmentation_now(&cluster, node, &mut cache);
                    assert_eq!(now.fragmentation().to_bits(), before.to_bits());
                    for gpus in [
                        GpuRequest::Whole(0),
                        GpuRequest::Whole(1),
                        GpuRequest::Whole(2),
                        GpuRequest::Whole(3),
                        GpuRequest::Whole(8),
                        GpuRequest::Shared(GpuMilli(110)),
                        GpuRequest::Shared(GpuMilli(230)),
                        GpuRequest::Shared(GpuMilli(470)),
                        GpuRequest::Shared(GpuMilli(810)),
                        GpuRequest::Shared(GpuMilli(1000)),
                    ] {
                        for cpu_milli in [0, 1_000, 4_000, 12_000] {
                            let shape = TaskShape {
                                gpus,
                                memory_mib: 1 << 14,
                                ..one_gpu_task(cpu_milli)
                            };
                            let expected = scorer.evaluation_passing_static(
                                &cluster, node, &shape, before, &mut cache,
                            );
                            let got =
                                scorer.evaluation_now(&cluster, node, &now, &shape, &mut cache);
                            assert_eq!(got, expected, "{policy:?} node {node} {shape:?} {now:?}");
                        }
                    }
                }
            }
            // Nodes of up to eight GPUs (eight in ten) are read from
            // their records where a table scores them.
            if tabled {
                assert!(fast > 40 * 60 / 2, "{fast}");
            } else {
                assert_eq!(fast, 0);
            }
        }
    }

    #[test]
    fn the_weight_tables_agree_with_the_shape_loop() {
        use rand::SeedableRng;
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        let workload = mixed_workload();
        let scale = Scale {
            cpu_milli: 64_000.0,
            gpus: 8.0,
        };
        let scorer = Scorer::new(PlacementPolicy::Fgd, workload.clone(), scale);
        let mut cache = ProfileCache::default();
        for _ in 0..5_000 {
            let (info, free, cpu) = random_state(&mut rng);
            let model = info.model;
            let table = scorer.fragmentation_of(&info, &free, cpu, 1 << 20, &mut cache);
            let reference = workload.fragmentation(&info, &free, cpu, 1 << 20);
            assert!(
                (table - reference).abs() < 1e-9 * (1.0 + reference.abs()),
                "{free:?} cpu {cpu} model {model}: {table} != {reference}"
            );
        }
    }

    /// A scoring's fragmentation after a placement
    /// ([`AfterFragmentation`]) is [`Scorer::fragmentation_of`] of the state
    /// after it to the last bit, for every share on every GPU it fits and
    /// every count of whole GPUs, through the weight tables and through
    /// GPU profiles (a workload whose shapes ask memory): the levels, and so
    /// the decisions, do not change with how it is computed.
    #[test]
    fn fragmentation_after_a_placement_is_that_of_the_state_after_to_the_bit() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let scale = Scale {
            cpu_milli: 64_000.0,
            gpus: 8.0,
        };
        for workload in [mixed_workload(), memory_asking_workload()] {
            let scorer = Scorer::new(PlacementPolicy::FgdConsolidate, workload, scale);
            let mut cache = ProfileCache::default();
            for _ in 0..2_000 {
                let (info, free, cpu) = random_state(&mut rng);
                let cpu_after = cpu / 2;
                let memory = rng.random_range(0..1u64 << 20);
                let reference = |after: &[u16], cache: &mut ProfileCache| {
                    scorer.fragmentation_of(&info, after, cpu_after, memory, cache)
                };
                // As scorings see the GPUs: zeros past the node's.
                let mut padded = [0u16; 64];
                padded[..free.len()].copy_from_slice(&free);
                for need in [1u16, 110, 470, 530, 1000] {
                    for index in 0..free.len() {
                        if free[index] < need {
                            continue;
                        }
                        let mut after = free.clone();
                        after[index] -= need;
                        let expected = reference(&after, &mut cache);
                        let got = AfterFragmentation::new(
                            &scorer,
                            &info,
                            &padded,
                            free.len(),
                            cpu_after,
                            memory,
                            Some(&mut cache),
                        )
                        .with_share(index, need);
                        assert_eq!(
                            got.to_bits(),
                            expected.to_bits(),
                            "{free:?} share {need} on {index}"
                        );
                    }
                }
                let whole = free.iter().filter(|&&slot| slot == 1000).count() as u32;
                for count in 0..=whole {
                    let mut after = free.clone();
                    let mut left = count;
                    for slot in after.iter_mut() {
                        if left > 0 && *slot == 1000 {
                            *slot = 0;
                            left -= 1;
                        }
                    }
                    let expected = reference(&after, &mut cache);
                    let got = AfterFragmentation::new(
                        &scorer,
                        &info,
                        &padded,
                        free.len(),
                        cpu_after,
                        memory,
                        None,
                    )
                    .with_whole(count);
                    assert_eq!(got.to_bits(), expected.to_bits(), "{free:?} {count} whole");
                }
            }
        }
    }

    #[test]
    fn typical_shapes_cover_the_requested_fraction() {
        let a = TaskShape {
            container: false,
            reserved: Default::default(),
            gpus: GpuRequest::Whole(1),
            cpu_milli: 1000,
            memory_mib: 0,
            models: ModelMask::ANY,
            pool: None,
            min_gpu_memory_mib: 0,
        };
        let b = TaskShape {
            container: false,
            reserved: Default::default(),
            gpus: GpuRequest::Shared(GpuMilli(500)),
            ..a
        };
        let c = TaskShape {
            container: false,
            reserved: Default::default(),
            gpus: GpuRequest::Whole(8),
            ..a
        };
        let tasks: Vec<TaskShape> = std::iter::repeat_n(a, 90)
            .chain(std::iter::repeat_n(b, 8))
            .chain(std::iter::repeat_n(c, 2))
            .collect();
        let workload = TypicalWorkload::from_tasks(tasks.iter(), 0.95);
        assert_eq!(
            workload.shapes().len(),
            2,
            "90% + 8% reach 95%; the 2% tail is left out"
        );
        assert!((workload.shapes()[0].weight - 90.0 / 98.0).abs() < 1e-12);
    }

    #[test]
    fn fgd_prefers_the_gpu_that_leaves_least_fragment() {
        // Typical: half-GPU tasks. A 0.4 share on GPU 1 (free 500) leaves 100,
        // a fragment; on GPU 0 (free 900) it leaves 500, still usable.
        let scorer = Scorer::new(
            PlacementPolicy::Fgd,
            TypicalWorkload::new(vec![shape(GpuRequest::Shared(GpuMilli(500)), 0, 1.0)]),
            Scale {
                cpu_milli: 64_000.0,
                gpus: 2.0,
            },
        );
        let free = NodeFree {
            gpu: vec![900, 500],
            cpu_milli: 64_000,
            memory_mib: 1 << 20,
        };
        let task = TaskShape {
            container: false,
            reserved: Default::default(),
            gpus: GpuRequest::Shared(GpuMilli(400)),
            cpu_milli: 0,
            memory_mib: 0,
            models: ModelMask::ANY,
            pool: None,
            min_gpu_memory_mib: 0,
        };
        let evaluation = scorer.evaluate_fitting(&node(2), &free, &task);
        assert_eq!(evaluation.pick, 1 << 0);
    }

    fn one_gpu_task(cpu_milli: u64) -> TaskShape {
        TaskShape {
            container: false,
            reserved: Default::default(),
            gpus: GpuRequest::Whole(1),
            cpu_milli,
            memory_mib: 0,
            models: ModelMask::ANY,
            pool: None,
            min_gpu_memory_mib: 0,
        }
    }

    #[test]
    fn consolidation_tiers_count_healthy_gpus_cpu_and_memory() {
        let info = node(2);
        let empty = NodeFree {
            gpu: vec![1000, 1000],
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
        };
        assert_eq!(consolidation_tier(&info, &empty), 0);
        let cpu_only = NodeFree {
            cpu_milli: info.cpu_milli - 1,
            ..empty.clone()
        };
        assert_eq!(consolidation_tier(&info, &cpu_only), 1);
        let memory_only = NodeFree {
            memory_mib: info.memory_mib - 1,
            ..empty.clone()
        };
        assert_eq!(consolidation_tier(&info, &memory_only), 1);
        let gpu = NodeFree {
            gpu: vec![1000, 700],
            ..empty.clone()
        };
        assert_eq!(consolidation_tier(&info, &gpu), 2);
        // An unhealthy GPU reads as 0 free but is not work.
        let mut sick = node(2);
        sick.gpu_healthy[1] = false;
        let sick_free = NodeFree {
            gpu: vec![1000, 0],
            ..empty
        };
        assert_eq!(consolidation_tier(&sick, &sick_free), 0);
    }

    #[test]
    fn consolidation_prefers_a_node_in_use_when_fgd_ties() {
        // Typical: one-GPU tasks; no placement here makes a fragment, so FGD
        // scores every node alike (and the name decides).
        let (fgd, consolidate) = one_gpu_scorers(0, 64_000.0, 2.0);
        let info = node(2);
        let empty = NodeFree {
            gpu: vec![1000, 1000],
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
        };
        let cpu_work = NodeFree {
            cpu_milli: info.cpu_milli - 8_000,
            ..empty.clone()
        };
        let gpu_work = NodeFree {
            gpu: vec![0, 1000],
            ..cpu_work.clone()
        };
        let task = one_gpu_task(4_000);
        let levels = |scorer: &Scorer| {
            [&empty, &cpu_work, &gpu_work]
                .map(|free| scorer.evaluate_fitting(&info, free, &task).level)
        };
        let [a, b, c] = levels(&fgd);
        assert!(a == b && b == c, "FGD ties: {a} {b} {c}");
        let [a, b, c] = levels(&consolidate);
        assert!(a < b && b < c, "empty < CPU work < GPU work: {a} {b} {c}");
        assert!(c <= MAX_LEVEL);
        // A better FGD level still wins over consolidation.
        let consolidate_level = |free: &NodeFree, task: &TaskShape| {
            consolidate.evaluate_fitting(&info, free, task).level
        };
        let partial = NodeFree {
            gpu: vec![500, 1000],
            ..empty.clone()
        };
        let half = TaskShape {
            container: false,
            reserved: Default::default(),
            gpus: GpuRequest::Shared(GpuMilli(500)),
            ..one_gpu_task(0)
        };
        // The half-GPU task fills GPU 0 of `partial` (no fragment left) but
        // splits a whole GPU of the empty node (a fragment for 1-GPU tasks).
        assert!(consolidate_level(&partial, &half) > consolidate_level(&empty, &half));
    }

    #[test]
    fn cpu_stranding_matches_a_hand_computed_example() {
        // Half the tasks take a whole GPU and 10 CPUs, half 500 thousandths
        // and 2 CPUs: (0.5 x 10 + 0.5 x 2) CPUs per (0.5 x 1 + 0.5 x 0.5)
        // GPUs = 8 CPUs per GPU. CPU-only shapes do not count.
        let workload = TypicalWorkload::new(vec![
            shape(GpuRequest::Whole(1), 10_000, 0.4),
            shape(GpuRequest::Shared(GpuMilli(500)), 2_000, 0.4),
            shape(GpuRequest::Whole(0), 30_000, 0.2),
        ]);
        assert!((workload.cpu_per_gpu() - 8_000.0).abs() < 1e-9);
        // 4 idle GPUs, 16 CPUs: they feed 2 GPUs; 2,000 thousandths stranded.
        assert!((workload.cpu_stranded(4_000, 16_000) - 2_000.0).abs() < 1e-9);
        // Enough CPUs: nothing stranded.
        assert_eq!(workload.cpu_stranded(4_000, 40_000), 0.0);
        assert_eq!(workload.cpu_stranded(0, 0), 0.0);
        // No GPU shapes: no rate, nothing stranded.
        let cpu_only = TypicalWorkload::new(vec![shape(GpuRequest::Whole(0), 4_000, 1.0)]);
        assert_eq!(cpu_only.cpu_stranded(8_000, 0), 0.0);
    }

    #[test]
    fn expected_share_waste_matches_a_hand_computed_example() {
        // Shares of 800 (60% of tasks) leave slivers of 200 that only the
        // 200 shares (10%) fit: oversubscribed, so every gap that only
        // shares of 200 or less fit is dead, up to the next share size, 300.
        let shares = |sizes: &[(u32, f64)]| {
            let mut shapes: Vec<TypicalShape> = sizes
                .iter()
                .map(|&(size, weight)| shape(GpuRequest::Shared(GpuMilli(size)), 1_000, weight))
                .collect();
            let rest = 1.0 - sizes.iter().map(|s| s.1).sum::<f64>();
            shapes.push(shape(GpuRequest::Whole(1), 8_000, rest));
            TypicalWorkload::new(shapes)
        };
        let workload = shares(&[(800, 0.6), (200, 0.1), (300, 0.2)]);
        assert_eq!(workload.dead_gaps_below(), 300);
        let waste = |free: u16| workload.expected_share_waste(free);
        assert_eq!(waste(0), 0.0);
        assert_eq!(waste(250), 250.0, "dead: only a 200 share fits");
        // 300: a 200 share (1 part in 3) leaves a dead 100, a 300 share
        // (2 parts) fills it: (100 x 0.1 + 0 x 0.2) / 0.3.
        assert!((waste(300) - 100.0 / 3.0).abs() < 1e-9, "{}", waste(300));
        // 500: a 200 share leaves 300 (33.3 expected), a 300 share a dead
        // 200: (33.33 x 0.1 + 200 x 0.2) / 0.3.
        let expected = (100.0 / 3.0 * 0.1 + 200.0 * 0.2) / 0.3;
        assert!((waste(500) - expected).abs() < 1e-9, "{}", waste(500));
        // No sliver outnumbers what fits it (600 leaves 400, and 400 shares
        // are more common): no dead gaps beyond those no share fits.
        let workload = shares(&[(600, 0.2), (400, 0.5)]);
        assert_eq!(workload.dead_gaps_below(), 0);
        assert_eq!(workload.expected_share_waste(399), 399.0);
        assert_eq!(workload.expected_share_waste(400), 0.0);
        // 800: a 600 share leaves a dead 200, a 400 share fills it exactly.
        let expected = 200.0 * 0.2 / 0.7;
        assert!((workload.expected_share_waste(800) - expected).abs() < 1e-9);
        // Without typical shares every gap is dead.
        let whole = TypicalWorkload::new(vec![shape(GpuRequest::Whole(1), 8_000, 1.0)]);
        assert_eq!(whole.expected_share_waste(370), 370.0);
    }

    #[test]
    fn expected_share_waste_stays_within_the_gap_for_any_workload() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for _ in 0..200 {
            // Up to 300 shapes, shares of any size (some repeated, some out
            // of range), whole GPUs and CPU-only tasks.
            let count = rng.random_range(1..300);
            let shapes: Vec<TypicalShape> = (0..count)
                .map(|_| {
                    let gpus = match rng.random_range(0..4) {
                        0 => GpuRequest::Whole(rng.random_range(0..9)),
                        _ => GpuRequest::Shared(GpuMilli(rng.random_range(0..1_200))),
                    };
                    shape(gpus, 1_000, rng.random_range(0.0..1.0) / count as f64)
                })
                .collect();
            let sizes: Vec<u16> = shapes
                .iter()
                .filter_map(|s| match s.gpus {
                    GpuRequest::Shared(size) => Some(size.0.clamp(1, 1000) as u16),
                    GpuRequest::Whole(_) => None,
                })
                .collect();
            let workload = TypicalWorkload::new(shapes);
            let dead = workload.dead_gaps_below();
            assert!(dead == 0 || dead == 1001 || sizes.contains(&dead), "{dead}");
            assert_eq!(workload.expected_share_waste(0), 0.0);
            for free in 0..=1000u16 {
                let waste = workload.expected_share_waste(free);
                assert!((0.0..=f64::from(free)).contains(&waste), "{free}: {waste}");
                if free < dead {
                    assert_eq!(waste, f64::from(free));
                }
                assert!(workload.waste_rank(free) < WASTE_CLASSES);
            }
        }
    }

    #[test]
    fn a_share_goes_where_its_gpu_is_expected_to_end_least_wasted() {
        // Typical: whole GPUs (half the tasks), shares of 500 and 250.
        // A 250 share on a GPU with 400 free leaves 150 that nothing fits;
        // on a fresh GPU it leaves 750, which a 500 and a 250 fill. FGD,
        // one task ahead, prefers the tight fit (the 400 gap was already
        // useless to whole-GPU tasks and 500 shares); the default takes the
        // fresh GPU.
        let workload = TypicalWorkload::new(vec![
            shape(GpuRequest::Whole(1), 8_000, 0.5),
            shape(GpuRequest::Shared(GpuMilli(500)), 1_000, 0.3),
            shape(GpuRequest::Shared(GpuMilli(250)), 1_000, 0.2),
        ]);
        assert_eq!(workload.expected_share_waste(150), 150.0);
        assert_eq!(workload.expected_share_waste(750), 0.0);
        let scale = Scale {
            cpu_milli: 64_000.0,
            gpus: 2.0,
        };
        let fgd = Scorer::new(PlacementPolicy::Fgd, workload.clone(), scale);
        let consolidate = Scorer::new(PlacementPolicy::FgdConsolidate, workload, scale);
        let info = node(1);
        let free = |slot: u16| NodeFree {
            gpu: vec![slot],
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
        };
        let task = TaskShape {
            gpus: GpuRequest::Shared(GpuMilli(250)),
            ..one_gpu_task(1_000)
        };
        let level =
            |scorer: &Scorer, slot: u16| scorer.evaluate_fitting(&info, &free(slot), &task).level;
        assert!(level(&fgd, 400) > level(&fgd, 1000), "FGD fills the gap");
        assert!(
            level(&consolidate, 1000) > level(&consolidate, 400),
            "the default takes the fresh GPU"
        );
        // Within a node, the same choice of GPU.
        let two = node(2);
        let both = NodeFree {
            gpu: vec![400, 1000],
            cpu_milli: two.cpu_milli,
            memory_mib: two.memory_mib,
        };
        assert_eq!(fgd.evaluate_fitting(&two, &both, &task).pick, 0b01);
        assert_eq!(consolidate.evaluate_fitting(&two, &both, &task).pick, 0b10);
        assert!(consolidate.evaluate_fitting(&two, &both, &task).level <= MAX_LEVEL);
    }

    #[test]
    fn a_cpu_only_task_goes_where_it_strands_no_gpus() {
        // Typical: one GPU and 10 CPUs. Node A: 4 GPUs, 40 CPUs (just
        // enough); node B: 4 GPUs, 80 CPUs. A CPU-only task of 8 CPUs leaves
        // every typical shape fitting on both, so FGD scores them alike;
        // on A it leaves 32 CPUs for 4 idle GPUs (3.2 fed, 800 thousandths
        // stranded), on B none.
        let (fgd, consolidate) = one_gpu_scorers(10_000, 80_000.0, 4.0);
        let lean = NodeStatic {
            cpu_milli: 40_000,
            ..node(4)
        };
        let rich = NodeStatic {
            cpu_milli: 80_000,
            ..node(4)
        };
        let empty = |info: &NodeStatic| NodeFree {
            gpu: vec![1000; 4],
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
        };
        let task = TaskShape {
            gpus: GpuRequest::Whole(0),
            ..one_gpu_task(8_000)
        };
        let level = |scorer: &Scorer, info: &NodeStatic| {
            scorer.evaluate_fitting(info, &empty(info), &task).level
        };
        assert_eq!(level(&fgd, &lean), level(&fgd, &rich), "FGD sees no harm");
        // 25 levels for CPU-only tasks: 800 stranded, at a third, is
        // sigmoid(-0.267) x 25 = 10.84, level 10 (12 with nothing
        // stranded), times 3 tiers.
        assert!((STRANDED_WEIGHT - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(level(&consolidate, &rich), 12 * CONSOLIDATION_TIERS);
        assert_eq!(level(&consolidate, &lean), 10 * CONSOLIDATION_TIERS);
    }

    #[test]
    fn relieving_stranded_gpus_earns_nothing() {
        // A node built CPU-poor (4 GPUs, 20 CPUs: 2 GPUs stranded at 10 CPUs
        // a GPU) against a balanced one: a 1-GPU task of 1 CPU relieves the
        // poor node (3 idle, 19 CPUs: 1.1 stranded), which must not raise its
        // score above what FGD and the tiers give.
        let (_, consolidate) = one_gpu_scorers(10_000, 40_000.0, 4.0);
        let task = one_gpu_task(1_000);
        for cpu_milli in [20_000, 40_000] {
            let info = NodeStatic {
                cpu_milli,
                ..node(4)
            };
            let free = NodeFree {
                gpu: vec![1000; 4],
                cpu_milli,
                memory_mib: info.memory_mib,
            };
            // No fragment for the typical shape either way: level 25 of 50
            // (sigmoid(0)), empty-node tier.
            assert_eq!(
                consolidate.evaluate_fitting(&info, &free, &task).level,
                25 * CONSOLIDATION_TIERS,
                "{cpu_milli} CPUs"
            );
        }
    }

    #[test]
    fn packing_scores_follow_the_published_rule() {
        let info = node(4);
        let empty = NodeFree {
            gpu: vec![1000; 4],
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
        };
        let used = NodeFree {
            gpu: vec![200, 1000, 1000, 500],
            ..empty.clone()
        };
        let share = |milli| GpuRequest::Shared(GpuMilli(milli));
        // Every GPU free: 33 minus the GPU count.
        assert_eq!(packing_level(&info, &empty, GpuRequest::Whole(1)), 29);
        // Fits on the GPU with 500 free (the tightest): 100 - 50 / 10.
        assert_eq!(packing_level(&info, &used, share(300)), 95);
        // Needs a fully free GPU of a node in use: 50 - 1.
        assert_eq!(packing_level(&info, &used, share(600)), 49);
        assert_eq!(packing_level(&info, &used, GpuRequest::Whole(2)), 48);
        // CPU-only tasks: 0 everywhere.
        assert_eq!(packing_level(&info, &used, GpuRequest::Whole(0)), 0);
        // An unhealthy GPU is not counted as one in use.
        let mut sick = node(4);
        sick.gpu_healthy[0] = false;
        let sick_free = NodeFree {
            gpu: vec![0, 1000, 1000, 1000],
            ..empty
        };
        assert_eq!(packing_level(&sick, &sick_free, GpuRequest::Whole(1)), 30);
    }

    #[test]
    fn the_sigmoid_steps_agree_with_the_formula() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for levels in [100u32, 50, 25] {
            let steps = SigmoidSteps::new(levels);
            let check = |drop: f64| {
                assert_eq!(
                    steps.level(drop),
                    sigmoid_level(drop, f64::from(levels)),
                    "{levels} levels, drop {drop:e}"
                );
            };
            // Every quarter from -60,000 to 60,000 (fragmentation drops are
            // sums of thousandths of GPUs times weights below 1).
            for quarter in -240_000..=240_000 {
                check(f64::from(quarter) / 4.0);
            }
            // At and just below each level's start, where a wrong threshold
            // would show.
            for &start in &steps.starts {
                check(start);
                check(start.next_down());
                check(start.next_up());
            }
            for _ in 0..100_000 {
                check(rng.random_range(-1e7..1e7));
                check(rng.random_range(-5000.0..5000.0));
            }
            for drop in [
                0.0,
                -0.0,
                f64::MAX,
                f64::MIN,
                f64::INFINITY,
                f64::NEG_INFINITY,
            ] {
                check(drop);
            }
            // A level starts where the formula reaches it and not before.
            assert_eq!(steps.starts.len(), levels as usize + 1);
            assert!(steps.starts.windows(2).all(|w| w[0] < w[1]));
        }
    }
}
