//! `muster sim services`: autoscaled services with a day's request curve
//! beside a stream of training jobs, with the inference pool dedicated or
//! lent to training (see `muster_sim::services`).

use crate::cli::ServicesSimArgs;
use muster_sim::{PoolSharing, ServiceMixConfig, run_service_mix};
use std::time::Duration;

pub fn run(args: &ServicesSimArgs) -> anyhow::Result<()> {
    let config = ServiceMixConfig {
        inference_nodes: args.inference_nodes,
        general_nodes: args.general_nodes,
        gpus_per_node: args.gpus_per_node,
        services: args.services,
        peak_rps: args.peak_rps,
        trough: args.trough,
        target_rps: args.target_rps,
        capacity_rps: args.target_rps * 1.25,
        max_replicas: args.max_replicas,
        training_load: args.training_load,
        replica_startup: Duration::from_secs(args.replica_startup),
        grace: Duration::from_secs(args.grace),
        hours: args.hours,
        seed: args.seed,
        ..ServiceMixConfig::default()
    };
    let results: Vec<_> = std::thread::scope(|scope| {
        let runs: Vec<_> = [PoolSharing::Dedicated, PoolSharing::Borrow]
            .into_iter()
            .map(|sharing| {
                let config = &config;
                scope.spawn(move || run_service_mix(config, sharing))
            })
            .collect();
        runs.into_iter()
            .map(|run| {
                run.join()
                    .map_err(|_| anyhow::anyhow!("a simulation panicked"))
            })
            .collect::<anyhow::Result<_>>()
    })?;
    println!(
        "{} h, {} inference + {} general nodes of {} GPUs; {} services (peak {} requests/s, \
         trough {:.0}%, {} a replica, at most {} replicas, {} s to start); training at {:.0}% of \
         the cluster's GPUs; seed {}",
        config.hours,
        config.inference_nodes,
        config.general_nodes,
        config.gpus_per_node,
        config.services,
        config.peak_rps,
        config.trough * 100.0,
        config.target_rps,
        config.max_replicas,
        config.replica_startup.as_secs(),
        config.training_load * 100.0,
        config.seed
    );
    println!();
    println!(
        "| inference pool | served % | replica-min short | replica wait (min) | training GPU-h | \
         training jobs | training JCT (h) | preemptions | GPU-h lost | cluster allocated % | \
         inference pool allocated % |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for result in &results {
        println!(
            "| {} | {:.2} | {:.0} | {:.2} | {:.0} | {} | {:.2} | {} | {:.1} | {:.1} | {:.1} |",
            result.sharing.name(),
            result.served_pct,
            result.replica_minutes_short,
            result.replica_wait_min,
            result.training_gpu_hours_done,
            result.training_jobs_done,
            result.training_jct_h,
            result.training_preemptions,
            result.training_gpu_hours_lost,
            result.cluster_allocated_pct,
            result.inference_allocated_pct
        );
    }
    if let Some(out) = &args.out {
        let text = serde_json::to_string_pretty(&serde_json::json!({
            "hours": config.hours,
            "seed": config.seed,
            "results": results,
        }))?;
        std::fs::write(out, text + "\n")
            .map_err(|error| anyhow::anyhow!("cannot write {}: {error}", out.display()))?;
    }
    Ok(())
}
