//! High availability: several `muster server` processes on one PostgreSQL
//! store, one of them the leader.
//!
//! Leadership is a row in the store (`leader`: term, holder, address and
//! when the lease ends, on the database's clock, so the servers' clocks do
//! not matter). A server takes the lease when it has ended, with the next
//! term; the leader renews it every [`HaConfig::renew_every`]. Every write
//! of the leader's store carries its term ([`SqlStore::fenced`]): the
//! transaction first reads the row `FOR SHARE` and gives up unless the term
//! is still its own, and a takeover, which updates the row, waits for the
//! writes in flight. So once a follower holds the next term, nothing the
//! deposed leader writes lands, however late it wakes up: its writer fails
//! closed (the server turns read-only) and this loop steps it down.
//!
//! A follower keeps no state: it forwards every request, reads and writes
//! alike, to the leader's advertised URL (answering 503 with Retry-After
//! while there is none), so agents and users may name any server. When it
//! takes the lease it stops forwarding and starts as a server, loading the
//! state from the store as a restarted server does (nodes get a fresh
//! lease, so running tasks keep running).

use crate::store::{Leadership, SqlStore, StoreLocation, StoreOptions};
use crate::{Server, ServerConfig, ServerHandle};
use anyhow::Context;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// What every server of one cluster shares, relative to the data
/// directory (docs/ha.md): the tokens, the secrets' key and the cluster CA
/// (each server issues its own certificate from it).
pub const SHARED_FILES: [&str; 6] = [
    "admin.token",
    "join.token",
    "metrics.token",
    "secrets.key",
    "tls/ca.pem",
    "tls/ca.key",
];

/// Copies [`SHARED_FILES`] from one server's data directory to another's
/// (created owner-only), for a second server of the same cluster.
pub fn share_identity(from: &std::path::Path, to: &std::path::Path) -> std::io::Result<()> {
    crate::create_private_dir(&to.join("tls"))?;
    for name in SHARED_FILES {
        std::fs::copy(from.join(name), to.join(name))?;
    }
    Ok(())
}

/// How a server takes part in the election.
#[derive(Debug, Clone)]
pub struct HaConfig {
    /// This process's name in the `leader` row (unique per start: a
    /// restarted server never takes itself for the leader it was).
    pub id: String,
    /// The URL other servers forward to while this one leads.
    pub advertise: String,
    /// How long a lease lasts unless renewed.
    pub lease: Duration,
}

impl HaConfig {
    pub const DEFAULT_LEASE: Duration = Duration::from_secs(4);

    /// A fresh id: the host, the process and a random part.
    pub fn new_id() -> String {
        let mut random = [0u8; 4];
        let _ = getrandom::fill(&mut random);
        format!(
            "{}-{}-{:08x}",
            host_name(),
            std::process::id(),
            u32::from_be_bytes(random)
        )
    }

    /// How often the leader renews, and followers look: a quarter of the
    /// lease.
    pub fn renew_every(&self) -> Duration {
        (self.lease / 4).max(Duration::from_millis(100))
    }
}

/// How long a leader's database session may sit idle inside a transaction
/// before PostgreSQL ends it (`idle_in_transaction_session_timeout`): a
/// leader stopped mid-transaction holds the `leader` row's share lock,
/// which the takeover must wait for. Half a leader lease, at least 1 s:
/// no healthy leader idles that long between two statements.
pub fn idle_transaction_limit(leader: Duration) -> Duration {
    (leader / 2).max(Duration::from_secs(1))
}

/// When the leader last renewed its lease, for the handlers: a leader
/// answers a heartbeat (a lease renewal for the node) only while its own
/// lease is surely current. `Instant` runs on while the process is stopped,
/// so a leader woken from a pause longer than its lease refuses until it
/// has renewed again, or stepped down, instead of answering from what it
/// knew before.
#[derive(Debug)]
pub struct LeaseClock {
    base: Instant,
    /// Milliseconds from `base` to the start of the last renewal that
    /// succeeded.
    renewed_ms: std::sync::atomic::AtomicU64,
    lease: Duration,
}

impl LeaseClock {
    /// A lease taken by an attempt that started at `at`.
    pub fn new(lease: Duration, at: Instant) -> Arc<LeaseClock> {
        let clock = Arc::new(LeaseClock {
            base: at,
            renewed_ms: std::sync::atomic::AtomicU64::new(0),
            lease,
        });
        clock.renewed(at);
        clock
    }

    /// How long the lease lasts unless renewed.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// A renewal that started at `at` succeeded.
    pub fn renewed(&self, at: Instant) {
        let ms = at.saturating_duration_since(self.base).as_millis() as u64;
        self.renewed_ms
            .fetch_max(ms, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether the lease is current at `now` (its last renewal less than a
    /// lease ago); `Err` says how long ago it was.
    pub fn current(&self, now: Instant) -> Result<(), Duration> {
        let renewed = self.base
            + Duration::from_millis(self.renewed_ms.load(std::sync::atomic::Ordering::SeqCst));
        let since = now.saturating_duration_since(renewed);
        if since < self.lease {
            Ok(())
        } else {
            Err(since)
        }
    }
}

/// This machine's name (`localhost` when it cannot be read).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|name| name.trim().to_string())
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

/// What the loop reports, for the CLI and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    Starting,
    Follower { leader: Option<String> },
    Leader { term: i64 },
}

/// Runs the server under the election until `stop` is set: follower
/// (forwarding) or leader (serving), as the lease says.
pub async fn run(
    mut config: ServerConfig,
    ha: HaConfig,
    mut stop: watch::Receiver<bool>,
    role: watch::Sender<Role>,
) -> anyhow::Result<()> {
    let location = config
        .store
        .clone()
        .context("high availability needs a PostgreSQL store (--store postgres://...)")?;
    if !matches!(location, StoreLocation::Postgres(_)) {
        anyhow::bail!(
            "high availability needs a PostgreSQL store (--store postgres://...); an SQLite \
             file is one server's"
        );
    }
    let election = SqlStore::open_at(&location, StoreOptions::default()).await?;
    let mut forwarder: Option<crate::forward::Forwarder> = None;
    let followed = watch::Sender::new(crate::forward::Leader::default());
    loop {
        if *stop.borrow() {
            break;
        }
        let attempt = Instant::now();
        match election.lead(&ha.id, &ha.advertise, None, ha.lease).await {
            Ok(Leadership::Leader { term }) => {
                if let Some(forwarder) = forwarder.take() {
                    forwarder.stop().await;
                }
                tracing::info!(term, id = %ha.id, "leading");
                let mut leading = config.clone();
                leading.fence_term = Some(term);
                let clock = LeaseClock::new(ha.lease, attempt);
                leading.leadership = Some(clock.clone());
                let handle = match Server::start(leading).await {
                    Ok(handle) => handle,
                    Err(error) => {
                        tracing::error!("cannot start as the leader: {error:#}");
                        election.resign(&ha.id, term).await.ok();
                        tokio::time::sleep(ha.renew_every()).await;
                        continue;
                    }
                };
                // A store copied once (--migrate-from) is not copied again.
                config.migrate_from = None;
                let _ = role.send(Role::Leader { term });
                let lost = lead(&election, &ha, term, &handle, &clock, &mut stop).await;
                handle.shutdown().await;
                match lost {
                    None => {
                        election.resign(&ha.id, term).await.ok();
                        break;
                    }
                    Some(reason) => tracing::warn!(term, "no longer the leader: {reason}"),
                }
            }
            Ok(Leadership::Follower { leader, lease_left }) => {
                let url = leader.map(|(url, _)| url);
                // Renewed every quarter lease, a lease under half left
                // means renewals were missed: the leader may be stopped or
                // cut off, and requests are not sent into the void.
                let silent = url.is_some() && lease_left < ha.lease / 2;
                let next = crate::forward::Leader {
                    url: url.clone(),
                    silent,
                };
                if *followed.borrow() != next {
                    followed.send_replace(next);
                }
                if forwarder.is_none() {
                    match crate::forward::Forwarder::start(&config, followed.subscribe()).await {
                        Ok(started) => forwarder = Some(started),
                        // The address may still be held by the server this
                        // process just stopped: try again next round.
                        Err(error) => tracing::warn!("cannot forward yet: {error:#}"),
                    }
                }
                // Told once per change: the loop looks every quarter lease.
                let following = Role::Follower { leader: url };
                role.send_if_modified(|now| {
                    let changed = *now != following;
                    if changed {
                        *now = following;
                    }
                    changed
                });
                tokio::select! {
                    _ = tokio::time::sleep(ha.renew_every()) => {}
                    _ = stop.changed() => {}
                }
            }
            Err(error) => {
                tracing::warn!("cannot reach the store for the election: {error}");
                tokio::select! {
                    _ = tokio::time::sleep(ha.renew_every()) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }
    if let Some(forwarder) = forwarder.take() {
        forwarder.stop().await;
    }
    election.close().await;
    Ok(())
}

/// Renews the lease while leading; returns why it stopped (`None`: asked
/// to stop).
async fn lead(
    election: &SqlStore,
    ha: &HaConfig,
    term: i64,
    handle: &ServerHandle,
    clock: &LeaseClock,
    stop: &mut watch::Receiver<bool>,
) -> Option<String> {
    let mut renewed = Instant::now();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(ha.renew_every()) => {}
            _ = stop.changed() => {}
        }
        if *stop.borrow() {
            return None;
        }
        if let Some(reason) = handle.read_only_reason() {
            return Some(format!("the store refused a write: {reason}"));
        }
        let attempt = Instant::now();
        match election
            .lead(&ha.id, &ha.advertise, Some(term), ha.lease)
            .await
        {
            Ok(Leadership::Leader { term: now }) if now == term => {
                renewed = attempt;
                clock.renewed(attempt);
            }
            Ok(Leadership::Leader { term: now }) => {
                return Some(format!("the lease moved to term {now}"));
            }
            Ok(Leadership::Follower { leader, .. }) => {
                return Some(format!(
                    "another server leads ({})",
                    leader.map_or("unknown".to_string(), |(url, term)| format!(
                        "{url}, term {term}"
                    ))
                ));
            }
            Err(error) => {
                // Not renewed in a whole lease: another server may hold it.
                if renewed.elapsed() >= ha.lease {
                    return Some(format!("the lease could not be renewed in time: {error}"));
                }
                tracing::warn!("cannot renew the lease yet: {error}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_is_current_for_a_lease_from_its_last_renewal_s_start() {
        let start = Instant::now();
        let clock = LeaseClock::new(Duration::from_secs(4), start);
        assert_eq!(clock.current(start + Duration::from_millis(3_999)), Ok(()));
        assert_eq!(
            clock.current(start + Duration::from_secs(20)),
            Err(Duration::from_secs(20)),
            "a leader woken after a 20 s pause"
        );
        clock.renewed(start + Duration::from_secs(19));
        assert_eq!(clock.current(start + Duration::from_secs(20)), Ok(()));
        // An older renewal, finished late, moves nothing back.
        clock.renewed(start + Duration::from_secs(2));
        assert_eq!(clock.current(start + Duration::from_secs(22)), Ok(()));
        assert!(clock.current(start + Duration::from_secs(23)).is_err());
    }
}
