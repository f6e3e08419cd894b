//! muster's domain vocabulary: ids, quantities, GPU models, topology, and the
//! validated job and node specs every other crate speaks.
//!
//! This crate is pure: it depends on nothing but `std`, reads no clock, no
//! randomness and no environment. Wire formats (serde, YAML) live in
//! `muster-api`, which validates into these types.

pub mod hashing;
mod job;
mod node;
mod quantity;
mod queue;
mod service;
mod text;

pub use job::{
    ArrayElement, ArraySpec, CheckpointPolicy, DEV_SESSION_COMMAND, DEV_TOKEN_VARIABLE, Dependency,
    DependencyKind, JobId, JobSpec, MAX_ARRAY_ELEMENTS, MAX_ARRAY_INDEX, MAX_DEPENDENCIES, Mount,
    PriorityClass, RetryPolicy, Signal, TopologyConstraint, TopologyStrength,
    is_dev_session_command,
};
pub use node::{
    CONTAINER_ENGINE, GpuModel, GpuSpec, MAX_GPU_TEXT_LENGTH, MAX_NODE_CPU_MILLI, MAX_NODE_GPUS,
    MAX_NODE_MEMORY_MIB, MAX_NODE_NAME_LENGTH, NodeName, NodeSpec, PoolName, RackName, fatal_xid,
    is_plain_name,
};
pub use quantity::{CpuMilli, GpuMilli, GpuRequest, MemoryMib, Time};
pub use queue::{Budget, QueueName, QueueSpec};
pub use service::{
    Autoscale, KEPT_REVISIONS, MAX_AUTOSCALE_WINDOW, MAX_PROBE_TIMEOUT, MAX_REPLICAS,
    MAX_SERVICE_NAME_LENGTH, Probe, ProbeAction, RestartBackoff, ScaleMetric, ServiceRef,
    ServiceSpec, Spread, UpdateStrategy,
};
pub use text::truncate_at_char_boundary;
