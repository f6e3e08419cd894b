//! The cluster as the scheduler sees it: each node's static shape and its free
//! resources, with GPU models, pools and racks interned to small integers.

use muster_model::{GpuModel, GpuRequest, NodeName, NodeSpec, PoolName, RackName};
use std::collections::{BTreeMap, BTreeSet};

/// Index of a node in [`ClusterState`]. Nodes are ordered by rack, then by
/// a fixed pseudo-random order within the rack ([`seeded_rank`] with seed
/// 0), so a smaller index wins a tie (the tie-break every policy uses). A node
/// with GPUs of several models is several entries (sub-nodes, one per model,
/// in the order of their first GPU): see [`ClusterState`].
pub type NodeIndex = u32;

/// The model index of a node without GPUs (see [`NodeStatic::model`]).
pub const NO_MODEL: u32 = u32::MAX;

/// The most GPUs of one model on one node: a node's GPUs of one model are
/// kept in 64-bit sets (`GpuPick`) and fixed 64-slot buffers on the hot path.
pub const MAX_GPUS_PER_MODEL: usize = 64;

/// The GPU models a task accepts, as an id into [`ClusterState`]'s table of
/// model sets.
///
/// Why an id and not a bit mask over models: a cluster may have any number of
/// distinct GPU models, but the requests of one cycle name few distinct *sets*
/// of models. Each distinct set (sorted model indices, models the cluster
/// lacks left out) is interned once by [`ClusterState::model_mask`], which
/// also records in every node ([`NodeStatic::accepted_by`]) whether the set
/// accepts the node's model. Checking a task against a node is then one bit
/// test, as with the old 64-bit mask, and a `TaskShape` stays small, `Copy`
/// and `Ord` (a map key in the placer). Ids are only meaningful for the
/// cluster that interned them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelMask(pub u32);

impl ModelMask {
    /// Any model (an empty list in a request).
    pub const ANY: ModelMask = ModelMask(u32::MAX);
    /// No model the cluster has: fits nowhere.
    pub const NONE: ModelMask = ModelMask(0);
}

/// A set of small integers, one bit each.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bits(Vec<u64>);

impl Bits {
    pub fn insert(&mut self, value: u32) {
        let word = value as usize / 64;
        if self.0.len() <= word {
            self.0.resize(word + 1, 0);
        }
        self.0[word] |= 1 << (value % 64);
    }

    pub fn contains(&self, value: u32) -> bool {
        self.0
            .get(value as usize / 64)
            .is_some_and(|word| word & (1 << (value % 64)) != 0)
    }
}

/// What one task needs from one node, with names interned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskShape {
    pub gpus: GpuRequest,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub models: ModelMask,
    /// `None`: any pool.
    pub pool: Option<u16>,
    pub min_gpu_memory_mib: u64,
    /// Runs in a container: only on nodes that can run them.
    pub container: bool,
    /// What it may do on a node of an inference pool.
    pub reserved: ReservedAccess,
}

/// What a task may do on a node of an inference pool
/// ([`NodeInput::reserved`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub enum ReservedAccess {
    /// Not go there (work that may not be preempted).
    #[default]
    No,
    /// Borrow it: run there, and be preempted for a service's replica
    /// whatever the queues' guarantees.
    Borrow,
    /// A service's replica: the pool is for it.
    Service,
}

impl TaskShape {
    pub fn per_gpu_milli(&self) -> u16 {
        self.gpus.per_gpu().0 as u16
    }

    pub fn gpu_count(&self) -> u32 {
        self.gpus.gpu_count()
    }
}

/// Why a node cannot take a task: the first filter it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum FilterReason {
    Pool,
    Cordoned,
    Unhealthy,
    GpuModel,
    GpuMemory,
    /// The task runs in a container and the node has no container engine.
    Containers,
    /// The node is in an inference pool: it takes services' replicas, and
    /// other work only if that work may be preempted (borrowing).
    Reserved,
    Gpus,
    Cpu,
    Memory,
}

impl FilterReason {
    pub const ALL: [FilterReason; 10] = [
        FilterReason::Pool,
        FilterReason::Cordoned,
        FilterReason::Unhealthy,
        FilterReason::GpuModel,
        FilterReason::GpuMemory,
        FilterReason::Containers,
        FilterReason::Reserved,
        FilterReason::Gpus,
        FilterReason::Cpu,
        FilterReason::Memory,
    ];

    /// Filters that a node can pass later, when work on it ends.
    pub fn is_capacity(self) -> bool {
        matches!(
            self,
            FilterReason::Gpus | FilterReason::Cpu | FilterReason::Memory
        )
    }
}

/// A node's static description, interned. For a node with GPUs of several
/// models this is one sub-node: the GPUs of one model and a share of the
/// node's CPU and memory (see [`ClusterState`]).
#[derive(Debug, Clone)]
pub struct NodeStatic {
    /// The real node's name (shared by its sub-nodes).
    pub name: NodeName,
    /// The real node: sub-nodes of one node have the same value, and
    /// different nodes different values (counting up in name order).
    pub real: u32,
    pub pool: u16,
    pub rack: u16,
    /// Interned GPU model; [`NO_MODEL`] for a node without GPUs.
    pub model: u32,
    /// The interned model sets ([`ModelMask`] ids) that accept `model`.
    pub accepted_by: Bits,
    pub gpu_memory_mib: u64,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// The real node's index of each GPU (positions here are local).
    pub gpu_index: Vec<u32>,
    /// NVLink domain of each GPU.
    pub nvlink_domain: Vec<u32>,
    pub cordoned: bool,
    pub healthy: bool,
    /// Per GPU: false when the GPU is out of service.
    pub gpu_healthy: Vec<bool>,
    /// In an inference pool (see [`ReservedAccess`]).
    pub reserved: bool,
    /// The node can run container tasks.
    pub containers: bool,
}

impl NodeStatic {
    /// Whether a task accepting `models` may use this node's GPUs (never for
    /// a node without GPUs).
    pub fn accepts(&self, models: ModelMask) -> bool {
        if models == ModelMask::ANY {
            self.model != NO_MODEL
        } else {
            self.accepted_by.contains(models.0)
        }
    }
}

/// A node's free resources.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeFree {
    /// Free thousandths on each GPU (0 for an unhealthy GPU).
    pub gpu: Vec<u16>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

impl NodeFree {
    pub fn idle_gpu_milli(&self) -> u64 {
        self.gpu.iter().map(|&free| u64::from(free)).sum()
    }

    pub fn whole_free_gpus(&self) -> u32 {
        self.gpu.iter().filter(|&&free| free == 1000).count() as u32
    }
}

/// See [`ClusterState::state_key`]: borrowed from the cluster, so keying a
/// node allocates nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeStateKey<'a> {
    model: u32,
    cpu_milli: u64,
    memory_mib: u64,
    nvlink_domain: &'a [u32],
    gpu_healthy: &'a [bool],
    free: &'a NodeFree,
}

/// Concrete GPUs a task gets on a node: (GPU index, thousandths taken).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuGrant {
    pub index: u32,
    pub milli: u16,
}

/// One task bound to a node and concrete GPUs.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TaskPlacement {
    pub node: NodeIndex,
    pub gpus: Vec<GpuGrant>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

/// Why the engine leaves a node out of a cycle (see
/// [`ClusterState::excluded_nodes`]); building a cluster never fails.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterError {
    /// A second node with the name of an earlier one (the first is kept).
    DuplicateNode(NodeName),
    /// More than [`MAX_GPUS_PER_MODEL`] GPUs of one model on the node.
    TooManyGpus {
        node: NodeName,
        model: GpuModel,
        count: usize,
        /// Whether the node has GPUs of other models too.
        mixed: bool,
    },
    /// GPU indices are not 0, 1, ... in the order listed.
    GpuIndices {
        node: NodeName,
        position: usize,
        index: u32,
    },
}

impl std::fmt::Display for ClusterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterError::DuplicateNode(name) => write!(
                f,
                "node {name} appears more than once; the scheduler takes the first"
            ),
            ClusterError::TooManyGpus {
                node,
                count,
                mixed: false,
                ..
            } => write!(
                f,
                "node {node} has {count} GPUs; the scheduler takes at most \
                 {MAX_GPUS_PER_MODEL} per node"
            ),
            ClusterError::TooManyGpus {
                node,
                model,
                count,
                mixed: true,
            } => write!(
                f,
                "node {node} has {count} {model} GPUs; the scheduler takes at most \
                 {MAX_GPUS_PER_MODEL} of one model per node"
            ),
            ClusterError::GpuIndices {
                node,
                position,
                index,
            } => write!(
                f,
                "node {node} lists GPU index {index} at position {position}; GPUs must be \
                 listed by index from 0 without gaps"
            ),
        }
    }
}

impl std::error::Error for ClusterError {}

/// Static shapes and free resources of every node, as the engine sees them.
///
/// Nodes the engine cannot take are left out, with the reason, in
/// [`ClusterState::excluded_nodes`]: a duplicate name (the first node is kept),
/// more than [`MAX_GPUS_PER_MODEL`] GPUs of one model, GPU indices that are
/// not 0, 1, ... in order. Building never fails.
///
/// A node with GPUs of several models is presented as one sub-node per model
/// (in the order of each model's first GPU), each with that model's GPUs
/// ([`NodeStatic::gpu_index`] maps them back to the node's GPU indices) and a
/// share of the node's CPU and memory in proportion to its GPU count; the
/// rounding remainder goes to the first sub-node, so nothing is lost. The
/// restriction: one task on such a node gets at most its model's share of
/// the node's CPU and memory. Sub-nodes share the node's name, pool, rack,
/// cordon and health; a gang never gets two of them (one task per real node,
/// see [`NodeStatic::real`]).
#[derive(Debug, Clone)]
pub struct ClusterState {
    pub nodes: Vec<NodeStatic>,
    pub free: Vec<NodeFree>,
    pub models: Vec<GpuModel>,
    pub pools: Vec<PoolName>,
    pub racks: Vec<RackName>,
    /// Nodes left out of the cycle, in name order, with the reason in words.
    pub excluded_nodes: Vec<(NodeName, String)>,
    /// Each real node's first sub-node and how many it has.
    by_name: BTreeMap<NodeName, (NodeIndex, u32)>,
    model_map: BTreeMap<GpuModel, u32>,
    /// Interned model sets, by [`ModelMask`] id (id 0: the empty set).
    model_sets: Vec<Vec<u32>>,
    model_set_ids: BTreeMap<Vec<u32>, u32>,
}

/// A node spec together with whether it may take new work.
#[derive(Debug, Clone)]
pub struct NodeInput {
    pub spec: NodeSpec,
    pub cordoned: bool,
    pub healthy: bool,
    /// GPU indices out of service.
    pub unhealthy_gpus: Vec<u32>,
    /// The node has a container engine (runs jobs with an image).
    pub containers: bool,
    /// The node is in an inference pool (see [`ReservedAccess`]).
    pub reserved: bool,
}

impl NodeInput {
    pub fn schedulable(spec: NodeSpec) -> Self {
        NodeInput {
            containers: true,
            reserved: false,
            spec,
            cordoned: false,
            healthy: true,
            unhealthy_gpus: Vec::new(),
        }
    }
}

fn intern<T: Ord + Clone>(list: &mut Vec<T>, map: &mut BTreeMap<T, u16>, value: &T) -> u16 {
    if let Some(&index) = map.get(value) {
        return index;
    }
    let index = list.len() as u16;
    list.push(value.clone());
    map.insert(value.clone(), index);
    index
}

/// `total` split in proportion to `weights` (rounded down), the remainder
/// added to the first part.
fn split_proportionally(total: u64, weights: &[usize]) -> Vec<u64> {
    let sum: u128 = weights.iter().map(|&w| w as u128).sum();
    let mut parts: Vec<u64> = weights
        .iter()
        .map(|&w| (u128::from(total) * w as u128 / sum.max(1)) as u64)
        .collect();
    let given: u64 = parts.iter().sum();
    if let Some(first) = parts.first_mut() {
        *first += total - given;
    }
    parts
}

/// A node's place in a fixed pseudo-random order of the nodes, drawn by
/// `seed`: the same name and seed always give the same rank, and different
/// seeds give unrelated orders. With [`ClusterState::reordered`], the order
/// that breaks ties between nodes of equal score, as the published FGD
/// simulator does (it prefixes each node's name with its place in a random
/// permutation drawn once per run).
pub fn seeded_rank(seed: u64, name: &NodeName) -> u64 {
    // FNV-1a over the name, then splitmix64 with the seed: well mixed, and
    // the same on every machine.
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in name.0.as_bytes() {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    let mut z = hash ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl ClusterState {
    /// The same cluster with its nodes in the order of `key` (then name):
    /// the order in which nodes of equal score are preferred. A node's
    /// sub-nodes stay together and in their order; model sets and task
    /// shapes interned against `self` stay valid.
    pub fn reordered<K: Ord>(&self, mut key: impl FnMut(&NodeName) -> K) -> ClusterState {
        let mut groups: Vec<(K, &NodeName, NodeIndex, u32)> = self
            .by_name
            .iter()
            .map(|(name, &(first, count))| (key(name), name, first, count))
            .collect();
        groups.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.cmp(b.1)));
        let mut nodes = Vec::with_capacity(self.nodes.len());
        let mut free = Vec::with_capacity(self.free.len());
        let mut by_name = BTreeMap::new();
        for (_, name, first, count) in groups {
            by_name.insert(name.clone(), (nodes.len() as NodeIndex, count));
            for index in first..first + count {
                nodes.push(self.nodes[index as usize].clone());
                free.push(self.free[index as usize].clone());
            }
        }
        ClusterState {
            nodes,
            free,
            models: self.models.clone(),
            pools: self.pools.clone(),
            racks: self.racks.clone(),
            excluded_nodes: self.excluded_nodes.clone(),
            by_name,
            model_map: self.model_map.clone(),
            model_sets: self.model_sets.clone(),
            model_set_ids: self.model_set_ids.clone(),
        }
    }

    /// Builds the cluster with every node empty. Nodes are ordered by rack,
    /// then pseudo-randomly within the rack (see [`NodeIndex`]).
    /// Never fails: nodes the engine cannot take are in
    /// [`ClusterState::excluded_nodes`] (the `Result` is kept for callers).
    pub fn new(inputs: Vec<NodeInput>) -> Result<Self, ClusterError> {
        Self::from_inputs(&inputs)
    }

    /// [`ClusterState::new`] without taking (or copying) the inputs: a
    /// scheduling cycle builds its cluster from the snapshot's nodes.
    pub fn from_inputs(inputs: &[NodeInput]) -> Result<Self, ClusterError> {
        Ok(Self::build(inputs))
    }

    /// Builds the cluster, leaving out (with a reason) the nodes the engine
    /// cannot take.
    pub fn build(inputs: &[NodeInput]) -> Self {
        let mut inputs: Vec<&NodeInput> = inputs.iter().collect();
        // The order in which nodes of equal score are preferred: by rack
        // (ties consolidate a rack at a time, keeping whole racks free for
        // gangs), then a fixed pseudo-random order within the rack (unlike
        // the name, unrelated to a node's shape or its neighbours); see
        // docs/scheduling-results.md, "Which tie order, and why". The sort
        // is stable: of two nodes with one name, the first listed stays.
        // Each cycle builds the cluster: the keys borrow, one hash a node.
        inputs.sort_by_cached_key(|&input| {
            (
                &input.spec.rack,
                seeded_rank(0, &input.spec.name),
                &input.spec.name,
            )
        });
        let mut cluster = ClusterState {
            nodes: Vec::with_capacity(inputs.len()),
            free: Vec::with_capacity(inputs.len()),
            models: Vec::new(),
            pools: Vec::new(),
            racks: Vec::new(),
            excluded_nodes: Vec::new(),
            by_name: BTreeMap::new(),
            model_map: BTreeMap::new(),
            model_sets: vec![Vec::new()],
            model_set_ids: BTreeMap::from([(Vec::new(), 0)]),
        };
        let mut pool_map = BTreeMap::new();
        let mut rack_map = BTreeMap::new();
        let mut real = 0u32;
        let mut seen: BTreeSet<&NodeName> = BTreeSet::new();
        for input in inputs {
            let spec = &input.spec;
            // Of two nodes with one name the first decides, taken or not.
            if !seen.insert(&spec.name) {
                cluster.exclude(ClusterError::DuplicateNode(spec.name.clone()));
                continue;
            }
            if let Some((position, gpu)) = spec
                .gpus
                .iter()
                .enumerate()
                .find(|(position, gpu)| gpu.index as usize != *position)
            {
                cluster.exclude(ClusterError::GpuIndices {
                    node: spec.name.clone(),
                    position,
                    index: gpu.index,
                });
                continue;
            }
            // GPU positions per model, models in the order of their first GPU.
            let mut groups: Vec<(&GpuModel, Vec<usize>)> = Vec::new();
            for (position, gpu) in spec.gpus.iter().enumerate() {
                match groups.iter_mut().find(|(model, _)| *model == &gpu.model) {
                    Some((_, positions)) => positions.push(position),
                    None => groups.push((&gpu.model, vec![position])),
                }
            }
            if let Some((model, positions)) = groups
                .iter()
                .find(|(_, positions)| positions.len() > MAX_GPUS_PER_MODEL)
            {
                cluster.exclude(ClusterError::TooManyGpus {
                    node: spec.name.clone(),
                    model: (*model).clone(),
                    count: if groups.len() == 1 {
                        spec.gpus.len()
                    } else {
                        positions.len()
                    },
                    mixed: groups.len() > 1,
                });
                continue;
            }
            let pool = intern(&mut cluster.pools, &mut pool_map, &spec.pool);
            let rack = intern(&mut cluster.racks, &mut rack_map, &spec.rack);
            let weights: Vec<usize> = if groups.is_empty() {
                vec![1]
            } else {
                groups
                    .iter()
                    .map(|(_, positions)| positions.len())
                    .collect()
            };
            let cpu = split_proportionally(spec.cpu.0, &weights);
            let memory = split_proportionally(spec.memory.0, &weights);
            let first = cluster.nodes.len() as NodeIndex;
            cluster
                .by_name
                .insert(spec.name.clone(), (first, weights.len() as u32));
            for part in 0..weights.len() {
                let (model, positions): (u32, Vec<usize>) = match groups.get(part) {
                    None => (NO_MODEL, Vec::new()),
                    Some((model, positions)) => (cluster.intern_model(model), positions.clone()),
                };
                let gpus: Vec<&muster_model::GpuSpec> =
                    positions.iter().map(|&p| &spec.gpus[p]).collect();
                let gpu_healthy: Vec<bool> = gpus
                    .iter()
                    .map(|gpu| !input.unhealthy_gpus.contains(&gpu.index))
                    .collect();
                let mut accepted_by = Bits::default();
                if model != NO_MODEL {
                    for (id, set) in cluster.model_sets.iter().enumerate() {
                        if set.binary_search(&model).is_ok() {
                            accepted_by.insert(id as u32);
                        }
                    }
                }
                cluster.free.push(NodeFree {
                    gpu: gpu_healthy
                        .iter()
                        .map(|&ok| if ok { 1000 } else { 0 })
                        .collect(),
                    cpu_milli: cpu[part],
                    memory_mib: memory[part],
                });
                cluster.nodes.push(NodeStatic {
                    name: spec.name.clone(),
                    real,
                    pool,
                    rack,
                    model,
                    accepted_by,
                    gpu_memory_mib: gpus.iter().map(|gpu| gpu.memory.0).min().unwrap_or(0),
                    cpu_milli: cpu[part],
                    memory_mib: memory[part],
                    gpu_index: gpus.iter().map(|gpu| gpu.index).collect(),
                    nvlink_domain: gpus.iter().map(|gpu| gpu.nvlink_domain).collect(),
                    cordoned: input.cordoned,
                    healthy: input.healthy,
                    gpu_healthy,
                    containers: input.containers,
                    reserved: input.reserved,
                });
            }
            real += 1;
        }
        // Said in name order, whatever the tie order.
        cluster.excluded_nodes.sort_by(|a, b| a.0.cmp(&b.0));
        cluster
    }

    fn exclude(&mut self, why: ClusterError) {
        let name = match &why {
            ClusterError::DuplicateNode(name) => name,
            ClusterError::TooManyGpus { node, .. } | ClusterError::GpuIndices { node, .. } => node,
        };
        self.excluded_nodes.push((name.clone(), why.to_string()));
    }

    fn intern_model(&mut self, model: &GpuModel) -> u32 {
        if let Some(&index) = self.model_map.get(model) {
            return index;
        }
        let index = self.models.len() as u32;
        self.models.push(model.clone());
        self.model_map.insert(model.clone(), index);
        index
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The node's first sub-node (its only one unless it mixes GPU models).
    pub fn node_index(&self, name: &NodeName) -> Option<NodeIndex> {
        self.by_name.get(name).map(|&(first, _)| first)
    }

    /// The node's sub-nodes (one unless it mixes GPU models); empty for a
    /// node the cluster does not have or left out.
    pub fn sub_nodes(&self, name: &NodeName) -> std::ops::Range<NodeIndex> {
        match self.by_name.get(name) {
            Some(&(first, count)) => first..first + count,
            None => 0..0,
        }
    }

    /// How many real nodes the cluster holds (sub-nodes counted once).
    pub fn real_len(&self) -> usize {
        self.by_name.len()
    }

    pub fn model_index(&self, model: &GpuModel) -> Option<u32> {
        self.model_map.get(model).copied()
    }

    pub fn pool_index(&self, pool: &PoolName) -> Option<u16> {
        self.pools
            .iter()
            .position(|known| known == pool)
            .map(|index| index as u16)
    }

    /// The set of the given models, interned (see [`ModelMask`]); models the
    /// cluster does not have are left out (so a job asking only for those
    /// fits nowhere). Empty means any.
    pub fn model_mask(&mut self, models: &[GpuModel]) -> ModelMask {
        if models.is_empty() {
            return ModelMask::ANY;
        }
        let mut set: Vec<u32> = models
            .iter()
            .filter_map(|model| self.model_index(model))
            .collect();
        set.sort_unstable();
        set.dedup();
        if let Some(&id) = self.model_set_ids.get(&set) {
            return ModelMask(id);
        }
        let id = self.model_sets.len() as u32;
        for node in &mut self.nodes {
            if node.model != NO_MODEL && set.binary_search(&node.model).is_ok() {
                node.accepted_by.insert(id);
            }
        }
        self.model_set_ids.insert(set.clone(), id);
        self.model_sets.push(set);
        ModelMask(id)
    }

    /// The models of an interned set (`None` for [`ModelMask::ANY`] or an id
    /// this cluster did not intern).
    pub fn models_of(&self, mask: ModelMask) -> Option<Vec<&GpuModel>> {
        let set = self.model_sets.get(mask.0 as usize)?;
        Some(set.iter().map(|&m| &self.models[m as usize]).collect())
    }

    /// Total GPU capacity of healthy GPUs, in thousandths.
    pub fn gpu_capacity_milli(&self) -> u64 {
        self.nodes
            .iter()
            .map(|node| node.gpu_healthy.iter().filter(|&&ok| ok).count() as u64 * 1000)
            .sum()
    }

    /// GPU capacity in use, in thousandths.
    pub fn gpu_allocated_milli(&self) -> u64 {
        self.gpu_capacity_milli() - self.free.iter().map(NodeFree::idle_gpu_milli).sum::<u64>()
    }

    /// The first filter `node` fails for `shape`, ignoring free capacity
    /// (pool, cordon, health, model, GPU memory, and whether the node could
    /// ever hold the task when empty).
    pub fn static_filter(&self, node: NodeIndex, shape: &TaskShape) -> Option<FilterReason> {
        self.static_filter_with(node, shape, true)
    }

    /// [`ClusterState::static_filter`]; without `availability`, a cordoned
    /// or lost node is taken as if it were back.
    fn static_filter_with(
        &self,
        node: NodeIndex,
        shape: &TaskShape,
        availability: bool,
    ) -> Option<FilterReason> {
        let info = &self.nodes[node as usize];
        if let Some(pool) = shape.pool
            && info.pool != pool
        {
            return Some(FilterReason::Pool);
        }
        if availability && info.cordoned {
            return Some(FilterReason::Cordoned);
        }
        if availability && !info.healthy {
            return Some(FilterReason::Unhealthy);
        }
        let gpus = shape.gpu_count();
        if gpus > 0 {
            if !info.accepts(shape.models) {
                return Some(FilterReason::GpuModel);
            }
            if info.gpu_memory_mib < shape.min_gpu_memory_mib {
                return Some(FilterReason::GpuMemory);
            }
        }
        if shape.container && !info.containers {
            return Some(FilterReason::Containers);
        }
        if info.reserved && shape.reserved == ReservedAccess::No {
            return Some(FilterReason::Reserved);
        }
        None
    }

    /// The first filter `node` fails for `shape` given its free resources.
    pub fn filter(&self, node: NodeIndex, shape: &TaskShape) -> Option<FilterReason> {
        if let Some(reason) = self.static_filter(node, shape) {
            return Some(reason);
        }
        let free = &self.free[node as usize];
        if !gpus_fit(&free.gpu, shape.gpus) {
            return Some(FilterReason::Gpus);
        }
        if free.cpu_milli < shape.cpu_milli {
            return Some(FilterReason::Cpu);
        }
        if free.memory_mib < shape.memory_mib {
            return Some(FilterReason::Memory);
        }
        None
    }

    /// Whether `shape` would fit `node` if nothing ran there.
    pub fn could_ever_fit(&self, node: NodeIndex, shape: &TaskShape) -> bool {
        self.could_fit_empty(node, shape, true)
    }

    /// Whether `shape` would fit `node` if nothing ran there and the node
    /// were uncordoned and up (a lost node back).
    pub fn could_fit_when_available(&self, node: NodeIndex, shape: &TaskShape) -> bool {
        self.could_fit_empty(node, shape, false)
    }

    fn could_fit_empty(&self, node: NodeIndex, shape: &TaskShape, availability: bool) -> bool {
        if self.static_filter_with(node, shape, availability).is_some() {
            return false;
        }
        let info = &self.nodes[node as usize];
        let healthy = info.gpu_healthy.iter().filter(|&&ok| ok).count() as u32;
        let gpus_ok = match shape.gpus {
            GpuRequest::Whole(count) => healthy >= count,
            GpuRequest::Shared(_) => healthy >= 1,
        };
        gpus_ok && info.cpu_milli >= shape.cpu_milli && info.memory_mib >= shape.memory_mib
    }

    pub fn fits(&self, node: NodeIndex, shape: &TaskShape) -> bool {
        self.filter(node, shape).is_none()
    }

    /// Whether the node's free resources hold `shape`, for a node already
    /// known to pass [`ClusterState::static_filter`].
    pub fn has_room(&self, node: NodeIndex, shape: &TaskShape) -> bool {
        let free = &self.free[node as usize];
        gpus_fit(&free.gpu, shape.gpus)
            && free.cpu_milli >= shape.cpu_milli
            && free.memory_mib >= shape.memory_mib
    }

    /// Everything a score can depend on except the node's name: two nodes
    /// with equal keys score the same for every shape.
    pub fn state_key(&self, node: NodeIndex) -> NodeStateKey<'_> {
        let info = &self.nodes[node as usize];
        NodeStateKey {
            model: info.model,
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
            nvlink_domain: &info.nvlink_domain,
            gpu_healthy: &info.gpu_healthy,
            free: &self.free[node as usize],
        }
    }

    /// Takes a placement's resources. The caller has checked it fits.
    pub fn take(&mut self, placement: &TaskPlacement) {
        let free = &mut self.free[placement.node as usize];
        for grant in &placement.gpus {
            let slot = &mut free.gpu[grant.index as usize];
            *slot = slot.saturating_sub(grant.milli);
        }
        free.cpu_milli = free.cpu_milli.saturating_sub(placement.cpu_milli);
        free.memory_mib = free.memory_mib.saturating_sub(placement.memory_mib);
    }

    /// Gives a placement's resources back.
    pub fn give_back(&mut self, placement: &TaskPlacement) {
        let node = &self.nodes[placement.node as usize];
        let free = &mut self.free[placement.node as usize];
        for grant in &placement.gpus {
            let index = grant.index as usize;
            if node.gpu_healthy.get(index).copied().unwrap_or(false) {
                free.gpu[index] = (free.gpu[index] + grant.milli).min(1000);
            }
        }
        free.cpu_milli = (free.cpu_milli + placement.cpu_milli).min(node.cpu_milli);
        free.memory_mib = (free.memory_mib + placement.memory_mib).min(node.memory_mib);
    }
}

/// Whether a GPU request fits the free GPUs of one node.
pub fn gpus_fit(free: &[u16], request: GpuRequest) -> bool {
    match request {
        GpuRequest::Whole(0) => true,
        GpuRequest::Whole(count) => {
            free.iter().filter(|&&slot| slot == 1000).count() as u32 >= count
        }
        GpuRequest::Shared(share) => free.iter().any(|&slot| u32::from(slot) >= share.0),
    }
}
