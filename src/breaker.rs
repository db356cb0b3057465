//! Circuit breakers, one per provider (SPEC §4): after `breaker.failures` definite failures
//! in a row the provider is skipped for a cool-down; then one real request is let through at
//! a time, and its success closes the breaker. The cool-down starts at `cool_down` and
//! doubles each time the breaker re-opens without a success in between (a failed trial, a
//! failed probe), up to `max_cool_down`; a success resets it. While a breaker is open, the
//! engine probes the provider every cool-down when a route has a `probe` (see
//! [`crate::engine`]), so a recovered provider is back within about one cool-down without
//! real traffic paying for the test.
//!
//! State is per gateway process: a breaker protects this gateway's view of a provider, and
//! sharing it through the store would put a store round trip on every attempt.

use std::sync::Mutex;
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::sync::Notify;
use tokio::time::Instant;

use crate::config::Provider;

#[derive(Debug)]
pub struct Breakers {
    breakers: Vec<Mutex<Breaker>>,
    /// Woken when a breaker opens, for the probers.
    opened: Notify,
}

#[derive(Debug)]
struct Breaker {
    name: String,
    config: crate::config::Breaker,
    /// The cool-down the breaker opens (or opened) for now.
    cool_down: Duration,
    consecutive: u32,
    /// Set while open: until when the provider is skipped.
    open_until: Option<Instant>,
    /// The trial request let through after the cool-down, if one is out.
    trial_since: Option<Instant>,
    probe: Option<ProbeView>,
}

/// The last probe of a provider, as the admin API shows it.
#[derive(Clone, Debug, Serialize)]
pub struct ProbeView {
    pub ok: bool,
    /// RFC 3339.
    pub at: String,
    pub error: Option<String>,
}

/// What the admin API shows of a breaker (`GET /providers`).
#[derive(Debug, Serialize)]
pub struct BreakerView {
    pub state: &'static str,
    /// RFC 3339, while open.
    pub open_until: Option<String>,
    /// The current cool-down, e.g. `"4s"`.
    pub cool_down: String,
    /// Definite failures in a row.
    pub failures: u32,
}

/// A provider as `GET /providers` shows it.
#[derive(Debug, Serialize)]
pub struct ProviderView {
    pub name: String,
    pub breaker: BreakerView,
    pub probe: Option<ProbeView>,
}

impl Breakers {
    pub fn new(providers: &[std::sync::Arc<Provider>]) -> Self {
        Self {
            breakers: providers
                .iter()
                .map(|p| {
                    Mutex::new(Breaker {
                        name: p.name.clone(),
                        config: p.breaker,
                        cool_down: p.breaker.cool_down,
                        consecutive: 0,
                        open_until: None,
                        trial_since: None,
                        probe: None,
                    })
                })
                .collect(),
            opened: Notify::new(),
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
            tracing::info!(provider = %b.name, "circuit closed: the provider answered again");
        }
        b.close();
    }

    pub fn record_failure(&self, index: usize) {
        let mut b = self.lock(index);
        b.consecutive += 1;
        let trial_failed = b.trial_since.take().is_some();
        if trial_failed {
            b.reopen();
        } else if b.consecutive >= b.config.failures && b.open_until.is_none() {
            b.open();
        }
        drop(b);
        self.opened.notify_waiters();
    }

    /// A probe of provider `index` while its breaker is open: a pass closes it, a failure
    /// re-opens it with the next, doubled, cool-down.
    pub fn record_probe(&self, index: usize, error: Option<String>) {
        let mut b = self.lock(index);
        b.probe = Some(ProbeView {
            ok: error.is_none(),
            at: humantime::format_rfc3339_millis(crate::clock::now()).to_string(),
            error: error.clone(),
        });
        match error {
            None if b.open_until.is_some() => {
                tracing::info!(provider = %b.name, "circuit closed: the probe passed");
                b.close();
            }
            None => {}
            Some(_) if b.open_until.is_some() => b.reopen(),
            Some(_) => {}
        }
    }

    /// When an open breaker's cool-down ends (it is due a probe then), or `None` if closed.
    pub fn due(&self, index: usize) -> Option<Instant> {
        self.lock(index).open_until
    }

    /// Resolves when some breaker has opened (or failed again).
    pub async fn opened(&self) {
        self.opened.notified().await;
    }

    pub fn views(&self) -> Vec<ProviderView> {
        let now = Instant::now();
        (0..self.breakers.len())
            .map(|i| {
                let b = self.lock(i);
                let state = match b.open_until {
                    None => "closed",
                    Some(until) if now < until => "open",
                    Some(_) => "half_open",
                };
                ProviderView {
                    name: b.name.clone(),
                    breaker: BreakerView {
                        state,
                        open_until: b.open_until.filter(|u| now < *u).map(|u| {
                            let wall: SystemTime = crate::clock::now() + (u - now);
                            humantime::format_rfc3339_millis(wall).to_string()
                        }),
                        cool_down: humantime::format_duration(b.cool_down).to_string(),
                        failures: b.consecutive,
                    },
                    probe: b.probe.clone(),
                }
            })
            .collect()
    }
}

impl Breaker {
    fn open(&mut self) {
        tracing::warn!(provider = %self.name, failures = self.consecutive, cool_down = ?self.cool_down,
            "circuit open: the provider is skipped for the cool-down");
        self.open_until = Some(Instant::now() + self.cool_down);
    }

    /// Opens again without a success in between: the cool-down doubles, up to its cap.
    fn reopen(&mut self) {
        self.cool_down = (self.cool_down * 2).min(self.config.max_cool_down);
        self.open();
    }

    fn close(&mut self) {
        self.consecutive = 0;
        self.open_until = None;
        self.trial_since = None;
        self.cool_down = self.config.cool_down;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breakers(failures: u32, cool_down: Duration) -> Breakers {
        let config = crate::config::Config::parse(
            &format!(
                "[[providers]]\nname = \"p\"\nbase_url = \"http://x\"\nbreaker = {{ failures = {failures}, cool_down = \"{}ms\", max_cool_down = \"{}ms\" }}\n\
                 [[routes]]\nname = \"r\"\nproviders = [\"p\"]\n",
                cool_down.as_millis(),
                cool_down.as_millis() * 4
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
        assert_eq!(b.views()[0].breaker.state, "open");
        tokio::time::advance(Duration::from_secs(31)).await;
        assert_eq!(b.views()[0].breaker.state, "half_open");
        assert!(b.try_acquire(0), "one trial after the cool-down");
        assert!(!b.try_acquire(0), "and only one");
        b.record_success(0);
        assert_eq!(b.views()[0].breaker.state, "closed");
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
            "a failed trial re-opens for a doubled cool-down"
        );
        tokio::time::advance(Duration::from_secs(19)).await;
        assert!(!b.try_acquire(0));
    }

    #[tokio::test(start_paused = true)]
    async fn the_cool_down_doubles_up_to_its_cap_and_a_success_resets_it() {
        let b = breakers(1, Duration::from_secs(2));
        b.record_failure(0);
        assert_eq!(b.views()[0].breaker.cool_down, "2s");
        for expected in ["4s", "8s", "8s"] {
            tokio::time::advance(Duration::from_secs(9)).await;
            assert!(b.try_acquire(0), "a trial");
            b.record_failure(0);
            assert_eq!(b.views()[0].breaker.cool_down, expected);
        }
        b.record_probe(0, Some("503".into()));
        assert_eq!(b.views()[0].breaker.state, "open");
        b.record_probe(0, None);
        let view = &b.views()[0];
        assert_eq!(
            (view.breaker.state, view.breaker.cool_down.as_str()),
            ("closed", "2s")
        );
        assert!(view.probe.as_ref().unwrap().ok);
    }
}
