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
            ErrorCode::Unavailable => 503,
            ErrorCode::Internal => 500,
        }
    }
}

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
pub struct SubmitRequest {
    pub spec: serde_json::Value,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SubmitResponse {
    pub id: u64,
}

/// One task of a job as placed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventView {
    pub at_ms: u64,
    pub what: String,
}

/// `GET /v1/jobs/{id}` and the items of `GET /v1/jobs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobView {
    pub id: u64,
    pub name: String,
    pub user: String,
    pub queue: String,
    pub priority_class: String,
    pub state: String,
    pub nodes: u32,
    /// Per node, e.g. "8" or "0.25".
    pub gpus_per_node: String,
    pub submitted_ms: u64,
    pub started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    pub exit_code: Option<i32>,
    pub attempts: u32,
    pub command: Vec<String>,
    pub tasks: Vec<TaskView>,
    /// Why it waits, in words (pending jobs only).
    pub pending_reason: Option<String>,
    /// Its place in line among pending jobs (1 = next).
    pub queue_position: Option<u32>,
    pub history: Vec<EventView>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct JobList {
    pub jobs: Vec<JobView>,
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

/// `POST /v1/agents/register` (join token).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterRequest {
    pub name: String,
    /// Address other nodes reach this one at (a gang's master address).
    pub address: String,
    /// Identifies this agent process; a restart uses a new epoch.
    pub epoch: u64,
    pub gpus: Vec<GpuView>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub pool: Option<String>,
    pub rack: Option<String>,
    pub backend: String,
    pub driver_version: Option<String>,
    pub cuda_version: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterResponse {
    /// The node's credential for heartbeats (a bearer token).
    pub node_token: String,
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
    /// The agent stopped it because it could not renew its lease.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub fenced: bool,
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
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeartbeatResponse {
    pub version: u64,
    pub lease_ms: u64,
    pub desired: Vec<DesiredAllocation>,
}

/// `POST /v1/agents/{node}/logs`: output of one allocation, appended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogChunk {
    pub allocation: u64,
    /// Byte offset of `data` in the allocation's log.
    pub offset: u64,
    pub data: String,
}

/// `GET /v1/jobs/{id}/logs?offset=N&follow=true`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogsResponse {
    pub data: String,
    pub next_offset: u64,
    /// True once the job has ended and every byte was returned.
    pub complete: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeView {
    pub name: String,
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
    pub last_heartbeat_ms: u64,
    pub allocations: Vec<u64>,
    /// GPU indices out of service.
    #[serde(default)]
    pub unhealthy_gpus: Vec<u32>,
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
    pub in_use_gpus: f64,
    pub pending_jobs: u32,
    pub running_jobs: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueList {
    pub queues: Vec<QueueView>,
}

/// `PUT /v1/queues/{name}` (admin).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct QueueUpdate {
    pub guaranteed_gpus: f64,
    pub borrow_limit_gpus: Option<f64>,
    pub weight: u32,
}

/// The answer to `POST /v1/agents/{node}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogAck {
    /// The log's length after the chunk: where the next chunk starts.
    pub next_offset: u64,
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
            };
            let text = serde_json::to_string(&observed).unwrap();
            let back: ObservedAllocation = serde_json::from_str(&text).unwrap();
            assert_eq!(back, observed, "{text}");
        }
    }
}
