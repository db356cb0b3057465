//! Several gateways sharing one Redis: one identity per intent across instances, fail-closed
//! when Redis is gone, and the store round trips a request costs.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::redis_server::RedisServer;
use common::*;
use idemgate::job::ExpiryPolicy;
use idemgate::store::redis::RedisStore;
use idemgate::store::JobStore;

const CHAT: &str = "/v1/chat/completions";

const POLICY: ExpiryPolicy = ExpiryPolicy {
    retention: Duration::from_secs(3600),
    late_result_window: Duration::from_secs(600),
};

async fn store(server: &RedisServer) -> Arc<RedisStore> {
    let config = common::redis_server::store_config(server.url());
    Arc::new(RedisStore::open(&config, POLICY).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_duplicates_split_across_two_gateways_make_one_call() {
    let server = RedisServer::start().await;
    shared_stores::fifty_duplicates_make_one_call(store(&server).await, store(&server).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_race_across_instances_has_one_winner() {
    let server = RedisServer::start().await;
    shared_stores::a_hedged_race_has_one_winner(store(&server).await, store(&server).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_closed_and_traffic_resumes_when_it_is_back() {
    let server = tokio::sync::Mutex::new(RedisServer::start().await);
    let redis = store(&*server.lock().await).await;
    shared_stores::an_outage_fails_closed_and_traffic_resumes(
        redis,
        async || server.lock().await.stop(),
        async || server.lock().await.restart().await,
    )
    .await;
}

/// A request through `gw`, and the round trips the store made for it.
async fn post_counted(gw: &TestGateway, redis: &RedisStore, key: &str) -> (Reply, u64) {
    let before = redis.round_trips();
    let reply = gw.post(CHAT, Some(key), chat_request()).await;
    (reply, redis.round_trips() - before)
}

/// A Redis command whose reply is not needed, such as `CONFIG RESETSTAT`.
async fn command(c: &mut redis::aio::MultiplexedConnection, name: &str, arg: &str) {
    let _: () = redis::cmd(name).arg(arg).query_async(c).await.unwrap();
}

/// The scripts the server ran since its statistics were last reset.
async fn scripts_run(c: &mut redis::aio::MultiplexedConnection) -> u64 {
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(c)
        .await
        .unwrap();
    stats
        .lines()
        .filter(|l| l.starts_with("cmdstat_evalsha:") || l.starts_with("cmdstat_eval:"))
        .filter_map(|l| {
            l.split("calls=")
                .nth(1)?
                .split(',')
                .next()?
                .parse::<u64>()
                .ok()
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_job_costs_two_round_trips_and_a_replay_one() {
    let server = RedisServer::start().await;
    let redis = store(&server).await;
    let (gw, _provider) = TestGateway::answering_ok(redis.clone()).await;

    // Load the scripts once, so the counts below are not skewed by a NOSCRIPT fallback.
    assert_eq!(
        gw.post(CHAT, Some("k-warm"), chat_request()).await.status,
        200
    );
    let mut c = server.connection().await;

    command(&mut c, "CONFIG", "RESETSTAT").await;
    let (first, trips) = post_counted(&gw, &redis, "k-trips").await;
    assert_eq!(first.status, 200);
    assert_eq!(trips, 2, "claim (with attempt 1) and settle");
    assert_eq!(
        scripts_run(&mut c).await,
        2,
        "two scripts ran on the server"
    );

    command(&mut c, "CONFIG", "RESETSTAT").await;
    let (replay, trips) = post_counted(&gw, &redis, "k-trips").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(trips, 1, "a replay is the claim alone");
    assert_eq!(scripts_run(&mut c).await, 1);
}

/// A claim that names a job Redis no longer holds (its hash evicted, or expired first) does
/// not block the key for the rest of its TTL: the next request takes the claim over with a
/// new job, and that job's answer is what the key replays from then on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_whose_job_is_gone_is_taken_over_by_a_new_job() {
    let server = RedisServer::start().await;
    let redis = store(&server).await;
    let (gw, provider) = TestGateway::answering_ok(redis.clone()).await;
    let first = gw.post(CHAT, Some("k-gone"), chat_request()).await;
    assert_eq!(first.status, 200);

    let mut c = server.connection().await;
    let jobs: Vec<String> = redis::cmd("KEYS")
        .arg("idemgate:{*}:job:*")
        .query_async(&mut c)
        .await
        .unwrap();
    assert_eq!(jobs.len(), 1, "{jobs:?}");
    command(&mut c, "DEL", &jobs[0]).await;

    let second = gw.post(CHAT, Some("k-gone"), chat_request()).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("idempotent-replayed"), Some("false"));
    assert_ne!(second.job_id(), first.job_id());
    let third = gw.post(CHAT, Some("k-gone"), chat_request()).await;
    assert_eq!(third.header("idempotent-replayed"), Some("true"));
    assert_eq!(third.job_id(), second.job_id());
    let calls = provider.received_requests().await.unwrap_or_default();
    assert_eq!(
        calls.len(),
        2,
        "the first job and the one that took its claim over"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_lost_the_scripts_is_sent_them_again_and_runs_each_once() {
    let server = RedisServer::start().await;
    let redis = store(&server).await;
    let (gw, provider) = TestGateway::answering_ok(redis.clone()).await;
    assert_eq!(
        gw.post(CHAT, Some("k-before"), chat_request()).await.status,
        200
    );

    // As after a restart without persistence, or a failover to a replica that never ran them.
    let mut c = server.connection().await;
    command(&mut c, "SCRIPT", "FLUSH").await;
    let (first, trips) = post_counted(&gw, &redis, "k-after").await;
    assert_eq!(first.status, 200);
    assert_eq!(trips, 6, "claim and settle each: refused, loaded, run");
    let replay = gw.post(CHAT, Some("k-after"), chat_request()).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.body, first.body);
    assert_eq!(
        replay.header("x-idempotency-job-id"),
        first.header("x-idempotency-job-id")
    );
    let calls = provider.received_requests().await.unwrap_or_default();
    assert_eq!(calls.len(), 2, "one call per intent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_attempt_leaves_the_job_unknown_never_rerun() {
    let server = RedisServer::start().await;
    let lines = format!("kind = \"redis\"\nurl = \"{}\"", server.url());
    shared_stores::a_gateway_killed_mid_attempt_leaves_the_job_unknown(
        &lines,
        store(&server).await,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_live_for_retention_after_settling_and_longer_while_unsettled() {
    let server = RedisServer::start().await;
    let mut provider = HeldProvider::start().await;
    // The gateway's retention matches the store's POLICY: 1h, and 10m for late answers.
    let route = format!(
        "[idempotency]\nretention = \"1h\"\n{}",
        two_provider_config(&provider.url(), "", None, "")
    );
    let gw = Arc::new(TestGateway::start_on(&route, store(&server).await).await);
    let mut c = server.connection().await;
    let pttls = |pattern: &'static str| {
        let mut c = c.clone();
        async move {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(pattern)
                .query_async(&mut c)
                .await
                .unwrap();
            let mut ttls = Vec::new();
            for key in keys {
                let ttl: i64 = redis::cmd("PTTL")
                    .arg(&key)
                    .query_async(&mut c)
                    .await
                    .unwrap();
                ttls.push((key, ttl));
            }
            ttls
        }
    };
    let running = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("k-ttl"), chat_request()).await })
    };
    let call = provider.next_call().await;
    let unsettled = (POLICY.retention + POLICY.late_result_window).as_millis() as i64;
    // A job's own keys (the store-wide indexes hold entries, not jobs, and live on).
    let ttls = pttls("idemgate:{*").await;
    assert_eq!(ttls.len(), 2, "claim and job: {ttls:?}");
    for (key, ttl) in &ttls {
        assert!(
            *ttl > unsettled - 60_000 && *ttl <= unsettled,
            "{key}: {ttl}"
        );
    }
    call.answer(200, Bytes::from_static(b"{}"));
    assert_eq!(running.await.unwrap().status, 200);
    let settled = POLICY.retention.as_millis() as i64;
    let ttls = pttls("idemgate:{*").await;
    assert_eq!(ttls.len(), 3, "claim, job and answer: {ttls:?}");
    for (key, ttl) in &ttls {
        assert!(*ttl > settled - 60_000 && *ttl <= settled, "{key}: {ttl}");
    }
    let _: () = redis::cmd("FLUSHALL").query_async(&mut c).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_orphaned_by_kill_9_is_listed_unknown_by_another_gateway_s_sweep() {
    let server = RedisServer::start().await;
    let lines = format!("kind = \"redis\"\nurl = \"{}\"", server.url());
    shared_stores::an_orphan_of_kill_9_is_listed_unknown_by_another_gateway(
        &lines,
        store(&server).await,
    )
    .await;
}

/// How many PUBLISH commands the server has run, scripts' included.
async fn publishes(server: &RedisServer) -> u64 {
    let mut connection = server.connection().await;
    let stats: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut connection)
        .await
        .unwrap();
    stats
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_publish:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_is_published_only_while_someone_waits_for_it() {
    use idemgate::job::{new_job_id, shard_tag, JobRecord, Transition};
    use idemgate::store::Claim;

    let server = RedisServer::start().await;
    let (runner, other) = (store(&server).await, store(&server).await);
    let now = idemgate::clock::now();
    let record = JobRecord::new(
        new_job_id("owner", "watched"),
        "owner".into(),
        "watched".into(),
        "fp".into(),
        "chat".into(),
        now,
        now + Duration::from_secs(30),
        &POLICY,
    );
    let Claim::Created(record) = runner.claim(record, now).await.unwrap() else {
        panic!("a new job");
    };
    let id = record.job.id.clone();
    let start = Transition::StartAttempt {
        version: record.job.version,
        n: 1,
        provider: "p".into(),
    };
    let before = publishes(&server).await;
    let started = runner.apply(&id, start, now).await.unwrap();
    assert!(started.outcome.is_ok());
    assert_eq!(publishes(&server).await, before, "nobody waits: no publish");

    // A duplicate on another gateway waits for the job to change.
    let version = started.record.job.version;
    let waiter = {
        let other = other.clone();
        let (id, state) = (id.clone(), started.record.job.state);
        tokio::spawn(async move {
            other
                .wait_change(&id, version, state, Duration::from_secs(10))
                .await
        })
    };
    let watch = format!("idemgate:{{{}}}:watch:{id}", shard_tag(&id).unwrap());
    let mut connection = server.connection().await;
    let mut watched = false;
    for _ in 0..500 {
        watched = redis::cmd("EXISTS")
            .arg(&watch)
            .query_async::<bool>(&mut connection)
            .await
            .unwrap();
        if watched {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(watched, "the waiter marks the job watched");
    let complete = Transition::Complete {
        n: 1,
        response: idemgate::job::StoredResponse {
            status: 200,
            headers: Vec::new().into(),
            body: Bytes::from_static(b"{}"),
            body_omitted: false,
        },
    };
    let settled = runner.apply(&id, complete, now).await.unwrap();
    assert!(settled.outcome.is_ok());
    assert_eq!(publishes(&server).await, before + 1, "the waiter is told");
    let started_waiting = tokio::time::Instant::now();
    let seen = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter wakes")
        .unwrap()
        .unwrap();
    assert_eq!(seen.job.state, idemgate::job::JobState::Succeeded);
    assert!(
        started_waiting.elapsed() < Duration::from_secs(5),
        "woken by the change, not by its deadline"
    );
}
