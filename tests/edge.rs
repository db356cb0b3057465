//! The client edge (SPEC §11, §3 steps 1–2): what a hostile or careless client can do to
//! the gateway — hold connections, trickle headers, stall bodies, flood it, spell a path
//! another way, send two owners — and what it gets back. Against in-process gateways on
//! port 0 and, where a process's own memory, descriptors, logs or signals matter, the real
//! binary.

mod common;

use std::io::Write as _;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Method, Request, Response};
use idemgate::body::{self, Body};
use idemgate::upstream::{Exchange, Transport, Upstream};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::Instant;

const CHAT: &str = "/v1/chat/completions";

/// The tests that open hundreds of connections or hundreds of megabytes take turns, so each
/// measures its own gateway rather than the machine's other load.
static HEAVY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn edge_config(provider: &str, server: &str) -> String {
    format!(
        "{server}\n[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"primary\"\nbase_url = \"{provider}\"\ntimeout = \"5s\"\n\
         [[routes]]\nname = \"chat\"\nmethods = [\"POST\"]\npath_prefix = \"{CHAT}\"\nproviders = [\"primary\"]\n\
         [[routes]]\nname = \"rest\"\npath_prefix = \"/\"\nproviders = [\"primary\"]\nidempotency = \"off\"\n"
    )
}

fn addr_of(base: &str) -> String {
    base.trim_start_matches("http://").to_owned()
}

/// Reads from `stream` until it closes (or `limit` passes); returns what was read and when
/// the close came.
async fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (Vec<u8>, Option<Instant>) {
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (out, Some(Instant::now())),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (out, None),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_are_cut_off_while_other_clients_are_served() {
    let _turn = HEAVY.lock().await;
    // A plain hyper provider: this test leaves hundreds of sockets half open, which a
    // wiremock server's verification on drop can wait on for ever.
    let (provider, calls) = completing_provider().await;
    let config = edge_config(&provider, "request_header_timeout = \"1s\"");
    let gw = TestGateway::start(&config).await;
    let addr = addr_of(&gw.base);
    let started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..500 {
        let addr = addr.clone();
        slow.push(tokio::spawn(async move {
            let mut stream = bounded("a connection", TcpStream::connect(&addr))
                .await
                .unwrap();
            let opened = Instant::now();
            stream
                .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
                .await
                .unwrap();
            // Trickle a header line now and then; the head never completes.
            let (mut reader, mut writer) = stream.into_split();
            let trickle = tokio::spawn(async move {
                for i in 0..40 {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    if writer
                        .write_all(format!("X-{i}: y\r\n").as_bytes())
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
            });
            let mut read = Vec::new();
            let closed =
                tokio::time::timeout(Duration::from_secs(5), reader.read_to_end(&mut read))
                    .await
                    .is_ok();
            trickle.abort();
            (closed, opened.elapsed(), read)
        }));
    }
    // A normal client is served all the while.
    for i in 0..5 {
        let reply = gw
            .post(CHAT, Some(&format!("normal-{i}")), chat_request())
            .await;
        assert_eq!(reply.status, 200);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let mut answered_408 = 0;
    for task in slow {
        let (closed, after, read) = bounded("a slow client", task).await.unwrap();
        assert!(closed, "a trickling connection was never closed");
        assert!(
            after >= Duration::from_millis(900) && after < Duration::from_secs(3),
            "closed after {after:?}"
        );
        if read.starts_with(b"HTTP/1.1 408") {
            answered_408 += 1;
            let text = String::from_utf8_lossy(&read);
            assert!(text.contains("urn:idemgate:request-timeout"), "{text}");
        }
    }
    assert_eq!(answered_408, 500, "every slow head gets its 408");
    assert!(started.elapsed() < Duration::from_secs(8));
    assert_eq!(
        calls.load(Ordering::SeqCst),
        5,
        "only the normal client reached the provider"
    );
}

/// A provider answering every request with the completion fixture, and its call count.
async fn completing_provider() -> (String, Arc<AtomicUsize>) {
    let (addr, calls) = serve_provider(|_request: Request<hyper::body::Incoming>| async {
        let mut response = hyper::Response::new(http_body_util::Full::new(fixture(
            "openai-chat-completion.json",
        )));
        response
            .headers_mut()
            .insert("content-type", "application/json".parse().unwrap());
        Ok::<_, std::io::Error>(response)
    })
    .await;
    (format!("http://{addr}"), calls)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_and_a_closed_connection_and_reaches_no_one() {
    let provider = answering(completion()).await;
    let config = edge_config(&provider.uri(), "request_body_timeout = \"1s\"");
    let gw = TestGateway::start(&config).await;
    for path in [CHAT, "/v1/files"] {
        let mut stream = TcpStream::connect(addr_of(&gw.base)).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: stall\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"model\":"
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        let sent = Instant::now();
        let (read, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
        let text = String::from_utf8_lossy(&read);
        assert!(text.starts_with("HTTP/1.1 408"), "{path}: {text}");
        assert!(text.contains("urn:idemgate:request-timeout"), "{text}");
        assert!(closed.is_some(), "{path}: the connection stays open");
        assert!(sent.elapsed() < Duration::from_secs(3));
    }
    assert_eq!(received(&provider).await, 0, "nothing reached the provider");
    let store = gw.running.gateway.store();
    assert_eq!(store.count_unknown().await.unwrap(), 0);
}

/// Sends `request` on a connection of its own and reads the answer until the gateway
/// closes the connection.
async fn answer_on_its_own_connection(gw: &TestGateway, request: &[u8]) -> String {
    let mut stream = TcpStream::connect(addr_of(&gw.base)).await.unwrap();
    // The gateway may answer before it has read the whole request and close: a write that
    // fails then is the test's to ignore, the answer is what counts.
    let _ = stream.write_all(request).await;
    let (read, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    assert!(closed.is_some(), "the connection stays open");
    String::from_utf8_lossy(&read).into_owned()
}

/// The problem+json of a whole answer, checked against its `x-request-id` header.
fn problem_of(answer: &str) -> serde_json::Value {
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let head = head.to_ascii_lowercase();
    assert!(
        head.contains("content-type: application/problem+json"),
        "{answer}"
    );
    assert!(head.contains("x-should-retry: false"), "{answer}");
    let problem: serde_json::Value = serde_json::from_str(body).expect("a JSON body");
    let id = problem["request_id"].as_str().expect("a request id");
    assert!(head.contains(&format!("x-request-id: {id}")), "{answer}");
    assert_eq!(
        problem["error"]["code"],
        problem["type"].as_str().unwrap()[13..]
    );
    problem
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_hyper_cannot_take_get_problems_and_reach_no_one() {
    let provider = answering(completion()).await;
    let gw = TestGateway::start(&edge_config(&provider.uri(), "")).await;
    let keyed = |key: &str, extra: &str| {
        format!(
            "POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-client-1\r\nIdempotency-Key: {key}\r\n{extra}Content-Length: 2\r\n\r\n{{}}"
        )
    };

    // A head past 64 KiB, on a protected route and on a pass-through one; one of more
    // fields than hyper parses.
    let big = format!("X-Padding: {}\r\n", "a".repeat(100 * 1024));
    let many: String = (0..120).map(|i| format!("X-Field-{i}: {i}\r\n")).collect();
    for request in [
        keyed("big", &big),
        format!("GET /v1/models HTTP/1.1\r\nHost: x\r\n{big}\r\n"),
        keyed("big", &many),
    ] {
        let answer = answer_on_its_own_connection(&gw, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
        let problem = problem_of(&answer);
        assert_eq!(problem["type"], "urn:idemgate:request-header-too-large");
        assert_eq!(problem["status"], 431);
    }

    // Not HTTP at all, and a request line with a space in its target.
    for request in ["GARBAGE\r\n\r\n", "GET /a b HTTP/1.1\r\nHost: x\r\n\r\n"] {
        let answer = answer_on_its_own_connection(&gw, request.as_bytes()).await;
        assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
        assert_eq!(problem_of(&answer)["type"], "urn:idemgate:bad-request");
    }

    // A request target past the bound is a head past it.
    let long = format!("GET /{} HTTP/1.1\r\nHost: x\r\n\r\n", "a".repeat(70_000));
    let answer = answer_on_its_own_connection(&gw, long.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer}");
    assert_eq!(
        problem_of(&answer)["type"],
        "urn:idemgate:request-header-too-large"
    );

    assert_eq!(received(&provider).await, 0, "nothing reached the provider");
    assert!(!key_was_claimed(&gw, "big").await, "nothing was claimed");

    // A large head within the bound is served; the gateway's own 400 after it, on the same
    // connection, stays its own.
    let within = format!("X-Padding: {}\r\n", "a".repeat(48 * 1024));
    let mut stream = TcpStream::connect(addr_of(&gw.base)).await.unwrap();
    stream
        .write_all(keyed("within", &within).as_bytes())
        .await
        .unwrap();
    let mut buf = vec![0u8; 64 * 1024];
    let n = bounded("the answer", stream.read(&mut buf)).await.unwrap();
    let answer = String::from_utf8_lossy(&buf[..n]);
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert_eq!(received(&provider).await, 1);
    stream
        .write_all(format!("POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-client-1\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}").as_bytes())
        .await
        .unwrap();
    let (read, _) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let answer = String::from_utf8_lossy(&read);
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert_eq!(
        problem_of(&answer)["type"],
        "urn:idemgate:missing-idempotency-key"
    );
}

/// A gateway with the `[server]` lines `server`, its provider, and a keep-alive connection
/// to it that has had one answer: a keyless request on the chat route, which the gateway
/// answers itself (400).
async fn answered_once(server: &str) -> (TestGateway, wiremock::MockServer, TcpStream) {
    let provider = answering(completion()).await;
    let gw = TestGateway::start(&edge_config(&provider.uri(), server)).await;
    let mut stream = TcpStream::connect(addr_of(&gw.base)).await.unwrap();
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nContent-Length: 2\r\n\r\n{}")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let n = bounded("the answer", stream.read(&mut buf)).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 400"));
    (gw, provider, stream)
}

/// A connection to the gateway whose socket takes little before its client reads.
async fn small_window_connection(gw: &TestGateway) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket
        .connect(addr_of(&gw.base).parse().unwrap())
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_nothing_of_its_answer_is_cut_off_after_idle_timeout() {
    let _turn = HEAVY.lock().await;
    const BODY: usize = 16 << 20;
    let provider =
        answering(wiremock::ResponseTemplate::new(200).set_body_bytes(vec![b'a'; BODY])).await;
    let gw = TestGateway::start(&edge_config(&provider.uri(), "idle_timeout = \"1s\"")).await;
    // A pass-through route: nothing is stored, the answer streams.
    let request = b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n";

    // A client that reads along, at its own pace, gets its whole answer however much
    // longer than idle_timeout that takes: the timer runs between writes, not over the answer.
    let mut reader = TcpStream::connect(addr_of(&gw.base)).await.unwrap();
    reader.write_all(request).await.unwrap();
    let mut got = 0;
    let mut buf = vec![0u8; 64 << 10];
    let started = Instant::now();
    while got < BODY {
        // The client's pace under test: 64 KiB at most every 8 ms.
        tokio::time::sleep(Duration::from_millis(8)).await;
        let n = bounded("a read", reader.read(&mut buf)).await.unwrap();
        assert!(n > 0, "the connection closed after {got} bytes");
        got += n;
    }
    assert!(
        started.elapsed() > Duration::from_millis(1500),
        "the answer took less than idle_timeout to read: the test proves nothing"
    );

    // One that stops reading is cut off once its socket is full and idle_timeout passes.
    let mut stalled = small_window_connection(&gw).await;
    stalled.write_all(request).await.unwrap();
    let stopped = Instant::now();
    // The client's behaviour under test: reading nothing for a while.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (read, closed) = read_until_closed(&mut stalled, Duration::from_secs(10)).await;
    let closed = closed.expect("the stalled connection is closed");
    assert!(
        read.len() < BODY,
        "the whole answer arrived: the connection waited for its client"
    );
    assert!(
        closed.duration_since(stopped) < Duration::from_secs(8),
        "closed {:?} after the client stopped reading",
        closed.duration_since(stopped)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_keep_alive_connection_is_closed_after_idle_timeout() {
    let (_gw, _provider, mut stream) = answered_once("idle_timeout = \"1s\"").await;
    let answered = Instant::now();
    let (_, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let idle = closed
        .expect("the idle connection is closed")
        .duration_since(answered);
    assert!(
        idle >= Duration::from_millis(900) && idle < Duration::from_secs(3),
        "closed after {idle:?} idle"
    );
}

/// After a keep-alive pause long enough for the connection's timers to settle on its idle
/// deadline, a slow head is still cut off `request_header_timeout` after its first byte,
/// not at the idle deadline further away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_head_after_a_keep_alive_pause_is_cut_off_at_the_header_timeout() {
    let (_gw, provider, mut stream) =
        answered_once("request_header_timeout = \"1s\"\nidle_timeout = \"10s\"").await;
    // Past the first head's deadline: the timers now wait for the idle one, 10 s away.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stream
        .write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let started = Instant::now();
    let (read, closed) = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let after = closed
        .expect("the slow head's connection is closed")
        .duration_since(started);
    assert!(
        after >= Duration::from_millis(900) && after < Duration::from_secs(3),
        "closed {after:?} after the head began"
    );
    assert!(
        String::from_utf8_lossy(&read).starts_with("HTTP/1.1 408"),
        "{}",
        String::from_utf8_lossy(&read)
    );
    assert_eq!(received(&provider).await, 0, "nothing reached the provider");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ninth_request_in_flight_is_shed_before_anything_is_claimed() {
    let mut provider = HeldProvider::start().await;
    let config = edge_config(&provider.url(), "max_in_flight = 8");
    let gw = Arc::new(TestGateway::start(&config).await);
    let mut held = Vec::new();
    for i in 0..8 {
        let gw = gw.clone();
        held.push(tokio::spawn(async move {
            gw.post(CHAT, Some(&format!("held-{i}")), chat_request())
                .await
        }));
    }
    let mut calls = Vec::new();
    for _ in 0..8 {
        calls.push(provider.next_call().await);
    }
    let shed = gw.post(CHAT, Some("ninth"), chat_request()).await;
    shed.assert_problem(503, "overloaded");
    assert!(shed.header("retry-after").is_some(), "{shed:?}");
    assert!(shed.header("x-request-id").is_some());
    assert_eq!(provider.calls(), 8, "the shed request reached no provider");
    // Nothing was claimed for its key: a claim of it now creates the job.
    assert!(!key_was_claimed(&gw, "ninth").await);
    for call in calls {
        call.answer(200, fixture("openai-chat-completion.json"));
    }
    for task in held {
        assert_eq!(task.await.unwrap().status, 200);
    }
    // Slots are given back: the next request is served.
    let later = gw.post(CHAT, Some("later"), chat_request());
    let call = tokio::spawn(async move {
        let call = provider.next_call().await;
        call.answer(200, fixture("openai-chat-completion.json"));
    });
    assert_eq!(later.await.status, 200);
    call.await.unwrap();
}

/// Whether the bearer `sk-client-1` already has a job for `key` in the gateway's store.
async fn key_was_claimed(gw: &TestGateway, key: &str) -> bool {
    let mut headers = http::HeaderMap::new();
    headers.insert("authorization", "Bearer sk-client-1".parse().unwrap());
    let owner = idemgate::intent::owner(&idemgate::intent::OwnerMode::Bearer, &headers).unwrap();
    let now = idemgate::clock::now();
    let policy = idemgate::job::ExpiryPolicy {
        retention: Duration::from_secs(60),
        late_result_window: Duration::from_secs(60),
    };
    let probe = idemgate::job::JobRecord::new(
        "job_probe".into(),
        owner,
        key.into(),
        "probe".into(),
        "chat".into(),
        now,
        now,
        &policy,
    );
    matches!(
        gw.running.gateway.store().claim(probe, now).await.unwrap(),
        idemgate::store::Claim::Existing(_)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_spelling_of_a_protected_path_gets_around_its_job() {
    let provider = answering(completion()).await;
    let gw = TestGateway::start(&edge_config(&provider.uri(), "")).await;
    let spellings = [
        ("POST", "/v1//chat/completions"),
        ("POST", "/v1/./chat/completions"),
        ("POST", "/v1/chat%2Fcompletions"),
        ("POST", "/v1/chat/completions;x=1"),
        ("POST", "/v1/%63hat/completions"),
        ("POST", "/v1/x/../chat/completions"),
        ("POST", "//v1/chat/completions"),
        ("post", "/v1/chat/completions"),
    ];
    for (i, (method, path)) in spellings.into_iter().enumerate() {
        let before = received(&provider).await;
        let key = format!("spelling-{i}");
        let method = Method::from_bytes(method.as_bytes()).unwrap();
        let headers = [
            ("authorization", "Bearer sk-client-1"),
            ("content-type", "application/json"),
            ("idempotency-key", key.as_str()),
        ];
        let first = gw
            .request(method.clone(), path, &headers, chat_request())
            .await;
        let second = gw.request(method, path, &headers, chat_request()).await;
        let calls = received(&provider).await - before;
        assert!(calls <= 1, "{path}: {calls} provider calls for one key");
        if first.status == 200 {
            assert_eq!(second.header("idempotent-replayed"), Some("true"), "{path}");
            assert_eq!(second.job_id(), first.job_id(), "{path}");
        } else {
            first.assert_problem(404, "no-route");
            assert_eq!(calls, 0, "{path}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keyed_post_on_an_off_route_is_served_but_says_the_key_was_not_honoured() {
    let provider = answering(completion()).await;
    let gw = TestGateway::start(&edge_config(&provider.uri(), "")).await;
    let headers = [
        ("authorization", "Bearer sk-client-1"),
        ("idempotency-key", "k"),
    ];
    let reply = gw
        .request(
            Method::POST,
            "/v1/other",
            &headers,
            Bytes::from_static(b"{}"),
        )
        .await;
    assert_eq!(reply.header("idempotency-key-honoured"), Some("false"));
    assert!(reply.header("x-idempotency-job-id").is_none());
    let unkeyed = gw
        .request(
            Method::POST,
            "/v1/other",
            &[("authorization", "Bearer a")],
            Bytes::from_static(b"{}"),
        )
        .await;
    assert!(unkeyed.header("idempotency-key-honoured").is_none());
    let metrics = gw.admin_get("/metrics").await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("idemgate_unprotected_keyed_requests_total{route=\"rest\"} 1"),
        "{text}"
    );
}

/// A provider answering the completion fixture with no `X-Request-Id` of its own, so the
/// id a client gets back is the gateway's.
async fn answering_without_an_id() -> wiremock::MockServer {
    answering(
        wiremock::ResponseTemplate::new(200)
            .set_body_raw(fixture("openai-chat-completion.json"), "application/json"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_request_id_is_kept_only_when_fit_to_log_and_forward() {
    let provider = answering_without_an_id().await;
    let gw = TestGateway::start(&edge_config(&provider.uri(), "")).await;
    let long = "r".repeat(201);
    let mut sent_ids = Vec::new();
    for (key, id) in [("fit", "req-mine"), ("long", long.as_str())] {
        let reply = gw
            .request(
                Method::POST,
                CHAT,
                &[
                    ("authorization", "Bearer a"),
                    ("idempotency-key", key),
                    ("x-request-id", id),
                ],
                chat_request(),
            )
            .await;
        assert_eq!(reply.status, 200);
        sent_ids.push(reply.header("x-request-id").expect("an id").to_owned());
    }
    assert_eq!(sent_ids[0], "req-mine");
    assert!(
        uuid::Uuid::parse_str(&sent_ids[1]).is_ok(),
        "{}",
        sent_ids[1]
    );
    // The provider got what the client got back, never the refused id.
    let forwarded: Vec<String> = provider
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.headers["x-request-id"].to_str().unwrap().to_owned())
        .collect();
    assert_eq!(forwarded, sent_ids);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_owner_header_is_refused_and_replays_nobody_s_answer() {
    let provider = answering(completion()).await;
    let config = format!(
        "[idempotency]\nowner = \"header:X-Owner-Id\"\n{}",
        edge_config(&provider.uri(), "")
    );
    let gw = TestGateway::start(&config).await;
    let victim = gw
        .request(
            Method::POST,
            CHAT,
            &[("x-owner-id", "victim-team"), ("idempotency-key", "k")],
            chat_request(),
        )
        .await;
    assert_eq!(victim.status, 200);
    let attack = gw
        .request(
            Method::POST,
            CHAT,
            &[
                ("x-owner-id", "victim-team"),
                ("x-owner-id", "attacker-team"),
                ("idempotency-key", "k"),
            ],
            chat_request(),
        )
        .await;
    attack.assert_problem(400, "ambiguous-owner");
    assert!(attack.header("x-idempotency-job-id").is_none());
    assert_eq!(received(&provider).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_owners_are_one_owner_whichever_header_carries_the_key() {
    let provider = answering(completion()).await;
    let config = format!(
        "[idempotency]\nowner = \"api-key\"\n{}",
        edge_config(&provider.uri(), "")
    );
    let gw = TestGateway::start(&config).await;
    let first = gw
        .request(
            Method::POST,
            CHAT,
            &[("authorization", "Bearer sk-1"), ("idempotency-key", "k")],
            chat_request(),
        )
        .await;
    for header in ["x-api-key", "api-key"] {
        let again = gw
            .request(
                Method::POST,
                CHAT,
                &[(header, "sk-1"), ("idempotency-key", "k")],
                chat_request(),
            )
            .await;
        assert_eq!(again.job_id(), first.job_id(), "{header}");
        assert_eq!(again.header("idempotent-replayed"), Some("true"));
    }
    let two = gw
        .request(
            Method::POST,
            CHAT,
            &[
                ("authorization", "Bearer sk-1"),
                ("x-api-key", "sk-2"),
                ("idempotency-key", "k"),
            ],
            chat_request(),
        )
        .await;
    two.assert_problem(400, "ambiguous-owner");
    let none = gw.post_without_owner(CHAT, "k", chat_request()).await;
    none.assert_problem(401, "missing-owner");
    // Names every header the key may come in, not only Authorization.
    let detail = none.json()["detail"].as_str().unwrap().to_owned();
    assert!(
        detail.contains("X-Api-Key") && detail.contains("api-key"),
        "{detail}"
    );
    assert_eq!(received(&provider).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_listed_clients_get_through_and_nothing_is_claimed_for_the_others() {
    let provider = answering(completion()).await;
    let allowed = idemgate::intent::digest(b"Bearer sk-client-1");
    let config = format!(
        "[clients]\nallow = [\"{allowed}\"]\n{}",
        edge_config(&provider.uri(), "")
    );
    let gw = TestGateway::start(&config).await;
    let stranger = gw
        .request(
            Method::POST,
            CHAT,
            &[
                ("authorization", "Bearer sk-stranger"),
                ("idempotency-key", "k"),
            ],
            chat_request(),
        )
        .await;
    stranger.assert_problem(401, "unknown-client");
    // Pass-through routes are the gateway's too.
    let proxied = gw
        .request(
            Method::GET,
            "/v1/models",
            &[("authorization", "Bearer sk-stranger")],
            Bytes::new(),
        )
        .await;
    proxied.assert_problem(401, "unknown-client");
    let nobody = gw.post_without_owner(CHAT, "k", chat_request()).await;
    nobody.assert_problem(401, "missing-owner");
    assert_eq!(received(&provider).await, 0);
    assert_eq!(gw.post(CHAT, Some("k"), chat_request()).await.status, 200);
    assert_eq!(received(&provider).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_rereads_the_allow_file() {
    let provider = answering(completion()).await;
    let dir = tempfile::tempdir().unwrap();
    let allow = dir.path().join("clients.txt");
    std::fs::write(
        &allow,
        format!("# team a\n{}\n", idemgate::intent::digest(b"Bearer a")),
    )
    .unwrap();
    let clients = format!("[clients]\nallow_file = \"{}\"", allow.display());
    let (config, port, admin) = process_config(dir.path(), &provider.uri(), &clients).await;
    let gateway = spawn_gateway(&config, port, admin).await;
    let client = client();
    let post = |auth: &'static str, key: &'static str| {
        let client = client.clone();
        let url = format!("{}{CHAT}", gateway.base);
        async move {
            send(
                &client,
                Method::POST,
                &url,
                &[("authorization", auth), ("idempotency-key", key)],
                chat_request(),
            )
            .await
        }
    };
    assert_eq!(post("Bearer a", "k1").await.status, 200);
    post("Bearer b", "k2")
        .await
        .assert_problem(401, "unknown-client");
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&allow)
        .unwrap();
    writeln!(file, "{}", idemgate::intent::digest(b"Bearer b")).unwrap();
    drop(file);
    let status = std::process::Command::new("kill")
        .arg("-HUP")
        .arg(gateway.child.id().to_string())
        .status()
        .unwrap();
    assert!(status.success());
    // A signal has no answer to await: ask again, bounded, until the new list is in force.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let reply = post("Bearer b", "k3").await;
        if reply.status == 200 {
            break;
        }
        reply.assert_problem(401, "unknown-client");
        assert!(
            Instant::now() < deadline,
            "SIGHUP never re-read the allow file"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(received(&provider).await, 2);
}

/// Given one core (a pinned process, a container with one CPU), the gateway runs one thread:
/// the scheduler on it serves concurrent duplicates with one provider call and stops cleanly
/// on SIGTERM with a request in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_given_one_core_runs_one_thread_and_keeps_its_laws() {
    let mut provider = HeldProvider::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, port, admin) = process_config(dir.path(), &provider.url(), "").await;
    let mut gateway = spawn_gateway_on_one_core(&config, port, admin).await;
    let pid = gateway.child.id();
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .count();
    assert_eq!(threads, 1, "one core, one thread");

    let duplicates: Vec<_> = (0..3)
        .map(|_| {
            let url = format!("{}{CHAT}", gateway.base);
            tokio::spawn(async move {
                send(
                    &client(),
                    Method::POST,
                    &url,
                    &[
                        ("authorization", "Bearer a"),
                        ("idempotency-key", "one-core"),
                    ],
                    chat_request(),
                )
                .await
            })
        })
        .collect();
    provider
        .next_call()
        .await
        .answer(200, fixture("openai-chat-completion.json"));
    let mut ids = Vec::new();
    for duplicate in duplicates {
        let reply = bounded("a duplicate's answer", duplicate).await.unwrap();
        assert_eq!(reply.status, 200);
        ids.push(reply.job_id());
    }
    ids.dedup();
    assert_eq!(ids.len(), 1, "one job id: {ids:?}");
    assert_eq!(provider.calls(), 1);

    // SIGTERM with a request held at the provider: the gateway waits for it, then exits 0.
    let url = format!("{}{CHAT}", gateway.base);
    let in_flight = tokio::spawn(async move {
        send(
            &client(),
            Method::POST,
            &url,
            &[
                ("authorization", "Bearer a"),
                ("idempotency-key", "in-flight"),
            ],
            chat_request(),
        )
        .await
    });
    let held = provider.next_call().await;
    let status = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .unwrap();
    assert!(status.success());
    held.answer(200, fixture("openai-chat-completion.json"));
    assert_eq!(
        bounded("the held answer", in_flight).await.unwrap().status,
        200
    );
    let exited = bounded("the gateway's exit", async {
        loop {
            if let Some(status) = gateway.child.try_wait().unwrap() {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(exited.success(), "{exited}");
    assert_eq!(provider.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_credentials_never_reach_a_provider_that_has_its_own() {
    let mut own = HeldProvider::start().await;
    let mut byok = HeldProvider::start().await;
    let config = format!(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"own\"\nbase_url = \"{}\"\nheaders = {{ X-Api-Key = \"sk-provider\" }}\n\
         [[providers]]\nname = \"byok\"\nbase_url = \"{}\"\nforward_client_credentials = true\n\
         [[routes]]\nname = \"own\"\npath_prefix = \"/own\"\nproviders = [\"own\"]\n\
         [[routes]]\nname = \"byok\"\npath_prefix = \"/byok\"\nproviders = [\"byok\"]\n",
        own.url(),
        byok.url()
    );
    let gw = Arc::new(TestGateway::start(&config).await);
    let headers = [
        ("authorization", "Bearer sk-client"),
        ("x-api-key", "sk-client"),
        ("api-key", "sk-client"),
        ("proxy-authorization", "Basic eA=="),
        ("x-request-id", "req-from-client"),
    ];
    let request = |path: &'static str| {
        let gw = gw.clone();
        let mut headers = headers.to_vec();
        headers.push(("idempotency-key", path));
        tokio::spawn(async move {
            gw.request(Method::POST, path, &headers, chat_request())
                .await
        })
    };
    let mut reply = request("/own");
    let call = tokio::select! {
        call = own.next_call() => call,
        answered = &mut reply => panic!("answered without a provider call: {:?}", answered.unwrap()),
    };
    assert!(
        call.headers.get("authorization").is_none(),
        "{:?}",
        call.headers
    );
    assert!(call.headers.get("api-key").is_none());
    assert!(call.headers.get("proxy-authorization").is_none());
    assert_eq!(call.headers["x-api-key"], "sk-provider");
    assert_eq!(call.headers["x-request-id"], "req-from-client");
    call.answer(200, fixture("openai-chat-completion.json"));
    let reply = reply.await.unwrap();
    assert_eq!(reply.header("x-request-id"), Some("req-from-client"));

    let reply = request("/byok");
    let call = byok.next_call().await;
    assert_eq!(call.headers["authorization"], "Bearer sk-client");
    assert_eq!(call.headers["x-api-key"], "sk-client");
    call.answer(200, fixture("openai-chat-completion.json"));
    assert_eq!(reply.await.unwrap().status, 200);
}

/// A transport whose first provider panics in the middle of a request, for the panic test;
/// the second answers.
#[derive(Debug)]
struct Panicking {
    answered: AtomicUsize,
}

impl Transport for Panicking {
    fn send(&self, index: usize, _request: Request<Body>) -> Exchange {
        assert!(index != 0, "a provider answer that trips a bug");
        self.answered.fetch_add(1, Ordering::SeqCst);
        Box::pin(async {
            let mut response = Response::new(body::full(fixture("openai-chat-completion.json")));
            response
                .headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok(response)
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_is_one_request_s_500_and_the_gateway_serves_on() {
    let config = TestGateway::config(
        "[store]\nkind = \"memory\"\n\
         [[providers]]\nname = \"buggy\"\nbase_url = \"http://buggy\"\n\
         [[providers]]\nname = \"fine\"\nbase_url = \"http://fine\"\n\
         [[routes]]\nname = \"buggy\"\npath_prefix = \"/buggy\"\nproviders = [\"buggy\"]\nidempotency = \"off\"\n\
         [[routes]]\nname = \"fine\"\npath_prefix = \"/\"\nproviders = [\"fine\"]\n",
    );
    let store = Arc::new(idemgate::store::memory::MemoryStore::new(
        idemgate::Engine::expiry_policy(&config),
    ));
    let transport = Arc::new(Panicking {
        answered: AtomicUsize::new(0),
    });
    let gw =
        TestGateway::start_with(config, store, Upstream::with_transport(transport.clone())).await;
    let panicked = gw
        .request(
            Method::GET,
            "/buggy",
            &[("x-request-id", "req-boom")],
            Bytes::new(),
        )
        .await;
    panicked.assert_problem(500, "internal");
    let body = panicked.json();
    assert_eq!(body["request_id"], "req-boom");
    assert!(
        !body["detail"].as_str().unwrap().contains("trips a bug"),
        "{body}"
    );
    assert_eq!(panicked.header("x-request-id"), Some("req-boom"));
    let next = gw
        .post("/v1/chat/completions", Some("after"), chat_request())
        .await;
    assert_eq!(next.status, 200);
    assert_eq!(transport.answered.load(Ordering::SeqCst), 1);
    let metrics = gw.admin_get("/metrics").await;
    assert!(String::from_utf8_lossy(&metrics.body).contains("idemgate_panics_total 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_is_one_access_log_line_with_its_id() {
    let provider = answering_without_an_id().await;
    let dir = tempfile::tempdir().unwrap();
    let (config, port, admin) =
        process_config(dir.path(), &provider.uri(), "[log]\nformat = \"json\"").await;
    let log_path = dir.path().join("stderr.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let gateway = spawn_gateway_logging(&config, port, admin, "info", Stdio::from(log)).await;
    let client = client();
    let url = format!("{}/v1//chat/completions", gateway.base);
    let first = send(
        &client,
        Method::POST,
        &url,
        &[
            ("authorization", "Bearer a"),
            ("idempotency-key", "k"),
            ("x-request-id", "req-mine"),
        ],
        chat_request(),
    )
    .await;
    assert_eq!(first.header("x-request-id"), Some("req-mine"));
    let replay = send(
        &client,
        Method::POST,
        &url,
        &[("authorization", "Bearer a"), ("idempotency-key", "k")],
        chat_request(),
    )
    .await;
    let generated = replay
        .header("x-request-id")
        .expect("an id is made up")
        .to_owned();
    let refused = send(&client, Method::POST, &url, &[], chat_request()).await;
    refused.assert_problem(401, "missing-owner");
    assert_eq!(
        refused.json()["request_id"].as_str(),
        refused.header("x-request-id")
    );
    // A worker that has not slept since its last line keeps the next one until it runs out
    // of work (src/logsink.rs, tested there): on a loaded machine that can be just after the
    // answer, so the lines are waited for, a bounded while, before the gateway is killed.
    let access_lines = |text: &str| -> Vec<serde_json::Value> {
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|l| l["target"] == "idemgate::access")
            .collect()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while access_lines(&std::fs::read_to_string(&log_path).unwrap()).len() < 3
        && Instant::now() < deadline
    {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(gateway);
    let text = std::fs::read_to_string(&log_path).unwrap();
    let lines = access_lines(&text);
    assert_eq!(lines.len(), 3, "{text}");
    let fields = |i: usize| &lines[i]["fields"];
    for (i, line) in lines.iter().enumerate() {
        for name in [
            "method",
            "path",
            "route",
            "status",
            "duration_ms",
            "outcome",
            "job_id",
            "attempt",
            "provider",
            "replayed",
            "request_id",
        ] {
            assert!(
                !line["fields"][name].is_null(),
                "line {i} lacks {name}: {}",
                line
            );
        }
        assert_eq!(line["fields"]["path"], CHAT, "the normalised path");
        let duration = line["fields"]["duration_ms"].to_string();
        assert!(
            duration.split('.').nth(1).is_none_or(|d| d.len() <= 3),
            "milliseconds to the microsecond: {duration}"
        );
    }
    assert_eq!(fields(0)["request_id"], "req-mine");
    assert_eq!(fields(0)["outcome"], "new");
    assert_eq!(fields(0)["status"], 200);
    assert_eq!(fields(0)["route"], "chat");
    assert_eq!(fields(0)["provider"], "primary");
    assert_eq!(fields(1)["outcome"], "replayed");
    assert_eq!(fields(1)["request_id"], generated.as_str());
    assert_eq!(fields(1)["job_id"], fields(0)["job_id"]);
    assert_eq!(fields(2)["status"], 401);
}

/// Huge pages zeroed 2 MB at a time at first touch stalled every request while the memory
/// store grew (main.rs); the process runs with them off.
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_process_runs_without_transparent_huge_pages() {
    let provider = answering(completion()).await;
    let (gateway, _dir) = gateway_process(&provider.uri(), "").await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", gateway.child.id())).unwrap();
    let thp = status
        .lines()
        .find_map(|line| line.strip_prefix("THP_enabled:"))
        .expect("the kernel reports THP_enabled")
        .trim();
    assert_eq!(thp, "0", "{status}");
}

/// Lines a busy worker holds are written once it runs out of work, without a stop to flush
/// them: many requests at once, on the default log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_log_lines_are_written_once_the_gateway_runs_out_of_work() {
    const REQUESTS: usize = 16;
    let provider = answering(completion()).await;
    let dir = tempfile::tempdir().unwrap();
    let (config, port, admin) = process_config(dir.path(), &provider.uri(), "").await;
    let mut gateway = spawn_gateway_logging(&config, port, admin, "info", Stdio::piped()).await;
    let stderr = gateway.child.stderr.take().unwrap();
    let (lines, mut logged) = tokio::sync::mpsc::unbounded_channel();
    std::thread::spawn(move || {
        use std::io::BufRead as _;
        for line in std::io::BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if lines.send(line).is_err() {
                break;
            }
        }
    });
    let client = client();
    let mut sends = tokio::task::JoinSet::new();
    for n in 0..REQUESTS {
        let client = client.clone();
        let url = format!("{}{CHAT}", gateway.base);
        sends.spawn(async move {
            let key = format!("k{n}");
            let id = format!("req-held-{n}");
            let sent = send(
                &client,
                Method::POST,
                &url,
                &[
                    ("authorization", "Bearer a"),
                    ("idempotency-key", key.as_str()),
                    ("x-request-id", id.as_str()),
                ],
                chat_request(),
            )
            .await;
            assert_eq!(sent.status, 200);
        });
    }
    while let Some(sent) = sends.join_next().await {
        sent.unwrap();
    }
    // Nothing else happens: every worker runs out of work and writes what it holds.
    let mut seen = std::collections::HashSet::new();
    tokio::time::timeout(PATIENCE, async {
        while seen.len() < REQUESTS {
            let line = logged
                .recv()
                .await
                .expect("the gateway's stderr stays open");
            if let Some(at) = line.find("request_id=req-held-") {
                assert!(line.contains("outcome=new"), "{line}");
                seen.insert(line[at..].to_owned());
            }
        }
    })
    .await
    .unwrap_or_else(|_| {
        panic!(
            "{} of {REQUESTS} lines written while the gateway runs",
            seen.len()
        )
    });
}

/// The access line is written without `tracing`, but the log's filter still decides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_filter_can_turn_the_access_lines_off() {
    let provider = answering(completion()).await;
    let dir = tempfile::tempdir().unwrap();
    for (filter, access_lines) in [("info", 1), ("info,idemgate::access=off", 0), ("warn", 0)] {
        let (config, port, admin) = process_config(dir.path(), &provider.uri(), "").await;
        let log_path = dir.path().join("stderr.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let gateway = spawn_gateway_logging(&config, port, admin, filter, Stdio::from(log)).await;
        let sent = send(
            &client(),
            Method::POST,
            &format!("{}{CHAT}", gateway.base),
            &[("authorization", "Bearer a"), ("idempotency-key", filter)],
            chat_request(),
        )
        .await;
        assert_eq!(sent.status, 200);
        drop(gateway);
        let text = std::fs::read_to_string(&log_path).unwrap();
        let written = text
            .lines()
            .filter(|l| l.contains("idemgate::access: request"))
            .count();
        assert_eq!(written, access_lines, "IDEMGATE_LOG={filter}: {text}");
        assert_eq!(
            text.contains("idemgate listening"),
            filter.starts_with("info"),
            "the rest of the log as the filter says: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_redis_fails_requests_closed_within_op_timeout() {
    let redis = common::redis_server::RedisServer::start().await;
    let provider = answering(completion()).await;
    let config = format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\nop_timeout = \"1s\"\n{}",
        redis.url(),
        edge_config(&provider.uri(), "").replace("[store]\nkind = \"memory\"\n", "")
    );
    let config = TestGateway::config(&config);
    let store = idemgate::store::open(&config.store, idemgate::Engine::expiry_policy(&config))
        .await
        .unwrap();
    let gw = TestGateway::start_with(config.clone(), store, Upstream::new(&config.providers)).await;
    assert_eq!(
        gw.post(CHAT, Some("before"), chat_request()).await.status,
        200
    );
    redis.signal("STOP");
    let sent = Instant::now();
    let frozen = gw.post(CHAT, Some("frozen"), chat_request()).await;
    let took = sent.elapsed();
    redis.signal("CONT");
    frozen.assert_problem(503, "store-unavailable");
    assert!(frozen.header("retry-after").is_some());
    assert!(took < Duration::from_millis(1500), "503 after {took:?}");
    assert_eq!(
        received(&provider).await,
        1,
        "no provider call without a claim"
    );
    let deadline = Instant::now() + PATIENCE;
    loop {
        let reply = gw.post(CHAT, Some("after"), chat_request()).await;
        if reply.status == 200 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "traffic never resumed: {reply:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A gateway process on `server_keys`, for what only a process shows: its descriptors and
/// its memory.
async fn gateway_process(provider: &str, server_keys: &str) -> (Process, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let (config, port, admin) = process_config(dir.path(), provider, server_keys).await;
    (spawn_gateway(&config, port, admin).await, dir)
}

/// A config file in `dir` for the gateway binary on two free ports (client, admin):
/// `server_keys` (more `[server]` keys, or other tables) follow its `[server]` lines.
async fn process_config(
    dir: &std::path::Path,
    provider: &str,
    server_keys: &str,
) -> (std::path::PathBuf, u16, u16) {
    let (port, admin) = (free_port().await, free_port().await);
    let config = dir.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nadmin_token_env = \"{ADMIN_TOKEN_ENV}\"\n{}",
            edge_config(provider, server_keys)
        ),
    )
    .unwrap();
    (config, port, admin)
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_clients_wait_and_the_descriptors_stay_bounded() {
    let _turn = HEAVY.lock().await;
    let (provider, _calls) = completing_provider().await;
    let (gateway, _dir) = gateway_process(
        &provider,
        "max_connections = 50\nrequest_header_timeout = \"1s\"",
    )
    .await;
    let pid = gateway.child.id();
    let baseline = open_fds(pid);
    let addr = addr_of(&gateway.base);
    let mut idle = Vec::new();
    for _ in 0..200 {
        idle.push(TcpStream::connect(&addr).await.unwrap());
    }
    // The accepted ones time out a second later, the next ones are accepted, and so on:
    // a normal client gets its turn.
    let client = client();
    let served = send(
        &client,
        Method::POST,
        &format!("{}{CHAT}", gateway.base),
        &[("authorization", "Bearer a"), ("idempotency-key", "k")],
        chat_request(),
    )
    .await;
    assert_eq!(served.status, 200);
    let peak = open_fds(pid);
    eprintln!(
        "max_connections = 50, 200 idle clients: {peak} descriptors open (baseline {baseline})"
    );
    assert!(
        peak <= baseline + 50 + 10,
        "{peak} descriptors open with max_connections = 50 (baseline {baseline})"
    );
    drop(idle);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_are_held_only_up_to_the_body_budget() {
    let _turn = HEAVY.lock().await;
    let (provider, calls) = completing_provider().await;
    let (gateway, _dir) = gateway_process(
        &provider,
        "max_buffered_body_bytes = 67108864\nrequest_body_timeout = \"30s\"",
    )
    .await;
    let pid = gateway.child.id();
    let baseline = rss_bytes(pid);
    let addr = addr_of(&gateway.base);
    const NINE_MIB: usize = 9 * 1024 * 1024;
    let chunk = Arc::new(vec![b' '; NINE_MIB]);
    let mut clients = Vec::new();
    for i in 0..100 {
        let (addr, chunk) = (addr.clone(), chunk.clone());
        clients.push(tokio::spawn(async move {
            let mut stream = TcpStream::connect(&addr).await.unwrap();
            let head = format!(
                "POST {CHAT} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer a\r\nIdempotency-Key: big-{i}\r\nContent-Length: {}\r\n\r\n",
                NINE_MIB + 1024
            );
            stream.write_all(head.as_bytes()).await.unwrap();
            // Most of the body, then silence; a refused client stops sending.
            let (mut reader, mut writer) = stream.into_split();
            let sending = tokio::spawn(async move {
                let _ = writer.write_all(&chunk).await;
                writer
            });
            let mut buf = vec![0u8; 1024];
            let status = match tokio::time::timeout(Duration::from_secs(4), reader.read(&mut buf)).await {
                Ok(Ok(n)) if n > 12 => String::from_utf8_lossy(&buf[9..12]).into_owned(),
                _ => "held".to_owned(),
            };
            (status, sending, reader)
        }));
    }
    let mut held = Vec::new();
    let mut overloaded = 0;
    for task in clients {
        let (status, sending, reader) = task.await.unwrap();
        match status.as_str() {
            "503" => overloaded += 1,
            "held" => {}
            other => panic!("unexpected status {other}"),
        }
        held.push((sending, reader));
    }
    let rss = rss_bytes(pid);
    assert!(overloaded >= 90, "{overloaded} of 100 were refused");
    assert!(
        rss < baseline + 160 * 1024 * 1024,
        "RSS grew from {} MiB to {} MiB",
        baseline >> 20,
        rss >> 20
    );
    eprintln!(
        "body budget: {overloaded} of 100 stalled 9 MiB bodies refused; RSS {} MiB -> {} MiB",
        baseline >> 20,
        rss >> 20
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    drop(held);
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|v| v.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overflowed_stream_whose_client_left_holds_no_memory() {
    use http_body_util::StreamBody;
    // A provider that streams 64 KiB events, 5 ms apart, 800 of them (50 MiB): far past
    // max_stored_response_bytes, and still going long after the client hangs up.
    let sent = Arc::new(AtomicUsize::new(0));
    let counter = sent.clone();
    let (addr, _) = serve_provider(move |_request| {
        let counter = counter.clone();
        async move {
            let event = Bytes::from(format!("data: {}\n\n", "x".repeat(64 * 1024 - 8)));
            let frames = futures_util::stream::unfold(0usize, move |i| {
                let (event, counter) = (event.clone(), counter.clone());
                async move {
                    if i == 800 {
                        return None;
                    }
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    counter.fetch_add(1, Ordering::SeqCst);
                    Some((
                        Ok::<_, std::io::Error>(http_body::Frame::data(event)),
                        i + 1,
                    ))
                }
            });
            let mut response = hyper::Response::new(StreamBody::new(frames));
            response
                .headers_mut()
                .insert("content-type", "text/event-stream".parse().unwrap());
            Ok(response)
        }
    })
    .await;
    let config = format!(
        "max_stored_response_bytes = 1048576\n{}",
        edge_config(&format!("http://{addr}"), "")
    );
    let gw = TestGateway::start(&config).await;
    let request = Request::post(format!("{}{CHAT}", gw.base))
        .header("authorization", "Bearer a")
        .header("idempotency-key", "stream")
        .body(http_body_util::Full::new(chat_request()))
        .unwrap();
    let response = bounded("the stream's head", client().request(request))
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.into_body();
    // Read past the limit, so the recording overflows, then hang up.
    let mut read = 0;
    while read < 2 * 1024 * 1024 {
        let frame = bounded("a chunk", http_body_util::BodyExt::frame(&mut body))
            .await
            .unwrap()
            .unwrap();
        read += frame.data_ref().map_or(0, Bytes::len);
    }
    drop(body);
    let hung_up_at = sent.load(Ordering::SeqCst);
    // The provider keeps streaming; the gateway keeps nothing of it.
    let deadline = Instant::now() + PATIENCE;
    loop {
        let text = String::from_utf8_lossy(&gw.admin_get("/metrics").await.body).into_owned();
        let held = metric(&text, "idemgate_stream_buffered_bytes");
        let streamed_since = sent.load(Ordering::SeqCst) - hung_up_at;
        if held < 256.0 * 1024.0 && streamed_since > 100 {
            eprintln!(
                "overflowed stream, client gone: {held} bytes held after {streamed_since} more chunks (6.4 MiB) streamed"
            );
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{held} bytes still held, {streamed_since} chunks since the hang-up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_scrape_reads_no_job_from_redis() {
    use idemgate::job::{ExpiryPolicy, JobRecord, Transition};
    let redis = common::redis_server::RedisServer::start().await;
    let provider = answering(completion()).await;
    let config = TestGateway::config(&format!(
        "[store]\nkind = \"redis\"\nurl = \"{}\"\n{}",
        redis.url(),
        edge_config(&provider.uri(), "").replace("[store]\nkind = \"memory\"\n", "")
    ));
    let policy = ExpiryPolicy {
        retention: Duration::from_secs(3600),
        late_result_window: Duration::from_secs(600),
    };
    let store = idemgate::store::open(&config.store, policy).await.unwrap();
    let now = idemgate::clock::now();
    for i in 0..1000 {
        let key = format!("k{i}");
        let id = idemgate::job::new_job_id("owner", &key);
        let record = JobRecord::new(
            id.clone(),
            "owner".into(),
            key,
            "fp".into(),
            "chat".into(),
            now,
            now,
            &policy,
        );
        store.claim(record, now).await.unwrap();
        store
            .apply(&id, Transition::MarkUnknown { version: 1 }, now)
            .await
            .unwrap();
    }
    let gw = TestGateway::start_with(config.clone(), store, Upstream::new(&config.providers)).await;
    let mut redis_cli = redis.connection().await;
    let calls = |info: String| -> u64 {
        info.lines()
            .filter(|l| l.starts_with("cmdstat_"))
            .filter_map(|l| l.split("calls=").nth(1))
            .filter_map(|v| v.split(',').next()?.parse::<u64>().ok())
            .sum()
    };
    let before: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut redis_cli)
        .await
        .unwrap();
    let scrape = gw.admin_get("/metrics").await;
    let after: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut redis_cli)
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&scrape.body);
    assert_eq!(metric(&text, "idemgate_jobs_unknown"), 1000.0);
    // The INFO call itself counts once.
    let commands = calls(after) - calls(before) - 1;
    assert!(
        commands <= 2,
        "one scrape sent {commands} commands to Redis"
    );
}
