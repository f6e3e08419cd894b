//! The task supervisor: `muster supervise STATE_DIR KEY`, one small process
//! per task, started by the agent by absolute path and outliving it.
//!
//! It reads the task's record (`tasks/KEY.json`), puts the task in a cgroup
//! of its own (or, with none, becomes the child subreaper of everything the
//! task starts), drops to the task's user, starts the command with its
//! output appended to the task's log, and then waits, forking nothing:
//! - for the task's leader to exit; then it kills whatever the task left
//!   behind, so no process outlives its task;
//! - for a stop request (`tasks/KEY.stop`, written only by the agent, which
//!   wakes it with SIGUSR1): the job's signal to every process of the task,
//!   then, after the grace period, a kill of all of them;
//! - for the node's fence deadline (`fence_at`, written only by the agent
//!   each time it renews its lease) to pass: then it kills the task at once,
//!   whether or not the agent is alive. It reads the file only when the
//!   deadline it last read is reached.
//!
//! Signals are only wake-ups: what to do comes from files under the agent's
//! state directory, which tasks (running as another user) can neither read
//! nor write. When the task and all its processes are gone it writes
//! `tasks/KEY.exit` (the exit code or signal, why it ended, its CPU time and
//! peak memory) and exits.
//!
//! It uses no async runtime and no threads (it forks after start-up), and
//! reports its start on stdout: `started PID` or `failed MESSAGE`.

use crate::runtime::cgroup::{Limits, TaskCgroup};
use crate::runtime::record::{
    self, EndReason, ExitRecord, PidRecord, StopRequest, TaskRecord, UserPlan,
};
use nix::sys::signal::{SigSet, SigmaskHow, Signal, kill, killpg, sigprocmask};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// The longest the supervisor sleeps without looking at the fence file.
const LONGEST_SLEEP_MS: u64 = 5_000;

/// How long a kill may take before the supervisor tries again.
const KILL_WAIT: Duration = Duration::from_secs(2);

/// Runs the supervisor; `args` are what follows `supervise`. Returns the
/// process's exit code (0 once the exit record is written).
pub fn main(args: &[String]) -> i32 {
    let [state_dir, key] = args else {
        eprintln!("usage: muster supervise STATE_DIR KEY (started by muster agent, not by hand)");
        return 2;
    };
    match supervise(Path::new(state_dir), key) {
        Ok(()) => 0,
        Err(message) => {
            // Before the task started, the agent reads this line; after,
            // nobody may be reading (a write error must not panic).
            let mut stdout = std::io::stdout();
            let _ = writeln!(stdout, "failed {message}");
            let _ = stdout.flush();
            1
        }
    }
}

/// Whether this process runs as root (and so can give tasks another user
/// and create cgroups).
pub fn running_as_root() -> bool {
    Uid::effective().is_root()
}

/// Whom to run a task as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskUser {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
}

/// The group of a task with a uid of the agent's range whose user has no
/// group number (Debian's `nogroup`, the overflow gid).
pub const NOGROUP: u32 = 65534;

/// The name a task with a uid of the agent's range goes by (`USER`,
/// `LOGNAME`): it has no account.
pub fn dynamic_name(uid: u32) -> String {
    format!("muster-task-{uid}")
}

/// The job's user's account on this node, when it exists and may run tasks
/// (not root, unless the operator allows it).
pub fn job_account(plan: &UserPlan, lookup: impl Fn(&str) -> Option<TaskUser>) -> Option<TaskUser> {
    plan.job_user
        .as_deref()
        .and_then(lookup)
        .filter(|user| user.uid != 0 || plan.allow_root)
}

/// The user a task runs as: the job's user when it exists here and is not
/// root (or root is allowed), else the uid of the agent's range the task
/// was given (no account: `HOME` is its private `/tmp` where it has one),
/// else (a record of an older agent) its fallback user, never root unless
/// allowed. `None`: the supervisor is not root and so cannot switch (the
/// task runs as the agent's user). `lookup` finds a user by name.
pub fn choose_user(
    running_as_root: bool,
    plan: &UserPlan,
    lookup: impl Fn(&str) -> Option<TaskUser>,
) -> Result<Option<TaskUser>, String> {
    if !running_as_root {
        return Ok(None);
    }
    if let Some(user) = job_account(plan, &lookup) {
        return Ok(Some(user));
    }
    if let Some(uid) = plan.dynamic_uid {
        return Ok(Some(TaskUser {
            name: dynamic_name(uid),
            uid,
            gid: plan.dynamic_gid.unwrap_or(NOGROUP),
            home: PathBuf::from("/tmp"),
        }));
    }
    let Some(fallback) = plan.fallback.as_deref() else {
        return Err(format!(
            "the job's user `{}` has no account on this node and the agent gave the task no \
             uid of its own",
            plan.job_user.as_deref().unwrap_or("(none)")
        ));
    };
    let fallback = lookup(fallback).ok_or_else(|| {
        format!("the task user `{fallback}` does not exist on this node; restart its agent")
    })?;
    if fallback.uid == 0 && !plan.allow_root {
        return Err(format!(
            "the task user `{}` is root, and this node does not allow tasks to run as root",
            fallback.name
        ));
    }
    Ok(Some(fallback))
}

/// The user named `name` on this node.
pub fn lookup_user(name: &str) -> Option<TaskUser> {
    let user = nix::unistd::User::from_name(name).ok()??;
    Some(TaskUser {
        name: user.name,
        uid: user.uid.as_raw(),
        gid: user.gid.as_raw(),
        home: user.dir,
    })
}

/// The decimal digits of `n`, for writing in a forked child (no
/// allocation there).
fn digits(n: i32, buffer: &mut [u8; 16]) -> &[u8] {
    let mut n = n.unsigned_abs();
    let mut at = buffer.len();
    loop {
        at -= 1;
        buffer[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    &buffer[at..]
}

fn supervise(state_dir: &Path, key: &str) -> Result<(), String> {
    let tasks_dir = state_dir.join("tasks");
    let record_path = record::path(&tasks_dir, key, "json");
    let task = record::read_task(&record_path)
        .map_err(|why| format!("cannot read {}: {why}", record_path.display()))?;

    // Out of the agent's session (a terminal's Ctrl-C is not for tasks),
    // and the reaper of every orphan the task makes.
    let _ = nix::unistd::setsid();
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|e| format!("cannot become a child subreaper: {e}"))?;
    let mut wake = SigSet::empty();
    for signal in [
        Signal::SIGCHLD,
        Signal::SIGUSR1,
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGQUIT,
        Signal::SIGPIPE,
    ] {
        wake.add(signal);
    }
    sigprocmask(SigmaskHow::SIG_BLOCK, Some(&wake), None)
        .map_err(|e| format!("cannot block signals: {e}"))?;
    let signals = SignalFd::with_flags(&wake, SfdFlags::SFD_NONBLOCK | SfdFlags::SFD_CLOEXEC)
        .map_err(|e| format!("cannot create a signalfd: {e}"))?;

    let user = choose_user(Uid::effective().is_root(), &task.user, lookup_user)?;
    let cgroup = task.cgroup.task(key);
    cgroup
        .create(Limits {
            memory_bytes: task.memory_limit_bytes,
            pids: task.pids_max,
        })
        .map_err(|why| format!("cannot create the task's cgroup: {why}"))?;

    let started = start(&task, &cgroup, user.as_ref(), state_dir, key);
    let Started {
        pid: child,
        user: user_name,
        uid,
        init,
    } = match started {
        Ok(started) => started,
        Err(message) => {
            let _ = cgroup.remove();
            // The task's own log says why it never ran.
            if let Ok(mut log) = open_log(&task.log_path) {
                let _ = writeln!(log, "muster: {message}");
            }
            let exit = ExitRecord {
                exit_code: Some(127),
                signal: None,
                reason: EndReason::StartFailed {
                    message: message.clone(),
                },
                killed_after_grace: false,
                usage: Default::default(),
                ended_at_ms: record::now_ms(),
            };
            let _ = record::write_json(&record::path(&tasks_dir, key, "exit"), &exit);
            return Err(message);
        }
    };
    let pid = Pid::from_raw(child as i32);
    let pid_record = PidRecord {
        supervisor: std::process::id() as i32,
        pid: pid.as_raw(),
        user: user_name,
        uid,
    };
    if let Err(error) = record::write_json(&record::path(&tasks_dir, key, "pid"), &pid_record) {
        // Nobody could find this task again: it must not run.
        let _ = killpg(pid, Signal::SIGKILL);
        cgroup.kill_all(KILL_WAIT);
        let _ = cgroup.remove();
        return Err(format!("cannot write the pid file: {error}"));
    }
    let mut stdout = std::io::stdout();
    let _ = writeln!(stdout, "started {}", pid.as_raw());
    let _ = stdout.flush();

    let exit = watch(&task, &tasks_dir, key, pid, &cgroup, &signals, init);
    record::write_json(&record::path(&tasks_dir, key, "exit"), &exit)
        .map_err(|e| format!("cannot write the exit record: {e}"))
}

fn open_log(path: &Path) -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(path)
}

/// A started task: its leader's pid (its init's, in a namespace of its
/// own), its user's name and uid, and the init's status pipe.
struct Started {
    pid: u32,
    user: String,
    uid: u32,
    init: Option<std::fs::File>,
}

/// Starts the command in its cgroup, as its user (in namespaces of its own
/// when the record says so, under an init forked from this process: see
/// [`fork_init`]).
fn start(
    task: &TaskRecord,
    cgroup: &TaskCgroup,
    user: Option<&TaskUser>,
    state_dir: &Path,
    key: &str,
) -> Result<Started, String> {
    if task.command.is_empty() {
        return Err("the command is empty".to_string());
    }
    // A container task: the helper that runs the container is the task's
    // process (see crate::container); it keeps the supervisor's user, to
    // reach the Docker engine, and the container runs as the task's user.
    let helper = match &task.container {
        Some(_) => Some(
            std::env::current_exe()
                .map_err(|e| format!("cannot find this program's own path: {e}"))?,
        ),
        None => None,
    };
    let own_path = || -> Result<String, String> {
        Ok(std::env::current_exe()
            .map_err(|e| format!("cannot find this program's own path: {e}"))?
            .to_str()
            .ok_or("this program's path is not UTF-8")?
            .to_string())
    };
    let container_user = match user {
        Some(user) => format!("{}:{}", user.uid, user.gid),
        None => format!(
            "{}:{}",
            Uid::effective().as_raw(),
            Gid::effective().as_raw()
        ),
    };
    // A dev environment's task is this program's session helper.
    let dev_session = if muster_model::is_dev_session_command(&task.command) && helper.is_none() {
        Some(own_path()?)
    } else {
        None
    };
    let (program, arguments): (String, Vec<String>) = match (&helper, &dev_session) {
        (None, Some(program)) => (program.clone(), vec!["dev-session".to_string()]),
        _ => match &helper {
            Some(helper) => (
                helper
                    .to_str()
                    .ok_or("this program's path is not UTF-8")?
                    .to_string(),
                vec![
                    "container-task".to_string(),
                    "run".to_string(),
                    state_dir.display().to_string(),
                    key.to_string(),
                    container_user,
                ],
            ),
            None => (task.command[0].clone(), task.command[1..].to_vec()),
        },
    };
    let log = open_log(&task.log_path)
        .map_err(|e| format!("cannot open the log {}: {e}", task.log_path.display()))?;
    let log_too = log
        .try_clone()
        .map_err(|e| format!("cannot open the log {}: {e}", task.log_path.display()))?;
    let procs: Vec<std::fs::File> = cgroup
        .procs_files()
        .iter()
        .map(|path| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| format!("cannot open {}: {e}", path.display()))
        })
        .collect::<Result<_, _>>()?;
    let mut env = task.env.clone();
    let (name, uid) = match user {
        Some(user) => {
            for (variable, value) in [
                ("HOME", user.home.to_string_lossy().into_owned()),
                ("USER", user.name.clone()),
                ("LOGNAME", user.name.clone()),
            ] {
                env.entry(variable.to_string()).or_insert(value);
            }
            (user.name.clone(), user.uid)
        }
        None => {
            let uid = Uid::effective();
            let name = nix::unistd::User::from_uid(uid)
                .ok()
                .flatten()
                .map_or_else(|| uid.to_string(), |u| u.name);
            (name, uid.as_raw())
        }
    };
    // A uid of the agent's range has no account, and so no supplementary
    // groups. Its files are its user's group's (umask 007: every run of the
    // user's jobs shares them), or, without a group, its own alone (umask
    // 077): the next holder of the uid, much later, is another tenant.
    let dynamic = user.is_some_and(|user| task.user.dynamic_uid == Some(user.uid));
    let umask = dynamic.then(|| {
        nix::sys::stat::Mode::from_bits_truncate(if task.user.dynamic_gid.is_some() {
            0o007
        } else {
            0o077
        })
    });
    let identity = match user.filter(|_| helper.is_none()) {
        Some(user) => {
            let groups = if dynamic {
                Vec::new()
            } else {
                let name = std::ffi::CString::new(user.name.clone())
                    .map_err(|_| format!("the user name `{}` holds a NUL byte", user.name))?;
                nix::unistd::getgrouplist(&name, Gid::from_raw(user.gid))
                    .unwrap_or_else(|_| vec![Gid::from_raw(user.gid)])
            };
            Some((Uid::from_raw(user.uid), Gid::from_raw(user.gid), groups))
        }
        None => None,
    };
    if helper.is_some() {
        // The helper's own environment: where the engine is, nothing of
        // the task's (that goes to the container).
        env = std::collections::BTreeMap::from([(
            "PATH".to_string(),
            "/usr/sbin:/usr/bin:/sbin:/bin".to_string(),
        )]);
        if let Ok(host) = std::env::var("DOCKER_HOST") {
            env.insert("DOCKER_HOST".to_string(), host);
        }
    }
    let working_dir = match task.working_dir.clone() {
        Some(dir) => dir,
        None => std::env::current_dir()
            .map_err(|e| format!("cannot tell this process's working directory: {e}"))?,
    };
    // In namespaces of its own: this program's task-init is the leader (pid
    // 1 of the new PID namespace, which unshare makes for the next child),
    // and it drops to the task's user once its mounts are made.
    let namespaced = task.namespaces && helper.is_none();
    if namespaced {
        nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID)
            .map_err(|e| format!("cannot make the task a PID namespace: {e}"))?;
        let plan = crate::taskinit::InitPlan {
            user: identity.as_ref().map(|(uid, gid, groups)| {
                (
                    uid.as_raw(),
                    gid.as_raw(),
                    groups.iter().map(|g| g.as_raw()).collect(),
                )
            }),
            working_dir: working_dir.clone(),
            command: std::iter::once(program.clone())
                .chain(arguments.iter().cloned())
                .collect(),
            env,
        };
        let (pid, pipe) = fork_init(&plan, [log, log_too], &procs, umask)?;
        return Ok(Started {
            pid,
            user: name,
            uid,
            init: Some(pipe),
        });
    }
    let switch = identity;
    let mut command = std::process::Command::new(&program);
    command
        .args(&arguments)
        .env_clear()
        .envs(&env)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_too)
        .process_group(0);
    if helper.is_none() {
        command.current_dir(&working_dir);
    }
    // SAFETY (the crate's one allowed unsafe block): the closure runs in the forked child before exec; it only makes
    // async-signal-safe system calls (write, sigprocmask, umask, setgroups,
    // setgid, setuid) on values prepared before the fork, and allocates
    // nothing.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(move || {
            let mut buffer = [0u8; 16];
            let me = digits(nix::unistd::getpid().as_raw(), &mut buffer);
            for file in &procs {
                nix::unistd::write(file.as_fd(), me)?;
            }
            sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
            if let Some(mask) = umask {
                nix::sys::stat::umask(mask);
            }
            if let Some((uid, gid, groups)) = &switch {
                nix::unistd::setgroups(groups)?;
                nix::unistd::setgid(*gid)?;
                nix::unistd::setuid(*uid)?;
            }
            Ok(())
        });
    }
    let child = command
        .spawn()
        .map_err(|e| format!("cannot start `{program}`: {e}"))?;
    Ok(Started {
        pid: child.id(),
        user: name,
        uid,
        init: None,
    })
}

/// Starts a task's init, the first process of the PID namespace made for
/// the next child, by forking this process (single-threaded: see the
/// module's note) rather than executing this program again, which costs
/// a few milliseconds a task. The child takes the status pipe's write end
/// as its standard input and the log as its output, joins the task's
/// cgroup and a process group of its own, closes every other descriptor,
/// and runs [`crate::taskinit::run_plan`]. Returns the init's pid and the
/// pipe's read end, once the init says the command started.
fn fork_init(
    plan: &crate::taskinit::InitPlan,
    logs: [std::fs::File; 2],
    procs: &[std::fs::File],
    umask: Option<nix::sys::stat::Mode>,
) -> Result<(u32, std::fs::File), String> {
    use std::os::fd::OwnedFd;
    let (read, write): (OwnedFd, OwnedFd) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| format!("pipe: {e}"))?;
    // Nothing buffered may be written twice (once more by the child).
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: the supervisor has no other thread (no async runtime, no
    // thread is ever started), so the child is a whole copy of it and may
    // allocate and run ordinary code; it never returns into the caller (it
    // exits with the init's code).
    #[allow(unsafe_code)]
    let forked = unsafe { nix::unistd::fork() }.map_err(|e| format!("fork: {e}"))?;
    match forked {
        nix::unistd::ForkResult::Child => {
            drop(read);
            let ready = (|| -> nix::Result<()> {
                nix::unistd::dup2_stdin(&write)?;
                nix::unistd::dup2_stdout(&logs[0])?;
                nix::unistd::dup2_stderr(&logs[1])?;
                nix::unistd::setpgid(Pid::from_raw(0), Pid::from_raw(0))?;
                let mut buffer = [0u8; 16];
                let me = digits(nix::unistd::getpid().as_raw(), &mut buffer);
                for file in procs {
                    nix::unistd::write(file.as_fd(), me)?;
                }
                sigprocmask(SigmaskHow::SIG_SETMASK, Some(&SigSet::empty()), None)?;
                if let Some(mask) = umask {
                    nix::sys::stat::umask(mask);
                }
                Ok(())
            })();
            let code = match ready {
                Ok(()) => {
                    close_all_but_stdio();
                    // Never unwinds into the supervisor's code: this is
                    // the init, and ends here.
                    std::panic::catch_unwind(|| crate::taskinit::run_plan(plan)).unwrap_or(127)
                }
                Err(error) => {
                    let line = format!("failed cannot start the task's init: {error}\n");
                    let _ = nix::unistd::write(&write, line.as_bytes());
                    127
                }
            };
            std::process::exit(code)
        }
        nix::unistd::ForkResult::Parent { child } => {
            // The write end is the child's alone: the pipe ends with it.
            drop(write);
            let mut pipe = std::fs::File::from(read);
            let first = read_line(&mut pipe);
            if first.trim() != "started" {
                let message = first.trim().strip_prefix("failed ").map_or_else(
                    || "the task's init ended before it started the command".to_string(),
                    str::to_string,
                );
                // Its namespace goes with it.
                let _ = kill(child, Signal::SIGKILL);
                let _ = waitpid(child, None);
                return Err(message);
            }
            Ok((child.as_raw() as u32, pipe))
        }
    }
}

/// Closes every descriptor but 0, 1 and 2 (in a forked init: what the
/// supervisor held, its signalfd and files, is not the task's).
fn close_all_but_stdio() {
    let open: Vec<i32> = match std::fs::read_dir("/proc/self/fd") {
        Ok(entries) => entries
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse().ok())
            .filter(|fd| *fd > 2)
            .collect(),
        Err(_) => return,
    };
    for fd in open {
        // The listing's own descriptor is among them, closed already.
        let _ = nix::unistd::close(fd);
    }
}

/// One line from the init's status pipe (up to its end, or the pipe's).
fn read_line(pipe: &mut std::fs::File) -> String {
    use std::io::Read;
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while line.len() < 4096 {
        match pipe.read(&mut byte) {
            Ok(1) if byte[0] == b'\n' => break,
            Ok(1) => line.push(byte[0]),
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => {}
            _ => break,
        }
    }
    String::from_utf8_lossy(&line).into_owned()
}

/// The node's fence deadline, or `None` when the file cannot be read (which
/// fences: the agent writes it before it starts any task).
fn fence_deadline(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    text.split_whitespace().next()?.parse().ok()
}

fn parse_signal(name: &str) -> Signal {
    match muster_model::Signal::parse(name) {
        Some(signal) => crate::runtime::to_nix(signal),
        None => Signal::SIGTERM,
    }
}

/// Every process descending from this one (the supervisor), found through
/// `/proc`: with the supervisor as subreaper, that is everything the task
/// started that is still alive.
fn descendants() -> Vec<Pid> {
    let me = std::process::id() as i32;
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut parent_of = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let mut fields = rest.split_whitespace();
        let state = fields.next().unwrap_or("Z");
        let Some(parent) = fields.next().and_then(|p| p.parse::<i32>().ok()) else {
            continue;
        };
        if state != "Z" && state != "X" {
            parent_of.push((pid, parent));
        }
    }
    // Children by parent, then a walk down from this process: linear in the
    // number of processes, however many the task forked.
    let mut children: std::collections::BTreeMap<i32, Vec<i32>> = Default::default();
    for (pid, parent) in parent_of {
        children.entry(parent).or_default().push(pid);
    }
    let mut found = Vec::new();
    let mut seen = std::collections::BTreeSet::from([me]);
    let mut stack = vec![me];
    while let Some(parent) = stack.pop() {
        for &pid in children.get(&parent).map_or(&[][..], Vec::as_slice) {
            if seen.insert(pid) {
                found.push(Pid::from_raw(pid));
                stack.push(pid);
            }
        }
    }
    found
}

/// Sends `signal` to every process of the task: its cgroup's members, its
/// process group, and (with no cgroup) every descendant.
fn signal_everything(cgroup: &TaskCgroup, pgid: Pid, signal: Signal) {
    let _ = killpg(pgid, signal);
    match cgroup {
        TaskCgroup::None => {
            for pid in descendants() {
                let _ = kill(pid, signal);
            }
        }
        _ => cgroup.signal_all(signal),
    }
}

/// Kills every process of the task and waits (up to [`KILL_WAIT`]) until
/// none is left.
fn kill_everything(cgroup: &TaskCgroup, pgid: Pid, reaper: &mut Reaper) {
    let _ = killpg(pgid, Signal::SIGKILL);
    match cgroup {
        TaskCgroup::None => {
            let until = Instant::now() + KILL_WAIT;
            loop {
                let left = descendants();
                if left.is_empty() || Instant::now() >= until {
                    break;
                }
                // Stop them all first, so none forks while the others die.
                for pid in &left {
                    let _ = kill(*pid, Signal::SIGSTOP);
                }
                for pid in &left {
                    let _ = kill(*pid, Signal::SIGKILL);
                }
                reaper.reap();
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        _ => {
            cgroup.kill_all(KILL_WAIT);
        }
    }
}

/// A container task's container goes with its helper: removed by force
/// through `PROGRAM container-task kill` (waited for, at most
/// [`CONTAINER_KILL_WAIT`]).
fn kill_container(task: &TaskRecord, tasks_dir: &Path, key: &str) {
    if task.container.is_none() {
        return;
    }
    let Ok(program) = std::env::current_exe() else {
        return;
    };
    let state_dir = tasks_dir.parent().unwrap_or(tasks_dir);
    let Ok(mut child) = std::process::Command::new(program)
        .arg("container-task")
        .arg("kill")
        .arg(state_dir)
        .arg(key)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
    else {
        return;
    };
    let until = Instant::now() + CONTAINER_KILL_WAIT;
    let child_pid = Pid::from_raw(child.id() as i32);
    loop {
        match waitpid(child_pid, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(WaitStatus::StillAlive) => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            _ => return,
        }
    }
}

/// How long removing a container may take.
const CONTAINER_KILL_WAIT: Duration = Duration::from_secs(20);

/// Reaps the supervisor's children (the task's leader, and every orphan of
/// the task, since the supervisor is their subreaper), keeping the leader's
/// status.
struct Reaper {
    leader: Pid,
    status: Option<WaitStatus>,
}

impl Reaper {
    /// Reaps every child that has ended.
    fn reap(&mut self) {
        loop {
            match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => return,
                Ok(status) => {
                    if status.pid() == Some(self.leader) {
                        self.status = Some(status);
                    }
                }
            }
        }
    }

    /// Whether no child is left at all.
    fn childless(&self) -> bool {
        matches!(
            waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)),
            Err(nix::errno::Errno::ECHILD)
        )
    }
}

struct Stopping {
    kill_at: Instant,
    killed: bool,
}

/// Waits for the task to end (by itself, stopped or fenced), then kills
/// what it left behind and says how it ended.
fn watch(
    task: &TaskRecord,
    tasks_dir: &Path,
    key: &str,
    pid: Pid,
    cgroup: &TaskCgroup,
    signals: &SignalFd,
    init: Option<std::fs::File>,
) -> ExitRecord {
    let stop_path = record::path(tasks_dir, key, "stop");
    let mut reason: Option<EndReason> = None;
    let mut stopping: Option<Stopping> = None;
    let mut killed_after_grace = false;
    let mut reaper = Reaper {
        leader: pid,
        status: None,
    };
    let status = loop {
        reaper.reap();
        if let Some(status) = reaper.status {
            break status;
        }
        let now = record::now_ms();
        let deadline = fence_deadline(&task.fence_file);
        let fenced = deadline.is_none_or(|deadline| now >= deadline);
        if fenced && !stopping.as_ref().is_some_and(|s| s.killed) {
            reason.get_or_insert(EndReason::Fenced);
            kill_everything(cgroup, pid, &mut reaper);
            kill_container(task, tasks_dir, key);
            stopping = Some(Stopping {
                kill_at: Instant::now(),
                killed: true,
            });
            continue;
        }
        if stopping.is_none()
            && let Ok(request) = record::read_json::<StopRequest>(&stop_path)
        {
            reason = Some(if request.fenced {
                EndReason::Fenced
            } else {
                EndReason::Stopped
            });
            signal_everything(cgroup, pid, parse_signal(&request.signal));
            stopping = Some(Stopping {
                kill_at: Instant::now() + Duration::from_millis(request.grace_ms),
                killed: false,
            });
        }
        if let Some(stop) = &mut stopping
            && !stop.killed
            && Instant::now() >= stop.kill_at
        {
            killed_after_grace = true;
            kill_everything(cgroup, pid, &mut reaper);
            kill_container(task, tasks_dir, key);
            stop.killed = true;
        }
        // Sleep until something can have changed: a signal (a child ended,
        // the agent asks to stop), the fence deadline, the end of a grace
        // period; at most LONGEST_SLEEP_MS.
        let mut sleep_ms = LONGEST_SLEEP_MS;
        if let Some(deadline) = deadline {
            sleep_ms = sleep_ms.min(deadline.saturating_sub(now) + 1);
        }
        if let Some(stop) = &stopping {
            let left = stop.kill_at.saturating_duration_since(Instant::now());
            sleep_ms = sleep_ms.min(if stop.killed {
                50
            } else {
                left.as_millis() as u64 + 1
            });
        }
        let mut fds = [nix::poll::PollFd::new(
            signals.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let timeout = nix::poll::PollTimeout::try_from(sleep_ms.max(1))
            .unwrap_or(nix::poll::PollTimeout::MAX);
        let _ = nix::poll::poll(&mut fds, timeout);
        while let Ok(Some(_)) = signals.read_signal() {}
    };
    // Whatever the task left behind goes with it.
    kill_everything(cgroup, pid, &mut reaper);
    kill_container(task, tasks_dir, key);
    let until = Instant::now() + KILL_WAIT;
    while Instant::now() < until {
        reaper.reap();
        if reaper.childless() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let mut usage = cgroup.usage();
    let _ = cgroup.remove();
    // A container's memory is in the engine's cgroup: its helper leaves a
    // mark when the kernel killed it there.
    if task.container.is_some() {
        let mark = record::path(tasks_dir, key, "oom");
        if std::fs::remove_file(&mark).is_ok() {
            usage.oom_killed = true;
        }
        // A helper killed while it pulled leaves its progress behind: the
        // task is not pulling any more.
        for extension in ["pull", "pull.tmp"] {
            let _ = std::fs::remove_file(record::path(tasks_dir, key, extension));
        }
    }
    let (mut exit_code, mut signal) = match status {
        WaitStatus::Exited(_, code) => (Some(code), None),
        WaitStatus::Signaled(_, signal, _) => (None, Some(signal as i32)),
        _ => (None, None),
    };
    // Under an init, how its command ended (an init killed from outside
    // said nothing: then how the init ended is the task's end).
    if let Some(mut pipe) = init {
        use std::io::Read;
        let mut text = String::new();
        let _ = (&mut pipe).take(64 * 1024).read_to_string(&mut text);
        if let Some((code, number)) = crate::taskinit::final_status(&text) {
            (exit_code, signal) = (code, number);
        }
    }
    let reason = match reason {
        Some(reason) => reason,
        None if usage.oom_killed && exit_code != Some(0) => EndReason::MemoryLimit,
        None => EndReason::Exited,
    };
    ExitRecord {
        exit_code,
        signal,
        reason,
        killed_after_grace,
        usage,
        ended_at_ms: record::now_ms(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user(name: &str, uid: u32) -> TaskUser {
        TaskUser {
            name: name.to_string(),
            uid,
            gid: uid,
            home: PathBuf::from("/home").join(name),
        }
    }

    fn lookup(name: &str) -> Option<TaskUser> {
        match name {
            "root" => Some(user("root", 0)),
            "alice" => Some(user("alice", 1000)),
            "nobody" => Some(user("nobody", 65534)),
            _ => None,
        }
    }

    fn plan(job_user: Option<&str>, dynamic_uid: Option<u32>, allow_root: bool) -> UserPlan {
        UserPlan {
            job_user: job_user.map(str::to_string),
            dynamic_uid,
            dynamic_gid: None,
            fallback: None,
            allow_root,
        }
    }

    #[test]
    fn a_task_runs_as_its_user_else_its_own_uid_and_never_as_root_unless_allowed() {
        let chosen = |plan: UserPlan| choose_user(true, &plan, lookup).unwrap().unwrap();
        assert_eq!(chosen(plan(Some("alice"), None, false)).uid, 1000);
        // Unknown here: the task's own uid, with a name of its own.
        let bob = chosen(plan(Some("bob"), Some(200_007), false));
        assert_eq!((bob.uid, bob.gid), (200_007, NOGROUP));
        assert_eq!(bob.name, "muster-task-200007");
        // With his group number's gid: in it, on every node and attempt.
        let grouped = UserPlan {
            dynamic_gid: Some(200_003),
            ..plan(Some("bob"), Some(200_011), false)
        };
        let grouped = chosen(grouped);
        assert_eq!((grouped.uid, grouped.gid), (200_011, 200_003));
        assert_eq!(chosen(plan(None, Some(200_008), false)).uid, 200_008);
        // The job says root: not without the operator's word.
        assert_eq!(
            chosen(plan(Some("root"), Some(200_009), false)).uid,
            200_009
        );
        assert_eq!(chosen(plan(Some("root"), Some(200_009), true)).uid, 0);
        // No uid given and no account: refused, never a shared user.
        let error = choose_user(true, &plan(Some("bob"), None, false), lookup).unwrap_err();
        assert!(error.contains("no account"), "{error}");
        // An older agent's record with a fallback user still reads.
        let old = UserPlan {
            fallback: Some("nobody".to_string()),
            ..plan(Some("bob"), None, false)
        };
        assert_eq!(chosen(old).name, "nobody");
        let old_root = UserPlan {
            fallback: Some("root".to_string()),
            ..plan(None, None, false)
        };
        assert!(choose_user(true, &old_root, lookup).is_err());
        // An agent that is not root cannot switch at all.
        assert_eq!(
            choose_user(false, &plan(Some("alice"), Some(200_010), false), lookup),
            Ok(None)
        );
    }

    #[test]
    fn pids_are_written_in_decimal() {
        let mut buffer = [0u8; 16];
        assert_eq!(digits(0, &mut buffer), b"0");
        assert_eq!(digits(4_194_304, &mut buffer), b"4194304");
        assert_eq!(digits(i32::MAX, &mut buffer), b"2147483647");
    }
}
