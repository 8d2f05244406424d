//! Per-key request rate limits (`--key-rate-limit RPS`): a token bucket per key id, refilled at RPS tokens a
//! second up to a burst of twice that. A key over its rate gets 429 `rate_limited` with `Retry-After`; other
//! keys are not slowed. The bootstrap key is not limited (it is the operator's).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct RateLimiter {
    per_second: f64,
    burst: f64,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

impl RateLimiter {
    /// None when `per_second` is 0 (no limit).
    pub fn new(per_second: u32) -> Option<RateLimiter> {
        (per_second > 0).then(|| RateLimiter {
            per_second: f64::from(per_second),
            burst: 2.0 * f64::from(per_second),
            buckets: Mutex::new(HashMap::new()),
        })
    }

    /// Takes one token for `key_id` at `now`, or says how long until one is there.
    pub fn take(&self, key_id: &str, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (tokens, last) = buckets.entry(key_id.to_string()).or_insert((self.burst, now));
        let elapsed = now.saturating_duration_since(*last).as_secs_f64();
        *tokens = (*tokens + elapsed * self.per_second).min(self.burst);
        *last = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((1.0 - *tokens) / self.per_second))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_rate_and_keys_are_separate() {
        let Some(r) = RateLimiter::new(2) else {
            panic!("a limiter for 2/s");
        };
        let t0 = Instant::now();
        for _ in 0..4 {
            assert_eq!(r.take("a", t0), Ok(()));
        }
        let wait = r.take("a", t0).err();
        assert!(
            wait.is_some_and(|w| w > Duration::ZERO && w <= Duration::from_millis(500)),
            "{wait:?}"
        );
        assert_eq!(r.take("b", t0), Ok(()), "another key is not slowed");
        assert_eq!(r.take("a", t0 + Duration::from_millis(500)), Ok(()));
        assert!(RateLimiter::new(0).is_none());
    }
}
