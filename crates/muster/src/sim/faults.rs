//! `muster sim faults`: the deterministic fault-injection simulation of the
//! control plane and its agents (`muster_sim::faults`), over many seeds in
//! parallel; prints a summary, or the failing seeds with their last events
//! and the command that replays each.

use crate::cli::FaultsArgs;
use anyhow::bail;
use muster_sim::{FaultConfig, FaultFailure, FaultReport, run_faults};
use std::time::Instant;

pub fn run(args: &FaultsArgs) -> anyhow::Result<()> {
    let config = FaultConfig {
        nodes: args.nodes as usize,
        jobs: args.sim_jobs as usize,
        duration_ms: args.duration.saturating_mul(1_000),
        loss: args.loss.clamp(0.0, 1.0),
        duplicate: args.duplicate.clamp(0.0, 1.0),
        max_delay_ms: args.max_delay_ms.max(1),
        partitions: !args.no_partitions,
        agent_crashes: !args.no_agent_crashes,
        host_crashes: !args.no_agent_crashes,
        server_crashes: !args.no_server_crashes,
        gpu_failures: !args.no_gpu_failures,
        fencing: !args.no_fencing,
        task_watchdog: !args.no_task_watchdog,
        ..FaultConfig::default()
    };
    let threads = args
        .jobs
        .map(|jobs| jobs as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .clamp(1, args.seeds as usize);
    eprintln!(
        "fault injection: seeds {}..{} on {threads} threads; {} nodes, {} jobs, {} s of faults",
        args.start,
        args.start + args.seeds,
        config.nodes,
        config.jobs,
        args.duration
    );
    let started = Instant::now();
    let seeds: Vec<u64> = (args.start..args.start + args.seeds).collect();
    let results: Vec<(u64, Result<FaultReport, FaultFailure>)> = super::parallel_map(
        &seeds,
        threads,
        &super::progress_bar(seeds.len(), "{bar:40} {pos}/{len} seeds, {elapsed} elapsed"),
        |&seed| (seed, run_faults(seed, &config)),
    );
    let reports: Vec<&FaultReport> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().ok())
        .collect();
    let failures: Vec<&FaultFailure> = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().err())
        .collect();
    let total = |f: fn(&FaultReport) -> u64| reports.iter().map(|r| f(r)).sum::<u64>();
    let detections: Vec<u64> = reports
        .iter()
        .flat_map(|r| r.detection_ms.clone())
        .collect();
    let requeues: Vec<u64> = reports.iter().flat_map(|r| r.requeue_ms.clone()).collect();
    println!(
        "{} of {} seeds passed in {:.1} s",
        reports.len(),
        results.len(),
        started.elapsed().as_secs_f64()
    );
    println!(
        "events {}, jobs succeeded {}, attempts {}",
        total(|r| r.events),
        total(|r| r.jobs_succeeded as u64),
        total(|r| r.attempts)
    );
    println!(
        "faults: partitions {}, agent crashes {}, host crashes {}, server crashes {}, GPU failures {}; fences {}, nodes lost {}, requeues {}",
        total(|r| r.partitions),
        total(|r| r.agent_crashes),
        total(|r| r.host_crashes),
        total(|r| r.server_crashes),
        total(|r| r.gpu_failures),
        total(|r| r.fences),
        total(|r| r.nodes_lost),
        total(|r| r.requeues)
    );
    println!("detection (fault → node lost): {}", spread(&detections));
    println!("requeue (fault → placed again): {}", spread(&requeues));
    if failures.is_empty() {
        return Ok(());
    }
    for failure in &failures {
        println!("\n{failure}");
        println!(
            "replay: muster sim faults --start {} --seeds 1{}",
            failure.seed,
            replay_flags(args)
        );
    }
    bail!("{} of {} seeds failed", failures.len(), results.len())
}

/// Mean and max, in simulated seconds.
fn spread(millis: &[u64]) -> String {
    if millis.is_empty() {
        return "none observed".to_string();
    }
    let mean = millis.iter().sum::<u64>() as f64 / millis.len() as f64 / 1000.0;
    let max = millis.iter().copied().max().unwrap_or(0) as f64 / 1000.0;
    format!("mean {mean:.1} s, max {max:.1} s over {}", millis.len())
}

/// The flags that change the simulation, to replay a seed exactly.
fn replay_flags(args: &FaultsArgs) -> String {
    let mut flags = format!(
        " --nodes {} --sim-jobs {} --duration {} --loss {} --duplicate {} --max-delay-ms {}",
        args.nodes, args.sim_jobs, args.duration, args.loss, args.duplicate, args.max_delay_ms
    );
    for (on, flag) in [
        (args.no_partitions, " --no-partitions"),
        (args.no_agent_crashes, " --no-agent-crashes"),
        (args.no_server_crashes, " --no-server-crashes"),
        (args.no_gpu_failures, " --no-gpu-failures"),
        (args.no_task_watchdog, " --no-task-watchdog"),
        (args.no_fencing, " --no-fencing"),
    ] {
        if on {
            flags.push_str(flag);
        }
    }
    flags
}
