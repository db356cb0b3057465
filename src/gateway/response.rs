//! An engine's [`Outcome`] as an HTTP response. The first answer and every replay are built
//! from the same stored bytes by [`answer`], so they cannot drift apart.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};

use crate::body::{self, Body};
use crate::engine::Outcome;
use crate::error::Problem;
use crate::headers;
use crate::job::StoredResponse;
use crate::store::JobStore;
use crate::stream;

pub(super) fn respond(outcome: Outcome, store: &std::sync::Arc<dyn JobStore>) -> Response<Body> {
    match outcome {
        Outcome::Answer {
            job_id,
            response,
            n,
            provider,
            replayed,
            head,
        } => match head {
            Some(head) => {
                // Kept as a clone, which is sized to its headers: the map an answer is built
                // in has room reserved for more.
                let headers = head.get_or_init(|| {
                    answer(job_id.as_deref(), &response, Some((n, &provider)), replayed)
                        .headers()
                        .clone()
                });
                let mut response = with_body(&response);
                *response.headers_mut() = headers.clone();
                response
            }
            None => answer(job_id.as_deref(), &response, Some((n, &provider)), replayed),
        },
        Outcome::Stream {
            job_id,
            live,
            joined,
        } => {
            let head = head(live.status, live.headers.clone());
            let mut response = answer(
                job_id.as_deref(),
                &head,
                Some((live.n, &live.provider)),
                joined,
            );
            *response.body_mut() = live.recording.body(!joined);
            response
        }
        Outcome::Follow { job_id, mirror } => {
            let head_of = head(mirror.head.status, mirror.head.headers.clone());
            let attempt = (mirror.head.n, mirror.head.provider.clone());
            let mut response = answer(Some(&job_id), &head_of, Some((attempt.0, &attempt.1)), true);
            *response.body_mut() = stream::follow(store.clone(), job_id, mirror);
            response
        }
        Outcome::Refused { job_id, cause } => Problem::from(cause)
            .maybe_job(job_id.as_deref())
            .into_response(),
    }
}

fn head(status: u16, headers: crate::job::Headers) -> StoredResponse {
    StoredResponse {
        status,
        headers,
        body: Bytes::new(),
        body_omitted: false,
    }
}

/// A stored answer as an HTTP response, with the gateway's headers.
fn answer(
    job_id: Option<&str>,
    stored: &StoredResponse,
    attempt: Option<(u32, &str)>,
    replayed: bool,
) -> Response<Body> {
    let mut response = with_body(stored);
    let headers = response.headers_mut();
    // Sized once for the provider's headers, the gateway's four and the request id, instead
    // of grown (and rehashed) on the way through an answer's twenty.
    headers.reserve(stored.headers.len() + 5);
    for (name, value) in stored.headers.iter() {
        if let (Some(name), Ok(value)) = (
            super::names::header_name(name),
            HeaderValue::from_maybe_shared(value),
        ) {
            headers.append(name, value);
        }
    }
    if let Some(id) = job_id.and_then(|id| HeaderValue::from_str(id).ok()) {
        headers.insert(headers::JOB_ID, id);
    }
    if let Some((n, provider)) = attempt {
        headers.insert(headers::ATTEMPT, attempt_value(n));
        if let Ok(provider) = HeaderValue::from_str(provider) {
            headers.insert(headers::PROVIDER, provider);
        }
    }
    headers.insert(
        headers::REPLAYED,
        HeaderValue::from_static(if replayed { "true" } else { "false" }),
    );
    response
}

/// A stored answer's status and body, without headers yet.
fn with_body(stored: &StoredResponse) -> Response<Body> {
    let mut response = Response::new(body::full(stored.body.clone()));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::BAD_GATEWAY);
    response
}

/// An attempt's ordinal as a header value. Nearly every answer comes from attempt 1 to 9,
/// and those are static: `HeaderValue::from(n)` formats into a buffer of its own, two
/// allocations on every answer and replay.
fn attempt_value(n: u32) -> HeaderValue {
    const ORDINALS: [&str; 10] = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
    match ORDINALS.get(n as usize) {
        Some(text) => HeaderValue::from_static(text),
        None => HeaderValue::from(n),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_ordinal_is_written_in_decimal() {
        for n in (0..=12).chain([99, 100, 12_345, u32::MAX]) {
            assert_eq!(
                attempt_value(n).to_str().unwrap(),
                n.to_string(),
                "attempt {n}"
            );
        }
    }
}
