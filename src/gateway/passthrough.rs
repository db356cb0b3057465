//! Safe methods and `idempotency = "off"` routes: a plain reverse proxy to the route's first
//! provider, streaming both ways, no job.

use http::request::Parts;
use http::{Request, Response};

use crate::body::Body;
use crate::config::{Config, Route};
use crate::error::Cause;
use crate::headers;
use crate::upstream::{provider_uri, Upstream};

use super::body::PendingBody;

/// Proxies the request as it is, but for its normalised `path_and_query` and the
/// provider's credentials in place of the client's.
pub(super) async fn pass_through(
    config: &Config,
    upstream: &Upstream,
    route: &Route,
    parts: Parts,
    path_and_query: &str,
    body: PendingBody,
) -> Result<Response<Body>, Cause> {
    let index = route.providers[0];
    let provider = config.provider(index);
    let mut headers = parts.headers;
    headers::strip_hop_by_hop(&mut headers);
    headers.remove(http::header::HOST);
    headers.remove(http::header::CONTENT_LENGTH);
    crate::upstream::set_provider_headers(
        &mut headers,
        provider,
        &config.idempotency.credential_headers,
    );
    let (body, body_late) = body.into_body();
    let mut request = Request::new(body);
    *request.method_mut() = parts.method;
    *request.uri_mut() = provider_uri(provider, path_and_query);
    *request.headers_mut() = headers;
    let response = tokio::time::timeout(provider.timeout, upstream.send(index, request))
        .await
        .map_err(|_| Cause::UpstreamTimeout {
            provider: provider.name.clone(),
            timeout: provider.timeout,
        })?
        .map_err(|e| {
            if body_late.load(std::sync::atomic::Ordering::SeqCst) {
                return Cause::BodyTimeout;
            }
            tracing::warn!(provider = %provider.name, error = %e, "pass-through call failed");
            Cause::UpstreamUnreachable {
                provider: provider.name.clone(),
            }
        })?;
    let (mut head, incoming) = response.into_parts();
    headers::strip_hop_by_hop(&mut head.headers);
    Ok(Response::from_parts(head, incoming))
}
