//! idemgate: an idempotency gateway for AI provider APIs. One job per intent; attempts
//! (primary, fallback, retries, hedges) accumulate under it; exactly one answer is stored
//! and replayed.
//!
//! # Layout
//!
//! ```text
//!   server (accept loop)            admin (SPEC §8)
//!        │                               │
//!   gateway (HTTP request path)          │
//!     reads route, owner, key,           │
//!     body (intent)                      │
//!        │  Submission ─▶ Outcome        │
//!        ▼                               ▼
//!   engine ── fingerprints, claims, waits, replays, re-opens; runs rounds
//!     ├─ round ─ attempt ─ relay         (SPEC §4, §5)
//!     ├─ store (JobStore) ─ job (pure state machine, SPEC §2)
//!     ├─ upstream (Transport)   ├─ breaker   ├─ probe ─ contract
//!     └─ stream (live recordings)   metrics   clock
//!   config ◀── everything reads it; error ◀── gateway and admin turn causes into problems
//! ```
//!
//! Arrows point from a module to what it uses; nothing below points back up. The engine
//! knows nothing of HTTP serving, so a round runs in a unit test with a simulated transport
//! and no listener.
//!
//! - [`config`]: TOML → validated, typed config (SPEC §9): raw shapes, validation with every
//!   default, single-value parsers.
//! - [`clock`]: wall time read through tokio's clock, so paused time drives leases.
//! - [`intent`]: owner, idempotency key and fingerprint of a request (SPEC §3).
//! - [`job`]: jobs, attempts, and the pure state machine with its compare-and-swap (SPEC §2).
//! - [`store`]: the `JobStore` trait that applies that state machine atomically, and its
//!   implementations.
//! - [`engine`]: what a job needs — store, providers, breakers, probes, live streams, tasks —
//!   and the rounds of attempts: failover, timeout → unknown, hedging, late answers.
//! - [`gateway`]: the HTTP request path, a thin adapter over the engine.
//! - [`upstream`]: provider clients and how a client request is rewritten for a provider.
//! - [`stream`]: live streams: relay, record, let duplicates join, follow a mirror (SPEC §5).
//! - [`contract`]: what a 2xx must hold before it may settle a job (SPEC §6).
//! - [`breaker`]: a circuit breaker per provider (SPEC §4).
//! - [`probe`]: proving a fallback holds the primary's contract (SPEC §6).
//! - [`admin`]: health, readiness, metrics, job inspection and cancel (SPEC §8).
//! - [`metrics`]: the Prometheus metrics.
//! - [`idle`]: whether the runtime's workers ran out of work, for the store's writer.
//! - [`error`]: every gateway error, from a typed cause to `application/problem+json` (SPEC §7).
//! - `server`: the hyper accept loop with graceful shutdown.
//! - [`alloc`]: the binary's global allocator, mimalloc.
//!
//! [`start`] binds both listeners and returns a [`Running`] gateway; [`run`] serves until a
//! shutdown future resolves. Tests start gateways in-process on port 0.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tracing::info;

pub mod accesslog;
pub mod admin;
pub mod alloc;
pub mod body;
pub mod breaker;
pub mod clock;
pub mod config;
pub mod console;
pub mod contract;
pub mod edge;
pub mod engine;
pub mod error;
pub mod gateway;
pub mod headers;
pub mod idle;
pub mod intent;
pub mod job;
pub mod logline;
pub mod logsink;
pub mod metrics;
pub mod probe;
mod server;
pub mod store;
pub mod stream;
pub mod upstream;

pub use config::Config;
pub use engine::Engine;
pub use gateway::Gateway;

/// Why a gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot open the store: {0}")]
    Store(#[from] store::StoreError),
}

/// A gateway serving in the background.
#[derive(Debug)]
pub struct Running {
    /// Where client traffic is served.
    pub addr: SocketAddr,
    /// Where the admin API is served, if configured.
    pub admin_addr: Option<SocketAddr>,
    pub gateway: Arc<Gateway>,
    shutdown: watch::Sender<bool>,
    task: JoinHandle<()>,
}

impl Running {
    /// Stops accepting, lets requests in flight finish within `server.shutdown_grace`, and
    /// marks the jobs of rounds that could not finish `unknown`.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        let _ = self.task.await;
    }
}

/// Opens the store, binds the listeners and starts serving.
pub async fn start(config: Config) -> Result<Running, StartError> {
    let config = Arc::new(config);
    let store = store::open(&config.store, Engine::expiry_policy(&config)).await?;
    start_with_store(config, store).await
}

/// Like [`start`], on a store the caller opened (several gateways can share one).
pub async fn start_with_store(
    config: Arc<Config>,
    store: Arc<dyn store::JobStore>,
) -> Result<Running, StartError> {
    let upstream = upstream::Upstream::new(&config.providers);
    start_with(config, store, upstream).await
}

/// Like [`start_with_store`], with providers reached through `upstream` (e.g. in-process
/// ones a test scripts).
pub async fn start_with(
    config: Arc<Config>,
    store: Arc<dyn store::JobStore>,
    upstream: upstream::Upstream,
) -> Result<Running, StartError> {
    let listener = server::bind(config.server.listen).await?;
    let addr = listener.local_addr().map_err(|source| StartError::Bind {
        addr: config.server.listen,
        source,
    })?;
    let admin_listener = match config.server.admin_listen {
        Some(admin) => Some(server::bind(admin).await?),
        None => None,
    };
    let admin_addr = admin_listener.as_ref().and_then(|l| l.local_addr().ok());
    let engine = Engine::new(config.clone(), store, upstream);
    let gateway = Gateway::new(engine.clone());
    if let Some(clients) = gateway.clients() {
        clients.reload_on_sighup();
    }
    let (shutdown, watch) = watch::channel(false);
    let grace = config.server.shutdown_grace;
    let limits = server::Limits {
        max_connections: config.server.max_connections,
        header_timeout: config.server.request_header_timeout,
        idle_timeout: config.server.idle_timeout,
    };

    let client = tokio::spawn(server::serve(
        listener,
        edge::client_service(gateway.clone()),
        limits,
        watch.clone(),
        grace,
    ));
    let admin = admin_listener.map(|listener| {
        let token = std::env::var(&config.server.admin_token_env).ok();
        if token.is_none() {
            tracing::warn!(env = %config.server.admin_token_env, "no admin token set: the admin API answers 401 except /healthz and /readyz");
        }
        let admin = Arc::new(admin::Admin::new(engine.clone(), token));
        let service = tower::service_fn(move |request| {
            let admin = admin.clone();
            async move { Ok::<_, std::convert::Infallible>(admin.handle(request).await) }
        });
        // The admin listener has its own connection slots: client load never crowds it out.
        let limits = server::Limits {
            max_connections: 256,
            ..limits
        };
        let service = tower::util::BoxCloneService::new(service);
        tokio::spawn(server::serve(listener, service, limits, watch.clone(), grace))
    });
    info!(%addr, admin = ?admin_addr, store = ?config.store.kind, "idemgate listening");

    let task = {
        let engine = engine.clone();
        tokio::spawn(async move {
            let _ = client.await;
            engine.abandon_rounds().await;
            engine.stop();
            if let Some(admin) = admin {
                let _ = admin.await;
            }
            info!("idemgate stopped");
        })
    };
    Ok(Running {
        addr,
        admin_addr,
        gateway,
        shutdown,
        task,
    })
}

/// Serves until `shutdown` resolves, then shuts down gracefully.
pub async fn run(config: Config, shutdown: impl Future<Output = ()>) -> Result<(), StartError> {
    let running = start(config).await?;
    shutdown.await;
    info!("shutting down");
    running.shutdown().await;
    Ok(())
}
