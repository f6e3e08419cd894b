//! Process groups: signalling them (the agent's last resort for a task
//! whose supervisor is gone), and the nix signal of a job's stop signal.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_groups_that_are_never_a_tasks() {
        for pgid in [-5, 0, 1, getpgrp().as_raw()] {
            assert!(matches!(
                check_pgid(pgid),
                Err(RuntimeError::InvalidProcessGroup { .. })
            ));
            assert!(signal_group(pgid, signal::Signal::SIGKILL).is_err());
        }
    }

    #[test]
    fn signalling_a_group_that_never_existed_is_fine() {
        // Pids are below 2^22 on Linux.
        assert!(signal_group(i32::MAX - 7, signal::Signal::SIGTERM).is_ok());
    }
}
