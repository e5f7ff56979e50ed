//! Request rates per API key (docs/api.md, "Budgets and limits"): a token bucket per key,
//! from `governor`, with the tenant's own rate where `bedrock tenant rate` set one and
//! `[rate_limits]` otherwise. Every authenticated request counts, and so does every
//! WebSocket client frame. Over the rate, a request is refused with 429 `rate_limited` and
//! `Retry-After`, and a frame with `rejected`.
//!
//! Buckets live in the process: with several nodes each has its own, so a key's rate is
//! per node. A tenant's own rate is read again at most once a minute.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use governor::clock::{Clock as _, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use super::error::ApiError;
use crate::config::RateLimitSettings;
use crate::metrics::Metrics;
use crate::store::Store;

/// How long a key's bucket keeps the rate it was made with before the tenant's rate is
/// read again.
const RELOAD: Duration = Duration::from_secs(60);

struct Bucket {
    /// `None`: no limit.
    limiter: Option<Arc<DefaultDirectRateLimiter>>,
    /// The rate and burst it was made with.
    rate: (f64, u32),
    made: Instant,
}

/// Every key's bucket.
pub struct RateLimits {
    default: RateLimitSettings,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl std::fmt::Debug for RateLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimits")
            .field("default", &self.default)
            .finish_non_exhaustive()
    }
}

fn limiter(per_second: f64, burst: u32) -> Option<Arc<DefaultDirectRateLimiter>> {
    if !(per_second.is_finite() && per_second > 0.0) {
        return None;
    }
    let quota = Quota::with_period(Duration::try_from_secs_f64(1.0 / per_second).ok()?)?
        .allow_burst(NonZeroU32::new(burst.max(1))?);
    Some(Arc::new(RateLimiter::direct(quota)))
}

impl RateLimits {
    pub fn new(default: RateLimitSettings) -> Self {
        RateLimits {
            default,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    fn buckets(&self) -> std::sync::MutexGuard<'_, HashMap<String, Bucket>> {
        self.buckets.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Counts one request of key `key_id` (the hash of the key, or the dev tenant's name)
    /// of tenant `tenant_id`.
    pub async fn admit(
        &self,
        store: &Store,
        metrics: &Metrics,
        key_id: &str,
        tenant_id: &str,
    ) -> Result<(), ApiError> {
        // One lock on the hot path: a fresh bucket is checked at once.
        let fresh = self
            .buckets()
            .get(key_id)
            .filter(|b| b.made.elapsed() < RELOAD)
            .map(|b| b.limiter.clone());
        if let Some(limiter) = fresh {
            return Self::check(metrics, limiter.as_deref()).map_err(ApiError::rate_limited);
        }
        {
            let own = store.tenant_limits(tenant_id).await.unwrap_or_default();
            let per_second = own.rate_per_second.unwrap_or(self.default.per_second);
            let burst = own.rate_burst.unwrap_or(self.default.burst);
            let mut buckets = self.buckets();
            if buckets.len() > 100_000 {
                buckets.retain(|_, b| b.made.elapsed() < RELOAD);
            }
            // A bucket whose rate has not changed keeps its tokens.
            match buckets.get_mut(key_id) {
                Some(bucket) if bucket.rate == (per_second, burst) => bucket.made = Instant::now(),
                Some(_) | None => {
                    buckets.insert(
                        key_id.to_owned(),
                        Bucket {
                            limiter: limiter(per_second, burst),
                            rate: (per_second, burst),
                            made: Instant::now(),
                        },
                    );
                }
            }
        }
        self.admit_known(metrics, key_id)
            .map_err(ApiError::rate_limited)
    }

    /// Counts one WebSocket frame of a key whose bucket exists (its connection was
    /// admitted); the seconds to wait when over the rate.
    pub fn admit_known(&self, metrics: &Metrics, key_id: &str) -> Result<(), u64> {
        let limiter = self.buckets().get(key_id).and_then(|b| b.limiter.clone());
        Self::check(metrics, limiter.as_deref())
    }

    fn check(metrics: &Metrics, limiter: Option<&DefaultDirectRateLimiter>) -> Result<(), u64> {
        let Some(limiter) = limiter else {
            return Ok(());
        };
        limiter.check().map_err(|not_until| {
            metrics.rejected("rate_limited");
            let wait = not_until.wait_time_from(DefaultClock::default().now());
            wait.as_secs_f64().ceil().max(1.0) as u64
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let bucket = limiter(2.0, 3).expect("a limiter");
        for _ in 0..3 {
            assert!(bucket.check().is_ok());
        }
        let refused = bucket.check().expect_err("over the burst");
        let wait = refused.wait_time_from(DefaultClock::default().now());
        assert!(wait <= Duration::from_millis(500), "{wait:?}");
        assert!(limiter(0.0, 10).is_none());
        assert!(limiter(f64::NAN, 10).is_none());
    }
}
