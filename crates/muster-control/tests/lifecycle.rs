//! Job lifecycles through the control plane, with invariants after every step.

use muster_control::{
    AllocationState, ControlConfig, ControlPlane, DesiredTask, Input, JobState, Observed, Software,
};
use muster_model::{GpuRequest, JobId, JobSpec, NodeName, Time};
use muster_sched::{SchedulingPolicy, schedule};
use muster_testkit::MakeNode;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

struct World {
    control: ControlPlane,
    now: Time,
}

impl World {
    fn new(nodes: &[&str]) -> Self {
        let mut world = World {
            control: ControlPlane::new(ControlConfig::default()),
            now: Time(1_000),
        };
        for (i, name) in nodes.iter().enumerate() {
            world.step(Input::Register {
                spec: MakeNode::new(name).gpus(4, "H100-80GB").build().spec,
                address: format!("10.0.0.{}", i + 1),
                software: Software::default(),
            });
        }
        world
    }

    fn step(&mut self, input: Input) {
        self.control
            .handle(self.now, input)
            .expect("input accepted");
        self.control.check_invariants().expect("invariants hold");
    }

    fn submit(&mut self, id: u64, nodes: u32, gpus: u32) {
        let mut spec = JobSpec::simple(
            "job",
            "default",
            GpuRequest::Whole(gpus),
            vec!["true".into()],
        );
        spec.nodes = nodes;
        self.step(Input::Submit {
            id: JobId(id),
            spec,
            user: "alice".into(),
        });
    }

    fn cycle(&mut self) {
        let outcome = self.outcome();
        self.control.apply_outcome(self.now, &outcome);
        self.control.check_invariants().expect("invariants hold");
    }

    /// What a scheduling cycle would decide now, not yet applied.
    fn outcome(&self) -> muster_sched::Outcome {
        let (snapshot, pending) = self.control.scheduling_input(self.now);
        schedule(
            &snapshot,
            &pending,
            &SchedulingPolicy::default(),
            &mut ChaCha8Rng::seed_from_u64(1),
        )
        .expect("valid cluster")
    }

    fn desired(&self, node: &str) -> Vec<DesiredTask> {
        self.control.desired(&NodeName::from(node))
    }

    fn report(&mut self, node: &str, observed: Vec<Observed>) {
        self.report_numbered(node, 0, observed);
    }

    fn report_numbered(&mut self, node: &str, sequence: u64, observed: Vec<Observed>) {
        let epoch = self.epoch(node);
        self.step(Input::Heartbeat {
            node: NodeName::from(node),
            epoch,
            sequence,
            observed,
            unhealthy: None,
        });
    }

    fn epoch(&self, node: &str) -> u64 {
        self.control
            .node(&NodeName::from(node))
            .expect("present")
            .epoch
    }

    fn allocation_state(&self, task: &DesiredTask) -> AllocationState {
        self.control
            .allocation(task.allocation)
            .expect("present")
            .state
    }

    fn job(&self, id: u64) -> &muster_control::Job {
        self.control.job(JobId(id)).expect("present")
    }

    fn state(&self, id: u64) -> JobState {
        self.job(id).state
    }

    fn advance(&mut self, millis: u64) {
        self.now = self.now.plus_millis(millis);
    }
}

fn running(task: &DesiredTask) -> Observed {
    Observed {
        allocation: task.allocation,
        generation: task.generation,
        exited: None,
        fenced: false,
        memory_limit: false,
    }
}

fn exited(task: &DesiredTask, code: i32) -> Observed {
    Observed {
        exited: Some(Some(code)),
        ..running(task)
    }
}

#[test]
fn a_job_runs_and_succeeds() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 2);
    world.cycle();
    let tasks = world.desired("a");
    assert_eq!(tasks.len(), 1);
    assert_eq!(tasks[0].gpus.len(), 2);
    assert_eq!(tasks[0].env["MUSTER_JOB_ID"], "1");
    world.report("a", vec![running(&tasks[0])]);
    assert_eq!(world.state(1), JobState::Running);
    world.report("a", vec![exited(&tasks[0], 0)]);
    assert_eq!(world.state(1), JobState::Succeeded);
    assert!(world.desired("a").is_empty());
}

#[test]
fn a_gang_gets_one_consistent_environment() {
    let mut world = World::new(&["a", "b", "c"]);
    world.submit(7, 2, 4);
    world.cycle();
    let mut tasks: Vec<DesiredTask> = ["a", "b", "c"]
        .iter()
        .flat_map(|n| world.desired(n))
        .collect();
    tasks.sort_by_key(|t| t.rank);
    assert_eq!(tasks.len(), 2);
    for (rank, task) in tasks.iter().enumerate() {
        assert_eq!(task.env["MUSTER_NODE_RANK"], rank.to_string());
        assert_eq!(task.env["PET_NODE_RANK"], rank.to_string());
        assert_eq!(task.env["PET_NNODES"], "2");
        assert_eq!(task.env["PET_NPROC_PER_NODE"], "4");
        assert_eq!(
            task.env["MUSTER_MASTER_ADDR"],
            tasks[0].env["MUSTER_MASTER_ADDR"]
        );
        assert_eq!(
            task.env["PET_MASTER_PORT"],
            tasks[0].env["MUSTER_MASTER_PORT"]
        );
    }
}

#[test]
fn the_contract_environment_wins_over_a_job_variable_of_the_same_name() {
    let mut world = World::new(&["a"]);
    let mut spec = JobSpec::simple("job", "default", GpuRequest::Whole(1), vec!["true".into()]);
    spec.env.insert("MUSTER_JOB_ID".into(), "forged".into());
    spec.env.insert("PET_NNODES".into(), "64".into());
    spec.env.insert("A_FIRST".into(), "kept".into());
    spec.env.insert("ZZ_LAST".into(), "kept too".into());
    world.step(Input::Submit {
        id: JobId(9),
        spec,
        user: "alice".into(),
    });
    world.cycle();
    let tasks = world.desired("a");
    assert_eq!(tasks.len(), 1);
    let env = &tasks[0].env;
    assert_eq!(env["MUSTER_JOB_ID"], "9");
    assert_eq!(env["PET_NNODES"], "1");
    assert_eq!(env["A_FIRST"], "kept");
    assert_eq!(env["ZZ_LAST"], "kept too");
    assert_eq!(env["MUSTER_MASTER_ADDR"], "10.0.0.1");
    assert_eq!(env.len(), 12, "{env:?}");
}

#[test]
fn a_start_on_a_node_cordoned_after_the_snapshot_is_not_applied() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 4);
    let outcome = world.outcome();
    assert_eq!(outcome.started.len(), 1);
    world.step(Input::Cordon {
        node: NodeName::from("a"),
        cordoned: true,
    });
    world.control.apply_outcome(world.now, &outcome);
    world.control.check_invariants().expect("invariants hold");
    assert_eq!(world.state(1), JobState::Pending);
    assert!(world.desired("a").is_empty());
}

#[test]
fn a_failed_task_stops_the_gang_and_fails_the_job() {
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 2, 4);
    world.cycle();
    let a = world.desired("a");
    let b = world.desired("b");
    world.report("a", vec![running(&a[0])]);
    world.report("b", vec![running(&b[0])]);
    world.report("a", vec![exited(&a[0], 3)]);
    assert_eq!(world.state(1), JobState::Stopping);
    assert!(world.desired("b")[0].stop, "the other task is told to stop");
    world.report("b", vec![exited(&b[0], 143)]);
    assert_eq!(world.state(1), JobState::Failed);
    assert_eq!(world.job(1).exit_code, Some(3));
}

#[test]
fn cancel_stops_a_running_job_and_a_pending_one_at_once() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 4);
    world.submit(2, 1, 4);
    world.cycle();
    world.step(Input::Cancel { job: JobId(2) });
    assert_eq!(world.state(2), JobState::Cancelled);
    let tasks = world.desired("a");
    world.report("a", vec![running(&tasks[0])]);
    world.step(Input::Cancel { job: JobId(1) });
    assert!(world.desired("a")[0].stop);
    world.report("a", vec![exited(&tasks[0], 143)]);
    assert_eq!(world.state(1), JobState::Cancelled);
}

#[test]
fn a_lost_node_requeues_its_job_elsewhere() {
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 1, 4);
    let (_, other, task) = lose_the_node_of_job_1(&mut world);
    world.cycle();
    let moved = world.desired(other);
    assert_eq!(moved.len(), 1);
    assert!(moved[0].generation > task.generation);
    assert_eq!(world.job(1).attempts, 2);
}

/// A job on `node` of `a`/`b` whose node is then declared lost (only the
/// other node heartbeats past the lease): re-queued. Returns the node and
/// the task it ran.
fn lose_the_node_of_job_1(world: &mut World) -> (&'static str, &'static str, DesiredTask) {
    world.cycle();
    let node = if world.desired("a").is_empty() {
        "b"
    } else {
        "a"
    };
    let other = if node == "a" { "b" } else { "a" };
    let task = world.desired(node).remove(0);
    world.report(node, vec![running(&task)]);
    world.advance(11_000);
    world.report(other, vec![]);
    world.step(Input::Tick);
    assert_eq!(world.state(1), JobState::Pending, "re-queued by the loss");
    (node, other, task)
}

#[test]
fn an_exit_reported_after_its_node_was_declared_lost_settles_the_requeued_job() {
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 1, 4);
    let (node, _, task) = lose_the_node_of_job_1(&mut world);
    // The agent comes back: its task had exited 0 before the loss.
    world.report(node, vec![exited(&task, 0)]);
    let job = world.job(1);
    assert_eq!(job.state, JobState::Succeeded, "{:?}", job.history);
    assert_eq!((job.attempts, job.exit_code), (1, Some(0)));
    world.cycle();
    assert!(world.desired("a").is_empty() && world.desired("b").is_empty());
    // Reported again (the agent keeps it until answered): nothing changes.
    world.report(node, vec![exited(&task, 0)]);
    assert_eq!(world.state(1), JobState::Succeeded);

    // A late failure ends a job with no retries for failures as failed.
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 1, 4);
    let (node, _, task) = lose_the_node_of_job_1(&mut world);
    world.report(node, vec![exited(&task, 3)]);
    let job = world.job(1);
    assert_eq!((job.state, job.exit_code), (JobState::Failed, Some(3)));
}

#[test]
fn a_late_exit_changes_nothing_once_the_job_started_again_or_when_fenced() {
    // Started again elsewhere: the old attempt's exit is history.
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 1, 4);
    let (node, other, task) = lose_the_node_of_job_1(&mut world);
    world.cycle();
    let again = world.desired(other);
    assert_eq!(again.len(), 1);
    world.report(other, vec![running(&again[0])]);
    world.report(node, vec![exited(&task, 0)]);
    assert_eq!(world.state(1), JobState::Running);
    assert_eq!(world.job(1).attempts, 2);
    assert_eq!(world.allocation_state(&task), AllocationState::Lost);

    // Fenced by its agent: the task did not end on its own.
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 1, 4);
    let (node, _, task) = lose_the_node_of_job_1(&mut world);
    let fenced = Observed {
        fenced: true,
        exited: Some(None),
        ..running(&task)
    };
    world.report(node, vec![fenced]);
    assert_eq!(world.state(1), JobState::Pending);
    assert_eq!(world.allocation_state(&task), AllocationState::Lost);
}

#[test]
fn a_gang_whose_other_rank_muster_stopped_stays_requeued_on_a_late_exit() {
    let mut world = World::new(&["a", "b", "c"]);
    world.submit(1, 2, 4);
    world.cycle();
    let mut tasks: Vec<(&str, DesiredTask)> = Vec::new();
    for node in ["a", "b", "c"] {
        for task in world.desired(node) {
            world.report(node, vec![running(&task)]);
            tasks.push((node, task));
        }
    }
    assert_eq!(tasks.len(), 2);
    let (lost, lost_task) = tasks[0].clone();
    let (kept, kept_task) = tasks[1].clone();
    let idle = ["a", "b", "c"]
        .into_iter()
        .find(|n| *n != lost && *n != kept)
        .expect("a third node");
    world.advance(11_000);
    world.report(kept, vec![running(&kept_task)]);
    world.report(idle, vec![]);
    world.step(Input::Tick);
    // The rank left is stopped by muster (killed by its signal).
    world.report(
        kept,
        vec![Observed {
            exited: Some(None),
            ..running(&kept_task)
        }],
    );
    assert_eq!(world.state(1), JobState::Pending);
    world.report(lost, vec![exited(&lost_task, 0)]);
    assert_eq!(
        world.state(1),
        JobState::Pending,
        "{:?}",
        world.job(1).history
    );
    assert_eq!(
        world.allocation_state(&lost_task),
        AllocationState::Exited { code: Some(0) },
        "what the node reported is kept"
    );
}

#[test]
fn reports_with_an_old_generation_are_ignored() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 1);
    world.cycle();
    let tasks = world.desired("a");
    let stale = Observed {
        generation: tasks[0].generation + 100,
        ..exited(&tasks[0], 0)
    };
    world.report("a", vec![running(&tasks[0])]);
    world.report("a", vec![stale]);
    assert_eq!(world.state(1), JobState::Running);
    let allocation = world
        .control
        .allocation(tasks[0].allocation)
        .expect("present");
    assert_eq!(allocation.state, AllocationState::Running);
}

#[test]
fn a_job_larger_than_the_cluster_stays_pending_with_a_reason() {
    let mut world = World::new(&["a"]);
    world.submit(1, 3, 4);
    world.cycle();
    let job = &world.job(1);
    assert_eq!(job.state, JobState::Pending);
    let reason = job.pending_reason.as_deref().unwrap_or_default();
    assert_eq!(
        reason,
        "too wide for the cluster: it needs 3 nodes, and only 1 nodes could ever hold one of \
         its tasks; ask for fewer nodes (with more GPUs each), or it starts when more such \
         nodes join"
    );
    assert_eq!(job.queue_position, Some(1));
    assert_eq!(world.control.pending_code(JobId(1)), Some("too-wide"));
    // One that fits the node but not beside a running job holds the
    // reservation (EASY backfill is the default).
    world.submit(2, 1, 4);
    world.submit(3, 1, 4);
    world.cycle();
    assert_eq!(world.state(2), JobState::Running);
    assert_eq!(world.control.pending_code(JobId(3)), Some("reservation"));
}

#[test]
fn a_heartbeat_from_an_old_epoch_is_refused() {
    let mut world = World::new(&["a"]);
    let error = world
        .control
        .handle(
            world.now,
            Input::Heartbeat {
                node: NodeName::from("a"),
                epoch: 0,
                sequence: 1,
                observed: vec![],
                unhealthy: None,
            },
        )
        .expect_err("refused");
    assert!(error.to_string().contains("register"), "{error}");
}

#[test]
fn a_gpu_gone_bad_moves_its_work_and_takes_no_more() {
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 1, 4);
    world.cycle();
    let node = if world.desired("a").is_empty() {
        "b"
    } else {
        "a"
    };
    let tasks = world.desired(node);
    world.report(node, vec![running(&tasks[0])]);
    world.step(Input::GpuHealth {
        node: NodeName::from(node),
        epoch: world.epoch(node),
        unhealthy: vec![tasks[0].gpus[0]],
    });
    assert!(
        world.desired(node)[0].stop,
        "the task on the bad GPU is stopped"
    );
    world.report(node, vec![exited(&tasks[0], 143)]);
    assert_eq!(world.state(1), JobState::Pending, "re-queued, not failed");
    world.cycle();
    let other = if node == "a" { "b" } else { "a" };
    assert_eq!(world.desired(other).len(), 1, "placed on the healthy node");
    assert!(
        world.desired(node).is_empty(),
        "3 healthy GPUs cannot hold 4"
    );
}

#[test]
fn a_task_stopped_by_fencing_requeues_its_job_instead_of_failing_it() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 1);
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", vec![running(&tasks[0])]);
    let fenced = Observed {
        exited: Some(None),
        fenced: true,
        ..running(&tasks[0])
    };
    world.report("a", vec![fenced]);
    assert_eq!(world.state(1), JobState::Pending, "re-queued, not failed");
    world.cycle();
    assert_eq!(world.job(1).attempts, 2);
}

#[test]
fn a_task_killed_at_its_memory_limit_fails_its_job_saying_so() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 1);
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", vec![running(&tasks[0])]);
    let killed = Observed {
        exited: Some(None),
        memory_limit: true,
        ..running(&tasks[0])
    };
    world.report("a", vec![killed]);
    assert_eq!(world.state(1), JobState::Failed);
    let history: Vec<&str> = world
        .job(1)
        .history
        .iter()
        .map(|(_, note)| note.as_str())
        .collect();
    assert!(
        history.contains(&"rank 0 on a killed by its memory limit"),
        "{history:?}"
    );
    assert_eq!(history.last(), Some(&"failed: killed by the memory limit"));
}

#[test]
fn a_start_on_a_gpu_that_went_bad_after_the_snapshot_is_not_applied() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 4);
    let outcome = world.outcome();
    assert_eq!(outcome.started.len(), 1);
    // Between the snapshot and applying the outcome, GPU 2 fails.
    world.step(Input::GpuHealth {
        node: NodeName::from("a"),
        epoch: world.epoch("a"),
        unhealthy: vec![2],
    });
    world.control.apply_outcome(world.now, &outcome);
    world.control.check_invariants().expect("invariants hold");
    assert_eq!(world.state(1), JobState::Pending);
}

#[test]
fn fair_share_favours_the_queue_that_used_less() {
    let mut world = World::new(&["a"]);
    let submit = |world: &mut World, id: u64, queue: &str| {
        let spec = JobSpec::simple("job", queue, GpuRequest::Whole(4), vec!["true".into()]);
        world.step(Input::Submit {
            id: JobId(id),
            spec,
            user: "alice".into(),
        });
    };
    submit(&mut world, 1, "heavy");
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", vec![running(&tasks[0])]);
    // An hour of use by queue `heavy`, accounted at each tick.
    world.step(Input::Tick);
    for _ in 0..60 {
        world.advance(60_000);
        world.report("a", vec![running(&tasks[0])]);
        world.step(Input::Tick);
    }
    world.report("a", vec![exited(&tasks[0], 0)]);
    for (id, queue) in [(2, "heavy"), (3, "light")] {
        submit(&mut world, id, queue);
        world.advance(1_000);
    }
    world.cycle();
    assert_eq!(
        world.state(3),
        JobState::Running,
        "the light queue goes first"
    );
    assert_eq!(world.state(2), JobState::Pending);
}

/// Issue 9 (fault-simulation seeds 63111 and 66200): a duplicated
/// heartbeat, sent before its node started a task, arrived after the job
/// was stopped; the server took the missing report for an exit, released
/// the GPUs and placed the job again while the task still ran. A heartbeat
/// not newer than the last one applied now applies nothing.
#[test]
fn an_old_or_duplicated_heartbeat_applies_nothing() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 4);
    world.cycle();
    let task = world.desired("a")[0].clone();
    // Sent before the node started the task (and duplicated on the way).
    world.report_numbered("a", 5, vec![]);
    assert_eq!(world.allocation_state(&task), AllocationState::Assigned);
    world.step(Input::Cancel { job: JobId(1) });
    assert_eq!(world.allocation_state(&task), AllocationState::Stopping);
    let before = world.control.clone();
    world.advance(3_000);
    world.report_numbered("a", 5, vec![]);
    world.report_numbered("a", 4, vec![]);
    assert_eq!(world.allocation_state(&task), AllocationState::Stopping);
    assert_eq!(world.state(1), JobState::Stopping);
    // It still renews the lease: the agent was alive when it sent it, and
    // counts its own lease from then.
    assert_eq!(
        world
            .control
            .node(&NodeName::from("a"))
            .expect("present")
            .last_heartbeat,
        world.now
    );
    assert_ne!(
        before
            .node(&NodeName::from("a"))
            .expect("present")
            .last_heartbeat,
        world.now
    );
    assert!(world.desired("a")[0].stop, "still told to stop");
    // A newer one applies.
    world.report_numbered("a", 6, vec![running(&task)]);
    world.report_numbered("a", 7, vec![exited(&task, 143)]);
    assert_eq!(world.state(1), JobState::Cancelled);
}

#[test]
fn epochs_are_issued_by_the_control_plane_and_only_move_forward() {
    let mut world = World::new(&["a", "b"]);
    let (a, b) = (world.epoch("a"), world.epoch("b"));
    assert!(a >= 1 && b > a, "cluster-wide, in order: {a} {b}");
    world.submit(1, 1, 4);
    world.cycle();
    let node = if world.desired("a").is_empty() {
        "b"
    } else {
        "a"
    };
    let task = world.desired(node)[0].clone();
    world.report_numbered(node, 9, vec![running(&task)]);
    let old = world.epoch(node);
    world.step(Input::Register {
        spec: MakeNode::new(node).gpus(4, "H100-80GB").build().spec,
        address: "10.0.0.1".to_string(),
        software: Software::default(),
    });
    let new = world.epoch(node);
    assert!(
        new > old.max(a).max(b),
        "a new epoch above every issued one"
    );
    // The old epoch is refused, and the new one numbers heartbeats anew.
    let refused = world.control.handle(
        world.now,
        Input::Heartbeat {
            node: NodeName::from(node),
            epoch: old,
            sequence: 10,
            observed: vec![],
            unhealthy: None,
        },
    );
    assert!(refused.is_err());
    world.report_numbered(node, 1, vec![running(&task)]);
    assert_eq!(world.allocation_state(&task), AllocationState::Running);
    world.step(Input::Cancel { job: JobId(1) });
    world.report_numbered(node, 2, vec![exited(&task, 143)]);
    assert_eq!(world.state(1), JobState::Cancelled);
}

#[test]
fn a_task_missing_from_a_report_is_lost_and_requeued_never_taken_as_exited() {
    let mut world = World::new(&["a"]);
    let mut spec = JobSpec::simple("job", "default", GpuRequest::Whole(1), vec!["x".into()]);
    spec.retry.on_node_failure = true;
    world.step(Input::Submit {
        id: JobId(1),
        spec,
        user: "alice".into(),
    });
    world.cycle();
    let task = world.desired("a")[0].clone();
    world.report("a", vec![running(&task)]);
    // The agent restarted and found no record of the task.
    world.report("a", vec![]);
    assert_eq!(world.allocation_state(&task), AllocationState::Lost);
    assert_eq!(world.state(1), JobState::Pending, "re-queued");
    assert_eq!(world.job(1).exit_code, None, "no exit code was invented");
}

#[test]
fn a_node_with_work_is_removed_only_with_force_which_requeues_the_work() {
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 2, 1);
    world.cycle();
    assert_eq!(world.state(1), JobState::Running);
    let refused = world
        .control
        .handle(
            world.now,
            Input::RemoveNode {
                node: NodeName::from("a"),
                force: false,
            },
        )
        .expect_err("refused");
    assert!(refused.to_string().contains("--force"), "{refused}");
    let outputs = world
        .control
        .handle(
            world.now,
            Input::RemoveNode {
                node: NodeName::from("a"),
                force: true,
            },
        )
        .expect("present");
    world.control.check_invariants().expect("present");
    assert!(outputs.contains(&muster_control::Output::NodeRemoved(NodeName::from("a"))));
    assert!(world.control.node(&NodeName::from("a")).is_none());
    // b's task is told to stop; once it exits the job waits in line again.
    let task = world.desired("b")[0].clone();
    assert!(task.stop);
    world.report("b", vec![exited(&task, 143)]);
    assert_eq!(world.state(1), JobState::Pending);
    // An empty node goes without force.
    world
        .control
        .handle(
            world.now,
            Input::RemoveNode {
                node: NodeName::from("b"),
                force: false,
            },
        )
        .expect("present");
    world.control.check_invariants().expect("present");
}

#[test]
fn finished_jobs_leave_the_hot_state_after_the_retention() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 1);
    world.submit(2, 1, 1);
    world.cycle();
    for task in world.desired("a") {
        world.report("a", vec![running(&task)]);
        world.report("a", vec![exited(&task, 0)]);
    }
    assert_eq!(world.state(1), JobState::Succeeded);
    world.advance(ControlConfig::default().retention_ms - 1);
    world.step(Input::Tick);
    assert!(
        world.control.job(JobId(1)).is_some(),
        "kept for the retention"
    );
    world.advance(2);
    world.step(Input::Tick);
    assert!(world.control.job(JobId(1)).is_none(), "retired");
    assert_eq!(world.control.job_allocations(JobId(1)).count(), 0);
    assert_eq!(world.control.job_count(), 0);
}

#[test]
fn a_node_spec_the_cluster_cannot_take_is_refused_with_every_reason() {
    let mut world = World::new(&[]);
    let mut spec = MakeNode::new("big").gpus(65, "H100-80GB").build().spec;
    spec.cpu = muster_model::CpuMilli(0);
    let error = world
        .control
        .handle(
            world.now,
            Input::Register {
                spec,
                address: "10.0.0.9".into(),
                software: Software::default(),
            },
        )
        .expect_err("refused");
    let text = error.to_string();
    assert!(
        text.contains("65 GPUs") && text.contains("at most 64"),
        "{text}"
    );
    assert!(text.contains("cpu_milli"), "{text}");
    assert!(world.control.node(&NodeName::from("big")).is_none());
    // Several models on one node are accepted.
    let mut mixed = MakeNode::new("mixed").gpus(4, "A100-40GB").build().spec;
    mixed.gpus[2].model = muster_model::GpuModel::new("L4");
    world.step(Input::Register {
        spec: mixed,
        address: "10.0.0.8".into(),
        software: Software::default(),
    });
}

#[test]
fn a_submission_never_acknowledged_is_withdrawn() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 1);
    world.control.withdraw(JobId(1)).expect("present");
    assert!(world.control.job(JobId(1)).is_none());
    world.submit(2, 1, 1);
    world.cycle();
    assert!(world.control.withdraw(JobId(2)).is_err(), "it has started");
}

#[test]
fn a_job_past_its_max_runtime_is_stopped_and_ends_timed_out() {
    let mut world = World::new(&["a"]);
    let mut spec = JobSpec::simple("job", "default", GpuRequest::Whole(1), vec!["x".into()]);
    spec.max_runtime = Some(std::time::Duration::from_secs(5));
    world.step(Input::Submit {
        id: JobId(1),
        spec,
        user: "alice".into(),
    });
    world.cycle();
    let task = world.desired("a")[0].clone();
    world.report("a", vec![running(&task)]);
    world.advance(4_999);
    world.step(Input::Tick);
    assert_eq!(world.state(1), JobState::Running, "not before the limit");
    world.advance(1);
    world.step(Input::Tick);
    assert_eq!(world.state(1), JobState::Stopping);
    let stop = world.desired("a")[0].clone();
    assert!(stop.stop, "told to stop with its signal and grace period");
    // Killed by the stop signal: timed out, not failed, not retried.
    world.report("a", vec![exited(&task, 143)]);
    assert_eq!(world.state(1), JobState::TimedOut);
    assert!(world.state(1).is_final());
    let history: Vec<&str> = world
        .job(1)
        .history
        .iter()
        .map(|(_, what)| what.as_str())
        .collect();
    assert!(
        history.iter().any(|what| what.contains("time limit")),
        "{history:?}"
    );
    assert_eq!(world.job(1).attempts, 1);
}

/// Issue 11: rank 1 exited 3 (its own failure); rank 0 was then stopped by
/// muster and died of SIGTERM (143). The job's outcome is rank 1's.
#[test]
fn a_gang_s_outcome_is_the_first_rank_that_failed_on_its_own() {
    let mut world = World::new(&["a", "b"]);
    world.submit(1, 2, 1);
    world.cycle();
    let mut tasks: Vec<(String, DesiredTask)> = Vec::new();
    for node in ["a", "b"] {
        for task in world.desired(node) {
            world.report(node, vec![running(&task)]);
            tasks.push((node.to_string(), task));
        }
    }
    tasks.sort_by_key(|(_, task)| task.rank);
    let (node0, rank0) = tasks[0].clone();
    let (node1, rank1) = tasks[1].clone();
    world.report(&node1, vec![exited(&rank1, 3)]);
    assert_eq!(world.state(1), JobState::Stopping);
    world.report(&node0, vec![exited(&rank0, 143)]);
    let job = world.job(1);
    assert_eq!(job.state, JobState::Failed);
    assert_eq!(job.exit_code, Some(3), "rank 1's code, not rank 0's 143");
    assert_eq!(job.first_failure, Some((1, Some(3))));
    let last = job.history.last().map(|(_, what)| what.as_str());
    assert_eq!(last, Some("failed: exit code 3 (rank 1)"));
}

#[test]
fn a_heartbeat_s_gpu_health_applies_only_when_the_heartbeat_is_newer() {
    let mut world = World::new(&["a"]);
    let beat = |world: &mut World, sequence: u64, unhealthy: Vec<u32>| {
        let epoch = world.epoch("a");
        world.step(Input::Heartbeat {
            node: NodeName::from("a"),
            epoch,
            sequence,
            observed: vec![],
            unhealthy: Some(unhealthy),
        });
    };
    let unhealthy = |world: &World| {
        world
            .control
            .node(&NodeName::from("a"))
            .expect("present")
            .unhealthy_gpus
            .clone()
    };
    beat(&mut world, 5, vec![2, 0, 2, 99]);
    assert_eq!(
        unhealthy(&world),
        vec![0, 2],
        "sorted, deduplicated, in range"
    );
    // An older heartbeat (sent before the GPUs failed) arrives late.
    beat(&mut world, 4, vec![]);
    assert_eq!(
        unhealthy(&world),
        vec![0, 2],
        "an old report changes nothing"
    );
    beat(&mut world, 6, vec![]);
    assert!(unhealthy(&world).is_empty(), "a newer one does");
}

mod dependencies {
    use super::*;
    use muster_control::ControlError;
    use muster_model::{Dependency, DependencyKind};

    fn submit_after(world: &mut World, id: u64, after: &[(u64, DependencyKind)]) {
        let mut spec = JobSpec::simple("job", "default", GpuRequest::Whole(1), vec!["true".into()]);
        spec.after = after
            .iter()
            .map(|&(job, kind)| Dependency {
                job: JobId(job),
                kind,
            })
            .collect();
        world.step(Input::Submit {
            id: JobId(id),
            spec,
            user: "alice".into(),
        });
    }

    /// Runs job `id` (the only one the node is given) to exit `code`.
    fn finish(world: &mut World, id: u64, code: i32) {
        world.cycle();
        let task = world
            .desired("a")
            .into_iter()
            .find(|t| t.job == JobId(id))
            .expect("the job was started");
        world.report("a", vec![exited(&task, code)]);
        assert_eq!(
            world.state(id),
            if code == 0 {
                JobState::Succeeded
            } else {
                JobState::Failed
            }
        );
    }

    #[test]
    fn a_job_waits_for_its_dependency_to_succeed_then_runs() {
        let mut world = World::new(&["a"]);
        world.submit(1, 1, 1);
        assert_eq!(world.control.pending_code(JobId(1)), Some("unscheduled"));
        submit_after(&mut world, 2, &[(1, DependencyKind::Ok)]);
        assert_eq!(world.control.pending_code(JobId(2)), Some("dependency"));
        assert_eq!(
            world.job(2).pending_reason.as_deref(),
            Some("waiting for job 1 to succeed (after: 1)")
        );
        // Room for both, but job 2 is held.
        world.cycle();
        assert_eq!(world.state(1), JobState::Running);
        assert_eq!(world.control.pending_code(JobId(1)), None);
        assert_eq!(world.state(2), JobState::Pending);
        let task = world.desired("a").remove(0);
        world.report("a", vec![exited(&task, 0)]);
        assert_eq!(world.state(1), JobState::Succeeded);
        world.cycle();
        assert_eq!(world.state(2), JobState::Running);
    }

    #[test]
    fn a_failed_dependency_cancels_its_dependents_and_theirs_saying_why() {
        let mut world = World::new(&["a"]);
        world.submit(1, 1, 1);
        submit_after(&mut world, 2, &[(1, DependencyKind::Ok)]);
        submit_after(&mut world, 3, &[(2, DependencyKind::Ok)]);
        // Job 4 waits for job 2 to end however: job 2's cancellation meets it.
        submit_after(&mut world, 4, &[(2, DependencyKind::Any)]);
        finish(&mut world, 1, 3);
        assert_eq!(world.state(2), JobState::Cancelled);
        let why = &world.job(2).history.last().expect("history").1;
        assert_eq!(
            why,
            "cancelled: job 1 failed, and this job waited for it to succeed"
        );
        assert_eq!(world.state(3), JobState::Cancelled);
        assert_eq!(world.state(4), JobState::Pending);
        world.cycle();
        assert_eq!(world.state(4), JobState::Running);
    }

    #[test]
    fn notok_runs_after_a_failure_and_is_cancelled_by_a_success() {
        let mut world = World::new(&["a"]);
        world.submit(1, 1, 1);
        submit_after(&mut world, 2, &[(1, DependencyKind::NotOk)]);
        finish(&mut world, 1, 0);
        assert_eq!(world.state(2), JobState::Cancelled);

        world.submit(3, 1, 1);
        submit_after(&mut world, 4, &[(3, DependencyKind::NotOk)]);
        finish(&mut world, 3, 1);
        world.cycle();
        assert_eq!(world.state(4), JobState::Running);
    }

    #[test]
    fn cancelling_a_pending_dependency_releases_any_and_cancels_ok() {
        let mut world = World::new(&["a"]);
        world.submit(1, 1, 1);
        submit_after(&mut world, 2, &[(1, DependencyKind::Any)]);
        submit_after(&mut world, 3, &[(1, DependencyKind::Ok)]);
        world.step(Input::Cancel { job: JobId(1) });
        assert_eq!(world.state(3), JobState::Cancelled);
        assert_eq!(world.job(2).pending_reason, None);
        world.cycle();
        assert_eq!(world.state(2), JobState::Running);
    }

    #[test]
    fn a_job_waiting_for_two_runs_only_when_both_are_met() {
        let mut world = World::new(&["a"]);
        world.submit(1, 1, 1);
        world.submit(2, 1, 1);
        submit_after(
            &mut world,
            3,
            &[(1, DependencyKind::Ok), (2, DependencyKind::Ok)],
        );
        assert_eq!(
            world.job(3).pending_reason.as_deref(),
            Some("waiting for job 1 to succeed and 1 more job (after: 1, 2)")
        );
        world.cycle();
        let tasks = world.desired("a");
        let first = tasks.iter().find(|t| t.job == JobId(1)).expect("job 1");
        world.report("a", vec![exited(first, 0), running(&tasks[1])]);
        assert_eq!(
            world.job(3).pending_reason.as_deref(),
            Some("waiting for job 2 to succeed (after: 1, 2)")
        );
        world.cycle();
        assert_eq!(world.state(3), JobState::Pending);
    }

    #[test]
    fn a_dependency_that_is_unknown_or_already_unmet_is_refused() {
        let mut world = World::new(&["a"]);
        let mut spec = JobSpec::simple("job", "default", GpuRequest::Whole(1), vec!["true".into()]);
        spec.after = vec![Dependency {
            job: JobId(99),
            kind: DependencyKind::Ok,
        }];
        let refused = world.control.handle(
            world.now,
            Input::Submit {
                id: JobId(1),
                spec: spec.clone(),
                user: "alice".into(),
            },
        );
        assert!(
            matches!(&refused, Err(ControlError::Invalid(m)) if m.contains("there is no job 99")),
            "{refused:?}"
        );
        world.submit(2, 1, 1);
        finish(&mut world, 2, 1);
        spec.after[0].job = JobId(2);
        let refused = world.control.handle(
            world.now,
            Input::Submit {
                id: JobId(3),
                spec: spec.clone(),
                user: "alice".into(),
            },
        );
        assert!(
            matches!(&refused, Err(ControlError::Invalid(m)) if m.contains("job 2 already failed")),
            "{refused:?}"
        );
        // Met already: accepted and free to run.
        spec.after[0].kind = DependencyKind::NotOk;
        world.step(Input::Submit {
            id: JobId(3),
            spec,
            user: "alice".into(),
        });
        world.cycle();
        assert_eq!(world.state(3), JobState::Running);
    }
}

mod arrays {
    use super::*;
    use muster_control::ControlError;
    use muster_model::ArraySpec;

    fn submit_array(world: &mut World, id: u64, array: &str, slurm_env: bool) {
        let mut spec = JobSpec::simple("shard", "default", GpuRequest::Whole(1), vec!["x".into()]);
        spec.array = Some(ArraySpec::parse(array).expect("valid array"));
        spec.slurm_env = slurm_env;
        world.step(Input::Submit {
            id: JobId(id),
            spec,
            user: "alice".into(),
        });
    }

    fn running_ids(world: &World) -> Vec<u64> {
        world
            .control
            .jobs()
            .filter(|job| job.state == JobState::Running)
            .map(|job| job.id.0)
            .collect()
    }

    #[test]
    fn elements_are_jobs_with_consecutive_ids_and_their_index() {
        let mut world = World::new(&["a"]);
        submit_array(&mut world, 10, "1,3,5-6", false);
        let elements: Vec<(u64, u32)> = world
            .control
            .jobs()
            .map(|job| (job.id.0, job.array.expect("an element").index))
            .collect();
        assert_eq!(elements, vec![(10, 1), (11, 3), (12, 5), (13, 6)]);
        for job in world.control.jobs() {
            let array = job.array.expect("an element");
            assert_eq!(
                (array.array, array.count, array.limit),
                (JobId(10), 4, None)
            );
            // The element's spec is the job's, without the array.
            assert_eq!(job.spec.array, None);
        }
        world.cycle();
        assert_eq!(running_ids(&world), vec![10, 11, 12, 13]);
        let task = world
            .desired("a")
            .into_iter()
            .find(|t| t.job == JobId(12))
            .expect("started");
        assert_eq!(task.env["MUSTER_ARRAY_INDEX"], "5");
        assert_eq!(task.env["MUSTER_ARRAY_JOB_ID"], "10");
        assert_eq!(task.env["MUSTER_ARRAY_COUNT"], "4");
        assert_eq!(task.env["MUSTER_JOB_ID"], "12");
        // Slurm's variables only when asked for.
        assert!(!task.env.contains_key("SLURM_ARRAY_TASK_ID"));
        assert!(!task.env.contains_key("SLURM_JOB_ID"));
    }

    #[test]
    fn an_array_overlapping_a_job_is_refused_whole() {
        let mut world = World::new(&["a"]);
        world.submit(5, 1, 1);
        let mut spec = JobSpec::simple("shard", "default", GpuRequest::Whole(1), vec!["x".into()]);
        spec.array = Some(ArraySpec::parse("0-9").expect("valid"));
        let refused = world.control.handle(
            world.now,
            Input::Submit {
                id: JobId(1),
                spec,
                user: "alice".into(),
            },
        );
        assert!(
            matches!(refused, Err(ControlError::Conflict(_))),
            "{refused:?}"
        );
        assert_eq!(world.control.job_count(), 1);
    }

    #[test]
    fn the_limit_caps_running_elements_lowest_first_until_all_end() {
        // 4 GPUs, 10 one-GPU elements, at most 3 at once.
        let mut world = World::new(&["a"]);
        submit_array(&mut world, 1, "0-9%3", false);
        world.cycle();
        assert_eq!(running_ids(&world), vec![1, 2, 3]);
        assert_eq!(world.control.pending_code(JobId(4)), Some("array-limit"));
        // A later cycle with room on the node still starts none.
        world.cycle();
        assert_eq!(running_ids(&world), vec![1, 2, 3]);
        let mut ended = 0;
        let mut most = 0;
        while ended < 10 {
            let tasks = world.desired("a");
            most = most.max(running_ids(&world).len());
            // The first one running fails, the others wait: a failed
            // element does not stop the array.
            let task = tasks.first().expect("an element runs").clone();
            let code = i32::from(task.job == JobId(2));
            world.report("a", vec![exited(&task, code)]);
            ended += 1;
            world.cycle();
        }
        assert_eq!(most, 3);
        assert_eq!(world.state(2), JobState::Failed);
        assert!(
            (1..=10)
                .filter(|&id| id != 2)
                .all(|id| world.state(id) == JobState::Succeeded)
        );
    }

    #[test]
    fn dependencies_hold_every_element_and_slurm_variables_are_set() {
        let mut world = World::new(&["a", "b"]);
        world.submit(1, 1, 4);
        world.cycle();
        let mut spec = JobSpec::simple("sweep", "default", GpuRequest::Whole(2), vec!["x".into()]);
        spec.nodes = 2;
        spec.array = Some(ArraySpec::parse("7-8").expect("valid"));
        spec.slurm_env = true;
        spec.working_dir = Some("/home/alice/run".into());
        spec.env
            .insert("SLURM_NTASKS_PER_NODE".to_string(), "4".to_string());
        spec.after = vec![muster_model::Dependency {
            job: JobId(1),
            kind: muster_model::DependencyKind::Ok,
        }];
        world.step(Input::Submit {
            id: JobId(2),
            spec,
            user: "alice".into(),
        });
        assert_eq!(world.control.pending_code(JobId(2)), Some("dependency"));
        assert_eq!(world.control.pending_code(JobId(3)), Some("dependency"));
        let holder = ["a", "b"]
            .into_iter()
            .find(|n| !world.desired(n).is_empty())
            .expect("job 1 runs somewhere");
        let task = world.desired(holder).remove(0);
        world.report(holder, vec![exited(&task, 0)]);
        world.cycle();
        // Both elements (2 nodes x 2 GPUs each) now run.
        assert_eq!(running_ids(&world), vec![2, 3]);
        let rank1 = world
            .desired("a")
            .into_iter()
            .chain(world.desired("b"))
            .find(|t| t.job == JobId(3) && t.env["MUSTER_NODE_RANK"] == "1")
            .expect("rank 1 of element 8");
        let env = &rank1.env;
        assert_eq!(env["SLURM_JOB_ID"], "3");
        assert_eq!(env["SLURM_PROCID"], "1");
        assert_eq!(env["SLURM_NODEID"], "1");
        assert_eq!(env["SLURM_NNODES"], "2");
        assert_eq!(env["SLURM_NTASKS"], "8");
        assert_eq!(env["SLURM_ARRAY_TASK_ID"], "8");
        assert_eq!(env["SLURM_ARRAY_JOB_ID"], "2");
        assert_eq!(env["SLURM_SUBMIT_DIR"], "/home/alice/run");
        assert_eq!(env["SLURM_GPUS_ON_NODE"], "2");
        let nodes: Vec<&str> = env["SLURM_JOB_NODELIST"].split(',').collect();
        assert_eq!(nodes.len(), 2);
        assert_eq!(env["SLURMD_NODENAME"], nodes[1]);
    }

    #[test]
    fn cancelling_an_array_cancels_every_unfinished_element() {
        let mut world = World::new(&["a"]);
        world.submit(1, 1, 1);
        submit_array(&mut world, 2, "0-5%2", false);
        world.cycle();
        assert_eq!(running_ids(&world), vec![1, 2, 3]);
        let task = world
            .desired("a")
            .into_iter()
            .find(|t| t.job == JobId(2))
            .expect("started");
        world.report("a", vec![exited(&task, 0)]);
        assert_eq!(world.state(2), JobState::Succeeded);
        world.step(Input::CancelArray { array: JobId(2) });
        // The ended element stays as it ended; the running one is told to
        // stop; the pending ones are cancelled; job 1 is not an element.
        assert_eq!(world.state(2), JobState::Succeeded);
        assert_eq!(world.state(3), JobState::Stopping);
        assert!((4..=7).all(|id| world.state(id) == JobState::Cancelled));
        assert_eq!(world.state(1), JobState::Running);
        assert_eq!(world.control.array_elements(JobId(2)).len(), 6);
        let refused = world
            .control
            .handle(world.now, Input::CancelArray { array: JobId(1) });
        // Not an array job: a conflict with what the job is.
        assert!(
            matches!(refused, Err(ControlError::Conflict(_))),
            "{refused:?}"
        );
        let refused = world
            .control
            .handle(world.now, Input::CancelArray { array: JobId(99) });
        assert!(
            matches!(refused, Err(ControlError::JobNotFound(_))),
            "{refused:?}"
        );
    }

    fn submit_after_array(world: &mut World, id: u64, array: u64, kind: &str) {
        let mut spec = JobSpec::simple("post", "default", GpuRequest::Whole(0), vec!["x".into()]);
        spec.after = vec![muster_model::Dependency {
            job: JobId(array),
            kind: muster_model::DependencyKind::parse(kind).expect("a kind"),
        }];
        world.step(Input::Submit {
            id: JobId(id),
            spec,
            user: "alice".into(),
        });
    }

    /// Ends the running element `id` with `code`.
    fn end(world: &mut World, id: u64, code: i32) {
        let task = world
            .desired("a")
            .into_iter()
            .find(|t| t.job == JobId(id))
            .expect("the element runs");
        world.report("a", vec![exited(&task, code)]);
    }

    #[test]
    fn a_job_after_an_array_waits_for_every_element() {
        let mut world = World::new(&["a"]);
        submit_array(&mut world, 1, "0-2", false);
        submit_after_array(&mut world, 4, 1, "ok");
        submit_after_array(&mut world, 5, 1, "any");
        submit_after_array(&mut world, 6, 1, "notok");
        assert_eq!(
            world.job(4).pending_reason.as_deref(),
            Some("waiting for array job 1 (every element) to succeed (after: 1)")
        );
        world.cycle();
        assert_eq!(running_ids(&world), vec![1, 2, 3]);
        // The array's first element (whose id the array has) ending does
        // not release them.
        end(&mut world, 1, 0);
        end(&mut world, 3, 0);
        world.cycle();
        for id in [4, 5, 6] {
            assert_eq!(world.state(id), JobState::Pending, "job {id}");
            assert_eq!(world.control.pending_code(JobId(id)), Some("dependency"));
        }
        end(&mut world, 2, 0);
        // All succeeded: ok and any go on; notok can never be met.
        assert_eq!(world.state(6), JobState::Cancelled);
        assert!(
            world.job(6).history.iter().any(|(_, what)| what
                == "cancelled: every element of array job 1 succeeded, and this job waited \
                    for one to fail"),
            "{:?}",
            world.job(6).history
        );
        world.cycle();
        assert_eq!(world.state(4), JobState::Running);
        assert_eq!(world.state(5), JobState::Running);
        // One already ended the right way: a new one after it is accepted
        // and free to run; one that waits for a failure is refused.
        submit_after_array(&mut world, 7, 1, "ok");
        assert!(!world.control.is_waiting(world.job(7)));
        let mut spec = JobSpec::simple("post", "default", GpuRequest::Whole(0), vec!["x".into()]);
        spec.after = vec![muster_model::Dependency {
            job: JobId(1),
            kind: muster_model::DependencyKind::NotOk,
        }];
        let refused = world.control.handle(
            world.now,
            Input::Submit {
                id: JobId(8),
                spec,
                user: "alice".into(),
            },
        );
        assert!(
            matches!(&refused, Err(ControlError::Invalid(why)) if why.contains("every element of array job 1 succeeded")),
            "{refused:?}"
        );
    }

    #[test]
    fn one_failed_element_cancels_a_job_waiting_for_all_to_succeed_at_once() {
        let mut world = World::new(&["a"]);
        submit_array(&mut world, 1, "0-2", false);
        submit_after_array(&mut world, 4, 1, "ok");
        submit_after_array(&mut world, 5, 1, "notok");
        // And a job after job 4: cancelled in turn.
        submit_after_array(&mut world, 6, 4, "ok");
        world.cycle();
        end(&mut world, 2, 3);
        // Elements 1 and 3 still run, but job 4 can never start.
        assert_eq!(world.state(4), JobState::Cancelled);
        assert!(world.job(4).history.iter().any(|(_, what)| what
            == "cancelled: element 1 of array job 1 failed, and this job waited for every \
                    element to succeed"));
        assert_eq!(world.state(6), JobState::Cancelled);
        // notok waits for all to end, then runs: one failed.
        assert_eq!(world.state(5), JobState::Pending);
        end(&mut world, 1, 0);
        end(&mut world, 3, 0);
        world.cycle();
        assert_eq!(world.state(5), JobState::Running);
        // A new job waiting for the array to succeed is refused, naming the
        // element that did not.
        let mut spec = JobSpec::simple("post", "default", GpuRequest::Whole(0), vec!["x".into()]);
        spec.after = vec![muster_model::Dependency {
            job: JobId(1),
            kind: muster_model::DependencyKind::Ok,
        }];
        let refused = world.control.handle(
            world.now,
            Input::Submit {
                id: JobId(9),
                spec,
                user: "alice".into(),
            },
        );
        assert!(
            matches!(&refused, Err(ControlError::Invalid(why)) if why.contains("element 1 of array job 1 failed")),
            "{refused:?}"
        );
    }

    #[test]
    fn a_job_after_one_element_waits_for_that_element_only() {
        let mut world = World::new(&["a"]);
        submit_array(&mut world, 1, "0-2", false);
        // Job 2 is element 1: not an array's id, so a job of its own.
        submit_after_array(&mut world, 4, 2, "ok");
        assert_eq!(
            world.job(4).pending_reason.as_deref(),
            Some("waiting for job 2 to succeed (after: 2)")
        );
        world.cycle();
        end(&mut world, 2, 0);
        world.cycle();
        assert_eq!(world.state(4), JobState::Running);
        assert_eq!(world.state(1), JobState::Running);
    }
}

#[test]
fn a_job_idle_for_its_idle_timeout_is_stopped_and_ends_idle_stopped() {
    let mut world = World::new(&["a"]);
    let mut spec = JobSpec::simple(
        "notebook",
        "default",
        GpuRequest::Whole(1),
        vec!["x".into()],
    );
    spec.idle_timeout = Some(std::time::Duration::from_secs(1800));
    world.step(Input::Submit {
        id: JobId(1),
        spec,
        user: "alice".into(),
    });
    world.submit(2, 1, 1);
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", tasks.iter().map(running).collect());
    // A job without an idle_timeout is left alone.
    world.step(Input::StopIdle { job: JobId(2) });
    assert_eq!(world.state(2), JobState::Running);
    world.step(Input::StopIdle { job: JobId(1) });
    assert_eq!(world.state(1), JobState::Stopping);
    let task = world
        .desired("a")
        .into_iter()
        .find(|t| t.job == JobId(1))
        .expect("the notebook's task");
    assert!(task.stop, "told to stop");
    world.report("a", vec![exited(&task, 143)]);
    assert_eq!(world.state(1), JobState::IdleStopped);
    assert!(JobState::IdleStopped.is_final());
    assert_eq!(JobState::parse("idle_stopped"), Some(JobState::IdleStopped));
    // Asking again is harmless.
    world.step(Input::StopIdle { job: JobId(1) });
    assert_eq!(world.state(1), JobState::IdleStopped);
}

#[test]
fn under_the_majority_policy_a_drifting_node_takes_no_work_until_it_matches() {
    use muster_control::StackPolicy;
    let mut world = World {
        control: ControlPlane::new(ControlConfig {
            stack_policy: StackPolicy::Majority,
            ..ControlConfig::default()
        }),
        now: Time(1_000),
    };
    let register = |world: &mut World, name: &str, driver: &str| {
        world.step(Input::Register {
            spec: MakeNode::new(name).gpus(4, "H100-80GB").build().spec,
            address: "10.0.0.1".into(),
            software: Software {
                backend: "nvml".into(),
                driver: Some(driver.into()),
                cuda: Some("12.4".into()),
                stack: Default::default(),
            },
        });
    };
    register(&mut world, "a", "550.90");
    register(&mut world, "b", "550.54");
    // Two nodes: no majority yet.
    assert!(world.control.nodes().all(|n| n.drift.is_none()));
    register(&mut world, "c", "550.90");
    let drift = |world: &World, name: &str| {
        world
            .control
            .node(&NodeName::from(name))
            .and_then(|n| n.drift.clone())
    };
    assert_eq!(
        drift(&world, "b").as_deref(),
        Some("stack drift: driver 550.54 vs 550.90")
    );
    assert_eq!(drift(&world, "a"), None);
    // Work goes only to the nodes with the pool's stack.
    for id in 1..=3 {
        world.submit(id, 1, 4);
    }
    world.cycle();
    assert!(world.desired("b").is_empty());
    assert_eq!(world.desired("a").len() + world.desired("c").len(), 2);
    // Upgraded, it registers again and is back.
    register(&mut world, "b", "550.90");
    assert_eq!(drift(&world, "b"), None);
    world.cycle();
    assert_eq!(world.desired("b").len(), 1);
}

#[test]
fn a_queue_may_impose_an_idle_timeout_and_the_shorter_one_applies() {
    let mut world = World::new(&["a"]);
    let mut queue = muster_model::QueueSpec::best_effort("notebooks");
    queue.idle_timeout = Some(std::time::Duration::from_secs(600));
    world.step(Input::SetQueue(queue));
    let mut spec = JobSpec::simple("nb", "notebooks", GpuRequest::Whole(1), vec!["x".into()]);
    world.step(Input::Submit {
        id: JobId(1),
        spec: spec.clone(),
        user: "alice".into(),
    });
    spec.idle_timeout = Some(std::time::Duration::from_secs(60));
    world.step(Input::Submit {
        id: JobId(2),
        spec,
        user: "alice".into(),
    });
    assert_eq!(
        world.control.idle_timeout_of(world.job(1)),
        Some(std::time::Duration::from_secs(600))
    );
    assert_eq!(
        world.control.idle_timeout_of(world.job(2)),
        Some(std::time::Duration::from_secs(60))
    );
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", tasks.iter().map(running).collect());
    // Job 1 has no idle_timeout of its own: its queue's applies.
    world.step(Input::StopIdle { job: JobId(1) });
    assert_eq!(world.state(1), JobState::Stopping);
}

#[test]
fn the_ledger_charges_held_used_and_idle_gpu_time_minute_by_minute() {
    use muster_control::accounting::{CostBy, Ledger, MINUTE_MS, cost_report, totals};
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 2);
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", tasks.iter().map(running).collect());
    // Start at a minute's 30th second.
    let start = 100 * MINUTE_MS + 30_000;
    let mut ledger = Ledger::default();
    assert!(ledger.accrue(&world.control, start).is_empty());
    // 30 s without telemetry, then the minute closes: held, not measured.
    let closed = ledger.accrue(&world.control, start + 30_000);
    assert_eq!(closed.len(), 1);
    assert_eq!(closed[0].minute_ms, 100 * MINUTE_MS);
    assert_eq!(closed[0].allocated_gpu_ms, 2 * 30_000);
    assert_eq!(closed[0].measured_gpu_ms, 0);
    assert_eq!(
        (closed[0].queue.as_str(), closed[0].user.as_str()),
        ("default", "alice")
    );
    assert_eq!(
        (closed[0].gpu_model.as_str(), closed[0].job),
        ("H100-80GB", 1)
    );
    // Telemetry says 90% busy; 20 s later it says idle (2%) for 40 s.
    let allocation = tasks[0].allocation.0;
    let mut closed = Vec::new();
    ledger.observe(
        &world.control,
        allocation,
        90,
        1_000,
        start + 30_000,
        &mut closed,
    );
    ledger.observe(
        &world.control,
        allocation,
        2,
        500,
        start + 50_000,
        &mut closed,
    );
    assert!(closed.is_empty());
    let closed = ledger.accrue(&world.control, start + 90_000);
    assert_eq!(closed.len(), 1);
    let minute = &closed[0];
    assert_eq!(minute.minute_ms, 101 * MINUTE_MS);
    assert_eq!(minute.allocated_gpu_ms, 2 * 60_000);
    assert_eq!(minute.measured_gpu_ms, 2 * 60_000);
    assert_eq!(
        minute.used_gpu_ms,
        2 * 20_000 * 90 / 100 + 2 * 40_000 * 2 / 100
    );
    assert_eq!(minute.idle_gpu_ms, 2 * 40_000);
    assert_eq!(minute.samples, 2);
    assert_eq!(minute.mean_utilization(), Some(46.0));
    assert_eq!(
        (minute.peak_utilization, minute.peak_memory_mib),
        (90, 1_000)
    );
    // Charged 5 s into the next minute; then the job ends: that partial
    // minute closes with the allocation (what ran after the last accrual,
    // at most the accrual period, is not charged), and nothing more is.
    assert!(ledger.accrue(&world.control, start + 95_000).is_empty());
    world.report("a", vec![exited(&tasks[0], 0)]);
    let last = ledger.accrue(&world.control, start + 100_000);
    assert_eq!(last.len(), 1);
    assert_eq!(last[0].minute_ms, 102 * MINUTE_MS);
    assert_eq!(last[0].allocated_gpu_ms, 2 * 5_000);
    assert_eq!(last[0].idle_gpu_ms, 2 * 5_000);
    assert!(ledger.accrue(&world.control, start + 200_000).is_empty());
    assert_eq!(ledger.open_accounts(), 0);
    // Priced: 2.5 an hour.
    let minutes = [closed[0].clone()];
    let lines = cost_report(
        &totals(CostBy::Queue, &minutes),
        &std::collections::BTreeMap::from([("H100-80GB".to_string(), 2.5)]),
    );
    assert_eq!(lines.len(), 1);
    assert!((lines[0].cost - 2.0 * 60.0 / 3600.0 * 2.5).abs() < 1e-9);
    assert!((lines[0].waste - 2.0 * 40.0 / 3600.0 * 2.5).abs() < 1e-9);
}

#[test]
fn a_queue_over_its_hard_budget_holds_its_pending_jobs_until_released() {
    let mut world = World::new(&["a"]);
    world.submit(1, 1, 1);
    let held = std::collections::BTreeSet::from([muster_model::QueueName::from("default")]);
    world.step(Input::HoldBudgets { queues: held });
    world.cycle();
    assert_eq!(world.state(1), JobState::Pending);
    assert_eq!(world.control.pending_code(JobId(1)), Some("budget"));
    assert!(world.desired("a").is_empty());
    world.step(Input::HoldBudgets {
        queues: Default::default(),
    });
    world.cycle();
    assert_eq!(world.desired("a").len(), 1);
    assert_eq!(world.control.pending_code(JobId(1)), None);
}

#[test]
fn a_queue_may_set_its_own_idle_threshold_and_duration() {
    use muster_control::usage::{GpuReading, UsageByNode, idle_for_ms, record_usage};
    let mut world = World::new(&["a"]);
    let mut queue = muster_model::QueueSpec::best_effort("notebooks");
    queue.idle_below_pct = Some(20);
    queue.idle_after = Some(std::time::Duration::from_secs(60));
    world.step(Input::SetQueue(queue));
    world.step(Input::Submit {
        id: JobId(1),
        spec: JobSpec::simple("nb", "notebooks", GpuRequest::Whole(1), vec!["x".into()]),
        user: "alice".into(),
    });
    world.submit(2, 1, 1);
    world.cycle();
    let tasks = world.desired("a");
    world.report("a", tasks.iter().map(running).collect());
    assert_eq!(world.control.idle_below_pct_of(world.job(1)), 20);
    assert_eq!(world.control.idle_below_pct_of(world.job(2)), 5);
    assert_eq!(
        world.control.idle_after_ms_of(world.job(1), 1_800_000),
        60_000
    );
    assert_eq!(
        world.control.idle_after_ms_of(world.job(2), 1_800_000),
        1_800_000
    );
    // Both jobs' GPUs at 15%: idle for the notebook queue, busy enough
    // for the default one.
    let readings: Vec<GpuReading> = tasks
        .iter()
        .flat_map(|task| task.gpus.iter())
        .map(|&index| GpuReading {
            index,
            utilization_pct: 15,
            memory_used_mib: 100,
        })
        .collect();
    let mut usage = UsageByNode::new();
    let node = NodeName::from("a");
    record_usage(
        usage.entry("a".into()).or_default(),
        &world.control,
        &node,
        &readings,
        1_000,
    );
    let idle = |id: u64, now: u64| {
        let job = world.control.job(JobId(id)).expect("a job");
        idle_for_ms(
            &world.control,
            &usage,
            job,
            now,
            world.control.idle_after_ms_of(job, 1_800_000),
        )
    };
    assert_eq!(idle(1, 30_000), None, "not yet a minute");
    assert_eq!(idle(1, 61_000), Some(60_000));
    assert_eq!(idle(2, 10_000_000), None, "15% is not idle at 5%");
}

#[test]
fn a_pool_may_require_versions_and_a_node_without_them_takes_no_work() {
    use muster_control::{PoolPolicy, StackPolicy};
    let mut world = World::new(&[]);
    let register = |world: &mut World, name: &str, driver: &str| {
        world.step(Input::Register {
            spec: MakeNode::new(name).gpus(4, "H100-80GB").build().spec,
            address: "10.0.0.1".into(),
            software: Software {
                backend: "nvml".into(),
                driver: Some(driver.into()),
                cuda: Some("12.4".into()),
                stack: Default::default(),
            },
        });
    };
    register(&mut world, "a", "550.90");
    register(&mut world, "b", "550.54");
    let drift = |world: &World, name: &str| {
        world
            .control
            .node(&NodeName::from(name))
            .and_then(|n| n.drift.clone())
    };
    // The server's default (report) marks nothing.
    assert_eq!(drift(&world, "b"), None);
    let pool = muster_model::PoolName::from("default");
    let required = PoolPolicy {
        stack: StackPolicy::Required,
        required: [("driver", "550.90"), ("nccl", "2.21.5")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        mounts: Vec::new(),
        inference: false,
    };
    world.step(Input::SetPoolPolicy {
        pool: pool.clone(),
        policy: Some(required.clone()),
    });
    assert_eq!(
        drift(&world, "b").as_deref(),
        Some("stack drift: driver 550.54 vs required 550.90, nccl (none) vs required 2.21.5")
    );
    assert!(drift(&world, "a").is_some(), "no nccl");
    world.submit(1, 1, 1);
    world.cycle();
    assert!(world.desired("a").is_empty() && world.desired("b").is_empty());
    // Only the driver, then: a is fine and takes the work.
    let mut driver_only = required.clone();
    driver_only.required.remove("nccl");
    world.step(Input::SetPoolPolicy {
        pool: pool.clone(),
        policy: Some(driver_only),
    });
    assert_eq!(drift(&world, "a"), None);
    world.cycle();
    assert_eq!(world.desired("a").len(), 1);
    // The policy survives a restart (records), and drift is derived again.
    let restored =
        ControlPlane::restore(ControlConfig::default(), world.control.records(), world.now)
            .expect("restored");
    assert_eq!(restored.stack_policy_of(&pool).stack, StackPolicy::Required);
    assert!(
        restored
            .node(&NodeName::from("b"))
            .is_some_and(|n| n.drift.is_some())
    );
    // Without versions, `required` is refused; removed, nothing is marked.
    let refused = world.control.handle(
        world.now,
        Input::SetPoolPolicy {
            pool: pool.clone(),
            policy: Some(PoolPolicy {
                stack: StackPolicy::Required,
                required: Default::default(),
                mounts: Vec::new(),
                inference: false,
            }),
        },
    );
    assert!(refused.is_err());
    world.step(Input::SetPoolPolicy { pool, policy: None });
    assert_eq!(drift(&world, "b"), None);
}

/// Issue 14: a queue learns from its finished jobs how long they run; a job
/// whose spec gives no estimate gets the mean of them for backfill and the
/// typical one for its start forecast, never more than its `max_runtime`;
/// a spec's estimate wins.
#[test]
fn a_queue_learns_its_run_times_and_forecasts_starts_from_them() {
    use muster_sched::{ForecastLimits, StartForecast, forecast_starts};
    let mut world = World::new(&["a"]);
    for id in 1..=3 {
        world.submit(id, 1, 1);
    }
    world.cycle();
    let tasks = world.desired("a");
    assert_eq!(tasks.len(), 3);
    world.report("a", tasks.iter().map(running).collect());
    // Jobs 1 and 2 run 100 s, job 3 runs 10,000 s.
    world.advance(100_000);
    world.report(
        "a",
        vec![
            exited(&tasks[0], 0),
            exited(&tasks[1], 0),
            running(&tasks[2]),
        ],
    );
    world.advance(9_900_000);
    world.report("a", vec![exited(&tasks[2], 0)]);
    assert_eq!(world.state(3), JobState::Succeeded);

    // Job 6 (1 GPU) runs; job 4 (the whole node) waits for it; job 5 caps
    // its run at 50 s; job 7 says it takes 20 s.
    world.submit(6, 1, 1);
    world.cycle();
    let running_task = world.desired("a")[0].clone();
    world.report("a", vec![running(&running_task)]);
    world.submit(4, 1, 4);
    let mut capped = JobSpec::simple("job", "default", GpuRequest::Whole(4), vec!["x".into()]);
    capped.max_runtime = Some(std::time::Duration::from_secs(50));
    let mut given = capped.clone();
    given.max_runtime = None;
    given.estimated_runtime = Some(std::time::Duration::from_secs(20));
    for (id, spec) in [(5, capped), (7, given)] {
        world.step(Input::Submit {
            id: JobId(id),
            spec,
            user: "alice".into(),
        });
    }
    let (snapshot, pending) = world.control.scheduling_input(world.now);
    let estimate = |pending: &[muster_sched::PendingJob], id: u64| {
        pending
            .iter()
            .find(|job| job.id == JobId(id))
            .expect("pending")
            .estimated_runtime_ms
    };
    // Backfill's: the mean (3,400 s), capped by max_runtime, or the spec's.
    assert_eq!(estimate(&pending, 4), Some(3_400_000));
    assert_eq!(estimate(&pending, 5), Some(50_000));
    assert_eq!(estimate(&pending, 7), Some(20_000));
    assert_eq!(
        snapshot.running[0].expected_end,
        Some(world.now.plus_millis(3_400_000))
    );
    // The forecast's: the typical run (100 s): job 6 should end in 100 s.
    let (ahead, waiting) = world
        .control
        .forecast_input(snapshot.clone(), pending.clone());
    assert_eq!(estimate(&waiting, 4), Some(100_000));
    assert_eq!(
        ahead.running[0].expected_end,
        Some(world.now.plus_millis(100_000))
    );
    let policy = SchedulingPolicy::default();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let outcome = schedule(&snapshot, &pending, &policy, &mut rng).expect("valid");
    world.control.apply_outcome(world.now, &outcome);
    let forecasts = forecast_starts(
        &ahead,
        &waiting,
        &policy,
        &outcome,
        None,
        &ForecastLimits::default(),
        &mut rng,
    )
    .expect("valid");
    world.control.set_forecasts(forecasts);
    // Job 4 is first in line: it starts when job 6 ends.
    assert_eq!(
        world.control.start_forecast(JobId(4)),
        Some(StartForecast::At(world.now.plus_millis(100_000)))
    );
    // A restarted control plane learns the same from the jobs it keeps.
    let restored = muster_control::ControlPlane::restore(
        ControlConfig::default(),
        world.control.records(),
        world.now,
    )
    .expect("restores");
    let (_, again) = restored.scheduling_input(world.now);
    assert_eq!(estimate(&again, 4), Some(3_400_000));
    // Forecasts of jobs no longer pending go.
    world.step(Input::Cancel { job: JobId(4) });
    world
        .control
        .set_forecasts([(JobId(4), StartForecast::Unknown)].into_iter().collect());
    assert_eq!(world.control.start_forecast(JobId(4)), None);
}

/// Issue 14: least attained service within a class. A job that has had
/// more GPU time than a threshold (default 1 GPU-hour) falls a level below
/// fresh jobs of its class, and keeps what it had through a re-queue; a
/// higher class still goes first.
#[test]
fn a_job_that_had_more_gpu_time_falls_below_fresh_jobs_of_its_class() {
    let mut world = World::new(&["a", "b"]);
    // It checkpoints every 10 minutes, so it may be preempted for a level.
    let mut spec = JobSpec::simple("job", "default", GpuRequest::Whole(4), vec!["x".into()]);
    spec.checkpoint.interval = Some(std::time::Duration::from_secs(600));
    world.step(Input::Submit {
        id: JobId(1),
        spec,
        user: "alice".into(),
    });
    world.cycle();
    let node = if world.desired("a").is_empty() {
        "b"
    } else {
        "a"
    };
    let other = if node == "a" { "b" } else { "a" };
    let task = world.desired(node)[0].clone();
    world.report(node, vec![running(&task)]);
    let priority = |world: &World, id: u64| {
        let (snapshot, pending) = world.control.scheduling_input(world.now);
        snapshot
            .running
            .iter()
            .find(|job| job.id == JobId(id))
            .map(|job| job.priority)
            .or_else(|| {
                pending
                    .iter()
                    .find(|job| job.id == JobId(id))
                    .map(|job| job.priority)
            })
            .expect("scheduled")
    };
    // Fresh: class normal (100) x 10.
    assert_eq!(priority(&world, 1), 1_000);
    // 4 GPUs for 15 minutes: 1 GPU-hour, the first threshold.
    world.advance(15 * 60_000);
    world.report(node, vec![running(&task)]);
    world.report(other, vec![]);
    assert_eq!(priority(&world, 1), 900);
    // Its node is lost: re-queued, it keeps the GPU time it had.
    world.advance(11_000);
    world.report(other, vec![]);
    world.step(Input::Tick);
    assert_eq!(world.state(1), JobState::Pending);
    assert_eq!(priority(&world, 1), 900);
    // A fresh job of its class goes first; a "low" one does not.
    world.submit(2, 1, 4);
    assert_eq!(priority(&world, 2), 1_000);
    let mut low = JobSpec::simple("job", "default", GpuRequest::Whole(4), vec!["x".into()]);
    low.priority_class = muster_model::PriorityClass::new("low", 0);
    world.step(Input::Submit {
        id: JobId(3),
        spec: low,
        user: "alice".into(),
    });
    assert_eq!(priority(&world, 3), 0);
    let outcome = world.outcome();
    assert_eq!(outcome.order, [JobId(2), JobId(1), JobId(3)]);
    // The GPU time of ended attempts is kept in memory only: a restarted
    // control plane counts from the attempt running then.
    let restored =
        ControlPlane::restore(ControlConfig::default(), world.control.records(), world.now)
            .expect("restores");
    let (_, pending) = restored.scheduling_input(world.now);
    let job1 = pending
        .iter()
        .find(|job| job.id == JobId(1))
        .expect("pending");
    assert_eq!(job1.priority, 1_000);
    // A running job that does not checkpoint is never stopped for a level:
    // it keeps its class's priority while it runs (pending, it would not).
    let mut plain = World::new(&["a"]);
    plain.submit(1, 1, 4);
    plain.cycle();
    let task = plain.desired("a")[0].clone();
    plain.report("a", vec![running(&task)]);
    plain.advance(2 * 3_600_000);
    plain.report("a", vec![running(&task)]);
    assert_eq!(
        plain.control.attained_gpu_s(plain.job(1), plain.now),
        8.0 * 3_600.0
    );
    assert_eq!(priority(&plain, 1), 1_000);
    // Turned off, a job keeps its class's priority however long it runs.
    let mut flat = World::new(&[]);
    flat.control = ControlPlane::new(ControlConfig {
        service_levels: muster_sched::ServiceLevels::none(),
        ..ControlConfig::default()
    });
    flat.step(Input::Register {
        spec: MakeNode::new("a").gpus(4, "H100-80GB").build().spec,
        address: "10.0.0.1".into(),
        software: Software::default(),
    });
    flat.submit(1, 1, 4);
    flat.cycle();
    let task = flat.desired("a")[0].clone();
    flat.report("a", vec![running(&task)]);
    flat.advance(3_600_000);
    flat.report("a", vec![running(&task)]);
    assert_eq!(priority(&flat, 1), 1_000);
}

#[test]
fn under_approve_nodes_a_new_node_takes_no_work_until_approved_and_keeps_it_across_registrations() {
    let mut world = World {
        control: ControlPlane::new(ControlConfig {
            approve_nodes: true,
            ..ControlConfig::default()
        }),
        now: Time(1_000),
    };
    let spec = MakeNode::new("n1").gpus(4, "H100-80GB").build().spec;
    let register = |spec: &muster_model::NodeSpec| Input::Register {
        spec: spec.clone(),
        address: "10.0.0.1".into(),
        software: Software::default(),
    };
    world.step(register(&spec));
    let node = NodeName::from("n1");
    assert!(world.control.node(&node).expect("known").pending_approval);
    world.submit(1, 1, 1);
    world.cycle();
    assert!(world.desired("n1").is_empty(), "no work for a pending node");
    assert_eq!(world.job(1).state, JobState::Pending);
    // Registering again (an agent restart) does not approve it.
    world.step(register(&spec));
    world.cycle();
    assert!(world.desired("n1").is_empty());
    world.step(Input::Approve { node: node.clone() });
    world.cycle();
    assert_eq!(world.desired("n1").len(), 1);
    // Nor does registering again take the approval back.
    world.step(register(&spec));
    assert!(!world.control.node(&node).expect("known").pending_approval);
    // At most MAX_PENDING_APPROVAL new nodes wait at once.
    for index in 0..muster_control::MAX_PENDING_APPROVAL {
        world.step(Input::Register {
            spec: MakeNode::new(&format!("w{index}"))
                .gpus(1, "H100-80GB")
                .build()
                .spec,
            address: "10.0.1.1".into(),
            software: Software::default(),
        });
    }
    let refused = world
        .control
        .handle(
            world.now,
            Input::Register {
                spec: MakeNode::new("one-too-many")
                    .gpus(1, "H100-80GB")
                    .build()
                    .spec,
                address: "10.0.1.2".into(),
                software: Software::default(),
            },
        )
        .unwrap_err()
        .to_string();
    assert!(refused.contains("already wait for approval"), "{refused}");
    // An unknown node cannot be approved.
    assert!(
        world
            .control
            .handle(
                world.now,
                Input::Approve {
                    node: NodeName::from("nobody")
                }
            )
            .is_err()
    );
}
