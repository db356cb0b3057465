//! The client edge (SPEC §11): who may connect, for how long, and how much. Everything here
//! runs before the gateway sees a request or after it answered, so the job protocol never
//! has to think about hostile clients.
//!
//! - `conn`: per-connection timers — the request head must arrive within
//!   `request_header_timeout` (else 408 and close), an idle keep-alive connection is closed
//!   after `idle_timeout` — and the bound on a request head, with problem+json in place of
//!   the empty answers hyper gives heads it cannot parse;
//! - `budget`: `max_buffered_body_bytes` across all connections;
//! - `clients`: the `[clients]` allow list, reloaded on SIGHUP;
//! - this module: the tower stack every client request goes through.

pub mod budget;
pub mod clients;
pub(crate) mod conn;

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::util::BoxCloneService;
use tower::{Service, ServiceBuilder};
use tower_http::catch_panic::CatchPanicLayer;

use crate::body::{Body, BoxError};
use crate::error::{Cause, Problem, REQUEST_ID};
use crate::gateway::{Gateway, ACCESS};
use crate::headers;

/// The service every client request goes through, outermost layer first.
pub(crate) type ClientService = BoxCloneService<Request<Body>, Response<Body>, Infallible>;

pub(crate) fn client_service(gateway: Arc<Gateway>) -> ClientService {
    let engine = gateway.engine().clone();
    let max_in_flight = engine.config().server.max_in_flight;
    let panics = engine.clone();
    let limited = ServiceBuilder::new()
        // Turns a shed request into 503 `overloaded`, before anything was claimed.
        .map_result(|result: Result<Response<Body>, BoxError>| {
            Ok::<_, BoxError>(match result {
                Ok(response) => response,
                Err(e) if e.is::<tower::load_shed::error::Overloaded>() => {
                    Problem::from(Cause::Overloaded).into_response()
                }
                Err(e) => Problem::from(Cause::Internal(e.to_string())).into_response(),
            })
        })
        // Refuses at once instead of queueing when `max_in_flight` requests are being
        // handled: a queue would only hide the overload from the client.
        .load_shed()
        .concurrency_limit(max_in_flight)
        .map_response(
            |response: Response<tower_http::body::UnsyncBoxBody<bytes::Bytes, BoxError>>| {
                response.map(crate::body::boxed)
            },
        )
        // Innermost: a panic in the request path becomes this request's 500 and frees its
        // in-flight slot; the connection and every other request carry on.
        .layer(CatchPanicLayer::custom(
            move |panic: Box<dyn std::any::Any + Send>| {
                panics.metrics().panicked();
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                Problem::from(Cause::Internal(format!(
                    "panic in request handling: {what}"
                )))
                .into_response()
            },
        ))
        .service_fn(move |request: Request<Body>| {
            let gateway = gateway.clone();
            // Boxed where it is made: the request path's state machine is kilobytes, and
            // each layer above would otherwise copy it into its own future.
            Box::pin(async move { Ok::<_, Infallible>(gateway.handle(request).await) })
        });
    // Outermost, so that every answer — shed, timed out, panicked — carries the request's
    // id, and no request goes unlogged.
    BoxCloneService::new(AccessLog { inner: limited })
}

/// The longest `X-Request-Id` taken from a client. The id goes into every access line and
/// to the provider, so a client could otherwise make each line as long as a request head.
const MAX_REQUEST_ID: usize = 200;

/// The request's id (SPEC §11): the client's own `X-Request-Id` when it is one printable
/// ASCII value of at most `MAX_REQUEST_ID` bytes, else a new one, which replaces it in the
/// request so that the provider gets the same (as Heroku's router does with the ids it will
/// not take). Looked up once, with no request or response extension: tower-http's pair of
/// layers for this looked the header up three times and allocated both requests' and
/// responses' extension maps.
pub(crate) fn request_id<B>(request: &mut Request<B>) -> http::HeaderValue {
    let mut ids = request.headers().get_all(headers::REQUEST_ID).iter();
    if let (Some(id), None) = (ids.next(), ids.next()) {
        if !id.is_empty()
            && id.len() <= MAX_REQUEST_ID
            && id.as_bytes().iter().all(|b| (b' '..=b'~').contains(b))
        {
            return id.clone();
        }
    }
    let mut text = [0u8; uuid::fmt::Hyphenated::LENGTH];
    let text = uuid::Uuid::new_v4().hyphenated().encode_lower(&mut text);
    let id = http::HeaderValue::from_str(text).expect("a UUID is a header value");
    request
        .headers_mut()
        .insert(headers::REQUEST_ID, id.clone());
    id
}

/// The request's id, taken or made, echoed on its answer and known to every problem built
/// while serving it; then one access-log line per request at info, with what an operator
/// greps for.
///
/// Generic over the stack below rather than boxing it: a boxed service is cloned into a new
/// box for every request and boxes its future again, two of a replay's 36 allocations.
#[derive(Clone)]
struct AccessLog<S> {
    inner: S,
}

impl<S, F> Service<Request<Body>> for AccessLog<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = BoxError, Future = F>,
    F: Future<Output = Result<Response<Body>, BoxError>> + Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // The load-shedding layer below is always ready: it refuses in `call` instead.
        match self.inner.poll_ready(cx) {
            Poll::Ready(_) => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }
    }

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let started = tokio::time::Instant::now();
        let method = request.method().clone();
        // Clones that share the request's buffers: a copy of each was three allocations of
        // a replay's sixty.
        let uri = request.uri().clone();
        let request_id = request_id(&mut request);
        let inner = self.inner.call(request);
        let scoped = request_id.clone();
        let served = async move {
            let mut response = inner
                .await
                .unwrap_or_else(|e| Problem::from(Cause::Internal(e.to_string())).into_response());
            // A provider's own id, which its answer carries, is kept as the provider sent it.
            if !response.headers().contains_key(headers::REQUEST_ID) {
                response
                    .headers_mut()
                    .insert(headers::REQUEST_ID, request_id.clone());
            }
            let info = ACCESS.with(RefCell::take);
            let info = info.as_ref();
            let header = |name| {
                response
                    .headers()
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("")
            };
            let outcome = match (
                info.and_then(|i| i.outcome),
                response.extensions().get::<crate::error::ProblemKind>(),
            ) {
                (Some(outcome), _) => outcome.as_str(),
                (None, Some(kind)) => kind.slug(),
                (None, None) => "proxied",
            };
            crate::accesslog::AccessLine {
                method: method.as_str(),
                path: info.map_or(uri.path(), |i| i.path.as_str()),
                route: info.and_then(|i| i.route.as_deref()).unwrap_or(""),
                status: response.status().as_u16(),
                micros: u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                outcome,
                job_id: header(headers::JOB_ID),
                attempt: header(headers::ATTEMPT),
                provider: header(headers::PROVIDER),
                replayed: header(headers::REPLAYED),
                request_id: request_id.to_str().unwrap_or_default(),
            }
            .log();
            Ok(response)
        };
        Box::pin(REQUEST_ID.scope(scoped, ACCESS.scope(RefCell::new(None), served)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_fit_client_request_ids_are_kept_and_others_replaced() {
        let taken = |ids: &[&[u8]]| {
            let mut request = Request::new(());
            for id in ids {
                request.headers_mut().append(
                    headers::REQUEST_ID,
                    http::HeaderValue::from_bytes(id).unwrap(),
                );
            }
            let id = request_id(&mut request);
            // The request carries the id it is served under, once, for the provider.
            let carried: Vec<_> = request
                .headers()
                .get_all(headers::REQUEST_ID)
                .iter()
                .collect();
            assert_eq!(carried, [&id]);
            id.as_bytes().to_vec()
        };
        let made = |id: Vec<u8>| {
            let id = String::from_utf8(id).unwrap();
            let parsed = uuid::Uuid::parse_str(&id).expect("a UUID");
            assert_eq!(parsed.get_version_num(), 4);
            assert_eq!(
                id,
                parsed.hyphenated().to_string(),
                "lower-case, hyphenated"
            );
            id
        };
        assert_eq!(taken(&[b"req-123 a/b=c"]), b"req-123 a/b=c");
        let longest = [b'a'; MAX_REQUEST_ID];
        assert_eq!(taken(&[&longest]), longest);
        let refused: [&[&[u8]]; 6] = [
            &[],
            &[&[b'a'; MAX_REQUEST_ID + 1]],
            &[b""],
            &[b"caf\xc3\xa9"],
            &[b"tab\there"],
            &[b"one", b"two"],
        ];
        let ids: Vec<String> = refused.iter().map(|ids| made(taken(ids))).collect();
        assert_ne!(ids[0], ids[1], "each made id is new");
    }
}
