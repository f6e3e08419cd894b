//! The node's own counters, read from the kernel (`/proc/stat`,
//! `/proc/meminfo`, `/proc/net/dev`) for telemetry. The parsers are pure and
//! bounded: an odd or hostile file gives fewer numbers, never a panic.

use muster_api::protocol::{InterfaceSample, NodeSample};

/// The most interfaces one report carries.
pub const MAX_INTERFACES: usize = 64;
/// The longest interface name kept (Linux allows 15 bytes).
const MAX_INTERFACE_NAME: usize = 64;

/// (busy, total) CPU time in ticks, from `/proc/stat`'s `cpu` line.
pub fn cpu_times(stat: &str) -> Option<(u64, u64)> {
    let line = stat.lines().find(|line| line.starts_with("cpu "))?;
    let values: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(10)
        .map(|field| field.parse::<u64>().ok())
        .collect::<Option<_>>()?;
    if values.len() < 4 {
        return None;
    }
    // user nice system idle iowait irq softirq steal (guest is in user).
    let total: u64 = values
        .iter()
        .take(8)
        .fold(0u64, |a, b| a.saturating_add(*b));
    let idle = values[3].saturating_add(values.get(4).copied().unwrap_or(0));
    Some((total.saturating_sub(idle), total))
}

/// Percent busy between two `cpu_times` readings.
pub fn busy_pct(before: (u64, u64), after: (u64, u64)) -> Option<f64> {
    let total = after.1.checked_sub(before.1)?;
    let busy = after.0.checked_sub(before.0)?;
    (total > 0).then(|| (busy as f64 * 100.0 / total as f64).clamp(0.0, 100.0))
}

/// (used, total) memory in MiB from `/proc/meminfo` (used: total less
/// available).
pub fn memory_mib(meminfo: &str) -> Option<(u64, u64)> {
    let field = |name: &str| {
        meminfo.lines().find_map(|line| {
            let rest = line.strip_prefix(name)?.strip_prefix(':')?;
            rest.split_whitespace().next()?.parse::<u64>().ok()
        })
    };
    let total = field("MemTotal")?;
    let available = field("MemAvailable")?;
    Some((total.saturating_sub(available) / 1024, total / 1024))
}

/// Bytes received and sent per interface from `/proc/net/dev`, loopback
/// left out, at most [`MAX_INTERFACES`].
pub fn network(dev: &str) -> Vec<InterfaceSample> {
    dev.lines()
        .filter_map(|line| {
            let (name, counters) = line.split_once(':')?;
            let name = name.trim();
            if name.is_empty() || name == "lo" || name.len() > MAX_INTERFACE_NAME {
                return None;
            }
            let fields: Vec<&str> = counters.split_whitespace().collect();
            Some(InterfaceSample {
                interface: name.to_string(),
                receive_bytes: fields.first()?.parse().ok()?,
                transmit_bytes: fields.get(8)?.parse().ok()?,
            })
        })
        .take(MAX_INTERFACES)
        .collect()
}

/// Samples the node, keeping the last CPU reading for the next busy share.
#[derive(Debug, Default)]
pub struct NodeSampler {
    last_cpu: Option<(u64, u64)>,
}

impl NodeSampler {
    pub fn sample(&mut self) -> NodeSample {
        let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
        let cpu = cpu_times(&read("/proc/stat"));
        let cpu_busy_pct = match (self.last_cpu, cpu) {
            (Some(before), Some(after)) => busy_pct(before, after),
            _ => None,
        };
        if cpu.is_some() {
            self.last_cpu = cpu;
        }
        let memory = memory_mib(&read("/proc/meminfo"));
        NodeSample {
            cpu_busy_pct,
            memory_used_mib: memory.map(|(used, _)| used),
            memory_total_mib: memory.map(|(_, total)| total),
            network: network(&read("/proc/net/dev")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_busy_share_comes_from_two_readings() {
        let before = cpu_times("cpu  100 0 100 800 0 0 0 0 0 0\ncpu0 1 2 3 4\n").expect("read");
        assert_eq!(before, (200, 1000));
        let after = cpu_times("cpu  150 0 150 900 0 0 0 0 0 0\n").expect("read");
        assert_eq!(busy_pct(before, after), Some(50.0));
        // A counter that went backwards (a reset) gives nothing.
        assert_eq!(busy_pct(after, before), None);
        assert_eq!(cpu_times("cpu  x y z\n"), None);
        assert_eq!(cpu_times(""), None);
        assert_eq!(cpu_times("cpu  1 2\n"), None);
        let huge = format!("cpu  {} {} 0 0\n", u64::MAX, u64::MAX);
        assert!(cpu_times(&huge).is_some());
    }

    #[test]
    fn memory_is_total_less_available() {
        let meminfo =
            "MemTotal:       16384000 kB\nMemFree:  1000 kB\nMemAvailable:    8192000 kB\n";
        assert_eq!(memory_mib(meminfo), Some((8000, 16000)));
        assert_eq!(memory_mib("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn network_counters_per_interface_without_loopback() {
        let dev = "Inter-|   Receive                                                |  Transmit\n \
                   face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
                   lo: 1000 10 0 0 0 0 0 0 1000 10 0 0 0 0 0 0\n  \
                   eth0: 123456 100 0 0 0 0 0 0 654321 90 0 0 0 0 0 0\n  \
                   ib0: 5 1 0 0 0 0 0 0\n";
        assert_eq!(
            network(dev),
            vec![InterfaceSample {
                interface: "eth0".to_string(),
                receive_bytes: 123_456,
                transmit_bytes: 654_321,
            }]
        );
        let many: String = (0..100)
            .map(|i| format!("eth{i}: 1 0 0 0 0 0 0 0 2 0 0 0 0 0 0 0\n"))
            .collect();
        assert_eq!(network(&many).len(), MAX_INTERFACES);
    }

    #[test]
    fn this_machine_samples() {
        let mut sampler = NodeSampler::default();
        let first = sampler.sample();
        assert!(first.memory_total_mib.is_some_and(|total| total > 0));
        let second = sampler.sample();
        assert!(
            second
                .cpu_busy_pct
                .is_none_or(|pct| (0.0..=100.0).contains(&pct))
        );
    }
}
