//! What is admitted. A submission, decided in one commit with it: its
//! user's and queue's pending jobs within their limits, and, for an
//! ordinary user, the queue's priority classes and preemptibility, and its
//! live dev environments within their limit (the counts are kept with
//! every change of a job's state, see
//! `state.rs`, and recounted by `check_invariants`). A registering node:
//! its claims within the server's limits, an address a node can have, GPUs
//! no other node holds.

use crate::state::{ControlPlane, Job, JobState};
use muster_model::{JobId, JobSpec, NodeName, NodeSpec, QueueName};
use std::collections::BTreeMap;

/// What admission counts, kept with every change of a job's state: the
/// pending jobs of each user and each queue, and each user's live (pending,
/// running or stopping) dev environments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct AdmissionCounts {
    by_user: BTreeMap<String, u64>,
    by_queue: BTreeMap<QueueName, u64>,
    dev_by_user: BTreeMap<String, u64>,
}

/// Whether a job in `state` holds a dev environment's place.
fn live(state: JobState) -> bool {
    matches!(
        state,
        JobState::Pending | JobState::Running | JobState::Stopping
    )
}

/// One more (`up`) or one fewer of `key`; a count that reaches 0 goes.
fn add<K: Ord + Clone>(counts: &mut BTreeMap<K, u64>, key: &K, up: bool) {
    if up {
        *counts.entry(key.clone()).or_default() += 1;
    } else if let Some(count) = counts.get_mut(key) {
        *count -= 1;
        if *count == 0 {
            counts.remove(key);
        }
    }
}

impl AdmissionCounts {
    /// Counts `jobs` from scratch.
    pub(crate) fn of(jobs: &BTreeMap<JobId, Job>) -> AdmissionCounts {
        let mut counts = AdmissionCounts::default();
        for job in jobs.values() {
            counts.changed(&job.user, &job.spec, None, Some(job.state));
        }
        counts
    }

    /// A job of `user` with `spec` went from state `was` to `is` (`None`:
    /// not a job, before its submission or after its withdrawal).
    pub(crate) fn changed(
        &mut self,
        user: &str,
        spec: &JobSpec,
        was: Option<JobState>,
        is: Option<JobState>,
    ) {
        let pending = |state: Option<JobState>| state == Some(JobState::Pending);
        if pending(was) != pending(is) {
            add(&mut self.by_user, &user.to_string(), pending(is));
            add(&mut self.by_queue, &spec.queue, pending(is));
        }
        let holds = |state: Option<JobState>| state.is_some_and(live);
        if spec.is_dev_environment() && holds(was) != holds(is) {
            add(&mut self.dev_by_user, &user.to_string(), holds(is));
        }
    }
}

/// Who submits, for [`ControlPlane::admission`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitter<'a> {
    pub user: &'a str,
    /// The most jobs the user may have pending (`None`: no limit).
    pub max_pending: Option<u64>,
    /// An ordinary user (not an operator or admin): the queue's priority
    /// class ceiling and its word on non-preemptible jobs apply.
    pub ordinary: bool,
    /// The most dev environments (pending or running) the user may have
    /// (`None`: no limit).
    pub max_dev: Option<u64>,
}

/// The highest priority class an ordinary user may submit to a queue that
/// names none.
pub const DEFAULT_MAX_PRIORITY_CLASS: &str = "normal";

impl ControlPlane {
    /// Whether `submitter` may submit `spec` now: its user's and its
    /// queue's pending jobs stay within their limits with it (an array's
    /// elements one each), and an ordinary user keeps to the queue's
    /// priority classes and preemptibility. The error says which limit,
    /// the count and what to do. Called with the submission in one commit,
    /// so a burst cannot pass a limit.
    pub fn admission(&self, spec: &JobSpec, submitter: &Submitter<'_>) -> Result<(), String> {
        let count = spec.array.as_ref().map_or(1, |array| array.len() as u64);
        let queue = self.queues.get(&spec.queue);
        if let Some(max) = submitter.max_dev
            && spec.is_dev_environment()
        {
            let live = self
                .admission_counts
                .dev_by_user
                .get(submitter.user)
                .copied()
                .unwrap_or(0);
            if live + count > max {
                return Err(format!(
                    "{user} has {live} dev environment(s) and may have at most {max}: stop one \
                     first (`muster dev stop NAME`), or ask an admin (the server's \
                     --max-dev-per-user)",
                    user = submitter.user
                ));
            }
        }
        if let Some(max) = submitter.max_pending {
            let pending = self.pending_of_user(submitter.user);
            if pending + count > max {
                return Err(format!(
                    "{user} has {pending} job(s) pending and may have at most {max}; this \
                     submission of {count} would pass that: wait for some to start, cancel some, \
                     or ask an admin (`muster users set {user} --max-pending N`)",
                    user = submitter.user
                ));
            }
        }
        if let Some(max) = queue.and_then(|queue| queue.max_pending) {
            let pending = self.pending_of_queue(&spec.queue);
            if pending + count > max {
                return Err(format!(
                    "queue {queue} has {pending} job(s) pending and may have at most {max}; this \
                     submission of {count} would pass that (an admin changes it with `muster \
                     queues set {queue} --max-pending N`)",
                    queue = spec.queue
                ));
            }
        }
        if submitter.ordinary {
            let ceiling = queue
                .and_then(|queue| queue.max_priority_class.clone())
                .unwrap_or_else(muster_model::PriorityClass::normal);
            debug_assert_eq!(
                muster_model::PriorityClass::normal().name,
                DEFAULT_MAX_PRIORITY_CLASS
            );
            if spec.priority_class.value > ceiling.value {
                return Err(format!(
                    "priority_class {} is above what queue {} allows its users ({}); submit at {} \
                     or below, or ask an admin (`muster queues set {} --max-priority-class {}`)",
                    spec.priority_class.name,
                    spec.queue,
                    ceiling.name,
                    ceiling.name,
                    spec.queue,
                    spec.priority_class.name
                ));
            }
            // A dev environment is someone's open shell: `muster dev start`
            // makes it non-preemptible, and a user has only a few of them
            // (`max_dev`), so the queue's word is not needed for it.
            if !spec.preemptible
                && !spec.is_dev_environment()
                && !queue.is_some_and(|queue| queue.allow_non_preemptible)
            {
                return Err(format!(
                    "queue {queue} takes no non-preemptible jobs from its users; submit with \
                     preemptible: true, or ask an admin (`muster queues set {queue} \
                     --allow-non-preemptible`)",
                    queue = spec.queue
                ));
            }
        }
        Ok(())
    }

    /// How many jobs `user` has pending (array elements one each).
    pub fn pending_of_user(&self, user: &str) -> u64 {
        self.admission_counts
            .by_user
            .get(user)
            .copied()
            .unwrap_or(0)
    }

    /// Whether any job is pending (held ones too): without one, a
    /// scheduling cycle has nothing to decide.
    pub fn any_pending(&self) -> bool {
        self.admission_counts
            .by_queue
            .values()
            .any(|&count| count > 0)
    }

    /// How many jobs queue `queue` has pending.
    pub fn pending_of_queue(&self, queue: &QueueName) -> u64 {
        self.admission_counts
            .by_queue
            .get(queue)
            .copied()
            .unwrap_or(0)
    }
}

/// The most GPUs, CPUs and memory one node may claim at registration: a
/// claim past them is refused (a node that lies would draw work first).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeLimits {
    pub gpus: usize,
    pub cpu_milli: u64,
    pub memory_mib: u64,
}

/// [`NodeLimits`] unless the operator says otherwise: 16 GPUs, 1,024 CPUs,
/// 16 TiB (beyond the largest single servers sold).
pub const DEFAULT_NODE_LIMITS: NodeLimits = NodeLimits {
    gpus: 16,
    cpu_milli: 1_024_000,
    memory_mib: 16 << 20,
};

/// What is wrong with a registering node's claims, in words (none: it may
/// join): more than `limits`, an unspecified, multicast or link-local
/// address (the cloud's metadata service lives there), one GPU twice.
pub fn node_claim_problems(spec: &NodeSpec, address: &str, limits: NodeLimits) -> Vec<String> {
    let mut problems = Vec::new();
    if spec.gpus.len() > limits.gpus {
        problems.push(format!(
            "it claims {} GPUs, more than the {} a node may have here (the server's \
             --max-node-gpus)",
            spec.gpus.len(),
            limits.gpus
        ));
    }
    if spec.cpu.0 > limits.cpu_milli {
        problems.push(format!(
            "it claims {} CPUs, more than the {} a node may have here (--max-node-cpus)",
            spec.cpu.0 / 1000,
            limits.cpu_milli / 1000
        ));
    }
    if spec.memory.0 > limits.memory_mib {
        problems.push(format!(
            "it claims {} GiB of memory, more than the {} GiB a node may have here \
             (--max-node-memory)",
            spec.memory.0 >> 10,
            limits.memory_mib >> 10
        ));
    }
    if let Ok(ip) = address.trim().parse::<core::net::IpAddr>() {
        let unusable = ip.is_unspecified()
            || ip.is_multicast()
            || match ip {
                core::net::IpAddr::V4(v4) => v4.is_link_local() || v4.is_broadcast(),
                core::net::IpAddr::V6(v6) => v6.is_unicast_link_local(),
            };
        if unusable {
            problems.push(format!(
                "its address {ip} is unspecified, multicast or link-local: no node is reached \
                 there; give the node's own address (--address)"
            ));
        }
    }
    let unique: std::collections::BTreeSet<&str> =
        spec.gpus.iter().map(|gpu| gpu.uuid.as_str()).collect();
    if unique.len() != spec.gpus.len() {
        problems.push("it names one GPU UUID twice".to_string());
    }
    problems
}

impl ControlPlane {
    /// A GPU of `uuids` that a node other than `name` holds, with that node.
    pub fn gpu_held_elsewhere(
        &self,
        name: &NodeName,
        uuids: &[String],
    ) -> Option<(String, NodeName)> {
        self.nodes
            .values()
            .filter(|node| node.spec.name != *name)
            .find_map(|node| {
                node.spec
                    .gpus
                    .iter()
                    .find(|gpu| uuids.contains(&gpu.uuid))
                    .map(|gpu| (gpu.uuid.clone(), node.spec.name.clone()))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_model::{CpuMilli, GpuModel, GpuSpec, MemoryMib, PoolName, RackName};

    fn node(gpus: usize, uuid: impl Fn(usize) -> String) -> NodeSpec {
        NodeSpec {
            name: NodeName("n".to_string()),
            pool: PoolName("default".to_string()),
            rack: RackName("default".to_string()),
            gpus: (0..gpus)
                .map(|index| GpuSpec {
                    index: index as u32,
                    uuid: uuid(index),
                    model: GpuModel::new("H100-80GB"),
                    memory: MemoryMib(81_920),
                    nvlink_domain: 0,
                })
                .collect(),
            cpu: CpuMilli(64_000),
            memory: MemoryMib(512 << 10),
        }
    }

    #[test]
    fn a_node_claims_only_what_a_node_may_have_at_an_address_a_node_can_have() {
        let plain = node(8, |i| format!("GPU-{i}"));
        assert!(node_claim_problems(&plain, "10.1.2.3", DEFAULT_NODE_LIMITS).is_empty());
        assert!(node_claim_problems(&plain, "gpu-7.example", DEFAULT_NODE_LIMITS).is_empty());
        let mut thief = node(64, |i| format!("GPU-{i}"));
        thief.memory = MemoryMib(100 << 20);
        thief.cpu = CpuMilli(4_096_000);
        let problems = node_claim_problems(&thief, "169.254.169.254", DEFAULT_NODE_LIMITS);
        assert_eq!(problems.len(), 4, "{problems:?}");
        for (problem, says) in
            problems
                .iter()
                .zip(["64 GPUs", "4096 CPUs", "102400 GiB", "link-local"])
        {
            assert!(problem.contains(says), "{problem}");
        }
        for address in ["0.0.0.0", "224.0.0.1", "255.255.255.255", "fe80::1", "::"] {
            assert_eq!(
                node_claim_problems(&plain, address, DEFAULT_NODE_LIMITS).len(),
                1,
                "{address}"
            );
        }
        let twice = node(2, |_| "GPU-same".to_string());
        assert_eq!(
            node_claim_problems(&twice, "10.0.0.1", DEFAULT_NODE_LIMITS),
            vec!["it names one GPU UUID twice"]
        );
    }

    fn submitted(control: &mut ControlPlane, id: u64, spec: JobSpec, user: &str) {
        control
            .handle(
                muster_model::Time(1),
                crate::Input::Submit {
                    id: JobId(id),
                    spec,
                    user: user.to_string(),
                },
            )
            .expect("submitted");
    }

    fn dev_spec() -> JobSpec {
        JobSpec::simple(
            "dev",
            "default",
            muster_model::GpuRequest::Whole(1),
            vec![muster_model::DEV_SESSION_COMMAND.to_string()],
        )
    }

    fn user<'a>(name: &'a str, max_dev: Option<u64>) -> Submitter<'a> {
        Submitter {
            user: name,
            max_pending: None,
            ordinary: true,
            max_dev,
        }
    }

    #[test]
    fn a_user_s_dev_environments_are_bounded_and_others_are_not_counted() {
        let mut control = ControlPlane::new(crate::ControlConfig::default());
        for id in 1..=2 {
            assert_eq!(
                control.admission(&dev_spec(), &user("alice", Some(2))),
                Ok(())
            );
            submitted(&mut control, id, dev_spec(), "alice");
        }
        let error = control
            .admission(&dev_spec(), &user("alice", Some(2)))
            .unwrap_err();
        assert!(error.contains("alice has 2 dev environment(s)"), "{error}");
        assert!(error.contains("at most 2"), "{error}");
        // Another user, an ordinary job, no limit: admitted.
        assert_eq!(
            control.admission(&dev_spec(), &user("bob", Some(2))),
            Ok(())
        );
        let batch = JobSpec::simple(
            "train",
            "default",
            muster_model::GpuRequest::Whole(1),
            vec!["true".to_string()],
        );
        assert_eq!(control.admission(&batch, &user("alice", Some(2))), Ok(()));
        assert_eq!(control.admission(&dev_spec(), &user("alice", None)), Ok(()));
        // Non-preemptible, as `muster dev start` makes it: still admitted
        // where the queue takes no other non-preemptible work.
        let mut steady = dev_spec();
        steady.preemptible = false;
        assert_eq!(control.admission(&steady, &user("bob", Some(2))), Ok(()));
        let mut batch_steady = batch.clone();
        batch_steady.preemptible = false;
        assert!(
            control
                .admission(&batch_steady, &user("bob", Some(2)))
                .is_err()
        );
        // One stopped makes room.
        control
            .handle(
                muster_model::Time(2),
                crate::Input::Cancel { job: JobId(1) },
            )
            .expect("cancelled");
        assert_eq!(
            control.admission(&dev_spec(), &user("alice", Some(2))),
            Ok(())
        );
    }

    #[test]
    fn pending_jobs_are_capped_counting_array_elements() {
        let mut control = ControlPlane::new(crate::ControlConfig::default());
        let submitter = Submitter {
            user: "alice",
            max_pending: Some(10),
            ordinary: true,
            max_dev: None,
        };
        let mut array = JobSpec::simple(
            "sweep",
            "default",
            muster_model::GpuRequest::Whole(1),
            vec!["true".to_string()],
        );
        array.array = muster_model::ArraySpec::parse("0-7").ok();
        assert!(array.array.is_some());
        assert_eq!(control.admission(&array, &submitter), Ok(()));
        submitted(&mut control, 1, array.clone(), "alice");
        // 8 pending: another 8 would be 16.
        let error = control.admission(&array, &submitter).unwrap_err();
        assert!(error.contains("alice has 8 job(s) pending"), "{error}");
        assert!(error.contains("submission of 8"), "{error}");
    }
}
