//! Scenarios run against every store several gateways share (Redis, PostgreSQL): each takes
//! the gateways' store clients and asserts what reached the providers and what every client
//! got.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Method;
use idemgate::store::JobStore;

use super::*;

const CHAT: &str = "/v1/chat/completions";

/// 50 concurrent duplicates, split across the two gateways: one provider call, one job id.
pub async fn fifty_duplicates_make_one_call(a: Arc<dyn JobStore>, b: Arc<dyn JobStore>) {
    let mut primary = HeldProvider::start().await;
    let route = two_provider_config(&primary.url(), "", None, "");
    let a = Arc::new(TestGateway::start_on(&route, a).await);
    let b = Arc::new(TestGateway::start_on(&route, b).await);
    let mut clicks = Vec::new();
    for i in 0..50 {
        let gw = if i % 2 == 0 { a.clone() } else { b.clone() };
        clicks.push(tokio::spawn(async move {
            gw.post(CHAT, Some("shared-click"), chat_request()).await
        }));
    }
    let call = primary.next_call().await;
    primary
        .assert_no_call_within(Duration::from_millis(300))
        .await;
    call.answer(200, fixture("openai-chat-completion.json"));
    let mut ids = std::collections::HashSet::new();
    for click in clicks {
        let reply = click.await.unwrap();
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.body, fixture("openai-chat-completion.json"));
        ids.insert(reply.job_id());
    }
    assert_eq!(ids.len(), 1, "one job id across both gateways");
    assert_eq!(primary.calls(), 1, "one upstream call across both gateways");
}

/// Gateway A hedges; the hedge (attempt 2) answers first and wins, the primary (attempt 1),
/// though first to start, answers later and loses; a duplicate on gateway B gets the
/// winner's answer. Returns the job id, once B sees attempt 1 `lost_race`.
pub async fn a_hedged_race_has_one_winner(a: Arc<dyn JobStore>, b: Arc<dyn JobStore>) -> String {
    let mut primary = HeldProvider::start().await;
    let mut fallback = HeldProvider::start().await;
    let route = two_provider_config(
        &primary.url(),
        "",
        Some(&fallback.url()),
        "hedge_after = \"100ms\"",
    );
    let a = Arc::new(TestGateway::start_on(&route, a).await);
    let b = Arc::new(TestGateway::start_on(&route, b).await);

    let first = {
        let a = a.clone();
        tokio::spawn(async move { a.post(CHAT, Some("k-race"), chat_request()).await })
    };
    let primary_call = primary.next_call().await;
    let fallback_call = fallback.next_call().await;
    // A duplicate on the other gateway waits for the job.
    let duplicate = {
        let b = b.clone();
        tokio::spawn(async move { b.post(CHAT, Some("k-race"), chat_request()).await })
    };
    fallback_call.answer(200, Bytes::from_static(br#"{"from":"fallback"}"#));
    let first = first.await.unwrap();
    let duplicate = duplicate.await.unwrap();
    assert_eq!(first.body, Bytes::from_static(br#"{"from":"fallback"}"#));
    assert_eq!(duplicate.body, first.body);
    assert_eq!(duplicate.job_id(), first.job_id());
    assert_eq!(duplicate.header("x-idempotency-attempt"), Some("2"));

    primary_call.answer(200, Bytes::from_static(br#"{"from":"primary"}"#));
    let id = first.job_id();
    let view = b
        .job_eventually(&id, |v| v["attempts"][0]["state"] == "lost_race")
        .await;
    assert_eq!(view["job"]["completed_by"], 2);
    let replay = b.post(CHAT, Some("k-race"), chat_request()).await;
    assert_eq!(
        replay.body,
        Bytes::from_static(br#"{"from":"fallback"}"#),
        "the loser's body is never served"
    );
    assert_eq!((primary.calls(), fallback.calls()), (1, 1));
    id
}

/// The store stops (`stop`) under a gateway that served traffic: requests are refused with
/// 503 `store-unavailable` and never reach the provider, `/readyz` says 503; once it is
/// back (`start`) traffic resumes without restarting the gateway.
pub async fn an_outage_fails_closed_and_traffic_resumes(
    store: Arc<dyn JobStore>,
    stop: impl AsyncFnOnce(),
    start: impl AsyncFnOnce(),
) {
    let provider = wiremock::MockServer::start().await;
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_body_string("ok"))
        .mount(&provider)
        .await;
    let gw =
        TestGateway::start_on(&two_provider_config(&provider.uri(), "", None, ""), store).await;
    for i in 0..5 {
        let key = format!("k-before-{i}");
        assert_eq!(gw.post(CHAT, Some(&key), chat_request()).await.status, 200);
    }
    stop().await;
    for i in 0..5 {
        let key = format!("k-down-{i}");
        gw.post(CHAT, Some(&key), chat_request())
            .await
            .assert_problem(503, "store-unavailable");
    }
    let c = client();
    let readyz = format!("{}/readyz", gw.admin);
    let ready = send(&c, Method::GET, &readyz, &[], Bytes::new()).await;
    assert_eq!(ready.status, 503);
    assert_eq!(
        received(&provider).await,
        5,
        "no upstream call without a claim"
    );

    start().await;
    // The connections come back by themselves; a few bounded tries to notice.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let reply = gw.post(CHAT, Some("k-after"), chat_request()).await;
        if reply.status == 200 {
            break;
        }
        reply.assert_problem(503, "store-unavailable");
        assert!(
            tokio::time::Instant::now() < deadline,
            "traffic never resumed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(received(&provider).await, 6);
    let ready = send(&c, Method::GET, &readyz, &[], Bytes::new()).await;
    assert_eq!(ready.status, 200);
}

/// A gateway process on `store` (a `[store]` table's lines) with `lease`, beside the
/// provider; its config file lives in `dir`.
async fn doomed_gateway(
    dir: &std::path::Path,
    store: &str,
    lease: &str,
    provider: &str,
) -> Process {
    let (port, admin_port) = (free_port().await, free_port().await);
    let file = dir.join("idemgate.toml");
    std::fs::write(
        &file,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin_port}\"\nadmin_token_env = \"{ADMIN_TOKEN_ENV}\"\n\
             [store]\n{store}\n[idempotency]\nlease = \"{lease}\"\n{}",
            two_provider_config(provider, "", None, "")
        ),
    )
    .unwrap();
    spawn_gateway(&file, port, admin_port).await
}

/// Posts `key` to the doomed gateway until its attempt is with the provider: the held call
/// and the request that waits for it. A gateway process just started may refuse the first
/// request (its store not yet answering within `op_timeout` on a loaded machine: a 503,
/// and nothing sent upstream), so a request that is answered before any call arrives is
/// sent again, a bounded number of times.
async fn cut_mid_attempt(
    doomed: &Process,
    key: &'static str,
    provider: &mut HeldProvider,
) -> (HeldCall, tokio::task::JoinHandle<Option<u16>>) {
    let mut cut = post_in_background(&doomed.base, key);
    for _ in 0..5 {
        tokio::select! {
            call = provider.next_call() => return (call, cut),
            answered = &mut cut => {
                eprintln!("the doomed gateway answered {answered:?} before calling; sending again");
                cut = post_in_background(&doomed.base, key);
            }
        }
    }
    panic!("the doomed gateway never called the provider");
}

/// A gateway process on `store` (its `[store]` lines) is killed (-9) while its attempt is
/// with the provider; another gateway (on `survivor`) finds the job `unknown` and never
/// calls the provider again.
pub async fn a_gateway_killed_mid_attempt_leaves_the_job_unknown(
    store: &str,
    survivor: Arc<dyn JobStore>,
) {
    let mut provider = HeldProvider::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut doomed = doomed_gateway(dir.path(), store, "300ms", &provider.url()).await;
    let (_held, cut) = cut_mid_attempt(&doomed, "k-killed", &mut provider).await;
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    let _ = bounded("the cut request", cut).await;

    let survivor = TestGateway::start_on(
        &format!(
            "[idempotency]\nlease = \"300ms\"\n{}",
            two_provider_config(&provider.url(), "", None, "")
        ),
        survivor,
    )
    .await;
    let reply = survivor.post(CHAT, Some("k-killed"), chat_request()).await;
    reply.assert_problem(409, "outcome-unknown");
    let view = survivor.job(&reply.job_id()).await;
    assert_eq!(view["job"]["state"], "unknown");
    assert_eq!(provider.calls(), 1, "never a second upstream call");
}

/// A gateway process is killed (-9) mid-attempt and nobody asks for the key again: the
/// other gateway's lease sweep lists the orphan `unknown` within `lease` + 10 s.
pub async fn an_orphan_of_kill_9_is_listed_unknown_by_another_gateway(
    store: &str,
    survivor: Arc<dyn JobStore>,
) {
    let mut provider = HeldProvider::start().await;
    let dir = tempfile::tempdir().unwrap();
    // The survivor runs from the start, as a second replica would.
    let survivor = TestGateway::start_on(
        &format!(
            "[idempotency]\nlease = \"1s\"\n{}",
            two_provider_config(&provider.url(), "", None, "")
        ),
        survivor,
    )
    .await;
    let mut doomed = doomed_gateway(dir.path(), store, "1s", &provider.url()).await;
    let (_held, cut) = cut_mid_attempt(&doomed, "k-orphan", &mut provider).await;
    doomed.child.kill().unwrap();
    doomed.child.wait().unwrap();
    let killed_at = tokio::time::Instant::now();
    let _ = bounded("the cut request", cut).await;

    wait_orphan_listed_unknown(
        &survivor.admin,
        "k-orphan",
        Duration::from_secs(1),
        killed_at,
    )
    .await;
    assert_eq!(provider.calls(), 1, "never a second upstream call");
}
