//! The admin API (SPEC §8), on its own listener: health, readiness, job inspection and the
//! out-of-band cancel. Everything but the probes needs the bearer token.

use std::sync::Arc;
use std::time::SystemTime;

use http::{Method, Request, Response, StatusCode};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::body::{self, Body};
use crate::engine::Engine;
use crate::error::{Cause, Problem, REQUEST_ID};
use crate::job::{Attempt, JobRecord, Rejection, Transition};
use crate::store::StoreError;

#[derive(Debug)]
pub struct Admin {
    engine: Arc<Engine>,
    /// SHA-256 of the token: compared digest to digest, so the comparison time says
    /// nothing about the token.
    token_digest: Option<[u8; 32]>,
}

impl Admin {
    pub fn new(engine: Arc<Engine>, token: Option<String>) -> Self {
        Self {
            engine,
            token_digest: token
                .filter(|t| !t.is_empty())
                .map(|t| Sha256::digest(t.as_bytes()).into()),
        }
    }

    /// Serves one admin request. Its answers carry a request id as the client listener's
    /// do (SPEC §11), so an operator's call can be named in a report like any other.
    pub async fn handle(self: Arc<Self>, mut request: Request<Body>) -> Response<Body> {
        let id = crate::edge::request_id(&mut request);
        let mut response = REQUEST_ID
            .scope(id.clone(), async {
                match self.serve(request).await {
                    Ok(response) => response,
                    Err(problem) => problem.into_response(),
                }
            })
            .await;
        response
            .headers_mut()
            .insert(crate::headers::REQUEST_ID, id);
        response
    }

    async fn serve(&self, request: Request<Body>) -> Result<Response<Body>, Problem> {
        let path = request.uri().path().to_owned();
        let method = request.method().clone();
        match (&method, path.as_str()) {
            (&Method::GET, "/healthz") => {
                return Ok(json_response(StatusCode::OK, json!({"status": "ok"})))
            }
            (&Method::GET, "/metrics") => {
                // A store that cannot list its unknown jobs still gets its other metrics out.
                let unknown = self.engine.store().count_unknown().await.ok();
                let text = self
                    .engine
                    .metrics()
                    .render(unknown, &self.engine.breakers().views());
                let mut response = Response::new(body::full(text));
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static(
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    ),
                );
                return Ok(response);
            }
            // The console's page is open: it holds no data, and asks for the token before it
            // shows any (every call it makes needs the token).
            (&Method::GET, "/ui") => return Ok(console()),
            (&Method::GET, "/readyz") => {
                return match self.engine.store().ping().await {
                    Ok(()) => Ok(json_response(StatusCode::OK, json!({"status": "ready"}))),
                    Err(e) => Err(Cause::Store(e).into()),
                }
            }
            _ => {}
        }
        self.authorize(&request)?;
        if method == Method::GET && path == "/providers" {
            let providers = self.engine.breakers().views();
            return Ok(json_response(
                StatusCode::OK,
                json!({ "providers": providers }),
            ));
        }
        if method == Method::GET && path == "/jobs" {
            return self.list(request.uri().query().unwrap_or("")).await;
        }
        let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        match (&method, segments.as_slice()) {
            (&Method::GET, ["jobs", id]) => {
                let record = self.engine.store().get(id).await.map_err(store_problem)?;
                let record = record.ok_or_else(|| not_found(id))?;
                Ok(json_response(StatusCode::OK, job_view(&record)))
            }
            (&Method::POST, ["jobs", id, "cancel"]) => {
                // Which attempts the cancel resolves, for the attempts counter, and the version
                // it cancels: a retried apply of it is then recognised as already applied.
                let record = self.engine.store().get(id).await.map_err(store_problem)?;
                let record = record.ok_or_else(|| not_found(id))?;
                let live: Vec<String> = record
                    .attempts
                    .iter()
                    .filter(|a| a.state.is_live())
                    .map(|a| a.provider.clone())
                    .collect();
                let cancel = Transition::CancelAt {
                    version: record.job.version,
                };
                let applied = self.engine.apply(id, cancel).await.map_err(|e| match e {
                    StoreError::NotFound(_) => not_found(id),
                    e => store_problem(e),
                })?;
                match applied.outcome {
                    Ok(_) => {
                        for provider in &live {
                            self.engine.metrics().attempt(provider, "cancelled");
                        }
                        tracing::warn!(job_id = %id, "job cancelled out of band; late answers will be discarded");
                        Ok(json_response(StatusCode::OK, job_view(&applied.record)))
                    }
                    Err(Rejection::AlreadySettled(state)) => {
                        Err(Problem::from(Cause::AlreadySettled(state)).job(*id))
                    }
                    Err(other) => Err(Problem::from(Cause::Internal(other.to_string())).job(*id)),
                }
            }
            _ => Err(Cause::NotFound(format!("no admin endpoint {method} {path}")).into()),
        }
    }

    /// `GET /jobs?state=unknown|in_progress[&limit=N][&after=ID]`: the jobs an operator
    /// looks at, in id order, a page at a time, from the store's indexes (never a scan);
    /// `GET /jobs?key=K&owner=HASH`: the job of that (owner, key).
    async fn list(&self, query: &str) -> Result<Response<Body>, Problem> {
        let mut state = None;
        let mut limit = 100usize;
        let mut after = None;
        let mut key = None;
        let mut owner = None;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode(value);
            match name {
                "state" => state = Some(value),
                "limit" => {
                    limit = value
                        .parse::<usize>()
                        .ok()
                        .filter(|l| (1..=1000).contains(l))
                        .ok_or(Cause::BadQuery("limit must be 1 to 1000"))?
                }
                "after" => after = Some(value),
                "key" => key = Some(value),
                "owner" => owner = Some(value),
                _ => {}
            }
        }
        let store = self.engine.store();
        if let Some(key) = key {
            let owner = owner.ok_or(Cause::BadQuery(
                "a lookup by key needs the owner's hash too (owner=)",
            ))?;
            let found = store.find(&owner, &key).await.map_err(store_problem)?;
            let found = found.filter(|r| !r.is_expired(crate::clock::now()));
            return match found {
                Some(record) => Ok(json_response(StatusCode::OK, job_view(&record))),
                None => Err(Cause::NotFound("no job for that key and owner".into()).into()),
            };
        }
        let ids =
            match state.as_deref() {
                Some("unknown") => store.unknown_jobs(after.as_deref(), limit).await,
                Some("in_progress") => store.in_progress_jobs(after.as_deref(), limit).await,
                _ => return Err(Cause::BadQuery(
                    "list jobs by state=unknown or state=in_progress, or find one by key=…&owner=…",
                )
                .into()),
            }
            .map_err(store_problem)?;
        let mut jobs = Vec::with_capacity(ids.len());
        for id in &ids {
            if let Some(record) = store.get(id).await.map_err(store_problem)? {
                jobs.push(job_view(&record));
            }
        }
        let next = (ids.len() == limit).then(|| ids.last().cloned()).flatten();
        Ok(json_response(
            StatusCode::OK,
            json!({ "jobs": jobs, "next": next }),
        ))
    }

    fn authorize(&self, request: &Request<Body>) -> Result<(), Problem> {
        let presented = request
            .headers()
            .get(http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(|t| <[u8; 32]>::from(Sha256::digest(t.trim().as_bytes())));
        match (&self.token_digest, presented) {
            (Some(expected), Some(presented)) if *expected == presented => Ok(()),
            (None, _) => Err(Cause::Unauthorized { configured: false }.into()),
            _ => Err(Cause::Unauthorized { configured: true }.into()),
        }
    }
}

/// A query value with `%XX` escapes and `+` decoded (keys may hold any visible ASCII).
fn percent_decode(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => match u8::from_str_radix(&value[i + 1..i + 3], 16) {
                Ok(b) => {
                    out.push(b);
                    i += 3;
                    continue;
                }
                Err(_) => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn not_found(id: &str) -> Problem {
    Cause::NotFound(format!("no job {id}")).into()
}

fn store_problem(e: StoreError) -> Problem {
    Cause::Store(e).into()
}

/// The operator console: one self-contained page, no external assets.
fn console() -> Response<Body> {
    let mut response = Response::new(body::full(include_str!("ui.html")));
    let headers = response.headers_mut();
    headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(
        http::header::CONTENT_SECURITY_POLICY,
        http::HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:",
        ),
    );
    headers.insert(
        http::header::CACHE_CONTROL,
        http::HeaderValue::from_static("no-store"),
    );
    response
}

fn json_response(status: StatusCode, value: Value) -> Response<Body> {
    let mut response = Response::new(body::full(value.to_string()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn time(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}

/// The job and its attempts as SPEC §8 names them. Stored bodies are never included.
pub fn job_view(record: &JobRecord) -> Value {
    let job = &record.job;
    json!({
        "job": {
            "id": job.id,
            "owner": job.owner,
            "key": job.key,
            "fingerprint": job.fingerprint,
            "route": job.route,
            "state": job.state,
            "version": job.version,
            "completed_by": job.completed_by,
            "created_at": time(job.created_at),
            "updated_at": time(job.updated_at),
            "expires_at": time(job.expires_at),
        },
        "attempts": record.attempts.iter().map(attempt_view).collect::<Vec<_>>(),
    })
}

fn attempt_view(a: &Attempt) -> Value {
    json!({
        "n": a.n,
        "provider": a.provider,
        "state": a.state,
        "read_version": a.read_version,
        "started_at": time(a.started_at),
        "finished_at": a.finished_at.map(time),
        "upstream_status": a.upstream_status,
        "error": a.error,
    })
}
