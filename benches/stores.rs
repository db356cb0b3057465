//! New-job throughput and latency through the whole gateway, per store, at concurrency 1 and
//! 32, in one run so the ratios compare like with like.
//!
//!     cargo bench --bench stores
//!
//! Every request is a new job (a fresh key) answered at once by a local provider, so the
//! store's claim and settle are the part that differs between rows. The Redis row runs
//! against a `redis-server` this bench starts on a free port (skipped when none is
//! installed), the PostgreSQL row against a server it makes with `initdb` (fsync on);
//! replays are measured too, since on Redis and PostgreSQL they are one round trip.

// A bench times real processes on the real clock: paused time has no place here.
#![allow(clippy::disallowed_methods)]

#[path = "../tests/common/pg_server.rs"]
#[allow(dead_code, unreachable_pub)]
mod pg_server;
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idemgate::job::ExpiryPolicy;
use idemgate::store::JobStore;
use support::{provider, REQUEST};
use tokio::net::TcpListener;

const REQUESTS: usize = 4000;
/// Each row's requests are split over this many rounds, the stores taking turns, so drift
/// on a shared machine hits every store alike.
const ROUNDS: usize = 4;

struct Row {
    throughput: f64,
    p50: Duration,
    p99: Duration,
}

/// Sends `count` requests with fresh keys `{tag}-{i}` from `concurrency` workers; returns
/// every latency and the wall time.
async fn run(url: &str, concurrency: usize, tag: &str, count: usize) -> (Vec<Duration>, Duration) {
    let client: Client<HttpConnector, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(concurrency)
        .build_http();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..concurrency {
        let client = client.clone();
        let next = next.clone();
        let url = url.to_owned();
        let tag = tag.to_owned();
        workers.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= count {
                    return samples;
                }
                let request = Request::post(&url)
                    .header("authorization", "Bearer sk-bench")
                    .header("idempotency-key", format!("{tag}-{i}"))
                    .body(Full::new(Bytes::from_static(REQUEST)))
                    .unwrap();
                let t = Instant::now();
                let response = client.request(request).await.unwrap();
                assert_eq!(response.status(), 200);
                let _ = response.into_body().collect().await.unwrap();
                samples.push(t.elapsed());
            }
        }));
    }
    let mut samples = Vec::new();
    for w in workers {
        samples.extend(w.await.unwrap());
    }
    (samples, started.elapsed())
}

/// One store's samples at one concurrency, summed over the rounds.
#[derive(Default)]
struct Acc {
    new: Vec<Duration>,
    new_elapsed: Duration,
    replay: Vec<Duration>,
    replay_elapsed: Duration,
    commits: u64,
}

fn row(mut samples: Vec<Duration>, elapsed: Duration) -> Row {
    samples.sort();
    Row {
        throughput: samples.len() as f64 / elapsed.as_secs_f64(),
        p50: samples[samples.len() / 2],
        p99: samples[samples.len() * 99 / 100],
    }
}

fn main() {
    let runtime = support::runtime();
    runtime.block_on(async {
        let upstream = provider().await;
        let config = support::config(&upstream, "");
        let config = Arc::new(config);
        let policy = ExpiryPolicy {
            retention: Duration::from_secs(3600),
            late_result_window: Duration::from_secs(600),
        };
        let dir = tempfile::tempdir().unwrap();
        let embedded = Arc::new(
            idemgate::store::embedded::EmbeddedStore::open(&dir.path().join("bench.db"), policy)
                .unwrap(),
        );
        let mut stores: Vec<(&str, Arc<dyn JobStore>)> = vec![
            (
                "memory",
                Arc::new(idemgate::store::memory::MemoryStore::new(policy)),
            ),
            ("embedded", embedded.clone()),
        ];
        let redis_server = start_redis().await;
        if let Some((_, url)) = &redis_server {
            let config = idemgate::config::StoreConfig {
                kind: idemgate::config::StoreKind::Redis,
                path: Default::default(),
                urls: vec![url.clone()],
                cluster: false,
                key_prefix: "bench".into(),
                pool_size: None,
                wait_replicas: 0,
                op_timeout: std::time::Duration::from_secs(2),
            };
            let store = idemgate::store::redis::RedisStore::open(&config, policy)
                .await
                .unwrap();
            stores.push(("redis", Arc::new(store)));
        }
        // PostgreSQL from initdb, synced commits as in production; skipped when not installed.
        let pg_server = std::panic::catch_unwind(pg_server::PgServer::start_durable).ok();
        if let Some(server) = &pg_server {
            let config = pg_server::store_config(&server.database().await, 16);
            let store = idemgate::store::postgres::PostgresStore::open(&config, policy)
                .await
                .unwrap();
            stores.push(("postgres", Arc::new(store)));
        }
        let mut results = Vec::new();
        let mut replays: Vec<(&str, usize, Row)> = Vec::new();
        let mut gateways = Vec::new();
        for (name, store) in stores {
            let running = idemgate::start_with_store(config.clone(), store)
                .await
                .unwrap();
            let url = format!("http://{}/v1/chat/completions", running.addr);
            gateways.push((name, url, running));
        }
        let commits = || {
            embedded
                .commit_stats()
                .commits
                .load(std::sync::atomic::Ordering::Relaxed)
        };
        for concurrency in [1, 32] {
            for (name, url, _) in &gateways {
                let _ = run(
                    url,
                    concurrency,
                    &format!("warm-{name}-{concurrency}"),
                    REQUESTS / ROUNDS,
                )
                .await;
            }
            let mut acc: Vec<Acc> = gateways.iter().map(|_| Acc::default()).collect();
            for round in 0..ROUNDS {
                for ((name, url, _), acc) in gateways.iter().zip(&mut acc) {
                    let tag = format!("{name}-{concurrency}-{round}");
                    let before = commits();
                    let (samples, elapsed) = run(url, concurrency, &tag, REQUESTS / ROUNDS).await;
                    acc.commits += commits() - before;
                    acc.new.extend(samples);
                    acc.new_elapsed += elapsed;
                    // The same keys again: every request is a replay.
                    let (samples, elapsed) = run(url, concurrency, &tag, REQUESTS / ROUNDS).await;
                    acc.replay.extend(samples);
                    acc.replay_elapsed += elapsed;
                }
            }
            for ((name, _, _), acc) in gateways.iter().zip(acc) {
                results.push((
                    *name,
                    concurrency,
                    row(acc.new, acc.new_elapsed),
                    acc.commits,
                ));
                replays.push((*name, concurrency, row(acc.replay, acc.replay_elapsed)));
            }
        }
        for (_, _, running) in gateways {
            running.shutdown().await;
        }
        println!("new jobs through the gateway, {REQUESTS} requests per row");
        println!(
            "{:<10} {:>4} {:>10} {:>10} {:>10} {:>10} {:>14}",
            "store", "conc", "req/s", "p50", "p99", "vs memory", "ops/commit"
        );
        for (name, concurrency, row, commits) in &results {
            let memory = &results
                .iter()
                .find(|(n, c, ..)| *n == "memory" && c == concurrency)
                .unwrap()
                .2;
            let per_commit = if *name == "embedded" && *commits > 0 {
                format!("{:.1}", (2 * REQUESTS) as f64 / *commits as f64)
            } else {
                "-".into()
            };
            println!(
                "{name:<10} {concurrency:>4} {:>10.0} {:>10.1?} {:>10.1?} {:>9.2}x {:>14}",
                row.throughput,
                row.p50,
                row.p99,
                row.throughput / memory.throughput,
                per_commit,
            );
        }
        println!("\nreplays through the gateway, {REQUESTS} requests per row");
        println!(
            "{:<10} {:>4} {:>10} {:>10} {:>10} {:>10}",
            "store", "conc", "req/s", "p50", "p99", "vs memory"
        );
        for (name, concurrency, row) in &replays {
            let memory = &replays
                .iter()
                .find(|(n, c, _)| *n == "memory" && c == concurrency)
                .unwrap()
                .2;
            println!(
                "{name:<10} {concurrency:>4} {:>10.0} {:>10.1?} {:>10.1?} {:>9.2}x",
                row.throughput,
                row.p50,
                row.p99,
                row.throughput / memory.throughput,
            );
        }
        if let Some((mut child, _)) = redis_server {
            let _ = child.kill();
            let _ = child.wait();
        }
        drop(pg_server);
    });
}

/// A throw-away `redis-server` on a free port, if one is installed.
async fn start_redis() -> Option<(std::process::Child, String)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .await
        .ok()?
        .local_addr()
        .ok()?
        .port();
    let child = std::process::Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .ok()?;
    let url = format!("redis://127.0.0.1:{port}");
    let client = redis::Client::open(url.as_str()).ok()?;
    for _ in 0..200 {
        if client.get_multiplexed_async_connection().await.is_ok() {
            return Some((child, url));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}
