//! The dashboard's sign-in sessions: a browser that signs in with a token
//! gets a cookie holding a random session id, never the token. The server
//! keeps, per session, the token it stands for (checked again on every
//! request, so a rotated or removed user's sessions end with the token)
//! and when it ends. Memory only, bounded: a restarted or newly elected
//! server signs browsers out, and past [`MAX_SESSIONS`] the oldest goes.

use std::collections::{BTreeSet, HashMap};

/// How long a session lasts from its sign-in.
pub const SESSION_TTL_MS: u64 = 12 * 3_600_000;

/// The most sessions kept; a new one past it ends the oldest.
pub const MAX_SESSIONS: usize = 10_000;

#[derive(Debug, Clone)]
struct Session {
    token: String,
    created_ms: u64,
}

#[derive(Debug, Default)]
pub struct Sessions {
    by_id: HashMap<String, Session>,
    /// (created, id): the oldest first.
    order: BTreeSet<(u64, String)>,
}

impl Sessions {
    /// A new session for `token`: its id (64 hex digits from the operating
    /// system's random source).
    pub fn open(&mut self, token: &str, now_ms: u64) -> Result<String, crate::auth::TokenError> {
        self.expire(now_ms);
        while self.by_id.len() >= MAX_SESSIONS {
            let Some((_, oldest)) = self.order.pop_first() else {
                break;
            };
            self.by_id.remove(&oldest);
        }
        let id = crate::auth::new_token()?;
        self.order.insert((now_ms, id.clone()));
        self.by_id.insert(
            id.clone(),
            Session {
                token: token.to_string(),
                created_ms: now_ms,
            },
        );
        Ok(id)
    }

    /// The token session `id` stands for, while it lasts.
    pub fn token(&self, id: &str, now_ms: u64) -> Option<&str> {
        let session = self.by_id.get(id)?;
        (now_ms < session.created_ms.saturating_add(SESSION_TTL_MS))
            .then_some(session.token.as_str())
    }

    /// Ends session `id` (signing out).
    pub fn close(&mut self, id: &str) {
        if let Some(session) = self.by_id.remove(id) {
            self.order.remove(&(session.created_ms, id.to_string()));
        }
    }

    fn expire(&mut self, now_ms: u64) {
        while let Some((created, _)) = self.order.first() {
            if now_ms < created.saturating_add(SESSION_TTL_MS) {
                break;
            }
            if let Some((_, id)) = self.order.pop_first() {
                self.by_id.remove(&id);
            }
        }
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_stands_for_its_token_until_it_ends_and_its_id_is_not_the_token() {
        let mut sessions = Sessions::default();
        let id = sessions.open("the-token", 1_000).expect("random");
        assert_eq!(id.len(), 64);
        assert_ne!(id, "the-token");
        assert_eq!(sessions.token(&id, 2_000), Some("the-token"));
        assert_eq!(sessions.token("guess", 2_000), None);
        assert_eq!(sessions.token(&id, 1_000 + SESSION_TTL_MS), None);
        let other = sessions.open("the-token", 3_000).expect("random");
        assert_ne!(other, id, "each sign-in its own id");
        sessions.close(&other);
        assert_eq!(sessions.token(&other, 3_001), None);
        // Expired ones go when the next opens.
        sessions.open("later", 2 * SESSION_TTL_MS).expect("random");
        assert_eq!(sessions.len(), 1);
    }

    #[test]
    fn past_the_limit_the_oldest_session_ends() {
        let mut sessions = Sessions::default();
        let first = sessions.open("t", 0).expect("random");
        for at in 1..MAX_SESSIONS as u64 {
            sessions.open("t", at).expect("random");
        }
        assert_eq!(sessions.len(), MAX_SESSIONS);
        assert!(sessions.token(&first, 10).is_some());
        sessions.open("t", MAX_SESSIONS as u64).expect("random");
        assert_eq!(sessions.len(), MAX_SESSIONS);
        assert!(sessions.token(&first, 10).is_none());
    }
}
