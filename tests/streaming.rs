//! Streaming answers (SPEC §5) against a provider whose every chunk the test releases by
//! hand: relay as it arrives, replay the same bytes, duplicates joining a live stream, cuts
//! and stalls that fail the job.

mod common;
mod faults;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use common::*;
use http::{Method, Request};
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use tokio::sync::mpsc;

const CHAT: &str = "/v1/chat/completions";

type Chunk = Result<Frame<Bytes>, std::io::Error>;

/// A provider answering every request with `text/event-stream`, one chunk whenever the
/// test sends it.
struct StreamingProvider {
    addr: SocketAddr,
    calls: mpsc::UnboundedReceiver<mpsc::UnboundedSender<Chunk>>,
    count: Arc<AtomicUsize>,
}

impl StreamingProvider {
    async fn start() -> Self {
        let (tx, calls) = mpsc::unbounded_channel();
        let (addr, count) = serve_provider(move |request: Request<Incoming>| {
            let tx = tx.clone();
            async move {
                let _ = request.into_body().collect().await;
                let (chunks, rx) = mpsc::unbounded_channel::<Chunk>();
                let _ = tx.send(chunks);
                let body = StreamBody::new(futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|chunk| (chunk, rx))
                }));
                let response = hyper::Response::builder()
                    .header("content-type", "text/event-stream")
                    .header("x-request-id", "req_stream")
                    .body(body)
                    .unwrap();
                Ok(response)
            }
        })
        .await;
        Self { addr, calls, count }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn next_call(&mut self) -> mpsc::UnboundedSender<Chunk> {
        bounded("a provider call", self.calls.recv()).await.unwrap()
    }

    fn calls(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// The SSE fixture split into its events: the chunks a provider sends one by one.
fn events() -> Vec<Bytes> {
    let text = String::from_utf8(fixture("openai-chat-stream.sse").to_vec()).unwrap();
    text.split_inclusive("\n\n")
        .map(|e| Bytes::from(e.to_owned()))
        .collect()
}

fn send_chunk(upstream: &mpsc::UnboundedSender<Chunk>, chunk: &Bytes) {
    upstream.send(Ok(Frame::data(chunk.clone()))).unwrap();
}

/// A streamed response being read chunk by chunk.
struct Reading {
    headers: http::HeaderMap,
    body: Incoming,
}

impl Reading {
    async fn start(url: String, key: &str) -> Self {
        let request = Request::post(url)
            .header("authorization", "Bearer sk-client-1")
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"gpt-4o-mini","stream":true}"#,
            )))
            .unwrap();
        let response = bounded("the response head", client().request(request))
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let (parts, body) = response.into_parts();
        Self {
            headers: parts.headers,
            body,
        }
    }

    /// Reads until `expected` bytes arrived (bounded), as one buffer.
    async fn read_exactly(&mut self, expected: usize) -> Bytes {
        let mut got = Vec::new();
        while got.len() < expected {
            let frame = bounded("a chunk", self.body.frame())
                .await
                .expect("the body goes on")
                .unwrap();
            got.extend_from_slice(&frame.into_data().unwrap());
        }
        Bytes::from(got)
    }

    /// Reads to the end: `Err` when the body ended abnormally.
    async fn read_to_end(mut self) -> Result<Bytes, String> {
        let mut got = Vec::new();
        while let Some(frame) = bounded("the end of the body", self.body.frame()).await {
            match frame {
                Ok(frame) => got.extend_from_slice(&frame.into_data().unwrap_or_default()),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(Bytes::from(got))
    }
}

fn config(provider: &str, extra_provider: &str) -> String {
    format!(
        "[store]\nkind = \"memory\"\n[[providers]]\nname = \"primary\"\nbase_url = \"{provider}\"\n{extra_provider}\n\
         [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\"]\n"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_stream_is_relayed_as_it_arrives_and_replayed_identically() {
    let mut provider = StreamingProvider::start().await;
    let gw = TestGateway::start(&config(&provider.url(), "")).await;
    let events = events();
    let client = tokio::spawn(Reading::start(format!("{}{CHAT}", gw.base), "k-slow"));
    let upstream = provider.next_call().await;
    send_chunk(&upstream, &events[0]);
    let mut reading = client.await.unwrap();
    assert_eq!(reading.headers["content-type"], "text/event-stream");
    assert_eq!(reading.headers["idempotent-replayed"], "false");

    // Five chunks 200 ms apart: each reaches the client before the next one is even sent.
    let started = Instant::now();
    let mut arrivals = Vec::new();
    let mut received = reading.read_exactly(events[0].len()).await.to_vec();
    arrivals.push(started.elapsed());
    for event in &events[1..5] {
        tokio::time::sleep(Duration::from_millis(200)).await;
        send_chunk(&upstream, event);
        received.extend_from_slice(&reading.read_exactly(event.len()).await);
        arrivals.push(started.elapsed());
    }
    assert!(
        arrivals[0] < Duration::from_millis(100),
        "first chunk at {:?}",
        arrivals[0]
    );
    assert!(
        arrivals[4] >= Duration::from_millis(800),
        "last chunk at {:?}",
        arrivals[4]
    );
    for event in &events[5..] {
        send_chunk(&upstream, event);
    }
    drop(upstream);
    received.extend_from_slice(&reading.read_to_end().await.expect("a clean end"));
    let whole: Vec<u8> = events.concat();
    assert_eq!(received, whole);

    let replay = gw
        .request(
            Method::POST,
            CHAT,
            &[
                ("authorization", "Bearer sk-client-1"),
                ("idempotency-key", "k-slow"),
            ],
            Bytes::from_static(br#"{"model":"gpt-4o-mini","stream":true}"#),
        )
        .await;
    assert_eq!(replay.status, 200);
    assert_eq!(
        replay.body,
        Bytes::from(whole),
        "the same bytes in the same order"
    );
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("content-type"), Some("text/event-stream"));
    assert_eq!(replay.header("x-request-id"), Some("req_stream"));
    assert_eq!(provider.calls(), 1);
    let view = gw.job(&replay.job_id()).await;
    assert_eq!(view["job"]["state"], "succeeded");
    assert_eq!(view["job"]["completed_by"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_joins_a_live_stream_from_its_start() {
    let mut provider = StreamingProvider::start().await;
    let gw = TestGateway::start(&config(&provider.url(), "")).await;
    let events = events();
    let first = tokio::spawn(Reading::start(format!("{}{CHAT}", gw.base), "k-join"));
    let upstream = provider.next_call().await;
    send_chunk(&upstream, &events[0]);
    let mut first = first.await.unwrap();
    send_chunk(&upstream, &events[1]);
    first.read_exactly(events[0].len() + events[1].len()).await;

    // The duplicate arrives after chunk 2: it gets chunks 1 and 2 at once, then follows live.
    let mut duplicate = Reading::start(format!("{}{CHAT}", gw.base), "k-join").await;
    assert_eq!(duplicate.headers["idempotent-replayed"], "true");
    assert_eq!(
        duplicate.headers["x-idempotency-job-id"],
        first.headers["x-idempotency-job-id"]
    );
    let so_far = duplicate
        .read_exactly(events[0].len() + events[1].len())
        .await;
    assert_eq!(
        so_far,
        Bytes::from([events[0].clone(), events[1].clone()].concat())
    );
    send_chunk(&upstream, &events[2]);
    assert_eq!(duplicate.read_exactly(events[2].len()).await, events[2]);
    for event in &events[3..] {
        send_chunk(&upstream, event);
    }
    drop(upstream);
    let rest = duplicate.read_to_end().await.expect("a clean end");
    assert_eq!(rest, Bytes::from(events[3..].concat()));
    first.read_to_end().await.expect("a clean end");
    assert_eq!(provider.calls(), 1, "one upstream call for both");
}

/// Starts a streamed request for `key` at the gateway `base`, has the provider send the
/// first three events and reads them: the reading, its job id and the provider's side.
async fn three_chunks_read(
    provider: &mut StreamingProvider,
    base: &str,
    key: &'static str,
) -> (Reading, String, mpsc::UnboundedSender<Chunk>) {
    let events = events();
    let client = tokio::spawn(Reading::start(format!("{base}{CHAT}"), key));
    let upstream = provider.next_call().await;
    for event in &events[..3] {
        send_chunk(&upstream, event);
    }
    let mut reading = client.await.unwrap();
    let id = reading.headers["x-idempotency-job-id"]
        .to_str()
        .unwrap()
        .to_owned();
    reading
        .read_exactly(events[..3].iter().map(Bytes::len).sum())
        .await;
    (reading, id, upstream)
}

async fn cut_or_stall(stall: bool) {
    let mut provider = StreamingProvider::start().await;
    let gw = TestGateway::start(&config(&provider.url(), "stream_idle_timeout = \"300ms\"")).await;
    let events = events();
    let (reading, id, upstream) = three_chunks_read(&mut provider, &gw.base, "k-cut").await;
    if !stall {
        upstream
            .send(Err(std::io::Error::other("connection reset")))
            .unwrap();
    }
    let end = reading.read_to_end().await;
    assert!(
        end.is_err(),
        "the client's body must end abnormally, not cleanly: {end:?}"
    );
    let view = gw
        .job_eventually(&id, |v| v["job"]["state"] == "failed")
        .await;
    assert_eq!(view["attempts"][0]["state"], "failed");
    assert_eq!(view["job"]["completed_by"], serde_json::Value::Null);
    drop(upstream);

    // A retry opens a new round: attempt 2.
    let retry = tokio::spawn(Reading::start(format!("{}{CHAT}", gw.base), "k-cut"));
    let upstream = provider.next_call().await;
    for event in &events {
        send_chunk(&upstream, event);
    }
    drop(upstream);
    let retry = retry.await.unwrap();
    assert_eq!(retry.headers["x-idempotency-attempt"], "2");
    assert_eq!(retry.headers["x-idempotency-job-id"].to_str().unwrap(), id);
    assert_eq!(
        retry.read_to_end().await.unwrap(),
        Bytes::from(events.concat())
    );
    assert_eq!(provider.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_cut_after_chunk_three_fails_the_job_and_the_client_sees_it() {
    cut_or_stall(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_longer_than_the_idle_timeout_is_a_cut() {
    cut_or_stall(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_larger_than_the_store_limit_reaches_the_client_but_is_not_replayed() {
    let primary = wiremock::MockServer::start().await;
    let big = Bytes::from(vec![b'x'; 64 * 1024]);
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(wiremock::ResponseTemplate::new(200).set_body_bytes(big.clone()))
        .mount(&primary)
        .await;
    // The harness owns [server], so this gateway with a small limit is started by hand.
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"{ADMIN_TOKEN_ENV}\"\nmax_stored_response_bytes = 1024\n{}",
        config(&primary.uri(), "")
    );
    let running = idemgate::start(idemgate::Config::parse(&text, "t").unwrap())
        .await
        .unwrap();
    let c = client();
    let url = format!("http://{}{CHAT}", running.addr);
    let headers = [
        ("authorization", "Bearer sk-client-1"),
        ("idempotency-key", "k-big"),
    ];
    let first = send(&c, Method::POST, &url, &headers, Bytes::from_static(b"{}")).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.body, big, "the whole answer reaches the client");
    let again = send(&c, Method::POST, &url, &headers, Bytes::from_static(b"{}")).await;
    again.assert_problem(409, "response-not-stored");
    assert_eq!(again.job_id(), first.job_id());
    assert_eq!(received(&primary).await, 1, "the job never runs twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_on_another_gateway_follows_the_stream_through_redis() {
    let server = common::redis_server::RedisServer::start().await;
    follows_across(redis_store(&server).await, redis_store(&server).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_on_another_gateway_follows_the_stream_through_postgres() {
    let url = common::pg_server::shared().database().await;
    follows_across(postgres_store(&url).await, postgres_store(&url).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_on_another_gateway_follows_a_retried_stream_not_the_cut_one() {
    let server = common::redis_server::RedisServer::start().await;
    let url = common::pg_server::shared().database().await;
    follows_a_retry_across(redis_store(&server).await, redis_store(&server).await).await;
    follows_a_retry_across(postgres_store(&url).await, postgres_store(&url).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_write_that_fails_or_loses_its_reply_is_written_again_once() {
    use faults::Fault;
    let server = common::redis_server::RedisServer::start().await;
    let url = common::pg_server::shared().database().await;
    // The head goes through; the first chunks are written but their reply is lost; writing
    // them again fails before it reaches the store; the third write goes through. The
    // follower on the other gateway must still get every chunk once, in order.
    let faults = [None, Some(Fault::ErrorAfter), Some(Fault::ErrorBefore)];
    follows_across_mirror_faults(&server, &url, &faults).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_arrives_before_the_mirror_follows_it_once_written() {
    use faults::Fault;
    let server = common::redis_server::RedisServer::start().await;
    let url = common::pg_server::shared().database().await;
    // The head reaches the store half a second after the stream started, well after the
    // duplicate asked: the job does not change when it lands, so only looking again finds it.
    let late_head = [Some(Fault::Delay(Duration::from_millis(500)))];
    follows_across_mirror_faults(&server, &url, &late_head).await;
}

/// [`follows_across`] on Redis, then on PostgreSQL, with `faults` met by the streaming
/// gateway's first mirror writes.
async fn follows_across_mirror_faults(
    server: &common::redis_server::RedisServer,
    url: &str,
    faults: &[Option<faults::Fault>],
) {
    let streaming = faults::Faulty::scripted(redis_store(server).await, &[]);
    streaming.mirror_faults(faults);
    follows_across(streaming, redis_store(server).await).await;
    let streaming = faults::Faulty::scripted(postgres_store(url).await, &[]);
    streaming.mirror_faults(faults);
    follows_across(streaming, postgres_store(url).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_streams_late_mirror_end_does_not_reach_its_retrys_followers() {
    late_cut_on_redis_then_postgres("end").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_streams_late_mirror_head_does_not_replace_its_retrys() {
    late_cut_on_redis_then_postgres("head").await;
}

/// [`follows_a_retry_past_a_late`] `step` on Redis, then on PostgreSQL.
async fn late_cut_on_redis_then_postgres(step: &'static str) {
    let server = common::redis_server::RedisServer::start().await;
    let url = common::pg_server::shared().database().await;
    let streaming = faults::Faulty::scripted(redis_store(&server).await, &[]);
    follows_a_retry_past_a_late(streaming, redis_store(&server).await, step).await;
    let streaming = faults::Faulty::scripted(postgres_store(&url).await, &[]);
    follows_a_retry_past_a_late(streaming, postgres_store(&url).await, step).await;
}

/// Gateway `a` (on `streaming`) relays a stream that is cut, then a retry's, whose head is
/// mirrored before the cut one's `step` (its head: all of its mirror; or its end) lands; a
/// duplicate on gateway `b` follows the retry.
async fn follows_a_retry_past_a_late(
    streaming: Arc<faults::Faulty>,
    b: Arc<dyn idemgate::store::JobStore>,
    step: &'static str,
) {
    let late = streaming.hold_next_mirror(step);
    let mut mirrored = streaming.watch_mirror();
    let (mut provider, a, b) = two_gateways(streaming, b).await;
    let key = "k-late-cut";
    // The retry streams and its head is mirrored while the cut one's writes are on their way.
    let (upstream, retry) = cut_then_retried(&mut provider, &a, key).await;
    mirror_reached(&mut mirrored, ("head", 2)).await;
    late.add_permits(1);
    mirror_reached(&mut mirrored, ("end", 1)).await;
    // A duplicate on the other gateway follows the retry, not the cut it came after.
    duplicate_follows_the_retry(&provider, &b, key, upstream, retry).await;
}

/// Waits (bounded) until a mirror write `want` reached the store.
async fn mirror_reached(
    mirrored: &mut mpsc::UnboundedReceiver<(&'static str, u32)>,
    want: (&'static str, u32),
) {
    while bounded("a mirror write", mirrored.recv()).await.unwrap() != want {}
}

/// A streaming provider and two gateways in front of it, on stores `a` and `b`.
async fn two_gateways(
    a: Arc<dyn idemgate::store::JobStore>,
    b: Arc<dyn idemgate::store::JobStore>,
) -> (StreamingProvider, TestGateway, TestGateway) {
    let provider = StreamingProvider::start().await;
    let a = TestGateway::start_on(&config(&provider.url(), ""), a).await;
    let b = TestGateway::start_on(&config(&provider.url(), ""), b).await;
    (provider, a, b)
}

/// Gateway `a` relays a stream that is cut after three chunks, then the retry's stream; a
/// duplicate on gateway `b` follows the retry's stream from its own first chunk, with none
/// of the cut stream's chunks and not its cut.
async fn follows_a_retry_across(
    a: Arc<dyn idemgate::store::JobStore>,
    b: Arc<dyn idemgate::store::JobStore>,
) {
    let (mut provider, a, b) = two_gateways(a, b).await;
    let key = "k-again";
    let (upstream, retry) = cut_then_retried(&mut provider, &a, key).await;
    duplicate_follows_the_retry(&provider, &b, key, upstream, retry).await;
}

/// On gateway `a`, a stream for `key` cut after three chunks, then the retry's stream with
/// its first chunk read: the retry's upstream and the retry's response.
async fn cut_then_retried(
    provider: &mut StreamingProvider,
    a: &TestGateway,
    key: &'static str,
) -> (mpsc::UnboundedSender<Chunk>, Reading) {
    let events = events();
    let (first, id, upstream) = three_chunks_read(provider, &a.base, key).await;
    upstream
        .send(Err(std::io::Error::other("connection reset")))
        .unwrap();
    assert!(
        first.read_to_end().await.is_err(),
        "the first stream is cut"
    );
    a.job_eventually(&id, |v| v["job"]["state"] == "failed")
        .await;
    drop(upstream);

    let retry = tokio::spawn(Reading::start(format!("{}{CHAT}", a.base), key));
    let upstream = provider.next_call().await;
    send_chunk(&upstream, &events[0]);
    let mut retry = retry.await.unwrap();
    assert_eq!(retry.headers["x-idempotency-attempt"], "2");
    assert_eq!(retry.read_exactly(events[0].len()).await, events[0]);
    (upstream, retry)
}

/// A duplicate for `key` on gateway `b` follows the retry's stream from its own first chunk
/// (none of the cut stream's chunks, not its cut) to a clean end, as the retry does.
async fn duplicate_follows_the_retry(
    provider: &StreamingProvider,
    b: &TestGateway,
    key: &str,
    upstream: mpsc::UnboundedSender<Chunk>,
    retry: Reading,
) {
    let events = events();
    let mut duplicate = Reading::start(format!("{}{CHAT}", b.base), key).await;
    assert_eq!(duplicate.headers["x-idempotency-attempt"], "2");
    assert_eq!(duplicate.read_exactly(events[0].len()).await, events[0]);
    both_end_cleanly(upstream, &events[1..], duplicate, retry).await;
    assert_eq!(provider.calls(), 2, "the cut stream and the retry's");
}

/// The provider sends `rest` and ends the stream: the duplicate reads exactly `rest` to a
/// clean end, and the request that started the stream ends cleanly too.
async fn both_end_cleanly(
    upstream: mpsc::UnboundedSender<Chunk>,
    rest: &[Bytes],
    duplicate: Reading,
    first: Reading,
) {
    for event in rest {
        send_chunk(&upstream, event);
    }
    drop(upstream);
    assert_eq!(
        duplicate.read_to_end().await.expect("a clean end"),
        Bytes::from(rest.concat())
    );
    first.read_to_end().await.expect("a clean end");
}

const POLICY: idemgate::job::ExpiryPolicy = idemgate::job::ExpiryPolicy {
    retention: Duration::from_secs(3600),
    late_result_window: Duration::from_secs(600),
};

/// A gateway's own client of the Redis `server`.
async fn redis_store(
    server: &common::redis_server::RedisServer,
) -> Arc<dyn idemgate::store::JobStore> {
    let config = common::redis_server::store_config(server.url());
    let store = idemgate::store::redis::RedisStore::open(&config, POLICY).await;
    Arc::new(store.unwrap())
}

/// A gateway's own client of the PostgreSQL database at `url`.
async fn postgres_store(url: &str) -> Arc<dyn idemgate::store::JobStore> {
    let config = common::pg_server::store_config(url, 4);
    let store = idemgate::store::postgres::PostgresStore::open(&config, POLICY).await;
    Arc::new(store.unwrap())
}

/// Gateway `a` relays a stream; a duplicate on gateway `b` (another store client on the
/// same store) gets what was relayed so far, then follows it live to its clean end.
async fn follows_across(
    a: Arc<dyn idemgate::store::JobStore>,
    b: Arc<dyn idemgate::store::JobStore>,
) {
    let (mut provider, a, b) = two_gateways(a, b).await;
    let events = events();

    let first = tokio::spawn(Reading::start(format!("{}{CHAT}", a.base), "k-across"));
    let upstream = provider.next_call().await;
    send_chunk(&upstream, &events[0]);
    send_chunk(&upstream, &events[1]);
    let mut first = first.await.unwrap();
    first.read_exactly(events[0].len() + events[1].len()).await;

    let mut duplicate = Reading::start(format!("{}{CHAT}", b.base), "k-across").await;
    assert_eq!(duplicate.headers["idempotent-replayed"], "true");
    assert_eq!(
        duplicate.headers["x-idempotency-job-id"],
        first.headers["x-idempotency-job-id"]
    );
    assert_eq!(duplicate.headers["content-type"], "text/event-stream");
    let so_far = duplicate
        .read_exactly(events[0].len() + events[1].len())
        .await;
    assert_eq!(
        so_far,
        Bytes::from([events[0].clone(), events[1].clone()].concat())
    );
    // It follows live: chunk 3 reaches it while the stream is still open.
    send_chunk(&upstream, &events[2]);
    assert_eq!(duplicate.read_exactly(events[2].len()).await, events[2]);
    both_end_cleanly(upstream, &events[3..], duplicate, first).await;
    assert_eq!(
        provider.calls(),
        1,
        "one upstream call across both gateways"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_stops_where_a_retry_replaced_the_stream_it_followed() {
    use common::mirror::{chunks, head};
    let server = common::redis_server::RedisServer::start().await;
    let store = redis_store(&server).await;
    let id = idemgate::job::new_job_id("owner-a", "k-replaced");
    store.mirror_stream(&id, head(1)).await.unwrap();
    store
        .mirror_stream(&id, chunks(1, 0, &["a"]))
        .await
        .unwrap();
    let first = store.read_stream(&id, 0).await.unwrap().expect("a mirror");
    let mut body = idemgate::stream::follow(store.clone(), id.clone(), first);
    let frame = bounded("the first chunk", body.frame())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(frame.into_data().unwrap(), "a");

    // Before the follower looks again, its attempt's stream is replaced by a retry's, which
    // by then holds more chunks than the follower has read.
    store.mirror_stream(&id, head(2)).await.unwrap();
    store
        .mirror_stream(&id, chunks(2, 0, &["x", "y"]))
        .await
        .unwrap();
    match bounded("the follower's next step", body.frame()).await {
        Some(Err(_)) => {}
        other => panic!("a follower relayed past its attempt's stream: {other:?}"),
    }
}
