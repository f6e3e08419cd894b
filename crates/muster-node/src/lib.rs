//! muster's node agent, pure: [`AgentCore`] makes every decision of an
//! agent (registration, heartbeats and their sequence numbers, the lease,
//! fencing, which tasks to start, stop and forget, and in which order) as a
//! state machine with typed inputs and outputs.
//!
//! No tokio, HTTP, clock or processes here: the agent shell
//! (`muster-agent`) and the fault simulation (`muster-sim`) pass values in
//! and carry the outputs out. Depends only on `muster-model`.

mod core;
mod failover;

pub use crate::core::{
    ANSWER_MARGIN_MS, AdoptedTask, AgentCore, CoreConfig, DEFAULT_HEARTBEAT_MS, DEFAULT_LEASE_MS,
    DesiredTask, FAILOVER_RESERVE_MS, HEARTBEAT_RETRY_MS, HeartbeatFailure, Input, LeaseRecord,
    ObservedTask, Output, REGISTER_BACKOFF_MAX_MS, REGISTER_BACKOFF_MIN_MS, REQUEST_LIMIT_MS,
    Report, TaskId,
};
pub use crate::failover::{
    DEFAULT_FENCE_MARGIN_MS, lease_through_failover_ms, least_lease_through_failover_ms,
};

/// How a task ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskExit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it (a stop, or something else).
    Signal(i32),
    /// The runtime killed it at the fence deadline (the lease was not
    /// renewed in time).
    Fenced,
    /// It is gone and nothing says how (its host restarted).
    Vanished,
    /// The kernel killed it, or a process of it, at its memory limit; the
    /// leader's own exit code when it exited by itself afterwards.
    MemoryLimit(Option<i32>),
}

impl TaskExit {
    /// The exit code as the control plane takes it (`None`: no code).
    pub fn code(self) -> Option<i32> {
        match self {
            TaskExit::Code(code) => Some(code),
            TaskExit::MemoryLimit(code) => code,
            TaskExit::Signal(_) | TaskExit::Fenced | TaskExit::Vanished => None,
        }
    }
}

/// How long a stopping task gets between its stop signal and the kill, in
/// ms, when the control plane did not say (the allocation is no longer
/// desired at all).
pub const DEFAULT_GRACE_MS: u64 = 10_000;

/// The most a task gets when the node fences itself: the lease is about to
/// run out and the work may be placed elsewhere, so the job's own grace
/// period cannot be honoured.
pub const FENCED_GRACE_MS: u64 = 500;

/// The grace period of a stop: the job's own (`None`: not known here, see
/// [`DEFAULT_GRACE_MS`]), cut to [`FENCED_GRACE_MS`] when fenced.
pub fn stop_grace_ms(job_grace_ms: Option<u64>, fenced: bool) -> u64 {
    let grace = job_grace_ms.unwrap_or(DEFAULT_GRACE_MS);
    if fenced {
        grace.min(FENCED_GRACE_MS)
    } else {
        grace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fenced_stop_cuts_the_grace_period() {
        assert_eq!(stop_grace_ms(Some(30_000), false), 30_000);
        assert_eq!(stop_grace_ms(Some(30_000), true), FENCED_GRACE_MS);
        assert_eq!(stop_grace_ms(Some(100), true), 100, "never longer");
        assert_eq!(stop_grace_ms(None, false), DEFAULT_GRACE_MS);
        assert_eq!(stop_grace_ms(None, true), FENCED_GRACE_MS);
    }
}
