//! Time to first byte of a streamed answer, through the gateway (a new job each time)
//! against a direct call to the same local provider, in interleaved rounds of one run.
//!
//!     cargo bench --bench ttfb
//!
//! The provider sends the first SSE event at once and the rest after 2 ms, so the first
//! byte is measured while the stream is still live, as a client sees it.

// A bench times real processes on the real clock: paused time has no place here.
#![allow(clippy::disallowed_methods)]

mod support;

use std::convert::Infallible;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body::Frame;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

const STREAM: &[u8] = include_bytes!("../tests/fixtures/openai-chat-stream.sse");
const SAMPLES: usize = 3000;
const ROUNDS: usize = 10;

async fn provider() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let _ = stream.set_nodelay(true);
            let service = service_fn(|request: Request<Incoming>| async move {
                let _ = request.into_body().collect().await;
                let text = std::str::from_utf8(STREAM).unwrap();
                let events: Vec<Bytes> = text
                    .split_inclusive("\n\n")
                    .map(|e| Bytes::from(e.to_owned()))
                    .collect();
                let body = StreamBody::new(futures_util::stream::unfold(
                    (events, 0),
                    |(events, i)| async move {
                        if i >= events.len() {
                            return None;
                        }
                        if i == 1 {
                            tokio::time::sleep(Duration::from_millis(2)).await;
                        }
                        Some((
                            Ok::<_, Infallible>(Frame::data(events[i].clone())),
                            (events, i + 1),
                        ))
                    },
                ));
                Ok::<_, Infallible>(
                    hyper::Response::builder()
                        .header("content-type", "text/event-stream")
                        .body(body)
                        .unwrap(),
                )
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

async fn ttfb(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    key: Option<String>,
) -> Duration {
    let mut request = Request::post(url).header("authorization", "Bearer sk-bench");
    if let Some(key) = key {
        request = request.header("idempotency-key", key);
    }
    let request = request
        .body(Full::new(Bytes::from_static(br#"{"stream":true}"#)))
        .unwrap();
    let started = Instant::now();
    let response = client.request(request).await.unwrap();
    let mut body = response.into_body();
    let first = body.frame().await.unwrap().unwrap();
    let elapsed = started.elapsed();
    assert!(!first.into_data().unwrap().is_empty());
    while body.frame().await.is_some() {}
    elapsed
}

fn percentile(samples: &mut [Duration], p: usize) -> Duration {
    samples.sort();
    samples[samples.len() * p / 100]
}

fn main() {
    let runtime = support::runtime();
    runtime.block_on(async {
        let upstream = provider().await;
        let config = support::config(&upstream, "[store]\nkind = \"memory\"");
        let running = idemgate::start(config).await.unwrap();
        let gateway = format!("http://{}/v1/chat/completions", running.addr);
        let direct_url = format!("{upstream}/v1/chat/completions");
        let client = Client::builder(TokioExecutor::new()).build_http();
        let mut key = 0usize;
        let (mut direct, mut through) = (Vec::new(), Vec::new());
        for round in 0..ROUNDS + 1 {
            for _ in 0..SAMPLES / ROUNDS {
                let d = ttfb(&client, &direct_url, None).await;
                key += 1;
                let g = ttfb(&client, &gateway, Some(format!("ttfb-{key}"))).await;
                // Round 0 warms up.
                if round > 0 {
                    direct.push(d);
                    through.push(g);
                }
            }
        }
        let (d50, g50) = (percentile(&mut direct, 50), percentile(&mut through, 50));
        let (d99, g99) = (percentile(&mut direct, 99), percentile(&mut through, 99));
        println!("time to first byte of a stream, {SAMPLES} samples each, interleaved");
        println!("{:<10} {:>10} {:>10} {:>10}", "", "p50", "p99", "p50 ratio");
        println!(
            "{:<10} {:>10.1?} {:>10.1?} {:>9.2}x",
            "direct", d50, d99, 1.0
        );
        println!(
            "{:<10} {:>10.1?} {:>10.1?} {:>9.2}x",
            "gateway",
            g50,
            g99,
            g50.as_secs_f64() / d50.as_secs_f64()
        );
        running.shutdown().await;
    });
}
