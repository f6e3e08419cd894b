//! Queues: a team's line, with a guaranteed GPU quota, a borrowing limit and a
//! fair-share weight.

use crate::GpuMilli;
use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct QueueName(pub String);

impl fmt::Display for QueueName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for QueueName {
    fn from(name: &str) -> Self {
        QueueName(name.to_string())
    }
}

/// A queue's quota. A queue may always use its `guaranteed` GPUs (taking them
/// back by preemption from queues that borrowed them), and may borrow idle
/// capacity up to `guaranteed + borrow_limit`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueSpec {
    pub name: QueueName,
    pub guaranteed: GpuMilli,
    /// How much above its guarantee the queue may borrow; `None` is unlimited.
    pub borrow_limit: Option<GpuMilli>,
    /// Fair-share weight (relative; at least 1).
    pub weight: u32,
    /// Jobs of this queue are stopped once their GPUs have been idle this
    /// long (for interactive and notebook queues), as with a job's own
    /// `idle_timeout`; the shorter of the two applies.
    pub idle_timeout: Option<std::time::Duration>,
    /// A running job of this queue counts as idle once all its GPUs have
    /// stayed below `idle_below_pct` this long (`None`: the server's
    /// `--idle-after`, 30 minutes by default).
    pub idle_after: Option<std::time::Duration>,
    /// Below this utilisation (percent) a GPU of this queue's jobs counts
    /// as idle (`None`: 5).
    pub idle_below_pct: Option<u32>,
    /// What the queue may spend on GPUs in a calendar month (UTC).
    pub budget: Option<Budget>,
    /// Whether the queue's members may see (read, not cancel) each other's
    /// jobs; otherwise a user sees only its own.
    pub members_see_jobs: bool,
    /// The most jobs (array elements one each) the queue may have pending;
    /// a submission past it is refused (`None`: no limit of the queue's).
    pub max_pending: Option<u64>,
    /// The highest priority class a user (not an operator or admin) may
    /// submit to the queue (`None`: `normal`); a higher one is refused, not
    /// lowered.
    pub max_priority_class: Option<crate::PriorityClass>,
    /// Users may submit non-preemptible jobs to the queue (operators and
    /// admins always may).
    pub allow_non_preemptible: bool,
}

/// A queue's monthly GPU budget, in hundredths of the price list's currency.
/// Past it the queue is warned of (soft) or, with `hard`, its new jobs wait
/// (pending `budget exhausted`) until the month ends or the budget grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    pub monthly_cents: u64,
    pub hard: bool,
}

impl QueueSpec {
    /// A queue with no guarantee, unlimited borrowing and weight 1.
    pub fn best_effort(name: impl Into<String>) -> Self {
        QueueSpec {
            name: QueueName(name.into()),
            guaranteed: GpuMilli::ZERO,
            borrow_limit: None,
            weight: 1,
            idle_timeout: None,
            idle_after: None,
            idle_below_pct: None,
            budget: None,
            members_see_jobs: false,
            max_pending: None,
            max_priority_class: None,
            allow_non_preemptible: false,
        }
    }

    /// The most GPU capacity this queue may hold at once.
    pub fn ceiling(&self) -> Option<GpuMilli> {
        self.borrow_limit.map(|limit| self.guaranteed + limit)
    }
}
