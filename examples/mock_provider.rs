//! A provider that answers every request at once with the OpenAI completion fixture: the
//! far end of `benches/overhead.sh`, so the figures measure the proxy and not the provider.
//!
//!     cargo run --release --example mock_provider -- 127.0.0.1:9000
//!
//! `ANSWER_BYTES=2048` pads the answer with trailing whitespace (still the same JSON) to
//! that size, for measuring what a stored job of a given size costs. `ANSWER_HEADERS=openai`
//! adds the headers OpenAI's API sends with a chat completion (rate limits, request id,
//! Cloudflare's cookies and ray), since a stored answer keeps every header it came with.
//! A request that asks to stream (`"stream": true`) is answered with the OpenAI stream
//! fixture as `text/event-stream`.

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

const ANSWER: &[u8] = include_bytes!("../tests/fixtures/openai-chat-completion.json");
const STREAM: &[u8] = include_bytes!("../tests/fixtures/openai-chat-stream.sse");

/// Whether a chat request's body asks for a stream, as OpenAI's SDKs write it (with or
/// without a space after the colon).
fn asks_to_stream(body: &[u8]) -> bool {
    [&b"\"stream\":true"[..], b"\"stream\": true"]
        .iter()
        .any(|needle| body.windows(needle.len()).any(|w| w == *needle))
}

/// Headers of a chat completion from `api.openai.com`, with made-up values of the real shapes.
const OPENAI_HEADERS: &[(&str, &str)] = &[
    ("access-control-expose-headers", "X-Request-ID"),
    ("openai-organization", "user-4x8kq2m9zv7w1n3b5c6d"),
    ("openai-processing-ms", "412"),
    ("openai-project", "proj_Q1w2E3r4T5y6U7i8O9p0AsDf"),
    ("openai-version", "2020-10-01"),
    ("x-ratelimit-limit-requests", "10000"),
    ("x-ratelimit-limit-tokens", "30000000"),
    ("x-ratelimit-remaining-requests", "9999"),
    ("x-ratelimit-remaining-tokens", "29999978"),
    ("x-ratelimit-reset-requests", "6ms"),
    ("x-ratelimit-reset-tokens", "0s"),
    ("x-request-id", "req_7b5f2e8c1a9d4e3f8b6c0a2d4e6f8a1b"),
    ("strict-transport-security", "max-age=31536000; includeSubDomains; preload"),
    ("cf-cache-status", "DYNAMIC"),
    (
        "set-cookie",
        "__cf_bm=Zx8.Yw7Vu6Ts5Rq4Po3Nm2Lk1Ji0Hg9Fe8Dc7Ba6-1764590400-1.0.1.1-QwErTyUiOpAsDfGhJkLzXcVbNm; path=/; expires=Mon, 01-Dec-26 12:30:00 GMT; domain=.api.openai.com; HttpOnly; Secure; SameSite=None",
    ),
    (
        "set-cookie",
        "_cfuvid=Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv1Wx2Yz3-1764590400123-0.0.1.1-604800000; path=/; domain=.api.openai.com; HttpOnly; Secure; SameSite=None",
    ),
    ("x-content-type-options", "nosniff"),
    ("server", "cloudflare"),
    ("cf-ray", "8f2a1b3c4d5e6f70-AMS"),
    ("alt-svc", "h3=\":443\"; ma=86400"),
];

fn main() {
    let answer = match std::env::var("ANSWER_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        Some(size) if size > ANSWER.len() => {
            let mut padded = ANSWER.to_vec();
            padded.resize(size, b' ');
            Bytes::from(padded)
        }
        _ => Bytes::from_static(ANSWER),
    };
    let extra: &[(&str, &str)] = match std::env::var("ANSWER_HEADERS").as_deref() {
        Ok("openai") => OPENAI_HEADERS,
        _ => &[],
    };
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:0".into());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let listener = TcpListener::bind(&addr).await.expect("bind");
        println!("{}", listener.local_addr().expect("address"));
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let answer = answer.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request: Request<Incoming>| {
                    let answer = answer.clone();
                    async move {
                        let body = match request.into_body().collect().await {
                            Ok(body) => body.to_bytes(),
                            Err(_) => Bytes::new(),
                        };
                        let (answer, kind) = if asks_to_stream(&body) {
                            (Bytes::from_static(STREAM), "text/event-stream")
                        } else {
                            (answer, "application/json")
                        };
                        let mut response = hyper::Response::new(Full::new(answer));
                        let headers = response.headers_mut();
                        headers.insert(
                            hyper::header::CONTENT_TYPE,
                            hyper::header::HeaderValue::from_static(kind),
                        );
                        for (name, value) in extra {
                            headers.append(*name, hyper::header::HeaderValue::from_static(value));
                        }
                        Ok::<_, Infallible>(response)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}
