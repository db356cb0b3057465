//! The floor of `benches/overhead.sh`: about the least a proxy built on the gateway's own
//! stack (tokio's one-core scheduler, hyper's server, hyper-util's pooled client, mimalloc,
//! SHA-256) can spend, measured beside the gateway in the same run. It shows how much of
//! the gateway's cost against nginx belongs to that stack, and how much to the gateway.
//!
//!     cargo run --release --example floor_proxy -- 127.0.0.1:9001 127.0.0.1:9000 pass
//!     cargo run --release --example floor_proxy -- 127.0.0.1:9001 127.0.0.1:9000 idempotent
//!
//! `pass` forwards each request and streams the answer back, as nginx's `proxy_pass` does.
//! `idempotent` is the bare idempotent path: the body read whole and hashed, `(SHA-256 of
//! the credential, key)` claimed in a locked map, the provider called, its answer copied
//! out of the connection's buffers and kept, and a duplicate with the same body answered
//! from the map (one of a job in flight waits for its answer). None of the rest: no
//! canonical JSON, no routes, attempts, timeouts, leases, access line, metrics, request ids
//! or limits. It is not a gateway — a failed call is forgotten, and whoever waited for it
//! gets a 502 — only a measuring stick.

use std::collections::HashMap;
use std::convert::Infallible;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio::sync::watch;

#[global_allocator]
static ALLOCATOR: idemgate::alloc::Allocator = idemgate::alloc::Allocator;

type Body = UnsyncBoxBody<Bytes, hyper::Error>;

type Answer = Option<(StatusCode, HeaderMap, Bytes)>;

/// What the map holds for an identity: the body's hash, and the answer once there is one.
struct Entry {
    fingerprint: [u8; 32],
    answer: watch::Receiver<Answer>,
}

struct Floor {
    upstream: String,
    client: Client<HttpConnector, Body>,
    idempotent: bool,
    jobs: Mutex<Jobs>,
}

/// The claimed identities, in 64 maps that each grow on their own, as the gateway's memory
/// store keeps its jobs. In one map, each doubling moved every entry at once: with a few
/// hundred thousand jobs, one bench run saw a p99 of 97 ms for the floor's new jobs at 32
/// clients, and in two alternating pairs of 8 s runs its slowest request took 25.0 and 22.4
/// ms against 13.1 and 9.2 ms with 64 maps (the CPU per new job the same within the runs'
/// noise). The identities are SHA-256 digests, so their first byte picks a map evenly.
struct Jobs(Vec<Map>);

type Map = HashMap<[u8; 32], Entry, foldhash::fast::RandomState>;

impl Jobs {
    fn new() -> Self {
        Self((0..64).map(|_| HashMap::default()).collect())
    }

    fn of(&mut self, identity: &[u8; 32]) -> &mut Map {
        let shards = self.0.len();
        &mut self.0[usize::from(identity[0]) % shards]
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream), Some(idempotent)) = (
        args.next(),
        args.next(),
        args.next().and_then(|mode| match mode.as_str() {
            "pass" => Some(false),
            "idempotent" => Some(true),
            _ => None,
        }),
    ) else {
        eprintln!("usage: floor_proxy LISTEN UPSTREAM pass|idempotent");
        std::process::exit(2);
    };
    // As the gateway does (src/main.rs): with transparent huge pages, each 2 MB page of the
    // growing map is zeroed whole at its first touch, and the floor's new jobs would pay a
    // kernel share (and hold memory) that the gateway's do not.
    #[cfg(target_os = "linux")]
    if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
        eprintln!("transparent huge pages stay on: {e}");
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let floor = Arc::new(Floor {
            upstream,
            client: Client::builder(TokioExecutor::new()).build(connector),
            idempotent,
            jobs: Mutex::new(Jobs::new()),
        });
        let listener = TcpListener::bind(&listen).await.expect("bind");
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let floor = floor.clone();
            tokio::spawn(async move {
                let service = service_fn(move |request| {
                    let floor = floor.clone();
                    async move { Ok::<_, Infallible>(floor.serve(request).await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
}

impl Floor {
    async fn serve(&self, request: Request<Incoming>) -> Response<Body> {
        if !self.idempotent {
            return match self.forward(request.map(BodyExt::boxed_unsync)).await {
                Some(response) => response.map(BodyExt::boxed_unsync),
                None => status(StatusCode::BAD_GATEWAY),
            };
        }
        let (parts, body) = request.into_parts();
        let Some(key) = parts.headers.get("idempotency-key") else {
            return status(StatusCode::BAD_REQUEST);
        };
        let owner = Sha256::digest(
            parts
                .headers
                .get(http::header::AUTHORIZATION)
                .map_or(&b""[..], |v| v.as_bytes()),
        );
        let identity: [u8; 32] = Sha256::new()
            .chain_update(owner)
            .chain_update(key.as_bytes())
            .finalize()
            .into();
        let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
            return status(StatusCode::BAD_REQUEST);
        };
        let fingerprint: [u8; 32] = Sha256::digest(&body).into();
        let answered = {
            let mut jobs = self.jobs.lock().expect("jobs");
            let jobs = jobs.of(&identity);
            match jobs.get(&identity) {
                Some(entry) if entry.fingerprint != fingerprint => {
                    return status(StatusCode::CONFLICT)
                }
                Some(entry) => Err(entry.answer.clone()),
                None => {
                    let (answered, answer) = watch::channel(None);
                    jobs.insert(
                        identity,
                        Entry {
                            fingerprint,
                            answer,
                        },
                    );
                    Ok(answered)
                }
            }
        };
        let answered = match answered {
            Ok(answered) => answered,
            Err(mut answer) => {
                let Ok(answer) = answer.wait_for(Option::is_some).await else {
                    return status(StatusCode::BAD_GATEWAY);
                };
                let (code, headers, body) = answer.as_ref().expect("answered");
                let mut response = Response::new(full(body.clone()));
                *response.status_mut() = *code;
                *response.headers_mut() = headers.clone();
                return response;
            }
        };
        let request = Request::from_parts(parts, full(body));
        let Some(response) = self.forward(request).await else {
            self.forget(&identity);
            return status(StatusCode::BAD_GATEWAY);
        };
        let (parts, body) = response.into_parts();
        let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
            self.forget(&identity);
            return status(StatusCode::BAD_GATEWAY);
        };
        // Copied, as the gateway does: kept as they are, the body and every header value
        // (a slice of the same buffer) would pin the connection's read buffer, several KB
        // for each stored answer.
        let body = Bytes::copy_from_slice(&body);
        answered.send_replace(Some((parts.status, owned(&parts.headers), body.clone())));
        Response::from_parts(parts, full(body))
    }

    /// Drops a claim whose call failed, so that a retry calls the provider again.
    fn forget(&self, identity: &[u8; 32]) {
        self.jobs
            .lock()
            .expect("jobs")
            .of(identity)
            .remove(identity);
    }

    async fn forward(&self, request: Request<Body>) -> Option<Response<Incoming>> {
        let (mut parts, body) = request.into_parts();
        let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
        parts.uri = format!("http://{}{path}", self.upstream).parse().ok()?;
        parts.headers.remove(http::header::HOST);
        self.client
            .request(Request::from_parts(parts, body))
            .await
            .ok()
    }
}

/// The headers with values of their own, none of them sharing a connection's buffer.
fn owned(headers: &HeaderMap) -> HeaderMap {
    headers
        .iter()
        .map(|(name, value)| {
            let value = HeaderValue::from_bytes(value.as_bytes()).expect("a valid value stays so");
            (name.clone(), value)
        })
        .collect()
}

fn full(bytes: Bytes) -> Body {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

fn status(code: StatusCode) -> Response<Body> {
    let mut response = Response::new(full(Bytes::new()));
    *response.status_mut() = code;
    response
}
