//! muster's scheduling engine: which pending job runs next, where, and what
//! must make way for it.
//!
//! Pure and deterministic: it takes values (a snapshot of the cluster, the
//! pending and running jobs, queues, a policy, an RNG) and returns values (an
//! [`Outcome`]). It never reads a clock, ambient randomness or the
//! environment, and must not depend on tokio, HTTP or a database. The server
//! and the simulator call the same code.

pub mod cluster;
pub mod placer;
pub mod policy;

pub use cluster::{
    Bits, ClusterError, ClusterState, FilterReason, GpuGrant, MAX_GPUS_PER_MODEL, ModelMask,
    NO_MODEL, NodeFree, NodeIndex, NodeInput, NodeStatic, ReservedAccess, TaskPlacement, TaskShape,
    seeded_rank,
};
pub use placer::{FilterCounts, GangFailure, Placer, best_node_by_scan};
pub use policy::{PlacementPolicy, Scale, Scorer, TypicalShape, TypicalWorkload, UnknownPolicy};
pub mod fairshare;
pub mod forecast;
pub mod runtime;
pub mod schedule;

pub use fairshare::{ServiceLevels, UsageLedger};
pub use forecast::{ForecastLimits, StartForecast, forecast_starts};
pub use runtime::RuntimeHistory;
pub use schedule::{
    Allocation, Apart, Backfill, JobStart, Outcome, PendingJob, PendingReason, Preemption,
    PreemptionCause, Reservation, RunningJob, SchedulingPolicy, Snapshot, TaskRequest,
    nodes_that_could_ever_hold, schedule,
};
