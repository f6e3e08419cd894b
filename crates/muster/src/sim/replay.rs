//! `muster sim replay`: time replay (Protocols B and C) of a job list on a
//! cluster, one run per scheduling policy, in parallel; prints a table and
//! writes `results.json`, `jct_cdf.svg`, `utilization.svg` and
//! `queue_length.svg`.

use super::{file_name, read, read_openb_nodes, write};
use crate::cli::{ReplayArgs, TraceFormat};
use anyhow::{Context, bail};
use muster_sched::NodeInput;
use muster_sim::{ReplayConfig, ReplayPolicy, ReplayResult, parse_openb_timed, parse_philly};
use serde::Serialize;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// What the replay ran on, as `results.json` records it.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterSummary {
    /// The cluster spec or node list's file name.
    pub file: String,
    /// `cluster spec` or `openb node list`.
    pub kind: &'static str,
    pub nodes: usize,
    pub gpus: u64,
    pub racks: usize,
    pub max_gpus_per_node: u32,
}

/// Everything `results.json` holds: the inputs, then one result per policy
/// in the order asked.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    pub protocol: &'static str,
    pub trace: String,
    pub format: &'static str,
    pub jobs: usize,
    pub cluster: ClusterSummary,
    pub policies: Vec<String>,
    pub seed: u64,
    pub checkpoint_interval_s: u64,
    pub las_thresholds_gpu_s: Vec<u64>,
    pub usage_half_life_s: u64,
    pub placement: &'static str,
    pub results: Vec<ReplayResult>,
}

impl ReplayReport {
    /// Pretty JSON, every float rounded to 3 decimals, with a final newline:
    /// the same report gives the same bytes.
    pub fn to_json(&self) -> anyhow::Result<String> {
        let mut bytes = Vec::new();
        let mut serializer = serde_json::Serializer::with_formatter(
            &mut bytes,
            RoundingFormatter(serde_json::ser::PrettyFormatter::new()),
        );
        self.serialize(&mut serializer)?;
        let mut text = String::from_utf8(bytes)?;
        text.push('\n');
        Ok(text)
    }
}

fn round3(value: f64) -> f64 {
    let rounded = (value * 1000.0).round() / 1000.0;
    if rounded == 0.0 { 0.0 } else { rounded }
}

/// serde_json's pretty printer, writing floats rounded to 3 decimals.
struct RoundingFormatter<'a>(serde_json::ser::PrettyFormatter<'a>);

impl serde_json::ser::Formatter for RoundingFormatter<'_> {
    fn write_f64<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        value: f64,
    ) -> std::io::Result<()> {
        self.0.write_f64(writer, round3(value))
    }

    fn write_f32<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        value: f32,
    ) -> std::io::Result<()> {
        self.0.write_f64(writer, round3(f64::from(value)))
    }

    fn begin_array<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.0.begin_array(writer)
    }

    fn end_array<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.0.end_array(writer)
    }

    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_array_value(writer, first)
    }

    fn end_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        self.0.end_array_value(writer)
    }

    fn begin_object<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.0.begin_object(writer)
    }

    fn end_object<W: ?Sized + std::io::Write>(&mut self, writer: &mut W) -> std::io::Result<()> {
        self.0.end_object(writer)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        self.0.begin_object_key(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        self.0.begin_object_value(writer)
    }

    fn end_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        self.0.end_object_value(writer)
    }
}

pub fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    let (nodes, cluster) = load_cluster(args)?;
    let trace_text = read(&args.trace)?;
    let trace_name = args.trace.display().to_string();
    let jobs = match args.format {
        TraceFormat::Philly => {
            if cluster.max_gpus_per_node == 0 {
                bail!(
                    "the cluster {} has no GPUs; a philly replay needs GPU nodes",
                    cluster.file
                );
            }
            parse_philly(&trace_text, &trace_name, cluster.max_gpus_per_node)?
        }
        TraceFormat::Openb => parse_openb_timed(&trace_text, &trace_name)?,
        TraceFormat::Muster => muster_sim::parse_muster_history(&trace_text, &trace_name)?,
    };
    let mut seen = BTreeSet::new();
    let policies: Vec<ReplayPolicy> = args
        .policies
        .iter()
        .copied()
        .filter(|policy| seen.insert(*policy))
        .collect();
    if policies.is_empty() {
        bail!("no policy to replay; give --policies with some of fifo, las, sjf-oracle, default");
    }
    let queues = match &args.queues {
        None => None,
        Some(path) => Some(muster_api::parse_queue_file_yaml(&read(path)?).map_err(
            |problems| {
                anyhow::anyhow!(
                    "the queue file {} is not valid:\n{problems}",
                    path.display()
                )
            },
        )?),
    };
    let config = ReplayConfig {
        checkpoint_interval_s: args.checkpoint_interval,
        placement: args.placement,
        queues,
        forecast: args.forecast.then(muster_sched::ForecastLimits::default),
        ..ReplayConfig::default()
    };
    let threads = args
        .jobs
        .map(|jobs| jobs as usize)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(policies.len())
        .max(1);
    eprintln!(
        "time replay: {} jobs from {} on {} ({} nodes, {} GPUs); {} polic{} on {} thread{}",
        jobs.len(),
        file_name(&args.trace),
        cluster.file,
        cluster.nodes,
        cluster.gpus,
        policies.len(),
        if policies.len() == 1 { "y" } else { "ies" },
        threads,
        if threads == 1 { "" } else { "s" },
    );
    let started = Instant::now();
    let progress = super::progress_bar(
        policies.len(),
        "{bar:40} {pos}/{len} policies replayed, {elapsed} elapsed {msg}",
    );
    let runs: Vec<Run> = super::parallel_map(&policies, threads, &progress, |&policy| {
        let started = Instant::now();
        let result = muster_sim::replay(&nodes, &jobs, policy, &config, args.seed);
        progress.set_message(format!("({policy} done)"));
        (result, started.elapsed())
    });
    let mut results = Vec::with_capacity(runs.len());
    for (policy, (result, elapsed)) in policies.iter().zip(runs) {
        let result = result.with_context(|| format!("cannot replay {policy} on this cluster"))?;
        eprintln!("{policy}: {:.1} s", elapsed.as_secs_f64());
        results.push(result);
    }
    eprintln!("done in {:.1} s", started.elapsed().as_secs_f64());

    let report = ReplayReport {
        protocol: "time replay (traces/README.md, protocols B and C)",
        trace: file_name(&args.trace),
        format: args.format.name(),
        jobs: jobs.len(),
        cluster,
        policies: policies
            .iter()
            .map(|policy| policy.name().to_string())
            .collect(),
        seed: args.seed,
        checkpoint_interval_s: config.checkpoint_interval_s,
        las_thresholds_gpu_s: config.las_thresholds_gpu_s.clone(),
        usage_half_life_s: config.usage_half_life_s,
        placement: config.placement.name(),
        results,
    };
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("cannot create {}", args.out.display()))?;
    let json_path = args.out.join("results.json");
    write(&json_path, &report.to_json()?)?;
    let plots = [
        ("jct_cdf.svg", super::plot::jct_cdf_svg(&report)),
        ("utilization.svg", super::plot::utilization_svg(&report)),
        ("queue_length.svg", super::plot::queue_length_svg(&report)),
    ];
    for (name, svg) in plots {
        let svg = svg.with_context(|| format!("cannot draw {name}"))?;
        write(&args.out.join(name), &svg)?;
    }

    print!("{}", table(&report));
    eprintln!(
        "wrote results.json, jct_cdf.svg, utilization.svg and queue_length.svg in {}",
        args.out.display()
    );
    Ok(())
}

/// The nodes of a running server, as it has them now.
fn nodes_of_server(url: &str) -> anyhow::Result<Vec<NodeInput>> {
    let connection = crate::commands::Connection {
        server: Some(url.to_string()),
        token: None,
        token_file: None,
        ca_sha256: None,
        json: false,
    };
    let client = connection.client()?;
    let list = crate::commands::runtime()?
        .block_on(client.nodes())
        .map_err(|error| anyhow::anyhow!("cannot read the nodes of {url}: {error}"))?;
    Ok(list
        .nodes
        .into_iter()
        .map(|node| {
            NodeInput::schedulable(muster_model::NodeSpec {
                name: muster_model::NodeName::from(node.name.as_str()),
                pool: muster_model::PoolName::from(node.pool.as_str()),
                rack: muster_model::RackName::from(node.rack.as_str()),
                gpus: node
                    .gpus
                    .iter()
                    .map(|gpu| muster_model::GpuSpec {
                        index: gpu.index,
                        uuid: gpu.uuid.clone(),
                        model: muster_model::GpuModel::new(&gpu.model),
                        memory: muster_model::MemoryMib(gpu.memory_mib),
                        nvlink_domain: gpu.nvlink_domain,
                    })
                    .collect(),
                cpu: muster_model::CpuMilli(node.cpu_milli),
                memory: muster_model::MemoryMib(node.memory_mib),
            })
        })
        .collect())
}

/// `nodes` scaled by `factor`: copies of the nodes in order (named
/// `NAME-xK`) to reach `round(n x factor)`, or the first ones.
fn scale_nodes(nodes: Vec<NodeInput>, factor: f64) -> Vec<NodeInput> {
    if nodes.is_empty() || (factor - 1.0).abs() < f64::EPSILON {
        return nodes;
    }
    let target = ((nodes.len() as f64 * factor).round() as usize).max(1);
    (0..target)
        .map(|i| {
            let mut node = nodes[i % nodes.len()].clone();
            let copy = i / nodes.len();
            if copy > 0 {
                node.spec.name =
                    muster_model::NodeName::from(format!("{}-x{copy}", node.spec.name.0).as_str());
            }
            node
        })
        .collect()
}

fn load_cluster(args: &ReplayArgs) -> anyhow::Result<(Vec<NodeInput>, ClusterSummary)> {
    let server_path;
    let (nodes, path, kind) = match (&args.cluster_from, &args.nodes_csv) {
        (Some(url), _) => {
            server_path = PathBuf::from(url.as_str());
            (nodes_of_server(url)?, &server_path, "server")
        }
        (None, Some(path)) => (read_openb_nodes(path)?, path, "openb node list"),
        (None, None) => {
            let path = &args.cluster;
            let text = read(path)?;
            let nodes = muster_api::parse_cluster_spec_yaml(&text).map_err(|errors| {
                anyhow::anyhow!("cannot read the cluster spec {}:\n{errors}", path.display())
            })?;
            let nodes = nodes.into_iter().map(NodeInput::schedulable).collect();
            (nodes, path, "cluster spec")
        }
    };
    let nodes = scale_nodes(nodes, args.scale_nodes);
    let racks: BTreeSet<&str> = nodes.iter().map(|node| node.spec.rack.as_str()).collect();
    let summary = ClusterSummary {
        file: file_name(path),
        kind,
        nodes: nodes.len(),
        gpus: nodes.iter().map(|node| node.spec.gpus.len() as u64).sum(),
        racks: racks.len(),
        max_gpus_per_node: nodes
            .iter()
            .map(|node| node.spec.gpus.len() as u32)
            .max()
            .unwrap_or(0),
    };
    Ok((nodes, summary))
}

type Run = (Result<ReplayResult, muster_sched::ClusterError>, Duration);

/// How a policy is named in tables and plots: oracles are labelled.
pub fn label(result: &ReplayResult) -> String {
    if result.oracle {
        format!("{} (oracle)", result.policy)
    } else {
        result.policy.clone()
    }
}

const HOUR: f64 = 3600.0;
const DAY: f64 = 86_400.0;

/// The tables printed on stdout: one row per policy, then per queue.
fn table(report: &ReplayReport) -> String {
    let mut text = format!(
        "time replay of {} ({} jobs) on {} ({} nodes, {} GPUs), checkpoint every {}, seed {}\n",
        report.trace,
        report.jobs,
        report.cluster.file,
        report.cluster.nodes,
        report.cluster.gpus,
        describe_interval(report.checkpoint_interval_s),
        report.seed
    );
    text.push_str(&format!(
        "{:<19} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>7} {:>11} {:>20}\n",
        "policy",
        "JCT mean",
        "JCT p50",
        "JCT p99",
        "queue mean",
        "queue p99",
        "makespan",
        "util",
        "preemptions",
        "completed/unschedul."
    ));
    text.push_str(&format!(
        "{:<19} {:>9} {:>9} {:>9} {:>10} {:>10} {:>9} {:>7} {:>11} {:>20}\n",
        "", "(h)", "(h)", "(h)", "(h)", "(h)", "(days)", "(%)", "", ""
    ));
    for result in &report.results {
        text.push_str(&format!(
            "{:<19} {:>9.2} {:>9.2} {:>9.1} {:>10.2} {:>10.1} {:>9.2} {:>7.1} {:>11} {:>20}\n",
            label(result),
            result.mean_jct_s / HOUR,
            result.p50_jct_s / HOUR,
            result.p99_jct_s / HOUR,
            result.mean_queueing_s / HOUR,
            result.p99_queueing_s / HOUR,
            result.makespan_s / DAY,
            100.0 * result.mean_gpu_utilization,
            result.preemptions,
            format!("{}/{}", result.completed, result.unschedulable),
        ));
    }
    let queues: BTreeSet<&str> = report
        .results
        .iter()
        .flat_map(|result| result.per_queue.keys().map(String::as_str))
        .collect();
    if queues.len() > 1 {
        text.push_str("\nper queue: mean JCT (h) / share of GPU-time used (%)");
        if let Some(default) = report.results.iter().find(|r| r.policy == "default") {
            text.push_str(&format!(
                "; guaranteed share (%) as {} gives it",
                default.policy
            ));
        }
        text.push('\n');
        text.push_str(&format!("{:<12} {:>6}", "queue", "jobs"));
        let guaranteed = report.results.iter().find(|r| r.policy == "default");
        if guaranteed.is_some() {
            text.push_str(&format!(" {:>10}", "guaranteed"));
        }
        for result in &report.results {
            text.push_str(&format!(" {:>16}", result.policy));
        }
        text.push('\n');
        for queue in queues {
            let jobs = report
                .results
                .iter()
                .filter_map(|result| result.per_queue.get(queue))
                .map(|entry| entry.jobs)
                .max()
                .unwrap_or(0);
            text.push_str(&format!("{queue:<12} {jobs:>6}"));
            if let Some(default) = guaranteed {
                let share = default
                    .per_queue
                    .get(queue)
                    .map_or(0.0, |entry| entry.guaranteed_share);
                text.push_str(&format!(" {:>10.1}", 100.0 * share));
            }
            for result in &report.results {
                let cell = match result.per_queue.get(queue) {
                    Some(entry) => format!(
                        "{:.1} / {:.1}",
                        entry.mean_jct_s / HOUR,
                        100.0 * entry.gpu_share
                    ),
                    None => "-".to_string(),
                };
                text.push_str(&format!(" {cell:>16}"));
            }
            text.push('\n');
        }
    }
    let forecasts: Vec<_> = report
        .results
        .iter()
        .filter_map(|result| result.forecast.as_ref().map(|f| (&result.policy, f)))
        .collect();
    if !forecasts.is_empty() {
        text.push_str("\nstart forecasts made at submission, jobs that waited over 10 minutes:\n");
        text.push_str(&format!(
            "{:<12} {:>8} {:>10} {:>10} {:>9} {:>11} {:>8} {:>13} {:>14}\n",
            "policy",
            "jobs",
            "within 2x",
            "too early",
            "too late",
            "not before",
            "unknown",
            "median ratio",
            "any wait: 2x"
        ));
        for (policy, forecast) in forecasts {
            text.push_str(&format!(
                "{:<12} {:>8} {:>9.1}% {:>9.1}% {:>8.1}% {:>10.1}% {:>7.1}% {:>13.2} {:>13.1}%\n",
                policy,
                forecast.waited_over_10_min,
                100.0 * forecast.within_2x,
                100.0 * forecast.too_early,
                100.0 * forecast.too_late,
                100.0 * forecast.not_before,
                100.0 * forecast.unknown,
                forecast.median_ratio,
                100.0 * forecast.all_waiting_within_2x,
            ));
        }
        text.push_str(
            "(ratio: actual wait / forecast wait; too early: waited over twice the forecast)\n",
        );
    }
    text
}

fn describe_interval(seconds: u64) -> String {
    if seconds == 0 {
        return "never (a preemption loses all work)".to_string();
    }
    let mut rest = seconds;
    let mut text = String::new();
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        if rest >= size {
            text.push_str(&format!("{}{unit}", rest / size));
            rest %= size;
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeInput {
        NodeInput::schedulable(muster_model::NodeSpec {
            name: muster_model::NodeName::from(name),
            pool: muster_model::PoolName::from("default"),
            rack: muster_model::RackName::from("r"),
            gpus: Vec::new(),
            cpu: muster_model::CpuMilli(1000),
            memory: muster_model::MemoryMib(1024),
        })
    }

    #[test]
    fn scaling_copies_nodes_in_order_or_keeps_the_first() {
        let names = |nodes: Vec<NodeInput>| -> Vec<String> {
            nodes.into_iter().map(|n| n.spec.name.0).collect()
        };
        let nodes = vec![node("a"), node("b")];
        assert_eq!(names(scale_nodes(nodes.clone(), 1.0)), ["a", "b"]);
        assert_eq!(
            names(scale_nodes(nodes.clone(), 2.5)),
            ["a", "b", "a-x1", "b-x1", "a-x2"]
        );
        assert_eq!(names(scale_nodes(nodes.clone(), 0.5)), ["a"]);
        assert_eq!(names(scale_nodes(nodes, 0.01)), ["a"], "at least one node");
    }

    #[test]
    fn floats_are_rounded_to_three_decimals_in_field_order() {
        #[derive(Serialize)]
        struct Sample {
            zeta: f64,
            alpha: Vec<(f64, f64)>,
            tiny: f64,
        }
        let sample = Sample {
            zeta: 1.0 / 3.0,
            alpha: vec![(2.0004, 123_456.789_9)],
            tiny: -0.000_1,
        };
        let mut bytes = Vec::new();
        let mut serializer = serde_json::Serializer::with_formatter(
            &mut bytes,
            RoundingFormatter(serde_json::ser::PrettyFormatter::new()),
        );
        sample.serialize(&mut serializer).unwrap();
        let text = String::from_utf8(bytes).unwrap();
        assert_eq!(
            text,
            "{\n  \"zeta\": 0.333,\n  \"alpha\": [\n    [\n      2.0,\n      123456.79\n    ]\n  ],\n  \"tiny\": 0.0\n}"
        );
    }

    #[test]
    fn intervals_read_back_as_written() {
        assert_eq!(describe_interval(1800), "30m");
        assert_eq!(describe_interval(5400), "1h30m");
        assert!(describe_interval(0).starts_with("never"));
    }
}
