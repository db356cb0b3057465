//! Gateways sharing one PostgreSQL database (SPEC §12): one identity per intent across
//! instances, decided by the unique constraint; one winner by the versioned `UPDATE`;
//! fail-closed while the database is gone; migrations that run once; the statements a
//! request costs. Every server here is started by the test harness (`initdb` + `pg_ctl`).

mod common;

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use common::pg_server::{self, PgServer};
use common::*;
use idemgate::config::StoreConfig;
use idemgate::job::{
    new_job_id, AttemptState, ExpiryPolicy, JobRecord, StoredResponse, Transition,
};
use idemgate::store::postgres::{schema, PostgresStore};
use idemgate::store::{Claim, JobStore};

const CHAT: &str = "/v1/chat/completions";

const POLICY: ExpiryPolicy = ExpiryPolicy {
    retention: Duration::from_secs(3600),
    late_result_window: Duration::from_secs(600),
};

fn config(url: &str) -> StoreConfig {
    pg_server::store_config(url, 8)
}

async fn store(url: &str) -> Arc<PostgresStore> {
    Arc::new(PostgresStore::open(&config(url), POLICY).await.unwrap())
}

/// A plain client for reading the tables as an operator would.
async fn sql(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_duplicates_split_across_two_gateways_make_one_call() {
    let url = pg_server::shared().database().await;
    shared_stores::fifty_duplicates_make_one_call(store(&url).await, store(&url).await).await;
    let rows = sql(&url)
        .await
        .query_one("SELECT count(*) FROM jobs", &[])
        .await
        .unwrap();
    assert_eq!(rows.get::<_, i64>(0), 1, "one jobs row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_race_across_instances_has_one_winner() {
    let url = pg_server::shared().database().await;
    let id =
        shared_stores::a_hedged_race_has_one_winner(store(&url).await, store(&url).await).await;
    let row = sql(&url)
        .await
        .query_one(
            "SELECT j.completed_by, a.state FROM jobs j JOIN attempts a ON a.job_id = j.id
             WHERE j.id = $1 AND a.n = 1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Option<i32>>(0), Some(2));
    assert_eq!(row.get::<_, String>(1), "lost_race");

    // The README's operator queries run on these tables and see this race.
    let readme = include_str!("../README.md");
    let block = readme
        .split("```sql\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("the README has its operator queries");
    let queries: Vec<&str> = block
        .split(';')
        .map(str::trim)
        .filter(|q| !q.is_empty())
        .collect();
    assert_eq!(queries.len(), 3);
    let client = sql(&url).await;
    let by_provider = client.query(queries[0], &[]).await.unwrap();
    assert_eq!(by_provider.len(), 1);
    assert_eq!(by_provider[0].get::<_, String>("provider"), "fallback");
    assert_eq!(by_provider[0].get::<_, i64>("jobs"), 1);
    assert!(client.query(queries[1], &[]).await.unwrap().is_empty());
    let rate = client.query(queries[2], &[]).await.unwrap();
    assert_eq!(rate[0].get::<_, String>("route"), "chat");
    assert_eq!(rate[0].get::<_, i64>("jobs"), 1);
}

/// A new job of `key` with one started attempt per provider, as a round registers them.
fn started(key: &str, providers: &[&str], now: SystemTime) -> JobRecord {
    let mut record = JobRecord::new(
        new_job_id("owner", key),
        "owner".into(),
        key.into(),
        "fp".into(),
        "chat".into(),
        now,
        now + Duration::from_secs(30),
        &POLICY,
    );
    for (n, provider) in (1..).zip(providers) {
        record
            .apply(
                Transition::StartAttempt {
                    version: 1,
                    n,
                    provider: (*provider).into(),
                },
                now,
                &POLICY,
            )
            .unwrap();
    }
    record
}

fn answer(body: &'static str) -> StoredResponse {
    StoredResponse {
        status: 200,
        headers: vec![(
            "content-type".into(),
            Bytes::from_static(b"application/json"),
        )]
        .into(),
        body: Bytes::from_static(body.as_bytes()),
        body_omitted: false,
    }
}

/// Two gateways each hold the job as they last saw it; the second to finish computes its
/// win on a stale record, and its `UPDATE … WHERE id AND version AND completed_by IS NULL`
/// matches zero rows: it re-reads, and its attempt is recorded `lost_race`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_second_finisher_s_update_matches_zero_rows_and_it_loses() {
    let url = pg_server::shared().database().await;
    let (a, b) = (store(&url).await, store(&url).await);
    let now = idemgate::clock::now();
    let record = started("k", &["primary", "fallback"], now);
    let id = record.job.id.clone();
    assert!(matches!(
        a.claim(record, now).await.unwrap(),
        Claim::Created(_)
    ));
    b.get(&id).await.unwrap().unwrap();

    let won = a
        .apply(
            &id,
            Transition::Complete {
                n: 2,
                response: answer("{\"from\":\"fallback\"}"),
            },
            now,
        )
        .await
        .unwrap();
    assert!(won.outcome.is_ok());
    assert_eq!(won.record.job.completed_by, Some(2));

    let before = b.lost_writes();
    let lost = b
        .apply(
            &id,
            Transition::Complete {
                n: 1,
                response: answer("{\"from\":\"primary\"}"),
            },
            now,
        )
        .await
        .unwrap();
    assert_eq!(
        b.lost_writes() - before,
        1,
        "the loser's UPDATE matched zero rows"
    );
    assert_eq!(lost.record.job.completed_by, Some(2));
    assert_eq!(lost.record.attempts[0].state, AttemptState::LostRace);
    assert_eq!(
        lost.record.job.response.unwrap().body,
        Bytes::from_static(b"{\"from\":\"fallback\"}"),
        "the winner's answer is the one stored"
    );
    let row = sql(&url)
        .await
        .query_one(
            "SELECT state FROM attempts WHERE job_id = $1 AND n = 1",
            &[&id],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "lost_race");
}

/// 100 claims of one (owner, key) at once from two pools: exactly one row, because the
/// unique constraint refuses the rest — the claim has no check before its insert.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_unique_constraint_decides_a_claim_race() {
    let url = pg_server::shared().database().await;
    let (a, b) = (store(&url).await, store(&url).await);
    let start = Arc::new(tokio::sync::Barrier::new(100));
    let mut claims = Vec::new();
    for i in 0..100 {
        let store = if i % 2 == 0 { a.clone() } else { b.clone() };
        let start = start.clone();
        claims.push(tokio::spawn(async move {
            let now = idemgate::clock::now();
            let record = JobRecord::new(
                new_job_id("owner", "same-key"),
                "owner".into(),
                "same-key".into(),
                "fp".into(),
                "chat".into(),
                now,
                now + Duration::from_secs(30),
                &POLICY,
            );
            start.wait().await;
            store.claim(record, now).await.unwrap()
        }));
    }
    let mut created = Vec::new();
    let mut existing = std::collections::HashSet::new();
    for claim in claims {
        match claim.await.unwrap() {
            Claim::Created(r) => created.push(r.job.id),
            Claim::Existing(r) => {
                existing.insert(r.job.id);
            }
        }
    }
    assert_eq!(created.len(), 1, "one claim created the job");
    assert!(
        existing.iter().all(|id| *id == created[0]),
        "the rest found it"
    );
    let client = sql(&url).await;
    let count: i64 = client
        .query_one(
            "SELECT count(*) FROM jobs WHERE owner = 'owner' AND idempotency_key = 'same-key'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(count, 1);
    // The constraint itself, without the gateway: a second row is refused.
    let refused = client
        .execute(
            "INSERT INTO jobs (id, owner, idempotency_key, fingerprint, route, state, version,
                 created_at, updated_at, expires_at, lease_until, revision)
             VALUES ('job_other', 'owner', 'same-key', 'fp', 'chat', 'in_progress', 1,
                 now(), now(), now(), now(), 1)",
            &[],
        )
        .await
        .unwrap_err();
    assert_eq!(
        refused.code(),
        Some(&tokio_postgres::error::SqlState::UNIQUE_VIOLATION)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_fails_closed_and_traffic_resumes_when_it_is_back() {
    let server = PgServer::start();
    let url = server.database().await;
    shared_stores::an_outage_fails_closed_and_traffic_resumes(
        store(&url).await,
        async || server.kill(),
        async || server.restart(),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_once_and_concurrent_starts_do_not_race() {
    let server = pg_server::shared();
    // An empty database: the first start migrates, the second finds nothing to do.
    let url = server.database().await;
    let mut client = sql(&url).await;
    assert_eq!(schema::migrate(&mut client).await.unwrap(), vec![1, 2]);
    assert_eq!(
        schema::migrate(&mut client).await.unwrap(),
        Vec::<i32>::new()
    );
    let versions: Vec<i32> = client
        .query(
            "SELECT version FROM idemgate_migrations ORDER BY version",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(versions, vec![1, 2]);

    // Two gateways at once on another empty database: one migrates, the other waits for
    // the advisory lock and then does nothing.
    let url = server.database().await;
    let (mut one, mut two) = (sql(&url).await, sql(&url).await);
    let (first, second) = tokio::join!(schema::migrate(&mut one), schema::migrate(&mut two));
    let mut results = vec![first.unwrap(), second.unwrap()];
    results.sort();
    assert_eq!(results, vec![Vec::<i32>::new(), vec![1, 2]]);
    // And two whole stores starting together on a third.
    let both = config(&server.database().await);
    let (a, b) = tokio::join!(
        PostgresStore::open(&both, POLICY),
        PostgresStore::open(&both, POLICY)
    );
    a.unwrap();
    b.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_job_costs_two_statements_and_a_notify_and_a_replay_one() {
    let url = pg_server::shared().database().await;
    let pg = store(&url).await;
    let (gw, _provider) = TestGateway::answering_ok(pg.clone()).await;
    // The first requests prepare the statements on the pooled connections.
    for i in 0..3 {
        let key = format!("k-warm-{i}");
        assert_eq!(gw.post(CHAT, Some(&key), chat_request()).await.status, 200);
        assert_eq!(gw.post(CHAT, Some(&key), chat_request()).await.status, 200);
    }
    let before = pg.statements();
    let first = gw.post(CHAT, Some("k-count"), chat_request()).await;
    assert_eq!(first.status, 200);
    assert_eq!(
        pg.statements() - before,
        3,
        "claim (with attempt 1), settle, and the NOTIFY after it"
    );
    let before = pg.statements();
    let replay = gw.post(CHAT, Some("k-count"), chat_request()).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(pg.statements() - before, 1, "a replay is the claim alone");
}

/// PostgreSQL keeps microseconds; a re-open is recognised by its exact lease instant. A
/// re-open whose reply was lost and that is retried through a gateway that never saw it
/// (nothing cached) is still recognised as already applied: no second round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_reopen_is_recognised_to_the_nanosecond_on_another_gateway() {
    let url = pg_server::shared().database().await;
    let (a, b) = (store(&url).await, store(&url).await);
    let now = idemgate::clock::now();
    let record = started("reopen", &["primary"], now);
    let id = record.job.id.clone();
    a.claim(record, now).await.unwrap();
    let fail = Transition::FailAttempt {
        n: 1,
        kind: idemgate::job::Failure::Failed,
        upstream_status: Some(503),
        error: None,
    };
    a.apply(&id, fail, now).await.unwrap().outcome.unwrap();
    a.apply(&id, Transition::FailRound { version: 1 }, now)
        .await
        .unwrap()
        .outcome
        .unwrap();
    let reopen = Transition::Reopen {
        version: 2,
        // An instant with nanoseconds below the microsecond.
        lease_until: SystemTime::UNIX_EPOCH + Duration::new(4_000_000_000, 123_456_789),
    };
    let first = a.apply(&id, reopen.clone(), now).await.unwrap();
    assert!(first.outcome.is_ok());
    assert_eq!(first.record.job.version, 3);
    let retried = b.apply(&id, reopen, now).await.unwrap();
    assert_eq!(
        retried.outcome, first.outcome,
        "the retry is the same re-open, already applied"
    );
    assert_eq!(retried.record.job.version, 3, "no second round");
    assert_eq!(retried.record.job.lease_until, first.record.job.lease_until);
}

/// Reads replies of the load until `count` of them had status `want`; every other reply is
/// a 200 or a 503 `store-unavailable`.
async fn seen(replies: &mut tokio::sync::mpsc::UnboundedReceiver<Reply>, want: u16, count: usize) {
    let mut got = 0;
    while got < count {
        let reply = bounded("replies", replies.recv()).await.expect("load runs");
        if reply.status != 200 {
            reply.assert_problem(503, "store-unavailable");
        }
        got += usize::from(reply.status == want);
    }
}

/// The database killed under a steady load and started again: requests in the outage are
/// refused with 503 `store-unavailable`, the load resumes by itself, and every call a
/// provider received is an attempt the database recorded — none went out unclaimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_under_load_no_call_goes_out_unclaimed() {
    let server = PgServer::start();
    let url = server.database().await;
    let (gw, provider) = TestGateway::answering_ok(store(&url).await).await;
    let gw = Arc::new(gw);
    let (tx, mut replies) = tokio::sync::mpsc::unbounded_channel();
    let stop = tokio_util::sync::CancellationToken::new();
    let mut load = Vec::new();
    for worker in 0..4 {
        let (gw, tx, stop) = (gw.clone(), tx.clone(), stop.clone());
        load.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.is_cancelled() {
                let key = format!("load-{worker}-{i}");
                let reply = gw.post(CHAT, Some(&key), chat_request()).await;
                let _ = tx.send(reply);
                i += 1;
            }
        }));
    }
    drop(tx);
    // Some traffic, then the kill; some refusals, then the restart; then traffic again.
    seen(&mut replies, 200, 20).await;
    server.kill();
    seen(&mut replies, 503, 20).await;
    server.restart();
    seen(&mut replies, 200, 20).await;
    stop.cancel();
    for worker in load {
        worker.await.unwrap();
    }
    while let Some(reply) = replies.recv().await {
        if reply.status != 200 {
            reply.assert_problem(503, "store-unavailable");
        }
    }
    // Every call carries its job id (as `Idempotency-Key`) and is an attempt the database
    // recorded. An attempt may have no call: a claim committed just before the kill, whose
    // reply was lost, answered 503 and was never sent (it turns `unknown` by the sweep).
    let client = sql(&url).await;
    let calls = provider.received_requests().await.unwrap();
    let mut per_job: std::collections::HashMap<String, i64> = Default::default();
    for call in &calls {
        let id = call
            .headers
            .get("idempotency-key")
            .and_then(|v| v.to_str().ok())
            .expect("a call names its job")
            .to_owned();
        *per_job.entry(id).or_default() += 1;
    }
    for (id, calls) in &per_job {
        let attempts: i64 = client
            .query_one("SELECT count(*) FROM attempts WHERE job_id = $1", &[id])
            .await
            .unwrap()
            .get(0);
        assert!(
            attempts >= *calls,
            "job {id}: {calls} provider calls, {attempts} attempts recorded"
        );
    }
    assert!(calls.len() >= 40, "the load ran: {} calls", calls.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_attempt_leaves_the_job_unknown_never_rerun() {
    let url = pg_server::shared().database().await;
    let lines = format!("kind = \"postgres\"\nurl = \"{url}\"");
    shared_stores::a_gateway_killed_mid_attempt_leaves_the_job_unknown(&lines, store(&url).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_orphaned_by_kill_9_is_listed_unknown_by_another_gateway_s_sweep() {
    let url = pg_server::shared().database().await;
    let lines = format!("kind = \"postgres\"\nurl = \"{url}\"");
    shared_stores::an_orphan_of_kill_9_is_listed_unknown_by_another_gateway(
        &lines,
        store(&url).await,
    )
    .await;
}

/// A job's row lives `retention + late_result_window` while unsettled and `retention` once
/// settled (`expires_at`, what the sweep deletes by).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_live_for_retention_after_settling_and_longer_while_unsettled() {
    let url = pg_server::shared().database().await;
    let mut provider = HeldProvider::start().await;
    let route = format!(
        "[idempotency]\nretention = \"1h\"\n{}",
        two_provider_config(&provider.url(), "", None, "")
    );
    let gw = Arc::new(TestGateway::start_on(&route, store(&url).await).await);
    let client = sql(&url).await;
    let expires_in = async || -> f64 {
        client
            .query_one(
                "SELECT extract(epoch FROM expires_at - now())::float8 FROM jobs",
                &[],
            )
            .await
            .unwrap()
            .get(0)
    };
    let running = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("k-ttl"), chat_request()).await })
    };
    let call = provider.next_call().await;
    let unsettled = (POLICY.retention + POLICY.late_result_window).as_secs_f64();
    let left = expires_in().await;
    assert!(left > unsettled - 60.0 && left <= unsettled, "{left}");
    call.answer(200, Bytes::from_static(b"{}"));
    assert_eq!(running.await.unwrap().status, 200);
    let settled = POLICY.retention.as_secs_f64();
    let left = expires_in().await;
    assert!(left > settled - 60.0 && left <= settled, "{left}");
}

/// PostgreSQL `text` refuses NUL, and an attempt's error can quote a provider's error code:
/// a hostile code still lets the failure be recorded (NUL as U+FFFD), never a failed write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nul_in_an_attempt_error_is_recorded_not_refused() {
    let url = pg_server::shared().database().await;
    let pg = store(&url).await;
    let now = idemgate::clock::now();
    let record = started("nul", &["primary"], now);
    let id = record.job.id.clone();
    pg.claim(record, now).await.unwrap();
    let fail = Transition::FailAttempt {
        n: 1,
        kind: idemgate::job::Failure::Failed,
        upstream_status: Some(400),
        error: Some("the provider answered 400 bad\0code".into()),
    };
    pg.apply(&id, fail, now).await.unwrap().outcome.unwrap();
    let error: String = sql(&url)
        .await
        .query_one("SELECT error FROM attempts WHERE job_id = $1", &[&id])
        .await
        .unwrap()
        .get(0);
    assert_eq!(error, "the provider answered 400 bad\u{FFFD}code");
}
