//! End-to-end behaviour of the gateway against real HTTP providers, asserting what reached
//! the providers and what the store holds, not only status codes.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Method;
use serde_json::json;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const CHAT: &str = "/v1/chat/completions";

/// One route `chat` over `providers` (name, url, timeout), with extra route keys.
fn config(providers: &[(&str, &str, &str)], route: &str) -> String {
    let mut text = String::from("[store]\nkind = \"memory\"\n");
    for (name, url, timeout) in providers {
        text.push_str(&format!(
            "[[providers]]\nname = \"{name}\"\nbase_url = \"{url}\"\ntimeout = \"{timeout}\"\n"
        ));
    }
    let names: Vec<String> = providers
        .iter()
        .map(|(n, _, _)| format!("\"{n}\""))
        .collect();
    text.push_str(&format!(
        "[[routes]]\nname = \"chat\"\nmethods = [\"POST\"]\npath_prefix = \"{CHAT}\"\nproviders = [{}]\n{route}\n",
        names.join(", ")
    ));
    text
}

// ---- 1. double click ----------------------------------------------------------------------

async fn double_click(n: usize) {
    let mut primary = HeldProvider::start().await;
    let gw = TestGateway::start(&config(&[("primary", &primary.url(), "30s")], "")).await;
    let gw = std::sync::Arc::new(gw);
    let mut clicks = Vec::new();
    for _ in 0..n {
        let gw = gw.clone();
        clicks.push(tokio::spawn(async move {
            gw.post(CHAT, Some("click-1"), chat_request()).await
        }));
    }
    let call = primary.next_call().await;
    // While the first call is held, no duplicate may reach the provider.
    primary
        .assert_no_call_within(Duration::from_millis(300))
        .await;
    call.answer(200, fixture("openai-chat-completion.json"));
    let mut replies = Vec::new();
    for click in clicks {
        replies.push(click.await.unwrap());
    }
    assert_eq!(primary.calls(), 1, "one upstream call for {n} clicks");
    let id = replies[0].job_id();
    for reply in &replies {
        assert_eq!(reply.status, 200, "{reply:?}");
        assert_eq!(reply.job_id(), id);
        assert_eq!(reply.body, fixture("openai-chat-completion.json"));
        assert_eq!(reply.header("x-idempotency-attempt"), Some("1"));
        assert_eq!(reply.header("x-idempotency-provider"), Some("primary"));
    }
    let first = replies
        .iter()
        .filter(|r| r.header("idempotent-replayed") == Some("false"))
        .count();
    assert_eq!(
        first, 1,
        "exactly one reply is the original, the rest are replays"
    );
    let view = gw.job(&id).await;
    assert_eq!(view["job"]["state"], "succeeded");
    assert_eq!(view["attempts"].as_array().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn double_click_two_requests_make_one_call() {
    double_click(2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_duplicates_make_one_call() {
    double_click(50).await;
}

// ---- 2. same key, other payload -----------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_with_different_body_is_a_conflict_and_reordered_json_is_a_replay() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let first = gw.post(CHAT, Some("k-reuse"), chat_request()).await;
    assert_eq!(first.status, 200);

    let other = Bytes::from(
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say goodbye."}]}"#,
    );
    let conflict = gw.post(CHAT, Some("k-reuse"), other).await;
    conflict.assert_problem(409, "idempotency-key-reused");
    assert_eq!(conflict.json()["job_id"], first.job_id());
    assert_eq!(
        received(&primary).await,
        1,
        "a conflict never reaches the provider"
    );

    let reordered = Bytes::from(
        r#"{ "max_tokens" : 64, "temperature": 0,
             "messages": [ {"content": "You are a terse assistant. Answer in JSON.", "role": "system"},
                           {"content": "Say hello.", "role": "user"} ],
             "model": "gpt-4o-mini" }"#,
    );
    let replay = gw.post(CHAT, Some("k-reuse"), reordered).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.job_id(), first.job_id());
    assert_eq!(replay.body, first.body);
    assert_eq!(received(&primary).await, 1);

    // The existing job is untouched by the conflict.
    let view = gw.job(&first.job_id()).await;
    assert_eq!(view["job"]["state"], "succeeded");
    assert_eq!(view["job"]["version"], 2);
}

/// Repeats of a replayed request are answered from their bytes; a payload of other bytes
/// is still fingerprinted, so it is a conflict (or a replay, when only its spelling
/// differs) however often the first one was repeated before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repeated_replays_still_tell_other_payloads_apart() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let first = gw.post(CHAT, Some("k-repeat"), chat_request()).await;
    assert_eq!(first.status, 200);
    for _ in 0..3 {
        let replay = gw.post(CHAT, Some("k-repeat"), chat_request()).await;
        assert_eq!(replay.status, 200);
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
        assert_eq!(
            (replay.job_id(), &replay.body),
            (first.job_id(), &first.body)
        );
    }
    let other = Bytes::from(
        r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say goodbye."}]}"#,
    );
    let conflict = gw.post(CHAT, Some("k-repeat"), other).await;
    conflict.assert_problem(409, "idempotency-key-reused");
    let mut respaced = chat_request().to_vec();
    respaced.insert(1, b' ');
    let replay = gw.post(CHAT, Some("k-repeat"), respaced.into()).await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    // The same bytes to another path are another intent.
    let elsewhere = gw
        .post(
            "/v1/chat/completions?stream_options=none",
            Some("k-repeat"),
            chat_request(),
        )
        .await;
    elsewhere.assert_problem(409, "idempotency-key-reused");
    let again = gw.post(CHAT, Some("k-repeat"), chat_request()).await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(received(&primary).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_payload_while_the_first_runs_is_reuse_not_in_progress() {
    let mut primary = HeldProvider::start().await;
    let gw = std::sync::Arc::new(
        TestGateway::start(&config(&[("primary", &primary.url(), "30s")], "")).await,
    );
    let first = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("k-busy"), chat_request()).await })
    };
    let call = primary.next_call().await;
    let conflict = gw
        .post(
            CHAT,
            Some("k-busy"),
            Bytes::from_static(b"{\"other\":true}"),
        )
        .await;
    conflict.assert_problem(409, "idempotency-key-reused");
    call.answer(200, fixture("openai-chat-completion.json"));
    assert_eq!(first.await.unwrap().status, 200);
    assert_eq!(primary.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_still_running_after_the_wait_gets_request_in_progress() {
    let mut primary = HeldProvider::start().await;
    let gw = std::sync::Arc::new(
        TestGateway::start(&format!(
            "[idempotency]\nwait_for_in_flight = \"200ms\"\n{}",
            config(&[("primary", &primary.url(), "30s")], "")
        ))
        .await,
    );
    let first = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("k-wait"), chat_request()).await })
    };
    let call = primary.next_call().await;
    let busy = gw.post(CHAT, Some("k-wait"), chat_request()).await;
    busy.assert_problem(409, "request-in-progress");
    assert_eq!(busy.header("retry-after"), Some("1"));
    assert!(busy.header("x-idempotency-job-id").is_some());
    call.answer(200, fixture("openai-chat-completion.json"));
    let first = first.await.unwrap();
    assert_eq!(busy.job_id(), first.job_id());
    assert_eq!(primary.calls(), 1);
}

// ---- 3. timeout → unknown -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn timeout_is_unknown_blocks_attempts_and_the_late_answer_settles_it() {
    let mut primary = HeldProvider::start().await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.url(), "300ms"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "",
    ))
    .await;

    let timed_out = gw.post(CHAT, Some("k-timeout"), chat_request()).await;
    timed_out.assert_problem(504, "outcome-unknown");
    let id = timed_out.job_id();
    assert_eq!(timed_out.json()["job_id"], id);
    let call = primary.next_call().await;

    let view = gw.job(&id).await;
    assert_eq!(view["job"]["state"], "unknown");
    assert_eq!(
        view["job"]["version"], 1,
        "marking unknown does not bump the version"
    );
    assert_eq!(view["attempts"][0]["state"], "unknown");
    assert_eq!(received(&fallback).await, 0, "no failover after a timeout");

    let retry = gw.post(CHAT, Some("k-timeout"), chat_request()).await;
    retry.assert_problem(409, "outcome-unknown");
    assert_eq!(retry.job_id(), id);
    assert_eq!(primary.calls(), 1);
    assert_eq!(received(&fallback).await, 0);

    // The late answer lands and settles the job through the compare-and-swap.
    call.answer(
        200,
        Bytes::from_static(br#"{"late":true,"choices":[{"message":{}}]}"#),
    );
    let view = gw.wait_job_change(&id, 1, "unknown").await;
    assert_eq!(view["job"]["state"], "succeeded");
    assert_eq!(view["job"]["completed_by"], 1);
    assert_eq!(view["attempts"][0]["state"], "succeeded");

    let replay = gw.post(CHAT, Some("k-timeout"), chat_request()).await;
    assert_eq!(replay.status, 200);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.body,
        Bytes::from_static(br#"{"late":true,"choices":[{"message":{}}]}"#)
    );
    assert_eq!(primary.calls(), 1);
    assert_eq!(received(&fallback).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_504_is_unknown_not_a_failover() {
    let primary = answering(ResponseTemplate::new(504)).await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), "30s"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-504"), chat_request()).await;
    reply.assert_problem(504, "outcome-unknown");
    assert_eq!(received(&fallback).await, 0);
    let view = gw.job(&reply.job_id()).await;
    assert_eq!(view["job"]["state"], "unknown");
}

// ---- 4. reverse-order finish ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hedged_primary_that_answers_last_loses_the_race() {
    let mut primary = HeldProvider::start().await;
    let mut fallback = HeldProvider::start().await;
    let gw = std::sync::Arc::new(
        TestGateway::start(&config(
            &[
                ("primary", &primary.url(), "30s"),
                ("fallback", &fallback.url(), "30s"),
            ],
            "hedge_after = \"100ms\"",
        ))
        .await,
    );
    let client = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("k-race"), chat_request()).await })
    };
    let primary_call = primary.next_call().await;
    let fallback_call = fallback.next_call().await;
    assert_eq!(
        primary_call.headers["idempotency-key"],
        fallback_call.headers["idempotency-key"]
    );

    fallback_call.answer(200, Bytes::from_static(br#"{"from":"fallback"}"#));
    let reply = client.await.unwrap();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, Bytes::from_static(br#"{"from":"fallback"}"#));
    assert_eq!(reply.header("x-idempotency-attempt"), Some("2"));
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    let id = reply.job_id();

    primary_call.answer(200, Bytes::from_static(br#"{"from":"primary"}"#));
    let view = gw
        .job_eventually(&id, |v| v["attempts"][0]["state"] == "lost_race")
        .await;
    assert_eq!(view["job"]["completed_by"], 2);
    assert_eq!(view["job"]["state"], "succeeded");
    assert_eq!(view["job"]["version"], 2);
    assert_eq!(view["attempts"][1]["state"], "succeeded");
    assert_eq!(view["attempts"][0]["provider"], "primary");

    let replay = gw.post(CHAT, Some("k-race"), chat_request()).await;
    assert_eq!(replay.body, Bytes::from_static(br#"{"from":"fallback"}"#));
    assert_eq!(replay.header("x-idempotency-attempt"), Some("2"));
    assert_eq!((primary.calls(), fallback.calls()), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_hedge_while_the_primary_is_answering() {
    let primary = answering(completion()).await;
    let mut fallback = HeldProvider::start().await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), "30s"),
            ("fallback", &fallback.url(), "30s"),
        ],
        "hedge_after = \"5s\"",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-nohedge"), chat_request()).await;
    assert_eq!(reply.status, 200);
    fallback
        .assert_no_call_within(Duration::from_millis(100))
        .await;
    assert_eq!(fallback.calls(), 0);
}

// ---- 5. failover --------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_on_503_goes_to_the_fallback() {
    let primary = answering(
        ResponseTemplate::new(503)
            .set_body_raw(fixture("openai-error-500.json"), "application/json"),
    )
    .await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), "30s"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-503"), chat_request()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-attempt"), Some("2"));
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    assert_eq!(
        (received(&primary).await, received(&fallback).await),
        (1, 1)
    );
    let view = gw.job(&reply.job_id()).await;
    assert_eq!(view["attempts"][0]["state"], "failed");
    assert_eq!(view["attempts"][0]["upstream_status"], 503);
    assert_eq!(view["attempts"][1]["state"], "succeeded");
    assert_eq!(view["job"]["completed_by"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_on_connection_refused() {
    let dead = closed_port().await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &format!("http://{dead}"), "30s"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-refused"), chat_request()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    let view = gw.job(&reply.job_id()).await;
    assert_eq!(view["attempts"][0]["state"], "failed");
    assert!(view["attempts"][0]["error"]
        .as_str()
        .unwrap()
        .contains("connect"));
    assert_eq!(received(&fallback).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_400_is_final_stored_and_replayed_without_failover() {
    let error = fixture("openai-error-400-context-length.json");
    let primary =
        answering(ResponseTemplate::new(400).set_body_raw(error.clone(), "application/json")).await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), "30s"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-400"), chat_request()).await;
    assert_eq!(reply.status, 400);
    assert_eq!(
        reply.body, error,
        "the provider's error passes through untouched"
    );
    assert_eq!(reply.header("idempotent-replayed"), Some("false"));
    let replay = gw.post(CHAT, Some("k-400"), chat_request()).await;
    assert_eq!(replay.status, 400);
    assert_eq!(replay.body, error);
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        (received(&primary).await, received(&fallback).await),
        (1, 0)
    );
    assert_eq!(gw.job(&reply.job_id()).await["job"]["state"], "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_providers_failing_fails_the_job_and_a_retry_opens_a_new_round() {
    let primary = MockServer::start().await;
    let fallback = answering(ResponseTemplate::new(503).set_body_string("fallback down")).await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(500)
                .set_body_raw(fixture("openai-error-500.json"), "application/json"),
        )
        .up_to_n_times(1)
        .mount(&primary)
        .await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), "30s"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "",
    ))
    .await;
    let failed = gw.post(CHAT, Some("k-allfail"), chat_request()).await;
    assert_eq!(
        failed.status, 503,
        "the client gets the last upstream answer"
    );
    assert_eq!(failed.body, "fallback down");
    assert_eq!(failed.header("x-idempotency-attempt"), Some("2"));
    let id = failed.job_id();
    let view = gw.job(&id).await;
    assert_eq!(view["job"]["state"], "failed");
    assert_eq!(view["job"]["version"], 2);

    // The primary recovers; the retry re-opens the same job with the next ordinals.
    Mock::given(method("POST"))
        .respond_with(completion())
        .mount(&primary)
        .await;
    let retry = gw.post(CHAT, Some("k-allfail"), chat_request()).await;
    assert_eq!(retry.status, 200);
    assert_eq!(retry.job_id(), id);
    assert_eq!(retry.header("x-idempotency-attempt"), Some("3"));
    assert_eq!(retry.header("idempotent-replayed"), Some("false"));
    let view = gw.job(&id).await;
    assert_eq!(view["job"]["state"], "succeeded");
    assert_eq!(view["job"]["completed_by"], 3);
    assert_eq!(
        view["job"]["version"], 4,
        "failed (+1), re-opened (+1), completed (+1)"
    );
    let states: Vec<_> = view["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["state"].clone())
        .collect();
    assert_eq!(
        states,
        vec![json!("failed"), json!("failed"), json!("succeeded")]
    );
    assert_eq!(view["attempts"][2]["read_version"], 3);
    assert_eq!(
        (received(&primary).await, received(&fallback).await),
        (2, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_provider_answering_is_all_providers_failed() {
    let dead = closed_port().await;
    let gw = TestGateway::start(&config(
        &[("primary", &format!("http://{dead}"), "30s")],
        "",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-none"), chat_request()).await;
    reply.assert_problem(502, "all-providers-failed");
    let id = reply.job_id();
    assert_eq!(reply.json()["job_id"], id);
    assert_eq!(gw.job(&id).await["job"]["state"], "failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_whose_gateway_died_is_unknown_once_its_lease_lapses() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    // Another gateway claimed the key, started an attempt, and died: its lease runs out.
    let mut headers = http::HeaderMap::new();
    headers.insert("authorization", "Bearer sk-client-1".parse().unwrap());
    let owner = idemgate::intent::owner(&idemgate::intent::OwnerMode::Bearer, &headers).unwrap();
    let fingerprint = idemgate::intent::fingerprint("POST", CHAT, &chat_request(), &[]);
    let now = idemgate::clock::now();
    let policy = idemgate::job::ExpiryPolicy {
        retention: Duration::from_secs(60),
        late_result_window: Duration::from_secs(60),
    };
    let orphan = idemgate::job::JobRecord::new(
        "job_orphan".into(),
        owner,
        "k-orphan".into(),
        fingerprint,
        "chat".into(),
        now,
        now + Duration::from_millis(200),
        &policy,
    );
    let store = gw.running.gateway.store().clone();
    store.claim(orphan, now).await.unwrap();
    store
        .apply(
            "job_orphan",
            idemgate::job::Transition::StartAttempt {
                version: 1,
                n: 1,
                provider: "primary".into(),
            },
            now,
        )
        .await
        .unwrap();

    // Within the lease the newcomer waits; once it lapses, the job is unknown.
    let reply = gw.post(CHAT, Some("k-orphan"), chat_request()).await;
    reply.assert_problem(409, "outcome-unknown");
    assert_eq!(reply.job_id(), "job_orphan");
    let view = gw.job("job_orphan").await;
    assert_eq!(view["job"]["state"], "unknown");
    assert_eq!(view["attempts"][0]["state"], "unknown");
    assert_eq!(received(&primary).await, 0, "never a second upstream call");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_served() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let h2: hyper_util::client::legacy::Client<_, http_body_util::Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .http2_only(true)
            .build_http();
    let reply = send(
        &h2,
        Method::POST,
        &format!("{}{CHAT}", gw.base),
        &[
            ("authorization", "Bearer sk-client-1"),
            ("idempotency-key", "k-h2"),
        ],
        chat_request(),
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, fixture("openai-chat-completion.json"));
    assert_eq!(received(&primary).await, 1);
}

// ---- 6. out-of-band cancel ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_of_an_unknown_job_lets_a_retry_run_and_discards_the_late_answer() {
    let mut primary = HeldProvider::start().await;
    let gw = TestGateway::start(&config(&[("primary", &primary.url(), "300ms")], "")).await;
    let timed_out = gw.post(CHAT, Some("k-cancel"), chat_request()).await;
    timed_out.assert_problem(504, "outcome-unknown");
    let id = timed_out.job_id();
    let late_call = primary.next_call().await;

    let cancelled = gw.admin_post(&format!("/jobs/{id}/cancel")).await;
    assert_eq!(cancelled.status, 200, "{cancelled:?}");
    assert_eq!(cancelled.json()["job"]["state"], "cancelled");
    assert_eq!(cancelled.json()["attempts"][0]["state"], "cancelled");
    assert_eq!(
        gw.admin_post(&format!("/jobs/{id}/cancel")).await.status,
        409
    );

    // The new round runs under the same job, with the next ordinal and a longer timeout.
    let gw = std::sync::Arc::new(gw);
    let retry = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("k-cancel"), chat_request()).await })
    };
    let second_call = primary.next_call().await;
    // The cancelled attempt's late answer arrives first and must be discarded.
    late_call.answer(200, Bytes::from_static(br#"{"from":"cancelled attempt"}"#));
    let view = gw
        .job_eventually(&id, |v| v["attempts"][0]["upstream_status"] == 200)
        .await;
    assert_eq!(view["attempts"][0]["state"], "cancelled");
    assert_eq!(view["job"]["state"], "in_progress");
    second_call.answer(200, Bytes::from_static(br#"{"from":"attempt 2"}"#));
    let retry = retry.await.unwrap();
    // The retry may time out too (300ms); what matters is that only attempt 2 can win.
    let view = gw
        .job_eventually(&id, |v| v["job"]["state"] == "succeeded")
        .await;
    assert_eq!(view["job"]["completed_by"], 2);
    assert_eq!(retry.job_id(), id);
    let replay = gw.post(CHAT, Some("k-cancel"), chat_request()).await;
    assert_eq!(replay.body, Bytes::from_static(br#"{"from":"attempt 2"}"#));
    assert_eq!(primary.calls(), 2);
}

// ---- 7. owners and bad input -----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bearer_owners_are_isolated() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let headers =
        |auth: &'static str| vec![("authorization", auth), ("idempotency-key", "shared-key")];
    let a = gw
        .request(
            Method::POST,
            CHAT,
            &headers("Bearer sk-alice"),
            chat_request(),
        )
        .await;
    let b = gw
        .request(
            Method::POST,
            CHAT,
            &headers("Bearer sk-bob"),
            Bytes::from_static(b"{\"other\":1}"),
        )
        .await;
    assert_eq!((a.status.as_u16(), b.status.as_u16()), (200, 200));
    assert_ne!(a.job_id(), b.job_id());
    assert_eq!(b.header("idempotent-replayed"), Some("false"));
    assert_eq!(received(&primary).await, 2);
    let view = gw.job(&a.job_id()).await;
    let owner = view["job"]["owner"].as_str().unwrap();
    assert_eq!(
        owner.len(),
        64,
        "the owner is a SHA-256, never the credential"
    );
    assert!(!view.to_string().contains("sk-alice"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn header_owners_are_isolated_and_required() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&format!(
        "[idempotency]\nowner = \"header:X-Owner-Id\"\n{}",
        config(&[("primary", &primary.uri(), "30s")], "")
    ))
    .await;
    let a = gw
        .request(
            Method::POST,
            CHAT,
            &[("x-owner-id", "team-a"), ("idempotency-key", "k")],
            chat_request(),
        )
        .await;
    let b = gw
        .request(
            Method::POST,
            CHAT,
            &[("x-owner-id", "team-b"), ("idempotency-key", "k")],
            chat_request(),
        )
        .await;
    let a2 = gw
        .request(
            Method::POST,
            CHAT,
            &[("x-owner-id", "team-a"), ("idempotency-key", "k")],
            chat_request(),
        )
        .await;
    assert_ne!(a.job_id(), b.job_id());
    assert_eq!(a2.job_id(), a.job_id());
    assert_eq!(a2.header("idempotent-replayed"), Some("true"));
    let missing = gw
        .request(
            Method::POST,
            CHAT,
            &[("authorization", "Bearer x"), ("idempotency-key", "k")],
            chat_request(),
        )
        .await;
    missing.assert_problem(401, "missing-owner");
    let detail = missing.json()["detail"].as_str().unwrap().to_owned();
    assert!(detail.to_lowercase().contains("x-owner-id"), "{detail}");
    assert_eq!(received(&primary).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_their_problem_and_touch_nothing() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let auth = ("authorization", "Bearer sk-client-1");
    let too_long = "k".repeat(256);
    type Case<'a> = (Vec<(&'a str, &'a str)>, Bytes, u16, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec![("idempotency-key", "k1")],
            chat_request(),
            401,
            "missing-owner",
        ),
        (vec![auth], chat_request(), 400, "missing-idempotency-key"),
        (
            vec![auth, ("idempotency-key", "")],
            chat_request(),
            400,
            "invalid-idempotency-key",
        ),
        (
            vec![auth, ("idempotency-key", "\"\"")],
            chat_request(),
            400,
            "invalid-idempotency-key",
        ),
        (
            vec![auth, ("idempotency-key", "\"a b\"")],
            chat_request(),
            400,
            "invalid-idempotency-key",
        ),
        (
            vec![auth, ("idempotency-key", "a\tb")],
            chat_request(),
            400,
            "invalid-idempotency-key",
        ),
        (
            vec![auth, ("idempotency-key", &too_long)],
            chat_request(),
            400,
            "invalid-idempotency-key",
        ),
        (
            vec![auth, ("idempotency-key", "k1")],
            Bytes::from(vec![b' '; 11 * 1024 * 1024]),
            413,
            "payload-too-large",
        ),
    ];
    for (headers, body, status, slug) in cases {
        let reply = gw.request(Method::POST, CHAT, &headers, body).await;
        reply.assert_problem(status, slug);
        assert!(
            reply.header("x-idempotency-job-id").is_none(),
            "{slug}: nothing was claimed"
        );
    }
    let no_route = gw
        .request(
            Method::POST,
            "/v2/other",
            &[auth, ("idempotency-key", "k1")],
            chat_request(),
        )
        .await;
    no_route.assert_problem(404, "no-route");
    assert_eq!(
        received(&primary).await,
        0,
        "no bad input reaches the provider"
    );

    // Nothing was stored under k1: a different body under it is a new job, not a conflict.
    let fresh = gw
        .request(
            Method::POST,
            CHAT,
            &[auth, ("idempotency-key", "k1")],
            Bytes::from_static(b"{\"x\":1}"),
        )
        .await;
    assert_eq!(fresh.status, 200);
    assert_eq!(fresh.header("idempotent-replayed"), Some("false"));
    // 255 characters is still a key, and the quoted form names the same key as the bare one.
    let long = "k".repeat(255);
    assert_eq!(
        gw.request(
            Method::POST,
            CHAT,
            &[auth, ("idempotency-key", &long)],
            chat_request()
        )
        .await
        .status,
        200
    );
    let quoted = gw
        .request(
            Method::POST,
            CHAT,
            &[auth, ("idempotency-key", "\"k1\"")],
            Bytes::from_static(b"{\"x\":1}"),
        )
        .await;
    assert_eq!(quoted.job_id(), fresh.job_id());
    assert_eq!(quoted.header("idempotent-replayed"), Some("true"));
    assert_eq!(received(&primary).await, 2);
}

// ---- 8. replays are identical ----------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_are_identical_to_the_first_answer() {
    let primary = answering(
        completion()
            .insert_header("openai-processing-ms", "312")
            .insert_header("x-ratelimit-remaining-requests", "9999")
            .insert_header("connection", "keep-alive"),
    )
    .await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let first = gw.post(CHAT, Some("k-same"), chat_request()).await;
    assert_eq!(first.header("x-request-id"), Some("req_primary"));
    assert_eq!(first.header("openai-processing-ms"), Some("312"));
    assert_eq!(first.header("idempotent-replayed"), Some("false"));
    // The first replay reads the job, the second makes the headers its store keeps for the
    // job's replays, the third is given them.
    for _ in 0..3 {
        let replay = gw.post(CHAT, Some("k-same"), chat_request()).await;
        assert_eq!(first.status, replay.status);
        assert_eq!(first.body, replay.body);
        assert_eq!(comparable_headers(&first), comparable_headers(&replay));
        assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    }
    assert_eq!(received(&primary).await, 1);
}

// ---- routing, pass-through, optional keys -------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safe_methods_and_off_routes_pass_through_without_jobs() {
    let primary = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/api/v1/models"))
        .respond_with(ResponseTemplate::new(200).set_body_string("models"))
        .mount(&primary)
        .await;
    Mock::given(method("POST"))
        .and(path("/api/v1/files"))
        .respond_with(ResponseTemplate::new(201).set_body_string("file"))
        .mount(&primary)
        .await;
    let gw = TestGateway::start(&format!(
        "{}[[routes]]\nname = \"rest\"\npath_prefix = \"/\"\nproviders = [\"primary\"]\nidempotency = \"off\"\n",
        config(&[("primary", &format!("{}/api", primary.uri()), "30s")], "")
    ))
    .await;
    let models = gw
        .request(Method::GET, "/v1/models", &[], Bytes::new())
        .await;
    assert_eq!(
        (models.status.as_u16(), &models.body[..]),
        (200, &b"models"[..])
    );
    assert!(models.header("x-idempotency-job-id").is_none());
    let file = gw
        .request(Method::POST, "/v1/files", &[], Bytes::from_static(b"data"))
        .await;
    assert_eq!(file.status, 201);
    assert!(file.header("x-idempotency-job-id").is_none());
    // A GET on an idempotent route is proxied too: safe methods never create jobs.
    let get = gw
        .request(
            Method::GET,
            "/v1/models",
            &[("idempotency-key", "k")],
            Bytes::new(),
        )
        .await;
    assert_eq!(get.status, 200);
    assert_eq!(received(&primary).await, 3);
}

/// The body's model is read once and tried against each model route in order; a body
/// that names no model route's model goes to the first route without models.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn routes_match_models_by_glob() {
    let gpt = answering(ResponseTemplate::new(200).set_body_string("gpt")).await;
    let claude = answering(ResponseTemplate::new(200).set_body_string("claude")).await;
    let rest = answering(ResponseTemplate::new(200).set_body_string("rest")).await;
    let gw = TestGateway::start(&format!(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"gpt\"\nbase_url = \"{}\"\n\
         [[providers]]\nname = \"claude\"\nbase_url = \"{}\"\n\
         [[providers]]\nname = \"rest\"\nbase_url = \"{}\"\n\
         [[routes]]\nname = \"gpt\"\npath_prefix = \"/v1\"\nmodels = [\"gpt-4o*\"]\nproviders = [\"gpt\"]\n\
         [[routes]]\nname = \"claude\"\npath_prefix = \"/v1\"\nmodels = [\"claude-*\"]\nproviders = [\"claude\"]\n\
         [[routes]]\nname = \"other\"\npath_prefix = \"/v1\"\nproviders = [\"rest\"]\n",
        gpt.uri(),
        claude.uri(),
        rest.uri()
    ))
    .await;
    let a = gw
        .post(
            "/v1/chat/completions",
            Some("m1"),
            Bytes::from_static(br#"{"model":"gpt-4o-mini"}"#),
        )
        .await;
    let b = gw
        .post(
            "/v1/messages",
            Some("m2"),
            Bytes::from_static(
                br#"{"messages":[{"role":"user","content":"hi","model":"gpt-4o"}],"model":"claude-sonnet-4"}"#,
            ),
        )
        .await;
    let c = gw
        .post(
            "/v1/chat/completions",
            Some("m3"),
            Bytes::from_static(br#"{"model":"llama-3"}"#),
        )
        .await;
    assert_eq!(
        (&a.body[..], &b.body[..], &c.body[..]),
        (&b"gpt"[..], &b"claude"[..], &b"rest"[..])
    );
    assert_eq!(gw.job(&a.job_id()).await["job"]["route"], "gpt");
    assert_eq!(gw.job(&b.job_id()).await["job"]["route"], "claude");
    assert_eq!(gw.job(&c.job_id()).await["job"]["route"], "other");
    assert_eq!(
        (
            received(&gpt).await,
            received(&claude).await,
            received(&rest).await
        ),
        (1, 1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_routes_run_keyless_requests_without_a_job() {
    let primary = answering(ResponseTemplate::new(503)).await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), "30s"),
            ("fallback", &fallback.uri(), "30s"),
        ],
        "idempotency = \"optional\"",
    ))
    .await;
    let reply = gw.post(CHAT, None, chat_request()).await;
    assert_eq!(reply.status, 200);
    assert!(reply.header("x-idempotency-job-id").is_none());
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    let again = gw.post(CHAT, None, chat_request()).await;
    assert_eq!(again.status, 200);
    assert_eq!(
        (received(&primary).await, received(&fallback).await),
        (2, 2),
        "keyless requests are never deduplicated"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_requests_carry_the_provider_rewrites_and_the_job_id() {
    let primary = answering(completion()).await;
    std::env::set_var("IDEMGATE_TEST_PROVIDER_KEY", "sk-provider");
    let gw = TestGateway::start(&config(&[("primary", &format!("{}/api/", primary.uri()), "30s")], "")
        .replace(
            "timeout = \"30s\"\n",
            "timeout = \"30s\"\nheaders = { Authorization = \"Bearer ${IDEMGATE_TEST_PROVIDER_KEY}\" }\nbody_set = { model = \"renamed\" }\n",
        ))
    .await;
    let reply = gw.post(CHAT, Some("k-rewrite"), chat_request()).await;
    assert_eq!(reply.status, 200);
    let sent = &primary.received_requests().await.unwrap()[0];
    assert_eq!(sent.url.path(), "/api/v1/chat/completions");
    assert_eq!(sent.headers["authorization"], "Bearer sk-provider");
    assert_eq!(sent.headers["idempotency-key"], reply.job_id().as_str());
    let body: serde_json::Value = serde_json::from_slice(&sent.body).unwrap();
    assert_eq!(body["model"], "renamed");
    assert_eq!(body["messages"][1]["content"], "Say hello.");
}

// ---- admin ----------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_needs_its_token() {
    let primary = answering(completion()).await;
    let gw = TestGateway::start(&config(&[("primary", &primary.uri(), "30s")], "")).await;
    let c = client();
    let get = |path: &str, auth: Option<&str>| {
        let url = format!("{}{path}", gw.admin);
        let auth = auth.map(|a| a.to_owned());
        let c = c.clone();
        async move {
            let headers: Vec<(&str, &str)> = auth
                .as_deref()
                .map(|a| vec![("authorization", a)])
                .unwrap_or_default();
            send(&c, Method::GET, &url, &headers, Bytes::new()).await
        }
    };
    assert_eq!(get("/healthz", None).await.status, 200);
    assert_eq!(get("/readyz", None).await.status, 200);
    let refused = get("/jobs/job_x", None).await;
    refused.assert_problem(401, "unauthorized");
    // Named by a request id like every answer the gateway makes itself.
    let id = refused.header("x-request-id").expect("a request id");
    assert_eq!(refused.json()["request_id"], id);
    get("/jobs/job_x", Some("Bearer wrong"))
        .await
        .assert_problem(401, "unauthorized");
    let named = send(
        &c,
        Method::GET,
        &format!("{}/jobs/job_x", gw.admin),
        &[("x-request-id", "ops-1")],
        Bytes::new(),
    )
    .await;
    assert_eq!(named.header("x-request-id"), Some("ops-1"));
    assert_eq!(named.json()["request_id"], "ops-1");
    let missing = gw.admin_get("/jobs/job_x").await;
    assert_eq!(missing.status, 404);

    let reply = gw.post(CHAT, Some("k-admin"), chat_request()).await;
    let view = gw.job(&reply.job_id()).await;
    let job = &view["job"];
    for field in [
        "id",
        "owner",
        "key",
        "fingerprint",
        "route",
        "state",
        "version",
        "completed_by",
        "created_at",
        "updated_at",
        "expires_at",
    ] {
        assert!(job.get(field).is_some(), "job field {field} in {view}");
    }
    let attempt = &view["attempts"][0];
    for field in [
        "n",
        "provider",
        "state",
        "read_version",
        "started_at",
        "finished_at",
        "upstream_status",
        "error",
    ] {
        assert!(
            attempt.get(field).is_some(),
            "attempt field {field} in {view}"
        );
    }
    assert_eq!(job["key"], "k-admin");
    assert_eq!(attempt["upstream_status"], 200);
    assert!(job["created_at"].as_str().unwrap().ends_with('Z'));
    assert!(
        view.to_string().find("Say hello").is_none(),
        "stored bodies are not shown"
    );
    let settled = gw
        .admin_post(&format!("/jobs/{}/cancel", reply.job_id()))
        .await;
    assert_eq!(settled.status, 409);
}

// ---- shutdown -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_requests_in_flight_finish() {
    let mut primary = HeldProvider::start().await;
    let gw = TestGateway::start(&config(&[("primary", &primary.url(), "30s")], "")).await;
    let base = gw.base.clone();
    let request = tokio::spawn(async move {
        send(
            &client(),
            Method::POST,
            &format!("{base}{CHAT}"),
            &[
                ("authorization", "Bearer a"),
                ("idempotency-key", "k-drain"),
            ],
            chat_request(),
        )
        .await
    });
    let call = primary.next_call().await;
    let store = gw.running.gateway.store().clone();
    let shutdown = tokio::spawn(gw.running.shutdown());
    call.answer(200, fixture("openai-chat-completion.json"));
    let reply = request.await.unwrap();
    assert_eq!(reply.status, 200);
    bounded("shutdown", shutdown).await.unwrap();
    let record = store.get(&reply.job_id()).await.unwrap().unwrap();
    assert_eq!(record.job.state.as_str(), "succeeded");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_past_the_grace_period_leaves_the_job_unknown_not_in_progress() {
    let mut primary = HeldProvider::start().await;
    let gw = TestGateway::start(&config(&[("primary", &primary.url(), "30s")], "")).await;
    let base = gw.base.clone();
    let _request = tokio::spawn(async move {
        let c = client();
        let _ = tokio::time::timeout(
            PATIENCE,
            c.request(
                http::Request::post(format!("{base}{CHAT}"))
                    .header("authorization", "Bearer a")
                    .header("idempotency-key", "k-abandon")
                    .body(http_body_util::Full::new(chat_request()))
                    .unwrap(),
            ),
        )
        .await;
    });
    let _held = primary.next_call().await;
    let store = gw.running.gateway.store().clone();
    bounded("shutdown", gw.running.shutdown()).await;
    let owner = idemgate::intent::owner(&idemgate::intent::OwnerMode::Bearer, &{
        let mut h = http::HeaderMap::new();
        h.insert("authorization", "Bearer a".parse().unwrap());
        h
    })
    .unwrap();
    // Find the job through a claim of the same (owner, key): it must not be in progress.
    let probe = idemgate::job::JobRecord::new(
        "job_probe".into(),
        owner,
        "k-abandon".into(),
        "fp".into(),
        "chat".into(),
        idemgate::clock::now(),
        idemgate::clock::now(),
        &idemgate::job::ExpiryPolicy {
            retention: Duration::from_secs(60),
            late_result_window: Duration::from_secs(60),
        },
    );
    match store.claim(probe, idemgate::clock::now()).await.unwrap() {
        idemgate::store::Claim::Existing(record) => {
            assert_eq!(record.job.state.as_str(), "unknown")
        }
        idemgate::store::Claim::Created(_) => panic!("the job vanished"),
    }
}
