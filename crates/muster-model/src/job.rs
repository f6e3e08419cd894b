//! A validated job: what a user submitted, with every field checked.

use crate::{CpuMilli, GpuModel, GpuRequest, MemoryMib, PoolName, QueueName};
use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

/// A job's id, assigned by whoever accepts the submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A named priority level. Higher values run first and may preempt lower ones.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PriorityClass {
    pub name: String,
    pub value: i32,
}

impl PriorityClass {
    /// The classes every cluster has, lowest first.
    pub fn builtin() -> [PriorityClass; 4] {
        [
            PriorityClass::new("low", 0),
            PriorityClass::new("normal", 100),
            PriorityClass::new("high", 200),
            PriorityClass::new("critical", 300),
        ]
    }

    pub fn new(name: &str, value: i32) -> Self {
        PriorityClass {
            name: name.to_string(),
            value,
        }
    }

    pub fn normal() -> Self {
        PriorityClass::new("normal", 100)
    }

    /// Looks up a built-in class by name.
    pub fn by_name(name: &str) -> Option<PriorityClass> {
        PriorityClass::builtin()
            .into_iter()
            .find(|class| class.name == name)
    }
}

/// Signals a job may ask to receive before it is stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Signal {
    Term,
    Int,
    Hup,
    Quit,
    Usr1,
    Usr2,
}

impl Signal {
    pub const ALL: [Signal; 6] = [
        Signal::Term,
        Signal::Int,
        Signal::Hup,
        Signal::Quit,
        Signal::Usr1,
        Signal::Usr2,
    ];

    /// The name without the `SIG` prefix, upper-case.
    pub fn name(self) -> &'static str {
        match self {
            Signal::Term => "TERM",
            Signal::Int => "INT",
            Signal::Hup => "HUP",
            Signal::Quit => "QUIT",
            Signal::Usr1 => "USR1",
            Signal::Usr2 => "USR2",
        }
    }

    /// Accepts `TERM`, `SIGTERM`, `term`, ...
    pub fn parse(text: &str) -> Option<Signal> {
        let upper = text.trim().to_ascii_uppercase();
        let bare = upper.strip_prefix("SIG").unwrap_or(&upper);
        Signal::ALL.into_iter().find(|signal| signal.name() == bare)
    }
}

/// How a job is told to stop (preemption, cancellation, time limit): the
/// signal, then a grace period before the process group is killed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointPolicy {
    pub signal: Signal,
    pub grace_period: Duration,
    /// How often the job saves a checkpoint, if it does; work since the last
    /// checkpoint is what a preemption loses.
    pub interval: Option<Duration>,
}

impl Default for CheckpointPolicy {
    fn default() -> Self {
        CheckpointPolicy {
            signal: Signal::Term,
            grace_period: Duration::from_secs(30),
            interval: None,
        }
    }
}

/// What happens when a job's task ends badly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Total attempts, the first included (1 = never retry).
    pub max_attempts: u32,
    /// Re-queue when a node fails under the job (does not use up attempts).
    pub on_node_failure: bool,
    /// Retry when the command exits non-zero (uses up attempts).
    pub on_exit_failure: bool,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            max_attempts: 1,
            on_node_failure: true,
            on_exit_failure: false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum TopologyStrength {
    /// The job is placed only if all its tasks fit in one rack.
    Required,
    /// One rack when possible, otherwise as few racks as possible.
    Preferred,
}

/// Where a gang's tasks may go relative to each other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopologyConstraint {
    pub same_rack: TopologyStrength,
}

/// What a job waits for of another (Slurm's `afterok`, `afterany`,
/// `afternotok`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum DependencyKind {
    /// The other job succeeded (the default).
    Ok,
    /// The other job ended, however.
    Any,
    /// The other job failed, was cancelled or timed out.
    NotOk,
}

impl DependencyKind {
    /// The name in specs and on the command line (`ok`, `any`, `notok`).
    pub fn name(self) -> &'static str {
        match self {
            DependencyKind::Ok => "ok",
            DependencyKind::Any => "any",
            DependencyKind::NotOk => "notok",
        }
    }

    /// Accepts `ok`/`afterok`, `any`/`afterany`, `notok`/`afternotok`.
    pub fn parse(text: &str) -> Option<DependencyKind> {
        match text.strip_prefix("after").unwrap_or(text) {
            "ok" => Some(DependencyKind::Ok),
            "any" => Some(DependencyKind::Any),
            "notok" => Some(DependencyKind::NotOk),
            _ => None,
        }
    }

    /// Whether another job ending as it did (`succeeded` or not) meets
    /// this dependency.
    pub fn met_by(self, succeeded: bool) -> bool {
        match self {
            DependencyKind::Ok => succeeded,
            DependencyKind::Any => true,
            DependencyKind::NotOk => !succeeded,
        }
    }

    /// What the dependent waits for, for pending reasons ("to succeed").
    pub fn waiting_for(self) -> &'static str {
        match self {
            DependencyKind::Ok => "to succeed",
            DependencyKind::Any => "to end",
            DependencyKind::NotOk => "to fail",
        }
    }
}

/// A job that must end (as `kind` says) before this one may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Dependency {
    pub job: JobId,
    pub kind: DependencyKind,
}

impl std::fmt::Display for Dependency {
    /// As specs and the command line write it: `12` (to succeed), `any:12`,
    /// `notok:12`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.kind {
            DependencyKind::Ok => write!(f, "{}", self.job.0),
            kind => write!(f, "{}:{}", kind.name(), self.job.0),
        }
    }
}

/// Most dependencies one job may have.
pub const MAX_DEPENDENCIES: usize = 64;

/// A validated job spec. Built by `muster-api` from YAML or JSON; every field
/// here already satisfies its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobSpec {
    pub name: String,
    pub queue: QueueName,
    /// `None`: any pool the queue may use (the default pool).
    pub pool: Option<PoolName>,
    pub priority_class: PriorityClass,
    /// Number of tasks, one per node.
    pub nodes: u32,
    pub gpus_per_node: GpuRequest,
    /// Empty: any model.
    pub gpu_models: Vec<GpuModel>,
    pub min_gpu_memory: Option<MemoryMib>,
    pub cpu_per_node: CpuMilli,
    pub memory_per_node: MemoryMib,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<String>,
    pub image: Option<String>,
    pub max_runtime: Option<Duration>,
    pub estimated_runtime: Option<Duration>,
    pub preemptible: bool,
    pub checkpoint: CheckpointPolicy,
    pub retry: RetryPolicy,
    pub topology: Option<TopologyConstraint>,
    /// Jobs that must end first (each once, at most [`MAX_DEPENDENCIES`]).
    pub after: Vec<Dependency>,
}

impl JobSpec {
    /// A one-task job with defaults everywhere, for builders and `muster run`.
    pub fn simple(name: &str, queue: &str, gpus: GpuRequest, command: Vec<String>) -> Self {
        JobSpec {
            name: name.to_string(),
            queue: QueueName::from(queue),
            pool: None,
            priority_class: PriorityClass::normal(),
            nodes: 1,
            gpus_per_node: gpus,
            gpu_models: Vec::new(),
            min_gpu_memory: None,
            cpu_per_node: CpuMilli(1000),
            memory_per_node: MemoryMib(1024),
            command,
            env: BTreeMap::new(),
            working_dir: None,
            image: None,
            max_runtime: None,
            estimated_runtime: None,
            preemptible: true,
            checkpoint: CheckpointPolicy::default(),
            retry: RetryPolicy::default(),
            topology: None,
            after: Vec::new(),
        }
    }

    /// GPU capacity of the whole job, in thousandths.
    pub fn total_gpu(&self) -> crate::GpuMilli {
        crate::GpuMilli(self.gpus_per_node.total().0 * self.nodes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signal_names_parse_with_or_without_prefix() {
        assert_eq!(Signal::parse("SIGUSR1"), Some(Signal::Usr1));
        assert_eq!(Signal::parse("term"), Some(Signal::Term));
        assert_eq!(Signal::parse("KILL"), None);
    }
}
