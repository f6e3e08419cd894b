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

/// The key of a node's software stack that says it runs container tasks:
/// its Docker engine's version (the agent reports it when the engine
/// answers). Jobs with an image go only to such nodes.
pub const CONTAINER_ENGINE: &str = "docker";

/// The most GPUs one node may have (the scheduler keeps a node's GPUs in
/// 64-bit sets).
pub const MAX_NODE_GPUS: usize = 64;
/// The longest node, pool or rack name.
pub const MAX_NODE_NAME_LENGTH: usize = 63;
/// The longest GPU model name or GPU UUID.
pub const MAX_GPU_TEXT_LENGTH: usize = 128;
/// The most CPU thousandths a node may offer (a million cores).
pub const MAX_NODE_CPU_MILLI: u64 = 1_000_000_000;
/// The most memory a node may offer: 1 PiB.
pub const MAX_NODE_MEMORY_MIB: u64 = 1 << 30;

/// Letters, digits, '-', '_' and '.', starting with a letter or digit, at
/// most [`MAX_NODE_NAME_LENGTH`] bytes: node, pool and rack names.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NODE_NAME_LENGTH
        && name.starts_with(|c: char| c.is_ascii_alphanumeric())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl NodeSpec {
    /// Every reason this spec cannot join a cluster, each naming the field,
    /// the value and what is accepted (empty: valid). A node may hold GPUs
    /// of several models.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        let plain = |what: &str, name: &str, problems: &mut Vec<String>| {
            if !is_plain_name(name) {
                problems.push(format!(
                    "{what} must be 1 to {MAX_NODE_NAME_LENGTH} letters, digits, '-', '_' or \
                     '.', starting with a letter or digit, got {:?}",
                    truncated(name)
                ));
            }
        };
        plain("the node name", &self.name.0, &mut problems);
        plain("pool", &self.pool.0, &mut problems);
        plain("rack", &self.rack.0, &mut problems);
        if self.gpus.len() > MAX_NODE_GPUS {
            problems.push(format!(
                "the node has {} GPUs; a node may have at most {MAX_NODE_GPUS} (split a larger \
                 machine into several agents with --gpus)",
                self.gpus.len()
            ));
        }
        for (position, gpu) in self.gpus.iter().enumerate().take(MAX_NODE_GPUS + 1) {
            if gpu.index as usize != position {
                problems.push(format!(
                    "gpus must be listed by index from 0 without gaps; gpus[{position}] has \
                     index {}",
                    gpu.index
                ));
            }
            let model = gpu.model.as_str();
            if model.is_empty()
                || model.len() > MAX_GPU_TEXT_LENGTH
                || !model.chars().all(|c| c.is_ascii_graphic())
            {
                problems.push(format!(
                    "gpus[{position}].model must be 1 to {MAX_GPU_TEXT_LENGTH} printable \
                     characters without spaces, got {:?}",
                    truncated(model)
                ));
            }
            if gpu.uuid.len() > MAX_GPU_TEXT_LENGTH || gpu.uuid.chars().any(char::is_control) {
                problems.push(format!(
                    "gpus[{position}].uuid must be at most {MAX_GPU_TEXT_LENGTH} printable \
                     characters, got {:?}",
                    truncated(&gpu.uuid)
                ));
            }
            if gpu.memory.0 > MAX_NODE_MEMORY_MIB {
                problems.push(format!(
                    "gpus[{position}].memory_mib is {}; at most {MAX_NODE_MEMORY_MIB}",
                    gpu.memory.0
                ));
            }
        }
        if self.cpu.0 == 0 || self.cpu.0 > MAX_NODE_CPU_MILLI {
            problems.push(format!(
                "cpu_milli must be from 1 to {MAX_NODE_CPU_MILLI} (what the node offers to \
                 jobs), got {}",
                self.cpu.0
            ));
        }
        if self.memory.0 == 0 || self.memory.0 > MAX_NODE_MEMORY_MIB {
            problems.push(format!(
                "memory_mib must be from 1 to {MAX_NODE_MEMORY_MIB} (what the node offers to \
                 jobs), got {}",
                self.memory.0
            ));
        }
        problems
    }

    /// The node's distinct GPU models, in order of first appearance.
    pub fn gpu_models(&self) -> Vec<&GpuModel> {
        let mut models: Vec<&GpuModel> = Vec::new();
        for gpu in &self.gpus {
            if !models.contains(&&gpu.model) {
                models.push(&gpu.model);
            }
        }
        models
    }
}

/// At most 80 characters of `text`, for error messages.
fn truncated(text: &str) -> String {
    match text.char_indices().nth(80) {
        Some((end, _)) => format!("{}...", &text[..end]),
        None => text.to_string(),
    }
}

/// What an XID (an error the NVIDIA driver logs for a GPU) means, when it
/// means the GPU itself is at fault and should take no more work until it
/// is reset or repaired; `None` for XIDs an application causes (13, 31,
/// 43, 45: its own faults, which leave the GPU fine) or that are unknown.
/// From NVIDIA's XID catalogue.
pub fn fatal_xid(xid: u64) -> Option<&'static str> {
    Some(match xid {
        48 => "a double-bit ECC error",
        63 => "ECC page retirement or row remapping pending",
        64 => "ECC page retirement or row remapping failed",
        74 => "an NVLink error",
        79 => "the GPU has fallen off the bus",
        92 => "a high single-bit ECC error rate",
        94 => "a contained ECC error",
        95 => "an uncontained ECC error",
        119 => "a GSP RPC timeout",
        120 => "a GSP error",
        140 => "an unrecovered ECC error",
        _ => return None,
    })
}

#[cfg(test)]
mod xid_tests {
    #[test]
    fn hardware_xids_are_fatal_and_application_ones_are_not() {
        assert!(super::fatal_xid(79).is_some_and(|what| what.contains("bus")));
        assert!(super::fatal_xid(48).is_some());
        for xid in [13, 31, 43, 45, 0, 9_999] {
            assert_eq!(super::fatal_xid(xid), None, "XID {xid}");
        }
    }
}
