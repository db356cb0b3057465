//! What an operator sees: every outcome moves its counter, and a lost race leaves one
//! `warn` line naming the job and the losing attempt.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use common::*;
use wiremock::matchers::method;
use wiremock::{Mock, MockServer, ResponseTemplate};

const CHAT: &str = "/v1/chat/completions";

/// Every log line this test binary writes, as JSON.
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buffer = Arc::new(Mutex::new(Vec::new()));
        let writer = buffer.clone();
        tracing_subscriber::fmt()
            .json()
            .with_env_filter("idemgate=info")
            .with_writer(move || Capture(writer.clone()))
            .init();
        buffer
    })
}

struct Capture(Arc<Mutex<Vec<u8>>>);

impl Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The value of a sample in Prometheus text, matched by name and labels in any order.
fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            let (metric, rest) = series.split_once('{').unwrap_or((series, "}"));
            (metric == name
                && labels
                    .iter()
                    .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\""))))
            .then(|| value.parse::<f64>().ok())?
        })
        .sum()
}

async fn metrics(gw: &TestGateway) -> String {
    let reply = send(
        &client(),
        http::Method::GET,
        &format!("{}/metrics", gw.admin),
        &[],
        Bytes::new(),
    )
    .await;
    assert_eq!(reply.status, 200);
    String::from_utf8(reply.body.to_vec()).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_outcome_moves_its_counter() {
    logs();
    let good = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_raw(fixture("openai-chat-completion.json"), "application/json"),
        )
        .mount(&good)
        .await;
    let down = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(503))
        .mount(&down)
        .await;
    let wrong = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_raw(fixture("fallback-wrong-shape.json"), "application/json"),
        )
        .mount(&wrong)
        .await;
    let mut slow = HeldProvider::start().await;
    let gw = Arc::new(
        TestGateway::start(&format!(
            "[idempotency]\nwait_for_in_flight = \"100ms\"\n[store]\nkind = \"memory\"\n\
             [[providers]]\nname = \"good\"\nbase_url = \"{}\"\n\
             [[providers]]\nname = \"down\"\nbase_url = \"{}\"\n\
             [[providers]]\nname = \"wrong\"\nbase_url = \"{}\"\n\
             [[providers]]\nname = \"slow\"\nbase_url = \"{}\"\ntimeout = \"200ms\"\n\
             [[routes]]\nname = \"chat\"\npath_prefix = \"/v1/chat\"\nproviders = [\"down\", \"wrong\", \"good\"]\n\
             contract = {{ json_pointers = [\"/choices/0/message\"] }}\n\
             [[routes]]\nname = \"slow\"\npath_prefix = \"/v1/slow\"\nproviders = [\"slow\"]\n",
            good.uri(),
            down.uri(),
            wrong.uri(),
            slow.url()
        ))
        .await,
    );
    let before = metrics(&gw).await;
    assert_eq!(sample(&before, "idemgate_requests_total", &[]), 0.0);

    // new, with a failed and a contract-rejected attempt on the way
    assert_eq!(
        gw.post(CHAT, Some("m-new"), chat_request()).await.status,
        200
    );
    // replayed
    assert_eq!(
        gw.post(CHAT, Some("m-new"), chat_request())
            .await
            .header("idempotent-replayed"),
        Some("true")
    );
    // conflict
    gw.post(CHAT, Some("m-new"), Bytes::from_static(b"{\"other\":1}"))
        .await
        .assert_problem(409, "idempotency-key-reused");
    // error
    gw.post(CHAT, None, chat_request())
        .await
        .assert_problem(400, "missing-idempotency-key");
    // unknown: the slow provider times out
    let timed_out = gw.post("/v1/slow", Some("m-slow"), chat_request()).await;
    timed_out.assert_problem(504, "outcome-unknown");
    let held = slow.next_call().await;
    // in_progress: a second slow job, held, and a duplicate that gives up waiting
    let running = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post("/v1/slow", Some("m-busy"), chat_request()).await })
    };
    let busy_call = slow.next_call().await;
    let busy = gw.post("/v1/slow", Some("m-busy"), chat_request()).await;
    busy.assert_problem(409, "request-in-progress");

    let text = metrics(&gw).await;
    let requests = |route: &str, outcome: &str| {
        sample(
            &text,
            "idemgate_requests_total",
            &[("route", route), ("outcome", outcome)],
        )
    };
    assert_eq!(requests("chat", "new"), 1.0, "{text}");
    assert_eq!(requests("chat", "replayed"), 1.0);
    assert_eq!(requests("chat", "conflict"), 1.0);
    assert_eq!(requests("chat", "error"), 1.0);
    assert_eq!(requests("slow", "unknown"), 1.0);
    assert_eq!(requests("slow", "in_progress"), 1.0);
    let attempts = |provider: &str, result: &str| {
        sample(
            &text,
            "idemgate_attempts_total",
            &[("provider", provider), ("result", result)],
        )
    };
    assert_eq!(attempts("down", "failed"), 1.0);
    assert_eq!(attempts("wrong", "contract_rejected"), 1.0);
    assert_eq!(attempts("good", "succeeded"), 1.0);
    assert_eq!(attempts("slow", "unknown"), 1.0);
    assert_eq!(sample(&text, "idemgate_jobs_unknown", &[]), 1.0);
    assert_eq!(
        sample(&text, "idemgate_breaker_open", &[("provider", "down")]),
        0.0
    );
    assert!(
        sample(
            &text,
            "idemgate_upstream_seconds_count",
            &[("provider", "good")]
        ) >= 1.0
    );
    // Every request that minted a job claimed once: the new one, the failed one, the one
    // that timed out. On the memory store a retry of a live key (the replay, the conflict,
    // the one in progress) is answered from a read, and the keyless request claims nothing.
    let claims = sample(
        &text,
        "idemgate_store_seconds_count",
        &[("operation", "claim")],
    );
    assert_eq!(claims, 3.0, "{text}");

    // The operator's list shows the unknown job; cancelling it resolves it.
    let id = timed_out.job_id();
    let listed = gw.admin_get("/jobs?state=unknown").await.json();
    assert_eq!(listed["jobs"].as_array().unwrap().len(), 1, "{listed}");
    assert_eq!(listed["jobs"][0]["job"]["id"], id.as_str());
    assert_eq!(
        gw.admin_post(&format!("/jobs/{id}/cancel")).await.status,
        200
    );
    let text = metrics(&gw).await;
    assert_eq!(
        sample(
            &text,
            "idemgate_attempts_total",
            &[("provider", "slow"), ("result", "cancelled")]
        ),
        1.0
    );
    assert_eq!(sample(&text, "idemgate_jobs_unknown", &[]), 0.0);
    assert_eq!(
        gw.admin_get("/jobs?state=unknown").await.json()["jobs"],
        serde_json::json!([])
    );
    gw.admin_get("/jobs?state=failed")
        .await
        .assert_problem(400, "bad-request");
    drop(held);
    busy_call.answer(200, Bytes::from_static(b"{}"));
    let _ = running.await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_race_is_one_warn_line_naming_the_job_and_the_loser() {
    let logs = logs();
    let mut primary = HeldProvider::start().await;
    let mut fallback = HeldProvider::start().await;
    let gw = Arc::new(
        TestGateway::start(&format!(
            "[store]\nkind = \"memory\"\n\
             [[providers]]\nname = \"primary\"\nbase_url = \"{}\"\n\
             [[providers]]\nname = \"fallback\"\nbase_url = \"{}\"\n\
             [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\", \"fallback\"]\nhedge_after = \"100ms\"\n",
            primary.url(),
            fallback.url()
        ))
        .await,
    );
    let client = {
        let gw = gw.clone();
        tokio::spawn(async move { gw.post(CHAT, Some("log-race"), chat_request()).await })
    };
    let first = primary.next_call().await;
    fallback
        .next_call()
        .await
        .answer(200, Bytes::from_static(b"{\"from\":\"fallback\"}"));
    let id = client.await.unwrap().job_id();
    first.answer(200, Bytes::from_static(b"{\"from\":\"primary\"}"));
    gw.job_eventually(&id, |v| v["attempts"][0]["state"] == "lost_race")
        .await;
    // The line is written before the state is visible; still, bound the wait for it.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let text = String::from_utf8(logs.lock().unwrap().clone()).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|l: &serde_json::Value| {
                l["level"] == "WARN" && l["fields"]["job_id"] == id.as_str()
            })
            .filter(|l| {
                l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("lost the race"))
            })
            .collect();
        if !lines.is_empty() {
            assert_eq!(lines.len(), 1, "{lines:?}");
            assert_eq!(lines[0]["fields"]["attempt"], 1);
            assert!(!text.contains("sk-client-1"), "no credential in the logs");
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no warn line for the lost race in:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
