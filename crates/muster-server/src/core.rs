//! The shell's shared state: the control plane behind a lock, the writer
//! that makes its changes durable, and the signals that wake the scheduler,
//! the agents' long polls and the log followers.
//!
//! Every change goes the same way: lock, refuse if the store has failed,
//! feed the control plane an input (with the time read here), turn what it
//! says changed ([`ControlPlane::changed_records`]) into store records and
//! queue them while still locked (so writes keep the order of the changes),
//! bump the desired version of each node whose allocations changed, unlock,
//! then wait for the commit where the caller must not answer before it.
//!
//! Fail closed: once a commit fails the writer writes nothing more and
//! every change is refused with 503 (the memory holds a change the disk
//! does not; a restart reads back exactly what was acknowledged). A
//! panic while the lock is held leaves a state nobody can trust: the
//! process aborts and a restart rebuilds from the store.

use crate::error::ApiError;
use crate::records::{AllocationRecord, JobRecord, NodeRecord, RecordError, job_row};
use crate::store::{Batch, Counters, Loaded};
use crate::writer::{Durable, Writer};
use muster_api::protocol::ErrorCode;
use muster_control::{ControlConfig, ControlPlane, Input, Output, Records};
use muster_model::{NodeName, QueueSpec, Time};
use std::collections::{BTreeMap, HashMap};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::{Notify, watch};

/// The wall clock, in milliseconds since the Unix epoch: the only place the
/// server reads it.
pub fn now() -> Time {
    Time(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0),
    )
}

/// The control plane and what the shell keeps beside it.
#[derive(Debug)]
pub struct Core {
    control: ControlPlane,
    pub next_job: u64,
    /// Each node's credential (bearer token), and the reverse map for
    /// authentication.
    node_tokens: BTreeMap<NodeName, String>,
    token_nodes: HashMap<String, NodeName>,
    /// Per node, the version of its desired allocations.
    versions: BTreeMap<NodeName, watch::Sender<u64>>,
    version_counter: u64,
    /// Per node, when its last heartbeat arrived and the latest gaps
    /// between heartbeats (for operators and the heartbeat tests).
    heartbeats: BTreeMap<NodeName, HeartbeatGaps>,
}

/// How many gaps between heartbeats are kept per node.
pub const HEARTBEAT_GAPS_KEPT: usize = 32;

/// When a node's heartbeats arrived lately.
#[derive(Debug)]
struct HeartbeatGaps {
    last: std::time::Instant,
    /// Milliseconds between consecutive heartbeats, oldest first, at most
    /// [`HEARTBEAT_GAPS_KEPT`].
    gaps: std::collections::VecDeque<u64>,
}

/// Why the stored state cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum RestoreFailure {
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error(
        "{0}; the server refuses to start on it (restore the data directory from a backup, or \
         report the problem with the store attached)"
    )]
    Inconsistent(muster_control::RestoreError),
}

impl Core {
    /// Rebuilds the state from what the store holds (every job not
    /// retired). Nodes get a fresh lease from `now`: their agents could not
    /// renew it while the server was down. A state that breaks an
    /// invariant is refused.
    pub fn restore(
        config: ControlConfig,
        loaded: Loaded,
        now: Time,
    ) -> Result<Core, RestoreFailure> {
        let mut records = Records::default();
        let mut node_tokens = BTreeMap::new();
        for (node, token) in loaded.nodes {
            let node = node.into_node()?;
            if !token.is_empty() {
                node_tokens.insert(node.spec.name.clone(), token);
            }
            records.nodes.push(node);
        }
        records.queues = loaded.queues.into_iter().map(QueueSpec::from).collect();
        for pool in loaded.pools {
            records.pool_policies.push(pool.into_policy()?);
        }
        let mut next_job = loaded.counters.next_job.max(1);
        for job in loaded.jobs {
            let job = job.into_job()?;
            next_job = next_job.max(job.id.0 + 1);
            records.jobs.push(job);
        }
        for allocation in loaded.allocations {
            records.allocations.push(allocation.into_allocation()?);
        }
        records.counters = muster_control::Counters {
            next_allocation: loaded.counters.next_allocation,
            next_generation: loaded.counters.next_generation,
            next_epoch: loaded.counters.next_epoch,
        };
        let control =
            ControlPlane::restore(config, records, now).map_err(RestoreFailure::Inconsistent)?;
        // Versions start from the clock, so an agent's version from before a
        // restart never matches a new one by chance.
        let version_counter = now.0;
        let versions = control
            .nodes()
            .map(|node| (node.spec.name.clone(), watch::channel(version_counter).0))
            .collect();
        let token_nodes = node_tokens
            .iter()
            .map(|(name, token)| (token.clone(), name.clone()))
            .collect();
        Ok(Core {
            control,
            next_job,
            node_tokens,
            token_nodes,
            versions,
            version_counter,
            heartbeats: BTreeMap::new(),
        })
    }

    /// The control plane (read only: changes go through [`Shared::apply`]).
    pub fn control(&self) -> &ControlPlane {
        &self.control
    }

    /// The node a credential belongs to.
    pub fn node_of_token(&self, token: &str) -> Option<&NodeName> {
        self.token_nodes.get(token)
    }

    /// `node`'s credential.
    pub fn credential(&self, node: &NodeName) -> Option<String> {
        self.node_tokens.get(node).cloned()
    }

    /// Whether `node` has a credential (a registered identity).
    pub fn has_credential(&self, node: &NodeName) -> bool {
        self.node_tokens.contains_key(node)
    }

    /// Gives `node` a credential (replacing any it had).
    pub fn set_credential(&mut self, node: &NodeName, token: String) {
        self.revoke_credential(node);
        self.token_nodes.insert(token.clone(), node.clone());
        self.node_tokens.insert(node.clone(), token);
    }

    /// Takes `node`'s credential away: its agent must join again with the
    /// join token.
    pub fn revoke_credential(&mut self, node: &NodeName) {
        if let Some(token) = self.node_tokens.remove(node) {
            self.token_nodes.remove(&token);
        }
    }

    /// Notes that a heartbeat from `node` arrived at `at` (a monotonic
    /// clock: gaps must not jump with the wall clock).
    pub fn note_heartbeat(&mut self, node: &NodeName, at: std::time::Instant) {
        match self.heartbeats.get_mut(node) {
            Some(seen) => {
                let gap = at.saturating_duration_since(seen.last);
                seen.last = at;
                if seen.gaps.len() == HEARTBEAT_GAPS_KEPT {
                    seen.gaps.pop_front();
                }
                seen.gaps
                    .push_back(u64::try_from(gap.as_millis()).unwrap_or(u64::MAX));
            }
            None if self.control.node(node).is_some() => {
                self.heartbeats.insert(
                    node.clone(),
                    HeartbeatGaps {
                        last: at,
                        gaps: std::collections::VecDeque::new(),
                    },
                );
            }
            None => {}
        }
    }

    /// The latest gaps between `node`'s heartbeats, in milliseconds,
    /// oldest first.
    pub fn heartbeat_gaps(&self, node: &NodeName) -> Vec<u64> {
        self.heartbeats
            .get(node)
            .map(|seen| seen.gaps.iter().copied().collect())
            .unwrap_or_default()
    }

    pub fn counters(&self) -> Counters {
        let control = self.control.counters();
        Counters {
            next_job: self.next_job,
            next_allocation: control.next_allocation,
            next_generation: control.next_generation,
            next_epoch: control.next_epoch,
        }
    }

    /// A receiver of `node`'s desired version (created on first use, for a
    /// known node).
    pub fn watch_desired(&mut self, node: &NodeName) -> watch::Receiver<u64> {
        let counter = self.version_counter;
        match self.versions.get(node) {
            Some(sender) => sender.subscribe(),
            None if self.control.node(node).is_some() => self
                .versions
                .entry(node.clone())
                .or_insert_with(|| watch::channel(counter).0)
                .subscribe(),
            None => watch::channel(counter).1,
        }
    }

    /// Ends node `node`'s heartbeat long poll now (its answer carries news
    /// beside the desired set: a tunnel to open).
    pub fn wake_node(&mut self, node: &NodeName) {
        if let Some(sender) = self.versions.get(node) {
            self.version_counter += 1;
            sender.send_replace(self.version_counter);
        }
    }

    /// Records what `outputs` changed into `batch`, and bumps the desired
    /// version of each node whose allocations changed.
    fn record(&mut self, outputs: &[Output], batch: &mut Batch) {
        let changes = self.control.changed_records(outputs);
        for job in &changes.jobs {
            match serde_json::to_string(&JobRecord::from(*job)) {
                Ok(text) => {
                    batch.jobs.insert(job.id.0, job_row(job, text));
                }
                Err(error) => tracing::error!(job = job.id.0, %error, "cannot encode a job"),
            }
        }
        for allocation in &changes.allocations {
            if let Ok(text) = serde_json::to_string(&AllocationRecord::from(*allocation)) {
                batch
                    .allocations
                    .insert(allocation.id.0, (allocation.job.0, text));
            }
        }
        for node in &changes.nodes {
            let token = self
                .node_tokens
                .get(&node.spec.name)
                .cloned()
                .unwrap_or_default();
            if let Ok(text) = serde_json::to_string(&NodeRecord::from(*node)) {
                batch.nodes.insert(node.spec.name.0.clone(), (text, token));
            }
        }
        let removed = changes.removed_nodes.clone();
        if changes.counters.is_some() || !batch.jobs.is_empty() {
            batch.counters = Some(self.counters());
        }
        for name in removed {
            self.revoke_credential(&name);
            self.heartbeats.remove(&name);
            batch.nodes.remove(&name.0);
            batch.removed_nodes.insert(name.0.clone());
        }
        for output in outputs {
            match output {
                Output::DesiredChanged(name) => {
                    self.version_counter += 1;
                    let version = self.version_counter;
                    match self.versions.get(name) {
                        Some(sender) => {
                            sender.send_replace(version);
                        }
                        None if self.control.node(name).is_some() => {
                            self.versions
                                .insert(name.clone(), watch::channel(version).0);
                        }
                        None => {}
                    }
                }
                Output::NodeRemoved(name) => {
                    // Long polls of the removed node end (their version
                    // moved), and its sender goes.
                    if let Some(sender) = self.versions.remove(name) {
                        self.version_counter += 1;
                        sender.send_replace(self.version_counter);
                    }
                }
                Output::JobRetired(id) => {
                    batch.retired.insert(id.0);
                }
                Output::JobChanged(_) | Output::NodeChanged(_) | Output::ReasonChanged(_) => {}
            }
        }
    }
}

/// Settings of the shell the handlers need.
#[derive(Debug, Clone)]
pub struct Settings {
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
    /// A running job whose GPUs stay below 5% this long is shown idle.
    pub idle_after_ms: u64,
    /// Accounting minutes older than this are deleted.
    pub usage_retention_ms: u64,
    /// Audit entries older than this are deleted.
    pub audit_retention_ms: u64,
    /// Requests per token (agents' own endpoints aside).
    pub rate_limit: Option<crate::ratelimit::RateLimit>,
    /// The most a registering node may claim.
    pub node_limits: crate::NodeLimits,
    /// The most jobs an ordinary user may have pending unless its own
    /// limit says otherwise (`None`: none).
    pub max_pending_per_user: Option<u64>,
    /// The most services an ordinary user may have (`None`: no limit but
    /// the cluster's).
    pub max_services_per_user: Option<u64>,
    /// The most dev environments (pending or running) an ordinary user may
    /// have.
    pub max_dev_per_user: Option<u64>,
    /// The server serves HTTPS: the dashboard's cookie is `Secure`, with
    /// HSTS.
    pub https: bool,
    /// This leader's own lease, when it leads several servers.
    pub leadership: Option<std::sync::Arc<crate::ha::LeaseClock>>,
}

/// What every task and handler shares.
#[derive(Debug)]
pub struct Shared {
    pub settings: Settings,
    /// Reads (views, token lookups, snapshots) share it; changes take it
    /// alone.
    core: RwLock<Core>,
    pub writer: Writer,
    /// Retired jobs are read from here.
    pub store: crate::store::SqlStore,
    /// Wakes the scheduling loop (a submission, an exit, a registration).
    pub wake_scheduler: Notify,
    /// Bumped on every job change and log append (wakes log followers).
    pub changes: watch::Sender<u64>,
    /// Bumped on every change of the control plane's state (the scheduling
    /// loop skips cycles while it stands still).
    pub state_version: std::sync::atomic::AtomicU64,
    /// A start forecast is being computed (at most one at a time).
    pub forecasting: std::sync::atomic::AtomicBool,
    pub admin_token: String,
    /// What new nodes register with (see [`crate::jointokens`]).
    pub join_tokens: std::sync::Mutex<crate::jointokens::JoinTokens>,
    /// Reads `/metrics` only.
    pub metrics_token: String,
    /// The latest telemetry of each node (memory only: one report per
    /// registered node, replaced by the next).
    pub telemetry: std::sync::Mutex<BTreeMap<String, crate::metrics::NodeTelemetry>>,
    /// Each node's telemetry over the last hour (memory only).
    pub history: std::sync::Mutex<crate::history::NodeHistories>,
    /// Each task's GPU usage from telemetry (memory only), per node.
    pub usage: std::sync::Mutex<crate::metrics::UsageByNode>,
    /// Per node, its tasks whose container image is being pulled, with the
    /// pull's progress, as its latest heartbeat said (memory only).
    pub pulling: std::sync::Mutex<BTreeMap<String, BTreeMap<u64, String>>>,
    /// Counters and histograms of the server's own work, for `/metrics`.
    pub instruments: crate::metrics::Instruments,
    /// GPU accounting: open minutes, prices, budgets.
    pub accounting: crate::accounting::Accounting,
    /// Users (by name and token hash).
    pub users: RwLock<crate::users::Users>,
    /// Audit entries waiting for a commit (see [`Shared::audit`]).
    pub audit_pending: std::sync::Mutex<Vec<crate::store::AuditEntry>>,
    /// Each token's request bucket.
    pub limiter: std::sync::Mutex<crate::ratelimit::Limiter>,
    /// Secrets, sealed, and their key.
    pub secrets: std::sync::Mutex<crate::secrets::Secrets>,
    /// Idempotency keys of submissions: (user, key) → job, when (24 h).
    pub idempotency: std::sync::Mutex<crate::idempotency::Keys>,
    /// Task logs, bounded per task.
    pub logs: std::sync::Arc<crate::logstore::LogStore>,
    /// Services and their replicas (see [`crate::services`]).
    pub services: crate::services::ServiceState,
    /// Dev environments' tunnels waiting for their agent (see [`crate::dev`]).
    pub tunnels: std::sync::Mutex<crate::dev::Tunnels>,
    /// The dashboard's sign-in sessions (see [`crate::sessions`]).
    pub sessions: std::sync::Mutex<crate::sessions::Sessions>,
    /// Becomes true when the server shuts down (ends long polls).
    pub shutdown: watch::Receiver<bool>,
}

/// Pending audit entries past this many are flushed at once.
const AUDIT_FLUSH_AT: usize = 1_000;

/// A panic interrupted a change: the state cannot be trusted.
fn poisoned() -> ! {
    tracing::error!(
        "a panic interrupted a change to the control plane; its state cannot be trusted: \
         aborting (a restart rebuilds it from the store)"
    );
    eprintln!("muster server: the control plane's lock is poisoned; aborting");
    std::process::abort();
}

/// A deposed leader's refusal (`reason`: why it may no longer lead): the
/// store took nothing, and a client given several servers sends it on to
/// the next at once.
pub fn no_longer_leads(reason: &str) -> ApiError {
    let mut error = ApiError::new(
        ErrorCode::Unavailable,
        format!(
            "{} ({reason}); it is stepping down to forward to the new leader: try again (a \
             client given several servers moves on by itself)",
            muster_api::protocol::NO_LONGER_LEADS
        ),
    );
    error.no_longer_leads = true;
    error
}

impl Shared {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Settings,
        core: Core,
        writer: Writer,
        store: crate::store::SqlStore,
        admin_token: String,
        metrics_token: String,
        instruments: crate::metrics::Instruments,
        accounting: crate::accounting::Accounting,
        tenants: crate::users::Tenants,
        logs: crate::logstore::LogStore,
        shutdown: watch::Receiver<bool>,
    ) -> Shared {
        Shared {
            settings,
            core: RwLock::new(core),
            writer,
            store,
            wake_scheduler: Notify::new(),
            changes: watch::channel(0).0,
            state_version: std::sync::atomic::AtomicU64::new(0),
            forecasting: std::sync::atomic::AtomicBool::new(false),
            admin_token,
            join_tokens: std::sync::Mutex::new(tenants.join_tokens),
            metrics_token,
            telemetry: std::sync::Mutex::new(BTreeMap::new()),
            usage: std::sync::Mutex::new(BTreeMap::new()),
            pulling: std::sync::Mutex::new(BTreeMap::new()),
            history: std::sync::Mutex::new(Default::default()),
            instruments,
            accounting,
            users: RwLock::new(tenants.users),
            idempotency: std::sync::Mutex::new(tenants.keys),
            secrets: std::sync::Mutex::new(tenants.secrets),
            limiter: std::sync::Mutex::new(Default::default()),
            audit_pending: std::sync::Mutex::new(Vec::new()),
            logs: std::sync::Arc::new(logs),
            services: Default::default(),
            tunnels: Default::default(),
            sessions: Default::default(),
            shutdown,
        }
    }

    /// The users, to read (token lookups).
    pub fn users(&self) -> std::sync::RwLockReadGuard<'_, crate::users::Users> {
        match self.users.read() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The users, to change.
    pub fn users_mut(&self) -> std::sync::RwLockWriteGuard<'_, crate::users::Users> {
        match self.users.write() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// Appends `entry` to the audit log: it rides with the next change's
    /// commit, or the lease ticker's flush within a second (so entries
    /// cost no commit of their own), and a full buffer is flushed at once.
    pub fn audit(&self, entry: crate::store::AuditEntry) {
        let full = {
            let mut pending = match self.audit_pending.lock() {
                Ok(pending) => pending,
                Err(poisoned) => poisoned.into_inner(),
            };
            pending.push(entry);
            pending.len() >= AUDIT_FLUSH_AT
        };
        if full {
            self.flush_audit();
        }
    }

    /// The audit entries not yet queued for a commit.
    pub fn take_audit(&self) -> Vec<crate::store::AuditEntry> {
        match self.audit_pending.lock() {
            Ok(mut pending) => std::mem::take(&mut *pending),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        }
    }

    /// Queues the pending audit entries for a commit of their own.
    pub fn flush_audit(&self) {
        let audit = self.take_audit();
        if !audit.is_empty() && self.read_only_reason().is_none() {
            self.writer.queue_quietly(Batch {
                audit,
                ..Batch::default()
            });
        }
    }

    /// The state, locked for a change. Never held across an `.await`. A
    /// lock poisoned by a panic mid-change is not recovered: the process
    /// aborts, and a restart rebuilds the state from the store.
    pub fn lock(&self) -> RwLockWriteGuard<'_, Core> {
        match self.core.write() {
            Ok(guard) => guard,
            Err(_) => poisoned(),
        }
    }

    /// The state, locked for reading (shared with other readers).
    pub fn read(&self) -> RwLockReadGuard<'_, Core> {
        match self.core.read() {
            Ok(guard) => guard,
            Err(_) => poisoned(),
        }
    }

    /// Why the server refuses changes, if it does.
    /// Writes one record of a feature's (a user, a secret, a join token:
    /// `None` removes it) into the batch `put` fills, and waits until it
    /// is durable; refused while the server is read-only.
    pub async fn save_record<T: serde::Serialize>(
        &self,
        record: Option<&T>,
        put: impl FnOnce(&mut crate::store::Batch, Option<String>),
    ) -> Result<(), ApiError> {
        self.queue_record(record, put)?.wait().await?;
        Ok(())
    }

    /// As [`Shared::save_record`], queued now (under whatever lock the
    /// caller holds) and durable once the answer is awaited.
    pub fn queue_record<T: serde::Serialize>(
        &self,
        record: Option<&T>,
        put: impl FnOnce(&mut crate::store::Batch, Option<String>),
    ) -> Result<crate::writer::Durable, ApiError> {
        if let Some(reason) = self.read_only_reason() {
            return Err(self.refused(&reason));
        }
        let text = record
            .map(serde_json::to_string)
            .transpose()
            .map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))?;
        let mut batch = crate::store::Batch::default();
        put(&mut batch, text);
        Ok(self.writer.queue(batch))
    }

    pub fn read_only_reason(&self) -> Option<String> {
        self.writer.failed()
    }

    /// The answer to every change once the store has failed (`reason`).
    /// A leader of several servers steps down on any failure of its store
    /// (crate::ha), within a quarter of its lease: its clients are sent to
    /// the next server at once (a submission with its idempotency key,
    /// answered with its job there if the failed commit did land), not
    /// told to wait for a restart. A server on its own is read-only until
    /// restarted.
    pub fn refused(&self, reason: &str) -> ApiError {
        if reason.contains("no longer the leader") {
            return no_longer_leads(reason);
        }
        if self.settings.leadership.is_some() {
            return no_longer_leads(&format!(
                "{}: {reason}",
                muster_api::protocol::STORE_COMMIT_FAILED
            ));
        }
        ApiError::new(
            ErrorCode::Unavailable,
            format!(
                "the server is read-only: a commit to its store failed ({reason}), so a change \
                 asked as it failed may or may not have been saved (look before asking again; a \
                 submission with the same Idempotency-Key answers its job once the server is \
                 back); nothing more is accepted until it is restarted with a working store \
                 (see /healthz)"
            ),
        )
    }

    /// Feeds one input to the control plane and queues what changed, with
    /// `extra` records in the same commit.
    pub fn apply(&self, input: Input, extra: Batch) -> Result<(Vec<Output>, Durable), ApiError> {
        let (outputs, durable, ()) = self.apply_with(|_| Ok((input, ())), |_, ()| (), extra)?;
        Ok((outputs, durable))
    }

    /// As [`Shared::apply`], with the input made under the same lock (to
    /// assign a job id or issue a node token, say; `make` may refuse), and
    /// `then` reading the state right after the change, still locked.
    pub fn apply_with<R, T>(
        &self,
        make: impl FnOnce(&mut Core) -> Result<(Input, R), ApiError>,
        then: impl FnOnce(&Core, R) -> T,
        extra: Batch,
    ) -> Result<(Vec<Output>, Durable, T), ApiError> {
        let (outputs, durable, made) = {
            let mut core = self.lock();
            if let Some(reason) = self.read_only_reason() {
                return Err(self.refused(&reason));
            }
            let (input, made) = make(&mut core)?;
            let outputs = core.control.handle(now(), input)?;
            let made = then(&core, made);
            let mut batch = extra;
            core.record(&outputs, &mut batch);
            batch.audit.extend(self.take_audit());
            (outputs, self.writer.queue(batch), made)
        };
        self.after(&outputs, true);
        Ok((outputs, durable, made))
    }

    /// [`Shared::apply_with`], with the extra records made from what `then`
    /// answered (written in the same commit).
    pub fn apply_with_batch<R, T>(
        &self,
        make: impl FnOnce(&mut Core) -> Result<(Input, R), ApiError>,
        then: impl FnOnce(&Core, R) -> T,
        extra: impl FnOnce(&T) -> Batch,
    ) -> Result<(Vec<Output>, Durable, T), ApiError> {
        let (outputs, durable, made) = {
            let mut core = self.lock();
            if let Some(reason) = self.read_only_reason() {
                return Err(self.refused(&reason));
            }
            let (input, made) = make(&mut core)?;
            let outputs = core.control.handle(now(), input)?;
            let made = then(&core, made);
            let mut batch = extra(&made);
            core.record(&outputs, &mut batch);
            batch.audit.extend(self.take_audit());
            (outputs, self.writer.queue(batch), made)
        };
        self.after(&outputs, true);
        Ok((outputs, durable, made))
    }

    /// Withdraws a submission whose commit failed (never acknowledged).
    pub fn withdraw(&self, id: muster_model::JobId) {
        let mut core = self.lock();
        if let Err(error) = core.control.withdraw(id) {
            tracing::warn!(job = id.0, %error, "an unsaved submission could not be withdrawn");
        }
    }

    /// Applies a scheduling cycle's outcome and queues what changed.
    /// Replaces the pending jobs' start forecasts (in memory only).
    pub fn apply_forecasts(
        &self,
        forecasts: std::collections::BTreeMap<muster_model::JobId, muster_sched::StartForecast>,
    ) {
        if self.read_only_reason().is_some() {
            return;
        }
        self.lock().control.set_forecasts(forecasts);
    }

    pub fn apply_outcome(&self, outcome: &muster_sched::Outcome) {
        let outputs = {
            let mut core = self.lock();
            if self.read_only_reason().is_some() {
                return;
            }
            let at = now();
            let outputs = core.control.apply_outcome(at, outcome);
            // What started now: how long each waited.
            for start in &outcome.started {
                if let Some(job) = core.control.job(start.job)
                    && job.started == Some(at)
                {
                    self.instruments.placements.inc();
                    self.instruments
                        .queue_wait_seconds
                        .observe(at.0.saturating_sub(job.submitted.0) as f64 / 1000.0);
                }
            }
            self.instruments
                .preemptions
                .inc_by(outcome.preemptions.len() as u64);
            let mut batch = Batch::default();
            core.record(&outputs, &mut batch);
            self.writer.queue_quietly(batch);
            outputs
        };
        self.after(&outputs, false);
    }

    /// Wakes who must know about `outputs`.
    fn after(&self, outputs: &[Output], wake_scheduler: bool) {
        if outputs.is_empty() {
            return;
        }
        self.state_version
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        if outputs
            .iter()
            .any(|o| matches!(o, Output::JobChanged(_) | Output::ReasonChanged(_)))
        {
            self.changes.send_modify(|version| *version += 1);
        }
        if wake_scheduler {
            self.wake_scheduler.notify_one();
        }
    }
}

impl Shared {
    /// Takes a node's credential away (its agent must join again with the
    /// join token, as a new machine would), saved before the answer.
    pub fn reset_identity(&self, name: &NodeName) -> Result<Durable, ApiError> {
        let mut core = self.lock();
        if let Some(reason) = self.read_only_reason() {
            return Err(self.refused(&reason));
        }
        let Some(node) = core.control.node(name) else {
            return Err(ApiError::not_found(format!(
                "no node {name}; `muster nodes` lists nodes"
            )));
        };
        let text = serde_json::to_string(&NodeRecord::from(node))
            .map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))?;
        core.revoke_credential(name);
        let mut batch = Batch::default();
        batch.nodes.insert(name.0.clone(), (text, String::new()));
        Ok(self.writer.queue(batch))
    }
}
