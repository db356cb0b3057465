//! Circuit breakers, one per provider (SPEC §4): after `breaker.failures` definite failures
//! in a row the provider is skipped for `breaker.cool_down`; then one real request is let
//! through, and its success closes the breaker again.
//!
//! State is per gateway process: a breaker protects this gateway's view of a provider, and
//! sharing it through the store would put a store round trip on every attempt.

use std::sync::Mutex;
use std::time::Duration;

use serde::Serialize;
use tokio::time::Instant;

use crate::config::Provider;

#[derive(Debug)]
pub struct Breakers {
    breakers: Vec<Mutex<Breaker>>,
}

#[derive(Debug)]
struct Breaker {
    name: String,
    failures: u32,
    cool_down: Duration,
    consecutive: u32,
    /// Set while open: until when the provider is skipped.
    open_until: Option<Instant>,
    /// The trial request let through after the cool-down, if one is out.
    trial_since: Option<Instant>,
}

/// What the admin API shows of a breaker.
#[derive(Debug, Serialize)]
pub struct BreakerView {
    pub name: String,
    pub state: &'static str,
    pub consecutive_failures: u32,
    /// RFC 3339, while open.
    pub open_until: Option<String>,
}

impl Breakers {
    pub fn new(providers: &[std::sync::Arc<Provider>]) -> Self {
        Self {
            breakers: providers
                .iter()
                .map(|p| {
                    Mutex::new(Breaker {
                        name: p.name.clone(),
                        failures: p.breaker.failures,
                        cool_down: p.breaker.cool_down,
                        consecutive: 0,
                        open_until: None,
                        trial_since: None,
                    })
                })
                .collect(),
        }
    }

    fn lock(&self, index: usize) -> std::sync::MutexGuard<'_, Breaker> {
        self.breakers[index]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the breaker is closed (a look, not a trial).
    pub fn is_closed(&self, index: usize) -> bool {
        self.lock(index).open_until.is_none()
    }

    /// Whether a request to provider `index` may go now; a half-open breaker lets exactly
    /// one trial through (another only if that one never reported back within a cool-down).
    pub fn try_acquire(&self, index: usize) -> bool {
        let mut b = self.lock(index);
        let now = Instant::now();
        match b.open_until {
            None => true,
            Some(until) if now < until => false,
            Some(_) => match b.trial_since {
                Some(since) if now < since + b.cool_down => false,
                _ => {
                    b.trial_since = Some(now);
                    true
                }
            },
        }
    }

    pub fn record_success(&self, index: usize) {
        let mut b = self.lock(index);
        if b.open_until.is_some() {
            tracing::info!(provider = %b.name, "circuit closed: the trial request succeeded");
        }
        b.consecutive = 0;
        b.open_until = None;
        b.trial_since = None;
    }

    pub fn record_failure(&self, index: usize) {
        let mut b = self.lock(index);
        b.consecutive += 1;
        let trial_failed = b.trial_since.take().is_some();
        if b.consecutive >= b.failures || trial_failed {
            if b.open_until.is_none() || trial_failed {
                tracing::warn!(provider = %b.name, failures = b.consecutive, cool_down = ?b.cool_down,
                    "circuit open: the provider is skipped for the cool-down");
            }
            b.open_until = Some(Instant::now() + b.cool_down);
        }
    }

    pub fn views(&self) -> Vec<BreakerView> {
        let now = Instant::now();
        (0..self.breakers.len())
            .map(|i| {
                let b = self.lock(i);
                let state = match b.open_until {
                    None => "closed",
                    Some(until) if now < until => "open",
                    Some(_) => "half_open",
                };
                BreakerView {
                    name: b.name.clone(),
                    state,
                    consecutive_failures: b.consecutive,
                    open_until: b.open_until.filter(|u| now < *u).map(|u| {
                        let wall = crate::clock::now() + (u - now);
                        humantime::format_rfc3339_millis(wall).to_string()
                    }),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breakers(failures: u32, cool_down: Duration) -> Breakers {
        let config = crate::config::Config::parse(
            &format!(
                "[[providers]]\nname = \"p\"\nbase_url = \"http://x\"\nbreaker = {{ failures = {failures}, cool_down = \"{}ms\" }}\n\
                 [[routes]]\nname = \"r\"\nproviders = [\"p\"]\n",
                cool_down.as_millis()
            ),
            "t",
        )
        .unwrap();
        Breakers::new(&config.providers)
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_and_lets_one_trial_through() {
        let b = breakers(3, Duration::from_secs(30));
        for _ in 0..2 {
            assert!(b.try_acquire(0));
            b.record_failure(0);
        }
        assert!(b.try_acquire(0), "two failures keep it closed");
        b.record_failure(0);
        assert!(!b.try_acquire(0), "the third opens it");
        assert_eq!(b.views()[0].state, "open");
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(b.views()[0].state, "half_open");
        assert!(b.try_acquire(0), "one trial after the cool-down");
        assert!(!b.try_acquire(0), "and only one");
        b.record_success(0);
        assert_eq!(b.views()[0].state, "closed");
        assert!(b.try_acquire(0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_trial_opens_it_again_and_a_success_resets_the_count() {
        let b = breakers(2, Duration::from_secs(10));
        b.record_failure(0);
        b.record_success(0);
        b.record_failure(0);
        assert!(b.try_acquire(0), "the count restarted after the success");
        b.record_failure(0);
        assert!(!b.try_acquire(0));
        tokio::time::advance(Duration::from_secs(11)).await;
        assert!(b.try_acquire(0));
        b.record_failure(0);
        assert!(
            !b.try_acquire(0),
            "a failed trial re-opens for a full cool-down"
        );
        tokio::time::advance(Duration::from_secs(9)).await;
        assert!(!b.try_acquire(0));
    }
}
