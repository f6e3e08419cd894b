//! A task's files under `STATE_DIR/tasks/` (a directory only the agent's
//! user can enter):
//! - `<key>.json` ([`TaskRecord`]): what to run and how, written once by the
//!   agent before it starts the supervisor, which reads it;
//! - `<key>.pid` ([`PidRecord`]): written by the supervisor once the task
//!   runs (the supervisor's pid, the task's pid and user);
//! - `<key>.stop` ([`StopRequest`]): written by the agent to ask the
//!   supervisor to stop the task (then it wakes the supervisor with SIGUSR1);
//! - `<key>.exit` ([`ExitRecord`]): written by the supervisor when the task
//!   and everything it started are gone.
//!
//! Every file is written through a temporary file and a rename, so a reader
//! never sees half of one.

use super::cgroup::{CgroupPlan, Usage};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Bumped when a field changes meaning; older agents refuse newer files.
pub const FORMAT: u32 = 2;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub format: u32,
    pub allocation: String,
    /// Milliseconds since the Unix epoch.
    pub started_at_ms: u64,
    /// The kernel's boot id when the task started: after a reboot the pid
    /// file's numbers name other processes, if any.
    pub boot_id: Option<String>,
    pub command: Vec<String>,
    /// The task's whole environment.
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<PathBuf>,
    pub gpu_indices: Vec<u32>,
    pub gpu_uuids: Vec<String>,
    /// `TERM`, `INT`, ...
    pub stop_signal: String,
    pub grace_period_ms: u64,
    pub log_path: PathBuf,
    /// The node's fence deadline (milliseconds since the epoch, first word
    /// of the file), kept by the agent: past it the supervisor kills the
    /// task.
    pub fence_file: PathBuf,
    pub cgroup: CgroupPlan,
    pub memory_limit_bytes: Option<u64>,
    /// The most processes and threads the task may have at once.
    #[serde(default)]
    pub pids_max: Option<u64>,
    pub user: UserPlan,
    /// Run in a PID and mount namespace of its own (private `/proc`, `/tmp`
    /// and `/dev/shm`; see `crate::taskinit`). Never for container tasks,
    /// which the engine gives namespaces.
    #[serde(default)]
    pub namespaces: bool,
    /// Run in a container (through the node's Docker engine) instead of on
    /// the node itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<ContainerPlan>,
}

/// How a task runs in a container (see `crate::container`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerPlan {
    pub image: String,
    /// The container's network: `host` (the default: NCCL and a gang's
    /// rendezvous need the node's interfaces), `bridge` or `none`.
    pub network: String,
    /// The size of `/dev/shm` (DataLoader workers and NCCL share memory
    /// through it; Docker's default is 64 MiB).
    pub shm_size_bytes: u64,
    /// GPUs passed through the NVIDIA container runtime (their UUIDs); empty
    /// with simulated GPUs, which have no devices.
    pub gpu_devices: Vec<String>,
    /// The CPU limit, in thousandths of a CPU (`None`: none).
    #[serde(default)]
    pub cpu_milli: Option<u64>,
    /// Credentials for pulling the image (the job's image pull secret:
    /// `USER:PASSWORD` or a JSON object with `username` and `password`).
    /// The record is readable by the agent's user only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_auth: Option<String>,
    /// Host paths bound into the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<ContainerMount>,
}

/// A host path bound into a container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerMount {
    pub source: String,
    pub target: String,
    pub read_only: bool,
}

/// Whom the task runs as (the supervisor switches to it, as root when the
/// agent is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UserPlan {
    /// The job's user: used when it exists on this node and is not root.
    pub job_user: Option<String>,
    /// Otherwise this uid of the agent's task uid range, the task's alone
    /// for its life (see `crate::runtime::uids`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_uid: Option<u32>,
    /// With it, this gid: its user's group (the same on every node, see
    /// `crate::runtime::uids`); `None`: `nogroup`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamic_gid: Option<u32>,
    /// A shared fallback user, in records of agents before task uids (read,
    /// never written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<String>,
    /// The operator allows tasks to run as root on this node.
    pub allow_root: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PidRecord {
    pub supervisor: i32,
    /// The task's leader; it leads its own process group.
    pub pid: i32,
    pub user: String,
    pub uid: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopRequest {
    /// `TERM`, `INT`, ...: sent to every process of the task first.
    pub signal: String,
    /// Then, after this long, everything is killed.
    pub grace_ms: u64,
    /// The node fenced itself (the lease could not be renewed).
    pub fenced: bool,
}

/// How a task ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EndReason {
    /// By itself: its exit code or the signal that ended it.
    Exited,
    /// Stopped on request (cancelled, preempted, no longer wanted).
    Stopped,
    /// Killed because the node's lease ran out (or the node fenced itself).
    Fenced,
    /// The kernel killed a process of the task at its memory limit.
    MemoryLimit,
    /// The command could not be started.
    StartFailed { message: String },
    /// Its supervisor vanished without a word (killed from outside): how
    /// the task ended is not known.
    Lost,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitRecord {
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub reason: EndReason,
    /// The stop's grace period ran out and the task was killed.
    #[serde(default)]
    pub killed_after_grace: bool,
    #[serde(default)]
    pub usage: Usage,
    /// Milliseconds since the epoch.
    pub ended_at_ms: u64,
}

pub fn path(tasks_dir: &Path, key: &str, extension: &str) -> PathBuf {
    tasks_dir.join(format!("{key}.{extension}"))
}

/// Writes `value` as JSON through a temporary file and a rename.
pub fn write_json<T: Serialize>(path: &Path, value: &T) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let text = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    let mut name = path.as_os_str().to_os_string();
    name.push(".tmp");
    let temporary = PathBuf::from(name);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&temporary)?;
    file.write_all(&text)?;
    drop(file);
    std::fs::rename(&temporary, path)
}

/// Reads a JSON file; the error is a sentence for a report.
pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, String> {
    let text = std::fs::read(path).map_err(|error| format!("cannot read it: {error}"))?;
    serde_json::from_slice(&text).map_err(|error| format!("it is not what muster wrote: {error}"))
}

/// Reads a task record and checks its format.
pub fn read_task(path: &Path) -> Result<TaskRecord, String> {
    let value: serde_json::Value = read_json(path)?;
    let format = value.get("format").and_then(serde_json::Value::as_u64);
    if format != Some(u64::from(FORMAT)) {
        return Err(format!(
            "it has format {}, and this agent reads format {FORMAT}; it was written by another \
             version of muster",
            format.map_or("none".to_string(), |f| f.to_string())
        ));
    }
    serde_json::from_value(value).map_err(|error| format!("it is not a task record: {error}"))
}

/// The kernel's boot id, where the host has one.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|id| id.trim().to_string())
        .filter(|id| !id.is_empty())
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
