//! `GET /metrics`: the fleet's GPUs under the names and labels of NVIDIA's
//! DCGM exporter (`DCGM_FI_DEV_GPU_UTIL{gpu, UUID, modelName, Hostname}`,
//! ...), each with the `job_id`, `queue` and `user` holding the GPU, so the
//! dashboards people use for DCGM work unchanged; and muster's own series
//! (jobs by state and pending reason, nodes, GPUs allocated, free and idle
//! by pool, node CPU, memory and network). OpenMetrics text, rendered by
//! `prometheus-client` from the state and the latest telemetry at each
//! scrape: nothing is kept between scrapes.

use muster_api::protocol::TelemetryReport;
use muster_control::{ControlPlane, JobState};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// A node's latest telemetry, and when the server got it.
#[derive(Debug, Clone)]
pub struct NodeTelemetry {
    pub received_ms: u64,
    pub report: TelemetryReport,
}

/// Telemetry older than this is not shown (a lost or stopped agent's
/// numbers would mislead).
pub const STALE_MS: u64 = 60_000;

pub use muster_control::usage::{IDLE_UTILIZATION_PCT, UsageByNode};

/// Every series `/metrics` may show (counters with their `_total`), for
/// the docs and the Grafana dashboard to be checked against.
pub const SERIES: &[&str] = &[
    "DCGM_FI_DEV_GPU_UTIL",
    "DCGM_FI_DEV_FB_USED",
    "DCGM_FI_DEV_FB_FREE",
    "DCGM_FI_DEV_POWER_USAGE",
    "DCGM_FI_DEV_GPU_TEMP",
    "DCGM_FI_DEV_SM_CLOCK",
    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "DCGM_FI_DEV_XID_ERRORS",
    "muster_gpu_pcie_transmit_bytes_total",
    "muster_gpu_pcie_receive_bytes_total",
    "muster_jobs",
    "muster_jobs_pending",
    "muster_job_idle_seconds",
    "muster_nodes",
    "muster_node_cordoned",
    "muster_gpus",
    "muster_gpus_idle",
    "muster_node_stack_drift",
    "muster_queue_budget",
    "muster_queue_budget_spent",
    "muster_pool_fragmentation",
    "muster_node_cpu_busy_percent",
    "muster_node_memory_used_bytes",
    "muster_node_memory_total_bytes",
    "muster_node_network_receive_bytes_total",
    "muster_node_network_transmit_bytes_total",
    "muster_scheduling_cycle_seconds",
    "muster_queue_wait_seconds",
    "muster_placements_total",
    "muster_preemptions_total",
    "muster_store_commit_seconds",
    "muster_api_request_seconds",
    "muster_audit_dropped_total",
];

/// Counters and histograms kept across scrapes: how the server itself
/// does (each is shared by clones; the scrape registers the clones).
#[derive(Debug, Clone)]
pub struct Instruments {
    /// A scheduling cycle: snapshot, engine and applying its outcome.
    pub cycle_seconds: Histogram,
    /// From submission to start, per start.
    pub queue_wait_seconds: Histogram,
    pub placements: Counter,
    pub preemptions: Counter,
    /// One commit (a group of changes) to the store.
    pub commit_seconds: Histogram,
    /// API requests by route and method.
    pub request_seconds: RequestHistograms,
    /// Refused requests without a known token left out of the audit log
    /// (past its 5 a second for them).
    pub audit_dropped: Counter,
}

/// Histograms of requests, by route and method.
pub type RequestHistograms = Family<Vec<(&'static str, String)>, Histogram, fn() -> Histogram>;

fn short_buckets() -> Histogram {
    // 0.5 ms to about 16 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 16))
}

fn wait_buckets() -> Histogram {
    // 0.1 s to about 1.5 days.
    Histogram::new(exponential_buckets(0.1, 3.0, 13))
}

impl Default for Instruments {
    fn default() -> Self {
        Instruments {
            cycle_seconds: short_buckets(),
            queue_wait_seconds: wait_buckets(),
            placements: Counter::default(),
            preemptions: Counter::default(),
            commit_seconds: short_buckets(),
            request_seconds: Family::new_with_constructor(short_buckets),
            audit_dropped: Counter::default(),
        }
    }
}

impl Instruments {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "muster_scheduling_cycle_seconds",
            "One scheduling cycle: snapshot, engine, applying the outcome",
            self.cycle_seconds.clone(),
        );
        registry.register(
            "muster_queue_wait_seconds",
            "From a job's submission to its start, per start",
            self.queue_wait_seconds.clone(),
        );
        registry.register(
            "muster_placements",
            "Jobs started by the scheduler",
            self.placements.clone(),
        );
        registry.register(
            "muster_preemptions",
            "Jobs the scheduler preempted",
            self.preemptions.clone(),
        );
        registry.register(
            "muster_store_commit_seconds",
            "One commit of a group of changes to the store",
            self.commit_seconds.clone(),
        );
        registry.register(
            "muster_api_request_seconds",
            "API requests by route and method (heartbeats long-poll)",
            self.request_seconds.clone(),
        );
        registry.register(
            "muster_audit_dropped",
            "Refused requests without a known token left out of the audit log (past 5 a second)",
            self.audit_dropped.clone(),
        );
    }
}

/// The content type of what [`render`] gives.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// A series' labels, shared by the series of one GPU (values are counted
/// references: a scrape of thousands of GPUs copies no text).
type Labels = Arc<Vec<(&'static str, Arc<str>)>>;

#[derive(Debug, Clone, Copy)]
enum Value {
    Gauge(f64),
    Counter(u64),
}

#[derive(Debug)]
struct FamilyData {
    help: &'static str,
    series: Vec<(Labels, Value)>,
}

/// Everything one scrape shows, streamed to the encoder as it is (no
/// per-series map or metric objects: a `Collector` of prometheus-client).
#[derive(Debug, Default)]
struct Families {
    families: BTreeMap<&'static str, FamilyData>,
}

impl Families {
    fn new() -> Self {
        Families::default()
    }

    fn push(&mut self, name: &'static str, help: &'static str, labels: Labels, value: Value) {
        self.families
            .entry(name)
            .or_insert_with(|| FamilyData {
                help,
                series: Vec::new(),
            })
            .series
            .push((labels, value));
    }

    fn gauge(&mut self, name: &'static str, help: &'static str, labels: Labels, value: f64) {
        self.push(name, help, labels, Value::Gauge(value));
    }

    fn counter(&mut self, name: &'static str, help: &'static str, labels: Labels, value: u64) {
        self.push(name, help, labels, Value::Counter(value));
    }
}

impl Collector for Families {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for (name, family) in &self.families {
            let kind = match family.series.first().map(|(_, value)| value) {
                Some(Value::Counter(_)) => MetricType::Counter,
                _ => MetricType::Gauge,
            };
            let mut metric = encoder.encode_descriptor(name, family.help, None, kind)?;
            for (labels, value) in &family.series {
                let labels: &[(&'static str, Arc<str>)] = labels.as_slice();
                let mut series = metric.encode_family(&labels)?;
                match value {
                    Value::Gauge(value) => series.encode_gauge(value)?,
                    Value::Counter(value) => {
                        series.encode_counter::<NoLabelSet, u64, u64>(value, None)?
                    }
                }
            }
        }
        Ok(())
    }
}

fn labels(pairs: Vec<(&'static str, Arc<str>)>) -> Labels {
    Arc::new(pairs)
}

fn text(value: &str) -> Arc<str> {
    Arc::from(value)
}

fn joined<'a>(values: impl Iterator<Item = &'a str>) -> Arc<str> {
    Arc::from(
        values
            .collect::<BTreeSet<&str>>()
            .into_iter()
            .collect::<Vec<_>>()
            .join(","),
    )
}

/// The metrics as OpenMetrics text.
pub fn render(
    control: &ControlPlane,
    telemetry: &BTreeMap<String, NodeTelemetry>,
    usage: &UsageByNode,
    idle_after_ms: u64,
    instruments: &Instruments,
    spent_this_month: &BTreeMap<String, f64>,
    now_ms: u64,
) -> String {
    let mut families = Families::new();
    for queue in control.queues() {
        let Some(budget) = queue.budget else {
            continue;
        };
        let queue_labels = labels(vec![
            ("queue", text(&queue.name.0)),
            ("hard", text(if budget.hard { "true" } else { "false" })),
        ]);
        families.gauge(
            "muster_queue_budget",
            "A queue's monthly GPU budget (the price list's currency)",
            Arc::clone(&queue_labels),
            budget.monthly_cents as f64 / 100.0,
        );
        families.gauge(
            "muster_queue_budget_spent",
            "What a queue with a budget has spent on GPUs this calendar month (UTC)",
            queue_labels,
            spent_this_month.get(&queue.name.0).copied().unwrap_or(0.0),
        );
    }

    // Jobs in memory that have not ended, by state and queue; pending ones
    // by queue and reason.
    let mut jobs: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut pending: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for job in control.jobs().filter(|job| !job.state.is_final()) {
        *jobs
            .entry((job.state.name(), job.spec.queue.0.as_str()))
            .or_default() += 1;
        if let Some(idle) = muster_control::usage::idle_for_ms(
            control,
            usage,
            job,
            now_ms,
            control.idle_after_ms_of(job, idle_after_ms),
        ) {
            families.gauge(
                "muster_job_idle_seconds",
                "Running jobs whose GPUs have all been below 5% utilisation for at least the \
                 server's idle threshold: for how long",
                labels(vec![
                    ("job_id", Arc::from(job.id.0.to_string())),
                    ("queue", text(&job.spec.queue.0)),
                    ("user", text(&job.user)),
                ]),
                idle as f64 / 1000.0,
            );
        }
        if job.state == JobState::Pending {
            let reason = control.pending_code(job.id).unwrap_or("unscheduled");
            *pending
                .entry((job.spec.queue.0.as_str(), reason))
                .or_default() += 1;
        }
    }
    for ((state, queue), count) in jobs {
        families.gauge(
            "muster_jobs",
            "Jobs not ended, by state and queue",
            labels(vec![("state", text(state)), ("queue", text(queue))]),
            count as f64,
        );
    }
    for ((queue, reason), count) in pending {
        families.gauge(
            "muster_jobs_pending",
            "Pending jobs by queue and why they wait (the code muster ps shows)",
            labels(vec![("queue", text(queue)), ("reason", text(reason))]),
            count as f64,
        );
    }

    let mut nodes: BTreeMap<&str, u64> = BTreeMap::new();
    // Per pool: free GPUs, and those of them on nodes partly taken (stranded
    // for a job that wants a whole node).
    let mut free_by_pool: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let mut gpus: BTreeMap<(&str, &str, &str), u64> = BTreeMap::new();
    let mut idle: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for node in control.nodes() {
        *nodes
            .entry(crate::records::node_state_name(node.state))
            .or_default() += 1;
        let hostname = node.spec.name.0.as_str();
        let host_text = text(hostname);
        let pool = node.spec.pool.0.as_str();
        if node.cordoned {
            families.gauge(
                "muster_node_cordoned",
                "1 for a cordoned node",
                labels(vec![("Hostname", text(hostname))]),
                1.0,
            );
        }
        let fresh = telemetry
            .get(hostname)
            .filter(|t| now_ms.saturating_sub(t.received_ms) <= STALE_MS)
            .map(|t| &t.report);
        // Who holds each GPU: (job, queue, user) per allocation on it.
        let mut holders: BTreeMap<u32, Vec<(String, &str, &str)>> = BTreeMap::new();
        for allocation in control.live_allocations(&node.spec.name) {
            let Some(job) = control.job(allocation.job) else {
                continue;
            };
            for (index, _) in &allocation.gpus {
                holders.entry(*index).or_default().push((
                    job.id.0.to_string(),
                    job.spec.queue.0.as_str(),
                    job.user.as_str(),
                ));
            }
        }
        let usable = node.state == muster_control::NodeState::Ready
            && !node.cordoned
            && node.drift.is_none();
        if usable && !node.spec.gpus.is_empty() {
            let free = node
                .spec
                .gpus
                .iter()
                .filter(|gpu| {
                    !holders.contains_key(&gpu.index) && !node.unhealthy_gpus.contains(&gpu.index)
                })
                .count() as u64;
            let entry = free_by_pool.entry(pool).or_default();
            entry.0 += free;
            if free < node.spec.gpus.len() as u64 {
                entry.1 += free;
            }
        }
        for gpu in &node.spec.gpus {
            let model = gpu.model.as_str();
            let model_text = text(model);
            let held = holders.get(&gpu.index);
            let mut pairs: Vec<(&'static str, Arc<str>)> = vec![
                ("gpu", Arc::from(gpu.index.to_string())),
                ("UUID", text(&gpu.uuid)),
                ("device", Arc::from(format!("nvidia{}", gpu.index))),
                ("modelName", Arc::clone(&model_text)),
                ("Hostname", Arc::clone(&host_text)),
            ];
            if let Some(held) = held {
                pairs.push(("job_id", joined(held.iter().map(|h| h.0.as_str()))));
                pairs.push(("queue", joined(held.iter().map(|h| h.1))));
                pairs.push(("user", joined(held.iter().map(|h| h.2))));
            }
            let gpu_labels = labels(pairs);
            let unhealthy = node.unhealthy_gpus.contains(&gpu.index);
            let state = match (held.is_some(), unhealthy) {
                (_, true) => "unhealthy",
                (true, false) => "allocated",
                (false, false) => "free",
            };
            *gpus.entry((pool, model, state)).or_default() += 1;
            let sample = fresh.and_then(|r| r.gpus.iter().find(|s| s.index == gpu.index));
            if held.is_some()
                && sample.is_some_and(|sample| sample.utilization_pct < IDLE_UTILIZATION_PCT)
            {
                *idle.entry((pool, model)).or_default() += 1;
            }
            let Some(sample) = sample else {
                continue;
            };
            let mut gauge = |name: &'static str, help: &'static str, value: f64| {
                families.gauge(name, help, Arc::clone(&gpu_labels), value);
            };
            gauge(
                "DCGM_FI_DEV_GPU_UTIL",
                "GPU utilization (in %).",
                f64::from(sample.utilization_pct),
            );
            gauge(
                "DCGM_FI_DEV_FB_USED",
                "Framebuffer memory used (in MiB).",
                sample.memory_used_mib as f64,
            );
            gauge(
                "DCGM_FI_DEV_FB_FREE",
                "Framebuffer memory free (in MiB).",
                sample
                    .memory_total_mib
                    .saturating_sub(sample.memory_used_mib) as f64,
            );
            if let Some(watts) = sample.power_watts {
                gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", watts);
            }
            if let Some(celsius) = sample.temperature_c {
                gauge(
                    "DCGM_FI_DEV_GPU_TEMP",
                    "GPU temperature (in C).",
                    f64::from(celsius),
                );
            }
            if let Some(mhz) = sample.sm_clock_mhz {
                gauge(
                    "DCGM_FI_DEV_SM_CLOCK",
                    "SM clock frequency (in MHz).",
                    f64::from(mhz),
                );
            }
            if let Some(xid) = sample.xid {
                gauge(
                    "DCGM_FI_DEV_XID_ERRORS",
                    "Value of the last XID error encountered.",
                    xid as f64,
                );
            }
            if let Some(errors) = sample.ecc_uncorrected {
                gauge(
                    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                    "Total number of double-bit volatile ECC errors.",
                    errors as f64,
                );
            }
            for (name, help, bytes) in [
                (
                    "muster_gpu_pcie_transmit_bytes",
                    "PCIe bytes the GPU sent since the driver loaded",
                    sample.pcie_tx_bytes,
                ),
                (
                    "muster_gpu_pcie_receive_bytes",
                    "PCIe bytes the GPU received since the driver loaded",
                    sample.pcie_rx_bytes,
                ),
            ] {
                if let Some(bytes) = bytes {
                    families.counter(name, help, Arc::clone(&gpu_labels), bytes);
                }
            }
        }
        if let Some(report) = fresh {
            let host = || labels(vec![("Hostname", Arc::clone(&host_text))]);
            if let Some(pct) = report.node.cpu_busy_pct {
                families.gauge(
                    "muster_node_cpu_busy_percent",
                    "Share of the node's CPU time busy since the previous sample",
                    host(),
                    pct,
                );
            }
            if let Some(used) = report.node.memory_used_mib {
                families.gauge(
                    "muster_node_memory_used_bytes",
                    "Node memory in use (total less available)",
                    host(),
                    (used * 1024 * 1024) as f64,
                );
            }
            if let Some(total) = report.node.memory_total_mib {
                families.gauge(
                    "muster_node_memory_total_bytes",
                    "Node memory",
                    host(),
                    (total * 1024 * 1024) as f64,
                );
            }
            for interface in &report.node.network {
                let interface_labels = labels(vec![
                    ("Hostname", Arc::clone(&host_text)),
                    ("interface", text(&interface.interface)),
                ]);
                families.counter(
                    "muster_node_network_receive_bytes",
                    "Bytes the interface received since the node booted",
                    Arc::clone(&interface_labels),
                    interface.receive_bytes,
                );
                families.counter(
                    "muster_node_network_transmit_bytes",
                    "Bytes the interface sent since the node booted",
                    interface_labels,
                    interface.transmit_bytes,
                );
            }
        }
    }
    for pool in control.pool_stacks() {
        for drift in pool.drift {
            families.gauge(
                "muster_node_stack_drift",
                "1 for each component of a node whose version differs from its pool's most \
                 common one",
                labels(vec![
                    ("Hostname", Arc::from(drift.node)),
                    ("pool", text(&pool.pool)),
                    ("component", Arc::from(drift.component)),
                    ("version", Arc::from(drift.version)),
                    ("expected", Arc::from(drift.expected)),
                ]),
                1.0,
            );
        }
    }
    for (state, count) in nodes {
        families.gauge(
            "muster_nodes",
            "Registered nodes by state",
            labels(vec![("state", text(state))]),
            count as f64,
        );
    }
    for ((pool, model, state), count) in gpus {
        families.gauge(
            "muster_gpus",
            "GPUs by pool, model and state (allocated, free, unhealthy)",
            labels(vec![
                ("pool", text(pool)),
                ("modelName", text(model)),
                ("state", text(state)),
            ]),
            count as f64,
        );
    }
    for (pool, (free, stranded)) in free_by_pool {
        families.gauge(
            "muster_pool_fragmentation",
            "Share of a pool's free GPUs that lie on partly used nodes (0: every free GPU is \
             on a wholly free node; 1: none is), on ready, uncordoned nodes",
            labels(vec![("pool", text(pool))]),
            if free == 0 {
                0.0
            } else {
                stranded as f64 / free as f64
            },
        );
    }
    for ((pool, model), count) in idle {
        families.gauge(
            "muster_gpus_idle",
            "Allocated GPUs whose latest utilisation is below 5%, by pool and model",
            labels(vec![("pool", text(pool)), ("modelName", text(model))]),
            count as f64,
        );
    }
    let mut registry = Registry::default();
    instruments.register(&mut registry);
    registry.register_collector(Box::new(families));
    let mut out = String::new();
    if let Err(error) = encode(&mut out, &registry) {
        tracing::error!("the metrics could not be encoded: {error}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_api::protocol::{GpuSample, NodeSample};
    use muster_control::{ControlConfig, Input, Software};
    use muster_model::{
        CpuMilli, GpuModel, GpuSpec, MemoryMib, NodeName, NodeSpec, PoolName, RackName, Time,
    };

    fn cluster() -> ControlPlane {
        let mut control = ControlPlane::new(ControlConfig::default());
        let spec = NodeSpec {
            name: NodeName::from("n1"),
            pool: PoolName::from("default"),
            rack: RackName::from("r1"),
            gpus: vec![GpuSpec {
                index: 0,
                uuid: "GPU-0".to_string(),
                model: GpuModel::new("L4"),
                memory: MemoryMib(24_576),
                nvlink_domain: 0,
            }],
            cpu: CpuMilli(8_000),
            memory: MemoryMib(65_536),
        };
        control
            .handle(
                Time(1_000),
                Input::Register {
                    spec,
                    address: "127.0.0.1".to_string(),
                    software: Software::default(),
                },
            )
            .expect("registered");
        control
    }

    fn report(at: u64) -> BTreeMap<String, NodeTelemetry> {
        BTreeMap::from([(
            "n1".to_string(),
            NodeTelemetry {
                received_ms: at,
                report: TelemetryReport {
                    epoch: 1,
                    sampled_ms: at,
                    gpus: vec![GpuSample {
                        index: 0,
                        utilization_pct: 42,
                        memory_used_mib: 100,
                        memory_total_mib: 24_576,
                        power_watts: None,
                        temperature_c: None,
                        sm_clock_mhz: None,
                        ecc_uncorrected: None,
                        xid: None,
                        pcie_tx_bytes: None,
                        pcie_rx_bytes: None,
                        healthy: true,
                    }],
                    node: NodeSample::default(),
                },
            },
        )])
    }

    #[test]
    fn fresh_telemetry_is_shown_and_stale_telemetry_is_not() {
        let control = cluster();
        let line = "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"GPU-0\",device=\"nvidia0\",\
                    modelName=\"L4\",Hostname=\"n1\"} 42.0";
        let none = UsageByNode::new();
        let fresh = render(
            &control,
            &report(100_000),
            &none,
            0,
            &Instruments::default(),
            &BTreeMap::new(),
            100_000 + STALE_MS,
        );
        assert!(fresh.lines().any(|l| l == line), "{fresh}");
        // What the device does not report is left out, not shown as 0.
        assert!(!fresh.contains("DCGM_FI_DEV_POWER_USAGE"), "{fresh}");
        let stale = render(
            &control,
            &report(100_000),
            &none,
            0,
            &Instruments::default(),
            &BTreeMap::new(),
            100_001 + STALE_MS,
        );
        assert!(!stale.contains("DCGM_FI_DEV_GPU_UTIL{"), "{stale}");
        // The inventory is shown either way, and the text ends as
        // OpenMetrics requires.
        assert!(
            stale.contains("muster_gpus{pool=\"default\",modelName=\"L4\",state=\"free\"} 1.0"),
            "{stale}"
        );
        assert!(stale.ends_with("# EOF\n"), "{stale}");
    }

    /// The names of the series a rendered text shows.
    fn shown(text: &str) -> BTreeSet<String> {
        text.lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| line.split(['{', ' ']).next())
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn every_series_shown_is_listed_and_the_dashboard_uses_only_listed_ones() {
        let control = cluster();
        let mut telemetry = report(100_000);
        if let Some(node) = telemetry.get_mut("n1") {
            node.report.node.cpu_busy_pct = Some(1.0);
            node.report.node.memory_used_mib = Some(1);
            node.report.node.memory_total_mib = Some(2);
            node.report.node.network = vec![muster_api::protocol::InterfaceSample {
                interface: "eth0".into(),
                receive_bytes: 1,
                transmit_bytes: 2,
            }];
            node.report.gpus[0].power_watts = Some(1.0);
            node.report.gpus[0].temperature_c = Some(1);
            node.report.gpus[0].sm_clock_mhz = Some(1);
            node.report.gpus[0].ecc_uncorrected = Some(0);
        }
        let instruments = Instruments::default();
        instruments.cycle_seconds.observe(0.01);
        instruments.placements.inc();
        instruments
            .request_seconds
            .get_or_create(&vec![("route", "/v1/jobs".to_string())])
            .observe(0.002);
        let text = render(
            &control,
            &telemetry,
            &UsageByNode::new(),
            0,
            &instruments,
            &BTreeMap::new(),
            100_000,
        );
        for name in shown(&text) {
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name);
            assert!(
                SERIES.contains(&name.as_str()) || SERIES.contains(&base),
                "{name} is not in SERIES"
            );
        }
        assert!(text.contains("muster_placements_total 1"), "{text}");
        assert!(
            text.contains("muster_api_request_seconds_count{route=\"/v1/jobs\"} 1"),
            "{text}"
        );
        // The dashboard's queries name only series muster shows.
        let dashboard: serde_json::Value =
            serde_json::from_str(include_str!("../../../docs/grafana/muster.json"))
                .expect("the dashboard is JSON");
        let panels = dashboard["panels"].as_array().expect("panels");
        assert!(panels.len() >= 10);
        let mut used = 0;
        for panel in panels {
            for target in panel["targets"].as_array().expect("targets") {
                let expr = target["expr"].as_str().expect("an expression");
                for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                    if word.starts_with("DCGM_") || word.starts_with("muster_") {
                        let base = ["_bucket", "_sum", "_count"]
                            .iter()
                            .find_map(|suffix| word.strip_suffix(suffix))
                            .unwrap_or(word);
                        assert!(
                            SERIES.contains(&word) || SERIES.contains(&base),
                            "the dashboard uses {word}"
                        );
                        used += 1;
                    }
                }
            }
        }
        assert!(used >= 15);
        // And the docs list every series.
        let docs = include_str!("../../../docs/observability.md");
        for name in SERIES {
            assert!(
                docs.contains(&format!("`{name}`")),
                "{name} is not in the docs"
            );
        }
    }
}
