//! The `/v1` HTTP API's wire types, shared by the server, the agents and the
//! CLI. Times are milliseconds since the Unix epoch; GPU shares are
//! thousandths of a GPU.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The small set of error codes every API error maps to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    InvalidArgument,
    NotFound,
    Conflict,
    Unauthenticated,
    PermissionDenied,
    /// Too many requests with one token (429, with `Retry-After`).
    ResourceExhausted,
    Unavailable,
    Internal,
}

impl ErrorCode {
    pub fn http_status(self) -> u16 {
        match self {
            ErrorCode::InvalidArgument => 400,
            ErrorCode::Unauthenticated => 401,
            ErrorCode::PermissionDenied => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::Conflict => 409,
            ErrorCode::ResourceExhausted => 429,
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }
}

/// The start of the message a deposed leader answers a change with (503,
/// code `unavailable`, header [`NO_LONGER_LEADS_HEADER`]): another server
/// leads, or is about to. The store took nothing of the request unless the
/// message also holds [`STORE_COMMIT_FAILED`].
pub const NO_LONGER_LEADS: &str = "this server no longer leads";

/// In a leader's refusal: its commit failed, so what was asked may or may
/// not have been saved (a retry with the same idempotency key tells).
pub const STORE_COMMIT_FAILED: &str = "a commit to its store failed";

/// The header a deposed leader's refusal carries: a client given several
/// servers sends the request to the next at once, without reading the body.
pub const NO_LONGER_LEADS_HEADER: &str = "muster-no-longer-leads";

/// The body of every error response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub code: ErrorCode,
    /// What went wrong and what to do about it.
    pub message: String,
}

/// `POST /v1/jobs`: a job spec (the YAML spec's fields, as JSON).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
#[cfg_attr(
    feature = "openapi",
    schema(example = json!({
        "spec": {"name": "train", "gpus": 1, "command": ["python", "train.py"]},
        "allow_pending": true
    }))
)]
pub struct SubmitRequest {
    /// The job spec (the same fields as the YAML one; docs/job-spec.md).
    #[cfg_attr(feature = "openapi", schema(value_type = crate::wire::JobSpec))]
    pub spec: serde_json::Value,
    /// Queue it even if no registered node could ever hold it (for nodes
    /// still to come); without it such a job is refused.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_pending: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SubmitResponse {
    pub id: u64,
    /// For an array: how many elements it has (its jobs are `id` to
    /// `id + elements - 1`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elements: Option<u32>,
    /// Accepted, but worth knowing (the queue is over its monthly budget).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// A pending job's forecast start: the scheduler's own plan (queue order,
/// quotas, reservations, backfill) run ahead as running jobs end, on runtime
/// estimates (the spec's `estimated_runtime`, else how long its queue's
/// finished jobs typically ran, at most `max_runtime`). It does not know of
/// jobs yet to be submitted, of preemptions, or of nodes joining or failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StartEstimate {
    /// `at`: the plan starts it at `at_ms`; `not_before`: the plan ended
    /// (it looks 64 steps or 30 days ahead, over the first 1,000 jobs in
    /// line) before it started, so not before `at_ms`; `unknown`: it waits
    /// on running jobs with no estimate, or no node could ever hold it.
    pub kind: StartEstimateKind,
    /// Milliseconds since the Unix epoch (absent for `unknown`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at_ms: Option<u64>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum StartEstimateKind {
    At,
    NotBefore,
    Unknown,
}

/// Where a job sits in its array.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ArrayView {
    /// The array's id (its first element's).
    pub job: u64,
    /// `MUSTER_ARRAY_INDEX`.
    pub index: u32,
    /// Elements in the array.
    pub count: u32,
    /// At most this many run at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
}

/// One task of a job as placed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TaskView {
    pub rank: u32,
    pub node: String,
    /// GPU indices on the node and the thousandths taken of each.
    pub gpus: Vec<(u32, u16)>,
    pub allocation: u64,
    pub generation: u64,
    pub state: String,
    pub exit_code: Option<i32>,
    /// Its GPUs' utilisation and memory from the node's telemetry, while
    /// the server holds the job in memory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<TaskUsage>,
    /// While its container image is being pulled: the pull's progress (and
    /// the task's state reads `pulling`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulling: Option<String>,
}

/// A task's GPUs as telemetry saw them (each sample: the mean over its
/// GPUs, whole GPUs as the device reports them).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TaskUsage {
    pub samples: u64,
    pub mean_utilization_pct: f64,
    pub peak_utilization_pct: u32,
    /// The most GPU memory its GPUs held at once, MiB.
    pub peak_memory_mib: u64,
    /// Since when every sample has been below 5% (`None`: the last was
    /// not).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_since_ms: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventView {
    pub at_ms: u64,
    pub what: String,
}

/// `GET /v1/jobs/{id}` and the items of `GET /v1/jobs`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobView {
    pub id: u64,
    pub name: String,
    pub user: String,
    pub queue: String,
    pub priority_class: String,
    pub state: String,
    pub nodes: u32,
    /// GPUs per node, a number: whole GPUs (8) or a share of one (0.25).
    pub gpus_per_node: f64,
    pub submitted_ms: u64,
    pub started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    pub exit_code: Option<i32>,
    /// The rank whose failure ended the job (the first to fail on its own;
    /// the others were stopped because of it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_rank: Option<u32>,
    pub attempts: u32,
    pub command: Vec<String>,
    /// Jobs it waits for, as specs write them: `12` (to succeed),
    /// `any:12` (to end), `notok:12` (to fail).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub after: Vec<String>,
    pub tasks: Vec<TaskView>,
    /// Why it waits, in words (pending jobs only).
    pub pending_reason: Option<String>,
    /// Why it waits, as a short code (pending jobs only): `dependency`,
    /// `array-limit` (its array runs as many elements as its `%N` allows),
    /// `capacity`, `quota`, `never-fits`, `too-wide` (fewer nodes could hold
    /// a task than it has tasks), `nodes-cordoned`, `nodes-lost`,
    /// `nodes-unavailable` (only cordoned or lost nodes could hold it),
    /// `rack`, `reservation`, `blocked`, `budget` (its queue's hard monthly
    /// budget is spent), `unscheduled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_code: Option<String>,
    /// Its place in line among pending jobs (1 = next).
    pub queue_position: Option<u32>,
    /// When it is expected to start (pending jobs only): the scheduler's
    /// plan run ahead, refreshed every cycle.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub estimated_start: Option<StartEstimate>,
    /// The array it is an element of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<ArrayView>,
    /// For a running job whose GPUs have all been below 5% utilisation for
    /// at least the server's idle threshold (30 minutes by default): for
    /// how long, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_for_s: Option<u64>,
    /// Worth knowing (its queue is over its monthly budget).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    pub history: Vec<EventView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobList {
    pub jobs: Vec<JobView>,
    /// Pass as `cursor` for the next page (older jobs); absent on the last
    /// page.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

/// A GPU as an agent registers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GpuView {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub nvlink_domain: u32,
}

/// `GET /v1/fleet`: each pool's software stack and the nodes that differ
/// from it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FleetView {
    pub pools: Vec<PoolStackView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolStackView {
    pub pool: String,
    pub nodes: u64,
    /// Per component (`driver`, `cuda`, `vbios`, `kernel`, ...), the most
    /// common version (ties: the highest).
    pub majority: BTreeMap<String, String>,
    /// Per component, how many nodes report each version (`(none)`: not
    /// reported).
    pub versions: BTreeMap<String, BTreeMap<String, u64>>,
    pub drift: Vec<DriftView>,
}

/// A node whose component differs from its pool's majority.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DriftView {
    pub node: String,
    pub component: String,
    pub version: String,
    pub expected: String,
}

/// The answer to `DELETE /v1/nodes/{name}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeRemoved {
    pub name: String,
    /// Jobs whose work on the node was stopped to be placed again.
    pub requeued_jobs: Vec<u64>,
}

/// `POST /v1/agents/register`: with the join token for a new node name,
/// with the node's own credential (the `node_token` an earlier
/// registration returned) for a node the cluster knows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterRequest {
    pub name: String,
    /// Address other nodes reach this one at (a gang's master address).
    pub address: String,
    pub gpus: Vec<GpuView>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub pool: Option<String>,
    pub rack: Option<String>,
    pub backend: String,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// The rest of the node's software stack, component to version
    /// (`vbios`, `kernel`, `nccl`, `container_runtime`, ...; at most 16,
    /// names of lowercase letters, digits and `_`, versions up to 128
    /// printable characters).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stack: BTreeMap<String, String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterResponse {
    /// The node's credential for heartbeats and later registrations (a
    /// bearer token): the agent keeps it in its state directory.
    pub node_token: String,
    /// The epoch this registration opened (issued by the server, never
    /// reused): heartbeats carry it.
    pub epoch: u64,
    pub lease_ms: u64,
    pub heartbeat_ms: u64,
}

/// What an agent knows of one allocation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ObservedAllocation {
    pub allocation: u64,
    pub generation: u64,
    /// `None` while running; the exit code (or `None` inside for a signal)
    /// once it ended. On the wire: absent while running, `null` for a
    /// signal, the code otherwise (plain serde would write `null` for both
    /// `None` and `Some(None)`, losing a death by signal).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "exit_on_the_wire"
    )]
    #[cfg_attr(feature = "openapi", schema(value_type = Option<i32>))]
    pub exited: Option<Option<i32>>,
    /// The node failed, not the task: the agent stopped it because it
    /// could not renew its lease, or it is gone with no record of how it
    /// ended (its host restarted). Its job is re-queued as a lost node's.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
    /// It ended because it reached its memory limit.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub memory_limit: bool,
}

/// `Option<Option<i32>>` as absent / `null` / a number.
mod exit_on_the_wire {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub fn serialize<S: Serializer>(
        value: &Option<Option<i32>>,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        match value {
            Some(code) => code.serialize(serializer),
            None => serializer.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Option<Option<i32>>, D::Error> {
        Option::<i32>::deserialize(deserializer).map(Some)
    }
}

/// `POST /v1/agents/{node}/heartbeat`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatRequest {
    pub epoch: u64,
    pub observed: Vec<ObservedAllocation>,
    /// Wait up to this long for the desired set to change past
    /// `known_version` before answering (long poll); 0 answers at once.
    pub wait_ms: u64,
    pub known_version: u64,
    /// GPU indices the agent's health checks found out of service.
    #[serde(default)]
    pub unhealthy_gpus: Vec<u32>,
    /// Strictly increasing within the agent's epoch. The server applies
    /// nothing from a heartbeat that is not newer than the last one it
    /// applied for the epoch (a duplicate, or one overtaken by a later one),
    /// and still answers it. 0 (absent): not numbered, always applied.
    #[serde(default)]
    pub sequence: u64,
    /// Tasks whose container image is being pulled, with the pull's
    /// progress (at most 64; shown in `describe` and `muster run`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pulling: Vec<PullStatus>,
}

/// A task whose container image is being pulled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PullStatus {
    pub allocation: u64,
    /// The engine's latest progress line, e.g. `pulling nvcr.io/nvidia/
    /// pytorch:24.05-py3: Downloading (12 of 31 layers done)`.
    #[cfg_attr(feature = "openapi", schema(max_length = 512))]
    pub status: String,
}

/// `POST /v1/agents/{node}/telemetry`: what a node's GPUs and the node
/// itself are doing, sampled every few seconds (apart from heartbeats).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TelemetryReport {
    /// The agent's epoch: a report of an earlier registration is refused.
    pub epoch: u64,
    /// When it was sampled, by the agent's clock.
    pub sampled_ms: u64,
    /// One per GPU (at most 64).
    pub gpus: Vec<GpuSample>,
    pub node: NodeSample,
}

/// One GPU, as NVML (or the simulated backend) reports it; `None` where the
/// device does not.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GpuSample {
    pub index: u32,
    /// Percent of the sample period a kernel ran, 0 to 100.
    pub utilization_pct: u32,
    pub memory_used_mib: u64,
    pub memory_total_mib: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub power_watts: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature_c: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sm_clock_mhz: Option<u32>,
    /// Uncorrected (double-bit) ECC errors since the driver loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ecc_uncorrected: Option<u64>,
    /// The latest XID the driver reported for this GPU since the agent
    /// started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<u64>,
    /// PCIe bytes sent and received since the driver loaded (counters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_tx_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pcie_rx_bytes: Option<u64>,
    pub healthy: bool,
}

/// The node's own counters, from the kernel.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeSample {
    /// Percent of all CPUs busy since the previous sample.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_busy_pct: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_used_mib: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_total_mib: Option<u64>,
    /// Bytes received and sent per interface since boot (at most 64
    /// interfaces; loopback left out).
    #[serde(default)]
    pub network: Vec<InterfaceSample>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct InterfaceSample {
    pub interface: String,
    pub receive_bytes: u64,
    pub transmit_bytes: u64,
}

/// A task the node must run, or stop when `stop` is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DesiredAllocation {
    pub allocation: u64,
    pub generation: u64,
    pub job: u64,
    pub rank: u32,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub working_dir: Option<String>,
    pub gpus: Vec<u32>,
    pub stop_signal: String,
    pub grace_period_ms: u64,
    pub stop: bool,
    /// The job's user: the task runs as this user where it exists on the
    /// node (else as the agent's task user).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// The number of the job's user's group, the same on every node and
    /// never another user's: a task of a user without an account on the
    /// node runs in group FIRST+N of the agent's task uid range, so every
    /// run of the user's jobs (another attempt, another node) reads and
    /// writes the files the earlier ones left (umask 007), and no other
    /// tenant's task does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_group: Option<u32>,
    /// The task's memory limit, in MiB (the job's memory per node).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mib: Option<u64>,
    /// The container image to run the task in (through the node's Docker
    /// engine); absent: on the node itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// The job's CPUs per node, in thousandths: a container's CPU limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_milli: Option<u64>,
    /// The credentials to pull `image` with (the value of the job's
    /// `image_pull_secret`), for the node's engine only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registry_auth: Option<String>,
    /// Host paths the container sees (allowed by the node's pool).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub mounts: Vec<crate::wire::MountSpec>,
    /// Checks of a service's replica (commands, TCP connections, HTTP
    /// requests) the agent runs beside it and reports
    /// (`POST /v1/agents/{node}/checks`): the server never connects to a
    /// port a user chose.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub checks: Vec<CheckSpec>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CheckSpec {
    /// A liveness check (else readiness).
    pub liveness: bool,
    /// A command check's command; empty for a network check.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub command: Vec<String>,
    /// A TCP or HTTP check: sent only to the replica's own port, and only
    /// while a process of its task listens there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network: Option<NetworkCheck>,
    pub period_ms: u64,
    pub timeout_ms: u64,
    /// Before the first run, from the task's start.
    #[serde(default)]
    pub initial_delay_ms: u64,
}

/// A replica's TCP or HTTP check, as its agent runs it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NetworkCheck {
    /// The replica's port (its `PORT`, or the service's fixed port).
    pub port: u16,
    /// `GET PATH` must answer 2xx or 3xx; absent: a TCP connection must
    /// open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http_path: Option<String>,
}

/// `POST /v1/agents/{node}/checks`: results of command checks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckReport {
    #[cfg_attr(feature = "openapi", schema(max_items = 10000))]
    pub results: Vec<CheckResult>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckResult {
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "whole_u64")]
    pub allocation: u64,
    pub liveness: bool,
    /// The run's number (1, 2, ...) for this allocation and kind.
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    #[serde(deserialize_with = "whole_u64")]
    pub run: u64,
    pub ok: bool,
    /// Why it failed (exit status, the end of its output, a timeout).
    #[cfg_attr(feature = "openapi", schema(max_length = 1024))]
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatResponse {
    pub version: u64,
    pub lease_ms: u64,
    pub desired: Vec<DesiredAllocation>,
    /// Connections a user asked for into a dev environment on this node:
    /// the agent opens each to the server
    /// (`POST /v1/agents/{node}/tunnels/{id}`, upgraded) and joins it to
    /// `127.0.0.1:port` (so nodes need no inbound ports).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tunnels: Vec<TunnelOpen>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TunnelOpen {
    pub id: u64,
    pub port: u16,
    /// The environment runs in a container: the agent reads the session's
    /// first line itself (a shell is an `exec` into the container of this
    /// task; a forward, a connection to the port) instead of passing it to
    /// a session helper.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<TunnelTask>,
}

/// The task a tunnel reaches (`j<job>-a<allocation>-g<generation>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TunnelTask {
    pub job: u64,
    pub allocation: u64,
    pub generation: u64,
}

/// `POST /v1/agents/{node}/logs`: output of one allocation, at a byte
/// offset of the task's output.
///
/// The bytes are exactly what the task wrote (no character conversion); on
/// the wire they are base64 (standard alphabet, padded) in `data_base64`.
/// A chunk that overlaps what the server has is written from the server's
/// end on (a retry is harmless); one that starts past the end is refused
/// with a conflict naming the byte to resume from, unless `omit_gap` is set.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogChunk {
    pub allocation: u64,
    /// Byte offset of `data` in the task's output.
    pub offset: u64,
    /// The bytes (at most [`MAX_LOG_CHUNK_BYTES`]).
    #[serde(rename = "data_base64", with = "bytes_as_base64")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = Byte))]
    pub data: Vec<u8>,
    /// The bytes between the server's end and `offset` are left out on
    /// purpose. Only accepted once the server has the log's head (see
    /// [`LogAck::head_bytes`]): it then drops its kept tail, which is older
    /// than `offset`, and starts the tail at `offset`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub omit_gap: bool,
    /// The task has exited and `offset + data.len()` is the whole output:
    /// followers can stop once they have read it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub eof: bool,
}

/// The most bytes one [`LogChunk`] carries (its base64 must fit in a
/// request body).
pub const MAX_LOG_CHUNK_BYTES: usize = 512 * 1024;

/// The answer to `POST /v1/agents/{node}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogAck {
    /// The end of what the server has of the log: where the next chunk
    /// starts. An empty chunk at offset 0 asks for it.
    pub next_offset: u64,
    /// The server keeps the first `head_bytes` bytes of the log...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_bytes: Option<u64>,
    /// ...and, past them, only the latest `tail_bytes` (at least half of
    /// that). So a sender that has sent the head and is more than
    /// `tail_bytes` behind may skip ahead (`omit_gap`) to its output's
    /// length minus `tail_bytes`, and never needs the bytes it skips.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_bytes: Option<u64>,
}

/// `GET /v1/jobs/{id}/logs?rank=R&offset=N&limit=L&follow=true`: a task's
/// output from byte `offset` of what it wrote.
///
/// Where the server left bytes out (the log passed its size limit), `data`
/// holds a marker line instead, `\n[muster: N bytes omitted]\n`, and
/// `next_offset` jumps past them: offsets always count the task's own bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogsResponse {
    /// The bytes, exactly as written; base64 on the wire (`data_base64`).
    #[serde(rename = "data_base64", with = "bytes_as_base64")]
    #[cfg_attr(feature = "openapi", schema(value_type = String, format = Byte))]
    pub data: Vec<u8>,
    /// Where to read next.
    pub next_offset: u64,
    /// More bytes are stored past `next_offset` now: read again at once.
    #[serde(default)]
    pub more: bool,
    /// True once the job has ended and every byte was returned.
    pub complete: bool,
    /// The task (allocation) whose output this is: the rank's latest. Pass
    /// it back (`allocation=`) when following: if the job runs again (a
    /// retry, a lost node), the answer is empty, with this set to the new
    /// task and `next_offset` 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocation: Option<u64>,
    /// How many bytes of output the server knows the task wrote (an offset
    /// a little below it reads the latest output).
    #[serde(default)]
    pub end: u64,
}

/// Bytes as a base64 string (standard alphabet, padded).
mod bytes_as_base64 {
    use base64::Engine;
    use base64::engine::general_purpose::STANDARD;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&STANDARD.encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(deserializer)?;
        STANDARD.decode(text.as_bytes()).map_err(|error| {
            serde::de::Error::custom(format!(
                "data_base64 is not valid base64 (standard alphabet, padded): {error}"
            ))
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeView {
    pub name: String,
    /// `ready`, `lost`, or `pending-approval` (joined under the server's
    /// `--approve-nodes`, given no work until `muster nodes approve`).
    pub state: String,
    pub cordoned: bool,
    pub draining: bool,
    pub pool: String,
    pub rack: String,
    pub address: String,
    pub gpus: Vec<GpuView>,
    /// Free thousandths per GPU.
    pub gpu_free: Vec<u32>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub backend: String,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
    /// The rest of its software stack (see `RegisterRequest::stack`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stack: BTreeMap<String, String>,
    /// Under the server's `--stack-policy majority`: how its stack differs
    /// from its pool's; it takes no new work until it matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift: Option<String>,
    pub last_heartbeat_ms: u64,
    /// Milliseconds between the latest heartbeats the server received from
    /// this node (up to 32, oldest first; kept in memory only).
    #[serde(default)]
    pub recent_heartbeat_gaps_ms: Vec<u64>,
    pub allocations: Vec<u64>,
    /// GPU indices out of service.
    #[serde(default)]
    pub unhealthy_gpus: Vec<u32>,
    /// What the node's latest telemetry says of GPUs with an XID or
    /// uncorrected ECC errors (`GPU 1: XID 79, the GPU has fallen off the
    /// bus`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_events: Vec<String>,
    /// Each GPU's utilisation in the node's latest telemetry, by index
    /// (empty: no telemetry in the last minute).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_utilization_pct: Vec<u32>,
    /// Why the scheduler leaves the node out, if it does (a spec it
    /// cannot take).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub excluded: Option<String>,
}

/// A pool: the nodes whose agents joined with that `--pool`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolView {
    pub name: String,
    pub nodes: u32,
    /// Nodes that take new work (ready and not cordoned).
    pub schedulable_nodes: u32,
    pub gpus: u32,
    /// Free GPU capacity in thousandths, over the schedulable nodes.
    pub gpu_free_milli: u64,
    /// The GPU models in the pool.
    pub models: Vec<String>,
    /// Its stack policy: `report`, `majority` or `required` (its own, or
    /// the server's `--stack-policy`).
    #[serde(default)]
    pub stack_policy: String,
    /// Under `required`: component → the version every node must report.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub required: BTreeMap<String, String>,
    /// Host paths container jobs in the pool may mount.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_mounts: Vec<String>,
    /// An inference pool (services first; other work borrows it).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inference: bool,
    /// GPU capacity (thousandths) held by services' replicas.
    #[serde(default)]
    pub service_gpu_milli: u64,
    /// GPU capacity (thousandths) held by other work on an inference pool:
    /// borrowed, given back the moment a service needs it.
    #[serde(default)]
    pub borrowed_gpu_milli: u64,
}

/// `PUT /v1/pools/{name}/policy` (admin): the pool's own stack policy.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolPolicyUpdate {
    /// `report`, `majority` or `required`.
    pub stack_policy: String,
    /// Under `required`: component (`driver`, `cuda`, `vbios`, `kernel`,
    /// `nccl`, `container_runtime`) → version.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub required: BTreeMap<String, String>,
    /// Host paths (absolute) container jobs in the pool may mount, each with
    /// everything under it; at most 64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_mounts: Vec<String>,
    /// An inference pool: its nodes run services' replicas, and other work
    /// only if it may be preempted (borrowing), which any replica preempts.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inference: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PoolList {
    pub pools: Vec<PoolView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeList {
    pub nodes: Vec<NodeView>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueView {
    pub name: String,
    pub guaranteed_gpus: f64,
    /// `None`: unlimited.
    pub borrow_limit_gpus: Option<f64>,
    pub weight: u32,
    /// Seconds: its jobs are stopped once their GPUs are idle this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    /// Seconds below `idle_below_pct` after which its jobs count as idle
    /// (`None`: the server's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_after_s: Option<u64>,
    /// Below this utilisation its jobs' GPUs count as idle (`None`: 5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_below_pct: Option<u32>,
    pub in_use_gpus: f64,
    /// Of them, GPUs its jobs borrow on inference pools (given back the
    /// moment a service needs them).
    #[serde(default)]
    pub borrowed_gpus: f64,
    pub pending_jobs: u32,
    pub running_jobs: u32,
    /// Monthly GPU budget (the price list's currency; `None`: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<f64>,
    /// Past the budget, new jobs wait (`budget exhausted`) instead of a
    /// warning only.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub budget_hard: bool,
    /// Spent this calendar month (UTC), at the current prices.
    #[serde(default)]
    pub spent_this_month: f64,
    /// Its members may read each other's jobs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members_see_jobs: bool,
    /// The most jobs it may have pending (`None`: no limit of its own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending: Option<u64>,
    /// The highest priority class its users may submit (operators and
    /// admins are not limited).
    #[serde(default)]
    pub max_priority_class: String,
    /// Its users may submit non-preemptible jobs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_non_preemptible: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueList {
    pub queues: Vec<QueueView>,
}

/// A whole number as JSON Schema counts one: `96` or `96.0`.
fn whole_u32<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let number = serde_json::Number::deserialize(deserializer)?;
    number
        .as_u64()
        .or_else(|| {
            number
                .as_f64()
                .filter(|value| {
                    value.fract() == 0.0 && *value >= 0.0 && *value <= f64::from(u32::MAX)
                })
                .map(|value| value as u64)
        })
        .and_then(|value| u32::try_from(value).ok())
        .ok_or_else(|| {
            serde::de::Error::custom(format!(
                "expected a whole number from 0 to {}, got {number}",
                u32::MAX
            ))
        })
}

fn whole_u32_or_null<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u32>, D::Error> {
    match Option::<serde_json::Number>::deserialize(deserializer)? {
        None => Ok(None),
        Some(number) => whole_u32(serde_json::Value::Number(number))
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

/// `PUT /v1/queues/{name}` (admin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueUpdate {
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1_000_000))]
    pub guaranteed_gpus: f64,
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1_000_000))]
    pub borrow_limit_gpus: Option<f64>,
    /// Fair-share weight.
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 10_000))]
    #[serde(deserialize_with = "whole_u32")]
    pub weight: u32,
    /// Stop the queue's jobs once their GPUs have been idle this long
    /// (e.g. `"30m"`; absent, empty or zero: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^([0-9]{1,12}|([0-9]{1,12}d)?([0-9]{1,12}h)?([0-9]{1,12}m)?([0-9]{1,12}s)?)$"
        )
    )]
    pub idle_timeout: Option<String>,
    /// Its jobs count as idle once their GPUs stay below `idle_below_pct`
    /// this long (e.g. `"10m"`; absent or empty: the server's
    /// `--idle-after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(
            pattern = "^([0-9]{1,12}|([0-9]{1,12}d)?([0-9]{1,12}h)?([0-9]{1,12}m)?([0-9]{1,12}s)?)$"
        )
    )]
    pub idle_after: Option<String>,
    /// Below this utilisation (percent, 1 to 100) a GPU counts as idle
    /// (absent: 5).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_u32_or_null"
    )]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 100))]
    pub idle_below_pct: Option<u32>,
    /// Monthly GPU budget in the price list's currency (absent: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(minimum = 0, maximum = 1_000_000_000_000_u64)
    )]
    pub budget: Option<f64>,
    /// Past the budget, the queue's new jobs wait.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub budget_hard: bool,
    /// Its members may read (not cancel) each other's jobs.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members_see_jobs: bool,
    /// The most jobs (array elements one each) it may have pending; a
    /// submission past it is refused (absent: no limit of its own).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_u64_or_null"
    )]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 100_000_000))]
    pub max_pending: Option<u64>,
    /// The highest priority class its users may submit: `low`, `normal`,
    /// `high` or `critical` (absent: `normal`). Operators and admins are not
    /// limited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(pattern = "^(low|normal|high|critical)$"))]
    pub max_priority_class: Option<String>,
    /// Its users may submit non-preemptible jobs (`preemptible: false`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_non_preemptible: bool,
}

/// One rank's use of its GPUs over a job's life (`GET /v1/jobs/{id}/usage`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RankUsage {
    pub rank: u32,
    /// Telemetry samples seen.
    pub samples: u64,
    /// `None`: no telemetry came for it.
    pub mean_utilization_pct: Option<f64>,
    pub peak_utilization_pct: u32,
    pub peak_memory_mib: u64,
    pub allocated_gpu_hours: f64,
    pub used_gpu_hours: f64,
    pub idle_gpu_hours: f64,
}

/// One rank's minute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UsagePoint {
    /// Start of the minute (ms since the epoch).
    pub minute_ms: u64,
    pub rank: u32,
    pub mean_utilization_pct: Option<f64>,
    pub peak_memory_mib: u64,
}

/// `GET /v1/jobs/{id}/usage`: a job's GPU use at one-minute resolution
/// (kept for the server's `--usage-retention`), every attempt's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobUsage {
    pub job: u64,
    pub ranks: Vec<RankUsage>,
    /// Oldest first; at most the latest 10,000.
    pub minutes: Vec<UsagePoint>,
}

/// One group of a cost report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CostLineView {
    /// The queue, user, job id or pool.
    pub key: String,
    pub allocated_gpu_hours: f64,
    /// Utilisation-weighted GPU-hours.
    pub used_gpu_hours: f64,
    /// Allocated while its GPUs were idle (below 5%).
    pub idle_gpu_hours: f64,
    /// Allocated without telemetry.
    pub unmeasured_gpu_hours: f64,
    pub cost: f64,
    /// The price of the idle GPU-hours.
    pub waste: f64,
    /// GPU-hours of models without a price (not in `cost`).
    pub unpriced_gpu_hours: f64,
}

/// `GET /v1/cost?since=30d&by=queue`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CostReport {
    pub since_ms: u64,
    pub until_ms: u64,
    /// `queue`, `user`, `job` or `pool`.
    pub by: String,
    /// The costliest first.
    pub lines: Vec<CostLineView>,
    /// GPU models used in the period that have no price.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unpriced_models: Vec<String>,
}

/// `GET /v1/prices`: per GPU model, per GPU-hour.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PriceList {
    pub prices: std::collections::BTreeMap<String, f64>,
}

/// One GPU in a node's history point.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GpuPoint {
    pub index: u32,
    pub utilization_pct: u32,
    pub memory_used_mib: u64,
}

/// A node's telemetry at one moment.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeHistoryPoint {
    pub at_ms: u64,
    pub gpus: Vec<GpuPoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_busy_pct: Option<f64>,
}

/// `GET /v1/nodes/{name}/telemetry`: the last hour, a point at most every
/// 30 seconds, oldest first (memory only).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeHistory {
    pub node: String,
    pub points: Vec<NodeHistoryPoint>,
}

/// `POST /v1/join-tokens` (admin): a token new nodes join with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JoinTokenCreate {
    /// How long it admits nodes, in milliseconds (absent: until revoked).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_u64_or_null"
    )]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 31_622_400_000_u64))]
    pub ttl_ms: Option<u64>,
    /// How many nodes may join with it (absent: any number).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_u64_or_null"
    )]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 1_000_000))]
    pub uses: Option<u64>,
    /// The pool its nodes join (absent: as each agent says).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub pool: Option<String>,
}

/// A join token as listed (never the token itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JoinTokenView {
    pub id: String,
    pub created_ms: u64,
    pub expires_ms: Option<u64>,
    pub max_uses: Option<u64>,
    pub uses: u64,
    pub pool: Option<String>,
    pub revoked: bool,
    /// The first start's token (`join.token` in the data directory).
    pub initial: bool,
    /// `valid`, `expired`, `used up` or `revoked`.
    pub state: String,
}

/// A join token just made: the token, shown this once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JoinTokenCreated {
    pub join_token: JoinTokenView,
    pub token: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JoinTokenList {
    pub join_tokens: Vec<JoinTokenView>,
}

/// `POST /v1/users` (admin): a user and its role.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UserCreate {
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    )]
    pub name: String,
    /// `user`, `operator` or `admin`.
    #[cfg_attr(feature = "openapi", schema(pattern = "^(user|operator|admin)$"))]
    pub role: String,
    /// The queues a `user` may submit to (default: `default`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(max_items = 256, inline, value_type = Vec<QueueNameSchema>))]
    pub queues: Vec<String>,
}

/// A queue's name, as the schema constrains it.
#[cfg(feature = "openapi")]
#[derive(utoipa::ToSchema)]
#[schema(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")]
#[allow(dead_code)]
pub struct QueueNameSchema(String);

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UserView {
    pub name: String,
    pub role: String,
    /// The queues it may submit to (empty for operators and admins: all).
    pub queues: Vec<String>,
    pub created_ms: u64,
    /// The most jobs it may have pending, its own (`None`: the server's
    /// default for users, none for operators and admins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending: Option<u64>,
    /// The number of its group on the nodes: where it has no account, its
    /// tasks run in gid FIRST+N of the agent's task uid range (200000+N by
    /// default), the same on every node and never another user's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub task_group: Option<u32>,
}

/// `POST /v1/users/{name}/limits` (admin): a user's own limits, whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UserLimits {
    /// The most jobs (array elements one each) it may have pending
    /// (absent: the server's `--max-pending-per-user` for a user, none for
    /// operators and admins).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_u64_or_null"
    )]
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 100_000_000))]
    pub max_pending: Option<u64>,
}

/// A user made or its token rotated: the token, shown this once.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UserToken {
    pub user: UserView,
    pub token: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct UserList {
    pub users: Vec<UserView>,
}

/// `GET /v1/whoami`: the token's user.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WhoAmI {
    pub name: String,
    pub role: String,
    /// `None`: every queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queues: Option<Vec<String>>,
}

/// One mutating request in the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditView {
    pub at_ms: u64,
    /// The token's user (`admin`, a user, `node:NAME`, `join`), `admin (as
    /// bob)` when the admin submitted for bob, or `(no token)` / `(unknown
    /// token)`.
    pub who: String,
    /// Method and route: `POST /v1/jobs/{id}/cancel`.
    pub action: String,
    /// The path asked for.
    pub object: String,
    /// The client's address.
    pub origin: String,
    pub status: u16,
    /// Authorization let it through (not 401 or 403).
    pub allowed: bool,
}

/// `GET /v1/audit` (admin), newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AuditList {
    pub entries: Vec<AuditView>,
}

/// `report` or `majority` with no versions, or `required` with 1 to 16.
#[cfg(feature = "openapi")]
impl utoipa::PartialSchema for PoolPolicyUpdate {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
        let text = || {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(r"^[!-+\--~][ -+\--~]{0,127}$"))
        };
        let mounts = || {
            utoipa::openapi::schema::ArrayBuilder::new()
                .items(
                    ObjectBuilder::new()
                        .schema_type(Type::String)
                        .pattern(Some(r"^/[^\u0000:,]{0,4095}$")),
                )
                .max_items(Some(64))
        };
        let policy = |names: &[&str]| {
            ObjectBuilder::new()
                .schema_type(Type::String)
                .enum_values(Some(names.iter().map(|n| n.to_string())))
        };
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Object)
                    .property("stack_policy", policy(&["report", "majority"]))
                    .required("stack_policy")
                    .property("allowed_mounts", mounts())
                    .property("inference", ObjectBuilder::new().schema_type(Type::Boolean))
                    .property(
                        "required",
                        ObjectBuilder::new()
                            .schema_type(Type::Object)
                            .max_properties(Some(0)),
                    ),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::Object)
                    .property("stack_policy", policy(&["required"]))
                    .required("stack_policy")
                    .property("allowed_mounts", mounts())
                    .property("inference", ObjectBuilder::new().schema_type(Type::Boolean))
                    .property(
                        "required",
                        ObjectBuilder::new()
                            .schema_type(Type::Object)
                            .min_properties(Some(1))
                            .max_properties(Some(16))
                            .property_names(Some(text()))
                            .additional_properties(Some(text())),
                    )
                    .required("required"),
            )
            .into()
    }
}

#[cfg(feature = "openapi")]
impl utoipa::ToSchema for PoolPolicyUpdate {}

/// `PUT /v1/secrets/{name}` (admin).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretSet {
    /// The value (at most 64 KiB, no NUL); never answered back.
    #[cfg_attr(
        feature = "openapi",
        schema(max_length = 65_536, pattern = "^[^\\u0000]*$")
    )]
    pub value: String,
    /// The queue whose jobs may use it (absent or empty: every queue's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^([A-Za-z0-9][A-Za-z0-9._-]{0,62})?$")
    )]
    pub queue: Option<String>,
}

/// A secret's name and scope, never its value.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretView {
    pub name: String,
    /// `None`: for every queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue: Option<String>,
    pub updated_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SecretList {
    pub secrets: Vec<SecretView>,
}

/// `PUT /v1/prices/{model}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PriceUpdate {
    #[cfg_attr(feature = "openapi", schema(minimum = 0, maximum = 1_000_000))]
    pub per_gpu_hour: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exit_by_signal_is_not_read_as_running() {
        for exited in [None, Some(None), Some(Some(0)), Some(Some(3))] {
            let observed = ObservedAllocation {
                allocation: 1,
                generation: 2,
                exited,
                fenced: false,
                memory_limit: false,
            };
            let text = serde_json::to_string(&observed).unwrap();
            let back: ObservedAllocation = serde_json::from_str(&text).unwrap();
            assert_eq!(back, observed, "{text}");
        }
    }

    #[test]
    fn log_bytes_travel_exactly() {
        let data: Vec<u8> = (0..=255u8).chain([0xe2, 0x82]).collect();
        let chunk = LogChunk {
            allocation: 3,
            offset: 65_535,
            data: data.clone(),
            omit_gap: false,
            eof: true,
        };
        let text = serde_json::to_string(&chunk).unwrap();
        assert!(text.contains("\"data_base64\":\""), "{text}");
        assert!(!text.contains("omit_gap"), "{text}");
        let back: LogChunk = serde_json::from_str(&text).unwrap();
        assert_eq!(back, chunk);
        let error = serde_json::from_str::<LogsResponse>(
            r#"{"data_base64":"not base64!","next_offset":0,"complete":false}"#,
        )
        .unwrap_err();
        assert!(error.to_string().contains("not valid base64"), "{error}");
    }
}

/// `POST /v1/services` and `PUT /v1/services/{name}`: a service spec
/// (`kind: service`; docs/services.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ServiceRequest {
    /// The service spec: a job spec's fields plus `kind: service`,
    /// `replicas`, `port`, `readiness`, `liveness`, `update`, `spread`,
    /// `restart`, `drain`.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub spec: serde_json::Value,
}

/// `POST /v1/services/{name}/scale`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ScaleRequest {
    #[cfg_attr(feature = "openapi", schema(maximum = 1000))]
    #[serde(deserialize_with = "whole_u32")]
    pub replicas: u32,
}

/// `POST /v1/services/{name}/rollback`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RollbackRequest {
    /// The revision whose template to run again (default: the one before
    /// the current).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole_u32_or_null"
    )]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 4294967295_u64))]
    pub revision: Option<u32>,
}

/// One replica of a service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReplicaView {
    /// Its job (`muster describe JOB`, `muster logs JOB`).
    pub job: u64,
    pub revision: u32,
    /// `pending`, `starting` (runs, not ready), `ready`, `draining`,
    /// `stopping`, or the job's end state.
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Where it serves (`ADDRESS:PORT`), once it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// Why it is not ready (its last check's answer).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_ready: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
}

/// A kept revision of a service's template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RevisionView {
    pub revision: u32,
    pub created_ms: u64,
    /// What its replicas run: the image, else the command.
    pub runs: String,
}

/// A service, its replicas and its rollout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceView {
    pub name: String,
    pub user: String,
    pub queue: String,
    /// The revision new replicas run.
    pub revision: u32,
    /// Replicas asked for.
    pub replicas: u32,
    /// Replicas pending or running (not stopping), every revision.
    pub current: u32,
    /// Of them, in traffic.
    pub ready: u32,
    /// Of them, of the current revision.
    pub updated: u32,
    /// A rollout in progress, or why it stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<String>,
    /// Replicas start again after this (restart backoff after failures).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backoff_until_ms: Option<u64>,
    /// The last replica failure, in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_failure: Option<String>,
    /// Being deleted: its replicas drain and stop.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deleting: bool,
    /// For an autoscaled service: its bounds, what it follows, and why it
    /// asks for `replicas` now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling: Option<String>,
    pub replica_list: Vec<ReplicaView>,
    pub revisions: Vec<RevisionView>,
    /// The current revision's spec, as stored.
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub spec: serde_json::Value,
    /// What the controller did lately (newest last, at most 20).
    pub events: Vec<ServiceEvent>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceEvent {
    pub at_ms: u64,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceList {
    pub services: Vec<ServiceView>,
}

/// A ready replica, for clients and gateways that balance themselves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Endpoint {
    pub job: u64,
    pub revision: u32,
    /// `ADDRESS:PORT`.
    pub address: String,
}

/// `GET /v1/services/{name}/endpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EndpointList {
    pub service: String,
    pub endpoints: Vec<Endpoint>,
}

/// `GET /v1/endpoints`: every service's ready replicas, and a version that
/// grows whenever they change (pass it back as `after` to wait for the
/// next change).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EndpointTable {
    /// Which server process made `version` (a restarted or newly elected
    /// server counts again from 0): `after` is only waited on with the same
    /// `instance`.
    pub instance: u64,
    pub version: u64,
    pub services: BTreeMap<String, Vec<Endpoint>>,
    /// Services that need a bearer token (`auth: {bearer_secret}`): the
    /// SHA-256, in hex, of the token a caller must send (empty: the secret
    /// is gone, and no caller passes).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub auth: BTreeMap<String, String>,
}

/// `POST /v1/traffic`: what one gateway has seen of each service (an
/// operator's or admin's token): the autoscaler's input.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TrafficReport {
    /// The gateway (a name of its own, the same in every report).
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub gateway: String,
    pub services: BTreeMap<String, ServiceTraffic>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ServiceTraffic {
    /// Requests received since the gateway started (a counter).
    #[serde(deserialize_with = "whole_u64")]
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    pub requests: u64,
    /// Requests being served now.
    #[serde(deserialize_with = "whole_u64")]
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    pub in_flight: u64,
    /// Requests held for want of a ready replica.
    #[serde(deserialize_with = "whole_u64")]
    #[cfg_attr(feature = "openapi", schema(maximum = 9_007_199_254_740_991_u64))]
    pub waiting: u64,
}

/// A whole number given as an integer or as a float without a fraction
/// (JSON Schema's integers include `2.0`), up to 2^53 - 1.
fn whole_u64<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    const MAX: u64 = 9_007_199_254_740_991;
    let number = serde_json::Number::deserialize(deserializer)?;
    number
        .as_u64()
        .or_else(|| {
            number
                .as_f64()
                .filter(|value| value.fract() == 0.0 && *value >= 0.0 && *value <= MAX as f64)
                .map(|value| value as u64)
        })
        .filter(|value| *value <= MAX)
        .ok_or_else(|| {
            serde::de::Error::custom(format!(
                "expected a whole number from 0 to {MAX}, got {number}"
            ))
        })
}

/// [`whole_u64`], or absent / `null`.
fn whole_u64_or_null<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    match Option::<serde_json::Number>::deserialize(deserializer)? {
        None => Ok(None),
        Some(number) => whole_u64(serde_json::Value::Number(number))
            .map(Some)
            .map_err(serde::de::Error::custom),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TrafficAck {
    /// Services of the report the server knows.
    pub known: u32,
}

/// A dev environment (`muster dev list`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DevView {
    pub name: String,
    /// Its job (`muster describe`, `muster logs`).
    pub job: u64,
    pub user: String,
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    pub gpus: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_ms: Option<u64>,
    /// Stopped once its GPUs stay idle this long.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_limit_s: Option<u64>,
    /// How long its GPUs have been idle (below 5%), if they are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_for_s: Option<u64>,
    /// Stopped at the latest this long after its start.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_lifetime_s: Option<u64>,
    /// A warning (idle reclaim coming, or the lifetime ending).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warning: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DevList {
    pub environments: Vec<DevView>,
}
