//! Start forecasts on hand-computed clusters: the engine run ahead.

use muster_model::{JobId, NodeName, Time};
use muster_sched::{
    Allocation, ForecastLimits, PendingJob, SchedulingPolicy, Snapshot, StartForecast,
    forecast_starts, schedule,
};
use muster_testkit::{MakeJob, MakeNode, running_from};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};

fn whole(node: &str) -> Vec<Allocation> {
    vec![Allocation {
        node: NodeName::from(node),
        gpus: (0..8).map(|i| (i, 1000)).collect(),
        cpu: muster_model::CpuMilli(1000),
        memory: muster_model::MemoryMib(1024),
    }]
}

/// Nodes a and b of 8 GPUs, both busy: a until `a_end`, b until `b_end`
/// (seconds; `None`: no estimate).
fn busy(a_end: Option<u64>, b_end: Option<u64>) -> Snapshot {
    let mut snapshot = Snapshot {
        nodes: vec![MakeNode::new("a").build(), MakeNode::new("b").build()],
        ..Snapshot::default()
    };
    for (id, node, end) in [(100, "a", a_end), (101, "b", b_end)] {
        let job = MakeJob::new(id).gpus(8).build();
        snapshot.running.push(running_from(
            &job,
            whole(node),
            Time(0),
            end.map(Time::from_secs),
        ));
    }
    snapshot
}

fn policy() -> SchedulingPolicy {
    SchedulingPolicy {
        preemption: false,
        ..SchedulingPolicy::default()
    }
}

fn forecast(
    snapshot: &Snapshot,
    pending: &[PendingJob],
    limits: &ForecastLimits,
    targets: Option<&BTreeSet<JobId>>,
) -> BTreeMap<JobId, StartForecast> {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let outcome = schedule(snapshot, pending, &policy(), &mut rng).expect("valid");
    forecast_starts(
        snapshot,
        pending,
        &policy(),
        &outcome,
        targets,
        limits,
        &mut rng,
    )
    .expect("valid")
}

fn at(secs: u64) -> StartForecast {
    StartForecast::At(Time::from_secs(secs))
}

/// a frees at 1,000 s and b at 3,000 s. Job 1 (one node, 2,000 s) takes a
/// at 1,000 s; job 2 (both nodes) holds the reservation for 3,000 s, when
/// job 1 and b's job end; job 3 (500 s) cannot backfill in front of it and
/// starts when job 2 ends, at 3,100 s.
#[test]
fn jobs_start_as_the_plan_frees_nodes_in_the_queue_s_order() {
    let pending = vec![
        MakeJob::new(1).gpus(8).estimate_secs(2_000).build(),
        MakeJob::new(2)
            .gpus(8)
            .tasks(2)
            .estimate_secs(100)
            .submitted_secs(1)
            .build(),
        MakeJob::new(3)
            .gpus(8)
            .estimate_secs(500)
            .submitted_secs(2)
            .build(),
    ];
    let forecasts = forecast(
        &busy(Some(1_000), Some(3_000)),
        &pending,
        &ForecastLimits::default(),
        None,
    );
    assert_eq!(forecasts[&JobId(1)], at(1_000));
    assert_eq!(forecasts[&JobId(2)], at(3_000));
    assert_eq!(forecasts[&JobId(3)], at(3_100));
}

/// Backfill is the engine's: a short job that ends before the reserved
/// start runs in front of the reservation holder.
#[test]
fn a_short_job_backfills_in_the_plan_as_in_the_cycle() {
    // a frees at 1,000 s, b at 5,000 s. Job 1 needs both (reserves for
    // 5,000 s); job 2 (1,000 s) fits on a from 1,000 s and ends by 2,000 s.
    let pending = vec![
        MakeJob::new(1).gpus(8).tasks(2).estimate_secs(100).build(),
        MakeJob::new(2)
            .gpus(8)
            .estimate_secs(1_000)
            .submitted_secs(1)
            .build(),
    ];
    let forecasts = forecast(
        &busy(Some(1_000), Some(5_000)),
        &pending,
        &ForecastLimits::default(),
        None,
    );
    assert_eq!(forecasts[&JobId(2)], at(1_000));
    assert_eq!(forecasts[&JobId(1)], at(5_000));
}

/// Ends close together share a step, and the step is the later end: the
/// forecast is late by the gap (here 50 s at 1,000 s), never early.
#[test]
fn close_ends_share_a_step_at_the_later_one() {
    let pending = vec![MakeJob::new(1).gpus(8).tasks(2).build()];
    let forecasts = forecast(
        &busy(Some(1_000), Some(1_050)),
        &pending,
        &ForecastLimits::default(),
        None,
    );
    assert_eq!(forecasts[&JobId(1)], at(1_050));
    // Far apart (1,000 s and 2,000 s), they are steps of their own.
    let pending = vec![
        MakeJob::new(1).gpus(8).build(),
        MakeJob::new(2).gpus(8).submitted_secs(1).build(),
    ];
    let forecasts = forecast(
        &busy(Some(1_000), Some(2_000)),
        &pending,
        &ForecastLimits::default(),
        None,
    );
    assert_eq!(forecasts[&JobId(1)], at(1_000));
    assert_eq!(forecasts[&JobId(2)], at(2_000));
}

/// A job waiting on running jobs with no runtime estimate cannot be
/// forecast; one no node could ever hold neither.
#[test]
fn without_estimates_or_room_the_start_is_unknown() {
    let pending = vec![
        MakeJob::new(1).gpus(8).tasks(2).build(),
        MakeJob::new(2).gpus(64).submitted_secs(1).build(),
    ];
    let forecasts = forecast(
        &busy(Some(1_000), None),
        &pending,
        &ForecastLimits::default(),
        None,
    );
    assert_eq!(forecasts[&JobId(1)], StartForecast::Unknown);
    assert_eq!(forecasts[&JobId(2)], StartForecast::Unknown);
}

/// The plan is bounded: past its jobs, steps or horizon, a job gets "not
/// before" the time the plan reached.
#[test]
fn a_bounded_plan_says_not_before_where_it_stopped() {
    let pending: Vec<PendingJob> = (1..=3)
        .map(|id| {
            MakeJob::new(id)
                .gpus(8)
                .estimate_secs(10_000)
                .submitted_secs(id)
                .build()
        })
        .collect();
    let snapshot = busy(Some(1_000), Some(3_000));
    // Everything: 1 at 1,000 s on a, 2 at 3,000 s on b, 3 at 11,000 s.
    let all = forecast(&snapshot, &pending, &ForecastLimits::default(), None);
    assert_eq!(
        [all[&JobId(1)], all[&JobId(2)], all[&JobId(3)]],
        [at(1_000), at(3_000), at(11_000)]
    );
    // Two jobs planned: the third is not before the plan's last step.
    let limits = ForecastLimits {
        jobs: 2,
        ..ForecastLimits::default()
    };
    let some = forecast(&snapshot, &pending, &limits, None);
    assert_eq!(some[&JobId(2)], at(3_000));
    assert_eq!(
        some[&JobId(3)],
        StartForecast::NotBefore(Time::from_secs(3_000))
    );
    // One step: only job 1.
    let limits = ForecastLimits {
        steps: 1,
        ..ForecastLimits::default()
    };
    let one = forecast(&snapshot, &pending, &limits, None);
    assert_eq!(one[&JobId(1)], at(1_000));
    assert_eq!(
        one[&JobId(2)],
        StartForecast::NotBefore(Time::from_secs(1_000))
    );
    // A horizon of 2,000 s: 3,000 s is past it.
    let limits = ForecastLimits {
        horizon_ms: 2_000_000,
        ..ForecastLimits::default()
    };
    let near = forecast(&snapshot, &pending, &limits, None);
    assert_eq!(near[&JobId(1)], at(1_000));
    assert_eq!(
        near[&JobId(3)],
        StartForecast::NotBefore(Time::from_secs(1_000))
    );
    // Targets: the plan stops once job 1 is known.
    let targets = BTreeSet::from([JobId(1)]);
    let first = forecast(
        &snapshot,
        &pending,
        &ForecastLimits::default(),
        Some(&targets),
    );
    assert_eq!(first[&JobId(1)], at(1_000));
    assert_eq!(
        first[&JobId(2)],
        StartForecast::NotBefore(Time::from_secs(1_000))
    );
}

/// A job the cycle itself starts is not forecast; what it takes is in the
/// plan (the next job waits for it to end).
#[test]
fn the_cycle_s_own_starts_are_in_the_plan() {
    let mut snapshot = busy(Some(1_000), None);
    snapshot.nodes.push(MakeNode::new("c").build());
    let pending = vec![
        MakeJob::new(1).gpus(8).estimate_secs(4_000).build(),
        MakeJob::new(2).gpus(8).submitted_secs(1).build(),
    ];
    let forecasts = forecast(&snapshot, &pending, &ForecastLimits::default(), None);
    assert!(!forecasts.contains_key(&JobId(1)), "{forecasts:?}");
    // c is job 1's until 4,000 s; a frees at 1,000 s.
    assert_eq!(forecasts[&JobId(2)], at(1_000));
}
