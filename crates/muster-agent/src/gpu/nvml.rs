//! The NVML backend: real GPUs through the NVIDIA driver.
//!
//! `nvml-wrapper` loads `libnvidia-ml.so.1` only in [`NvmlBackend::new`], so
//! nothing here needs a GPU to build or to start; without a driver, `new`
//! returns [`GpuError::NoDriver`]. NVML calls block (briefly): the agent calls
//! the backend from a blocking thread.
//!
//! XID events: an NVML event set registered for critical XIDs on every GPU
//! at start, drained (without waiting) at each telemetry read; the latest
//! XID per GPU is kept, and a fatal one ([`muster_model::fatal_xid`])
//! makes the GPU unhealthy until the agent restarts. PCIe bytes come from
//! NVML's field values (`NVML_FI_DEV_PCIE_COUNT_TX_BYTES`/`RX_BYTES`, where
//! the driver counts them). Not read yet: NVLink throughput (its field
//! values are per link, and nvml-wrapper 0.13 asks for link 0 only), MIG
//! instances, row remapping.

use super::{GpuBackend, GpuError, GpuInfo, GpuInventory, GpuTelemetry};
use muster_model::{GpuModel, MemoryMib};
use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::{Clock, EccCounter, MemoryError, TemperatureSensor};
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::sync::{Mutex, PoisonError};

/// The library the NVIDIA driver installs (the unversioned `.so` comes only
/// with development packages, so it is not asked for).
const LIBRARY: &str = "libnvidia-ml.so.1";

/// NVML's `NVML_NVLINK_MAX_LINKS`: links are probed until one is refused.
const MAX_NVLINK_LINKS: u32 = 18;

const MIB: u64 = 1024 * 1024;

/// GPUs read through NVML.
pub struct NvmlBackend {
    /// Loaded once per agent process and kept for its life (the event set
    /// borrows it).
    nvml: &'static Nvml,
    /// Critical XID events of every GPU that supports them (`None`: no GPU
    /// does, or the set could not be made).
    events: Option<Mutex<EventSet<'static>>>,
    /// The latest XID per GPU index.
    xids: Mutex<BTreeMap<u32, u64>>,
}

impl std::fmt::Debug for NvmlBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlBackend").finish_non_exhaustive()
    }
}

impl NvmlBackend {
    /// Loads `libnvidia-ml.so.1` and initializes NVML.
    pub fn new() -> Result<Self, GpuError> {
        Self::with_library_path(LIBRARY)
    }

    /// Loads NVML from another path (a driver installed outside the loader's
    /// search path).
    pub fn with_library_path(path: impl AsRef<OsStr>) -> Result<Self, GpuError> {
        let nvml: &'static Nvml = Box::leak(Box::new(
            Nvml::builder()
                .lib_path(path.as_ref())
                .init()
                .map_err(init_error)?,
        ));
        Ok(NvmlBackend {
            nvml,
            events: xid_events(nvml).map(Mutex::new),
            xids: Mutex::new(BTreeMap::new()),
        })
    }

    /// Takes the XID events that arrived since the last call.
    fn drain_xids(&self) {
        let Some(events) = &self.events else {
            return;
        };
        let events = events.lock().unwrap_or_else(PoisonError::into_inner);
        let mut xids = self.xids.lock().unwrap_or_else(PoisonError::into_inner);
        // Bounded: a storm of events is read over several samples.
        for _ in 0..1_000 {
            let Ok(event) = events.wait(0) else {
                break;
            };
            if let (Ok(index), Some(XidError::Value(xid))) =
                (event.device.index(), event.event_data)
            {
                tracing::warn!(gpu = index, xid, "the driver reported an XID");
                xids.insert(index, xid);
            }
        }
    }

    fn device(&self, index: u32) -> Result<nvml_wrapper::Device<'_>, GpuError> {
        self.nvml
            .device_by_index(index)
            .map_err(|source| nvml_error(format!("open GPU {index}"), source))
    }

    /// Each GPU's PCI bus id and the remote PCI bus ids of its active NVLink
    /// links. A GPU whose NVLink state cannot be read has no links.
    fn nvlink_links(&self, count: u32) -> (Vec<Option<String>>, Vec<(usize, String)>) {
        let mut bus_ids = Vec::new();
        let mut links = Vec::new();
        for index in 0..count {
            let Ok(device) = self.nvml.device_by_index(index) else {
                bus_ids.push(None);
                continue;
            };
            bus_ids.push(
                device
                    .pci_info()
                    .ok()
                    .map(|pci| normalize_bus_id(&pci.bus_id)),
            );
            for link in 0..MAX_NVLINK_LINKS {
                let wrapper = device.link_wrapper_for(link);
                match wrapper.is_active() {
                    Ok(true) => {
                        if let Ok(remote) = wrapper.remote_pci_info() {
                            links.push((index as usize, normalize_bus_id(&remote.bus_id)));
                        }
                    }
                    Ok(false) => {}
                    // Past the GPU's last link, or no NVLink at all.
                    Err(_) => break,
                }
            }
        }
        (bus_ids, links)
    }
}

impl GpuBackend for NvmlBackend {
    fn inventory(&self) -> Result<GpuInventory, GpuError> {
        let count = self
            .nvml
            .device_count()
            .map_err(|source| nvml_error("count the GPUs".to_string(), source))?;
        let (bus_ids, links) = self.nvlink_links(count);
        let domains = nvlink_domains(&bus_ids, &links);
        let mut gpus = Vec::new();
        let mut vbios = std::collections::BTreeSet::new();
        for index in 0..count {
            let device = self.device(index)?;
            if let Ok(version) = device.vbios_version() {
                vbios.insert(version);
            }
            let uuid = device
                .uuid()
                .map_err(|source| nvml_error(format!("read the UUID of GPU {index}"), source))?;
            let name = device
                .name()
                .map_err(|source| nvml_error(format!("read the name of GPU {index}"), source))?;
            let memory = device.memory_info().map_err(|source| {
                nvml_error(format!("read the memory size of GPU {index}"), source)
            })?;
            let memory = MemoryMib(memory.total / MIB);
            gpus.push(GpuInfo {
                index,
                uuid,
                model: normalize_gpu_name(&name, memory),
                memory,
                nvlink_domain: domains.get(index as usize).copied().unwrap_or(index),
            });
        }
        Ok(GpuInventory {
            gpus,
            driver_version: self.nvml.sys_driver_version().ok(),
            cuda_version: self.nvml.sys_cuda_driver_version().ok().map(|version| {
                format!(
                    "{}.{}",
                    nvml_wrapper::cuda_driver_version_major(version),
                    nvml_wrapper::cuda_driver_version_minor(version)
                )
            }),
            nvml_version: self.nvml.sys_nvml_version().ok(),
            vbios_version: match vbios.len() {
                0 => None,
                1 => vbios.into_iter().next(),
                _ => Some(format!(
                    "mixed: {}",
                    vbios.into_iter().collect::<Vec<_>>().join(", ")
                )),
            },
            backend: "nvml",
        })
    }

    fn telemetry(&self) -> Result<Vec<GpuTelemetry>, GpuError> {
        self.drain_xids();
        let xids = self
            .xids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let count = self
            .nvml
            .device_count()
            .map_err(|source| nvml_error("count the GPUs".to_string(), source))?;
        let mut samples = Vec::new();
        for index in 0..count {
            let device = match self.nvml.device_by_index(index) {
                Ok(device) => device,
                // A GPU that cannot even be opened is reported, as unhealthy.
                Err(_) => {
                    samples.push(GpuTelemetry {
                        index,
                        utilization_pct: 0,
                        memory_used: MemoryMib::ZERO,
                        power_milliwatts: None,
                        temperature_c: None,
                        ecc_errors: None,
                        sm_clock_mhz: None,
                        xid: xids.get(&index).copied(),
                        pcie_tx_bytes: None,
                        pcie_rx_bytes: None,
                        healthy: false,
                    });
                    continue;
                }
            };
            let utilization = device.utilization_rates();
            let memory = device.memory_info();
            let power = device.power_usage();
            let temperature = device.temperature(TemperatureSensor::Gpu);
            let ecc = device.total_ecc_errors(MemoryError::Uncorrected, EccCounter::Volatile);
            let pending_retirement = device.are_pages_pending_retired();
            let lost = [
                lost(&utilization),
                lost(&memory),
                lost(&power),
                lost(&temperature),
                lost(&ecc),
                lost(&pending_retirement),
            ]
            .contains(&true);
            let ecc = ecc.ok();
            let (pcie_tx_bytes, pcie_rx_bytes) = pcie_bytes(&device);
            samples.push(GpuTelemetry {
                index,
                utilization_pct: utilization.map(|rates| rates.gpu.min(100)).unwrap_or(0),
                memory_used: memory
                    .map(|info| MemoryMib(info.used / MIB))
                    .unwrap_or(MemoryMib::ZERO),
                power_milliwatts: power.ok(),
                temperature_c: temperature.ok(),
                ecc_errors: ecc,
                sm_clock_mhz: device.clock_info(Clock::SM).ok(),
                xid: xids.get(&index).copied(),
                pcie_tx_bytes,
                pcie_rx_bytes,
                healthy: !lost
                    && !pending_retirement.unwrap_or(false)
                    && ecc.unwrap_or(0) == 0
                    && xids
                        .get(&index)
                        .and_then(|xid| muster_model::fatal_xid(*xid))
                        .is_none(),
            });
        }
        Ok(samples)
    }
}

/// NVML's field ids of the PCIe byte counters.
const PCIE_COUNT_TX_BYTES: u32 = 197;
const PCIE_COUNT_RX_BYTES: u32 = 198;

/// PCIe bytes sent and received since the driver loaded, where counted.
fn pcie_bytes(device: &nvml_wrapper::Device<'_>) -> (Option<u64>, Option<u64>) {
    use nvml_wrapper::enums::device::SampleValue;
    use nvml_wrapper::structs::device::FieldId;
    let Ok(values) =
        device.field_values_for(&[FieldId(PCIE_COUNT_TX_BYTES), FieldId(PCIE_COUNT_RX_BYTES)])
    else {
        return (None, None);
    };
    let value = |i: usize| match values.get(i) {
        Some(Ok(sample)) => match sample.value {
            Ok(SampleValue::U64(v)) => Some(v),
            Ok(SampleValue::U32(v)) => Some(u64::from(v)),
            Ok(SampleValue::I64(v)) => u64::try_from(v).ok(),
            _ => None,
        },
        _ => None,
    };
    (value(0), value(1))
}

/// An event set with every GPU that supports critical XID events
/// registered; `None` when none does.
fn xid_events(nvml: &'static Nvml) -> Option<EventSet<'static>> {
    let count = nvml.device_count().ok()?;
    let mut set = nvml.create_event_set().ok()?;
    let mut registered = 0;
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
        // A failed registration frees the set: only GPUs that say they
        // support the events are registered.
        let supported = device
            .supported_event_types()
            .is_ok_and(|types| types.contains(EventTypes::CRITICAL_XID_ERROR));
        if !supported {
            tracing::info!(gpu = index, "no XID events from this GPU");
            continue;
        }
        match device.register_events(EventTypes::CRITICAL_XID_ERROR, set) {
            Ok(back) => {
                registered += 1;
                set = back;
            }
            Err(error) => {
                tracing::warn!(gpu = index, error = %error.error, "cannot watch XID events");
                return None;
            }
        }
    }
    (registered > 0).then_some(set)
}

/// Errors that mean the GPU itself is gone or wedged (not merely that a
/// query is unsupported).
fn lost<T>(result: &Result<T, NvmlError>) -> bool {
    matches!(
        result,
        Err(NvmlError::GpuLost | NvmlError::ResetRequired | NvmlError::CorruptedInfoROM)
    )
}

fn nvml_error(action: String, source: NvmlError) -> GpuError {
    GpuError::Nvml { action, source }
}

/// Maps a failed `Nvml::init` to an error that says what to do.
fn init_error(error: NvmlError) -> GpuError {
    match error {
        NvmlError::LibloadingError(source) => GpuError::NoDriver {
            detail: source.to_string(),
        },
        NvmlError::LibraryNotFound => GpuError::NoDriver {
            detail: error.to_string(),
        },
        NvmlError::FailedToLoadSymbol(detail) => GpuError::DriverTooOld { detail },
        NvmlError::FunctionNotFound => GpuError::DriverTooOld {
            detail: error.to_string(),
        },
        NvmlError::DriverNotLoaded | NvmlError::LibRmVersionMismatch => GpuError::DriverNotLoaded {
            detail: error.to_string(),
        },
        NvmlError::NoPermission => GpuError::NoPermission,
        other => nvml_error("initialize".to_string(), other),
    }
}

/// Words in NVML's product names that are not part of the model as the fleet
/// names it: the vendor, the brand, the form factor, the memory type.
const NOISE_WORDS: &[&str] = &[
    "NVIDIA",
    "TESLA",
    "GEFORCE",
    "GENERATION",
    "SXM",
    "SXM2",
    "SXM3",
    "SXM4",
    "SXM5",
    "SXM6",
    "PCIE",
    "NVL",
    "HBM2",
    "HBM2E",
    "HBM3",
    "HBM3E",
];

/// Families sold with several memory sizes: their model name gets the size
/// (from the name when it says it, else from the memory NVML reports).
const MULTI_MEMORY_FAMILIES: &[&str] = &["A100", "A800", "H100", "H800", "V100"];

/// Turns an NVML product name into the model name the fleet uses, for
/// example `NVIDIA H100 80GB HBM3` → `H100-80GB`.
///
/// The rules: split on spaces and dashes; drop the vendor, brand, form factor
/// and memory type (`NVIDIA`, `Tesla`, `GeForce`, `SXM4`, `PCIe`, `NVL`,
/// `HBM3`, ...); join what is left with dashes; then put the memory size
/// last, as `-NNGB`: the size the name gives, or, for families sold in
/// several sizes (A100, A800, H100, H800, V100), the reported `memory`
/// rounded to whole GiB. So an H100 PCIe (79.6 GiB) and an H100 SXM both
/// become `H100-80GB`, an H100 NVL (93.6 GiB) `H100-94GB`, and
/// `Tesla T4` becomes `T4`. An empty name becomes `UNKNOWN`.
pub fn normalize_gpu_name(name: &str, memory: MemoryMib) -> GpuModel {
    let mut words = Vec::new();
    let mut memory_word = None;
    for raw in name.split(|c: char| c.is_whitespace() || c == '-') {
        let word: String = raw
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '.')
            .collect::<String>()
            .to_ascii_uppercase();
        if word.is_empty() || NOISE_WORDS.contains(&word.as_str()) {
            continue;
        }
        let is_memory = word
            .strip_suffix("GB")
            .is_some_and(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()));
        if is_memory {
            memory_word.get_or_insert(word);
        } else {
            words.push(word);
        }
    }
    let Some(family) = words.first() else {
        return GpuModel::new("UNKNOWN");
    };
    if memory_word.is_none() && MULTI_MEMORY_FAMILIES.contains(&family.as_str()) && memory.0 > 0 {
        memory_word = Some(format!("{}GB", (memory.0 + 512) / 1024));
    }
    words.extend(memory_word);
    GpuModel::new(&words.join("-"))
}

/// `00000000:18:00.0` and `0000:18:00.0` name the same device: an 8-digit
/// upper-case domain and upper-case hex digits.
fn normalize_bus_id(bus_id: &str) -> String {
    let bus_id = bus_id.trim().trim_end_matches('\0');
    match bus_id.split_once(':') {
        Some((domain, rest)) => match u32::from_str_radix(domain, 16) {
            Ok(domain) => format!("{domain:08X}:{}", rest.to_ascii_uppercase()),
            Err(_) => bus_id.to_ascii_uppercase(),
        },
        None => bus_id.to_ascii_uppercase(),
    }
}

/// NVLink domains from link endpoints, by union-find.
///
/// `bus_ids[i]` is GPU `i`'s PCI bus id (`None` when unknown); each link
/// `(i, remote)` is an active NVLink link from GPU `i` to the device at PCI
/// bus id `remote`, a GPU or an NVSwitch. Everything connected, directly or
/// through switches, is one domain. Domains are numbered from 0 in the order
/// of their lowest GPU index; a GPU without links is a domain of its own.
fn nvlink_domains(bus_ids: &[Option<String>], links: &[(usize, String)]) -> Vec<u32> {
    let mut node_of_bus: BTreeMap<&str, usize> = BTreeMap::new();
    for (index, bus_id) in bus_ids.iter().enumerate() {
        if let Some(bus_id) = bus_id {
            node_of_bus.entry(bus_id.as_str()).or_insert(index);
        }
    }
    let mut parent: Vec<usize> = (0..bus_ids.len()).collect();
    fn root(parent: &mut [usize], mut node: usize) -> usize {
        while parent[node] != node {
            parent[node] = parent[parent[node]];
            node = parent[node];
        }
        node
    }
    for (gpu, remote) in links {
        if *gpu >= bus_ids.len() {
            continue;
        }
        let remote = match node_of_bus.get(remote.as_str()) {
            Some(node) => *node,
            None => {
                // A switch (or a GPU NVML did not list): a node of its own.
                parent.push(parent.len());
                let node = parent.len() - 1;
                node_of_bus.insert(remote.as_str(), node);
                node
            }
        };
        let (a, b) = (root(&mut parent, *gpu), root(&mut parent, remote));
        // The smaller node becomes the root, so a domain's root is its
        // lowest GPU.
        let (low, high) = (a.min(b), a.max(b));
        parent[high] = low;
    }
    let mut domain_of_root = BTreeMap::new();
    (0..bus_ids.len())
        .map(|gpu| {
            let next = domain_of_root.len() as u32;
            *domain_of_root.entry(root(&mut parent, gpu)).or_insert(next)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gib(n: u64) -> MemoryMib {
        MemoryMib(n * 1024)
    }

    #[test]
    fn normalizes_product_names_to_fleet_model_names() {
        let cases = [
            ("NVIDIA H100 80GB HBM3", MemoryMib(81559), "H100-80GB"),
            ("NVIDIA H100 PCIe", MemoryMib(81559), "H100-80GB"),
            ("NVIDIA H100 NVL", MemoryMib(95830), "H100-94GB"),
            ("NVIDIA H200", MemoryMib(143771), "H200"),
            ("NVIDIA H200 NVL", MemoryMib(143771), "H200"),
            ("NVIDIA B200", MemoryMib(183359), "B200"),
            ("NVIDIA A100-SXM4-40GB", gib(40), "A100-40GB"),
            ("NVIDIA A100-SXM4-80GB", gib(80), "A100-80GB"),
            ("NVIDIA A100 80GB PCIe", gib(80), "A100-80GB"),
            ("NVIDIA A100-PCIE-40GB", gib(40), "A100-40GB"),
            ("Tesla V100-SXM2-32GB", MemoryMib(32510), "V100-32GB"),
            ("Tesla V100-PCIE-16GB", MemoryMib(16160), "V100-16GB"),
            ("Tesla T4", MemoryMib(15360), "T4"),
            ("NVIDIA L4", MemoryMib(23034), "L4"),
            ("NVIDIA A10G", MemoryMib(23028), "A10G"),
            ("NVIDIA L40S", MemoryMib(46068), "L40S"),
            ("NVIDIA GeForce RTX 4090", MemoryMib(24564), "RTX-4090"),
            ("NVIDIA RTX A6000", MemoryMib(49140), "RTX-A6000"),
            (
                "NVIDIA RTX 6000 Ada Generation",
                MemoryMib(49140),
                "RTX-6000-ADA",
            ),
            ("NVIDIA GH200 480GB", MemoryMib(97871), "GH200-480GB"),
        ];
        for (name, memory, expected) in cases {
            assert_eq!(
                normalize_gpu_name(name, memory),
                GpuModel::new(expected),
                "{name}"
            );
        }
    }

    #[test]
    fn odd_names_never_panic() {
        assert_eq!(normalize_gpu_name("", gib(80)), GpuModel::new("UNKNOWN"));
        assert_eq!(
            normalize_gpu_name("NVIDIA", gib(80)),
            GpuModel::new("UNKNOWN")
        );
        assert_eq!(
            normalize_gpu_name("  weird (TM) thing  ", MemoryMib::ZERO),
            GpuModel::new("WEIRD-TM-THING")
        );
        assert_eq!(
            normalize_gpu_name("NVIDIA H100", MemoryMib::ZERO),
            GpuModel::new("H100"),
            "no memory known: no size added"
        );
        assert_eq!(normalize_gpu_name("Ж GB 80GB", gib(1)).as_str(), "GB-80GB");
    }

    #[test]
    fn bus_ids_compare_equal_across_domain_widths() {
        assert_eq!(normalize_bus_id("0000:18:00.0"), "00000000:18:00.0");
        assert_eq!(normalize_bus_id("00000000:af:00.0"), "00000000:AF:00.0");
        assert_eq!(normalize_bus_id("garbage"), "GARBAGE");
    }

    fn bus(n: u8) -> Option<String> {
        Some(format!("00000000:{n:02X}:00.0"))
    }

    #[test]
    fn gpus_linked_directly_share_a_domain() {
        let bus_ids = [bus(1), bus(2), bus(3), bus(4)];
        let links = [
            (0, "00000000:02:00.0".to_string()),
            (1, "00000000:01:00.0".to_string()),
            (2, "0000:04:00.0".to_string()),
        ];
        let links: Vec<_> = links
            .into_iter()
            .map(|(gpu, remote)| (gpu, normalize_bus_id(&remote)))
            .collect();
        assert_eq!(nvlink_domains(&bus_ids, &links), [0, 0, 1, 1]);
    }

    #[test]
    fn gpus_behind_the_same_switches_share_a_domain() {
        // HGX: every GPU has links to each of two NVSwitches.
        let bus_ids: Vec<_> = (1..=8).map(bus).collect();
        let mut links = Vec::new();
        for gpu in 0..8 {
            links.push((gpu, "00000000:C0:00.0".to_string()));
            links.push((gpu, "00000000:C1:00.0".to_string()));
        }
        assert_eq!(nvlink_domains(&bus_ids, &links), [0; 8]);
    }

    #[test]
    fn gpus_without_links_are_domains_of_their_own() {
        let bus_ids = [bus(1), None, bus(3)];
        assert_eq!(nvlink_domains(&bus_ids, &[]), [0, 1, 2]);
        // Domains are numbered by their lowest GPU, whatever the link order.
        let links = [(2, "00000000:01:00.0".to_string()), (7, "x".to_string())];
        assert_eq!(nvlink_domains(&bus_ids, &links), [0, 1, 0]);
        assert_eq!(nvlink_domains(&[], &links), Vec::<u32>::new());
    }

    #[test]
    fn missing_library_is_a_clear_error() {
        let error = NvmlBackend::with_library_path("/nonexistent/libnvidia-ml.so.1")
            .expect_err("no library at that path");
        assert!(matches!(error, GpuError::NoDriver { .. }), "{error:?}");
        assert_eq!(
            error.to_string(),
            "no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded); \
             use --simulate-gpus 8xH100-80GB to run without GPUs"
        );
    }

    #[test]
    fn new_fails_cleanly_or_works_on_this_machine() {
        // On machines without a driver (CI, laptops) this is the clear
        // error; on a GPU machine the backend must answer.
        match NvmlBackend::new() {
            Err(error) => assert!(
                error.to_string().contains("--simulate-gpus"),
                "unexpected error: {error}"
            ),
            Ok(backend) => {
                let inventory = backend.inventory().expect("inventory on a GPU machine");
                assert_eq!(inventory.backend, "nvml");
                let telemetry = backend.telemetry().expect("telemetry on a GPU machine");
                assert_eq!(telemetry.len(), inventory.gpus.len());
            }
        }
    }

    #[test]
    fn init_errors_say_what_to_do() {
        let cases = [
            (NvmlError::LibraryNotFound, "no NVIDIA driver found"),
            (NvmlError::DriverNotLoaded, "installed but not loaded"),
            (NvmlError::LibRmVersionMismatch, "installed but not loaded"),
            (
                NvmlError::FailedToLoadSymbol("nvmlInit_v2".to_string()),
                "too old",
            ),
            (NvmlError::NoPermission, "/dev/nvidia*"),
            (NvmlError::Unknown, "nvml could not initialize"),
        ];
        for (error, expected) in cases {
            let message = init_error(error).to_string();
            assert!(message.contains(expected), "{message}");
        }
    }
}
