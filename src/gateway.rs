//! The request path of SPEC §3: route, owner, key, body, fingerprint, claim, and what to do
//! with the job the claim found — run it, replay it, wait for it, refuse, or re-open it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderName, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use tracing::{debug, warn};

use crate::attempts::{run_round, RoundEnd, RoundJob};
use crate::body::{self, Body};
use crate::breaker::Breakers;
use crate::config::{Config, IdempotencyMode, Route};
use crate::error::{Problem, ProblemKind};
use crate::headers;
use crate::intent;
use crate::job::{
    new_job_id, ExpiryPolicy, Found, JobId, JobRecord, JobState, StoredResponse, Transition,
};
use crate::metrics::{Metrics, RequestOutcome};
use crate::probe::ProbeResults;
use crate::store::{Applied, Claim, JobStore, MirroredStream, StoreError};
use crate::stream::{LiveStream, LiveStreams};
use crate::upstream::{provider_uri, CallError, ClientRequest, Upstream};
use tracing::Instrument;

/// Everything a request needs: config, store, upstream clients.
#[derive(Debug)]
pub struct Gateway {
    pub(crate) config: Arc<Config>,
    pub(crate) store: Arc<dyn JobStore>,
    pub(crate) upstream: Upstream,
    /// Rounds this process is running, by job id, with the version each read: on shutdown
    /// the ones still running are marked `unknown`, never left `in_progress`.
    rounds: Mutex<HashMap<JobId, u64>>,
    /// Streams this process is relaying, for duplicates to join.
    pub(crate) streams: LiveStreams,
    pub(crate) breakers: Breakers,
    pub(crate) metrics: Metrics,
    /// The last probe of each fallback, for routes with `failover_requires_probe`.
    pub(crate) probes: Arc<ProbeResults>,
    /// Tasks this gateway spawned (rounds, attempts, streams), for [`Gateway::crash`].
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

/// How long a client should wait before asking again about a job in flight.
const RETRY_AFTER: Duration = Duration::from_secs(1);

impl Gateway {
    pub fn new(config: Arc<Config>, store: Arc<dyn JobStore>) -> Arc<Self> {
        let upstream = Upstream::new(&config.providers);
        Self::with_upstream(config, store, upstream)
    }

    /// A gateway whose providers are reached through `upstream` (e.g. simulated ones).
    pub fn with_upstream(
        config: Arc<Config>,
        store: Arc<dyn JobStore>,
        upstream: Upstream,
    ) -> Arc<Self> {
        let probes = Arc::new(ProbeResults::default());
        if tokio::runtime::Handle::try_current().is_ok() {
            crate::probe::spawn_probers(config.clone(), upstream.clone(), probes.clone());
        }
        Arc::new(Self {
            breakers: Breakers::new(&config.providers),
            metrics: Metrics::default(),
            probes,
            upstream,
            config,
            store,
            rounds: Mutex::new(HashMap::new()),
            streams: LiveStreams::default(),
            tasks: Mutex::new(Vec::new()),
        })
    }

    /// Spawns a task of this gateway: [`Gateway::crash`] can abort it.
    pub(crate) fn spawn<F>(&self, task: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let handle = tokio::spawn(task);
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        if tasks.len() >= 1024 {
            tasks.retain(|t| !t.is_finished());
        }
        tasks.push(handle.abort_handle());
        handle
    }

    /// Stops every round, attempt and stream of this gateway at once, as if its process had
    /// been killed: no grace, no bookkeeping. Its jobs are left as a dead gateway leaves them
    /// (their leases lapse). For crash tests and simulations.
    pub fn crash(&self) {
        for task in self
            .tasks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            task.abort();
        }
    }

    /// The store this gateway claims and settles jobs in.
    pub fn store(&self) -> &Arc<dyn JobStore> {
        &self.store
    }

    pub fn expiry_policy(config: &Config) -> ExpiryPolicy {
        ExpiryPolicy {
            retention: config.idempotency.retention,
            late_result_window: config.idempotency.late_result_window,
        }
    }

    /// Applies a transition, retrying a store that blipped with a short bounded backoff so a
    /// settle is not lost to one dropped connection. Transitions are safe to re-apply.
    pub(crate) async fn apply(
        &self,
        id: &str,
        transition: Transition,
    ) -> Result<Applied, StoreError> {
        let mut delay = Duration::from_millis(25);
        for _ in 0..4 {
            let started = std::time::Instant::now();
            let applied = self
                .store
                .apply(id, transition.clone(), crate::clock::now())
                .await;
            self.metrics.store("apply", started.elapsed());
            match applied {
                Err(StoreError::Unavailable(e)) => {
                    warn!(job_id = id, error = %e, "store unavailable; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                result => return result,
            }
        }
        self.store.apply(id, transition, crate::clock::now()).await
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
        let response = result.unwrap_or_else(Problem::into_response);
        // Pass-through traffic is not counted: it makes no job.
        if let Some(route) = route {
            self.metrics.request(&route, outcome_of(&response));
        }
        response
    }

    async fn serve(
        self: &Arc<Self>,
        request: Request<Body>,
        counted_as: &mut Option<String>,
    ) -> Result<Response<Body>, Problem> {
        let (parts, body) = request.into_parts();
        let mut body = PendingBody::Unread(body);
        let route = match self.select_route(&parts, &mut body).await {
            Ok(route) => route,
            Err(problem) => {
                *counted_as = Some("none".into());
                return Err(problem);
            }
        };
        let safe = matches!(parts.method, Method::GET | Method::HEAD | Method::OPTIONS);
        if safe || route.idempotency == IdempotencyMode::Off {
            return self.pass_through(&route, parts, body).await;
        }
        *counted_as = Some(route.name.clone());
        tracing::Span::current().record("route", route.name.as_str());
        let idem = &self.config.idempotency;
        let owner = intent::owner(&idem.owner, &parts.headers).ok_or_else(|| {
            Problem::new(
                ProblemKind::MissingOwner,
                match &idem.owner {
                    intent::OwnerMode::Header(name) => {
                        format!("the {name} header names the owner of the key and is missing")
                    }
                    _ => "an Authorization header is required: the key belongs to its owner".into(),
                },
            )
        })?;
        tracing::Span::current().record("owner", owner.as_str());
        let key = intent::key(&parts.headers, &idem.header, idem.max_key_length)
            .map_err(|e| Problem::new(ProblemKind::InvalidIdempotencyKey, e.to_string()))?;
        if key.is_none() && route.idempotency == IdempotencyMode::Required {
            return Err(Problem::new(
                ProblemKind::MissingIdempotencyKey,
                format!("route {:?} requires an {} header", route.name, idem.header),
            ));
        }
        let bytes = body.read(&parts, self.config.server.max_body_bytes).await?;
        let path_and_query = path_and_query(&parts);
        let request = Arc::new(ClientRequest::new(
            parts.method.clone(),
            path_and_query.clone(),
            parts.headers,
            bytes,
            &idem.header,
        ));
        let Some(key) = key else {
            let end = self.spawn_round(route, None, request).await;
            return Ok(self.respond(None, end).await);
        };
        let fingerprint = intent::fingerprint(
            parts.method.as_str(),
            &path_and_query,
            &request.body,
            &idem.fingerprint_ignore,
        );
        let now = crate::clock::now();
        let policy = Self::expiry_policy(&self.config);
        let mut record = JobRecord::new(
            new_job_id(&owner, &key),
            owner,
            key,
            fingerprint.clone(),
            route.name.clone(),
            now,
            now + idem.lease,
            &policy,
        );
        // The first attempt is registered with the claim: one store write for both. Not when
        // the primary's circuit is open: the round will skip it.
        let first_attempt = if self.breakers.is_closed(route.providers[0]) {
            let primary = self.config.provider(route.providers[0]).name.clone();
            let start = Transition::StartAttempt {
                version: record.job.version,
                provider: primary,
            };
            match record.apply(start, now, &policy) {
                Ok(crate::job::Effect::AttemptStarted { n, .. }) => Some(n),
                _ => None,
            }
        } else {
            None
        };
        let started = std::time::Instant::now();
        let claimed = self.store.claim(record, now).await;
        self.metrics.store("claim", started.elapsed());
        let claimed = claimed.map_err(unavailable)?;
        let job_id = match &claimed {
            Claim::Created(r) | Claim::Existing(r) => r.job.id.clone(),
        };
        tracing::Span::current().record("job_id", job_id.as_str());
        match claimed {
            Claim::Created(record) => {
                debug!(job_id = %record.job.id, route = %route.name, "new job");
                let job = RoundJob {
                    id: record.job.id,
                    version: record.job.version,
                    first_attempt,
                };
                Ok(self.run_job(route, job, request).await)
            }
            Claim::Existing(record) => self.resolve(route, record, &fingerprint, request).await,
        }
    }

    /// The first route whose methods, path prefix and (when given) model globs match.
    async fn select_route(
        &self,
        parts: &Parts,
        body: &mut PendingBody,
    ) -> Result<Arc<Route>, Problem> {
        let path = parts.uri.path();
        for route in &self.config.routes {
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
            let bytes = body.read(parts, self.config.server.max_body_bytes).await?;
            let model = serde_json::from_slice::<serde_json::Value>(&bytes)
                .ok()
                .and_then(|v| v.get("model").and_then(|m| m.as_str().map(str::to_owned)));
            if let Some(model) = model {
                if route.models.iter().any(|glob| glob.matches(&model)) {
                    return Ok(route.clone());
                }
            }
        }
        Err(Problem::new(
            ProblemKind::NoRoute,
            format!("no route matches {} {path}", parts.method),
        ))
    }

    /// Safe methods and `idempotency = "off"` routes: a plain reverse proxy to the route's
    /// first provider, streaming both ways, no job.
    async fn pass_through(
        &self,
        route: &Route,
        parts: Parts,
        body: PendingBody,
    ) -> Result<Response<Body>, Problem> {
        let index = route.providers[0];
        let provider = self.config.provider(index);
        let mut headers = parts.headers.clone();
        headers::strip_hop_by_hop(&mut headers);
        headers.remove(http::header::HOST);
        headers.remove(http::header::CONTENT_LENGTH);
        for (name, value) in &provider.headers {
            headers.insert(name.clone(), value.clone());
        }
        let body = match body {
            PendingBody::Unread(body) => body,
            PendingBody::Read(bytes) => body::full(bytes),
        };
        let mut request = Request::new(body);
        *request.method_mut() = parts.method.clone();
        *request.uri_mut() = provider_uri(provider, &path_and_query(&parts));
        *request.headers_mut() = headers;
        let response = tokio::time::timeout(provider.timeout, self.upstream.send(index, request))
            .await
            .map_err(|_| {
                Problem::new(
                    ProblemKind::AttemptTimedOut,
                    format!(
                        "provider {:?} did not answer within {:?}",
                        provider.name, provider.timeout
                    ),
                )
            })?
            .map_err(|e: CallError| {
                Problem::new(
                    ProblemKind::AllProvidersFailed,
                    format!("provider {:?}: {e}", provider.name),
                )
            })?;
        let (mut head, incoming) = response.into_parts();
        headers::strip_hop_by_hop(&mut head.headers);
        Ok(Response::from_parts(head, incoming))
    }

    /// A claim found an existing job: SPEC §3 step 6, looping while the job is in flight.
    async fn resolve(
        self: &Arc<Self>,
        route: Arc<Route>,
        mut record: JobRecord,
        fingerprint: &str,
        request: Arc<ClientRequest>,
    ) -> Result<Response<Body>, Problem> {
        let idem = &self.config.idempotency;
        let deadline = tokio::time::Instant::now() + idem.wait_for_in_flight;
        loop {
            let id = record.job.id.clone();
            let now = crate::clock::now();
            match record.classify(fingerprint, now) {
                Found::Conflict => return Err(Problem::new(
                    ProblemKind::IdempotencyKeyReused,
                    "this idempotency key was used for a different request (method, path or body)",
                )
                .job(id)),
                Found::Replay => return Ok(replay(&record)),
                Found::Unknown => return Err(unknown_problem(&id)),
                Found::LeaseLapsed => {
                    let version = record.job.version;
                    let applied = self
                        .apply(&id, Transition::ExpireLease { version })
                        .await
                        .map_err(unavailable)?;
                    if applied.outcome.is_ok() {
                        warn!(job_id = %id, "job's lease lapsed (its gateway stopped); the job is unknown");
                    }
                    record = applied.record;
                }
                Found::InFlight => {
                    if let Some(live) = self.streams.joinable(&id) {
                        // A duplicate of a live stream gets what was recorded, then follows.
                        return Ok(relay(Some(&id), &live, false));
                    }
                    if record.job.completed_by.is_some() {
                        // Streaming on another gateway: follow its mirror in the store.
                        if let Some(mirror) =
                            self.store.read_stream(&id, 0).await.map_err(unavailable)?
                        {
                            return Ok(follow(self.store.clone(), id, mirror));
                        }
                    }
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        return Err(Problem::new(
                            ProblemKind::RequestInProgress,
                            "a request with this idempotency key is still running",
                        )
                        .job(id)
                        .retry_after(RETRY_AFTER));
                    }
                    // Wake at the latest when the lease would lapse, to notice a dead gateway.
                    let lease_left = record
                        .job
                        .lease_until
                        .duration_since(now)
                        .unwrap_or_default();
                    let wait = left.min(lease_left + Duration::from_millis(5));
                    record = self
                        .store
                        .wait_change(&id, record.job.version, record.job.state, wait)
                        .await
                        .map_err(unavailable)?;
                }
                Found::Reopenable { version } => {
                    let lease_until = now + idem.lease;
                    let applied = self
                        .apply(
                            &id,
                            Transition::Reopen {
                                version,
                                lease_until,
                            },
                        )
                        .await
                        .map_err(unavailable)?;
                    if applied.outcome.is_ok() {
                        debug!(job_id = %id, version = applied.record.job.version, "job re-opened for a new round");
                        let job = RoundJob {
                            id,
                            version: applied.record.job.version,
                            first_attempt: None,
                        };
                        return Ok(self.run_job(route, job, request).await);
                    }
                    // Another retry re-opened it first: wait for that round like a duplicate.
                    record = applied.record;
                }
            }
        }
    }

    async fn run_job(
        self: &Arc<Self>,
        route: Arc<Route>,
        job: RoundJob,
        request: Arc<ClientRequest>,
    ) -> Response<Body> {
        let id = job.id.clone();
        let end = self.spawn_round(route, Some(job), request).await;
        self.respond(Some(&id), end).await
    }

    /// Runs the round in its own task so that a client hanging up cannot abandon the job.
    async fn spawn_round(
        self: &Arc<Self>,
        route: Arc<Route>,
        job: Option<RoundJob>,
        request: Arc<ClientRequest>,
    ) -> RoundEnd {
        let gw = self.clone();
        let task = self.spawn(async move {
            if let Some(job) = &job {
                gw.lock_rounds().insert(job.id.clone(), job.version);
            }
            let id = job.as_ref().map(|j| j.id.clone());
            let end = run_round(gw.clone(), route, job, request).await;
            if let Some(id) = id {
                gw.lock_rounds().remove(&id);
            }
            end
        });
        task.await.unwrap_or_else(|e| {
            warn!(error = %e, "a round task failed");
            RoundEnd::Store(StoreError::Unavailable(
                "internal error in the round".into(),
            ))
        })
    }

    fn lock_rounds(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, u64>> {
        self.rounds.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn respond(&self, job_id: Option<&str>, end: RoundEnd) -> Response<Body> {
        let problem = match end {
            RoundEnd::Won { response, n, provider } => {
                return answer(job_id, &response, Some((n, &provider)), false);
            }
            RoundEnd::Streaming(live) => return relay(job_id, &live, true),
            RoundEnd::Failed { last: Some((response, n, provider)) } => {
                return answer(job_id, &response, Some((n, &provider)), false);
            }
            RoundEnd::Failed { last: None } => Problem::new(
                ProblemKind::AllProvidersFailed,
                "no provider answered; the job is failed and a retry with the same key opens a new round",
            ),
            RoundEnd::Unknown => Problem::new(
                ProblemKind::AttemptTimedOut,
                "the provider did not answer in time; the request may have run. The job is unknown until its late answer lands or it is cancelled",
            ),
            RoundEnd::Store(e) => Problem::new(ProblemKind::StoreUnavailable, e.to_string()),
            RoundEnd::Settled => match job_id {
                Some(id) => return self.settled(id).await,
                None => Problem::new(ProblemKind::AllProvidersFailed, "no provider answered"),
            },
        };
        match job_id {
            Some(id) => problem.job(id),
            None => problem,
        }
        .into_response()
    }

    /// The answer for a round whose job was settled by someone else.
    async fn settled(&self, id: &str) -> Response<Body> {
        let record = match self.store.get(id).await {
            Ok(Some(record)) => record,
            Ok(None) => {
                return Problem::new(ProblemKind::StoreUnavailable, "the job vanished")
                    .job(id)
                    .into_response()
            }
            Err(e) => return unavailable(e).job(id).into_response(),
        };
        match record.job.state {
            JobState::Succeeded => replay(&record),
            JobState::Cancelled => Problem::new(
                ProblemKind::OutcomeUnknown,
                "the job was cancelled out of band while this request ran; a retry opens a new round",
            )
            .job(id)
            .into_response(),
            JobState::Unknown => unknown_problem(id).into_response(),
            JobState::Failed => Problem::new(ProblemKind::AllProvidersFailed, "the job failed")
                .job(id)
                .into_response(),
            JobState::InProgress => Problem::new(ProblemKind::RequestInProgress, "the job is running")
                .job(id)
                .retry_after(RETRY_AFTER)
                .into_response(),
        }
    }

    /// Shutdown: rounds that could not finish within the grace period may have reached a
    /// provider, so their jobs become `unknown` rather than staying `in_progress`.
    pub async fn abandon_rounds(&self) {
        let rounds: Vec<(JobId, u64)> = self.lock_rounds().drain().collect();
        for (id, version) in rounds {
            match self.apply(&id, Transition::MarkUnknown { version }).await {
                Ok(Applied { outcome: Ok(_), .. }) => {
                    warn!(job_id = %id, "shutdown: job left unknown; resolve it with the cancel API if needed")
                }
                Ok(_) => {}
                Err(e) => {
                    warn!(job_id = %id, error = %e, "shutdown: could not mark the job unknown")
                }
            }
        }
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

fn unavailable(e: StoreError) -> Problem {
    Problem::new(ProblemKind::StoreUnavailable, e.to_string()).retry_after(RETRY_AFTER)
}

fn unknown_problem(id: &str) -> Problem {
    Problem::new(
        ProblemKind::OutcomeUnknown,
        "an earlier attempt of this job may have run; no new attempt is made until it settles or is cancelled",
    )
    .job(id)
}

fn path_and_query(parts: &Parts) -> String {
    parts
        .uri
        .path_and_query()
        .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned())
}

/// Segment-aware: `/v1/chat` matches `/v1/chat` and `/v1/chat/x`, not `/v1/chatty`.
fn prefix_matches(prefix: &str, path: &str) -> bool {
    match path.strip_prefix(prefix) {
        Some(rest) => rest.is_empty() || prefix.ends_with('/') || rest.starts_with('/'),
        None => false,
    }
}

/// The client's body: read at most once, as late as possible.
enum PendingBody {
    Unread(Body),
    Read(Bytes),
}

impl PendingBody {
    async fn read(&mut self, parts: &Parts, limit: usize) -> Result<Bytes, Problem> {
        let body = match std::mem::replace(self, Self::Read(Bytes::new())) {
            Self::Read(bytes) => {
                *self = Self::Read(bytes.clone());
                return Ok(bytes);
            }
            Self::Unread(body) => body,
        };
        let too_large = || {
            Problem::new(
                ProblemKind::PayloadTooLarge,
                format!("the request body is larger than {limit} bytes"),
            )
        };
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut body = body;
        if declared.is_some_and(|len| len > limit as u64) {
            drain(body).await;
            return Err(too_large());
        }
        let mut buf = bytes::BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|e| {
                Problem::new(
                    ProblemKind::BadRequest,
                    format!("could not read the request body: {e}"),
                )
            })?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    drain(body).await;
                    return Err(too_large());
                }
                buf.extend_from_slice(&data);
            }
        }
        let bytes = buf.freeze();
        *self = Self::Read(bytes.clone());
        Ok(bytes)
    }
}

/// Reads and discards what is left of a refused body, within bounds, so the client gets to
/// read the 413 instead of a connection reset while it is still sending.
async fn drain(mut body: Body) {
    const MAX_DRAIN: usize = 64 * 1024 * 1024;
    let mut drained = 0;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(Ok(frame)) = body.frame().await {
            drained += frame.data_ref().map_or(0, Bytes::len);
            if drained > MAX_DRAIN {
                return;
            }
        }
    })
    .await;
}

/// A live stream as an HTTP response: the client that runs the job (`primary`) or a
/// duplicate that joins it, from its first byte.
fn relay(job_id: Option<&str>, live: &LiveStream, primary: bool) -> Response<Body> {
    let head = StoredResponse {
        status: live.status,
        headers: live.headers.clone(),
        body: Bytes::new(),
        body_omitted: false,
    };
    let mut response = answer(job_id, &head, Some((live.n, &live.provider)), !primary);
    *response.body_mut() = live.recording.body(primary);
    response
}

/// A duplicate following a stream that another gateway relays, through the store's
/// mirror: what was mirrored so far, then the rest, polled with a bounded lag.
fn follow(store: Arc<dyn JobStore>, id: JobId, first: MirroredStream) -> Response<Body> {
    const LAG: Duration = Duration::from_millis(25);
    const PATIENCE: Duration = Duration::from_secs(60);
    let head = StoredResponse {
        status: first.head.status,
        headers: first.head.headers.clone(),
        body: Bytes::new(),
        body_omitted: false,
    };
    let mut response = answer(
        Some(&id),
        &head,
        Some((first.head.n, &first.head.provider)),
        true,
    );
    let state = (
        store,
        id,
        first.chunks.len(),
        std::collections::VecDeque::from(first.chunks),
        first.end,
        tokio::time::Instant::now(),
    );
    let chunks = futures_util::stream::unfold(Some(state), |state| async move {
        let (store, id, mut cursor, mut pending, mut end, mut progress) = state?;
        loop {
            if let Some(chunk) = pending.pop_front() {
                return Some((
                    Ok(http_body::Frame::data(chunk)),
                    Some((store, id, cursor, pending, end, progress)),
                ));
            }
            match end {
                Some(Ok(())) => return None,
                Some(Err(reason)) => return Some((Err(reason.into()), None)),
                None => {}
            }
            if progress.elapsed() > PATIENCE {
                return Some((Err("the mirrored stream stopped progressing".into()), None));
            }
            tokio::time::sleep(LAG).await;
            match store.read_stream(&id, cursor).await {
                Ok(Some(next)) => {
                    if !next.chunks.is_empty() || next.end.is_some() {
                        progress = tokio::time::Instant::now();
                    }
                    cursor += next.chunks.len();
                    pending.extend(next.chunks);
                    end = next.end;
                }
                Ok(None) => return Some((Err("the mirrored stream is gone".into()), None)),
                Err(e) => return Some((Err(e.to_string().into()), None)),
            }
        }
    });
    *response.body_mut() =
        http_body_util::BodyExt::boxed_unsync(http_body_util::StreamBody::new(chunks));
    response
}

fn replay(record: &JobRecord) -> Response<Body> {
    let job = &record.job;
    let Some(response) = &job.response else {
        return Problem::new(
            ProblemKind::StoreUnavailable,
            "the settled job has no stored answer",
        )
        .job(job.id.clone())
        .into_response();
    };
    let winner = job
        .completed_by
        .and_then(|n| record.attempt(n))
        .map(|a| (a.n, a.provider.as_str()));
    if response.body_omitted {
        return Problem::new(
            ProblemKind::ResponseNotStored,
            "the answer was larger than max_stored_response_bytes: it reached the request that ran the job but is not kept for replay; the job will not run again",
        )
        .job(job.id.clone())
        .into_response();
    }
    answer(Some(&job.id), response, winner, true)
}

/// A stored answer as an HTTP response, with the gateway's headers. The first answer and
/// every replay come from the same stored bytes, so they cannot drift apart.
fn answer(
    job_id: Option<&str>,
    stored: &StoredResponse,
    attempt: Option<(u32, &str)>,
    replayed: bool,
) -> Response<Body> {
    let mut response = Response::new(body::full(stored.body.clone()));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    let headers = response.headers_mut();
    for (name, value) in &stored.headers {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value.clone()),
        ) {
            headers.append(name, value);
        }
    }
    if let Some(id) = job_id.and_then(|id| HeaderValue::from_str(id).ok()) {
        headers.insert(headers::JOB_ID, id);
    }
    if let Some((n, provider)) = attempt {
        headers.insert(headers::ATTEMPT, HeaderValue::from(n));
        if let Ok(provider) = HeaderValue::from_str(provider) {
            headers.insert(headers::PROVIDER, provider);
        }
    }
    headers.insert(
        headers::REPLAYED,
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    response
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
