//! The stored form of the control plane's state: one serde record per job,
//! allocation, node and queue, written as JSON. Job specs are stored in their
//! wire form (`muster_api::JobSpec`) and validated again when read back.

use muster_control::{
    Allocation, AllocationId, AllocationState, Job, JobState, Node, NodeState, Software, StopCause,
};
use muster_model::{
    CpuMilli, GpuMilli, GpuModel, GpuSpec, JobId, MemoryMib, NodeName, NodeSpec, PoolName,
    QueueName, QueueSpec, RackName, Time,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A stored record that no longer reads back.
#[derive(Debug, thiserror::Error)]
#[error("{what} in the store does not read back: {reason}")]
pub struct RecordError {
    pub what: String,
    pub reason: String,
}

fn record_error(what: impl Into<String>, reason: impl ToString) -> RecordError {
    RecordError {
        what: what.into(),
        reason: reason.to_string(),
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct JobRecord {
    pub id: u64,
    pub spec: muster_api::JobSpec,
    pub user: String,
    pub submitted_ms: u64,
    pub state: String,
    pub stop_cause: Option<String>,
    pub attempts: u32,
    pub exit_code: Option<i32>,
    /// The first rank that failed on its own, and its code.
    #[serde(default)]
    pub first_failure: Option<(u32, Option<i32>)>,
    pub started_ms: Option<u64>,
    pub finished_ms: Option<u64>,
    /// Allocations of the current attempt.
    pub allocations: Vec<u64>,
    pub history: Vec<(u64, String)>,
    pub pending_reason: Option<String>,
    pub queue_position: Option<u32>,
    /// The array it is an element of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array: Option<ArrayRecord>,
}

/// [`muster_model::ArrayElement`] as stored.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ArrayRecord {
    pub array: u64,
    pub index: u32,
    pub count: u32,
    pub limit: Option<u32>,
}

fn stop_cause_name(cause: StopCause) -> &'static str {
    match cause {
        StopCause::Cancel => "cancel",
        StopCause::Preempted => "preempted",
        StopCause::TaskFailed => "task_failed",
        StopCause::NodeLost => "node_lost",
        StopCause::TimeLimit => "time_limit",
        StopCause::Idle => "idle",
    }
}

fn parse_stop_cause(name: &str) -> Option<StopCause> {
    [
        StopCause::Cancel,
        StopCause::Preempted,
        StopCause::TaskFailed,
        StopCause::NodeLost,
        StopCause::TimeLimit,
        StopCause::Idle,
    ]
    .into_iter()
    .find(|cause| stop_cause_name(*cause) == name)
}

impl From<&Job> for JobRecord {
    fn from(job: &Job) -> Self {
        JobRecord {
            id: job.id.0,
            spec: muster_api::JobSpec::from(&job.spec),
            user: job.user.clone(),
            submitted_ms: job.submitted.0,
            state: job.state.name().to_string(),
            stop_cause: job.stop_cause.map(|c| stop_cause_name(c).to_string()),
            attempts: job.attempts,
            exit_code: job.exit_code,
            first_failure: job.first_failure,
            started_ms: job.started.map(|t| t.0),
            finished_ms: job.finished.map(|t| t.0),
            allocations: job.allocations.iter().map(|a| a.0).collect(),
            history: job.history.iter().map(|(t, w)| (t.0, w.clone())).collect(),
            pending_reason: job.pending_reason.clone(),
            queue_position: job.queue_position,
            array: job.array.map(|array| ArrayRecord {
                array: array.array.0,
                index: array.index,
                count: array.count,
                limit: array.limit,
            }),
        }
    }
}

impl JobRecord {
    pub fn into_job(self) -> Result<Job, RecordError> {
        let what = || format!("job {}", self.id);
        let value = serde_json::to_value(&self.spec).map_err(|e| record_error(what(), e))?;
        let spec = muster_api::parse_job_spec_value(&value).map_err(|e| record_error(what(), e))?;
        let state = JobState::parse(&self.state)
            .ok_or_else(|| record_error(what(), format!("unknown state {:?}", self.state)))?;
        let stop_cause = match &self.stop_cause {
            None => None,
            Some(name) => Some(
                parse_stop_cause(name)
                    .ok_or_else(|| record_error(what(), format!("unknown stop cause {name:?}")))?,
            ),
        };
        Ok(Job {
            id: JobId(self.id),
            spec,
            user: self.user,
            submitted: Time(self.submitted_ms),
            state,
            stop_cause,
            attempts: self.attempts,
            exit_code: self.exit_code,
            first_failure: self.first_failure,
            started: self.started_ms.map(Time),
            finished: self.finished_ms.map(Time),
            allocations: self.allocations.into_iter().map(AllocationId).collect(),
            history: self
                .history
                .into_iter()
                .map(|(t, w)| (Time(t), w))
                .collect(),
            pending_reason: self.pending_reason,
            queue_position: self.queue_position,
            array: self.array.map(|array| muster_model::ArrayElement {
                array: JobId(array.array),
                index: array.index,
                count: array.count,
                limit: array.limit,
            }),
        })
    }
}

/// A job's row in the store: its record and the columns it is found by.
pub fn job_row(job: &Job, record: String) -> crate::store::JobRow {
    crate::store::JobRow {
        record,
        state: job.state.name().to_string(),
        user: job.user.clone(),
        queue: job.spec.queue.0.clone(),
    }
}

/// An allocation state's name, as the API and the store write it.
pub fn allocation_state_name(state: AllocationState) -> &'static str {
    match state {
        AllocationState::Assigned => "assigned",
        AllocationState::Running => "running",
        AllocationState::Stopping => "stopping",
        AllocationState::Exited { .. } => "exited",
        AllocationState::Lost => "lost",
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AllocationRecord {
    pub id: u64,
    pub job: u64,
    pub rank: u32,
    pub node: String,
    pub gpus: Vec<(u32, u16)>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub generation: u64,
    pub state: String,
    pub exit_code: Option<i32>,
    pub env: BTreeMap<String, String>,
    pub assigned_ms: u64,
}

impl From<&Allocation> for AllocationRecord {
    fn from(allocation: &Allocation) -> Self {
        AllocationRecord {
            id: allocation.id.0,
            job: allocation.job.0,
            rank: allocation.rank,
            node: allocation.node.0.clone(),
            gpus: allocation.gpus.clone(),
            cpu_milli: allocation.cpu.0,
            memory_mib: allocation.memory.0,
            generation: allocation.generation,
            state: allocation_state_name(allocation.state).to_string(),
            exit_code: match allocation.state {
                AllocationState::Exited { code } => code,
                _ => None,
            },
            env: allocation.env.clone(),
            assigned_ms: allocation.assigned.0,
        }
    }
}

impl AllocationRecord {
    pub fn into_allocation(self) -> Result<Allocation, RecordError> {
        let state = match self.state.as_str() {
            "assigned" => AllocationState::Assigned,
            "running" => AllocationState::Running,
            "stopping" => AllocationState::Stopping,
            "exited" => AllocationState::Exited {
                code: self.exit_code,
            },
            "lost" => AllocationState::Lost,
            other => {
                return Err(record_error(
                    format!("allocation {}", self.id),
                    format!("unknown state {other:?}"),
                ));
            }
        };
        Ok(Allocation {
            id: AllocationId(self.id),
            job: JobId(self.job),
            rank: self.rank,
            node: NodeName(self.node),
            gpus: self.gpus,
            cpu: CpuMilli(self.cpu_milli),
            memory: MemoryMib(self.memory_mib),
            generation: self.generation,
            state,
            env: self.env,
            assigned: Time(self.assigned_ms),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GpuRecord {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub memory_mib: u64,
    pub nvlink_domain: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct NodeRecord {
    pub name: String,
    pub pool: String,
    pub rack: String,
    pub gpus: Vec<GpuRecord>,
    pub cpu_milli: u64,
    pub memory_mib: u64,
    pub address: String,
    pub epoch: u64,
    pub state: String,
    pub cordoned: bool,
    pub draining: bool,
    pub last_heartbeat_ms: u64,
    pub backend: String,
    pub driver: Option<String>,
    pub cuda: Option<String>,
    #[serde(default)]
    pub unhealthy_gpus: Vec<u32>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub stack: BTreeMap<String, String>,
    /// Waits for an operator's approval (`--approve-nodes`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pending_approval: bool,
}

impl From<&Node> for NodeRecord {
    fn from(node: &Node) -> Self {
        NodeRecord {
            name: node.spec.name.0.clone(),
            pool: node.spec.pool.0.clone(),
            rack: node.spec.rack.0.clone(),
            gpus: node
                .spec
                .gpus
                .iter()
                .map(|gpu| GpuRecord {
                    index: gpu.index,
                    uuid: gpu.uuid.clone(),
                    model: gpu.model.as_str().to_string(),
                    memory_mib: gpu.memory.0,
                    nvlink_domain: gpu.nvlink_domain,
                })
                .collect(),
            cpu_milli: node.spec.cpu.0,
            memory_mib: node.spec.memory.0,
            address: node.address.clone(),
            epoch: node.epoch,
            state: node_state_name(node.state).to_string(),
            cordoned: node.cordoned,
            draining: node.draining,
            unhealthy_gpus: node.unhealthy_gpus.clone(),
            last_heartbeat_ms: node.last_heartbeat.0,
            backend: node.software.backend.clone(),
            driver: node.software.driver.clone(),
            cuda: node.software.cuda.clone(),
            stack: node.software.stack.clone(),
            pending_approval: node.pending_approval,
        }
    }
}

pub fn node_state_name(state: NodeState) -> &'static str {
    match state {
        NodeState::Ready => "ready",
        NodeState::Lost => "lost",
    }
}

impl NodeRecord {
    pub fn into_node(self) -> Result<Node, RecordError> {
        let state = match self.state.as_str() {
            "ready" => NodeState::Ready,
            "lost" => NodeState::Lost,
            other => {
                return Err(record_error(
                    format!("node {}", self.name),
                    format!("unknown state {other:?}"),
                ));
            }
        };
        Ok(Node {
            spec: NodeSpec {
                name: NodeName(self.name),
                pool: PoolName(self.pool),
                rack: RackName(self.rack),
                gpus: self
                    .gpus
                    .into_iter()
                    .map(|gpu| GpuSpec {
                        index: gpu.index,
                        uuid: gpu.uuid,
                        model: GpuModel::new(&gpu.model),
                        memory: MemoryMib(gpu.memory_mib),
                        nvlink_domain: gpu.nvlink_domain,
                    })
                    .collect(),
                cpu: CpuMilli(self.cpu_milli),
                memory: MemoryMib(self.memory_mib),
            },
            unhealthy_gpus: self.unhealthy_gpus,
            address: self.address,
            epoch: self.epoch,
            state,
            cordoned: self.cordoned,
            draining: self.draining,
            last_heartbeat: Time(self.last_heartbeat_ms),
            drift: None,
            pending_approval: self.pending_approval,
            software: Software {
                backend: self.backend,
                driver: self.driver,
                cuda: self.cuda,
                stack: self.stack,
            },
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct QueueRecord {
    pub name: String,
    pub guaranteed_milli: u32,
    pub borrow_limit_milli: Option<u32>,
    pub weight: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_after_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_below_pct: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget_monthly_cents: Option<u64>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub budget_hard: bool,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub members_see_jobs: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_pending: Option<u64>,
    /// (name, value) of the highest priority class users may submit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_priority_class: Option<(String, i32)>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_non_preemptible: bool,
}

impl From<&QueueSpec> for QueueRecord {
    fn from(queue: &QueueSpec) -> Self {
        QueueRecord {
            name: queue.name.0.clone(),
            guaranteed_milli: queue.guaranteed.0,
            borrow_limit_milli: queue.borrow_limit.map(|l| l.0),
            weight: queue.weight,
            idle_timeout_s: queue.idle_timeout.map(|t| t.as_secs()),
            idle_after_s: queue.idle_after.map(|t| t.as_secs()),
            idle_below_pct: queue.idle_below_pct,
            budget_monthly_cents: queue.budget.map(|b| b.monthly_cents),
            budget_hard: queue.budget.is_some_and(|b| b.hard),
            members_see_jobs: queue.members_see_jobs,
            max_pending: queue.max_pending,
            max_priority_class: queue
                .max_priority_class
                .as_ref()
                .map(|class| (class.name.clone(), class.value)),
            allow_non_preemptible: queue.allow_non_preemptible,
        }
    }
}

impl From<QueueRecord> for QueueSpec {
    fn from(record: QueueRecord) -> Self {
        QueueSpec {
            name: QueueName(record.name),
            guaranteed: GpuMilli(record.guaranteed_milli),
            borrow_limit: record.borrow_limit_milli.map(GpuMilli),
            weight: record.weight.max(1),
            idle_timeout: record.idle_timeout_s.map(std::time::Duration::from_secs),
            idle_after: record.idle_after_s.map(std::time::Duration::from_secs),
            idle_below_pct: record.idle_below_pct.map(|pct| pct.min(100)),
            budget: record
                .budget_monthly_cents
                .map(|monthly_cents| muster_model::Budget {
                    monthly_cents,
                    hard: record.budget_hard,
                }),
            members_see_jobs: record.members_see_jobs,
            max_pending: record.max_pending,
            max_priority_class: record
                .max_priority_class
                .map(|(name, value)| muster_model::PriorityClass::new(&name, value)),
            allow_non_preemptible: record.allow_non_preemptible,
        }
    }
}

/// A pool's own stack policy as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    pub name: String,
    /// `report`, `majority` or `required`.
    pub stack_policy: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub required: BTreeMap<String, String>,
    /// Host paths container jobs may mount.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_mounts: Vec<String>,
    /// An inference pool.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub inference: bool,
}

impl PoolRecord {
    pub fn of(pool: &muster_model::PoolName, policy: &muster_control::PoolPolicy) -> PoolRecord {
        PoolRecord {
            name: pool.0.clone(),
            stack_policy: policy.stack.name().to_string(),
            required: policy.required.clone(),
            allowed_mounts: policy.mounts.clone(),
            inference: policy.inference,
        }
    }

    pub fn into_policy(
        self,
    ) -> Result<(muster_model::PoolName, muster_control::PoolPolicy), RecordError> {
        let stack = muster_control::StackPolicy::parse(&self.stack_policy).ok_or_else(|| {
            record_error(
                format!("pool {}", self.name),
                format!("unknown stack policy {:?}", self.stack_policy),
            )
        })?;
        Ok((
            muster_model::PoolName(self.name),
            muster_control::PoolPolicy {
                stack,
                required: self.required,
                mounts: self.allowed_mounts,
                inference: self.inference,
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_model::{GpuRequest, JobSpec};

    #[test]
    fn a_job_reads_back_as_it_was_written() {
        let mut spec =
            JobSpec::simple("train", "team-a", GpuRequest::Whole(2), vec!["true".into()]);
        spec.env.insert("A".into(), "1".into());
        let job = Job {
            id: JobId(7),
            spec,
            user: "alice".into(),
            submitted: Time(1_000),
            state: JobState::Stopping,
            stop_cause: Some(StopCause::Preempted),
            attempts: 2,
            exit_code: None,
            first_failure: Some((1, Some(3))),
            started: Some(Time(2_000)),
            finished: None,
            allocations: vec![AllocationId(3)],
            history: vec![(Time(1_000), "submitted".into())],
            pending_reason: None,
            queue_position: None,
            array: None,
        };
        let text = serde_json::to_string(&JobRecord::from(&job)).unwrap();
        let back: JobRecord = serde_json::from_str(&text).unwrap();
        assert_eq!(back.into_job().unwrap(), job);
    }

    #[test]
    fn an_exited_allocation_keeps_its_code() {
        let allocation = Allocation {
            id: AllocationId(1),
            job: JobId(2),
            rank: 0,
            node: NodeName::from("a"),
            gpus: vec![(0, 1000), (1, 250)],
            cpu: CpuMilli(1000),
            memory: MemoryMib(512),
            generation: 9,
            state: AllocationState::Exited { code: Some(3) },
            env: BTreeMap::new(),
            assigned: Time(5),
        };
        let back = AllocationRecord::from(&allocation)
            .into_allocation()
            .unwrap();
        assert_eq!(back, allocation);
    }
}
