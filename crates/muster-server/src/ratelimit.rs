//! A per-token rate limit: each token gets a bucket of `burst` requests,
//! refilled at `per_second`; a request finding it empty is answered 429
//! with `Retry-After`. Agents' own endpoints are left out (a node's
//! heartbeats, logs and telemetry are paced by the agent), so a busy user
//! cannot starve them. Buckets idle long enough to be full again are
//! dropped, so memory follows the tokens in use.

use std::collections::HashMap;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RateLimit {
    pub per_second: f64,
    pub burst: f64,
}

impl RateLimit {
    /// `100/s`, `20/s:200` (rate and burst); `off` for none.
    pub fn parse(text: &str) -> Result<Option<RateLimit>, String> {
        let text = text.trim();
        if text == "off" {
            return Ok(None);
        }
        let usage = || format!("expected N/s or N/s:BURST (like 100/s:500) or off, got {text:?}");
        let (rate, burst) = match text.split_once(':') {
            Some((rate, burst)) => (rate, Some(burst)),
            None => (text, None),
        };
        let per_second: f64 = rate
            .strip_suffix("/s")
            .and_then(|n| n.trim().parse().ok())
            .filter(|n: &f64| n.is_finite() && *n > 0.0)
            .ok_or_else(usage)?;
        let burst = match burst {
            None => (per_second * 5.0).max(1.0),
            Some(burst) => burst
                .trim()
                .parse::<f64>()
                .ok()
                .filter(|n| n.is_finite() && *n >= 1.0)
                .ok_or_else(usage)?,
        };
        Ok(Some(RateLimit { per_second, burst }))
    }
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

#[derive(Debug, Default)]
pub struct Limiter {
    buckets: HashMap<String, Bucket>,
    last_sweep: Option<Instant>,
}

impl Limiter {
    /// Takes one request of `key` at `now`: `Ok` or how long to wait.
    pub fn take(&mut self, limit: RateLimit, key: &str, now: Instant) -> Result<(), Duration> {
        let full_after = Duration::from_secs_f64(limit.burst / limit.per_second);
        if self
            .last_sweep
            .is_none_or(|last| now.duration_since(last) > full_after.max(Duration::from_secs(60)))
        {
            self.buckets
                .retain(|_, bucket| now.duration_since(bucket.at) < full_after);
            self.last_sweep = Some(now);
        }
        let bucket = self.buckets.entry(key.to_string()).or_insert(Bucket {
            tokens: limit.burst,
            at: now,
        });
        let elapsed = now.duration_since(bucket.at).as_secs_f64();
        bucket.tokens = (bucket.tokens + elapsed * limit.per_second).min(limit.burst);
        bucket.at = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(
                (1.0 - bucket.tokens) / limit.per_second,
            ))
        }
    }

    pub fn len(&self) -> usize {
        self.buckets.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buckets.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_passes_then_the_rate_holds_and_idle_buckets_go() {
        let limit = RateLimit::parse("10/s:3").expect("valid").expect("on");
        let mut limiter = Limiter::default();
        let start = Instant::now();
        for _ in 0..3 {
            assert!(limiter.take(limit, "a", start).is_ok());
        }
        let wait = limiter
            .take(limit, "a", start)
            .expect_err("the bucket is empty");
        assert!(
            wait <= Duration::from_millis(100) && wait > Duration::ZERO,
            "{wait:?}"
        );
        // Another token has a bucket of its own.
        assert!(limiter.take(limit, "b", start).is_ok());
        assert!(
            limiter
                .take(limit, "a", start + Duration::from_millis(100))
                .is_ok()
        );
        // Much later, the idle buckets are swept.
        assert!(
            limiter
                .take(limit, "c", start + Duration::from_secs(120))
                .is_ok()
        );
        assert_eq!(limiter.len(), 1);
        assert_eq!(RateLimit::parse("off"), Ok(None));
        assert!(RateLimit::parse("fast").is_err());
        assert_eq!(
            RateLimit::parse("100/s").expect("valid"),
            Some(RateLimit {
                per_second: 100.0,
                burst: 500.0
            })
        );
    }
}
