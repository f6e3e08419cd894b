//! GPU accounting: what each task held and used, minute by minute, and what
//! it cost. Pure: the shell passes the time, keeps the [`Ledger`] (the
//! minutes still open, memory only), writes the closed minutes to its store
//! and sums them back for a report ([`cost_report`]).
//!
//! Every second (or so) the shell calls [`Ledger::accrue`]: each running
//! allocation is charged the time since its last accrual, in GPU-milliseconds
//! (its GPUs times the time; a fraction of a GPU counts its share), split at
//! wall-clock minute boundaries; of that, the part telemetry saw used
//! (weighted by utilisation) and the part it saw idle (below
//! [`crate::usage::IDLE_UTILIZATION_PCT`], or the job's queue's
//! `idle_below_pct`). A minute closes when the clock
//! passes its end or the allocation stops running; closed minutes are
//! returned to be written.

use crate::{AllocationState, ControlPlane};
use std::collections::BTreeMap;

pub const MINUTE_MS: u64 = 60_000;

/// Time between two accruals longer than this is not charged (the server
/// was stopped or stalled): the allocation's account restarts.
pub const MAX_ACCRUAL_GAP_MS: u64 = 5 * MINUTE_MS;

/// One task's use of its GPUs in one wall-clock minute. The names of its
/// job's queue and user, its node's pool and GPU model travel with it, so a
/// report needs nothing else (and outlives the job's retention).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageMinute {
    /// Start of the minute (ms since the epoch, a multiple of [`MINUTE_MS`]).
    pub minute_ms: u64,
    pub allocation: u64,
    pub job: u64,
    pub rank: u32,
    pub node: String,
    pub pool: String,
    pub gpu_model: String,
    pub queue: String,
    pub user: String,
    /// GPU-milliseconds held.
    pub allocated_gpu_ms: u64,
    /// Of those, the ones telemetry covered.
    pub measured_gpu_ms: u64,
    /// Utilisation-weighted: a GPU at 50% for a minute used 30,000.
    pub used_gpu_ms: u64,
    /// Held while telemetry saw the task's GPUs idle.
    pub idle_gpu_ms: u64,
    /// Telemetry samples in the minute, their utilisation summed (the mean
    /// over the task's GPUs, percent), the highest, and the highest memory
    /// (MiB, summed over the task's GPUs).
    pub samples: u32,
    pub utilization_sum: u64,
    pub peak_utilization: u32,
    pub peak_memory_mib: u64,
}

impl UsageMinute {
    pub fn mean_utilization(&self) -> Option<f64> {
        (self.samples > 0).then(|| self.utilization_sum as f64 / f64::from(self.samples))
    }
}

#[derive(Debug, Clone)]
struct Account {
    /// Charged up to here.
    last_ms: u64,
    /// GPU thousandths held.
    gpu_milli: u64,
    /// The latest utilisation telemetry gave (percent), if any yet.
    utilization: Option<u32>,
    /// Below this utilisation the time counts idle (the job's queue's).
    idle_below_pct: u32,
    minute: UsageMinute,
}

/// The minutes still open, one per running allocation.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    open: BTreeMap<u64, Account>,
}

impl Ledger {
    pub fn open_accounts(&self) -> usize {
        self.open.len()
    }

    /// The open minutes as they stand (for a report that includes the
    /// current minute).
    pub fn open_minutes(&self) -> impl Iterator<Item = &UsageMinute> {
        self.open.values().map(|account| &account.minute)
    }

    /// Charges every running allocation up to `now_ms`; returns the minutes
    /// that closed (passed, or of allocations no longer running).
    pub fn accrue(&mut self, control: &ControlPlane, now_ms: u64) -> Vec<UsageMinute> {
        let mut closed = Vec::new();
        let mut running = std::collections::BTreeSet::new();
        for job in control.jobs() {
            if job.state != crate::JobState::Running && job.state != crate::JobState::Stopping {
                continue;
            }
            for allocation in control.current_allocations(job) {
                if allocation.state != AllocationState::Running {
                    continue;
                }
                running.insert(allocation.id.0);
                let account = self
                    .open
                    .entry(allocation.id.0)
                    .or_insert_with(|| open_account(control, job, allocation, now_ms));
                charge(account, now_ms, &mut closed);
            }
        }
        let stopped: Vec<u64> = self
            .open
            .keys()
            .filter(|id| !running.contains(id))
            .copied()
            .collect();
        for id in stopped {
            if let Some(account) = self.open.remove(&id)
                && account.minute.allocated_gpu_ms > 0
            {
                closed.push(account.minute);
            }
        }
        closed
    }

    /// Telemetry for allocation `allocation`: the mean utilisation of its
    /// GPUs and their memory. Charges up to `now_ms` at the previous reading
    /// first (closed minutes go to `closed`).
    /// An allocation not running (or not known) is left out; one running
    /// that the ledger has not charged yet is opened here.
    pub fn observe(
        &mut self,
        control: &ControlPlane,
        allocation: u64,
        utilization_pct: u32,
        memory_mib: u64,
        now_ms: u64,
        closed: &mut Vec<UsageMinute>,
    ) {
        let account = match self.open.entry(allocation) {
            std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
            std::collections::btree_map::Entry::Vacant(entry) => {
                let Some(found) = control.allocation(crate::AllocationId(allocation)) else {
                    return;
                };
                let Some(job) = control.job(found.job) else {
                    return;
                };
                if found.state != AllocationState::Running {
                    return;
                }
                entry.insert(open_account(control, job, found, now_ms))
            }
        };
        charge(account, now_ms, closed);
        let utilization = utilization_pct.min(100);
        account.utilization = Some(utilization);
        let minute = &mut account.minute;
        minute.samples += 1;
        minute.utilization_sum += u64::from(utilization);
        minute.peak_utilization = minute.peak_utilization.max(utilization);
        minute.peak_memory_mib = minute.peak_memory_mib.max(memory_mib);
    }
}

/// A new account for a running allocation, charged from `now_ms`.
fn open_account(
    control: &ControlPlane,
    job: &crate::Job,
    allocation: &crate::Allocation,
    now_ms: u64,
) -> Account {
    let node = control.node(&allocation.node);
    let gpu_model = node
        .and_then(|node| {
            let index = allocation.gpus.first()?.0;
            node.spec.gpus.iter().find(|gpu| gpu.index == index)
        })
        .map(|gpu| gpu.model.as_str().to_string())
        .unwrap_or_default();
    Account {
        last_ms: now_ms,
        gpu_milli: allocation
            .gpus
            .iter()
            .map(|(_, milli)| u64::from(*milli))
            .sum(),
        utilization: None,
        idle_below_pct: control.idle_below_pct_of(job),
        minute: UsageMinute {
            minute_ms: now_ms - now_ms % MINUTE_MS,
            allocation: allocation.id.0,
            job: job.id.0,
            rank: allocation.rank,
            node: allocation.node.0.clone(),
            pool: node.map(|n| n.spec.pool.0.clone()).unwrap_or_default(),
            gpu_model,
            queue: job.spec.queue.0.clone(),
            user: job.user.clone(),
            ..UsageMinute::default()
        },
    }
}

/// Charges `account` from its last accrual to `now_ms`, closing each minute
/// it passes the end of.
fn charge(account: &mut Account, now_ms: u64, closed: &mut Vec<UsageMinute>) {
    if now_ms <= account.last_ms {
        return;
    }
    if now_ms - account.last_ms > MAX_ACCRUAL_GAP_MS {
        // Nobody watched meanwhile: charge nothing for the gap.
        if account.minute.allocated_gpu_ms > 0 || account.minute.samples > 0 {
            closed.push(account.minute.clone());
        }
        account.minute = fresh_minute(&account.minute, now_ms - now_ms % MINUTE_MS);
        account.last_ms = now_ms;
        return;
    }
    while account.last_ms < now_ms {
        let end_of_minute = account.minute.minute_ms + MINUTE_MS;
        let until = now_ms.min(end_of_minute);
        let held = account.gpu_milli * (until - account.last_ms) / 1000;
        let minute = &mut account.minute;
        minute.allocated_gpu_ms += held;
        if let Some(utilization) = account.utilization {
            minute.measured_gpu_ms += held;
            minute.used_gpu_ms += held * u64::from(utilization) / 100;
            if utilization < account.idle_below_pct {
                minute.idle_gpu_ms += held;
            }
        }
        account.last_ms = until;
        if until == end_of_minute {
            closed.push(account.minute.clone());
            account.minute = fresh_minute(&account.minute, end_of_minute);
        }
    }
}

fn fresh_minute(previous: &UsageMinute, minute_ms: u64) -> UsageMinute {
    UsageMinute {
        minute_ms,
        allocation: previous.allocation,
        job: previous.job,
        rank: previous.rank,
        node: previous.node.clone(),
        pool: previous.pool.clone(),
        gpu_model: previous.gpu_model.clone(),
        queue: previous.queue.clone(),
        user: previous.user.clone(),
        ..UsageMinute::default()
    }
}

/// How a cost report groups usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CostBy {
    Queue,
    User,
    Job,
    Pool,
}

impl CostBy {
    pub fn parse(text: &str) -> Option<CostBy> {
        Some(match text {
            "queue" => CostBy::Queue,
            "user" => CostBy::User,
            "job" => CostBy::Job,
            "pool" => CostBy::Pool,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            CostBy::Queue => "queue",
            CostBy::User => "user",
            CostBy::Job => "job",
            CostBy::Pool => "pool",
        }
    }

    /// The key of a minute under this grouping.
    pub fn key_of(self, minute: &UsageMinute) -> String {
        match self {
            CostBy::Queue => minute.queue.clone(),
            CostBy::User => minute.user.clone(),
            CostBy::Job => minute.job.to_string(),
            CostBy::Pool => minute.pool.clone(),
        }
    }
}

/// GPU-milliseconds summed for one group and GPU model (what a store's
/// `GROUP BY` gives).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageTotals {
    pub key: String,
    pub gpu_model: String,
    pub allocated_gpu_ms: u64,
    pub measured_gpu_ms: u64,
    pub used_gpu_ms: u64,
    pub idle_gpu_ms: u64,
}

impl UsageTotals {
    pub fn add(&mut self, minute: &UsageMinute) {
        self.allocated_gpu_ms += minute.allocated_gpu_ms;
        self.measured_gpu_ms += minute.measured_gpu_ms;
        self.used_gpu_ms += minute.used_gpu_ms;
        self.idle_gpu_ms += minute.idle_gpu_ms;
    }
}

/// Sums minutes per group and GPU model.
pub fn totals<'a>(
    by: CostBy,
    minutes: impl IntoIterator<Item = &'a UsageMinute>,
) -> Vec<UsageTotals> {
    let mut sums: BTreeMap<(String, String), UsageTotals> = BTreeMap::new();
    for minute in minutes {
        let key = (by.key_of(minute), minute.gpu_model.clone());
        sums.entry(key.clone())
            .or_insert_with(|| UsageTotals {
                key: key.0,
                gpu_model: key.1,
                ..UsageTotals::default()
            })
            .add(minute);
    }
    sums.into_values().collect()
}

/// Folds totals with the same key and model together (a store's sums and
/// the open minutes').
pub fn merge_totals(parts: impl IntoIterator<Item = UsageTotals>) -> Vec<UsageTotals> {
    let mut sums: BTreeMap<(String, String), UsageTotals> = BTreeMap::new();
    for part in parts {
        match sums.entry((part.key.clone(), part.gpu_model.clone())) {
            std::collections::btree_map::Entry::Occupied(mut entry) => {
                let sum = entry.get_mut();
                sum.allocated_gpu_ms += part.allocated_gpu_ms;
                sum.measured_gpu_ms += part.measured_gpu_ms;
                sum.used_gpu_ms += part.used_gpu_ms;
                sum.idle_gpu_ms += part.idle_gpu_ms;
            }
            std::collections::btree_map::Entry::Vacant(entry) => {
                entry.insert(part);
            }
        }
    }
    sums.into_values().collect()
}

/// One group's line of a cost report: GPU-hours and their price.
#[derive(Debug, Clone, PartialEq)]
pub struct CostLine {
    pub key: String,
    pub allocated_gpu_hours: f64,
    /// Utilisation-weighted.
    pub used_gpu_hours: f64,
    /// Held while idle.
    pub idle_gpu_hours: f64,
    /// Held without telemetry (neither used nor idle is known).
    pub unmeasured_gpu_hours: f64,
    /// Allocated GPU-hours times the price of their model.
    pub cost: f64,
    /// The price of the idle hours.
    pub waste: f64,
    /// GPU-hours of models without a price (not in `cost`).
    pub unpriced_gpu_hours: f64,
}

const MS_PER_HOUR: f64 = 3_600_000.0;

/// Prices the totals (per GPU model, per GPU-hour) and sums them per group,
/// the costliest first (then by key).
pub fn cost_report(totals: &[UsageTotals], prices: &BTreeMap<String, f64>) -> Vec<CostLine> {
    let mut lines: BTreeMap<&str, CostLine> = BTreeMap::new();
    for total in totals {
        let line = lines.entry(total.key.as_str()).or_insert_with(|| CostLine {
            key: total.key.clone(),
            allocated_gpu_hours: 0.0,
            used_gpu_hours: 0.0,
            idle_gpu_hours: 0.0,
            unmeasured_gpu_hours: 0.0,
            cost: 0.0,
            waste: 0.0,
            unpriced_gpu_hours: 0.0,
        });
        let hours = |ms: u64| ms as f64 / MS_PER_HOUR;
        line.allocated_gpu_hours += hours(total.allocated_gpu_ms);
        line.used_gpu_hours += hours(total.used_gpu_ms);
        line.idle_gpu_hours += hours(total.idle_gpu_ms);
        line.unmeasured_gpu_hours +=
            hours(total.allocated_gpu_ms.saturating_sub(total.measured_gpu_ms));
        match prices.get(&total.gpu_model) {
            Some(price) => {
                line.cost += hours(total.allocated_gpu_ms) * price;
                line.waste += hours(total.idle_gpu_ms) * price;
            }
            None => line.unpriced_gpu_hours += hours(total.allocated_gpu_ms),
        }
    }
    let mut lines: Vec<CostLine> = lines.into_values().collect();
    lines.sort_by(|a, b| b.cost.total_cmp(&a.cost).then_with(|| a.key.cmp(&b.key)));
    lines
}

/// The start (ms since the epoch, UTC) of the calendar month holding `ms`:
/// budgets are monthly.
pub fn month_start_ms(ms: u64) -> u64 {
    let days = ms / 86_400_000;
    let (year, month, _) = civil_from_days(days as i64);
    days_from_civil(year, month, 1) as u64 * 86_400_000
}

// Howard Hinnant's algorithms: days since 1970-01-01 to and from a
// proleptic Gregorian date.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let m = i64::from(m);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_month_starts_on_its_first_day_at_midnight_utc() {
        // 2026-12-04T03:19:19Z
        assert_eq!(month_start_ms(1_796_361_559_000), 1_796_083_200_000);
        // 2024-02-29T12:00:00Z → 2024-02-01
        assert_eq!(month_start_ms(1_709_208_000_000), 1_706_745_600_000);
        assert_eq!(month_start_ms(0), 0);
    }

    #[test]
    fn prices_apply_per_model_and_unpriced_hours_are_counted_apart() {
        let hour = 3_600_000;
        let totals = [
            UsageTotals {
                key: "team-a".into(),
                gpu_model: "H100-80GB".into(),
                allocated_gpu_ms: 10 * hour,
                measured_gpu_ms: 10 * hour,
                used_gpu_ms: 6 * hour,
                idle_gpu_ms: 2 * hour,
            },
            UsageTotals {
                key: "team-a".into(),
                gpu_model: "L4".into(),
                allocated_gpu_ms: 4 * hour,
                measured_gpu_ms: 0,
                used_gpu_ms: 0,
                idle_gpu_ms: 0,
            },
            UsageTotals {
                key: "team-b".into(),
                gpu_model: "H100-80GB".into(),
                allocated_gpu_ms: 20 * hour,
                measured_gpu_ms: 20 * hour,
                used_gpu_ms: 19 * hour,
                idle_gpu_ms: 0,
            },
        ];
        let prices = BTreeMap::from([("H100-80GB".to_string(), 2.5)]);
        let report = cost_report(&totals, &prices);
        assert_eq!(report[0].key, "team-b");
        assert_eq!(report[0].cost, 50.0);
        let a = &report[1];
        assert_eq!(a.allocated_gpu_hours, 14.0);
        assert_eq!(a.used_gpu_hours, 6.0);
        assert_eq!(a.idle_gpu_hours, 2.0);
        assert_eq!(a.unmeasured_gpu_hours, 4.0);
        assert_eq!(a.cost, 25.0);
        assert_eq!(a.waste, 5.0);
        assert_eq!(a.unpriced_gpu_hours, 4.0);
    }
}
