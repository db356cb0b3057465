//! The one place where the gateway's own errors become HTTP responses: RFC 9457
//! `application/problem+json` bodies with the slugs of SPEC §7.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, StatusCode};
use serde::Serialize;

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
        }
    }

    pub fn status(self) -> StatusCode {
        match self {
            Self::MissingOwner | Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::MissingIdempotencyKey | Self::InvalidIdempotencyKey | Self::BadRequest => {
                StatusCode::BAD_REQUEST
            }
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
        }
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
        }
    }
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
        let p = Problem::new(ProblemKind::AttemptTimedOut, "timed out").job("job_1");
        let v: serde_json::Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(v["type"], "urn:idemgate:outcome-unknown");
        assert_eq!(v["status"], 504);
        assert_eq!(v["job_id"], "job_1");
        assert_eq!(v["detail"], "timed out");
        let r = Problem::new(ProblemKind::RequestInProgress, "wait")
            .retry_after(Duration::from_secs(2))
            .into_response();
        assert_eq!(r.status(), 409);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
        assert_eq!(r.headers()["retry-after"], "2");
        let v: serde_json::Value =
            serde_json::from_slice(&Problem::new(ProblemKind::NoRoute, "x").body()).unwrap();
        assert!(v.get("job_id").is_none());
    }
}
