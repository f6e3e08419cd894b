//! A task's init: the first process (pid 1) of a task's own PID
//! namespace, which its supervisor creates (`unshare(CLONE_NEWPID)`, then
//! a fork that runs [`run_plan`]: no second exec of this program); `muster
//! task-init --probe` tells whether a host allows it.
//!
//! As root, it makes the task a mount namespace of its own: mounts made
//! private, a fresh tmpfs on `/tmp` and on `/dev/shm` (they vanish with the
//! namespace, when the task's last process is gone), and `/proc` mounted
//! anew for the PID namespace, so the task sees only its own processes.
//! Bound back where they were: a working directory under `/tmp` or
//! `/dev/shm` (other than those themselves), so a task submitted from there
//! still finds its files; and the host's `/tmp` entries that root owns (the
//! operator's: a checkout, a scratch directory made for sharing; at most
//! 256), never an entry of a tenant's, whose files are owned by its uid. Then it drops to the task's user, starts the
//! command in its own process group, reaps every orphan of the namespace,
//! and, when the command's process ends, writes how it ended to its
//! standard input (the write end of a pipe its supervisor reads; the
//! command's own standard input is `/dev/null`) and exits: the kernel then kills whatever is left in the
//! namespace.
//!
//! Its supervisor, outside the namespace, still signals and kills every
//! process of the task (by process group, cgroup and descendants); a kill
//! of this init kills the whole namespace. Signals from inside the
//! namespace cannot reach it (an init has no handlers), so a task cannot
//! end its own init early except by ending its command.
//!
//! The status pipe gets lines: `started` once the command runs, or
//! `failed MESSAGE` when it could not be started; then `exit CODE` or
//! `signal NUMBER` at its end.

use nix::mount::MsFlags;
use nix::sys::wait::{WaitStatus, waitpid};
use nix::unistd::{Gid, Pid, Uid};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// What the supervisor asks of an init.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitPlan {
    /// (uid, gid, supplementary groups) to drop to; `None`: stay.
    pub user: Option<(u32, u32, Vec<u32>)>,
    /// The task's working directory (absolute).
    pub working_dir: PathBuf,
    pub command: Vec<String>,
    /// The command's environment (nothing of the supervisor's).
    pub env: std::collections::BTreeMap<String, String>,
}

/// `task-init --probe`: exit 0 when namespaces can be made, else 1 with
/// why on stderr (see [`probe`]). A task's init itself is forked by its
/// supervisor ([`run_plan`]), never started by name.
pub fn entry(args: &[String]) -> i32 {
    if args.first().map(String::as_str) != Some("--probe") || args.len() != 1 {
        eprintln!("usage: muster task-init --probe (run by the agent at its start)");
        return 2;
    }
    match probe() {
        Ok(()) => 0,
        Err(why) => {
            eprintln!("{why}");
            1
        }
    }
}

/// Whether `SUPERVISOR task-init --probe` can give tasks namespaces on this
/// host; the error says why not.
pub fn namespaces_available(supervisor: &Path) -> Result<(), String> {
    let output = std::process::Command::new(supervisor)
        .args(["task-init", "--probe"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", supervisor.display()))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&output.stderr).trim().to_string())
    }
}

/// Is the init: makes the mounts, starts the command, reaps until it ends
/// and says how on standard input. Returns the init's exit code. The
/// supervisor calls it in the child it forks (no second exec of this
/// program: the cheaper start).
pub fn run_plan(plan: &InitPlan) -> i32 {
    match run(plan) {
        Ok(child) => {
            tell("started");
            let ended = reap_until(child);
            match ended {
                WaitStatus::Exited(_, code) => {
                    tell(&format!("exit {code}"));
                    code
                }
                WaitStatus::Signaled(_, signal, _) => {
                    tell(&format!("signal {}", signal as i32));
                    128 + signal as i32
                }
                _ => {
                    tell("exit 1");
                    1
                }
            }
        }
        Err(message) => {
            tell(&format!("failed {}", message.replace('\n', " ")));
            127
        }
    }
}

/// Writes a status line to standard input (the supervisor's pipe); a
/// supervisor gone is no reason to fail.
fn tell(line: &str) {
    let text = format!("{line}\n");
    let _ = nix::unistd::write(std::io::stdin().as_fd(), text.as_bytes());
}

/// Makes the task's mounts, drops to its user and starts its command.
fn run(plan: &InitPlan) -> Result<Pid, String> {
    private_mounts(&plan.working_dir)?;
    std::env::set_current_dir(&plan.working_dir).map_err(|error| {
        format!(
            "cannot enter the working directory {}: {error}",
            plan.working_dir.display()
        )
    })?;
    if let Some((uid, gid, groups)) = &plan.user {
        let groups: Vec<Gid> = groups.iter().map(|g| Gid::from_raw(*g)).collect();
        nix::unistd::setgroups(&groups).map_err(|e| format!("setgroups: {e}"))?;
        nix::unistd::setgid(Gid::from_raw(*gid)).map_err(|e| format!("setgid: {e}"))?;
        nix::unistd::setuid(Uid::from_raw(*uid)).map_err(|e| format!("setuid: {e}"))?;
    }
    let child = std::process::Command::new(&plan.command[0])
        .args(&plan.command[1..])
        .env_clear()
        .envs(&plan.env)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|error| format!("cannot start `{}`: {error}", plan.command[0]))?;
    Ok(Pid::from_raw(child.id() as i32))
}

/// The task's own mounts: everything private to this namespace, a fresh
/// `/tmp` and `/dev/shm`, `/proc` of this PID namespace.
fn private_mounts(working_dir: &Path) -> Result<(), String> {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)
        .map_err(|e| format!("cannot make a mount namespace: {e}"))?;
    nix::mount::mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(|e| format!("cannot make mounts private: {e}"))?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    for dir in ["/tmp", "/dev/shm"] {
        let dir = Path::new(dir);
        if !dir.is_dir() {
            continue;
        }
        // What stays visible, held by open handles and bound back once the
        // fresh one is mounted: the working directory, if under this one;
        // and in /tmp, the operator's entries (owned by root: a checkout, a
        // shared scratch directory), never a tenant's.
        // Each with whether the task needs it: the working directory does;
        // an operator's entry removed since the scan is left out.
        let mut keep: Vec<(PathBuf, Kept, bool)> = Vec::new();
        if let Ok(rest) = working_dir.strip_prefix(dir)
            && !rest.as_os_str().is_empty()
        {
            keep.push((working_dir.to_path_buf(), hold(working_dir)?, true));
        }
        if dir == Path::new("/tmp") {
            keep.extend(
                operators_entries(dir)
                    .into_iter()
                    .map(|(path, kept)| (path, kept, false)),
            );
        }
        nix::mount::mount(Some("tmpfs"), dir, Some("tmpfs"), flags, Some("mode=1777"))
            .map_err(|e| format!("cannot mount a private {}: {e}", dir.display()))?;
        // Deepest last: the working directory may lie inside a kept entry.
        keep.sort_by_key(|(path, _, _)| path.components().count());
        for (path, kept, needed) in keep {
            match bind_back(&path, kept) {
                Ok(()) => {}
                Err(why) if needed => return Err(why),
                // Removed from the host's /tmp meanwhile (its handle names
                // a deleted entry): gone there too.
                Err(_) => {
                    let _ = std::fs::remove_file(&path).or_else(|_| std::fs::remove_dir(&path));
                }
            }
        }
    }
    nix::mount::mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        flags | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(|e| format!("cannot mount the task's /proc: {e}"))?;
    Ok(())
}

/// The most entries of the host's `/tmp` kept in a task's: past it, the
/// rest are not (said on the task's log).
const MOST_KEPT: usize = 256;

/// An entry of the host's `/tmp` (or the working directory) held open
/// while the fresh one is mounted over it.
enum Kept {
    /// A directory or file (or socket, FIFO), by an `O_PATH` handle.
    Path {
        handle: std::os::fd::OwnedFd,
        dir: bool,
    },
    /// A symbolic link, made again with the same target.
    Link(PathBuf),
}

fn hold(path: &Path) -> Result<Kept, String> {
    use nix::fcntl::OFlag;
    let metadata = std::fs::symlink_metadata(path)
        .map_err(|e| format!("cannot look at {}: {e}", path.display()))?;
    if metadata.file_type().is_symlink() {
        let target = std::fs::read_link(path)
            .map_err(|e| format!("cannot read the link {}: {e}", path.display()))?;
        return Ok(Kept::Link(target));
    }
    let handle = nix::fcntl::open(
        path,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    Ok(Kept::Path {
        handle,
        dir: metadata.is_dir(),
    })
}

/// The entries of `dir` that root owns, held (at most [`MOST_KEPT`]).
fn operators_entries(dir: &Path) -> Vec<(PathBuf, Kept)> {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut kept = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        let owned_by_root = std::fs::symlink_metadata(&path).is_ok_and(|m| m.uid() == 0);
        if !owned_by_root {
            continue;
        }
        if kept.len() == MOST_KEPT {
            eprintln!(
                "muster: only {MOST_KEPT} of the host's /tmp entries are kept in the task's /tmp"
            );
            break;
        }
        if let Ok(held) = hold(&path) {
            kept.push((path, held));
        }
    }
    kept
}

/// Puts a held entry back at `path`, in the fresh mount above it.
fn bind_back(path: &Path, kept: Kept) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let made = |e: std::io::Error| format!("cannot keep {}: {e}", path.display());
    match kept {
        Kept::Link(target) => {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(made)?;
            }
            std::os::unix::fs::symlink(&target, path).map_err(made)
        }
        Kept::Path { handle, dir } => {
            if dir {
                std::fs::create_dir_all(path).map_err(made)?;
            } else {
                if let Some(parent) = path.parent() {
                    std::fs::create_dir_all(parent).map_err(made)?;
                }
                std::fs::File::create(path).map_err(made)?;
            }
            let source = format!("/proc/self/fd/{}", handle.as_raw_fd());
            nix::mount::mount(
                Some(source.as_str()),
                path,
                None::<&str>,
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .map_err(|e| format!("cannot keep {}: {e}", path.display()))
        }
    }
}

/// Reaps every process that ends in the namespace (orphans come to the
/// init) until `leader` ends; returns how it ended.
fn reap_until(leader: Pid) -> WaitStatus {
    loop {
        match waitpid(Pid::from_raw(-1), None) {
            Ok(status) if status.pid() == Some(leader) => match status {
                WaitStatus::Exited(..) | WaitStatus::Signaled(..) => return status,
                _ => continue,
            },
            Ok(_) => continue,
            Err(nix::errno::Errno::EINTR) => continue,
            // No child left at all: the leader is gone without a status.
            Err(_) => return WaitStatus::Exited(leader, 1),
        }
    }
}

/// Whether this host lets the supervisor give tasks PID and mount
/// namespaces: `muster task-init --probe` makes both and a task's mounts
/// ([`private_mounts`]), then exits. Run in a process of its own.
pub fn probe() -> Result<(), String> {
    // The very mounts a task gets, in a process of its own that exits.
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWPID)
        .map_err(|e| format!("cannot make a PID namespace: {e}"))?;
    private_mounts(Path::new("/"))
}

/// How a task ended, from its init's status lines (the last `exit` or
/// `signal` line): (exit code, signal).
pub fn final_status(text: &str) -> Option<(Option<i32>, Option<i32>)> {
    text.lines().rev().find_map(|line| {
        let (word, number) = line.trim().split_once(' ')?;
        let number = number.trim().parse::<i32>().ok()?;
        match word {
            "exit" => Some((Some(number), None)),
            "signal" => Some((None, Some(number))),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_status_line_says_how_the_task_ended() {
        assert_eq!(final_status("started\nexit 3\n"), Some((Some(3), None)));
        assert_eq!(final_status("started\nsignal 15\n"), Some((None, Some(15))));
        assert_eq!(final_status("started\n"), None);
        assert_eq!(final_status(""), None);
    }
}
