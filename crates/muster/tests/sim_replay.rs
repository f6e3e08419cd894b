//! `muster sim replay` as a user runs it: the built binary on a tiny Philly
//! slice written to a temporary folder and the shipped small cluster spec.

mod common;

use common::{failure, muster, success};
use std::path::Path;
use std::process::Output;

/// 12 jobs from 3 teams on `examples/clusters/small.yaml` (2 nodes x 8 GPUs,
/// 2 x 4): enough to queue; the 32-GPU job needs 4 nodes of 8 GPUs and
/// never fits.
const TRACE: &str = "timestamp,duration,num_gpus,gpu_time,cluster\n\
                     2017-10-01 00:00:00,7200.0,8,57600.0,vc-a\n\
                     2017-10-01 00:05:00,3600.0,16,57600.0,vc-b\n\
                     2017-10-01 00:10:00,600.0,1,600.0,vc-c\n\
                     2017-10-01 00:10:30,1800.0,4,7200.0,vc-c\n\
                     2017-10-01 00:11:00,900.0,2,1800.0,vc-a\n\
                     2017-10-01 00:20:00,36000.0,8,288000.0,vc-b\n\
                     2017-10-01 00:30:00,120.0,1,120.0,vc-c\n\
                     2017-10-01 01:00:00,5400.0,4,21600.0,vc-a\n\
                     2017-10-01 01:00:00,300.0,32,9600.0,vc-b\n\
                     2017-10-01 02:00:00,60.0,1,60.0,vc-c\n\
                     2017-10-01 03:00:00,14400.0,12,172800.0,vc-a\n\
                     2017-10-01 03:30:00,450.5,1,450.5,vc-c\n";

const SMALL_CLUSTER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../examples/clusters/small.yaml"
);

fn replay(dir: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "sim",
        "replay",
        "--trace",
        "trace.csv",
        "--cluster",
        SMALL_CLUSTER,
    ];
    args.extend_from_slice(extra);
    muster(dir, &args)
}

#[test]
fn sim_replay_writes_results_and_plots_deterministically() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("trace.csv"), TRACE).unwrap();
    let stdout = success(&replay(
        dir.path(),
        &[
            "--policies",
            "fifo,default",
            "--checkpoint-interval",
            "1h",
            "--seed",
            "7",
            "--out",
            "out",
        ],
    ));
    assert!(stdout.contains("fifo"), "{stdout}");
    assert!(stdout.contains("default"), "{stdout}");
    assert!(stdout.contains("11/1"), "completed/unschedulable: {stdout}");

    let text = std::fs::read_to_string(dir.path().join("out/results.json")).unwrap();
    let results: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(results["trace"], "trace.csv");
    assert_eq!(results["format"], "philly");
    assert_eq!(results["jobs"], 12);
    assert_eq!(results["cluster"]["file"], "small.yaml");
    assert_eq!(results["cluster"]["nodes"], 4);
    assert_eq!(results["cluster"]["gpus"], 24);
    assert_eq!(results["cluster"]["max_gpus_per_node"], 8);
    assert_eq!(results["policies"], serde_json::json!(["fifo", "default"]));
    assert_eq!(results["seed"], 7);
    assert_eq!(results["checkpoint_interval_s"], 3600);
    let runs = results["results"].as_array().unwrap();
    assert_eq!(runs.len(), 2);
    for (run, policy) in runs.iter().zip(["fifo", "default"]) {
        assert_eq!(run["policy"], policy);
        assert_eq!(run["oracle"], false);
        assert_eq!(run["jobs"], 12);
        assert_eq!(run["completed"], 11);
        assert_eq!(run["unschedulable"], 1);
        let mean = run["mean_jct_s"].as_f64().unwrap();
        let p99 = run["p99_jct_s"].as_f64().unwrap();
        assert!(0.0 < mean && mean <= p99, "{run}");
        let utilization = run["mean_gpu_utilization"].as_f64().unwrap();
        assert!(0.0 < utilization && utilization <= 1.0, "{run}");
        assert!(!run["jct_cdf"].as_array().unwrap().is_empty());
        assert!(!run["timeline"].as_array().unwrap().is_empty());
        let queues = run["per_queue"].as_object().unwrap();
        let names: Vec<&String> = queues.keys().collect();
        assert_eq!(names, ["vc-a", "vc-b", "vc-c"]);
    }
    // Default gives the teams guaranteed shares; fifo pools them.
    assert!(runs[1]["per_queue"]["vc-b"]["guaranteed_share"].as_f64() > Some(0.0));
    assert_eq!(runs[0]["per_queue"]["vc-b"]["guaranteed_share"], 0.0);
    // Floats are rounded to 3 decimals.
    for number in text
        .split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .filter(|token| token.contains('.'))
    {
        let decimals = number.len() - number.find('.').unwrap() - 1;
        assert!(decimals <= 3, "{number} in results.json");
    }

    for plot in ["jct_cdf.svg", "utilization.svg", "queue_length.svg"] {
        let svg = std::fs::read_to_string(dir.path().join("out").join(plot)).unwrap();
        assert!(svg.starts_with("<svg"), "{plot}");
        assert!(svg.contains("default"), "{plot} has a legend");
    }

    // Same inputs: byte-identical results, however many threads.
    success(&replay(
        dir.path(),
        &[
            "--policies",
            "fifo,default",
            "--checkpoint-interval",
            "1h",
            "--seed",
            "7",
            "--out",
            "again",
            "--jobs",
            "1",
        ],
    ));
    let again = std::fs::read_to_string(dir.path().join("again/results.json")).unwrap();
    assert_eq!(text, again);
}

#[test]
fn the_oracle_is_labelled() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("trace.csv"), TRACE).unwrap();
    let stdout = success(&replay(
        dir.path(),
        &["--policies", "sjf-oracle,las", "--out", "out"],
    ));
    assert!(stdout.contains("sjf-oracle (oracle)"), "{stdout}");
    let text = std::fs::read_to_string(dir.path().join("out/results.json")).unwrap();
    let results: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(results["results"][0]["oracle"], true);
    assert_eq!(results["results"][1]["oracle"], false);
}

#[test]
fn a_malformed_row_names_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let bad = TRACE.replace("00:10:30,1800.0,4,", "00:10:30,1800.0,four,");
    std::fs::write(dir.path().join("trace.csv"), bad).unwrap();
    let stderr = failure(&replay(
        dir.path(),
        &["--policies", "fifo,default", "--out", "out"],
    ));
    assert!(
        stderr.contains(
            "error: trace.csv:5: column num_gpus: expected an integer 1..=4096, got \"four\""
        ),
        "{stderr}"
    );
    assert!(!dir.path().join("out").exists(), "nothing is written");
}

#[test]
fn a_bad_cluster_spec_names_the_field() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("trace.csv"), TRACE).unwrap();
    std::fs::write(
        dir.path().join("cluster.yaml"),
        "node_groups:\n  - name: a\n    count: 2\n    gpu_model: T4\n    gpus: 8\n    \
         cpus: 8\n    memory: 64GiB\n    nvlink_domains: 3\n",
    )
    .unwrap();
    let stderr = failure(&muster(
        dir.path(),
        &[
            "sim",
            "replay",
            "--trace",
            "trace.csv",
            "--cluster",
            "cluster.yaml",
        ],
    ));
    assert!(
        stderr.contains(
            "error: cannot read the cluster spec cluster.yaml:\n\
             node_groups[0].nvlink_domains: must divide gpus (8) evenly"
        ),
        "{stderr}"
    );
}

#[test]
fn an_unknown_policy_lists_the_accepted_ones() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = failure(&replay(dir.path(), &["--policies", "fifo,srtf"]));
    assert!(
        stderr.contains("unknown replay policy \"srtf\"; accepted: fifo, las, sjf-oracle, default"),
        "{stderr}"
    );
}

#[test]
fn an_openb_pod_list_replays_on_an_openb_node_list() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("nodes.csv"),
        "sn,cpu_milli,memory_mib,gpu,model\nn0,16000,65536,2,T4\nn1,32000,131072,4,V100M32\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("pods.csv"),
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,deletion_time,scheduled_time\n\
         p0,4000,8192,2,1000,,LS,Running,0,3600,0\n\
         p1,2000,4096,1,500,,BE,Running,60,660,60\n\
         p2,8000,16384,4,1000,V100M32,LS,Running,120,7320,120\n\
         p3,1000,2048,0,0,,BE,Running,180,240,180\n\
         p4,2000,4096,4,1000,V100M32,LS,Running,300,1200,300\n",
    )
    .unwrap();
    let stdout = success(&muster(
        dir.path(),
        &[
            "sim",
            "replay",
            "--trace",
            "pods.csv",
            "--format",
            "openb",
            "--nodes-csv",
            "nodes.csv",
            "--policies",
            "fifo,default",
            "--out",
            "out",
        ],
    ));
    assert!(stdout.contains("5/0"), "{stdout}");
    let text = std::fs::read_to_string(dir.path().join("out/results.json")).unwrap();
    let results: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(results["format"], "openb");
    assert_eq!(results["cluster"]["kind"], "openb node list");
    assert_eq!(results["cluster"]["gpus"], 6);
    // p0 fills n0's two T4s, so p1's half GPU goes on a V100: p2 (all four
    // V100s) waits for it until 660 s and ends at 7860 s; p4 (four V100s
    // too) is queued from 300 s until then.
    assert_eq!(results["results"][0]["p99_queueing_s"], 7560.0);

    let stderr = failure(&muster(
        dir.path(),
        &[
            "sim",
            "replay",
            "--trace",
            "pods.csv",
            "--format",
            "openb",
            "--nodes-csv",
            "nodes.csv",
            "--cluster",
            SMALL_CLUSTER,
        ],
    ));
    assert!(stderr.contains("cannot be used with"), "{stderr}");
}
