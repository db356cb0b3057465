//! The one place where the gateway's own errors become HTTP responses: typed causes in,
//! RFC 9457 `application/problem+json` bodies with the slugs of SPEC §7 out.
//!
//! Every problem is built here from a [`Cause`], so the texts a client reads are written
//! once, and a cause that carries an internal error (a store's, a bug's) is logged once with
//! its source and answered with a generic text: store errors, file paths and addresses never
//! reach a client's `detail`.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, StatusCode};
use serde::Serialize;
use tracing::{error, warn};

use crate::job::JobState;
use crate::store::StoreError;

/// How long a client should wait before asking again about a job in flight, or a store
/// that did not answer.
pub const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The header the OpenAI and Anthropic SDKs read before retrying on their own.
pub const SHOULD_RETRY: http::HeaderName = http::HeaderName::from_static("x-should-retry");

/// Every error the gateway itself answers with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProblemKind {
    MissingOwner,
    MissingIdempotencyKey,
    InvalidIdempotencyKey,
    PayloadTooLarge,
    IdempotencyKeyReused,
    RequestInProgress,
    /// 409 for a request that finds the job `unknown`.
    OutcomeUnknown,
    /// 504 for the request whose own attempt timed out.
    AttemptTimedOut,
    AllProvidersFailed,
    StoreUnavailable,
    NoRoute,
    Unauthorized,
    NotFound,
    AlreadySettled,
    /// The request could not be read at all (e.g. the client's body broke off).
    BadRequest,
    /// The job succeeded with an answer too large to keep for replay.
    ResponseNotStored,
    /// A bug: logged with its cause, nothing internal in the body.
    Internal,
    /// Two different credentials, or one owner header sent twice.
    AmbiguousOwner,
    /// The credential is not one of `[clients]`.
    UnknownClient,
    /// The client was too slow sending its head or body.
    RequestTimeout,
    /// A request head larger than the connection takes (`edge::conn::MAX_HEAD_BYTES`).
    HeadTooLarge,
    /// A request target longer than HTTP's parser takes.
    UriTooLong,
    /// Load shed: too many requests in flight, or too many body bytes buffered.
    Overloaded,
}

impl ProblemKind {
    pub fn slug(self) -> &'static str {
        match self {
            Self::MissingOwner => "missing-owner",
            Self::MissingIdempotencyKey => "missing-idempotency-key",
            Self::InvalidIdempotencyKey => "invalid-idempotency-key",
            Self::PayloadTooLarge => "payload-too-large",
            Self::IdempotencyKeyReused => "idempotency-key-reused",
            Self::RequestInProgress => "request-in-progress",
            Self::OutcomeUnknown | Self::AttemptTimedOut => "outcome-unknown",
            Self::AllProvidersFailed => "all-providers-failed",
            Self::StoreUnavailable => "store-unavailable",
            Self::NoRoute => "no-route",
            Self::Unauthorized => "unauthorized",
            Self::NotFound => "not-found",
            Self::AlreadySettled => "job-settled",
            Self::BadRequest => "bad-request",
            Self::ResponseNotStored => "response-not-stored",
            Self::Internal => "internal",
            Self::AmbiguousOwner => "ambiguous-owner",
            Self::UnknownClient => "unknown-client",
            Self::RequestTimeout => "request-timeout",
            Self::HeadTooLarge => "request-header-too-large",
            Self::UriTooLong => "uri-too-long",
            Self::Overloaded => "overloaded",
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingOwner | Self::Unauthorized | Self::UnknownClient => {
                StatusCode::UNAUTHORIZED
            }
            Self::MissingIdempotencyKey
            | Self::InvalidIdempotencyKey
            | Self::BadRequest
            | Self::AmbiguousOwner => StatusCode::BAD_REQUEST,
            Self::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::HeadTooLarge => StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            Self::UriTooLong => StatusCode::URI_TOO_LONG,
            Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::IdempotencyKeyReused
            | Self::RequestInProgress
            | Self::OutcomeUnknown
            | Self::AlreadySettled
            | Self::ResponseNotStored => StatusCode::CONFLICT,
            Self::AttemptTimedOut => StatusCode::GATEWAY_TIMEOUT,
            Self::AllProvidersFailed => StatusCode::BAD_GATEWAY,
            Self::StoreUnavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::NoRoute | Self::NotFound => StatusCode::NOT_FOUND,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// `x-should-retry`, the header the Stainless-generated SDKs obey: retrying with the same
    /// key can only help when the answer may change by itself.
    pub fn should_retry(self) -> bool {
        matches!(
            self,
            Self::RequestInProgress | Self::StoreUnavailable | Self::Overloaded
        )
    }

    fn title(self) -> &'static str {
        match self {
            Self::MissingOwner => "Missing owner",
            Self::MissingIdempotencyKey => "Missing idempotency key",
            Self::InvalidIdempotencyKey => "Invalid idempotency key",
            Self::PayloadTooLarge => "Payload too large",
            Self::IdempotencyKeyReused => "Idempotency key reused",
            Self::RequestInProgress => "Request in progress",
            Self::OutcomeUnknown | Self::AttemptTimedOut => "Outcome unknown",
            Self::AllProvidersFailed => "All providers failed",
            Self::StoreUnavailable => "Store unavailable",
            Self::NoRoute => "No route",
            Self::Unauthorized => "Unauthorized",
            Self::NotFound => "Not found",
            Self::AlreadySettled => "Job already settled",
            Self::BadRequest => "Bad request",
            Self::ResponseNotStored => "Response not stored",
            Self::Internal => "Internal error",
            Self::AmbiguousOwner => "Ambiguous owner",
            Self::UnknownClient => "Unknown client",
            Self::RequestTimeout => "Request timeout",
            Self::HeadTooLarge => "Request header too large",
            Self::UriTooLong => "URI too long",
            Self::Overloaded => "Overloaded",
        }
    }
}

/// Why the gateway answers with an error instead of a provider's answer.
#[derive(Debug)]
pub enum Cause {
    NoRoute {
        method: Method,
        path: String,
    },
    /// The request names no owner; what it lacks, for the detail.
    MissingOwner {
        wanted: String,
    },
    /// Why the idempotency key is not acceptable, as the key parser says it.
    InvalidKey(String),
    MissingKey {
        route: String,
        header: String,
    },
    TooLarge {
        limit: usize,
    },
    UnreadableBody,
    KeyReused,
    InProgress,
    /// The job is `unknown`: an earlier attempt may have run.
    Unknown,
    /// This request's own attempt timed out.
    TimedOut,
    /// No provider answered; the job (if any) is failed.
    AllFailed,
    /// The job was settled as failed by another request's round.
    Failed,
    /// The job was cancelled out of band while this request ran.
    Cancelled,
    /// The job succeeded with an answer too large to keep.
    NotStored,
    Store(StoreError),
    /// A pass-through provider did not answer within its timeout.
    UpstreamTimeout {
        provider: String,
        timeout: Duration,
    },
    /// A pass-through provider could not be reached.
    UpstreamUnreachable {
        provider: String,
    },
    /// A provider was called but its answer could not be written to the store.
    Unrecorded(StoreError),
    /// A bug; the text is logged, never sent.
    Internal(String),
    /// Two credentials that differ, or an owner header sent more than once.
    AmbiguousOwner(&'static str),
    UnknownClient,
    /// The client did not send its whole body within `request_body_timeout`.
    BodyTimeout,
    /// The client did not send its request head within `request_header_timeout`.
    HeadTimeout,
    /// A request head that is not HTTP, answered by the connection before any route.
    MalformedHead,
    /// More bytes than the connection takes, or more header fields than hyper parses.
    HeadTooLarge {
        limit: usize,
        fields: usize,
    },
    UriTooLong,
    /// Too many requests in flight, or too many body bytes buffered.
    Overloaded,
    // The admin API's.
    Unauthorized {
        configured: bool,
    },
    NotFound(String),
    AlreadySettled(JobState),
    BadQuery(&'static str),
}

/// A gateway error on its way to the client.
#[derive(Clone, Debug)]
pub struct Problem {
    pub kind: ProblemKind,
    pub detail: String,
    pub job_id: Option<String>,
    pub retry_after: Option<Duration>,
}

#[derive(Serialize)]
struct Body<'a> {
    #[serde(rename = "type")]
    kind: String,
    title: &'a str,
    status: u16,
    detail: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    job_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    request_id: Option<String>,
    /// The shape the OpenAI and Anthropic SDKs read their exception's message from.
    error: SdkError<'a>,
}

#[derive(Serialize)]
struct SdkError<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    code: &'static str,
}

tokio::task_local! {
    /// The id of the request being served (SPEC §11), set by the client edge for the whole
    /// request, so every problem names it wherever it is built.
    pub static REQUEST_ID: http::HeaderValue;
}

impl From<Cause> for Problem {
    fn from(cause: Cause) -> Self {
        use ProblemKind as K;
        let (kind, detail): (ProblemKind, String) = match cause {
            Cause::NoRoute { method, path } => (K::NoRoute, format!("no route matches {method} {path}")),
            Cause::MissingOwner { wanted } => (
                K::MissingOwner,
                format!("{wanted} is required: an idempotency key belongs to its owner"),
            ),
            Cause::InvalidKey(why) => (K::InvalidIdempotencyKey, why),
            Cause::MissingKey { route, header } => (
                K::MissingIdempotencyKey,
                format!("route {route:?} requires an {header} header"),
            ),
            Cause::TooLarge { limit } => (
                K::PayloadTooLarge,
                format!("the request body is larger than {limit} bytes"),
            ),
            Cause::UnreadableBody => (
                K::BadRequest,
                "the request body could not be read: the connection broke off".into(),
            ),
            Cause::KeyReused => (
                K::IdempotencyKeyReused,
                "this idempotency key was used for a different request (method, path or body)".into(),
            ),
            Cause::InProgress => (
                K::RequestInProgress,
                "a request with this idempotency key is still running".into(),
            ),
            Cause::Unknown => (
                K::OutcomeUnknown,
                "an earlier attempt of this job may have run; no new attempt is made until it settles or is cancelled".into(),
            ),
            Cause::TimedOut => (
                K::AttemptTimedOut,
                "the provider did not answer in time; the request may have run. The job is unknown until its late answer lands or it is cancelled".into(),
            ),
            Cause::AllFailed => (
                K::AllProvidersFailed,
                "no provider answered; the job is failed and a retry with the same key opens a new round".into(),
            ),
            Cause::Failed => (
                K::AllProvidersFailed,
                "the job failed; a retry with the same key opens a new round".into(),
            ),
            Cause::Cancelled => (
                K::OutcomeUnknown,
                "the job was cancelled out of band while this request ran; a retry opens a new round".into(),
            ),
            Cause::NotStored => (
                K::ResponseNotStored,
                "the answer was larger than max_stored_response_bytes: it reached the request that ran the job but is not kept for replay; the job will not run again".into(),
            ),
            Cause::Store(e) => {
                warn!(error = %e, source = ?std::error::Error::source(&e), "store unavailable");
                let detail = match e {
                    StoreError::NotFound(_) => "the job is no longer in the store",
                    StoreError::Unavailable { .. } => {
                        "the job store is unavailable; retry with the same key later"
                    }
                };
                return Self::new(K::StoreUnavailable, detail).retry_after(RETRY_AFTER);
            }
            Cause::UpstreamTimeout { provider, timeout } => (
                K::AttemptTimedOut,
                format!("provider {provider:?} did not answer within {timeout:?}"),
            ),
            Cause::UpstreamUnreachable { provider } => (
                K::AllProvidersFailed,
                format!("provider {provider:?} could not be reached"),
            ),
            Cause::Unrecorded(e) => {
                warn!(error = %e, "a provider answered but the store could not record it");
                return Self::new(
                    K::StoreUnavailable,
                    "a provider was called but the job store could not record its answer; the job will turn unknown when its lease lapses and is never run again",
                )
                .retry_after(RETRY_AFTER);
            }
            Cause::AmbiguousOwner(why) => (K::AmbiguousOwner, why.into()),
            Cause::UnknownClient => (
                K::UnknownClient,
                "this credential is not allowed to use the gateway".into(),
            ),
            Cause::BodyTimeout => (
                K::RequestTimeout,
                "the request body did not arrive in time".into(),
            ),
            Cause::HeadTimeout => (
                K::RequestTimeout,
                "the request head did not arrive in time".into(),
            ),
            Cause::MalformedHead => (
                K::BadRequest,
                "the request head is not valid HTTP/1.1".into(),
            ),
            Cause::HeadTooLarge { limit, fields } => (
                K::HeadTooLarge,
                format!("the request head (request line and headers) is larger than {limit} bytes or has more than {fields} header fields"),
            ),
            Cause::UriTooLong => (
                K::UriTooLong,
                "the request target is longer than 65 534 bytes".into(),
            ),
            Cause::Overloaded => {
                return Self::new(
                    K::Overloaded,
                    "the gateway is at its limit of requests in flight; retry shortly",
                )
                .retry_after(RETRY_AFTER);
            }
            Cause::Internal(what) => {
                error!(cause = %what, "internal error");
                (K::Internal, "an internal error occurred; it has been logged".into())
            }
            Cause::Unauthorized { configured: false } => (
                K::Unauthorized,
                "the admin token is not configured (see server.admin_token_env)".into(),
            ),
            Cause::Unauthorized { configured: true } => (
                K::Unauthorized,
                "a valid admin bearer token is required".into(),
            ),
            Cause::NotFound(what) => (K::NotFound, what),
            Cause::AlreadySettled(state) => (K::AlreadySettled, format!("the job is already {state}")),
            Cause::BadQuery(why) => (K::BadRequest, why.into()),
        };
        let problem = Self::new(kind, detail);
        if kind == K::RequestInProgress {
            problem.retry_after(RETRY_AFTER)
        } else {
            problem
        }
    }
}

impl Problem {
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind,
            detail: detail.into(),
            job_id: None,
            retry_after: None,
        }
    }

    pub fn job(mut self, job_id: impl Into<String>) -> Self {
        self.job_id = Some(job_id.into());
        self
    }

    /// Names the job when there is one.
    pub fn maybe_job(self, job_id: Option<&str>) -> Self {
        match job_id {
            Some(id) => self.job(id),
            None => self,
        }
    }

    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    pub fn status(&self) -> StatusCode {
        self.kind.status()
    }

    /// The JSON body, `urn:idemgate:<slug>` typed.
    pub fn body(&self) -> Bytes {
        let body = Body {
            kind: format!("urn:idemgate:{}", self.kind.slug()),
            title: self.kind.title(),
            status: self.kind.status().as_u16(),
            detail: &self.detail,
            job_id: self.job_id.as_deref(),
            request_id: REQUEST_ID
                .try_with(|id| id.to_str().unwrap_or_default().to_owned())
                .ok(),
            error: SdkError {
                message: &self.detail,
                kind: self.kind.slug(),
                code: self.kind.slug(),
            },
        };
        Bytes::from(serde_json::to_vec(&body).expect("a problem always serialises"))
    }

    pub fn into_response(self) -> http::Response<crate::body::Body> {
        let mut response = http::Response::new(crate::body::full(self.body()));
        *response.status_mut() = self.status();
        // Lets the request counter tell outcomes apart without parsing the body.
        response.extensions_mut().insert(self.kind);
        let headers = response.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        headers.insert(
            SHOULD_RETRY,
            HeaderValue::from_static(if self.kind.should_retry() {
                "true"
            } else {
                "false"
            }),
        );
        if let Some(after) = self.retry_after {
            headers.insert(
                http::header::RETRY_AFTER,
                HeaderValue::from(after.as_secs().max(1)),
            );
        }
        if let Some(id) = &self.job_id {
            if let Ok(v) = HeaderValue::from_str(id) {
                headers.insert(crate::headers::JOB_ID, v);
            }
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_rfc9457_with_the_spec_slugs() {
        let p = Problem::from(Cause::TimedOut).job("job_1");
        let v: serde_json::Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(v["type"], "urn:idemgate:outcome-unknown");
        assert_eq!(v["status"], 504);
        assert_eq!(v["job_id"], "job_1");
        let r = Problem::from(Cause::InProgress).into_response();
        assert_eq!(r.status(), 409);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert_eq!(r.headers()["retry-after"], "1");
        let v: serde_json::Value = serde_json::from_slice(
            &Problem::from(Cause::NoRoute {
                method: Method::POST,
                path: "/x".into(),
            })
            .body(),
        )
        .unwrap();
        assert!(v.get("job_id").is_none());
    }

    #[test]
    fn every_slug_says_whether_an_sdk_should_retry_it() {
        use ProblemKind as K;
        let table = [
            (K::MissingOwner, "missing-owner", 401, false),
            (
                K::MissingIdempotencyKey,
                "missing-idempotency-key",
                400,
                false,
            ),
            (
                K::InvalidIdempotencyKey,
                "invalid-idempotency-key",
                400,
                false,
            ),
            (K::PayloadTooLarge, "payload-too-large", 413, false),
            (
                K::IdempotencyKeyReused,
                "idempotency-key-reused",
                409,
                false,
            ),
            (K::RequestInProgress, "request-in-progress", 409, true),
            (K::OutcomeUnknown, "outcome-unknown", 409, false),
            (K::AttemptTimedOut, "outcome-unknown", 504, false),
            (K::AllProvidersFailed, "all-providers-failed", 502, false),
            (K::StoreUnavailable, "store-unavailable", 503, true),
            (K::NoRoute, "no-route", 404, false),
            (K::Unauthorized, "unauthorized", 401, false),
            (K::AmbiguousOwner, "ambiguous-owner", 400, false),
            (K::UnknownClient, "unknown-client", 401, false),
            (K::RequestTimeout, "request-timeout", 408, false),
            (K::Overloaded, "overloaded", 503, true),
            (K::Internal, "internal", 500, false),
        ];
        for (kind, slug, status, retry) in table {
            let response = Problem::new(kind, "why").into_response();
            assert_eq!(response.status(), status, "{slug}");
            assert_eq!(
                response.headers()["x-should-retry"],
                if retry { "true" } else { "false" },
                "{slug}"
            );
            let body: serde_json::Value =
                serde_json::from_slice(&Problem::new(kind, "why").body()).unwrap();
            assert_eq!(body["type"], format!("urn:idemgate:{slug}"));
            assert_eq!(body["error"]["message"], "why", "{slug}");
            assert_eq!(body["error"]["type"], slug);
            assert_eq!(body["error"]["code"], slug);
        }
    }

    #[test]
    fn internal_causes_never_reach_the_detail() {
        let store = StoreError::unavailable(
            "redis",
            std::io::Error::other("connection refused to 10.1.2.3:6379 (/var/lib/x)"),
        );
        let p = Problem::from(Cause::Store(store));
        assert_eq!(p.kind, ProblemKind::StoreUnavailable);
        assert!(!p.detail.contains("10.1.2.3") && !p.detail.contains("/var"));
        assert_eq!(p.retry_after, Some(RETRY_AFTER));
        let p = Problem::from(Cause::Internal("panicked at src/x.rs:1".into()));
        assert_eq!(p.status(), 500);
        assert!(!p.detail.contains("src/x.rs"));
    }
}
