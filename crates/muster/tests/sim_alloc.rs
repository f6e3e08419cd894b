//! `muster sim alloc` as a user runs it: the built binary on tiny traces
//! written to a temporary folder.

mod common;

use common::{failure, muster, success};
use std::path::Path;
use std::process::Output;

const NODES: &str = "sn,cpu_milli,memory_mib,gpu,model\n\
                     n0,16000,65536,2,T4\n\
                     n1,16000,65536,2,T4\n\
                     n2,32000,131072,4,V100M32\n";

const TASKS: &str = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos\n\
                     a,4000,8192,1,1000,,LS\n\
                     b,2000,4096,1,500,,LS\n\
                     c,8000,16384,2,1000,V100M32,LS\n\
                     d,1000,2048,0,0,,BE\n\
                     e,2000,4096,1,250,T4,LS\n";

/// `muster sim alloc --nodes nodes.csv --tasks TASKS --out OUT` and `extra`.
fn alloc(dir: &Path, tasks: &str, out: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "sim",
        "alloc",
        "--nodes",
        "nodes.csv",
        "--tasks",
        tasks,
        "--out",
        out,
    ];
    args.extend_from_slice(extra);
    muster(dir, &args)
}

#[test]
fn sim_alloc_writes_results_and_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("nodes.csv"), NODES).unwrap();
    std::fs::write(dir.path().join("tasks.csv"), TASKS).unwrap();
    let stdout = success(&alloc(
        dir.path(),
        "tasks.csv",
        "out",
        &["--seeds", "2", "--ties", "name"],
    ));
    for policy in ["fgd", "best-fit", "packing", "random", "default"] {
        assert!(
            stdout.contains(policy),
            "the table lists {policy}: {stdout}"
        );
    }

    let text = std::fs::read_to_string(dir.path().join("out/results.json")).unwrap();
    let results: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(results["nodes"], 3);
    assert_eq!(results["gpus"], 8.0);
    assert_eq!(results["tasks"], 5);
    let policies = results["policies"].as_array().unwrap();
    let names: Vec<&str> = policies
        .iter()
        .map(|p| p["policy"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["fgd", "best-fit", "packing", "random", "default"]);
    for policy in policies {
        assert_eq!(policy["seeds"], serde_json::json!([0, 1]));
        let curve = policy["alloc_ratio_pct"].as_array().unwrap();
        assert_eq!(curve.len(), 131, "one point per 1% of load, 0..=130");
        assert_eq!(curve[0], 0.0);
        let at_100 = policy["alloc_ratio_at_100"].as_f64().unwrap();
        let at_130 = policy["alloc_ratio_at_130"].as_f64().unwrap();
        assert_eq!(curve[100].as_f64(), Some(at_100));
        assert_eq!(curve[130].as_f64(), Some(at_130));
        assert!(
            0.0 < at_100 && at_100 <= at_130 && at_130 <= 100.0,
            "{policy}"
        );
        let unallocated = policy["unallocated_gpus_at_100"].as_f64().unwrap();
        assert!((unallocated - 8.0 * (1.0 - at_100 / 100.0)).abs() < 1e-3);
    }
    assert_eq!(
        policies[0]["alloc_ratio_pct"], policies[4]["alloc_ratio_pct"],
        "on this slice, with name ties, the consolidating default places as fgd does"
    );
    // `default` is `fgd-consolidate`, reported under its own name.
    let named = success(&alloc(
        dir.path(),
        "tasks.csv",
        "named",
        &["--seeds", "2", "--policies", "fgd-consolidate,default"],
    ));
    assert!(named.contains("fgd-consolidate"), "{named}");
    let named: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.path().join("named/results.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(named["policies"][1]["policy"], "default");
    assert_eq!(
        named["policies"][0]["alloc_ratio_pct"],
        named["policies"][1]["alloc_ratio_pct"]
    );

    let svg = std::fs::read_to_string(dir.path().join("out/alloc.svg")).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(100)]);
    assert!(svg.contains("best-fit"));

    // Same inputs and seeds: byte-identical results.
    success(&alloc(
        dir.path(),
        "tasks.csv",
        "again",
        &["--seeds", "2", "--jobs", "1", "--ties", "name"],
    ));
    let text_again = std::fs::read_to_string(dir.path().join("again/results.json")).unwrap();
    assert_eq!(text, text_again);
    // The published random tie order (the default) is drawn from the seed:
    // deterministic too.
    for out in ["random-1", "random-2"] {
        success(&alloc(dir.path(), "tasks.csv", out, &["--seeds", "3"]));
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("random-1/results.json")).unwrap(),
        std::fs::read_to_string(dir.path().join("random-2/results.json")).unwrap()
    );
}

#[test]
fn a_malformed_trace_names_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("nodes.csv"), NODES).unwrap();
    let bad = TASKS.replace("b,2000,4096,1,500", "b,2000,4096,1,half");
    std::fs::write(dir.path().join("tasks.csv"), bad).unwrap();
    let stderr = failure(&alloc(dir.path(), "tasks.csv", "out", &["--seeds", "1"]));
    assert!(
        stderr
            .contains("tasks.csv:3: column gpu_milli: expected an integer 0..=1000, got \"half\""),
        "{stderr}"
    );
    assert!(!dir.path().join("out").exists(), "nothing is written");
}

#[test]
fn a_missing_file_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let stderr = failure(&muster(
        dir.path(),
        &["sim", "alloc", "--nodes", "missing.csv", "--out", "out"],
    ));
    assert!(
        stderr.contains("error: cannot read missing.csv"),
        "{stderr}"
    );
}

#[test]
fn sim_mix_writes_a_pod_list_that_sim_alloc_reads() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("nodes.csv"), NODES).unwrap();
    std::fs::write(dir.path().join("tasks.csv"), TASKS).unwrap();
    let mix = |extra: &[&str], out: &str| {
        let mut args = vec![
            "sim",
            "mix",
            "--nodes",
            "nodes.csv",
            "--tasks",
            "tasks.csv",
            "--out",
            out,
        ];
        args.extend_from_slice(extra);
        muster(dir.path(), &args)
    };
    success(&mix(&["--gpu-spec", "100", "--seed", "4"], "spec.csv"));
    let text = std::fs::read_to_string(dir.path().join("spec.csv")).unwrap();
    let rows: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(rows.len(), 5);
    for row in &rows {
        let fields: Vec<&str> = row.split(',').collect();
        let constrained = !fields[5].is_empty();
        assert_eq!(
            constrained,
            fields[3] != "0",
            "GPU tasks get a model: {row}"
        );
        if fields[3] == "4" {
            assert_eq!(fields[5], "V100M32", "only n2 has 4 GPUs: {row}");
        }
    }
    success(&mix(&["--gpu-spec", "100", "--seed", "4"], "again.csv"));
    assert_eq!(
        std::fs::read(dir.path().join("again.csv")).unwrap(),
        text.as_bytes(),
        "same seed, same list"
    );
    success(&alloc(
        dir.path(),
        "spec.csv",
        "out",
        &["--seeds", "1", "--policies", "default"],
    ));

    // Nothing to draw from: a clear error, no file.
    std::fs::write(
        dir.path().join("whole.csv"),
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\na,1000,1024,1,1000\n",
    )
    .unwrap();
    let output = muster(
        dir.path(),
        &[
            "sim",
            "mix",
            "--tasks",
            "whole.csv",
            "--share",
            "50",
            "--out",
            "bad.csv",
        ],
    );
    assert_eq!(output.status.code(), Some(1));
    let stderr = failure(&output);
    assert!(stderr.contains("no GPU-sharing tasks"), "{stderr}");
    assert!(!dir.path().join("bad.csv").exists());
}
