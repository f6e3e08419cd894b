//! Which of a client's servers to talk to, when to move to the next, and
//! how long to wait before trying again.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The servers a client may talk to (several servers on one PostgreSQL
/// store, any of which answers: see docs/ha.md), and the one it uses now.
/// Shared by a client's clones: one that finds a server gone moves them
/// all on.
#[derive(Debug)]
pub(super) struct Servers {
    /// As given: URLs separated by commas.
    pub(super) given: String,
    pub(super) urls: Vec<String>,
    current: AtomicUsize,
}

impl Servers {
    pub(super) fn parse(given: &str) -> Arc<Servers> {
        let mut urls: Vec<String> = given
            .split(',')
            .map(|url| url.trim().trim_end_matches('/').to_string())
            .filter(|url| !url.is_empty())
            .collect();
        if urls.is_empty() {
            urls.push(given.trim().trim_end_matches('/').to_string());
        }
        Arc::new(Servers {
            given: urls.join(","),
            urls,
            current: AtomicUsize::new(0),
        })
    }

    pub(super) fn current(&self) -> (usize, &str) {
        let index = self.current.load(Ordering::Relaxed) % self.urls.len();
        (index, &self.urls[index])
    }

    /// `index` did not answer: the next server is tried from now on
    /// (unless another request moved on already).
    pub(super) fn failed(&self, index: usize) {
        let next = (index + 1) % self.urls.len();
        let _ = self
            .current
            .compare_exchange(index, next, Ordering::Relaxed, Ordering::Relaxed);
    }
}

/// Points `url` at `server` (scheme, host and port), keeping its path.
pub(super) fn rebase(url: &mut reqwest::Url, server: &str) {
    if let Ok(base) = reqwest::Url::parse(server) {
        let _ = url.set_scheme(base.scheme());
        let _ = url.set_host(base.host_str());
        let _ = url.set_port(base.port());
    }
}

/// A deposed leader's refusal ([`crate::protocol::NO_LONGER_LEADS_HEADER`]).
pub(super) fn no_longer_leads(response: &reqwest::Response) -> bool {
    response
        .headers()
        .contains_key(crate::protocol::NO_LONGER_LEADS_HEADER)
}

/// How long a read waits for an election (servers sharing a PostgreSQL
/// store choose a new leader within their `--leader-lease`, 4 s by default).
pub(super) const ELECTION_WAIT: Duration = Duration::from_secs(15);

/// The first pause before a request is sent again.
pub(super) const FIRST_RETRY_WAIT: Duration = Duration::from_millis(250);

/// The longest pause between two tries: a quarter of the default
/// `--leader-lease` (4 s), so a client sees a new leader within about a
/// quarter lease of its election, never a whole lease or more later.
pub(super) const LONGEST_RETRY_WAIT: Duration = Duration::from_secs(1);

/// The pause after `wait`: doubled, at most [`LONGEST_RETRY_WAIT`].
pub(super) fn next_wait(wait: Duration) -> Duration {
    (wait * 2).min(LONGEST_RETRY_WAIT)
}

/// How long a request may wait for its answer unless it says otherwise
/// (long polls and log follows do): past it the server is taken for
/// stopped or cut off, and the next one is used.
pub(super) const REQUEST_DEADLINE: Duration = Duration::from_secs(30);

/// How long a read may wait for its answer before it is asked of the next
/// server.
pub(super) const READ_DEADLINE: Duration = Duration::from_secs(10);

/// How long a submission is retried while the server cannot be reached.
pub(super) const SUBMIT_RETRY_FOR: Duration = Duration::from_secs(60);

/// The error a submission ends with, once it is no longer retried: when an
/// earlier attempt may have reached a server (sent, with no whole answer),
/// the job may have been accepted, and saying only that the server could
/// not be reached (or refused) would have its user submit a duplicate.
pub(super) fn given_up(error: super::ClientError, unknown: bool, key: &str) -> super::ClientError {
    use super::ClientError;
    if !unknown {
        return error;
    }
    let note = format!(
        "an earlier attempt got no answer, so the job may have been accepted: look with \
         `muster jobs` before submitting it again (idempotency key {key})"
    );
    match error {
        ClientError::Transport { url, reason, .. } => ClientError::Transport {
            url,
            reason: format!("{reason}; {note}"),
            sent: true,
        },
        ClientError::Api { status, mut body } if status >= 500 => {
            body.message = format!("{}; {note}", body.message);
            ClientError::Api { status, body }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    /// Retries back off 0.25, 0.5, 1 s and then stay at 1 s: a takeover at
    /// 3.9 s is seen by 4.75 s, not at 7.75 s as with a doubling to 4 s.
    #[test]
    fn retries_never_wait_past_a_quarter_of_the_leader_lease() {
        let mut wait = super::FIRST_RETRY_WAIT;
        let mut sent = std::time::Duration::ZERO;
        let mut tries = Vec::new();
        while sent < std::time::Duration::from_secs(6) {
            sent += wait;
            tries.push(sent.as_millis());
            wait = super::next_wait(wait);
        }
        assert_eq!(tries, [250, 750, 1750, 2750, 3750, 4750, 5750, 6750]);
    }

    /// A submission given up after an attempt that may have reached a
    /// server says the job may have been accepted, and how to look, never
    /// only "cannot reach"; one that never reached any says nothing more,
    /// and a refusal of the job itself stays as it is.
    #[test]
    fn a_submission_given_up_after_an_unanswered_attempt_says_it_may_have_been_accepted() {
        use super::super::ClientError;
        use crate::protocol::{ErrorBody, ErrorCode};
        let refused = || ClientError::Transport {
            url: "https://a:7070".into(),
            reason: "connection refused".into(),
            sent: false,
        };
        let told = super::given_up(refused(), true, "k1").to_string();
        assert!(
            told.starts_with(
                "cannot reach the muster server at https://a:7070: connection refused; "
            ) && told.contains("may have been accepted")
                && told.contains("muster jobs")
                && told.contains("k1"),
            "{told}"
        );
        assert_eq!(
            super::given_up(refused(), false, "k1").to_string(),
            refused().to_string()
        );
        let unavailable = ClientError::Api {
            status: 503,
            body: ErrorBody {
                code: ErrorCode::Unavailable,
                message: "this server no longer leads".into(),
            },
        };
        assert!(
            super::given_up(unavailable, true, "k1")
                .to_string()
                .contains("may have been accepted")
        );
        let invalid = ClientError::Api {
            status: 422,
            body: ErrorBody {
                code: ErrorCode::InvalidArgument,
                message: "no such queue".into(),
            },
        };
        assert!(
            !super::given_up(invalid, true, "k1")
                .to_string()
                .contains("accepted")
        );
    }
}
