//! The log shipper: sends each task's output to the server, apart from the
//! heartbeats.
//!
//! It runs as its own tokio task with its own HTTP client (so its own
//! connections: a slow upload never holds a heartbeat back), at a rate cap
//! for the whole node ([`LogShipConfig::rate_bytes_per_s`]) in chunks of at
//! most [`LogShipConfig::chunk_bytes`], one chunk per task in turn.
//!
//! The agent tells it which tasks exist and whether they still run
//! ([`LogShipper::update`], each round of its loop) and the node's token
//! ([`LogShipper::set_token`], at each registration). For a task it has not
//! shipped from yet (a new one, or one an earlier agent ran), it first asks
//! the server where its copy ends (an empty chunk at offset 0), so a
//! restarted agent resumes where the server is, and sends from there:
//! exactly the bytes of the task's log file, at their offsets. Once a task
//! has exited and everything is sent, a last chunk says so (`eof`), the
//! log file is removed from the node (the server has it all), and
//! [`LogShipper::shipped_all`] turns true: the agent must not forget a task
//! before.
//!
//! A task far ahead of the cap: the server says it keeps the first
//! `head_bytes` of a log and, past them, only the latest `tail_bytes`. Once
//! the head is sent (a chunk never crosses its end), a sender more than
//! `tail_bytes` (and a chunk) behind skips to its file's length minus
//! `tail_bytes` (`omit_gap`): what it skips is what the server would drop
//! anyway. So the backlog of a task that writes without end stays bounded,
//! and the server's copy of an exited task is complete after at most
//! `tail_bytes` more at the capped rate.
//!
//! The node's disk stays bounded too: what the server has acknowledged, and
//! what is sure to be skipped (past the head, before the file's length
//! minus `tail_bytes` and a chunk), is freed in the task's log file by
//! punching holes (`fallocate(PUNCH_HOLE)`, in steps of [`PUNCH_STEP`]),
//! which keeps the file's length and so every offset; where the filesystem
//! cannot, the file just keeps its bytes. The shipper never reads a byte it
//! freed.
//!
//! A task whose allocation the server does not know (or gives to another
//! node) is given up on, with a warning: nothing can be shipped for it.

use crate::runtime::{ProcessRuntime, RuntimeError};
use muster_api::client::{Client, ClientError};
use muster_api::protocol::{ErrorCode, LogChunk, MAX_LOG_CHUNK_BYTES};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How the shipper sends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogShipConfig {
    /// Log bytes sent per second at most, for the whole node.
    pub rate_bytes_per_s: u64,
    /// Bytes per chunk at most (capped at the wire's
    /// [`MAX_LOG_CHUNK_BYTES`]).
    pub chunk_bytes: usize,
}

/// Acknowledged bytes are freed on the node's disk in steps this large.
pub const PUNCH_STEP: u64 = 4 << 20;

/// The default cap: 8 MiB/s per node.
pub const DEFAULT_LOG_RATE: u64 = 8 << 20;

impl Default for LogShipConfig {
    fn default() -> Self {
        LogShipConfig {
            rate_bytes_per_s: DEFAULT_LOG_RATE,
            chunk_bytes: 256 * 1024,
        }
    }
}

/// The agent's handle on its shipper. The shipper's task ends once every
/// handle is dropped.
#[derive(Debug, Clone)]
pub struct LogShipper {
    shared: Arc<Shared>,
}

#[derive(Debug, Default)]
struct Shared {
    state: Mutex<State>,
    wake: Notify,
}

#[derive(Debug, Default)]
struct State {
    token: Option<String>,
    tasks: BTreeMap<String, TaskLog>,
}

/// What the shipper knows of one task's log.
#[derive(Debug, Clone)]
struct TaskLog {
    allocation: u64,
    exited: bool,
    /// Where the server's copy ends (`None`: ask it first).
    acked: Option<u64>,
    /// What the server keeps: the first `head_bytes`, then the latest
    /// `tail_bytes` (from its last answer).
    head_bytes: Option<u64>,
    tail_bytes: Option<u64>,
    /// Every byte and the `eof` were acknowledged, or the server refused
    /// the allocation for good.
    done: bool,
    /// The log file's bytes before this offset were freed (a hole).
    punched: u64,
    /// The bytes from the head's end to here were freed, sure to be skipped.
    skipped_punched: u64,
}

/// The allocation of a task named `j<job>-a<allocation>-g<generation>` (or
/// `a<allocation>-g<generation>`).
fn allocation_of(key: &str) -> Option<u64> {
    let rest = match key.strip_prefix('j').and_then(|k| k.split_once('-')) {
        Some((_, rest)) => rest,
        None => key,
    };
    rest.strip_prefix('a')?.split_once("-g")?.0.parse().ok()
}

impl LogShipper {
    /// Starts the shipper's task, sending to `server` for node `node`.
    pub fn start(
        server: Client,
        node: &str,
        runtime: Arc<ProcessRuntime>,
        config: LogShipConfig,
    ) -> LogShipper {
        let shared = Arc::new(Shared::default());
        let worker = Worker {
            shared: Arc::downgrade(&shared),
            server,
            node: node.to_string(),
            runtime,
            chunk_bytes: config.chunk_bytes.clamp(1, MAX_LOG_CHUNK_BYTES),
            rate: config.rate_bytes_per_s.max(1),
            next_send: Instant::now(),
            client: None,
        };
        tokio::spawn(worker.run());
        LogShipper { shared }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The node's token, from its latest registration.
    pub fn set_token(&self, token: &str) {
        self.state().token = Some(token.to_string());
        self.shared.wake.notify_one();
    }

    /// The tasks on the node now, by name, and whether each still runs.
    /// Tasks left out are no longer shipped.
    pub fn update<'a>(&self, tasks: impl IntoIterator<Item = (&'a str, bool)>) {
        let mut state = self.state();
        let mut next = BTreeMap::new();
        for (key, running) in tasks {
            let Some(allocation) = allocation_of(key) else {
                continue;
            };
            let mut log = state.tasks.remove(key).unwrap_or(TaskLog {
                allocation,
                exited: false,
                acked: None,
                head_bytes: None,
                tail_bytes: None,
                done: false,
                punched: 0,
                skipped_punched: 0,
            });
            log.exited = !running;
            next.insert(key.to_string(), log);
        }
        state.tasks = next;
        drop(state);
        self.shared.wake.notify_one();
    }

    /// Whether the task has exited and its whole log reached the server (or
    /// the server refused it for good). False for a task not given to
    /// [`LogShipper::update`].
    pub fn shipped_all(&self, key: &str) -> bool {
        self.state().tasks.get(key).is_some_and(|log| log.done)
    }
}

struct Worker {
    shared: Weak<Shared>,
    /// The server, with no token.
    server: Client,
    node: String,
    runtime: Arc<ProcessRuntime>,
    chunk_bytes: usize,
    rate: u64,
    /// When the rate cap lets the next bytes go.
    next_send: Instant,
    /// The client for the current token.
    client: Option<(String, Client)>,
}

/// What one step of one task's shipping did.
enum Step {
    /// Sent bytes (or learnt where to resume): go on soon.
    Progress,
    /// Nothing to send now.
    Idle,
    /// The server could not be reached: wait before trying again.
    Unreachable,
}

impl Worker {
    async fn run(mut self) {
        let mut backoff = Duration::from_millis(200);
        loop {
            let Some(shared) = self.shared.upgrade() else {
                return;
            };
            let (token, keys) = {
                let state = shared
                    .state
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let keys: Vec<String> = state
                    .tasks
                    .iter()
                    .filter(|(_, log)| !log.done)
                    .map(|(key, _)| key.clone())
                    .collect();
                (state.token.clone(), keys)
            };
            let mut progressed = false;
            let mut unreachable = false;
            if let Some(token) = token {
                if self.client.as_ref().is_none_or(|(t, _)| *t != token) {
                    self.client = Some((token.clone(), self.server.with_token(&token)));
                }
                for key in keys {
                    match self.step(&shared, &key).await {
                        Step::Progress => progressed = true,
                        Step::Idle => {}
                        Step::Unreachable => {
                            unreachable = true;
                            break;
                        }
                    }
                }
            }
            let pause = if unreachable {
                let pause = backoff;
                backoff = (backoff * 2).min(Duration::from_secs(5));
                pause
            } else {
                backoff = Duration::from_millis(200);
                if progressed {
                    Duration::ZERO
                } else {
                    Duration::from_millis(250)
                }
            };
            if !pause.is_zero() {
                tokio::select! {
                    _ = shared.wake.notified(), if !unreachable => {}
                    _ = tokio::time::sleep(pause) => {}
                }
            }
        }
    }

    fn snapshot(shared: &Shared, key: &str) -> Option<TaskLog> {
        shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .tasks
            .get(key)
            .cloned()
    }

    /// Records what the server said of `key`'s log (if the agent still
    /// lists it).
    fn record(shared: &Shared, key: &str, change: impl FnOnce(&mut TaskLog)) {
        if let Some(log) = shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .tasks
            .get_mut(key)
        {
            change(log);
        }
    }

    /// Sends the next chunk of `key`'s log (or asks where to resume, or
    /// says the log is whole).
    async fn step(&mut self, shared: &Shared, key: &str) -> Step {
        let Some(log) = Self::snapshot(shared, key) else {
            return Step::Idle;
        };
        let Some(acked) = log.acked else {
            let probe = LogChunk {
                allocation: log.allocation,
                offset: 0,
                data: Vec::new(),
                omit_gap: false,
                eof: false,
            };
            return self.send(shared, key, &probe).await;
        };
        let length = match tokio::fs::metadata(self.runtime.log_path(key)).await {
            Ok(meta) => meta.len(),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => 0,
            Err(error) => {
                tracing::warn!("cannot read the log of {key}: {error}");
                return Step::Idle;
            }
        };
        let chunk_bytes = self.chunk_bytes as u64;
        let head = log.head_bytes.unwrap_or(0);
        // Far behind, with the head sent: skip to where the bytes the
        // server keeps begin.
        let (offset, omit_gap) = match log.tail_bytes {
            Some(tail) if acked >= head && length.saturating_sub(acked) > tail + chunk_bytes => {
                (length - tail, true)
            }
            _ => (acked, false),
        };
        // Bytes past the head and more than a tail and a chunk before the
        // end will be skipped whatever comes: free them now.
        if let Some(tail) = log.tail_bytes {
            let from = head.max(acked).max(log.skipped_punched);
            let upto = length.saturating_sub(tail + chunk_bytes) / PUNCH_STEP * PUNCH_STEP;
            if upto > from {
                self.punch(key, from, upto);
                Self::record(shared, key, |log| log.skipped_punched = upto);
            }
        }
        // A chunk of the head ends with the head.
        let most = if offset < head {
            (head - offset).min(chunk_bytes) as usize
        } else {
            self.chunk_bytes
        };
        let data = if offset < length {
            match self.runtime.read_log(key, offset, most).await {
                Ok((data, _)) => data,
                Err(RuntimeError::NoLog { .. }) => Vec::new(),
                Err(error) => {
                    tracing::warn!("cannot read the log of {key}: {error}");
                    return Step::Idle;
                }
            }
        } else {
            Vec::new()
        };
        let end = offset + data.len() as u64;
        // The whole output is known once the task has exited (its log
        // file no longer grows).
        let eof = log.exited && end >= length;
        if data.is_empty() && !eof {
            return Step::Idle;
        }
        // The rate cap.
        let now = Instant::now();
        if self.next_send > now {
            tokio::time::sleep_until(self.next_send).await;
        }
        let cost = Duration::from_secs_f64(data.len() as f64 / self.rate as f64);
        self.next_send = self.next_send.max(now) + cost;
        let chunk = LogChunk {
            allocation: log.allocation,
            offset,
            data,
            omit_gap,
            eof,
        };
        self.send(shared, key, &chunk).await
    }

    async fn send(&self, shared: &Shared, key: &str, chunk: &LogChunk) -> Step {
        let Some((_, client)) = &self.client else {
            return Step::Idle;
        };
        match client.push_logs(&self.node, chunk).await {
            Ok(ack) => {
                let whole = chunk.eof && ack.next_offset <= chunk.offset + chunk.data.len() as u64;
                let mut punch = None;
                Self::record(shared, key, |log| {
                    log.acked = Some(ack.next_offset);
                    log.head_bytes = ack.head_bytes;
                    log.tail_bytes = ack.tail_bytes;
                    log.done |= whole;
                    // Free what the server has, in whole steps.
                    let upto = ack.next_offset / PUNCH_STEP * PUNCH_STEP;
                    if upto > log.punched {
                        punch = Some((log.punched, upto));
                        log.punched = upto;
                    }
                });
                if whole {
                    // The server has all of it: the node needs it no more.
                    let path = self.runtime.log_path(key);
                    match tokio::fs::remove_file(&path).await {
                        Ok(()) => {}
                        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                        Err(error) => {
                            tracing::warn!(
                                "cannot remove the shipped log {}: {error}",
                                path.display()
                            )
                        }
                    }
                } else if let Some((from, upto)) = punch {
                    self.punch(key, from, upto);
                }
                Step::Progress
            }
            Err(error) => match error.code() {
                // A gap, or a skip the server does not take: ask again
                // where its copy ends.
                Some(ErrorCode::Conflict) => {
                    tracing::info!("resuming the log of {key}: {error}");
                    Self::record(shared, key, |log| log.acked = None);
                    Step::Progress
                }
                Some(
                    ErrorCode::NotFound | ErrorCode::PermissionDenied | ErrorCode::InvalidArgument,
                ) => {
                    tracing::warn!("giving up on the log of {key}: {error}");
                    Self::record(shared, key, |log| log.done = true);
                    Step::Idle
                }
                _ => {
                    if !matches!(error, ClientError::Api { .. }) {
                        tracing::debug!("cannot ship the log of {key} yet: {error}");
                    } else {
                        tracing::warn!("cannot ship the log of {key} yet: {error}");
                    }
                    Step::Unreachable
                }
            },
        }
    }
}

impl Worker {
    /// Frees bytes `from..upto` of `key`'s log file on disk; its length and
    /// the offsets of everything after stay.
    fn punch(&self, key: &str, from: u64, upto: u64) {
        use nix::fcntl::{FallocateFlags, fallocate};
        let path = self.runtime.log_path(key);
        let result = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|error| error.to_string())
            .and_then(|file| {
                let offset = i64::try_from(from).map_err(|e| e.to_string())?;
                let len = i64::try_from(upto - from).map_err(|e| e.to_string())?;
                fallocate(
                    &file,
                    FallocateFlags::FALLOC_FL_PUNCH_HOLE | FallocateFlags::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                )
                .map_err(|error| error.to_string())
            });
        if let Err(error) = result {
            tracing::debug!(
                "cannot free the shipped part of {}: {error}",
                path.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn allocations_are_read_from_task_names() {
        assert_eq!(super::allocation_of("j7-a12-g345"), Some(12));
        assert_eq!(super::allocation_of("a12-g345"), Some(12));
        assert_eq!(super::allocation_of("junk"), None);
    }
}
