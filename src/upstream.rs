//! The upstream side: one pooled hyper client per provider (HTTP/1.1 and HTTP/2, rustls for
//! https), how a client request is rewritten for a provider (SPEC §4), and how the ways an
//! exchange can break are told apart, because that decides between failover and `unknown`.

use std::error::Error as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, Uri};
use http_body::{Body as _, Frame, SizeHint};
use http_body_util::BodyExt;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use std::future::Future;
use std::pin::Pin;

use crate::body::{self, Body, BoxError};
use crate::config::Provider;
use crate::headers;

type HttpsClient = Client<HttpsConnector<HttpConnector>, Body>;

/// A provider exchange in flight.
pub type Exchange = Pin<Box<dyn Future<Output = Result<Response<Body>, CallError>> + Send>>;

/// How requests reach providers: hyper over TCP and TLS, or, in a simulation, in-process
/// providers whose timing a seed decides.
pub trait Transport: Send + Sync + std::fmt::Debug + 'static {
    /// Sends `request` to provider `index`; the answer's body is still to be read.
    fn send(&self, index: usize, request: Request<Body>) -> Exchange;
}

/// The way to every configured provider, by provider index.
#[derive(Clone, Debug)]
pub struct Upstream {
    transport: Arc<dyn Transport>,
}

/// One pooled hyper client per provider.
#[derive(Debug)]
struct Hyper {
    clients: Box<[HttpsClient]>,
}

impl Transport for Hyper {
    fn send(&self, index: usize, request: Request<Body>) -> Exchange {
        let client = self.clients[index].clone();
        let (parts, outgoing) = request.into_parts();
        let outgoing = Outgoing::new(outgoing);
        let taken_all = outgoing.taken_all.clone();
        let request = Request::from_parts(parts, body::boxed(outgoing));
        Box::pin(async move {
            let response = client
                .request(request)
                .await
                .map_err(|e| classify(e, taken_all.load(Ordering::Acquire)))?;
            Ok(response.map(body::boxed))
        })
    }
}

/// A request body as hyper takes it: in slices of at most [`Outgoing::SLICE`] bytes, noting
/// when the last one was taken. Until then the provider cannot hold the whole request, so a
/// connection that breaks is a request not sent, whichever side of the connection notices
/// the break first: a write of the body, or a read that finds the provider's reset (hyper
/// reports that one as a connection error, like a reset after a whole request).
struct Outgoing {
    inner: Body,
    /// The rest of a frame larger than a slice.
    pending: Bytes,
    taken_all: Arc<AtomicBool>,
}

impl Outgoing {
    /// Small enough that hyper takes the body a few slices ahead of the socket, not all at
    /// once; large enough that a request body of the usual size is one frame.
    const SLICE: usize = 64 * 1024;

    fn new(inner: Body) -> Self {
        Self {
            // An empty body is never polled: it is all taken from the start.
            taken_all: Arc::new(AtomicBool::new(inner.is_end_stream())),
            inner,
            pending: Bytes::new(),
        }
    }

    fn slice(&mut self, mut data: Bytes) -> Bytes {
        if data.len() > Self::SLICE {
            self.pending = data.split_off(Self::SLICE);
        }
        if self.pending.is_empty() && self.inner.is_end_stream() {
            self.taken_all.store(true, Ordering::Release);
        }
        data
    }
}

impl http_body::Body for Outgoing {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if !this.pending.is_empty() {
            let rest = std::mem::take(&mut this.pending);
            return Poll::Ready(Some(Ok(Frame::data(this.slice(rest)))));
        }
        match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            None => {
                this.taken_all.store(true, Ordering::Release);
                Poll::Ready(None)
            }
            Some(Ok(frame)) => Poll::Ready(Some(Ok(match frame.into_data() {
                Ok(data) => Frame::data(this.slice(data)),
                Err(frame) => frame,
            }))),
            Some(Err(e)) => Poll::Ready(Some(Err(e))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.pending.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let mut hint = self.inner.size_hint();
        let pending = self.pending.len() as u64;
        hint.set_lower(hint.lower() + pending);
        if let Some(upper) = hint.upper() {
            hint.set_upper(upper + pending);
        }
        hint
    }
}

/// How an exchange failed before a complete response arrived. Each keeps the transport's
/// own error as its source; the display is the whole chain on one line, for attempt records
/// and logs (never for a client).
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    /// No connection could be made: the request was certainly not delivered.
    #[error("connect: {}", chain(.0.as_ref()))]
    Connect(#[source] BoxError),
    /// The connection broke while the request was still being sent.
    #[error("request not sent: {}", chain(.0.as_ref()))]
    NotSent(#[source] BoxError),
    /// The request was sent and the connection broke before any response byte.
    #[error("connection reset before a response: {}", chain(.0.as_ref()))]
    Reset(#[source] BoxError),
    /// The response started and then broke: the provider did the work, or some of it.
    #[error("response broken: {}", chain(.0.as_ref()))]
    Broken(#[source] BoxError),
}

impl Upstream {
    pub fn new(providers: &[Arc<Provider>]) -> Self {
        let clients = providers.iter().map(|p| client_for(p)).collect();
        Self::with_transport(Arc::new(Hyper { clients }))
    }

    pub fn with_transport(transport: Arc<dyn Transport>) -> Self {
        Self { transport }
    }

    /// Sends `request` to provider `index`; the answer's body is still to be read.
    pub async fn send(
        &self,
        index: usize,
        request: Request<Body>,
    ) -> Result<Response<Body>, CallError> {
        self.transport.send(index, request).await
    }
}

/// How much of an answer's body was read.
#[derive(Debug)]
pub enum Read {
    /// All of it.
    Whole(Bytes),
    /// More than the limit: what was read so far, in chunks; the rest is still in the body.
    Over(Vec<Bytes>),
}

/// Reads a body up to `limit` bytes, calling `on_first_byte` when its first byte arrives
/// (hedging counts silence until then).
pub async fn read_body(
    body: &mut Body,
    limit: usize,
    on_first_byte: impl FnOnce(),
) -> Result<Read, CallError> {
    let mut chunks: Vec<Bytes> = Vec::new();
    let mut len = 0;
    let mut on_first_byte = Some(on_first_byte);
    while let Some(data) = next_data(body).await? {
        if let Some(f) = on_first_byte.take() {
            f();
        }
        len += data.len();
        chunks.push(data);
        if len > limit {
            return Ok(Read::Over(chunks));
        }
    }
    let mut whole = BytesMut::with_capacity(len);
    for chunk in chunks {
        whole.extend_from_slice(&chunk);
    }
    Ok(Read::Whole(whole.freeze()))
}

/// The next non-empty data chunk of a body, `None` at its end. A body that breaks off after
/// the response started is [`CallError::Broken`]: the provider did (some of) the work.
pub async fn next_data(body: &mut Body) -> Result<Option<Bytes>, CallError> {
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(CallError::Broken)?;
        if let Ok(data) = frame.into_data() {
            if !data.is_empty() {
                return Ok(Some(data));
            }
        }
    }
    Ok(None)
}

/// An answer's headers as kept: hop-by-hop ones and those in `also` dropped, the others in
/// the order the provider sent them (filtered, not removed, since a removal from a
/// `HeaderMap` moves its last header into the gap), copied out of the connection's read
/// buffer, which they would otherwise pin.
pub fn kept_headers(headers: &HeaderMap, also: &[HeaderName]) -> crate::job::Headers {
    crate::job::Headers::from_pairs(
        headers::end_to_end(headers)
            .filter(|(name, _)| !also.contains(name))
            .map(|(name, value)| (name.as_str(), value.as_bytes())),
    )
}

fn client_for(provider: &Provider) -> HttpsClient {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(provider.connect_timeout));
    http.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
        .expect("ring supports the default TLS versions")
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http);
    Client::builder(TokioExecutor::new()).build(https)
}

/// What a failed exchange means; `taken_all`: whether hyper took the whole request body.
fn classify(error: hyper_util::client::legacy::Error, taken_all: bool) -> CallError {
    if error.is_connect() {
        return CallError::Connect(error.into());
    }
    let mut source = error.source();
    let mut not_sent = !taken_all;
    while let Some(e) = source {
        if let Some(e) = e.downcast_ref::<hyper::Error>() {
            // Canceled: the pooled connection closed before the request went out. A failed
            // body write: the connection broke while the request was still being sent.
            // (hyper has no predicate for the latter; its kind shows in its message.)
            not_sent |= e.is_canceled()
                || e.is_body_write_aborted()
                || e.to_string()
                    .starts_with("error writing a body to connection");
            break;
        }
        source = e.source();
    }
    if not_sent {
        CallError::NotSent(error.into())
    } else {
        CallError::Reset(error.into())
    }
}

/// An error and its causes on one line, for attempt records and logs.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

/// A client's headers as a provider gets them (SPEC §11): the client's credential headers
/// removed unless the provider forwards client credentials, then the provider's own headers
/// set, each replacing the client's header of the same name.
pub fn set_provider_headers(
    headers: &mut HeaderMap,
    provider: &Provider,
    credentials: &[HeaderName],
) {
    if !provider.forward_client_credentials {
        for name in credentials {
            headers.remove(name);
        }
    }
    for (name, value) in &provider.headers {
        headers.insert(name.clone(), value.clone());
    }
}

/// The parts of a client request that every attempt re-sends.
#[derive(Debug)]
pub struct ClientRequest {
    pub method: Method,
    pub path_and_query: String,
    /// As the client sent them: what must not cross the gateway is dropped from each
    /// provider's copy, so a request that is only replayed never pays for it.
    pub headers: HeaderMap,
    pub body: Bytes,
    /// The client's credential headers, kept from providers that use their own.
    pub credentials: Arc<[HeaderName]>,
    /// The route's idempotency key header, which is the gateway's, not the provider's.
    key_header: HeaderName,
}

impl ClientRequest {
    pub fn new(
        method: Method,
        path_and_query: String,
        headers: HeaderMap,
        body: Bytes,
        key_header: &HeaderName,
    ) -> Self {
        Self {
            method,
            path_and_query,
            headers,
            body,
            credentials: Arc::new([]),
            key_header: key_header.clone(),
        }
    }

    /// The request for `provider`: its base URL, its headers, its `body_set` overrides, and
    /// the job id as `Idempotency-Key` so a provider that dedupes can do so too. Hop-by-hop
    /// headers, `Host` and `Content-Length` (recomputed) and the client's own idempotency
    /// key do not cross.
    /// The client's `Content-Type`, when it is text.
    pub fn content_type(&self) -> Option<&str> {
        self.headers
            .get(http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
    }

    pub fn for_provider(&self, provider: &Provider, job_id: Option<&str>) -> Request<Body> {
        // Built in one pass over the client's headers, in their order, instead of a copy of
        // the whole map with a hashed removal of every name that must not cross.
        let credentials: &[HeaderName] = if provider.forward_client_credentials {
            &[]
        } else {
            &self.credentials
        };
        let mut headers = HeaderMap::with_capacity(self.headers.len() + provider.headers.len() + 1);
        for (name, value) in headers::end_to_end(&self.headers) {
            let gateways_own = name == http::header::HOST
                || name == http::header::CONTENT_LENGTH
                || *name == self.key_header
                || name == headers::IDEMPOTENCY_KEY
                || credentials.contains(name);
            if !gateways_own {
                headers.append(name.clone(), value.clone());
            }
        }
        for (name, value) in &provider.headers {
            headers.insert(name.clone(), value.clone());
        }
        if let Some(id) = job_id.and_then(|id| HeaderValue::from_str(id).ok()) {
            headers.insert(headers::IDEMPOTENCY_KEY, id);
        }
        let body = apply_body_set(&self.body, &provider.body_set);
        let mut request = Request::new(body::full(body));
        *request.method_mut() = self.method.clone();
        *request.uri_mut() = provider_uri(provider, &self.path_and_query);
        *request.headers_mut() = headers;
        request
    }
}

/// `base_url` joined with the client's path and query: `https://h/api` + `/v1/x?y`.
pub fn provider_uri(provider: &Provider, path_and_query: &str) -> Uri {
    let mut parts = provider.base_url.clone().into_parts();
    let joined = format!("{}{}", provider.base_path, path_and_query);
    parts.path_and_query = Some(
        joined
            .parse()
            .unwrap_or_else(|_| http::uri::PathAndQuery::from_static("/")),
    );
    Uri::from_parts(parts).expect("scheme and authority come from a valid base URL")
}

fn apply_body_set(body: &Bytes, set: &serde_json::Map<String, serde_json::Value>) -> Bytes {
    if set.is_empty() {
        return body.clone();
    }
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut map)) => {
            for (k, v) in set {
                map.insert(k.clone(), v.clone());
            }
            Bytes::from(serde_json::to_vec(&map).expect("a JSON map serialises"))
        }
        // Only JSON objects have fields to override; anything else goes as it came.
        _ => body.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn provider(base: &str) -> Provider {
        let config = crate::config::Config::parse(
            &format!(
                r#"
                [[providers]]
                name = "p"
                base_url = "{base}"
                headers = {{ Authorization = "Bearer provider-key" }}
                body_set = {{ model = "other-model" }}
                [[routes]]
                name = "r"
                providers = ["p"]
                "#
            ),
            "t",
        )
        .unwrap();
        (*config.providers[0]).clone()
    }

    /// A header map of `pairs`, in order, repeated names appended.
    fn header_map(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn requests_are_rewritten_for_the_provider() {
        let h = header_map(&[
            ("authorization", "Bearer client"),
            ("idempotency-key", "k1"),
            ("connection", "keep-alive"),
            ("content-length", "20"),
            ("x-trace", "t"),
        ]);
        let req = ClientRequest::new(
            Method::POST,
            "/v1/chat?x=1".into(),
            h,
            Bytes::from_static(br#"{"model":"gpt","n":1}"#),
            &HeaderName::from_static("idempotency-key"),
        );
        let out = req.for_provider(&provider("https://example.com/api/"), Some("job_9"));
        assert_eq!(out.uri(), "https://example.com/api/v1/chat?x=1");
        assert_eq!(out.headers()["authorization"], "Bearer provider-key");
        assert_eq!(out.headers()["idempotency-key"], "job_9");
        assert_eq!(out.headers()["x-trace"], "t");
        assert!(!out.headers().contains_key("connection"));
        assert!(!out.headers().contains_key("content-length"));
        let body = apply_body_set(&req.body, &provider("http://x").body_set);
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["model"], "other-model");
        assert_eq!(v["n"], 1);
        assert_eq!(
            apply_body_set(&Bytes::from_static(b"raw"), &provider("http://x").body_set),
            "raw"
        );
    }

    /// The frames `outgoing` yields, each with whether the whole body counted as taken
    /// right after it, and the size hint before the first.
    async fn frames_of(mut outgoing: Outgoing) -> (Option<u64>, Vec<(usize, bool)>) {
        let exact = outgoing.size_hint().exact();
        let mut frames = Vec::new();
        while let Some(frame) = outgoing.frame().await {
            let data = frame.unwrap().into_data().unwrap();
            frames.push((data.len(), outgoing.taken_all.load(Ordering::Acquire)));
        }
        assert!(outgoing.taken_all.load(Ordering::Acquire));
        (exact, frames)
    }

    #[tokio::test]
    async fn a_large_request_body_is_taken_in_slices_and_counts_as_sent_at_its_last() {
        let big = Outgoing::new(body::full(vec![7u8; 150 * 1024]));
        assert!(!big.taken_all.load(Ordering::Acquire));
        assert_eq!(
            frames_of(big).await,
            (
                Some(150 * 1024),
                vec![(64 * 1024, false), (64 * 1024, false), (22 * 1024, true)]
            )
        );
        let small = Outgoing::new(body::full(vec![7u8; 600]));
        assert_eq!(frames_of(small).await, (Some(600), vec![(600, true)]));
        // hyper never polls an empty body: it is sent as soon as the head is.
        let empty = Outgoing::new(body::full(Bytes::new()));
        assert!(empty.taken_all.load(Ordering::Acquire));
        assert_eq!(frames_of(empty).await, (Some(0), vec![]));
    }

    #[test]
    fn a_provider_request_keeps_the_clients_header_order_without_the_gateways_own() {
        let h = header_map(&[
            ("x-first", "1"),
            ("host", "gateway.example"),
            ("x-api-key", "client-key"),
            ("x-second", "2"),
            ("idempotency-key", "k1"),
            ("x-third", "3"),
            ("content-length", "2"),
            ("x-fourth", "4"),
        ]);
        let mut req = ClientRequest::new(
            Method::POST,
            "/v1/chat".into(),
            h,
            Bytes::from_static(b"{}"),
            &HeaderName::from_static("idempotency-key"),
        );
        req.credentials = Arc::new([HeaderName::from_static("x-api-key")]);
        let names = |provider: &Provider| -> Vec<String> {
            req.for_provider(provider, Some("job_9"))
                .headers()
                .keys()
                .map(|name| name.as_str().to_owned())
                .collect()
        };
        let mut own = provider("https://example.com/");
        assert_eq!(
            names(&own),
            [
                "x-first",
                "x-second",
                "x-third",
                "x-fourth",
                "authorization",
                "idempotency-key"
            ]
        );
        own.forward_client_credentials = true;
        assert_eq!(
            names(&own),
            [
                "x-first",
                "x-api-key",
                "x-second",
                "x-third",
                "x-fourth",
                "authorization",
                "idempotency-key"
            ]
        );
    }

    #[test]
    fn an_answers_headers_are_kept_in_the_providers_order_without_hop_by_hop_or_named_ones() {
        let h = header_map(&[
            ("content-type", "application/json"),
            ("set-cookie", "a=1"),
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "dropped"),
            ("x-drop", "dropped too"),
            ("x-empty", ""),
            ("set-cookie", "b=2"),
            ("x-request-id", "req_1"),
        ]);
        let kept: Vec<(String, Bytes)> = kept_headers(&h, &[HeaderName::from_static("x-drop")])
            .iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect();
        let expected: Vec<(String, Bytes)> = [
            ("content-type", "application/json"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("x-empty", ""),
            ("x-request-id", "req_1"),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), Bytes::from_static(v.as_bytes())))
        .collect();
        assert_eq!(kept, expected);
    }
}
