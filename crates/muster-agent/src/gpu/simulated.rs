//! The simulated backend: GPUs described by a spec such as `8xH100-80GB`,
//! for tests and demos on machines without GPUs.

use super::{GpuBackend, GpuError, GpuInfo, GpuInventory, GpuTelemetry};
use muster_model::{GpuModel, MemoryMib};
use std::sync::{Mutex, PoisonError};

/// Models whose memory need not be written in the spec, in GiB.
const KNOWN_MEMORY_GIB: &[(&str, u64)] = &[
    ("A10", 24),
    ("A10G", 24),
    ("A30", 24),
    ("A40", 48),
    ("B200", 192),
    ("GB200", 192),
    ("H200", 141),
    ("L4", 24),
    ("L40", 48),
    ("L40S", 48),
    ("RTX-4090", 24),
    ("RTX-A6000", 48),
    ("T4", 16),
];

/// Families built as SXM modules on NVLink baseboards: up to 8 GPUs of one
/// such model form one NVLink domain. Every other model (L4, T4, A10, L40S,
/// ...) is a PCIe card with a domain of its own.
const SXM_FAMILIES: &[&str] = &[
    "A100", "A800", "B100", "B200", "GB200", "GH200", "H100", "H200", "H800", "V100",
];

/// GPUs per NVLink domain (one HGX/DGX baseboard).
const GPUS_PER_BASEBOARD: u32 = 8;

/// Board power (TDP) by family, in watts; others get `DEFAULT_TDP_WATTS`.
const TDP_WATTS: &[(&str, u32)] = &[
    ("A10", 150),
    ("A10G", 150),
    ("A100", 400),
    ("B200", 1000),
    ("GB200", 1200),
    ("H100", 700),
    ("H200", 700),
    ("L4", 72),
    ("L40S", 350),
    ("T4", 70),
    ("V100", 300),
];
const DEFAULT_TDP_WATTS: u32 = 300;

#[derive(Debug, Clone, Copy)]
struct GpuState {
    utilization_pct: u32,
    /// PCIe bytes "moved" so far: a busy GPU moves more.
    pcie_bytes: u64,
    healthy: bool,
    /// The latest XID "reported" (`MUSTER_SIM_XID` of a task on it).
    xid: Option<u64>,
}

/// GPUs that exist only in this process. Everything is deterministic: the
/// same spec and node name give the same UUIDs, domains and telemetry.
#[derive(Debug)]
pub struct SimulatedBackend {
    gpus: Vec<GpuInfo>,
    states: Mutex<Vec<GpuState>>,
    /// Running tasks' load: their GPUs and utilisation (percent).
    loads: Mutex<std::collections::BTreeMap<String, (Vec<u32>, u32)>>,
}

/// What a task's GPUs report when it declares no `MUSTER_SIM_UTIL`.
pub const DEFAULT_TASK_UTILIZATION_PCT: u32 = 80;

impl SimulatedBackend {
    /// The most GPUs one simulated node may have.
    pub const MAX_GPUS: u32 = 64;

    /// Parses a `--simulate-gpus` spec: items `COUNTxMODEL` separated by
    /// commas, such as `8xH100-80GB` or `2xA100-40GB,4xL4`. A bare `MODEL`
    /// counts one. A model's memory comes from its `-NNGB` suffix, or, for a
    /// few models sold in one size (`L4`, `T4`, `A10`, `H200`, `B200`, ...),
    /// from a table. Indices follow the order of the spec.
    ///
    /// UUIDs are `GPU-sim-<hash of node_name>-<index>`, so nodes simulated
    /// side by side have distinct GPUs.
    pub fn parse(spec: &str, node_name: &str) -> Result<Self, GpuError> {
        let invalid = |reason: String| GpuError::InvalidSimulatedSpec {
            spec: spec.to_string(),
            reason,
        };
        if spec.trim().is_empty() {
            return Err(invalid("it is empty".to_string()));
        }
        let node_seed = fnv1a(node_name.as_bytes());
        let mut gpus: Vec<GpuInfo> = Vec::new();
        let mut domain_size = 0;
        for item in spec.split(',') {
            let (count, model, memory) = parse_item(item).map_err(invalid)?;
            let total = gpus.len() as u64 + u64::from(count);
            if total > u64::from(Self::MAX_GPUS) {
                return Err(invalid(format!(
                    "that is {total} GPUs, and a node has at most {}",
                    Self::MAX_GPUS
                )));
            }
            let sxm = SXM_FAMILIES.contains(&family(&model));
            for _ in 0..count {
                let index = gpus.len() as u32;
                let nvlink_domain = match gpus.last() {
                    None => 0,
                    Some(previous) => {
                        let joins =
                            sxm && previous.model == model && domain_size < GPUS_PER_BASEBOARD;
                        if joins {
                            previous.nvlink_domain
                        } else {
                            domain_size = 0;
                            previous.nvlink_domain + 1
                        }
                    }
                };
                domain_size += 1;
                gpus.push(GpuInfo {
                    index,
                    uuid: format!("GPU-sim-{node_seed:016x}-{index}"),
                    model: model.clone(),
                    memory,
                    nvlink_domain,
                });
            }
        }
        let states = vec![
            GpuState {
                utilization_pct: 0,
                pcie_bytes: 0,
                healthy: true,
                xid: None,
            };
            gpus.len()
        ];
        Ok(SimulatedBackend {
            gpus,
            states: Mutex::new(states),
            loads: Mutex::new(std::collections::BTreeMap::new()),
        })
    }

    /// The simulated GPUs, ordered by index.
    pub fn gpus(&self) -> &[GpuInfo] {
        &self.gpus
    }

    /// Makes GPU `index` report `utilization_pct` (capped at 100), and
    /// memory and power in proportion, from now on.
    pub fn set_busy(&self, index: u32, utilization_pct: u32) -> Result<(), GpuError> {
        self.update(index, |state| {
            state.utilization_pct = utilization_pct.min(100)
        })
    }

    /// Makes GPU `index` report itself healthy or not, from now on.
    pub fn set_healthy(&self, index: u32, healthy: bool) -> Result<(), GpuError> {
        self.update(index, |state| state.healthy = healthy)
    }

    fn update(&self, index: u32, change: impl FnOnce(&mut GpuState)) -> Result<(), GpuError> {
        let mut states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
        let count = states.len();
        let state = states
            .get_mut(index as usize)
            .ok_or(GpuError::NoSuchGpu { index, count })?;
        change(state);
        Ok(())
    }
}

impl GpuBackend for SimulatedBackend {
    fn inventory(&self) -> Result<GpuInventory, GpuError> {
        Ok(GpuInventory {
            gpus: self.gpus.clone(),
            driver_version: Some("simulated".to_string()),
            cuda_version: None,
            nvml_version: None,
            vbios_version: Some("simulated".to_string()),
            backend: "simulated",
        })
    }

    fn task_started(
        &self,
        task: &str,
        gpus: &[u32],
        env: &std::collections::BTreeMap<String, String>,
    ) {
        // `MUSTER_SIM_XID=79`: the driver reports that XID on the task's
        // GPUs as it starts (a fatal one takes them out of service).
        if let Some(xid) = env
            .get("MUSTER_SIM_XID")
            .and_then(|text| text.trim().parse::<u64>().ok())
        {
            let mut states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
            for &index in gpus {
                if let Some(state) = states.get_mut(index as usize) {
                    state.xid = Some(xid);
                }
            }
        }
        // `MUSTER_SIM_UTIL=0.9`: the task keeps its GPUs 90% busy.
        let pct = env
            .get("MUSTER_SIM_UTIL")
            .and_then(|text| text.trim().parse::<f64>().ok())
            .filter(|share| share.is_finite())
            .map_or(DEFAULT_TASK_UTILIZATION_PCT, |share| {
                (share.clamp(0.0, 1.0) * 100.0).round() as u32
            });
        self.loads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(task.to_string(), (gpus.to_vec(), pct));
    }

    fn task_ended(&self, task: &str) {
        self.loads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(task);
    }

    fn telemetry(&self) -> Result<Vec<GpuTelemetry>, GpuError> {
        let mut states = self.states.lock().unwrap_or_else(PoisonError::into_inner);
        let mut load = vec![0u32; self.gpus.len()];
        for (gpus, pct) in self
            .loads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
        {
            for &index in gpus {
                if let Some(busy) = load.get_mut(index as usize) {
                    *busy = (*busy + pct).min(100);
                }
            }
        }
        Ok(self
            .gpus
            .iter()
            .zip(states.iter_mut())
            .zip(load)
            .map(|((gpu, state), load)| {
                let pct = state.utilization_pct.max(load);
                // Deterministic: 10 MB a sample at full load, per reading.
                state.pcie_bytes += u64::from(pct) * 100_000;
                let tdp = TDP_WATTS
                    .iter()
                    .find(|(name, _)| *name == family(&gpu.model))
                    .map_or(DEFAULT_TDP_WATTS, |(_, watts)| *watts);
                let idle = tdp / 10;
                GpuTelemetry {
                    index: gpu.index,
                    utilization_pct: pct,
                    memory_used: MemoryMib(gpu.memory.0 * u64::from(pct) / 100),
                    power_milliwatts: Some((idle + (tdp - idle) * pct / 100) * 1000),
                    temperature_c: Some(30 + pct / 2),
                    ecc_errors: Some(0),
                    sm_clock_mhz: Some(if pct > 0 { 1980 } else { 345 }),
                    xid: state.xid,
                    pcie_tx_bytes: Some(state.pcie_bytes),
                    pcie_rx_bytes: Some(state.pcie_bytes / 2),
                    healthy: state.healthy && state.xid.and_then(muster_model::fatal_xid).is_none(),
                }
            })
            .collect())
    }
}

/// The family of a model: its name up to the first dash (`H100-80GB` →
/// `H100`); `RTX-4090` stays whole, since `RTX` alone names no GPU.
fn family(model: &GpuModel) -> &str {
    let name = model.as_str();
    if name.starts_with("RTX-") {
        return name;
    }
    name.split('-').next().unwrap_or(name)
}

/// One `COUNTxMODEL` item: the count, the model and its memory.
fn parse_item(item: &str) -> Result<(u32, GpuModel, MemoryMib), String> {
    let item = item.trim();
    if item.is_empty() {
        return Err("it has an empty item (a comma too many?)".to_string());
    }
    let digits_len = item.bytes().take_while(u8::is_ascii_digit).count();
    let (count, model_text) = if digits_len == 0 {
        if item.starts_with(['-', '+']) {
            return Err(format!(
                "`{item}`: the count must be a whole number of at least 1"
            ));
        }
        (1, item)
    } else {
        let (digits, rest) = item.split_at(digits_len);
        let Some(model_text) = rest.trim_start().strip_prefix(['x', 'X']) else {
            return Err(format!(
                "`{item}` has a count but no `x`: write `{digits}x<MODEL>`"
            ));
        };
        let count: u32 = digits
            .parse()
            .map_err(|_| format!("`{item}`: the count {digits} is too large"))?;
        if count == 0 {
            return Err(format!("`{item}`: the count must be at least 1"));
        }
        (count, model_text.trim())
    };
    if model_text.is_empty() {
        return Err(format!("`{item}` names no GPU model after the count"));
    }
    if !model_text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '.' || c == '_')
    {
        return Err(format!(
            "`{model_text}` is not a GPU model name: use letters, digits and dashes"
        ));
    }
    let model = GpuModel::new(model_text);
    let memory = memory_of(&model)?;
    Ok((count, model, memory))
}

/// A model's memory, from its `-NNGB` suffix or the table of known models.
fn memory_of(model: &GpuModel) -> Result<MemoryMib, String> {
    let name = model.as_str();
    if let Some((_, suffix)) = name.rsplit_once('-')
        && let Some(digits) = suffix.strip_suffix("GB")
        && !digits.is_empty()
        && digits.bytes().all(|b| b.is_ascii_digit())
    {
        return match digits.parse::<u64>() {
            Ok(gib @ 1..=4096) => Ok(MemoryMib(gib * 1024)),
            _ => Err(format!(
                "`{name}`: the memory must be between 1GB and 4096GB"
            )),
        };
    }
    if let Some((_, gib)) = KNOWN_MEMORY_GIB.iter().find(|(known, _)| *known == name) {
        return Ok(MemoryMib(gib * 1024));
    }
    let known: Vec<&str> = KNOWN_MEMORY_GIB.iter().map(|(known, _)| *known).collect();
    Err(format!(
        "the memory of GPU model `{name}` is unknown: add it as a suffix, like `{name}-80GB`, \
         or use a model whose memory is known ({})",
        known.join(", ")
    ))
}

/// FNV-1a, 64 bits: a stable hash (unlike std's, which may change between
/// Rust releases), so simulated UUIDs are the same on every run.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(spec: &str) -> SimulatedBackend {
        SimulatedBackend::parse(spec, "node-a").expect("a valid spec")
    }

    fn domains(backend: &SimulatedBackend) -> Vec<u32> {
        backend.gpus().iter().map(|gpu| gpu.nvlink_domain).collect()
    }

    fn check_error(spec: &str, expected: &str) {
        let error = SimulatedBackend::parse(spec, "node-a").expect_err(spec);
        let message = error.to_string();
        assert!(
            message.contains(expected),
            "{spec}: `{message}` should contain `{expected}`"
        );
        assert!(
            message.contains("like `8xH100-80GB`"),
            "{spec}: every spec error shows an example: {message}"
        );
    }

    #[test]
    fn eight_h100s_form_one_nvlink_domain() {
        let backend = parse("8xH100-80GB");
        let inventory = backend.inventory().expect("inventory");
        assert_eq!(inventory.backend, "simulated");
        assert_eq!(inventory.gpus.len(), 8);
        for (index, gpu) in inventory.gpus.iter().enumerate() {
            assert_eq!(gpu.index, index as u32);
            assert_eq!(gpu.model, GpuModel::new("H100-80GB"));
            assert_eq!(gpu.memory, MemoryMib(80 * 1024));
            assert_eq!(gpu.nvlink_domain, 0);
        }
    }

    #[test]
    fn mixed_spec_follows_its_order_and_pcie_cards_stand_alone() {
        let backend = parse("2xA100-40GB, 4xl4");
        let models: Vec<&str> = backend
            .gpus()
            .iter()
            .map(|gpu| gpu.model.as_str())
            .collect();
        assert_eq!(models, ["A100-40GB", "A100-40GB", "L4", "L4", "L4", "L4"]);
        assert_eq!(backend.gpus()[2].memory, MemoryMib(24 * 1024));
        assert_eq!(domains(&backend), [0, 0, 1, 2, 3, 4]);
    }

    #[test]
    fn sxm_domains_hold_at_most_eight_gpus_of_one_model() {
        assert_eq!(
            domains(&parse("12xH200")),
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1]
        );
        // Consecutive items of one model fill the same baseboard.
        assert_eq!(
            domains(&parse("4xB200,4xB200,1xB200")),
            [0; 8].iter().copied().chain([1]).collect::<Vec<_>>()
        );
        assert_eq!(domains(&parse("2xH100-80GB,2xH100-94GB")), [0, 0, 1, 1]);
    }

    #[test]
    fn bare_model_counts_one_and_custom_models_need_a_memory_suffix() {
        let backend = parse("T4");
        assert_eq!(backend.gpus().len(), 1);
        assert_eq!(backend.gpus()[0].memory, MemoryMib(16 * 1024));
        let custom = parse("3xFOO-bar-48GB");
        assert_eq!(custom.gpus()[0].model.as_str(), "FOO-BAR-48GB");
        assert_eq!(custom.gpus()[0].memory, MemoryMib(48 * 1024));
        assert_eq!(domains(&custom), [0, 1, 2], "unknown families are PCIe");
    }

    #[test]
    fn bad_specs_are_clear_errors() {
        check_error("", "it is empty");
        check_error("0xH100-80GB", "at least 1");
        check_error("8x", "names no GPU model");
        check_error("-3xL4", "whole number of at least 1");
        check_error(
            "8xFOO-bar-baz",
            "memory of GPU model `FOO-BAR-BAZ` is unknown",
        );
        check_error("8xFOO-bar-baz", "like `FOO-BAR-BAZ-80GB`");
        check_error("8xH100", "`H100-80GB`");
        check_error("8", "has a count but no `x`");
        check_error("8H100", "has a count but no `x`");
        check_error("2xL4,,2xT4", "empty item");
        check_error("2xL4,", "empty item");
        check_error("99999999999xL4", "too large");
        check_error("65xL4", "at most 64");
        check_error("40xL4,40xT4", "that is 80 GPUs");
        check_error("2xH100 80GB", "not a GPU model name");
        check_error("2xH100-0GB", "between 1GB and 4096GB");
    }

    #[test]
    fn uuids_are_deterministic_and_differ_per_node() {
        let a = SimulatedBackend::parse("2xL4", "node-a").expect("valid");
        let again = SimulatedBackend::parse("2xL4", "node-a").expect("valid");
        let b = SimulatedBackend::parse("2xL4", "node-b").expect("valid");
        assert_eq!(a.gpus(), again.gpus());
        assert_ne!(a.gpus()[0].uuid, b.gpus()[0].uuid);
        assert_ne!(a.gpus()[0].uuid, a.gpus()[1].uuid);
        assert!(a.gpus()[1].uuid.starts_with("GPU-sim-"));
        assert!(a.gpus()[1].uuid.ends_with("-1"));
        assert!(!a.gpus()[0].uuid.contains("node-a"));
    }

    #[test]
    fn a_task_declaring_a_fatal_xid_takes_its_gpus_out_of_service() {
        let backend = parse("4xH100-80GB");
        let env = |xid: &str| {
            std::collections::BTreeMap::from([("MUSTER_SIM_XID".to_string(), xid.to_string())])
        };
        // An application's own fault (XID 13) leaves the GPU in service.
        backend.task_started("a", &[0], &env("13"));
        backend.task_started("b", &[1, 2], &env("79"));
        let telemetry = backend.telemetry().expect("telemetry");
        assert_eq!((telemetry[0].xid, telemetry[0].healthy), (Some(13), true));
        assert_eq!((telemetry[1].xid, telemetry[1].healthy), (Some(79), false));
        assert!(!telemetry[2].healthy);
        assert_eq!((telemetry[3].xid, telemetry[3].healthy), (None, true));
        // It stays so after the task ends: the GPU needs a reset.
        backend.task_ended("b");
        assert!(!backend.telemetry().expect("telemetry")[1].healthy);
    }

    #[test]
    fn telemetry_is_idle_until_told_busy() {
        let backend = parse("2xH100-80GB");
        let idle = backend.telemetry().expect("telemetry");
        assert_eq!(idle.len(), 2);
        assert_eq!(idle[0].utilization_pct, 0);
        assert_eq!(idle[0].memory_used, MemoryMib::ZERO);
        assert_eq!(idle[0].power_milliwatts, Some(70_000));
        assert!(idle[0].healthy);

        backend.set_busy(1, 150).expect("gpu 1 exists");
        backend.set_healthy(0, false).expect("gpu 0 exists");
        let busy = backend.telemetry().expect("telemetry");
        assert_eq!(busy[1].utilization_pct, 100);
        assert_eq!(busy[1].memory_used, MemoryMib(80 * 1024));
        assert_eq!(busy[1].power_milliwatts, Some(700_000));
        assert_eq!(busy[1].temperature_c, Some(80));
        assert!(!busy[0].healthy);
        // The same load reads the same, but for the PCIe counters, which a
        // busy GPU moves on at each reading and an idle one does not.
        let again = backend.telemetry().expect("telemetry");
        let without_counters = |samples: &[GpuTelemetry]| -> Vec<GpuTelemetry> {
            samples
                .iter()
                .map(|s| GpuTelemetry {
                    pcie_tx_bytes: None,
                    pcie_rx_bytes: None,
                    ..s.clone()
                })
                .collect()
        };
        assert_eq!(
            without_counters(&busy),
            without_counters(&again),
            "deterministic"
        );
        assert_eq!(busy[1].pcie_tx_bytes, Some(10_000_000));
        assert_eq!(again[1].pcie_tx_bytes, Some(20_000_000));
        assert_eq!(again[0].pcie_tx_bytes, Some(0));

        let error = backend.set_busy(2, 10).expect_err("only 2 GPUs");
        assert_eq!(
            error.to_string(),
            "no GPU with index 2 on this node (it has 2)"
        );
    }

    #[test]
    fn inventory_converts_to_model_gpu_specs() {
        let specs = parse("2xL4").inventory().expect("inventory").gpu_specs();
        assert_eq!(specs.len(), 2);
        assert_eq!(specs[1].index, 1);
        assert_eq!(specs[1].nvlink_domain, 1);
    }
}
