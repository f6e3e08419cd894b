//! Each node's telemetry over the last hour, in memory: a point at most
//! every 30 seconds (faster reports are thinned), at most 120 per node
//! (about 20 KiB with 8 GPUs; 40 MiB at 2,000 nodes), forgotten with the
//! node. For node charts (`GET
//! /v1/nodes/{name}/telemetry`, the dashboard, `muster top`).

use muster_api::protocol::{GpuPoint, NodeHistoryPoint, TelemetryReport};
use std::collections::{BTreeMap, VecDeque};

pub const HISTORY_MS: u64 = 3_600_000;
pub const MIN_SPACING_MS: u64 = 30_000;
pub const MAX_POINTS: usize = (HISTORY_MS / MIN_SPACING_MS) as usize;

#[derive(Debug, Default)]
pub struct NodeHistories {
    nodes: BTreeMap<String, VecDeque<NodeHistoryPoint>>,
}

impl NodeHistories {
    /// Keeps `report` of `node` received at `now_ms`, unless the latest
    /// point is under [`MIN_SPACING_MS`] old.
    pub fn record(&mut self, node: &str, report: &TelemetryReport, now_ms: u64) {
        let points = self.nodes.entry(node.to_string()).or_default();
        if points
            .back()
            .is_some_and(|last| now_ms < last.at_ms.saturating_add(MIN_SPACING_MS))
        {
            return;
        }
        while points.len() >= MAX_POINTS
            || points
                .front()
                .is_some_and(|first| first.at_ms.saturating_add(HISTORY_MS) < now_ms)
        {
            points.pop_front();
        }
        points.push_back(NodeHistoryPoint {
            at_ms: now_ms,
            gpus: report
                .gpus
                .iter()
                .map(|gpu| GpuPoint {
                    index: gpu.index,
                    utilization_pct: gpu.utilization_pct.min(100),
                    memory_used_mib: gpu.memory_used_mib,
                })
                .collect(),
            cpu_busy_pct: report.node.cpu_busy_pct,
        });
    }

    /// The node's points within the last hour, oldest first.
    pub fn of(&self, node: &str, now_ms: u64) -> Vec<NodeHistoryPoint> {
        self.nodes
            .get(node)
            .map(|points| {
                points
                    .iter()
                    .filter(|p| p.at_ms.saturating_add(HISTORY_MS) >= now_ms)
                    .cloned()
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Forgets nodes `keep` says no.
    pub fn retain(&mut self, keep: impl Fn(&String) -> bool) {
        self.nodes.retain(|node, _| keep(node));
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use muster_api::protocol::{GpuSample, NodeSample};

    fn report(utilization_pct: u32) -> TelemetryReport {
        TelemetryReport {
            epoch: 1,
            sampled_ms: 0,
            gpus: vec![GpuSample {
                index: 0,
                utilization_pct,
                memory_used_mib: 10,
                memory_total_mib: 100,
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
        }
    }

    #[test]
    fn an_hour_is_kept_thinned_to_a_point_every_thirty_seconds() {
        let mut histories = NodeHistories::default();
        // A report every second for two hours.
        for second in 0..7_200u64 {
            histories.record("a", &report((second % 100) as u32), second * 1_000);
        }
        let points = histories.of("a", 7_199_000);
        assert!(
            points.len() <= MAX_POINTS && points.len() >= MAX_POINTS - 1,
            "{}",
            points.len()
        );
        assert!(
            points
                .windows(2)
                .all(|w| w[1].at_ms - w[0].at_ms >= MIN_SPACING_MS)
        );
        assert!(points[0].at_ms + HISTORY_MS >= 7_199_000);
        // Later, with no reports, the old points drop out of view.
        assert!(histories.of("a", 7_199_000 + HISTORY_MS + 1).is_empty());
        histories.retain(|node| node != "a");
        assert_eq!(histories.len(), 0);
    }
}
