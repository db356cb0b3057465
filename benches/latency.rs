//! Added latency of the gateway: a new-job request and a replay, each against a direct call
//! to the same local provider, measured in one run so the ratios compare like with like.
//!
//!     cargo bench --bench latency
//!
//! The provider is a local hyper server answering the OpenAI completion fixture at once, so
//! the figures are the gateway's own cost (routing, fingerprint, claim, settle, copy) plus
//! one extra loopback hop.

// A bench times real processes on the real clock: paused time has no place here.
#![allow(clippy::disallowed_methods)]

mod support;

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use support::{provider, ANSWER, REQUEST};

const WARMUP: usize = 500;
/// Samples per kind, taken in interleaved rounds so drift on a shared machine hits every
/// kind alike.
const SAMPLES: usize = 6000;
const ROUNDS: usize = 12;

struct Stats {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

fn stats(mut samples: Vec<Duration>) -> Stats {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    Stats {
        p50: samples[samples.len() / 2],
        p99: samples[samples.len() * 99 / 100],
        mean,
    }
}

async fn measure(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    url: &str,
    count: usize,
    key: impl Fn(usize) -> Option<String>,
) -> Vec<Duration> {
    let mut samples = Vec::with_capacity(count);
    for i in 0..count {
        let mut request = Request::post(url)
            .header("authorization", "Bearer sk-bench")
            .header("content-type", "application/json");
        if let Some(key) = key(i) {
            request = request.header("idempotency-key", key);
        }
        let request = request
            .body(Full::new(Bytes::from_static(REQUEST)))
            .unwrap();
        let started = Instant::now();
        let response = client.request(request).await.unwrap();
        assert_eq!(response.status(), 200);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        samples.push(started.elapsed());
        assert_eq!(body.len(), ANSWER.len());
    }
    samples
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

        let new_keys = std::sync::atomic::AtomicUsize::new(0);
        let next_key = |_| {
            let n = new_keys.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            Some(format!("bench-new-{n}"))
        };
        let replay_key = |_| Some("bench-replay".to_owned());
        let _ = measure(&client, &direct_url, WARMUP, |_| None).await;
        let _ = measure(&client, &gateway, WARMUP, next_key).await;
        let _ = measure(&client, &gateway, WARMUP, replay_key).await;
        let (mut direct, mut new_job, mut replay) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..ROUNDS {
            direct.extend(measure(&client, &direct_url, SAMPLES / ROUNDS, |_| None).await);
            new_job.extend(measure(&client, &gateway, SAMPLES / ROUNDS, next_key).await);
            replay.extend(measure(&client, &gateway, SAMPLES / ROUNDS, replay_key).await);
        }
        let (direct, new_job, replay) = (stats(direct), stats(new_job), stats(replay));

        println!(
            "latency over {SAMPLES} sequential requests per kind in {ROUNDS} interleaved rounds, memory store"
        );
        println!(
            "{:<10} {:>10} {:>10} {:>10} {:>12}",
            "", "p50", "p99", "mean", "p50 ratio"
        );
        for (name, s) in [
            ("direct", &direct),
            ("new job", &new_job),
            ("replay", &replay),
        ] {
            println!(
                "{name:<10} {:>10.1?} {:>10.1?} {:>10.1?} {:>11.2}x",
                s.p50,
                s.p99,
                s.mean,
                s.p50.as_secs_f64() / direct.p50.as_secs_f64()
            );
        }
        running.shutdown().await;
    });
}
