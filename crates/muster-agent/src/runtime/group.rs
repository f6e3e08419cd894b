//! Process groups: signalling them, and telling whether any member is left.

use super::RuntimeError;
use nix::errno::Errno;
use nix::sys::signal::{self, killpg};
use nix::unistd::{Pid, getpgrp};

/// The nix signal for a job's stop signal.
pub(crate) fn to_nix(signal: muster_model::Signal) -> signal::Signal {
    use muster_model::Signal;
    match signal {
        Signal::Term => signal::Signal::SIGTERM,
        Signal::Int => signal::Signal::SIGINT,
        Signal::Hup => signal::Signal::SIGHUP,
        Signal::Quit => signal::Signal::SIGQUIT,
        Signal::Usr1 => signal::Signal::SIGUSR1,
        Signal::Usr2 => signal::Signal::SIGUSR2,
    }
}

/// Refuses process groups that are never a task's: 0 and 1 (which `killpg`
/// would take as "my own group" and "init"), negatives, and the agent's own
/// group. A pid file is data from outside: this is what keeps a damaged one
/// from making the agent signal itself.
pub(super) fn check_pgid(pgid: i32) -> Result<Pid, RuntimeError> {
    if pgid <= 1 || Pid::from_raw(pgid) == getpgrp() {
        return Err(RuntimeError::InvalidProcessGroup { pgid });
    }
    Ok(Pid::from_raw(pgid))
}

/// Sends `signal` to every process of the group. A group that no longer
/// exists is not an error.
pub(super) fn signal_group(pgid: i32, signal: signal::Signal) -> Result<(), RuntimeError> {
    let group = check_pgid(pgid)?;
    match killpg(group, signal) {
        Ok(()) | Err(Errno::ESRCH) => Ok(()),
        Err(source) => Err(RuntimeError::Signal {
            pgid,
            signal: signal.as_str(),
            source,
        }),
    }
}

/// Whether any process of the group is still running.
///
/// `killpg(pgid, 0)` alone is not enough: it also succeeds for zombies, and
/// a task's grandchildren become zombies of whatever reaps orphans (PID 1,
/// which in some containers never reaps). So when the group answers, its
/// members are looked up in `/proc` and zombies do not count. Where `/proc`
/// cannot be read, the group counts as alive.
pub fn group_alive(pgid: i32) -> bool {
    let Ok(group) = check_pgid(pgid) else {
        return false;
    };
    match killpg(group, None) {
        Err(Errno::ESRCH) => false,
        // EPERM: the group exists but is not ours to signal.
        Ok(()) | Err(_) => has_running_member(pgid).unwrap_or(true),
    }
}

/// `Some(true)` when a process of the group is in a state other than zombie
/// or dead; `None` when `/proc` cannot be read.
fn has_running_member(pgid: i32) -> Option<bool> {
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        // Processes come and go while we look: skip the ones that went.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((state, group)) = parse_stat(&stat)
            && group == pgid
            && state != 'Z'
            && state != 'X'
        {
            return Some(true);
        }
    }
    Some(false)
}

/// The state and process group from `/proc/PID/stat`:
/// `PID (COMM) STATE PPID PGRP ...`, where COMM may hold spaces and parens.
fn parse_stat(stat: &str) -> Option<(char, i32)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let _parent = fields.next()?;
    let group = fields.next()?.parse().ok()?;
    Some((state, group))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_lines_with_odd_command_names() {
        assert_eq!(parse_stat("123 (sleep) S 1 120 120 0 -1"), Some(('S', 120)));
        assert_eq!(parse_stat("123 (a) b) (c) Z 1 77 77 0"), Some(('Z', 77)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) R"), None);
    }

    #[test]
    fn refuses_groups_that_are_never_a_tasks() {
        for pgid in [-5, 0, 1, getpgrp().as_raw()] {
            assert!(matches!(
                check_pgid(pgid),
                Err(RuntimeError::InvalidProcessGroup { .. })
            ));
            assert!(!group_alive(pgid));
            assert!(signal_group(pgid, signal::Signal::SIGKILL).is_err());
        }
    }

    #[test]
    fn a_group_that_never_existed_is_not_alive() {
        // Pids are below 2^22 on Linux.
        assert!(!group_alive(i32::MAX - 7));
        assert!(signal_group(i32::MAX - 7, signal::Signal::SIGTERM).is_ok());
    }
}
