//! Group commit: one task writes every change to the store. Changes are
//! queued in the order the state changed (the queue is filled while the
//! control plane's lock is held); the task takes everything queued, commits
//! it in one transaction, then answers each waiter. While one commit waits
//! for the disk, the next batches pile up and share the next commit.

use crate::store::{Batch, Store, StoreError};
use prometheus_client::metrics::histogram::Histogram;
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::{mpsc, oneshot, watch};

/// The most queued changes folded into one commit.
const MAX_GROUP: usize = 4096;

struct Request {
    batch: Batch,
    /// This batch's place in the queue (1, 2, ...).
    sequence: u64,
    done: Option<oneshot::Sender<Result<(), StoreError>>>,
}

/// Where the writer stands: every batch up to `sequence` is durable; once
/// a commit failed, `failed` says why and nothing more is written (the
/// memory holds changes the disk does not: the server turns read-only
/// rather than go on from a state it could not save).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Committed {
    pub sequence: u64,
    pub failed: Option<String>,
}

/// The sending side of the writer's queue.
#[derive(Debug, Clone)]
pub struct Writer {
    queue: mpsc::UnboundedSender<Request>,
    /// The last sequence number handed out, held from taking a number to
    /// sending the batch, so batches reach the writer in the order of
    /// their numbers: a commit covers every number up to its last, and
    /// [`Writer::durable_through`] never passes a batch still on its way
    /// (one queued outside the control plane's lock could otherwise take a
    /// number, be overtaken and be committed after a later one).
    queued: Arc<Mutex<u64>>,
    committed: watch::Receiver<Committed>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request").finish_non_exhaustive()
    }
}

/// Waits for one queued batch to be durable.
pub struct Durable(Option<oneshot::Receiver<Result<(), StoreError>>>);

impl Durable {
    pub async fn wait(self) -> Result<(), StoreError> {
        match self.0 {
            None => Err(StoreError::Closed),
            Some(receiver) => receiver.await.unwrap_or(Err(StoreError::Closed)),
        }
    }
}

impl Writer {
    /// Starts the writer task over `store`. It ends once every [`Writer`]
    /// is dropped and the queue is drained.
    #[cfg(test)]
    pub fn start<S: Store>(store: S) -> (Writer, tokio::task::JoinHandle<()>) {
        Writer::start_observed(store, Histogram::new([1.0]))
    }

    /// [`Writer::start`], timing each commit into `commit_seconds`.
    pub fn start_observed<S: Store>(
        store: S,
        commit_seconds: Histogram,
    ) -> (Writer, tokio::task::JoinHandle<()>) {
        let (queue, receiver) = mpsc::unbounded_channel();
        let (committed_sender, committed) = watch::channel(Committed::default());
        let task = tokio::spawn(run(store, receiver, committed_sender, commit_seconds));
        let writer = Writer {
            queue,
            queued: Arc::new(Mutex::new(0)),
            committed,
        };
        (writer, task)
    }

    fn send(&self, batch: Batch, done: Option<oneshot::Sender<Result<(), StoreError>>>) -> bool {
        // Never held for long: an unbounded send.
        let mut queued = self.lock_queued();
        *queued += 1;
        let sequence = *queued;
        self.queue
            .send(Request {
                batch,
                sequence,
                done,
            })
            .is_ok()
    }

    /// Queues a batch; the answer says when it is durable. Never blocks, so
    /// it may be called with the control plane's lock held (which is what
    /// keeps the writes in the order of the changes).
    pub fn queue(&self, batch: Batch) -> Durable {
        let (done, receiver) = oneshot::channel();
        if self.send(batch, Some(done)) {
            Durable(Some(receiver))
        } else {
            Durable(None)
        }
    }

    /// Queues a batch nobody waits for.
    pub fn queue_quietly(&self, batch: Batch) {
        if batch.is_empty() {
            return;
        }
        if !self.send(batch, None) {
            tracing::warn!("a change was not saved: the store's writer has stopped");
        }
    }

    /// The sequence number of the last batch queued: read under the
    /// control plane's lock, it covers every change made so far.
    pub fn queued(&self) -> u64 {
        *self.lock_queued()
    }

    fn lock_queued(&self) -> std::sync::MutexGuard<'_, u64> {
        self.queued.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Why the store stopped taking commits, if it did.
    pub fn failed(&self) -> Option<String> {
        self.committed.borrow().failed.clone()
    }

    /// Waits until every batch up to `sequence` is durable.
    pub async fn durable_through(&self, sequence: u64) -> Result<(), StoreError> {
        let mut committed = self.committed.clone();
        let state = committed
            .wait_for(|state| state.sequence >= sequence || state.failed.is_some())
            .await
            .map_err(|_| StoreError::Closed)?
            .clone();
        match state.failed {
            Some(reason) if state.sequence < sequence => Err(StoreError::Database(reason)),
            _ => Ok(()),
        }
    }
}

async fn run<S: Store>(
    store: S,
    mut receiver: mpsc::UnboundedReceiver<Request>,
    committed: watch::Sender<Committed>,
    commit_seconds: Histogram,
) {
    let mut buffer = Vec::new();
    let mut failed: Option<StoreError> = None;
    while receiver.recv_many(&mut buffer, MAX_GROUP).await > 0 {
        let mut batch = Batch::default();
        let mut waiters = Vec::with_capacity(buffer.len());
        let mut last = 0;
        for request in buffer.drain(..) {
            batch.merge(request.batch);
            last = last.max(request.sequence);
            if let Some(done) = request.done {
                waiters.push(done);
            }
        }
        let result = match &failed {
            // Nothing is written after a failed commit: the batches after
            // it describe changes on top of one the disk does not have.
            Some(error) => Err(error.clone()),
            None => {
                let started = std::time::Instant::now();
                let written = store.write(&batch).await;
                commit_seconds.observe(started.elapsed().as_secs_f64());
                written
            }
        };
        match &result {
            Ok(()) => {
                committed.send_modify(|state| state.sequence = state.sequence.max(last));
            }
            Err(error) if failed.is_none() => {
                tracing::error!(
                    %error,
                    "a commit to the store failed: the server is read-only until restarted"
                );
                failed = Some(error.clone());
                let reason = error.to_string();
                committed.send_modify(|state| state.failed = Some(reason));
            }
            Err(_) => {}
        }
        for waiter in waiters {
            let _ = waiter.send(result.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Loaded;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    /// A store whose commits take a while, counting commits and records.
    #[derive(Clone, Default)]
    struct SlowStore {
        commits: Arc<AtomicUsize>,
        jobs: Arc<AtomicUsize>,
    }

    impl Store for SlowStore {
        async fn load(&self) -> Result<Loaded, StoreError> {
            Ok(Loaded::default())
        }

        async fn write(&self, batch: &Batch) -> Result<(), StoreError> {
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.commits.fetch_add(1, Ordering::SeqCst);
            self.jobs.fetch_add(batch.jobs.len(), Ordering::SeqCst);
            Ok(())
        }
    }

    /// A store whose commits fail from the `fail_from`th on.
    #[derive(Clone)]
    struct FailingStore {
        commits: Arc<AtomicUsize>,
        fail_from: usize,
    }

    impl Store for FailingStore {
        async fn load(&self) -> Result<Loaded, StoreError> {
            Ok(Loaded::default())
        }

        async fn write(&self, _batch: &Batch) -> Result<(), StoreError> {
            let commit = self.commits.fetch_add(1, Ordering::SeqCst) + 1;
            if commit >= self.fail_from {
                return Err(StoreError::Database("disk full".into()));
            }
            Ok(())
        }
    }

    #[tokio::test]
    async fn after_a_failed_commit_nothing_is_written_or_acknowledged() {
        let store = FailingStore {
            commits: Arc::new(AtomicUsize::new(0)),
            fail_from: 2,
        };
        let (writer, task) = Writer::start(store.clone());
        let mut first = Batch::default();
        first.retired.insert(1);
        writer.queue(first).wait().await.unwrap();
        let covered = writer.queued();
        writer.durable_through(covered).await.unwrap();
        let mut second = Batch::default();
        second.retired.insert(2);
        assert!(writer.queue(second).wait().await.is_err());
        assert!(writer.failed().unwrap().contains("disk full"));
        let mut third = Batch::default();
        third.retired.insert(3);
        assert!(writer.queue(third).wait().await.is_err());
        assert!(writer.durable_through(writer.queued()).await.is_err());
        assert_eq!(
            store.commits.load(Ordering::SeqCst),
            2,
            "no write after the failure"
        );
        drop(writer);
        task.await.unwrap();
    }

    /// A store that records which retired ids it wrote.
    #[derive(Clone, Default)]
    struct RecordingStore {
        written: Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>,
    }

    impl Store for RecordingStore {
        async fn load(&self) -> Result<Loaded, StoreError> {
            Ok(Loaded::default())
        }

        async fn write(&self, batch: &Batch) -> Result<(), StoreError> {
            tokio::task::yield_now().await;
            self.written
                .lock()
                .unwrap()
                .extend(batch.retired.iter().copied());
            Ok(())
        }
    }

    /// Batches queued at once from several threads (some outside the
    /// control plane's lock, as accounting's are): once a queuer's
    /// `durable_through(queued())` returns, its own batch is written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_batch_is_durable_once_its_number_is_covered() {
        let store = RecordingStore::default();
        let (writer, task) = Writer::start(store.clone());
        let mut queuers = Vec::new();
        for thread in 0..8u64 {
            let writer = writer.clone();
            let store = store.clone();
            queuers.push(tokio::spawn(async move {
                for round in 0..300u64 {
                    let id = thread * 1_000 + round;
                    let mut batch = Batch::default();
                    batch.retired.insert(id);
                    writer.queue_quietly(batch);
                    writer.durable_through(writer.queued()).await.unwrap();
                    assert!(
                        store.written.lock().unwrap().contains(&id),
                        "batch {id} was covered before it was written"
                    );
                }
            }));
        }
        for queuer in queuers {
            queuer.await.unwrap();
        }
        drop(writer);
        task.await.unwrap();
    }

    #[tokio::test]
    async fn batches_queued_during_a_commit_share_the_next_one() {
        let store = SlowStore::default();
        let (writer, task) = Writer::start(store.clone());
        let mut waiting = Vec::new();
        for id in 0..100 {
            let mut batch = Batch::default();
            batch.jobs.insert(
                id,
                crate::store::JobRow {
                    record: format!("{{\"id\":{id}}}"),
                    state: "pending".into(),
                    user: "u".into(),
                    queue: "q".into(),
                },
            );
            waiting.push(writer.queue(batch));
        }
        for durable in waiting {
            durable.wait().await.unwrap();
        }
        assert_eq!(store.jobs.load(Ordering::SeqCst), 100);
        let commits = store.commits.load(Ordering::SeqCst);
        assert!(commits <= 2, "{commits} commits for 100 batches");
        drop(writer);
        task.await.unwrap();
    }
}
