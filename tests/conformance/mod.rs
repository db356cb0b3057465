//! The store conformance suite: every SPEC §2 transition, the compare-and-swap conditions,
//! concurrent claims and expiry, held against every `JobStore` the same way.
//!
//! `conformance_suite!(name, async_factory)` expands to one test per case for a store.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idemgate::job::{
    AttemptState, Effect, ExpiryPolicy, Failure, JobRecord, JobState, Rejection, StoredResponse,
    Transition,
};
use idemgate::store::{Claim, JobStore, StoreError};

pub const POLICY: ExpiryPolicy = ExpiryPolicy {
    retention: Duration::from_secs(60),
    late_result_window: Duration::from_secs(30),
};

pub fn record(owner: &str, key: &str) -> JobRecord {
    let now = idemgate::clock::now();
    JobRecord::new(
        idemgate::job::new_job_id(owner, key),
        owner.into(),
        key.into(),
        "fingerprint".into(),
        "chat".into(),
        now,
        now + Duration::from_secs(30),
        &POLICY,
    )
}

pub fn answer(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![
            (
                "content-type".into(),
                Bytes::from_static(b"application/json"),
            ),
            ("x-request-id".into(), Bytes::from_static(b"req_1")),
        ]
        .into(),
        body: Bytes::from_static(body.as_bytes()),
        body_omitted: false,
    }
}

pub async fn created(store: &dyn JobStore, owner: &str, key: &str) -> JobRecord {
    match store
        .claim(record(owner, key), idemgate::clock::now())
        .await
        .unwrap()
    {
        Claim::Created(r) => r,
        Claim::Existing(r) => panic!("expected a new job, found {}", r.job.id),
    }
}

async fn apply(
    store: &dyn JobStore,
    id: &str,
    t: Transition,
) -> (Result<Effect, Rejection>, JobRecord) {
    let applied = store.apply(id, t, idemgate::clock::now()).await.unwrap();
    (applied.outcome, applied.record)
}

/// Runs a fresh job's first attempt to a successful answer.
async fn succeed(store: &dyn JobStore, id: &str) {
    start(store, id, 1, "p").await;
    let complete = Transition::Complete {
        n: 1,
        response: answer("x"),
    };
    apply(store, id, complete).await.0.unwrap();
}

async fn start(store: &dyn JobStore, id: &str, version: u64, provider: &str) -> u32 {
    let record = store.get(id).await.unwrap().expect("the job exists");
    let t = Transition::StartAttempt {
        version,
        n: record.attempts.last().map_or(1, |a| a.n + 1),
        provider: provider.into(),
    };
    match apply(store, id, t).await.0 {
        Ok(Effect::AttemptStarted { n, read_version }) => {
            assert_eq!(read_version, version);
            n
        }
        other => panic!("attempt did not start: {other:?}"),
    }
}

async fn complete(
    store: &dyn JobStore,
    id: &str,
    n: u32,
    body: &'static str,
) -> Result<Effect, Rejection> {
    apply(
        store,
        id,
        Transition::Complete {
            n,
            response: answer(body),
        },
    )
    .await
    .0
}

pub async fn claim_creates_once_then_returns_the_job(store: Arc<dyn JobStore>) {
    let first = created(&*store, "owner-a", "k").await;
    assert_eq!(first.job.state, JobState::InProgress);
    assert_eq!(first.job.version, 1);
    match store
        .claim(record("owner-a", "k"), idemgate::clock::now())
        .await
        .unwrap()
    {
        Claim::Existing(r) => {
            assert_eq!(r.job.id, first.job.id);
            assert_eq!(r.job.fingerprint, "fingerprint");
        }
        Claim::Created(_) => panic!("a second claim must find the first job"),
    }
    let got = store.get(&first.job.id).await.unwrap().unwrap();
    assert_eq!(got.job.key, "k");
    assert!(store.get("job_missing").await.unwrap().is_none());

    // A claim made with the identity the caller holds is filed where a plain claim looks,
    // and the other way round.
    let identity = idemgate::job::claim_digest_bytes("owner-a", "k");
    match store
        .claim_identified(&identity, record("owner-a", "k"), idemgate::clock::now())
        .await
        .unwrap()
    {
        Claim::Existing(r) => assert_eq!(r.job.id, first.job.id),
        Claim::Created(_) => panic!("a claim by identity must find the job a claim made"),
    }
    let identity = idemgate::job::claim_digest_bytes("owner-a", "k2");
    let by_identity = match store
        .claim_identified(&identity, record("owner-a", "k2"), idemgate::clock::now())
        .await
        .unwrap()
    {
        Claim::Created(r) => r,
        Claim::Existing(r) => panic!("expected a new job, found {}", r.job.id),
    };
    let found = store.find("owner-a", "k2").await.unwrap();
    assert_eq!(found.map(|r| r.job.id), Some(by_identity.job.id.clone()));
    match store
        .claim(record("owner-a", "k2"), idemgate::clock::now())
        .await
        .unwrap()
    {
        Claim::Existing(r) => assert_eq!(r.job.id, by_identity.job.id),
        Claim::Created(_) => panic!("a claim must find the job a claim by identity made"),
    }
}

pub async fn owners_and_keys_never_meet(store: Arc<dyn JobStore>) {
    let a = created(&*store, "owner-a", "shared").await;
    let b = created(&*store, "owner-b", "shared").await;
    let c = created(&*store, "owner-a", "other").await;
    assert_ne!(a.job.id, b.job.id);
    assert_ne!(a.job.id, c.job.id);
    // Ambiguous concatenations must not collide either.
    let d = created(&*store, "owner-a:x", "y").await;
    let e = created(&*store, "owner-a", "x:y").await;
    assert_ne!(d.job.id, e.job.id);
}

pub async fn concurrent_claims_create_exactly_one_job(store: Arc<dyn JobStore>) {
    let mut tasks = Vec::new();
    for _ in 0..64 {
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            store
                .claim(record("owner", "race"), idemgate::clock::now())
                .await
                .unwrap()
        }));
    }
    let mut created_ids = Vec::new();
    let mut seen_ids = Vec::new();
    for task in tasks {
        match task.await.unwrap() {
            Claim::Created(r) => {
                created_ids.push(r.job.id.clone());
                seen_ids.push(r.job.id);
            }
            Claim::Existing(r) => seen_ids.push(r.job.id),
        }
    }
    assert_eq!(created_ids.len(), 1, "exactly one claim creates the job");
    assert!(
        seen_ids.iter().all(|id| *id == created_ids[0]),
        "everyone sees the one job"
    );
}

pub async fn first_completion_wins_and_the_second_loses(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = &job.job.id;
    let a = start(&*store, id, 1, "primary").await;
    let b = start(&*store, id, 1, "fallback").await;
    assert_eq!((a, b), (1, 2));
    assert_eq!(complete(&*store, id, b, "fallback").await, Ok(Effect::Won));
    assert_eq!(
        complete(&*store, id, a, "primary").await,
        Ok(Effect::LostRace {
            completed_by: Some(b)
        })
    );
    let r = store.get(id).await.unwrap().unwrap();
    assert_eq!(r.job.state, JobState::Succeeded);
    assert_eq!(r.job.version, 2);
    assert_eq!(r.job.completed_by, Some(b));
    assert_eq!(
        r.job.response,
        Some(answer("fallback")),
        "stored byte for byte, loser dropped"
    );
    assert_eq!(r.attempt(a).unwrap().state, AttemptState::LostRace);
    assert_eq!(r.attempt(b).unwrap().state, AttemptState::Succeeded);
}

pub async fn concurrent_completions_have_one_winner(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = job.job.id.clone();
    let mut ns = Vec::new();
    for i in 0..8 {
        ns.push(start(&*store, &id, 1, &format!("p{i}")).await);
    }
    let mut tasks = Vec::new();
    for n in ns {
        let store = store.clone();
        let id = id.clone();
        tasks.push(tokio::spawn(
            async move { complete(&*store, &id, n, "x").await },
        ));
    }
    let mut wins = 0;
    for task in tasks {
        if task.await.unwrap() == Ok(Effect::Won) {
            wins += 1;
        }
    }
    assert_eq!(wins, 1);
    let r = store.get(&id).await.unwrap().unwrap();
    assert_eq!(r.job.version, 2);
    let lost = r
        .attempts
        .iter()
        .filter(|a| a.state == AttemptState::LostRace)
        .count();
    assert_eq!(lost, 7);
}

pub async fn a_cancelled_round_cannot_complete_after_a_reopen(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = &job.job.id;
    let a = start(&*store, id, 1, "p").await;
    apply(
        &*store,
        id,
        Transition::AttemptUnknown {
            n: a,
            error: "timeout".into(),
        },
    )
    .await
    .0
    .unwrap();
    apply(&*store, id, Transition::MarkUnknown { version: 1 })
        .await
        .0
        .unwrap();
    apply(&*store, id, Transition::Cancel).await.0.unwrap();
    let (reopened, r) = apply(
        &*store,
        id,
        Transition::Reopen {
            version: 2,
            lease_until: idemgate::clock::now() + Duration::from_secs(30),
        },
    )
    .await;
    reopened.unwrap();
    assert_eq!(r.job.version, 3);
    let b = start(&*store, id, 3, "p").await;
    assert_eq!(
        complete(&*store, id, a, "stale").await,
        Ok(Effect::Discarded)
    );
    assert_eq!(complete(&*store, id, b, "fresh").await, Ok(Effect::Won));
    let r = store.get(id).await.unwrap().unwrap();
    assert_eq!(r.job.response, Some(answer("fresh")));
    assert_eq!(r.attempt(a).unwrap().state, AttemptState::Cancelled);
}

pub async fn unknown_keeps_the_version_and_a_late_answer_settles(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = &job.job.id;
    let a = start(&*store, id, 1, "p").await;
    apply(
        &*store,
        id,
        Transition::AttemptUnknown {
            n: a,
            error: "timeout".into(),
        },
    )
    .await
    .0
    .unwrap();
    let (marked, r) = apply(&*store, id, Transition::MarkUnknown { version: 1 }).await;
    marked.unwrap();
    assert_eq!((r.job.state, r.job.version), (JobState::Unknown, 1));
    let (refused, _) = apply(
        &*store,
        id,
        Transition::StartAttempt {
            version: 1,
            n: 2,
            provider: "f".into(),
        },
    )
    .await;
    assert!(
        refused.is_err(),
        "no attempt starts while the job is unknown"
    );
    assert_eq!(complete(&*store, id, a, "late").await, Ok(Effect::Won));
    let r = store.get(id).await.unwrap().unwrap();
    assert_eq!((r.job.state, r.job.version), (JobState::Succeeded, 2));
}

pub async fn a_late_definite_failure_fails_the_unknown_job(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = &job.job.id;
    let a = start(&*store, id, 1, "p").await;
    apply(
        &*store,
        id,
        Transition::AttemptUnknown {
            n: a,
            error: "timeout".into(),
        },
    )
    .await
    .0
    .unwrap();
    apply(&*store, id, Transition::MarkUnknown { version: 1 })
        .await
        .0
        .unwrap();
    let fail = Transition::FailAttempt {
        n: a,
        kind: Failure::Failed,
        upstream_status: Some(503),
        error: None,
    };
    assert_eq!(
        apply(&*store, id, fail).await.0,
        Ok(Effect::AttemptFailed { job_failed: true })
    );
    let r = store.get(id).await.unwrap().unwrap();
    assert_eq!((r.job.state, r.job.version), (JobState::Failed, 2));
}

pub async fn cancel_settles_and_discards_late_answers(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = &job.job.id;
    let a = start(&*store, id, 1, "p").await;
    let (cancelled, r) = apply(&*store, id, Transition::Cancel).await;
    cancelled.unwrap();
    assert_eq!((r.job.state, r.job.version), (JobState::Cancelled, 2));
    assert_eq!(r.attempt(a).unwrap().state, AttemptState::Cancelled);
    assert_eq!(
        complete(&*store, id, a, "late").await,
        Ok(Effect::Discarded)
    );
    let (again, _) = apply(&*store, id, Transition::Cancel).await;
    assert_eq!(again, Err(Rejection::AlreadySettled(JobState::Cancelled)));
    let r = store.get(id).await.unwrap().unwrap();
    assert!(r.job.response.is_none());
}

pub async fn failed_rounds_reopen_once(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = job.job.id.clone();
    let a = start(&*store, &id, 1, "p").await;
    let fail = Transition::FailAttempt {
        n: a,
        kind: Failure::Failed,
        upstream_status: Some(503),
        error: None,
    };
    apply(&*store, &id, fail).await.0.unwrap();
    apply(&*store, &id, Transition::FailRound { version: 1 })
        .await
        .0
        .unwrap();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let store = store.clone();
        let id = id.clone();
        tasks.push(tokio::spawn(async move {
            let t = Transition::Reopen {
                version: 2,
                lease_until: idemgate::clock::now() + Duration::from_secs(30),
            };
            store
                .apply(&id, t, idemgate::clock::now())
                .await
                .unwrap()
                .outcome
                .is_ok()
        }));
    }
    let mut reopened = 0;
    for task in tasks {
        reopened += usize::from(task.await.unwrap());
    }
    assert_eq!(reopened, 1, "of concurrent retries exactly one re-opens");
    let n = start(&*store, &id, 3, "p").await;
    assert_eq!(n, 2, "the new round continues the ordinals");
}

pub async fn a_lapsed_lease_turns_the_job_unknown(store: Arc<dyn JobStore>) {
    let now = idemgate::clock::now();
    let mut rec = record("o", "lease");
    rec.job.lease_until = now + Duration::from_millis(1);
    let rec = match store.claim(rec, now).await.unwrap() {
        Claim::Created(r) => r,
        Claim::Existing(_) => panic!("fresh key"),
    };
    let id = &rec.job.id;
    let a = start(&*store, id, 1, "p").await;
    let later = now + Duration::from_secs(1);
    let r = store.get(id).await.unwrap().unwrap();
    assert_eq!(
        r.classify("fingerprint", later),
        idemgate::job::Found::LeaseLapsed
    );
    let applied = store
        .apply(id, Transition::ExpireLease { version: 1 }, later)
        .await
        .unwrap();
    applied.outcome.unwrap();
    assert_eq!(applied.record.job.state, JobState::Unknown);
    assert_eq!(
        applied.record.attempt(a).unwrap().state,
        AttemptState::Unknown
    );
    let renewed = store
        .apply(
            id,
            Transition::RenewLease {
                version: 1,
                until: later + Duration::from_secs(30),
            },
            later,
        )
        .await
        .unwrap();
    assert!(
        renewed.outcome.is_err(),
        "an unknown job has no lease to renew"
    );
}

pub async fn waiters_are_woken_by_a_change(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "k").await;
    let id = job.job.id.clone();
    let a = start(&*store, &id, 1, "p").await;
    let waiter = {
        let store = store.clone();
        let id = id.clone();
        tokio::spawn(async move {
            store
                .wait_change(&id, 1, JobState::InProgress, Duration::from_secs(20))
                .await
        })
    };
    // The waiter may register before or after this completion; either way it must see it.
    let started = tokio::time::Instant::now();
    assert_eq!(complete(&*store, &id, a, "done").await, Ok(Effect::Won));
    let seen = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(seen.job.state, JobState::Succeeded);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "woken by the change, not the timeout"
    );
    // Nothing changes: the wait ends at its timeout with the record as it is.
    let unchanged = store
        .wait_change(&id, 2, JobState::Succeeded, Duration::from_millis(50))
        .await
        .unwrap();
    assert_eq!(unchanged.job.version, 2);
}

pub async fn expired_jobs_are_replaced_by_a_new_claim(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "expiring").await;
    let id = &job.job.id;
    let a = start(&*store, id, 1, "p").await;
    complete(&*store, id, a, "old").await.unwrap();
    let settled = store.get(id).await.unwrap().unwrap();
    // Within retention the key still names the job...
    let soon = settled.job.updated_at + POLICY.retention - Duration::from_secs(1);
    assert!(matches!(
        store.claim(record("o", "expiring"), soon).await.unwrap(),
        Claim::Existing(_)
    ));
    // ...after it, a claim starts over.
    let later = settled.job.updated_at + POLICY.retention + Duration::from_secs(1);
    match store.claim(record("o", "expiring"), later).await.unwrap() {
        Claim::Created(r) => assert_ne!(&r.job.id, id),
        Claim::Existing(_) => panic!("an expired job must not be returned"),
    }
}

pub async fn unsettled_jobs_outlive_retention_by_the_late_window(store: Arc<dyn JobStore>) {
    let job = created(&*store, "o", "unsettled").await;
    let created_at = job.job.updated_at;
    let after_retention = created_at + POLICY.retention + Duration::from_secs(1);
    assert!(
        matches!(
            store
                .claim(record("o", "unsettled"), after_retention)
                .await
                .unwrap(),
            Claim::Existing(_)
        ),
        "an unsettled job never expires before retention + late_result_window"
    );
}

pub async fn unknown_jobs_are_listed_until_resolved(store: Arc<dyn JobStore>) {
    let mut unknown = Vec::new();
    for key in ["u1", "u2", "u3"] {
        let job = created(&*store, "o", key).await;
        let id = job.job.id.clone();
        if key != "u2" {
            apply(&*store, &id, Transition::MarkUnknown { version: 1 })
                .await
                .0
                .unwrap();
            unknown.push(id);
        }
    }
    unknown.sort();
    assert_eq!(store.unknown_jobs(None, 10).await.unwrap(), unknown);
    let first = store.unknown_jobs(None, 1).await.unwrap();
    assert_eq!(first, vec![unknown[0].clone()]);
    assert_eq!(
        store.unknown_jobs(Some(&first[0]), 10).await.unwrap(),
        vec![unknown[1].clone()]
    );
    apply(&*store, &unknown[0], Transition::Cancel)
        .await
        .0
        .unwrap();
    assert_eq!(
        store.unknown_jobs(None, 10).await.unwrap(),
        vec![unknown[1].clone()]
    );
}

pub async fn unknown_jobs_are_not_found(store: Arc<dyn JobStore>) {
    match store
        .apply("job_nope", Transition::Cancel, idemgate::clock::now())
        .await
    {
        Err(StoreError::NotFound(id)) => assert_eq!(id, "job_nope"),
        other => panic!("expected NotFound, got {other:?}"),
    }
    store.ping().await.unwrap();
}

/// A stream's mirror written as the relay writes it, with steps written again as after a
/// lost reply: every chunk is held once, in order, a new attempt's head replaces the
/// earlier attempt's chunks and end, and that attempt's writes landing after it, its head
/// included, are dropped.
/// Stores that serve one process do not mirror.
pub async fn a_mirror_written_again_holds_each_chunk_once(store: Arc<dyn JobStore>) {
    use crate::common::mirror::{chunks, end, head};
    let job = created(&*store, "owner-a", "streaming").await;
    let id = job.job.id.as_str();
    store.mirror_stream(id, head(1)).await.unwrap();
    let Some(empty) = store.read_stream(id, 0).await.unwrap() else {
        return;
    };
    assert!(empty.chunks.is_empty() && empty.end.is_none());
    for update in [
        chunks(1, 0, &["a", "b"]),
        chunks(1, 0, &["a", "b"]),
        chunks(1, 1, &["b", "c"]),
        chunks(1, 3, &["d"]),
        end(1, Err("cut")),
    ] {
        store.mirror_stream(id, update).await.unwrap();
    }
    let mirrored = store.read_stream(id, 0).await.unwrap().expect("a mirror");
    assert_eq!(mirrored.chunks, ["a", "b", "c", "d"]);
    assert_eq!(mirrored.end, Some(Err("cut".into())));
    assert_eq!(
        store.read_stream(id, 2).await.unwrap().unwrap().chunks,
        ["c", "d"]
    );

    store.mirror_stream(id, head(2)).await.unwrap();
    let retried = store.read_stream(id, 0).await.unwrap().expect("a mirror");
    assert_eq!(retried.head.n, 2);
    assert!(retried.chunks.is_empty(), "{:?}", retried.chunks);
    assert_eq!(retried.end, None);
    store.mirror_stream(id, chunks(2, 0, &["x"])).await.unwrap();
    // The cut attempt's last writes, landing late: its mirror is gone, they are dropped,
    // and so is its head, should its mirror have started late too.
    for late in [head(1), chunks(1, 4, &["e"]), end(1, Err("cut"))] {
        store.mirror_stream(id, late).await.unwrap();
    }
    let live = store.read_stream(id, 0).await.unwrap().expect("a mirror");
    assert_eq!(
        (live.head.n, live.chunks, live.end),
        (2, vec![Bytes::from("x")], None),
        "an earlier attempt's writes reached a retry's mirror"
    );
    store.mirror_stream(id, end(2, Ok(()))).await.unwrap();
    let whole = store.read_stream(id, 0).await.unwrap().expect("a mirror");
    assert_eq!(
        (whole.chunks, whole.end),
        (vec![Bytes::from("x")], Some(Ok(())))
    );
}

/// One `#[tokio::test]` per case for the store `make` builds. `make` returns the store and
/// a guard that keeps whatever backs it (a directory, a server) alive for the test.
#[macro_export]
macro_rules! conformance_suite {
    ($store:ident, $make:expr) => {
        mod $store {
            #[allow(unused_imports)]
            use super::*;
            $crate::conformance_suite!(@cases $make;
                claim_creates_once_then_returns_the_job,
                owners_and_keys_never_meet,
                concurrent_claims_create_exactly_one_job,
                first_completion_wins_and_the_second_loses,
                concurrent_completions_have_one_winner,
                a_cancelled_round_cannot_complete_after_a_reopen,
                unknown_keeps_the_version_and_a_late_answer_settles,
                a_late_definite_failure_fails_the_unknown_job,
                cancel_settles_and_discards_late_answers,
                failed_rounds_reopen_once,
                a_lapsed_lease_turns_the_job_unknown,
                waiters_are_woken_by_a_change,
                expired_jobs_are_replaced_by_a_new_claim,
                unsettled_jobs_outlive_retention_by_the_late_window,
                unknown_jobs_are_not_found,
                unknown_jobs_are_listed_until_resolved,
                lost_replies_are_recognised_when_retried,
                lapsed_leases_are_listed_from_an_index,
                in_progress_jobs_are_listed_in_id_order,
                a_mirror_written_again_holds_each_chunk_once,
            );
        }
    };
    (@cases $make:expr; $($case:ident,)*) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                let (store, _guard) = ($make)().await;
                super::conformance::$case(store).await;
            }
        )*
    };
}

/// Applies `t` through a store that loses the reply after writing it, then again as the
/// engine's retry does: the retry must answer `expected`, as the first apply did.
async fn lost_then_retried(
    store: &Arc<dyn JobStore>,
    id: &str,
    t: Transition,
    expected: Result<Effect, Rejection>,
) -> JobRecord {
    let faulty =
        crate::faults::Faulty::scripted(store.clone(), &[Some(crate::faults::Fault::ErrorAfter)]);
    let lost = faulty.apply(id, t.clone(), idemgate::clock::now()).await;
    assert!(lost.is_err(), "the first reply is lost: {t:?}");
    let retried = faulty
        .apply(id, t.clone(), idemgate::clock::now())
        .await
        .unwrap();
    assert_eq!(retried.outcome, expected, "the retry of {t:?}");
    retried.record
}

/// Every transition, applied, its reply lost, retried: recognised as already applied, with
/// the same effect and no second change — one attempt, one round.
pub async fn lost_replies_are_recognised_when_retried(store: Arc<dyn JobStore>) {
    // start, unknown, a late win
    let a = created(&*store, "o", "lost-a").await.job.id;
    let r = lost_then_retried(
        &store,
        &a,
        Transition::StartAttempt {
            version: 1,
            n: 1,
            provider: "p".into(),
        },
        Ok(Effect::AttemptStarted {
            n: 1,
            read_version: 1,
        }),
    )
    .await;
    assert_eq!(r.attempts.len(), 1, "one attempt, not two");
    let r = lost_then_retried(
        &store,
        &a,
        Transition::AttemptUnknown {
            n: 1,
            error: "timeout".into(),
        },
        Ok(Effect::Applied),
    )
    .await;
    assert_eq!(r.attempts[0].state, AttemptState::Unknown);
    let r = lost_then_retried(
        &store,
        &a,
        Transition::MarkUnknown { version: 1 },
        Ok(Effect::Applied),
    )
    .await;
    assert_eq!((r.job.state, r.job.version), (JobState::Unknown, 1));
    let r = lost_then_retried(
        &store,
        &a,
        Transition::Complete {
            n: 1,
            response: answer("late"),
        },
        Ok(Effect::Won),
    )
    .await;
    assert_eq!(
        (r.job.state, r.job.version, r.job.completed_by),
        (JobState::Succeeded, 2, Some(1))
    );

    // a failed attempt, a failed round, a re-open, a new attempt, a cancel
    let b = created(&*store, "o", "lost-b").await.job.id;
    start(&*store, &b, 1, "p").await;
    let fail = Transition::FailAttempt {
        n: 1,
        kind: Failure::Failed,
        upstream_status: Some(503),
        error: Some("503".into()),
    };
    lost_then_retried(
        &store,
        &b,
        fail,
        Ok(Effect::AttemptFailed { job_failed: false }),
    )
    .await;
    let r = lost_then_retried(
        &store,
        &b,
        Transition::FailRound { version: 1 },
        Ok(Effect::Applied),
    )
    .await;
    assert_eq!((r.job.state, r.job.version), (JobState::Failed, 2));
    let reopen = Transition::Reopen {
        version: 2,
        lease_until: idemgate::clock::now() + Duration::from_secs(30),
    };
    let r = lost_then_retried(&store, &b, reopen, Ok(Effect::Applied)).await;
    assert_eq!(
        (r.job.state, r.job.version),
        (JobState::InProgress, 3),
        "one new round"
    );
    let r = lost_then_retried(
        &store,
        &b,
        Transition::StartAttempt {
            version: 3,
            n: 2,
            provider: "q".into(),
        },
        Ok(Effect::AttemptStarted {
            n: 2,
            read_version: 3,
        }),
    )
    .await;
    assert_eq!(r.attempts.len(), 2);
    let r = lost_then_retried(
        &store,
        &b,
        Transition::CancelAt { version: 3 },
        Ok(Effect::Applied),
    )
    .await;
    assert_eq!((r.job.state, r.job.version), (JobState::Cancelled, 4));

    // a hedge race lost, a lease expired
    let c = created(&*store, "o", "lost-c").await.job.id;
    start(&*store, &c, 1, "p").await;
    start(&*store, &c, 1, "q").await;
    apply(
        &*store,
        &c,
        Transition::Complete {
            n: 2,
            response: answer("fast"),
        },
    )
    .await
    .0
    .unwrap();
    let r = lost_then_retried(
        &store,
        &c,
        Transition::Complete {
            n: 1,
            response: answer("slow"),
        },
        Ok(Effect::LostRace {
            completed_by: Some(2),
        }),
    )
    .await;
    assert_eq!(r.job.response.unwrap().body, answer("fast").body);
    let d = created(&*store, "o", "lost-d").await.job.id;
    start(&*store, &d, 1, "p").await;
    lost_then_retried(
        &store,
        &d,
        Transition::ExpireLease { version: 1 },
        Ok(Effect::Applied),
    )
    .await;

    // streams: the slot, the end, a cut
    let e = created(&*store, "o", "lost-e").await.job.id;
    start(&*store, &e, 1, "p").await;
    lost_then_retried(
        &store,
        &e,
        Transition::BeginStream { n: 1 },
        Ok(Effect::Won),
    )
    .await;
    let r = lost_then_retried(
        &store,
        &e,
        Transition::EndStream {
            n: 1,
            response: answer("streamed"),
        },
        Ok(Effect::Won),
    )
    .await;
    assert_eq!((r.job.state, r.job.version), (JobState::Succeeded, 2));
    let f = created(&*store, "o", "lost-f").await.job.id;
    start(&*store, &f, 1, "p").await;
    apply(&*store, &f, Transition::BeginStream { n: 1 })
        .await
        .0
        .unwrap();
    let r = lost_then_retried(
        &store,
        &f,
        Transition::CutStream {
            n: 1,
            error: "cut".into(),
        },
        Ok(Effect::AttemptFailed { job_failed: true }),
    )
    .await;
    assert_eq!((r.job.state, r.job.version), (JobState::Failed, 2));
}

/// In-progress jobs whose lease lapsed are listed (for the sweep); live and settled ones
/// are not.
pub async fn lapsed_leases_are_listed_from_an_index(store: Arc<dyn JobStore>) {
    let now = idemgate::clock::now();
    let mut lapsed = record("o", "lapsed");
    lapsed.job.lease_until = now - Duration::from_secs(1);
    let lapsed = match store.claim(lapsed, now).await.unwrap() {
        Claim::Created(r) => r.job.id,
        Claim::Existing(_) => unreachable!(),
    };
    let live = created(&*store, "o", "live").await.job.id;
    let settled = created(&*store, "o", "settled").await.job.id;
    succeed(&*store, &settled).await;
    let listed = store.lapsed_leases(now, 10).await.unwrap();
    assert_eq!(
        listed,
        vec![(lapsed.clone(), 1)],
        "{live} and {settled} are not lapsed"
    );
    apply(&*store, &lapsed, Transition::ExpireLease { version: 1 })
        .await
        .0
        .unwrap();
    assert!(store.lapsed_leases(now, 10).await.unwrap().is_empty());
}

/// Jobs running now are listed in id order, a page at a time, whatever order they were
/// claimed in; a settled job is not.
pub async fn in_progress_jobs_are_listed_in_id_order(store: Arc<dyn JobStore>) {
    let mut claimed = Vec::new();
    for key in ["r1", "r2", "r3", "r4", "r5"] {
        claimed.push(created(&*store, "o", key).await.job.id);
    }
    let settled = claimed.remove(1);
    succeed(&*store, &settled).await;
    let mut running = claimed.clone();
    running.sort();
    assert_ne!(
        running, claimed,
        "the keys are chosen so that id order is not the order of the claims"
    );
    assert_eq!(store.in_progress_jobs(None, 10).await.unwrap(), running);
    let first = store.in_progress_jobs(None, 2).await.unwrap();
    assert_eq!(first, running[..2]);
    assert_eq!(
        store.in_progress_jobs(Some(&first[1]), 10).await.unwrap(),
        running[2..]
    );
}
