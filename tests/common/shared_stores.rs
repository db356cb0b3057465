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
