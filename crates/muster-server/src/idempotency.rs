//! Idempotency keys of submissions: a client that retries `POST /v1/jobs`
//! with the same `Idempotency-Key` (after a timeout, a dropped connection
//! or a server crash) gets the job its first request made, not a second
//! one. A key is the submitting user's, kept 24 hours, written in the same
//! commit as the job it made (so a crash keeps both or neither).

use std::collections::BTreeMap;

/// How long a key is remembered.
pub const KEY_TTL_MS: u64 = 24 * 3_600_000;
/// The longest key accepted.
pub const MAX_KEY_LENGTH: usize = 255;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Entry {
    /// A request with this key is being submitted now.
    InFlight,
    /// It made this job, at this time (ms).
    Made { job: u64, at_ms: u64 },
}

/// (user, key) → what a request with it did.
#[derive(Debug, Default)]
pub struct Keys {
    entries: BTreeMap<(String, String), Entry>,
}

/// What to do with a request that carries a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// New: submit, then [`Keys::made`] or [`Keys::release`].
    Go,
    /// Already made this job: answer it.
    Made(u64),
    /// Another request with the key is under way.
    Busy,
}

impl Keys {
    pub fn load(entries: Vec<(String, String, u64, u64)>, now_ms: u64) -> Keys {
        let mut keys = Keys::default();
        for (user, key, job, at_ms) in entries {
            if now_ms.saturating_sub(at_ms) < KEY_TTL_MS {
                keys.entries.insert((user, key), Entry::Made { job, at_ms });
            }
        }
        keys
    }

    /// Claims `key` of `user` for a submission.
    pub fn claim(&mut self, user: &str, key: &str, now_ms: u64) -> Claim {
        let id = (user.to_string(), key.to_string());
        match self.entries.get(&id) {
            Some(Entry::InFlight) => Claim::Busy,
            Some(Entry::Made { job, at_ms }) if now_ms.saturating_sub(*at_ms) < KEY_TTL_MS => {
                Claim::Made(*job)
            }
            _ => {
                self.entries.insert(id, Entry::InFlight);
                Claim::Go
            }
        }
    }

    /// The claimed key made `job`.
    pub fn made(&mut self, user: &str, key: &str, job: u64, at_ms: u64) {
        self.entries.insert(
            (user.to_string(), key.to_string()),
            Entry::Made { job, at_ms },
        );
    }

    /// The claimed key made nothing (the submission failed): free it.
    pub fn release(&mut self, user: &str, key: &str) {
        let id = (user.to_string(), key.to_string());
        if self.entries.get(&id) == Some(&Entry::InFlight) {
            self.entries.remove(&id);
        }
    }

    /// Forgets keys older than the TTL.
    pub fn prune(&mut self, now_ms: u64) {
        self.entries.retain(|_, entry| match entry {
            Entry::InFlight => true,
            Entry::Made { at_ms, .. } => now_ms.saturating_sub(*at_ms) < KEY_TTL_MS,
        });
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Checks a key: 1 to 255 visible ASCII characters.
pub fn check_key(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > MAX_KEY_LENGTH || !key.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "Idempotency-Key: 1 to {MAX_KEY_LENGTH} visible ASCII characters (a UUID, say)"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_makes_one_job_per_user_for_a_day() {
        let mut keys = Keys::default();
        assert_eq!(keys.claim("alice", "k", 0), Claim::Go);
        assert_eq!(keys.claim("alice", "k", 1), Claim::Busy);
        // Another user's key of the same text is another key.
        assert_eq!(keys.claim("bob", "k", 1), Claim::Go);
        keys.made("alice", "k", 7, 10);
        assert_eq!(keys.claim("alice", "k", 20), Claim::Made(7));
        // A failed submission frees its key.
        keys.release("bob", "k");
        assert_eq!(keys.claim("bob", "k", 30), Claim::Go);
        // After a day it is forgotten.
        assert_eq!(keys.claim("alice", "k", 10 + KEY_TTL_MS), Claim::Go);
        keys.prune(10 + 2 * KEY_TTL_MS);
        assert_eq!(keys.len(), 2, "in-flight claims stay");
        let loaded = Keys::load(vec![("a".into(), "k".into(), 3, 0)], KEY_TTL_MS - 1);
        assert_eq!(loaded.len(), 1);
        assert!(check_key("").is_err() && check_key("a b").is_err());
        assert!(check_key("0b1c2d3e-uuid").is_ok());
    }
}
