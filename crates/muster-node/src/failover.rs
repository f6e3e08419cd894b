//! How long a node's lease must last for its agent to keep its tasks
//! through a pause (or crash) of the leader of several servers.
//!
//! The agent fences `lease - fence margin` after it sent its last answered
//! heartbeat, which may be two heartbeat periods before the pause (a long
//! poll sent a period after the one before, held up to a period). The
//! follower takes the leader's lease up to 1.25 leader leases into the
//! pause (it ends a lease after the last renewal; followers look every
//! quarter lease), half a lease more when the leader stopped inside a
//! transaction (PostgreSQL ends that session after half a leader lease
//! idle). Then the agent needs one try at the new leader, an answer
//! margin. The default adds a leader lease for the new leader to load the
//! cluster's state.

use crate::core::ANSWER_MARGIN_MS;

/// The agent's fence margin unless configured otherwise.
pub const DEFAULT_FENCE_MARGIN_MS: u64 = 3_000;

/// The shortest node lease an agent heartbeating every `heartbeat_ms`
/// rides a takeover through, with a leader lease of `leader_lease_ms`.
pub fn least_lease_through_failover_ms(leader_lease_ms: u64, heartbeat_ms: u64) -> u64 {
    leader_lease_ms * 7 / 4 + 2 * heartbeat_ms + DEFAULT_FENCE_MARGIN_MS + ANSWER_MARGIN_MS
}

/// The node lease of servers sharing one store: `given` when it is long
/// enough, by default [`least_lease_through_failover_ms`] plus a leader
/// lease, and at least `single_server_ms` (the lease of a server on its
/// own). Too short a `given` is refused, saying what would do.
pub fn lease_through_failover_ms(
    given: Option<u64>,
    leader_lease_ms: u64,
    heartbeat_ms: u64,
    single_server_ms: u64,
) -> Result<u64, String> {
    let least = least_lease_through_failover_ms(leader_lease_ms, heartbeat_ms);
    match given {
        None => Ok((least + leader_lease_ms).max(single_server_ms)),
        Some(lease) if lease >= least => Ok(lease),
        Some(lease) => Err(format!(
            "--lease {lease} ms is too short for --leader-lease {leader_lease_ms} ms: a node's \
             lease must outlast a pause of the leader (up to 1.75 leader leases before another \
             server has taken over) plus two heartbeat periods, the agent's fence margin and \
             a try at the new leader; give --lease {least} ms or more, a shorter \
             --leader-lease, or leave --lease out"
        )),
    }
}
