//! Failover that earns trust (SPEC §4, §6): contracts, retries and `Retry-After`, circuit
//! breakers, probes — against real HTTP providers, asserting what reached each of them.

mod common;

use std::process::Command;
use std::time::Duration;

use tokio::time::Instant;

use common::*;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

const CHAT: &str = "/v1/chat/completions";

/// Providers (name, url, extra keys) and one route over `route_providers`.
fn config(providers: &[(&str, &str, &str)], route_providers: &[&str], route: &str) -> String {
    let mut text = String::from("[store]\nkind = \"memory\"\n");
    for (name, url, extra) in providers {
        text.push_str(&format!(
            "[[providers]]\nname = \"{name}\"\nbase_url = \"{url}\"\n{extra}\n"
        ));
    }
    let names: Vec<String> = route_providers.iter().map(|n| format!("\"{n}\"")).collect();
    text.push_str(&format!(
        "[[routes]]\nname = \"chat\"\nmethods = [\"POST\"]\npath_prefix = \"{CHAT}\"\nproviders = [{}]\n{route}\n",
        names.join(", ")
    ));
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fallback_that_breaks_the_contract_is_rejected_and_the_next_one_answers() {
    let primary = answering(ResponseTemplate::new(503)).await;
    let wrong = answering(
        ResponseTemplate::new(200)
            .set_body_raw(fixture("fallback-wrong-shape.json"), "application/json"),
    )
    .await;
    let good = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), ""),
            ("wrong", &wrong.uri(), ""),
            ("good", &good.uri(), ""),
        ],
        &["primary", "wrong", "good"],
        "contract = { json_pointers = [\"/choices/0/message\"] }",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-contract"), chat_request()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.body, fixture("openai-chat-completion.json"));
    assert_eq!(reply.header("x-idempotency-provider"), Some("good"));
    assert_eq!(reply.header("x-idempotency-attempt"), Some("3"));
    let view = gw.job(&reply.job_id()).await;
    assert_eq!(view["attempts"][1]["state"], "contract_rejected");
    assert_eq!(view["attempts"][1]["upstream_status"], 200);
    assert!(
        view["attempts"][1]["error"]
            .as_str()
            .unwrap()
            .contains("/choices/0/message"),
        "{view}"
    );
    assert_eq!(view["job"]["completed_by"], 3);
    // The rejected body was never stored: the replay is the good provider's.
    let replay = gw.post(CHAT, Some("k-contract"), chat_request()).await;
    assert_eq!(replay.body, fixture("openai-chat-completion.json"));
    assert_eq!(
        (
            received(&primary).await,
            received(&wrong).await,
            received(&good).await
        ),
        (1, 1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_json_schema_contract_rejects_an_answer_that_breaks_it() {
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("chat.schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "required": ["choices"], "properties": {"choices": {"type": "array", "minItems": 1}}}"#,
    )
    .unwrap();
    let empty = answering(ResponseTemplate::new(200).set_body_string(r#"{"choices": []}"#)).await;
    let good = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[("empty", &empty.uri(), ""), ("good", &good.uri(), "")],
        &["empty", "good"],
        &format!("contract = {{ schema = \"{}\" }}", schema.display()),
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-schema"), chat_request()).await;
    assert_eq!(reply.header("x-idempotency-provider"), Some("good"));
    let view = gw.job(&reply.job_id()).await;
    assert_eq!(view["attempts"][0]["state"], "contract_rejected");
    assert!(
        view["attempts"][0]["error"]
            .as_str()
            .unwrap()
            .contains("schema"),
        "{view}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_retry_after_is_waited_for_and_the_retry_succeeds() {
    let primary = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("retry-after", "1")
                .set_body_raw(fixture("openai-error-429.json"), "application/json"),
        )
        .up_to_n_times(1)
        .mount(&primary)
        .await;
    Mock::given(method("POST"))
        .respond_with(completion())
        .mount(&primary)
        .await;
    let gw = TestGateway::start(&config(
        &[("primary", &primary.uri(), "")],
        &["primary", "primary"],
        "",
    ))
    .await;
    let started = Instant::now();
    let reply = gw.post(CHAT, Some("k-retry-after"), chat_request()).await;
    let elapsed = started.elapsed();
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-attempt"), Some("2"));
    assert!(
        elapsed >= Duration::from_millis(950),
        "the retry waited only {elapsed:?}"
    );
    let view = gw.job(&reply.job_id()).await;
    assert_eq!(view["attempts"][0]["state"], "failed");
    assert_eq!(view["attempts"][0]["upstream_status"], 429);
    assert_eq!(view["attempts"][1]["provider"], "primary");
    assert_eq!(received(&primary).await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_retry_after_is_not_waited_for_the_next_provider_answers() {
    let primary = answering(
        ResponseTemplate::new(429)
            .insert_header("retry-after", "3600")
            .set_body_raw(fixture("openai-error-429.json"), "application/json"),
    )
    .await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), ""),
            ("fallback", &fallback.uri(), ""),
        ],
        &["primary", "primary", "fallback"],
        "",
    ))
    .await;
    let started = Instant::now();
    let reply = gw
        .post(CHAT, Some("k-long-retry-after"), chat_request())
        .await;
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it waited {:?}",
        started.elapsed()
    );
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    assert_eq!(reply.header("x-idempotency-attempt"), Some("2"));
    assert_eq!(
        (received(&primary).await, received(&fallback).await),
        (1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_without_retry_after_back_off_and_are_attempts_of_the_job() {
    let primary = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(500))
        .up_to_n_times(2)
        .mount(&primary)
        .await;
    Mock::given(method("POST"))
        .respond_with(completion())
        .mount(&primary)
        .await;
    let gw = TestGateway::start(&config(
        &[("primary", &primary.uri(), "")],
        &["primary", "primary", "primary"],
        "max_retry_after = \"1s\"",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-backoff"), chat_request()).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-attempt"), Some("3"));
    let view = gw.job(&reply.job_id()).await;
    let states: Vec<_> = view["attempts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["state"].clone())
        .collect();
    assert_eq!(states, vec!["failed", "failed", "succeeded"]);
    assert_eq!(received(&primary).await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_primary_is_skipped_while_its_circuit_is_open_then_tried_once() {
    let primary = answering(ResponseTemplate::new(503)).await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            (
                "primary",
                &primary.uri(),
                "breaker = { failures = 5, cool_down = \"700ms\" }",
            ),
            ("fallback", &fallback.uri(), ""),
        ],
        &["primary", "fallback"],
        "",
    ))
    .await;
    for i in 0..5 {
        let reply = gw
            .post(CHAT, Some(&format!("k-breaker-{i}")), chat_request())
            .await;
        assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    }
    assert_eq!(received(&primary).await, 5);
    let providers = gw.admin_get("/providers").await.json();
    assert_eq!(providers["providers"][0]["name"], "primary");
    assert_eq!(providers["providers"][0]["breaker"]["state"], "open");
    assert_eq!(providers["providers"][0]["breaker"]["failures"], 5);
    assert_eq!(providers["providers"][0]["breaker"]["cool_down"], "700ms");
    assert_eq!(providers["providers"][0]["probe"], serde_json::Value::Null);
    assert_eq!(providers["providers"][1]["breaker"]["state"], "closed");

    // Open: zero calls reach the primary; the fallback answers as attempt 1.
    for i in 5..8 {
        let reply = gw
            .post(CHAT, Some(&format!("k-breaker-{i}")), chat_request())
            .await;
        assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
        assert_eq!(reply.header("x-idempotency-attempt"), Some("1"));
    }
    assert_eq!(
        received(&primary).await,
        5,
        "no call reaches an open circuit"
    );

    // The primary recovers; after the cool-down (wall-clock state: nothing to await but
    // time) one trial reaches it, succeeds, and traffic returns to it.
    primary.reset().await;
    Mock::given(method("POST"))
        .respond_with(completion())
        .mount(&primary)
        .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let trial = gw.post(CHAT, Some("k-breaker-trial"), chat_request()).await;
    assert_eq!(trial.header("x-idempotency-provider"), Some("primary"));
    assert_eq!(
        gw.admin_get("/providers").await.json()["providers"][0]["breaker"]["state"],
        "closed"
    );
    let after = gw.post(CHAT, Some("k-breaker-after"), chat_request()).await;
    assert_eq!(after.header("x-idempotency-provider"), Some("primary"));
    assert_eq!(received(&primary).await, 2);
    assert_eq!(received(&fallback).await, 8);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn provider_errors_pass_through_untouched() {
    let error = fixture("openai-error-400-context-length.json");
    let primary = answering(
        ResponseTemplate::new(400)
            .set_body_raw(error.clone(), "application/json")
            .insert_header("x-request-id", "req_400"),
    )
    .await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &[
            ("primary", &primary.uri(), ""),
            ("fallback", &fallback.uri(), ""),
        ],
        &["primary", "primary", "fallback"],
        "",
    ))
    .await;
    let reply = gw.post(CHAT, Some("k-400-final"), chat_request()).await;
    assert_eq!(reply.status, 400);
    assert_eq!(reply.body, error);
    assert_eq!(reply.header("content-type"), Some("application/json"));
    assert_eq!(reply.header("x-request-id"), Some("req_400"));
    assert_eq!(
        (received(&primary).await, received(&fallback).await),
        (1, 0),
        "never retried, never masked"
    );
}

// ---- probes -----------------------------------------------------------------------------

fn probe_config(dir: &std::path::Path, primary: &str, fallback: &str) -> std::path::PathBuf {
    let path = dir.join("idemgate.toml");
    std::fs::write(
        &path,
        format!(
            "{}[routes.probe]\nbody = {{ model = \"gpt-4o-mini\", messages = [{{ role = \"user\", content = \"ping\" }}] }}\n",
            config(
                &[("primary", primary, ""), ("fallback", fallback, "body_set = { model = \"other\" }")],
                &["primary", "fallback"],
                "contract = { json_pointers = [\"/choices/0/message/content\"] }",
            )
        ),
    )
    .unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_passes_a_good_fallback_and_fails_one_that_renames_a_field() {
    let primary = answering(completion()).await;
    let good = answering(completion()).await;
    let renamed = answering(
        ResponseTemplate::new(200).set_body_string(
            String::from_utf8(fixture("openai-chat-completion.json").to_vec())
                .unwrap()
                .replace("\"content\"", "\"text\""),
        ),
    )
    .await;
    let dir = tempfile::tempdir().unwrap();

    let ok = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["probe", "--config"])
        .arg(probe_config(dir.path(), &primary.uri(), &good.uri()))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{table}");
    assert!(
        table.contains("fallback") && table.contains("ok"),
        "{table}"
    );
    // The fallback got the probe rendered for it: its own body_set.
    let sent: serde_json::Value =
        serde_json::from_slice(&good.received_requests().await.unwrap()[0].body).unwrap();
    assert_eq!(sent["model"], "other");

    let bad = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(["probe", "--config"])
        .arg(probe_config(dir.path(), &primary.uri(), &renamed.uri()))
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&bad.stdout);
    assert!(!bad.status.success(), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains("fallback"))
        .expect("a fallback row");
    assert!(
        row.contains("missing /choices/0/message/content"),
        "{table}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_failover_to_a_provider_whose_probe_failed() {
    let primary = answering(ResponseTemplate::new(503)).await;
    let unproven = answering(ResponseTemplate::new(200).set_body_string("{\"choices\": []}")).await;
    let gw = TestGateway::start(&format!(
        "{}[routes.probe]\nbody = {{ model = \"m\" }}\n",
        config(
            &[("primary", &primary.uri(), ""), ("fallback", &unproven.uri(), "")],
            &["primary", "fallback"],
            "contract = { json_pointers = [\"/choices/0/message\"] }\nfailover_requires_probe = true\nprobe_interval = \"1h\"",
        )
    ))
    .await;
    // The start-up probe reaches both providers; wait for it (bounded) before asserting.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while received(&unproven).await < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the start-up probe never ran"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let reply = gw.post(CHAT, Some("k-unproven"), chat_request()).await;
    assert_eq!(reply.status, 503, "the primary's answer, with no failover");
    assert_eq!(
        received(&unproven).await,
        1,
        "only the probe reached the unproven fallback"
    );
}
