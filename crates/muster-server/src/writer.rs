//! Group commit: one task writes every change to the store. Changes are
//! queued in the order the state changed (the queue is filled while the
//! control plane's lock is held); the task takes everything queued, commits
//! it in one transaction, then answers each waiter. While one commit waits
//! for the disk, the next batches pile up and share the next commit.

use crate::store::{Batch, Store, StoreError};
use tokio::sync::{mpsc, oneshot};

/// The most queued changes folded into one commit.
const MAX_GROUP: usize = 4096;

struct Request {
    batch: Batch,
    done: Option<oneshot::Sender<Result<(), StoreError>>>,
}

/// The sending side of the writer's queue.
#[derive(Debug, Clone)]
pub struct Writer {
    queue: mpsc::UnboundedSender<Request>,
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
    pub fn start<S: Store>(store: S) -> (Writer, tokio::task::JoinHandle<()>) {
        let (queue, receiver) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(store, receiver));
        (Writer { queue }, task)
    }

    /// Queues a batch; the answer says when it is durable. Never blocks, so
    /// it may be called with the control plane's lock held (which is what
    /// keeps the writes in the order of the changes).
    pub fn queue(&self, batch: Batch) -> Durable {
        let (done, receiver) = oneshot::channel();
        let request = Request {
            batch,
            done: Some(done),
        };
        match self.queue.send(request) {
            Ok(()) => Durable(Some(receiver)),
            Err(_) => Durable(None),
        }
    }

    /// Queues a batch nobody waits for.
    pub fn queue_quietly(&self, batch: Batch) {
        if batch.is_empty() {
            return;
        }
        let request = Request { batch, done: None };
        if self.queue.send(request).is_err() {
            tracing::warn!("a change was not saved: the store's writer has stopped");
        }
    }
}

async fn run<S: Store>(store: S, mut receiver: mpsc::UnboundedReceiver<Request>) {
    let mut buffer = Vec::new();
    while receiver.recv_many(&mut buffer, MAX_GROUP).await > 0 {
        let mut batch = Batch::default();
        let mut waiters = Vec::with_capacity(buffer.len());
        for request in buffer.drain(..) {
            batch.merge(request.batch);
            if let Some(done) = request.done {
                waiters.push(done);
            }
        }
        let result = store.write(&batch).await;
        if let Err(error) = &result {
            tracing::error!(%error, "a commit to the store failed");
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
    use std::sync::Arc;
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

    #[tokio::test]
    async fn batches_queued_during_a_commit_share_the_next_one() {
        let store = SlowStore::default();
        let (writer, task) = Writer::start(store.clone());
        let mut waiting = Vec::new();
        for id in 0..100 {
            let mut batch = Batch::default();
            batch.jobs.insert(id, format!("{{\"id\":{id}}}"));
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
