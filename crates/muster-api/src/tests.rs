//! Tests of the whole path: text → wire spec → validated spec, and back.

use crate::{
    CommandSpec, JobSpec, MAX_SPEC_BYTES, Quantity, SpecErrors, TextLocation, parse_job_spec_json,
    parse_job_spec_value, parse_job_spec_yaml, validate,
};
use muster_model as model;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::time::Duration;

const DOCS: &str = include_str!("../../../docs/job-spec.md");

/// The error lines of a spec that must be refused.
fn errors(yaml: &str) -> Vec<String> {
    match parse_job_spec_yaml(yaml) {
        Ok(spec) => panic!("expected errors, parsed {spec:?}\n--- spec:\n{yaml}"),
        Err(errors) => errors.iter().map(ToString::to_string).collect(),
    }
}

/// One check helper for error messages: a spec made of `name` and `command`
/// plus `fields`, and the exact error lines expected.
fn check(fields: &str, expect: &[&str]) {
    let yaml = format!("name: test\ncommand: [run]\n{fields}");
    assert_eq!(errors(&yaml), expect, "--- spec:\n{yaml}");
}

fn parse(yaml: &str) -> model::JobSpec {
    parse_job_spec_yaml(yaml).unwrap_or_else(|errors| panic!("{errors}\n--- spec:\n{yaml}"))
}

fn round_trip(spec: &model::JobSpec) {
    let wire = JobSpec::from(spec);
    let json = serde_json::to_string(&wire).expect("wire specs serialize");
    let again = parse_job_spec_json(&json).unwrap_or_else(|errors| panic!("{errors}\n{json}"));
    assert_eq!(&again, spec, "json round trip: {json}");
    let yaml = serde_saphyr::to_string(&wire).expect("wire specs serialize");
    let again = parse_job_spec_yaml(&yaml).unwrap_or_else(|errors| panic!("{errors}\n{yaml}"));
    assert_eq!(&again, spec, "yaml round trip: {yaml}");
}

const FULL: &str = r#"
name: train-llama-7b
queue: llm-team
pool: training
priority_class: high
nodes: 2
gpus: 8
gpu_models: [h100-80gb, A100-80GB]
min_gpu_memory: 40GiB
cpus: 12.5
memory: 512GiB
command: [torchrun, --nproc-per-node=8, train.py, --epochs, 10]
env:
  NCCL_DEBUG: WARN
  OMP_NUM_THREADS: 8
  USE_FLASH: true
working_dir: /workspace
image: nvcr.io/nvidia/pytorch:24.05-py3
image_pull_secret: ngc
mounts:
  - {source: /datasets/imagenet, target: /data, read_only: true}
max_runtime: 1d
estimated_runtime: 20h30m
preemptible: false
checkpoint:
  signal: SIGUSR1
  grace_period: 2m
  interval: 1800
retry:
  max_attempts: 3
  on_node_failure: false
  on_exit_failure: true
topology:
  same_rack: required
after: [3, "any:4"]
array: "0-7,10%2"
slurm_env: true
idle_timeout: 2h
"#;

fn full_spec() -> model::JobSpec {
    model::JobSpec {
        name: "train-llama-7b".to_string(),
        queue: model::QueueName::from("llm-team"),
        pool: Some(model::PoolName::from("training")),
        priority_class: model::PriorityClass::new("high", 200),
        nodes: 2,
        gpus_per_node: model::GpuRequest::Whole(8),
        gpu_models: vec![
            model::GpuModel::new("H100-80GB"),
            model::GpuModel::new("A100-80GB"),
        ],
        min_gpu_memory: Some(model::MemoryMib(40 * 1024)),
        cpu_per_node: model::CpuMilli(12_500),
        memory_per_node: model::MemoryMib(512 * 1024),
        command: [
            "torchrun",
            "--nproc-per-node=8",
            "train.py",
            "--epochs",
            "10",
        ]
        .map(String::from)
        .to_vec(),
        env: BTreeMap::from([
            ("NCCL_DEBUG".to_string(), "WARN".to_string()),
            ("OMP_NUM_THREADS".to_string(), "8".to_string()),
            ("USE_FLASH".to_string(), "true".to_string()),
        ]),
        secrets: BTreeMap::new(),
        working_dir: Some("/workspace".to_string()),
        image: Some("nvcr.io/nvidia/pytorch:24.05-py3".to_string()),
        image_pull_secret: Some("ngc".to_string()),
        mounts: vec![model::Mount {
            source: "/datasets/imagenet".to_string(),
            target: "/data".to_string(),
            read_only: true,
        }],
        max_runtime: Some(Duration::from_secs(86_400)),
        estimated_runtime: Some(Duration::from_secs(20 * 3600 + 30 * 60)),
        preemptible: false,
        checkpoint: model::CheckpointPolicy {
            signal: model::Signal::Usr1,
            grace_period: Duration::from_secs(120),
            interval: Some(Duration::from_secs(1800)),
        },
        retry: model::RetryPolicy {
            max_attempts: 3,
            on_node_failure: false,
            on_exit_failure: true,
        },
        topology: Some(model::TopologyConstraint {
            same_rack: model::TopologyStrength::Required,
        }),
        after: vec![
            model::Dependency {
                job: model::JobId(3),
                kind: model::DependencyKind::Ok,
            },
            model::Dependency {
                job: model::JobId(4),
                kind: model::DependencyKind::Any,
            },
        ],
        array: Some(model::ArraySpec {
            indices: vec![0, 1, 2, 3, 4, 5, 6, 7, 10],
            limit: Some(2),
        }),
        slurm_env: true,
        idle_timeout: Some(Duration::from_secs(7200)),
        service: None,
    }
}

#[test]
fn full_spec_parses() {
    assert_eq!(parse(FULL), full_spec());
}

#[test]
fn defaults() {
    let spec = parse("name: hello\ncommand: [echo, hi]\n");
    let expected = model::JobSpec::simple(
        "hello",
        "default",
        model::GpuRequest::Whole(0),
        vec!["echo".to_string(), "hi".to_string()],
    );
    assert_eq!(spec, expected);
    assert_eq!(spec.cpu_per_node, model::CpuMilli(1000));
    assert_eq!(spec.memory_per_node, model::MemoryMib(1024));
    assert_eq!(spec.checkpoint.signal, model::Signal::Term);
    assert_eq!(spec.checkpoint.grace_period, Duration::from_secs(30));
    assert_eq!(spec.retry, model::RetryPolicy::default());
    assert!(spec.preemptible);
    assert_eq!(spec.topology, None);
}

#[test]
fn null_means_default_and_empty_sections_take_defaults() {
    let spec = parse("name: a\ncommand: x\npool: ~\nqueue:\ncheckpoint: {}\nretry: {}\n");
    assert_eq!(spec.pool, None);
    assert_eq!(spec.queue, model::QueueName::from("default"));
    assert_eq!(spec.checkpoint, model::CheckpointPolicy::default());
    assert_eq!(spec.retry, model::RetryPolicy::default());
}

#[test]
fn shell_string_command_runs_with_sh() {
    let spec = parse("name: a\ncommand: python train.py | tee log\n");
    assert_eq!(spec.command, ["sh", "-c", "python train.py | tee log"]);
}

#[test]
fn single_gpu_model_string_is_a_list_of_one() {
    let spec = parse("name: a\ncommand: x\ngpus: 1\ngpu_models: t4\n");
    assert_eq!(spec.gpu_models, vec![model::GpuModel::new("T4")]);
}

#[test]
fn gpu_quantities() {
    let gpus =
        |written: &str| parse(&format!("name: a\ncommand: x\ngpus: {written}\n")).gpus_per_node;
    assert_eq!(gpus("8"), model::GpuRequest::Whole(8));
    assert_eq!(gpus("\"8\""), model::GpuRequest::Whole(8));
    assert_eq!(gpus("8.0"), model::GpuRequest::Whole(8));
    assert_eq!(gpus("0"), model::GpuRequest::Whole(0));
    assert_eq!(
        gpus("0.25"),
        model::GpuRequest::Shared(model::GpuMilli(250))
    );
    assert_eq!(
        gpus("'0.5'"),
        model::GpuRequest::Shared(model::GpuMilli(500))
    );
    assert_eq!(
        gpus("0.125"),
        model::GpuRequest::Shared(model::GpuMilli(125))
    );
    assert_eq!(gpus("64"), model::GpuRequest::Whole(64));
}

#[test]
fn cpu_and_memory_quantities() {
    let spec = |fields: &str| parse(&format!("name: a\ncommand: x\n{fields}"));
    assert_eq!(spec("cpus: 0.5").cpu_per_node, model::CpuMilli(500));
    assert_eq!(spec("cpus: '4'").cpu_per_node, model::CpuMilli(4000));
    assert_eq!(
        spec("memory: 512MiB").memory_per_node,
        model::MemoryMib(512)
    );
    assert_eq!(spec("memory: 2048").memory_per_node, model::MemoryMib(2048));
    assert_eq!(
        spec("memory: 16Gi").memory_per_node,
        model::MemoryMib(16_384)
    );
    assert_eq!(
        spec("memory: 1.5GiB").memory_per_node,
        model::MemoryMib(1536)
    );
    assert_eq!(
        spec("gpus: 1\nmin_gpu_memory: 40960MiB").min_gpu_memory,
        Some(model::MemoryMib(40_960))
    );
    assert_eq!(
        spec("gpus: 1\nmin_gpu_memory: 40960").min_gpu_memory,
        Some(model::MemoryMib(40_960))
    );
}

#[test]
fn durations() {
    let runtime = |written: &str| {
        parse(&format!("name: a\ncommand: x\nmax_runtime: {written}\n")).max_runtime
    };
    let secs = |seconds| Some(Duration::from_secs(seconds));
    assert_eq!(runtime("90s"), secs(90));
    assert_eq!(runtime("30m"), secs(1800));
    assert_eq!(runtime("2h"), secs(7200));
    assert_eq!(runtime("1d"), secs(86_400));
    assert_eq!(runtime("1h30m"), secs(5400));
    assert_eq!(runtime("3600"), secs(3600));
    assert_eq!(runtime("'3600'"), secs(3600));
}

#[test]
fn signals_and_case() {
    let spec = |fields: &str| parse(&format!("name: a\ncommand: x\n{fields}"));
    assert_eq!(
        spec("checkpoint: {signal: usr2}").checkpoint.signal,
        model::Signal::Usr2
    );
    assert_eq!(
        spec("checkpoint: {signal: SIGINT}").checkpoint.signal,
        model::Signal::Int
    );
    assert_eq!(
        spec("priority_class: Critical").priority_class,
        model::PriorityClass::new("critical", 300)
    );
    assert_eq!(
        spec("nodes: 3\ntopology: {same_rack: preferred}").topology,
        Some(model::TopologyConstraint {
            same_rack: model::TopologyStrength::Preferred
        })
    );
}

#[test]
fn error_messages_name_the_field_the_value_and_what_is_accepted() {
    check("nodes: 0", &["nodes: must be at least 1, got 0"]);
    check("nodes: -2", &["nodes: must be at least 1, got -2"]);
    check("nodes: 5000", &["nodes: must be at most 4096, got 5000"]);
    check(
        "nodes: 1.5",
        &["nodes: expected a whole number like 2, got 1.5"],
    );
    check(
        "nodes: two",
        &["nodes: expected a whole number like 2, got \"two\""],
    );
    check(
        "nodes: [1]",
        &["nodes: expected a whole number like 2, got a list"],
    );
    check(
        "gpus: 1.5",
        &["gpus: a share must be below 1 or a whole number, got 1.5"],
    );
    check("gpus: -1", &["gpus: must not be negative, got -1"]);
    check("gpus: 65", &["gpus: must be at most 64 per node, got 65"]);
    check(
        "gpus: 0.3333",
        &[
            "gpus: a share is counted in thousandths of a GPU (at most 3 decimal places), got 0.3333",
        ],
    );
    check(
        "gpus: lots",
        &["gpus: expected a number of GPUs like 8, or a share of one GPU like 0.25, got \"lots\""],
    );
    check(
        "gpus: 0.5\nnodes: 2",
        &[
            "gpus: a share of a GPU (0.5) needs nodes: 1, got nodes: 2; a job of several nodes takes whole GPUs",
        ],
    );
    check("cpus: 0", &["cpus: must be more than 0, got 0"]);
    check(
        "cpus: 5000",
        &["cpus: must be at most 4096 per node, got 5000"],
    );
    check(
        "memory: 16GB",
        &[
            "memory: unknown unit \"GB\"; accepted: MiB, GiB, TiB (or Mi, Gi, Ti), or a whole number of MiB, got \"16GB\"",
        ],
    );
    check("memory: 0", &["memory: must be more than 0, got 0"]);
    check(
        "memory: 0.5MiB",
        &["memory: not a whole number of MiB, got \"0.5MiB\""],
    );
    check(
        "min_gpu_memory: lots",
        &[
            "min_gpu_memory: expected a size like \"16GiB\", \"512MiB\", \"1TiB\" (or 16Gi, 512Mi, 1Ti), or a whole number of MiB, got \"lots\"",
        ],
    );
    check(
        "max_runtime: 1.5h",
        &[
            "max_runtime: expected a duration like \"90s\", \"30m\", \"2h\", \"1d\" or \"1h30m\", or a whole number of seconds, got \"1.5h\"",
        ],
    );
    check(
        "max_runtime: 0",
        &["max_runtime: must be more than 0s, got 0"],
    );
    check(
        "max_runtime: 1h\nestimated_runtime: 90m",
        &["estimated_runtime: must not exceed max_runtime (1h), got \"90m\""],
    );
    check(
        "checkpoint: {signal: KILL}",
        &["checkpoint.signal: unknown signal \"KILL\"; accepted: TERM, INT, HUP, QUIT, USR1, USR2"],
    );
    check(
        "checkpoint: {grace_period: 2h}",
        &["checkpoint.grace_period: must be at most 1h, got \"2h\""],
    );
    check(
        "checkpoint: {interval: 0s}",
        &["checkpoint.interval: must be more than 0s, got \"0s\""],
    );
    check(
        "checkpoint: TERM",
        &[
            "checkpoint: expected a mapping with fields signal, grace_period, interval, got \"TERM\"",
        ],
    );
    check(
        "retry: {max_attempts: 0}",
        &["retry.max_attempts: must be at least 1, got 0"],
    );
    check(
        "retry: {max_attempts: 101}",
        &["retry.max_attempts: must be at most 100, got 101"],
    );
    check(
        "retry: {on_exit_failure: maybe}",
        &["retry.on_exit_failure: expected true or false, got \"maybe\""],
    );
    check(
        "topology: {same_rack: always}",
        &["topology.same_rack: unknown value \"always\"; accepted: required, preferred"],
    );
    check(
        "topology: {}",
        &["topology.same_rack: required when topology is given; accepted: required, preferred"],
    );
    check(
        "priority_class: urgent",
        &[
            "priority_class: unknown priority class \"urgent\"; accepted: low, normal, high, critical",
        ],
    );
    check(
        "queue: my queue",
        &[
            "queue: must be 1 to 63 letters, digits, '-', '_' or '.', starting with a letter or digit, got \"my queue\"",
        ],
    );
    check(
        "queue: no",
        &["queue: expected a string, got false; put it in quotes"],
    );
    check(
        "preemptible: 1",
        &["preemptible: expected true or false, got 1"],
    );
    check(
        "working_dir: data",
        &["working_dir: must be an absolute path (starting with /), got \"data\""],
    );
    check(
        "image: my image",
        &[
            "image: must be an image reference like \"nvcr.io/nvidia/pytorch:24.05-py3\" (no spaces), got \"my image\"",
        ],
    );
    check(
        "image_pull_secret: ngc",
        &[
            "image_pull_secret: names the credentials for pulling `image`, and the job has no image: add `image:` or drop it",
        ],
    );
    check(
        "image: a/b:1\nimage_pull_secret: 'has space'",
        &[
            "image_pull_secret: the secret's name \"has space\" is 1 to 63 letters, digits, '-', '_' or '.'",
        ],
    );
    check(
        "mounts: [{source: /data, target: /data}]",
        &[
            "mounts: mounts are for container jobs (`image:`); a job without one sees the node's files as they are",
        ],
    );
    check(
        "image: a/b:1\nmounts: [{source: /data/../etc, target: /data}, {source: /x, target: /data}]",
        &[
            "mounts[0].source: must be an absolute path without `..`, `:` or `,`, got \"/data/../etc\"",
            "mounts[1].target: \"/data\" is mounted twice",
        ],
    );
    check(
        "image: a/b:1\nmounts: [{source: /y}]",
        &["mounts[0]: needs a source (the path on the node) and a target (the path in the task)"],
    );
    check(
        "gpu_models: ['']",
        &["gpu_models[0]: must not be empty; give a GPU model like \"H100-80GB\""],
    );
    check(
        "gpu_models: {a: b}",
        &["gpu_models: expected a GPU model like \"H100-80GB\", or a list of them, got a mapping"],
    );
    check(
        "env: {MUSTER_JOB_ID: '7'}",
        &[
            "env.MUSTER_JOB_ID: reserved: muster sets MUSTER_*, PET_*, CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES itself",
        ],
    );
    check(
        "env: {PET_NNODES: '2'}",
        &[
            "env.PET_NNODES: reserved: muster sets MUSTER_*, PET_*, CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES itself",
        ],
    );
    check(
        "env: {'MY VAR': x}",
        &[
            "env[\"MY VAR\"]: not a valid variable name \"MY VAR\": use letters, digits and '_', not starting with a digit",
        ],
    );
    check(
        "env: {LR: 0.001}",
        &[
            "env.LR: expected a string, got 0.001; put it in quotes so it is kept exactly as written",
        ],
    );
    check(
        "env: [A]",
        &["env: expected a mapping of variable names to values, got a list"],
    );
}

#[test]
fn name_rules() {
    let name_errors = |name: &str| errors(&format!("name: {name}\ncommand: [x]\n"));
    assert_eq!(
        name_errors("Train_1"),
        [
            "name: must be lowercase letters, digits and '-', starting and ending with a letter or digit (a DNS label), got \"Train_1\""
        ]
    );
    assert_eq!(
        name_errors(&"a".repeat(64)),
        ["name: must be at most 63 characters, got 64"]
    );
    assert_eq!(
        name_errors("''"),
        [
            "name: must not be empty; use lowercase letters, digits and '-', starting and ending with a letter or digit (a DNS label)"
        ]
    );
    assert_eq!(
        name_errors("123"),
        ["name: expected a string, got 123; put it in quotes"]
    );
    assert_eq!(
        errors("command: [x]\n"),
        ["name: required: a name like \"train-llama\" (lowercase letters, digits and '-')"]
    );
}

#[test]
fn command_rules() {
    assert_eq!(
        errors("name: a\n"),
        [
            "command: required: a list of arguments like [python, train.py], or one string run by sh -c"
        ]
    );
    assert_eq!(
        errors("name: a\ncommand: []\n"),
        ["command: must not be empty; give at least the program to run"]
    );
    assert_eq!(
        errors("name: a\ncommand: '  '\n"),
        ["command: must not be empty"]
    );
    assert_eq!(
        errors("name: a\ncommand: ['', x]\n"),
        ["command[0]: the program to run must not be empty"]
    );
    assert_eq!(
        errors("name: a\ncommand: [python, 1.50, [x]]\n"),
        [
            "command[1]: expected a string, got 1.5; put it in quotes so it is kept exactly as written",
            "command[2]: expected a string, got a list",
        ]
    );
    assert_eq!(
        errors("name: a\ncommand: {run: x}\n"),
        [
            "command: expected a list of arguments like [python, train.py], or one string run by sh -c, got a mapping"
        ]
    );
}

#[test]
fn unknown_fields_get_the_closest_name_at_every_level() {
    assert_eq!(
        errors("name: a\ncommand: [x]\ngpu: 8\n"),
        ["gpu: unknown field; did you mean \"gpus\"?"]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\ncheckpoint:\n  singal: TERM\n"),
        ["checkpoint.singal: unknown field; did you mean \"signal\"?"]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\nretry: {max_attempt: 2}\n"),
        ["retry.max_attempt: unknown field; did you mean \"max_attempts\"?"]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\ntopology: {same_racks: required}\n"),
        [
            "topology.same_racks: unknown field; did you mean \"same_rack\"?",
            "topology.same_rack: required when topology is given; accepted: required, preferred",
        ]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\nsignal: USR1\n"),
        ["signal: unknown field; did you mean \"checkpoint.signal\"?"]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\ntimeout: 1h\n"),
        ["timeout: unknown field; did you mean \"max_runtime\"?"]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\nzzz: 1\n"),
        [
            "zzz: unknown field; accepted: name, queue, pool, priority_class, nodes, gpus, gpu_models, min_gpu_memory, cpus, memory, command, env, secrets, working_dir, image, image_pull_secret, mounts, max_runtime, estimated_runtime, preemptible, checkpoint, retry, topology, after, array, slurm_env, idle_timeout, service"
        ]
    );
    assert_eq!(
        errors("name: a\ncommand: [x]\ntopology: {zzz: 1, same_rack: required}\n"),
        ["topology.zzz: unknown field; accepted: same_rack"]
    );
}

#[test]
fn all_errors_are_reported_at_once() {
    let found = errors(
        "name: Bad_Name\ncomand: [x]\nnodes: 0\ngpus: 1.5\nmemory: 1GB\ncheckpoint: {signal: KILL, grace: 1s}\nretry: {max_attempts: 0}\n",
    );
    assert_eq!(
        found,
        [
            "comand: unknown field; did you mean \"command\"?",
            "checkpoint.grace: unknown field; did you mean \"grace_period\"?",
            "name: must be lowercase letters, digits and '-', starting and ending with a letter or digit (a DNS label), got \"Bad_Name\"",
            "nodes: must be at least 1, got 0",
            "gpus: a share must be below 1 or a whole number, got 1.5",
            "memory: unknown unit \"GB\"; accepted: MiB, GiB, TiB (or Mi, Gi, Ti), or a whole number of MiB, got \"1GB\"",
            "command: required: a list of arguments like [python, train.py], or one string run by sh -c",
            "checkpoint.signal: unknown signal \"KILL\"; accepted: TERM, INT, HUP, QUIT, USR1, USR2",
            "retry.max_attempts: must be at least 1, got 0",
        ]
    );
}

#[test]
fn a_field_of_the_wrong_kind_is_reported_once() {
    // `nodes` cannot be read, so the share rule (which needs nodes) does not
    // add a second complaint; the bad env value is reported once too.
    assert_eq!(
        errors("name: a\ncommand: [x]\nnodes: [2]\ngpus: 0.5\nenv: {A: [1]}\n"),
        [
            "nodes: expected a whole number like 2, got a list",
            "env.A: expected a string, got a list",
        ]
    );
}

#[test]
fn documents_that_are_not_specs() {
    assert_eq!(
        errors(""),
        ["the spec is empty; expected a mapping of fields with at least name and command"]
    );
    assert_eq!(
        errors("- a\n- b\n"),
        ["expected a mapping of fields with at least name and command, got a list"]
    );
    assert_eq!(
        errors("just text"),
        ["expected a mapping of fields with at least name and command, got \"just text\""]
    );
}

#[test]
fn yaml_syntax_errors_give_line_and_column() {
    let errors = parse_job_spec_yaml("name: a\ncommand: [x\ngpus: 1\n").expect_err("bad yaml");
    assert_eq!(errors.len(), 1);
    let error = &errors.0[0];
    assert_eq!(error.path, "");
    assert!(error.message.starts_with("invalid yaml: "), "{error}");
    assert!(error.message.contains("line 3"), "{error}");
    assert_eq!(error.location.map(|location| location.line), Some(3));
}

#[test]
fn duplicate_keys_are_refused() {
    let errors = parse_job_spec_yaml("name: a\ncommand: [x]\ngpus: 1\ngpus: 2\n").expect_err("dup");
    assert!(errors.to_string().contains("duplicate"), "{errors}");
    assert_eq!(
        errors.0[0].location,
        Some(TextLocation { line: 4, column: 1 })
    );
}

#[test]
fn oversized_specs_are_refused() {
    let text = format!("name: a\ncommand: [x]\n#{}\n", "x".repeat(MAX_SPEC_BYTES));
    let errors = parse_job_spec_yaml(&text).expect_err("too large");
    assert_eq!(
        errors.to_string(),
        format!(
            "the spec is too large: {} bytes; at most 1048576 bytes (1 MiB) are accepted",
            text.len()
        )
    );
    assert!(parse_job_spec_json(&text).is_err());
}

#[test]
fn yaml_bombs_are_refused() {
    let mut bomb = String::from("a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n");
    for (name, previous) in ["b", "c", "d", "e", "f", "g", "h", "i"]
        .iter()
        .zip(["a", "b", "c", "d", "e", "f", "g", "h"])
    {
        let items = vec![format!("*{previous}"); 9].join(", ");
        bomb.push_str(&format!("{name}: &{name} [{items}]\n"));
    }
    bomb.push_str("name: x\ncommand: [x]\n");
    let errors = parse_job_spec_yaml(&bomb).expect_err("bomb");
    assert!(errors.to_string().starts_with("invalid yaml: "), "{errors}");

    let deep = format!("name: x\ncommand: {}", "[".repeat(10_000));
    assert!(parse_job_spec_yaml(&deep).is_err());
    let deep_json = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    assert!(parse_job_spec_json(&deep_json).is_err());
}

#[test]
fn json_specs() {
    let spec = parse_job_spec_json(
        r#"{"name": "a", "gpus": 0.5, "memory": "2GiB", "command": ["x"], "env": {"N": 4}}"#,
    )
    .expect("valid json");
    assert_eq!(
        spec.gpus_per_node,
        model::GpuRequest::Shared(model::GpuMilli(500))
    );
    assert_eq!(spec.memory_per_node, model::MemoryMib(2048));
    assert_eq!(spec.env.get("N").map(String::as_str), Some("4"));

    let errors = parse_job_spec_json("{\"name\": \"a\",\n \"gpus\": }").expect_err("bad json");
    assert!(errors.to_string().starts_with("invalid json: "), "{errors}");
    assert_eq!(errors.0[0].location.map(|location| location.line), Some(2));

    assert_eq!(
        parse_job_spec_json(r#"{"name": "a", "command": ["x"], "Gpus": 1}"#)
            .expect_err("unknown field")
            .to_string(),
        "Gpus: unknown field; did you mean \"gpus\"?"
    );
}

#[test]
fn wire_spec_deserializes_with_the_same_checks() {
    let wire: JobSpec = serde_json::from_value(serde_json::json!({
        "name": "a", "gpus": "0.25", "command": "run"
    }))
    .expect("valid wire spec");
    assert_eq!(wire.gpus, Some(Quantity::Text("0.25".to_string())));
    assert_eq!(wire.command, Some(CommandSpec::Shell("run".to_string())));
    let spec = model::JobSpec::try_from(&wire).expect("valid values");
    assert_eq!(
        spec.gpus_per_node,
        model::GpuRequest::Shared(model::GpuMilli(250))
    );

    let error = serde_json::from_value::<JobSpec>(serde_json::json!({
        "name": "a", "command": "run", "nodez": 2
    }))
    .expect_err("unknown field");
    assert_eq!(
        error.to_string(),
        "nodez: unknown field; did you mean \"nodes\"?"
    );

    // Values are checked by the conversion, not by deserializing.
    let wire: JobSpec = serde_json::from_value(serde_json::json!({
        "name": "a", "command": "run", "nodes": 0
    }))
    .expect("kinds are right");
    let errors: SpecErrors = validate(&wire).expect_err("nodes: 0");
    assert_eq!(errors.paths(), ["nodes"]);
}

#[test]
fn round_trips() {
    round_trip(&full_spec());
    round_trip(&parse("name: a\ncommand: x\n"));
    round_trip(&parse(
        "name: a\ncommand: x\ngpus: 0.125\ncpus: 0.25\nmemory: 1536\nmax_runtime: 93784\n",
    ));
    round_trip(&parse(
        "name: a\ncommand: [a, 'b c', '']\ngpus: 0.333\nmemory: 1TiB\ntopology: {same_rack: preferred}\n",
    ));
    round_trip(&model::JobSpec::simple(
        "simple",
        "team-a",
        model::GpuRequest::Whole(2),
        vec!["run".to_string()],
    ));
}

#[test]
fn wire_form_of_a_spec_is_readable() {
    let wire = JobSpec::from(&full_spec());
    let json = serde_json::to_value(&wire).expect("serializes");
    assert_eq!(json["gpus"], serde_json::json!(8));
    assert_eq!(json["cpus"], serde_json::json!(12.5));
    assert_eq!(json["memory"], serde_json::json!("512GiB"));
    assert_eq!(json["estimated_runtime"], serde_json::json!("20h30m"));
    assert_eq!(json["checkpoint"]["signal"], serde_json::json!("USR1"));
    assert_eq!(json["topology"]["same_rack"], serde_json::json!("required"));
    let share = JobSpec::from(&parse("name: a\ncommand: x\ngpus: 0.25\n"));
    assert_eq!(
        serde_json::to_value(&share).expect("serializes")["gpus"],
        serde_json::json!(0.25)
    );
}

/// The fenced blocks of a language in a markdown text, in order.
fn fenced_blocks<'a>(markdown: &'a str, language: &str) -> Vec<&'a str> {
    let opening = format!("```{language}\n");
    let mut blocks = Vec::new();
    let mut rest = markdown;
    while let Some(start) = rest.find(&opening) {
        let body = &rest[start + opening.len()..];
        let Some(end) = body.find("```") else { break };
        blocks.push(&body[..end]);
        rest = &body[end..];
    }
    blocks
}

#[test]
fn docs_examples_parse() {
    // Each yaml block says whether it is valid on its first line; the error
    // output shown after each invalid one is exactly what the parser prints.
    let yaml_blocks = fenced_blocks(DOCS, "yaml");
    let mut expected_outputs = fenced_blocks(DOCS, "text").into_iter();
    assert!(yaml_blocks.len() >= 6, "docs lost their examples");
    let mut valid = 0;
    for block in yaml_blocks {
        match block.lines().next() {
            Some("# example: valid") => {
                let spec = parse(block);
                round_trip(&spec);
                valid += 1;
            }
            Some("# example: invalid") => {
                let errors = parse_job_spec_yaml(block).expect_err("marked invalid");
                let expected = expected_outputs
                    .next()
                    .expect("an output after each invalid example");
                assert_eq!(format!("{errors}\n"), expected, "--- example:\n{block}");
            }
            other => panic!(
                "a yaml example must start with '# example: valid' or '# example: invalid', got {other:?}"
            ),
        }
    }
    assert!(valid >= 5);
    for block in fenced_blocks(DOCS, "json") {
        parse_job_spec_json(block).unwrap_or_else(|errors| panic!("{errors}\n{block}"));
    }
    // Every field is documented.
    for field in crate::read::JOB_FIELDS
        .iter()
        .filter(|field| !matches!(**field, "checkpoint" | "retry" | "topology"))
        .map(|field| field.to_string())
        .chain(
            crate::read::CHECKPOINT_FIELDS
                .iter()
                .map(|f| format!("checkpoint.{f}")),
        )
        .chain(
            crate::read::RETRY_FIELDS
                .iter()
                .map(|f| format!("retry.{f}")),
        )
        .chain(
            crate::read::TOPOLOGY_FIELDS
                .iter()
                .map(|f| format!("topology.{f}")),
        )
    {
        assert!(
            DOCS.contains(&format!("| `{field}` |")),
            "{field} is not documented"
        );
    }
}

/// Spec-like values: known field names (and near misses) with values of any
/// kind, nested a little.
fn spec_like_value() -> impl Strategy<Value = serde_json::Value> {
    let key = prop_oneof![
        prop::sample::select(
            crate::read::JOB_FIELDS
                .iter()
                .chain(crate::read::CHECKPOINT_FIELDS)
                .chain(crate::read::RETRY_FIELDS)
                .chain(crate::read::TOPOLOGY_FIELDS)
                .map(|field| field.to_string())
                .collect::<Vec<_>>()
        ),
        "[a-zA-Z_]{0,12}",
    ];
    let leaf = prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<u64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        prop::sample::select(vec![
            "0.25",
            "1.5",
            "8",
            "16GiB",
            "1h30m",
            "KILL",
            "SIGUSR1",
            "required",
            "-1",
            "",
            "1e400",
            "0.0001",
            "99999999999999999999999",
            "TiB",
            "1d1d",
            "normal",
        ])
        .prop_map(serde_json::Value::from),
        ".{0,20}".prop_map(serde_json::Value::from),
    ];
    leaf.prop_recursive(4, 48, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::from),
            prop::collection::btree_map(key.clone(), inner, 0..8)
                .prop_map(|map| serde_json::Value::Object(map.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let text = String::from_utf8_lossy(&bytes);
        let _ = parse_job_spec_yaml(&text);
        let _ = parse_job_spec_json(&text);
    }

    #[test]
    fn yaml_ish_text_never_panics(text in "[a-z_:\\-\\[\\]{},&*!|>#'\" \n0-9.~?%@`]{0,200}") {
        let _ = parse_job_spec_yaml(&text);
    }

    #[test]
    fn spec_like_values_never_panic(value in spec_like_value()) {
        let _ = parse_job_spec_value(&value);
        let json = value.to_string();
        let _ = parse_job_spec_json(&json);
        // JSON is YAML too (mostly): the YAML path must not panic either.
        let _ = parse_job_spec_yaml(&json);
        if let Ok(yaml) = serde_saphyr::to_string(&value) {
            let _ = parse_job_spec_yaml(&yaml);
        }
    }

    #[test]
    fn valid_specs_round_trip(
        nodes in 1u32..=8,
        gpus in prop_oneof![(0u32..=64).prop_map(model::GpuRequest::Whole),
                            (1u32..=999).prop_map(|m| model::GpuRequest::Shared(model::GpuMilli(m)))],
        cpu in 1u64..=4_096_000,
        memory in 1u64..=(1 << 30),
        runtime in prop::option::of(1u64..=10_000_000),
        argv in prop::collection::vec(".{0,10}", 1..4),
    ) {
        let nodes = if matches!(gpus, model::GpuRequest::Shared(_)) { 1 } else { nodes };
        let mut argv = argv;
        if argv[0].trim().is_empty() || argv.iter().any(|a| a.contains('\0')) {
            argv = vec!["run".to_string()];
        }
        let mut spec = model::JobSpec::simple("p", "q", gpus, argv);
        spec.nodes = nodes;
        spec.cpu_per_node = model::CpuMilli(cpu);
        spec.memory_per_node = model::MemoryMib(memory);
        spec.max_runtime = runtime.map(Duration::from_secs);
        spec.estimated_runtime = spec.max_runtime;
        round_trip(&spec);
    }
}

#[test]
fn dependencies() {
    use model::{Dependency, DependencyKind};
    let dependency = |job: u64, kind| Dependency {
        job: model::JobId(job),
        kind,
    };
    assert_eq!(
        parse("name: a\ncommand: x\nafter: [12, \"any:13\", \"afternotok:14\", \"OK:15\"]\n").after,
        vec![
            dependency(12, DependencyKind::Ok),
            dependency(13, DependencyKind::Any),
            dependency(14, DependencyKind::NotOk),
            dependency(15, DependencyKind::Ok),
        ]
    );
    assert_eq!(
        parse("name: a\ncommand: x\nafter: 7\n").after,
        vec![dependency(7, DependencyKind::Ok)]
    );
    assert_eq!(
        parse("name: a\ncommand: x\nafter: \"7, any:8\"\n").after,
        vec![
            dependency(7, DependencyKind::Ok),
            dependency(8, DependencyKind::Any)
        ]
    );
    round_trip(&parse(
        "name: a\ncommand: x\nafter: [3, \"any:4\", \"notok:5\"]\n",
    ));
    check(
        "after: [\"later:3\"]",
        &[
            "after[0]: unknown dependency kind \"later\"; expected a job id like 12 (wait for it to succeed), \"any:12\" (to end) or \"notok:12\" (to fail)",
        ],
    );
    check(
        "after: [0, -1, \"x\"]",
        &[
            "after[0]: expected a job id like 12 (wait for it to succeed), \"any:12\" (to end) or \"notok:12\" (to fail), got \"0\"",
            "after[1]: expected a job id like 12 (wait for it to succeed), \"any:12\" (to end) or \"notok:12\" (to fail), got \"-1\"",
            "after[2]: expected a job id like 12 (wait for it to succeed), \"any:12\" (to end) or \"notok:12\" (to fail), got \"x\"",
        ],
    );
    check(
        "after: [3, \"any:3\"]",
        &["after[1]: job 3 is named twice; name each job once"],
    );
    check(
        "after: {job: 3}",
        &[
            "after: expected a job id like 12, a text like \"any:12\", or a list of them, got a mapping",
        ],
    );
    let many: Vec<String> = (1..=65).map(|id| id.to_string()).collect();
    check(
        &format!("after: [{}]", many.join(", ")),
        &["after: at most 64 jobs, got 65; chain them through an intermediate job"],
    );
    assert_eq!(
        errors("name: a\ncommand: x\ndepends_on: 3\n"),
        ["depends_on: unknown field; did you mean \"after\"?"]
    );
}

#[test]
fn an_array_is_bounded_by_what_all_its_copies_weigh() {
    let big = "x".repeat(10 * 1024);
    let spec =
        |array: &str| format!("name: a\ncommand: [x]\nenv:\n  BIG: {big}\narray: \"{array}\"\n");
    let refused = errors(&spec("0-9999"));
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert!(
        refused[0].starts_with("array: 10000 elements of a spec of 11 KiB")
            && refused[0].contains("at most 64 MiB"),
        "{refused:?}"
    );
    // The same spec as a smaller array, and a small spec as a large one.
    assert_eq!(parse(&spec("0-999")).array.map(|a| a.len()), Some(1000));
    let small = parse("name: a\ncommand: [x]\narray: 0-9999%8\n");
    assert_eq!(
        small.array.map(|a| (a.len(), a.limit)),
        Some((10_000, Some(8)))
    );
}

#[test]
fn a_secret_is_named_in_env_or_secrets_and_never_a_value() {
    let spec = parse(
        "name: a\ncommand: [x]\nenv:\n  A: '1'\n  HF_TOKEN: {secret: hf}\nsecrets:\n  WANDB_KEY: wandb\n",
    );
    assert_eq!(spec.env.get("A").map(String::as_str), Some("1"));
    assert!(!spec.env.contains_key("HF_TOKEN"));
    assert_eq!(spec.secrets.get("HF_TOKEN").map(String::as_str), Some("hf"));
    assert_eq!(
        spec.secrets.get("WANDB_KEY").map(String::as_str),
        Some("wandb")
    );
    // The wire form keeps the names, and reads back the same.
    let wire = serde_json::to_value(crate::wire::JobSpec::from(&spec)).expect("wire");
    assert_eq!(wire["secrets"]["HF_TOKEN"], "hf");
    let again = crate::parse_job_spec_value(&wire).expect("reads back");
    assert_eq!(again, spec);
    for (yaml, wanted) in [
        ("env: {X: {secret: hf, extra: 1}}", "{secret: NAME}"),
        (
            "env: {MUSTER_X: {secret: hf}}",
            "not a variable a job may set",
        ),
        (
            "env: {X: '1'}\nsecrets: {X: hf}",
            "both as a value and as a secret",
        ),
        ("env: {X: {secret: 'a b'}}", "the secret's name"),
    ] {
        let text = format!("name: a\ncommand: [x]\n{yaml}\n");
        let errors = crate::parse_job_spec_yaml(&text)
            .expect_err(yaml)
            .to_string();
        assert!(errors.contains(wanted), "{yaml}: {errors}");
    }
}

#[test]
fn optional_counts_take_whole_numbers_as_json_schema_counts_them() {
    // JSON Schema's integers include 66973.0: the API's schema says
    // integer, so the server must take it (a fraction it refuses).
    let update: crate::protocol::QueueUpdate = serde_json::from_value(serde_json::json!({
        "guaranteed_gpus": 1.0, "borrow_limit_gpus": null, "weight": 1,
        "max_pending": 66973.0,
    }))
    .expect("a whole number");
    assert_eq!(update.max_pending, Some(66973));
    let limits: crate::protocol::UserLimits =
        serde_json::from_value(serde_json::json!({ "max_pending": 5.0 })).expect("whole");
    assert_eq!(limits.max_pending, Some(5));
    let token: crate::protocol::JoinTokenCreate =
        serde_json::from_value(serde_json::json!({ "uses": 3.0, "ttl_ms": null })).expect("whole");
    assert_eq!((token.uses, token.ttl_ms), (Some(3), None));
    assert!(
        serde_json::from_value::<crate::protocol::UserLimits>(serde_json::json!({
            "max_pending": 1.5
        }))
        .is_err()
    );
}
