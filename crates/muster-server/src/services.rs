//! Services (docs/services.md): the shell around
//! `muster_control::services`. Keeps each service's record (its kept
//! revisions, the current one, the replica count) in the store's
//! `services` table, tracks its replicas (one-task jobs whose spec names
//! the service), hands their readiness and liveness checks to the agents
//! that run them (the server never connects to a replica), carries out the controller's actions (submit, drain, cancel) and serves
//! `/v1/services` and the endpoint table the gateway follows.

use crate::api::{Identity, principal_of, unprocessable};
use crate::core::{Shared, now};
use crate::error::{ApiError, Body, Params, PathParams};
use crate::store::Batch;
use axum::Json;
use axum::extract::State;
use muster_api::protocol::{
    CheckReport, CheckSpec, DesiredAllocation, Endpoint, EndpointList, EndpointTable, ErrorBody,
    ErrorCode, NetworkCheck, ReplicaView, RevisionView, RollbackRequest, ScaleRequest,
    ServiceEvent, ServiceList, ServiceRequest, ServiceView, TrafficAck, TrafficReport,
};
use muster_control::services::{
    Action, AutoscalerState, ControllerState, Load, ProbeState, Replica, ReplicaRun, Status,
    autoscale, reconcile,
};
use muster_control::{AllocationState, JobState};
use muster_model::{JobId, ProbeAction, ServiceRef, ServiceSpec, Time};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

type Shared_ = State<Arc<Shared>>;

/// The most services a server keeps.
pub const MAX_SERVICES: usize = 1_000;
/// Events kept per service.
const EVENTS: usize = 20;
/// Between controller rounds.
const ROUND: Duration = Duration::from_millis(250);
/// The longest a `GET /v1/endpoints?after=` waits for a change (a log
/// read with `follow` waits as long: the API's longest wait for a user).
const ENDPOINTS_WAIT: Duration = Duration::from_secs(10);

/// A service as stored.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServiceRecord {
    pub name: String,
    /// Whose replicas they are (its queues, its accounting).
    pub user: String,
    pub created_ms: u64,
    /// Oldest first; the current one among them.
    pub revisions: Vec<RevisionRecord>,
    pub current: u32,
    pub replicas: u32,
    #[serde(default)]
    pub deleting: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RevisionRecord {
    pub revision: u32,
    pub created_ms: u64,
    /// The spec as `muster_api::service::service_spec_value` writes it.
    pub spec: serde_json::Value,
}

impl ServiceRecord {
    /// Adds `spec` (as `service_spec_value` writes it) as the next revision
    /// and makes it current, keeping [`muster_model::KEPT_REVISIONS`].
    fn add_revision(&mut self, spec: serde_json::Value, created_ms: u64) {
        let revision = self
            .revisions
            .iter()
            .map(|kept| kept.revision)
            .max()
            .unwrap_or(0)
            + 1;
        self.revisions.push(RevisionRecord {
            revision,
            created_ms,
            spec,
        });
        self.current = revision;
        trim_revisions(self);
    }

    fn revision(&self, revision: u32) -> Option<&RevisionRecord> {
        self.revisions.iter().find(|kept| kept.revision == revision)
    }

    /// The current revision's spec, with the record's replica count.
    fn spec(&self) -> Result<ServiceSpec, String> {
        let kept = self.revision(self.current).ok_or_else(|| {
            format!(
                "service {}: revision {} is not kept",
                self.name, self.current
            )
        })?;
        let mut spec = muster_api::service::parse_stored_service_spec_value(&kept.spec)
            .map_err(|errors| format!("service {}: {errors}", self.name))?;
        spec.replicas = if self.deleting { 0 } else { self.replicas };
        Ok(spec)
    }
}

/// What the server tracks of one replica (memory only).
#[derive(Debug, Clone)]
struct Track {
    revision: u32,
    readiness: ProbeState,
    liveness: ProbeState,
    /// The last command-check runs taken in (readiness, liveness).
    runs: (u64, u64),
    draining_since: Option<Time>,
    stopping: bool,
}

impl Track {
    fn new(revision: u32) -> Self {
        Track {
            revision,
            readiness: ProbeState::new(false),
            liveness: ProbeState::new(true),
            runs: (0, 0),
            draining_since: None,
            stopping: false,
        }
    }
}

struct Entry {
    record: ServiceRecord,
    /// The current revision's spec; its `replicas` is what the controller
    /// keeps (the autoscaler's count when it has one).
    spec: ServiceSpec,
    controller: ControllerState,
    autoscaler: AutoscalerState,
    /// Why the autoscaler asks for the count it asks for.
    autoscaled: Option<String>,
    replicas: BTreeMap<JobId, Track>,
    status: Status,
    events: VecDeque<(u64, String)>,
}

impl Entry {
    fn event(&mut self, message: String) {
        tracing::info!(service = %self.record.name, "{message}");
        if self.events.len() >= EVENTS {
            self.events.pop_front();
        }
        self.events.push_back((now().0, message));
    }
}

/// Every service, in memory.
pub struct Services {
    entries: BTreeMap<String, Entry>,
    /// This process's [`EndpointTable::instance`].
    instance: u64,
    /// The endpoint table's version (grows with every change).
    version: u64,
    /// The endpoint table as last published.
    table: BTreeMap<String, Vec<Endpoint>>,
    /// Per service with `auth`, the SHA-256 (hex) of its bearer secret's
    /// value, as last published.
    auth: BTreeMap<String, String>,
}

impl Default for Services {
    fn default() -> Self {
        let mut bytes = [0u8; 8];
        // A clock reading if the system has no randomness to give.
        // Below 2^63: the API's integers are int64.
        let instance = match getrandom::fill(&mut bytes) {
            Ok(()) => u64::from_le_bytes(bytes) >> 1,
            Err(_) => now().0,
        };
        Services {
            entries: BTreeMap::new(),
            instance,
            version: 0,
            table: BTreeMap::new(),
            auth: BTreeMap::new(),
        }
    }
}

/// Serialises changes to services (API edits, the loop's removals), which
/// wait for the store between reading and writing a record.
#[derive(Default)]
pub struct ServiceState {
    services: std::sync::Mutex<Services>,
    traffic: std::sync::Mutex<Traffic>,
    /// The agents' latest check results.
    checks: std::sync::Mutex<CheckResults>,
    /// Each service's checks, as the last round published them (a leaf
    /// lock: the heartbeat reads it with the state locked).
    agent_checks: std::sync::Mutex<BTreeMap<String, Vec<CheckSpec>>>,
    edit: tokio::sync::Mutex<()>,
    /// Bumped with the endpoint table's version.
    changed: tokio::sync::watch::Sender<u64>,
}

impl std::fmt::Debug for ServiceState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceState")
            .field("services", &self.lock().entries.len())
            .finish()
    }
}

impl ServiceState {
    fn lock(&self) -> std::sync::MutexGuard<'_, Services> {
        match self.services.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// Takes in the stored services at start, and the replicas the control
/// plane holds (jobs naming a service); replicas of a service that no
/// longer exists are cancelled by the first round.
pub fn load(shared: &Shared, records: Vec<ServiceRecord>) {
    let mut services = shared.services.lock();
    for record in records {
        match record.spec() {
            Ok(spec) => {
                let name = record.name.clone();
                services.entries.insert(
                    name,
                    Entry {
                        record,
                        spec,
                        controller: ControllerState::default(),
                        autoscaler: AutoscalerState::default(),
                        autoscaled: None,
                        replicas: BTreeMap::new(),
                        status: Status::default(),
                        events: VecDeque::new(),
                    },
                );
            }
            Err(error) => {
                tracing::error!(%error, "a stored service does not read back; it is left alone")
            }
        }
    }
    let core = shared.read();
    for job in core.control().jobs() {
        if job.state.is_final() {
            continue;
        }
        if let Some(service) = &job.spec.service
            && let Some(entry) = services.entries.get_mut(&service.name)
        {
            entry.replicas.insert(job.id, Track::new(service.revision));
        }
    }
    // An autoscaled service starts from the replicas it has.
    for entry in services.entries.values_mut() {
        if let Some(rule) = entry.spec.autoscale
            && !entry.record.deleting
        {
            entry.spec.replicas =
                (entry.replicas.len() as u32).clamp(rule.min_replicas, rule.max_replicas);
        }
    }
}

/// (allocation, liveness) → (run, result): the agents' latest command-check
/// results (memory only; pruned to running replicas every round).
type CheckResults = BTreeMap<(u64, bool), (u64, Result<(), String>)>;

/// The gateways' latest reports (memory only).
#[derive(Default)]
struct Traffic {
    gateways: BTreeMap<String, GatewaySeen>,
}

struct GatewaySeen {
    at: Time,
    report: TrafficReport,
    /// Requests per second per service, from its last two reports.
    rates: BTreeMap<String, f64>,
}

/// A gateway silent this long no longer counts.
const TRAFFIC_STALE_MS: u64 = 10_000;
/// The most gateways kept.
const MAX_GATEWAYS: usize = 1_000;

impl Traffic {
    fn take(&mut self, at: Time, report: TrafficReport) {
        self.gateways
            .retain(|_, seen| at.millis_since(seen.at) <= TRAFFIC_STALE_MS);
        let mut rates = BTreeMap::new();
        if let Some(before) = self.gateways.get(&report.gateway) {
            let seconds = at.millis_since(before.at) as f64 / 1000.0;
            for (service, now) in &report.services {
                let rate = match before.report.services.get(service) {
                    Some(then) if seconds > 0.0 && now.requests >= then.requests => {
                        (now.requests - then.requests) as f64 / seconds
                    }
                    // A counter that went back: the gateway restarted.
                    _ => before.rates.get(service).copied().unwrap_or(0.0),
                };
                rates.insert(service.clone(), rate);
            }
        }
        if self.gateways.len() >= MAX_GATEWAYS && !self.gateways.contains_key(&report.gateway) {
            return;
        }
        self.gateways
            .insert(report.gateway.clone(), GatewaySeen { at, report, rates });
    }

    /// A service's load, summed over the gateways heard from lately.
    fn load(&self, at: Time, service: &str) -> Load {
        let mut load = Load::default();
        for seen in self.gateways.values() {
            if at.millis_since(seen.at) > TRAFFIC_STALE_MS {
                continue;
            }
            load.request_rate += seen.rates.get(service).copied().unwrap_or(0.0);
            if let Some(counts) = seen.report.services.get(service) {
                load.in_flight += counts.in_flight as f64;
                load.waiting += counts.waiting;
            }
        }
        load
    }
}

/// One replica as observed under the state's lock.
struct Seen {
    service: String,
    job: JobId,
    /// Its task's allocation, while it runs.
    allocation: Option<u64>,
    run: ReplicaRun,
    /// `ADDRESS:PORT` while it runs.
    endpoint: Option<String>,
}

fn observe(shared: &Shared, services: &Services) -> Vec<Seen> {
    let core = shared.read();
    let control = core.control();
    let mut seen = Vec::new();
    for (name, entry) in &services.entries {
        for &job in entry.replicas.keys() {
            let Some(found) = control.job(job) else {
                // Retired: it ended long ago.
                seen.push(Seen {
                    service: name.clone(),
                    job,
                    allocation: None,
                    run: ReplicaRun::Ended { failed: false },
                    endpoint: None,
                });
                continue;
            };
            let allocation_id = found.allocations.first().map(|id| id.0);
            let (run, endpoint) = match found.state {
                JobState::Pending => (ReplicaRun::Pending, None),
                JobState::Running | JobState::Stopping => {
                    let allocation = found
                        .allocations
                        .first()
                        .and_then(|id| control.allocation(*id));
                    match allocation {
                        Some(allocation) if allocation.state == AllocationState::Running => {
                            let address = control
                                .node(&allocation.node)
                                .map(|node| node.address.clone())
                                .unwrap_or_default();
                            let port = control.replica_port(found).unwrap_or(0);
                            (
                                ReplicaRun::Running {
                                    since: found.started.unwrap_or(found.submitted),
                                },
                                Some(format!("{address}:{port}")),
                            )
                        }
                        // Assigned, not yet started: as pending.
                        _ => (ReplicaRun::Pending, None),
                    }
                }
                JobState::Succeeded => (ReplicaRun::Ended { failed: false }, None),
                _ => (ReplicaRun::Ended { failed: true }, None),
            };
            seen.push(Seen {
                service: name.clone(),
                job,
                allocation: allocation_id,
                run,
                endpoint,
            });
        }
    }
    seen
}

/// The controller: a round every quarter second while the server runs.
pub async fn run(shared: Arc<Shared>, mut shutdown: tokio::sync::watch::Receiver<bool>) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(ROUND) => {}
            _ = shutdown.changed() => return,
        }
        if *shutdown.borrow() {
            return;
        }
        if shared.read_only_reason().is_some() {
            continue;
        }
        round(&shared).await;
    }
}

async fn round(shared: &Arc<Shared>) {
    // What runs (every check runs on the replica's node, by its agent).
    let seen = {
        let services = shared.services.lock();
        if services.entries.is_empty() {
            // No replica to keep results for (an agent may still report
            // for a moment after the last service goes).
            match shared.services.checks.lock() {
                Ok(mut reported) => reported.clear(),
                Err(poisoned) => poisoned.into_inner().clear(),
            }
            return;
        }
        observe(shared, &services)
    };
    let at = now();
    // Decide.
    let mut todo: Vec<(String, Action)> = Vec::new();
    let mut finished: Vec<String> = Vec::new();
    {
        let mut services = shared.services.lock();
        // The agents' checks, each run taken in once.
        {
            let mut reported = match shared.services.checks.lock() {
                Ok(reported) => reported,
                Err(poisoned) => poisoned.into_inner(),
            };
            let live: std::collections::BTreeSet<u64> = seen
                .iter()
                .filter_map(|replica| replica.allocation)
                .collect();
            reported.retain(|(allocation, _), _| live.contains(allocation));
            for replica in &seen {
                let (ReplicaRun::Running { .. }, Some(allocation)) =
                    (replica.run, replica.allocation)
                else {
                    continue;
                };
                let Some(entry) = services.entries.get_mut(&replica.service) else {
                    continue;
                };
                let (readiness, liveness) =
                    (entry.spec.readiness.clone(), entry.spec.liveness.clone());
                let Some(track) = entry.replicas.get_mut(&replica.job) else {
                    continue;
                };
                for (is_liveness, probe) in [(false, readiness), (true, liveness)] {
                    let Some(probe) = probe else {
                        continue;
                    };
                    let Some((run, result)) = reported.get(&(allocation, is_liveness)) else {
                        continue;
                    };
                    let last = if is_liveness {
                        &mut track.runs.1
                    } else {
                        &mut track.runs.0
                    };
                    if *run > *last {
                        *last = *run;
                        let state = if is_liveness {
                            &mut track.liveness
                        } else {
                            &mut track.readiness
                        };
                        state.record(&probe, at, result.clone());
                    }
                }
            }
        }
        let names: Vec<String> = services.entries.keys().cloned().collect();
        let traffic = match shared.services.traffic.lock() {
            Ok(traffic) => traffic,
            Err(poisoned) => poisoned.into_inner(),
        };
        for name in names {
            let Some(entry) = services.entries.get_mut(&name) else {
                continue;
            };
            if let Some(rule) = entry.spec.autoscale
                && !entry.record.deleting
            {
                let mut load = traffic.load(at, &name);
                load.ready = entry.status.ready;
                if matches!(rule.metric, muster_model::ScaleMetric::GpuUtilization(_)) {
                    load.gpu_utilization = gpu_utilization(shared, entry, at);
                }
                let current = entry.spec.replicas;
                let (count, why) = autoscale(at, &rule, current, &load, &mut entry.autoscaler);
                if count != current {
                    entry.event(format!(
                        "autoscaled from {current} to {count} replicas: {why}"
                    ));
                    entry.spec.replicas = count;
                }
                entry.autoscaled = Some(why);
            }
            let replicas: Vec<Replica> = seen
                .iter()
                .filter(|replica| replica.service == name)
                .filter_map(|replica| {
                    let track = entry.replicas.get(&replica.job)?;
                    let running = matches!(replica.run, ReplicaRun::Running { .. });
                    let ready = running
                        && match &entry.spec.readiness {
                            Some(_) => track.readiness.passing,
                            None => true,
                        };
                    Some(Replica {
                        job: replica.job,
                        revision: track.revision,
                        run: replica.run,
                        draining_since: track.draining_since,
                        stopping: track.stopping,
                        ready,
                        dead: (running && !track.liveness.passing)
                            .then(|| track.liveness.message.clone().unwrap_or_default()),
                        not_ready: track.readiness.message.clone(),
                    })
                })
                .collect();
            let revision = entry.record.current;
            let (actions, status) =
                reconcile(at, &entry.spec, revision, &replicas, &mut entry.controller);
            entry.status = status;
            for action in actions {
                match &action {
                    Action::Drain { job } => {
                        if let Some(track) = entry.replicas.get_mut(job) {
                            track.draining_since = Some(at);
                        }
                        entry.event(format!("replica job {} drains", job.0));
                    }
                    Action::Stop { job, why } => {
                        if let Some(track) = entry.replicas.get_mut(job) {
                            track.stopping = true;
                        }
                        entry.event(format!("replica job {} stops: {why}", job.0));
                        todo.push((name.clone(), action));
                    }
                    Action::Forget { job } => {
                        entry.replicas.remove(job);
                    }
                    Action::Start { .. } => todo.push((name.clone(), action)),
                }
            }
            if entry.record.deleting && entry.replicas.is_empty() {
                finished.push(name.clone());
            }
        }
        drop(traffic);
        publish(shared, &mut services, &seen);
    }
    for (name, action) in todo {
        match action {
            Action::Start { revision } => start_replica(shared, &name, revision).await,
            Action::Stop { job, .. } => {
                match shared.apply(muster_control::Input::Cancel { job }, Batch::default()) {
                    Ok((_, durable)) => {
                        if let Err(error) = durable.wait().await {
                            tracing::warn!(job = job.0, %error, "a replica's stop was not saved");
                        }
                    }
                    Err(error) => {
                        tracing::debug!(job = job.0, error = %error.body.message, "replica stop")
                    }
                }
            }
            Action::Drain { .. } | Action::Forget { .. } => {}
        }
    }
    for name in finished {
        let _edit = shared.services.edit.lock().await;
        let batch = Batch {
            services: BTreeMap::from([(name.clone(), None)]),
            ..Batch::default()
        };
        if shared.writer.queue(batch).wait().await.is_ok() {
            let mut services = shared.services.lock();
            if services
                .entries
                .get(&name)
                .is_some_and(|entry| entry.record.deleting && entry.replicas.is_empty())
            {
                services.entries.remove(&name);
                tracing::info!(service = %name, "service deleted");
            }
        }
    }
}

/// A service's checks as the agents get them; a network check's port is
/// each replica's own (see [`fill_checks`]).
fn checks_of(spec: &ServiceSpec) -> Vec<CheckSpec> {
    [(false, &spec.readiness), (true, &spec.liveness)]
        .into_iter()
        .filter_map(|(liveness, probe)| {
            let probe = probe.as_ref()?;
            let (command, network) = match &probe.action {
                ProbeAction::Command(command) => (command.clone(), None),
                ProbeAction::Tcp => (
                    Vec::new(),
                    Some(NetworkCheck {
                        port: 0,
                        http_path: None,
                    }),
                ),
                ProbeAction::Http { path } => (
                    Vec::new(),
                    Some(NetworkCheck {
                        port: 0,
                        http_path: Some(path.clone()),
                    }),
                ),
            };
            Some(CheckSpec {
                liveness,
                command,
                network,
                period_ms: probe.period.as_millis() as u64,
                timeout_ms: probe.timeout.as_millis() as u64,
                initial_delay_ms: probe.initial_delay.as_millis() as u64,
            })
        })
        .collect()
}

/// Adds each replica's checks to its node's desired set (the agent runs
/// them beside the task; a network check against the replica's own port).
/// Called with the state's lock held: it takes only the leaf lock of the
/// checks each round publishes, never the services' own (which is held
/// while the state is read).
pub fn fill_checks(
    shared: &Shared,
    control: &muster_control::ControlPlane,
    desired: &mut [DesiredAllocation],
) {
    let published = match shared.services.agent_checks.lock() {
        Ok(published) => published,
        Err(poisoned) => poisoned.into_inner(),
    };
    if published.is_empty() {
        return;
    }
    for task in desired.iter_mut().filter(|task| !task.stop) {
        let Some(job) = control.job(JobId(task.job)) else {
            continue;
        };
        let Some(checks) = job
            .spec
            .service
            .as_ref()
            .and_then(|service| published.get(&service.name))
        else {
            continue;
        };
        let port = control.replica_port(job).unwrap_or(0);
        task.checks.extend(checks.iter().cloned().map(|mut check| {
            if let Some(network) = &mut check.network {
                network.port = port;
            }
            check
        }));
    }
}

/// A node's command-check results (its own token): the latest run of each
/// check of its tasks, taken in by the next controller round.
#[utoipa::path(
    post, path = "/v1/agents/{node}/checks", tag = "agents",
    params(("node" = String, Path, description = "the node's name")),
    request_body = CheckReport,
    responses((status = 200, description = "kept")),
    security(("bearer" = []))
)]
pub async fn agent_checks(
    State(shared): Shared_,
    PathParams(node): PathParams<String>,
    Body(report): Body<CheckReport>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let node = muster_model::NodeName(node);
    let owned: std::collections::BTreeSet<u64> = {
        let core = shared.read();
        core.control()
            .live_allocations(&node)
            .map(|allocation| allocation.id.0)
            .collect()
    };
    let mut checks = match shared.services.checks.lock() {
        Ok(checks) => checks,
        Err(poisoned) => poisoned.into_inner(),
    };
    let mut kept = 0u64;
    for result in report.results {
        // Only this node's tasks.
        if !owned.contains(&result.allocation) {
            continue;
        }
        let key = (result.allocation, result.liveness);
        if checks.get(&key).is_some_and(|(run, _)| *run >= result.run) {
            continue;
        }
        let outcome = if result.ok {
            Ok(())
        } else {
            let mut message = result.message;
            muster_model::truncate_at_char_boundary(&mut message, 1024);
            Err(message)
        };
        checks.insert(key, (result.run, outcome));
        kept += 1;
    }
    Ok(Json(serde_json::json!({ "kept": kept })))
}

/// The mean utilisation of the GPUs of `entry`'s running replicas, from
/// their nodes' fresh telemetry.
fn gpu_utilization(shared: &Shared, entry: &Entry, at: Time) -> Option<f64> {
    // The state before the telemetry, as everywhere else.
    let core = shared.read();
    let control = core.control();
    let telemetry = match shared.telemetry.lock() {
        Ok(telemetry) => telemetry,
        Err(poisoned) => poisoned.into_inner(),
    };
    let (mut sum, mut count) = (0.0, 0u32);
    for &job in entry.replicas.keys() {
        let Some(allocation) = control
            .job(job)
            .and_then(|job| job.allocations.first())
            .and_then(|id| control.allocation(*id))
            .filter(|allocation| allocation.state == AllocationState::Running)
        else {
            continue;
        };
        let Some(node) = telemetry.get(&allocation.node.0) else {
            continue;
        };
        if at.0.saturating_sub(node.received_ms) > crate::metrics::STALE_MS {
            continue;
        }
        for (index, _) in &allocation.gpus {
            if let Some(gpu) = node.report.gpus.iter().find(|gpu| gpu.index == *index) {
                sum += f64::from(gpu.utilization_pct);
                count += 1;
            }
        }
    }
    (count > 0).then(|| sum / f64::from(count))
}

/// Recomputes the endpoint table; a change bumps its version and wakes
/// whoever follows it.
fn publish(shared: &Shared, services: &mut Services, seen: &[Seen]) {
    let checks: BTreeMap<String, Vec<CheckSpec>> = services
        .entries
        .iter()
        .map(|(name, entry)| (name.clone(), checks_of(&entry.spec)))
        .filter(|(_, checks)| !checks.is_empty())
        .collect();
    match shared.services.agent_checks.lock() {
        Ok(mut published) => *published = checks,
        Err(poisoned) => *poisoned.into_inner() = checks,
    }
    let mut table: BTreeMap<String, Vec<Endpoint>> = BTreeMap::new();
    for (name, entry) in &services.entries {
        let mut endpoints = Vec::new();
        for replica in seen.iter().filter(|replica| &replica.service == name) {
            let (Some(track), Some(address)) =
                (entry.replicas.get(&replica.job), &replica.endpoint)
            else {
                continue;
            };
            let ready = match &entry.spec.readiness {
                Some(_) => track.readiness.passing,
                None => true,
            };
            if ready && track.draining_since.is_none() && !track.stopping && track.liveness.passing
            {
                endpoints.push(Endpoint {
                    job: replica.job.0,
                    revision: track.revision,
                    address: address.clone(),
                });
            }
        }
        table.insert(name.clone(), endpoints);
    }
    // The gateway checks callers against a hash: the secret itself never
    // leaves the server. A secret that is gone refuses every caller.
    let auth: BTreeMap<String, String> = {
        let secrets = shared
            .secrets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        services
            .entries
            .iter()
            .filter_map(|(name, entry)| {
                let secret = entry.spec.bearer_secret.as_ref()?;
                let hash = match secrets.value(secret, &entry.spec.template.queue.0) {
                    Some(value) => crate::users::token_hash(&value),
                    None => String::new(),
                };
                Some((name.clone(), hash))
            })
            .collect()
    };
    if table != services.table || auth != services.auth {
        services.table = table;
        services.auth = auth;
        services.version += 1;
        shared.services.changed.send_replace(services.version);
    }
}

async fn start_replica(shared: &Arc<Shared>, name: &str, revision: u32) {
    let (spec, user) = {
        let services = shared.services.lock();
        let Some(entry) = services.entries.get(name) else {
            return;
        };
        let mut spec = entry.spec.template.clone();
        spec.service = Some(ServiceRef {
            name: name.to_string(),
            revision,
            port: entry.spec.port,
            spread: entry.spec.spread,
        });
        (spec, entry.record.user.clone())
    };
    match crate::api::submit_spec(shared, spec, user, true, None, None).await {
        Ok((_, Json(response))) => {
            let mut services = shared.services.lock();
            if let Some(entry) = services.entries.get_mut(name) {
                entry
                    .replicas
                    .insert(JobId(response.id), Track::new(revision));
                entry.event(format!(
                    "replica job {} of revision {revision} submitted",
                    response.id
                ));
            }
        }
        Err(error) => {
            let mut services = shared.services.lock();
            if let Some(entry) = services.entries.get_mut(name) {
                let why = format!("a replica could not be submitted: {}", error.body.message);
                entry.event(why.clone());
                // Tried again after the backoff, as after a failure.
                entry.controller.failed(now(), &entry.spec, why);
            }
        }
    }
}

// ------------------------------------------------------------------ API

fn not_found(name: &str) -> ApiError {
    ApiError::not_found(format!(
        "no service {name}; `muster services list` lists them"
    ))
}

/// Whether `principal` may change service `record` (its owner, or staff).
fn may_change(principal: &crate::users::Principal, record: &ServiceRecord) -> Result<(), ApiError> {
    if principal.name == record.user || principal.role != crate::users::Role::User {
        return Ok(());
    }
    Err(ApiError::new(
        ErrorCode::PermissionDenied,
        format!(
            "service {} is {}'s; only its owner, an operator or an admin may change it",
            record.name, record.user
        ),
    ))
}

/// Service `name` as `principal` may change it: its record and current
/// spec; refused while it is being deleted unless `deleting_ok`.
fn changeable(
    shared: &Shared,
    principal: &crate::users::Principal,
    name: &str,
    deleting_ok: bool,
) -> Result<(ServiceRecord, ServiceSpec), ApiError> {
    let services = shared.services.lock();
    let entry = services.entries.get(name).ok_or_else(|| not_found(name))?;
    may_change(principal, &entry.record)?;
    if entry.record.deleting && !deleting_ok {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!("service {name} is being deleted"),
        ));
    }
    Ok((entry.record.clone(), entry.spec.clone()))
}

fn may_read(shared: &Shared, principal: &crate::users::Principal, record: &ServiceRecord) -> bool {
    if principal.name == record.user || principal.role != crate::users::Role::User {
        return true;
    }
    let queue = record
        .spec()
        .map(|spec| spec.template.queue.0)
        .unwrap_or_default();
    principal.member_of(&queue)
        && shared
            .read()
            .control()
            .queues()
            .any(|spec| spec.name.0 == queue && spec.members_see_jobs)
}

/// Parses a request's spec and checks what a job submission checks.
fn checked_spec(
    shared: &Shared,
    principal: &crate::users::Principal,
    value: &serde_json::Value,
) -> Result<ServiceSpec, ApiError> {
    let spec = muster_api::service::parse_service_spec_value(value)
        .map_err(|errors| unprocessable(errors.to_string()))?;
    crate::secrets::check_spec(shared, &spec.template).map_err(|error| {
        if error.body.code == ErrorCode::InvalidArgument {
            error.with_status(axum::http::StatusCode::UNPROCESSABLE_ENTITY)
        } else {
            error
        }
    })?;
    crate::api::check_mounts(shared, &spec.template)?;
    if let Some(secret) = &spec.bearer_secret
        && !shared
            .secrets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .usable(secret, &spec.template.queue.0)
    {
        return Err(unprocessable(format!(
            "auth.bearer_secret: no secret {secret} for queue {}; an admin sets it with \
             `muster secrets set {secret}` (the value callers send as a bearer token)",
            spec.template.queue
        )));
    }
    if !principal.member_of(&spec.template.queue.0) {
        return Err(ApiError::new(
            ErrorCode::PermissionDenied,
            format!(
                "{} may use queue(s) {}, not {}",
                principal.name,
                principal.queues.clone().unwrap_or_default().join(", "),
                spec.template.queue
            ),
        ));
    }
    if spec.replicas > 0
        && let Some(why) = shared.read().control().never_fits(&spec.template)
    {
        return Err(unprocessable(format!("a replica could never run: {why}")));
    }
    Ok(spec)
}

fn runs(spec: &serde_json::Value) -> String {
    if let Some(image) = spec.get("image").and_then(|image| image.as_str()) {
        return image.to_string();
    }
    match spec.get("command") {
        Some(serde_json::Value::Array(argv)) => argv
            .iter()
            .map(|arg| arg.as_str().unwrap_or_default())
            .collect::<Vec<_>>()
            .join(" "),
        Some(serde_json::Value::String(text)) => text.clone(),
        _ => String::new(),
    }
}

fn view(shared: &Shared, entry: &Entry, endpoints: &[Endpoint]) -> ServiceView {
    let core = shared.read();
    let control = core.control();
    let replica_list = entry
        .replicas
        .iter()
        .map(|(&job, track)| {
            let found = control.job(job);
            let allocation = found
                .and_then(|job| job.allocations.first())
                .and_then(|id| control.allocation(*id));
            let ready = endpoints.iter().any(|endpoint| endpoint.job == job.0);
            let state = match found.map(|job| job.state) {
                None => "ended".to_string(),
                Some(JobState::Pending) => "pending".to_string(),
                Some(JobState::Running | JobState::Stopping) if track.stopping => {
                    "stopping".to_string()
                }
                Some(JobState::Running | JobState::Stopping) if track.draining_since.is_some() => {
                    "draining".to_string()
                }
                Some(JobState::Running) if ready => "ready".to_string(),
                Some(JobState::Running | JobState::Stopping) => "starting".to_string(),
                Some(other) => other.name().to_string(),
            };
            ReplicaView {
                job: job.0,
                revision: track.revision,
                state,
                node: allocation.map(|allocation| allocation.node.0.clone()),
                endpoint: allocation.and_then(|allocation| {
                    let address = control.node(&allocation.node)?.address.clone();
                    let port = control.replica_port(found?)?;
                    Some(format!("{address}:{port}"))
                }),
                not_ready: (!ready).then(|| track.readiness.message.clone()).flatten(),
                started_ms: found.and_then(|job| job.started).map(|time| time.0),
            }
        })
        .collect();
    ServiceView {
        name: entry.record.name.clone(),
        user: entry.record.user.clone(),
        queue: entry.spec.template.queue.0.clone(),
        revision: entry.record.current,
        replicas: entry.spec.replicas,
        current: entry.status.current,
        ready: entry.status.ready,
        updated: entry.status.updated,
        rollout: entry.status.rollout.clone(),
        backoff_until_ms: entry.status.backoff_until.map(|time| time.0),
        last_failure: entry.controller.last_failure_why.clone(),
        deleting: entry.record.deleting,
        autoscaling: entry.spec.autoscale.map(|rule| {
            let follows = match rule.metric {
                muster_model::ScaleMetric::RequestRate(rate) => {
                    format!("{rate} requests/s a replica")
                }
                muster_model::ScaleMetric::InFlight(count) => {
                    format!("{count} requests in flight a replica")
                }
                muster_model::ScaleMetric::GpuUtilization(pct) => format!("GPUs {pct}% busy"),
            };
            format!(
                "{} to {} replicas for {follows} (down after {}s); now: {}",
                rule.min_replicas,
                rule.max_replicas,
                rule.window.as_secs(),
                entry
                    .autoscaled
                    .clone()
                    .unwrap_or_else(|| "no traffic seen yet".into())
            )
        }),
        replica_list,
        revisions: entry
            .record
            .revisions
            .iter()
            .map(|kept| RevisionView {
                revision: kept.revision,
                created_ms: kept.created_ms,
                runs: runs(&kept.spec),
            })
            .collect(),
        spec: entry
            .record
            .revision(entry.record.current)
            .map(|kept| kept.spec.clone())
            .unwrap_or_default(),
        events: entry
            .events
            .iter()
            .map(|(at, message)| ServiceEvent {
                at_ms: *at,
                message: message.clone(),
            })
            .collect(),
    }
}

fn view_of(shared: &Shared, name: &str) -> Result<ServiceView, ApiError> {
    let services = shared.services.lock();
    let entry = services.entries.get(name).ok_or_else(|| not_found(name))?;
    let endpoints = services.table.get(name).cloned().unwrap_or_default();
    Ok(view(shared, entry, &endpoints))
}

async fn save(shared: &Shared, record: &ServiceRecord) -> Result<(), ApiError> {
    let text = serde_json::to_string(record)
        .map_err(|error| ApiError::new(ErrorCode::Internal, error.to_string()))?;
    let batch = Batch {
        services: BTreeMap::from([(record.name.clone(), Some(text))]),
        ..Batch::default()
    };
    shared.writer.queue(batch).wait().await?;
    Ok(())
}

/// Create a service: its replicas start at once.
#[utoipa::path(
    post, path = "/v1/services", tag = "services",
    request_body = ServiceRequest,
    responses(
        (status = 201, body = ServiceView),
        (status = 409, description = "a service of that name exists", body = ErrorBody),
        (status = 422, description = "the spec is refused: every problem, one per line", body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn create_service(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    Body(request): Body<ServiceRequest>,
) -> Result<(axum::http::StatusCode, Json<ServiceView>), ApiError> {
    let principal = principal_of(&identity)?;
    let spec = checked_spec(&shared, &principal, &request.spec)?;
    let _edit = shared.services.edit.lock().await;
    {
        let services = shared.services.lock();
        if services.entries.contains_key(&spec.name) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!(
                    "service {} exists; change it with `muster services update`, or delete it \
                     first",
                    spec.name
                ),
            ));
        }
        if services.entries.len() >= MAX_SERVICES {
            return Err(ApiError::invalid(format!(
                "at most {MAX_SERVICES} services; delete one first"
            )));
        }
        if principal.role == crate::users::Role::User
            && let Some(max) = shared.settings.max_services_per_user
        {
            let owned = services
                .entries
                .values()
                .filter(|entry| entry.record.user == principal.name)
                .count() as u64;
            if owned >= max {
                return Err(ApiError::new(
                    ErrorCode::PermissionDenied,
                    format!(
                        "{} has {owned} service(s) and may have at most {max}: delete one \
                         first (`muster services delete NAME`), or ask an admin (the server's \
                         --max-services-per-user)",
                        principal.name
                    ),
                ));
            }
        }
    }
    let at = now().0;
    let record = ServiceRecord {
        name: spec.name.clone(),
        user: principal.name.clone(),
        created_ms: at,
        revisions: vec![RevisionRecord {
            revision: 1,
            created_ms: at,
            spec: muster_api::service::service_spec_value(&spec),
        }],
        current: 1,
        replicas: spec.replicas,
        deleting: false,
    };
    save(&shared, &record).await?;
    let name = spec.name.clone();
    {
        let mut services = shared.services.lock();
        let mut entry = Entry {
            record,
            spec,
            controller: ControllerState::default(),
            autoscaler: AutoscalerState::default(),
            autoscaled: None,
            replicas: BTreeMap::new(),
            status: Status::default(),
            events: VecDeque::new(),
        };
        entry.event(format!("created by {} (revision 1)", principal.name));
        services.entries.insert(name.clone(), entry);
    }
    Ok((
        axum::http::StatusCode::CREATED,
        Json(view_of(&shared, &name)?),
    ))
}

/// Change a service: a new template is a new revision, rolled out one
/// replica at a time; other changes (replicas, checks, strategy) apply at
/// once.
#[utoipa::path(
    put, path = "/v1/services/{name}", tag = "services",
    params(("name" = String, Path, description = "the service", pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    request_body = ServiceRequest,
    responses(
        (status = 200, body = ServiceView),
        (status = 404, body = ErrorBody),
        (status = 422, body = ErrorBody),
        (status = 503, body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn update_service(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
    Body(request): Body<ServiceRequest>,
) -> Result<Json<ServiceView>, ApiError> {
    let principal = principal_of(&identity)?;
    let spec = checked_spec(&shared, &principal, &request.spec)?;
    if spec.name != name {
        return Err(unprocessable(format!(
            "name: the spec names service {}, the request {name}; a service cannot be renamed",
            spec.name
        )));
    }
    let _edit = shared.services.edit.lock().await;
    let (mut record, old) = changeable(&shared, &principal, &name, false)?;
    let value = muster_api::service::service_spec_value(&spec);
    let new_revision = spec.template_differs(&old);
    if new_revision {
        record.add_revision(value, now().0);
    } else if let Some(kept) = record
        .revisions
        .iter_mut()
        .find(|kept| kept.revision == record.current)
    {
        kept.spec = value;
    }
    record.replicas = spec.replicas;
    save(&shared, &record).await?;
    {
        let mut services = shared.services.lock();
        if let Some(entry) = services.entries.get_mut(&name) {
            let current = record.current;
            let mut spec = spec;
            if let Some(rule) = spec.autoscale {
                spec.replicas = entry
                    .spec
                    .replicas
                    .clamp(rule.min_replicas, rule.max_replicas);
            }
            entry.record = record;
            entry.spec = spec;
            entry.event(if new_revision {
                format!(
                    "updated by {}: revision {current} rolls out",
                    principal.name
                )
            } else {
                format!(
                    "updated by {} (same template, revision {current})",
                    principal.name
                )
            });
        }
    }
    Ok(Json(view_of(&shared, &name)?))
}

/// Keeps [`muster_model::KEPT_REVISIONS`], the current one always.
fn trim_revisions(record: &mut ServiceRecord) {
    while record.revisions.len() > muster_model::KEPT_REVISIONS {
        let Some(position) = record
            .revisions
            .iter()
            .position(|kept| kept.revision != record.current)
        else {
            break;
        };
        record.revisions.remove(position);
    }
}

/// Set a service's replica count.
#[utoipa::path(
    post, path = "/v1/services/{name}/scale", tag = "services",
    params(("name" = String, Path, description = "the service", pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    request_body = ScaleRequest,
    responses((status = 200, body = ServiceView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn scale_service(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
    Body(request): Body<ScaleRequest>,
) -> Result<Json<ServiceView>, ApiError> {
    let principal = principal_of(&identity)?;
    if request.replicas > muster_model::MAX_REPLICAS {
        return Err(ApiError::invalid(format!(
            "replicas: at most {}, got {}",
            muster_model::MAX_REPLICAS,
            request.replicas
        )));
    }
    let _edit = shared.services.edit.lock().await;
    let (mut record, spec) = changeable(&shared, &principal, &name, false)?;
    if let Some(rule) = spec.autoscale {
        return Err(ApiError::new(
            ErrorCode::Conflict,
            format!(
                "service {name} is autoscaled ({} to {} replicas); change `autoscale` in its \
                 spec with `muster services update`",
                rule.min_replicas, rule.max_replicas
            ),
        ));
    }
    let before = record.replicas;
    record.replicas = request.replicas;
    save(&shared, &record).await?;
    {
        let mut services = shared.services.lock();
        if let Some(entry) = services.entries.get_mut(&name) {
            entry.record.replicas = request.replicas;
            entry.spec.replicas = request.replicas;
            entry.event(format!(
                "scaled from {before} to {} replicas by {}",
                request.replicas, principal.name
            ));
        }
    }
    Ok(Json(view_of(&shared, &name)?))
}

/// Run an earlier revision's template again (as a new revision, rolled
/// out like an update).
#[utoipa::path(
    post, path = "/v1/services/{name}/rollback", tag = "services",
    params(("name" = String, Path, description = "the service", pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    request_body = RollbackRequest,
    responses((status = 200, body = ServiceView), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody), (status = 422, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn rollback_service(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
    Body(request): Body<RollbackRequest>,
) -> Result<Json<ServiceView>, ApiError> {
    let principal = principal_of(&identity)?;
    let _edit = shared.services.edit.lock().await;
    let (mut record, _) = changeable(&shared, &principal, &name, false)?;
    let target = match request.revision {
        Some(revision) => revision,
        None => record
            .revisions
            .iter()
            .map(|kept| kept.revision)
            .filter(|&revision| revision < record.current)
            .max()
            .ok_or_else(|| {
                unprocessable(format!(
                    "service {name} has no revision before {} to roll back to",
                    record.current
                ))
            })?,
    };
    if target == record.current {
        return Err(unprocessable(format!(
            "revision {target} is the current one already"
        )));
    }
    let kept = record.revision(target).cloned().ok_or_else(|| {
        unprocessable(format!(
            "revision {target} is not kept (kept: {})",
            record
                .revisions
                .iter()
                .map(|kept| kept.revision.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ))
    })?;
    let mut spec = muster_api::service::parse_stored_service_spec_value(&kept.spec)
        .map_err(|errors| unprocessable(errors.to_string()))?;
    spec.replicas = record.replicas;
    let autoscaled = {
        let services = shared.services.lock();
        services
            .entries
            .get(&name)
            .map_or(record.replicas, |entry| entry.spec.replicas)
    };
    if let Some(rule) = spec.autoscale {
        spec.replicas = autoscaled.clamp(rule.min_replicas, rule.max_replicas);
    }
    record.add_revision(muster_api::service::service_spec_value(&spec), now().0);
    let revision = record.current;
    save(&shared, &record).await?;
    {
        let mut services = shared.services.lock();
        if let Some(entry) = services.entries.get_mut(&name) {
            entry.record = record;
            entry.spec = spec;
            entry.event(format!(
                "rolled back by {} to revision {target}'s template (as revision {revision})",
                principal.name
            ));
        }
    }
    Ok(Json(view_of(&shared, &name)?))
}

/// Delete a service: its replicas drain and stop, then it is gone.
#[utoipa::path(
    delete, path = "/v1/services/{name}", tag = "services",
    params(("name" = String, Path, description = "the service", pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    responses((status = 200, body = ServiceView), (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn delete_service(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
) -> Result<Json<ServiceView>, ApiError> {
    let principal = principal_of(&identity)?;
    let _edit = shared.services.edit.lock().await;
    let (mut record, _) = changeable(&shared, &principal, &name, true)?;
    if !record.deleting {
        record.deleting = true;
        save(&shared, &record).await?;
        let mut services = shared.services.lock();
        if let Some(entry) = services.entries.get_mut(&name) {
            entry.record.deleting = true;
            entry.spec.replicas = 0;
            entry.event(format!("deleted by {}: replicas drain", principal.name));
        }
    }
    Ok(Json(view_of(&shared, &name)?))
}

/// Every service the caller may see.
#[utoipa::path(
    get, path = "/v1/services", tag = "services",
    responses((status = 200, body = ServiceList)),
    security(("bearer" = []))
)]
pub async fn list_services(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
) -> Result<Json<ServiceList>, ApiError> {
    let principal = principal_of(&identity)?;
    let services = shared.services.lock();
    let list = services
        .entries
        .values()
        .filter(|entry| may_read(&shared, &principal, &entry.record))
        .map(|entry| {
            let endpoints = services
                .table
                .get(&entry.record.name)
                .cloned()
                .unwrap_or_default();
            view(&shared, entry, &endpoints)
        })
        .collect();
    Ok(Json(ServiceList { services: list }))
}

/// One service: its replicas, revisions, rollout and recent events.
#[utoipa::path(
    get, path = "/v1/services/{name}", tag = "services",
    params(("name" = String, Path, description = "the service", pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    responses((status = 200, body = ServiceView), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn get_service(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
) -> Result<Json<ServiceView>, ApiError> {
    let principal = principal_of(&identity)?;
    {
        let services = shared.services.lock();
        let entry = services
            .entries
            .get(&name)
            .ok_or_else(|| not_found(&name))?;
        if !may_read(&shared, &principal, &entry.record) {
            return Err(not_found(&name));
        }
    }
    Ok(Json(view_of(&shared, &name)?))
}

/// A service's ready replicas (`ADDRESS:PORT`), for clients that balance
/// themselves.
#[utoipa::path(
    get, path = "/v1/services/{name}/endpoints", tag = "services",
    params(("name" = String, Path, description = "the service", pattern = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")),
    responses((status = 200, body = EndpointList), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn service_endpoints(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<Identity>,
    PathParams(name): PathParams<String>,
) -> Result<Json<EndpointList>, ApiError> {
    let principal = principal_of(&identity)?;
    let services = shared.services.lock();
    // Another user's service is not there for this one, as with jobs.
    match services.entries.get(&name) {
        Some(entry) if may_read(&shared, &principal, &entry.record) => {}
        _ => return Err(not_found(&name)),
    }
    Ok(Json(EndpointList {
        service: name.clone(),
        endpoints: services.table.get(&name).cloned().unwrap_or_default(),
    }))
}

/// A gateway's traffic per service (an operator's or admin's token): what
/// the autoscaler follows.
#[utoipa::path(
    post, path = "/v1/traffic", tag = "services",
    request_body = TrafficReport,
    responses((status = 200, body = TrafficAck)),
    security(("bearer" = []))
)]
pub async fn report_traffic(
    State(shared): Shared_,
    Body(report): Body<TrafficReport>,
) -> Result<Json<TrafficAck>, ApiError> {
    if report.gateway.is_empty() || report.gateway.chars().count() > 128 {
        return Err(ApiError::invalid(
            "gateway: a name of 1 to 128 characters, the same in every report",
        ));
    }
    if report.services.len() > MAX_SERVICES {
        return Err(unprocessable(format!(
            "services: at most {MAX_SERVICES} a report"
        )));
    }
    // Only services this server has: a report's other names are dropped,
    // so what is kept is bounded by the services.
    let mut report = report;
    {
        let services = shared.services.lock();
        report
            .services
            .retain(|name, _| services.entries.contains_key(name));
    }
    let known = report.services.len() as u32;
    let mut traffic = match shared.services.traffic.lock() {
        Ok(traffic) => traffic,
        Err(poisoned) => poisoned.into_inner(),
    };
    traffic.take(now(), report);
    Ok(Json(TrafficAck { known }))
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EndpointsQuery {
    /// Answer once the table's version is past this one (at most 10 s
    /// later; then the same table).
    #[param(maximum = 9_223_372_036_854_775_807_u64)]
    after: Option<u64>,
    /// The `instance` of the answer `after` came from: another instance's
    /// versions mean nothing here, so the answer is at once.
    #[param(maximum = 9_223_372_036_854_775_807_u64)]
    instance: Option<u64>,
}

/// Every service's ready replicas, with a version; `after=VERSION` waits
/// for the next change (what `muster gateway` follows).
#[utoipa::path(
    get, path = "/v1/endpoints", tag = "services",
    params(EndpointsQuery),
    responses((status = 200, body = EndpointTable)),
    security(("bearer" = []))
)]
pub async fn endpoint_table(
    State(shared): Shared_,
    Params(query): Params<EndpointsQuery>,
) -> Result<Json<EndpointTable>, ApiError> {
    const MAX: u64 = i64::MAX as u64;
    if query.after.is_some_and(|after| after > MAX)
        || query.instance.is_some_and(|instance| instance > MAX)
    {
        return Err(ApiError::invalid(format!(
            "after and instance are at most {MAX} (from an earlier answer)"
        )));
    }
    let same_instance = query
        .instance
        .is_none_or(|instance| instance == shared.services.lock().instance);
    if let Some(after) = query.after.filter(|_| same_instance) {
        let mut changed = shared.services.changed.subscribe();
        let mut shutdown = shared.shutdown.clone();
        let wait = async {
            loop {
                if *changed.borrow_and_update() > after {
                    return;
                }
                tokio::select! {
                    result = changed.changed() => if result.is_err() { return },
                    _ = shutdown.changed() => return,
                }
            }
        };
        let _ = tokio::time::timeout(ENDPOINTS_WAIT, wait).await;
    }
    let services = shared.services.lock();
    Ok(Json(EndpointTable {
        instance: services.instance,
        version: services.version,
        services: services.table.clone(),
        auth: services.auth.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_are_bounded_and_the_current_one_is_kept() {
        let mut record = ServiceRecord {
            name: "web".into(),
            user: "admin".into(),
            created_ms: 0,
            revisions: (1..=15)
                .map(|revision| RevisionRecord {
                    revision,
                    created_ms: 0,
                    spec: serde_json::Value::Null,
                })
                .collect(),
            current: 1,
            replicas: 1,
            deleting: false,
        };
        trim_revisions(&mut record);
        assert_eq!(record.revisions.len(), muster_model::KEPT_REVISIONS);
        assert_eq!(record.revisions[0].revision, 1, "the current one stays");
        assert_eq!(record.revisions[1].revision, 7);
    }
}
