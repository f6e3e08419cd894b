//! Scenario tests for one scheduling cycle, one area per module.

use muster_model::{GpuMilli, JobId, NodeName, QueueName, QueueSpec, Time, TopologyStrength};
use muster_sched::{
    Allocation, Backfill, FilterReason, GangFailure, Outcome, PendingJob, PendingReason,
    PlacementPolicy, PreemptionCause, SchedulingPolicy, Snapshot, schedule,
};
use muster_testkit::{MakeJob, MakeNode, check_outcome, make_nodes, running_from};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeSet;

mod common;

fn cycle(snapshot: &Snapshot, pending: &[PendingJob], policy: &SchedulingPolicy) -> Outcome {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let outcome = schedule(snapshot, pending, policy, &mut rng).expect("valid cluster");
    if let Err(violation) = check_outcome(snapshot, pending, &outcome) {
        panic!("invariant violated: {violation}\n{outcome:#?}");
    }
    outcome
}

fn snapshot(nodes: Vec<muster_sched::NodeInput>) -> Snapshot {
    Snapshot {
        nodes,
        ..Snapshot::default()
    }
}

fn started(outcome: &Outcome, id: u64) -> &[Allocation] {
    &outcome
        .started
        .iter()
        .find(|start| start.job == JobId(id))
        .unwrap_or_else(|| panic!("job {id} did not start: {:#?}", outcome.pending))
        .tasks
}

fn reason(outcome: &Outcome, id: u64) -> &PendingReason {
    outcome
        .pending
        .get(&JobId(id))
        .unwrap_or_else(|| panic!("job {id} is not pending"))
}

fn node_of(outcome: &Outcome, id: u64) -> String {
    started(outcome, id)[0].node.0.clone()
}

mod filtering {
    use super::*;

    #[test]
    fn each_filter_is_counted_in_the_pending_reason() {
        let nodes = vec![
            MakeNode::new("a-pool").pool("inference").build(),
            MakeNode::new("b-cordoned").cordoned().build(),
            MakeNode::new("c-unhealthy").unhealthy().build(),
            MakeNode::new("d-model").gpus(8, "L4").build(),
            MakeNode::new("e-memory").gpu_memory_gib(40).build(),
            MakeNode::new("f-cpu").cpus(2).build(),
        ];
        let job = MakeJob::new(1)
            .models(&["H100-80GB"])
            .min_gpu_memory_gib(80)
            .pool("default")
            .cpus(4)
            .build();
        let outcome = cycle(&snapshot(nodes), &[job], &SchedulingPolicy::default());
        // The cordoned and the lost node would do once back: it waits for
        // them, and says so.
        let why = reason(&outcome, 1);
        assert_eq!(why.code(), "nodes-unavailable");
        assert!(
            why.to_string()
                .starts_with("waiting for nodes to come back"),
            "{why}"
        );
        let PendingReason::NodesUnavailable { filters } = why else {
            panic!("expected nodes-unavailable, got {why:?}");
        };
        assert_eq!(
            (filters.could_ever_fit, filters.could_fit_when_available),
            (0, 2)
        );
        for filter in [
            FilterReason::Pool,
            FilterReason::Cordoned,
            FilterReason::Unhealthy,
            FilterReason::GpuModel,
            FilterReason::GpuMemory,
            FilterReason::Cpu,
        ] {
            assert_eq!(filters.rejected.get(&filter), Some(&1), "{filter:?}");
        }
    }

    /// A job with an image goes only to nodes with a container engine; with
    /// none free it waits and says why; a plain job goes anywhere.
    #[test]
    fn a_container_job_goes_only_to_nodes_that_run_containers() {
        let nodes = vec![
            MakeNode::new("a-plain").without_containers().build(),
            MakeNode::new("b-docker").build(),
        ];
        let boxed = MakeJob::new(1).gpus(8).in_container().build();
        let outcome = cycle(
            &snapshot(nodes.clone()),
            &[boxed],
            &SchedulingPolicy::default(),
        );
        assert_eq!(node_of(&outcome, 1), "b-docker");
        // Two of them: the second finds no node that runs containers free.
        let jobs = [
            MakeJob::new(1).gpus(8).in_container().build(),
            MakeJob::new(2).gpus(8).in_container().build(),
            MakeJob::new(3).gpus(8).build(),
        ];
        let outcome = cycle(
            &snapshot(nodes.clone()),
            &jobs,
            &SchedulingPolicy::default(),
        );
        assert_eq!(node_of(&outcome, 1), "b-docker");
        assert_eq!(node_of(&outcome, 3), "a-plain");
        // Job 2 waits for the one node that runs containers (holding it
        // for when job 1 ends), while job 3 went to the other.
        assert!(
            matches!(reason(&outcome, 2), PendingReason::HoldsReservation { .. }),
            "{}",
            reason(&outcome, 2)
        );
        // Only nodes without an engine: it never fits, and says why.
        let plain = vec![MakeNode::new("a-plain").without_containers().build()];
        let boxed = MakeJob::new(1).gpus(8).in_container().build();
        let outcome = cycle(&snapshot(plain), &[boxed], &SchedulingPolicy::default());
        let why = reason(&outcome, 1).to_string();
        assert!(why.contains("cannot run containers"), "{why}");
    }

    #[test]
    fn a_job_that_fits_only_cordoned_or_lost_nodes_says_which() {
        let job = MakeJob::new(1).gpus(8).build();
        let cordoned = vec![
            MakeNode::new("a").cordoned().build(),
            MakeNode::new("b").gpus(4, "H100-80GB").build(),
        ];
        let outcome = cycle(
            &snapshot(cordoned),
            std::slice::from_ref(&job),
            &SchedulingPolicy::default(),
        );
        assert_eq!(reason(&outcome, 1).code(), "nodes-cordoned");
        let lost = vec![MakeNode::new("a").unhealthy().build()];
        let outcome = cycle(
            &snapshot(lost),
            std::slice::from_ref(&job),
            &SchedulingPolicy::default(),
        );
        assert_eq!(reason(&outcome, 1).code(), "nodes-lost");
        // Too large for any node, back or not: never fits.
        let small = vec![MakeNode::new("a").gpus(4, "H100-80GB").cordoned().build()];
        let outcome = cycle(&snapshot(small), &[job], &SchedulingPolicy::default());
        assert_eq!(reason(&outcome, 1).code(), "never-fits");
    }

    #[test]
    fn an_unhealthy_gpu_is_never_allocated() {
        let nodes = vec![MakeNode::new("n").gpus(2, "A100").unhealthy_gpu(0).build()];
        let jobs = vec![MakeJob::new(1).build(), MakeJob::new(2).build()];
        let outcome = cycle(&snapshot(nodes), &jobs, &SchedulingPolicy::default());
        assert_eq!(started(&outcome, 1)[0].gpus, vec![(1, 1000)]);
        assert!(matches!(
            reason(&outcome, 2),
            PendingReason::NeverFits { .. }
                | PendingReason::NoCapacity { .. }
                | PendingReason::HoldsReservation { .. }
        ));
    }
}

mod fractional {
    use super::*;

    #[test]
    fn shares_pack_onto_one_gpu_without_over_committing() {
        let nodes = vec![MakeNode::new("n").gpus(2, "A100").build()];
        let jobs: Vec<PendingJob> = (1..=5)
            .map(|id| MakeJob::new(id).share(300).build())
            .collect();
        for policy in PlacementPolicy::ALL {
            let outcome = cycle(
                &snapshot(nodes.clone()),
                &jobs,
                &SchedulingPolicy {
                    placement: policy,
                    ..SchedulingPolicy::default()
                },
            );
            assert_eq!(
                outcome.started.len(),
                5,
                "{policy}: 3 fit per GPU, 6 in all"
            );
        }
        let outcome = cycle(
            &snapshot(nodes),
            &jobs,
            &SchedulingPolicy {
                placement: PlacementPolicy::BestFit,
                ..SchedulingPolicy::default()
            },
        );
        let on_gpu0 = outcome
            .started
            .iter()
            .filter(|s| s.tasks[0].gpus[0].0 == 0)
            .count();
        assert_eq!(on_gpu0, 3, "best-fit fills the fuller GPU first");
    }

    #[test]
    fn a_share_that_fits_no_gpu_waits() {
        let nodes = vec![MakeNode::new("n").gpus(1, "A100").build()];
        let jobs = vec![
            MakeJob::new(1).share(600).build(),
            MakeJob::new(2).share(600).build(),
        ];
        let outcome = cycle(&snapshot(nodes), &jobs, &SchedulingPolicy::default());
        started(&outcome, 1);
        assert!(!outcome.started.iter().any(|s| s.job == JobId(2)));
    }
}

mod gangs {
    use super::*;

    #[test]
    fn a_gang_is_placed_whole_on_distinct_nodes() {
        let outcome = cycle(
            &snapshot(make_nodes("n", 4, 2)),
            &[MakeJob::new(1).gpus(8).tasks(3).build()],
            &SchedulingPolicy::default(),
        );
        assert_eq!(started(&outcome, 1).len(), 3);
    }

    #[test]
    fn a_gang_larger_than_the_cluster_stays_pending_and_holds_nothing() {
        let pending = [
            MakeJob::new(1).gpus(8).tasks(5).build(),
            MakeJob::new(2).gpus(8).build(),
        ];
        let outcome = cycle(
            &snapshot(make_nodes("n", 4, 2)),
            &pending,
            &SchedulingPolicy::default(),
        );
        let PendingReason::NeverFits { filters, .. } = reason(&outcome, 1) else {
            panic!("{:?}", reason(&outcome, 1));
        };
        assert_eq!(filters.could_ever_fit, 4);
        // Nodes could hold its tasks, just not enough of them.
        assert_eq!(reason(&outcome, 1).code(), "too-wide");
        assert!(
            reason(&outcome, 1)
                .to_string()
                .starts_with("too wide for the cluster: it needs 5 nodes, and only 4"),
            "{}",
            reason(&outcome, 1)
        );
        started(&outcome, 2);
    }

    #[test]
    fn a_gang_prefers_one_rack() {
        let mut nodes = make_nodes("n", 6, 3);
        // Rack 0 has one node busy: the gang of 3 must go to rack 1.
        nodes[0] = MakeNode::new("n-000")
            .rack("rack-00")
            .gpus(8, "H100-80GB")
            .build();
        let busy = MakeJob::new(9).gpus(8).build();
        let mut snap = snapshot(nodes);
        snap.running.push(running_from(
            &busy,
            vec![Allocation {
                node: NodeName::from("n-000"),
                gpus: (0..8).map(|i| (i, 1000)).collect(),
                cpu: muster_model::CpuMilli(1000),
                memory: muster_model::MemoryMib(1024),
            }],
            Time(0),
            None,
        ));
        let outcome = cycle(
            &snap,
            &[MakeJob::new(1).gpus(8).tasks(3).build()],
            &SchedulingPolicy {
                preemption: false,
                ..SchedulingPolicy::default()
            },
        );
        let mut nodes: Vec<String> = started(&outcome, 1)
            .iter()
            .map(|t| t.node.0.clone())
            .collect();
        // Ranks follow the cluster's tie order; the nodes are rack 1's.
        nodes.sort();
        assert_eq!(nodes, vec!["n-003", "n-004", "n-005"]);
    }

    #[test]
    fn same_rack_required_is_honoured_or_the_job_waits() {
        let job = MakeJob::new(1)
            .gpus(8)
            .tasks(3)
            .same_rack(TopologyStrength::Required)
            .build();
        let outcome = cycle(
            &snapshot(make_nodes("n", 4, 2)),
            std::slice::from_ref(&job),
            &SchedulingPolicy::default(),
        );
        match reason(&outcome, 1) {
            PendingReason::NoCapacity {
                gang:
                    Some(GangFailure::NoRackLargeEnough {
                        largest_rack: 2,
                        needed: 3,
                    }),
                ..
            } => {}
            other => panic!("unexpected {other:?}"),
        }
        let preferred = MakeJob::new(1)
            .gpus(8)
            .tasks(3)
            .same_rack(TopologyStrength::Preferred)
            .build();
        let outcome = cycle(
            &snapshot(make_nodes("n", 4, 2)),
            &[preferred],
            &SchedulingPolicy::default(),
        );
        assert_eq!(started(&outcome, 1).len(), 3);
    }

    #[test]
    fn a_task_takes_gpus_from_one_nvlink_domain() {
        let node = MakeNode::new("n")
            .gpus(8, "H100-80GB")
            .nvlink_domains_of(4)
            .build();
        let jobs = vec![
            MakeJob::new(1).gpus(2).build(),
            MakeJob::new(2).gpus(4).build(),
        ];
        let outcome = cycle(
            &snapshot(vec![node]),
            &jobs,
            &SchedulingPolicy {
                placement: PlacementPolicy::BestFit,
                ..SchedulingPolicy::default()
            },
        );
        let second: Vec<u32> = started(&outcome, 2)[0].gpus.iter().map(|g| g.0).collect();
        assert_eq!(
            second,
            vec![4, 5, 6, 7],
            "domain 0 has only 2 free whole GPUs"
        );
    }
}

mod queues {
    use super::*;

    fn queue(name: &str, guaranteed: u32, borrow: Option<u32>, weight: u32) -> QueueSpec {
        QueueSpec {
            name: QueueName::from(name),
            guaranteed: GpuMilli::whole(guaranteed),
            borrow_limit: borrow.map(GpuMilli::whole),
            weight,
            idle_timeout: None,
            idle_after: None,
            idle_below_pct: None,
            budget: None,
            members_see_jobs: false,
            max_pending: None,
            max_priority_class: None,
            allow_non_preemptible: false,
        }
    }

    #[test]
    fn a_queue_at_its_ceiling_waits_with_a_quota_reason() {
        let mut snap = snapshot(make_nodes("n", 2, 2));
        snap.queues = vec![queue("team", 4, Some(4), 1)];
        let jobs = vec![
            MakeJob::new(1).queue("team").gpus(8).build(),
            MakeJob::new(2).queue("team").gpus(1).build(),
        ];
        let outcome = cycle(&snap, &jobs, &SchedulingPolicy::default());
        started(&outcome, 1);
        assert!(matches!(
            reason(&outcome, 2),
            PendingReason::QuotaExceeded { .. }
        ));
    }

    #[test]
    fn fair_share_serves_the_queue_that_used_less() {
        let mut snap = snapshot(make_nodes("n", 1, 1));
        snap.queues = vec![queue("heavy", 0, None, 1), queue("light", 0, None, 1)];
        snap.usage.insert(QueueName::from("heavy"), 1e6);
        let jobs = vec![
            MakeJob::new(1).queue("heavy").gpus(8).build(),
            MakeJob::new(2)
                .queue("light")
                .gpus(8)
                .submitted_secs(10)
                .build(),
        ];
        let outcome = cycle(&snap, &jobs, &SchedulingPolicy::default());
        started(&outcome, 2);
        assert_eq!(outcome.order, vec![JobId(2), JobId(1)]);
    }

    #[test]
    fn weights_scale_fair_share() {
        let mut snap = snapshot(make_nodes("n", 1, 1));
        snap.queues = vec![queue("a", 0, None, 1), queue("b", 0, None, 4)];
        snap.usage.insert(QueueName::from("a"), 100.0);
        snap.usage.insert(QueueName::from("b"), 300.0);
        let jobs = vec![
            MakeJob::new(1).queue("a").gpus(8).build(),
            MakeJob::new(2).queue("b").gpus(8).build(),
        ];
        let outcome = cycle(&snap, &jobs, &SchedulingPolicy::default());
        started(&outcome, 2);
    }

    #[test]
    fn higher_priority_goes_first_and_aging_prevents_starvation() {
        let mut snap = snapshot(make_nodes("n", 1, 1));
        let policy = SchedulingPolicy {
            preemption: false,
            ..SchedulingPolicy::default()
        };
        // A low job (0) against a normal one (100) submitted just now: after
        // 50 minutes the low job has gained 50 points, not enough.
        snap.now = Time::from_secs(3000);
        let jobs = vec![
            MakeJob::new(1).priority(0).gpus(8).build(),
            MakeJob::new(2)
                .priority(100)
                .gpus(8)
                .submitted_secs(3000)
                .build(),
        ];
        assert_eq!(cycle(&snap, &jobs, &policy).order[0], JobId(2));
        // After 110 minutes it has gained 110 and overtakes.
        snap.now = Time::from_secs(6600);
        let jobs = vec![
            MakeJob::new(1).priority(0).gpus(8).build(),
            MakeJob::new(2)
                .priority(100)
                .gpus(8)
                .submitted_secs(6600)
                .build(),
        ];
        let outcome = cycle(&snap, &jobs, &policy);
        assert_eq!(outcome.order[0], JobId(1));
        started(&outcome, 1);
    }
}

mod preemption {
    use super::*;

    fn occupied(jobs: &[(u64, i32, &str, u64)]) -> Snapshot {
        // (id, priority, node, started secs): each holds all 8 GPUs of node.
        let names: Vec<&str> = jobs.iter().map(|j| j.2).collect();
        let mut snap = snapshot(names.iter().map(|n| MakeNode::new(n).build()).collect());
        snap.now = Time::from_secs(10_000);
        for &(id, priority, node, started) in jobs {
            let job = MakeJob::new(id).priority(priority).gpus(8).build();
            snap.running.push(running_from(
                &job,
                vec![Allocation {
                    node: NodeName::from(node),
                    gpus: (0..8).map(|i| (i, 1000)).collect(),
                    cpu: muster_model::CpuMilli(1000),
                    memory: muster_model::MemoryMib(1024),
                }],
                Time::from_secs(started),
                None,
            ));
        }
        snap
    }

    #[test]
    fn the_cheapest_victim_is_chosen() {
        // Both low priority; job 11 started later, so it loses less work.
        let snap = occupied(&[(10, 0, "a", 0), (11, 0, "b", 9000), (12, 100, "c", 9500)]);
        let outcome = cycle(
            &snap,
            &[MakeJob::new(1).priority(200).gpus(8).build()],
            &SchedulingPolicy::default(),
        );
        assert_eq!(outcome.preemptions.len(), 1);
        assert_eq!(outcome.preemptions[0].victim, JobId(11));
        assert_eq!(outcome.preemptions[0].cause, PreemptionCause::Priority);
        assert_eq!(node_of(&outcome, 1), "b");
    }

    #[test]
    fn equal_priority_never_preempts() {
        let snap = occupied(&[(10, 100, "a", 0)]);
        let outcome = cycle(
            &snap,
            &[MakeJob::new(1).priority(100).gpus(8).build()],
            &SchedulingPolicy::default(),
        );
        assert!(outcome.preemptions.is_empty());
    }

    #[test]
    fn no_preemption_when_it_would_not_make_the_job_placeable() {
        let snap = occupied(&[(10, 0, "a", 0), (11, 200, "b", 0)]);
        // Needs two nodes; only one holds a lower-priority job.
        let outcome = cycle(
            &snap,
            &[MakeJob::new(1).priority(100).gpus(8).tasks(2).build()],
            &SchedulingPolicy::default(),
        );
        assert!(outcome.preemptions.is_empty());
    }

    #[test]
    fn quota_reclaim_takes_back_a_guarantee_from_a_borrower() {
        let mut snap = occupied(&[(10, 100, "a", 0), (11, 100, "b", 0)]);
        for running in &mut snap.running {
            running.queue = QueueName::from("borrower");
        }
        snap.queues = vec![
            QueueSpec {
                name: QueueName::from("owner"),
                guaranteed: GpuMilli::whole(8),
                borrow_limit: None,
                weight: 1,
                idle_timeout: None,
                idle_after: None,
                idle_below_pct: None,
                budget: None,
                members_see_jobs: false,
                max_pending: None,
                max_priority_class: None,
                allow_non_preemptible: false,
            },
            QueueSpec::best_effort("borrower"),
        ];
        let job = MakeJob::new(1).queue("owner").priority(100).gpus(8).build();
        let outcome = cycle(&snap, &[job], &SchedulingPolicy::default());
        assert_eq!(outcome.preemptions.len(), 1);
        assert_eq!(outcome.preemptions[0].cause, PreemptionCause::QuotaReclaim);
        started(&outcome, 1);
    }

    #[test]
    fn a_queue_within_its_guarantee_is_protected_from_other_queues() {
        let mut snap = occupied(&[(10, 0, "a", 0)]);
        snap.running[0].queue = QueueName::from("owner");
        snap.queues = vec![
            QueueSpec {
                name: QueueName::from("owner"),
                guaranteed: GpuMilli::whole(8),
                borrow_limit: None,
                weight: 1,
                idle_timeout: None,
                idle_after: None,
                idle_below_pct: None,
                budget: None,
                members_see_jobs: false,
                max_pending: None,
                max_priority_class: None,
                allow_non_preemptible: false,
            },
            QueueSpec::best_effort("other"),
        ];
        let job = MakeJob::new(1).queue("other").priority(300).gpus(8).build();
        let outcome = cycle(&snap, &[job], &SchedulingPolicy::default());
        assert!(outcome.preemptions.is_empty());
    }
}

mod inference_pools {
    use super::*;
    use muster_sched::ReservedAccess;

    #[test]
    fn only_services_and_preemptible_work_go_to_an_inference_pool() {
        let nodes = vec![MakeNode::new("serve").inference().build()];
        let jobs = [
            MakeJob::new(1).gpus(2).build(),
            MakeJob::new(2)
                .gpus(2)
                .reserved(ReservedAccess::Borrow)
                .build(),
            MakeJob::new(3)
                .gpus(2)
                .reserved(ReservedAccess::Service)
                .build(),
        ];
        let outcome = cycle(&snapshot(nodes), &jobs, &SchedulingPolicy::default());
        let why = reason(&outcome, 1).to_string();
        assert!(why.contains("inference pool"), "{why}");
        started(&outcome, 2);
        started(&outcome, 3);
    }

    #[test]
    fn a_service_takes_back_its_pool_from_a_borrower_whatever_its_queue() {
        // A borrower from a queue well within its guarantee, at a higher
        // priority than the replica: still preempted, for the pool's owner.
        // (The engine sees it borrows: no service, on an inference node.)
        let mut snap = snapshot(vec![MakeNode::new("serve").inference().build()]);
        snap.now = Time::from_secs(100);
        let borrower = MakeJob::new(10)
            .queue("training")
            .priority(500)
            .gpus(8)
            .reserved(ReservedAccess::Borrow)
            .build();
        let running = running_from(
            &borrower,
            vec![Allocation {
                node: NodeName::from("serve"),
                gpus: (0..8).map(|i| (i, 1000)).collect(),
                cpu: muster_model::CpuMilli(1000),
                memory: muster_model::MemoryMib(1024),
            }],
            Time::from_secs(0),
            None,
        );
        snap.running.push(running);
        snap.queues = vec![
            QueueSpec {
                guaranteed: GpuMilli::whole(64),
                ..QueueSpec::best_effort("training")
            },
            QueueSpec::best_effort("serving"),
        ];
        let replica = MakeJob::new(1)
            .queue("serving")
            .priority(100)
            .gpus(1)
            .reserved(ReservedAccess::Service)
            .build();
        let outcome = cycle(
            &snap,
            std::slice::from_ref(&replica),
            &SchedulingPolicy::default(),
        );
        assert_eq!(outcome.preemptions.len(), 1, "{outcome:#?}");
        assert_eq!(outcome.preemptions[0].victim, JobId(10));
        assert_eq!(outcome.preemptions[0].cause, PreemptionCause::Borrowed);
        started(&outcome, 1);
        // The same job on a node of a general pool is not a borrower: the
        // replica waits.
        snap.nodes = vec![MakeNode::new("serve").build()];
        let outcome = cycle(&snap, &[replica], &SchedulingPolicy::default());
        assert!(outcome.preemptions.is_empty());
        reason(&outcome, 1);
    }
}

mod backfill {
    use super::*;

    /// Two nodes; node a busy until t=1000 s, node b free. A 2-node job is
    /// blocked and reserves both; a short job may run on b, a long one not.
    fn blocked() -> Snapshot {
        let mut snap = snapshot(vec![MakeNode::new("a").build(), MakeNode::new("b").build()]);
        let busy = MakeJob::new(10).gpus(8).build();
        snap.running.push(running_from(
            &busy,
            vec![Allocation {
                node: NodeName::from("a"),
                gpus: (0..8).map(|i| (i, 1000)).collect(),
                cpu: muster_model::CpuMilli(1000),
                memory: muster_model::MemoryMib(1024),
            }],
            Time(0),
            Some(Time::from_secs(1000)),
        ));
        snap
    }

    fn policy(backfill: Backfill) -> SchedulingPolicy {
        SchedulingPolicy {
            backfill,
            preemption: false,
            ..SchedulingPolicy::default()
        }
    }

    #[test]
    fn easy_backfill_lets_short_jobs_pass_but_not_long_ones() {
        let jobs = vec![
            MakeJob::new(1).gpus(8).tasks(2).build(),
            MakeJob::new(2)
                .gpus(8)
                .estimate_secs(3600)
                .submitted_secs(1)
                .build(),
            MakeJob::new(3)
                .gpus(8)
                .estimate_secs(500)
                .submitted_secs(2)
                .build(),
        ];
        let outcome = cycle(&blocked(), &jobs, &policy(Backfill::Easy));
        assert_eq!(
            reason(&outcome, 1),
            &PendingReason::HoldsReservation {
                start: Some(Time::from_secs(1000))
            }
        );
        assert!(matches!(
            reason(&outcome, 2),
            PendingReason::BehindReservation {
                holder: JobId(1),
                ..
            }
        ));
        assert_eq!(node_of(&outcome, 3), "b");
    }

    #[test]
    fn without_backfill_nothing_passes_a_blocked_job() {
        let jobs = vec![
            MakeJob::new(1).gpus(8).tasks(2).build(),
            MakeJob::new(3)
                .gpus(8)
                .estimate_secs(500)
                .submitted_secs(2)
                .build(),
        ];
        let outcome = cycle(&blocked(), &jobs, &policy(Backfill::None));
        assert_eq!(
            reason(&outcome, 3),
            &PendingReason::BehindBlockedJob { blocker: JobId(1) }
        );
        let outcome = cycle(&blocked(), &jobs, &policy(Backfill::AnyFit));
        started(&outcome, 3);
    }
}

mod policies {
    use super::*;

    #[test]
    fn best_fit_and_packing_fill_the_fuller_node() {
        let mut snap = snapshot(vec![MakeNode::new("a").build(), MakeNode::new("b").build()]);
        let busy = MakeJob::new(10).gpus(4).build();
        snap.running.push(running_from(
            &busy,
            vec![Allocation {
                node: NodeName::from("b"),
                gpus: (0..4).map(|i| (i, 1000)).collect(),
                cpu: muster_model::CpuMilli(1000),
                memory: muster_model::MemoryMib(1024),
            }],
            Time(0),
            None,
        ));
        for placement in [PlacementPolicy::BestFit, PlacementPolicy::Packing] {
            let outcome = cycle(
                &snap,
                &[MakeJob::new(1).gpus(2).build()],
                &SchedulingPolicy {
                    placement,
                    ..SchedulingPolicy::default()
                },
            );
            assert_eq!(node_of(&outcome, 1), "b", "{placement}");
        }
    }

    /// Nodes of equal score go to the first in the cluster's order: the
    /// smallest name, or the order `reordered` gives (a seeded random one
    /// in the published simulator's protocol); each node keeps its state.
    #[test]
    fn ties_go_to_the_first_node_in_the_cluster_order() {
        use muster_sched::{
            ClusterState, NodeInput, Placer, Scale, Scorer, TaskShape, TypicalWorkload, seeded_rank,
        };
        let nodes: Vec<NodeInput> = ["a", "b", "c"]
            .iter()
            .map(|name| MakeNode::new(name).gpus(8, "H100").build())
            .collect();
        let mut cluster = ClusterState::new(nodes).unwrap();
        let shape = TaskShape {
            container: false,
            gpus: muster_model::GpuRequest::Whole(1),
            cpu_milli: 1000,
            memory_mib: 1024,
            models: muster_sched::ModelMask::ANY,
            pool: None,
            min_gpu_memory_mib: 0,
            reserved: Default::default(),
        };
        // "b" is half full: best-fit prefers it whatever the order.
        cluster.free[1].gpu[..4].fill(0);
        let first = |cluster: ClusterState, policy: PlacementPolicy| {
            let workload = TypicalWorkload::from_tasks([shape].iter(), 0.95);
            let scorer = Scorer::new(policy, workload, Scale::of(&cluster));
            let mut placer = Placer::new(cluster.clone(), scorer);
            let placement = placer
                .place(&shape, &|_| false, &mut ChaCha8Rng::seed_from_u64(0))
                .expect("placed");
            cluster.nodes[placement.node as usize].name.0.clone()
        };
        // Random placement aside, every policy ties "a" and "c" (empty).
        let reversed = cluster.reordered(|name| std::cmp::Reverse(name.clone()));
        assert_eq!(
            reversed
                .nodes
                .iter()
                .map(|n| n.name.0.as_str())
                .collect::<Vec<_>>(),
            ["c", "b", "a"]
        );
        assert_eq!(reversed.free[1].gpu[..4], [0, 0, 0, 0], "b keeps its state");
        assert_eq!(reversed.node_index(&NodeName::from("a")), Some(2));
        assert_eq!(first(cluster.clone(), PlacementPolicy::BestFit), "b");
        assert_eq!(first(reversed.clone(), PlacementPolicy::BestFit), "b");
        cluster.free[1].gpu.fill(0);
        let reversed = cluster.reordered(|name| std::cmp::Reverse(name.clone()));
        for policy in [PlacementPolicy::Fgd, PlacementPolicy::BestFit] {
            assert_eq!(first(cluster.clone(), policy), "a", "{policy}");
            assert_eq!(first(reversed.clone(), policy), "c", "{policy}");
        }
        // A seeded order is the same for a seed and differs between seeds.
        let order = |seed: u64| {
            let mut names: Vec<&str> = vec!["n0", "n1", "n2", "n3", "n4", "n5", "n6", "n7"];
            names.sort_by_key(|name| seeded_rank(seed, &NodeName::from(*name)));
            names.join(",")
        };
        assert_eq!(order(3), order(3));
        assert!((0..8).any(|seed| order(seed) != order(3)));
    }

    #[test]
    fn policy_names_parse() {
        for policy in PlacementPolicy::ALL {
            assert_eq!(policy.name().parse::<PlacementPolicy>(), Ok(policy));
        }
        assert_eq!(
            "default".parse::<PlacementPolicy>(),
            Ok(PlacementPolicy::DEFAULT)
        );
        let error = "tetris".parse::<PlacementPolicy>().unwrap_err().to_string();
        assert!(
            error.contains("accepted: fgd-consolidate, fgd, best-fit"),
            "{error}"
        );
    }
}

mod wording {
    use super::*;

    #[test]
    fn pending_reasons_read_as_sentences() {
        let outcome = cycle(
            &snapshot(make_nodes("n", 2, 2)),
            &[
                MakeJob::new(1).gpus(8).tasks(3).build(),
                MakeJob::new(2).gpus(16).build(),
            ],
            &SchedulingPolicy::default(),
        );
        let text = reason(&outcome, 1).to_string();
        assert!(
            text.contains("needs 3 nodes, and only 2 nodes could ever hold one of its tasks"),
            "{text}"
        );
        let text = reason(&outcome, 2).to_string();
        assert!(text.contains("only 0 nodes could hold one task"), "{text}");
        assert!(text.contains("2 have too few free GPUs"), "{text}");
    }
}

/// Nodes the engine cannot take, nodes mixing GPU models, many models.
mod odd_nodes {
    use super::*;
    use common::{check_real_nodes, mixed_node};
    use muster_model::{CpuMilli, MemoryMib};
    use muster_sched::ClusterState;

    fn checked(snapshot: &Snapshot, pending: &[PendingJob], policy: &SchedulingPolicy) -> Outcome {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let outcome = schedule(snapshot, pending, policy, &mut rng).expect("never fails");
        if let Err(violation) = check_real_nodes(snapshot, pending, &outcome) {
            panic!("invariant violated: {violation}\n{outcome:#?}");
        }
        outcome
    }

    fn model(k: usize) -> String {
        format!("MODEL-{k:02}")
    }

    /// One 65-GPU node, a duplicate name, GPU indices with a gap, one node
    /// mixing models and 70 one-model nodes of 70 distinct models.
    fn odd_cluster() -> Vec<muster_sched::NodeInput> {
        let mut nodes = vec![
            MakeNode::new("a-h100").build(),
            MakeNode::new("gpu-9").gpus(65, "H100-80GB").build(),
            mixed_node("mixed", &["A100", "L4", "A100", "L4"]),
        ];
        // A second "a-h100" listed later: the first is kept.
        nodes.push(MakeNode::new("a-h100").gpus(2, "T4").build());
        let mut gap = MakeNode::new("bad-index").gpus(2, "H100-80GB").build();
        gap.spec.gpus[1].index = 2;
        nodes.push(gap);
        for k in 0..70 {
            nodes.push(
                MakeNode::new(&format!("m-{k:02}"))
                    .gpus(1, &model(k))
                    .build(),
            );
        }
        nodes
    }

    #[test]
    fn bad_nodes_are_left_out_and_the_rest_of_the_cycle_runs() {
        let snap = snapshot(odd_cluster());
        let mut jobs: Vec<PendingJob> = (0..70)
            .map(|k| MakeJob::new(k as u64).models(&[&model(k)]).build())
            .collect();
        jobs.push(MakeJob::new(100).gpus(8).models(&["H100-80GB"]).build());
        jobs.push(MakeJob::new(101).gpus(2).models(&["L4"]).build());
        jobs.push(MakeJob::new(102).gpus(2).models(&["A100"]).build());
        let outcome = checked(&snap, &jobs, &SchedulingPolicy::default());
        for k in 0..70 {
            assert_eq!(node_of(&outcome, k as u64), format!("m-{k:02}"), "job {k}");
        }
        assert_eq!(started(&outcome, 100)[0].node, NodeName::from("a-h100"));
        assert_eq!(started(&outcome, 101)[0].gpus, vec![(1, 1000), (3, 1000)]);
        assert_eq!(started(&outcome, 102)[0].gpus, vec![(0, 1000), (2, 1000)]);
        assert_eq!(
            outcome.excluded_nodes,
            vec![
                (
                    NodeName::from("a-h100"),
                    "node a-h100 appears more than once; the scheduler takes the first".to_string()
                ),
                (
                    NodeName::from("bad-index"),
                    "node bad-index lists GPU index 2 at position 1; GPUs must be listed by \
                     index from 0 without gaps"
                        .to_string()
                ),
                (
                    NodeName::from("gpu-9"),
                    "node gpu-9 has 65 GPUs; the scheduler takes at most 64 per node".to_string()
                ),
            ]
        );
        let cluster = ClusterState::build(&snap.nodes);
        assert_eq!(cluster.excluded_nodes, outcome.excluded_nodes);
        assert_eq!(cluster.models.len(), 73, "H100, A100, L4 and 70 more");
    }

    #[test]
    fn jobs_without_a_model_land_anywhere_among_many_models() {
        let snap = snapshot(odd_cluster());
        // 1 + 2 + 70 GPUs on healthy nodes (a-h100 has 8): 80 one-GPU jobs fit.
        let jobs: Vec<PendingJob> = (0..80).map(|id| MakeJob::new(id).build()).collect();
        let outcome = checked(&snap, &jobs, &SchedulingPolicy::default());
        assert_eq!(outcome.started.len(), 80, "{:#?}", outcome.pending);
        let on: BTreeSet<String> = outcome
            .started
            .iter()
            .map(|s| s.tasks[0].node.0.clone())
            .collect();
        assert!(on.contains("mixed") && on.contains("m-69") && on.contains("a-h100"));
        assert!(!on.contains("gpu-9") && !on.contains("bad-index"));
        // A model no node has fits nowhere, a list of two fits either.
        let jobs = vec![
            MakeJob::new(1).models(&["B200"]).build(),
            MakeJob::new(2)
                .gpus(1)
                .models(&["B200", &model(42)])
                .build(),
        ];
        let outcome = checked(&snap, &jobs, &SchedulingPolicy::default());
        assert!(matches!(
            reason(&outcome, 1),
            PendingReason::NeverFits { .. }
        ));
        assert_eq!(node_of(&outcome, 2), "m-42");
    }

    #[test]
    fn a_mixed_node_runs_each_model_on_its_own_gpus() {
        // GPUs 0, 2, 4 are A100; 1, 3, 5 are L4. A running job holds L4 GPU 3.
        let mut snap = snapshot(vec![mixed_node(
            "mixed",
            &["A100", "L4", "A100", "L4", "A100", "L4"],
        )]);
        let busy = MakeJob::new(50).build();
        snap.running.push(running_from(
            &busy,
            vec![Allocation {
                node: NodeName::from("mixed"),
                gpus: vec![(3, 1000)],
                cpu: CpuMilli(1000),
                memory: MemoryMib(1024),
            }],
            Time(0),
            None,
        ));
        let jobs = vec![
            MakeJob::new(1).gpus(2).models(&["L4"]).build(),
            MakeJob::new(2).gpus(3).models(&["A100"]).build(),
            MakeJob::new(3).gpus(1).models(&["L4"]).build(),
        ];
        let outcome = checked(&snap, &jobs, &SchedulingPolicy::default());
        assert_eq!(started(&outcome, 1)[0].gpus, vec![(1, 1000), (5, 1000)]);
        assert_eq!(
            started(&outcome, 2)[0].gpus,
            vec![(0, 1000), (2, 1000), (4, 1000)]
        );
        assert!(outcome.pending.contains_key(&JobId(3)), "{outcome:#?}");
        // Shares, too, land on the right model's GPUs.
        let jobs = vec![MakeJob::new(4).share(500).models(&["A100"]).build()];
        let outcome = checked(
            &snapshot(snap.nodes.clone()),
            &jobs,
            &SchedulingPolicy::default(),
        );
        let gpus = &started(&outcome, 4)[0].gpus;
        assert!([0, 2, 4].contains(&gpus[0].0), "{gpus:?}");
    }

    #[test]
    fn a_mixed_node_never_over_commits_cpu_or_memory() {
        // 64 CPUs and 512 GiB over 4 A100 + 4 L4: 32 CPUs and 256 GiB each.
        let node = || {
            mixed_node(
                "mixed",
                &["A100", "A100", "A100", "A100", "L4", "L4", "L4", "L4"],
            )
        };
        let jobs = vec![
            MakeJob::new(1)
                .models(&["A100"])
                .cpus(30)
                .memory_gib(200)
                .build(),
            MakeJob::new(2)
                .models(&["L4"])
                .cpus(30)
                .memory_gib(200)
                .build(),
            MakeJob::new(3).models(&["A100"]).cpus(30).build(),
            MakeJob::new(4).gpus(0).cpus(4).memory_gib(100).build(),
        ];
        let outcome = checked(&snapshot(vec![node()]), &jobs, &SchedulingPolicy::default());
        started(&outcome, 1);
        started(&outcome, 2);
        assert!(outcome.pending.contains_key(&JobId(3)), "{outcome:#?}");
        // A running CPU-only job of 40 CPUs fills the first sub-node (32) and
        // spills 8 onto the second: only 24 CPUs are left with the L4s, none
        // with the A100s.
        let mut snap = snapshot(vec![node()]);
        let cpu_job = MakeJob::new(60).gpus(0).cpus(40).build();
        snap.running.push(running_from(
            &cpu_job,
            vec![Allocation {
                node: NodeName::from("mixed"),
                gpus: Vec::new(),
                cpu: CpuMilli(40_000),
                memory: MemoryMib(1024),
            }],
            Time(0),
            None,
        ));
        let jobs = vec![
            MakeJob::new(1).models(&["A100"]).cpus(1).build(),
            MakeJob::new(2).models(&["L4"]).cpus(25).build(),
            MakeJob::new(3).models(&["L4"]).cpus(24).build(),
            MakeJob::new(4).gpus(0).cpus(1).build(),
        ];
        let outcome = checked(
            &snap,
            &jobs,
            &SchedulingPolicy {
                preemption: false,
                ..SchedulingPolicy::default()
            },
        );
        assert!(outcome.pending.contains_key(&JobId(1)), "{outcome:#?}");
        assert!(outcome.pending.contains_key(&JobId(2)), "{outcome:#?}");
        started(&outcome, 3);
        assert!(outcome.pending.contains_key(&JobId(4)), "{outcome:#?}");
    }

    #[test]
    fn a_gang_never_gets_two_tasks_on_one_node() {
        let mixed = || mixed_node("mixed", &["A100", "A100", "L4", "L4"]);
        let gang = || vec![MakeJob::new(1).gpus(2).tasks(2).build()];
        // One real node with two sub-nodes that each fit a task: never fits.
        let outcome = checked(
            &snapshot(vec![mixed()]),
            &gang(),
            &SchedulingPolicy::default(),
        );
        let PendingReason::NeverFits { filters, .. } = reason(&outcome, 1) else {
            panic!("{:?}", reason(&outcome, 1));
        };
        assert_eq!(filters.could_ever_fit, 1);
        // With a second node it spans the two.
        let nodes = vec![mixed(), MakeNode::new("plain").gpus(2, "L4").build()];
        let outcome = checked(&snapshot(nodes), &gang(), &SchedulingPolicy::default());
        let mut on: Vec<&str> = started(&outcome, 1)
            .iter()
            .map(|t| t.node.0.as_str())
            .collect();
        on.sort_unstable();
        assert_eq!(on, ["mixed", "plain"]);
    }

    #[test]
    fn reservations_and_victims_name_real_nodes() {
        let mut snap = snapshot(vec![
            mixed_node("mixed", &["A100", "A100", "L4", "L4"]),
            MakeNode::new("plain").gpus(2, "L4").build(),
        ]);
        snap.now = Time::from_secs(100);
        let low = MakeJob::new(70).priority(0).gpus(2).build();
        for (id, node, gpus) in [(70, "mixed", vec![2, 3]), (71, "plain", vec![0, 1])] {
            let mut job = running_from(
                &MakeJob::new(id).priority(0).gpus(2).build(),
                vec![Allocation {
                    node: NodeName::from(node),
                    gpus: gpus.iter().map(|&i| (i, 1000)).collect(),
                    cpu: CpuMilli(1000),
                    memory: MemoryMib(1024),
                }],
                Time(0),
                Some(Time::from_secs(1000 + id)),
            );
            job.id = JobId(id);
            job.priority = low.priority;
            snap.running.push(job);
        }
        // Two L4 tasks: blocked; a reservation on both real nodes.
        let gang = vec![
            MakeJob::new(1)
                .gpus(2)
                .tasks(2)
                .models(&["L4"])
                .priority(0)
                .build(),
        ];
        let policy = SchedulingPolicy {
            preemption: false,
            ..SchedulingPolicy::default()
        };
        let outcome = checked(&snap, &gang, &policy);
        let reservation = outcome.reservation.expect("a reservation");
        let mut reserved = reservation.nodes.clone();
        reserved.sort();
        assert_eq!(
            reserved,
            vec![NodeName::from("mixed"), NodeName::from("plain")]
        );
        // A higher priority preempts both, and starts on the L4 GPUs 2 and 3.
        let gang = vec![
            MakeJob::new(2)
                .gpus(2)
                .tasks(2)
                .models(&["L4"])
                .priority(200)
                .build(),
        ];
        let outcome = checked(&snap, &gang, &SchedulingPolicy::default());
        let victims: BTreeSet<JobId> = outcome.preemptions.iter().map(|p| p.victim).collect();
        assert_eq!(victims, BTreeSet::from([JobId(70), JobId(71)]));
        let tasks = started(&outcome, 2);
        let on_mixed = tasks
            .iter()
            .find(|task| task.node == NodeName::from("mixed"))
            .expect("a task on the mixed node");
        assert_eq!(on_mixed.gpus, vec![(2, 1000), (3, 1000)]);
        assert!(
            tasks
                .iter()
                .any(|task| task.node == NodeName::from("plain"))
        );
    }
}

mod spreading {
    use super::*;

    #[test]
    fn replicas_of_one_service_go_to_different_nodes_in_one_cycle() {
        // Without spreading, both would pack onto the first node.
        let nodes = make_nodes("n", 3, 3);
        let jobs: Vec<PendingJob> = (1..=3)
            .map(|id| {
                MakeJob::new(id)
                    .gpus(1)
                    .apart("web", &[], false, false)
                    .build()
            })
            .collect();
        let outcome = cycle(&snapshot(nodes), &jobs, &SchedulingPolicy::default());
        let used: BTreeSet<String> = (1..=3).map(|id| node_of(&outcome, id)).collect();
        assert_eq!(used.len(), 3, "{outcome:#?}");
    }

    #[test]
    fn a_replica_goes_with_another_only_when_no_other_node_has_room() {
        let nodes = make_nodes("n", 2, 2);
        let replica = MakeJob::new(1)
            .gpus(1)
            .apart("web", &["n-000"], false, false)
            .build();
        let outcome = cycle(
            &snapshot(nodes.clone()),
            &[replica],
            &SchedulingPolicy::default(),
        );
        assert_eq!(node_of(&outcome, 1), "n-001");
        // Both nodes hold a replica: a soft spread shares one, a required
        // one (a fixed port) waits and says why.
        let soft = MakeJob::new(2)
            .gpus(1)
            .apart("web", &["n-000", "n-001"], false, false)
            .build();
        let outcome = cycle(
            &snapshot(nodes.clone()),
            &[soft],
            &SchedulingPolicy::default(),
        );
        started(&outcome, 2);
        let hard = MakeJob::new(3)
            .gpus(1)
            .apart("web", &["n-000", "n-001"], false, true)
            .build();
        let outcome = cycle(&snapshot(nodes), &[hard], &SchedulingPolicy::default());
        assert_eq!(reason(&outcome, 3).code(), "capacity");
    }

    #[test]
    fn rack_spreading_prefers_a_rack_without_a_replica() {
        // Racks of two: n-000 and n-001 in the first, n-002 and n-003 in the
        // second. A replica on n-000 sends the next to the second rack.
        let nodes = make_nodes("n", 4, 2);
        let replica = MakeJob::new(1)
            .gpus(1)
            .apart("web", &["n-000"], true, false)
            .build();
        let outcome = cycle(&snapshot(nodes), &[replica], &SchedulingPolicy::default());
        let node = node_of(&outcome, 1);
        assert!(node == "n-002" || node == "n-003", "{node}");
    }
}
