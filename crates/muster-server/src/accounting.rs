//! GPU accounting in the server: the ledger of open minutes (memory),
//! closed minutes written through the writer, prices, cost reports and
//! queue budgets. The rules are the pure `muster_control::accounting`'s.

use crate::core::{Shared, now};
use crate::error::ApiError;
use crate::store::Batch;
use muster_api::protocol::{CostLineView, CostReport};
use muster_control::Input;
use muster_control::accounting::{
    CostBy, Ledger, UsageMinute, UsageTotals, cost_report, merge_totals, month_start_ms, totals,
};
use muster_model::QueueName;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// How often budgets are summed again (and the hold applied).
const BUDGET_EVERY_MS: u64 = 30_000;
/// How often minutes past the retention are deleted.
const PRUNE_EVERY_MS: u64 = 3_600_000;

/// The default retention of accounting minutes: 35 days (a month's report
/// and budget, with days to spare).
pub const DEFAULT_USAGE_RETENTION_MS: u64 = 35 * 86_400_000;

#[derive(Debug, Default)]
pub struct Accounting {
    ledger: Mutex<Ledger>,
    /// Per GPU model, per GPU-hour (the store's, cached).
    prices: Mutex<BTreeMap<String, f64>>,
    /// Per queue: spent this month (UTC) at the current prices.
    spent: Mutex<BTreeMap<String, f64>>,
    /// When budgets were last summed and minutes last pruned (ms).
    last_budget_ms: Mutex<u64>,
    last_prune_ms: Mutex<u64>,
}

fn locked<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match mutex.lock() {
        Ok(guard) => guard,
        Err(poisoned) => poisoned.into_inner(),
    }
}

impl Accounting {
    pub fn with_prices(prices: BTreeMap<String, f64>) -> Accounting {
        Accounting {
            prices: Mutex::new(prices),
            ..Accounting::default()
        }
    }

    pub fn prices(&self) -> BTreeMap<String, f64> {
        locked(&self.prices).clone()
    }

    pub fn set_price(&self, model: String, price: Option<f64>) {
        let mut prices = locked(&self.prices);
        match price {
            Some(price) => prices.insert(model, price),
            None => prices.remove(&model),
        };
    }

    /// Spent this month by `queue`.
    pub fn spent(&self, queue: &str) -> f64 {
        locked(&self.spent).get(queue).copied().unwrap_or(0.0)
    }

    /// Per queue, spent this month.
    pub fn spent_by_queue(&self) -> BTreeMap<String, f64> {
        locked(&self.spent).clone()
    }

    /// Telemetry's samples for allocations: (allocation, utilisation,
    /// memory MiB).
    pub fn observe(
        &self,
        shared: &Shared,
        control: &muster_control::ControlPlane,
        samples: &[(u64, u32, u64)],
    ) {
        let now_ms = now().0;
        let mut closed = Vec::new();
        {
            let mut ledger = locked(&self.ledger);
            for &(allocation, utilization, memory) in samples {
                ledger.observe(
                    control,
                    allocation,
                    utilization,
                    memory,
                    now_ms,
                    &mut closed,
                );
            }
        }
        write_minutes(shared, closed);
    }

    /// The open minutes of `job` (not yet in the store).
    pub fn open_minutes_of(&self, job: u64) -> Vec<UsageMinute> {
        locked(&self.ledger)
            .open_minutes()
            .filter(|minute| minute.job == job)
            .cloned()
            .collect()
    }

    fn open_totals(&self, by: CostBy, since_ms: u64) -> Vec<UsageTotals> {
        let ledger = locked(&self.ledger);
        totals(
            by,
            ledger
                .open_minutes()
                .filter(|minute| minute.minute_ms >= since_ms),
        )
    }

    /// Every open minute, to be written at shutdown (a restart goes on
    /// adding to the same rows).
    pub fn take_open(&self) -> Vec<UsageMinute> {
        std::mem::take(&mut *locked(&self.ledger))
            .open_minutes()
            .filter(|minute| minute.allocated_gpu_ms > 0 || minute.samples > 0)
            .cloned()
            .collect()
    }
}

fn write_minutes(shared: &Shared, closed: Vec<UsageMinute>) {
    if closed.is_empty() {
        return;
    }
    shared.writer.queue_quietly(Batch {
        usage: closed,
        ..Batch::default()
    });
}

/// Every second: charge the running allocations; now and then, sum the
/// budgets and prune old minutes.
pub async fn tick(shared: &Shared) {
    let now_ms = now().0;
    let closed = {
        let core = shared.read();
        locked(&shared.accounting.ledger).accrue(core.control(), now_ms)
    };
    write_minutes(shared, closed);
    let due = |last: &Mutex<u64>, every: u64| {
        let mut last = locked(last);
        let due = now_ms.saturating_sub(*last) >= every;
        if due {
            *last = now_ms;
        }
        due
    };
    if due(&shared.accounting.last_prune_ms, PRUNE_EVERY_MS) {
        shared.writer.queue_quietly(Batch {
            prune_usage_before: Some(now_ms.saturating_sub(shared.settings.usage_retention_ms)),
            prune_audit_before: Some(now_ms.saturating_sub(shared.settings.audit_retention_ms)),
            prune_idempotency_before: Some(now_ms.saturating_sub(crate::idempotency::KEY_TTL_MS)),
            ..Batch::default()
        });
        match shared.idempotency.lock() {
            Ok(mut keys) => keys.prune(now_ms),
            Err(poisoned) => poisoned.into_inner().prune(now_ms),
        }
    }
    if due(&shared.accounting.last_budget_ms, BUDGET_EVERY_MS)
        && let Err(error) = refresh_budgets(shared).await
    {
        tracing::warn!(error = %error.body.message, "cannot sum the queues' budgets");
    }
}

/// Sums each queue's cost this month and holds the queues over a hard
/// budget.
pub async fn refresh_budgets(shared: &Shared) -> Result<(), ApiError> {
    let month = month_start_ms(now().0);
    let report = cost(shared, CostBy::Queue, month).await?;
    let spent: BTreeMap<String, f64> = report
        .lines
        .iter()
        .map(|line| (line.key.clone(), line.cost))
        .collect();
    let held: BTreeSet<QueueName> = {
        let core = shared.read();
        core.control()
            .queues()
            .filter(|queue| {
                queue.budget.is_some_and(|budget| {
                    budget.hard
                        && spent.get(&queue.name.0).copied().unwrap_or(0.0) * 100.0
                            >= budget.monthly_cents as f64
                })
            })
            .map(|queue| queue.name.clone())
            .collect()
    };
    *locked(&shared.accounting.spent) = spent;
    let unchanged = shared.read().control().budget_holds() == &held;
    if !unchanged {
        tracing::info!(queues = ?held, "queues held at their hard budget");
        shared.apply(Input::HoldBudgets { queues: held }, Batch::default())?;
        shared.wake_scheduler.notify_one();
    }
    Ok(())
}

/// Cost since `since_ms`, grouped by `by`: the store's minutes and the
/// open ones, priced.
pub async fn cost(shared: &Shared, by: CostBy, since_ms: u64) -> Result<CostReport, ApiError> {
    let stored = shared.store.usage_totals(by, since_ms).await?;
    let all = merge_totals(
        stored
            .into_iter()
            .chain(shared.accounting.open_totals(by, since_ms)),
    );
    let prices = shared.accounting.prices();
    let unpriced_models: BTreeSet<String> = all
        .iter()
        .filter(|total| total.allocated_gpu_ms > 0 && !prices.contains_key(&total.gpu_model))
        .map(|total| total.gpu_model.clone())
        .collect();
    let lines = cost_report(&all, &prices)
        .into_iter()
        .map(|line| CostLineView {
            key: line.key,
            allocated_gpu_hours: line.allocated_gpu_hours,
            used_gpu_hours: line.used_gpu_hours,
            idle_gpu_hours: line.idle_gpu_hours,
            unmeasured_gpu_hours: line.unmeasured_gpu_hours,
            cost: line.cost,
            waste: line.waste,
            unpriced_gpu_hours: line.unpriced_gpu_hours,
        })
        .collect();
    Ok(CostReport {
        since_ms,
        until_ms: now().0,
        by: by.name().to_string(),
        lines,
        unpriced_models: unpriced_models.into_iter().collect(),
    })
}

/// The warning a job of `queue` carries while the queue is over its
/// monthly budget (`None`: within it, or no budget).
pub fn budget_warning(shared: &Shared, queue: &muster_model::QueueSpec) -> Option<String> {
    let budget = queue.budget?;
    let spent = shared.accounting.spent(&queue.name.0);
    let limit = budget.monthly_cents as f64 / 100.0;
    (spent >= limit).then(|| {
        format!(
            "queue {} has spent {spent:.2} of its monthly budget of {limit:.2}{}",
            queue.name,
            if budget.hard {
                "; its new jobs wait until the month ends or the budget is raised"
            } else {
                ""
            }
        )
    })
}

// ------------------------------------------------------------- endpoints

use crate::error::{Body, Params, PathParams};
use axum::Json;
use axum::extract::State;
use muster_api::protocol::{ErrorBody, JobUsage, PriceList, PriceUpdate, RankUsage, UsagePoint};

type Shared_ = State<std::sync::Arc<Shared>>;

/// The most minutes `GET /v1/jobs/{id}/usage` answers (the latest).
pub const MAX_USAGE_POINTS: u32 = 10_000;

const MS_PER_HOUR: f64 = 3_600_000.0;

/// A job's GPU use at one-minute resolution: per rank, the mean and peak
/// utilisation, peak memory and GPU-hours held, used and idle; and the
/// latest minutes. Every attempt's, as long as the retention keeps them.
#[utoipa::path(
    get, path = "/v1/jobs/{id}/usage", tag = "jobs",
    params(("id" = u64, Path, description = "the job's id", maximum = 9_223_372_036_854_775_807_u64)),
    responses((status = 200, body = JobUsage), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn job_usage(
    State(shared): Shared_,
    axum::Extension(identity): axum::Extension<crate::api::Identity>,
    PathParams(id): PathParams<String>,
) -> Result<Json<JobUsage>, ApiError> {
    let job: u64 = id
        .trim()
        .parse()
        .ok()
        .filter(|id| i64::try_from(*id).is_ok())
        .ok_or_else(|| ApiError::invalid(format!("a job id is a number like 12, got {id:?}")))?;
    // A job it may not read is not found; a retired one whose record is
    // gone still has its minutes (for an admin or operator).
    match crate::api::visible_job(&shared, &identity, muster_model::JobId(job)).await {
        Ok(_) => {}
        Err(error)
            if error.body.code == muster_api::protocol::ErrorCode::NotFound
                && identity
                    .principal()
                    .is_some_and(|p| p.role >= crate::users::Role::Operator) => {}
        Err(error) => return Err(error),
    }
    let mut minutes = shared.store.job_usage(job, MAX_USAGE_POINTS).await?;
    minutes.extend(shared.accounting.open_minutes_of(job));
    Ok(Json(usage_of(job, &minutes)))
}

/// Folds a job's minutes into its usage view (rows of the same rank and
/// minute, from several attempts or a flush after a restart, add up).
pub fn usage_of(job: u64, minutes: &[UsageMinute]) -> JobUsage {
    // Per rank: the minutes summed (samples, utilisation and GPU time
    // added, peaks the highest).
    let mut ranks: BTreeMap<u32, UsageMinute> = BTreeMap::new();
    let mut points: BTreeMap<(u64, u32), (u64, u64, u64)> = BTreeMap::new();
    for minute in minutes {
        let rank = ranks.entry(minute.rank).or_default();
        rank.samples = rank.samples.saturating_add(minute.samples);
        rank.utilization_sum += minute.utilization_sum;
        rank.peak_utilization = rank.peak_utilization.max(minute.peak_utilization);
        rank.peak_memory_mib = rank.peak_memory_mib.max(minute.peak_memory_mib);
        rank.allocated_gpu_ms += minute.allocated_gpu_ms;
        rank.used_gpu_ms += minute.used_gpu_ms;
        rank.idle_gpu_ms += minute.idle_gpu_ms;
        let point = points.entry((minute.minute_ms, minute.rank)).or_default();
        point.0 += u64::from(minute.samples);
        point.1 += minute.utilization_sum;
        point.2 = point.2.max(minute.peak_memory_mib);
    }
    let mean = |samples: u64, sum: u64| (samples > 0).then(|| sum as f64 / samples as f64);
    let skip = points.len().saturating_sub(MAX_USAGE_POINTS as usize);
    JobUsage {
        job,
        ranks: ranks
            .into_iter()
            .map(|(rank, r)| RankUsage {
                rank,
                samples: u64::from(r.samples),
                mean_utilization_pct: mean(u64::from(r.samples), r.utilization_sum),
                peak_utilization_pct: r.peak_utilization,
                peak_memory_mib: r.peak_memory_mib,
                allocated_gpu_hours: r.allocated_gpu_ms as f64 / MS_PER_HOUR,
                used_gpu_hours: r.used_gpu_ms as f64 / MS_PER_HOUR,
                idle_gpu_hours: r.idle_gpu_ms as f64 / MS_PER_HOUR,
            })
            .collect(),
        minutes: points
            .into_iter()
            .skip(skip)
            .map(|((minute_ms, rank), p)| UsagePoint {
                minute_ms,
                rank,
                mean_utilization_pct: mean(p.0, p.1),
                peak_memory_mib: p.2,
            })
            .collect(),
    }
}

#[derive(Debug, serde::Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct CostQuery {
    /// How far back: a duration (`30d`, `12h`) or `month` (since the 1st,
    /// UTC). Default `30d`; at most the server's usage retention is kept.
    #[param(
        pattern = "^(month|([0-9]{1,12}|([0-9]{1,12}d)?([0-9]{1,12}h)?([0-9]{1,12}m)?([0-9]{1,12}s)?))$"
    )]
    pub since: Option<String>,
    /// `queue` (default), `user`, `job` or `pool`.
    #[param(pattern = "^(|queue|user|job|pool)$")]
    pub by: Option<String>,
}

/// Where a report starts: `month` or a duration back from `now_ms`.
pub fn since_of(text: Option<&str>, now_ms: u64) -> Result<u64, ApiError> {
    match text {
        Some("month") => Ok(month_start_ms(now_ms)),
        None => Ok(now_ms.saturating_sub(30 * 86_400_000)),
        Some(text) => match muster_api::parse_api_duration(text) {
            Ok(None) => Ok(now_ms.saturating_sub(30 * 86_400_000)),
            Ok(Some(duration)) => {
                Ok(now_ms.saturating_sub(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)))
            }
            Err(why) => Err(ApiError::invalid(format!(
                "since: {why}, or `month`; got {text:?}"
            ))),
        },
    }
}

/// GPU-hours allocated, used (utilisation-weighted) and idle, and their
/// cost at the current prices, per queue, user, job or pool.
#[utoipa::path(
    get, path = "/v1/cost", tag = "cost",
    params(CostQuery),
    responses((status = 200, body = CostReport), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn cost_endpoint(
    State(shared): Shared_,
    Params(query): Params<CostQuery>,
) -> Result<Json<CostReport>, ApiError> {
    let by = match query.by.as_deref() {
        None | Some("") => CostBy::Queue,
        Some(text) => CostBy::parse(text).ok_or_else(|| {
            ApiError::invalid(format!(
                "by: expected queue, user, job or pool, got {text:?}"
            ))
        })?,
    };
    let since = since_of(query.since.as_deref(), now().0)?;
    Ok(Json(cost(&shared, by, since).await?))
}

/// The price list: per GPU model, per GPU-hour.
#[utoipa::path(
    get, path = "/v1/prices", tag = "cost",
    responses((status = 200, body = PriceList)),
    security(("bearer" = []))
)]
pub async fn list_prices(State(shared): Shared_) -> Json<PriceList> {
    Json(PriceList {
        prices: shared.accounting.prices(),
    })
}

/// Set the price of a GPU-hour of a model (as agents name it, e.g.
/// `H100-80GB`); applies to every report from now on, past usage included.
#[utoipa::path(
    put, path = "/v1/prices/{model}", tag = "cost",
    params(("model" = String, Path, description = "the GPU model", pattern = r"^[A-Za-z0-9][A-Za-z0-9._()-]{0,127}$")),
    request_body = PriceUpdate,
    responses((status = 200, body = PriceList), (status = 400, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn set_price(
    State(shared): Shared_,
    PathParams(model): PathParams<String>,
    Body(update): Body<PriceUpdate>,
) -> Result<Json<PriceList>, ApiError> {
    muster_api::prices::check_price(&model, update.per_gpu_hour).map_err(ApiError::invalid)?;
    change_price(&shared, &model, Some(update.per_gpu_hour)).await
}

/// Remove a model's price.
#[utoipa::path(
    delete, path = "/v1/prices/{model}", tag = "cost",
    params(("model" = String, Path, description = "the GPU model", pattern = r"^[A-Za-z0-9][A-Za-z0-9._()-]{0,127}$")),
    responses((status = 200, body = PriceList), (status = 404, body = ErrorBody)),
    security(("bearer" = []))
)]
pub async fn remove_price(
    State(shared): Shared_,
    PathParams(model): PathParams<String>,
) -> Result<Json<PriceList>, ApiError> {
    muster_api::prices::check_model(&model).map_err(ApiError::invalid)?;
    let key = muster_api::prices::price_key(&model);
    if !shared.accounting.prices().contains_key(&key) {
        return Err(ApiError::not_found(format!(
            "{key} has no price; `muster prices` lists them"
        )));
    }
    change_price(&shared, &model, None).await
}

async fn change_price(
    shared: &Shared,
    model: &str,
    price: Option<f64>,
) -> Result<Json<PriceList>, ApiError> {
    if let Some(reason) = shared.read_only_reason() {
        return Err(shared.refused(&reason));
    }
    let key = muster_api::prices::price_key(model);
    if price.is_some()
        && !shared.accounting.prices().contains_key(&key)
        && shared.accounting.prices().len() >= muster_api::prices::MAX_PRICED_MODELS
    {
        return Err(ApiError::invalid(format!(
            "at most {} models have prices; remove one first",
            muster_api::prices::MAX_PRICED_MODELS
        )));
    }
    shared
        .writer
        .queue(Batch {
            prices: BTreeMap::from([(key.clone(), price)]),
            ..Batch::default()
        })
        .wait()
        .await?;
    shared.accounting.set_price(key, price);
    refresh_budgets(shared).await?;
    Ok(Json(PriceList {
        prices: shared.accounting.prices(),
    }))
}
