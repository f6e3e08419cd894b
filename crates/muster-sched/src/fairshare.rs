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

/// Least attained service within a priority class (as Tiresias): a job
/// falls a level each time the GPU time it has had (all attempts) passes a
/// threshold, so short jobs go before long ones without anyone knowing how
/// long a job will run. The server and the replay's `default` policy both
/// build the engine's priority with [`ServiceLevels::priority`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceLevels {
    /// GPU-seconds at which a job falls to the next level, ascending.
    pub thresholds_gpu_s: Vec<u64>,
}

impl Default for ServiceLevels {
    /// 1, 10 and 100 GPU-hours (Tiresias's discretised levels).
    fn default() -> Self {
        ServiceLevels {
            thresholds_gpu_s: vec![3_600, 36_000, 360_000],
        }
    }
}

impl ServiceLevels {
    /// Engine units per class unit: a class's value counts ten times, so
    /// that the levels within a class (at most [`Self::MAX_LEVELS`] x
    /// [`Self::LEVEL_STEP`]) never reach the next built-in class (100
    /// apart).
    pub const CLASS_SCALE: i32 = 10;
    /// Engine units a level costs: with the default aging (one unit a
    /// minute waited) a job waiting 100 minutes climbs back one level.
    pub const LEVEL_STEP: i32 = 100;
    /// Levels that count (thresholds past the ninth are ignored).
    pub const MAX_LEVELS: usize = 9;

    /// No levels: every job of a class is equal (priority = class x
    /// [`Self::CLASS_SCALE`]).
    pub fn none() -> Self {
        ServiceLevels {
            thresholds_gpu_s: Vec::new(),
        }
    }

    /// How many thresholds `attained_gpu_s` has passed.
    pub fn level(&self, attained_gpu_s: f64) -> u32 {
        self.thresholds_gpu_s
            .iter()
            .take(Self::MAX_LEVELS)
            .filter(|&&threshold| attained_gpu_s >= threshold as f64)
            .count() as u32
    }

    /// The engine's priority for a pending job of class value `class` that
    /// has had `attained_gpu_s` GPU-seconds.
    pub fn priority(&self, class: i32, attained_gpu_s: f64) -> i32 {
        class
            .saturating_mul(Self::CLASS_SCALE)
            .saturating_sub(Self::LEVEL_STEP * self.level(attained_gpu_s) as i32)
    }

    /// The engine's priority for a running job: as a pending one's if it
    /// checkpoints, so that a fresh job of its class may preempt it once it
    /// has had its share (it loses at most a checkpoint interval of work);
    /// its class's alone if it does not, so that a job that would lose all
    /// its work is never stopped for a level (only for a higher class).
    pub fn running_priority(&self, class: i32, attained_gpu_s: f64, checkpoints: bool) -> i32 {
        if checkpoints {
            self.priority(class, attained_gpu_s)
        } else {
            self.priority(class, 0.0)
        }
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

    #[test]
    fn jobs_fall_a_level_per_threshold_and_never_below_the_next_class() {
        let levels = ServiceLevels::default();
        assert_eq!(levels.level(0.0), 0);
        assert_eq!(levels.level(3_599.0), 0);
        assert_eq!(levels.level(3_600.0), 1);
        assert_eq!(levels.level(1e9), 3);
        assert_eq!(levels.priority(100, 0.0), 1_000);
        assert_eq!(levels.priority(100, 40_000.0), 800);
        // The longest-served "high" job still goes before a fresh "normal" one.
        assert!(levels.priority(200, 1e9) > levels.priority(100, 0.0));
        assert_eq!(ServiceLevels::none().priority(100, 1e9), 1_000);
        // A running job that does not checkpoint keeps its class's priority.
        assert_eq!(levels.running_priority(100, 40_000.0, true), 800);
        assert_eq!(levels.running_priority(100, 40_000.0, false), 1_000);
        // Odd classes do not overflow.
        assert_eq!(levels.priority(i32::MIN, 1e9), i32::MIN);
        assert_eq!(levels.priority(i32::MAX, 0.0), i32::MAX);
    }
}
