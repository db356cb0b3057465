//! The engine: everything a job needs and nothing of HTTP serving. It owns the store (with
//! its retry policy and store metrics), the upstream clients, the breakers, the probe
//! results, the live streams and every task it spawns; it claims a job for an intent, decides
//! what the claim found (SPEC §3 step 6) and runs rounds of attempts (SPEC §4).
//!
//! The HTTP request path ([`crate::gateway`]) and the admin API ([`crate::admin`]) are thin
//! adapters over an `Arc<Engine>`: they turn requests into a [`Submission`] or an admin
//! operation and an [`Outcome`] back into a response. A round can be run from an engine with
//! a simulated transport and no listener at all.
//!
//! - this module: the engine, claims and what they found;
//! - `round`: one round — which provider goes next, timeouts, hedging, retries, leases;
//! - `attempt`: one attempt — the call, what its answer means, its own settlement;
//! - `relay`: an attempt whose answer is a stream — relayed live, recorded, mirrored.

mod attempt;
mod background;
mod relay;
mod round;

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::breaker::Breakers;
use crate::config::{Config, Route};
use crate::error::Cause;
use crate::job::{
    claim_digest_bytes, job_id_for, Effect, ExpiryPolicy, Found, JobId, JobRecord, JobState,
    ReplayHead, Settled, StoredResponse, Transition,
};
use crate::metrics::Metrics;
use crate::probe::ProbeResults;
use crate::store::{Applied, Claim, JobStore, MirroredStream, Peeked, StoreError};
use crate::stream::{LiveStream, LiveStreams};
use crate::upstream::{ClientRequest, Upstream};

pub use round::{RoundEnd, RoundJob};

/// What a job needs: config, store, providers, and the tasks working for it.
#[derive(Debug)]
pub struct Engine {
    config: Arc<Config>,
    store: Arc<dyn JobStore>,
    upstream: Upstream,
    breakers: Breakers,
    metrics: Metrics,
    /// The last probe of each fallback, for routes with `failover_requires_probe`.
    probes: Arc<ProbeResults>,
    /// Streams this process is relaying, for duplicates to join.
    streams: LiveStreams,
    /// Rounds this process is running, by job id, with the version each read: on shutdown
    /// the ones still running are marked `unknown`, never left `in_progress`.
    rounds: Mutex<Rounds>,
    /// Every task of this engine (rounds, attempts, streams, probers), so shutdown can wait.
    tasks: TaskTracker,
    /// Cancelled by [`Engine::crash`]: every task stops at its next await, as if killed.
    killed: CancellationToken,
    /// Cancelled by [`Engine::stop`]: background loops (probers) end.
    stopping: CancellationToken,
    /// Timed-out calls kept waiting for a late answer, at most `late_result_max`.
    late: Arc<AtomicUsize>,
}

/// An attempt's place among the calls kept for a late answer: taken when it times out,
/// given back when its task ends, however it ends.
#[derive(Debug)]
pub(crate) struct LateSlot {
    waiting: Arc<AtomicUsize>,
    max: usize,
    counted: AtomicBool,
}

impl LateSlot {
    /// Counts the attempt among the late ones, unless `late_result_max` are already waiting.
    pub(crate) fn admit(&self) -> bool {
        let admitted = self
            .waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .is_ok();
        self.counted.store(admitted, Ordering::Release);
        admitted
    }
}

impl Drop for LateSlot {
    fn drop(&mut self) {
        if self.counted.load(Ordering::Acquire) {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// One intent, as the request path read it. Its fingerprint is the request's, taken by the
/// engine only when a claim needs it.
#[derive(Debug)]
pub struct Submission {
    pub route: Arc<Route>,
    /// The owner's hash.
    pub owner: String,
    /// `None` for a keyless request on an `optional` route: attempts, but no job.
    pub key: Option<String>,
    pub request: Arc<ClientRequest>,
}

/// What became of a submission.
#[derive(Debug)]
pub enum Outcome {
    /// An attempt's answer: the winner's (first time or replayed), or the last upstream
    /// answer of a round in which every provider failed.
    Answer {
        job_id: Option<JobId>,
        response: StoredResponse,
        n: u32,
        provider: String,
        replayed: bool,
        /// A replay's headers as its store keeps them, if it does.
        head: Option<ReplayHead>,
    },
    /// A live stream: relayed by this request's round, or joined by a duplicate.
    Stream {
        job_id: Option<JobId>,
        live: LiveStream,
        joined: bool,
    },
    /// A stream relayed by another gateway, to follow through the store's mirror.
    Follow {
        job_id: JobId,
        mirror: MirroredStream,
    },
    /// No answer to give: why.
    Refused { job_id: Option<JobId>, cause: Cause },
}

impl Outcome {
    fn refused(job_id: &str, cause: Cause) -> Self {
        Self::Refused {
            job_id: Some(job_id.to_owned()),
            cause,
        }
    }
}

impl Engine {
    /// An engine whose providers are reached through `upstream` (real or simulated). Inside
    /// a runtime it starts the probers of routes with `failover_requires_probe`.
    pub fn new(config: Arc<Config>, store: Arc<dyn JobStore>, upstream: Upstream) -> Arc<Self> {
        let store = crate::store::timed::Timed::new(store, config.store.op_timeout);
        let engine = Arc::new(Self {
            breakers: Breakers::new(&config.providers),
            metrics: Metrics::new(
                config.routes.iter().map(|r| r.name.as_str()),
                config.providers.iter().map(|p| p.name.as_str()),
            ),
            probes: Arc::new(ProbeResults::default()),
            streams: LiveStreams::default(),
            rounds: Mutex::new(Rounds::default()),
            tasks: TaskTracker::new(),
            killed: CancellationToken::new(),
            stopping: CancellationToken::new(),
            late: Arc::new(AtomicUsize::new(0)),
            upstream,
            config,
            store,
        });
        if tokio::runtime::Handle::try_current().is_ok() {
            let stopping = engine.stopping.clone();
            let sweep = background::sweep_leases(Arc::downgrade(&engine));
            engine.spawn(async move { stopping.run_until_cancelled(sweep).await });
            // A provider of a route with a probe is probed while its breaker is open.
            let mut probed = Vec::new();
            for route in engine.config.routes.iter().filter(|r| r.probe.is_some()) {
                for &index in &route.providers {
                    if !probed.contains(&index) {
                        probed.push(index);
                        let stopping = engine.stopping.clone();
                        let prober = background::probe_open_breaker(
                            Arc::downgrade(&engine),
                            index,
                            route.clone(),
                        );
                        engine.spawn(async move { stopping.run_until_cancelled(prober).await });
                    }
                }
            }
            for route in engine
                .config
                .routes
                .iter()
                .filter(|r| r.failover_requires_probe)
            {
                let prober = crate::probe::prober(
                    engine.config.clone(),
                    engine.upstream.clone(),
                    route.clone(),
                    engine.probes.clone(),
                );
                let stopping = engine.stopping.clone();
                engine.spawn(async move { stopping.run_until_cancelled(prober).await });
            }
        }
        engine
    }

    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    pub fn store(&self) -> &Arc<dyn JobStore> {
        &self.store
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn breakers(&self) -> &Breakers {
        &self.breakers
    }

    pub fn upstream(&self) -> &Upstream {
        &self.upstream
    }

    pub fn expiry_policy(config: &Config) -> ExpiryPolicy {
        ExpiryPolicy {
            retention: config.idempotency.retention,
            late_result_window: config.idempotency.late_result_window,
        }
    }

    /// Spawns a task of this engine: tracked for shutdown, stopped by [`Engine::crash`]
    /// (then it yields `None`).
    pub(crate) fn spawn<F>(&self, task: F) -> JoinHandle<Option<F::Output>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let killed = self.killed.clone();
        // Boxed once here: a round's or an attempt's state machine is kilobytes, and unboxed
        // it was copied by every wrapper and again into the task's cell.
        let task = Box::pin(task);
        self.tasks
            .spawn(async move { killed.run_until_cancelled(task).await })
    }

    pub(crate) fn late_slot(&self) -> Arc<LateSlot> {
        Arc::new(LateSlot {
            waiting: self.late.clone(),
            max: self.config.idempotency.late_result_max,
            counted: AtomicBool::new(false),
        })
    }

    /// Timed-out calls waiting for a late answer right now.
    pub fn late_results_waiting(&self) -> usize {
        self.late.load(Ordering::Acquire)
    }

    /// Stops every round, attempt and stream of this engine at once, as if its process had
    /// been killed: no grace, no bookkeeping. Its jobs are left as a dead gateway leaves them
    /// (their leases lapse). For crash tests and simulations.
    pub fn crash(&self) {
        self.killed.cancel();
    }

    /// Ends the background loops (probers); rounds and late answers carry on.
    pub fn stop(&self) {
        self.stopping.cancel();
        self.tasks.close();
    }

    /// Applies a transition, retrying a store that blipped with a short bounded backoff so a
    /// settle is not lost to one dropped connection. Transitions are safe to re-apply.
    pub async fn apply(&self, id: &str, transition: Transition) -> Result<Applied, StoreError> {
        let mut delay = Duration::from_millis(25);
        for _ in 0..4 {
            let started = tokio::time::Instant::now();
            let applied = self
                .store
                .apply(id, transition.clone(), crate::clock::now())
                .await;
            self.metrics.store("apply", started.elapsed());
            match applied {
                Err(e @ StoreError::Unavailable { .. }) => {
                    warn!(job_id = id, error = %e, "store unavailable; retrying");
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                result => return result,
            }
        }
        self.store.apply(id, transition, crate::clock::now()).await
    }

    /// Claims the job of a submission and carries it out: a new job runs, an existing one is
    /// replayed, waited for, refused or re-opened (SPEC §3 step 6).
    pub async fn submit(self: &Arc<Self>, submission: Submission) -> Outcome {
        let Submission {
            route,
            owner,
            key,
            request,
        } = submission;
        let Some(key) = key else {
            let end = self.run(route, None, request).await;
            return self.outcome(None, end).await;
        };
        let now = crate::clock::now();
        let identity = claim_digest_bytes(&owner, &key);
        // A repeat of a request already replayed is known by its bytes: its body is not
        // parsed into its canonical form again.
        let mut digest = None;
        if let Some((repeat, settled)) = self.store.peek_repeat(&identity, now) {
            if *digest.insert(request_digest(&request)) == repeat {
                tracing::Span::current().record("job_id", settled.job_id.as_str());
                return replayed(settled);
            }
        }
        let fingerprint = self.fingerprint(&request);
        match self.store.peek(&identity, &owner, &key, now, &fingerprint) {
            Some(Peeked::Settled(settled)) => {
                tracing::Span::current().record("job_id", settled.job_id.as_str());
                let digest = || digest.unwrap_or_else(|| request_digest(&request));
                self.store
                    .remember_repeat(&identity, &settled.job_id, &digest);
                return replayed(settled);
            }
            Some(Peeked::Record(record)) => {
                return self.existing(route, record, &fingerprint, request).await
            }
            None => {}
        }
        // The claim's state ends with its statement: held to the end of the function, its
        // records would be part of the future for as long as the job runs.
        let job = match self
            .claim(&route, owner, key, &identity, &fingerprint, now)
            .await
        {
            Ok((Claim::Created(record), first_attempt)) => {
                tracing::Span::current().record("job_id", record.job.id.as_str());
                debug!(job_id = %record.job.id, route = %route.name, "new job");
                RoundJob {
                    next_n: next_ordinal(&record),
                    id: record.job.id,
                    version: record.job.version,
                    first_attempt,
                }
            }
            Ok((Claim::Existing(record), _)) => {
                return self.existing(route, record, &fingerprint, request).await
            }
            Err(e) => {
                return Outcome::Refused {
                    job_id: None,
                    cause: Cause::Store(e),
                }
            }
        };
        self.run_job(route, job, request).await
    }

    /// Claims a new job for (owner, key) with its first attempt registered (its number, if
    /// one was), or finds the job the key names already.
    async fn claim(
        &self,
        route: &Route,
        owner: String,
        key: String,
        identity: &[u8; 32],
        fingerprint: &str,
        now: std::time::SystemTime,
    ) -> Result<(Claim, Option<u32>), StoreError> {
        let idem = &self.config.idempotency;
        let policy = Self::expiry_policy(&self.config);
        let mut record = JobRecord::new(
            job_id_for(identity),
            owner,
            key,
            fingerprint.to_owned(),
            route.name.clone(),
            now,
            now + idem.lease,
            &policy,
        );
        // The first attempt is registered with the claim: one store write for both. Not when
        // the primary's circuit is open: the round will skip it.
        let first_attempt = if self.breakers.is_closed(route.providers[0]) {
            let start = Transition::StartAttempt {
                version: record.job.version,
                n: 1,
                provider: self.config.provider(route.providers[0]).name.clone(),
            };
            match record.apply(start, now, &policy) {
                Ok(Effect::AttemptStarted { n, .. }) => Some(n),
                _ => None,
            }
        } else {
            None
        };
        let started = tokio::time::Instant::now();
        let claimed = self.store.claim_identified(identity, record, now).await;
        self.metrics.store("claim", started.elapsed());
        claimed.map(|claim| (claim, first_attempt))
    }

    /// The fingerprint of a request (SPEC §3 step 5).
    fn fingerprint(&self, request: &ClientRequest) -> String {
        crate::intent::fingerprint_of(
            request.method.as_str(),
            &request.path_and_query,
            request.content_type(),
            &request.body,
            &self.config.idempotency.fingerprint_ignore,
        )
    }

    /// A submission whose key names a live job, found by its claim or read beforehand.
    ///
    /// Boxed: waiting on a job in flight is the largest state a submission can be in, and
    /// held inline it made every submission's future — a new job's, a replay's — 4 152
    /// bytes instead of 1 168, created and moved on every request (memcpy, 5 % of a new
    /// job's samples, the largest cost after the kernel's; the request path's boxed future
    /// alone was 0.9 %).
    fn existing<'a>(
        self: &'a Arc<Self>,
        route: Arc<Route>,
        record: JobRecord,
        fingerprint: &'a str,
        request: Arc<ClientRequest>,
    ) -> std::pin::Pin<Box<dyn Future<Output = Outcome> + Send + 'a>> {
        Box::pin(async move {
            tracing::Span::current().record("job_id", record.job.id.as_str());
            self.resolve(route, record, fingerprint, request).await
        })
    }

    /// A claim found an existing job: SPEC §3 step 6, looping while the job is in flight.
    async fn resolve(
        self: &Arc<Self>,
        route: Arc<Route>,
        mut record: JobRecord,
        fingerprint: &str,
        request: Arc<ClientRequest>,
    ) -> Outcome {
        let idem = &self.config.idempotency;
        let deadline = tokio::time::Instant::now() + idem.wait_for_in_flight;
        loop {
            let id = record.job.id.clone();
            let now = crate::clock::now();
            let store_failed = |e| Outcome::refused(&id, Cause::Store(e));
            match record.classify(fingerprint, now) {
                Found::Conflict => return Outcome::refused(&id, Cause::KeyReused),
                Found::Replay => return replay(record),
                Found::Unknown => return Outcome::refused(&id, Cause::Unknown),
                Found::LeaseLapsed => {
                    let version = record.job.version;
                    let applied = match self.apply(&id, Transition::ExpireLease { version }).await {
                        Ok(applied) => applied,
                        Err(e) => return store_failed(e),
                    };
                    if matches!(applied.outcome, Ok(Effect::Applied)) {
                        self.metrics.lease_expired();
                        warn!(job_id = %id, "job's lease lapsed (its gateway stopped); the job is unknown");
                    }
                    record = applied.record;
                }
                Found::InFlight => {
                    if let Some(live) = self.streams.joinable(&id) {
                        // A duplicate of a live stream gets what was recorded, then follows.
                        return Outcome::Stream {
                            job_id: Some(id),
                            live,
                            joined: true,
                        };
                    }
                    // Whether a stream elsewhere is still to show up in the store's mirror.
                    let mut mirror_due = false;
                    if let Some(streaming) = record.job.completed_by {
                        // Streaming on another gateway: follow its mirror in the store.
                        match self.store.read_stream(&id, 0).await {
                            Ok(Some(mirror)) if mirror.head.n == streaming => {
                                if !matches!(mirror.end, Some(Err(_))) {
                                    return Outcome::Follow { job_id: id, mirror };
                                }
                                // Cut: its job is about to fail, which wakes this wait;
                                // then it re-opens, rather than relay a broken answer.
                                // Looked at again at a follower's pace all the same: a
                                // mirror that shows a cut it should not (an earlier
                                // attempt's late write) then costs a poll, not the wait.
                                mirror_due = true;
                            }
                            // Not mirrored yet, or the mirror is still an earlier attempt's:
                            // the job does not change when the head is written, so look
                            // again as a follower polls, instead of waiting for the job.
                            Ok(_) => mirror_due = true,
                            Err(e) => return store_failed(e),
                        }
                    }
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if left.is_zero() {
                        return Outcome::refused(&id, Cause::InProgress);
                    }
                    // Wake at the latest when the lease would lapse, to notice a dead gateway.
                    let lease_left = record
                        .job
                        .lease_until
                        .duration_since(now)
                        .unwrap_or_default();
                    let mut wait = left.min(lease_left + Duration::from_millis(5));
                    if mirror_due {
                        wait = wait.min(crate::stream::FOLLOW_LAG);
                    }
                    record = match self
                        .store
                        .wait_change(&id, record.job.version, record.job.state, wait)
                        .await
                    {
                        Ok(record) => record,
                        Err(e) => return store_failed(e),
                    };
                }
                Found::Reopenable { version } => {
                    let lease_until = reopen_lease(now, idem.lease);
                    let reopen = Transition::Reopen {
                        version,
                        lease_until,
                    };
                    let applied = match self.apply(&id, reopen).await {
                        Ok(applied) => applied,
                        Err(e) => return store_failed(e),
                    };
                    if applied.outcome.is_ok() {
                        debug!(job_id = %id, version = applied.record.job.version, "job re-opened for a new round");
                        let job = RoundJob {
                            id,
                            version: applied.record.job.version,
                            first_attempt: None,
                            next_n: next_ordinal(&applied.record),
                        };
                        return self.run_job(route, job, request).await;
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
    ) -> Outcome {
        let id = job.id.clone();
        let end = self.run(route, Some(job), request).await;
        self.outcome(Some(id), end).await
    }

    /// Runs a round in its own task, so that a client hanging up cannot abandon the job.
    pub async fn run(
        self: &Arc<Self>,
        route: Arc<Route>,
        job: Option<RoundJob>,
        request: Arc<ClientRequest>,
    ) -> RoundEnd {
        let engine = self.clone();
        let task = self.spawn(async move {
            // Removed however the round ends, so the map cannot grow with abandoned rounds.
            let _registered = job.as_ref().map(|job| RoundRegistration::new(&engine, job));
            round::run_round(engine.clone(), route, job, request).await
        });
        match task.await {
            Ok(Some(end)) => end,
            Ok(None) => RoundEnd::Internal("the gateway is stopping".into()),
            Err(e) => {
                if e.is_panic() {
                    self.metrics.panicked();
                }
                RoundEnd::Internal(format!("a round task failed: {e}"))
            }
        }
    }

    /// What a round's end means for the request that ran it.
    async fn outcome(&self, job_id: Option<JobId>, end: RoundEnd) -> Outcome {
        let cause = match end {
            RoundEnd::Won {
                response,
                n,
                provider,
            }
            | RoundEnd::Failed {
                last: Some((response, n, provider)),
            } => {
                return Outcome::Answer {
                    job_id,
                    response,
                    n,
                    provider,
                    replayed: false,
                    head: None,
                }
            }
            RoundEnd::Streaming(live) => {
                return Outcome::Stream {
                    job_id,
                    live,
                    joined: false,
                }
            }
            RoundEnd::Failed { last: None } => Cause::AllFailed,
            RoundEnd::Unknown => Cause::TimedOut,
            RoundEnd::Store(e) => Cause::Store(e),
            RoundEnd::Unrecorded(e) => Cause::Unrecorded(e),
            RoundEnd::Internal(what) => Cause::Internal(what),
            RoundEnd::Settled => match &job_id {
                Some(id) => return self.settled(id).await,
                None => Cause::AllFailed,
            },
        };
        Outcome::Refused { job_id, cause }
    }

    /// The answer for a round whose job was settled by someone else.
    async fn settled(&self, id: &str) -> Outcome {
        let record = match self.store.get(id).await {
            Ok(Some(record)) => record,
            Ok(None) => return Outcome::refused(id, Cause::Store(StoreError::NotFound(id.into()))),
            Err(e) => return Outcome::refused(id, Cause::Store(e)),
        };
        let cause = match record.job.state {
            JobState::Succeeded => return replay(record),
            JobState::Cancelled => Cause::Cancelled,
            JobState::Unknown => Cause::Unknown,
            JobState::Failed => Cause::Failed,
            JobState::InProgress => Cause::InProgress,
        };
        Outcome::refused(id, cause)
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

    fn lock_rounds(&self) -> std::sync::MutexGuard<'_, Rounds> {
        self.rounds.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Running rounds by job id, with the version each read. Hashed with foldhash, not SipHash:
/// an entry is made and removed by every new job, and ids are minted by the gateway (a
/// digest and random bits), so a client cannot aim them at one bucket.
type Rounds = HashMap<JobId, u64, foldhash::fast::RandomState>;

/// A round's entry in [`Engine::rounds`], removed when the round's task ends or is dropped.
struct RoundRegistration<'a> {
    engine: &'a Engine,
    id: JobId,
}

impl<'a> RoundRegistration<'a> {
    fn new(engine: &'a Engine, job: &RoundJob) -> Self {
        engine.lock_rounds().insert(job.id.clone(), job.version);
        Self {
            engine,
            id: job.id.clone(),
        }
    }
}

impl Drop for RoundRegistration<'_> {
    fn drop(&mut self) {
        self.engine.lock_rounds().remove(&self.id);
    }
}

/// The lease a re-open writes, which is also how a retry of that re-open knows it applied
/// (`Transition::Reopen`): two clients' retries re-opening one job at the same instant, on
/// two gateways or under a paused clock, would otherwise share it, each take the other's
/// re-open for its own, and both run a round (seen in the simulation: two calls for one
/// attempt, and the loser's body served). Up to a millisecond of random nanoseconds on a
/// lease of seconds sets them apart.
fn reopen_lease(now: SystemTime, lease: Duration) -> SystemTime {
    now + lease + Duration::from_nanos(fastrand::u64(..1_000_000))
}

/// The ordinal of a job's next attempt.
fn next_ordinal(record: &JobRecord) -> u32 {
    record.attempts.last().map_or(1, |a| a.n + 1)
}

/// [`crate::intent::request_digest`] of a client's request.
fn request_digest(request: &ClientRequest) -> [u8; 32] {
    crate::intent::request_digest(
        request.method.as_str(),
        &request.path_and_query,
        request.content_type(),
        &request.body,
    )
}

/// A settled job's answer, replayed.
fn replayed(settled: Settled) -> Outcome {
    Outcome::Answer {
        job_id: Some(settled.job_id),
        response: settled.response,
        n: settled.n,
        provider: settled.provider,
        replayed: true,
        head: settled.head,
    }
}

/// A settled job's stored answer, or why there is none to give.
fn replay(record: JobRecord) -> Outcome {
    if let Some(settled) = record.settled() {
        return replayed(settled);
    }
    let cause = match &record.job.response {
        Some(response) if response.body_omitted => Cause::NotStored,
        _ => Cause::Internal("a settled job has no stored answer".into()),
    };
    Outcome::refused(&record.job.id, cause)
}

#[cfg(test)]
mod tests;
