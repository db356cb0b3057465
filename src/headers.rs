//! Header rules: the gateway's own response headers, and the hop-by-hop headers that never
//! cross it in either direction (RFC 9110 §7.6.1).

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

pub const JOB_ID: HeaderName = HeaderName::from_static("x-idempotency-job-id");
pub const ATTEMPT: HeaderName = HeaderName::from_static("x-idempotency-attempt");
pub const PROVIDER: HeaderName = HeaderName::from_static("x-idempotency-provider");
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `false` on a keyed request that an `off` route served without a job.
pub const KEY_HONOURED: HeaderName = HeaderName::from_static("idempotency-key-honoured");
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

// A `static`, not a `const`: a `const` array of `HeaderName`s is built, and dropped, at
// every use, and this one is read for every header of every request and answer.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// Whether `name` is hop-by-hop: one of the fixed set, or named by `Connection`.
pub fn is_hop_by_hop(name: &HeaderName, connection_listed: &[HeaderName]) -> bool {
    HOP_BY_HOP.contains(name) || name == "proxy-connection" || connection_listed.contains(name)
}

/// Headers listed in `Connection`, which are hop-by-hop for this message only.
pub fn connection_listed(headers: &HeaderMap) -> Vec<HeaderName> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect()
}

/// The headers that cross the gateway: all but the hop-by-hop ones, in their order.
pub fn end_to_end(headers: &HeaderMap) -> impl Iterator<Item = (&HeaderName, &HeaderValue)> {
    let listed = connection_listed(headers);
    headers
        .iter()
        .filter(move |(name, _)| !is_hop_by_hop(name, &listed))
}

/// Drops every hop-by-hop header, keeping the others in their order.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed = connection_listed(headers);
    // One pass over the handful of headers there are, instead of a hashed removal of every
    // name that might be there (ten lookups per request and per answer).
    if !headers.keys().any(|name| is_hop_by_hop(name, &listed)) {
        return;
    }
    // Rebuilt, not removed from: a removal from a `HeaderMap` moves its last header into the
    // gap, and a provider's answer is passed on with its headers as it sent them.
    let mut kept = HeaderMap::with_capacity(headers.len());
    kept.extend(end_to_end(headers).map(|(name, value)| (name.clone(), value.clone())));
    *headers = kept;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hop_by_hop_headers_and_connection_listed_ones_are_dropped() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, x-private".parse().unwrap());
        h.insert("x-private", "1".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("proxy-connection", "keep-alive".parse().unwrap());
        h.append(header::UPGRADE, "h2c".parse().unwrap());
        h.append(header::UPGRADE, "websocket".parse().unwrap());
        h.insert(header::CONTENT_TYPE, "application/json".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key(header::CONTENT_TYPE));
    }

    #[test]
    fn headers_left_after_stripping_keep_their_order() {
        let mut h = HeaderMap::new();
        h.append("x-first", "1".parse().unwrap());
        h.append(header::CONNECTION, "keep-alive".parse().unwrap());
        h.append("x-second", "2".parse().unwrap());
        h.append("set-cookie", "a".parse().unwrap());
        h.append("x-third", "3".parse().unwrap());
        h.append("set-cookie", "b".parse().unwrap());
        strip_hop_by_hop(&mut h);
        let left: Vec<(&str, &str)> = h
            .iter()
            .map(|(name, value)| (name.as_str(), value.to_str().unwrap()))
            .collect();
        assert_eq!(
            left,
            [
                ("x-first", "1"),
                ("x-second", "2"),
                ("set-cookie", "a"),
                ("set-cookie", "b"),
                ("x-third", "3"),
            ]
        );
    }
}
