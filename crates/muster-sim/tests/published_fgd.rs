//! Protocol A against the published FGD numbers (`../shared/traces`), on a
//! small slice: three seeds of `cpu200`, where the tie order matters most,
//! and of `default`, where the default placement must reach 96%.
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

/// Protocol A on `openb_pod_list_{name}.csv` and the openb nodes.
fn openb(name: &str) -> AllocationExperiment {
    let nodes = parse_openb_nodes(
        &trace("openb_node_list_gpu_node.csv"),
        "openb_node_list_gpu_node.csv",
    )
    .expect("nodes");
    let file = format!("openb_pod_list_{name}.csv");
    let tasks = parse_openb_tasks(&trace(&file), &file).expect("tasks");
    AllocationExperiment::new(nodes, &tasks).expect("experiment")
}

fn cpu200() -> AllocationExperiment {
    openb("cpu200")
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
/// are many, that lifts it well above the published FGD (96.0% against
/// 94.8% over ten seeds); without the rule it was 94.9%.
#[test]
fn the_default_counts_stranded_gpus_and_beats_the_published_fgd_on_cpu200() {
    let default = at_100(&cpu200(), PlacementPolicy::FgdConsolidate);
    assert!(
        default >= 94.8 + 0.5,
        "default on cpu200: {default:.2}% against the published FGD's 94.8%"
    );
}

/// The default places a share where its GPU is expected to end least
/// wasted (`TypicalWorkload::expected_share_waste`): on `default` that
/// takes it to 96.1% over ten seeds (95.8% without the rule, 95.2% for
/// the published FGD); these three seeds give 96.08-96.15%, 95.76-95.81%
/// without it, and 95.24-95.35% under muster's `fgd`.
#[test]
fn the_default_places_shares_by_expected_waste_and_reaches_96_percent_on_default() {
    let experiment = openb("default");
    let default = at_100(&experiment, PlacementPolicy::FgdConsolidate);
    assert!(
        default >= 96.0,
        "default on the default trace: {default:.2}%, 96.0% asked (issue 14)"
    );
    let fgd = at_100(&experiment, PlacementPolicy::Fgd);
    assert!(
        default - fgd >= 0.5,
        "default {default:.2}% against muster's FGD {fgd:.2}%"
    );
}
