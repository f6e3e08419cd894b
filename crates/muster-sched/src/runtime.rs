//! Runtime estimates learned from a queue's finished jobs.
//!
//! [`RuntimeHistory`] keeps, per duration bucket (25% apart, from one
//! second to about 110 days), how many finished jobs ran at least that long
//! and their total run time: fixed size, however many jobs finish. It
//! answers the expected total run time of a job that has already run a
//! while (the mean of the finished jobs that ran longer). The server fills
//! the runtime estimates of jobs whose spec gives none from it (backfill,
//! reservations and start forecasts read them), and the replay's `default`
//! policy does the same from the jobs finished so far, never from a job's
//! own duration.
//!
//! History fades: when a history holds [`RuntimeHistory::FADE_AT`] jobs,
//! every count and sum is halved, so a queue whose work changes is learned
//! anew within some tens of thousands of jobs.

/// The share of similar finished jobs that a start forecast assumes a
/// running job outlasts no longer than: when jobs end, not how much they
/// use, decides when a waiting job starts, and run times are heavy-tailed,
/// so the mean (what backfill uses) puts every end far too late. On the
/// Philly replay the median wait ratio (actual / forecast) is 0.25 with the
/// mean, 1.52 with the median (0.5), 1.02 with 0.6 and 0.78 with 0.7
/// (docs/scheduling-results.md; measured before the default ordered by
/// attained service): 0.6 is the least biased.
pub const FORECAST_QUANTILE: f64 = 0.6;

/// Duration buckets, 25% apart: bucket `b` holds durations from 1.25^b s.
const BUCKETS: usize = 72;

#[derive(Debug, Clone, PartialEq)]
pub struct RuntimeHistory {
    /// Jobs (weighted) that ran at least bucket `b`'s lower bound.
    count_from: [f64; BUCKETS + 1],
    /// Their total run time in seconds.
    sum_from: [f64; BUCKETS + 1],
}

impl Default for RuntimeHistory {
    fn default() -> Self {
        RuntimeHistory {
            count_from: [0.0; BUCKETS + 1],
            sum_from: [0.0; BUCKETS + 1],
        }
    }
}

impl RuntimeHistory {
    /// Jobs held before the history is halved.
    pub const FADE_AT: f64 = 100_000.0;

    fn bucket(seconds: u64) -> usize {
        let bucket = (seconds.max(1) as f64).ln() / 1.25f64.ln();
        (bucket as usize).min(BUCKETS - 1)
    }

    /// Jobs learned from (weighted: halved as history fades).
    pub fn jobs(&self) -> f64 {
        self.count_from[0]
    }

    /// Learns a finished job that ran `seconds`.
    pub fn add(&mut self, seconds: u64) {
        if self.count_from[0] + 1.0 > Self::FADE_AT {
            for value in self.count_from.iter_mut().chain(self.sum_from.iter_mut()) {
                *value /= 2.0;
            }
        }
        for from in 0..=Self::bucket(seconds) {
            self.count_from[from] += 1.0;
            self.sum_from[from] += seconds as f64;
        }
    }

    /// The expected total run time of a job that has run `elapsed` seconds:
    /// the mean of the finished ones that ran longer (bucket by bucket; at
    /// 0, the mean of all), at least `elapsed` + 60 s; twice `elapsed` if
    /// none ran that long. `None` before any job finished.
    pub fn expected_total(&self, elapsed: u64) -> Option<u64> {
        if self.count_from[0] == 0.0 {
            return None;
        }
        let mut from = Self::bucket(elapsed);
        let own_count = self.count_from[from] - self.count_from[from + 1];
        let own_sum = self.sum_from[from] - self.sum_from[from + 1];
        if own_count > 0.0 && own_sum / own_count <= elapsed as f64 {
            from += 1;
        }
        let count = self.count_from[from];
        let mean = if count <= 0.0 {
            2 * elapsed
        } else {
            (self.sum_from[from] / count) as u64
        };
        Some(mean.max(elapsed + 60))
    }

    /// The total run time that a `fraction` (0.5: half) of the finished
    /// jobs that ran longer than `elapsed` seconds stayed within, to the
    /// bucket (25%), at least `elapsed` + 60 s; twice `elapsed` if none ran
    /// that long. `None` before any job finished. Run times are heavy-tailed
    /// (most jobs short, a few very long), so the median is far below the
    /// mean: when jobs end matters more than how much they use, it is the
    /// better guess.
    pub fn quantile_total(&self, elapsed: u64, fraction: f64) -> Option<u64> {
        if self.count_from[0] == 0.0 {
            return None;
        }
        let from = Self::bucket(elapsed);
        let longer = self.count_from[from];
        if longer <= 0.0 {
            return Some(2 * elapsed);
        }
        // The first bucket by which `fraction` of them had ended.
        let mut end = from;
        while end + 1 < BUCKETS && longer - self.count_from[end + 1] < fraction * longer {
            end += 1;
        }
        // The bucket's own mean (its jobs, those ending in it).
        let own_count = self.count_from[end] - self.count_from[end + 1];
        let own_sum = self.sum_from[end] - self.sum_from[end + 1];
        let guess = if own_count > 0.0 {
            (own_sum / own_count) as u64
        } else {
            1.25f64.powf(end as f64 + 0.5) as u64
        };
        Some(guess.max(elapsed + 60))
    }

    /// The time still to run, in milliseconds, that start forecasts assume
    /// for a job that has run `elapsed_ms`: the [`FORECAST_QUANTILE`] of
    /// the finished jobs that ran longer ([`Self::quantile_total`]).
    pub fn forecast_remaining_ms(&self, elapsed_ms: u64) -> Option<u64> {
        let elapsed = elapsed_ms / 1000;
        self.quantile_total(elapsed, FORECAST_QUANTILE)
            .map(|total| (total - elapsed) * 1000)
    }

    /// The expected time still to run, in milliseconds, of a job that has
    /// run `elapsed_ms`.
    pub fn expected_remaining_ms(&self, elapsed_ms: u64) -> Option<u64> {
        let elapsed = elapsed_ms / 1000;
        self.expected_total(elapsed)
            .map(|total| (total - elapsed) * 1000)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nothing_learned_is_no_estimate() {
        assert_eq!(RuntimeHistory::default().expected_total(0), None);
    }

    #[test]
    fn a_job_expects_the_mean_of_those_that_ran_longer() {
        let mut history = RuntimeHistory::default();
        for seconds in [100, 100, 1_000, 10_000] {
            history.add(seconds);
        }
        // At the start: the mean of all four.
        assert_eq!(history.expected_total(0), Some(2_800));
        // Past 100 s: the two longer ones.
        assert_eq!(history.expected_total(500), Some(5_500));
        // Past all of them: twice what it has run.
        assert_eq!(history.expected_total(20_000), Some(40_000));
        // Never less than a minute ahead.
        assert_eq!(history.expected_total(9_990), Some(10_050));
        assert_eq!(history.expected_remaining_ms(500_000), Some(5_000_000));
    }

    #[test]
    fn forecasts_assume_the_typical_end_not_the_mean_one() {
        let mut history = RuntimeHistory::default();
        // Nine short jobs and one very long: the mean is ten times the
        // typical run.
        for _ in 0..9 {
            history.add(100);
        }
        history.add(100_000);
        assert_eq!(history.expected_total(0), Some(10_090));
        assert_eq!(history.quantile_total(0, 0.6), Some(100));
        assert_eq!(history.forecast_remaining_ms(30_000), Some(70_000));
        // Past the short ones, only the long one is left to go by.
        assert_eq!(history.quantile_total(1_000, 0.6), Some(100_000));
        // Past every job seen: twice its running time so far.
        assert_eq!(history.quantile_total(200_000, 0.6), Some(400_000));
        assert_eq!(RuntimeHistory::default().quantile_total(0, 0.6), None);
    }

    #[test]
    fn history_fades_but_keeps_its_mean() {
        let mut history = RuntimeHistory::default();
        for _ in 0..RuntimeHistory::FADE_AT as u64 {
            history.add(100);
        }
        assert_eq!(history.jobs(), RuntimeHistory::FADE_AT);
        history.add(100);
        assert_eq!(history.jobs(), RuntimeHistory::FADE_AT / 2.0 + 1.0);
        assert_eq!(history.expected_total(0), Some(100));
        // New work outweighs the faded old within as many jobs again.
        for _ in 0..RuntimeHistory::FADE_AT as u64 {
            history.add(10_000);
        }
        assert!(history.expected_total(0).unwrap() > 7_000);
    }
}
