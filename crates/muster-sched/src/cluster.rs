//! The cluster as the scheduler sees it: each node's static shape and its free
//! resources, with GPU models, pools and racks interned to small integers.

use muster_model::{GpuModel, GpuRequest, NodeName, NodeSpec, PoolName, RackName};
use std::collections::BTreeMap;

/// Index of a node in [`ClusterState`]; nodes are ordered by name, so a
/// smaller index is a smaller name (the tie-break every policy uses).
pub type NodeIndex = u32;

/// A set of GPU models as a bit mask over [`ClusterState`]'s interned models.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelMask(pub u64);

impl ModelMask {
    pub const ANY: ModelMask = ModelMask(u64::MAX);

    pub fn contains(self, model: u8) -> bool {
        model < 64 && self.0 & (1 << model) != 0
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
    Gpus,
    Cpu,
    Memory,
}

impl FilterReason {
    pub const ALL: [FilterReason; 8] = [
        FilterReason::Pool,
        FilterReason::Cordoned,
        FilterReason::Unhealthy,
        FilterReason::GpuModel,
        FilterReason::GpuMemory,
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

/// A node's static description, interned.
#[derive(Debug, Clone)]
pub struct NodeStatic {
    pub name: NodeName,
    pub pool: u16,
    pub rack: u16,
    /// Interned GPU model; `u8::MAX` for a node without GPUs.
    pub model: u8,
    pub gpu_memory_mib: u64,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    /// NVLink domain of each GPU.
    pub nvlink_domain: Vec<u32>,
    pub cordoned: bool,
    pub healthy: bool,
    /// Per GPU: false when the GPU is out of service.
    pub gpu_healthy: Vec<bool>,
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

/// See [`ClusterState::state_key`].
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeStateKey {
    model: u8,
    cpu_milli: u64,
    memory_mib: u64,
    nvlink_domain: Vec<u32>,
    gpu_healthy: Vec<bool>,
    free: NodeFree,
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

/// Error building a cluster from node specs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterError {
    DuplicateNode(NodeName),
    TooManyGpuModels,
    TooManyGpus(NodeName),
    MixedGpuModels(NodeName),
}

impl std::fmt::Display for ClusterError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClusterError::DuplicateNode(name) => write!(f, "node {name} appears twice"),
            ClusterError::TooManyGpuModels => {
                write!(f, "more than 63 distinct GPU models in one cluster")
            }
            ClusterError::TooManyGpus(name) => {
                write!(f, "node {name} has more than 64 GPUs")
            }
            ClusterError::MixedGpuModels(name) => write!(
                f,
                "node {name} mixes GPU models; split it into one node per model"
            ),
        }
    }
}

impl std::error::Error for ClusterError {}

/// Static shapes and free resources of every node.
#[derive(Debug, Clone)]
pub struct ClusterState {
    pub nodes: Vec<NodeStatic>,
    pub free: Vec<NodeFree>,
    pub models: Vec<GpuModel>,
    pub pools: Vec<PoolName>,
    pub racks: Vec<RackName>,
    by_name: BTreeMap<NodeName, NodeIndex>,
}

/// A node spec together with whether it may take new work.
#[derive(Debug, Clone)]
pub struct NodeInput {
    pub spec: NodeSpec,
    pub cordoned: bool,
    pub healthy: bool,
    /// GPU indices out of service.
    pub unhealthy_gpus: Vec<u32>,
}

impl NodeInput {
    pub fn schedulable(spec: NodeSpec) -> Self {
        NodeInput {
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

impl ClusterState {
    /// Builds the cluster with every node empty. Nodes are sorted by name.
    pub fn new(inputs: Vec<NodeInput>) -> Result<Self, ClusterError> {
        Self::from_inputs(&inputs)
    }

    /// [`ClusterState::new`] without taking (or copying) the inputs: a
    /// scheduling cycle builds its cluster from the snapshot's nodes.
    pub fn from_inputs(inputs: &[NodeInput]) -> Result<Self, ClusterError> {
        let mut inputs: Vec<&NodeInput> = inputs.iter().collect();
        // Snapshots usually come sorted already (the check is cheaper).
        if !inputs.is_sorted_by(|a, b| a.spec.name <= b.spec.name) {
            inputs.sort_by(|a, b| a.spec.name.cmp(&b.spec.name));
        }
        let mut models = Vec::new();
        let mut model_map = BTreeMap::new();
        let mut pools = Vec::new();
        let mut pool_map = BTreeMap::new();
        let mut racks = Vec::new();
        let mut rack_map = BTreeMap::new();
        let mut by_name = BTreeMap::new();
        let mut nodes = Vec::with_capacity(inputs.len());
        let mut free = Vec::with_capacity(inputs.len());
        for (index, input) in inputs.iter().enumerate() {
            let spec = &input.spec;
            if by_name
                .insert(spec.name.clone(), index as NodeIndex)
                .is_some()
            {
                return Err(ClusterError::DuplicateNode(spec.name.clone()));
            }
            if spec.gpus.len() > 64 {
                return Err(ClusterError::TooManyGpus(spec.name.clone()));
            }
            let model = match spec.gpu_model() {
                None => u8::MAX,
                Some(model) => {
                    if spec.gpus.iter().any(|gpu| &gpu.model != model) {
                        return Err(ClusterError::MixedGpuModels(spec.name.clone()));
                    }
                    let interned = intern(&mut models, &mut model_map, model);
                    if interned >= 63 {
                        return Err(ClusterError::TooManyGpuModels);
                    }
                    interned as u8
                }
            };
            let gpu_healthy: Vec<bool> = spec
                .gpus
                .iter()
                .map(|gpu| !input.unhealthy_gpus.contains(&gpu.index))
                .collect();
            nodes.push(NodeStatic {
                name: spec.name.clone(),
                pool: intern(&mut pools, &mut pool_map, &spec.pool),
                rack: intern(&mut racks, &mut rack_map, &spec.rack),
                model,
                gpu_memory_mib: spec.gpus.iter().map(|gpu| gpu.memory.0).min().unwrap_or(0),
                cpu_milli: spec.cpu.0,
                memory_mib: spec.memory.0,
                nvlink_domain: spec.gpus.iter().map(|gpu| gpu.nvlink_domain).collect(),
                cordoned: input.cordoned,
                healthy: input.healthy,
                gpu_healthy: gpu_healthy.clone(),
            });
            free.push(NodeFree {
                gpu: gpu_healthy
                    .iter()
                    .map(|&ok| if ok { 1000 } else { 0 })
                    .collect(),
                cpu_milli: spec.cpu.0,
                memory_mib: spec.memory.0,
            });
        }
        Ok(ClusterState {
            nodes,
            free,
            models,
            pools,
            racks,
            by_name,
        })
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    pub fn node_index(&self, name: &NodeName) -> Option<NodeIndex> {
        self.by_name.get(name).copied()
    }

    pub fn model_index(&self, model: &GpuModel) -> Option<u8> {
        self.models
            .iter()
            .position(|known| known == model)
            .map(|index| index as u8)
    }

    pub fn pool_index(&self, pool: &PoolName) -> Option<u16> {
        self.pools
            .iter()
            .position(|known| known == pool)
            .map(|index| index as u16)
    }

    /// A mask of the given models; models the cluster does not have are left
    /// out (so a job asking only for those fits nowhere). Empty means any.
    pub fn model_mask(&self, models: &[GpuModel]) -> ModelMask {
        if models.is_empty() {
            return ModelMask::ANY;
        }
        let mut mask = 0u64;
        for model in models {
            if let Some(index) = self.model_index(model) {
                mask |= 1 << index;
            }
        }
        ModelMask(mask)
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
        let info = &self.nodes[node as usize];
        if let Some(pool) = shape.pool
            && info.pool != pool
        {
            return Some(FilterReason::Pool);
        }
        if info.cordoned {
            return Some(FilterReason::Cordoned);
        }
        if !info.healthy {
            return Some(FilterReason::Unhealthy);
        }
        let gpus = shape.gpu_count();
        if gpus > 0 {
            if !shape.models.contains(info.model) {
                return Some(FilterReason::GpuModel);
            }
            if info.gpu_memory_mib < shape.min_gpu_memory_mib {
                return Some(FilterReason::GpuMemory);
            }
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
        if self.static_filter(node, shape).is_some() {
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
    pub fn state_key(&self, node: NodeIndex) -> NodeStateKey {
        let info = &self.nodes[node as usize];
        let free = &self.free[node as usize];
        NodeStateKey {
            model: info.model,
            cpu_milli: info.cpu_milli,
            memory_mib: info.memory_mib,
            nvlink_domain: info.nvlink_domain.clone(),
            gpu_healthy: info.gpu_healthy.clone(),
            free: free.clone(),
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
