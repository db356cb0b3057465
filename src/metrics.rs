//! Prometheus metrics (`GET /metrics` on the admin listener): what an on-call engineer needs
//! to see a job stuck in `unknown` at 3 a.m. without reading the code.

use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AttemptLabels {
    provider: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProviderLabels {
    provider: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OperationLabels {
    operation: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// What a request came to, as counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// It ran attempts (a new job, a re-opened one, or a keyless request).
    New,
    Replayed,
    Conflict,
    InProgress,
    Unknown,
    Error,
}

impl RequestOutcome {
    const ALL: [Self; 6] = [
        Self::New,
        Self::Replayed,
        Self::Conflict,
        Self::InProgress,
        Self::Unknown,
        Self::Error,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::New => "new",
            Self::Replayed => "replayed",
            Self::Conflict => "conflict",
            Self::InProgress => "in_progress",
            Self::Unknown => "unknown",
            Self::Error => "error",
        }
    }
}

/// Attempt results, as counted.
const RESULTS: [&str; 6] = [
    "succeeded",
    "failed",
    "unknown",
    "lost_race",
    "contract_rejected",
    "cancelled",
];

/// Store operations, as timed.
const OPERATIONS: [&str; 3] = ["claim", "apply", "get"];

/// The series every job touches, looked up once when the engine starts: a lookup in a
/// family allocates its label strings, hashes them and takes the family's lock, five times
/// per new job. Anything not resolved here (a name no config holds) is still counted
/// through its family.
#[derive(Debug, Default)]
struct Resolved {
    /// By route name: one counter per [`RequestOutcome`], in `RequestOutcome::ALL` order.
    routes: Vec<(String, [Counter; RequestOutcome::ALL.len()])>,
    providers: Vec<ProviderSeries>,
    /// In [`OPERATIONS`] order.
    store: Vec<Histogram>,
}

#[derive(Debug)]
struct ProviderSeries {
    name: String,
    upstream: Histogram,
    /// In [`RESULTS`] order.
    attempts: [Counter; RESULTS.len()],
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    resolved: Resolved,
    requests: Family<RequestLabels, Counter>,
    attempts: Family<AttemptLabels, Counter>,
    races_lost: Family<ProviderLabels, Counter>,
    jobs_unknown: Gauge,
    breaker_open: Family<ProviderLabels, Gauge>,
    upstream_seconds: Histograms<ProviderLabels>,
    store_seconds: Histograms<OperationLabels>,
    unprotected: Family<RouteLabels, Counter>,
    panics: Counter,
    late_dropped: Counter,
    stream_buffered: Gauge,
    leases_expired: Counter,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    route: String,
}

fn latency_histogram() -> Histogram {
    // 0.5 ms … ~33 s.
    Histogram::new(exponential_buckets(0.0005, 2.0, 17))
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("idemgate");
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "requests",
            "Idempotent requests by route and outcome (new, replayed, conflict, in_progress, unknown, error)",
            requests.clone(),
        );
        let attempts = Family::<AttemptLabels, Counter>::default();
        registry.register(
            "attempts",
            "Attempt results by provider (succeeded, failed, unknown, lost_race, contract_rejected, cancelled)",
            attempts.clone(),
        );
        let races_lost = Family::<ProviderLabels, Counter>::default();
        registry.register(
            "races_lost",
            "Attempts whose answer arrived after another attempt won, by provider; their payload was dropped",
            races_lost.clone(),
        );
        let jobs_unknown = Gauge::default();
        registry.register(
            "jobs_unknown",
            "Jobs currently unknown: an attempt may have run and nobody knows; each needs a late answer or an operator",
            jobs_unknown.clone(),
        );
        let breaker_open = Family::<ProviderLabels, Gauge>::default();
        registry.register(
            "breaker_open",
            "Circuit breaker state by provider: 0 closed, 1 open (skipped), 2 half-open (one trial allowed)",
            breaker_open.clone(),
        );
        let upstream_seconds: Histograms<ProviderLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "upstream_seconds",
            "Time from sending an attempt to its complete answer (first byte for streams), by provider",
            upstream_seconds.clone(),
        );
        let store_seconds: Histograms<OperationLabels> =
            Family::new_with_constructor(latency_histogram);
        registry.register(
            "store_seconds",
            "Store operation latency by operation (claim, apply, get)",
            store_seconds.clone(),
        );
        let unprotected = Family::<RouteLabels, Counter>::default();
        registry.register(
            "unprotected_keyed_requests",
            "Non-safe requests that carried an idempotency key but landed on an idempotency = \"off\" route: served without a job",
            unprotected.clone(),
        );
        let panics = Counter::default();
        registry.register(
            "panics",
            "Panics caught while handling a request or running a round; each answered 500 internal",
            panics.clone(),
        );
        let late_dropped = Counter::default();
        registry.register(
            "late_results_dropped",
            "Timed-out calls not kept for a late answer because late_result_max calls were already waiting; their attempts stay unknown",
            late_dropped.clone(),
        );
        let stream_buffered = Gauge::default();
        registry.register(
            "stream_buffered_bytes",
            "Bytes of live streams held in memory (recordings and unread chunks)",
            stream_buffered.clone(),
        );
        let leases_expired = Counter::default();
        registry.register(
            "leases_expired",
            "Jobs left in_progress by a gateway that stopped, moved to unknown once their lease lapsed",
            leases_expired.clone(),
        );
        Self {
            resolved: Resolved::default(),
            leases_expired,
            unprotected,
            panics,
            late_dropped,
            stream_buffered,
            registry,
            requests,
            attempts,
            races_lost,
            jobs_unknown,
            breaker_open,
            upstream_seconds,
            store_seconds,
        }
    }
}

impl Metrics {
    /// Metrics whose series for these routes, providers and store operations exist from the
    /// start (at zero) and are counted without a lookup.
    pub fn new<'a>(
        routes: impl IntoIterator<Item = &'a str>,
        providers: impl IntoIterator<Item = &'a str>,
    ) -> Self {
        let mut metrics = Self::default();
        let routes = routes
            .into_iter()
            .map(|route| {
                let counters = RequestOutcome::ALL.map(|outcome| {
                    metrics
                        .requests
                        .get_or_create(&RequestLabels {
                            route: route.to_owned(),
                            outcome: outcome.as_str().to_owned(),
                        })
                        .clone()
                });
                (route.to_owned(), counters)
            })
            .collect();
        let providers = providers
            .into_iter()
            .map(|provider| ProviderSeries {
                name: provider.to_owned(),
                upstream: metrics
                    .upstream_seconds
                    .get_or_create(&ProviderLabels {
                        provider: provider.to_owned(),
                    })
                    .clone(),
                attempts: RESULTS.map(|result| {
                    metrics
                        .attempts
                        .get_or_create(&AttemptLabels {
                            provider: provider.to_owned(),
                            result: result.to_owned(),
                        })
                        .clone()
                }),
            })
            .collect();
        let store = OPERATIONS
            .iter()
            .map(|operation| {
                metrics
                    .store_seconds
                    .get_or_create(&OperationLabels {
                        operation: (*operation).to_owned(),
                    })
                    .clone()
            })
            .collect();
        metrics.resolved = Resolved {
            routes,
            providers,
            store,
        };
        metrics
    }

    fn provider(&self, name: &str) -> Option<&ProviderSeries> {
        self.resolved.providers.iter().find(|p| p.name == name)
    }

    pub fn request(&self, route: &str, outcome: RequestOutcome) {
        if let Some((_, counters)) = self.resolved.routes.iter().find(|(r, _)| r == route) {
            counters[outcome as usize].inc();
            return;
        }
        self.requests
            .get_or_create(&RequestLabels {
                route: route.to_owned(),
                outcome: outcome.as_str().to_owned(),
            })
            .inc();
    }

    pub fn attempt(&self, provider: &str, result: &str) {
        let index = RESULTS.iter().position(|r| *r == result);
        if let (Some(series), Some(index)) = (self.provider(provider), index) {
            series.attempts[index].inc();
            return;
        }
        self.attempts
            .get_or_create(&AttemptLabels {
                provider: provider.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }

    pub fn race_lost(&self, provider: &str) {
        self.races_lost
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .inc();
    }

    pub fn upstream(&self, provider: &str, took: Duration) {
        if let Some(series) = self.provider(provider) {
            series.upstream.observe(took.as_secs_f64());
            return;
        }
        self.upstream_seconds
            .get_or_create(&ProviderLabels {
                provider: provider.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn store(&self, operation: &str, took: Duration) {
        let index = OPERATIONS.iter().position(|o| *o == operation);
        if let Some(histogram) = index.and_then(|i| self.resolved.store.get(i)) {
            histogram.observe(took.as_secs_f64());
            return;
        }
        self.store_seconds
            .get_or_create(&OperationLabels {
                operation: operation.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    pub fn unprotected_keyed_request(&self, route: &str) {
        self.unprotected
            .get_or_create(&RouteLabels {
                route: route.to_owned(),
            })
            .inc();
    }

    pub fn panicked(&self) {
        self.panics.inc();
    }

    #[cfg(test)]
    pub(crate) fn panics(&self) -> u64 {
        self.panics.get()
    }

    pub fn lease_expired(&self) {
        self.leases_expired.inc();
    }

    pub fn late_result_dropped(&self) {
        self.late_dropped.inc();
    }

    /// The text exposition, with the gauges that are read at scrape time set first.
    pub fn render(
        &self,
        jobs_unknown: Option<usize>,
        breakers: &[crate::breaker::ProviderView],
    ) -> String {
        if let Some(count) = jobs_unknown {
            self.jobs_unknown.set(count as i64);
        }
        self.stream_buffered
            .set(i64::try_from(crate::stream::buffered_bytes()).unwrap_or(i64::MAX));
        for b in breakers {
            let state = match b.breaker.state {
                "open" => 1,
                "half_open" => 2,
                _ => 0,
            };
            self.breaker_open
                .get_or_create(&ProviderLabels {
                    provider: b.name.clone(),
                })
                .set(state);
        }
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)
            .expect("writing to a String cannot fail");
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_index_their_counters_in_order() {
        for (i, outcome) in RequestOutcome::ALL.into_iter().enumerate() {
            assert_eq!(outcome as usize, i);
        }
    }

    #[test]
    fn resolved_series_and_looked_up_ones_are_the_same_series() {
        let metrics = Metrics::new(["chat"], ["primary"]);
        let before = metrics.render(None, &[]);
        assert!(
            before.contains(r#"idemgate_requests_total{route="chat",outcome="replayed"} 0"#),
            "{before}"
        );
        metrics.request("chat", RequestOutcome::Replayed);
        metrics.request("other", RequestOutcome::New);
        metrics.attempt("primary", "lost_race");
        metrics.attempt("primary", "lost_race");
        metrics.attempt("elsewhere", "failed");
        metrics.upstream("primary", Duration::from_millis(3));
        metrics.store("claim", Duration::from_millis(1));
        metrics.store("expire", Duration::from_millis(1));
        let text = metrics.render(None, &[]);
        for line in [
            r#"idemgate_requests_total{route="chat",outcome="replayed"} 1"#,
            r#"idemgate_requests_total{route="other",outcome="new"} 1"#,
            r#"idemgate_attempts_total{provider="primary",result="lost_race"} 2"#,
            r#"idemgate_attempts_total{provider="elsewhere",result="failed"} 1"#,
            r#"idemgate_upstream_seconds_count{provider="primary"} 1"#,
            r#"idemgate_store_seconds_count{operation="claim"} 1"#,
            r#"idemgate_store_seconds_count{operation="expire"} 1"#,
        ] {
            assert!(text.contains(line), "{line} missing from\n{text}");
        }
    }
}
