//! Header rules: the gateway's own response headers, and the hop-by-hop headers that never
//! cross it in either direction (RFC 9110 §7.6.1).

use http::header::{self, HeaderMap, HeaderName};

pub const JOB_ID: HeaderName = HeaderName::from_static("x-idempotency-job-id");
pub const ATTEMPT: HeaderName = HeaderName::from_static("x-idempotency-attempt");
pub const PROVIDER: HeaderName = HeaderName::from_static("x-idempotency-provider");
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `false` on a keyed request that an `off` route served without a job.
pub const KEY_HONOURED: HeaderName = HeaderName::from_static("idempotency-key-honoured");
pub const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

const HOP_BY_HOP: [HeaderName; 8] = [
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

/// Removes every hop-by-hop header in place.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let listed = connection_listed(headers);
    // One pass over the handful of headers there are, instead of a hashed removal of every
    // name that might be there (ten lookups per request and per answer).
    let present: Vec<HeaderName> = headers
        .keys()
        .filter(|name| is_hop_by_hop(name, &listed))
        .cloned()
        .collect();
    for name in present {
        headers.remove(name);
    }
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
}
