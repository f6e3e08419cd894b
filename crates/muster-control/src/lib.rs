//! muster's control-plane state machine.
//!
//! It owns the truth about jobs, allocations (a task bound to a node and
//! concrete GPUs, with a generation), nodes (with leases renewed by
//! heartbeats) and queues. Inputs arrive through [`ControlPlane::handle`] with
//! the current time; scheduling is split in two so that the server can run
//! the engine off its async threads: [`ControlPlane::scheduling_input`] takes
//! a snapshot, [`ControlPlane::apply_outcome`] re-checks each decision against
//! the state as it is by then and applies what still holds.
//!
//! Pure: no tokio, HTTP, database, clock, randomness or environment; the
//! server persists what [`Output`] says changed. [`ControlPlane::check_invariants`]
//! recomputes derived state from scratch.

pub mod accounting;
mod admission;
pub mod fleet;
mod records;
pub mod services;
mod state;
pub mod usage;

pub(crate) use admission::AdmissionCounts;
pub use admission::{
    DEFAULT_MAX_PRIORITY_CLASS, DEFAULT_NODE_LIMITS, NodeLimits, Submitter, node_claim_problems,
};
pub use records::{ChangedRecords, Counters, MemoryStore, Records, RestoreError};
pub use state::*;
