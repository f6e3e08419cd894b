//! GPU backends behind one trait: what GPUs a node has ([`GpuInventory`]) and
//! how they are doing ([`GpuTelemetry`]).
//!
//! Two backends:
//! - [`NvmlBackend`] talks to the NVIDIA driver through NVML. The library
//!   (`libnvidia-ml.so.1`) is loaded at run time, so the agent builds and
//!   starts on machines without GPUs; there, [`NvmlBackend::new`] returns
//!   [`GpuError::NoDriver`].
//! - [`SimulatedBackend`] pretends to have the GPUs of a spec such as
//!   `8xH100-80GB` (the agent's `--simulate-gpus`), for tests and demos.

mod nvml;
mod simulated;

pub use nvml::{NvmlBackend, normalize_gpu_name};
pub use simulated::SimulatedBackend;

use muster_model::{GpuModel, GpuSpec, MemoryMib};

/// One GPU as the agent registers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInfo {
    /// Index on the node, as NVML counts (PCI bus order); the process runtime
    /// sets `CUDA_DEVICE_ORDER=PCI_BUS_ID` so CUDA counts the same way.
    pub index: u32,
    pub uuid: String,
    pub model: GpuModel,
    /// Total memory of the GPU.
    pub memory: MemoryMib,
    /// GPUs with the same domain talk over NVLink. Domains are numbered from
    /// 0 in the order of their lowest GPU index.
    pub nvlink_domain: u32,
}

impl From<GpuInfo> for GpuSpec {
    fn from(gpu: GpuInfo) -> Self {
        GpuSpec {
            index: gpu.index,
            uuid: gpu.uuid,
            model: gpu.model,
            memory: gpu.memory,
            nvlink_domain: gpu.nvlink_domain,
        }
    }
}

/// What a node's GPUs are, plus the software around them (for fleet
/// consistency checks: drift in drivers and CUDA across nodes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuInventory {
    /// Ordered by index.
    pub gpus: Vec<GpuInfo>,
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports, as `12.4`.
    pub cuda_version: Option<String>,
    pub nvml_version: Option<String>,
    /// The GPUs' firmware (VBIOS) version: one, or `mixed: a, b` when they
    /// differ.
    pub vbios_version: Option<String>,
    /// Which backend produced this: `"nvml"` or `"simulated"`.
    pub backend: &'static str,
}

impl GpuInventory {
    /// The GPUs as the domain model describes them.
    pub fn gpu_specs(&self) -> Vec<GpuSpec> {
        self.gpus.iter().cloned().map(GpuSpec::from).collect()
    }
}

/// How one GPU is doing right now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuTelemetry {
    pub index: u32,
    /// Percent of the last sample period during which a kernel ran (0..=100).
    pub utilization_pct: u32,
    pub memory_used: MemoryMib,
    /// `None` where the GPU does not report it.
    pub power_milliwatts: Option<u32>,
    pub temperature_c: Option<u32>,
    /// Uncorrected ECC errors since the driver loaded (volatile count);
    /// `None` where ECC is off or not supported.
    pub ecc_errors: Option<u64>,
    /// The streaming multiprocessors' clock.
    pub sm_clock_mhz: Option<u32>,
    /// The latest XID the driver reported for this GPU since the agent
    /// started (`None`: none). One that [`muster_model::fatal_xid`] names
    /// makes the GPU unhealthy until the agent restarts (after a reset).
    pub xid: Option<u64>,
    /// PCIe bytes sent and received since the driver loaded (`None` where
    /// the device does not count them).
    pub pcie_tx_bytes: Option<u64>,
    pub pcie_rx_bytes: Option<u64>,
    /// `false` when the GPU should not get new work: memory pages pending
    /// retirement, uncorrected ECC errors, a fatal XID, or the GPU fell off
    /// the bus.
    pub healthy: bool,
}

/// Why a GPU backend could not answer.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    /// The NVML library is not installed: a machine without an NVIDIA driver.
    #[error(
        "no NVIDIA driver found (libnvidia-ml.so.1 could not be loaded); use --simulate-gpus 8xH100-80GB to run without GPUs"
    )]
    NoDriver {
        /// What the loader said, for logs.
        detail: String,
    },
    /// The library is there but the kernel driver is not running.
    #[error(
        "the NVIDIA driver is installed but not loaded ({detail}); check `nvidia-smi` and the kernel module, or use --simulate-gpus 8xH100-80GB to run without GPUs"
    )]
    DriverNotLoaded { detail: String },
    /// The library lacks a function muster needs.
    #[error(
        "the NVIDIA driver is too old for muster ({detail}); upgrade the driver, or use --simulate-gpus 8xH100-80GB to run without GPUs"
    )]
    DriverTooOld { detail: String },
    #[error(
        "no permission to talk to the NVIDIA driver; run the agent as a user that can open /dev/nvidia*"
    )]
    NoPermission,
    /// Any other NVML failure.
    #[error("nvml could not {action}: {source}")]
    Nvml {
        /// What was being asked, in words: `read the name of GPU 3`.
        action: String,
        #[source]
        source: nvml_wrapper::error::NvmlError,
    },
    /// A `--simulate-gpus` spec that does not parse.
    #[error(
        "invalid --simulate-gpus `{spec}`: {reason}; write it as COUNTxMODEL items separated by commas, like `8xH100-80GB` or `2xA100-40GB,4xL4`"
    )]
    InvalidSimulatedSpec { spec: String, reason: String },
    #[error("no GPU with index {index} on this node (it has {count})")]
    NoSuchGpu { index: u32, count: usize },
}

/// A source of GPU inventory and telemetry.
pub trait GpuBackend: Send + Sync {
    /// The node's GPUs and driver software. Called at registration and when
    /// the agent refreshes its inventory.
    fn inventory(&self) -> Result<GpuInventory, GpuError>;
    /// One sample per GPU, ordered by index. Cheap enough to call every
    /// heartbeat.
    fn telemetry(&self) -> Result<Vec<GpuTelemetry>, GpuError>;
    /// A task started on GPUs `gpus` with environment `env`: the simulated
    /// backend keeps them as busy as its `MUSTER_SIM_UTIL` says (a share,
    /// 0 to 1); real GPUs report what they do.
    fn task_started(
        &self,
        _task: &str,
        _gpus: &[u32],
        _env: &std::collections::BTreeMap<String, String>,
    ) {
    }
    /// The task named `task` ended.
    fn task_ended(&self, _task: &str) {}
}
