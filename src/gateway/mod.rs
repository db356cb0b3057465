//! The HTTP request path of SPEC §3, as a thin adapter over the [`Engine`]: route, owner,
//! key and body are read from the request; the engine fingerprints it, claims and carries
//! out the job; its [`crate::engine::Outcome`] becomes the response.
//!
//! - this module: reading the intent of a request;
//! - `path`: the one spelling of a method and path that routing and fingerprints use;
//! - `body`: the client's body, read once and bounded in size, budget and time;
//! - `model`: the `model` a body names, for routes that match by model;
//! - `passthrough`: safe methods and `off` routes, proxied without a job;
//! - `response`: outcomes as responses, replays byte for byte.

mod body;
pub mod model;
mod names;
mod passthrough;
mod path;
mod response;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use http::request::Parts;
use http::{HeaderValue, Method, Request, Response};
use tracing::{warn, Instrument};

use crate::body::Body;
use crate::config::{Config, IdempotencyMode, Route};
use crate::edge::budget::BodyBudget;
use crate::edge::clients::Clients;
use crate::engine::{Engine, Submission};
use crate::error::{Cause, Problem, ProblemKind};
use crate::headers;
use crate::intent::{self, OwnerError};
use crate::metrics::RequestOutcome;
use crate::store::JobStore;
use crate::upstream::ClientRequest;

use self::body::PendingBody;

/// The client-facing side of a gateway.
#[derive(Debug)]
pub struct Gateway {
    engine: Arc<Engine>,
    budget: Arc<BodyBudget>,
    clients: Option<Arc<Clients>>,
    /// Routes whose keyed-but-unprotected requests were already logged at warn.
    warned: Mutex<HashSet<String>>,
}

/// What the access log needs of a request the gateway answered.
#[derive(Clone, Debug, Default)]
pub struct AccessInfo {
    pub path: String,
    pub route: Option<String>,
    pub outcome: Option<RequestOutcome>,
}

tokio::task_local! {
    /// The [`AccessInfo`] of the request being served: left by [`Gateway::handle`] for the
    /// client edge's access line. A response extension allocated a map, its table and a box
    /// for every request, three of a replay's 34 allocations.
    pub static ACCESS: std::cell::RefCell<Option<AccessInfo>>;
}

impl Gateway {
    pub fn new(engine: Arc<Engine>) -> Arc<Self> {
        let server = &engine.config().server;
        let budget = BodyBudget::new(server.max_buffered_body_bytes);
        let clients = engine.config().clients.as_ref().map(Clients::new);
        Arc::new(Self {
            engine,
            budget,
            clients,
            warned: Mutex::new(HashSet::new()),
        })
    }

    /// The allow list of `[clients]`, if configured (reloaded on SIGHUP by the server).
    pub fn clients(&self) -> Option<&Arc<Clients>> {
        self.clients.as_ref()
    }

    /// Request body bytes held right now, against `max_buffered_body_bytes`.
    pub fn buffered_body_bytes(&self) -> usize {
        self.budget.used()
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
        // At debug: a span's fields are formatted when it is made and again on each record,
        // which at info cost more than the rest of a new job; the access line carries what
        // an operator greps for.
        let span = tracing::debug_span!(
            "request",
            method = %request.method(),
            path = %request.uri().path(),
            route = tracing::field::Empty,
            owner = tracing::field::Empty,
            job_id = tracing::field::Empty,
        );
        let mut info = AccessInfo {
            path: request.uri().path().to_owned(),
            ..AccessInfo::default()
        };
        let result = self.serve(request, &mut info).instrument(span).await;
        let response = result.unwrap_or_else(|cause| {
            let problem = Problem::from(cause);
            let kind = problem.kind;
            let mut response = problem.into_response();
            if kind == ProblemKind::RequestTimeout {
                // The rest of a late body may still be on its way: this connection is done.
                response
                    .headers_mut()
                    .insert(http::header::CONNECTION, HeaderValue::from_static("close"));
            }
            response
        });
        // Pass-through traffic is not counted: it makes no job.
        if let Some(route) = &info.route {
            let outcome = outcome_of(&response);
            self.engine.metrics().request(route, outcome);
            info.outcome = Some(outcome);
        }
        // Outside the client edge (a test serving the gateway alone) there is no line to
        // write, and no slot.
        let _ = ACCESS.try_with(|slot| *slot.borrow_mut() = Some(info));
        response
    }

    async fn serve(
        &self,
        request: Request<Body>,
        info: &mut AccessInfo,
    ) -> Result<Response<Body>, Cause> {
        let config = self.config();
        let deadline = tokio::time::Instant::now() + config.server.request_body_timeout;
        let (mut parts, body) = request.into_parts();
        parts.method = path::method(&parts.method);
        let normal = path::normalise(parts.uri.path()).map_err(|_| Cause::NoRoute {
            method: parts.method.clone(),
            path: "a path with an encoded '/' or '\\'".into(),
        })?;
        info.path.clone_from(&normal);
        let path_and_query = match parts.uri.query() {
            Some(query) => format!("{normal}?{query}"),
            None => normal.clone(),
        };
        let mut body = PendingBody::new(
            body,
            config.server.max_body_bytes,
            deadline,
            self.budget.reservation(),
        );
        let route = match self.select_route(&parts, &normal, &mut body).await {
            Ok(route) => route,
            Err(cause) => {
                info.route = Some("none".into());
                return Err(cause);
            }
        };
        let safe = matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS);
        let idem = &config.idempotency;
        if safe || route.idempotency == IdempotencyMode::Off {
            if self.clients.is_some() {
                self.owner(&parts)?;
            }
            let keyed = !safe && parts.headers.contains_key(&idem.header);
            let upstream = self.engine.upstream();
            let mut response =
                passthrough::pass_through(config, upstream, &route, parts, &path_and_query, body)
                    .await?;
            if keyed {
                self.unprotected(&route);
                response
                    .headers_mut()
                    .insert(headers::KEY_HONOURED, HeaderValue::from_static("false"));
            }
            return Ok(response);
        }
        info.route = Some(route.name.clone());
        tracing::Span::current().record("route", route.name.as_str());
        let owner = self.owner(&parts)?;
        tracing::Span::current().record("owner", owner.as_str());
        let key = intent::key(&parts.headers, &idem.header, idem.max_key_length)
            .map_err(|e| Cause::InvalidKey(e.to_string()))?;
        if key.is_none() && route.idempotency == IdempotencyMode::Required {
            return Err(Cause::MissingKey {
                route: route.name.clone(),
                header: idem.header.to_string(),
            });
        }
        let bytes = body.read(&parts).await?;
        let mut request = ClientRequest::new(
            parts.method,
            path_and_query,
            parts.headers,
            bytes,
            &idem.header,
        );
        request.credentials = idem.credential_headers.clone();
        let submission = Submission {
            route,
            owner,
            key,
            request: Arc::new(request),
        };
        let outcome = self.engine.submit(submission).await;
        Ok(response::respond(outcome, self.engine.store()))
    }

    /// The owner of a request (SPEC §3 step 2), and whether `[clients]` lets it in.
    fn owner(&self, parts: &Parts) -> Result<String, Cause> {
        let idem = &self.config().idempotency;
        let owner = intent::owner(&idem.owner, &parts.headers).map_err(|e| match e {
            OwnerError::Ambiguous(why) => Cause::AmbiguousOwner(why),
            OwnerError::Missing => Cause::MissingOwner {
                wanted: match &idem.owner {
                    intent::OwnerMode::Header(name) => format!("the {name} header"),
                    // The SDKs send their key in any of the three.
                    intent::OwnerMode::ApiKey => {
                        "an API key (Authorization: Bearer, X-Api-Key or api-key)".into()
                    }
                    _ => "an Authorization header".into(),
                },
            },
        })?;
        match &self.clients {
            Some(clients) if !clients.allows(&owner) => Err(Cause::UnknownClient),
            _ => Ok(owner),
        }
    }

    /// A keyed non-safe request on an `off` route: served, but said so, counted, and logged
    /// once per route.
    fn unprotected(&self, route: &Route) {
        self.engine.metrics().unprotected_keyed_request(&route.name);
        let first = self
            .warned
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(route.name.clone());
        if first {
            warn!(route = %route.name, "requests with an idempotency key reach this idempotency = \"off\" route: they are served without a job, and duplicates run twice");
        }
    }

    /// The first route whose methods, path prefix and (when given) model globs match.
    async fn select_route(
        &self,
        parts: &Parts,
        path: &str,
        body: &mut PendingBody,
    ) -> Result<Arc<Route>, Cause> {
        // The body's model, read at the first route that matches by model.
        let mut named: Option<Option<String>> = None;
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
            let model = match &named {
                Some(model) => model,
                None => {
                    let bytes = body.read(parts).await?;
                    named.insert(model::model_of(&bytes).map(std::borrow::Cow::into_owned))
                }
            };
            if let Some(model) = model {
                if route.models.iter().any(|glob| glob.matches(model)) {
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

/// Segment-aware: `/v1/chat` matches `/v1/chat`, `/v1/chat/x` and `/v1/chat;v=1` (a
/// segment's parameters do not make it another segment), not `/v1/chatty`.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => {
            rest.is_empty()
                || prefix.ends_with('/')
                || rest.starts_with('/')
                || rest.starts_with(';')
        }
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
        assert!(prefix_matches("/v1/chat", "/v1/chat;x=1"));
    }
}
