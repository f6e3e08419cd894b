//! `GET /metrics`: the fleet's GPUs under the names and labels of NVIDIA's
//! DCGM exporter (`DCGM_FI_DEV_GPU_UTIL{gpu, UUID, modelName, Hostname}`,
//! ...), each with the `job`, `queue` and `user` holding the GPU, so the
//! dashboards people use for DCGM work unchanged; and muster's own series
//! (jobs by state and pending reason, nodes, GPUs allocated, free and idle
//! by pool, node CPU, memory and network). OpenMetrics text, rendered by
//! `prometheus-client` from the state and the latest telemetry at each
//! scrape: nothing is kept between scrapes.

use muster_api::protocol::TelemetryReport;
use muster_control::{ControlPlane, JobState};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::AtomicU64;

/// A node's latest telemetry, and when the server got it.
#[derive(Debug, Clone)]
pub struct NodeTelemetry {
    pub received_ms: u64,
    pub report: TelemetryReport,
}

/// Telemetry older than this is not shown (a lost or stopped agent's
/// numbers would mislead).
pub const STALE_MS: u64 = 60_000;

/// Below this utilisation (percent) an allocated GPU counts as idle.
pub const IDLE_UTILIZATION_PCT: u32 = 5;

/// The content type of what [`render`] gives.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

type Labels = Vec<(String, String)>;
type FloatGauge = Gauge<f64, AtomicU64>;

/// Families created on first use, registered once each.
struct Families {
    registry: Registry,
    gauges: BTreeMap<&'static str, Family<Labels, FloatGauge>>,
    counters: BTreeMap<&'static str, Family<Labels, Counter>>,
}

impl Families {
    fn new() -> Self {
        Families {
            registry: Registry::default(),
            gauges: BTreeMap::new(),
            counters: BTreeMap::new(),
        }
    }

    fn gauge(&mut self, name: &'static str, help: &str, labels: Labels, value: f64) {
        let registry = &mut self.registry;
        let family = self.gauges.entry(name).or_insert_with(|| {
            let family = Family::<Labels, FloatGauge>::default();
            registry.register(name, help, family.clone());
            family
        });
        family.get_or_create(&labels).set(value);
    }

    fn counter(&mut self, name: &'static str, help: &str, labels: Labels, value: u64) {
        let registry = &mut self.registry;
        let family = self.counters.entry(name).or_insert_with(|| {
            let family = Family::<Labels, Counter>::default();
            registry.register(name, help, family.clone());
            family
        });
        family.get_or_create(&labels).inc_by(value);
    }
}

fn label(key: &str, value: impl Into<String>) -> (String, String) {
    (key.to_string(), value.into())
}

fn joined<'a>(values: impl Iterator<Item = &'a str>) -> String {
    values
        .collect::<BTreeSet<&str>>()
        .into_iter()
        .collect::<Vec<_>>()
        .join(",")
}

/// The metrics as OpenMetrics text.
pub fn render(
    control: &ControlPlane,
    telemetry: &BTreeMap<String, NodeTelemetry>,
    now_ms: u64,
) -> String {
    let mut families = Families::new();

    // Jobs in memory that have not ended, by state and queue; pending ones
    // by queue and reason.
    let mut jobs: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    let mut pending: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for job in control.jobs().filter(|job| !job.state.is_final()) {
        *jobs
            .entry((job.state.name(), job.spec.queue.0.as_str()))
            .or_default() += 1;
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
            vec![label("state", state), label("queue", queue)],
            count as f64,
        );
    }
    for ((queue, reason), count) in pending {
        families.gauge(
            "muster_jobs_pending",
            "Pending jobs by queue and why they wait (the code muster ps shows)",
            vec![label("queue", queue), label("reason", reason)],
            count as f64,
        );
    }

    let mut nodes: BTreeMap<&str, u64> = BTreeMap::new();
    let mut gpus: BTreeMap<(&str, &str, &str), u64> = BTreeMap::new();
    let mut idle: BTreeMap<(&str, &str), u64> = BTreeMap::new();
    for node in control.nodes() {
        *nodes
            .entry(crate::records::node_state_name(node.state))
            .or_default() += 1;
        let hostname = node.spec.name.0.as_str();
        let pool = node.spec.pool.0.as_str();
        if node.cordoned {
            families.gauge(
                "muster_node_cordoned",
                "1 for a cordoned node",
                vec![label("Hostname", hostname)],
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
        for gpu in &node.spec.gpus {
            let model = gpu.model.as_str();
            let held = holders.get(&gpu.index);
            let mut labels = vec![
                label("gpu", gpu.index.to_string()),
                label("UUID", gpu.uuid.as_str()),
                label("device", format!("nvidia{}", gpu.index)),
                label("modelName", model),
                label("Hostname", hostname),
            ];
            if let Some(held) = held {
                labels.push(label("job", joined(held.iter().map(|h| h.0.as_str()))));
                labels.push(label("queue", joined(held.iter().map(|h| h.1))));
                labels.push(label("user", joined(held.iter().map(|h| h.2))));
            }
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
            let mut gauge = |name: &'static str, help: &str, value: f64| {
                families.gauge(name, help, labels.clone(), value);
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
            if let Some(errors) = sample.ecc_uncorrected {
                gauge(
                    "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
                    "Total number of double-bit volatile ECC errors.",
                    errors as f64,
                );
            }
        }
        if let Some(report) = fresh {
            let host = || vec![label("Hostname", hostname)];
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
                let labels = vec![
                    label("Hostname", hostname),
                    label("interface", interface.interface.as_str()),
                ];
                families.counter(
                    "muster_node_network_receive_bytes",
                    "Bytes the interface received since the node booted",
                    labels.clone(),
                    interface.receive_bytes,
                );
                families.counter(
                    "muster_node_network_transmit_bytes",
                    "Bytes the interface sent since the node booted",
                    labels,
                    interface.transmit_bytes,
                );
            }
        }
    }
    for (state, count) in nodes {
        families.gauge(
            "muster_nodes",
            "Registered nodes by state",
            vec![label("state", state)],
            count as f64,
        );
    }
    for ((pool, model, state), count) in gpus {
        families.gauge(
            "muster_gpus",
            "GPUs by pool, model and state (allocated, free, unhealthy)",
            vec![
                label("pool", pool),
                label("modelName", model),
                label("state", state),
            ],
            count as f64,
        );
    }
    for ((pool, model), count) in idle {
        families.gauge(
            "muster_gpus_idle",
            "Allocated GPUs whose latest utilisation is below 5%, by pool and model",
            vec![label("pool", pool), label("modelName", model)],
            count as f64,
        );
    }
    let mut text = String::new();
    if let Err(error) = encode(&mut text, &families.registry) {
        tracing::error!("the metrics could not be encoded: {error}");
    }
    text
}
