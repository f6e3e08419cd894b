//! Protocol A against the published FGD numbers (`../shared/traces`), on a
//! small slice: three seeds of `cpu200`, where the tie order matters most.
//! The published simulator breaks ties between nodes of equal score by a
//! random order of the nodes drawn per run; muster's `fgd` does the same
//! under `Ties::Random` and lands within 0.3 point of the published 94.8%
//! at 100% load, while the smallest name first falls behind.

use muster_sched::PlacementPolicy;
use muster_sim::{AllocationExperiment, Ties, parse_openb_nodes, parse_openb_tasks};

fn trace(name: &str) -> String {
    let path = format!(
        "{}/../../../shared/traces/openb/{name}",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{path}: {error} (the traces live in ../shared)"))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// Protocol A on `openb_pod_list_cpu200.csv` and the openb nodes.
fn cpu200() -> AllocationExperiment {
    let nodes = parse_openb_nodes(
        &trace("openb_node_list_gpu_node.csv"),
        "openb_node_list_gpu_node.csv",
    )
    .expect("nodes");
    let tasks = parse_openb_tasks(
        &trace("openb_pod_list_cpu200.csv"),
        "openb_pod_list_cpu200.csv",
    )
    .expect("tasks");
    AllocationExperiment::new(nodes, &tasks).expect("experiment")
}

/// The median over seeds 0-2 of `policy`'s allocation (%) at 100% load.
fn at_100(experiment: &AllocationExperiment, policy: PlacementPolicy) -> f64 {
    let capacity = experiment.capacity_milli() as f64;
    median(
        (0..3)
            .map(|seed| {
                let curve = experiment.run(policy, seed);
                curve.allocated_milli[100] as f64 * 100.0 / capacity
            })
            .collect(),
    )
}

#[test]
fn fgd_with_the_published_tie_order_matches_the_published_fgd_on_cpu200() {
    let experiment = cpu200();
    let at_100 = |ties: Ties| at_100(&experiment.clone().with_ties(ties), PlacementPolicy::Fgd);
    let random = at_100(Ties::Random);
    let name = at_100(Ties::Name);
    // Published FGD on cpu200: 94.8% at 100% load (traces/README.md).
    assert!(
        (random - 94.8).abs() <= 0.3,
        "fgd with random ties: {random:.2}% against the published 94.8%"
    );
    assert!(
        random - name > 0.3,
        "the tie order is a first-order effect: random {random:.2}%, name {name:.2}%"
    );
}

/// The default placement counts the GPUs a placement leaves without CPU
/// (`fgd-consolidate`'s stranding rule): on `cpu200`, where CPU-only tasks
/// are many, that lifts it well above the published FGD (95.7% against
/// 94.8% over ten seeds); without the rule it was 94.9%.
#[test]
fn the_default_counts_stranded_gpus_and_beats_the_published_fgd_on_cpu200() {
    let default = at_100(&cpu200(), PlacementPolicy::FgdConsolidate);
    assert!(
        default >= 94.8 + 0.5,
        "default on cpu200: {default:.2}% against the published FGD's 94.8%"
    );
}
