//! muster's domain vocabulary: ids, quantities, GPU models, topology, and the
//! validated job and node specs every other crate speaks.
//!
//! This crate is pure: it depends on nothing but `std`, reads no clock, no
//! randomness and no environment. Wire formats (serde, YAML) live in
//! `muster-api`, which validates into these types.

mod job;
mod node;
mod quantity;
mod queue;

pub use job::{
    CheckpointPolicy, JobId, JobSpec, PriorityClass, RetryPolicy, Signal, TopologyConstraint,
    TopologyStrength,
};
pub use node::{GpuModel, GpuSpec, NodeName, NodeSpec, PoolName, RackName};
pub use quantity::{CpuMilli, GpuMilli, GpuRequest, MemoryMib, Time};
pub use queue::{QueueName, QueueSpec};
