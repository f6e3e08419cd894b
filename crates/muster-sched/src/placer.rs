//! Node selection for tasks and gangs, fast.
//!
//! [`Placer`] keeps, for every task shape it has been asked about, the score
//! level of every node (an index: per level, a bit set of nodes). A placement
//! changes one node, so only that node is re-scored, once per known shape;
//! finding the best node is then a walk down the levels to the first set bit.
//! This makes exactly the decisions of [`best_node_by_scan`], which scores
//! every node for every task; a property test holds the two together.

use crate::cluster::{ClusterState, FilterReason, NodeIndex, TaskPlacement, TaskShape};
use crate::policy::{Evaluation, GpuPick, PlacementPolicy, ProfileCache, Scorer};
use muster_model::TopologyStrength;
use rand::Rng;
use std::collections::BTreeMap;

const INFEASIBLE: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Bucket {
    count: u32,
    bits: Vec<u64>,
}

impl Bucket {
    fn new(nodes: usize) -> Self {
        Bucket {
            count: 0,
            bits: vec![0; nodes.div_ceil(64)],
        }
    }

    fn insert(&mut self, node: NodeIndex) {
        self.bits[node as usize / 64] |= 1 << (node % 64);
        self.count += 1;
    }

    fn remove(&mut self, node: NodeIndex) {
        self.bits[node as usize / 64] &= !(1 << (node % 64));
        self.count -= 1;
    }

    fn iter(&self) -> impl Iterator<Item = NodeIndex> + '_ {
        self.bits
            .iter()
            .enumerate()
            .flat_map(|(word_index, &word)| {
                let mut word = word;
                std::iter::from_fn(move || {
                    if word == 0 {
                        return None;
                    }
                    let bit = word.trailing_zeros();
                    word &= word - 1;
                    Some(word_index as u32 * 64 + bit)
                })
            })
    }
}

/// Score levels of every node for one task shape.
#[derive(Debug, Clone)]
struct ShapeIndex {
    /// Nodes the shape can never use (pool, cordon, health, model, GPU memory).
    excluded: Vec<bool>,
    level_of: Vec<u32>,
    /// Indexed by level (levels are at most [`crate::policy::MAX_LEVEL`]).
    buckets: Vec<Option<Bucket>>,
}

impl ShapeIndex {
    fn build(
        cluster: &ClusterState,
        scorer: &Scorer,
        shape: &TaskShape,
        fragmentation: &[f64],
    ) -> Self {
        let mut index = ShapeIndex {
            excluded: (0..cluster.len() as NodeIndex)
                .map(|node| cluster.static_filter(node, shape).is_some())
                .collect(),
            level_of: vec![INFEASIBLE; cluster.len()],
            buckets: Vec::new(),
        };
        // Nodes in equal states score equally: score each state once (at the
        // start of a cycle most nodes are empty, so there are few states).
        let mut memo: BTreeMap<crate::cluster::NodeStateKey<'_>, u32> = BTreeMap::new();
        let mut cache = ProfileCache::default();
        for node in 0..cluster.len() as NodeIndex {
            // A node without room now is infeasible (the level it starts
            // with): no key, no score. In a busy cluster that is most.
            if index.excluded[node as usize] || !cluster.has_room(node, shape) {
                continue;
            }
            let key = cluster.state_key(node);
            let level = *memo.entry(key).or_insert_with(|| {
                cache.reset();
                scorer
                    .evaluate_passing_static(
                        cluster,
                        node,
                        shape,
                        fragmentation[node as usize],
                        &mut cache,
                    )
                    .map_or(INFEASIBLE, |evaluation| evaluation.level)
            });
            index.set(cluster.len(), node, level);
        }
        index
    }

    fn update(
        &mut self,
        cluster: &ClusterState,
        scorer: &Scorer,
        shape: &TaskShape,
        node: NodeIndex,
        fragmentation_now: f64,
        cache: &mut ProfileCache,
    ) {
        if self.excluded[node as usize] {
            return;
        }
        let level = scorer
            .evaluate_passing_static(cluster, node, shape, fragmentation_now, cache)
            .map_or(INFEASIBLE, |evaluation| evaluation.level);
        self.set(cluster.len(), node, level);
    }

    fn set(&mut self, nodes: usize, node: NodeIndex, level: u32) {
        let old = self.level_of[node as usize];
        if old == level {
            return;
        }
        if old != INFEASIBLE
            && let Some(Some(bucket)) = self.buckets.get_mut(old as usize)
        {
            bucket.remove(node);
        }
        if level != INFEASIBLE {
            let slot = level as usize;
            if self.buckets.len() <= slot {
                self.buckets.resize_with(slot + 1, || None);
            }
            self.buckets[slot]
                .get_or_insert_with(|| Bucket::new(nodes))
                .insert(node);
        }
        self.level_of[node as usize] = level;
    }

    /// Feasible nodes, best level first, smallest index first within a level.
    fn ranked(&self) -> impl Iterator<Item = NodeIndex> + '_ {
        self.buckets
            .iter()
            .rev()
            .flatten()
            .filter(|bucket| bucket.count > 0)
            .flat_map(Bucket::iter)
    }
}

/// The best node for `shape` by scoring every node: highest level, then
/// smallest name. The reference the indexed search must agree with.
pub fn best_node_by_scan(
    cluster: &ClusterState,
    scorer: &Scorer,
    shape: &TaskShape,
    excluded: &dyn Fn(NodeIndex) -> bool,
) -> Option<(NodeIndex, Evaluation)> {
    let mut best: Option<(NodeIndex, Evaluation)> = None;
    for node in 0..cluster.len() as NodeIndex {
        if excluded(node) {
            continue;
        }
        if let Some(evaluation) = scorer.evaluate(cluster, node, shape)
            && best.is_none_or(|(_, b)| evaluation.level > b.level)
        {
            best = Some((node, evaluation));
        }
    }
    best
}

/// How many nodes each filter turned away, for "why is my job pending".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FilterCounts {
    pub rejected: BTreeMap<FilterReason, u32>,
    /// Nodes the task fits on but that are held for a reservation.
    pub reserved: u32,
    /// Nodes the task fits on right now.
    pub feasible: u32,
    /// Nodes the task would fit on if they were empty.
    pub could_ever_fit: u32,
}

impl FilterCounts {
    /// True when fewer than `tasks` nodes could ever take a task, whatever
    /// ends: the job is larger than the cluster as it stands.
    pub fn never_fits(&self, tasks: u32) -> bool {
        self.could_ever_fit < tasks
    }
}

/// Why a gang could not be placed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GangFailure {
    /// Fewer nodes fit a task than the job has tasks.
    TooFewNodes { feasible: u32, needed: u32 },
    /// Enough nodes, but no single rack has enough and the job requires one.
    NoRackLargeEnough { largest_rack: u32, needed: u32 },
}

/// Chooses nodes and GPUs for tasks and gangs, keeping the cluster's free
/// resources and its indexes up to date.
#[derive(Debug, Clone)]
pub struct Placer {
    cluster: ClusterState,
    scorer: Scorer,
    indexes: BTreeMap<TaskShape, ShapeIndex>,
    indexed: bool,
    /// Each node's current fragmentation (FGD), kept with the indexes.
    fragmentation: Vec<f64>,
    cache: ProfileCache,
}

impl Placer {
    pub fn new(cluster: ClusterState, scorer: Scorer) -> Self {
        let indexed = scorer.policy != PlacementPolicy::Random;
        let fragmentation = if indexed {
            (0..cluster.len() as NodeIndex)
                .map(|node| scorer.fragmentation_now(&cluster, node))
                .collect()
        } else {
            Vec::new()
        };
        Placer {
            cluster,
            scorer,
            indexes: BTreeMap::new(),
            indexed,
            fragmentation,
            cache: ProfileCache::default(),
        }
    }

    /// A placer that scores every node for every task (the reference).
    pub fn new_scanning(cluster: ClusterState, scorer: Scorer) -> Self {
        Placer {
            cluster,
            scorer,
            indexes: BTreeMap::new(),
            indexed: false,
            fragmentation: Vec::new(),
            cache: ProfileCache::default(),
        }
    }

    pub fn cluster(&self) -> &ClusterState {
        &self.cluster
    }

    pub fn scorer(&self) -> &Scorer {
        &self.scorer
    }

    pub fn into_cluster(self) -> ClusterState {
        self.cluster
    }

    fn node_changed(&mut self, node: NodeIndex) {
        if !self.indexed {
            return;
        }
        let Placer {
            cluster,
            scorer,
            indexes,
            fragmentation,
            cache,
            ..
        } = self;
        let now = scorer.fragmentation_now(cluster, node);
        fragmentation[node as usize] = now;
        cache.reset();
        for (shape, index) in indexes.iter_mut() {
            index.update(cluster, scorer, shape, node, now, cache);
        }
    }

    fn ensure_index(&mut self, shape: &TaskShape) {
        if self.indexed && !self.indexes.contains_key(shape) {
            let index = ShapeIndex::build(&self.cluster, &self.scorer, shape, &self.fragmentation);
            self.indexes.insert(*shape, index);
        }
    }

    /// Feasible nodes for `shape`, best first (random order for `random`).
    pub fn ranked_nodes<R: Rng>(
        &mut self,
        shape: &TaskShape,
        excluded: &dyn Fn(NodeIndex) -> bool,
        rng: &mut R,
    ) -> Vec<NodeIndex> {
        if self.indexed {
            self.ensure_index(shape);
            if let Some(index) = self.indexes.get(shape) {
                return index.ranked().filter(|&node| !excluded(node)).collect();
            }
        }
        let mut scored: Vec<(u32, NodeIndex)> = (0..self.cluster.len() as NodeIndex)
            .filter(|&node| !excluded(node))
            .filter_map(|node| {
                self.scorer
                    .evaluate(&self.cluster, node, shape)
                    .map(|evaluation| (evaluation.level, node))
            })
            .collect();
        if self.scorer.policy == PlacementPolicy::Random {
            for i in (1..scored.len()).rev() {
                let j = rng.random_range(0..=i);
                scored.swap(i, j);
            }
        } else {
            scored.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        }
        scored.into_iter().map(|(_, node)| node).collect()
    }

    /// The node and GPUs one task would get, without taking them.
    pub fn choose<R: Rng>(
        &mut self,
        shape: &TaskShape,
        excluded: &dyn Fn(NodeIndex) -> bool,
        rng: &mut R,
    ) -> Option<TaskPlacement> {
        let node = match self.scorer.policy {
            PlacementPolicy::Random => {
                let feasible: Vec<NodeIndex> = (0..self.cluster.len() as NodeIndex)
                    .filter(|&node| !excluded(node) && self.cluster.fits(node, shape))
                    .collect();
                if feasible.is_empty() {
                    return None;
                }
                let node = feasible[rng.random_range(0..feasible.len())];
                // As the published simulator's Random: a share goes to a GPU
                // drawn uniformly among those it fits.
                if let muster_model::GpuRequest::Shared(share) = shape.gpus {
                    let fitting: Vec<u32> = self.cluster.free[node as usize]
                        .gpu
                        .iter()
                        .enumerate()
                        .filter(|(_, free)| u32::from(**free) >= share.0)
                        .map(|(index, _)| index as u32)
                        .collect();
                    let index = fitting[rng.random_range(0..fitting.len())];
                    return Some(TaskPlacement {
                        node,
                        gpus: vec![crate::cluster::GpuGrant {
                            index,
                            milli: share.0 as u16,
                        }],
                        cpu_milli: shape.cpu_milli,
                        memory_mib: shape.memory_mib,
                    });
                }
                node
            }
            _ if self.indexed => {
                self.ensure_index(shape);
                self.indexes
                    .get(shape)?
                    .ranked()
                    .find(|&node| !excluded(node))?
            }
            _ => best_node_by_scan(&self.cluster, &self.scorer, shape, excluded)?.0,
        };
        self.placement_on(node, shape)
    }

    /// The placement of `shape` on `node` under the policy's GPU choice.
    pub fn placement_on(&self, node: NodeIndex, shape: &TaskShape) -> Option<TaskPlacement> {
        let evaluation = self.scorer.evaluate(&self.cluster, node, shape)?;
        Some(TaskPlacement {
            node,
            gpus: grants(evaluation.pick, shape.per_gpu_milli()),
            cpu_milli: shape.cpu_milli,
            memory_mib: shape.memory_mib,
        })
    }

    /// Places one task on the best node and takes its resources.
    pub fn place<R: Rng>(
        &mut self,
        shape: &TaskShape,
        excluded: &dyn Fn(NodeIndex) -> bool,
        rng: &mut R,
    ) -> Option<TaskPlacement> {
        let placement = self.choose(shape, excluded, rng)?;
        self.commit(&placement);
        Some(placement)
    }

    /// Chooses one node per task for a gang, all or nothing, without taking
    /// them: in one rack when one rack can hold the job (the rack whose
    /// weakest chosen node scores best), otherwise across as few racks as
    /// possible unless the job requires one rack.
    pub fn choose_gang<R: Rng>(
        &mut self,
        shape: &TaskShape,
        tasks: u32,
        same_rack: Option<TopologyStrength>,
        excluded: &dyn Fn(NodeIndex) -> bool,
        rng: &mut R,
    ) -> Result<Vec<TaskPlacement>, GangFailure> {
        let needed = tasks as usize;
        if needed <= 1 {
            return match self.choose(shape, excluded, rng) {
                Some(placement) => Ok(vec![placement]),
                None => Err(GangFailure::TooFewNodes {
                    feasible: 0,
                    needed: tasks,
                }),
            };
        }
        let mut ranked = self.ranked_nodes(shape, excluded, rng);
        if self.cluster.len() != self.cluster.real_len() {
            // One task per real node: of a node's sub-nodes, only the best
            // ranked one stays a candidate.
            let mut seen = std::collections::BTreeSet::new();
            ranked.retain(|&node| seen.insert(self.cluster.nodes[node as usize].real));
        }
        if ranked.len() < needed {
            return Err(GangFailure::TooFewNodes {
                feasible: ranked.len() as u32,
                needed: tasks,
            });
        }
        let mut per_rack: BTreeMap<u16, Vec<NodeIndex>> = BTreeMap::new();
        let mut chosen: Option<Vec<NodeIndex>> = None;
        for &node in &ranked {
            let rack = self.cluster.nodes[node as usize].rack;
            let members = per_rack.entry(rack).or_default();
            members.push(node);
            if members.len() == needed {
                chosen = Some(members.clone());
                break;
            }
        }
        let nodes = match chosen {
            Some(nodes) => nodes,
            None => {
                let largest = per_rack.values().map(Vec::len).max().unwrap_or(0);
                if same_rack == Some(TopologyStrength::Required) {
                    return Err(GangFailure::NoRackLargeEnough {
                        largest_rack: largest as u32,
                        needed: tasks,
                    });
                }
                // Fewest racks: the fullest racks first (ties: the rack whose
                // best node ranks first).
                let mut racks: Vec<&Vec<NodeIndex>> = per_rack.values().collect();
                let position = |node: NodeIndex| ranked.iter().position(|&n| n == node);
                racks.sort_by_key(|members| {
                    (std::cmp::Reverse(members.len()), position(members[0]))
                });
                let mut nodes = Vec::with_capacity(needed);
                for members in racks {
                    for &node in members {
                        if nodes.len() < needed {
                            nodes.push(node);
                        }
                    }
                }
                nodes
            }
        };
        let mut placements = Vec::with_capacity(needed);
        for node in nodes {
            let placement = self
                .placement_on(node, shape)
                .ok_or(GangFailure::TooFewNodes {
                    feasible: 0,
                    needed: tasks,
                })?;
            placements.push(placement);
        }
        Ok(placements)
    }

    /// Takes a placement's resources.
    pub fn commit(&mut self, placement: &TaskPlacement) {
        self.cluster.take(placement);
        self.node_changed(placement.node);
    }

    /// Returns a placement's resources (a task ended or was preempted).
    pub fn release(&mut self, placement: &TaskPlacement) {
        self.cluster.give_back(placement);
        self.node_changed(placement.node);
    }

    /// For each node, the first filter it fails for `shape`. Filters count
    /// sub-nodes (a node mixing GPU models is one per model); `feasible` and
    /// `could_ever_fit` count real nodes, as a gang takes one task per node.
    pub fn diagnose(
        &self,
        shape: &TaskShape,
        reserved: &dyn Fn(NodeIndex) -> bool,
    ) -> FilterCounts {
        let mut counts = FilterCounts::default();
        // Sub-nodes of one node are adjacent: count a real node once.
        let mut last_could = None;
        let mut last_feasible = None;
        for node in 0..self.cluster.len() as NodeIndex {
            let real = Some(self.cluster.nodes[node as usize].real);
            if last_could != real && self.cluster.could_ever_fit(node, shape) {
                counts.could_ever_fit += 1;
                last_could = real;
            }
            match self.cluster.filter(node, shape) {
                Some(reason) => *counts.rejected.entry(reason).or_default() += 1,
                None if reserved(node) => counts.reserved += 1,
                None if last_feasible != real => {
                    counts.feasible += 1;
                    last_feasible = real;
                }
                None => {}
            }
        }
        counts
    }
}

/// The grants for a GPU pick.
pub fn grants(pick: GpuPick, milli: u16) -> Vec<crate::cluster::GpuGrant> {
    (0..64)
        .filter(|index| pick & (1 << index) != 0)
        .map(|index| crate::cluster::GpuGrant { index, milli })
        .collect()
}
