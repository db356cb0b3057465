//! Steps of a stream's mirror, written as a relay writes them.

use bytes::Bytes;
use idemgate::store::{StreamHead, StreamUpdate};

/// Attempt `n`'s head: a 200 with no headers, from provider `p`.
pub fn head(n: u32) -> StreamUpdate {
    StreamUpdate::Head(StreamHead {
        status: 200,
        headers: Default::default(),
        n,
        provider: "p".into(),
    })
}

/// Attempt `n`'s chunks `from`, `from + 1`, …, one per text.
pub fn chunks(n: u32, from: usize, texts: &[&'static str]) -> StreamUpdate {
    StreamUpdate::Chunks {
        n,
        from,
        chunks: texts
            .iter()
            .map(|t| Bytes::from_static(t.as_bytes()))
            .collect(),
    }
}

/// Attempt `n`'s end: clean, or cut for a reason.
pub fn end(n: u32, end: Result<(), &str>) -> StreamUpdate {
    StreamUpdate::End {
        n,
        end: end.map_err(str::to_owned),
    }
}
