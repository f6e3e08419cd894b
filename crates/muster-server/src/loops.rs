//! The server's background loops: the scheduling loop (every interval or
//! when woken, the engine runs on a blocking thread, never on the async
//! ones) and the lease ticker (every second, so lost nodes are noticed).

use crate::core::{Shared, now};
use muster_control::Input;
use muster_sched::{SchedulingPolicy, schedule};
use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::SeedableRng;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::sync::watch;

/// A generator for the scheduler's random choices, seeded by the operating
/// system.
fn seeded_rng() -> ChaCha8Rng {
    let mut seed = [0u8; 32];
    if let Err(error) = getrandom::fill(&mut seed) {
        tracing::warn!(%error, "no random seed from the operating system; using a fixed one");
    }
    ChaCha8Rng::from_seed(seed)
}

pub async fn scheduling_loop(
    shared: Arc<Shared>,
    policy: SchedulingPolicy,
    interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let mut rng = seeded_rng();
    let mut ticker = tokio::time::interval(interval.max(Duration::from_millis(10)));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // When not before: wake-ups that come while a cycle runs (a burst of
    // submissions) share the next cycle, and cycles use at most about a
    // third of a core, however long a cycle over many pending jobs takes.
    let mut next_cycle = tokio::time::Instant::now();
    // A cycle that changed nothing, over a state that has not changed
    // since, would decide the same: skipped, but for a cycle every
    // IDLE_RECHECK (priorities age, fair share decays).
    let mut settled: Option<(u64, tokio::time::Instant)> = None;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            () = shared.wake_scheduler.notified() => {}
            _ = shutdown.changed() => break,
        }
        if *shutdown.borrow() {
            break;
        }
        tokio::select! {
            _ = tokio::time::sleep_until(next_cycle) => {}
            _ = shutdown.changed() => break,
        }
        let cycle_started = tokio::time::Instant::now();
        if shared.read_only_reason().is_some() {
            continue;
        }
        let version = shared.state_version.load(Ordering::SeqCst);
        if let Some((seen, at)) = settled
            && seen == version
            && at.elapsed() < IDLE_RECHECK
        {
            continue;
        }
        // No job waits: nothing to decide, and no snapshot of every node
        // (32,768 node specs copied every second) is built to find that out.
        if !shared.read().control().any_pending() {
            continue;
        }
        let (snapshot, pending) = shared.read().control().scheduling_input(now());
        if pending.is_empty() {
            continue;
        }
        let cycle_policy = policy.clone();
        let joined = tokio::task::spawn_blocking(move || {
            let outcome = schedule(&snapshot, &pending, &cycle_policy, &mut rng);
            (outcome, rng, snapshot, pending)
        })
        .await;
        match joined {
            Ok((outcome, returned, snapshot, pending)) => {
                rng = returned;
                match outcome {
                    Ok(outcome) => {
                        shared.apply_outcome(&outcome);
                        forecast(&shared, &policy, snapshot, pending, outcome.clone());
                        shared
                            .instruments
                            .cycle_seconds
                            .observe(cycle_started.elapsed().as_secs_f64());
                        let after = shared.state_version.load(Ordering::SeqCst);
                        // Nothing changed: not even a pending reason.
                        settled = (after == version).then_some((version, cycle_started));
                    }
                    Err(error) => tracing::error!(%error, "a scheduling cycle failed"),
                }
            }
            Err(error) => {
                tracing::error!(%error, "a scheduling cycle panicked");
                rng = seeded_rng();
            }
        }
        next_cycle = cycle_started + cycle_started.elapsed() * 3 + MIN_CYCLE_GAP;
    }
}

/// Forecasts when each job the cycle left pending will start (the engine
/// run ahead, [`muster_sched::forecast_starts`]) on a blocking thread of its
/// own, so that the next cycle does not wait for it; skipped while the
/// previous forecast still runs (on a large cluster forecasts then refresh
/// as often as they can, not every cycle).
fn forecast(
    shared: &Arc<Shared>,
    policy: &SchedulingPolicy,
    snapshot: muster_sched::Snapshot,
    pending: Vec<muster_sched::PendingJob>,
    outcome: muster_sched::Outcome,
) {
    if outcome.pending.is_empty() || shared.forecasting.swap(true, Ordering::SeqCst) {
        return;
    }
    /// Clears the flag however the forecast ends (a panic included).
    struct Done(Arc<Shared>);
    impl Drop for Done {
        fn drop(&mut self) {
            self.0.forecasting.store(false, Ordering::SeqCst);
        }
    }
    let done = Done(shared.clone());
    let policy = policy.clone();
    tokio::task::spawn_blocking(move || {
        // Estimates for every running and pending job: off the async
        // threads, like the plan.
        let (ahead, waiting) = done.0.read().control().forecast_input(snapshot, pending);
        // The plan's own generator: placement ties are broken by node order,
        // so it matters only to the random placement policy.
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        match muster_sched::forecast_starts(
            &ahead,
            &waiting,
            &policy,
            &outcome,
            None,
            &muster_sched::ForecastLimits::default(),
            &mut rng,
        ) {
            Ok(forecasts) => done.0.apply_forecasts(forecasts),
            Err(error) => tracing::warn!(%error, "a start forecast failed"),
        }
    });
}

/// The longest a settled scheduler waits before a cycle with no change.
const IDLE_RECHECK: Duration = Duration::from_secs(5);

/// The least time between the starts of two scheduling cycles.
const MIN_CYCLE_GAP: Duration = Duration::from_millis(5);

pub async fn lease_ticker(shared: Arc<Shared>, mut shutdown: watch::Receiver<bool>) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.changed() => break,
        }
        if *shutdown.borrow() {
            break;
        }
        if shared.read_only_reason().is_some() {
            continue;
        }
        match shared.apply(Input::Tick, Default::default()) {
            Ok((outputs, _durable)) => {
                for output in outputs {
                    if let muster_control::Output::NodeChanged(node) = output {
                        tracing::info!(node = %node, "node changed state (lease)");
                    }
                }
            }
            Err(error) => tracing::error!(error = %error.body.message, "the lease tick failed"),
        }
        forget_removed_nodes(&shared);
        shared.flush_audit();
        crate::accounting::tick(&shared).await;
    }
    shared.flush_audit();
    // The minutes still open are written: a restart adds to the same rows.
    let open = shared.accounting.take_open();
    if !open.is_empty() && shared.read_only_reason().is_none() {
        let _ = shared
            .writer
            .queue(crate::store::Batch {
                usage: open,
                ..Default::default()
            })
            .wait()
            .await;
    }
}

/// Telemetry and usage of nodes no longer registered go with them.
fn forget_removed_nodes(shared: &Shared) {
    let core = shared.read();
    let registered = |node: &String| {
        core.control()
            .node(&muster_model::NodeName(node.clone()))
            .is_some()
    };
    if let Ok(mut telemetry) = shared.telemetry.lock()
        && telemetry.len() > core.control().nodes().count()
    {
        telemetry.retain(|node, _| registered(node));
    }
    if let Ok(mut usage) = shared.usage.lock()
        && usage.len() > core.control().nodes().count()
    {
        usage.retain(|node, _| registered(node));
    }
    if let Ok(mut history) = shared.history.lock()
        && history.len() > core.control().nodes().count()
    {
        history.retain(registered);
    }
}
