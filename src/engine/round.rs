//! One round of attempts at a job (SPEC §4): primary, failover, timeout, hedge, late answers.
//!
//! A round runs in its own task, so a client that hangs up does not abandon the job half
//! way. Each attempt settles *itself* in the store — a win by compare-and-swap, a failure,
//! an `unknown` — then reports to the round. That is what lets an attempt outlive its
//! round: after a timeout the round answers `outcome-unknown` and ends, while the attempt
//! keeps waiting for its late answer (up to `late_result_window`) and settles the job
//! through the same compare-and-swap when it lands.
//!
//! One attempt at a time is polled by the round's own task ([`Inline`]), the others run in
//! tasks of their own: most jobs have exactly one attempt, and its task was a spawn, two
//! boxes and a wake-up across tasks per new job. An inline attempt the round ends without
//! is handed to a task of its own then, so it outlives the round as a spawned one does.

use std::collections::BTreeMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use sync_wrapper::SyncWrapper;
use tokio::sync::mpsc;
use tokio::time::{sleep_until, Instant};
use tracing::{debug, info, warn};

use super::Engine;
use crate::config::Route;
use crate::job::{Effect, Failure, JobId, StoredResponse, Transition};
use crate::store::{Applied, StoreError};
use crate::stream::LiveStream;
use crate::upstream::ClientRequest;

use super::attempt::{AttemptTask, Done, Event};

/// The job a round works for, and the version the round read when it opened.
#[derive(Clone, Debug)]
pub struct RoundJob {
    pub id: JobId,
    pub version: u64,
    /// The round's first attempt when it was registered with the claim itself, which saves
    /// a store round trip on every new job.
    pub first_attempt: Option<u32>,
    /// The ordinal the round's next attempt takes: what a `StartAttempt` expects, so that
    /// applying it twice starts one attempt.
    pub next_n: u32,
}

/// How a round ended, from the point of view of the request that ran it.
#[derive(Debug)]
pub enum RoundEnd {
    /// An attempt of this round completed the job with this answer.
    Won {
        response: StoredResponse,
        n: u32,
        provider: String,
    },
    /// Somebody else settled the job (another attempt's late answer, or a cancel): the
    /// answer, if any, is in the store.
    Settled,
    /// Every provider definitely failed; `last` is the last upstream answer, if any.
    Failed {
        last: Option<(StoredResponse, u32, String)>,
    },
    /// No attempt is running and at least one timed out.
    Unknown,
    /// An attempt of this round holds the result slot and is relaying a stream.
    Streaming(LiveStream),
    /// The store failed before any provider was called for this round's next step.
    Store(StoreError),
    /// A provider was called but the store could not record what came of it.
    Unrecorded(StoreError),
    /// The round's task failed or was stopped: a bug, or a gateway going down.
    Internal(String),
}

/// An attempt as its round sees it.
#[derive(Debug)]
struct Live {
    provider: String,
    /// Index into the config's providers.
    index: usize,
    started: Instant,
    deadline: Option<Instant>,
    first_byte: bool,
    timed_out: bool,
    /// The attempt's task, dropped (its call with it) when no late answer may be awaited;
    /// `None` for the attempt the round polls itself ([`Round::inline`]).
    task: Option<tokio::task::AbortHandle>,
    /// Held by the attempt's task while it runs; counts it once it waits for a late answer.
    late: Arc<super::LateSlot>,
}

/// An attempt polled by its round's task rather than spawned. Dropped while its call still
/// runs — the round ended, or was dropped — it is handed to a task of its own, as if it had
/// been spawned; [`Inline::cancel`] drops the call instead.
struct Inline {
    n: u32,
    /// Only ever reached through `&mut`: a round shares itself across its awaits, and a
    /// call need not be `Sync`.
    call: Option<SyncWrapper<Pin<Box<dyn Future<Output = ()> + Send>>>>,
    engine: Arc<Engine>,
}

impl Inline {
    /// Taken out while it is polled: a call that panics is dropped as the round unwinds,
    /// never handed to a task to be polled again.
    fn poll_call(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let Some(mut call) = self.call.take() else {
            return Poll::Ready(());
        };
        let polled = call.get_mut().as_mut().poll(cx);
        if polled.is_pending() {
            self.call = Some(call);
        }
        polled
    }

    /// Ends the call without a late answer.
    fn cancel(mut self) {
        self.call = None;
    }
}

impl Drop for Inline {
    fn drop(&mut self) {
        let Some(call) = self.call.take() else {
            return;
        };
        // Outside a runtime (one shutting down drops its tasks) nothing could poll it.
        if tokio::runtime::Handle::try_current().is_ok() {
            drop(self.engine.spawn(call.into_inner()));
        }
    }
}

struct Round {
    engine: Arc<Engine>,
    route: Arc<Route>,
    job: Option<RoundJob>,
    request: Arc<ClientRequest>,
    events: mpsc::UnboundedSender<Event>,
    /// Next index into `route.providers`.
    cursor: usize,
    /// Ordinals of keyless attempts, which have no store to count them.
    local_n: u32,
    live: BTreeMap<u32, Live>,
    /// The attempt this task polls, if one of `live` is.
    inline: Option<Inline>,
    last_failure: Option<(StoredResponse, u32, String)>,
    /// The provider whose attempt failed last, and the `Retry-After` it asked for: a retry
    /// of that same provider waits for it.
    last_failed: Option<(usize, Option<Duration>)>,
    /// Retries of one provider in a row, for the backoff.
    retries: u32,
    /// When the next attempt starts, if it waits for a backoff or a `Retry-After`.
    pending: Option<Instant>,
    no_more_attempts: bool,
}

/// Runs a round to its end. `job` is `None` for a keyless request on an `optional` route:
/// the same attempts, but nothing claimed or stored.
pub(super) async fn run_round(
    engine: Arc<Engine>,
    route: Arc<Route>,
    job: Option<RoundJob>,
    request: Arc<ClientRequest>,
) -> RoundEnd {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let lease = engine.config.idempotency.lease;
    let mut round = Round {
        engine,
        route,
        job,
        request,
        events: tx,
        cursor: 0,
        local_n: 0,
        live: BTreeMap::new(),
        inline: None,
        last_failure: None,
        last_failed: None,
        retries: 0,
        pending: None,
        no_more_attempts: false,
    };
    let registered = round.job.as_ref().and_then(|j| j.first_attempt);
    if let Err(end) = round.start_next(registered).await {
        return end;
    }
    if let Err(end) = round.advance().await {
        return end;
    }
    // One timer for all of the round's deadlines, reset to the earliest. A timer of each
    // deadline's own (the provider's timeout, the hedge, a retry's backoff, the lease's
    // renewal), made anew at each turn of the loop, disabled ones included, and put in the
    // wheel and taken out again, cost 1.2 % of a new job's instructions.
    let renewal = lease / 3;
    let mut renew_at = Instant::now() + renewal;
    let timer = sleep_until(renew_at);
    tokio::pin!(timer);
    loop {
        let timeout_at = round.next_timeout();
        let hedge_at = round.next_hedge();
        let pending_at = round.pending;
        let wake_at = [timeout_at, hedge_at, pending_at]
            .into_iter()
            .flatten()
            .fold(renew_at, Instant::min);
        if timer.deadline() != wake_at {
            timer.as_mut().reset(wake_at);
        }
        tokio::select! {
            // Fixed priority: answers before timers, so a run replays exactly under paused time.
            biased;
            Some(event) = rx.recv() => match event {
                Event::FirstByte(n) => {
                    if let Some(live) = round.live.get_mut(&n) {
                        live.first_byte = true;
                    }
                }
                Event::Streaming(stream) => return RoundEnd::Streaming(stream),
                Event::Done(n, done) => {
                    if let Some(end) = round.on_done(n, done) {
                        return end;
                    }
                }
            },
            // The call reports through `rx` before it ends.
            () = poll_fn(|cx| poll_inline(&mut round.inline, cx)), if round.inline.is_some() => {
                round.inline = None;
            }
            () = &mut timer => {
                // The timer fired at the earliest deadline; of those due, in this order, one
                // is handled per turn, the next at the next turn.
                let now = Instant::now();
                let due = |at: Option<Instant>| at.is_some_and(|at| at <= now);
                if due(timeout_at) {
                    if let Err(end) = round.on_timeouts().await {
                        return end;
                    }
                } else if due(hedge_at) {
                    debug!(route = %round.route.name, "hedging: attempt in flight is silent");
                    // A hedge goes somewhere else: past entries whose provider is already
                    // running an attempt of this job (a retry of the silent primary is no
                    // hedge).
                    round.cursor = round.next_idle_step().unwrap_or(round.route.providers.len());
                    if let Err(end) = round.start_next(None).await {
                        return end;
                    }
                } else if due(pending_at) {
                    round.pending = None;
                    if let Err(end) = round.start_next(None).await {
                        return end;
                    }
                } else if renew_at <= now {
                    round.renew_lease().await;
                    renew_at = now + renewal;
                }
            }
        }
        if let Err(end) = round.advance().await {
            return end;
        }
    }
}

/// A provider's `Retry-After`: delta-seconds or an HTTP date.
fn retry_after(headers: &crate::job::Headers) -> Option<Duration> {
    let value = headers.get("retry-after")?;
    let value = std::str::from_utf8(&value).ok()?.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(crate::clock::now()).unwrap_or_default())
}

/// Ends attempt `n`'s call without a late answer: its task, or the round's inline call.
fn drop_call(n: u32, task: &Option<tokio::task::AbortHandle>, inline: &mut Option<Inline>) {
    match task {
        Some(task) => task.abort(),
        None => {
            if let Some(call) = inline.take_if(|i| i.n == n) {
                call.cancel();
            }
        }
    }
}

/// Polls the round's inline attempt; pending while there is none.
fn poll_inline(inline: &mut Option<Inline>, cx: &mut Context<'_>) -> Poll<()> {
    inline
        .as_mut()
        .map_or(Poll::Pending, |inline| inline.poll_call(cx))
}

impl Round {
    fn job_id(&self) -> Option<&str> {
        self.job.as_ref().map(|j| j.id.as_str())
    }

    async fn apply(&self, transition: Transition) -> Result<Applied, StoreError> {
        let job = self
            .job
            .as_ref()
            .expect("only job rounds apply transitions");
        self.engine.apply(&job.id, transition).await
    }

    /// Starts the attempt at the next provider of the route; `registered` is its ordinal
    /// when the store already holds it.
    async fn start_next(&mut self, mut registered: Option<u32>) -> Result<(), RoundEnd> {
        // Skipped providers (open circuit, failed probe) count as definite failures of their
        // step: the round moves on at once.
        let (index, provider) = loop {
            let Some(&index) = self.route.providers.get(self.cursor) else {
                if let Some(n) = registered {
                    self.record_skip(n, "no provider left to try").await?;
                }
                return Ok(());
            };
            let step = self.cursor;
            self.cursor += 1;
            let provider = self.engine.config().provider(index).clone();
            let unproven = step > 0
                && self.route.failover_requires_probe
                && !self.engine.probes.passed(&self.route.name, index);
            let skip = if unproven {
                Some("its last probe failed")
            } else if !self.engine.breakers.try_acquire(index) {
                Some("its circuit is open")
            } else {
                None
            };
            match skip {
                None => break (index, provider),
                Some(why) => {
                    info!(job_id = self.job_id(), provider = %provider.name, why, "provider skipped");
                    if let Some(n) = registered.take() {
                        self.record_skip(n, &format!("skipped: {why}")).await?;
                    }
                }
            }
        };
        let n = match (registered, &self.job) {
            (Some(n), _) => n,
            (None, None) => {
                self.local_n += 1;
                self.local_n
            }
            (None, Some(job)) => {
                let applied = self
                    .apply(Transition::StartAttempt {
                        version: job.version,
                        n: job.next_n,
                        provider: provider.name.clone(),
                    })
                    .await
                    .map_err(RoundEnd::Store)?;
                match applied.outcome {
                    Ok(Effect::AttemptStarted { n, .. }) => {
                        if let Some(job) = &mut self.job {
                            job.next_n = n + 1;
                        }
                        n
                    }
                    // The job moved on without this round (cancelled out of band).
                    _ => return Err(RoundEnd::Settled),
                }
            }
        };
        debug!(job_id = self.job_id(), attempt = n, provider = %provider.name, "attempt started");
        let now = Instant::now();
        let attempt = AttemptTask {
            engine: self.engine.clone(),
            route: self.route.clone(),
            job_id: self.job.as_ref().map(|j| j.id.clone()),
            version: self.job.as_ref().map_or(0, |j| j.version),
            n,
            provider_index: index,
            request: self.request.clone(),
            events: self.events.clone(),
        };
        // Its own span, not the request's: an attempt may outlive the request that started it.
        let span = tracing::debug_span!("attempt", job_id = self.job_id(), attempt = n, provider = %provider.name);
        let late = self.engine.late_slot();
        let held = late.clone();
        let call = tracing::Instrument::instrument(
            async move {
                let _held = held;
                attempt.run().await;
            },
            span,
        );
        let task = if self.inline.is_none() {
            self.inline = Some(Inline {
                n,
                call: Some(SyncWrapper::new(Box::pin(call))),
                engine: self.engine.clone(),
            });
            None
        } else {
            Some(self.engine.spawn(call).abort_handle())
        };
        self.live.insert(
            n,
            Live {
                provider: provider.name.clone(),
                index,
                started: now,
                deadline: Some(now + provider.timeout),
                first_byte: false,
                timed_out: false,
                task,
                late,
            },
        );
        Ok(())
    }

    /// The attempt registered with the claim could not start: record why.
    async fn record_skip(&self, n: u32, why: &str) -> Result<(), RoundEnd> {
        if self.job.is_some() {
            self.apply(Transition::FailAttempt {
                n,
                kind: Failure::Failed,
                upstream_status: None,
                error: Some(why.to_owned()),
            })
            .await
            .map_err(RoundEnd::Store)?;
        }
        Ok(())
    }

    /// Full-jitter exponential backoff between retries of one provider, capped by the
    /// route's `max_retry_after`.
    fn backoff(&self) -> Duration {
        let base = Duration::from_millis(100) * 2u32.saturating_pow(self.retries.min(10));
        let cap = base.min(self.route.max_retry_after);
        cap.mul_f64(0.5 + fastrand::f64() / 2.0)
    }

    fn running(&self) -> impl Iterator<Item = (&u32, &Live)> {
        self.live.iter().filter(|(_, l)| !l.timed_out)
    }

    fn next_timeout(&self) -> Option<Instant> {
        self.running().filter_map(|(_, l)| l.deadline).min()
    }

    /// When to start a hedged attempt: the newest running attempt has been silent for
    /// `hedge_after` (headers alone are not an answer).
    /// The next step of the route, from the cursor, whose provider is not running an
    /// attempt of this job.
    fn next_idle_step(&self) -> Option<usize> {
        (self.cursor..self.route.providers.len()).find(|&step| {
            let index = self.route.providers[step];
            !self.running().any(|(_, live)| live.index == index)
        })
    }

    fn next_hedge(&self) -> Option<Instant> {
        let hedge_after = self.route.hedge_after?;
        if self.no_more_attempts || self.next_idle_step().is_none() {
            return None;
        }
        let (_, newest) = self.running().last()?;
        (!newest.first_byte).then(|| newest.started + hedge_after)
    }

    fn on_done(&mut self, n: u32, done: Done) -> Option<RoundEnd> {
        let live = self.live.remove(&n)?;
        match done {
            Done::Won(response) => Some(RoundEnd::Won {
                response,
                n,
                provider: live.provider,
            }),
            Done::Lost | Done::Discarded => Some(RoundEnd::Settled),
            // The attempt reached its provider: its answer is lost to the store, not unsent.
            Done::Store(e) => Some(RoundEnd::Unrecorded(e)),
            Done::Failed { response, failover } => {
                let retry_after = response.as_ref().and_then(|r| retry_after(&r.headers));
                self.last_failed = Some((live.index, retry_after));
                if let Some(response) = response {
                    self.last_failure = Some((response, n, live.provider));
                }
                if !failover {
                    self.no_more_attempts = true;
                }
                None
            }
            Done::Unknown => {
                // A broken response or a 504: this attempt's outcome is unknown, and so no
                // further attempt may start.
                self.no_more_attempts = true;
                self.live.insert(
                    n,
                    Live {
                        timed_out: true,
                        deadline: None,
                        ..live
                    },
                );
                None
            }
        }
    }

    async fn on_timeouts(&mut self) -> Result<(), RoundEnd> {
        let now = Instant::now();
        let due: Vec<u32> = self
            .running()
            .filter(|(_, l)| l.deadline.is_some_and(|d| d <= now))
            .map(|(n, _)| *n)
            .collect();
        for n in due {
            let marked = match &self.job {
                None => true,
                Some(_) => {
                    let applied = self
                        .apply(Transition::AttemptUnknown {
                            n,
                            error: "no response within the provider's timeout".into(),
                        })
                        .await
                        .map_err(RoundEnd::Store)?;
                    // Discarded: the attempt settled a moment ago; its report is on the way.
                    matches!(applied.outcome, Ok(Effect::Applied))
                }
            };
            let job_id = self.job.as_ref().map(|j| j.id.clone());
            let live = self.live.get_mut(&n).expect("due attempts are live");
            live.deadline = None;
            if marked {
                self.engine.metrics.attempt(&live.provider, "unknown");
                live.timed_out = true;
                self.no_more_attempts = true;
                if live.late.admit() {
                    warn!(job_id, attempt = n, provider = %live.provider,
                        "attempt timed out; its outcome is unknown and its call is kept for a late answer");
                } else {
                    // Memory stays bounded: the attempt stays unknown for an operator.
                    drop_call(n, &live.task, &mut self.inline);
                    self.engine.metrics.late_result_dropped();
                    warn!(job_id, attempt = n, provider = %live.provider,
                        "attempt timed out; late_result_max calls already wait for late answers, so this one is dropped and the job stays unknown");
                }
            }
        }
        Ok(())
    }

    /// Decides what follows once no attempt is running.
    async fn advance(&mut self) -> Result<(), RoundEnd> {
        if self.running().next().is_some() || self.pending.is_some() {
            return Ok(());
        }
        let any_unknown = self.live.values().any(|l| l.timed_out);
        if any_unknown {
            return Err(self.end_unknown().await);
        }
        if !self.no_more_attempts && self.cursor < self.route.providers.len() {
            let providers = &self.route.providers;
            if let Some((failed, retry_after)) = self.last_failed.take() {
                // A retry of the provider that just failed waits for its Retry-After, unless
                // that is longer than the route accepts: then the retry is skipped.
                if retry_after.is_some_and(|after| after > self.route.max_retry_after) {
                    while providers.get(self.cursor) == Some(&failed) {
                        self.cursor += 1;
                    }
                } else if providers.get(self.cursor) == Some(&failed) {
                    let delay = retry_after.unwrap_or_else(|| self.backoff());
                    self.retries += 1;
                    debug!(
                        job_id = self.job_id(),
                        ?delay,
                        "retrying the same provider after a pause"
                    );
                    self.pending = Some(Instant::now() + delay);
                    return Ok(());
                } else {
                    self.retries = 0;
                }
            }
            self.start_next(None).await?;
            if self.running().next().is_some() {
                return Ok(());
            }
        }
        Err(self.end_failed().await)
    }

    async fn end_unknown(&mut self) -> RoundEnd {
        let Some(job) = &self.job else {
            return RoundEnd::Unknown;
        };
        match self
            .apply(Transition::MarkUnknown {
                version: job.version,
            })
            .await
        {
            Ok(Applied { outcome: Ok(_), .. }) => {
                warn!(job_id = %job.id, "job is unknown: an attempt timed out and none is left running");
                RoundEnd::Unknown
            }
            // A late answer (or a cancel) got there first.
            Ok(_) => RoundEnd::Settled,
            Err(e) => RoundEnd::Store(e),
        }
    }

    async fn end_failed(&mut self) -> RoundEnd {
        let last = self.last_failure.take();
        let Some(job) = &self.job else {
            return RoundEnd::Failed { last };
        };
        match self
            .apply(Transition::FailRound {
                version: job.version,
            })
            .await
        {
            Ok(Applied { outcome: Ok(_), .. }) => {
                info!(job_id = %job.id, "every provider failed; the job is failed and may be retried");
                RoundEnd::Failed { last }
            }
            Ok(_) => RoundEnd::Settled,
            Err(e) => RoundEnd::Store(e),
        }
    }

    async fn renew_lease(&self) {
        let Some(job) = &self.job else { return };
        let until = crate::clock::now() + self.engine.config().idempotency.lease;
        let renewed = self
            .apply(Transition::RenewLease {
                version: job.version,
                until,
            })
            .await;
        if let Err(e) = renewed {
            warn!(job_id = %job.id, error = %e, "could not renew the job's lease");
        }
    }
}
