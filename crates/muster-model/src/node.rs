//! Nodes, their GPUs and their place in the topology.

use crate::{CpuMilli, MemoryMib};
use std::fmt;

macro_rules! name {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub String);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<&str> for $name {
            fn from(name: &str) -> Self {
                $name(name.to_string())
            }
        }

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }
    };
}

name!(
    /// A node's unique name (its host name by default).
    NodeName
);
name!(
    /// A named set of nodes for workload isolation (training, inference, dev).
    PoolName
);
name!(
    /// A rack (or leaf switch): the network tier a gang prefers to stay within.
    RackName
);

/// A GPU model as the fleet names it, for example `H100-80GB`, `A100-40GB`,
/// `T4`. Compared case-insensitively: the name is stored upper-case.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct GpuModel(String);

impl GpuModel {
    pub fn new(name: &str) -> Self {
        GpuModel(name.trim().to_ascii_uppercase())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for GpuModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// One GPU of a node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpec {
    /// Index on the node, as `CUDA_VISIBLE_DEVICES` counts.
    pub index: u32,
    pub uuid: String,
    pub model: GpuModel,
    pub memory: MemoryMib,
    /// GPUs with the same domain talk over NVLink.
    pub nvlink_domain: u32,
}

/// What a node offers: its GPUs, CPUs, memory, and where it sits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeSpec {
    pub name: NodeName,
    pub pool: PoolName,
    pub rack: RackName,
    pub gpus: Vec<GpuSpec>,
    pub cpu: CpuMilli,
    pub memory: MemoryMib,
}

impl NodeSpec {
    /// The model of the node's GPUs (nodes are homogeneous in practice; the
    /// first GPU's model is taken), or `None` for a CPU-only node.
    pub fn gpu_model(&self) -> Option<&GpuModel> {
        self.gpus.first().map(|gpu| &gpu.model)
    }
}
