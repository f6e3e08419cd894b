//! Node selection for tasks and gangs, fast.
//!
//! [`Placer`] keeps, for every task shape it has been asked about, the score
//! level of every node (an index: per level, a bit set of nodes). A placement
//! changes one node, so only that node needs re-scoring; it is noted in a
//! change log, and a shape's index re-scores the nodes changed since it last
//! looked when it is next asked (each node once, however often it changed
//! meanwhile: rare shapes skip most of the work, and nothing is spent on
//! shapes never asked again). Finding the best node is then a walk down the
//! levels to the first set bit.
//! This makes exactly the decisions of [`best_node_by_scan`], which scores
//! every node for every task; a property test holds the two together.

use crate::cluster::{ClusterState, FilterReason, NodeIndex, TaskPlacement, TaskShape};
use crate::policy::{Evaluation, GpuPick, NodeNow, PlacementPolicy, ProfileCache, Scorer};
use muster_model::{GpuRequest, TopologyStrength};
use rand::Rng;
use std::collections::BTreeMap;

/// The level of a node without room for the shape.
const INFEASIBLE: u32 = u32::MAX;
/// The level of a node the shape can never use (pool, cordon, health,
/// model, GPU memory): kept with the levels, so that bringing an index up
/// to date reads one array per changed node, not two.
const EXCLUDED: u32 = u32::MAX - 1;

/// The nodes at one level of a [`ShapeIndex`]: a short sorted list while
/// few, a bit per node of the cluster once more. Most levels hold a few
/// nodes (a share's levels under `fgd-consolidate` number thousands), and a
/// bit set for each would cost the cluster's size per level.
///
/// Held by value in the index's list of levels, with its count, and its
/// bits and their summary in one allocation: moving a node between levels
/// (most of an index's upkeep under FGD, whose nodes change level at every
/// change) reads the level's entry and then the word it changes, not a
/// pointer to a bucket and then one to its bits.
#[derive(Debug, Clone, Default)]
struct Bucket {
    count: u32,
    /// The nodes, ascending, in `few[..count]` while `set` is empty.
    few: Option<Box<[NodeIndex; Bucket::FEW]>>,
    /// Once the bucket has held more than [`Bucket::FEW`] nodes: a bit per
    /// node (`words` words, as many as the cluster needs), then a bit per
    /// word of those, set while the word has a node, so that a bucket that
    /// once held many nodes and now holds few is read without going
    /// through its empty words (157 at 10,000 nodes).
    set: Box<[u64]>,
}

impl Bucket {
    /// Nodes kept as a list before a bucket turns into a bit set.
    const FEW: usize = 32;

    /// Turns the list into a bit set of `words` words (and their summary).
    fn make_bit_set(&mut self, words: usize) {
        self.set = vec![0; words + words.div_ceil(64)].into_boxed_slice();
        if let Some(few) = self.few.take() {
            for &node in &few[..self.count as usize] {
                self.set_bit(words, node);
            }
        }
    }

    fn set_bit(&mut self, words: usize, node: NodeIndex) {
        let word = node as usize / 64;
        self.set[word] |= 1 << (node % 64);
        self.set[words + word / 64] |= 1 << (word % 64);
    }

    /// Adds `node`, which it does not hold, in a cluster of `words` words
    /// of nodes.
    fn insert(&mut self, words: usize, node: NodeIndex) {
        if self.set.is_empty() {
            let len = self.count as usize;
            // A bit set no larger than the list would grow to: straight
            // away.
            if len < Self::FEW && words * 2 > Self::FEW {
                let few = self.few.get_or_insert_with(|| Box::new([0; Self::FEW]));
                if let Err(at) = few[..len].binary_search(&node) {
                    few.copy_within(at..len, at + 1);
                    few[at] = node;
                    self.count += 1;
                }
                return;
            }
            self.make_bit_set(words);
        }
        self.set_bit(words, node);
        self.count += 1;
    }

    /// Takes `node`, which it holds, out.
    fn remove(&mut self, words: usize, node: NodeIndex) {
        if self.set.is_empty() {
            let len = self.count as usize;
            if let Some(few) = self.few.as_mut()
                && let Ok(at) = few[..len].binary_search(&node)
            {
                few.copy_within(at + 1..len, at);
                self.count -= 1;
            }
            return;
        }
        let word = node as usize / 64;
        self.set[word] &= !(1 << (node % 64));
        if self.set[word] == 0 {
            self.set[words + word / 64] &= !(1 << (word % 64));
        }
        self.count -= 1;
    }

    /// The nodes, ascending.
    fn iter(&self, words: usize) -> impl Iterator<Item = NodeIndex> + '_ {
        let listed: &[NodeIndex] = match &self.few {
            Some(few) if self.set.is_empty() => &few[..self.count as usize],
            _ => &[],
        };
        let (bits, summary) = self.set.split_at(words.min(self.set.len()));
        listed
            .iter()
            .copied()
            .chain(ones(summary).flat_map(move |word| {
                ones(&bits[word as usize..=word as usize]).map(move |bit| word * 64 + bit)
            }))
    }
}

/// The set bits of `words`, ascending, numbered from the first word's.
fn ones(words: &[u64]) -> impl Iterator<Item = u32> + '_ {
    words.iter().enumerate().flat_map(|(index, &word)| {
        let mut word = word;
        std::iter::from_fn(move || {
            if word == 0 {
                return None;
            }
            let bit = word.trailing_zeros();
            word &= word - 1;
            Some(index as u32 * 64 + bit)
        })
    })
}

/// Score levels of every node for one task shape.
#[derive(Debug, Clone)]
struct ShapeIndex {
    /// Each node's level, [`INFEASIBLE`] or [`EXCLUDED`].
    level_of: Vec<u32>,
    /// For a share, the GPU each feasible node would give it, found with
    /// its level (empty for other shapes): the placement reads it instead
    /// of scoring the chosen node again.
    gpu_of: Vec<u8>,
    /// Indexed by level (levels are at most [`crate::policy::MAX_LEVEL`]).
    buckets: Vec<Bucket>,
    /// A bit per level, set while the level has a node: reading goes from
    /// one level with nodes to the next without visiting the empty ones
    /// between (a share's levels under `fgd-consolidate` number thousands,
    /// most of them empty; stepping through them was most of the default's
    /// reads, docs/benchmarks.md).
    occupied: Vec<u64>,
    /// How much of the placer's change log this index has taken in.
    seen: usize,
}

impl ShapeIndex {
    /// The index of `shape` for the cluster as it is now, having taken in
    /// the change log up to `seen`. Nodes still in the state they started
    /// in score as the others of their start class (equal states score
    /// equally: at the start of a cycle most nodes are empty, so there are
    /// few classes, each scored once); nodes changed since score on their
    /// own.
    fn build(placer: &mut PlacerParts<'_>, shape: &TaskShape, seen: usize) -> Self {
        let cluster = placer.cluster;
        let mut index = ShapeIndex {
            seen,
            level_of: (0..cluster.len() as NodeIndex)
                .map(|node| match cluster.static_filter(node, shape) {
                    Some(_) => EXCLUDED,
                    None => INFEASIBLE,
                })
                .collect(),
            gpu_of: if matches!(shape.gpus, GpuRequest::Shared(_)) {
                vec![0; cluster.len()]
            } else {
                Vec::new()
            },
            buckets: Vec::new(),
            occupied: Vec::new(),
        };
        let mut memo: Vec<Option<(u32, u8)>> = vec![None; placer.class_count];
        for node in 0..cluster.len() as NodeIndex {
            // A node without room now is infeasible (the level it starts
            // with): no score. In a busy cluster that is most.
            if index.level_of[node as usize] == EXCLUDED || !cluster.has_room(node, shape) {
                continue;
            }
            let class = placer.class_of[node as usize];
            let (level, gpu) = if placer.latest_change[node as usize] == u32::MAX {
                match memo[class as usize] {
                    Some(scored) => scored,
                    None => {
                        let scored = placer.level(node, shape);
                        memo[class as usize] = Some(scored);
                        scored
                    }
                }
            } else {
                placer.level(node, shape)
            };
            index.set(node, level, gpu);
        }
        index
    }

    /// The words of a bucket's bit set: one bit per node of the cluster.
    fn words(&self) -> usize {
        self.level_of.len().div_ceil(64)
    }

    /// Puts `node` at `level`, a share's `gpu` with it.
    fn set(&mut self, node: NodeIndex, level: u32, gpu: u8) {
        if let Some(slot) = self.gpu_of.get_mut(node as usize) {
            *slot = gpu;
        }
        let old = self.level_of[node as usize];
        if old == level {
            return;
        }
        let words = self.words();
        if old < EXCLUDED
            && let Some(bucket) = self.buckets.get_mut(old as usize)
        {
            bucket.remove(words, node);
            if bucket.count == 0 {
                self.occupied[old as usize / 64] &= !(1 << (old % 64));
            }
        }
        if level < EXCLUDED {
            let slot = level as usize;
            if self.buckets.len() <= slot {
                self.buckets.resize_with(slot + 1, Bucket::default);
            }
            self.buckets[slot].insert(words, node);
            if self.occupied.len() <= slot / 64 {
                self.occupied.resize(slot / 64 + 1, 0);
            }
            self.occupied[slot / 64] |= 1 << (slot % 64);
        }
        self.level_of[node as usize] = level;
    }

    /// Feasible nodes, best level first, smallest index first within a level.
    fn ranked(&self) -> impl Iterator<Item = NodeIndex> + '_ {
        let words = self.words();
        self.occupied
            .iter()
            .enumerate()
            .rev()
            .flat_map(|(word_index, &word)| {
                let mut word = word;
                std::iter::from_fn(move || {
                    if word == 0 {
                        return None;
                    }
                    let bit = 63 - word.leading_zeros();
                    word &= !(1 << bit);
                    Some(word_index * 64 + bit as usize)
                })
            })
            .flat_map(move |level| self.buckets[level].iter(words))
    }
}

/// The best node for `shape` by scoring every node: highest level, then
/// first node in the cluster order. The reference the indexed search must agree with.
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
    /// Nodes the task would fit on if they were empty, uncordoned and up:
    /// more than `could_ever_fit` when cordoned or lost nodes would do.
    pub could_fit_when_available: u32,
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
    /// Under FGD, what scoring each node reads of it now, its
    /// fragmentation with it, kept with the indexes (empty under the other
    /// policies: they score from the cluster, and a node's fragmentation is
    /// 0 to them).
    now: Vec<NodeNow>,
    /// Nodes in the order they changed (one entry per change); indexes take
    /// it in when they are next used. Bounded by the placements and releases
    /// of one placer's life (one scheduling cycle).
    changes: Vec<NodeIndex>,
    /// Each node's latest entry in `changes` (`u32::MAX`: none): an index
    /// re-scores a node at its latest entry only.
    latest_change: Vec<u32>,
    /// Each node's latest release's entry in `changes` (`u32::MAX`: none).
    last_release: Vec<u32>,
    /// Each node's state class at the start (equal states, equal class).
    class_of: Vec<u32>,
    class_count: usize,
    /// GPU profiles, shared by every node and shape that needs one.
    profiles: ProfileCache,
    /// The nodes an index re-scores when it is brought up to date, and
    /// their levels (kept to reuse the space).
    rescored: Vec<(NodeIndex, u32, u8)>,
}

/// The parts of a [`Placer`] a shape index is built and updated from.
struct PlacerParts<'a> {
    cluster: &'a ClusterState,
    scorer: &'a Scorer,
    now: &'a [NodeNow],
    latest_change: &'a [u32],
    class_of: &'a [u32],
    class_count: usize,
    profiles: &'a mut ProfileCache,
}

impl PlacerParts<'_> {
    /// `node`'s level for `shape`, the node known to pass the static
    /// filters, and for a share the GPU it would take there (0 otherwise).
    #[inline]
    fn level(&mut self, node: NodeIndex, shape: &TaskShape) -> (u32, u8) {
        match self.now.get(node as usize) {
            Some(now) => self
                .scorer
                .evaluation_now(self.cluster, node, now, shape, self.profiles),
            None => {
                self.scorer
                    .evaluation_passing_static(self.cluster, node, shape, 0.0, self.profiles)
            }
        }
        .map_or((INFEASIBLE, 0), |evaluation| {
            (evaluation.level, evaluation.pick.trailing_zeros() as u8)
        })
    }
}

impl Placer {
    pub fn new(cluster: ClusterState, scorer: Scorer) -> Self {
        let indexed = scorer.policy != PlacementPolicy::Random;
        let cluster_len = cluster.len();
        let (class_of, class_count) = if indexed {
            let mut classes: BTreeMap<crate::cluster::NodeStateKey<'_>, u32> = BTreeMap::new();
            let class_of: Vec<u32> = (0..cluster_len as NodeIndex)
                .map(|node| {
                    let next = classes.len() as u32;
                    *classes.entry(cluster.state_key(node)).or_insert(next)
                })
                .collect();
            (class_of, classes.len())
        } else {
            (Vec::new(), 0)
        };
        let mut profiles = ProfileCache::default();
        let now: Vec<NodeNow> = if indexed && scorer.policy.uses_fragmentation() {
            (0..cluster.len() as NodeIndex)
                .map(|node| scorer.node_now(&cluster, node, &mut profiles))
                .collect()
        } else {
            Vec::new()
        };
        Placer {
            cluster,
            scorer,
            indexes: BTreeMap::new(),
            indexed,
            now,
            changes: Vec::new(),
            latest_change: if indexed {
                vec![u32::MAX; cluster_len]
            } else {
                Vec::new()
            },
            last_release: if indexed {
                vec![u32::MAX; cluster_len]
            } else {
                Vec::new()
            },
            class_of,
            class_count,
            profiles,
            rescored: Vec::new(),
        }
    }

    /// A placer that scores every node for every task (the reference).
    pub fn new_scanning(cluster: ClusterState, scorer: Scorer) -> Self {
        Placer {
            cluster,
            scorer,
            indexes: BTreeMap::new(),
            indexed: false,
            now: Vec::new(),
            changes: Vec::new(),
            latest_change: Vec::new(),
            last_release: Vec::new(),
            class_of: Vec::new(),
            class_count: 0,
            profiles: ProfileCache::default(),
            rescored: Vec::new(),
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
        if let Some(now) = self.now.get_mut(node as usize) {
            *now = self
                .scorer
                .node_now(&self.cluster, node, &mut self.profiles);
        }
        self.latest_change[node as usize] = self.changes.len() as u32;
        self.changes.push(node);
    }

    /// The shape whose index serves `shape`, when the policy's levels do
    /// not depend on memory (every policy but an FGD whose typical shapes
    /// ask for memory): for FGD, the same shape asking no memory; for the
    /// others, its memory rounded down to a power of two. Shapes that differ
    /// only in memory then share one index and each changed node is
    /// re-scored once for all of them. The index counts a node feasible with
    /// the key's memory; nodes with less than the shape's own are skipped
    /// when it is read ([`Placer::ranked_in_index`]). Dropping memory
    /// altogether makes FGD's cycle about 6% faster (a quarter fewer
    /// re-scorings, docs/benchmarks.md) but best-fit's slower: on a full
    /// cluster best-fit's best-ranked nodes are mostly out of memory (it
    /// fills nodes), and the read skips them one by one; within a factor of
    /// two, few are skipped.
    fn index_key(&self, shape: &TaskShape) -> TaskShape {
        if shape.memory_mib == 0 || !self.scorer.levels_ignore_memory() {
            return *shape;
        }
        let memory_mib = if self.scorer.policy.uses_fragmentation() {
            0
        } else {
            1 << (63 - shape.memory_mib.leading_zeros())
        };
        TaskShape {
            memory_mib,
            ..*shape
        }
    }

    /// The nodes of `shape`'s index (brought up to date by
    /// [`Placer::index`]) that have its memory free, best first.
    fn ranked_in_index<'a>(&'a self, shape: &'a TaskShape) -> impl Iterator<Item = NodeIndex> + 'a {
        self.indexes
            .get(&self.index_key(shape))
            .into_iter()
            .flat_map(ShapeIndex::ranked)
            .filter(move |&node| self.cluster.free[node as usize].memory_mib >= shape.memory_mib)
    }

    /// The index of `shape` (see [`Placer::index_key`]), built or brought up
    /// to date with the nodes changed since it was last used.
    fn index(&mut self, shape: &TaskShape) -> Option<&ShapeIndex> {
        if !self.indexed {
            return None;
        }
        let key = self.index_key(shape);
        let shape = &key;
        let Placer {
            cluster,
            scorer,
            indexes,
            now,
            changes,
            latest_change,
            last_release,
            class_of,
            class_count,
            profiles,
            rescored,
            ..
        } = self;
        let mut parts = PlacerParts {
            cluster,
            scorer,
            now,
            latest_change,
            class_of,
            class_count: *class_count,
            profiles,
        };
        let index = indexes
            .entry(*shape)
            .or_insert_with(|| ShapeIndex::build(&mut parts, shape, changes.len()));
        let seen = index.seen;
        // In three passes, each over memory of its own (the index's arrays,
        // the nodes and the scorer's tables, the index's levels), rather
        // than all three for each node in turn: which nodes to re-score,
        // their levels, then their moves.
        rescored.clear();
        for (position, &node) in changes.iter().enumerate().skip(seen) {
            let at = node as usize;
            if parts.latest_change[at] as usize != position {
                continue;
            }
            let level = index.level_of[at];
            // Resources only shrink between releases: a node that had no
            // room when the index last looked, and gave nothing back since,
            // still has none.
            if level == EXCLUDED
                || (level == INFEASIBLE && last_release[at].wrapping_add(1) as usize <= seen)
            {
                continue;
            }
            rescored.push((node, 0, 0));
        }
        for (node, level, gpu) in rescored.iter_mut() {
            (*level, *gpu) = parts.level(*node, shape);
        }
        for &(node, level, gpu) in rescored.iter() {
            index.set(node, level, gpu);
        }
        index.seen = changes.len();
        Some(index)
    }

    /// Feasible nodes for `shape`, best first (random order for `random`).
    pub fn ranked_nodes<R: Rng>(
        &mut self,
        shape: &TaskShape,
        excluded: &dyn Fn(NodeIndex) -> bool,
        rng: &mut R,
    ) -> Vec<NodeIndex> {
        if self.index(shape).is_some() {
            return self
                .ranked_in_index(shape)
                .filter(|&node| !excluded(node))
                .collect();
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
                self.index(shape)?;
                self.ranked_in_index(shape).find(|&node| !excluded(node))?
            }
            _ => best_node_by_scan(&self.cluster, &self.scorer, shape, excluded)?.0,
        };
        self.placement_on(node, shape)
    }

    /// A share's GPU on `node` as its index found it with the node's level,
    /// where the index has taken in every change (so the node is as it was
    /// scored) and counts the node feasible.
    fn indexed_share_gpu(&self, node: NodeIndex, shape: &TaskShape) -> Option<u8> {
        let GpuRequest::Shared(_) = shape.gpus else {
            return None;
        };
        let index = self.indexes.get(&self.index_key(shape))?;
        (index.seen == self.changes.len() && index.level_of[node as usize] < EXCLUDED)
            .then(|| index.gpu_of[node as usize])
    }

    /// The placement of `shape` on `node` under the policy's GPU choice.
    pub fn placement_on(&mut self, node: NodeIndex, shape: &TaskShape) -> Option<TaskPlacement> {
        let pick = if self.indexed {
            // As the index scored it: the node's fragmentation and GPU
            // profiles are already known.
            if !self.cluster.fits(node, shape) {
                return None;
            }
            match self.indexed_share_gpu(node, shape) {
                Some(gpu) => 1 << gpu,
                None => self.scorer.pick_passing_static(
                    &self.cluster,
                    node,
                    shape,
                    self.now
                        .get(node as usize)
                        .map_or(0.0, NodeNow::fragmentation),
                    &mut self.profiles,
                )?,
            }
        } else {
            self.scorer.evaluate(&self.cluster, node, shape)?.pick
        };
        Some(TaskPlacement {
            node,
            gpus: grants(pick, shape.per_gpu_milli()),
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
        // Candidates best first, taken only as far as needed: the first rack
        // to gather `needed` of them wins, usually long before the end of
        // the list (most gangs find room in the first racks they look at).
        let scanned = if self.indexed {
            self.index(shape);
            None
        } else {
            Some(self.ranked_nodes(shape, excluded, rng))
        };
        let mut ranked: Vec<NodeIndex> = Vec::new();
        let mut per_rack: BTreeMap<u16, Vec<NodeIndex>> = BTreeMap::new();
        let mut chosen: Option<Vec<NodeIndex>> = None;
        {
            let cluster = &self.cluster;
            let candidates: Box<dyn Iterator<Item = NodeIndex> + '_> = match &scanned {
                Some(list) => Box::new(list.iter().copied()),
                None => Box::new(self.ranked_in_index(shape).filter(|&node| !excluded(node))),
            };
            // One task per real node: of a node's sub-nodes, only the best
            // ranked one is a candidate.
            let split = cluster.len() != cluster.real_len();
            let mut seen = std::collections::BTreeSet::new();
            for node in candidates {
                if split && !seen.insert(cluster.nodes[node as usize].real) {
                    continue;
                }
                ranked.push(node);
                let members = per_rack
                    .entry(cluster.nodes[node as usize].rack)
                    .or_default();
                members.push(node);
                if members.len() == needed {
                    chosen = Some(members.clone());
                    break;
                }
            }
        }
        if chosen.is_none() && ranked.len() < needed {
            return Err(GangFailure::TooFewNodes {
                feasible: ranked.len() as u32,
                needed: tasks,
            });
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
        if self.indexed {
            self.last_release[placement.node as usize] = self.changes.len() as u32 - 1;
        }
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
        let mut last_available = None;
        let mut last_feasible = None;
        for node in 0..self.cluster.len() as NodeIndex {
            let real = Some(self.cluster.nodes[node as usize].real);
            if last_could != real && self.cluster.could_ever_fit(node, shape) {
                counts.could_ever_fit += 1;
                last_could = real;
            }
            if last_available != real && self.cluster.could_fit_when_available(node, shape) {
                counts.could_fit_when_available += 1;
                last_available = real;
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use std::collections::BTreeSet;

    /// A bucket lists its nodes in ascending order through inserts and
    /// removals, as a short list and after turning into a bit set, and a
    /// shape index reads its levels from the highest with a node.
    #[test]
    fn buckets_and_levels_read_in_order() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        // A small cluster's buckets start as bit sets; a large one's as
        // lists that turn into bit sets past 32 nodes.
        for nodes in [300_usize, 5_000] {
            let words = nodes.div_ceil(64);
            let mut bucket = Bucket::default();
            bucket.insert(words, 0);
            assert_eq!(bucket.set.is_empty(), nodes > 1024);
            bucket.remove(words, 0);
            let mut model = BTreeSet::new();
            for step in 0..2_000 {
                let node = rng.random_range(0..nodes as NodeIndex);
                // Mostly inserts at first (past the list's limit), then both.
                if model.contains(&node) && (step > 500 || rng.random_bool(0.1)) {
                    bucket.remove(words, node);
                    model.remove(&node);
                } else if !model.contains(&node) {
                    bucket.insert(words, node);
                    model.insert(node);
                }
                assert_eq!(bucket.count as usize, model.len());
                assert!(bucket.iter(words).eq(model.iter().copied()), "step {step}");
            }
        }

        let mut index = ShapeIndex {
            level_of: vec![INFEASIBLE; 4],
            gpu_of: Vec::new(),
            buckets: Vec::new(),
            occupied: Vec::new(),
            seen: 0,
        };
        index.set(0, 5, 0);
        index.set(1, 900, 0);
        index.set(2, 900, 0);
        index.set(3, 7, 0);
        assert_eq!(index.ranked().collect::<Vec<_>>(), [1, 2, 3, 0]);
        // The top level emptied: reading starts lower, and so on down
        // (levels 64 apart and more: other words of the level bit set).
        index.set(0, 200, 0);
        assert_eq!(index.ranked().collect::<Vec<_>>(), [1, 2, 0, 3]);
        index.set(0, 5, 0);
        index.set(1, 6, 0);
        index.set(2, INFEASIBLE, 0);
        assert_eq!(index.ranked().collect::<Vec<_>>(), [3, 1, 0]);
        index.set(3, 6, 0);
        assert_eq!(index.ranked().collect::<Vec<_>>(), [1, 3, 0]);
        for node in 0..4 {
            index.set(node, INFEASIBLE, 0);
        }
        assert!(index.occupied.iter().all(|&word| word == 0));
        assert_eq!(index.ranked().count(), 0);
    }
}
