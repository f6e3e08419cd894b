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

/// Most elements one job array may have.
pub const MAX_ARRAY_ELEMENTS: usize = 10_000;
/// The largest index an array element may have.
pub const MAX_ARRAY_INDEX: u32 = 4_000_000;

/// A job array as submitted (Slurm's `--array`): one element per index, each
/// a job of its own with `MUSTER_ARRAY_INDEX` set; `limit` (`%8`) caps how
/// many run at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArraySpec {
    /// Sorted, each once, at most [`MAX_ARRAY_ELEMENTS`].
    pub indices: Vec<u32>,
    pub limit: Option<u32>,
}

impl ArraySpec {
    /// Reads Slurm's notation: `0-99`, `1,3,5-7`, `0-15:4` (a step), each
    /// optionally followed by `%N` (at most N running at once).
    pub fn parse(text: &str) -> Result<ArraySpec, String> {
        const FORM: &str = "expected indices like 0-99, 1,3,5-7 or 0-15:4, optionally followed \
                            by %N to run at most N at once (e.g. 0-99%8)";
        let text = text.trim();
        let (list, limit) = match text.split_once('%') {
            None => (text, None),
            Some((list, limit)) => match limit.trim().parse::<u32>() {
                Ok(limit) if limit > 0 => (list, Some(limit)),
                _ => {
                    return Err(format!(
                        "the limit after % must be a whole number of at least 1, got {:?}",
                        limit.trim()
                    ));
                }
            },
        };
        let number = |part: &str| -> Result<u32, String> {
            let part = part.trim();
            let value: u32 = part
                .parse()
                .map_err(|_| format!("{part:?} is not an index; {FORM}"))?;
            if value > MAX_ARRAY_INDEX {
                return Err(format!(
                    "index {value} is over the largest allowed, {MAX_ARRAY_INDEX}"
                ));
            }
            Ok(value)
        };
        let mut indices: Vec<u32> = Vec::new();
        if list.trim().is_empty() {
            return Err(format!("no indices; {FORM}"));
        }
        for item in list.split(',') {
            let (range, step) = match item.split_once(':') {
                None => (item, 1),
                Some((range, step)) => match step.trim().parse::<u32>() {
                    Ok(step) if step > 0 => (range, step),
                    _ => {
                        return Err(format!(
                            "the step after : must be a whole number of at least 1, got {:?}",
                            step.trim()
                        ));
                    }
                },
            };
            let (first, last) = match range.split_once('-') {
                None => {
                    let value = number(range)?;
                    (value, value)
                }
                Some((first, last)) => (number(first)?, number(last)?),
            };
            if first > last {
                return Err(format!(
                    "range {}-{} goes backwards; write the smaller index first",
                    first, last
                ));
            }
            let count = (last - first) / step + 1;
            if indices.len() + count as usize > MAX_ARRAY_ELEMENTS {
                return Err(format!(
                    "an array has at most {MAX_ARRAY_ELEMENTS} elements; {text:?} has more"
                ));
            }
            indices.extend((first..=last).step_by(step as usize));
        }
        indices.sort_unstable();
        indices.dedup();
        Ok(ArraySpec { indices, limit })
    }

    /// The number of elements.
    pub fn len(&self) -> usize {
        self.indices.len()
    }

    pub fn is_empty(&self) -> bool {
        self.indices.is_empty()
    }
}

impl fmt::Display for ArraySpec {
    /// Compactly, as [`ArraySpec::parse`] reads it: runs of consecutive
    /// indices as ranges (`0-99%8`, `1,3,5-7`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut position = 0;
        let mut first = true;
        while position < self.indices.len() {
            let start = self.indices[position];
            let mut end = position;
            while end + 1 < self.indices.len() && self.indices[end + 1] == self.indices[end] + 1 {
                end += 1;
            }
            if !first {
                f.write_str(",")?;
            }
            first = false;
            if end == position {
                write!(f, "{start}")?;
            } else {
                write!(f, "{start}-{}", self.indices[end])?;
            }
            position = end + 1;
        }
        if let Some(limit) = self.limit {
            write!(f, "%{limit}")?;
        }
        Ok(())
    }
}

/// What makes a job an element of an array: the array's id (its first
/// element's; the elements have consecutive ids), its index, and the
/// array's size and limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ArrayElement {
    pub array: JobId,
    pub index: u32,
    /// Elements in the array: they are jobs `array` to `array + count - 1`.
    pub count: u32,
    /// At most this many run at once.
    pub limit: Option<u32>,
}

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
    /// Variables whose values are secrets: variable name → secret name
    /// (`env: {HF_TOKEN: {secret: hf}}`). The value is put in only on the
    /// way to the node that runs the task; the spec holds the name.
    pub secrets: BTreeMap<String, String>,
    pub working_dir: Option<String>,
    pub image: Option<String>,
    /// The secret holding the credentials to pull `image` from a private
    /// registry (`USER:PASSWORD`, or a JSON object with `username` and
    /// `password`); like [`JobSpec::secrets`], only its name is kept here.
    pub image_pull_secret: Option<String>,
    /// Host paths a container job's tasks see (the pool must allow them).
    pub mounts: Vec<Mount>,
    pub max_runtime: Option<Duration>,
    pub estimated_runtime: Option<Duration>,
    pub preemptible: bool,
    pub checkpoint: CheckpointPolicy,
    pub retry: RetryPolicy,
    pub topology: Option<TopologyConstraint>,
    /// Jobs that must end first (each once, at most [`MAX_DEPENDENCIES`]).
    pub after: Vec<Dependency>,
    /// Submit as an array: one job per index.
    pub array: Option<ArraySpec>,
    /// Also give tasks the `SLURM_*` variables batch scripts read (what
    /// `muster sbatch` submits).
    pub slurm_env: bool,
    /// Stop the job (state `idle_stopped`) once all its GPUs have stayed
    /// below 5% utilisation this long.
    pub idle_timeout: Option<Duration>,
    /// Set by muster on a service's replicas (never by a submission).
    pub service: Option<crate::service::ServiceRef>,
}

/// The command of a dev environment's job (`muster dev start`): the agent
/// runs its own binary's session helper (`muster dev-session`) in its
/// place, which serves `muster dev shell` and `muster dev forward` through
/// the agent's own connection to the server.
pub const DEV_SESSION_COMMAND: &str = "muster-dev-session";

/// The variable of a dev environment's task that holds its token (the
/// server derives it and puts it there; the session helper checks it).
pub const DEV_TOKEN_VARIABLE: &str = "MUSTER_DEV_TOKEN";

/// Whether `command` is a dev environment's ([`DEV_SESSION_COMMAND`]).
pub fn is_dev_session_command(command: &[String]) -> bool {
    command.len() == 1 && command[0] == DEV_SESSION_COMMAND
}

/// A host path mounted into a container job's tasks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The absolute path on the node.
    pub source: String,
    /// Where the task sees it (absolute, inside the container).
    pub target: String,
    pub read_only: bool,
}

impl JobSpec {
    /// Whether it is a dev environment (its command is
    /// [`DEV_SESSION_COMMAND`]).
    pub fn is_dev_environment(&self) -> bool {
        is_dev_session_command(&self.command)
    }

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
            secrets: BTreeMap::new(),
            working_dir: None,
            image: None,
            image_pull_secret: None,
            mounts: Vec::new(),
            max_runtime: None,
            estimated_runtime: None,
            preemptible: true,
            checkpoint: CheckpointPolicy::default(),
            retry: RetryPolicy::default(),
            topology: None,
            after: Vec::new(),
            array: None,
            slurm_env: false,
            idle_timeout: None,
            service: None,
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

    #[test]
    fn arrays_read_slurm_notation_and_print_compactly() {
        let array = ArraySpec::parse("0-99%8").expect("valid");
        assert_eq!(array.len(), 100);
        assert_eq!(array.limit, Some(8));
        assert_eq!(array.to_string(), "0-99%8");
        let array = ArraySpec::parse("7,1,3-5,3").expect("valid");
        assert_eq!(array.indices, vec![1, 3, 4, 5, 7]);
        assert_eq!(array.to_string(), "1,3-5,7");
        let array = ArraySpec::parse("0-15:4").expect("valid");
        assert_eq!(array.indices, vec![0, 4, 8, 12]);
        assert_eq!(ArraySpec::parse(" 42 ").expect("valid").indices, vec![42]);
        for (bad, says) in [
            ("", "no indices"),
            ("5-1", "backwards"),
            ("0-9%0", "at least 1"),
            ("0-9%x", "at least 1"),
            ("0-9:0", "at least 1"),
            ("a-3", "not an index"),
            ("0-10000", "at most 10000 elements"),
            ("4000001", "largest allowed"),
            ("-3", "not an index"),
        ] {
            let error = ArraySpec::parse(bad).expect_err(bad);
            assert!(error.contains(says), "{bad}: {error}");
        }
        // The bound holds before anything is built: a huge range is refused
        // without allocating it.
        assert!(ArraySpec::parse("0-4000000").is_err());
    }
}
