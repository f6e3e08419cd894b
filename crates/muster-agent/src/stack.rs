//! The node's software stack beyond the GPU driver and CUDA, for fleet
//! consistency: GPU firmware (VBIOS), kernel, NCCL and the container
//! runtimes installed. Read from files only (no program is run).

use crate::gpu::GpuInventory;
use std::collections::BTreeMap;

/// Where NCCL's library is looked for.
const LIBRARY_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
    "/usr/local/cuda/lib64",
];

/// Container runtimes looked for, by absolute path.
const RUNTIMES: &[(&str, &str)] = &[
    ("containerd", "/usr/bin/containerd"),
    ("docker", "/usr/bin/docker"),
    (
        "nvidia-container-runtime",
        "/usr/bin/nvidia-container-runtime",
    ),
    ("podman", "/usr/bin/podman"),
];

/// The highest NCCL version among library file names
/// (`libnccl.so.2.21.5`).
pub fn nccl_version<'a>(names: impl Iterator<Item = &'a str>) -> Option<String> {
    names
        .filter_map(|name| name.strip_prefix("libnccl.so."))
        .filter_map(|version| {
            let parts: Vec<u32> = version
                .split('.')
                .map(|part| part.parse().ok())
                .collect::<Option<_>>()?;
            (parts.len() == 3).then(|| (parts, version.to_string()))
        })
        .max()
        .map(|(_, version)| version)
}

/// The node's stack (components beyond the driver and CUDA).
pub fn node_stack(inventory: &GpuInventory) -> BTreeMap<String, String> {
    let mut stack = BTreeMap::new();
    if let Ok(kernel) = std::fs::read_to_string("/proc/sys/kernel/osrelease") {
        let kernel = kernel.trim();
        if !kernel.is_empty() && kernel.len() <= 128 {
            stack.insert("kernel".to_string(), kernel.to_string());
        }
    }
    if let Some(vbios) = &inventory.vbios_version {
        stack.insert("vbios".to_string(), vbios.clone());
    }
    let mut names = Vec::new();
    for dir in LIBRARY_DIRS {
        if let Ok(entries) = std::fs::read_dir(dir) {
            names.extend(
                entries
                    .flatten()
                    .filter_map(|entry| entry.file_name().into_string().ok())
                    .filter(|name| name.starts_with("libnccl.so.")),
            );
        }
    }
    if let Some(nccl) = nccl_version(names.iter().map(String::as_str)) {
        stack.insert("nccl".to_string(), nccl);
    }
    let runtimes: Vec<&str> = RUNTIMES
        .iter()
        .filter(|(_, path)| std::path::Path::new(path).exists())
        .map(|(name, _)| *name)
        .collect();
    if !runtimes.is_empty() {
        stack.insert("container_runtime".to_string(), runtimes.join(","));
    }
    stack
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_version_is_the_highest_full_one() {
        let names = [
            "libnccl.so",
            "libnccl.so.2",
            "libnccl.so.2.19.3",
            "libnccl.so.2.21.5",
            "libnccl.so.2.9.9",
            "libnccl.so.x.y.z",
            "libcudart.so.12.4.127",
        ];
        assert_eq!(nccl_version(names.into_iter()), Some("2.21.5".into()));
        assert_eq!(nccl_version(std::iter::empty()), None);
    }

    #[test]
    fn this_node_reports_its_kernel() {
        let inventory = GpuInventory {
            gpus: Vec::new(),
            driver_version: None,
            cuda_version: None,
            nvml_version: None,
            vbios_version: Some("96.00.89.00.01".into()),
            backend: "simulated",
        };
        let stack = node_stack(&inventory);
        assert!(stack.contains_key("kernel"), "{stack:?}");
        assert_eq!(stack["vbios"], "96.00.89.00.01");
    }
}
