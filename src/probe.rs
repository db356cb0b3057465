//! Probes (SPEC §6): a route's `probe` request sent through every provider of the route —
//! with that provider's headers and `body_set`, so it proves the request renders for it — to
//! check that a fallback holds the primary's contract *before* the gateway fails over to it.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use serde_json::Value;
use tracing::{info, warn};

use crate::config::{Config, Route};
use crate::upstream::{read_body, ClientRequest, Read, Upstream};

/// One provider's probe result.
#[derive(Clone, Debug)]
pub struct ProbeResult {
    pub route: String,
    pub provider: String,
    pub provider_index: usize,
    /// The primary's row, first in a route.
    pub primary: bool,
    pub status: Option<u16>,
    pub elapsed: Duration,
    /// `None` when the provider holds the contract; otherwise what is wrong.
    pub problem: Option<String>,
}

impl ProbeResult {
    pub fn passed(&self) -> bool {
        self.problem.is_none()
    }
}

/// Sends the route's probe through each of its providers (each once, in route order).
pub async fn probe_route(config: &Config, upstream: &Upstream, route: &Route) -> Vec<ProbeResult> {
    let Some(probe) = &route.probe else {
        return Vec::new();
    };
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    for (name, value) in &probe.headers {
        headers.insert(name.clone(), value.clone());
    }
    let body = if probe.body.is_null() {
        Bytes::new()
    } else {
        Bytes::from(serde_json::to_vec(&probe.body).expect("JSON serialises"))
    };
    let path = probe
        .path
        .clone()
        .unwrap_or_else(|| route.path_prefix.clone());
    let request = ClientRequest::new(
        probe.method.clone(),
        path,
        headers,
        body,
        &config.idempotency.header,
    );
    let mut seen = Vec::new();
    let mut results: Vec<ProbeResult> = Vec::new();
    let mut primary_shape: Option<&'static str> = None;
    for (step, &index) in route.providers.iter().enumerate() {
        if seen.contains(&index) {
            continue;
        }
        seen.push(index);
        let provider = config.provider(index);
        let started = Instant::now();
        let outcome = tokio::time::timeout(provider.timeout, async {
            let response = upstream
                .send(index, request.for_provider(provider, None))
                .await
                .map_err(|e| e.to_string())?;
            let (head, mut incoming) = response.into_parts();
            let body = match read_body(
                &mut incoming,
                config.server.max_stored_response_bytes,
                || {},
            )
            .await
            .map_err(|e| e.to_string())?
            {
                Read::Whole(body) => body,
                Read::Over(_) => {
                    return Err("the answer is larger than max_stored_response_bytes".to_owned())
                }
            };
            Ok::<_, String>((head.status.as_u16(), body))
        })
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {:?}", provider.timeout)));
        let (status, problem) = match outcome {
            Err(e) => (None, Some(e)),
            Ok((status, body)) => {
                let shape = shape_of(&body);
                let problem = if !(200..300).contains(&status) {
                    Some(format!("status {status}"))
                } else if let Some(violation) =
                    crate::contract::violation(route.contract.as_ref(), &body)
                {
                    Some(violation)
                } else {
                    match (step, primary_shape) {
                        (0, _) => {
                            primary_shape = Some(shape);
                            None
                        }
                        (_, Some(expected)) if expected != shape => Some(format!(
                            "the answer is {shape}, the primary's is {expected}"
                        )),
                        _ => None,
                    }
                };
                (Some(status), problem)
            }
        };
        results.push(ProbeResult {
            route: route.name.clone(),
            provider: provider.name.clone(),
            provider_index: index,
            primary: step == 0,
            status,
            elapsed: started.elapsed(),
            problem,
        });
    }
    results
}

/// Sends the route's probe to one provider: `None` when it passes (a 2xx that holds the
/// route's contract), else what is wrong. What an open breaker is tested with.
pub async fn probe_provider(
    config: &Config,
    upstream: &Upstream,
    route: &Route,
    index: usize,
) -> Option<String> {
    let mut single = route.clone();
    single.providers = vec![index];
    probe_route(config, upstream, &single)
        .await
        .into_iter()
        .next()
        .and_then(|result| result.problem)
}

/// What kind of document an answer is, for "parses as the primary's does".
fn shape_of(body: &[u8]) -> &'static str {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(_)) => "a JSON object",
        Ok(Value::Array(_)) => "a JSON array",
        Ok(_) => "a JSON scalar",
        Err(_) => "not JSON",
    }
}

/// The table `idemgate probe` prints.
pub fn table(results: &[ProbeResult]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<16} {:<16} {:<9} {:>7} {:>9}  result",
        "route", "provider", "role", "status", "time"
    );
    for r in results {
        let _ = writeln!(
            out,
            "{:<16} {:<16} {:<9} {:>7} {:>9}  {}",
            r.route,
            r.provider,
            if r.primary { "primary" } else { "fallback" },
            r.status.map_or("-".to_owned(), |s| s.to_string()),
            format!("{}ms", r.elapsed.as_millis()),
            r.problem.as_deref().unwrap_or("ok"),
        );
    }
    out
}

/// `idemgate probe`: probes every route that has a probe; `true` when every provider held.
pub async fn run_cli(config: &Config) -> (String, bool) {
    let upstream = Upstream::new(&config.providers);
    let mut results = Vec::new();
    for route in config.routes.iter().filter(|r| r.probe.is_some()) {
        results.extend(probe_route(config, &upstream, route).await);
    }
    if results.is_empty() {
        return ("no route has a [routes.probe] request\n".to_owned(), true);
    }
    let ok = results.iter().all(ProbeResult::passed);
    (table(&results), ok)
}

/// The last probe result per (route, provider), for `failover_requires_probe`.
#[derive(Debug, Default)]
pub struct ProbeResults(Mutex<HashMap<(String, usize), bool>>);

impl ProbeResults {
    /// Whether the provider's last probe on this route passed. Never probed: not proven.
    pub fn passed(&self, route: &str, provider: usize) -> bool {
        let results = self.0.lock().unwrap_or_else(|e| e.into_inner());
        results
            .get(&(route.to_owned(), provider))
            .copied()
            .unwrap_or(false)
    }

    fn record(&self, results: &[ProbeResult]) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        for r in results {
            map.insert((r.route.clone(), r.provider_index), r.passed());
        }
    }
}

/// Probes one route with `failover_requires_probe` every `probe_interval`, for ever: the
/// engine runs it as a task that ends when the gateway stops.
pub async fn prober(
    config: Arc<Config>,
    upstream: Upstream,
    route: Arc<Route>,
    results: Arc<ProbeResults>,
) {
    let mut tick = tokio::time::interval(route.probe_interval);
    loop {
        tick.tick().await;
        let round = probe_route(&config, &upstream, &route).await;
        for r in round.iter().filter(|r| !r.passed()) {
            warn!(route = %r.route, provider = %r.provider, problem = r.problem.as_deref(),
                "probe failed: no failover to this provider until it passes");
        }
        info!(route = %route.name, passed = round.iter().filter(|r| r.passed()).count(), of = round.len(), "probed");
        results.record(&round);
    }
}
