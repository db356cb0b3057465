//! The client's request body: read at most once, as late as possible, within bounds.

use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http_body_util::BodyExt;

use crate::body::{self, Body};
use crate::error::Cause;

/// The client's body, unread until something needs it (a model glob, the fingerprint).
pub(super) enum PendingBody {
    Unread(Body),
    Read(Bytes),
}

impl PendingBody {
    /// The whole body, at most `limit` bytes; read once, then kept.
    pub(super) async fn read(&mut self, parts: &Parts, limit: usize) -> Result<Bytes, Cause> {
        let body = match std::mem::replace(self, Self::Read(Bytes::new())) {
            Self::Read(bytes) => {
                *self = Self::Read(bytes.clone());
                return Ok(bytes);
            }
            Self::Unread(body) => body,
        };
        let declared = parts
            .headers
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        let mut body = body;
        if declared.is_some_and(|len| len > limit as u64) {
            drain(body).await;
            return Err(Cause::TooLarge { limit });
        }
        let mut buf = bytes::BytesMut::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| Cause::UnreadableBody)?;
            if let Ok(data) = frame.into_data() {
                if buf.len() + data.len() > limit {
                    drain(body).await;
                    return Err(Cause::TooLarge { limit });
                }
                buf.extend_from_slice(&data);
            }
        }
        let bytes = buf.freeze();
        *self = Self::Read(bytes.clone());
        Ok(bytes)
    }

    /// The body to forward as it is, read or not.
    pub(super) fn into_body(self) -> Body {
        match self {
            Self::Unread(body) => body,
            Self::Read(bytes) => body::full(bytes),
        }
    }
}

/// Reads and discards what is left of a refused body, within bounds, so the client gets to
/// read the 413 instead of a connection reset while it is still sending.
async fn drain(mut body: Body) {
    const MAX_DRAIN: usize = 64 * 1024 * 1024;
    let mut drained = 0;
    let _ = tokio::time::timeout(Duration::from_secs(2), async {
        while let Some(Ok(frame)) = body.frame().await {
            drained += frame.data_ref().map_or(0, Bytes::len);
            if drained > MAX_DRAIN {
                return;
            }
        }
    })
    .await;
}
