//! muster's simulator: replays public GPU-cluster traces through the real
//! scheduling engine (`muster-sched`) and measures what each placement policy
//! achieves.
//!
//! It owns the trace formats (the Alibaba openb node and pod lists, see
//! [`trace`]) and the evaluation protocols of `traces/README.md`; today
//! Protocol A, allocation under load (see [`alloc`]); and the deterministic
//! fault-injection world of the control plane and its agents (see [`faults`]).
//!
//! Pure and deterministic: parsing takes text, simulation takes a seed, and
//! the same inputs and seed give byte-identical results. It must not depend on
//! tokio, HTTP or a database, and never reads a clock, ambient randomness,
//! the environment or files (the `muster` binary reads the files and runs
//! seeds on threads). Only ordered collections are used.

pub mod alloc;
pub mod faults;
pub mod jobs;
pub mod mix;
pub mod replay;
pub mod services;
pub mod trace;

pub use alloc::{
    AllocationCurve, AllocationError, AllocationExperiment, AllocationReport, LOAD_POINTS,
    MAX_LOAD_PCT, NamedPolicy, PolicyResult, Ties, arrival_list, summarize,
};
pub use faults::{FaultConfig, FaultFailure, FaultReport, run_faults};
pub use jobs::{MUSTER_HISTORY_HEADER, parse_muster_history, parse_openb_timed, parse_philly};
pub use mix::{MixChange, MixError, resample, write_openb_tasks};
pub use replay::{
    QueueResult, ReplayConfig, ReplayJob, ReplayPolicy, ReplayResult, proportional_queues, replay,
};
pub use services::{
    PoolSharing, ServiceMixConfig, ServiceMixResult, request_rate, run_service_mix,
};
pub use trace::{TraceError, TraceTask, parse_openb_nodes, parse_openb_tasks};
