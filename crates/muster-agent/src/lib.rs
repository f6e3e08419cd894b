//! muster's node agent shell (tokio): the part of `muster agent` that touches
//! the host.
//!
//! It owns:
//! - [`gpu`]: GPU backends behind one trait, [`gpu::GpuBackend`]: NVML
//!   (the driver library is loaded at run time, so the agent builds and
//!   starts anywhere) and a simulated backend (`--simulate-gpus 8xH100-80GB`)
//!   for tests and demos;
//! - [`runtime`]: the process runtime, which runs each task under a
//!   supervisor ([`supervise`]) in a cgroup of its own, as an unprivileged
//!   user, with its GPUs in `CUDA_VISIBLE_DEVICES`, logs to files, stops it
//!   with a signal and a grace period, fences it at the node's deadline even
//!   when the agent is gone, and finds its tasks again after a restart;
//! - later, the agent's main loop: registration, heartbeats and lease
//!   renewal, watching desired allocations, reporting what runs.
//!
//! It must not make decisions: which allocation runs where, when a lease is
//! lost, what to fence. Those belong to the pure crates (`muster-node`,
//! `muster-control`, `muster-sched`), which this shell feeds with values and
//! whose effects it carries out. It reads clocks and the environment, starts
//! processes and talks to the driver; nothing pure depends on it.

pub mod agent;
pub mod checks;
pub mod container;
pub mod devsession;
pub mod gpu;
pub mod logship;
pub mod nodestats;
pub mod runtime;
pub mod stack;
pub mod supervise;
pub mod taskinit;
mod tunnels;

pub use agent::{AgentConfig, run};
pub use gpu::{
    GpuBackend, GpuError, GpuInfo, GpuInventory, GpuTelemetry, NvmlBackend, SimulatedBackend,
};
pub use runtime::{
    CgroupChoice, CgroupPlan, EndReason, ProcessRuntime, RecoveredStatus, RecoveredTask, Recovery,
    RuntimeConfig, RuntimeError, StopOutcome, TaskExit, TaskLaunch,
};
