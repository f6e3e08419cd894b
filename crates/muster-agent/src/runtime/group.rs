//! Process groups: finding a group's members of one user (the agent's last
//! resort for a task whose supervisor is gone), and the nix signal of a
//! job's stop signal.

use super::RuntimeError;
use nix::sys::signal;
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

/// The live processes of process group `pgid` that run as `uid`, from
/// `/proc` (empty for a group that can never be a task's).
pub(super) fn members_of_user(pgid: i32, uid: u32) -> Vec<Pid> {
    if check_pgid(pgid).is_err() {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut members = Vec::new();
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        // Processes come and go while we look: skip the ones that went.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        if stat_group(&stat) == Some(pgid) && status_uid(&status) == Some(uid) {
            members.push(Pid::from_raw(pid));
        }
    }
    members
}

/// The process group from `/proc/PID/stat` (`PID (COMM) STATE PPID PGRP
/// ...`, where COMM may hold spaces and parens), unless it is a zombie.
fn stat_group(stat: &str) -> Option<i32> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?;
    let _parent = fields.next()?;
    let group = fields.next()?.parse().ok()?;
    (state != "Z" && state != "X").then_some(group)
}

/// The real uid from `/proc/PID/status`.
fn status_uid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;

    #[test]
    fn refuses_groups_that_are_never_a_tasks() {
        for pgid in [-5, 0, 1, getpgrp().as_raw()] {
            assert!(matches!(
                check_pgid(pgid),
                Err(RuntimeError::InvalidProcessGroup { .. })
            ));
        }
    }

    #[test]
    fn reads_group_and_uid_from_proc_files() {
        assert_eq!(stat_group("123 (sleep) S 1 120 120 0 -1"), Some(120));
        assert_eq!(stat_group("123 (a) b) (c) R 1 77 77 0"), Some(77));
        assert_eq!(
            stat_group("123 (x) Z 1 77 77 0"),
            None,
            "zombies do not count"
        );
        assert_eq!(stat_group("garbage"), None);
        assert_eq!(
            status_uid("Name:\tsh\nUid:\t65534\t65534\t65534\t65534\n"),
            Some(65534)
        );
        assert_eq!(status_uid("Name:\tsh\n"), None);
        // A child leading its own group, as this test's user.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .expect("sleep starts");
        let pgid = child.id() as i32;
        let uid = nix::unistd::getuid().as_raw();
        assert_eq!(members_of_user(pgid, uid), vec![Pid::from_raw(pgid)]);
        assert!(members_of_user(pgid, uid + 1).is_empty(), "another user's");
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            members_of_user(getpgrp().as_raw(), uid).is_empty(),
            "never ours"
        );
        assert!(members_of_user(1, 0).is_empty());
    }
}
