//! Rounds run from an engine alone: a scripted in-process transport, the memory store, no
//! listener, no `Gateway`, under paused time.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, Method, Request, Response};

use super::{Engine, Outcome, Submission};
use crate::body::{self, Body};
use crate::config::Config;
use crate::error::Cause;
use crate::job::{AttemptState, JobState};
use crate::store::memory::MemoryStore;
use crate::store::JobStore;
use crate::upstream::{ClientRequest, Exchange, Transport, Upstream};

/// What a scripted provider does with every call: answer with a status after a delay.
#[derive(Clone, Copy, Debug)]
struct Script {
    status: u16,
    after: Duration,
}

#[derive(Debug)]
struct Scripted {
    scripts: Vec<Script>,
    calls: Vec<AtomicUsize>,
}

impl Scripted {
    fn new(scripts: Vec<Script>) -> Arc<Self> {
        let calls = scripts.iter().map(|_| AtomicUsize::new(0)).collect();
        Arc::new(Self { scripts, calls })
    }

    fn calls(&self) -> Vec<usize> {
        self.calls
            .iter()
            .map(|c| c.load(Ordering::SeqCst))
            .collect()
    }
}

impl Transport for Scripted {
    fn send(&self, index: usize, _request: Request<Body>) -> Exchange {
        self.calls[index].fetch_add(1, Ordering::SeqCst);
        let script = self.scripts[index];
        Box::pin(async move {
            tokio::time::sleep(script.after).await;
            assert_ne!(script.status, PANICS, "the scripted provider panics");
            let mut response = Response::new(body::full(format!("{{\"from\":{index}}}")));
            *response.status_mut() = http::StatusCode::from_u16(script.status).unwrap();
            response
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok(response)
        })
    }
}

fn engine(route_extra: &str, scripts: Vec<Script>) -> (Arc<Engine>, Arc<Scripted>) {
    engine_with("", route_extra, scripts)
}

/// An engine whose `[idempotency]` table also holds `idempotency_extra`.
fn engine_with(
    idempotency_extra: &str,
    route_extra: &str,
    scripts: Vec<Script>,
) -> (Arc<Engine>, Arc<Scripted>) {
    let text = format!(
        "[store]\nkind = \"memory\"\n[idempotency]\nowner = \"anonymous\"\n{idempotency_extra}\n\
         [[providers]]\nname = \"primary\"\nbase_url = \"http://primary\"\ntimeout = \"2s\"\n\
         [[providers]]\nname = \"fallback\"\nbase_url = \"http://fallback\"\ntimeout = \"2s\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\", \"fallback\"]\n{route_extra}\n"
    );
    let config = Arc::new(Config::parse(&text, "test").unwrap());
    let store: Arc<dyn JobStore> = Arc::new(MemoryStore::new(Engine::expiry_policy(&config)));
    let transport = Scripted::new(scripts);
    let engine = Engine::new(config, store, Upstream::with_transport(transport.clone()));
    (engine, transport)
}

async fn submit(engine: &Arc<Engine>, key: &str) -> Outcome {
    let config = engine.config();
    let body = bytes::Bytes::from_static(b"{\"prompt\":1}");
    let request = ClientRequest::new(
        Method::POST,
        "/v1/chat".into(),
        HeaderMap::new(),
        body,
        &config.idempotency.header,
    );
    engine
        .submit(Submission {
            route: config.routes[0].clone(),
            owner: "owner".into(),
            key: Some(key.into()),
            request: Arc::new(request),
        })
        .await
}

fn answered(outcome: &Outcome) -> (String, u32, bool) {
    match outcome {
        Outcome::Answer {
            job_id,
            n,
            replayed,
            response,
            ..
        } => {
            assert_eq!(response.status, 200);
            (job_id.clone().unwrap(), *n, *replayed)
        }
        other => panic!("expected an answer, got {other:?}"),
    }
}

async fn attempts(engine: &Engine, id: &str) -> (JobState, Vec<AttemptState>) {
    let record = engine.store().get(id).await.unwrap().unwrap();
    let states = record.attempts.iter().map(|a| a.state).collect();
    (record.job.state, states)
}

/// A [`Script`] status whose call panics instead of answering.
const PANICS: u16 = 0;

const fn script(status: u16, millis: u64) -> Script {
    Script {
        status,
        after: Duration::from_millis(millis),
    }
}

#[tokio::test(start_paused = true)]
async fn a_definite_failure_fails_over_to_the_next_provider() {
    let (engine, providers) = engine("", vec![script(503, 100), script(200, 100)]);
    let (id, n, replayed) = answered(&submit(&engine, "k").await);
    assert_eq!((n, replayed), (2, false));
    assert_eq!(providers.calls(), [1, 1]);
    assert_eq!(
        attempts(&engine, &id).await,
        (
            JobState::Succeeded,
            vec![AttemptState::Failed, AttemptState::Succeeded]
        )
    );
}

#[tokio::test(start_paused = true)]
async fn a_timeout_is_unknown_blocks_attempts_and_its_late_answer_settles_the_job() {
    let (engine, providers) = engine("", vec![script(200, 5_000), script(200, 100)]);
    let id = match submit(&engine, "k").await {
        Outcome::Refused {
            job_id: Some(id),
            cause: Cause::TimedOut,
        } => id,
        other => panic!("expected a timeout, got {other:?}"),
    };
    assert_eq!(
        attempts(&engine, &id).await,
        (JobState::Unknown, vec![AttemptState::Unknown])
    );
    // A retry while it is unknown makes no attempt.
    assert!(matches!(
        submit(&engine, "k").await,
        Outcome::Refused {
            cause: Cause::Unknown,
            ..
        }
    ));
    assert_eq!(providers.calls(), [1, 0]);
    // The late answer lands (5 s after it was sent) and settles the job.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        attempts(&engine, &id).await,
        (JobState::Succeeded, vec![AttemptState::Succeeded])
    );
    let (replayed_id, n, replayed) = answered(&submit(&engine, "k").await);
    assert_eq!((replayed_id, n, replayed), (id, 1, true));
    assert_eq!(providers.calls(), [1, 0]);
}

/// The round renews its job's lease every third of `lease` for as long as its call runs,
/// again after each renewal, so a call longer than the lease is never taken for a crash.
#[tokio::test(start_paused = true)]
async fn a_long_call_keeps_its_job_leased_renewal_after_renewal() {
    // lease 1.5 s: renewed at 0.5, 1.0 and 1.5 s into a call that answers at 1.8 s.
    let (engine, providers) = engine_with(
        "lease = \"1500ms\"",
        "",
        vec![script(200, 1_800), script(200, 100)],
    );
    let running = tokio::spawn({
        let engine = engine.clone();
        async move { submit(&engine, "k").await }
    });
    let lease_left = || async {
        let record = engine.store().find("owner", "k").await.unwrap().unwrap();
        assert_eq!(record.job.state, JobState::InProgress);
        record
            .job
            .lease_until
            .duration_since(crate::clock::now())
            .unwrap_or_default()
    };
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    // Without renewal 0.3 s would be left; after only the first, 0.8 s; after the second
    // (at 1.0 s), 1.3 s.
    let left = lease_left().await;
    assert!(
        left > Duration::from_millis(1_000),
        "lease not renewed twice: {left:?} left"
    );
    // After the third (at 1.5 s), 1.4 s.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let left = lease_left().await;
    assert!(
        left > Duration::from_millis(1_300),
        "lease not renewed three times: {left:?} left"
    );
    let (id, n, replayed) = answered(&running.await.unwrap());
    assert_eq!((n, replayed), (1, false));
    assert_eq!(
        attempts(&engine, &id).await,
        (JobState::Succeeded, vec![AttemptState::Succeeded])
    );
    assert_eq!(providers.calls(), [1, 0]);
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_call_beyond_late_result_max_is_dropped_and_its_job_stays_unknown() {
    let (engine, providers) = engine_with(
        "late_result_max = 1",
        "",
        vec![script(200, 5_000), script(200, 100)],
    );
    let mut ids = Vec::new();
    for key in ["kept", "dropped"] {
        match submit(&engine, key).await {
            Outcome::Refused {
                job_id: Some(id),
                cause: Cause::TimedOut,
            } => ids.push(id),
            other => panic!("expected a timeout, got {other:?}"),
        }
    }
    assert_eq!(providers.calls(), [2, 0]);
    assert_eq!(engine.late_results_waiting(), 1);
    // Both late answers would have landed by now; only the kept call was there to take one.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(
        attempts(&engine, &ids[0]).await,
        (JobState::Succeeded, vec![AttemptState::Succeeded])
    );
    assert_eq!(
        attempts(&engine, &ids[1]).await,
        (JobState::Unknown, vec![AttemptState::Unknown])
    );
    assert_eq!(engine.late_results_waiting(), 0);
}

#[tokio::test(start_paused = true)]
async fn an_attempt_that_panics_ends_its_request_as_internal_and_is_counted() {
    let (engine, providers) = engine("", vec![script(PANICS, 100), script(200, 100)]);
    let id = match submit(&engine, "k").await {
        Outcome::Refused {
            job_id: Some(id),
            cause: Cause::Internal(_),
        } => id,
        other => panic!("expected an internal error, got {other:?}"),
    };
    assert_eq!(providers.calls(), [1, 0]);
    assert_eq!(engine.metrics().panics(), 1);
    // Nothing settled it: the job waits for its lease to lapse, when the sweep makes it
    // `unknown` for an operator, and no other provider was called in its place.
    assert_eq!(
        attempts(&engine, &id).await,
        (JobState::InProgress, vec![AttemptState::Started])
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_on_the_memory_store_is_answered_from_a_read_without_a_claim() {
    let (engine, providers) = engine("", vec![script(200, 100), script(200, 100)]);
    let (id, _, replayed) = answered(&submit(&engine, "k").await);
    assert!(!replayed);
    for _ in 0..3 {
        let (again, n, replayed) = answered(&submit(&engine, "k").await);
        assert_eq!((again.as_str(), n, replayed), (id.as_str(), 1, true));
    }
    assert_eq!(providers.calls(), [1, 0]);
    let metrics = engine.metrics().render(None, &[]);
    assert!(
        metrics.contains(r#"idemgate_store_seconds_count{operation="claim"} 1"#),
        "one claim, by the first request: {metrics}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_hedge_that_finishes_first_wins_even_over_the_primary() {
    // The primary answers after 1.8 s; the hedge starts at 1 s and answers after 0.5 s.
    let (engine, providers) = engine(
        "hedge_after = \"1s\"",
        vec![script(200, 1_800), script(200, 500)],
    );
    let (id, n, replayed) = answered(&submit(&engine, "k").await);
    assert_eq!((n, replayed), (2, false));
    assert_eq!(providers.calls(), [1, 1]);
    // The primary's answer arrives later and loses the race whole.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        attempts(&engine, &id).await,
        (
            JobState::Succeeded,
            vec![AttemptState::LostRace, AttemptState::Succeeded]
        )
    );
}

/// A re-open is told from another client's by its lease instant (`Transition::Reopen`): two
/// made at one instant, as two gateways' retries of one failed job can be, must not share
/// it, or each takes the other's re-open for its own and both run a round.
#[test]
fn two_reopens_at_one_instant_write_leases_of_their_own() {
    let now = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
    let lease = Duration::from_secs(30);
    let (a, b) = (
        super::reopen_lease(now, lease),
        super::reopen_lease(now, lease),
    );
    assert_ne!(a, b);
    for at in [a, b] {
        let past = at.duration_since(now + lease).unwrap();
        assert!(past < Duration::from_millis(1), "{past:?} past the lease");
    }
}

/// An attempt whose win was already recorded (a second call for it, which no path should
/// make) answers its client with the stored answer, never its own body: what the client
/// gets first is what every replay gives.
#[tokio::test(start_paused = true)]
async fn a_win_answers_with_the_stored_answer() {
    let (engine, providers) = engine("", vec![script(200, 1_000), script(200, 100)]);
    let running = tokio::spawn({
        let engine = engine.clone();
        async move { submit(&engine, "k").await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let record = engine.store().find("owner", "k").await.unwrap().unwrap();
    let stored = crate::job::StoredResponse {
        status: 200,
        headers: vec![("content-type".to_owned(), "application/json".into())].into(),
        body: bytes::Bytes::from_static(b"{\"stored\":true}"),
        body_omitted: false,
    };
    let won = engine
        .store()
        .apply(
            &record.job.id,
            crate::job::Transition::Complete {
                n: 1,
                response: stored.clone(),
            },
            crate::clock::now(),
        )
        .await
        .unwrap();
    assert_eq!(won.outcome, Ok(crate::job::Effect::Won));
    let outcome = running.await.unwrap();
    let Outcome::Answer {
        response,
        n,
        replayed,
        ..
    } = outcome
    else {
        panic!("expected an answer, got {outcome:?}");
    };
    assert_eq!((n, replayed), (1, false));
    assert_eq!(
        response.body, stored.body,
        "the stored answer, not the call's own"
    );
    assert_eq!(providers.calls(), [1, 0]);
    let record = engine.store().get(&record.job.id).await.unwrap().unwrap();
    assert_eq!(record.job.response.unwrap().body, stored.body);
}
