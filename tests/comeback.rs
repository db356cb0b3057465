//! Failover that comes back (SPEC §4): adaptive breakers that return to a recovered
//! primary, probes that close a breaker without real traffic, hedges that go somewhere
//! else, and `code:` failover for errors that are definite. Against a scripted provider —
//! a real HTTP server whose health the test switches — with short cool-downs so the
//! timelines take seconds.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Request;
use hyper::body::Incoming;
use tokio::time::Instant;

const CHAT: &str = "/v1/chat/completions";

/// A provider that answers 503 while unhealthy and the completion fixture when healthy,
/// and notes when each call came.
struct Scripted {
    url: String,
    healthy: Arc<AtomicBool>,
    calls: Arc<Mutex<Vec<(Instant, u16)>>>,
}

async fn scripted() -> Scripted {
    let healthy = Arc::new(AtomicBool::new(false));
    let calls: Arc<Mutex<Vec<(Instant, u16)>>> = Arc::default();
    let (addr, _) = {
        let (healthy, calls) = (healthy.clone(), calls.clone());
        serve_provider(move |_request: Request<Incoming>| {
            let (healthy, calls) = (healthy.clone(), calls.clone());
            async move {
                let ok = healthy.load(Ordering::SeqCst);
                let status = if ok { 200 } else { 503 };
                calls.lock().unwrap().push((Instant::now(), status));
                let body = if ok {
                    fixture("openai-chat-completion.json")
                } else {
                    Bytes::from_static(
                        b"{\"error\":{\"message\":\"overloaded\",\"type\":\"server_error\"}}",
                    )
                };
                let mut response = hyper::Response::new(http_body_util::Full::new(body));
                *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
                response
                    .headers_mut()
                    .insert("content-type", "application/json".parse().unwrap());
                Ok(response)
            }
        })
        .await
    };
    Scripted {
        url: format!("http://{addr}"),
        healthy,
        calls,
    }
}

fn config(primary: &str, fallback: &str, breaker: &str, route: &str) -> String {
    format!(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"primary\"\nbase_url = \"{primary}\"\nbreaker = {{ {breaker} }}\n\
         [[providers]]\nname = \"fallback\"\nbase_url = \"{fallback}\"\n\
         [[routes]]\nname = \"chat\"\nmethods = [\"POST\"]\npath_prefix = \"{CHAT}\"\nproviders = [\"primary\", \"fallback\"]\n{route}\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_primary_is_used_again_within_one_cool_down() {
    let primary = scripted().await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &primary.url,
        &fallback.uri(),
        "failures = 2, cool_down = \"400ms\", max_cool_down = \"4s\"",
        "",
    ))
    .await;
    let started = Instant::now();
    let spacing = Duration::from_millis(240);
    let mut timeline = Vec::new();
    let mut recovered_at = None;
    for i in 0..20 {
        // The primary is down for the first five requests' time, healthy after.
        if i == 5 {
            primary.healthy.store(true, Ordering::SeqCst);
            recovered_at = Some(Instant::now());
        }
        let reply = gw
            .post(CHAT, Some(&format!("flap-{i}")), chat_request())
            .await;
        assert_eq!(reply.status, 200);
        let provider = reply.header("x-idempotency-provider").unwrap().to_owned();
        timeline.push((started.elapsed(), provider));
        tokio::time::sleep(spacing).await;
    }
    let recovered_at = recovered_at.unwrap();
    let first_back = timeline
        .iter()
        .find(|(at, provider)| *at >= recovered_at - started && provider == "primary")
        .map(|(at, _)| *at - (recovered_at - started))
        .expect("the primary served again");
    let lines: Vec<String> = timeline
        .iter()
        .map(|(at, p)| format!("{:>5}ms {p}", at.as_millis()))
        .collect();
    eprintln!(
        "flap timeline (primary down until {}ms):\n  {}\nprimary back {}ms after its recovery",
        (recovered_at - started).as_millis(),
        lines.join("\n  "),
        first_back.as_millis()
    );
    // Within one cool-down (its current value, at most 1.6 s after three doublings here)
    // plus one request's spacing.
    assert!(
        first_back <= Duration::from_millis(1600) + spacing,
        "{first_back:?}"
    );
    // Everything after the first return stays on the primary.
    let back = timeline
        .iter()
        .position(|(at, p)| *at >= recovered_at - started && p == "primary")
        .unwrap();
    assert!(
        timeline[back..].iter().all(|(_, p)| p == "primary"),
        "{lines:?}"
    );
    // During the outage: the two failures that opened it, then at most one trial per
    // cool-down.
    let calls = primary.calls.lock().unwrap().clone();
    let outage: Vec<_> = calls.iter().filter(|(_, status)| *status == 503).collect();
    assert!(
        outage.len() <= 2 + 3,
        "{} calls reached the failing primary",
        outage.len()
    );
    for pair in outage.windows(2).skip(1) {
        assert!(
            pair[1].0 - pair[0].0 >= Duration::from_millis(380),
            "two trials within one cool-down"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_closes_the_breaker_without_real_traffic() {
    let primary = scripted().await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &primary.url,
        &fallback.uri(),
        "failures = 2, cool_down = \"300ms\", max_cool_down = \"2s\"",
        "contract = { json_pointers = [\"/choices/0/message\"] }\n[routes.probe]\nbody = { model = \"gpt-4o-mini\", messages = [] }",
    ))
    .await;
    for i in 0..2 {
        let reply = gw
            .post(CHAT, Some(&format!("probe-{i}")), chat_request())
            .await;
        assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    }
    let view = gw.admin_get("/providers").await.json();
    assert_eq!(view["providers"][0]["breaker"]["state"], "open");
    primary.healthy.store(true, Ordering::SeqCst);
    let recovered = Instant::now();
    // No client request: the probe alone must close it.
    let deadline = recovered + PATIENCE;
    let closed = loop {
        let view = gw.admin_get("/providers").await.json();
        if view["providers"][0]["breaker"]["state"] == "closed" {
            break view;
        }
        assert!(
            Instant::now() < deadline,
            "the probe never closed it: {view}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    eprintln!(
        "probe closed the breaker {:?} after the recovery",
        recovered.elapsed()
    );
    assert_eq!(closed["providers"][0]["probe"]["ok"], true);
    assert!(closed["providers"][0]["probe"]["at"].is_string());
    assert_eq!(closed["providers"][0]["breaker"]["cool_down"], "300ms");
    let reply = gw.post(CHAT, Some("probe-after"), chat_request()).await;
    assert_eq!(reply.header("x-idempotency-provider"), Some("primary"));
    assert_eq!(reply.header("x-idempotency-attempt"), Some("1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cool_down_doubles_on_each_failed_trial_and_resets_after_a_success() {
    let primary = scripted().await;
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &primary.url,
        &fallback.uri(),
        "failures = 1, cool_down = \"200ms\", max_cool_down = \"1s\"",
        "",
    ))
    .await;
    let cool_down = |view: serde_json::Value| {
        view["providers"][0]["breaker"]["cool_down"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let _ = gw.post(CHAT, Some("cd-0"), chat_request()).await;
    assert_eq!(cool_down(gw.admin_get("/providers").await.json()), "200ms");
    let mut seen = Vec::new();
    for (i, wait) in [250u64, 450, 850, 1050].into_iter().enumerate() {
        // Past the current cool-down: one trial goes to the primary, fails, re-opens.
        tokio::time::sleep(Duration::from_millis(wait)).await;
        let before = primary.calls.lock().unwrap().len();
        let _ = gw
            .post(CHAT, Some(&format!("cd-{}", i + 1)), chat_request())
            .await;
        assert_eq!(primary.calls.lock().unwrap().len(), before + 1, "one trial");
        seen.push(cool_down(gw.admin_get("/providers").await.json()));
    }
    assert_eq!(seen, ["400ms", "800ms", "1s", "1s"]);
    primary.healthy.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(1050)).await;
    let reply = gw.post(CHAT, Some("cd-ok"), chat_request()).await;
    assert_eq!(reply.header("x-idempotency-provider"), Some("primary"));
    let view = gw.admin_get("/providers").await.json();
    assert_eq!(view["providers"][0]["breaker"]["state"], "closed");
    assert_eq!(cool_down(view), "200ms", "a success resets it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_goes_to_a_provider_that_is_not_already_running() {
    let mut primary = HeldProvider::start().await;
    let fallback = answering(completion()).await;
    let text = format!(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"primary\"\nbase_url = \"{}\"\n\
         [[providers]]\nname = \"fallback\"\nbase_url = \"{}\"\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"{CHAT}\"\nproviders = [\"primary\", \"primary\", \"fallback\"]\nhedge_after = \"300ms\"\n",
        primary.url(),
        fallback.uri()
    );
    let gw = TestGateway::start(&text).await;
    let reply = {
        let gw = Arc::new(gw);
        let g = gw.clone();
        let reply = tokio::spawn(async move { g.post(CHAT, Some("hedge"), chat_request()).await });
        let _silent = primary.next_call().await;
        let reply = bounded("the hedged answer", reply).await.unwrap();
        primary
            .assert_no_call_within(Duration::from_millis(200))
            .await;
        reply
    };
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    assert_eq!(reply.header("x-idempotency-attempt"), Some("2"));
    assert_eq!(
        primary.calls(),
        1,
        "the silent primary got exactly one call"
    );
    assert_eq!(received(&fallback).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_prompt_moves_to_the_fallback_and_other_codes_stay_final() {
    let calls = Arc::new(AtomicUsize::new(0));
    let (primary, _) = {
        let calls = calls.clone();
        serve_provider(move |request: Request<Incoming>| {
            let calls = calls.clone();
            async move {
                calls.fetch_add(1, Ordering::SeqCst);
                let body = http_body_util::BodyExt::collect(request.into_body())
                    .await
                    .unwrap()
                    .to_bytes();
                let over_long = String::from_utf8_lossy(&body).contains("very long");
                let answer = if over_long {
                    fixture("openai-error-400-context-length.json")
                } else {
                    Bytes::from_static(b"{\"error\":{\"message\":\"bad\",\"type\":\"invalid_request_error\",\"code\":\"invalid_value\"}}")
                };
                let mut response = hyper::Response::new(http_body_util::Full::new(answer));
                *response.status_mut() = http::StatusCode::BAD_REQUEST;
                response
                    .headers_mut()
                    .insert("content-type", "application/json".parse().unwrap());
                Ok(response)
            }
        })
        .await
    };
    let fallback = answering(completion()).await;
    let gw = TestGateway::start(&config(
        &format!("http://{primary}"),
        &fallback.uri(),
        "failures = 1",
        "failover_on = [\"connect\", \"429\", \"5xx\", \"code:context_length_exceeded\"]",
    ))
    .await;
    let long = Bytes::from_static(b"{\"model\":\"gpt-4o-mini\",\"messages\":[{\"role\":\"user\",\"content\":\"a very long prompt\"}]}");
    let reply = gw.post(CHAT, Some("long"), long).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
    let view = gw.job(&reply.job_id()).await;
    let attempts = view["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0]["state"], "failed");
    assert_eq!(attempts[0]["upstream_status"], 400);
    assert_eq!(attempts[1]["state"], "succeeded");
    // A refused prompt says nothing about the primary's health: its breaker stays closed
    // (with failures = 1, one counted failure would have opened it).
    let providers = gw.admin_get("/providers").await.json();
    assert_eq!(providers["providers"][0]["breaker"]["state"], "closed");

    // Another code is a final answer: passed through, stored, replayed.
    let first = gw.post(CHAT, Some("other"), chat_request()).await;
    assert_eq!(first.status, 400);
    assert_eq!(first.header("x-idempotency-provider"), Some("primary"));
    let again = gw.post(CHAT, Some("other"), chat_request()).await;
    assert_eq!(again.status, 400);
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, first.body);
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(received(&fallback).await, 1);
}

#[test]
fn an_empty_code_entry_is_refused_by_check_config() {
    let text = config("http://a", "http://b", "", "failover_on = [\"code:\"]");
    let error = idemgate::Config::parse(&text, "routes.toml")
        .unwrap_err()
        .to_string();
    assert!(error.contains("failover_on"), "{error}");
    assert!(error.contains("needs a value"), "{error}");
}

/// A provider that reads a request's head and `read` body bytes, then drops the connection.
async fn hanging_up(read: usize) -> String {
    use tokio::io::AsyncReadExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut seen = Vec::new();
                let mut buf = [0u8; 8192];
                loop {
                    let Ok(n) = stream.read(&mut buf).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    if let Some(head) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                        if seen.len() >= head + 4 + read {
                            break;
                        }
                    }
                }
                // Dropped with no answer (unread bytes make the close a reset).
                drop(stream);
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_after_the_request_was_sent_is_unknown_unless_the_route_says_reset() {
    let body = chat_request();
    let fallback = answering(completion()).await;
    for (route, expect_unknown) in [
        ("", true),
        ("failover_on = [\"connect\", \"reset\", \"5xx\"]", false),
    ] {
        let primary = hanging_up(body.len()).await;
        let gw =
            TestGateway::start(&config(&primary, &fallback.uri(), "failures = 5", route)).await;
        let reply = gw.post(CHAT, Some("reset"), body.clone()).await;
        if expect_unknown {
            reply.assert_problem(504, "outcome-unknown");
        } else {
            assert_eq!(reply.status, 200);
            assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
        }
    }
    assert_eq!(received(&fallback).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_dropped_while_the_request_is_sent_is_a_definite_failure() {
    let fallback = answering(completion()).await;
    let primary = hanging_up(0).await;
    let gw = TestGateway::start(&format!(
        "max_body_bytes = 134217728\n{}",
        config(&primary, &fallback.uri(), "failures = 5", "")
    ))
    .await;
    // A body far larger than the socket buffers on both sides together: the provider hangs
    // up while it is still being sent.
    let big = Bytes::from(format!(
        "{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"{}\"}}]}}",
        "x".repeat(48 * 1024 * 1024)
    ));
    let reply = gw.post(CHAT, Some("not-sent"), big).await;
    assert_eq!(reply.status, 200, "{}", gw.job(&reply.job_id()).await);
    assert_eq!(reply.header("x-idempotency-provider"), Some("fallback"));
}
