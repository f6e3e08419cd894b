//! The process runtime: runs each task under a supervisor on this host.
//!
//! A task is started as `SUPERVISOR supervise STATE_DIR KEY` (the `muster`
//! binary itself, by absolute path; see [`crate::supervise`]): the
//! supervisor puts the task in a cgroup of its own (see [`cgroup`]), drops to
//! the task's user, runs the command, enforces the node's fence deadline
//! even when the agent is dead or hung, kills everything the task left when
//! it ends, and writes how it ended. The agent talks to it only through
//! files in its state directory, which tasks cannot reach.
//!
//! Layout of the state directory (mode 0700, like `logs/` and `tasks/`):
//! - `logs/<key>.log` (mode 0600): the task's stdout and stderr, both
//!   appended to this one file;
//! - `tasks/<key>.{json,pid,stop,exit}`: see [`record`];
//! - `fence_at`: the node's fence deadline ([`ProcessRuntime::set_fence_deadline`]);
//! - `supervisor.log`: what supervisors print on stderr (their errors; at
//!   most about 1 MiB, then started anew).
//!
//! Exits are reported on a channel: [`ProcessRuntime::next_exit`] waits for
//! the next one (the agent's main loop selects on it), for tasks this
//! runtime started and for running tasks a [`recover`](ProcessRuntime::recover)
//! found. A task's files stay after it exits until
//! [`forget`](ProcessRuntime::forget), so an exit seen just before an agent
//! crash is not lost.
//!
//! The task's environment is not the agent's (which may hold the node's join
//! token): it is a short allowlist taken from the agent ([`PASSED_THROUGH`],
//! `PATH` with a default), then the launch's `env`, then the GPU variables,
//! which the launch cannot override: `CUDA_VISIBLE_DEVICES` and
//! `NVIDIA_VISIBLE_DEVICES` (the GPU indices, comma-separated; empty for no
//! GPU, so CUDA sees none), `CUDA_DEVICE_ORDER=PCI_BUS_ID` (so CUDA numbers
//! GPUs as NVML does) and `MUSTER_GPU_UUIDS`. `HOME`, `USER` and `LOGNAME`
//! are the task user's (set by the supervisor) unless the job sets them.

pub mod cgroup;
mod group;
pub mod ports;
pub(crate) mod record;
pub mod uids;

pub use cgroup::{CgroupChoice, CgroupPlan, Usage};
pub(crate) use group::to_nix;
pub use record::EndReason;

use muster_model::{Signal, Time};
use record::{ExitRecord, PidRecord, StopRequest, TaskRecord, UserPlan};
use std::collections::BTreeMap;
use std::io::SeekFrom;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncSeekExt};
use tokio::sync::{mpsc, watch};

/// Variables passed from the agent's environment to every task.
pub const PASSED_THROUGH: &[&str] = &["LANG", "LC_ALL", "LD_LIBRARY_PATH", "PATH", "TMPDIR", "TZ"];

/// `PATH` when the agent has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long a stop may take past its grace period before the agent kills
/// the task's cgroup itself (the supervisor kills within milliseconds).
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How long a supervisor may take to start its task.
const START_WAIT: Duration = Duration::from_secs(10);

/// How often to look at a task whose supervisor is not this process's child
/// (a recovered task's).
const POLL_INTERVAL: Duration = Duration::from_millis(100);

/// The most `supervisor.log` grows before it is started anew.
const SUPERVISOR_LOG_BYTES: u64 = 1 << 20;

/// Longest allocation id accepted.
const MAX_ALLOCATION_LEN: usize = 128;

/// How tasks run on this node.
#[derive(Debug, Clone)]
pub struct RuntimeConfig {
    pub state_dir: PathBuf,
    /// The program started as `PROGRAM supervise STATE_DIR KEY` for each
    /// task: the `muster` binary, by absolute path.
    pub supervisor: PathBuf,
    pub cgroups: CgroupPlan,
    /// The uids tasks get, one each, when the job's user has no account
    /// here (the agent runs as root); `None`: the agent is not root, and
    /// tasks run as its own user.
    pub task_uids: Option<uids::UidRange>,
    /// Each task in a PID and mount namespace of its own (the host allows
    /// it; see [`crate::taskinit`]).
    pub namespaces: bool,
    /// Tasks may run as root (the job's user is root).
    pub allow_root: bool,
    /// The most processes and threads one task may have at once, where the
    /// node has a pids controller (`None`: no limit).
    pub task_pids_max: Option<u64>,
    /// A container task's GPUs go through the NVIDIA container runtime
    /// (real GPUs); off with simulated ones.
    pub container_gpus: bool,
    /// Containers' network: `host` (the default), `bridge` or `none`.
    pub container_network: String,
    /// Containers' `/dev/shm` (`None`: half the task's memory limit, or
    /// [`DEFAULT_SHM_BYTES`] without one).
    pub container_shm_bytes: Option<u64>,
}

/// The most [`RuntimeConfig::task_pids_max`] is by default: far above
/// what a training job's workers and threads need (a DataLoader with 32
/// workers of 64 threads is 2,048), far below a node's `pid_max`.
pub const DEFAULT_TASK_PIDS_MAX: u64 = 4_096;

/// [`RuntimeConfig::task_pids_max`] unless the operator says otherwise:
/// [`DEFAULT_TASK_PIDS_MAX`], and never above a quarter of the host's
/// `pid_max` (so four tasks' fork bombs still leave the host pids).
pub fn default_task_pids_max(host_pid_max: Option<u64>) -> u64 {
    match host_pid_max {
        Some(max) => DEFAULT_TASK_PIDS_MAX.min((max / 4).max(64)),
        None => DEFAULT_TASK_PIDS_MAX,
    }
}

/// The host's `pid_max`.
pub fn host_pid_max() -> Option<u64> {
    std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .ok()?
        .trim()
        .parse()
        .ok()
}

impl RuntimeConfig {
    /// No cgroups, no namespaces, tasks in the default uid range (when run
    /// as root).
    pub fn new(state_dir: PathBuf, supervisor: PathBuf) -> Self {
        RuntimeConfig {
            state_dir,
            supervisor,
            cgroups: CgroupPlan::None,
            task_uids: crate::supervise::running_as_root().then(|| {
                uids::UidRange::parse(uids::DEFAULT_TASK_UID_RANGE)
                    .unwrap_or_else(|_| unreachable!("the default range parses"))
            }),
            namespaces: false,
            allow_root: false,
            task_pids_max: Some(default_task_pids_max(host_pid_max())),
            container_gpus: false,
            container_network: "host".to_string(),
            container_shm_bytes: None,
        }
    }
}

/// What to run for one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskLaunch {
    /// The allocation's id; names the task's files, so it must be
    /// filesystem-safe: letters, digits, `-`, `_` and `.`, not starting with
    /// `.`, at most 128 bytes.
    pub allocation: String,
    /// The program and its arguments; the program is looked up in `PATH`.
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    /// `None`: the agent's working directory.
    pub working_dir: Option<PathBuf>,
    pub gpu_indices: Vec<u32>,
    pub gpu_uuids: Vec<String>,
    /// What [`ProcessRuntime::stop`] sends first when the caller has no
    /// better idea (kept in the record for recovered tasks).
    pub stop_signal: Signal,
    pub grace_period: Duration,
    /// The job's user: the task runs as this user when it exists here.
    pub user: Option<String>,
    /// The number of the user's group (the same on every node): without
    /// an account here, the task runs in group FIRST+N of the task uid
    /// range (see [`uids::UidRange::group`]).
    pub user_group: Option<u32>,
    /// The task's memory limit (the job's memory per node), where the node's
    /// cgroups can hold one.
    pub memory_limit_mib: Option<u64>,
    /// The container image to run in (`None`: on the node itself).
    pub image: Option<String>,
    /// The job's CPUs, in thousandths: a container's CPU limit (processes
    /// on the node are not limited).
    pub cpu_milli: Option<u64>,
    /// Credentials to pull the image with (`USER:PASSWORD` or JSON).
    pub registry_auth: Option<String>,
    /// Host paths a container sees: (source, target, read only).
    pub mounts: Vec<(String, String, bool)>,
}

/// A task's files besides its record (`KEY.json`): removed before it starts
/// and when it is forgotten, so none outlives its task. `pull` and `oom`
/// are a container task's (see `crate::container`).
const TRANSIENT_FILES: [&str; 6] = ["exit", "pid", "stop", "pull", "pull.tmp", "oom"];

/// The most pulls a heartbeat reports.
pub const MAX_PULLING: usize = 64;

/// A container's `/dev/shm` when the task has no memory limit: 8 GiB (a
/// tmpfs takes memory only as it is written).
pub const DEFAULT_SHM_BYTES: u64 = 8 << 30;

/// A task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskExit {
    pub allocation: String,
    /// The exit code, when the task exited by itself.
    pub exit_code: Option<i32>,
    /// The signal number, when a signal ended it.
    pub signal: Option<i32>,
    pub reason: EndReason,
    pub usage: Usage,
}

impl TaskExit {
    fn from_record(allocation: &str, record: ExitRecord) -> Self {
        TaskExit {
            allocation: allocation.to_string(),
            exit_code: record.exit_code,
            signal: record.signal,
            reason: record.reason,
            usage: record.usage,
        }
    }

    fn lost(allocation: &str) -> Self {
        TaskExit {
            allocation: allocation.to_string(),
            exit_code: None,
            signal: None,
            reason: EndReason::Lost,
            usage: Usage::default(),
        }
    }
}

/// How a stop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopOutcome {
    /// The task exited within the grace period (anything left of it was
    /// then killed).
    Exited,
    /// The grace period ran out; the task was killed.
    Killed,
    /// Nothing was running.
    NotRunning,
}

/// A task found in the state directory by [`ProcessRuntime::recover`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredTask {
    pub allocation: String,
    /// The task's leader (0 when it never started).
    pub pid: i32,
    pub pgid: i32,
    pub started_at: Time,
    pub command: Vec<String>,
    pub gpu_indices: Vec<u32>,
    pub gpu_uuids: Vec<String>,
    pub stop_signal: Signal,
    pub grace_period: Duration,
    pub status: RecoveredStatus,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecoveredStatus {
    /// Its supervisor still runs; its exit will come through
    /// [`ProcessRuntime::next_exit`].
    Running,
    /// It ended, and nobody has called `forget` since.
    Exited(TaskExit),
    /// Its supervisor is gone (or the host rebooted since) without an exit
    /// record; whatever was left of the task has been killed.
    Gone,
}

/// Everything a recovery found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Ordered by allocation.
    pub tasks: Vec<RecoveredTask>,
    /// Records that could not be read, with why; left in place.
    pub unreadable: Vec<(PathBuf, String)>,
}

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(
        "invalid allocation id `{allocation}`: {reason}; use at most 128 letters, digits, `-`, `_` and `.`, not starting with `.`"
    )]
    InvalidAllocation { allocation: String, reason: String },
    #[error("allocation {allocation} has an empty command; give at least the program to run")]
    EmptyCommand { allocation: String },
    #[error(
        "cannot start allocation {allocation}: working directory `{}` does not exist or is not a directory; create it or change the job's working_dir",
        path.display()
    )]
    WorkingDir { allocation: String, path: PathBuf },
    #[error("allocation {allocation} is already running (supervisor {pid}); stop it first")]
    AlreadyRunning { allocation: String, pid: i32 },
    #[error("cannot start allocation {allocation}: {message}")]
    Start { allocation: String, message: String },
    #[error(
        "cannot use the agent state at `{}`: {source}; check that the state directory is writable",
        path.display()
    )]
    State {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no task for allocation {allocation} on this node")]
    NotFound { allocation: String },
    #[error("allocation {allocation} is still running; stop it before forgetting it")]
    StillRunning { allocation: String },
    #[error(
        "refusing to signal process group {pgid}: it cannot be a task's (the pid file may be damaged)"
    )]
    InvalidProcessGroup { pgid: i32 },
    #[error("no log for allocation {allocation} at `{}`", path.display())]
    NoLog { allocation: String, path: PathBuf },
}

/// A task whose exit this runtime watches.
#[derive(Debug)]
struct Watched {
    exit: watch::Receiver<Option<TaskExit>>,
}

/// A start under way ([`ProcessRuntime::begin_start`]): dropping it ends
/// the mark and wakes whoever waits for the start.
struct Starting<'a> {
    runtime: &'a ProcessRuntime,
    allocation: String,
    _done: watch::Sender<()>,
}

impl Drop for Starting<'_> {
    fn drop(&mut self) {
        self.runtime.lock_starting().remove(&self.allocation);
    }
}

/// Runs tasks under supervisors, with their state under one directory.
#[derive(Debug)]
pub struct ProcessRuntime {
    config: RuntimeConfig,
    tasks: Mutex<BTreeMap<String, Watched>>,
    /// The allocations being started, each with a channel that closes once
    /// its start is done: starts of different allocations run at once, a
    /// second start of one is refused, and a stop waits for the start.
    starting: Mutex<BTreeMap<String, watch::Receiver<()>>>,
    exits_sender: mpsc::UnboundedSender<TaskExit>,
    exits: tokio::sync::Mutex<mpsc::UnboundedReceiver<TaskExit>>,
    /// The fence deadline last written.
    fence_deadline: Mutex<Option<u64>>,
    /// Which task holds which uid of the range (`None`: not root).
    uids: std::sync::Arc<Mutex<Option<uids::UidPool>>>,
}

fn state_error(path: &Path) -> impl Fn(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::State {
        path: path.to_path_buf(),
        source,
    }
}

/// Creates `dir` (and its parents) and makes it private to the agent's user.
fn private_dir(dir: &Path) -> Result<(), RuntimeError> {
    std::fs::create_dir_all(dir).map_err(state_error(dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(state_error(dir))
}

/// Whether `pid` is the supervisor of `key` (and not a process that reused
/// its pid).
fn is_supervisor(pid: i32, key: &str) -> bool {
    if pid <= 1 {
        return false;
    }
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
        return false;
    };
    let arguments: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = stat
        .rsplit_once(')')
        .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
    !zombie && arguments.contains(&b"supervise".as_slice()) && arguments.contains(&key.as_bytes())
}

impl ProcessRuntime {
    pub fn new(config: RuntimeConfig) -> Self {
        let (exits_sender, exits) = mpsc::unbounded_channel();
        ProcessRuntime {
            tasks: Mutex::new(BTreeMap::new()),
            starting: Mutex::new(BTreeMap::new()),
            exits_sender,
            exits: tokio::sync::Mutex::new(exits),
            fence_deadline: Mutex::new(None),
            uids: std::sync::Arc::new(Mutex::new(config.task_uids.map(|range| {
                uids::UidPool::new(range, Some(config.state_dir.join("uid_cursor")))
            }))),
            config,
        }
    }

    fn lock_uids(&self) -> std::sync::MutexGuard<'_, Option<uids::UidPool>> {
        self.uids.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The uid of the agent's range that task `allocation` holds, if any.
    pub fn task_uid(&self, allocation: &str) -> Option<u32> {
        self.lock_uids().as_ref()?.held_by(allocation)
    }

    /// A uid for the task when its job's user has no account here (and the
    /// agent is root): the task's own, until it and its processes are gone.
    fn task_uid_for(&self, launch: &TaskLaunch) -> Result<Option<u32>, RuntimeError> {
        let plan = UserPlan {
            job_user: launch.user.clone(),
            dynamic_uid: None,
            dynamic_gid: None,
            fallback: None,
            allow_root: self.config.allow_root,
        };
        let mut pool = self.lock_uids();
        let Some(pool) = pool.as_mut() else {
            return Ok(None);
        };
        if crate::supervise::job_account(&plan, crate::supervise::lookup_user).is_some() {
            return Ok(None);
        }
        let running = uids::uids_running();
        match pool.allocate(&launch.allocation, &running) {
            Some(uid) => Ok(Some(uid)),
            None => Err(RuntimeError::Start {
                allocation: launch.allocation.clone(),
                message: format!(
                    "every uid of the task uid range {} is held by a running task or used by a \
                     process; widen --task-uid-range",
                    pool.range()
                ),
            }),
        }
    }

    /// The gid of user group `number` on this node (`None`: no task uid
    /// range, or the number is past it).
    pub fn task_gid(&self, number: Option<u32>) -> Option<u32> {
        self.config.task_uids?.group(number?)
    }

    pub fn state_dir(&self) -> &Path {
        &self.config.state_dir
    }

    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Where the task's output goes (stdout and stderr together).
    pub fn log_path(&self, allocation: &str) -> PathBuf {
        self.config
            .state_dir
            .join("logs")
            .join(format!("{allocation}.log"))
    }

    fn tasks_dir(&self) -> PathBuf {
        self.config.state_dir.join("tasks")
    }

    fn file(&self, allocation: &str, extension: &str) -> PathBuf {
        record::path(&self.tasks_dir(), allocation, extension)
    }

    fn fence_file(&self) -> PathBuf {
        self.config.state_dir.join("fence_at")
    }

    /// Sets the node's fence deadline (milliseconds since the epoch): every
    /// supervisor kills its task once it has passed. Call it each time the
    /// lease is renewed, before the first start. Supervisors read the file
    /// when the deadline they know is reached; a deadline moved earlier (a
    /// shorter lease) wakes them at once.
    pub fn set_fence_deadline(&self, deadline_ms: u64) -> Result<(), RuntimeError> {
        private_dir(&self.config.state_dir)?;
        let path = self.fence_file();
        let earlier = {
            let mut last = self
                .fence_deadline
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let earlier = last.is_none_or(|last| deadline_ms < last);
            *last = Some(deadline_ms);
            earlier
        };
        let temporary = path.with_extension("tmp");
        std::fs::write(&temporary, format!("{deadline_ms}\n")).map_err(state_error(&temporary))?;
        std::fs::rename(&temporary, &path).map_err(state_error(&path))?;
        if earlier {
            self.wake_supervisors();
        }
        Ok(())
    }

    /// Sends SIGUSR1 (a wake-up) to every running supervisor of this node.
    fn wake_supervisors(&self) {
        let Ok(entries) = std::fs::read_dir(self.tasks_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.extension().is_none_or(|e| e != "pid") {
                continue;
            }
            let Some(key) = path.file_stem().and_then(|s| s.to_str()) else {
                continue;
            };
            if let Ok(pids) = record::read_json::<PidRecord>(&path)
                && is_supervisor(pids.supervisor, key)
            {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pids.supervisor),
                    nix::sys::signal::Signal::SIGUSR1,
                );
            }
        }
    }

    /// Starts the task, with the clock read now as its start time.
    /// The tasks whose container image is being pulled (their helper keeps
    /// `tasks/KEY.pull` while it pulls), with the pull's progress: at most
    /// [`MAX_PULLING`], each line at most 512 bytes.
    pub fn pulling(&self) -> Vec<(String, String)> {
        let keys: Vec<String> = self.lock_tasks().keys().cloned().collect();
        keys.into_iter()
            .filter_map(|key| {
                let text = std::fs::read_to_string(self.file(&key, "pull")).ok()?;
                let mut status = text.trim().to_string();
                muster_model::truncate_at_char_boundary(&mut status, 512);
                Some((key, status))
            })
            .take(MAX_PULLING)
            .collect()
    }

    pub async fn start(&self, launch: TaskLaunch) -> Result<(), RuntimeError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        self.start_at(launch, Time(now)).await
    }

    /// Starts the task under a supervisor; `started_at` goes into its record.
    /// Returns once the command runs; its exit comes later through
    /// [`next_exit`](Self::next_exit). A command that cannot be started is
    /// an error (and its log says why).
    pub async fn start_at(&self, launch: TaskLaunch, started_at: Time) -> Result<(), RuntimeError> {
        check_allocation(&launch.allocation)?;
        let allocation = launch.allocation.clone();
        if launch.command.is_empty() {
            return Err(RuntimeError::EmptyCommand { allocation });
        }
        if let Some(path) = launch
            .working_dir
            .as_ref()
            .filter(|_| launch.image.is_none())
        {
            let is_dir = tokio::fs::metadata(path)
                .await
                .is_ok_and(|metadata| metadata.is_dir());
            if !is_dir {
                return Err(RuntimeError::WorkingDir {
                    allocation,
                    path: path.clone(),
                });
            }
        }
        let _starting = self.begin_start(&allocation)?;
        self.check_not_running(&allocation)?;
        // A port it will listen on, taken by a neighbour: said now, not
        // as a crash later.
        ports::check_free(&launch.env).map_err(|message| RuntimeError::Start {
            allocation: allocation.clone(),
            message,
        })?;
        private_dir(&self.config.state_dir)?;
        private_dir(&self.config.state_dir.join("logs"))?;
        private_dir(&self.tasks_dir())?;
        for extension in TRANSIENT_FILES {
            let path = self.file(&allocation, extension);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(RuntimeError::State { path, source }),
            }
        }
        let dynamic_uid = self.task_uid_for(&launch)?;
        let dynamic_gid = dynamic_uid.and(self.task_gid(launch.user_group));
        if dynamic_uid.is_some() && dynamic_gid.is_none() {
            tracing::warn!(
                allocation = %allocation,
                group = ?launch.user_group,
                "the task's user has no group number within the task uid range: it runs in \
                 nogroup, and a later run of its job cannot write the files this one makes"
            );
        }
        let record = TaskRecord {
            format: record::FORMAT,
            allocation: allocation.clone(),
            started_at_ms: started_at.0,
            boot_id: record::boot_id(),
            command: launch.command.clone(),
            env: match &launch.image {
                None => task_environment(&launch, |name| std::env::var(name).ok()),
                // Nothing of the node's: the image's own PATH and HOME.
                Some(_) => {
                    let mut env = task_environment(&launch, |_| None);
                    env.remove("PATH");
                    env
                }
            },
            working_dir: launch.working_dir.clone(),
            gpu_indices: launch.gpu_indices.clone(),
            gpu_uuids: launch.gpu_uuids.clone(),
            stop_signal: launch.stop_signal.name().to_string(),
            grace_period_ms: launch.grace_period.as_millis() as u64,
            log_path: self.log_path(&allocation),
            fence_file: self.fence_file(),
            cgroup: self.config.cgroups.clone(),
            memory_limit_bytes: launch.memory_limit_mib.map(|mib| mib << 20),
            pids_max: self.config.task_pids_max,
            user: UserPlan {
                job_user: launch.user.clone(),
                dynamic_uid,
                dynamic_gid,
                fallback: None,
                allow_root: self.config.allow_root,
            },
            namespaces: self.config.namespaces && launch.image.is_none(),
            container: launch.image.as_ref().map(|image| record::ContainerPlan {
                image: image.clone(),
                network: self.config.container_network.clone(),
                shm_size_bytes: self.config.container_shm_bytes.unwrap_or_else(|| {
                    launch
                        .memory_limit_mib
                        .map_or(DEFAULT_SHM_BYTES, |mib| (mib << 20) / 2)
                }),
                cpu_milli: launch.cpu_milli,
                registry_auth: launch.registry_auth.clone(),
                mounts: launch
                    .mounts
                    .iter()
                    .map(|(source, target, read_only)| record::ContainerMount {
                        source: source.clone(),
                        target: target.clone(),
                        read_only: *read_only,
                    })
                    .collect(),
                gpu_devices: if self.config.container_gpus {
                    launch.gpu_uuids.clone()
                } else {
                    Vec::new()
                },
            }),
        };
        let record_path = self.file(&allocation, "json");
        let started = self
            .run_supervisor(&allocation, &record_path, &record)
            .await;
        if started.is_err() {
            self.release_uid(&allocation);
        }
        started
    }

    /// Gives a task's uid back: it and every process of it are gone.
    fn release_uid(&self, allocation: &str) {
        if let Some(pool) = self.lock_uids().as_mut() {
            pool.release(allocation);
        }
    }

    /// Writes the task's record, starts its supervisor and waits until it
    /// says the task runs.
    async fn run_supervisor(
        &self,
        allocation: &str,
        record_path: &Path,
        record: &TaskRecord,
    ) -> Result<(), RuntimeError> {
        let allocation = allocation.to_string();
        record::write_json(record_path, record).map_err(state_error(record_path))?;

        // Supervisors' stderr (only their errors), bounded: started anew once
        // it passes SUPERVISOR_LOG_BYTES.
        let supervisor_log = self.config.state_dir.join("supervisor.log");
        let full = std::fs::metadata(&supervisor_log)
            .is_ok_and(|metadata| metadata.len() > SUPERVISOR_LOG_BYTES);
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(!full)
            .truncate(full)
            .open(&supervisor_log)
            .map_err(state_error(&supervisor_log))?;
        let mut child = tokio::process::Command::new(&self.config.supervisor)
            .arg("supervise")
            .arg(&self.config.state_dir)
            .arg(&allocation)
            .env_clear()
            // Where the Docker engine is, for container tasks (the agent
            // found it there).
            .envs(
                std::env::var("DOCKER_HOST")
                    .ok()
                    .map(|host| ("DOCKER_HOST", host)),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(false)
            .spawn()
            .map_err(|error| RuntimeError::Start {
                allocation: allocation.clone(),
                message: format!(
                    "cannot run the supervisor {}: {error}",
                    self.config.supervisor.display()
                ),
            })?;
        let Some(stdout) = child.stdout.take() else {
            return Err(RuntimeError::Start {
                allocation,
                message: "the supervisor has no stdout".to_string(),
            });
        };
        let mut line = String::new();
        let mut reader = tokio::io::BufReader::new(stdout);
        let read = tokio::time::timeout(START_WAIT, reader.read_line(&mut line)).await;
        let line = line.trim();
        if !matches!(read, Ok(Ok(n)) if n > 0) || !line.starts_with("started ") {
            let message = match line.strip_prefix("failed ") {
                Some(message) => message.to_string(),
                None => format!(
                    "the supervisor did not start the task (see {})",
                    supervisor_log.display()
                ),
            };
            let _ = child.start_kill();
            let _ = child.wait().await;
            // A supervisor too slow to say so may have started the task.
            kill_remains(
                &self.file(&allocation, "pid"),
                &self.config.cgroups.task(&allocation),
            )
            .await;
            return Err(RuntimeError::Start {
                allocation,
                message,
            });
        }

        let (exit_sender, exit_receiver) = watch::channel(None);
        let exits = self.exits_sender.clone();
        let exit_path = self.file(&allocation, "exit");
        let cgroup = self.config.cgroups.task(&allocation);
        let pid_path = self.file(&allocation, "pid");
        let key = allocation.clone();
        let uids = self.uids.clone();
        tokio::spawn(async move {
            let _ = child.wait().await;
            let exit = supervisor_ended(&key, &exit_path, &pid_path, &cgroup).await;
            release(&uids, &key);
            let _ = exit_sender.send(Some(exit.clone()));
            let _ = exits.send(exit);
        });
        self.lock_tasks().insert(
            allocation,
            Watched {
                exit: exit_receiver,
            },
        );
        Ok(())
    }

    /// Marks `allocation` as being started until the guard drops; errors
    /// when it is already.
    fn begin_start(&self, allocation: &str) -> Result<Starting<'_>, RuntimeError> {
        let mut starting = self.lock_starting();
        if starting.contains_key(allocation) {
            return Err(RuntimeError::AlreadyRunning {
                allocation: allocation.to_string(),
                pid: 0,
            });
        }
        let (done, waiting) = watch::channel(());
        starting.insert(allocation.to_string(), waiting);
        Ok(Starting {
            runtime: self,
            allocation: allocation.to_string(),
            _done: done,
        })
    }

    /// Waits until a start of `allocation` under way (if any) is done.
    async fn start_done(&self, allocation: &str) {
        let waiting = self.lock_starting().get(allocation).cloned();
        if let Some(mut waiting) = waiting {
            // Closed (an error) once the start's guard is dropped.
            while waiting.changed().await.is_ok() {}
        }
    }

    fn lock_starting(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, watch::Receiver<()>>> {
        self.starting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Errors when the allocation runs, here or (after a restart) from a
    /// previous agent's start.
    fn check_not_running(&self, allocation: &str) -> Result<(), RuntimeError> {
        if let Some(task) = self.lock_tasks().get(allocation)
            && task.exit.borrow().is_none()
        {
            return Err(RuntimeError::AlreadyRunning {
                allocation: allocation.to_string(),
                pid: 0,
            });
        }
        if let Ok(pids) = record::read_json::<PidRecord>(&self.file(allocation, "pid"))
            && is_supervisor(pids.supervisor, allocation)
        {
            return Err(RuntimeError::AlreadyRunning {
                allocation: allocation.to_string(),
                pid: pids.supervisor,
            });
        }
        Ok(())
    }

    fn lock_tasks(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Watched>> {
        self.tasks.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits for the next task of this runtime to exit. Exits are queued, so
    /// none is missed between calls; with nothing running it waits forever
    /// (select on it alongside other work).
    pub async fn next_exit(&self) -> TaskExit {
        let mut exits = self.exits.lock().await;
        match exits.recv().await {
            Some(exit) => exit,
            // Unreachable while `self` holds a sender.
            None => std::future::pending().await,
        }
    }

    /// The next queued exit, if one is waiting.
    pub fn try_next_exit(&self) -> Option<TaskExit> {
        self.exits.try_lock().ok()?.try_recv().ok()
    }

    /// Stops the task: its supervisor sends `signal` to every process of
    /// the task, waits up to `grace` for the task to exit, then kills all of
    /// them. Works for tasks this runtime started and for running tasks
    /// found by [`recover`](Self::recover).
    pub async fn stop(
        &self,
        allocation: &str,
        signal: Signal,
        grace: Duration,
    ) -> Result<StopOutcome, RuntimeError> {
        self.stop_as(allocation, signal, grace, false).await
    }

    /// [`stop`](Self::stop), saying whether the node fenced itself (the
    /// task's end is then reported as fenced).
    pub async fn stop_as(
        &self,
        allocation: &str,
        signal: Signal,
        grace: Duration,
        fenced: bool,
    ) -> Result<StopOutcome, RuntimeError> {
        check_allocation(allocation)?;
        // A stop that comes while the task is being started acts on it once
        // it runs (or finds that it never did).
        self.start_done(allocation).await;
        let watched = self
            .lock_tasks()
            .get(allocation)
            .map(|task| task.exit.clone());
        if watched.as_ref().is_some_and(|exit| exit.borrow().is_some())
            || self.file(allocation, "exit").exists()
        {
            return Ok(StopOutcome::NotRunning);
        }
        let pid_path = self.file(allocation, "pid");
        let pids = match record::read_json::<PidRecord>(&pid_path) {
            Ok(pids) => pids,
            Err(_) if watched.is_none() => {
                return Err(RuntimeError::NotFound {
                    allocation: allocation.to_string(),
                });
            }
            Err(_) => return Ok(StopOutcome::NotRunning),
        };
        let request = StopRequest {
            signal: signal.name().to_string(),
            grace_ms: grace.as_millis() as u64,
            fenced,
        };
        let stop_path = self.file(allocation, "stop");
        record::write_json(&stop_path, &request).map_err(state_error(&stop_path))?;
        if is_supervisor(pids.supervisor, allocation) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pids.supervisor),
                nix::sys::signal::Signal::SIGUSR1,
            );
        } else if watched.is_none() {
            // Its supervisor is gone: the agent kills what is left.
            kill_remains(&pid_path, &self.config.cgroups.task(allocation)).await;
            return Ok(StopOutcome::NotRunning);
        }
        let limit = grace + KILL_WAIT;
        let exit_path = self.file(allocation, "exit");
        let ended = match watched {
            Some(mut exit) => tokio::time::timeout(limit, exit.wait_for(Option::is_some))
                .await
                .is_ok(),
            None => {
                let deadline = tokio::time::Instant::now() + limit;
                loop {
                    if exit_path.exists() || !is_supervisor(pids.supervisor, allocation) {
                        break true;
                    }
                    if tokio::time::Instant::now() >= deadline {
                        break false;
                    }
                    tokio::time::sleep(POLL_INTERVAL).await;
                }
            }
        };
        if !ended {
            // The supervisor did not finish in time (hung, or frozen): the
            // agent kills the task itself.
            kill_remains(&pid_path, &self.config.cgroups.task(allocation)).await;
            return Ok(StopOutcome::Killed);
        }
        Ok(match record::read_json::<ExitRecord>(&exit_path) {
            Ok(exit) if !exit.killed_after_grace => StopOutcome::Exited,
            _ => StopOutcome::Killed,
        })
    }

    /// Reads every task record and tells, for each task, whether it still
    /// runs. Running ones are watched from now on: their exits come through
    /// [`next_exit`](Self::next_exit). A task whose supervisor is gone
    /// without an exit record is killed (nothing runs unsupervised) and
    /// reported as gone.
    pub async fn recover(&self) -> Result<Recovery, RuntimeError> {
        let dir = self.tasks_dir();
        let mut entries = match tokio::fs::read_dir(&dir).await {
            Ok(entries) => entries,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Recovery::default());
            }
            Err(source) => return Err(RuntimeError::State { path: dir, source }),
        };
        let mut paths = Vec::new();
        loop {
            match entries.next_entry().await {
                Ok(Some(entry)) => {
                    let path = entry.path();
                    if path
                        .extension()
                        .is_some_and(|extension| extension == "json")
                    {
                        paths.push(path);
                    }
                }
                Ok(None) => break,
                Err(source) => return Err(RuntimeError::State { path: dir, source }),
            }
        }
        paths.sort();
        let mut recovery = Recovery::default();
        for path in paths {
            let task = match record::read_task(&path) {
                Ok(task) => task,
                Err(reason) => {
                    recovery.unreadable.push((path, reason));
                    continue;
                }
            };
            let Some(stop_signal) = Signal::parse(&task.stop_signal) else {
                let reason = format!("unknown stop signal `{}`", task.stop_signal);
                recovery.unreadable.push((path, reason));
                continue;
            };
            let key = task.allocation.clone();
            if check_allocation(&key).is_err() || path != self.file(&key, "json") {
                recovery
                    .unreadable
                    .push((path, "its allocation does not match its name".to_string()));
                continue;
            }
            let pids = record::read_json::<PidRecord>(&self.file(&key, "pid")).ok();
            let same_boot = match (&task.boot_id, record::boot_id()) {
                (Some(then), Some(now)) => *then == now,
                _ => true,
            };
            let status = match record::read_json::<ExitRecord>(&self.file(&key, "exit")) {
                Ok(exit) => RecoveredStatus::Exited(TaskExit::from_record(&key, exit)),
                Err(_) => match &pids {
                    Some(pids) if same_boot && is_supervisor(pids.supervisor, &key) => {
                        if let (Some(uid), Some(pool)) =
                            (task.user.dynamic_uid, self.lock_uids().as_mut())
                        {
                            pool.hold(uid, &key);
                        }
                        self.watch_recovered(&key, pids.supervisor);
                        RecoveredStatus::Running
                    }
                    _ => {
                        if same_boot {
                            kill_remains(&self.file(&key, "pid"), &task.cgroup.task(&key)).await;
                        }
                        RecoveredStatus::Gone
                    }
                },
            };
            let pid = pids.as_ref().map_or(0, |p| p.pid);
            recovery.tasks.push(RecoveredTask {
                allocation: key,
                pid,
                pgid: pid,
                started_at: Time(task.started_at_ms),
                command: task.command,
                gpu_indices: task.gpu_indices,
                gpu_uuids: task.gpu_uuids,
                stop_signal,
                grace_period: Duration::from_millis(task.grace_period_ms),
                status,
            });
        }
        recovery
            .tasks
            .sort_by(|a, b| a.allocation.cmp(&b.allocation));
        Ok(recovery)
    }

    /// Watches a running task of an earlier agent until its supervisor
    /// writes the exit record or vanishes.
    fn watch_recovered(&self, key: &str, supervisor: i32) {
        if self.lock_tasks().contains_key(key) {
            return;
        }
        let (exit_sender, exit_receiver) = watch::channel(None);
        let exits = self.exits_sender.clone();
        let exit_path = self.file(key, "exit");
        let pid_path = self.file(key, "pid");
        let cgroup = self.config.cgroups.task(key);
        let key = key.to_string();
        self.lock_tasks().insert(
            key.clone(),
            Watched {
                exit: exit_receiver,
            },
        );
        let uids = self.uids.clone();
        tokio::spawn(async move {
            loop {
                if let Ok(exit) = record::read_json::<ExitRecord>(&exit_path) {
                    release(&uids, &key);
                    let exit = TaskExit::from_record(&key, exit);
                    let _ = exit_sender.send(Some(exit.clone()));
                    let _ = exits.send(exit);
                    return;
                }
                if !is_supervisor(supervisor, &key) {
                    // One last look: it may have written the record and exited.
                    let exit = supervisor_ended(&key, &exit_path, &pid_path, &cgroup).await;
                    release(&uids, &key);
                    let _ = exit_sender.send(Some(exit.clone()));
                    let _ = exits.send(exit);
                    return;
                }
                tokio::time::sleep(POLL_INTERVAL).await;
            }
        });
    }

    /// Drops an ended task: its records and what this runtime remembers of
    /// it. The log stays (the log shipper removes it once shipped). Call it
    /// once the control plane has the exit.
    pub async fn forget(&self, allocation: &str) -> Result<(), RuntimeError> {
        check_allocation(allocation)?;
        if self.lock_starting().contains_key(allocation) {
            return Err(RuntimeError::StillRunning {
                allocation: allocation.to_string(),
            });
        }
        {
            let tasks = self.lock_tasks();
            if let Some(task) = tasks.get(allocation)
                && task.exit.borrow().is_none()
            {
                return Err(RuntimeError::StillRunning {
                    allocation: allocation.to_string(),
                });
            }
        }
        if let Ok(pids) = record::read_json::<PidRecord>(&self.file(allocation, "pid"))
            && !self.file(allocation, "exit").exists()
            && is_supervisor(pids.supervisor, allocation)
        {
            return Err(RuntimeError::StillRunning {
                allocation: allocation.to_string(),
            });
        }
        self.lock_tasks().remove(allocation);
        for extension in std::iter::once("json").chain(TRANSIENT_FILES) {
            let path = self.file(allocation, extension);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => return Err(RuntimeError::State { path, source }),
            }
        }
        Ok(())
    }

    /// Up to `max_bytes` of the task's log from byte `offset`, and the offset
    /// to ask for next (for `muster logs -f`: call again with it). Past the
    /// end, the answer is empty and the offset unchanged.
    pub async fn read_log(
        &self,
        allocation: &str,
        offset: u64,
        max_bytes: usize,
    ) -> Result<(Vec<u8>, u64), RuntimeError> {
        check_allocation(allocation)?;
        let path = self.log_path(allocation);
        let mut file = match tokio::fs::File::open(&path).await {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                return Err(RuntimeError::NoLog {
                    allocation: allocation.to_string(),
                    path,
                });
            }
            Err(source) => return Err(RuntimeError::State { path, source }),
        };
        file.seek(SeekFrom::Start(offset))
            .await
            .map_err(state_error(&path))?;
        let mut bytes = Vec::new();
        file.take(max_bytes as u64)
            .read_to_end(&mut bytes)
            .await
            .map_err(state_error(&path))?;
        let next = offset + bytes.len() as u64;
        Ok((bytes, next))
    }
}

/// Gives task `key`'s uid back to `uids` (the task and its processes are
/// gone).
fn release(uids: &Mutex<Option<uids::UidPool>>, key: &str) {
    if let Some(pool) = uids.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
        pool.release(key);
    }
}

/// How a task ended whose supervisor has exited: its exit record, or, with
/// none (the supervisor was killed), `Lost`, once whatever is left of the
/// task has been killed: nothing of it may run unsupervised.
async fn supervisor_ended(
    key: &str,
    exit_path: &Path,
    pid_path: &Path,
    cgroup: &cgroup::TaskCgroup,
) -> TaskExit {
    match record::read_json::<ExitRecord>(exit_path) {
        Ok(exit) => TaskExit::from_record(key, exit),
        Err(_) => {
            kill_remains(pid_path, cgroup).await;
            TaskExit::lost(key)
        }
    }
}

/// Kills whatever is left of a task whose supervisor is gone: every member
/// of its cgroup; with no cgroup, every process of its process group that
/// runs as the task's user (a pid may have been reused since: a process of
/// another user in a group of that number is left alone).
async fn kill_remains(pid_path: &Path, cgroup: &cgroup::TaskCgroup) {
    // A container task's container is the engine's, outside the task's
    // cgroup: it goes too (its supervisor, which would have removed it, is
    // gone).
    if let (Some(tasks_dir), Some(key)) = (
        pid_path.parent(),
        pid_path.file_stem().and_then(|stem| stem.to_str()),
    ) && record::read_task(&record::path(tasks_dir, key, "json"))
        .is_ok_and(|task| task.container.is_some())
    {
        let state_dir = tasks_dir.parent().unwrap_or(tasks_dir);
        crate::container::remove_task_container(state_dir, key).await;
    }
    let pids = record::read_json::<PidRecord>(pid_path).ok();
    let cgroup = cgroup.clone();
    let _ = tokio::task::spawn_blocking(move || {
        if let (cgroup::TaskCgroup::None, Some(pids)) = (&cgroup, pids) {
            for pid in group::members_of_user(pids.pid, pids.uid) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
            }
        }
        cgroup.kill_all(Duration::from_secs(2));
        let _ = cgroup.remove();
    })
    .await;
}

/// The environment of a command check beside a task: what the task's own
/// gets from the agent (see the module doc), then the task's variables.
pub fn check_environment(
    task_env: &BTreeMap<String, String>,
    agent_var: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    for name in PASSED_THROUGH {
        if let Some(value) = agent_var(name) {
            env.insert(name.to_string(), value);
        }
    }
    env.entry("PATH".to_string())
        .or_insert_with(|| DEFAULT_PATH.to_string());
    env.extend(task_env.clone());
    env
}

/// The task's environment (see the module doc); `agent_var` reads the
/// agent's own environment.
fn task_environment(
    launch: &TaskLaunch,
    agent_var: impl Fn(&str) -> Option<String>,
) -> BTreeMap<String, String> {
    // What a check beside the task gets too, then the task's own variables
    // from the agent.
    let mut env = check_environment(&launch.env, agent_var);
    let indices = launch
        .gpu_indices
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    env.insert("CUDA_VISIBLE_DEVICES".to_string(), indices.clone());
    env.insert("NVIDIA_VISIBLE_DEVICES".to_string(), indices);
    env.insert("CUDA_DEVICE_ORDER".to_string(), "PCI_BUS_ID".to_string());
    env.insert("MUSTER_GPU_UUIDS".to_string(), launch.gpu_uuids.join(","));
    env
}

fn check_allocation(allocation: &str) -> Result<(), RuntimeError> {
    let reason = if allocation.is_empty() {
        Some("it is empty")
    } else if allocation.len() > MAX_ALLOCATION_LEN {
        Some("it is too long")
    } else if allocation.starts_with('.') {
        Some("it starts with `.`")
    } else if !allocation
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
    {
        Some("it has a character that is not safe in a file name")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(RuntimeError::InvalidAllocation {
            allocation: allocation.to_string(),
            reason: reason.to_string(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch() -> TaskLaunch {
        TaskLaunch {
            allocation: "x".to_string(),
            command: vec!["true".to_string()],
            env: BTreeMap::new(),
            working_dir: None,
            gpu_indices: vec![0],
            gpu_uuids: Vec::new(),
            stop_signal: Signal::Term,
            grace_period: Duration::from_secs(1),
            user: None,
            user_group: None,
            memory_limit_mib: None,
            image: None,
            cpu_milli: None,
            registry_auth: None,
            mounts: Vec::new(),
        }
    }

    #[test]
    fn environment_keeps_only_the_allowlist_and_gpu_variables_win() {
        let mut task = launch();
        task.env.insert("HOME".to_string(), "/job".to_string());
        task.env
            .insert("NVIDIA_VISIBLE_DEVICES".to_string(), "all".to_string());
        let agent = |name: &str| match name {
            "HOME" => Some("/root".to_string()),
            "LANG" => Some("C.UTF-8".to_string()),
            "MUSTER_JOIN_TOKEN" => Some("secret".to_string()),
            _ => None,
        };
        let env = task_environment(&task, agent);
        assert_eq!(env["HOME"], "/job", "the launch sets it, not the agent");
        assert_eq!(env["LANG"], "C.UTF-8");
        assert_eq!(env["PATH"], DEFAULT_PATH);
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "0");
        assert!(!env.contains_key("MUSTER_JOIN_TOKEN"));
        task.env.clear();
        let env = task_environment(&task, agent);
        assert!(
            !env.contains_key("HOME"),
            "the agent's HOME is not the task's (the supervisor sets the task user's)"
        );
    }
}
