//! The HTTP request path of SPEC §3, as a thin adapter over the [`Engine`]: route, owner,
//! key, body and fingerprint are read from the request; the engine claims and carries out
//! the job; its [`crate::engine::Outcome`] becomes the response.
//!
//! - this module: reading the intent of a request;
//! - `body`: the client's body, read once and bounded;
//! - `passthrough`: safe methods and `off` routes, proxied without a job;
//! - `response`: outcomes as responses, replays byte for byte.

mod body;
mod passthrough;
mod response;

use std::sync::Arc;

use http::request::Parts;
use http::{Method, Request, Response, Uri};
use tracing::Instrument;

use crate::body::Body;
use crate::config::{Config, IdempotencyMode, Route};
use crate::engine::{Engine, Submission};
use crate::error::{Cause, Problem, ProblemKind};
use crate::headers;
use crate::intent;
use crate::metrics::RequestOutcome;
use crate::store::JobStore;
use crate::upstream::ClientRequest;

use self::body::PendingBody;

/// The client-facing side of a gateway.
#[derive(Debug)]
pub struct Gateway {
    engine: Arc<Engine>,
}

impl Gateway {
    pub fn new(engine: Arc<Engine>) -> Arc<Self> {
        Arc::new(Self { engine })
    }

    pub fn engine(&self) -> &Arc<Engine> {
        &self.engine
    }

    /// The store this gateway claims and settles jobs in.
    pub fn store(&self) -> &Arc<dyn JobStore> {
        self.engine.store()
    }

    fn config(&self) -> &Config {
        self.engine.config()
    }

    /// Serves one client request; every error becomes its problem+json answer.
    pub async fn handle(self: Arc<Self>, request: Request<Body>) -> Response<Body> {
        let span = tracing::info_span!(
            "request",
            method = %request.method(),
            path = %request.uri().path(),
            route = tracing::field::Empty,
            owner = tracing::field::Empty,
            job_id = tracing::field::Empty,
        );
        let mut route = None;
        let result = self.serve(request, &mut route).instrument(span).await;
        let response = result.unwrap_or_else(|cause| Problem::from(cause).into_response());
        // Pass-through traffic is not counted: it makes no job.
        if let Some(route) = route {
            self.engine.metrics().request(&route, outcome_of(&response));
        }
        response
    }

    async fn serve(
        &self,
        request: Request<Body>,
        counted_as: &mut Option<String>,
    ) -> Result<Response<Body>, Cause> {
        let (parts, body) = request.into_parts();
        let mut body = PendingBody::Unread(body);
        let route = match self.select_route(&parts, &mut body).await {
            Ok(route) => route,
            Err(cause) => {
                *counted_as = Some("none".into());
                return Err(cause);
            }
        };
        let safe = matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS);
        if safe || route.idempotency == IdempotencyMode::Off {
            let upstream = self.engine.upstream();
            return passthrough::pass_through(self.config(), upstream, &route, parts, body).await;
        }
        *counted_as = Some(route.name.clone());
        tracing::Span::current().record("route", route.name.as_str());
        let idem = &self.config().idempotency;
        let owner =
            intent::owner(&idem.owner, &parts.headers).ok_or_else(|| Cause::MissingOwner {
                header: match &idem.owner {
                    intent::OwnerMode::Header(name) => Some(name.to_string()),
                    _ => None,
                },
            })?;
        tracing::Span::current().record("owner", owner.as_str());
        let key = intent::key(&parts.headers, &idem.header, idem.max_key_length)
            .map_err(|e| Cause::InvalidKey(e.to_string()))?;
        if key.is_none() && route.idempotency == IdempotencyMode::Required {
            return Err(Cause::MissingKey {
                route: route.name.clone(),
                header: idem.header.to_string(),
            });
        }
        let bytes = body
            .read(&parts, self.config().server.max_body_bytes)
            .await?;
        let path_and_query = path_and_query(&parts.uri);
        let fingerprint = match key {
            Some(_) => intent::fingerprint(
                parts.method.as_str(),
                &path_and_query,
                &bytes,
                &idem.fingerprint_ignore,
            ),
            None => String::new(),
        };
        let request = Arc::new(ClientRequest::new(
            parts.method,
            path_and_query,
            parts.headers,
            bytes,
            &idem.header,
        ));
        let submission = Submission {
            route,
            owner,
            key,
            fingerprint,
            request,
        };
        let outcome = self.engine.submit(submission).await;
        Ok(response::respond(outcome, self.engine.store()))
    }

    /// The first route whose methods, path prefix and (when given) model globs match.
    async fn select_route(
        &self,
        parts: &Parts,
        body: &mut PendingBody,
    ) -> Result<Arc<Route>, Cause> {
        let path = parts.uri.path();
        for route in &self.config().routes {
            let method_ok = route
                .methods
                .as_ref()
                .is_none_or(|m| m.contains(&parts.method));
            if !method_ok || !prefix_matches(&route.path_prefix, path) {
                continue;
            }
            if route.models.is_empty() {
                return Ok(route.clone());
            }
            let bytes = body
                .read(parts, self.config().server.max_body_bytes)
                .await?;
            let model = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("model").and_then(|m| m.as_str().map(str::to_owned)));
            if let Some(model) = model {
                if route.models.iter().any(|glob| glob.matches(&model)) {
                    return Ok(route.clone());
                }
            }
        }
        Err(Cause::NoRoute {
            method: parts.method.clone(),
            path: path.to_owned(),
        })
    }
}

/// What a request came to, for the requests counter.
fn outcome_of(response: &Response<Body>) -> RequestOutcome {
    match response.extensions().get::<ProblemKind>() {
        Some(ProblemKind::IdempotencyKeyReused) => RequestOutcome::Conflict,
        Some(ProblemKind::RequestInProgress) => RequestOutcome::InProgress,
        Some(ProblemKind::OutcomeUnknown | ProblemKind::AttemptTimedOut) => RequestOutcome::Unknown,
        Some(_) => RequestOutcome::Error,
        None if response
            .headers()
            .get(headers::REPLAYED)
            .is_some_and(|v| v == "true") =>
        {
            RequestOutcome::Replayed
        }
        None => RequestOutcome::New,
    }
}

fn path_and_query(uri: &Uri) -> String {
    uri.path_and_query()
        .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned())
}

/// Segment-aware: `/v1/chat` matches `/v1/chat` and `/v1/chat/x`, not `/v1/chatty`.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_whole_segments() {
        assert!(prefix_matches("/v1/chat", "/v1/chat"));
        assert!(prefix_matches("/v1/chat", "/v1/chat/completions"));
        assert!(!prefix_matches("/v1/chat", "/v1/chatty"));
        assert!(prefix_matches("/", "/anything"));
        assert!(prefix_matches("/v1/", "/v1/x"));
        assert!(!prefix_matches("/v2", "/v1"));
    }
}
