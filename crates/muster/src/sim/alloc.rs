//! `muster sim alloc`: Protocol A (allocation under load) for several
//! policies and seeds, in parallel; prints a table and writes
//! `results.json` and `alloc.svg`.

use super::{file_name, read_openb_nodes, read_openb_tasks};
use crate::cli::AllocArgs;
use anyhow::Context;
use muster_sched::PlacementPolicy;
use muster_sim::{
    AllocationCurve, AllocationExperiment, AllocationReport, PolicyResult, summarize,
};
use std::collections::BTreeMap;
use std::time::Instant;

pub fn run(args: &AllocArgs) -> anyhow::Result<()> {
    let files = &args.files;
    let nodes = read_openb_nodes(&files.nodes)?;
    let tasks = read_openb_tasks(&files.tasks)?;
    let experiment = AllocationExperiment::new(nodes, &tasks)
        .with_context(|| format!("cannot simulate {}", files.nodes.display()))?
        .with_ties(args.ties);

    // `default` is one of the others: each distinct policy runs once per seed.
    let seeds: Vec<u64> = (0..args.seeds).collect();
    let distinct: Vec<PlacementPolicy> = args
        .policies
        .iter()
        .map(|named| named.policy)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let runs: Vec<(PlacementPolicy, u64)> = distinct
        .iter()
        .flat_map(|&policy| seeds.iter().map(move |&seed| (policy, seed)))
        .collect();
    let threads = args
        .jobs
        .map(|jobs| jobs as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(runs.len())
        .max(1);
    eprintln!(
        "allocation under load: {} nodes, {:.0} GPUs, {} tasks in the pod list; {} runs on {} threads",
        experiment.cluster().len(),
        experiment.capacity_milli() as f64 / 1000.0,
        experiment.task_count(),
        runs.len(),
        threads
    );
    let started = Instant::now();
    let progress = super::progress_bar(
        runs.len(),
        "{bar:40} {pos}/{len} runs, {elapsed} elapsed, ~{eta} left",
    );
    let curves: Vec<AllocationCurve> =
        super::parallel_map(&runs, threads, &progress, |&(policy, seed)| {
            experiment.run(policy, seed)
        });
    eprintln!("done in {:.1} s", started.elapsed().as_secs_f64());

    let mut by_policy: BTreeMap<PlacementPolicy, Vec<AllocationCurve>> = BTreeMap::new();
    for (&(policy, _), curve) in runs.iter().zip(curves) {
        by_policy.entry(policy).or_default().push(curve);
    }
    let mut results: Vec<PolicyResult> = Vec::new();
    for named in &args.policies {
        if results.iter().any(|result| result.policy == named.name) {
            continue;
        }
        let curves = by_policy
            .get(&named.policy)
            .context("internal error: a policy was not run")?;
        results.push(summarize(
            &named.name,
            &seeds,
            curves,
            experiment.capacity_milli(),
        ));
    }

    let report = AllocationReport::new(
        &experiment,
        &file_name(&files.nodes),
        &file_name(&files.tasks),
        results,
    );
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let json_path = args.out.join("results.json");
    let json = report.to_json().context("cannot serialize the results")?;
    std::fs::write(&json_path, json)
        .with_context(|| format!("cannot write {}", json_path.display()))?;
    let svg_path = args.out.join("alloc.svg");
    let svg = super::plot::allocation_svg(&report).context("cannot draw the plot")?;
    std::fs::write(&svg_path, svg)
        .with_context(|| format!("cannot write {}", svg_path.display()))?;

    print!("{}", table(&report, args.seeds));
    eprintln!("wrote {} and {}", json_path.display(), svg_path.display());
    Ok(())
}

/// The table printed on stdout: medians over seeds.
fn table(report: &AllocationReport, seeds: u64) -> String {
    let mut text = format!(
        "GPU allocation ratio under load, median of {seeds} seed{} ({} nodes, {} GPUs, {})\n",
        if seeds == 1 { "" } else { "s" },
        report.nodes,
        report.gpus,
        report.tasks_file
    );
    text.push_str(&format!(
        "{:<10} {:>16} {:>16} {:>26}\n",
        "policy", "alloc % at 100%", "alloc % at 130%", "unallocated GPUs at 100%"
    ));
    for result in &report.policies {
        text.push_str(&format!(
            "{:<10} {:>16.1} {:>16.1} {:>26.1}\n",
            result.policy,
            result.alloc_ratio_at_100,
            result.alloc_ratio_at_130,
            result.unallocated_gpus_at_100
        ));
    }
    text
}
