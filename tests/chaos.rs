//! Chaos, bounded: two gateway processes sharing one store — a `redis-server`, or a
//! PostgreSQL server —, a client load of intents with deliberate duplicates sent to both,
//! and in the middle: the store killed (-9; PostgreSQL's immediate stop) and restarted, the
//! store frozen (SIGSTOP, every process of it) and thawed, one gateway killed (-9) and
//! restarted.
//! Afterwards, from the provider's own records and the store:
//!
//! 1. no job ever had two calls running at the provider at once;
//! 2. every call that reached the provider is an attempt the store recorded;
//! 3. every job is settled or `unknown` — none stuck `in_progress` past its lease;
//! 4. every successful answer a client got is its job's stored winner, byte for byte.
//!
//! `cargo test` runs a short version (about 20 s); `CHAOS_SCALE=5 cargo test --release
//! --test chaos -- --nocapture` runs five times the intents over a storm five times as long,
//! with five rounds of those faults (each killing the other gateway).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::pg_server::PgServer;
use common::redis_server::RedisServer;
use common::*;
use http::Request;
use hyper::body::Incoming;
use idemgate::job::JobState;
use tokio::time::Instant;

/// What the provider saw: per job id, calls running now, the most at once, calls in all.
#[derive(Default)]
struct Ledger {
    running: HashMap<String, usize>,
    most: HashMap<String, usize>,
    calls: HashMap<String, usize>,
    orphans: usize,
}

fn scale() -> usize {
    std::env::var("CHAOS_SCALE")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1)
}

/// A store server the storm can kill, restart, freeze and thaw.
trait Victim {
    /// The `[store]` lines of a gateway on it.
    fn lines(&self) -> String;
    async fn kill(&mut self);
    async fn restart(&mut self);
    fn freeze(&self);
    fn thaw(&self);
}

impl Victim for RedisServer {
    fn lines(&self) -> String {
        format!("kind = \"redis\"\nurl = \"{}\"", self.url())
    }
    async fn kill(&mut self) {
        self.stop();
    }
    async fn restart(&mut self) {
        RedisServer::restart(self).await;
    }
    fn freeze(&self) {
        self.signal("STOP");
    }
    fn thaw(&self) {
        self.signal("CONT");
    }
}

struct Postgres {
    server: PgServer,
    url: String,
}

impl Victim for Postgres {
    fn lines(&self) -> String {
        format!("kind = \"postgres\"\nurl = \"{}\"\npool_size = 8", self.url)
    }
    async fn kill(&mut self) {
        self.server.kill();
    }
    async fn restart(&mut self) {
        self.server.restart();
    }
    fn freeze(&self) {
        self.server.signal("STOP");
    }
    fn thaw(&self) {
        self.server.signal("CONT");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_survive_redis_and_gateway_kills_without_running_an_intent_twice() {
    storm("Redis", RedisServer::start_durable().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_gateways_survive_postgres_and_gateway_kills_without_running_an_intent_twice() {
    let server = PgServer::start();
    let url = server.database().await;
    storm("PostgreSQL", Postgres { server, url }).await;
}

async fn storm(name: &str, mut store: impl Victim) {
    let scale = scale();
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let (provider, _) = {
        let ledger = ledger.clone();
        serve_provider(move |request: Request<Incoming>| {
            let ledger = ledger.clone();
            async move {
                let job = request
                    .headers()
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                let pause = Duration::from_millis(fastrand::u64(20..300));
                let n = {
                    let mut l = ledger.lock().unwrap();
                    match &job {
                        Some(job) => {
                            let running = l.running.entry(job.clone()).or_default();
                            *running += 1;
                            let now = *running;
                            let most = l.most.entry(job.clone()).or_default();
                            *most = (*most).max(now);
                            let calls = l.calls.entry(job.clone()).or_default();
                            *calls += 1;
                            *calls
                        }
                        None => {
                            l.orphans += 1;
                            0
                        }
                    }
                };
                tokio::time::sleep(pause).await;
                if let Some(job) = &job {
                    *ledger.lock().unwrap().running.get_mut(job).unwrap() -= 1;
                }
                let body = format!(
                    "{{\"choices\":[{{\"message\":{{\"content\":\"{job:?} call {n}\"}}}}]}}"
                );
                let mut response =
                    hyper::Response::new(http_body_util::Full::new(Bytes::from(body)));
                response
                    .headers_mut()
                    .insert("content-type", "application/json".parse().unwrap());
                Ok(response)
            }
        })
        .await
    };
    let dir = tempfile::tempdir().unwrap();
    let store_lines = store.lines();
    let config = |port: u16, admin: u16| {
        format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\nadmin_listen = \"127.0.0.1:{admin}\"\nadmin_token_env = \"{ADMIN_TOKEN_ENV}\"\nshutdown_grace = \"1s\"\n\
             [store]\n{}\nop_timeout = \"1s\"\n\
             [idempotency]\nlease = \"1s\"\nwait_for_in_flight = \"3s\"\nlate_result_window = \"5s\"\n\
             [[providers]]\nname = \"primary\"\nbase_url = \"http://{provider}\"\ntimeout = \"2s\"\n\
             [[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [\"primary\"]\n",
            store_lines
        )
    };
    let mut gateways = Vec::new();
    for name in ["a", "b"] {
        let (port, admin) = (free_port().await, free_port().await);
        let file = dir.path().join(format!("{name}.toml"));
        std::fs::write(&file, config(port, admin)).unwrap();
        gateways.push((file, port, admin));
    }
    let mut processes = Vec::new();
    for (file, port, admin) in &gateways {
        processes.push(spawn_gateway(file, *port, *admin).await);
    }
    let bases: Vec<String> = gateways
        .iter()
        .map(|(_, port, _)| format!("http://127.0.0.1:{port}"))
        .collect();

    // The clients: intents, each sent as 1–3 duplicates at once to either gateway, then
    // retried (same key) until it gets a final answer or the storm is over.
    let intents = 60 * scale;
    let storm = Duration::from_secs(8 * scale as u64);
    let started = Instant::now();
    let seen: Arc<Mutex<Vec<(String, Bytes)>>> = Arc::default();
    let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = Vec::new();
    for intent in 0..intents {
        let (bases, seen, requests) = (bases.clone(), seen.clone(), requests.clone());
        clients.push(tokio::spawn(async move {
            let client = client();
            let key = format!("intent-{intent}");
            tokio::time::sleep(storm.mul_f64(fastrand::f64() * 0.8)).await;
            for _round in 0..6 {
                let copies = fastrand::usize(1..4);
                let mut sent = Vec::new();
                for _ in 0..copies {
                    let (client, key) = (client.clone(), key.clone());
                    let url = format!("{}/v1/chat/completions", bases[fastrand::usize(0..2)]);
                    requests.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    sent.push(tokio::spawn(async move {
                        let request = Request::post(url)
                            .header("authorization", "Bearer sk-chaos")
                            .header("idempotency-key", key)
                            .body(http_body_util::Full::new(Bytes::from_static(
                                b"{\"prompt\":1}",
                            )))
                            .unwrap();
                        let response =
                            tokio::time::timeout(Duration::from_secs(10), client.request(request))
                                .await;
                        let Ok(Ok(response)) = response else {
                            return None;
                        };
                        let status = response.status().as_u16();
                        let job = response
                            .headers()
                            .get("x-idempotency-job-id")
                            .and_then(|v| v.to_str().ok())
                            .map(str::to_owned);
                        let body = http_body_util::BodyExt::collect(response.into_body())
                            .await
                            .ok()?
                            .to_bytes();
                        Some((status, job, body))
                    }));
                }
                let mut done = false;
                for reply in sent {
                    if let Ok(Some((status, job, body))) = reply.await {
                        if status == 200 {
                            if let Some(job) = job {
                                seen.lock().unwrap().push((job, body));
                            }
                            done = true;
                        } else if status == 409 || status == 502 || status == 504 {
                            // Decided (or unknown): retrying the same key cannot change it.
                            done = status != 409 || done;
                        }
                    }
                }
                if done {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
        }));
    }

    // The storm: one round of faults per 8 s of it, so a longer storm has more of them
    // rather than the same ones further apart; each round kills the other gateway.
    let rounds = scale;
    let step = Duration::from_secs(1);
    for round in 0..rounds {
        tokio::time::sleep(step).await;
        store.kill().await;
        tokio::time::sleep(step / 2).await;
        store.restart().await;
        tokio::time::sleep(step).await;
        store.freeze();
        tokio::time::sleep(step / 2).await;
        store.thaw();
        tokio::time::sleep(step).await;
        let victim = round % 2;
        processes[victim].child.kill().unwrap(); // kill -9
        processes[victim].child.wait().unwrap();
        tokio::time::sleep(step / 2).await;
        let (file, port, admin) = &gateways[victim];
        processes[victim] = spawn_gateway(file, *port, *admin).await;
        if round + 1 < rounds {
            tokio::time::sleep(step * 7 / 2).await;
        }
    }
    for client in clients {
        bounded_by(Duration::from_secs(120), client).await;
    }
    // Let leases lapse and the sweep and late answers land.
    tokio::time::sleep(Duration::from_secs(4)).await;

    // The checks, from the store itself.
    let store = idemgate::store::open(
        &idemgate::Config::parse(&config(1, 2), "chaos")
            .unwrap()
            .store,
        idemgate::job::ExpiryPolicy {
            retention: Duration::from_secs(86400),
            late_result_window: Duration::from_secs(5),
        },
    )
    .await
    .unwrap();
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    assert_eq!(ledger.orphans, 0, "every provider call carries its job id");
    let mut states: HashMap<&'static str, usize> = HashMap::new();
    let mut attempts_recorded = 0;
    for (job, calls) in &ledger.calls {
        assert_eq!(ledger.most[job], 1, "job {job}: two calls ran at once");
        let record =
            store.get(job).await.unwrap().unwrap_or_else(|| {
                panic!("job {job} reached the provider but is not in the store")
            });
        assert!(
            record.attempts.len() >= *calls,
            "job {job}: {calls} provider calls, {} attempts recorded",
            record.attempts.len()
        );
        attempts_recorded += record.attempts.len();
        assert!(
            record.job.state != JobState::InProgress,
            "job {job} is stuck in_progress: {record:?}"
        );
        *states.entry(record.job.state.as_str()).or_default() += 1;
    }
    let seen = seen.lock().unwrap().clone();
    for (job, body) in &seen {
        let record = store
            .get(job)
            .await
            .unwrap()
            .expect("an answered job is stored");
        if let Some(stored) = &record.job.response {
            assert_eq!(
                &stored.body, body,
                "job {job}: an answer that is not the stored winner"
            );
        }
    }
    let calls: usize = ledger.calls.values().sum();
    eprintln!(
        "chaos on {name}: {intents} intents, {} requests ({} duplicates and retries), {rounds} store kill -9, {rounds} store SIGSTOP, {rounds} gateway kill -9; \
         {} jobs reached the provider: {states:?}; {calls} provider calls, {attempts_recorded} attempts recorded; {} answers checked; {:.1?}",
        requests.load(std::sync::atomic::Ordering::Relaxed),
        requests.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(intents),
        ledger.calls.len(),
        seen.len(),
        started.elapsed()
    );
    drop(processes);
}

async fn bounded_by<T>(limit: Duration, task: tokio::task::JoinHandle<T>) -> T {
    tokio::time::timeout(limit, task)
        .await
        .expect("a client never finished")
        .unwrap()
}
