//! Test harness: gateways started in-process on port 0, providers that are real HTTP
//! servers (wiremock, or [`HeldProvider`] when a test must decide exactly when an answer
//! leaves), and a small HTTP client.

#![allow(dead_code, unreachable_pub)]

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};

pub mod mirror;
pub mod pg_server;
pub mod redis_server;
pub mod shared_stores;

pub const ADMIN_TOKEN: &str = "test-admin-token";
pub const ADMIN_TOKEN_ENV: &str = "IDEMGATE_TEST_ADMIN_TOKEN";

/// Every wait in a test is bounded by this.
pub const PATIENCE: Duration = Duration::from_secs(10);

pub fn fixture(name: &str) -> Bytes {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    Bytes::from(std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

pub fn chat_request() -> Bytes {
    fixture("openai-chat-request.json")
}

/// Runs `f` with the whole test bounded by [`PATIENCE`] times `factor`.
pub async fn bounded<T>(what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(PATIENCE, f)
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

/// A gateway running in-process.
pub struct TestGateway {
    pub running: idemgate::Running,
    pub base: String,
    pub admin: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// A response as a test sees it.
#[derive(Debug, Clone)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn job_id(&self) -> String {
        self.header("x-idempotency-job-id")
            .unwrap_or_else(|| panic!("no job id on {self:?}"))
            .to_owned()
    }

    /// Asserts a problem+json answer of this status and slug.
    pub fn assert_problem(&self, status: u16, slug: &str) {
        assert_eq!(self.status, status, "{self:?}");
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let body = self.json();
        assert_eq!(body["type"], format!("urn:idemgate:{slug}"), "{body}");
        assert_eq!(body["status"], status, "{body}");
        assert!(
            body["title"].is_string() && body["detail"].is_string(),
            "{body}"
        );
    }
}

/// Polls the admin API at `admin` until it lists exactly one job `unknown`, the one of
/// `key`, and that no later than `lease` + 10 s after `killed_at`; then checks the gauge.
/// For the gateways killed (-9) mid-attempt, whose orphans only a lease sweep can find.
pub async fn wait_orphan_listed_unknown(
    admin: &str,
    key: &str,
    lease: Duration,
    killed_at: tokio::time::Instant,
) {
    let client = client();
    let auth = format!("Bearer {ADMIN_TOKEN}");
    let deadline = killed_at + lease + Duration::from_secs(10);
    loop {
        let listed = send(
            &client,
            Method::GET,
            &format!("{admin}/jobs?state=unknown"),
            &[("authorization", &auth)],
            Bytes::new(),
        )
        .await
        .json();
        if listed["jobs"]
            .as_array()
            .is_some_and(|jobs| jobs.len() == 1)
        {
            assert_eq!(listed["jobs"][0]["job"]["key"], key);
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "not listed unknown within lease + 10 s: {listed}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "orphan listed unknown {:?} after the kill",
        killed_at.elapsed()
    );
    let metrics = send(
        &client,
        Method::GET,
        &format!("{admin}/metrics"),
        &[],
        Bytes::new(),
    )
    .await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("idemgate_jobs_unknown 1"), "{text}");
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Bytes,
) -> Reply {
    let mut request = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request.body(Full::new(body)).unwrap();
    let response = bounded("a response", client.request(request))
        .await
        .expect("the request is answered");
    let (parts, body) = response.into_parts();
    let body = bounded("a response body", body.collect())
        .await
        .expect("the body arrives")
        .to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

impl TestGateway {
    /// Starts a gateway on `config` (TOML without `[server]`, which this adds).
    pub async fn start(config: &str) -> Self {
        let store = idemgate::store::memory::MemoryStore::new(idemgate::job::ExpiryPolicy {
            retention: Duration::from_secs(3600),
            late_result_window: Duration::from_secs(600),
        });
        Self::start_on(config, Arc::new(store)).await
    }

    pub async fn start_on(config: &str, store: Arc<dyn idemgate::store::JobStore>) -> Self {
        let config = Self::config(config);
        let upstream = idemgate::upstream::Upstream::new(&config.providers);
        Self::start_with(config, store, upstream).await
    }

    /// A gateway on `store` in front of one provider (returned, for its calls) that answers
    /// every call 200 `ok`.
    pub async fn answering_ok(
        store: Arc<dyn idemgate::store::JobStore>,
    ) -> (Self, wiremock::MockServer) {
        let provider = wiremock::MockServer::start().await;
        wiremock::Mock::given(wiremock::matchers::method("POST"))
            .respond_with(wiremock::ResponseTemplate::new(200).set_body_string("ok"))
            .mount(&provider)
            .await;
        let gw = Self::start_on(&two_provider_config(&provider.uri(), "", None, ""), store).await;
        (gw, provider)
    }

    /// The full config of a test gateway: `[server]` added to `config`.
    pub fn config(config: &str) -> Arc<idemgate::Config> {
        std::env::set_var(ADMIN_TOKEN_ENV, ADMIN_TOKEN);
        let text = format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nadmin_token_env = \"{ADMIN_TOKEN_ENV}\"\nshutdown_grace = \"2s\"\n{config}"
        );
        Arc::new(idemgate::Config::parse(&text, "test.toml").unwrap_or_else(|e| panic!("{e}")))
    }

    /// A gateway whose providers are reached through `upstream`.
    pub async fn start_with(
        config: Arc<idemgate::Config>,
        store: Arc<dyn idemgate::store::JobStore>,
        upstream: idemgate::upstream::Upstream,
    ) -> Self {
        let running = idemgate::start_with(config, store, upstream)
            .await
            .expect("the gateway starts");
        Self {
            base: format!("http://{}", running.addr),
            admin: format!("http://{}", running.admin_addr.unwrap()),
            running,
            client: client(),
        }
    }

    pub async fn post(&self, path: &str, key: Option<&str>, body: Bytes) -> Reply {
        let mut headers = vec![
            ("authorization", "Bearer sk-client-1"),
            ("content-type", "application/json"),
        ];
        if let Some(key) = key {
            headers.push(("idempotency-key", key));
        }
        self.request(Method::POST, path, &headers, body).await
    }

    /// A keyed chat request that carries no credential at all.
    pub async fn post_without_owner(&self, path: &str, key: &str, body: Bytes) -> Reply {
        let headers = [("idempotency-key", key)];
        self.request(Method::POST, path, &headers, body).await
    }

    pub async fn request(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Reply {
        send(
            &self.client,
            method,
            &format!("{}{path}", self.base),
            headers,
            body,
        )
        .await
    }

    pub async fn admin_get(&self, path: &str) -> Reply {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        send(
            &self.client,
            Method::GET,
            &format!("{}{path}", self.admin),
            &[("authorization", &auth)],
            Bytes::new(),
        )
        .await
    }

    pub async fn admin_post(&self, path: &str) -> Reply {
        let auth = format!("Bearer {ADMIN_TOKEN}");
        send(
            &self.client,
            Method::POST,
            &format!("{}{path}", self.admin),
            &[("authorization", &auth)],
            Bytes::new(),
        )
        .await
    }

    /// The admin view of a job: `{"job": {...}, "attempts": [...]}`.
    pub async fn job(&self, id: &str) -> Value {
        let reply = self.admin_get(&format!("/jobs/{id}")).await;
        assert_eq!(reply.status, 200, "{reply:?}");
        reply.json()
    }

    /// Waits (bounded) until the admin view of a job satisfies `check`. For state that has
    /// no notification a test can subscribe to, such as an attempt losing a race.
    pub async fn job_eventually(&self, id: &str, check: impl Fn(&Value) -> bool) -> Value {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let view = self.job(id).await;
            if check(&view) {
                return view;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "job never reached the expected state: {view}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits for the job to leave (`version`, `state`), through the store's own notification.
    pub async fn wait_job_change(&self, id: &str, version: u64, state: &str) -> serde_json::Value {
        let store = self.running.gateway.store();
        let record = bounded(
            "a job change",
            store.wait_change(id, version, state_of(state), PATIENCE),
        )
        .await
        .unwrap();
        assert!(
            record.job.version != version || record.job.state.as_str() != state,
            "job {id} never left {state} at version {version}"
        );
        self.job(id).await
    }
}

fn state_of(s: &str) -> idemgate::job::JobState {
    use idemgate::job::JobState::*;
    match s {
        "in_progress" => InProgress,
        "succeeded" => Succeeded,
        "failed" => Failed,
        "unknown" => Unknown,
        _ => Cancelled,
    }
}

/// A port nothing listens on: bound, then released.
pub async fn closed_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap()
}

/// A provider whose every request is handed to the test, which decides when and how it is
/// answered. Counts the requests it received.
pub struct HeldProvider {
    pub addr: SocketAddr,
    calls: mpsc::UnboundedReceiver<HeldCall>,
    count: Arc<AtomicUsize>,
}

/// Status, headers and body a held call is answered with.
type HeldAnswer = (u16, Vec<(String, String)>, Bytes);

/// One request held at a [`HeldProvider`].
pub struct HeldCall {
    pub headers: HeaderMap,
    pub body: Bytes,
    reply: oneshot::Sender<HeldAnswer>,
}

impl HeldCall {
    pub fn answer(self, status: u16, body: Bytes) {
        self.answer_with(status, &[("content-type", "application/json")], body);
    }

    pub fn answer_with(self, status: u16, headers: &[(&str, &str)], body: Bytes) {
        let headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let _ = self.reply.send((status, headers, body));
    }
}

/// A provider on a free port: every request is counted, then answered by `handler`, each
/// connection served over HTTP/1.1 until the test ends. Returns its address and the count.
pub async fn serve_provider<H, F, B>(handler: H) -> (SocketAddr, Arc<AtomicUsize>)
where
    H: Fn(Request<Incoming>) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = Result<hyper::Response<B>, std::io::Error>> + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(AtomicUsize::new(0));
    let counter = count.clone();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (handler, counter) = (handler.clone(), counter.clone());
            let service = service_fn(move |request: Request<Incoming>| {
                counter.fetch_add(1, Ordering::SeqCst);
                handler(request)
            });
            tokio::spawn(async move {
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, count)
}

impl HeldProvider {
    pub async fn start() -> Self {
        let (tx, calls) = mpsc::unbounded_channel();
        let (addr, count) = serve_provider(move |request: Request<Incoming>| {
            let tx = tx.clone();
            async move {
                let (parts, body) = request.into_parts();
                let body = body
                    .collect()
                    .await
                    .map_err(std::io::Error::other)?
                    .to_bytes();
                let (reply, answer) = oneshot::channel();
                let _ = tx.send(HeldCall {
                    headers: parts.headers,
                    body,
                    reply,
                });
                // A dropped call closes the connection without an answer.
                let (status, headers, body) = match answer.await {
                    Ok(answer) => answer,
                    Err(_) => return Err(std::io::Error::other("dropped")),
                };
                let mut response = hyper::Response::new(Full::new(body));
                *response.status_mut() = StatusCode::from_u16(status).unwrap();
                for (k, v) in headers {
                    response.headers_mut().insert(
                        http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                        v.parse().unwrap(),
                    );
                }
                Ok(response)
            }
        })
        .await;
        Self { addr, calls, count }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The next request to arrive (bounded wait).
    pub async fn next_call(&mut self) -> HeldCall {
        bounded("a provider call", self.calls.recv())
            .await
            .expect("the provider is running")
    }

    /// Asserts that no further request arrives within `quiet`.
    pub async fn assert_no_call_within(&mut self, quiet: Duration) {
        if let Ok(Some(_)) = tokio::time::timeout(quiet, self.calls.recv()).await {
            panic!("an unexpected provider call arrived");
        }
    }

    pub fn calls(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// The completion fixture as a provider's 200.
pub fn completion() -> wiremock::ResponseTemplate {
    wiremock::ResponseTemplate::new(200)
        .set_body_raw(fixture("openai-chat-completion.json"), "application/json")
        .insert_header("x-request-id", "req_primary")
}

/// A provider that answers every POST with `template`.
pub async fn answering(template: wiremock::ResponseTemplate) -> wiremock::MockServer {
    let server = wiremock::MockServer::start().await;
    wiremock::Mock::given(wiremock::matchers::method("POST"))
        .respond_with(template)
        .mount(&server)
        .await;
    server
}

/// Providers `primary` (with `primary_extra` keys) and, when given, `fallback`, behind one
/// route `chat` on `/v1` with `route` keys.
pub fn two_provider_config(
    primary: &str,
    primary_extra: &str,
    fallback: Option<&str>,
    route: &str,
) -> String {
    let mut text =
        format!("[[providers]]\nname = \"primary\"\nbase_url = \"{primary}\"\n{primary_extra}\n");
    let mut names = "\"primary\"".to_owned();
    if let Some(fallback) = fallback {
        text.push_str(&format!(
            "[[providers]]\nname = \"fallback\"\nbase_url = \"{fallback}\"\n"
        ));
        names.push_str(", \"fallback\"");
    }
    text.push_str(&format!(
        "[[routes]]\nname = \"chat\"\npath_prefix = \"/v1\"\nproviders = [{names}]\n{route}\n"
    ));
    text
}

/// How many requests a wiremock server received.
pub async fn received(server: &wiremock::MockServer) -> usize {
    server.received_requests().await.map_or(0, |r| r.len())
}

/// Headers of a reply without the ones that legitimately differ between a first answer and
/// its replay: the replay flag, and the id of each request.
pub fn comparable_headers(reply: &Reply) -> HashMap<String, String> {
    reply
        .headers
        .iter()
        .filter(|(k, _)| *k != "idempotent-replayed" && *k != "x-request-id")
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap_or("").to_owned()))
        .collect()
}

/// Sends one keyed POST to `base` in the background, for a request the test cuts off (by
/// killing the gateway that runs it); its status, if an answer came.
pub fn post_in_background(base: &str, key: &'static str) -> tokio::task::JoinHandle<Option<u16>> {
    let url = format!("{base}/v1/chat/completions");
    tokio::spawn(async move {
        let request = Request::post(url)
            .header("authorization", "Bearer sk-client-1")
            .header("idempotency-key", key)
            .body(Full::new(chat_request()))
            .unwrap();
        client()
            .request(request)
            .await
            .ok()
            .map(|r| r.status().as_u16())
    })
}

/// The `idemgate` binary running as a child process, killed when dropped.
pub struct Process {
    pub child: Child,
    pub base: String,
    pub admin: String,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port for a child gateway to listen on, below the kernel's ephemeral range
/// (32768–60999 by default): a port the kernel handed out and took back could be handed out
/// again as the source port of another test's outgoing connection before the child binds
/// it, and the child would then fail to start.
pub async fn free_port() -> u16 {
    loop {
        let port = fastrand::u16(20_000..32_000);
        if TcpListener::bind(("127.0.0.1", port)).await.is_ok() {
            return port;
        }
    }
}

/// Starts the binary on `config` and waits (bounded) until its admin port accepts.
pub async fn spawn_gateway(config: &std::path::Path, port: u16, admin_port: u16) -> Process {
    spawn_gateway_logging(config, port, admin_port, "warn", Stdio::null()).await
}

/// Like [`spawn_gateway`], logging at `level` to `stderr`.
pub async fn spawn_gateway_logging(
    config: &std::path::Path,
    port: u16,
    admin_port: u16,
    level: &str,
    stderr: Stdio,
) -> Process {
    let mut command = Command::new(env!("CARGO_BIN_EXE_idemgate"));
    command.arg("--config").arg(config);
    start_gateway(command, port, admin_port, level, stderr).await
}

/// Like [`spawn_gateway`], allowed to run on the first CPU only (util-linux's `taskset`), as
/// in a container given one core.
pub async fn spawn_gateway_on_one_core(
    config: &std::path::Path,
    port: u16,
    admin_port: u16,
) -> Process {
    let mut command = Command::new("taskset");
    command
        .args(["-c", "0", env!("CARGO_BIN_EXE_idemgate"), "--config"])
        .arg(config);
    start_gateway(command, port, admin_port, "warn", Stdio::null()).await
}

async fn start_gateway(
    mut command: Command,
    port: u16,
    admin_port: u16,
    level: &str,
    stderr: Stdio,
) -> Process {
    let child = command
        .env(ADMIN_TOKEN_ENV, ADMIN_TOKEN)
        .env("IDEMGATE_LOG", level)
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let process = Process {
        child,
        base: format!("http://127.0.0.1:{port}"),
        admin: format!("http://127.0.0.1:{admin_port}"),
    };
    // A child process has no signal to await but its port: poll it, bounded.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if tokio::net::TcpStream::connect(("127.0.0.1", admin_port))
            .await
            .is_ok()
        {
            return process;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the gateway never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
