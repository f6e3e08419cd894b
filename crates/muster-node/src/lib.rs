//! muster's node agent, pure: [`AgentCore`] makes every decision of an
//! agent (registration, heartbeats and their sequence numbers, the lease,
//! fencing, which tasks to start, stop and forget, and in which order) as a
//! state machine with typed inputs and outputs.
//!
//! No tokio, HTTP, clock or processes here: the agent shell
//! (`muster-agent`) and the fault simulation (`muster-sim`) pass values in
//! and carry the outputs out. Depends only on `muster-model`.

mod core;

pub use crate::core::{
    AdoptedTask, AgentCore, CoreConfig, DEFAULT_HEARTBEAT_MS, DEFAULT_LEASE_MS, DesiredTask,
    HEARTBEAT_RETRY_MS, HeartbeatFailure, Input, LeaseRecord, ObservedTask, Output,
    REGISTER_BACKOFF_MAX_MS, REGISTER_BACKOFF_MIN_MS, REQUEST_LIMIT_MS, Report, TaskId,
};
use std::collections::BTreeSet;

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
}

impl TaskExit {
    /// The exit code as the control plane takes it (`None`: no code).
    pub fn code(self) -> Option<i32> {
        match self {
            TaskExit::Code(code) => Some(code),
            TaskExit::Signal(_) | TaskExit::Fenced | TaskExit::Vanished => None,
        }
    }
}

/// An allocation the control plane wants on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Desired {
    pub allocation: u64,
    pub generation: u64,
    pub job: u64,
    /// The control plane wants it stopped.
    pub stop: bool,
}

/// An allocation the agent started (or found again after a restart).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Local {
    pub allocation: u64,
    pub generation: u64,
    /// The job it belongs to; `None` when unknown (a task found again after
    /// a restart whose job could not be read).
    pub job: Option<u64>,
    /// Its process group still runs.
    pub running: bool,
    /// A stop was already issued.
    pub stopping: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Action {
    Start { allocation: u64, generation: u64 },
    Stop { allocation: u64, generation: u64 },
}

/// Whether the node has gone too long without renewing its lease: it must
/// stop its allocations before the control plane's lease runs out and the
/// work is placed elsewhere. `margin_ms` is how much earlier than the lease
/// the node gives up, so that its tasks are gone before the server acts.
pub fn must_fence(now_ms: u64, last_renewal_ms: u64, lease_ms: u64, margin_ms: u64) -> bool {
    now_ms.saturating_sub(last_renewal_ms) + margin_ms >= lease_ms
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

/// The actions that bring what runs here to what is desired. A fenced node
/// stops everything and starts nothing. A task whose generation is not the
/// desired one is stale and is stopped; a desired task is started only once
/// nothing else of its job runs here (no other generation of the allocation,
/// no other attempt of the job, no task of unknown job that is on its way
/// out), so two attempts of a job never overlap on a node.
pub fn reconcile(desired: &[Desired], local: &[Local], fenced: bool) -> Vec<Action> {
    let mut actions = BTreeSet::new();
    let wanted: BTreeSet<(u64, u64)> = desired
        .iter()
        .filter(|d| !d.stop && !fenced)
        .map(|d| (d.allocation, d.generation))
        .collect();
    let job_of: std::collections::BTreeMap<(u64, u64), u64> = desired
        .iter()
        .map(|d| ((d.allocation, d.generation), d.job))
        .collect();
    for task in local {
        if task.running && !task.stopping && !wanted.contains(&(task.allocation, task.generation)) {
            actions.insert(Action::Stop {
                allocation: task.allocation,
                generation: task.generation,
            });
        }
    }
    for &(allocation, generation) in &wanted {
        let known = local
            .iter()
            .any(|t| t.allocation == allocation && t.generation == generation);
        let job = job_of.get(&(allocation, generation)).copied();
        let other_running = local.iter().any(|t| {
            t.running
                && (t.allocation, t.generation) != (allocation, generation)
                && (t.allocation == allocation
                    || (!wanted.contains(&(t.allocation, t.generation))
                        && (t.job.is_none() || t.job == job)))
        });
        if !known && !other_running {
            actions.insert(Action::Start {
                allocation,
                generation,
            });
        }
    }
    actions.into_iter().collect()
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

    fn desired(allocation: u64, generation: u64, stop: bool) -> Desired {
        Desired {
            allocation,
            generation,
            job: allocation * 100,
            stop,
        }
    }

    fn local(allocation: u64, generation: u64, running: bool) -> Local {
        Local {
            allocation,
            generation,
            job: Some(allocation * 100),
            running,
            stopping: false,
        }
    }

    #[test]
    fn a_new_attempt_waits_for_the_old_attempt_of_its_job_to_end() {
        // Allocation 7 (job 100's old attempt) still runs; allocation 9 is
        // the job's new attempt.
        let old = Local {
            job: Some(100),
            ..local(7, 3, true)
        };
        let new = Desired {
            job: 100,
            ..desired(9, 8, false)
        };
        assert_eq!(
            reconcile(&[new], &[old], false),
            vec![Action::Stop {
                allocation: 7,
                generation: 3
            }],
            "stop the old attempt; start the new one only once it is gone"
        );
        let gone = Local {
            running: false,
            ..old
        };
        assert_eq!(
            reconcile(&[new], &[gone], false),
            vec![Action::Start {
                allocation: 9,
                generation: 8
            }]
        );
        // A task of unknown job on its way out holds back starts too.
        let unknown = Local {
            job: None,
            stopping: true,
            ..local(5, 1, true)
        };
        assert!(reconcile(&[new], &[unknown], false).is_empty());
    }

    #[test]
    fn starts_what_is_desired_and_not_running() {
        assert_eq!(
            reconcile(&[desired(1, 5, false)], &[], false),
            vec![Action::Start {
                allocation: 1,
                generation: 5
            }]
        );
    }

    #[test]
    fn an_exited_task_is_not_started_again() {
        assert!(reconcile(&[desired(1, 5, false)], &[local(1, 5, false)], false).is_empty());
    }

    #[test]
    fn stops_what_is_marked_stop_or_unknown_or_stale() {
        let actions = reconcile(
            &[desired(1, 5, true), desired(2, 9, false)],
            &[local(1, 5, true), local(3, 1, true), local(2, 8, true)],
            false,
        );
        assert_eq!(
            actions,
            vec![
                Action::Stop {
                    allocation: 1,
                    generation: 5
                },
                Action::Stop {
                    allocation: 2,
                    generation: 8
                },
                Action::Stop {
                    allocation: 3,
                    generation: 1
                },
            ],
            "the new generation of 2 waits until the stale one is gone"
        );
    }

    #[test]
    fn a_fenced_node_stops_everything_and_starts_nothing() {
        let actions = reconcile(
            &[desired(1, 5, false), desired(2, 6, false)],
            &[local(1, 5, true)],
            true,
        );
        assert_eq!(
            actions,
            vec![Action::Stop {
                allocation: 1,
                generation: 5
            }]
        );
    }

    #[test]
    fn fencing_starts_a_margin_before_the_lease_ends() {
        assert!(!must_fence(10_000, 5_000, 10_000, 2_000));
        assert!(must_fence(13_000, 5_000, 10_000, 2_000));
        assert!(must_fence(20_000, 5_000, 10_000, 2_000));
    }
}
