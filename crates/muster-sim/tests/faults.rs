//! Issue 5: the control plane and its agents under seeded faults (loss,
//! duplication, delay, partitions, agent, host and server crashes), with
//! invariants after every event. A failure names its seed; replay it with
//! `muster sim faults --start SEED --seeds 1`.

use muster_sim::{FaultConfig, FaultFailure, FaultReport, run_faults};

/// Runs `seeds` on every core.
fn run_seeds(
    seeds: std::ops::Range<u64>,
    config: &FaultConfig,
) -> Vec<Result<FaultReport, FaultFailure>> {
    let seeds: Vec<u64> = seeds.collect();
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8);
    let chunk = seeds.len().div_ceil(threads).max(1);
    std::thread::scope(|scope| {
        let handles: Vec<_> = seeds
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|&seed| run_faults(seed, config))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|handle| handle.join().expect("a simulation thread panicked"))
            .collect()
    })
}

#[test]
fn two_hundred_seeds_with_every_fault_keep_every_property() {
    let config = FaultConfig::default();
    let results = run_seeds(0..200, &config);
    let failures: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of 200 seeds failed; first:\n{}",
        failures.len(),
        failures[0]
    );
    let reports: Vec<&FaultReport> = results.iter().filter_map(|r| r.as_ref().ok()).collect();
    let sum = |f: fn(&FaultReport) -> u64| reports.iter().map(|r| f(r)).sum::<u64>();
    // The faults did happen, and the cluster recovered from them.
    assert!(
        sum(|r| r.partitions) > 200,
        "partitions: {}",
        sum(|r| r.partitions)
    );
    assert!(sum(|r| r.agent_crashes) > 100);
    assert!(sum(|r| r.host_crashes) > 100);
    assert!(sum(|r| r.server_crashes) > 100);
    assert!(
        sum(|r| r.nodes_lost) > 50,
        "nodes lost: {}",
        sum(|r| r.nodes_lost)
    );
    assert!(
        sum(|r| r.requeues) > 20,
        "requeues: {}",
        sum(|r| r.requeues)
    );
    assert!(sum(|r| r.fences) > 50, "fences: {}", sum(|r| r.fences));
    assert!(
        sum(|r| r.gpu_failures) > 50,
        "GPU failures: {}",
        sum(|r| r.gpu_failures)
    );
}

#[test]
fn the_same_seed_gives_the_same_run_and_other_seeds_differ() {
    let config = FaultConfig::default();
    let first = run_faults(7, &config).unwrap_or_else(|failure| panic!("{failure}"));
    let again = run_faults(7, &config).unwrap_or_else(|failure| panic!("{failure}"));
    assert_eq!(first, again);
    let hashes: std::collections::BTreeSet<u64> = (0..8)
        .map(|seed| run_faults(seed, &config).map_or(0, |report| report.hash))
        .collect();
    assert_eq!(hashes.len(), 8, "eight seeds, eight different event logs");
    assert!(!hashes.contains(&0));
}

#[test]
fn without_fencing_some_seed_runs_a_job_twice_and_is_named() {
    let config = FaultConfig {
        fencing: false,
        ..FaultConfig::default()
    };
    let failure = (0..50)
        .find_map(|seed| run_faults(seed, &config).err())
        .expect("without fencing a partitioned node keeps running a re-queued job");
    let text = failure.to_string();
    assert!(text.contains("runs twice"), "{text}");
    assert!(
        text.starts_with(&format!("seed {}:", failure.seed)),
        "{text}"
    );
    assert!(failure.last_events.len() >= 20, "{text}");
    // The failure replays from its seed.
    assert_eq!(run_faults(failure.seed, &config).err(), Some(failure));
}

/// Issue 9: a heartbeat duplicated on the way, sent before node-0 started
/// a task, reached the server after the job was stopped; the server took
/// the missing report for an exit and placed allocation 14 on the GPU that
/// allocation 7 still held, and node-0 started 14 before stopping 7, in one
/// step (a GPU ran two tasks). Fixed by heartbeat sequence numbers and by
/// the agent core starting a task only once its GPUs are free.
#[test]
fn seed_63111_no_gpu_runs_two_tasks() {
    check_seed(63_111);
}

/// Issue 9: the same duplicated-heartbeat race let a gang's new attempt
/// start on another node while its old attempt still ran (a job ran twice).
#[test]
fn seed_66200_no_job_runs_twice() {
    check_seed(66_200);
}

/// Seeds that run a job twice when the control plane applies a heartbeat
/// that is not newer than the last one it applied (found by a sweep with
/// that check removed: 122 of 20,000 seeds failed, these first): they keep
/// the sequence-number rule tested end to end.
#[test]
fn seeds_313_and_317_need_heartbeat_sequence_numbers() {
    check_seed(313);
    check_seed(317);
}

/// `muster sim faults --start SEED --seeds 1 --nodes 4 --sim-jobs 12
/// --duration 60 --loss 0.05 --duplicate 0.03 --max-delay-ms 400`.
fn check_seed(seed: u64) {
    let config = FaultConfig {
        nodes: 4,
        jobs: 12,
        duration_ms: 60_000,
        loss: 0.05,
        duplicate: 0.03,
        max_delay_ms: 400,
        ..FaultConfig::default()
    };
    if let Err(failure) = run_faults(seed, &config) {
        panic!("{failure}");
    }
}
