//! Decayed GPU-time usage per queue, the basis of fair-share ordering.

use muster_model::{QueueName, Time};
use std::collections::BTreeMap;

/// GPU-seconds each queue used, decayed with a half-life so that old usage
/// counts less than recent usage (as Slurm's fair-share factor does).
#[derive(Debug, Clone, PartialEq)]
pub struct UsageLedger {
    pub half_life_ms: u64,
    pub updated: Time,
    pub gpu_seconds: BTreeMap<QueueName, f64>,
}

impl UsageLedger {
    pub fn new(half_life_ms: u64, now: Time) -> Self {
        UsageLedger {
            half_life_ms: half_life_ms.max(1),
            updated: now,
            gpu_seconds: BTreeMap::new(),
        }
    }

    /// Decays all usage to `now` and adds what each queue used since the last
    /// update: `allocated` is each queue's GPU capacity in thousandths, held
    /// throughout the interval.
    pub fn advance(&mut self, now: Time, allocated: &BTreeMap<QueueName, u64>) {
        let elapsed = now.millis_since(self.updated);
        if elapsed == 0 {
            return;
        }
        let factor = 0.5f64.powf(elapsed as f64 / self.half_life_ms as f64);
        for value in self.gpu_seconds.values_mut() {
            *value *= factor;
        }
        // Usage during the interval, decayed from its midpoint.
        let mid_factor = 0.5f64.powf(elapsed as f64 / 2.0 / self.half_life_ms as f64);
        for (queue, &milli) in allocated {
            let used = milli as f64 / 1000.0 * elapsed as f64 / 1000.0 * mid_factor;
            *self.gpu_seconds.entry(queue.clone()).or_default() += used;
        }
        self.updated = now;
    }

    pub fn usage(&self, queue: &QueueName) -> f64 {
        self.gpu_seconds.get(queue).copied().unwrap_or(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_halves_after_one_half_life() {
        let queue = QueueName::from("a");
        let mut ledger = UsageLedger::new(1000, Time(0));
        ledger.gpu_seconds.insert(queue.clone(), 100.0);
        ledger.advance(Time(1000), &BTreeMap::new());
        assert!((ledger.usage(&queue) - 50.0).abs() < 1e-9);
    }

    #[test]
    fn allocation_accrues_gpu_seconds() {
        let queue = QueueName::from("a");
        let mut ledger = UsageLedger::new(u64::MAX / 4, Time(0));
        let allocated = BTreeMap::from([(queue.clone(), 2000)]);
        ledger.advance(Time(10_000), &allocated);
        assert!((ledger.usage(&queue) - 20.0).abs() < 1e-6);
    }
}
