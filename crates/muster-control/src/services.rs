//! The service controller's rules (pure): from what a service asks and how
//! its replicas are doing, what to start, take out of traffic and stop.
//!
//! A service's replicas are ordinary jobs (their spec's
//! [`muster_model::ServiceRef`] names the service and the revision they
//! run). The shell (`muster-server`) observes them, runs the checks
//! ([`ProbeState`] decides when one is due and whether it passes), and
//! carries out the [`Action`]s of [`reconcile`]: it submits, drains and
//! cancels jobs. The same rules drive the simulator's service replay.

use muster_model::{Autoscale, JobId, Probe, ScaleMetric, ServiceSpec, Time};
use std::collections::VecDeque;
use std::time::Duration;

/// How one replica is doing, as the shell sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct Replica {
    pub job: JobId,
    pub revision: u32,
    pub run: ReplicaRun,
    /// Taken out of traffic at this time (it stops once drained).
    pub draining_since: Option<Time>,
    /// Its stop was asked (drained, failed its liveness check, scaled
    /// down); its end is no failure.
    pub stopping: bool,
    /// Its readiness check passes (or it has none and runs).
    pub ready: bool,
    /// Its liveness check has failed (it must be replaced).
    pub dead: Option<String>,
    /// Why it is not ready, in words (the last check's answer).
    pub not_ready: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaRun {
    /// Waiting to be placed (or being placed).
    Pending,
    /// Its task runs, since then.
    Running { since: Time },
    /// Its job ended; `failed` unless it succeeded or was stopped by the
    /// controller.
    Ended { failed: bool },
}

/// What the controller decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Submit a replica of this revision.
    Start { revision: u32 },
    /// Take the replica out of traffic now; it is stopped after the drain.
    Drain { job: JobId },
    /// Stop (cancel) the replica.
    Stop { job: JobId, why: String },
    /// The replica's job ended: stop tracking it.
    Forget { job: JobId },
}

/// The controller's memory of one service between rounds (memory only: a
/// restarted server starts again from no failures).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ControllerState {
    /// Replica failures in a row (ended on their own, or dead).
    pub failures_in_row: u32,
    /// No replica is started before this (restart backoff).
    pub next_start: Time,
    pub last_failure: Option<Time>,
    /// Why the last replica failed, in words.
    pub last_failure_why: Option<String>,
}

/// The service's state in numbers and words, for views.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Status {
    pub desired: u32,
    /// Replicas not stopping (pending or running), every revision.
    pub current: u32,
    /// Of them, ready (in traffic).
    pub ready: u32,
    /// Of them, of the current revision.
    pub updated: u32,
    /// A rollout in progress, or why it stopped.
    pub rollout: Option<String>,
    /// Replicas start again after this (restart backoff), if later than now.
    pub backoff_until: Option<Time>,
}

/// How long a new revision's replica may run without becoming ready before
/// the rollout is said to be stopped.
pub fn progress_deadline(spec: &ServiceSpec) -> Duration {
    if let Some(deadline) = spec.update.progress_deadline {
        return deadline;
    }
    match &spec.readiness {
        Some(probe) => (probe.initial_delay
            + probe.period * (probe.failure_threshold + probe.success_threshold)
            + probe.timeout)
            .max(Duration::from_secs(30)),
        None => Duration::from_secs(30),
    }
}

/// The wait before the next start after `failures` failures in a row.
pub fn backoff(spec: &ServiceSpec, failures: u32) -> Duration {
    if failures == 0 {
        return Duration::ZERO;
    }
    let doubled = spec
        .restart
        .initial
        .saturating_mul(1u32 << (failures - 1).min(20));
    doubled.min(spec.restart.max)
}

/// One round for one service at `now`, its current revision `revision`.
pub fn reconcile(
    now: Time,
    spec: &ServiceSpec,
    revision: u32,
    replicas: &[Replica],
    state: &mut ControllerState,
) -> (Vec<Action>, Status) {
    let mut actions = Vec::new();
    // Ended replicas: forgotten; a failure counts towards the backoff.
    for replica in replicas {
        if let ReplicaRun::Ended { failed } = replica.run {
            actions.push(Action::Forget { job: replica.job });
            if failed && !replica.stopping {
                note_failure(
                    now,
                    spec,
                    state,
                    format!("replica job {} ended with an error", replica.job.0),
                );
            }
        }
    }
    // Dead replicas are stopped and replaced.
    for replica in replicas {
        if let (Some(why), false, false) = (
            &replica.dead,
            replica.stopping,
            matches!(replica.run, ReplicaRun::Ended { .. }),
        ) {
            actions.push(Action::Stop {
                job: replica.job,
                why: format!("failed its liveness check: {why}"),
            });
            note_failure(
                now,
                spec,
                state,
                format!(
                    "replica job {} failed its liveness check: {why}",
                    replica.job.0
                ),
            );
        }
    }
    // Drained replicas are stopped.
    for replica in replicas {
        if let Some(since) = replica.draining_since
            && !replica.stopping
            && !matches!(replica.run, ReplicaRun::Ended { .. })
            && now.millis_since(since) >= spec.drain.as_millis() as u64
        {
            actions.push(Action::Stop {
                job: replica.job,
                why: "drained".to_string(),
            });
        }
    }
    let live: Vec<&Replica> = replicas
        .iter()
        .filter(|replica| {
            !matches!(replica.run, ReplicaRun::Ended { .. })
                && !replica.stopping
                && replica.draining_since.is_none()
                && replica.dead.is_none()
        })
        .collect();
    // A replica of the current revision ready since the last failure
    // clears the backoff.
    if state.failures_in_row > 0
        && live.iter().any(|replica| {
            replica.ready
                && replica.revision == revision
                && matches!(replica.run, ReplicaRun::Running { since }
                    if state.last_failure.is_none_or(|failure| since > failure))
        })
    {
        state.failures_in_row = 0;
        state.next_start = now;
    }
    let (current, old): (Vec<&Replica>, Vec<&Replica>) = live
        .iter()
        .partition(|replica| replica.revision == revision);
    let ready_now = live.iter().filter(|replica| replica.ready).count() as u32;
    let desired = spec.replicas;
    let may_start = now >= state.next_start;
    let mut starts = 0u32;
    let mut removed: Vec<JobId> = Vec::new();
    let mut remove = |actions: &mut Vec<Action>, replica: &Replica, why: &str| {
        removed.push(replica.job);
        match replica.run {
            // Never in traffic: stopped at once.
            ReplicaRun::Pending => actions.push(Action::Stop {
                job: replica.job,
                why: why.to_string(),
            }),
            _ if !replica.ready => actions.push(Action::Stop {
                job: replica.job,
                why: why.to_string(),
            }),
            _ => actions.push(Action::Drain { job: replica.job }),
        }
    };
    let mut rollout = None;
    if old.is_empty() {
        let have = current.len() as u32;
        if have < desired && may_start {
            starts = desired - have;
        } else if have > desired {
            // The least useful go first: pending, then not ready, then the
            // newest.
            let mut order = current.clone();
            order.sort_by_key(|replica| {
                (
                    !matches!(replica.run, ReplicaRun::Pending),
                    replica.ready,
                    std::cmp::Reverse(match replica.run {
                        ReplicaRun::Running { since } => since,
                        _ => Time(u64::MAX),
                    }),
                )
            });
            for replica in order.iter().take((have - desired) as usize) {
                remove(&mut actions, replica, "scaled down");
            }
        }
    } else {
        let total = (current.len() + old.len()) as u32;
        let most = desired + spec.update.max_surge;
        let least_ready = desired.saturating_sub(spec.update.max_unavailable);
        // New replicas, within the surge.
        let want_new = desired.saturating_sub(current.len() as u32);
        let room = most.saturating_sub(total);
        if may_start {
            starts = want_new.min(room);
        }
        // Old replicas not in traffic serve nobody: they go at once.
        let mut ready_left = ready_now;
        let mut total_left = total;
        for replica in old.iter().filter(|replica| !replica.ready) {
            remove(&mut actions, replica, "replaced by a new revision");
            total_left -= 1;
        }
        // Then ready ones, as long as enough stay ready.
        for replica in old.iter().filter(|replica| replica.ready) {
            if ready_left > least_ready {
                remove(&mut actions, replica, "replaced by a new revision");
                ready_left -= 1;
                total_left -= 1;
            }
        }
        // A second chance to start now that old ones left.
        if may_start {
            let room = most.saturating_sub(total_left);
            starts = starts.max(want_new.min(room));
        }
        let updated_ready = current.iter().filter(|replica| replica.ready).count();
        let deadline = progress_deadline(spec).as_millis() as u64;
        let stuck = current.iter().find(|replica| {
            !replica.ready
                && matches!(replica.run, ReplicaRun::Running { since }
                    if now.millis_since(since) >= deadline)
        });
        rollout = Some(match stuck {
            Some(replica) => format!(
                "rollout to revision {revision} stopped: replica job {} is not ready after {}s \
                 ({}); the old revision keeps serving. Fix the spec and update again, or roll \
                 back (`muster services rollback {}`)",
                replica.job.0,
                deadline / 1000,
                replica
                    .not_ready
                    .clone()
                    .unwrap_or_else(|| "no check has passed yet".to_string()),
                spec.name
            ),
            None if state.failures_in_row >= 3 => format!(
                "rollout to revision {revision} stopped: {} replica failures in a row ({}); \
                 the old revision keeps serving",
                state.failures_in_row,
                state.last_failure_why.clone().unwrap_or_default()
            ),
            None => format!(
                "rolling out revision {revision}: {updated_ready} of {desired} new replicas \
                 ready, {} old to replace",
                old.len()
            ),
        });
    }
    for _ in 0..starts {
        actions.push(Action::Start { revision });
    }
    let still: Vec<&&Replica> = live
        .iter()
        .filter(|replica| !removed.contains(&replica.job))
        .collect();
    let status = Status {
        desired,
        current: still.len() as u32 + starts,
        ready: still.iter().filter(|replica| replica.ready).count() as u32,
        updated: still
            .iter()
            .filter(|replica| replica.revision == revision)
            .count() as u32
            + starts,
        rollout,
        backoff_until: (state.next_start > now).then_some(state.next_start),
    };
    (actions, status)
}

fn note_failure(now: Time, spec: &ServiceSpec, state: &mut ControllerState, why: String) {
    state.failed(now, spec, why);
}

impl ControllerState {
    /// A replica failed (or could not be submitted): one more failure in
    /// a row, and no start before the backoff.
    pub fn failed(&mut self, now: Time, spec: &ServiceSpec, why: String) {
        self.failures_in_row = self.failures_in_row.saturating_add(1);
        self.last_failure = Some(now);
        self.last_failure_why = Some(why);
        self.next_start = now.plus_millis(backoff(spec, self.failures_in_row).as_millis() as u64);
    }
}

/// What an autoscaled service's replicas see, summed over the gateways.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    /// Requests per second.
    pub request_rate: f64,
    /// Requests in flight.
    pub in_flight: f64,
    /// Requests held for want of a ready replica (scale from zero).
    pub waiting: u64,
    /// Mean utilisation of the ready replicas' GPUs (percent), if known.
    pub gpu_utilization: Option<f64>,
    /// Ready replicas.
    pub ready: u32,
}

/// The autoscaler's memory of one service: its recent recommendations.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AutoscalerState {
    recent: VecDeque<(Time, u32)>,
}

/// How many replicas `autoscale` asks for now, from `current` (the count
/// asked for so far): at once when more, and when fewer, the most any
/// recommendation of the last `window` asked for (so a dip does not stop
/// replicas that the next burst needs). Held requests ask for one replica
/// at least. Also returns the reason in words.
pub fn autoscale(
    now: Time,
    autoscale: &Autoscale,
    current: u32,
    load: &Load,
    state: &mut AutoscalerState,
) -> (u32, String) {
    let (wanted, why) = match autoscale.metric {
        ScaleMetric::RequestRate(per) => (
            (load.request_rate / per).ceil(),
            format!("{:.1} requests/s for {per} a replica", load.request_rate),
        ),
        ScaleMetric::InFlight(per) => (
            (load.in_flight / per).ceil(),
            format!(
                "{:.1} requests in flight for {per} a replica",
                load.in_flight
            ),
        ),
        ScaleMetric::GpuUtilization(pct) => match load.gpu_utilization {
            Some(mean) if load.ready > 0 => (
                (f64::from(load.ready) * mean / pct).ceil(),
                format!(
                    "GPUs {mean:.0}% busy on {} ready replicas for {pct}%",
                    load.ready
                ),
            ),
            _ => (f64::from(current), "no GPU telemetry yet".to_string()),
        },
    };
    let mut wanted = if wanted.is_finite() && wanted > 0.0 {
        wanted.min(f64::from(u32::MAX)) as u32
    } else {
        0
    };
    let mut why = why;
    if load.waiting > 0 && wanted == 0 {
        wanted = 1;
        why = format!("{} requests held for a replica", load.waiting);
    }
    let wanted = wanted.clamp(autoscale.min_replicas, autoscale.max_replicas);
    let window = autoscale.window.as_millis() as u64;
    while state
        .recent
        .front()
        .is_some_and(|(at, _)| now.millis_since(*at) > window)
    {
        state.recent.pop_front();
    }
    // Only the most wanted within the window matters: an earlier entry that
    // wanted no more than this one never will, so the list stays decreasing
    // (at most one entry per replica count) and its front is the most.
    while state
        .recent
        .back()
        .is_some_and(|(_, count)| *count <= wanted)
    {
        state.recent.pop_back();
    }
    state.recent.push_back((now, wanted));
    if wanted >= current {
        return (wanted, why);
    }
    let most = state.recent.front().map_or(wanted, |(_, count)| *count);
    (most.min(current), why)
}

/// One check's record for one replica: when it is due, and whether it
/// passes (after its thresholds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeState {
    pub passing: bool,
    successes: u32,
    failures: u32,
    last: Option<Time>,
    /// The last failed check's answer.
    pub message: Option<String>,
}

impl ProbeState {
    /// A readiness check starts failing (not ready until it passes); a
    /// liveness check starts passing.
    pub fn new(passing: bool) -> Self {
        ProbeState {
            passing,
            successes: 0,
            failures: 0,
            last: None,
            message: None,
        }
    }

    /// Takes a check's result (`Err`: why it failed).
    pub fn record(&mut self, probe: &Probe, now: Time, result: Result<(), String>) {
        self.last = Some(now);
        match result {
            Ok(()) => {
                self.failures = 0;
                self.successes = self.successes.saturating_add(1);
                if self.successes >= probe.success_threshold {
                    self.passing = true;
                    self.message = None;
                }
            }
            Err(why) => {
                self.successes = 0;
                self.failures = self.failures.saturating_add(1);
                self.message = Some(why);
                if self.failures >= probe.failure_threshold {
                    self.passing = false;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_model::{GpuRequest, JobSpec, ProbeAction, UpdateStrategy};

    fn spec(replicas: u32) -> ServiceSpec {
        ServiceSpec {
            name: "web".into(),
            replicas,
            template: JobSpec::simple("web", "default", GpuRequest::Whole(0), vec!["x".into()]),
            port: None,
            readiness: Some(Probe::new(ProbeAction::Http {
                path: "/healthz".into(),
            })),
            liveness: None,
            update: UpdateStrategy::default(),
            spread: Default::default(),
            restart: Default::default(),
            drain: Duration::from_secs(2),
            autoscale: None,
            bearer_secret: None,
        }
    }

    fn replica(job: u64, revision: u32, run: ReplicaRun, ready: bool) -> Replica {
        Replica {
            job: JobId(job),
            revision,
            run,
            draining_since: None,
            stopping: false,
            ready,
            dead: None,
            not_ready: None,
        }
    }

    fn running(job: u64, revision: u32, ready: bool) -> Replica {
        replica(job, revision, ReplicaRun::Running { since: Time(0) }, ready)
    }

    fn starts(actions: &[Action]) -> usize {
        actions
            .iter()
            .filter(|action| matches!(action, Action::Start { .. }))
            .count()
    }

    #[test]
    fn a_new_service_starts_its_replicas_and_scales_down_the_least_useful_first() {
        let mut state = ControllerState::default();
        let (actions, status) = reconcile(Time(0), &spec(3), 1, &[], &mut state);
        assert_eq!(starts(&actions), 3);
        assert_eq!((status.current, status.ready), (3, 0));
        let replicas = [
            replica(1, 1, ReplicaRun::Running { since: Time(100) }, true),
            replica(2, 1, ReplicaRun::Running { since: Time(900) }, true),
            replica(3, 1, ReplicaRun::Pending, false),
        ];
        let (actions, status) = reconcile(Time(1_000), &spec(1), 1, &replicas, &mut state);
        assert_eq!(
            actions,
            vec![
                Action::Stop {
                    job: JobId(3),
                    why: "scaled down".into()
                },
                Action::Drain { job: JobId(2) },
            ]
        );
        assert_eq!((status.current, status.ready), (1, 1));
    }

    #[test]
    fn failures_back_off_doubling_and_a_ready_replica_clears_it() {
        let spec = spec(1);
        let mut state = ControllerState::default();
        let failed = [replica(1, 1, ReplicaRun::Ended { failed: true }, false)];
        let (actions, status) = reconcile(Time(10_000), &spec, 1, &failed, &mut state);
        assert_eq!(actions, vec![Action::Forget { job: JobId(1) }]);
        assert_eq!(status.backoff_until, Some(Time(11_000)));
        let (actions, _) = reconcile(Time(11_000), &spec, 1, &[], &mut state);
        assert_eq!(starts(&actions), 1);
        let failed = [replica(2, 1, ReplicaRun::Ended { failed: true }, false)];
        let (_, status) = reconcile(Time(12_000), &spec, 1, &failed, &mut state);
        assert_eq!(status.backoff_until, Some(Time(14_000)), "doubles");
        assert_eq!(state.failures_in_row, 2);
        // A replica stopped by the controller is no failure.
        let mut stopped = replica(3, 1, ReplicaRun::Ended { failed: true }, false);
        stopped.stopping = true;
        reconcile(Time(13_000), &spec, 1, &[stopped], &mut state);
        assert_eq!(state.failures_in_row, 2);
        let ready = [replica(
            4,
            1,
            ReplicaRun::Running {
                since: Time(14_500),
            },
            true,
        )];
        reconcile(Time(15_000), &spec, 1, &ready, &mut state);
        assert_eq!(state.failures_in_row, 0);
        assert_eq!(backoff(&spec, 30), spec.restart.max);
    }

    #[test]
    fn a_dead_replica_is_stopped_and_replaced_after_the_backoff() {
        let spec = spec(2);
        let mut state = ControllerState::default();
        let mut dead = running(1, 1, true);
        dead.dead = Some("GET /healthz: connection refused".into());
        let replicas = [dead, running(2, 1, true)];
        let (actions, status) = reconcile(Time(5_000), &spec, 1, &replicas, &mut state);
        assert!(
            matches!(&actions[0], Action::Stop { job: JobId(1), why } if why.contains("liveness"))
        );
        assert_eq!(starts(&actions), 0, "waits for the backoff");
        assert_eq!(status.backoff_until, Some(Time(6_000)));
        let mut stopping = replicas[0].clone();
        stopping.stopping = true;
        let replicas = [stopping, running(2, 1, true)];
        let (actions, _) = reconcile(Time(6_000), &spec, 1, &replicas, &mut state);
        assert_eq!(starts(&actions), 1);
    }

    #[test]
    fn a_drained_replica_is_stopped_after_the_drain() {
        let spec = spec(1);
        let mut state = ControllerState::default();
        let mut draining = running(1, 1, true);
        draining.draining_since = Some(Time(1_000));
        let replicas = [draining, running(2, 1, true)];
        let (actions, _) = reconcile(Time(2_999), &spec, 1, &replicas, &mut state);
        assert!(actions.is_empty(), "{actions:?}");
        let (actions, _) = reconcile(Time(3_000), &spec, 1, &replicas, &mut state);
        assert_eq!(
            actions,
            vec![Action::Stop {
                job: JobId(1),
                why: "drained".into()
            }]
        );
    }

    /// Plays a rollout: each started replica runs at once and is ready one
    /// round later (or never, with `new_ready` false); drains end at once.
    fn roll(update: UpdateStrategy, new_ready: bool, rounds: usize) -> (Vec<Replica>, Vec<u32>) {
        let mut spec = spec(3);
        spec.update = update;
        let mut state = ControllerState::default();
        let mut replicas: Vec<Replica> = (1..=3).map(|job| running(job, 1, true)).collect();
        let mut next = 4;
        let mut ready_seen = Vec::new();
        for round in 0..rounds {
            let now = Time(1_000 * round as u64);
            let (actions, _) = reconcile(now, &spec, 2, &replicas, &mut state);
            for replica in &mut replicas {
                if replica.revision == 2 && matches!(replica.run, ReplicaRun::Running { .. }) {
                    replica.ready = new_ready;
                }
            }
            for action in actions {
                match action {
                    Action::Start { revision } => {
                        replicas.push(replica(
                            next,
                            revision,
                            ReplicaRun::Running { since: now },
                            false,
                        ));
                        next += 1;
                    }
                    Action::Drain { job } | Action::Stop { job, .. } => {
                        replicas.retain(|replica| replica.job != job);
                    }
                    Action::Forget { .. } => {}
                }
            }
            ready_seen.push(replicas.iter().filter(|replica| replica.ready).count() as u32);
        }
        (replicas, ready_seen)
    }

    #[test]
    fn a_rolling_update_replaces_one_at_a_time_and_keeps_every_replica_ready() {
        let (replicas, ready) = roll(UpdateStrategy::default(), true, 12);
        assert!(replicas.iter().all(|replica| replica.revision == 2));
        assert_eq!(replicas.len(), 3);
        assert!(ready.iter().all(|&count| count >= 3), "{ready:?}");
        // With room for one unavailable and no surge, never more than 3.
        let (replicas, ready) = roll(
            UpdateStrategy {
                max_surge: 0,
                max_unavailable: 1,
                progress_deadline: None,
            },
            true,
            12,
        );
        assert!(replicas.iter().all(|replica| replica.revision == 2));
        assert!(ready.iter().all(|&count| count >= 2), "{ready:?}");
    }

    #[test]
    fn a_new_revision_that_never_gets_ready_stops_the_rollout_and_keeps_the_old() {
        let (replicas, ready) = roll(UpdateStrategy::default(), false, 40);
        let old = replicas
            .iter()
            .filter(|replica| replica.revision == 1)
            .count();
        assert_eq!(old, 3, "{replicas:?}");
        assert_eq!(replicas.len(), 4, "one surge replica, no more");
        assert!(ready.iter().all(|&count| count == 3));
        let mut state = ControllerState::default();
        let (_, status) = reconcile(Time(40_000), &spec(3), 2, &replicas, &mut state);
        let rollout = status.rollout.unwrap_or_default();
        assert!(
            rollout.contains("rollout to revision 2 stopped"),
            "{rollout}"
        );
    }

    /// Autoscaling from 0 to `max_replicas` at 10 requests/s a replica.
    fn request_rate_rule(max_replicas: u32, window: Duration) -> Autoscale {
        Autoscale {
            min_replicas: 0,
            max_replicas,
            metric: ScaleMetric::RequestRate(10.0),
            window,
        }
    }

    fn request_load(rate: f64) -> Load {
        Load {
            request_rate: rate,
            ..Load::default()
        }
    }

    #[test]
    fn the_autoscalers_memory_holds_at_most_one_entry_per_replica_count() {
        let rule = request_rate_rule(8, Duration::from_secs(3600));
        let mut state = AutoscalerState::default();
        let mut current = 0;
        // An hour of rounds every 250 ms with a load going up and down.
        for round in 0..14_400u64 {
            let load = request_load(((round * 7919) % 97) as f64);
            current = autoscale(Time(round * 250), &rule, current, &load, &mut state).0;
            assert!(state.recent.len() <= 9, "{} entries", state.recent.len());
        }
        // The most wanted in the window (loads up to 96/s: 8 replicas) holds.
        assert_eq!(current, 8);
    }

    #[test]
    fn autoscaling_follows_the_load_up_at_once_and_down_after_the_window() {
        let rule = request_rate_rule(4, Duration::from_secs(10));
        let mut state = AutoscalerState::default();
        let load = request_load;
        // Idle at zero; a held request asks for one.
        assert_eq!(autoscale(Time(0), &rule, 0, &load(0.0), &mut state).0, 0);
        let held = Load {
            waiting: 2,
            ..Load::default()
        };
        assert_eq!(autoscale(Time(1_000), &rule, 0, &held, &mut state).0, 1);
        // Up at once, never past the maximum.
        assert_eq!(
            autoscale(Time(2_000), &rule, 1, &load(25.0), &mut state).0,
            3
        );
        assert_eq!(
            autoscale(Time(3_000), &rule, 3, &load(500.0), &mut state).0,
            4
        );
        // Down only once the window has no higher recommendation.
        assert_eq!(
            autoscale(Time(4_000), &rule, 4, &load(5.0), &mut state).0,
            4
        );
        assert_eq!(
            autoscale(Time(13_000), &rule, 4, &load(5.0), &mut state).0,
            4
        );
        assert_eq!(
            autoscale(Time(13_001), &rule, 4, &load(5.0), &mut state).0,
            1
        );
        assert_eq!(
            autoscale(Time(20_000), &rule, 1, &load(0.0), &mut state).0,
            1
        );
        assert_eq!(
            autoscale(Time(23_002), &rule, 1, &load(0.0), &mut state).0,
            0
        );
        // GPU utilisation: 3 replicas at 90% for a 60% target ask for 5 (max 4).
        let gpu = Autoscale {
            metric: ScaleMetric::GpuUtilization(60.0),
            min_replicas: 1,
            ..rule
        };
        let busy = Load {
            gpu_utilization: Some(90.0),
            ready: 3,
            ..Load::default()
        };
        let (count, why) = autoscale(Time(0), &gpu, 3, &busy, &mut AutoscalerState::default());
        assert_eq!(count, 4, "{why}");
    }

    #[test]
    fn checks_pass_and_fail_after_their_thresholds() {
        let mut probe = Probe::new(ProbeAction::Tcp);
        probe.failure_threshold = 2;
        probe.success_threshold = 2;
        probe.initial_delay = Duration::from_secs(5);
        let mut state = ProbeState::new(false);
        state.record(&probe, Time(5_000), Ok(()));
        assert!(!state.passing);
        state.record(&probe, Time(7_000), Ok(()));
        assert!(state.passing);
        state.record(&probe, Time(9_000), Err("refused".into()));
        assert!(state.passing, "one failure is not enough");
        state.record(&probe, Time(11_000), Err("refused".into()));
        assert!(!state.passing);
        assert_eq!(state.message.as_deref(), Some("refused"));
    }
}
