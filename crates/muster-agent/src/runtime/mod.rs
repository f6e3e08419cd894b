//! The process runtime: runs a task as a process group on this host.
//!
//! Layout of the state directory:
//! - `logs/<allocation>.log`: the task's stdout and stderr, both appended to
//!   this one file (opened by the agent and handed to the task, so nothing is
//!   lost when the agent restarts);
//! - `tasks/<allocation>.json`: the pid file (pid, process group, start time,
//!   boot id, GPUs, stop signal, and the exit once seen), so a restarted
//!   agent can find its tasks again with [`ProcessRuntime::recover`].
//!
//! Exits are reported on a channel: [`ProcessRuntime::next_exit`] waits for
//! the next one (the agent's main loop selects on it). A task's pid file stays
//! after it exits, with the exit recorded, until [`ProcessRuntime::forget`]
//! removes it, so an exit seen just before an agent crash is not lost.
//!
//! The task's environment is not the agent's (which may hold the node's join
//! token): it is a short allowlist taken from the agent ([`PASSED_THROUGH`],
//! `PATH` with a default), then the launch's `env`, then the GPU variables,
//! which the launch cannot override: `CUDA_VISIBLE_DEVICES` and
//! `NVIDIA_VISIBLE_DEVICES` (the GPU indices, comma-separated; empty for no
//! GPU, so CUDA sees none), `CUDA_DEVICE_ORDER=PCI_BUS_ID` (so CUDA numbers
//! GPUs as NVML does) and `MUSTER_GPU_UUIDS`.

mod group;
mod record;
#[cfg(test)]
mod tests;

pub use group::group_alive;

use muster_model::{Signal, Time};
use record::{ExitRecord, TaskRecord};
use std::collections::BTreeMap;
use std::io::SeekFrom;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncSeekExt};
use tokio::sync::{mpsc, watch};

/// Variables passed from the agent's environment to every task.
pub const PASSED_THROUGH: &[&str] = &[
    "HOME",
    "LANG",
    "LC_ALL",
    "LD_LIBRARY_PATH",
    "LOGNAME",
    "PATH",
    "SHELL",
    "TMPDIR",
    "TZ",
    "USER",
];

/// `PATH` when the agent has none.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// How long to wait for a group to vanish after SIGKILL.
const KILL_WAIT: Duration = Duration::from_secs(5);

/// How often to look at a group we cannot wait on (a recovered task's).
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// Longest allocation id accepted.
const MAX_ALLOCATION_LEN: usize = 128;

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
    /// better idea (kept in the pid file for recovered tasks).
    pub stop_signal: Signal,
    pub grace_period: Duration,
}

/// A task's leader exited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskExit {
    pub allocation: String,
    /// The exit code, when the task exited by itself.
    pub exit_code: Option<i32>,
    /// The signal number, when a signal ended it.
    pub signal: Option<i32>,
}

/// How a stop ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopOutcome {
    /// The task exited within the grace period (anything left of its group
    /// was then killed).
    Exited,
    /// The grace period ran out; the group was killed.
    Killed,
    /// Nothing was running.
    NotRunning,
}

/// A task found in the state directory by [`ProcessRuntime::recover`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecoveredTask {
    pub allocation: String,
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
    /// Some process of its group is still running.
    Running,
    /// An agent saw it exit, and nobody has called `forget` since.
    Exited(TaskExit),
    /// No process is left (or the host rebooted since), and its exit was not
    /// seen.
    Gone,
}

/// Everything a recovery found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Recovery {
    /// Ordered by allocation.
    pub tasks: Vec<RecoveredTask>,
    /// Pid files that could not be read, with why; left in place.
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
    #[error("allocation {allocation} is already running (process group {pgid}); stop it first")]
    AlreadyRunning { allocation: String, pgid: i32 },
    #[error("cannot start `{program}` for allocation {allocation}: {source}")]
    Spawn {
        allocation: String,
        program: String,
        #[source]
        source: std::io::Error,
    },
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
    #[error("cannot send SIG{signal} to process group {pgid}: {source}")]
    Signal {
        pgid: i32,
        signal: &'static str,
        #[source]
        source: nix::errno::Errno,
    },
    #[error("no log for allocation {allocation} at `{}`", path.display())]
    NoLog { allocation: String, path: PathBuf },
}

/// A task this runtime started (and so can wait on).
#[derive(Debug)]
struct OwnTask {
    pgid: i32,
    exit: watch::Receiver<Option<TaskExit>>,
}

/// Runs tasks as process groups, with their state under one directory.
#[derive(Debug)]
pub struct ProcessRuntime {
    state_dir: PathBuf,
    tasks: Mutex<BTreeMap<String, OwnTask>>,
    /// Serializes starts, so two starts of one allocation cannot race.
    starting: tokio::sync::Mutex<()>,
    exits_sender: mpsc::UnboundedSender<TaskExit>,
    exits: tokio::sync::Mutex<mpsc::UnboundedReceiver<TaskExit>>,
}

/// Where the task's target is known from.
enum Target {
    Own(i32, watch::Receiver<Option<TaskExit>>),
    Recovered(i32),
}

impl ProcessRuntime {
    /// A runtime keeping its files under `state_dir` (created on first
    /// start).
    pub fn new(state_dir: PathBuf) -> Self {
        let (exits_sender, exits) = mpsc::unbounded_channel();
        ProcessRuntime {
            state_dir,
            tasks: Mutex::new(BTreeMap::new()),
            starting: tokio::sync::Mutex::new(()),
            exits_sender,
            exits: tokio::sync::Mutex::new(exits),
        }
    }

    pub fn state_dir(&self) -> &Path {
        &self.state_dir
    }

    /// Where the task's output goes (stdout and stderr together).
    pub fn log_path(&self, allocation: &str) -> PathBuf {
        self.state_dir
            .join("logs")
            .join(format!("{allocation}.log"))
    }

    fn record_path(&self, allocation: &str) -> PathBuf {
        self.state_dir
            .join("tasks")
            .join(format!("{allocation}.json"))
    }

    /// Starts the task, with the clock read now as its start time.
    pub async fn start(&self, launch: TaskLaunch) -> Result<(), RuntimeError> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |since| since.as_millis() as u64);
        self.start_at(launch, Time(now)).await
    }

    /// Starts the task in a process group of its own; `started_at` goes into
    /// the pid file. Returns once the process runs and its pid file is
    /// written; its exit comes later through [`next_exit`](Self::next_exit).
    pub async fn start_at(&self, launch: TaskLaunch, started_at: Time) -> Result<(), RuntimeError> {
        check_allocation(&launch.allocation)?;
        let allocation = launch.allocation.clone();
        let Some((program, arguments)) = launch.command.split_first() else {
            return Err(RuntimeError::EmptyCommand { allocation });
        };
        if let Some(path) = &launch.working_dir {
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
        let _starting = self.starting.lock().await;
        self.check_not_running(&allocation).await?;

        let log_path = self.log_path(&allocation);
        let record_path = self.record_path(&allocation);
        for dir in [log_path.parent(), record_path.parent()]
            .into_iter()
            .flatten()
        {
            tokio::fs::create_dir_all(dir)
                .await
                .map_err(|source| RuntimeError::State {
                    path: dir.to_path_buf(),
                    source,
                })?;
        }
        let log_error = |source| RuntimeError::State {
            path: log_path.clone(),
            source,
        };
        let stdout = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .await
            .map_err(log_error)?
            .into_std()
            .await;
        let stderr = stdout.try_clone().map_err(log_error)?;

        let mut command = tokio::process::Command::new(program);
        command
            .args(arguments)
            .env_clear()
            .envs(task_environment(&launch, |name| std::env::var(name).ok()))
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .process_group(0)
            .kill_on_drop(false);
        if let Some(path) = &launch.working_dir {
            command.current_dir(path);
        }
        let mut child = command.spawn().map_err(|source| RuntimeError::Spawn {
            allocation: allocation.clone(),
            program: program.clone(),
            source,
        })?;
        let Some(pid) = child.id().and_then(|pid| i32::try_from(pid).ok()) else {
            // Only possible once the child was reaped, which nothing did.
            return Err(RuntimeError::Spawn {
                allocation,
                program: program.clone(),
                source: std::io::Error::other("the process vanished as it started"),
            });
        };

        let mut record = TaskRecord {
            format: record::FORMAT,
            allocation: allocation.clone(),
            pid,
            pgid: pid,
            started_at_ms: started_at.0,
            boot_id: record::boot_id(),
            command: launch.command.clone(),
            gpu_indices: launch.gpu_indices.clone(),
            gpu_uuids: launch.gpu_uuids.clone(),
            stop_signal: launch.stop_signal.name().to_string(),
            grace_period_ms: launch.grace_period.as_millis() as u64,
            exit: None,
        };
        if let Err(error) = record::write(&record_path, &record).await {
            // A task nobody could find after a restart must not run.
            let _ = group::signal_group(pid, nix::sys::signal::Signal::SIGKILL);
            let _ = child.wait().await;
            return Err(error);
        }

        let (exit_sender, exit_receiver) = watch::channel(None);
        let exits = self.exits_sender.clone();
        tokio::spawn(async move {
            let exit = match child.wait().await {
                Ok(status) => TaskExit {
                    allocation: record.allocation.clone(),
                    exit_code: status.code(),
                    signal: status.signal(),
                },
                Err(_) => TaskExit {
                    allocation: record.allocation.clone(),
                    exit_code: None,
                    signal: None,
                },
            };
            record.exit = Some(ExitRecord {
                exit_code: exit.exit_code,
                signal: exit.signal,
            });
            // Best effort: if this fails, a recovery reports the task gone.
            let _ = record::write(&record_path, &record).await;
            let _ = exit_sender.send(Some(exit.clone()));
            let _ = exits.send(exit);
        });
        self.lock_tasks().insert(
            allocation,
            OwnTask {
                pgid: pid,
                exit: exit_receiver,
            },
        );
        Ok(())
    }

    /// Errors when the allocation runs, here or (after a restart) from a
    /// previous agent's start.
    async fn check_not_running(&self, allocation: &str) -> Result<(), RuntimeError> {
        if let Some(task) = self.lock_tasks().get(allocation)
            && task.exit.borrow().is_none()
        {
            return Err(RuntimeError::AlreadyRunning {
                allocation: allocation.to_string(),
                pgid: task.pgid,
            });
        }
        if let Ok(record) = record::read(&self.record_path(allocation)).await
            && record.exit.is_none()
            && same_boot(&record)
            && group_alive_off_thread(record.pgid).await
        {
            return Err(RuntimeError::AlreadyRunning {
                allocation: allocation.to_string(),
                pgid: record.pgid,
            });
        }
        Ok(())
    }

    fn lock_tasks(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, OwnTask>> {
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

    /// Stops the task: sends `signal` to its whole process group, waits up
    /// to `grace` for it to exit, then sends SIGKILL to the group (which also
    /// ends children it left behind). Works for tasks this runtime started
    /// and for tasks found by [`recover`](Self::recover); for the latter,
    /// "exited" means every process of the group is gone.
    pub async fn stop(
        &self,
        allocation: &str,
        signal: Signal,
        grace: Duration,
    ) -> Result<StopOutcome, RuntimeError> {
        check_allocation(allocation)?;
        let target = self
            .lock_tasks()
            .get(allocation)
            .map(|task| Target::Own(task.pgid, task.exit.clone()));
        let target = match target {
            Some(target) => target,
            None => match record::read(&self.record_path(allocation)).await {
                Ok(record) if record.exit.is_none() && same_boot(&record) => {
                    Target::Recovered(record.pgid)
                }
                Ok(_) => return Ok(StopOutcome::NotRunning),
                Err(_) => {
                    return Err(RuntimeError::NotFound {
                        allocation: allocation.to_string(),
                    });
                }
            },
        };
        match target {
            Target::Own(pgid, mut exit) => {
                if exit.borrow().is_some() {
                    // The leader is gone; children it left may not be.
                    if group_alive_off_thread(pgid).await {
                        group::signal_group(pgid, nix::sys::signal::Signal::SIGKILL)?;
                    }
                    return Ok(StopOutcome::NotRunning);
                }
                group::signal_group(pgid, group::to_nix(signal))?;
                let exited = tokio::time::timeout(grace, exit.wait_for(Option::is_some))
                    .await
                    .is_ok_and(|waited| waited.is_ok());
                group::signal_group(pgid, nix::sys::signal::Signal::SIGKILL)?;
                if !exited {
                    let _ = tokio::time::timeout(KILL_WAIT, exit.wait_for(Option::is_some)).await;
                }
                Ok(if exited {
                    StopOutcome::Exited
                } else {
                    StopOutcome::Killed
                })
            }
            Target::Recovered(pgid) => {
                group::check_pgid(pgid)?;
                if !group_alive_off_thread(pgid).await {
                    return Ok(StopOutcome::NotRunning);
                }
                group::signal_group(pgid, group::to_nix(signal))?;
                let exited = wait_group_gone(pgid, grace).await;
                if !exited {
                    group::signal_group(pgid, nix::sys::signal::Signal::SIGKILL)?;
                    wait_group_gone(pgid, KILL_WAIT).await;
                }
                Ok(if exited {
                    StopOutcome::Exited
                } else {
                    StopOutcome::Killed
                })
            }
        }
    }

    /// Reads every pid file and tells, for each task, whether its process
    /// group still runs. Reads only: the agent decides what to do with what
    /// it finds (report, [`stop`](Self::stop), [`kill_orphan`](Self::kill_orphan),
    /// [`forget`](Self::forget)).
    pub async fn recover(&self) -> Result<Recovery, RuntimeError> {
        let dir = self.state_dir.join("tasks");
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
            let record = match record::read(&path).await {
                Ok(record) => record,
                Err(reason) => {
                    recovery.unreadable.push((path, reason));
                    continue;
                }
            };
            let Some(stop_signal) = Signal::parse(&record.stop_signal) else {
                let reason = format!("unknown stop signal `{}`", record.stop_signal);
                recovery.unreadable.push((path, reason));
                continue;
            };
            let status = match record.exit {
                Some(exit) => RecoveredStatus::Exited(TaskExit {
                    allocation: record.allocation.clone(),
                    exit_code: exit.exit_code,
                    signal: exit.signal,
                }),
                None if same_boot(&record) && group_alive_off_thread(record.pgid).await => {
                    RecoveredStatus::Running
                }
                None => RecoveredStatus::Gone,
            };
            recovery.tasks.push(RecoveredTask {
                allocation: record.allocation,
                pid: record.pid,
                pgid: record.pgid,
                started_at: Time(record.started_at_ms),
                command: record.command,
                gpu_indices: record.gpu_indices,
                gpu_uuids: record.gpu_uuids,
                stop_signal,
                grace_period: Duration::from_millis(record.grace_period_ms),
                status,
            });
        }
        recovery
            .tasks
            .sort_by(|a, b| a.allocation.cmp(&b.allocation));
        Ok(recovery)
    }

    /// Kills a process group found by a recovery (SIGKILL, no grace), and
    /// waits up to 5 s for it to be gone. A group already gone is fine.
    pub async fn kill_orphan(&self, pgid: i32) -> Result<(), RuntimeError> {
        group::signal_group(pgid, nix::sys::signal::Signal::SIGKILL)?;
        wait_group_gone(pgid, KILL_WAIT).await;
        Ok(())
    }

    /// Drops an exited (or gone) task: its pid file and what this runtime
    /// remembers of it. The log stays. Call it once the control plane has
    /// the exit.
    pub async fn forget(&self, allocation: &str) -> Result<(), RuntimeError> {
        check_allocation(allocation)?;
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
        let path = self.record_path(allocation);
        if let Ok(record) = record::read(&path).await
            && record.exit.is_none()
            && same_boot(&record)
            && group_alive_off_thread(record.pgid).await
        {
            return Err(RuntimeError::StillRunning {
                allocation: allocation.to_string(),
            });
        }
        self.lock_tasks().remove(allocation);
        match tokio::fs::remove_file(&path).await {
            Ok(()) => Ok(()),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RuntimeError::State { path, source }),
        }
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
        let state_error = |source| RuntimeError::State {
            path: path.clone(),
            source,
        };
        file.seek(SeekFrom::Start(offset))
            .await
            .map_err(state_error)?;
        let mut bytes = Vec::new();
        file.take(max_bytes as u64)
            .read_to_end(&mut bytes)
            .await
            .map_err(state_error)?;
        let next = offset + bytes.len() as u64;
        Ok((bytes, next))
    }
}

/// The task's environment (see the module doc); `agent_var` reads the
/// agent's own environment.
fn task_environment(
    launch: &TaskLaunch,
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
    env.extend(launch.env.clone());
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

/// False when the pid file is from before the last reboot.
fn same_boot(record: &TaskRecord) -> bool {
    match (&record.boot_id, record::boot_id()) {
        (Some(then), Some(now)) => *then == now,
        _ => true,
    }
}

/// [`group_alive`] on a blocking thread: it may scan `/proc`.
async fn group_alive_off_thread(pgid: i32) -> bool {
    tokio::task::spawn_blocking(move || group_alive(pgid))
        .await
        .unwrap_or(true)
}

/// Polls until no process of the group runs; `true` if that happened within
/// `limit`.
async fn wait_group_gone(pgid: i32, limit: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if !group_alive_off_thread(pgid).await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}
