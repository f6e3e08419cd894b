//! Services: long-running replicas of one job template, kept at a count,
//! checked for health, replaced when they fail and updated one at a time.
//!
//! A service's replicas are ordinary one-task jobs whose spec carries a
//! [`ServiceRef`]: the scheduler, the control plane and the agents treat
//! them like any job; the service controller (`muster_control::services`)
//! decides when to start and stop them.

use crate::job::JobSpec;
use std::time::Duration;

/// The most replicas one service may ask for.
pub const MAX_REPLICAS: u32 = 1_000;
/// The longest service name (it becomes part of host names and paths).
pub const MAX_SERVICE_NAME_LENGTH: usize = 63;
/// Revisions a service keeps (the current one included) for rollback.
pub const KEPT_REVISIONS: usize = 10;

/// What marks a job as one of a service's replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceRef {
    pub name: String,
    /// The revision of the service's template it runs (1, 2, ...).
    pub revision: u32,
    /// The port the replica serves on, when the service fixes one; `None`:
    /// the port muster gives the task in `PORT`.
    pub port: Option<u16>,
    pub spread: Spread,
}

/// How a replica is checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProbeAction {
    /// `GET http://REPLICA:PORT{path}` answers 2xx or 3xx in time.
    Http { path: String },
    /// A TCP connection to the replica's port opens in time.
    Tcp,
    /// The command exits 0 in time, run on the replica's node by its
    /// agent, in the replica's cgroup, as its user, with its environment
    /// and working directory.
    Command(Vec<String>),
}

/// A readiness or liveness check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub action: ProbeAction,
    /// Between checks.
    pub period: Duration,
    /// Each check's limit.
    pub timeout: Duration,
    /// Consecutive failures that make it fail.
    pub failure_threshold: u32,
    /// Consecutive successes that make it pass again.
    pub success_threshold: u32,
    /// Before the first check, from the replica's start.
    pub initial_delay: Duration,
}

/// The longest a check may take (the replica's agent runs it; a check that
/// runs longer fails).
pub const MAX_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest autoscaling window: the autoscaler keeps what it wanted over
/// the window, every controller round.
pub const MAX_AUTOSCALE_WINDOW: Duration = Duration::from_secs(3600);

impl Probe {
    /// A check of `action` with the defaults: every 2 s, 1 s each, failing
    /// after 3 failures, passing after 1 success, from the start.
    pub fn new(action: ProbeAction) -> Self {
        Probe {
            action,
            period: Duration::from_secs(2),
            timeout: Duration::from_secs(1),
            failure_threshold: 3,
            success_threshold: 1,
            initial_delay: Duration::ZERO,
        }
    }
}

/// Where replicas go relative to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Spread {
    /// Each on a node of its own when one is free, else with another.
    #[default]
    Nodes,
    /// As `Nodes`, and racks without a replica before racks with one.
    Racks,
}

/// How a new revision replaces the old one's replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpdateStrategy {
    /// Replicas above the count while updating.
    pub max_surge: u32,
    /// Ready replicas below the count while updating.
    pub max_unavailable: u32,
    /// How long a new revision's replica may run without becoming ready
    /// before the rollout is said to be stopped (`None`: the readiness
    /// check's own span, at least 30 s).
    pub progress_deadline: Option<Duration>,
}

impl Default for UpdateStrategy {
    fn default() -> Self {
        UpdateStrategy {
            max_surge: 1,
            max_unavailable: 0,
            progress_deadline: None,
        }
    }
}

/// Waits between replacements of failing replicas: `initial`, doubling at
/// each failure in a row up to `max`; a replica ready for `reset` clears it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RestartBackoff {
    pub initial: Duration,
    pub max: Duration,
}

impl Default for RestartBackoff {
    fn default() -> Self {
        RestartBackoff {
            initial: Duration::from_secs(1),
            max: Duration::from_secs(60),
        }
    }
}

/// What the replica count follows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ScaleMetric {
    /// Requests per second through the gateways, per replica.
    RequestRate(f64),
    /// Requests in flight at the gateways, per replica.
    InFlight(f64),
    /// Mean GPU utilisation of the replicas' GPUs, percent.
    GpuUtilization(f64),
}

/// Replicas between `min_replicas` and `max_replicas`, as many as the
/// metric asks; fewer only once the metric has asked for no more for the
/// whole `window` (stabilisation). `min_replicas: 0` scales to zero (the
/// gateway holds the first request until a replica is ready).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Autoscale {
    pub min_replicas: u32,
    pub max_replicas: u32,
    pub metric: ScaleMetric,
    pub window: Duration,
}

/// A validated service spec.
#[derive(Debug, Clone, PartialEq)]
pub struct ServiceSpec {
    pub name: String,
    pub replicas: u32,
    /// What each replica runs: a one-task job (its name is the service's).
    pub template: JobSpec,
    /// A fixed port every replica serves on (then at most one replica a
    /// node); `None`: each gets its own in `PORT`.
    pub port: Option<u16>,
    pub readiness: Option<Probe>,
    pub liveness: Option<Probe>,
    pub update: UpdateStrategy,
    pub spread: Spread,
    pub restart: RestartBackoff,
    /// How long a replica is out of the endpoints before it is stopped
    /// (requests in flight finish; clients stop picking it).
    pub drain: Duration,
    /// `None`: `replicas` replicas, set by hand (`muster services scale`).
    pub autoscale: Option<Autoscale>,
    /// Requests through the gateway must carry `Authorization: Bearer
    /// VALUE` of this secret (its name; `None`: anyone may call).
    pub bearer_secret: Option<String>,
}

impl ServiceSpec {
    /// Whether `other` runs differently (a new revision), as opposed to
    /// differing only in what the controller reads (count, checks,
    /// strategy).
    pub fn template_differs(&self, other: &ServiceSpec) -> bool {
        self.template != other.template || self.port != other.port
    }
}
